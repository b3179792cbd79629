"""Charts for a ``bench.run`` JSON document (matplotlib, Agg backend).

    python -m bench.plots bench/results/run-<ts>.json     # redraw the charts of a run

* ``<base>-raw.png``: raw-reader files/s by system and reader thread count (log scale);
* ``<base>-pipeline.png``: DataLoader files/s per epoch, per system and worker count,
  with the stall seconds written on the bars;
* ``<base>-hit-ratio.png``: hit ratio by cache size (fraction of the dataset), when a
  cache-size run was measured (the warm pass of the unbounded cache is the 100% point).
"""

from __future__ import annotations

import json
import os
import sys


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_raw(doc: dict, path: str) -> str | None:
    runs = doc.get("raw") or []
    if not runs:
        return None
    plt = _plt()
    labels: list[str] = []
    for r in runs:
        if r["label"] not in labels:
            labels.append(r["label"])
    threads = sorted({r["threads"] for r in runs})
    width = 0.8 / len(threads)
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(labels)), 4.8))
    for k, t in enumerate(threads):
        xs, vals = [], []
        for i, lab in enumerate(labels):
            r = next((r for r in runs if r["label"] == lab and r["threads"] == t), None)
            if r is None:
                continue
            xs.append(i + (k - (len(threads) - 1) / 2) * width)
            vals.append(r["files_per_s"])
        bars = ax.bar(xs, vals, width, label=f"{t} reader thread{'s' if t > 1 else ''}")
        ax.bar_label(bars, fmt="%.0f", fontsize=6, padding=2)
    ax.set_yscale("log")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("files/s, log scale")
    ds = doc.get("dataset", {})
    ax.set_title(f"Raw reader, {ds.get('files')} files, remote at "
                 f"{doc.get('config', {}).get('rate')}", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_pipeline(doc: dict, path: str) -> str | None:
    runs = doc.get("pipeline") or []
    if not runs:
        return None
    plt = _plt()
    labels = [f"{p['system']}\n{p['sampler']} w={p['workers']}" for p in runs]
    epochs = sorted({e["epoch"] for p in runs for e in p["epochs"]})
    width = 0.8 / max(1, len(epochs))
    fig, ax = plt.subplots(figsize=(max(7, 1.0 * len(labels)), 4.8))
    for k, ep in enumerate(epochs):
        xs, vals, stalls = [], [], []
        for i, p in enumerate(runs):
            e = next((e for e in p["epochs"] if e["epoch"] == ep), None)
            if e is None:
                continue
            xs.append(i + (k - (len(epochs) - 1) / 2) * width)
            vals.append(e["files_per_s"])
            stalls.append(f"{e['stall_s']:.1f}s")
        bars = ax.bar(xs, vals, width, label=f"epoch {ep + 1}")
        ax.bar_label(bars, labels=stalls, fontsize=6, padding=2)
    ax.set_xticks(range(len(labels)), labels, fontsize=7)
    ax.set_ylabel("files/s (label: stall seconds)")
    ax.set_title("Training input pipeline (ImageFolder + DataLoader), files/s per epoch",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_hit_ratio(doc: dict, path: str) -> str | None:
    runs = doc.get("raw") or []
    pts: dict[int, list[tuple[float, float]]] = {}
    for r in runs:
        if r.get("hit_ratio") is None:
            continue
        if "cache_fraction" in r and r["phase"] == "pass2":
            pts.setdefault(r["threads"], []).append((r["cache_fraction"], r["hit_ratio"]))
        elif r["label"] == "dlcachefs warm":
            pts.setdefault(r["threads"], []).append((1.0, r["hit_ratio"]))
    if not any(f < 1.0 for v in pts.values() for f, _ in v):
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for t, v in sorted(pts.items()):
        v.sort()
        ax.plot([f * 100 for f, _ in v], [h for _, h in v], marker="o", label=f"{t} threads")
    ax.set_xlabel("cache size, % of the dataset")
    ax.set_ylabel("hit ratio, second pass")
    ax.set_ylim(0, 1.05)
    ax.set_title("dlcachefs hit ratio by cache size (LRU; Belady not computed)", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_all(doc: dict, base: str) -> list[str]:
    """Draw every chart the document has data for; returns the paths written."""
    out = []
    for fn, suffix in ((plot_raw, "-raw.png"), (plot_pipeline, "-pipeline.png"),
                       (plot_hit_ratio, "-hit-ratio.png")):
        p = fn(doc, base + suffix)
        if p:
            out.append(p)
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m bench.plots RUN.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        doc = json.load(f)
    for p in plot_all(doc, os.path.splitext(argv[0])[0]):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
