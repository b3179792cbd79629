"""Dataset larger than the cache: the hit ratio dlcachefs reaches, next to the offline
bounds for the same order (Belady's farthest-next-use and LRU, from bench.belady).

    python -m bench.partial [--classes 8 --per-class 250 --mean-kb 20] [--cache-frac 0.3]
                            [--epochs 4] [--out bench/results/partial.json]
                            [--policies lru,reuse-distance,lcache] [--both-layouts]

A real ImageFolder + DataLoader(DistributedSampler, 2 workers) reads the epochs through
the mount under `dlcachefs run`; per epoch it records the mount's hits, misses,
prefetch_hits and bytes_from_source. Prints JSON (and writes it to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from .belady import belady, lru
from .make_dataset import Spec, make_dataset
from .mounting import DlcMount

LOOP = r'''
import json, os, sys, time, torch
from torchvision import datasets
root, epochs = sys.argv[1], int(sys.argv[2])
ds = datasets.ImageFolder(root, loader=lambda p: open(p, "rb").read())
sampler = torch.utils.data.DistributedSampler(ds, num_replicas=1, rank=0, seed=7)
dl = torch.utils.data.DataLoader(ds, batch_size=32, sampler=sampler, num_workers=2,
                                 collate_fn=lambda b: len(b))
def st():
    with open(os.path.join(root, "..", ".dlcache", "stats")) as f:
        return json.load(f)
out = []
for e in range(epochs):
    sampler.set_epoch(e)
    b = st()
    t0 = time.perf_counter()
    n = sum(dl)
    dt = time.perf_counter() - t0
    for _ in range(300):  # let the next epoch's log settle (nothing is timed on it)
        a = st()
        nl = a["streams"].get("default/0", {}).get("next_log")
        if a["pending_bytes"] == 0 and (nl is None or nl["sealed"] == nl["chunks"]):
            break
        time.sleep(0.1)
    out.append({"epoch": e, "files": n, "seconds": round(dt, 3),
                **{k: a[k] - b[k] for k in ("hits", "misses", "prefetch_hits",
                                            "bytes_from_source")},
                "chunk_bytes": a["chunk_bytes"]})
print(json.dumps(out))
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--classes", type=int, default=8)
    ap.add_argument("--per-class", type=int, default=250)
    ap.add_argument("--mean-kb", type=float, default=20.0)
    ap.add_argument("--cache-frac", type=float, default=0.3)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None)
    ap.add_argument("--policies", default="lru",
                    help="comma-separated --policy values, one fresh mount each (lru)")
    ap.add_argument("--no-reorder", action="store_true", help="mount with --no-reorder")
    ap.add_argument("--both-layouts", action="store_true",
                    help="run each policy with and without LCache log reordering")
    a = ap.parse_args()
    work = a.workdir or tempfile.mkdtemp(prefix="dlc-partial-")
    src = os.path.join(work, "data")
    make_dataset(src, Spec(a.classes, a.per_class, mean_kb=a.mean_kb))
    root = os.path.join(src, "train")
    import torchvision  # noqa: PLC0415

    ds = torchvision.datasets.ImageFolder(root, loader=lambda p: p)
    sizes = [os.path.getsize(p) for p, _ in ds.samples]
    total = sum(sizes)
    cap = int(total * a.cache_frac)
    script = os.path.join(work, "loop.py")
    with open(script, "w") as f:
        f.write(LOOP)
    from dlcachefs.clairvoyance.replay import OrderReplayer, SamplerSpec  # noqa: PLC0415

    rep = OrderReplayer(SamplerSpec("distributed", seed=7, world=1, rank=0), len(sizes))
    seq = [i for e in range(a.epochs) for i in rep.order(e)]
    bh, bhb, btot = belady(seq, sizes, cap)
    lh, lhb, _ = lru(seq, sizes, cap)
    n = len(seq)
    res = {"files": len(sizes), "dataset_bytes": total, "cache_bytes": cap,
           "belady_hit_ratio": round(bh / n, 4), "lru_hit_ratio": round(lh / n, 4),
           # what an epoch reads from the source is the measure that counts prefetching
           # right: a prefetched sample is a hit at its open, but it was read all the same
           "belady_bytes_from_source": btot - bhb, "lru_bytes_from_source": btot - lhb,
           "runs": []}
    for k, policy in enumerate(p.strip() for p in a.policies.split(",") if p.strip()):
        for reorder in ([True, False] if a.both_layouts else [not a.no_reorder]):
            extra = ["--cache-size", str(cap), "--chunk-size", "256K", "--min-free", "0",
                     "--policy", policy] + ([] if reorder else ["--no-reorder"])
            tag = f"{k}-{int(reorder)}"
            m = DlcMount(src, os.path.join(work, f"mnt-{tag}"), os.path.join(work, f"cache-{tag}"),
                         extra)
            m.start()
            try:
                r = subprocess.run([*m.cli, "run", "--", sys.executable, script,
                                    os.path.join(m.mnt, "train"), str(a.epochs)],
                                   capture_output=True, text=True, timeout=3600)
                if r.returncode != 0:
                    sys.exit(f"training loop failed:\n{r.stderr[-3000:]}")
                epochs = json.loads(r.stdout.strip().splitlines()[-1])
            finally:
                m.umount()
            hits = sum(e["hits"] for e in epochs)
            res["runs"].append({
                "policy": policy, "reorder": reorder, "epochs": epochs,
                "hit_ratio": round(hits / n, 4),
                "bytes_from_source": sum(e.get("bytes_from_source", 0) for e in epochs),
                "source_bytes_vs_belady": round(
                    sum(e.get("bytes_from_source", 0) for e in epochs) / (btot - bhb), 3),
                "vs_belady": round(hits / bh, 3) if bh else None,
                "vs_lru": round(hits / lh, 2) if lh else None,
                "max_chunk_bytes_seen": max(e["chunk_bytes"] for e in epochs)})
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
