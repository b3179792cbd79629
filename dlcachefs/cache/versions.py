"""Which bytes in the cache are the current version of a file: the one freshness check.

A source file is one version per :class:`~dlcachefs.cache.source.Identity` (size,
mtime_ns, source inode); the namespace entry says which version is current. Cached
bytes may be served, or reused, only for that version:

* an index record is current when it was written from this version
  (:func:`record_identity`) and the file is not in the writer's ``drops`` (stale or
  corrupt, dropped from the index by the next commit): :meth:`Versions.is_current`;
* bytes not sealed yet are current when the writer's pending record, or the
  :class:`~dlcachefs.cache.buffers.Backlog`'s entry, carries this identity.

Every place that asks "may these bytes stand for this version of this file" asks here.
(The seal transaction checks the same rule inside its LMDB write transaction, in a
thread, against the entries as they are then: :func:`dlcachefs.store.seal.seal_chunks`,
for the chunk writer and the reorderer alike.)

Concurrency: trio loop only (LMDB read transactions, the writer's loop-side state).
"""

from __future__ import annotations

from collections.abc import Container
from typing import TYPE_CHECKING

from dlcachefs.cache.namespace import identity
from dlcachefs.cache.source import Identity
from dlcachefs.store.index import Index
from dlcachefs.store.schema import Entry, Record

if TYPE_CHECKING:
    from dlcachefs.cache.buffers import Backlog
    from dlcachefs.cache.writer import ChunkWriter


def record_identity(rec: Record) -> Identity:
    """The version of the file a record was written from."""
    return Identity(rec.size, rec.mtime_ns, rec.src_ino)


def record_is_current(ino: int, rec: Record | None, ident: Identity,
                      drops: Container[int]) -> bool:
    """THE check: ``rec`` holds version ``ident`` of ``ino`` and is not being dropped."""
    return rec is not None and ino not in drops and record_identity(rec) == ident


class Versions:
    """Where the cache holds a given version of a file (see the module docstring)."""

    def __init__(self, index: Index, writer: ChunkWriter, backlog: Backlog) -> None:
        self.index = index
        self.writer = writer
        self.backlog = backlog

    def is_current(self, ino: int, rec: Record | None, ident: Identity) -> bool:
        """Whether ``rec`` may be served as version ``ident`` of ``ino``."""
        return record_is_current(ino, rec, ident, self.writer.drops)

    def is_stale(self, ino: int, rec: Record | None, ident: Identity) -> bool:
        """A record that is served no longer: of another version, not yet dropped."""
        return rec is not None and ino not in self.writer.drops and not self.is_current(
            ino, rec, ident)

    def record(self, ino: int, ident: Identity) -> Record | None:
        """The index record of this version of ``ino``, or None."""
        rec = self.index.get_record(ino)
        return rec if self.is_current(ino, rec, ident) else None

    def servable(self, ino: int) -> Record | None:
        """The index record of ``ino`` unless it is being dropped, whatever its version
        (read plans read ahead by it; the open compares versions when it takes)."""
        rec = self.index.get_record(ino)
        return None if rec is None or ino in self.writer.drops else rec

    def listed_entry(self, ino: int, ident: Identity) -> Entry | None:
        """The namespace entry of ``ino`` if the snapshot still lists this version."""
        e = self.index.get_entry(ino)
        return e if e is not None and identity(e) == ident else None

    def is_listed(self, ino: int, ident: Identity) -> bool:
        """Whether the namespace snapshot still lists ``ino`` at this version."""
        return self.listed_entry(ino, ident) is not None

    def in_writer(self, ino: int, ident: Identity) -> bool:
        """Whether the writer holds this version of ``ino``, to be sealed."""
        p = self.writer.pending.get(ino)
        return p is not None and p.ident == ident

    def unsealed(self, ino: int, ident: Identity) -> bytes | None:
        """This version's bytes waiting to be sealed (in the writer or the backlog)."""
        p = self.writer.pending.get(ino)
        if p is not None and p.ident == ident:
            return p.data
        return self.backlog.get(ino, ident)

    def is_cached(self, ino: int, ident: Identity) -> bool:
        """True when this version of ``ino`` is indexed or waiting to be sealed."""
        return self.record(ino, ident) is not None or self.unsealed(ino, ident) is not None
