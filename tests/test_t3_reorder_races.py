"""Races in a next epoch's log (dlcachefs.clairvoyance.reorder): tasks that claim slots
across an await, against the epoch switch and the log's end. Found in review; each test
holds a fetch open at the racing moment with events, no timing."""

import os

import trio

from dlcachefs.clairvoyance.reorder import NextEpochLog
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
