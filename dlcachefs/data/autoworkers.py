"""``dlcachefs run --workers auto``: DLCache's Algorithm 2 applied online, in the training.

At the start of every epoch (every new iterator of a DataLoader) the hook
(:mod:`dlcachefs.data.hook`) asks the loader's :class:`Tuner` for the epoch's
``num_workers``, computed by :func:`choose` from the last epoch's measurements with
:func:`dlcachefs.admin.advise.algorithm2` (../shared/papers/002_*, section III-E):

* t_fetch, the time to fetch one batch, is measured where the batch is fetched: in each
  worker process, around torch's ``_MapDatasetFetcher.fetch`` (the dataset's
  ``__getitem__``/``__getitems__`` for every index of the batch, then ``collate_fn``), and
  written into a shared array the main process reads (:class:`WorkerInit`, given to the
  workers in place of the loader's ``worker_init_fn``, which it calls). Opens seen by the
  mount cannot serve: in-process reads (:mod:`dlcachefs.data.intercept`) never reach it.
  With ``num_workers=0`` the main process fetches: t_fetch is then its time blocked in
  ``next()`` per batch.
* t_req, the training's own time per batch between two requests: the seconds between a
  ``next()`` returning and the next call, in the main process (the hook's pace timer).
* the cores this process may run on, and memory: the workers' proportional set size
  (PSS, sampled during the epoch) per worker against ``mem_up`` = what they use plus
  half of the memory available (``MemAvailable``): memory can stop the count from
  growing, never lower it.

The decision is bounded by ``auto:MIN-MAX`` (:func:`parse`). What a change costs and
what it keeps:

* the sample order is the sampler's, in the main process, whatever the count: a new
  iterator draws its base seed once from the loader's generator (or the global RNG)
  with 0 workers as with many, so the draws, and every later order, are those of the
  fixed count;
* ``persistent_workers=True``: the workers live in one iterator; a new count shuts them
  down and makes a new iterator (once per change, not per epoch). Its base seed is drawn
  from a private generator, because a persistent loader draws from the user's generator
  only once, at its first iterator: drawing again would shift every later order. Such a
  loader never goes to 0 workers (torch would then make a new iterator, and draw, each
  epoch), nor does one with a ``timeout`` (torch refuses it without workers);
* from 0 workers to more: ``prefetch_factor`` is set to the loader's own (2 when it had
  none), and back to None at 0, as ``DataLoader.__init__`` requires;
* random augmentations in ``__getitem__`` follow the worker's seed (base seed + worker
  id) and which worker fetches which batch: with another count they differ, as they do
  from one run to the next with a fixed count;
* an ``IterableDataset`` (each worker yields its own share: the count changes the data)
  and ``in_order=False`` (the order follows the workers' speed) are left alone.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import re
import sys
import time
import warnings
from dataclasses import asdict, dataclass

from dlcachefs.admin.advise import algorithm2, pss_bytes, rank_cores, rank_memory_available

#: batches fetched and training steps measured before an epoch's numbers are used
MIN_BATCHES = 2
#: seconds: a shorter measured step is taken as this
MIN_T_REQ = 1e-6
#: per worker in the shared array: fetch seconds, batches, CPU seconds, samples
FIELDS = 4
#: at most this many workers, or twice the last count, when their memory is not known
GROWTH_UNMEASURED = 2
#: seconds between two samples of the workers' memory during an epoch
MEM_EVERY = 2.0
#: epochs kept in a tuner's history (``workers_report``)
HISTORY = 256
#: the largest MAX of ``auto:MIN-MAX`` (torch's own limit is the machine)
MAX_BOUND = 4096

_SPEC = re.compile(r"auto(?::(\d*)-(\d*))?")


@dataclass(frozen=True)
class Bounds:
    """``--workers auto:MIN-MAX``: the counts Algorithm 2 may choose (``hi`` None: no
    upper bound but its own, the cores)."""

    lo: int = 0
    hi: int | None = None


def parse(spec: str) -> Bounds:
    """``auto``, ``auto:MIN-MAX``, ``auto:MIN-`` or ``auto:-MAX`` as :class:`Bounds`;
    ValueError otherwise (MIN > MAX, MAX 0 or above :data:`MAX_BOUND`)."""
    m = _SPEC.fullmatch(spec.strip())
    if m is None:
        raise ValueError(f"--workers {spec!r}: expected auto, auto:MIN-MAX, auto:MIN- or "
                         "auto:-MAX")
    lo = int(m.group(1)) if m.group(1) else 0
    hi = int(m.group(2)) if m.group(2) else None
    if hi is not None and not 1 <= hi <= MAX_BOUND:
        raise ValueError(f"--workers {spec!r}: MAX must be between 1 and {MAX_BOUND}")
    if lo > (hi if hi is not None else MAX_BOUND):
        raise ValueError(f"--workers {spec!r}: MIN is above MAX")
    return Bounds(lo, hi)


@dataclass(frozen=True)
class Measured:
    """One epoch of a loader, as the tuner measured it."""

    workers: int                        # ω: num_workers during the epoch
    batches: int = 0                    # batches fetched (by the workers, or the main process)
    fetch_s: float = 0.0                # their fetch time, summed
    steps: int = 0                      # training steps measured between two next() calls
    train_s: float = 0.0                # their time, summed
    mem_worker: float | None = None     # bytes (PSS) per worker, None: not measured
    mem_available: float | None = None  # bytes available on the machine when measured
    #: whether moving the fetches between the main process and workers (0 <-> more
    #: workers) may change the order: the sampler draws its seed from torch's global
    #: generator (None: not known, taken as yes)
    order_needs_place: bool | None = None


@dataclass(frozen=True)
class Choice:
    """The count for the next epoch and why: Algorithm 2's uncapped ceil(t_fetch / t_req)
    (``wanted``), what capped it (``cores``, ``memory``, the bounds ``min``/``max``), or
    why the count was kept (``kept``)."""

    workers: int
    previous: int
    wanted: int | None = None
    capped_by: str | None = None
    t_fetch: float | None = None
    t_req: float | None = None
    mem_worker: float | None = None
    mem_up: float | None = None
    kept: str | None = None


def floor_of(bounds: Bounds, persistent: bool, timeout: float) -> int:
    """The least count a loader may get: MIN, and 1 for a loader that cannot run without
    workers as it was built (``persistent_workers``, ``timeout``)."""
    return max(bounds.lo, 1 if (persistent or timeout > 0) else 0)


def keep_side(n: int, m: Measured) -> tuple[int, str | None]:
    """``n`` on the same side of 0 as ``m.workers`` when crossing it could change the
    order (:attr:`Measured.order_needs_place`): a sampler seeded from torch's global
    generator draws its seed in ``iter()`` with workers and at the first ``next()``
    without, so any other draw in between (another loader's, an augmentation's in the
    main process) moves to the other side of it and changes the order."""
    if m.order_needs_place is False or (n > 0) == (m.workers > 0):
        return n, None
    return (0 if m.workers == 0 else 1), "order"


def clamp(n: int, bounds: Bounds, floor: int) -> tuple[int, str | None]:
    """``n`` within ``[max(floor, MIN), MAX]`` (the floor wins over MAX), and which bound
    moved it."""
    floor = max(floor, bounds.lo)
    if bounds.hi is not None and n > bounds.hi:
        return max(bounds.hi, floor), "max"
    if n < floor:
        return floor, "min"
    return n, None


def choose(m: Measured, cores: int, bounds: Bounds, floor: int = 0) -> Choice:
    """Algorithm 2 on one epoch's measurements, within ``bounds`` (and at least
    ``floor``: :func:`floor_of`). Pure. The count is kept when too little was measured
    (fewer than :data:`MIN_BATCHES` batches or training steps)."""
    if m.batches < MIN_BATCHES or m.steps < MIN_BATCHES:
        n, cap = clamp(m.workers, bounds, floor)
        return Choice(n, m.workers, capped_by=cap, kept="too few batches measured")
    t_fetch = m.fetch_s / m.batches
    t_req = m.train_s / m.steps
    # a step below a microsecond is lost in the measurement (two clock reads and a
    # Python call): the cores decide
    t_req = max(t_req, MIN_T_REQ)
    mem_total = mem_up = None
    if m.mem_worker is not None and m.workers > 0:
        mem_total = m.mem_worker * m.workers
        if m.mem_available is not None:
            mem_up = mem_total + m.mem_available / 2
    d = algorithm2(m.workers, t_fetch, t_req, max(1, cores), mem_total, mem_up)
    n, cap = keep_side(d.workers, m)
    if mem_up is None and n > max(GROWTH_UNMEASURED, 2 * m.workers):
        # the workers' memory is not known (none ran, or none was sampled): at most
        # double, so that a count too large for the memory is seen before it is reached
        n, cap = max(GROWTH_UNMEASURED, 2 * m.workers), cap or "growth"
    n, bound = clamp(n, bounds, floor)
    return Choice(n, m.workers, d.wanted, bound or cap or d.capped_by, t_fetch, t_req,
                  m.mem_worker if mem_total is not None else None, mem_up)


class WorkerInit:
    """The ``worker_init_fn`` the workers of a tuned loader get: it times the worker's
    batch fetches into ``slots`` (a shared array, :data:`FIELDS` per worker), then calls
    the loader's own ``worker_init_fn``. Picklable (for the ``spawn`` start method) when
    the loader's own function is."""

    def __init__(self, user_fn, slots) -> None:
        self.user_fn = user_fn
        self.slots = slots

    def __call__(self, worker_id: int) -> None:
        # torch moved its fetcher, say: not measured (an error here would end the
        # worker, and torch the training)
        with contextlib.suppress(Exception):
            _time_fetches(self.slots, worker_id)
        if self.user_fn is not None:
            self.user_fn(worker_id)


_slots = None  # this worker's shared array, and its offset in it
_base = 0


def _time_fetches(slots, worker_id: int) -> None:
    """In a worker process: time every batch fetch of torch's map-style fetcher. The
    patch is this process's alone (a worker is a process of its own, forked or not)."""
    global _slots, _base
    _slots, _base = slots, worker_id * FIELDS
    from torch.utils.data._utils import fetch  # noqa: PLC0415 - the training imported torch

    cls = fetch._MapDatasetFetcher
    if cls.__dict__.get("_dlcachefs_timed"):
        return
    orig = cls.fetch
    clock, cpu = time.perf_counter, time.process_time

    def timed_fetch(self, index):
        t0, c0 = clock(), cpu()
        try:
            return orig(self, index)
        finally:
            s, b = _slots, _base
            if s is not None:  # one writer per field: the main process only reads
                s[b] += clock() - t0
                s[b + 1] += 1
                s[b + 2] += cpu() - c0
                s[b + 3] += len(index) if self.auto_collation else 1

    cls.fetch = timed_fetch
    cls._dlcachefs_timed = True


def _totals(slots) -> tuple[float, int, float, int]:
    """(fetch seconds, batches, CPU seconds, samples) over every worker of ``slots``."""
    vals = list(slots)
    return (sum(vals[0::FIELDS]), int(sum(vals[1::FIELDS])), sum(vals[2::FIELDS]),
            int(sum(vals[3::FIELDS])))


def sampler_draws_global(loader, data_module) -> bool:
    """Whether ``loader``'s order may come from torch's global generator: a
    ``RandomSampler`` or ``SubsetRandomSampler`` without a generator of its own, or a
    sampler this cannot tell (a sequential or distributed one, or one with a generator,
    does not)."""
    bs = loader.batch_sampler
    inner = getattr(bs, "sampler", None) if bs is not None else loader.sampler
    if bs is not None and type(bs) is not data_module.BatchSampler:
        return True
    if isinstance(inner, (data_module.SequentialSampler, data_module.DistributedSampler)):
        return False
    if isinstance(inner, (data_module.RandomSampler, data_module.SubsetRandomSampler)):
        return inner.generator is None
    return True


class Tuner:
    """One DataLoader's ``--workers auto``: its measurements and the count of each epoch.
    Main process only; the hook calls :meth:`epoch_start` before it makes the epoch's
    iterator, :meth:`make_iterator` to make it, and :meth:`batch` after each batch."""

    def __init__(self, loader, bounds: Bounds) -> None:
        self.bounds = bounds
        self.persistent = bool(loader.persistent_workers)
        self.floor = floor_of(bounds, self.persistent, float(loader.timeout or 0))
        # the loader's own prefetch_factor, for the epochs it has workers
        self.prefetch_factor = loader.prefetch_factor or 2
        self.epoch = 0
        self.history: list[dict] = []
        self._pace = None          # the last iterator's pace report (hook._PaceReport)
        self._slots = None         # the shared array of the last multi-process iterator
        self._seen = (0.0, 0, 0.0, 0)  # its totals already counted
        self.sampler_global = True  # set by the hook: sampler_draws_global()
        self._made_once = False
        self._mem: float | None = None
        self._avail: float | None = None
        self._mem_at = 0.0

    # ----- at the start of an epoch ------------------------------------------------

    def measured(self, workers: int) -> tuple[Measured, float | None]:
        """The last epoch's :class:`Measured` (``workers`` during it), and its workers'
        CPU share of their fetch time (None without workers)."""
        iters = steps = 0
        wait = train = 0.0
        if self._pace is not None:
            iters, steps, wait, train = self._pace.take_epoch()
        share = None
        if workers > 0 and self._slots is None:  # not timed: nothing measured
            fetch_s, batches = 0.0, 0
        elif workers > 0:
            tot = _totals(self._slots)
            fetch_s, batches, cpu_s = (tot[0] - self._seen[0], tot[1] - self._seen[1],
                                       tot[2] - self._seen[2])
            self._seen = tot
            share = cpu_s / fetch_s if fetch_s > 0 else None
        else:  # the main process fetched: its time in next()
            fetch_s, batches = wait, iters
        # a sampler seeded from torch's global generator draws its seed in iter() with
        # workers and at the first next() without: any other draw in between (another
        # loader's, an augmentation's) lands on the other side, and the order changes
        needs = self.sampler_global
        m = Measured(workers, batches, fetch_s, steps, train, self._mem, self._avail,
                     needs)
        self._mem = self._avail = None
        return m, share

    def epoch_start(self, loader) -> Choice:
        """Decide this epoch's count and set it on ``loader`` (shutting down a persistent
        iterator whose count changes). The first epoch keeps the loader's own count,
        within the bounds."""
        current = int(loader.num_workers)
        if self.epoch == 0:
            n, cap = clamp(current, self.bounds, self.floor)
            c, share = Choice(n, current, capped_by=cap, kept="first epoch"), None
        else:
            m, share = self.measured(current)
            c = choose(m, rank_cores(), self.bounds, self.floor)
        if c.workers != current:
            self._apply(loader, c.workers)
        self._record(c, share)
        self.epoch += 1
        return c

    def _apply(self, loader, n: int) -> None:
        it = getattr(loader, "_iterator", None)
        if self.persistent and it is not None:
            # its workers cannot change: they are shut down, a new iterator comes next
            try:
                it._shutdown_workers()
            finally:
                loader._iterator = None
        loader.num_workers = n
        # DataLoader.__init__'s rule: a prefetch_factor with workers, None without
        loader.prefetch_factor = self.prefetch_factor if n > 0 else None

    def _record(self, c: Choice, cpu_share: float | None) -> None:
        row = {"epoch": self.epoch, **asdict(c), "cpu_share": cpu_share}
        self.history.append(row)
        del self.history[:-HISTORY]
        sys.stderr.write(f"dlcachefs: workers auto: {describe(row)}\n")

    # ----- making the iterator --------------------------------------------------------

    def make_iterator(self, loader, make):
        """``make()`` (torch's ``DataLoader.__iter__``), with the workers it starts timing
        their fetches; a persistent loader's later iterators draw their base seed from a
        private generator (see the module doc). A failure of the tuner's own part makes
        the iterator as without it (the epoch is not measured); ``make()``'s own errors
        are the training's."""
        made = False

        def make_once():
            nonlocal made
            made = True
            return make()

        try:
            return self._make_iterator(loader, make_once)
        except Exception as e:
            if made:
                raise
            warnings.warn(f"dlcachefs: --workers auto cannot time this epoch ({e})",
                          RuntimeWarning, stacklevel=2)
            self._slots = None
            return make()

    def _make_iterator(self, loader, make):
        import torch  # noqa: PLC0415 - the training imported it

        if loader.num_workers == 0:
            return make()
        if self.persistent and getattr(loader, "_iterator", None) is not None:
            return make()
        try:
            slots = multiprocessing.RawArray("d", FIELDS * loader.num_workers)
        except (OSError, ValueError) as e:  # no shared memory: the epoch is not measured
            warnings.warn(f"dlcachefs: --workers auto cannot time the workers ({e})",
                          RuntimeWarning, stacklevel=2)
            self._slots = None
            return make()
        user_fn, gen = loader.worker_init_fn, loader.generator
        loader.worker_init_fn = WorkerInit(user_fn, slots)
        if self.persistent and self._made_once:
            private = torch.Generator()
            private.manual_seed(self.epoch)
            loader.generator = private
        try:
            it = make()
        finally:
            loader.worker_init_fn, loader.generator = user_fn, gen
        self._made_once = True
        self._slots, self._seen = slots, (0.0, 0, 0.0, 0)
        return it

    def track(self, pace) -> None:
        """The epoch's iterator's pace report (the training's side of the measurements:
        :meth:`hook._PaceReport.take_epoch`)."""
        self._pace = pace

    def batch(self, it, now: float) -> None:
        """After a batch of ``it``: sample its workers' memory now and then."""
        if now - self._mem_at < MEM_EVERY and self._mem is not None:
            return
        self._mem_at = now
        workers = getattr(it, "_workers", None)
        if not workers:
            return
        sizes = [x for x in (pss_bytes(w.pid) for w in workers if w.pid) if x]
        if sizes:
            per = sum(sizes) / len(sizes)
            self._mem = per if self._mem is None else max(self._mem, per)
            avail = rank_memory_available()
            self._avail = float(avail) if avail is not None else None
        # reading smaps_rollup takes a while with large workers: that time is ours, not
        # the training's step (t_req), which the pace timer counts from ``last_end``
        pace = self._pace
        if pace is not None and pace.last_end is not None:
            pace.last_end += time.perf_counter() - now


def describe(row: dict) -> str:
    """One epoch of a tuner's history as a log line."""
    prev, n = row["previous"], row["workers"]
    head = f"epoch {row['epoch']}: num_workers " + (f"{prev} -> {n}" if n != prev else
                                                     f"{n}, kept")
    if row.get("kept"):
        return head + f" ({row['kept']}" + (f"; the bound {row['capped_by']}"
                                             if row.get("capped_by") else "") + ")"
    parts = [f"t_fetch {1000 * row['t_fetch']:.1f} ms per batch",
             f"t_req {1000 * row['t_req']:.1f} ms", f"ceil(t_fetch / t_req) = {row['wanted']}"]
    if row.get("mem_worker") is not None and row.get("mem_up") is not None:
        parts.append(f"memory {row['mem_worker'] / 2**20:.0f} MiB per worker, "
                     f"limit {row['mem_up'] / 2**20:.0f} MiB")
    if row.get("cpu_share") is not None:
        parts.append(f"workers on CPU {100 * row['cpu_share']:.0f}% of their fetch time")
    if row.get("capped_by"):
        parts.append(f"capped by {row['capped_by']}")
    return head + " (Algorithm 2: " + ", ".join(parts) + ")"


def eligible(loader, data_module) -> str | None:
    """Why ``loader`` is not tuned (None: it is)."""
    if isinstance(loader.dataset, data_module.IterableDataset):
        return "an IterableDataset (each worker yields its own share)"
    if getattr(loader, "in_order", True) is False:
        return "in_order=False (its order follows the workers)"
    return None
