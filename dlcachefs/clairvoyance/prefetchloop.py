"""A stream's prefetch loop: its epoch's samples fetched in order, ahead of its reader.

When a stream knows its epoch's order, :meth:`PrefetchLoop.run` walks it and has the
prefetcher (:meth:`~dlcachefs.cache.prefetch.Prefetcher.prefetch_one`) make sure each
sample's current version is cached or held in memory before the reader opens it (the
chunk writer packs fetched files into chunks in fetch order, so the epoch's log comes out
in its read order).

Bounds: at most ``lead`` samples (and ``lead_bytes``) ahead of the reader, at most
``concurrency`` fetches in flight, and never faster than the chunk writer takes them.
Chunks loaded whole into the memory tier ahead of the reader (a log laid out in the
epoch's order) stay within the tier, from the chunk of the reader's position on, and are
``want``-ed there until the reader's position passes their last record (the tier evicts
them last): :class:`ChunksAhead`.

Concurrency: trio loop; one loop per stream's epoch, a task of the epoch's nursery
(cancelled with it when the stream's epoch or sampler changes); its fetches are tasks of
a nursery of its own.
"""

from __future__ import annotations

import logging
from collections import deque

import trio

from dlcachefs.cache.buffers import ReadAhead
from dlcachefs.cache.memtier import MemoryTier
from dlcachefs.cache.namespace import Namespace
from dlcachefs.cache.prefetch import Prefetcher
from dlcachefs.clairvoyance.stream import Stream
from dlcachefs.config import Config
from dlcachefs.errors import DlcError
from dlcachefs.store.schema import Chunk

log = logging.getLogger(__name__)

#: samples a stream's prefetch runs ahead of its reader at most (a read plan's lead too)
LEAD = 1024
#: bytes a stream's prefetch runs ahead of its reader at most (and half the cache)
LEAD_BYTES = 512 << 20
#: positions passed without a task (cached, nothing to do) between two checkpoints
SETTLED_STEP = 128


def stream_lead_bytes(cfg: Config) -> int:
    """The bytes a stream's prefetch runs ahead of its reader at most."""
    return min(LEAD_BYTES, cfg.cache_size // 2)


class ChunksAhead:
    """The chunks a stream's prefetcher loads whole into the memory tier ahead of its
    reader (a log laid out in the epoch's order), from the chunk of the reader's position
    on: each is ``want``-ed in the tier until the reader's position passes its last
    record, and together they stay within the tier's room less what read plans reserved
    and what other streams want (else the last ones loaded evict the first before their
    records are read). Trio loop only."""

    def __init__(self, mem: MemoryTier) -> None:
        self.mem = mem
        self.runs: deque[list[int]] = deque()  # [last position, chunk id], in order
        # chunk id -> [its runs (a chunk's positions need not be contiguous), length]
        self.chunks: dict[int, list[int]] = {}
        self.mine = 0  # bytes of the chunks here, each once

    def fits(self, c: Chunk) -> bool:
        """Whether the reader's chunks ahead and ``c`` fit (a first chunk always does)."""
        if c.chunk_id in self.chunks or not self.chunks:
            return True
        others = self.mem.wanted_bytes - self.mine
        return self.mine + c.length <= self.mem.limit - self.mem.reserved - others

    def add(self, p: int, c: Chunk) -> None:
        """Position ``p`` reads a record of ``c``."""
        if self.runs and self.runs[-1][1] == c.chunk_id:
            self.runs[-1][0] = p
            return
        self.runs.append([p, c.chunk_id])
        held = self.chunks.get(c.chunk_id)
        if held is not None:
            held[0] += 1
            return
        self.chunks[c.chunk_id] = [1, c.length]
        self.mine += c.length
        self.mem.want(c.chunk_id, c.length)

    def passed(self, position: int) -> None:
        """The reader's position: the runs before it are read."""
        while self.runs and self.runs[0][0] < position:
            self._drop(self.runs.popleft()[1])

    def clear(self) -> None:
        while self.runs:
            self._drop(self.runs.popleft()[1])

    def _drop(self, cid: int) -> None:
        held = self.chunks[cid]
        held[0] -= 1
        if held[0] == 0:
            del self.chunks[cid]
            self.mine -= held[1]
            self.mem.unwant(cid)


class PrefetchLoop:
    """Runs each stream's prefetch of its epoch (see the module doc)."""

    def __init__(self, ns: Namespace, readahead: ReadAhead, memtier: MemoryTier,
                 prefetcher: Prefetcher, *, lead: int = LEAD, lead_bytes: int = LEAD_BYTES,
                 concurrency: int = 8) -> None:
        """``lead_bytes``: at most this many bytes ahead (with ``memory_prefetch``, at
        most the read-ahead set's limit); ``concurrency``: fetches in flight per
        stream."""
        self.ns = ns
        self.readahead = readahead
        self.memtier = memtier
        self.prefetcher = prefetcher
        self.lead = lead
        self.lead_bytes = lead_bytes
        self.concurrency = concurrency

    async def run(self, s: Stream) -> None:
        """Prefetch ``s``'s epoch (its order as set at the switch) ahead of its reader."""
        assert s.samples is not None
        slots = trio.Semaphore(self.concurrency)
        lead_bytes = self.lead_bytes
        if s.memory_prefetch:
            lead_bytes = min(lead_bytes, self.readahead.limit)
        window: deque[tuple[int, int]] = deque()  # (position, size) prefetched, for lead_bytes
        # chunks loaded whole into the memory tier ahead of the reader (see _prefetch_in)
        ahead = s.chunks_ahead = ChunksAhead(self.memtier)
        try:
            await self._prefetch_in(s, slots, lead_bytes, window, ahead)
            # every position handed out: the chunks ahead stay wanted until read
            while ahead.runs:
                ahead.passed(s.position)
                if ahead.runs:
                    await s.moved.wait()
        finally:
            ahead.clear()
            if s.chunks_ahead is ahead:
                s.chunks_ahead = None

    async def _prefetch_in(self, s: Stream, slots: trio.Semaphore, lead_bytes: int,
                           window: deque[tuple[int, int]], ahead: ChunksAhead) -> None:
        sizes_ahead = 0
        settled = 0
        async with trio.open_nursery() as nursery:
            for p in range(len(s.order)):
                ino = s.samples.inos[s.order[p]]
                size = self.ns.size_of(ino) if ino else 0
                # stay within `lead` samples and `lead_bytes` of the reader, and within
                # the memory tier for chunks loaded whole
                while True:
                    while window and window[0][0] < s.position:
                        sizes_ahead -= window.popleft()[1]
                    ahead.passed(s.position)
                    # asked again after each wait: the tier's room may have changed
                    c = self.prefetcher.chunk_ahead(ino, s) if ino else None
                    if p - s.position < self.lead and (c is None or ahead.fits(c)) and (
                            sizes_ahead + size <= lead_bytes or not window):
                        break
                    await s.moved.wait()
                if c is None and ino and self.prefetcher.settled(ino, s):
                    # cached, listing fresh, nothing loaded ahead: what _fetch_one would
                    # find, without a task (the loop's cost per sample of a warm epoch)
                    s.prefetched_upto = p + 1
                    window.append((p, size))
                    sizes_ahead += size
                    s.ready[p] = 1
                    settled += 1
                    if settled % SETTLED_STEP == 0:
                        # a lead of such positions at an epoch's start is one loop step
                        # otherwise (index reads on the loop: FUSE requests wait)
                        await trio.lowlevel.checkpoint()
                    continue
                await slots.acquire()
                s.prefetched_upto = p + 1
                window.append((p, size))
                sizes_ahead += size
                if c is not None:
                    ahead.add(p, c)
                nursery.start_soon(self._fetch_one, s, p, ino, slots)

    async def _fetch_one(self, s: Stream, p: int, ino: int, slots: trio.Semaphore) -> None:
        try:
            if ino and not s.consumed[p]:
                fetched = await self.prefetcher.prefetch_one(ino, s)
                if fetched:
                    s.prefetched += 1
            s.ready[p] = 1
        except DlcError as e:
            log.debug("prefetch of inode %d failed: %s", ino, e)
        finally:
            slots.release()
