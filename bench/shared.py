"""Several datasets in one cache, mounted: the bytes re-fetched from a slow source with the
cost-aware shares (``--share-policy cost``) against equal shares (``equal``: each
dataset's own LRU in half the budget), side by side in one run.

    python -m bench.shared [--files 60] [--size 48K] [--budget 1.25] [--delay-ms 10]
                           [--warm-rounds 5] [--rounds 4] [--stopped] [--cooldown 60]
                           [--policies equal,cost] [--core-rev REV]
                           [--out bench/results/shared.json]

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

``--stopped``: a third dataset (``idle``, a local tree like the fast one) is mounted on
the root first, read whole (it holds up to the whole budget) and unmounted before the two
others mount: a stopped dataset whose bytes count in the budget. Past ``--cooldown``
seconds (``--share-cooldown`` of every mount) the live daemons take its room back when
they need it; reported per policy: ``idle`` (bytes it held at its stop, holds at the end,
and gave back). ``--core-rev REV`` runs every daemon from a committed revision (the
"before" side: a revision without that, where the stopped dataset keeps its bytes).
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


def _ledger_entry(root: Path, ds: str) -> dict:
    return json.loads((root / "ledger.json").read_text())["datasets"].get(ds, {})


def run_policy(work: Path, policy: str, fast_src: Path, slow_src: Path,
               files: tuple[dict[str, bytes], dict[str, bytes]], budget: int,
               warm: int, rounds: int, idle: tuple[Path, dict[str, bytes]] | None = None,
               cooldown: float = 60.0, cli: list[str] | None = None) -> dict:
    root = work / f"root-{policy}"
    args = ["--shared-cache", "--cache-size", str(budget), "--share-policy", policy,
            "--share-interval", "0.5", "--flush-interval", "0.5", "--scan-ahead", "0",
            "--share-cooldown", str(cooldown)]
    wrong = 0
    out: dict = {}
    if idle is not None:  # mounted, read whole, stopped: its bytes count in the budget
        with Mount(idle[0], work / f"midle-{policy}", root, *args, "--dataset", "idle",
                   debug_invariants=False, cli=cli) as m:
            wrong += _read(m.mnt, idle[1])
            m.wait_cached(len(idle[1]))
        out["idle"] = {"held_bytes": _ledger_entry(root, "idle").get("used")}
    fast = Mount(fast_src, work / f"mfast-{policy}", root, *args, "--dataset", "fast",
                 debug_invariants=False, cli=cli)
    slow = Mount(slow_src, work / f"mslow-{policy}", root, *args, "--dataset", "slow",
                 debug_invariants=False, cli=cli)
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
    out.update({"wall_s": round(wall, 3), "wrong_bytes": wrong})
    if idle is not None:
        e = _ledger_entry(root, "idle")
        out["idle"].update({"left_bytes": e.get("used"),
                            "reclaimed_bytes": e.get("reclaimed_bytes", 0)})
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
    p.add_argument("--stopped", action="store_true",
                   help="a third dataset, read and stopped before the others mount")
    p.add_argument("--cooldown", type=float, default=60.0,
                   help="--share-cooldown of every mount (seconds)")
    p.add_argument("--policies", default="equal,cost")
    p.add_argument("--core-rev", default=None, metavar="REV",
                   help="run the daemons from this committed revision (git archive)")
    p.add_argument("--out", default=os.path.join("bench", "results", "shared.json"))
    a = p.parse_args(argv)
    size = parse_size(a.size)
    policies = a.policies.split(",")
    work = Path(tempfile.mkdtemp(prefix="dlc-shared-"))
    try:
        fast_src, slow_real = work / "fast", work / "slow_real"
        files = (_tree(fast_src, a.files, size, 1), _tree(slow_real, a.files, size, 2))
        budget = int(a.budget * a.files * size)
        idle = (work / "idle", _tree(work / "idle", a.files, size, 3)) if a.stopped else None
        cli = None
        if a.core_rev:
            from .fidelity import core_from_rev  # noqa: PLC0415

            cli = [core_from_rev(a.core_rev, work)[0]]
        results = {}
        with passthrough_mount(str(slow_real), str(work / "slow"), delay_ms=a.delay_ms):
            for policy in policies:
                results[policy] = run_policy(work, policy, fast_src, work / "slow", files,
                                             budget, a.warm_rounds, a.rounds, idle,
                                             a.cooldown, cli)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def ratio(x: float, y: float) -> float | None:
        return round(x / y, 3) if y else None

    doc = {
        "bench": "shared", "params": vars(a), "budget_bytes": budget,
        "dataset_bytes": a.files * size, "results": results,
        "machine": machine_info(),
    }
    if "equal" in results and "cost" in results:
        eq, co = results["equal"], results["cost"]
        doc["ratios"] = {"slow_bytes_refetched": ratio(co["slow"]["bytes_refetched"],
                                                       eq["slow"]["bytes_refetched"]),
                         "fast_bytes_refetched": ratio(co["fast"]["bytes_refetched"],
                                                       eq["fast"]["bytes_refetched"]),
                         "wall_s": ratio(co["wall_s"], eq["wall_s"])}
    ok = all(r["wrong_bytes"] == 0 for r in results.values())
    doc["status"] = "ok" if ok else "failed"
    print(json.dumps(doc, indent=1))
    if a.out:
        write_json(a.out, doc)
    return 0 if doc["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
