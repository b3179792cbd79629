"""Training fidelity under a cache smaller than the dataset: does a variant of the cache
(importance sampling + substitution, iCACHE) keep the model's accuracy while reading fewer
bytes from the source?

    sudo .venv/bin/python -m bench.fidelity [--seeds 3] [--epochs 15] [--variants baseline,icache]
                                            [--cache-frac 0.2] [--source-delay-ms 2]
                                            [--h-fraction F] [--beta B] [--warmup N]
                                            [--out bench/results/fidelity.json]

Data: scikit-learn's digits as a PNG ImageFolder tree (bench/digits.py: 1,438 train and
359 test images of 32x32, ~190 bytes each), in ``--workdir`` (bench/out/fidelity/).

For every seed and every variant, the same small CNN (2 conv layers + linear, CPU,
``torch.manual_seed(seed)``, deterministic algorithms, ``--threads`` intra-op threads)
trains for ``--epochs`` epochs with ``torchvision.datasets.ImageFolder`` +
``DataLoader(num_workers=2, batch_size=64)`` over the TRAIN folder read through a fresh
dlcachefs mount of the digits directory (or of the slowed source, below; empty cache, ``--cache-size`` = ``--cache-frac``
of the train bytes, the same for every variant, ``--chunk-size`` small enough that the
cache holds many chunks). After every epoch the model is evaluated on the TEST folder read
from local disk (not through the mount); ``test_top1`` is the accuracy after the last one.
The mount's ``.dlcache/stats`` are read after every epoch and at the end, then it is
unmounted (always, also on failure).

Variants (``--variants``, comma-separated):

* ``baseline``: ``--policy lru``; ``RandomSampler`` with its own ``torch.Generator``
  seeded with ``seed`` (full epochs, a new permutation each); mean cross-entropy.
  Nothing is announced to the mount.
* ``icache``: mount with ``--policy icache:package=<chunk size> --substitute`` (the
  default 1 MiB package would not fit this cache; ``--icache-policy`` changes it); the
  dataset is ``dlcachefs.torch.with_index(ImageFolder(root))`` (items ``(img, target, index)``),
  the sampler ``ImportanceSampler(ds, seed=seed)`` (``set_epoch`` each epoch; it
  announces each epoch's order to the mount), per-sample losses
  (``cross_entropy(reduction="none")``, detached) go to ``sampler.record`` and
  ``LossReporter(root).report`` every batch, ``LossReporter.flush()`` at epoch end; the
  model trains on their mean. ``--h-fraction`` (the mount's), ``--beta``, ``--warmup``,
  ``--full-every`` (the sampler's) change only this variant; unset, the defaults hold.
  When ``dlcachefs.torch`` lacks one of these, or the mount refuses the options, the
  variant is reported as ``skipped`` with the reason: never faked.
* ``local``: the baseline's training on the local train folder, no mount (a reference:
  its accuracy must equal the baseline's bit for bit, the mount serves the same bytes).

``--source-delay-ms`` (alias ``--slow-ms``, default 2): every dlcachefs mount then reads
the digits through a fresh ``bench.passthrough --delay-ms`` FUSE mount (``--workdir``/src,
every open waits that long; concurrent opens overlap), started for the run and unmounted
after it, always: dlcachefs first, then the passthrough. 0: dlcachefs reads the local
directory directly. The delay changes the wall time, not ``bytes_from_source``.

Output: the JSON document in ``--out`` (per run: ``test_top1``, ``epochs``,
``samples_seen``, ``bytes_from_source``, the mount's stats at the end without
``streams``, per-epoch loss/accuracy/stats deltas, ``wall_s``), a markdown summary next
to it (``.md``) and on stdout: per variant, test top-1 mean ± std over seeds, its
difference from the baseline in points, mean bytes from the source and their ratio to the
baseline's, hits, misses, substitutions. Progress goes to stderr. Exit status 1 when a
run failed (a skipped variant is not a failure); a failed run keeps the tail of the
daemon's log (``daemon_log_tail``, ``daemon_error``).

``--core-rev REV`` runs the daemon from a committed revision (``git archive`` into the
workdir, read-only) instead of the working tree, for when the tree is mid-edit; the
training side still imports the working tree. ``config.core`` says which ran.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dlcachefs.mountctl import is_mounted, unmount

from .digits import write_digits
from .mounting import DlcMount, MountError, counter_delta, dlcachefs_exe
from .passthrough import passthrough_mount
from .util import machine_info, write_json

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
VARIANTS = ("baseline", "icache", "local")
#: stats fields left out of the per-run copy (large or per-stream detail)
BIG_STATS_FIELDS = frozenset({"streams"})
#: per-epoch counters kept from the stats delta (plus any key naming substitution)
EPOCH_COUNTERS = ("bytes_from_source", "bytes_from_cache", "hits", "misses", "prefetched",
                  "chunks_evicted", "chunk_reads", "record_reads")


def log(msg: str) -> None:
    print(f"fidelity: {msg}", file=sys.stderr, flush=True)


class Skipped(Exception):
    """The variant cannot run on this tree (missing API, refused mount options)."""


# ----- model and data ---------------------------------------------------------------------

def make_model(side: int, classes: int):
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * (side // 4) * (side // 4), classes),
    )


def make_transform():
    from torchvision import transforms

    # ImageFolder's default loader opens as RGB; back to one channel
    return transforms.Compose([transforms.Grayscale(1), transforms.ToTensor(),
                               transforms.Normalize((0.5,), (0.5,))])


def evaluate(model, root: str, batch_size: int = 512) -> float:
    import torch
    from torchvision.datasets import ImageFolder

    ds = ImageFolder(root, transform=make_transform())
    dl = torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=False, num_workers=0)
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for x, y in dl:
            correct += int((model(x).argmax(1) == y).sum())
            total += int(y.numel())
    model.train()
    return correct / total


# ----- the training-loop adapters ---------------------------------------------------------

class PlainAdapter:
    """ImageFolder + RandomSampler with its own generator seeded with ``seed``: the
    baseline (full epochs, a new permutation each epoch from that generator; nothing is
    announced to the mount)."""

    per_sample_losses = False

    def __init__(self, root: str, seed: int, a: argparse.Namespace | None = None) -> None:
        import torch
        from torchvision.datasets import ImageFolder

        self.dataset = ImageFolder(root, transform=make_transform())
        g = torch.Generator()
        g.manual_seed(seed)
        self.sampler = torch.utils.data.RandomSampler(self.dataset, generator=g)

    def start_epoch(self, epoch: int) -> None:
        pass

    def unpack(self, batch):
        x, y = batch
        return x, y, None

    def after_batch(self, indices, losses) -> None:
        pass

    def end_epoch(self) -> None:
        pass

    def finish(self) -> None:
        pass


ICACHE_API = ("LossReporter", "ImportanceSampler", "with_index")


def icache_api():
    """(LossReporter, ImportanceSampler, with_index) from dlcachefs.torch, or Skipped."""
    try:
        import dlcachefs.torch as dt
    except Exception as e:  # pragma: no cover - the module exists in this tree
        raise Skipped(f"import dlcachefs.torch failed: {e!r}") from None
    missing = [n for n in ICACHE_API if not hasattr(dt, n)]
    if missing:
        raise Skipped(f"dlcachefs.torch has no {', '.join(missing)} yet")
    return dt.LossReporter, dt.ImportanceSampler, dt.with_index


def sampler_kwargs(a: argparse.Namespace | None) -> dict:
    """ImportanceSampler's options given on the command line (none: its defaults)."""
    if a is None:
        return {}
    return {k: getattr(a, k) for k in ("beta", "warmup", "full_every")
            if getattr(a, k, None) is not None}


class ICacheAdapter:
    """The importance-sampling API, called in exactly one place:

        ds = with_index(ImageFolder(root))      # items (img, target, index)
        rep = LossReporter(root)
        sampler = ImportanceSampler(ds, seed=seed)   # (+ --beta/--warmup/--full-every)
        per epoch: sampler.set_epoch(e); per batch: sampler.record(idx, losses),
                   rep.report(idx, losses); at the end of the epoch: rep.flush()
    """

    per_sample_losses = True

    def __init__(self, root: str, seed: int, a: argparse.Namespace | None = None) -> None:
        from torchvision.datasets import ImageFolder

        LossReporter, ImportanceSampler, with_index = icache_api()
        self.dataset = with_index(ImageFolder(root, transform=make_transform()))
        self.reporter = LossReporter(root)
        self.sampler = ImportanceSampler(self.dataset, seed=seed, **sampler_kwargs(a))

    def start_epoch(self, epoch: int) -> None:
        self.sampler.set_epoch(epoch)

    def unpack(self, batch):
        x, y, idx = batch
        return x, y, idx

    def after_batch(self, indices, losses) -> None:
        self.sampler.record(indices, losses)
        self.reporter.report(indices, losses)

    def end_epoch(self) -> None:
        self.reporter.flush()

    def finish(self) -> None:
        close = getattr(self.reporter, "close", None)
        if close is not None:
            close()


ADAPTERS = {"baseline": PlainAdapter, "local": PlainAdapter, "icache": ICacheAdapter}


def icache_policy_spec(spec: str | None, chunk_size: int) -> str:
    """The iCACHE policy spec. Its L-cache packages default to 1 MiB, larger than this
    benchmark's whole cache (~50 KB): a package of one chunk keeps an L-cache possible."""
    return spec or f"icache:package={chunk_size}"


def mount_args(variant: str, cache_size: int, chunk_size: int, policy: str,
               icache_policy: str | None = None, h_fraction: float | None = None
               ) -> list[str]:
    args = [f"--cache-size={cache_size}", f"--chunk-size={chunk_size}", "--min-free=0"]
    if variant == "icache":
        args += [f"--policy={icache_policy_spec(icache_policy, chunk_size)}", "--substitute"]
        if h_fraction is not None:
            args.append(f"--h-fraction={h_fraction}")
        return args
    return [*args, f"--policy={policy}"]


# ----- one training run ----------------------------------------------------------------------

def substitution_keys(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if "substitut" in k and isinstance(v, (int, float))}


def small_stats(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k not in BIG_STATS_FIELDS}


def train(variant: str, seed: int, train_root: str, test_root: str, side: int, classes: int,
          a: argparse.Namespace, stats_fn=None) -> dict:
    """Train one model; ``stats_fn`` reads the mount's stats (None: no mount)."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(seed)
    torch.set_num_threads(a.threads)
    torch.use_deterministic_algorithms(True, warn_only=True)
    adapter = ADAPTERS[variant](train_root, seed, a)
    model = make_model(side, classes)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    dl = torch.utils.data.DataLoader(adapter.dataset, batch_size=a.batch_size,
                                     sampler=adapter.sampler, num_workers=a.workers)
    epochs = []
    samples_seen = 0
    t_train = time.perf_counter()
    for e in range(a.epochs):
        adapter.start_epoch(e)
        before = stats_fn() if stats_fn else None
        t0 = time.perf_counter()
        n = correct = 0
        loss_sum = 0.0
        for batch in dl:
            x, y, idx = adapter.unpack(batch)
            out = model(x)
            losses = F.cross_entropy(out, y, reduction="none")
            loss = losses.mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if adapter.per_sample_losses:
                adapter.after_batch(idx, losses.detach())
            n += int(y.numel())
            correct += int((out.argmax(1) == y).sum())
            loss_sum += float(losses.detach().sum())
        adapter.end_epoch()
        dt = time.perf_counter() - t0
        samples_seen += n
        rec = {"epoch": e, "samples": n, "seconds": round(dt, 3),
               "train_loss": round(loss_sum / max(1, n), 5),
               "train_top1": round(correct / max(1, n), 5),
               "test_top1": round(evaluate(model, test_root), 5)}
        if stats_fn:
            after = stats_fn()
            d = counter_delta(before, after)
            rec["stats_delta"] = {k: d[k] for k in d
                                  if k in EPOCH_COUNTERS or "substitut" in k}
        epochs.append(rec)
        log(f"  {variant} seed {seed} epoch {e}: loss {rec['train_loss']:.4f} "
            f"test {rec['test_top1']:.4f} ({dt:.1f} s"
            + (f", {rec['stats_delta'].get('bytes_from_source', 0)} B from source)"
               if stats_fn else ")"))
    adapter.finish()
    return {"epochs": a.epochs, "samples_seen": samples_seen,
            "train_s": round(time.perf_counter() - t_train, 3),
            "test_top1": epochs[-1]["test_top1"] if epochs else None,
            "per_epoch": epochs}


def run_one(variant: str, seed: int, data: Path, side: int, classes: int, cache_size: int,
            chunk_size: int, a: argparse.Namespace) -> dict:
    rec: dict = {"variant": variant, "seed": seed}
    t0 = time.perf_counter()
    test_root = str(data / "test")
    try:
        if variant == "icache":
            icache_api()  # skip before mounting when the API is not there
        if variant == "local":
            rec.update(train(variant, seed, str(data / "train"), test_root, side, classes, a))
        else:
            work = Path(a.workdir)
            cache = work / f"cache-{variant}-{seed}"
            shutil.rmtree(cache, ignore_errors=True)
            margs = mount_args(variant, cache_size, chunk_size, a.policy, a.icache_policy,
                               a.h_fraction if variant == "icache" else None)
            rec["mount_args"] = margs
            with contextlib.ExitStack() as stack:
                source = str(data)
                if a.source_delay_ms > 0:
                    # the slowed source: dlcachefs reads the digits through the delaying
                    # passthrough; unmounted after dlcachefs (the ExitStack closes last)
                    source = str(work / "src")
                    stack.enter_context(passthrough_mount(
                        str(data), source, delay_ms=a.source_delay_ms,
                        log_path=str(work / "passthrough.log")))
                    rec["source"] = {"passthrough": source, "delay_ms": a.source_delay_ms}
                m = DlcMount(source, str(work / "mnt"), str(cache), margs, exe=a.exe)
                try:
                    m.start()
                except MountError as e:
                    if variant == "icache":
                        raise Skipped(f"the mount refused the iCACHE options: {e}") from None
                    raise
                ok = False
                try:
                    res = train(variant, seed, os.path.join(m.mnt, "train"), test_root,
                                side, classes, a, stats_fn=m.stats)
                    final = m.stats()
                    ok = True
                finally:
                    m.umount()  # dlcachefs first; the passthrough when the stack closes
                    if not ok:  # the daemon's own account of what went wrong
                        tail = _tail(cache / "dlcachefs.log", 40)
                        rec["daemon_log_tail"] = tail
                        errs = [x for x in tail
                                if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", x)]
                        if errs:
                            rec["daemon_error"] = errs[-1]
                    if not a.keep_cache:
                        shutil.rmtree(cache, ignore_errors=True)
            rec.update(res)
            rec["bytes_from_source"] = final.get("bytes_from_source")
            rec["hits"] = final.get("hits")
            rec["misses"] = final.get("misses")
            rec["substitutions"] = substitution_keys(final)
            streams = final.get("streams") or {}
            if isinstance(streams, dict):  # per stream (job/rank): substitutions per epoch
                rec["stream_substitutions"] = {
                    k: v.get("substitutions") for k, v in streams.items()
                    if isinstance(v, dict) and v.get("substitutions")}
            rec["stats"] = small_stats(final)
        rec["status"] = "ok"
    except Skipped as e:
        rec.update(status="skipped", reason=str(e))
        log(f"{variant} seed {seed}: skipped: {e}")
    except Exception as e:
        rec.update(status="failed", error=f"{type(e).__name__}: {e}")
        log(f"{variant} seed {seed}: FAILED: {short_reason(rec['error'])}"
            + (f" (daemon: {rec['daemon_error']})" if rec.get("daemon_error") else ""))
    rec["wall_s"] = round(time.perf_counter() - t0, 3)
    return rec


def short_reason(why: str) -> str:
    """The first line of an error and its last (the root cause of a worker's traceback)."""
    lines = [x.strip() for x in why.splitlines() if x.strip()]
    return " ... ".join(dict.fromkeys([lines[0], lines[-1]])) if lines else ""


def _tail(path: Path, n: int) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[-n:]
    except OSError:
        return []


def core_from_rev(rev: str, work: Path) -> tuple[str, dict]:
    """A ``dlcachefs`` executable that runs the daemon from a committed revision (``git
    archive``, read-only) instead of the working tree: for when the tree is mid-edit.
    Returns (executable, description)."""
    sha = subprocess.run(["git", "--no-optional-locks", "-C", ROOT, "rev-parse", "--verify",
                          f"{rev}^{{commit}}"], capture_output=True, text=True, check=True
                         ).stdout.strip()
    stage = work / f"core-{sha[:12]}"
    pkg = stage / "dlcachefs"
    if not (stage / "COMPLETE").exists():
        shutil.rmtree(stage, ignore_errors=True)
        stage.mkdir(parents=True)
        archive = subprocess.run(["git", "--no-optional-locks", "-C", ROOT, "archive", sha,
                                  "dlcachefs", "mount", "policies"],
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(stage)], input=archive, check=True)
        # the installed layout (pyproject's package-dir): dlcachefs.mount, dlcachefs.policies;
        # python -P: the working directory (maybe this repository) is not put on sys.path
        (stage / "mount").rename(pkg / "mount")
        (stage / "policies").rename(pkg / "policies")
        exe = stage / "bin" / "dlcachefs"
        exe.parent.mkdir()
        exe.write_text("#!/bin/sh\n"
                       f'PYTHONPATH="{stage}${{PYTHONPATH:+:$PYTHONPATH}}" '
                       f'exec "{sys.executable}" -P -m dlcachefs.cli "$@"\n')
        exe.chmod(0o755)
        (stage / "COMPLETE").write_text(sha + "\n")
    return str(stage / "bin" / "dlcachefs"), {"rev": rev, "commit": sha, "staged": str(stage)}


# ----- summary ---------------------------------------------------------------------------------

def _mean(xs):
    return statistics.fmean(xs) if xs else None


def _std(xs):
    return statistics.stdev(xs) if len(xs) > 1 else 0.0 if xs else None


def summarize(runs: list[dict], variants: list[str]) -> list[dict]:
    rows = []
    base = None
    for v in variants:
        ok = [r for r in runs if r["variant"] == v and r["status"] == "ok"]
        other = [r for r in runs if r["variant"] == v and r["status"] != "ok"]
        row: dict = {"variant": v, "runs_ok": len(ok), "runs_total": len(ok) + len(other)}
        if not ok:
            row["status"] = other[0]["status"] if other else "not run"
            first = other[0] if other else {}
            row["reason"] = short_reason(first.get("reason") or first.get("error") or "")
            if first.get("daemon_error"):
                row["reason"] += f" (daemon: {first['daemon_error']})"
            rows.append(row)
            continue
        top1 = [r["test_top1"] for r in ok]
        row.update(status="ok", test_top1_mean=_mean(top1), test_top1_std=_std(top1),
                   test_top1=top1, wall_s_mean=_mean([r["wall_s"] for r in ok]),
                   samples_seen_mean=_mean([r["samples_seen"] for r in ok]))
        if all(r.get("bytes_from_source") is not None for r in ok):
            row["bytes_from_source_mean"] = _mean([r["bytes_from_source"] for r in ok])
            row["hits_mean"] = _mean([r["hits"] for r in ok])
            row["misses_mean"] = _mean([r["misses"] for r in ok])
            subs = [sum(r["substitutions"].values()) for r in ok if r["substitutions"]]
            row["substitutions_mean"] = _mean(subs) if subs else None
        if v == "baseline":
            base = row
        rows.append(row)
    if base is not None:
        for row in rows:
            if row.get("status") != "ok":
                continue
            row["top1_diff_points"] = 100.0 * (row["test_top1_mean"] - base["test_top1_mean"])
            b, x = base.get("bytes_from_source_mean"), row.get("bytes_from_source_mean")
            row["bytes_vs_baseline"] = x / b if b and x is not None else None
    return rows


def _fmt(x, spec: str, none: str = "-") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def markdown(doc: dict) -> str:
    c = doc["config"]
    lines = [
        f"# Training fidelity: digits, {c['seeds']} seeds x {c['epochs']} epochs, cache "
        f"{c['cache_size_bytes']:,} B ({c['cache_frac']:.0%} of {doc['dataset']['bytes']['train']:,} "
        f"train bytes), chunk {c['chunk_size_bytes']:,} B",
        "",
        "daemon: " + (f"{c['core']['rev']} ({c['core']['commit'][:12]}, git archive)"
                      if c["core"].get("rev") else "the working tree") + "; test set read "
        "from local disk",
        "",
        "| variant | runs | test top-1 % (mean ± std) | Δ top-1 vs baseline (points) | "
        "samples/run | MB from source (mean) | bytes vs baseline | hits | misses | "
        "substitutions | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["summary"]:
        if r.get("status") != "ok":
            lines.append(f"| {r['variant']} | {r['runs_ok']}/{r['runs_total']} | "
                         f"{r['status']}: {r.get('reason') or ''} | | | | | | | | |")
            continue
        mb = r.get("bytes_from_source_mean")
        lines.append(
            f"| {r['variant']} | {r['runs_ok']}/{r['runs_total']} | "
            f"{100 * r['test_top1_mean']:.2f} ± {100 * r['test_top1_std']:.2f} | "
            f"{_fmt(r.get('top1_diff_points'), '+.2f')} | "
            f"{_fmt(r.get('samples_seen_mean'), ',.0f')} | "
            f"{_fmt(mb / 1e6 if mb is not None else None, '.3f')} | "
            f"{_fmt(r.get('bytes_vs_baseline'), '.3f')} | {_fmt(r.get('hits_mean'), ',.0f')} | "
            f"{_fmt(r.get('misses_mean'), ',.0f')} | {_fmt(r.get('substitutions_mean'), ',.0f')} | "
            f"{_fmt(r.get('wall_s_mean'), '.1f')} |")
    sd = c["source_delay"]
    lines += ["", f"Source: {sd['requested_ms']:g} ms per open ({sd['how']})" if sd["applied"]
              else "Source: the local digits directory (no delay)"]
    opts = [f"--h-fraction {c['icache_h_fraction']}"] if c.get("icache_h_fraction") else []
    opts += [f"{k}={v}" for k, v in (c.get("icache_sampler_options") or {}).items()]
    lines.append("icache: " + c["icache_policy"] + " --substitute"
                 + (", " + ", ".join(opts) if opts else " (defaults)"))
    return "\n".join(lines) + "\n"


# ----- main -----------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.fidelity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (default 3)")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--variants", default="baseline,icache", help=f"of {','.join(VARIANTS)}")
    ap.add_argument("--cache-frac", type=float, default=0.2,
                    help="cache size as a fraction of the train bytes (default 0.2)")
    ap.add_argument("--cache-size", type=int, default=None, help="bytes; overrides --cache-frac")
    ap.add_argument("--chunk-size", type=int, default=None,
                    help="bytes (default: cache size / 16, at least 4096)")
    ap.add_argument("--policy", default="lru", help="eviction policy of the baseline (lru)")
    ap.add_argument("--icache-policy", default=None, metavar="SPEC",
                    help="the icache variant's --policy (default icache:package=<chunk size>)")
    ap.add_argument("--source-delay-ms", "--slow-ms", dest="source_delay_ms", type=float,
                    default=2.0, help="per-open latency of the source, ms: dlcachefs mounts "
                    "the digits through bench.passthrough --delay-ms (default 2; 0: the "
                    "local directory directly)")
    ap.add_argument("--h-fraction", type=float, default=None,
                    help="icache only: the mount's --h-fraction (default: the mount's, 0.7)")
    ap.add_argument("--beta", type=float, default=None,
                    help="icache only: ImportanceSampler beta (default: its own, 0.33)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="icache only: ImportanceSampler warmup epochs (default: its own, 2)")
    ap.add_argument("--full-every", type=int, default=None,
                    help="icache only: ImportanceSampler full_every (default: its own, 3)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--upscale", type=int, default=4)
    ap.add_argument("--core-rev", default=None, metavar="REV",
                    help="run the daemon from this git revision (git archive) instead of "
                         "the working tree")
    ap.add_argument("--exe", default=None, help="the dlcachefs executable (default: the venv's)")
    ap.add_argument("--keep-cache", action="store_true", help="keep each run's cache directory")
    ap.add_argument("--workdir", default=os.path.join(ROOT, "bench", "out", "fidelity"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "fidelity.json"))
    a = ap.parse_args(argv)
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown variant(s) {', '.join(bad)}; choose from {', '.join(VARIANTS)}")

    t_all = time.perf_counter()
    work = Path(a.workdir)
    work.mkdir(parents=True, exist_ok=True)
    data = work / "digits"
    manifest = write_digits(data, upscale=a.upscale)
    core: dict = {"rev": None, "tree": "working tree"}
    if a.core_rev:
        a.exe, core = core_from_rev(a.core_rev, work)
        log(f"daemon from {a.core_rev} ({core['commit'][:12]}), not the working tree")
    core["exe"] = a.exe or dlcachefs_exe()
    train_bytes = manifest["bytes"]["train"]
    cache_size = a.cache_size if a.cache_size is not None else int(train_bytes * a.cache_frac)
    chunk_size = a.chunk_size or max(4096, cache_size // 16)
    delay = {"requested_ms": a.source_delay_ms, "applied": a.source_delay_ms > 0,
             "how": "bench.passthrough --delay-ms (per open, trio.sleep) between the "
                    "digits directory and dlcachefs" if a.source_delay_ms > 0 else None}
    side = manifest["image_size"][0]
    classes = len(manifest["classes"])
    log(f"digits: {manifest['counts']} files, {train_bytes:,} train bytes; cache "
        f"{cache_size:,} B, chunk {chunk_size:,} B")

    # a mountpoint left by an earlier crash would make every mount fail
    for mnt in (work / "mnt", work / "src"):  # dlcachefs first, then the passthrough
        if is_mounted(mnt):
            unmount(mnt, lazy="at_once")

    runs = []
    for seed in range(a.seeds):
        for v in variants:
            log(f"{v} seed {seed}")
            r = run_one(v, seed, data, side, classes, cache_size, chunk_size, a)
            runs.append(r)
            if r["status"] == "ok":
                log(f"{v} seed {seed}: test top-1 {r['test_top1']:.4f}, "
                    f"{r.get('bytes_from_source', '-')} B from source, {r['wall_s']:.1f} s")

    doc = {
        "bench": "fidelity",
        "status": "failed" if any(r["status"] == "failed" for r in runs) else "ok",
        "config": {"seeds": a.seeds, "epochs": a.epochs, "variants": variants,
                   "cache_frac": a.cache_frac if a.cache_size is None
                   else cache_size / train_bytes,
                   "cache_size_bytes": cache_size, "chunk_size_bytes": chunk_size,
                   "policy": a.policy,
                   "icache_policy": icache_policy_spec(a.icache_policy, chunk_size),
                   "batch_size": a.batch_size, "workers": a.workers,
                   "threads": a.threads, "lr": a.lr, "optimizer": "SGD momentum 0.9",
                   "model": "conv16-pool-conv32-pool-linear",
                   "sampler": {"baseline": "RandomSampler(generator seeded with seed)",
                               "icache": "dlcachefs.torch.ImportanceSampler(ds, seed=seed"
                               + "".join(f", {k}={v}" for k, v in sampler_kwargs(a).items())
                               + ")",
                               "local": "RandomSampler(generator seeded with seed)"},
                   "icache_h_fraction": a.h_fraction,
                   "icache_sampler_options": sampler_kwargs(a),
                   "source_delay": delay, "core": core},
        "dataset": {**manifest, "path": str(data)},
        "machine": machine_info(ROOT),
        "runs": runs,
        "summary": summarize(runs, variants),
        "total_seconds": round(time.perf_counter() - t_all, 1),
    }
    md = markdown(doc)
    if a.out:
        write_json(a.out, doc)
        with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
            f.write(md)
        log(f"wrote {a.out}")
    print(md, end="")
    return 1 if doc["status"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
