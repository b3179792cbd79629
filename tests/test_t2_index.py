"""Tier 2: the LMDB metaindex (dlcachefs.store.index) and its value encodings (dlcachefs.store.schema)."""

from __future__ import annotations

import stat

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dlcachefs.store import schema as S
from dlcachefs.store.index import Index
from dlcachefs.store.schema import Chunk, Entry, Record, ukey, unkey

U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
I64 = st.integers(-(2**63), 2**63 - 1)
NAMES = st.binary(min_size=1, max_size=255).filter(lambda b: b"/" not in b and b"\0" not in b)

FILE = stat.S_IFREG | 0o644
DIR = stat.S_IFDIR | 0o755
LNK = stat.S_IFLNK | 0o777


# ----- schema round trips --------------------------------------------------------------


@given(n=U64)
def test_ukey_round_trip_and_order(n):
    assert unkey(ukey(n)) == n
    if n < 2**64 - 1:
        assert ukey(n) < ukey(n + 1)


@given(ino=U64, parent=U64, name=st.binary(max_size=300), mode=U32, nlink=U32, uid=U32,
       gid=U32, size=U64, blocks=U64, rdev=U64, at=I64, mt=I64, ct=I64, sino=U64,
       chk=st.floats(allow_nan=False), target=st.binary(max_size=300))
def test_entry_round_trip(ino, parent, name, mode, nlink, uid, gid, size, blocks, rdev, at, mt,
                          ct, sino, chk, target):
    e = Entry(ino, parent, name, mode, nlink, uid, gid, size, blocks, rdev, at, mt, ct, sino,
              chk, target)
    assert Entry.unpack(ino, e.pack()) == e
    assert Entry.unpack(ino, memoryview(e.pack())) == e


@given(vals=st.tuples(U64, U64, U64, U64, U64, I64, U64))
def test_record_round_trip(vals):
    r = Record(*vals)
    assert Record.unpack(r.pack()) == r


@given(cid=U64, log_id=U64, off=U64, length=U64, sealed=U64,
       members=st.lists(U64, max_size=200).map(tuple))
def test_chunk_round_trip(cid, log_id, off, length, sealed, members):
    c = Chunk(cid, log_id, off, length, sealed, members)
    assert Chunk.unpack(cid, c.pack()) == c


# ----- helpers -------------------------------------------------------------------------


def entry(ino, parent, name, mode=FILE, size=0, mtime_ns=1, target=b""):
    return Entry(ino, parent, name, mode, 1, 0, 0, size, (size + 511) // 512, 0, 0, mtime_ns,
                 0, ino + 1000, 1.0, target)


@pytest.fixture
def ix(tmp_path):
    index = Index(str(tmp_path / "meta.lmdb"), map_size=1 << 26)
    yield index
    index.close()


def counters(ix: Index) -> dict[str, int]:
    return {k.decode(): ix.counter(k) for k in
            (S.K_FILES, S.K_BYTES_TOTAL, S.K_CACHED_BYTES, S.K_CHUNK_BYTES)}


def expected_counters(ix: Index) -> dict[str, int]:
    """The counters recomputed from the tables."""
    files = [e for e in ix.iter_entries() if stat.S_ISREG(e.mode)]
    return {"n_files": len(files), "bytes_total": sum(e.size for e in files),
            "cached_bytes": sum(r.size for _, r in ix.iter_records()),
            "chunk_bytes": sum(c.length for c in ix.iter_chunks())}


def build_tree(ix: Index):
    """root(1) / d(16) / {f1(17), sub(18) / {f2(19), f3(20)}, link(21)} ; root / top(22)
    chunk 1 = [17, 19] in log 1, chunk 2 = [20, 22] in log 1."""
    with ix.write() as w:
        w.put_entry(entry(1, 0, b"", DIR))
        w.put_entry(entry(16, 1, b"d", DIR))
        w.put_entry(entry(17, 16, b"f1", size=100))
        w.put_entry(entry(18, 16, b"sub", DIR))
        w.put_entry(entry(19, 18, b"f2", size=200))
        w.put_entry(entry(20, 18, b"f3", size=300))
        w.put_entry(entry(21, 16, b"link", LNK, target=b"../top"))
        w.put_entry(entry(22, 1, b"top", size=400))
        w.put_chunk(Chunk(1, 1, 40, 1000, 5, (17, 19)))
        w.put_record(17, Record(1, 1, 100, 100, 0xA, 1, 1017))
        w.put_record(19, Record(1, 1, 300, 200, 0xB, 1, 1019))
        w.put_chunk(Chunk(2, 1, 1040, 2000, 6, (20, 22)))
        w.put_record(20, Record(2, 1, 1100, 300, 0xC, 1, 1020))
        w.put_record(22, Record(2, 1, 1500, 400, 0xD, 1, 1022))


def test_fresh_index_is_consistent(ix):
    assert ix.check_invariants() == []
    assert ix.n_records() == 0 and ix.n_chunks() == 0
    assert ix.get_entry(1) is None and ix.get_record(1) is None and ix.get_chunk(1) is None


def test_schema_version_mismatch_is_refused(tmp_path):
    p = str(tmp_path / "m")
    ix = Index(p, map_size=1 << 24)
    with ix.write() as w:
        w.set_meta(S.K_FORMAT, (99).to_bytes(8, "little"))
    ix.close()
    with pytest.raises(RuntimeError, match="schema"):
        Index(p, map_size=1 << 24)


def test_put_get_and_counters(ix):
    build_tree(ix)
    assert ix.get_entry(19) == entry(19, 18, b"f2", size=200)
    assert ix.get_entry(21).target == b"../top"
    assert ix.lookup(18, b"f3") == 20
    assert ix.lookup(18, b"nope") is None
    assert ix.lookup(1, b"f3") is None
    assert ix.get_record(22) == Record(2, 1, 1500, 400, 0xD, 1, 1022)
    assert ix.get_chunk(2) == Chunk(2, 1, 1040, 2000, 6, (20, 22))
    assert counters(ix) == expected_counters(ix) == {
        "n_files": 4, "bytes_total": 1000, "cached_bytes": 1000, "chunk_bytes": 3000}
    assert ix.n_records() == 4 and ix.n_chunks() == 2
    assert ix.check_invariants() == []


def test_put_entry_update_keeps_counters(ix):
    build_tree(ix)
    with ix.write() as w:
        w.put_entry(entry(17, 16, b"f1", size=150, mtime_ns=9))  # grew
        w.put_entry(entry(22, 1, b"top", DIR))                   # a file became a directory
    assert counters(ix)["n_files"] == 3
    assert counters(ix)["bytes_total"] == 150 + 200 + 300
    assert counters(ix) == expected_counters(ix)


def test_put_record_replace_keeps_cached_bytes(ix):
    build_tree(ix)
    with ix.write() as w:
        w.put_chunk(Chunk(3, 2, 40, 500, 7, (17,)))
        w.put_record(17, Record(3, 2, 100, 120, 0xE, 2, 1017))
    assert counters(ix) == expected_counters(ix)
    assert counters(ix)["cached_bytes"] == 1020
    assert ix.check_invariants() == []


@given(names=st.lists(NAMES, unique=True, max_size=40))
def test_list_dir_sorted_by_bytes(tmp_path_factory, names):
    ix = Index(str(tmp_path_factory.mktemp("ld")), map_size=1 << 24)
    try:
        with ix.write() as w:
            w.put_entry(entry(1, 0, b"", DIR))
            w.put_entry(entry(2, 1, b"a", DIR))
            w.put_entry(entry(3, 0, b"", DIR))  # a neighbour directory: must not leak in
            for i, n in enumerate(names):
                w.put_entry(entry(100 + i, 2, n))
                w.put_entry(entry(1000 + i, 3, n))
                w.put_entry(entry(5000 + i, 1, n + b"x"))
        got = ix.list_dir(2)
        assert got == sorted((n, 100 + i) for i, n in enumerate(names))
        assert [n for n, _ in got] == sorted(names)
        assert ix.list_dir(99) == []
    finally:
        ix.close()


def test_list_dir_edge_names(ix):
    with ix.write() as w:
        w.put_entry(entry(1, 0, b"", DIR))
        for i, n in enumerate([b"b", b"B", b"a.b", b"a", b"\xff\xfe", b"\x01", b"a" * 255]):
            w.put_entry(entry(16 + i, 1, n))
    names = [n for n, _ in ix.list_dir(1)]
    assert names == sorted(names)
    assert names[0] == b"\x01" and names[-1] == b"\xff\xfe"


def test_delete_tree(ix):
    build_tree(ix)
    with ix.write() as w:
        removed = w.delete_tree(16)
    assert sorted(removed) == [16, 17, 18, 19, 20, 21]
    for ino in removed:
        assert ix.get_entry(ino) is None
        assert ix.get_record(ino) is None
        assert ix.list_dir(ino) == []
    assert ix.lookup(1, b"d") is None
    assert ix.list_dir(1) == [(b"top", 22)]
    assert ix.get_record(22) is not None
    # chunks are not the namespace's business: they stay (dead records only cost space)
    assert ix.n_chunks() == 2
    assert counters(ix) == expected_counters(ix) == {
        "n_files": 1, "bytes_total": 400, "cached_bytes": 400, "chunk_bytes": 3000}
    assert ix.check_invariants() == []
    with ix.write() as w:
        assert w.delete_tree(16) == []  # idempotent
        assert w.delete_tree(22) == [22]
    assert counters(ix) == expected_counters(ix)
    assert counters(ix)["n_files"] == 0 and counters(ix)["cached_bytes"] == 0
    assert ix.check_invariants() == []


def test_delete_tree_of_a_file(ix):
    build_tree(ix)
    with ix.write() as w:
        assert w.delete_tree(19) == [19]
    assert ix.list_dir(18) == [(b"f3", 20)]
    assert counters(ix) == expected_counters(ix)
    assert ix.check_invariants() == []


def test_write_aborts_on_exception(ix):
    build_tree(ix)
    before = counters(ix)
    with pytest.raises(RuntimeError, match="boom"), ix.write() as w:
        w.delete_tree(16)
        w.drop_chunk(2)
        raise RuntimeError("boom")
    assert ix.get_entry(19) is not None and ix.get_chunk(2) is not None
    assert counters(ix) == before


def test_drop_chunk_drops_only_records_still_in_it(ix):
    build_tree(ix)
    with ix.write() as w:  # 19 was re-cached into chunk 3 since
        w.put_chunk(Chunk(3, 2, 40, 700, 7, (19,)))
        w.put_record(19, Record(3, 2, 100, 200, 0xB, 1, 1019))
    with ix.write() as w:
        c = w.drop_chunk(1)
        assert c == Chunk(1, 1, 40, 1000, 5, (17, 19))
        assert w.drop_chunk(1) is None
        assert w.drop_chunk(42) is None
    assert ix.get_record(17) is None
    assert ix.get_record(19) == Record(3, 2, 100, 200, 0xB, 1, 1019)
    assert ix.get_record(20) is not None
    assert ix.get_chunk(1) is None
    assert counters(ix) == expected_counters(ix)
    assert counters(ix)["chunk_bytes"] == 2700
    assert ix.check_invariants() == []


def test_drop_record_only_chunk(ix):
    build_tree(ix)
    with ix.write() as w:
        assert w.drop_record(17, only_chunk=2) is None
        assert w.drop_record(17, only_chunk=1) is not None
        assert w.drop_record(17) is None
    assert counters(ix) == expected_counters(ix)
    assert ix.check_invariants() == []


def test_alloc_sequences(ix):
    with ix.write() as w:
        a = [w.alloc(S.K_NEXT_INO) for _ in range(3)]
        b = [w.alloc(b"custom", start=5) for _ in range(2)]
    assert a == [16, 17, 18]  # FIRST_INO, set when the index was created
    assert b == [5, 6]
    with ix.write() as w:
        assert w.alloc(S.K_NEXT_INO) == 19


# ----- invariants broken on purpose ----------------------------------------------------


@pytest.mark.parametrize("damage,problem", [
    (lambda w: w.put_record(17, Record(77, 1, 100, 100, 0xA, 1, 1017)), "missing chunk 77"),
    # chunk 1 lists 17 and 19 only
    (lambda w: w.put_record(20, Record(1, 1, 100, 300, 0xC, 1, 1020)), "does not list inode 20"),
    (lambda w: w.put_record(17, Record(1, 1, 1000, 100, 0xA, 1, 1017)),  # 1000+100 > 40+1000
     "outside chunk"),
    (lambda w: w.put_record(17, Record(1, 9, 100, 100, 0xA, 1, 1017)), "names log 9"),
    # a raw delete, bypassing delete_tree (no IndexTxn method leaves a record behind)
    (lambda w: w.txn.delete(ukey(19), db=w.ix.inode), "no namespace entry"),
], ids=["record_names_missing_chunk", "chunk_does_not_list_inode", "record_outside_chunk",
        "wrong_log", "record_without_entry"])
def test_invariant_broken_on_purpose(ix, damage, problem):
    build_tree(ix)
    with ix.write() as w:
        damage(w)
    assert any(problem in p for p in ix.check_invariants())


@pytest.mark.parametrize("key", [S.K_CACHED_BYTES, S.K_CHUNK_BYTES])
def test_invariant_counter_drift(ix, key):
    build_tree(ix)
    with ix.write() as w:
        w._add(key, 1)
    problems = ix.check_invariants()
    assert len(problems) == 1 and key.decode() in problems[0]


def test_invariants_hold_under_random_operations(tmp_path):
    """A random mix of the mutations keeps counters and invariants right."""
    import random

    rng = random.Random(1234)
    ix = Index(str(tmp_path / "r"), map_size=1 << 26)
    try:
        with ix.write() as w:
            w.put_entry(entry(1, 0, b"", DIR))
        dirs, files, next_ino, next_chunk = [1], [], 16, 1
        for _ in range(300):
            op = rng.random()
            with ix.write() as w:
                if op < 0.3:
                    ino, next_ino = next_ino, next_ino + 1
                    parent = rng.choice(dirs)
                    if rng.random() < 0.3:
                        w.put_entry(entry(ino, parent, b"d%d" % ino, DIR))
                        dirs.append(ino)
                    else:
                        w.put_entry(entry(ino, parent, b"f%d" % ino, size=rng.randrange(1000)))
                        files.append(ino)
                elif op < 0.55 and files:
                    members = rng.sample(files, min(len(files), rng.randrange(1, 5)))
                    cid, next_chunk = next_chunk, next_chunk + 1
                    off = rng.randrange(0, 10**6)
                    w.put_chunk(Chunk(cid, 1, off, 10_000, 0, tuple(members)))
                    for i, m in enumerate(members):
                        w.put_record(m, Record(cid, 1, off + 100 + i * 1000, rng.randrange(900),
                                               0, 0, 0))
                elif op < 0.7:
                    w.drop_chunk(rng.randrange(1, next_chunk + 1))
                elif op < 0.8 and files:
                    w.drop_record(rng.choice(files))
                elif op < 0.9 and len(dirs) > 1:
                    d = rng.choice(dirs[1:])
                    gone = set(w.delete_tree(d))
                    dirs = [x for x in dirs if x not in gone]
                    files = [x for x in files if x not in gone]
                elif files:
                    f = rng.choice(files)
                    if w.get_entry(f) is not None:
                        e = w.get_entry(f)
                        e.size = rng.randrange(1000)
                        w.put_entry(e)
        assert counters(ix) == expected_counters(ix)
        assert ix.check_invariants() == []
    finally:
        ix.close()


# ----- the memo of the current snapshot ------------------------------------------------


def test_memo_answers_repeated_reads_without_a_transaction(ix):
    build_tree(ix)
    reads = ix.reads
    first = (ix.get_entry(19), ix.get_record(19), ix.get_entry(99), ix.get_record(18))
    assert ix.reads == reads + 4
    hits = ix.memo_hits
    assert (ix.get_entry(19), ix.get_record(19), ix.get_entry(99), ix.get_record(18)) == first
    assert ix.reads == reads + 4 and ix.memo_hits == hits + 4  # absent keys remembered too


def test_memo_never_answers_an_older_version_after_a_write(ix):
    build_tree(ix)
    assert ix.get_entry(17).size == 100 and ix.get_record(17).size == 100
    assert ix.get_entry(23) is None
    with ix.write() as w:
        w.put_entry(entry(17, 16, b"f1", size=150, mtime_ns=9))
        w.put_entry(entry(23, 16, b"new", size=5))
        w.drop_record(17)
    assert ix.get_entry(17).size == 150 and ix.get_record(17) is None
    assert ix.get_entry(23).size == 5
    with ix.write() as w:
        w.delete_tree(16)
    assert ix.get_entry(17) is None and ix.get_entry(23) is None


def test_memo_keeps_nothing_read_while_a_write_is_under_way(ix):
    """A read while another thread's write transaction is open sees the snapshot before
    it (LMDB's rule), and is not kept: once the write has committed, the new value
    answers."""
    import threading  # noqa: PLC0415

    build_tree(ix)
    inside, release = threading.Event(), threading.Event()

    def writer() -> None:
        with ix.write() as w:
            w.put_entry(entry(17, 16, b"f1", size=150, mtime_ns=9))
            inside.set()
            release.wait(10)

    t = threading.Thread(target=writer)
    t.start()
    try:
        assert inside.wait(10)
        assert ix.get_entry(17).size == 100  # the snapshot before the write
        assert ix.get_entry(17).size == 100
    finally:
        release.set()
        t.join()
    assert ix.get_entry(17).size == 150


def test_memo_is_bounded(ix, monkeypatch):
    from dlcachefs.store import index as index_mod  # noqa: PLC0415

    monkeypatch.setattr(index_mod, "MEMO_MAX", 3)
    build_tree(ix)
    for ino in (1, 16, 17, 18, 19, 20):
        ix.get_entry(ino)
    reads = ix.reads
    assert ix.get_entry(20) == entry(20, 18, b"f3", size=300)
    assert ix.reads == reads + 1  # not kept: the memo was full
