"""What the peer tier stores: the content key of a file version, and the value format.

Nodes share files by *content key*: the dataset's name in the tier, the file's path
relative to the source root, its size and its mtime_ns. Never our chunk ids, which differ
per node, and the source's inode number only with ``--peer-key-inode`` (it differs per
client on sshfs; it agrees on NFS and Lustre). So by default the tier trusts less than the
local cache does (size + mtime_ns + source inode): a file replaced by one of the same size
and mtime (1-second mtimes, ``touch -r``) is a local miss but may be served from the tier
in its old version. The memcached key is a hash of it (memcached keys are at
most 250 bytes of printable ASCII, paths are not); the full content key is written into
the value, so a hash collision, a value written by another program or for another version
is never served.

A value::

    magic "DLCP" | version u8 | 3 zero bytes | key_len u32 | data_len u64 | xxh3_64 u64
    | content key (key_len bytes) | file bytes (data_len bytes)

little-endian; the checksum is xxh3-64 over the content key and the file bytes. A value
is served only when all of it checks out (:func:`decode`): its magic and version, its key
equal to the one asked for, its length exactly what the header says and the file's size,
its checksum. A partial value (a torn write, a truncated item), a value of another
version, a foreign value or one larger than the item limit (:func:`fits`) are refused;
the caller reads the source instead.

A file whose value does not fit an item is stored in *pieces* (ranges of ``piece_size``
bytes, the last one shorter; :func:`piece_size_for` picks the largest size an item
holds) and a *manifest* under the file's own key, written after its pieces::

    manifest: magic "DLCM" | version u8 | 3 zero bytes | key_len u32 | pieces u32
              | size u64 | piece_size u64 | whole xxh3_64 u64 | header xxh3_64 u64
              | content key
    piece i:  magic "DLCQ" | version u8 | 3 zero bytes | key_len u32 | index u32
              | data_len u64 | xxh3_64 u64 | content key | the piece's bytes

``whole`` is the checksum a whole value would carry (content key and file bytes); the
manifest's own checksum covers its header and key. A piece's memcached key is the
file's key, the piece size and the index (:func:`piece_key`: a writer with another item
limit writes other keys), and its checksum covers the content key, the index, the piece
size, the manifest's ``whole`` and the bytes: a piece of another writer's bytes of the
same version (a file rewritten in place with the same size and mtime) is refused on
its own, and the pieces put together are checked against ``whole`` once more
(:func:`join_pieces`), so a file served from pieces is one writer's bytes or nothing.

Pure functions, no I/O, no trio: called in the peer tier's worker threads.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"DLCP"
VERSION = 1
HEADER = struct.Struct("<4sB3sIQQ")
_RESERVED = b"\0\0\0"
#: what memcached adds to an item besides key and value (item header, CAS, suffix), rounded up
ITEM_OVERHEAD = 1024
#: memcached keys of this format start with this (readable in ``stats cachedump``)
KEY_PREFIX = "dlcfs1:"
LEASE_SUFFIX = ":lease"


#: a manifest's header (its last field, the header checksum, covers the others and the key)
MANIFEST_MAGIC = b"DLCM"
MANIFEST = struct.Struct("<4sB3sIIQQQQ")
PIECE_MAGIC = b"DLCQ"
PIECE = struct.Struct("<4sB3sIIQQ")
#: room a piece key takes past its file's key (":<piece size hex>:<index>")
PIECE_KEY_EXTRA = 40
#: the smallest piece worth storing; pieces are a multiple of it
PIECE_ALIGN = 4096
#: the most pieces a manifest may name (a 256 MiB file in 4 KiB pieces is 65,536)
MAX_PIECES = 1 << 17


class BadValue(ValueError):
    """A value that must not be served; ``reason`` is one word for the stats."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ContentKey:
    """One version of one file of one dataset, as every node names it."""

    content: bytes  # namespace, path, size, mtime_ns: written into the value
    key: str  # the memcached key (a hash of ``content``)
    size: int

    @property
    def lease(self) -> str:
        """The memcached key of the lease on this version (``add`` decides who reads it)."""
        return self.key + LEASE_SUFFIX


def content_key(namespace: bytes, rel: bytes, size: int, mtime_ns: int,
                src_ino: int | None = None) -> ContentKey:
    """The content key of version (``size``, ``mtime_ns``) of ``rel`` in ``namespace``;
    with ``src_ino`` (``--peer-key-inode``) the source inode is part of it too."""
    parts = [namespace, rel, b"%d" % size, b"%d" % mtime_ns]
    if src_ino is not None:
        parts.append(b"ino=%d" % src_ino)
    content = b"\0".join(parts)
    digest = hashlib.blake2b(content, digest_size=20).hexdigest()
    return ContentKey(content, KEY_PREFIX + digest, size)


def value_size(ck: ContentKey) -> int:
    """Bytes of the value of ``ck``'s file."""
    return HEADER.size + len(ck.content) + ck.size


def fits(ck: ContentKey, item_max: int) -> bool:
    """Whether the value of ``ck``'s file fits an item of a server whose limit is
    ``item_max`` (memcached ``-I``), with room for memcached's own item overhead."""
    return value_size(ck) + len(ck.key) + ITEM_OVERHEAD <= item_max


def _checksum(content: bytes, data: bytes | memoryview) -> int:
    h = xxhash.xxh3_64()
    h.update(content)
    h.update(data)
    return h.intdigest()


def encode(ck: ContentKey, data: bytes | memoryview) -> bytes:
    """The value of ``data`` under ``ck`` (one copy of the bytes)."""
    if len(data) != ck.size:
        raise ValueError(f"{len(data)} bytes for a content key of {ck.size}")
    head = HEADER.pack(MAGIC, VERSION, _RESERVED, len(ck.content), len(data), _checksum(ck.content, data))
    return b"".join((head, ck.content, data))


def decode(value: bytes, ck: ContentKey) -> memoryview:
    """The file bytes of ``value`` if it is a whole, intact value of ``ck``; else
    :class:`BadValue`. A view into ``value`` (no copy)."""
    if len(value) < HEADER.size:
        raise BadValue("short")
    magic, version, reserved, key_len, data_len, checksum = HEADER.unpack_from(value)
    if magic != MAGIC:
        raise BadValue("magic")
    if version != VERSION or reserved != _RESERVED:
        raise BadValue("version")
    mv = memoryview(value)
    start = HEADER.size + key_len
    if start > len(value) or mv[HEADER.size:start] != ck.content:
        raise BadValue("key")
    if data_len != ck.size or len(value) - start != data_len:
        raise BadValue("length")
    data = mv[start:]
    if _checksum(ck.content, data) != checksum:
        raise BadValue("checksum")
    return data


# ----- pieced values: files larger than an item ------------------------------------------


@dataclass(frozen=True, slots=True)
class Manifest:
    """How a file is stored in pieces: its ``size``, ``piece_size`` (the last piece is
    shorter), the number of ``pieces`` and the ``whole`` file's checksum."""

    size: int
    piece_size: int
    pieces: int
    whole: int

    def bounds(self, i: int) -> tuple[int, int]:
        """The byte range ``[start, end)`` of piece ``i``."""
        start = i * self.piece_size
        return start, min(self.size, start + self.piece_size)


def piece_size_for(ck: ContentKey, item_max: int) -> int:
    """The largest multiple of :data:`PIECE_ALIGN` whose piece value fits an item of
    ``item_max`` bytes (its key, header, content key and memcached's overhead included);
    0 when not even one fits."""
    room = (item_max - ITEM_OVERHEAD - len(ck.key) - PIECE_KEY_EXTRA - PIECE.size
            - len(ck.content))
    return max(0, room // PIECE_ALIGN * PIECE_ALIGN)


def piece_key(ck: ContentKey, piece_size: int, i: int) -> str:
    """The memcached key of piece ``i`` of ``ck``'s file in pieces of ``piece_size``."""
    return f"{ck.key}:{piece_size:x}:{i}"


def manifest_of(ck: ContentKey, data: bytes | memoryview, piece_size: int) -> Manifest:
    """The manifest of ``data`` (``ck``'s file) in pieces of ``piece_size`` (checksums the
    whole file: a worker thread for large files)."""
    if len(data) != ck.size:
        raise ValueError(f"{len(data)} bytes for a content key of {ck.size}")
    if piece_size <= 0:
        raise ValueError("a piece size must be positive")
    return Manifest(ck.size, piece_size, -(-ck.size // piece_size),
                    _checksum(ck.content, data))


def encode_manifest(ck: ContentKey, m: Manifest) -> bytes:
    """The value stored under ``ck``'s own key for a file in pieces."""
    head = MANIFEST.pack(MANIFEST_MAGIC, VERSION, _RESERVED, len(ck.content), m.pieces,
                         m.size, m.piece_size, m.whole, 0)[:-8]
    return b"".join((head, _checksum(head, ck.content).to_bytes(8, "little"), ck.content))


def _decode_manifest(value: bytes, ck: ContentKey) -> Manifest:
    if len(value) < MANIFEST.size:
        raise BadValue("short")
    (_magic, version, reserved, key_len, pieces, size, piece_size, whole,
     check) = MANIFEST.unpack_from(value)
    if version != VERSION or reserved != _RESERVED:
        raise BadValue("version")
    if len(value) != MANIFEST.size + key_len or value[MANIFEST.size:] != ck.content:
        raise BadValue("key")
    if _checksum(value[:MANIFEST.size - 8], ck.content) != check:
        raise BadValue("checksum")
    if size != ck.size or piece_size <= 0 or pieces != -(-size // piece_size):
        raise BadValue("length")
    if pieces > MAX_PIECES:
        # never written so (piece_size_for): a forged manifest of 1-byte pieces would
        # have every reader allocate and ask for millions of pieces
        raise BadValue("length")
    return Manifest(size, piece_size, pieces, whole)


def decode_stored(value: bytes, ck: ContentKey) -> memoryview | Manifest:
    """What is stored under ``ck``'s own key: the file's bytes (a whole value,
    :func:`decode`) or the :class:`Manifest` of its pieces; else :class:`BadValue`."""
    if value[:4] == MANIFEST_MAGIC:
        return _decode_manifest(value, ck)
    return decode(value, ck)


def _piece_checksum(ck: ContentKey, m: Manifest, i: int, data: bytes | memoryview) -> int:
    h = xxhash.xxh3_64()
    h.update(ck.content)
    h.update(struct.pack("<IQQ", i, m.piece_size, m.whole))
    h.update(data)
    return h.intdigest()


def encode_piece(ck: ContentKey, m: Manifest, i: int, data: bytes | memoryview) -> bytes:
    """The value of piece ``i`` of ``data`` (the whole file, ``ck``'s version)."""
    if len(data) != m.size or not 0 <= i < m.pieces:
        raise ValueError(f"piece {i} of {len(data)} bytes under a manifest of {m}")
    start, end = m.bounds(i)
    piece = memoryview(data)[start:end]
    head = PIECE.pack(PIECE_MAGIC, VERSION, _RESERVED, len(ck.content), i, len(piece),
                      _piece_checksum(ck, m, i, piece))
    return b"".join((head, ck.content, piece))


def decode_piece(value: bytes, ck: ContentKey, m: Manifest, i: int) -> memoryview:
    """The bytes of piece ``i`` if ``value`` is that piece of the file ``m`` describes,
    whole and intact; else :class:`BadValue`. A view into ``value``."""
    if len(value) < PIECE.size:
        raise BadValue("short")
    magic, version, reserved, key_len, index, data_len, checksum = PIECE.unpack_from(value)
    if magic != PIECE_MAGIC:
        raise BadValue("magic")
    if version != VERSION or reserved != _RESERVED:
        raise BadValue("version")
    mv = memoryview(value)
    start = PIECE.size + key_len
    if start > len(value) or mv[PIECE.size:start] != ck.content:
        raise BadValue("key")
    lo, hi = m.bounds(i)
    if index != i or data_len != hi - lo or len(value) - start != data_len:
        raise BadValue("length")
    data = mv[start:]
    if _piece_checksum(ck, m, i, data) != checksum:
        raise BadValue("checksum")
    return data


def join_pieces(ck: ContentKey, m: Manifest, pieces: list[memoryview]) -> bytes:
    """The file from its checked pieces, in order, if it matches the manifest's whole
    checksum; else :class:`BadValue` (``"whole"``). One copy; a worker thread."""
    if len(pieces) != m.pieces:
        raise BadValue("length")
    data = b"".join(pieces)
    if len(data) != m.size or _checksum(ck.content, data) != m.whole:
        raise BadValue("whole")
    return data
