"""The composition root of one mount's core: every part made once, here, and handed its
collaborators in its constructor.

:func:`build` is how the daemon (:mod:`dlcachefs.mount.daemon`), the core tests
(:func:`dlcachefs.testing.fakes.run_engine`) and the simulator's engine mode
(:mod:`dlcachefs.sim.modelcheck`) make a mount's core, so that control -> streams ->
engine runs without FUSE exactly as it does mounted. What it makes, in the order the
parts need each other:

* the cache directory's index and logs, the counters, the memory budget (fitted to the
  daemon's memory cgroup), the one wrapper of source calls, the namespace;
* the streams (:mod:`dlcachefs.clairvoyance`: who reads what, in which order) and the
  caching policy's views of the cache, the streams' future and the samples' importance;
  the policy named by ``cfg.policy``, looked up in the registry
  (:func:`dlcachefs.policies.registry`: built-in and entry-point policies; this is the
  one place of the core that imports :mod:`dlcachefs.policies`);
* the read path's parts (:mod:`dlcachefs.cache`: writer, reader, fetcher, versions,
  buffers, substitution) and the :class:`~dlcachefs.cache.engine.Engine` over them;
* the background parts: read plans, prefetch, scan-ahead, the losses and the packer
  (:mod:`dlcachefs.importance`), the peer tier and the owner's prefetch
  (:mod:`dlcachefs.peers`, ``--peers`` only), a shared root's share and dedup
  (``--shared-cache`` only), the trace recorder (``--trace``);
* the control file's state, bound to the streams and the losses.

The read path reaches the background parts only through the Protocols of
:mod:`dlcachefs.cache.readers`: the streams answer which stream an open is for, and the
observers (the streams, the read planner, the trace recorder, scan-ahead, in that order)
hear every open.

Nothing here runs at build time: the caller starts the core (:meth:`Session.start`,
blocking: recovery, the namespace scan), runs its background tasks
(:meth:`Session.serve`) in a nursery it owns, and closes it (:meth:`Session.close`,
:meth:`Session.close_files`); or hands a body to :meth:`Session.run`.

Concurrency: every part lives on the trio loop of :meth:`Session.serve`; each part's
module says what it runs in threads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TypeVar

import trio

from dlcachefs import __version__
from dlcachefs.cache.buffers import LATER_CHUNKS, Backlog, ReadAhead
from dlcachefs.cache.dedup import ContentStore
from dlcachefs.cache.engine import Engine
from dlcachefs.cache.fetch import Fetcher, SourceCalls
from dlcachefs.cache.fetchpool import FetchPool
from dlcachefs.cache.filesystem import Filesystem
from dlcachefs.cache.inprocess import InProcessReads
from dlcachefs.cache.invariants import check_after_commit
from dlcachefs.cache.memlimit import MemoryBudget, cgroup_limit, current_rss, fit
from dlcachefs.cache.memtier import MemoryTier
from dlcachefs.cache.namespace import Namespace, is_dir
from dlcachefs.cache.policy import CachingPolicy, PolicyContext, plans_packages
from dlcachefs.cache.prefetch import Prefetcher
from dlcachefs.cache.reader import LogReader
from dlcachefs.cache.readers import Observers
from dlcachefs.cache.readplan import ReadPlanner
from dlcachefs.cache.recovery import check_source, recover
from dlcachefs.cache.scanahead import OUTSIDE, ScanAhead
from dlcachefs.cache.shares import ShareKeeper
from dlcachefs.cache.source import DirDescriptors, LocalSource, Source
from dlcachefs.cache.stats import Counters
from dlcachefs.cache.substitute import Substitution
from dlcachefs.cache.versions import Versions
from dlcachefs.cache.views import IndexCacheView, PolicyClock
from dlcachefs.cache.writer import AccountLimit, ChunkWriter
from dlcachefs.clairvoyance.attribution import Attribution
from dlcachefs.clairvoyance.control import ControlState, ErrorLog
from dlcachefs.clairvoyance.events import StreamEvents
from dlcachefs.clairvoyance.future import StreamFuture
from dlcachefs.clairvoyance.listings import SampleLists
from dlcachefs.clairvoyance.nextepoch import NextEpochPlanner
from dlcachefs.clairvoyance.prefetchloop import LEAD, PrefetchLoop, stream_lead_bytes
from dlcachefs.clairvoyance.reorder import HeldBudget, NextEpochLog
from dlcachefs.clairvoyance.stream import StreamTable
from dlcachefs.clairvoyance.streams import StreamManager
from dlcachefs.clairvoyance.trace import TraceRecorder
from dlcachefs.config import Config
from dlcachefs.errors import DlcError
from dlcachefs.importance.losses import Losses
from dlcachefs.importance.packer import Packer
from dlcachefs.importance.view import InodeImportance
from dlcachefs.peers.expiry import expiry_of_streams
from dlcachefs.policies import make_policy, registry
from dlcachefs.store.advice import AdviceBoard
from dlcachefs.store.index import Index
from dlcachefs.store.logs import LogStore
from dlcachefs.store.modes import DIR_MODE
from dlcachefs.store.tally import TALLY_DIR, TallyEvents, TallyReader

log = logging.getLogger(__name__)

T = TypeVar("T")

#: what the engine's parts take: the policy, made from its read-only views
PolicyFactory = Callable[[PolicyContext], CachingPolicy]


def policies() -> dict[str, type[CachingPolicy]]:
    """Every registered policy by name (built-in and entry points; see
    :func:`dlcachefs.policies.registry`)."""
    return registry()


def policy_factory(spec: str) -> PolicyFactory:
    """The factory of the policy ``NAME[:key=value,...]`` names. The spec is checked now
    (an unknown name, option or value raises ValueError before anything is opened)."""
    make_policy(spec)  # a throwaway instance: policies are cheap to make and do no I/O

    def make(ctx: PolicyContext) -> CachingPolicy:
        return make_policy(spec, ctx)

    return make


@dataclass
class Session:
    """One mount's core: the engine (the read path), the background parts and the
    control file's state, as :func:`build` made and wired them."""

    cfg: Config
    engine: Engine
    control: ControlState
    streams: StreamManager
    losses: Losses
    plans: ReadPlanner
    prefetcher: Prefetcher
    scan: ScanAhead
    importance: InodeImportance
    future: StreamFuture
    memory: MemoryBudget
    zerocopy: TallyReader
    packer: Packer | None = None
    trace: TraceRecorder | None = None
    peers: object | None = None  # dlcachefs.peers.tier.PeerTier, with --peers
    owner_prefetch: object | None = None  # dlcachefs.peers.ownerprefetch.OwnerPrefetch
    shares: ShareKeeper | None = None
    dedup: ContentStore | None = None
    #: reads served in training processes, told to the observers (dlcachefs.cache.inprocess)
    in_process: InProcessReads | None = None
    started: float = 0.0
    _filesystem: Filesystem | None = field(default=None, repr=False)

    def filesystem(self) -> Filesystem:
        """The core's filesystem facade over this session, for a FUSE adapter
        (:mod:`dlcachefs.mount.ops`): made at the first call, once, and only for a mount,
        since its coherence rules register with the namespace as the kernel's
        (:class:`~dlcachefs.cache.coherence.Coherence`: a file changed during the mount is
        bypassed until the kernel was told); a core without a kernel has none."""
        if self._filesystem is None:
            eng = self.engine

            async def statfs() -> os.statvfs_result:
                return await eng.calls.call(eng.source.statvfs)

            control = self.control if self.in_process is None else \
                _InProcessFirst(self.control, self.in_process)
            self._filesystem = Filesystem(
                eng, control=control, stats=self.stats,
                on_opendir=self.streams.note_opendir,
                on_control_open=self.streams.start_replay, statfs=statfs)
        return self._filesystem

    @property
    def policy(self) -> CachingPolicy:
        """The caching policy (made by :func:`build` from ``cfg.policy``)."""
        return self.engine.policy

    # ----- life cycle ------------------------------------------------------------------

    def start(self, progress: Callable[[int, int, float], None] | None = None,
              recount_all: bool = True) -> dict:
        """Blocking start-up before the filesystem is served: a cache of another source is
        refused; with ``--shared-cache``, this dataset's entry in the root's ledger first
        (its limit is the one recovery shrinks to) and dedup's manifest; then crash
        recovery and the namespace scan when there is no snapshot yet or ``--rescan`` was
        given (:mod:`dlcachefs.cache.recovery`; ``recount_all`` as it takes it)."""
        eng = self.engine
        check_source(self.cfg, eng.index, eng.source.root)
        if self.shares is not None:
            eng.writer.limit = self.shares.join()
        if self.dedup is not None:
            self.dedup.load_manifest()
        return recover(self.cfg, eng.index, eng.logs, eng.ns, eng.writer, eng.policy,
                       progress, recount_all=recount_all)

    async def serve(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Every part's background tasks, until cancelled (each part owns its own
        nursery, started here)."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.engine.run)
            if self.peers is not None:
                await nursery.start(self.peers.run)  # type: ignore[attr-defined]
            await nursery.start(self.losses.run)
            await nursery.start(self.streams.run)
            await nursery.start(self.scan.run)
            if self.prefetcher.pool is not None:
                await nursery.start(self.prefetcher.pool.run)
            if self.in_process is not None:
                await nursery.start(self.in_process.run)
            nursery.start_soon(self._unprotect_idle_streams)
            if self.shares is not None:
                await nursery.start(self.shares.run)
            if self.dedup is not None:
                await nursery.start(self.dedup.run)
            if self.owner_prefetch is not None:
                await nursery.start(self.owner_prefetch.run)  # type: ignore[attr-defined]
            if self.packer is not None:
                await nursery.start(self.packer.run)
            task_status.started()

    async def _unprotect_idle_streams(self) -> None:
        """Let go, now and then, of the protection of idle streams' logs
        (``StreamManager.unprotect_idle``)."""
        while True:
            await trio.sleep(DirDescriptors.TTL_S)
            self.streams.unprotect_idle(time.monotonic())

    async def close(self) -> None:
        """Stop prefetching, seal and commit what is pending, and stop the background
        work that outlives a cancel (the peer tier's queued stores, the trace)."""
        self.streams.close()
        self.scan.close()
        await self.engine.close()
        if self.peers is not None:
            await self.peers.close()  # type: ignore[attr-defined]  # queued stores, bounded
        if self.trace is not None:
            await trio.to_thread.run_sync(self.trace.save, self.engine.ns.size_of)

    def close_files(self) -> None:
        """Release descriptors and the index (after :meth:`close`; off the loop is fine).
        A shared root hears this dataset's exact bytes after the last commit first."""
        if self.shares is not None:
            self.shares.leave()
        self.engine.close_files()
        if self.plans.board is not None:
            self.plans.board.close()

    def write(self, data: bytes, pid: int) -> int:
        """One ``write()`` of ``data`` to ``.dlcache/control`` by process ``pid``, as the
        FUSE layer hands it over: applied whole (returns ``len(data)``) or refused whole
        with :class:`~dlcachefs.errors.ControlError` (EINVAL; the reason is kept for
        ``.dlcache/errors``). Trio loop: the streams' tasks start in their nursery."""
        return self.control.apply(data, pid)

    def run(self, body: Callable[[Session], Awaitable[T]]) -> T:
        """Blocking: :meth:`start`, then run ``body(self)`` under trio with the background
        tasks running, then :meth:`close` as an unmount does. For cores without a
        kernel mount (tests, the simulator's engine mode). The index stays open (its
        state can be checked afterwards) until :meth:`close_files`."""
        self.start()

        async def main() -> T:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.serve)
                result = await body(self)
                await self.close()  # seals what is pending, as at unmount
                nursery.cancel_scope.cancel()  # the other background tasks, as the daemon
            return result

        return trio.run(main)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close_files()

    # ----- the stats document ----------------------------------------------------------

    def _state(self) -> dict:
        """The stats document's first part: what is mounted, and the cache's state."""
        eng = self.engine
        cfg = self.cfg
        snap = eng.index.snapshot()
        return {
            "version": __version__,
            "pid": os.getpid(),
            "source": os.fsdecode(eng.source.root),
            "mountpoint": cfg.mountpoint,
            "cache_dir": cfg.data_dir,
            "uptime_s": round(time.time() - self.started, 3),
            "files": snap["files"],
            "bytes_total": snap["bytes_total"],
            "cached_files": snap["records"],
            "cached_bytes": snap["cached_bytes"],
            "chunks": snap["chunks"],
            "chunk_bytes": snap["chunk_bytes"],
            # --cache-size, or with --shared-cache this dataset's share of it now
            "cache_limit_bytes": eng.writer.limit,
            # the disk under the cache: free space, --min-free, a pause after a failed write
            "cache_disk": eng.writer.disk_state(),
            "max_cached_file": cfg.max_cached_file,  # larger files are read through
            "memory_bytes": eng.memtier.bytes,
            "memory_limit_bytes": eng.memtier.limit,
            # the daemon's memory cgroup limit found at start (None: none); --memory and
            # the buffers were sized to fit it (dlcachefs.cache.memlimit)
            "cgroup_memory_limit": self.memory.cgroup_limit,
            "readahead_limit_bytes": eng.readahead.limit,
            "backlog_limit_bytes": eng.backlog.limit,
            # fetched, not yet in a sealed chunk (waiting for the writer's room included)
            "pending_bytes": eng.writer.open_bytes + eng.writer.sealing_bytes
            + eng.backlog.bytes,
            # the --cache-size account: chunk_bytes - evicting_bytes + reserved_bytes
            # <= cache_limit_bytes (see dlcachefs.cache.writer)
            "reserved_bytes": eng.writer.pending_bytes,
            "evicting_bytes": eng.writer.doomed_bytes,
            # the account itself as the writer keeps it (its "used" follows the index
            # once a commit's bookkeeping is done: chunk_bytes may be ahead meanwhile)
            "cache_account_bytes": eng.writer.account(),
            "open_files": len(eng.handles),
            "revalidate_s": cfg.revalidate,
        }

    def stats(self) -> dict:
        """The ``.dlcache/stats`` document (counters since mount; cache state
        cumulative): the one place that reads every part. Trio loop."""
        eng = self.engine
        cfg = self.cfg
        if self.in_process is not None:
            # first: the streams' counts include them, and zerocopy.collect() removes the
            # files of readers that ended, last events and all
            with contextlib.suppress(Exception):  # the stats must answer (run() logs it)
                self.in_process.drain(scan=True)
        out = self._state()
        out.update({
            # torch loaded (from a training's first contact on, in the background):
            # announced samplers replay
            "sampler_replay_ready": self.streams.replay_ready,
            "losses_waiting": self.losses.waiting,
            # trees fetched ahead of readers whose order is unknown (cache.scanahead)
            "scan_ahead": self.scan.stats(),
        })
        out.update(eng.counters.as_dict())
        # every pread of the logs (serving, and background fills)
        out["cache_disk_bytes_read"] = eng.logs.bytes_read
        # reordered logs' chunks read back (just written) to checksum them before a seal
        out["cache_disk_bytes_read_back"] = eng.logs.bytes_read_back
        # read ahead into the page cache for readers in training processes (readplan)
        out["cache_disk_bytes_advised"] = eng.logs.bytes_advised
        # or posted for those readers to ask of the kernel themselves, and what they took
        if self.plans.board is not None:
            with contextlib.suppress(OSError):
                out["read_ahead_board"] = self.plans.board.stats()
        # entries and records read from LMDB (a read transaction each), and those the
        # memo of the current snapshot answered (store.index)
        out["index_reads"] = eng.index.reads
        out["index_memo_hits"] = eng.index.memo_hits
        out["read_plans"] = self.plans.stats()
        out["source_latency"] = eng.calls.latency.as_dict()  # seconds per attempt, by call
        # samples training processes read from the cache directly, and their fallbacks.
        # Blocking on the loop on purpose, as the LMDB reads: a listing and two small
        # opens of a local file per reading process (tens of microseconds each), only
        # when stats are read
        out["zerocopy"] = self.zerocopy.collect()
        if self.in_process is not None:
            out["zerocopy"].update(self.in_process.stats())
        out["streams"] = self.streams.stats()
        for key, rel in self.scan.tree_of_groups().items():
            # (a stream's opens outside its samples: its second loader's tree)
            own, outside, _ = key.partition(OUTSIDE)
            if own in out["streams"]:
                out["streams"][own]["scan_ahead_outside" if outside else "scan_ahead"] = rel
        # --shared-cache: the root's budget, this dataset's share, the ledger's entries
        out["shared"] = None if self.shares is None else self.shares.stats()
        # --shared-cache dedup: files served from the root's other datasets
        out["dedup"] = None if self.dedup is None else self.dedup.stats()
        out["policy"] = {"name": cfg.policy, **eng.policy.stats()}
        # the cluster's shared tier (--peers): per server and lease counts
        out["peers"] = None if self.peers is None else self.peers.stats()  # type: ignore[attr-defined]
        if self.owner_prefetch is not None:  # --peer-self: fetched ahead for the cluster
            out["peers"]["owner_prefetch"] = self.owner_prefetch.stats()  # type: ignore[attr-defined]
        out["packer"] = None if self.packer is None else self.packer.as_dict()
        # --fetch-workers: files the workers fetched ahead, jobs, fallbacks, restarts
        pool = self.prefetcher.pool
        out["fetch_workers"] = None if pool is None else pool.stats()
        imp = self.importance
        t = imp.table
        out["importance"] = None if t is None else {
            "dataset": imp.dataset, "samples": t.n, "version": t.version(),
            "h_samples": None if t.high is None else sum(t.high),
            "jobs": {k: {"reported": j.reported, "benefit": j.benefit}
                     for k, j in t.jobs.items()}}
        return out


def build(cfg: Config, source: Source | None = None) -> Session:
    """The core of a mount of ``cfg`` over ``source`` (default: ``cfg.source`` on the local
    filesystem), every part made and wired (the module docstring). Opens the cache's index
    and logs; nothing starts yet."""
    factory = policy_factory(cfg.policy)  # a bad --policy fails before the index opens
    source = source if source is not None else LocalSource(cfg.source)
    os.makedirs(cfg.data_dir, mode=DIR_MODE, exist_ok=True)  # owner-only (store.modes)
    index = Index(cfg.index_dir)
    logs = LogStore(cfg.logs_dir, cfg.log_size)
    counters = Counters()
    # container-aware: --memory, read-ahead and the backlog fit the memory cgroup's limit
    memory = fit(cfg.memory, cfg.chunk_size, LATER_CHUNKS * cfg.chunk_size, cgroup_limit(),
                 current_rss())
    if memory.reason:
        log.warning("%s", memory.reason)
    calls = SourceCalls(source, cfg, counters)  # every call on the source goes through it
    observers = Observers()  # the read path's events, fanned out (added in _background)
    ns = Namespace(index, calls, revalidate=cfg.revalidate, use_src_ino=cfg.use_source_inode,
                   on_removed=observers.gone)
    # the policy sees the cache (chunks from the index, within the account's limit, which
    # a shared root's share moves at run time), the streams' future and the losses
    table = StreamTable()  # the streams of readers by (job, rank), filled by the manager
    clock = PolicyClock()  # one tick per open
    future = StreamFuture(table, clock)
    importance = InodeImportance()
    limit = AccountLimit(cfg.cache_size)
    policy = factory(PolicyContext(IndexCacheView(index, limit), future, importance))
    # the cluster's shared tier (--peers): pymemcache is imported only then
    peers = None
    if cfg.peers is not None:
        from dlcachefs.peers.tier import PeerTier  # noqa: PLC0415 - optional dependency

        # a value expires after its last planned use in the streams' orders
        peers = PeerTier(cfg, source.root, expiry_of=partial(expiry_of_streams, table))
    # --shared-cache dedup: identical bytes held once in the root (dlcachefs.cache.dedup)
    dedup = ContentStore(cfg, index, calls) if cfg.shared_cache and cfg.dedup else None
    rp = _read_path(cfg, source, index, logs, counters, calls, ns, policy, limit, memory,
                    peers, dedup)
    return _background(cfg, rp, observers, table, clock, future, importance, memory, peers,
                       dedup)


@dataclass
class _ReadPath:
    """The read path's parts, as :func:`_read_path` made them (the engine takes them)."""

    source: Source
    index: Index
    logs: LogStore
    counters: Counters
    calls: SourceCalls
    ns: Namespace
    policy: CachingPolicy
    memtier: MemoryTier
    writer: ChunkWriter
    backlog: Backlog
    readahead: ReadAhead
    versions: Versions
    reader: LogReader
    fetcher: Fetcher
    disk_limiter: trio.CapacityLimiter


def _read_path(cfg: Config, source: Source, index: Index, logs: LogStore,
               counters: Counters, calls: SourceCalls, ns: Namespace, policy: CachingPolicy,
               limit: AccountLimit, memory: MemoryBudget, peers: object | None,
               dedup: ContentStore | None) -> _ReadPath:
    """The chunk writer, the buffers, the version check, the reader and the fetcher."""
    memtier = MemoryTier(memory.memory)
    # --shared-cache: units cut for the smallest share a dataset may get (a 32nd of the
    # budget when the floor is smaller: units of a few KiB would cost more)
    basis = (max(int(cfg.cache_size * cfg.share_floor), cfg.cache_size // 32, 4096)
             if cfg.shared_cache else None)
    writer = ChunkWriter(
        cfg, index, logs, policy, memtier, counters, limit=limit, unit_basis=basis,
        keeper=peers if peers is not None and cfg.peer_keep else None,  # type: ignore[arg-type]
        content_keys=dedup is not None,
        after_commit=check_after_commit if cfg.debug_invariants else None)
    backlog = Backlog(memory.backlog)  # fetched bytes waiting for the writer's room
    readahead = ReadAhead(memory.readahead)  # bytes fetched or loaded ahead of their opens
    versions = Versions(index, writer, backlog)
    disk_limiter = trio.CapacityLimiter(4)
    reader = LogReader(index, logs, memtier, writer, policy, counters, disk_limiter,
                       readahead)
    fetcher = Fetcher(cfg, calls, ns, writer, policy, versions, backlog, counters,
                      peers, dedup)  # type: ignore[arg-type]
    return _ReadPath(source, index, logs, counters, calls, ns, policy, memtier, writer,
                     backlog, readahead, versions, reader, fetcher, disk_limiter)


def _streams(cfg: Config, rp: _ReadPath, table: StreamTable, clock: PolicyClock,
             importance: InodeImportance, memory: MemoryBudget, plans: ReadPlanner,
             prefetcher: Prefetcher, events: TallyEvents
             ) -> tuple[StreamManager, Losses, TraceRecorder | None, ErrorLog]:
    """The stream manager and its parts, the losses it tells of epochs, the trace and
    the control file's error log (shared with the losses)."""
    index, ns, writer, policy = rp.index, rp.ns, rp.writer, rp.policy
    next_log = partial(NextEpochLog, cfg=cfg, index=index, logs=rp.logs, writer=writer,
                       policy=policy, counters=rp.counters, disk_limiter=rp.disk_limiter,
                       versions=rp.versions, prefetcher=prefetcher, held=HeldBudget())
    losses: Losses | None = None  # (made below: it asks the streams for sample lists)
    streams = StreamManager(
        cfg, table, attribution=Attribution(table), lists=SampleLists(ns, index, table),
        planner=NextEpochPlanner(cfg, table, ns, writer, rp.memtier,
                                 lambda: events.lost, next_log),
        prefetch=PrefetchLoop(ns, rp.readahead, rp.memtier, prefetcher,
                              lead_bytes=stream_lead_bytes(cfg),
                              concurrency=cfg.source_threads),
        plans=plans, readahead=rp.readahead, ns=ns, clock=clock,
        # the importance hears of epochs and dropped jobs (the losses, made next)
        on_epoch=lambda s, samples: losses.epoch_started(s, samples),  # type: ignore[union-attr]
        on_job_dropped=lambda job: losses.forget_job(job))  # type: ignore[union-attr]
    if not memory.replay_worker:
        log.warning("%s", memory.replay_reason)
        streams.replay.disable(memory.replay_reason)
    trace = TraceRecorder(cfg.trace) if cfg.trace else None
    errors = ErrorLog()  # the control file's, shared with the losses
    losses = Losses(importance, streams, rp.counters, cfg.h_fraction, trace, errors)
    return streams, losses, trace, errors


class _InProcessFirst:
    """The control file, taking the reads served in training processes before each
    write: a new epoch's announcement must not come before the last epoch's reads
    (their events are drained every 50 ms; the opens through the mount come in order)."""

    def __init__(self, control: ControlState, in_process: InProcessReads) -> None:
        self.control = control
        self.in_process = in_process

    def apply(self, data: bytes, pid: int) -> int:
        try:
            self.in_process.drain(scan=True)
        except Exception:  # noqa: BLE001 - the write is applied all the same (run() logs)
            log.debug("draining in-process reads before a control write failed",
                      exc_info=True)
        return self.control.apply(data, pid)

    def state_text(self) -> bytes:
        return self.control.state_text()

    def errors_text(self) -> bytes:
        return self.control.errors_text()


def _background(cfg: Config, rp: _ReadPath, observers: Observers, table: StreamTable,
                clock: PolicyClock, future: StreamFuture, importance: InodeImportance,
                memory: MemoryBudget, peers: object | None,
                dedup: ContentStore | None) -> Session:
    """The parts that work for readers in the background, the engine over the read path
    (told of opens through ``observers``), and the control state."""
    index, ns, writer, policy = rp.index, rp.ns, rp.writer, rp.policy
    zerocopy = TallyReader(os.path.join(cfg.data_dir, TALLY_DIR))  # zero-copy readers' counts
    events = TallyEvents(os.path.join(cfg.data_dir, TALLY_DIR))  # and their opens
    # the read-ahead of streams read in training processes, posted for those processes
    # to ask of the kernel (store.advice); without it the daemon asks itself
    try:
        board: AdviceBoard | None = AdviceBoard(os.path.join(cfg.data_dir, TALLY_DIR))
    except OSError as e:
        log.warning("no read-ahead board for in-process readers (%s): the daemon reads "
                    "ahead for them itself", e)
        board = None
    # planned reads of known orders: half of --memory, taken from the tier
    plans = ReadPlanner(board=board, index=index, logs=rp.logs, writer=writer, memtier=rp.memtier,
                        counters=rp.counters, disk_limiter=rp.disk_limiter, reader=rp.reader,
                        versions=rp.versions, readahead=rp.readahead,
                        budget=min(memory.memory // 2, stream_lead_bytes(cfg)), lead=LEAD,
                        max_batch=max(4 << 20, 2 * cfg.chunk_size))
    # --fetch-workers: files fetched ahead are read and appended by worker processes (a
    # local source's files only; with the peer tier or dedup the daemon fetches them)
    pool = None
    if (cfg.fetch_workers > 0 and isinstance(rp.source, LocalSource) and peers is None
            and dedup is None):
        pool = FetchPool(cfg, index=index, logs=rp.logs, writer=writer, policy=policy, ns=ns,
                         fetcher=rp.fetcher, counters=rp.counters)
    prefetcher = Prefetcher(
        cfg, ns=ns, versions=rp.versions, fetcher=rp.fetcher, reader=rp.reader, writer=writer,
        policy=policy, backlog=rp.backlog, readahead=rp.readahead, plans=plans,
        counters=rp.counters, pool=pool)
    streams, losses, trace, errors = _streams(cfg, rp, table, clock, importance, memory,
                                              plans, prefetcher, events)
    # iCACHE's dynamic packaging fills the L-cache when substitution is on (and the
    # policy plans packages at all)
    packer = (Packer(cfg, index=index, ns=ns, policy=policy, writer=writer,
                     fetcher=rp.fetcher, importance=importance,
                     sample_list=streams.sample_list)
              if cfg.substitute and plans_packages(policy) else None)
    substitution = Substitution(
        cfg, index=index, ns=ns, versions=rp.versions, fetcher=rp.fetcher, reader=rp.reader,
        readahead=rp.readahead, policy=policy, packer=packer, counters=rp.counters)
    scan = ScanAhead(cfg, index=index, ns=ns, writer=writer, fetcher=rp.fetcher,
                     prefetcher=prefetcher, group_of=streams.group_of)
    stream_events = StreamEvents(streams)
    # who hears each open, in this order: the streams (positions), the read plans, the
    # trace, scan-ahead
    for o in (stream_events, plans, trace, scan):
        if o is not None:
            observers.add(o)
    engine = Engine(
        cfg, source=rp.source, index=index, logs=rp.logs, counters=rp.counters,
        calls=rp.calls, ns=ns, policy=policy, clock=clock, memtier=rp.memtier, writer=writer,
        backlog=rp.backlog, readahead=rp.readahead, versions=rp.versions, reader=rp.reader,
        fetcher=rp.fetcher, substitution=substitution, plans=plans, readers=stream_events,
        observers=observers)
    # --shared-cache: this dataset's share of the root's budget (dlcachefs.cache.shares)
    shares = (ShareKeeper(cfg, index, writer, rp.counters, rp.calls)
              if cfg.shared_cache else None)
    # --peer-self: this node fetches ahead the files it owns in the cluster's order
    owner_prefetch = None
    if peers is not None and cfg.peer_self is not None:
        from dlcachefs.peers.ownerprefetch import OwnerPrefetch  # noqa: PLC0415 - --peers only

        owner_prefetch = OwnerPrefetch(cfg, index=index, ns=ns, fetcher=rp.fetcher,
                                       peers=peers, streams=streams)  # type: ignore[arg-type]

    def resolve_dir(rel: str) -> int:
        e = ns.resolve(os.fsencode(rel))
        if not is_dir(e):
            raise DlcError("not a directory")
        return e.ino

    control = ControlState(
        resolve_dir, streams.on_stream, dataset_size=streams.dataset_size,
        on_loss=losses.on_loss, on_order=streams.on_order, loss_room=losses.room,
        on_job_dropped=streams.drop_job, job_reading=streams.job_reading, errors=errors)
    # reads served in training processes (dlcachefs run): their events, as opens
    in_process = InProcessReads(events,
                                index=index, readers=stream_events, observers=observers,
                                policy=policy, clock=clock, after_use=rp.reader.after_use)
    return Session(cfg, engine, control, streams, losses, plans, prefetcher, scan, importance,
                   future, memory, zerocopy, packer=packer, trace=trace, peers=peers,
                   owner_prefetch=owner_prefetch, shares=shares, dedup=dedup,
                   in_process=in_process, started=time.time())
