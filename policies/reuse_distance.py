"""Lobster's eviction: reuse count and reuse distance, with deterministic prefetching.

Lobster (ICPP'22, section 4.4) knows every future access from the seeded sampler and
applies, per node:

(a) reuse count: once a sample has had its last planned access, evict it right away;
(b) reuse distance: after iteration ``h`` of an epoch of ``I`` iterations, a sample just
    used whose next reuse distance is larger than ``2I - h`` is not read during the next
    epoch: evict it to make room for more prefetches;
(c) when the cache is full anyway, evict the sample whose next use is farthest, and
    prefetch (admit) the sample whose next use is nearest (Belady's MIN rule).

Here the clock ticks once per sample served, whoever reads it; every stream (the ranks of
a node) counts its distances at its own pace on it, and the end of the next epoch is
each stream's own (:mod:`dlcachefs.clairvoyance.future`). ``I`` is an epoch's length in
samples and ``h`` the position in it.

The horizon: the job's number of epochs is not known to the mount, so "until the end of
training" (Lobster's reuse count) is read as "within the known epochs": this one, the
next, and the known epochs after it while those after this one read fewer bytes than
the stream's share of the cache holds (the cache over its job's ranks, which share it;
none when the dataset fits the cache, where nothing is evicted) (at most six more; a seeded sampler's epochs are all replayable, orders
sent with ``order`` lines only as far as sent). Why that far: the cache holds the
samples of nearest next use, and once the epochs ahead read as many bytes as the cache
holds, a sample whose next use lies beyond them is always farther than enough nearer
ones to fill the cache; knowing more epochs would only rank samples that are evicted
anyway. So with an epoch larger than its share (every DistributedSampler epoch of a
partially cached dataset, each rank's shard against its share) the horizon is this epoch
and the next; epochs that read a
part of the dataset each (importance sampling, subsets) reach further, so that a sample
skipped by the next epoch but read by the one after has a far but finite next use
instead of none. Rule (a) is then "no use within the horizon", which rule (b) (no use
before the end of the next epoch) already implies: a release needs (b), the horizon
orders the evictions.

The keys: a unit's earliest next use in the streams' frames
(:mod:`dlcachefs.clairvoyance.future`), which hold still while the clock ticks, so a
lazy heap by key finds the farthest unit exactly: an entry's key changes only when a
member is read (the unit is pushed again) or when the future makes its frames again
(:meth:`~dlcachefs.cache.policy.FutureView.generation`: every unit is keyed again at the
next decision). Keys counted from the live paces instead moved with every pace, and an
entry whose key grew beneath the heap's top was passed over.

(a) and (b) only act when the next epoch is known for every stream, so an unknown
future never evicts anything early. A unit (a chunk of several samples) is as near as
its nearest member: it is released only when every member qualifies, and its eviction
key is its members' earliest next use. With nothing announced the rules reduce to LRU
(every key is NEVER; ties go oldest-first).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Sequence

from dlcachefs.cache.policy import NEVER, CachingPolicy, SupportsReleaseAfterUse


class ReuseDistancePolicy(CachingPolicy, SupportsReleaseAfterUse):
    """Farthest-next-use eviction + Lobster's release rules; LRU without a known future."""

    name = "reuse-distance"
    options = {"eager": bool}

    def __init__(self, ctx=None, eager: bool = True, **opts: object) -> None:
        super().__init__(ctx, **opts)
        self.eager = eager
        self._units: dict[int, tuple[int, tuple[int, ...]]] = {}  # unit -> (size, members)
        self._seq: dict[int, int] = {}  # unit -> recency stamp (ties: oldest first)
        self._tick = 0
        # lazy max-heap of (-key, stamp, unit); entries go stale on access or removal and
        # are checked (and re-keyed) when they reach the top
        self._heap: list[tuple[float, int, int]] = []
        self._generation: int | None = None  # the future's frames the heap is keyed in
        self.released = 0

    def __len__(self) -> int:
        return len(self._units)

    def _key(self, unit: int) -> float:
        nu = self.ctx.future.next_use
        return min((nu(m) for m in self._units[unit][1]), default=NEVER)

    def _push(self, unit: int) -> None:
        self._tick += 1
        self._seq[unit] = self._tick
        heapq.heappush(self._heap, (-self._key(unit), self._tick, unit))
        if len(self._heap) > 4 * len(self._units) + 64:  # drop stale entries now and then
            self._heap = [e for e in self._heap if self._seq.get(e[2]) == e[1]]
            heapq.heapify(self._heap)

    def on_insert(self, unit: int, members: Sequence[int], size: int) -> None:
        self._units[unit] = (size, tuple(members))
        self._push(unit)

    def on_access(self, unit: int, sample: int) -> None:
        if unit in self._units:
            self._push(unit)  # its next use moved on

    def on_remove(self, unit: int) -> None:
        self._units.pop(unit, None)
        self._seq.pop(unit, None)

    def _rekey_if_moved(self) -> dict[int, float]:
        """Key every unit again when the future made its frames again since the heap
        was keyed (keys may have grown: the lazy heap only catches those at its top).
        Returns the keys computed (the decision's own, not computed again)."""
        g = self.ctx.future.generation()
        if g == self._generation:
            return {}
        self._generation = g
        keys = {u: self._key(u) for u in self._units}
        self._heap = [(-k, self._seq[u], u) for u, k in keys.items()]
        heapq.heapify(self._heap)
        return keys

    def _top(self, exclude: Collection[int], held: list,
             keys: dict[int, float]) -> tuple[float, int] | None:
        """The valid entry with the farthest key (popped), or None. ``keys``: the units'
        keys computed in this decision (the future does not move within one: a unit
        re-keyed and popped again, or chosen and pushed back, is not computed again)."""
        while self._heap:
            neg, stamp, unit = heapq.heappop(self._heap)
            if self._seq.get(unit) != stamp:
                continue  # stale
            key = keys.get(unit)
            if key is None:
                key = keys[unit] = self._key(unit)
            if key != -neg:  # the future moved (a new order, reads not seen): re-key
                heapq.heappush(self._heap, (-key, stamp, unit))
                continue
            if unit in exclude:
                held.append((neg, stamp, unit))
                continue
            return key, unit
        return None

    def farthest(self) -> float | None:
        """Key of the unit that would be evicted first (None when nothing is cached)."""
        keys = self._rekey_if_moved()
        held: list = []
        top = self._top((), held, keys)
        if top is None:
            return None
        key, unit = top
        heapq.heappush(self._heap, (-key, self._seq[unit], unit))
        return key

    def admit(self, sample: int, size: int) -> bool:
        # (c): when room has to be made, only for a sample needed sooner than the
        # farthest cached one (else it would evict something more useful than itself)
        cache, fut = self.ctx.cache, self.ctx.future
        if cache.used() + size <= cache.capacity() or fut.horizon() <= fut.now():
            return True
        far = self.farthest()
        return far is None or fut.next_use(sample) < far

    def release_after_use(self, unit: int, sample: int) -> bool:
        if not self.eager or unit not in self._units:
            return False
        used = self.ctx.future.used_by_next_epoch_end
        # Lobster's limit: now + 2I - h, the end of the next epoch, each reader's own
        # (ranks sharing the clock each count in their own positions); taken from the
        # next epoch's known order, which also covers epochs of different lengths
        # (importance sampling). A reader's next epoch unknown: the rules wait.
        # (a) and (b): no member is read again before the end of the next epoch
        if all(used(m) is False for m in self._units[unit][1]):
            self.released += 1
            return True
        return False

    def victims(self, need: int, exclude: Collection[int]) -> list[int]:
        keys = self._rekey_if_moved()
        out: list[int] = []
        held: list = []
        freed = 0
        while freed < need:
            top = self._top(exclude, held, keys)
            if top is None:
                break
            _, unit = top
            out.append(unit)
            freed += self._units[unit][0]
        for e in held + [(-keys[u], self._seq[u], u) for u in out]:
            heapq.heappush(self._heap, e)  # the caller calls on_remove for the chosen
        return out

    def stats(self) -> dict:
        return {"released_after_use": self.released}
