"""``dlcachefs simulate``: replay an access trace against every caching policy.

A trace is what a training reads, epoch by epoch (sample indices in order), with each
sample's size and class directory, and the losses the training reported in each epoch.
It comes from a file (JSON, :mod:`dlcachefs.clairvoyance.trace`: what a mount's
``--trace`` writes) or is generated from sampler settings (:func:`generate_trace`:
torch's RandomSampler / DistributedSampler orders, or iCACHE's importance sampling over
synthetic losses).

The runner drives the same :class:`~dlcachefs.cache.policy.CachingPolicy` objects a mount uses,
through the same calls in the same order as the chunk writer and the engine (request,
hit / miss, substitution, admission, packing into units, eviction, release after use),
with a future view that knows the current and the next epoch (what an announced seeded
sampler gives) and an importance view fed with the trace's losses at the end of each
epoch (the H-list rebuilt at each epoch start). Belady's rule with the whole trace known
and bypass allowed (farthest next use, a sample never cached when it would be the
farthest itself) is printed as the bound. A substituted miss is not a hit: it is counted
apart, and reads nothing from the source.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from dlcachefs.cache.policy import (
    PACK_CHUNK,
    PolicyContext,
    SupportsPackagePlanning,
    may_substitute,
    releases_after_use,
    substitute_for,
    unit_target,
)
from dlcachefs.clairvoyance.trace import Trace
from dlcachefs.importance.scores import Importance, select_epoch

NEVER = float("inf")


def generate_trace(n: int, epochs: int, sampler: str = "random", seed: int = 0,
                   classes: int = 10, mean_size: int = 110_000) -> Trace:
    """A synthetic training: lognormal file sizes, per-sample difficulty, and losses that
    fall over the epochs (``loss = difficulty * exp(-epoch / 8) * noise``). ``sampler``:
    ``random`` / ``distributed`` (torch's orders, replayed), or ``iis`` (iCACHE's
    importance sampling over the losses reported so far)."""
    rng = random.Random(seed)
    sigma = 0.5
    mu = math.log(mean_size) - sigma * sigma / 2
    sizes = [max(512, int(rng.lognormvariate(mu, sigma))) for _ in range(n)]
    cls = [i * classes // n for i in range(n)]  # ImageFolder: classes in contiguous runs
    difficulty = [rng.lognormvariate(0.0, 1.0) for _ in range(n)]
    orders: list[list[int]] = []
    losses: list[dict[int, float]] = []
    iv = [math.nan] * n
    for e in range(epochs):
        if sampler == "iis":
            order = select_epoch(n, e, seed, iv)
        else:
            from dlcachefs.clairvoyance.replay import OrderReplayer, SamplerSpec  # noqa: PLC0415 (torch)

            spec = (SamplerSpec("distributed", seed=seed, world=1, rank=0)
                    if sampler == "distributed" else SamplerSpec("random", seed=seed))
            order = OrderReplayer(spec, n).order(e)
        orders.append(order)
        rep = {s: difficulty[s] * math.exp(-e / 8) * rng.lognormvariate(0.0, 0.3) for s in order}
        losses.append(rep)
        for s, v in rep.items():
            iv[s] = v
    return Trace(sizes, cls, orders, losses)


# ----- the runner's views (what a mount's engine provides) ----------------------------


class _Cache:
    def __init__(self, capacity: int) -> None:
        self.cap = capacity
        self.bytes = 0
        self.units: dict[int, tuple[list[int], int]] = {}

    def capacity(self) -> int:
        return self.cap

    def used(self) -> int:
        return self.bytes

    def members(self, unit: int) -> Sequence[int]:
        return self.units[unit][0] if unit in self.units else ()

    def unit_size(self, unit: int) -> int:
        return self.units[unit][1] if unit in self.units else 0


class _Future:
    """The trace's next uses, known up to the end of the next epoch."""

    def __init__(self, trace: Trace, horizon_epochs: int) -> None:
        self.seq = [s for e in trace.epochs for s in e]
        self.starts: list[int] = []
        t = 0
        for e in trace.epochs:
            self.starts.append(t)
            t += len(e)
        self.starts.append(t)
        self.nxt = [0] * len(self.seq)
        last: dict[int, int] = {}
        for i in range(len(self.seq) - 1, -1, -1):
            self.nxt[i] = last.get(self.seq[i], len(self.seq))
            last[self.seq[i]] = i
        self.next_pos = [len(self.seq)] * trace.n
        for s, i in last.items():
            self.next_pos[s] = i
        self.horizon_epochs = horizon_epochs
        self.t = 0
        self.epoch = 0

    def advance(self, t: int, epoch: int) -> None:
        """Tick ``t`` (sample seq[t]) is being served now."""
        self.t, self.epoch = t, epoch
        self.next_pos[self.seq[t]] = self.nxt[t]

    def now(self) -> int:
        return self.t

    def horizon(self) -> int:
        return self.starts[min(self.epoch + 1 + self.horizon_epochs, len(self.starts) - 1)] - 1

    def next_use(self, sample: int) -> float:
        p = self.next_pos[sample]
        return p if p <= self.horizon() else NEVER

    def epoch_length(self) -> int | None:
        return self.starts[self.epoch + 1] - self.starts[self.epoch]

    def epoch_start(self) -> int:
        return self.starts[self.epoch]

    def next_epoch_end(self) -> int | None:
        if self.horizon_epochs < 1 or self.epoch + 2 >= len(self.starts):
            return None
        return self.starts[self.epoch + 2] - 1

    def used_by_next_epoch_end(self, sample: int) -> bool | None:
        end = self.next_epoch_end()
        return None if end is None else self.next_pos[sample] <= end

    def generation(self) -> int:
        # a sample's next use moves only when it is read, or from NEVER to its position
        # when the horizon reaches it: never later without a read
        return 0


class _Importance:
    def __init__(self, imp: Importance) -> None:
        self.imp = imp
        self.ep = 0

    def importance(self, sample: int) -> float | None:
        return self.imp.value(sample)

    def is_high(self, sample: int) -> bool:
        return self.imp.is_high(sample)

    def version(self) -> int:
        return self.imp.version()

    def epoch(self) -> int:
        return self.ep


@dataclass
class Result:
    policy: str
    capacity: int
    hits: int = 0
    misses: int = 0
    substituted: int = 0
    bytes_from_source: int = 0
    accesses: int = 0
    policy_stats: dict = field(default_factory=dict)

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    def as_dict(self) -> dict:
        return {"policy": self.policy, "capacity": self.capacity, "hits": self.hits,
                "misses": self.misses, "substituted": self.substituted,
                "accesses": self.accesses, "hit_ratio": round(self.hit_ratio, 4),
                "bytes_from_source": self.bytes_from_source, "policy_stats": self.policy_stats}


def run_policy(trace: Trace, spec: str, capacity: int, *, chunk_size: int = 0,
               substitute: bool = False, h_fraction: float = 0.7,
               horizon_epochs: int = 1) -> Result:
    """Replay ``trace`` against the policy ``spec`` with a cache of ``capacity`` bytes."""
    # the registry is the composition root's (a policy named as a mount names it)
    # the registry alone (as the CLI checks a spec): no trio or lmdb for a simulation
    from dlcachefs.policies import make_policy  # noqa: PLC0415

    cache = _Cache(capacity)
    fut = _Future(trace, horizon_epochs)
    imp = Importance(trace.n, h_fraction)
    iview = _Importance(imp)
    pol = make_policy(spec, PolicyContext(cache, fut, iview))
    # a packer only for a policy that plans packages
    planner = pol if isinstance(pol, SupportsPackagePlanning) else None
    res = Result(spec, capacity)
    unit_of: dict[int, int] = {}  # sample -> unit (sealed or open)
    open_units: dict[int, list[int]] = {}  # pack target -> samples waiting
    open_bytes: dict[int, int] = {}
    by_class: dict[int, set[int]] = {}
    served: set[int] = set()
    next_unit = [1]

    def remove(unit: int) -> None:
        members, size = cache.units.pop(unit)
        cache.bytes -= size
        for m in members:
            if unit_of.get(m) == unit:
                del unit_of[m]
                by_class.get(trace.classes[m], set()).discard(m)
        pol.on_remove(unit)

    def seal(target: int) -> None:
        members = open_units.pop(target, [])
        size = open_bytes.pop(target, 0)
        for m in members:
            unit_of.pop(m, None)
        if not members:
            return
        need = cache.bytes + size - capacity
        if need > 0:
            for v in pol.victims(need, ()):
                remove(v)
        if cache.bytes + size > capacity:
            for m in members:  # cannot make room: not cached (the writer's cache_skipped)
                pol.on_dropped(m)
            return
        uid = next_unit[0]
        next_unit[0] += 1
        cache.units[uid] = (members, size)
        cache.bytes += size
        for m in members:
            unit_of[m] = uid
            by_class.setdefault(trace.classes[m], set()).add(m)
        pol.on_insert(uid, members, size)

    def serve_from(unit: int, sample: int) -> None:
        if unit in cache.units:
            pol.on_access(unit, sample)
            if releases_after_use(pol, unit, sample):
                remove(unit)

    rng = random.Random(0)
    pool = list(range(trace.n))

    def package(planner: SupportsPackagePlanning) -> None:
        """iCACHE III-C, as the mount's packer: the policy's next package, read from the
        source (counted) and inserted as one unit, at once."""
        plan = planner.plan_package(pool, trace.sizes.__getitem__, 0)
        if plan:
            key = -next_unit[0]  # a group of its own (targets are >= 0)
            open_units[key] = list(plan)
            open_bytes[key] = sum(trace.sizes[m] for m in plan)
            res.bytes_from_source += open_bytes[key]
            seal(key)

    t = 0
    for e, order in enumerate(trace.epochs):
        iview.ep = e
        served.clear()
        if e > 0:
            imp.rebuild()  # the H-list for this epoch, from the losses so far
        for s in order:
            fut.advance(t, e)
            t += 1
            if substitute and planner is not None:
                package(planner)
            res.accesses += 1
            pol.on_request(s)
            served.add(s)
            size = trace.sizes[s]
            u = unit_of.get(s)
            if u is not None:
                res.hits += 1
                serve_from(u, s)
            else:
                sub = None
                if substitute and may_substitute(pol, s):
                    pool = [c for c in by_class.get(trace.classes[s], ()) if c not in served]
                    if len(pool) > 256:
                        pool = rng.sample(pool, 256)
                    sub = substitute_for(pol, s, pool)
                if sub is not None and sub in unit_of:
                    res.substituted += 1
                    served.add(sub)
                    serve_from(unit_of[sub], sub)
                else:
                    res.misses += 1
                    res.bytes_from_source += size
                    if size <= capacity and pol.admit(s, size):
                        target = unit_target(pol, s, size)
                        if target == PACK_CHUNK:
                            target = chunk_size
                        open_units.setdefault(target, []).append(s)
                        open_bytes[target] = open_bytes.get(target, 0) + size
                        unit_of[s] = -1  # pending: readable, like the writer's pending set
                        if open_bytes[target] >= target:
                            seal(target)
            if t % 1024 == 0:
                while pol.maintain():
                    pass
        for target in list(open_units):
            seal(target)
        if e < len(trace.losses):
            for s, v in trace.losses[e].items():
                imp.update("sim", [s], [v])
    res.policy_stats = pol.stats()
    return res


def belady_counts(seq: Sequence[int], sizes: Sequence[int], cap: int) -> tuple[int, int, int]:
    """(hits, hit bytes, total bytes) of farthest-next-use eviction over ``seq`` with the
    whole of it known; a sample may be evicted as it arrives (bypass)."""
    nxt = [0] * len(seq)
    last: dict[int, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        nxt[i] = last.get(seq[i], len(seq))
        last[seq[i]] = i
    cached: dict[int, int] = {}  # sample -> its next use
    heap: list[tuple[int, int]] = []  # (-next use, sample), lazily invalidated
    used = hits = hit_bytes = total = 0
    for i, s in enumerate(seq):
        total += sizes[s]
        if s in cached:
            hits += 1
            hit_bytes += sizes[s]
        else:
            if sizes[s] > cap:
                continue
            used += sizes[s]
        cached[s] = nxt[i]
        heapq.heappush(heap, (-nxt[i], s))
        while used > cap:
            neg, g = heapq.heappop(heap)
            if cached.get(g) != -neg:
                continue  # stale entry
            del cached[g]  # farthest next use: possibly s itself (bypass)
            used -= sizes[g]
    return hits, hit_bytes, total


def lru_counts(seq: Sequence[int], sizes: Sequence[int], cap: int) -> tuple[int, int, int]:
    """(hits, hit bytes, total bytes) of least-recently-used eviction over ``seq``: the
    reference LRU (the offline baseline next to :func:`belady_counts`)."""
    od: OrderedDict[int, None] = OrderedDict()
    used = hits = hit_bytes = total = 0
    for f in seq:
        total += sizes[f]
        if f in od:
            hits += 1
            hit_bytes += sizes[f]
            od.move_to_end(f)
            continue
        if sizes[f] > cap:
            continue  # never cached (as the writer and the simulated policies do)
        od[f] = None
        used += sizes[f]
        while used > cap:
            g, _ = od.popitem(last=False)
            used -= sizes[g]
    return hits, hit_bytes, total


def belady(trace: Trace, capacity: int) -> Result:
    """Belady's bound for ``trace`` as a :class:`Result` (see :func:`belady_counts`)."""
    seq = [s for e in trace.epochs for s in e]
    hits, hit_bytes, total = belady_counts(seq, trace.sizes, capacity)
    return Result("belady", capacity, hits=hits, misses=len(seq) - hits,
                  bytes_from_source=total - hit_bytes, accesses=len(seq))


def simulate(trace: Trace, policies: Sequence[str], fractions: Sequence[float], *,
             chunk_size: int = 0, substitute: bool = False, h_fraction: float = 0.7) -> dict:
    """Every policy and Belady at every cache size (fractions of the dataset's bytes)."""
    total = trace.total_bytes()
    rows = []
    for frac in fractions:
        cap = int(total * frac)
        row = {"fraction": frac, "capacity": cap,
               "belady": belady(trace, cap).as_dict()}
        for p in policies:
            row[p] = run_policy(trace, p, cap, chunk_size=chunk_size, h_fraction=h_fraction,
                                substitute=substitute and p.startswith("icache")).as_dict()
        rows.append(row)
    return {"samples": trace.n, "epochs": len(trace.epochs), "accesses": trace.accesses(),
            "dataset_bytes": total, "policies": list(policies), "rows": rows}


def table(result: dict) -> str:
    """Markdown: hit ratio (and GB from the source) per policy and cache size."""
    pols = [*result["policies"], "belady"]
    head = "| cache | " + " | ".join(pols) + " |"
    lines = [head, "|" + "---|" * (len(pols) + 1)]
    for row in result["rows"]:
        cells = []
        for p in pols:
            r = row[p]
            cell = f"{r['hit_ratio']:.3f} ({r['bytes_from_source'] / 1e9:.2f} GB)"
            if r["substituted"]:
                cell += f" +{r['substituted'] / r['accesses']:.3f} subst."
            cells.append(cell)
        lines.append(f"| {row['fraction']:.0%} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
