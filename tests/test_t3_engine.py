"""Tier 3: the cache engine without a kernel (Engine driven directly under trio).

Every test checks ``index.check_invariants() == []`` when its engine closes (run_engine).

One suite for every variant: each test runs once per registered policy (the ``policy``
fixture), since what they check is the engine's (the read path, damage and recovery,
source errors, the ``--cache-size`` account), whatever the policy decides. One scenario
cannot be set up for every policy: :func:`test_concurrent_seals_respect_cache_size` needs
a full cache that makes room by eviction, and iCACHE admits no sample into a full H-cache
before it knows any importance (it refuses rather than evicts), so it is skipped there.
Tests of one policy's own decisions live in ``test_t2_policies.py``, ``test_t3_packer.py``
and ``test_t7_importance.py``.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import random
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlcachefs.cache.namespace import ROOT_INO, identity
from dlcachefs.errors import (
    InvalidArgument,
    IsADirectory,
    NotFound,
    SourceChanged,
    SourceError,
    SourceTimeout,
)
from dlcachefs.session import policies
from dlcachefs.store import schema as S
from dlcachefs.store.chunkfmt import CHUNK_HEADER_SIZE
from dlcachefs.testing.fakes import (
    ChangingSource,
    CountingSource,
    FailingSource,
    HangingMetaSource,
    HangingSource,
    SlowSource,
    make_config,
    read_all,
    read_source,
    run_engine,
    run_session,
    write_tree,
)


@pytest.fixture(scope="module", params=sorted(policies()))
def policy(request) -> str:
    """Every registered policy, by name (``--policy``). Module scope: a plain value, and
    the hypothesis test below may use it (no function-scoped state between examples)."""
    return request.param


def sample_files(seed: int = 0) -> dict[bytes, bytes]:
    rng = random.Random(seed)
    files: dict[bytes, bytes] = {}
    for c in range(3):
        for i in range(8):
            files[b"train/cls%d/img%02d.jpg" % (c, i)] = rng.randbytes(rng.randrange(1, 20_000))
    files[b"train/empty"] = b""
    files[b"val/\xff\xfe-not-utf8.bin"] = rng.randbytes(3000)
    files[b"top.txt"] = b"hello\n"
    files[b"big.bin"] = rng.randbytes(150_000)  # larger than a chunk: sealed alone
    return files


@pytest.fixture
def tree(tmp_path):
    """(source dir, cache dir, files): a small dataset on the 'slow' side."""
    src, cache = tmp_path / "src", tmp_path / "cache"
    files = sample_files()
    write_tree(src, files)
    return src, cache, files


async def read_everything(eng, files, order=None, flush=False) -> None:
    """Read every file and compare. ``flush``: seal after each one, so that none is skipped
    by a writer that is behind (the fetch path never waits for the writer)."""
    for rel in order or sorted(files):
        assert await read_all(eng, rel) == files[rel], rel
        if flush:
            await eng.flush()


def cold_read(src: Path, cache: Path, files, policy: str, **cfg_kw):
    """A fresh engine on ``cache`` reads every file once; returns (engine, source)."""
    source = CountingSource(src)

    async def body(eng):
        await read_everything(eng, files, flush=True)
        assert eng.index.n_records() == len(files)

    _, eng = run_engine(make_config(src, cache, policy=policy, **cfg_kw), body, source)
    return eng, source


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.store\.integrity: the index may be damaged \(CorruptedError: ",
    r"WARNING dlcachefs\.cache\.writer: sealing a chunk failed; serving from the source for "
    r"\d+ s \(the index may be damaged: CorruptedError: ",
    r"WARNING dlcachefs\.cache\.engine: sealing at the stop failed")
def test_a_seal_that_always_fails_ends_neither_in_a_storm_nor_a_stop_that_hangs(
        tree, monkeypatch):
    """``bench.chaos --scenario corrupt --seed 1005``: a damaged page failed every seal of
    a queued drop; the writer retried every 50 ms (a WARNING each) and its stop never
    ended. Retries now back off, and the stop gives up what it cannot commit."""
    import lmdb

    from dlcachefs.store import integrity

    monkeypatch.setattr(integrity, "_run_errors", [])
    src, cache, files = tree
    cfg = make_config(src, cache)
    names = sorted(files)
    run_engine(cfg, lambda eng: read_everything(eng, files, flush=True))

    def damaged(*args, **kwargs):
        raise lmdb.CorruptedError("mdb_del: MDB_CORRUPTED: Located page was wrong type")

    import dlcachefs.cache.writer as writer_mod

    monkeypatch.setattr(writer_mod, "seal_chunks", damaged)

    async def body(eng):
        eng.writer.drop(next(i for i, _ in eng.index.iter_records()))  # a drop to commit
        assert await read_all(eng, names[0]) == files[names[0]]
        for _ in range(100):  # the loop's own seals: 5 s of them, at most ~5 attempts
            await trio.sleep(0.05)
        assert 1 <= eng.counters.write_errors <= 6, eng.counters.write_errors

    run_engine(cfg, body, check_invariants=False)  # returns: the stop ended


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.store\.integrity: the index may be damaged \(CorruptedError: ",
    r"WARNING dlcachefs\.cache\.writer: sealing a chunk failed; serving from the source for "
    r"\d+ s \(the index may be damaged: CorruptedError: ")
def test_damage_met_while_sealing_is_damage_not_an_unexpected_error(tree, monkeypatch, caplog):
    """``bench.chaos --scenario corrupt --seed 77``: ``MDB_CORRUPTED`` raised while a seal
    indexed a record (a page of the mapped index damaged) was logged as an unexpected
    error with its traceback. It goes through the one damage path now: a WARNING without
    a traceback, the run noted as damaged (the stop leaves no clean marker), the bytes
    served from the source meanwhile, exact."""
    import lmdb

    from dlcachefs.store import integrity, seal

    monkeypatch.setattr(integrity, "_run_errors", [])
    src, cache, files = tree
    real, calls = seal._index_record, []

    def damaged(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise lmdb.CorruptedError("mdb_put: MDB_CORRUPTED: Located page was wrong type")
        return real(*args, **kwargs)

    monkeypatch.setattr(seal, "_index_record", damaged)

    async def body(eng):
        await read_everything(eng, files)
        for _ in range(400):  # the writer's own loop seals (as in a daemon), not a flush
            if eng.counters.write_errors:
                break
            await trio.sleep(0.05)
        assert eng.counters.write_errors == 1
        await read_everything(eng, files)  # from the source while caching pauses: exact

    run_engine(make_config(src, cache), body)
    assert integrity.damage_seen()
    ours = [r for r in caplog.records if r.name.startswith("dlcachefs")]
    assert not [r for r in ours if r.exc_info or r.levelname in ("ERROR", "CRITICAL")], ours
    assert any("sealing a chunk failed" in r.getMessage() for r in ours)


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.cache\.recovery: the index's derived values disagreed with its "
    r"entries .*recounted: next_chunk 1 -> \d+")
def test_a_damaged_chunk_counter_never_gives_a_new_chunk_an_indexed_id(tree):
    """A flipped bit in the index's next-chunk counter (the structural check cannot see
    it: the chaos suite's damage scenario) gave the next chunk written the id of one still
    indexed; indexing it replaced that chunk's entry while its log kept counting its bytes,
    and a later eviction by that id deleted the new chunk's log under its entry. New ids
    now start past every chunk indexed, as log ids start past every log file."""
    src, cache, files = tree
    names = sorted(files)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    cfg = make_config(src, cache)

    async def read_some(eng, which):
        for rel in which:
            assert await read_all(eng, rel) == files[rel], rel
            await eng.flush()
        return eng.index.last_chunk_id()

    last, _ = run_engine(cfg, lambda eng: read_some(eng, first))
    assert last >= 2
    from dlcachefs.store.index import Index

    ix = Index(cfg.index_dir)
    try:  # the counter damaged on disk, below the chunks indexed
        with ix.write() as w:
            w.set_meta(S.K_NEXT_CHUNK, (1).to_bytes(8, "little"))
    finally:
        ix.close()

    async def body(eng):
        before = {c.chunk_id: c for c in eng.index.iter_chunks()}
        await read_some(eng, second)
        after = {c.chunk_id: c for c in eng.index.iter_chunks()}
        # no chunk indexed before was replaced by a new one under its id
        assert all(after.get(cid, c) == c for cid, c in before.items())
        assert min(set(after) - set(before)) > last

    run_engine(cfg, body)  # (and the live bytes of every log match its chunks)


# ----- basic read path -----------------------------------------------------------------


def test_first_open_fetches_then_hits(tree, policy):
    src, cache, files = tree
    source = CountingSource(src)

    async def body(eng):
        assert eng.ns.get(ROOT_INO).ino == ROOT_INO
        assert [n for n, _ in eng.ns.children(ROOT_INO)] == [b"big.bin", b"top.txt", b"train",
                                                               b"val"]
        await read_everything(eng, files, flush=True)
        c = eng.counters
        assert c.misses == len(files) and c.hits == 0 and c.cache_skipped == 0
        assert c.bytes_from_source == sum(map(len, files.values()))
        assert source.calls["read_file"] == len(files)
        # later passes in the same mount: memory tier or logs, never the source
        await read_everything(eng, files)
        await read_everything(eng, files)
        assert c.hits == 2 * len(files)
        assert source.calls["read_file"] == len(files)
        assert c.bytes_from_source == sum(map(len, files.values()))
        assert eng.index.n_records() == len(files)
        assert eng.index.counter(S.K_CACHED_BYTES) == sum(map(len, files.values()))
        assert c.chunks_written >= 2 and c.checksum_failures == 0

    run_engine(make_config(src, cache, policy=policy), body, source)


def test_writer_behind_skips_but_serves(tree, policy):
    """Fetches faster than the writer seals: some files are not cached (counted), all are
    served right, and a later read caches them."""
    src, cache, files = tree
    source = CountingSource(src)

    async def body(eng):
        await read_everything(eng, files)  # no flushes: the writer may fall behind
        await eng.flush()
        c = eng.counters
        assert eng.index.n_records() == len(files) - c.cache_skipped
        for _ in range(3):
            await read_everything(eng, files, flush=True)
        assert eng.index.n_records() == len(files)
        assert c.misses == len(files) + c.cache_skipped
        assert sum(source.reads.values()) == c.misses

    run_engine(make_config(src, cache, policy=policy), body, source)


def test_pending_records_are_hits(tree, policy):
    """A fetched file waiting to be sealed is served from the writer's pending set."""
    src, cache, files = tree
    source = CountingSource(src)
    rel = b"top.txt"

    async def body(eng):
        assert await read_all(eng, rel) == files[rel]
        assert eng.ns.resolve(rel).ino in eng.writer.pending
        assert await read_all(eng, rel) == files[rel]
        assert source.reads[rel] == 1 and eng.counters.hits == 1

    run_engine(make_config(src, cache, policy=policy, flush_interval=30.0), body, source)


def test_a_prefetched_file_that_waited_for_the_writer_is_a_hit(tree, policy):
    """A file fetched ahead while the writer had no room waits in the backlog; its open
    is a cache hit, not a ``prefetch_hit`` (opens served from memory only, never cached):
    whether it is cached is asked at the open, not taken from the fetch."""
    src, cache, files = tree
    rel = b"top.txt"

    async def body(sess):
        eng = sess.engine
        e = eng.ns.resolve(rel)
        room = eng.writer.has_room
        # the cache disk is behind: no room for the fetched bytes (the prefetch's own
        # wait for room, nbytes=0, passes)
        eng.writer.has_room = lambda nbytes=0: nbytes == 0
        stream = SimpleNamespace(memory_prefetch=False, bytes_from_source=0,
                                 pages_served=False, key="job/0")
        try:
            assert await sess.prefetcher.prefetch_one(e.ino, stream)
        finally:
            eng.writer.has_room = room
        assert eng.backlog.get(e.ino, identity(e)) is not None  # waiting for the writer
        assert e.ino not in eng.writer.pending
        c = eng.counters
        hits = c.hits
        assert await read_all(eng, rel) == files[rel]
        assert (c.prefetch_hits, c.hits - hits, c.misses) == (0, 1, 0)

    run_session(make_config(src, cache, policy=policy, flush_interval=30.0), body)


def test_read_offsets_and_eof(tree, policy):
    src, cache, files = tree
    rel = b"big.bin"
    data = files[rel]

    async def body(eng):
        e = eng.ns.resolve(rel)
        for _ in range(2):  # from the fetch, then from the cache
            r = await eng.open(e.ino)
            for off, size in [(0, 1), (1, 4096), (70_000, 100_000), (len(data) - 3, 10),
                              (len(data), 10), (len(data) + 5, 10), (0, 0)]:
                assert bytes(await eng.read(r.fh, off, size)) == data[off : off + size]
            eng.release(r.fh)
            await eng.flush()
        with pytest.raises(InvalidArgument):
            await eng.read(r.fh, 0, 10)  # released
        with pytest.raises(IsADirectory):
            await eng.open(eng.ns.resolve(b"train").ino)
        with pytest.raises(NotFound):
            eng.ns.resolve(b"train/nope")

    run_engine(make_config(src, cache, policy=policy), body)


def test_concurrent_opens_share_one_fetch(tree, policy):
    src, cache, files = tree
    source = SlowSource(src, delay=0.2)
    rel = b"train/cls1/img03.jpg"

    async def body(eng):
        results = []

        async def one():
            results.append(await read_all(eng, rel))

        async with trio.open_nursery() as n:
            for _ in range(5):
                n.start_soon(one)
        assert results == [files[rel]] * 5
        assert source.reads[rel] == 1
        assert eng.counters.misses == 5 and eng.counters.fetch_waits == 4

    run_engine(make_config(src, cache, policy=policy), body, source)


def test_cancelled_fetch_does_not_cancel_other_openers(tree, policy):
    """Regression: when the open that started a shared fetch is cancelled, the other opens
    of the file fetch it themselves; they never receive the first one's Cancelled."""
    src, cache, files = tree
    source = SlowSource(src, delay=0.3)
    rel = b"train/cls0/img01.jpg"

    async def body(eng):
        got = []
        first_done = trio.Event()

        async def cancelled_opener():
            with trio.move_on_after(0.05) as cs:
                await read_all(eng, rel)
            first_done.set()
            assert cs.cancelled_caught

        async def other_opener():
            ino = eng.ns.resolve(rel).ino
            # joins the fetch the first one started (polled: the first one may be scheduled
            # later; on a stalled machine it may already be over, then this one fetches)
            while not eng.fetcher.in_flight(ino) and not first_done.is_set():
                await trio.sleep(0.001)
            got.append(await read_all(eng, rel))

        with trio.fail_after(20):
            async with trio.open_nursery() as n:
                n.start_soon(cancelled_opener)
                n.start_soon(other_opener)
        assert got == [files[rel]]

    run_engine(make_config(src, cache, policy=policy), body, source)


# ----- remount -------------------------------------------------------------------------


@pytest.mark.parametrize("revalidate", [3600.0, 0.0])
def test_remount_serves_from_cache(tree, revalidate, policy):
    src, cache, files = tree
    cold_read(src, cache, files, policy)
    source = CountingSource(src)

    async def body(eng):
        await read_everything(eng, files)
        c = eng.counters
        assert c.bytes_from_source == 0
        assert c.hits == len(files) and c.misses == 0
        assert c.bytes_from_cache == sum(map(len, files.values()))
        assert c.chunk_reads + c.record_reads > 0

    _, eng = run_engine(make_config(src, cache, policy=policy, revalidate=revalidate), body, source)
    assert source.calls["read_file"] == 0
    assert source.calls["list_dir"] == 0  # the namespace snapshot was reused, no rescan


def test_remount_with_single_record_reads(tree, policy):
    """A memory tier too small for whole chunks: records are read one by one, verified."""
    src, cache, files = tree
    cold_read(src, cache, files, policy)

    async def body(eng):
        await read_everything(eng, files)
        assert eng.counters.record_reads > 0
        assert eng.counters.bytes_from_source == 0

    run_engine(make_config(src, cache, policy=policy, memory=4096), body)


def test_an_open_loads_nothing_until_its_first_read(tree, policy):
    """The kernel serves a file whose pages it holds without a READ: an open alone must
    not read the file from the cache disk (a cat pass used to read the whole cache back),
    yet it is a hit, and its use still reaches the policy."""
    src, cache, files = tree
    cold_read(src, cache, files, policy)
    rel = b"train/cls1/img03.jpg"
    source = CountingSource(src)

    async def body(sess):
        eng = sess.engine
        seen = []
        orig = eng.reader.after_use
        eng.reader.after_use = lambda cid, ino: (seen.append(ino), orig(cid, ino))[1]
        e = eng.ns.resolve(rel)
        for _ in range(3):
            r = await eng.open(e.ino)
            assert r.keep_cache and not r.direct_io
            eng.release(r.fh)
        assert sess.stats()["cache_disk_bytes_read"] == 0
        assert eng.counters.record_reads == eng.counters.chunk_reads == 0
        assert eng.counters.hits == 3 and eng.counters.bytes_from_cache == 0
        assert seen == [e.ino] * 3
        assert await read_all(eng, rel) == files[rel]  # the READ loads it
        assert sess.stats()["cache_disk_bytes_read"] >= len(files[rel])
        assert seen == [e.ino] * 4  # once per open, read or not
        assert sum(source.reads.values()) == 0

    run_session(make_config(src, cache, policy=policy), body, source)


async def _open_then(eng, rel, between):
    """open ``rel`` (a lazy handle), run ``between``, then read it whole; the bytes."""
    r = await eng.open(eng.ns.resolve(rel).ino)
    try:
        await between()
        out = bytearray()
        while piece := await eng.read(r.fh, len(out), 4096):
            out += piece
        return bytes(out)
    finally:
        eng.release(r.fh)


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.cache\.reader: cached copy of .* is damaged or unreadable")
def test_a_cached_file_lost_between_open_and_read_is_fetched(tree, policy):
    """The record an open saw is gone by its first READ (its log lost, as an eviction
    would): the opened version is fetched from the source, counted."""
    src, cache, files = tree
    cold_read(src, cache, files, policy)
    rel = b"train/cls2/img05.jpg"
    _, rec, log_path, _ = record_location(cache, src, rel, policy)
    source = CountingSource(src)

    async def body(eng):
        async def lose_log():
            os.unlink(log_path)

        assert await _open_then(eng, rel, lose_log) == files[rel]
        assert eng.counters.lazy_refetches == 1 and source.reads[rel] == 1

    run_engine(make_config(src, cache, policy=policy, memory=4096), body, source)


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.cache\.reader: cached copy of .* is damaged or unreadable")
def test_a_file_changed_and_lost_between_open_and_read_is_an_error(tree, policy):
    """Lost and changed on the source between open and READ: the opened version exists
    nowhere, so the READ fails (ESTALE); never the new version's bytes under the old
    size the kernel was given."""
    src, cache, files = tree
    cold_read(src, cache, files, policy)
    rel = b"train/cls0/img06.jpg"
    _, rec, log_path, _ = record_location(cache, src, rel, policy)

    async def body(eng):
        async def change_and_lose():
            rewrite(src / os.fsdecode(rel), files[rel] + b"grown")
            os.unlink(log_path)

        with pytest.raises(SourceChanged):
            await _open_then(eng, rel, change_and_lose)
        assert eng.counters.lazy_refetches == 0
        assert await read_all(eng, rel) == files[rel] + b"grown"  # a new open: new version

    run_engine(make_config(src, cache, policy=policy, memory=4096, revalidate=0), body)


def test_a_record_moved_between_open_and_read_is_read_where_it_is_now(tree, policy):
    """The same version sealed again elsewhere (as a reordered log takes it) and its old
    chunk evicted between open and READ: read from its new place, not from the source."""
    src, cache, files = tree
    cold_read(src, cache, files, policy)
    rel = b"train/cls1/img02.jpg"
    source = CountingSource(src)

    async def body(eng):
        e = eng.ns.resolve(rel)
        old = eng.index.get_record(e.ino)

        async def move():
            eng.writer.drop(e.ino)  # cached again, the same version, in another chunk
            await eng.flush()
            assert await read_all(eng, rel) == files[rel]
            await eng.flush()
            new = eng.index.get_record(e.ino)
            assert new is not None and new.chunk_id != old.chunk_id
            for ino, r in list(eng.index.iter_records()):  # empty the old chunk, retire it
                if r.chunk_id == old.chunk_id and ino != e.ino:
                    eng.writer.drop(ino)
            await eng.flush()
            eng.writer.retire_chunk(old.chunk_id)
            await eng.flush()
            assert eng.index.get_chunk(old.chunk_id) is None

        assert await _open_then(eng, rel, move) == files[rel]
        assert eng.counters.lazy_refetches == 0 and source.reads[rel] == 1  # (the move's)

    run_engine(make_config(src, cache, policy=policy, memory=4096), body, source)


def test_an_open_of_an_older_version_never_reads_once_a_newer_is_known(tree, policy):
    """Opened (lazily, its bytes still cached), then a newer open sees the file changed:
    the older handle's READ would fill the kernel's pages, shared with the newer open,
    with old bytes. It fails (ESTALE) instead."""
    src, cache, files = tree
    cold_read(src, cache, files, policy)
    rel = b"train/cls2/img03.jpg"

    async def body(eng):
        e = eng.ns.resolve(rel)
        r = await eng.open(e.ino)
        rewrite(src / os.fsdecode(rel), files[rel] + b"v2")
        assert await read_all(eng, rel) == files[rel] + b"v2"  # the newer open
        with pytest.raises(SourceChanged):
            await eng.read(r.fh, 0, 4096)
        eng.release(r.fh)

    run_engine(make_config(src, cache, policy=policy, revalidate=0), body)


def test_pages_are_given_with_an_open_that_holds_them_at_its_first_open_only(tree):
    """``Engine.pages_for_kernel`` (``--store-pages``): a miss's bytes, at its open; a
    cached file's only at its first open in the mount (later the kernel may hold its
    pages already, and whether READs come is the page-cache verdict); never above the
    bound, for a handle that loads at its first READ, or once a newer version is known."""
    src, cache, files = tree
    rel, big = b"train/cls0/img01.jpg", b"big.bin"

    async def first_mount(eng):
        e = eng.ns.resolve(rel)
        r = await eng.open(e.ino)  # a miss
        assert bytes(eng.pages_for_kernel(r.fh)) == files[rel]
        eng.note_pages_stored(r.fh)
        assert eng.counters.pages_stored == 1
        eng.release(r.fh)
        await eng.flush()
        r = await eng.open(e.ino)  # cached now, and opened before in this mount
        assert eng.pages_for_kernel(r.fh) is None
        eng.release(r.fh)
        # held at the open this time (fetched ahead), but not the first open: the
        # kernel may hold pages of it (of this version or, had it changed, another)
        eng.readahead.put(e.ino, identity(e), eng.index.get_record(e.ino), files[rel], "t")
        r = await eng.open(e.ino)
        h = eng.handles[r.fh]
        assert h.data is not None and h.cached
        assert eng.pages_for_kernel(r.fh) is None
        eng.release(r.fh)
        r = await eng.open(eng.ns.resolve(big).ino)  # above the bound
        assert eng.pages_for_kernel(r.fh) is None
        eng.release(r.fh)
        await eng.flush()

    run_engine(make_config(src, cache, store_pages=100_000), first_mount)

    async def second_mount(eng):
        e = eng.ns.resolve(rel)
        r = await eng.open(e.ino)  # cached, loaded lazily at its first READ: nothing held
        assert eng.pages_for_kernel(r.fh) is None
        eng.release(r.fh)

    run_engine(make_config(src, cache, store_pages=100_000), second_mount)

    async def third_mount(eng):
        # cached and held at the open (the read-ahead set), the first open of this mount
        e = eng.ns.resolve(rel)
        eng.readahead.put(e.ino, identity(e), eng.index.get_record(e.ino), files[rel], "t")
        r = await eng.open(e.ino)
        assert bytes(eng.pages_for_kernel(r.fh)) == files[rel]
        rewrite(src / os.fsdecode(rel), files[rel] + b"v2")
        assert await read_all(eng, rel) == files[rel] + b"v2"  # a newer open sees it
        assert eng.pages_for_kernel(r.fh) is None  # the older version's pages: never
        eng.release(r.fh)

    run_engine(make_config(src, cache, store_pages=100_000, revalidate=0), third_mount)


def test_an_older_miss_never_reads_once_a_newer_version_is_known(tree, policy):
    """A miss's handle (the file fetched at its open) fills the kernel's pages with its
    READs as a cached one does: once a newer open has seen the file change (and the
    kernel dropped its pages), the older handle's READ fails (ESTALE) rather than put
    the old bytes back into pages the newer opens share."""
    src, cache, files = tree
    rel = b"train/cls1/img05.jpg"

    async def body(eng):
        e = eng.ns.resolve(rel)
        r = await eng.open(e.ino)  # a miss: fetched now
        assert not eng.handles[r.fh].cached
        assert bytes(await eng.read(r.fh, 0, 1 << 20)) == files[rel]
        rewrite(src / os.fsdecode(rel), files[rel][:100] + b"v2")
        assert await read_all(eng, rel) == files[rel][:100] + b"v2"  # the newer open
        with pytest.raises(SourceChanged):
            await eng.read(r.fh, 0, 4096)
        eng.release(r.fh)

    run_engine(make_config(src, cache, policy=policy, revalidate=0), body)


def test_a_second_version_waiting_for_the_writer_is_not_queued_beside_the_first(tree):
    """Two versions of one file fetched before the first is sealed (a file replaced on
    the source between two opens): the second is not cached now. Queued beside the
    first, the older open record was no longer readable from pending, and the two could
    be indexed in either order (an invariant a churning source broke)."""
    src, cache, files = tree
    rel = b"top.txt"

    async def body(eng):
        e = eng.ns.resolve(rel)
        ident = identity(e)
        assert eng.writer.submit(e.ino, rel, ident, files[rel])
        newer = dataclasses.replace(ident, mtime_ns=ident.mtime_ns + 1)
        skipped = eng.counters.cache_skipped
        assert not eng.writer.submit(e.ino, rel, newer, files[rel] + b"v2")
        assert eng.counters.cache_skipped == skipped + 1
        assert eng.writer.pending[e.ino].ident == ident
        assert eng.check_invariants() == []
        assert eng.writer.submit(e.ino, rel, ident, files[rel])  # the same version: queued

    run_engine(make_config(src, cache, flush_interval=30.0), body)


def test_ino_bits_are_a_set():
    from dlcachefs.cache.engine import InoBits

    @given(st.lists(st.integers(0, 5000), max_size=300))
    @settings(max_examples=200, deadline=None)
    def check(inos):
        bits, seen = InoBits(), set()
        for ino in inos:
            assert bits.add(ino) == (ino not in seen)
            seen.add(ino)

    check()


def test_concurrent_first_reads_of_one_open_load_it_once(tree, policy):
    src, cache, files = tree
    cold_read(src, cache, files, policy)
    rel = b"big.bin"

    async def body(eng):
        r = await eng.open(eng.ns.resolve(rel).ino)
        got = {}

        async def read_at(off):
            got[off] = bytes(await eng.read(r.fh, off, 50_000))

        async with trio.open_nursery() as n:
            for off in (0, 50_000, 100_000):
                n.start_soon(read_at, off)
        eng.release(r.fh)
        assert b"".join(got[o] for o in sorted(got)) == files[rel]
        assert eng.counters.record_reads + eng.counters.chunk_reads == 1

    run_engine(make_config(src, cache, policy=policy), body)


# ----- damaged cache -------------------------------------------------------------------


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def record_location(cache: Path, src: Path, rel: bytes, policy: str):
    """(ino, Record, log path) of a cached file, looked up in a short-lived engine."""

    async def body(eng):
        ino = eng.ns.resolve(rel).ino
        rec = eng.index.get_record(ino)
        assert rec is not None
        return ino, rec, eng.logs.path(rec.log_id), eng.index.get_chunk(rec.chunk_id)

    res, _ = run_engine(make_config(src, cache, policy=policy), body)
    return res


@pytest.mark.parametrize("memory", [64 << 20, 4096])  # whole-chunk reads, single-record reads
@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.cache\.reader: cached copy of .* is damaged or unreadable")
def test_corrupt_record_is_refetched(tree, memory, policy):
    src, cache, files = tree
    rel = b"train/cls0/img04.jpg"
    cold_read(src, cache, files, policy)
    ino, rec, log_path, _ = record_location(cache, src, rel, policy)
    flip_byte(log_path, rec.offset + rec.size // 2)
    source = CountingSource(src)

    async def body(eng):  # a fresh engine: the memory tier is cold
        assert await read_all(eng, rel) == files[rel]
        assert eng.counters.checksum_failures == 1
        assert source.reads[rel] == 1
        assert eng.counters.misses == 1
        # the rest is still served from the cache, including the damaged chunk's other records
        await read_everything(eng, files)
        assert eng.counters.checksum_failures == 1
        assert sum(source.reads.values()) == 1
        await eng.flush()
        new = eng.index.get_record(ino)
        assert new is not None and new.chunk_id != rec.chunk_id

    run_engine(make_config(src, cache, policy=policy, memory=memory), body, source)

    async def again(eng):  # the re-cached copy is good
        await read_everything(eng, files)
        assert eng.counters.checksum_failures == 0
        assert eng.counters.bytes_from_source == 0

    run_engine(make_config(src, cache, policy=policy), again)


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.cache\.reader: cached copy of .* is damaged or unreadable")
def test_corrupt_record_copied_from_memory_is_refetched(tree, policy):
    """A record whose log pages are in memory is copied on the loop, not read in a
    thread (``record_reads_in_memory``), and checked all the same: a damaged one is
    never served."""
    src, cache, files = tree
    rel = b"train/cls0/img04.jpg"
    cold_read(src, cache, files, policy)
    ino, rec, log_path, _ = record_location(cache, src, rel, policy)
    flip_byte(log_path, rec.offset + rec.size // 2)  # (through the page cache)
    other = next(r for r in files if r != rel)

    async def body(eng):
        assert await read_all(eng, other) == files[other]  # opens the log: the thread
        in_memory = eng.counters.record_reads_in_memory
        assert await read_all(eng, rel) == files[rel]
        assert eng.counters.record_reads_in_memory == in_memory + 1
        assert eng.counters.checksum_failures == 1 and eng.counters.misses == 1

    run_engine(make_config(src, cache, policy=policy, memory=4096), body)


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.cache\.reader: cached copy of .* is damaged or unreadable")
def test_record_being_dropped_is_not_read_again(tree, policy):
    """Regression: while the commit that drops a bad record is in flight, later opens must
    not read (and count, and drop again) that record; the late second drop used to delete
    the freshly re-cached copy in the next commit."""
    import time

    src, cache, files = tree
    rel = b"train/cls1/img06.jpg"
    cold_read(src, cache, files, policy)
    ino, rec, log_path, _ = record_location(cache, src, rel, policy)
    flip_byte(log_path, rec.offset + rec.size // 3)
    source = CountingSource(src)

    async def body(eng):
        orig = eng.writer._commit

        def slow_commit(*args):
            time.sleep(0.3)  # part of the scenario: the drop's commit stays in flight
            return orig(*args)

        eng.writer._commit = slow_commit
        assert await read_all(eng, rel) == files[rel]  # checksum failure, refetch, drop
        with trio.fail_after(10):
            while not eng.writer.committing:  # the drop's commit is in flight
                await trio.sleep(0.005)
        for _ in range(3):
            assert await read_all(eng, rel) == files[rel]
        await eng.flush()
        eng.writer._commit = orig
        await eng.flush()
        assert eng.counters.checksum_failures == 1
        assert source.reads[rel] == 1
        new = eng.index.get_record(ino)
        assert new is not None and new.chunk_id != rec.chunk_id

    run_engine(make_config(src, cache, policy=policy, flush_interval=30.0), body, source)


def test_corrupt_chunk_header_records_still_verified(tree, policy):
    """A damaged chunk header: each record is checked against its own checksum instead."""
    src, cache, files = tree
    rel = b"train/cls2/img01.jpg"
    cold_read(src, cache, files, policy)
    _, rec, log_path, chunk = record_location(cache, src, rel, policy)
    flip_byte(log_path, chunk.offset + 3)  # inside the chunk magic

    async def body(eng):
        await read_everything(eng, files)
        assert eng.counters.checksum_failures == 0
        assert eng.counters.bytes_from_source == 0

    run_engine(make_config(src, cache, policy=policy), body)


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.cache\.reader: cached copy of .* is damaged or unreadable")
def test_every_record_byte_of_a_chunk_corrupted(tree, policy):
    """Damage spread over a whole chunk: every damaged record is refetched, none served."""
    src, cache, files = tree
    cold_read(src, cache, files, policy)
    _, rec, log_path, chunk = record_location(cache, src, b"train/cls0/img00.jpg", policy)
    for off in range(chunk.offset + CHUNK_HEADER_SIZE, chunk.offset + chunk.length, 997):
        flip_byte(log_path, off)
    source = CountingSource(src)

    async def body(eng):
        await read_everything(eng, files)
        assert eng.counters.checksum_failures >= 1
        assert eng.counters.checksum_failures == eng.counters.misses
        assert sum(source.reads.values()) == eng.counters.misses

    run_engine(make_config(src, cache, policy=policy), body, source)


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.cache\.reader: cached copy of .* is damaged or unreadable",
    r"WARNING dlcachefs\.cache\.reader: chunk \d+ unreadable \(log \d+ is shorter than its index says\)")
def test_truncated_log_is_refetched(tree, policy):
    """A log shorter than the index says (lost tail): those records are refetched."""
    src, cache, files = tree
    cold_read(src, cache, files, policy)
    _, rec, log_path, chunk = record_location(cache, src, b"val/\xff\xfe-not-utf8.bin", policy)
    os.truncate(log_path, chunk.offset + chunk.length // 2)

    async def body(eng):
        await read_everything(eng, files)
        assert eng.counters.checksum_failures >= 1
        assert eng.counters.misses >= 1

    run_engine(make_config(src, cache, policy=policy), body)


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.cache\.recovery: \d+ chunks point at missing log files; dropping them")
def test_missing_log_drops_its_chunks(tree, policy):
    src, cache, files = tree
    cold_read(src, cache, files, policy)
    logs = sorted((cache / "logs").iterdir())
    assert logs
    os.unlink(logs[0])
    source = CountingSource(src)

    async def body(eng):
        await read_everything(eng, files)
        assert eng.counters.misses >= 1
        assert eng.counters.checksum_failures == 0

    run_engine(make_config(src, cache, policy=policy), body, source)


def test_torn_tail_is_cut_at_start(tree, policy):
    src, cache, files = tree
    cold_read(src, cache, files, policy)
    logs = sorted((cache / "logs").iterdir())
    last = logs[-1]
    size = last.stat().st_size
    with open(last, "ab") as f:
        f.write(os.urandom(12_345))

    async def body(eng):
        await read_everything(eng, files)
        assert eng.counters.bytes_from_source == 0
        assert eng.counters.checksum_failures == 0
        # new chunks append cleanly after recovery
        await read_everything(eng, {b"top.txt": files[b"top.txt"]})

    _, eng = run_engine(make_config(src, cache, policy=policy), body)
    assert last.stat().st_size == size


def test_torn_tail_with_an_unindexed_chunk(tree, policy):
    """A chunk appended but never indexed (crash before commit) is cut off, not served."""
    from dlcachefs.store.chunkfmt import RecordIn, encode_chunk

    src, cache, files = tree
    cold_read(src, cache, files, policy)
    last = sorted((cache / "logs").iterdir())[-1]
    size = last.stat().st_size
    chunk, _ = encode_chunk(999, [RecordIn(16, b"top.txt", 0, 0, b"WRONG BYTES")])
    with open(last, "ab") as f:
        f.write(chunk + chunk[:100])

    async def body(eng):
        await read_everything(eng, files)
        assert eng.counters.bytes_from_source == 0

    run_engine(make_config(src, cache, policy=policy), body)
    assert last.stat().st_size == size


# ----- changes on the source -----------------------------------------------------------


def rewrite(path: Path, data: bytes, mtime_shift_ns: int = 2_000_000_000) -> None:
    """Rewrite in place (same inode) and move mtime, as an editor or rsync --inplace would."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.write(data)
        f.truncate(len(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + mtime_shift_ns))


@pytest.mark.parametrize("same_size", [False, True])
def test_changed_source_file_is_refetched(tree, same_size, policy):
    src, cache, files = tree
    rel = b"train/cls1/img05.jpg"
    cold_read(src, cache, files, policy)
    old = files[rel]
    new = bytes(b ^ 0xFF for b in old) if same_size else old + b"more bytes"
    rewrite(src / os.fsdecode(rel), new)
    source = CountingSource(src)

    async def body(eng):
        assert await read_all(eng, rel) == new
        assert eng.counters.stale_refetches == 1
        assert source.reads[rel] == 1
        e = eng.ns.resolve(rel)
        assert e.size == len(new)
        await eng.flush()
        rec = eng.index.get_record(e.ino)
        assert rec is not None and rec.mtime_ns == e.mtime_ns and rec.size == len(new)
        assert await read_all(eng, rel) == new
        assert eng.counters.stale_refetches == 1
        # the unchanged files are still hits
        await read_everything(eng, {k: v for k, v in files.items() if k != rel})
        assert sum(source.reads.values()) == 1

    run_engine(make_config(src, cache, policy=policy, revalidate=0), body, source)


@pytest.mark.parametrize("mode,rel", [("before", b"train/cls2/img07.jpg"),
                                      ("during", b"train/cls0/img02.jpg")])
def test_file_changed_while_fetched(tree, policy, mode, rel):
    """The source file changes once as it is fetched: ``before`` (without revalidation the
    listed identity is old; the fetch sees the new one) or ``during`` the read (read_file
    notices and retries). Either way the reader gets the new bytes, and they are cached."""
    src, cache, files = tree
    source = ChangingSource(src, rel, times=1, mode=mode)

    async def body(eng):
        data = await read_all(eng, rel)
        assert source.mutations == 1
        assert data == read_source(src, rel) != files[rel]
        assert len(data) == len(files[rel]) + source.grow
        assert eng.ns.resolve(rel).size == len(data)
        await eng.flush()
        assert eng.index.get_record(eng.ns.resolve(rel).ino).size == len(data)
        return data

    data, _ = run_engine(make_config(src, cache, policy=policy), body, source)

    async def remount(eng):
        assert await read_all(eng, rel) == data
        assert eng.counters.hits == 1

    run_engine(make_config(src, cache, policy=policy), remount)


def test_file_changing_on_every_read_raises_source_changed(tree, policy):
    src, cache, files = tree
    rel = b"train/cls0/img02.jpg"
    source = ChangingSource(src, rel, times=100, mode="during")

    async def body(eng):
        with pytest.raises(SourceChanged):
            await read_all(eng, rel)
        assert source.mutations == source.CHANGE_RETRIES
        assert eng.counters.source_retries == 0  # not a transient error: no engine retries
        await read_everything(eng, {k: v for k, v in files.items() if k != rel})

    run_engine(make_config(src, cache, policy=policy), body, source)


# ----- source errors -------------------------------------------------------------------


def test_transient_eio_is_retried(tree, policy):
    src, cache, files = tree
    rel = b"top.txt"
    source = FailingSource(src, errno.EIO, fail_times=2, paths={rel})

    async def body(eng):
        assert await read_all(eng, rel) == files[rel]
        assert eng.counters.source_retries == 2
        assert eng.counters.source_errors == 2
        assert source.reads[rel] == 3

    run_engine(make_config(src, cache, policy=policy, source_retries=2), body, source)


def test_persistent_eio_fails_after_retries(tree, policy):
    src, cache, files = tree
    rel = b"top.txt"
    source = FailingSource(src, errno.EIO, fail_times=None, paths={rel})

    async def body(eng):
        with pytest.raises(SourceError) as ei:
            await read_all(eng, rel)
        assert ei.value.errno == errno.EIO
        assert source.reads[rel] == 2
        assert eng.counters.source_retries == 1
        # nothing was cached for it; other files are fine
        await eng.flush()
        assert eng.index.get_record(eng.ns.resolve(rel).ino) is None
        assert await read_all(eng, b"big.bin") == files[b"big.bin"]

    run_engine(make_config(src, cache, policy=policy, source_retries=1), body, source)


@pytest.mark.parametrize("err,exc", [(errno.EACCES, SourceError), (errno.ENOENT, NotFound)])
def test_permanent_errors_are_not_retried(tree, err, exc, policy):
    src, cache, files = tree
    rel = b"train/cls0/img00.jpg"
    source = FailingSource(src, err, fail_times=None, paths={rel})

    async def body(eng):
        for _ in range(2):
            with pytest.raises(exc) as ei:
                await read_all(eng, rel)
            if exc is SourceError:
                assert ei.value.errno == err
        assert source.reads[rel] == 2  # once per open, never retried
        assert eng.counters.source_retries == 0
        assert await read_all(eng, b"top.txt") == files[b"top.txt"]

    run_engine(make_config(src, cache, policy=policy), body, source)


@pytest.mark.parametrize("revalidate", [3600.0, 0.0])
def test_vanished_source_file_is_not_found(tree, revalidate, policy):
    src, cache, files = tree
    rel = b"train/cls2/img06.jpg"
    source = CountingSource(src)

    async def body(eng):
        ino = eng.ns.resolve(rel).ino
        os.unlink(src / os.fsdecode(rel))
        with pytest.raises(NotFound):
            await eng.open(ino)
        if revalidate == 0:  # the restat also drops it from the snapshot
            with pytest.raises(NotFound):
                eng.ns.resolve(rel)
        assert await read_all(eng, b"top.txt") == files[b"top.txt"]

    run_engine(make_config(src, cache, policy=policy, revalidate=revalidate), body, source)


def test_hanging_source_times_out(tree, policy):
    src, cache, files = tree
    rel = b"train/cls1/img00.jpg"
    source = HangingSource(src, paths={rel})

    async def body(eng):
        try:
            with pytest.raises(SourceTimeout):
                await read_all(eng, rel)
            assert source.entered.is_set()
            assert eng.counters.source_timeouts == 1
            # the rest of the mount keeps working while one source thread is stuck
            await read_everything(eng, {k: v for k, v in files.items() if k != rel})
        finally:
            source.release()

    run_engine(make_config(src, cache, policy=policy, source_timeout=0.5), body, source)


@pytest.mark.parametrize("revalidate", [0.0, 1e-9])  # lstat of the file; re-list of its dir
def test_hanging_namespace_call_times_out(tree, revalidate, policy):
    """Regression: a hung lstat/list_dir (revalidation) must end in SourceTimeout, not hang."""
    src, cache, files = tree
    rel = b"train/cls1/img02.jpg"
    source = HangingMetaSource(src, paths={rel, b"train/cls1"})

    async def body(eng):
        ino = eng.ns.resolve(rel).ino
        source.armed = True
        try:
            with trio.fail_after(20):  # a safety net only; the engine must give up first
                with pytest.raises(SourceTimeout):
                    await eng.open(ino)
                assert await read_all(eng, b"top.txt") == files[b"top.txt"]
        finally:
            source.release()

    run_engine(make_config(src, cache, policy=policy, revalidate=revalidate, source_timeout=0.5), body,
               source)


def test_slow_source_within_timeout(tree, policy):
    src, cache, files = tree
    source = SlowSource(src, delay=0.02)

    async def body(eng):
        subset = dict(list(sorted(files.items()))[:6])
        async with trio.open_nursery() as n:
            for rel in subset:
                n.start_soon(read_all, eng, rel)
        await read_everything(eng, subset)
        assert eng.counters.source_timeouts == 0
        assert sum(source.reads.values()) == len(subset)

    run_engine(make_config(src, cache, policy=policy, source_timeout=5.0), body, source)


# ----- the cache disk fails ------------------------------------------------------------


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.cache\.writer: cache write failed \(\[Errno 28\] No space left on device\)")
def test_disk_full_serves_from_source_and_recovers(tree, monkeypatch, policy):
    """ENOSPC on a log append: the half-written chunk is cut off, nothing is indexed, every
    file is still served (from the source), and caching resumes after the back-off."""
    from dlcachefs.store.chunkfmt import LOG_HEADER_SIZE

    src, cache, files = tree
    real_fdatasync = os.fdatasync

    def enospc(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    async def body(sess):
        eng = sess.engine
        monkeypatch.setattr(os, "fdatasync", enospc)
        await read_everything(eng, files, flush=True)
        c = eng.counters
        assert c.write_errors == 1  # then the writer backs off instead of failing again
        assert c.cache_skipped == len(files)
        # stats and scan-ahead say why nothing is cached now (the disk, not the policy)
        disk = sess.stats()["cache_disk"]
        assert disk["paused_s"] > 0 and "No space left on device" in disk["paused_reason"]
        assert "caching is paused" in eng.writer.short_of_disk()
        assert eng.index.n_records() == 0 and eng.index.n_chunks() == 0
        logs = sorted((cache / "logs").iterdir())
        assert [p.stat().st_size for p in logs] == [LOG_HEADER_SIZE]
        monkeypatch.setattr(os, "fdatasync", real_fdatasync)
        eng.writer.backoff_until = 0.0  # the disk has room again; skip the wait
        assert sess.stats()["cache_disk"]["paused_s"] == 0 and eng.writer.short_of_disk() is None
        await read_everything(eng, files, flush=True)
        assert eng.index.n_records() == len(files)
        assert c.misses == 2 * len(files)

    run_session(make_config(src, cache, policy=policy), body)

    async def remount(eng):
        await read_everything(eng, files)
        assert eng.counters.bytes_from_source == 0

    run_engine(make_config(src, cache, policy=policy), remount)


# ----- read-through of large files -----------------------------------------------------


def test_an_open_of_an_older_version_never_fills_the_page_cache(tree, policy):
    """Read-through handles share the kernel's pages of the file: once a newer version is
    known (another open saw it), a handle of the older one (its descriptor still reads
    that version: the file was replaced by a rename) gets an error, not a read that
    would put old pages beside the new ones."""
    src, cache, files = tree
    data = files[b"big.bin"]

    async def body(eng):
        p = await eng.open(eng.ns.resolve(b"big.bin").ino)
        assert not p.direct_io
        assert bytes(await eng.read(p.fh, 0, 100)) == data[:100]
        new = data[::-1]
        tmp = src / "big.tmp"
        tmp.write_bytes(new)
        os.utime(tmp, ns=(1, 2_000_000_000_000_000_000))
        os.replace(tmp, src / "big.bin")
        q = await eng.open(eng.ns.resolve(b"big.bin").ino)  # sees the new version
        assert q.direct_io  # (the kernel may still hold the old size)
        with pytest.raises(SourceChanged):
            await eng.read(p.fh, len(data) // 2, 100)
        assert bytes(await eng.read(q.fh, 0, 100)) == new[:100]
        r = await eng.open(eng.ns.resolve(b"big.bin").ino)
        assert not r.direct_io and bytes(await eng.read(r.fh, 50, 100)) == new[50:150]
        for h in (p, q, r):
            eng.release(h.fh)

    run_engine(make_config(src, cache, policy=policy, max_cached_file=100_000), body)


def test_a_read_through_file_removed_while_open_reads_on(tmp_path):
    """POSIX: an open descriptor of a removed file reads on. Gone from the listing, the
    file has no newer version whose pages its reads could mix with (inode numbers are
    never reused): its handle is not refused."""
    src, cache = tmp_path / "src", tmp_path / "cache"
    data = os.urandom(300_000)
    write_tree(src, {b"big.bin": data, b"small.bin": b"x" * 100})

    async def body(eng):
        p = await eng.open(eng.ns.resolve(b"big.bin").ino)
        assert not p.direct_io
        assert bytes(await eng.read(p.fh, 0, 100)) == data[:100]
        os.unlink(src / "big.bin")
        await eng.ns.refresh_dir(ROOT_INO)  # a revalidation lists the directory again
        assert bytes(await eng.read(p.fh, 100, 100)) == data[100:200]
        eng.release(p.fh)

    run_engine(make_config(src, cache, policy="lru", max_cached_file=100_000), body)


def test_large_file_is_read_through(tree, policy):
    src, cache, files = tree
    rel = b"big.bin"
    data = files[rel]

    async def body(eng):
        e = eng.ns.resolve(rel)
        r = await eng.open(e.ino)
        # through the page cache (mmap works), never kept across opens
        assert not r.direct_io and not r.keep_cache
        assert bytes(await eng.read(r.fh, 1000, 5000)) == data[1000:6000]
        assert bytes(await eng.read(r.fh, len(data) - 10, 100)) == data[-10:]
        # the file changes while open: no bytes of the new version come out
        rewrite(src / "big.bin", data[::-1])
        with pytest.raises(SourceChanged):
            await eng.read(r.fh, 0, 10)
        eng.release(r.fh)
        await eng.flush()
        assert eng.index.get_record(e.ino) is None
        assert eng.counters.bytes_from_source == 5000 + 10
        assert eng.counters.read_through == 1 and eng.counters.cache_skipped == 0
        assert await read_all(eng, b"top.txt") == files[b"top.txt"]

    run_engine(make_config(src, cache, policy=policy, max_cached_file=100_000), body)


# ----- eviction ------------------------------------------------------------------------


def test_eviction_keeps_cache_within_size(tmp_path, policy):
    rng = random.Random(7)
    src, cache = tmp_path / "src", tmp_path / "cache"
    files = {b"d%d/f%03d" % (i % 4, i): rng.randbytes(rng.randrange(2000, 12_000))
             for i in range(80)}
    write_tree(src, files)
    cache_size = 200_000

    async def body(eng):
        order = sorted(files)
        for epoch in range(3):
            rng.shuffle(order)
            for i, rel in enumerate(order):
                assert await read_all(eng, rel) == files[rel]
                if i % 10 == 9:
                    await eng.flush()
                assert eng.index.counter(S.K_CHUNK_BYTES) <= cache_size, epoch
            await eng.flush()
            assert eng.index.check_invariants() == []
        # the cache was full: the policy made room (evicted) or kept files out (iCACHE's
        # H-cache with no importance known refuses instead; LRU never refuses)
        assert eng.counters.chunks_evicted > 0 or eng.counters.not_admitted > 0
        assert eng.index.counter(S.K_CHUNK_BYTES) <= cache_size
        assert eng.counters.hits > 0 and eng.counters.misses > len(files)

    run_engine(make_config(src, cache, policy=policy, cache_size=cache_size, chunk_size=32 << 10,
                           log_size=64 << 10), body)

    async def remount(eng):
        await read_everything(eng, files)

    run_engine(make_config(src, cache, policy=policy, cache_size=cache_size, chunk_size=32 << 10,
                           log_size=64 << 10), remount)


def test_concurrent_seals_respect_cache_size(tmp_path, policy):
    """Regression: a flush() while the writer task's seal is committing must not plan its
    eviction from stale counters (both seals chose the same victim; the cache overgrew)."""
    import time

    if policy == "icache":  # see the module docstring
        pytest.skip("iCACHE refuses samples into a full cache before any importance is "
                    "known: nothing is evicted, the two seals cannot race for victims")

    rng = random.Random(1)
    files = {b"f%03d" % i: rng.randbytes(9000) for i in range(40)}
    src, cache = tmp_path / "src", tmp_path / "cache"
    write_tree(src, files)
    cache_size = 100_000
    names = iter(sorted(files))

    async def body(eng):
        for _ in range(3):  # fill the cache with ~36 KB chunks
            for _ in range(4):
                rel = next(names)
                assert await read_all(eng, rel) == files[rel]
            await eng.flush()
        orig = eng.writer._commit

        def slow_commit(*args):
            time.sleep(0.3)  # part of the scenario: a second seal comes while this commits
            return orig(*args)

        eng.writer._commit = slow_commit
        for _ in range(4):  # a chunk's worth: the writer task starts sealing it (slowly)
            await read_all(eng, next(names))
        with trio.fail_after(10):
            while eng.writer.sealing_bytes == 0:
                await trio.sleep(0.01)
        for _ in range(4):
            await read_all(eng, next(names))
        await eng.flush()  # a second seal while the first one commits
        assert eng.counters.chunks_evicted >= 2
        assert eng.index.counter(S.K_CHUNK_BYTES) <= cache_size

    run_engine(make_config(src, cache, policy=policy, cache_size=cache_size, chunk_size=32 << 10,
                           flush_interval=30.0), body)


# ----- random workloads ----------------------------------------------------------------

OPS = st.lists(st.one_of(
    st.tuples(st.just("read"), st.integers(0, 10**6), st.integers(0, 10**6),
              st.integers(1, 70_000)),
    st.tuples(st.just("flush")),
    st.tuples(st.just("remount")),
), min_size=1, max_size=40)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(seed=st.integers(0, 2**32), n_files=st.integers(1, 25),
       chunk_size=st.sampled_from([4096, 8192, 20_000, 64 << 10]),
       memory=st.sampled_from([4096, 64 << 10, 16 << 20]),
       cache_size=st.sampled_from([30_000, 100_000, 1 << 30]),
       ops=OPS)
def test_random_workload_reads_source_bytes(seed, n_files, chunk_size, memory, cache_size, ops,
                                            policy):
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        src, cache = Path(tmp) / "src", Path(tmp) / "cache"
        files: dict[bytes, bytes] = {}
        for i in range(n_files):
            depth = rng.randrange(3)
            parts = [b"d%d" % rng.randrange(3) for _ in range(depth)] + [b"f%d" % i]
            size = rng.choice([0, 1, rng.randrange(100), rng.randrange(10_000),
                               rng.randrange(40_000)])
            files[b"/".join(parts)] = rng.randbytes(size)
        write_tree(src, files)
        names = sorted(files)
        cfg = make_config(src, cache, policy=policy, chunk_size=chunk_size, memory=memory,
                          cache_size=cache_size)
        # split the op list into mounts
        mounts: list[list[tuple]] = [[]]
        for op in ops:
            if op[0] == "remount":
                mounts.append([])
            else:
                mounts[-1].append(op)
        for mount_ops in mounts:
            async def body(eng, mount_ops=mount_ops):
                for op in mount_ops:
                    if op[0] == "flush":
                        await eng.flush()
                        continue
                    _, which, off, size = op
                    rel = names[which % len(names)]
                    data = files[rel]
                    off = off % (len(data) + 2)
                    e = eng.ns.resolve(rel)
                    r = await eng.open(e.ino)
                    try:
                        got = bytes(await eng.read(r.fh, off, size))
                    finally:
                        eng.release(r.fh)
                    assert got == data[off : off + size], (rel, off, size)
                assert eng.index.counter(S.K_CHUNK_BYTES) <= cache_size

            run_engine(cfg, body)


def test_reorder_backfill_of_a_vanished_file_does_not_end_the_engine(tmp_path, policy):
    """Regression (review): a source error while filling a next-epoch log is that log's
    problem, never the daemon's."""

    src, cache = tmp_path / "src", tmp_path / "cache"
    files = {f"train/c0/img{i}.jpg".encode(): os.urandom(3000) for i in range(4)}
    write_tree(src, files)
    inos: list[int] = []

    async def body(sess):
        eng = sess.engine
        inos.extend(eng.ns.resolve(r).ino for r in files)
        nl = sess.streams.planner.new_log("default/0", 1)
        await nl.plan(inos)
        os.unlink(src / "train/c0/img0.jpg")  # not cached, and gone from the source
        backfilled = trio.Event()

        async def backfill():
            await nl.backfill([inos[0]])  # tries the source for the vanished file
            backfilled.set()

        sess.streams._nursery.start_soon(backfill)
        sess.streams._nursery.start_soon(nl.run)
        with trio.fail_after(20):
            await backfilled.wait()
        nl.request_finish()
        await nl.done.wait()
        # the vanished file's slot holds a filler record: its chunk is sealed all the same
        assert not nl.failed and nl.sealed == len(nl.chunks) == 1
        # the engine still serves the other files
        assert await read_all(eng, b"train/c0/img1.jpg") == files[b"train/c0/img1.jpg"]

    run_session(make_config(src, cache, policy=policy), body)


def test_a_sample_changed_or_gone_since_its_log_was_planned_leaves_a_filler(tmp_path, policy):
    """Sweep B: a file replaced (new size) or deleted between the planning of a next
    epoch's log and its fill left its chunk unsealed for good, and that chunk's other
    samples were then read out of order from their old chunks (6.5x read per byte served).
    Its slot now holds a filler record (inode 0, zeros) of the planned length: the chunk is
    sealed and indexed with the other samples only, checksums holding, and the changed
    file is served in its new version, the deleted one not at all."""
    from dlcachefs.cache.namespace import identity
    from dlcachefs.errors import NotFound
    from dlcachefs.store.chunkfmt import verify_chunk

    src, cache = tmp_path / "src", tmp_path / "cache"
    files = {f"train/c0/img{i}.jpg".encode(): os.urandom(3000 + i) for i in range(5)}
    write_tree(src, files)
    new1 = os.urandom(4321)

    async def body(sess):
        eng = sess.engine
        inos = [eng.ns.resolve(r).ino for r in files]
        planned = [identity(eng.index.get_entry(i)) for i in inos]
        nl = sess.streams.planner.new_log("default/0", 1)
        await nl.plan(inos)
        assert len(nl.chunks) == 1 and len(nl.chunks[0].slots) == 5
        sess.streams._nursery.start_soon(nl.run)
        # img1 is replaced and served in its new version in this epoch (the reader's
        # bytes are fed to the log): its slot can never hold the planned version
        (src / "train/c0/img1.jpg").write_bytes(new1)
        changed = identity(await eng.ns.fresh_file(inos[1]))  # (an open sees it)
        assert changed != planned[1]
        # the bytes of an older version than planned (a fetch joined) say nothing
        older = dataclasses.replace(planned[1], mtime_ns=planned[1].mtime_ns - 1)
        nl.consumed(inos[2], files[b"train/c0/img2.jpg"], older)
        assert not nl.slots[inos[2]].written
        nl.consumed(inos[1], new1, changed)
        nl.consumed(inos[2], files[b"train/c0/img2.jpg"], planned[2])
        assert nl.slots[inos[1]].filler and not nl.slots[inos[2]].filler
        os.unlink(src / "train/c0/img0.jpg")  # gone before the fill at the epoch boundary
        nl.request_finish()
        nl.start_reading()
        with trio.fail_after(20):
            await nl.done.wait()
        assert not nl.failed and nl.sealed == 1
        c = nl.chunks[0]
        assert c.unread == 3  # the filler slots are never read in the log's epoch
        chunk = eng.index.get_chunk(c.chunk_id)
        assert chunk is not None and set(chunk.members) == {inos[2], inos[3], inos[4]}
        for i in (2, 3, 4):
            rec = eng.index.get_record(inos[i])
            assert rec.log_id == nl.log_id and rec.chunk_id == c.chunk_id
        assert eng.index.get_record(inos[0]) is None or eng.index.get_record(inos[0]).log_id != nl.log_id
        raw = eng.logs.read(nl.log_id, c.offset, c.length)
        header, recs, bad = verify_chunk(raw)
        assert bad == 0 and header.n_records == 5
        assert [r.ino for r in recs] == [0, 0, inos[2], inos[3], inos[4]]
        for r, rel in zip(recs[2:], list(files)[2:], strict=True):
            assert bytes(raw[r.data_offset:r.data_offset + r.size]) == files[rel]
        for rel in list(files)[2:]:
            assert await read_all(eng, rel) == files[rel]
        assert await read_all(eng, b"train/c0/img1.jpg") == new1
        with pytest.raises(NotFound):
            await read_all(eng, b"train/c0/img0.jpg")

    run_session(make_config(src, cache, policy=policy, revalidate=0), body)


def test_invariants_are_checked_after_every_reorder_seal(tmp_path, policy):
    """--debug-invariants covers both seal paths: the reorderer's chunks are indexed
    through ChunkWriter.commit_external, which runs the engine's check after each one,
    as the writer's own seals do."""

    src, cache = tmp_path / "src", tmp_path / "cache"
    files = {f"train/c0/img{i:02d}.jpg".encode(): os.urandom(5000) for i in range(24)}
    write_tree(src, files)
    events: list[str] = []

    async def body(sess):
        eng = sess.engine
        check = eng.writer.after_commit
        assert check is not None  # make_config turns --debug-invariants on

        def after_commit(writer):
            events.append("check")
            check(writer)

        eng.writer.after_commit = after_commit
        nl = sess.streams.planner.new_log("default/0", 1)
        await nl.plan([eng.ns.resolve(r).ino for r in files])
        seal_thread = nl._seal_thread

        def sealing(c):
            events.append("seal")
            return seal_thread(c)

        nl._seal_thread = sealing
        sess.streams._nursery.start_soon(nl.run)
        nl.request_finish()  # fill every slot (from the source) and seal every chunk
        with trio.fail_after(20):
            await nl.done.wait()
        assert nl.sealed == len(nl.chunks) > 1 and eng.counters.reorder_chunks == nl.sealed
        assert eng.index.get_record(eng.ns.resolve(b"train/c0/img00.jpg").ino).log_id == nl.log_id

    run_session(make_config(src, cache, policy=policy, chunk_size=16 << 10), body)
    seals = [i for i, ev in enumerate(events) if ev == "seal"]
    assert len(seals) > 1
    for i in seals:  # each reorder seal is followed by a check before anything else seals
        assert events[i + 1] == "check", events


def test_a_chunk_left_holding_no_record_is_retired(tmp_path, policy):
    """Sweep F5: a chunk whose files all changed on the source (their old records dropped
    as stale, the new versions cached in another chunk) holds nothing an open can read,
    yet it stayed, counted in the cache's bytes, until the policy evicted it: a cache with
    room never did (28 of 49 chunks, 27.5 MB, held no record after a few epochs of a
    changing dataset). It is retired at the next seal now, and counted apart."""
    src, cache = tmp_path / "src", tmp_path / "cache"
    files = {f"train/c0/img{i}.jpg".encode(): os.urandom(3000) for i in range(4)}
    write_tree(src, files)

    async def body(eng):
        for rel in files:
            assert await read_all(eng, rel) == files[rel]
        await eng.flush()
        old = {eng.index.get_record(eng.ns.resolve(r).ino).chunk_id for r in files}
        assert all(eng.index.get_chunk(c) is not None for c in old)
        new = {r: os.urandom(3500) for r in files}  # every file replaced, new sizes
        for rel, data in new.items():
            (src / os.fsdecode(rel)).write_bytes(data)
        for rel in files:
            assert await read_all(eng, rel) == new[rel]
        await eng.flush()
        await eng.flush()  # (a chunk left empty by one seal goes at the next)
        assert all(eng.index.get_chunk(c) is None for c in old), old
        live = sum(c.length for c in eng.index.iter_chunks())
        assert eng.index.counter(S.K_CHUNK_BYTES) == live
        assert eng.counters.chunks_superseded >= len(old)

    run_engine(make_config(src, cache, policy=policy, revalidate=0), body)
