"""A dataset mounted from a second place, mounted: what the second copy costs with and
without content dedup (``--shared-cache``), side by side in one run.

    python -m bench.dedup [--files 300] [--size 64K] [--delay-ms 10] [--epochs 2]
                          [--at-once] [--core-rev REV] [--out bench/results/dedup.json]

Dataset ``a`` (``--files`` random files of about ``--size``) is a local directory, mounted
with ``--shared-cache`` and read whole, so the root holds it. Dataset ``b`` is the same
bytes under other names and times behind ``bench.passthrough --delay-ms`` (every open of
a source file waits, as on a far NFS server or object store), with a ``sha256sum`` list
in its root. Per case, a fresh copy of a's cache root, then ``b`` is mounted on it and
read whole ``--epochs`` times (page cache dropped before each), every byte compared with
the source:

* ``no-dedup``: ``--no-dedup`` (what a second mount of a copy did before: its own copy);
* ``learned``: dedup, no list (each file read from b's source once to learn its digest,
  not stored; later epochs borrow);
* ``manifest``: dedup with ``--content-manifest`` (b's source never read).

Per case and epoch: wall time, bytes b read from its source, bytes borrowed; at the end
b's chunk bytes (its second copy) and the root's. ``ratios``: each dedup case over
``no-dedup``. Exit status 1 when any byte read differs.

``--at-once``: b is read the moment its mount returns, as a training started right after
the mount reads it (by default the bench first waits until b's daemon has walked a's
index: the steady state). The dedup cases then also report ``first_look_s`` (how long
b's first look at the root took) and ``held`` (fetches that waited for it).
``--core-rev REV`` runs b's daemon from a committed revision (the "before" side).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

from dlcachefs.testing.mounting import Mount
from dlcachefs.units import parse_size

from .passthrough import passthrough_mount
from .util import drop_page_cache, machine_info, write_json

CASES = ("no-dedup", "learned", "manifest")


def _copies(work: Path, n: int, size: int) -> tuple[Path, Path, dict[str, bytes], dict[str, str]]:
    rnd = random.Random(3)
    a, b = work / "a", work / "b_real"
    files, names = {}, {}
    for i in range(n):
        rel = f"c{i % 8}/f{i:05d}.jpg"
        data = rnd.randbytes(max(1, size + rnd.randrange(-size // 2, size // 2 + 1)))
        for root, path in ((a, rel), (b, f"train/n{i % 8:02d}/img_{i:05d}.jpg")):
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_bytes(data)
        files[rel], names[rel] = data, f"train/n{i % 8:02d}/img_{i:05d}.jpg"
    lines = [f"{hashlib.sha256(files[r]).hexdigest()}  ./{names[r]}" for r in files]
    (b / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    return a, b, files, names


def _read(mnt: Path, files: dict[str, bytes], names: dict[str, str] | None) -> int:
    """Every file through the mount; how many differ from the source."""
    return sum((mnt / (names[r] if names else r)).read_bytes() != d for r, d in files.items())


def _chunk_bytes(root: Path) -> int:
    return sum(p.stat().st_blocks * 512 for p in root.glob("datasets/*/logs/*.log"))


def run_case(work: Path, case: str, seeded: Path, b_src: Path, files: dict[str, bytes],
             names: dict[str, str], epochs: int, manifest: Path, at_once: bool = False,
             cli: list[str] | None = None) -> dict:
    root = work / f"root-{case}"
    shutil.copytree(seeded, root)  # a's cache, as a's mount left it
    args = ["--shared-cache", "--cache-size", "4G", "--dataset", "b", "--scan-ahead", "0",
            "--flush-interval", "0.5"]
    if case == "no-dedup":
        args.append("--no-dedup")
    elif case == "manifest":
        args += ["--content-manifest", str(manifest)]
    out: dict = {"epochs": [], "wrong_bytes": 0}
    with Mount(b_src, work / f"mb-{case}", root, *args, debug_invariants=False,
               cli=cli) as mb:
        if case != "no-dedup" and not at_once:  # b sees a once it has walked a's index
            mb.wait_stats(lambda s: s["dedup"]["siblings"] == ["a"], "b does not see a")
        before = mb.stats()
        for _ in range(epochs):
            drop_page_cache()
            t0 = time.perf_counter()
            out["wrong_bytes"] += _read(mb.mnt, files, names)
            wall = time.perf_counter() - t0
            st = mb.stats()
            out["epochs"].append({
                "wall_s": round(wall, 3),
                "bytes_from_source": st["bytes_from_source"] - before["bytes_from_source"],
                "bytes_from_datasets": st["bytes_from_datasets"] - before["bytes_from_datasets"]})
            before = st
        mb.wait_stats(lambda s: s["pending_bytes"] == 0, "b's writes did not settle")
        st = mb.stats()
        out["b_chunk_bytes"] = st["chunk_bytes"]
        out["b_cached_files"] = st["cached_files"]
        out["dedup"] = st["dedup"]
    out["root_disk_bytes"] = _chunk_bytes(root)
    shutil.rmtree(root, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.dedup")
    p.add_argument("--files", type=int, default=300)
    p.add_argument("--size", default="64K")
    p.add_argument("--delay-ms", type=float, default=10.0)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--at-once", action="store_true",
                   help="read b as soon as its mount returns (no wait for its first look)")
    p.add_argument("--core-rev", default=None, metavar="REV",
                   help="run b's daemon from this committed revision (git archive)")
    p.add_argument("--out", default=os.path.join("bench", "results", "dedup.json"))
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="dlc-dedup-"))
    try:
        a_src, b_real, files, names = _copies(work, a.files, parse_size(a.size))
        seeded = work / "seeded"
        with Mount(a_src, work / "ma", seeded, "--shared-cache", "--cache-size", "4G",
                   "--dataset", "a", "--scan-ahead", "0", "--flush-interval", "0.5",
                   debug_invariants=False) as ma:
            wrong = _read(ma.mnt, files, None)
            ma.wait_cached(len(files))
        cli = None
        if a.core_rev:
            from .fidelity import core_from_rev  # noqa: PLC0415

            cli = [core_from_rev(a.core_rev, work)[0]]
        results = {}
        with passthrough_mount(str(b_real), str(work / "b"), delay_ms=a.delay_ms):
            for case in CASES:
                results[case] = run_case(work, case, seeded, work / "b", files, names,
                                         a.epochs, work / "b" / "SHA256SUMS", a.at_once,
                                         cli)
        a_disk = _chunk_bytes(seeded)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base = results["no-dedup"]

    def ratio(x: float, y: float) -> float | None:
        return round(x / y, 3) if y else None

    doc = {"bench": "dedup", "params": vars(a), "dataset_bytes": sum(map(len, files.values())),
           "a_disk_bytes": a_disk, "results": results,
           "ratios": {case: {
               "epoch1_wall": ratio(r["epochs"][0]["wall_s"], base["epochs"][0]["wall_s"]),
               "epoch1_source_bytes": ratio(r["epochs"][0]["bytes_from_source"],
                                            base["epochs"][0]["bytes_from_source"]),
               "root_disk_bytes": ratio(r["root_disk_bytes"], base["root_disk_bytes"])}
               for case, r in results.items() if case != "no-dedup"},
           "machine": machine_info()}
    bad = wrong + sum(r["wrong_bytes"] for r in results.values())
    doc["status"] = "ok" if bad == 0 else "failed"
    print(json.dumps(doc, indent=1))
    if a.out:
        write_json(a.out, doc)
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
