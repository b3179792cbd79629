"""Tier 3: the parts of the core meet only through the interfaces they declare."""

from __future__ import annotations

import inspect

from dlcachefs.cache.readers import OpenObserver, Readers, ReaderStream
from dlcachefs.clairvoyance.reorder import ReorderEngine
from dlcachefs.clairvoyance.streams import Stream, StreamEngine
from dlcachefs.testing.fakes import make_config, run_session, write_tree


def members(proto: type) -> set[str]:
    """The names a Protocol declares: its attributes and its methods (its bases' too)."""
    names: set[str] = set()
    for k in proto.__mro__:
        if k is object or k.__name__ in ("Protocol", "Generic"):
            continue
        names.update(getattr(k, "__annotations__", {}))
        names.update(n for n, v in vars(k).items()
                     if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property)))
    return names


def lacks(obj: object, proto: type) -> list[str]:
    return sorted(n for n in members(proto) if not hasattr(obj, n))


def test_each_part_provides_what_its_users_declare(tmp_path):
    """The read path reaches the background parts only through the Protocols of
    cache/readers.py (the streams' answers, a reader's stream, the observers), and the
    streams reach the read path's parts only through theirs (StreamEngine,
    ReorderEngine): the objects the composition root hands over must have every member
    those declare, and none of the members is private."""
    src, cache = tmp_path / "src", tmp_path / "cache"
    write_tree(src, {b"train/c0/a.jpg": b"x" * 100})

    async def body(sess):
        for proto in (Readers, OpenObserver, ReaderStream, StreamEngine, ReorderEngine):
            names = members(proto)
            assert names, proto
            assert not [n for n in names if n.startswith("_")], proto
        assert lacks(sess.engine.readers, Readers) == []
        for o in sess.engine.observers._all:
            assert lacks(o, OpenObserver) == [], type(o).__name__
        assert lacks(Stream("j", 0), ReaderStream) == []
        assert lacks(sess.streams.engine, StreamEngine) == []
        assert lacks(sess.streams.engine, ReorderEngine) == []
        # the read path holds no background part
        for name in ("streams", "losses", "packer", "scan", "peers", "shares", "dedup",
                     "owner_prefetch", "trace", "prefetcher", "control"):
            assert not hasattr(sess.engine, name), name

    run_session(make_config(src, cache), body)
