"""Feeding a node: an unmodified ImageFolder loop over the local copy, through the mount,
and under ``dlcachefs run`` with its reads served in the training's own processes, side
by side in one run; CPU per sample in the daemon and in the readers, and the ceiling of
one node those imply (a model).

    sudo python -m bench.node [--files 3000] [--workers 2] [--rounds 3]
                              [--out bench/results/node.json]
    sudo python -m bench.node --files 200 --rounds 1 --smoke     # a quick check

One JPEG ImageFolder dataset (``bench.make_dataset``, ~110 KB files) on local disk,
mounted with dlcachefs over it (the source is local on purpose: this measures the read
path's CPU, not a slow link). The mount is warmed (every file read once through it, the
chunk writer idle). Then ``--rounds`` rounds, the systems' order rotated per round, each
one epoch of ``bench.pipeline`` (``DataLoader(shuffle=True, num_workers=--workers)``,
JPEG decode, RandomResizedCrop, no simulated compute) with the page cache dropped before
it (``warm`` from disk: the local copy's files, the cache's logs):

* ``local``: the loop over the local copy;
* ``mount``: the loop over the mount under ``dlcachefs run --no-intercept`` (every sample
  a FUSE open, the sampler announced);
* ``run``: the same under ``dlcachefs run`` (read-only binary opens of cached files
  served in the workers: :mod:`dlcachefs.data.intercept`).

Per run: ``files_per_s``, ``reader_cpu_ms_per_file`` (the loop's process and its workers:
reading and decoding), ``daemon_cpu_ms_per_file`` (``/proc/PID/stat`` of the daemon
around the run, over the files), ``fuse_file_opens`` and ``in_process_hits`` from the
mount's stats. ``medians`` and ``ratios`` (``run``/``local``, ``mount``/``local``) over the
rounds. Every run's ``digest`` must equal the dataset's ``tree_digest`` (every file read
once, the right bytes), else ``"status": "failed"`` and exit status 1.

``node_model`` (labelled a model: it extrapolates from this machine): for each system, the
samples/s of a node with 8, 16, 32 and 64 cores if reading took what it took here: the
daemon's share runs in one process (at most one core: ``1000 / daemon_ms``), the readers'
on the other cores (``(cores - 1) * 1000 / reader_ms``), the node the lower of the two;
next to MLPerf Storage's need of 1,786 samples/s per accelerator (ResNet-50 on an H100).
The readers' CPU includes the JPEG decode and the crop, as a training's would.

Root is needed to drop the page cache. Output: the JSON document on stdout and ``--out``;
a plot beside it (``.png``) when matplotlib is there; progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time

from . import make_dataset as md
from .mounting import DlcMount
from .util import drop_page_cache, machine_info, write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_WORK = os.path.join(REPO, "bench", "out", "node")
DEFAULT_OUT = os.path.join(REPO, "bench", "results", "node.json")
SYSTEMS = ("local", "mount", "run")
#: MLPerf Storage: samples/s one H100 needs to train ResNet-50
MLPERF_PER_ACCELERATOR = 1786
CORES = (8, 16, 32, 64)


def log(msg: str) -> None:
    print(f"[node {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def one_epoch(system: str, data: str, workers: int, seed: int, m: DlcMount) -> dict:
    """One epoch of bench.pipeline for ``system``, with the daemon's CPU and stats."""
    py = [sys.executable, "-m", "bench.pipeline", "--data", data, "--epochs", "1",
          "--workers", str(workers), "--compute-ms", "0", "--seed", str(seed)]
    cli = [sys.executable, "-m", "dlcachefs.cli", "run"]
    cmd = {"local": py, "mount": [*cli, "--no-intercept", "--", *py],
           "run": [*cli, "--", *py]}[system]
    drop_page_cache([data])
    start = m.probe_start()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"{system}: exit {r.returncode}: {r.stderr[-2000:]}")
    end = m.probe_end(start)
    epoch = next(json.loads(x) for x in r.stdout.splitlines()
                 if x.startswith("{") and json.loads(x).get("kind") == "epoch")
    zc0 = start["stats"].get("zerocopy") or {}
    zc1 = m.stats().get("zerocopy") or {}
    d = end["stats_delta"]
    files = epoch["files"]
    return {"system": system, "files": files, "seconds": epoch["seconds"],
            "files_per_s": round(files / epoch["seconds"], 1),
            "digest": epoch["digest"],
            "reader_cpu_ms_per_file": round(1000 * epoch["reader_cpu_s"] / files, 3),
            "daemon_cpu_ms_per_file": round(1000 * end["daemon_cpu_s"] / files, 4),
            "fuse_file_opens": d.get("hits", 0) + d.get("misses", 0),
            "in_process_hits": zc1.get("hits", 0) - zc0.get("hits", 0),
            "in_process_fallbacks": zc1.get("fallbacks", 0) - zc0.get("fallbacks", 0),
            "bytes_from_source": d.get("bytes_from_source", 0)}


def node_model(daemon_ms: float, reader_ms: float) -> dict:
    """Samples/s of a node of ``CORES`` cores (see the module doc)."""
    out = {}
    for cores in CORES:
        daemon_cap = 1000 / daemon_ms if daemon_ms > 0 else math.inf
        readers_cap = (cores - 1) * 1000 / reader_ms if reader_ms > 0 else math.inf
        node = min(daemon_cap, readers_cap)
        out[str(cores)] = {"samples_per_s": round(node), "accelerators_fed":
                           round(node / MLPERF_PER_ACCELERATOR, 1),
                           "bound_by": "daemon" if daemon_cap < readers_cap else "readers"}
    return out


def run(a: argparse.Namespace) -> dict:
    per_class = max(1, math.ceil(a.files / a.classes))
    spec = md.Spec(classes=a.classes, per_class=per_class, seed=a.seed, mean_kb=a.mean_kb)
    root = os.path.join(a.work, f"dataset-c{spec.classes}-p{per_class}-s{spec.seed}-"
                                f"m{spec.mean_kb:g}")
    log(f"dataset: {spec.files} files in {root}")
    manifest, reused = md.ensure_dataset(root, spec, progress=sys.stderr.isatty())
    mnt = os.path.join(a.work, "mnt")
    cache = os.path.join(a.work, "cache")
    shutil.rmtree(cache, ignore_errors=True)
    doc: dict = {"bench": "node", "status": "ok", "machine": machine_info(REPO),
                 "args": vars(a),
                 "dataset": {"root": root, "files": spec.files, "reused": reused,
                             "total_bytes": manifest["total_bytes"],
                             "tree_digest": manifest["tree_digest"]},
                 "runs": []}
    with DlcMount(root, mnt, cache, extra_args=a.mount_arg) as m:
        log("warm-up: every file through the mount, then the writer idle")
        for dirpath, _, names in os.walk(mnt):
            if ".dlcache" in dirpath:
                continue
            for n in names:
                with open(os.path.join(dirpath, n), "rb") as f:
                    f.read()
        m.wait_idle()
        for rnd in range(a.rounds):
            order = SYSTEMS[rnd % len(SYSTEMS):] + SYSTEMS[:rnd % len(SYSTEMS)]
            for system in order:
                data = os.path.join(root if system == "local" else mnt, "train")
                got = one_epoch(system, data, a.workers, a.seed + rnd, m)
                got["round"] = rnd
                log(f"round {rnd} {system}: {got['files_per_s']} files/s, daemon "
                    f"{got['daemon_cpu_ms_per_file']} ms/file, readers "
                    f"{got['reader_cpu_ms_per_file']} ms/file")
                if got["digest"] != manifest["tree_digest"]:
                    doc["status"] = "failed"
                    log(f"{system}: the epoch's digest is not the dataset's")
                doc["runs"].append(got)
    med: dict = {}
    for system in SYSTEMS:
        rs = [r for r in doc["runs"] if r["system"] == system]
        med[system] = {k: statistics.median(r[k] for r in rs) for k in (
            "files_per_s", "reader_cpu_ms_per_file", "daemon_cpu_ms_per_file",
            "fuse_file_opens", "in_process_hits")}
    doc["medians"] = med
    doc["ratios"] = {f"{s}/local": round(med[s]["files_per_s"] / med["local"]["files_per_s"], 3)
                     for s in ("mount", "run")}
    doc["node_model"] = {
        "label": "a model: samples/s of one node if each sample cost the CPU measured here",
        "mlperf_per_accelerator": MLPERF_PER_ACCELERATOR,
        **{s: node_model(med[s]["daemon_cpu_ms_per_file"], med[s]["reader_cpu_ms_per_file"])
           for s in SYSTEMS}}
    return doc


def plot(doc: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    med = doc["medians"]
    ax1.bar(SYSTEMS, [med[s]["files_per_s"] for s in SYSTEMS])
    ax1.set_ylabel("files/s (warm, page cache dropped)")
    ax1.set_title("one epoch, ImageFolder + DataLoader")
    for s in SYSTEMS:
        model = doc["node_model"][s]
        ax2.plot(CORES, [model[str(c)]["samples_per_s"] for c in CORES], marker="o", label=s)
    ax2.plot(CORES, [MLPERF_PER_ACCELERATOR * 8] * len(CORES), "k--", label="8 accelerators")
    ax2.set_xlabel("cores (model)")
    ax2.set_ylabel("samples/s")
    ax2.set_xscale("log", base=2)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=3000)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--mean-kb", type=float, default=110.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--mount-arg", action="append", default=[],
                   help="an extra argument for dlcachefs mount (repeatable)")
    p.add_argument("--work", default=DEFAULT_WORK)
    p.add_argument("--out", default=DEFAULT_OUT)
    p.add_argument("--smoke", action="store_true", help="a quick check: no file written")
    a = p.parse_args(argv)
    doc = run(a)
    print(json.dumps(doc, indent=2))
    if not a.smoke:
        write_json(a.out, doc)
        plot(doc, os.path.splitext(a.out)[0] + ".png")
    return 0 if doc["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
