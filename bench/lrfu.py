"""Datasets sharing one cache: what each eviction policy makes the jobs re-fetch, in
simulation (``dlcachefs.sim.datasets``; DLCache's offline experiment, section IV-D).

    python -m bench.lrfu [--workloads 200] [--datasets 12] [--jobs 300]
                         [--cache 0.2,0.35,0.5] [--out bench/results/lrfu.json]

Each workload: ``--datasets`` datasets of 10-150 GB, each on one of three sources
(10 Gbit/s, 1 Gbit/s, 100 Mbit/s; preparing one costs its size over its source's speed
plus 5 s), ``--jobs`` jobs of Zipf popularity (1.1) with bursts; the cache holds a
fraction (``--cache``) of all datasets' bytes; a dataset used by the job in progress is
never evicted. Per policy and cache fraction, over the workloads: the total preparation
time and the bytes fetched from the slowest source, each as a ratio to LRU's on the same
workload (mean, and the share of workloads where it is lower than LRU's). A simulation of
the policy the design proposes, not the daemon.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from dlcachefs.sim.datasets import POLICIES, compare, workload


def _slow_bytes(r, sizes: dict[str, int]) -> int:
    """Bytes a result fetched from the datasets of ``sizes`` (the slowest source's)."""
    return sum(n * sizes[k] for k, n in r.by_dataset.items() if k in sizes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.lrfu")
    p.add_argument("--workloads", type=int, default=200)
    p.add_argument("--datasets", type=int, default=12)
    p.add_argument("--jobs", type=int, default=300)
    p.add_argument("--cache", default="0.2,0.35,0.5")
    p.add_argument("--step", type=float, default=0.5, help="LRFU's step (0: LFU, 1: ~LRU)")
    p.add_argument("--out", default=os.path.join("bench", "results", "lrfu.json"))
    a = p.parse_args(argv)
    table: dict = {}
    for frac in [float(x) for x in a.cache.split(",") if x.strip()]:
        ratios: dict[str, list[float]] = {pol: [] for pol in POLICIES}
        slow: dict[str, list[float]] = {pol: [] for pol in POLICIES}
        for w in range(a.workloads):
            ds, jobs = workload(a.datasets, a.jobs, seed=w)
            cap = int(frac * sum(d.size for d in ds))
            res = compare(ds, jobs, cap, step=a.step)
            slow_names = {d.name: d.size for d in ds if d.source == "100mbit"}

            base, base_slow = res["lru"].prep_seconds, _slow_bytes(res["lru"], slow_names)
            for pol, r in res.items():
                ratios[pol].append(r.prep_seconds / base if base else 1.0)
                if base_slow:
                    slow[pol].append(_slow_bytes(r, slow_names) / base_slow)
        table[str(frac)] = {pol: {
            "prep_time_vs_lru": round(statistics.mean(ratios[pol]), 3),
            "better_than_lru": round(sum(x < 1 - 1e-9 for x in ratios[pol]) / len(ratios[pol]), 3),
            "slow_source_bytes_vs_lru": round(statistics.mean(slow[pol]), 3) if slow[pol] else None,
        } for pol in POLICIES}
    doc = {"bench": "lrfu", "workloads": a.workloads, "datasets": a.datasets, "jobs": a.jobs,
           "step": a.step, "table": table,
           "note": "means over workloads of each policy's ratio to LRU on the same workload "
                   "(lower is better); a simulation (dlcachefs.sim.datasets)"}
    print("cache  " + "  ".join(f"{pol:>16}" for pol in POLICIES))
    for frac, row in table.items():
        print(f"{frac:<6} " + "  ".join(
            f"{row[pol]['prep_time_vs_lru']:>7.3f} / {row[pol]['slow_source_bytes_vs_lru'] or 0:>6.3f}"
            for pol in POLICIES))
    print("(preparation time / bytes from the 100 Mbit/s source, each vs LRU)")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
