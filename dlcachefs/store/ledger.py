"""The ledger of a shared cache root (``--shared-cache``): one small JSON file under flock.

Several daemons, one per dataset, share a cache root and one ``--cache-size`` budget.
Each keeps its own cache under ``<root>/datasets/<id>/`` and publishes, every few
seconds, one entry in ``<root>/ledger.json``:

    {"version": 1, "budget": BYTES,
     "datasets": {ID: {"pid", "host", "state": "live"|"stopped"|"dead", "heartbeat",
                       "limit", "used", "demand", "cost", "bytes_per_s", "latency_s",
                       "crf", "crf_t", "last_read", "source", "mountpoint"}}}

``limit`` is the entry's promise: the bytes its dataset may hold on disk (its chunks),
whatever its daemon does next. The protocol keeps ``sum(limit) <= budget`` over every
entry, and each daemon keeps its chunk bytes below its published limit:

* an entry grows its limit only here, under the lock, into what the others' limits
  leave (:func:`grant`), and its daemon applies the larger limit after the file says so;
* a daemon shrinks first (its victims doomed and their drop committed), and publishes
  the smaller limit after;
* an entry whose daemon is gone (its pid not alive, or no heartbeat for
  :data:`STALE_HEARTBEATS` intervals) is marked ``dead`` and keeps its last limit (a
  killed daemon may have sealed up to it); a daemon that stops cleanly publishes
  ``stopped`` with ``limit`` = its exact chunk bytes. Either keeps counting until its
  dataset is mounted again (the new daemon takes the entry over) or its directory
  ``<root>/datasets/<id>`` is removed (the entry is then dropped by whoever looks);
* a ``stopped`` entry past its cooldown shrinks when a live daemon needs the room: that
  daemon evicts from the dataset first and lowers the entry's ``limit`` after
  (:mod:`dlcachefs.store.reclaim`, chosen by :mod:`dlcachefs.cache.shares`).

Concurrency: blocking (flock, file I/O, fsync); called from worker threads
(``trio.to_thread``) or before the trio loop starts. The lock is ``<root>/ledger.lock``,
held only for a read-modify-write of the file (milliseconds), with no other lock taken
meanwhile; a dataset's cache lock, when one is held, is always taken before it (a
daemon's own, or a stopped dataset's while another daemon evicts from it:
:mod:`dlcachefs.store.reclaim`), so there is no lock-order cycle. The file is replaced by rename, so a
reader without the lock sees the old or the new document, never half of one. One host
only: pids and flock mean nothing across machines (a root on NFS shared by nodes is not
supported).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from dlcachefs.errors import DlcError

T = TypeVar("T")

LEDGER = "ledger.json"
LEDGER_LOCK = "ledger.lock"
FORMAT = 1
#: an entry whose heartbeat is older than this many publishing intervals is dead
STALE_HEARTBEATS = 10
#: ... and never younger than this (a daemon stuck in a long commit is not dead)
STALE_MIN_S = 30.0


def check_root(cache_dir: str, shared: bool, datasets_dir: str) -> None:
    """Refuse a cache directory used the other way: a single-dataset cache (it has an
    index) as a shared root, or a shared root (it has a ledger or datasets) without
    ``--shared-cache`` (its budget would not be counted). Raises DlcError."""
    if shared and os.path.exists(os.path.join(cache_dir, "meta.lmdb")):
        raise DlcError(f"{cache_dir} is the cache of one dataset (it has meta.lmdb); "
                       "--shared-cache needs a cache root of its own (a new --cache-dir)")
    if not shared and (os.path.exists(os.path.join(cache_dir, LEDGER))
                       or os.path.isdir(os.path.join(cache_dir, datasets_dir))):
        raise DlcError(f"{cache_dir} is a shared cache root (several datasets, one budget); "
                       "mount it with --shared-cache")
    if not shared:
        # a root's datasets/ directory, or one dataset's directory in it, as a plain cache:
        # its bytes would sit in the root uncounted by the root's budget
        real = os.path.realpath(cache_dir)
        for d in (real, os.path.dirname(real)):  # <root>/datasets, <root>/datasets/<id>
            root = os.path.dirname(d)
            if os.path.basename(d) == datasets_dir and os.path.exists(os.path.join(root, LEDGER)):
                raise DlcError(f"{cache_dir} is inside the shared cache root {root}; mount "
                               f"with --shared-cache --cache-dir {root} (and --dataset NAME)")


def empty_doc() -> dict[str, Any]:
    return {"version": FORMAT, "budget": 0, "datasets": {}}


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (ours or another user's)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def is_live(entry: dict[str, Any], now: float, interval: float) -> bool:
    """Whether ``entry``'s daemon still runs and publishes (:data:`STALE_HEARTBEATS`)."""
    if entry.get("state") != "live":
        return False
    if entry.get("host") != socket.gethostname() or not pid_alive(int(entry.get("pid", 0))):
        return False
    stale = max(STALE_MIN_S, STALE_HEARTBEATS * float(entry.get("interval", interval)))
    return now - float(entry.get("heartbeat", 0.0)) <= stale


def expire(doc: dict[str, Any], root: str, datasets_dir: str, now: float,
           interval: float) -> None:
    """Mark entries of daemons that are gone ``dead`` (their limit keeps counting), and
    drop entries whose dataset directory was removed."""
    for ds, e in list(doc["datasets"].items()):
        if not os.path.isdir(os.path.join(root, datasets_dir, ds)):
            del doc["datasets"][ds]
        elif e.get("state") == "live" and not is_live(e, now, interval):
            e["state"] = "dead"


def counted(doc: dict[str, Any], but: str | None = None) -> int:
    """The bytes the entries (all but ``but``) may hold: the sum of their limits."""
    return sum(int(e.get("limit", 0)) for ds, e in doc["datasets"].items() if ds != but)


def grant(doc: dict[str, Any], ds: str, target: int) -> int:
    """Grow ``ds``'s published limit towards ``target`` into what the other entries'
    limits leave of the budget (never shrinks it: a daemon shrinks before it publishes).
    Returns the limit now published."""
    e = doc["datasets"][ds]
    cur = int(e.get("limit", 0))
    room = int(doc["budget"]) - counted(doc, but=ds)
    new = min(target, room)
    if new > cur:
        e["limit"] = cur = new
    return cur


class Ledger:
    """``<root>/ledger.json`` read and written under ``<root>/ledger.lock``."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.path = os.path.join(root, LEDGER)
        self.lock_path = os.path.join(root, LEDGER_LOCK)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The ledger's lock (exclusive, blocking). Tests hold it to read the daemons'
        chunk bytes while no limit can grow."""
        os.makedirs(self.root, mode=0o700, exist_ok=True)  # owner-only (store.modes)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock

    def read(self) -> dict[str, Any]:
        """The document as last written (an empty one when there is none). Raises
        DlcError when the file is not a ledger."""
        try:
            with open(self.path, "rb") as f:
                doc = json.loads(f.read() or b"{}")
        except FileNotFoundError:
            return empty_doc()
        except (OSError, ValueError) as e:
            raise DlcError(f"shared cache ledger {self.path} is unreadable ({e}); "
                           "remove it (it is rebuilt by the running mounts)") from None
        if not isinstance(doc, dict) or not doc:
            return empty_doc()
        if doc.get("version") != FORMAT or not isinstance(doc.get("datasets"), dict):
            raise DlcError(f"shared cache ledger {self.path}: unknown format "
                           f"{doc.get('version')!r}")
        if not all(isinstance(e, dict) for e in doc["datasets"].values()):
            raise DlcError(f"shared cache ledger {self.path}: an entry is not an object; "
                           "remove the file (the running mounts write it again)")
        return doc

    def _write(self, doc: dict[str, Any]) -> None:
        tmp = f"{self.path}.{os.getpid()}.tmp"
        data = json.dumps(doc, indent=1, sort_keys=True).encode()
        # the daemons' own file: 0600, with a reader group too (store.modes.PRIVATE)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)  # a crash must not leave an empty ledger (limits forgotten)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)

    def update(self, fn: Callable[[dict[str, Any]], T]) -> T:
        """Under the lock: read the document, ``fn(doc)`` changes it in place, write it
        back; ``fn``'s result is returned. ``fn`` runs with the lock held: no I/O in it
        but cheap stat calls."""
        with self.locked():
            doc = self.read()
            try:
                out = fn(doc)
            except (TypeError, ValueError, KeyError, AttributeError) as e:
                # the file is input: another version's or a hand-edited entry
                raise DlcError(f"shared cache ledger {self.path} has a malformed entry "
                               f"({type(e).__name__}: {e}); remove the file (the running "
                               "mounts write it again)") from None
            try:
                self._write(doc)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise DlcError(f"cannot write {self.path}: disk full") from None
                raise
            return out
