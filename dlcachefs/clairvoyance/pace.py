"""How fast a stream's loader workers fetch, measured from their opens (DLCache's t_fetch),
and what the cache saves them (iCACHE's caching benefit, :class:`OpenLatency`).

A PyTorch DataLoader worker (a process) takes a batch index, then loads the batch's
samples one after the other: for a map-style dataset over files (ImageFolder), one
``open`` per sample, then the sample is read and processed (decoded, transformed) before
the next ``open``. So the time between two consecutive opens of one worker *within a
batch* is one sample's fetch time, I/O and processing included: what DLCache calls
t_fetch per sample (Algorithm 2 takes it per batch: ``batch`` times this). Between the
last open of a batch and the first of the worker's next batch the worker may also have
waited for an index (the training is slower than the loader): those gaps are kept apart.

With the ``batch B`` hint (``batch B workers=K prefetch_factor=F``, sent by the torch
hook with the epoch), the k-th open of a worker (counted from 0 in the epoch) starts a
batch when ``k % B == 0``. Without the hint, nothing is split and only the totals are
kept. A worker is a reader's pid as FUSE gives it (a DataLoader worker loads in its
main thread, so the pid is the process's).

The training's own side comes from the torch hook: ``pace iters=N steps=M wait=S
train=S`` (:func:`dlcachefs.clairvoyance.protocol.pace_line`), kept on the stream's
control state (``StreamState.train_pace``) and shown here as ``training``: the seconds it
waited for batches and the seconds of its own step between them (DLCache's t_req).

Per epoch: opens, the span from the first open to the last, the sum and count of the
in-batch gaps, of the between-batch gaps, and of the daemon's own time per open; the
last complete epoch is kept next to the current one, so a reading right after an epoch
ended describes that epoch. O(1) per open. Trio loop only (called from
:meth:`dlcachefs.cache.engine.Engine.open`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

#: worker pids remembered per epoch (more workers than this are not told apart)
MAX_WORKERS = 1024
#: epochs whose loader-worker count is kept (``workers_by_epoch``)
WORKERS_EPOCHS = 64


@dataclass
class _Epoch:
    epoch: int | None
    opens: int = 0
    first: float = 0.0
    last: float = 0.0
    intra_s: float = 0.0   # in-batch gaps: one sample's fetch (I/O + processing)
    intra_n: int = 0
    inter_s: float = 0.0   # gaps across a batch boundary (may include waiting for work)
    inter_n: int = 0
    io_s: float = 0.0      # the daemon's time per open (cache or source)
    workers: dict[int, tuple[int, float]] = field(default_factory=dict)  # pid -> (k, t)

    def as_dict(self) -> dict:
        return {"epoch": self.epoch, "opens": self.opens, "workers_seen": len(self.workers),
                "span_s": round(self.last - self.first, 6),
                "sample_fetch_s": round(self.intra_s / self.intra_n, 6) if self.intra_n
                else None, "in_batch_gaps": self.intra_n,
                "between_batches_s": round(self.inter_s / self.inter_n, 6) if self.inter_n
                else None, "between_batch_gaps": self.inter_n,
                "open_s": round(self.io_s / self.opens, 6) if self.opens else None,
                "worker_pids": sorted(self.workers)[:64]}


class Pace:
    """The fetch timings of one stream's readers (see the module doc)."""

    def __init__(self) -> None:
        self.batch: int | None = None
        self.workers: int | None = None
        self.prefetch_factor: int | None = None
        self.cur: _Epoch | None = None
        self.prev: _Epoch | None = None
        #: the hint's worker count per announced epoch (``dlcachefs run --workers auto``
        #: changes it from epoch to epoch), the last :data:`WORKERS_EPOCHS`
        self.by_epoch: dict[int, int] = {}
        self.state = None  # the stream's control state (its ``train_pace``), once announced

    def hint(self, batch: int | None, workers: int | None,
             prefetch_factor: int | None, epoch: int | None = None) -> None:
        """The ``batch`` hint of the stream's announcement (of ``epoch``, if known)."""
        self.batch, self.workers, self.prefetch_factor = batch, workers, prefetch_factor
        if epoch is not None and workers is not None:
            self.by_epoch.pop(epoch, None)  # (re-inserted last: the newest)
            self.by_epoch[epoch] = workers
            while len(self.by_epoch) > WORKERS_EPOCHS:
                del self.by_epoch[next(iter(self.by_epoch))]

    def note(self, pid: int, start: float, end: float, epoch: int | None) -> None:
        """An open by ``pid`` of this stream, from ``start`` to ``end`` (monotonic s)."""
        cur = self.cur
        if cur is None or cur.epoch != epoch:
            if cur is not None and cur.opens:
                self.prev = cur
            cur = self.cur = _Epoch(epoch, first=start)
        cur.opens += 1
        cur.last = start
        cur.io_s += end - start
        w = cur.workers.get(pid)
        if w is None:
            if len(cur.workers) < MAX_WORKERS:
                cur.workers[pid] = (1, start)
            return
        k, t = w
        gap = start - t
        if self.batch and k % self.batch == 0:
            cur.inter_s += gap
            cur.inter_n += 1
        else:
            cur.intra_s += gap
            cur.intra_n += 1
        cur.workers[pid] = (k + 1, start)

    def seconds_per_sample(self) -> float | None:
        """The stream's wall time per opened sample: the current epoch's span over its
        opens, else the last complete epoch's; None until two opens were seen."""
        for ep in (self.cur, self.prev):
            if ep is not None and ep.opens >= 2 and ep.last > ep.first:
                return (ep.last - ep.first) / (ep.opens - 1)
        return None

    def stats(self) -> dict:
        """The hints and both epochs' measurements (``current``, ``previous``)."""
        tp = getattr(self.state, "train_pace", None)
        training = None if tp is None else {
            "iters": tp[0], "steps": tp[1], "wait_s": round(tp[2], 6),
            "train_s": round(tp[3], 6), "age_s": round(max(0.0, time.time() - tp[4]), 3)}
        return {"batch": self.batch, "workers": self.workers,
                "prefetch_factor": self.prefetch_factor, "training": training,
                "workers_by_epoch": {str(e): w for e, w in self.by_epoch.items()},
                "current": None if self.cur is None else self.cur.as_dict(),
                "previous": None if self.prev is None else self.prev.as_dict()}


class OpenLatency:
    """A stream's open latencies this epoch, hits and misses apart: the job's measured
    caching benefit (iCACHE III-D, :meth:`benefit`). Restarted at each epoch switch."""

    __slots__ = ("hit_s", "hit_n", "miss_s", "miss_n", "t0")

    def __init__(self) -> None:
        self.restart(0.0)

    def restart(self, t0: float) -> None:
        """An epoch begins at ``t0`` (monotonic s): nothing measured yet."""
        self.hit_s = self.miss_s = 0.0
        self.hit_n = self.miss_n = 0
        self.t0 = t0

    def note(self, cached: bool, seconds: float) -> None:
        """An open served from the cache (``cached``) or not, in ``seconds``."""
        if cached:
            self.hit_s += seconds
            self.hit_n += 1
        else:
            self.miss_s += seconds
            self.miss_n += 1

    def benefit(self, now: float) -> float | None:
        """Estimated T_cacheless / T_cache of the epoch so far: its wall time per sample,
        and what it would be if its cache hits had waited like its misses (reads are
        sequential per loader worker). None until both were measured."""
        n = self.hit_n + self.miss_n
        if self.hit_n < 20 or self.miss_n < 20 or now <= self.t0:
            return None
        per = (now - self.t0) / n
        extra = self.hit_n / n * max(0.0, self.miss_s / self.miss_n - self.hit_s / self.hit_n)
        return (per + extra) / per
