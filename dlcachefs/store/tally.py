"""Counters of zero-copy readers, one small file per reading process, in the cache directory.

A training process that reads samples straight from the cache (:mod:`dlcachefs.data`)
never passes through FUSE for them, so the daemon cannot count them. Each such process
counts into a file of its own, ``<cache-dir>/zerocopy/<pid>-<token>.tally``, memory
mapped: counting is a store into shared memory, no system call and no FUSE request on the
per-sample path. The daemon sums the files when ``.dlcache/stats`` is read (``zerocopy``
in stats, :class:`TallyReader`).

Layout (version 3, little-endian): the magic ``DLCZC003``; one u64 per name of
:data:`FIELDS`, in that order; the reader's job (64 bytes, UTF-8, zero-padded) and rank
(i64, -1 when unknown), from ``$DLCACHEFS_JOB`` and ``$RANK`` at creation; the ring's
head (u64: events written so far); then :data:`RING` events of (inode u64, time f64 of
``time.monotonic()``, size u64). Only the owning process writes its file; the daemon
reads it with ``pread`` (the page cache is shared with the mapping; never a map of its
own: a file truncated under a map would kill the daemon with SIGBUS). A count may be
read while it is being stored: aligned 8-byte stores are not torn on the platforms we
run on, and a count read one sample late is harmless in stats.

The event ring tells the daemon which files were read in the process and when (one
event per sample served from the cache), so that stream positions, prefetch pacing, LRU
recency and the next epoch's logs follow in-process reads as they follow opens through
the mount (:class:`TallyEvents`, drained every few tens of milliseconds). The writer
stores the event's slot, then the head; x86-64 and arm64 (with the store order Python's
``mmap`` slice assignment gives on one thread, under the writer's lock) make the head
visible after the slot. The daemon reads the head, the slots after the last it took,
then the head again: a slot the writer may have overwritten meanwhile (more than
:data:`RING` events behind the second head) is dropped and counted as ``lost``. At a
sample per millisecond per process, the ring holds 4 s of events; the daemon drains it
every 50 ms.

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
MAGIC = b"DLCZC003"  # 002: the "denied" count; 003: more reasons, job and rank, events
#: what a zero-copy reader counts. ``hits``/``hit_bytes``: samples served from the cache
#: directly; the others are reads that went through the mount instead, by reason:
#: ``not_cached`` (no record), ``stale`` (the record is not the entry's version, or the
#: entry is due for revalidation), ``unresolved`` (the path is not a regular file of the
#: snapshot reachable inside the mount: an absolute or escaping symlink, a name not
#: listed yet), ``mismatch`` (the bytes read fail the record's checksum: evicted, moved
#: or damaged under the reader), ``missing_log`` (the log file is gone), ``errors``
#: (the index or a log could not be read), ``denied`` (the file's or a directory's mode
#: denies this process: the mount answers, EACCES); and for opens intercepted under
#: ``dlcachefs run`` (:mod:`dlcachefs.data.intercept`): ``too_large`` (above the size read
#: in the process), ``mode`` (not a binary read-only open), ``unsound`` (the daemon has not
#: found the index sound: it is not mapped), ``switched`` (a descriptor was asked for:
#: ``fileno()``, ``mmap``; the rest of that file is read through the mount)
FIELDS = ("hits", "hit_bytes", "not_cached", "stale", "unresolved", "mismatch",
          "missing_log", "errors", "denied", "too_large", "mode", "unsound", "switched")
FALLBACKS = FIELDS[2:]
_U64 = struct.Struct("<Q")
_COUNTS = len(MAGIC)
JOB_BYTES = 64
_JOB = _COUNTS + _U64.size * len(FIELDS)
_RANK = struct.Struct("<q")
_HEAD = _JOB + JOB_BYTES + _RANK.size
#: one event: the file's inode, when its open began (``time.monotonic()``), the seconds
#: until its bytes were there, its size (a file read in the process is at most 4 GiB)
EVENT = struct.Struct("<QdfI")
#: events the ring holds
RING = 4096
_RING = _HEAD + _U64.size
SIZE = _RING + EVENT.size * RING
#: what the daemon reads of a file at each drain besides the ring: counts, job, rank, head
HEAD_SIZE = _RING
SUFFIX = ".tally"
#: the file in the cache directory (not in ``zerocopy/``, which a reader group may write)
#: by which the daemon vouches for its index (:func:`dlcachefs.store.integrity.hold_sound`)
SOUND_FILE = "index-sound"


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


def identity() -> tuple[str, int]:
    """This process's job and rank as a training launcher gives them (``$DLCACHEFS_JOB``,
    "default" when unset, as the torch hook announces it; ``$RANK``, -1 when unset): how
    the daemon attributes a reader's events when its process is not one it knows (it
    ended before its last events were taken: :class:`TallyEvents`)."""
    job = os.environ.get("DLCACHEFS_JOB") or "default"
    try:
        rank = int(os.environ.get("RANK", "-1"))
    except ValueError:
        rank = -1
    return job, rank


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
            head = bytearray(SIZE)
            head[:len(MAGIC)] = MAGIC
            job, rank = identity()
            head[_JOB:_JOB + JOB_BYTES] = job.encode()[:JOB_BYTES].ljust(JOB_BYTES, b"\0")
            _RANK.pack_into(head, _JOB + JOB_BYTES, rank)
            os.pwrite(fd, head, 0)
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
        self._head = 0  # events written (under _lock)
        self._lock = threading.Lock()  # += on a list item is not atomic across threads
        self._closed = False  # (under _lock) a count after close() is dropped

    def add(self, field: int, n: int = 1) -> None:
        """Add ``n`` to ``FIELDS[field]``."""
        with self._lock:
            if self._closed:  # a read in another thread that was past its lookup
                return
            v = self._vals[field] = self._vals[field] + n
            _U64.pack_into(self._map, _COUNTS + _U64.size * field, v)

    def add2(self, f1: int, n1: int, f2: int, n2: int) -> None:
        """Add ``n1`` to ``FIELDS[f1]`` and ``n2`` to ``FIELDS[f2]`` (one lock for both:
        a hit counts a sample and its bytes)."""
        with self._lock:
            if self._closed:
                return
            v1 = self._vals[f1] = self._vals[f1] + n1
            v2 = self._vals[f2] = self._vals[f2] + n2
            _U64.pack_into(self._map, _COUNTS + _U64.size * f1, v1)
            _U64.pack_into(self._map, _COUNTS + _U64.size * f2, v2)

    def hit(self, ino: int, t: float, seconds: float, size: int) -> None:
        """A sample served from the cache: ``hits`` + 1, ``hit_bytes`` + ``size``, and its
        event (opened at ``t``, its bytes there ``seconds`` later) in the ring: the slot
        first, then the head (see the module doc)."""
        with self._lock:
            if self._closed:
                return
            m = self._map
            v1 = self._vals[0] = self._vals[0] + 1
            v2 = self._vals[1] = self._vals[1] + size
            _U64.pack_into(m, _COUNTS, v1)
            _U64.pack_into(m, _COUNTS + _U64.size, v2)
            h = self._head
            EVENT.pack_into(m, _RING + EVENT.size * (h % RING), ino, t, seconds, size)
            self._head = h + 1
            _U64.pack_into(m, _HEAD, h + 1)

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
            buf = os.pread(fd, HEAD_SIZE, 0)
        finally:
            os.close(fd)
    except OSError:
        return None
    if len(buf) != HEAD_SIZE or buf[: len(MAGIC)] != MAGIC:
        return None
    return _counts(buf)


def _counts(buf: bytes) -> list[int]:
    return [_U64.unpack_from(buf, _COUNTS + _U64.size * i)[0] for i in range(len(FIELDS))]


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


# ----- the daemon's side of the events -----------------------------------------------------

#: seconds between listings of the directory for readers that started or ended
SCAN_EVERY_S = 0.2
#: reading processes whose events the daemon follows at once (each holds a descriptor)
MAX_RINGS = 1024


class Ring:
    """One reading process's file as the daemon drains it (:class:`TallyEvents`)."""

    __slots__ = ("name", "pid", "fd", "job", "rank", "tail", "counts", "alive")

    def __init__(self, name: str, fd: int, head: bytes, fresh: bool) -> None:
        self.name = name
        self.pid = int(name.split("-", 1)[0]) if name.split("-", 1)[0].isdigit() else 0
        self.fd = fd
        self.job = head[_JOB:_JOB + JOB_BYTES].rstrip(b"\0").decode("utf-8", "replace")
        self.rank = _RANK.unpack_from(head, _JOB + JOB_BYTES)[0]
        # a reader already counting when the daemon started: what it did before is not
        # this mount's (as TallyReader's base)
        self.tail = 0 if fresh else _U64.unpack_from(head, _HEAD)[0]
        self.counts = [0] * len(FIELDS) if fresh else _counts(head)
        self.alive = True


class TallyEvents:
    """The daemon's side of the readers' event rings: :meth:`drain` returns, per reading
    process, the events written since the last drain and how its counts moved.

    Blocking (a ``pread`` of a few hundred bytes per live reader, a directory listing
    every :data:`SCAN_EVERY_S`): cheap enough for the trio loop at a drain every 50 ms.
    The descriptors are opened as :func:`read_counts` opens them (regular files only,
    never a link followed, never a wait on a FIFO)."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self._rings: dict[str, Ring] = {}
        #: files of readers that ended, drained for the last time, still listed
        self._ended: set[str] = set()
        self._next_scan = 0.0
        self._started = False
        #: events the daemon could not read before the writer overwrote them
        self.lost = 0
        self._scan()  # the readers there now were there before this mount

    def drain(self, now: float, scan: bool = False
              ) -> list[tuple[Ring, list[tuple[int, float, float, int]], list[int]]]:
        """(reader, its new events as (inode, opened, seconds, size), its counts' deltas)
        for every reader with something new. Readers that ended are drained one last
        time and forgotten. ``scan``: list the directory now (before
        :meth:`TallyReader.collect` removes the files of readers that ended)."""
        ended: list[Ring] = []
        if scan or now >= self._next_scan:
            self._next_scan = now + SCAN_EVERY_S
            ended = self._scan()
        out = []
        try:
            for ring in [*self._rings.values(), *ended]:
                try:
                    got = self._drain_one(ring)
                except (struct.error, ValueError, OSError) as e:
                    # a file its writer (any reader-group member) made wrong: it alone is
                    # dropped, never the others' events
                    log.info("tally %s: unreadable events (%s); ignored", ring.name, e)
                    self._forget(ring)
                    continue
                if got is not None:
                    out.append((ring, *got))
        finally:
            for ring in ended:
                _close_fd(ring.fd)
        return out

    def _forget(self, ring: Ring) -> None:
        if self._rings.get(ring.name) is ring:
            del self._rings[ring.name]
            self._ended.add(ring.name)
            _close_fd(ring.fd)

    def readers(self) -> int:
        """Reading processes known now (as of the last directory listing)."""
        return len(self._rings)

    def close(self) -> None:
        for ring in self._rings.values():
            _close_fd(ring.fd)
        self._rings.clear()

    def _scan(self) -> list[Ring]:
        """Open the files of readers that started, take out those of readers that ended
        (returned: drained once more by the caller, then closed)."""
        try:
            names = {n for n in os.listdir(self.dir) if n.endswith(SUFFIX) and n[0] != "."}
        except OSError:
            names = set()
        fresh = self._started  # files there at the first scan were there before us
        self._started = True
        ended = []
        for name, ring in list(self._rings.items()):
            if name not in names or not _alive_fd(ring.fd):
                ended.append(self._rings.pop(name))
                self._ended.add(name)
        self._ended &= names  # (removed by TallyReader.collect: forgotten)
        for name in names - self._rings.keys() - self._ended:
            if len(self._rings) >= MAX_RINGS:  # (a member making files by the thousand)
                break
            try:
                fd = _open_regular(os.path.join(self.dir, name))
            except OSError:
                continue
            head = _pread(fd, HEAD_SIZE, 0)
            if head is None or len(head) != HEAD_SIZE or head[:len(MAGIC)] != MAGIC:
                _close_fd(fd)
                continue
            self._rings[name] = Ring(name, fd, head, fresh)
        return ended

    def _drain_one(self, ring: Ring) -> tuple[list[tuple[int, float, float, int]],
                                               list[int]] | None:
        head_buf = _pread(ring.fd, HEAD_SIZE, 0)
        if head_buf is None or len(head_buf) != HEAD_SIZE:
            return None
        counts = _counts(head_buf)
        delta = [c - b for c, b in zip(counts, ring.counts, strict=True)]
        ring.counts = counts
        head = _U64.unpack_from(head_buf, _HEAD)[0]
        events: list[tuple[int, float, float, int]] = []
        if head < ring.tail or head - ring.tail > 1 << 40:
            raise ValueError(f"head {head} behind tail {ring.tail} or implausible")
        if head > ring.tail:
            start = max(ring.tail, head - RING)
            self.lost += start - ring.tail
            raw = self._slots(ring.fd, start, head)
            # the writer may have gone round the ring while we read: a slot more than RING
            # behind the head now may hold a newer event (see the module doc)
            again = _pread(ring.fd, _U64.size, _HEAD)
            head2 = _U64.unpack(again)[0] if again is not None and len(again) == 8 else head
            keep_from = max(start, head2 - RING)
            self.lost += keep_from - start
            if raw is not None and len(raw) != EVENT.size * (head - start):
                raise ValueError("a short ring")
            if raw is not None:
                skip = keep_from - start
                events = [EVENT.unpack_from(raw, EVENT.size * i)
                          for i in range(skip, head - start)]
            ring.tail = head
        if not events and not any(delta):
            return None
        return events, delta

    @staticmethod
    def _slots(fd: int, start: int, end: int) -> bytes | None:
        """The slots of events ``start`` to ``end`` (at most RING), in order: one or two
        ``pread`` calls (the ring wraps)."""
        a, b = start % RING, end % RING
        if a < b or end - start == 0:
            return _pread(fd, EVENT.size * (b - a), _RING + EVENT.size * a)
        first = _pread(fd, EVENT.size * (RING - a), _RING + EVENT.size * a)
        second = _pread(fd, EVENT.size * b, _RING) if b else b""
        if first is None or second is None:
            return None
        return first + second


def _pread(fd: int, n: int, off: int) -> bytes | None:
    try:
        return os.pread(fd, n, off)
    except OSError:
        return None


def _close_fd(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)


def _alive_fd(fd: int) -> bool:
    """Whether the owner of the open file ``fd`` still holds its shared lock."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    return False
