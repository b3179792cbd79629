"""First epochs only, side by side and repeated: the slow remote read directly against
dlcachefs on an empty cache, for every way a first epoch is read.

    sudo .venv/bin/python -m bench.first_epoch [--files 3000] [--rounds 3] [--rate 400mbit]
        [--cases raw1,raw8,pipe,pipe-run,pipe-dist] [--workers 2] [--cache-dir DIR] [--out JSON]

Needs root (network namespace, ``drop_caches``). One JPEG ImageFolder dataset
(``bench.make_dataset``, ~110 KB per file) is exported by the slow remote
(``bench.remote.slow_remote``: sshd in a netns + sshfs, link shaped to ``--rate``). Each
round runs, for every case, the remote directly and then dlcachefs (a fresh mount on an
empty cache over the same sshfs mount, ``--ignore-source-inode``), one after the other, so
that both sides of a ratio see the same machine:

=========== ==================================================================================
case        what reads the epoch
=========== ==================================================================================
raw1        ``open().read()`` of every file, one thread, one fixed random permutation
raw8        the same, 8 threads
pipe        ``bench/pipeline.py`` (ImageFolder, decode, RandomResizedCrop, 20 ms compute
            per batch, ``--workers`` DataLoader workers, ``shuffle``): nothing announced
pipe-run    the same under ``dlcachefs run`` (the RandomSampler's order announced)
pipe-dist   the same with a DistributedSampler (world 1), under ``dlcachefs run``
=========== ==================================================================================

The page cache is dropped before every epoch; before each round, 64 files are read through
sshfs with 8 threads (untimed), so that sshfs's connections are open for both systems
(:func:`warm_connections`). The dlcachefs mount is made before the
epoch starts and the epoch starts at once (as a user's job does: nothing waits for the
daemon's background start). Every byte is checked: the raw readers hash each file against
the dataset manifest, the pipeline's epoch digest must equal the manifest's; any
difference stops the run (exit status 1).

Output: JSON (``--out``, default ``bench/results/first_epoch-<ts>.json``) with every run
(files/s, wall, the machine's busy share, the daemon's CPU, its counter deltas) and, per case, the ratio dlcachefs /
direct of each round with its median and minimum; a markdown table next to it and on
stdout. Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

from . import make_dataset as md
from .mounting import DlcMount, counter_delta, dlcachefs_exe
from .readers import read_all
from .remote import slow_remote
from .run import BenchFailure, Verifier
from .util import drop_page_cache, machine_cpu_seconds, machine_info, proc_cpu_seconds, write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_WORK = os.path.join(REPO, "bench", "out", "first_epoch")
CASES = ("raw1", "raw8", "pipe", "pipe-run", "pipe-dist")


def log(msg: str) -> None:
    print(f"[first_epoch {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Failure(RuntimeError):
    """Wrong bytes or a failed reader: exit status 1."""


def raw_epoch(root: str, rels: list[str], threads: int, verifier: Verifier) -> dict:
    res = read_all([os.path.join(root, r) for r in rels], threads)
    try:
        verifier.check_read(f"raw x{threads}", rels, res)
    except BenchFailure as e:
        raise Failure(str(e)) from None
    s = res.summary()
    return {"files_per_s": s["files_per_s"], "seconds": s["wall_s"]}


def pipe_epoch(data: str, case: str, workers: int, seed: int, launcher: bool,
               verifier: Verifier) -> dict:
    cmd = [sys.executable, "-m", "bench.pipeline", "--data", data, "--epochs", "1",
           "--workers", str(workers), "--sampler",
           "distributed" if case == "pipe-dist" else "random", "--seed", str(seed)]
    if launcher:
        cmd = [dlcachefs_exe(), "run", "--", *cmd]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if r.returncode != 0:
        raise Failure(f"pipeline {case} failed ({r.returncode}): {r.stderr[-2000:]}")
    ep = next(json.loads(x) for x in r.stdout.splitlines()
              if x.startswith("{") and json.loads(x).get("kind") == "epoch")
    try:
        verifier.check_epoch(f"pipeline {case}", ep)
    except BenchFailure as e:
        raise Failure(str(e)) from None
    return {"files_per_s": ep["files_per_s"], "seconds": ep["seconds"],
            "stall_s": ep["stall_s"], "reader_cpu_s": ep["reader_cpu_s"]}


def one_epoch(case: str, root: str, a: argparse.Namespace, ctx: dict) -> dict:
    """One first epoch of ``case`` over ``root`` (the exported directory, or a mount of it),
    with the machine's busy share meanwhile (``machine_busy``, of all its CPUs: whether the
    epoch was bound by the CPU or by waiting)."""
    b0, t0 = machine_cpu_seconds()
    if case.startswith("raw"):
        d = raw_epoch(root, ctx["order"], int(case[3:]), ctx["verifier"])
    else:
        d = pipe_epoch(os.path.join(root, "train"), case, a.workers, a.seed,
                       case != "pipe" and ctx["mounted"], ctx["verifier"])
    b1, t1 = machine_cpu_seconds()
    d["machine_busy"] = round((b1 - b0) / max(t1 - t0, 1e-9), 3)
    return d


def first_epoch_dataset(dataset_dir: str, files: int, seed: int
                        ) -> tuple[str, dict, list[str]]:
    """The JPEG ImageFolder dataset of ``files`` files under ``dataset_dir`` (made once,
    then reused), its manifest, and the one random order the raw readers read it in
    (paths relative to the dataset: ``train/<class>/<file>``)."""
    spec = md.Spec(classes=10, per_class=max(1, math.ceil(files / 10)), seed=seed)
    ds = os.path.join(dataset_dir, f"dataset-c10-p{spec.per_class}-s{seed}")
    manifest, _ = md.ensure_dataset(ds, spec, progress=True)
    order = [r[0] for r in manifest["file_list"]]
    random.Random(f"first-epoch-{seed}").shuffle(order)
    return ds, manifest, order


def warm_connections(remote, order: list[str], n: int = 64) -> None:
    """Read ``n`` files through sshfs with 8 threads, untimed, before a round: sshfs starts
    with one SSH connection and opens more (up to ``max_conns``) at the first concurrent
    requests, and while it does, every request waits (~0.3 s here). A direct 1-thread
    reader never needs a second connection; dlcachefs (its reader's miss beside
    scan-ahead's fetch) did, so that one-time cost of sshfs fell on its first epoch
    alone. The page cache is dropped before every measured epoch anyway."""
    read_all([os.path.join(remote.mount, r) for r in order[-n:]], threads=8)


def run_round(rnd: int, a: argparse.Namespace, remote, ctx: dict, runs: list) -> None:
    warm_connections(remote, ctx["order"])
    mnt = os.path.join(a.work, "mnt")
    cache = a.cache_dir or os.path.join(a.work, "cache")
    os.makedirs(mnt, exist_ok=True)
    for case in a.cases:
        drop_page_cache([ctx["dataset_root"]])
        ctx["mounted"] = False
        c0 = proc_cpu_seconds(remote.sshfs_pid)
        d = one_epoch(case, remote.mount, a, ctx)
        d.update(case=case, system="direct", round=rnd,
                 sshfs_cpu_s=round((proc_cpu_seconds(remote.sshfs_pid) or 0) - (c0 or 0), 2))
        runs.append(d)
        shutil.rmtree(cache, ignore_errors=True)
        with DlcMount(remote.mount, mnt, cache, ["--ignore-source-inode", *a.mount_arg]) as m:
            drop_page_cache([ctx["dataset_root"]])
            ctx["mounted"] = True
            s0 = m.stats()
            p0 = proc_cpu_seconds(m.pid)
            e = one_epoch(case, mnt, a, ctx)
            cpu = (proc_cpu_seconds(m.pid) or 0) - (p0 or 0)
            delta = counter_delta(s0, m.stats())
        shutil.rmtree(cache, ignore_errors=True)
        e.update(case=case, system="dlcachefs", round=rnd, daemon_cpu_s=round(cpu, 2),
                 daemon_cpu_ms_per_file=round(1000 * cpu / len(ctx["order"]), 3),
                 stats_delta={k: v for k, v in delta.items() if v})
        runs.append(e)
        log(f"round {rnd} {case:<9} direct {d['files_per_s']:7.1f} files/s, dlcachefs "
            f"{e['files_per_s']:7.1f} ({e['files_per_s'] / d['files_per_s']:.2f}x), daemon "
            f"{e['daemon_cpu_ms_per_file']:.2f} ms CPU/file; machine busy "
            f"{d['machine_busy']:.0%} / {e['machine_busy']:.0%}")


def summarize(runs: list, cases: list[str]) -> list[dict]:
    out = []
    for case in cases:
        pairs = {}
        for r in runs:
            if r["case"] == case:
                pairs.setdefault(r["round"], {})[r["system"]] = r
        ratios = [round(p["dlcachefs"]["files_per_s"] / p["direct"]["files_per_s"], 3)
                  for p in pairs.values() if len(p) == 2]
        if not ratios:
            continue
        direct = [p["direct"]["files_per_s"] for p in pairs.values()]
        dlc = [p["dlcachefs"]["files_per_s"] for p in pairs.values() if "dlcachefs" in p]
        out.append({"case": case, "ratios": ratios, "median": statistics.median(ratios),
                    "min": min(ratios), "direct_median_files_per_s": statistics.median(direct),
                    "dlcachefs_median_files_per_s": statistics.median(dlc),
                    "daemon_cpu_ms_per_file_median": statistics.median(
                        p["dlcachefs"]["daemon_cpu_ms_per_file"] for p in pairs.values()
                        if "dlcachefs" in p)})
    return out


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [f"# bench.first_epoch {doc['started']}", "",
             f"{doc['files']} files, {doc['total_bytes'] / 1e6:.0f} MB, remote sshfs over a "
             f"veth shaped to {doc['rate']}; {doc['rounds']} rounds, direct and dlcachefs "
             f"one after the other per case; {m['cpu_model']}, {m['cpus']} CPUs, kernel "
             f"{m['kernel']}; load average before: {doc['loadavg_before']}", "",
             "| case | direct files/s (median) | dlcachefs files/s (median) | dlcachefs / "
             "direct per round | median | min | daemon CPU ms/file |",
             "|---|---|---|---|---|---|---|"]
    for s in doc["summary"]:
        lines.append(f"| {s['case']} | {s['direct_median_files_per_s']:.0f} | "
                     f"{s['dlcachefs_median_files_per_s']:.0f} | "
                     f"{', '.join(f'{x:.2f}' for x in s['ratios'])} | {s['median']:.2f} | "
                     f"{s['min']:.2f} | {s['daemon_cpu_ms_per_file_median']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate", default="400mbit")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mount-arg", action="append", default=[], metavar="ARG")
    p.add_argument("--remote-name", default="dlcbench")
    p.add_argument("--work", default=DEFAULT_WORK)
    p.add_argument("--cache-dir", default=None,
                   help="dlcachefs's cache directory (default WORK/cache; e.g. on tmpfs, so "
                        "that its writes do not share this one machine's disk with the "
                        "remote's reads, as they would not on a real remote)")
    p.add_argument("--dataset-dir", default=os.path.join(REPO, "bench", "out", "run"),
                   help="where the dataset is made or reused (bench.run's, by default)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    a.cases = [c for c in a.cases.split(",") if c]
    unknown = set(a.cases) - set(CASES)
    if unknown:
        p.error(f"unknown cases: {', '.join(sorted(unknown))}")
    if os.geteuid() != 0:
        p.error("needs root (network namespace, drop_caches)")
    out = a.out or os.path.join(REPO, "bench", "results",
                                f"first_epoch-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(a.work, exist_ok=True)
    ds, manifest, order = first_epoch_dataset(a.dataset_dir, a.files, a.seed)
    rels = [r[0] for r in manifest["file_list"]]  # "train/<class>/<file>"
    ctx = {"dataset_root": ds, "order": order, "verifier": Verifier(manifest)}
    doc = {"bench": "first_epoch", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": " ".join([os.path.basename(sys.executable), "-m", "bench.first_epoch",
                                *(argv if argv is not None else sys.argv[1:])]),
           "files": len(rels), "total_bytes": manifest["total_bytes"], "rate": a.rate,
           "rounds": a.rounds, "cases": a.cases, "machine": machine_info(REPO),
           "loadavg_before": " ".join(f"{x:.2f}" for x in os.getloadavg()), "runs": []}
    status = 0
    try:
        with slow_remote(ds, os.path.join(a.work, "mnt-remote"), rate=a.rate,
                         name=a.remote_name) as remote:
            for rnd in range(1, a.rounds + 1):
                run_round(rnd, a, remote, ctx, doc["runs"])
    except Failure as e:
        doc["status"], doc["error"] = "failed", str(e)
        log(f"FAILED: {e}")
        status = 1
    else:
        doc["status"] = "ok"
    doc["summary"] = summarize(doc["runs"], a.cases)
    write_json(out, doc)
    md_text = markdown(doc)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(md_text)
    print(md_text)
    return status


if __name__ == "__main__":
    sys.exit(main())
