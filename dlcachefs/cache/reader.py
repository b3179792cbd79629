"""Reading cached records back: the memory tier and the logs, checksums verified.

A record's bytes come from:

* the memory tier (:mod:`dlcachefs.cache.memtier`), when its chunk was loaded lately;
* one read of the whole chunk (then kept in the memory tier), when whole chunks are
  being reused: the chunk's payload checksum is verified once, in the worker thread; a
  chunk whose payload fails it is kept unverified, and every record sliced from it is
  checked against its own checksum;
* one read of the record alone, checked against its own checksum, when chunks loaded
  lately served few records each (adaptive: see :meth:`LogReader._whole_chunk`), for an
  open a read plan covers, and for background reads (filling a reordered log).

A record that cannot be read or fails its checksum is dropped (the writer forgets it at
the next commit) and counted, never served: the open then fetches it from the source.
A chunk is pinned while it is read, so that it is not evicted (hole-punched) under the
read. Each record served is reported to the policy (which may release its chunk).

:meth:`LogReader.preload` reads ahead of a stream's reader: the chunk into the memory
tier, or the record alone into the :class:`~dlcachefs.cache.buffers.ReadAhead`.

Concurrency: the reader's state lives on the trio loop. Log reads and whole-chunk
checksums run in worker threads under the disk limiter, one hop per chunk or record.
Concurrent loads of one chunk are coalesced (``_loading``).
"""

from __future__ import annotations

import logging
import os
from collections import deque

import trio

from dlcachefs.cache.buffers import ReadAhead
from dlcachefs.cache.memtier import ChunkBuf, MemoryTier
from dlcachefs.cache.policy import CachingPolicy, releases_after_use
from dlcachefs.cache.stats import Counters
from dlcachefs.cache.versions import record_identity
from dlcachefs.cache.writer import ChunkWriter
from dlcachefs.errors import FormatError
from dlcachefs.store.chunkfmt import checksum, verify_chunk
from dlcachefs.store.index import Index
from dlcachefs.store.logs import LogStore
from dlcachefs.store.schema import Chunk, Record

log = logging.getLogger(__name__)

#: records up to this size are read on the loop when their pages are in memory (a copy of
#: 1 MiB takes ~0.1 ms: longer would hold other requests up; larger records go through a
#: thread as before)
CACHED_READ_MAX = 1 << 20


class LogReader:
    """Records from the memory tier or the logs (see the module docstring)."""

    def __init__(self, index: Index, logs: LogStore, memtier: MemoryTier, writer: ChunkWriter,
                 policy: CachingPolicy, counters: Counters,
                 disk_limiter: trio.CapacityLimiter, readahead: ReadAhead) -> None:
        self.index = index
        self.logs = logs
        self.memtier = memtier
        self.writer = writer
        self.policy = policy
        self.counters = counters
        self.disk_limiter = disk_limiter
        self.readahead = readahead
        self._loading: dict[int, trio.Event] = {}  # chunk id -> load in progress
        # adaptive whole-chunk reads: records served per chunk loaded, as a moving average
        self._reuse = 8.0
        self._loads = 0
        self._served = 0
        self._probe = 0
        self._recent_chunk_reads: deque[int] = deque(maxlen=64)

    async def read_record(self, ino: int, rec: Record, background: bool = False,
                          whole: bool = True) -> memoryview | None:
        """The record's bytes from memory or the log; None when they cannot be trusted.
        ``background`` reads (filling a reordered log) read the record alone and leave the
        memory tier and the reader's statistics alone. ``whole=False`` (an open a read
        plan covers) never loads the whole chunk: the plan reads the chunk's other records
        when they are due."""
        buf = self.memtier.get(rec.chunk_id)
        while buf is None and rec.chunk_id in self._loading:
            await self._loading[rec.chunk_id].wait()  # another open is loading this chunk
            buf = self.memtier.get(rec.chunk_id)
        if buf is None:
            if not self.writer.pin(rec.chunk_id):
                return None  # being evicted right now
            try:
                c = self.index.get_chunk(rec.chunk_id)
                if c is None:
                    return None
                if background or not whole or not self._whole_chunk(c):
                    return await self.read_single(ino, rec, background)
                buf = await self._load_chunk_into_memory(c)
                if buf is None:
                    return self.bad(ino, rec.chunk_id)
            finally:
                self.writer.unpin(rec.chunk_id)
        else:
            self._served += 1
        start = rec.offset - buf.offset
        view = memoryview(buf.data)[start : start + rec.size]
        if len(view) != rec.size or (not buf.verified and checksum(view) != rec.data_xxh):
            return self.bad(ino, rec.chunk_id)
        if not background:
            self.after_use(rec.chunk_id, ino)
        return view

    async def _load_chunk_into_memory(self, c: Chunk) -> ChunkBuf | None:
        # sequential: a neighbour of it in the log was among the last chunk reads *asked
        # for* (issued, finished or still in flight). Decided here, before the read, in the
        # order the daemon asks the disk: loads run concurrently (the reader, several
        # preloads under the disk limiter) and their tasks resume in any order (trio runs a
        # batch of woken tasks in reverse half of the time: three preloads of a scan issued
        # as 2, 3, 4 and finishing together resumed as 4, 3, 2), so deciding on completion
        # counted 4 as a jump (neither 3 nor 5 done yet) in a log read front to back. Issued
        # in log order, every chunk but the first of a run counts, whatever the finish order.
        recent = self._recent_chunk_reads
        sequential = c.chunk_id - 1 in recent or c.chunk_id + 1 in recent
        recent.append(c.chunk_id)
        ev = self._loading[c.chunk_id] = trio.Event()
        data = None
        try:
            data, verified = await trio.to_thread.run_sync(
                self._load_chunk, c, limiter=self.disk_limiter)
        except (FormatError, OSError) as exc:
            log.warning("chunk %d unreadable (%s); refetching from the source", c.chunk_id, exc)
            return None
        finally:
            del self._loading[c.chunk_id]
            ev.set()
            if data is None and c.chunk_id in recent:  # not read after all (or cancelled)
                recent.remove(c.chunk_id)
        self.counters.chunk_reads += 1
        if sequential:
            self.counters.sequential_chunk_reads += 1
        log.debug("chunk read %d (log %d, %d bytes%s)", c.chunk_id, c.log_id, c.length,
                  ", sequential" if sequential else "")
        self._loads += 1
        buf = ChunkBuf(c.chunk_id, c.offset, data, verified)
        self.memtier.put(buf)
        return buf

    async def read_single(self, ino: int, rec: Record, background: bool = False,
                          counter: str = "fill_reads") -> memoryview | None:
        """One record from the log, checked against its checksum. ``background`` reads
        count under ``counter`` instead of ``record_reads``. A reader's record whose
        pages are all in memory is copied on the loop (:meth:`LogStore.read_cached`), not
        read in a thread: the hop costs more CPU than the copy of a sample (a few tens of
        microseconds for 110 KB), and the loop never waits for the disk."""
        data: bytes | bytearray | None = None
        if not background and rec.size <= CACHED_READ_MAX:
            try:
                data = self.logs.read_cached(rec.log_id, rec.offset, rec.size)
            except OSError:
                data = None  # the thread's read below says what is wrong
            if data is not None:
                self.counters.record_reads_in_memory += 1
        if data is None:
            try:
                data = await trio.to_thread.run_sync(self.logs.read, rec.log_id, rec.offset,
                                                     rec.size, limiter=self.disk_limiter)
            except (FormatError, OSError):
                return self.bad(ino, rec.chunk_id)
        if background:
            setattr(self.counters, counter, getattr(self.counters, counter) + 1)
        else:
            self.counters.record_reads += 1
        if checksum(data) != rec.data_xxh:
            return self.bad(ino, rec.chunk_id)
        if not background:
            self.after_use(rec.chunk_id, ino)
        return memoryview(data)

    def bad(self, ino: int, chunk_id: int | None = None) -> None:
        """The record of ``ino`` cannot be trusted: counted, logged (the first 100, then
        one in 1,000: a failing disk must not flood the log), and dropped at the next
        commit (its open fetches the file from the source)."""
        self.counters.checksum_failures += 1
        n = self.counters.checksum_failures
        if n <= 100 or n % 1000 == 0:
            e = self.index.get_entry(ino)
            log.warning("cached copy of %r (inode %d%s) is damaged or unreadable (%d so "
                        "far): served from the source instead; `dlcachefs verify` checks "
                        "the whole cache", os.fsdecode(e.name) if e is not None else "?", ino,
                        "" if chunk_id is None else f", chunk {chunk_id}", n)
        self.writer.drop(ino)
        return None

    def after_use(self, chunk_id: int, ino: int) -> None:
        """A record of the chunk was served: tell the policy; release if it says so."""
        self.policy.on_access(chunk_id, ino)
        if releases_after_use(self.policy, chunk_id, ino):
            self.counters.released_after_use += 1
            self.writer.retire_chunk(chunk_id)

    def _whole_chunk(self, c: Chunk) -> bool:
        """Read the whole chunk (then slice) or just the one record?

        Whole chunks pay off when later records of the chunk are read while it is still
        in memory (sequential or clairvoyant order, or a dataset that fits the memory
        tier). When chunks loaded lately served few records each, read single records,
        and probe with a whole chunk every 16th miss to notice when that changes.
        """
        if c.length > self.memtier.limit // 3:  # chunks end a little past --chunk-size
            return False
        if not self.memtier.can_hold(c.length):  # planned reads hold the room: records
            return False
        if self._loads >= 32:
            self._reuse = 0.5 * self._reuse + 0.5 * (1 + self._served / self._loads)
            self._loads = self._served = 0
        if self._reuse >= 2.0:
            return True
        self._probe += 1
        return self._probe % 16 == 0

    def _load_chunk(self, c: Chunk) -> tuple[bytes, bool]:
        """Thread: one read of a whole chunk; True when its payload checksum holds."""
        data = self.logs.read(c.log_id, c.offset, c.length)
        try:
            _, _, bad = verify_chunk(data)
        except FormatError:
            return data, False
        return data, bad == 0

    def _preloads_whole(self, c: Chunk) -> bool:
        return (c.length <= self.memtier.limit // 3 and self.memtier.can_hold(c.length)
                and self._reuse >= 2.0)

    def chunk_to_preload(self, ino: int, only_log: int | None = None) -> Chunk | None:
        """The chunk a :meth:`preload` of ``ino`` would have in the memory tier (loaded
        whole now, or there already), if any: the stream's prefetcher keeps such chunks
        within the tier until their last record is opened."""
        rec = self.index.get_record(ino)
        if rec is None or (only_log is not None and rec.log_id != only_log):
            return None
        c = self.index.get_chunk(rec.chunk_id)
        return c if c is not None and self._preloads_whole(c) else None

    async def preload(self, ino: int, owner: str, only_log: int | None = None) -> None:
        """Ahead of the reader: its chunk into the memory tier when whole chunks are being
        reused, else the record alone into the read-ahead set (the reader then never
        waits for the disk). ``only_log``: whole chunks of that log only (the one laid
        out for the reader's epoch); a record elsewhere is loaded alone."""
        rec = self.index.get_record(ino)
        if rec is None or rec.chunk_id in self.memtier or rec.chunk_id in self._loading:
            return
        c = self.index.get_chunk(rec.chunk_id)
        if c is None or not self.writer.pin(c.chunk_id):
            return
        try:
            if (only_log is None or rec.log_id == only_log) and self._preloads_whole(c):
                if await self._load_chunk_into_memory(c) is not None:
                    self.counters.chunk_preloads += 1
            elif ino not in self.readahead and self.readahead.has_room(rec.size):
                data = await self.read_single(ino, rec, True, "record_preloads")
                if data is not None and self.index.get_record(ino) == rec:
                    self.readahead.put(ino, record_identity(rec), rec, data, owner)
        finally:
            self.writer.unpin(c.chunk_id)
