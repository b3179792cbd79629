"""Small helpers shared by the benchmarks: hashing, page-cache control, /proc readers,
a description of the machine, percentiles, and the setup of the loader benchmarks
(:func:`loader_bench`). Standard library only (plus xxhash when it is installed, which
dlcachefs itself depends on; :func:`loader_bench` imports ``bench.make_dataset`` and
``bench.mounting`` when called, as they import this module)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib import metadata

try:  # ~20 GB/s: hashing every byte read must not distort the reader's timing
    import xxhash

    def file_hash(data: bytes | memoryview) -> str:
        return xxhash.xxh3_128_hexdigest(data)

    HASH_NAME = "xxh3_128"
except ImportError:  # pragma: no cover - dlcachefs depends on xxhash
    import hashlib

    def file_hash(data: bytes | memoryview) -> str:
        return hashlib.blake2b(data, digest_size=16).hexdigest()

    HASH_NAME = "blake2b-128"


def tree_digest(items: Iterable[tuple[str, int, str]]) -> str:
    """One digest of a whole tree from (relative path, size, file hash) triples, in any
    order. Two trees (or two runs of a reader) with equal digests hold the same bytes."""
    import hashlib

    h = hashlib.sha256()
    for rel, size, fh in sorted(items):
        h.update(f"{rel}\0{size}\0{fh}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


# ----- page cache ----------------------------------------------------------------------

_DROP_WARNED = False


def drop_page_cache(fallback_roots: Sequence[str] = ()) -> str:
    """Empty the kernel's page cache so that the next reads come from the device.

    ``sync`` then ``echo 3 > /proc/sys/vm/drop_caches`` (needs root). Without the right
    to do that, fall back to ``posix_fadvise(DONTNEED)`` on every file under
    ``fallback_roots`` (never pass a FUSE mountpoint here: opening files through it would
    count as reads). Returns how it was done: "drop_caches", "fadvise" or "none".
    """
    global _DROP_WARNED
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError as e:
        if not _DROP_WARNED:
            print(f"bench: cannot write /proc/sys/vm/drop_caches ({e.strerror}); falling back "
                  "to posix_fadvise(DONTNEED) per file", file=sys.stderr)
            _DROP_WARNED = True
    if not fallback_roots:
        return "none"
    for root in fallback_roots:
        for dirpath, _, names in os.walk(root):
            for n in names:
                with contextlib.suppress(OSError):
                    fd = os.open(os.path.join(dirpath, n), os.O_RDONLY | os.O_NOFOLLOW)
                    try:
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
    return "fadvise"


# ----- /proc -----------------------------------------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK")


def net_rx(iface: str | None) -> int | None:
    """Bytes received so far on a network interface (None when unknown)."""
    if not iface:
        return None
    try:
        with open(f"/sys/class/net/{iface}/statistics/rx_bytes") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def proc_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process (all its threads), in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
    except OSError:
        return None
    # fields[0] is the state (field 3 of stat(5)); utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_cpu_split(pid: int) -> tuple[float, float] | None:
    """(utime, stime) of a process (all its threads), in seconds: time in its own code
    against time in the kernel on its behalf (its syscalls, e.g. read-ahead it asked)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
    except OSError:
        return None
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def wait_cpu_quiet(pid: int, quiet_s: float = 0.5, timeout: float = 15.0) -> float:
    """Wait until process ``pid`` used less than two clock ticks of CPU over ``quiet_s``
    (at most ``timeout`` seconds); returns the seconds waited. After the page cache is
    dropped, a FUSE daemon answers the kernel's FORGET of every inode the last epoch
    looked up: work of the drop, not of the epoch measured next."""
    t0 = time.monotonic()
    last = proc_cpu_seconds(pid)
    while time.monotonic() - t0 < timeout:
        time.sleep(quiet_s)
        now = proc_cpu_seconds(pid)
        if now is None or last is None or now - last < 2 / CLK_TCK:
            break
        last = now
    return time.monotonic() - t0


def proc_faults(pid: int) -> tuple[int, int] | None:
    """(minor, major) page faults of a process so far: a major fault read a page of a
    mapped file (its code, libraries, an LMDB map) back from disk, in the kernel on its
    behalf (system time)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(") ", 1)[1].split()
    except OSError:
        return None
    return int(fields[7]), int(fields[9])


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all CPUs (``/proc/stat``;
    idle and iowait are not busy). Two readings give the machine's busy share between."""
    with open("/proc/stat") as f:
        vals = [int(x) for x in f.readline().split()[1:]]
    total = sum(vals[:8])  # guest time is already counted in user
    return (total - vals[3] - vals[4]) / CLK_TCK, total / CLK_TCK


def proc_status_kb(pid: int, key: str) -> int | None:
    """A ``kB`` value of /proc/<pid>/status, e.g. VmHWM (peak RSS) or VmRSS."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss(pid: int) -> bool:
    """Reset VmHWM of a process (``echo 5 > /proc/<pid>/clear_refs``), so that the next
    reading is the peak of what happened since. False when not allowed."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5\n")
        return True
    except OSError:
        return False


def bdi_read_ahead_kb(path: str) -> int | None:
    """read_ahead_kb of the backing device of the filesystem holding ``path`` (for a FUSE
    mount: its own bdi, /sys/class/bdi/0:N)."""
    try:
        dev = os.stat(path).st_dev
        with open(f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb") as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def fs_of(path: str) -> dict:
    """Filesystem type and mount point of ``path`` (longest /proc/self/mounts prefix)."""
    real = os.path.realpath(path)
    best = {"mountpoint": "/", "fstype": "?", "device": "?"}
    best_len = -1
    with contextlib.suppress(OSError), open("/proc/self/mounts") as f:
        for line in f:
            dev, mnt, fstype = line.split()[:3]
            mnt = mnt.encode().decode("unicode_escape")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > best_len:
                best, best_len = {"mountpoint": mnt, "fstype": fstype, "device": dev}, len(mnt)
    return best


# ----- the machine ---------------------------------------------------------------------

def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _git(repo: str, *args: str) -> str | None:
    # read-only: --no-optional-locks keeps `git status` from refreshing the index
    try:
        r = subprocess.run(["git", "--no-optional-locks", "-C", repo, *args],
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def machine_info(repo: str | None = None) -> dict:
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_kb = None
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    fuse_pages = None
    with contextlib.suppress(OSError, ValueError), open("/proc/sys/fs/fuse/max_pages_limit") as f:
        fuse_pages = int(f.read())
    fusermount = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        r = subprocess.run(["fusermount3", "--version"], capture_output=True, text=True,
                           timeout=10)
        fusermount = (r.stdout or r.stderr).strip().rsplit(" ", 1)[-1] or None
    info = {
        "cpu_model": cpu,
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_gb": round(mem_kb / 2**20, 2) if mem_kb else None,
        "kernel": platform.release(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "fuse_max_pages_limit": fuse_pages,
        "fusermount3": fusermount,
        "versions": {d: _version(d) for d in (
            "dlcachefs", "pyfuse3", "trio", "lmdb", "xxhash", "numpy", "pillow",
            "torch", "torchvision", "matplotlib", "psutil")},
        "hash": HASH_NAME,
    }
    if repo:
        head = _git(repo, "rev-parse", "HEAD")
        dirty = _git(repo, "status", "--porcelain", "--untracked-files=no")
        info["git"] = {"commit": head, "dirty": bool(dirty) if dirty is not None else None}
    return info


# ----- numbers -------------------------------------------------------------------------

def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile of an already sorted sequence (q in 0..100)."""
    if not sorted_values:
        return float("nan")
    k = (len(sorted_values) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (k - lo)


def write_json(path: str, doc: dict) -> None:
    """Write atomically (a reader never sees half a file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=False)
        f.write("\n")
    os.replace(tmp, path)


class Stopwatch:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0


@dataclass
class LoaderBench:
    """A training script over a warmed dlcachefs mount of a JPEG ImageFolder, to run
    under ``dlcachefs run`` (made by :func:`loader_bench`)."""

    exe: str  #: the ``dlcachefs`` executable
    mnt: str  #: the mount point
    root: str  #: the ImageFolder's root on the mount (its ``train``)
    script: str  #: the training script's path
    files: int  #: the dataset's files

    def run(self, run_args: Sequence[str], script_args: Sequence[str]
            ) -> tuple[dict, str, float] | None:
        """Run ``python script root *script_args`` under ``dlcachefs run *run_args``: the
        JSON of its last stdout line, its stderr, and the seconds the process took; None
        when it failed (the tail of its stderr printed)."""
        t0 = time.perf_counter()
        r = subprocess.run([self.exe, "run", *run_args, "--", sys.executable, self.script,
                            self.root, *script_args], capture_output=True, text=True)
        if r.returncode != 0:
            print(r.stderr[-3000:], file=sys.stderr)
            return None
        res = json.loads(r.stdout.strip().splitlines()[-1])
        return res, r.stderr, time.perf_counter() - t0


@contextlib.contextmanager
def loader_bench(out: str, files: int, train: str) -> Iterator[LoaderBench]:
    """The setup of the benchmarks that time a DataLoader under ``dlcachefs run``
    (``bench.advise``, ``bench.workers_auto``): a JPEG ImageFolder dataset of about
    ``files`` files in 4 classes (``bench.make_dataset``, made once) in ``out/data``,
    the training script ``train`` written to ``out/train.py``, and dlcachefs over the
    dataset (``out/mnt``, a 10G cache in ``out/cache``), warmed first (``dlcachefs
    warmup``: the loader's time is its own, not the source's). Unmounted on exit."""
    from . import make_dataset as md  # (they import this module)
    from .mounting import DlcMount, dlcachefs_exe

    os.makedirs(out, exist_ok=True)
    data = os.path.join(out, "data")
    manifest, _ = md.ensure_dataset(data, md.Spec(classes=4, per_class=max(1, files // 4)),
                                    progress=sys.stderr.isatty())
    script = os.path.join(out, "train.py")
    with open(script, "w") as f:
        f.write(train)
    exe = dlcachefs_exe()
    with DlcMount(data, os.path.join(out, "mnt"), os.path.join(out, "cache"),
                  ["--cache-size", "10G"]) as m:
        subprocess.run([exe, "warmup", str(m.mnt), "--json"], check=True, capture_output=True)
        yield LoaderBench(exe, str(m.mnt), os.path.join(str(m.mnt), "train"), script,
                          len(manifest["file_list"]))
