"""The LMDB schema of the metaindex: sub-databases, keys and value encodings (version 1).

All keys that are numbers are 8-byte big-endian so that LMDB's byte order is numeric order.

=========  ===========================  ==================================================
database   key                          value
=========  ===========================  ==================================================
meta       ascii name                   format version, source root, counters (u64/bytes);
                                        ``epoch_log/<job>/<rank>/<epoch>``: the epoch's
                                        reordered log and its chunk ids (JSON)
inode      ino                          :class:`Entry` (attributes mirrored from the source)
dirent     parent ino + name bytes      child ino  (a prefix scan lists a directory, sorted)
record     ino                          :class:`Record` (where the cached bytes are)
chunk      chunk id                     :class:`Chunk` (log, offset, length, member inodes)
ckey       ino                          :class:`ContentKey`: the SHA-256 of the file's bytes
                                        at one version (``--shared-cache`` dedup)
content    SHA-256 (32 bytes)           ino whose ``record`` holds those bytes (published
                                        for the other datasets of a shared root)
=========  ===========================  ==================================================

Invariants (checked by :meth:`Index.check_invariants` and by ``dlcachefs verify``):

* every ``record`` names a ``chunk`` that lists the record's inode, and its inode exists;
* every inode in a chunk's member list either has a record in that chunk or was dropped
  since (a chunk may hold dead records; they only cost space until the chunk is evicted);
* the bytes a chunk points at were fsync'ed before the chunk was written to the index;
* a ``content`` entry names an inode whose ``ckey`` has that digest; a reader of another
  process still checks that the inode's record has the ckey's version and that the bytes
  it reads have the record's xxh3 (:meth:`dlcachefs.store.readonly.IndexReader.by_content`),
  so an entry left stale (by a build without content keys that wrote the index since)
  can make a lookup miss, never serve other bytes.

Both ``ckey`` and ``content`` were added in place (version 1 still): an index without
them gets them at its next open by a daemon; readers treat them as empty until then.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

SCHEMA_VERSION = 1
#: LMDB reader slots (one per process with the environment open: the daemon, and each
#: zero-copy reading process, e.g. every DataLoader worker of every job on the mount).
#: LMDB's default, 126, is reached by 8 ranks x 16 workers, and then every read
#: transaction, the daemon's too, fails with MDB_READERS_FULL. Set by the first process
#: that opens the environment, so every opener passes it. 40 bytes of lock file each.
MAX_READERS = 4096

DB_META = b"meta"
DB_INODE = b"inode"
DB_DIRENT = b"dirent"
DB_RECORD = b"record"
DB_CHUNK = b"chunk"
DB_CKEY = b"ckey"
DB_CONTENT = b"content"

# meta keys
K_FORMAT = b"format"
K_SOURCE = b"source"
K_SCAN_DONE = b"scan_done_ns"
K_NEXT_INO = b"next_ino"
K_NEXT_CHUNK = b"next_chunk"
K_NEXT_LOG = b"next_log"
K_FILES = b"n_files"
K_BYTES_TOTAL = b"bytes_total"
K_CACHED_BYTES = b"cached_bytes"
K_CHUNK_BYTES = b"chunk_bytes"

_U64 = struct.Struct(">Q")
_MODE = struct.Struct("<I")  # Entry: mode at byte 8
_U64LE = struct.Struct("<Q")  # Entry: size at byte 24


def epoch_log_prefix(stream: str) -> bytes:
    """meta key prefix of one stream's epoch logs (the epoch number follows)."""
    return f"epoch_log/{stream}/".encode()


def epoch_log_key(stream: str, epoch: int) -> bytes:
    """meta key of the chunk list of one stream's epoch log (LCache's per-epoch MetaIndex)."""
    return epoch_log_prefix(stream) + str(epoch).encode()


def ukey(n: int) -> bytes:
    """8-byte big-endian key for an unsigned number."""
    return _U64.pack(n)


def unkey(b: bytes) -> int:
    return _U64.unpack(b)[0]


def dirent_key(parent: int, name: bytes) -> bytes:
    return _U64.pack(parent) + name


@dataclass(slots=True)
class Entry:
    """One namespace entry: a file, directory or symlink, with attributes as the source has them.

    ``checked_at`` (wall-clock seconds) is when these attributes (for a directory: its
    listing and its children's attributes) were last read from the source.
    """

    ino: int
    parent: int
    name: bytes
    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    blocks: int
    rdev: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    src_ino: int
    checked_at: float
    target: bytes = b""  # symlink target, as stored on the source

    _S = struct.Struct("<QIIIIQQQqqqQdII")

    @staticmethod
    def MODE_SIZE(buf: bytes) -> tuple[int, int]:  # noqa: N802 - a packed-field accessor
        """(mode, size) straight from a packed entry, without unpacking the rest."""
        return _MODE.unpack_from(buf, 8)[0], _U64LE.unpack_from(buf, 24)[0]

    def pack(self) -> bytes:
        return (
            self._S.pack(self.parent, self.mode, self.nlink, self.uid, self.gid, self.size,
                         self.blocks, self.rdev, self.atime_ns, self.mtime_ns, self.ctime_ns,
                         self.src_ino, self.checked_at, len(self.name), len(self.target))
            + self.name + self.target
        )

    @classmethod
    def unpack(cls, ino: int, buf: bytes) -> Entry:
        (parent, mode, nlink, uid, gid, size, blocks, rdev, at, mt, ct, sino, chk, nl, tl) = (
            cls._S.unpack_from(buf))
        o = cls._S.size
        return cls(ino, parent, bytes(buf[o : o + nl]), mode, nlink, uid, gid, size, blocks,
                   rdev, at, mt, ct, sino, chk, bytes(buf[o + nl : o + nl + tl]))


@dataclass(frozen=True, slots=True)
class Record:
    """Where one file's cached bytes live: a record inside a chunk of a log file.

    ``offset`` is the absolute offset of the data in the log; ``mtime_ns``/``src_ino``/
    ``size`` are the source identity the bytes were read under.
    """

    chunk_id: int
    log_id: int
    offset: int
    size: int
    data_xxh: int
    mtime_ns: int
    src_ino: int

    _S = struct.Struct("<QQQQQqQ")

    def pack(self) -> bytes:
        return self._S.pack(self.chunk_id, self.log_id, self.offset, self.size, self.data_xxh,
                            self.mtime_ns, self.src_ino)

    @classmethod
    def unpack(cls, buf: bytes) -> Record:
        return cls(*cls._S.unpack(buf))


@dataclass(frozen=True, slots=True)
class Chunk:
    """A sealed chunk: ``length`` bytes at ``offset`` in log ``log_id``, holding ``members``."""

    chunk_id: int
    log_id: int
    offset: int
    length: int
    sealed_ns: int
    members: tuple[int, ...]

    _S = struct.Struct("<QQQQI")

    def pack(self) -> bytes:
        return self._S.pack(self.log_id, self.offset, self.length, self.sealed_ns,
                            len(self.members)) + struct.pack(f"<{len(self.members)}Q", *self.members)

    @classmethod
    def unpack(cls, chunk_id: int, buf: bytes) -> Chunk:
        log_id, offset, length, sealed, n = cls._S.unpack_from(buf)
        members = struct.unpack_from(f"<{n}Q", buf, cls._S.size)
        return cls(chunk_id, log_id, offset, length, sealed, members)


@dataclass(frozen=True, slots=True)
class ContentKey:
    """The SHA-256 of one file's whole bytes, and the version (size, mtime, source inode)
    those bytes were the file's content at."""

    sha256: bytes
    size: int
    mtime_ns: int
    src_ino: int

    _S = struct.Struct("<32sQqQ")

    def pack(self) -> bytes:
        return self._S.pack(self.sha256, self.size, self.mtime_ns, self.src_ino)

    @classmethod
    def unpack(cls, buf: bytes) -> ContentKey:
        return cls(*cls._S.unpack(buf))

    def same_version(self, v: Entry | Record) -> bool:
        return (self.size, self.mtime_ns, self.src_ino) == (v.size, v.mtime_ns, v.src_ino)
