"""Tier 1: an epoch's plan (dlcachefs.clairvoyance.epochplan), computed off the loop from
its arguments only: the order's positions and consumed flags, whether it repeats the last
order, whether a laid-out log was laid out in it, and the next order when it is known."""

from __future__ import annotations

import dataclasses

import pytest

from dlcachefs.clairvoyance.epochplan import ExplicitOrders, plan_epoch
from dlcachefs.clairvoyance.positions import epoch_positions
from dlcachefs.clairvoyance.replay import SamplerSpec
from dlcachefs.clairvoyance.samplelist import SampleList

# five samples; sample 3 is no readable file (a dangling link): inode 0
SAMPLES = SampleList("d", ["c"], [11, 12, 13, 0, 15], [0] * 5, list("abcde"))


def explicit(orders: dict) -> ExplicitOrders:
    return ExplicitOrders(SamplerSpec(kind="explicit"), orders, len(SAMPLES))


def plan(orders: dict, epoch: int = 1, **kw):
    kw = {"last_order": None, "laid_order": None, "cluster_world": None, "key": "j/0"} | kw
    return plan_epoch(explicit(orders), epoch, SAMPLES, **kw)


def test_a_plan_holds_the_orders_positions_and_its_next_order():
    p = plan({1: [4, 3, 0, 2, 1], 2: [0, 1, 2, 3, 4]})
    assert p.order == [4, 3, 0, 2, 1] and p.epoch == 1 and p.samples is SAMPLES
    positions, consumed = epoch_positions(p.order, SAMPLES)
    assert p.consumed == consumed == bytearray(b"\0\1\0\0\0")  # inode 0: never opened
    assert [p.positions.next(i) for i in (15, 11, 13, 12)] == [0, 2, 3, 4]
    assert not p.repeats and not p.laid_ok and p.cluster is None
    assert p.next_order == [0, 1, 2, 3, 4] and p.next_first.next(11) == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.order = []  # type: ignore[misc]


def test_an_order_that_repeats_the_last_one_is_taken_to_repeat_again():
    order = [2, 0, 1, 4, 3]
    p = plan({1: order}, last_order=list(order), laid_order=list(order))
    assert p.repeats and p.laid_ok
    assert p.next_order == order and p.next_first.next(13) == 0
    q = plan({1: order}, last_order=[0, 1, 2, 3, 4], laid_order=[0, 1, 2, 3, 4])
    assert not q.repeats and not q.laid_ok
    assert q.next_order == [] and q.next_first is None  # epoch 2 not announced


def test_an_order_outside_the_sample_list_is_a_value_error():
    with pytest.raises(ValueError, match="outside"):
        plan({1: [0, 7]})


def test_the_policys_horizon_takes_known_epochs_until_they_read_the_cache():
    """Epochs of two of five samples (an importance sampler's): with a cache of four
    samples' bytes, the plan holds the epochs after the next until they read four
    samples' worth (two more); without a cache size to cover, none; an epoch not
    announced ends it."""
    s = dataclasses.replace(SAMPLES, nbytes=500)  # 100 bytes a sample
    orders = {1: [0, 1], 2: [2, 4], 3: [0, 2], 4: [1, 4], 5: [0, 4]}
    p = plan_epoch(explicit(orders), 1, s, last_order=None, laid_order=None,
                   cluster_world=None, key="j/0", cover_bytes=400)
    assert [n for _, n in p.later] == [2]  # epochs 2 + 3 read 400 bytes
    assert p.later[0][0].next(11) == 0 and p.later[0][0].next(13) == 1
    p = plan_epoch(explicit(orders), 1, s, last_order=None, laid_order=None,
                   cluster_world=None, key="j/0", cover_bytes=10_000)
    assert len(p.later) == 3  # epochs 3, 4, 5: epoch 6 is not announced
    assert plan({1: [0, 1], 2: [2, 4], 3: [0, 2]}).later == ()  # no cover_bytes
