"""Tier 3: the parts of the core meet only through the interfaces they declare."""

from __future__ import annotations

import inspect

from dlcachefs.cache.readers import OpenObserver, Readers, ReaderStream
from dlcachefs.clairvoyance.samplelist import SampleList
from dlcachefs.clairvoyance.stream import Stream
from dlcachefs.clairvoyance.streams import EpochStarted, JobDropped
from dlcachefs.importance.losses import Losses
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
    cache/readers.py (the streams' answers, a reader's stream, the observers): the objects
    the composition root hands it must have every member those declare, and none of the
    members is private. The streams and their next-epoch logs are given their
    collaborators, the ones the read path has, and share the policy's clock with it."""
    src, cache = tmp_path / "src", tmp_path / "cache"
    write_tree(src, {b"train/c0/a.jpg": b"x" * 100})

    async def body(sess):
        eng = sess.engine
        for proto in (Readers, OpenObserver, ReaderStream):
            names = members(proto)
            assert names, proto
            assert not [n for n in names if n.startswith("_")], proto
        assert lacks(eng.readers, Readers) == []
        for o in eng.observers._all:
            assert lacks(o, OpenObserver) == [], type(o).__name__
        assert lacks(Stream("j", 0), ReaderStream) == []
        # the read path holds no background part
        for name in ("streams", "losses", "packer", "scan", "peers", "shares", "dedup",
                     "owner_prefetch", "trace", "prefetcher", "control", "future"):
            assert not hasattr(eng, name), name
        assert sess.future.clock is eng.clock is sess.streams.clock
        assert sess.future.streams is sess.streams.streams
        nl = sess.streams.planner.new_log("default/0", 1)
        assert (nl.writer, nl.index, nl.prefetcher) == (eng.writer, eng.index, sess.prefetcher)

    run_session(make_config(src, cache), body)


def test_the_losses_are_what_the_streams_tell_of_epochs_and_dropped_jobs():
    """The streams tell the importance of an epoch's start and a job's end through the
    callables they declare (EpochStarted, JobDropped); Losses' methods take exactly what
    they pass."""
    stream, samples = Stream("j", 0), SampleList("", [], [], [], [])
    for proto, meth, args in ((EpochStarted, Losses.epoch_started, (stream, samples)),
                              (JobDropped, Losses.forget_job, ("j",))):
        want = list(inspect.signature(proto.__call__).parameters)[1:]
        have = list(inspect.signature(meth).parameters)[1:]
        assert have == want, (proto.__name__, have, want)
        inspect.signature(meth).bind(None, *args)
