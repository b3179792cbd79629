"""One stream of readers: a (job, rank) that announced its sampler, and its epoch's state.

A :class:`Stream` holds what the read path asks of it (the epoch's ``order``, the
``positions`` not consumed yet and the reader's ``position``, the logs laid out for this
epoch and the next, ``memory_prefetch``, the page-cache verdict, the substitutions) and
small parts that belong together: the page-cache verdict
(:class:`~dlcachefs.clairvoyance.pagecache.PageVerdict`), the learned order's opens
(:class:`~dlcachefs.clairvoyance.learned.LearnedOpens`), the open latencies
(:class:`~dlcachefs.clairvoyance.pace.OpenLatency`) and the loader's pace
(:class:`~dlcachefs.clairvoyance.pace.Pace`). :class:`StreamTable` is the mount's streams
by (job, rank), shared by the parts that read them.

Concurrency: trio loop only; an epoch's order and positions are computed in a worker
thread and handed over by :class:`~dlcachefs.clairvoyance.streams.StreamManager` in one
synchronous step (:mod:`dlcachefs.clairvoyance.epochplan`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from dlcachefs.cache.readers import ReadCounts
from dlcachefs.clairvoyance.history import EpochHistory
from dlcachefs.clairvoyance.learned import LearnedOpens
from dlcachefs.clairvoyance.pace import OpenLatency, Pace
from dlcachefs.clairvoyance.pagecache import PageVerdict
from dlcachefs.clairvoyance.positions import Positions

if TYPE_CHECKING:
    from dlcachefs.clairvoyance.epochplan import ExplicitOrders
    from dlcachefs.clairvoyance.learned import LearnedOrder
    from dlcachefs.clairvoyance.positions import ClusterUse
    from dlcachefs.clairvoyance.prefetchloop import ChunksAhead
    from dlcachefs.clairvoyance.reorder import NextEpochLog
    from dlcachefs.clairvoyance.replayworker import RemoteReplayer
    from dlcachefs.clairvoyance.samplelist import SampleList

log = logging.getLogger(__name__)

#: a stream that opened nothing for this long (a training that ended or died mid-epoch)
#: no longer protects its logs from eviction (NextEpochPlanner.unprotect_idle), and its
#: job is no longer reading (StreamTable.job_reading)
IDLE_S = 300.0

#: why a stream's next epoch's log was given up (stats: ``reorder``)
GIVEN_UP = ("given up: the kernel's page cache serves this epoch "
            "(page_cache.serves_this_epoch); laid out again at the start of an epoch that "
            "follows one whose READs came")


def same_dataset(old: SampleList | None, new: SampleList) -> bool:
    """Whether an epoch over ``new`` reads the dataset the last one (over ``old``) read:
    the same list, or the same root (a view's key included)."""
    return old is not None and (new is old or new.root == old.root)


@dataclass
class Stream:
    job: str
    rank: int
    dataset: str | None = None
    samples: SampleList | None = None
    replayer: RemoteReplayer | ExplicitOrders | LearnedOrder | None = None
    epoch: int | None = None
    # ----- the epoch's progress (read by the engine, the read plan, the policy) -----
    order: list[int] = field(default_factory=list)  # dataset indices of the current epoch
    positions: Positions = field(default_factory=lambda: Positions([]))
    consumed: bytearray = field(default_factory=bytearray)
    ready: bytearray = field(default_factory=bytearray)
    position: int = 0
    prefetched_upto: int = 0
    moved: trio.Event = field(default_factory=trio.Event)
    # ----- measures (stats) -----
    stall_seconds: float = 0.0
    # its bytes from the source since mount (:attr:`bytes_from_source`, which also
    # counts them in the epoch being read)
    source_bytes: int = 0
    prefetched: int = 0
    history: EpochHistory = field(default_factory=EpochHistory)  # by epoch (stats)
    reads: ReadCounts = field(default_factory=ReadCounts)
    #: its last open was served in the training's process (dlcachefs.data.intercept):
    #: its read plan asks the kernel for pages instead of reading into memory
    in_process: bool = False
    # ----- the announcement being configured -----
    cancel: trio.CancelScope | None = None
    pids: set[int] = field(default_factory=set)
    error: str | None = None
    target_epoch: int | None = None  # announced; ``epoch`` catches up once its order is known
    early: list[int] = field(default_factory=list)  # opens seen before the order was known
    explicit: dict | None = None  # epoch -> order, for ``sampler explicit`` (order lines)
    #: (dataset key, why): the mount cannot make that dataset's list as the training has
    #: it (a SampleListMismatch), so its order is learned from the opens instead
    unmatched: tuple[str, str] | None = None
    # the announced epoch already begun for importance while its order is being replayed
    # (a replay restarted by ``on_order`` must not begin it twice)
    begun: int | None = None
    # its epoch was announced again (a restart, or a set_epoch never called) and is being
    # configured: the opens meanwhile are the new pass's, kept in ``early`` until it is
    restarting: bool = False
    mode: str = "none"  # replayed | learned | none
    reason: str = "waiting for the dataset, sampler and epoch"
    # ----- logs laid out in an epoch's order (LCache) -----
    next_log: NextEpochLog | None = None  # the next epoch's log being laid out
    current_log: NextEpochLog | None = None  # the reordered log this epoch reads
    reorder: str = ""  # why no next epoch's log is laid out (stats), when that is decided
    memory_prefetch: bool = False  # dataset > half the cache: prefetch into memory only
    chunks_ahead: ChunksAhead | None = None  # its prefetcher's chunks loaded ahead
    last_open: float = 0.0  # monotonic time of its epoch switch or last open in its order
    # ----- the next epoch's order when known: sample -> first position (the policy's
    # future), and a distributed sampler's cluster-wide use (every rank's, --peers) -----
    next_first: Positions | None = None
    next_first_order: list[int] = field(default_factory=list)
    #: the known epochs after the next one, (first positions, length) each, as far as the
    #: policy's horizon reaches (:func:`~dlcachefs.clairvoyance.epochplan.plan_epoch`)
    later_first: tuple[tuple[Positions, int], ...] = ()
    cluster: ClusterUse | None = None
    # this epoch's order is the last epoch's again (a generator seeded anew each epoch, a
    # DistributedSampler whose set_epoch is never called): the next one is taken to
    # repeat it too, and no next-epoch log is laid out (the last one is read in order)
    repeats: bool = False
    epoch_tick: int = 0  # the policy clock's tick when this epoch began
    # ----- substitution (iCACHE) -----
    used: set[int] = field(default_factory=set)  # inodes served this epoch (substitution)
    substituted: dict[int, int] = field(default_factory=dict)  # requested -> served ino
    substituted_before: dict[int, int] = field(default_factory=dict)  # the last epoch's
    substitutions: dict[int, int] = field(default_factory=dict)  # epoch -> count
    # ----- parts -----
    learn: LearnedOpens = field(default_factory=LearnedOpens)
    latency: OpenLatency = field(default_factory=OpenLatency)
    pace: Pace = field(default_factory=Pace)  # the loader's fetch timings (DLCache Alg. 2)
    pages: PageVerdict = field(init=False)

    def __post_init__(self) -> None:
        self.pages = PageVerdict(on_found=self._give_up_next_log)

    @property
    def key(self) -> str:
        return f"{self.job}/{self.rank}"

    # ----- measures -------------------------------------------------------------------

    @property
    def reading_epoch(self) -> int | None:
        """The epoch its opens belong to: the announced one from its announcement on (its
        order may still be computed), else the last one switched to."""
        return self.target_epoch if self.target_epoch is not None else self.epoch

    @property
    def bytes_from_source(self) -> int:
        """Bytes read from the source for this stream since mount (its misses and its
        prefetch). Adding to it counts them in the epoch being read too (:attr:`history`),
        wherever the read path counts them."""
        return self.source_bytes

    @bytes_from_source.setter
    def bytes_from_source(self, value: int) -> None:
        self.history.note_source_bytes(self.reading_epoch, value - self.source_bytes)
        self.source_bytes = value

    def note_served(self, waited: bool) -> None:
        """One of its opens was served (a miss when it ``waited`` for the source)."""
        self.history.note_open(self.reading_epoch, waited)

    # ----- the epoch's progress -------------------------------------------------------

    def consume(self, ino: int, p: int) -> bool:
        """Position ``p`` (of ``ino``) is done with in this epoch; True when that released
        a chunk of its current log (room for the next logs)."""
        self.consumed[p] = 1
        cur = self.current_log
        if cur is not None and cur.release_after_use:
            done = cur.used(ino)  # LCache line 16: release a chunk after use
            if done is not None:
                cur.release(done)
                if self.next_log is not None:
                    self.next_log.room_freed()
                return True
        return False

    def advance(self) -> None:
        """Move the position past what is consumed; wake what waits on it."""
        moved = False
        while self.position < len(self.consumed) and self.consumed[self.position]:
            self.position += 1
            moved = True
        if moved:
            self.moved.set()
            self.moved = trio.Event()

    @property
    def order_unknowable(self) -> bool:
        """No order will cover the opens now: a learned stream whose order has not repeated
        yet, or one whose replay failed (scan-ahead may guess for it). A stream whose
        announced order is still being computed is not one."""
        if self.order and self.epoch == self.target_epoch:
            return False
        return self.learn.cur is not None or self.error is not None

    def covers(self, ino: int) -> bool:
        """Whether ``ino`` is one of the samples of the dataset this stream reads (True
        while that is not known yet: no order was switched to). A training's processes
        open other files too (a validation loader the hook does not announce, over another
        directory or another part of the dataset): those opens are no order's."""
        s = self.samples
        if s is None or not self.order:
            return True
        found = s.covers(ino)
        return True if found is None else found

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

    # ----- measures of its opens (the engine's open path) -----------------------------

    def note_latency(self, cached: bool, seconds: float) -> None:
        """An open served from the cache or not: :meth:`OpenLatency.note`."""
        self.latency.note(cached, seconds)

    def benefit(self, now: float) -> float | None:
        """The epoch's measured caching benefit so far: :meth:`OpenLatency.benefit`."""
        return self.latency.benefit(now)

    # ----- the page-cache verdict (see PageVerdict) -----------------------------------

    @property
    def pages_served(self) -> bool:
        """The kernel's page cache serves this epoch: no read plan, no preloads."""
        return self.pages.served

    @property
    def pages_lost(self) -> trio.Event:
        """Set when the pages stop serving the epoch (a paused read plan waits on it)."""
        return self.pages.lost

    @property
    def pages_judged(self) -> bool:
        """A window of this epoch's opens was judged."""
        return self.pages.judged

    def note_cached_open(self) -> int:
        """:meth:`PageVerdict.note_cached_open`."""
        return self.pages.note_cached_open()

    def note_cached_read(self, count: int) -> None:
        """:meth:`PageVerdict.note_cached_read`."""
        self.pages.note_cached_read(count)

    def note_unread(self, count: int) -> None:
        """:meth:`PageVerdict.note_unread`."""
        self.pages.note_unread(count)

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
                "bytes_from_source": self.bytes_from_source,
                # the last epochs' bytes from the source, hits and misses
                "epochs": self.history.stats(), "dataset": self.dataset,
                "substitutions": {str(k): v for k, v in sorted(self.substitutions.items())},
                "error": self.error, "loader": self.pace.stats(), "reads": self.reads.stats(),
                "page_cache": self.pages.stats(),
                # --peers: every rank's order is known (the tier's expiry is the cluster's)
                "cluster_ranks": None if self.cluster is None else self.cluster.world,
                "next_log": None if self.next_log is None else {
                    "epoch": self.next_log.epoch, "chunks": len(self.next_log.chunks),
                    "sealed": self.next_log.sealed, "failed": self.next_log.failed},
                **({"reorder": self.reorder} if self.reorder else {})}


class StreamTable(dict[tuple[str, int], Stream]):
    """The mount's streams by (job, rank), and what is asked of them by job. One table
    per mount, made by the composition root and shared by the parts that read it (the
    stream manager, which alone adds and removes streams; the policy's future; the
    attribution of readers; the sample lists). Trio loop."""

    def job_dataset(self, job: str) -> str | None:
        """The dataset a stream of ``job`` reads, if any."""
        for s in self.values():
            if s.job == job and s.dataset is not None:
                return s.dataset
        return None

    def job_reading(self, job: str) -> bool:
        """Whether a stream of ``job`` opened a file in the last IDLE_S seconds."""
        now = time.monotonic()
        return any(k[0] == job and now - s.last_open < IDLE_S for k, s in self.items())

    def substitutions_of(self, job: str) -> dict[int, int]:
        """Requested sample -> the sample served instead, for ``job``'s streams: the last
        epoch's substitutions, then this one's (losses are reported late)."""
        subs: dict[int, int] = {}
        for st in self.values():
            if st.job == job:
                subs.update(st.substituted_before)
                subs.update(st.substituted)
        return subs

    def samples_read(self, dataset: str) -> SampleList | None:
        """The sample list a stream reads ``dataset`` by, if any."""
        for st in self.values():
            if st.dataset == dataset and st.samples is not None:
                return st.samples
        return None

    def ordered(self) -> int:
        """How many streams know their order (the ranks laying out their next epochs)."""
        return sum(1 for s in self.values() if s.order)
