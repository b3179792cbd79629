"""Is the sampler replay worker ready when a script under ``dlcachefs run`` announces?

    python -m bench.launch_start [--repeat 3] [--wait 5] [--out bench/results/launch_start.json]

The daemon starts its replay worker (a process that imports torch, ~2-4 s here) when a
training first reaches the mount: the hook opens ``.dlcache/control`` as the script's
interpreter starts, so the worker imports torch while the script imports its own (see
docs/clairvoyance.md, "Start-up of a stream"). This measures that race as a user meets it: a small
ImageFolder (4 x 100 JPEGs of ~8 KB, ``bench.make_dataset``) is mounted, ``--wait`` seconds pass (a mount made before the
job), then ``dlcachefs run -- python train.py MNT`` runs an ordinary script (imports torch
and torchvision, ``ImageFolder``, ``DataLoader(shuffle=True)``, one epoch). Meanwhile
``stats`` is polled every 50 ms. Reported per repetition, in seconds from the launch:
``script_started`` and ``iter`` (the script's own clock: its first line, the line before
``iter()``), ``replay_ready`` (``sampler_replay_ready`` became true), ``stream_active``
(the stream ``default/0`` in mode ``replayed`` at epoch 0: its order known), and
``active_after_iter`` (the wait the announcement saw). A fresh mount per repetition.

Prints JSON (and writes it to ``--out``). Times are reported, never asserted. No root.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time

from . import make_dataset as md
from .mounting import DlcMount
from .util import machine_info, write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_WORK = os.path.join(REPO, "bench", "out", "launch_start")
DEFAULT_OUT = os.path.join(REPO, "bench", "results", "launch_start.json")

SCRIPT = '''
import sys, time
t0 = time.time()
import torch
from torchvision import datasets, transforms
tf = transforms.Compose([transforms.Resize((32, 32)), transforms.ToTensor()])
ds = datasets.ImageFolder(sys.argv[1], transform=tf)
dl = torch.utils.data.DataLoader(ds, batch_size=10, shuffle=True, num_workers=0)
t_iter = time.time()
n = 0
for x, y in dl:
    n += 1
    time.sleep(0.05)  # the training step
print(t0, t_iter, n)
'''


def one(work: str, src: str, wait: float) -> dict:
    mnt, cache = os.path.join(work, "mnt"), os.path.join(work, "cache")
    shutil.rmtree(cache, ignore_errors=True)
    os.makedirs(mnt, exist_ok=True)
    script = os.path.join(work, "train.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    with DlcMount(src, mnt, cache) as m:
        time.sleep(wait)
        events: dict[str, float] = {}
        stop = threading.Event()

        def poll() -> None:
            while not stop.is_set():
                st = m.stats()
                now = time.time()
                if st.get("sampler_replay_ready"):
                    events.setdefault("replay_ready", now)
                s = (st.get("streams") or {}).get("default/0")
                if s and s.get("mode") == "replayed" and s.get("epoch") == 0:
                    events.setdefault("stream_active", now)
                time.sleep(0.05)

        th = threading.Thread(target=poll, daemon=True)
        th.start()
        t0 = time.time()
        r = subprocess.run([sys.executable, "-m", "dlcachefs.cli", "run", "--", sys.executable,
                            script, mnt], capture_output=True, text=True, timeout=600,
                           cwd=work)
        stop.set()
        th.join()
    if r.returncode != 0:
        raise RuntimeError(f"the script failed: {r.stderr[-2000:]}")
    started, it, _n = map(float, r.stdout.split())
    out = {"script_started": started - t0, "iter": it - t0,
           **{k: v - t0 for k, v in events.items()}}
    if "stream_active" in events:
        out["active_after_iter"] = events["stream_active"] - it
    return {k: round(v, 3) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.launch_start",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--wait", type=float, default=5.0,
                   help="seconds between the mount and the job's launch (default 5)")
    p.add_argument("--work", default=DEFAULT_WORK)
    p.add_argument("--out", default=DEFAULT_OUT)
    a = p.parse_args(argv)
    os.makedirs(a.work, exist_ok=True)
    src = os.path.join(a.work, "src")
    md.ensure_dataset(src, md.Spec(classes=4, per_class=100, mean_kb=8.0))
    runs = [one(a.work, os.path.join(src, "train"), a.wait) for _ in range(a.repeat)]
    keys = sorted({k for r in runs for k in r})
    doc = {"bench": "launch_start", "machine": machine_info(REPO), "args": vars(a),
           "runs": runs,
           "median": {k: statistics.median(r[k] for r in runs if k in r) for k in keys}}
    write_json(a.out, doc)
    print(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
