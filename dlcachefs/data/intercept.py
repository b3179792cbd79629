"""Reads of cached files served inside the training process, under ``dlcachefs run``.

DAOS serves reads of its FUSE mount inside the application with an interception library
(libioil, libpil4dfs); this is the Python equivalent. :func:`install` (run by the
launcher's ``sitecustomize`` in every Python process of a training: the main process,
DataLoader workers forked or spawned, every DDP rank) replaces ``builtins.open`` and
``io.open``; a read-only binary open (``"rb"``) of a file under a dlcachefs mount whose
current version is cached is answered with a :class:`CachedFile` holding the file's
bytes, read from the cache's log with one ``pread`` and checked against the record's
checksum by :meth:`dlcachefs.data.reader.CacheReader.read_located` (which holds the
safety protocol). No FUSE request is made for it; the daemon learns of the read from the
reader's event ring (:mod:`dlcachefs.store.tally`). ``pathlib.Path.read_bytes``,
``PIL.Image.open(path)``, ``numpy.load(path)``, timm's and DLIO's readers all open through
``open``; ``torchvision.io.read_file`` (and ``decode_image(path)``, which calls it) opens
in C and is replaced in ``torchvision.io`` when that module is imported. Readers that open
in C otherwise (OpenCV, ``numpy.fromfile(path)``, h5py) read through the mount.

Everything else goes to the real ``open``, exactly as without the launcher: another mode
(text, writing, ``buffering=0``, an ``opener``), a path not under a dlcachefs mount (found
by type ``fuse.dlcachefs`` in the process's mount table, read again at most once a
second; a path through symlinks is resolved first), a mount's ``.dlcache/`` files, a mount that says not to (``--substitute``: it
decides at open which file's bytes an open gets), a process the cache directory does not
admit (only its owner and the mount's ``--reader-group``: the mount then enforces the
source's modes), a file above :data:`MAX_SIZE` (so that a header scan of a large file
never reads all of it), and every fallback of the reader (not cached, stale under the
mount's freshness rule, a checksum mismatch, an index the daemon does not hold sound...).
Each is counted by reason in the process's tally (``stats``, ``zerocopy``).

The object returned behaves as the ``BufferedReader`` the real ``open`` returns (``read``,
``read1``, ``readinto``, ``readline``, iteration, ``seek``, ``tell``, ``peek``, ``name``,
``mode``, ``closed``, the context manager). When a descriptor is asked for (``fileno()``,
hence ``mmap``; ``raw``), it switches to a real file opened on the mount, at the same
position, if that is the same version (its size and modification time): ``ESTALE``
otherwise, never a newer version's bytes.

Nothing here raises or warns where the real ``open`` would not: any error of the
in-process path sends the open to the real ``open``. The reader's own opens call the real
``open`` (a per-thread flag keeps the interception from recursing). Never installed in the
daemon (:func:`uninstall` at its start) or its replay worker (``DLCACHEFS_INTERCEPT=0`` in
their environment); ``dlcachefs run --no-intercept`` sets the same.

Concurrency: any thread; the mount table is read again under a lock, each mount's reader
made once under it; the rest is the reader's (:mod:`dlcachefs.data.reader`).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import io
import json
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from dlcachefs.data.onimport import PatchOnImport

if TYPE_CHECKING:
    from dlcachefs.data.reader import CacheReader
    from dlcachefs.store.readonly import Located

#: the environment variable that turns interception off ("0")
ENV = "DLCACHEFS_INTERCEPT"
#: the environment variable for the size cap, in bytes
ENV_MAX = "DLCACHEFS_INTERCEPT_MAX"
#: files above this many bytes are read through the mount (a shard, a video: their
#: readers seek and read parts, and a header scan must not read all of it)
MAX_SIZE = 16 << 20
#: seconds between readings of the mount table
MOUNTS_EVERY_S = 1.0
#: seconds before a mount whose description could not be read is asked again
RETRY_S = 5.0


class _Transient(Exception):
    """A mount's description could not be read now."""

_real_open = io.open  # what builtins.open is too, before install()
#: the real ``open``, for reads that must go through the mount whatever is installed
real_open = _real_open
_installed = False
_local = threading.local()


class _Mounts:
    """The dlcachefs mounts of this process and each one's reader (None: not read in the
    process), as ``bytes`` prefixes. Refreshed at most every :data:`MOUNTS_EVERY_S`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.prefixes: tuple[tuple[bytes, str], ...] = ()
        self._next = 0.0
        self._readers: dict[str, CacheReader | None] = {}
        self._retry: dict[str, float] = {}  # root -> when to ask a silent mount again

    def find(self, path: bytes) -> tuple[str, bytes] | None:
        """(the mount's root, ``path`` relative to it) for an absolute ``path``."""
        if time.monotonic() >= self._next:
            self._refresh()
        for prefix, root in self.prefixes:
            if path.startswith(prefix):
                return root, path[len(prefix):]
        return None

    def reader(self, root: str) -> CacheReader | None:
        r = self._readers.get(root, False)
        if r is not False:
            return r  # type: ignore[return-value]
        with self._lock:
            if root not in self._readers:
                if time.monotonic() < self._retry.get(root, 0.0):
                    return None
                try:
                    self._readers[root] = _reader_for(root)
                except _Transient:
                    # the mount did not answer (a daemon restarting): asked again later
                    self._retry[root] = time.monotonic() + RETRY_S
                    return None
                except Exception:  # noqa: BLE001 - no lmdb in this venv, say: the mount reads
                    self._readers[root] = None
            return self._readers[root]

    def _refresh(self) -> None:
        from dlcachefs import mountctl  # noqa: PLC0415 - at the first open only

        with self._lock:
            if time.monotonic() < self._next:
                return
            try:
                roots = mountctl.mounts_of("fuse.dlcachefs")
            except OSError:
                roots = []
            # the longest first: a mount inside another's tree is its own
            roots.sort(key=len, reverse=True)
            self.prefixes = tuple((os.fsencode(r.rstrip("/") + "/"), r) for r in roots)
            for gone in set(self._readers) - set(roots):
                del self._readers[gone]
            self._next = time.monotonic() + MOUNTS_EVERY_S


def _reader_for(root: str) -> CacheReader | None:
    """The mount's reader when this process may read its cache in-process: the mount
    allows it, and the cache directory admits this user (else the mount's own checks
    apply, through the mount)."""
    from dlcachefs.data import reader as R  # noqa: PLC0415 - lmdb at the first open

    try:
        with _real_open(os.path.join(root, *R.INFO), "rb") as f:
            info = R.CacheInfo.from_json(json.loads(f.read()))
    except OSError as e:
        raise _Transient from e
    except (ValueError, KeyError, TypeError):
        return None
    if not info.intercept:
        return None
    lock = os.path.join(info.index_dir, "lock.mdb")
    if not (os.access(info.index_dir, os.R_OK | os.X_OK) and os.access(lock, os.W_OK)
            and os.access(info.logs_dir, os.R_OK | os.X_OK)):
        return None
    R.QUIET = True  # the training hears nothing of the reader: fallbacks are counted
    return R.CacheReader(root, info)


_mounts = _Mounts()


#: seconds a fork waits for a thread making a mount's reader (see _before_fork)
FORK_WAIT_S = 5.0
_fork_held = threading.local()


def _before_fork() -> None:
    # No fork while a thread makes a mount's reader, if it can be helped: it imports under
    # this lock, and a child forked meanwhile would inherit that module's import lock held
    # by a thread it does not have. The imports are made at install() when a mount is
    # there (before any thread); this wait covers a mount that came later. Bounded: that
    # thread may itself wait for a lock the forking thread holds (logging's, taken by its
    # own at-fork handler), and a fork must never hang the training.
    _fork_held.got = _mounts._lock.acquire(timeout=FORK_WAIT_S)


def _after_fork_in_parent() -> None:
    if getattr(_fork_held, "got", False):
        _fork_held.got = False
        _mounts._lock.release()


def _after_fork_in_child() -> None:
    _mounts._lock = threading.Lock()  # (the parent's, held through the fork)


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


def _max_size() -> int:
    try:
        return int(os.environ.get(ENV_MAX, MAX_SIZE))
    except ValueError:
        return MAX_SIZE


_max = _max_size()


def _mount_of(file: Any) -> tuple[CacheReader, bytes] | None:
    """The reader of the mount ``file`` lies in, and its absolute path, when the process
    may read that mount's cache (not for its ``.dlcache/`` files, nor a path with a
    trailing slash: the kernel's ENOTDIR, through the mount)."""
    if isinstance(file, int):
        return None
    p = os.fsencode(file)  # (str, bytes, PathLike; TypeError for anything else)
    if not p.startswith(b"/"):
        p = os.getcwdb() + b"/" + p
    found = _mounts.find(p)
    if found is None:
        r = _through_links(p) if _mounts.prefixes else None
        found = _mounts.find(r) if r is not None and r != p else None
        if found is None:
            return None
        p = r
    root, rel = found
    if rel.startswith(b".dlcache/") or rel == b".dlcache" or rel.endswith(b"/"):
        return None
    reader = _mounts.reader(root)
    return None if reader is None else (reader, p)


#: directories (as opened through) -> where they resolve, for opens outside the mounts
_dirs: dict[bytes, bytes] = {}
DIRS_MAX = 4096


def _through_links(p: bytes) -> bytes | None:
    """Where ``p`` (absolute, not under a mount as given) resolves, when that may be
    under a mount (a link to a file in it, a directory linked into it); None otherwise.
    An open outside the mounts pays a lookup of its directory (resolved once, then
    remembered) and one ``lstat``; a path that may lead into a mount is resolved afresh,
    so a link changed since never sends an open to the wrong file."""
    d, _, base = p.rpartition(b"/")
    r = _dirs.get(d)
    if r is None:
        r = os.path.realpath(d or b"/")
        if len(_dirs) >= DIRS_MAX:
            _dirs.clear()
        _dirs[d] = r
    if _mounts.find(r.rstrip(b"/") + b"/" + base) is not None or os.path.islink(p):
        return os.path.realpath(p)
    return None


def _served(file: Any) -> CachedFile | None:
    """The in-process answer to ``open(file, "rb")``, or None for the real ``open``."""
    m = _mount_of(file)
    if m is None:
        return None
    reader, p = m
    got = reader.read_located(p, _max)
    if got is None:
        return None
    # (the name as the real open gives it: the str or bytes given, a path's str)
    name = file if isinstance(file, str | bytes) else os.fspath(file)
    return CachedFile(got[0], name, p, got[1], reader)


def _count(file: Any, reason: str) -> None:
    """Count an open under a mount that the mode sends through it."""
    m = _mount_of(file)
    if m is not None:
        m[0].count(reason)


def open(file, mode="r", buffering=-1, encoding=None, errors=None, newline=None,  # noqa: A001
         closefd=True, opener=None):
    """``io.open``, with read-only binary opens of cached files of a dlcachefs mount served
    in the process (see the module doc)."""
    if not getattr(_local, "inside", False):
        try:
            _local.inside = True
            if ((mode == "rb" or mode == "br") and buffering != 0 and opener is None
                    and closefd is True and encoding is None and errors is None
                    and newline is None):  # (the real open refuses the others)
                f = _served(file)
                if f is not None:
                    return f
            elif mode and "r" in mode and "+" not in mode:
                _count(file, "mode")
        except Exception:  # noqa: BLE001, S110 - the real open answers, as without us
            pass
        finally:
            _local.inside = False
    return _real_open(file, mode, buffering, encoding, errors, newline, closefd, opener)


#: ``os.SEEK_DATA``, ``os.SEEK_HOLE`` (Linux; none elsewhere)
_DATA_HOLE = tuple(getattr(os, n) for n in ("SEEK_DATA", "SEEK_HOLE") if hasattr(os, n))


class CachedFile(io.BufferedIOBase):
    """A file's bytes served in the process, as a read-only ``BufferedReader`` (see the
    module doc). After :meth:`fileno` (or ``raw``) it reads a real file on the mount.

    Not a subclass of ``io.BufferedReader``, on purpose: code that checks for one takes
    it to mean "a real descriptor" (``numpy.load`` then reads with ``fromfile``, which asks
    for ``fileno()``), so a subclass would send those reads through the mount."""

    def __init__(self, data: bytes, name: Any, path: bytes, where: Located,
                 reader: CacheReader) -> None:
        self._f: Any = io.BytesIO(data)  # (shares ``data``: no copy)
        self._data = data
        self.name = name
        self.mode = "rb"
        self._path = path
        self._where = where
        self._reader = reader

    # ----- reads: what BufferedReader does ------------------------------------------

    def read(self, size: int | None = -1) -> bytes:
        if size is not None and size < -1:
            raise ValueError("read length must be non-negative or -1")
        return self._f.read(size)

    def read1(self, size: int = -1) -> bytes:
        if size < -1:
            raise ValueError("read length must be non-negative or -1")
        return self._f.read1(size)

    def readinto(self, b) -> int:
        return self._f.readinto(b)

    def readinto1(self, b) -> int:
        return self._f.readinto1(b)

    def readline(self, size: int | None = -1) -> bytes:
        return self._f.readline(size)

    def readlines(self, hint: int | None = -1) -> list[bytes]:
        return self._f.readlines(hint)

    def peek(self, size: int = 0) -> bytes:
        f = self._f
        if not isinstance(f, io.BytesIO):
            return f.peek(size)
        # what a BufferedReader's buffer would hold (at least one byte, if any is left);
        # from the bytes, not f.getbuffer(), which would make BytesIO copy them
        pos = f.tell()
        return self._data[pos:pos + max(size, io.DEFAULT_BUFFER_SIZE)]

    def seek(self, offset: int, whence: int = 0) -> int:
        f = self._f
        if isinstance(f, io.BytesIO) and whence in _DATA_HOLE and not f.closed:
            # a file without holes, as the kernel answers for one (the mount's too): data
            # from any offset inside the file, the one hole at its end, ENXIO past it
            # (a negative offset too: the kernel compares it unsigned)
            if not 0 <= offset < len(self._data):
                raise OSError(errno.ENXIO, os.strerror(errno.ENXIO))
            return f.seek(offset if whence == _DATA_HOLE[0] else len(self._data))
        if isinstance(f, io.BytesIO) and whence in (0, 1, 2) and not f.closed:
            # a position before the start is the kernel's EINVAL, not BytesIO's ValueError
            base = (0, f.tell(), len(self._data))[whence]
            if base + offset < 0:
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def readable(self) -> bool:
        self._check_open()
        return True

    def seekable(self) -> bool:
        self._check_open()
        return True

    def writable(self) -> bool:
        self._check_open()
        return False

    def isatty(self) -> bool:
        self._check_open()
        return False

    def write(self, b) -> int:
        raise io.UnsupportedOperation("write")

    def truncate(self, pos: int | None = None) -> int:
        raise io.UnsupportedOperation("truncate")

    def detach(self):
        raise io.UnsupportedOperation("detach")

    def flush(self) -> None:
        self._check_open()

    def close(self) -> None:
        self._f.close()
        super().close()

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("I/O operation on closed file.")

    # ----- a descriptor asked for: the mount's file, same version -------------------

    def fileno(self) -> int:
        return self._real().fileno()

    @property
    def raw(self):
        return self._real().raw

    def _real(self):
        """The file on the mount at this position, for the version read (ESTALE if the
        mount now has another)."""
        f = self._f
        if not isinstance(f, io.BytesIO):
            return f
        self._check_open()
        pos = f.tell()
        real = _real_open(self._path, "rb")
        try:
            st = os.fstat(real.fileno())
            w = self._where
            if st.st_size != w.size or (w.mtime_ns and st.st_mtime_ns != w.mtime_ns):
                raise OSError(errno.ESTALE, os.strerror(errno.ESTALE), self.name)
            real.seek(pos)
        except BaseException:
            real.close()
            raise
        self._reader.count("switched")
        self._f = real
        f.close()
        return real

    def __repr__(self) -> str:
        return f"<dlcachefs.CachedFile name={self.name!r} mode='rb'>"

    def __getstate__(self):
        raise TypeError(f"cannot pickle {type(self).__name__!r} object")


# ----- torchvision.io: files read in C ------------------------------------------------------

TV_IMAGE = "torchvision.io.image"


def _ignore(_: Exception) -> None:
    pass  # torchvision's own read_file answers


def _patch_torchvision(image_mod) -> None:
    """Replace ``read_file`` in ``torchvision.io.image`` (``decode_image(path)`` calls it
    there) and in ``torchvision.io``."""
    real = getattr(image_mod, "read_file", None)
    if real is None or getattr(real, "_dlcachefs", False):
        return

    def read_file(path):
        try:
            f = None
            if not getattr(_local, "inside", False):
                _local.inside = True
                try:
                    f = _served(str(path))
                finally:
                    _local.inside = False
            if f is not None:
                import torch  # noqa: PLC0415 - torchvision has it loaded

                data = f.read()
                f.close()
                # a tensor of its own memory, as torchvision's (frombuffer would share,
                # and warn about, a read-only buffer)
                return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
                    torch.empty(0, dtype=torch.uint8)
        except Exception:  # noqa: BLE001, S110 - torchvision's own read answers
            pass
        return real(path)

    read_file._dlcachefs = True  # type: ignore[attr-defined]
    read_file.__doc__ = real.__doc__
    image_mod.read_file = read_file
    io_mod = sys.modules.get("torchvision.io")
    if io_mod is not None and getattr(io_mod, "read_file", None) is real:
        io_mod.read_file = read_file


# ----- on and off ----------------------------------------------------------------------------

def install() -> bool:
    """Serve cached files' opens in this process (see the module doc), unless
    ``$DLCACHEFS_INTERCEPT`` is ``0``. Returns whether it is installed."""
    global _installed
    if _installed:
        return True
    if os.environ.get(ENV, "1") == "0":
        return False
    _installed = True
    if _mount_table_has_one():
        # the reader's imports now, in the one thread there is: made lazily in a reading
        # thread, a DataLoader worker forked meanwhile could inherit their import locks
        with contextlib.suppress(Exception):  # (no lmdb here: reads go through the mount)
            import dlcachefs.data.reader  # noqa: F401, PLC0415
    builtins.open = open
    io.open = open
    image = sys.modules.get("torchvision.io.image")
    if image is not None:
        _patch_torchvision(image)
    else:
        # (torchvision.io imports read_file from it right after: the patched one)
        sys.meta_path.insert(0, PatchOnImport(TV_IMAGE, _patch_torchvision, _ignore))
    return True


def _mount_table_has_one() -> bool:
    try:
        with _real_open("/proc/self/mounts", "rb") as f:
            return b" fuse.dlcachefs " in f.read()
    except OSError:
        return False


def uninstall() -> None:
    """The real ``open`` again (the daemon, which a launcher may have started, serves the
    mount: it must never read through its own cache this way), and for this process's
    children (``$DLCACHEFS_INTERCEPT=0``)."""
    global _installed
    os.environ[ENV] = "0"
    if not _installed:
        return
    _installed = False
    builtins.open = _real_open
    io.open = _real_open
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not (isinstance(f, PatchOnImport) and f.name == TV_IMAGE)]


def installed() -> bool:
    """Whether :func:`install` is in effect in this process."""
    return _installed
