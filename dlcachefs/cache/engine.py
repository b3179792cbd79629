"""The cache engine: what an open and a read of a mirrored file do. No FUSE in here.

Read path of one file (``open`` does the work, ``read`` only slices):

1. the namespace entry, revalidated against the source when the rule says so;
2. the index record, if its source identity equals the entry's: the bytes come from the
   memory tier, or from the log (one read of the whole chunk, payload checksum verified,
   kept in the memory tier; or, when whole chunks are not being reused, one read of the
   record alone, checked against its own checksum; or, for an open of a stream whose
   epoch is read by a plan (:mod:`dlcachefs.cache.readplan`), the bytes the plan read ahead);
3. a record that is stale or fails its checksum is dropped and counted, never served;
4. otherwise the file is fetched whole from the source in a worker thread (bounded by the
   source limiter, with a timeout and retries of transient errors), served, and handed to
   the chunk writer.

Concurrency rules: all engine state lives on the trio loop and is touched only there.
Source reads, log reads and checksums of whole chunks run in worker threads
(``trio.to_thread.run_sync``): source calls under ``source_limiter``
(``--source-threads``), log reads under ``disk_limiter`` (a read plan's batch: one hop). The chunk writer's commits run
in its own thread of one (see :mod:`dlcachefs.cache.writer`). LMDB read transactions run on
the loop (microseconds); LMDB write transactions only in threads.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import trio

from dlcachefs import __version__
from dlcachefs.cache.fetch import SourceCalls
from dlcachefs.cache.invariants import check_cache
from dlcachefs.cache.memtier import ChunkBuf, MemoryTier
from dlcachefs.cache.namespace import Namespace, identity, is_file
from dlcachefs.cache.policy import CachePolicy, PolicyContext
from dlcachefs.cache.readplan import ReadPlanner
from dlcachefs.cache.recovery import recover
from dlcachefs.cache.scanahead import ScanAhead
from dlcachefs.cache.source import (
    Identity,
    LocalSource,
    Source,
    open_for_range_reads,
    pread_checked,
)
from dlcachefs.cache.stats import Counters
from dlcachefs.cache.views import IndexCacheView, InodeImportance, StreamFuture
from dlcachefs.cache.writer import ChunkWriter
from dlcachefs.clairvoyance.streams import Stream, StreamManager, dataset_key
from dlcachefs.config import Config
from dlcachefs.errors import (
    DlcError,
    FormatError,
    InvalidArgument,
)
from dlcachefs.importance.packer import Packer
from dlcachefs.sim.tracelog import TraceRecorder
from dlcachefs.store.chunkfmt import checksum, verify_chunk
from dlcachefs.store.index import Index
from dlcachefs.store.logs import LogStore
from dlcachefs.store.schema import Chunk, Entry, Record

log = logging.getLogger(__name__)

#: loss pairs that may wait for their dataset's sample list (about 100 MB at most)
MAX_EARLY_LOSSES = 1 << 22
#: fetched bytes that may wait for the chunk writer's room, in chunks (--chunk-size)
LATER_CHUNKS = 2


@dataclass(slots=True)
class Handle:
    """An open file. ``data`` is one consistent version of the whole file, or None for a
    read-through handle (files larger than ``max_cached_file``), which keeps ``fd``."""

    ino: int
    data: memoryview | None
    cached: bool
    fd: int = -1
    ident: Identity | None = None


@dataclass(slots=True)
class OpenResult:
    fh: int
    keep_cache: bool
    direct_io: bool


class _Inflight:
    """One fetch in progress; later opens of the same file wait for it."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.result: tuple[bytes, Entry] | None = None
        self.error: BaseException | None = None


class Engine:
    """Owns the index, the logs, the namespace, the memory tier and the chunk writer."""

    def __init__(self, cfg: Config, source: Source | None = None, *,
                 policy: Callable[[PolicyContext], CachePolicy]) -> None:
        """``policy`` makes the caching policy from the engine's views (a policy class, or
        :func:`dlcachefs.session.policy_factory` of ``cfg.policy``); the engine never looks
        policies up by name (the composition root, :mod:`dlcachefs.session`, does)."""
        self.cfg = cfg
        self.source = source if source is not None else LocalSource(cfg.source)
        os.makedirs(cfg.cache_dir, exist_ok=True)
        self.index = Index(cfg.index_dir)
        self.logs = LogStore(cfg.logs_dir, cfg.log_size)
        self.counters = Counters()
        # every call on the source goes through this one wrapper (limiter, timeout, retries)
        self.calls = SourceCalls(self.source, cfg, self.counters)
        self.disk_limiter = trio.CapacityLimiter(4)
        self.ns = Namespace(self.index, self.calls, revalidate=cfg.revalidate,
                            use_src_ino=cfg.use_source_inode)
        self.streams = StreamManager(self)
        self.scan = ScanAhead(self)
        # what the policy sees: chunks from the index, the streams' future, the losses
        self.future = StreamFuture(self.streams)
        self.importance = InodeImportance()
        self.policy = policy(PolicyContext(
            IndexCacheView(self.index, cfg.cache_size), self.future, self.importance))
        self.memtier = MemoryTier(cfg.memory)
        self.writer = ChunkWriter(cfg, self.index, self.logs, self.policy, self.memtier,
                                  self.counters)
        if cfg.debug_invariants:
            self.writer.after_commit = self._after_commit
        # iCACHE's dynamic packaging fills the L-cache when substitution is on (and the
        # policy plans packages at all)
        plans = type(self.policy).plan_package is not CachePolicy.plan_package
        self.packer = Packer(self) if cfg.substitute and plans else None
        self._children: dict[int, tuple[float, list[int]]] = {}  # dir -> (when, files)
        # fetched files waiting for the writer's room (the reader did not wait): ino ->
        # (identity, bytes), at most LATER_CHUNKS chunks' worth
        self._later: dict[int, tuple[Identity, bytes]] = {}
        self._later_bytes = 0
        self._later_empty = trio.Event()  # set (and replaced) when _later drains
        # readers waiting for the source now: scan-ahead then leaves them the link
        self.demand_fetches = 0
        self.demand_idle = trio.Event()  # set (and replaced) when demand_fetches drops to 0
        self.trace = TraceRecorder(cfg.trace) if cfg.trace else None
        self._nursery: trio.Nursery | None = None
        self._rebuilding = False
        self._rebuild_due = False
        self.handles: dict[int, Handle] = {}
        self._next_fh = 1
        self._inflight: dict[int, _Inflight] = {}
        self._loading: dict[int, trio.Event] = {}  # chunk id -> load in progress
        self._started = time.time()
        # adaptive whole-chunk reads: records served per chunk loaded, as a moving average
        self._reuse = 8.0
        self._loads = 0
        self._served = 0
        self._probe = 0
        self._recent_chunk_reads: deque[int] = deque(maxlen=64)
        # records read ahead of the reader (record mode); consumed by the next open
        # ino -> (identity, record it came from or None when prefetched from the source,
        # bytes, owning stream key)
        self.ready: dict[int, tuple[Identity, Record | None, bytes | memoryview, str]] = {}
        self._ready_bytes = 0
        self.ready_limit = max(cfg.memory // 4, cfg.chunk_size)
        self.control = None  # set by attach_control
        # losses waiting for their dataset's sample list: dataset -> [(job, idx, values)]
        self._early: dict[str, list[tuple[str, list[int], list[float]]]] = {}
        self._early_count = 0
        # planned reads of known orders (issue 9): half of --memory, taken from the tier
        self.plans = ReadPlanner(self, min(cfg.memory // 2, self.streams.lead_bytes),
                                 lead=self.streams.lead,
                                 max_batch=max(4 << 20, 2 * cfg.chunk_size))

    # ----- life cycle ----------------------------------------------------------------

    def start(self, progress: Callable[[int, int, float], None] | None = None) -> dict:
        """Blocking start-up before the filesystem is served: crash recovery, then the
        namespace scan when there is no snapshot yet or ``--rescan`` was given
        (:mod:`dlcachefs.cache.recovery`)."""
        return recover(self.cfg, self.index, self.logs, self.ns, self.writer, self.policy,
                       progress)

    def check_invariants(self) -> list[str]:
        """Violated invariants of the cache, as readable lines (empty when all hold); see
        :mod:`dlcachefs.cache.invariants`. Trio loop."""
        return check_cache(self.writer, self.index, self.logs, self.cfg.cache_size)

    def _after_commit(self) -> None:
        """--debug-invariants: check after every commit; a violation is an ERROR."""
        problems = self.check_invariants()
        if problems:
            self.counters.invariant_violations += len(problems)
            for p in problems[:10]:
                log.error("invariant violated: %s", p)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Background tasks (the chunk writer), until cancelled or :meth:`close`."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.writer.run)
            await nursery.start(self.streams.run)
            await nursery.start(self.scan.run)
            nursery.start_soon(self._maintain_policy)
            if self.packer is not None:
                await nursery.start(self.packer.run)
            self._nursery = nursery
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

    async def close(self) -> None:
        """Stop prefetching, seal and commit what is pending, and stop background work."""
        self.streams.close()
        self.scan.close()
        with trio.move_on_after(10):  # what readers were served is worth keeping
            await self.flush()
        await self.writer.close()
        if self.trace is not None:
            await trio.to_thread.run_sync(self.trace.save, self.size_of)

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
        stream = self.streams.stream_of(pid) if pid else None
        t0 = time.monotonic()
        e = await self.ns.fresh_file(ino)
        if not is_file(e):
            raise InvalidArgument("not a regular file")
        if stream is not None:
            self.streams.note_open(stream, ino)
            self.plans.poke(stream)
            if self.trace is not None:
                self.trace.opened(stream.dataset, stream.samples, stream.epoch, ino)
        if pid and (stream is None or stream.order_unknowable):
            # no known order covers this open: maybe an epoch's scan of a tree
            group = stream.key if stream is not None else self.streams.group_of(pid)
            if group is not None:
                self.scan.note_open(group, ino, e.parent)
        if e.size > self.cfg.max_cached_file:
            return await self._open_read_through(e)
        self.future.tick += 1
        self.policy.on_request(ino)
        if stream is not None and self.cfg.substitute:
            sub = await self._substitute(e, stream)
            if sub is not None:
                return sub
        data, cached, waited = await self._load(
            e, cache=stream is None or not stream.memory_prefetch, stream=stream)
        if stream is not None and stream.next_log is not None:
            stream.next_log.consumed(ino, data, identity(e))
        if stream is not None:
            stream.used.add(ino)
            stream.note_latency(cached, time.monotonic() - t0)
        if stream is not None and waited:
            stream.stall_seconds += time.monotonic() - t0
            if not cached:
                stream.bytes_from_source += len(data)
        fh = self._new_fh(Handle(ino, memoryview(data), cached))
        # keep_cache only for bytes we know are this version and when the kernel cannot
        # hold pages of an older one (the file did not change during this mount)
        changed = ino in self.ns.changed
        self.ns.changed.discard(ino)  # this open drops the kernel's pages of the file
        # a file that changed during the mount: its first open bypasses the page cache
        # (direct_io), since the kernel's idea of its size may be the old one until the
        # invalidation queued for it has gone through
        return OpenResult(fh, keep_cache=cached and not changed, direct_io=changed)

    async def _substitute(self, e: Entry, stream: Stream) -> OpenResult | None:
        """iCACHE substitution: a missed L-sample is served with the bytes of a cached
        L-sample of the SAME directory (so the class label taken from the path stays
        right) not yet used this epoch. Never an H-sample (the policy says which)."""
        if self.is_cached(e) or e.ino in self.ready or e.ino in self._inflight:
            return None
        if not self.policy.substitutable(e.ino):
            return None
        files = await self._files_in(e.parent)
        cands = [i for i in files if i != e.ino and i not in stream.used]
        if self.packer is not None:
            self.packer.wake()  # a miss is recorded and a cached L-sample used up
        while True:
            pick = self.policy.choose_substitute(e.ino, cands)
            if pick is None:
                return None
            cands.remove(pick)
            try:  # the substitute's current version, by the same freshness rule as an open
                se = await self.ns.fresh_file(pick)
            except DlcError:
                continue
            rec = self.index.get_record(pick)
            if rec is None or pick in self.writer.drops or Identity(
                    rec.size, rec.mtime_ns, rec.src_ino) != identity(se):
                continue
            data = await self._read_record(pick, rec)  # tells the policy it was served
            if data is not None:
                break
        self.counters.substitutions += 1  # neither a hit nor a miss: counted apart
        stream.used.update((pick, e.ino))
        stream.substituted[e.ino] = pick
        # the announced epoch (its order may still be being replayed)
        ep = stream.target_epoch if stream.target_epoch is not None else stream.epoch or 0
        stream.substitutions[ep] = stream.substitutions.get(ep, 0) + 1
        # the kernel knows the requested file's size: direct_io so the substitute's own
        # length is what the reader gets (a short read is its end of file)
        fh = self._new_fh(Handle(e.ino, memoryview(data), True))
        return OpenResult(fh, keep_cache=False, direct_io=True)

    async def _files_in(self, parent: int) -> list[int]:
        """Regular files of a directory (cached for the revalidation window)."""
        hit = self._children.get(parent)
        now = time.monotonic()
        if hit is not None and now - hit[0] < max(self.cfg.revalidate, 1.0):
            return hit[1]
        files = await trio.to_thread.run_sync(self._list_files, parent)
        if len(self._children) > 4096:
            self._children.clear()
        self._children[parent] = (now, files)
        return files

    def _list_files(self, parent: int) -> list[int]:
        out = []
        for _name, ino in self.index.list_dir(parent):
            ent = self.index.get_entry(ino)
            if ent is not None and is_file(ent):
                out.append(ino)
        return out

    # ----- importance (iCACHE) ---------------------------------------------------------

    def epoch_started(self, stream: Stream, samples) -> None:
        """A stream begins an epoch: note its job's caching benefit measured over the
        epoch that ended, and rebuild the H-list (in a thread) from the losses so far."""
        imp = self.importance
        imp.bind(stream.dataset or "", samples.inos, self.cfg.h_fraction)
        imp.current_epoch = max(imp.current_epoch, stream.target_epoch or 0)
        table = imp.table
        if table is None or not table.jobs:
            return
        b = stream.benefit(time.monotonic())
        if b is not None and stream.job in table.jobs:
            table.jobs[stream.job].benefit = b
        self._rebuild_due = True
        if not self._rebuilding and self._nursery is not None:
            self._nursery.start_soon(self._rebuild_importance, table)

    async def _rebuild_importance(self, table) -> None:
        """Rebuild the AIV and H-list in a thread, one rebuild at a time (several ranks
        starting an epoch ask together). Never fatal: an error is logged."""
        self._rebuilding = True
        try:
            while self._rebuild_due:
                self._rebuild_due = False
                try:
                    await trio.to_thread.run_sync(table.rebuild)
                except Exception:  # noqa: BLE001 - the mount goes on with the old H-list
                    log.exception("rebuilding the importance table failed")
        finally:
            self._rebuilding = False

    def dataset_size(self, rel: str) -> int | None:
        """Samples in the ImageFolder at ``rel`` when a stream has listed it (else None)."""
        sl = self.streams.sample_list(rel)
        return None if sl is None else len(sl.inos)

    def attach_control(self, control) -> None:
        """The mount's :class:`~dlcachefs.clairvoyance.control.ControlState`: jobs' datasets for
        :meth:`on_loss`, and its error log for losses that turn out invalid later."""
        self.control = control

    def early_loss_room(self) -> int:
        """How many more loss pairs may wait for their dataset's sample list."""
        return MAX_EARLY_LOSSES - self._early_count

    def on_loss(self, job: str, indices: list[int], values: list[float]) -> None:
        """Losses a job reported (``loss`` control lines): its IVs. A loss reported for a
        sample that was substituted belongs to the sample actually served.

        Nothing valid is dropped: losses that arrive before their dataset's sample list
        is known (a script that announces and reports at once) wait, at most
        ``MAX_EARLY_LOSSES`` pairs (the control file refuses more with EINVAL, see
        :meth:`early_loss_room`), while the list is made in the background; they are
        applied in arrival order once it is known."""
        js = self.control.jobs.get(job) if self.control is not None else None
        dataset = dataset_key(js) if js is not None else self.streams.job_dataset(job)
        if dataset is None:  # control refuses losses of a job without a dataset
            self.counters.losses_ignored += len(indices)
            return
        sl = self.streams.sample_list(dataset)
        if sl is None or self._early.get(dataset):
            self._early.setdefault(dataset, []).append((job, indices, values))
            self._early_count += len(indices)
            self.streams.list_soon(dataset, self._apply_early_losses,
                                   js.view if js is not None else None)
            return
        self._apply_losses(job, dataset, sl, indices, values)

    def _apply_early_losses(self, dataset: str) -> None:
        """The sample list of ``dataset`` is known: apply the losses that waited for it."""
        sl = self.streams.sample_list(dataset)
        queued = self._early.pop(dataset, [])
        for job, indices, values in queued:
            self._early_count -= len(indices)
            if sl is not None:
                self._apply_losses(job, dataset, sl, indices, values)
            else:
                self._note_invalid(f"{len(indices)} losses of job {job!r} dropped: the "
                                   f"sample list of dataset {dataset or '.'!r} could not be "
                                   f"made")
                self.counters.losses_ignored += len(indices)

    def _note_invalid(self, msg: str) -> None:
        log.warning("%s", msg)
        if self.control is not None:
            self.control.note(msg)

    def _apply_losses(self, job: str, dataset: str, sl, indices: list[int],
                      values: list[float]) -> None:
        n = len(sl.inos)
        if any(not 0 <= i < n for i in indices):  # accepted before the list was known
            pairs = [(i, v) for i, v in zip(indices, values, strict=True) if 0 <= i < n]
            bad = len(indices) - len(pairs)
            self.counters.losses_ignored += bad
            self._note_invalid(f"{bad} losses of job {job!r} dropped: index out of range, "
                               f"dataset {dataset or '.'!r} has {n} samples")
            indices, values = [i for i, _ in pairs], [v for _, v in pairs]
        imp = self.importance
        imp.bind(dataset, sl.inos, self.cfg.h_fraction)
        # losses arrive late (the reporter batches): the last epoch's map, then this one's
        subs: dict[int, int] = {}
        for st in self.streams.streams.values():
            if st.job == job:
                subs.update(st.substituted_before)
                subs.update(st.substituted)
        if subs:
            idx = imp.index_of
            indices = [idx.get(subs.get(sl.inos[i], -1), i) for i in indices]
        if imp.table is None:
            return
        imp.table.update(job, indices, values)
        if self.trace is not None:
            self.trace.lost(dataset, imp.current_epoch, indices, values)
        self.counters.losses += len(indices)

    def _after_use(self, chunk_id: int, ino: int) -> None:
        """A record of the chunk was served: tell the policy; release if it says so."""
        self.policy.on_access(chunk_id, ino)
        if self.policy.release_after_use(chunk_id, ino):
            self.counters.released_after_use += 1
            self.writer.retire_chunk(chunk_id)

    async def read(self, fh: int, offset: int, size: int) -> bytes | memoryview:
        h = self.handles.get(fh)
        if h is None:
            raise InvalidArgument("bad file handle")
        if h.data is not None:
            out = h.data[offset : offset + size]
            if h.cached:
                self.counters.bytes_from_cache += len(out)
            return out
        data = await self.calls.call(pread_checked, h.fd, offset, size, h.ident,
                                     self.cfg.use_source_inode)
        self.counters.bytes_from_source += len(data)
        return data

    def release(self, fh: int) -> None:
        h = self.handles.pop(fh, None)
        if h is not None and h.fd >= 0:
            os.close(h.fd)

    def _new_fh(self, h: Handle) -> int:
        fh = self._next_fh
        self._next_fh += 1
        self.handles[fh] = h
        return fh

    async def _open_read_through(self, e: Entry) -> OpenResult:
        if not isinstance(self.source, LocalSource):
            raise InvalidArgument("file too large to cache and the source has no ranged reads")
        rel = self.ns.path_of(e)
        fd, ident = await self.calls.call(open_for_range_reads, self.source, rel,
                                          self.cfg.use_source_inode)
        if ident != identity(e):
            e = await trio.to_thread.run_sync(self.ns.update_identity, e, ident)
            self.ns.changed_on_source(e)
        self.counters.misses += 1
        return OpenResult(self._new_fh(Handle(e.ino, None, False, fd, ident)),
                          keep_cache=False, direct_io=True)

    # ----- cache lookups -------------------------------------------------------------

    def size_of(self, ino: int) -> int:
        e = self.index.get_entry(ino)
        return e.size if e is not None else 0

    def is_cached(self, e: Entry) -> bool:
        """True when the current version of ``e`` is indexed or waiting to be sealed."""
        ident = identity(e)
        rec = self.index.get_record(e.ino)
        if rec is not None and e.ino not in self.writer.drops and Identity(
                rec.size, rec.mtime_ns, rec.src_ino) == ident:
            return True
        p = self.writer.pending.get(e.ino)
        if p is not None and p.ident == ident:
            return True
        later = self._later.get(e.ino)
        return later is not None and later[0] == ident

    async def prefetch_one(self, ino: int, stream: Stream) -> bool:
        """Make sure the current version of ``ino`` is in the cache (and its chunk in the
        memory tier, when whole chunks are being read); True if it was fetched."""
        e = await self.ns.fresh_file(ino)
        if e.size > self.cfg.max_cached_file or ino in self._inflight or ino in self.ready:
            return False
        if self.is_cached(e):
            if not self.plans.wanted(stream):  # a plan reads it ahead instead
                await self._preload(ino, stream.key)
            return False
        if self.cfg.substitute and self.policy.substitutable(ino):
            return False  # an L-sample: its open may be served by substitution instead
        await self.writer.wait_room()
        if self.is_cached(e) or ino in self._inflight:
            return False
        if stream.memory_prefetch:
            # the disk cache is kept for the logs: hold it in memory until it is read
            data, e = await self._fetch(e, cache=False)
            self._put_ready(ino, identity(e), None, data, stream.key)
        else:
            data, e = await self._fetch(e)
            p = self.writer.pending.get(ino)
            if (p is None or p.ident != identity(e)) and (
                    self._ready_bytes + len(data) <= self.ready_limit):
                # the policy did not admit it (or the writer skipped it): hold it in
                # memory until it is read, rather than fetch it twice
                self._put_ready(ino, identity(e), None, data, stream.key)
        stream.bytes_from_source += len(data)
        self.counters.prefetched += 1
        return True

    async def scan_one(self, ino: int) -> tuple[int, bool]:
        """Scan-ahead (:mod:`dlcachefs.cache.scanahead`): fetch ``ino`` into the cache unless it
        is there or on its way; (bytes fetched, whether the cache kept them)."""
        e = await self.ns.fresh_file(ino)
        if (e.size > self.cfg.max_cached_file or ino in self._inflight or ino in self.ready
                or self.is_cached(e)):
            return 0, False
        if self.cfg.substitute and self.policy.substitutable(ino):
            return 0, False  # an L-sample: its open may be served by substitution instead
        await self.writer.wait_room(e.size)
        if self.is_cached(e) or ino in self._inflight:
            return 0, False
        # fetched without caching, then submitted here once the writer has room: a guess
        # never takes the bounded room readers' own files wait in (_later_bytes)
        data, e = await self._fetch(e, cache=False)
        self.counters.scan_ahead_files += 1
        self.counters.scan_ahead_bytes += len(data)
        ident = identity(e)
        if ino in self._later or self.is_cached(e):
            return len(data), self.is_cached(e)
        self._later[ino] = (ident, data)  # readers find it while it waits for the writer
        try:
            await self.writer.wait_room(len(data))
            cur = self.index.get_entry(ino)
            if cur is None or identity(cur) != ident:
                return len(data), False  # a newer version came meanwhile
            p = self.writer.pending.get(ino)
            if p is not None:
                return len(data), p.ident == ident
            if self.writer.room() < len(data) + 4096:
                return len(data), False  # room taken meanwhile: never evict for a guess
            if not self.policy.admit(ino, len(data)):
                self.counters.not_admitted += 1
                return len(data), False
            if not self.writer.submit(ino, self.ns.path_of(e), ident, data):
                self.policy.on_dropped(ino)
                return len(data), False
            return len(data), True
        finally:
            self._later_release(ino)

    async def _preload(self, ino: int, owner: str) -> None:
        """Ahead of the reader: its chunk into the memory tier when whole chunks are being
        reused, else the record alone into the small ready set (the reader then never
        waits for the disk)."""
        rec = self.index.get_record(ino)
        if rec is None or rec.chunk_id in self.memtier or rec.chunk_id in self._loading:
            return
        c = self.index.get_chunk(rec.chunk_id)
        if c is None or not self.writer.pin(c.chunk_id):
            return
        try:
            if (c.length <= self.memtier.limit // 3 and self.memtier.can_hold(c.length)
                    and self._reuse >= 2.0):
                if await self._load_chunk_into_memory(c) is not None:
                    self.counters.chunk_preloads += 1
            elif ino not in self.ready and self._ready_bytes + rec.size <= self.ready_limit:
                data = await self._read_single(ino, rec, True, "record_preloads")
                if data is not None and self.index.get_record(ino) == rec:
                    self._put_ready(ino, Identity(rec.size, rec.mtime_ns, rec.src_ino), rec, data,
                                    owner)
        finally:
            self.writer.unpin(c.chunk_id)

    def _put_ready(self, ino: int, ident: Identity, rec: Record | None,
                   data: bytes | memoryview, owner: str) -> None:
        old = self.ready.pop(ino, None)
        if old is not None:
            self._ready_bytes -= len(old[2])
        self.ready[ino] = (ident, rec, data, owner)
        self._ready_bytes += len(data)

    def drop_ready(self, owner: str) -> None:
        """Forget what was read ahead for one stream's epoch that is over."""
        for ino in [i for i, v in self.ready.items() if v[3] == owner]:
            self._ready_bytes -= len(self.ready.pop(ino)[2])

    async def bytes_for(self, ino: int, ident: Identity) -> bytes | memoryview | None:
        """The bytes of this version of ``ino`` from the cache, else the source; None when
        the file is gone or no longer this version (used to fill reordered logs)."""
        e = self.index.get_entry(ino)
        if e is None or identity(e) != ident:
            return None
        rec = self.index.get_record(ino)
        if rec is not None and ino not in self.writer.drops and Identity(
                rec.size, rec.mtime_ns, rec.src_ino) == ident:
            data = await self._read_record(ino, rec, background=True)
            if data is not None:
                return data
        p = self.writer.pending.get(ino)
        if p is not None and p.ident == ident:
            return p.data
        later = self._later.get(ino)
        if later is not None and later[0] == ident:
            return later[1]
        data, e2 = await self._fetch(e)
        return data if identity(e2) == ident else None

    async def _load(self, e: Entry, cache: bool = True, stream: Stream | None = None
                    ) -> tuple[bytes | memoryview, bool, bool]:
        """Bytes of the current version of ``e``, whether they came from the cache, and
        whether the open had to wait for the source. An open of a ``stream`` whose epoch
        is read through a plan takes the plan's bytes, or reads the record alone."""
        ident = identity(e)
        rec = self.index.get_record(e.ino)
        early = self.ready.pop(e.ino, None)
        if early is not None:
            self._ready_bytes -= len(early[2])
            if early[0] == ident and early[1] is None:  # fetched ahead, kept in memory only
                self.counters.prefetch_hits += 1
                return early[2], False, False
        if rec is not None and e.ino not in self.writer.drops:
            if Identity(rec.size, rec.mtime_ns, rec.src_ino) == ident:
                if early is not None and early[1] == rec:
                    self.counters.hits += 1
                    self._after_use(rec.chunk_id, e.ino)
                    return early[2], True, False
                plan = self.plans.plan_for(stream)
                if plan is not None and not plan.covers(e.ino):
                    plan = None
                if plan is not None:
                    data = await plan.take(e.ino, rec)
                    if data is not None:
                        self.counters.hits += 1
                        self.counters.planned_hits += 1
                        self._after_use(rec.chunk_id, e.ino)
                        return data, True, False
                whole = plan is None and not self.plans.pending(stream)
                data = await self._read_record(e.ino, rec, whole=whole)
                if data is not None:
                    self.counters.hits += 1
                    return data, True, False
            else:
                self.counters.stale_refetches += 1
                self.writer.drop(e.ino)
        p = self.writer.pending.get(e.ino)
        if p is not None and p.ident == ident:
            self.counters.hits += 1
            return p.data, True, False
        later = self._later.get(e.ino)
        if later is not None and later[0] == ident:  # fetched, waiting for the writer
            self.counters.hits += 1
            return later[1], True, False
        waits = e.ino in self._inflight  # a prefetch is on it: wait for it (a miss all the same)
        self.demand_fetches += 1
        try:
            data, _ = await self._fetch(e, cache or waits)
        finally:
            self.demand_fetches -= 1
            if not self.demand_fetches:
                self.demand_idle.set()
                self.demand_idle = trio.Event()
        self.counters.misses += 1
        self.counters.fetch_waits += waits
        return data, False, True

    async def _read_record(self, ino: int, rec: Record, background: bool = False,
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
                    return await self._read_single(ino, rec, background)
                buf = await self._load_chunk_into_memory(c)
                if buf is None:
                    return self._bad(ino)
            finally:
                self.writer.unpin(rec.chunk_id)
        else:
            self._served += 1
        start = rec.offset - buf.offset
        view = memoryview(buf.data)[start : start + rec.size]
        if len(view) != rec.size or (not buf.verified and checksum(view) != rec.data_xxh):
            return self._bad(ino)
        if not background:
            self._after_use(rec.chunk_id, ino)
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

    async def _read_single(self, ino: int, rec: Record, background: bool = False,
                           counter: str = "fill_reads") -> memoryview | None:
        """One record from the log, checked against its checksum. ``background`` reads
        count under ``counter`` instead of ``record_reads``."""
        try:
            data = await trio.to_thread.run_sync(self.logs.read, rec.log_id, rec.offset,
                                                 rec.size, limiter=self.disk_limiter)
        except (FormatError, OSError):
            return self._bad(ino)
        if background:
            setattr(self.counters, counter, getattr(self.counters, counter) + 1)
        else:
            self.counters.record_reads += 1
        if checksum(data) != rec.data_xxh:
            return self._bad(ino)
        if not background:
            self._after_use(rec.chunk_id, ino)
        return memoryview(data)

    def _bad(self, ino: int) -> None:
        self.counters.checksum_failures += 1
        self.writer.drop(ino)
        return None

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

    # ----- source fetches ------------------------------------------------------------

    async def _fetch(self, e: Entry, cache: bool = True) -> tuple[bytes, Entry]:
        """Fetch a whole file from the source (concurrent opens of one file share it)."""
        while (inf := self._inflight.get(e.ino)) is not None:
            await inf.done.wait()
            if inf.result is not None:
                return inf.result
            if isinstance(inf.error, Exception):
                raise inf.error
            # the fetching task was cancelled, not this one: never re-raise its Cancelled
        inf = self._inflight[e.ino] = _Inflight()
        try:
            inf.result = await self._fetch_now(e, cache)
            return inf.result
        except BaseException as exc:
            inf.error = exc
            raise
        finally:
            del self._inflight[e.ino]
            inf.done.set()

    async def _fetch_now(self, e: Entry, cache: bool = True) -> tuple[bytes, Entry]:
        rel = self.ns.path_of(e)
        data, ident = await self.calls.read_file(rel)
        if ident != identity(e):
            # changed since it was listed: serve the new version, and tell the kernel
            e = await trio.to_thread.run_sync(self.ns.update_identity, e, ident)
            self.ns.changed_on_source(e)
        self.counters.bytes_from_source += len(data)
        if not cache:
            return data, e
        if not self.policy.admit(e.ino, len(data)):
            self.counters.not_admitted += 1
            return data, e
        if not self.writer.has_room(len(data)):
            # the reader has its bytes and does not wait for the cache disk (an fdatasync
            # under load takes 100s of ms): the file waits for the writer's room in the
            # background, up to LATER_CHUNKS chunks' worth; past that the reader waits
            # (backpressure: memory stays bounded and nothing is left uncached)
            if self._submit_later(e.ino, rel, ident, data):
                return data, e
            await self.writer.wait_room(len(data))
        if not self.writer.submit(e.ino, rel, ident, data):
            self.policy.on_dropped(e.ino)
        return data, e

    def _submit_later(self, ino: int, rel: bytes, ident: Identity, data: bytes) -> bool:
        """Queue the file for the writer in the background; False when the bound is
        reached (one file waits whatever its size, as the writer takes one whatever
        its size)."""
        if self._nursery is None or ino in self._later or (
                self._later and self._later_bytes + len(data) > LATER_CHUNKS * self.cfg.chunk_size):
            return False
        self._later[ino] = (ident, data)
        self._later_bytes += len(data)
        self._nursery.start_soon(self._submit_when_room, ino, rel, ident, data)
        return True

    async def _submit_when_room(self, ino: int, rel: bytes, ident: Identity,
                                data: bytes) -> None:
        try:
            await self.writer.wait_room(len(data))
            e = self.index.get_entry(ino)
            p = self.writer.pending.get(ino)
            if p is not None and p.ident == ident:
                pass  # this version is already on its way
            elif e is None or identity(e) != ident or p is not None:
                self.policy.on_dropped(ino)  # a newer version came meanwhile: not this one
            elif not self.writer.submit(ino, rel, ident, data):
                self.policy.on_dropped(ino)
        except Exception:  # noqa: BLE001 - a policy's failure must not end the mount
            log.exception("caching a fetched file failed")
        finally:
            self._later_bytes -= len(data)
            self._later_release(ino)

    def _later_release(self, ino: int) -> None:
        self._later.pop(ino, None)
        if not self._later:
            self._later_empty.set()
            self._later_empty = trio.Event()

    async def flush(self) -> None:
        """Seal everything fetched so far, the files still waiting for the writer's room
        included (tests, and an orderly unmount)."""
        while self._later:
            await self._later_empty.wait()
        await self.writer.flush()

    # ----- stats ---------------------------------------------------------------------

    def stats(self) -> dict:
        """The ``.dlcache/stats`` document (counters since mount; cache state cumulative)."""
        snap = self.index.snapshot()
        out = {
            "version": __version__,
            "pid": os.getpid(),
            "source": os.fsdecode(self.source.root),
            "mountpoint": self.cfg.mountpoint,
            "cache_dir": self.cfg.cache_dir,
            "uptime_s": round(time.time() - self._started, 3),
            "files": snap["files"],
            "bytes_total": snap["bytes_total"],
            "cached_files": snap["records"],
            "cached_bytes": snap["cached_bytes"],
            "chunks": snap["chunks"],
            "chunk_bytes": snap["chunk_bytes"],
            "cache_limit_bytes": self.cfg.cache_size,
            "memory_bytes": self.memtier.bytes,
            "memory_limit_bytes": self.memtier.limit,
            # fetched, not yet in a sealed chunk (waiting for the writer's room included)
            "pending_bytes": self.writer.open_bytes + self.writer.sealing_bytes
            + self._later_bytes,
            # the --cache-size account: chunk_bytes - evicting_bytes + reserved_bytes
            # <= cache_limit_bytes (see dlcachefs.cache.writer)
            "reserved_bytes": self.writer.pending_bytes,
            "evicting_bytes": self.writer.doomed_bytes,
            "open_files": len(self.handles),
            "revalidate_s": self.cfg.revalidate,
            # torch loaded (at mount start, in the background): announced samplers replay
            "sampler_replay_ready": self.streams.replay_ready,
            "losses_waiting": self._early_count,
            # trees fetched ahead of readers whose order is unknown (dlcachefs.cache.scanahead)
            "scan_ahead": self.scan.stats(),
        }
        out.update(self.counters.as_dict())
        out["cache_disk_bytes_read"] = self.logs.bytes_read  # every pread that serves
        # reordered logs' chunks read back (just written) to checksum them before a seal
        out["cache_disk_bytes_read_back"] = self.logs.bytes_read_back
        out["read_plans"] = self.plans.stats()
        out["streams"] = self.streams.stats()
        for key, rel in self.scan.tree_of_groups().items():
            if key in out["streams"]:
                out["streams"][key]["scan_ahead"] = rel
        out["policy"] = {"name": self.cfg.policy, **self.policy.stats()}
        out["packer"] = None if self.packer is None else self.packer.as_dict()
        t = self.importance.table
        out["importance"] = None if t is None else {
            "dataset": self.importance.dataset, "samples": t.n, "version": t.version(),
            "h_samples": None if t.high is None else sum(t.high),
            "jobs": {k: {"reported": j.reported, "benefit": j.benefit}
                     for k, j in t.jobs.items()}}
        return out
