"""Warming a cache before training: ``dlcachefs warmup`` against reading the tree with
``cat``, side by side in one run, over a slow source; and the cost of a metrics scrape.

    sudo .venv/bin/python -m bench.warmup [--files 600] [--delay-ms 5] [--jobs 1,8]
                                          [--out bench/results/warmup.json]

One JPEG ImageFolder dataset (``bench.make_dataset``, ~110 KB files) behind
``bench.passthrough --delay-ms`` (every open of the source waits ``--delay-ms``: an
object store's or a far NFS server's per-request latency), with dlcachefs mounted over
it, a fresh cache directory for each method:

* ``cat``: ``find MNT -type f -print0 | xargs -0 cat > /dev/null`` (what people do);
* ``cat -P8``: the same with ``xargs -P 8 -n 16`` (8 cats at once);
* ``warmup -jN``: ``dlcachefs warmup MNT --jobs N`` per ``--jobs``; then the same command
  again (``resume``: everything cached, nothing should be fetched or opened).

Per method: wall seconds until the daemon has sealed everything (``pending_bytes`` 0),
files/s, MB/s, bytes read from the source, files cached. Then every file is read back
through the mount and hashed against the dataset's manifest: ``misses`` must be 0 (all
warmed) and the bytes equal, else ``"status": "failed"`` and exit status 1. ``ratios``:
each method's wall time against ``cat``'s. The ``warmup -j8`` mount also serves
``--metrics-port``: ``scrape_ms`` is the median and max of 20 scrapes of ``/metrics``.

Needs root for dropping the page cache between methods (without it the source's pages
stay warm, which favours nobody: every method reads through the delayed passthrough).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

from . import make_dataset as md
from .mounting import DlcMount, dlcachefs_exe
from .passthrough import passthrough_mount
from .util import drop_page_cache, file_hash

OUT = os.path.join("bench", "out", "warmup")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check(mnt: str, manifest: dict) -> tuple[int, int]:
    """Read every file of the manifest through the mount: (files read, mismatches)."""
    bad = 0
    for rel, _size, want in manifest["file_list"]:
        with open(os.path.join(mnt, rel), "rb") as fh:
            if file_hash(fh.read()) != want:
                bad += 1
    return len(manifest["file_list"]), bad


def run_method(name: str, cmd: list[str], slow: str, out: str, manifest: dict,
               extra: list[str] | None = None, shell: bool = False, resume: bool = False,
               scrape: bool = False) -> dict:
    cache = os.path.join(out, f"cache-{name.replace(' ', '_')}")
    mnt = os.path.join(out, "mnt")
    shutil.rmtree(cache, ignore_errors=True)
    port = _free_port() if scrape else None
    args = ["--cache-size", "100G", *(extra or [])]
    if port:
        args += ["--metrics-port", str(port)]
    res: dict = {"method": name}
    with DlcMount(slow, mnt, cache, args) as m:
        m.wait_idle()
        drop_page_cache()
        before = m.stats()
        full = [c.replace("MNT", str(m.mnt)) for c in cmd]
        t0 = time.perf_counter()
        r = subprocess.run(" ".join(full) if shell else full, shell=shell, capture_output=True,
                           text=True)
        m.wait_idle(600)
        wall = time.perf_counter() - t0
        after = m.stats()
        res.update({"returncode": r.returncode, "wall_s": round(wall, 3),
                    "bytes_from_source": after["bytes_from_source"] - before["bytes_from_source"],
                    "cached_files": after["cached_files"], "misses": after["misses"]})
        n = len(manifest["file_list"])
        res["files_per_s"] = round(n / wall, 1)
        res["mb_per_s"] = round(res["bytes_from_source"] / wall / 1e6, 2)
        if r.returncode != 0:
            res["stderr"] = r.stderr[-2000:]
        if resume:
            b2 = m.stats()
            t1 = time.perf_counter()
            r2 = subprocess.run(full, capture_output=True, text=True)
            a2 = m.stats()
            res["resume"] = {"wall_s": round(time.perf_counter() - t1, 3),
                             "returncode": r2.returncode,
                             "opens": (a2["hits"] + a2["misses"]) - (b2["hits"] + b2["misses"]),
                             "bytes_from_source": a2["bytes_from_source"]
                             - b2["bytes_from_source"]}
        if scrape and port:
            times = []
            for _ in range(20):
                t = time.perf_counter()
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as u:
                    u.read()
                times.append((time.perf_counter() - t) * 1000)
            res["scrape_ms"] = {"median": round(statistics.median(times), 2),
                                "max": round(max(times), 2)}
        drop_page_cache()
        b3 = m.stats()
        count, bad = _check(str(m.mnt), manifest)
        a3 = m.stats()
        res["check"] = {"files": count, "mismatches": bad,
                        "misses": a3["misses"] - b3["misses"]}
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.warmup")
    p.add_argument("--files", type=int, default=600)
    p.add_argument("--delay-ms", type=float, default=5.0)
    p.add_argument("--jobs", default="1,8")
    p.add_argument("--out", default=os.path.join("bench", "results", "warmup.json"))
    a = p.parse_args(argv)
    os.makedirs(OUT, exist_ok=True)
    data = os.path.join(OUT, "data")
    spec = md.Spec(classes=10, per_class=max(1, a.files // 10))
    manifest, _ = md.ensure_dataset(data, spec, progress=sys.stderr.isatty())
    exe = dlcachefs_exe()
    slow = os.path.join(OUT, "slow")
    results = []
    with passthrough_mount(data, slow, delay_ms=a.delay_ms):
        methods = [
            ("cat", ["find", "MNT", "-type", "f", "-print0", "|", "xargs", "-0", "cat",
                     ">", "/dev/null"], {"shell": True}),
            ("cat -P8", ["find", "MNT", "-type", "f", "-print0", "|", "xargs", "-0", "-P", "8",
                         "-n", "16", "cat", ">", "/dev/null"], {"shell": True}),
        ]
        for j in [int(x) for x in a.jobs.split(",") if x.strip()]:
            methods.append((f"warmup -j{j}", [exe, "warmup", "MNT", "--jobs", str(j)],
                            {"resume": True, "scrape": j == 8}))
        for name, cmd, kw in methods:
            print(f"bench.warmup: {name}", file=sys.stderr)
            results.append(run_method(name, cmd, slow, OUT, manifest, **kw))
    base = next(r for r in results if r["method"] == "cat")["wall_s"]
    failed = [r["method"] for r in results
              if r["returncode"] != 0 or r["check"]["mismatches"] or r["check"]["misses"]
              or r.get("resume", {}).get("bytes_from_source", 0)
              or r.get("resume", {}).get("opens", 0)]
    doc = {"bench": "warmup", "files": len(manifest["file_list"]), "delay_ms": a.delay_ms,
           "results": results,
           "ratios": {r["method"]: round(base / r["wall_s"], 2) for r in results},
           "status": "failed" if failed else "ok", "failed": failed,
           "note": "speed-up of each method's wall time over cat's (higher is faster)"}
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps(doc, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
