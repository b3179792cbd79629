"""Datasets sharing one cache, in simulation (dlcachefs.sim.datasets): DLCache's CRF, the
eviction orders, the cooldown."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dlcachefs.sim.datasets import POLICIES, Dataset, crf, simulate, workload


def test_crf():
    assert crf([0, 1, 2], now=2, step=0) == 3  # step 0: LFU, a count
    assert crf([2], now=2) == 1
    # p=2, step=1: (1/2)^2 + (1/2)^0
    assert crf([0, 2], now=2, p=2, step=1) == pytest.approx(1.25)
    assert crf([5], now=2) == 0  # future references do not count


A, B, C = Dataset("a", 40, 100.0), Dataset("b", 40, 1.0), Dataset("c", 40, 50.0)


def test_orders():
    # a cache of 80 holds two of the three. Jobs a a b c a b: c must evict a or b.
    jobs = ["a", "a", "b", "c", "a", "b"]
    # LRU evicts a (older), then a comes back and evicts b, then b evicts c
    lru = simulate([A, B, C], jobs, 80, "lru")
    assert lru.by_dataset == {"a": 2, "b": 2, "c": 1} and lru.prep_seconds == 252
    # greedy evicts the cheapest (b), then b evicts c (cheaper than a)
    greedy = simulate([A, B, C], jobs, 80, "greedy")
    assert greedy.by_dataset == {"a": 1, "b": 2, "c": 1} and greedy.prep_seconds == 152
    # LFU and LRFU keep a (referenced twice; CRF 0.85 against b's 0.71 at time 3)
    for pol in ("lfu", "lrfu", "clrfu", "clrfu-x"):
        assert simulate([A, B, C], jobs, 80, pol).by_dataset == {"a": 1, "b": 2, "c": 1}, pol


def test_lru_evicts_the_least_recent():
    jobs = ["a", "b", "a", "c"]  # c evicts b (a was used after b)
    r = simulate([A, B, C], jobs + ["a"], 80, "lru")
    assert r.by_dataset == {"a": 1, "b": 1, "c": 1}
    r = simulate([A, B, C], jobs + ["b"], 80, "lru")
    assert r.by_dataset == {"a": 1, "b": 2, "c": 1}


def test_cooldown_and_too_large():
    # cooldown 2: the dataset of the job before is not eligible either: c cannot evict b
    # (used just before) and evicts a, though a is more expensive
    r = simulate([A, B, C], ["a", "b", "c", "a"], 80, "greedy", cooldown=2)
    assert r.by_dataset == {"a": 2, "b": 1, "c": 1}
    big = Dataset("big", 100, 1.0)
    r = simulate([A, big], ["big", "a", "big"], 80, "lru")
    assert r.by_dataset == {"big": 2, "a": 1}  # never kept


@given(seed=st.integers(0, 10_000), frac=st.floats(0.05, 1.0))
def test_invariants(seed, frac):
    ds, jobs = workload(6, 40, seed=seed)
    cap = int(frac * sum(d.size for d in ds))
    first = len(set(jobs))  # every dataset is prepared at least once
    for pol in POLICIES:
        r = simulate(ds, jobs, cap, pol)
        assert first <= r.preparations <= len(jobs)
        assert sum(r.by_dataset.values()) == r.preparations
        if cap >= sum(d.size for d in ds):
            assert r.preparations == first  # everything fits: nothing prepared twice
