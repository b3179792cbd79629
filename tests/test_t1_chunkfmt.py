"""Tier 1: the on-disk format (dlcachefs.store.chunkfmt), pure bytes in / values out."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlcachefs.errors import FormatError
from dlcachefs.store.chunkfmt import (
    CHUNK_HEADER_SIZE,
    LOG_HEADER_SIZE,
    MAX_KEY,
    RECORD_HEADER_SIZE,
    ChunkHeader,
    RecordIn,
    checksum,
    decode_chunk_header,
    decode_log_header,
    encode_chunk,
    encode_log_header,
    encode_record,
    iter_records,
    verify_chunk,
    verify_record,
)

# keys are arbitrary bytes: non-UTF-8 names must round-trip unchanged
keys = st.binary(min_size=0, max_size=80)
U64 = st.integers(0, 2**64 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)


@st.composite
def record_lists(draw, max_records=20, max_size=200_000):
    n = draw(st.integers(0, max_records))
    seed = draw(st.integers(0, 2**32))
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        # data is made from a seed: hypothesis drawing 200 KB byte by byte would be slow
        size = draw(st.one_of(st.integers(0, 64), st.integers(0, max_size)))
        out.append(RecordIn(ino=draw(U64), key=draw(keys), mtime_ns=draw(I64),
                            src_ino=draw(U64), data=rng.randbytes(size)))
    return out


def small_records() -> list[RecordIn]:
    return [
        RecordIn(16, b"train/a.jpg", 1_700_000_000_000_000_000, 42, b"hello world" * 3),
        RecordIn(17, b"train/\xff\xfe-not-utf8", -5, 0, b""),
        RecordIn(18, b"", 7, 2**64 - 1, bytes(range(97))),
    ]


def same_record(meta, rec: RecordIn, chunk: bytes) -> bool:
    data = chunk[meta.data_offset : meta.data_offset + meta.size]
    return (meta.ino, meta.key, meta.size, meta.mtime_ns, meta.src_ino, data) == (
        rec.ino, rec.key, len(rec.data), rec.mtime_ns, rec.src_ino, bytes(rec.data))


# ----- round trips --------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(records=record_lists(), chunk_id=U64)
def test_chunk_round_trip(records, chunk_id):
    chunk, metas = encode_chunk(chunk_id, records)
    header, good, bad = verify_chunk(chunk)
    assert bad == 0
    assert header.chunk_id == chunk_id
    assert header.n_records == len(records)
    assert header.total_len == len(chunk)
    assert good == metas
    assert [m for m in iter_records(chunk, decode_chunk_header(chunk))] == metas
    for meta, rec in zip(good, records, strict=True):
        assert same_record(meta, rec, chunk)
        assert verify_record(chunk, meta)
        assert meta.data_xxh == checksum(rec.data)
    expected = CHUNK_HEADER_SIZE + sum(RECORD_HEADER_SIZE + len(r.key) + len(r.data)
                                       for r in records)
    assert len(chunk) == expected


def test_chunk_with_memoryview_input_and_data():
    recs = [RecordIn(1, b"k", 0, 0, memoryview(b"abcdef")[1:4])]
    chunk, metas = encode_chunk(3, recs)
    h, good, bad = verify_chunk(memoryview(chunk))
    assert bad == 0 and good == metas
    assert chunk[good[0].data_offset : good[0].data_offset + good[0].size] == b"bcd"


def test_key_too_long_is_refused():
    with pytest.raises(ValueError):
        encode_record(RecordIn(1, b"k" * MAX_KEY, 0, 0, b""))
    encode_record(RecordIn(1, b"k" * (MAX_KEY - 1), 0, 0, b""))


@given(log_id=U64, created=U64)
def test_log_header_round_trip(log_id, created):
    h = encode_log_header(log_id, created)
    assert len(h) == LOG_HEADER_SIZE
    assert decode_log_header(h) == (log_id, created)
    assert decode_log_header(memoryview(h + b"trailing chunk bytes")) == (log_id, created)


def test_log_header_damage():
    h = encode_log_header(5, 123)
    for cut in range(LOG_HEADER_SIZE):
        with pytest.raises(FormatError):
            decode_log_header(h[:cut])
    for pos in range(LOG_HEADER_SIZE):
        bad = bytearray(h)
        bad[pos] ^= 0x01
        with pytest.raises(FormatError):
            decode_log_header(bytes(bad))
    # a chunk is not a log header
    chunk, _ = encode_chunk(1, small_records())
    with pytest.raises(FormatError):
        decode_log_header(chunk)


def test_log_of_chunks_walks_back_to_back():
    """A log is a header then chunks; walking by total_len finds every chunk."""
    chunks = [encode_chunk(i, small_records()[: i % 4])[0] for i in range(1, 6)]
    log = encode_log_header(9, 1) + b"".join(chunks)
    assert decode_log_header(log) == (9, 1)
    pos, seen = LOG_HEADER_SIZE, []
    while pos < len(log):
        h = decode_chunk_header(log[pos:])
        _, good, bad = verify_chunk(log[pos : pos + h.total_len])
        assert bad == 0
        seen.append(h.chunk_id)
        pos += h.total_len
    assert seen == [1, 2, 3, 4, 5]
    assert pos == len(log)


# ----- torn tails ----------------------------------------------------------------------


def test_every_truncation_of_a_chunk_is_refused():
    recs = small_records()
    chunk, _ = encode_chunk(7, recs)
    for cut in range(len(chunk)):
        torn = chunk[:cut]
        try:
            _, good, _ = verify_chunk(torn)
        except FormatError:
            continue
        # never reached with the current format; if it ever is, no wrong data may come out
        for meta in good:
            rec = next(r for r in recs if r.ino == meta.ino)
            assert same_record(meta, rec, torn)
        assert len(good) < len(recs)


def test_truncated_chunk_iter_records_raises():
    chunk, _ = encode_chunk(7, small_records())
    h = decode_chunk_header(chunk)
    with pytest.raises(FormatError):
        list(iter_records(chunk[:-1], h))


def test_header_lies_about_record_count():
    """A header whose n_records disagrees with the payload cannot be walked."""
    recs = small_records()
    chunk, _ = encode_chunk(7, recs)
    h = decode_chunk_header(chunk)
    with pytest.raises(FormatError):
        list(iter_records(chunk, ChunkHeader(h.chunk_id, h.n_records - 1, h.payload_len,
                                             h.payload_xxh)))
    with pytest.raises(FormatError):
        list(iter_records(chunk, ChunkHeader(h.chunk_id, h.n_records + 1, h.payload_len,
                                             h.payload_xxh)))


# ----- corruption ----------------------------------------------------------------------


def check_corruption(recs: list[RecordIn], chunk: bytes, pos: int, xor: int) -> None:
    """Flip bits of one byte; the damage must be seen and no wrong bytes come out."""
    bad = bytearray(chunk)
    bad[pos] ^= xor
    bad = bytes(bad)
    try:
        header, good, n_bad = verify_chunk(bad)
    except FormatError:
        return
    # not refused as a whole: then the damage was in some record's data
    assert n_bad >= 1, f"corruption at {pos} not detected"
    assert len(good) + n_bad == len(recs)
    for meta in good:
        rec = next(r for r in recs if r.ino == meta.ino)
        assert same_record(meta, rec, bad), f"wrong bytes served after corruption at {pos}"
        assert not (meta.data_offset <= pos < meta.data_offset + meta.size)


def test_every_single_byte_corruption_is_detected():
    recs = small_records()
    chunk, _ = encode_chunk(11, recs)
    for pos in range(len(chunk)):
        for xor in (0x01, 0x80, 0xFF):
            check_corruption(recs, chunk, pos, xor)


@settings(max_examples=150, deadline=None)
@given(records=record_lists(max_records=6, max_size=3000).filter(bool), data=st.data())
def test_random_single_byte_corruption(records, data):
    # distinct inodes so that a good record can be matched with what was written
    records = [RecordIn(i, r.key, r.mtime_ns, r.src_ino, r.data) for i, r in enumerate(records)]
    chunk, _ = encode_chunk(1, records)
    pos = data.draw(st.integers(0, len(chunk) - 1), label="pos")
    xor = data.draw(st.integers(1, 255), label="xor")
    check_corruption(records, chunk, pos, xor)


def test_corrupted_data_salvages_other_records():
    recs = small_records()
    chunk, metas = encode_chunk(11, recs)
    bad = bytearray(chunk)
    bad[metas[0].data_offset + 2] ^= 0x40
    _, good, n_bad = verify_chunk(bytes(bad))
    assert n_bad == 1
    assert [m.ino for m in good] == [17, 18]
    assert not verify_record(bytes(bad), metas[0])
    assert verify_record(bytes(bad), metas[2])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=40), st.integers(1, 5),
       st.integers(0, 100), st.integers(1, 700))
def test_log_writes_buffers_in_a_row(tmp_path_factory, bufs, iov_max, off, piece):
    """The writer hands a chunk's buffers to pwritev without joining them (several calls
    when there are more than IOV_MAX buffers or WRITE_PIECE bytes, a buffer cut across
    two): the file holds exactly their concatenation."""
    import os

    from dlcachefs.store import logs as logstore

    path = tmp_path_factory.mktemp("w") / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        old = logstore._IOV_MAX, logstore.WRITE_PIECE
        logstore._IOV_MAX, logstore.WRITE_PIECE = iov_max, piece
        calls: list[tuple[int, int]] = []
        real = os.pwritev

        def pwritev(fd_, batch, at):
            calls.append((len(batch), sum(len(b) for b in batch)))
            return real(fd_, batch, at)

        try:
            os.pwritev = pwritev
            logstore._pwrite_all(fd, bufs, off)
        finally:
            os.pwritev = real
            logstore._IOV_MAX, logstore.WRITE_PIECE = old
        # never more than IOV_MAX buffers or WRITE_PIECE bytes a call, and no empty call
        assert all(0 < n <= iov_max and 0 < size <= piece for n, size in calls), calls
        assert os.pread(fd, off + 20000, 0)[off:] == b"".join(bufs)
    finally:
        os.close(fd)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.binary(min_size=1, max_size=50), st.binary(max_size=500)),
                max_size=12), st.integers(0, 2**32))
def test_chunk_parts_are_the_chunk(recs, cid):
    """encode_chunk_parts' buffers, joined, are a chunk that decodes to the records, and
    the length it reports is theirs."""
    from dlcachefs.store.chunkfmt import encode_chunk_parts

    ins = [RecordIn(i + 1, k, 7, 9, d) for i, (k, d) in enumerate(recs)]
    parts, metas, n = encode_chunk_parts(cid, ins)
    blob = b"".join(parts)
    assert len(blob) == n
    header, good, bad = verify_chunk(blob)  # the payload checksum holds
    assert header.chunk_id == cid and header.n_records == len(ins) and bad == 0
    assert [g.data_offset for g in good] == [m.data_offset for m in metas]
    for m, r in zip(metas, ins, strict=True):
        assert blob[m.data_offset:m.data_offset + m.size] == r.data
