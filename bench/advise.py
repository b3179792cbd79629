"""Does the worker advice (``dlcachefs advise``, DLCache's Algorithm 2) pick a good
``num_workers``? Epoch times for every worker count side by side, and what the advice said
after each.

    sudo .venv/bin/python -m bench.advise [--files 400] [--workers 0,1,2,3] [--step-ms 30]
                                          [--batch 16] [--out bench/results/advise.json]

One JPEG ImageFolder dataset (``bench.make_dataset``, ~110 KB files), dlcachefs over its
local copy, warmed first (``dlcachefs warmup``), so the loader's time is decoding and
transforms, not the source. A training script under ``dlcachefs run``: ImageFolder
(Resize 64 + ToTensor), ``DataLoader(batch_size=--batch, shuffle=True,
num_workers=K)``, a simulated training step of ``--step-ms`` per batch (a sleep, as
DLCache's own evaluation does), one epoch per K, in a fresh process. Per K: the epoch's
wall time, the training's data stall (seconds blocked in ``next()``), and the advice read
right after the epoch (recommended ``num_workers``, t_fetch, t_req). ``best``: the K with
the shortest epoch; ``advised``: what the advice said from each K. The machine's cores
cap the advice (Algorithm 2 line 2).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from .util import loader_bench

OUT = os.path.join("bench", "out", "advise")

TRAIN = r'''
import json, sys, time, torch
from torchvision import datasets, transforms
root, workers, batch, step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
ds = datasets.ImageFolder(root, transform=transforms.Compose(
    [transforms.Resize((64, 64)), transforms.ToTensor()]))
dl = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=workers)
t0 = time.perf_counter()
wait = 0.0
it = iter(dl)
n = 0
while True:
    t = time.perf_counter()
    try:
        x, y = next(it)
    except StopIteration:
        break
    wait += time.perf_counter() - t
    n += len(y)
    time.sleep(step)
print(json.dumps({"samples": n, "epoch_s": time.perf_counter() - t0, "wait_s": wait}))
'''


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.advise")
    p.add_argument("--files", type=int, default=400)
    p.add_argument("--workers", default="0,1,2,3")
    p.add_argument("--step-ms", type=float, default=30.0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--out", default=os.path.join("bench", "results", "advise.json"))
    a = p.parse_args(argv)
    rows = []
    with loader_bench(OUT, a.files, TRAIN) as lb:
        for k in [int(x) for x in a.workers.split(",") if x.strip()]:
            print(f"bench.advise: num_workers={k}", file=sys.stderr)
            ran = lb.run(["--job", f"w{k}"], [str(k), str(a.batch), str(a.step_ms / 1000)])
            if ran is None:
                return 1
            res, _, seconds = ran
            res["process_s"] = round(seconds, 3)
            adv = subprocess.run([lb.exe, "advise", lb.mnt, "--json"], capture_output=True,
                                 text=True)
            advice = {x["stream"]: x for x in json.loads(adv.stdout or "[]")}.get(f"w{k}/0", {})
            rows.append({"workers": k, "epoch_s": round(res["epoch_s"], 3),
                         "stall_s": round(res["wait_s"], 3), "samples": res["samples"],
                         "advised": advice.get("recommended"), "bound": advice.get("bound"),
                         "t_fetch_ms": round(advice["t_fetch"] * 1000, 2)
                         if advice.get("t_fetch") else None,
                         "t_req_ms": round(advice["t_req"] * 1000, 2)
                         if advice.get("t_req") else None,
                         "t_req_from": advice.get("t_req_from")})
    best = min(rows, key=lambda r: r["epoch_s"])
    doc = {"bench": "advise", "files": lb.files, "batch": a.batch,
           "step_ms": a.step_ms, "cores": len(os.sched_getaffinity(0)), "rows": rows,
           "best": best["workers"],
           "note": "epoch_s per num_workers; advised: dlcachefs advise's num_workers after "
                   "that epoch (the machine was shared: read ratios, not absolutes)"}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
