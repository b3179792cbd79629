"""How fast a stream becomes active after its announcement, on an ImageNet-sized list.

    python -m bench.stream_start [--classes 1000] [--per-class 1281] [--work DIR] [--out F]

Makes (once, reused afterwards) a tree of ``classes x per-class`` tiny ``.jpg`` files (only
the names matter: the daemon derives ImageFolder's sample list from its snapshot and
replays the sampler), mounts it with an empty cache, and then, as a training script does:

1. writes ``job``/``dataset``/``sampler random seed=S per_epoch=true``/``epoch 0`` and, in
   the very next write, ``loss`` lines for 1,000 samples (a script that reports losses at
   once);
2. (after the replay worker's import of torch, ``sampler_replay_ready`` in stats: a
   script takes as long to import its own torch) polls ``stats`` until the stream's ``epoch`` is 0 (its order is known: prefetch and
   planning can start): that is the **start latency**;
3. does the same for epoch 1 (the sample list is known by then);
4. checks that the early losses were kept (``losses`` counts them, ``losses_ignored`` 0).

Prints JSON (and writes it to ``--out``). Times are reported, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from dlcachefs.data.hook import prepare_mounts

from .mounting import DlcMount, dlcachefs_exe
from .util import machine_info, proc_status_kb, write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(msg: str) -> None:
    print(f"[stream_start {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_tree(root: str, classes: int, per_class: int) -> bool:
    """The tree under ``root/train``; returns True when an existing one was reused."""
    marker = os.path.join(root, f".complete-{classes}x{per_class}")
    if os.path.exists(marker):
        return True
    shutil.rmtree(root, ignore_errors=True)

    def one(c: int) -> None:
        d = os.path.join(root, "train", f"c{c:05d}")
        os.makedirs(d)
        for i in range(per_class):
            with open(os.path.join(d, f"{i:06d}.jpg"), "wb") as f:
                f.write(b"%d/%d" % (c, i))

    with ThreadPoolExecutor(16) as ex:
        list(ex.map(one, range(classes)))
    open(marker, "w").close()
    return False


def _write(mnt: str, text: str) -> None:
    fd = os.open(os.path.join(mnt, ".dlcache", "control"), os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _wait_epoch(m: DlcMount, job: str, epoch: int, timeout: float) -> tuple[float, dict]:
    t0 = time.perf_counter()
    while True:
        s = m.stats()
        st = s.get("streams", {}).get(f"{job}/0", {})
        if st.get("epoch") == epoch:
            return time.perf_counter() - t0, s
        if st.get("error"):
            raise RuntimeError(f"stream error: {st['error']}")
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"stream not active after {timeout} s: {st}")
        time.sleep(0.01)


def _announce_and_wait(m: DlcMount, mnt: str, job: str, timeout: float, out: dict,
                       prefix: str, losses: bool) -> None:
    head = f"job {job}\ndataset .\n"
    for epoch in (0, 1):
        t = time.perf_counter()
        _write(mnt, head + f"sampler random seed={11 + epoch} per_epoch=true\nepoch {epoch}\n")
        if losses and epoch == 0:  # a script that reports losses at once
            _write(mnt, head + "".join(f"loss {i} {1.0 + i % 7}\n" for i in range(1000)))
        _wait_epoch(m, job, epoch, timeout)
        dt = time.perf_counter() - t
        out[f"{prefix}epoch{epoch}_active_s"] = round(dt, 3)
        log(f"{prefix}epoch {epoch}: stream active {dt:.3f} s after the announcement")


def _wait_replay_ready(m: DlcMount, timeout: float) -> float:
    # The daemon's replay worker imports torch from the moment a training's hook opens the
    # control file at its start (the script spends as long importing its own torch
    # before it announces).
    t = time.perf_counter()
    prepare_mounts([str(m.mnt)])  # what a training's hook does at its start
    while not m.stats().get("sampler_replay_ready"):
        if time.perf_counter() - t > timeout:
            raise RuntimeError("the daemon never finished loading torch")
        time.sleep(0.05)
    return round(time.perf_counter() - t, 2)


def _imagefolder_scan(root: str) -> tuple[float, int]:
    """What ``ImageFolder(root)`` does before the script can announce: torchvision's own
    class discovery and walk, through the mount."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    t = time.perf_counter()
    _classes, idx = find_classes(root)
    samples = make_dataset(root, idx, IMG_EXTENSIONS)
    return time.perf_counter() - t, len(samples)


def run(classes: int, per_class: int, work: str, timeout: float) -> dict:
    src = os.path.join(work, "src")
    t0 = time.perf_counter()
    reused = make_tree(src, classes, per_class)
    out: dict = {"samples": classes * per_class, "tree_reused": reused,
                 "tree_make_s": None if reused else round(time.perf_counter() - t0, 1),
                 "machine": machine_info(REPO)}
    log(f"tree of {classes * per_class} files ready ({'reused' if reused else 'made'})")
    cache, mnt = os.path.join(work, "cache"), os.path.join(work, "mnt")
    shutil.rmtree(cache, ignore_errors=True)
    train = os.path.join(src, "train")
    with DlcMount(train, mnt, cache, ["--log-level", "info"], dlcachefs_exe(),
                  timeout=3600) as m:
        out["mount_s"] = round(m.mount_s or 0, 2)
        log(f"first mount (scan) {out['mount_s']} s")
        out["replay_ready_after_mount_s"] = _wait_replay_ready(m, timeout)
        # 1. announced with nothing seen before: the list is made on the announcement
        _announce_and_wait(m, mnt, "cold", timeout, out, "cold_", losses=True)
        s = m.stats()
        out["losses"], out["losses_ignored"] = s.get("losses"), s.get("losses_ignored")
        rss = proc_status_kb(m.pid, "VmRSS") if m.pid else None
        out["daemon_rss_mb"] = round(rss / 1024, 1) if rss else None
    # 2. as a training script does it: ImageFolder(root) over the mount, then announce
    with DlcMount(train, mnt, cache, ["--log-level", "info"], dlcachefs_exe(),
                  timeout=3600) as m:
        out["remount_s"] = round(m.mount_s or 0, 2)
        _wait_replay_ready(m, timeout)
        dt, n = _imagefolder_scan(mnt)
        out["script_imagefolder_scan_s"] = round(dt, 2)
        log(f"ImageFolder over the mount: {n} samples in {dt:.2f} s")
        _announce_and_wait(m, mnt, "script", timeout, out, "script_", losses=False)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--classes", type=int, default=1000)
    ap.add_argument("--per-class", type=int, default=1281)
    ap.add_argument("--work", default=os.path.join(REPO, "bench", "out", "stream_start"))
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    os.makedirs(a.work, exist_ok=True)
    res = run(a.classes, a.per_class, a.work, a.timeout)
    print(json.dumps(res, indent=1))
    if a.out:
        write_json(a.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
