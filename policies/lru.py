"""Least-recently-used eviction over whole units (the baseline)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence

from dlcachefs.cache.policy import CachingPolicy


class LRUPolicy(CachingPolicy):
    """Evict the unit whose last served sample is the oldest."""

    name = "lru"

    def __init__(self, ctx=None, **opts: object) -> None:
        super().__init__(ctx, **opts)
        self._order: OrderedDict[int, int] = OrderedDict()  # unit -> size, oldest first

    def __len__(self) -> int:
        return len(self._order)

    def on_insert(self, unit: int, members: Sequence[int], size: int) -> None:
        self._order[unit] = size
        self._order.move_to_end(unit)

    def on_access(self, unit: int, sample: int) -> None:
        if unit in self._order:
            self._order.move_to_end(unit)

    def on_remove(self, unit: int) -> None:
        self._order.pop(unit, None)

    def victims(self, need: int, exclude: Collection[int]) -> list[int]:
        out: list[int] = []
        freed = 0
        for unit, size in self._order.items():
            if freed >= need:
                break
            if unit in exclude:
                continue
            out.append(unit)
            freed += size
        return out
