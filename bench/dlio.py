"""DLIO (``dlio_benchmark``, MLPerf Storage's engine) over the slow remote, read directly
and through dlcachefs: is the first epoch through the mount ever slower?

    sudo .venv/bin/python -m bench.dlio [--rate 400mbit] [--files 3000] [--ranks 2]
                                        [--modes raw,decode] [--epochs 2]
                                        [--out bench/results/dlio.json]
    sudo .venv/bin/python -m bench.dlio --setup-only     # only build the DLIO venv

DLIO lives in its own venv (``--venv``, default ``bench/out/dlio-venv``), built on first
use (``ensure_venv``): ``dlio_benchmark`` and ``pydftracer`` with ``--no-deps`` (the wheel
declares tensorflow, nvidia-dali-cuda110, torch, torchaudio and torchvision), then only
what its PyTorch/JPEG path imports (hydra-core, omegaconf, pandas, h5py, PyYAML, mpi4py
built from source against Debian's Open MPI). torch, numpy, Pillow, psutil and dlcachefs
come from the project's venv through a ``.pth`` file (``site.addsitedir`` of this
interpreter's site-packages), so no second torch is downloaded. The project's venv, its
tests and CI never see DLIO. ``bench/dlio_launch.py`` starts DLIO with a stand-in for its
TensorFlow profiler module and holds the raw reader.

One run (needs root: network namespace, ``drop_caches``):

1. DLIO generates its JPEG dataset once (``generate_data: True``, ``--ranks`` ranks) into
   ``WORK/export/jpeg-n<FILES>/train/img_*_of_<FILES>.jpeg`` on local disk (kept and
   reused while its marker file matches the parameters).
2. ``bench.remote.slow_remote`` exports ``WORK/export`` (sshd in a netns + sshfs, both
   directions shaped to ``--rate``).
3. For every mode (``raw``: ``bench.dlio_launch.RawImageReader`` reads each file's bytes;
   ``decode``: DLIO's own ``ImageReader``, ``np.asarray(PIL.Image.open(path))``) and
   every system (``direct``: DLIO's ``data_folder`` is the sshfs mount; ``dlcachefs``: a
   fresh dlcachefs mount with an empty cache over the sshfs mount, ``--ignore-source-inode``;
   ``local``, asked for with ``--systems``: the dataset's own folder on local disk, the
   ceiling of any cache once its bytes are local),
   the page cache is dropped and ``mpirun -np RANKS --bind-to none`` runs DLIO for
   ``--epochs`` epochs (``dlcachefs run --`` around mpirun for the mount unless
   ``--no-launcher``: DLIO's PyTorch loader uses its own ``dlio_sampler``, so whether a
   stream shows in the mount's ``stats`` is recorded, not assumed).

Output (JSON on stdout and in ``--out``, markdown next to it and on stdout): per system,
mode and epoch DLIO's own ``train_throughput_samples_per_second`` (summed over the
ranks), the epoch's wall time, and the ratio dlcachefs / direct per mode and epoch; per
system and mode the time of all epochs against direct's, and, with ``local`` run, the
bound of any cache: its first epoch no faster than the dataset's bytes over the link at
``--rate`` (nor than the local copy's first epoch), the later ones no faster than the
local copy's; plus
bytes over the network, daemon CPU, the mount's counter deltas and its streams. Timings
are reported, never asserted. Everything mounted is unmounted, the remote torn down, and
only processes this run started are ended, by pid.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Sequence

from dlcachefs.mountctl import end_pid

from .mounting import DlcMount, counter_delta, dlcachefs_exe
from .remote import slow_remote
from .util import drop_page_cache, machine_info, net_rx, proc_cpu_seconds, write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_WORK = os.path.join(REPO, "bench", "out", "dlio")
DEFAULT_VENV = os.path.join(REPO, "bench", "out", "dlio-venv")
DLIO_VERSION = "2.0.0"
#: installed with --no-deps: DLIO's wheel would pull tensorflow, DALI and a second torch
NO_DEPS_PKGS = (f"dlio_benchmark=={DLIO_VERSION}", "pydftracer==1.0.2")
#: what DLIO's PyTorch + JPEG/PNG path imports that the project's venv lacks
DEPS_PKGS = ("hydra-core>=1.3.2", "omegaconf>=2.2.0", "pandas>=1.5.1", "h5py>=3.11.0",
             "PyYAML>=6.0.0")
MODES = {"raw": "bench.dlio_launch.RawImageReader", "decode": None}


class DlioError(RuntimeError):
    """DLIO could not be installed or did not run to its end."""


def log(msg: str) -> None:
    print(f"[dlio {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----- the DLIO venv ---------------------------------------------------------------------------

def venv_python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def _venv_ok(py: str) -> bool:
    probe = ("import dlio_benchmark, mpi4py, hydra, omegaconf, pandas, h5py, yaml, torch, "
             "PIL, psutil, dftracer; from mpi4py import MPI")
    try:
        return subprocess.run([py, "-c", probe], capture_output=True, timeout=300,
                              cwd="/").returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _pip(py: str, *args: str) -> None:
    cmd = [py, "-m", "pip", "--disable-pip-version-check", "-q", "install", *args]
    log("pip install " + " ".join(args))
    r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if r.returncode != 0:
        raise DlioError(f"pip {' '.join(args)} failed ({r.returncode}): {r.stderr.strip()[-2000:]}")


def ensure_venv(venv: str = DEFAULT_VENV) -> str:
    """Build DLIO's venv when it is missing or incomplete; returns its python. See the
    module doc for what goes in. Needs ``mpicc`` (Debian ``libopenmpi-dev``) for mpi4py."""
    py = venv_python(venv)
    if os.path.exists(py) and _venv_ok(py):
        return py
    import torch  # noqa: F401 - DLIO's PyTorch path needs the project's torch

    if not shutil.which("mpicc") or not shutil.which("mpirun"):
        raise DlioError("mpicc/mpirun not found: apt-get install -y openmpi-bin libopenmpi-dev "
                        "(or DLCACHEFS_BENCH=1 bash scripts/setup.sh)")
    if not os.path.exists(py):
        base = getattr(sys, "_base_executable", None) or sys.executable
        log(f"creating {venv} with {base}")
        subprocess.run([base, "-m", "venv", venv], check=True)
    # the project's site-packages (torch, numpy, Pillow, psutil, dlcachefs) after DLIO's
    # own; addsitedir also reads the .pth files there (the editable dlcachefs, a shared venv)
    purelib = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    ours = sysconfig.get_paths()["purelib"]
    with open(os.path.join(purelib, "zz_dlcachefs_project.pth"), "w") as f:
        f.write(f"import site; site.addsitedir({ours!r})\n")
    _pip(py, "--no-deps", *NO_DEPS_PKGS)
    _pip(py, *DEPS_PKGS)
    # from source, against the system's Open MPI (a few minutes on 2 cores)
    _pip(py, "--no-binary=mpi4py", "mpi4py>=3.1.4")
    if not _venv_ok(py):
        raise DlioError(f"{venv} was built but does not import DLIO and its dependencies")
    log(f"DLIO venv ready: {venv}")
    return py


# ----- DLIO configuration and runs ---------------------------------------------------------------

def workload_yaml(*, data_folder: str, files: int, output: str, generate: bool, train: bool,
                  epochs: int, batch_size: int, read_threads: int, computation_time: float,
                  record_length: int, record_length_stdev: int, shuffle: str,
                  reader_class: str | None, fmt: str = "jpeg") -> str:
    """A DLIO workload file (its ``configs/workload/*.yaml`` schema)."""
    lines = [
        "model: dlcbench",
        "framework: pytorch",
        "workflow:",
        f"  generate_data: {generate}",
        f"  train: {train}",
        "  evaluation: False",
        "  checkpoint: False",
        "  profiling: False",
        "dataset:",
        f"  data_folder: {data_folder}",
        f"  format: {fmt}",
        f"  num_files_train: {files}",
        "  num_files_eval: 0",
        "  num_samples_per_file: 1",
        f"  record_length: {record_length}",
        f"  record_length_stdev: {record_length_stdev}",
        "  num_subfolders_train: 0",
        "reader:",
        "  data_loader: pytorch",
        f"  batch_size: {batch_size}",
        f"  read_threads: {read_threads}",
        # quoted: YAML 1.1 reads a bare off as false. file_shuffle is left out: DLIO
        # 2.0.0 keeps it as a string, and any string (even 'off') then counts as "on".
        f"  sample_shuffle: '{shuffle}'",
    ]
    if reader_class:
        lines.append(f"  reader_classname: {reader_class}")
    lines += [
        "train:",
        f"  epochs: {epochs}",
        f"  computation_time: {computation_time}",
        "output:",
        f"  folder: {output}",
        "",
    ]
    return "\n".join(lines)


def run_dlio(py: str, ranks: int, yaml_text: str, rundir: str, launcher: list[str] | None = None,
             timeout_s: float = 3600.0) -> dict:
    """Write the workload, run ``mpirun -np RANKS --bind-to none`` DLIO in ``rundir``, and
    return its summary, per-epoch stats, the wall time and the log's path."""
    shutil.rmtree(rundir, ignore_errors=True)
    conf = os.path.join(rundir, "conf", "workload")
    os.makedirs(conf)
    with open(os.path.join(conf, "dlcbench.yaml"), "w") as f:
        f.write(yaml_text)
    mpirun = shutil.which("mpirun")
    if not mpirun:
        raise DlioError("mpirun not found: apt-get install -y openmpi-bin libopenmpi-dev")
    cmd = [*(launcher or []), mpirun, "-np", str(ranks), "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    cmd += [py, "-m", "bench.dlio_launch", "--config-dir", os.path.join(rundir, "conf"),
            "workload=dlcbench", f"hydra.run.dir={os.path.join(rundir, 'hydra')}"]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env.setdefault("OMPI_MCA_btl", "self,vader")  # one machine: no network transports
    # pydftracer traces every read by default (DFTRACER_ENABLE unset counts as 1): off,
    # unless the caller asks for it
    env.setdefault("DFTRACER_ENABLE", "0")
    logpath = os.path.join(rundir, "dlio.out")
    t0 = time.perf_counter()
    with open(logpath, "wb") as logf:
        proc = subprocess.Popen(cmd, cwd=rundir, env=env, stdin=subprocess.DEVNULL,
                                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except BaseException:
            end_pid(proc.pid)  # mpirun ends its ranks
            raise
    wall = time.perf_counter() - t0
    out = os.path.join(rundir, "output")
    if rc != 0:
        raise DlioError(f"DLIO exited with status {rc}; see {logpath}:\n{_tail(logpath)}")
    res = {"wall_s": round(wall, 3), "log": logpath, "output": out,
           "command": " ".join(cmd)}
    for name in ("summary.json", "per_epoch_stats.json"):
        p = os.path.join(out, name)
        if os.path.exists(p):
            with open(p) as f:
                res[name.removesuffix(".json")] = json.load(f)
    return res


def _tail(path: str, n: int = 25) -> str:
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        return "".join(f.readlines()[-n:])
    return ""


def epochs_of(res: dict) -> list[dict]:
    """Per epoch: DLIO's samples/s (summed over ranks), AU % and the epoch's seconds."""
    metric = res.get("summary", {}).get("metric", {})
    tps = metric.get("train_throughput_samples_per_second", [])
    aus = metric.get("train_au_percentage", [])
    per = res.get("per_epoch_stats", {})
    out = []
    for i, tp in enumerate(tps):
        ep = per.get(str(i + 1), {})
        out.append({"epoch": i + 1, "samples_per_s": round(float(tp), 2),
                    "au_percent": round(float(aus[i]), 2) if i < len(aus) else None,
                    "seconds": float(ep["duration"]) if "duration" in ep else None})
    return out


# ----- the dataset -------------------------------------------------------------------------------

def ensure_dataset(py: str, export: str, a: argparse.Namespace) -> str:
    """DLIO's own JPEG dataset of ``a.files`` files under ``export``; made once, reused
    while the marker file holds the same parameters. Returns its folder."""
    folder = os.path.join(export, f"jpeg-n{a.files}")
    params = {"files": a.files, "record_length": a.record_length,
              "record_length_stdev": a.record_length_stdev, "dlio": DLIO_VERSION}
    marker = os.path.join(folder, ".dlcbench-dataset.json")
    with contextlib.suppress(OSError, ValueError), open(marker) as f:
        if json.load(f) == params:
            return folder
    shutil.rmtree(folder, ignore_errors=True)
    log(f"generating {a.files} JPEGs with DLIO into {folder}")
    text = workload_yaml(data_folder=folder, files=a.files, output=os.path.join(a.work, "gen", "output"),
                         generate=True, train=False, epochs=1, batch_size=a.batch_size,
                         read_threads=0, computation_time=0.0, record_length=a.record_length,
                         record_length_stdev=a.record_length_stdev, shuffle="off",
                         reader_class=None)
    run_dlio(py, a.ranks, text, os.path.join(a.work, "gen"))
    os.sync()
    with open(marker, "w") as f:
        json.dump(params, f)
    return folder


def dataset_info(folder: str) -> dict:
    sizes = [e.stat().st_size for e in os.scandir(os.path.join(folder, "train")) if e.is_file()]
    return {"folder": folder, "files": len(sizes), "bytes": sum(sizes),
            "mean_kb": round(sum(sizes) / max(1, len(sizes)) / 1000, 1)}


# ----- the comparison ----------------------------------------------------------------------------

def one_run(py: str, a: argparse.Namespace, system: str, mode: str, data_folder: str,
            iface: str, pids: dict[str, int | None], mount: DlcMount | None) -> dict:
    text = workload_yaml(data_folder=data_folder, files=a.files,
                         output=os.path.join(a.work, "runs", f"{system}-{mode}", "output"),
                         generate=False, train=True, epochs=a.epochs, batch_size=a.batch_size,
                         read_threads=a.read_threads, computation_time=a.computation_time,
                         record_length=a.record_length, record_length_stdev=a.record_length_stdev,
                         shuffle=a.shuffle, reader_class=MODES[mode])
    launcher = [dlcachefs_exe(), "run", "--"] if mount is not None and a.launcher else None
    page_cache = drop_page_cache()
    load = os.getloadavg()[0]
    cpu0 = {k: proc_cpu_seconds(p) for k, p in pids.items() if p}
    stats0 = mount.stats() if mount else None
    rx0 = net_rx(iface)
    log(f"{system} {mode}: DLIO, {a.ranks} ranks x {a.read_threads} workers, {a.epochs} epochs")
    res = run_dlio(py, a.ranks, text, os.path.join(a.work, "runs", f"{system}-{mode}"), launcher)
    rx1 = net_rx(iface)
    rec: dict = {"system": system, "mode": mode, "page_cache": page_cache,
                 "loadavg_1m_before": round(load, 2), "wall_s": res["wall_s"],
                 "epochs": epochs_of(res), "launcher": bool(launcher), "log": res["log"],
                 "net_rx_bytes": rx1 - rx0 if rx0 is not None and rx1 is not None else None,
                 "daemon_cpu_s": {k: round(proc_cpu_seconds(p) - cpu0[k], 3)
                                  for k, p in pids.items() if p and cpu0.get(k) is not None
                                  and proc_cpu_seconds(p) is not None}}
    if mount is not None:
        after = mount.stats()
        delta = counter_delta(stats0 or {}, after)
        streams = after.get("streams") or {}
        rec["dlcachefs"] = {
            "stats_delta": delta, "streams": streams, "stream_seen": bool(streams),
            "state_after": {k: after.get(k) for k in ("cached_files", "cached_bytes", "chunks",
                                                      "pending_bytes")}}
    for ep in rec["epochs"]:
        log(f"  {system:<9} {mode:<6} epoch {ep['epoch']}: {ep['samples_per_s']:>8.1f} samples/s "
            f"({ep['seconds']} s, AU {ep['au_percent']} %)")
    if len(rec["epochs"]) != a.epochs:
        raise DlioError(f"{system} {mode}: DLIO reported {len(rec['epochs'])} epochs, "
                        f"expected {a.epochs}; see {res['log']}")
    return rec


def ratios(runs: Sequence[dict]) -> list[dict]:
    """dlcachefs / direct samples/s per mode and epoch."""
    by = {(r["system"], r["mode"]): r for r in runs}
    out = []
    for (system, mode), r in by.items():
        d = by.get(("direct", mode))
        if system != "dlcachefs" or d is None:
            continue
        for ep, de in zip(r["epochs"], d["epochs"], strict=False):
            if de["samples_per_s"]:
                out.append({"mode": mode, "epoch": ep["epoch"],
                            "dlcachefs_samples_per_s": ep["samples_per_s"],
                            "direct_samples_per_s": de["samples_per_s"],
                            "ratio": round(ep["samples_per_s"] / de["samples_per_s"], 3)})
    return out


def rate_bits(rate: str | None) -> float | None:
    """``tc``'s rate (``400mbit``, ``1gbit``, ``800kbit``) in bits/s; None otherwise."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", (rate or "").strip().lower())
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)] if m else None


def totals(runs: Sequence[dict], link_s: float | None = None) -> list[dict]:
    """Per mode: every system's time over all its epochs against direct's, and with
    ``local`` run, the bound of any cache in front of the remote (module docstring): its
    first epoch no faster than the dataset's bytes over the link (``link_s``; direct's
    first epoch when unknown) nor than the local copy's first epoch, the later ones no
    faster than the local copy's."""
    by = {(r["system"], r["mode"]): r for r in runs}
    out = []
    for mode in dict.fromkeys(r["mode"] for r in runs):
        d = by.get(("direct", mode))
        if d is None or not all(e["seconds"] for e in d["epochs"]):
            continue
        direct_s = sum(e["seconds"] for e in d["epochs"])
        row: dict = {"mode": mode, "epochs": len(d["epochs"]), "direct_s": round(direct_s, 2)}
        for (system, m), r in by.items():
            if m == mode and system != "direct" and all(e["seconds"] for e in r["epochs"]):
                t = sum(e["seconds"] for e in r["epochs"])
                row[f"{system}_s"] = round(t, 2)
                row[f"{system}_x"] = round(direct_s / t, 3)
        loc = by.get(("local", mode))
        if loc is not None and len(loc["epochs"]) == len(d["epochs"]) > 1 \
                and all(e["seconds"] for e in loc["epochs"]):
            first = max(link_s if link_s is not None else d["epochs"][0]["seconds"],
                        loc["epochs"][0]["seconds"])
            bound = first + sum(e["seconds"] for e in loc["epochs"][1:])
            row["cache_bound_s"] = round(bound, 2)
            row["cache_bound_x"] = round(direct_s / bound, 3)
        out.append(row)
    return out


def markdown(doc: dict) -> str:
    c = doc["config"]
    lines = [f"# DLIO {DLIO_VERSION}: remote directly vs dlcachefs",
             "",
             f"{doc['dataset']['files']} DLIO JPEGs (mean {doc['dataset']['mean_kb']} KB), remote = "
             f"sshfs to an sshd in a netns shaped to {c['rate']}; `mpirun -np {c['ranks']}`, PyTorch "
             f"loader, {c['read_threads']} workers per rank, batch {c['batch_size']}, "
             f"computation_time {c['computation_time']} s per batch, sample_shuffle {c['shuffle']}; "
             "page cache dropped before each run; dlcachefs with an empty cache"
             f"{' under `dlcachefs run`' if c['launcher'] else ''}.",
             "",
             "| mode | system | epoch | samples/s | epoch s | AU % | net MB (run) | daemon CPU s (run) | stream |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["runs"]:
        net = f"{r['net_rx_bytes'] / 1e6:.0f}" if r.get("net_rx_bytes") is not None else "?"
        cpu = ", ".join(f"{k} {v:.1f}" for k, v in r["daemon_cpu_s"].items())
        stream = ("yes" if r["dlcachefs"]["stream_seen"] else "no") if "dlcachefs" in r else ""
        for ep in r["epochs"]:
            lines.append(f"| {r['mode']} | {r['system']} | {ep['epoch']} | {ep['samples_per_s']:.1f} "
                         f"| {ep['seconds']} | {ep['au_percent']} | {net} | {cpu} | {stream} |")
    if doc["ratios"]:
        lines += ["", "| mode | epoch | dlcachefs / direct |", "|---|---|---|"]
        lines += [f"| {x['mode']} | {x['epoch']} | {x['ratio']:.2f} |" for x in doc["ratios"]]
    if doc.get("totals"):
        lines += ["", "| mode | epochs | direct s | dlcachefs s (x direct) | local s (x direct) "
                  "| a cache's bound s (x direct) |", "|---|---|---|---|---|---|"]
        for t in doc["totals"]:
            cells = [f"{t[k + '_s']} ({t[k + '_x']:.2f}x)" if k + "_s" in t else "" for k in
                     ("dlcachefs", "local", "cache_bound")]
            lines.append(f"| {t['mode']} | {t['epochs']} | {t['direct_s']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def warm_up(src: str, n: int) -> dict:
    """Read ``n`` files of the dataset through the fresh sshfs mount with 8 threads,
    untimed. Without it the first measured run alone pays for sshfs opening its
    connections: on the functional runs, whichever run came first was 2-6x slower than
    the same run later. The page cache is dropped before every measured run anyway."""
    from .readers import read_all

    names = sorted(os.listdir(os.path.join(src, "train")))[:n]
    t0 = time.perf_counter()
    res = read_all([os.path.join(src, "train", x) for x in names], threads=8)
    wall = time.perf_counter() - t0
    log(f"warm-up: {len(names)} files through sshfs in {wall:.2f} s, {len(res.errors)} errors")
    return {"files": len(names), "seconds": round(wall, 3), "errors": len(res.errors)}


def main_run(a: argparse.Namespace) -> dict:
    py = ensure_venv(a.venv)
    a.work = os.path.abspath(a.work)
    export = os.path.join(a.work, "export")
    os.makedirs(export, exist_ok=True)
    folder = ensure_dataset(py, export, a)
    rel = os.path.relpath(folder, export)
    rmnt = os.path.join(a.work, "remote-mnt")
    doc: dict = {"bench": "dlio", "dlio_version": DLIO_VERSION, "status": "ok",
                 "machine": machine_info(REPO), "dataset": dataset_info(folder),
                 "config": {k: getattr(a, k) for k in (
                     "rate", "files", "ranks", "modes", "epochs", "batch_size", "read_threads",
                     "computation_time", "shuffle", "record_length", "record_length_stdev",
                     "launcher", "systems")},
                 "runs": []}
    t0 = time.perf_counter()
    with slow_remote(export, rmnt, rate=a.rate, name=a.remote_name) as r:
        iface = f"{r.name}-h"
        src = os.path.join(rmnt, rel)  # the dataset as the remote shows it
        doc["warmup"] = warm_up(src, a.warmup_files)
        for mode in a.modes:
            if "direct" in a.systems:
                doc["runs"].append(one_run(py, a, "direct", mode, src, iface,
                                           {"sshfs": r.sshfs_pid}, None))
            if "dlcachefs" in a.systems:
                cache = os.path.join(a.work, f"cache-{mode}")
                shutil.rmtree(cache, ignore_errors=True)
                dmnt = os.path.join(a.work, f"dlc-mnt-{mode}")
                with DlcMount(src, dmnt, cache, ["--ignore-source-inode", *a.mount_arg]) as m:
                    doc["runs"].append(one_run(py, a, "dlcachefs", mode, dmnt, iface,
                                               {"sshfs": r.sshfs_pid, "dlcachefs": m.pid}, m))
                shutil.rmtree(cache, ignore_errors=True)
            if "local" in a.systems:
                doc["runs"].append(one_run(py, a, "local", mode, folder, iface, {}, None))
    doc["ratios"] = ratios(doc["runs"])
    bits = rate_bits(a.rate)
    doc["totals"] = totals(doc["runs"], doc["dataset"]["bytes"] * 8 / bits if bits else None)
    doc["total_seconds"] = round(time.perf_counter() - t0, 1)
    return doc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.dlio", description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="400mbit", help="tbf rate of the remote's link (none: unshaped)")
    p.add_argument("--files", type=int, default=3000, help="DLIO JPEG files (default 3000)")
    p.add_argument("--ranks", type=int, default=2, help="MPI ranks (default 2)")
    p.add_argument("--modes", default="raw,decode", help="raw,decode")
    p.add_argument("--systems", default="direct,dlcachefs",
                   help="direct,dlcachefs[,local] (local: the dataset's folder on local disk)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--read-threads", type=int, default=2,
                   help="DataLoader workers per rank (DLIO's reader.read_threads)")
    p.add_argument("--computation-time", type=float, default=0.01,
                   help="DLIO's train.computation_time, seconds per batch (default 0.01)")
    p.add_argument("--shuffle", default="seed", choices=("off", "seed", "random"),
                   help="DLIO's reader.sample_shuffle (default seed)")
    p.add_argument("--record-length", type=int, default=193_000,
                   help="DLIO's dataset.record_length: pixels of its grayscale noise JPEGs "
                        "(193,000 gives ~110 KB files)")
    p.add_argument("--record-length-stdev", type=int, default=60_000)
    p.add_argument("--warmup-files", type=int, default=64,
                   help="files read through sshfs before the first run, untimed (default 64)")
    p.add_argument("--no-launcher", dest="launcher", action="store_false",
                   help="run mpirun without `dlcachefs run --` on the mount")
    p.add_argument("--mount-arg", action="append", default=[],
                   help="extra `dlcachefs mount` option (repeatable)")
    p.add_argument("--work", default=DEFAULT_WORK, help=f"scratch folder (default {DEFAULT_WORK})")
    p.add_argument("--venv", default=DEFAULT_VENV, help=f"DLIO's venv (default {DEFAULT_VENV})")
    p.add_argument("--remote-name", default="dlcbench")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/dlio-<ts>.json)")
    p.add_argument("--setup-only", action="store_true", help="build the DLIO venv and exit")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    if a.setup_only:
        print(ensure_venv(a.venv))
        return 0
    a.modes = [m for m in a.modes.split(",") if m]
    a.systems = [s for s in a.systems.split(",") if s]
    bad = [m for m in a.modes if m not in MODES] + [s for s in a.systems
                                                   if s not in ("direct", "dlcachefs", "local")]
    if bad:
        print(f"bench.dlio: unknown mode or system: {', '.join(bad)}", file=sys.stderr)
        return 2
    if a.rate in ("", "none"):
        a.rate = None
    out = a.out or os.path.join(REPO, "bench", "results",
                                f"dlio-{time.strftime('%Y%m%d-%H%M%S')}.json")
    try:
        doc = main_run(a)
    except DlioError as e:
        print(f"bench.dlio: {e}", file=sys.stderr)
        return 1
    write_json(out, doc)
    md = markdown(doc)
    with open(os.path.splitext(out)[0] + ".md", "w") as f:
        f.write(md)
    print(json.dumps(doc, indent=2))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
