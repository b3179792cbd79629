"""iCACHE: an importance-informed cache (Chen et al., HPCA'23, section III, Algorithm 1).

The cache is split in two:

* the **H-cache** holds H-samples (members of the H-list: the most important samples by
  their latest loss, see :mod:`dlcachefs.importance`), each a unit of its own, managed by
  a min-heap of importance (the *H-heap*, top-node = least important). An H-sample that
  misses is read from the source; while the H-cache has room it is admitted; when it is
  full it is admitted only if its importance is strictly greater than the top-node's,
  which it then replaces (Algorithm 1, lines 9-16). Nothing happens on a hit.
* the **L-cache** holds L-samples in *packages* of at least ``package`` bytes (1 MiB): a
  package is one unit, read and released whole. L-samples that missed are packed into the
  next package (the paper's repacking of missed IDs). A package all of whose samples were
  served this epoch is released when the L-cache needs room ("when all data items in the
  L-cache have been accessed once, new packages will be read"). When the H-list changes,
  packages whose samples are now mostly H are marked stale (in steps, by
  :meth:`maintain`) and go next, so the L-cache is repacked with current L-samples; the
  paper's topping up of new packages with L-samples taken from old ones is not done.

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
the L-cache. Before the first H-list exists every sample counts as H and, with no
importance known, the H-cache only fills while it has room (the paper's warm-up epochs).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Collection, Sequence

from .base import PACK_ALONE, CachePolicy

#: heap entries re-keyed per :meth:`ICachePolicy.maintain` call
REBUILD_STEP = 4096
#: requests seen before the measured H/L frequencies replace the initial ratio
MIN_REQUESTS = 256


class ICachePolicy(CachePolicy):
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
        self._epoch = self.ctx.importance.epoch()
        # admitted, not yet inserted: sample -> (side, bytes); so victims knows who needs
        # room (the writer reports samples it then drops: on_dropped)
        self._pending: dict[int, tuple[str, int]] = {}
        self._pending_h = 0
        self._pending_l = 0
        self._f_h = 0.0
        self._f_l = 0.0
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
        cap = self.ctx.cache.capacity()
        total = self._f_h + self._f_l
        share = self.h_ratio if total < MIN_REQUESTS else self._f_h / total
        return max(0, min(int(cap * share), cap - self.package))

    def l_capacity(self) -> int:
        return self.ctx.cache.capacity() - self.h_capacity()

    def _new_epoch(self) -> None:
        ep = self.ctx.importance.epoch()
        if ep != self._epoch:
            self._epoch = ep
            self._served.clear()
            self._left = {u: len(m) for u, (m, _) in self._l.items()}
            self._used_up_units.clear()
            self._f_h /= 2
            self._f_l /= 2
        v = self.ctx.importance.version()
        if v != self._version:  # the H-list was rebuilt: start a shadow heap
            self._version = v
            self._shadow = []
            self._rebuild = list(self._h)
            self._restale = list(self._l)

    def on_request(self, sample: int) -> None:
        self._new_epoch()
        if self._high(sample):
            self._f_h += 1
        else:
            self._f_l += 1

    # ----- placement and admission (Algorithm 1) ---------------------------------------

    def pack(self, sample: int, size: int) -> int:
        return PACK_ALONE if self._high(sample) else self.package

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
        # an L-sample that missed: repacked into the next package
        self._add_pending(sample, "l", size)
        return True

    def _add_pending(self, sample: int, side: str, size: int) -> None:
        self.on_dropped(sample)  # admitted again: the older admission is void
        self._pending[sample] = (side, size)
        if side == "h":
            self._pending_h += size
        else:
            self._pending_l += size

    def on_dropped(self, sample: int) -> None:
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
        for m in members:
            self.on_dropped(m)  # no longer pending
        if len(members) == 1 and self._high(members[0]):
            self._h[unit] = (members[0], size)
            self._h_bytes += size
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

    def on_access(self, unit: int, sample: int) -> None:
        self._new_epoch()
        if sample in self._served:
            return  # the H-cache keeps no recency (line 6)
        self._served.add(sample)
        u = self._l_of.get(sample)
        if u is not None and u in self._left:
            self._left[u] -= 1
            if self._left[u] <= 0:
                self._used_up_units[u] = None

    def on_remove(self, unit: int) -> None:
        h = self._h.pop(unit, None)
        if h is not None:
            self._h_bytes -= h[1]
            self._stamp.pop(unit, None)
            return
        pkg = self._l.pop(unit, None)
        if pkg is not None:
            self._l_bytes -= pkg[1]
            self._left.pop(unit, None)
            self._used_up_units.pop(unit, None)
            self._stale.pop(unit, None)
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
        pool = [c for c in candidates
                if c in self._l_of and c not in self._served and not self._high(c)]
        if not pool:
            return None
        # marked served when the runner serves it (on_access), not here: it may fail
        self.substitutions += 1
        return self._rng.choice(pool)

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
                "stale_packages": len(self._stale)}
