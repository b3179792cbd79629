"""The read-only views a mount gives its caching policy (see :mod:`dlcachefs.cache.policy`).

* :class:`IndexCacheView`: units are chunks; sizes and members from the index;
* :class:`PolicyClock`: the policy's clock, one tick per open; the known future it
  counts in is :class:`~dlcachefs.clairvoyance.future.StreamFuture`, from the streams'
  announced orders;
* :class:`InodeImportance`: the dataset's :class:`~dlcachefs.importance.scores.Importance`
  (losses by dataset index) seen by inode.

All of it runs on the trio loop, like the policy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dlcachefs.importance.scores import Importance
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


class InodeImportance:
    """Importance by inode, for the dataset whose jobs report losses."""

    def __init__(self) -> None:
        self.table: Importance | None = None
        self.index_of: dict[int, int] = {}
        self.dataset: str | None = None
        self.current_epoch = 0

    def bind(self, dataset: str, inos: Sequence[int], h_fraction: float) -> None:
        if self.dataset == dataset and self.table is not None and self.table.n == len(inos):
            return
        if self.table is not None:  # one dataset's importance at a time (see README)
            # (the losses this drops are counted and warned of by the caller that knows
            # them: importance.losses)
            log.info("importance: now for dataset %r, no longer %r", dataset, self.dataset)
        self.dataset = dataset
        self.table = Importance(len(inos), h_fraction)
        self.index_of = {ino: i for i, ino in enumerate(inos) if ino}

    def importance(self, sample: int) -> float | None:
        i = self.index_of.get(sample)
        return None if i is None or self.table is None else self.table.value(i)

    def is_high(self, sample: int) -> bool:
        i = self.index_of.get(sample)
        # a file outside the dataset is never a substitution candidate: count it as H
        return True if i is None or self.table is None else self.table.is_high(i)

    def version(self) -> int:
        return 0 if self.table is None else self.table.version()

    def epoch(self) -> int:
        return self.current_epoch
