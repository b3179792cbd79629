"""First and second epoch over a far remote (latency-bound), with and without clairvoyance.

The remote is sshfs to an sshd in a network namespace, with ``--delay-ms`` added in each
direction by bench/delay.py as ssh's ProxyCommand (no netem in this kernel). The same
training pipeline (bench.pipeline: ImageFolder + DataLoader, decode, 20 ms compute per
batch) reads it directly, and through dlcachefs under ``dlcachefs run`` (sampler
announced: prefetch in order, ahead of the reader).

    sudo .venv/bin/python -m bench.latency [--delay-ms 20] [--classes 6 --per-class 100]
                                           [--out bench/results/latency.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

from .make_dataset import Spec, make_dataset
from .mounting import DlcMount
from .remote import NS_IP, slow_remote

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _pipeline(data: str, *, launcher: bool, epochs: int, sampler: str, workers: int) -> list:
    cmd = [sys.executable, "-m", "bench.pipeline", "--data", data, "--epochs", str(epochs),
           "--workers", str(workers), "--sampler", sampler]
    if launcher:
        cmd = [sys.executable, "-m", "dlcachefs.cli", "run", "--", *cmd]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=3600)
    if r.returncode:
        sys.exit(f"pipeline failed:\n{r.stderr[-3000:]}")
    return [json.loads(line) for line in r.stdout.splitlines()
            if line.startswith("{") and '"kind": "epoch"' in line]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--delay-ms", type=float, default=20.0, help="added each way (RTT = 2x)")
    ap.add_argument("--classes", type=int, default=6)
    ap.add_argument("--per-class", type=int, default=100)
    ap.add_argument("--workdir", default="/var/tmp/dlc-latency")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    src = os.path.join(a.workdir, "data")
    make_dataset(src, Spec(a.classes, a.per_class))
    mnt = os.path.join(a.workdir, "sshfs")
    os.makedirs(mnt, exist_ok=True)
    proxy = f"ProxyCommand={sys.executable} {os.path.join(HERE, 'delay.py')} {NS_IP} 22 {a.delay_ms}"
    rows = []
    with slow_remote(src, mnt, rate=None, sshfs_options=[proxy]):
        subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=False)
        for workers in (0, 2):
            for e in _pipeline(os.path.join(mnt, "train"), launcher=False, epochs=1,
                               sampler="random", workers=workers):
                rows.append({"system": "remote direct", "sampler": "random", "workers": workers,
                             "epoch": e["epoch"], "files_per_s": round(e["files_per_s"], 1),
                             "stall_s": round(e["stall_s"], 2)})
            for sampler in ("random", "distributed"):
                cache = os.path.join(a.workdir, "cache")
                shutil.rmtree(cache, ignore_errors=True)
                m = DlcMount(mnt, os.path.join(a.workdir, "dmnt"), cache, ["--ignore-source-inode"])
                m.start()
                try:
                    for e in _pipeline(os.path.join(m.mnt, "train"), launcher=True,
                                       epochs=2, sampler=sampler, workers=workers):
                        rows.append({"system": "dlcachefs run", "sampler": sampler,
                                     "workers": workers, "epoch": e["epoch"],
                                     "files_per_s": round(e["files_per_s"], 1),
                                     "stall_s": round(e["stall_s"], 2)})
                finally:
                    m.umount()
    res = {"delay_ms_each_way": a.delay_ms, "files": a.classes * a.per_class, "rows": rows}
    print("| system | sampler | workers | epoch | files/s | stall s |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['system']} | {r['sampler']} | {r['workers']} | {r['epoch']} | "
              f"{r['files_per_s']} | {r['stall_s']} |")
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
