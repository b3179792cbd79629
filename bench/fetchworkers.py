"""Daemon CPU per file fetched ahead by prefetch, with and without ``--fetch-workers``.

    .venv/bin/python -m bench.fetchworkers [--files 1000] [--workers 0,2]
        [--phases prefetch,misses,scan,scanread] [--out JSON]

A tree of ``--files`` random files of 60-160 KB on local disk (made once under
``--work``). For each value of ``--workers``, a fresh mount on an empty cache
(``--scan-ahead 0``), then three phases, each with the daemon's CPU (``/proc``, the
daemon's process only: fetch workers are counted apart) and wall time:

* ``prefetch``: an explicit order of every file is announced through the control file
  and nothing reads: the stream's prefetch fetches the whole epoch (at most
  ``prefetchloop.LEAD`` samples ahead of a reader that has not started: keep
  ``--files`` at or below it) and the writer seals it; ends when ``prefetched`` reaches
  the file count and nothing is pending;
* ``hits``: 8 threads read every file in the announced order (the cached files through
  FUSE: the FUSE cost of a hit);
* ``misses``: another fresh mount, nothing announced, 8 threads read every file (each
  open a miss the reader waits on through FUSE).

Two more phases (``--phases``), each on a fresh mount with scan-ahead on (its default) and
nothing announced, so that the reads are a reader group's with no known order:

* ``scan``: the daemon's cost per file scan-ahead fetches. A reader opens
  ``scanahead.MIN_OPENS`` files picked at random over the classes (so the tree is the
  whole dataset), then only re-opens its first file (a hit) every ``KEEP_S`` seconds to
  stay active while scan-ahead fetches the rest; ``files_per_s``: files scanned ahead per
  second until the tree is done (``scan_s``, from the reader's first open); the CPU window
  goes on until the writer holds nothing more (``wall_s``), and includes the reader's
  first misses (through FUSE), the re-opens and the stats reads; ``daemon_ms_per_file``
  is per file scanned ahead;
* ``scanread``: a ``cat``-like reader (one thread) reads every file in directory order
  while scan-ahead runs ahead of it: files/s of the reader (``read_s``) and daemon CPU
  per file read (FUSE included; until the writer holds nothing more), the files
  scan-ahead fetched and how many the workers wrote.

The page cache is not dropped system-wide (nothing here needs root, and other runs may
measure at the same time): the source files' own pages are dropped before each phase
(``POSIX_FADV_DONTNEED``), so every source read goes to the disk. The ``misses`` phase
ends when the writer has sealed everything. Every byte read is compared with the source.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from dlcachefs.cache.scanahead import MIN_OPENS

from .mounting import DlcMount
from .util import proc_cpu_seconds, write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_WORK = os.path.join(REPO, "bench", "out", "fetchworkers")
PHASES = ("prefetch", "misses", "scan", "scanread")
KEEP_S = 0.5  # the scan phase's reader re-opens a file this often (below scanahead.IDLE_S)


def log(msg: str) -> None:
    print(f"[fetchworkers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_tree(root: str, n: int, seed: int = 0) -> list[str]:
    """``n`` files of 60-160 KB in 10 class directories; their paths in ImageFolder order."""
    rng = random.Random(seed)
    rels = [f"c{i % 10:02d}/f{i:06d}.jpg" for i in range(n)]
    done = os.path.join(root, ".done")
    if not os.path.exists(done) or _text(done) != str(n):
        shutil.rmtree(root, ignore_errors=True)
        for rel in rels:
            p = os.path.join(root, rel)
            os.makedirs(os.path.dirname(p), exist_ok=True)
            with open(p, "wb") as f:
                f.write(rng.randbytes(rng.randint(60_000, 160_000)))
        with open(done, "w") as f:
            f.write(str(n))
    return sorted(rels, key=lambda r: (os.path.dirname(r), os.path.basename(r)))


def _text(path: str) -> str:
    with open(path) as f:
        return f.read()


def digests(root: str, rels: list[str]) -> dict[str, str]:
    out = {}
    for r in rels:
        with open(os.path.join(root, r), "rb") as f:
            out[r] = hashlib.blake2b(f.read(), digest_size=16).hexdigest()
    return out


def read_all(root: str, rels: list[str], want: dict[str, str], threads: int = 8) -> None:
    def one(r: str) -> None:
        with open(os.path.join(root, r), "rb") as f:
            got = hashlib.blake2b(f.read(), digest_size=16).hexdigest()
        if got != want[r]:
            raise SystemExit(f"wrong bytes for {r}")
    with ThreadPoolExecutor(threads) as ex:
        list(ex.map(one, rels))


def evict_source(root: str, rels: list[str]) -> None:
    """Drop the source files' pages (theirs only: ``POSIX_FADV_DONTNEED``), so that every
    source read goes to the disk, as in a first epoch."""
    for r in rels:
        fd = os.open(os.path.join(root, r), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def control(mnt: str, text: str) -> None:
    fd = os.open(os.path.join(mnt, ".dlcache", "control"), os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def announce(mnt: str, n: int, order: list[int]) -> None:
    lines = ["job b", "dataset .", "sampler explicit"]
    for k in range(0, n, 500):
        lines.append(f"order 0 {k} " + " ".join(map(str, order[k:k + 500])))
    lines.append(f"order 0 end {n}")
    text = "\n".join(lines) + "\n"
    # the control file takes at most 64 KiB per write: whole lines per write
    buf = ""
    for line in text.splitlines(keepends=True):
        if len(buf) + len(line) > 60_000:
            control(mnt, "job b\n" + buf if not buf.startswith("job") else buf)
            buf = ""
        buf += line
    control(mnt, (buf if buf.startswith("job") else "job b\n" + buf) + "epoch 0\n")


def workers_cpu(m: DlcMount) -> float:
    """CPU seconds of the daemon's fetch workers (as its stats list them)."""
    pool = m.stats().get("fetch_workers") or {}
    return sum(proc_cpu_seconds(pid) or 0.0 for pid in pool.get("pids", []))


def phase(m: DlcMount, fn, n: int) -> dict:
    c0, w0, t0 = proc_cpu_seconds(m.pid), workers_cpu(m), time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    cpu, wcpu = proc_cpu_seconds(m.pid) - c0, workers_cpu(m) - w0
    return {"wall_s": round(wall, 3), "daemon_cpu_s": round(cpu, 3),
            "daemon_ms_per_file": round(1000 * cpu / n, 3),
            "workers_cpu_s": round(wcpu, 3), "files_per_s": round(n / wall, 1)}


def scan_done(st: dict) -> bool:
    """Scan-ahead's trees are finished (what they fetched may wait for the writer)."""
    trees = st.get("scan_ahead") or {}
    return bool(trees) and all(t.get("state") not in ("listing", "scanning", "paused")
                               for t in trees.values())


def scan_phase(m: DlcMount, mnt: str, rels: list[str], want: dict[str, str]) -> dict:
    """The ``scan`` phase (see the module doc): the cost per file scanned ahead."""
    first = random.Random(2).sample(rels, MIN_OPENS)
    c0, w0, t0 = proc_cpu_seconds(m.pid), workers_cpu(m), time.perf_counter()
    read_all(mnt, first, want, threads=1)
    last = time.monotonic()
    while not scan_done(m.stats()):  # (a stats read: ~0.4 ms of the daemon's CPU)
        if time.perf_counter() - t0 > 600:
            raise SystemExit("scan-ahead did not finish")
        if time.monotonic() - last > KEEP_S:
            read_all(mnt, first[:1], want, threads=1)  # stay active: a hit
            last = time.monotonic()
        time.sleep(0.05)
    scan_s = time.perf_counter() - t0
    # (the daemon's writer seals what it holds after its flush interval: waited for, in
    # the CPU counted, not in files/s)
    m.wait_stats(lambda s: s.get("pending_bytes", 1) == 0, "the writer did not drain",
                 timeout=600)
    wall = time.perf_counter() - t0
    cpu, wcpu = proc_cpu_seconds(m.pid) - c0, workers_cpu(m) - w0
    st = m.stats()
    k = max(st.get("scan_ahead_files", 0), 1)
    out = {"scan_s": round(scan_s, 3), "wall_s": round(wall, 3),
           "daemon_cpu_s": round(cpu, 3), "daemon_ms_per_file": round(1000 * cpu / k, 3),
           "workers_cpu_s": round(wcpu, 3), "workers_ms_per_file": round(1000 * wcpu / k, 3),
           "files_per_s": round(k / scan_s, 1)}
    return out | scan_counts(st)


def scanread_phase(m: DlcMount, mnt: str, rels: list[str], want: dict[str, str]) -> dict:
    """The ``scanread`` phase (see the module doc): a ``cat`` of the tree in its order."""
    c0, w0, t0 = proc_cpu_seconds(m.pid), workers_cpu(m), time.perf_counter()
    read_all(mnt, rels, want, threads=1)
    read_s = time.perf_counter() - t0
    m.wait_stats(lambda s: s.get("pending_bytes", 1) == 0, "the writer did not drain",
                 timeout=600)
    wall = time.perf_counter() - t0
    cpu, wcpu = proc_cpu_seconds(m.pid) - c0, workers_cpu(m) - w0
    n = len(rels)
    out = {"read_s": round(read_s, 3), "wall_s": round(wall, 3),
           "daemon_cpu_s": round(cpu, 3), "daemon_ms_per_file": round(1000 * cpu / n, 3),
           "workers_cpu_s": round(wcpu, 3), "files_per_s": round(n / read_s, 1)}
    return out | scan_counts(m.stats())


def scan_counts(st: dict) -> dict:
    """Files scanned ahead, how many of them the workers wrote, and the reader's misses."""
    pool = st.get("fetch_workers") or {}
    return {"scanned": st.get("scan_ahead_files", 0), "by_workers": pool.get("scan_ahead", 0),
            "pool_fallbacks": pool.get("fallbacks", 0), "pool_jobs": pool.get("jobs", 0),
            "misses": st.get("misses"),
            "fetch_waits": st.get("fetch_waits"),
            "trees": {k: (v.get("state"), v.get("files"))
                      for k, v in (st.get("scan_ahead") or {}).items()}}


def run_one(a: argparse.Namespace, src: str, rels: list[str], want: dict[str, str],
            workers: int) -> dict:
    n = len(rels)
    out: dict = {"workers": workers}
    order = random.Random(1).sample(range(n), n)
    for label in a.phases:
        args = ["--cache-size", "4G"]
        if label in ("prefetch", "misses"):
            args += ["--scan-ahead", "0"]
        if workers:
            args += ["--fetch-workers", str(workers)]
        cache = os.path.join(a.work, f"cache-{workers}-{label}")
        mnt = os.path.join(a.work, f"mnt-{workers}-{label}")
        shutil.rmtree(cache, ignore_errors=True)
        os.makedirs(mnt, exist_ok=True)
        with DlcMount(src, mnt, cache, args) as m:
            m.wait_idle()
            evict_source(src, rels)
            if label == "scan":
                out["scan"] = scan_phase(m, mnt, rels, want)
            elif label == "scanread":
                out["scanread"] = scanread_phase(m, mnt, rels, want)
            elif label == "prefetch":
                def pre(mnt: str = mnt, m: DlcMount = m) -> None:
                    announce(mnt, n, order)
                    m.wait_stats(lambda s: s.get("prefetched", 0) >= n
                                 and s.get("pending_bytes", 1) == 0,
                                 "prefetch did not finish", timeout=600)
                out["prefetch"] = phase(m, pre, n)
                st = m.stats()
                out["prefetch"]["prefetched"] = st.get("prefetched")
                out["prefetch"]["fetch_workers"] = st.get("fetch_workers")
                ordered = [rels[i] for i in order]
                out["hits"] = phase(m, lambda mnt=mnt, o=ordered: read_all(mnt, o, want), n)
                out["hits"]["misses"] = m.stats().get("misses")
            else:
                def miss(mnt: str = mnt, m: DlcMount = m) -> None:
                    read_all(mnt, rels, want)
                    m.wait_idle()
                out["misses"] = phase(m, miss, n)
                out["misses"]["misses"] = m.stats().get("misses")
        log(f"workers={workers} {label}: {json.dumps(out)}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--files", type=int, default=1000)
    p.add_argument("--workers", default="0,2")
    p.add_argument("--phases", default=",".join(PHASES),
                   help=f"comma-separated, of {', '.join(PHASES)}")
    p.add_argument("--work", default=DEFAULT_WORK)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    a.phases = [x for x in a.phases.split(",") if x]
    if not a.phases or set(a.phases) - set(PHASES):
        p.error(f"--phases: some of {', '.join(PHASES)}")
    os.makedirs(a.work, exist_ok=True)
    src = os.path.join(a.work, "src")
    rels = make_tree(src, a.files)
    want = digests(src, rels)
    runs = [run_one(a, src, rels, want, int(w)) for w in a.workers.split(",")]
    doc = {"files": a.files, "runs": runs}
    print(json.dumps(doc, indent=1))
    if a.out:
        write_json(a.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
