"""The policy's known future from several streams on one clock (Lobster with DDP ranks):
distances at each stream's own pace, each stream's own release limit."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_t2_reuse_keys import farthest_first

from dlcachefs.cache.policy import NEVER, PolicyContext
from dlcachefs.cache.views import PolicyClock
from dlcachefs.clairvoyance.future import StreamFuture
from dlcachefs.clairvoyance.positions import Positions
from dlcachefs.clairvoyance.stream import Stream, StreamTable
from policies.reuse_distance import ReuseDistancePolicy


def stream(rank: int, order: list[int], nxt: list[int] | None, position: int = 0,
           epoch_tick: int = 0) -> Stream:
    """A stream of job ``j`` reading inodes ``order`` (the next epoch's ``nxt`` when
    known), its first ``position`` read."""
    s = Stream("j", rank)
    s.samples = object()  # (known: the future only asks whether it is)
    s.order = list(order)
    s.positions = Positions(order)
    for ino in order[:position]:
        s.positions.pop(ino)
    s.position = position
    s.epoch_tick = epoch_tick
    if nxt is not None:
        s.next_first, s.next_first_order = Positions(nxt), list(nxt)
    return s


def future(*streams: Stream, tick: int) -> StreamFuture:
    table = StreamTable()
    for s in streams:
        table[(s.job, s.rank)] = s
    return StreamFuture(table, PolicyClock(tick))


class _Cache:
    def capacity(self) -> int:
        return 1 << 30

    def used(self) -> int:
        return 0

    def members(self, unit):
        return ()

    def unit_size(self, unit):
        return 0


def test_distances_count_at_each_streams_pace():
    """Two streams on one clock, one reading three times as fast: a sample 10 positions
    ahead of the slow one (4 ticks a position) comes after one 20 positions ahead of the
    fast one (4/3 ticks a position). Counted 1:1 in positions they came the other way."""
    a = stream(0, list(range(1, 201)), None, position=100, epoch_tick=0)
    b = stream(1, list(range(201, 601)), None, position=300, epoch_tick=0)
    f = future(a, b, tick=400)
    slow, fast = f.next_use(111), f.next_use(521)  # 10 ahead of a, 20 ahead of b
    assert slow == 400 + 4 * 10
    assert fast < slow
    assert fast == pytest.approx(400 + 20 * 400 / 300)  # (in the frame: start + pace * p)


def test_a_stream_too_early_to_measure_takes_an_equal_share():
    """Two ranks that just began: each position is taken as two ticks."""
    a = stream(0, list(range(1, 101)), None, position=3, epoch_tick=50)
    b = stream(1, list(range(101, 201)), None, position=3, epoch_tick=50)
    f = future(a, b, tick=56)
    assert f.next_use(10) == 56 + 2 * 6
    assert f.next_use(150) == 56 + 2 * 46
    assert f.next_use(999) == NEVER


def test_release_limit_is_each_streams_own_next_epoch():
    """Rank 1 reads sample 5 (rank 0 read it this epoch) late in its next epoch: before
    the end of ITS next epoch, so it is kept, although rank 0's next epoch (taken for
    every rank before, in ticks 1:1 with its positions) ended earlier. A sample no rank
    reads again goes."""
    a = stream(0, list(range(1, 101)), list(range(101, 201)), position=50)
    late = [*range(6, 100)][:94] + [5] + [*range(300, 305)]
    b = stream(1, list(range(101, 201)), late, position=50)
    f = future(a, b, tick=100)
    pol = ReuseDistancePolicy(PolicyContext(_Cache(), f))
    pol.on_insert(7, (5,), 1000)
    assert f.used_by_next_epoch_end(5) is True
    assert not pol.release_after_use(7, 5)
    pol.on_insert(8, (999,), 1000)
    assert f.used_by_next_epoch_end(999) is False
    assert pol.release_after_use(8, 999)


def test_no_release_while_a_stream_does_not_know_its_next_epoch():
    a = stream(0, list(range(1, 11)), list(range(1, 11)), position=5)
    b = stream(1, list(range(11, 21)), None, position=5)
    f = future(a, b, tick=10)
    assert f.used_by_next_epoch_end(999) is None
    assert f.next_epoch_end() is None
    pol = ReuseDistancePolicy(PolicyContext(_Cache(), f))
    pol.on_insert(1, (999,), 10)
    assert not pol.release_after_use(1, 999)


@settings(max_examples=40, deadline=None)
@given(ranks=st.integers(1, 4), n=st.integers(40, 400), seed=st.integers(0, 10_000),
       at=st.floats(0.0, 0.999))
def test_next_use_is_the_merged_orders_tick(ranks, n, seed, at):
    """N ranks in lockstep (one open each, round robin) over disjoint shards: at any
    point of the epoch, every sample's next use is its tick in the merged order of this
    epoch and the next, within one round plus the pace's measuring error."""
    rnd = random.Random(seed)
    inos = list(range(1, n * ranks + 1))

    def shards() -> list[list[int]]:
        rnd.shuffle(inos)
        return [inos[r::ranks] for r in range(ranks)]

    cur, nxt = shards(), shards()
    merged = [o[k] for k in range(n) for o in cur] + [o[k] for k in range(n) for o in nxt]
    done = int(at * n) * ranks  # opens so far: every rank at position done / ranks
    streams = [stream(r, cur[r], nxt[r], position=done // ranks) for r in range(ranks)]
    f = future(*streams, tick=done)
    true: dict[int, int] = {}
    for t in range(len(merged) - 1, done - 1, -1):
        true[merged[t]] = t
    for ino, t in true.items():
        got = f.next_use(ino)
        assert abs(got - t) <= ranks + (t - done) / 16, (ino, got, t)


def test_later_known_epochs_give_far_finite_uses_and_release_still_at_the_next():
    """A sample read by neither this epoch nor the next but by the one after (an
    importance sampler's) has a next use past the next epoch, not NEVER, and is still
    released after use by Lobster's rule (it is not read during the next epoch)."""
    s = stream(0, [1, 2, 3, 4], [5, 6], position=2)
    s.later_first = ((Positions([7, 1]), 2), (Positions([8]), 1))
    f = future(s, tick=2)
    assert f.next_use(7) == 2 + 1 * (2 + 2 + 0)  # pace: an equal share of one stream
    assert f.next_use(8) == 2 + (2 + 2 + 2 + 0)
    assert f.next_use(9) == NEVER
    assert f.horizon() == 2 + 2 + 2 + 2 + 1
    pol = ReuseDistancePolicy(PolicyContext(_Cache(), f))
    pol.on_insert(1, (7,), 10)
    assert pol.release_after_use(1, 7)


def test_a_stream_idle_for_long_is_not_the_future():
    """A training that ended leaves its stream in the table: its next epoch kept every
    one of its samples from Lobster's release for any later job (a review finding). A
    stream that opened nothing for IDLE_S is no longer asked; one that is reading is."""
    import time

    from dlcachefs.clairvoyance.stream import IDLE_S

    gone = stream(0, [1, 2, 3, 4], [1, 2, 3, 4], position=4)
    live = stream(1, [5, 6, 7, 8], [5, 6, 7, 8], position=1)
    now = time.monotonic()
    gone.last_open, live.last_open = now - IDLE_S - 1, now
    f = future(gone, live, tick=10)
    assert f.next_use(2) == NEVER  # only the gone stream would read it
    assert f.next_use(6) != NEVER
    gone.last_open = now  # reading again: it is the future again
    f = future(gone, live, tick=11)
    assert f.next_use(2) != NEVER


def test_next_uses_hold_still_while_the_streams_read_at_their_pace():
    """Two ranks in step: the clock ticks and both read, and a sample's next use stays
    the same tick (the policy's heap stays valid); the future's generation stays too."""
    a = stream(0, list(range(1, 201)), None, position=40, epoch_tick=0)
    b = stream(1, list(range(201, 401)), None, position=40, epoch_tick=0)
    f = future(a, b, tick=80)
    g, use = f.generation(), f.next_use(150)
    assert use == pytest.approx(80 + 2 * 109)
    for _ in range(30):
        for s in (a, b):
            s.positions.pop(s.order[s.position])
            s.position += 1
            f.clock.tick += 1
        assert f.next_use(150) == use and f.generation() == g


def test_a_stalled_stream_moves_its_next_uses_later_and_says_so():
    """One rank stops reading while the other goes on: within the frames' drift limit
    its next uses hold; past it the frames are made again (a new generation) and its
    samples' next uses recede by the ticks it lost."""
    from dlcachefs.clairvoyance.future import REFIT_DRIFT, REFIT_MIN_TICKS

    n = 3000
    a = stream(0, list(range(1, n + 1)), None, position=40, epoch_tick=0)
    b = stream(1, list(range(n + 1, 2 * n + 1)), None, position=40, epoch_tick=0)
    f = future(a, b, tick=80)
    g, use = f.generation(), f.next_use(150)
    limit = max(REFIT_DRIFT * 2 * n, REFIT_MIN_TICKS)  # ticks: a's pace is 2
    while f.clock.tick - 80 <= limit:
        b.positions.pop(b.order[b.position])
        b.position += 1
        f.clock.tick += 1
        if f.clock.tick - 80 <= limit:
            assert f.next_use(150) == use and f.generation() == g
    assert f.generation() != g
    assert f.next_use(150) > use + limit - 1


def test_a_stream_with_nothing_ahead_makes_no_frame_again():
    """A rank that read its epoch and does not know its next waits while the other
    reads: it has no next use to move, so it never costs the policy a re-key."""
    from dlcachefs.clairvoyance.future import REFIT_MIN_TICKS

    n = 3000
    a = stream(0, [1, 2, 3], None, position=3)
    b = stream(1, list(range(10, n + 10)), None, position=0)
    f = future(a, b, tick=3)
    g = f.generation()
    for _ in range(REFIT_MIN_TICKS + 100):
        b.positions.pop(b.order[b.position])
        b.position += 1
        f.clock.tick += 1
    assert f.generation() == g


def test_an_order_replaced_or_a_stream_gone_is_a_new_generation():
    a = stream(0, [1, 2, 3, 4], [1, 2, 3, 4], position=1)
    b = stream(1, [5, 6, 7, 8], [5, 6, 7, 8], position=1)
    f = future(a, b, tick=2)
    g = f.generation()
    assert f.generation() == g
    a.order, a.positions = [4, 3, 2, 1], Positions([4, 3, 2, 1])  # announced again
    assert f.generation() != g
    g = f.generation()
    a.next_first = Positions([2, 1])  # its next epoch alone told again
    assert f.generation() != g
    g = f.generation()
    a.later_first = ((Positions([3]), 1),)  # a later epoch became known
    assert f.generation() != g
    g = f.generation()
    del f.streams[("j", 1)]  # (the table lists the streams that know their order)
    f.clock.tick += 1
    assert f.generation() != g
    g = f.generation()
    c = stream(2, [9, 10], [9, 10], position=0)  # one gone and one come in one step
    del f.streams[("j", 0)]
    f.streams[("j", 2)] = c
    f.clock.tick += 1
    assert f.generation() != g
    assert f.next_use(10) != NEVER and f.next_use(2) == NEVER


@settings(max_examples=150, deadline=None)
@given(ranks=st.integers(1, 3), n=st.integers(8, 40), seed=st.integers(0, 10_000),
       steps=st.integers(20, 400))
def test_victims_are_the_farthest_in_the_streams_frames(ranks, n, seed, steps):
    """Ranks reading at uneven, changing speeds (stalls included) over shared samples,
    each knowing its next epoch; units of 1-3 samples. At every decision the policy's
    victims are the farthest next uses as the future gives them then (brute force):
    frames made again in between re-key the heap, reads re-key their unit."""
    rnd = random.Random(seed)
    inos = list(range(1, n + 1))
    streams = []
    for r in range(ranks):
        cur, nxt = rnd.sample(inos, n), rnd.sample(inos, n)
        streams.append(stream(r, cur, nxt))
    f = future(*streams, tick=0)
    pol = ReuseDistancePolicy(PolicyContext(_Cache(), f))
    unit_of: dict[int, int] = {}
    rnd.shuffle(inos)
    k = u = 0
    while k < n:
        members = inos[k:k + rnd.randint(1, 3)]
        pol.on_insert(u, members, rnd.randint(1, 3))
        unit_of.update((m, u) for m in members)
        k, u = k + len(members), u + 1
    speed = [rnd.choice([1, 1, 2, 4]) for _ in streams]
    for _ in range(steps):
        if rnd.random() < 0.05:
            speed[rnd.randrange(ranks)] = rnd.choice([0, 1, 3])  # a stall, a new pace
        live = [s for s, v in zip(streams, speed, strict=True)
                for _ in range(v) if s.position < len(s.order)]
        if live and rnd.random() < 0.85:
            s = rnd.choice(live)
            ino = s.order[s.position]
            s.positions.pop(ino)
            s.position += 1
            f.clock.tick += 1
            if unit_of.get(ino) in pol._units:
                pol.on_access(unit_of[ino], ino)
            continue
        need = rnd.randint(1, 4)
        exclude = {x for x in pol._units if rnd.random() < 0.2}
        want = farthest_first(pol, f, need, exclude)
        got = pol.victims(need, exclude)
        assert got == want
        for x in got[:1]:  # (the writer removes what it evicts: one, to keep some)
            pol.on_remove(x)
