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
