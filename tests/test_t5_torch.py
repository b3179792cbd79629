"""A real torchvision ImageFolder + DataLoader (several workers) through the mount."""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import pytest
from conftest import requires_fuse

from dlcachefs.testing.mounting import drop_page_cache

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("torchvision.datasets")
transforms = pytest.importorskip("torchvision.transforms")
Image = pytest.importorskip("PIL.Image")

pytestmark = requires_fuse


def make_images(root: Path, classes: int = 4, per_class: int = 30, seed: int = 0) -> None:
    rnd = random.Random(seed)
    for c in range(classes):
        d = root / f"class_{c:02d}"
        d.mkdir(parents=True)
        for i in range(per_class):
            w, h = rnd.randint(24, 64), rnd.randint(24, 64)
            img = Image.frombytes("RGB", (w, h), rnd.randbytes(w * h * 3))
            img.save(d / f"img_{i:03d}.jpg", quality=85)
    (root / "class_00" / "notes.txt").write_text("not an image; ImageFolder must skip it\n")


def run_epochs(root: Path, epochs: int = 2) -> list[list[tuple[str, int]]]:
    tf = transforms.Compose([transforms.Resize((32, 32)), transforms.ToTensor()])
    ds = datasets.ImageFolder(str(root), transform=tf)
    g = torch.Generator()
    g.manual_seed(1234)
    dl = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, num_workers=2, generator=g)
    out = []
    for _ in range(epochs):
        seen = []
        for x, y in dl:
            for xi, yi in zip(x, y, strict=True):
                seen.append((hashlib.sha256(xi.numpy().tobytes()).hexdigest(), int(yi)))
        out.append(seen)
    return out


def test_imagefolder_dataloader_sees_the_same_samples(tmp_path, mount):
    src = tmp_path / "src"
    make_images(src)
    m = mount(src)
    assert datasets.ImageFolder(str(m.mnt)).classes == datasets.ImageFolder(str(src)).classes
    assert [(Path(p).relative_to(m.mnt), y) for p, y in datasets.ImageFolder(str(m.mnt)).samples] \
        == [(Path(p).relative_to(src), y) for p, y in datasets.ImageFolder(str(src)).samples]
    direct = run_epochs(src)
    through = run_epochs(m.mnt)
    assert through == direct
    assert len(direct[0]) == 120 and direct[0] != direct[1]  # shuffled differently per epoch
    st = m.wait_cached(120)
    drop_page_cache()
    assert run_epochs(m.mnt, epochs=1) == direct[:1]
    st2 = m.stats()
    assert st2["bytes_from_source"] == st["bytes_from_source"]  # the third epoch hit the cache


TRAIN = r'''
import hashlib, sys, torch
from torchvision import datasets, transforms
torch.manual_seed(0)
tf = transforms.Compose([transforms.Resize((16, 16)), transforms.ToTensor()])
ds = datasets.ImageFolder(sys.argv[1], transform=tf)
dl = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, num_workers=2)
model = torch.nn.Sequential(torch.nn.Dropout(0.2), torch.nn.Linear(16 * 16 * 3, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
h = hashlib.sha256()
for epoch in range(2):
    for x, y in dl:
        h.update(y.numpy().tobytes())
        h.update(x.numpy().tobytes())
        loss = torch.nn.functional.cross_entropy(model(x.flatten(1)), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
h.update(torch.cat([p.detach().flatten() for p in model.parameters()]).numpy().tobytes())
print(h.hexdigest())
'''


def children(pid: int) -> list[int]:
    """The live child processes of ``pid``."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(d))
    return out


def test_launcher_is_bit_identical_and_announces_the_sampler(tmp_path, mount):
    import subprocess
    import sys

    src = tmp_path / "src"
    make_images(src)
    m = mount(src)
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    py = [sys.executable, str(script)]

    def run(cmd: list[str]) -> str:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    plain = run([*py, str(m.mnt)])
    # an unannounced script works; the mount shows its opens, with no stream of its own
    st = m.stats()
    assert st["streams"] and all(k.startswith("unannounced/") and v["mode"] == "none"
                                 for k, v in st["streams"].items())
    # and the daemon never started its replay worker (torch's import) for it
    assert st["sampler_replay_ready"] is False and children(m.pid) == []
    hooked = run([sys.executable, "-m", "dlcachefs.cli", "run", "--", *py, str(m.mnt)])
    assert children(m.pid)  # the hook's first contact started it (and its tracker)
    assert hooked == plain  # same samples in the same order, same weights
    assert run([*py, str(src)]) == plain

    def replayed(s: dict) -> bool:  # the daemon replays epoch 1's order in the background
        st = s["streams"]["default/0"]
        return st["epoch"] == 1 and st["position"] == 120

    st = m.wait_stats(replayed, "epoch 1's order was not replayed")["streams"]["default/0"]
    assert st["samples"] == 120, st
    assert st["error"] is None
    ctl = json.loads((m.mnt / ".dlcache" / "control").read_bytes())
    assert ctl["jobs"]["default"]["dataset"] == ""  # the mount root itself
    assert ctl["streams"]["default/0"]["sampler"]["per_epoch"] is True


IIS_TRAIN = """
import sys, torch
from torch.utils.data import DataLoader
from torchvision import datasets, transforms
from dlcachefs.torch import ImportanceSampler, LossReporter, with_index

root = sys.argv[1]
tf = transforms.Compose([transforms.Resize((16, 16)), transforms.ToTensor()])
ds = with_index(datasets.ImageFolder(root, transform=tf))
sampler = ImportanceSampler(ds, seed=0, warmup=1, full_every=0)
reporter = LossReporter(root)
loader = DataLoader(ds, sampler=sampler, batch_size=16, num_workers=2)
for epoch in range(3):
    sampler.set_epoch(epoch)
    for x, y, idx in loader:
        loss = x.mean(dim=(1, 2, 3))  # any per-sample value will do
        sampler.record(idx, loss); reporter.report(idx, loss)
    reporter.flush()
"""


def test_importance_sampler_under_the_launcher_stays_explicit(tmp_path, mount):
    """Under ``dlcachefs run`` the DataLoader hook must not announce an ImportanceSampler
    as an unknown sampler: the stream stays the explicit order it announces itself, and
    the losses build the importance list (it was ``learned``, version 0)."""
    import subprocess
    import sys

    src = tmp_path / "src"
    make_images(src, classes=3, per_class=20)
    m = mount(src, "--policy", "icache")
    script = tmp_path / "iis.py"
    script.write_text(IIS_TRAIN)
    r = subprocess.run([sys.executable, "-m", "dlcachefs.cli", "run", "--", sys.executable,
                        str(script), str(m.mnt)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "not replayable" not in r.stderr, r.stderr
    st = m.stats()
    s = st["streams"]["default/0"]
    assert s["mode"] == "replayed" and "explicit" in s["reason"], s
    assert "seed" not in s["reason"]  # an explicit order's next one is sent, not drawn
    # its batch hint and pace too, for `dlcachefs advise` (it said "run the training
    # under dlcachefs run", which it was)
    assert s["loader"]["batch"] == 16 and s["loader"]["workers"] == 2, s["loader"]
    assert st["importance"]["version"] >= 1
    ctl = json.loads((m.mnt / ".dlcache" / "control").read_bytes())
    assert ctl["streams"]["default/0"]["sampler"]["kind"] == "explicit"


def test_importance_training_with_substitution_keeps_labels_right(tmp_path, mount):
    """ImportanceSampler + LossReporter + a DataLoader with workers over a mount with
    icache and --substitute: every image a batch carries is the exact decoding of a
    source file of the class its label says, substitutes included."""
    from dlcachefs.data.hook import ImportanceSampler, LossReporter, with_index

    src = tmp_path / "src"
    make_images(src, classes=3, per_class=40)
    total = sum(p.stat().st_size for p in src.rglob("*.jpg"))
    m = mount(src, "--policy", "icache:package=8K", "--substitute", "--h-fraction", "0.5",
              "--cache-size", str(total // 3), "--chunk-size", "8K")
    tf = transforms.Compose([transforms.Resize((32, 32)), transforms.ToTensor()])
    digest_class: dict[str, int] = {}
    ref = datasets.ImageFolder(str(src), transform=tf)
    for i in range(len(ref)):
        x, y = ref[i]
        digest_class[hashlib.sha256(x.numpy().tobytes()).hexdigest()] = y
    ds = with_index(datasets.ImageFolder(str(m.mnt), transform=tf))
    sampler = ImportanceSampler(ds, seed=3, warmup=1, full_every=0)
    reporter = LossReporter(str(m.mnt))
    rnd = random.Random(0)
    difficulty = [rnd.random() for _ in range(len(ds))]
    for epoch in range(4):
        sampler.set_epoch(epoch)
        dl = torch.utils.data.DataLoader(ds, sampler=sampler, batch_size=8, num_workers=2)
        for x, y, idx in dl:
            for xi, yi in zip(x, y, strict=True):
                d = hashlib.sha256(xi.numpy().tobytes()).hexdigest()
                assert digest_class[d] == int(yi)  # a source image of the labelled class
            loss = torch.tensor([difficulty[int(i)] for i in idx])
            sampler.record(idx, loss)
            reporter.report(idx, loss)
        reporter.flush()
        if epoch >= 1:
            assert len(sampler) < len(ds)  # importance sampling trains on a subset
    st = m.stats()
    assert st["losses"] > 0 and st["importance"]["version"] >= 1
    assert st["substitutions"] > 0  # and every substitute above carried a right label
    assert not (m.mnt / ".dlcache" / "errors").read_text()  # every write was accepted
