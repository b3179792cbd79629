"""One daemon per cache directory: an exclusive ``flock`` on ``<cache-dir>/lock``.

With ``--shared-cache`` the directory is a dataset's own cache under the root
(``<root>/datasets/<id>/lock``): several daemons share the root, one per dataset.

The kernel releases the lock when the holder dies (even by ``kill -9``), so a crashed
daemon never blocks the next mount. The file says who holds it, for the error message.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable

from dlcachefs.errors import CacheLocked

#: the lock file's name in the cache directory
LOCK_NAME = "lock"
#: seconds a stopped daemon's children (fetch workers) may hold its lock after it
CHILDREN_EXIT_S = 3.0
#: seconds a mount waits for a reclaim of its dataset's space by another daemon's child
#: (:mod:`dlcachefs.store.reclaim`, which ends within its CHILD_TIMEOUT_S, 20 s)
RECLAIM_WAIT_S = 30.0


class CacheLock:
    def __init__(self, cache_dir: str, dataset: str | None = None,
                 is_mounted: Callable[[str], bool] | None = None,
                 wait_for_exit: Callable[[int], bool] | None = None) -> None:
        """``dataset``: the dataset id when ``cache_dir`` is one under a shared root (for
        the error message). ``is_mounted(path)``: whether a FUSE filesystem is mounted
        at ``path`` (:func:`dlcachefs.mountctl.is_mounted`), for a holder's mountpoint in
        the error message; without it the holder is taken to be mounted there.
        ``wait_for_exit(pid)``: wait a bounded time for process ``pid`` to exit, True when
        it did; a holder no longer mounted (a daemon stopping after an unmount) is waited
        for with it before the lock is refused. Without it, refused at once."""
        self.path = os.path.join(cache_dir, LOCK_NAME)
        self.dataset = dataset
        self.is_mounted = is_mounted
        self.wait_for_exit = wait_for_exit
        self.fd: int | None = None

    def acquire(self, mountpoint: str) -> None:
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)  # owner-only
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if not _try_lock(fd):
            holder = _holder(fd)
            pid = holder.get("pid")
            if holder.get("reclaim") is True and _lock_within(fd, RECLAIM_WAIT_S):
                # another daemon's child was taking back this stopped dataset's space
                self._take(fd, mountpoint)
                return
            # `fusermount3 -u MNT` then at once a new mount: the last daemon is still
            # committing as it stops. It is waited for (a bounded time), not refused
            stopping = self._detached(holder.get("mountpoint", "?"))
            if (stopping and isinstance(pid, int) and self.wait_for_exit is not None
                    and self.wait_for_exit(pid) and _lock_within(fd, CHILDREN_EXIT_S)):
                self._take(fd, mountpoint)
                return
            os.close(fd)
            if self.dataset is not None:
                raise CacheLocked(
                    f"dataset {self.dataset} of the shared cache "
                    f"{os.path.dirname(os.path.dirname(os.path.dirname(self.path)))} is in "
                    f"use by another dlcachefs daemon (pid {holder.get('pid', '?')}, mounted "
                    f"at {holder.get('mountpoint', '?')}); one daemon per dataset: unmount "
                    "it first, or give this mount another --dataset") from None
            mp = holder.get("mountpoint", "?")
            # not mounted there (as this process sees the mount table): still starting
            # (scanning the source), committing as it stops, or unmounted lazily
            if not stopping:
                what = f", mounted at {mp}); unmount it first"
            elif mp == mountpoint and self.wait_for_exit is not None:
                what = (f"), not mounted at {mp} now: the daemon of the last mount there is "
                        "still starting or stopping (committing what it fetched, or unmounted lazily "
                        "and exiting once the files still open there are closed); wait for "
                        "it to exit, close them")
            else:
                what = (f"), not mounted at {mp} now: starting, stopping, or unmounted "
                        "lazily and exiting once the files still open there are closed; "
                        "wait, close them")
            raise CacheLocked(
                f"cache directory {os.path.dirname(self.path)} is in use by another dlcachefs "
                f"daemon (pid {holder.get('pid', '?')}{what}, or choose another --cache-dir"
            ) from None
        self._take(fd, mountpoint)

    def _take(self, fd: int, mountpoint: str) -> None:
        """The lock on ``fd`` is ours: say who holds it."""
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "mountpoint": mountpoint}).encode(), 0)
        self.fd = fd

    def _detached(self, mountpoint: str) -> bool:
        """Whether a daemon's mountpoint is no longer mounted (a lazy unmount: the daemon
        serves the files still open and exits after the last close)."""
        return (self.is_mounted is not None and os.path.isabs(mountpoint)
                and not self.is_mounted(mountpoint))

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _lock_within(fd: int, seconds: float) -> bool:
    """Take the lock on ``fd``, trying for up to ``seconds``: a daemon's fetch workers
    hold it too, and end a moment after it (their parent-death signal)."""
    deadline = time.monotonic() + seconds
    while not _try_lock(fd):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _try_lock(fd: int) -> bool:
    """Take the exclusive lock on ``fd`` if no one holds it; whether it was taken."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(fd: int) -> dict:
    """Who holds the lock, as the holder wrote it (pid, mountpoint); {} when unreadable."""
    try:
        holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return holder if isinstance(holder, dict) else {}
