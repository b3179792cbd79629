"""Helpers to run a real dlcachefs mount in a subprocess and always clean it up."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

DLCACHEFS = [sys.executable, "-m", "dlcachefs.cli"]


def wait_until(pred: Callable[[], object], what: str = "timed out", timeout: float = 60.0,
               interval: float = 0.05):
    """``pred()``'s first true value, polled until ``timeout`` seconds have passed: waits
    for something done in the background (never an assertion on how long it took)."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} (after {timeout:g} s)")
        time.sleep(interval)


def fuse_mounted(path: Path) -> bool:
    with open("/proc/self/mounts") as f:
        return any(line.split()[1] == str(path) for line in f if len(line.split()) > 2)


class Mount:
    """A foreground ``dlcachefs mount`` child process; ``.mnt`` is the mountpoint.

    Every mount runs with ``--debug-invariants``: the daemon checks the cache's invariants
    after every commit and logs each violation as an ERROR line; :meth:`violations`
    reads them back (the ``mount`` fixture fails a test that caused one)."""

    def __init__(self, source: Path, mnt: Path, cache: Path, *extra: str) -> None:
        self.source, self.mnt, self.cache = source, mnt, cache
        self.extra = extra if "--debug-invariants" in extra else (*extra, "--debug-invariants")
        self.proc: subprocess.Popen | None = None
        self.log = cache.parent / f"{mnt.name}.daemon.log"

    def start(self, timeout: float = 60.0) -> Mount:
        # OSError: a stale mount left by a killed daemon; the new daemon cleans it up
        with contextlib.suppress(OSError):
            self.mnt.mkdir(parents=True, exist_ok=True)
        logf = open(self.log, "ab")  # noqa: SIM115 - kept open for the child's lifetime
        self.proc = subprocess.Popen(
            [*DLCACHEFS, "mount", str(self.source), str(self.mnt), "--cache-dir", str(self.cache),
             "--foreground", *self.extra],
            stdin=subprocess.DEVNULL, stdout=logf, stderr=logf)
        logf.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mount exited with {self.proc.returncode}: {self.log.read_text()}")
            if fuse_mounted(self.mnt):
                try:
                    self.stats()
                    return self
                except OSError:
                    pass
            time.sleep(0.05)
        self.cleanup()
        raise RuntimeError(f"mount not ready after {timeout} s: {self.log.read_text()}")

    def violations(self) -> list[str]:
        """The invariant violations the daemon logged so far (all its mounts on this log)."""
        return self.violations_in(self.log)

    @staticmethod
    def violations_in(log: Path) -> list[str]:
        if not log.exists():
            return []
        return [line for line in log.read_text(errors="replace").splitlines()
                if "invariant violated" in line]

    def stats(self) -> dict:
        with open(self.mnt / ".dlcache" / "stats", "rb") as f:
            return json.loads(f.read())

    def wait_stats(self, pred, what: str = "timed out", timeout: float = 60.0) -> dict:
        """Stats once ``pred(stats)`` holds: the daemon works in the background (polling
        with a deadline, not a timing assertion)."""
        last: dict = {}

        def check() -> dict | None:
            last["st"] = st = self.stats()
            return st if pred(st) else None

        try:
            return wait_until(check, what, timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}; stats: {json.dumps(last.get('st'), indent=1)}") from None

    def wait_cached(self, n_files: int, timeout: float = 60.0) -> dict:
        """Wait until ``n_files`` are indexed and nothing is pending (not a timing assertion)."""
        return self.wait_stats(lambda st: st["cached_files"] >= n_files
                               and st["pending_bytes"] == 0, "cache did not settle", timeout)

    def umount(self, timeout: float = 60.0) -> None:
        r = subprocess.run([*DLCACHEFS, "umount", str(self.mnt)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        if self.proc is not None:
            self.proc.wait(timeout=timeout)
            assert self.proc.returncode == 0, self.log.read_text()

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def cleanup(self) -> None:
        """Whatever state it is in: unmount and end the child (only ours, by PID)."""
        if fuse_mounted(self.mnt):
            subprocess.run(["fusermount3", "-u", "-z", str(self.mnt)], capture_output=True)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def drop_page_cache() -> None:
    """Make the next reads reach the daemon (needs root; a no-op otherwise)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def read_tree(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            if p.is_symlink():
                continue
            out[str(p.relative_to(root))] = p.read_bytes()
    return out
