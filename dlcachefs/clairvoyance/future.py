"""The known future a caching policy sees (its :class:`~dlcachefs.cache.policy.FutureView`),
from the streams' announced orders.

The clock (:class:`~dlcachefs.cache.views.PolicyClock`) ticks once per open, on the
engine's open path; a sample's next use is ``now`` plus how far ahead of its stream's
position it comes in this epoch, or in the next epoch when that order is known. The
nearest use over every stream that knows its order wins.

Concurrency: trio loop, like the policy.
"""

from __future__ import annotations

from dlcachefs.cache.views import NEVER, PolicyClock
from dlcachefs.clairvoyance.stream import Stream, StreamTable


class StreamFuture:
    """Next uses from every stream that knows its order (the nearest wins)."""

    def __init__(self, streams: StreamTable, clock: PolicyClock) -> None:
        self.streams = streams
        self.clock = clock
        self._active_at: tuple[int, list[Stream]] = (-1, [])

    def _active(self) -> list[Stream]:
        # asked once per member of a unit per decision: listed once per tick
        tick = self.clock.tick
        if self._active_at[0] != tick:
            self._active_at = (tick, [s for s in self.streams.values()
                                      if s.order and s.samples is not None])
        return self._active_at[1]

    def now(self) -> int:
        return self.clock.tick

    def next_use(self, sample: int) -> float:
        best = NEVER
        tick = self.clock.tick
        for s in self._active():
            p = s.positions.next(sample)
            if p is not None:
                best = min(best, tick + max(0, p - s.position))
            elif s.next_first is not None:
                q = s.next_first.next(sample)
                if q is not None:
                    best = min(best, tick + len(s.order) - s.position + q)
        return best

    def horizon(self) -> int:
        tick = self.clock.tick
        ends = [tick + len(s.order) - s.position
                + (len(s.next_first_order) if s.next_first is not None else 0)
                for s in self._active()]
        return max(ends, default=tick)

    def epoch_length(self) -> int | None:
        act = self._active()
        return len(act[0].order) if act else None

    def epoch_start(self) -> int:
        act = self._active()
        return act[0].epoch_tick if act else 0

    def next_epoch_end(self) -> int | None:
        """Last tick of the next epoch of the first stream, when its order is known."""
        act = self._active()
        if not act or act[0].next_first is None:
            return None
        s = act[0]
        return s.epoch_tick + len(s.order) + len(s.next_first_order) - 1
