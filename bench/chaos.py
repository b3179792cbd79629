"""Faults on purpose, long: kill -9 cycles, damaged cache files, a misbehaving source, a
full cache disk and a memory limit, a soak of many readers, fuzzed control writes. The
scenarios are :mod:`dlcachefs.testing.scenarios` (the test suite runs them short,
``tests/test_t7_chaos.py``); this prints their counts as JSON and writes them to
``bench/results/chaos-<UTC time>.json``.

    sudo .venv/bin/python -m bench.chaos                       # every scenario, full size
    sudo .venv/bin/python -m bench.chaos --scenario kill,fuzz --cycles 100 --fuzz 100000
    sudo .venv/bin/python -m bench.chaos --scenario corrupt --injections 150 --seeds 1001-1020

Full size (the defaults): 1,000 kill cycles, 1,000 damage injections, 200 source faults
per case, 120 s of a filling disk and of a memory limit, a 30-minute soak, 10^5 fuzzed
writes against the parser and 10^4 into a live mount. Needs root (mounts, a tmpfs,
dropping the page cache, cgroups). What must hold is in each scenario's docstring and
in ``verdict`` of the output: 0 wrong bytes, 0 lost committed records, 0 mixed reads,
the daemon up, 0 fuzz crashes and every refusal with its reason.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from dlcachefs.testing import scenarios as S

OUT = Path(__file__).parent / "results"


def verdict(r: dict) -> list[str]:
    """What in a scenario's result breaks a promise (empty: nothing)."""
    bad = []
    if r.get("skipped"):
        return bad
    for key in ("wrong_bytes_reads", "lost_committed_records", "mixed_reads",
                "injections_with_wrong_bytes", "daemon_down", "mount_failures",
                "daemon_died_before_kill", "daemon_died_with_trainer", "tracebacks",
                "verify_crashed", "unexpected_errno", "reads_after_fault_wrong",
                "source_fds_left", "source_fds_after_settle", "deleted_fds_after_settle"):
        if r.get(key):
            bad.append(f"{key}={r[key]}")
    if "daemon_up_at_end" in r and not r["daemon_up_at_end"]:
        bad.append("daemon down at the end")
    if r.get("scenario") in ("diskfull", "soak") and r.get("client_errors"):
        bad.append(f"client_errors={r['client_errors']}")
    if r.get("scenario") == "corrupt" and r.get("repair_clean", 0) < r.get("verify_runs", 0):
        bad.append("verify --repair left problems")
    if r.get("scenario") == "kill" and r.get("verify_problems"):
        bad.append(f"verify found {r['verify_problems']} problems at the end")
    for part in ("parser", "mount"):
        p = r.get(part) or {}
        for key in ("crashes", "refused_without_reason", "refused_but_changed_state"):
            if p.get(key):
                bad.append(f"{part}.{key}={p[key]}")
        if part == "mount" and p and (not p.get("daemon_up_at_end") or p.get("other_errors")):
            bad.append(f"mount: daemon_up={p.get('daemon_up_at_end')} "
                       f"other_errors={p.get('other_errors')}")
    return bad


def parse_seeds(text: str) -> list[int]:
    """``A-B`` (inclusive) or ``A,B,C``."""
    if "-" in text:
        lo, hi = (int(x) for x in text.split("-", 1))
        return list(range(lo, hi + 1))
    return [int(x) for x in text.split(",")]


#: the columns of a per-seed table, by scenario: (heading, how to read it off a result)
COLUMNS = {
    "corrupt": (("injections", lambda r: r.get("injections", 0)),
                ("detected", lambda r: r.get("detected", 0) + r.get("detected_as_errors", 0)),
                ("harmless", lambda r: r.get("harmless_or_latent", 0)),
                ("mount failures", lambda r: r.get("mount_failures", 0)),
                ("tracebacks", lambda r: r.get("tracebacks", 0)),
                ("wrong bytes", lambda r: r.get("wrong_bytes_reads", 0))),
    "kill": (("cycles", lambda r: r.get("cycles", 0)),
             ("reads", lambda r: sum(r.get(k, {}).get("reads_ok", 0)
                                     + sum(r.get(k, {}).get("errors_by_errno", {}).values())
                                     for k in ("reads", "verify_reads"))),
             ("wrong reads", lambda r: r.get("wrong_bytes_reads", 0)),
             ("lost records", lambda r: r.get("lost_committed_records", 0)),
             ("mount failures", lambda r: r.get("mount_failures", 0)),
             ("tracebacks", lambda r: r.get("tracebacks", 0)),
             ("verify problems", lambda r: r.get("verify_problems", 0))),
}


def table(scenarios: dict[str, dict]) -> str:
    """A markdown table per scenario of a ``--seeds`` run: one row per seed, the verdict
    last."""
    out = []
    for name, cols in COLUMNS.items():
        rows = [r for r in scenarios.values() if r.get("scenario") == name]
        if not rows:
            continue
        head = ["seed", *(c for c, _ in cols), "verdict"]
        out += [f"{name}:", "| " + " | ".join(head) + " |",
                "|" + "---|" * len(head)]
        for r in rows:
            v = r["verdict"] if r["verdict"] == "ok" else "; ".join(r["verdict"])
            out.append("| " + " | ".join([str(r["seed"]), *(str(f(r)) for _, f in cols), v])
                       + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos", description=__doc__.split("\n\n")[0])
    p.add_argument("--scenario", default="all",
                   help=f"comma-separated: {','.join(S.SCENARIOS)} (default all)")
    p.add_argument("--cycles", type=int, default=1000, help="kill -9 cycles")
    p.add_argument("--reorder-every", type=int, default=3,
                   help="every Nth kill cycle waits for a part-written next-epoch log "
                        "(1: all of them; 0: none)")
    p.add_argument("--injections", type=int, default=1000, help="damage injections")
    p.add_argument("--source-rounds", type=int, default=200, help="source faults per case")
    p.add_argument("--minutes", type=float, default=30.0, help="soak length")
    p.add_argument("--fill-seconds", type=float, default=120.0,
                   help="disk-full and memory-limit length")
    p.add_argument("--fuzz", type=int, default=100_000, help="fuzzed writes to the parser")
    p.add_argument("--fuzz-mount", type=int, default=10_000,
                   help="fuzzed writes to a live mount")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", default=None,
                   help="run each scenario once per seed (A-B or a comma list) and print a "
                        "table of the runs (docs/faults.md publishes one)")
    p.add_argument("--work", default=None, help="work directory (default: a new temp dir)")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    chosen = S.SCENARIOS if a.scenario == "all" else tuple(a.scenario.split(","))
    unknown = set(chosen) - set(S.SCENARIOS)
    if unknown:
        p.error(f"unknown scenario {', '.join(sorted(unknown))}")
    base = Path(a.work or tempfile.mkdtemp(prefix="dlc-chaos-"))
    log = (lambda s: None) if a.quiet else (lambda s: print(f"chaos: {s}", file=sys.stderr))
    runs = {
        "kill": lambda w: S.kill_cycles(w, a.cycles, a.seed, reorder_every=a.reorder_every,
                                        log=log),
        "corrupt": lambda w: S.corruption(w, a.injections, a.seed,
                                          verify_every=max(10, a.injections // 10), log=log),
        "source": lambda w: S.source_faults(w, a.source_rounds, a.seed, log=log),
        "diskfull": lambda w: S.disk_full(w, a.fill_seconds, a.seed, log=log),
        "memory": lambda w: S.memory_pressure(w, a.fill_seconds, a.seed, log=log),
        "soak": lambda w: S.soak(w, a.minutes * 60, a.seed, sample_every=10.0, log=log),
        "fuzz": lambda w: S.fuzz(w, a.fuzz, a.fuzz_mount, a.seed, log=log),
    }
    results: dict = {"command": " ".join(["python -m bench.chaos", *(argv or sys.argv[1:])]),
                     "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "machine": {"cpus": os.cpu_count(), "kernel": os.uname().release},
                     "scenarios": {}}
    failed = False
    seeds = parse_seeds(a.seeds) if a.seeds else [a.seed]
    for seed in seeds:
        a.seed = seed
        for name in chosen:
            log(f"--- {name} seed {seed}")
            t0 = time.monotonic()
            r = runs[name](S.fresh(base / name))
            r["seed"] = seed
            r["wall_s"] = round(time.monotonic() - t0, 1)
            r["verdict"] = verdict(r) or "ok"
            failed |= r["verdict"] != "ok"
            results["scenarios"][name if len(seeds) == 1 else f"{name}/{seed}"] = r
            log(f"{name} seed {seed}: {r['verdict']} ({r['wall_s']} s)")
    if len(seeds) > 1:
        results["table"] = table(results["scenarios"])
        print(results["table"], file=sys.stderr)
    OUT.mkdir(exist_ok=True)
    path = OUT / f"chaos-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps(results, indent=1) + "\n")
    shown = {k: {kk: vv for kk, vv in v.items() if kk != "samples"}
             for k, v in results["scenarios"].items()}
    print(json.dumps({**results, "scenarios": shown, "written": str(path)}, indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
