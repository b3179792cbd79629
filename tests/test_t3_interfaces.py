"""Tier 3: the parts of the core use the engine only through the interfaces they declare."""

from __future__ import annotations

import inspect

from dlcachefs.cache.readplan import PlanEngine
from dlcachefs.cache.scanahead import ScanEngine
from dlcachefs.clairvoyance.samplelist import SampleList
from dlcachefs.clairvoyance.stream import Stream
from dlcachefs.clairvoyance.streams import EpochStarted, JobDropped
from dlcachefs.importance.losses import Losses
from dlcachefs.importance.packer import PackerEngine
from dlcachefs.testing.fakes import make_config, run_engine, write_tree


def test_engine_provides_what_each_part_declares(tmp_path):
    """The background parts given the engine use it only through the members their
    Protocol lists (ScanEngine, PackerEngine, PlanEngine): the engine must have every one
    of them, and none of them is private. The streams and their next-epoch logs are given
    their collaborators instead, and share the policy's clock with the engine."""
    src, cache = tmp_path / "src", tmp_path / "cache"
    write_tree(src, {b"train/c0/a.jpg": b"x" * 100})
    protocols = (ScanEngine, PackerEngine, PlanEngine)

    async def body(eng):
        for proto in protocols:
            names = {n for k in proto.__mro__ for n in getattr(k, "__annotations__", {})}
            assert names, proto
            assert not [n for n in names if n.startswith("_")], proto
            missing = [n for n in sorted(names) if not hasattr(eng, n)]
            assert not missing, f"{proto.__name__}: the engine lacks {missing}"
        assert eng.future.clock is eng.clock is eng.streams.clock
        assert eng.future.streams is eng.streams.streams
        nl = eng.streams.planner.new_log("default/0", 1)
        assert (nl.writer, nl.index, nl.prefetcher) == (eng.writer, eng.index, eng.prefetcher)

    run_engine(make_config(src, cache), body)


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
