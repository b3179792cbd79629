"""Tier 1: ``--workers auto``'s decision (:func:`dlcachefs.data.autoworkers.choose`), a pure
function from one epoch's measurements to the next epoch's ``num_workers``: DLCache's
Algorithm 2 within the user's bounds, and never across 0 when that could change the order;
its spec grammar; the count per epoch in the stream's stats and the summary."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlcachefs.admin import summary
from dlcachefs.admin.advise import algorithm2
from dlcachefs.clairvoyance.pace import WORKERS_EPOCHS, Pace
from dlcachefs.data.autoworkers import (
    MIN_BATCHES,
    MIN_T_REQ,
    Bounds,
    Measured,
    choose,
    describe,
    floor_of,
    parse,
)


def test_the_spec_grammar() -> None:
    assert parse("auto") == Bounds(0, None)
    assert parse("auto:2-8") == Bounds(2, 8)
    assert parse("auto:2-") == Bounds(2, None)
    assert parse("auto:-3") == Bounds(0, 3)
    assert parse(" auto:0-1 ") == Bounds(0, 1)
    for bad in ("", "4", "auto:", "auto:8-2", "auto:2", "auto:-0", "auto:1-5000", "Auto",
                "auto:a-b", "auto:5000-"):
        with pytest.raises(ValueError):
            parse(bad)


def m(workers=1, fetch_ms=80.0, req_ms=20.0, batches=50, **kw) -> Measured:
    """An epoch of ``batches`` batches fetched in ``fetch_ms`` each, the training taking
    ``req_ms`` between two of them; the workers' memory measured (1 MiB each, 1 TiB
    available) unless said otherwise."""
    kw.setdefault("mem_worker", float(2**20))
    kw.setdefault("mem_available", float(2**40))
    return Measured(workers, batches, batches * fetch_ms / 1000, batches,
                    batches * req_ms / 1000, **kw)


def test_algorithm2_line_by_line() -> None:
    # line 2: ceil(t_fetch / t_req) = ceil(80 / 20) = 4, under 8 cores
    c = choose(m(), cores=8, bounds=Bounds())
    assert (c.workers, c.previous, c.wanted, c.capped_by) == (4, 1, 4, None)
    assert c.t_fetch == pytest.approx(0.08) and c.t_req == pytest.approx(0.02)
    # ... capped by the cores
    c = choose(m(), cores=2, bounds=Bounds())
    assert (c.workers, c.wanted, c.capped_by) == (2, 4, "cores")
    # lines 3-5: 2 workers of 1 GiB each, 1 GiB available (mem_up = 2 + 0.5 GiB): 2
    c = choose(m(workers=2, mem_worker=2**30, mem_available=2**30), 8, Bounds())
    assert (c.workers, c.capped_by, c.mem_up) == (2, "memory", 2.5 * 2**30)
    # the training slower than the loader: fewer workers (down to 1)
    c = choose(m(workers=6, fetch_ms=10, req_ms=50), 8, Bounds())
    assert (c.workers, c.wanted) == (1, 1)
    # a step lost in the clock's resolution: the cores decide
    assert choose(m(req_ms=0.0), 3, Bounds()).workers == 3


def test_bounds_and_what_is_kept() -> None:
    assert choose(m(), 8, Bounds(0, 3)).workers == 3
    assert choose(m(), 8, Bounds(0, 3)).capped_by == "max"
    c = choose(m(workers=6, fetch_ms=10, req_ms=50), 8, Bounds(2, None))
    assert (c.workers, c.capped_by) == (2, "min")
    # too little measured: the count stays (within the bounds)
    c = choose(m(batches=MIN_BATCHES - 1), 8, Bounds())
    assert (c.workers, c.kept) == (1, "too few batches measured")
    assert choose(m(workers=9, batches=0), 8, Bounds(0, 4)).workers == 4
    # persistent workers or a timeout: never 0
    assert floor_of(Bounds(), persistent=True, timeout=0) == 1
    assert floor_of(Bounds(), persistent=False, timeout=5.0) == 1
    assert floor_of(Bounds(3, None), persistent=False, timeout=0) == 3
    # (memory never takes a loader below its count: mem_up holds what its workers use)
    c = choose(m(workers=3, mem_worker=2**30, mem_available=0), 8, Bounds())
    assert (c.workers, c.capped_by) == (3, "memory")
    # a fetch that takes no time: Algorithm 2 says 0, the floor 1
    c = choose(m(workers=1, fetch_ms=0, order_needs_place=False), 8, Bounds(), floor=1)
    assert (c.workers, c.wanted, c.capped_by) == (1, 0, "min")


def test_zero_is_crossed_only_when_the_order_cannot_change() -> None:
    # from 0 workers: the fetches drew from torch's global generator, so did the sampler
    c = choose(m(workers=0, order_needs_place=True), 8, Bounds())
    assert (c.workers, c.capped_by, c.wanted) == (0, "order", 4)
    c = choose(m(workers=0, order_needs_place=None), 8, Bounds())  # not known: no
    assert c.workers == 0
    # (no worker ran: their memory is not known, so at most 2 at once)
    c = choose(m(workers=0, order_needs_place=False), 8, Bounds())
    assert (c.workers, c.wanted, c.capped_by) == (2, 4, "growth")
    # to 0 workers (a fetch that takes no time): the same rule
    assert choose(m(workers=1, fetch_ms=0, order_needs_place=False), 8, Bounds()).workers == 0
    c = choose(m(workers=1, fetch_ms=0, order_needs_place=True), 8, Bounds())
    assert (c.workers, c.capped_by) == (1, "order")
    # explicit bounds win: auto:1- moves a loader off 0 (the docs say what that costs)
    assert choose(m(workers=0, order_needs_place=True), 8, Bounds(1, None)).workers == 1


def test_without_the_workers_memory_the_count_at_most_doubles() -> None:
    """Algorithm 2's memory lines need the workers' memory: when none was measured (no
    worker ran, or none was sampled) the count grows at most to twice the last (at least
    2), so a count the memory cannot hold is seen on the way."""
    c = choose(m(workers=1, fetch_ms=800, mem_worker=None), 64, Bounds())
    assert (c.workers, c.wanted, c.capped_by) == (2, 40, "growth")
    c = choose(m(workers=3, fetch_ms=800, mem_worker=None), 64, Bounds())
    assert (c.workers, c.capped_by) == (6, "growth")
    c = choose(m(workers=3, fetch_ms=800), 64, Bounds())  # measured: Algorithm 2's count
    assert (c.workers, c.capped_by) == (40, None)
    assert choose(m(workers=1, fetch_ms=800, mem_worker=None), 64, Bounds(5, None)).workers == 5


@settings(max_examples=400, deadline=None)
@given(workers=st.integers(0, 64), batches=st.integers(0, 10_000),
       fetch_s=st.floats(0, 1e5), steps=st.integers(0, 10_000), train_s=st.floats(0, 1e5),
       mem_worker=st.none() | st.floats(0, 2**40), avail=st.none() | st.floats(0, 2**42),
       needs=st.none() | st.booleans(), cores=st.integers(1, 256),
       lo=st.integers(0, 16), span=st.none() | st.integers(0, 64),
       persistent=st.booleans())
def test_the_count_stays_within_its_bounds(workers, batches, fetch_s, steps, train_s,
                                           mem_worker, avail, needs, cores, lo, span,
                                           persistent) -> None:
    bounds = Bounds(lo, None if span is None else max(1, lo + span))
    floor = floor_of(bounds, persistent, 0.0)
    meas = Measured(workers, batches, fetch_s, steps, train_s, mem_worker, avail, needs)
    c = choose(meas, cores, bounds, floor)
    assert c.workers >= floor
    if bounds.hi is not None:
        assert c.workers <= max(bounds.hi, floor)
    assert c.previous == workers
    if c.kept:
        return
    # Algorithm 2 never asks for more than the cores; only MIN may
    assert c.workers <= max(cores, floor)
    if needs is not False and c.capped_by != "min" and c.capped_by != "max":
        assert (c.workers > 0) == (workers > 0)  # 0 is not crossed
    if mem_worker is None or avail is None or workers == 0:
        assert c.workers <= max(2, 2 * workers, floor)  # the memory not known: growth
    if needs is False and mem_worker is None and c.capped_by is None:
        d = algorithm2(workers, fetch_s / batches, max(train_s / steps, MIN_T_REQ), cores)
        assert c.workers == d.workers == min(c.wanted, cores)
        assert c.wanted == math.ceil(c.t_fetch / c.t_req)


@settings(max_examples=100, deadline=None)
@given(fetch_ms=st.floats(1, 1000), req_ms=st.floats(1, 1000), more=st.floats(1, 10),
       cores=st.integers(1, 64))
def test_a_slower_fetch_never_gets_fewer_workers(fetch_ms, req_ms, more, cores) -> None:
    a = choose(m(fetch_ms=fetch_ms, req_ms=req_ms), cores, Bounds())
    b = choose(m(fetch_ms=fetch_ms * more, req_ms=req_ms), cores, Bounds())
    assert b.workers >= a.workers


def test_the_log_line() -> None:
    c = choose(m(mem_worker=100 * 2**20, mem_available=2**30), 2, Bounds())
    row = {"epoch": 3, **c.__dict__, "cpu_share": 0.04}
    line = describe(row)
    assert line.startswith("epoch 3: num_workers 1 -> 2 (Algorithm 2: t_fetch 80.0 ms")
    assert "t_req 20.0 ms" in line and "ceil(t_fetch / t_req) = 4" in line
    assert "capped by cores" in line and "100 MiB per worker" in line and "CPU 4%" in line
    kept = choose(m(batches=0, workers=2), 2, Bounds())
    assert describe({"epoch": 1, **kept.__dict__}) == (
        "epoch 1: num_workers 2, kept (too few batches measured)")


def test_the_count_per_epoch_in_the_stats_and_the_summary() -> None:
    p = Pace()
    for e, w in [(0, 1), (1, 2), (2, 2), (2, 3)]:  # epoch 2 announced again: the last
        p.hint(8, w, 2, e)
    p.hint(8, None, None, 3)  # no workers in the hint: nothing to keep
    assert p.stats()["workers_by_epoch"] == {"0": 1, "1": 2, "2": 3}
    for e in range(WORKERS_EPOCHS + 5):
        p.hint(8, 4, 2, 10 + e)
    kept = p.stats()["workers_by_epoch"]
    assert len(kept) == WORKERS_EPOCHS and list(kept)[-1] == str(10 + e)
    st_ = {"streams": {"j/0": {"mode": "replayed", "epoch": 1,
                               "epochs": {"0": {"bytes_from_source": 10, "hits": 0,
                                                "misses": 3},
                                          "1": {"bytes_from_source": 0, "hits": 3,
                                                "misses": 0}},
                               "loader": {"workers_by_epoch": {"0": 1, "1": 4}}}}}
    text = "\n".join(summary.summary(st_))
    assert any(line.split()[:3] == ["workers", "1", "4"] for line in text.splitlines()), text


def test_cores_and_memory_are_the_cgroups_and_shared_by_the_local_ranks(tmp_path, monkeypatch):
    """A container's quota, not the host's cores or free memory, bounds the workers; and
    the ranks of a job on one machine (torchrun's LOCAL_WORLD_SIZE) share them."""
    from dlcachefs.admin import advise

    v2 = tmp_path / "v2"
    (v2 / "job").mkdir(parents=True)
    (v2 / "job" / "cpu.max").write_text("400000 100000\n")  # 4 CPUs
    (v2 / "job" / "memory.max").write_text(f"{16 << 30}\n")
    (v2 / "job" / "memory.current").write_text(f"{10 << 30}\n")
    cg = tmp_path / "cgroup"
    cg.write_text("0::/job\n")
    assert advise.cgroup_cpus(str(cg), str(v2)) == 4.0
    assert advise.cgroup_memory_room(str(cg), str(v2)) == 6 << 30
    (v2 / "job" / "cpu.max").write_text("max 100000\n")
    (v2 / "job" / "memory.max").write_text("max\n")
    assert advise.cgroup_cpus(str(cg), str(v2)) is None
    assert advise.cgroup_memory_room(str(cg), str(v2)) is None
    v1 = tmp_path / "v1"
    for d, files in {"cpu,cpuacct": {"cpu.cfs_quota_us": "150000", "cpu.cfs_period_us": "100000"},
                     "memory": {"memory.limit_in_bytes": str(8 << 30),
                                "memory.usage_in_bytes": str(3 << 30)}}.items():
        (v1 / d / "job").mkdir(parents=True)
        for name, text in files.items():
            (v1 / d / "job" / name).write_text(text + "\n")
    cg.write_text("4:cpu,cpuacct:/job\n3:memory:/job\n")
    assert advise.cgroup_cpus(str(cg), str(v1)) == 1.5
    assert advise.cgroup_memory_room(str(cg), str(v1)) == 5 << 30

    monkeypatch.setattr(advise, "usable_cores", lambda: 64)
    monkeypatch.setattr(advise, "cgroup_cpus", lambda: 4.0)
    monkeypatch.setattr(advise, "mem_available", lambda: 100 << 30)
    monkeypatch.setattr(advise, "cgroup_memory_room", lambda: 6 << 30)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert (advise.rank_cores(), advise.rank_memory_available()) == (4, 6 << 30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert (advise.rank_cores(), advise.rank_memory_available()) == (2, 3 << 30)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert advise.rank_cores() == 1  # never 0
