"""Wrapped datasets through a real mount: a user class + Subset + DataLoader(shuffle=True,
num_workers=2) under `dlcachefs run` is replayed (prefetch, same bytes, bit-identical
training); a seeded generator gets the next epoch's log; a custom sampler is learned;
a script run without the launcher shows up as unannounced."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import requires_fuse
from test_t5_torch import make_images

pytest.importorskip("torchvision")
pytestmark = requires_fuse

TRAIN = r'''
import hashlib, io, json, random, sys
import numpy as np, torch
from PIL import Image
from torchvision import datasets

root, epochs, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]


def load_bytes(path):
    with open(path, "rb") as f:
        return f.read()


class Decode:
    def __call__(self, raw):
        img = Image.open(io.BytesIO(raw)).convert("RGB").resize((16, 16))
        x = torch.from_numpy(np.asarray(img).copy()).permute(2, 0, 1).float() / 255
        return x, hashlib.sha256(raw).hexdigest()


class Train(torch.utils.data.Dataset):
    """A user's wrapper: holds the ImageFolder in an attribute."""

    def __init__(self, root):
        self.base = datasets.ImageFolder(root, loader=load_bytes, transform=Decode())
        self.name = "train"

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        (x, digest), y = self.base[i]
        return x, y, digest, self.base.samples[i][0][len(self.base.root) + 1:]


class Shorter(Train):
    """A wrapper the hook cannot map (it hides the last sample)."""

    def __len__(self):
        return len(self.base) - 1


class Reversed(torch.utils.data.Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self):
        return self.n


class Files(torch.utils.data.Dataset):
    """A user's dataset with no ImageFolder in it: globbed files, kept as paths relative
    to the working directory."""

    def __init__(self, root):
        import glob, os
        paths = sorted(glob.glob(os.path.join(root, "*", "*.jpg")))
        self.files = [os.path.relpath(p) for p in paths]
        self.rels = [p[len(root) + 1:] for p in paths]
        self.classes = sorted({r.split("/")[0] for r in self.rels})

    def __len__(self):
        return len(self.files)

    def __getitem__(self, i):
        x, digest = Decode()(load_bytes(self.files[i]))
        return x, self.classes.index(self.rels[i].split("/")[0]), digest, self.rels[i]


torch.manual_seed(0)
full = Shorter(root) if mode == "filtered" else Files(root) if mode == "files" else Train(root)
keep = sorted(random.Random(1).sample(range(len(full)), k=len(full) * 3 // 4))
ds = torch.utils.data.Subset(full, keep)
g = torch.Generator()
g.manual_seed(7)


def make_loader():
    if mode == "gen-reseed":  # a new generator seeded the same way each epoch
        return torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, num_workers=2,
                                           generator=torch.Generator().manual_seed(7))
    if mode == "dist-noset":  # DistributedSampler.set_epoch never called: one order
        smp = torch.utils.data.DistributedSampler(ds, num_replicas=1, rank=0, seed=0)
        return torch.utils.data.DataLoader(ds, batch_size=16, sampler=smp, num_workers=2)
    if mode.startswith("gen"):
        return torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, num_workers=2,
                                           generator=g)
    if mode.startswith("custom"):
        return torch.utils.data.DataLoader(ds, batch_size=16, sampler=Reversed(len(ds)),
                                           num_workers=2)
    return torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, num_workers=2)


def sync(epoch):
    """DLC_SYNC=1 (under the launcher only): wait, outside the timed run of the training,
    for the mount to be where a slower training would find it: the replay worker ready
    before epoch 0, each epoch's opens all attributed after it. Tests that look at what
    the mount did with an epoch do not then depend on the machine's speed."""
    import os, time
    if not os.environ.get("DLC_SYNC"):
        return
    stats = os.path.join(root, ".dlcache", "stats")
    n = len(ds)

    def ok(st):
        s = st["streams"].get("default/0", {})
        if epoch < 0:
            return st.get("sampler_replay_ready")
        return s.get("position") == n and s.get("samples") == n

    for _ in range(1200):
        with open(stats) as f:
            if ok(json.load(f)):
                return
        time.sleep(0.05)
    raise SystemExit(f"the mount never reached epoch {epoch}'s end")


dl = make_loader()
sync(-1)
model = torch.nn.Sequential(torch.nn.Dropout(0.2), torch.nn.Linear(16 * 16 * 3, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
h = hashlib.sha256()
out = []
for epoch in range(epochs):
    if (mode.endswith("-new") or mode == "gen-reseed") and epoch:  # a new DataLoader
        dl = make_loader()
    seen = []
    for x, y, digest, rel in dl:
        seen += [[r, d, int(t)] for r, d, t in zip(rel, digest, y)]
        h.update(x.numpy().tobytes())
        loss = torch.nn.functional.cross_entropy(model(x.flatten(1)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    out.append(seen)
    sync(epoch)
h.update(torch.cat([p.detach().flatten() for p in model.parameters()]).numpy().tobytes())
print(json.dumps({"epochs": out, "digest": h.hexdigest()}))
'''


def _run(cmd: list[str], env: dict | None = None) -> dict:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                       env=None if env is None else {**os.environ, **env})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _launch(script: Path, root: Path, epochs: int, mode: str) -> list[str]:
    return [sys.executable, "-m", "dlcachefs.cli", "run", "--", sys.executable, str(script),
            str(root), str(epochs), mode]


def _same_training(script: Path, dataset: Path, m, epochs: int, mode: str,
                   env: dict | None = None) -> dict:
    """The script run on the dataset directly and on the mount under ``dlcachefs run``:
    the same samples in the same order, the same weights. Returns that training."""
    direct = _run([sys.executable, str(script), str(dataset), str(epochs), mode])
    hooked = _run(_launch(script, m.mnt, epochs, mode), env=env)
    assert hooked == direct
    return direct


def _stream_at(m, stream: str, epoch: int, position: int | None, what: str) -> dict:
    """The mount's stats once ``stream`` is in ``epoch`` (at ``position``, when given)."""

    def at(s: dict) -> bool:
        st = s["streams"].get(stream, {})
        return st.get("epoch") == epoch and (position is None or st.get("position") == position)

    return m.wait_stats(at, what, 60.0)


@pytest.fixture
def script(tmp_path) -> Path:
    """The training script (TRAIN) in a file."""
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("wrapped") / "src"
    make_images(src, classes=8, per_class=150)  # 1,200 files: epoch 0 outlasts the setup
    return src


def test_wrapped_subset_is_replayed_and_bit_identical(dataset, mount, script):
    m = mount(dataset)
    training = _same_training(script, dataset, m, 2, "plain", env={"DLC_SYNC": "1"})
    n = len(training["epochs"][0])
    assert n == 900 and training["epochs"][0] != training["epochs"][1]
    source = {str(p.relative_to(dataset)): hashlib.sha256(p.read_bytes()).hexdigest()
              for p in dataset.rglob("*.jpg")}
    for epoch in training["epochs"]:
        for rel, digest, _label in epoch:
            assert source[rel] == digest  # every sample's bytes are the source's
    st = _stream_at(m, "default/0", 1, n, "epoch 1 never fully replayed")
    s0 = st["streams"]["default/0"]
    assert s0["mode"] == "replayed", s0
    assert s0["samples"] == n and s0["error"] is None
    assert "next epoch is not known" in s0["reason"]  # seeds drawn per epoch
    assert st["prefetched"] > 0  # epoch 0 was fetched ahead of the reader
    assert not (m.mnt / ".dlcache" / "errors").read_text()
    # the same script without the launcher: same training, and the mount says why it
    # cannot help instead of staying silent
    plain = _run([sys.executable, str(script), str(m.mnt), "2", "plain"])
    assert plain == training
    st = m.stats()
    unannounced = [v for k, v in st["streams"].items() if k.startswith("unannounced/")]
    assert unannounced and unannounced[0]["mode"] == "none"
    assert "dlcachefs run" in unannounced[0]["reason"] and unannounced[0]["opens"] >= n


@pytest.mark.parametrize("mode", ["gen-reseed", "dist-noset"])
def test_an_order_that_repeats_each_epoch_is_replayed_as_repeating(dataset, mount, script,
                                                                   tmp_path, mode):
    """Two common ways an epoch repeats the last one's order: a DataLoader built each
    epoch with ``Generator().manual_seed(7)``, and a DistributedSampler whose
    ``set_epoch`` is never called. The mount computes each epoch's order from what the
    hook announces and sees the repeat: the next epoch is taken to repeat it, and no
    next-epoch log is laid out in a guessed order. Before, the re-seeded generator's
    epochs 1 on were replayed as if the generator had gone on (a wrong order: its logs
    laid out for it were read in whole chunks out of order, 0 planned reads)."""
    m = mount(dataset, "--chunk-size", "64K", "--reorder-min", "0",
              cache=tmp_path / f"cache-{mode}", name=f"mnt-{mode}")
    training = _same_training(script, dataset, m, 3, mode, env={"DLC_SYNC": "1"})
    n = len(training["epochs"][0])
    assert training["epochs"][0] == training["epochs"][1] == training["epochs"][2]
    epoch = 0 if mode == "dist-noset" else 2  # (an epoch never set is announced as 0)
    st = m.wait_stats(lambda st: "repeats the last one's order" in st["streams"].get(
        "default/0", {}).get("reason", ""), "the repeat was never seen")
    s0 = st["streams"]["default/0"]
    assert s0["mode"] == "replayed" and s0["epoch"] == epoch and s0["samples"] == n, s0
    assert ("set_epoch" in s0["reason"]) == (mode == "dist-noset"), s0["reason"]
    m.wait_stats(lambda st: st["streams"]["default/0"]["next_log"] is None,
                 "a next-epoch log was laid out for a repeating order")
    assert "repeats the last one's" in m.stats()["streams"]["default/0"]["reorder"]


def _next_log_or_pages(s0: dict) -> None:
    """Epoch 2 of a stream whose next order is known: epoch 3's log is laid out in its
    order, unless the kernel's page cache served epoch 1 (the dataset is in RAM: a log
    would be written and read back for nothing, and the stream says so), or is judged to
    serve epoch 2 from its first opens (the log being laid out is given up, and the
    stream says that instead: streams.GIVEN_UP)."""
    nl = s0["next_log"]
    reason = s0.get("reorder", "")
    assert (nl is not None and nl["epoch"] == 3) or (
        nl is None and ("page cache served" in reason or "page cache serves" in reason)
        and s0["page_cache"]["serves_this_epoch"]), s0


def test_seeded_generator_lays_out_the_next_epoch(dataset, mount, script, tmp_path):
    # --reorder-min 0: the small dataset would fit in memory, where no log is laid out
    m = mount(dataset, "--chunk-size", "64K", "--reorder-min", "0", cache=tmp_path / "cache2",
              name="mnt2")
    n = len(_same_training(script, dataset, m, 3, "gen")["epochs"][0])
    st = _stream_at(m, "default/0", 2, n, "epoch 2 never replayed")
    s0 = st["streams"]["default/0"]
    assert s0["mode"] == "replayed" and "generator's state" in s0["reason"], s0
    assert "next epoch is known" in s0["reason"]
    assert st["reorder_chunks"] > 0  # the next epoch's log was laid out in its order
    _next_log_or_pages(s0)
    assert not (m.mnt / ".dlcache" / "errors").read_text()


def test_a_loader_built_anew_each_epoch_counts_epochs_on(dataset, mount, script, tmp_path):
    """A new DataLoader (so a new sampler) per epoch, over the same dataset: its epochs
    are 0, 1, 2 as with one loader. They were 0 each time: the mount took every epoch
    for a restart, laid out a next-epoch log never read (2.5x the dataset fetched with a
    cache that holds it), and a learned order never repeated."""
    m = mount(dataset, "--chunk-size", "64K", "--reorder-min", "0",
              cache=tmp_path / "cache5", name="mnt5")
    training = _same_training(script, dataset, m, 3, "gen-new")
    n = len(training["epochs"][0])
    st = _stream_at(m, "default/0", 2, n, "epoch 2 never replayed")
    s0 = st["streams"]["default/0"]
    assert s0["mode"] == "replayed" and "next epoch is known" in s0["reason"], s0
    _next_log_or_pages(s0)
    size = sum(p.stat().st_size for p in dataset.rglob("*.jpg"))
    assert st["bytes_from_source"] <= size  # each file fetched once at most
    # a stream counts what was fetched for it once: an open that waited for its own
    # prefetch added the bytes a second time (more than the mount fetched at all)
    assert s0["bytes_from_source"] <= st["bytes_from_source"]
    _same_training(script, dataset, m, 3, "custom-new", env={"DLCACHEFS_JOB": "custom"})
    st = _stream_at(m, "custom/0", 2, None, "the custom job never reached epoch 2")
    s1 = st["streams"]["custom/0"]
    assert s1["mode"] == "learned" and "repeats: prefetched" in s1["reason"], s1


def test_custom_sampler_is_learned(dataset, mount, script, tmp_path):
    m = mount(dataset, cache=tmp_path / "cache3", name="mnt3")
    n = len(_same_training(script, dataset, m, 3, "custom")["epochs"][0])
    st = _stream_at(m, "default/0", 2, n, "epoch 2 never learned")
    s0 = st["streams"]["default/0"]
    assert s0["mode"] == "learned", s0
    assert "Reversed is not replayable" in s0["reason"]
    assert "repeats: prefetched" in s0["reason"] and s0["samples"] == n
    # a wrapper the hook cannot map: learned too, and the reason says why
    _same_training(script, dataset, m, 3, "filtered", env={"DLCACHEFS_JOB": "filtered"})
    st = _stream_at(m, "filtered/0", 2, None, "the filtered job never reached epoch 2")
    s1 = st["streams"]["filtered/0"]
    assert s1["mode"] == "learned" and "cannot be mapped" in s1["reason"], s1
    assert "changed since the last epoch" in s1["reason"]  # shuffled: nothing to prefetch


def test_a_dataset_without_an_image_folder_is_learned(dataset, mount, script, tmp_path):
    """A user's dataset holding file paths (relative to the working directory), with no
    ImageFolder the hook could map: the hook finds the mount from the paths and the
    stream is learned (it was "none", with a pointer to warnings never printed)."""
    m = mount(dataset, cache=tmp_path / "cache4", name="mnt4")
    _same_training(script, dataset, m, 3, "files", env={"DLCACHEFS_JOB": "files"})
    st = _stream_at(m, "files/0", 2, None, "the files job never reached epoch 2")
    s = st["streams"]["files/0"]
    assert s["mode"] == "learned" and "Files" in s["reason"], s


def test_a_wrapper_that_replaces_pythonpath_is_told_why_nothing_was_announced(
        dataset, mount, script):
    """``dlcachefs run -- bash run.sh`` where run.sh sets its own PYTHONPATH: the launcher's
    hook is gone from the training's path. The training runs as without the launcher,
    and the mount says why instead of "run the script under dlcachefs run"."""
    m = mount(dataset)
    wrapper = f'PYTHONPATH=/nonexistent exec "{sys.executable}" "{script}" "{m.mnt}" 1 plain'
    r = subprocess.run([sys.executable, "-m", "dlcachefs.cli", "run", "--", "sh", "-c",
                        wrapper], capture_output=True, text=True, timeout=900,
                       start_new_session=True)  # a process group of its own
    assert r.returncode == 0, r.stderr[-3000:]
    st = m.stats()
    assert not [k for k in st["streams"] if not k.startswith("unannounced/")], st["streams"]
    reasons = [v["reason"] for k, v in st["streams"].items() if k.startswith("unannounced/")]
    assert any("PYTHONPATH was replaced" in x for x in reasons), reasons
