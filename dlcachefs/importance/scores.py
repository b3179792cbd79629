"""Sample importance from training losses (iCACHE III-A, III-B, III-D).

* A job's **importance value** (IV) of a sample is its latest reported loss; samples not
  trained keep their old value (iCACHE keeps no smoothing or decay).
* Several jobs on one dataset (III-D): each job's IVs are kept apart; a job's values are
  turned into **relative** importance RIV (the sample's percentile rank among that job's
  IVs, 0..1), and the **aggregated** importance is ``AIV_i = sum_j benefit_j * RIV_i^j``
  over the cache-eligible jobs (``benefit_j > ELIGIBLE``, the measured
  ``T_cacheless / T_cache`` of job j). When no job is eligible yet, every job counts with
  weight 1, so a single job's AIV orders samples exactly like its IVs.
* The **H-list** is the ``h_fraction`` most important samples by AIV, rebuilt by
  :meth:`Importance.rebuild` (at every epoch start of a job that reports losses); each
  rebuild bumps :meth:`Importance.version` (the policies' shadow-heap trigger). Until
  the first rebuild there is no H-list, and every sample counts as H (warm-up).
* :func:`select_epoch` is iCACHE's I/O-oriented importance sampling (IIS), shared by the
  torch sampler and ``dlcachefs simulate``.

Samples are dataset indices here; the engine maps them to inodes. Pure Python; runs on
the trio loop in a mount (rebuilds are O(n log n) over the dataset, done once an epoch).
"""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

#: a job is cache-eligible when caching makes it at least this much faster (iCACHE: 1.5)
ELIGIBLE = 1.5


def percentile_ranks(values: Sequence[float]) -> list[float]:
    """Rank of each value among all, scaled to 0..1 (ties share their mean rank)."""
    n = len(values)
    if n <= 1:
        return [1.0] * n
    order = sorted(range(n), key=values.__getitem__)
    out = [0.0] * n
    i = 0
    while i < n:
        j = i
        while j + 1 < n and values[order[j + 1]] == values[order[i]]:
            j += 1
        r = (i + j) / 2 / (n - 1)
        for k in range(i, j + 1):
            out[order[k]] = r
        i = j + 1
    return out


@dataclass
class JobImportance:
    """One job's IVs over the dataset (NaN = never reported) and its measured benefit."""

    n: int
    iv: array = field(init=False)
    reported: int = 0
    benefit: float | None = None

    def __post_init__(self) -> None:
        self.iv = array("d", [math.nan]) * self.n

    def update(self, indices: Sequence[int], values: Sequence[float]) -> None:
        for i, v in zip(indices, values, strict=True):
            self.iv[i] = v
        self.reported += len(indices)

    def filled(self) -> list[float]:
        """IVs with never-reported samples at the mean of the reported ones."""
        known = [v for v in self.iv if not math.isnan(v)]
        fill = sum(known) / len(known) if known else 0.0
        return [fill if math.isnan(v) else v for v in self.iv]


class Importance:
    """IVs of every job on one dataset, the AIV and the H-list."""

    def __init__(self, n: int, h_fraction: float = 0.7) -> None:
        if not 0.0 < h_fraction <= 1.0:
            raise ValueError("h_fraction must be within (0, 1]")
        self.n = n
        self.h_fraction = h_fraction
        self.jobs: dict[str, JobImportance] = {}
        self.aiv: list[float] | None = None
        self.high: bytearray | None = None  # None: no H-list yet (everything counts as H)
        self._version = 0

    def job(self, name: str) -> JobImportance:
        j = self.jobs.get(name)
        if j is None:
            j = self.jobs[name] = JobImportance(self.n)
        return j

    def update(self, job: str, indices: Sequence[int], values: Sequence[float]) -> None:
        self.job(job).update(indices, values)

    def weights(self) -> dict[str, float]:
        """Per job weight in the AIV: its benefit when eligible; all 1 when none is."""
        jobs = {k: j for k, j in list(self.jobs.items()) if j.reported}
        eligible = {k: j.benefit for k, j in jobs.items()
                    if j.benefit is not None and j.benefit > ELIGIBLE}
        if eligible:
            return eligible  # type: ignore[return-value]
        return dict.fromkeys(jobs, 1.0)

    def rebuild(self) -> None:
        """Recompute the AIV and the H-list from every job's current IVs."""
        jobs = dict(self.jobs)  # (a job may be forgotten on the loop meanwhile)
        w = self.weights()
        if not w:
            return
        aiv = [0.0] * self.n
        for name, weight in w.items():
            j = jobs.get(name)
            if j is None:
                continue
            for i, r in enumerate(percentile_ranks(j.filled())):
                aiv[i] += weight * r
        k = max(1, round(self.h_fraction * self.n))
        high = bytearray(self.n)
        for i in sorted(range(self.n), key=aiv.__getitem__, reverse=True)[:k]:
            high[i] = 1
        self.aiv, self.high = aiv, high
        self._version += 1

    def version(self) -> int:
        return self._version

    def value(self, i: int) -> float | None:
        return None if self.aiv is None else self.aiv[i]

    def is_high(self, i: int) -> bool:
        return self.high is None or bool(self.high[i])


def select_epoch(n: int, epoch: int, seed: int, iv: Sequence[float] | None, *,
                 beta: float = 0.33, warmup: int = 2, full_every: int = 3) -> list[int]:
    """iCACHE's I/O-oriented importance sampling: the samples epoch ``epoch`` trains on,
    in the order it reads them, decided before it starts from the IVs known then.

    A random permutation (seeded by ``seed`` and ``epoch``); during the first ``warmup``
    epochs, every ``full_every``-th epoch, and while no IVs exist, every sample is kept
    (a full epoch). Otherwise sample ``s`` is kept with probability ``rank(s) ** beta``,
    ``rank`` its percentile rank among the IVs (Selective-Backprop, as in the authors'
    code; ranks over the whole dataset rather than a 1024-loss history, so the most
    important sample is always kept). Never-reported samples count at the mean IV.
    """
    rng = random.Random(f"dlcachefs-iis/{seed}/{epoch}")
    perm = list(range(n))
    rng.shuffle(perm)
    if iv is None or epoch < warmup or (full_every > 0 and epoch % full_every == 0):
        return perm
    known = [v for v in iv if not math.isnan(v)]
    if not known:
        return perm
    fill = sum(known) / len(known)
    ranks = percentile_ranks([fill if math.isnan(v) else v for v in iv])
    return [s for s in perm if rng.random() < ranks[s] ** beta]
