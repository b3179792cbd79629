"""``dlcachefs run --workers auto``: does a loader started with one worker reach the count
Algorithm 2 advises, and does its epoch time drop? Runs with ``--workers auto`` alternated
with runs of the same script at a fixed ``num_workers=1``.

    .venv/bin/python -m bench.workers_auto [--files 256] [--epochs 4] [--rounds 2]
        [--fetch-ms 10] [--step-ms 20] [--batch 16] [--out bench/results/workers_auto.json]

One JPEG ImageFolder dataset (``bench.make_dataset``), dlcachefs over its local copy,
warmed first (``dlcachefs warmup``). The training script, under ``dlcachefs run``:
ImageFolder whose transform waits ``--fetch-ms`` per sample (a sleep: what a remote read
costs, I/O-bound) then Resize 32 + ToTensor, ``DataLoader(batch_size=--batch,
shuffle=True, num_workers=1)``, a training step of ``--step-ms`` per batch (a sleep, as
DLCache's evaluation does), ``--epochs`` epochs. Per run: each epoch's ``num_workers``
and wall seconds, and a digest of the indices trained on (equal across the two modes:
the order does not depend on the count). Wall time on a shared machine: the fetch and the
step are sleeps, so the ratio between the modes is what to read, not the absolutes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .util import loader_bench

OUT = os.path.join("bench", "out", "workers_auto")

TRAIN = r'''
import hashlib, json, sys, time, torch
import dlcachefs.torch as hook
from torchvision import datasets, transforms
root, epochs, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fetch, step = float(sys.argv[4]), float(sys.argv[5])


class Wait:
    def __call__(self, img):
        time.sleep(fetch)
        return img


ds = hook.with_index(datasets.ImageFolder(root, transform=transforms.Compose(
    [Wait(), transforms.Resize((32, 32)), transforms.ToTensor()])))
dl = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, num_workers=1)
torch.manual_seed(0)
rows, h = [], hashlib.sha256()
for epoch in range(epochs):
    t0 = time.perf_counter()
    for x, y, i in dl:
        h.update(json.dumps(i.tolist()).encode())
        time.sleep(step)
    rows.append({"epoch": epoch, "workers": dl.num_workers,
                 "epoch_s": round(time.perf_counter() - t0, 3)})
report = hook.workers_report(dl)
for r, a in zip(rows, report):
    r.update({k: a[k] for k in ("wanted", "capped_by")})
    if a.get("t_fetch") is not None:
        r.update(t_fetch_ms=round(a["t_fetch"] * 1000, 1), t_req_ms=round(a["t_req"] * 1000, 1))
print(json.dumps({"epochs": rows, "order_sha256": h.hexdigest()[:16]}))
'''


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.workers_auto")
    p.add_argument("--files", type=int, default=256)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--fetch-ms", type=float, default=10.0)
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--workers", default="auto", help="what --workers auto runs pass")
    p.add_argument("--out", default=os.path.join("bench", "results", "workers_auto.json"))
    a = p.parse_args(argv)
    runs = []
    with loader_bench(OUT, a.files, TRAIN) as lb:
        for rnd in range(a.rounds):
            for mode in ("auto", "fixed1"):
                print(f"bench.workers_auto: round {rnd} {mode}", file=sys.stderr)
                extra = ["--workers", a.workers] if mode == "auto" else []
                ran = lb.run(extra, [str(a.epochs), str(a.batch), str(a.fetch_ms / 1000),
                                     str(a.step_ms / 1000)])
                if ran is None:
                    return 1
                res, stderr, seconds = ran
                runs.append({"round": rnd, "mode": mode, **res,
                             "process_s": round(seconds, 3),
                             "log": [x for x in stderr.splitlines()
                                     if x.startswith("dlcachefs: workers auto:")]})

    def mean_epoch(mode: str, first: bool) -> float:
        xs = [e["epoch_s"] for r in runs if r["mode"] == mode for e in r["epochs"]
              if (e["epoch"] == 0) == first]
        return round(sum(xs) / len(xs), 3) if xs else float("nan")

    auto_later, fixed_later = mean_epoch("auto", False), mean_epoch("fixed1", False)
    doc = {"bench": "workers_auto", "files": lb.files, "batch": a.batch,
           "fetch_ms": a.fetch_ms, "step_ms": a.step_ms, "epochs": a.epochs,
           "workers": a.workers, "cores": len(os.sched_getaffinity(0)), "runs": runs,
           "same_order": len({r["order_sha256"] for r in runs}) == 1,
           "epoch0_s": {"auto": mean_epoch("auto", True), "fixed1": mean_epoch("fixed1", True)},
           "later_epochs_s": {"auto": auto_later, "fixed1": fixed_later},
           "later_speedup": round(fixed_later / auto_later, 2) if auto_later else None,
           "note": "epoch 0 runs the loader's own count (1) in both modes; later epochs: "
                   "auto's count against 1 (the machine was shared: read ratios)"}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
