"""Streams: one per (job, rank) that announced its sampler; clairvoyant prefetch for each.

When a stream knows its dataset (an ImageFolder root), its sampler and its epoch, the
order of that epoch is known exactly (:mod:`dlcachefs.clairvoyance.replay`). The
prefetcher then fetches the samples from the source in that order, ahead of the reader,
into the cache (the chunk writer packs them into chunks in fetch order, so the epoch's
log comes out in its read order).

:class:`StreamManager` is the orchestration: it hears announcements (``on_stream``,
``on_order``, from the control state), configures each stream's epoch
(:meth:`StreamManager._configure`) and switches it, and follows each reader's position
(``note_open``). The rest is done by its parts, each in its own module:

* which stream an open belongs to, by process: :mod:`~dlcachefs.clairvoyance.attribution`;
* the datasets' sample lists: :mod:`~dlcachefs.clairvoyance.listings`;
* an epoch's order, positions and next order, computed in a thread:
  :mod:`~dlcachefs.clairvoyance.epochplan` (learned orders:
  :mod:`~dlcachefs.clairvoyance.learned`);
* the next epoch's log (LCache), and the read-backs into the next logs of samples
  served elsewhere (in training processes, or when their slot found no room):
  :mod:`~dlcachefs.clairvoyance.nextepoch`;
* the prefetch ahead of the reader: :mod:`~dlcachefs.clairvoyance.prefetchloop`;
* a stream's state: :mod:`~dlcachefs.clairvoyance.stream`.

Reader position: each open marks the first not-yet-consumed position of that sample in
the order; ``position`` is the first position not consumed. Workers read slightly out
of order; that only leaves a few holes behind ``position`` for a moment.

Modes (``mode`` and ``reason`` of each stream in stats):

* ``replayed``: the order is the sampler's, replayed (:mod:`dlcachefs.clairvoyance.replay`) over the
  job's dataset; a dataset that is a *view* (wrapped ImageFolders,
  :mod:`dlcachefs.data.wrappers`) is the concatenation of its roots' ImageFolder lists seen
  through its index list, each root's list checked against the training's digest first.
* ``learned``: the training said its order cannot be replayed (``sampler unknown``), or
  its dataset's list cannot be made as the training has it (a
  :class:`~dlcachefs.clairvoyance.listings.SampleListMismatch`: another sort order, other
  files; the reason says which); the
  stream is formed from the opens of the process tree, epoch by epoch (``epoch`` lines).
  When the order of opens of an epoch repeats the previous epoch's (up to the small
  reordering of loader workers), that order is prefetched for the next epoch.
* ``none``: nothing is prefetched, with the reason: an error, or (for
  processes that never announced, ``unannounced/PGID`` entries, at most
  ``MAX_UNANNOUNCED``) nothing was announced.

Concurrency: all state on the trio loop. Each announcement starts a configure task in
the manager's nursery (cancelled, through the stream's ``cancel`` scope, when a newer
announcement or the end of the job replaces it). The rule of an epoch switch: whatever
takes time (listing the dataset, replaying the order, positions over the whole order,
the next order) is done first, awaiting worker threads, into an immutable
:class:`~dlcachefs.clairvoyance.epochplan.EpochPlan`; then, after checking that the
configure task was not replaced meanwhile (its scope not cancelled, the stream's
announced epoch still this one), the plan is applied to the stream in one synchronous
step (:meth:`StreamManager._switch`, no await between the check and the last
assignment), so the read path never sees a stream half switched. The epoch's prefetch,
read plan and next-epoch planning then run in a nursery of the configure task.

Who owns what: the manager owns its nursery (opened in :meth:`StreamManager.run`) and the
streams' configure tasks. The next-epoch logs' background read-backs (of in-process
reads, and the retries of slots that found no room, with the room promised to them) are
the :class:`~dlcachefs.clairvoyance.nextepoch.NextEpochPlanner`'s: the manager binds its
nursery to the planner once it is open, and unbinds it at :meth:`StreamManager.close`,
so nothing of the planner starts before the nursery exists or after it closed.
``backfill`` and ``next_logs`` here only pass on to the planner, for the read path
(:mod:`~dlcachefs.clairvoyance.events`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Protocol

import trio

from dlcachefs.cache.buffers import ReadAhead
from dlcachefs.cache.namespace import Namespace
from dlcachefs.cache.readplan import ReadPlanner
from dlcachefs.cache.views import PolicyClock
from dlcachefs.clairvoyance.attribution import Attribution
from dlcachefs.clairvoyance.control import JobState, StreamState, ViewDef
from dlcachefs.clairvoyance.epochplan import (
    SHUFFLING,
    EpochPlan,
    choose_replayer,
    describe_mode,
    plan_epoch,
)
from dlcachefs.clairvoyance.learned import similar
from dlcachefs.clairvoyance.listings import SampleListMismatch, SampleLists, dataset_key
from dlcachefs.clairvoyance.nextepoch import NextEpochPlanner
from dlcachefs.clairvoyance.prefetchloop import PrefetchLoop
from dlcachefs.clairvoyance.reorder import NextEpochLog
from dlcachefs.clairvoyance.replay import RANKED, SamplerSpec
from dlcachefs.clairvoyance.replayworker import ReplayClosed, ReplayWorker
from dlcachefs.clairvoyance.samplelist import SampleList
from dlcachefs.clairvoyance.stream import Stream, StreamTable, same_dataset
from dlcachefs.config import Config
from dlcachefs.errors import DlcError
from dlcachefs.store.integrity import log_failure
from dlcachefs.store.schema import Entry

__all__ = ["EpochStarted", "JobDropped", "Stream", "StreamManager", "StreamTable", "dataset_key"]

log = logging.getLogger(__name__)


class EpochStarted(Protocol):
    """Told when a stream's announced epoch begins over its dataset's ``samples`` (once
    the list is made, before the order is replayed): the importance's
    :meth:`~dlcachefs.importance.losses.Losses.epoch_started` rebuilds the H-list there."""

    def __call__(self, stream: Stream, samples: SampleList) -> None: ...


class JobDropped(Protocol):
    """Told when a job's streams end (control forgot the job): the importance's
    :meth:`~dlcachefs.importance.losses.Losses.forget_job`."""

    def __call__(self, job: str) -> None: ...


class StreamManager:
    """Owns the streams and their tasks (see the module doc)."""

    def __init__(self, cfg: Config, streams: StreamTable, *, attribution: Attribution,
                 lists: SampleLists, planner: NextEpochPlanner, prefetch: PrefetchLoop,
                 plans: ReadPlanner, readahead: ReadAhead, ns: Namespace, clock: PolicyClock,
                 on_epoch: EpochStarted, on_job_dropped: JobDropped,
                 replay: ReplayWorker | None = None) -> None:
        """``streams``: the table this manager alone adds streams to and removes them
        from; ``plans``: each epoch's read plan (``run``, ``poke``, ``forget``);
        ``readahead``: a stream's bytes fetched ahead are let go at its switch;
        ``ns.gone``: files gone from the source, passed at a switch; ``clock``: the
        policy's clock (an epoch's first tick); ``replay``: the sampler replay worker
        (one of its own by default; closed with the manager)."""
        self.cfg = cfg
        self.streams = streams
        self.attribution = attribution
        self.lists = lists
        self.planner = planner
        self.prefetch = prefetch
        self.plans = plans
        self.readahead = readahead
        self.ns = ns
        self.clock = clock
        self.on_epoch = on_epoch
        self.on_job_dropped = on_job_dropped
        self._nursery: trio.Nursery | None = None
        self.replay_ready = False  # torch imported: orders can be replayed without waiting
        # torch's sampler replay runs there, not in the daemon
        self.replay = replay if replay is not None else ReplayWorker()
        self._replay_started = False

    @property
    def lead(self) -> int:
        """Samples a stream's prefetch runs ahead of its reader at most."""
        return self.prefetch.lead

    # ----- life cycle -------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Owns the streams' tasks (and the sample lists' nursery), until :meth:`close`
        or cancellation."""
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(self.lists.run)
                self._nursery = nursery
                self.planner.bind(nursery)  # its logs' read-backs start there from now on
                task_status.started()
                await trio.sleep_forever()
        finally:  # (cancelled without close(): nothing starts in the closed nursery)
            self._nursery = None
            self.planner.bind(None)

    def start_replay(self) -> None:
        """Start the sampler replay worker, once. Replaying a sampler needs torch (~3-4 s
        of CPU to import here), in a worker process (dlcachefs.clairvoyance.replayworker:
        never in the daemon, whose GIL it would hold), niced. Not at mount start: a mount
        read by something that never announces (raw readers, DLIO, a script without the
        hook) would pay that import during its first epoch (~3% of a first pass over a
        400 Mbit/s link here, ``bench.first_epoch``). It starts when a training process
        first reaches the control file: the hook opens it at interpreter start
        (:func:`dlcachefs.data.hook.install`), while the script imports its own torch,
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
            self.planner.bind(None)
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
        before = s.pace.workers
        s.pace.hint(st.batch, st.workers, st.prefetch_factor, st.epoch)
        if before is not None and st.workers is not None and st.workers != before:
            # (dlcachefs run --workers auto, or a script that changes it)
            log.info("stream %s/%s: the loader runs %d workers from epoch %s (was %d)",
                     st.job, st.rank, st.workers, st.epoch, before)
        s.pace.state = st  # the training's pace reports land there
        if pid is not None:
            s.pids.add(pid)
            self.attribution.announced(pid)  # attribution may have changed
        spec = st.sampler
        learned = spec is not None and spec.kind == "unknown"
        if (js.dataset is None and not learned) or spec is None or st.epoch is None:
            return
        if self._nursery is None:
            return
        key = None if learned else dataset_key(js)
        if key is not None and s.unmatched is not None and s.unmatched[0] == key:
            # its list was found not to be the training's: learned, as it was then
            spec, key, learned = SamplerSpec("unknown", reason=s.unmatched[1]), None, True
        if learned:
            s.learn.begin(st.epoch)
        # the previous epoch's prefetch stops now, even if its task has not started yet
        if s.cancel is not None:
            s.cancel.cancel()
        s.cancel = trio.CancelScope()
        s.restarting = not learned and s.epoch is not None and st.epoch == s.epoch
        s.target_epoch = st.epoch
        s.early = []
        s.explicit = st.orders if spec.kind == "explicit" else None
        s.learn.keep(learned)
        self._nursery.start_soon(self._configure, s, s.cancel, key, spec, st.epoch,
                                 js.view, st.sampler_index)

    def on_order(self, st: StreamState, js: JobState, epoch: int, order, pid: int) -> None:
        """An explicit order (``order`` lines, the importance sampler) was completed."""
        s = self.streams.get((st.job, st.rank))
        if s is not None and s.target_epoch == epoch and s.epoch != epoch:
            self.on_stream(st, js, pid)  # its epoch was announced first: start it now

    def drop_job(self, job: str) -> None:
        """Control forgot ``job`` (idle, its processes gone, to make room for a new one):
        its streams end. Their prefetch and planning stop, their logs become ordinary
        cache (an unfinished next-epoch log is given up), their read-ahead is let go."""
        for key in [k for k in self.streams if k[0] == job]:
            s = self.streams.pop(key)
            if s.cancel is not None:
                s.cancel.cancel()
            s.target_epoch = None  # a configure task still under way switches nothing
            self.planner.end_stream(s)
            self.readahead.drop_owner(s.key)
            self.plans.forget(s)
        self.attribution.forget()
        self.on_job_dropped(job)

    # ----- an epoch's configuration and switch ------------------------------------------

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
                log_failure(log, "stream %s: prefetch stopped", s.key)

    @staticmethod
    def _replaced(s: Stream, epoch: int) -> bool:
        """Whether the configure task of ``s``'s ``epoch`` was replaced (a newer
        announcement, the job's end or the unmount cancelled its scope)."""
        return s.target_epoch != epoch or trio.current_effective_deadline() == -float("inf")

    async def _samples_for(self, s: Stream, dataset: str | None, view: ViewDef | None
                           ) -> SampleList:
        """The stream's sample list: the job's ImageFolder, the view's composite list (its
        roots checked against the training's digests), or a learned order of opens."""
        if dataset is None:  # learned: the last epoch's opens, when they repeat
            pair = s.learn.take_pair()
            if pair is not None:  # compared in a thread: up to MAX_LEARNED opens each
                s.learn.stable = await trio.to_thread.run_sync(similar, *pair)
            seq = s.learn.sequence()
            return SampleList("", [], seq, [0] * len(seq), [])
        return await self.lists.ensure_sample_list(dataset, view)

    def _learn_instead(self, s: Stream, dataset: str, epoch: int, why: str) -> SamplerSpec:
        """The list of ``dataset`` is not the training's (``why``): the stream learns its
        order from the opens from this epoch on, as a ``sampler unknown`` would (its opens
        since the announcement, kept in ``early``, are this epoch's first). Its later
        announcements of the same dataset are learned too (``on_stream``)."""
        log.info("stream %s: its order is learned from the opens: %s", s.key, why)
        s.unmatched = (dataset, why)
        s.explicit = None
        s.learn.keep(True)
        s.learn.begin(epoch)
        if s.learn.cur is not None and not s.learn.cur:
            s.learn.cur.extend(s.early)
        s.restarting = False
        return SamplerSpec("unknown", reason=why)

    async def _configure_now(self, s: Stream, dataset: str | None, spec: SamplerSpec,
                             epoch: int, view: ViewDef | None = None, subset=None) -> None:
        try:
            try:
                samples = await self._samples_for(s, dataset, view)
            except SampleListMismatch as e:
                if self._replaced(s, epoch):
                    return  # the newer announcement finds the same mismatch
                spec = self._learn_instead(s, dataset, epoch, str(e))
                dataset = view = subset = None
                samples = await self._samples_for(s, None, None)
            if (spec.kind != "unknown" and s.begun != epoch and not self._replaced(s, epoch)):
                # the epoch begins for importance and substitution once its dataset is
                # listed, not once its order is replayed (a torch sampler's replay may
                # first wait for torch): from here the job's losses count and the H-list
                # is rebuilt. A learned order has no dataset (no importance, no losses).
                s.dataset, s.begun = dataset, epoch
                self.on_epoch(s, samples)
                s.used, s.substituted_before, s.substituted = set(), s.substituted, {}
            replayer = choose_replayer(s.replayer, spec, samples, s.samples, epoch,
                                       explicit=s.explicit, learned_stable=s.learn.stable,
                                       worker=self.replay, subset=subset)
            # Only a shuffling sampler's order can be said to repeat (a sequential one
            # always does, and its next epoch is known anyway), and only after an epoch:
            # a later epoch number, or the same one read to its end (a set_epoch never
            # called). The same epoch announced again part way (a peek at one batch, a
            # restart from a checkpoint) is a restart, not a repeat. (A view's sample
            # list is made anew for each epoch: the same dataset, compared by its key,
            # not by identity.) Asked before the plan: while it is computed, this stream
            # either switches nothing (another epoch, whose position is not asked) or
            # restarts (its opens wait in ``early``: the position stays).
            may_repeat = (spec.kind in SHUFFLING and same_dataset(s.samples, samples)
                          and len(samples) == len(s.samples) and bool(s.order)
                          and (epoch != s.epoch or s.position >= len(s.order)))
            laid = s.next_log
            # with --peers, a distributed sampler's every rank's order too
            world = (spec.world if self.cfg.peers is not None and spec.kind == "distributed"
                     and spec.world >= 2 else None)
            # the policy's horizon of later epochs (epochplan): this stream's share of the
            # cache, which its job's ranks share; none when the dataset fits the cache
            limit = self.planner.writer.limit
            ranks = max(1, spec.world) if spec.kind in RANKED else 1
            cover = 0 if samples.nbytes <= limit else limit // ranks
            plan = await trio.to_thread.run_sync(partial(
                plan_epoch, replayer, epoch, samples,
                last_order=s.order if may_repeat else None,
                laid_order=laid.order if laid is not None else None,
                cluster_world=world, key=s.key, cover_bytes=cover))
        except (DlcError, ValueError, OSError) as e:
            s.error = str(e)
            s.mode, s.reason = "none", str(e)
            s.restarting = False
            # an unmount that cuts replays still queued for the worker is not a problem
            # of the stream's order: said at INFO, so a log watcher sees no warning
            level = logging.INFO if isinstance(e, ReplayClosed) else logging.WARNING
            log.log(level, "stream %s: cannot replay its order: %s", s.key, e)
            return
        if self._replaced(s, epoch):
            return  # a newer announcement replaced this one while the order was computed
        self._switch(s, plan, spec, dataset, laid)  # one step: no await in there
        assert self._nursery is not None  # (close() cancelled this task otherwise)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.prefetch.run, s)
            # this epoch's reads from the logs, in its order (dlcachefs.cache.readplan)
            nursery.start_soon(self.plans.run, s)
            await self.planner.plan_next(s, plan.samples, epoch, plan.next_order,
                                         self._nursery)

    def _switch(self, s: Stream, plan: EpochPlan, spec: SamplerSpec, dataset: str | None,
                laid: NextEpochLog | None) -> None:
        """Apply ``plan`` to ``s``: the stream switches to its epoch. Synchronous, so the
        stream switches epochs atomically (see the module doc's rule)."""
        epoch, samples, order = plan.epoch, plan.samples, plan.order
        s.error = None
        s.replayer = plan.replayer
        s.mode, s.reason = describe_mode(spec, plan.replayer, epoch, len(samples), s.learn)
        if plan.repeats:
            what = ("DistributedSampler.set_epoch is not called"
                    if spec.kind == "distributed" and s.epoch == epoch
                    else "the sampler's generator is seeded the same way each epoch")
            s.reason = (f"{s.reason.split(';')[0]}; this epoch repeats the last one's order "
                        f"({what}?): the next is taken to repeat it too")
        s.memory_prefetch = self.planner.partial(samples.nbytes, plan.next_first is not None)
        if epoch != s.epoch or samples is not s.samples:
            # not s.dataset to compare: the importance step may have set it already
            s.pages.end_epoch(same_dataset=same_dataset(s.samples, samples))
        s.dataset, s.samples, s.epoch, s.order = dataset, samples, epoch, order
        s.repeats = plan.repeats
        s.positions, s.consumed = plan.positions, plan.consumed
        s.ready = bytearray(len(order))
        s.position = s.prefetched_upto = 0
        s.restarting = False  # (its opens so far are in early, counted below)
        self.readahead.drop_owner(s.key)
        if spec.kind == "unknown":
            s.used, s.substituted_before, s.substituted = set(), s.substituted, {}
        s.begun = None  # switched: announcing this epoch again begins it again
        s.epoch_tick = self.clock.tick
        s.last_open = time.monotonic()
        s.latency.restart(s.last_open)
        s.next_first, s.next_first_order = plan.next_first, plan.next_order
        s.later_first = plan.later
        s.cluster = plan.cluster
        early, s.early = s.early, []
        log.info("stream %s: epoch %d, %d samples, %s", s.key, epoch, len(order), s.mode)
        assert self._nursery is not None
        self.planner.begin_epoch(s, epoch, laid, plan.laid_ok, self._nursery)
        for ino in early:  # opens before the switch: counted against this epoch's log
            self.note_open(s, ino, learn=False)  # (learned when they came)
        if self.ns.gone:  # files gone from the source: never opened in this epoch
            self._pass_gone(s, list(self.ns.gone))

    # ----- readers' opens (the engine's open path) ----------------------------------------

    def stream_of(self, pid: int) -> Stream | None:
        """The stream an open by ``pid`` belongs to (:meth:`Attribution.stream_of`)."""
        return self.attribution.stream_of(pid)

    def stream_named(self, job: str, rank: int) -> Stream | None:
        """The stream of ``job``'s rank ``rank``; with rank -1 (not known), the job's
        only stream on this mount, if it has one only."""
        if rank >= 0:
            return self.streams.get((job, rank))
        found = [s for (j, _r), s in self.streams.items() if j == job]
        return found[0] if len(found) == 1 else None

    def backfill(self, inos: Sequence[int]) -> None:
        """:meth:`NextEpochPlanner.backfill_reads`."""
        self.planner.backfill_reads(inos)

    def group_of(self, pid: int) -> str | None:
        """The ``unannounced/PGID`` key of a reader (:meth:`Attribution.group_of`)."""
        return self.attribution.group_of(pid)

    def note_open(self, s: Stream, ino: int, learn: bool = True) -> None:
        """Mark the sample consumed and move the stream's position."""
        if learn:
            s.learn.note(ino)
        if s.epoch != s.target_epoch or s.restarting:
            if len(s.early) < 1 << 20:
                s.early.append(ino)
            return
        p = s.positions.pop(ino)
        if p is None:
            return
        s.last_open = time.monotonic()
        if s.consume(ino, p):
            # a chunk of its current log released: room for any rank's next log (each
            # log's slots are filled from every rank's opens)
            self.planner.retry_no_room()
        s.advance()

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
        for nl in self.planner.next_logs():  # their slots get fillers: they can be sealed
            for ino in inos:
                nl.gone(ino)

    def _pass_gone(self, s: Stream, inos: list[int]) -> None:
        moved = s.position
        for ino in inos:
            while (p := s.positions.pop(ino)) is not None:  # (every position of it)
                s.consume(ino, p)
        s.advance()
        if s.position != moved:
            self.plans.poke(s)

    def next_logs(self) -> list[NextEpochLog]:
        """:meth:`NextEpochPlanner.next_logs`: every stream's next epoch's log."""
        return self.planner.next_logs()

    def unprotect_idle(self, now: float) -> None:
        """:meth:`NextEpochPlanner.unprotect_idle`."""
        self.planner.unprotect_idle(now)

    # ----- questions of other parts (control, losses, the packer, the mount), answered by
    # the parts that hold the answer (callers may be handed those parts instead) --------

    def sample_list(self, dataset: str) -> SampleList | None:
        """:meth:`SampleLists.sample_list`."""
        return self.lists.sample_list(dataset)

    def list_soon(self, dataset: str, then: Callable[[str], None],
                  view: ViewDef | None = None) -> None:
        """:meth:`SampleLists.list_soon`."""
        self.lists.list_soon(dataset, then, view)

    def dataset_size(self, rel: str) -> int | None:
        """:meth:`SampleLists.dataset_size`."""
        return self.lists.dataset_size(rel)

    def note_opendir(self, d: Entry) -> None:
        """:meth:`SampleLists.note_opendir`."""
        self.lists.note_opendir(d)

    def job_dataset(self, job: str) -> str | None:
        """:meth:`StreamTable.job_dataset`."""
        return self.streams.job_dataset(job)

    def job_reading(self, job: str) -> bool:
        """:meth:`StreamTable.job_reading`."""
        return self.streams.job_reading(job)

    def substitutions_of(self, job: str) -> dict[int, int]:
        """:meth:`StreamTable.substitutions_of`."""
        return self.streams.substitutions_of(job)

    def stats(self) -> dict:
        out: dict = {s.key: s.stats() for s in self.streams.values()}
        out.update(self.attribution.stats())
        return out
