"""Tier 3: the simulator counts what the engine counts.

The same small trace is replayed by ``dlcachefs simulate``'s runner
(:func:`dlcachefs.sim.simulate.run_policy`, a model of the writer and the engine) and
through a real mount's core (:func:`dlcachefs.sim.modelcheck.run_through_core`, built by
:func:`dlcachefs.session.build`), with the same policy and ``--cache-size``. See
:mod:`dlcachefs.sim.modelcheck` for what is held equal so that the counts can agree
exactly, and why the equality is asserted for ``lru`` and for ``icache`` on traces without
losses only.
"""

from __future__ import annotations

import random

import pytest

from dlcachefs.sim.modelcheck import run_through_core, sample_key, unit_trace
from dlcachefs.sim.simulate import Trace, lru_counts, run_policy


def small_trace(seed: int, kind: str) -> Trace:
    """40 samples of 200 B .. 9 KB in 4 classes, plus one of 60 KB; 3 epochs. ``shuffle``:
    every sample once per epoch, reshuffled; ``skewed``: 60 draws per epoch with
    replacement, a few samples far more often than the rest (hits within an epoch)."""
    rng = random.Random(seed)
    n = 41
    sizes = [rng.randrange(200, 9000) for _ in range(n - 1)] + [60_000]
    classes = [i * 4 // n for i in range(n)]
    epochs = []
    for _ in range(3):
        if kind == "shuffle":
            order = list(range(n))
            rng.shuffle(order)
        else:
            order = rng.choices(range(n), weights=[1 / (1 + i) for i in range(n)], k=60)
        epochs.append(order)
    return Trace(sizes, classes, epochs)


@pytest.mark.parametrize("policy", ["lru", "icache"])  # icache: no losses in these traces
@pytest.mark.parametrize("kind", ["shuffle", "skewed"])
@pytest.mark.parametrize("seed,fraction", [(0, 0.2), (1, 0.45), (2, 0.8)])
def test_simulated_counts_equal_the_engines(tmp_path, seed, fraction, kind, policy):
    trace = small_trace(seed, kind)
    assert not trace.losses
    units = unit_trace(trace)
    cap = int(sum(units.sizes) * fraction)
    sim = run_policy(units, policy, cap)
    real = run_through_core(trace, policy, cap, tmp_path)
    assert (real.accesses, real.hits, real.misses) == (sim.accesses, sim.hits, sim.misses)
    # the simulator counts unit bytes; every key here has one length, so each miss
    # differs by the same overhead
    over = {units.sizes[i] - trace.sizes[i] for i in range(trace.n)}
    assert len(over) == 1 and len({len(sample_key(trace, i)) for i in range(trace.n)}) == 1
    assert real.bytes_from_source == sim.bytes_from_source - sim.misses * over.pop()
    seq = [s for e in trace.epochs for s in e]
    if policy == "lru":  # and both agree with the reference LRU over the same units
        assert lru_counts(seq, units.sizes, cap)[0] == real.hits
    # the example exercises hits, and evictions where the cache holds less than half of
    # the dataset (samples are read again; at 0.2 the 60 KB one never fits: always a miss)
    assert 0 < real.hits < real.accesses
    if fraction < 0.5:
        assert real.misses > len(set(seq))
