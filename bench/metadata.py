"""Metadata at scale: N tiny files (make_dataset's ``--tiny``), local source only.

    python -m bench.metadata [--files 1000000] [--work bench/out/metadata] [--out FILE.json]

Measures, in this order:

* ``local find`` / ``local ls -lR``: ``find SRC | wc -l`` and ``ls -lR SRC > /dev/null``
  over the local directory, page cache and dentry cache dropped first (cold), then again
  (warm);
* ``mount (scan)``: ``dlcachefs mount`` on an empty cache directory: lists the whole tree
  into the LMDB snapshot before it returns;
* ``find``, ``ls -lR`` through the mount (first time: the kernel asks the daemon for
  everything), the daemon's RSS and peak RSS after them;
* ``remount``: ``dlcachefs umount`` + ``mount`` of the same cache (the snapshot is
  reused, the source is not listed), then ``find`` and ``ls -lR`` again and the RSS.

Correctness: the number of entries ``find`` prints through the mount must equal the
local one, and 1,000 files chosen at random must read back the same bytes through the
mount; otherwise it fails (exit status 1). Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time

from . import make_dataset as md
from .mounting import DlcMount, dlcachefs_exe
from .util import drop_page_cache, file_hash, machine_info, proc_status_kb, write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class MetadataFailure(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[metadata {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _timed_shell(cmd: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise MetadataFailure(f"{cmd!r} failed ({r.returncode}): {r.stderr.strip()[:500]}")
    return dt, r.stdout.strip()


def _find(path: str) -> tuple[float, int]:
    dt, out = _timed_shell(f"find '{path}' | wc -l")
    return dt, int(out)


def _ls(path: str) -> float:
    return _timed_shell(f"ls -lR '{path}' > /dev/null")[0]


def _rss(pid: int | None) -> dict:
    if not pid:
        return {}
    rss = proc_status_kb(pid, "VmRSS")
    hwm = proc_status_kb(pid, "VmHWM")
    return {"rss_mb": round(rss / 1024, 1) if rss else None,
            "peak_rss_mb": round(hwm / 1024, 1) if hwm else None}


def run_metadata(files: int, work: str, seed: int = 0, mount_timeout: float = 3600.0) -> dict:
    """Measure and return the ``metadata`` section (see the module doc)."""
    classes = 1000 if files >= 1000 else 1
    per_class = max(1, files // classes)
    spec = md.Spec(classes=classes, per_class=per_class, seed=seed, tiny=True)
    root = os.path.join(work, f"tiny-c{classes}-p{per_class}-s{seed}")
    log(f"tiny dataset: {spec.files} files in {root}")
    t0 = time.perf_counter()
    manifest, reused = md.ensure_dataset(root, spec, progress=True)
    out: dict = {"files": spec.files, "source": root, "dataset_reused": reused,
                 "dataset_make_s": None if reused else round(time.perf_counter() - t0, 2),
                 "runs": []}
    src = os.path.join(root, "train")  # what is mounted: the ImageFolder root
    runs = out["runs"]

    def add(name: str, seconds: float, **kw) -> None:
        runs.append({"name": name, "seconds": round(seconds, 3), **kw})
        log(f"{name}: {seconds:.2f} s " + " ".join(f"{k}={v}" for k, v in kw.items()))

    drop_page_cache([])
    dt, n_local = _find(src)
    add("local find (cold)", dt, entries=n_local)
    dt, _ = _find(src)
    add("local find (warm)", dt, entries=n_local)
    drop_page_cache([])
    add("local ls -lR (cold)", _ls(src))
    add("local ls -lR (warm)", _ls(src))

    cache = os.path.join(work, "cache")
    mnt = os.path.join(work, "mnt")
    shutil.rmtree(cache, ignore_errors=True)
    exe = dlcachefs_exe()
    rng = random.Random(seed)
    sample = [(c, i) for c, i in ((rng.randrange(classes), rng.randrange(per_class))
                                  for _ in range(1000))]
    try:
        with DlcMount(src, mnt, cache, [], exe, timeout=mount_timeout) as m:
            add("dlcachefs mount (first, scanning)", m.mount_s, pid=m.pid, **_rss(m.pid))
            dt, n = _find(mnt)
            add("dlcachefs find (after first mount)", dt, entries=n)
            if n != n_local:
                raise MetadataFailure(f"find through the mount lists {n} entries, "
                                      f"the source {n_local}")
            add("dlcachefs ls -lR (after first mount)", _ls(mnt), **_rss(m.pid))
            bad = []
            for c, i in sample:
                rel = os.path.relpath(os.path.join(root, md.rel_path(spec, c, i)), src)
                with open(os.path.join(src, rel), "rb") as f:
                    want = file_hash(f.read())
                with open(os.path.join(mnt, rel), "rb") as f:
                    got = file_hash(f.read())
                if got != want:
                    bad.append(rel)
            if bad:
                raise MetadataFailure(f"{len(bad)} of {len(sample)} files differ through "
                                      f"the mount, e.g. {bad[0]}")
            out["sample_files_checked"] = len(sample)
            out["after_first_mount"] = _rss(m.pid)
        out["umount_s"] = round(m.umount_s or 0, 3)
        drop_page_cache([])
        with DlcMount(src, mnt, cache, [], exe, timeout=mount_timeout) as m:
            add("dlcachefs remount (snapshot reused)", m.mount_s, pid=m.pid, **_rss(m.pid))
            dt, n = _find(mnt)
            add("dlcachefs find (after remount)", dt, entries=n)
            if n != n_local:
                raise MetadataFailure(f"find after remount lists {n} entries, the source "
                                      f"{n_local}")
            add("dlcachefs ls -lR (after remount)", _ls(mnt), **_rss(m.pid))
            out["after_remount"] = _rss(m.pid)
            st = m.stats()
            out["stats_files"] = st.get("files")
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    by = {r["name"]: r for r in runs}
    out["summary"] = {
        "first_mount_s": by["dlcachefs mount (first, scanning)"]["seconds"],
        "remount_s": by["dlcachefs remount (snapshot reused)"]["seconds"],
        "find_local_warm_s": by["local find (warm)"]["seconds"],
        "find_mount_s": by["dlcachefs find (after first mount)"]["seconds"],
        "find_mount_after_remount_s": by["dlcachefs find (after remount)"]["seconds"],
        "ls_local_warm_s": by["local ls -lR (warm)"]["seconds"],
        "ls_mount_s": by["dlcachefs ls -lR (after first mount)"]["seconds"],
        "ls_mount_after_remount_s": by["dlcachefs ls -lR (after remount)"]["seconds"],
        "daemon_rss_mb": max(out["after_first_mount"].get("rss_mb") or 0,
                             out["after_remount"].get("rss_mb") or 0),
        "daemon_peak_rss_mb": max(out["after_first_mount"].get("peak_rss_mb") or 0,
                                  out["after_remount"].get("peak_rss_mb") or 0),
    }
    s = out["summary"]
    s["daemon_peak_rss_mb_per_million_files"] = round(
        s["daemon_peak_rss_mb"] / (spec.files / 1e6), 1)
    return out


def markdown(meta: dict) -> str:
    lines = [f"Metadata, {meta['files']:,} tiny files (local source):", "",
             "| step | seconds | entries | daemon RSS MB | daemon peak RSS MB |",
             "|---|---|---|---|---|"]
    for r in meta["runs"]:
        lines.append(f"| {r['name']} | {r['seconds']:.2f} | {r.get('entries', '')} | "
                     f"{r.get('rss_mb', '')} | {r.get('peak_rss_mb', '')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.metadata",
                                description="dlcachefs metadata at scale (tiny files).")
    p.add_argument("--files", type=int, default=1_000_000)
    p.add_argument("--work", default=os.path.join(REPO, "bench", "out", "metadata"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    os.makedirs(a.work, exist_ok=True)
    doc = {"benchmark": "metadata", "machine": machine_info(REPO), "status": "running"}
    code = 0
    try:
        doc["metadata"] = run_metadata(a.files, os.path.abspath(a.work), a.seed)
        doc["status"] = "ok"
    except MetadataFailure as e:
        log(f"FAILED: {e}")
        code, doc["status"], doc["error"] = 1, "failed", str(e)
    out = a.out or os.path.join(REPO, "bench", "results",
                                f"metadata-{time.strftime('%Y%m%d-%H%M%S')}.json")
    write_json(out, doc)
    print(json.dumps(doc, indent=2))
    if "metadata" in doc:
        print(markdown(doc["metadata"]))
    log(f"wrote {out}")
    return code


if __name__ == "__main__":
    sys.exit(main())
