"""The read-only views a mount gives its caching policy (see :mod:`dlcachefs.cache.policy`).

* :class:`IndexCacheView`: units are chunks; sizes and members from the index;
* :class:`PolicyClock`: the policy's clock, one tick per open; the known future it
  counts in is :class:`~dlcachefs.clairvoyance.future.StreamFuture`, from the streams'
  announced orders;
* the samples' importance (losses): :class:`dlcachefs.importance.view.InodeImportance`.

All of it runs on the trio loop, like the policy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

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


@dataclass(slots=True)
class PolicyClock:
    """The policy's logical clock: one tick per sample served (the engine's open ticks
    it). Shared by the engine and the known future
    (:class:`~dlcachefs.clairvoyance.future.StreamFuture`), which reads it."""

    tick: int = 0
