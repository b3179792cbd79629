"""Indexing sealed chunks: the one LMDB write transaction of a seal.

Both writers of chunks end a seal here, after the chunks' bytes are durable: the chunk
writer (:mod:`dlcachefs.cache.writer`: new chunks appended to the active log, the
policy's victims to drop) and the reorderer (:mod:`dlcachefs.clairvoyance.reorder`: one
chunk of a next epoch's log, whose records move there). One transaction, in this order:

1. drop the victims (chunks, and every record still in them) and the dropped records;
2. per new chunk: put each record whose inode's namespace entry still has the version
   the bytes were read under (a file changed or removed while its bytes waited is never
   indexed), with its content key when it has one, then the chunk itself (its member list names every record written into
   it, indexed or not: a chunk may hold dead records);
3. raise the chunk and log id sequences past what was used;
4. find the chunks that lost a record here and hold none any more (dead).

The callers differ in one decision, a parameter: what to do when an inode already has a
record of the same version elsewhere (``keep_indexed``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from dlcachefs.store import schema as S
from dlcachefs.store.index import Index, IndexTxn
from dlcachefs.store.schema import Chunk, Record


class Version(Protocol):
    """One version of a source file as the cache tells them apart: (size, mtime, source
    inode). :class:`dlcachefs.cache.source.Identity`, :class:`Entry` and :class:`Record`
    all have these fields."""

    @property
    def size(self) -> int: ...

    @property
    def mtime_ns(self) -> int: ...

    @property
    def src_ino(self) -> int: ...


def same_version(a: Version, b: Version) -> bool:
    """True when ``a`` and ``b`` name the same version of a file."""
    return a.size == b.size and a.mtime_ns == b.mtime_ns and a.src_ino == b.src_ino


@dataclass(frozen=True, slots=True)
class NewRecord:
    """A record written into a new chunk: indexed as ``record`` only if inode ``ino`` is
    still at ``version`` (the version its bytes were read under)."""

    ino: int
    version: Version
    record: Record
    #: the SHA-256 of the record's bytes (``--shared-cache`` dedup): offered to the other
    #: datasets of the root under it once indexed
    sha256: bytes | None = None


@dataclass(frozen=True, slots=True)
class NewChunk:
    """A chunk whose bytes are durable, with the records written into it."""

    chunk: Chunk
    records: Sequence[NewRecord]


@dataclass(slots=True)
class Sealed:
    """What one seal transaction did."""

    #: inodes whose record now points into one of the new chunks
    indexed: list[int] = field(default_factory=list)
    #: victims that were in the index, as they were (their log ranges can be released)
    evicted: list[Chunk] = field(default_factory=list)
    #: ids of indexed chunks that lost a record here (moved, replaced or dropped) and
    #: hold none now: nothing points into them any more
    dead: list[int] = field(default_factory=list)


def seal_chunks(index: Index, chunks: Sequence[NewChunk], *, keep_indexed: bool,
                victims: Iterable[int] = (), drops: Iterable[int] = (),
                new_log: int | None = None) -> Sealed:
    """Thread: index ``chunks`` and drop ``victims`` (chunk ids) and ``drops`` (inodes'
    records) in ONE write transaction (see the module docstring for its order).

    ``keep_indexed``: an inode that already has a record of the same version keeps it
    (True) or has it moved into the new chunk (False). ``new_log``: a log id the log id
    sequence is raised past (a log started for these chunks), even when ``chunks`` is
    empty (the log file may exist though nothing was appended to it).
    """
    out = Sealed()
    with index.write() as w:
        for v in victims:
            c = w.drop_chunk(v)
            if c is not None:
                out.evicted.append(c)
        # chunks that lost a record here, in order of first loss (a dict: an ordered set)
        lost: dict[int, None] = {}
        for ino in drops:
            old = w.drop_record(ino)
            if old is not None:
                lost[old.chunk_id] = None
        for nc in chunks:
            for nr in nc.records:
                if _index_record(w, nr, keep_indexed, lost):
                    out.indexed.append(nr.ino)
            w.put_chunk(nc.chunk)
        if chunks:
            w.bump(S.K_NEXT_CHUNK, max(nc.chunk.chunk_id for nc in chunks) + 1)
        if new_log is not None:
            w.bump(S.K_NEXT_LOG, new_log + 1)
        out.dead = [cid for cid in lost if _holds_no_record(w, cid)]
    return out


def _index_record(w: IndexTxn, nr: NewRecord, keep_indexed: bool, lost: dict[int, None]) -> bool:
    e = w.get_entry(nr.ino)
    if e is None or not same_version(e, nr.version):
        return False  # changed or removed while its bytes waited: never index it
    old = w.get_record(nr.ino)
    if old is not None:
        if keep_indexed and same_version(old, nr.version):
            return False
        lost[old.chunk_id] = None
    w.put_record(nr.ino, nr.record)
    if nr.sha256 is not None:
        v = nr.version
        w.publish(nr.ino, S.ContentKey(nr.sha256, v.size, v.mtime_ns, v.src_ino))
    return True


def _holds_no_record(w: IndexTxn, chunk_id: int) -> bool:
    """True when chunk ``chunk_id`` is indexed and none of its members' records is in it."""
    c = w.get_chunk(chunk_id)
    if c is None:  # dropped (a victim) or never indexed: not ours to report
        return False
    return all((r := w.get_record(m)) is None or r.chunk_id != chunk_id for m in c.members)
