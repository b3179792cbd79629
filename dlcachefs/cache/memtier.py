"""The memory tier: whole chunks recently read from the logs, bounded in bytes (LRU, but
for the chunks readers want: below).

A stream's prefetcher says which chunks its reader still needs (:meth:`MemoryTier.want`:
the chunks of its next records, loaded ahead or being read); eviction takes the least
recently used chunk nobody wants first, and when every chunk held is wanted, the one
wanted last (the furthest ahead of its reader). Plain LRU evicted what a reader was
about to read: a chunk loaded ahead, or one a loader worker had left for a moment for
the next chunk while another worker still had records to read in it, was touched
*before* the chunks the reader had finished, and a log laid out in the epoch's order was
read about twice whenever the dataset was larger than ``--memory``. ``wanted_bytes``
(each wanted chunk once) lets each stream keep its lead within what the others leave.

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
        # chunk id -> [streams whose reader needs it, its length], in the order first wanted
        self._wanted: OrderedDict[int, list[int]] = OrderedDict()
        self.wanted_bytes = 0

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

    def want(self, chunk_id: int, length: int) -> None:
        """A stream's reader will read records of this chunk (``length`` bytes, held
        now or loaded ahead soon): evicted last."""
        w = self._wanted.get(chunk_id)
        if w is None:
            self._wanted[chunk_id] = [1, length]
            self.wanted_bytes += length
        else:
            w[0] += 1

    def unwant(self, chunk_id: int) -> None:
        w = self._wanted.get(chunk_id)
        if w is None:
            return
        w[0] -= 1
        if w[0] <= 0:
            del self._wanted[chunk_id]
            self.wanted_bytes -= w[1]

    def _evict(self, extra: int) -> None:
        while self._d and self.bytes + self.reserved + extra > self.limit:
            old = self._d.pop(self._victim())
            self.bytes -= len(old.data)

    def _victim(self) -> int:
        """The least recently used chunk no stream wants, else the one wanted last (the
        furthest ahead of its reader: LRU among wanted chunks would take the next one a
        reader needs, loaded ahead and not touched yet)."""
        if not self._wanted:
            return next(iter(self._d))
        for cid in self._d:  # oldest first
            if cid not in self._wanted:
                return cid
        for cid in reversed(self._wanted):
            if cid in self._d:
                return cid
        return next(iter(self._d))

    def discard(self, chunk_id: int) -> None:
        old = self._d.pop(chunk_id, None)
        if old is not None:
            self.bytes -= len(old.data)
