"""FUSE requests and daemon CPU per cached file, for a reader that is not under
``dlcachefs run`` (every open goes through the mount).

    .venv/bin/python -m bench.requests [--files 1500] [--threads 1] [--repeat 3]
        [--mount-arg=--memory=16M] [--core-rev REV | --exe PATH]
        [--out bench/results/requests.json]

Makes (or reuses) a tree of ``--files`` random files of 60-160 KB in ``bench/out/requests``,
mounts it on an empty cache, reads every file once (fetched from the source), waits for
the chunk writer to seal everything, then runs ``--repeat`` times, each over the files in
one fixed random order (``open(path, "rb").read()``, ``--threads`` readers):

* ``logs``   the mount's pages of every file dropped first (``posix_fadvise(DONTNEED)``
             through the mount, untimed and not counted), and the cache directory's log
             files' pages too: every READ reaches the daemon, which serves it from its
             memory tier or the chunk logs (``--mount-arg=--memory=16M`` keeps most of it
             on the logs);
* ``paged``  at once again: the kernel holds every file's pages (``keep_cache``);
* ``logs-paged`` the mount's pages dropped again, not the logs': the READs reach the
             daemon, whose log reads find their pages in memory.

For each pass: the requests per file by opcode (``fuse_ops`` in stats; FUSE_IOCTL, which
libfuse answers itself, is not counted there), the LMDB read transactions per file
(``index_reads``, when the daemon counts them), and the daemon's CPU (its threads' run
time, ``/proc/PID/task/*/schedstat``) per file, less what the stats reads cost (measured apart) and
what it spends idle meanwhile. Medians over the repetitions. Every file's bytes are
compared with the source's. Drops no page cache but the mount's and the cache
directory's (safe beside other work); needs no root.

``--core-rev REV`` runs the daemon of a committed revision (the "before" side), ``--exe``
another installed ``dlcachefs``. Prints a JSON document (and writes ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import statistics
import sys
import time

from dlcachefs.testing.mounting import wait_until

from .mounting import DlcMount, dlcachefs_exe
from .readers import read_all
from .util import file_hash, machine_info, proc_cpu_seconds, write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_WORK = os.path.join(REPO, "bench", "out", "requests")


def cpu_ns(pid: int) -> tuple[int, frozenset[str]]:
    """CPU time the process's live threads have run, in nanoseconds
    (``/proc/PID/task/*/schedstat``: user and system alike, exact, where
    ``/proc/PID/stat`` counts 10 ms ticks), and their ids: a thread that ends takes its
    time with it (trio's idle worker threads end after 10 s), so a difference is good only
    when no thread of the first reading has gone (:func:`cpu_between`)."""
    total, tids = 0, []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue
        tids.append(tid)
    return total, frozenset(tids)


class CpuMark:
    """A reading of the daemon's CPU: exact (:func:`cpu_ns`) and in ticks."""

    def __init__(self, pid: int) -> None:
        self.ns, self.tids = cpu_ns(pid)
        self.ticks_s = proc_cpu_seconds(pid) or 0.0


def cpu_between(a: CpuMark, b: CpuMark) -> float:
    """Seconds of CPU from ``a`` to ``b``: exact when every thread of ``a`` still ran at
    ``b``, else from the ticks (which keep the time of threads that ended)."""
    if a.tids <= b.tids:
        return (b.ns - a.ns) / 1e9
    return b.ticks_s - a.ticks_s


def log(msg: str) -> None:
    print(f"[requests {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_tree(root: str, files: int, seed: int) -> list[str]:
    """``files`` random files of 60-160 KB in 20 directories (reused when present);
    their relative paths."""
    rng = random.Random(seed)
    rels = [f"c{i % 20:02d}/{i:06d}.bin" for i in range(files)]
    done = os.path.join(root, ".complete")
    if os.path.exists(done):
        return rels
    shutil.rmtree(root, ignore_errors=True)
    for rel in rels:
        p = os.path.join(root, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(rng.randbytes(rng.randint(60_000, 160_000)))
    open(done, "w").close()
    return rels


def fadvise_dontneed(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def log_files(cache: str) -> list[str]:
    out = []
    for dirpath, _dirs, names in os.walk(cache):
        out += [os.path.join(dirpath, n) for n in names if re.match(r"^\d{8,}\.log$", n)]
    return out


class Probe:
    """The daemon's counters and CPU around a pass, the cost of reading them taken out."""

    def __init__(self, m: DlcMount) -> None:
        self.m = m
        assert m.pid is not None
        self.pid = m.pid
        # what one read of the stats costs the daemon, and its CPU per second when idle
        n = 20
        c0 = CpuMark(self.pid)
        for _ in range(n):
            m.stats()
        self.stats_cpu = cpu_between(c0, CpuMark(self.pid)) / n
        c0, t0 = CpuMark(self.pid), time.perf_counter()
        time.sleep(2.0)
        self.idle_cpu_per_s = cpu_between(c0, CpuMark(self.pid)) / (time.perf_counter() - t0)

    def run(self, paths: list[str], threads: int, expect: dict[str, str]) -> dict:
        s0 = self.m.stats()
        c0, t0 = CpuMark(self.pid), time.perf_counter()
        res = read_all(paths, threads)
        polls = [0]

        def released() -> dict | None:
            polls[0] += 1
            st = self.m.stats()
            done = st["fuse_ops"]["release"] - s0["fuse_ops"]["release"] >= len(paths)
            return st if done else None

        s1 = wait_until(released, "the pass's releases", interval=0.05)
        c1, t1 = CpuMark(self.pid), time.perf_counter()
        if res.errors:
            raise SystemExit(f"requests: {len(res.errors)} files failed: {res.errors[:3]}")
        bad = [p for p, h in zip(paths, res.hashes, strict=True) if expect[p] != h]
        if bad:
            raise SystemExit(f"requests: {len(bad)} files differ from the source: {bad[:3]}")
        n = len(paths)
        ops = {k: v - s0["fuse_ops"].get(k, 0) for k, v in s1["fuse_ops"].items()}
        ops.pop("dlcache", None)  # the stats reads themselves
        raw = cpu_between(c0, c1)
        cpu = raw - polls[0] * self.stats_cpu - self.idle_cpu_per_s * (t1 - t0)
        out = {
            "files_per_s": round(n / res.wall_s, 1),
            "requests_per_file": {k: round(v / n, 3) for k, v in sorted(ops.items()) if v},
            "requests_per_file_total": round(sum(ops.values()) / n, 3),
            "daemon_cpu_ms_per_file": round(1000 * cpu / n, 4),
            "daemon_cpu_ms_per_file_raw": round(1000 * raw / n, 4),
            "cpu_exact": c0.tids <= c1.tids,  # (else from 10 ms ticks)
        }
        for k in ("index_reads", "index_memo_hits", "hits", "misses", "chunk_reads", "record_reads",
                  "record_reads_in_memory",
                  "page_cache_opens", "bytes_from_source"):
            if k in s1 and isinstance(s1[k], (int, float)):
                out[k + "_per_file"] = round((s1[k] - s0.get(k, 0)) / n, 3)
        return out


def median_of(runs: list[dict]) -> dict:
    """Per key, the median over the repetitions (numbers and dicts of numbers)."""
    out: dict = {}
    for k, v in runs[0].items():
        if isinstance(v, dict):
            keys = sorted({kk for r in runs for kk in r[k]})
            out[k] = {kk: round(statistics.median(r[k].get(kk, 0) for r in runs), 3)
                      for kk in keys}
        else:
            out[k] = round(statistics.median(r[k] for r in runs), 4)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.requests",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=1500)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--work", default=DEFAULT_WORK)
    ap.add_argument("--mount-arg", action="append", default=[],
                    help="an option for dlcachefs mount (repeatable)")
    ap.add_argument("--exe", default=None, help="the dlcachefs executable (default: the venv's)")
    ap.add_argument("--core-rev", default=None, metavar="REV",
                    help="run the daemon of this committed revision (git archive)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    root = os.path.join(a.work, f"tree-{a.files}-s{a.seed}")
    rels = make_tree(root, a.files, a.seed)
    expect_src = {}
    for r in rels:
        with open(os.path.join(root, r), "rb") as f:
            expect_src[r] = file_hash(f.read())
    mnt, cache = os.path.join(a.work, "mnt"), os.path.join(a.work, "cache")
    shutil.rmtree(cache, ignore_errors=True)
    order = list(rels)
    random.Random(a.seed).shuffle(order)
    exe = a.exe or dlcachefs_exe()
    if a.core_rev:
        from pathlib import Path  # noqa: PLC0415

        from .fidelity import core_from_rev  # noqa: PLC0415

        exe, _core = core_from_rev(a.core_rev, Path(a.work))
    doc: dict = {"benchmark": "requests", "argv": sys.argv[1:], "exe": exe,
                 "core_rev": a.core_rev,
                 "machine": machine_info(REPO), "files": a.files, "threads": a.threads,
                 "mount_args": a.mount_arg}
    with DlcMount(root, mnt, cache, a.mount_arg, exe) as m:
        paths = [os.path.join(mnt, r) for r in order]
        expect = {os.path.join(mnt, r): expect_src[r] for r in rels}
        probe = Probe(m)
        doc["stats_read_cpu_ms"] = round(1000 * probe.stats_cpu, 3)
        doc["idle_cpu_ms_per_s"] = round(1000 * probe.idle_cpu_per_s, 3)
        log(f"mounted (daemon {m.pid}); first pass from the source")
        doc["cold"] = probe.run(paths, a.threads, expect)
        m.wait_idle()
        m.wait_cached(len(rels), timeout=120)
        runs: dict[str, list[dict]] = {"logs": [], "paged": [], "logs-paged": []}
        for rep in range(a.repeat):
            fadvise_dontneed(paths)
            fadvise_dontneed(log_files(str(m.cache)))
            runs["logs"].append(probe.run(paths, a.threads, expect))
            runs["paged"].append(probe.run(paths, a.threads, expect))
            fadvise_dontneed(paths)
            runs["logs-paged"].append(probe.run(paths, a.threads, expect))
            log(f"repetition {rep + 1}: daemon CPU ms per file: " + ", ".join(
                f"{k} {v[-1]['daemon_cpu_ms_per_file']}" for k, v in runs.items()))
        doc["runs"] = runs
        doc["median"] = {k: median_of(v) for k, v in runs.items()}
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out:
        write_json(a.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
