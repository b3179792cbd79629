"""The cache as another process sees it: read-only, for a training's zero-copy reader
and for a shared root's other datasets (dedup): the index (:class:`IndexReader`) and the
log files (:class:`LogFiles`).

The daemon stays the only writer of a cache directory (DESIGN.md). A reader in the
training process (:mod:`dlcachefs.data`) opens the LMDB environment read-only, with
LMDB's lock table (``lock=True``: its read transactions are registered, so the daemon's
writer never reuses a page a reader still sees), and decides in ONE short read
transaction per sample what an ``open`` of the same path through the mount would decide:

1. the path is walked from the mount's root through the snapshot (``dirent``, ``inode``),
   component by component as the kernel walks it: ``..`` is the parent of the directory
   reached so far (after following links, not a textual parent), a symlink with a
   relative target is followed from its own directory (at most :data:`MAX_LINKS`). A
   symlink with an absolute target, a ``..`` above the root, a name not in the snapshot
   or anything that is not a regular file at the end is :data:`UNRESOLVED`: the kernel
   would resolve it outside this snapshot, so only the mount can answer for it;
2. the file's directory must be fresh under the mount's ``--revalidate`` rule
   (:mod:`dlcachefs.cache.namespace`: its listing younger than ``revalidate`` seconds,
   never with ``revalidate == 0``); otherwise :data:`STALE`, and the open through the
   mount re-lists it;
3. the file's ``record`` must exist (else :data:`NOT_CACHED`) and carry the entry's
   identity (size, mtime_ns, source inode; else :data:`STALE`);
4. permissions as the kernel checks them on the mount (it is mounted with
   ``default_permissions``, over the modes, owners and groups mirrored from the source):
   search (x) on every directory a name is looked up in, read (r) on the file, for the
   process's effective uid and groups (none for root, as CAP_DAC_OVERRIDE); a denial is
   :data:`DENIED`, so the mount answers (EACCES) as it would have. Without this, a file
   made unreadable on the source would stay readable from the cache.

The answer is a :class:`Located` (where the bytes are and their xxh3-64), or the reason.
The index reader reads no log: the bytes may be gone by the time the caller reads them
(an eviction commits between this transaction and the read), which is why the caller
reads them with :class:`LogFiles` and checks the checksum of what it reads (see
:mod:`dlcachefs.data.reader`).

Directory walks: the walk to a file's directory (``train/n01440764`` for every sample of
that class) is remembered in the process, keyed by the directory's path, the uid and the
groups, and tagged with the id of the LMDB snapshot it was made in (``txn.id()``: the
last transaction the daemon committed before it). It is used only in a transaction of the
same snapshot, in which it is exactly what a new walk would give; any commit of the daemon
makes every remembered walk stale (each is walked again at its next use). So a sample costs
three LMDB reads (its dirent, entry and record) instead of two per path component. This
matters past its CPU: py-lmdb lets go of the GIL around every read, and with several
reading threads each hand-off of the GIL is a wait (8 threads read ~2x faster with it).

Files located: :meth:`IndexReader.locate_path` remembers, the same way, where a file's
cached bytes are (the :class:`Located`), keyed by its path, the uid and the groups, tagged
with the snapshot, and used while its directory's listing is fresh (rule 2). A file
read again in the same snapshot (threads re-reading, a persistent DataLoader worker in a
later epoch while the daemon committed nothing) costs one LMDB transaction and no read
in it: the kernel's dentry cache does the same for the local copy it is compared with.
Only answers that serve from the cache are remembered (a miss goes through the mount,
which is slow anyway, and may be cached by the next snapshot). At most :data:`MAX_FILES`
per process (~450 bytes each: 7 MiB; a DataLoader worker is a process); past it, all are
forgotten, so over a dataset far larger than that, re-reads find little remembered.

Transactions stay short on purpose: LMDB cannot reuse a page freed after the oldest live
read transaction began, so a reader that held one open would make the daemon's index
grow. Blocking code; any thread (py-lmdb read transactions are per call here).
"""

from __future__ import annotations

import contextlib
import os
import stat
import struct
import threading
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import lmdb

from dlcachefs.store import schema as S
from dlcachefs.store.schema import Entry, Record, ukey, unkey

ROOT_INO = 1  # the namespace's root (dlcachefs.cache.namespace.ROOT_INO; store sits below cache)
#: symlinks followed in one path, as Linux's limit (ELOOP past it)
MAX_LINKS = 40
#: the daemon's map size (:class:`dlcachefs.store.index.Index`): address space only. A
#: smaller map would need reopening (MDB_MAP_RESIZED) once the daemon's file outgrows it.
MAP_SIZE = 1 << 36

#: version of the mount's description of its cache for readers (``.dlcache/zerocopy``)
INFO_FORMAT = 1

NOT_CACHED = "not_cached"
STALE = "stale"
UNRESOLVED = "unresolved"
DENIED = "denied"

_Q = struct.Struct("<Q")
#: mode, uid, gid of a packed :class:`~dlcachefs.store.schema.Entry` (from byte 8: mode,
#: nlink skipped, uid, gid)
_MODE_UID_GID = struct.Struct("<I4xII")
#: a packed entry's ``checked_at`` (the 13th field of :attr:`Entry._S`)
_CHECKED_AT = struct.Struct("<d")
_CHECKED_AT_OFF = struct.calcsize("<QIIIIQQQqqqQ")
_R, _X = 4, 1
_NO_GROUPS: frozenset[int] = frozenset()
#: last components that need the whole walk (they are not names in a directory)
_SPECIAL = frozenset((b"", b".", b".."))
#: directory walks remembered per process (:meth:`IndexReader._dir`); past it, forgotten
MAX_DIRS = 65536
#: files located remembered per process (:meth:`IndexReader.locate_path`); past it, forgotten
MAX_FILES = 16384


def _may(buf: bytes, want: int, uid: int, groups: frozenset[int]) -> bool:
    """Whether a process with ``uid`` and ``groups`` has the ``want`` bit (4 read, 1
    search) on the entry packed in ``buf``: the owner's bits if it owns it, else the
    group's if it is in the group, else the others' (generic_permission, without ACLs:
    the mount has none)."""
    mode, owner, group = _MODE_UID_GID.unpack_from(buf, 8)
    if uid == owner:
        bits = mode >> 6
    elif group in groups:
        bits = mode >> 3
    else:
        bits = mode
    return bool(bits & want)


class Located(NamedTuple):
    """Where the cached bytes of a file's current version are: ``size`` bytes at
    ``offset`` of log ``log_id``, whose xxh3-64 must be ``data_xxh``. (A named tuple:
    made once per zero-copy read, where a frozen dataclass costs a microsecond.)"""

    ino: int
    log_id: int
    offset: int
    size: int
    data_xxh: int
    #: the version's modification time (with ``size``, what a descriptor opened on the
    #: mount later is checked against: the same version or none)
    mtime_ns: int = 0


class IndexReader:
    """A cache's LMDB environment opened read-only in this process.

    py-lmdb refuses a second environment on the same path in one process, and LMDB's
    environments must not be used across ``fork()``: the caller keeps one per process
    (:mod:`dlcachefs.data.reader`)."""

    def __init__(self, index_dir: str) -> None:
        self.path = index_dir
        self.file_id = _file_id(index_dir)
        #: (directory path, uid, groups) -> (snapshot id, the walk's end): see the module doc
        self._dirs: dict[tuple[bytes, int, frozenset[int]],
                         tuple[int, tuple[int, bytes] | str]] = {}
        #: (path, uid, groups) -> (snapshot id, where, its directory's checked_at): see
        #: the module doc
        self._files: dict[tuple[bytes, int, frozenset[int]], tuple[int, Located, float]] = {}
        self.env = lmdb.open(index_dir, readonly=True, lock=True, subdir=True, create=False,
                             max_dbs=8, readahead=False, map_size=MAP_SIZE,
                             max_readers=S.MAX_READERS)
        try:
            self.meta = self.env.open_db(S.DB_META, create=False)
            self.inode = self.env.open_db(S.DB_INODE, create=False)
            self.dirent = self.env.open_db(S.DB_DIRENT, create=False)
            self.record = self.env.open_db(S.DB_RECORD, create=False)
            self.ckey = self.content = None  # an index no daemon of this build opened yet
            self.open_content()
            with self.env.begin(buffers=False) as txn:
                fmt = txn.get(S.K_FORMAT, db=self.meta)
            if fmt is None or _Q.unpack(fmt)[0] != S.SCHEMA_VERSION:
                raise lmdb.Error(f"cache index {index_dir} has schema "
                                 f"{fmt and _Q.unpack(fmt)[0]}, this reader knows "
                                 f"{S.SCHEMA_VERSION}")
        except BaseException:
            self.env.close()
            raise

    def open_content(self) -> bool:
        """Open the content-key databases (dedup) if the daemon has made them; whether
        they are open."""
        if self.content is None:
            try:
                self.ckey = self.env.open_db(S.DB_CKEY, create=False)
                self.content = self.env.open_db(S.DB_CONTENT, create=False)
            except lmdb.NotFoundError:
                return False
        return True

    def by_content(self, sha256: bytes) -> Located | None:
        """Where this cache holds bytes whose SHA-256 is ``sha256``: the ``content``
        entry's inode, whose key must be that digest and whose record must have the key's
        version (then the record's bytes are the ones the daemon hashed; the caller still
        checks the xxh3 of what it reads). None when it holds none."""
        if self.content is None:
            return None
        with self.env.begin(buffers=False) as txn:
            v = txn.get(sha256, db=self.content)
            if v is None:
                return None
            k, rb = txn.get(v, db=self.ckey), txn.get(v, db=self.record)
        if k is None or rb is None:
            return None
        key, rec = S.ContentKey.unpack(k), Record.unpack(rb)
        if key.sha256 != sha256 or not key.same_version(rec):
            return None
        return Located(unkey(v), rec.log_id, rec.offset, rec.size, rec.data_xxh)

    def replaced(self) -> bool:
        """True when the index file at the path is no longer the one opened (the cache
        directory was removed and made again): the caller opens it anew."""
        try:
            return _file_id(self.path) != self.file_id
        except OSError:
            return True

    def locate(self, parts: Sequence[bytes], revalidate: float, now: float) -> Located | str:
        """The cached bytes of the file at ``parts`` (path components from the mount's
        root), or why they cannot be served from the cache (:data:`NOT_CACHED`,
        :data:`STALE`, :data:`UNRESOLVED`, :data:`DENIED`). See the module doc for the
        rules.

        The walk to the file's directory is remembered per snapshot (see "Directory
        walks" in the module doc): a sample usually costs three LMDB reads, its dirent,
        its entry and its record."""
        uid, groups, check = _who()
        with self.env.begin(buffers=False) as txn:
            got = self._locate(txn, parts, uid, groups, check, revalidate, now)
        return got if isinstance(got, str) else got[0]

    def locate_path(self, rel: bytes, revalidate: float, now: float) -> Located | str:
        """:meth:`locate` of ``rel``, the path from the mount's root (``/``-separated
        components), with the answer remembered when it serves from the cache (see
        "Files located" in the module doc): the same answer as :meth:`locate`, always."""
        uid, groups, check = _who()
        key = (rel, uid, groups)
        with self.env.begin(buffers=False) as txn:
            snap = txn.id()
            hit = self._files.get(key)
            # (the freshness rule of _file, for the directory listed at hit[2])
            if hit is not None and hit[0] == snap and revalidate > 0 and (
                    now - hit[2] <= revalidate):
                return hit[1]
            got = self._locate(txn, rel.split(b"/"), uid, groups, check, revalidate, now)
        if isinstance(got, str):
            return got
        if len(self._files) >= MAX_FILES:
            self._files.clear()
        self._files[key] = (snap, *got)  # (a dict store: atomic under the GIL)
        return got[0]

    def _locate(self, txn: lmdb.Transaction, parts: Sequence[bytes], uid: int,
                groups: frozenset[int], check: bool, revalidate: float,
                now: float) -> tuple[Located, float] | str:
        """:meth:`locate` in ``txn``: where, and when the file's directory was listed;
        or why not."""
        name = parts[-1] if parts else b""
        dir_ino: int | None = None
        dir_buf: bytes | None = None
        if len(parts) < 2 or name in _SPECIAL:
            got = self._walk(txn, parts, uid, groups, check)
        else:
            d = self._dir(txn, parts, uid, groups, check)
            if isinstance(d, str):
                return d
            dir_ino, dir_buf = d
            if check and not _may(dir_buf, _X, uid, groups):
                return DENIED
            v = txn.get(ukey(dir_ino) + name, db=self.dirent)
            b = txn.get(v, db=self.inode) if v is not None else None
            if b is None:
                return UNRESOLVED
            if stat.S_ISLNK(_MODE_UID_GID.unpack_from(b, 8)[0]):
                got = self._walk(txn, parts, uid, groups, check)  # followed from the root
            else:
                got = (unkey(v), b)
        if isinstance(got, str):
            return got
        return self._file(txn, *got, dir_ino, dir_buf, uid, groups, check, revalidate, now)

    def _dir(self, txn: lmdb.Transaction, parts: Sequence[bytes], uid: int,
             groups: frozenset[int], check: bool) -> tuple[int, bytes] | str:
        """The directory the last component of ``parts`` is looked up in (its inode and
        packed entry; the search checks on the way made), or why the walk stops: the
        walk of ``parts[:-1]``, remembered for this snapshot."""
        key = (b"/".join(parts[:-1]), uid, groups)
        snap = txn.id()
        hit = self._dirs.get(key)
        if hit is not None and hit[0] == snap:
            return hit[1]
        got = self._walk(txn, parts[:-1], uid, groups, check)
        if not isinstance(got, str):
            cur, buf = got
            if buf is None:  # reached by "..": its entry is read here
                buf = txn.get(ukey(cur), db=self.inode)
            if buf is None or not stat.S_ISDIR(_MODE_UID_GID.unpack_from(buf, 8)[0]):
                got = UNRESOLVED  # "file/name": the kernel says ENOTDIR
            else:
                got = (cur, buf)
        if len(self._dirs) >= MAX_DIRS:
            self._dirs.clear()
        self._dirs[key] = (snap, got)  # (a dict store: atomic under the GIL)
        return got

    def _walk(self, txn: lmdb.Transaction, parts: Sequence[bytes], uid: int,
              groups: frozenset[int], check: bool) -> tuple[int, bytes | None] | str:
        """Walk ``parts`` from the root as the kernel does (rule 1 of the module doc):
        ``(inode, packed entry or None)`` where it ends (None: reached by ``..`` or the
        root itself), or why it stops."""
        dget = txn.cursor(db=self.dirent).get
        iget = txn.cursor(db=self.inode).get
        todo = list(reversed(parts))
        cur, buf, links = ROOT_INO, None, 0
        while todo:
            name = todo.pop()
            if name == b"":
                continue
            if check:  # every lookup, "." and ".." too, needs x on the directory
                d = buf if buf is not None else iget(ukey(cur))
                if d is None:
                    return UNRESOLVED
                if not _may(d, _X, uid, groups):
                    return DENIED
            if name == b".":
                continue
            if name == b"..":
                if cur == ROOT_INO:
                    return UNRESOLVED  # above the mount: outside this snapshot
                b = iget(ukey(cur))
                if b is None:
                    return UNRESOLVED
                cur, buf = Entry.unpack(cur, b).parent, None
                continue
            v = dget(ukey(cur) + name)
            b = iget(v) if v is not None else None
            if b is None:
                return UNRESOLVED
            mode, _ = Entry.MODE_SIZE(b)
            if stat.S_ISLNK(mode):
                links += 1
                target = Entry.unpack(unkey(v), b).target
                if links > MAX_LINKS or not target or target.startswith(b"/"):
                    return UNRESOLVED
                todo.extend(reversed(target.split(b"/")))  # from the link's directory
                continue
            if todo and not stat.S_ISDIR(mode):
                return UNRESOLVED  # "file/..." : the kernel says ENOTDIR
            cur, buf = unkey(v), b
        return cur, buf

    def _file(self, txn: lmdb.Transaction, ino: int, buf: bytes | None, dir_ino: int | None,
              dir_buf: bytes | None, uid: int, groups: frozenset[int], check: bool,
              revalidate: float, now: float) -> tuple[Located, float] | str:
        """Rules 2-4 of the module doc for the entry the walk reached (``dir_ino`` and
        ``dir_buf``: the directory it was looked up in, when known): where, and when the
        directory was listed (its ``checked_at``)."""
        if buf is None:
            return UNRESOLVED  # the root, or a directory reached by ".."
        (parent, mode, _nlink, _uid, _gid, size, _blocks, _rdev, _at, mtime_ns, _ct, src_ino,
         _chk, _nl, _tl) = Entry._S.unpack_from(buf)
        if not stat.S_ISREG(mode):
            return UNRESOLVED
        if check and not _may(buf, _R, uid, groups):
            return DENIED
        pb = dir_buf if parent == dir_ino else txn.get(ukey(parent), db=self.inode)
        if pb is None:
            return UNRESOLVED
        checked_at = _CHECKED_AT.unpack_from(pb, _CHECKED_AT_OFF)[0]
        if revalidate <= 0 or now - checked_at > revalidate:
            return STALE
        rb = txn.get(ukey(ino), db=self.record)
        if rb is None:
            return NOT_CACHED
        _chunk, log_id, offset, rsize, data_xxh, rmtime, rsrc = Record._S.unpack(rb)
        if (rsize, rmtime, rsrc) != (size, mtime_ns, src_ino):
            return STALE
        return Located(ino, log_id, offset, rsize, data_xxh, rmtime), checked_at

    def close(self) -> None:
        self.env.close()


def _who() -> tuple[int, frozenset[int], bool]:
    """This process's effective uid and groups, and whether permissions are checked for
    it (not for root: CAP_DAC_OVERRIDE)."""
    uid = os.geteuid()
    if uid == 0:
        return uid, _NO_GROUPS, False
    return uid, frozenset((os.getegid(), *os.getgroups())), True


def _file_id(index_dir: str) -> tuple[int, int]:
    st = os.stat(os.path.join(index_dir, "data.mdb"))
    return st.st_dev, st.st_ino


# ----- the logs, read-only -----------------------------------------------------------------

#: log descriptors kept open per process before unused ones are closed
MAX_FDS = 256
#: Linux returns at most this many bytes per read(2)/pread(2) (MAX_RW_COUNT)
MAX_RW = 0x7FFFF000

#: the read of a record's bytes (a seam for tests: evict between lookup and read)
_pread = os.pread


class LogFiles:
    """Read-only descriptors of one cache's log files, shared by the threads of a process.

    Protocol (``_lock`` guards both tables): a descriptor is taken (``users`` + 1) for
    one ``pread`` and given back. :meth:`sweep` retires descriptors of deleted logs
    (``st_nlink == 0``): a retired one leaves ``_fds`` at once (the next read of that log
    opens the file anew, or finds it gone) and is closed when its last user gives it
    back, so a descriptor number is never closed, and reused by another ``open``, under
    a ``pread``."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self._lock = threading.Lock()
        self._fds: dict[int, list[int]] = {}  # log id -> [fd, users, retired]
        self._busy: list[list[int]] = []  # retired while in use: closed by their last user

    @contextlib.contextmanager
    def _held(self, log_id: int) -> Iterator[int]:
        """The log's descriptor (opened at its first use; FileNotFoundError: the log is
        gone), taken for one call and given back (see the class doc)."""
        with self._lock:
            slot = self._fds.get(log_id)
            if slot is None:
                fd = os.open(os.path.join(self.dir, f"{log_id:08d}.log"),
                             os.O_RDONLY | os.O_CLOEXEC)  # FileNotFoundError: gone
                slot = self._fds[log_id] = [fd, 0, 0]
            slot[1] += 1
        try:
            yield slot[0]
        finally:
            with self._lock:
                slot[1] -= 1
                if slot[2] and slot[1] == 0:
                    self._busy.remove(slot)
                    _close(slot[0])

    def pread(self, log_id: int, size: int, offset: int) -> bytes:
        with self._held(log_id) as fd:
            if size <= MAX_RW:
                return _pread(fd, size, offset)
            return _pread_all(fd, size, offset)

    def advise(self, log_id: int, offset: int, length: int) -> None:
        """Ask the kernel to read a range of a log into the page cache, in the background
        (``POSIX_FADV_WILLNEED``: :mod:`dlcachefs.store.advice`). OSError when the log is
        gone."""
        with self._held(log_id) as fd:
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)

    def sweep(self, everything: bool = False) -> None:
        """Retire descriptors of deleted logs (every one with ``everything``; every
        one when more than :data:`MAX_FDS` are open)."""
        with self._lock:
            everything = everything or len(self._fds) > MAX_FDS
            for log_id, slot in list(self._fds.items()):
                try:
                    gone = everything or os.fstat(slot[0]).st_nlink == 0
                except OSError:
                    gone = True
                if gone:
                    del self._fds[log_id]
                    slot[2] = 1
                    if slot[1]:
                        self._busy.append(slot)
                    else:
                        _close(slot[0])

    def abandon(self) -> None:
        """In a forked child: close the copies it inherited (no lock: the forking thread
        is the only one, and a lock held by another thread at fork stays held)."""
        for slot in [*self._fds.values(), *self._busy]:
            _close(slot[0])
        self._fds, self._busy = {}, []

    def open_count(self) -> int:
        """Descriptors open now (tests)."""
        with self._lock:
            return len(self._fds) + len(self._busy)


def _pread_all(fd: int, size: int, offset: int) -> bytes:
    """``size`` bytes at ``offset`` in several ``pread`` calls (a record of 2 GiB or more:
    one call returns at most :data:`MAX_RW`); short at the file's end, like one call."""
    out = bytearray()
    while len(out) < size:
        piece = _pread(fd, min(size - len(out), MAX_RW), offset + len(out))
        if not piece:
            break
        out += piece
    return bytes(out)


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
