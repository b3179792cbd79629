"""What a cache's disk writes cost a reader of the slow remote on this machine, with no
cache at all: the direct reader of ``bench.first_epoch``'s ``raw1`` case, alone and then
beside a plain writer that writes what a first epoch's cache writes (one 16 MiB chunk
plus ``fdatasync`` per 16 MiB the link brings, here every ``--every`` seconds) to a file
on ``--disk-dir`` (the cache disk). The link's throughput is sampled every 50 ms.

    sudo .venv/bin/python -m bench.disk_stall [--files 3000] [--rounds 3]
        [--rate 400mbit] [--every 0.35] [--chunk-mib 16] [--piece-kib N] [--spread S] [--disk-dir DIR]
        [--out JSON]

Why: through dlcachefs a first epoch over the 400 Mbit/s remote drops the link from ~48
to 30-40 MB/s for one 50 ms sample at each chunk it seals (``bench.first_epoch``). If an
unrelated writer of the same bytes does the same to a reader that uses no cache, the dip
belongs to the machine (its virtual disk's writes take the CPUs the link's ssh/sshfs
need), not to the daemon's code. The remote's files are served from tmpfs
(``--dataset-dir``, default ``/dev/shm/...``) so that the remote's reads do not share the
cache disk either.

Output: JSON (``--out``, default ``bench/results/disk_stall-<ts>.json``): per round and
mode (``alone``, ``writer``) the files/s, the link's MB/s samples, the samples below 40
MB/s, the writer's write and ``fdatasync`` times; and the ratio writer / alone per round.
Needs root (network namespace, ``drop_caches``). Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

from .first_epoch import first_epoch_dataset
from .readers import read_all
from .remote import slow_remote
from .util import drop_page_cache, machine_info, write_json

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IFACE_SUFFIX = "-h"  # bench.remote's host-side veth: <name>-h


def log(msg: str) -> None:
    print(f"[disk_stall {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class LinkSampler:
    """Bytes received on ``iface`` every ``period`` seconds, in a thread."""

    def __init__(self, iface: str, period: float = 0.05) -> None:
        self.path = f"/sys/class/net/{iface}/statistics/rx_bytes"
        self.period = period
        self.samples: list[tuple[float, int]] = []
        self._halt = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._halt.is_set():
            with open(self.path) as f:
                self.samples.append((time.perf_counter(), int(f.read())))
            time.sleep(self.period)

    def __enter__(self) -> LinkSampler:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._halt.set()
        self._t.join()

    def mb_per_s(self) -> list[float]:
        s = self.samples
        return [round((b2 - b1) / (t2 - t1) / 1e6, 1)
                for (t1, b1), (t2, b2) in zip(s, s[1:], strict=False) if t2 > t1]


class ChunkWriter(threading.Thread):
    """Writes ``chunk`` bytes and ``fdatasync`` s them every ``every`` seconds, as a cache's
    chunk writer does during a first epoch, until stopped; the file is removed at the end.
    ``piece`` < ``chunk``: the chunk is written in pieces spread over the interval (as a
    writer that appends records as they come would), then synced once."""

    def __init__(self, path: str, chunk: int, every: float, piece: int = 0,
                 spread: float | None = None) -> None:
        super().__init__(daemon=True)
        self.path, self.every = path, every
        self.spread = every if spread is None else spread
        self.buf = os.urandom(chunk)
        self.piece = piece if 0 < piece < chunk else chunk
        self.writes: list[float] = []
        self.syncs: list[float] = []
        self._halt = threading.Event()

    def run(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            while not self._halt.is_set():
                t0 = time.perf_counter()
                step = self.spread * self.piece / len(self.buf)
                for off in range(0, len(self.buf), self.piece):
                    os.write(fd, self.buf[off:off + self.piece])
                    if off + self.piece < len(self.buf):
                        self._halt.wait(step)
                t1 = time.perf_counter()
                os.fdatasync(fd)
                t2 = time.perf_counter()
                self.writes.append(t1 - t0)
                self.syncs.append(t2 - t1)
                self._halt.wait(max(0.0, self.every - (t2 - t0)))
        finally:
            os.close(fd)
            os.unlink(self.path)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def one_pass(remote, rels: list[str], iface: str, writer: ChunkWriter | None,
             dataset_root: str) -> dict:
    drop_page_cache([dataset_root])
    if writer is not None:
        writer.start()
        time.sleep(0.2)
    try:
        with LinkSampler(iface) as link:
            res = read_all([os.path.join(remote.mount, r) for r in rels], threads=1)
    finally:
        if writer is not None:
            writer.stop()
    s = res.summary()
    if s.get("errors"):
        raise RuntimeError(f"{s['errors']} read errors")
    rates = link.mb_per_s()
    busy = rates[2:-2] if len(rates) > 8 else rates  # not the ramp and the tail
    out = {"files_per_s": s["files_per_s"], "seconds": s["wall_s"], "link_mb_s": rates,
           "link_median_mb_s": statistics.median(busy) if busy else None,
           "samples_below_40": sum(1 for r in busy if r < 40)}
    if writer is not None:
        out["writer_chunks"] = len(writer.writes)
        out["write_ms_median"] = round(1000 * statistics.median(writer.writes), 1)
        out["fdatasync_ms_median"] = round(1000 * statistics.median(writer.syncs), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rate", default="400mbit")
    p.add_argument("--every", type=float, default=0.35,
                   help="seconds between chunks (16 MiB at ~48 MB/s: 0.35)")
    p.add_argument("--chunk-mib", type=int, default=16)
    p.add_argument("--piece-kib", type=int, default=0,
                   help="write each chunk in pieces of this size spread over --every "
                        "(default: the whole chunk at once, as dlcachefs's writer does)")
    p.add_argument("--spread", type=float, default=None,
                   help="seconds over which a chunk's pieces are spread (default --every)")
    p.add_argument("--disk-dir", default=os.path.join(REPO, "bench", "out", "disk_stall"),
                   help="where the writer writes (the disk a cache would use)")
    p.add_argument("--dataset-dir", default="/dev/shm/dlc-bench-disk-stall",
                   help="where the remote's dataset is made (tmpfs by default)")
    p.add_argument("--remote-name", default="dlcbench")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if os.geteuid() != 0:
        p.error("needs root (network namespace, drop_caches)")
    out = a.out or os.path.join(REPO, "bench", "results",
                                f"disk_stall-{time.strftime('%Y%m%d-%H%M%S')}.json")
    os.makedirs(a.disk_dir, exist_ok=True)
    ds, manifest, rels = first_epoch_dataset(a.dataset_dir, a.files, a.seed)
    doc = {"bench": "disk_stall", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
           "command": " ".join([os.path.basename(sys.executable), "-m", "bench.disk_stall",
                                *(argv if argv is not None else sys.argv[1:])]),
           "files": len(rels), "total_bytes": manifest["total_bytes"], "rate": a.rate,
           "every_s": a.every, "chunk_mib": a.chunk_mib, "piece_kib": a.piece_kib,
           "spread_s": a.spread, "machine": machine_info(REPO),
           "runs": []}
    iface = a.remote_name + IFACE_SUFFIX
    with slow_remote(ds, os.path.join(a.disk_dir, "mnt-remote"), rate=a.rate,
                     name=a.remote_name) as remote:
        read_all([os.path.join(remote.mount, r) for r in rels[-64:]], threads=8)  # conns
        for rnd in range(1, a.rounds + 1):
            alone = one_pass(remote, rels, iface, None, ds)
            w = ChunkWriter(os.path.join(a.disk_dir, "chunks.tmp"), a.chunk_mib << 20,
                            a.every, a.piece_kib << 10, a.spread)
            beside = one_pass(remote, rels, iface, w, ds)
            for mode, r in (("alone", alone), ("writer", beside)):
                doc["runs"].append({"round": rnd, "mode": mode, **r})
            log(f"round {rnd}: alone {alone['files_per_s']:.1f} files/s "
                f"({alone['samples_below_40']} samples < 40 MB/s), beside the writer "
                f"{beside['files_per_s']:.1f} ({beside['samples_below_40']} < 40; write "
                f"{beside['write_ms_median']} ms, fdatasync {beside['fdatasync_ms_median']} "
                f"ms): {beside['files_per_s'] / alone['files_per_s']:.3f}x")
    ratios = [round(w["files_per_s"] / al["files_per_s"], 3)
              for al, w in zip(doc["runs"][0::2], doc["runs"][1::2], strict=True)]
    doc["summary"] = {"ratios_writer_over_alone": ratios, "median": statistics.median(ratios)}
    write_json(out, doc)
    print(f"direct reader beside a chunk writer / alone, per round: {ratios} "
          f"(median {doc['summary']['median']}); {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
