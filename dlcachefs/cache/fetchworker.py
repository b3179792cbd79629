"""A fetch worker process (``--fetch-workers``): source reads, checksums and log appends
of files fetched ahead, off the daemon's core.

Run by :class:`dlcachefs.cache.fetchpool.FetchPool` as
``python -m dlcachefs.cache.fetchworker ROOT USE_SRC_INO``. It reads jobs from
stdin and answers each on stdout, one at a time, in order (:func:`send` / :func:`recv`:
a 4-byte length, then a pickle; both ends are the daemon's own code). A job names files
(inode, path relative to the source root, the version the daemon expects), a log file
the daemon created, the offset to append at, the chunk id to give the chunk, and the
bytes the daemon reserved (``room``). The worker reads each file from the source
(:class:`~dlcachefs.cache.source.LocalSource`: the same rules as the daemon's reads),
keeps those whose version is the expected one, encodes them as ONE chunk
(:func:`~dlcachefs.store.chunkfmt.encode_chunk_parts`, xxh3 as everywhere), writes it at
the offset and ``fdatasync``\\ s the log before it answers. The answer carries only the
records' metadata; the daemon indexes them (it stays the only LMDB writer).

Never more than ``room`` bytes are written, and nothing past the job's offset is written
before the chunk is complete: a failed write is cut back to the offset. A worker killed
mid-append leaves a torn tail the index does not cover; the daemon appends no more to
that log, and recovery cuts such tails at the next start.

Death with the daemon: ``PR_SET_PDEATHSIG`` (SIGKILL) is set first thing, and stdin's
end-of-file ends the loop. The daemon's cache lock descriptor is inherited (kept open, never used):
the ``flock`` is held until the worker is gone too, so no new daemon recovers the cache
while a worker of the old one could still append.

Standard library, xxhash and the store's format only: no trio, no lmdb.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import pickle
import signal
import struct
import sys
from dataclasses import dataclass

from dlcachefs.cache.source import Identity, LocalSource
from dlcachefs.errors import DlcError
from dlcachefs.store.chunkfmt import RecordIn, encode_chunk_parts

_LEN = struct.Struct("<I")
#: tests only: a path; the first worker to create that file writes half of its next
#: chunk and SIGKILLs itself (a worker killed mid-append, deterministically, once)
TEAR_ENV = "DLCACHEFS_TEST_TEAR_FETCH_JOB"
#: prctl's option number (linux/prctl.h)
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class Job:
    """Files to fetch into one chunk at ``offset`` of log ``log_path``."""

    log_path: str
    offset: int
    room: int  # bytes the daemon reserved for the chunk: never more is written
    chunk_id: int
    files: list[tuple[int, bytes, Identity]]  # (inode, relative path, expected version)


@dataclass(frozen=True, slots=True)
class Done:
    """What a job did: the chunk's length (0: nothing written), each record written as
    ``(ino, data offset in the chunk, size, data xxh3, mtime_ns, src_ino)``, and the
    files not written with why (``(ino, reason, version seen or None)``)."""

    length: int
    records: list[tuple[int, int, int, int, int, int]]
    skipped: list[tuple[int, str, Identity | None]]
    error: str | None = None  # the append failed (nothing of it stays in the log)


def send(fd: int, obj: object) -> None:
    """Blocking: one message on ``fd``."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    _write_all(fd, _LEN.pack(len(data)) + data)


def recv(fd: int) -> object | None:
    """Blocking: one message from ``fd``; None at end of file."""
    head = _read_exact(fd, _LEN.size)
    if head is None:
        return None
    body = _read_exact(fd, _LEN.unpack(head)[0])
    return None if body is None else pickle.loads(body)  # noqa: S301 - the daemon's own


def frame(obj: object) -> bytes:
    """A message as bytes (the daemon's side writes it through trio)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(data)) + data


def _write_all(fd: int, data: bytes) -> None:
    mv = memoryview(data)
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


def _read_exact(fd: int, n: int) -> bytes | None:
    parts, got = [], 0
    while got < n:
        b = os.read(fd, n - got)
        if not b:
            return None
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def run_job(src: LocalSource, use_src_ino: bool, job: Job, tear: bool = False) -> Done:
    """Read, check, encode, append and sync one job's chunk (see the module doc).
    ``tear``: die by SIGKILL halfway through the append (tests)."""
    recs: list[RecordIn] = []
    skipped: list[tuple[int, str, Identity | None]] = []
    for ino, rel, want in job.files:
        try:
            data, seen = src.read_file(rel, use_src_ino)
        except DlcError as e:
            skipped.append((ino, f"{type(e).__name__}: {e}", None))
            continue
        if seen != want:
            skipped.append((ino, "changed", seen))
            continue
        recs.append(RecordIn(ino, rel, seen.mtime_ns, seen.src_ino, data))
    if not recs:
        return Done(0, [], skipped)
    parts, metas, length = encode_chunk_parts(job.chunk_id, recs)
    if length > job.room:  # never past what the daemon reserved
        return Done(0, [], skipped + [(r.ino, "room", None) for r in recs])
    try:
        fd = os.open(job.log_path, os.O_WRONLY | os.O_CLOEXEC)
    except OSError as e:
        return Done(0, [], skipped + [(r.ino, "log", None) for r in recs], str(e))
    try:
        try:
            off = job.offset
            if tear:
                whole = b"".join(parts)
                os.pwrite(fd, whole[:len(whole) // 2], off)
                os.kill(os.getpid(), signal.SIGKILL)
            bufs = [memoryview(p) for p in parts]
            while bufs:
                n = os.pwritev(fd, bufs, off)
                off += n
                while bufs and n >= len(bufs[0]):
                    n -= len(bufs[0])
                    bufs.pop(0)
                if bufs and n:
                    bufs[0] = bufs[0][n:]
            os.fdatasync(fd)
        except OSError as e:
            with contextlib.suppress(OSError):  # nothing half written stays behind
                os.ftruncate(fd, job.offset)
            return Done(0, [], skipped + [(r.ino, "write", None) for r in recs], str(e))
    finally:
        os.close(fd)
    return Done(length, [(m.ino, m.data_offset, m.size, m.data_xxh, m.mtime_ns, m.src_ino)
                         for m in metas], skipped)


def _die_with_parent() -> None:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def main(argv: list[str]) -> int:
    """The worker's loop: one job in, one answer out, until stdin ends."""
    parent = os.getppid()
    _die_with_parent()
    if os.getppid() != parent:  # the daemon died before the signal was armed
        return 1
    root, use_src_ino = os.fsencode(argv[0]), argv[1] == "1"
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a ^C is the daemon's to handle
    # the protocol's descriptors moved away from 0 and 1: nothing printed corrupts it
    fd_in, fd_out = os.dup(0), os.dup(1)
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    src = LocalSource(root)
    tear = _tear_once(os.environ.get(TEAR_ENV))
    while True:
        job = recv(fd_in)
        if job is None:
            return 0
        assert isinstance(job, Job)
        send(fd_out, run_job(src, use_src_ino, job, tear=tear))


def _tear_once(marker: str | None) -> bool:
    """Tests: whether this worker is the one to die mid-append (:data:`TEAR_ENV`)."""
    if not marker:
        return False
    try:
        os.close(os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except OSError:
        return False
    return True


if __name__ == "__main__":
    # run as the module's importable name, so that what is pickled names the classes the
    # daemon knows (dlcachefs.cache.fetchworker.Done, not __main__.Done)
    from dlcachefs.cache.fetchworker import main as _main

    sys.exit(_main(sys.argv[1:]))
