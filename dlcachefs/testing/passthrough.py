"""A minimal pyfuse3 + trio read-only passthrough over a local directory, as a source
that is slow or misbehaves on demand (the chaos scenarios, the shared-cache tests) and as
the floor cost of a Python FUSE daemon (``bench.passthrough`` measures it).

    python -m dlcachefs.testing.passthrough SRC MNT [--direct-io] [--keep-cache]
                                            [--delay-ms MS] [--faults FILE]

    with passthrough_mount(src, mnt, direct_io=False) as pid:
        ...  # read mnt

It answers lookup, getattr, opendir, readdir, releasedir, open, read, release, statfs; FLUSH
once with ENOSYS (the kernel then stops sending it); the rest is pyfuse3's ENOSYS. Entry
and attribute timeouts are long (the mount is read-only), negative lookups are cached
too. ``read`` is one ``os.pread`` on the trio loop (cheaper than a thread hop for small
reads on 2 cores). Inodes are numbered by the daemon and never forgotten (a test tree is
small). ``--direct-io`` opens files with ``direct_io`` (no page cache on the mount);
``--keep-cache`` keeps the mount's page cache across opens (otherwise every open drops
it, so every read reaches the daemon). ``--delay-ms MS`` makes every ``open`` wait MS
milliseconds (``trio.sleep``, so concurrent opens overlap) before answering: a slow
source (an object store's per-request latency) over a local directory. 0 (default): none.

``--faults FILE`` makes it a misbehaving source (the ``source`` chaos scenario): FILE is
JSON, ``{"NAME": SPEC}`` by file basename, read again whenever it changes; SPEC
``{"errno": N}`` fails the ``open`` of NAME with errno N; ``{"hang": "open"}`` holds its
``open``, ``{"hang": "read2"}`` its first ``read`` past offset 0 (a fetch already half
read), until NAME leaves FILE (at most 300 s); a hang appends NAME to ``FILE.hit``. With
``--faults``, attributes are not cached by the kernel (timeouts 0), so a change made
during a hang is seen by the next ``fstat``, as on a local disk.

:func:`passthrough_mount` starts the daemon as a child, waits until it is mounted, and on
the way out always unmounts (``fusermount3 -u``) and ends the child by its pid if it did
not exit by itself.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pyfuse3
import trio

from dlcachefs.mountctl import MountError, is_mounted, stop_daemon, wait_mounted

TIMEOUT = 86400.0  # entry / attribute timeout, seconds


# ----- the daemon ---------------------------------------------------------------------------

class Faults:
    """``--faults FILE``: the fault spec of each file by basename, read again whenever the
    file changes (the module docstring)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.mtime: int | None = None
        self.specs: dict = {}

    def of(self, path: bytes) -> dict | None:
        """The fault spec for ``path``'s basename, from the faults file as it is now."""
        try:
            mt = os.stat(self.path).st_mtime_ns
            if mt != self.mtime:
                with open(self.path, "rb") as f:
                    self.specs = json.loads(f.read() or b"{}")
                self.mtime = mt
        except (OSError, ValueError):
            self.specs = {}
        return self.specs.get(os.fsdecode(os.path.basename(path)))

    async def hang(self, path: bytes) -> None:
        """Hold the caller while ``path`` has a hang in the file (300 s at most); note it
        in ``FILE.hit``."""
        with open(self.path + ".hit", "a") as f:
            f.write(os.fsdecode(os.path.basename(path)) + "\n")
        for _ in range(6000):
            spec = self.of(path)
            if not spec or "hang" not in spec:
                return
            await trio.sleep(0.05)


class Passthrough(pyfuse3.Operations):
    """The read-only passthrough over ``src`` (the module docstring)."""

    supports_dot_lookup = False
    enable_writeback_cache = False

    def __init__(self, src: str, direct_io: bool, keep_cache: bool, delay_ms: float = 0.0,
                 faults: str | None = None) -> None:
        super().__init__()
        self.src = src
        self.direct_io, self.keep_cache = direct_io, keep_cache
        self.delay_s = max(0.0, delay_ms) / 1000.0
        self.timeout = 0.0 if faults else TIMEOUT
        self.faults = Faults(faults) if faults else None
        self.paths: dict[int, bytes] = {pyfuse3.ROOT_INODE: os.fsencode(src)}
        self.inodes: dict[bytes, int] = {os.fsencode(src): pyfuse3.ROOT_INODE}
        self.next_inode = pyfuse3.ROOT_INODE + 1
        self.listings: dict[int, list[tuple[bytes, bytes]]] = {}
        self.next_dh = 1
        self.fh_paths: dict[int, bytes] = {}  # with faults: open fd -> its path

    def _inode(self, path: bytes) -> int:
        ino = self.inodes.get(path)
        if ino is None:
            ino = self.next_inode
            self.next_inode += 1
            self.inodes[path] = ino
            self.paths[ino] = path
        return ino

    def _attrs(self, st: os.stat_result, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.generation = 0
        a.entry_timeout = self.timeout
        a.attr_timeout = self.timeout
        a.st_mode = st.st_mode
        a.st_nlink = st.st_nlink
        a.st_uid = st.st_uid
        a.st_gid = st.st_gid
        a.st_rdev = st.st_rdev
        a.st_size = st.st_size
        a.st_blksize = st.st_blksize
        a.st_blocks = st.st_blocks
        a.st_atime_ns = st.st_atime_ns
        a.st_mtime_ns = st.st_mtime_ns
        a.st_ctime_ns = st.st_ctime_ns
        return a

    def _stat(self, path: bytes) -> os.stat_result:
        try:
            return os.lstat(path)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None

    async def lookup(self, parent_inode, name, ctx=None):
        parent = self.paths.get(parent_inode)
        if parent is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if name == b".":
            path = parent
        elif name == b"..":
            path = os.path.dirname(parent) if parent_inode != pyfuse3.ROOT_INODE else parent
        else:
            path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            neg = pyfuse3.EntryAttributes()  # st_ino 0: a cached negative entry
            neg.st_ino = 0
            neg.entry_timeout = self.timeout
            return neg
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        return self._attrs(st, self._inode(path))

    async def getattr(self, inode, ctx=None):
        path = self.paths.get(inode)
        if path is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._attrs(self._stat(path), inode)

    async def forget(self, inode_list):
        return  # inodes are kept for the daemon's life

    async def opendir(self, inode, ctx):
        path = self.paths.get(inode)
        if path is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        try:
            names = sorted(os.listdir(path))
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        dh = self.next_dh
        self.next_dh += 1
        self.listings[dh] = [(n, os.path.join(path, n)) for n in names]
        return dh

    async def readdir(self, fh, start_id, token):
        entries = self.listings.get(fh, [])
        for i in range(start_id, len(entries)):
            name, path = entries[i]
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not pyfuse3.readdir_reply(token, name, self._attrs(st, self._inode(path)),
                                         i + 1):
                return

    async def releasedir(self, fh):
        self.listings.pop(fh, None)

    async def open(self, inode, flags, ctx):
        path = self.paths.get(inode)
        if path is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise pyfuse3.FUSEError(errno.EROFS)
        if self.delay_s:
            await trio.sleep(self.delay_s)
        spec = self.faults.of(path) if self.faults else None
        if spec and "errno" in spec:
            raise pyfuse3.FUSEError(int(spec["errno"]))
        if spec and spec.get("hang") == "open":
            await self.faults.hang(path)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None
        if self.faults:
            self.fh_paths[fd] = path
        return pyfuse3.FileInfo(fh=fd, direct_io=self.direct_io or bool(self.faults),
                                keep_cache=self.keep_cache)

    async def read(self, fh, off, size):
        if self.faults and off > 0:
            spec = self.faults.of(self.fh_paths.get(fh, b""))
            if spec and spec.get("hang") == "read2":
                await self.faults.hang(self.fh_paths[fh])
        try:
            return os.pread(fh, size, off)
        except OSError as e:
            raise pyfuse3.FUSEError(e.errno or errno.EIO) from None

    async def flush(self, fh):
        raise pyfuse3.FUSEError(errno.ENOSYS)  # the kernel stops sending FLUSH

    async def release(self, fh):
        self.fh_paths.pop(fh, None)
        with contextlib.suppress(OSError):
            os.close(fh)

    async def statfs(self, ctx):
        sv = os.statvfs(self.src)
        out = pyfuse3.StatvfsData()
        for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                  "f_ffree", "f_favail", "f_namemax"):
            setattr(out, k, getattr(sv, k))
        return out


def serve(src: str, mnt: str, direct_io: bool = False, keep_cache: bool = False,
          delay_ms: float = 0.0, faults: str | None = None) -> int:
    """Mount and serve in the foreground until unmounted (or SIGTERM / SIGINT)."""
    src = os.path.realpath(src)
    mnt = os.path.abspath(mnt)
    if not os.path.isdir(src):
        print(f"passthrough: not a directory: {src}", file=sys.stderr)
        return 2
    ops = Passthrough(src, direct_io, keep_cache, delay_ms,
                      os.path.abspath(faults) if faults else None)
    opts = set(pyfuse3.default_options)
    opts |= {"ro", "fsname=dlcbench-passthrough", "subtype=dlcbench-passthrough"}
    pyfuse3.init(ops, mnt, opts)
    signalled = False

    async def _main() -> None:
        nonlocal signalled
        async with trio.open_nursery() as nursery:
            async def on_signals() -> None:
                nonlocal signalled
                with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as sigs:
                    async for _ in sigs:
                        signalled = True
                        pyfuse3.terminate()

            nursery.start_soon(on_signals)
            try:
                await pyfuse3.main(min_tasks=1, max_tasks=16)
            finally:
                nursery.cancel_scope.cancel()

    try:
        trio.run(_main)
    finally:
        pyfuse3.close(unmount=signalled)
    return 0


# ----- the context manager -------------------------------------------------------------------

def set_read_ahead_kb(mnt: str, kb: int) -> bool:
    """Set the mount's bdi read_ahead_kb (from outside the daemon). False if impossible."""
    st = os.stat(mnt)
    p = f"/sys/class/bdi/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/read_ahead_kb"
    try:
        with open(p, "w") as f:
            f.write(f"{kb}\n")
        return True
    except OSError:
        return False


@contextlib.contextmanager
def passthrough_mount(src: str, mnt: str, direct_io: bool = False, keep_cache: bool = False,
                      read_ahead_kb: int | None = None, log_path: str | None = None,
                      delay_ms: float = 0.0, faults: str | None = None) -> Iterator[int]:
    """Start the passthrough daemon on ``mnt`` in a child process and yield its pid; on
    the way out (also on failure) unmount with ``fusermount3 -u`` and end the child by
    its pid if it has not exited by itself. ``delay_ms`` > 0: every open waits that long."""
    src = os.path.abspath(src)
    mnt = os.path.abspath(mnt)
    os.makedirs(mnt, exist_ok=True)
    if is_mounted(mnt):
        raise MountError(f"{mnt} is already a mountpoint")
    args = [sys.executable, "-m", "dlcachefs.testing.passthrough", src, mnt]
    if direct_io:
        args.append("--direct-io")
    if keep_cache:
        args.append("--keep-cache")
    if delay_ms > 0:
        args.append(f"--delay-ms={delay_ms}")
    if faults:
        args.append(f"--faults={os.path.abspath(faults)}")
    logf = open(log_path or os.devnull, "ab")  # noqa: SIM115
    try:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=logf,
                                stderr=logf, start_new_session=True)
    finally:
        logf.close()
    try:
        wait_mounted(mnt, proc, what="the passthrough")
        if read_ahead_kb is not None and not set_read_ahead_kb(mnt, read_ahead_kb):
            print("passthrough: could not set read_ahead_kb", file=sys.stderr)
        yield proc.pid
    finally:
        problems = stop_daemon(mnt, proc, None, None)
        if problems:
            print(f"passthrough: {'; '.join(problems)}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """The daemon, in the foreground: ``python -m dlcachefs.testing.passthrough SRC MNT
    [--direct-io] [--keep-cache] [--delay-ms MS] [--faults FILE]``."""
    p = argparse.ArgumentParser(prog="python -m dlcachefs.testing.passthrough",
                                description="minimal read-only pyfuse3 passthrough "
                                "(foreground)")
    p.add_argument("src")
    p.add_argument("mnt")
    p.add_argument("--direct-io", action="store_true")
    p.add_argument("--keep-cache", action="store_true")
    p.add_argument("--delay-ms", type=float, default=0.0,
                   help="wait this long in every open (a slow source; default 0)")
    p.add_argument("--faults", metavar="FILE",
                   help="JSON of faults by file name (errno, hang); see the module's doc")
    a = p.parse_args(argv)
    return serve(a.src, a.mnt, direct_io=a.direct_io, keep_cache=a.keep_cache,
                 delay_ms=a.delay_ms, faults=a.faults)


if __name__ == "__main__":
    sys.exit(main())
