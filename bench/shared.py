"""Several datasets in one cache, mounted: the bytes re-fetched from a slow source with the
cost-aware shares (``--share-policy cost``) against equal shares (``equal``: each
dataset's own LRU in half the budget), side by side in one run.

    python -m bench.shared [--files 60] [--size 48K] [--budget 1.25] [--delay-ms 10]
                           [--warm-rounds 5] [--rounds 4] [--out bench/results/shared.json]

Two datasets of ``--files`` random files of ``--size`` bytes: a fast one (a local
directory) and a slow one (the same kind of tree behind ``bench.passthrough --delay-ms``:
every open of a source file waits, as on a far object store). Per policy, a fresh cache
root with a budget of ``--budget`` times one dataset's bytes (smaller than both together),
two daemons (``--shared-cache``, one per dataset); both trees are read whole, alternately,
``--warm-rounds`` times (the shares settle) and then ``--rounds`` times, measured: bytes
each daemon fetched from its source in the measured rounds, its share and cached bytes at
the end, and the wall time of the measured rounds. Every byte read is compared with the
source (``wrong_bytes`` must be 0, else exit status 1). ``ratios``: cost-aware over equal.

Equal use of both datasets, so the split is the cost's doing: reading a dataset through
in a loop larger than its share, LRU keeps nothing useful (each read evicts what the
next round reads first), so a share below the dataset's size costs the whole dataset
each round; the cost-aware split gives the slow dataset its whole size and leaves the
fast one its floor.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from dlcachefs.testing.mounting import Mount
from dlcachefs.units import parse_size

from .passthrough import passthrough_mount
from .util import drop_page_cache, machine_info, write_json


def _tree(root: Path, n: int, size: int, seed: int) -> dict[str, bytes]:
    rnd = random.Random(seed)
    files = {}
    for i in range(n):
        rel = f"c{i % 8}/f{i:05d}.bin"
        data = rnd.randbytes(size)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        files[rel] = data
    return files


def _read(mnt: Path, files: dict[str, bytes]) -> int:
    """Read every file through the mount; the number of files whose bytes differ."""
    return sum((mnt / rel).read_bytes() != data for rel, data in files.items())


def run_policy(work: Path, policy: str, fast_src: Path, slow_src: Path,
               files: tuple[dict[str, bytes], dict[str, bytes]], budget: int,
               warm: int, rounds: int) -> dict:
    root = work / f"root-{policy}"
    args = ["--shared-cache", "--cache-size", str(budget), "--share-policy", policy,
            "--share-interval", "0.5", "--flush-interval", "0.5", "--scan-ahead", "0"]
    wrong = 0
    fast = Mount(fast_src, work / f"mfast-{policy}", root, *args, "--dataset", "fast",
                 debug_invariants=False)
    slow = Mount(slow_src, work / f"mslow-{policy}", root, *args, "--dataset", "slow",
                 debug_invariants=False)
    with fast, slow:
        for _ in range(warm):
            drop_page_cache()
            wrong += _read(fast.mnt, files[0]) + _read(slow.mnt, files[1])
        a0, b0 = fast.stats(), slow.stats()
        t0 = time.perf_counter()
        for _ in range(rounds):
            drop_page_cache()  # every read reaches the daemons
            wrong += _read(fast.mnt, files[0]) + _read(slow.mnt, files[1])
        wall = time.perf_counter() - t0
        a, b = fast.stats(), slow.stats()
    out = {"wall_s": round(wall, 3), "wrong_bytes": wrong}
    for name, s0, s in (("fast", a0, a), ("slow", b0, b)):
        out[name] = {
            "bytes_refetched": s["bytes_from_source"] - s0["bytes_from_source"],
            "share_bytes": s["shared"]["limit_bytes"], "cached_bytes": s["chunk_bytes"],
            "cost_s_per_mib": s["shared"]["cost_s_per_mib"],
            "evictions": s["chunks_evicted"]}
    out["sum_cached_bytes"] = a["chunk_bytes"] + b["chunk_bytes"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.shared")
    p.add_argument("--files", type=int, default=60)
    p.add_argument("--size", default="48K")
    p.add_argument("--budget", type=float, default=1.25,
                   help="the root's budget, in datasets (one dataset's bytes = 1)")
    p.add_argument("--delay-ms", type=float, default=10.0)
    p.add_argument("--warm-rounds", type=int, default=5)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--out", default=os.path.join("bench", "results", "shared.json"))
    a = p.parse_args(argv)
    size = parse_size(a.size)
    work = Path(tempfile.mkdtemp(prefix="dlc-shared-"))
    try:
        fast_src, slow_real = work / "fast", work / "slow_real"
        files = (_tree(fast_src, a.files, size, 1), _tree(slow_real, a.files, size, 2))
        budget = int(a.budget * a.files * size)
        results = {}
        with passthrough_mount(str(slow_real), str(work / "slow"), delay_ms=a.delay_ms):
            for policy in ("equal", "cost"):
                results[policy] = run_policy(work, policy, fast_src, work / "slow", files,
                                             budget, a.warm_rounds, a.rounds)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    eq, co = results["equal"], results["cost"]

    def ratio(x: float, y: float) -> float | None:
        return round(x / y, 3) if y else None

    doc = {
        "bench": "shared", "params": vars(a), "budget_bytes": budget,
        "dataset_bytes": a.files * size, "results": results,
        "ratios": {"slow_bytes_refetched": ratio(co["slow"]["bytes_refetched"],
                                                 eq["slow"]["bytes_refetched"]),
                   "fast_bytes_refetched": ratio(co["fast"]["bytes_refetched"],
                                                 eq["fast"]["bytes_refetched"]),
                   "wall_s": ratio(co["wall_s"], eq["wall_s"])},
        "machine": machine_info(),
    }
    doc["status"] = "ok" if eq["wrong_bytes"] == co["wrong_bytes"] == 0 else "failed"
    print(json.dumps(doc, indent=1))
    if a.out:
        write_json(a.out, doc)
    return 0 if doc["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
