"""An epoch's plan: everything an epoch switch needs that takes time, computed off the loop.

When a stream's announced epoch is configured, its order is replayed (or taken from
``order`` lines, or learned) and seen as inodes: the positions per inode, the consumed
flags, whether it repeats the last epoch's order, whether the log laid out for it was
laid out in this order, the next epoch's order and first positions (the policy's
future), and with ``--peers`` a distributed sampler's cluster-wide use. That is numpy
and list work over the whole order (a 1.28M-sample epoch: about a second on a loaded
daemon), and a replay may wait for the replay worker: :func:`plan_epoch` does all of it
in one worker thread and returns an immutable :class:`EpochPlan`, which the stream
manager applies to the stream in one synchronous step.

* :func:`choose_replayer`: which replayer gives the epoch's order (loop, cheap);
* :class:`ExplicitOrders`: orders announced with ``order`` lines;
* :func:`describe_mode`: the stream's ``mode`` and ``reason`` in stats.

Concurrency: :func:`plan_epoch` runs in a worker thread and reads only its arguments
(lists the loop replaces but never mutates: an order, a laid-out log's order, the last
epoch's order; a sample list; the replayer, whose cache has its own lock).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np

from dlcachefs.clairvoyance.learned import LearnedOpens, LearnedOrder
from dlcachefs.clairvoyance.positions import (
    ClusterUse,
    Positions,
    epoch_positions,
    first_positions,
)
from dlcachefs.clairvoyance.replay import SamplerSpec
from dlcachefs.clairvoyance.replayworker import RemoteReplayer, ReplayClosed, ReplayWorker
from dlcachefs.clairvoyance.samplelist import SampleList

log = logging.getLogger(__name__)

#: samplers whose order can be said to repeat the last epoch's (a sequential one always
#: does, and its next epoch is known anyway)
SHUFFLING = ("random", "subset_random", "distributed")

#: known epochs after the next one the policy's future reaches into at most (see
#: :func:`plan_epoch`'s ``cover_bytes``)
MAX_LATER_EPOCHS = 6

class ExplicitOrders:
    """Orders announced with ``order`` lines, in place of a replayed sampler."""

    def __init__(self, spec: SamplerSpec, orders: dict, n: int) -> None:
        self.spec, self.orders, self.n = spec, orders, n

    def known(self, epoch: int) -> bool:
        return epoch in self.orders

    def order(self, epoch: int) -> list[int]:
        if epoch not in self.orders:
            raise ValueError(f"no order announced for epoch {epoch} (send 'order' lines first)")
        out = [int(i) for i in self.orders[epoch]]
        if any(not 0 <= i < self.n for i in out):
            raise ValueError(f"the order of epoch {epoch} names a sample outside 0..{self.n - 1}")
        return out


#: what gives a stream's orders: a replayed sampler, ``order`` lines, or learned opens
Replayer = RemoteReplayer | ExplicitOrders | LearnedOrder


def choose_replayer(current: Replayer | None, spec: SamplerSpec, samples: SampleList,
                    last_samples: SampleList | None, epoch: int, *, explicit: dict | None,
                    learned_stable: bool, worker: ReplayWorker, subset=None) -> Replayer:
    """The replayer of ``epoch``'s order: the stream's ``current`` one when it still
    holds, else a new one. Raises ValueError for a sampler that cannot replay over
    ``samples``."""
    if spec.kind == "explicit":  # a copy: control may drop old epochs meanwhile
        return ExplicitOrders(spec, dict(explicit or {}), len(samples))
    if spec.kind == "unknown":
        return LearnedOrder(spec, len(samples), epoch, learned_stable)
    if (current is None or current.spec != spec or last_samples is not samples
            or spec.per_epoch
            # a generator's state is announced at each epoch's first draw: the same
            # state again at a later epoch is a generator seeded anew the same way
            # (a DataLoader built each epoch with Generator().manual_seed(0)), not
            # one that went on: that epoch's order is computed from it afresh
            or (spec.state is not None
                and getattr(current, "base_epoch", epoch) != epoch)):
        return RemoteReplayer(worker, spec, len(samples), base_epoch=epoch, subset=subset)
    return current


@dataclass(frozen=True, slots=True)
class EpochPlan:
    """What an epoch switch applies to its stream (see the module doc). Its
    ``positions`` and ``consumed`` are the stream's from the switch on: the plan is
    applied once, then dropped."""

    epoch: int
    samples: SampleList
    replayer: Replayer
    order: list[int]  # dataset indices of the epoch
    positions: Positions
    consumed: bytearray  # samples that are no readable file are consumed from the start
    #: the order is the last epoch's again (given a ``last_order`` to compare)
    repeats: bool
    #: the log laid out for this epoch was laid out in this order (given its order)
    laid_ok: bool
    #: the next epoch's order when known (this one again when it ``repeats``), else []
    next_order: list[int]
    next_first: Positions | None  # inode -> its first position in ``next_order``
    cluster: ClusterUse | None  # --peers: a distributed sampler's cluster-wide use
    #: the known epochs after the next one, (first positions, length) each, as far as
    #: the policy's horizon reaches (``cover_bytes``)
    later: tuple[tuple[Positions, int], ...] = ()


def plan_epoch(replayer: Replayer, epoch: int, samples: SampleList, *,
               last_order: list[int] | None, laid_order: list[int] | None,
               cluster_world: int | None, key: str, cover_bytes: int = 0) -> EpochPlan:
    """Thread: the :class:`EpochPlan` of ``epoch``. ``last_order``: the last epoch's
    order when this one may repeat it (a shuffling sampler over the same dataset, after
    an epoch); ``laid_order``: the order the log laid out for this epoch was laid out
    in; ``cluster_world``: the world of a distributed sampler whose every rank's order
    is wanted (``--peers``); ``cover_bytes``: the cache's size, which the known epochs
    after this one should read at least (the policy's horizon: the next epoch, and more
    known epochs while those read fewer bytes than the cache holds, at most
    :data:`MAX_LATER_EPOCHS` more). Raises what replay raises (ValueError, DlcError,
    OSError)."""
    order = replayer.order(epoch)
    repeats = last_order is not None and order == last_order
    # the log laid out for this epoch is read as its log only if it was laid out in this
    # order: a wrong guess of the next order (the sampler re-seeded, an epoch not
    # advanced) would be read in whole chunks out of order
    laid_ok = laid_order is not None and order == laid_order
    nxt: list[int] = []
    nxt_first = None
    if repeats:  # the next epoch is taken to repeat it as well
        nxt = order
        nxt_first = first_positions(nxt, samples)
    elif replayer.known(epoch + 1):  # the policy's future reaches into it
        nxt = replayer.order(epoch + 1)
        nxt_first = first_positions(nxt, samples)
    positions, consumed = epoch_positions(order, samples)
    # which files are the stream's samples: its processes' opens of other files (a
    # second loader over another directory) are no order's, and scan-ahead guesses them
    samples.build_sorted()
    cluster = None
    if cluster_world is not None and isinstance(replayer, RemoteReplayer):
        cluster = _cluster_use(replayer, cluster_world, epoch, samples, key)
    later: list[tuple[Positions, int]] = []
    if nxt_first is not None and not repeats and cover_bytes > 0:
        covered, k = epoch_bytes(nxt, samples), epoch + 2
        while covered < cover_bytes and len(later) < MAX_LATER_EPOCHS and replayer.known(k):
            o = replayer.order(k)
            later.append((first_positions(o, samples), len(o)))
            covered += epoch_bytes(o, samples)
            k += 1
    return EpochPlan(epoch, samples, replayer, order, positions, consumed, repeats, laid_ok,
                     nxt, nxt_first, cluster, tuple(later))


def epoch_bytes(order: list[int], samples: SampleList) -> int:
    """Thread: about the bytes of the distinct samples ``order`` reads (its share of
    distinct samples times the dataset's bytes)."""
    if not len(samples):
        return 0
    distinct = len(np.unique(np.asarray(order, dtype=np.int64)))
    return samples.nbytes * distinct // len(samples)


def _cluster_use(rep: RemoteReplayer, world: int, epoch: int, samples: SampleList,
                 key: str) -> ClusterUse | None:
    """Thread: a distributed sampler's every rank's order (this epoch's and the next
    one's when known): when each sample is used cluster-wide, for the peer tier's expiry
    (:func:`dlcachefs.peers.expiry.expiry_of_streams`). None when it cannot be computed (the expiry then falls
    back to this node's ranks and a margin)."""
    try:
        cur = rep.cluster_order(epoch)
        nxt = rep.cluster_order(epoch + 1) if rep.known(epoch + 1) else None
        return ClusterUse.of(world, cur, nxt, samples)
    except ReplayClosed:
        raise  # the unmount: the stream does not switch
    except ValueError as e:
        log.info("stream %s: no cluster-wide order (%s)", key, e)
        return None


def describe_mode(spec: SamplerSpec, replayer: Replayer, epoch: int, n: int,
                  learn: LearnedOpens) -> tuple[str, str]:
    """(mode, reason) of a stream whose epoch was just configured."""
    if spec.kind == "unknown":
        why = spec.reason or "the sampler is not replayable"
        if learn.stable:
            return "learned", f"{why}; the order of opens repeats: prefetched ({n} samples)"
        if learn.prev is None:
            return "learned", f"{why}; learning the order of opens (first epoch)"
        if not learn.compared:
            return "learned", f"{why}; one epoch's order of opens known: prefetched from the " \
                              f"next epoch on if the next repeats it"
        return "learned", f"{why}; the order of opens changed since the last epoch: not " \
                          f"prefetched"
    what = {"random": "RandomSampler", "subset_random": "SubsetRandomSampler",
            "distributed": "DistributedSampler", "sequential": "SequentialSampler",
            "explicit": "explicit order"}.get(spec.kind, spec.kind)
    how = " from the generator's state" if spec.state else ""
    if replayer.known(epoch + 1):
        nxt = "the next epoch is known"
    elif spec.kind == "explicit":
        nxt = "the next epoch is not known (its order is sent when it starts)"
    else:
        nxt = "the next epoch is not known (its seed is drawn when it starts)"
    return "replayed", f"{what}{how} over {n} samples; {nxt}"
