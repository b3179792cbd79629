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

Readers, at each sample they serve from the cache: one ``pread`` of the header; when
``posted`` is past ``taken``, a thread of theirs (:meth:`AdviceTaker.take_soon`; one at a
time per process: the sample is handed back meanwhile) tries the board's lock without
waiting (``flock(LOCK_EX | LOCK_NB)``; a thread lock
first, since threads of one process share its descriptor), read ``taken`` again under
it, ask the kernel for at most :data:`TAKE_RANGES` ranges not taken (so one sample never
carries a long backlog: the next samples take the rest), and store the new ``taken``.
The others go on at once. So each range is asked for once, by one process, and no reader
ever waits for another. A process's descriptor of the board is its own (a forked child
opens its own: a descriptor shared across a fork shares its lock too).

Nothing here is trusted for correctness: a range is only a hint to the kernel's page
cache (a wrong one reads pages nobody uses), so the board needs no checksum; a reader
of another job, or of another mount of the same cache, may carry out any range. With a
reader group the board is the group's to write (0660), so a member can plant hints that
other members' processes carry out: ranges of the cache's logs only (the reader opens
logs by id in the logs directory), at most :data:`TAKE_RANGES` ranges and
:data:`TAKE_BYTES` per sample, and nothing on the board can make a take raise or wait
for a lock. A board no reader takes (none live, or one holding its lock) is noticed by the
daemon (:meth:`AdviceBoard.lagging`), which then asks the kernel itself.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import struct
import threading
import time
from collections import deque
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
#: ranges one take carries out at most (the sample it runs in waits for them)
TAKE_RANGES = 32
#: a range longer than this, or reaching past 2**62, is not one the daemon posts (its
#: batches hold ``readplan.ADVISE_BATCH`` of records): skipped
MAX_RANGE = 128 << 20
#: bytes one take asks for at most (past its first range: the rest at the next samples)
TAKE_BYTES = 128 << 20
_LIMIT = 1 << 62
#: seconds a posted range may wait untaken before the daemon asks the kernel itself
LAG_S = 1.0
#: seconds after which a reader that found no board it may use looks again
RETRY_S = 30.0


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
            head = os.pread(fd, _HEADER.size, 0)
            magic, posted, taken = b"", 0, 0
            if len(head) == _HEADER.size:
                magic, posted, taken, _ = _HEADER.unpack(head)
            if (st.st_size != SIZE or len(head) != _HEADER.size or magic != MAGIC
                    or posted > _LIMIT or taken > posted):
                # not a board, or counters no daemon wrote (a member may write it)
                os.ftruncate(fd, 0)
                os.ftruncate(fd, SIZE)
                posted = 0
            # what the last mount posted and no reader took is moot now; the bytes taken
            # count from this mount on, as the bytes posted do
            os.pwrite(fd, _HEADER.pack(MAGIC, posted, posted, 0), 0)
            self.posted = posted
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._base = self.posted
        self.posted_bytes = 0
        # (end of a post's sequence numbers, when posted): those no reader took yet
        self._untaken: deque[tuple[int, float]] = deque()

    def post(self, ranges: Iterable[tuple[int, int, int]]) -> int:
        """Post ``(log id, offset, length)`` ranges; returns their bytes. Ranges of one
        log that touch or lie within :data:`MERGE_GAP` of each other are merged (one
        system call in the reader, not one per record)."""
        # (longer than a reader carries out: in pieces)
        merged = [(log_id, off + a, min(MAX_RANGE, n - a))
                  for log_id, off, n in merge_ranges(ranges) for a in range(0, n, MAX_RANGE)]
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
        self._untaken.append((self.posted, time.monotonic()))
        n = sum(r[2] for r in merged)
        self.posted_bytes += n
        return n

    def lagging(self, now: float | None = None) -> bool:
        """Whether ranges posted more than :data:`LAG_S` ago are still not taken: no
        reader takes them (none reads now, or one holds the board's lock); the caller
        then asks the kernel itself and posts nothing until the readers catch up."""
        if not self._untaken:
            return False
        now = time.monotonic() if now is None else now  # (the clock of post())
        c = _counters(self._fd)
        taken = c[1] if c is not None else 0
        while self._untaken and self._untaken[0][0] <= taken:
            self._untaken.popleft()
        return bool(self._untaken) and now - self._untaken[0][1] > LAG_S

    def stats(self) -> dict:
        """Ranges and bytes posted since this mount began, ranges and bytes the readers
        took (all since this mount began)."""
        _, taken, taken_bytes = _counters(self._fd) or (0, 0, 0)
        return {"posted": self.posted - self._base, "posted_bytes": self.posted_bytes,
                "taken": max(0, min(taken, self.posted) - self._base),
                "taken_bytes": taken_bytes, "waiting": max(0, self.posted - taken)}

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._fd)
        self._fd = -1


def _own_file(path: str, mode: int) -> int:
    """A descriptor of ``path``, a regular file of the directory's owner (the daemon) with
    one link; made with ``mode`` when missing (an existing one keeps its mode: the cache's
    modes are :mod:`dlcachefs.store.modes`'s, ``--keep-cache-modes`` included). Anything
    else there (a reader group member may make entries in the directory: a link, a FIFO,
    a file of their own) is removed first: the directory is ours."""
    owner = os.stat(os.path.dirname(path)).st_uid
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    for _ in range(3):
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, mode)
        except FileExistsError:
            pass
        else:
            try:
                os.fchmod(fd, mode)  # (whatever the umask)
            except BaseException:
                os.close(fd)
                raise
            return fd
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            continue  # removed meanwhile: made anew
        except OSError as e:
            if e.errno not in (errno.ELOOP, errno.EACCES, errno.EPERM, errno.ENXIO):
                raise
        else:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == owner and st.st_nlink == 1:
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
        #: monotonic time until which no board is looked for (none this process may use
        #: was found: an older daemon, a cache not ours to write)
        self._failed_until = 0.0
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None  # take_soon's, while it runs

    def _open(self) -> int:
        """The board's descriptor; -1 (looked for again after :data:`RETRY_S`) when there
        is none this process may write: never a link followed, never a FIFO, only the
        daemon's (the owner of the directory it is in) with one link."""
        fd = -1
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            st = os.fstat(fd)
            owner = os.stat(os.path.dirname(self.path)).st_uid
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == owner:
                self._fd = fd
                return fd
        except OSError:
            pass
        if fd >= 0:
            os.close(fd)
        self._failed_until = time.monotonic() + RETRY_S
        return -1

    def take_soon(self, advise: Callable[[int, int, int], None]) -> None:
        """:meth:`take` in a thread of its own when ranges wait (one at a time per
        process): the sample in hand does not wait for the kernel's page allocations
        (``posix_fadvise`` lets go of the GIL). One ``pread`` here when none wait."""
        try:
            t = self._thread
            if t is not None and t.is_alive():
                return
            fd = self._fd
            if fd >= 0:
                c = _counters(fd)
                if c is None or c[0] <= c[1]:
                    return
            elif time.monotonic() < self._failed_until:
                return
            t = self._thread = threading.Thread(target=self.take, args=(advise,),
                                                name="dlcachefs-readahead", daemon=True)
            t.start()
        except Exception:  # noqa: BLE001 - a hint: nothing of it may reach the training
            return

    def take(self, advise: Callable[[int, int, int], None]) -> int:
        """Carry out the ranges posted and not taken yet, if no one else is doing so:
        ``advise(log id, offset, length)`` for each (its OSError skips the range).
        Returns how many this call took. Never raises (whatever is on the board); never
        waits for a lock."""
        try:
            return self._take(advise)
        except Exception:  # noqa: BLE001 - a hint: nothing of it may reach the training
            return 0

    def _take(self, advise: Callable[[int, int, int], None]) -> int:
        fd = self._fd
        if fd < 0:
            if (time.monotonic() < self._failed_until
                    or not self._lock.acquire(blocking=False)):
                return 0
            try:  # (under the lock: two threads never both open it)
                fd = self._fd if self._fd >= 0 else self._open()
            finally:
                self._lock.release()
            if fd < 0:
                return 0
        try:
            c = _counters(fd)
            if c is None or c[0] <= c[1]:
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
        c = _counters(fd)  # again: another process may have taken them meanwhile
        if c is None or c[0] <= c[1]:
            return 0
        posted, taken, taken_bytes = c
        start = max(taken, posted - RING)
        end = min(posted, start + TAKE_RANGES)  # the rest at the next samples
        done = asked = 0
        for seq, slot in _slots(fd, start, end):
            s, log_id, off, n = SLOT.unpack(slot)
            if s != seq or not 0 < n <= MAX_RANGE or off + n > _LIMIT:
                continue  # overwritten since (the daemon wrapped around), or not its
            if done and asked + n > TAKE_BYTES:
                end = seq  # enough for one sample: this one at the next
                break
            asked += n
            try:
                advise(log_id, off, n)
            except OSError:
                continue
            taken_bytes += n
            done += 1
        os.pwrite(fd, struct.pack("<QQ", end, taken_bytes % (1 << 64)), _TAKEN)
        return done

    def abandon(self) -> None:
        """In a forked child: its copy of the parent's descriptor is closed (the lock
        stays the parent's: it goes with the last copy); the child opens its own at its
        next take."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._lock = threading.Lock()
        self._thread = None  # (not the child's: threads do not cross a fork)

    def close(self, again: bool = False) -> None:
        """Close the board (waits for a take in progress: its descriptor is never closed
        under it). ``again``: the cache directory was made anew, its board is another
        file: the next take opens it."""
        with self._lock:
            fd, self._fd = self._fd, -1
            if again:
                self._failed_until = 0.0
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)


def _counters(fd: int) -> tuple[int, int, int] | None:
    """(posted, taken, taken bytes) from the board's header; None when it is not a
    board's (short, or no magic)."""
    head = os.pread(fd, _HEADER.size, 0)
    if len(head) != _HEADER.size:
        return None
    magic, posted, taken, taken_bytes = _HEADER.unpack(head)
    return (posted, taken, taken_bytes) if magic == MAGIC else None


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
