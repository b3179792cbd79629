"""Mount and unmount dlcachefs for a benchmark, through its CLI, and watch its daemon.

    with DlcMount(source, mountpoint, cache_dir) as m:
        m.stats()            # the .dlcache/stats JSON
        m.pid                # the daemon's pid (from the stats)

The mount is always unmounted on the way out, even when the body fails. If
``dlcachefs umount`` fails, the mount is detached lazily and the daemon this object
started (its pid, checked against its command line) is sent SIGTERM, then SIGKILL.
Nothing else is ever killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from .util import bdi_read_ahead_kb, proc_cpu_seconds, proc_status_kb, reset_peak_rss

#: stats keys that describe the cache's state (not counters since mount)
STATE_KEYS = frozenset({
    "version", "pid", "source", "mountpoint", "cache_dir", "uptime_s", "files", "bytes_total",
    "cached_files", "cached_bytes", "chunks", "chunk_bytes", "cache_limit_bytes",
    "memory_bytes", "memory_limit_bytes", "pending_bytes", "open_files", "revalidate_s",
})


class MountError(RuntimeError):
    pass


def dlcachefs_exe() -> str:
    """The ``dlcachefs`` next to this Python (the venv), else the one on PATH."""
    cand = os.path.join(os.path.dirname(sys.executable), "dlcachefs")
    if os.access(cand, os.X_OK):
        return cand
    found = shutil.which("dlcachefs")
    if not found:
        raise MountError("dlcachefs executable not found (is the venv active?)")
    return found


def counter_delta(before: dict, after: dict) -> dict:
    """after - before for every numeric counter (not the state keys)."""
    out = {}
    for k, v in after.items():
        if k in STATE_KEYS or not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        out[k] = v - before.get(k, 0)
    return out


class DlcMount:
    def __init__(self, source: str, mountpoint: str, cache_dir: str,
                 extra_args: list[str] | tuple[str, ...] = (), exe: str | None = None,
                 timeout: float = 300.0) -> None:
        self.source = os.path.abspath(source)
        self.mountpoint = os.path.abspath(mountpoint)
        self.cache_dir = os.path.abspath(cache_dir)
        self.extra_args = list(extra_args)
        self.exe = exe or dlcachefs_exe()
        self.timeout = timeout
        self.pid: int | None = None
        self.mount_s: float | None = None
        self.umount_s: float | None = None
        self.read_ahead_kb: int | None = None

    # ----- life cycle --------------------------------------------------------------------

    def mount(self) -> DlcMount:
        os.makedirs(self.mountpoint, exist_ok=True)
        cmd = [self.exe, "mount", self.source, self.mountpoint, "--cache-dir", self.cache_dir,
               *self.extra_args]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout)
        self.mount_s = time.perf_counter() - t0
        if r.returncode != 0:
            raise MountError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
        try:
            self.pid = int(self.stats()["pid"])
        except Exception:
            self._force_unmount()
            raise
        self.read_ahead_kb = bdi_read_ahead_kb(self.mountpoint)
        return self

    def umount(self) -> None:
        if self.pid is None and not _is_mounted(self.mountpoint):
            return
        t0 = time.perf_counter()
        try:
            r = subprocess.run([self.exe, "umount", self.mountpoint], capture_output=True,
                               text=True, timeout=self.timeout + 30)
            ok = r.returncode == 0
            err = r.stderr.strip()
        except subprocess.TimeoutExpired:
            ok, err = False, "timed out"
        self.umount_s = time.perf_counter() - t0
        if not ok:
            self._force_unmount()
            raise MountError(f"dlcachefs umount {self.mountpoint} failed: {err}")
        self.pid = None

    def _force_unmount(self) -> None:
        subprocess.run(["fusermount3", "-u", "-z", self.mountpoint], capture_output=True,
                       check=False)
        pid = self.pid
        if pid and _is_our_daemon(pid):
            for sig, wait in ((signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                deadline = time.monotonic() + wait
                while _alive(pid) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if not _alive(pid):
                    break
        self.pid = None

    def __enter__(self) -> DlcMount:
        return self.mount()

    def __exit__(self, *exc) -> None:
        try:
            self.umount()
        except MountError as e:
            if exc[0] is None:
                raise
            print(f"bench: {e}", file=sys.stderr)  # do not hide the original error

    # ----- observing -----------------------------------------------------------------------

    def stats(self) -> dict:
        with open(os.path.join(self.mountpoint, ".dlcache", "stats"), "rb") as f:
            return json.loads(f.read())

    def wait_idle(self, timeout: float = 60.0) -> float:
        """Wait until the chunk writer has sealed everything (pending_bytes == 0), so
        that what follows reads from the logs. Returns the seconds waited."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout:
            if self.stats().get("pending_bytes", 0) == 0:
                break
            time.sleep(0.1)
        return time.perf_counter() - t0

    def probe_start(self) -> dict:
        """Counters before a run; resets the daemon's peak RSS when allowed."""
        assert self.pid is not None
        return {"stats": self.stats(), "cpu_s": proc_cpu_seconds(self.pid),
                "peak_reset": reset_peak_rss(self.pid)}

    def probe_end(self, start: dict) -> dict:
        assert self.pid is not None
        cpu = proc_cpu_seconds(self.pid)
        hwm = proc_status_kb(self.pid, "VmHWM")
        rss = proc_status_kb(self.pid, "VmRSS")
        after = self.stats()
        return {
            "pid": self.pid,
            "stats_delta": counter_delta(start["stats"], after),
            "state_after": {k: after[k] for k in (
                "cached_files", "cached_bytes", "chunks", "chunk_bytes", "memory_bytes",
                "pending_bytes", "open_files") if k in after},
            "daemon_cpu_s": round(cpu - start["cpu_s"], 3)
            if cpu is not None and start["cpu_s"] is not None else None,
            # VmHWM: the peak of this run when the reset worked, else the peak since start
            "daemon_peak_rss_mb": round(hwm / 1024, 1) if hwm is not None else None,
            "daemon_peak_rss_scope": "run" if start["peak_reset"] else "since_mount",
            "daemon_rss_mb": round(rss / 1024, 1) if rss is not None else None,
        }


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][:1] not in ("Z", "X")
    except OSError:
        return False


def _is_our_daemon(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"dlcachefs" in f.read()
    except OSError:
        return False


def _is_mounted(path: str) -> bool:
    with contextlib.suppress(OSError), open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 2 and parts[1].encode().decode("unicode_escape") == path:
                return True
    return False
