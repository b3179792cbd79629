"""Where the daemon's CPU goes per fetched file: a first pass, sampled with py-spy.

    sudo .venv/bin/python -m bench.cpu_profile [--files 3000] [--threads 8] [--work DIR]
                                               [--out bench/results/cpu_profile.json]
                                               [--rate 200] [--raw FILE]

Makes (or reuses) a JPEG dataset with ``bench.make_dataset``, mounts it on an empty cache,
reads every file once through the mount in a random order with ``--threads`` raw readers
(no announcement: the read-through path of a first epoch), and meanwhile samples the
daemon with ``py-spy record --threads`` (``pip install py-spy``). Prints the daemon's CPU
seconds per fetched file (``/proc/PID/stat`` utime+stime over the pass) and the share of
the busy samples under each of the daemon's hot frames (inclusive, and innermost only:
``self``), as JSON; ``--raw`` keeps py-spy's collapsed stacks.

Counts of CPU time, not wall time: on a loaded machine they stay meaningful. The first
second after the mount (the background import of torch) is left out of the sample.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter

from dlcachefs.data.hook import prepare_mounts

from . import make_dataset as md
from .mounting import DlcMount, dlcachefs_exe
from .readers import read_all
from .util import proc_cpu_seconds, write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDLE = ("get_events", "_thread_cache.py:211", "wait (threading", "select (", "epoll")


def summarize(raw: str, top: int = 30) -> dict:
    """Shares of the busy samples per frame from py-spy's ``raw`` output.

    ``frames``: inclusive (the frame or anything it called); ``self``: the innermost
    frame only (where the CPU is spent), to find what to cut.
    """
    incl: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit():
            continue
        frames = stack.split(";")
        if any(k in frames[-1] for k in IDLE):
            continue
        total += int(n)
        leaf[frames[-1]] += int(n)
        for f in set(frames):
            if "thread (" not in f and "_bootstrap" not in f and "Thread.run" not in f:
                incl[f] += int(n)
    def shares(c: Counter[str]) -> list[dict]:
        return [{"share": round(n / total, 3), "frame": f}
                for f, n in c.most_common(top)] if total else []
    return {"busy_samples": total, "frames": shares(incl), "self": shares(leaf)}


def run(files: int, threads: int, work: str, rate: int = 200,
        keep_raw: str | None = None) -> dict:
    per_class = max(1, files // 10)
    spec = md.Spec(classes=10, per_class=per_class, seed=0, style="noise")
    root = os.path.join(work, f"ds-{spec.files}")
    md.ensure_dataset(root, spec, progress=False)
    src = os.path.join(root, "train")
    rel = sorted(os.path.relpath(os.path.join(d, f), src)
                 for d, _, fs in os.walk(src) for f in fs)
    random.Random(0).shuffle(rel)
    cache, mnt = os.path.join(work, "cache"), os.path.join(work, "mnt")
    shutil.rmtree(cache, ignore_errors=True)
    spy_exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    with DlcMount(src, mnt, cache, [], dlcachefs_exe()) as m, \
            tempfile.TemporaryDirectory() as tmp:
        assert m.pid is not None
        prepare_mounts([mnt])  # as a training's hook does at its start
        while not m.stats().get("sampler_replay_ready"):
            time.sleep(0.1)  # the replay worker's torch import is not the fetch path
        raw = os.path.join(tmp, "spy.txt")
        spy = subprocess.Popen([spy_exe, "record", "-p", str(m.pid), "-r", str(rate), "-f", "raw",
                                "-o", raw, "--threads"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1)
        c0 = proc_cpu_seconds(m.pid) or 0.0
        t0 = time.perf_counter()
        res = read_all([os.path.join(mnt, p) for p in rel], threads=threads)
        wall = time.perf_counter() - t0
        c1 = proc_cpu_seconds(m.pid) or 0.0
        m.wait_idle(120)
        c2 = proc_cpu_seconds(m.pid) or 0.0
        spy.send_signal(2)
        spy.wait(timeout=60)
        with open(raw) as f:
            text = f.read()
        if keep_raw:
            with open(keep_raw, "w") as f:
                f.write(text)
        prof = summarize(text)
        n = len(rel)
        return {"files": n, "threads": threads, "errors": res.summary().get("errors"),
                "wall_s": round(wall, 2), "files_per_s": round(n / wall, 1),
                "daemon_cpu_ms_per_file": round(1000 * (c1 - c0) / n, 3),
                "daemon_cpu_ms_per_file_with_writer_drain": round(1000 * (c2 - c0) / n, 3),
                "profile": prof}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--work", default=os.path.join(REPO, "bench", "out", "cpu_profile"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    ap.add_argument("--raw", default=None, help="keep py-spy's collapsed stacks here")
    a = ap.parse_args(argv)
    os.makedirs(a.work, exist_ok=True)
    doc = run(a.files, a.threads, a.work, a.rate, a.raw)
    print(json.dumps(doc, indent=1))
    if a.out:
        write_json(a.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
