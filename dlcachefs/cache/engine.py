"""The read path: what an open, a read and a release of a mirrored file do. No FUSE in
here, and no part that works in the background: those are built by the composition root
(:mod:`dlcachefs.session`) and reached through the small Protocols of
:mod:`dlcachefs.cache.readers` (the readers' streams, and the events the read path tells
them).

Read path of one file (``open`` does the work, ``read`` only slices):

1. the namespace entry, revalidated against the source when the rule says so
   (:mod:`dlcachefs.cache.namespace`);
2. bytes read ahead for this open (:class:`~dlcachefs.cache.buffers.ReadAhead`);
3. the index record, if it holds the entry's version (:mod:`dlcachefs.cache.versions`):
   the bytes come from a read plan of the stream's epoch (:mod:`dlcachefs.cache.readplan`),
   or from the memory tier or the log (:mod:`dlcachefs.cache.reader`);
4. a record that is stale or fails its checksum is dropped and counted, never served;
5. bytes fetched but not sealed yet (the writer's pending records, the backlog);
6. otherwise the file is fetched whole (:mod:`dlcachefs.cache.fetch`): from the peer
   tier when ``--peers`` names one, else from the source, served, and handed to the chunk
   writer (:mod:`dlcachefs.cache.writer`).

Under ``--substitute`` a missed L-sample may be served with another sample first
(:mod:`dlcachefs.cache.substitute`). Each open is told to the observers
(:class:`~dlcachefs.cache.readers.OpenObserver`: the streams, the read planner,
scan-ahead, the trace) before its bytes are looked for, and how it was served after.

Concurrency rules: all engine state lives on the trio loop and is touched only there.
Source calls run in worker threads under the source limiter (``--source-threads``,
:class:`~dlcachefs.cache.fetch.SourceCalls`); log reads and checksums of whole chunks in
worker threads under the disk limiter (a read plan's batch: one hop). The chunk writer's
commits run in its own thread of one (see :mod:`dlcachefs.cache.writer`). LMDB read
transactions run on the loop (microseconds); LMDB write transactions only in threads.
The engine's own background tasks (the writer, the fetcher's hand-overs, the policy's
steps, LMDB reader slots, idle descriptors) run in :meth:`Engine.run`'s nursery.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import trio

from dlcachefs.cache.buffers import Backlog, ReadAhead
from dlcachefs.cache.fetch import Fetcher, SourceCalls
from dlcachefs.cache.invariants import check_cache
from dlcachefs.cache.memtier import MemoryTier
from dlcachefs.cache.namespace import Namespace, identity, is_file
from dlcachefs.cache.policy import CachingPolicy
from dlcachefs.cache.reader import LogReader
from dlcachefs.cache.readers import OpenEvent, OpenObserver, Readers, ReaderStream, Served
from dlcachefs.cache.readplan import ReadPlanner
from dlcachefs.cache.source import (
    DirDescriptors,
    Identity,
    LocalSource,
    Source,
    open_for_range_reads,
    pread_checked,
)
from dlcachefs.cache.stats import Counters
from dlcachefs.cache.substitute import Substitution
from dlcachefs.cache.versions import Versions
from dlcachefs.cache.views import PolicyClock
from dlcachefs.cache.writer import ChunkWriter
from dlcachefs.config import Config
from dlcachefs.errors import InvalidArgument, SourceChanged
from dlcachefs.store.index import Index
from dlcachefs.store.integrity import log_failure, note_error
from dlcachefs.store.logs import LogStore
from dlcachefs.store.schema import Entry, Record

log = logging.getLogger(__name__)

#: how often dead processes' LMDB reader slots are freed (Engine._reap_readers)
READER_REAP_S = 30.0


#: the owner, in the read-ahead set, of the bytes of files the kernel READ only in part
#: (kept for the open that follows: Engine.release)
RELEASED_OWNER = "released"


@dataclass(slots=True)
class Handle:
    """An open file. ``data`` is one consistent version of the whole file, or None for a
    read-through handle (files larger than ``max_cached_file``), which keeps ``fd``, or
    for a cached file not loaded yet (``rec`` set: loaded at its first READ, which never
    comes when the kernel's page cache holds the file)."""

    ino: int
    data: memoryview | None
    cached: bool
    fd: int = -1
    ident: Identity | None = None
    paged: bool = False  # its READs fill the kernel's page cache (no direct_io): each
                         # checks first that no newer version is known (_same_version)
    rec: Record | None = None  # the cached version's record, for a lazy handle
    whole: bool = True  # a lazy handle's load may read the record's whole chunk
    filling: trio.Event | None = None  # set when its fill ended (concurrent READs: one)
    stream: ReaderStream | None = None  # a cached file's stream: its READs are counted there
    page_count: int = 0  # ... in this epoch's count of it (Stream.page_count)
    cache_refetch: bool = True  # a lazy handle's refetch may be cached (not memory-only)
    seen: int = 0  # Namespace.changes when it opened (a paged handle's version check)
    was_read: bool = False  # a READ came (else the kernel's pages served the open); for
                            # a lazy handle: its fill counted its hit or miss
    first_open: bool = False  # no earlier open of its file in this mount: the kernel
                              # holds none of its pages
    read_end: int = 0  # the end of the furthest READ of its bytes
    keep_partial: bool = True  # READ in part only, its bytes are kept for the next open
                               # (not for an epoch read from its own laid-out log)


class InoBits:
    """A set of inode numbers as a bitmap (1.28M files: 160 KB, where a set of ints
    takes ~70 MB). Inode numbers are small: the index hands them out in sequence."""

    def __init__(self) -> None:
        self._bits = bytearray()

    def add(self, ino: int) -> bool:
        """Add ``ino``; True if it was not in the set."""
        i, bit = ino >> 3, 1 << (ino & 7)
        if i >= len(self._bits):
            self._bits.extend(bytes(max(i + 1 - len(self._bits), len(self._bits))))
        if self._bits[i] & bit:
            return False
        self._bits[i] |= bit
        return True


@dataclass(slots=True)
class OpenResult:
    fh: int
    keep_cache: bool
    direct_io: bool
    #: the entry of the version the handle serves (its size is what the kernel must hold)
    entry: Entry | None = None


class Engine:
    """Opens, reads and releases mirrored files over the parts of the read path, which
    the composition root (:func:`dlcachefs.session.build`) makes and hands it."""

    def __init__(self, cfg: Config, *, source: Source, index: Index, logs: LogStore,
                 counters: Counters, calls: SourceCalls, ns: Namespace, policy: CachingPolicy,
                 clock: PolicyClock, memtier: MemoryTier, writer: ChunkWriter,
                 backlog: Backlog, readahead: ReadAhead, versions: Versions,
                 reader: LogReader, fetcher: Fetcher, substitution: Substitution,
                 plans: ReadPlanner, readers: Readers, observers: OpenObserver) -> None:
        """``policy`` is the caching policy the writer and the reader consult too;
        ``clock`` the policy's clock (one tick per open); ``plans`` the read plans of
        known orders (their bytes are taken at open); ``readers`` answers which stream an
        open belongs to; ``observers`` hear every open (see the module docstring)."""
        self.cfg = cfg
        self.source = source
        self.index = index
        self.logs = logs
        self.counters = counters
        self.calls = calls  # every call on the source (limiter, timeout, retries)
        self.ns = ns
        self.policy = policy
        self.clock = clock
        self.memtier = memtier
        self.writer = writer
        self.backlog = backlog  # fetched bytes waiting for the writer's room
        self.readahead = readahead  # fetched or loaded bytes waiting for their opens
        self.versions = versions
        self.reader = reader
        self.fetcher = fetcher
        self.substitution = substitution
        self.plans = plans
        self.readers = readers
        self.observers = observers
        self.handles: dict[int, Handle] = {}
        self._opened = InoBits()  # files opened in this mount (Handle.first_open)
        self._next_fh = 1

    # ----- life cycle ----------------------------------------------------------------

    def check_invariants(self) -> list[str]:
        """Violated invariants of the cache, as readable lines (empty when all hold); see
        :mod:`dlcachefs.cache.invariants`. Trio loop."""
        return check_cache(self.writer, self.index, self.logs, self.writer.limit)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The read path's background tasks (the chunk writer, the fetcher's hand-overs,
        the policy's steps, the upkeep of LMDB reader slots and idle descriptors), until
        cancelled."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.writer.run)
            await nursery.start(self.fetcher.run)
            nursery.start_soon(self._maintain_policy)
            nursery.start_soon(self._reap_readers)
            nursery.start_soon(self._let_idle_things_go)
            task_status.started()

    async def _maintain_policy(self) -> None:
        """The policy's background steps (iCACHE's shadow heap), between requests. A
        policy that fails here is logged, never the end of the mount."""
        while True:
            try:
                while self.policy.maintain():
                    await trio.sleep(0)
            except Exception:  # noqa: BLE001 - third-party policies run here too
                log_failure(log, "policy %s: background step failed", self.cfg.policy)
                await trio.sleep(10)
            await trio.sleep(0.2)

    async def _reap_readers(self) -> None:
        """Free, now and then, the LMDB reader slots of zero-copy reading processes that
        died with the index open (killed DataLoader workers): the table is bounded
        (:data:`~dlcachefs.store.schema.MAX_READERS`) and a full one fails every read
        transaction, ours too. A thread: it scans the lock table."""
        while True:
            await trio.sleep(READER_REAP_S)
            try:
                n = await trio.to_thread.run_sync(self.index.reap_readers)
            except Exception as e:  # noqa: BLE001 - an LMDB error here must not end the mount
                note_error(e)
                log.warning("freeing dead readers' LMDB slots failed: %s", e)
                continue
            if n:
                log.info("freed %d LMDB reader slots of processes that died", n)

    async def _let_idle_things_go(self) -> None:
        """Close the source directory descriptors kept for fetches once they expire, so
        that an idle daemon holds none (``LocalSource.drop_idle``: O_PATH closes under a
        lock held for microseconds, cheap enough for the loop), and let go of
        scan-ahead's spares held too long (``ReadAhead.drop_old_spares``)."""
        while True:
            await trio.sleep(DirDescriptors.TTL_S)
            if isinstance(self.source, LocalSource):
                self.source.drop_idle()
            self.readahead.drop_old_spares()

    async def flush(self) -> None:
        """Seal everything fetched so far, the files still waiting for the writer's room
        included (tests, and an orderly unmount)."""
        await self.backlog.drained()
        await self.writer.flush()

    async def close(self) -> None:
        """Seal and commit what is pending (for up to 10 s), and stop the writer. A seal
        that fails here (a full disk, a damaged index: :func:`log_failure` tells them
        apart) costs only what was not committed yet, fetched again later; the stop goes
        on (after damage it leaves no clean marker, see :mod:`dlcachefs.store.integrity`)."""
        with trio.move_on_after(10):  # what readers were served is worth keeping
            try:
                await self.flush()
            except Exception:  # noqa: BLE001 - the unmount must end, and cleanly
                log_failure(log, "sealing at the stop failed; what it held is not cached")
        await self.writer.close()

    def close_files(self) -> None:
        """Release descriptors and the index (after :meth:`close`, off the loop is fine)."""
        for h in self.handles.values():
            if h.fd >= 0:
                os.close(h.fd)
        self.handles.clear()
        self.logs.close()
        self.index.close()

    # ----- open / read / release -----------------------------------------------------

    async def open(self, ino: int, pid: int = 0) -> OpenResult:
        """Open a file for reading; ``pid`` attributes the read to a stream."""
        stream = self.readers.stream_of(pid) if pid else None
        t0 = time.monotonic()
        e = await self.ns.fresh_file(ino)
        seen = self.ns.changes  # a change noticed from here on may be newer than e
        first_open = self._opened.add(ino)
        if not is_file(e):
            raise InvalidArgument("not a regular file")
        ev = OpenEvent(ino, pid, e.parent, t0, stream)
        self.observers.opened(ev)
        if e.size > self.cfg.max_cached_file:
            return await self._open_read_through(e, seen)
        self.clock.tick += 1
        self.policy.on_request(ino)
        if stream is not None and self.cfg.substitute:
            sub = await self.substitution.serve(e, stream)
            if sub is not None:
                # the kernel knows the requested file's size: direct_io so the substitute's
                # own length is what the reader gets (a short read is its end of file)
                fh = self._new_fh(Handle(e.ino, sub, True))
                return OpenResult(fh, keep_cache=False, direct_io=True, entry=e)
        lazy = self._lazy_open(e, stream, seen)
        if lazy is not None:
            if stream is not None:
                lazy.page_count = stream.note_cached_open()
                lazy.stream = stream
                lazy.keep_partial = stream.current_log is None
                lazy.cache_refetch = not stream.memory_prefetch
                self.observers.served(ev, Served(None, lazy.ident, True))
            return OpenResult(self._new_fh(lazy), keep_cache=True, direct_io=False, entry=e)
        data, cached, waited, joined, got = await self._load(
            e, cache=stream is None or not stream.memory_prefetch, stream=stream)
        # the version of the bytes (a fetch joined may have read an older one)
        self.observers.served(ev, Served(data, identity(got), cached, waited, joined))
        # keep_cache only for bytes we know are this version and when the kernel cannot
        # hold pages of an older one (the file did not change during this mount); the
        # mount layer may give a first open's pages to the kernel and keep them
        # (pages_for_kernel: the kernel holds no page of a file never opened)
        changed = self._bypass_pages(ino)
        h = Handle(ino, memoryview(data), cached, first_open=first_open,
                   keep_partial=stream is None or stream.current_log is None)
        if not changed:
            # its READs fill the kernel's pages, shared with every open of the file: each
            # checks first that no newer version is known, as a lazy handle's do; a
            # miss's too (an older open's READs must not refill, with the old bytes, the
            # pages a newer open dropped)
            h.ident, h.paged, h.seen = identity(got), True, seen
        if cached and not changed and stream is not None:
            # counted even when a next-epoch log took the bytes at open (never lazy
            # then): an epoch the kernel's pages served lays out no next log
            # (StreamTable._plan_next), and the one after opens lazily
            h.page_count = stream.note_cached_open()
            h.stream = stream
        fh = self._new_fh(h)
        # a file that changed during the mount: its first open bypasses the page cache
        # (direct_io), since the kernel's idea of its size may be the old one until the
        # invalidation queued for it has gone through
        if identity(got) != identity(e):  # a newer version came with the fetch: its entry
            e = got
        return OpenResult(fh, keep_cache=cached and not changed, direct_io=changed, entry=e)

    def _bypass_pages(self, ino: int) -> bool:
        """Whether an open of ``ino`` must bypass the kernel's pages (direct_io, and
        ``keep_cache`` off, which drops them): the kernel may hold attributes or pages of
        another version (:attr:`Namespace.changed`, kept until the mount layer's
        invalidation went through). Without a mount layer (no kernel to tell) the
        open itself is the last one to bypass them."""
        if ino not in self.ns.changed:
            return False
        if self.ns.on_invalidate is None:
            del self.ns.changed[ino]
        return True

    def _lazy_open(self, e: Entry, stream: ReaderStream | None, seen: int) -> Handle | None:
        """A handle that loads the cached file at its first READ, or None to load it now.

        With ``keep_cache`` the kernel serves a file whose pages it still holds without
        any READ: loading it at open would read it from the cache disk for nothing (a
        ``cat`` pass over a dataset that fits in RAM read the whole cache back each time).
        Only for a current record that nothing else at open needs: not a file fetched
        ahead, nor one whose record the read plan holds or is reading (their bytes are in
        memory already and must be taken), not one whose slot in the next epoch's log is
        still to be written from the bytes its open is served (any stream's next
        log; nor any open of a stream that reads its own laid-out log while writing the
        next), not a file that changed
        during the mount (direct_io: its READs always come). A sample of a planned epoch
        that the plan does not hold (opened again in the epoch, its bytes handed to the
        first open; or the reader got ahead of the plan) is lazy too: a loader that opens
        each sample twice (the raw bytes, then PIL) read every record twice from the
        cache disk, once for pages the kernel already had. A sample of an epoch read
        record by record (``plans.reads_records``) never has its whole chunk read for one
        READ."""
        ino = e.ino
        if ino in self.ns.changed or ino in self.readahead:
            return None
        if self.readers.wanted_by_next_log(ino):
            return None  # (a slot of any stream's next log)
        if stream is not None:
            if stream.next_log is not None and stream.current_log is not None:
                # (an epoch read from its own laid-out log loads at open: its chunks are
                # read ahead in order, and a lazy READ would read a record alone)
                return None
            cur = stream.current_log
            if cur is not None and cur.release_after_use:
                # LCache releases a chunk at the open of its last record: a READ after
                # that would find it evicted (and fetch the sample again)
                return None
            plan = self.plans.plan_for(stream)
            if plan is not None and plan.covers(ino) and plan.holds(ino):
                return None
        ident = identity(e)
        rec = self.index.get_record(ino)
        if not self.versions.is_current(ino, rec, ident):
            return None
        assert rec is not None
        whole = self.plans.reads_whole(stream, ino, rec)
        return Handle(ino, None, True, ident=ident, paged=True, rec=rec, whole=whole,
                      seen=seen)

    async def _fill(self, h: Handle) -> memoryview:
        """First READ of a lazy handle: its version's bytes from the cache, else (evicted,
        dropped or unreadable since the open) from the source, that version only."""
        assert h.ident is not None and h.rec is not None
        # the index's record now, if it is still this version: the one seen at open, or
        # where the same version moved since (a reordered log took it). Never a record
        # the index no longer holds: a damaged copy of it would be dropped as the file's
        # record (read_record's bad()), which may be the good moved one by then.
        rec = self.index.get_record(h.ino)
        data = None
        if self.versions.is_current(h.ino, rec, h.ident):
            assert rec is not None
            data = await self.reader.read_record(h.ino, rec, whole=h.whole)
        if data is not None:
            self.counters.hits += 1
            return data
        unsealed = self.versions.unsealed(h.ino, h.ident)
        if unsealed is not None:
            self.counters.hits += 1
            return memoryview(unsealed)
        e = self.index.get_entry(h.ino)
        if e is None or identity(e) != h.ident:
            raise SourceChanged("the file changed on the source while it was open")
        data, got = await self.fetcher.fetch_for_reader(e, h.cache_refetch)  # a miss after all
        if identity(got) != h.ident or identity(self.index.get_entry(h.ino) or e) != h.ident:
            raise SourceChanged("the file changed on the source while it was open")
        self.counters.lazy_refetches += 1
        h.cached = False  # its READs count as bytes from the source (the fetch did)
        return memoryview(data)

    async def _load(self, e: Entry, cache: bool = True, stream: ReaderStream | None = None
                    ) -> tuple[bytes | memoryview, bool, bool, bool, Entry]:
        """Bytes of the current version of ``e``, whether they came from the cache,
        whether the open had to wait for the source, whether it waited for a fetch
        that was under way already, and the entry of the bytes' version (``e``, or a
        newer one a fetch found). An open of a ``stream`` whose epoch
        is read through a plan takes the plan's bytes, or reads the record alone."""
        ident = identity(e)
        rec = self.index.get_record(e.ino)
        early = self.readahead.take(e.ino)
        if early is not None and early.ident == ident and early.rec is None:
            # cached or not is asked now, not taken from when it was fetched: a prefetch
            # whose bytes waited in the backlog for the writer's room did not know yet
            if self.versions.is_current(e.ino, rec, ident):
                assert rec is not None  # fetched ahead and sealed since: a hit
                self.counters.hits += 1
                self.reader.after_use(rec.chunk_id, e.ino)
                return early.data, True, False, False, e
            if self.versions.unsealed(e.ino, ident) is not None:
                self.counters.hits += 1  # fetched ahead, still waiting for the writer
                return early.data, True, False, False, e
            # fetched ahead, kept in memory only (or its record has gone since)
            self.counters.prefetch_hits += 1
            return early.data, False, False, False, e
        if self.versions.is_current(e.ino, rec, ident):
            assert rec is not None
            if early is not None and early.rec == rec:
                self.counters.hits += 1
                self.reader.after_use(rec.chunk_id, e.ino)
                return early.data, True, False, False, e
            plan = self.plans.plan_for(stream)
            if plan is not None and not plan.covers(e.ino):
                plan = None
            if plan is not None:
                data = await plan.take(e.ino, rec)
                if data is not None:
                    self.counters.hits += 1
                    self.counters.planned_hits += 1
                    self.reader.after_use(rec.chunk_id, e.ino)
                    return data, True, False, False, e
            whole = plan is None and self.plans.reads_whole(stream, e.ino, rec)
            data = await self.reader.read_record(e.ino, rec, whole=whole)
            if data is not None:
                self.counters.hits += 1
                return data, True, False, False, e
        elif self.versions.is_stale(e.ino, rec, ident):
            self.counters.stale_refetches += 1
            self.writer.drop(e.ino)
        unsealed = self.versions.unsealed(e.ino, ident)
        if unsealed is not None:  # fetched, waiting for the writer (or its room)
            self.counters.hits += 1
            return unsealed, True, False, False, e
        # a prefetch may be on it: the reader then waits for it (a miss all the same;
        # joined: its bytes are counted where that fetch began, not again here)
        joined = self.fetcher.in_flight(e.ino)
        data, got = await self.fetcher.fetch_for_reader(e, cache)
        return data, False, True, joined, got

    async def read(self, fh: int, offset: int, size: int) -> bytes | memoryview:
        """Up to ``size`` bytes of an open file at ``offset``."""
        h = self.handles.get(fh)
        if h is None:
            raise InvalidArgument("bad file handle")
        h.was_read = True
        if h.stream is not None:  # its first READ: the kernel's pages did not serve it
            h.stream.note_cached_read(h.page_count)
            h.stream = None
        while h.data is None and h.rec is not None:
            # one fill at a time per handle; no lock: an uncontended trio.Lock costs two
            # checkpoints (trips through the scheduler) on every first READ
            ev = h.filling
            if ev is None or ev.is_set():  # none yet, or the last one failed: fill
                h.filling = ev = trio.Event()
                try:
                    h.data = await self._fill(h)
                finally:
                    ev.set()
            else:
                await ev.wait()
        if h.data is not None:
            self._same_version(h)  # (a page-cache handle: see there)
            out = h.data[offset : offset + size]
            h.read_end = max(h.read_end, offset + len(out))
            if h.cached:
                self.counters.bytes_from_cache += len(out)
            return out
        data = await self.calls.call(pread_checked, h.fd, offset, size, h.ident,
                                     self.cfg.use_source_inode)
        # checked once the bytes are read, just before the kernel gets them: a newer open
        # may have seen a change while the read was in flight
        self._same_version(h)
        self.counters.bytes_from_source += len(data)
        return data

    def _same_version(self, h: Handle) -> None:
        """The kernel's pages of a file are shared by every open of it: a page-cache
        handle of an older version (its descriptor still reads that version) must not
        fill them once a newer one is known, or a newer open would be served a mix.
        (A file gone from the listing is no such case: inode numbers are never reused,
        so no newer open shares its pages, and its open descriptor reads on.)"""
        if h.paged and h.seen != self.ns.changes:  # (no change seen: none is newer)
            cur = self.index.get_entry(h.ino)
            if cur is not None and identity(cur) != h.ident:
                raise SourceChanged("the file changed on the source while it was open")

    def pages_for_kernel(self, fh: int) -> memoryview | None:
        """The bytes of open file ``fh`` that the kernel's page cache may take with its
        open (``--store-pages``): the whole file, held in memory by the open already (a
        miss just fetched, a file fetched ahead or planned), of the version the open
        serves. None for a handle that loads at its first READ or reads through, above
        the size bound, or whose version is no longer the current one (its pages are
        shared with newer opens: see :meth:`_same_version`). Call it in the same step as
        :meth:`open` returned (no await between): the check holds for that moment.

        Only at the file's first open in this mount (an open that did not even get
        that far counts as one): the kernel then holds no page of it, so the pages
        given are all it has (stored pages raise the kernel's size, never cut it: at a
        later open, pages of an older, longer version past the end could stay, and an
        opener given the new bytes read the old tail). And a cached file's later opens
        are how a stream learns that the page cache serves its epochs (whether READs
        come): giving the pages then would hide it, and the logs would be read for
        nothing. Substituted and read-through handles never hold their own file's
        bytes at a first open (``first_open`` is False)."""
        h = self.handles.get(fh)
        if (h is None or h.data is None or not h.first_open or not h.paged
                or not 0 < len(h.data) <= self.cfg.store_pages):
            return None
        try:
            self._same_version(h)
        except SourceChanged:
            return None
        return h.data

    def note_bypassing(self, fh: int) -> None:
        """The mount layer answered open ``fh`` with direct_io (another version of the
        file is open there): its READs fill no page, so they need no version check, and
        they say nothing of whether the page cache serves its stream."""
        h = self.handles.get(fh)
        if h is not None:
            h.paged = False
            h.stream = None

    def note_pages_stored(self, fh: int) -> None:
        """The kernel took the open's bytes (:meth:`pages_for_kernel`): counted as its
        READs would have been; a cached file's stream learns that this open was served
        by the daemon, not by pages the kernel still held (its page-cache verdict)."""
        h = self.handles.get(fh)
        if h is None or h.data is None:
            return
        h.was_read = True
        if h.stream is not None:
            h.stream.note_cached_read(h.page_count)
            h.stream = None
        if h.cached:
            self.counters.bytes_from_cache += len(h.data)
        self.counters.pages_stored += 1

    def release(self, fh: int) -> None:
        """Close an open file."""
        h = self.handles.pop(fh, None)
        if h is None:
            return
        if h.fd >= 0:
            os.close(h.fd)
        if h.stream is not None:  # counted for its stream's verdict, and no READ came
            h.stream.note_unread(h.page_count)
            h.stream = None
        if (h.data is not None and h.was_read and h.cached and h.paged and h.keep_partial
                and h.ident is not None and 0 < h.read_end < len(h.data)
                and len(h.data) <= self.readahead.limit // 4
                and h.ino not in self.readahead and self.readahead.has_room(len(h.data))):
            # the kernel READ only the head of the file (a header check: the reader's
            # 16 bytes and the kernel's read-ahead around them): the open that follows
            # to read it all takes these bytes, not its record from the cache disk again
            # (a small file: a quarter of the read-ahead set at most). Not in an epoch
            # read from its own laid-out log: its chunks are read ahead in order, and
            # a loader's partial reads (PIL stops at a JPEG's end marker) would keep
            # most files of the epoch in memory a second time.
            # A spare: the first to go when room is wanted, and after a minute. A copy:
            # the view may be of a larger buffer (a read plan's batch) it would keep.
            self.readahead.put(h.ino, h.ident, None, bytes(h.data), RELEASED_OWNER,
                               cached=True, spare=True)
        if h.cached and not h.was_read and h.paged:
            self.counters.page_cache_opens += 1
        if h.rec is not None and not h.was_read:
            # served by the kernel's pages alone: a hit, and its use still counts for the
            # policy (recency, LCache's release after use), as a loaded record's does
            self.counters.hits += 1
            self.reader.after_use(h.rec.chunk_id, h.ino)
        self.observers.released(h.ino, h.was_read)

    def _new_fh(self, h: Handle) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = h
        return fh

    async def _open_read_through(self, e: Entry, seen: int) -> OpenResult:
        if not isinstance(self.source, LocalSource):
            raise InvalidArgument("file too large to cache and the source has no ranged reads")
        rel = self.ns.path_of(e)
        fd, ident = await self.calls.call(open_for_range_reads, self.source, rel,
                                          self.cfg.use_source_inode)
        if ident != identity(e):
            e = await self.ns.note_identity(e, ident)
        self.counters.misses += 1
        self.counters.read_through += 1
        # Through the page cache, not direct_io: the kernel refuses mmap of a direct_io
        # file (ENODEV), and large files are what people map (numpy memmaps, shards);
        # readahead helps their sequential reads too. keep_cache=False drops pages of an
        # earlier open, and every range read is checked against the opened version. As
        # in open(): the first open after a change during the mount is direct_io (the
        # kernel may still hold the old size, and would cut reads at it).
        changed = self._bypass_pages(e.ino)
        return OpenResult(self._new_fh(Handle(e.ino, None, False, fd, ident,
                                              paged=not changed, seen=seen)),
                          keep_cache=False, direct_io=changed, entry=e)

