"""The reuse-distance policy's keys computed once per unit per decision: the same victims
as the heap that computed them again on every pop (kept here as the reference), with
fewer next-use look-ups. The keys move on every tick (each stream's pace), so a decision
re-keys the stale entries it pops; within one decision the future does not move."""

from __future__ import annotations

import heapq
from collections.abc import Collection

from dlcachefs.policies import NEVER, PolicyContext
from dlcachefs.policies.reuse_distance import ReuseDistancePolicy
from hypothesis import given, settings
from hypothesis import strategies as st


class Cache:
    def capacity(self) -> int:
        return 1 << 40

    def used(self) -> int:
        return 0


class Future:
    """Two streams, each at its own pace: a sample's next use is the nearer of
    ``start + pace * position`` over the streams that read it (as StreamFuture's)."""

    def __init__(self) -> None:
        self.pos: list[dict[int, int]] = [{}, {}]
        self.pace = [1.0, 1.0]
        self.start = [0, 0]
        self.calls = 0

    def now(self) -> int:
        return 0

    def horizon(self) -> int:
        return 0

    def epoch_length(self) -> None:
        return None

    def next_use(self, sample: int) -> float:
        self.calls += 1
        best = NEVER
        for k in (0, 1):
            p = self.pos[k].get(sample)
            if p is not None:
                best = min(best, self.start[k] + self.pace[k] * p)
        return best


class Reference(ReuseDistancePolicy):
    """The decisions as they were: every key computed again when its entry is popped,
    and the chosen units' keys again when pushed back."""

    def _top(self, exclude: Collection[int], held: list, keys=None):
        while self._heap:
            neg, stamp, unit = heapq.heappop(self._heap)
            if self._seq.get(unit) != stamp:
                continue
            key = self._key(unit)
            if key != -neg:
                heapq.heappush(self._heap, (-key, stamp, unit))
                continue
            if unit in exclude:
                held.append((neg, stamp, unit))
                continue
            return key, unit
        return None

    def farthest(self) -> float | None:
        held: list = []
        top = self._top((), held)
        if top is None:
            return None
        key, unit = top
        heapq.heappush(self._heap, (-key, self._seq[unit], unit))
        return key

    def victims(self, need: int, exclude: Collection[int]) -> list[int]:
        out: list[int] = []
        held: list = []
        freed = 0
        while freed < need:
            top = self._top(exclude, held)
            if top is None:
                break
            _, unit = top
            out.append(unit)
            freed += self._units[unit][0]
        for e in held + [(-self._key(u), self._seq[u], u) for u in out]:
            heapq.heappush(self._heap, e)
        return out


SAMPLES = 12
UNITS = 10  # (unit ids count up from 0: small ids name live units)

insert = st.tuples(st.just("insert"), st.lists(st.integers(0, SAMPLES - 1), min_size=1,
                                               max_size=3), st.integers(1, 4))
decide = st.tuples(st.just("victims"), st.integers(1, 6), st.sets(st.integers(0, UNITS),
                                                                  max_size=3))
op = st.one_of(
    insert, insert, decide, decide,
    st.tuples(st.just("access"), st.integers(0, UNITS)),
    st.tuples(st.just("remove"), st.integers(0, UNITS)),
    st.tuples(st.just("pace"), st.integers(0, 1), st.floats(1.0, 4.0)),
    st.tuples(st.just("tick"), st.integers(0, 1), st.integers(0, 30)),
    st.tuples(st.just("move"), st.integers(0, 1), st.integers(0, SAMPLES - 1),
              st.none() | st.integers(0, 3 * SAMPLES)),
    st.tuples(st.just("move"), st.integers(0, 1), st.integers(0, SAMPLES - 1),
              st.integers(0, 3 * SAMPLES)),
    st.tuples(st.just("farthest")),
)


def replay(ops: list, first: dict[int, int] | None = None) -> tuple[list, int, int]:
    """Each policy's answers, and the next-use look-ups of each (new, reference).
    ``first``: the first stream's positions to begin with."""
    futs = [Future(), Future()]
    for f in futs:
        f.pos[0] = dict(first or {})
    pols = [ReuseDistancePolicy(PolicyContext(Cache(), futs[0])),
            Reference(PolicyContext(Cache(), futs[1]))]
    answers: list = []
    units: list[int] = []
    for o in ops:
        kind = o[0]
        if kind in ("pace", "tick", "move", "order"):  # the future moves between decisions
            for f in futs:
                if kind == "pace":
                    f.pace[o[1]] = o[2]
                elif kind == "tick":
                    f.start[o[1]] += o[2]
                elif kind == "order":
                    f.pos[o[1]] = dict(o[2])
                elif o[3] is None:
                    f.pos[o[1]].pop(o[2], None)
                else:
                    f.pos[o[1]][o[2]] = o[3]
            continue
        got = []
        for p in pols:
            if kind == "insert":
                p.on_insert(len(units), o[1], o[2])
            elif kind == "access" and units:
                p.on_access(units[o[1] % len(units)], 0)
            elif kind == "remove" and units:
                p.on_remove(units[o[1] % len(units)])
            elif kind == "victims":
                chosen = p.victims(o[1], {u for u in o[2] if u in p._units})
                for u in chosen:  # (as the writer does for the units it evicts)
                    p.on_remove(u)
                got.append(chosen)
            elif kind == "farthest":
                got.append(p.farthest())
        if kind == "insert":
            units.append(len(units))
        if got:
            answers.append(got)
    assert sorted(pols[0]._units) == sorted(pols[1]._units)
    assert sorted(pols[0]._heap) == sorted(pols[1]._heap)  # (the same keys, stale or not)
    return answers, futs[0].calls, futs[1].calls


@settings(max_examples=1000, deadline=None)
@given(st.permutations(range(SAMPLES)), st.lists(op, min_size=10, max_size=80))
def test_the_same_victims_as_keys_computed_on_every_pop(order, ops):
    answers, new, old = replay(ops, dict(enumerate(order)))
    for mine, ref in answers:
        assert mine == ref
    assert new <= old


def test_a_decision_computes_each_key_once():
    """Every unit re-keyed (a pace changed since they were pushed) and chosen: its key
    computed once, not at the re-key, again at the check and again when pushed back."""
    ops = [("order", 0, {s: 10 * s for s in range(SAMPLES)}), ("pace", 0, 1.0)]
    ops += [("insert", [s], 1) for s in range(6)]
    ops += [("pace", 0, 2.0), ("victims", 6, set())]
    answers, new, old = replay(ops)
    assert answers == [[[5, 4, 3, 2, 1, 0]] * 2]
    assert new < old
