"""LCache's release after use, for the log layout (LCache section III-B, Algorithm 1 line 16).

When the dataset is larger than the cache, LCache keeps the next epoch's log and releases
the current log chunk by chunk once its samples have been read: a chunk all of whose
samples were served this epoch is not read again before the next epoch, whose log holds
its own copy. This policy does that for any unit: LRU order, plus release of a unit as
soon as every member has been served in the current epoch, while the cache is under
pressure (fuller than ``pressure`` of its capacity; with room to spare nothing is given
up). The reordered log itself is written by :mod:`dlcachefs.clairvoyance.reorder`.
"""

from __future__ import annotations

from collections.abc import Sequence

from dlcachefs.policies.lru import LRUPolicy

from dlcachefs.cache.policy import SupportsReleaseAfterUse


class LCachePolicy(LRUPolicy, SupportsReleaseAfterUse):
    """LRU + release of fully consumed units under pressure."""

    name = "lcache"
    options = {"pressure": float}

    def __init__(self, ctx=None, pressure: float = 0.9, **opts: object) -> None:
        super().__init__(ctx, **opts)
        if not 0.0 <= pressure <= 1.0:
            raise ValueError("lcache: pressure must be within 0..1")
        self.pressure = pressure
        self._members: dict[int, tuple[int, ...]] = {}
        self._left: dict[int, set[int]] = {}  # unit -> members not served this epoch
        self._epoch_start = 0
        self.released = 0

    def on_insert(self, unit: int, members: Sequence[int], size: int) -> None:
        super().on_insert(unit, members, size)
        self._members[unit] = tuple(members)
        self._left[unit] = set(members)

    def on_remove(self, unit: int) -> None:
        super().on_remove(unit)
        self._members.pop(unit, None)
        self._left.pop(unit, None)

    def on_access(self, unit: int, sample: int) -> None:
        super().on_access(unit, sample)
        start = self.ctx.future.epoch_start()
        if start != self._epoch_start:  # a new epoch: every unit is unread again
            self._epoch_start = start
            self._left = {u: set(m) for u, m in self._members.items()}
        left = self._left.get(unit)
        if left is not None:
            left.discard(sample)

    def release_after_use(self, unit: int, sample: int) -> bool:
        cache = self.ctx.cache
        if self._left.get(unit) or unit not in self._left:
            return False
        if cache.used() < self.pressure * cache.capacity():
            return False
        self.released += 1
        return True

    def stats(self) -> dict:
        return {"released_after_use": self.released}
