"""Prototype: a second process serving READs of one dlcachefs mount through a cloned
``/dev/fuse`` fd (FUSE_DEV_IOC_CLONE). An investigation, not a feature (bench/README.md,
"fuseclone", says what it found).

    sudo .venv/bin/python -m bench.fuseclone [--files 200] [--threads 8] [--work DIR]

1. Mounts dlcachefs over a small tree of random files, reads every file once (cached),
   waits for the writer.
2. Opens every file (the daemon answers OPEN), drops the mount's pages of them
   (``posix_fadvise(DONTNEED)``), so that the reads below must reach a daemon.
3. Starts a helper process that takes the daemon's ``/dev/fuse`` fd (``pidfd_getfd``, root:
   a daemon that wanted helpers would fork them after ``pyfuse3.init`` or pass the fd with
   SCM_RIGHTS), opens ``/dev/fuse`` and clones the session onto it
   (``ioctl(FUSE_DEV_IOC_CLONE)``), then reads raw FUSE requests from it. A READ of a
   cached file it answers itself: the record from the cache's LMDB index (opened
   read-only), one ``pread`` of the log, the xxh3 checked, the slice asked for. Any other
   request it cannot answer right, and says so (EIO, counted by opcode).
4. The client ``pread``s every open file whole with ``--threads`` threads; every byte is
   compared with the source. Then the helper is stopped, and a file is read through the
   mount again (the daemon alone).

Prints JSON: READs served by the helper and by the daemon (``fuse_ops``), other opcodes
the helper received, errors seen, whether every byte matched.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import fcntl
import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

FUSE_DEV_IOC_CLONE = 0x8004E500  # _IOR(229, 0, uint32_t)
SYS_PIDFD_GETFD = 438
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len, opcode, unique, nodeid, uid, gid, pid, extlen, pad
READ_IN = struct.Struct("<QQIIQII")  # fh, offset, size, read_flags, lock_owner, flags, pad
OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
FUSE_READ, FUSE_FORGET, FUSE_BATCH_FORGET, FUSE_INTERRUPT = 15, 2, 42, 36
OPNAMES = {1: "LOOKUP", 2: "FORGET", 3: "GETATTR", 14: "OPEN", 15: "READ", 18: "RELEASE",
           25: "FLUSH", 36: "INTERRUPT", 39: "IOCTL", 42: "BATCH_FORGET"}


def fuse_fd_of(pid: int) -> int:
    """The fd number of /dev/fuse in process ``pid`` (the session's)."""
    fds = [int(n) for n in os.listdir(f"/proc/{pid}/fd")
           if os.readlink(f"/proc/{pid}/fd/{n}") == "/dev/fuse"]
    if len(fds) != 1:
        raise RuntimeError(f"process {pid} holds {len(fds)} /dev/fuse fds")
    return fds[0]


def take_fd(pid: int, fd: int) -> int:
    """A duplicate of fd ``fd`` of process ``pid`` in this process (pidfd_getfd)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        got = libc.syscall(SYS_PIDFD_GETFD, pidfd, fd, 0)
        if got < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"pidfd_getfd: {os.strerror(e)}")
        return got
    finally:
        os.close(pidfd)


# ----- the helper process ----------------------------------------------------------------

def helper(pid: int, cache_dir: str, ready_path: str, stats_path: str) -> int:
    import lmdb

    from dlcachefs.store import schema as S
    from dlcachefs.store.chunkfmt import checksum
    from dlcachefs.store.schema import Record, ukey

    stats: dict = {"reads": 0, "bytes": 0, "read_fallback_eio": 0, "other": {},
                   "errors": []}
    session = take_fd(pid, fuse_fd_of(pid))
    dev = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(dev, FUSE_DEV_IOC_CLONE, struct.pack("I", session))
    except OSError as e:
        stats["errors"].append(f"FUSE_DEV_IOC_CLONE: {e}")
        _dump(stats, stats_path)
        return 1
    os.close(session)  # the clone holds the connection; the daemon keeps its own fd
    env = lmdb.open(os.path.join(cache_dir, "meta.lmdb"), readonly=True, lock=True,
                    subdir=True, create=False, max_dbs=8, readahead=False)
    record_db = env.open_db(S.DB_RECORD, create=False)
    logs: dict[int, int] = {}
    cache: dict[int, bytes] = {}
    stop = False

    def on_term(*_a) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    open(ready_path, "w").close()
    buf = bytearray(1 << 21)  # the kernel refuses reads smaller than max_write + headers
    while not stop:
        r, _, _ = select.select([dev], [], [], 0.1)
        if not r:
            continue
        n = os.readv(dev, [buf])
        ln, op, unique, nodeid, _uid, _gid, _pid, _x, _p = IN_HEADER.unpack_from(buf)
        if op in (FUSE_FORGET, FUSE_BATCH_FORGET, FUSE_INTERRUPT):
            stats["other"][OPNAMES.get(op, str(op))] = stats["other"].get(
                OPNAMES.get(op, str(op)), 0) + 1
            continue  # no reply to these
        if op != FUSE_READ:
            stats["other"][OPNAMES.get(op, str(op))] = stats["other"].get(
                OPNAMES.get(op, str(op)), 0) + 1
            os.write(dev, OUT_HEADER.pack(OUT_HEADER.size, -errno.EIO, unique))
            continue
        _fh, off, size, *_ = READ_IN.unpack_from(buf, IN_HEADER.size)
        data = cache.get(nodeid)
        if data is None:
            with env.begin(db=record_db, buffers=False) as txn:
                rb = txn.get(ukey(nodeid))
            if rb is not None:
                rec = Record.unpack(rb)
                fd = logs.get(rec.log_id)
                if fd is None:
                    fd = logs[rec.log_id] = os.open(
                        os.path.join(cache_dir, "logs", f"{rec.log_id:08d}.log"), os.O_RDONLY)
                d = os.pread(fd, rec.size, rec.offset)
                if len(d) == rec.size and checksum(d) == rec.data_xxh:
                    data = cache[nodeid] = d
        if data is None:
            stats["read_fallback_eio"] += 1  # a real helper must not do this
            os.write(dev, OUT_HEADER.pack(OUT_HEADER.size, -errno.EIO, unique))
            continue
        piece = data[off:off + size]
        os.writev(dev, [OUT_HEADER.pack(OUT_HEADER.size + len(piece), 0, unique), piece])
        stats["reads"] += 1
        stats["bytes"] += len(piece)
        del n, ln
    _dump(stats, stats_path)
    return 0


def _dump(doc: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(doc, f)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# ----- the driver --------------------------------------------------------------------------

def run(a: argparse.Namespace) -> dict:
    sys.path.insert(0, REPO)
    from bench.mounting import DlcMount

    work = os.path.abspath(a.work)
    src, mnt, cache = (os.path.join(work, x) for x in ("src", "mnt", "cache"))
    shutil.rmtree(work, ignore_errors=True)
    rng = __import__("random").Random(0)
    rels = []
    for i in range(a.files):
        d = os.path.join(src, f"c{i % 4}")
        os.makedirs(d, exist_ok=True)
        rel = f"c{i % 4}/{i:05d}.bin"
        with open(os.path.join(src, rel), "wb") as f:
            f.write(rng.randbytes(rng.randint(1, 300_000)))
        rels.append(rel)
    doc: dict = {"files": a.files, "threads": a.threads}
    with DlcMount(src, mnt, cache) as m:
        for r in rels:
            with open(os.path.join(mnt, r), "rb") as f:
                f.read()
        m.wait_idle()
        fds = [os.open(os.path.join(mnt, r), os.O_RDONLY) for r in rels]
        for fd in fds:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        ops0 = m.stats()["fuse_ops"]
        ready, statf = os.path.join(work, "ready"), os.path.join(work, "helper.json")
        h = subprocess.Popen([sys.executable, "-m", "bench.fuseclone", "--helper", str(m.pid),
                              cache, ready, statf], cwd=REPO)
        try:
            t0 = time.monotonic()
            while not os.path.exists(ready) and h.poll() is None and time.monotonic() - t0 < 30:
                time.sleep(0.05)
            doc["helper_started"] = os.path.exists(ready)
            sizes = [os.path.getsize(os.path.join(src, r)) for r in rels]

            def read_one(i: int) -> bool:
                try:
                    got = os.pread(fds[i], sizes[i] + 1, 0)
                except OSError as e:
                    return f"{rels[i]}: {e}"
                return got == _read(os.path.join(src, rels[i])) or f"{rels[i]}: bytes differ"

            with ThreadPoolExecutor(a.threads) as ex:
                results = list(ex.map(read_one, range(len(rels))))
            doc["client_errors"] = [r for r in results if r is not True][:10]
            doc["bytes_match"] = all(r is True for r in results)
            if a.mixed:
                # what a training loop does: open + read + close by path. Every request
                # kind now reaches the helper too, which cannot answer them for the daemon
                # (so no stats are read until it is gone: that too goes through the mount)

                def by_path(i: int) -> bool | str:
                    try:
                        with open(os.path.join(mnt, rels[i]), "rb") as f:
                            got = f.read()
                    except OSError as e:
                        return f"{type(e).__name__}: {e}"
                    return got == _read(os.path.join(src, rels[i])) or "differ"

                with ThreadPoolExecutor(a.threads) as ex:
                    mixed = list(ex.map(by_path, range(min(len(rels), 60))))
                errs = [r for r in mixed if r is not True]
                doc["mixed"] = {"files": len(mixed), "failed": len(errs),
                                "errors_seen": sorted(set(errs))[:5]}
        finally:
            h.send_signal(signal.SIGTERM)
            h.wait(timeout=30)
        for fd in fds:
            os.close(fd)
        st1 = m.stats()
        ops1 = st1["fuse_ops"]
        doc["daemon_reads"] = ops1["read"] - ops0["read"]
        if "mixed" in doc:  # the daemon's side of the by-path phase
            doc["mixed"]["daemon_opens"] = ops1["open"] - ops0["open"]
        doc["helper"] = json.loads(_read(statf)) if os.path.exists(statf) else None
        # after the helper left: the daemon alone
        doc["mount_works_after_helper"] = (_read(os.path.join(mnt, rels[0]))
                                           == _read(os.path.join(src, rels[0])))
    return doc


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--helper"]:
        return helper(int(argv[1]), argv[2], argv[3], argv[4])
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--mixed", action="store_true",
                    help="then open + read + close by path while the helper is attached "
                         "(shows what it cannot answer)")
    ap.add_argument("--work", default=os.path.join(REPO, "bench", "out", "fuseclone"))
    doc = run(ap.parse_args(argv))
    print(json.dumps(doc, indent=1))
    return 0 if doc.get("bytes_match") else 1  # --mixed failing is the expected finding


if __name__ == "__main__":
    sys.exit(main())
