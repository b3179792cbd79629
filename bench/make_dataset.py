"""Synthetic datasets for the benchmarks, deterministic from a seed.

Two kinds:

* **images** (default): an ImageFolder tree ``OUT/train/<class>/<i>.jpg`` of real JPEGs
  that PIL decodes. File sizes are drawn from a lognormal distribution (mean ``--mean-kb``,
  sigma ``--sigma``), like ImageNet's (mean ~110 KB). Each image's pixel count is chosen
  so that its JPEG lands near its drawn size, using a linear model (bytes = a + b * pixels)
  calibrated once per run on two reference images. The default ``photo`` style (a smooth
  random field plus grain) compresses to ~0.6 bytes/pixel, like real photos, so a 110 KB
  file has ~190k pixels and costs about what an ImageNet JPEG costs to decode; ``noise``
  (uniform noise) has ~1/3 of the pixels for the same size.
* **tiny** (``--tiny``): up to 1,000,000 files of a few bytes each, spread over
  ``--classes`` directories, written with plain ``os.write`` (for listing, namespace and
  remount tests).

The same arguments give a byte-identical tree (same names, bytes and mtimes), given the
same numpy / Pillow / libjpeg build: every file has its own random stream, derived from
(seed, class, index), so the files can be made in parallel in any order.

``OUT/MANIFEST.json`` is written last: its presence means the tree is complete. It holds
the parameters, the counts, the size statistics and a digest of the whole tree (and, for
images, every file's hash), which :func:`load_if_matches` uses to reuse a tree.

CLI::

    python -m bench.make_dataset OUT --classes 10 --per-class 300 --seed 0 [--mean-kb 110]
    python -m bench.make_dataset OUT --tiny --classes 1000 --per-class 1000 --seed 0
"""

from __future__ import annotations

import argparse
import io
import json
import math
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

from .util import HASH_NAME, file_hash, tree_digest, write_json

MANIFEST = "MANIFEST.json"
FORMAT = 1
#: every generated file gets this mtime (2020-01-01T00:00:00Z), so trees compare equal
FIXED_MTIME_NS = 1_577_836_800 * 10**9
TINY_MAX_FILES = 1_000_000
#: (width, height) ratios of generated images, chosen per file
ASPECTS = ((4, 3), (3, 4), (1, 1), (3, 2), (16, 9))
#: clamp of a drawn size, as a fraction / multiple of the mean
MIN_FRACTION, MAX_MULTIPLE = 0.05, 20.0


@dataclass(frozen=True)
class Spec:
    classes: int
    per_class: int
    seed: int = 0
    mean_kb: float = 110.0
    sigma: float = 0.5
    quality: int = 90
    style: str = "photo"  # "photo" | "noise"
    tiny: bool = False

    @property
    def files(self) -> int:
        return self.classes * self.per_class

    def key(self) -> dict:
        """The parameters that decide the bytes of the tree."""
        d = asdict(self)
        if self.tiny:  # image parameters do not matter for tiny files
            for k in ("mean_kb", "sigma", "quality", "style"):
                d.pop(k)
        d["format"] = FORMAT
        return d


def class_name(c: int) -> str:
    return f"n{c:08d}"  # ImageNet-like (n01440764), sorts like the index


def rel_path(spec: Spec, c: int, i: int) -> str:
    return f"train/{class_name(c)}/{i}.{'txt' if spec.tiny else 'jpg'}"


# ----- images --------------------------------------------------------------------------

def _rng(seed: int, c: int, i: int):
    import numpy as np

    return np.random.default_rng(np.random.SeedSequence([seed, c, i, FORMAT]))


def _pixels(rng, w: int, h: int, style: str):
    """An RGB array of shape (h, w, 3)."""
    import numpy as np
    from PIL import Image

    if style == "noise":
        return np.frombuffer(rng.bytes(w * h * 3), np.uint8).reshape(h, w, 3)
    # photo: a random field at 1/16 resolution, upsampled (smooth regions and edges),
    # plus grain of +-32, which is what makes it cost ~0.6 bytes/pixel at quality 90
    lo = np.frombuffer(rng.bytes(max(2, h // 16) * max(2, w // 16) * 3), np.uint8)
    lo = lo.reshape(max(2, h // 16), max(2, w // 16), 3)
    base = np.asarray(Image.fromarray(lo).resize((w, h), Image.BILINEAR), dtype=np.int16)
    grain = np.frombuffer(rng.bytes(w * h * 3), np.uint8).reshape(h, w, 3) >> 2
    return np.clip(base + grain.astype(np.int16) - 32, 0, 255).astype(np.uint8)


def _encode(arr, quality: int) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _dims(pixels: float, aspect: tuple[int, int]) -> tuple[int, int]:
    aw, ah = aspect
    w = max(16, round(math.sqrt(pixels * aw / ah)))
    h = max(16, round(pixels / w))
    return w, h


def calibrate(quality: int, style: str) -> tuple[float, float]:
    """(a, b) of bytes ~ a + b * pixels, from two reference images (deterministic)."""
    import numpy as np

    pts = []
    for k, px in enumerate((60_000, 360_000)):
        rng = np.random.default_rng(np.random.SeedSequence([0xCA1, k, FORMAT]))
        w, h = _dims(px, (4, 3))
        pts.append((w * h, len(_encode(_pixels(rng, w, h, style), quality))))
    (p0, s0), (p1, s1) = pts
    b = (s1 - s0) / (p1 - p0)
    return s0 - b * p0, b


def _target_size(rng, spec: Spec) -> int:
    mean = spec.mean_kb * 1000.0
    mu = math.log(mean) - spec.sigma**2 / 2  # so that E[size] = mean
    size = float(rng.lognormal(mu, spec.sigma))
    return int(min(max(size, MIN_FRACTION * mean), MAX_MULTIPLE * mean))


def image_bytes(spec: Spec, c: int, i: int, model: tuple[float, float]) -> tuple[bytes, int]:
    """The JPEG of file (c, i) and the size it was aiming at."""
    rng = _rng(spec.seed, c, i)
    target = _target_size(rng, spec)
    aspect = ASPECTS[int(rng.integers(len(ASPECTS)))]
    a, b = model
    w, h = _dims(max((target - a) / b, 256.0), aspect)
    return _encode(_pixels(rng, w, h, spec.style), spec.quality), target


_MODEL: tuple[float, float] | None = None


def _init_worker(model: tuple[float, float]) -> None:
    global _MODEL
    _MODEL = model


def _make_class(args: tuple[str, Spec, int]) -> list[tuple[str, int, str, int]]:
    out, spec, c = args
    assert _MODEL is not None
    d = os.path.join(out, "train", class_name(c))
    os.makedirs(d, exist_ok=True)
    rows = []
    for i in range(spec.per_class):
        data, target = image_bytes(spec, c, i, _MODEL)
        path = os.path.join(d, f"{i}.jpg")
        with open(path, "wb") as f:
            f.write(data)
        os.utime(path, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS))
        rows.append((rel_path(spec, c, i), len(data), file_hash(data), target))
    return rows


def _make_images(out: str, spec: Spec, workers: int, progress: bool) -> dict:
    import multiprocessing as mp

    model = calibrate(spec.quality, spec.style)
    rows: list[tuple[str, int, str, int]] = []
    tasks = [(out, spec, c) for c in range(spec.classes)]
    t0 = time.perf_counter()
    if workers > 1 and spec.classes > 1:
        ctx = mp.get_context("fork")
        with ctx.Pool(workers, initializer=_init_worker, initargs=(model,)) as pool:
            for k, r in enumerate(pool.imap_unordered(_make_class, tasks), 1):
                rows += r
                if progress:
                    _show(k, spec.classes, len(rows), t0)
    else:
        _init_worker(model)
        for k, t in enumerate(tasks, 1):
            rows += _make_class(t)
            if progress:
                _show(k, spec.classes, len(rows), t0)
    sizes = sorted(r[1] for r in rows)
    targets = [r[3] for r in rows]
    mean = sum(sizes) / len(sizes)
    return {
        "calibration": {"bytes_per_pixel": model[1], "intercept_bytes": model[0]},
        "size_stats": {
            "mean_kb": mean / 1000,
            "target_mean_kb": spec.mean_kb,
            "drawn_mean_kb": sum(targets) / len(targets) / 1000,
            "mean_error": mean / (spec.mean_kb * 1000) - 1,
            "median_kb": sizes[len(sizes) // 2] / 1000,
            "min_kb": sizes[0] / 1000,
            "max_kb": sizes[-1] / 1000,
        },
        "file_list": [[r[0], r[1], r[2]] for r in sorted(rows)],
        "_rows": rows,
    }


def _show(k: int, n: int, files: int, t0: float) -> None:
    if sys.stderr.isatty():
        sys.stderr.write(f"\rmake_dataset: {k}/{n} directories, {files:,} files, "
                         f"{time.perf_counter() - t0:.1f} s")
        sys.stderr.flush()
        if k == n:
            sys.stderr.write("\n")


# ----- tiny files ----------------------------------------------------------------------

def tiny_bytes(spec: Spec, c: int, i: int) -> bytes:
    return f"{spec.seed}:{c}:{i}\n".encode()


def _make_tiny_class(out: str, spec: Spec, c: int) -> tuple[int, str]:
    d = os.path.join(out, "train", class_name(c))
    os.makedirs(d, exist_ok=True)
    total = 0
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    lines = []
    for i in range(spec.per_class):
        data = tiny_bytes(spec, c, i)
        path = os.path.join(d, f"{i}.txt")
        fd = os.open(path, flags, 0o644)
        try:
            os.write(fd, data)
            os.utime(fd, ns=(FIXED_MTIME_NS, FIXED_MTIME_NS))
        finally:
            os.close(fd)
        total += len(data)
        lines.append((rel_path(spec, c, i), len(data), file_hash(data)))
    return total, tree_digest(lines)


def _make_tiny(out: str, spec: Spec, workers: int, progress: bool) -> dict:
    if spec.files > TINY_MAX_FILES:
        raise ValueError(f"--tiny makes at most {TINY_MAX_FILES:,} files "
                         f"({spec.classes} x {spec.per_class} = {spec.files:,})")
    t0 = time.perf_counter()
    digests: list[tuple[str, int, str]] = []
    total = 0
    # os.open/write/close release the GIL: threads keep the disk and both cores busy
    with ThreadPoolExecutor(max(1, workers * 2)) as ex:
        futs = [ex.submit(_make_tiny_class, out, spec, c) for c in range(spec.classes)]
        for k, fut in enumerate(futs, 1):
            n, dg = fut.result()
            total += n
            digests.append((class_name(k - 1), n, dg))
            if progress:
                _show(k, spec.classes, k * spec.per_class, t0)
    # the tree digest of a tiny tree is a digest of per-directory digests (no file list)
    return {"tiny_total_bytes": total, "_dir_digests": digests}


# ----- the public entry points ----------------------------------------------------------

def make_dataset(out: str, spec: Spec, *, workers: int | None = None, clean: bool = True,
                 progress: bool = False) -> dict:
    """Build the tree under ``out`` and return its manifest (also written to
    ``out/MANIFEST.json``, last). An existing ``out/train`` is removed first when
    ``clean`` (so that no file of an older tree survives)."""
    if spec.classes < 1 or spec.per_class < 1:
        raise ValueError("--classes and --per-class must be >= 1")
    if spec.style not in ("photo", "noise"):
        raise ValueError(f"unknown style {spec.style!r}")
    workers = workers or len(os.sched_getaffinity(0))
    os.makedirs(out, exist_ok=True)
    with_manifest = os.path.join(out, MANIFEST)
    if os.path.exists(with_manifest):
        os.unlink(with_manifest)
    if clean and os.path.isdir(os.path.join(out, "train")):
        shutil.rmtree(os.path.join(out, "train"))
    t0 = time.perf_counter()
    if spec.tiny:
        body = _make_tiny(out, spec, workers, progress)
        digest = tree_digest(body.pop("_dir_digests"))
        total = body["tiny_total_bytes"]
    else:
        body = _make_images(out, spec, workers, progress)
        rows = body.pop("_rows")
        digest = tree_digest((r[0], r[1], r[2]) for r in rows)
        total = sum(r[1] for r in rows)
    # directories get the fixed mtime too (after their files were created)
    for c in range(spec.classes):
        os.utime(os.path.join(out, "train", class_name(c)), ns=(FIXED_MTIME_NS,) * 2)
    os.utime(os.path.join(out, "train"), ns=(FIXED_MTIME_NS,) * 2)
    manifest = {
        "format": FORMAT,
        "spec": spec.key(),
        "root": "train",
        "files": spec.files,
        "total_bytes": total,
        "hash": HASH_NAME,
        "tree_digest": digest,
        "make_seconds": round(time.perf_counter() - t0, 3),
        "workers": workers,
        **body,
    }
    write_json(with_manifest, manifest)
    return manifest


def load_manifest(out: str) -> dict | None:
    try:
        with open(os.path.join(out, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def load_if_matches(out: str, spec: Spec) -> dict | None:
    """The manifest of a complete tree made with ``spec`` whose files are all present
    with their recorded sizes (a cheap check: sizes, not bytes); else None."""
    m = load_manifest(out)
    if m is None or m.get("spec") != spec.key() or m.get("hash") != HASH_NAME:
        return None
    try:
        if spec.tiny:
            for c in range(spec.classes):
                if len(os.listdir(os.path.join(out, "train", class_name(c)))) != spec.per_class:
                    return None
        else:
            for rel, size, _ in m["file_list"]:
                if os.stat(os.path.join(out, rel)).st_size != size:
                    return None
    except OSError:
        return None
    return m


def ensure_dataset(out: str, spec: Spec, *, workers: int | None = None,
                   progress: bool = False) -> tuple[dict, bool]:
    """(manifest, reused): reuse the tree at ``out`` if it matches, else (re)make it."""
    m = load_if_matches(out, spec)
    if m is not None:
        return m, True
    return make_dataset(out, spec, workers=workers, progress=progress), False


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.make_dataset",
        description="Make a deterministic synthetic ImageFolder tree OUT/train/<class>/<i>.jpg "
                    "(or, with --tiny, many tiny files) for the dlcachefs benchmarks.")
    p.add_argument("out", metavar="OUT", help="output directory (its train/ is replaced)")
    p.add_argument("--classes", type=int, required=True, help="number of class directories")
    p.add_argument("--per-class", type=int, required=True, help="files per class directory")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--mean-kb", type=float, default=110.0,
                   help="mean file size in KB (1000 bytes) of the lognormal (default 110)")
    p.add_argument("--sigma", type=float, default=0.5,
                   help="sigma of the lognormal file sizes (default 0.5)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality (default 90)")
    p.add_argument("--style", choices=["photo", "noise"], default="photo",
                   help="image content: photo-like (~0.6 B/pixel, realistic decode cost) or "
                        "uniform noise (default photo)")
    p.add_argument("--tiny", action="store_true",
                   help="metadata mode: tiny text files (a few bytes), no PIL, up to 1,000,000")
    p.add_argument("--workers", type=int, default=None,
                   help="parallel workers (default: usable CPUs)")
    p.add_argument("--reuse", action="store_true",
                   help="keep an existing complete tree made with the same arguments")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    spec = Spec(classes=a.classes, per_class=a.per_class, seed=a.seed, mean_kb=a.mean_kb,
                sigma=a.sigma, quality=a.quality, style=a.style, tiny=a.tiny)
    try:
        if a.reuse:
            m, reused = ensure_dataset(a.out, spec, workers=a.workers, progress=True)
        else:
            m, reused = make_dataset(a.out, spec, workers=a.workers, progress=True), False
    except ValueError as e:
        print(f"make_dataset: {e}", file=sys.stderr)
        return 2
    summary = {k: v for k, v in m.items() if k != "file_list"}
    summary["reused"] = reused
    print(json.dumps(summary, indent=2))
    err = m.get("size_stats", {}).get("mean_error")
    if err is not None and abs(err) > 0.15:
        print(f"make_dataset: warning: mean size is {err:+.0%} off the target", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
