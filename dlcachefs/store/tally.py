"""Counters of zero-copy readers, one small file per reading process, in the cache directory.

A training process that reads samples straight from the cache (:mod:`dlcachefs.data`)
never passes through FUSE for them, so the daemon cannot count them. Each such process
counts into a file of its own, ``<cache-dir>/zerocopy/<pid>-<token>.tally``, memory
mapped: counting is a store into shared memory, no system call and no FUSE request on the
per-sample path. The daemon sums the files when ``.dlcache/stats`` is read (``zerocopy``
in stats, :class:`TallyReader`).

Layout (version 1, little-endian): the magic ``DLCZC001``, then one u64 per name of
:data:`FIELDS`, in that order. Only the owning process writes its file; the daemon reads
it with ``pread`` (the page cache is shared with the mapping). A count may be read while
it is being stored: aligned 8-byte stores are not torn on the platforms we run on, and a
count read one sample late is harmless in stats.

Liveness, without pids (they are reused): the owner holds ``flock(LOCK_SH)`` on its file
for its lifetime, and the kernel drops the lock when the process ends, however it ends.
The daemon tries ``LOCK_EX | LOCK_NB``; when it gets it, the owner is gone: its last
counts are folded into the daemon's totals and the file is removed. A file appears under
its final name only once it is locked (it is made under a temporary name, then renamed),
so the daemon never takes a reader that is starting for one that ended. A forked child
shares its parent's lock (one open file description) until it closes its copy, which
:mod:`dlcachefs.data` does at once: the child then counts in a file of its own.

Counts since mount: the daemon notes every file's counts when it starts
(:class:`TallyReader` is made with the engine) and reports only what was counted after.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import stat
import struct
import threading
import time

log = logging.getLogger(__name__)

#: the directory inside the cache directory
TALLY_DIR = "zerocopy"
MAGIC = b"DLCZC002"  # 002: the "denied" count
#: what a zero-copy reader counts. ``hits``/``hit_bytes``: samples served from the cache
#: directly; the others are reads that went through the mount instead, by reason:
#: ``not_cached`` (no record), ``stale`` (the record is not the entry's version, or the
#: entry is due for revalidation), ``unresolved`` (the path is not a regular file of the
#: snapshot reachable inside the mount: an absolute or escaping symlink, a name not
#: listed yet), ``mismatch`` (the bytes read fail the record's checksum: evicted, moved
#: or damaged under the reader), ``missing_log`` (the log file is gone), ``errors``
#: (the index or a log could not be read), ``denied`` (the file's or a directory's mode
#: denies this process: the mount answers, EACCES)
FIELDS = ("hits", "hit_bytes", "not_cached", "stale", "unresolved", "mismatch",
          "missing_log", "errors", "denied")
FALLBACKS = FIELDS[2:]
_U64 = struct.Struct("<Q")
SIZE = len(MAGIC) + _U64.size * len(FIELDS)
SUFFIX = ".tally"


#: a reader's temp file younger than this is left alone at daemon start even when it is not
#: locked yet (made by ``open``, locked by the next call): removing it would leave that
#: reader counting for itself only
TMP_GRACE_S = 60.0


def counter_mode(directory: str) -> int:
    """The mode of a counter file made in ``directory``: 0640 in a reader group's
    ``zerocopy/`` (group-writable and setgid: the file is the group's, and the daemon,
    a member or root, reads it), else 0600 (the owner's own readers)."""
    try:
        return 0o640 if os.stat(directory).st_mode & 0o020 else 0o600
    except OSError:
        return 0o600


class TallyWriter:
    """The counter file of this process (made at the first count). Thread-safe."""

    def __init__(self, directory: str) -> None:
        os.makedirs(directory, mode=0o700, exist_ok=True)  # (the daemon makes it first)
        mode = counter_mode(directory)
        token = os.urandom(6).hex()
        name = f"{os.getpid()}-{token}{SUFFIX}"
        tmp = os.path.join(directory, f".{name}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            os.fchmod(fd, mode)  # whatever this process's umask: the daemon reads it
            # locked at once: a daemon starting now removes unlocked temp files (it also
            # leaves young ones alone, for the instant between open and flock)
            fcntl.flock(fd, fcntl.LOCK_SH)  # before it is visible: see the module doc
            os.pwrite(fd, MAGIC + bytes(SIZE - len(MAGIC)), 0)
            self.path = os.path.join(directory, name)
            os.rename(tmp, self.path)
            self._map = mmap.mmap(fd, SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        self._fd = fd
        self._vals = [0] * len(FIELDS)
        self._lock = threading.Lock()  # += on a list item is not atomic across threads
        self._closed = False  # (under _lock) a count after close() is dropped

    def add(self, field: int, n: int = 1) -> None:
        """Add ``n`` to ``FIELDS[field]``."""
        with self._lock:
            if self._closed:  # a read in another thread that was past its lookup
                return
            v = self._vals[field] = self._vals[field] + n
            _U64.pack_into(self._map, len(MAGIC) + _U64.size * field, v)

    def add2(self, f1: int, n1: int, f2: int, n2: int) -> None:
        """Add ``n1`` to ``FIELDS[f1]`` and ``n2`` to ``FIELDS[f2]`` (one lock for both:
        a hit counts a sample and its bytes)."""
        with self._lock:
            if self._closed:
                return
            v1 = self._vals[f1] = self._vals[f1] + n1
            v2 = self._vals[f2] = self._vals[f2] + n2
            _U64.pack_into(self._map, len(MAGIC) + _U64.size * f1, v1)
            _U64.pack_into(self._map, len(MAGIC) + _U64.size * f2, v2)

    def values(self) -> dict[str, int]:
        with self._lock:
            return dict(zip(FIELDS, self._vals, strict=True))

    def close(self) -> None:
        """Stop counting (the file stays until the daemon sees its lock gone); counts
        after this are dropped."""
        with self._lock:
            self._closed = True
            self._map.close()
        self.abandon()

    def abandon(self) -> None:
        """In a forked child: let go of the parent's file (its descriptor, shared with the
        parent, holds the parent's lock; the mapping stays, unused, until exit)."""
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = -1


def _open_regular(path: str) -> int:
    """A descriptor of ``path`` if it is a regular file (OSError otherwise): never a
    link followed, never a wait on a FIFO a reader-group member put in the directory
    (the daemon reads these files on its trio loop)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path}: not a regular file")
    return fd


def read_counts(path: str) -> list[int] | None:
    """The counts in a tally file; None when it is not one (or is gone)."""
    try:
        fd = _open_regular(path)
        try:
            buf = os.pread(fd, SIZE, 0)
        finally:
            os.close(fd)
    except OSError:
        return None
    if len(buf) != SIZE or buf[: len(MAGIC)] != MAGIC:
        return None
    return [_U64.unpack_from(buf, len(MAGIC) + _U64.size * i)[0] for i in range(len(FIELDS))]


def owner_alive(path: str) -> bool:
    """True while the process that writes ``path`` lives (it holds a shared lock)."""
    try:
        fd = _open_regular(path)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # drops our lock too, if we got it
    return False


class TallyReader:
    """The daemon's side: sums of the zero-copy readers' counts since it started.

    Blocking (a directory listing and one small read per live reader); called when stats
    are read, a few files at most, so it runs where stats are made."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self._base: dict[str, list[int]] = {}  # file -> its counts when we started
        self._folded = [0] * len(FIELDS)  # counts of readers that ended since
        with contextlib.suppress(OSError):  # made by a reader that died before its rename
            for name in os.listdir(self.dir):
                tmp = os.path.join(self.dir, name)
                if (name.startswith(".") and name.endswith(".tmp") and not owner_alive(tmp)
                        and time.time() - os.stat(tmp).st_mtime > TMP_GRACE_S):
                    os.unlink(tmp)
        for name in self._names():
            path = os.path.join(self.dir, name)
            counts = read_counts(path)
            if owner_alive(path):
                if counts is not None:
                    self._base[name] = counts
            else:  # ended before this mount: nothing of it counts now
                with contextlib.suppress(OSError):
                    os.unlink(path)

    def _names(self) -> list[str]:
        try:
            return [n for n in os.listdir(self.dir) if n.endswith(SUFFIX) and n[0] != "."]
        except OSError:
            return []

    def any_readers(self) -> bool:
        """Whether a zero-copy reader is counting in this cache now (its process alive):
        one directory listing, and a check per counter file."""
        return any(owner_alive(os.path.join(self.dir, n)) for n in self._names())

    def collect(self) -> dict[str, int]:
        """Counts since start of every reader, live or ended, with ``fallbacks`` (their
        sum over the fallback reasons) and ``readers`` (processes counting now)."""
        sums = list(self._folded)
        live = 0
        for name in self._names():
            path = os.path.join(self.dir, name)
            alive = owner_alive(path)  # before the read: a final count is not missed
            counts = read_counts(path)
            if counts is None:
                continue
            base = self._base.get(name)
            delta = counts if base is None else [c - b for c, b in zip(counts, base, strict=True)]
            if alive:
                live += 1
                sums = [s + d for s, d in zip(sums, delta, strict=True)]
                continue
            self._folded = [s + d for s, d in zip(self._folded, delta, strict=True)]
            sums = [s + d for s, d in zip(sums, delta, strict=True)]
            try:
                os.unlink(path)
                self._base.pop(name, None)
            except OSError as e:  # left behind: counted once, its counts are the base now
                self._base[name] = counts
                log.debug("could not remove the tally of an ended reader %s: %s", path, e)
        out = dict(zip(FIELDS, sums, strict=True))
        out["fallbacks"] = sum(out[k] for k in FALLBACKS)
        out["readers"] = live
        return out
