"""The read-only views a mount gives its caching policy (see :mod:`dlcachefs.cache.policy`).

* :class:`IndexCacheView`: units are chunks; sizes and members from the index;
* :class:`StreamFuture`: the known future from the streams' announced orders. The clock
  ticks once per open; a sample's next use is ``now`` plus how far ahead of its stream's
  position it comes in this epoch, or in the next epoch when that order is known;
* the samples' importance (losses): :class:`dlcachefs.importance.view.InodeImportance`.

All of it runs on the trio loop, like the policy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from dlcachefs.store import schema as S
from dlcachefs.store.index import Index

NEVER = float("inf")
log = logging.getLogger(__name__)


class IndexCacheView:
    def __init__(self, index: Index, capacity: int | Callable[[], int]) -> None:
        """``capacity``: the cache's limit, or a function returning it (a shared root's
        share changes at run time)."""
        self.index = index
        self.cap = capacity

    def capacity(self) -> int:
        return self.cap() if callable(self.cap) else self.cap

    def used(self) -> int:
        return self.index.counter(S.K_CHUNK_BYTES)

    def members(self, unit: int) -> Sequence[int]:
        c = self.index.get_chunk(unit)
        return c.members if c is not None else ()

    def unit_size(self, unit: int) -> int:
        c = self.index.get_chunk(unit)
        return c.length if c is not None else 0


class PolicyClock:
    """The policy's logical clock: one tick per open of a cached-size file (the engine
    ticks it), read by the future view and the streams (an epoch's first tick)."""

    __slots__ = ("tick",)

    def __init__(self) -> None:
        self.tick = 0


class StreamFuture:
    """Next uses from every stream that knows its order (the nearest wins)."""

    def __init__(self, streams, clock: PolicyClock) -> None:
        self.streams = streams  # StreamManager
        self.clock = clock
        self._active_at: tuple[int, list] = (-1, [])

    @property
    def tick(self) -> int:
        return self.clock.tick

    def _active(self):
        # asked once per member of a unit per decision: listed once per tick
        if self._active_at[0] != self.tick:
            self._active_at = (self.tick, [s for s in self.streams.streams.values()
                                           if s.order and s.samples is not None])
        return self._active_at[1]

    def now(self) -> int:
        return self.tick

    def next_use(self, sample: int) -> float:
        best = NEVER
        for s in self._active():
            p = s.positions.next(sample)
            if p is not None:
                best = min(best, self.tick + max(0, p - s.position))
            elif s.next_first is not None:
                q = s.next_first.next(sample)
                if q is not None:
                    best = min(best, self.tick + len(s.order) - s.position + q)
        return best

    def horizon(self) -> int:
        ends = [self.tick + len(s.order) - s.position
                + (len(s.next_first_order) if s.next_first is not None else 0)
                for s in self._active()]
        return max(ends, default=self.tick)

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
