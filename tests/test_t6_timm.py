"""timm's folder reader through a real mount under ``dlcachefs run``: its order
(``natural_key``: img2 before img10, class2 before class10) is the one replayed, index
for index; a list in an order the mount cannot make is learned from the opens, with the
reason."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import requires_fuse

from dlcachefs.clairvoyance.trace import load_trace

pytest.importorskip("timm")
Image = pytest.importorskip("PIL.Image")
pytestmark = requires_fuse

TRAIN = r'''
import json, os, sys, time, torch
from timm.data import create_dataset
from torchvision import transforms
mnt, epochs, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ds = create_dataset("", root=mnt, split="train", is_training=True)
reader = ds.reader
if how == "reversed":  # an order neither torchvision nor timm makes, over the same files
    reader.samples.reverse()
ds.transform = transforms.Compose([transforms.Resize((8, 8)), transforms.ToTensor()])
seen = []  # the dataset indices this training reads, in its order (num_workers=0)
get = type(reader).__getitem__
def spy(self, index):
    seen[-1].append(index)
    return get(self, index)
type(reader).__getitem__ = spy
stats_path = os.path.join(mnt, ".dlcache", "stats")
def stats():
    with open(stats_path) as f:
        return json.load(f)
def wait(pred, seconds=120):  # background work settles (nothing timed is asserted)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not pred(stats()):
        time.sleep(0.05)
    return stats()
wait(lambda s: s["sampler_replay_ready"])
g = torch.Generator()
g.manual_seed(5)
dl = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True, num_workers=0, generator=g)
out = []
for epoch in range(epochs):
    seen.append([])
    for x, y in dl:
        pass
    def settled(s):
        st = s["streams"].get("default/0", {})
        return st.get("epoch") == epoch and (st["mode"] != "replayed"
                                             or st["position"] == len(seen[-1]))
    st = wait(settled)
    out.append({"seen": seen[-1], "stream": st["streams"].get("default/0")})
print(json.dumps({"epochs": out,
                  "paths": [os.path.relpath(p, reader.root) for p, _ in reader.samples]}))
'''

#: names that sort differently naturally and lexically, a file in the root (timm keeps
#: it), files timm's types filter leaves out
NAMES = ([f"class{c}/img{i}.jpg" for c in (1, 2, 10) for i in (1, 2, 3, 10, 11, 20)]
         + ["class10/img7.png", "cover3.jpg"])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("timm") / "src"
    rnd = random.Random(7)
    for name in NAMES:
        p = src / "train" / name
        p.parent.mkdir(parents=True, exist_ok=True)
        Image.frombytes("RGB", (12, 12), rnd.randbytes(12 * 12 * 3)).save(p)
    (src / "train" / "class2" / "notes.txt").write_text("not an image\n")
    (src / "train" / "README").write_text("not an image either\n")
    return src


def _train(mnt: Path, tmp_path: Path, epochs: int, how: str) -> dict:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    r = subprocess.run([sys.executable, "-m", "dlcachefs.cli", "run", "--no-intercept", "--",
                        sys.executable, str(script), str(mnt), str(epochs), how],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_timm_order_is_replayed(dataset, mount, tmp_path):
    """Before: the mount derived torchvision's order, the digests differed and the stream
    stayed ``none`` ("sample list mismatch"). Now timm's list is made: the stream is
    ``replayed``, and each open names the index the training read (the trace maps opens
    to indices of the mount's list)."""
    trace = tmp_path / "trace.json"
    m = mount(dataset, "--trace", str(trace))
    got = _train(m.mnt, tmp_path, 2, "timm")
    paths = got["paths"]
    assert paths.index("class2/img2.jpg") < paths.index("class2/img10.jpg")
    assert paths.index("class2/img20.jpg") < paths.index("class10/img1.jpg")
    for ep in got["epochs"]:
        assert ep["stream"]["mode"] == "replayed", ep["stream"]["reason"]
        assert ep["stream"]["samples"] == len(NAMES)
    m.umount()
    t = load_trace(str(trace))
    assert len(t.epochs) == 2
    first, second = (ep["seen"] for ep in got["epochs"])
    assert sorted(first) == sorted(second) == list(range(len(NAMES)))
    # epoch 0's opens before its order was known are not in the trace (no list yet)
    assert t.epochs[0] == first[len(first) - len(t.epochs[0]):] and t.epochs[0]
    assert t.epochs[1] == second


def test_an_order_the_mount_cannot_make_is_learned(dataset, mount, tmp_path):
    """The same files in another order: the stream learns its order from the opens
    (``learned``, never ``none``), and its reason names the cause."""
    m = mount(dataset)
    got = _train(m.mnt, tmp_path, 2, "reversed")
    for ep in got["epochs"]:
        st = ep["stream"]
        assert st["mode"] == "learned", st["reason"]
        assert st["reason"].startswith(
            "sample list mismatch under 'train': the training's sample list is in another "
            f"sort order than torchvision's or timm's (the same {len(NAMES)} files); "), st
