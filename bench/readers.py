"""Raw readers: how the benchmarks read a list of files, timed per file.

A reader opens each file and reads it whole, in a given order, with N threads that pull
the next index from a shared queue (so with 1 thread the order is exactly the given
permutation, and with N threads it is that order, N files in flight at a time). Every
file's bytes are hashed (xxh3, ~20 GB/s, so hashing hardly shows in the timing) so that
a run can be compared byte for byte with another run over a different path.

Readers are registered in :data:`READERS` by name so that later benchmarks can add
others (``os.read`` into a buffer, ``mmap``, PIL decode, a DataLoader...) without
touching the drivers.
"""

from __future__ import annotations

import resource
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .util import file_hash, percentile

#: a reader: path -> the file's bytes
ReadFn = Callable[[str], bytes]


def read_python(path: str) -> bytes:
    """What training code does: ``open(path, "rb").read()`` (buffered; on FUSE this is
    one READ per 128 KiB... up to max_read, plus one that hits EOF)."""
    with open(path, "rb") as f:
        return f.read()


READERS: dict[str, ReadFn] = {"python": read_python}


@dataclass
class ReadResult:
    files: int
    bytes: int
    wall_s: float
    latencies_s: list[float]          # per file, in the order of ``paths``
    hashes: list[str]                 # per file, in the order of ``paths``
    sizes: list[int]
    finish_order: list[int] = field(default_factory=list)  # index of the k-th file done
    reader_cpu_s: float = 0.0         # user+sys CPU of this process during the run
    errors: list[tuple[int, str]] = field(default_factory=list)

    def summary(self) -> dict:
        lat = sorted(self.latencies_s)
        ms = 1000.0
        return {
            "files": self.files,
            "bytes": self.bytes,
            "wall_s": round(self.wall_s, 4),
            "files_per_s": round(self.files / self.wall_s, 1) if self.wall_s else None,
            "mb_per_s": round(self.bytes / 1e6 / self.wall_s, 2) if self.wall_s else None,
            "latency_ms": {
                "mean": round(sum(lat) / len(lat) * ms, 4) if lat else None,
                "p50": round(percentile(lat, 50) * ms, 4),
                "p90": round(percentile(lat, 90) * ms, 4),
                "p99": round(percentile(lat, 99) * ms, 4),
                "max": round(lat[-1] * ms, 4) if lat else None,
            },
            # mean latency of each tenth of the run, in reading order: warm-up and
            # periodic stalls (chunk loads, writer commits) show up here
            "latency_ms_by_tenth": [
                round(sum(part) / len(part) * ms, 4) if part else None
                for part in (self.latencies_s[k * len(self.latencies_s) // 10:
                                              (k + 1) * len(self.latencies_s) // 10]
                             for k in range(10))],
            "reader_cpu_s": round(self.reader_cpu_s, 3),
            "errors": len(self.errors),
        }

    def slowest(self, paths: Sequence[str], k: int = 5) -> list[dict]:
        """The k slowest files: path, latency, and when in the run they were read."""
        rank = {idx: pos for pos, idx in enumerate(self.finish_order)}
        top = sorted(range(len(self.latencies_s)), key=self.latencies_s.__getitem__,
                     reverse=True)[:k]
        return [{"path": paths[i], "ms": round(self.latencies_s[i] * 1000, 3),
                 "order": i, "finished": rank.get(i), "bytes": self.sizes[i]} for i in top]


def _cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def read_all(paths: Sequence[str], threads: int = 1, reader: ReadFn = read_python) -> ReadResult:
    """Read every path whole, in order, with ``threads`` threads. An error on one file
    is recorded (index, message) and the run goes on; callers decide what it means."""
    n = len(paths)
    lat = [0.0] * n
    hashes = [""] * n
    sizes = [0] * n
    finish: list[int] = []
    errors: list[tuple[int, str]] = []
    lock = threading.Lock()
    nxt = iter(range(n))

    def work() -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            t0 = time.perf_counter()
            try:
                data = reader(paths[i])
            except OSError as e:
                lat[i] = time.perf_counter() - t0
                with lock:
                    errors.append((i, f"{type(e).__name__}: {e}"))
                    finish.append(i)
                continue
            lat[i] = time.perf_counter() - t0
            hashes[i] = file_hash(data)
            sizes[i] = len(data)
            finish.append(i)  # list.append is atomic under the GIL

    cpu0 = _cpu()
    t0 = time.perf_counter()
    if threads <= 1:
        work()
    else:
        with ThreadPoolExecutor(threads, thread_name_prefix="reader") as ex:
            for f in [ex.submit(work) for _ in range(threads)]:
                f.result()
    wall = time.perf_counter() - t0
    return ReadResult(files=n, bytes=sum(sizes), wall_s=wall, latencies_s=lat, hashes=hashes,
                      sizes=sizes, finish_order=finish, reader_cpu_s=_cpu() - cpu0,
                      errors=errors)
