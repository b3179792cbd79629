"""Tier 3: scan-ahead's fetches through the fetch workers (``--fetch-workers``).

:meth:`Prefetcher.scan_one` hands a guess to the pool (:meth:`FetchPool.fetch` with
``spare``): a worker reads, checks and appends it, the daemon only indexes it. A guess
never evicts: without free room for it the pool answers None before the policy is asked,
and nothing is reserved. Whenever the pool answers None (no room, a worker died, the file
changed), the daemon fetches it the usual way, with the usual rules and counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from dlcachefs.cache import scanahead
from dlcachefs.cache.fetchpool import GUESSES_PER_WORKER
from dlcachefs.cache.prefetch import GUESS_SPARE
from dlcachefs.testing.fakes import CountingSource, make_config, read_all, run_session, write_tree

FILES = {f"train/c{i % 2}/{i:03d}.jpg".encode(): bytes([i]) * (3000 + 97 * i)
         for i in range(6)}
REL = b"train/c1/003.jpg"


def _setup(tmp_path: Path, **kw) -> tuple:
    src, cache = tmp_path / "src", tmp_path / "cache"
    write_tree(src, FILES)
    return make_config(src, cache, **kw), CountingSource(src)


def test_a_guess_is_fetched_and_appended_by_a_worker(tmp_path):
    """With a pool, scan_one's file is written by a worker: the daemon's source never
    reads it, its writer never holds it; it is indexed, counted as scan-ahead's (in the
    mount's counters and the pool's), and served exactly from the log."""
    cfg, source = _setup(tmp_path, fetch_workers=1)

    async def body(sess):
        eng, pool = sess.engine, sess.prefetcher.pool
        assert pool is not None
        e = eng.ns.resolve(REL)
        assert await sess.prefetcher.scan_one(e.ino) == (len(FILES[REL]), True)
        assert source.reads.get(REL, 0) == 0 and e.ino not in eng.writer.pending
        assert eng.index.get_record(e.ino) is not None
        assert (pool.guesses, pool.files, pool.fallbacks) == (1, 1, 0)
        c = eng.counters
        assert (c.scan_ahead_files, c.scan_ahead_bytes) == (1, len(FILES[REL]))
        # cached and in flight no more: a second guess skips it
        assert await sess.prefetcher.scan_one(e.ino) == (0, False)
        assert await read_all(eng, REL) == FILES[REL]
        assert (c.hits, c.misses) == (1, 0) and source.reads.get(REL, 0) == 0

    run_session(cfg, body, source)


class _NoPool:
    """A pool that never writes anything (a worker gone, a changed file): None."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int | None]] = []
        self.guess_slots = trio.Semaphore(8)

    async def fetch(self, e, *, spare=None):
        self.calls.append((e.ino, spare))
        return None


def test_a_guess_the_pool_does_not_write_is_fetched_by_the_daemon(tmp_path):
    """The pool answers None: scan_one fetches the file in the daemon as without a pool
    (read once, submitted to the writer, counted once), and it is served exactly."""
    cfg, source = _setup(tmp_path)

    async def body(sess):
        eng = sess.engine
        sess.prefetcher.pool = fake = _NoPool()
        e = eng.ns.resolve(REL)
        assert await sess.prefetcher.scan_one(e.ino) == (len(FILES[REL]), True)
        assert fake.calls == [(e.ino, GUESS_SPARE)]
        assert source.reads[REL] == 1
        assert e.ino in eng.writer.pending or eng.index.get_record(e.ino) is not None
        c = eng.counters
        assert (c.scan_ahead_files, c.scan_ahead_bytes) == (1, len(FILES[REL]))
        assert await read_all(eng, REL) == FILES[REL]
        assert (c.hits, c.misses) == (1, 0) and source.reads[REL] == 1

    run_session(cfg, body, source)


def test_a_guess_never_evicts_through_the_pool(tmp_path):
    """Free room short of the file and the spare: the pool writes nothing, asks the
    policy nothing, reserves and dooms nothing, and answers False; the daemon does not
    fetch it either (it would read it only to drop it): (nothing fetched, not kept)."""
    cfg, source = _setup(tmp_path, fetch_workers=1)

    async def body(sess):
        eng, pool = sess.engine, sess.prefetcher.pool
        assert pool is not None
        e = eng.ns.resolve(REL)
        asked: list[int] = []
        admit = eng.policy.admit
        eng.policy.admit = lambda ino, size: asked.append(ino) or admit(ino, size)
        eng.writer.room = lambda: len(FILES[REL]) + GUESS_SPARE - 1
        reserved = eng.writer.reserved
        assert await pool.fetch(e, spare=GUESS_SPARE) is False
        assert asked == [] and eng.writer.reserved == reserved and not eng.writer.doomed
        assert await sess.prefetcher.scan_one(e.ino) == (0, False)
        assert asked == [] and not eng.writer.doomed
        assert (pool.files, pool.guesses) == (0, 0)
        assert e.ino not in eng.writer.pending and eng.index.get_record(e.ino) is None
        assert source.reads.get(REL, 0) == 0

    run_session(cfg, body, source)


def test_a_guess_the_policy_refuses_is_asked_once_and_not_fetched(tmp_path):
    """The policy does not admit a guess: it was asked once (iCACHE counts refusals),
    the refusal is counted once, and nothing is read from the source for it."""
    cfg, source = _setup(tmp_path, fetch_workers=1)

    async def body(sess):
        eng, pool = sess.engine, sess.prefetcher.pool
        e = eng.ns.resolve(REL)
        asked: list[int] = []
        eng.policy.admit = lambda ino, size: asked.append(ino) and False
        assert await sess.prefetcher.scan_one(e.ino) == (0, False)
        assert asked == [e.ino] and eng.counters.not_admitted == 1 and pool.refused == 1
        assert source.reads.get(REL, 0) == 0 and eng.index.get_record(e.ino) is None

    run_session(cfg, body, source)


def test_guesses_the_pool_hands_back_are_fetched_as_few_at_a_time_as_without_it(tmp_path):
    """With a pool scan-ahead has a batch of files in flight per fetch --scan-ahead allows;
    those the pool hands back are fetched by the daemon at most --scan-ahead at a time
    (the source sees no more than without workers), and every one is cached exactly."""
    cfg, source = _setup(tmp_path, scan_ahead=2)

    async def body(sess):
        eng, pre = sess.engine, sess.prefetcher
        pre.pool = _NoPool()
        assert pre.scan_batch > 1
        fetch = eng.fetcher.fetch
        now, most = [0], [0]
        full = trio.Event()  # the first fetches wait until two are in flight

        async def counted(e, cache=True):
            now[0] += 1
            most[0] = max(most[0], now[0])
            try:
                if now[0] >= 2:
                    full.set()
                with trio.fail_after(30):  # (a bound of 1 fails here, not hangs)
                    await full.wait()
                await trio.sleep(0.02)  # (the others would start meanwhile, unbounded)
                return await fetch(e, cache)
            finally:
                now[0] -= 1

        eng.fetcher.fetch = counted
        inos = [eng.ns.resolve(rel).ino for rel in FILES]
        got: dict[int, tuple[int, bool]] = {}

        async def one(ino: int) -> None:
            got[ino] = await pre.scan_one(ino)

        async with trio.open_nursery() as nursery:
            for ino in inos:
                nursery.start_soon(one, ino)
        eng.fetcher.fetch = fetch
        assert most[0] == 2
        assert all(kept and n for n, kept in got.values()) and len(got) == len(FILES)
        for rel, data in FILES.items():
            assert await read_all(eng, rel) == data
        assert sum(source.reads.values()) == len(FILES)

    run_session(cfg, body, source)


@pytest.mark.parametrize(("workers", "most"), [(0, 2), (1, 6)])
def test_scan_ahead_in_flight_bound_with_and_without_workers(tmp_path, monkeypatch, workers,
                                                             most):
    """--scan-ahead 2: two files in flight without workers; with them, batches, up to a
    chunk's worth of bytes per fetch (64 KiB chunks: six files of 20,000 bytes in all);
    every file of the tree ends cached exactly."""
    src, cache = tmp_path / "src", tmp_path / "cache"
    files = {f"tree/{i:03d}.bin".encode(): bytes([i]) * 20_000 for i in range(60)}
    write_tree(src, files)
    cfg = make_config(src, cache, scan_ahead=2, fetch_workers=workers)
    assert cfg.chunk_size == 64 << 10
    # no pause for a reader gone quiet, however slow the machine (the opens stop here)
    monkeypatch.setattr(scanahead, "IDLE_S", 3600.0)

    async def body(sess):
        eng, pre, scan = sess.engine, sess.prefetcher, sess.scan
        real = pre.scan_one
        now, seen = [0], [0]
        full = trio.Event()  # the first fetches wait until the bound is reached

        async def held(ino: int):
            now[0] += 1
            seen[0] = max(seen[0], now[0])
            try:
                if now[0] >= most:
                    full.set()
                await full.wait()
                return await real(ino)
            finally:
                now[0] -= 1

        pre.scan_one = held
        entries = [eng.ns.resolve(rel) for rel in files]
        for e in entries[:32]:  # a reader's 32 distinct opens: the tree is scanned
            scan.note_open("g", e.ino, e.parent)
        tree = scan.trees[entries[0].parent]
        with trio.fail_after(60):
            while tree.state in ("listing", "scanning", "paused"):
                await trio.sleep(0.02)
        assert (tree.state, tree.files) == ("done", 28)
        assert seen[0] == most
        for rel, data in files.items():
            assert await read_all(eng, rel) == data
        if workers:
            assert sess.prefetcher.pool.guesses == 28

    run_session(cfg, body, CountingSource(src))


def test_guesses_go_one_per_job_while_a_reader_waits_for_the_source(tmp_path):
    """While a reader waits for the source (``demand_fetches``), each worker job holds
    one of scan-ahead's guesses: the link serves at most one guess per worker beside the
    reader's miss. Every file still ends cached exactly."""
    cfg, source = _setup(tmp_path, fetch_workers=1)

    async def body(sess):
        eng, pre = sess.engine, sess.prefetcher
        pool = pre.pool
        entries = [eng.ns.resolve(rel) for rel in FILES]
        eng.fetcher.demand_fetches = 1  # (a reader's miss in flight, as the fetcher counts)
        try:
            async with trio.open_nursery() as nursery:
                for e in entries:
                    nursery.start_soon(pre.scan_one, e.ino)
        finally:
            eng.fetcher.demand_fetches = 0
        assert (pool.guesses, pool.jobs) == (len(FILES), len(FILES))
        for rel, data in FILES.items():
            assert await read_all(eng, rel) == data
        assert sum(source.reads.values()) == 0

    run_session(cfg, body, source)


def test_the_pool_holds_a_few_guesses_per_worker(tmp_path):
    """A guess is held in flight once in the pool (an open of it waits for its job): at
    most GUESSES_PER_WORKER per worker are in it at once, the others wait outside,
    holding nothing. Every file ends cached exactly, none fetched by the daemon."""
    files = {f"tree/{i:03d}.bin".encode(): bytes([i]) * 5_000 for i in range(40)}
    src, cache = tmp_path / "src", tmp_path / "cache"
    write_tree(src, files)
    source = CountingSource(src)
    cfg = make_config(src, cache, fetch_workers=1)

    async def body(sess):
        eng, pre = sess.engine, sess.prefetcher
        pool = pre.pool
        inside, most = [0], [0]
        real = pool.fetch

        async def counted(e, *, spare=None):
            inside[0] += 1
            most[0] = max(most[0], inside[0])
            try:
                return await real(e, spare=spare)
            finally:
                inside[0] -= 1

        pool.fetch = counted
        async with trio.open_nursery() as nursery:
            for rel in files:
                nursery.start_soon(pre.scan_one, eng.ns.resolve(rel).ino)
        assert 1 < most[0] <= GUESSES_PER_WORKER < len(files)
        assert pool.guesses == len(files) and pool.fallbacks == 0
        for rel, data in files.items():
            assert await read_all(eng, rel) == data
        assert sum(source.reads.values()) == 0

    run_session(cfg, body, source)


def test_a_request_of_the_prefetch_goes_before_queued_guesses(tmp_path):
    """The queue a worker takes its next job from: the prefetch's requests (a stream's
    next files, which a reader will open) before scan-ahead's guesses, whatever the order
    they came in; a guess only when guesses are allowed in the job."""
    cfg, source = _setup(tmp_path, fetch_workers=1)

    async def body(sess):
        pool = sess.prefetcher.pool
        g1, g2, a1 = object(), object(), object()
        pool._guessed.extend([g1, g2])
        pool._asked.append(a1)
        assert pool._take_nowait(False) is a1
        assert pool._take_nowait(False) is None
        assert pool._take_nowait(True) is g1
        assert await pool._take() is g2
        assert pool._take_nowait(True) is None

    run_session(cfg, body, source)
