"""Least-recently-used eviction over whole chunks."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from .base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Evict the chunk whose last served record is the oldest."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[int, int] = OrderedDict()  # chunk id -> size, oldest first

    def __len__(self) -> int:
        return len(self._order)

    def on_insert(self, chunk_id: int, size: int) -> None:
        self._order[chunk_id] = size
        self._order.move_to_end(chunk_id)

    def on_access(self, chunk_id: int) -> None:
        if chunk_id in self._order:
            self._order.move_to_end(chunk_id)

    def on_remove(self, chunk_id: int) -> None:
        self._order.pop(chunk_id, None)

    def victims(self, need_bytes: int, exclude: Collection[int]) -> list[int]:
        out: list[int] = []
        freed = 0
        for cid, size in self._order.items():
            if freed >= need_bytes:
                break
            if cid in exclude:
                continue
            out.append(cid)
            freed += size
        return out
