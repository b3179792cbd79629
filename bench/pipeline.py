"""A real training input pipeline, timed per epoch: torchvision ImageFolder + DataLoader
(JPEG decode, RandomResizedCrop(64), ToTensor, batch 32) with a fixed simulated compute
time per batch (``time.sleep``), so that the time the loop waits for data shows.

    python -m bench.pipeline --data MNT/train [--epochs 2] [--workers 2] [--batch 32]
                             [--compute-ms 20] [--sampler random|distributed] [--seed 0]
    dlcachefs run -- python -m bench.pipeline --data MNT/train ...   # sampler announced

Prints one JSON object per line: one per epoch (``"kind": "epoch"``), then a final one
(``"kind": "done"``). Per epoch:

* ``seconds``: wall time of the epoch (iterator creation, worker start, every batch);
* ``files_per_s``, ``mb_per_s``: samples and their file bytes over ``seconds``;
* ``stall_s``: the time the loop waited for the next batch (``next(it)``; with
  ``--workers 0`` that includes loading and decoding); ``seconds`` = stall + the
  simulated compute (``compute_s``) + ``iter(loader)`` (starting the workers);
* ``reader_cpu_s``: user+system CPU of this process and its reaped children (the
  DataLoader workers of the finished epoch);
* ``digest``: a digest of (path relative to the parent of ``--data``, size, xxh3-128)
  of every sample read this epoch; when the epoch read every file once it equals the
  dataset manifest's ``tree_digest`` (``bench.run`` checks it);
* on a dlcachefs mount (found by walking up from ``--data`` to a ``.dlcache/stats``):
  ``dlcachefs.stats_delta`` (every counter's change during the epoch),
  ``dlcachefs.clairvoyance.streams`` (the per-stream state at the end), ``daemon_cpu_s``;
* ``net_rx_bytes`` when ``--net-iface`` is given: bytes received on that interface
  during the epoch (the slow remote's veth: bytes that came from the remote).

The dataset class is a subclass of ImageFolder (same ``root`` and ``samples``, so the
``dlcachefs run`` hook recognises it) whose ``__getitem__`` reads the file's bytes once,
hashes them, and decodes from memory: the bytes the pipeline trains on are checked.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import sys
import time

from .util import net_rx


def _cpu_all() -> float:
    s = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def _find_stats(path: str) -> str | None:
    p = os.path.abspath(path)
    while True:
        cand = os.path.join(p, ".dlcache", "stats")
        try:
            if os.path.isfile(cand):
                return cand
        except OSError:
            pass
        parent = os.path.dirname(p)
        if parent == p:
            return None
        p = parent


def _read_stats(path: str | None) -> dict | None:
    if path is None:
        return None
    with open(path, "rb") as f:
        return json.loads(f.read())


def make_dataset_class(raw: bool = False):
    """The bench's ImageFolder; ``raw``: the file's bytes are read and hashed, not
    decoded (the data path's cost alone: the sample is a placeholder tensor)."""
    import torch
    from PIL import Image
    from torchvision import datasets

    from .util import file_hash

    class HashedImageFolder(datasets.ImageFolder):
        """ImageFolder that returns (image, target, index, size, hash of the file)."""

        def __getitem__(self, index):
            path, target = self.samples[index]
            with open(path, "rb") as f:
                data = f.read()
            h = file_hash(data)
            if raw:
                return torch.zeros(1), target, index, len(data), h
            img = Image.open(io.BytesIO(data)).convert("RGB")
            if self.transform is not None:
                img = self.transform(img)
            return img, target, index, len(data), h

    return HashedImageFolder


def run(a: argparse.Namespace) -> int:
    import torch
    from torch.utils.data import DataLoader, DistributedSampler
    from torchvision import transforms

    from .mounting import counter_delta
    from .util import proc_cpu_seconds, tree_digest

    torch.manual_seed(a.seed)
    tf = transforms.Compose([transforms.RandomResizedCrop(64), transforms.ToTensor()])
    ds = make_dataset_class(a.raw)(a.data, transform=tf)
    base = os.path.dirname(os.path.abspath(a.data))
    rels = [os.path.relpath(p, base) for p, _ in ds.samples]
    if a.sampler == "distributed":
        sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=a.seed)
        loader = DataLoader(ds, batch_size=a.batch, sampler=sampler, num_workers=a.workers)
    else:
        sampler = None
        loader = DataLoader(ds, batch_size=a.batch, shuffle=True, num_workers=a.workers)
    stats_path = _find_stats(a.data)
    compute = a.compute_ms / 1000.0
    total_files = 0
    for epoch in range(a.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        st0 = _read_stats(stats_path)
        dpid = int(st0["pid"]) if st0 else None
        dcpu0 = proc_cpu_seconds(dpid) if dpid else None
        pids = list(a.daemon_pid or [])
        pcpu0 = {p: proc_cpu_seconds(p) for p in pids}
        rx0 = net_rx(a.net_iface)
        cpu0 = _cpu_all()
        seen: dict[int, tuple[int, str]] = {}
        nbytes = 0
        stall = 0.0
        batches = 0
        t0 = time.perf_counter()
        it = iter(loader)
        while True:
            tw = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                stall += time.perf_counter() - tw
                break
            stall += time.perf_counter() - tw
            _, _, idx, sizes, hashes = batch
            for i, s, h in zip(idx.tolist(), sizes.tolist(), hashes, strict=True):
                seen[i] = (s, h)
                nbytes += s
            batches += 1
            time.sleep(compute)  # the simulated training step
        secs = time.perf_counter() - t0
        del it
        files = sum(1 for _ in seen)
        rec = {
            "kind": "epoch", "epoch": epoch, "files": files, "batches": batches,
            "bytes": nbytes, "seconds": round(secs, 4),
            "files_per_s": round(files / secs, 1), "mb_per_s": round(nbytes / 1e6 / secs, 2),
            "stall_s": round(stall, 4), "compute_s": round(batches * compute, 4),
            "reader_cpu_s": round(_cpu_all() - cpu0, 3),
            "all_files": files == len(ds.samples),
            "digest": tree_digest((rels[i], s, h) for i, (s, h) in seen.items()),
        }
        rx1 = net_rx(a.net_iface)
        if rx0 is not None and rx1 is not None:
            rec["net_rx_bytes"] = rx1 - rx0
        if pids:
            rec["daemon_cpu_s"] = {str(p): round((proc_cpu_seconds(p) or 0) - (pcpu0[p] or 0), 3)
                                   for p in pids}
        if st0 is not None:
            st1 = _read_stats(stats_path)
            rec["dlcachefs"] = {
                "pid": dpid,
                "stats_delta": counter_delta(st0, st1),
                "streams": st1.get("streams"),
                "daemon_cpu_s": round((proc_cpu_seconds(dpid) or 0) - (dcpu0 or 0), 3)
                if dcpu0 is not None else None,
            }
        total_files += files
        print(json.dumps(rec), flush=True)
    print(json.dumps({"kind": "done", "epochs": a.epochs, "files": total_files,
                      "dataset_files": len(ds.samples), "on_dlcachefs": stats_path is not None,
                      "hook": "dlcachefs.torch" in sys.modules}), flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="the ImageFolder root (class subfolders)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workers", type=int, default=2, help="DataLoader num_workers")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--compute-ms", type=float, default=20.0,
                   help="simulated compute per batch, ms (time.sleep)")
    p.add_argument("--sampler", choices=["random", "distributed"], default="random",
                   help="random: DataLoader(shuffle=True); distributed: "
                        "DistributedSampler(num_replicas=1, rank=0) with set_epoch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--raw", action="store_true",
                   help="read and hash each file, no JPEG decode or crop (the data path)")
    p.add_argument("--daemon-pid", type=int, action="append",
                   help="also report the CPU seconds of this pid per epoch (repeatable)")
    p.add_argument("--net-iface", help="report rx bytes of this network interface per epoch")
    return p


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
