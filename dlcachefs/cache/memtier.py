"""The memory tier: whole chunks recently read from the logs, bounded in bytes (LRU).

Runs on the trio loop only (no locks). Planned reads (:mod:`dlcachefs.cache.readplan`) hold their
bytes outside the tier but within the same ``--memory``: they ``reserve`` room, which
evicts chunks, and the tier then keeps ``bytes + reserved <= limit``. A chunk here may be only partly trusted: when its
payload checksum failed on load, ``verified`` is False and every slice taken from it is
checked against the record's own checksum before it is served.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class ChunkBuf:
    chunk_id: int
    offset: int  # absolute offset of the chunk in its log
    data: bytes
    verified: bool


class MemoryTier:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0
        self.reserved = 0  # bytes held by planned reads, out of the same limit
        self._d: OrderedDict[int, ChunkBuf] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def __contains__(self, chunk_id: int) -> bool:
        return chunk_id in self._d

    def get(self, chunk_id: int) -> ChunkBuf | None:
        buf = self._d.get(chunk_id)
        if buf is not None:
            self._d.move_to_end(chunk_id)
        return buf

    def can_hold(self, length: int) -> bool:
        """Whether a chunk of ``length`` bytes fits beside what planned reads reserved."""
        return length + self.reserved <= self.limit

    def put(self, buf: ChunkBuf) -> None:
        if not self.can_hold(len(buf.data)):
            return
        self.discard(buf.chunk_id)
        self._evict(len(buf.data))
        self._d[buf.chunk_id] = buf
        self.bytes += len(buf.data)

    def reserve(self, n: int) -> None:
        """``n`` bytes of the limit are used elsewhere (planned reads): evict to fit."""
        self.reserved += n
        self._evict(0)

    def unreserve(self, n: int) -> None:
        self.reserved -= n

    def _evict(self, extra: int) -> None:
        while self._d and self.bytes + self.reserved + extra > self.limit:
            _, old = self._d.popitem(last=False)
            self.bytes -= len(old.data)

    def discard(self, chunk_id: int) -> None:
        old = self._d.pop(chunk_id, None)
        if old is not None:
            self.bytes -= len(old.data)
