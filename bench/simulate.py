"""``dlcachefs simulate`` over several traces, with plots: hit ratio by cache size.

    python -m bench.simulate [--samples 5000] [--epochs 8] [--out bench/results/simulate]

Runs the simulator (every registered policy and Belady's bound; cache sizes 10-80% of
the dataset) on three generated multi-epoch traces: torch's ``RandomSampler`` order,
``DistributedSampler`` (world 1), and iCACHE's importance sampling (IIS; icache then
also with substitution). Writes ``<out>.json``, ``<out>.md`` and one PNG per trace.
"""

from __future__ import annotations

import argparse
import json
import os

from dlcachefs.policies import registry

from dlcachefs.sim.simulate import generate_trace, simulate, table

FRACTIONS = (0.1, 0.2, 0.4, 0.6, 0.8)


def plot(result: dict, title: str, path: str) -> str:
    from bench.plots import _plt

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    fr = [r["fraction"] * 100 for r in result["rows"]]
    for p in [*result["policies"], "belady"]:
        ax.plot(fr, [r[p]["hit_ratio"] for r in result["rows"]], marker="o", label=p,
                linestyle="--" if p == "belady" else "-")
    ax.set_xlabel("cache size (% of the dataset)")
    ax.set_ylabel("hit ratio")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=5000)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/simulate")
    a = ap.parse_args(argv)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    pols = sorted(registry())
    doc, md = {}, []
    for sampler in ("random", "distributed", "iis"):
        trace = generate_trace(a.samples, a.epochs, sampler, a.seed)
        names = pols + (["icache+substitute"] if sampler == "iis" else [])
        res = simulate(trace, pols, FRACTIONS)
        if sampler == "iis":
            sub = simulate(trace, ["icache"], FRACTIONS, substitute=True)
            for row, srow in zip(res["rows"], sub["rows"], strict=True):
                row["icache+substitute"] = srow["icache"]
            res["policies"] = names
        doc[sampler] = res
        title = (f"{sampler} sampler: {a.samples} samples, {a.epochs} epochs "
                 f"({res['dataset_bytes'] / 1e9:.2f} GB)")
        md += [f"### {title}", "", table(res), ""]
        plot(res, title, f"{a.out}-{sampler}.png")
    with open(a.out + ".json", "w") as f:
        json.dump(doc, f, indent=1)
    with open(a.out + ".md", "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
