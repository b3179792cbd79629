"""pyfuse3 ``Operations`` over the core :class:`~dlcachefs.cache.engine.Engine`.

Runs on the trio loop. Kernel caching: entries and attributes are cached for
``--revalidate`` seconds (the same window in which the core trusts its snapshot; a
LOOKUP or GETATTR of a file after that checks it as an open does), and
``keep_cache`` is set for files served from the cache, so the kernel keeps their pages.
The bytes an open holds in memory already are given to the page cache with the open
(``notify_store``, ``--store-pages``), so that no READ follows it.
FLUSH is answered once with ENOSYS, after which the kernel stops sending it.
"""

from __future__ import annotations

import errno
import logging
import os
import stat

import pyfuse3
import trio
from dlcachefs.mount import virtual as V
from dlcachefs.mount.errmap import fuse_errors

from dlcachefs.cache.namespace import ROOT_INO, identity
from dlcachefs.cache.source import Identity
from dlcachefs.errors import NotFound, PermissionDenied, ReadOnly
from dlcachefs.session import Session
from dlcachefs.store.schema import Entry

log = logging.getLogger(__name__)

#: the operations counted in ``fuse_ops``: every one the kernel may send a read-only
#: mount. ``lookup``, ``getattr``, ``open``, ``read`` and ``release`` count the mirror's
#: files only; those of ``.dlcache/`` (reading stats included) count under ``dlcache``, so
#: that watching the counters does not change them. Not seen here: requests libfuse
#: answers itself (FUSE_IOCTL, ENOSYS: Python's open() sends one per file, isatty's TCGETS)
OPS = ("lookup", "getattr", "setattr", "readlink", "forget", "opendir", "readdir",
       "releasedir", "open", "read", "write", "release", "flush", "fsync", "access",
       "statfs", "getxattr", "listxattr", "dlcache")


class _Held:
    """A file open here: per version open, its latest entry and its opens; and
    ``attrs``, the entry LOOKUP and GETATTR answer with: the oldest version still open,
    whose opens read the kernel's pages, bounded by the size the kernel holds (a newer
    version's opens bypass the pages: :meth:`Operations.open`)."""

    __slots__ = ("attrs", "versions")

    def __init__(self, e: Entry) -> None:
        self.attrs = e
        self.versions: dict[Identity, list] = {identity(e): [e, 1]}  # -> [entry, opens]

    def opened(self, e: Entry) -> None:
        ident = identity(e)
        slot = self.versions.get(ident)
        if slot is None:
            self.versions[ident] = [e, 1]
        else:
            slot[0] = e
            slot[1] += 1
        if identity(self.attrs) == ident:
            self.attrs = e

    def closed(self, ident: Identity) -> bool:
        """One open of version ``ident`` closed; True when ``attrs`` moved to the newest
        version still open (the one it answered for is closed)."""
        slot = self.versions.get(ident)
        if slot is not None:
            slot[1] -= 1
            if slot[1] <= 0:
                del self.versions[ident]
        if self.versions and identity(self.attrs) not in self.versions:
            self.attrs = next(reversed(self.versions.values()))[0]
            return True
        return False


class _VHandle:
    __slots__ = ("ino", "data", "pid")

    def __init__(self, ino: int, data: bytes, pid: int) -> None:
        self.ino, self.data, self.pid = ino, data, pid


class Operations(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, session: Session) -> None:
        super().__init__()
        engine = session.engine
        self.session = session
        self.engine = engine
        self.ns = engine.ns
        self.control = session.control
        self.vattrs = V.VirtualAttrs()
        self.timeout = float(engine.cfg.revalidate)
        self._can_store = engine.cfg.store_pages > 0  # (off for good after ENOSYS)
        self._dirs: dict[int, list[tuple[bytes, int]]] = {}
        self._next_dh = 1
        self._vfh: dict[int, _VHandle] = {}
        self._next_vfh = V.VFH_BASE
        # pending kernel notifications, deduplicated; unbounded on purpose: dropping one
        # would let the kernel serve an old size for up to --revalidate seconds
        self._inval: dict[tuple, None] = {}
        self._inval_ready = trio.Event()
        self.ns.on_invalidate = self._queue_invalidation
        self.initialized = trio.Event()
        # requests received per operation (``fuse_ops`` in stats): what a file costs in
        # round trips. One dict increment per request, on the loop.
        self.ops: dict[str, int] = dict.fromkeys(OPS, 0)
        # files open here (see _Held and _fresh). A few dict operations per open and
        # per release.
        self._open: dict[int, _Held] = {}
        self._fh_ino: dict[int, tuple[int, Identity]] = {}

    def init(self) -> None:
        """FUSE INIT: called on the loop before the reply goes to the kernel."""
        self.initialized.set()

    # ----- attributes ----------------------------------------------------------------

    def _attrs(self, e: Entry) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = e.ino
        a.generation = 0
        a.entry_timeout = self.timeout
        a.attr_timeout = self.timeout
        a.st_mode = e.mode
        a.st_nlink = e.nlink
        a.st_uid = e.uid
        a.st_gid = e.gid
        a.st_rdev = e.rdev
        a.st_size = e.size
        a.st_blksize = 4096
        a.st_blocks = e.blocks
        a.st_atime_ns = e.atime_ns
        a.st_mtime_ns = e.mtime_ns
        a.st_ctime_ns = e.ctime_ns
        return a

    def _vattrs(self, ino: int) -> pyfuse3.EntryAttributes:
        a = pyfuse3.EntryAttributes()
        a.st_ino = ino
        a.entry_timeout = 1.0
        a.attr_timeout = 1.0
        a.st_mode = V.MODES[ino]
        a.st_nlink = 2 if ino == V.VDIR_INO else 1
        a.st_uid, a.st_gid = self.vattrs.uid, self.vattrs.gid
        a.st_size = 0
        a.st_blksize = 4096
        a.st_atime_ns = a.st_mtime_ns = a.st_ctime_ns = self.vattrs.time_ns
        return a

    # ----- lookups ---------------------------------------------------------------------

    @fuse_errors
    async def lookup(self, parent_inode, name, ctx=None):
        if parent_inode == ROOT_INO and name == V.VDIR_NAME:
            self.ops["dlcache"] += 1
            return self._vattrs(V.VDIR_INO)
        if parent_inode == V.VDIR_INO:
            self.ops["dlcache"] += 1
            if name in V.FILES:
                return self._vattrs(V.FILES[name])
            raise NotFound(os.fsdecode(name))
        self.ops["lookup"] += 1
        e = await self.ns.fresh_lookup(parent_inode, name)
        try:
            e = await self._fresh_entry(e)  # a name deleted on the source: ENOENT
        except NotFound:
            # or a name whose type changed (a directory replaced by a file, or the
            # reverse): the check has just re-listed its directory, where it has a new
            # inode now (the snapshot answers: no second listing)
            e = await self._fresh_entry(self.ns.lookup(parent_inode, name))
        return self._attrs(self._answer(e))

    @fuse_errors
    async def getattr(self, inode, ctx=None):
        if inode in V.VIRTUAL:
            self.ops["dlcache"] += 1
            return self._vattrs(inode)
        self.ops["getattr"] += 1
        try:
            e = self.ns.get(inode)
        except NotFound:
            # deleted on the source while open here: its opens still read their version,
            # and fstat answers as a local filesystem's does for an unlinked open file
            held = self._open.get(inode)
            if held is None:
                raise
            return self._attrs(held.attrs)
        return self._attrs(await self._fresh(e))

    async def _fresh(self, e: Entry) -> Entry:
        """A file's entry checked by the rule an open follows (``--revalidate``: its
        directory re-listed once the window has passed; 0: the file itself, at every
        call), so that ``stat`` and ``ls -l`` show what an open would find: a size, or
        ENOENT for a file deleted on the source. A directory's own attributes follow the
        same rule (:meth:`Namespace.fresh_dir_attrs`): the kernel checks access
        (``default_permissions``) against its mode.

        A file open here is not checked: the entry of its latest open answers. The kernel
        asks GETATTR before reads of an open file (libfuse's auto_inval_data) and cuts
        the file at the size it gets: a smaller size found on the source meanwhile would
        end an open's read of its own version short, with no error. Open files follow
        the source from their next open (close-to-open, as NFS)."""
        if e.ino in self._open:
            return self._answer(e)
        return await self._fresh_entry(e)

    def _answer(self, cur: Entry) -> Entry:
        """The entry the kernel is given for ``cur`` (LOOKUP, GETATTR, READDIRPLUS):
        ``cur``, or for a file open here its :attr:`_Held.attrs`. When those are not
        the current version's, the kernel holds an older size: the next open bypasses
        the kernel's pages (its reads of them would stop at that size, a newer version
        cut short with no error)."""
        held = self._open.get(cur.ino)
        if held is None:
            return cur
        if identity(held.attrs) != identity(cur):
            self.ns.note_kernel_behind(cur.ino)
        return held.attrs

    async def _fresh_entry(self, e: Entry) -> Entry:
        """``e`` checked by the freshness rule of its type (no open considered)."""
        return await (self.ns.fresh_dir_attrs(e.ino) if stat.S_ISDIR(e.mode)
                      else self.ns.fresh_file(e.ino))

    @fuse_errors
    async def setattr(self, inode, attr, fields, fh, ctx):
        self.ops["setattr"] += 1
        # The only change allowed anywhere: truncating the control file to 0, which
        # `echo ... > control` asks for. It has no effect (writes are not stored).
        if (inode == V.CONTROL_INO and fields.update_size and attr.st_size == 0
                and not (fields.update_mode or fields.update_uid or fields.update_gid)):
            return self._vattrs(inode)
        raise ReadOnly("read-only mirror")

    @fuse_errors
    async def readlink(self, inode, ctx):
        self.ops["readlink"] += 1
        e = self.ns.get(inode)
        if not stat.S_ISLNK(e.mode):
            raise pyfuse3.FUSEError(errno.EINVAL)
        return e.target

    @fuse_errors
    async def forget(self, inode_list):
        self.ops["forget"] += 1
        return  # inodes are persistent; nothing to free

    # ----- directories -------------------------------------------------------------------

    @fuse_errors
    async def opendir(self, inode, ctx):
        self.ops["opendir"] += 1
        if inode == V.VDIR_INO:
            listing = [(b".", inode), (b"..", ROOT_INO), *sorted(V.FILES.items())]
        else:
            e = await self.ns.fresh_dir(inode)
            listing = [(b".", inode), (b"..", e.parent or ROOT_INO), *self.ns.children(inode)]
            self.session.streams.note_opendir(e)
        dh = self._next_dh
        self._next_dh += 1
        self._dirs[dh] = listing
        return dh

    @fuse_errors
    async def readdir(self, fh, start_id, token):
        self.ops["readdir"] += 1
        listing = self._dirs[fh]
        for i in range(start_id, len(listing)):
            name, ino = listing[i]
            try:
                if ino in V.VIRTUAL:
                    attrs = self._vattrs(ino)
                else:
                    # READDIRPLUS: the kernel takes these attributes as a GETATTR's (an
                    # open file's: the version its opens read, see _fresh)
                    attrs = self._attrs(self._answer(self.ns.get(ino)))
            except NotFound:
                continue  # removed since opendir
            if not pyfuse3.readdir_reply(token, name, attrs, i + 1):
                break

    @fuse_errors
    async def releasedir(self, fh):
        self.ops["releasedir"] += 1
        self._dirs.pop(fh, None)

    # ----- files -------------------------------------------------------------------------

    @fuse_errors
    async def open(self, inode, flags, ctx):
        if inode in V.VIRTUAL:
            self.ops["dlcache"] += 1
            return self._open_virtual(inode, flags, ctx)
        self.ops["open"] += 1
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            raise ReadOnly("read-only mirror")
        r = await self.engine.open(inode, ctx.pid)
        e = r.entry
        keep_cache, direct_io = r.keep_cache, r.direct_io
        if inode in self.ns.changed:
            self._drop_kernel_attrs(inode)
        if e is not None:  # (None: a mount's engine that does not say; see _fresh)
            ident = identity(e)
            held = self._open.get(inode)
            if held is None and not direct_io and self._store_pages(inode, r.fh, e):
                keep_cache = True  # (False would drop the pages just given)
            if held is None:
                self._open[inode] = _Held(e)
            else:
                if any(v != ident for v in held.versions):
                    # another version of the file is open here. The kernel's pages are
                    # shared by every open of an inode and an open reads them without
                    # asking: this open's bytes in the pages would be read by the older
                    # open as its own (its head, then the new version's tail). So this
                    # one bypasses them, and drops those there (the older open's next
                    # READ then fails, ESTALE: it never gets the new bytes), until the
                    # older opens are closed. (A first open after a change is direct_io
                    # already: the engine's rule.)
                    # The kernel keeps the older version's attributes meanwhile: a size
                    # it took from this one would cut the older opens' reads of their
                    # pages short (a truncated file, no error).
                    keep_cache, direct_io = False, True
                    self.engine.note_bypassing(r.fh)
                held.opened(e)
            self._fh_ino[r.fh] = (inode, ident)
        return pyfuse3.FileInfo(fh=r.fh, keep_cache=keep_cache, direct_io=direct_io)

    def _drop_kernel_attrs(self, inode: int) -> None:
        """The file changed on the source and the kernel was not told yet (its
        invalidation is queued for the worker): it may still hold the older version's
        attributes, and ``fstat`` on this open would give the older size (measured: 47 in
        40,020 open + fstat + read of files replaced every 20 ms, ``--revalidate 1``;
        ``numpy.fromfile`` then read the new version cut at the old size). So its
        attributes go now, before the open is answered: the reader's ``fstat`` asks
        GETATTR. Attributes only (no page is locked or dropped), so this may run inside
        the OPEN (libfuse's rule names no open among the requests it must not run in);
        the pages go with the queued invalidation."""
        try:
            pyfuse3.invalidate_inode(inode, True)
        except OSError as exc:
            if exc.errno != errno.ENOENT:  # ENOENT: the kernel holds nothing of it
                log.debug("invalidating the attributes of inode %d: %s", inode, exc)

    def _store_pages(self, inode: int, fh: int, e: Entry) -> bool:
        """Give the kernel's page cache the bytes the open holds already
        (``--store-pages``, :meth:`Engine.pages_for_kernel`), before the open is answered:
        the reader's READs are then served by the kernel, one round trip through this
        daemon less per file (measured: ~0.2 -> ~0.06 ms per read of a 110 KB file).
        True when the kernel took them.

        Only when no other open of the file is held (the caller checks): ``notify_store``
        locks each page it fills, and a READ of another open of this file, in flight,
        holds its page locked until this loop answers it: the loop would wait for
        itself. (The kernel sends a file's RELEASE only after its READs are answered.)
        Only at the file's first open in this mount (the engine's rule): the kernel
        holds no page of it, so the pages given are all it has. (A store never cuts the
        kernel's idea of the size, and an OPEN reply carries no attributes: at a later
        open, pages of an older, longer version could stay past the new end.) The
        whole file of the entry the open serves (``e``), nothing less."""
        if not self._can_store:
            return False
        data = self.engine.pages_for_kernel(fh)
        if data is None or len(data) != e.size:
            return False
        try:
            pyfuse3.notify_store(inode, 0, data)
        except OSError as exc:
            # a part may be stored: bytes of the version this open serves, harmless
            if exc.errno == errno.ENOSYS:
                self._can_store = False
                log.info("the kernel does not take stored pages: --store-pages is off")
            else:
                log.debug("storing the pages of inode %d failed: %s", inode, exc)
            return False
        self.engine.note_pages_stored(fh)
        return True

    def _open_virtual(self, inode: int, flags: int, ctx) -> pyfuse3.FileInfo:
        writing = flags & os.O_ACCMODE != os.O_RDONLY
        if inode == V.VDIR_INO:
            raise pyfuse3.FUSEError(errno.EISDIR)
        if writing and inode != V.CONTROL_INO:
            raise ReadOnly("only .dlcache/control is writable")
        if inode == V.CONTROL_INO and ctx.uid not in (self.vattrs.uid, 0):
            raise PermissionDenied("the control file belongs to the mount's owner")
        if inode == V.CONTROL_INO:
            # a training process is here (the hook opens it at interpreter start): the
            # sampler replay worker imports torch while the script imports its own
            try:
                self.session.streams.start_replay()
            except Exception:  # noqa: BLE001 - never fail the open for it (unmounting)
                log.exception("starting the sampler replay worker failed")
        if inode == V.STATS_INO:
            import json  # noqa: PLC0415  (only here)

            doc = self.session.stats()
            doc["fuse_ops"] = dict(self.ops)
            if ctx.uid not in (self.vattrs.uid, 0):
                doc = V.shared_stats(doc)  # another user's job sees no job's own sections
            data = (json.dumps(doc, indent=2) + "\n").encode()
        elif inode == V.ERRORS_INO:
            data = self.control.errors_text()
        elif inode == V.ZEROCOPY_INO:
            data = V.zerocopy_info(self.engine.cfg)
        else:
            data = b"" if writing else self.control.state_text()
        fh = self._next_vfh
        self._next_vfh += 1
        self._vfh[fh] = _VHandle(inode, data, ctx.pid)
        return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False, nonseekable=False)

    @fuse_errors
    async def read(self, fh, off, size):
        if fh >= V.VFH_BASE:
            self.ops["dlcache"] += 1
            return self._vfh[fh].data[off : off + size]
        self.ops["read"] += 1
        return await self.engine.read(fh, off, size)

    @fuse_errors
    async def write(self, fh, off, buf):
        self.ops["write"] += 1
        vh = self._vfh.get(fh) if fh >= V.VFH_BASE else None
        if vh is None or vh.ino != V.CONTROL_INO:
            raise ReadOnly("read-only mirror")
        return self.control.apply(bytes(buf), vh.pid)

    @fuse_errors
    async def release(self, fh):
        if fh >= V.VFH_BASE:
            self.ops["dlcache"] += 1
            self._vfh.pop(fh, None)
        else:
            self.ops["release"] += 1
            ino, ident = self._fh_ino.pop(fh, (None, None))
            held = self._open.get(ino) if ino is not None else None
            if held is not None:
                if held.closed(ident):
                    # the version whose attributes the kernel kept is closed: the newest
                    # one still open answers from now on
                    self._kernel_asks_again(held.attrs.parent, ino)
                elif not held.versions:
                    del self._open[ino]
                    cur = self.engine.index.get_entry(ino)
                    if cur is None or identity(cur) != identity(held.attrs):
                        # answered with its open's version while a newer one (or none)
                        # was known: now that nothing holds it
                        self._kernel_asks_again(held.attrs.parent, ino)
            self.engine.release(fh)

    async def flush(self, fh):
        self.ops["flush"] += 1
        raise pyfuse3.FUSEError(errno.ENOSYS)  # the kernel then stops sending FLUSH

    async def fsync(self, fh, datasync):
        self.ops["fsync"] += 1
        return

    @fuse_errors
    async def access(self, inode, mode, ctx):
        self.ops["access"] += 1
        if mode & os.W_OK and inode != V.CONTROL_INO:
            raise ReadOnly("read-only mirror")

    @fuse_errors
    async def statfs(self, ctx):
        self.ops["statfs"] += 1
        st = await self.engine.calls.call(self.engine.source.statvfs)
        s = pyfuse3.StatvfsData()
        s.f_bsize, s.f_frsize = st.f_bsize, st.f_frsize
        # the source's numbers, as a read-only bind mount shows them: `df` of the mount is
        # the dataset's filesystem (0 free made every mount look 100% used to disk-full
        # monitors); a write is EROFS whatever they say
        s.f_blocks, s.f_bfree, s.f_bavail = st.f_blocks, st.f_bfree, st.f_bavail
        s.f_files, s.f_ffree, s.f_favail = st.f_files, st.f_ffree, st.f_favail
        s.f_namemax = st.f_namemax
        return s

    # ----- extended attributes: none ---------------------------------------------------

    # ENOSYS once, and the kernel stops asking (no_getxattr/no_listxattr): `ls -l` looks up
    # an ACL xattr of every file, and these would otherwise be one request per file
    async def getxattr(self, inode, name, ctx):
        self.ops["getxattr"] += 1
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def listxattr(self, inode, ctx):
        self.ops["listxattr"] += 1
        raise pyfuse3.FUSEError(errno.ENOSYS)

    # ----- every modification: EROFS -----------------------------------------------------

    async def _erofs(self, *args, **kwargs):
        raise pyfuse3.FUSEError(errno.EROFS)

    create = mkdir = mknod = symlink = link = unlink = rmdir = rename = _erofs
    setxattr = removexattr = _erofs

    # ----- kernel cache invalidation -------------------------------------------------------

    def _kernel_asks_again(self, parent: int, ino: int) -> None:
        """The kernel holds attributes of a version of ``ino`` other than those it is
        answered with from now on: it is told to ask again, and until it has, the next
        open bypasses its pages (their reads stop at the size it holds)."""
        self._queue_invalidation("inode", parent, None, ino)
        self.ns.note_kernel_behind(ino)

    def _queue_invalidation(self, kind: str, parent: int, name: bytes | None, ino: int | None
                            ) -> None:
        self._inval[(kind, parent, name, ino)] = None
        self._inval_ready.set()

    async def invalidation_worker(self) -> None:
        """Tell the kernel about source changes, from a thread: the notify calls may block
        on kernel locks, and must never run inside the request that caused them."""
        while True:
            await self._inval_ready.wait()
            self._inval_ready = trio.Event()
            batch, self._inval = list(self._inval), {}
            for kind, parent, name, ino in batch:
                mark = self.ns.changed.get(ino) if ino is not None else None
                try:
                    if kind == "entry" and name:
                        await trio.to_thread.run_sync(pyfuse3.invalidate_entry, parent, name)
                    elif ino is not None:
                        await trio.to_thread.run_sync(pyfuse3.invalidate_inode, ino, False)
                except OSError as e:
                    if e.errno != errno.ENOENT:  # the kernel did not know it: nothing to do
                        log.debug("invalidate %s %s: %s", kind, ino or name, e)
                        continue
                if kind == "inode" and mark is not None:
                    # the kernel holds nothing of the file now: its opens may keep pages
                    self.ns.kernel_told(ino, mark)
