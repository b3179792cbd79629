"""``dlcachefs run --workers auto`` over a mount: a training whose loader starts with one
worker and a slow ``__getitem__`` (a sleep: I/O-bound) gets more workers from its second
epoch on, with t_fetch timed in the workers (their reads are served in-process, so the
mount never sees them); the indices it trains on are those of the same training run
without ``--workers auto``; the mount's stats and summary show the count of each epoch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import requires_fuse
from test_t5_torch import make_images

from dlcachefs.data.hook import prepare_mounts
from dlcachefs.testing.mounting import DLCACHEFS

pytest.importorskip("torchvision")
pytestmark = requires_fuse

TRAIN = r'''
import json, sys, time, torch
import dlcachefs.torch as hook
from torchvision import datasets, transforms


class Slow:
    """The sample's processing: a wait (what a remote read or a heavy decode costs)."""

    def __call__(self, img):
        time.sleep(0.015)
        return img


ds = hook.with_index(datasets.ImageFolder(sys.argv[1], transform=transforms.Compose(
    [Slow(), transforms.Resize((8, 8)), transforms.RandomHorizontalFlip(),
     transforms.ToTensor()])))
dl = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True, num_workers=1)
torch.manual_seed(7)
seen, counts = [], []
for epoch in range(3):
    for x, y, i in dl:
        time.sleep(0.003)  # the training step
        seen.append(i.tolist())
    counts.append(dl.num_workers)
print(json.dumps({"seen": seen, "counts": counts, "report": hook.workers_report(dl)}))
'''


def train(tmp_path, mnt, *run_args: str) -> dict:
    r = subprocess.run([*DLCACHEFS, "run", *run_args, "--", sys.executable,
                        str(tmp_path / "train.py"), str(mnt)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    out["stderr"] = r.stderr
    return out


def test_workers_auto_over_a_mount(tmp_path, mount):
    make_images(tmp_path / "src", classes=2, per_class=24)
    m = mount(tmp_path / "src")
    (tmp_path / "train.py").write_text(TRAIN)
    prepare_mounts([str(m.mnt)])
    m.wait_stats(lambda st: st["sampler_replay_ready"], "replay worker not ready", 300)

    auto = train(tmp_path, m.mnt, "--workers", "auto")
    fixed = train(tmp_path, m.mnt)
    assert auto["seen"] == fixed["seen"]  # every epoch's indices, batch by batch
    assert sorted(sum(fixed["seen"][:12], [])) == list(range(48))
    assert fixed["counts"] == [1, 1, 1]
    # a 60 ms fetch per batch against a 3 ms step: Algorithm 2 wants ~20 workers, the
    # cores (2 or more here) cap it; the first epoch keeps the loader's own count
    assert auto["counts"][0] == 1 and min(auto["counts"][1:]) >= 2
    rows = auto["report"]
    assert rows[1]["t_fetch"] >= 4 * 0.015 and rows[1]["capped_by"] in ("cores", None)
    assert rows[1]["cpu_share"] < 0.5  # the workers mostly wait: measured in them
    assert "dlcachefs: workers auto: epoch 1: num_workers 1 -> " in auto["stderr"]

    # the mount heard the count of each epoch with the epoch's batch hint; the stats
    # now hold the second run's (fixed) epochs: run the auto one again to read them
    auto2 = train(tmp_path, m.mnt, "--workers", "auto:1-2")
    assert auto2["seen"] == fixed["seen"] and auto2["counts"] == [1, 2, 2]
    st = m.wait_stats(lambda st: st["streams"].get("default/0", {}).get("loader", {})
                      .get("workers_by_epoch") == {"0": 1, "1": 2, "2": 2},
                      "the epochs' counts not in the stats", 120)
    assert st["streams"]["default/0"]["loader"]["workers"] == 2
    assert "stream default/0: the loader runs 2 workers from epoch 1 (was 1)" in \
        m.log.read_text()
    r = subprocess.run([*DLCACHEFS, "stats", str(m.mnt)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert any(line.split()[:1] == ["workers"] and line.split()[-3:] == ["1", "2", "2"]
               for line in r.stdout.splitlines()), \
        r.stdout


def test_a_wrong_spec_is_refused(tmp_path):
    r = subprocess.run([*DLCACHEFS, "run", "--workers", "auto:4-2", "--", sys.executable,
                        "-c", "pass"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "MIN is above MAX" in r.stderr
