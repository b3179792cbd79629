"""A stopped dataset of a shared root gives space back: its chunks evicted by another
daemon (``--shared-cache``; the choice of dataset and amount is :mod:`dlcachefs.cache.shares`).

A dataset whose daemon stopped cleanly keeps its cache, counted in the root's ledger
(:mod:`dlcachefs.store.ledger`) until it is mounted again. A live daemon that needs the
room evicts part of it with :func:`evict_stopped`, in this order (the crash-safety
argument is the chunk writer's, :mod:`dlcachefs.cache.writer`):

1. the dataset's cache lock (:mod:`dlcachefs.store.lock`), taken without waiting: free
   means no daemon runs on it (a daemon holds it while it runs, its fetch workers too).
   The lock file then names this process as a reclaim (``"reclaim": true``): a mount of
   the dataset starting meanwhile waits for the lock up to
   :data:`~dlcachefs.store.lock.RECLAIM_WAIT_S`, longer than this child may run
   (:data:`CHILD_TIMEOUT_S`), instead of being refused;
2. its index only if it is exactly as its clean stop left it (the stop's walk found it
   sound and marked it, :func:`~dlcachefs.store.integrity.mark_clean`): an index a crash
   left, or one that changed since, is not opened here (reading a damaged LMDB file can
   kill this process) and keeps counting until its dataset is mounted again. The mark is
   removed before the index is opened, so a crash from here on makes the next start walk
   it;
3. its oldest chunks (lowest chunk ids, the order they were sealed in: within a dataset
   that nobody reads, none is known to be used sooner than another) until ``nbytes`` are
   chosen, dropped with their records in ONE write transaction
   (:func:`~dlcachefs.store.seal.seal_chunks`, which withdraws their content offers too);
   committed (LMDB fsyncs);
4. then their bytes given back: a log that no longer holds an indexed chunk is deleted,
   the others get holes punched (a crash before leaves bytes nothing indexes, as a crash
   of the writer between its commit and its punches does: space, never wrong bytes);
5. the index closed and marked clean again (nothing but this transaction wrote to it
   since the mark was checked);
6. the ledger entry, still ``stopped``, lowered to the chunk bytes now held (so the sum
   of limits drops only after the disk did), and the lock released.

The dataset's next mount recovers as after any stop: the chunks kept are served, the
files evicted are fetched again from its source.

A daemon runs it in a child process (:func:`evict_stopped_in_child`): LMDB must not open
one environment twice in a process (the daemon may hold the dataset's index open
read-only already, for content dedup), and a child is also what the daemon reads another
dataset's index in first anyway (:func:`~dlcachefs.store.integrity.check_index`): the
daemon never maps an index it does not own for writing. The child takes the lock; if it
dies, the kernel releases the lock, and a commit is whole or absent.

Blocking (flock, LMDB, file I/O; a child process); called from a worker thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dlcachefs.store import integrity
from dlcachefs.store import ledger as L
from dlcachefs.store import schema as S
from dlcachefs.store.index import Index
from dlcachefs.store.lock import LOCK_NAME
from dlcachefs.store.logs import LogStore
from dlcachefs.store.seal import seal_chunks

log = logging.getLogger(__name__)

#: run the child with -P where there is one (3.11+): a module in the daemon's working
#: directory never shadows one of ours
SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []

#: why a dataset was not evicted from: its index is not as its clean stop left it
UNFIT = "not as its clean stop left it"
#: the index and logs of a dataset's directory (as :class:`dlcachefs.config.Config` names them)
INDEX_DIR, LOGS_DIR = "meta.lmdb", "logs"


@dataclass(frozen=True, slots=True)
class Reclaimed:
    """What one :func:`evict_stopped` did."""

    dataset: str
    #: chunk bytes dropped from its index (0: nothing done; ``skipped`` says why)
    freed: int = 0
    chunks: int = 0
    #: chunk bytes it holds now
    left: int = 0
    skipped: str | None = None


@contextlib.contextmanager
def _hold_if_free(cache_dir: str):
    """The dataset's cache lock if no one holds it (yields True), else yields False. The
    lock file's content (who held it last) is left as it is (module doc, step 1)."""
    path = os.path.join(cache_dir, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        yield False  # no lock file: not a dataset a daemon ever ran on
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        # a mount starting meanwhile waits for this holder (store.lock.RECLAIM_WAIT_S)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "reclaim": True}).encode(), 0)
        yield True
    finally:
        os.close(fd)  # releases the flock


def evict_stopped(root: str, datasets_dir: str, ds: str, nbytes: int,
                  still_stopped: Callable[[dict[str, Any]], bool]) -> Reclaimed:
    """Evict at least ``nbytes`` of chunk bytes (whole chunks, oldest first) of the
    stopped dataset ``ds`` of the shared root ``root`` (module doc). ``still_stopped(entry)``
    says, of its ledger entry read with the dataset's lock held, whether it is still the
    stopped one the caller chose; if not, nothing is done."""
    d = os.path.join(root, datasets_dir, ds)
    ledger = L.Ledger(root)
    index_dir = os.path.join(d, INDEX_DIR)
    with _hold_if_free(d) as held:
        if not held:
            return Reclaimed(ds, skipped="in use")
        entry = ledger.read()["datasets"].get(ds)
        if entry is None or not still_stopped(entry):
            return Reclaimed(ds, skipped="no longer stopped")
        if not integrity.unchanged_since_clean_stop(index_dir):
            return Reclaimed(ds, skipped=UNFIT)
        index = Index(index_dir)
        try:
            victims, total = [], 0
            chunks = index.iter_chunks()  # in chunk id order: the oldest first
            try:
                for c in chunks:
                    if total >= nbytes:
                        break
                    victims.append(c.chunk_id)
                    total += c.length
            finally:
                chunks.close()  # its read transaction ends before the write's begins
            sealed = seal_chunks(index, [], keep_indexed=True, victims=victims)
            left = index.counter(S.K_CHUNK_BYTES)
            live: dict[int, int] = {}
            for c in index.iter_chunks():
                live[c.log_id] = live.get(c.log_id, 0) + c.length
        except BaseException:
            index.close()  # not marked clean: its next start walks it
            raise
        logs = LogStore(os.path.join(d, LOGS_DIR), log_size=0)
        try:
            for c in sealed.evicted:
                live[c.log_id] = live.get(c.log_id, 0) + c.length
            logs.live = live
            for c in sealed.evicted:  # deletes a log whose live bytes reach 0, else punches
                logs.release(c.log_id, c.offset, c.length)
        finally:
            logs.close()
            index.close()
        integrity.mark_clean(index_dir)
        freed = sum(c.length for c in sealed.evicted)

        def lower(doc: dict[str, Any]) -> None:
            e = doc["datasets"].get(ds)
            if e is None or not still_stopped(e):
                return  # cannot be: its lock was held all along
            e["limit"] = min(int(e.get("limit", left)), left)
            e["used"] = left
            e["reclaimed_bytes"] = int(e.get("reclaimed_bytes", 0)) + freed
            e["reclaimed_at"] = time.time()

        ledger.update(lower)
    return Reclaimed(ds, freed, len(sealed.evicted), left)


#: seconds a child may take (one commit and the punches; a walk is never made here)
CHILD_TIMEOUT_S = 20.0

_CHILD = r"""
import json, sys
from dlcachefs.store.reclaim import _child
print(json.dumps(_child(json.loads(sys.argv[1]))))
"""


def _child(args: dict[str, Any]) -> dict[str, Any]:
    """In the child: :func:`evict_stopped` for the entry stopped at ``args["stopped_at"]``."""
    at = float(args["stopped_at"])

    def same_stop(e: dict[str, Any]) -> bool:
        return e.get("state") == "stopped" and float(e.get("heartbeat") or 0.0) == at

    try:
        r = evict_stopped(args["root"], args["datasets_dir"], args["dataset"],
                          int(args["nbytes"]), same_stop)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which logs it
        return {"error": f"{type(e).__name__}: {e}"[:500]}
    return {"freed": r.freed, "chunks": r.chunks, "left": r.left, "skipped": r.skipped}


def evict_stopped_in_child(root: str, datasets_dir: str, ds: str, nbytes: int,
                           stopped_at: float) -> Reclaimed:
    """:func:`evict_stopped` in a child process (module doc), for the entry of ``ds``
    whose stop published ``heartbeat == stopped_at``. Raises OSError when the child
    failed (the reason in the message)."""
    # the same dlcachefs as ours, wherever the working directory is (a daemon is in /)
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (pkg_root, env.get("PYTHONPATH"))))
    args = {"root": root, "datasets_dir": datasets_dir, "dataset": ds, "nbytes": nbytes,
            "stopped_at": stopped_at}
    try:
        r = subprocess.run([sys.executable, *SAFE_PATH, "-c", _CHILD, json.dumps(args)],
                           capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
                           stdin=subprocess.DEVNULL, env=env)
    except subprocess.TimeoutExpired:
        raise OSError(f"did not finish in {CHILD_TIMEOUT_S:g} s") from None
    try:
        out = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise OSError(f"no report (exit {r.returncode}: {last[:300]})") from None
    if "error" in out:
        raise OSError(out["error"])
    if out["skipped"] is None:
        log.info("stopped dataset %s of the shared root: %d chunks (%d bytes) evicted for "
                 "room, %d bytes left", ds, out["chunks"], out["freed"], out["left"])
    return Reclaimed(ds, out["freed"], out["chunks"], out["left"], out["skipped"])
