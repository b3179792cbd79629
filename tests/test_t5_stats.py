"""Tier 5: ``dlcachefs stats MNT`` after a real training over a mount: the short summary a
person reads (what was served from where, the stream and why, its epochs' bytes from the
source, the reads served in the training's processes, warnings), ``--all`` and ``--json``
as before, and the per-epoch ``bytes_from_source`` of a stream in the stats document."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import requires_fuse

from dlcachefs.testing.mounting import DLCACHEFS
from dlcachefs.units import format_size

pytest.importorskip("torchvision")
t5 = pytest.importorskip("test_t5_torch")

pytestmark = requires_fuse

#: three epochs of an ImageFolder with a DistributedSampler (its order announced by the
#: launcher); after each epoch, waits until what was fetched is sealed (the next epoch
#: finds it cached; nothing timed is asserted)
TRAIN = r'''
import json, os, sys, time, torch
from torchvision import datasets, transforms
root = sys.argv[1]
ds = datasets.ImageFolder(root, transform=transforms.Compose(
    [transforms.Resize((16, 16)), transforms.ToTensor()]))
sampler = torch.utils.data.DistributedSampler(ds, num_replicas=1, rank=0, seed=3)
dl = torch.utils.data.DataLoader(ds, batch_size=16, sampler=sampler, num_workers=2)
def stats():
    with open(os.path.join(root, ".dlcache", "stats")) as f:
        return json.load(f)
# the daemon's replay worker has imported torch (it may take seconds on a loaded machine)
deadline = time.monotonic() + 120
while not stats()["sampler_replay_ready"] and time.monotonic() < deadline:
    time.sleep(0.1)
seen = 0
for epoch in range(3):
    sampler.set_epoch(epoch)
    for x, _ in dl:
        seen += len(x)
    deadline = time.monotonic() + 120
    while stats()["pending_bytes"] and time.monotonic() < deadline:
        time.sleep(0.05)
print(seen)
'''


def test_stats_summary_after_an_imagefolder_training(tmp_path, mount):
    src = tmp_path / "src"
    t5.make_images(src, classes=3, per_class=20)
    m = mount(src, "--flush-interval", "0.1")
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    r = subprocess.run([*DLCACHEFS, "run", "--", sys.executable, str(script), str(m.mnt)],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert int(r.stdout.split()[-1]) == 3 * 60

    st = json.loads(subprocess.run([*DLCACHEFS, "stats", str(m.mnt), "--json"],
                                   capture_output=True, text=True, check=True,
                                   timeout=60).stdout)
    s = st["streams"]["default/0"]
    # every reader was the training's (the late events of its ended loader workers'
    # in-process reads were not taken for process groups that announced nothing)
    assert [k for k in st["streams"] if k.startswith("unannounced/")] == []
    assert s["mode"] == "replayed" and s["epoch"] == 2, s
    epochs = s["epochs"]
    # the first epoch read the dataset from the source; the cache holds it: none since
    assert epochs["0"]["bytes_from_source"] > 0
    assert epochs["0"]["bytes_from_source"] <= st["bytes_from_source"]
    assert epochs["0"]["bytes_from_source"] == s["bytes_from_source"]
    for e in ("1", "2"):
        assert epochs[e]["bytes_from_source"] == 0 and epochs[e]["misses"] == 0, epochs
        assert epochs[e]["hits"] > 0, epochs
    assert sum(epochs[e]["hits"] + epochs[e]["misses"] for e in epochs) > 0

    out = subprocess.run([*DLCACHEFS, "stats", str(m.mnt)], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    print(out)
    lines = out.splitlines()
    assert len(lines) <= 25, out
    assert lines[0].startswith(f"{m.mnt} <- {src}")
    by_label = {}
    for line in lines:
        by_label.setdefault(line[:11].strip(), []).append(line[11:])
    assert by_label["stream"][0].startswith("default/0: replayed, epoch 2, 60 of 60 samples")
    flat = " ".join(out.split())
    assert f"why: {' '.join(s['reason'].split())}" in flat
    # the stream's epochs: bytes from the source, hits, misses
    table = [line.split() for line in lines if line.startswith(" " * 11 + "epoch ")
             or line.startswith(" " * 11 + "from source ")]
    assert table[0] == ["epoch", "0", "1", "2"]
    assert table[1][2:] == [format_size(epochs["0"]["bytes_from_source"]), "0", "0"]
    # served from where, as the document says
    assert by_label["opens"][0].startswith(
        f"{st['hits'] + st['misses'] + st['prefetch_hits'] + st['substitutions']:,} "
        f"through the mount: {st['hits']:,} from the cache, {st['misses']:,} waited")
    zc = st["zerocopy"]
    assert len(by_label["in-process"]) == 1  # one line for the reads served in-process
    if zc["hits"]:
        assert by_label["in-process"][0].startswith(f"{zc['hits']:,} reads (")
    assert "hit ratio" in by_label and "bytes" in by_label and "cache" in by_label
    assert by_label["warnings"] == ["none"], out
    assert "--all" in lines[-1]

    # --all: every key, as before the summary (latency histograms and fuse_ops included)
    full = subprocess.run([*DLCACHEFS, "stats", str(m.mnt), "--all"], capture_output=True,
                          text=True, check=True, timeout=60).stdout
    assert len(full.splitlines()) > 60
    for key in ("bytes_from_source ", "source_latency:", "fuse_ops:", "streams:",
                "  default/0:", "zerocopy:"):
        assert key in full, key
