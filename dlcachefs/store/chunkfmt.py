"""On-disk format of log files, chunks and records (version 1).

A log file is a header followed by chunks, back to back::

    log    := LogHeader chunk*
    chunk  := ChunkHeader record{n_records}        # written with one write() call
    record := RecordHeader key data

* ``LogHeader`` (40 bytes): magic ``DLCLOG01``, version, log id, creation time, and an
  xxh3-64 of the header itself.
* ``ChunkHeader`` (48 bytes): magic ``DLCCHNK1``, version, record count, chunk id, payload
  length (bytes after the header), xxh3-64 of the whole payload, xxh3-64 of the header.
* ``RecordHeader`` (56 bytes): magic ``DREC``, key length, namespace inode, data length,
  the source identity the bytes were read under (mtime_ns, source inode), xxh3-64 of the
  data, xxh3-64 of header + key. The key is the file's path relative to the source root.
  A record with inode 0 and an empty key is a filler: it holds the place of a sample
  whose file changed or was deleted after a reordered log was planned (see
  :func:`dlcachefs.clairvoyance.reorder.filler_record`); nothing indexes inode 0.

Two levels of checksums: the payload checksum lets a reader verify a whole chunk in one
pass; the per-record checksums let it salvage the good records of a damaged chunk and
let ``dlcachefs verify`` say exactly which files were hit. All integers little-endian.
Everything here is pure (bytes in, values out) so it can be fuzzed without I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import xxhash

from dlcachefs.errors import FormatError

VERSION = 1

LOG_MAGIC = b"DLCLOG01"
CHUNK_MAGIC = b"DLCCHNK1"
RECORD_MAGIC = b"DREC"

_LOG = struct.Struct("<8sHHIQQ")  # magic, version, flags, reserved, log_id, created_ns
_CHUNK = struct.Struct("<8sHHIQQQ")  # magic, version, flags, n_records, chunk_id, payload_len, payload_xxh
_RECORD = struct.Struct("<4sIQQqQQ")  # magic, key_len, ino, size, mtime_ns, src_ino, data_xxh
_U64 = struct.Struct("<Q")

LOG_HEADER_SIZE = _LOG.size + 8
CHUNK_HEADER_SIZE = _CHUNK.size + 8
RECORD_HEADER_SIZE = _RECORD.size + 8

MAX_KEY = 1 << 16


def checksum(data: bytes | memoryview) -> int:
    """The checksum used everywhere in the format: xxh3, 64 bits."""
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True, slots=True)
class RecordIn:
    """A record to be written: one source file's bytes and the identity they were read under."""

    ino: int
    key: bytes
    mtime_ns: int
    src_ino: int
    data: bytes | memoryview


@dataclass(frozen=True, slots=True)
class RecordMeta:
    """A record as found in a chunk. ``data_offset`` is relative to the chunk start."""

    ino: int
    key: bytes
    size: int
    mtime_ns: int
    src_ino: int
    data_xxh: int
    data_offset: int


@dataclass(frozen=True, slots=True)
class ChunkHeader:
    chunk_id: int
    n_records: int
    payload_len: int
    payload_xxh: int

    @property
    def total_len(self) -> int:
        return CHUNK_HEADER_SIZE + self.payload_len


def encode_log_header(log_id: int, created_ns: int) -> bytes:
    head = _LOG.pack(LOG_MAGIC, VERSION, 0, 0, log_id, created_ns)
    return head + _U64.pack(checksum(head))


def decode_log_header(buf: bytes | memoryview) -> tuple[int, int]:
    """Return (log_id, created_ns); raise FormatError if the header is not a valid v1 header."""
    if len(buf) < LOG_HEADER_SIZE:
        raise FormatError("log header truncated")
    head = bytes(buf[: _LOG.size])
    magic, version, _flags, _res, log_id, created = _LOG.unpack(head)
    if magic != LOG_MAGIC:
        raise FormatError("not a dlcachefs log file (bad magic)")
    if version != VERSION:
        raise FormatError(f"log format version {version} is not supported (this build reads {VERSION})")
    (xh,) = _U64.unpack_from(buf, _LOG.size)
    if xh != checksum(head):
        raise FormatError("log header checksum mismatch")
    return log_id, created


def encode_record(rec: RecordIn) -> bytes:
    """Header + key + data of one record."""
    if len(rec.key) >= MAX_KEY:
        raise ValueError("record key too long")
    head = _RECORD.pack(
        RECORD_MAGIC, len(rec.key), rec.ino, len(rec.data), rec.mtime_ns, rec.src_ino, checksum(rec.data)
    )
    return b"".join((head, _U64.pack(checksum(head + rec.key)), rec.key, rec.data))


def encode_chunk(chunk_id: int, records: Sequence[RecordIn]) -> tuple[bytes, list[RecordMeta]]:
    """Serialize a chunk. Returns the bytes and where each record's data sits in them."""
    parts, metas, _ = encode_chunk_parts(chunk_id, records)
    return b"".join(parts), metas


def encode_chunk_parts(chunk_id: int, records: Sequence[RecordIn]
                       ) -> tuple[list[bytes], list[RecordMeta], int]:
    """A chunk as buffers to write in a row (``b"".join`` of them is :func:`encode_chunk`'s
    bytes), with the records' places and the total length. The files' bytes are not
    copied: the writer hands the buffers to one ``pwritev`` (the copies cost ~10% of the
    daemon's CPU per fetched file); each file's data is checksummed once."""
    parts: list[bytes] = [b""]  # the header, once the payload's checksum is known
    metas: list[RecordMeta] = []
    payload = xxhash.xxh3_64()
    pos = CHUNK_HEADER_SIZE
    for rec in records:
        if len(rec.key) >= MAX_KEY:
            raise ValueError("record key too long")
        data_xxh = checksum(rec.data)
        head = _RECORD.pack(RECORD_MAGIC, len(rec.key), rec.ino, len(rec.data), rec.mtime_ns,
                            rec.src_ino, data_xxh)
        rh = b"".join((head, _U64.pack(checksum(head + rec.key)), rec.key))
        payload.update(rh)
        payload.update(rec.data)
        parts.append(rh)
        parts.append(rec.data)
        metas.append(RecordMeta(rec.ino, rec.key, len(rec.data), rec.mtime_ns, rec.src_ino,
                                data_xxh, pos + len(rh)))
        pos += len(rh) + len(rec.data)
    head = _CHUNK.pack(CHUNK_MAGIC, VERSION, 0, len(records), chunk_id, pos - CHUNK_HEADER_SIZE,
                       payload.intdigest())
    parts[0] = head + _U64.pack(checksum(head))
    return parts, metas, pos


def encode_chunk_header(chunk_id: int, n_records: int, payload_len: int, payload_xxh: int
                        ) -> bytes:
    """A chunk header on its own, for chunks whose records are written piecewise (the
    reordered next-epoch log): the header goes last, once the payload is complete."""
    head = _CHUNK.pack(CHUNK_MAGIC, VERSION, 0, n_records, chunk_id, payload_len, payload_xxh)
    return head + _U64.pack(checksum(head))


def record_len(key_len: int, size: int) -> int:
    """Bytes one record takes in a chunk."""
    return RECORD_HEADER_SIZE + key_len + size


def decode_chunk_header(buf: bytes | memoryview) -> ChunkHeader:
    """Parse and verify a chunk header; raise FormatError on any damage."""
    if len(buf) < CHUNK_HEADER_SIZE:
        raise FormatError("chunk header truncated")
    head = bytes(buf[: _CHUNK.size])
    magic, version, _flags, n, chunk_id, plen, pxh = _CHUNK.unpack(head)
    if magic != CHUNK_MAGIC:
        raise FormatError("bad chunk magic")
    if version != VERSION:
        raise FormatError(f"chunk format version {version} is not supported")
    (xh,) = _U64.unpack_from(buf, _CHUNK.size)
    if xh != checksum(head):
        raise FormatError("chunk header checksum mismatch")
    return ChunkHeader(chunk_id, n, plen, pxh)


def iter_records(chunk: bytes | memoryview, header: ChunkHeader) -> Iterator[RecordMeta]:
    """Walk the records of a chunk whose header is already verified.

    Raises FormatError when a record header is damaged (the walk cannot go on past it).
    Does not verify data checksums: see :func:`verify_chunk`.
    """
    mv = memoryview(chunk)
    end = CHUNK_HEADER_SIZE + header.payload_len
    if len(mv) < end:
        raise FormatError("chunk truncated")
    pos = CHUNK_HEADER_SIZE
    for _ in range(header.n_records):
        if pos + RECORD_HEADER_SIZE > end:
            raise FormatError("record header past end of chunk")
        head = bytes(mv[pos : pos + _RECORD.size])
        magic, klen, ino, size, mtime_ns, src_ino, dxh = _RECORD.unpack(head)
        (hxh,) = _U64.unpack_from(mv, pos + _RECORD.size)
        key_start = pos + RECORD_HEADER_SIZE
        if magic != RECORD_MAGIC or key_start + klen + size > end:
            raise FormatError("damaged record header")
        key = bytes(mv[key_start : key_start + klen])
        if hxh != checksum(head + key):
            raise FormatError("record header checksum mismatch")
        data_off = key_start + klen
        yield RecordMeta(ino, key, size, mtime_ns, src_ino, dxh, data_off)
        pos = data_off + size
    if pos != end:
        raise FormatError("chunk payload length does not match its records")


def verify_chunk(chunk: bytes | memoryview) -> tuple[ChunkHeader, list[RecordMeta], int]:
    """Verify a whole chunk read from disk.

    Returns (header, good records, number of bad records). The fast path is one checksum
    over the payload; only when it fails are records checked one by one, so that the good
    ones can still be served. Raises FormatError when the header itself is damaged or the
    record structure cannot be walked (then nothing in the chunk can be trusted).
    """
    header = decode_chunk_header(chunk)
    mv = memoryview(chunk)
    payload = mv[CHUNK_HEADER_SIZE : CHUNK_HEADER_SIZE + header.payload_len]
    if len(payload) != header.payload_len:
        raise FormatError("chunk truncated")
    records = list(iter_records(mv, header))
    if checksum(payload) == header.payload_xxh:
        return header, records, 0
    good = [r for r in records if checksum(mv[r.data_offset : r.data_offset + r.size]) == r.data_xxh]
    return header, good, len(records) - len(good)


def verify_record(chunk: bytes | memoryview, rec: RecordMeta) -> bool:
    """True when one record's data matches its checksum."""
    mv = memoryview(chunk)
    return checksum(mv[rec.data_offset : rec.data_offset + rec.size]) == rec.data_xxh
