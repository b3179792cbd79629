"""Feeding a node: an unmodified ImageFolder loop over the local copy, through the mount,
and under ``dlcachefs run`` with its reads served in the training's own processes, side
by side in one run; CPU per sample in the daemon and in the readers, and the ceiling of
one node those imply (a model).

    sudo python -m bench.node [--files 3000] [--workers 2] [--rounds 3]
                              [--passes cold,warm,paged] [--out bench/results/node.json]
    sudo python -m bench.node --files 200 --rounds 1 --smoke     # a quick check

One JPEG ImageFolder dataset (``bench.make_dataset``, ~110 KB files) on local disk,
mounted with dlcachefs over it (the source is local on purpose: this measures the read
path's CPU, not a slow link). Three passes, each ``--rounds`` rounds, the systems' order
rotated per round, each run one epoch of ``bench.pipeline`` (``DataLoader(shuffle=True,
num_workers=--workers)``, JPEG decode, RandomResizedCrop, no simulated compute):

* ``cold``: the page cache dropped, and the mount's cache empty (a new cache directory
  and a new mount for each run of ``mount`` and ``run``): every sample is fetched from
  the source during the epoch (the local copy is read from the device);
* ``warm``: the page cache dropped, the mount warmed beforehand (every file read once
  through it, the chunk writer idle): the local copy's files and the cache's logs are
  read from the device;
* ``paged``: as ``warm``, but each measured epoch follows an unmeasured epoch of the
  same system, the page cache kept: the local copy's files, the mount's pages and the
  logs' pages are in memory (CPU per sample with no device reads at all).

* ``local``: the loop over the local copy;
* ``mount``: the loop over the mount under ``dlcachefs run --no-intercept`` (every sample
  a FUSE open, the sampler announced);
* ``run``: the same under ``dlcachefs run`` (read-only binary opens of cached files
  served in the workers: :mod:`dlcachefs.data.intercept`).

Before each measured epoch the bench waits until the daemon is quiet: dropping the page
cache also drops the kernel's inodes, and the daemon then answers a FORGET for each
inode the last epoch looked up (the drop's work, not the epoch's: a training does not
drop its caches every epoch).

Per run: ``files_per_s``, ``reader_cpu_ms_per_file`` (the loop's process and its workers:
reading and decoding), ``daemon_cpu_ms_per_file`` (``/proc/PID/stat`` of the daemon
around the run, over the files; split into ``daemon_user_ms_per_file``, its own code, and
``daemon_sys_ms_per_file``, the kernel's work it asked for, which includes the read-ahead
of the logs it advises for readers in the training's processes: ``advised_bytes``; the
read-ahead it posts for those readers to ask of the kernel themselves, their CPU then:
``posted_bytes``, :mod:`dlcachefs.store.advice`), ``fuse_file_opens`` and
``in_process_hits`` from the mount's stats. ``medians[pass][system]`` and ``ratios[pass]`` (``run``/``local``,
``mount``/``local``) over the rounds. Every run's ``digest`` must equal the dataset's ``tree_digest`` (every file read
once, the right bytes), else ``"status": "failed"`` and exit status 1.

``node_model`` (labelled a model: it extrapolates from this machine): for each pass and
system, the
samples/s of a node with 8, 16, 32 and 64 cores if reading took what it took here: the
daemon's share runs in one process (at most one core: ``1000 / daemon_ms``), the readers'
and its fetch workers' (``workers_cpu_ms_per_file``, with ``--mount-arg=--fetch-workers=N``)
on the other cores (``(cores - 1) * 1000 / (reader_ms + workers_ms)``), the node the lower
of the two;
next to MLPerf Storage's need of 1,786 samples/s per accelerator (ResNet-50 on an H100).
The readers' CPU includes the JPEG decode and the crop, as a training's would; with
``--raw`` the loop only reads and hashes each file (the bench's check of the bytes), so the
model is the ceiling of the data path itself, whatever the training does with the bytes.

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
from .util import (
    drop_page_cache,
    machine_info,
    proc_cpu_seconds,
    proc_cpu_split,
    proc_faults,
    wait_cpu_quiet,
    write_json,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_WORK = os.path.join(REPO, "bench", "out", "node")
DEFAULT_OUT = os.path.join(REPO, "bench", "results", "node.json")
SYSTEMS = ("local", "mount", "run")
PASSES = ("cold", "warm", "paged")
#: MLPerf Storage: samples/s one H100 needs to train ResNet-50
MLPERF_PER_ACCELERATOR = 1786
CORES = (8, 16, 32, 64)


def log(msg: str) -> None:
    print(f"[node {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def one_epoch(system: str, data: str, workers: int, seed: int, m: DlcMount, *,
              drop: bool = True, raw: bool = False, sampler: str = "random") -> dict:
    """One epoch of bench.pipeline for ``system`` (the page cache dropped before it when
    ``drop``), with the daemon's CPU and stats."""
    py = [sys.executable, "-m", "bench.pipeline", "--data", data, "--epochs", "1",
          "--workers", str(workers), "--compute-ms", "0", "--seed", str(seed),
          *(["--raw"] if raw else []), "--sampler", sampler]
    cli = [sys.executable, "-m", "dlcachefs.cli", "run"]
    cmd = {"local": py, "mount": [*cli, "--no-intercept", "--", *py],
           "run": [*cli, "--", *py]}[system]
    if drop:
        drop_page_cache([data])
    assert m.pid is not None
    wait_cpu_quiet(m.pid)  # the daemon's FORGETs of the inodes the drop let go
    start = m.probe_start()
    assert m.pid is not None
    split0 = proc_cpu_split(m.pid)
    faults0 = proc_faults(m.pid)
    workers0 = workers_cpu(start["stats"])
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=3600)
    if r.returncode != 0:
        raise RuntimeError(f"{system}: exit {r.returncode}: {r.stderr[-2000:]}")
    split1 = proc_cpu_split(m.pid)
    faults1 = proc_faults(m.pid)
    end = m.probe_end(start)
    workers1 = workers_cpu(m.stats())
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
            # its own code against the kernel's work it asked for (syscalls: FUSE
            # requests, reads of the source and logs, the read-ahead advised for readers)
            **({"daemon_user_ms_per_file": round(1000 * (split1[0] - split0[0]) / files, 4),
                "daemon_sys_ms_per_file": round(1000 * (split1[1] - split0[1]) / files, 4)}
               if split0 and split1 else {}),
            # pages of its mapped files (code, libraries, the index) read back from disk
            # after the page cache was dropped: a cost per epoch, not per sample
            **({"daemon_major_faults": faults1[1] - faults0[1]} if faults0 and faults1
               else {}),
            "advised_bytes": d.get("planned_advised_bytes", 0),
            # or posted for the readers to ask of the kernel (their CPU, not the daemon's)
            "posted_bytes": d.get("planned_posted_bytes", 0),
            # --fetch-workers: their CPU (reading, checking, appending) is spread like
            # the readers' (workers that ended during the run are not counted)
            "workers_cpu_ms_per_file": round(1000 * sum(
                workers1[p] - workers0.get(p, 0.0) for p in workers1) / files, 4),
            "fuse_file_opens": d.get("hits", 0) + d.get("misses", 0),
            "in_process_hits": zc1.get("hits", 0) - zc0.get("hits", 0),
            "in_process_fallbacks": zc1.get("fallbacks", 0) - zc0.get("fallbacks", 0),
            "bytes_from_source": d.get("bytes_from_source", 0),
            # the next epoch's log laid out meanwhile (--sampler distributed): its chunks
            "reorder_chunks": d.get("reorder_chunks", 0)}


def workers_cpu(stats: dict) -> dict[int, float]:
    """CPU seconds of each of the daemon's fetch workers (``--fetch-workers``) now."""
    out = {}
    for pid in (stats.get("fetch_workers") or {}).get("pids") or []:
        cpu = proc_cpu_seconds(pid)
        if cpu is not None:
            out[pid] = cpu
    return out


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


def warm_up(mnt: str, m: DlcMount) -> None:
    """Every file read once through the mount, then the chunk writer idle."""
    for dirpath, _, names in os.walk(mnt):
        if ".dlcache" in dirpath:
            continue
        for n in names:
            with open(os.path.join(dirpath, n), "rb") as f:
                f.read()
    m.wait_idle()


def rotated(rnd: int) -> tuple[str, ...]:
    """The systems in round ``rnd``'s order (rotated: none always runs first)."""
    k = rnd % len(SYSTEMS)
    return SYSTEMS[k:] + SYSTEMS[:k]


def run(a: argparse.Namespace) -> dict:
    per_class = max(1, math.ceil(a.files / a.classes))
    spec = md.Spec(classes=a.classes, per_class=per_class, seed=a.seed, mean_kb=a.mean_kb)
    root = os.path.join(a.work, f"dataset-c{spec.classes}-p{per_class}-s{spec.seed}-"
                                f"m{spec.mean_kb:g}")
    log(f"dataset: {spec.files} files in {root}")
    manifest, reused = md.ensure_dataset(root, spec, progress=sys.stderr.isatty())
    mnt = os.path.join(a.work, "mnt")
    cache = os.path.join(a.work, "cache")
    passes = [p for p in PASSES if p in a.passes.split(",")]
    doc: dict = {"bench": "node", "status": "ok", "machine": machine_info(REPO),
                 "args": vars(a), "passes": passes,
                 "dataset": {"root": root, "files": spec.files, "reused": reused,
                             "total_bytes": manifest["total_bytes"],
                             "tree_digest": manifest["tree_digest"]},
                 "runs": []}

    def measured(pass_: str, rnd: int, system: str, m: DlcMount, drop: bool) -> None:
        data = os.path.join(root if system == "local" else mnt, "train")
        got = {"pass": pass_, "round": rnd,
               **one_epoch(system, data, a.workers, a.seed + rnd, m, drop=drop, raw=a.raw,
                         sampler=a.sampler)}
        log(f"{pass_} round {rnd} {system}: {got['files_per_s']} files/s, daemon "
            f"{got['daemon_cpu_ms_per_file']} ms/file, readers "
            f"{got['reader_cpu_ms_per_file']} ms/file, "
            f"{got['bytes_from_source']} bytes from the source")
        if got["digest"] != manifest["tree_digest"]:
            doc["status"] = "failed"
            log(f"{pass_} {system}: the epoch's digest is not the dataset's")
        doc["runs"].append(got)

    if "cold" in passes:
        for rnd in range(a.rounds):
            for system in rotated(rnd):
                # a new, empty cache and a new mount for each run (the local copy's run
                # has one too: the same steps before each system)
                shutil.rmtree(cache, ignore_errors=True)
                with DlcMount(root, mnt, cache, extra_args=a.mount_arg) as m:
                    measured("cold", rnd, system, m, drop=True)
    shutil.rmtree(cache, ignore_errors=True)
    if {"warm", "paged"} & set(passes):
        with DlcMount(root, mnt, cache, extra_args=a.mount_arg) as m:
            log("warm-up: every file through the mount, then the writer idle")
            warm_up(mnt, m)
            for pass_ in ("warm", "paged"):
                if pass_ not in passes:
                    continue
                for rnd in range(a.rounds):
                    for system in rotated(rnd):
                        if pass_ == "paged":  # the same system's epoch before: pages in
                            data = os.path.join(root if system == "local" else mnt, "train")
                            one_epoch(system, data, a.workers, a.seed + rnd, m, drop=False,
                                      raw=a.raw, sampler=a.sampler)
                        measured(pass_, rnd, system, m, drop=pass_ == "warm")
                    m.wait_idle()
    keys = ("files_per_s", "reader_cpu_ms_per_file", "daemon_cpu_ms_per_file",
            "daemon_user_ms_per_file", "daemon_sys_ms_per_file", "fuse_file_opens",
            "in_process_hits", "bytes_from_source", "advised_bytes", "posted_bytes",
            "daemon_major_faults", "reorder_chunks",
            "workers_cpu_ms_per_file")
    med: dict = {}
    for pass_ in passes:
        med[pass_] = {}
        for system in SYSTEMS:
            rs = [r for r in doc["runs"] if r["pass"] == pass_ and r["system"] == system]
            med[pass_][system] = {k: statistics.median(r[k] for r in rs) for k in keys
                                  if all(k in r for r in rs)}
    doc["medians"] = med
    doc["ratios"] = {p: {f"{s}/local": round(med[p][s]["files_per_s"]
                                             / med[p]["local"]["files_per_s"], 3)
                         for s in ("mount", "run")} for p in passes}
    doc["node_model"] = {
        "label": "a model: samples/s of one node if each sample cost the CPU measured here",
        "mlperf_per_accelerator": MLPERF_PER_ACCELERATOR,
        **{p: {s: node_model(med[p][s]["daemon_cpu_ms_per_file"],
                             med[p][s]["reader_cpu_ms_per_file"]
                             + med[p][s].get("workers_cpu_ms_per_file", 0.0))
               for s in SYSTEMS}
           for p in passes}}
    return doc


def plot(doc: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    passes = doc["passes"]
    fig, axes = plt.subplots(1, 1 + len(passes), figsize=(5 * (1 + len(passes)), 4))
    ax1 = axes[0]
    med = doc["medians"]
    width = 0.8 / len(SYSTEMS)
    for k, s in enumerate(SYSTEMS):
        ax1.bar([i + k * width for i in range(len(passes))],
                [med[p][s]["files_per_s"] for p in passes], width, label=s)
    ax1.set_xticks([i + width for i in range(len(passes))], passes)
    ax1.set_ylabel("files/s (one epoch, ImageFolder + DataLoader)")
    ax1.legend()
    for ax, p in zip(axes[1:], passes, strict=True):
        for s in SYSTEMS:
            model = doc["node_model"][p][s]
            ax.plot(CORES, [model[str(c)]["samples_per_s"] for c in CORES], marker="o",
                    label=s)
        ax.plot(CORES, [MLPERF_PER_ACCELERATOR * 8] * len(CORES), "k--",
                label="8 accelerators")
        ax.set_title(f"{p}: node model")
        ax.set_xlabel("cores (model)")
        ax.set_ylabel("samples/s")
        ax.set_xscale("log", base=2)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=3000)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--mean-kb", type=float, default=110.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--sampler", choices=["random", "distributed"], default="random",
                   help="the loop's sampler: random (shuffle=True, each epoch's order known "
                        "at its start) or distributed (seeded: the next epoch's order is "
                        "known, so LCache lays out its log during the epoch, the relayout "
                        "counted in the daemon's CPU)")
    p.add_argument("--raw", action="store_true",
                   help="the loop reads and hashes each file, no decode or crop: the data "
                        "path's CPU alone (the node model then is the storage's ceiling)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--passes", default=",".join(PASSES),
                   help="which of cold,warm,paged (comma-separated)")
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
