"""Tier 3: the parts of the core use the engine only through the interfaces they declare."""

from __future__ import annotations

from dlcachefs.cache.readplan import PlanEngine
from dlcachefs.cache.scanahead import ScanEngine
from dlcachefs.clairvoyance.reorder import ReorderEngine
from dlcachefs.clairvoyance.streams import StreamEngine
from dlcachefs.importance.packer import PackerEngine
from dlcachefs.testing.fakes import make_config, run_engine, write_tree


def test_engine_provides_what_each_part_declares(tmp_path):
    """The background parts use the engine only through the members their Protocol lists
    (StreamEngine, ReorderEngine, ScanEngine, PackerEngine, PlanEngine): the engine must
    have every one of them, and none of them is private."""
    src, cache = tmp_path / "src", tmp_path / "cache"
    write_tree(src, {b"train/c0/a.jpg": b"x" * 100})
    protocols = (StreamEngine, ReorderEngine, ScanEngine, PackerEngine, PlanEngine)

    async def body(eng):
        for proto in protocols:
            names = {n for k in proto.__mro__ for n in getattr(k, "__annotations__", {})}
            assert names, proto
            assert not [n for n in names if n.startswith("_")], proto
            missing = [n for n in sorted(names) if not hasattr(eng, n)]
            assert not missing, f"{proto.__name__}: the engine lacks {missing}"

    run_engine(make_config(src, cache), body)
