"""``dlcachefs advise`` after a real training epoch through the mount: the batch hint came
from the torch hook, the fetch times from the workers' opens, and the advice is Algorithm
2 applied to the measurements it prints."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import requires_fuse
from test_t5_torch import make_images

from dlcachefs.admin.advise import algorithm2
from dlcachefs.data.hook import prepare_mounts
from dlcachefs.testing.mounting import DLCACHEFS

pytest.importorskip("torchvision")
pytestmark = requires_fuse

TRAIN = r'''
import sys, time, torch
from torchvision import datasets, transforms
ds = datasets.ImageFolder(sys.argv[1], transform=transforms.Compose(
    [transforms.Resize((16, 16)), transforms.ToTensor()]))
class Backwards(torch.utils.data.Sampler):  # not replayable: the mount learns its order
    def __iter__(self):
        return iter(range(len(ds) - 1, -1, -1))

    def __len__(self):
        return len(ds)

g = torch.Generator()
g.manual_seed(5)
if sys.argv[2] == "custom":
    dl = torch.utils.data.DataLoader(ds, batch_size=4, sampler=Backwards(), num_workers=2)
else:
    dl = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True, num_workers=2,
                                     generator=g)
n = 0
for x, y in dl:
    time.sleep(0.05)  # the training step
    n += len(y)
print(n)
'''


@pytest.mark.parametrize("sampler", ["shuffle", "custom"])
def test_advise_after_an_epoch(tmp_path, mount, sampler):
    make_images(tmp_path / "src", classes=2, per_class=40)
    m = mount(tmp_path / "src")
    (tmp_path / "train.py").write_text(TRAIN)
    # the epoch's order is replayed once the replay worker has imported torch (started
    # when a training first opens the control file, as the hook does at its start)
    prepare_mounts([str(m.mnt)])
    m.wait_stats(lambda st: st["sampler_replay_ready"], "replay worker not ready", 300)
    r = subprocess.run([*DLCACHEFS, "run", "--", sys.executable, str(tmp_path / "train.py"),
                        str(m.mnt), sampler], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split()[-1] == "80"
    # the stream's set-up runs in the background: wait for its mode (not a timing check)
    mode = "learned" if sampler == "custom" else "replayed"
    stream = m.wait_stats(lambda st: st["streams"].get("default/0", {}).get("mode") == mode,
                          f"stream not {mode}", 300)["streams"]["default/0"]
    loader = stream["loader"]
    assert (loader["batch"], loader["workers"], loader["prefetch_factor"]) == (4, 2, 2)
    ep = loader["current"]
    assert ep["opens"] == 80 and ep["workers_seen"] == 2
    # 2 workers x 10 batches of 4: 3 gaps inside each batch, 1 across each later boundary
    assert ep["in_batch_gaps"] == 60 and ep["between_batch_gaps"] == 18

    # the training's own pace, from the hook's last report (at the epoch's end at least):
    # its step sleeps 50 ms, so the time between next() calls is at least that
    tr = loader["training"]
    assert 1 <= tr["iters"] <= 20 and tr["steps"] >= 1
    assert tr["train_s"] / tr["steps"] >= 0.05

    r = subprocess.run([*DLCACHEFS, "advise", str(m.mnt), "--json", "--cores", "4"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    (a,) = json.loads(r.stdout)
    assert a["stream"] == "default/0" and a["current"] == 2 and a["batch"] == 4
    assert a["t_fetch"] == pytest.approx(4 * ep["sample_fetch_s"])
    assert a["t_cycle"] == pytest.approx(3 * ep["sample_fetch_s"] + ep["between_batches_s"])
    assert a["t_req_from"] == "training" and a["bound"] is None
    assert a["t_req"] == pytest.approx(tr["train_s"] / tr["steps"])
    d = algorithm2(2, a["t_fetch"], a["t_req"], 4, a["mem_total"], a["mem_up"], 2)
    assert a["decision"]["workers"] == a["recommended"] == d.workers
    assert 1 <= a["recommended"] <= 4
    r = subprocess.run([*DLCACHEFS, "advise", str(m.mnt)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    print(r.stdout)
    assert r.stdout.startswith(f"stream default/0: num_workers={a['recommended']} (now 2")
    assert "t_fetch = 4 x" in r.stdout and "Algorithm 2:" in r.stdout
    r = subprocess.run([*DLCACHEFS, "stats", str(m.mnt)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "stream default/0: num_workers=" in r.stdout


def test_advise_without_streams(tmp_path, mount):
    (tmp_path / "src").mkdir()
    m = mount(tmp_path / "src")
    r = subprocess.run([*DLCACHEFS, "advise", str(m.mnt)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "no announced stream" in r.stderr
