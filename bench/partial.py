"""Dataset larger than the cache: the hit ratio dlcachefs reaches, next to the offline
bounds for the same order (Belady's farthest-next-use and LRU, from bench.belady).

    python -m bench.partial [--classes 8 --per-class 250 --mean-kb 20]
                            [--cache-fracs 0.1,0.3,0.6] [--ranks 1,2,4] [--epochs 4]
                            [--chunk-size 256K] [--out bench/results/partial.json]
                            [--policies lru,reuse-distance,lcache] [--both-layouts]

``--ranks N`` starts N training processes together on one mount, each under its own
``dlcachefs run`` with RANK, WORLD_SIZE and LOCAL_RANK set, each a DataLoader (2 workers,
batches of 32) over its DistributedSampler(num_replicas=N, rank=r, seed=7); the ranks
meet at a barrier (torch.distributed, gloo) after every batch, as DDP's all-reduce keeps
them in step. The offline bounds (Belady, LRU) are computed over the ranks' reads merged
**round robin by batch** (rank 0's batch b, rank 1's batch b, ..., then batch b + 1): the
lockstep order; the loaders' workers read up to prefetch_factor x workers batches ahead of
it, so the mount sees it only about so.

Per run, a mount's ``bytes_from_source`` (counted at the source: reads served in the
training process do not hide anything) against Belady's source bytes, and the byte hit
ratio ``1 - source bytes / bytes read`` against Belady's. ``--cache-fracs`` and
``--ranks`` (comma lists) run the grid in one invocation, a fresh mount per cell and
policy. Prints JSON (and writes it to --out) and a table on stderr.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile

from .belady import belady, lru
from .make_dataset import Spec, make_dataset
from .mounting import DlcMount

BATCH = 32

LOOP = r'''
import json, os, sys, time, torch
import torch.distributed as dist
from torchvision import datasets
root, epochs, rdv, batch = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
workers = int(sys.argv[5])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world)
ds = datasets.ImageFolder(root, loader=lambda p: open(p, "rb").read())
sampler = torch.utils.data.DistributedSampler(ds, num_replicas=world, rank=rank, seed=7)
dl = torch.utils.data.DataLoader(ds, batch_size=batch, sampler=sampler, num_workers=workers,
                                 collate_fn=lambda b: len(b))
def st():
    with open(os.path.join(root, "..", ".dlcache", "stats")) as f:
        return json.load(f)
deadline = time.monotonic() + 120
while not st()["sampler_replay_ready"] and time.monotonic() < deadline:
    time.sleep(0.1)
out = []
for e in range(epochs):
    sampler.set_epoch(e)
    b = st() if rank == 0 else None  # (before the barrier: no rank reads this epoch yet)
    dist.barrier()
    t0 = time.perf_counter()
    n = 0
    for k in dl:  # one barrier per batch: the ranks in step, as DDP's all-reduce keeps them
        n += k
        dist.barrier()
    dt = time.perf_counter() - t0
    dist.barrier()
    if rank == 0:
        for _ in range(300):  # let the next epoch's logs settle (nothing is timed on it)
            a = st()
            logs = [s.get("next_log") for s in a["streams"].values()]
            if a["pending_bytes"] == 0 and all(nl is None or nl["sealed"] == nl["chunks"]
                                               for nl in logs):
                break
            time.sleep(0.1)
        out.append({"epoch": e, "files": n, "seconds": round(dt, 3),
                    **{k: a[k] - b[k] for k in ("hits", "misses", "prefetch_hits",
                                                "bytes_from_source")},
                    "chunk_bytes": a["chunk_bytes"],
                    # the next epoch's logs as the epoch ends: chunks planned, sealed, failed
                    "next_logs": [[nl["chunks"], nl["sealed"], nl["failed"]] for nl in logs
                                  if nl is not None]})
    dist.barrier()
dist.destroy_process_group()
print(json.dumps(out))
'''


def merged_order(n: int, ranks: int, epochs: int, batch: int = BATCH) -> list[int]:
    """The ranks' reads of ``epochs`` epochs merged round robin by batch (the lockstep
    order the offline bounds are computed over)."""
    from dlcachefs.clairvoyance.replay import OrderReplayer, SamplerSpec  # noqa: PLC0415

    reps = [OrderReplayer(SamplerSpec("distributed", seed=7, world=ranks, rank=r), n)
            for r in range(ranks)]
    seq: list[int] = []
    for e in range(epochs):
        orders = [rep.order(e) for rep in reps]
        for b in range(0, max(len(o) for o in orders), batch):
            for o in orders:
                seq.extend(o[b:b + batch])
    return seq


def communicate_all(procs: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """Each process's ``(stdout, stderr)``, their pipes drained all at once (a thread per
    process): drained in turn, a rank writing more than a pipe holds (64 KiB) while the
    bench waits on another rank's pipe blocks, and with it the barrier every rank waits at.
    A rank that fails has the others killed (they would wait at the barrier for it)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(procs))) as pool:
        futs = {pool.submit(p.communicate, timeout=timeout): p for p in procs}
        try:
            for fut in concurrent.futures.as_completed(futs):
                if fut.exception() is None and futs[fut].returncode != 0:
                    for p in procs:
                        if p.poll() is None:
                            p.kill()
        finally:
            for p in procs:  # (a communicate that raised leaves its process running)
                if p.poll() is None:
                    p.kill()
        return [f.result() for f in futs]


def run_ranks(m: DlcMount, script: str, ranks: int, epochs: int, work: str,
              workers: int) -> list[dict]:
    """The ranks started together, each under its own ``dlcachefs run``; rank 0's
    per-epoch counters (the mount's counters are shared by the ranks)."""
    rdv = os.path.join(work, f"rdv-{os.getpid()}-{id(m)}")
    if os.path.exists(rdv):
        os.unlink(rdv)
    procs = []
    for r in range(ranks):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(ranks)}
        procs.append(subprocess.Popen(
            [*m.cli, "run", "--", sys.executable, script, os.path.join(m.mnt, "train"),
             str(epochs), rdv, str(BATCH), str(workers)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
    try:
        outs = communicate_all(procs, timeout=3600)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, (_, err)) in enumerate(zip(procs, outs, strict=True)):
        if p.returncode != 0:
            sys.exit(f"training loop of rank {r} failed:\n{err[-3000:]}")
    return json.loads(outs[0][0].strip().splitlines()[-1])


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--classes", type=int, default=8)
    ap.add_argument("--per-class", type=int, default=250)
    ap.add_argument("--mean-kb", type=float, default=20.0)
    ap.add_argument("--cache-frac", type=float, default=None,
                    help="one cache size, a fraction of the dataset (0.3)")
    ap.add_argument("--cache-fracs", type=_floats, default=None,
                    help="comma-separated cache fractions, a grid in one run (0.1,0.3,0.6)")
    ap.add_argument("--ranks", type=_ints, default=[1],
                    help="training processes on the mount, comma-separated for a grid (1)")
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank")
    ap.add_argument("--chunk-size", default="256K", help="the mounts' --chunk-size (256K)")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--policies", default="lru",
                    help="comma-separated --policy values, one fresh mount each (lru)")
    ap.add_argument("--no-reorder", action="store_true", help="mount with --no-reorder")
    ap.add_argument("--both-layouts", action="store_true",
                    help="run each policy with and without LCache log reordering")
    a = ap.parse_args()
    fracs = a.cache_fracs or [a.cache_frac if a.cache_frac is not None else 0.3]
    work = a.workdir or tempfile.mkdtemp(prefix="dlc-partial-")
    src = os.path.join(work, "data")
    make_dataset(src, Spec(a.classes, a.per_class, mean_kb=a.mean_kb))
    root = os.path.join(src, "train")
    import torchvision  # noqa: PLC0415

    ds = torchvision.datasets.ImageFolder(root, loader=lambda p: p)
    sizes = [os.path.getsize(p) for p, _ in ds.samples]
    total = sum(sizes)
    script = os.path.join(work, "loop.py")
    with open(script, "w") as f:
        f.write(LOOP)
    policies = [p.strip() for p in a.policies.split(",") if p.strip()]
    res = {"files": len(sizes), "dataset_bytes": total, "epochs": a.epochs, "batch": BATCH,
           "chunk_size": a.chunk_size,
           "merged_order": "round robin by batch: rank 0's batch b, rank 1's batch b, ..., "
                           "then batch b + 1 (the ranks' lockstep order)",
           "cells": []}
    table = []
    for ranks in a.ranks:
        seq = merged_order(len(sizes), ranks, a.epochs)
        n = len(seq)
        for frac in fracs:
            cap = int(total * frac)
            bh, bhb, btot = belady(seq, sizes, cap)
            lh, lhb, _ = lru(seq, sizes, cap)
            cell = {"ranks": ranks, "cache_frac": frac, "cache_bytes": cap, "reads": n,
                    "bytes_read": btot,
                    "belady_hit_ratio": round(bh / n, 4), "lru_hit_ratio": round(lh / n, 4),
                    "belady_byte_hit_ratio": round(bhb / btot, 4),
                    "lru_byte_hit_ratio": round(lhb / btot, 4),
                    # what the ranks read from the source is the measure that counts
                    # prefetching right: a prefetched sample is a hit at its open, but it
                    # was read all the same
                    "belady_bytes_from_source": btot - bhb, "lru_bytes_from_source": btot - lhb,
                    "runs": []}
            for k, policy in enumerate(policies):
                for reorder in ([True, False] if a.both_layouts else [not a.no_reorder]):
                    extra = ["--cache-size", str(cap), "--chunk-size", a.chunk_size, "--min-free", "0",
                             "--policy", policy] + ([] if reorder else ["--no-reorder"])
                    tag = f"r{ranks}-c{frac}-{k}-{int(reorder)}"
                    m = DlcMount(src, os.path.join(work, f"mnt-{tag}"),
                                 os.path.join(work, f"cache-{tag}"), extra)
                    m.start()
                    try:
                        epochs = run_ranks(m, script, ranks, a.epochs, work, a.workers)
                    finally:
                        m.umount()
                    hits = sum(e["hits"] for e in epochs)
                    from_src = sum(e.get("bytes_from_source", 0) for e in epochs)
                    bhr = 1 - from_src / btot
                    run = {"policy": policy, "reorder": reorder, "epochs": epochs,
                           "hit_ratio": round(hits / n, 4),
                           "bytes_from_source": from_src,
                           "source_bytes_vs_belady": round(from_src / (btot - bhb), 3),
                           "byte_hit_ratio": round(bhr, 4),
                           "byte_hit_ratio_vs_belady": round(bhr / (bhb / btot), 3) if bhb
                           else None,
                           "vs_belady": round(hits / bh, 3) if bh else None,
                           "vs_lru": round(hits / lh, 2) if lh else None,
                           "max_chunk_bytes_seen": max(e["chunk_bytes"] for e in epochs)}
                    cell["runs"].append(run)
                    table.append(f"| {ranks} | {frac:.0%} | {policy}"
                                 f"{'' if reorder else ' --no-reorder'} | "
                                 f"{from_src / 1e6:.1f} MB ({run['source_bytes_vs_belady']}x) | "
                                 f"{bhr:.3f} ({run['byte_hit_ratio_vs_belady']}x of "
                                 f"{bhb / btot:.3f}) |")
                    print(table[-1], file=sys.stderr, flush=True)
            res["cells"].append(cell)
    text = json.dumps(res, indent=2)
    print(text)
    print("| ranks | cache | policy | from the source (x Belady) | byte hit ratio "
          "(x Belady's) |\n|---|---|---|---|---|\n" + "\n".join(table), file=sys.stderr)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
