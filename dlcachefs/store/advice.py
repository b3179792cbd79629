"""Read-ahead the daemon plans and the training's processes carry out.

When a stream's samples are read in the training's processes (:mod:`dlcachefs.data`),
the daemon still knows the epoch's order and walks it ahead of the readers
(:mod:`dlcachefs.cache.readplan`). Asking the kernel to read those ranges of the logs
into the page cache (``POSIX_FADV_WILLNEED``) costs kernel time in the process that asks:
page allocations and I/O submission, about as much per sample as the rest of the daemon's
work. Done by the daemon, it sits on the daemon's one core however many cores the node
has. So the daemon only writes down what to read (a few bytes per range, on its loop),
and the readers, many processes, ask the kernel for it.

The board is one file, ``<cache-dir>/zerocopy/advice``, that the daemon makes and
writes with ``pwrite``; readers read it with ``pread`` (nobody maps it: a file truncated
under a map kills the process that touches it). Layout (little-endian): the magic
``DLCAD001``; ``posted`` (u64, ranges written so far); ``taken`` (u64, ranges carried
out or skipped so far); ``taken_bytes`` (u64); then :data:`RING` slots of (seq, log id,
offset, length), u64 each. The daemon writes a range's slot, then ``posted``: one thread,
two system calls in that order, so a reader that sees ``posted`` sees the slot. A slot
names its sequence number: a reader that finds another one there (the daemon wrapped
around the ring since) skips it.

Readers, at each sample they serve (:meth:`AdviceTaker.take`): one ``pread`` of the
header; when ``posted`` is past ``taken``, they try the board's lock without waiting
(``flock(LOCK_EX | LOCK_NB)``; a thread lock first, since threads of one process share
its descriptor), read ``taken`` again under it, ask the kernel for each range not taken,
and store the new ``taken``. Whoever holds the lock does the whole backlog; the others
go on at once. So each range is asked for once, by one process, and no reader ever waits
for another. A process's descriptor of the board is its own (a forked child opens its
own: a descriptor shared across a fork shares its lock too).

Nothing here is trusted for correctness: a range is only a hint to the kernel's page
cache (a wrong one reads pages nobody uses), so the board needs no checksum; a reader
of another job, or of another mount of the same cache, may carry out any range.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import struct
import threading
from collections.abc import Callable, Iterable

#: the board's file name, in the readers' directory (:data:`dlcachefs.store.tally.TALLY_DIR`)
BOARD = "advice"
MAGIC = b"DLCAD001"
_HEADER = struct.Struct("<8sQQQ")  # magic, posted, taken, taken bytes
_U64 = struct.Struct("<Q")
_POSTED = 8
_TAKEN = 16
#: one range: its sequence number, log id, offset, length
SLOT = struct.Struct("<QQQQ")
#: ranges the board holds: a reader more than this far behind skips the oldest
RING = 4096
SIZE = _HEADER.size + RING * SLOT.size


def board_mode(directory: str) -> int:
    """0660 in a reader group's directory (group-writable: its readers store ``taken``),
    else 0600 (the owner's own readers)."""
    try:
        return 0o660 if os.stat(directory).st_mode & 0o020 else 0o600
    except OSError:
        return 0o600


class AdviceBoard:
    """The daemon's side: ranges of logs to read ahead, posted for the readers.

    Call from one thread (the trio loop): each post is a few small ``pwrite`` calls to a
    file in the page cache."""

    def __init__(self, directory: str) -> None:
        """Open ``directory``/advice, made anew when it is missing or not a board (a
        board left by the last mount is carried on: readers may hold its descriptor)."""
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.path = os.path.join(directory, BOARD)
        mode = board_mode(directory)
        fd = _own_file(self.path, mode)
        try:
            st = os.fstat(fd)
            os.fchmod(fd, mode)
            head = os.pread(fd, _HEADER.size, 0)
            if st.st_size != SIZE or len(head) != _HEADER.size or head[:8] != MAGIC:
                os.ftruncate(fd, 0)
                os.ftruncate(fd, SIZE)
                os.pwrite(fd, _HEADER.pack(MAGIC, 0, 0, 0), 0)
                self.posted = 0
            else:
                _, posted, _, _ = _HEADER.unpack(head)
                # what the last mount posted and no reader took is moot now
                self.posted = posted
                os.pwrite(fd, _U64.pack(posted), _TAKEN)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._base = self.posted
        self.posted_bytes = 0

    def post(self, ranges: Iterable[tuple[int, int, int]]) -> int:
        """Post ``(log id, offset, length)`` ranges; returns their bytes. Ranges of one
        log that touch or lie within :data:`MERGE_GAP` of each other are merged (one
        system call in the reader, not one per record)."""
        merged = merge_ranges(ranges)
        if not merged:
            return 0
        seq = self.posted
        # (more than the ring holds: only the last RING are kept; readers skip the rest)
        merged = merged[-RING:]
        buf = bytearray(SLOT.size * len(merged))
        for i, (log_id, off, n) in enumerate(merged):
            SLOT.pack_into(buf, i * SLOT.size, seq + i, log_id, off, n)
        first = seq % RING
        split = min(len(merged), RING - first) * SLOT.size
        os.pwrite(self._fd, bytes(buf[:split]), _HEADER.size + first * SLOT.size)
        if split < len(buf):
            os.pwrite(self._fd, bytes(buf[split:]), _HEADER.size)
        self.posted = seq + len(merged)
        os.pwrite(self._fd, _U64.pack(self.posted), _POSTED)  # after the slots
        n = sum(r[2] for r in merged)
        self.posted_bytes += n
        return n

    def stats(self) -> dict:
        """Ranges and bytes posted since this mount began, ranges and bytes the readers
        took (``taken_bytes``: since the board was made)."""
        head = os.pread(self._fd, _HEADER.size, 0)
        taken = taken_bytes = 0
        if len(head) == _HEADER.size and head[:8] == MAGIC:
            _, _, taken, taken_bytes = _HEADER.unpack(head)
        return {"posted": self.posted - self._base, "posted_bytes": self.posted_bytes,
                "taken": max(0, min(taken, self.posted) - self._base),
                "taken_bytes": taken_bytes, "waiting": max(0, self.posted - taken)}

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = -1


def _own_file(path: str, mode: int) -> int:
    """A descriptor of ``path``, a regular file of ours with one link, made when missing.
    Anything else there (a reader group member may make entries in the directory: a
    link, a FIFO, a file of their own) is removed first: the directory is ours."""
    for _ in range(3):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
                         | os.O_CLOEXEC, mode)
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.EACCES, errno.EPERM, errno.ENXIO):
                raise
        else:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_nlink == 1:
                return fd
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    raise OSError(f"{path}: not a file of ours, and it comes back")


#: ranges of one log this close are asked for as one (the gap is a chunk's header, or a
#: record of another epoch: a page or two read that no one asked for)
MERGE_GAP = 8 << 10


def merge_ranges(ranges: Iterable[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """``(log id, offset, length)`` ranges sorted by log and offset, those of one log
    less than :data:`MERGE_GAP` apart made one (pure; empty ranges dropped)."""
    out: list[list[int]] = []
    for log_id, off, n in sorted(r for r in ranges if r[2] > 0):
        if out and out[-1][0] == log_id and off <= out[-1][1] + out[-1][2] + MERGE_GAP:
            last = out[-1]
            last[2] = max(last[1] + last[2], off + n) - last[1]
        else:
            out.append([log_id, off, n])
    return [(a, b, c) for a, b, c in out]


class AdviceTaker:
    """A reading process's side (see the module doc). Thread-safe; one per process and
    board: a forked child makes its own (:meth:`abandon` the parent's)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = -1
        self._failed = False  # no board (an older daemon, or not ours to write): no advice
        self._lock = threading.Lock()

    def _open(self) -> int:
        """The board's descriptor, -1 (for good, until :meth:`close` ``again``) when
        there is none this process may write: never a link followed, never a FIFO."""
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            self._failed = True
            return -1
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
        except OSError:
            regular = False
        if not regular:
            os.close(fd)
            self._failed = True
            return -1
        self._fd = fd
        return fd

    def take(self, advise: Callable[[int, int, int], None]) -> int:
        """Carry out the ranges posted and not taken yet, if no one else is doing so:
        ``advise(log id, offset, length)`` for each (its OSError skips the range).
        Returns how many this call took. Never raises OSError; never waits for a lock."""
        fd = self._fd
        if fd < 0:
            if self._failed or not self._lock.acquire(blocking=False):
                return 0
            try:  # (under the lock: two threads never both open it)
                fd = self._fd if self._fd >= 0 else self._open()
            finally:
                self._lock.release()
            if fd < 0:
                return 0
        try:
            head = os.pread(fd, _HEADER.size, 0)
            if len(head) != _HEADER.size:
                return 0
            magic, posted, taken, _ = _HEADER.unpack(head)
            if magic != MAGIC or posted <= taken:
                return 0
            if not self._lock.acquire(blocking=False):
                return 0
            try:
                if self._fd != fd:
                    return 0  # closed meanwhile (its number may be another file's now)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return 0
                try:
                    return self._take_locked(fd, advise)
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                self._lock.release()
        except OSError:
            return 0

    def _take_locked(self, fd: int, advise: Callable[[int, int, int], None]) -> int:
        head = os.pread(fd, _HEADER.size, 0)
        if len(head) != _HEADER.size:
            return 0
        magic, posted, taken, taken_bytes = _HEADER.unpack(head)
        if magic != MAGIC or posted <= taken:
            return 0
        start = max(taken, posted - RING)
        done = 0
        for seq, slot in _slots(fd, start, posted):
            s, log_id, off, n = SLOT.unpack(slot)
            if s != seq:
                continue  # overwritten since (the daemon wrapped around): skipped
            try:
                advise(log_id, off, n)
            except OSError:
                continue
            taken_bytes += n
            done += 1
        os.pwrite(fd, struct.pack("<QQ", posted, taken_bytes), _TAKEN)
        return done

    def abandon(self) -> None:
        """In a forked child: its copy of the parent's descriptor is closed (the lock
        stays the parent's: it goes with the last copy); the child opens its own at its
        next take."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._failed = False
        self._lock = threading.Lock()

    def close(self, again: bool = False) -> None:
        """Close the board (waits for a take in progress: its descriptor is never closed
        under it). ``again``: the cache directory was made anew, its board is another
        file: the next take opens it."""
        with self._lock:
            fd, self._fd = self._fd, -1
            if again:
                self._failed = False
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


def _slots(fd: int, start: int, end: int) -> list[tuple[int, bytes]]:
    """The slots of sequence numbers ``[start, end)`` (at most :data:`RING`), read in one
    or two ``pread`` calls (the ring wraps once at most)."""
    out: list[tuple[int, bytes]] = []
    seq = start
    while seq < end:
        first = seq % RING
        n = min(end - seq, RING - first)
        data = os.pread(fd, n * SLOT.size, _HEADER.size + first * SLOT.size)
        got = len(data) // SLOT.size
        out.extend((seq + i, data[i * SLOT.size:(i + 1) * SLOT.size]) for i in range(got))
        if got < n:
            break
        seq += n
    return out
