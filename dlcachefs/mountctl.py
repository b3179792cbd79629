"""Mount lifecycle from the outside: is a path mounted, wait until it is, unmount it (with
a lazy fallback), end the daemon that served it.

The one implementation behind ``dlcachefs umount``, the daemon's clean-up of a stale
mount, and the subprocess mount helpers of the tests and the benchmarks
(:mod:`dlcachefs.testing.mounting`, ``bench/``).

Nothing here makes a call on a mountpoint itself: mounts are read from the mount table
(``/proc/self/mounts``), processes from ``/proc``. A daemon must never call into its own
mount (it would deadlock), and a hung mount must not hang whoever checks it. Unmounting
goes through ``fusermount3``, which works without root for the user's own FUSE mounts.
Standard library only.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from dlcachefs.errors import DlcError

#: what :func:`unmount` does when the plain unmount fails
Lazy = Literal["never", "if_busy", "if_failed", "at_once"]

_ESCAPE = re.compile(rb"\\([0-7]{3})")


class MountError(RuntimeError):
    """A mount that did not come up, or an unmount that failed."""


# ----- the mount table --------------------------------------------------------------------


def _unescape(field: bytes) -> str:
    # the kernel writes space, tab, newline and backslash as \ooo octal; other bytes as is
    return os.fsdecode(_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), field))


def parse_mount_table(data: bytes) -> dict[str, str]:
    """Mountpoint -> filesystem type, from the text of ``/proc/self/mounts``; the last
    mount on a path wins (it is the visible one)."""
    out: dict[str, str] = {}
    for line in data.splitlines():
        parts = line.split()
        if len(parts) > 2:
            out[_unescape(parts[1])] = os.fsdecode(parts[2])
    return out


def mount_table() -> dict[str, str]:
    """Mountpoint -> filesystem type (``fuse.dlcachefs``, ``fuse.sshfs``, ``ext4``...) of
    this process's mounts."""
    try:
        with open("/proc/self/mounts", "rb") as f:
            return parse_mount_table(f.read())
    except OSError:
        return {}


def _spellings(path: str | os.PathLike) -> set[str]:
    """How the mount table may name ``path``: as given (absolute), and with its parent's
    symlinks resolved. The path itself is never resolved (that would be a call on it)."""
    p = os.path.abspath(os.fspath(path))
    return {p, os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))}


def fstype(path: str | os.PathLike) -> str | None:
    """The filesystem type mounted at ``path``; None when nothing is mounted there."""
    table = mount_table()
    for p in _spellings(path):
        if p in table:
            return table[p]
    return None


def is_mounted(path: str | os.PathLike, fuse: bool = False) -> bool:
    """Whether something (with ``fuse``: a FUSE filesystem, ``fuse.*`` or ``fuseblk``) is
    mounted at ``path``."""
    t = fstype(path)
    return t is not None and (not fuse or t.startswith("fuse"))


def mounts_of(kind: str) -> list[str]:
    """The mountpoints of filesystems of type ``kind`` (e.g. ``fuse.dlcachefs``)."""
    return [p for p, t in mount_table().items() if t == kind]


def wait_mounted(path: str | os.PathLike, proc: subprocess.Popen | None = None,
                 timeout: float = 30.0, what: str = "mount",
                 ready: Callable[[], object] | None = None, interval: float = 0.05) -> float:
    """Wait until ``path`` is mounted (and ``ready()``, when given, returns true without
    raising OSError). Raises :class:`MountError` at once when ``proc`` (the daemon) exits
    first, and after ``timeout`` seconds otherwise (a startup deadline, not a
    measurement). Returns the seconds waited."""
    t0 = time.monotonic()
    while True:
        if is_mounted(path):
            try:
                if ready is None or ready():
                    return time.monotonic() - t0
            except OSError:
                pass  # mounted, not answering yet
        if proc is not None and proc.poll() is not None:
            raise MountError(f"{what} exited with status {proc.returncode} before {path} "
                             f"was mounted")
        if time.monotonic() - t0 > timeout:
            raise MountError(f"{what}: {path} not mounted after {timeout:g} s")
        time.sleep(interval)


# ----- unmounting ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Unmounted:
    """How :func:`unmount` went: ``ok``; ``lazy`` when it was detached lazily (files were
    open: the daemon goes on serving them and exits after the last is closed);
    ``error``, fusermount3's message when not ok."""

    ok: bool
    lazy: bool = False
    error: str = ""


def _fusermount(path: str, lazy: bool, timeout: float) -> tuple[bool, str]:
    args = ["fusermount3", "-u", *(["-z"] if lazy else []), path]
    try:
        r = subprocess.run(args, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        return False, str(e)
    return r.returncode == 0, r.stderr.strip()


def unmount(path: str | os.PathLike, lazy: Lazy = "if_busy", timeout: float = 60.0
            ) -> Unmounted:
    """Unmount the FUSE filesystem at ``path`` with ``fusermount3 -u``. When that fails,
    ``lazy`` says whether to detach it lazily (``-z``) instead: ``if_busy`` (files are
    open: the default), ``if_failed`` (whatever the reason: a clean-up that must not leave
    it behind), ``never``; ``at_once`` skips the plain unmount (a stale mount, whose daemon
    is dead, or a clean-up). Never raises; see :class:`Unmounted`."""
    p = os.path.abspath(os.fspath(path))
    if lazy != "at_once":
        ok, err = _fusermount(p, False, timeout)
        if ok:
            return Unmounted(True)
        if lazy == "never" or (lazy == "if_busy" and "busy" not in err.lower()):
            return Unmounted(False, error=err)
    ok, err = _fusermount(p, True, timeout)
    return Unmounted(ok, lazy=ok, error="" if ok else err)


# ----- the daemon's process -----------------------------------------------------------------


def check_apart(source: str, mountpoint: str, cache_dir: str) -> None:
    """Refuse (DlcError) a mountpoint that is the source, inside it or above it, or above
    the cache directory. The daemon would read its own mount: the source listed with the
    mount in it, or a source or cache hidden under it, where every read waits for a
    request that only the daemon can answer (a deadlock that not even SIGKILL ends).
    The source and the mountpoint are compared resolved (the daemon opens the source by
    its real path); the cache directory both as given, made absolute (the daemon opens it
    by that path: a symlink inside the mountpoint leading elsewhere hides it all the
    same), and resolved."""
    def inside(a: str, b: str) -> bool:  # a is b or below it
        return a == b or a.startswith(b.rstrip("/") + "/")

    def forms(p: str) -> set[str]:
        return {os.path.abspath(p), os.path.realpath(p)}

    src, mnt = os.path.realpath(source), os.path.realpath(mountpoint)
    if inside(mnt, src):
        raise DlcError(f"mountpoint {mountpoint} is the source {source} or inside it: "
                       f"mount it elsewhere (the daemon reads the source)")
    if inside(src, mnt):
        raise DlcError(f"source {source} is inside the mountpoint {mountpoint}: the mount "
                       f"would hide it from the daemon")
    if any(inside(c, m) for c in forms(cache_dir) for m in forms(mountpoint)):
        raise DlcError(f"cache directory {cache_dir} is inside the mountpoint "
                       f"{mountpoint}: the mount would hide it from the daemon")


def alive(pid: int) -> bool:
    """``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b") ", 1)[1][:1] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def cmdline(pid: int) -> bytes:
    """The command line of ``pid`` (NUL-separated); empty when it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def wait_gone(pid: int, timeout: float, interval: float = 0.05) -> bool:
    """Wait until ``pid`` has exited (at most ``timeout`` seconds); True when it has."""
    deadline = time.monotonic() + timeout
    while alive(pid):  # a zombie counts as gone: its parent reaps it
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def end_pid(pid: int | None, must_contain: bytes | None = None, grace: float = 5.0,
            kill_grace: float = 2.0) -> bool:
    """End one process we started but is not our :class:`subprocess.Popen` child (a
    daemonized mount): SIGTERM, then SIGKILL after ``grace`` seconds. When
    ``must_contain`` is given, the process's command line must contain it (a recycled pid
    is left alone). Returns True when the process is gone."""
    if not pid or pid <= 1 or not alive(pid):
        return True
    if must_contain is not None and must_contain not in cmdline(pid):
        return True
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, kill_grace)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
        if wait_gone(pid, wait):
            return True
    return not alive(pid)


def end_child(proc: subprocess.Popen, grace: float = 30.0) -> bool:
    """End our child ``proc``: SIGTERM, then SIGKILL after ``grace`` seconds (through
    Popen, so that its exit status stays known). True when it had to be killed."""
    if proc.poll() is not None:
        return False
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
        return False
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        return True


def stop_daemon(mnt: str | os.PathLike, proc: subprocess.Popen | None = None,
                pid: int | None = None, must_contain: bytes | None = None,
                grace: float = 10.0) -> list[str]:
    """Unmount ``mnt`` (lazily if a plain unmount fails) and make sure its daemon (our
    child ``proc``, or ``pid``) ended: after an unmount a FUSE daemon exits by itself; if
    it does not within ``grace`` seconds, it is ended. Returns the problems met (empty
    when all went well)."""
    problems = []
    if is_mounted(mnt):
        unmount(mnt, lazy="if_failed")
        if is_mounted(mnt):
            problems.append(f"{mnt} is still mounted")
    if proc is not None:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            problems.append(f"daemon pid {proc.pid} did not exit after unmount; ended it")
            end_child(proc, grace=5.0)
    elif pid and not wait_gone(pid, grace) and (must_contain is None
                                                 or must_contain in cmdline(pid)):
        problems.append(f"daemon pid {pid} did not exit after unmount; ended it")
        end_pid(pid, must_contain)
    return problems
