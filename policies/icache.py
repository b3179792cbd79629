"""iCACHE: an importance-informed cache (Chen et al., HPCA'23, section III, Algorithm 1).

The cache is split in two:

* the **H-cache** holds H-samples (members of the H-list: the most important samples by
  their latest loss, see :mod:`dlcachefs.importance.scores`), each a unit of its own, managed by
  a min-heap of importance (the *H-heap*, top-node = least important). An H-sample that
  misses is read from the source; while the H-cache has room it is admitted; when it is
  full it is admitted only if its importance is strictly greater than the top-node's,
  which it then replaces (Algorithm 1, lines 9-16). Nothing happens on a hit.
* the **L-cache** holds L-samples in *packages* of at least ``package`` bytes (1 MiB): a
  package is one unit, read and released whole. A package all of whose samples were
  served this epoch is released when the L-cache needs room ("when all data items in the
  L-cache have been accessed once, new packages will be read"). When the H-list changes,
  packages whose samples are now mostly H are marked stale (in steps, by
  :meth:`maintain`) and go next.

**Dynamic packaging** (III-C, Fig. 6; with substitution, i.e. once the runner calls
:meth:`ICachePolicy.plan_package`): the runner's background packer asks for the next
package whenever the L-cache has room for one (its share minus live packages, used-up
and stale packages counting as room). The policy answers with the members: first the
L-samples that *missed* before the current epoch or H-list (their IDs are recorded at
every L miss, substituted or not, and "re-packed" after the H-list update; one the reader
asked for this epoch already waits for the next, being neither a hit nor a substitute
for it before then), then L-samples
picked at random from the dataset (a walk with a random start and a random stride
coprime to its length: each sample once per epoch, no shuffled copy of the dataset)
that are not cached, not pending and not yet requested this epoch, so that every new
package brings substitutes for the rest of the epoch (the paper's 100% L-hit ratio).
The runner reads the members from the source in one batch and inserts them as ONE unit.
In this mode an L-sample that misses is not admitted on the read path (no reactive
packages): it is recorded and comes in with a later package. Package size:
``min(package, L-share)`` where the L-share is at least one package but at most half the
cache (a cache smaller than two packages gets packages of half its size, not none).

**Substitution** (Algorithm 1, lines 22-23; only when the mount enables it): a missed
L-sample may be served with a cached L-sample *from the L-cache* not yet served this
epoch, chosen at random among the candidates the runner offers. H-samples never are.

**Shadow heap** (III-B): when the H-list is rebuilt (the importance view's version
changes), the current heap keeps deciding evictions with the old values while a shadow
heap is rebuilt with the new ones in bounded steps (:meth:`maintain`); inserts during the
rebuild go to both; once complete the shadow heap replaces the heap.

**H/L split** (III-A): ``Size_H = Size_cache * F_H / (F_H + F_L)`` with ``F_H``/``F_L``
the numbers of requests for H-/L-samples (halved at every epoch so the split follows the
current sampling), starting from ``h_ratio`` (9:1) and keeping at least one package for
the L-cache (at most half the cache: ``min(package, capacity // 2)``). Before the first
H-list exists every sample counts as H and, with no importance known, the H-cache only
fills while it has room (the paper's warm-up epochs).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable, Collection, Sequence

from dlcachefs.cache.policy import (
    PACK_ALONE,
    CachingPolicy,
    SupportsPackagePlanning,
    SupportsPacking,
    SupportsReleaseAfterUse,
    SupportsSubstitution,
)

#: heap entries re-keyed per :meth:`ICachePolicy.maintain` call
REBUILD_STEP = 4096
#: requests seen before the measured H/L frequencies replace the initial ratio
MIN_REQUESTS = 256
#: dataset samples looked at per :meth:`ICachePolicy.plan_package` call (bounded work on
#: the runner's loop, which also serves reads; a draft carries over to the next call)
PLAN_STEP = 16384


class ICachePolicy(CachingPolicy, SupportsPacking, SupportsPackagePlanning,
                   SupportsSubstitution, SupportsReleaseAfterUse):
    """H-cache by importance min-heap + L-cache of packages + substitution decisions."""

    name = "icache"
    options = {"package": int, "h_ratio": float, "seed": int}

    def __init__(self, ctx=None, package: int = 1 << 20, h_ratio: float = 0.9, seed: int = 0,
                 **opts: object) -> None:
        super().__init__(ctx, **opts)
        if package < 1:
            raise ValueError("icache: package must be at least 1 byte")
        if not 0.0 < h_ratio < 1.0:
            raise ValueError("icache: h_ratio must be within (0, 1)")
        self.package = package
        self.h_ratio = h_ratio
        self._rng = random.Random(seed)
        # H-cache: unit -> (sample, size); heap of (importance, stamp, unit), lazily deleted
        self._h: dict[int, tuple[int, int]] = {}
        self._h_bytes = 0
        self._heap: list[tuple[float, int, int]] = []
        self._stamp: dict[int, int] = {}
        self._tick = 0
        self._version = self.ctx.importance.version()
        self._shadow: list[tuple[float, int, int]] | None = None
        self._rebuild: list[int] = []
        # repacking (III-C): packages mostly made of samples that are H now go first
        self._restale: list[int] = []
        self._stale: dict[int, None] = {}
        # L-cache: unit -> (members, size), oldest first; per-epoch served samples; per
        # package its members not yet served this epoch, and the used-up ones in order
        self._l: dict[int, tuple[tuple[int, ...], int]] = {}
        self._l_bytes = 0
        self._l_of: dict[int, int] = {}  # sample -> its L unit
        self._served: set[int] = set()
        self._left: dict[int, int] = {}
        self._used_up_units: dict[int, None] = {}
        # packages that go first (used up or stale) and their bytes: room for the packer
        self._going: set[int] = set()
        self._going_bytes = 0
        self._epoch = self.ctx.importance.epoch()
        # admitted, not yet inserted: sample -> (side, bytes); so victims knows who needs
        # room (the writer reports samples it then drops: on_dropped)
        self._pending: dict[int, tuple[str, int]] = {}
        self._pending_h = 0
        self._pending_l = 0
        self._f_h = 0.0
        self._f_l = 0.0
        self._h_samples: set[int] = set()
        # dynamic packaging (III-C), on once the runner asks for packages
        self.packaging = False
        # L-samples missed this epoch (since the last H-list change), and those missed
        # before: the latter go first into the next packages
        self._missed: dict[int, None] = {}
        self._repack: dict[int, None] = {}
        self._requested: set[int] = set()  # asked for this epoch (packaging mode only)
        self._planned: set[int] = set()  # members of packages planned, not yet inserted
        self._draft: dict[int, int] = {}  # the package being chosen: sample -> bytes
        self._draft_bytes = 0
        self._walk: tuple[int, int, int, int] | None = None  # (n, start, stride, done)
        self._walk_pool: int | None = None  # id() of the pool the walk is over
        self.packages = 0
        self.packed_bytes = 0
        self.packed_samples = 0
        self.packages_by_epoch: dict[int, int] = {}
        self.substitutions_by_epoch: dict[int, int] = {}
        self.l_not_admitted = 0
        # substitutes chosen and not yet served: counted when the runner serves them (it
        # may give a pick up, e.g. a package being evicted, and ask again)
        self._picks: set[int] = set()
        self.substitutions = 0
        self.h_admitted = 0
        self.h_refused = 0
        self.shadow_swaps = 0

    def __len__(self) -> int:
        return len(self._h) + len(self._l)

    # ----- classification and the split ---------------------------------------------

    def _high(self, sample: int) -> bool:
        return self.ctx.importance.is_high(sample)

    def _iv(self, sample: int) -> float:
        v = self.ctx.importance.importance(sample)
        return 0.0 if v is None else v

    def h_capacity(self) -> int:
        """Bytes of the H-cache: the paper's split, leaving the L-cache at least one
        package (or half the cache when a package is more than that)."""
        cap = self.ctx.cache.capacity()
        total = self._f_h + self._f_l
        share = self.h_ratio if total < MIN_REQUESTS else self._f_h / total
        return max(0, min(int(cap * share), cap - min(self.package, cap // 2)))

    def l_capacity(self) -> int:
        """Bytes of the L-cache (the rest of the cache)."""
        return self.ctx.cache.capacity() - self.h_capacity()

    def package_size(self) -> int:
        """Bytes a package aims at: ``package``, or the L-share when that is smaller."""
        return min(self.package, self.l_capacity())

    def _new_epoch(self) -> None:
        ep = self.ctx.importance.epoch()
        if ep != self._epoch:
            self._epoch = ep
            self._served.clear()
            self._left = {u: len(m) for u, (m, _) in self._l.items()}
            self._used_up_units.clear()
            self._going = {u for u in self._stale if u in self._l}
            self._going_bytes = sum(self._l[u][1] for u in self._going)
            self._f_h /= 2
            self._f_l /= 2
            self._requested.clear()
            self._picks.clear()
            self._walk = None  # a new walk: every L-sample is fresh again
            self._repack.update(self._missed)  # III-C: the missed IDs are loaded now
            self._missed.clear()
        v = self.ctx.importance.version()
        if v != self._version:  # the H-list was rebuilt: start a shadow heap
            self._version = v
            self._shadow = []
            self._rebuild = list(self._h)
            self._restale = list(self._l)
            # III-C repacking: the IDs missed so far go first into the next packages
            self._repack.update(self._missed)
            self._missed.clear()
            self._walk = None

    def on_request(self, sample: int) -> None:
        self._new_epoch()
        if self._high(sample):
            self._f_h += 1
        else:
            self._f_l += 1
        if self.packaging:
            self._requested.add(sample)

    # ----- placement and admission (Algorithm 1) ---------------------------------------

    def pack(self, sample: int, size: int) -> int:
        return PACK_ALONE if self._high(sample) else self.package_size()

    def _valid_top(self) -> tuple[float, int] | None:
        while self._heap:
            iv, stamp, unit = self._heap[0]
            if self._stamp.get(unit) == stamp:
                return iv, unit
            heapq.heappop(self._heap)
        return None

    def admit(self, sample: int, size: int) -> bool:
        self._new_epoch()
        if self._high(sample):
            if self._h_bytes + self._pending_h + size <= self.h_capacity():
                ok = True  # lines 9-10: not full
            else:  # lines 12-16: only if more important than the top-node
                top = self._valid_top()
                ok = top is not None and self._iv(sample) > top[0]
            if ok:
                self._add_pending(sample, "h", size)
                self.h_admitted += 1
            else:
                self.h_refused += 1
            return ok
        if self.packaging:  # III-C: its ID is recorded; a later package brings it in
            self._note_miss(sample)
            self.l_not_admitted += 1
            return False
        # an L-sample that missed: repacked into the next package
        self._add_pending(sample, "l", size)
        return True

    def _note_miss(self, sample: int) -> None:
        if self.packaging and not self._high(sample):
            self._missed[sample] = None

    def _add_pending(self, sample: int, side: str, size: int) -> None:
        self.on_dropped(sample)  # admitted again: the older admission is void
        self._pending[sample] = (side, size)
        if side == "h":
            self._pending_h += size
        else:
            self._pending_l += size

    def on_dropped(self, sample: int) -> None:
        self._planned.discard(sample)
        old = self._pending.pop(sample, None)
        if old is not None:
            if old[0] == "h":
                self._pending_h -= old[1]
            else:
                self._pending_l -= old[1]

    # ----- life of a unit ------------------------------------------------------------

    def _heap_push(self, unit: int, sample: int) -> None:
        self._tick += 1
        self._stamp[unit] = self._tick
        heapq.heappush(self._heap, (self._iv(sample), self._tick, unit))
        if self._shadow is not None:  # mirrored into the heap being rebuilt
            self._shadow.append((self._iv(sample), self._tick, unit))

    def on_insert(self, unit: int, members: Sequence[int], size: int) -> None:
        self._new_epoch()
        planned = sum(1 for m in members if m in self._planned)
        for m in members:
            self.on_dropped(m)  # no longer pending
        if planned:  # a package the packer built
            self.packages += 1
            self.packed_bytes += size
            self.packed_samples += len(members)
            self.packages_by_epoch[self._epoch] = self.packages_by_epoch.get(self._epoch, 0) + 1
        if len(members) == 1 and self._high(members[0]) and not planned:
            self._h[unit] = (members[0], size)
            self._h_bytes += size
            self._h_samples.add(members[0])
            self._heap_push(unit, members[0])
        else:
            self._l[unit] = (tuple(members), size)
            self._l_bytes += size
            for m in members:
                self._l_of[m] = unit
            left = sum(1 for m in members if m not in self._served)
            self._left[unit] = left
            if left == 0:
                self._used_up_units[unit] = None
                self._mark_going(unit)

    def on_access(self, unit: int, sample: int) -> None:
        self._new_epoch()
        if sample in self._picks:  # served as a substitute
            self._picks.discard(sample)
            self.substitutions += 1
            ep = self._epoch
            self.substitutions_by_epoch[ep] = self.substitutions_by_epoch.get(ep, 0) + 1
        if sample in self._served:
            return  # the H-cache keeps no recency (line 6)
        self._served.add(sample)
        u = self._l_of.get(sample)
        if u is not None and u in self._left:
            self._left[u] -= 1
            if self._left[u] <= 0:
                self._used_up_units[u] = None
                self._mark_going(u)

    def on_remove(self, unit: int) -> None:
        h = self._h.pop(unit, None)
        if h is not None:
            self._h_bytes -= h[1]
            self._stamp.pop(unit, None)
            self._h_samples.discard(h[0])
            return
        pkg = self._l.pop(unit, None)
        if pkg is not None:
            self._l_bytes -= pkg[1]
            self._left.pop(unit, None)
            self._used_up_units.pop(unit, None)
            self._stale.pop(unit, None)
            if unit in self._going:
                self._going.discard(unit)
                self._going_bytes -= pkg[1]
            for m in pkg[0]:
                if self._l_of.get(m) == unit:
                    del self._l_of[m]

    def _used_up(self, unit: int) -> bool:
        return unit in self._used_up_units

    def release_after_use(self, unit: int, sample: int) -> bool:
        # a package served whole this epoch goes when the L-cache needs the room
        return (unit in self._l and self._l_bytes + self._pending_l > self.l_capacity()
                and self._used_up(unit))

    def victims(self, need: int, exclude: Collection[int]) -> list[int]:
        out: list[int] = []
        freed = 0
        h_over = self._h_bytes + self._pending_h - self.h_capacity()
        l_over = self._l_bytes + self._pending_l - self.l_capacity()
        # the side over its share gives up space first; H by the heap, L used-up first
        order = ("h", "l") if h_over >= l_over else ("l", "h")
        skipped: list[tuple[float, int, int]] = []
        for side in order:
            if side == "h":
                while freed < need and self._heap:
                    iv, stamp, unit = heapq.heappop(self._heap)
                    if self._stamp.get(unit) != stamp:
                        continue
                    if unit in exclude:
                        skipped.append((iv, stamp, unit))
                        continue
                    out.append(unit)
                    freed += self._h[unit][1]
                    skipped.append((iv, stamp, unit))  # on_remove invalidates it
            else:  # packages served whole this epoch, stale ones, then the oldest
                chosen = set(out)
                for pool in (self._used_up_units, self._stale, self._l):
                    for u in pool:
                        if freed >= need:
                            break
                        if u in exclude or u in chosen:
                            continue
                        out.append(u)
                        chosen.add(u)
                        freed += self._l[u][1]
        for e in skipped:
            heapq.heappush(self._heap, e)
        return out

    # ----- substitution ---------------------------------------------------------------

    def substitutable(self, sample: int) -> bool:
        self._new_epoch()
        return not self._high(sample)

    def choose_substitute(self, sample: int, candidates: Sequence[int]) -> int | None:
        if not self.substitutable(sample):
            return None
        self._note_miss(sample)  # III-C: loaded later by the packer, substituted or not
        # a pick in flight is out too: two concurrent misses must not get the same one
        pool = [c for c in candidates if c in self._l_of and c not in self._served
                and c not in self._picks and not self._high(c)]
        if not pool:
            return None
        # marked served and counted when the runner serves it (on_access): it may fail
        pick = self._rng.choice(pool)
        self._picks.add(pick)
        return pick

    # ----- dynamic packaging (III-C) ------------------------------------------------

    def _l_room(self) -> int:
        """Bytes of the L-share not held by live packages or planned ones; packages
        served whole this epoch and stale ones count as room (they go first)."""
        live = self._l_bytes - self._going_bytes
        return self.l_capacity() - live - self._pending_l

    def _mark_going(self, unit: int) -> None:
        pkg = self._l.get(unit)
        if pkg is not None and unit not in self._going:
            self._going.add(unit)
            self._going_bytes += pkg[1]

    def _packable(self, sample: int) -> bool:
        return (not self._high(sample) and sample not in self._l_of
                and sample not in self._h_samples and sample not in self._pending
                and sample not in self._planned)

    def _next_random(self, pool: Sequence[int]) -> int | None:
        """The next sample of this epoch's random walk over ``pool`` (None at its end):
        a random start and a random stride coprime to the length visit each once."""
        n = len(pool)
        if self._walk is None or self._walk_pool != id(pool) or self._walk[0] != n:
            if n == 0:
                return None
            stride = self._rng.randrange(1, n + 1)
            while math.gcd(stride, n) != 1:
                stride = self._rng.randrange(1, n + 1)
            self._walk = (n, self._rng.randrange(n), stride, 0)
            self._walk_pool = id(pool)
        n, start, stride, done = self._walk
        if done >= n:
            return None
        self._walk = (n, start, stride, done + 1)
        return pool[(start + done * stride) % n]

    def plan_package(self, pool: Sequence[int], size_of: Callable[[int], int | None],
                     unit_overhead: int = 0) -> list[int]:
        """The next package to build, or ``[]`` (no room, nothing to pack, or the choice
        is not finished: call again). ``pool``: the dataset's samples;
        ``size_of(s)``: the bytes ``s`` takes inside a unit, None if it is gone (an index
        lookup, no I/O); ``unit_overhead``: a unit's own header. The members are pending
        from now on: the runner inserts them as one unit (:meth:`on_insert`) or reports
        each it could not read (:meth:`on_dropped`).

        First the L-samples missed in earlier epochs or H-lists, then a random walk
        over L-samples not cached and not requested this epoch; the package stops once
        it reaches :meth:`package_size` and never exceeds the L-cache's room."""
        self._new_epoch()
        self.packaging = True
        want = max(1, self.package_size() - unit_overhead)  # payload bytes to reach
        limit = self._l_room() - unit_overhead  # payload bytes that fit
        if limit < want:
            return []
        checked = 0
        # the repack queue first (missed IDs), then the walk
        while self._draft_bytes < want and self._repack and checked < PLAN_STEP:
            s = next(iter(self._repack))
            del self._repack[s]
            checked += 1
            # asked for this epoch already: no substitute now, and its hit has passed
            if (s in self._requested or not self._try_draft(s, size_of, limit)) \
                    and self._packable(s):
                self._missed[s] = None  # at the next epoch or H-list, then
        ended = False
        while self._draft_bytes < want and checked < PLAN_STEP:
            s = self._next_random(pool)
            if s is None:
                ended = True
                break
            checked += 1
            if s not in self._requested:
                self._try_draft(s, size_of, limit)
        if self._draft_bytes < want and not ended:
            return []  # not finished: the next call goes on from here
        # drafted over several calls: whatever got cached or became H meanwhile is out
        members = [(s, b) for s, b in self._draft.items() if self._packable(s)]
        self._draft, self._draft_bytes = {}, 0
        for s, b in members:
            self._add_pending(s, "l", b)
            self._planned.add(s)
        return [s for s, _ in members]

    def _try_draft(self, s: int, size_of: Callable[[int], int | None], limit: int) -> bool:
        """Add ``s`` to the draft if it may be packed and fits; True if it was added."""
        if s in self._draft or not self._packable(s):
            return False
        size = size_of(s)
        if size is None or self._draft_bytes + size > limit:
            return False
        self._draft[s] = size
        self._draft_bytes += size
        return True

    # ----- the shadow heap ------------------------------------------------------------

    def maintain(self) -> bool:
        self._new_epoch()
        if self._restale:  # after an H-list change: which packages went stale
            step = self._restale[-REBUILD_STEP:]
            del self._restale[-REBUILD_STEP:]
            for unit in step:
                pkg = self._l.get(unit)
                if pkg is not None and 2 * sum(map(self._high, pkg[0])) > len(pkg[0]):
                    self._stale[unit] = None
                    self._mark_going(unit)
            return True
        if self._shadow is None:
            return False
        step = self._rebuild[-REBUILD_STEP:]
        del self._rebuild[-REBUILD_STEP:]
        for unit in step:
            h = self._h.get(unit)
            if h is not None:
                self._shadow.append((self._iv(h[0]), self._stamp[unit], unit))
        if self._rebuild:
            return True
        heapq.heapify(self._shadow)  # complete: it becomes the H-heap
        self._heap, self._shadow = self._shadow, None
        self.shadow_swaps += 1
        return False

    def stats(self) -> dict:
        return {"h_units": len(self._h), "h_bytes": self._h_bytes,
                "h_capacity": self.h_capacity(), "l_packages": len(self._l),
                "l_bytes": self._l_bytes, "substitutions": self.substitutions,
                "h_admitted": self.h_admitted, "h_refused": self.h_refused,
                "shadow_swaps": self.shadow_swaps, "rebuilding": self._shadow is not None,
                "stale_packages": len(self._stale), "package_size": self.package_size(),
                "l_capacity": self.l_capacity(), "packaging": self.packaging,
                "packages": self.packages, "packed_bytes": self.packed_bytes,
                "packed_samples": self.packed_samples,
                "packages_by_epoch": {str(k): v for k, v in sorted(self.packages_by_epoch.items())},
                "substitutions_by_epoch": {
                    str(k): v for k, v in sorted(self.substitutions_by_epoch.items())},
                "missed_l": len(self._missed), "repack_queue": len(self._repack),
                "l_not_admitted": self.l_not_admitted}
