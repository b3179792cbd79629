"""Append-only log files holding sealed chunks (``<cache-dir>/logs/NNNNNNNN.log``).

Every method here blocks on the local disk; the core calls them from worker threads,
except :meth:`LogStore.read_cached`, which never waits for the disk. Appends come from a single thread at a time (the chunk writer holds a limiter of one);
reads use ``os.pread`` on shared descriptors and may come from any thread.

Space is reclaimed per chunk by punching a hole (``fallocate(PUNCH_HOLE)``) where the
filesystem supports it, and per log by deleting a log once none of its chunks is live.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import re
import threading
import time
from collections import OrderedDict

from dlcachefs.errors import FormatError
from dlcachefs.store.chunkfmt import LOG_HEADER_SIZE, decode_log_header, encode_log_header
from dlcachefs.store.modes import DIR_MODE, file_mode_in

log = logging.getLogger(__name__)

_LOG_RE = re.compile(r"^(\d{8,})\.log$")

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]


def punch_hole(fd: int, offset: int, length: int) -> bool:
    """Free the blocks of a byte range; False when the filesystem cannot do it."""
    r = _libc.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length)
    if r != 0:
        e = ctypes.get_errno()
        if e in (errno.EOPNOTSUPP, errno.ENOSYS):
            return False
        raise OSError(e, os.strerror(e))
    return True


#: open log descriptors kept (LRU); more are opened while in use, closed when released
MAX_OPEN_LOGS = 64

#: preadv's flag for a read that fails (EAGAIN) rather than wait for the disk; None when
#: this Python or system has none (then read_cached always says no)
_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)


class LogStore:
    """The log files of one cache directory.

    Descriptors: at most ``max_open`` log files stay open (least recently used closed
    first; the active log never), so a cache of many logs each holding a few live chunks
    does not creep towards the fd limit. Concurrency rule: every use of a descriptor is
    inside :meth:`_use`, which pins it (a count under ``_lock``); eviction closes only
    unpinned descriptors, and one evicted while pinned is closed by its last user. So no
    thread ever preads, pwrites, fsyncs or punches through a descriptor that was closed
    (or whose number was reused for another file) under it."""

    def __init__(self, directory: str, log_size: int, max_open: int = MAX_OPEN_LOGS) -> None:
        os.makedirs(directory, mode=DIR_MODE, exist_ok=True)  # owner-only (store.modes)
        self.dir = directory
        self.log_size = log_size
        self.max_open = max(max_open, 2)
        self._fds: OrderedDict[int, int] = OrderedDict()  # log id -> fd, oldest use first
        self._pins: dict[int, int] = {}  # fd -> users now
        self._orphans: set[int] = set()  # fds evicted while pinned: closed at last unpin
        self._lock = threading.Lock()  # guards _fds, _pins, _orphans and live
        self.active_id: int | None = None
        self.active_end = 0
        self.live: dict[int, int] = {}  # log id -> live chunk bytes
        self.filling: set[int] = set()  # reorder logs still being written: never deleted
        self.bytes_read = 0  # bytes read by :meth:`read` since start (under _lock)
        self.bytes_read_back = 0  # of those, read back before a seal (not serving reads)
        self.bytes_advised = 0  # asked into the page cache for other processes (advise)

    def path(self, log_id: int) -> str:
        return os.path.join(self.dir, f"{log_id:08d}.log")

    def log_ids(self) -> list[int]:
        out = []
        for name in os.listdir(self.dir):
            m = _LOG_RE.match(name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def recover(self, indexed_end: dict[int, int]) -> dict[str, int]:
        """Make the logs agree with the index after a crash or a clean stop.

        ``indexed_end`` maps each log id to the end of its last indexed chunk. A log with
        nothing indexed is deleted; bytes past the indexed end (a torn tail, or a chunk whose
        index commit never happened) are truncated. Returns counts for the log file.
        """
        stats = {"logs_deleted": 0, "tail_bytes_dropped": 0}
        for log_id in self.log_ids():
            p = self.path(log_id)
            end = indexed_end.get(log_id)
            if end is None:
                os.unlink(p)
                stats["logs_deleted"] += 1
                continue
            size = os.path.getsize(p)
            if size > end:
                with open(p, "r+b") as f:
                    f.truncate(end)
                    os.fsync(f.fileno())
                stats["tail_bytes_dropped"] += size - end
        self._fsync_dir()
        return stats

    def _fsync_dir(self) -> None:
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def _use(self, log_id: int):
        """The descriptor of a log, pinned open for the ``with`` body (see the class)."""
        with self._lock:
            fd = self._fds.get(log_id)
            if fd is None:
                fd = os.open(self.path(log_id), os.O_RDWR | os.O_CLOEXEC)
                self._fds[log_id] = fd
            else:
                self._fds.move_to_end(log_id)
            self._pins[fd] = self._pins.get(fd, 0) + 1
            self._evict_fds()
        try:
            yield fd
        finally:
            with self._lock:
                self._unpin(fd)

    def _unpin(self, fd: int) -> None:
        n = self._pins[fd] - 1
        if n:
            self._pins[fd] = n
            return
        del self._pins[fd]
        if fd in self._orphans:
            self._orphans.discard(fd)
            os.close(fd)

    def _evict_fds(self) -> None:
        """Close least recently used descriptors past ``max_open`` (under ``_lock``)."""
        if len(self._fds) <= self.max_open:
            return
        for log_id in list(self._fds):
            if len(self._fds) <= self.max_open:
                break
            if log_id == self.active_id:
                continue
            fd = self._fds.pop(log_id)
            if fd in self._pins:
                self._orphans.add(fd)  # its last user closes it
            else:
                os.close(fd)

    def open_fds(self) -> int:
        """Log descriptors open now (kept and in use)."""
        with self._lock:
            return len(self._fds) + len(self._orphans)

    def _create(self, log_id: int, size: int) -> None:
        """A new log file with its header, ``size`` bytes long (sparse), durable on return."""
        p = self.path(log_id)
        # 0600, or 0640 in a reader group's logs/ (store.modes), whatever the umask
        mode = file_mode_in(self.dir)
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
        try:
            os.fchmod(fd, mode)
            os.write(fd, encode_log_header(log_id, time.time_ns()))
            if size > LOG_HEADER_SIZE:
                os.ftruncate(fd, size)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            os.unlink(p)
            raise
        with self._lock:
            self._fds[log_id] = fd
            self.live.setdefault(log_id, 0)
            self._evict_fds()
        self._fsync_dir()

    def start_log(self, log_id: int) -> None:
        """Create a new log file and make it the one appends go to."""
        self._create(log_id, LOG_HEADER_SIZE)
        self.active_id = log_id
        self.active_end = LOG_HEADER_SIZE

    def create_sized(self, log_id: int, size: int) -> None:
        """Create a log of ``size`` bytes (sparse) to be filled at planned offsets: the
        reordered log of a next epoch. It is never the append target."""
        self._create(log_id, size)

    def pwrite(self, log_id: int, data: bytes | memoryview, offset: int) -> None:
        with self._use(log_id) as fd:
            n = os.pwrite(fd, data, offset)
        if n != len(data):
            raise OSError(errno.EIO, f"short write to log {log_id}")

    def datasync(self, log_id: int) -> None:
        with self._use(log_id) as fd:
            os.fdatasync(fd)

    def add_live(self, log_id: int, length: int) -> None:
        with self._lock:  # the chunk writer and the reorderer commit from different threads
            self.live[log_id] = self.live.get(log_id, 0) + length

    def discard_log(self, log_id: int) -> None:
        """Delete a log nothing in the index points at (an abandoned reorder plan)."""
        with self._lock:
            if self.live.get(log_id, 0) > 0:
                return
            self.live.pop(log_id, None)
        self._delete(log_id)

    def _delete(self, log_id: int) -> None:
        with self._lock:
            fd = self._fds.pop(log_id, None)
            if fd is not None and fd in self._pins:
                self._orphans.add(fd)
                fd = None
        if fd is not None:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(log_id))

    def needs_new_log(self, length: int) -> bool:
        return self.active_id is None or (
            self.active_end > LOG_HEADER_SIZE and self.active_end + length > self.log_size)

    def append(self, data: bytes | list[bytes]) -> tuple[int, int]:
        """Append chunks (bytes, or buffers written in a row without joining them) to the
        active log and fsync. Returns (log id, offset).

        On failure (ENOSPC, EIO) the log is cut back to where it was, so nothing half
        written stays behind, and the error propagates.
        """
        assert self.active_id is not None, "start_log() first"
        off = self.active_end
        bufs = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
        total = sum(len(b) for b in bufs)
        with self._use(self.active_id) as fd:
            try:
                _pwrite_all(fd, bufs, off)
                os.fdatasync(fd)
            except OSError:
                try:
                    os.ftruncate(fd, off)
                except OSError:
                    log.exception("could not cut log %d back after a failed append",
                                  self.active_id)
                raise
        self.active_end = off + total
        self.add_live(self.active_id, total)
        return self.active_id, off

    def read(self, log_id: int, offset: int, length: int, *, read_back: bool = False) -> bytes:
        """One pread of ``length`` bytes; short reads (a truncated log) raise FormatError.
        ``read_back``: bytes just written, read again to checksum them before they are
        indexed (a reordered log's chunk): counted apart from the reads that serve."""
        try:
            with self._use(log_id) as fd:
                # a damaged index may name any length: never allocate past the file's end
                if offset + length > os.fstat(fd).st_size or offset < 0 or length < 0:
                    raise FormatError(f"log {log_id} is shorter than its index says")
                data = os.pread(fd, length, offset)
        except FileNotFoundError as e:
            raise FormatError(f"log {log_id} is missing") from e
        with self._lock:  # several threads read; += is not atomic
            if read_back:
                self.bytes_read_back += len(data)
            else:
                self.bytes_read += len(data)
        if len(data) != length:
            raise FormatError(f"log {log_id} is shorter than its index says")
        return data

    def advise(self, log_id: int, offset: int, length: int) -> None:
        """Ask the kernel to read a range into the page cache now, in the background
        (``POSIX_FADV_WILLNEED``): for readers in other processes that will ``pread`` it
        (:mod:`dlcachefs.data`). Thread; a log that is gone is skipped."""
        try:
            with self._use(log_id) as fd:
                os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
        except FileNotFoundError:
            return
        with self._lock:
            self.bytes_advised += length

    def read_cached(self, log_id: int, offset: int, length: int) -> bytearray | None:
        """:meth:`read`'s bytes when all of them are in the page cache now, read without
        waiting for the disk (``preadv`` with ``RWF_NOWAIT``: a copy from memory, cheap
        enough for the trio loop); None when some are not, when the log is not open
        already (opening it is left to :meth:`read`), or for a range past the log's end:
        the caller then reads with :meth:`read`, in a thread, which says what is wrong."""
        global _NOWAIT
        if _NOWAIT is None or offset < 0 or length <= 0:
            return None
        with self._lock:
            fd = self._fds.get(log_id)
            if fd is None:
                return None
            self._pins[fd] = self._pins.get(fd, 0) + 1
        try:
            if offset + length > os.fstat(fd).st_size:
                return None
            buf = bytearray(length)
            try:
                n = os.preadv(fd, [buf], offset, _NOWAIT)
            except BlockingIOError:  # some page is not in memory
                return None
            except OSError as e:
                if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # the filesystem cannot
                    _NOWAIT = None
                    log.info("the cache disk's filesystem does not read with RWF_NOWAIT: "
                             "every log read goes through a thread")
                    return None
                raise
        finally:
            with self._lock:
                self._unpin(fd)
        if n != length:  # (a part in memory, the rest not)
            return None
        with self._lock:
            self.bytes_read += n
        return buf

    def release(self, log_id: int, offset: int, length: int) -> None:
        """Give back the space of an evicted chunk; delete the log when nothing in it lives."""
        with self._lock:
            self.live[log_id] = self.live.get(log_id, 0) - length
            empty = (self.live[log_id] <= 0 and log_id != self.active_id
                     and log_id not in self.filling)
            if empty:
                self.live.pop(log_id, None)
        if empty:
            self._delete(log_id)
            return
        self._punch(log_id, offset, length)

    def punch(self, log_id: int, offset: int, length: int) -> None:
        """Free a byte range nothing indexes (a next epoch's chunk given up half written);
        the log's live bytes do not change."""
        self._punch(log_id, offset, length)

    def _punch(self, log_id: int, offset: int, length: int) -> None:
        try:
            with self._use(log_id) as fd:
                punch_hole(fd, offset, length)
        except FileNotFoundError:
            # Deleted meanwhile: two releases of one log race (threads), the one that
            # takes its live bytes to 0 deletes it while the other is on its way to punch.
            # A deleted log's space is free already: nothing to do, nothing to warn about.
            pass
        except OSError as e:
            if e.errno in (errno.EFBIG, errno.EINVAL):
                # a range no log file can have: the chunk's entry in the index was damaged
                # (a flipped offset or length); nothing is freed, nothing else is wrong
                log.warning("could not punch a hole in log %d at %d+%d (%s): the chunk's "
                            "index entry may be damaged", log_id, offset, length, e.strerror)
            else:
                log.warning("could not punch a hole in log %d", log_id, exc_info=True)

    def check_header(self, log_id: int) -> None:
        decode_log_header(self.read(log_id, 0, LOG_HEADER_SIZE))

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            for fd in self._orphans:
                os.close(fd)
            self._orphans.clear()


_IOV_MAX = 1024  # buffers per pwritev (Linux's UIO_MAXIOV)
#: bytes per pwritev at most. One 16 MiB write, the usual seal, cost a reader of a slow
#: remote beside it 3-6% of its throughput on the bench machine, the same bytes
#: written 1 MiB a call 0-2% (``bench.disk_stall``, a plain writer with no cache:
#: ``--piece-kib 1024 --spread 0`` against the default); the calls cost nothing else
#: that shows (16 system calls a chunk instead of one).
WRITE_PIECE = 1 << 20


def _pwrite_all(fd: int, bufs: list, off: int) -> None:
    """Write ``bufs`` in a row at ``off`` (pwritev, at most _IOV_MAX buffers and
    WRITE_PIECE bytes a call; a short write, which a regular file only gives on error,
    continues where it stopped)."""
    views = []
    for b in bufs:
        v = memoryview(b)
        if v.ndim != 1 or v.itemsize != 1:
            v = v.cast("B")
        if len(v):  # an empty one would make a 0-byte write look stuck
            views.append(v)
    i, skip = 0, 0  # the first byte not written yet: views[i][skip]
    while i < len(views):
        batch, room, j = [], WRITE_PIECE, i
        while j < len(views) and room > 0 and len(batch) < _IOV_MAX:
            v = views[j][skip:] if j == i else views[j]
            if len(v) > room:
                v = v[:room]
            batch.append(v)
            room -= len(v)
            j += 1
        n = os.pwritev(fd, batch, off)
        if n <= 0:
            raise OSError(errno.EIO, "log write made no progress")
        off += n
        while n > 0:  # move past what was written
            left = len(views[i]) - skip
            if n >= left:
                n -= left
                i, skip = i + 1, 0
            else:
                skip, n = skip + n, 0
