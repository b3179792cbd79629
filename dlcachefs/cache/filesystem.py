"""The filesystem as the kernel sees it, without the kernel: the facade the FUSE layer
(:mod:`dlcachefs.mount.ops`) is a thin adapter over.

Each operation returns plain results that carry what the kernel must be told: attributes
(:class:`Attributes`: an entry and how long the kernel may keep it), an open's
:class:`Opened` (``keep_cache``, ``direct_io``, attributes to drop now, the bytes to give
the page cache with the open), and notifications owed to the kernel, queued for the mount
layer's worker (:meth:`Filesystem.next_invalidations`). Which version of a file the kernel
may hold, and the rules that follow from it, are in :mod:`dlcachefs.cache.coherence`; the
``.dlcache/`` directory is :mod:`dlcachefs.cache.virtual`. Errors are the core's exceptions
(:mod:`dlcachefs.errors`): the mount layer chooses errno, in one place.

Kernel caching: entries and attributes are cached for ``--revalidate`` seconds (the same
window in which the core trusts its snapshot; a LOOKUP or GETATTR of a file after that
checks it as an open does), and ``keep_cache`` is set for files served from the cache, so
the kernel keeps their pages. The bytes an open holds in memory already are given to the
page cache with the open (``--store-pages``), so that no READ follows it.

What the facade needs of the rest of the daemon comes through its constructor: the engine
(:class:`ServedEngine`), the control state (:class:`~dlcachefs.cache.virtual.ControlFile`),
and callables for the stats document, an opened directory (the streams guess a dataset's
sample list from it), an opened control file (the sampler replay worker starts) and the
source's ``statvfs``. Trio loop only.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

from dlcachefs.cache.coherence import Coherence, Invalidation
from dlcachefs.cache.namespace import ROOT_INO, Namespace
from dlcachefs.cache.virtual import TIMEOUT as VIRTUAL_TIMEOUT
from dlcachefs.cache.virtual import VDIR_INO, VFH_BASE, VIRTUAL, VirtualDir
from dlcachefs.config import Config
from dlcachefs.errors import InvalidArgument, NotFound, ReadOnly
from dlcachefs.store.schema import Entry

if TYPE_CHECKING:
    from dlcachefs.cache.engine import OpenResult
    from dlcachefs.cache.virtual import ControlFile

#: the operations counted in ``fuse_ops``: every one the kernel may send a read-only
#: mount. ``lookup``, ``getattr``, ``open``, ``read`` and ``release`` count the mirror's
#: files only; those of ``.dlcache/`` (reading stats included) count under ``dlcache``, so
#: that watching the counters does not change them. Not seen here: requests libfuse
#: answers itself (FUSE_IOCTL, ENOSYS: Python's open() sends one per file, isatty's TCGETS)
OPS = ("lookup", "getattr", "setattr", "readlink", "forget", "opendir", "readdir",
       "releasedir", "open", "read", "write", "release", "flush", "fsync", "access",
       "statfs", "getxattr", "listxattr", "dlcache")


class Attributes(NamedTuple):
    """What the kernel is given for an inode: its entry, and the seconds it may keep the
    entry and its attributes."""

    entry: Entry
    timeout: float


@dataclass(slots=True)
class Opened:
    """An open, answered: the handle and what the kernel must do with it."""

    fh: int
    keep_cache: bool  # the kernel keeps the pages it holds of the file (else drops them)
    direct_io: bool  # reads bypass the page cache
    #: the version the open serves (its size is what the kernel must hold); None for a
    #: virtual file
    entry: Entry | None = None
    #: drop the kernel's attributes of the inode before the open is answered (attributes
    #: only: see :meth:`Filesystem.open`)
    drop_attrs: bool = False
    #: the whole file, to give the page cache before the open is answered (and, once the
    #: kernel took them, :meth:`Filesystem.pages_stored`)
    pages: memoryview | None = None


class ServedEngine(Protocol):
    """What the facade uses of :class:`dlcachefs.cache.engine.Engine`."""

    cfg: Config
    ns: Namespace

    async def open(self, ino: int, pid: int = 0) -> OpenResult: ...

    async def read(self, fh: int, offset: int, size: int) -> bytes | memoryview: ...

    def release(self, fh: int) -> None: ...

    def pages_for_kernel(self, fh: int) -> memoryview | None: ...

    def note_bypassing(self, fh: int) -> None: ...

    def note_pages_stored(self, fh: int) -> None: ...


class Filesystem:
    """Lookups, attributes, directories, opens, reads and releases of the mirror and of
    ``.dlcache/``, with the kernel's directives in their results."""

    def __init__(self, engine: ServedEngine, *, control: ControlFile,
                 stats: Callable[[], dict], on_opendir: Callable[[Entry], None],
                 on_control_open: Callable[[], None],
                 statfs: Callable[[], Awaitable[os.statvfs_result]]) -> None:
        """``stats``: the stats document (``.dlcache/stats`` adds ``fuse_ops``);
        ``on_opendir``: a directory of the mirror was opened; ``on_control_open``: the
        control file was opened (a training process is here); ``statfs``: the source's
        ``statvfs``."""
        self.engine = engine
        self.ns = engine.ns
        self.coherence = Coherence(self.ns)  # (installs the namespace's on_invalidate)
        self.virtual = VirtualDir(engine.cfg, control, self._stats_document,
                                  on_control_open)
        self._stats = stats
        self._on_opendir = on_opendir
        self._statfs = statfs
        self.timeout = float(engine.cfg.revalidate)
        self.store_pages = engine.cfg.store_pages > 0
        self._dirs: dict[int, list[tuple[bytes, int]]] = {}
        self._next_dh = 1
        # requests received per operation (``fuse_ops`` in stats): what a file costs in
        # round trips. One dict increment per request. The mount layer counts here the
        # requests it answers itself (count()).
        self.requests: dict[str, int] = dict.fromkeys(OPS, 0)

    def count(self, op: str) -> None:
        """One request ``op`` answered without the facade (FLUSH, FORGET, xattrs...)."""
        self.requests[op] += 1

    def _stats_document(self) -> dict:
        doc = self._stats()
        doc["fuse_ops"] = dict(self.requests)
        return doc

    # ----- attributes ----------------------------------------------------------------

    def _attrs(self, e: Entry) -> Attributes:
        return Attributes(e, self.timeout)

    def _vattrs(self, ino: int) -> Attributes:
        return Attributes(self.virtual.entry(ino), VIRTUAL_TIMEOUT)

    async def lookup(self, parent: int, name: bytes) -> Attributes:
        """LOOKUP of ``name`` in directory ``parent``."""
        if self.virtual.is_lookup(parent, name):
            self.requests["dlcache"] += 1
            return Attributes(self.virtual.lookup(parent, name), VIRTUAL_TIMEOUT)
        self.requests["lookup"] += 1
        e = await self.ns.fresh_lookup(parent, name)
        try:
            e = await self._fresh_entry(e)  # a name deleted on the source: ENOENT
        except NotFound:
            # or a name whose type changed (a directory replaced by a file, or the
            # reverse): the check has just re-listed its directory, where it has a new
            # inode now (the snapshot answers: no second listing)
            e = await self._fresh_entry(self.ns.lookup(parent, name))
        return self._attrs(self.coherence.answer(e))

    async def getattr(self, ino: int) -> Attributes:
        """GETATTR of ``ino``."""
        if ino in VIRTUAL:
            self.requests["dlcache"] += 1
            return self._vattrs(ino)
        self.requests["getattr"] += 1
        try:
            e = self.ns.get(ino)
        except NotFound:
            # deleted on the source while open here: its opens still read their version,
            # and fstat answers as a local filesystem's does for an unlinked open file
            held = self.coherence.held_attrs(ino)
            if held is None:
                raise
            return self._attrs(held)
        return self._attrs(await self._fresh(e))

    async def _fresh(self, e: Entry) -> Entry:
        """A file's entry checked by the rule an open follows (``--revalidate``: its
        directory re-listed once the window has passed; 0: the file itself, at every
        call), so that ``stat`` and ``ls -l`` show what an open would find: a size, or
        ENOENT for a file deleted on the source. A directory's own attributes follow the
        same rule (:meth:`Namespace.fresh_dir_attrs`): the kernel checks access
        (``default_permissions``) against its mode. A file open here is not checked: the
        entry of its opens answers (:meth:`Coherence.answer`)."""
        if self.coherence.is_open(e.ino):
            return self.coherence.answer(e)
        return await self._fresh_entry(e)

    async def _fresh_entry(self, e: Entry) -> Entry:
        """``e`` checked by the freshness rule of its type (no open considered)."""
        return await (self.ns.fresh_dir_attrs(e.ino) if stat.S_ISDIR(e.mode)
                      else self.ns.fresh_file(e.ino))

    def setattr(self, ino: int, *, size: int | None, mode_or_owner: bool) -> Attributes:
        """SETATTR: ``size`` the size asked for (None: unchanged), ``mode_or_owner``
        whether the mode, owner or group change too. The only change allowed anywhere:
        truncating the control file to 0, which ``echo ... > control`` asks for. It has no
        effect (writes are not stored)."""
        self.requests["setattr"] += 1
        if self.virtual.may_write(ino) and size == 0 and not mode_or_owner:
            return self._vattrs(ino)
        raise ReadOnly("read-only mirror")

    def readlink(self, ino: int) -> bytes:
        self.requests["readlink"] += 1
        e = self.ns.get(ino)
        if not stat.S_ISLNK(e.mode):
            raise InvalidArgument("not a symbolic link")
        return e.target

    def access(self, ino: int, writing: bool) -> None:
        """ACCESS: writing is refused everywhere but the control file."""
        self.requests["access"] += 1
        if writing and not self.virtual.may_write(ino):
            raise ReadOnly("read-only mirror")

    async def statfs(self) -> os.statvfs_result:
        """The source's numbers, as a read-only bind mount shows them: ``df`` of the mount
        is the dataset's filesystem (0 free made every mount look 100% used to disk-full
        monitors); a write is EROFS whatever they say."""
        self.requests["statfs"] += 1
        return await self._statfs()

    # ----- directories -------------------------------------------------------------------

    async def opendir(self, ino: int) -> int:
        """OPENDIR: a handle on the directory's listing as it is now."""
        self.requests["opendir"] += 1
        if ino == VDIR_INO:
            listing = self.virtual.listing()
        else:
            e = await self.ns.fresh_dir(ino)
            listing = [(b".", ino), (b"..", e.parent or ROOT_INO), *self.ns.children(ino)]
            self._on_opendir(e)
        dh = self._next_dh
        self._next_dh += 1
        self._dirs[dh] = listing
        return dh

    def readdir(self, dh: int, start: int) -> Iterator[tuple[bytes, Attributes, int]]:
        """READDIRPLUS from position ``start``: (name, attributes, next position) per
        entry, lazily (the caller stops when the kernel's buffer is full). Entries removed
        since the OPENDIR are passed by."""
        self.requests["readdir"] += 1
        return self._listed(self._dirs[dh], start)

    def _listed(self, listing: list[tuple[bytes, int]], start: int
                ) -> Iterator[tuple[bytes, Attributes, int]]:
        for i in range(start, len(listing)):
            name, ino = listing[i]
            try:
                if ino in VIRTUAL:
                    attrs = self._vattrs(ino)
                else:
                    # READDIRPLUS: the kernel takes these attributes as a GETATTR's (an
                    # open file's: the version its opens read, see _fresh)
                    attrs = self._attrs(self.coherence.answer(self.ns.get(ino)))
            except NotFound:
                continue  # removed since opendir
            yield name, attrs, i + 1

    def releasedir(self, dh: int) -> None:
        self.requests["releasedir"] += 1
        self._dirs.pop(dh, None)

    # ----- files -------------------------------------------------------------------------

    async def open(self, ino: int, flags: int, uid: int, pid: int) -> Opened:
        """OPEN of ``ino`` with ``os.open`` ``flags`` by process ``pid`` of user ``uid``.

        ``drop_attrs``: the file changed on the source and the kernel was not told yet
        (its invalidation is queued for the worker): it may still hold the older
        version's attributes, and ``fstat`` on this open would give the older size
        (``numpy.fromfile`` then read the new version cut at the old size). So its
        attributes go now, before the open is answered: the reader's ``fstat`` asks
        GETATTR. Attributes only (no page is locked or dropped), so this may run inside the
        OPEN (libfuse's rule names no open among the requests it must not run in); the
        pages go with the queued invalidation.

        ``pages``: the bytes the open holds already (``--store-pages``,
        :meth:`Engine.pages_for_kernel`), for the kernel's page cache before the open is
        answered: the reader's READs are then served by the kernel, one round trip through
        this daemon less per file. Only when no other open of the file is held: the
        kernel's store locks each page it fills, and a READ of another open of this file,
        in flight, holds its page locked until this loop answers it: the loop would wait
        for itself. (The kernel sends a file's RELEASE only after its READs are answered.)
        Only at the file's first open in this mount (the engine's rule): the kernel holds
        no page of it, so the pages given are all it has. (A store never cuts the kernel's
        idea of the size, and an OPEN reply carries no attributes: at a later open, pages
        of an older, longer version could stay past the new end.) The whole file of the
        entry the open serves, nothing less. Give them in the same step as this returned
        (no await between): the engine's check holds for that moment."""
        if ino in VIRTUAL:
            self.requests["dlcache"] += 1
            fh = self.virtual.open(ino, flags & os.O_ACCMODE != os.O_RDONLY, uid, pid)
            return Opened(fh, keep_cache=False, direct_io=True)
        self.requests["open"] += 1
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            raise ReadOnly("read-only mirror")
        r = await self.engine.open(ino, pid)
        out = Opened(r.fh, r.keep_cache, r.direct_io, entry=r.entry,
                     drop_attrs=self.coherence.kernel_behind(ino))
        e = r.entry
        if e is None:  # (a mount's engine that does not say: no version kept for it)
            return out
        if self.store_pages and not r.direct_io and not self.coherence.is_open(ino):
            data = self.engine.pages_for_kernel(r.fh)
            if data is not None and len(data) == e.size:
                out.pages = data
        if self.coherence.opened(ino, r.fh, e):  # another version is open here
            out.keep_cache, out.direct_io = False, True
            self.engine.note_bypassing(r.fh)
        return out

    def pages_stored(self, opened: Opened) -> None:
        """The kernel took ``opened.pages``: the open keeps them (``keep_cache``: without
        it the kernel would drop the pages just given), and the engine counts them as the
        open's READs."""
        opened.keep_cache = True
        self.engine.note_pages_stored(opened.fh)

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        if fh >= VFH_BASE:
            self.requests["dlcache"] += 1
            return self.virtual.read(fh, off, size)
        self.requests["read"] += 1
        return await self.engine.read(fh, off, size)

    def write(self, fh: int, data: bytes) -> int:
        """WRITE: only to an open control file (a control write, applied whole)."""
        self.requests["write"] += 1
        if fh < VFH_BASE:
            raise ReadOnly("read-only mirror")
        return self.virtual.write(fh, data)

    def release(self, fh: int) -> None:
        if fh >= VFH_BASE:
            self.requests["dlcache"] += 1
            self.virtual.release(fh)
            return
        self.requests["release"] += 1
        self.coherence.released(fh)
        self.engine.release(fh)

    # ----- notifications owed to the kernel -------------------------------------------

    async def next_invalidations(self) -> list[Invalidation]:
        """Wait for notifications the kernel is owed; all of them, taken. For each,
        :meth:`invalidation_mark` just before it is sent and
        :meth:`invalidation_done` once it went through (or the kernel did not know it)."""
        return await self.coherence.next_batch()

    def invalidation_mark(self, inv: Invalidation) -> int | None:
        return self.coherence.mark(inv)

    def invalidation_done(self, inv: Invalidation, mark: int | None) -> None:
        self.coherence.kernel_dropped(inv, mark)

