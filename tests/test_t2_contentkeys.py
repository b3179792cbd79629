"""Content keys in the index (--shared-cache dedup): what is offered to other datasets,
when an offer is withdrawn, and what a reader of another process accepts; the manifest
and attribute parsers."""

from __future__ import annotations

import hashlib
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from dlcachefs.cache.dedup import parse_key, parse_manifest
from dlcachefs.store.index import Index
from dlcachefs.store.readonly import IndexReader
from dlcachefs.store.schema import Chunk, ContentKey, Entry, Record

ROOT = 1


def _entry(ino: int, size: int, mtime: int = 5, parent: int = ROOT) -> Entry:
    return Entry(ino, parent, f"f{ino}".encode(), 0o100644, 1, 0, 0, size, 0, 0, 0, mtime, 0,
                 ino + 100, 0.0)


def _index(tmp_path) -> Index:
    ix = Index(str(tmp_path / "meta.lmdb"))
    with ix.write() as w:
        w.put_entry(Entry(ROOT, 0, b"", 0o40755, 2, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1e18))
    return ix


def _cache(ix: Index, ino: int, data: bytes, mtime: int = 5, chunk: int = 1) -> ContentKey:
    """``ino`` cached in chunk ``chunk`` with its key offered (as a seal does it)."""
    e = _entry(ino, len(data), mtime)
    key = ContentKey(hashlib.sha256(data).digest(), len(data), mtime, e.src_ino)
    with ix.write() as w:
        w.put_entry(e)
        w.put_record(ino, Record(chunk, 1, 4096 * ino, len(data), 7, mtime, e.src_ino))
        w.put_chunk(Chunk(chunk, 1, 4096 * ino, len(data) + 64, 0, (ino,)))
        w.publish(ino, key)
    return key


def _offered(path: str, sha: bytes) -> int | None:
    """The inode a reader of another process finds for ``sha`` (py-lmdb opens one
    environment per path and process: the caller has closed its :class:`Index`)."""
    r = IndexReader(path)
    try:
        loc = r.by_content(sha)
        return None if loc is None else loc.ino
    finally:
        r.close()


def test_an_offer_is_withdrawn_with_its_record_and_with_its_version(tmp_path):
    ix = _index(tmp_path)
    path = ix.path
    k2 = _cache(ix, 2, b"two" * 100)
    k3 = _cache(ix, 3, b"three" * 100, chunk=2)
    assert ix.check_invariants() == []
    ix.close()
    assert _offered(path, k2.sha256) == 2 and _offered(path, k3.sha256) == 3
    ix = Index(path)
    # the chunk is evicted: its record goes, and so does the offer (the key stays known)
    with ix.write() as w:
        w.drop_chunk(1)
    assert ix.get_key(2) == k2
    # a new version of 3 is cached: the old digest is no longer offered, nor known
    with ix.write() as w:
        w.put_entry(_entry(3, 500, mtime=9))
        w.put_record(3, Record(2, 1, 4096 * 3, 500, 8, 9, 103))
    assert ix.get_key(3) is None and ix.check_invariants() == []
    # a file removed from the source takes its key along
    _cache(ix, 4, b"four", chunk=3)
    with ix.write() as w:
        w.delete_tree(4)
    assert ix.get_key(4) is None and ix.check_invariants() == []
    ix.close()
    assert _offered(path, k2.sha256) is None and _offered(path, k3.sha256) is None


def test_a_reader_refuses_an_offer_whose_record_is_of_another_version(tmp_path):
    """A key left for an older version (as a crash between two writes could leave it) is
    never taken for the record's bytes."""
    ix = _index(tmp_path)
    k = _cache(ix, 2, b"x" * 50)
    with ix.write() as w:  # the record moves to another version behind the index's back
        w.txn.put((2).to_bytes(8, "big"), Record(1, 1, 8192, 50, 1, 6, 102).pack(), db=ix.record)
    assert ix.check_invariants() == []  # tolerated: readers check the version
    ix.close()
    assert _offered(ix.path, k.sha256) is None


_names = st.text(st.characters(codec="utf-8", exclude_characters="\n\r/\x00\\"),
                 min_size=1, max_size=12).filter(lambda s: s not in (".", ".."))


@settings(max_examples=200, deadline=None)
@given(files=st.dictionaries(st.lists(_names, min_size=1, max_size=3).map("/".join),
                             st.binary(min_size=32, max_size=32), max_size=20),
       star=st.booleans(), dot=st.booleans())
def test_manifest_lines_as_sha256sum_writes_them(files, star, dot):
    text = "".join(f"{d.hex()} {'*' if star else ' '}{'./' if dot else ''}{p}\n"
                   for p, d in files.items()).encode()
    got = parse_manifest(text, b"/src/sub", b"/src")
    assert got == {f"sub/{p}".encode(): d for p, d in files.items()}


def test_manifest_skips_bad_lines_and_paths_outside_the_source():
    good = "ab" * 32
    text = (f"{good}  ../outside.jpg\n{good}  /etc/passwd\nnot a line\n{'zz' * 32}  x.jpg\n"
            f"{good}  in.jpg\r\n{good[:-2]}  short.jpg\n").encode()
    assert parse_manifest(text, b"/src", b"/src") == {b"in.jpg": bytes.fromhex(good)}


@given(st.binary(min_size=32, max_size=32))
def test_attribute_values_hex_raw_or_prefixed(d):
    assert parse_key(d) == d
    assert parse_key(d.hex().encode()) == d
    assert parse_key(b"sha256:" + d.hex().upper().encode() + b"\n") == d
    assert parse_key(d[:31]) is None and parse_key(b"md5:" + d.hex().encode()) is None


def test_an_index_made_before_content_keys_is_read_without_them(tmp_path):
    """A cache written by an older build has no ``ckey``/``content`` databases: a reader
    sees no offers, and sees them once a daemon of this build opened the index."""
    import lmdb  # noqa: PLC0415

    from dlcachefs.store import schema as S  # noqa: PLC0415

    path = str(tmp_path / "meta.lmdb")
    os.makedirs(path)
    env = lmdb.open(path, max_dbs=8, subdir=True)
    meta = env.open_db(S.DB_META)
    for name in (S.DB_INODE, S.DB_DIRENT, S.DB_RECORD, S.DB_CHUNK):
        env.open_db(name)
    with env.begin(write=True) as txn:
        txn.put(S.K_FORMAT, S.SCHEMA_VERSION.to_bytes(8, "little"), db=meta)
    env.close()
    r = IndexReader(path)
    try:
        assert r.content is None and r.by_content(b"\0" * 32) is None
        assert not r.open_content()
    finally:
        r.close()
    ix = Index(path)
    k = _cache(ix, 2, b"now")
    ix.close()
    assert _offered(path, k.sha256) == 2


def test_the_index_walk_reads_the_content_keys_too(tmp_path):
    """The walk that decides whether an index is damaged (in a child process, before the
    daemon reads it) touches ``ckey`` and ``content`` and checks their lengths; an index
    without them (made before them) is not damaged."""
    from dlcachefs.store.integrity import check_index  # noqa: PLC0415

    ix = _index(tmp_path)
    _cache(ix, 2, b"ok")
    path = ix.path
    ix.close()
    assert check_index(path) is None
    ix = Index(path)
    with ix.write() as w:
        w.txn.put((3).to_bytes(8, "big"), b"short", db=ix.ckey)
    ix.close()
    why = check_index(path)
    assert why is not None and "ckey" in why, why
