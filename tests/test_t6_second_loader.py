"""A training with two loaders under ``dlcachefs run``: its shuffled training loader and a
sequential validation loader over another directory (torchvision's reference script), over
a slow source. The launcher must never be slower than no launcher: the validation set,
which the hook does not announce while the training loader holds the job's stream, is
scanned ahead as it is without the launcher (its opens are of files outside the stream's
samples); a validation loader that the hook does announce (it reads first, when no
training loader owns the stream yet) is prefetched in its known order. The training's
samples stay bit-identical to a run without the mount."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import requires_fuse
from test_t5_torch import make_images

pytest.importorskip("torchvision")
pytestmark = requires_fuse

SCRIPT = r'''
import hashlib, json, os, sys, time, torch
from torchvision import datasets, transforms
root, epochs, first = sys.argv[1], int(sys.argv[2]), sys.argv[3]
tf = transforms.Compose([transforms.Resize((16, 16)), transforms.ToTensor()])
train = datasets.ImageFolder(os.path.join(root, "train"), transform=tf)
val = datasets.ImageFolder(os.path.join(root, "val"), transform=tf)
torch.manual_seed(3)
tl = torch.utils.data.DataLoader(train, batch_size=16, shuffle=True, num_workers=2)
vl = torch.utils.data.DataLoader(val, batch_size=8, num_workers=2,
                                 sampler=torch.utils.data.SequentialSampler(val))
stats_path = os.path.join(root, ".dlcache", "stats")

def stats():
    if not os.path.exists(stats_path):
        return None
    with open(stats_path) as f:
        return json.load(f)

def settle():  # the background work of what was read so far is done (nothing timed)
    deadline = time.monotonic() + 120
    while stats() is not None and stats()["pending_bytes"] and time.monotonic() < deadline:
        time.sleep(0.1)

def digests(loader, step_s=0.0):
    out = []
    for x, y in loader:
        out += [(hashlib.sha256(xi.numpy().tobytes()).hexdigest()[:16], int(yi))
                for xi, yi in zip(x, y)]
        time.sleep(step_s)  # the model's step (the loader workers read on meanwhile)
    return out

deadline = time.monotonic() + 120  # the replay worker imported torch: orders are known
while stats() is not None and time.monotonic() < deadline:
    if stats()["sampler_replay_ready"]:
        break
    time.sleep(0.1)
out = []
for epoch in range(epochs):
    ep = {}
    for which in ((["val", "train"] if first == "val" else ["train", "val"])
                  if epoch == 0 else ["train", "val"]):
        settle()
        before = stats()
        ep[which] = digests(tl if which == "train" else vl, 0.2 if which == "val" else 0)
        ep[which + "_stats"] = (before, stats())
    out.append(ep)
print(json.dumps(out))
'''

DELAY_MS = 20  # every open of a source file waits this long (a remote filesystem)


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("twoloaders") / "src"
    make_images(src / "train", classes=4, per_class=40)  # 160 files
    make_images(src / "val", classes=4, per_class=25, seed=1)  # 100 files (+ a .txt)
    return src


def _run(cmd: list[str]) -> list[dict]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _delta(pair: list[dict], key: str) -> int:
    return pair[1][key] - pair[0][key]


@pytest.mark.parametrize(("launcher", "first"), [
    ("run", "train"), ("run --no-intercept", "train"), ("run", "val")])
def test_the_validation_loader_is_read_ahead_under_the_launcher(
        dataset, mount, tmp_path, launcher, first):
    """``first="train"``: the validation loader is not announced (the training loader
    owns the job's stream); epoch 1's validation pass gets most of its files scanned ahead
    (before: every one of them was a miss, where the run without the launcher had most
    scanned ahead), and the stream's stats name the tree. ``first="val"``: the validation
    loader announces (SequentialSampler, replayed) and its pass is prefetched in its order;
    then the training loader takes the stream. Either way the training's samples and the
    validation's are the ones a run without the mount reads."""
    from dlcachefs.testing.passthrough import passthrough_mount  # noqa: PLC0415 - FUSE

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    direct = _run([sys.executable, str(script), str(dataset), "2", first])
    with passthrough_mount(str(dataset), str(tmp_path / "slow"), delay_ms=DELAY_MS):
        m = mount(tmp_path / "slow")
        through = _run([sys.executable, "-m", "dlcachefs.cli", *launcher.split(), "--",
                        sys.executable, str(script), str(m.mnt), "2", first])
        m.umount()
    for d, t in zip(direct, through, strict=True):
        assert t["train"] == d["train"] and t["val"] == d["val"]
    n_val = len(direct[0]["val"])
    assert n_val == 100
    pair = through[0]["val_stats"]
    # opens that fetched their own file (an open that joined a fetch ahead of it already
    # under way counts as a miss too, in fetch_waits)
    misses = _delta(pair, "misses") - _delta(pair, "fetch_waits")
    st = pair[1]
    stream = st["streams"]["default/0"]
    if first == "train":
        tree = st["scan_ahead"].get("val", {})
        scanned = tree.get("files", 0)
        # the first 32 opens come before the scan starts (as without the launcher: 67
        # scanned, 44 missed there; before the fix 0 scanned, 100 missed). The bounds
        # leave room for a loaded machine, where the reader may pass the scan more often
        assert scanned >= n_val // 4, (scanned, misses, st["scan_ahead"])
        assert misses <= n_val * 3 // 4, (misses, scanned)
        assert stream.get("scan_ahead_outside") == "val", stream
        assert stream["mode"] == "replayed" and "RandomSampler" in stream["reason"]
    else:
        prefetched = _delta(pair, "prefetched")
        assert prefetched > n_val // 2, (prefetched, misses)
        assert misses < n_val // 2, (misses, prefetched)
    # epoch 2's validation is served from the cache
    assert _delta(through[1]["val_stats"], "misses") == 0
