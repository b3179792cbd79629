"""pyfuse3 ``Operations``: a thin adapter over the core's
:class:`~dlcachefs.cache.filesystem.Filesystem`.

Each request converts its arguments, awaits the facade, builds pyfuse3's replies
(``EntryAttributes``, ``FileInfo``, ``StatvfsData``) and carries out the kernel directives
the results hold (``notify_store``, ``invalidate_inode``; the queued notifications in
:meth:`Operations.invalidation_worker`). What to answer, and which version of a file the
kernel may hold, is decided in the core (:mod:`dlcachefs.cache.coherence`); errno is
chosen in one place (:func:`~dlcachefs.mount.errmap.fuse_errors`). What stays here are
facts about the kernel: FLUSH and the xattr requests are answered once with ENOSYS, after
which the kernel stops sending them, and a kernel that refuses stored pages is not offered
them again. Runs on the trio loop.
"""

from __future__ import annotations

import errno
import logging
import os

import pyfuse3
import trio
from dlcachefs.mount.errmap import fuse_errors

from dlcachefs.cache.filesystem import Attributes, Filesystem

log = logging.getLogger(__name__)


def entry_attributes(a: Attributes) -> pyfuse3.EntryAttributes:
    """pyfuse3's reply for the facade's :class:`Attributes`."""
    e = a.entry
    x = pyfuse3.EntryAttributes()
    x.st_ino = e.ino
    x.generation = 0
    x.entry_timeout = a.timeout
    x.attr_timeout = a.timeout
    x.st_mode = e.mode
    x.st_nlink = e.nlink
    x.st_uid = e.uid
    x.st_gid = e.gid
    x.st_rdev = e.rdev
    x.st_size = e.size
    x.st_blksize = 4096
    x.st_blocks = e.blocks
    x.st_atime_ns = e.atime_ns
    x.st_mtime_ns = e.mtime_ns
    x.st_ctime_ns = e.ctime_ns
    return x


class Operations(pyfuse3.Operations):
    supports_dot_lookup = False
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, fs: Filesystem) -> None:
        super().__init__()
        self.fs = fs
        self._can_store = True  # off for good once the kernel refused stored pages
        self.initialized = trio.Event()

    def init(self) -> None:
        """FUSE INIT: called on the loop before the reply goes to the kernel."""
        self.initialized.set()

    # ----- lookups ---------------------------------------------------------------------

    @fuse_errors
    async def lookup(self, parent_inode, name, ctx=None):
        return entry_attributes(await self.fs.lookup(parent_inode, name))

    @fuse_errors
    async def getattr(self, inode, ctx=None):
        return entry_attributes(await self.fs.getattr(inode))

    @fuse_errors
    async def setattr(self, inode, attr, fields, fh, ctx):
        return entry_attributes(self.fs.setattr(
            inode, size=attr.st_size if fields.update_size else None,
            mode_or_owner=fields.update_mode or fields.update_uid or fields.update_gid))

    @fuse_errors
    async def readlink(self, inode, ctx):
        return self.fs.readlink(inode)

    @fuse_errors
    async def forget(self, inode_list):
        self.fs.count("forget")  # inodes are persistent; nothing to free

    # ----- directories -------------------------------------------------------------------

    @fuse_errors
    async def opendir(self, inode, ctx):
        return await self.fs.opendir(inode)

    @fuse_errors
    async def readdir(self, fh, start_id, token):
        for name, attrs, next_id in self.fs.readdir(fh, start_id):
            if not pyfuse3.readdir_reply(token, name, entry_attributes(attrs), next_id):
                break

    @fuse_errors
    async def releasedir(self, fh):
        self.fs.releasedir(fh)

    # ----- files -------------------------------------------------------------------------

    @fuse_errors
    async def open(self, inode, flags, ctx):
        r = await self.fs.open(inode, flags, ctx.uid, ctx.pid)
        # the directives, before the open is answered and with no await in between (the
        # pages are those of the version the open serves at this moment)
        if r.drop_attrs:
            self._drop_kernel_attrs(inode)
        if r.pages is not None and self._can_store and self._store(inode, r.pages):
            self.fs.pages_stored(r)
        return pyfuse3.FileInfo(fh=r.fh, keep_cache=r.keep_cache, direct_io=r.direct_io)

    def _drop_kernel_attrs(self, inode: int) -> None:
        """Attributes only (see :meth:`Filesystem.open`): no page is locked or dropped, so
        this may run inside the OPEN."""
        try:
            pyfuse3.invalidate_inode(inode, True)
        except OSError as exc:
            if exc.errno != errno.ENOENT:  # ENOENT: the kernel holds nothing of it
                log.debug("invalidating the attributes of inode %d: %s", inode, exc)

    def _store(self, inode: int, data: memoryview) -> bool:
        """Give the kernel's page cache ``data`` (the whole file, from offset 0); True
        when the kernel took it."""
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
        return True

    @fuse_errors
    async def read(self, fh, off, size):
        return await self.fs.read(fh, off, size)

    @fuse_errors
    async def write(self, fh, off, buf):
        return self.fs.write(fh, bytes(buf))

    @fuse_errors
    async def release(self, fh):
        self.fs.release(fh)

    async def flush(self, fh):
        self.fs.count("flush")
        raise pyfuse3.FUSEError(errno.ENOSYS)  # the kernel then stops sending FLUSH

    async def fsync(self, fh, datasync):
        self.fs.count("fsync")

    @fuse_errors
    async def access(self, inode, mode, ctx):
        self.fs.access(inode, bool(mode & os.W_OK))

    @fuse_errors
    async def statfs(self, ctx):
        st = await self.fs.statfs()
        s = pyfuse3.StatvfsData()
        s.f_bsize, s.f_frsize = st.f_bsize, st.f_frsize
        s.f_blocks, s.f_bfree, s.f_bavail = st.f_blocks, st.f_bfree, st.f_bavail
        s.f_files, s.f_ffree, s.f_favail = st.f_files, st.f_ffree, st.f_favail
        s.f_namemax = st.f_namemax
        return s

    # ----- extended attributes: none ---------------------------------------------------

    # ENOSYS once, and the kernel stops asking (no_getxattr/no_listxattr): `ls -l` looks up
    # an ACL xattr of every file, and these would otherwise be one request per file
    async def getxattr(self, inode, name, ctx):
        self.fs.count("getxattr")
        raise pyfuse3.FUSEError(errno.ENOSYS)

    async def listxattr(self, inode, ctx):
        self.fs.count("listxattr")
        raise pyfuse3.FUSEError(errno.ENOSYS)

    # ----- every modification: EROFS -----------------------------------------------------

    async def _erofs(self, *args, **kwargs):
        raise pyfuse3.FUSEError(errno.EROFS)

    create = mkdir = mknod = symlink = link = unlink = rmdir = rename = _erofs
    setxattr = removexattr = _erofs

    # ----- kernel cache invalidation -------------------------------------------------------

    async def invalidation_worker(self) -> None:
        """Tell the kernel what the core queued (source changes, versions it no longer
        answers with), from a thread: the notify calls may block on kernel locks, and must
        never run inside the request that caused them."""
        while True:
            for inv in await self.fs.next_invalidations():
                mark = self.fs.invalidation_mark(inv)
                try:
                    if inv.kind == "entry" and inv.name:
                        await trio.to_thread.run_sync(pyfuse3.invalidate_entry, inv.parent,
                                                      inv.name)
                    elif inv.ino is not None:
                        await trio.to_thread.run_sync(pyfuse3.invalidate_inode, inv.ino,
                                                      False)
                except OSError as e:
                    if e.errno != errno.ENOENT:  # the kernel did not know it: nothing to do
                        log.debug("invalidate %s %s: %s", inv.kind, inv.ino or inv.name, e)
                        continue
                self.fs.invalidation_done(inv, mark)
