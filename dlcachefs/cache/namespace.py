"""The namespace: the source tree as a persistent snapshot in LMDB.

The tree is listed once (threads, one ``scandir`` per directory) and kept in the index,
so a remount of an unchanged source lists nothing, and ``ls``/``find``/``stat`` are served
without touching the source. Inode numbers are ours, stable across remounts (a path keeps
its inode as long as it exists on the source).

Freshness rule (``--revalidate SECONDS``, documented in docs/freshness.md):

* A directory's listing, and the attributes of its children, are as fresh as the
  directory's ``checked_at``. When an ``opendir`` or an ``open`` of one of its files finds
  it older than ``revalidate`` seconds, the directory is listed again (one ``scandir`` for
  all its children: on NFS/sshfs the attributes come with the listing) and merged.
* With ``revalidate == 0`` every ``open`` of a file ``lstat``s that file on the source,
  and every ``opendir`` re-lists the directory.
* A lookup of a name the snapshot does not hold re-lists its directory first when the
  listing is older than ``revalidate``, at most once a second per directory (a listing
  under way is joined): a file or directory added on the source is found by its path,
  not only after an ``ls`` of its directory.
* ``--rescan`` re-lists the whole tree at mount time.
* A source root that lists empty (or cannot be listed) while the snapshot's root holds
  entries is a fault of the source (an NFS automount that lapsed, a mount that went away
  underneath), not a dataset deleted: nothing is dropped for it, neither the root's
  entries nor a directory found missing meanwhile, and the call fails with EIO
  (:class:`SourceRootFault`) until the root lists again. A dataset really emptied is
  shown empty after ``--rescan``, or once its root lists again.

A change found this way updates the snapshot (same inode for the same path and type),
and the engine never serves cached bytes whose identity differs from the entry's.

Concurrency: reads of the snapshot run on the trio loop (LMDB read txns); listings and
stats of the source run in worker threads through the one source wrapper
(:class:`~dlcachefs.cache.fetch.SourceCalls`: limiter, timeout, retries, counters), and
every write txn in a worker thread. The start-up scan (:meth:`Namespace.scan`) is
blocking and runs before the filesystem is served, with its own thread pool.
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import logging
import os
import stat as stat_mod
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import trio

from dlcachefs.cache.source import Identity, Listing, Source
from dlcachefs.errors import DlcError, IsADirectory, NotADirectory, NotFound, SourceError
from dlcachefs.store import schema as S
from dlcachefs.store.index import Index, IndexTxn
from dlcachefs.store.schema import Entry

if TYPE_CHECKING:  # fetch.py imports this module
    from dlcachefs.cache.fetch import SourceCalls

log = logging.getLogger(__name__)

#: a directory is listed again for a name it lacks at most this often (seconds), whatever
#: --revalidate says (Namespace.fresh_lookup)
MISSING_RELIST_S = 1.0
#: with --revalidate 0, a directory's own lstat at most this often (a path walk asks for
#: every directory of the path, LOOKUP and GETATTR, at every open)
DIR_ATTRS_MIN_S = 1.0

ROOT_INO = 1

#: inodes remembered as gone from the source (Namespace.gone)
MAX_GONE = 1 << 20
#: names at the root that the mount reserves for itself and hides from the mirror
RESERVED_ROOT_NAMES = frozenset({b".dlcache"})

#: a change notification for the kernel: (kind, parent ino, name or None, ino or None)
Invalidate = Callable[[str, int, bytes | None, int | None], None]

#: entries per write transaction during a full scan
SCAN_BATCH = 20_000

#: seconds between two warnings about a source root that lists empty
ROOT_FAULT_WARN_S = 60.0


class SourceRootFault(SourceError):
    """The source root lists empty or cannot be listed while the snapshot holds a tree."""

    def __init__(self, msg: str) -> None:
        super().__init__(msg, errno.EIO)


def entry_from_stat(ino: int, parent: int, name: bytes, st: os.stat_result, now: float,
                    target: bytes = b"", use_src_ino: bool = True) -> Entry:
    return Entry(
        ino=ino, parent=parent, name=name, mode=st.st_mode, nlink=st.st_nlink,
        uid=st.st_uid, gid=st.st_gid, size=st.st_size, blocks=st.st_blocks, rdev=st.st_rdev,
        atime_ns=st.st_atime_ns, mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns,
        src_ino=st.st_ino if use_src_ino else 0, checked_at=now, target=target,
    )


def _same_attrs(a: Entry, b: Entry) -> bool:
    """True when b shows nothing new compared with a (checked_at aside)."""
    return (a.mode, a.nlink, a.uid, a.gid, a.size, a.blocks, a.rdev, a.mtime_ns, a.ctime_ns,
            a.src_ino, a.target) == (b.mode, b.nlink, b.uid, b.gid, b.size, b.blocks, b.rdev,
                                     b.mtime_ns, b.ctime_ns, b.src_ino, b.target)


def _visible(listing: list[Listing]) -> bool:
    """Whether a root listing shows anything the mirror shows."""
    return any(item.name not in RESERVED_ROOT_NAMES for item in listing)


def _type(mode: int) -> int:
    return stat_mod.S_IFMT(mode)


def is_dir(e: Entry) -> bool:
    return stat_mod.S_ISDIR(e.mode)


def is_file(e: Entry) -> bool:
    return stat_mod.S_ISREG(e.mode)


def identity(e: Entry) -> Identity:
    return Identity(e.size, e.mtime_ns, e.src_ino)


class MergeResult:
    """What a directory merge changed, for kernel invalidation and record cleanup."""

    def __init__(self) -> None:
        self.added: list[tuple[bytes, int]] = []
        self.changed: list[int] = []
        self.removed: list[tuple[bytes, int]] = []
        self.subdirs: list[tuple[int, bytes]] = []  # (ino, rel path) of child directories

    def __bool__(self) -> bool:
        return bool(self.added or self.changed or self.removed)


def merge_listing(w: IndexTxn, dir_e: Entry, dir_rel: bytes, listing: list[Listing], now: float,
                  use_src_ino: bool) -> MergeResult:
    """Make the snapshot of one directory equal to a fresh listing (inside a write txn)."""
    res = MergeResult()
    old = dict(w.list_dir(dir_e.ino))
    for item in listing:
        if dir_e.ino == ROOT_INO and item.name in RESERVED_ROOT_NAMES:
            log.warning("source has %r at its root; it is hidden behind the mount's own",
                        item.name)
            continue
        ino = old.pop(item.name, None)
        prev = w.get_entry(ino) if ino is not None else None
        if prev is not None and _type(prev.mode) != _type(item.st.st_mode):
            for r in w.delete_tree(prev.ino):
                res.removed.append((b"", r))
            res.removed.append((item.name, prev.ino))
            ino, prev = None, None
        if ino is None:
            ino = w.alloc(S.K_NEXT_INO)
        # a directory's checked_at is its own listing's time: keep it until it is listed
        chk = prev.checked_at if (prev is not None and stat_mod.S_ISDIR(item.st.st_mode)) else (
            0.0 if stat_mod.S_ISDIR(item.st.st_mode) else now)
        e = entry_from_stat(ino, dir_e.ino, item.name, item.st, chk, item.target, use_src_ino)
        if prev is None:
            w.put_entry(e)
            res.added.append((item.name, ino))
        elif not _same_attrs(prev, e):
            w.put_entry(e)
            res.changed.append(ino)
        if stat_mod.S_ISDIR(item.st.st_mode):
            res.subdirs.append((ino, dir_rel + b"/" + item.name if dir_rel else item.name))
    for name, ino in old.items():
        for r in w.delete_tree(ino):
            if r != ino:  # (a removed directory's files: gone too, see Namespace.gone)
                res.removed.append((b"", r))
        res.removed.append((name, ino))
    dir_e.checked_at = now
    w.put_entry(dir_e)
    return res


class Namespace:
    """Lookups and listings from the snapshot; refreshes from the source under the rule above."""

    def __init__(self, index: Index, calls: SourceCalls, *, revalidate: float = 3600.0,
                 use_src_ino: bool = True,
                 on_removed: Callable[[list[int]], None] | None = None) -> None:
        """``on_removed(inos)`` hears of files found gone from the source (the read
        path's observers: :meth:`dlcachefs.cache.readers.OpenObserver.gone`)."""
        self.index = index
        self.calls = calls  # every source call of a revalidation goes through it
        self.source: Source = calls.source
        self.revalidate = revalidate
        self.use_src_ino = use_src_ino
        self.on_invalidate: Invalidate | None = None
        # inodes found gone from the source during this mount, most recent last (bounded:
        # MAX_GONE): an inode is never handed out again, so a stream whose epoch order
        # holds one never sees it opened (its open fails at LOOKUP) and passes it by
        # (the streams hear of it through on_removed)
        self.gone: OrderedDict[int, None] = OrderedDict()
        self.on_removed = on_removed
        # inodes of which the kernel may still hold attributes or pages of another
        # version than the current one (a change seen on the source during this mount,
        # or an older open's attributes answered): every open of them bypasses the
        # kernel's pages (direct_io) until the kernel has dropped what it held (the
        # mount layer's invalidation of the inode went through: kernel_told). Value:
        # the latest mark's number (a mark after an invalidation began outlives it).
        self.changed: dict[int, int] = {}
        self._marks = 0
        # how many entry changes were made during the mount (any entry): an open handle
        # that has seen none since it opened knows of no newer version
        # (Engine._same_version). Counted before each write's thread starts, so that a
        # READ on the loop meanwhile checks rather than skips.
        self.changes = 0
        self._dir_paths: OrderedDict[int, bytes] = OrderedDict()
        # directory -> (done, outcome) of the re-listing under way; outcome: [] while it
        # runs and when it was cancelled, [None] when it merged, [error] when it failed
        self._refreshing: dict[int, tuple[trio.Event, list[Exception | None]]] = {}
        # directory ino -> its checked_at, so that an open of a file checks its parent's
        # freshness without an LMDB read (each read on the loop also lets go of the GIL).
        # Written and dropped on the loop only; a directory's checked_at changes only in a
        # merge, and refresh_dir drops the entry after the merge's write transaction
        # returned: a value read before that commit was stored before the drop (the
        # loop runs one task at a time), so what stays is never older than the index.
        self._dir_checked: dict[int, float] = {}
        self._missing_relist: dict[int, float] = {}  # dir -> monotonic s of that re-list
        self._root_fault_warned = -ROOT_FAULT_WARN_S  # monotonic s of the last warning
        # monotonic s the root's own attributes were last taken from the source (no
        # listing holds the root: see fresh_dir_attrs)
        self._root_attrs_checked = -float("inf")
        # the source root's (st_dev, st_ino) at its first lstat of this mount: a root seen
        # as another directory later (an automount that lapsed shows the directory under
        # it) gives no attributes (see fresh_dir_attrs)
        self._root_id: tuple[int, int] | None = None
        self._dir_attrs_checked: dict[int, float] = {}  # --revalidate 0: dir -> monotonic s

    # ----- snapshot reads (trio loop) -----------------------------------------------

    def get(self, ino: int) -> Entry:
        e = self.index.get_entry(ino)
        if e is None:
            raise NotFound(f"no inode {ino}")
        return e

    def lookup(self, parent: int, name: bytes) -> Entry:
        ino = self.index.lookup(parent, name)
        if ino is None:
            raise NotFound(os.fsdecode(name))
        return self.get(ino)

    async def fresh_lookup(self, parent: int, name: bytes) -> Entry:
        """:meth:`lookup`, but a name not in the snapshot is looked for again in a fresh
        listing of ``parent`` when the snapshot's is stale (the freshness rule), at most
        once per ``MISSING_RELIST_S`` per directory even with ``revalidate == 0`` (a
        loop probing for absent side files must not list a large directory each time).
        A listing that fails leaves the answer to the snapshot: not found."""
        ino = self.index.lookup(parent, name)
        if ino is None:
            pe = self.get(parent)
            now = time.monotonic()
            last = self._missing_relist.get(parent, -MISSING_RELIST_S)
            # a listing under way is joined whatever the bound says: it may hold the name
            due = now - last >= MISSING_RELIST_S or parent in self._refreshing
            if is_dir(pe) and self._stale(pe) and due:
                if len(self._missing_relist) >= 100_000:
                    self._missing_relist.clear()  # bounded
                if parent not in self._refreshing:
                    self._missing_relist[parent] = now
                try:
                    await self.refresh_dir(parent)
                except DlcError as e:  # the source is down: the snapshot answers
                    log.info("listing %r for a missing name failed: %s", pe.name, e)
                    raise NotFound(os.fsdecode(name)) from None
                ino = self.index.lookup(parent, name)
            if ino is None:
                raise NotFound(os.fsdecode(name))
        return self.get(ino)

    def resolve(self, rel: bytes) -> Entry:
        """Entry for a relative path such as b"train/cls" (no '..', no symlinks followed)."""
        e = self.get(ROOT_INO)
        for part in (p for p in rel.split(b"/") if p and p != b"."):
            if not is_dir(e):
                raise NotADirectory(os.fsdecode(rel))
            e = self.lookup(e.ino, part)
        return e

    def children(self, ino: int) -> list[tuple[bytes, int]]:
        e = self.get(ino)
        if not is_dir(e):
            raise NotADirectory(os.fsdecode(e.name))
        return self.index.list_dir(ino)

    def size_of(self, ino: int) -> int:
        """The file's size in the snapshot (0 when it is not there)."""
        e = self.index.get_entry(ino)
        return e.size if e is not None else 0

    def path_of(self, e: Entry) -> bytes:
        """Relative source path of an entry (directory paths are cached, bounded)."""
        if e.ino == ROOT_INO:
            return b""
        parent = self._dir_path(e.parent)
        return parent + b"/" + e.name if parent else e.name

    def _dir_path(self, ino: int) -> bytes:
        if ino == ROOT_INO:
            return b""
        p = self._dir_paths.get(ino)
        if p is not None:
            self._dir_paths.move_to_end(ino)
            return p
        e = self.get(ino)
        p = self.path_of(e)
        self._dir_paths[ino] = p
        if len(self._dir_paths) > 100_000:
            self._dir_paths.popitem(last=False)
        return p

    # ----- freshness (trio loop, work in threads) -----------------------------------

    def _stale(self, e: Entry) -> bool:
        return self.revalidate == 0 or time.time() - e.checked_at > self.revalidate

    async def fresh_dir(self, ino: int) -> Entry:
        """The directory entry, re-listed from the source first if it is stale."""
        e = self.get(ino)
        if not is_dir(e):
            raise NotADirectory(os.fsdecode(e.name))
        if self._stale(e):
            await self.refresh_dir(ino)
            e = self.get(ino)
        return e

    async def fresh_file(self, ino: int) -> Entry:
        """The file entry, checked against the source first if the rule says so."""
        e = self.get(ino)
        if is_dir(e):
            raise IsADirectory(os.fsdecode(e.name))
        if self.revalidate == 0:
            return await self._restat(e)
        return await self._by_parent_listing(e)

    def file_if_fresh(self, ino: int) -> Entry | None:
        """What :meth:`fresh_file` would return without checking the source: the file's
        entry when its parent's listing is within ``revalidate``; None when that call
        would check first (or ``ino`` is not a file)."""
        if self.revalidate == 0:
            return None
        e = self.index.get_entry(ino)
        if e is None or is_dir(e) or time.time() - self._parent_checked(e) > self.revalidate:
            return None
        return e

    def _parent_checked(self, e: Entry) -> float:
        """When the listing of ``e``'s parent was last checked against the source."""
        checked = self._dir_checked.get(e.parent)
        if checked is None:
            checked = self.get(e.parent).checked_at
            if len(self._dir_checked) >= 100_000:
                self._dir_checked.clear()  # bounded; refilled from the index as needed
            self._dir_checked[e.parent] = checked
        return checked

    async def _by_parent_listing(self, e: Entry) -> Entry:
        """``e`` once its parent's listing (where its attributes come from) is within
        ``revalidate``: re-listed first when it is older."""
        if time.time() - self._parent_checked(e) > self.revalidate:
            await self.refresh_dir(e.parent)
            e = self.get(e.ino)  # NotFound if it vanished
        return e

    async def fresh_dir_attrs(self, ino: int) -> Entry:
        """The directory entry with its own attributes (mode, owner, times) as fresh as a
        file's are (:meth:`fresh_file`): they come with its parent's listing, so that is
        re-listed once older than ``revalidate``; with 0 the directory itself is
        ``lstat``-ed at every call. The root, which no listing holds, is ``lstat``-ed once
        per window (and at the first call of a mount). Its own listing's freshness
        (``checked_at``: what :meth:`fresh_dir` follows) is not touched. With
        ``default_permissions`` the kernel decides access from these attributes: a
        directory closed on the source must not stay open here."""
        e = self.get(ino)
        if not is_dir(e):
            raise NotADirectory(os.fsdecode(e.name))
        if ino == ROOT_INO:
            now = time.monotonic()
            if self.revalidate and now - self._root_attrs_checked <= self.revalidate:
                return e
            self._root_attrs_checked = now
            try:
                return await self._restat(e)
            except DlcError as err:  # the root's faults are the listing's to report
                log.info("the source root's attributes: %s (the snapshot's answer)", err)
                return e
        if self.revalidate == 0:
            now = time.monotonic()
            if now - self._dir_attrs_checked.get(ino, -DIR_ATTRS_MIN_S) < DIR_ATTRS_MIN_S:
                return e
            if len(self._dir_attrs_checked) >= 100_000:
                self._dir_attrs_checked.clear()  # bounded
            self._dir_attrs_checked[ino] = now
            return await self._restat(e)
        return await self._by_parent_listing(e)

    async def _restat(self, e: Entry) -> Entry:
        rel = self.path_of(e)
        root = e.ino == ROOT_INO
        try:
            st = await self.calls.call(self.source.lstat, rel)
        except NotFound:
            if not root:
                await self.refresh_dir(e.parent)
            raise
        if root:
            rid = (st.st_dev, st.st_ino)
            if self._root_id is None:
                self._root_id = rid
            elif rid != self._root_id:
                raise SourceError(f"the source root {os.fsdecode(self.source.root)} is "
                                  "another directory than at mount (an automount that "
                                  "lapsed?)", errno.EIO)
        # a directory's checked_at is its listing's time: an lstat does not list it
        new = entry_from_stat(e.ino, e.parent, e.name, st,
                              e.checked_at if is_dir(e) else time.time(), e.target,
                              self.use_src_ino)
        if _type(new.mode) != _type(e.mode):
            if root:
                raise SourceError(f"the source root {os.fsdecode(self.source.root)} is no "
                                  "longer a directory", errno.ENOTDIR)
            await self.refresh_dir(e.parent)
            return self.get(e.ino)
        if not _same_attrs(e, new):
            if stat_mod.S_ISLNK(new.mode):
                new.target = await self.calls.call(self.source.readlink, rel)
            self.changes += 1  # before the write: see __init__
            stored = await trio.to_thread.run_sync(self._put_if_current, new)
            if stored is None:  # a listing merged meanwhile changed or removed it
                return self.get(e.ino)
            self._notify("inode", e.parent, None, e.ino)
            return stored
        return new

    def _put_if_current(self, new: Entry) -> Entry | None:
        """Blocking (thread): store attributes an lstat found, unless the entry changed
        meanwhile (a listing merged while the lstat was under way removed it, gave its
        name another inode or type): then nothing, None. A directory keeps the newest
        listing time (``checked_at``)."""
        with self.index.write() as w:
            cur = w.get_entry(new.ino)
            if (cur is None or _type(cur.mode) != _type(new.mode)
                    or (cur.parent, cur.name) != (new.parent, new.name)
                    or (new.ino != ROOT_INO and w.lookup(new.parent, new.name) != new.ino)):
                return None
            if is_dir(cur):
                new.checked_at = cur.checked_at
            w.put_entry(new)
            return new

    def source_path(self, rel: bytes) -> bytes:
        root = self.source.root
        return root + b"/" + rel if rel else root

    def _put(self, e: Entry) -> None:
        with self.index.write() as w:
            w.put_entry(e)

    async def note_identity(self, e: Entry, ident: Identity) -> Entry:
        """A fetch or an open saw version ``ident`` of ``e`` (not the snapshot's):
        record it and tell the kernel; returns the new entry."""
        self.changes += 1  # before the write: see __init__
        new = await trio.to_thread.run_sync(self.update_identity, e, ident)
        self.changed_on_source(new)
        return new

    def update_identity(self, e: Entry, ident: Identity) -> Entry:
        """Blocking (thread): record an identity seen while fetching; returns the new entry."""
        new = dataclasses.replace(e, size=ident.size, mtime_ns=ident.mtime_ns,
                                  src_ino=ident.src_ino, checked_at=time.time())
        self._put(new)
        return new

    async def refresh_dir(self, ino: int) -> None:
        """Re-list one directory from the source and merge it (concurrent calls coalesce:
        they wait for the one under way, and fail as it failed: a caller must never go on
        with a listing that is due for revalidation as if it had been re-listed)."""
        running = self._refreshing.get(ino)
        if running is not None:
            await running[0].wait()
            if not running[1]:  # the leader was cancelled: re-list ourselves
                return await self.refresh_dir(ino)
            if running[1][0] is not None:
                raise copy.copy(running[1][0])  # its own traceback, not the leader's
            return
        ev, outcome = self._refreshing[ino] = (trio.Event(), [])
        try:
            e = self.get(ino)
            rel = self.path_of(e)
            try:
                listing = await self.calls.call(self.source.list_dir, rel)
            except NotFound:
                if ino != ROOT_INO:
                    await self._check_root(f"{os.fsdecode(rel)} is missing")
                    self.changes += 1  # before the write: see __init__
                    removed = await trio.to_thread.run_sync(self._delete, e)
                    self._dir_checked.clear()  # a subtree went: rare, start afresh
                    self._notify("entry", e.parent, e.name, e.ino)
                    self._note_gone(removed)
                raise
            if ino == ROOT_INO and not _visible(listing) and self.children(ROOT_INO):
                self._root_fault("it lists empty")
            self.changes += 1  # before the write (it may change entries): see __init__
            res = await trio.to_thread.run_sync(self._merge, e, rel, listing)
            self._dir_checked.pop(ino, None)  # after the commit: see __init__
            for _ino, _sub in res.subdirs:
                self._dir_checked.pop(_ino, None)
            for name, child in res.added + res.removed:
                if name:
                    self._notify("entry", ino, name, child)
            for child in res.changed:
                self._notify("inode", ino, None, child)
            for _name, child in res.removed:
                self._dir_paths.pop(child, None)
            if res.removed:
                self._note_gone([child for _name, child in res.removed])
        except Exception as err:
            outcome.append(err)
            raise
        else:
            outcome.append(None)
        finally:
            del self._refreshing[ino]
            ev.set()

    async def _check_root(self, why: str) -> None:
        """Before dropping a directory the source says is missing: SourceRootFault if the
        whole root looks gone (see the module docstring), else nothing."""
        if not self.children(ROOT_INO):
            return
        try:
            listing = await self.calls.call(self.source.list_dir, b"")
        except (NotFound, SourceError) as e:
            self._root_fault(f"{why} and the root cannot be listed ({e})")
        if not _visible(listing):
            self._root_fault(f"{why} and the root lists empty")

    def _root_fault(self, why: str) -> None:
        now = time.monotonic()
        if now - self._root_fault_warned >= ROOT_FAULT_WARN_S:
            self._root_fault_warned = now
            log.warning("the source root %s: %s; taken for a fault of the source (an "
                        "unmounted NFS or automount?): nothing of the snapshot or the cache "
                        "is dropped, and reads fail with EIO until it lists again (a dataset "
                        "really emptied: remount with --rescan)",
                        os.fsdecode(self.source.root), why)
        raise SourceRootFault(f"the source root {os.fsdecode(self.source.root)}: {why}")

    def _merge(self, e: Entry, rel: bytes, listing: list[Listing]) -> MergeResult:
        with self.index.write() as w:
            # (a copy of e: merge_listing sets its checked_at, and the index's memo may
            # hand the same object to others)
            cur = w.get_entry(e.ino) or dataclasses.replace(e)
            return merge_listing(w, cur, rel, listing, time.time(), self.use_src_ino)

    def _delete(self, e: Entry) -> list[int]:
        with self.index.write() as w:
            return w.delete_tree(e.ino)

    def _note_gone(self, inos: list[int]) -> None:
        """Inodes removed from the snapshot (gone from the source): remembered in
        :attr:`gone`, and told to ``on_removed``."""
        for ino in inos:
            self.gone[ino] = None
            self.gone.move_to_end(ino)
        while len(self.gone) > MAX_GONE:
            self.gone.popitem(last=False)
        if self.on_removed is not None:
            self.on_removed(inos)

    def note_kernel_behind(self, ino: int) -> None:
        """The kernel was given attributes of another version of ``ino`` than the
        current one (an older open's, held by the mount layer): its next open must not
        read through the kernel's pages, whose reads stop at the size the kernel holds
        (:attr:`changed`, the same rule as a change seen on the source)."""
        self._mark_changed(ino)

    def _mark_changed(self, ino: int) -> None:
        self._marks += 1
        self.changed[ino] = self._marks

    def kernel_told(self, ino: int, mark: int) -> None:
        """The kernel dropped its attributes and pages of ``ino`` (an invalidation that
        began when ``changed[ino]`` was ``mark`` went through, or the kernel did not
        know the inode): its opens may use the kernel's pages again, unless it was
        marked again since."""
        if self.changed.get(ino, mark + 1) <= mark:
            del self.changed[ino]

    def changed_on_source(self, e: Entry) -> None:
        """A fetch saw a newer version of ``e`` than the snapshot: tell the kernel."""
        self._notify("inode", e.parent, None, e.ino)

    def _notify(self, kind: str, parent: int, name: bytes | None, ino: int | None) -> None:
        if ino is not None:
            if kind == "inode":  # (a name added or removed: the kernel holds nothing of
                self._mark_changed(ino)  # a new inode, and a gone one opens no more)
            self.changes += 1
        if self.on_invalidate is not None:
            self.on_invalidate(kind, parent, name, ino)

    # ----- full scan (blocking; at mount time, before the filesystem is served) ------

    def has_snapshot(self) -> bool:
        return self.index.get_meta(S.K_SCAN_DONE) is not None

    def scan(self, threads: int = 16, progress: Callable[[int, int, float], None] | None = None
             ) -> tuple[int, int]:
        """List the whole source tree into the snapshot (merging into an existing one).

        Directories are listed by ``threads`` workers in parallel; merges happen on the
        calling thread in write transactions of up to ``SCAN_BATCH`` entries. Returns
        (entries, directories) seen. ``progress(entries, dirs, elapsed)`` is called about
        twice a second.
        """
        t0 = time.monotonic()
        now = time.time()
        root_st = self.source.lstat(b"")
        with self.index.write() as w:
            root = w.get_entry(ROOT_INO)
            new_root = entry_from_stat(ROOT_INO, 0, b"", root_st, root.checked_at if root else 0.0,
                                       use_src_ino=self.use_src_ino)
            w.put_entry(new_root)
            w.set_meta(S.K_SOURCE, self.source.root)
        n_entries, n_dirs = 0, 0
        last_report = 0.0
        # Bounded memory: at most 2 x threads listings in flight; directories found wait
        # in a queue (a million stat results held at once would cost ~1 GB).
        todo: deque[tuple[int, bytes]] = deque([(ROOT_INO, b"")])
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="scan") as pool:
            pending: dict[Future, tuple[int, bytes]] = {}
            batch: list[tuple[int, bytes, list[Listing]]] = []
            batch_size = 0
            while todo or pending or batch:
                while todo and len(pending) < 2 * threads:
                    ino, rel = todo.popleft()
                    pending[pool.submit(self.source.list_dir, rel)] = (ino, rel)
                done: set[Future] = set()
                if pending:
                    done, _ = wait(list(pending), timeout=0.5, return_when=FIRST_COMPLETED)
                for fut in done:
                    ino, rel = pending.pop(fut)
                    try:
                        listing = fut.result()
                    except NotFound:
                        continue  # vanished during the scan; its parent's next listing drops it
                    batch.append((ino, rel, listing))
                    batch_size += len(listing) + 1
                if batch and (batch_size >= SCAN_BATCH or not pending or not done
                              or not todo):
                    with self.index.write() as w:
                        for ino, rel, listing in batch:
                            d = w.get_entry(ino)
                            if d is None:
                                continue
                            res = merge_listing(w, d, rel, listing, now, self.use_src_ino)
                            n_entries += len(listing)
                            n_dirs += 1
                            todo.extend(res.subdirs)
                    batch, batch_size = [], 0
                if progress is not None and time.monotonic() - last_report > 0.5:
                    last_report = time.monotonic()
                    progress(n_entries, n_dirs, last_report - t0)
        with self.index.write() as w:
            w.set_meta(S.K_SCAN_DONE, str(time.time_ns()).encode())
        if progress is not None:
            progress(n_entries, n_dirs, time.monotonic() - t0)
        return n_entries, n_dirs
