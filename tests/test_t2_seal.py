"""Tier 2: the seal transaction (dlcachefs.store.seal) on a real LMDB index.

The tree of :func:`test_t2_index.build_tree`: chunk 1 = [17, 19] and chunk 2 = [20, 22]
in log 1; every entry has mtime 1 and source inode ino + 1000.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_t2_index import DIR, build_tree, counters, entry, expected_counters

from dlcachefs.cache.source import Identity
from dlcachefs.store import schema as S
from dlcachefs.store.index import Index
from dlcachefs.store.schema import Chunk, Record
from dlcachefs.store.seal import NewChunk, NewRecord, seal_chunks

SIZES = {17: 100, 19: 200, 20: 300, 22: 400}  # build_tree's files


def current(ino: int) -> Identity:
    """The version build_tree's entry of ``ino`` has."""
    return Identity(SIZES[ino], 1, ino + 1000)


def new_chunk(cid: int, inos: list[int], versions: dict[int, Identity] | None = None,
              log_id: int = 2, offset: int = 0) -> NewChunk:
    """Chunk ``cid`` at ``offset`` in ``log_id`` holding ``inos`` (at their current version
    unless ``versions`` says otherwise), records 1000 bytes apart."""
    recs = []
    for i, ino in enumerate(inos):
        v = (versions or {}).get(ino) or current(ino)
        recs.append(NewRecord(ino, v, Record(cid, log_id, offset + 40 + i * 1000, v.size,
                                             0xF0 + i, v.mtime_ns, v.src_ino)))
    return NewChunk(Chunk(cid, log_id, offset, 40 + 1000 * len(inos), 7, tuple(inos)), recs)


@pytest.fixture
def ix(tmp_path):
    index = Index(str(tmp_path / "meta.lmdb"), map_size=1 << 26)
    build_tree(index)
    yield index
    index.close()


def consistent(ix: Index) -> bool:
    return ix.check_invariants() == [] and counters(ix) == expected_counters(ix)


# ----- versions ------------------------------------------------------------------------


@pytest.mark.parametrize("keep_indexed", [True, False])
@pytest.mark.parametrize("changed", ["size", "mtime_ns", "src_ino", "removed"])
def test_a_record_whose_entry_changed_is_not_indexed(ix, keep_indexed, changed):
    # the bytes were read under another version than the entry's, or the file is gone
    stale = current(17)
    if changed != "removed":
        stale = replace(stale, **{changed: getattr(stale, changed) + 1})
    else:
        with ix.write() as w:
            w.delete_tree(17)
    before = ix.get_record(17)
    out = seal_chunks(ix, [new_chunk(10, [17, 22], {17: stale})], keep_indexed=keep_indexed)
    # not indexed: the old record (or none) stays; the other member moves (22 had a record
    # of the same version in chunk 2, so only when asked to move)
    assert ix.get_record(17) == before
    assert out.indexed == ([] if keep_indexed else [22])
    # the chunk is indexed whatever its records became, listing every member
    assert ix.get_chunk(10).members == (17, 22)
    assert consistent(ix)


def test_a_record_of_a_newer_version_replaces_the_old_one(ix):
    with ix.write() as w:  # 17 changed on the source since chunk 1 was written
        e = w.get_entry(17)
        e.mtime_ns = 5
        w.put_entry(e)
    out = seal_chunks(ix, [new_chunk(10, [17], {17: Identity(100, 5, 1017)})],
                      keep_indexed=True)
    assert out.indexed == [17]
    assert ix.get_record(17).chunk_id == 10 and ix.get_record(17).mtime_ns == 5
    assert out.dead == []  # chunk 1 still holds 19
    assert consistent(ix)


# ----- a record indexed elsewhere --------------------------------------------------------


def test_a_record_indexed_elsewhere_is_kept_when_asked(ix):
    before = {ino: ix.get_record(ino) for ino in (17, 19)}
    out = seal_chunks(ix, [new_chunk(10, [17, 19])], keep_indexed=True)
    assert out.indexed == [] and out.dead == []
    assert {ino: ix.get_record(ino) for ino in (17, 19)} == before
    assert ix.get_chunk(10) is not None  # a chunk of dead records, for the policy to evict
    assert consistent(ix)


def test_a_record_indexed_elsewhere_moves_when_asked(ix):
    out = seal_chunks(ix, [new_chunk(10, [17, 19])], keep_indexed=False)
    assert out.indexed == [17, 19]
    assert ix.get_record(17).chunk_id == ix.get_record(19).chunk_id == 10
    assert ix.get_record(17).offset == 40 and ix.get_record(19).offset == 1040
    assert out.dead == [1]  # everything chunk 1 held moved: the caller may retire it
    assert ix.get_chunk(1) is not None  # reported, not dropped
    assert consistent(ix)


def test_a_chunk_that_keeps_a_record_is_not_dead(ix):
    out = seal_chunks(ix, [new_chunk(10, [17, 20])], keep_indexed=False)
    assert out.indexed == [17, 20]
    assert out.dead == []  # chunk 1 still holds 19, chunk 2 still holds 22
    out = seal_chunks(ix, [new_chunk(11, [19], offset=2000)], keep_indexed=False)
    assert out.dead == [1]
    assert consistent(ix)


# ----- victims and drops ----------------------------------------------------------------


def test_victims_are_dropped_with_their_records(ix):
    chunk2 = ix.get_chunk(2)
    out = seal_chunks(ix, [], keep_indexed=True, victims=[2, 99])  # 99: not in the index
    assert out.evicted == [chunk2]
    assert ix.get_chunk(2) is None
    assert ix.get_record(20) is None and ix.get_record(22) is None
    assert out.indexed == [] and out.dead == []
    assert ix.get_record(17) is not None  # chunk 1 untouched
    assert consistent(ix)


def test_victims_go_before_the_new_records(ix):
    # 20 and 22 lose their records with chunk 2, and are indexed again in chunk 10 even
    # when keeping records indexed elsewhere: there is no elsewhere any more
    out = seal_chunks(ix, [new_chunk(10, [20, 22])], keep_indexed=True, victims=[2])
    assert out.indexed == [20, 22]
    assert [c.chunk_id for c in out.evicted] == [2]
    assert out.dead == []  # a victim is evicted, not reported dead
    assert consistent(ix)


def test_drops_are_dropped_and_can_leave_a_chunk_dead(ix):
    out = seal_chunks(ix, [], keep_indexed=True, drops=[20, 17, 99])  # 99: no record
    assert ix.get_record(20) is None and ix.get_record(17) is None
    assert out.dead == []  # chunk 1 still holds 19, chunk 2 still holds 22
    out = seal_chunks(ix, [], keep_indexed=True, drops=[22])
    assert out.dead == [2]
    assert consistent(ix)


def test_a_dropped_record_is_indexed_again_from_the_new_chunk(ix):
    out = seal_chunks(ix, [new_chunk(10, [17])], keep_indexed=True, drops=[17])
    assert out.indexed == [17] and ix.get_record(17).chunk_id == 10
    assert out.dead == []
    assert consistent(ix)


# ----- sequences -------------------------------------------------------------------------


def test_sequences_are_raised_past_what_was_used(ix):
    seal_chunks(ix, [new_chunk(10, [17]), new_chunk(12, [19], offset=2000)],
                keep_indexed=False, new_log=4)
    assert int.from_bytes(ix.get_meta(S.K_NEXT_CHUNK), "little") == 13
    assert int.from_bytes(ix.get_meta(S.K_NEXT_LOG), "little") == 5
    # never lowered
    seal_chunks(ix, [new_chunk(11, [20], offset=4000)], keep_indexed=False, new_log=3)
    assert int.from_bytes(ix.get_meta(S.K_NEXT_CHUNK), "little") == 13
    assert int.from_bytes(ix.get_meta(S.K_NEXT_LOG), "little") == 5
    assert consistent(ix)


def test_a_new_log_is_counted_even_without_chunks(ix):
    # the chunk writer started a log, then its append failed: the id stays used
    seal_chunks(ix, [], keep_indexed=True, new_log=6)
    assert int.from_bytes(ix.get_meta(S.K_NEXT_LOG), "little") == 7
    assert ix.get_meta(S.K_NEXT_CHUNK) is None


def test_a_seal_that_fails_changes_nothing(ix):
    before = (list(ix.iter_records()), list(ix.iter_chunks()), counters(ix))
    bad = new_chunk(10, [17])
    bad = NewChunk(bad.chunk, [*bad.records, None])  # type: ignore[list-item]
    with pytest.raises(AttributeError):
        seal_chunks(ix, [bad], keep_indexed=False, victims=[2], drops=[19], new_log=3)
    assert (list(ix.iter_records()), list(ix.iter_chunks()), counters(ix)) == before
    assert ix.get_meta(S.K_NEXT_LOG) is None


# ----- against a model -------------------------------------------------------------------

N_FILES = 8
FIRST = 16
OLD = [1, 2, 3]  # chunk ids already in the index
BEFORE = st.sampled_from(["none", "same", "older"])  # the record an inode has to begin with
#: what a new chunk holds of an inode: nothing, its current version, or one changed in
#: one of the three fields that tell versions apart
AFTER = st.sampled_from(["none", "current", "size", "mtime_ns", "src_ino"])


@settings(max_examples=150, deadline=None)
@given(before=st.lists(st.tuples(BEFORE, st.sampled_from(OLD)), min_size=N_FILES,
                       max_size=N_FILES),
       after=st.lists(st.tuples(AFTER, st.integers(0, 1)), min_size=N_FILES, max_size=N_FILES),
       victims=st.lists(st.sampled_from([*OLD, 50]), unique=True),
       drops=st.lists(st.integers(FIRST, FIRST + N_FILES), unique=True),
       keep_indexed=st.booleans(), new_log=st.none() | st.integers(1, 9))
def test_seal_matches_a_model(before, after, victims, drops, keep_indexed, new_log):
    """Any starting index, any new chunks (records of the current version or a changed
    one), victims and drops: the index ends as the model says, the result reports what
    the model says, and the invariants and counters hold."""
    inos = list(range(FIRST, FIRST + N_FILES))
    version = {ino: Identity(10 + ino, 1, ino + 1000) for ino in inos}
    # the starting index: every file's entry, and records in the old chunks
    records: dict[int, tuple[int, Identity]] = {}  # ino -> (chunk id, version): the model
    for ino, (kind, cid) in zip(inos, before, strict=True):
        if kind != "none":
            v = version[ino] if kind == "same" else Identity(10 + ino, 0, ino + 1000)
            records[ino] = (cid, v)
    chunks = {cid: [ino for ino, (c, _) in records.items() if c == cid] for cid in OLD}
    # the new chunks 10 and 11 in log 2, and what the seal should do
    new: dict[int, list[int]] = {10: [], 11: []}
    new_versions: dict[int, Identity] = {}
    for ino, (kind, j) in zip(inos, after, strict=True):
        if kind != "none":
            new[10 + j].append(ino)
            new_versions[ino] = version[ino] if kind == "current" else replace(
                version[ino], **{kind: getattr(version[ino], kind) + 1})
    with tempfile.TemporaryDirectory() as d:
        ix = Index(d, map_size=1 << 24)
        try:
            with ix.write() as w:
                w.put_entry(entry(1, 0, b"", DIR))
                for ino in inos:
                    w.put_entry(entry(ino, 1, b"f%d" % ino, size=version[ino].size))
                for cid, members in chunks.items():
                    w.put_chunk(Chunk(cid, 1, cid * 100_000, 40 + 1000 * len(members), 1,
                                      tuple(members)))
                    for i, ino in enumerate(members):
                        v = records[ino][1]
                        w.put_record(ino, Record(cid, 1, cid * 100_000 + 40 + i * 1000,
                                                 v.size, 0, v.mtime_ns, v.src_ino))
            sealed = [new_chunk(cid, members, new_versions, offset=(cid - 10) * 100_000)
                      for cid, members in new.items() if members]
            out = seal_chunks(ix, sealed, keep_indexed=keep_indexed, victims=victims,
                              drops=drops, new_log=new_log)

            # the model
            evicted = [c for c in victims if c in chunks]
            lost: list[int] = []
            for ino in list(records):
                if records[ino][0] in victims:
                    del records[ino]
            for ino in drops:
                if ino in records:
                    lost.append(records.pop(ino)[0])
            indexed = []
            for nc in sealed:
                for nr in nc.records:
                    if nr.version != version[nr.ino]:
                        continue
                    old = records.get(nr.ino)
                    if old is not None and keep_indexed and old[1] == nr.version:
                        continue
                    if old is not None:
                        lost.append(old[0])
                    records[nr.ino] = (nc.chunk.chunk_id, nr.version)
                    indexed.append(nr.ino)
            holding = {c for c, _ in records.values()}
            dead = [c for c in dict.fromkeys(lost) if c not in victims and c not in holding]

            assert out.indexed == indexed
            assert [c.chunk_id for c in out.evicted] == evicted
            assert out.dead == dead
            got = {ino: (r.chunk_id, Identity(r.size, r.mtime_ns, r.src_ino))
                   for ino, r in ix.iter_records()}
            assert got == records
            assert sorted(c.chunk_id for c in ix.iter_chunks()) == sorted(
                [c for c in OLD if c not in victims] + [nc.chunk.chunk_id for nc in sealed])
            nxt = ix.get_meta(S.K_NEXT_CHUNK)
            assert (int.from_bytes(nxt, "little") if nxt else None) == (
                max(nc.chunk.chunk_id for nc in sealed) + 1 if sealed else None)
            nlog = ix.get_meta(S.K_NEXT_LOG)
            assert (int.from_bytes(nlog, "little") if nlog else None) == (
                new_log + 1 if new_log is not None else None)
            assert consistent(ix)
        finally:
            ix.close()
