"""Run a real dlcachefs mount in a subprocess and always clean it up: :class:`Mount`,
for the tests and the benchmarks; and the oracle the tests apply to a daemon afterwards
(its exit, its log, its cache)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from dlcachefs import mountctl
from dlcachefs.mountctl import MountError

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


class Mount:
    """A dlcachefs mount run through its command line, always cleaned up; ``.mnt`` is the
    mountpoint, ``.pid`` the daemon's while it is mounted.

    Two ways to run the daemon:

    * in the foreground (the default; the tests): ``dlcachefs mount --foreground`` is our
      child; its stdout and stderr go to :attr:`log`, which the ``mount`` fixture reads
      after the test, with how the daemon ended (:meth:`exit_problem`; see
      :class:`DaemonOracle`). With ``debug_invariants`` (the default) the daemon checks
      the cache's invariants after every commit and logs each violation as an ERROR line.
    * daemonized (``daemonize=True``; the benchmarks, as a user runs it): ``dlcachefs
      mount`` forks the daemon and returns once the mount is ready; the daemon logs to
      ``<cache>/dlcachefs.log`` (:attr:`log`); its pid comes from the stats.

    ``cli`` is the ``dlcachefs`` command (default: this Python's ``-m dlcachefs.cli``);
    ``timeout`` bounds the start. :meth:`umount` runs ``dlcachefs umount``; when that
    fails, the mount is detached lazily and the daemon this object started ended (by its
    pid, checked against its command line; nothing else is ever signalled), then
    :class:`MountError` is raised. As a context manager: started on the way in, unmounted
    on the way out, also when the body fails (whose error is then the one raised)."""

    def __init__(self, source: str | os.PathLike, mnt: str | os.PathLike,
                 cache: str | os.PathLike, *extra: str, log: str | os.PathLike | None = None,
                 cli: Sequence[str] | None = None, daemonize: bool = False,
                 timeout: float = 60.0, debug_invariants: bool = True) -> None:
        self.source, self.mnt, self.cache = (Path(os.path.abspath(p)) for p in (source, mnt, cache))
        if debug_invariants and "--debug-invariants" not in extra:
            extra = (*extra, "--debug-invariants")
        if not any(a == "--min-free" or a.startswith("--min-free=") for a in extra):
            # The tests' datasets are a few MB: the host's free disk (the default floor is
            # 1 GiB) must not decide whether a test caches anything (CI failed on a full disk).
            extra = (*extra, "--min-free", "64M")
        self.extra = extra
        self.cli = list(cli or DLCACHEFS)
        self.daemonize = daemonize
        self.timeout = timeout
        self.log = Path(log) if log is not None else (
            self.cache / "dlcachefs.log" if daemonize
            else self.cache.parent / f"{self.mnt.name}.daemon.log")
        self.proc: subprocess.Popen | None = None  # the foreground daemon
        self.pid: int | None = None  # the daemon's, while mounted
        self.mount_s: float | None = None  # how long the start took
        self.umount_s: float | None = None  # how long ``dlcachefs umount`` took
        self.killed = False  # by the test, with kill9()
        self.forced = False  # by cleanup(): it did not stop after SIGTERM

    # ----- life cycle --------------------------------------------------------------------

    def start(self, timeout: float | None = None) -> Mount:
        """Mount, and return once the mount answers (its stats are readable)."""
        timeout = self.timeout if timeout is None else timeout
        # OSError: a stale mount left by a killed daemon; the new daemon cleans it up
        with contextlib.suppress(OSError):
            self.mnt.mkdir(parents=True, exist_ok=True)
        cmd = [*self.cli, "mount", str(self.source), str(self.mnt), "--cache-dir",
               str(self.cache), *self.extra]
        t0 = time.perf_counter()
        if self.daemonize:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            self.mount_s = time.perf_counter() - t0
            if r.returncode != 0:
                raise MountError(f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
            try:
                self.pid = int(self.stats()["pid"])
            except Exception:
                self.cleanup()
                raise
            return self
        with open(self.log, "ab") as logf:  # the child keeps its own descriptor
            self.proc = subprocess.Popen([*cmd, "--foreground"], stdin=subprocess.DEVNULL,
                                         stdout=logf, stderr=logf)
        self.pid = self.proc.pid
        try:
            mountctl.wait_mounted(self.mnt, self.proc, timeout, "dlcachefs mount",
                                  ready=self.stats)
        except MountError as e:
            self.cleanup()
            raise MountError(f"{e}: {self.log.read_text()}") from None
        self.mount_s = time.perf_counter() - t0
        return self

    def umount(self, timeout: float = 60.0) -> None:
        """``dlcachefs umount``, then wait (at most ``timeout`` seconds) for a foreground
        daemon to exit, with status 0. A no-op when not mounted by this object."""
        if self.pid is None and not mountctl.is_mounted(self.mnt):
            return
        t0 = time.perf_counter()
        try:
            # the command waits up to 120 s (its --timeout) for the daemon's last commit
            r = subprocess.run([*self.cli, "umount", str(self.mnt)], capture_output=True,
                               text=True, timeout=max(self.timeout, 120.0) + 30)
            ok, err = r.returncode == 0, r.stderr.strip()
        except subprocess.TimeoutExpired:
            ok, err = False, "timed out"
        self.umount_s = time.perf_counter() - t0
        if not ok:
            self.cleanup()
            raise MountError(f"dlcachefs umount {self.mnt} failed: {err}")
        if self.proc is not None:
            try:
                rc = self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.cleanup()
                raise MountError(f"daemon {self.proc.pid} did not exit within {timeout:g} s "
                                 f"of the unmount: {self.log.read_text()}") from None
            if rc != 0:
                raise MountError(f"daemon {self.proc.pid} exited with status {rc}: "
                                 f"{self.log.read_text()}")
        self.pid = None

    def kill9(self) -> None:
        """Kill the daemon with SIGKILL (a crash; it leaves a stale mount behind)."""
        self.killed = True
        if self.proc is not None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        elif self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            mountctl.wait_gone(self.pid, 30)
        self.pid = None

    def cleanup(self) -> None:
        """Whatever state it is in: detach the mount lazily and end the daemon (only
        ours: our child, or the daemonized pid checked against its command line)."""
        if mountctl.is_mounted(self.mnt):
            mountctl.unmount(self.mnt, lazy="at_once")
        if self.proc is not None:
            self.forced = mountctl.end_child(self.proc, grace=30) or self.forced
        elif self.pid is not None:
            mountctl.end_pid(self.pid, b"dlcachefs", grace=30, kill_grace=10)
        self.pid = None

    def __enter__(self) -> Mount:
        return self.start()

    def __exit__(self, *exc) -> None:
        try:
            self.umount()
        except MountError as e:
            if exc[0] is None:
                raise
            print(f"dlcachefs: {e}", file=sys.stderr)  # do not hide the body's error

    # ----- observing -----------------------------------------------------------------------

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

    def exit_problem(self) -> str | None:
        """How a foreground daemon ended, after :meth:`cleanup`, when not as it should:
        with status 0, after an unmount or a SIGTERM (a SIGKILL sent by :meth:`kill9` is
        expected)."""
        if self.proc is None or self.killed:
            return None
        rc = self.proc.poll()
        what = f"daemon {self.proc.pid} (mounted at {self.mnt})"
        if rc is None:
            return f"{what} is still running"
        if self.forced:
            return f"{what} did not stop within 30 s of SIGTERM; killed"
        if rc < 0:
            return f"{what} died of {signal.Signals(-rc).name}"
        return f"{what} exited with status {rc}" if rc else None


# ----- the oracle: what a daemon logged, and what it left in its cache ------------------

#: The start of a logged record (the daemon's format: "date time LEVEL logger: msg").
_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ ")
#: A logged record at WARNING or above.
_LOGGED_PROBLEM = re.compile(_RECORD.pattern + "(WARNING|ERROR|CRITICAL) ")
#: A Python warning printed by the ``warnings`` module ("file.py:12: FooWarning: msg").
_PY_WARNING = re.compile(r"^\S+:\d+: \w*Warning: ")
_TRACEBACK = "Traceback (most recent call last)"


#: For ``daemon_log_allows``: the daemon mounting over a stale FUSE mount, the one a daemon
#: killed by SIGKILL leaves behind, cleans it up and says so.
STALE_MOUNT = r"WARNING dlcachefs: mountpoint \S+ is a stale FUSE mount; unmounting it$"


#: For every tier's log oracle: what a small memory cgroup makes the core warn of at
#: start (the buffers fitted to the limit; no room for the sampler replay worker). A CI
#: box in such a cgroup must not fail every test for it.
SMALL_CGROUP = r"WARNING dlcachefs\.session: memory cgroup limit \d+ MiB\b"

#: The format of a daemon's log records (mount/daemon.py), also used to show in-process
#: records to the same ``allows`` regexes.
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_FORMATTER = logging.Formatter(LOG_FORMAT)


def _allowed(text: str, allows: Iterable[str]) -> bool:
    return any(re.search(a, text) for a in allows)


def record_problems(records: Iterable[logging.LogRecord],
                    allows: Iterable[str] = ()) -> list[str]:
    """:func:`log_problems` for records logged in this process (the core tiers): each
    record at WARNING or above, formatted as a daemon log writes it (with its traceback,
    if it carries one), that no ``allows`` regex (nor :data:`SMALL_CGROUP`) finds a match
    in."""
    allows = (*allows, SMALL_CGROUP)
    out = []
    for r in records:
        if r.levelno < logging.WARNING:
            continue
        text = _FORMATTER.format(r)
        if not _allowed(text, allows):
            out.append(text)
    return out


def log_problems(log: Path, allows: Iterable[str] = ()) -> list[str]:
    """What a daemon log holds that no test expects: records logged at WARNING or above
    (invariant violations are ERROR records), Python warnings, and tracebacks, printed or
    logged. A traceback is one problem from its "Traceback" line to the exception's line;
    each problem passes only if one of the ``allows`` regexes (or :data:`SMALL_CGROUP`)
    finds a match in it."""
    if not log.exists():
        return []
    allows = (*allows, SMALL_CGROUP)
    lines = log.read_text(errors="replace").splitlines()
    problems = []
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        if _TRACEBACK in line:
            block = [line]
            while i < len(lines) and lines[i][:1].isspace():
                block.append(lines[i])
                i += 1
            if i < len(lines) and lines[i] and not _RECORD.match(lines[i]):
                # the exception's own line ("ValueError: ..."), if it is not indented
                block.append(lines[i])
                i += 1
            problem = "\n".join(block)
        elif _LOGGED_PROBLEM.match(line) or _PY_WARNING.match(line):
            problem = line
        else:
            continue
        if not _allowed(problem, allows):
            problems.append(problem)
    return problems


def verify_problems(cache: Path, allows: Iterable[str] = ()) -> list[str]:
    """Run ``dlcachefs verify`` on a cache directory no daemon holds any more: each damaged
    chunk or record and each index problem it reports, unless one of the ``allows`` regexes
    finds a match in it ("damaged chunk 3: ...", "damaged record: inode 7 (name) in chunk
    3", "index: ..."); and any other sign of trouble (an exit status that does not fit the
    report, output on stderr)."""
    if not (cache / "meta.lmdb").exists():
        return []  # the daemon never opened an index here (its mount failed: the test says why)
    allows = tuple(allows)
    r = subprocess.run([*DLCACHEFS, "verify", "--cache-dir", str(cache), "--json"],
                       capture_output=True, text=True, timeout=600)
    where = f"dlcachefs verify --cache-dir {cache}"
    try:
        rep = json.loads(r.stdout)
    except ValueError:
        return [f"{where} exited {r.returncode}: {r.stdout[-2000:]}{r.stderr[-3000:]}"]
    found = ([f"damaged chunk {b['chunk']}: {b['reason']}" for b in rep["bad_chunks"]]
             + [f"damaged record: inode {b['inode']} ({b['name']}) in chunk {b['chunk']}"
                for b in rep["bad_records"]]
             + [f"index: {p}" for p in rep["invariant_problems"]]
             + ([f"index damaged: {rep['index_damaged']}"] if rep.get("index_damaged") else []))
    problems = [f"{where}: {p}" for p in found if not _allowed(p, allows)]
    if r.returncode != (1 if found else 0):
        problems.append(f"{where} exited {r.returncode} for {len(found)} problems")
    problems += [f"{where} (stderr): {line}" for line in r.stderr.splitlines()
                 if line.strip() and not _allowed(line, allows)]
    return problems


class DaemonOracle:
    """What every test that ran a daemon must satisfy once its daemons have stopped: each
    :class:`Mount` ended well (:meth:`Mount.exit_problem`), no unexpected problem in their
    logs (:func:`log_problems`) and nothing damaged in their caches
    (:func:`verify_problems`). A test that provokes warnings or damages a cache on purpose
    says so, as narrowly as it can, with ``daemon_log_allows`` and ``verify_allows``
    (pytest markers taking regexes; see conftest.py)."""

    def __init__(self, log_allows: Iterable[str] = (), verify_allows: Iterable[str] = ()) -> None:
        self.log_allows, self.verify_allows = tuple(log_allows), tuple(verify_allows)
        self.logs: dict[Path, None] = {}
        self.caches: dict[Path, None] = {}
        self.mounts: list[Mount] = []

    def watch(self, log: Path | None = None, cache: Path | None = None,
              mount: Mount | None = None) -> None:
        """Check ``log`` and ``cache`` at the end (each once, however many daemons used it),
        and a ``mount``'s exit, log and cache."""
        if mount is not None:
            self.mounts.append(mount)
            log, cache = mount.log, mount.cache
        if log is not None:
            self.logs[Path(log)] = None
        if cache is not None:
            self.caches[Path(cache)] = None

    def problems(self) -> list[str]:
        """Call once no daemon runs on the watched caches any more (verify takes their lock)."""
        out = [p for m in self.mounts if (p := m.exit_problem()) is not None]
        out += [f"{log}: {p}" for log in self.logs for p in log_problems(log, self.log_allows)]
        for cache in self.caches:
            out += verify_problems(cache, self.verify_allows)
        return out


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
