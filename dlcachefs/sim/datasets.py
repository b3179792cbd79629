"""Datasets sharing one cache: DLCache's cost-aware LRFU against the classic policies, in
simulation (DESIGN.md, "Several datasets in one cache"; not in the daemon yet).

DLCache (../shared/papers/002_*, III-C 2) evicts whole datasets (its data blocks) when
the storage runs out. A block is eligible once no active job uses it and its cooldown has
passed; eligible blocks are evicted in increasing order of their combined recency and
frequency at the current time,

    CRF_t(b) = sum over b's references t_i <= t of F(t - t_i),   F(x) = (1 / p) ** (step * x)

(LRFU: ``step`` 0 is LFU, 1 is close to LRU), first, and of their preparation cost
C(b) (download and extraction time), second. All files of a dataset share its
reference times (a job references its whole dataset when it registers).

:func:`simulate` replays a sequence of jobs, each needing one whole dataset present
(DLCache prepares a job's dataset before the job starts); a dataset not present is
prepared at its cost and takes its bytes, evicting eligible datasets by the policy until
it fits. Times are job arrivals (integers), so ``step * x`` counts jobs. Policies:

* ``lru``, ``lfu``: the classics on the same references;
* ``lrfu``: CRF alone;
* ``greedy``: the cheapest to prepare again first (DLCache's "Greedy" baseline);
* ``clrfu``: DLCache's cost-aware LRFU as the paper states it: CRF, then cost;
* ``clrfu-x``: CRF * cost (a variant: the expected re-preparation cost; where CRF values
  rarely tie, the paper's order is LRFU's, and the cost only breaks ties).

Pure Python, no I/O: used by ``bench.lrfu`` and its tests.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

POLICIES = ("lru", "lfu", "lrfu", "greedy", "clrfu", "clrfu-x")


@dataclass(frozen=True)
class Dataset:
    name: str
    size: int       # bytes
    cost: float     # seconds to prepare it again (fetch from its source)
    source: str = ""  # which source it comes from (a label)


def crf(refs: Sequence[int], now: int, p: float = 2.0, step: float = 0.5) -> float:
    """DLCache's CRF at ``now`` of a block referenced at times ``refs``."""
    base = 1.0 / p
    return sum(base ** (step * (now - t)) for t in refs if t <= now)


@dataclass
class _State:
    refs: dict[str, list[int]] = field(default_factory=dict)
    present: dict[str, int] = field(default_factory=dict)   # name -> bytes held
    last_use: dict[str, int] = field(default_factory=dict)


def _key(policy: str, d: Dataset, st: _State, now: int, p: float, step: float
         ) -> tuple[float, ...]:
    """Eviction order: the smallest key goes first."""
    refs = st.refs.get(d.name, [])
    if policy == "lru":
        return (refs[-1] if refs else -1,)
    if policy == "lfu":
        return (len(refs), refs[-1] if refs else -1)
    c = crf(refs, now, p, step)
    if policy == "lrfu":
        return (c,)
    if policy == "greedy":
        return (d.cost, refs[-1] if refs else -1)
    if policy == "clrfu":
        return (c, d.cost)
    if policy == "clrfu-x":
        return (c * d.cost,)
    raise ValueError(f"unknown policy {policy!r} (known: {', '.join(POLICIES)})")


@dataclass
class Result:
    policy: str
    prep_seconds: float = 0.0       # the sum of the costs of the datasets prepared
    bytes_fetched: int = 0
    preparations: int = 0
    by_dataset: dict[str, int] = field(default_factory=dict)  # preparations per dataset


def simulate(datasets: Sequence[Dataset], jobs: Sequence[str], capacity: int, policy: str,
             cooldown: int = 1, p: float = 2.0, step: float = 0.5) -> Result:
    """Replay ``jobs`` (dataset names, one job each, in arrival order) on a cache of
    ``capacity`` bytes under ``policy``. A dataset used by one of the last ``cooldown``
    jobs is not eligible for eviction (the job in progress always counts). A dataset
    larger than the cache is prepared every time and never kept."""
    by_name = {d.name: d for d in datasets}
    st = _State()
    res = Result(policy)
    for now, name in enumerate(jobs):
        d = by_name[name]
        st.refs.setdefault(name, []).append(now)
        if name not in st.present:
            res.prep_seconds += d.cost
            res.bytes_fetched += d.size
            res.preparations += 1
            res.by_dataset[name] = res.by_dataset.get(name, 0) + 1
            if d.size <= capacity:
                used = sum(st.present.values())
                while used + d.size > capacity:
                    eligible = [by_name[n] for n in st.present
                                if now - st.last_use.get(n, -10**9) >= cooldown]
                    if not eligible:
                        break
                    victim = min(eligible, key=lambda v: _key(policy, v, st, now, p, step))
                    used -= st.present.pop(victim.name)
                if used + d.size <= capacity:
                    st.present[name] = d.size
        st.last_use[name] = now
    return res


def workload(n_datasets: int, n_jobs: int, seed: int = 0, zipf: float = 1.1,
             sizes: tuple[int, int] = (10 << 30, 150 << 30),
             bandwidths: Sequence[tuple[str, float]] = (
                 ("10gbit", 10e9 / 8), ("1gbit", 1e9 / 8), ("100mbit", 1e8 / 8))
             ) -> tuple[list[Dataset], list[str]]:
    """Datasets of random sizes on sources of different speeds (10 Gbit/s, 1 Gbit/s and
    100 Mbit/s by default: a local NFS, a cloud bucket, a far one), and a job sequence of
    Zipf popularity with bursts (a tuning sweep repeats its dataset a few times)."""
    rnd = random.Random(seed)
    ds = []
    for i in range(n_datasets):
        size = rnd.randint(*sizes)
        label, bw = rnd.choice(list(bandwidths))
        ds.append(Dataset(f"d{i:02d}", size, size / bw + 5.0, label))
    weights = [1.0 / (r + 1) ** zipf for r in range(n_datasets)]
    order = list(range(n_datasets))
    rnd.shuffle(order)  # popularity is not tied to size or speed
    jobs: list[str] = []
    while len(jobs) < n_jobs:
        k = rnd.choices(order, weights)[0]
        jobs += [ds[k].name] * rnd.choice((1, 1, 1, 2, 3))
    return ds, jobs[:n_jobs]


def compare(datasets: Sequence[Dataset], jobs: Sequence[str], capacity: int,
            policies: Sequence[str] = POLICIES, **kw) -> dict[str, Result]:
    return {pol: simulate(datasets, jobs, capacity, pol, **kw) for pol in policies}

