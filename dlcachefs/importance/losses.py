"""Losses the jobs report, booked into the importance table (iCACHE's IVs).

A job writes ``loss`` lines into the control file (indices into its dataset and their
losses); :meth:`Losses.on_loss` books them into the :class:`InodeImportance` of the
dataset, by the samples actually served: a loss reported for a sample that was
substituted belongs to its substitute. When a stream begins an epoch
(:meth:`Losses.epoch_started`), its job's caching benefit over the epoch that ended is
noted and the H-list is rebuilt, in a thread, from the losses so far.

Nothing valid is dropped: losses that arrive before their dataset's sample list is known
(a script that announces and reports at once) wait, at most ``MAX_EARLY_LOSSES`` pairs
(the control file refuses more with EINVAL, see :meth:`Losses.room`), while the list is
made in the background; they are applied in arrival order once it is known. Losses that
turn out invalid then are counted (``losses_ignored``) and noted in the control file's
error log.

Concurrency: trio loop; the importance table's rebuild runs in a worker thread, one at a
time, as a task of :meth:`Losses.run`'s nursery.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import trio

from dlcachefs.cache.stats import Counters
from dlcachefs.cache.tasks import TaskOwner
from dlcachefs.clairvoyance.streams import Stream, StreamManager, dataset_key
from dlcachefs.clairvoyance.trace import TraceRecorder
from dlcachefs.importance.view import InodeImportance
from dlcachefs.store.integrity import log_failure

if TYPE_CHECKING:
    from dlcachefs.clairvoyance.control import ErrorLog, JobState

log = logging.getLogger(__name__)

#: loss pairs that may wait for their dataset's sample list (about 100 MB at most)
MAX_EARLY_LOSSES = 1 << 22


class Losses(TaskOwner):
    """Reported losses -> the importance table (module docstring)."""

    def __init__(self, importance: InodeImportance, streams: StreamManager,
                 counters: Counters, h_fraction: float,
                 trace: TraceRecorder | None = None, errors: ErrorLog | None = None) -> None:
        """``errors``: the control file's error log, where losses that turn out invalid
        later are noted (they were accepted)."""
        self.importance = importance
        self.streams = streams
        self.counters = counters
        self.h_fraction = h_fraction
        self.trace = trace
        self.errors = errors
        self._switch_said = -60.0  # monotonic s of the last note of a dataset switch
        # losses waiting for their dataset's sample list: dataset -> [(job, idx, values)]
        self._early: dict[str, list[tuple[str, list[int], list[float]]]] = {}
        self.waiting = 0  # loss pairs in _early
        self._rebuilding = False
        self._rebuild_due = False
        super().__init__()  # run() holds the importance table's rebuilds

    def room(self) -> int:
        """How many more loss pairs may wait for their dataset's sample list."""
        return MAX_EARLY_LOSSES - self.waiting

    # ----- epochs -----------------------------------------------------------------------

    def _dropping_for(self, dataset: str, why: str) -> None:
        """Before the importance moves to ``dataset``: one dataset's importance at a time
        (docs/importance.md), so the losses held for another are dropped; counted
        (``losses_dropped``) and said in .dlcache/errors, at most once a minute (two
        jobs reporting for two datasets switch it at every batch of losses)."""
        imp = self.importance
        if imp.dataset in (None, dataset) or imp.table is None or not imp.table.jobs:
            return
        lost = sum(j.reported for j in imp.table.jobs.values())
        if not lost:
            return  # nothing held: nothing to say
        self.counters.losses_dropped += lost
        now = time.monotonic()
        if now - self._switch_said >= 60.0:
            self._switch_said = now
            self._note_invalid(f"importance now for dataset {dataset or '.'!r} ({why}): the "
                               f"{lost} losses reported for dataset {imp.dataset or '.'!r} "
                               f"are dropped (one dataset's importance per mount)")

    def forget_job(self, job: str) -> None:
        """A job forgotten by control: its importance values no longer weigh (and their
        memory, n floats per job, is let go)."""
        table = self.importance.table
        if table is not None and table.jobs.pop(job, None) is not None:
            self._rebuild_due = True
            if not self._rebuilding:
                self.spawn(self._rebuild_importance, table)

    def epoch_started(self, stream: Stream, samples) -> None:
        """A stream begins an epoch: note its job's caching benefit measured over the
        epoch that ended, and rebuild the H-list (in a thread) from the losses so far."""
        imp = self.importance
        ds = stream.dataset or ""
        if (imp.dataset not in (None, ds) and imp.table is not None and imp.table.jobs
                and stream.job not in imp.table.jobs):
            # a job that reports no losses (an eval loader, another job's val/ set) does
            # not take the importance away from the dataset whose losses it holds; the
            # losses of another dataset, when they come, do (and say so: _apply_losses)
            return
        self._dropping_for(ds, f"job {stream.job!r} starts an epoch over it")
        imp.bind(ds, samples.inos, self.h_fraction)
        imp.current_epoch = max(imp.current_epoch, stream.target_epoch or 0)
        table = imp.table
        if table is None or not table.jobs:
            return
        b = stream.benefit(time.monotonic())
        if b is not None and stream.job in table.jobs:
            table.jobs[stream.job].benefit = b
        self._rebuild_due = True
        if not self._rebuilding:
            self.spawn(self._rebuild_importance, table)

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
                    log_failure(log, "rebuilding the importance table failed")
        finally:
            self._rebuilding = False

    # ----- losses -----------------------------------------------------------------------

    def on_loss(self, js: JobState, indices: list[int], values: list[float]) -> None:
        """Losses job ``js`` reported (``loss`` control lines): its IVs (module
        docstring)."""
        job = js.name
        dataset = dataset_key(js)
        if dataset is None:  # control refuses losses of a job without a dataset
            self.counters.losses_ignored += len(indices)
            return
        sl = self.streams.sample_list(dataset)
        if sl is None or self._early.get(dataset):
            self._early.setdefault(dataset, []).append((job, indices, values))
            self.waiting += len(indices)
            self.streams.list_soon(dataset, self._apply_early_losses, js.view)
            return
        self._apply_losses(job, dataset, sl, indices, values)

    def _apply_early_losses(self, dataset: str) -> None:
        """The sample list of ``dataset`` is known: apply the losses that waited for it."""
        sl = self.streams.sample_list(dataset)
        queued = self._early.pop(dataset, [])
        for job, indices, values in queued:
            self.waiting -= len(indices)
            if sl is not None:
                self._apply_losses(job, dataset, sl, indices, values)
            else:
                self._note_invalid(f"{len(indices)} losses of job {job!r} dropped: the "
                                   f"sample list of dataset {dataset or '.'!r} could not be "
                                   f"made")
                self.counters.losses_ignored += len(indices)

    def _note_invalid(self, msg: str) -> None:
        log.warning("%s", msg)
        if self.errors is not None:
            self.errors.note(msg)

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
        self._dropping_for(dataset, f"losses of job {job!r}")
        imp.bind(dataset, sl.inos, self.h_fraction)
        # losses arrive late (the reporter batches): the last epoch's map, then this one's
        subs = self.streams.substitutions_of(job)
        if subs:
            idx = imp.index_of
            indices = [idx.get(subs.get(sl.inos[i], -1), i) for i in indices]
        if imp.table is None:
            return
        imp.table.update(job, indices, values)
        if self.trace is not None:
            self.trace.lost(dataset, imp.current_epoch, indices, values)
        self.counters.losses += len(indices)
