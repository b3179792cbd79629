"""Reading a mounted dataset's files straight from the cache directory, with the mount as
the fallback.

A :class:`CacheReader` belongs to one dlcachefs mount (found from a path inside it: the
mount says where its cache is in ``<mount>/.dlcache/zerocopy``). ``read(path)`` returns
the file's bytes: from the cache directory when the daemon's index says the file's
current version is cached there (one LMDB read transaction, one ``pread`` of the record,
its xxh3-64 checked), else by one ``open`` + ``read`` of ``path`` through the mount, which
fills the cache exactly as any read through the mount does (prefetch, policies, stats).
No FUSE request is made for a sample served from the cache.

The safety protocol (the daemon may evict a chunk, punch its hole, move its records to
another log or delete a log at any moment, while readers in other processes hold what
they looked up):

* **Look up, then read, then check.** The record is looked up in one read transaction
  (:meth:`IndexReader.locate_path`: the file's entry, its freshness and the record's
  version, or that answer remembered for the same snapshot);
  its bytes are read with ONE ``pread`` into a new ``bytes`` object; they are returned
  only if their xxh3-64 equals the record's checksum. The daemon never rewrites a byte
  range in place with other data (logs are append-only; a range that leaves the index is
  punched, reads as zeros, and is never reused; a moved record gets a new place), so a
  range that still passes the checksum holds exactly the bytes of the version that was
  current at the lookup: never a mix, never another file's.
* **Anything else goes through the mount**: no record, a record of another version, a
  directory due for revalidation, a path the mirrored modes would refuse this process
  (checked as the kernel checks them: :mod:`dlcachefs.store.readonly`), a checksum
  mismatch (a hole punched since the lookup, a short read of a truncated log), a log that
  is gone, an index that cannot be read, LMDB's reader table full. The mount then decides
  as it always does, and refetches what is damaged.
* **``pread``, not ``mmap``.** A page of a mapped file that is truncated under the map
  raises SIGBUS when touched, and CPython cannot turn that into an exception: it kills
  the process. The daemon truncates logs (crash recovery at its next start cuts unindexed
  tails, a failed append is cut back). ``pread`` of such a range is a short read, which
  the checksum rejects. The cost is one copy, kernel to user, per sample; a 110 KB copy
  is a few microseconds next to the ~2 ms of decoding it. No copy is made on our side:
  the ``bytes`` from ``pread`` go to the decoder as they are (``io.BytesIO`` shares a
  ``bytes`` object instead of copying it), ``memoryview`` and ``numpy.frombuffer`` views
  of it are free.
* **Descriptors of deleted logs are closed.** A log the daemon deleted keeps its disk
  space while any descriptor is open on it; every :data:`SWEEP_EVERY` reads, descriptors
  whose file has no link left (``st_nlink == 0``) are closed, once no thread is reading
  through them. The index file is checked at the same time: a cache directory made anew
  (removed and mounted again) is reopened when its index file's identity (device,
  inode) is not the one opened. Both run every :data:`SWEEP_EVERY` reads and at least
  every :data:`CHECK_EVERY_S` seconds, not at every read: a ``stat`` per read cost 15%
  of the reads of 8 threads (each system call hands the GIL to another thread). So for
  up to that long after its cache directory is removed, a reader may still serve what
  the removed cache held (its open descriptors keep the removed logs readable), as a
  read begun just before the removal would; never later.

Processes and threads: each process opens its own LMDB environment and descriptors, at
its first read, one per cache per process, shared by every reader object and thread
(py-lmdb refuses a second environment on the same files in one process). LMDB
environments must not cross a ``fork()``, and a forked child could not open its own
while it holds an inherited one (py-lmdb's guard is inherited too), so no child ever
inherits one: just before ``fork()`` (``os.register_at_fork``) the parent waits for the
lookup in flight (microseconds), closes its environment, and holds new lookups back
until the fork is done; it reopens at its next read. The child (a DataLoader worker)
closes its copies of the log descriptors, lets go of the parent's counter file and
opens its own at its first read. Spawned workers unpickle a reader that holds only
paths. Threads share the per-process state: a lookup is one LMDB read transaction, one
thread at a time (the lookup lock: see :class:`_Process` for why), a read one ``pread``
on a shared descriptor, any number at once; small locks guard the descriptor table (a
descriptor is closed only when no thread reads through it) and the counters; the
index is opened, checked and closed under the lookup lock. Lock order: the lookup lock,
then ``LogFiles._lock``; ``_Process._lock`` (the counter file) and the counters' own
lock are taken with no other held but the lookup lock in ``close()``.

Counting (``zerocopy`` in the daemon's stats): each process counts its hits and its
fallbacks by reason in a small memory-mapped file in the cache directory
(:mod:`dlcachefs.store.tally`), which the daemon sums when its stats are read.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import lmdb

from dlcachefs.data.intercept import real_open
from dlcachefs.store.advice import BOARD, AdviceTaker
from dlcachefs.store.chunkfmt import checksum
from dlcachefs.store.integrity import stamp_of
from dlcachefs.store.readonly import INFO_FORMAT, IndexReader, Located, LogFiles
from dlcachefs.store.tally import FIELDS, TallyWriter

#: the mount's description of its cache for zero-copy readers, below the mount root
INFO = (".dlcache", "zerocopy")
#: reads between checks for deleted logs and a replaced index (per process)
SWEEP_EVERY = 256
#: seconds between those checks, at the most, whatever the reads
CHECK_EVERY_S = 0.05
#: reads between attempts to open an index that could not be opened (per process)
RETRY_EVERY = 1024
#: seconds the daemon may not vouch for its index file before the environment is closed
UNSOUND_CLOSE_S = 1.0

_F = {name: i for i, name in enumerate(FIELDS)}
HITS, HIT_BYTES, MISMATCH, MISSING_LOG, ERRORS = (
    _F["hits"], _F["hit_bytes"], _F["mismatch"], _F["missing_log"], _F["errors"])
UNRESOLVED, TOO_LARGE, UNSOUND = _F["unresolved"], _F["too_large"], _F["unsound"]

#: the root directory's inode number on every FUSE mount (the kernel's FUSE_ROOT_ID)
FUSE_ROOT_INO = 1


#: no warnings: set where the reads are a training's own opens served in the process
#: (:mod:`dlcachefs.data.intercept`), which must see nothing the real ``open`` would not
#: show; the fallbacks are counted all the same
QUIET = False


def _warn(msg: str) -> None:
    if not QUIET:
        warnings.warn(f"dlcachefs.data: {msg}", RuntimeWarning, stacklevel=4)


def find_mount(path: str | os.PathLike) -> str | None:
    """The root of the dlcachefs mount holding ``path`` (``path`` itself or an
    ancestor, taken lexically as :func:`os.path.abspath` gives it), or None.

    Only a mount's root counts (a mount point whose inode is the FUSE root's, 1, holding
    ``.dlcache/zerocopy``): a ``.dlcache`` directory anywhere else (in a source tree, on
    another file system) must never bind a reader to the cache it names, whose namespace
    is not the one the path is in."""
    cur = os.path.abspath(os.fspath(path))
    while True:
        if os.path.exists(os.path.join(cur, *INFO)) and _is_fuse_root(cur):
            return cur
        parent = os.path.dirname(cur)
        if parent == cur:
            return None
        cur = parent


def _is_fuse_root(path: str) -> bool:
    try:
        return os.path.ismount(path) and os.stat(path).st_ino == FUSE_ROOT_INO
    except OSError:
        return False


@dataclass(frozen=True)
class CacheInfo:
    """What a mount tells zero-copy readers (``.dlcache/zerocopy``, JSON)."""

    index_dir: str
    logs_dir: str
    tally_dir: str
    revalidate_s: float
    #: a file that exists while the daemon holds its index sound (None: not said)
    sound: str | None = None
    #: whether opens may be served in the training process (:mod:`dlcachefs.data.intercept`;
    #: not with ``--substitute``, which decides at open what a file's bytes are)
    intercept: bool = True

    @classmethod
    def from_json(cls, doc: Mapping) -> CacheInfo:
        if doc.get("format") != INFO_FORMAT:
            raise ValueError(f"zero-copy description format {doc.get('format')!r}, this "
                             f"reader knows {INFO_FORMAT}")
        sound = doc.get("sound")
        return cls(str(doc["index_dir"]), str(doc["logs_dir"]), str(doc["tally_dir"]),
                   float(doc["revalidate_s"]), None if sound is None else str(sound),
                   bool(doc.get("intercept", True)))


class CacheReader:
    """Reads files of one dlcachefs mount from its cache directory, or through the mount.

    Holds only paths (pickles small, for spawned DataLoader workers); what a process
    opens is kept per process (see the module doc). Thread-safe.
    """

    def __init__(self, mount_root: str | os.PathLike, info: CacheInfo) -> None:
        self.mount_root = os.path.abspath(os.fspath(mount_root))
        self.info = info
        self._prefix = os.fsencode(self.mount_root.rstrip("/") + "/")

    @classmethod
    def for_path(cls, path: str | os.PathLike) -> CacheReader | None:
        """The reader of the mount holding ``path``; None (with a warning when the mount
        is there but unusable) when ``path`` is not on a dlcachefs mount."""
        root = find_mount(path)
        if root is None:
            return None
        try:
            with real_open(os.path.join(root, *INFO), "rb") as f:
                info = CacheInfo.from_json(json.loads(f.read()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            _warn(f"{root} does not describe its cache ({e}); reading through the mount")
            return None
        return cls(root, info)

    # ----- reads ---------------------------------------------------------------------------

    def read(self, path: str | bytes | os.PathLike) -> bytes:
        """The bytes of the file at ``path`` (inside the mount): from the cache when its
        current version is there and intact, else by ``open`` + ``read`` through the
        mount (whose errors, e.g. FileNotFoundError, are raised as they are)."""
        data = self.read_cached(path)
        if data is None:
            # the real open: under `dlcachefs run` the intercepted one would look the
            # file up again (and count its fallback twice)
            with real_open(path, "rb") as f:
                data = f.read()
        return data

    def read_cached(self, path: str | bytes | os.PathLike) -> bytes | None:
        """The bytes from the cache, checked against their checksum; None when they must
        be read through the mount (the reason is counted)."""
        got = self.read_located(path)
        return got[0] if got is not None else None

    def read_located(self, path: str | bytes | os.PathLike, max_size: int | None = None,
                     t0: float | None = None) -> tuple[bytes, Located] | None:
        """:meth:`read_cached` with where the bytes were (their version: the record's size
        and mtime); files above ``max_size`` bytes are not read (``too_large``). ``t0``:
        when the caller's open began (``time.monotonic()``), for the event the daemon
        gets (how long the read took)."""
        if t0 is None:
            t0 = time.monotonic()
        proc = _process(self.info)
        rel = self._rel(path)
        if rel is None:
            proc.count(UNRESOLVED)
            return None
        got = proc.locate(rel, self.info.revalidate_s)
        if got is None:
            proc.count(ERRORS)
            return None
        if not isinstance(got, Located):
            proc.count(_F[got])
            return None
        if max_size is not None and got.size > max_size:
            proc.count(TOO_LARGE)
            return None
        try:
            data = proc.logs.pread(got.log_id, got.size, got.offset)
        except FileNotFoundError:
            proc.count(MISSING_LOG)
            return None
        except OSError:
            proc.count(ERRORS)
            return None
        # the one check that makes the bytes trustworthy (see the module doc)
        if len(data) != got.size or checksum(data) != got.data_xxh:
            proc.count(MISMATCH)
            return None
        proc.hit(got.ino, t0, got.size)
        return data, got

    def count(self, reason: str) -> None:
        """Count a read sent through the mount for ``reason`` (a name of
        :data:`dlcachefs.store.tally.FIELDS`)."""
        _process(self.info).count(_F[reason])

    def counts(self) -> dict[str, int]:
        """What this process counted for this mount's cache (hits, fallbacks by reason)."""
        return _process(self.info).counts()

    def close(self) -> None:
        """Close what this process opened for this mount's cache (its index environment,
        log descriptors; counting ends). Only once no thread of the process reads it any
        more; a later read opens them again."""
        with _procs_lock:
            p = _procs.pop(self.info.index_dir, None)
        if p is not None:
            p.close()

    def _rel(self, path: str | bytes | os.PathLike) -> bytes | None:
        """``path`` from the mount's root; None when it is not below it."""
        p = os.fsencode(path)
        if not p.startswith(b"/"):
            p = os.getcwdb() + b"/" + p  # what open() would resolve it against now
        if not p.startswith(self._prefix):
            return None
        return p[len(self._prefix):]

    def __repr__(self) -> str:
        return f"CacheReader({self.mount_root!r})"


# ----- per-process state -------------------------------------------------------------------

class _NoTally:
    """Counts kept in this process only (the cache directory is not writable for us)."""

    def __init__(self) -> None:
        self._vals = [0] * len(FIELDS)
        self._lock = threading.Lock()

    def add(self, field: int, n: int = 1) -> None:
        with self._lock:
            self._vals[field] += n

    def hit(self, ino: int, t: float, seconds: float, size: int) -> None:
        with self._lock:
            self._vals[HITS] += 1
            self._vals[HIT_BYTES] += size

    def values(self) -> dict[str, int]:
        with self._lock:
            return dict(zip(FIELDS, self._vals, strict=True))

    def abandon(self) -> None:
        pass

    close = abandon


class _Process:
    """What one process holds for one cache: its LMDB environment, log descriptors and
    counter file, made at its first read. The lookup lock guards the environment,
    ``_lock`` the counter file."""

    def __init__(self, info: CacheInfo) -> None:
        self.info = info
        self.logs = LogFiles(info.logs_dir)
        # the read-ahead the daemon planned for these readers: carried out here, at hits
        self.advice = AdviceTaker(os.path.join(info.tally_dir, BOARD))
        self._lock = threading.Lock()  # opening the counter file (a leaf lock)
        # Lookups run one at a time, under this lock, which also guards the index (it is
        # opened, checked and closed under it). Why one at a time: py-lmdb lets go of the
        # GIL around each LMDB read, and with several threads reading, each of those
        # short releases hands the GIL to another thread and waits to get it back; one
        # lookup at a time makes none of those waits (8 threads: lookups 2.7x, whole
        # reads 1.5x faster here). The pread and the checksum, long enough to run beside
        # other threads, stay outside it. The price: a lookup that faults the index in
        # from disk holds the others back (the index is small next to the samples and
        # stays in the page cache while a training reads). A fork or close() takes it
        # too, so no lookup is in flight when the index closes.
        self._lookup = threading.Lock()
        self._index: IndexReader | None = None
        self._failed_at: int | None = None
        #: the cache directory was refused to this user (said once): its counts stay here
        self._denied = False
        self._tally: TallyWriter | _NoTally | None = None
        self._reads = 0  # (under the lookup lock, as the next one and _failed_at)
        self._next_check = 0.0  # monotonic time of the next sweep, at the latest
        #: the daemon does not vouch for its index file now: not read (lookup lock)
        self.unsound = False
        self._unsound_since: float | None = None

    def locate(self, rel: bytes, revalidate: float) -> Located | str | None:
        """One lookup (:meth:`IndexReader.locate_path`); None when the index cannot be
        read."""
        with self._lookup:
            ix = self.index()
            if ix is None:
                return "unsound" if self.unsound else None
            try:
                return ix.locate_path(rel, revalidate, time.time())
            except lmdb.ReadersFullError:
                # LMDB's reader table is full (too many reading processes): this lookup
                # goes through the mount; the environment is fine, keep it
                return None
            except Exception:  # noqa: BLE001 - lmdb.Error and friends: the mount answers
                # (MDB_MAP_RESIZED and the like): opened anew at the next read
                self._drop_index()
                return None

    def _drop_index(self) -> None:
        """Close the index. Under the lookup lock, so no lookup runs in it (py-lmdb
        releases the GIL inside a read: an environment closed under one is a use after
        free; and it refuses to open the same files again while it is open)."""
        ix, self._index = self._index, None
        if ix is not None:
            with contextlib.suppress(Exception):
                ix.close()

    def before_fork(self) -> None:
        """In the parent, just before ``fork()``: wait for the lookup in flight, close the
        index (reopened at the next read), and hold the lookup lock until the fork is
        done, so the child inherits no LMDB environment (see the module doc)."""
        self._lookup.acquire()
        self._drop_index()

    def after_fork_in_parent(self) -> None:
        self._lookup.release()

    def index(self) -> IndexReader | None:
        """The index to look up in, checked to still be the cache directory's (every
        :data:`SWEEP_EVERY` reads and :data:`CHECK_EVERY_S` seconds: a cache removed
        and made anew must not be read from its old files). Under the lookup lock."""
        ix = self._index
        self._reads += 1
        now = time.monotonic()
        if ix is not None and self._reads % SWEEP_EVERY and now < self._next_check:
            return ix
        self._next_check = now + CHECK_EVERY_S
        if ix is not None:
            self.logs.sweep()
            if ix.replaced():
                self._drop_index()
                self.advice.close(again=True)  # its read-ahead board is another file now
                self.logs.sweep(everything=True)  # and so are its logs
        # A damaged index can kill the process that maps it (SIGBUS, an LMDB assert): it
        # is read only while the daemon vouches for the index file as it is now (found
        # sound at start, changed since by its own commits only: integrity.SoundFlag)
        sound = self._sound()
        self.unsound = not sound
        if not sound:
            # checked again at the next read. Between a commit and the daemon's word on
            # it the file is briefly unlike the flag: the environment stays open (a map
            # nobody reads from is harmless) unless that lasts
            self._next_check = now
            if self._unsound_since is None:
                self._unsound_since = now
            elif now - self._unsound_since > UNSOUND_CLOSE_S:
                self._drop_index()
            return None
        self._unsound_since = None
        if self._index is None and (self._failed_at is None
                                    or self._reads - self._failed_at >= RETRY_EVERY):
            try:
                self._index = IndexReader(self.info.index_dir)
                self._failed_at, self._denied = None, False
            except Exception as e:  # noqa: BLE001 - lmdb.Error, OSError: the mount answers
                # (lmdb says EACCES as ReadonlyError)
                denied = isinstance(e, PermissionError | lmdb.ReadonlyError)
                if self._failed_at is None and denied:
                    _warn(f"this user (uid {os.geteuid()}) may not read the cache directory "
                          f"{os.path.dirname(self.info.index_dir)} (only its owner and the "
                          f"mount's --reader-group may); reading through the mount")
                elif self._failed_at is None:
                    _warn(f"cannot open the cache index {self.info.index_dir} ({e}); "
                          f"reading through the mount")
                self._failed_at = self._reads
                self._denied = denied
        return self._index

    def _sound(self) -> bool:
        """Whether the daemon's flag names the index file as it is now."""
        flag = self.info.sound
        if flag is None:
            return True
        try:
            with real_open(flag, "rb") as f:
                said = f.read().strip()
        except PermissionError:
            return True  # nor the index, then: its open says so (and counts it)
        except OSError:
            return False
        now = stamp_of(self.info.index_dir)
        return now is not None and said == now.encode()

    def count(self, field: int, n: int = 1) -> None:
        t = self._tally
        if t is None:
            with self._lock:
                if self._tally is None:
                    try:
                        self._tally = TallyWriter(self.info.tally_dir)
                    except OSError as e:
                        # a user refused the cache directory was told so once already
                        if not (self._denied and isinstance(e, PermissionError)):
                            _warn(f"cannot count in {self.info.tally_dir} ({e}); the "
                                  f"mount's stats will not show this process's zero-copy "
                                  f"reads")
                        self._tally = _NoTally()
                t = self._tally
        t.add(field, n)  # (after close(), under a read past its lookup: dropped)

    def hit(self, ino: int, t0: float, nbytes: int) -> None:
        """Count a sample served from the cache (its count, bytes and event for the
        daemon: :meth:`TallyWriter.hit`)."""
        t = self._tally
        if t is None:
            self.count(HITS, 0)  # makes the counter file
            t = self._tally
            assert t is not None
        t.hit(ino, t0, time.monotonic() - t0, nbytes)
        # then some of the read-ahead the daemon posted since, in a thread (the sample in
        # hand does not wait for it; nor for another reader taking them)
        self.advice.take_soon(self.logs.advise)

    def counts(self) -> dict[str, int]:
        t = self._tally
        return t.values() if t is not None else dict.fromkeys(FIELDS, 0)

    def close(self) -> None:
        # the lookup in flight finishes first: py-lmdb releases the GIL inside a get, and
        # an environment closed under one is a use after free (the same lock as a fork's)
        with self._lookup:
            self.advice.close()  # first: a take in progress opens no log after the sweep
            self.logs.sweep(everything=True)
            self._drop_index()
            with self._lock:
                if self._tally is not None:
                    self._tally.close()
                    self._tally = None

    def abandon(self) -> None:
        """In a forked child (see the module doc)."""
        self.logs.abandon()
        self.advice.abandon()
        if self._tally is not None:
            self._tally.abandon()


_procs: dict[str, _Process] = {}  # index dir -> this process's state
_procs_pid = os.getpid()
_procs_lock = threading.Lock()
#: what a forked child inherited: kept referenced, never used (see the module doc)
_inherited: list[_Process] = []


def _process(info: CacheInfo) -> _Process:
    if os.getpid() != _procs_pid:  # forked without the at-fork hooks (a C-level fork)
        _after_fork_in_child()
    p = _procs.get(info.index_dir)
    if p is None:
        with _procs_lock:
            p = _procs.get(info.index_dir)
            if p is None:
                p = _procs[info.index_dir] = _Process(info)
    return p


def _before_fork() -> None:
    _procs_lock.acquire()  # no new state while forking; released after, in both
    for p in _procs.values():
        p.before_fork()


def _after_fork_in_parent() -> None:
    for p in _procs.values():
        p.after_fork_in_parent()
    _procs_lock.release()


def _after_fork_in_child() -> None:
    global _procs_pid, _procs_lock
    _procs_lock = threading.Lock()  # the parent's was held through the fork
    _procs_pid = os.getpid()
    for p in _procs.values():
        p.abandon()
        _inherited.append(p)
    _procs.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)
