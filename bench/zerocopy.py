"""Zero-copy reads (``dlcachefs.data``) against the local copy and the mount, warm, side by
side in one run.

    python -m bench.zerocopy [--files 3000] [--threads 1,8] [--workers 2] [--rounds 5]
                             [--out bench/results/zerocopy.json]
    python -m bench.zerocopy --files 60 --threads 8 --smoke     # a quick check, no numbers

One JPEG ImageFolder dataset (``bench.make_dataset``, ~110 KB files), mounted with
dlcachefs over its local copy (the source is local on purpose: this measures the read
path, not a slow link). Warm-up: every file read once through the mount (so it is
cached), the chunk writer idle, then every configuration below run once untimed (the
page cache holds the local copy, the cache's logs, the mount's files). Then ``--rounds``
timed rounds (the systems' order rotated per round), each reading every file once in one
fixed random permutation; ``median_files_per_s`` and ``ratios`` are over the rounds:

* ``raw`` (``bench.readers.read_all``, N threads pulling from one queue), per ``--threads``:
  ``zerocopy``: ``CacheReader.read(path)`` (LMDB lookup, one ``pread``, xxh3 check; no FUSE
  request), warm as the local copy is: the files read once in this process just before,
  untimed (the reader remembers where each is per LMDB snapshot, as the kernel's dentry
  cache remembers the local copy's paths); ``zerocopy-first``: the same after
  ``reader.close()``, so every file is looked up in the index; ``local``: ``open().read()`` of the local copy; ``mount``: ``open().read()``
  through the mount (the kernel keeps the mount's pages: OPEN and RELEASE reach the
  daemon); ``mount-daemon``: the same with the mount's pages dropped before the run
  (``posix_fadvise(DONTNEED)`` through the mount, untimed), so that every read is served
  by the daemon from its cache, as for a dataset larger than the page cache.
* ``loader``: ``DataLoader(batch_size=32, num_workers=--workers)`` whose dataset returns
  each sample's bytes (no decoding) to the main process, over the same permutation:
  ``zerocopy``: ``CachedImageFolder(MNT/train).read_bytes(i)``; ``local``: the same class
  over the local copy (``zero_copy=False``: plain ``open().read()``); ``mount``: the same
  over the mount with ``zero_copy=False``.

Per run: ``files_per_s``, ``mb_per_s``, latency percentiles (raw), ``reader_cpu_s`` (this
process, and for the loader its workers), the daemon's CPU seconds and its stats delta
(``file_opens``: hits + misses through FUSE, 0 for zero-copy runs; ``zerocopy_hits``).
``ratios`` compares zero-copy with the local copy and the mount. Every file's bytes are
hashed and compared with the dataset's manifest in every run; any difference (or any
zero-copy read that was not served from the cache) gives ``"status": "failed"`` and exit
status 1.

Output: the JSON document on stdout and in ``--out``; progress on stderr. No root needed
(nothing is dropped: every run is warm).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import sys
import time

from dlcachefs.data import CacheReader
from dlcachefs.data.folder import CachedImageFolder

from . import make_dataset as md
from .mounting import DlcMount
from .passes import drop_mount_pages
from .readers import read_all
from .util import file_hash, machine_info, write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_WORK = os.path.join(REPO, "bench", "out", "zerocopy")
DEFAULT_OUT = os.path.join(REPO, "bench", "results", "zerocopy.json")
SYSTEMS = ("zerocopy", "zerocopy-first", "local", "mount", "mount-daemon")
#: the loader rows (the DataLoader over the mount leaves the pages to the kernel)
LOADER_SYSTEMS = ("zerocopy", "local", "mount")


def log(msg: str) -> None:
    print(f"[zerocopy {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class Failed(RuntimeError):
    """Wrong bytes, read errors, or a zero-copy read that was not served from the cache."""


# ----- the loader's dataset ----------------------------------------------------------------

class BytesFolder(CachedImageFolder):
    """A CachedImageFolder whose items are (the file's bytes, index): no decoding, so the
    loader rows measure reading and shipping bytes to the main process."""

    def __getitem__(self, index):
        return self.read_bytes(index).obj, index  # the bytes the view wraps (no copy)


def loader_run(root: str, zero_copy: bool, order: list[int], workers: int,
               expected: dict[str, str]) -> dict:
    import resource

    import torch

    ds = BytesFolder(root, zero_copy=zero_copy)
    if zero_copy and ds.reader is None:
        raise Failed(f"{root} is not on a dlcachefs mount")
    dl = torch.utils.data.DataLoader(ds, batch_size=32, sampler=order, num_workers=workers)

    def cpu() -> float:
        s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

    cpu0 = cpu()
    t0 = time.perf_counter()
    n = nbytes = 0
    bad = []
    for datas, idx in dl:
        for data, i in zip(datas, idx.tolist(), strict=True):
            rel = os.path.relpath(ds.samples[i][0], os.path.dirname(root))
            if file_hash(data) != expected[rel]:
                bad.append(rel)
            n += 1
            nbytes += len(data)
    wall = time.perf_counter() - t0
    if bad or n != len(order):
        raise Failed(f"loader over {root}: {len(bad)} wrong files, {n} of {len(order)} read")
    return {"files": n, "bytes": nbytes, "wall_s": round(wall, 4),
            "files_per_s": round(n / wall, 1), "mb_per_s": round(nbytes / 1e6 / wall, 2),
            "reader_cpu_s": round(cpu() - cpu0, 3)}


# ----- runs ----------------------------------------------------------------------------------

def delta(m: DlcMount, start: dict) -> dict:
    end = m.probe_end(start)
    d = end["stats_delta"]
    zc0 = start["stats"].get("zerocopy") or {}
    zc1 = m.stats().get("zerocopy") or {}
    return {"daemon_cpu_s": end["daemon_cpu_s"],
            "file_opens": d.get("hits", 0) + d.get("misses", 0),
            "bytes_from_source": d.get("bytes_from_source", 0),
            "zerocopy_hits": zc1.get("hits", 0) - zc0.get("hits", 0),
            "zerocopy_fallbacks": zc1.get("fallbacks", 0) - zc0.get("fallbacks", 0)}


def check_raw(label: str, rels: list[str], res, expected: dict) -> None:
    bad = [r for r, h in zip(rels, res.hashes, strict=True) if expected[r] != h]
    if res.errors or bad:
        raise Failed(f"{label}: {len(res.errors)} errors, {len(bad)} wrong files "
                     f"(first: {(res.errors or bad)[:3]})")


def run(a: argparse.Namespace) -> dict:
    per_class = max(1, math.ceil(a.files / a.classes))
    spec = md.Spec(classes=a.classes, per_class=per_class, seed=a.seed, mean_kb=a.mean_kb)
    root = os.path.join(a.work, f"dataset-c{spec.classes}-p{per_class}-s{spec.seed}-"
                                f"m{spec.mean_kb:g}")
    log(f"dataset: {spec.files} files in {root}")
    manifest, reused = md.ensure_dataset(root, spec, progress=sys.stderr.isatty())
    rels = [r[0] for r in manifest["file_list"]]
    expected = {r[0]: r[2] for r in manifest["file_list"]}
    order_rels = list(rels)
    random.Random(f"zerocopy-{a.seed}").shuffle(order_rels)
    mnt = os.path.join(a.work, "mnt")
    cache = os.path.join(a.work, "cache")
    shutil.rmtree(cache, ignore_errors=True)
    doc: dict = {"bench": "zerocopy", "status": "ok", "machine": machine_info(REPO),
                 "args": vars(a),
                 "dataset": {"root": root, "files": len(rels), "reused": reused,
                             "total_bytes": manifest["total_bytes"],
                             "tree_digest": manifest["tree_digest"]},
                 "raw": [], "loader": []}
    with DlcMount(root, mnt, cache, extra_args=a.mount_arg) as m:
        paths = {"local": [os.path.join(root, r) for r in order_rels],
                 "mount": [os.path.join(mnt, r) for r in order_rels]}
        paths["zerocopy"] = paths["zerocopy-first"] = paths["mount-daemon"] = paths["mount"]
        log("warm-up: every file through the mount, then the writer idle")
        check_raw("warm-up", order_rels, read_all(paths["mount"], threads=8), expected)
        m.wait_idle()
        st = m.stats()
        doc["cache"] = {k: st.get(k) for k in ("cached_files", "cached_bytes", "chunks")}
        if st["cached_files"] < len(rels):
            raise Failed(f"only {st['cached_files']} of {len(rels)} files cached after the "
                         f"warm-up (is --cache-size too small?)")
        reader = CacheReader.for_path(mnt)
        if reader is None:
            raise Failed(f"{mnt} does not describe its cache (.dlcache/zerocopy)")
        fns = {"zerocopy": reader.read, "zerocopy-first": reader.read, "local": None,
               "mount": None, "mount-daemon": None}
        threads = [int(t) for t in a.threads.split(",")]
        train = {"local": os.path.join(root, "train"), "mount": os.path.join(mnt, "train")}
        train["zerocopy"] = train["mount"]
        ds0 = BytesFolder(train["local"], zero_copy=False)
        index_of = {os.path.relpath(p, root): i for i, (p, _) in enumerate(ds0.samples)}
        order = [index_of[r] for r in order_rels]
        # an untimed round first (every page cache warm), then --rounds timed rounds; the
        # systems' order rotates per round so none always runs right after another
        for rnd in range(a.rounds + 1):
            warm = rnd == 0
            n = len(SYSTEMS)
            systems = SYSTEMS[rnd % n:] + SYSTEMS[:rnd % n]
            for t in threads:
                for system in systems:
                    kw = {"reader": fns[system]} if fns[system] else {}
                    if system == "mount-daemon":
                        drop_mount_pages(mnt, order_rels)
                    elif system == "zerocopy-first":
                        reader.close()  # the next read opens the index anew: nothing known
                    elif system == "zerocopy":
                        # warm as the local copy is (its dentries and pages): the files
                        # located once in this process, untimed (a DataLoader's fork in
                        # between closed the index, and with it what was remembered)
                        read_all(paths[system], threads=t, reader=reader.read)
                    start = m.probe_start()
                    res = read_all(paths[system], threads=t, **kw)
                    check_raw(f"raw {system}", order_rels, res, expected)
                    d = delta(m, start)
                    if system.startswith("zerocopy") and (d["zerocopy_hits"] != len(rels)
                                                          or d["file_opens"]):
                        raise Failed(f"zero-copy run: {d['zerocopy_hits']} of {len(rels)} "
                                     f"from the cache, {d['file_opens']} opens through FUSE")
                    if not warm:
                        doc["raw"].append({"system": system, "threads": t, "round": rnd,
                                           **res.summary(), **d})
                        log(f"raw {system:9s} {t} threads: "
                            f"{res.summary()['files_per_s']} files/s")
            if a.workers >= 0:
                for system in (s for s in systems if s in LOADER_SYSTEMS):
                    start = m.probe_start()
                    res = loader_run(train[system], system == "zerocopy", order, a.workers,
                                     expected)
                    d = delta(m, start)
                    if system == "zerocopy" and d["file_opens"]:
                        raise Failed(f"zero-copy loader: {d['file_opens']} opens through FUSE")
                    if not warm:
                        doc["loader"].append({"system": system, "workers": a.workers,
                                              "round": rnd, **res, **d})
                        log(f"loader {system:9s} {a.workers} workers: "
                            f"{res['files_per_s']} files/s")
    doc["median_files_per_s"] = medians(doc)
    doc["ratios"] = ratios(doc)
    return doc


def medians(doc: dict) -> dict:
    """Per part, system and thread/worker count: the median files/s over the timed rounds
    (runs are short and the machine is shared: one round alone is noise)."""
    out: dict = {}
    for part, key in (("raw", "threads"), ("loader", "workers")):
        by: dict = {}
        for r in doc[part]:
            by.setdefault((r["system"], r[key]), []).append(r["files_per_s"])
        for (system, k), v in by.items():
            out[f"{part} {key}={k}: {system}"] = round(statistics.median(v), 1)
    return out


def ratios(doc: dict) -> dict:
    """Zero-copy's median files/s (warm, and first in the process) over the local copy's
    and the mount's."""
    out: dict = {}
    for part, key in (("raw", "threads"), ("loader", "workers")):
        by: dict = {}
        for r in doc[part]:
            by.setdefault((r["system"], r[key]), []).append(r["files_per_s"])
        by = {k: statistics.median(v) for k, v in by.items()}
        for (system, k), fps in by.items():
            if not system.startswith("zerocopy"):
                continue
            for other in ("local", "mount", "mount-daemon"):
                ref = by.get((other, k))
                if ref:
                    out[f"{part} {key}={k}: {system} / {other}"] = round(fps / ref, 3)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.zerocopy", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--files", type=int, default=3000, help="dataset files (default 3000)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--mean-kb", type=float, default=110.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=5,
                   help="timed rounds after the untimed one; medians are reported (default 5)")
    p.add_argument("--threads", default="1,8", help="raw reader threads, comma separated")
    p.add_argument("--workers", type=int, default=2,
                   help="DataLoader workers (-1: no loader rows)")
    p.add_argument("--mount-arg", action="append", default=[],
                   help="extra argument for dlcachefs mount (repeatable)")
    p.add_argument("--work", default=DEFAULT_WORK, help="scratch directory")
    p.add_argument("--out", default=DEFAULT_OUT, help="JSON result file")
    p.add_argument("--smoke", action="store_true",
                   help="a quick check that everything runs: --out is not written")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        doc = run(a)
        status = 0
    except Failed as e:
        doc = {"bench": "zerocopy", "status": "failed", "error": str(e)}
        log(f"FAILED: {e}")
        status = 1
    if not a.smoke:
        write_json(a.out, doc)
    print(json.dumps(doc, indent=2))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
