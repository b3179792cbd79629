"""LCache's log reordering (Algorithm 1): lay out epoch e+1's log in epoch e+1's order
while epoch e is read.

When a stream knows the order of its next epoch (DistributedSampler, or a RandomSampler
whose generator seed was announced), a :class:`NextEpochLog` plans a new log file: the
samples of epoch e+1 in that order, grouped into chunks of about ``--chunk-size``, each
record at a precomputed offset (LCache computes "the storage location of each sample
file within the LogFile" from the file sizes). While epoch e runs, every sample the
reader consumes is written, in the background, to its slot in that file, from the bytes
the reader was just served (no second read). A chunk whose records are all written gets
its header (payload checksum) and ``fdatasync``, and only then is indexed: its records
now point into the new log. Old chunks whose records have all moved are released
(LCache line 16, "evict(CurrLog, ...)"), through the chunk writer, once unpinned.

At the start of epoch e+1 the plan is finished: slots still empty (samples not read
through this stream in epoch e) are filled from the cache, or the source, and their
chunks sealed. Epoch e+1 then reads its log front to back, one large read per chunk.

Each sample gets one slot (its first position in the next order): the index keeps one
location per file. A slot whose planned version is gone for good (the file deleted, or
changed: the reader was served another version and the namespace lists that one) gets a
filler record of the slot's length (inode 0, never indexed), so the chunk's other samples
still seal in order; a chunk of fillers only is never sealed. A source error that says
nothing of the version (a timeout, EIO) leaves the slot unwritten. Crash safety is the
writer's: only complete, fsynced chunks are indexed; after a crash the plan is gone and
the records still point at their old chunks.

``--cache-size``: each slot's record length (and the chunk header's, with its chunk's first
slot) is reserved in the chunk writer's account (:meth:`ChunkWriter.try_reserve`, which
evicts by the policy to make room) when the slot is claimed, before any byte of it is
written; a slot that gets no reservation is not claimed (the fill at the epoch boundary
tries again). Per slot, not per chunk: when the cache cannot hold two copies of the
dataset, this log grows while the current epoch's log shrinks (its chunks are released as
they are read), the two fitting at every moment as LCache argues; a chunk's whole length
claimed at its first slot would ask, within the first few samples of the epoch, for the
room of every chunk of this log at once, and most slots would go unwritten (then fetched
from the source again at the epoch boundary). A sealed chunk's reservations (its length,
all slots being written) become chunk bytes when it is indexed, under the writer's limiter
(:meth:`ChunkWriter.commit_external`), and are given back, with the written range punched
out, when the plan ends with the chunk unsealed. The plan itself is cut to what the cache
can hold and its chunks to the writer's unit size.

Concurrency: the plan's state lives on the trio loop; slot writes go to worker threads
in batches (one thread hop per batch, not per sample) under the disk limiter; chunk
finalization (read back, checksum, header, fdatasync, one LMDB write transaction) runs in
a thread. The plan's tasks belong to the stream manager's nursery.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from dlcachefs.cache.namespace import identity
from dlcachefs.cache.source import Identity
from dlcachefs.errors import DlcError, NotFound, SourceChanged
from dlcachefs.store import schema as S
from dlcachefs.store.chunkfmt import (
    CHUNK_HEADER_SIZE,
    LOG_HEADER_SIZE,
    RECORD_HEADER_SIZE,
    RecordIn,
    checksum,
    encode_chunk_header,
    encode_record,
    record_len,
)
from dlcachefs.store.integrity import log_failure
from dlcachefs.store.schema import Chunk, Record
from dlcachefs.store.seal import NewChunk, NewRecord, seal_chunks

if TYPE_CHECKING:
    from dlcachefs.cache.policy import CachingPolicy
    from dlcachefs.cache.prefetch import Prefetcher
    from dlcachefs.cache.stats import Counters
    from dlcachefs.cache.versions import Versions
    from dlcachefs.cache.writer import ChunkWriter
    from dlcachefs.config import Config
    from dlcachefs.store.index import Index
    from dlcachefs.store.logs import LogStore

log = logging.getLogger(__name__)

#: bytes of consumed samples waiting to be written to their slots; above it they are
#: left for the fill at the epoch boundary
MAX_QUEUED = 64 << 20
#: bytes of samples served through the mount that found no room for their slots, kept
#: until room is freed (:meth:`NextEpochLog.consumed`), over every log of the daemon
#: together; above it they are read again
MAX_HELD = 64 << 20


class HeldBudget:
    """The bytes every next-epoch log of a daemon holds for slots that found no room
    (:data:`MAX_HELD` in all: with many ranks, or logs of jobs gone, never more). Trio
    loop only."""

    def __init__(self, limit: int = MAX_HELD) -> None:
        self.limit = limit
        self.used = 0


class RoomRound:
    """The room one round of retries hands out (:meth:`NextEpochLog.take_no_room`, after
    a chunk was released or unpinned): the writer's reclaimable bytes once, each log's
    retry taking what its slots need from what is left. Each log given the whole room
    read back, together, more slots than could be reserved, and those that then found no
    room were read for nothing. Trio loop only."""

    def __init__(self, left: int) -> None:
        self.left = left


@dataclass(slots=True)
class Slot:
    ino: int
    key: bytes
    ident: Identity
    chunk: int  # index into NextEpochLog.chunks
    offset: int  # absolute offset of the record header in the log
    rlen: int  # the record's length (header, path, bytes)
    written: bool = False
    read: bool = False  # read in this log's own epoch (a sample may repeat in an order)
    #: written with a filler record, not the file's: the file changed or vanished since
    #: planning, so this version can never be written; the chunk seals without it
    filler: bool = False


@dataclass(slots=True)
class PlannedChunk:
    chunk_id: int
    offset: int
    length: int
    slots: list[Slot] = field(default_factory=list)
    remaining: int = 0
    sealed: bool = False
    unread: int = 0  # records not yet read in this log's own epoch
    held: int = 0  # bytes of it reserved in the writer's --cache-size account

    def members(self) -> tuple[int, ...]:
        """The files the chunk holds once sealed (its filler slots hold none)."""
        return tuple(s.ino for s in self.slots if not s.filler)


def filler_record(rlen: int) -> bytes:
    """A record of ``rlen`` bytes that belongs to no file (inode 0, empty key, zeros):
    it takes the slot of a sample whose planned version can no longer be written, so the
    chunk's layout, computed from the planned sizes, stays valid and the chunk can be
    sealed. Nothing indexes inode 0, so no reader ever serves it."""
    return encode_record(RecordIn(0, b"", 0, 0, bytes(rlen - RECORD_HEADER_SIZE)))


def plan_layout(index, inos: list[int], chunk_size: int, max_file: int, start_offset: int,
                max_bytes: int | None = None) -> tuple[list[PlannedChunk], dict[int, Slot]]:
    """Thread: slots and chunk boundaries for ``inos`` in this order (first occurrence
    only; files not cacheable are left out), stopping before ``max_bytes`` of chunks: when
    the log cannot hold the whole epoch it holds the samples that come first (LCache
    III-B). Chunk ids are filled in by the caller."""
    paths: dict[int, bytes] = {}

    def rel(e) -> bytes:
        if e.parent in (0, 1):
            return e.name
        p = paths.get(e.parent)
        if p is None:
            pe = index.get_entry(e.parent)
            p = paths[e.parent] = rel(pe) if pe is not None else b""
        return p + b"/" + e.name

    chunks: list[PlannedChunk] = []
    slots: dict[int, Slot] = {}
    cur: PlannedChunk | None = None
    off = start_offset
    for ino in inos:
        if not ino or ino in slots:
            continue
        e = index.get_entry(ino)
        if e is None or e.size > max_file or (e.mode & 0o170000) != 0o100000:
            continue
        key = rel(e)
        rlen = record_len(len(key), e.size)
        if max_bytes is not None and off - start_offset + rlen + CHUNK_HEADER_SIZE > max_bytes:
            break
        if cur is None or (cur.slots and cur.length + rlen > chunk_size):
            cur = PlannedChunk(0, off, CHUNK_HEADER_SIZE)
            chunks.append(cur)
            off += CHUNK_HEADER_SIZE
        slot = Slot(ino, key, identity(e), len(chunks) - 1, off, rlen)
        cur.slots.append(slot)
        cur.length += rlen
        cur.remaining += 1
        slots[ino] = slot
        off += rlen
    return chunks, slots


class NextEpochLog:
    """The reordered log of one stream's next epoch."""

    def __init__(self, stream_key: str, epoch: int, *, cfg: Config, index: Index,
                 logs: LogStore, writer: ChunkWriter, policy: CachingPolicy,
                 counters: Counters, disk_limiter: trio.CapacityLimiter,
                 versions: Versions, prefetcher: Prefetcher,
                 held: HeldBudget | None = None) -> None:
        """The log of stream ``stream_key``'s ``epoch``. ``held``: the budget of bytes
        held for slots that found no room, shared by every log of the daemon (a budget
        of this log's own without it). Its collaborators: the writer's
        ``--cache-size`` account, ids and retirement (``chunk_target``,
        ``reserve_chunk_ids``, ``reserve_log_id``, ``protected``, ``try_reserve``,
        ``unreserve``, ``commit_external``, ``retire_chunk``), the logs' file operations,
        index write transactions (in threads) under ``disk_limiter`` for slot writes, the
        policy's ``on_insert``, the counters, ``versions.listed_entry`` (is a planned
        version still the listed one) and :meth:`Prefetcher.bytes_for` (the bytes of
        slots the reader did not fill)."""
        self.cfg = cfg
        self.index = index
        self.logs = logs
        self.writer = writer
        self.policy = policy
        self.counters = counters
        self.disk_limiter = disk_limiter
        self.versions = versions
        self.prefetcher = prefetcher
        self.key = stream_key
        self.epoch = epoch
        #: the order (dataset indices) the log is laid out for, when its planner says:
        #: an epoch that begins with another order does not read it as its log
        self.order: list[int] | None = None
        self.log_id = 0
        self.chunks: list[PlannedChunk] = []
        self.slots: dict[int, Slot] = {}
        self.queue: list[tuple[Slot, bytes]] = []
        self.queued_bytes = 0
        self._wake = trio.Event()
        self.sealed = 0
        self.failed = False
        #: samples of the log not written when its epoch began (fetched for it then)
        self.missing_at_start: int | None = None
        #: its epoch is being read and its chunks are released once read (a cache too
        #: small for the dataset: set by the stream manager after start_reading)
        self.release_after_use = False
        self._finish = False
        self._reading = False  # start_reading was called: chunks count their unread
        self.done = trio.Event()
        #: slots consumed (or backfilled) when --cache-size had no room for them, read
        #: again from the cache (else the source) once the current epoch's log releases a
        #: chunk (:meth:`room_freed`): the reads served in training processes release
        #: theirs a drain late, after opens through the mount that came next
        self._no_room: dict[int, None] = {}
        self._room_freed = False
        #: the bytes of some of those slots, served through the mount: with a cache too
        #: small for the dataset they are nowhere else (prefetched into memory only), and
        #: read again they were read from the source twice (with reads served in training
        #: processes, 1.5x Belady's source bytes over four epochs at a cache of 60%)
        self._held: dict[int, bytes] = {}
        self.held_bytes = 0
        self.budget = held if held is not None else HeldBudget()

    async def plan(self, order_inos: list[int], max_bytes: int | None = None,
                   ranks: int = 1) -> None:
        """Lay out the log of ``order_inos`` (the next epoch's order); ``ranks``: the
        streams laying out their next epochs (they share the cache)."""
        cfg = self.cfg
        # never more than the cache holds, shared by the streams (ranks) laying out their
        # next epochs (each log holds its own samples). No room is kept aside for the
        # current epoch's chunks: a slot that finds none while they are read keeps its
        # bytes (within MAX_HELD) and is retried as they are released, and by the end of
        # the epoch this rank's are. (Two chunks kept aside were a fifth of a cache of
        # nine chunks: 0.72-0.78x Belady's hit ratio at 10% with 2 and 4 ranks,
        # `bench.partial`; without, medians of 0.91-0.97x.) The reservations keep the
        # limit whatever this estimate says
        w = self.writer
        ranks = max(1, ranks)
        cap = max(w.limit // ranks, w.chunk_target)  # limit: the share
        max_bytes = cap if max_bytes is None else min(max_bytes, cap)
        self.chunks, self.slots = await trio.to_thread.run_sync(
            plan_layout, self.index, order_inos, w.chunk_target, cfg.max_cached_file,
            LOG_HEADER_SIZE, max_bytes)
        first = self.writer.reserve_chunk_ids(len(self.chunks))
        for i, c in enumerate(self.chunks):
            c.chunk_id = first + i
        # until its epoch starts (and with a cache too small for the dataset, until each
        # chunk is read in that epoch: release), this log's chunks are not the LRU's
        self.writer.protected.update(c.chunk_id for c in self.chunks)
        self.log_id = self.writer.reserve_log_id()
        end = self.chunks[-1].offset + self.chunks[-1].length if self.chunks else LOG_HEADER_SIZE
        self.logs.filling.add(self.log_id)
        await trio.to_thread.run_sync(self.logs.create_sized, self.log_id, end)
        await trio.to_thread.run_sync(self._record_plan)
        log.info("stream %s: planned epoch %d's log %d: %d samples in %d chunks", self.key,
                 self.epoch, self.log_id, len(self.slots), len(self.chunks))

    # ----- loop side ------------------------------------------------------------------

    def wants(self, ino: int) -> bool:
        """Whether ``ino``'s slot is still to be written from the bytes its open is
        served (:meth:`consumed`): such an open loads them at open, not lazily."""
        slot = self.slots.get(ino)
        return slot is not None and not slot.written and not self.failed

    def consumed(self, ino: int, data: bytes | memoryview, ident: Identity) -> None:
        """The reader was just served ``data`` for ``ino``: queue it for its slot."""
        slot = self.slots.get(ino)
        if slot is None or slot.written or self.failed:
            return
        if slot.ident != ident:
            # changed since planning: when the planned version is no longer the listed
            # one, it can never be written, and the slot's length was computed from it,
            # so the slot gets a filler record and its chunk can still be sealed (the new
            # version is cached on its own). (The bytes served may also be an older
            # version than planned, from a fetch joined: then the fill decides.)
            if self.versions.listed_entry(ino, slot.ident) is None:
                self._claim_filler(slot)
            return
        if len(data) != slot.ident.size:
            return  # not the whole file: the fill decides at the epoch boundary
        if self.queued_bytes + len(data) > MAX_QUEUED:
            return  # (the fill reads it at the epoch boundary)
        if not self._reserve(slot):
            self._no_room[ino] = None
            self._hold_bytes(ino, data)
            return
        self._drop_held(ino)
        slot.written = True  # claimed; written by the drain task
        self.queue.append((slot, bytes(data)))
        self.queued_bytes += len(data)
        self._wake.set()

    def gone(self, ino: int) -> None:
        """``ino`` is gone from the source: its slot can never hold it (a filler)."""
        slot = self.slots.get(ino)
        if slot is not None:
            self._claim_filler(slot)

    def _hold_bytes(self, ino: int, data: bytes | memoryview) -> None:
        """Keep ``data`` for ``ino``'s slot, which found no room, within the daemon's
        :data:`HELD` budget (else its bytes are read again when room comes)."""
        if (ino not in self._held and not self._finish and not self.failed
                and self.budget.used + len(data) <= self.budget.limit):
            self._held[ino] = bytes(data)
            self.held_bytes += len(data)
            self.budget.used += len(data)

    def _drop_held(self, ino: int) -> bytes | None:
        data = self._held.pop(ino, None)
        if data is not None:
            self.held_bytes -= len(data)
            self.budget.used -= len(data)
        return data

    def _drop_all_held(self) -> None:
        self.budget.used -= self.held_bytes
        self._held.clear()
        self.held_bytes = 0

    def _claim_filler(self, slot: Slot) -> None:
        """Claim ``slot`` for a filler record (see :func:`filler_record`), unless it was
        claimed already, the log failed, or there is no room for it in --cache-size (its
        chunk then stays unsealed)."""
        self._drop_held(slot.ino)
        if slot.written or self.failed or not self._reserve(slot):
            return
        slot.written = slot.filler = True
        if not slot.read:  # nothing of it is to be read from this log in its epoch
            slot.read = True
            if self._reading:
                self.chunks[slot.chunk].unread -= 1
        self.queue.append((slot, b""))
        self._wake.set()

    def _reserve(self, slot: Slot) -> bool:
        """Room in --cache-size for the slot's record (and its chunk's header, with the
        chunk's first slot), reserved before its first byte; False when there is none.
        Called once per slot, just before it is claimed (``written``)."""
        c = self.chunks[slot.chunk]
        need = slot.rlen + (CHUNK_HEADER_SIZE if c.held == 0 else 0)
        if not self.writer.try_reserve(need):
            return False
        c.held += need
        return True

    def start_reading(self) -> None:
        """This log's epoch has begun: count, per chunk, the records still to be read."""
        self._reading = True
        for c in self.chunks:
            c.unread = sum(not s.read for s in c.slots)  # (filler slots are never read)

    def used(self, ino: int) -> int | None:
        """The reader consumed ``ino`` in this log's epoch; returns the chunk id when that
        was the chunk's last unread record (and the chunk is sealed): it may be released."""
        slot = self.slots.get(ino)
        if slot is None or slot.read:
            return None
        slot.read = True
        c = self.chunks[slot.chunk]
        if c.unread <= 0:
            return None
        c.unread -= 1
        return c.chunk_id if c.unread == 0 and c.sealed else None

    def unprotect(self) -> None:
        self.writer.protected.difference_update(c.chunk_id for c in self.chunks)

    def protect(self) -> None:
        """Protect its chunks again (after :meth:`unprotect`), those still to be sealed or
        indexed and not on their way out (a doomed chunk must never be protected)."""
        w, ix = self.writer, self.index
        for c in self.chunks:
            if c.chunk_id in w.doomed or c.chunk_id in w.evicting:
                continue
            if c.sealed and ix.get_chunk(c.chunk_id) is None:
                continue
            w.protected.add(c.chunk_id)

    def release(self, chunk_id: int) -> None:
        """LCache's release after use: every record of the chunk was read in this log's
        epoch; it is no longer protected, and evicted at the next seal."""
        self.writer.protected.discard(chunk_id)
        self.counters.released_after_use += 1
        self.writer.retire_chunk(chunk_id)

    def request_finish(self) -> None:
        """Epoch e+1 has started: fill what is missing and seal the rest (see :meth:`run`)."""
        self.missing_at_start = sum(1 for s in self.slots.values() if not s.written)
        log.info("stream %s: epoch %d starts with %d of %d chunks of its log sealed, %d "
                 "samples missing", self.key, self.epoch, self.sealed, len(self.chunks),
                 self.missing_at_start)
        self._finish = True
        self._wake.set()

    def abandon(self) -> None:
        self.unprotect()
        self.failed = True
        self._finish = True
        self._drop_all_held()
        self._wake.set()

    async def run(self) -> None:
        """Drain consumed samples into their slots and seal complete chunks; once asked to
        finish, fill the empty slots (from the cache, else the source) and seal them."""
        try:
            while not self._finish:
                await self._wake.wait()
                self._wake = trio.Event()
                await self._drain()
            if not self.failed:
                await self._fill()
        except (OSError, DlcError) as e:
            self.failed = True
            log.warning("stream %s: reordering epoch %d stopped: %s", self.key, self.epoch, e)
        except Exception:  # noqa: BLE001 - a background task must never end the daemon
            self.failed = True
            log_failure(log, "stream %s: reordering epoch %d failed", self.key, self.epoch)
        finally:
            self._drop_all_held()  # (the log is written: nothing more is claimed)
            self.logs.filling.discard(self.log_id)
            given_up = [c for c in self.chunks if c.held and not c.sealed]
            for c in given_up:  # their bytes will never be indexed
                self.writer.unreserve(c.held)
                c.held = 0
            with trio.CancelScope(shield=True):
                if self.sealed == 0:
                    await trio.to_thread.run_sync(self.logs.discard_log, self.log_id)
                elif given_up:
                    await trio.to_thread.run_sync(self._punch, given_up)
            log.info("stream %s: epoch %d's log %d: %d of %d chunks sealed", self.key,
                     self.epoch, self.log_id, self.sealed, len(self.chunks))
            self.done.set()

    async def _drain(self) -> None:
        while self.queue:
            batch, self.queue, self.queued_bytes = self.queue, [], 0
            await trio.to_thread.run_sync(self._write_slots, batch,
                                          limiter=self.disk_limiter)
            ready = []
            for slot, _ in batch:
                c = self.chunks[slot.chunk]
                c.remaining -= 1
                if c.remaining == 0:
                    ready.append(c)
            for c in ready:
                if c.members():
                    await self._seal(c)
                # (a chunk of fillers only would hold nothing: it is given up at the end)

    def hold(self, inos: list[int]) -> list[int]:
        """Pin the chunks the cache holds ``inos``' records in, until :meth:`backfill`
        of them has read them (given the list returned). Called in the same step as the
        reads served in training processes that may release those chunks (their bytes
        never reach the daemon): a chunk released after use is dropped at the next seal,
        and the backfill read its records from the source again."""
        pinned = []
        for ino in inos:
            rec = self.index.get_record(ino)
            if rec is not None and self.writer.pin(rec.chunk_id):
                pinned.append(rec.chunk_id)
        return pinned

    async def backfill(self, inos: list[int], pinned: list[int] | None = None) -> None:
        """Queue samples consumed before this plan existed, read in training processes, or
        that found no room when consumed (read back from the cache, else the source).
        ``pinned``: chunks :meth:`hold` pinned for them (a drain's reads): their records
        are read first, then the chunks unpinned, so that the room of those the reads
        released can take the records read from them."""
        try:
            if pinned is not None:
                # _read_pinned unpins them, whatever happens (one owner of the unpins: a
                # second unpin would take away another reader's pin)
                read = await self._read_pinned(inos, pinned)
                await self._backfill(list(read), read)
            else:
                await self._backfill(inos)
        except Exception:  # noqa: BLE001 - a background task must never end the daemon
            log_failure(log, "stream %s: backfill of epoch %d's log failed", self.key, self.epoch)

    async def _read_pinned(self, inos: list[int], pinned: list[int]
                           ) -> dict[int, bytes | memoryview | None]:
        """The planned bytes of the slots of ``inos`` still to be written, read while
        ``pinned`` are pinned (unpinned on return)."""
        out: dict[int, bytes | memoryview | None] = {}
        try:
            for ino in inos:
                slot = self.slots.get(ino)
                if slot is None or slot.written or self.failed or self._finish:
                    continue
                try:
                    out[ino] = await self._planned_bytes(slot)
                except DlcError:  # timed out, the source failing...: left for the fill
                    continue
        finally:
            for cid in pinned:
                self.writer.unpin(cid)
        return out

    async def _backfill(self, inos: list[int],
                        read: dict[int, bytes | memoryview | None] | None = None) -> None:
        """``read``: the bytes already read for ``inos`` (else read here)."""
        for ino in inos:
            slot = self.slots.get(ino)
            if slot is None or slot.written or self.failed or self._finish:
                continue
            if read is not None:
                data = read[ino]
            else:
                try:
                    data = await self._planned_bytes(slot)
                except DlcError:  # timed out, the source failing...: left for the fill
                    continue
            # (after the await: the log may have ended, or another task claimed the slot)
            if data is None and not self._finish:
                self._claim_filler(slot)  # gone, or changed: never this version again
                continue
            if data is None or slot.written or self.failed or self._finish:
                continue
            if not self._reserve(slot):
                self._no_room[ino] = None
                self._hold_bytes(ino, data)
                continue
            self._drop_held(ino)
            slot.written = True
            self.queue.append((slot, bytes(data)))
            self.queued_bytes += len(data)
            if self.queued_bytes > 8 << 20:
                self._wake.set()
                await trio.sleep(0)
        self._wake.set()

    def room_freed(self) -> None:
        """The current epoch's log released a chunk: the slots that found no room may."""
        self._room_freed = True

    def take_no_room(self, room: RoomRound | None = None) -> list[int]:
        """The slots to backfill now that room was freed (none until it was). ``room``:
        the round's room, shared with the other logs retried in the same round (taken
        from here); without it, the writer's reclaimable bytes for this log alone."""
        if not self._room_freed or not self._no_room or self._finish or self.failed:
            return []
        self._room_freed = False
        if room is None:
            room = RoomRound(self.writer.reclaimable())
        # as many as the room freed holds (each read back from the cache, else the
        # source: not a read per release for slots that would find no room again)
        out = []
        for i in list(self._no_room):
            slot = self.slots[i]
            if not slot.written:
                need = slot.rlen + CHUNK_HEADER_SIZE
                if need > room.left:
                    break
                room.left -= need
                out.append(i)
            del self._no_room[i]
        return out

    async def _fill(self) -> None:
        for slot in list(self.slots.values()):
            if slot.written:
                continue
            try:
                data = await self._planned_bytes(slot)
            except DlcError:
                continue  # timed out, the source failing...: that chunk stays unsealed
            # (after the await: the backfill may have claimed it, or the log failed)
            if data is None:
                # gone, or changed: a filler record takes its place, so the chunk's
                # other samples are still read from this log in order
                self._claim_filler(slot)
                continue
            if slot.written or self.failed or not self._reserve(slot):
                continue  # claimed meanwhile, or no room: that chunk stays unsealed
            slot.written = True
            self.queue.append((slot, bytes(data)))
            self.queued_bytes += len(data)
            if self.queued_bytes > 8 << 20:
                await self._drain()
        await self._drain()

    async def _planned_bytes(self, slot: Slot) -> bytes | memoryview | None:
        """The bytes of the slot's planned version (the cache's, else the source's);
        None when that version is gone for good (the file deleted or changed). Other
        source errors (a timeout, EIO, a lapsed mount) raise: nothing is known then."""
        held = self._drop_held(slot.ino)
        if held is not None and self.versions.listed_entry(slot.ino, slot.ident) is not None:
            return held  # (its version still the listed one: else read as below)
        try:
            return await self.prefetcher.bytes_for(slot.ino, slot.ident)
        except (NotFound, SourceChanged):
            return None

    def _record_plan(self) -> None:
        """Thread: the epoch's chunk list in the index (the per-sample locations follow as
        chunks are sealed). Older epochs' lists of this stream are dropped."""
        import json  # noqa: PLC0415
        with self.index.write() as w:
            prefix = S.epoch_log_prefix(self.key)
            for k in w.meta_keys(prefix):
                if int(k[len(prefix):]) < self.epoch - 1:
                    w.delete_meta(k)
            w.set_meta(S.epoch_log_key(self.key, self.epoch), json.dumps(
                {"log": self.log_id, "chunks": [c.chunk_id for c in self.chunks],
                 "samples": len(self.slots)}).encode())

    # ----- threads --------------------------------------------------------------------

    def _write_slots(self, batch: list[tuple[Slot, bytes]]) -> None:
        logs = self.logs
        for slot, data in batch:
            if slot.filler:
                rec = filler_record(slot.rlen)
            else:
                rec = encode_record(RecordIn(slot.ino, slot.key, slot.ident.mtime_ns,
                                             slot.ident.src_ino, data))
            logs.pwrite(self.log_id, rec, slot.offset)

    async def _seal(self, c: PlannedChunk) -> None:
        if c.held != c.length or not all(sl.written for sl in c.slots):
            # a slot claimed twice, or one never written: its range would hold zeros, and
            # a checksum over them; such a chunk is never indexed (the log fails)
            raise DlcError(f"chunk {c.chunk_id}: {c.held} of {c.length} bytes reserved, "
                           f"{sum(not sl.written for sl in c.slots)} slots unwritten")
        dead = await self.writer.commit_external(c.length, self._seal_thread, c)
        c.sealed = True
        c.held = 0  # the reservations are chunk bytes now
        self.sealed += 1
        self.policy.on_insert(c.chunk_id, c.members(), c.length)
        self.counters.reorder_chunks += 1
        for old in dead:
            self.writer.retire_chunk(old, empty=True)
        if self.release_after_use and c.unread == 0:
            self.release(c.chunk_id)  # read whole before it was sealed (the boundary fill)

    def _punch(self, chunks: list[PlannedChunk]) -> None:
        """Thread: free the written slots of chunks that will never be indexed."""
        for c in chunks:
            self.logs.punch(self.log_id, c.offset, c.length)

    def _seal_thread(self, c: PlannedChunk) -> list[int]:
        payload_len = c.length - CHUNK_HEADER_SIZE
        payload = self.logs.read(self.log_id, c.offset + CHUNK_HEADER_SIZE, payload_len,
                                read_back=True)
        head = encode_chunk_header(c.chunk_id, len(c.slots), payload_len, checksum(payload))
        self.logs.pwrite(self.log_id, head, c.offset)
        self.logs.datasync(self.log_id)
        mv = memoryview(payload)
        recs = []
        for slot in c.slots:
            if slot.filler:
                continue
            data_off = slot.offset + RECORD_HEADER_SIZE + len(slot.key)
            rel = data_off - c.offset - CHUNK_HEADER_SIZE
            xxh = checksum(mv[rel : rel + slot.ident.size])
            recs.append(NewRecord(slot.ino, slot.ident, Record(
                c.chunk_id, self.log_id, data_off, slot.ident.size, xxh, slot.ident.mtime_ns,
                slot.ident.src_ino)))
        chunk = Chunk(c.chunk_id, self.log_id, c.offset, c.length, time.time_ns(),
                      c.members())
        # keep_indexed=False: moving each record into the next epoch's order is the point;
        # the chunks left without records are the caller's to retire (LCache line 16)
        sealed = seal_chunks(self.index, [NewChunk(chunk, recs)], keep_indexed=False,
                             new_log=self.log_id)
        self.logs.add_live(self.log_id, c.length)
        return sealed.dead
