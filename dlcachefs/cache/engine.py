"""The cache engine: what an open and a read of a mirrored file do, and the wiring of
the parts that do the work. No FUSE in here.

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
   tier when ``--peers`` names one (:mod:`dlcachefs.peers.tier`), else from the source,
   served, and handed to the chunk writer (:mod:`dlcachefs.cache.writer`).

Under ``--substitute`` a missed L-sample may be served with another sample first
(:mod:`dlcachefs.cache.substitute`). Work ahead of readers is in
:mod:`dlcachefs.cache.prefetch` (known orders), :mod:`dlcachefs.cache.scanahead` (unknown
orders) and :mod:`dlcachefs.clairvoyance.reorder` (the next epoch's log); start-up in
:mod:`dlcachefs.cache.recovery`; losses in :mod:`dlcachefs.importance.losses`; the stats
document in :mod:`dlcachefs.cache.stats`.

The background parts scan-ahead, the packer and read plans are given this engine and use
only the members their module declares in a Protocol (``ScanEngine``, ``PackerEngine``,
``PlanEngine``): all of them public attributes listed in :meth:`Engine.__init__`. The
streams (:mod:`dlcachefs.clairvoyance.streams`) and their next-epoch logs are given
their collaborators in their constructors.

Concurrency rules: all engine state lives on the trio loop and is touched only there.
Source calls run in worker threads under the source limiter (``--source-threads``,
:class:`~dlcachefs.cache.fetch.SourceCalls`); log reads and checksums of whole chunks in
worker threads under ``disk_limiter`` (a read plan's batch: one hop). The chunk writer's
commits run in its own thread of one (see :mod:`dlcachefs.cache.writer`). LMDB read
transactions run on the loop (microseconds); LMDB write transactions only in threads.
Every background task belongs to a nursery of :meth:`Engine.run` (each part owns its
own, started there).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import trio

from dlcachefs.cache.buffers import LATER_CHUNKS, Backlog, ReadAhead
from dlcachefs.cache.dedup import ContentStore
from dlcachefs.cache.fetch import Fetcher, SourceCalls
from dlcachefs.cache.invariants import check_cache
from dlcachefs.cache.memlimit import cgroup_limit, current_rss, fit
from dlcachefs.cache.memtier import MemoryTier
from dlcachefs.cache.namespace import Namespace, identity, is_file
from dlcachefs.cache.ownerfetch import OwnerPrefetch
from dlcachefs.cache.policy import CachePolicy, PolicyContext
from dlcachefs.cache.prefetch import Prefetcher
from dlcachefs.cache.reader import LogReader
from dlcachefs.cache.readplan import ReadPlanner
from dlcachefs.cache.recovery import check_source, recover
from dlcachefs.cache.scanahead import ScanAhead
from dlcachefs.cache.shares import ShareKeeper
from dlcachefs.cache.source import (
    DirDescriptors,
    Identity,
    LocalSource,
    Source,
    open_for_range_reads,
    pread_checked,
)
from dlcachefs.cache.stats import Counters, stats_document
from dlcachefs.cache.substitute import Substitution
from dlcachefs.cache.versions import Versions
from dlcachefs.cache.views import IndexCacheView, InodeImportance, PolicyClock
from dlcachefs.cache.writer import ChunkWriter
from dlcachefs.clairvoyance.attribution import Attribution
from dlcachefs.clairvoyance.control import ControlState
from dlcachefs.clairvoyance.future import StreamFuture
from dlcachefs.clairvoyance.listings import SampleLists
from dlcachefs.clairvoyance.nextepoch import NextEpochPlanner
from dlcachefs.clairvoyance.prefetchloop import LEAD, PrefetchLoop, stream_lead_bytes
from dlcachefs.clairvoyance.reorder import NextEpochLog
from dlcachefs.clairvoyance.stream import StreamTable
from dlcachefs.clairvoyance.streams import Stream, StreamManager
from dlcachefs.config import Config
from dlcachefs.errors import InvalidArgument, SourceChanged
from dlcachefs.importance.losses import Losses
from dlcachefs.importance.packer import Packer
from dlcachefs.sim.tracelog import TraceRecorder
from dlcachefs.store.index import Index
from dlcachefs.store.logs import LogStore
from dlcachefs.store.schema import Entry, Record
from dlcachefs.store.tally import TALLY_DIR, TallyReader

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
    stream: Stream | None = None  # a cached file's stream: its READs are counted there
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
    """Opens, reads and releases mirrored files; owns and wires the cache's parts."""

    def __init__(self, cfg: Config, source: Source | None = None, *,
                 policy: Callable[[PolicyContext], CachePolicy]) -> None:
        """``policy`` makes the caching policy from the engine's views (a policy class, or
        :func:`dlcachefs.session.policy_factory` of ``cfg.policy``); the engine never looks
        policies up by name (the composition root, :mod:`dlcachefs.session`, does)."""
        self.cfg = cfg
        self.source = source if source is not None else LocalSource(cfg.source)
        os.makedirs(cfg.data_dir, exist_ok=True)
        self.index = Index(cfg.index_dir)
        self.logs = LogStore(cfg.logs_dir, cfg.log_size)
        self.counters = Counters()
        # container-aware: --memory, read-ahead and the backlog fit the memory cgroup's limit
        self.memory = fit(cfg.memory, cfg.chunk_size, LATER_CHUNKS * cfg.chunk_size,
                          cgroup_limit(), current_rss())
        if self.memory.reason:
            log.warning("%s", self.memory.reason)
        # every call on the source goes through this one wrapper (limiter, timeout, retries)
        self.calls = SourceCalls(self.source, cfg, self.counters)
        self.disk_limiter = trio.CapacityLimiter(4)
        self.ns = Namespace(self.index, self.calls, revalidate=cfg.revalidate,
                            use_src_ino=cfg.use_source_inode)
        # the streams of readers by (job, rank): the stream manager's, read by the
        # policy's future, counted in ticks of the policy's clock (one per open)
        stream_table = StreamTable()
        self.clock = PolicyClock()
        # what the policy sees: chunks from the index, the streams' future, the losses
        self.future = StreamFuture(stream_table, self.clock)
        self.importance = InodeImportance()
        # the policy sees the writer's limit (a shared root's share moves at run time)
        self.policy = policy(PolicyContext(
            IndexCacheView(self.index, self._cache_limit), self.future, self.importance))
        self.memtier = MemoryTier(self.memory.memory)
        # --shared-cache: units cut for the smallest share a dataset may get (a 32nd of
        # the budget when the floor is smaller: units of a few KiB would cost more)
        basis = (max(int(cfg.cache_size * cfg.share_floor), cfg.cache_size // 32, 4096)
                 if cfg.shared_cache else None)
        self.writer = ChunkWriter(cfg, self.index, self.logs, self.policy, self.memtier,
                                  self.counters, unit_basis=basis)
        if cfg.debug_invariants:
            self.writer.after_commit = self._after_commit
        # iCACHE's dynamic packaging fills the L-cache when substitution is on (and the
        # policy plans packages at all)
        plans = type(self.policy).plan_package is not CachePolicy.plan_package
        self.packer = Packer(self) if cfg.substitute and plans else None
        self.trace = TraceRecorder(cfg.trace) if cfg.trace else None
        # zero-copy readers' counts (dlcachefs.data): their files' counts at start are the base
        self.zerocopy = TallyReader(os.path.join(cfg.data_dir, TALLY_DIR))
        # fetched bytes held in memory: waiting for the writer's room; read ahead of opens
        self.backlog = Backlog(self.memory.backlog)
        self.readahead = ReadAhead(self.memory.readahead)
        self.versions = Versions(self.index, self.writer, self.backlog)
        self.reader = LogReader(self.index, self.logs, self.memtier, self.writer, self.policy,
                                self.counters, self.disk_limiter, self.readahead)
        # the cluster's shared tier (--peers): pymemcache is imported only then
        self.peers = None
        if cfg.peers is not None:
            from dlcachefs.peers.tier import PeerTier  # noqa: PLC0415 - optional dependency
            self.peers = PeerTier(cfg, self.source.root)
            if cfg.peer_keep:  # keep the last copy in the cluster (Lobster 4.4)
                self.writer.keeper = self.peers
            self.peers.expiry_of = self.peer_expiry
        self.fetcher = Fetcher(cfg, self.calls, self.ns, self.writer, self.policy,
                               self.versions, self.backlog, self.counters, self.peers)
        # --peer-self: this node fetches ahead the files it owns in the cluster's order
        self.owner_prefetch = (OwnerPrefetch(self) if self.peers is not None
                               and cfg.peer_self is not None else None)
        # planned reads of known orders (issue 9): half of --memory, taken from the tier
        self.plans = ReadPlanner(self, min(self.memory.memory // 2, stream_lead_bytes(cfg)),
                                 lead=LEAD, max_batch=max(4 << 20, 2 * cfg.chunk_size))
        self.prefetcher = Prefetcher(
            cfg, ns=self.ns, versions=self.versions, fetcher=self.fetcher,
            reader=self.reader, writer=self.writer, policy=self.policy, backlog=self.backlog,
            readahead=self.readahead, plans=self.plans, counters=self.counters)
        self.substitution = Substitution(
            cfg, index=self.index, ns=self.ns, versions=self.versions, fetcher=self.fetcher,
            reader=self.reader, readahead=self.readahead, policy=self.policy,
            packer=self.packer, counters=self.counters)
        next_log = partial(NextEpochLog, cfg=cfg, index=self.index, logs=self.logs,
                           writer=self.writer, policy=self.policy, counters=self.counters,
                           disk_limiter=self.disk_limiter, versions=self.versions,
                           prefetcher=self.prefetcher)
        self.streams = StreamManager(
            cfg, stream_table, attribution=Attribution(stream_table),
            lists=SampleLists(self.ns, self.index, stream_table),
            planner=NextEpochPlanner(cfg, stream_table, self.ns, self.writer, self.memtier,
                                     self.zerocopy, next_log),
            prefetch=PrefetchLoop(self.ns, self.readahead, self.memtier, self.prefetcher,
                                  lead_bytes=stream_lead_bytes(cfg),
                                  concurrency=cfg.source_threads),
            plans=self.plans, readahead=self.readahead, ns=self.ns, clock=self.clock,
            # the losses hear of epochs and dropped jobs, and ask the streams for sample
            # lists: built after the streams, reached at call time
            on_epoch=lambda s, samples: self.losses.epoch_started(s, samples),
            on_job_dropped=lambda job: self.losses.forget_job(job))
        self.ns.on_removed = self.streams.note_gone
        if not self.memory.replay_worker:
            log.warning("%s", self.memory.replay_reason)
            self.streams.replay.disable(self.memory.replay_reason)
        self.losses = Losses(self.importance, self.streams, self.counters, cfg.h_fraction,
                             self.trace)
        self.scan = ScanAhead(self)
        # --shared-cache: this dataset's share of the root's budget (dlcachefs.cache.shares)
        self.shares = (ShareKeeper(cfg, self.index, self.writer, self.counters, self.calls)
                       if cfg.shared_cache else None)
        # --shared-cache dedup: identical bytes held once in the root (dlcachefs.cache.dedup)
        self.dedup = (ContentStore(cfg, self.index, self.calls)
                      if cfg.shared_cache and cfg.dedup else None)
        if self.dedup is not None:
            self.writer.content_keys = True
            self.fetcher.dedup = self.dedup
        self.handles: dict[int, Handle] = {}
        self._opened = InoBits()  # files opened in this mount (Handle.first_open)
        self._next_fh = 1
        self.started = time.time()

    # ----- life cycle ----------------------------------------------------------------

    def start(self, progress: Callable[[int, int, float], None] | None = None) -> dict:
        """Blocking start-up before the filesystem is served: crash recovery, then the
        namespace scan when there is no snapshot yet or ``--rescan`` was given
        (:mod:`dlcachefs.cache.recovery`). With ``--shared-cache``, this dataset's entry
        in the root's ledger first: its limit is the one recovery shrinks to."""
        # first (before a shared root's ledger hears of this mount): a cache of another
        # source is refused
        check_source(self.cfg, self.index, self.source.root)
        if self.shares is not None:
            self.writer.limit = self.shares.join()
        if self.dedup is not None:
            self.dedup.load_manifest()
        return recover(self.cfg, self.index, self.logs, self.ns, self.writer, self.policy,
                       progress)

    def check_invariants(self) -> list[str]:
        """Violated invariants of the cache, as readable lines (empty when all hold); see
        :mod:`dlcachefs.cache.invariants`. Trio loop."""
        return check_cache(self.writer, self.index, self.logs, self.writer.limit)

    def _cache_limit(self) -> int:
        """The limit of the cache account now: ``--cache-size``, or this dataset's share."""
        w = getattr(self, "writer", None)  # a policy may ask while the engine is built
        return self.cfg.cache_size if w is None else w.limit

    def _after_commit(self) -> None:
        """--debug-invariants: check after every commit; a violation is an ERROR."""
        problems = self.check_invariants()
        if problems:
            self.counters.invariant_violations += len(problems)
            for p in problems[:10]:
                log.error("invariant violated: %s", p)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Background tasks (the chunk writer, the parts' own nurseries, the policy's
        steps), until cancelled or :meth:`close`."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.writer.run)
            await nursery.start(self.fetcher.run)
            if self.peers is not None:
                await nursery.start(self.peers.run)
            await nursery.start(self.losses.run)
            await nursery.start(self.streams.run)
            await nursery.start(self.scan.run)
            nursery.start_soon(self._maintain_policy)
            nursery.start_soon(self._reap_readers)
            nursery.start_soon(self._let_idle_things_go)
            if self.shares is not None:
                await nursery.start(self.shares.run)
            if self.dedup is not None:
                await nursery.start(self.dedup.run)
            if self.owner_prefetch is not None:
                await nursery.start(self.owner_prefetch.run)
            if self.packer is not None:
                await nursery.start(self.packer.run)
            task_status.started()

    async def _maintain_policy(self) -> None:
        """The policy's background steps (iCACHE's shadow heap), between requests. A
        policy that fails here is logged, never the end of the mount."""
        while True:
            try:
                while self.policy.maintain():
                    await trio.sleep(0)
            except Exception:  # noqa: BLE001 - third-party policies run here too
                log.exception("policy %s: background step failed", self.cfg.policy)
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
                log.warning("freeing dead readers' LMDB slots failed: %s", e)
                continue
            if n:
                log.info("freed %d LMDB reader slots of processes that died", n)

    async def _let_idle_things_go(self) -> None:
        """Close the source directory descriptors kept for fetches once they expire, so
        that an idle daemon holds none (``LocalSource.drop_idle``: O_PATH closes under a
        lock held for microseconds, cheap enough for the loop), let go of scan-ahead's
        spares held too long (``ReadAhead.drop_old_spares``) and of the protection of idle
        streams' logs (``StreamManager.unprotect_idle``)."""
        while True:
            await trio.sleep(DirDescriptors.TTL_S)
            if isinstance(self.source, LocalSource):
                self.source.drop_idle()
            self.readahead.drop_old_spares()
            self.streams.unprotect_idle(time.monotonic())

    async def flush(self) -> None:
        """Seal everything fetched so far, the files still waiting for the writer's room
        included (tests, and an orderly unmount)."""
        await self.backlog.drained()
        await self.writer.flush()

    async def close(self) -> None:
        """Stop prefetching, seal and commit what is pending, and stop background work."""
        self.streams.close()
        self.scan.close()
        with trio.move_on_after(10):  # what readers were served is worth keeping
            await self.flush()
        await self.writer.close()
        if self.peers is not None:
            await self.peers.close()  # the stores still queued, bounded
        if self.trace is not None:
            await trio.to_thread.run_sync(self.trace.save, self.ns.size_of)

    def close_files(self) -> None:
        """Release descriptors and the index (after :meth:`close`, off the loop is fine)."""
        for h in self.handles.values():
            if h.fd >= 0:
                os.close(h.fd)
        self.handles.clear()
        if self.shares is not None:  # after the last commit: the exact bytes left
            self.shares.leave()
        self.logs.close()
        self.index.close()

    @property
    def control(self) -> ControlState | None:
        """The mount's control state (:class:`~dlcachefs.clairvoyance.control.ControlState`),
        once the session attached it to :attr:`losses` (None before)."""
        return self.losses.control

    def peer_expiry(self, ino: int) -> int:
        """The memcached expiry (s, 0: never) of ``ino``'s value in the peer tier: its last
        planned use over the streams that know their order (a distributed sampler's over
        every rank), plus a margin (:mod:`dlcachefs.peers.expiry`). Trio loop;
        O(streams)."""
        from dlcachefs.peers.expiry import expiry_s, planned_use  # noqa: PLC0415 - --peers only
        uses = []
        for s in self.streams.streams.values():
            if not s.order or s.samples is None:
                continue
            if s.cluster is not None:  # every rank's use: the cluster's last one
                cur, nxt = s.cluster.steps(ino)
                if cur is not None and cur < s.position:
                    cur = None  # read by the cluster already in this epoch
            else:
                cur = s.positions.next(ino)
                nxt = s.next_first.next(ino) if s.next_first is not None else None
            u = planned_use(s.position, cur, len(s.order), nxt, s.pace.seconds_per_sample())
            if u is not None:
                uses.append(u)
        return expiry_s(uses)

    def stats(self) -> dict:
        """The ``.dlcache/stats`` document (:func:`dlcachefs.cache.stats.stats_document`)."""
        return stats_document(self)

    # ----- open / read / release -----------------------------------------------------

    async def open(self, ino: int, pid: int = 0) -> OpenResult:
        """Open a file for reading; ``pid`` attributes the read to a stream."""
        stream = self.streams.stream_of(pid) if pid else None
        t0 = time.monotonic()
        e = await self.ns.fresh_file(ino)
        seen = self.ns.changes  # a change noticed from here on may be newer than e
        first_open = self._opened.add(ino)
        if not is_file(e):
            raise InvalidArgument("not a regular file")
        if stream is not None:
            self.streams.note_open(stream, ino)
            self.plans.poke(stream)
            if self.trace is not None:
                # the epoch announced, not the one configured: an open that comes while
                # the new epoch's order is computed is the new epoch's (recorded under the
                # old one, it was dropped there as a repeat)
                ep = stream.epoch if stream.target_epoch is None else stream.target_epoch
                self.trace.opened(stream.dataset, stream.samples, ep, ino)
        if pid and (stream is None or stream.order_unknowable):
            # no known order covers this open: maybe an epoch's scan of a tree
            group = stream.key if stream is not None else self.streams.group_of(pid)
            if group is not None:
                self.scan.note_open(group, ino, e.parent)
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
                self._note_served(stream, ino, pid, t0, True)
            return OpenResult(self._new_fh(lazy), keep_cache=True, direct_io=False, entry=e)
        data, cached, waited, joined, got = await self._load(
            e, cache=stream is None or not stream.memory_prefetch, stream=stream)
        for nl in self.streams.next_logs():  # (every stream's: see next_logs)
            # the version of the bytes (a fetch joined may have read an older one)
            nl.consumed(ino, data, identity(got))
        if stream is not None:
            self._note_served(stream, ino, pid, t0, cached)
        if stream is not None and waited:
            stream.stall_seconds += time.monotonic() - t0
            if not cached and not joined:
                stream.bytes_from_source += len(data)
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

    @staticmethod
    def _note_served(stream: Stream, ino: int, pid: int, t0: float, cached: bool) -> None:
        """An open of ``stream`` from ``t0`` served now: the loader's t_fetch."""
        stream.used.add(ino)
        t1 = time.monotonic()
        stream.note_latency(cached, t1 - t0)
        stream.pace.note(pid, t0, t1, stream.target_epoch)

    def _lazy_open(self, e: Entry, stream: Stream | None, seen: int) -> Handle | None:
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
        if any(nl.wants(ino) for nl in self.streams.next_logs()):
            return None  # (a slot of any stream's next log: see StreamManager.next_logs)
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

    async def _load(self, e: Entry, cache: bool = True, stream: Stream | None = None
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

