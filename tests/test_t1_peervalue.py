"""Tier 1: the peer tier's content keys and value format (dlcachefs.peers.valuefmt): a value
round-trips, and every change to it (a flipped bit anywhere, a cut, trailing bytes,
another key, another version) is refused, never served."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlcachefs.peers.valuefmt import (
    HEADER,
    ITEM_OVERHEAD,
    BadValue,
    content_key,
    decode,
    encode,
    fits,
    value_size,
)

paths = st.binary(min_size=1, max_size=300).filter(lambda b: b"\0" not in b)
namespaces = st.binary(min_size=0, max_size=64).filter(lambda b: b"\0" not in b)


@st.composite
def files(draw):
    data = draw(st.binary(max_size=4096))
    ck = content_key(draw(namespaces), draw(paths), len(data), draw(st.integers(0, 2**63 - 1)))
    return ck, data


@given(files())
def test_a_value_round_trips(f):
    ck, data = f
    v = encode(ck, data)
    assert len(v) == value_size(ck) == HEADER.size + len(ck.content) + len(data)
    assert bytes(decode(v, ck)) == data
    assert ck.key.isascii() and len(ck.key) + len(ck.lease) < 250 and " " not in ck.lease


@settings(max_examples=300)
@given(files(), st.data())
def test_a_flipped_bit_anywhere_is_refused(f, d):
    ck, data = f
    v = bytearray(encode(ck, data))
    i = d.draw(st.integers(0, len(v) - 1))
    v[i] ^= 1 << d.draw(st.integers(0, 7))
    with pytest.raises(BadValue):
        decode(bytes(v), ck)


@given(files(), st.data())
def test_a_cut_or_a_longer_value_is_refused(f, d):
    ck, data = f
    v = encode(ck, data)
    cut = d.draw(st.integers(0, len(v) - 1))
    with pytest.raises(BadValue):
        decode(v[:cut], ck)
    with pytest.raises(BadValue):
        decode(v + d.draw(st.binary(min_size=1, max_size=16)), ck)


@given(files(), files())
def test_another_files_value_is_refused(f, g):
    (ck, _), (ck2, data2) = f, g
    if ck.content == ck2.content:
        return
    with pytest.raises(BadValue):
        decode(encode(ck2, data2), ck)


@given(paths, st.integers(0, 2**40), st.integers(0, 2**62))
def test_another_version_is_another_key(rel, size, mtime):
    ck = content_key(b"ds", rel, size, mtime)
    for other in (content_key(b"ds", rel, size + 1, mtime),
                  content_key(b"ds", rel, size, mtime + 1),
                  content_key(b"ds2", rel, size, mtime),
                  content_key(b"ds", rel + b"x", size, mtime)):
        assert other.key != ck.key and other.content != ck.content


@given(st.binary(max_size=300))
def test_anything_that_is_not_a_value_is_refused(junk):
    ck = content_key(b"ds", b"a", len(junk), 1)
    with pytest.raises(BadValue):
        decode(junk, ck)


def test_the_item_limit_counts_header_key_and_overhead():
    ck = content_key(b"ds", b"a/b.jpg", 1000, 1)
    exact = value_size(ck) + len(ck.key) + ITEM_OVERHEAD
    assert fits(ck, exact) and not fits(ck, exact - 1)
    with pytest.raises(ValueError):
        encode(ck, b"x" * 999)  # the bytes must be the key's version's size


# ----- pieced values (files larger than an item) -----------------------------------------

from dlcachefs.peers.valuefmt import (  # noqa: E402
    MANIFEST,
    PIECE,
    PIECE_ALIGN,
    PIECE_KEY_EXTRA,
    Manifest,
    decode_piece,
    decode_stored,
    encode_manifest,
    encode_piece,
    join_pieces,
    manifest_of,
    piece_key,
    piece_size_for,
)


@st.composite
def pieced(draw):
    """A file, its content key, a piece size (small: many pieces) and its manifest."""
    ck, data = draw(files())
    piece_size = draw(st.integers(1, max(1, len(data) + 3)))
    if not data:
        data = b"x"
        ck = content_key(b"ds", b"one", 1, 1)
    return ck, data, manifest_of(ck, data, piece_size)


def _pieces(ck, data, m):
    return [encode_piece(ck, m, i, data) for i in range(m.pieces)]


@given(pieced())
def test_pieces_round_trip_and_cover_the_file(p):
    ck, data, m = p
    assert m.pieces == -(-len(data) // m.piece_size) and m.size == len(data)
    assert decode_stored(encode_manifest(ck, m), ck) == m
    views = [decode_piece(v, ck, m, i) for i, v in enumerate(_pieces(ck, data, m))]
    assert b"".join(views) == data
    assert all(len(v) == m.piece_size for v in views[:-1]) and 0 < len(views[-1]) <= m.piece_size
    assert join_pieces(ck, m, views) == data
    keys = {piece_key(ck, m.piece_size, i) for i in range(m.pieces)}
    assert len(keys) == m.pieces and ck.key not in keys
    assert all(k.isascii() and " " not in k and len(k) <= len(ck.key) + PIECE_KEY_EXTRA
               and len(k) < 250 for k in keys)


@settings(max_examples=300)
@given(pieced(), st.data())
def test_a_flipped_bit_in_a_piece_or_the_manifest_is_refused(p, d):
    ck, data, m = p
    if d.draw(st.booleans()):
        v = bytearray(encode_manifest(ck, m))
        v[d.draw(st.integers(0, len(v) - 1))] ^= 1 << d.draw(st.integers(0, 7))
        with pytest.raises(BadValue):
            decode_stored(bytes(v), ck)
    else:
        i = d.draw(st.integers(0, m.pieces - 1))
        v = bytearray(encode_piece(ck, m, i, data))
        v[d.draw(st.integers(0, len(v) - 1))] ^= 1 << d.draw(st.integers(0, 7))
        with pytest.raises(BadValue):
            decode_piece(bytes(v), ck, m, i)


@given(pieced(), st.data())
def test_a_cut_or_longer_piece_and_another_index_are_refused(p, d):
    ck, data, m = p
    i = d.draw(st.integers(0, m.pieces - 1))
    v = encode_piece(ck, m, i, data)
    with pytest.raises(BadValue):
        decode_piece(v[:d.draw(st.integers(0, len(v) - 1))], ck, m, i)
    with pytest.raises(BadValue):
        decode_piece(v + d.draw(st.binary(min_size=1, max_size=8)), ck, m, i)
    for j in {i - 1, i + 1} & set(range(m.pieces)):
        with pytest.raises(BadValue):
            decode_piece(v, ck, m, j)
    with pytest.raises(BadValue):  # a whole value is not a piece, nor the reverse
        decode_piece(encode(ck, data), ck, m, i)
    m_cut = encode_manifest(ck, m)
    with pytest.raises(BadValue):
        decode_stored(m_cut[:d.draw(st.integers(0, len(m_cut) - 1))], ck)


@given(pieced(), st.binary(min_size=1, max_size=64), st.data())
def test_pieces_of_two_writers_are_never_put_together(p, other, d):
    """Two writers of one content key with different bytes (a file rewritten in place,
    same size and mtime): a piece of one is refused under the other's manifest, and pieces
    that happen to match their own manifests still fail the whole checksum if mixed."""
    ck, data, m = p
    data2 = bytes(a ^ b for a, b in zip(data, (other * (len(data) // len(other) + 1)),
                                        strict=False))
    if data2 == data:
        return
    m2 = manifest_of(ck, data2, m.piece_size)
    i = d.draw(st.integers(0, m.pieces - 1))
    mine, theirs = _pieces(ck, data, m), _pieces(ck, data2, m2)
    if theirs[i] != mine[i]:
        with pytest.raises(BadValue):
            decode_piece(theirs[i], ck, m, i)
    mixed = [decode_piece(v, ck, m, j) for j, v in enumerate(mine)]
    mixed[i] = memoryview(bytes(data2[slice(*m2.bounds(i))]))
    if bytes(mixed[i]) != data[slice(*m.bounds(i))]:
        with pytest.raises(BadValue):
            join_pieces(ck, m, mixed)


@given(pieced(), pieced())
def test_another_files_manifest_and_pieces_are_refused(p, q):
    (ck, _, m), (ck2, data2, m2) = p, q
    if ck.content == ck2.content:
        return
    with pytest.raises(BadValue):
        decode_stored(encode_manifest(ck2, m2), ck)
    with pytest.raises(BadValue):
        decode_piece(encode_piece(ck2, m2, 0, data2), ck, m, 0)


@given(paths, st.integers(1, 2**31), st.integers(4096, 64 << 20))
def test_a_piece_of_the_chosen_size_fits_the_item_limit(rel, size, item_max):
    ck = content_key(b"ds", rel, size, 1)
    ps = piece_size_for(ck, item_max)
    assert ps % PIECE_ALIGN == 0 and ps >= 0
    if ps:
        piece_value = PIECE.size + len(ck.content) + ps
        key = piece_key(ck, ps, -(-size // ps) - 1)
        assert piece_value + len(key) + ITEM_OVERHEAD <= item_max
        assert piece_size_for(ck, item_max + PIECE_ALIGN) > ps  # the largest that fits
        assert MANIFEST.size + len(ck.content) + len(ck.key) + ITEM_OVERHEAD <= item_max


def test_a_manifest_must_describe_the_keys_file():
    ck = content_key(b"ds", b"big.tar", 10_000, 1)
    data = bytes(range(256)) * 39 + b"x" * 16
    m = manifest_of(ck, data, 4096)
    assert (m.pieces, m.bounds(2)) == (3, (8192, 10_000))
    for bad in (Manifest(m.size, m.piece_size, 2, m.whole),  # pieces do not cover it
                Manifest(m.size + 1, m.piece_size, 3, m.whole)):  # another size
        with pytest.raises(BadValue):
            decode_stored(encode_manifest(ck, bad), ck)
    with pytest.raises(ValueError):
        manifest_of(ck, data[:-1], 4096)
    with pytest.raises(ValueError):
        encode_piece(ck, m, 3, data)


def test_a_manifest_of_tiny_or_countless_pieces_is_refused():
    """A forged manifest (its checksum is no secret) of 1-byte pieces for a large file
    would have every reader allocate and ask for millions of pieces: refused at decode;
    a file that would need more pieces than a reader takes is never stored in pieces."""
    import xxhash

    from dlcachefs.peers import valuefmt as vf

    size = 256 << 20
    ck = vf.ContentKey(key="k" * 40, content=b"c" * 16, size=size)
    for piece_size in (1, 64, vf.PIECE_ALIGN):
        m = vf.Manifest(size, piece_size, -(-size // piece_size), xxhash.xxh3_64_intdigest(b""))
        value = vf.encode_manifest(ck, m)
        if piece_size == vf.PIECE_ALIGN:
            assert vf.decode_stored(value, ck) == m  # 65,536 pieces: what a writer makes
        else:
            with pytest.raises(vf.BadValue):
                vf.decode_stored(value, ck)
    big = vf.ContentKey(key="k" * 40, content=b"c" * 16, size=(vf.MAX_PIECES + 1) * 4096)
    m = vf.Manifest(big.size, 4096, vf.MAX_PIECES + 1, 0)
    with pytest.raises(vf.BadValue):
        vf.decode_stored(vf.encode_manifest(big, m), big)
