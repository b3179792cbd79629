"""The source side: the slow dataset directory the mount mirrors.

Every method here blocks (a network filesystem may take milliseconds or hang), so the
core calls them only from worker threads (``trio.to_thread.run_sync`` under the source
``CapacityLimiter``), never on the trio loop. Paths are relative ``bytes`` so that names
that are not valid UTF-8 round-trip unchanged.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat as stat_mod
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from dlcachefs.errors import DlcError, NotFound, OutsideSource, SourceChanged, SourceError

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Identity:
    """What identifies one version of a source file: (size, mtime_ns, inode).

    ``src_ino`` is 0 when the source's inode numbers are not stable (``--ignore-source-inode``,
    for example sshfs without ``-o use_ino``), and then only size and mtime count.
    """

    size: int
    mtime_ns: int
    src_ino: int


@dataclass(frozen=True, slots=True)
class Listing:
    """One child of a directory as listed on the source: its name, lstat, and link target."""

    name: bytes
    st: os.stat_result
    target: bytes = b""


class Source(Protocol):
    """What the core needs from a source. All calls block; call them from threads."""

    root: bytes

    def lstat(self, rel: bytes) -> os.stat_result: ...

    def list_dir(self, rel: bytes) -> list[Listing]: ...

    def readlink(self, rel: bytes) -> bytes: ...

    def read_file(self, rel: bytes, use_src_ino: bool) -> tuple[bytes, Identity]: ...

    def statvfs(self) -> os.statvfs_result: ...


def identity_of(st: os.stat_result, use_src_ino: bool) -> Identity:
    return Identity(st.st_size, st.st_mtime_ns, st.st_ino if use_src_ino else 0)


class LocalSource:
    """A source that is a directory of the local VFS: a local disk, NFS, Lustre, sshfs...

    No call follows a symlink, so none reaches outside the root, whatever the tree became
    after the scan: a path is resolved one component at a time from a descriptor of the
    root (``openat`` of ``O_PATH`` descriptors with ``O_NOFOLLOW``; :meth:`_open_dir`), so
    a directory swapped for a symlink is refused, not followed (it was listed, stat'ed and read through before);
    files are opened with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO swapped in does not hang a
    thread), and the opened descriptor's real path (from /proc/self/fd, no round trip to
    the source) must still lie under the root's real path.
    """

    #: how often a file that changes while it is read is re-read before giving up
    CHANGE_RETRIES = 3
    #: fresh walks in a row not giving the exact path before directories are no longer kept
    INEXACT_LIMIT = 3

    def __init__(self, root: str | bytes) -> None:
        root_b = os.fsencode(root)
        self.root = os.path.realpath(root_b).rstrip(b"/") or b"/"
        if not os.path.isdir(self.root):
            raise NotFound(f"source is not a directory: {os.fsdecode(root_b)}")
        self._prefix = self.root if self.root.endswith(b"/") else self.root + b"/"
        self._dirs = DirDescriptors()  # directories walked lately (_open_file)
        self._exact_paths = True  # whether an opened file's /proc path is root + rel
        self._inexact = 0  # fresh walks in a row whose /proc path was not root + rel

    def full(self, rel: bytes) -> bytes:
        return self._prefix + rel if rel else self.root

    def _open_dir(self, parts: list[bytes], rel: bytes,
                  link_error: type[DlcError] = NotFound, listing: bool = False) -> int:
        """A descriptor of directory ``parts`` under the root, resolved one component at
        a time without following a symlink. NotFound when a component is gone, is no
        longer a directory or became a symlink after the scan (``openat`` with
        ``O_DIRECTORY | O_NOFOLLOW`` of a symlink is ENOTDIR; the namespace drops a
        directory that is NotFound and lists its parent again); ``link_error`` when the
        kernel says ELOOP.

        The descriptors are ``O_PATH`` (a lookup, no ``open`` of the directory: on a FUSE
        source such as sshfs a real open is an OPENDIR + RELEASEDIR round trip to the
        server, per component, per call), except the last one when ``listing`` (readdir
        needs an opened directory)."""
        walk = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(self.root, walk if parts or not listing
                         else os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            # the root itself gone (moved away, an automount lapsed): a source error, not
            # NotFound, so that nothing of the snapshot or the cache is dropped for it
            raise SourceError(f"the source root {os.fsdecode(self.root)} cannot be opened: "
                              f"{e.strerror}", e.errno) from e
        try:
            for i, name in enumerate(parts):
                last = listing and i == len(parts) - 1
                nfd = os.open(name, (os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                                     | os.O_CLOEXEC) if last else walk, dir_fd=fd)
                os.close(fd)
                fd = nfd
            return fd
        except (FileNotFoundError, NotADirectoryError) as e:
            os.close(fd)
            raise NotFound(f"no longer a directory on the source: {os.fsdecode(rel)}") from e
        except OSError as e:
            os.close(fd)
            if e.errno == errno.ELOOP:
                raise link_error(f"a directory became a symlink on the source: "
                                 f"{os.fsdecode(rel)}") from e
            raise SourceError(f"open {os.fsdecode(rel)}: {e.strerror}", e.errno) from e

    def _split(self, rel: bytes) -> tuple[list[bytes], bytes]:
        *dirs, name = rel.split(b"/")
        return dirs, name

    def lstat(self, rel: bytes) -> os.stat_result:
        if not rel:
            try:
                return os.lstat(self.root)
            except FileNotFoundError as e:
                raise NotFound(f"the source root is gone: {os.fsdecode(self.root)}") from e
            except OSError as e:
                raise SourceError(f"lstat {os.fsdecode(self.root)}: {e.strerror}",
                                  e.errno) from e
        return self._at(rel, "lstat",
                        lambda name, dfd: os.stat(name, dir_fd=dfd, follow_symlinks=False))

    def readlink(self, rel: bytes) -> bytes:
        """The target of symlink ``rel`` (as stored; never resolved)."""
        return self._at(rel, "readlink", lambda name, dfd: os.readlink(name, dir_fd=dfd))

    def _at(self, rel: bytes, what: str, fn: Callable[[bytes, int], T]) -> T:
        """``fn(name, parent_fd)`` for the last component of ``rel``, its parent walked
        beneath the root (:meth:`_open_dir`); errors mapped as every call here maps them."""
        dirs, name = self._split(rel)
        dfd = self._open_dir(dirs, rel)
        try:
            return fn(name, dfd)
        except FileNotFoundError as e:
            raise NotFound(f"vanished from the source: {os.fsdecode(rel)}") from e
        except OSError as e:
            raise SourceError(f"{what} {os.fsdecode(rel)}: {e.strerror}", e.errno) from e
        finally:
            os.close(dfd)

    def list_dir(self, rel: bytes) -> list[Listing]:
        out: list[Listing] = []
        dfd = self._open_dir(rel.split(b"/") if rel else [], rel, listing=True)
        try:
            with os.scandir(dfd) as it:
                for de in it:
                    name = os.fsencode(de.name)
                    try:
                        st = de.stat(follow_symlinks=False)
                        target = (os.readlink(name, dir_fd=dfd)
                                  if stat_mod.S_ISLNK(st.st_mode) else b"")
                    except FileNotFoundError:
                        continue  # vanished between readdir and stat
                    out.append(Listing(name, st, target))
        except FileNotFoundError as e:
            raise NotFound(f"directory vanished from the source: {os.fsdecode(rel)}") from e
        except OSError as e:
            raise SourceError(f"list {os.fsdecode(rel)}: {e.strerror}", e.errno) from e
        finally:
            os.close(dfd)
        return out

    def _open_file(self, rel: bytes) -> int:
        """A read descriptor of regular-file path ``rel``, resolved beneath the root (see
        the class); its real path is checked to lie under the root.

        The parent directory's descriptor comes from :attr:`_dirs` when it was walked
        lately: a fetch opens one file after another in the same few directories, and a
        walk costs an ``openat`` and a ``close`` per component, each a GIL hand-off in a
        busy daemon. A file opened through a remembered directory must then have exactly
        the path asked for (``/proc/self/fd``): a directory renamed or swapped since it
        was walked gives another path (or no such file), and the file is opened again
        after a fresh walk. A source whose descriptors do not show the exact path
        (``INEXACT_LIMIT`` fresh walks in a row) stops remembering directories.

        A directory mounted over after it was walked is still the covered one through its
        kept descriptor for up to ``DirDescriptors.TTL_S`` plus the sweep's period (a few
        seconds): the window a network filesystem's own directory cache has too."""
        dirs, name = self._split(rel)
        if not self._exact_paths:
            return self._open_walked(dirs, name, rel)
        key = b"/".join(dirs)
        held = self._dirs.take(key)
        while True:
            fresh = held is None
            if held is None:
                held = self._dirs.put(key, self._open_dir(dirs, rel, link_error=SourceChanged))
            try:
                fd = self._open_in(held.fd, name, rel)
            except DlcError:
                self._dirs.give_back(held)
                if fresh:
                    raise
                self._dirs.forget(key, held)  # the directory may have moved: walk again
                held = None
                continue
            self._dirs.give_back(held)
            real = _fd_path(fd)
            if real == self._prefix + rel:
                self._inexact = 0
                return fd
            os.close(fd)
            if not fresh:  # a remembered directory that moved since: walk again
                self._dirs.forget(key, held)
                held = None
                continue
            if not real.startswith(self._prefix):
                raise OutsideSource(f"resolves outside the source root: {os.fsdecode(rel)}")
            # a fresh walk that does not give the exact path: a rename racing the walk,
            # or a root whose descriptors never show it (then, after a few in a row,
            # remember nothing from now on and check only the root's prefix, as before
            # descriptors were kept)
            self._inexact += 1
            if self._inexact >= self.INEXACT_LIMIT:
                self._exact_paths = False
                self._dirs.clear()
            return self._open_walked(dirs, name, rel)

    def _open_walked(self, dirs: list[bytes], name: bytes, rel: bytes) -> int:
        """``rel`` opened after a fresh walk, its real path checked against the root's."""
        dfd = self._open_dir(dirs, rel, link_error=SourceChanged)
        try:
            fd = self._open_in(dfd, name, rel)
        finally:
            os.close(dfd)
        if not _fd_path(fd).startswith(self._prefix):
            os.close(fd)
            raise OutsideSource(f"resolves outside the source root: {os.fsdecode(rel)}")
        return fd

    @staticmethod
    def _open_in(dfd: int, name: bytes, rel: bytes) -> int:
        try:
            return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                           dir_fd=dfd)
        except FileNotFoundError as e:
            raise NotFound(f"vanished from the source: {os.fsdecode(rel)}") from e
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise SourceChanged(f"became a symlink on the source: {os.fsdecode(rel)}") from e
            raise SourceError(f"open {os.fsdecode(rel)}: {e.strerror}", e.errno) from e

    def read_file(self, rel: bytes, use_src_ino: bool) -> tuple[bytes, Identity]:
        """Read a whole regular file as one consistent version.

        The identity is taken with fstat before and after the read; if it moved, or the
        byte count disagrees with the size, the read is repeated, and after
        ``CHANGE_RETRIES`` attempts :class:`SourceChanged` is raised: bytes of two versions
        are never returned.
        """
        for _ in range(self.CHANGE_RETRIES):
            fd = self._open_file(rel)
            try:
                st1 = os.fstat(fd)
                if not stat_mod.S_ISREG(st1.st_mode):
                    raise SourceChanged(f"no longer a regular file: {os.fsdecode(rel)}")
                # O_NONBLOCK was for the open only (a FIFO swapped in): Lustre honours it
                # on reads of a regular file too (EAGAIN under another client's lock)
                _blocking(fd)
                data = _read_all(fd, st1.st_size)
                st2 = os.fstat(fd)
            except OSError as e:
                raise SourceError(f"read {os.fsdecode(rel)}: {e.strerror}", e.errno) from e
            finally:
                os.close(fd)
            id1, id2 = identity_of(st1, use_src_ino), identity_of(st2, use_src_ino)
            if id1 == id2 and len(data) == id1.size:
                return data, id1
        raise SourceChanged(f"kept changing while read: {os.fsdecode(rel)}")

    def statvfs(self) -> os.statvfs_result:
        return os.statvfs(self.root)

    def get_xattr(self, rel: bytes, name: str, use_src_ino: bool
                  ) -> tuple[bytes | None, Identity]:
        """Extended attribute ``name`` of regular file ``rel`` (resolved as
        :meth:`read_file` resolves it; None when the file has no such attribute or the
        filesystem has none), and the identity of the file it was read from."""
        fd = self._open_file(rel)
        try:
            ident = identity_of(os.fstat(fd), use_src_ino)
            try:
                return os.getxattr(fd, name), ident
            except OSError as e:
                if e.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ERANGE,
                               errno.E2BIG):
                    return None, ident
                raise
        except OSError as e:
            raise SourceError(f"getxattr {os.fsdecode(rel)}: {e.strerror}", e.errno) from e
        finally:
            os.close(fd)

    def drop_idle(self) -> int:
        """Close the remembered directory descriptors that have expired (see
        :class:`DirDescriptors`); how many are still held."""
        return self._dirs.drop_expired()


def _blocking(fd: int) -> None:
    """Clear ``O_NONBLOCK`` in one call (``os.set_blocking`` reads the flags first: two;
    the only other status flags F_SETFL changes, O_APPEND/O_ASYNC/O_DIRECT/O_NOATIME,
    are never set on a source descriptor)."""
    fcntl.fcntl(fd, fcntl.F_SETFL, 0)


def _read_all(fd: int, size: int) -> bytes:
    """Read to EOF, expecting ``size`` bytes; one extra byte detects a file that grew.

    One ``read`` into the bytes object returned (a regular file gives all of it at once,
    FUSE sources such as sshfs included); the pieces are joined only after a short read
    (no zeroed buffer to fill and copy out: the copy would hold the GIL)."""
    data = os.read(fd, size + 1)
    if not data or len(data) > size:
        return data
    parts = [data]
    got = len(data)
    while got <= size:
        more = os.read(fd, size + 1 - got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return data if len(parts) == 1 else b"".join(parts)


def open_for_range_reads(src: LocalSource, rel: bytes, use_src_ino: bool) -> tuple[int, Identity]:
    """Open a (large, uncached) file for ranged reads; same symlink rule as read_file."""
    fd = src._open_file(rel)
    try:
        st = os.fstat(fd)
        if not stat_mod.S_ISREG(st.st_mode):
            raise SourceChanged(f"no longer a regular file: {os.fsdecode(rel)}")
        _blocking(fd)  # (see read_file)
        return fd, identity_of(st, use_src_ino)
    except BaseException:
        os.close(fd)
        raise


def pread_checked(fd: int, offset: int, size: int, expect: Identity, use_src_ino: bool) -> bytes:
    """A ranged read that refuses to return bytes of another version than ``expect``."""
    try:
        data = os.pread(fd, size, offset)
        now = identity_of(os.fstat(fd), use_src_ino)
    except OSError as e:
        raise SourceError(f"read: {e.strerror}", e.errno) from e
    if now != expect:
        raise SourceChanged("the file changed on the source while it was open")
    return data


def _fd_path(fd: int) -> bytes:
    """The path the kernel has for descriptor ``fd`` (no round trip to the source); a
    descriptor it cannot name is closed and reported as a source error."""
    try:
        return os.readlink(b"/proc/self/fd/%d" % fd)
    except OSError as e:
        os.close(fd)
        raise SourceError(f"cannot name an opened source file: {e.strerror}", e.errno) from e


@dataclass(slots=True)
class _Dir:
    fd: int
    born: float
    users: int = 0
    dead: bool = False  # no longer handed out; closed by its last user


class DirDescriptors:
    """``O_PATH`` descriptors of the directories walked lately, by relative path, for
    :meth:`LocalSource._open_file`: at most ``MAX`` (least recently used go), each for
    ``TTL_S`` (a directory renamed away on a network source is walked again at least
    that often, whatever the client's caches say).

    Concurrency: called from the source's worker threads; one lock for the table, never
    held across a call to the source. A descriptor handed out (:meth:`take`, :meth:`put`)
    stays open until :meth:`give_back`: one dropped meanwhile is closed by its last user,
    so no thread ever uses a number that was closed (and maybe reused)."""

    MAX = 64
    TTL_S = 2.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dirs: OrderedDict[bytes, _Dir] = OrderedDict()

    def take(self, key: bytes) -> _Dir | None:
        """The descriptor of ``key`` if one is fresh, handed out (give it back)."""
        with self._lock:
            d = self._dirs.get(key)
            if d is None:
                return None
            if time.monotonic() - d.born > self.TTL_S:
                self._drop(key, d)
                return None
            self._dirs.move_to_end(key)
            d.users += 1
            return d

    def put(self, key: bytes, fd: int) -> _Dir:
        """Remember a freshly walked descriptor of ``key``, handed out (give it back)."""
        d = _Dir(fd, time.monotonic(), users=1)
        with self._lock:
            old = self._dirs.get(key)
            if old is not None:
                self._drop(key, old)
            self._dirs[key] = d
            while len(self._dirs) > self.MAX:
                k, v = next(iter(self._dirs.items()))
                self._drop(k, v)
        return d

    def give_back(self, d: _Dir) -> None:
        with self._lock:
            d.users -= 1
            if d.dead and not d.users:
                os.close(d.fd)

    def forget(self, key: bytes, d: _Dir) -> None:
        """``d`` is no longer handed out (its directory may have moved)."""
        with self._lock:
            if self._dirs.get(key) is d:
                self._drop(key, d)

    def clear(self) -> None:
        with self._lock:
            for k, d in list(self._dirs.items()):
                self._drop(k, d)

    def drop_expired(self) -> int:
        """Let go of the descriptors older than ``TTL_S`` (an idle source then holds
        none: nothing pins its directories, an automounter may unmount it); how many
        are left. Cheap: safe to call from the trio loop (O_PATH closes, no source call)."""
        now = time.monotonic()
        with self._lock:
            for k, d in [(k, d) for k, d in self._dirs.items() if now - d.born > self.TTL_S]:
                self._drop(k, d)
            return len(self._dirs)

    def _drop(self, key: bytes, d: _Dir) -> None:  # lock held
        del self._dirs[key]
        d.dead = True
        if not d.users:
            os.close(d.fd)
