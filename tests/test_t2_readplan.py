"""Planned reads: which records are read together (dlcachefs.cache.readplan.group_reads), and
the worker-thread half that reads and verifies them (read_runs), without a mount."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlcachefs.cache.readplan import MIN_USEFUL, Want, group_reads, read_runs
from dlcachefs.clairvoyance.samplelist import SampleList
from dlcachefs.clairvoyance.stream import Stream, same_dataset
from dlcachefs.store.chunkfmt import RecordIn, encode_chunk
from dlcachefs.store.logs import LogStore
from dlcachefs.store.schema import Record


def _layout(chunks: list[list[tuple[int, int]]]) -> dict[int, Record]:
    """Records from (size, gap before it) per chunk; chunks back to back in logs 1 and 2."""
    recs: dict[int, Record] = {}
    ino = 1
    off = 40
    for cid, chunk in enumerate(chunks):
        off += 48
        for size, gap in chunk:
            off += gap
            recs[ino] = Record(cid, 1 + cid % 2, off, size, ino * 7, 0, 0)
            off += size
            ino += 1
    return recs


layouts = st.lists(st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 3000)),
                            min_size=1, max_size=12), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None)
@given(layouts, st.randoms(use_true_random=False), st.floats(0.3, 1.0))
def test_grouping_covers_each_record_once_within_the_useful_fraction(chunks, rnd, frac):
    recs = _layout(chunks)
    inos = list(recs)
    picked = rnd.sample(inos, rnd.randint(1, len(inos)))
    picked += rnd.sample(picked, min(2, len(picked)))  # a sample twice in the window
    rnd.shuffle(picked)
    runs = group_reads([Want(i, recs[i]) for i in picked], frac)

    got = [w.ino for r in runs for w in r.wants]
    assert sorted(got) == sorted(set(picked))  # every record exactly once
    useful_total = read_total = 0
    by_chunk: dict[int, list] = {}
    for r in runs:
        assert r.wants
        offs = [w.rec.offset for w in r.wants]
        assert offs == sorted(offs)
        for w in r.wants:
            assert w.rec.chunk_id == r.chunk_id and w.rec.log_id == r.log_id
            assert r.offset <= w.rec.offset and w.rec.offset + w.rec.size <= r.offset + r.length
        # tight: starts at its first record, ends at its last record's end
        assert r.offset == r.wants[0].rec.offset
        assert r.offset + r.length == max(w.rec.offset + w.rec.size for w in r.wants)
        assert r.useful >= frac * r.length - 1e-9  # the amplification bound, per read
        useful_total += r.useful
        read_total += r.length
        by_chunk.setdefault(r.chunk_id, []).append(r)
    assert read_total <= useful_total / frac + 1e-6
    for rs in by_chunk.values():
        for a, b in zip(rs, rs[1:], strict=False):
            assert a.offset + a.length <= b.offset  # no byte read twice
            # greedy: b was split off only because a + b's first record fell below frac
            nxt = b.wants[0].rec
            assert a.useful + nxt.size < frac * (nxt.offset + nxt.size - a.offset)


@given(layouts, st.randoms(use_true_random=False))
def test_records_needed_together_and_adjacent_are_one_read_per_chunk(chunks, rnd):
    recs = _layout([[(size, 0) for size, _ in c] for c in chunks])  # no gaps
    inos = list(recs)
    rnd.shuffle(inos)
    runs = group_reads([Want(i, recs[i]) for i in inos], MIN_USEFUL)
    assert len(runs) == len(chunks)  # whole chunks' records, each one pread
    assert all(r.useful == r.length for r in runs)


def test_far_apart_records_are_read_alone():
    recs = _layout([[(1000, 0), (1000, 50_000), (1000, 50_000)]])
    runs = group_reads([Want(i, recs[i]) for i in (3, 1, 2)])
    assert [len(r.wants) for r in runs] == [1, 1, 1]
    assert [r.length for r in runs] == [1000, 1000, 1000]


def test_read_runs_verifies_every_record(tmp_path):
    logs = LogStore(str(tmp_path / "logs"), 1 << 30)
    logs.start_log(1)
    rnd = random.Random(1)
    datas = [rnd.randbytes(rnd.randint(10, 3000)) for _ in range(20)]
    blob, metas = encode_chunk(5, [RecordIn(i + 1, f"f{i}".encode(), 0, 0, d)
                                   for i, d in enumerate(datas)])
    _, off = logs.append(blob)
    recs = {m.ino: Record(5, 1, off + m.data_offset, m.size, m.data_xxh, 0, 0) for m in metas}
    # damage record 4 on disk
    bad = recs[4]
    logs.pwrite(1, b"\xff" * 4, bad.offset)
    wanted = [1, 2, 3, 4, 9, 17]
    runs = group_reads([Want(i, recs[i]) for i in wanted])
    before = logs.bytes_read
    res = read_runs(logs, runs)
    assert logs.bytes_read - before == sum(r.length for r in runs)
    seen = {}
    for r, (data, oks) in zip(runs, res, strict=True):
        assert data is not None and len(data) == r.length
        for w, ok in zip(r.wants, oks, strict=True):
            a = w.rec.offset - r.offset
            seen[w.ino] = ok
            if ok:
                assert data[a : a + w.rec.size] == datas[w.ino - 1]
    assert seen == {1: True, 2: True, 3: True, 4: False, 9: True, 17: True}
    logs.close()


def test_memory_tier_gives_room_to_planned_reads():
    from dlcachefs.cache.memtier import ChunkBuf, MemoryTier

    t = MemoryTier(100)
    for cid in range(4):
        t.put(ChunkBuf(cid, 0, b"x" * 25, True))
    assert t.bytes == 100
    t.reserve(40)  # planned reads take 40 of the 100: the oldest chunks go
    assert t.bytes + t.reserved <= 100 and 0 not in t and 3 in t
    t.put(ChunkBuf(9, 0, b"y" * 25, True))
    assert t.bytes + t.reserved <= 100 and 9 in t
    t.unreserve(40)
    t.put(ChunkBuf(10, 0, b"z" * 25, True))
    assert t.bytes == 75 and t.reserved == 0


def test_memory_tier_stores_no_chunk_larger_than_the_room_reservations_leave():
    """Regression (review): with planned reads holding part of the tier, a chunk bigger
    than what is left was stored anyway (emptying the tier) and exceeded the limit."""
    from dlcachefs.cache.memtier import ChunkBuf, MemoryTier

    t = MemoryTier(100)
    t.put(ChunkBuf(1, 0, b"x" * 20, True))
    t.reserve(60)
    assert not t.can_hold(50) and t.can_hold(40)
    t.put(ChunkBuf(2, 0, b"y" * 50, True))  # cannot be held: not stored, nothing evicted
    assert 2 not in t and 1 in t
    assert t.bytes + t.reserved <= t.limit
    t.put(ChunkBuf(3, 0, b"z" * 40, True))  # fits once the older chunk goes
    assert 3 in t and t.bytes + t.reserved <= t.limit


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "want", "unwant", "get"]),
                          st.integers(0, 7), st.integers(5, 40)), max_size=60))
def test_memory_tier_evicts_a_chunk_a_reader_wants_only_when_nothing_else_is_left(ops):
    """A stream's reader needs the chunks it ``want``s (loaded ahead of it, or being read
    by one of its loader workers): eviction takes the least recently used chunk nobody
    wants first (plain LRU evicted them before their records were read: a laid-out log
    read twice), and among wanted ones the one wanted last (the furthest ahead); the byte
    limit holds and ``wanted_bytes`` counts each wanted chunk once, whatever the order of
    operations."""
    from dlcachefs.cache.memtier import ChunkBuf, MemoryTier

    t = MemoryTier(100)
    wanted: dict[int, list[int]] = {}  # chunk id -> [count, length], in first-wanted order
    for op, cid, size in ops:
        if op == "put":
            before = list(t._d)
            t.put(ChunkBuf(cid, 0, b"x" * size, True))
            gone = [c for c in before if c not in t and c != cid]
            if any(c in wanted for c in gone):
                # nothing unwanted was left, and the wanted went furthest-ahead first
                assert all(c in wanted for c in t._d if c != cid), (gone, list(t._d))
                held = [c for c in wanted if c in before and c != cid]
                assert [c for c in held if c in gone] == held[len(held) - len(
                    [c for c in gone if c in wanted]):], (held, gone)
        elif op == "want":
            t.want(cid, size)
            wanted.setdefault(cid, [0, size])[0] += 1
        elif op == "unwant" and cid in wanted:
            t.unwant(cid)
            wanted[cid][0] -= 1
            if not wanted[cid][0]:
                del wanted[cid]
        else:
            t.get(cid)
        assert t.bytes == sum(len(b.data) for b in t._d.values()) <= t.limit
        assert t.wanted_bytes == sum(length for _, length in wanted.values())


@pytest.mark.parametrize("opens,reads,served", [
    (0, 0, False), (31, 0, False),  # too few opens of cached files to tell
    (32, 0, True), (100, 10, True),  # the kernel's pages served (almost) all of them
    (100, 11, False), (100, 100, False)])
def test_an_epoch_is_page_served_when_its_cached_opens_came_without_reads(opens, reads,
                                                                          served):
    """Whether the next epoch is read ahead from the logs (no plan when the kernel's
    page cache served the last one: Stream.pages_served)."""
    s = Stream("j", 0)
    s.pages.cached_opens, s.pages.cached_reads = opens, reads
    s.pages.end_epoch()
    assert s.pages_served is served
    assert s.pages.cached_opens == s.pages.cached_reads == 0  # the next epoch counts anew
    s.pages.end_epoch()
    assert s.pages_served is False  # an epoch with no opens of cached files tells nothing


def opens(s: Stream, n: int, read: int) -> None:
    """``n`` opens of cached files, the first ``read`` of them READ, the others released
    with no READ (the kernel's pages served them)."""
    for i in range(n):
        count = s.note_cached_open()
        if i < read:
            s.note_cached_read(count)
        else:
            s.note_unread(count)


def test_reads_that_stop_coming_make_an_epoch_page_served_at_once():
    """The kernel holds what the last epoch read (its READs filled the pages): once a
    window of 32 opens has at most one READ, the epoch is taken as page-served (its plan
    pauses); 2 or 3 READs in 32 change nothing either way (hysteresis: a kernel holding
    most pages does not turn the verdict at every window)."""
    s = Stream("j", 0)
    s.pages.end_epoch()
    assert not s.pages_served and not s.pages_judged
    opens(s, 31, 0)
    assert not s.pages_served and not s.pages_judged  # a window is 32 outcomes
    opens(s, 1, 0)
    assert s.pages_served and s.pages_judged
    opens(s, 32, 3)  # not enough to end it
    assert s.pages_served
    opens(s, 32, 4)
    assert not s.pages_served and s.pages_lost.is_set()
    opens(s, 32, 2)  # not enough to start it again
    assert not s.pages_served
    opens(s, 32, 1)
    assert s.pages_served and not s.pages_lost.is_set()  # renewed for the next loss
    s.pages.end_epoch()
    assert not s.pages_judged


def test_an_open_counts_once_its_outcome_is_known():
    """Opens answered before their READs come (a loader with many threads) are not taken
    for page-served: a window counts outcomes (a READ, or a release without one)."""
    s = Stream("j", 0)
    s.pages.end_epoch()
    counts = [s.note_cached_open() for _ in range(64)]  # 64 opens in flight, no outcome yet
    assert not s.pages_served and not s.pages_judged
    for c in counts[:32]:
        s.note_cached_read(c)
    assert not s.pages_served and s.pages_judged


def test_an_open_counted_before_the_epoch_switch_is_not_the_next_epochs():
    """Stats D (sweep): with persistent workers, opens answered just before an epoch
    switch had their READs (or releases) counted in the next epoch, whose page_cache
    showed more READs than cached opens (588 of 585). Their outcomes now count in the
    epoch they were opened in, which has ended: nowhere."""
    s = Stream("j", 0)
    s.pages.end_epoch()
    late = [s.note_cached_open() for _ in range(5)]  # answered, READs not come yet
    s.pages.end_epoch()  # the switch
    opens(s, 3, 3)
    for c in late:
        s.note_cached_read(c)
    assert (s.pages.cached_opens, s.pages.cached_reads) == (3, 3)
    assert s.pages.recent_opens == 3  # their outcomes are not in the new epoch's window
    s.note_unread(late[0])
    assert s.pages.recent_opens == 3


def test_reads_coming_back_end_a_page_served_epoch_at_once():
    """The kernel dropped the pages mid-epoch (a pause, memory pressure): as soon as READs
    come back for more than one open in ten, the epoch is no longer taken as page-served,
    and its plan is woken (pages_lost) instead of waiting for the next epoch."""
    s = Stream("j", 0)
    s.pages.cached_opens = 100
    s.pages.end_epoch()
    assert s.pages_served and not s.pages_lost.is_set()
    opens(s, 32, 3)  # 32 opens, 3 of them READ: still served by the pages
    assert s.pages_served and not s.pages_lost.is_set()
    opens(s, 32, 4)  # then 4 of 32 READ
    assert not s.pages_served and s.pages_lost.is_set()
    s.pages.cached_opens = 100
    s.pages.end_epoch(same_dataset=False)  # another dataset: nothing known of its pages
    assert not s.pages_served and not s.pages_lost.is_set()


def test_an_epoch_over_another_dataset_starts_with_its_pages_unknown():
    """A stream alternating train and val: val's epoch must not take train's page-cache
    decision (the switch compared a name the importance step had already overwritten)."""
    train = SampleList("train", [], [1, 2], [0, 0], ["a", "b"])
    val = SampleList("val", [], [3], [0], ["c"])
    assert same_dataset(train, train)
    assert same_dataset(train, SampleList("train", [], [1, 2], [0, 0], ["a", "b"]))
    assert not same_dataset(train, val) and not same_dataset(None, train)


def test_chunks_ahead_of_two_streams_share_the_memory_tier():
    """Each stream's chunks loaded ahead stay within the tier less what the other wants
    (review: each took the whole tier, and with two ranks on a mount the chunks wanted
    overflowed it); a chunk whose positions come in two runs is wanted and counted once
    until the reader passes both."""
    from dlcachefs.cache.memtier import MemoryTier
    from dlcachefs.clairvoyance.prefetchloop import ChunksAhead as _ChunksAhead
    from dlcachefs.store.schema import Chunk

    def chunk(cid: int) -> Chunk:
        return Chunk(cid, 1, cid * 30, 30, 0, ())

    mem = MemoryTier(100)
    a, b = _ChunksAhead(mem), _ChunksAhead(mem)
    a.add(0, chunk(1))
    a.add(1, chunk(2))
    assert a.fits(chunk(3))  # 90 of 100
    b.add(0, chunk(7))  # a first chunk always fits
    assert not a.fits(chunk(3)) and a.fits(chunk(2))  # 60 + 30 + 30 of b's > 100
    assert not b.fits(chunk(8))  # 30 + 30 + a's 60 > 100
    a.add(2, chunk(1))  # chunk 1 again, after chunk 2: one more run, no more bytes
    assert mem.wanted_bytes == 90 and a.mine == 60
    a.passed(2)  # the first run of 1 and the run of 2 are read; the second of 1 is not
    assert mem.wanted_bytes == 60 and a.mine == 30 and 1 in a.chunks and 2 not in a.chunks
    a.clear()
    b.clear()
    assert mem.wanted_bytes == 0 and not mem._wanted


def test_the_log_laid_out_for_the_epoch_being_read():
    """Records outside the log laid out for the epoch being read are read alone (review):
    from the announcement on, that log is the announced epoch's (still ``next_log`` until
    the switch), not the ending epoch's; a failed log has no records "outside" it."""
    from types import SimpleNamespace as NS

    s = Stream("j", 0)
    assert s.laid_out_log() is None
    s.epoch = s.target_epoch = 3
    s.current_log = NS(log_id=7, failed=False, epoch=3)
    s.next_log = NS(log_id=9, failed=False, epoch=4)
    assert s.laid_out_log() == 7
    s.target_epoch = 4  # announced, its order being computed: epoch 4's log is read
    assert s.laid_out_log() == 9
    s.next_log = NS(log_id=9, failed=True, epoch=4)
    assert s.laid_out_log() is None
    s.target_epoch = 3
    s.current_log = NS(log_id=7, failed=True, epoch=3)
    assert s.laid_out_log() is None
