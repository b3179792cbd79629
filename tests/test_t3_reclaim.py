"""A stopped dataset of a shared root gives space back (dlcachefs.store.reclaim), in the
core: a dataset cached by a real session and stopped, then evicted from as a live daemon
of the root does. Its index drops the oldest chunks in one commit, the disk gives their
bytes back, its ledger entry is lowered after, its index stays marked clean, and a new
session of the dataset serves the rest and fetches only what was evicted."""

from __future__ import annotations

import fcntl
import os
import random
from pathlib import Path

import pytest

from dlcachefs.config import DATASETS_DIR
from dlcachefs.store import integrity
from dlcachefs.store import ledger as L
from dlcachefs.store import schema as S
from dlcachefs.store.index import Index
from dlcachefs.store.lock import LOCK_NAME
from dlcachefs.store.reclaim import evict_stopped, evict_stopped_in_child
from dlcachefs.testing.fakes import make_config, read_all, run_session, write_tree


def _stopped_dataset(tmp_path: Path) -> tuple[dict[bytes, bytes], object, Path]:
    rnd = random.Random(5)
    files = {f"c{i % 3}/f{i:02d}".encode(): rnd.randbytes(rnd.randrange(20_000, 40_000))
             for i in range(30)}
    write_tree(tmp_path / "src", files)
    cfg = make_config(tmp_path / "src", tmp_path / "root", cache_size=8 << 20,
                      shared_cache=True, dataset="c", chunk_size=64 << 10)

    async def body(sess):
        for rel, data in files.items():
            assert await read_all(sess.engine, rel) == data
        await sess.engine.flush()

    run_session(cfg, body)  # closed: its entry in the ledger is "stopped"
    d = tmp_path / "root" / DATASETS_DIR / "c"
    (d / LOCK_NAME).touch()  # as its daemon left it
    integrity.mark_clean(str(d / "meta.lmdb"))  # as a clean stop leaves it
    return files, cfg, d


def _stopped(e: dict) -> bool:
    return e.get("state") == "stopped"


def test_a_stopped_dataset_is_evicted_oldest_first_and_refetches_only_that(tmp_path):
    files, cfg, d = _stopped_dataset(tmp_path)
    root = str(tmp_path / "root")
    led = L.Ledger(root)
    before = led.read()["datasets"]["c"]
    assert before["state"] == "stopped" and before["limit"] == before["used"] > 0
    ix = Index(str(d / "meta.lmdb"))
    chunks = list(ix.iter_chunks())
    ix.close()
    disk0 = sum(p.stat().st_blocks * 512 for p in (d / "logs").glob("*.log"))
    want = before["limit"] // 2
    # as a daemon runs it: in a child process (LMDB opens an environment once a process)
    r = evict_stopped_in_child(root, DATASETS_DIR, "c", want, before["heartbeat"])
    assert r.skipped is None and r.freed >= want and r.left == before["limit"] - r.freed
    # the oldest chunks, whole, and no more than needed
    ids = [c.chunk_id for c in chunks]
    assert r.chunks < len(chunks) and sum(c.length for c in chunks[:r.chunks]) == r.freed
    assert sum(c.length for c in chunks[:r.chunks - 1]) < want
    after = led.read()["datasets"]["c"]
    assert after["limit"] == after["used"] == r.left and after["reclaimed_bytes"] == r.freed
    disk1 = sum(p.stat().st_blocks * 512 for p in (d / "logs").glob("*.log"))
    assert disk0 - disk1 >= r.freed * 0.9, (disk0, disk1, r.freed)  # the disk gave it back
    # as its clean stop left it: the next start need not walk it
    assert integrity.unchanged_since_clean_stop(str(d / "meta.lmdb"))
    ix = Index(str(d / "meta.lmdb"))
    try:
        assert [c.chunk_id for c in ix.iter_chunks()] == ids[r.chunks:]
        assert ix.counter(S.K_CHUNK_BYTES) == r.left
        assert ix.check_invariants() == []
        kept = ix.counter(S.K_CACHED_BYTES)
    finally:
        ix.close()

    async def again(sess):
        for rel, data in files.items():
            assert await read_all(sess.engine, rel) == data
        return sess.engine.counters.bytes_from_source

    fetched, _ = run_session(cfg, again)
    assert fetched == sum(map(len, files.values())) - kept  # only what was evicted


def test_a_dataset_in_use_or_not_cleanly_stopped_is_left_alone(tmp_path):
    files, cfg, d = _stopped_dataset(tmp_path)
    root = str(tmp_path / "root")
    led = L.Ledger(root)
    limit = led.read()["datasets"]["c"]["limit"]
    fd = os.open(d / LOCK_NAME, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a daemon runs on it
        assert evict_stopped(root, DATASETS_DIR, "c", 1, _stopped).skipped == "in use"
    finally:
        os.close(fd)
    assert evict_stopped(root, DATASETS_DIR, "c", 1, lambda e: False).skipped \
        == "no longer stopped"
    # another stop than the one chosen (mounted and stopped again meanwhile)
    assert evict_stopped_in_child(root, DATASETS_DIR, "c", 1, 1.0).skipped \
        == "no longer stopped"
    integrity.unchanged_since_clean_stop(str(d / "meta.lmdb"))  # the mark gone: a crash
    assert evict_stopped(root, DATASETS_DIR, "c", 1, _stopped).skipped \
        == "not as its clean stop left it"
    assert led.read()["datasets"]["c"]["limit"] == limit  # nothing changed


def test_a_crash_between_the_commit_and_the_punches_leaves_a_sound_cache(tmp_path, monkeypatch):
    """The eviction dies after its index commit, before any hole is punched (as a kill
    there would leave it): the index is not marked clean (its next start walks it), the
    ledger still counts the larger limit (over-counted, never under), and a new session
    serves every file exactly, from the cache what it still indexes."""
    from dlcachefs.store import logs as logs_mod  # noqa: PLC0415

    files, cfg, d = _stopped_dataset(tmp_path)
    root = str(tmp_path / "root")
    led = L.Ledger(root)
    before = led.read()["datasets"]["c"]

    def die(*_a, **_k):
        raise RuntimeError("killed")

    monkeypatch.setattr(logs_mod.LogStore, "release", die)
    with pytest.raises(RuntimeError, match="killed"):
        evict_stopped(root, DATASETS_DIR, "c", before["limit"] // 3, _stopped)
    monkeypatch.undo()
    assert not integrity.unchanged_since_clean_stop(str(d / "meta.lmdb"))  # walked next
    assert led.read()["datasets"]["c"]["limit"] == before["limit"]  # over-counted only
    ix = Index(str(d / "meta.lmdb"))
    try:
        assert ix.check_invariants() == []
        left, kept = ix.counter(S.K_CHUNK_BYTES), ix.counter(S.K_CACHED_BYTES)
    finally:
        ix.close()
    assert 0 < left < before["limit"]

    async def again(sess):
        for rel, data in files.items():
            assert await read_all(sess.engine, rel) == data
        return sess.engine.counters.bytes_from_source

    fetched, _ = run_session(cfg, again)
    assert fetched == sum(map(len, files.values())) - kept


def test_a_mount_during_a_reclaim_waits_for_it_instead_of_being_refused(tmp_path):
    """The reclaim's child names itself in the dataset's lock file while it holds the lock:
    a mount of that dataset starting meanwhile waits for the lock (RECLAIM_WAIT_S) and
    gets it once the child is done. The stopped daemon's name left there (mounted, say,
    at a mountpoint another mount uses now) refused the mount at once."""
    import subprocess
    import sys

    from dlcachefs.store.lock import CacheLock, CacheLocked

    d = tmp_path / "ds"
    d.mkdir()
    (d / LOCK_NAME).write_text('{"pid": 1, "mountpoint": "/somewhere"}')
    # a reclaim holding the lock for a second (what store.reclaim._hold_if_free does)
    holder = subprocess.Popen([sys.executable, "-c", f"""
import time
from dlcachefs.store.reclaim import _hold_if_free
with _hold_if_free({str(d)!r}) as held:
    assert held
    print("held", flush=True)
    time.sleep(1.0)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        lock = CacheLock(str(d), dataset="ds", is_mounted=lambda p: True)
        lock.acquire("/mnt/new")  # waits for the reclaim (refused at once before)
        lock.release()
    finally:
        holder.wait(30)
    # a live daemon's name there (mounted): refused at once, as before
    with open(d / LOCK_NAME, "r+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.truncate(0)
        f.write('{"pid": 1, "mountpoint": "/somewhere"}')
        f.flush()
        with pytest.raises(CacheLocked):
            CacheLock(str(d), dataset="ds", is_mounted=lambda p: True).acquire("/mnt/new")
