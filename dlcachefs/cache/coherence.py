"""Which version of a file the kernel may hold, and what it must be told.

The kernel keeps a file's attributes (for ``--revalidate`` seconds) and its pages; both are
shared by every open of the inode, and an open reads the pages without asking. When the
source changes during a mount, the kernel may still hold the older version's size and bytes.
The rules that keep every open reading one whole version, never cut short and never mixed:

* **The first open after a change bypasses the pages** (``direct_io``, no ``keep_cache``)
  until the kernel has dropped what it held: :attr:`Namespace.changed
  <dlcachefs.cache.namespace.Namespace.changed>`, marked by the namespace when it sees a
  change and by :meth:`Coherence.answer` here, cleared by :meth:`Coherence.kernel_dropped`
  once an invalidation of the inode went through (the engine's ``_bypass_pages``).
* **An open file's attributes stay those of its opens' version** (:meth:`Coherence.answer`):
  the kernel asks GETATTR before reads of an open file (libfuse's ``auto_inval_data``) and
  cuts the file at the size it gets, so a smaller size found on the source meanwhile would
  end an open's read of its own version short, with no error. Open files follow the source
  from their next open (close-to-open, as NFS).
* **Another version open here: this open bypasses the pages** (:meth:`Coherence.opened`):
  its bytes in the pages would be read by the older open as its own.
* **The kernel is told when what it was answered is no longer current**
  (:meth:`Coherence.released`): the version whose attributes it kept is closed, so it must
  ask again; until it has, opens bypass its pages.
* **Pages go to the kernel with an open only when no other open of the file is held**
  (the filesystem's ``open``; the engine adds: only at the file's first open in the mount,
  and only while no newer version is known).

Notifications for the kernel are queued here (deduplicated) and sent by the mount layer's
worker, never inside the request that caused them. Trio loop only; a few dict operations per
open and per release.
"""

from __future__ import annotations

from typing import NamedTuple

import trio

from dlcachefs.cache.namespace import Namespace, identity
from dlcachefs.cache.source import Identity
from dlcachefs.errors import NotFound
from dlcachefs.store.schema import Entry


class Invalidation(NamedTuple):
    """A notification for the kernel: ``entry`` (a name added or removed in ``parent``:
    its lookup is forgotten) or ``inode`` (the attributes and pages of ``ino`` dropped)."""

    kind: str
    parent: int
    name: bytes | None
    ino: int | None


class Held:
    """A file open here: per version open, its latest entry and its opens; and ``attrs``,
    the entry LOOKUP and GETATTR answer with: the version whose opens read the kernel's
    pages, bounded by the size the kernel holds (a newer version's opens bypass the pages)."""

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


class Coherence:
    """The files open here by version, the attributes the kernel is answered with, and the
    queue of notifications the kernel is owed. Installs itself as the namespace's
    ``on_invalidate``: from then on the namespace keeps a changed inode in
    :attr:`Namespace.changed` until the kernel was told (a mount with a kernel)."""

    def __init__(self, ns: Namespace) -> None:
        self.ns = ns
        self._open: dict[int, Held] = {}
        self._fh_ino: dict[int, tuple[int, Identity]] = {}
        # pending kernel notifications, deduplicated; unbounded on purpose: dropping one
        # would let the kernel serve an old size for up to --revalidate seconds
        self._pending: dict[Invalidation, None] = {}
        self._ready = trio.Event()
        ns.on_invalidate = self.queue

    # ----- answers -----------------------------------------------------------------

    def is_open(self, ino: int) -> bool:
        return ino in self._open

    def held_attrs(self, ino: int) -> Entry | None:
        """The entry answered for open file ``ino`` (None when it is not open here)."""
        held = self._open.get(ino)
        return held.attrs if held is not None else None

    def answer(self, cur: Entry) -> Entry:
        """The entry the kernel is given for ``cur`` (LOOKUP, GETATTR, READDIRPLUS):
        ``cur``, or for a file open here its :attr:`Held.attrs`. When those are not the
        current version's, the kernel holds an older size: the next open bypasses the
        kernel's pages (its reads of them would stop at that size, a newer version cut
        short with no error)."""
        held = self._open.get(cur.ino)
        if held is None:
            return cur
        if identity(held.attrs) != identity(cur):
            self.ns.note_kernel_behind(cur.ino)
        return held.attrs

    def kernel_behind(self, ino: int) -> bool:
        """Whether the kernel may hold attributes or pages of another version of ``ino``
        than the current one (a change seen, the kernel not told yet)."""
        return ino in self.ns.changed

    # ----- opens and releases ---------------------------------------------------------

    def opened(self, ino: int, fh: int, e: Entry) -> bool:
        """Open ``fh`` of ``ino`` serves version ``e``; True when another version of the
        file is open here, so that this open must bypass the kernel's pages.

        The kernel's pages are shared by every open of an inode and an open reads them
        without asking: this open's bytes in the pages would be read by the older open as
        its own (its head, then the new version's tail). So this one bypasses them, and
        drops those there (the older open's next READ then fails, ESTALE: it never gets
        the new bytes), until the older opens are closed. (A first open after a change is
        direct_io already: the engine's rule.) The kernel keeps the older version's
        attributes meanwhile: a size it took from this one would cut the older opens'
        reads of their pages short (a truncated file, no error)."""
        ident = identity(e)
        self._fh_ino[fh] = (ino, ident)
        held = self._open.get(ino)
        if held is None:
            self._open[ino] = Held(e)
            return False
        other = any(v != ident for v in held.versions)
        held.opened(e)
        return other

    def released(self, fh: int) -> None:
        """Open ``fh`` closed. When the kernel holds attributes of a version other than
        those it is answered with from now on (the version it kept is closed), it is told
        to ask again."""
        ino, ident = self._fh_ino.pop(fh, (None, None))
        held = self._open.get(ino) if ino is not None else None
        if held is None:
            return
        assert ino is not None and ident is not None
        if held.closed(ident):
            # the version whose attributes the kernel kept is closed: the newest one
            # still open answers from now on
            self._kernel_asks_again(held.attrs.parent, ino)
        elif not held.versions:
            del self._open[ino]
            try:
                cur: Entry | None = self.ns.get(ino)
            except NotFound:
                cur = None
            if cur is None or identity(cur) != identity(held.attrs):
                # answered with its open's version while a newer one (or none) was known:
                # now that nothing holds it
                self._kernel_asks_again(held.attrs.parent, ino)

    def _kernel_asks_again(self, parent: int, ino: int) -> None:
        """The kernel holds attributes of a version of ``ino`` other than those it is
        answered with from now on: it is told to ask again, and until it has, the next
        open bypasses its pages (their reads stop at the size it holds)."""
        self.queue("inode", parent, None, ino)
        self.ns.note_kernel_behind(ino)

    # ----- the kernel's notifications -------------------------------------------------

    def queue(self, kind: str, parent: int, name: bytes | None, ino: int | None) -> None:
        """Owe the kernel a notification (the namespace's ``on_invalidate``)."""
        self._pending[Invalidation(kind, parent, name, ino)] = None
        self._ready.set()

    def pending(self) -> list[Invalidation]:
        """The notifications owed and not taken yet (for tests and checks)."""
        return list(self._pending)

    def take(self) -> list[Invalidation]:
        """The notifications owed now, taken (the caller sends them)."""
        batch, self._pending = list(self._pending), {}
        self._ready = trio.Event()
        return batch

    async def next_batch(self) -> list[Invalidation]:
        """Wait until a notification is owed, then :meth:`take` them all."""
        await self._ready.wait()
        return self.take()

    def mark(self, inv: Invalidation) -> int | None:
        """Taken just before ``inv`` is sent: what :meth:`kernel_dropped` needs to know
        whether the inode was marked changed again while it was on its way."""
        return self.ns.changed.get(inv.ino) if inv.ino is not None else None

    def kernel_dropped(self, inv: Invalidation, mark: int | None) -> None:
        """``inv`` went through (or the kernel did not know the inode): for an inode, the
        kernel holds nothing of it now, so its opens may keep pages again (unless it was
        marked again after ``mark``)."""
        if inv.kind == "inode" and inv.ino is not None and mark is not None:
            self.ns.kernel_told(inv.ino, mark)
