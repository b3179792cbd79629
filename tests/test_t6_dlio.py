"""DLIO's PyTorch loader under ``dlcachefs run``, through a real mount: two "MPI ranks"
(processes of one job), each a DataLoader with 2 persistent workers over DLIO's
``TorchDataset`` and ``dlio_sampler``, announce their orders as explicit orders of their
own rank (:mod:`dlcachefs.data.dlio`); the mount replays both, prefetches the first
epoch ahead of the readers and knows each next epoch; the samples, their bytes and every
epoch's order are those of the same run without the launcher, with ``sample_shuffle``
``seed`` (DLIO reseeds numpy) and ``random`` (it draws from numpy's global generator as
it stands, which the preview must leave untouched, and which DLIO also draws from
between epochs: the next epoch's order sent as a prediction is then sent again).

DLIO itself lives in the benches' own venv (``bench.dlio`` runs the real one), so the
package here is a stand-in with DLIO 2.0's module names, and its sampler is DLIO 2.0's
code as it is; its dataset reads each file whole, as the bench's raw reader does."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import requires_fuse
from dlio_standin import SAMPLER_SRC

from dlcachefs.data.hook import prepare_mounts
from dlcachefs.testing.mounting import DLCACHEFS

pytest.importorskip("torch")
pytestmark = requires_fuse

FILES = 48
EPOCHS = 3

STANDIN = {
    "dlio_benchmark/__init__.py": "",
    "dlio_benchmark/utils/__init__.py": "",
    "dlio_benchmark/common/__init__.py": "",
    "dlio_benchmark/common/enumerations.py": '''
from enum import Enum


class Shuffle(Enum):
    OFF = "off"
    SEED = "seed"
    RANDOM = "random"


class DatasetType(Enum):
    TRAIN = "train"
    VALID = "valid"
''',
    "dlio_benchmark/utils/config.py": '''
class ConfigArguments:
    __instance = None

    def __init__(self):
        self.file_list_train = []
        self.file_list_eval = []
        self.num_samples_per_file = 1

    @staticmethod
    def get_instance():
        if ConfigArguments.__instance is None:
            ConfigArguments.__instance = ConfigArguments()
        return ConfigArguments.__instance
''',
    "dlio_benchmark/data_loader/__init__.py": "",
    "dlio_benchmark/data_loader/torch_data_loader.py": '''
import math
import os

import numpy as np
from torch.utils.data import Dataset
from torch.utils.data.sampler import Sampler

from dlio_benchmark.common.enumerations import Shuffle
from dlio_benchmark.utils.config import ConfigArguments


class TorchDataset(Dataset):
    def __init__(self, format_type, dataset_type, epoch, num_samples, num_workers, batch_size):
        self.dataset_type = dataset_type
        self.num_samples = num_samples
        self.files = list(ConfigArguments.get_instance().file_list_train)

    def __len__(self):
        return self.num_samples

    def __getitem__(self, image_idx):
        with open(self.files[image_idx], "rb") as f:
            return image_idx, f.read()


''' + SAMPLER_SRC,
}

RANK = r'''
import hashlib, json, os, sys, time
import numpy as np, torch
sys.path.insert(0, sys.argv[4])
from dlio_benchmark.common.enumerations import DatasetType, Shuffle
from dlio_benchmark.data_loader.torch_data_loader import TorchDataset, dlio_sampler
from dlio_benchmark.utils.config import ConfigArguments

folder, epochs, shuffle, _ = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rank, world = int(sys.argv[-1]), int(os.environ.get("RANKS", "2"))
pause = os.environ.get("PAUSE_DIR")  # after epoch 0: say so, wait for "go"
args = ConfigArguments.get_instance()
train = os.path.join(folder, "train")
args.file_list_train = sorted(os.path.join(train, f) for f in os.listdir(train))
np.random.seed(99)  # (shuffle=random draws from the global generator as it stands)
ds = TorchDataset("jpeg", DatasetType.TRAIN, 1, len(args.file_list_train), 2, 4)
sampler = dlio_sampler(rank, world, len(ds), Shuffle(shuffle), epochs, 123)
dl = torch.utils.data.DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2,
                                 persistent_workers=True, collate_fn=lambda b: b)
out = []
for epoch in range(epochs):
    seen = []
    for batch in dl:
        seen += [(i, hashlib.sha256(raw).hexdigest()) for i, raw in batch]
    out.append(seen)
    np.random.normal(0, 1)  # DLIO's computation_time_stdev: a draw between epochs
    if pause and epoch == 0:
        open(os.path.join(pause, "epoch0"), "w").close()
        while not os.path.exists(os.path.join(pause, "go")):
            time.sleep(0.05)
print(json.dumps(out))
'''

LAUNCH = r'''
import subprocess, sys
procs = [subprocess.Popen([sys.executable, *sys.argv[1:], str(r)], stdout=subprocess.PIPE,
                          text=True) for r in (0, 1)]
outs = [p.communicate()[0] for p in procs]
assert all(p.returncode == 0 for p in procs), [p.returncode for p in procs]
print(outs[0].strip()); print(outs[1].strip())
'''


def write_scripts(tmp_path: Path) -> None:
    for rel, text in STANDIN.items():
        (tmp_path / "standin" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "standin" / rel).write_text(text)
    (tmp_path / "rank.py").write_text(RANK)
    (tmp_path / "launch.py").write_text(LAUNCH)


def make_dlio_dataset(folder: Path) -> dict[str, str]:
    """DLIO's layout: ``folder/train/img_<i>_of_<n>.jpeg`` (bytes of no importance: the
    stand-in reads them whole). Returns each file's sha256 by absolute-path name."""
    (folder / "train").mkdir(parents=True)
    out = {}
    for i in range(FILES):
        data = hashlib.sha256(str(i).encode()).digest() * (100 + 37 * i)
        name = f"img_{i}_of_{FILES}.jpeg"
        (folder / "train" / name).write_bytes(data)
        out[name] = hashlib.sha256(data).hexdigest()
    return out


def run_ranks(tmp_path: Path, folder: Path, shuffle: str, launcher: bool) -> list[list]:
    cmd = [sys.executable, str(tmp_path / "launch.py"), str(tmp_path / "rank.py"),
           str(folder), str(EPOCHS), shuffle, str(tmp_path / "standin")]
    if launcher:
        cmd = [*DLCACHEFS, "run", "--", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cannot replay" not in r.stderr and "could not" not in r.stderr, r.stderr[-3000:]
    return [json.loads(line) for line in r.stdout.splitlines()[-2:]]


@pytest.mark.parametrize("shuffle", ["seed", "random"])
def test_dlio_ranks_announce_their_orders_and_train_identically(tmp_path, mount, shuffle):
    digests = make_dlio_dataset(tmp_path / "src")
    write_scripts(tmp_path)
    m = mount(tmp_path / "src")
    prepare_mounts([str(m.mnt)])
    m.wait_stats(lambda st: st["sampler_replay_ready"], "replay worker not ready", 300)

    hooked = run_ranks(tmp_path, m.mnt, shuffle, launcher=True)
    plain = run_ranks(tmp_path, tmp_path / "src", shuffle, launcher=False)
    assert hooked == plain  # every rank's every epoch: the same indices and bytes
    files = sorted(os.listdir(tmp_path / "src" / "train"))
    for rank_epochs in hooked:
        for seen in rank_epochs:
            assert all(digests[files[i]] == d for i, d in seen)
    assert hooked[0][0] != hooked[0][1]  # the epochs' orders differ (a real shuffle)
    assert sorted(i for i, _ in hooked[0][0] + hooked[1][0]) == list(range(FILES))

    st = m.stats()
    for rank in (0, 1):
        s = st["streams"][f"default/{rank}"]
        assert s["mode"] == "replayed" and "explicit order" in s["reason"], s
        assert s["samples"] == FILES // 2 and s["error"] is None, s  # its share
        assert "the next epoch is known" in s["reason"], s
        assert s["epoch"] == EPOCHS - 1, s
    # the first epoch was fetched ahead of the readers, in the ranks' orders
    assert st["prefetched"] > 0
    assert st["bytes_from_source"] <= sum((tmp_path / "src" / "train" / f).stat().st_size
                                          for f in files)
    assert not (m.mnt / ".dlcache" / "errors").read_text()


def test_a_daemon_restarted_between_epochs_hears_the_next_epoch(tmp_path, mount):
    """The mount is unmounted and mounted again (a new daemon, the same cache) while a
    rank waits between epochs: the new daemon knows neither the job nor its view, refuses
    the next epoch's order, and the hook sends it again at once with the dataset and
    sampler lines (and the view's definition); the rank's stream is replayed for that
    epoch on the new daemon, and the training is the one run without the launcher."""
    make_dlio_dataset(tmp_path / "src")
    write_scripts(tmp_path)
    (tmp_path / "pause").mkdir()
    m = mount(tmp_path / "src")
    prepare_mounts([str(m.mnt)])
    m.wait_stats(lambda st: st["sampler_replay_ready"], "replay worker not ready", 300)
    env = {**os.environ, "RANKS": "1", "PAUSE_DIR": str(tmp_path / "pause")}
    cmd = [*DLCACHEFS, "run", "--", sys.executable, str(tmp_path / "rank.py"), str(m.mnt),
           "2", "seed", str(tmp_path / "standin"), "0"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "pause" / "epoch0").exists():
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
            time.sleep(0.05)
        assert m.stats()["streams"]["default/0"]["epoch"] == 0
        m.umount()
        # (explicit orders need no replay worker: nothing to wait for on the new daemon)
        m2 = mount(tmp_path / "src", cache=m.cache, mnt=m.mnt, name="mnt2")
        (tmp_path / "pause" / "go").touch()
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, err[-3000:]
    assert "could not announce" not in err, err[-3000:]
    env.pop("PAUSE_DIR")
    plain = subprocess.run([sys.executable, str(tmp_path / "rank.py"), str(tmp_path / "src"),
                            "2", "seed", str(tmp_path / "standin"), "0"],
                           capture_output=True, text=True, timeout=300, env=env)
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert json.loads(out.splitlines()[-1]) == json.loads(plain.stdout.splitlines()[-1])
    s = m2.stats()["streams"]["default/0"]
    assert s["mode"] == "replayed" and s["epoch"] == 1 and s["error"] is None, s
    assert "explicit order" in s["reason"], s
