"""Streams: one per (job, rank) that announced its sampler; clairvoyant prefetch for each.

When a stream knows its dataset (an ImageFolder root), its sampler and its epoch, the
order of that epoch is known exactly (:mod:`dlcachefs.clairvoyance.replay`). The prefetcher then
fetches the samples from the source in that order, ahead of the reader, into the cache
(the chunk writer packs them into chunks in fetch order, so the epoch's log comes out in
its read order).

Reader position: opens are attributed to a stream by process (the process that wrote
the control lines and its descendants, i.e. DataLoader workers, found through
``/proc/<pid>/stat`` parents). Each open marks the first not-yet-consumed position of
that sample in the order; ``position`` is the first position not consumed. Workers read
slightly out of order; that only leaves a few holes behind ``position`` for a moment.

Bounds: at most ``lead`` samples (and ``lead_bytes``) ahead of the reader, at most
``concurrency`` fetches in flight, and never faster than the chunk writer takes them.
Chunks loaded whole into the memory tier ahead of the reader stay within the tier, from
the chunk of the reader's position on, and are ``want``-ed there until the reader's
position passes their last record (the tier evicts them last).

Modes (``mode`` and ``reason`` of each stream in stats):

* ``replayed``: the order is the sampler's, replayed (:mod:`dlcachefs.clairvoyance.replay`) over the
  job's dataset; a dataset that is a *view* (wrapped ImageFolders,
  :mod:`dlcachefs.client.wrappers`) is the concatenation of its roots' ImageFolder lists seen
  through its index list, each root's list checked against the training's digest first.
* ``learned``: the training said its order cannot be replayed (``sampler unknown``); the
  stream is formed from the opens of the process tree, epoch by epoch (``epoch`` lines).
  When the order of opens of an epoch repeats the previous epoch's (up to the small
  reordering of loader workers), that order is prefetched for the next epoch.
* ``none``: nothing is prefetched, with the reason: a digest mismatch, an error, or (for
  processes that never announced, ``unannounced/PGID`` entries, at most
  ``MAX_UNANNOUNCED``) nothing was announced.

Concurrency: all state on the trio loop; each stream's prefetcher is a task in the
engine's nursery, cancelled and replaced when the stream's epoch or sampler changes.
"""

from __future__ import annotations

import logging
import operator
import os
import stat
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np
import trio

from dlcachefs.clairvoyance.control import JobState, StreamState, ViewDef
from dlcachefs.clairvoyance.pace import Pace
from dlcachefs.clairvoyance.protocol import ENV_LAUNCHED, paths_digest
from dlcachefs.clairvoyance.reorder import NextEpochLog, ReorderEngine
from dlcachefs.clairvoyance.replay import SamplerSpec
from dlcachefs.clairvoyance.replayworker import RemoteReplayer, ReplayClosed, ReplayWorker
from dlcachefs.clairvoyance.samplelist import (
    IMG_EXTENSIONS,
    SampleList,
    image_folder,
    links_leaving,
)
from dlcachefs.errors import DlcError
from dlcachefs.store.schema import Chunk, Entry

if TYPE_CHECKING:
    from dlcachefs.cache.buffers import ReadAhead
    from dlcachefs.cache.memtier import MemoryTier
    from dlcachefs.cache.namespace import Namespace
    from dlcachefs.cache.prefetch import Prefetcher
    from dlcachefs.cache.readplan import ReadPlanner
    from dlcachefs.cache.views import StreamFuture
    from dlcachefs.importance.losses import Losses

MAX_UNANNOUNCED = 8  # stats entries for processes that read without announcing
MAX_LEARNED = 1 << 22  # opens remembered per epoch of a learned stream
#: a stream that opened nothing for this long (a training that ended or died mid-epoch)
#: no longer protects its logs from eviction (StreamManager.unprotect_idle)
IDLE_S = 300.0
NOTHING_ANNOUNCED = ("nothing announced: run the script under `dlcachefs run` or call "
                     "dlcachefs.torch.install()")
HOOKED_SILENT = ("nothing announced although the torch hook is installed (`dlcachefs run`): "
                 "no DataLoader iterated over a dataset on this mount (samples read as "
                 "dataset[i] without a DataLoader are not seen by the hook), or the hook "
                 "could not map it (its warnings on the training's stderr say why)")
HOOK_LOST = ("nothing announced: started by `dlcachefs run`, but PYTHONPATH was replaced on "
             "the way (a wrapper script that sets PYTHONPATH=...), so the torch hook is not "
             "loaded: extend it instead (export PYTHONPATH=...:$PYTHONPATH), or call "
             "dlcachefs.torch.install()")

log = logging.getLogger(__name__)

#: an epoch whose opens of cached files were at least this many, and of which at most
#: one in PAGED_READ_EVERY was READ, was served by the kernel's page cache
#: (Stream.pages_served)
PAGED_MIN_OPENS = 32
PAGED_READ_EVERY = 10
#: within an epoch, a window of PAGED_MIN_OPENS outcomes with at most one READ in this
#: many starts pages_served (a stricter bound than the one that ends it: hysteresis)
PAGED_FOUND_EVERY = 30

MAX_SAMPLE_LISTS = 4  # sample lists kept (train and val views of the jobs, a guess)
MAX_GUESSES = 8  # directories listed ahead of an announcement, per mount
LIST_RETRY_S = 30.0  # a dataset whose listing failed is not listed again before this


def same_dataset(old: SampleList | None, new: SampleList) -> bool:
    """Whether an epoch over ``new`` reads the dataset the last one (over ``old``) read:
    the same list, or the same root (a view's key included)."""
    return old is not None and (new is old or new.root == old.root)


#: why a stream's next epoch's log was given up (stats: ``reorder``)
GIVEN_UP = ("given up: the kernel's page cache serves this epoch "
            "(page_cache.serves_this_epoch); laid out again at the start of an epoch that "
            "follows one whose READs came")


@dataclass
class Stream:
    job: str
    rank: int
    dataset: str | None = None
    samples: SampleList | None = None
    replayer: RemoteReplayer | _Explicit | _Learned | None = None
    epoch: int | None = None
    order: list[int] = field(default_factory=list)  # dataset indices of the current epoch
    positions: Positions = field(default_factory=lambda: Positions([]))
    consumed: bytearray = field(default_factory=bytearray)
    ready: bytearray = field(default_factory=bytearray)
    position: int = 0
    prefetched_upto: int = 0
    stall_seconds: float = 0.0
    bytes_from_source: int = 0
    prefetched: int = 0
    cancel: trio.CancelScope | None = None
    moved: trio.Event = field(default_factory=trio.Event)
    pids: set[int] = field(default_factory=set)
    error: str | None = None
    target_epoch: int | None = None  # announced; ``epoch`` catches up once its order is known
    early: list[int] = field(default_factory=list)  # opens seen before the order was known
    next_log: NextEpochLog | None = None  # the next epoch's log being laid out (LCache)
    chunks_ahead: _ChunksAhead | None = None  # its prefetcher's chunks loaded ahead
    reorder: str = ""  # why no next epoch's log is laid out (stats), when that is decided
    memory_prefetch: bool = False  # dataset > half the cache: prefetch into memory only
    current_log: NextEpochLog | None = None  # the reordered log this epoch reads
    last_open: float = 0.0  # monotonic time of its epoch switch or last open in its order
    explicit: dict | None = None  # epoch -> order, for ``sampler explicit`` (order lines)
    # the next epoch's order when known: sample -> first position (the policy's future)
    next_first: Positions | None = None
    next_first_order: list[int] = field(default_factory=list)
    #: a distributed sampler's cluster-wide use (every rank's order), with --peers only
    cluster: ClusterUse | None = None
    used: set[int] = field(default_factory=set)  # inodes served this epoch (substitution)
    substituted: dict[int, int] = field(default_factory=dict)  # requested -> served ino
    substituted_before: dict[int, int] = field(default_factory=dict)  # the last epoch's
    epoch_tick: int = 0  # the policy clock's tick when this epoch began
    # the announced epoch already begun for importance while its order is being replayed
    # (a replay restarted by ``on_order`` must not begin it twice)
    begun: int | None = None
    substitutions: dict[int, int] = field(default_factory=dict)  # epoch -> count
    # open latencies, for the job's measured caching benefit (iCACHE III-D)
    hit_s: float = 0.0
    hit_n: int = 0
    miss_s: float = 0.0
    miss_n: int = 0
    epoch_t0: float = 0.0
    mode: str = "none"  # replayed | learned | none
    reason: str = "waiting for the dataset, sampler and epoch"
    learn_epoch: int | None = None  # learned streams: the epoch whose opens are recorded
    learn_cur: list[int] | None = None  # inodes opened this epoch, in order
    learn_prev: list[int] | None = None  # the last complete epoch's opens
    learn_stable: bool = False  # the last two epochs opened in the same order
    learn_compared: bool = False  # two complete epochs were compared
    learn_pair: tuple[list[int], list[int]] | None = None  # epochs still to compare
    # this epoch's order is the last epoch's again (a generator seeded anew each epoch, a
    # DistributedSampler whose set_epoch is never called): the next one is taken to
    # repeat it too, and no next-epoch log is laid out (the last one is read in order)
    repeats: bool = False
    # its epoch was announced again (a restart, or a set_epoch never called) and is being
    # configured: the opens meanwhile are the new pass's, kept in ``early`` until it is
    restarting: bool = False
    pace: Pace = field(default_factory=Pace)  # the loader's fetch timings (DLCache Alg. 2)
    # opens of cached files this epoch, and how many of them were READ: the others the
    # kernel served from its page cache. An epoch served so (the dataset fits in RAM) has
    # the next one read nothing ahead from the logs (pages_served): no read plan, no
    # preloads, each open loaded at its first READ, if one comes.
    cached_opens: int = 0
    cached_reads: int = 0
    pages_served: bool = False
    # which epoch's count an open is in (bumped at each switch): an open counted in one
    # epoch whose READ, or release, comes after the switch is not the next epoch's
    page_count: int = 0
    # the last PAGED_MIN_OPENS of them whose outcome is known (READ, or released without
    # one): READs coming back (the kernel dropped the pages) end pages_served at once, and
    # the epoch's read plan starts (pages_lost) or resumes; hardly any (at most one in
    # PAGED_FOUND_EVERY: the kernel holds what the last epoch read) start it, and the plan
    # pauses (it read the epoch after the first one whole again, for opens the kernel
    # served). The stricter bound to start it keeps a kernel that holds most pages from
    # flipping the verdict at every window.
    recent_opens: int = 0
    recent_reads: int = 0
    pages_lost: trio.Event = field(default_factory=trio.Event)
    pages_judged: bool = False  # a window of this epoch's opens was judged (a read plan
    # reads only a little ahead until then: readplan.FIRST_LEAD)

    def note_latency(self, cached: bool, seconds: float) -> None:
        if cached:
            self.hit_s += seconds
            self.hit_n += 1
        else:
            self.miss_s += seconds
            self.miss_n += 1

    def benefit(self, now: float) -> float | None:
        """Estimated T_cacheless / T_cache of this stream's epoch so far: its wall time
        per sample, and what it would be if its cache hits had waited like its misses
        (reads are sequential per loader worker). None until both were measured."""
        n = self.hit_n + self.miss_n
        if self.hit_n < 20 or self.miss_n < 20 or now <= self.epoch_t0:
            return None
        per = (now - self.epoch_t0) / n
        extra = self.hit_n / n * max(0.0, self.miss_s / self.miss_n - self.hit_s / self.hit_n)
        return (per + extra) / per

    @property
    def order_unknowable(self) -> bool:
        """No order will cover the opens now: a learned stream whose order has not repeated
        yet, or one whose replay failed (scan-ahead may guess for it). A stream whose
        announced order is still being computed is not one."""
        if self.order and self.epoch == self.target_epoch:
            return False
        return self.learn_cur is not None or self.error is not None

    def laid_out_log(self) -> int | None:
        """The id of the log laid out for the epoch being read (the announced one from
        its announcement on, before the switch: its log is still ``next_log``), None when
        that epoch has none, or its log failed (then no record is "outside" it)."""
        if self.target_epoch is not None and self.target_epoch != self.epoch:
            nl = self.next_log
            if nl is not None and nl.epoch == self.target_epoch and not nl.failed:
                return nl.log_id
            return None
        cur = self.current_log
        return None if cur is None or cur.failed else cur.log_id

    @property
    def key(self) -> str:
        return f"{self.job}/{self.rank}"

    def end_page_count(self, same_dataset: bool = True) -> None:
        """An epoch switch: decide from the epoch that ended whether the kernel's page
        cache serves this stream (see ``pages_served``), and count anew. Another dataset
        than the last epoch's: nothing is known of its pages."""
        n, r = self.cached_opens, self.cached_reads
        self.pages_served = (same_dataset and n >= PAGED_MIN_OPENS
                             and r * PAGED_READ_EVERY <= n)
        self.cached_opens = self.cached_reads = self.recent_opens = self.recent_reads = 0
        self.page_count += 1
        self.pages_lost = trio.Event()
        self.pages_judged = False

    def note_cached_open(self) -> int:
        """An open of a cached file whose bytes could be loaded lazily (see
        ``pages_served``): counted for the epoch's verdict; its outcome, a READ
        (:meth:`note_cached_read`) or none (:meth:`note_unread`), is counted in the
        current window. Returns the count it is in, for its outcome."""
        self.cached_opens += 1
        return self.page_count

    def note_cached_read(self, count: int) -> None:
        """The first READ of such an open: the kernel's pages did not serve it."""
        if count != self.page_count:
            return  # opened in an epoch that has ended
        self.cached_reads += 1
        self.recent_reads += 1
        self._judge()

    def note_unread(self, count: int) -> None:
        """Such an open was released with no READ: the kernel's pages served it."""
        if count == self.page_count:
            self._judge()

    def _judge(self) -> None:
        """One more outcome in the window; every PAGED_MIN_OPENS of them, a page-served
        stream whose READs came back (more than one in PAGED_READ_EVERY) is served so no
        longer (``pages_lost`` set), and one whose READs hardly come (at most one in
        PAGED_FOUND_EVERY) is served so from now on (its plan pauses). Outcomes, not
        opens: many opens answered before their READs come (a loader with many threads)
        would look served."""
        self.recent_opens += 1
        if self.recent_opens < PAGED_MIN_OPENS:
            return
        self.pages_judged = True
        if self.pages_served and self.recent_reads * PAGED_READ_EVERY > self.recent_opens:
            self.pages_served = False
            self.pages_lost.set()
        elif (not self.pages_served
              and self.recent_reads * PAGED_FOUND_EVERY <= self.recent_opens):
            self.pages_served = True
            self.pages_lost = trio.Event()
            self._give_up_next_log()
        self.recent_opens = self.recent_reads = 0

    def _give_up_next_log(self) -> None:
        """The kernel's pages serve this epoch: the next epoch's log being laid out would
        be written, and read back, for an epoch they serve too (and its slots need every
        open of this one loaded from the logs: none could be lazy). It is given up; its
        chunks sealed so far stay ordinary cache. Not for a cache too small for the
        dataset (memory_prefetch): there the log says which samples stay cached."""
        nl = self.next_log
        if nl is None or self.memory_prefetch:
            return
        nl.abandon()
        self.next_log = None
        self.reorder = GIVEN_UP
        log.info("stream %s: the kernel's page cache serves epoch %d; its next epoch's "
                 "log is given up", self.key, self.epoch)

    def stats(self) -> dict:
        hi = min(self.prefetched_upto, len(self.order))
        lead = sum(1 for p in range(self.position, hi) if self.ready[p])
        return {"mode": self.mode, "reason": self.reason,
                "epoch": self.epoch, "position": self.position, "samples": len(self.order),
                "prefetch_lead": lead, "prefetched": self.prefetched,
                "stall_seconds": round(self.stall_seconds, 3),
                "bytes_from_source": self.bytes_from_source, "dataset": self.dataset,
                "substitutions": {str(k): v for k, v in sorted(self.substitutions.items())},
                "error": self.error, "loader": self.pace.stats(),
                "page_cache": {"cached_opens": self.cached_opens,
                               "read": self.cached_reads,
                               "serves_this_epoch": self.pages_served},
                # --peers: every rank's order is known (the tier's expiry is the cluster's)
                "cluster_ranks": None if self.cluster is None else self.cluster.world,
                "next_log": None if self.next_log is None else {
                    "epoch": self.next_log.epoch, "chunks": len(self.next_log.chunks),
                    "sealed": self.next_log.sealed, "failed": self.next_log.failed},
                **({"reorder": self.reorder} if self.reorder else {})}


class StreamEngine(ReorderEngine, Protocol):
    """What the :class:`StreamManager` uses of the engine
    (:class:`~dlcachefs.cache.engine.Engine` provides it), besides what it hands on to the
    :class:`NextEpochLog` of each stream (:class:`ReorderEngine`): the namespace (sample
    lists, sizes, paths), the index's typed listings, ``writer.retire_chunk`` (LCache's
    release after use), the read-ahead set (``drop_owner``, ``limit``), the memory
    tier (``limit``: whether a next epoch's log is worth laying out; ``want``,
    ``unwant``, ``wanted_bytes``, ``reserved``: the chunks loaded ahead of a reader),
    ``losses.epoch_started``, the policy clock ``future.tick``, ``plans.run`` (an epoch's
    read plan) and ``prefetcher.prefetch_one``."""

    ns: Namespace
    readahead: ReadAhead
    memtier: MemoryTier
    losses: Losses
    future: StreamFuture
    plans: ReadPlanner
    prefetcher: Prefetcher


class _ChunksAhead:
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


class StreamManager:
    """Owns the streams and their prefetch tasks (see :class:`StreamEngine` for what it
    uses of the engine)."""

    def __init__(self, engine: StreamEngine, lead: int = 1024, lead_bytes: int = 512 << 20,
                 concurrency: int | None = None) -> None:
        self.engine = engine
        self.lead = lead
        self.lead_bytes = min(lead_bytes, engine.cfg.cache_size // 2)
        self.concurrency = concurrency or engine.cfg.source_threads
        self.streams: dict[tuple[str, int], Stream] = {}
        self._pid_stream: OrderedDict[int, Stream | None] = OrderedDict()
        self._nursery: trio.Nursery | None = None
        # the last sample lists made (a 1.28M-sample list is ~150 MB: keep a few)
        self._samplelists: OrderedDict[str, SampleList] = OrderedDict()
        self._last_opendir = 0
        self._guessed: set[int] = set()  # directories listed ahead of an announcement
        self._listing: dict[str, trio.Event] = {}  # dataset -> its list is being made
        self._list_failed: dict[str, tuple[float, str]] = {}  # dataset -> (when, why)
        self.replay_ready = False  # torch imported: orders can be replayed without waiting
        self.replay = ReplayWorker()  # torch's sampler replay runs there, not in the daemon
        self._replay_started = False
        # (rel, extensions) -> a root's list verified against a training's, with its
        # count and digest: a view built later (the files changed) is checked against it
        self._roots: dict[tuple, tuple[SampleList, int, str]] = {}
        # (job, dataset) -> (the epoch its ranks first planned a next-epoch log here, the
        # most of its DistributedSampler's ranks seen on this mount then; _ranks_laying_out)
        self._local_ranks: dict[tuple, tuple[int, int]] = {}
        self.unannounced: OrderedDict[int, dict] = OrderedDict()  # pgid -> stats entry
        self._pid_group: OrderedDict[int, int] = OrderedDict()  # reader pid -> pgid

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Owns the prefetch tasks, until :meth:`close` or cancellation."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def start_replay(self) -> None:
        """Start the sampler replay worker, once. Replaying a sampler needs torch (~3-4 s
        of CPU to import here), in a worker process (dlcachefs.clairvoyance.replayworker:
        never in the daemon, whose GIL it would hold), niced. Not at mount start: a mount
        read by something that never announces (raw readers, DLIO, a script without the
        hook) would pay that import during its first epoch (~3% of a first pass over a
        400 Mbit/s link here, ``bench.first_epoch``). It starts when a training process
        first reaches the control file: the hook opens it at interpreter start
        (:func:`dlcachefs.client.hook.install`), while the script imports its own torch,
        so the worker is ready about when the script announces; or at the first
        announcement. Trio loop."""
        if self._replay_started or self._nursery is None:
            return
        self._replay_started = True
        self._nursery.start_soon(self._preload)

    async def _preload(self) -> None:
        ok = await trio.to_thread.run_sync(self.replay.wait_ready, abandon_on_cancel=True)
        if not ok:
            log.info("announced samplers cannot be replayed: %s", self.replay.error)
        self.replay_ready = ok

    def close(self) -> None:
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
            self._nursery = None
        self.replay.close()

    # ----- control updates (trio loop, from ControlState.apply) ---------------------

    def on_stream(self, st: StreamState, js: JobState, pid: int | None) -> None:
        """A stream's announcement changed (:class:`ControlState`'s callback): ``pid`` is
        the announcing process (its reads, and its children's, are this stream's), None
        when another process's write changed the stream (another rank's new dataset)."""
        self.start_replay()
        s = self.streams.get((st.job, st.rank))
        if s is None:
            s = self.streams[(st.job, st.rank)] = Stream(st.job, st.rank)
        s.pace.hint(st.batch, st.workers, st.prefetch_factor)
        s.pace.state = st  # the training's pace reports land there
        if pid is not None:
            s.pids.add(pid)
            self._pid_stream.clear()  # attribution may have changed
            if self.unannounced:  # its process group has announced now
                self.unannounced.pop(_pgid(_tgid(pid)), None)
        learned = st.sampler is not None and st.sampler.kind == "unknown"
        if (js.dataset is None and not learned) or st.sampler is None or st.epoch is None:
            return
        if self._nursery is None:
            return
        if learned:
            self._learn_epoch(s, st.epoch)
        # the previous epoch's prefetch stops now, even if its task has not started yet
        if s.cancel is not None:
            s.cancel.cancel()
        s.cancel = trio.CancelScope()
        s.restarting = not learned and s.epoch is not None and st.epoch == s.epoch
        s.target_epoch = st.epoch
        s.early = []
        s.explicit = st.orders if st.sampler.kind == "explicit" else None
        if learned:
            s.learn_cur = s.learn_cur if s.learn_cur is not None else []
        else:
            s.learn_cur = s.learn_prev = None
            s.learn_epoch = None
        key = None if learned else dataset_key(js)
        self._nursery.start_soon(self._configure, s, s.cancel, key, st.sampler, st.epoch,
                                 js.view, st.sampler_index)

    def _learn_epoch(self, s: Stream, epoch: int) -> None:
        """A learned stream's epoch begins: the opens recorded so far were the last
        epoch's; its order is stable when they repeat the epoch before."""
        if s.learn_epoch == epoch:
            return
        if s.learn_cur:
            prev, s.learn_prev = s.learn_prev, s.learn_cur
            s.learn_compared = prev is not None
            s.learn_stable = False
            # compared in the configure task, in a thread: up to MAX_LEARNED opens each
            s.learn_pair = (s.learn_cur, prev) if prev is not None else None
        s.learn_cur, s.learn_epoch = [], epoch

    def on_order(self, st: StreamState, js: JobState, epoch: int, order, pid: int) -> None:
        """An explicit order (``order`` lines, the importance sampler) was completed."""
        s = self.streams.get((st.job, st.rank))
        if s is not None and s.target_epoch == epoch and s.epoch != epoch:
            self.on_stream(st, js, pid)  # its epoch was announced first: start it now

    async def _configure(self, s: Stream, cs: trio.CancelScope, dataset: str | None,
                         spec: SamplerSpec, epoch: int, view: ViewDef | None = None,
                         subset=None) -> None:
        """Replay the epoch's order, then prefetch it. Never raises: a background task's
        error is the stream's error, shown in stats, not the daemon's end."""
        with cs:
            try:
                await self._configure_now(s, dataset, spec, epoch, view, subset)
            except ReplayClosed as e:  # the next epoch's replay, cut by an unmount
                s.restarting = False
                s.error = str(e)
                s.mode, s.reason = "none", f"prefetch stopped: {s.error}"
                log.info("stream %s: prefetch stopped: %s", s.key, e)
            except Exception as e:  # noqa: BLE001
                s.restarting = False
                s.error = f"{type(e).__name__}: {e}"
                s.mode, s.reason = "none", f"prefetch stopped: {s.error}"
                log.exception("stream %s: prefetch stopped", s.key)

    async def _samples_for(self, s: Stream, dataset: str | None, view: ViewDef | None
                           ) -> SampleList:
        """The stream's sample list: the job's ImageFolder, the view's composite list (its
        roots checked against the training's digests), or a learned order of opens."""
        if dataset is None:  # learned: the last epoch's opens, when they repeat
            pair, s.learn_pair = s.learn_pair, None
            if pair is not None:
                s.learn_stable = await trio.to_thread.run_sync(_similar, *pair)
            seq = list(s.learn_prev or []) if s.learn_stable else []
            return SampleList("", [], seq, [0] * len(seq), [])
        return await self.ensure_sample_list(dataset, view)

    def _view_samples(self, key: str, view: ViewDef) -> SampleList:
        """Thread: the view's sample list; ValueError when a root's listing differs from
        the training's (never a silently wrong order)."""
        inos: list[int] = []
        labels: list[int] = []
        paths: list[str] = []
        nbytes = 0
        for r in view.roots:
            rk = (r.rel, r.extensions)
            known = self._roots.get(rk)
            # a root's list made or verified earlier holds only while the training's is
            # the same: one that rebuilt its ImageFolder after files were added or
            # deleted has another count or digest, and the earlier list replayed its
            # order over the wrong samples (403 misses of 600 in the sweep)
            sl = known[0] if known is not None and known[1:] == (r.count, r.sha) else None
            if sl is None:
                sl = self._samplelists.get(r.rel) if r.extensions == IMG_EXTENSIONS else None
                if sl is None or len(sl) != r.count or paths_digest(sl.paths) != r.sha:
                    sl = image_folder(self.engine.ns, r.rel, r.extensions)  # (listed anew)
                if len(sl) != r.count or paths_digest(sl.paths) != r.sha:
                    hint = " (a custom is_valid_file?)" if r.extensions is None else ""
                    out = links_leaving(self.engine.ns, r.rel)
                    if out:
                        hint += (f" ({out} symlinks in it dangle or lead out of the source:"
                                 f" the training follows them to files the mount does not"
                                 f" hold)")
                    raise ValueError(
                        f"sample list mismatch under {r.rel or '.'!r}: the mount lists "
                        f"{len(sl)} files, the training {r.count}"
                        + (" (same count, other files or order)" if len(sl) == r.count
                           else "") + f"{hint}; the order is not replayed")
                if len(self._roots) > 16:
                    self._roots.clear()
                self._roots[rk] = (sl, r.count, r.sha)
            inos += sl.inos
            labels += sl.labels
            nbytes += sl.nbytes
            prefix = f"{r.rel}/" if r.rel else ""
            paths += [prefix + p for p in sl.paths]
        if view.index is not None:
            idx = view.index
            inos = [inos[j] for j in idx]
            labels = [labels[j] for j in idx]
            paths = [paths[j] for j in idx]
            nbytes = sum(self.engine.ns.size_of(i) for i in inos if i)
        return SampleList(key, [], inos, labels, paths, nbytes)

    async def _configure_now(self, s: Stream, dataset: str | None, spec: SamplerSpec,
                             epoch: int, view: ViewDef | None = None, subset=None) -> None:
        try:
            samples = await self._samples_for(s, dataset, view)
            if (spec.kind != "unknown" and s.target_epoch == epoch and s.begun != epoch
                    and trio.current_effective_deadline() != -float("inf")):
                # the epoch begins for importance and substitution once its dataset is
                # listed, not once its order is replayed (a torch sampler's replay may
                # first wait for torch): from here the job's losses count and the H-list
                # is rebuilt. A learned order has no dataset (no importance, no losses).
                s.dataset, s.begun = dataset, epoch
                self.engine.losses.epoch_started(s, samples)
                s.used, s.substituted_before, s.substituted = set(), s.substituted, {}
            if spec.kind == "explicit":  # a copy: control may drop old epochs meanwhile
                s.replayer = _Explicit(spec, dict(s.explicit or {}), len(samples))
            elif spec.kind == "unknown":
                s.replayer = _Learned(spec, len(samples), epoch, s.learn_stable)
            elif (s.replayer is None or s.replayer.spec != spec or s.samples is not samples
                    or spec.per_epoch
                    # a generator's state is announced at each epoch's first draw: the same
                    # state again at a later epoch is a generator seeded anew the same way
                    # (a DataLoader built each epoch with Generator().manual_seed(0)), not
                    # one that went on: that epoch's order is computed from it afresh
                    or (spec.state is not None
                        and getattr(s.replayer, "base_epoch", epoch) != epoch)):
                s.replayer = RemoteReplayer(self.replay, spec, len(samples), base_epoch=epoch,
                                            subset=subset)
            order = await trio.to_thread.run_sync(s.replayer.order, epoch)
            # (a view's sample list is made anew for each epoch: the same dataset, compared
            # by its key, not by identity)
            # Only a shuffling sampler's order can be said to repeat (a sequential one
            # always does, and its next epoch is known anyway), and only after an epoch:
            # a later epoch number, or the same one read to its end (a set_epoch never
            # called). The same epoch announced again part way (a peek at one batch, a
            # restart from a checkpoint) is a restart, not a repeat.
            repeats = (spec.kind in ("random", "subset_random", "distributed")
                       and same_dataset(s.samples, samples) and len(samples) == len(s.samples)
                       and bool(s.order)
                       and (epoch != s.epoch or s.position >= len(s.order))
                       and await trio.to_thread.run_sync(operator.eq, order, s.order))
            # the log laid out for this epoch is read as its log only if it was laid out
            # in this order: a wrong guess of the next order (the sampler re-seeded, an
            # epoch not advanced) would be read in whole chunks out of order
            laid = s.next_log
            laid_ok = (laid is not None and laid.order is not None
                       and await trio.to_thread.run_sync(operator.eq, order, laid.order))
            nxt: list[int] = []
            nxt_first: dict[int, int] | None = None
            if repeats:  # the next epoch is taken to repeat it as well
                nxt = order
                nxt_first = await trio.to_thread.run_sync(_first_positions, nxt, samples)
            elif s.replayer.known(epoch + 1):  # the policy's future reaches into it
                nxt = await trio.to_thread.run_sync(s.replayer.order, epoch + 1)
                nxt_first = await trio.to_thread.run_sync(_first_positions, nxt, samples)
            need = self._dataset_bytes(samples)
            positions, consumed = await trio.to_thread.run_sync(_positions, order, samples)
            cluster = await self._cluster_use(s, spec, epoch, samples)
        except (DlcError, ValueError, OSError) as e:
            s.error = str(e)
            s.mode, s.reason = "none", str(e)
            s.restarting = False
            # an unmount that cuts replays still queued for the worker is not a problem
            # of the stream's order: said at INFO, so a log watcher sees no warning
            level = logging.INFO if isinstance(e, ReplayClosed) else logging.WARNING
            log.log(level, "stream %s: cannot replay its order: %s", s.key, e)
            return
        if s.target_epoch != epoch or trio.current_effective_deadline() == -float("inf"):
            return  # a newer announcement replaced this one while the order was computed
        # no await from here on: the stream switches epochs atomically
        s.error = None
        s.mode, s.reason = _mode(spec, s.replayer, epoch, len(samples), s)
        if repeats:
            what = ("DistributedSampler.set_epoch is not called"
                    if spec.kind == "distributed" and s.epoch == epoch
                    else "the sampler's generator is seeded the same way each epoch")
            s.reason = (f"{s.reason.split(';')[0]}; this epoch repeats the last one's order "
                        f"({what}?): the next is taken to repeat it too")
        # partial caching the LCache way needs the next epoch's log; without a known next
        # order the cache is filled the ordinary way, by the policy's admission
        # the writer's limit: --cache-size, or a shared root's share (cache.shares)
        s.memory_prefetch = (2 * need > self.engine.writer.limit and self.engine.cfg.reorder
                             and nxt_first is not None)
        if epoch != s.epoch or samples is not s.samples:
            # not s.dataset to compare: the importance step above may have set it already
            s.end_page_count(same_dataset=same_dataset(s.samples, samples))
        s.dataset, s.samples, s.epoch, s.order = dataset, samples, epoch, order
        s.repeats = repeats
        s.positions, s.consumed = positions, consumed
        s.ready = bytearray(len(order))
        s.position = s.prefetched_upto = 0
        s.restarting = False  # (its opens so far are in early, counted below)
        self.engine.readahead.drop_owner(s.key)
        if spec.kind == "unknown":
            s.used, s.substituted_before, s.substituted = set(), s.substituted, {}
        s.begun = None  # switched: announcing this epoch again begins it again
        s.epoch_tick = self.engine.future.tick
        s.hit_s = s.miss_s = 0.0
        s.hit_n = s.miss_n = 0
        s.epoch_t0 = s.last_open = time.monotonic()
        s.next_first, s.next_first_order = nxt_first, nxt
        s.cluster = cluster
        early, s.early = s.early, []
        log.info("stream %s: epoch %d, %d samples, %s", s.key, epoch, len(order), s.mode)
        prev, s.next_log = s.next_log, None
        if s.current_log is not None:
            # its epoch is over: ordinary cache now (the new log's gaps are filled from it)
            s.current_log.release_after_use = False
            s.current_log.unprotect()
            if s.memory_prefetch and prev is not None:
                # LCache line 16, release after use: the last epoch's log is consumed;
                # what of it the new log did not take is not worth the room (partial
                # caching only). Only once the new log is complete: its gaps are filled
                # from the old one.
                self._nursery.start_soon(self._release_after, prev, s.current_log)
        s.current_log = None
        if prev is not None:
            if prev.epoch == epoch and prev is laid and laid_ok:
                prev.request_finish()  # this epoch's log: fill its gaps and seal it
                s.current_log = prev
                prev.start_reading()
                if s.memory_prefetch and not self.engine.zerocopy.any_readers():
                    # its chunks stay protected until read (LCache's release after use,
                    # note_open): the next epoch's log, written meanwhile into the room
                    # they free, must not evict the part of this epoch's log still ahead
                    # (LRU would take exactly those, its oldest chunks, and every one
                    # evicted is a sample fetched again this epoch)
                    prev.release_after_use = True
                    prev.protect()  # (again, if an idle pause let it go)
                else:
                    # the whole dataset fits; or zero-copy readers read it, whose hits
                    # the mount never sees (nothing would ever be released): ordinary
                    # cache now
                    prev.unprotect()
            else:
                prev.abandon()
        for ino in early:  # opens before the switch: counted against this epoch's log
            self.note_open(s, ino, learn=False)  # (learned when they came)
        if self.engine.ns.gone:  # files gone from the source: never opened in this epoch
            self._pass_gone(s, list(self.engine.ns.gone))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._prefetch, s)
            # this epoch's reads from the logs, in its order (dlcachefs.cache.readplan)
            nursery.start_soon(self.engine.plans.run, s)
            await self._plan_next(s, samples, epoch)

    async def _cluster_use(self, s: Stream, spec: SamplerSpec, epoch: int,
                           samples: SampleList) -> ClusterUse | None:
        """With ``--peers``, a distributed sampler's every rank's order (this epoch's and
        the next one's when known): when each sample is used cluster-wide, for the peer
        tier's expiry (:meth:`Engine.peer_expiry`). None otherwise, or when it cannot be
        computed (the expiry then falls back to this node's ranks and a margin)."""
        rep = s.replayer
        if (self.engine.cfg.peers is None or spec.kind != "distributed" or spec.world < 2
                or not isinstance(rep, RemoteReplayer)):
            return None
        try:
            cur = await trio.to_thread.run_sync(rep.cluster_order, epoch)
            nxt = None
            if rep.known(epoch + 1):
                nxt = await trio.to_thread.run_sync(rep.cluster_order, epoch + 1)
            return await trio.to_thread.run_sync(ClusterUse.of, spec.world, cur, nxt, samples)
        except ReplayClosed:
            raise  # the unmount: the stream does not switch
        except ValueError as e:
            log.info("stream %s: no cluster-wide order (%s)", s.key, e)
            return None

    async def _plan_next(self, s: Stream, samples: SampleList, epoch: int) -> None:
        """LCache: when epoch+1's order is known, lay out its log while this epoch runs."""
        assert s.replayer is not None and self._nursery is not None
        # close() may forget the nursery while the plan is made: its tasks still go there
        # (cancelled at once then, and nl.run's cleanup runs)
        nursery = self._nursery
        s.reorder = ""
        if not self.engine.cfg.reorder or not s.replayer.known(epoch + 1):
            return
        if s.repeats:
            s.reorder = ("not needed: this epoch's order repeats the last one's (the sampler "
                         "re-seeded the same way, or its epoch was not advanced: "
                         "DistributedSampler.set_epoch); the next is taken to repeat it, and "
                         "the logs are read in that order")
            return
        if s.pages_served and not s.memory_prefetch:
            # the kernel's page cache served the last epoch's READs (the dataset fits in
            # RAM): the next is read from it in any order, and a log laid out for it would
            # be written and read back for nothing, each epoch (the opens that take its
            # bytes could not be lazy either). Pages that go end this at the next epoch.
            s.reorder = ("not needed: the kernel's page cache served the last epoch "
                         "(page_cache.serves_this_epoch); laid out again once its READs "
                         "come back")
            return
        cfg = self.engine.cfg
        limit = self.engine.memtier.limit
        floor = cfg.reorder_min if cfg.reorder_min is not None else limit // 2
        # the memory tier is one for the mount: every dataset streams read now counts
        # (several ranks of one dataset count it once)
        read_now = {st.dataset: st.samples.nbytes for st in self.streams.values()
                    if st.samples is not None and st.dataset is not None}
        read_now[s.dataset] = samples.nbytes
        total = sum(read_now.values())
        if not s.memory_prefetch and total <= floor:
            # LCache lays the next epoch's log out in its order so that an epoch whose data
            # does not fit in memory reads whole chunks front to back. Data that fits in the
            # memory tier is read a chunk at a time in any order (each chunk loaded once by
            # the read plan, then kept): a second copy written and read back during this
            # epoch would buy nothing, and it takes the disk and ~0.6 ms of CPU per sample
            # from a first epoch's loader. A cache too small for the dataset
            # (memory_prefetch) always needs the log: it says which samples stay cached.
            s.reorder = (f"not needed: the {total / 2**20:.1f} MiB of the datasets read now "
                         f"are at most --reorder-min ({floor / 2**20:.1f} MiB; by default half of "
                         f"the memory tier, {limit / 2**20:.1f} MiB)")
            return
        # LCache: two logs. When the cache cannot hold two copies of the dataset, the next
        # log holds the samples that come first in its epoch, as many as the cache holds
        # (the current log is released chunk by chunk as it is consumed, so the two fit);
        # the rest is prefetched from the source in order, into memory, when it runs.
        budget = max(self.engine.writer.limit - 2 * cfg.chunk_size, cfg.chunk_size) \
            if s.memory_prefetch else None
        order = await trio.to_thread.run_sync(s.replayer.order, epoch + 1)
        nl = NextEpochLog(self.engine, s.key, epoch + 1)
        nl.order = order
        ranks = self._ranks_laying_out(s)
        await nl.plan([samples.inos[i] for i in order], budget, ranks=ranks)
        if budget is not None:
            # (of the stream's own order: a DistributedSampler rank's is its shard)
            log.info("stream %s: the cache holds %d of the %d samples of epoch %d's order",
                     s.key, len(nl.slots), len(order), epoch + 1)
        if s.target_epoch != epoch:  # a newer epoch began while planning
            nl.abandon()
        elif s.pages_served and not s.memory_prefetch:
            # judged served by the kernel's pages while planning (a large dataset takes a
            # second or more): _judge found no log to give up then
            nl.abandon()
            s.reorder = GIVEN_UP
        else:
            s.next_log = nl
            for ino in list(self.engine.ns.gone):  # gone while it was planned: fillers
                nl.gone(ino)
            # samples this epoch already served before the plan existed go in from the
            # cache: this stream's, and those the other ranks of the dataset served (its
            # slots are filled from every stream's opens: next_logs)
            done = [st.samples.inos[st.order[p]] for st in self.streams.values()
                    if same_dataset(st.samples, samples) and st.epoch == epoch and st.order
                    for p in range(len(st.order)) if st.consumed[p]]
            nursery.start_soon(nl.backfill, done)
        nursery.start_soon(nl.run)

    def job_reading(self, job: str) -> bool:
        """Whether a stream of ``job`` opened a file in the last IDLE_S seconds."""
        now = time.monotonic()
        return any(k[0] == job and now - s.last_open < IDLE_S
                   for k, s in self.streams.items())

    def drop_job(self, job: str) -> None:
        """Control forgot ``job`` (idle, its processes gone, to make room for a new one):
        its streams end. Their prefetch and planning stop, their logs become ordinary
        cache (an unfinished next-epoch log is given up), their read-ahead is let go."""
        for key in [k for k in self.streams if k[0] == job]:
            s = self.streams.pop(key)
            if s.cancel is not None:
                s.cancel.cancel()
            s.target_epoch = None  # a configure task still under way switches nothing
            if s.next_log is not None:
                s.next_log.abandon()
                s.next_log = None
            if s.current_log is not None:
                s.current_log.release_after_use = False
                s.current_log.unprotect()
                s.current_log = None
            self.engine.readahead.drop_owner(s.key)
            self.engine.plans.forget(s)
        self._pid_stream.clear()
        self.engine.losses.forget_job(job)

    def unprotect_idle(self, now: float) -> None:
        """Stop protecting the current epoch's log of a stream that opened nothing for
        :data:`IDLE_S` (a training that ended or died mid-epoch), or of every stream once
        a zero-copy reader reads the cache (its hits never reach the mount, so their
        chunks would never be released): their chunks become ordinary cache, so another
        training can evict them. The next epoch's log of an idle stream too (a training
        that ended planned one for an epoch that never comes); if its epoch does begin
        after the pause, it is protected again then. Trio loop; every few seconds (one
        listing of the counters' directory, only while a current log is protected)."""
        zerocopy = None
        for s in self.streams.values():
            if s.chunks_ahead is not None and now - s.last_open >= IDLE_S:
                # a reader that stopped short of its epoch's end: its chunks ahead are
                # wanted no more (they would shrink every other stream's room)
                s.chunks_ahead.clear()
            nxt = s.next_log
            if nxt is not None and now - s.last_open >= IDLE_S and any(
                    c.chunk_id in self.engine.writer.protected for c in nxt.chunks):
                # a training that ended (its last epoch planned a next one that never
                # comes): others may evict it; protected again if its epoch does begin
                nxt.unprotect()
                log.info("stream %s: nothing opened for %.0f s: epoch %d's planned log is "
                         "no longer protected from eviction", s.key, now - s.last_open,
                         nxt.epoch)
            cur = s.current_log
            if cur is None or not cur.release_after_use:
                continue
            if now - s.last_open >= IDLE_S:
                why = f"nothing opened for {now - s.last_open:.0f} s"
            else:
                if zerocopy is None:
                    zerocopy = self.engine.zerocopy.any_readers()
                if not zerocopy:
                    continue
                why = "zero-copy readers read the cache"
            cur.release_after_use = False  # (not protected again this epoch)
            cur.unprotect()
            log.info("stream %s: %s: epoch %d's log is no longer protected from eviction",
                     s.key, why, cur.epoch)

    async def _release_after(self, filling: NextEpochLog, old: NextEpochLog) -> None:
        await filling.done.wait()
        for c in old.chunks:
            if c.sealed:
                self.engine.writer.retire_chunk(c.chunk_id)

    def sample_list(self, dataset: str) -> SampleList | None:
        """The ImageFolder sample list of ``dataset`` if it has been made."""
        sl = self._samplelists.get(dataset)
        if sl is not None:
            self._samplelists.move_to_end(dataset)
            return sl
        # a list evicted from the few kept (guesses ahead of announcements) is still the
        # one a stream reads by
        for st in self.streams.values():
            if st.dataset == dataset and st.samples is not None:
                return st.samples
        return None

    def note_opendir(self, d: Entry) -> None:
        """A directory of the mirror was opened. A training script builds its ImageFolder
        before it announces: it lists the root, then walks each class directory. When a
        directory is opened right after its parent and the parent looks like a dataset
        root (mostly subdirectories), the parent's sample list is made in the background,
        so that the announcement that follows finds it ready (listing 1.28M samples takes
        seconds). Bounded: one guess in flight, each directory once, ``MAX_GUESSES`` per
        mount. (The replay worker is not started here: a training under the hook starts
        it at its start, any announcement starts it, and a script that does neither
        never needs torch in the daemon.)
        Trio loop."""
        try:
            self._guess(d)
        except Exception:  # noqa: BLE001 - a guess must never fail the opendir
            log.exception("listing ahead of an announcement failed")

    def _guess(self, d: Entry) -> None:
        parent, self._last_opendir = self._last_opendir, d.ino
        if (d.parent != parent or parent in self._guessed or self._listing
                or len(self._guessed) >= MAX_GUESSES or self._nursery is None):
            return
        try:
            p = self.engine.ns.get(parent)
        except DlcError:
            return
        kids = self.engine.index.list_dir_typed(parent)
        ndirs = sum(1 for k in kids if stat.S_ISDIR(k[2]))
        if ndirs < 2 or 2 * ndirs < len(kids):
            return
        self._guessed.add(parent)
        rel = os.fsdecode(self.engine.ns.path_of(p))
        if rel not in self._samplelists:
            log.info("listing %r ahead of an announcement (an ImageFolder scan was seen)",
                     rel or ".")
            self.list_soon(rel, lambda _d: None)

    async def ensure_sample_list(self, dataset: str, view: ViewDef | None = None
                                 ) -> SampleList:
        """The sample list of ``dataset`` (an ImageFolder root, or a view's key with its
        ``view``), made in a thread from the snapshot on first use (once, however many
        callers wait for it). Raises what listing raises."""
        while True:
            samples = self.sample_list(dataset)
            if samples is not None:
                return samples
            busy = self._listing.get(dataset)
            if busy is None:
                break
            await busy.wait()  # then look again: made, or failed (and maybe retried)
        failed = self._list_failed.get(dataset)
        if failed is not None and time.monotonic() - failed[0] < LIST_RETRY_S:
            raise DlcError(failed[1])  # a listing that just failed is not redone at once
        done = self._listing[dataset] = trio.Event()
        try:
            if view is None:
                samples = await trio.to_thread.run_sync(image_folder, self.engine.ns, dataset)
            else:
                samples = await trio.to_thread.run_sync(self._view_samples, dataset, view)
        except (DlcError, ValueError, OSError) as e:
            self._list_failed[dataset] = (time.monotonic(), str(e))
            while len(self._list_failed) > 64:
                self._list_failed.pop(next(iter(self._list_failed)))
            raise
        finally:
            if self._listing.get(dataset) is done:
                del self._listing[dataset]
            done.set()
        self._list_failed.pop(dataset, None)
        self._samplelists[dataset] = samples
        while len(self._samplelists) > MAX_SAMPLE_LISTS:
            self._samplelists.popitem(last=False)
        return samples

    def list_soon(self, dataset: str, then: Callable[[str], None],
                  view: ViewDef | None = None) -> None:
        """Make the sample list of ``dataset`` (with its ``view``, see
        :meth:`ensure_sample_list`) in the background, then call ``then(dataset)`` on the
        loop (also when listing failed: the list is then None)."""
        if self._nursery is None:
            then(dataset)
            return

        async def task() -> None:
            try:
                await self.ensure_sample_list(dataset, view)
            except Exception as e:  # noqa: BLE001 - reported through then()
                log.warning("dataset %r: cannot make its sample list: %s", dataset, e)
            try:
                then(dataset)
            except Exception:  # noqa: BLE001 - a background task must not end the mount
                log.exception("dataset %r: applying what waited for its list failed",
                              dataset)

        self._nursery.start_soon(task)

    def next_logs(self) -> list[NextEpochLog]:
        """The next epochs' logs being laid out, every stream's: an open by any of them
        (or by any reader) may fill a slot of another's. With a DistributedSampler about
        half of a rank's next-epoch samples are read by the other ranks in this epoch;
        filled only from its own rank's opens, each log was completed at the epoch
        boundary from the cache, both ranks at once, in scattered order (two ranks on a
        mount read 5.8x what they served with ``--memory 8M``)."""
        return [s.next_log for s in self.streams.values()
                if s.next_log is not None and not s.next_log.failed]

    def _ranks_laying_out(self, s: Stream) -> int:
        """How many streams share the cache with ``s``'s next-epoch log: every stream
        that knows its order, and for a DistributedSampler the ranks of its job expected
        on this mount, not only those that announced yet. Counted alone, the first rank
        to announce planned its log for the whole cache, and with a cache smaller than
        the dataset the other ranks' logs found no room (the sweep: two ranks, 16 chunks
        planned for a 12 MiB cache, epoch 2 read 103% of the dataset from the source).
        In the job's first epoch on the mount all of the world's ranks are expected (a
        node holding fewer then lays out smaller logs for one epoch: the rest of that
        epoch is prefetched in order); after, as many as it saw. No waiting for the
        ranks: the plan is not delayed (a first epoch shorter than a wait got no log)."""
        n = self.ordered_streams()
        spec = getattr(s.replayer, "spec", None)
        if spec is None or spec.kind != "distributed" or spec.world < 2:
            return n
        key = (s.job, s.dataset)
        seen = sum(1 for o in self.streams.values()
                   if o.job == s.job and o.order and o.dataset == s.dataset)
        first, most = self._local_ranks.get(key, (s.epoch, 0))
        most = max(most, seen)
        self._local_ranks[key] = (first, most)
        while len(self._local_ranks) > 64:
            self._local_ranks.pop(next(iter(self._local_ranks)))
        # (in the job's first epoch here, its ranks may still be announcing)
        expected = spec.world if s.epoch == first else most
        return max(n, n - seen + min(expected, spec.world))

    def ordered_streams(self) -> int:
        """How many streams know their order (the ranks laying out their next epochs)."""
        return sum(1 for s in self.streams.values() if s.order)

    def dataset_size(self, rel: str) -> int | None:
        """Samples in the ImageFolder at ``rel`` when a stream has listed it (else None)."""
        sl = self.sample_list(rel)
        return None if sl is None else len(sl.inos)

    def substitutions_of(self, job: str) -> dict[int, int]:
        """Requested sample -> the sample served instead, for ``job``'s streams: the last
        epoch's substitutions, then this one's (losses are reported late)."""
        subs: dict[int, int] = {}
        for st in self.streams.values():
            if st.job == job:
                subs.update(st.substituted_before)
                subs.update(st.substituted)
        return subs

    def job_dataset(self, job: str) -> str | None:
        for s in self.streams.values():
            if s.job == job and s.dataset is not None:
                return s.dataset
        return None

    @staticmethod
    def _dataset_bytes(samples: SampleList) -> int:
        """Total size of the dataset's files (counted when the list was made)."""
        return samples.nbytes

    # ----- prefetch -------------------------------------------------------------------

    async def _prefetch(self, s: Stream) -> None:
        assert s.samples is not None
        slots = trio.Semaphore(self.concurrency)
        lead_bytes = self.lead_bytes
        if s.memory_prefetch:
            lead_bytes = min(lead_bytes, self.engine.readahead.limit)
        window: deque[tuple[int, int]] = deque()  # (position, size) prefetched, for lead_bytes
        # chunks loaded whole into the memory tier ahead of the reader (see _prefetch_in)
        ahead = s.chunks_ahead = _ChunksAhead(self.engine.memtier)
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
                           window: deque[tuple[int, int]], ahead: _ChunksAhead) -> None:
        sizes_ahead = 0
        async with trio.open_nursery() as nursery:
            for p in range(len(s.order)):
                ino = s.samples.inos[s.order[p]]
                size = self.engine.ns.size_of(ino) if ino else 0
                # stay within `lead` samples and `lead_bytes` of the reader, and within
                # the memory tier for chunks loaded whole
                while True:
                    while window and window[0][0] < s.position:
                        sizes_ahead -= window.popleft()[1]
                    ahead.passed(s.position)
                    # asked again after each wait: the tier's room may have changed
                    c = self.engine.prefetcher.chunk_ahead(ino, s) if ino else None
                    if p - s.position < self.lead and (c is None or ahead.fits(c)) and (
                            sizes_ahead + size <= lead_bytes or not window):
                        break
                    await s.moved.wait()
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
                fetched = await self.engine.prefetcher.prefetch_one(ino, s)
                if fetched:
                    s.prefetched += 1
            s.ready[p] = 1
        except DlcError as e:
            log.debug("prefetch of inode %d failed: %s", ino, e)
        finally:
            slots.release()

    # ----- reader attribution ---------------------------------------------------------

    def stream_of(self, pid: int) -> Stream | None:
        """The stream an open by ``pid`` belongs to (None: counted as unannounced)."""
        found = self._stream_of(pid)
        if found is None:
            self._unannounced_open(pid)
        return found

    def group_of(self, pid: int) -> str | None:
        """The ``unannounced/PGID`` key of a reader seen by :meth:`stream_of`."""
        pg = self._pid_group.get(pid)
        return None if pg is None else f"unannounced/{pg}"

    def _unannounced_open(self, pid: int) -> None:
        """An open by a process tree that announced nothing: a bounded ``none`` entry per
        process group (a training and its loader workers share one)."""
        pg = self._pid_group.get(pid)
        tgid = 0
        if pg is None:
            tgid = _tgid(pid)
            pg = _pgid(tgid)
            self._pid_group[pid] = pg
            while len(self._pid_group) > 4096:
                self._pid_group.popitem(last=False)
        e = self.unannounced.get(pg)
        if e is None:
            tgid = tgid or _tgid(pid)
            e = {"mode": "none", "opens": 0, "command": _comm(tgid),
                 "reason": _unannounced_reason(tgid)}
            self.unannounced[pg] = e
            while len(self.unannounced) > MAX_UNANNOUNCED:
                self.unannounced.popitem(last=False)
        e["opens"] += 1

    def _stream_of(self, pid: int) -> Stream | None:
        if not self.streams:
            return None
        if pid in self._pid_stream:
            return self._pid_stream[pid]
        owners = {p: s for s in self.streams.values() for p in s.pids}
        found, cur = None, _tgid(pid)
        for _ in range(16):  # the writer itself, or an ancestor of the reader
            if cur in owners:
                found = owners[cur]
                break
            cur = _parent(cur)
            if cur <= 1:
                break
        self._pid_stream[pid] = found
        while len(self._pid_stream) > 4096:
            self._pid_stream.popitem(last=False)
        return found

    def note_open(self, s: Stream, ino: int, learn: bool = True) -> None:
        """Mark the sample consumed and move the stream's position."""
        if learn and s.learn_cur is not None and len(s.learn_cur) < MAX_LEARNED:
            s.learn_cur.append(ino)
        if s.epoch != s.target_epoch or s.restarting:
            if len(s.early) < 1 << 20:
                s.early.append(ino)
            return
        p = s.positions.pop(ino)
        if p is None:
            return
        s.last_open = time.monotonic()
        self._consume(s, ino, p)
        self._advance(s)

    def note_gone(self, inos: list[int]) -> None:
        """Files found gone from the source (``Namespace.on_removed``): no open of them
        will come (with ``--revalidate 0`` it fails at LOOKUP; an open that gets as far
        as OPEN moves the position itself, even when its fetch then finds the file
        gone), so every stream's position passes them. (It stopped at the first one for
        the rest of the epoch, and with it the prefetch and the chunk preloads ahead:
        6-8x read per byte served in the sweep.) A stream between an announcement and
        its switch passes them at the switch, from ``Namespace.gone``. Every next-epoch
        log being laid out gives their slots filler records. Trio loop."""
        for s in self.streams.values():
            if s.order and s.epoch == s.target_epoch and not s.restarting:
                self._pass_gone(s, inos)
        for nl in self.next_logs():  # their slots get fillers: the logs can be sealed
            for ino in inos:
                nl.gone(ino)

    def _pass_gone(self, s: Stream, inos: list[int]) -> None:
        moved = s.position
        for ino in inos:
            while (p := s.positions.pop(ino)) is not None:  # (every position of it)
                self._consume(s, ino, p)
        self._advance(s)
        if s.position != moved:
            self.engine.plans.poke(s)

    def _consume(self, s: Stream, ino: int, p: int) -> None:
        """Position ``p`` (of ``ino``) is done with in this epoch."""
        s.consumed[p] = 1
        cur = s.current_log
        if cur is not None and cur.release_after_use:
            done = cur.used(ino)  # LCache line 16: release a chunk after use
            if done is not None:
                cur.release(done)

    def _advance(self, s: Stream) -> None:
        """Move the stream's position past what is consumed; wake what waits on it."""
        moved = False
        while s.position < len(s.consumed) and s.consumed[s.position]:
            s.position += 1
            moved = True
        if moved:
            s.moved.set()
            s.moved = trio.Event()

    def stats(self) -> dict:
        out: dict = {s.key: s.stats() for s in self.streams.values()}
        for pg, e in self.unannounced.items():
            out[f"unannounced/{pg}"] = dict(e)
        return out


class _Learned:
    """A learned order: the last epoch's opens, predicted to repeat when they repeated
    the epoch before (``stable``); else nothing is known."""

    def __init__(self, spec: SamplerSpec, n: int, epoch: int, stable: bool) -> None:
        self.spec, self.n, self.epoch, self.stable = spec, n, epoch, stable

    def known(self, epoch: int) -> bool:
        return self.stable and epoch >= self.epoch

    def order(self, epoch: int) -> list[int]:
        return list(range(self.n))


def _similar(a: list[int], b: list[int], share: float = 0.9) -> bool:
    """Whether two epochs opened nearly the same files in nearly the same order: at least
    98% of the opens in common, and at least ``share`` of them within a window of where
    they were. Loader workers reorder by up to workers x prefetch_factor x batch under
    load; the window, 1/8 of the epoch, is far below what a reshuffle moves (a random
    permutation keeps about 2 x window / n = 25% of the files that near)."""
    if not a or not b:
        return False
    common = sum((Counter(a) & Counter(b)).values())
    if common < 0.98 * max(len(a), len(b)):
        log.info("learned order: %d of %d opens in common: a different set", common, len(a))
        return False
    window = max(16, len(a) // 8)
    where: dict[int, int] = {}
    for p, ino in enumerate(b):
        where.setdefault(ino, p)
    near = sum(1 for p, ino in enumerate(a) if ino in where and abs(where[ino] - p) <= window)
    log.info("learned order: %d of %d opens within %d positions of the last epoch's",
             near, len(a), window)
    return near >= share * len(a)


def _mode(spec: SamplerSpec, replayer, epoch: int, n: int, s: Stream) -> tuple[str, str]:
    """(mode, reason) of a stream whose epoch was just configured."""
    if spec.kind == "unknown":
        why = spec.reason or "the sampler is not replayable"
        if s.learn_stable:
            return "learned", f"{why}; the order of opens repeats: prefetched ({n} samples)"
        if s.learn_prev is None:
            return "learned", f"{why}; learning the order of opens (first epoch)"
        if not s.learn_compared:
            return "learned", f"{why}; one epoch's order of opens known: prefetched from the " \
                              f"next epoch on if the next repeats it"
        return "learned", f"{why}; the order of opens changed since the last epoch: not " \
                          f"prefetched"
    what = {"random": "RandomSampler", "subset_random": "SubsetRandomSampler",
            "distributed": "DistributedSampler", "sequential": "SequentialSampler",
            "explicit": "explicit order"}.get(spec.kind, spec.kind)
    how = " from the generator's state" if spec.state else ""
    if replayer.known(epoch + 1):
        nxt = "the next epoch is known"
    elif spec.kind == "explicit":
        nxt = "the next epoch is not known (its order is sent when it starts)"
    else:
        nxt = "the next epoch is not known (its seed is drawn when it starts)"
    return "replayed", f"{what}{how} over {n} samples; {nxt}"


class _Explicit:
    """Orders announced with ``order`` lines, in place of a replayed sampler."""

    def __init__(self, spec: SamplerSpec, orders: dict, n: int) -> None:
        self.spec, self.orders, self.n = spec, orders, n

    def known(self, epoch: int) -> bool:
        return epoch in self.orders

    def order(self, epoch: int) -> list[int]:
        if epoch not in self.orders:
            raise ValueError(f"no order announced for epoch {epoch} (send 'order' lines first)")
        out = [int(i) for i in self.orders[epoch]]
        if any(not 0 <= i < self.n for i in out):
            raise ValueError(f"the order of epoch {epoch} names a sample outside 0..{self.n - 1}")
        return out


@dataclass(frozen=True, slots=True)
class ClusterUse:
    """When a distributed sampler's samples are read cluster-wide, from each epoch's
    global order (every rank's; position ``g`` is read at step ``g // world``, the ranks
    stepping together): ``current`` and ``next`` are :class:`Positions` of the REVERSED
    orders (of ``current_len`` and ``next_len`` positions), so that they give each inode's
    last position (DistributedSampler's padding repeats a few samples at the end)."""

    world: int
    current: Positions
    current_len: int
    next: Positions | None = None
    next_len: int = 0
    #: this epoch's global order as inodes (the owner's prefetch walks it)
    inos: np.ndarray | None = None

    @classmethod
    def of(cls, world: int, cur: list[int], nxt: list[int] | None,
           samples: SampleList) -> ClusterUse:
        """Thread: from the global orders (dataset indices) of this epoch and the next."""
        return cls(world, _first_positions(cur[::-1], samples), len(cur),
                   None if nxt is None else _first_positions(nxt[::-1], samples),
                   0 if nxt is None else len(nxt), _order_inos(cur, samples))

    def steps(self, ino: int) -> tuple[int | None, int | None]:
        """The last step at which the cluster reads ``ino`` in this epoch and the next."""
        c = self.current.next(ino)
        n = self.next.next(ino) if self.next is not None else None
        return (None if c is None else (self.current_len - 1 - c) // self.world,
                None if n is None else (self.next_len - 1 - n) // self.world)


class Positions:
    """Inode -> its positions in an epoch's order that were not consumed yet, smallest
    first. Built with numpy (a 1.28M-sample epoch in ~0.1 s, where a dict took 1-2 s on
    the loaded daemon): the first position of every inode in an array indexed by inode
    (inode numbers are dense: the namespace hands them out in sequence; a dict when they
    are not), and a queue only for inodes that occur more than once (sampling with
    replacement, DistributedSampler's padding). Inode 0 (not a readable file) is never
    listed. Not thread-safe: built in a thread, then used on the trio loop only."""

    __slots__ = ("_first", "_dict", "_more")

    def __init__(self, order_inos) -> None:
        oi = np.asarray(order_inos, dtype=np.int64)
        self._first: np.ndarray | None = None
        self._dict: dict[int, int] | None = None
        self._more: dict[int, deque[int]] = {}
        if len(oi) == 0:
            self._dict = {}
            return
        top = int(oi.max())
        if int(oi.min()) >= 0 and top <= 4 * len(oi) + (1 << 20):
            counts = np.bincount(oi, minlength=top + 1)
            counts[0] = 0
            if int(counts.max(initial=0)) <= 1:  # a permutation (the common case): O(n)
                arr = np.full(top + 1, -1, dtype=np.int64)
                arr[oi] = np.arange(len(oi), dtype=np.int64)
                arr[0] = -1
                self._first = arr
                return
        uniq, first = np.unique(oi, return_index=True)
        if uniq[0] == 0:
            uniq, first = uniq[1:], first[1:]
        top = int(uniq[-1]) if len(uniq) else 0
        if top <= 4 * len(oi) + (1 << 20):
            arr = np.full(top + 1, -1, dtype=np.int64)
            arr[uniq] = first
            self._first = arr
        else:  # sparse inode numbers: a dict is smaller
            self._dict = dict(zip(uniq.tolist(), first.tolist(), strict=True))
        if len(uniq) < np.count_nonzero(oi):  # some inode occurs more than once
            is_first = np.zeros(len(oi), dtype=bool)
            is_first[first] = True
            for p in np.flatnonzero(~is_first & (oi != 0)).tolist():
                self._more.setdefault(int(oi[p]), deque()).append(p)

    def next(self, ino: int) -> int | None:
        """The smallest position of ``ino`` not consumed yet."""
        if self._first is not None:
            if 0 < ino < len(self._first):
                p = int(self._first[ino])
                return p if p >= 0 else None
            return None
        return self._dict.get(ino)  # type: ignore[union-attr]

    def __contains__(self, ino: int) -> bool:
        return self.next(ino) is not None

    def pop(self, ino: int) -> int | None:
        """Consume and return the smallest position of ``ino`` (None: none is left)."""
        p = self.next(ino)
        if p is None:
            return None
        q = self._more.get(ino)
        nxt = -1
        if q:
            nxt = q.popleft()
            if not q:
                del self._more[ino]
        if self._first is not None:
            self._first[ino] = nxt
        elif nxt >= 0:
            self._dict[ino] = nxt  # type: ignore[index]
        else:
            del self._dict[ino]  # type: ignore[union-attr]
        return p


def _order_inos(order: list[int], samples: SampleList) -> np.ndarray:
    """The inodes of ``order``'s samples. An index outside the sample list (a subset's
    indices, or an order, announced for a larger dataset than the one listed) is a
    ValueError, which makes the stream's order unknown with that reason."""
    idx = np.asarray(order, dtype=np.int64)
    inos = samples.inos_array()
    if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= len(inos)):
        bad = int(idx.max()) if int(idx.max()) >= len(inos) else int(idx.min())
        raise ValueError(f"the order names sample {bad}, outside the dataset's "
                         f"{len(inos)} samples")
    return inos[idx]


def _positions(order: list[int], samples: SampleList) -> tuple[Positions, bytearray]:
    """Thread: the order's positions per inode, and the consumed flags, with a sample that
    is not a readable file (dangling link) counted read: it is never opened."""
    oi = _order_inos(order, samples)
    return Positions(oi), bytearray((oi == 0).astype(np.uint8).tobytes())


def dataset_key(js: JobState) -> str | None:
    """The key of a job's sample list: its ImageFolder root, or ``ROOT@VID`` for a view
    (a wrapped dataset: several roots and/or an index list, see :mod:`dlcachefs.client.wrappers`)."""
    if js.dataset is None or js.view is None:
        return js.dataset
    return f"{js.dataset or '.'}@{js.view.vid}"


def _first_positions(order: list[int], samples: SampleList) -> Positions:
    """Thread: inode -> its first position in ``order`` (the next epoch's, for the policy)."""
    return Positions(_order_inos(order, samples))


def _tgid(tid: int) -> int:
    """FUSE reports the calling thread's id: map it to its process."""
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return tid


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return 0
    # the command name may contain spaces and parentheses: split after the last ')'
    return int(data[data.rindex(b")") + 2 :].split()[1])



def _pgid(pid: int) -> int:
    """The process group of ``pid`` (itself when unknown)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2 :].split()[2])
    except (OSError, ValueError, IndexError):
        return pid


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


def _unannounced_reason(pid: int) -> str:
    """Why a process that reads announced nothing, from its environment: the launcher's
    hook on its PYTHONPATH (then no DataLoader was seen), the launcher's mark without the
    hook (a wrapper replaced PYTHONPATH), or neither (not launched)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return NOTHING_ANNOUNCED
    hooked = launched = False
    for var in env.split(b"\0"):
        if var.startswith(b"PYTHONPATH="):
            hooked = b"dlcachefs/client/_boot" in var
        elif var.startswith(ENV_LAUNCHED.encode() + b"="):
            launched = True
    if hooked:
        return HOOKED_SILENT
    return HOOK_LOST if launched else NOTHING_ANNOUNCED
