"""The memcached expiry of a value: its last planned use in the known epochs, plus a
margin (pure; no I/O).

What is known (issue 12, "with reuse distances known, set the memcached expiry to the
sample's last planned use"): a stream with an announced order knows, for each sample,
how many samples ahead of its reader it comes in the current epoch and, once announced,
in the next one (:class:`PlannedUse`); its loader's pace gives seconds per sample
(:mod:`dlcachefs.clairvoyance.pace`). The last planned use is the latest of these over
the mount's streams, in seconds from now.

The margin is two epochs of that stream's pace (and at least :data:`MIN_MARGIN_S`): a
node knows its own ranks' orders only, and another rank's use of the sample in the next
epoch (announced at that epoch's start) comes at most two epochs after any point of this
one; it also absorbs a pace that slows down. A distributed sampler's use is known
cluster-wide (every rank's order follows from the announced seed, world size and epoch,
and the ranks step together): such a use is the cluster's (*exact*: the step at which
whichever rank reads the sample reads it), not this node's. Its margin is the same two
epochs: a DistributedSampler reads every sample every epoch, and the epoch after the
next one (its order known too, but not walked) reads it again within two epochs of its
use in the next one, so the value is still there then; a hit does not renew an expiry. Nothing known (no order, no pace, the
sample in no known order): 0, memcached's "never". memcached reads an expiry over 30 days
as an absolute Unix time, so a longer one is also 0.

The pace is the loader's, measured from its opens (the current epoch's, else the last
one's): a first epoch's prefetch stores files before the second open, so those values get
no expiry when stored; the touch that keeps a file at eviction sets it later.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

#: the least margin past the last planned use (s)
MIN_MARGIN_S = 300.0
#: epochs of margin past the last planned use
MARGIN_EPOCHS = 2.0
#: memcached takes a larger expiry as an absolute Unix time
MAX_RELATIVE_S = 30 * 24 * 3600


@dataclass(frozen=True, slots=True)
class PlannedUse:
    """A sample's last use known to one stream: ``ahead`` samples after the stream's
    reader position, at ``seconds_per_sample``, in epochs of ``epoch_samples``."""

    ahead: int
    seconds_per_sample: float
    epoch_samples: int


def expiry_s(uses: Iterable[PlannedUse]) -> int:
    """Seconds until the value may expire: the latest planned use plus its margin, rounded
    up; 0 (never) when no use is known or the result would exceed 30 days."""
    best = 0.0
    known = False
    for u in uses:
        if u.ahead < 0 or not u.seconds_per_sample > 0 or u.epoch_samples <= 0:
            continue
        if not math.isfinite(u.seconds_per_sample):
            continue
        known = True
        t = (u.ahead * u.seconds_per_sample
             + max(MIN_MARGIN_S, MARGIN_EPOCHS * u.epoch_samples * u.seconds_per_sample))
        best = max(best, t)
    if not known or best > MAX_RELATIVE_S:  # (an overflow to inf included)
        return 0
    secs = math.ceil(best)
    return secs if 0 < secs <= MAX_RELATIVE_S else 0


def planned_use(position: int, current: int | None, epoch_samples: int,
                next_first: int | None, seconds_per_sample: float | None
                ) -> PlannedUse | None:
    """One stream's last known use of a sample: ``current``, its next position in the
    current epoch (None: not left in it), ``next_first`` its first position in the next
    epoch (None: not known), the reader at ``position``. A permutation uses a sample once
    per epoch, so the next epoch's use is the last known one; None when neither is known
    or the pace is not. The positions may be the cluster's steps (every rank's; see the
    module doc)."""
    if seconds_per_sample is None or seconds_per_sample <= 0:
        return None
    if next_first is not None:
        ahead = epoch_samples - position + next_first
    elif current is not None:
        ahead = current - position
    else:
        return None
    return PlannedUse(max(0, ahead), seconds_per_sample, epoch_samples)


def expiry_of_streams(streams: Mapping, ino: int) -> int:
    """The memcached expiry (s, 0: never) of ``ino``'s value: its last planned use over
    the streams that know their order (a distributed sampler's over every rank), plus
    the margin (:func:`expiry_s`). ``streams``: the mount's streams by (job, rank)
    (:class:`~dlcachefs.clairvoyance.stream.StreamTable`). Trio loop; O(streams)."""
    uses = []
    for s in streams.values():
        if not s.order or s.samples is None:
            continue
        if s.cluster is not None:  # every rank's use: the cluster's last one
            cur, nxt = s.cluster.steps(ino)
            if cur is not None and cur < s.position:
                cur = None  # read by the cluster already in this epoch
        else:
            cur = s.positions.next(ino)
            nxt = s.next_first.next(ino) if s.next_first is not None else None
        u = planned_use(s.position, cur, len(s.order), nxt, s.pace.seconds_per_sample())
        if u is not None:
            uses.append(u)
    return expiry_s(uses)
