"""dlcachefs mounted for a benchmark: :class:`dlcachefs.testing.mounting.Mount`, daemonized
as a user runs it, plus what a benchmark measures of its daemon.

    with DlcMount(source, mountpoint, cache_dir) as m:
        m.stats()            # the .dlcache/stats JSON
        m.pid                # the daemon's pid (from the stats)
        m.mount_s            # how long `dlcachefs mount` took

The mount is always unmounted on the way out, even when the body fails; a failed
``dlcachefs umount`` detaches it lazily and ends the daemon this object started (by its
pid, checked against its command line). Nothing else is ever killed.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

from dlcachefs.testing.mounting import Mount, MountError

from .util import bdi_read_ahead_kb, proc_cpu_seconds, proc_status_kb, reset_peak_rss

__all__ = ["STATE_KEYS", "DlcMount", "MountError", "counter_delta", "dlcachefs_exe"]

#: stats keys that describe the cache's state (not counters since mount)
STATE_KEYS = frozenset({
    "version", "pid", "source", "mountpoint", "cache_dir", "uptime_s", "files", "bytes_total",
    "cached_files", "cached_bytes", "chunks", "chunk_bytes", "cache_limit_bytes",
    "memory_bytes", "memory_limit_bytes", "pending_bytes", "open_files", "revalidate_s",
})


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
        if k == "fuse_ops" and isinstance(v, dict):  # FUSE requests per operation
            out[k] = {op: n - before.get(k, {}).get(op, 0) for op, n in v.items()}
            continue
        if k in STATE_KEYS or not isinstance(v, (int, float)) or isinstance(v, bool):
            continue
        out[k] = v - before.get(k, 0)
    return out


class DlcMount(Mount):
    """A daemonized mount run by the ``dlcachefs`` executable ``exe`` (default: the
    venv's), ``timeout`` seconds for ``dlcachefs mount`` (a first mount scans the source),
    no invariant checks (they cost time); plus the daemon's read_ahead_kb, CPU and RSS."""

    def __init__(self, source: str, mountpoint: str, cache_dir: str,
                 extra_args: list[str] | tuple[str, ...] = (), exe: str | None = None,
                 timeout: float = 300.0) -> None:
        super().__init__(source, mountpoint, cache_dir, *extra_args,
                         cli=[exe or dlcachefs_exe()], daemonize=True, timeout=timeout,
                         debug_invariants=False)
        self.read_ahead_kb: int | None = None

    def start(self, timeout: float | None = None) -> DlcMount:
        super().start(timeout)
        self.read_ahead_kb = bdi_read_ahead_kb(str(self.mnt))
        return self

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
