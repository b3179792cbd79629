"""The known future a caching policy sees (its :class:`~dlcachefs.cache.policy.FutureView`),
from the streams' announced orders.

The clock (:class:`~dlcachefs.cache.views.PolicyClock`) ticks once per open, on the
engine's open path, whoever opens: several streams (the DDP ranks of a node) share it.
Each stream counts in its own positions, so a distance in a stream's order becomes ticks
at that stream's own pace: the ticks per position it took since its epoch began (with N
ranks in step, about N; a stream that stalls sees its uses recede). Before a stream has
read enough of its epoch to measure (:data:`RATE_MIN_POSITIONS`), its last epoch's pace
serves, else an equal share of the ticks among the streams still reading. A sample's next
use is ``now`` plus the nearest of those distances over every stream that knows its
order, in this epoch, in the next when that order is known, and in the known epochs after
it that the stream's plan holds (the policy's horizon: while the epochs after this one
read fewer bytes than the cache holds; see
:func:`~dlcachefs.clairvoyance.epochplan.plan_epoch`).

Lobster's release limit ("not read during the next epoch") is each stream's own: a
sample goes only when no stream reads it before the end of that stream's next epoch,
counted in that stream's positions (:meth:`StreamFuture.used_by_next_epoch_end`), so
one rank's pace never stands for another's.

Concurrency: trio loop, like the policy.
"""

from __future__ import annotations

import time

from dlcachefs.cache.views import NEVER, PolicyClock
from dlcachefs.clairvoyance.stream import IDLE_S, Stream, StreamTable

#: positions a stream reads in an epoch before its pace is measured from that epoch
RATE_MIN_POSITIONS = 32


class StreamFuture:
    """Next uses from every stream that knows its order (the nearest wins), each
    stream's distance in ticks at its own pace (module docstring)."""

    def __init__(self, streams: StreamTable, clock: PolicyClock) -> None:
        self.streams = streams
        self.clock = clock
        self._active_at: tuple[int, list[tuple[Stream, float]]] = (-1, [])
        #: the last pace measured of each stream (key -> ticks per position)
        self._paces: dict[str, float] = {}

    def _active(self) -> list[tuple[Stream, float]]:
        """The streams that know their order, each with its pace (ticks per position).
        Asked once per member of a unit per decision: listed once per tick."""
        tick = self.clock.tick
        if self._active_at[0] != tick:
            # a stream that opened nothing for IDLE_S (a training that ended) is not the
            # future: its next epoch would keep its samples from every release, forever
            # (0.0: no open or switch seen yet, as in a stream built by hand)
            now = time.monotonic()
            act = [s for s in self.streams.values() if s.order and s.samples is not None
                   and (s.last_open == 0.0 or now - s.last_open < IDLE_S)]
            reading = sum(1 for s in act if s.position < len(s.order))
            self._active_at = (tick, [(s, self._pace(s, tick, reading)) for s in act])
        return self._active_at[1]

    def _pace(self, s: Stream, tick: int, reading: int) -> float:
        """Ticks per position of ``s``: measured over its epoch so far, else its last
        epoch's, else an equal share among the ``reading`` streams. At least 1 (a
        position is one open, and one open is one tick)."""
        if s.position >= RATE_MIN_POSITIONS:
            pace = max(1.0, (tick - s.epoch_tick) / s.position)
            if s.position < len(s.order):  # (a finished stream's pace only grows)
                self._paces[s.key] = pace
            return pace
        return self._paces.get(s.key, float(max(1, reading)))

    def now(self) -> int:
        return self.clock.tick

    def next_use(self, sample: int) -> float:
        best = NEVER
        tick = self.clock.tick
        for s, pace in self._active():
            d = _distance(s, sample)
            if d is not None:
                best = min(best, tick + pace * d)
        return best

    def horizon(self) -> int:
        tick = self.clock.tick
        ends = [tick + int(pace * _known_ahead(s)) for s, pace in self._active()]
        return max(ends, default=tick)

    def epoch_length(self) -> int | None:
        """Ticks an epoch of the node takes (Lobster's I over every stream): the longest
        of the streams' epochs at their paces."""
        act = self._active()
        return max(int(pace * len(s.order)) for s, pace in act) if act else None

    def epoch_start(self) -> int:
        """When the epoch every stream reads now began: the latest stream's switch is
        the one that completes it, so the earliest of the current starts moves once per
        epoch of the node, when the last stream switched."""
        act = self._active()
        return min(s.epoch_tick for s, _ in act) if act else 0

    def next_epoch_end(self) -> int | None:
        """The last tick of the next epoch of every stream (the latest of them, each at
        its pace) when every stream knows its next epoch, else None."""
        act = self._active()
        if not act or any(s.next_first is None for s, _ in act):
            return None
        tick = self.clock.tick
        return max(tick + int(pace * (len(s.order) - s.position + len(s.next_first_order)))
                   - 1 for s, pace in act)

    def used_by_next_epoch_end(self, sample: int) -> bool | None:
        """Does a stream read ``sample`` before the end of its own next epoch? None when
        some stream's next epoch is not known (its reads after this epoch are not)."""
        act = self._active()
        if not act:
            return None
        if any(s.positions.next(sample) is not None
               or (s.next_first is not None and s.next_first.next(sample) is not None)
               for s, _ in act):
            return True
        return None if any(s.next_first is None for s, _ in act) else False


def _distance(s: Stream, sample: int) -> int | None:
    """Positions of ``s`` until it reads ``sample`` next: in this epoch, the next, or a
    later known one (:attr:`Stream.later_first`); None when none of them reads it."""
    p = s.positions.next(sample)
    if p is not None:
        return max(0, p - s.position)
    if s.next_first is None:
        return None
    ahead = len(s.order) - s.position
    q = s.next_first.next(sample)
    if q is not None:
        return ahead + q
    ahead += len(s.next_first_order)
    for first, length in s.later_first:
        q = first.next(sample)
        if q is not None:
            return ahead + q
        ahead += length
    return None


def _known_ahead(s: Stream) -> int:
    """Positions of ``s`` its known orders reach ahead of its reader."""
    if s.next_first is None:
        return len(s.order) - s.position
    return (len(s.order) - s.position + len(s.next_first_order)
            + sum(length for _, length in s.later_first))
