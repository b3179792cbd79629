"""Offline hit-ratio bounds for a known access order (clairvoyance makes them computable).

Given the exact sequence of files a training reads (the sampler replayed over several
epochs) and a cache of C bytes, this computes the byte-weighted and per-file hit ratios
of:

* ``belady``: on a miss, admit the file and evict the cached files whose next use is
  farthest in the future (Belady's MIN; with files of different sizes this farthest-first
  rule is the usual offline bound, not a proven optimum);
* ``lru``: least recently used;
* ``lcache``: what dlcachefs's partial caching does (LCache III-B): each epoch's log
  holds the samples that come first in that epoch, up to the cache size.

    python -m bench.belady --files 3000 --epochs 4 --cache-frac 0.3 [--sampler random|distributed]

Prints JSON. Pure Python; the orders come from dlcachefs.clairvoyance.replay (torch).
"""

from __future__ import annotations

import argparse
import json
import random

from dlcachefs.clairvoyance.replay import OrderReplayer, SamplerSpec
from dlcachefs.sim.simulate import belady_counts as belady
from dlcachefs.sim.simulate import lru_counts as lru


def trace(n: int, epochs: int, kind: str, seed: int) -> list[list[int]]:
    spec = (SamplerSpec("distributed", seed=seed, world=1, rank=0) if kind == "distributed"
            else SamplerSpec("random", seed=seed))
    r = OrderReplayer(spec, n)
    return [r.order(e) for e in range(epochs)]


def lcache(orders: list[list[int]], sizes: list[int], cap: int) -> tuple[int, int, int]:
    """dlcachefs's partial caching: epoch e's log holds the first samples of epoch e's
    order, up to the cache size (written while epoch e-1 is read, as the previous log is
    released chunk by chunk after use); epoch 0 has no log."""
    hits = hit_bytes = total = 0
    for e, order in enumerate(orders):
        held: set[int] = set()
        if e > 0:
            room = cap
            for f in order:
                if f in held:
                    continue
                if sizes[f] > room:
                    break
                held.add(f)
                room -= sizes[f]
        for f in order:
            total += sizes[f]
            if f in held:
                hits += 1
                hit_bytes += sizes[f]
    return hits, hit_bytes, total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--cache-frac", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.8])
    ap.add_argument("--sampler", choices=["random", "distributed"], default="distributed")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--mean-kb", type=float, default=110.0)
    a = ap.parse_args()
    rnd = random.Random(a.seed)
    sizes = [max(1, int(rnd.lognormvariate(0, 0.5) * a.mean_kb * 1024 / 1.133))
             for _ in range(a.files)]
    orders = trace(a.files, a.epochs, a.sampler, a.seed)
    seq = [f for o in orders for f in o]
    out = {"files": a.files, "epochs": a.epochs, "sampler": a.sampler,
           "dataset_bytes": sum(sizes), "results": []}
    for frac in a.cache_frac:
        cap = int(sum(sizes) * frac)
        row = {"cache_frac": frac}
        for name, fn, arg in (("belady", belady, seq), ("lru", lru, seq),
                              ("lcache", lcache, orders)):
            h, hb, tb = fn(arg, sizes, cap)
            row[name] = {"hit_ratio": round(h / len(seq), 4), "byte_hit_ratio": round(hb / tb, 4)}
        out["results"].append(row)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
