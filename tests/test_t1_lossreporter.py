"""Tier 1: dlcachefs.data.hook.LossReporter and with_index, against a fake mount (a directory
holding ``.dlcache/control``) whose control writes are applied to a real ControlState."""

from __future__ import annotations

import errno
import os
import pickle
import subprocess
import sys
import warnings

import pytest

import dlcachefs.data.hook as dt
from dlcachefs.clairvoyance.control import MAX_LINE, MAX_WRITE, ControlState
from dlcachefs.errors import ControlError, NotFound

N = 1000  # samples in the fake dataset


class FakeMount:
    """``tmp/mnt`` with ``.dlcache/control`` (a regular file: find_mount only checks that
    it exists) and a dataset ``train``. ``os.write`` to the control file is applied to
    ``self.cs`` and answers EINVAL on a refusal, like the FUSE layer."""

    def __init__(self, tmp_path, monkeypatch) -> None:
        self.root = tmp_path / "mnt"
        (self.root / ".dlcache").mkdir(parents=True)
        self.control = self.root / ".dlcache" / "control"
        self.control.write_bytes(b"")
        (self.root / "train").mkdir()
        self.dataset = str(self.root / "train")
        self.losses: list[tuple[str, list[int], list[float]]] = []
        self.cs = ControlState(self._resolve, dataset_size={"train": N}.get,
                               on_loss=lambda js, i, v: self.losses.append((js.name, i, v)))
        self.writes: list[bytes] = []
        self.refused: list[str] = []
        real_write = os.write
        ctl = os.path.realpath(self.control)

        def write(fd: int, data) -> int:
            if os.path.realpath(f"/proc/self/fd/{fd}") != ctl:
                return real_write(fd, data)
            data = bytes(data)
            self.writes.append(data)
            try:
                return self.cs.apply(data, os.getpid())
            except ControlError as e:
                self.refused.append(str(e))
                raise OSError(errno.EINVAL, "Invalid argument") from None

        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(dt, "_warned", set())
        dt.find_mount.cache_clear()

    def _resolve(self, rel: str) -> int:
        if rel in ("", "train"):
            return 1 if rel == "" else 2
        raise NotFound(rel)

    def pairs(self, job: str | None = None) -> list[tuple[int, float]]:
        return [(i, v) for j, idx, vals in self.losses if job is None or j == job
                for i, v in zip(idx, vals, strict=True)]


@pytest.fixture
def fm(tmp_path, monkeypatch) -> FakeMount:
    m = FakeMount(tmp_path, monkeypatch)
    yield m
    dt.find_mount.cache_clear()


def test_report_and_flush(fm):
    fm.cs.apply(b"dataset train\n", os.getpid())
    r = dt.LossReporter(fm.dataset)
    assert r.enabled and r.mount == str(fm.root) and r.rel == "train"
    r.report([3, 1, 4], [0.5, 1.25, -2.0])
    r.report((1, 5), (3.0, 1e-7))
    assert fm.writes == []  # buffered
    r.flush()
    assert len(fm.writes) == 1 and not fm.refused
    assert fm.writes[0].startswith(b"loss 3 0.5 1 1.25 4 -2 1 3 5 1e-07")
    assert fm.pairs() == [(3, 0.5), (1, 1.25), (4, -2.0), (1, 3.0), (5, 1e-7)]
    assert r.sent_pairs == 5 and r.dropped_pairs == 0
    r.flush()  # nothing pending: no write
    assert len(fm.writes) == 1


def test_float32_values_are_exact(fm):
    """9 significant digits: the float32 of what the mount receives is the float32 sent."""
    np = pytest.importorskip("numpy")
    fm.cs.apply(b"dataset train\n", os.getpid())
    rng = np.random.default_rng(0)
    vals = (rng.standard_normal(500) * 10.0 ** rng.uniform(-30, 30, 500)).astype(np.float32)
    with dt.LossReporter(fm.dataset) as r:
        r.report(np.arange(500), vals)
    got = fm.pairs()
    assert [i for i, _ in got] == list(range(500))
    assert np.array_equal(np.array([v for _, v in got], dtype=np.float32), vals)


def test_job_line(fm, monkeypatch):
    monkeypatch.delenv(dt.ENV_JOB, raising=False)
    fm.cs.apply(b"job a\ndataset train\njob b\n", os.getpid())  # this process writes for b
    with dt.LossReporter(fm.dataset, job="a") as r:
        r.report([7], [1.0])
    assert fm.writes[0].startswith(b"job a\nloss 7 1\n")
    assert fm.losses == [("a", [7], [1.0])]
    monkeypatch.setenv(dt.ENV_JOB, "a")  # dlcachefs run --job a
    with dt.LossReporter(fm.dataset) as r:
        r.report([8], [2.0])
    assert fm.writes[-1].startswith(b"job a\n")
    assert fm.losses[-1] == ("a", [8], [2.0])


def test_dataset_sent_once_when_refused(fm):
    with dt.LossReporter(fm.dataset, job="j") as r:  # the job has no dataset yet
        r.report([1, 2], [1.0, 2.0])
        r.flush()
        assert fm.refused and "before a dataset" in fm.refused[0]
        assert fm.writes[1].startswith(b"job j\ndataset train\nloss 1 1 2 2\n")
        r.report([3], [3.0])
    assert fm.writes[2].startswith(b"job j\nloss 3 3\n")
    assert fm.pairs("j") == [(1, 1.0), (2, 2.0), (3, 3.0)]
    assert r.sent_pairs == 3


def test_non_finite_dropped_with_one_warning(fm):
    fm.cs.apply(b"dataset train\n", os.getpid())
    r = dt.LossReporter(fm.dataset)
    with pytest.warns(RuntimeWarning, match="non-finite"):
        r.report([1, 2, 3, 4, 5], [1.0, float("nan"), float("inf"), -float("inf"), 5.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r.report([6, -1], [float("nan"), 1.0])  # warned already; a negative index dropped too
        r.close()
    assert fm.pairs() == [(1, 1.0), (5, 5.0)] and not fm.refused
    assert r.dropped_pairs == 5


def test_mismatched_lengths(fm):
    r = dt.LossReporter(fm.dataset)
    with pytest.raises(ValueError, match="2 indices but 1 losses"):
        r.report([1, 2], [1.0])


@pytest.mark.parametrize("max_pairs", [3000, 100_000, 7])
def test_large_batches_are_split(fm, max_pairs):
    fm.cs.apply(b"dataset train\n", os.getpid())
    n = 20_000
    idx = [(i * 7919) % N for i in range(n)]
    vals = [(-1) ** i * (i + 0.123456789) * 1e-30 for i in range(n)]  # long tokens
    r = dt.LossReporter(fm.dataset, job="big", max_pairs_per_write=max_pairs)
    fm.cs.apply(b"job big\ndataset train\n", os.getpid())
    r.report(idx[:5000], vals[:5000])
    r.report(idx[5000:], vals[5000:])
    r.close()
    assert not fm.refused
    for w in fm.writes:
        assert len(w) <= MAX_WRITE
        assert w.startswith(b"job big\n")
        lines = w.decode().splitlines()[1:]
        assert all(len(line) <= MAX_LINE and line.startswith("loss ") for line in lines)
        assert sum(len(line.split()) - 1 for line in lines) // 2 <= max_pairs
    if max_pairs == 100_000:
        assert len(fm.writes) >= n * 20 // MAX_WRITE  # filled up to 64 KiB
    got = fm.pairs("big")
    assert [i for i, _ in got] == idx
    assert [v for _, v in got] == [float(f"{v:.9g}") for v in vals]
    assert r.sent_pairs == n


def test_buffer_writes_when_full(fm):
    fm.cs.apply(b"dataset train\n", os.getpid())
    r = dt.LossReporter(fm.dataset, max_pairs_per_write=10)
    r.report(range(9), [1.0] * 9)
    assert fm.writes == []
    r.report([9], [1.0])
    assert len(fm.writes) == 1 and len(fm.pairs()) == 10


def test_torch_tensors(fm):
    torch = pytest.importorskip("torch")
    fm.cs.apply(b"dataset train\n", os.getpid())
    w = torch.ones(4, requires_grad=True)
    loss = w * torch.tensor([0.5, 1.5, float("nan"), 2.0])
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    with dt.LossReporter(fm.dataset) as r, pytest.warns(RuntimeWarning, match="non-finite"):
        for d in devices:
            r.report(torch.tensor([[1, 2], [3, 4]], device=d), loss.to(d).reshape(2, 2))
    assert fm.pairs() == [(1, 0.5), (2, 1.5), (4, 2.0)] * len(devices)


def test_not_on_a_mount_is_a_noop(tmp_path, monkeypatch):
    monkeypatch.setattr(dt, "_warned", set())
    dt.find_mount.cache_clear()
    (tmp_path / "data").mkdir()
    with pytest.warns(RuntimeWarning, match="not on a dlcachefs mount"):
        r = dt.LossReporter(tmp_path / "data")
    assert not r.enabled
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with dt.LossReporter(tmp_path / "data") as r2:  # warned already
            r2.report([1], [float("nan")])
            r2.report([1, 2], [1.0])  # not even checked: nothing is done at all
    dt.find_mount.cache_clear()


def test_write_failure_never_raises(fm):
    fm.cs.apply(b"dataset train\n", os.getpid())
    r = dt.LossReporter(fm.dataset)
    fm.control.unlink()  # the mount went away
    r.report([1], [1.0])
    with pytest.warns(RuntimeWarning, match="could not report losses"):
        r.flush()
    assert r.dropped_pairs == 1 and fm.losses == []


# ----- with_index ----------------------------------------------------------------------


class FakeFolder:
    """What the sampler hook looks for: ``root`` and ``samples``."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.samples = [(f"{root}/c{i % 2}/{i}.jpg", i % 2) for i in range(6)]
        self.targets = [t for _, t in self.samples]
        self.classes = ["c0", "c1"]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        return float(i) * 10, self.samples[i][1]

    def __getitems__(self, idx):  # must not be used through the wrapper
        raise AssertionError("__getitems__ bypasses the index")


def test_with_index():
    torch = pytest.importorskip("torch")
    ds = FakeFolder("/mnt/train")
    w = dt.with_index(ds)
    assert isinstance(w, torch.utils.data.Dataset) and isinstance(w, dt.WithIndex)
    assert len(w) == 6 and w[4] == (40.0, 0, 4)
    assert w.root == "/mnt/train" and w.samples is ds.samples
    assert w.targets == ds.targets and w.classes == ["c0", "c1"]
    assert dt._dataset_root(w) == "/mnt/train"
    with pytest.raises(AttributeError):
        w.nothing_like_this  # noqa: B018
    assert not hasattr(w, "__getitems__")
    w2 = pickle.loads(pickle.dumps(w))  # DataLoader workers with spawn pickle it
    assert w2[1] == (10.0, 1, 1) and w2.root == "/mnt/train"
    batches = list(torch.utils.data.DataLoader(w, batch_size=4))
    x, y, i = batches[0]
    assert i.tolist() == [0, 1, 2, 3] and y.tolist() == [0, 1, 0, 1]
    assert dt.with_index(["a", "b"])[1] == ("b", 1)  # a non-tuple item


def test_importing_does_not_import_torch():
    code = ("import sys, dlcachefs.data.hook as dt; dt.LossReporter('/'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-W", "ignore", "-c", code], check=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
