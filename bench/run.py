"""The whole benchmark suite in one run, on one dataset, side by side.

    python -m bench.run [--quick] [--files N] [--rate 400mbit] [--out bench/results/run-<ts>.json]

Needs root (network namespace for the slow remote, drop_caches). One ImageFolder JPEG
dataset (default 3,000 files of ~110 KB; ``--quick``: 600) is exported by a slow remote
(``bench.remote.slow_remote``: sshd in a netns + sshfs, link shaped to ``--rate``), and:

1. raw readers (``open().read()``, one fixed random permutation, 1 and 8 threads) over:
   the remote directly (sshfs); the local copy cold and warm; the minimal pyfuse3
   passthrough over the local copy; rclone ``--vfs-cache-mode full`` (fast options) pass
   1 and 2 over the same remote (default options on a small capped subset, separately);
   dlcachefs over the remote, cold pass and warm pass (page cache dropped); dlcachefs
   with ``--cache-size`` 30% of the dataset, two passes (hit ratio).
2. a training input pipeline (``bench/pipeline.py``, 2 epochs, workers 0/2/4) over the
   remote directly, dlcachefs without the launcher, and dlcachefs with ``dlcachefs run``
   (RandomSampler and DistributedSampler).
3. metadata at scale (``bench/metadata.py``; tiny files, local source).

Every byte read is hashed and compared with the dataset manifest: any difference stops
the run (exit status 1). Timings are reported, never asserted; the "goals" section says
where each goal stands. Output: JSON (``--out``), a markdown summary next to it (.md)
and on stdout, PNG charts next to it (``bench/plots.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
import traceback

from . import make_dataset as md
from .belady import belady, lru
from .mounting import DlcMount, dlcachefs_exe
from .readers import read_all
from .util import (
    drop_page_cache,
    fs_of,
    machine_info,
    net_rx,
    proc_cpu_seconds,
    proc_status_kb,
    reset_peak_rss,
    write_json,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_WORK = os.path.join(REPO, "bench", "out", "run")


class BenchFailure(RuntimeError):
    """Wrong bytes or read errors: exit status 1."""


def log(msg: str) -> None:
    print(f"[run {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----- probes ------------------------------------------------------------------------------

class Daemons:
    """CPU seconds and peak RSS of a set of daemon pids (name -> pid) over a run."""

    def __init__(self, pids: dict[str, int | None]) -> None:
        self.pids = {k: v for k, v in pids.items() if v}

    def start(self) -> dict:
        return {k: (proc_cpu_seconds(p), reset_peak_rss(p)) for k, p in self.pids.items()}

    def end(self, start: dict) -> dict:
        out = {}
        for k, p in self.pids.items():
            cpu = proc_cpu_seconds(p)
            hwm = proc_status_kb(p, "VmHWM")
            c0, reset = start.get(k, (None, False))
            out[k] = {"pid": p,
                      "cpu_s": round(cpu - c0, 3) if cpu is not None and c0 is not None else None,
                      "peak_rss_mb": round(hwm / 1024, 1) if hwm else None,
                      "peak_rss_scope": "run" if reset else "since_start"}
        return out


# ----- the raw reader ------------------------------------------------------------------------

class Verifier:
    def __init__(self, manifest: dict) -> None:
        self.expected = {r[0]: (r[1], r[2]) for r in manifest["file_list"]}
        self.tree_digest = manifest["tree_digest"]

    def check_read(self, label: str, rels: list[str], res) -> None:
        if res.errors:
            shown = "; ".join(f"{rels[i]}: {m}" for i, m in res.errors[:5])
            raise BenchFailure(f"{label}: {len(res.errors)} files could not be read: {shown}")
        bad = [r for r, s, h in zip(rels, res.sizes, res.hashes, strict=True)
               if self.expected.get(r) != (s, h)]
        if bad:
            raise BenchFailure(f"{label}: {len(bad)} of {len(rels)} files differ from the "
                               f"source, e.g. {bad[0]}")

    def check_epoch(self, label: str, ep: dict) -> None:
        if not ep.get("all_files"):
            raise BenchFailure(f"{label}: epoch {ep['epoch']} did not read every file once")
        if ep["digest"] != self.tree_digest:
            raise BenchFailure(f"{label}: epoch {ep['epoch']} read bytes that differ from the "
                               "source (digest mismatch)")


def raw_run(ctx: dict, system: str, phase: str, threads: int, root: str, rels: list[str],
            drop: bool, daemons: dict[str, int | None], mount: DlcMount | None = None,
            note: str = "") -> dict:
    page_cache = drop_page_cache([ctx["dataset_root"]]) if drop else "warm"
    paths = [os.path.join(root, r) for r in rels]
    dm = Daemons(daemons)
    d0 = dm.start()
    p0 = mount.probe_start() if mount else None
    rx0 = net_rx(ctx.get("iface"))
    res = read_all(paths, threads)
    rx1 = net_rx(ctx.get("iface"))
    dlc = mount.probe_end(p0) if mount else None
    dd = dm.end(d0)
    label = f"{system} {phase}".strip()
    ctx["verifier"].check_read(f"{label} x{threads}", rels, res)
    rec = {"system": system, "phase": phase, "label": label, "threads": threads,
           "page_cache": page_cache, **res.summary(), "bytes_match_source": True,
           "daemons": dd,
           "daemon_cpu_s": round(sum(v["cpu_s"] or 0 for v in dd.values()), 3) if dd else None,
           "daemon_peak_rss_mb": max((v["peak_rss_mb"] or 0 for v in dd.values()), default=None)
           if dd else None}
    if rx0 is not None and rx1 is not None:
        rec["net_rx_bytes"] = rx1 - rx0
    if note:
        rec["note"] = note
    if dlc is not None:
        rec["dlcachefs"] = dlc
        rec["daemon_cpu_s"] = round((rec["daemon_cpu_s"] or 0) + (dlc["daemon_cpu_s"] or 0), 3)
        rec["daemon_peak_rss_mb"] = dlc["daemon_peak_rss_mb"]
        s = dlc["stats_delta"]
        h, m = s.get("hits", 0), s.get("misses", 0)
        rec["hit_ratio"] = round(h / (h + m), 4) if h + m else None
    ctx["doc"]["raw"].append(rec)
    s = rec.get("dlcachefs", {}).get("stats_delta", {})
    log(f"raw {label:<24} x{threads}: {rec['files_per_s']:>8.1f} files/s "
        f"{rec['mb_per_s']:>7.1f} MB/s p50 {rec['latency_ms']['p50']:.2f} ms p99 "
        f"{rec['latency_ms']['p99']:.2f} ms net {rec.get('net_rx_bytes', 0) / 1e6:.1f} MB"
        + (f" | hits {s.get('hits')} misses {s.get('misses')} from source "
           f"{s.get('bytes_from_source', 0) / 1e6:.1f} MB" if s else ""))
    return rec


def raw_section(ctx: dict, a: argparse.Namespace, remote) -> None:
    from .passthrough import passthrough_mount
    from .rclone import rclone_mount

    root = ctx["dataset_root"]
    rmnt = remote.mount
    rels = ctx["order"]
    mnt = os.path.join(a.work, "mnt")
    sshfs = {"sshfs": remote.sshfs_pid}
    total = ctx["total_bytes"]
    for t in a.threads:
        raw_run(ctx, "remote direct", "", t, rmnt, rels, True, sshfs)
        raw_run(ctx, "local", "cold", t, root, rels, True, {})
        raw_run(ctx, "local", "warm", t, root, rels, False, {})
        with passthrough_mount(root, mnt) as pid:
            raw_run(ctx, "passthrough", "cold", t, mnt, rels, True, {"passthrough": pid},
                    note="minimal pyfuse3 passthrough over the local copy, page cache dropped")
            raw_run(ctx, "passthrough", "warm", t, mnt, rels, False, {"passthrough": pid},
                    note="minimal pyfuse3 passthrough over the local copy, its page cache warm")
        if "rclone" in a.systems:
            with rclone_mount("sftp", remote, mnt, fast=True) as rc:
                raw_run(ctx, "rclone fast", "pass1", t, mnt, rels, True, {"rclone": rc.pid})
                raw_run(ctx, "rclone fast", "pass2", t, mnt, rels, True, {"rclone": rc.pid})
            sub = rels[: a.rclone_default_files]
            with rclone_mount("sftp", remote, mnt, fast=False) as rc:
                raw_run(ctx, "rclone default", "pass1", t, mnt, sub, True, {"rclone": rc.pid},
                        note=f"default options, first {len(sub)} files of the order only")
                raw_run(ctx, "rclone default", "pass2", t, mnt, sub, True, {"rclone": rc.pid},
                        note=f"default options, first {len(sub)} files of the order only")
        cache = os.path.join(a.work, f"cache-raw-x{t}")
        shutil.rmtree(cache, ignore_errors=True)
        try:
            with DlcMount(rmnt, mnt, cache, ["--ignore-source-inode", *a.mount_arg]) as m:
                ctx["doc"]["mounts"].append({"what": f"raw x{t}", "mount_s": round(m.mount_s, 3)})
                raw_run(ctx, "dlcachefs", "cold", t, mnt, rels, True, sshfs, m)
                m.wait_idle()
                raw_run(ctx, "dlcachefs", "warm", t, mnt, rels, True, sshfs, m)
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        try:  # the same first pass without scan-ahead (dlcachefs.cache.scanahead): what it adds
            with DlcMount(rmnt, mnt, cache, ["--ignore-source-inode", *a.mount_arg,
                                              "--scan-ahead=0"]) as m:
                raw_run(ctx, "dlcachefs --scan-ahead 0", "cold", t, mnt, rels, True, sshfs, m,
                        note="scan-ahead off: every file fetched when it is opened")
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        if t in a.cache_frac_threads:
            size = max(1, int(total * a.cache_frac))
            args = ["--ignore-source-inode", *a.mount_arg, f"--cache-size={size}",
                    f"--chunk-size={a.small_chunk}"]
            try:
                with DlcMount(rmnt, mnt, cache, args) as m:
                    for ph in ("pass1", "pass2"):
                        rec = raw_run(ctx, f"dlcachefs {int(a.cache_frac * 100)}% cache", ph, t,
                                      mnt, rels, True, sshfs, m,
                                      note=f"--cache-size {size} ({a.cache_frac:.0%} of the "
                                           f"dataset), --chunk-size {a.small_chunk}; same "
                                           "order both passes")
                        rec["cache_size_bytes"] = size
                        rec["cache_fraction"] = a.cache_frac
                        if ph == "pass2":
                            # offline bounds for the same two passes of the same order
                            n = len(ctx["sizes"])
                            seq = list(range(n)) * 2
                            rec["belady_hit_ratio"] = round(
                                belady(seq, ctx["sizes"], size)[0] / n, 4)
                            rec["lru_hit_ratio"] = round(lru(seq, ctx["sizes"], size)[0] / n, 4)
                        m.wait_idle()
            finally:
                shutil.rmtree(cache, ignore_errors=True)


# ----- the pipeline ----------------------------------------------------------------------------

def pipeline_run(ctx: dict, a: argparse.Namespace, system: str, data: str, workers: int,
                 sampler: str, launcher: bool, remote) -> dict:
    cmd = [sys.executable, "-m", "bench.pipeline", "--data", data, "--epochs", str(a.epochs),
           "--workers", str(workers), "--batch", str(a.batch), "--compute-ms",
           str(a.compute_ms), "--sampler", sampler, "--seed", str(a.seed),
           "--net-iface", ctx["iface"], "--daemon-pid", str(remote.sshfs_pid)]
    if launcher:
        cmd = [dlcachefs_exe(), "run", "--", *cmd]
    drop_page_cache([ctx["dataset_root"]])
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    label = f"{system} [{sampler}, workers={workers}]"
    if r.returncode != 0:
        raise BenchFailure(f"pipeline {label} failed ({r.returncode}): {r.stderr[-3000:]}")
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    epochs = [x for x in lines if x.get("kind") == "epoch"]
    done = next((x for x in lines if x.get("kind") == "done"), {})
    for ep in epochs:
        ctx["verifier"].check_epoch(label, ep)
    rec = {"system": system, "sampler": sampler, "workers": workers, "launcher": launcher,
           "label": label, "epochs": epochs, "process_wall_s": round(wall, 2),
           "hook_loaded": done.get("hook"), "bytes_match_source": True}
    if r.stderr.strip():
        rec["stderr_tail"] = r.stderr.strip()[-600:]
    ctx["doc"]["pipeline"].append(rec)
    for ep in epochs:
        s = ep.get("dlcachefs", {}).get("stats_delta", {})
        log(f"pipe {label:<52} epoch {ep['epoch']}: {ep['files_per_s']:>7.1f} files/s stall "
            f"{ep['stall_s']:.2f} s net {ep.get('net_rx_bytes', 0) / 1e6:.1f} MB"
            + (f" | src {s.get('bytes_from_source', 0) / 1e6:.1f} MB chunk_reads "
               f"{s.get('chunk_reads')} seq {s.get('sequential_chunk_reads')} prefetched "
               f"{s.get('prefetched')}" if s else ""))
    return rec


def pipeline_section(ctx: dict, a: argparse.Namespace, remote) -> None:
    rdata = os.path.join(remote.mount, "train")
    mnt = os.path.join(a.work, "mnt")
    for w in a.workers:
        # the floor: the same DataLoader over the local copy (no network, no FUSE)
        pipeline_run(ctx, a, "local", os.path.join(ctx["dataset_root"], "train"), w, "random",
                     False, remote)
        pipeline_run(ctx, a, "remote direct", rdata, w, "random", False, remote)
        for system, sampler, launcher in (("dlcachefs", "random", False),
                                          ("dlcachefs run", "random", True),
                                          ("dlcachefs run", "distributed", True)):
            cache = os.path.join(a.work, f"cache-pipe-{w}-{sampler}-{int(launcher)}")
            shutil.rmtree(cache, ignore_errors=True)
            try:
                with DlcMount(remote.mount, mnt, cache, ["--ignore-source-inode", *a.mount_arg]):
                    pipeline_run(ctx, a, system, os.path.join(mnt, "train"), w, sampler,
                                 launcher, remote)
            finally:
                shutil.rmtree(cache, ignore_errors=True)


# ----- goals ---------------------------------------------------------------------------------

def _fps(doc: dict, label: str, threads: int) -> float | None:
    for r in doc.get("raw", []):
        if r["label"] == label and r["threads"] == threads:
            return r["files_per_s"]
    return None


def _ep(doc: dict, system: str, sampler: str, workers: int, epoch: int) -> dict | None:
    for p in doc.get("pipeline", []):
        if p["system"] == system and p["sampler"] == sampler and p["workers"] == workers:
            for e in p["epochs"]:
                if e["epoch"] == epoch:
                    return e
    return None


def goals(doc: dict) -> list[dict]:
    out: list[dict] = []

    def add(goal: str, status: str, detail: str) -> None:
        out.append({"goal": goal, "status": status, "detail": detail})

    def cmp(goal: str, val: float | None, ref: float | None, factor: float, what: str) -> None:
        if val is None or ref is None:
            add(goal, "not measured", f"missing: {what}")
            return
        ratio = val / ref if ref else math.inf
        add(goal, "met" if ratio >= factor else "NOT met",
            f"{val:.0f} vs {ref:.0f} files/s = {ratio:.2f}x (target >= {factor:g}x; {what})")

    t = max((r["threads"] for r in doc.get("raw", [])), default=8)
    warm = _fps(doc, "dlcachefs warm", t)
    cmp(f"warm dlcachefs {t} readers >= passthrough {t} readers", warm,
        _fps(doc, "passthrough warm", t), 1.0,
        "passthrough over the local copy with its page cache warm; dlcachefs's warm pass "
        "runs with the page cache dropped")
    cmp(f"warm dlcachefs {t} readers >= passthrough {t} readers, both page caches dropped",
        warm, _fps(doc, "passthrough cold", t), 1.0, "passthrough over the local copy, cold")
    cmp(f"warm dlcachefs {t} readers >= 4x remote direct", warm,
        _fps(doc, "remote direct", t), 4.0, "sshfs over the shaped link")
    cmp(f"warm dlcachefs {t} readers >= 3x rclone pass 2", warm,
        _fps(doc, "rclone fast pass2", t), 3.0, "rclone --vfs-cache-mode full, fast options")
    ws = sorted({p["workers"] for p in doc.get("pipeline", [])})
    for w in ws:
        base = _ep(doc, "remote direct", "random", w, 0)
        for sampler in ("random", "distributed"):
            e = _ep(doc, "dlcachefs run", sampler, w, 0)
            cmp(f"cold epoch, sampler announced ({sampler}), workers={w} >= 1.5x remote direct",
                e and e["files_per_s"], base and base["files_per_s"], 1.5,
                "epoch 1 files/s, same DataLoader")
    for w in ws:
        base = _ep(doc, "remote direct", "random", w, 1)
        for system, sampler in (("dlcachefs", "random"), ("dlcachefs run", "random"),
                                ("dlcachefs run", "distributed")):
            e = _ep(doc, system, sampler, w, 1)
            if e is None or base is None:
                continue
            frac = e["stall_s"] / base["stall_s"] if base["stall_s"] else math.inf
            loc = _ep(doc, "local", "random", w, 1)
            add(f"warm-epoch stall <= 10% of remote direct ({system}, {sampler}, workers={w})",
                "met" if frac <= 0.10 else "NOT met",
                f"{e['stall_s']:.2f} s vs {base['stall_s']:.2f} s = {frac:.1%}"
                + (f"; the same DataLoader over the local copy stalls {loc['stall_s']:.2f} s "
                   f"= {loc['stall_s'] / base['stall_s']:.1%} (the floor on this machine)"
                   if loc and base["stall_s"] else ""))
    cache_runs = [r for r in doc.get("raw", []) if "cache_fraction" in r and r["phase"] == "pass2"]
    for r in cache_runs:
        bel, lr = r.get("belady_hit_ratio"), r.get("lru_hit_ratio")
        ok = bel is not None and r["hit_ratio"] >= 0.95 * bel and r["hit_ratio"] >= 2 * (lr or 0)
        add(f"{r['cache_fraction']:.0%} cache: hit ratio >= 0.95x Belady and >= 2x LRU "
            f"(raw reader x{r['threads']}, no order announced, pass 2)",
            "met" if ok else "NOT met",
            f"hit ratio {r['hit_ratio']} vs Belady {bel} and LRU {lr} (offline, same order); "
            f"bytes_from_source "
            f"{r['dlcachefs']['stats_delta'].get('bytes_from_source', 0) / 1e6:.1f} MB. "
            "Without an announced order the cache is plain LRU; with the sampler announced "
            "see `python -m bench.partial`")
    if not cache_runs:
        add("30% cache hit ratio", "not measured", "no cache-size run")
    meta = doc.get("metadata")
    if meta and "summary" in meta:
        s = meta["summary"]
        n = meta["files"]
        scale = "" if n >= 1_000_000 else f" (measured at {n:,} files, not 1,000,000)"
        add("remount of 1,000,000 files < 5 s" + scale,
            ("met" if s["remount_s"] < 5 else "NOT met") if n >= 1_000_000 else
            ("met at this scale" if s["remount_s"] < 5 else "NOT met"),
            f"remount {s['remount_s']:.2f} s, first mount {s['first_mount_s']:.2f} s")
        per_m = s["daemon_peak_rss_mb_per_million_files"]
        add("daemon RSS < 300 MB per million files" + scale,
            "met" if per_m < 300 else "NOT met",
            f"peak RSS {s['daemon_peak_rss_mb']:.0f} MB for {n:,} files = {per_m:.0f} MB per "
            "million (includes the interpreter's fixed ~30 MB); RSS after the first mount + "
            f"find + ls -lR {meta['after_first_mount'].get('rss_mb')} MB, after the remount "
            f"+ find + ls -lR {meta['after_remount'].get('rss_mb')} MB")
    else:
        add("metadata goals (remount, RSS)", "not measured", "metadata part not run")
    return out


# ----- the markdown ----------------------------------------------------------------------------

def _mb(v) -> str:
    return "" if v is None else f"{v / 1e6:.1f}"


def markdown(doc: dict) -> str:
    L: list[str] = []
    ds = doc.get("dataset", {})
    m = doc["machine"]
    L.append(f"# bench.run {doc.get('started', '')}")
    L.append("")
    L.append(f"{ds.get('files')} files, {ds.get('total_bytes', 0) / 1e6:.0f} MB; remote: sshfs "
             f"over a veth shaped to {doc['config'].get('rate')}; {m['cpu_model']}, "
             f"{m['cpus_usable']} CPUs, {m['memory_gb']} GB, kernel {m['kernel']}. "
             f"Status: {doc.get('status')}.")
    if doc.get("raw"):
        L += ["", "## Raw reader (open+read whole file, one fixed random order)", "",
              "| system | thr | files/s | MB/s | p50 ms | p99 ms | reader CPU s | daemon CPU s "
              "| daemon peak RSS MB | net MB from remote | dlc src MB | hits | misses | hit ratio "
              "| files |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in doc["raw"]:
            s = r.get("dlcachefs", {}).get("stats_delta", {})
            L.append("| " + " | ".join([
                r["label"], str(r["threads"]), f"{r['files_per_s']:.0f}", f"{r['mb_per_s']:.1f}",
                f"{r['latency_ms']['p50']:.2f}", f"{r['latency_ms']['p99']:.2f}",
                f"{r['reader_cpu_s']:.2f}",
                "" if r.get("daemon_cpu_s") is None else f"{r['daemon_cpu_s']:.2f}",
                "" if not r.get("daemon_peak_rss_mb") else f"{r['daemon_peak_rss_mb']:.0f}",
                _mb(r.get("net_rx_bytes")),
                _mb(s.get("bytes_from_source")) if s else "",
                str(s.get("hits", "")) if s else "", str(s.get("misses", "")) if s else "",
                "" if r.get("hit_ratio") is None else f"{r['hit_ratio']:.3f}",
                str(r["files"])]) + " |")
        L.append("")
        L.append("daemon CPU/RSS: sshfs for `remote direct`; dlcachefs + sshfs for dlcachefs "
                 "(peak RSS: dlcachefs); rclone; the passthrough. `net MB`: bytes received "
                 "from the remote's veth during the run (includes protocol overhead).")
    if doc.get("pipeline"):
        L += ["", f"## Training pipeline (ImageFolder + DataLoader, batch "
              f"{doc['config']['batch']}, RandomResizedCrop(64), {doc['config']['compute_ms']:g}"
              " ms simulated compute per batch)", "",
              "| system | sampler | workers | epoch | files/s | seconds | stall s | reader CPU s "
              "| daemon CPU s | net MB | dlc src MB | chunk_reads | seq chunk_reads | "
              "prefetched | hits | misses |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for p in doc["pipeline"]:
            for e in p["epochs"]:
                d = e.get("dlcachefs")
                s = d["stats_delta"] if d else {}
                dcpu = sum((e.get("daemon_cpu_s") or {}).values()) + (
                    (d or {}).get("daemon_cpu_s") or 0)
                L.append("| " + " | ".join([
                    p["system"], p["sampler"], str(p["workers"]), str(e["epoch"] + 1),
                    f"{e['files_per_s']:.0f}", f"{e['seconds']:.2f}", f"{e['stall_s']:.2f}",
                    f"{e['reader_cpu_s']:.1f}", f"{dcpu:.1f}", _mb(e.get("net_rx_bytes")),
                    _mb(s.get("bytes_from_source")) if d else "",
                    str(s.get("chunk_reads", "")) if d else "",
                    str(s.get("sequential_chunk_reads", "")) if d else "",
                    str(s.get("prefetched", "")) if d else "",
                    str(s.get("hits", "")) if d else "", str(s.get("misses", "")) if d else "",
                ]) + " |")
        L.append("")
        L.append("`dlcachefs run` = through the launcher (sampler announced). Page cache dropped "
                 "before epoch 1 only; stall = time the loop waited for the next batch. daemon "
                 "CPU = sshfs (+ dlcachefs).")
    meta = doc.get("metadata")
    if meta and meta.get("runs"):
        from .metadata import markdown as meta_md
        L += ["", "## " + meta_md(meta)]
    if doc.get("goals"):
        L += ["", "## Goals", ""]
        for g in doc["goals"]:
            L.append(f"- **{g['status']}**: {g['goal']}: {g['detail']}")
    if doc.get("warnings"):
        L += ["", "## Warnings", ""] + [f"- {w}" for w in doc["warnings"]]
    if doc.get("error"):
        L += ["", f"**FAILED**: {doc['error']}"]
    return "\n".join(L)


def warnings_for(doc: dict) -> list[str]:
    out = []
    for r in doc.get("raw", []):
        s = r.get("dlcachefs", {}).get("stats_delta")
        if not s:
            continue
        where = f"{r['label']} x{r['threads']}"
        if r["phase"] == "warm" and (s.get("misses") or s.get("bytes_from_source")):
            out.append(f"{where}: {s.get('misses')} misses, {s.get('bytes_from_source')} bytes "
                       "from the source on the warm pass (expected 0)")
        for k in ("checksum_failures", "stale_refetches", "source_errors", "source_timeouts",
                  "cache_skipped", "write_errors"):
            if s.get(k):
                out.append(f"{where}: {k} = {s[k]}")
    for p in doc.get("pipeline", []):
        if p["launcher"] and not p.get("hook_loaded"):
            out.append(f"{p['label']}: the dlcachefs.torch hook was not loaded in the pipeline")
    return out


# ----- main ------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="600 files, workers 0,2, metadata at 100,000 files: a few minutes")
    p.add_argument("--files", type=int, default=None, help="JPEG files (default 3000; quick 600)")
    p.add_argument("--rate", default="400mbit", help="link rate of the slow remote (tbf)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/run-<ts>.json)")
    p.add_argument("--work", default=DEFAULT_WORK)
    p.add_argument("--threads", default="1,8")
    p.add_argument("--workers", default=None, help="DataLoader num_workers list (default 0,2,4;"
                                                   " quick 0,2)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--compute-ms", type=float, default=20.0)
    p.add_argument("--metadata-files", type=int, default=None,
                   help="tiny files for the metadata part (default 1,000,000; quick 100,000)")
    p.add_argument("--parts", default="raw,pipeline,metadata",
                   help="which parts to run (comma-separated: raw, pipeline, metadata)")
    p.add_argument("--metadata-from", metavar="JSON",
                   help="take the metadata part from a `python -m bench.metadata` result "
                        "instead of measuring it again")
    p.add_argument("--no-rclone", action="store_true", help="skip rclone")
    p.add_argument("--remote-name", default="dlcbench",
                   help="network namespace and link names of the slow remote (default "
                        "dlcbench; another name lets two runs share a machine)")
    p.add_argument("--rclone-default-files", type=int, default=None,
                   help="files read by rclone with default options (default 100; quick 40)")
    p.add_argument("--mount-arg", action="append", default=[],
                   help="extra argument for every `dlcachefs mount`, repeatable, e.g. "
                        "--mount-arg=--scan-ahead=8")
    p.add_argument("--cache-frac", type=float, default=0.30)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    from . import plots
    from .remote import slow_remote

    a = build_parser().parse_args(argv)
    a.work = os.path.abspath(a.work)
    a.files = a.files or (600 if a.quick else 3000)
    a.threads = [int(x) for x in a.threads.split(",") if x.strip()]
    a.workers = [int(x) for x in (a.workers or ("0,2" if a.quick else "0,2,4")).split(",")
                 if x.strip()]
    a.metadata_files = a.metadata_files or (100_000 if a.quick else 1_000_000)
    a.rclone_default_files = a.rclone_default_files or (40 if a.quick else 100)
    a.parts = {x.strip() for x in a.parts.split(",") if x.strip()}
    a.systems = set() if a.no_rclone else {"rclone"}
    # the 30% cache runs: every thread count in a full run, the largest one in --quick
    a.cache_frac_threads = {max(a.threads)} if a.quick else set(a.threads)
    a.small_chunk = "4M" if a.quick else "8M"
    ts = time.strftime("%Y%m%d-%H%M%S")
    out = os.path.abspath(a.out or os.path.join(REPO, "bench", "results", f"run-{ts}.json"))
    os.makedirs(a.work, exist_ok=True)
    doc: dict = {"benchmark": "run", "status": "running",
                 "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv[1:],
                 "machine": machine_info(REPO),
                 "config": {"quick": a.quick, "mount_args": a.mount_arg, "files": a.files, "rate": a.rate,
                            "threads": a.threads, "workers": a.workers, "epochs": a.epochs,
                            "batch": a.batch, "compute_ms": a.compute_ms,
                            "metadata_files": a.metadata_files, "parts": sorted(a.parts),
                            "rclone_default_files": a.rclone_default_files,
                            "cache_frac": a.cache_frac, "small_chunk": a.small_chunk,
                            "seed": a.seed, "work": a.work, "cache_fs": fs_of(a.work)},
                 "raw": [], "pipeline": [], "mounts": [], "warnings": []}
    code = 0
    t_start = time.perf_counter()
    try:
        if os.geteuid() != 0:
            raise SystemExit("bench.run needs root (slow remote, drop_caches)")
        if a.parts & {"raw", "pipeline"}:
            classes = 10
            spec = md.Spec(classes=classes, per_class=math.ceil(a.files / classes), seed=a.seed)
            root = os.path.join(a.work, f"dataset-c{classes}-p{spec.per_class}-s{a.seed}")
            log(f"dataset: {spec.files} files in {root}")
            manifest, reused = md.ensure_dataset(root, spec, progress=True)
            rels = [r[0] for r in manifest["file_list"]]
            order = list(rels)
            random.Random(f"run-order-{a.seed}").shuffle(order)
            doc["dataset"] = {"root": root, "files": len(rels),
                              "total_bytes": manifest["total_bytes"],
                              "tree_digest": manifest["tree_digest"], "reused": reused,
                              "size_stats": manifest.get("size_stats"), "fs": fs_of(root)}
            sizes_by_rel = {r[0]: r[1] for r in manifest["file_list"]}
            ctx = {"doc": doc, "dataset_root": root, "order": order,
                   "sizes": [sizes_by_rel[r] for r in order],
                   "total_bytes": manifest["total_bytes"], "verifier": Verifier(manifest)}
            rmnt = os.path.join(a.work, "mnt-remote")
            with slow_remote(root, rmnt, rate=a.rate, name=a.remote_name) as remote:
                ctx["iface"] = f"{remote.name}-h"
                doc["remote"] = remote.describe()
                log(f"remote up: sshfs pid {remote.sshfs_pid} on {rmnt}, rate {a.rate}")
                if "raw" in a.parts:
                    raw_section(ctx, a, remote)
                if "pipeline" in a.parts:
                    pipeline_section(ctx, a, remote)
        if a.metadata_from:
            with open(a.metadata_from) as f:
                doc["metadata"] = json.load(f)["metadata"]
            doc["metadata"]["from_file"] = os.path.abspath(a.metadata_from)
            log(f"metadata part taken from {a.metadata_from}")
        elif "metadata" in a.parts:
            from .metadata import run_metadata
            doc["metadata"] = run_metadata(a.metadata_files,
                                           os.path.join(a.work, "metadata"), a.seed)
        doc["status"] = "ok"
    except BenchFailure as e:
        log(f"FAILED: {e}")
        code, doc["status"], doc["error"] = 1, "failed", str(e)
    except KeyboardInterrupt:
        code, doc["status"], doc["error"] = 130, "interrupted", "KeyboardInterrupt"
    except Exception as e:  # noqa: BLE001 - keep what was measured, say why it stopped
        traceback.print_exc()
        code, doc["status"], doc["error"] = 1, "failed", f"{type(e).__name__}: {e}"
    doc["total_seconds"] = round(time.perf_counter() - t_start, 1)
    doc["warnings"] += warnings_for(doc)
    doc["goals"] = goals(doc)
    write_json(out, doc)
    try:
        doc["charts"] = plots.plot_all(doc, os.path.splitext(out)[0])
    except Exception as e:  # noqa: BLE001 - charts are a convenience
        log(f"warning: no charts: {type(e).__name__}: {e}")
        doc["charts"] = []
    write_json(out, doc)
    md_text = markdown(doc)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(md_text + "\n")
    print(md_text)
    log(f"wrote {out}, {os.path.splitext(out)[0]}.md, charts: {', '.join(doc['charts'])}")
    return code


if __name__ == "__main__":
    sys.exit(main())
