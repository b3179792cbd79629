"""Tier 5: CachedImageFolder (dlcachefs.data) over real mounts: the same dataset as
torchvision's ImageFolder over the mount, samples read from the cache directly in
DataLoader workers (fork and spawn) without a FUSE request, recognised by ``dlcachefs
run``, and never a wrong byte while the daemon evicts under the readers."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import requires_fuse
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlcachefs.data.reader import CacheReader
from dlcachefs.store import readonly
from dlcachefs.testing.mounting import wait_until

torch = pytest.importorskip("torch")
datasets = pytest.importorskip("torchvision.datasets")
transforms = pytest.importorskip("torchvision.transforms")

from dlcachefs.data import CachedImageFolder  # noqa: E402

samplelist = pytest.importorskip("test_t2_samplelist")
t3 = pytest.importorskip("test_t3_zerocopy")
t5 = pytest.importorskip("test_t5_torch")

pytestmark = requires_fuse

#: mounts of these tests: chunks sealed quickly, nothing fetched ahead of the readers
QUICK = ("--flush-interval", "0.1", "--scan-ahead", "0")


def settle(m, n_files: int) -> dict:
    """Stats once ``n_files`` are indexed and nothing waits for the writer."""
    return m.wait_cached(n_files)


def file_reads(st: dict) -> int:
    """Opens of files the daemon served (hits and misses)."""
    return st["hits"] + st["misses"]


# ----- the same dataset as ImageFolder -----------------------------------------------------


def raw(data: bytes | memoryview) -> bytes:
    return bytes(data)


def outcome(fn):
    """What ``fn()`` returns, or the type of the OSError it raises."""
    try:
        return fn()
    except OSError as e:
        return type(e)


def read_path(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@settings(deadline=None, max_examples=8,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(classes=st.lists(samplelist.CLASS, min_size=1, max_size=3),
       links=st.lists(st.tuples(st.integers(0, 2), samplelist.NAME, samplelist.EXT,
                                st.integers(0, 99), st.sampled_from(["rel", "abs"])),
                      max_size=4),
       sub=st.booleans())
def test_same_dataset_and_bytes_as_imagefolder_over_random_trees(tmp_path, mount, classes,
                                                                  links, sub):
    n = len(list(tmp_path.iterdir()))
    base = tmp_path / f"ex{n}"
    src = base / "src"
    data = src / "train" if sub else src
    data.mkdir(parents=True)
    samplelist.build(data, classes, [], [])
    if sub:
        samplelist.touch(src, "val/k/a.jpg", "top.png")
    files = sorted(os.path.relpath(os.path.join(d, f), data)
                   for d, _, fs in os.walk(data) for f in fs)
    for f in files:  # every file its own bytes
        (data / f).write_bytes(f.encode() + os.urandom(16))
    names = sorted(e.name for e in os.scandir(data) if e.is_dir())
    if not names:
        return  # torchvision refuses a dataset without classes
    made = []
    for where, lname, ext, pick, kind in links:
        cls = names[where % len(names)]
        target = files[pick % len(files)] if files else "missing.jpg"
        made.append((f"{cls}/{lname}{ext}",
                     "../" + target if kind == "rel" else str(data / target)))
    samplelist.build(data, [], [], made)
    m = mount(src, *QUICK, name=f"mnt{n}", cache=base / "cache")
    # each example's mount ends with it, failed or not: hypothesis runs many examples
    # (shrinking) before the fixture's teardown
    try:
        root = m.mnt / "train" if sub else m.mnt
        tv = datasets.ImageFolder(str(root), loader=read_path, allow_empty=True)
        zc = CachedImageFolder(str(root), decode=raw, allow_empty=True)
        assert zc.reader is not None
        assert (zc.classes, zc.class_to_idx, zc.samples, zc.targets) == (
            tv.classes, tv.class_to_idx, tv.samples, tv.targets)
        expected_hits = sum(t3.kernel_walk(src, os.path.relpath(p, m.mnt)) is not None
                            for p, _ in zc.samples)
        for _ in range(2):  # first through the mount (it caches), then from the cache
            for i in range(len(zc)):
                want = outcome(lambda i=i: tv[i])  # a dangling link: the same error both ways
                assert outcome(lambda i=i: zc[i]) == want
                expect = want[0] if isinstance(want, tuple) else want
                assert outcome(lambda i=i: bytes(zc.read_bytes(i))) == expect
                assert outcome(lambda i=i: zc.read_array(i).tobytes()) == expect
            if _ == 0:
                m.wait_stats(lambda s: s["pending_bytes"] == 0, "the writer did not settle")
        counts = zc.cache_counts()
        assert counts["hits"] >= 3 * expected_hits  # item, bytes and array of the second pass
        assert counts["errors"] == counts["mismatch"] == counts["missing_log"] == 0
    except BaseException:
        with contextlib.suppress(Exception):
            m.umount()
        raise
    m.umount()


def test_not_on_a_mount_it_is_imagefolder(tmp_path):
    src = tmp_path / "src"
    t5.make_images(src, classes=2, per_class=5)
    tf = transforms.ToTensor()
    zc, tv = CachedImageFolder(str(src), transform=tf), datasets.ImageFolder(str(src), transform=tf)
    assert zc.reader is None and zc.cache_counts() is None
    assert zc.samples == tv.samples
    for i in range(len(zc)):
        assert torch.equal(zc[i][0], tv[i][0]) and zc[i][1] == tv[i][1]
        assert bytes(zc.read_bytes(i)) == Path(zc.samples[i][0]).read_bytes()
    # a path loader is used as ImageFolder uses it
    assert CachedImageFolder(str(src), loader=read_path)[0][0] == Path(zc.samples[0][0]).read_bytes()


# ----- DataLoader workers ------------------------------------------------------------------


def epoch_digests(ds, ctx: str | None, seed: int = 7) -> list[tuple[str, int]]:
    g = torch.Generator()
    g.manual_seed(seed)
    dl = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, num_workers=2,
                                     generator=g, multiprocessing_context=ctx)
    out = []
    for x, y in dl:
        for xi, yi in zip(x, y, strict=True):
            out.append((hashlib.sha256(xi.numpy().tobytes()).hexdigest(), int(yi)))
    return out


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_dataloader_workers_read_from_the_cache(tmp_path, mount, ctx):
    """A warm cache: the workers read every sample from it, none through FUSE; the
    training sees the same tensors and labels as ImageFolder over the source."""
    src = tmp_path / "src"
    t5.make_images(src)
    m = mount(src, *QUICK)
    for p, _ in datasets.ImageFolder(str(m.mnt)).samples:  # warm: read once through the mount
        read_path(p)
    settle(m, 120)
    tf = transforms.Compose([transforms.Resize((32, 32)), transforms.ToTensor()])
    ds = CachedImageFolder(str(m.mnt), transform=tf)
    direct = epoch_digests(datasets.ImageFolder(str(src), transform=tf), ctx)
    before = m.stats()
    extra = 0
    if ctx == "fork":  # the parent reads first: its index must not reach the workers
        ds[0]
        extra = 1
    assert epoch_digests(ds, ctx) == direct
    assert len(direct) == 120
    # the workers counted in files of their own, which the daemon sums (live or ended)
    st = m.wait_stats(lambda s: s["zerocopy"]["hits"] >= 120 + extra,
                      "the workers' counts did not reach the daemon")
    assert file_reads(st) == file_reads(before)  # no sample opened through FUSE
    assert st["zerocopy"]["hits"] == 120 + extra and st["zerocopy"]["fallbacks"] == 0
    assert st["zerocopy"]["hit_bytes"] >= 120 * 500


# ----- dlcachefs run -------------------------------------------------------------------------

TRAIN = r'''
import hashlib, json, sys, torch
from torchvision import datasets, transforms
from dlcachefs.data import CachedImageFolder
cls = CachedImageFolder if sys.argv[2] == "cached" else datasets.ImageFolder
torch.manual_seed(0)
tf = transforms.Compose([transforms.Resize((16, 16)), transforms.ToTensor()])
ds = cls(sys.argv[1], transform=tf)
dl = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, num_workers=2)
h = hashlib.sha256()
for epoch in range(2):
    for x, y in dl:
        h.update(y.numpy().tobytes())
        h.update(x.numpy().tobytes())
print(h.hexdigest())
'''


def test_dlcachefs_run_announces_a_cached_image_folder(tmp_path, mount):
    src = tmp_path / "src"
    t5.make_images(src)
    m = mount(src, "--flush-interval", "0.1")
    script = tmp_path / "train.py"
    script.write_text(TRAIN)

    def train(root: Path, kind: str, launcher: bool) -> str:
        pre = [sys.executable, "-m", "dlcachefs.cli", "run", "--"] if launcher else []
        r = subprocess.run([*pre, sys.executable, str(script), str(root), kind],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    reference = train(src, "plain", False)
    assert train(m.mnt, "cached", True) == reference  # bit-identical through both paths

    def replayed(s: dict) -> bool:
        st = s["streams"].get("default/0")
        return st is not None and st["mode"] == "replayed" and st["samples"] == 120

    st = m.wait_stats(replayed, "the CachedImageFolder's sampler was not replayed")
    st = m.wait_stats(lambda s: s["zerocopy"]["readers"] == 0, "workers still counting")
    zc = st["zerocopy"]
    # epoch 1 went through the mount (nothing cached yet); epoch 2 mostly from the cache
    assert zc["hits"] + zc["fallbacks"] == 240
    assert zc["not_cached"] > 0 and zc["hits"] > 0
    assert zc["errors"] == zc["mismatch"] == 0


# ----- eviction under running readers ---------------------------------------------------------


def tree(root: Path, prefix: str, n: int, rnd: random.Random) -> dict[str, bytes]:
    out = {}
    for i in range(n):
        rel = f"{prefix}/c{i % 4}/{i:04d}.jpg"
        data = rnd.randbytes(rnd.randint(2000, 9000))
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        out[rel] = data
    return out


def test_eviction_under_zero_copy_readers_never_returns_wrong_bytes(tmp_path, mount,
                                                                    monkeypatch):
    """A cache of 256K, two trees of ~1.1 MB: threads read tree A from the cache directly
    for several epochs while the main thread reads tree B through the mount, so chunks
    are evicted (holes punched) all the time. First, three times on purpose, a record's
    chunk is evicted between the reader's lookup and its read (the pread waits until the
    daemon has punched the range). Every sample returned equals the source."""
    rnd = random.Random(11)
    src = tmp_path / "src"
    a = tree(src, "a", 200, rnd)
    b = tree(src, "b", 200, rnd)
    m = mount(src, *QUICK, "--cache-size", "256K", "--chunk-size", "32K", "--memory", "1M")
    r = CacheReader.for_path(m.mnt)
    assert r is not None
    raced: list[int] = []
    b_cycle = itertools.cycle(b)

    def evicting_pread(fd: int, size: int, offset: int) -> bytes:
        first = os.pread(fd, size, offset)

        def punched() -> bool:  # B through the mount until this range is punched
            for _ in range(20):
                read_path(str(m.mnt / next(b_cycle)))
            return os.pread(fd, size, offset) != first

        wait_until(punched, "the record's chunk was not evicted", timeout=120)
        raced.append(offset)
        return os.pread(fd, size, offset)

    for rel in list(a)[:3]:
        read_path(str(m.mnt / rel))  # cached again, and indexed
        m.wait_stats(lambda s: s["pending_bytes"] == 0, "the writer did not settle")
        monkeypatch.setattr(readonly, "_pread", evicting_pread)
        assert r.read(m.mnt / rel) == a[rel]
        monkeypatch.setattr(readonly, "_pread", os.pread)
    assert len(raced) == 3
    assert r.counts()["mismatch"] == 3  # the three raced reads fell back to the mount

    wrong: list[str] = []
    stop = threading.Event()

    def zero_copy_epochs(seed: int) -> None:
        order = list(a)
        rng = random.Random(seed)
        try:
            for _ in range(3):
                rng.shuffle(order)
                for rel in order:
                    if r.read(m.mnt / rel) != a[rel]:
                        wrong.append(rel)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            wrong.append(repr(e))
        finally:
            stop.set()

    threads = [threading.Thread(target=zero_copy_epochs, args=(k,)) for k in range(4)]
    evicted0 = m.stats()["chunks_evicted"]
    for t in threads:
        t.start()
    while not stop.is_set():  # B through the mount, evicting A's chunks
        for rel in b:
            if stop.is_set():
                break
            assert read_path(str(m.mnt / rel)) == b[rel]
    for t in threads:
        t.join()
    assert wrong == []
    st = m.stats()
    assert st["chunks_evicted"] > evicted0  # the readers ran under eviction
    c = r.counts()
    assert c["hits"] > 0 and c["not_cached"] > 0
    assert c["errors"] == 0
