"""Races in a next epoch's log (dlcachefs.clairvoyance.reorder): tasks that claim slots
across an await, against the epoch switch and the log's end. Found in review; each test
holds a fetch open at the racing moment with events, no timing."""

import os
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager

import pytest
import trio
import trio.testing

from dlcachefs.cache.namespace import identity
from dlcachefs.clairvoyance.reorder import NextEpochLog
from dlcachefs.clairvoyance.stream import Stream
from dlcachefs.store.chunkfmt import CHUNK_HEADER_SIZE
from dlcachefs.testing.fakes import make_config, read_all, run_session, write_tree


def two_samples(tmp_path) -> tuple[dict, object]:
    """Two 3,000-byte samples of one class, and the config of an engine over them."""
    src, cache = tmp_path / "src", tmp_path / "cache"
    files = {b"train/c0/img%02d.jpg" % i: os.urandom(3000) for i in range(2)}
    write_tree(src, files)
    return files, make_config(src, cache, policy="lru", chunk_size=64 << 10)


async def planned(sess, files: dict) -> tuple[NextEpochLog, list[int]]:
    """Epoch 1's log of the samples, in their order: one chunk, one slot each."""
    inos = [sess.engine.ns.resolve(r).ino for r in files]
    nl = sess.streams.planner.new_log("default/0", 1)
    await nl.plan(inos)
    assert len(nl.chunks) == 1 and len(nl.chunks[0].slots) == 2
    return nl, inos


def served_without_room(sess, files: dict, logs: Iterable[NextEpochLog],
                        inos: list[int]) -> None:
    """Each of ``inos`` (samples of ``files``) is served to each of ``logs`` while the
    cache has no room for its slot (full of the current logs): the log keeps its bytes
    and the slot waits for room."""
    eng = sess.engine
    rel_of = {eng.ns.resolve(r).ino: r for r in files}
    real = eng.writer.try_reserve
    eng.writer.try_reserve = lambda n: False  # the cache is full of the current logs
    try:
        for nl in logs:
            for ino in inos:
                nl.consumed(ino, files[rel_of[ino]], identity(eng.index.get_entry(ino)))
    finally:
        eng.writer.try_reserve = real


@asynccontextmanager
async def two_logs_without_room(sess, files: dict
                                ) -> AsyncIterator[tuple[NextEpochLog, NextEpochLog]]:
    """The room tests' setup: two ranks' next logs of the samples (``default/0``, then
    ``default/1``), each served the first sample while the cache had no room for its
    slot; since then room was freed for one slot (``writer.reclaimable``). Their streams
    are in the manager's table meanwhile; then they are removed and the logs abandoned."""
    writer = sess.engine.writer
    nl, inos = await planned(sess, files)
    other = sess.streams.planner.new_log("default/1", 1)
    await other.plan(inos)
    S, _ = inos
    served_without_room(sess, files, (nl, other), [S])
    need = nl.slots[S].rlen + CHUNK_HEADER_SIZE
    writer.reclaimable = lambda: need  # room freed for one of the two slots
    r0, r1 = Stream("default", 0), Stream("default", 1)
    r0.next_log, r1.next_log = nl, other
    table = sess.streams.streams
    table[("default", 0)], table[("default", 1)] = r0, r1
    try:
        yield nl, other
    finally:
        del table[("default", 0)], table[("default", 1)]
        nl.abandon()
        other.abandon()


def start_backfill(sess, nl: NextEpochLog, inos: list[int]) -> trio.Event:
    """Run the log's backfill of ``inos`` in the background; the event is set when it
    returned (what it claims is claimed by then)."""
    finished = trio.Event()

    async def backfill() -> None:
        await nl.backfill(inos)
        finished.set()

    sess.streams._nursery.start_soon(backfill)
    return finished


def scenario(tmp_path, vanish_t: bool):
    """A backfill fetching slot S when the epoch switches; the fill fetches S too. S must
    be claimed once; with T never claimed (``vanish_t``), the chunk must never be sealed
    over T's unwritten range (T's bytes would be zeros, with a checksum over them)."""
    files, cfg = two_samples(tmp_path)
    out = {}

    async def body(sess):
        eng = sess.engine
        nl, inos = await planned(sess, files)
        S, T = inos
        real = sess.prefetcher.bytes_for
        gate_b, gate_f = trio.Event(), trio.Event()
        inside = {"b": trio.Event(), "f": trio.Event()}
        calls = []

        async def bytes_for(ino, ident):
            calls.append(ino)
            if ino == S and len([c for c in calls if c == S]) == 1:
                inside["b"].set()
                await gate_b.wait()
            elif ino == S:
                inside["f"].set()
                await gate_f.wait()
            elif ino == T and vanish_t:
                return None  # T gone / no room: never claimed
            return await real(ino, ident)

        sess.prefetcher.bytes_for = bytes_for
        backfilled = start_backfill(sess, nl, [S])
        sess.streams._nursery.start_soon(nl.run)
        await inside["b"].wait()        # backfill is fetching S
        nl.request_finish()             # the epoch switch
        await inside["f"].wait()        # the fill is fetching S too
        gate_b.set()
        await backfilled.wait()         # backfill claimed S
        gate_f.set()                    # the fill must not claim S again
        with trio.fail_after(20):
            await nl.done.wait()
        c = nl.chunks[0]
        out.update(failed=nl.failed, sealed=nl.sealed, held=c.held, length=c.length,
                   reserved=eng.writer.reserved)
        if nl.sealed:
            out["T_read"] = await read_all(eng, b"train/c0/img01.jpg")
            out["T_src"] = files[b"train/c0/img01.jpg"]

    run_session(cfg, body, check_invariants=False)
    return out


def test_a_slot_fetched_by_backfill_and_fill_is_claimed_once(tmp_path):
    out = scenario(tmp_path, vanish_t=False)
    assert not out["failed"], out


def test_a_chunk_with_an_unwritten_slot_is_never_sealed(tmp_path):
    out = scenario(tmp_path, vanish_t=True)
    if out["sealed"]:  # (it is not: the chunk had a slot never written)
        assert out["T_read"] == out["T_src"]


def test_a_backfill_ending_after_its_log_reserves_nothing(tmp_path):
    """A backfill whose fetch was in flight when its log was abandoned must not reserve
    room after the log gave its reservations back (they would never be returned)."""
    files, cfg = two_samples(tmp_path)
    out = {}

    async def body(sess):
        eng = sess.engine
        nl, inos = await planned(sess, files)
        real = sess.prefetcher.bytes_for
        gate, inside = trio.Event(), trio.Event()

        async def bytes_for(ino, ident):
            inside.set()
            await gate.wait()
            return await real(ino, ident)

        sess.prefetcher.bytes_for = bytes_for
        before = eng.writer.reserved
        backfilled = start_backfill(sess, nl, [inos[0]])
        sess.streams._nursery.start_soon(nl.run)
        await inside.wait()
        nl.abandon()                 # a newer epoch began: the log is given up
        await nl.done.wait()         # run()'s cleanup has run
        gate.set()
        await backfilled.wait()      # its fetch returned after the cleanup
        out["leaked"] = eng.writer.reserved - before
        out["held"] = nl.chunks[0].held

    run_session(cfg, body, check_invariants=False)
    assert out["leaked"] == 0, out


def test_a_sample_repeated_in_the_order_is_read_once_from_its_log(tmp_path):
    """An order may hold a sample twice (a DistributedSampler's padding, sampling with
    replacement): its second open must not count as another slot read, or its chunk
    would be released with slots still unread."""
    files, cfg = two_samples(tmp_path)

    async def body(sess):
        nl, inos = await planned(sess, files)
        nl.chunks[0].sealed = True  # (as if sealed: used() names a chunk to release)
        nl.start_reading()
        assert nl.used(inos[0]) is None
        assert nl.used(inos[0]) is None and nl.chunks[0].unread == 1  # the repeat
        assert nl.used(inos[1]) == nl.chunks[0].chunk_id
        nl.chunks[0].sealed = False
        nl.abandon()

    run_session(cfg, body, check_invariants=False)


class _ReleasingLog:
    """The current epoch's log, as ``Stream.consume`` sees it: every use releases."""

    release_after_use = True
    epoch = 1

    def __init__(self) -> None:
        self.released: list[int] = []

    def used(self, ino: int) -> int:
        return 7

    def release(self, chunk_id: int) -> None:
        self.released.append(chunk_id)


def test_a_sample_that_found_no_room_is_written_once_the_current_log_frees_some(tmp_path):
    """An open through the mount can come before the events of reads served in training
    processes (drained 50 ms late) whose release of the current log's chunks would have
    made room for it: the sample is read again for its slot at the next release, not
    left to the fill at the epoch boundary (a CI run waited for the next log for ever)."""
    files, cfg = two_samples(tmp_path)
    out = {}

    async def body(sess):
        writer = sess.engine.writer
        assert await read_all(sess.engine, b"train/c0/img00.jpg")  # S is cached
        await sess.engine.flush()
        nl, inos = await planned(sess, files)
        S, T = inos
        served_without_room(sess, files, [nl], [S, T])
        out["claimed_without_room"] = nl.slots[S].written
        out["before_a_release"] = nl.take_no_room()
        s = Stream("default", 0, consumed=bytearray(2))
        s.current_log, s.next_log = _ReleasingLog(), nl
        real_room = writer.reclaimable
        writer.reclaimable = lambda: 0  # released, but nothing freed yet (pinned)
        s.consume(S, 0)
        out["no_budget"] = nl.take_no_room()
        writer.reclaimable = real_room
        s.consume(T, 1)  # the current log releases a chunk: room
        out["released"] = s.current_log.released
        retry = nl.take_no_room()
        out["retry"], out["again"], out["ST"] = retry, nl.take_no_room(), [S, T]
        await nl.backfill(retry)
        out["written"] = nl.slots[S].written and nl.slots[T].written
        nl.abandon()

    run_session(cfg, body, check_invariants=False)
    assert out["claimed_without_room"] is False
    assert out["before_a_release"] == []  # nothing freed yet: nothing to retry
    assert out["no_budget"] == []  # no read for a slot that would find no room again
    assert out["released"] == [7, 7]
    # S read back from the cache, T from the source: each once
    assert out["retry"] == out["ST"] and out["again"] == []
    assert out["written"] is True


def test_the_current_log_stays_protected_while_in_process_reads_report(tmp_path):
    """Reads served in training processes release the current log's chunks through their
    events: their readers alone no longer let the log go (it was, and the next log then
    found no room), only events lost from a full ring do, once per loss."""
    import time

    files, cfg = two_samples(tmp_path)
    out = {}

    class Log(_ReleasingLog):
        def __init__(self) -> None:
            super().__init__()
            self.unprotected = 0

        def unprotect(self) -> None:
            self.unprotected += 1

    async def body(sess):
        planner = sess.streams.planner
        lost = [0]
        planner.events_lost = lambda: lost[0]
        s = Stream("job", 0, last_open=time.monotonic())
        s.current_log = Log()
        planner.streams[("job", 0)] = s
        planner.unprotect_idle(time.monotonic())
        out["kept"] = (s.current_log.release_after_use, s.current_log.unprotected)
        lost[0] = 3
        planner.unprotect_idle(time.monotonic())
        out["lost"] = (s.current_log.release_after_use, s.current_log.unprotected)
        s.current_log = Log()  # the next epoch's: the same loss is not counted again
        planner.unprotect_idle(time.monotonic())
        out["again"] = (s.current_log.release_after_use, s.current_log.unprotected)
        del planner.streams[("job", 0)]

    run_session(cfg, body, check_invariants=False)
    assert out["kept"] == (True, 0)
    assert out["lost"] == (False, 1)
    assert out["again"] == (True, 0)


def _recording_bytes_for(sess) -> list[int]:
    """Record the inodes the next logs read back (from the cache, else the source)."""
    calls: list[int] = []
    real = sess.prefetcher.bytes_for

    async def bytes_for(ino, ident):
        calls.append(ino)
        return await real(ino, ident)

    sess.prefetcher.bytes_for = bytes_for
    return calls


def test_a_sample_served_without_room_keeps_its_bytes_for_its_slot(tmp_path):
    """A sample served through the mount when the cache had no room for its slot (the
    current log's release a drain late) is written from the bytes it was served, once
    room comes: with a cache too small for the dataset it was prefetched into memory
    only, and read again it was read from the source a second time."""
    files, cfg = two_samples(tmp_path)
    out = {}

    async def body(sess):
        nl, inos = await planned(sess, files)
        S, _ = inos
        served_without_room(sess, files, [nl], [S])
        calls = _recording_bytes_for(sess)
        before = sess.engine.counters.bytes_from_source
        nl.room_freed()
        retry = nl.take_no_room()
        await nl.backfill(retry)
        out.update(retry=retry, S=S, calls=calls, written=nl.slots[S].written,
                   source=sess.engine.counters.bytes_from_source - before,
                   held=nl.held_bytes)
        nl.abandon()

    run_session(cfg, body, check_invariants=False)
    assert out["retry"] == [out["S"]] and out["written"]
    assert out["calls"] == [] and out["source"] == 0 and out["held"] == 0


def test_a_backfill_of_in_process_reads_keeps_the_chunks_they_released(tmp_path):
    """Reads served in training processes release the current log's chunks in the same
    step as they ask the next logs to read their records back: the chunks are pinned
    until then, so a seal in between does not drop them (the record was read from the
    source again: 1.5x Belady's source bytes), and they go once read."""
    files, cfg = two_samples(tmp_path)
    out = {}

    async def body(sess):
        eng, writer = sess.engine, sess.engine.writer
        assert await read_all(eng, b"train/c0/img00.jpg")
        await eng.flush()
        nl, inos = await planned(sess, files)
        S, _ = inos
        chunk = eng.index.get_record(S).chunk_id
        pinned = nl.hold([S])
        writer.retire_chunk(chunk)  # released after use by the same reads
        await writer.flush()  # a seal before the backfill ran
        out["kept"] = eng.index.get_chunk(chunk) is not None
        before = eng.counters.bytes_from_source
        await nl.backfill([S], pinned)
        out["written"] = nl.slots[S].written
        out["source"] = eng.counters.bytes_from_source - before
        await writer.flush()
        out["gone_after"] = eng.index.get_chunk(chunk) is None and chunk not in writer.pins
        nl.abandon()

    run_session(cfg, body, check_invariants=False)
    assert out["kept"] and out["written"] and out["source"] == 0
    assert out["gone_after"]


def test_a_release_by_one_rank_retries_another_ranks_slots_that_found_no_room(tmp_path):
    """Each rank's next log is filled from every rank's opens: a slot of rank 1's log that
    found no room is retried when rank 0's current log releases a chunk (only the
    releasing rank's own log was retried: rank 1's waited, unsealed, for the epoch's end,
    and its next epoch read those chunks' samples from the source)."""
    from dlcachefs.clairvoyance.positions import Positions

    files, cfg = two_samples(tmp_path)
    out = {}

    async def body(sess):
        nl, inos = await planned(sess, files)
        S, T = inos
        served_without_room(sess, files, [nl], [S])
        r0, r1 = Stream("default", 0), Stream("default", 1)
        r0.order, r0.positions, r0.consumed = [T], Positions([T]), bytearray(1)
        r0.current_log = _ReleasingLog()
        r1.next_log = nl
        table = sess.streams.streams
        table[("default", 0)], table[("default", 1)] = r0, r1
        sess.streams.note_open(r0, T)  # rank 0's read releases a chunk of its log
        with trio.fail_after(20):
            while not nl.slots[S].written:
                await trio.sleep(0.01)
        out["written"] = nl.slots[S].written
        del table[("default", 0)], table[("default", 1)]
        nl.abandon()

    run_session(cfg, body, check_invariants=False)
    assert out["written"]


def test_held_bytes_go_back_to_the_daemons_budget(tmp_path):
    """Bytes held for a slot that found no room are given back when the slot is claimed
    another way (a filler) and when the log ends: a log of a job gone kept them (64 MiB
    a log, never given back). The budget is one for every log of the daemon."""
    files, cfg = two_samples(tmp_path)
    out = {}

    async def body(sess):
        nl, inos = await planned(sess, files)
        S, T = inos
        other = sess.streams.planner.new_log("other/0", 1)  # a second log, the same budget
        assert other.budget is nl.budget
        served_without_room(sess, files, [nl], inos)
        out["held"] = (nl.held_bytes, nl.budget.used)
        nl._claim_filler(nl.slots[T])  # T claimed another way: its bytes go
        out["after_filler"] = (nl.held_bytes, nl.budget.used)
        nl.abandon()  # the log ends: every byte goes
        out["after_end"] = (nl.held_bytes, nl.budget.used)
        other.abandon()

    run_session(cfg, body, check_invariants=False)
    assert out["held"] == (6000, 6000)
    assert out["after_filler"] == (3000, 3000)
    assert out["after_end"] == (0, 0)


@pytest.mark.daemon_log_allows(r"backfill of epoch 1's log failed", r"RuntimeError: a bug")
def test_a_backfill_whose_read_fails_unpins_each_chunk_once(tmp_path):
    """The chunks pinned for a backfill of in-process reads are unpinned once, also when
    its read raises: a second unpin took away another reader's pin on the chunk (a read
    in flight), which could then be dropped and punched under it."""
    files, cfg = two_samples(tmp_path)
    out = {}

    async def body(sess):
        eng, writer = sess.engine, sess.engine.writer
        assert await read_all(eng, b"train/c0/img00.jpg")
        await eng.flush()
        nl, inos = await planned(sess, files)
        S, _ = inos
        chunk = eng.index.get_record(S).chunk_id
        assert writer.pin(chunk)  # another reader's pin, held throughout
        pinned = nl.hold([S])

        async def failing(slot):
            raise RuntimeError("a bug in the read")

        nl._planned_bytes = failing
        await nl.backfill([S], pinned)  # logged, never raised
        out["pins"] = writer.pins[chunk]
        writer.unpin(chunk)
        nl.abandon()

    run_session(cfg, body, check_invariants=False)
    assert out["pins"] == 1


def test_one_round_of_retries_shares_the_room_freed_between_logs(tmp_path):
    """The slots of several next logs that found no room are retried in one round when
    a chunk is released: each log's retry takes from what the others left of the room
    (each was handed the whole room: together they read back more slots than could be
    reserved, and those found no room again, read for nothing)."""
    files, cfg = two_samples(tmp_path)
    out = {}

    async def body(sess):
        async with two_logs_without_room(sess, files) as (nl, other):
            retried: dict[str, list[int]] = {}
            for log in (nl, other):
                async def record(inos, pinned=None, key=log.key):
                    retried[key] = list(inos)
                log.backfill = record
            sess.streams.planner.retry_no_room()
            await trio.testing.wait_all_tasks_blocked()
            out["retried"] = sorted(len(v) for v in retried.values())
            out["left_for_later"] = sorted(len(log._no_room) for log in (nl, other))

    run_session(cfg, body, check_invariants=False)
    assert out["retried"] == [1]  # one slot's read: the room of one slot
    assert out["left_for_later"] == [0, 1]  # the other log's, at the next release


def test_room_handed_to_a_retry_still_reading_is_not_handed_again(tmp_path):
    """A retry reserves its slots after reading them back: a second release meanwhile
    (a few opens later) found the same reclaimable room and handed it to the other log
    too, which then read its slot back for nothing. The room promised to a retry still
    reading counts as taken until it has reserved or given up; then the other log gets
    it at the next release."""
    files, cfg = two_samples(tmp_path)
    out = {}

    async def body(sess):
        planner = sess.streams.planner
        async with two_logs_without_room(sess, files) as (nl, other):
            reading = trio.Event()
            retried: list[str] = []
            for log in (nl, other):
                async def slow(inos, pinned=None, key=log.key):
                    retried.append(key)
                    await reading.wait()  # still reading back: nothing reserved yet
                log.backfill = slow
            planner.retry_no_room()
            planner.retry_no_room()  # the next release, while the first retry reads
            await trio.testing.wait_all_tasks_blocked()
            out["while_reading"] = len(retried)
            reading.set()
            await trio.testing.wait_all_tasks_blocked()
            planner.retry_no_room()  # a release after it finished: the room again
            await trio.testing.wait_all_tasks_blocked()
            out["after"] = len(retried)
            out["promised"] = planner._promised

    run_session(cfg, body, check_invariants=False)
    assert out["while_reading"] == 1
    assert out["after"] == 2 and out["promised"] == 0


def test_backfills_of_several_logs_run_together_and_unpin_once_when_cancelled(tmp_path):
    """One drain's backfills of several next logs run two at a time (they ran one after
    the other); cancelled (the daemon stopping) with one log still waiting for its turn,
    each log's pins are unpinned once: by its backfill when it started, else by the
    task that waited."""
    files, cfg = two_samples(tmp_path)
    out = {}

    async def body(sess):
        eng, writer = sess.engine, sess.engine.writer
        assert await read_all(eng, b"train/c0/img00.jpg")
        await eng.flush()
        nl, inos = await planned(sess, files)
        S, _ = inos
        chunk = eng.index.get_record(S).chunk_id
        logs = [nl]
        for r in (1, 2):
            other = sess.streams.planner.new_log(f"default/{r}", 1)
            await other.plan(inos)
            logs.append(other)
        running: list[str] = []

        def blocking(log):
            async def backfill(inos, pinned=None):
                running.append(log.key)
                try:
                    await trio.sleep_forever()
                finally:
                    running.remove(log.key)
                    for cid in pinned or ():  # (the contract: unpinned, whatever happens)
                        writer.unpin(cid)
            return backfill

        jobs = []
        for log in logs:
            log.backfill = blocking(log)
            jobs.append((log, [S], log.hold([S])))
        assert writer.pin(chunk)  # another reader's pin, held throughout
        out["pins"] = writer.pins[chunk]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sess.streams.planner._backfill_reads, jobs)
            await trio.testing.wait_all_tasks_blocked()
            out["running"] = len(running)
            nursery.cancel_scope.cancel()  # the daemon stopping
        out["pins_after"] = writer.pins.get(chunk, 0)
        writer.unpin(chunk)
        for log in logs:
            log.abandon()

    run_session(cfg, body, check_invariants=False)
    assert out["pins"] == 4
    assert out["running"] == 2  # BACKFILLS of the 3 (1 when one after the other)
    assert out["pins_after"] == 1  # the other reader's, only
