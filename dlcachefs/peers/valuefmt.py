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
