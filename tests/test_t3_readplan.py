"""Tier 3: planned reads (dlcachefs.cache.readplan) with the engine driven directly under trio,
no kernel: a stream announced with a known order and no next-epoch log (``reorder``
off), over a cache filled beforehand."""

from __future__ import annotations

import random
import threading

import pytest
import trio

import dlcachefs.cache.readplan as readplan
from dlcachefs.cache.namespace import identity
from dlcachefs.testing.fakes import make_config, read_all, run_session, write_tree

PID = 9_100_000  # above the kernel's pid_max: never a real process


def dataset(seed: int = 3) -> dict[bytes, bytes]:
    rng = random.Random(seed)
    return {b"train/c%d/%02d.jpg" % (c, i): rng.randbytes(rng.randrange(500, 4000))
            for c in range(3) for i in range(10)}


def make_setup(tmp_path, files: dict[bytes, bytes], **kw):
    """``files`` written to a source under ``tmp_path``, and a config over it (16 KiB
    chunks, no next-epoch logs unless ``kw`` says otherwise)."""
    src = tmp_path / "src"
    write_tree(src, files)
    kw = {"chunk_size": 16 << 10, "reorder": False, **kw}
    return make_config(src, tmp_path / "cache", **kw), files


@pytest.fixture
def setup(tmp_path):
    return make_setup(tmp_path, dataset())


async def read_whole(eng, ino: int, step: int = 1 << 20) -> bytes:
    """open (as the reader's process) + READs of ``step`` bytes to the end + release."""
    h = await eng.open(ino, PID)
    try:
        out = bytearray()
        while piece := await eng.read(h.fh, len(out), step):
            out += piece
    finally:
        eng.release(h.fh)
    return bytes(out)


async def read_in_process(r, s) -> None:
    """The stream's whole epoch read in the training's processes: their events, one per
    position in order, as a drain tells them (a few checkpoints between: the plan runs)."""
    from dlcachefs.cache.readers import OpenEvent, Served

    eng = r.eng
    for p in range(len(s.order)):
        ino = r.ino_at(p)
        ev = OpenEvent(ino, PID, eng.index.get_entry(ino).parent, 0.0, s, in_process=True)
        eng.observers.opened(ev)
        eng.observers.served(ev, Served(None, None, True))
        for _ in range(5):
            await trio.sleep(0)


class Reader:
    """One rank reading its announced epoch through the engine, in the epoch's order."""

    def __init__(self, sess, files) -> None:
        eng = sess.engine
        self.eng, self.files = eng, files
        self.sess = sess
        self.cs = sess.control
        self.by_ino = {eng.ns.resolve(rel).ino: rel for rel in files}
        self.pos = 0

    async def fill(self) -> None:
        """Every file read once without a stream, sealed and indexed."""
        for rel in sorted(self.files):
            assert await read_all(self.eng, rel) == self.files[rel]
        await self.eng.flush()
        assert self.eng.index.n_records() == len(self.files)

    async def announce(self, epoch: int = 0):
        self.cs.apply(f"job j\ndataset train\nsampler distributed seed=5 world=1 rank=0\n"
                      f"epoch {epoch}\n".encode(), PID)
        self.pos = 0
        with trio.fail_after(20):  # the order is replayed in a thread: wait for it
            while (s := self.sess.streams.streams.get(("j", 0))) is None or \
                    s.epoch != epoch or not s.order:
                await trio.sleep(0.01)
        self.stream = s
        return s

    async def plan(self):
        """The stream's plan, once its task has begun."""
        with trio.fail_after(20):
            while (p := self.sess.plans.plans.get(self.stream.key)) is None:
                await trio.sleep(0.01)
        return p

    def ino_at(self, p: int) -> int:
        s = self.stream
        return s.samples.inos[s.order[p]]

    async def read_next(self) -> None:
        ino = self.ino_at(self.pos)
        self.pos += 1
        assert await read_whole(self.eng, ino) == self.files[self.by_ino[ino]]

    async def read_rest(self) -> None:
        while self.pos < len(self.stream.order):
            await self.read_next()


def test_open_waiting_for_its_batch_takes_the_planned_bytes(setup, monkeypatch):
    """Regression (review): the open moves the reader's position before it takes; when it
    waited for its batch in flight, the plan dropped the record as 'behind the reader' as
    soon as the batch landed, and the open read it again from the log."""
    cfg, files = setup
    gate = threading.Event()
    real = readplan.read_runs

    def gated(logs, runs):
        gate.wait(30)  # the first batch stays in flight until the open waits for it
        return real(logs, runs)

    async def body(sess):
        eng = sess.engine
        r = Reader(sess, files)
        await r.fill()
        monkeypatch.setattr(readplan, "read_runs", gated)
        await r.announce()
        plan = await r.plan()
        first = r.ino_at(0)
        with trio.fail_after(20):
            while first not in plan.inflight:
                await trio.sleep(0.01)
        ev = plan.inflight[first]
        async with trio.open_nursery() as n:
            n.start_soon(r.read_next)
            with trio.fail_after(20):  # the open waits in take() for the batch
                while ev.statistics().tasks_waiting == 0:
                    await trio.sleep(0.01)
            gate.set()
        assert eng.counters.planned_hits == 1
        assert eng.counters.fill_reads == 0  # not read again as a single record
        await r.read_rest()

    run_session(cfg, body)


def test_finished_plan_is_closed_and_unregistered(setup):
    """Regression (review): a plan that handed out its whole epoch stayed registered, so
    plan_for kept returning a plan that serves nothing."""
    cfg, files = setup

    async def body(sess):
        eng = sess.engine
        r = Reader(sess, files)
        await r.fill()
        s = await r.announce()
        plan = await r.plan()
        await r.read_rest()
        with trio.fail_after(20):
            while s.key in sess.plans.plans:
                await trio.sleep(0.01)
        assert plan.closed and sess.plans.plan_for(s) is None
        assert sess.plans.held == 0 and eng.memtier.reserved == 0

    run_session(cfg, body)


def test_plan_of_a_stopped_reader_gives_its_memory_back(setup):
    """Regression (review): a job that stopped mid-epoch kept the plan's reservation of
    the memory tier for good. Without progress for ``idle`` seconds the plan gives back
    what it holds, and reads ahead again once the reader moves."""
    cfg, files = setup

    async def body(sess):
        eng = sess.engine
        sess.plans.idle = 0.3
        r = Reader(sess, files)
        await r.fill()
        await r.announce()
        plan = await r.plan()
        for _ in range(3):
            await r.read_next()
        with trio.fail_after(20):  # the plan read ahead of the reader, then it stops
            while not plan.ready:
                await trio.sleep(0.01)
        assert eng.memtier.reserved > 0
        with trio.fail_after(20):
            while eng.memtier.reserved or sess.plans.held:
                await trio.sleep(0.01)
        assert plan.idle and not plan.ready and plan.held == 0
        assert sess.plans.plan_for(r.stream) is plan  # still this epoch's plan
        hits = eng.counters.planned_hits
        await r.read_next()  # the reader moves again: so does the plan
        with trio.fail_after(20):
            while not plan.ready:
                await trio.sleep(0.01)
        assert not plan.idle
        await r.read_rest()
        assert eng.counters.planned_hits > hits

    run_session(cfg, body)


def big_setup(tmp_path, per_class: int = 60):
    """More files than a plan reads ahead before its epoch's pages are judged."""
    rng = random.Random(11)
    files = {b"train/c%d/%03d.jpg" % (c, i): rng.randbytes(rng.randrange(500, 2000))
             for c in range(3) for i in range(per_class)}
    assert len(files) > 2 * readplan.FIRST_LEAD
    return make_setup(tmp_path, files)


async def open_unread(eng, ino: int) -> None:
    """An open the kernel's page cache serves: no READ comes before its release."""
    h = await eng.open(ino, PID)
    eng.release(h.fh)


def test_a_sample_opened_again_in_its_epoch_is_read_only_if_a_read_comes(setup):
    """A loader that opens each sample twice (its raw bytes, then PIL): the plan hands its
    bytes to the first open, and the second one read the record again from the cache disk
    at open, even when the kernel's pages (filled by the first) served it. Now it is
    loaded at its first READ, if one comes, and then as the record alone (never its whole
    chunk), while the plan runs and after it has finished."""
    cfg, files = setup

    async def second_open_read(eng, r, ino) -> None:
        before, chunks = eng.logs.bytes_read, eng.counters.chunk_reads
        h = await eng.open(ino, PID)
        try:
            data = await eng.read(h.fh, 0, 1 << 20)
        finally:
            eng.release(h.fh)
        assert bytes(data) == files[r.by_ino[ino]]
        assert eng.counters.chunk_reads == chunks
        assert eng.logs.bytes_read - before <= len(data) + 4096

    async def body(sess):
        eng = sess.engine
        r = Reader(sess, files)
        await r.fill()
        s = await r.announce()
        plan = await r.plan()
        # the first sample held (or in flight) before the first open: on a loaded machine
        # the plan's task may otherwise start after the reader has passed every sample
        with trio.fail_after(20):
            while not plan.holds(r.ino_at(0)):
                await trio.sleep(0.01)
        for _ in range(len(files)):
            ino = r.ino_at(r.pos)
            await r.read_next()  # the first open: the plan's bytes (or its own read)
            if r.pos == 5:  # a second open that is READ, mid-epoch
                await second_open_read(eng, r, ino)
                continue
            before = eng.logs.bytes_read
            h = await eng.open(ino, PID)  # the second: the kernel's pages serve it
            eng.release(h.fh)
            assert eng.logs.bytes_read == before, r.pos
        assert eng.counters.planned_hits > 0
        with trio.fail_after(20):  # the plan handed everything out and is gone
            while s.key in sess.plans.plans:
                await trio.sleep(0.01)
        await second_open_read(eng, r, r.ino_at(0))

    run_session(cfg, body)


def test_a_plan_pauses_while_the_kernels_pages_serve_the_epoch(tmp_path):
    """The kernel holds what the last epoch read: this epoch's opens come without READs.
    Its plan read ahead only ``FIRST_LEAD`` positions until a window of opens was judged
    (before, a dataset that fits in the budget was read whole at once, for nothing), then
    reads nothing more while the opens are served so. READs coming back resume it from
    the reader's position."""
    cfg, files = big_setup(tmp_path)

    async def body(sess):
        eng = sess.engine
        r = Reader(sess, files)
        await r.fill()
        s = await r.announce()
        assert not s.pages_served
        plan = await r.plan()
        with trio.fail_after(20):
            while not plan.ready:
                await trio.sleep(0.01)
        await trio.sleep(0.2)  # it would read on now if its lead allowed
        assert max(x.pos for x in plan.ready.values()) < readplan.FIRST_LEAD
        read = eng.logs.bytes_read
        # PAGED_MIN_OPENS opens served by the kernel
        while not s.pages_served:
            await open_unread(eng, r.ino_at(r.pos))
            r.pos += 1
        assert r.pos < readplan.FIRST_LEAD
        while r.pos < len(s.order) // 2:
            await open_unread(eng, r.ino_at(r.pos))
            r.pos += 1
        await trio.sleep(0.2)
        assert eng.logs.bytes_read == read  # nothing more read ahead, nothing at open
        assert sess.plans.held == 0 and eng.memtier.reserved == 0  # passed: dropped
        assert sess.plans.plan_for(s) is plan
        # READs come back (the kernel dropped the pages): the plan resumes, from here
        while s.pages_served:
            await r.read_next()
        with trio.fail_after(20):
            while not plan.ready:
                await trio.sleep(0.01)
        assert min(x.pos for x in plan.ready.values()) >= r.pos - 1
        planned = eng.counters.planned_hits
        await r.read_rest()
        assert eng.counters.planned_hits > planned

    run_session(cfg, body)


def test_a_verdict_that_keeps_turning_never_has_records_read_twice(tmp_path):
    """The kernel's pages serve the epoch's opens for a while, then not, then again (it
    holds part of the dataset): the plan pauses and resumes with the verdict, and no
    record is read from the cache disk twice. (A first version stopped the plan and
    started a new one at each turn, which read its whole lead again: up to 6x the
    dataset in a review's measurement.)"""
    cfg, files = big_setup(tmp_path, per_class=100)
    size = sum(len(v) for v in files.values())

    async def body(sess):
        eng = sess.engine
        r = Reader(sess, files)
        await r.fill()
        s = await r.announce()
        plan = await r.plan()
        before = eng.logs.bytes_read
        turns, served = 0, s.pages_served
        while r.pos < len(s.order):
            if (r.pos // 40) % 2:  # 40 opens READ, then 40 the kernel serves, ...
                await r.read_next()
            else:
                await open_unread(eng, r.ino_at(r.pos))
                r.pos += 1
            if s.pages_served != served:
                turns, served = turns + 1, s.pages_served
            await trio.sleep(0)  # the plan's task runs between opens, as with a kernel
        assert turns >= 4, turns
        assert eng.counters.planned_hits > 0
        assert eng.logs.bytes_read - before <= size / readplan.MIN_USEFUL + 4096
        assert plan.held == 0 or plan.closed

    run_session(cfg, body)


def test_a_plan_never_reads_what_memory_holds(setup):
    """A file held in the read-ahead set (fetched ahead, or kept for its next open) is
    taken from there by its open: the plan skips it rather than read its record too."""
    cfg, files = setup

    async def body(sess):
        eng = sess.engine
        r = Reader(sess, files)
        await r.fill()
        # five files whose bytes are in memory before the epoch is announced
        held = sorted(r.by_ino)[:5]
        for ino in held:
            e = eng.index.get_entry(ino)
            eng.readahead.put(ino, identity(e), None, files[r.by_ino[ino]], "test",
                              cached=True)
        s = await r.announce()
        plan = await r.plan()
        seen: set[int] = set()
        while r.pos < len(s.order):
            seen.update(plan.ready)
            if r.ino_at(r.pos) in held:
                before = eng.logs.bytes_read
                await r.read_next()
                assert eng.logs.bytes_read == before
            else:
                await r.read_next()
        assert not seen & set(held)

    run_session(cfg, body)


def test_a_next_epoch_log_does_not_keep_a_second_open_from_being_lazy(tmp_path):
    """With the next epoch's order known, a log is laid out for it from the bytes each
    open is served: an open whose slot is still to be written loads its bytes at open;
    a second open of the sample (its slot written by the first) is lazy, and the kernel's
    pages serve it with nothing read from the cache disk."""
    cfg, files = make_setup(tmp_path, dataset(), reorder=True, reorder_min=0)

    async def body(sess):
        eng = sess.engine
        r = Reader(sess, files)
        await r.fill()
        s = await r.announce()
        with trio.fail_after(20):
            while s.next_log is None:
                await trio.sleep(0.01)
        for _ in range(len(files)):
            ino = r.ino_at(r.pos)
            await r.read_next()
            assert not s.next_log.wants(ino)
            before = eng.logs.bytes_read
            h = await eng.open(ino, PID)
            eng.release(h.fh)
            assert eng.logs.bytes_read == before, r.pos

    run_session(cfg, body)


def test_bytes_kept_for_the_next_open_are_never_an_older_version(tmp_path):
    """A header check keeps the file's bytes for the open that follows; the file changes
    on the source in between: that open gets the new version, never the kept bytes."""
    cfg, files = make_setup(tmp_path, dataset(), revalidate=0)

    async def body(sess):
        eng = sess.engine
        r = Reader(sess, files)
        await r.fill()
        await r.announce()
        await r.plan()
        ino = r.ino_at(0)
        rel = r.by_ino[ino]
        h = await eng.open(ino, PID)
        try:
            assert bytes(await eng.read(h.fh, 0, 16)) == files[rel][:16]
        finally:
            eng.release(h.fh)
        assert ino in eng.readahead  # kept for the next open
        new = b"new version " * 500
        write_tree(tmp_path / "src", {rel: new})
        assert await read_whole(eng, ino, 1000) == new

    run_session(cfg, body)


def test_a_header_check_then_a_read_reads_the_record_once(setup):
    """A loader that checks each file's header (the kernel READs only its head) and then
    opens it again to read it all: the second open's READs read the record again from the
    cache disk. The bytes the first open held are kept (a spare of the read-ahead set)
    for the open that follows."""
    cfg, files = setup

    async def body(sess):
        eng = sess.engine
        r = Reader(sess, files)
        await r.fill()
        s = await r.announce()
        await r.plan()
        read0 = eng.logs.bytes_read
        for _ in range(len(s.order)):
            ino = r.ino_at(r.pos)
            r.pos += 1
            want = files[r.by_ino[ino]]
            h = await eng.open(ino, PID)  # the header check: its first 16 bytes READ
            try:
                assert bytes(await eng.read(h.fh, 0, 16)) == want[:16]
            finally:
                eng.release(h.fh)
            before = eng.logs.bytes_read
            assert await read_whole(eng, ino, 1000) == want  # then the whole file
            assert eng.logs.bytes_read == before, r.pos
        size = sum(len(v) for v in files.values())
        assert eng.logs.bytes_read - read0 <= size / readplan.MIN_USEFUL + 4096

    run_session(cfg, body)


@pytest.mark.parametrize("board", ["taken", "lagging", None])
def test_a_stream_read_in_process_is_advised_in_quarters_of_the_lead(tmp_path, monkeypatch,
                                                                      board):
    """A stream whose reader reads the logs in its own processes (dlcachefs run) gets its
    window asked into the page cache, never read into the daemon's memory, and in
    batches of a quarter of the lead as the reader passes (a thread and a call per
    record it passes cost the daemon more than the events themselves). With the
    readers' board (the default) the daemon only posts the runs there and asks the
    kernel for nothing itself; without one, or while the readers take nothing from it,
    it asks itself."""

    rng = random.Random(5)
    files = {b"train/c%d/%03d.jpg" % (c, i): rng.randbytes(rng.randrange(500, 2000))
             for c in range(3) for i in range(40)}
    cfg, files = make_setup(tmp_path, files)
    calls: list[int] = []
    real = readplan.advise_runs

    def counted(logs, runs):
        n = real(logs, runs)
        calls.append(n)
        return n

    out = {}

    async def body(sess):
        r = Reader(sess, files)
        await r.fill()
        s = await r.announce(0)
        first = await r.plan()
        s.in_process = True  # (its next epoch's plan starts with it)
        sess.plans.lead = 40
        monkeypatch.setattr(readplan, "advise_runs", counted)
        if board:
            real_post = sess.plans.board.post
            monkeypatch.setattr(sess.plans.board, "post",
                                lambda ranges: calls.append(real_post(ranges)) or calls[-1])
            # (no reader process takes here: whether they do is set, not timed)
            monkeypatch.setattr(sess.plans.board, "lagging",
                                lambda now=None: board == "lagging")
        else:
            sess.plans.board = None
        s = await r.announce(1)
        await r.plan()
        with trio.fail_after(20):  # epoch 0's plan, reading into memory, is over
            while not first.closed or first.inflight:
                await trio.sleep(0.01)
        before = sess.stats()["planned_bytes"]
        await read_in_process(r, s)
        with trio.fail_after(20):  # the plan handed out its epoch: no advise in flight
            while s.key in sess.plans.plans:
                await trio.sleep(0.01)
        out["planned_bytes"] = sess.stats()["planned_bytes"] - before
        out["advised"] = sess.stats()["planned_advised_bytes"]
        out["posted"] = sess.stats()["planned_posted_bytes"]
        out["lagged"] = sess.stats()["planned_lagged"]
        out["calls"] = list(calls)

    run_session(cfg, body)
    assert out["planned_bytes"] == 0  # nothing read into the daemon's memory
    calls = out["calls"]
    assert (out["lagged"] > 0) == (board == "lagging")
    if board == "taken":
        assert out["advised"] == 0  # the daemon asked the kernel for nothing itself
        assert out["posted"] == sum(calls) > 0
    else:
        assert out["posted"] == 0
        assert out["advised"] == sum(calls) > 0
    # 120 positions, a lead of 40: one call per quarter (10 positions) and the first
    # window, not one per position
    assert 1 <= len(calls) <= 120 // 10 + 3, calls


def test_a_plan_reads_little_into_memory_until_it_knows_where_reads_are_served(tmp_path):
    """An epoch read through the mount, then announced again and read in the training's
    processes (a job restarted under `dlcachefs run`: the stream's pages were judged in
    the epoch before, so the plan's first lead was not held back). Until an open of the
    new pass tells, the plan reads at most FIRST_LEAD records into the daemon's memory
    (the readers read the logs themselves: those bytes are read twice); after it,
    nothing more."""

    rng = random.Random(6)
    files = {b"train/c%d/%03d.jpg" % (c, i): rng.randbytes(rng.randrange(500, 2000))
             for c in range(3) for i in range(80)}
    cfg, files = make_setup(tmp_path, files)
    out = {}

    async def body(sess):
        r = Reader(sess, files)
        await r.fill()
        await r.announce(0)
        await r.plan()
        await r.read_rest()  # epoch 0 through the mount: its plan read ahead, judged
        before = sess.stats()["planned_records"]
        with trio.fail_after(20):  # epoch 0's plan handed everything out
            while r.stream.key in sess.plans.plans:
                await trio.sleep(0.01)
        s = await r.announce(0)
        assert not s.in_process
        plan = await r.plan()
        with trio.fail_after(20):  # its first batch read, nothing in flight
            while not plan.ready or plan.inflight:
                await trio.sleep(0.01)
        for _ in range(50):
            await trio.sleep(0)
        out["untold"] = sess.stats()["planned_records"] - before
        assert not plan.told
        await read_in_process(r, s)
        out["told"] = plan.told
        out["all"] = sess.stats()["planned_records"] - before
        out["posted"] = sess.stats()["planned_posted_bytes"]

    run_session(cfg, body)
    assert 0 < out["untold"] <= readplan.FIRST_LEAD < 240
    assert out["told"] and out["all"] == out["untold"]  # nothing more into memory
    assert out["posted"] > 0  # the rest went to the readers' board


@pytest.mark.parametrize("stale", [False, True])
def test_the_prefetch_loop_passes_cached_positions_without_a_task(tmp_path, monkeypatch,
                                                                   stale):
    """A warm epoch read through a plan: each position whose file is cached and listed
    fresh is passed by the prefetch loop without a task (prefetch_one would only have
    found it cached: its cost per sample). A listing past ``revalidate`` still goes
    through prefetch_one, which checks the source first (freshness ahead of the reader).
    Either way every position ends ready and the reader gets the source's bytes."""
    cfg, files = make_setup(tmp_path, dataset(), revalidate=3600.0)
    calls: list[int] = []

    async def body(sess):
        eng = sess.engine
        pf = sess.prefetcher
        real = pf.prefetch_one

        async def counted(ino, stream):
            calls.append(ino)
            return await real(ino, stream)

        monkeypatch.setattr(pf, "prefetch_one", counted)
        r = Reader(sess, files)
        await r.fill()
        if stale:  # every listing checked long ago: the rule asks the source again
            eng.ns.revalidate = 1e-9
        s = await r.announce()
        await r.read_rest()
        with trio.fail_after(20):
            while s.prefetched_upto < len(s.order):
                await trio.sleep(0.01)
        assert all(s.ready)

    run_session(cfg, body)
    if stale:  # (positions the reader passed before their task came are not asked)
        assert calls
    else:
        assert calls == []
