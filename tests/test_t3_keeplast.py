"""Tier 3: the chunk writer's half of keeping the last copy in the cluster (Lobster 4.4,
``ChunkWriter.keeper``), in a real engine with a small cache and a recording keeper (no
memcached): every record handed over is a current record of a victim, read back before
its chunk was dropped, byte for byte the source's, with its identity; a record past the
keeper's room is not read, only counted; without a keeper nothing is read back."""

from __future__ import annotations

import os

from dlcachefs.cache.source import Identity
from dlcachefs.testing.fakes import make_config, read_all, run_engine, write_tree


class Recorder:
    """A keeper that accepts ``room`` bytes per commit and records what it got."""

    def __init__(self, room: int) -> None:
        self.room_bytes = room
        self.kept: list[tuple[int, bytes, Identity, bytes]] = []
        self.unread = 0

    def room(self) -> int:
        return self.room_bytes

    def keep(self, records, unread: int) -> None:
        self.kept.extend(records)
        self.unread += unread


def _tree() -> dict[bytes, bytes]:
    return {b"d%d/f%03d" % (i % 4, i): os.urandom(3000 + 211 * i) for i in range(60)}


def _run(tmp_path, keeper: Recorder | None, files: dict[bytes, bytes]):
    write_tree(tmp_path / "src", files)
    cfg = make_config(tmp_path / "src", tmp_path / "cache", cache_size=96 << 10,
                      chunk_size=16 << 10)

    async def body(eng):
        eng.writer.keeper = keeper
        for rel in files:  # twice the cache: the first files are evicted
            assert await read_all(eng, rel) == files[rel]
        await eng.writer.flush()
        return {rel: eng.ns.resolve(rel).ino for rel in files}

    inos, eng = run_engine(cfg, body)
    return inos, eng


def test_evicted_records_are_handed_over_exact_before_they_are_dropped(tmp_path):
    files = _tree()
    keeper = Recorder(room=1 << 30)
    inos, eng = _run(tmp_path, keeper, files)
    assert eng.counters.chunks_evicted > 0
    assert keeper.kept and keeper.unread == 0
    seen = set()
    for ino, rel, ident, data in keeper.kept:
        assert data == files[rel], rel  # the source's bytes
        assert inos[rel] == ino and ident.size == len(data)
        st = os.stat(tmp_path / "src" / os.fsdecode(rel))
        assert ident.mtime_ns == st.st_mtime_ns
        assert rel not in seen  # one hand-over per eviction of a record
        seen.add(rel)
    # the first files read are among the evicted (LRU), every one of them handed over
    assert set(list(files)[:5]) <= seen


def test_past_the_room_records_are_counted_not_read(tmp_path, monkeypatch):
    files = _tree()
    keeper = Recorder(room=4000)  # one small record per commit at most
    from dlcachefs.cache import writer  # noqa: PLC0415
    from dlcachefs.store.logs import LogStore  # noqa: PLC0415

    reads: list[int] = []  # chunk reads made while victims are read back
    inside = []
    orig_victims, orig_read = writer.ChunkWriter._read_victims, LogStore.read

    def victims(self, *a):
        inside.append(1)
        try:
            return orig_victims(self, *a)
        finally:
            inside.pop()

    def read(self, log_id, offset, length, **kw):
        if inside:
            reads.append(length)
        return orig_read(self, log_id, offset, length, **kw)

    monkeypatch.setattr(writer.ChunkWriter, "_read_victims", victims)
    monkeypatch.setattr(LogStore, "read", read)
    _, eng = _run(tmp_path, keeper, files)
    # a victim chunk is read only when one of its records fits what room is left: at
    # most as many chunk reads as records handed over (the rest counted from the index)
    assert len(reads) <= len(keeper.kept), (len(reads), len(keeper.kept))
    assert eng.counters.chunks_evicted > 0
    assert keeper.unread > 0
    per_commit = 4000
    assert all(len(d) <= per_commit for *_, d in keeper.kept)


def test_without_a_keeper_nothing_is_read_back(tmp_path, monkeypatch):
    files = _tree()
    from dlcachefs.cache import writer  # noqa: PLC0415
    calls = []
    orig = writer.ChunkWriter._read_victims
    monkeypatch.setattr(writer.ChunkWriter, "_read_victims",
                        lambda self, *a: calls.append(a) or orig(self, *a))
    _, eng = _run(tmp_path, None, files)
    assert eng.counters.chunks_evicted > 0 and calls == []
