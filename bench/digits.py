"""scikit-learn's bundled digits (1,797 8x8 grayscale images, 10 classes) as a small
ImageFolder tree of PNG files, for training-fidelity benchmarks (bench/fidelity.py).

    python -m bench.digits DEST [--upscale 4] [--seed 0] [--test-frac 0.2]

    DEST/train/<class>/<i>.png     # i = the image's index in load_digits(), 4 digits
    DEST/test/<class>/<i>.png
    DEST/MANIFEST.json             # written last: parameters, counts, bytes, tree digest

* Pixels 0..16 are scaled to 0..255 (uint8, rounded) and upscaled by nearest neighbour
  (``--upscale 4``: 32x32), written as 8-bit grayscale PNG by PIL: ~150-400 bytes a file.
* The split is stratified and fixed: per class, a permutation from
  ``numpy.random.default_rng(seed + class)``; its first ``round(n * test_frac)`` images go
  to ``test``. No scikit-learn splitter is used, so the split does not depend on its version.
* Deterministic bytes: the same arguments give the same tree (same pixels, same PNG
  encoder settings, no metadata chunks), and every file and directory gets the same
  fixed mtime (2020-01-01). A complete tree made with the same parameters is reused.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import sys
from pathlib import Path

FIXED_MTIME = 1577836800  # 2020-01-01T00:00:00Z, as bench.make_dataset
FORMAT_VERSION = 1


def _png(pixels) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(pixels, mode="L").save(buf, format="PNG", compress_level=9,
                                           optimize=False)
    return buf.getvalue()


def _split(targets, seed: int, test_frac: float) -> dict[int, str]:
    """{image index: "train" | "test"}, stratified by class."""
    import numpy as np

    out: dict[int, str] = {}
    for c in sorted({int(t) for t in targets}):
        idx = np.flatnonzero(targets == c)
        perm = idx[np.random.default_rng(seed + c).permutation(len(idx))]
        n_test = int(round(len(idx) * test_frac))
        for k, i in enumerate(perm):
            out[int(i)] = "test" if k < n_test else "train"
    return out


def write_digits(dest: Path, upscale: int = 4, seed: int = 0, test_frac: float = 0.2) -> dict:
    """Write the tree (or reuse a complete one with the same parameters) and return its
    manifest: ``counts`` ({split: files}), ``bytes`` ({split: bytes}), ``total_bytes``,
    ``classes``, ``image_size``, ``tree_digest``, the parameters."""
    import numpy as np
    from sklearn.datasets import load_digits

    from .util import file_hash, tree_digest

    dest = Path(dest)
    params = {"format": FORMAT_VERSION, "upscale": int(upscale), "seed": int(seed),
              "test_frac": float(test_frac)}
    manifest_path = dest / "MANIFEST.json"
    if manifest_path.exists():
        try:
            old = json.loads(manifest_path.read_text())
        except (OSError, ValueError):
            old = None
        if old and old.get("params") == params:
            return old
    if dest.exists():
        shutil.rmtree(dest)

    d = load_digits()
    images = d.images  # (1797, 8, 8), float 0..16
    targets = np.asarray(d.target)
    split = _split(targets, seed, test_frac)
    counts = {"train": 0, "test": 0}
    nbytes = {"train": 0, "test": 0}
    items = []
    dirs = {dest}
    for i in range(len(images)):
        px = np.rint(images[i] * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
        if upscale > 1:
            px = np.repeat(np.repeat(px, upscale, axis=0), upscale, axis=1)
        data = _png(np.ascontiguousarray(px))
        part = split[i]
        cls = str(int(targets[i]))
        rel = f"{part}/{cls}/{i:04d}.png"
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        dirs.update({path.parent, path.parent.parent})
        path.write_bytes(data)
        os.utime(path, (FIXED_MTIME, FIXED_MTIME))
        counts[part] += 1
        nbytes[part] += len(data)
        items.append((rel, len(data), file_hash(data)))
    for p in sorted(dirs, key=lambda p: len(p.parts), reverse=True):
        os.utime(p, (FIXED_MTIME, FIXED_MTIME))
    side = images.shape[1] * max(1, upscale)
    manifest = {
        "dataset": "sklearn.datasets.load_digits",
        "params": params,
        "classes": sorted({str(int(t)) for t in targets}, key=int),
        "image_size": [side, side],
        "counts": counts,
        "bytes": nbytes,
        "total_files": sum(counts.values()),
        "total_bytes": sum(nbytes.values()),
        "mean_file_bytes": round(sum(nbytes.values()) / max(1, sum(counts.values())), 1),
        "tree_digest": tree_digest(items),
    }
    tmp = dest / "MANIFEST.json.tmp"
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(tmp, manifest_path)  # last: its presence means the tree is complete
    os.utime(manifest_path, (FIXED_MTIME, FIXED_MTIME))
    os.utime(dest, (FIXED_MTIME, FIXED_MTIME))
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.digits", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dest")
    ap.add_argument("--upscale", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--test-frac", type=float, default=0.2)
    a = ap.parse_args(argv)
    m = write_digits(Path(a.dest), a.upscale, a.seed, a.test_frac)
    print(json.dumps(m, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
