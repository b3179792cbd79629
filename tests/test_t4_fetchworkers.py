"""Mounted tests of ``--fetch-workers``: files a stream's prefetch fetches ahead are read,
checksummed and appended by worker processes, indexed by the daemon."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
from conftest import requires_fuse

from dlcachefs.cache.fetchworker import TEAR_ENV
from dlcachefs.store.chunkfmt import LOG_HEADER_SIZE
from dlcachefs.store.index import Index
from dlcachefs.testing.mounting import STALE_MOUNT, drop_page_cache, wait_until

pytestmark = requires_fuse

WORKER_GONE = r"WARNING dlcachefs\.cache\.fetchpool: fetch worker \d+ \(pid \d+\) is gone"


def make_tree(root: Path, n: int = 120, seed: int = 3) -> list[Path]:
    """``n`` files in ImageFolder's layout; in ImageFolder's order."""
    rnd = random.Random(seed)
    files = []
    for i in range(n):
        p = root / "train" / f"class{i % 4}" / f"{i:04d}.jpg"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rnd.randbytes(rnd.choice([0, 1, 5_000, 40_000, 120_000])))
        files.append(p)
    return sorted(files, key=lambda p: (p.parent.name, p.name))


def announce(mnt: Path, n: int, seed: int = 0) -> list[int]:
    """An explicit order of epoch 0 over the whole dataset, announced; the order."""
    order = random.Random(seed).sample(range(n), n)
    text = ("job j\ndataset train\nsampler explicit\n"
            f"order 0 0 {' '.join(map(str, order))}\norder 0 end {n}\nepoch 0\n")
    fd = os.open(mnt / ".dlcache" / "control", os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    return order


def read_exact(mnt: Path, src: Path, files: list[Path]) -> None:
    for p in files:
        rel = p.relative_to(src)
        assert (mnt / rel).read_bytes() == p.read_bytes(), rel


def worker_pids(st: dict) -> list[int]:
    return list((st.get("fetch_workers") or {}).get("pids") or [])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def logs_match_index(cache: Path) -> None:
    """Every log ends where its last indexed chunk ends (recovery cut every tail)."""
    idx = Index(str(cache / "meta.lmdb"))
    try:
        ends: dict[int, int] = {}
        for c in idx.iter_chunks():
            ends[c.log_id] = max(ends.get(c.log_id, LOG_HEADER_SIZE), c.offset + c.length)
    finally:
        idx.close()
    for p in (cache / "logs").iterdir():
        log_id = int(p.name.split(".")[0])
        assert log_id in ends, f"{p.name}: nothing indexed in it, yet it is there"
        assert p.stat().st_size == ends[log_id], p.name


def test_prefetched_files_are_fetched_by_workers_exactly_and_survive_a_remount(tmp_path, mount):
    src = tmp_path / "src"
    files = make_tree(src)
    m = mount(src, "--fetch-workers", "2", "--scan-ahead", "0")
    order = announce(m.mnt, len(files))
    st = m.wait_stats(lambda s: s["fetch_workers"]["files"] >= len(files) - 1
                      and s["prefetched"] >= len(files) and s["pending_bytes"] == 0,
                      "the workers did not fetch the epoch", timeout=120)
    assert st["misses"] == 0
    assert st["fetch_workers"]["fallbacks"] == 0 and st["fetch_workers"]["restarts"] == 0
    pids = worker_pids(st)
    assert len(pids) == 2 and all(alive(p) for p in pids) and m.pid not in pids
    assert st["cached_files"] >= len(files) - 1  # (an empty file may not count)
    drop_page_cache()
    read_exact(m.mnt, src, [files[i] for i in order])
    st = m.stats()
    assert st["misses"] == 0 and st["bytes_from_source"] == sum(p.stat().st_size for p in files)
    m.umount()
    assert not any(alive(p) for p in pids)  # a clean stop ends them
    m2 = mount(src, "--fetch-workers", "2")
    drop_page_cache()
    read_exact(m2.mnt, src, files)
    st = m2.stats()
    assert st["bytes_from_source"] == 0 and st["misses"] == 0


@pytest.mark.daemon_log_allows(WORKER_GONE, STALE_MOUNT)
def test_a_worker_killed_mid_append_leaves_nothing_torn_and_dies_with_the_daemon(
        tmp_path, mount, monkeypatch):
    """One worker writes half a chunk and is SIGKILLed (the test hook): its files are
    fetched again, by the daemon, and served exactly; another worker takes its place.
    Then the daemon is SIGKILLed: its workers die with it, and the next start cuts every
    log back to its indexed end (the torn half chunk included); verify finds nothing
    wrong (the mount fixture runs it)."""
    src = tmp_path / "src"
    files = make_tree(src)
    marker = tmp_path / "tore"
    monkeypatch.setenv(TEAR_ENV, str(marker))
    m = mount(src, "--fetch-workers", "2", "--scan-ahead", "0")
    order = announce(m.mnt, len(files))
    st = m.wait_stats(lambda s: s["prefetched"] >= len(files) and s["pending_bytes"] == 0,
                      "the epoch was not fetched", timeout=120)
    assert marker.exists()
    assert st["fetch_workers"]["restarts"] >= 1 and st["fetch_workers"]["fallbacks"] >= 1
    read_exact(m.mnt, src, [files[i] for i in order])
    assert m.stats()["misses"] == 0
    # a torn tail stays in the dead worker's log until the next start (nothing indexes it)
    cache = tmp_path / "cache"
    pids = worker_pids(m.stats())
    assert pids
    m.kill9()
    wait_until(lambda: not any(alive(p) for p in pids), "fetch workers outlived the daemon")
    monkeypatch.delenv(TEAR_ENV)
    m2 = mount(src, "--fetch-workers", "2")
    drop_page_cache()
    read_exact(m2.mnt, src, files)
    assert m2.stats()["bytes_from_source"] == 0
    m2.umount()
    logs_match_index(cache)


def test_opens_that_catch_up_with_the_workers_get_exact_bytes_read_once(tmp_path, mount):
    """Readers start with the announcement: an open of a file a worker is fetching waits
    for it and gets its bytes back from the log (or, before the prefetch reached it,
    fetches it itself); every byte exact, every file read from the source once."""
    src = tmp_path / "src"
    files = make_tree(src, n=300)
    m = mount(src, "--fetch-workers", "1", "--scan-ahead", "0")
    order = announce(m.mnt, len(files))
    read_exact(m.mnt, src, [files[i] for i in order])
    st = m.wait_stats(lambda s: s["pending_bytes"] == 0, "the writer did not drain")
    assert st["bytes_from_source"] == sum(p.stat().st_size for p in files)
    assert st["fetch_workers"]["fallbacks"] == 0  # (how many the workers took: timing)


def test_scan_ahead_files_are_written_by_the_workers_exactly(tmp_path, mount):
    """A reader that announced nothing reads an ImageFolder tree in a random order: after
    its first opens scan-ahead fetches the rest, through the workers (none by the daemon:
    every cached file is either one of the reader's misses, which the daemon's writer
    cached, or a worker's); the rest of the epoch is hits, byte for byte the source's,
    every file read from the source once; after a remount, all from the logs."""
    src = tmp_path / "src"
    rnd = random.Random(11)
    files = []
    for i in range(160):
        p = src / "train" / f"class{i % 4}" / f"{i:04d}.jpg"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rnd.randbytes(rnd.randint(3_000, 30_000)))
        files.append(p)
    order = files[:]
    rnd.shuffle(order)
    m = mount(src, "--fetch-workers", "2", "--chunk-size", "256K")
    read_exact(m.mnt, src, order[:32])  # the 32nd open starts the scan

    def scanned(st: dict) -> bool:
        # the reader stays active (a scan pauses when its readers are idle): a hit
        read_exact(m.mnt, src, order[:1])
        return st["scan_ahead"].get("train", {}).get("state") == "done" \
            and st["pending_bytes"] == 0

    st = m.wait_stats(scanned, "the scan-ahead of train did not finish", timeout=120)
    pool = st["fetch_workers"]
    assert st["scan_ahead"]["train"]["files"] == st["scan_ahead_files"] == len(files) - 32
    assert pool["scan_ahead"] == pool["files"] == st["scan_ahead_files"]
    assert pool["fallbacks"] == 0 and pool["restarts"] == 0
    assert st["misses"] == 32 and st["cached_files"] == st["misses"] + pool["files"]
    read_exact(m.mnt, src, order[32:])
    st = m.stats()
    assert st["misses"] == 32
    assert st["bytes_from_source"] == sum(p.stat().st_size for p in files)
    m.umount()
    m2 = mount(src, "--fetch-workers", "2", "--scan-ahead", "0")
    read_exact(m2.mnt, src, files)
    st = m2.stats()
    assert st["bytes_from_source"] == 0 and st["misses"] == 0
