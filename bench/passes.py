"""Passes over a dataset with a raw reader: the source directly vs dlcachefs.

For each thread count (``--threads 1,8``), in this order:

* ``direct cold``   the source directory, page cache dropped first;
* ``direct warm``   the same again at once (the source's pages are in memory);
* ``dlc pass1``     dlcachefs on a fresh cache directory, page cache dropped: every file
                    comes from the source and is written into chunks;
* ``dlc pass2``     the same mount after the chunk writer went idle, page cache dropped:
                    every file comes from the chunk logs (or the daemon's memory tier);
* ``dlc warm``      the same mount again at once, nothing dropped: cached files keep
                    their pages (``keep_cache``), so a file costs an OPEN and a RELEASE;
* ``dlc daemon-warm`` the mount's pages of every file dropped (fadvise, untimed), nothing
                    else: every read reaches the daemon, which serves it from its memory
                    tier; the like-for-like run against ``passthrough warm``;
* ``dlc remount``   after unmount + mount of the same cache, page cache dropped: served
                    from the logs, nothing from the source (``bytes_from_source`` 0);
* ``passthrough cold`` / ``passthrough warm``  ``bench.passthrough`` (a minimal pyfuse3
                    daemon) over the source, page cache dropped / not: every read reaches
                    it (it never keeps pages across opens). The floor of a Python FUSE
                    daemon; ``ratios`` compares dlcachefs with it per repetition.

Every file is read whole (``open(...).read()``) in one fixed random permutation
(``--order same``; ``--order epoch`` draws a new permutation per pass, as a shuffling
sampler does: then pass 2 no longer reads the logs in the order pass 1 wrote them). The
bytes of every run are hashed per file and compared with the first direct run (and with
the dataset's manifest): any difference aborts the benchmark with exit status 1.

Output: a JSON document (stdout and ``--out``), a markdown table (stdout), and when
matplotlib is there a bar chart of files/s next to the JSON (``--out`` with ``.png``).
Progress goes to stderr. See bench/README.md for what each number means.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time
import traceback

from . import make_dataset as md
from .mounting import DlcMount, dlcachefs_exe
from .passthrough import passthrough_mount
from .readers import READERS, ReadResult, read_all
from .util import (
    drop_page_cache,
    fs_of,
    machine_info,
    proc_cpu_seconds,
    tree_digest,
    write_json,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_WORK = os.path.join(REPO, "bench", "out", "passes")
DEFAULT_OUT = os.path.join(REPO, "bench", "results", "passes.json")
SYSTEMS = ("direct", "passthrough", "dlcachefs")


class BenchFailure(RuntimeError):
    """The benchmark found wrong behaviour (bytes differ, read errors): exit status 1."""


def log(msg: str) -> None:
    print(f"[passes {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----- the dataset and the order ---------------------------------------------------------

def prepare_dataset(a: argparse.Namespace) -> tuple[str, list[str], dict | None, dict]:
    """(source root, relative paths in name order, manifest or None, dataset info)."""
    if a.source:
        root = os.path.abspath(a.source)
        rels = []
        for dirpath, dirs, names in os.walk(root):
            dirs.sort()
            for n in sorted(names):
                p = os.path.join(dirpath, n)
                if os.path.isfile(p) and not os.path.islink(p):
                    rels.append(os.path.relpath(p, root))
        manifest = md.load_manifest(root)
        if manifest is not None:  # a tree of ours: read only the dataset, not the manifest
            rels = [r for r in rels if r != md.MANIFEST]
        if a.files:
            rels = rels[: a.files] if a.files < len(rels) else rels
        info = {"source": root, "made": False, "files": len(rels)}
    else:
        per_class = math.ceil((a.files or 3000) / a.classes)
        spec = md.Spec(classes=a.classes, per_class=per_class, seed=a.seed, mean_kb=a.mean_kb)
        root = os.path.join(a.work, f"dataset-c{spec.classes}-p{per_class}-s{spec.seed}-"
                                    f"m{spec.mean_kb:g}")
        log(f"dataset: {spec.files} files in {root}")
        t0 = time.perf_counter()
        manifest, reused = md.ensure_dataset(root, spec, progress=True)
        log(f"dataset {'reused' if reused else 'made'} in {time.perf_counter() - t0:.1f} s")
        rels = [r[0] for r in manifest["file_list"]]
        info = {"source": root, "made": not reused, "files": len(rels),
                "spec": manifest["spec"], "total_bytes": manifest["total_bytes"],
                "tree_digest": manifest["tree_digest"],
                "size_stats": manifest.get("size_stats"),
                "make_seconds": manifest.get("make_seconds") if not reused else None}
    if not rels:
        raise SystemExit(f"passes: no files under {root}")
    info["order"] = {"seed": a.seed, "mode": a.order}
    info["source_fs"] = fs_of(root)
    return root, rels, manifest, info


def reading_order(rels: list[str], seed: int, mode: str, epoch: int) -> list[str]:
    """The files in the order a pass reads them: one fixed random permutation for every
    pass (``same``), or a new one per pass like a shuffling sampler's epochs (``epoch``:
    pass k of a sequence uses permutation k, for every system and thread count)."""
    order = list(rels)
    random.Random(f"passes-order-{seed}" + (f"-epoch-{epoch}" if mode == "epoch" else "")
                  ).shuffle(order)
    return order


# ----- checking the bytes ------------------------------------------------------------------

class Checker:
    """Holds the reference bytes (size and hash of every file) and compares every run with
    them, file by file, whatever order the run read them in."""

    def __init__(self, manifest: dict | None) -> None:
        self.expected: dict[str, tuple[int, str]] | None = None
        self.reference_run: str | None = None
        self.digest: str | None = None
        self.manifest = None
        if manifest and "file_list" in manifest:
            self.manifest = {r[0]: (r[1], r[2]) for r in manifest["file_list"]}

    def check(self, label: str, rels: list[str], res: ReadResult) -> str:
        """Compare ``res`` (the files ``rels``, in that order) with the reference; the
        first run becomes the reference, after its own check against the manifest.
        Returns the run's digest. Raises BenchFailure when a file could not be read or
        its bytes differ."""
        if res.errors:
            shown = "; ".join(f"{rels[i]}: {m}" for i, m in res.errors[:5])
            raise BenchFailure(f"{label}: {len(res.errors)} files could not be read: {shown}")
        got = {r: (size, h) for r, size, h in zip(rels, res.sizes, res.hashes, strict=True)}
        digest = tree_digest((r, size, h) for r, (size, h) in got.items())
        if self.expected is None:
            if self.manifest is not None:
                bad = [r for r in rels if self.manifest.get(r) != got[r]]
                if bad:
                    raise BenchFailure(
                        f"{label}: {len(bad)} files differ from the dataset manifest, e.g. "
                        f"{bad[0]} (is the dataset directory damaged? delete it)")
            self.expected, self.reference_run, self.digest = got, label, digest
            return digest
        if digest != self.digest:
            bad = [r for r in self.expected if got.get(r) != self.expected[r]]
            ex = ", ".join(f"{r} (not read)" if r not in got else
                           f"{r} ({got[r][0]} bytes, expected {self.expected[r][0]}; hash "
                           f"{got[r][1][:12]}, expected {self.expected[r][1][:12]})"
                           for r in bad[:5])
            raise BenchFailure(f"{label}: {len(bad)} of {len(self.expected)} files differ "
                               f"from {self.reference_run}: {ex}")
        return digest


# ----- one run ---------------------------------------------------------------------------

def run_one(label: str, system: str, phase: str, threads: int, root: str, rels: list[str],
            checker: Checker, reader_name: str, drop: bool, mount: DlcMount | None,
            drop_roots: list[str], cpu_pid: int | None = None) -> dict:
    """Read every file of ``rels`` (in that order) under ``root`` once, after emptying the
    page cache when ``drop``; return the run's record."""
    page_cache = "warm"
    if drop:
        page_cache = drop_page_cache(drop_roots)
        if page_cache == "none":
            page_cache = "not dropped"
    paths = [os.path.join(root, r) for r in rels]
    probe = mount.probe_start() if mount else None
    cpu0 = proc_cpu_seconds(cpu_pid) if cpu_pid else None
    res = read_all(paths, threads, READERS[reader_name])
    cpu1 = proc_cpu_seconds(cpu_pid) if cpu_pid else None
    daemon = mount.probe_end(probe) if mount else None
    digest = checker.check(f"{label} x{threads}", rels, res)
    rec = {
        "label": label, "system": system, "phase": phase, "threads": threads,
        "page_cache": page_cache,
        **res.summary(),
        "digest": digest, "bytes_match_reference": True,
        "slowest": res.slowest(rels),
    }
    if daemon is not None:
        rec["dlcachefs"] = daemon
        rec["daemon_cpu_s"] = daemon["daemon_cpu_s"]
        ops = daemon["stats_delta"].get("fuse_ops")
        if isinstance(ops, dict):
            rec["fuse_requests_per_file"] = {k: round(v / len(rels), 2)
                                             for k, v in ops.items() if v}
    if cpu0 is not None and cpu1 is not None:
        rec["daemon_cpu_s"] = round(cpu1 - cpu0, 3)
    if rec.get("daemon_cpu_s") is not None:
        rec["daemon_cpu_ms_per_file"] = round(1000 * rec["daemon_cpu_s"] / len(rels), 3)
    d = rec.get("dlcachefs", {}).get("stats_delta", {})
    log(f"{label:<13} x{threads}: {rec['files_per_s']:>8.1f} files/s {rec['mb_per_s']:>7.1f} MB/s "
        f"p50 {rec['latency_ms']['p50']:.3f} ms p99 {rec['latency_ms']['p99']:.3f} ms"
        + (f" | from source {d.get('bytes_from_source', 0) / 1e6:.1f} MB, hits {d.get('hits')},"
           f" misses {d.get('misses')}, chunk_reads {d.get('chunk_reads')}, record_reads "
           f"{d.get('record_reads')}" if d else ""))
    return rec


def expectations(rec: dict, nfiles: int) -> list[str]:
    """Things that should hold for a run of this phase (reported, not fatal)."""
    d = rec.get("dlcachefs", {}).get("stats_delta")
    if d is None:
        return []
    out = []
    where = f"{rec['label']} x{rec['threads']}"
    opens = d.get("hits", 0) + d.get("misses", 0)
    if opens != nfiles:
        out.append(f"{where}: hits + misses = {opens}, expected {nfiles} (one open per file)")
    if rec["phase"] == "pass1" and d.get("misses") != nfiles:
        out.append(f"{where}: {d.get('misses')} misses on a fresh cache, expected {nfiles}")
    if rec["phase"] in ("pass2", "warm", "daemon-warm", "remount"):
        if d.get("bytes_from_source"):
            out.append(f"{where}: {d['bytes_from_source']} bytes from the source, expected 0")
        if d.get("misses"):
            out.append(f"{where}: {d['misses']} misses, expected 0")
    for k in ("checksum_failures", "stale_refetches", "source_errors", "cache_skipped",
              "write_errors"):
        if d.get(k):
            out.append(f"{where}: {k} = {d[k]}")
    return out


def drop_mount_pages(mnt: str, rels: list[str]) -> None:
    """Drop the mount's pages of every file (``posix_fadvise(DONTNEED)`` through the mount),
    nothing else: the next read of each reaches the daemon, whose memory tier is warm, and
    the kernel keeps its dentries (as the passthrough's warm run does)."""
    for r in rels:
        fd = os.open(os.path.join(mnt, r), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# ----- the whole benchmark -----------------------------------------------------------------

def parse_lists(a: argparse.Namespace) -> tuple[list[int], list[str]]:
    try:
        threads = [int(t) for t in a.threads.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"passes: bad --threads {a.threads!r}") from None
    if not threads or min(threads) < 1:
        raise SystemExit("passes: --threads needs counts >= 1")
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"passes: unknown system {s!r} (choose from {', '.join(SYSTEMS)})")
    return threads, systems


def new_doc(a: argparse.Namespace) -> dict:
    threads, systems = parse_lists(a)
    return {
        "benchmark": "passes",
        "status": "running",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv[1:],
        "machine": machine_info(REPO),
        "config": {"threads": threads, "systems": systems, "reader": a.reader,
                   "mount_args": a.mount_arg, "work": a.work,
                   "cache_fs": fs_of(a.work)},
        "runs": [],
        "mounts": [],
        "warnings": [],
    }


def run(a: argparse.Namespace, doc: dict) -> dict:
    """Fill ``doc`` with the runs (in place, so that a failure keeps what was done)."""
    threads, systems = doc["config"]["threads"], doc["config"]["systems"]
    os.makedirs(a.work, exist_ok=True)
    t_start = time.perf_counter()
    root, rels, manifest, info = prepare_dataset(a)
    doc["dataset"] = info
    checker = Checker(manifest)
    mnt = os.path.join(a.work, "mnt")
    runs = doc["runs"]
    exe = dlcachefs_exe() if "dlcachefs" in systems else None

    def add(rec: dict, rep: int) -> dict:
        rec["rep"] = rep
        runs.append(rec)
        return rec

    def order(epoch: int) -> list[str]:
        return reading_order(rels, a.seed, a.order, epoch)

    try:
        for rep in range(a.repeat):
            if a.repeat > 1:
                log(f"repetition {rep + 1} of {a.repeat}")
            if "direct" in systems:
                for t in threads:
                    add(run_one("direct cold", "direct", "cold", t, root, order(0), checker,
                                a.reader, True, None, [root]), rep)
                    add(run_one("direct warm", "direct", "warm", t, root, order(1), checker,
                                a.reader, False, None, [root]), rep)
            if "passthrough" in systems:
                for t in threads:
                    with passthrough_mount(root, mnt, read_ahead_kb=1024) as pid:
                        add(run_one("passthrough cold", "passthrough", "cold", t, mnt, order(0),
                                    checker, a.reader, True, None, [root], pid), rep)
                        add(run_one("passthrough warm", "passthrough", "warm", t, mnt, order(1),
                                    checker, a.reader, False, None, [root], pid), rep)
            if "dlcachefs" in systems:
                for t in threads:
                    cache = os.path.join(a.work, f"cache-x{t}")
                    shutil.rmtree(cache, ignore_errors=True)
                    drop_roots = [root, cache]
                    with DlcMount(root, mnt, cache, a.mount_arg, exe) as m:
                        log(f"mounted {mnt} (daemon {m.pid}, {m.mount_s:.2f} s, "
                            f"read_ahead_kb {m.read_ahead_kb})")
                        rec = add(run_one("dlc pass1", "dlcachefs", "pass1", t, mnt, order(0),
                                          checker, a.reader, True, m, drop_roots), rep)
                        rec["dlcachefs"]["writer_settle_s"] = round(m.wait_idle(), 3)
                        add(run_one("dlc pass2", "dlcachefs", "pass2", t, mnt, order(1),
                                    checker, a.reader, True, m, drop_roots), rep)
                        add(run_one("dlc warm", "dlcachefs", "warm", t, mnt, order(1),
                                    checker, a.reader, False, m, drop_roots), rep)
                        drop_mount_pages(mnt, rels)
                        add(run_one("dlc daemon-warm", "dlcachefs", "daemon-warm", t, mnt,
                                    order(1), checker, a.reader, False, m, drop_roots), rep)
                    doc["mounts"].append(_mount_info(m, t, rep, "pass1+pass2"))
                    with DlcMount(root, mnt, cache, a.mount_arg, exe) as m:
                        log(f"remounted {mnt} (daemon {m.pid}, {m.mount_s:.2f} s)")
                        add(run_one("dlc remount", "dlcachefs", "remount", t, mnt, order(2),
                                    checker, a.reader, True, m, drop_roots), rep)
                    doc["mounts"].append(_mount_info(m, t, rep, "remount"))
                    if not a.keep_cache:
                        shutil.rmtree(cache, ignore_errors=True)
        doc["status"] = "ok"
    finally:
        for r in runs:
            doc["warnings"] += expectations(r, len(rels))
        doc["reference_digest"] = checker.digest
        doc["total_seconds"] = round(time.perf_counter() - t_start, 2)
        doc["summary"] = summarize(runs)
        doc["ratios"] = ratios(runs)
    return doc


#: (numerator run, denominator run): the comparisons issue 11 asks for, per repetition
RATIOS = (("dlc daemon-warm", "passthrough warm"), ("dlc warm", "passthrough warm"),
          ("dlc pass2", "passthrough warm"),
          ("dlc pass2", "passthrough cold"), ("dlc pass2", "direct cold"),
          ("dlc warm", "direct cold"))


def ratios(runs: list[dict]) -> list[dict]:
    """files/s of one run over another's, per thread count, for every repetition (so that
    "every run" can be checked: ``min``), with the median."""
    by = {(r["label"], r["threads"], r.get("rep", 0)): r["files_per_s"] for r in runs}
    out = []
    for num, den in RATIOS:
        for t in sorted({r["threads"] for r in runs}):
            vals = [round(by[(num, t, rep)] / by[(den, t, rep)], 3)
                    for (lab, th, rep) in sorted(by) if lab == num and th == t
                    and (den, t, rep) in by and by[(den, t, rep)]]
            if vals:
                s = sorted(vals)
                out.append({"ratio": f"{num} / {den}", "threads": t, "per_rep": vals,
                            "median": s[(len(s) - 1) // 2], "min": s[0]})
    return out


def summarize(runs: list[dict]) -> list[dict]:
    """Per (run label, threads): the repetition with the median files/s (its index in
    ``runs``, so that every number shown comes from one real run) and the range."""
    groups: dict[tuple[str, int], list[int]] = {}
    for i, r in enumerate(runs):
        groups.setdefault((r["label"], r["threads"]), []).append(i)
    out = []
    for (label, t), idx in groups.items():
        by_speed = sorted(idx, key=lambda i: runs[i]["files_per_s"])
        fps = [runs[i]["files_per_s"] for i in by_speed]
        out.append({"label": label, "threads": t, "reps": len(idx),
                    "median_run": by_speed[(len(by_speed) - 1) // 2],
                    "files_per_s_median": fps[(len(fps) - 1) // 2],
                    "files_per_s_min": fps[0], "files_per_s_max": fps[-1]})
    return out


def _mount_info(m: DlcMount, threads: int, rep: int, used_for: str) -> dict:
    return {"threads": threads, "rep": rep, "used_for": used_for, "mount_s": _r(m.mount_s),
            "umount_s": _r(m.umount_s), "read_ahead_kb": m.read_ahead_kb}


def _r(x: float | None) -> float | None:
    return round(x, 3) if x is not None else None


# ----- reporting -------------------------------------------------------------------------

def markdown(doc: dict) -> str:
    cols = ["run", "thr", "files/s", "MB/s", "p50 ms", "p99 ms", "max ms", "wall s",
            "src MB", "hits", "misses", "chunk_reads", "record_reads", "daemon CPU s",
            "daemon CPU ms/file", "FUSE requests/file", "daemon peak RSS MB"]
    summary = doc.get("summary") or summarize(doc["runs"])
    reps = max((g["reps"] for g in summary), default=1)
    if reps > 1:
        cols.insert(3, "files/s range")
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for g in summary:
        r = doc["runs"][g["median_run"]]
        d = r.get("dlcachefs")
        s = d["stats_delta"] if d else {}

        def v(key, d=d, s=s):
            return "" if d is None else str(s.get(key, ""))

        lat = r["latency_ms"]
        row = [r["label"], str(r["threads"]), f"{r['files_per_s']:.0f}", f"{r['mb_per_s']:.1f}",
               f"{lat['p50']:.3f}", f"{lat['p99']:.3f}", f"{lat['max']:.1f}",
               f"{r['wall_s']:.2f}",
               "" if d is None else f"{s.get('bytes_from_source', 0) / 1e6:.1f}",
               v("hits"), v("misses"), v("chunk_reads"), v("record_reads"),
               "" if r.get("daemon_cpu_s") is None else f"{r['daemon_cpu_s']:.2f}",
               "" if r.get("daemon_cpu_ms_per_file") is None
               else f"{r['daemon_cpu_ms_per_file']:.3f}",
               " ".join(f"{k} {v:g}" for k, v in r.get("fuse_requests_per_file", {}).items()),
               "" if d is None else f"{d['daemon_peak_rss_mb']:.0f}"]
        if reps > 1:
            row.insert(3, f"{g['files_per_s_min']:.0f}-{g['files_per_s_max']:.0f}")
        lines.append("| " + " | ".join(row) + " |")
    ds = doc.get("dataset", {})
    m = doc["machine"]
    lines.append("")
    lines.append(f"{ds.get('files')} files, {ds.get('total_bytes', 0) / 1e6:.0f} MB "
                 f"({m['cpu_model']}, {m['cpus_usable']} CPUs, {m['memory_gb']} GB, "
                 f"kernel {m['kernel']}); reader `{doc['config']['reader']}`; "
                 "page cache dropped before every run but `direct warm`, `passthrough warm` "
                 "and `dlc warm`; "
                 f"order `{doc['dataset'].get('order', {}).get('mode')}`"
                 + (f"; median of {reps} repetitions by files/s." if reps > 1 else "."))
    if doc.get("ratios"):
        lines += ["", "| ratio (files/s) | threads | per repetition | median | min |",
                  "|---|---|---|---|---|"]
        for q in doc["ratios"]:
            lines.append(f"| {q['ratio']} | {q['threads']} | "
                         f"{', '.join(f'{x:.2f}' for x in q['per_rep'])} | {q['median']:.2f} | "
                         f"{q['min']:.2f} |")
    return "\n".join(lines)


def plot(doc: dict, path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    summary = doc.get("summary") or summarize(doc["runs"])
    labels: list[str] = []
    for g in summary:
        if g["label"] not in labels:
            labels.append(g["label"])
    threads = sorted({g["threads"] for g in summary})
    if not labels:
        return None
    width = 0.8 / len(threads)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels)), 4.2))
    for k, t in enumerate(threads):
        xs, vals, lo, hi = [], [], [], []
        for i, lab in enumerate(labels):
            g = next((g for g in summary if g["label"] == lab and g["threads"] == t), None)
            if g is None:
                continue
            xs.append(i + (k - (len(threads) - 1) / 2) * width)
            vals.append(g["files_per_s_median"])
            lo.append(g["files_per_s_median"] - g["files_per_s_min"])
            hi.append(g["files_per_s_max"] - g["files_per_s_median"])
        bars = ax.bar(xs, vals, width, label=f"{t} thread{'s' if t > 1 else ''}",
                      yerr=[lo, hi] if any(lo) or any(hi) else None, capsize=3)
        ax.bar_label(bars, fmt="%.0f", fontsize=7, padding=9)
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("files/s, log scale (higher is better)")
    ds = doc.get("dataset", {})
    ax.set_title(f"Raw reader, {ds.get('files')} files of ~"
                 f"{ds.get('total_bytes', 0) / max(1, ds.get('files', 1)) / 1e3:.0f} KB: "
                 "source vs dlcachefs", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.passes",
        description="Raw-reader passes over a dataset: the source directory (cold, warm) vs "
                    "dlcachefs (pass 1 cold, pass 2 from the logs, after a remount). Checks "
                    "that every byte read through the mount equals the source.")
    p.add_argument("--files", type=int, default=None,
                   help="dataset size in files (default 3000; with --source: the first N "
                        "files in name order, default all)")
    p.add_argument("--classes", type=int, default=10,
                   help="class directories of the generated dataset (default 10)")
    p.add_argument("--mean-kb", type=float, default=110.0,
                   help="mean file size of the generated dataset, KB (default 110)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the generated dataset and of the reading order (default 0)")
    p.add_argument("--source", metavar="DIR",
                   help="use this existing directory as the dataset instead of generating one")
    p.add_argument("--threads", default="1,8",
                   help="comma-separated reader thread counts (default 1,8)")
    p.add_argument("--systems", default="direct,passthrough,dlcachefs",
                   help="what to measure, comma-separated: direct, passthrough, dlcachefs "
                        "(default all three)")
    p.add_argument("--order", choices=["same", "epoch"], default="same",
                   help="reading order of the passes: one fixed random permutation for all "
                        "(same, default), or a new permutation per pass (epoch)")
    p.add_argument("--reader", choices=sorted(READERS), default="python",
                   help="how a file is read (default python: open(...).read())")
    p.add_argument("--mount-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for `dlcachefs mount`, repeatable, e.g. "
                        "--mount-arg=--memory=64M")
    p.add_argument("--work", default=DEFAULT_WORK,
                   help="work directory: dataset, cache directories, mountpoint "
                        "(default bench/out/passes)")
    p.add_argument("--repeat", type=int, default=3,
                   help="repeat the whole sequence N times; the table shows the median run "
                        "(default 3)")
    p.add_argument("--keep-cache", action="store_true",
                   help="keep the cache directories after the runs")
    p.add_argument("--out", default=DEFAULT_OUT,
                   help="where to write the JSON (default bench/results/passes.json); the "
                        "chart goes next to it as .png")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    a.work = os.path.abspath(a.work)
    if a.files is not None and a.files < 1:
        raise SystemExit("passes: --files must be >= 1")
    if a.repeat < 1:
        raise SystemExit("passes: --repeat must be >= 1")
    doc = new_doc(a)
    code = 0
    try:
        run(a, doc)
    except BenchFailure as e:
        log(f"FAILED: {e}")
        code, doc["status"], doc["error"] = 1, "failed", str(e)
    except KeyboardInterrupt:
        log("interrupted")
        code, doc["status"], doc["error"] = 130, "interrupted", "KeyboardInterrupt"
    except Exception as e:  # noqa: BLE001 - keep what was measured, say why it stopped
        traceback.print_exc()
        code, doc["status"], doc["error"] = 1, "failed", f"{type(e).__name__}: {e}"
    out = os.path.abspath(a.out)
    write_json(out, doc)  # first: a failing chart must not lose the numbers
    if code == 0:
        try:
            doc["chart"] = plot(doc, os.path.splitext(out)[0] + ".png")
        except Exception as e:  # noqa: BLE001 - the chart is a convenience
            log(f"warning: no chart: {type(e).__name__}: {e}")
            doc["chart"] = None
        write_json(out, doc)
    print(json.dumps(doc, indent=2))
    if doc["runs"]:
        print()
        print(markdown(doc))
    for w in doc["warnings"]:
        log(f"warning: {w}")
    log(f"wrote {out}" + (f" and {doc['chart']}" if doc.get("chart") else ""))
    return code


if __name__ == "__main__":
    sys.exit(main())
