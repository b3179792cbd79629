"""Tier 1: the memcached expiry of a peer-tier value (dlcachefs.peers.expiry), computed
the way the engine does (Positions of the current order with the consumed ones popped,
the next epoch's first positions, the pace) against a reference that reads the orders
directly: the last planned use, plus two epochs of pace (at least 300 s), rounded up; 0
when nothing is known or it is past memcached's 30-day relative limit."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from dlcachefs.clairvoyance.positions import Positions
from dlcachefs.peers.expiry import (
    MAX_RELATIVE_S,
    MIN_MARGIN_S,
    PlannedUse,
    expiry_s,
    planned_use,
)


def reference(streams, ino: int) -> int:
    """Seconds from now to ``ino``'s last planned use over ``streams`` (order, position,
    next order or None, pace), plus the margin; from the orders themselves."""
    best = None
    for order, position, nxt, pace in streams:
        if pace is None or pace <= 0:
            continue
        n = len(order)
        if nxt is not None and ino in nxt:
            ahead = n - position + nxt.index(ino)
        elif ino in order[position:]:
            ahead = order[position:].index(ino)
        else:
            continue
        t = ahead * pace + max(MIN_MARGIN_S, 2.0 * n * pace)
        best = t if best is None else max(best, t)
    if best is None:
        return 0
    secs = math.ceil(best)
    return secs if secs <= MAX_RELATIVE_S else 0


@st.composite
def stream(draw):
    n = draw(st.integers(1, 40))
    order = draw(st.permutations(list(range(1, n + 1))))
    position = draw(st.integers(0, n))
    nxt = draw(st.none() | st.permutations(list(range(1, n + 1))))
    pace = draw(st.none() | st.just(0.0) | st.floats(1e-4, 1e5, allow_nan=False))
    return order, position, nxt, pace


@settings(max_examples=300, deadline=None)
@given(st.lists(stream(), min_size=0, max_size=3), st.integers(1, 45))
def test_the_expiry_is_the_last_planned_use_plus_the_margin(streams, ino):
    uses = []
    for order, position, nxt, pace in streams:
        pos = Positions(order)
        for p in order[:position]:  # the reader consumed these
            pos.pop(p)
        nf = Positions(nxt).next(ino) if nxt is not None else None
        u = planned_use(position, pos.next(ino), len(order), nf, pace)
        if u is not None:
            uses.append(u)
    got = expiry_s(uses)
    assert got == reference(streams, ino)
    assert got == 0 or MIN_MARGIN_S <= got <= MAX_RELATIVE_S


@given(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 10**9),
       st.integers(-5, 10**9))
def test_any_input_gives_a_valid_memcached_expiry(pace, ahead, n):
    got = expiry_s([PlannedUse(ahead, pace, n)])
    assert isinstance(got, int) and (got == 0 or 0 < got <= MAX_RELATIVE_S)


def test_nothing_known_is_never():
    assert expiry_s([]) == 0
    assert planned_use(3, 5, 10, None, None) is None  # no pace
    assert planned_use(3, None, 10, None, 0.1) is None  # not in a known order


def test_the_pace_is_the_current_epochs_else_the_last_ones():
    from dlcachefs.clairvoyance.pace import Pace  # noqa: PLC0415
    p = Pace()
    assert p.seconds_per_sample() is None
    p.note(10, 100.0, 100.1, epoch=0)
    assert p.seconds_per_sample() is None  # one open: no span yet
    for k in range(1, 5):
        p.note(10 + k % 2, 100.0 + 0.5 * k, 100.0 + 0.5 * k + 0.1, epoch=0)
    assert p.seconds_per_sample() == 0.5  # 4 gaps over 2 s, workers mixed
    p.note(10, 200.0, 200.1, epoch=1)  # epoch 1 has one open: epoch 0's pace stands
    assert p.seconds_per_sample() == 0.5
    p.note(10, 200.25, 200.3, epoch=1)
    assert p.seconds_per_sample() == 0.25


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 60), world=st.integers(2, 5), step=st.integers(0, 30),
       nxt_known=st.booleans(), pace=st.floats(1e-3, 10.0), ino=st.integers(1, 61))
def test_a_distributed_samplers_expiry_is_the_clusters_last_use(n, world, step, nxt_known,
                                                                pace, ino):
    """With every rank's order (a DistributedSampler: ranks step together), the expiry is
    the step at which ANY rank reads the sample last, in this epoch or the next, plus two
    epochs (at least 300 s): never before another rank's read, nor before its read in
    the epoch after the next (within two epochs of the next one's)."""
    from dlcachefs.clairvoyance.positions import ClusterUse  # noqa: PLC0415
    from dlcachefs.clairvoyance.replay import SamplerSpec, distributed_epoch  # noqa: PLC0415

    spec = SamplerSpec(kind="distributed", world=world, rank=0, shuffle=False)
    inos = list(range(1, n + 1))  # sample i is inode i + 1
    g_cur = [inos[i] for i in distributed_epoch(spec, n, 0, whole=True)]
    g_nxt = [inos[i] for i in distributed_epoch(spec, n, 1, whole=True)]
    per_rank = len(g_cur) // world
    position = min(step, per_rank)
    cu = ClusterUse(world, Positions(g_cur[::-1]), len(g_cur),
                    Positions(g_nxt[::-1]) if nxt_known else None, len(g_nxt))
    cur, nxt = cu.steps(ino)
    if cur is not None and cur < position:
        cur = None
    u = planned_use(position, cur, per_rank, nxt, pace)
    # the reference: the last step at which any rank reads ino, from the orders
    later = [g // world - position for g, x in enumerate(g_cur) if x == ino
             and g // world >= position]
    if nxt_known:
        later += [per_rank - position + g // world for g, x in enumerate(g_nxt) if x == ino]
    if not later:
        assert u is None
        return
    t = max(later) * pace
    want = math.ceil(t + max(MIN_MARGIN_S, 2.0 * per_rank * pace))
    assert expiry_s([u]) == want
    # every rank's read of it in the known epochs comes before the expiry (the padding's
    # repeats at the end of an epoch included, within the margin)
    assert all(k * pace <= expiry_s([u]) for k in later)
