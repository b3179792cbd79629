"""Learned orders: a stream whose sampler cannot be replayed (``sampler unknown``) is
formed from the opens of its process tree, epoch by epoch. When the order of opens of an
epoch repeats the previous epoch's (up to the small reordering of loader workers), that
order is taken to repeat again, and is prefetched for the next epoch.

* :class:`LearnedOpens`: a stream's opens recorded per epoch, and whether they repeat;
* :class:`LearnedOrder`: the order it stands for (the "replayer" of such a stream);
* :func:`similar`: whether two epochs opened nearly the same files in nearly the same
  order (run in a thread: up to ``MAX_LEARNED`` opens each).

Concurrency: :class:`LearnedOpens` on the trio loop; :func:`similar` in a worker thread,
over lists the loop no longer appends to.
"""

from __future__ import annotations

import logging
from collections import Counter

from dlcachefs.clairvoyance.replay import SamplerSpec

log = logging.getLogger(__name__)

MAX_LEARNED = 1 << 22  # opens remembered per epoch of a learned stream


class LearnedOpens:
    """The opens of a learned stream: this epoch's, the last complete one's, and what
    comparing them found. ``cur`` is None for a stream whose order is announced."""

    __slots__ = ("epoch", "cur", "prev", "stable", "compared", "pair")

    def __init__(self) -> None:
        self.epoch: int | None = None  # the epoch whose opens are recorded
        self.cur: list[int] | None = None  # inodes opened this epoch, in order
        self.prev: list[int] | None = None  # the last complete epoch's opens
        self.stable = False  # the last two epochs opened in the same order
        self.compared = False  # two complete epochs were compared
        self.pair: tuple[list[int], list[int]] | None = None  # epochs still to compare

    def begin(self, epoch: int) -> None:
        """A learned stream's epoch begins: the opens recorded so far were the last
        epoch's; its order is stable when they repeat the epoch before (compared later,
        in a thread: :meth:`take_pair`)."""
        if self.epoch == epoch:
            return
        if self.cur:
            prev, self.prev = self.prev, self.cur
            self.compared = prev is not None
            self.stable = False
            self.pair = (self.cur, prev) if prev is not None else None
        self.cur, self.epoch = [], epoch

    def keep(self, learned: bool) -> None:
        """The stream's announcement: recording goes on (``learned``: a sampler that
        cannot be replayed), or stops and forgets (an announced order)."""
        if learned:
            self.cur = self.cur if self.cur is not None else []
        else:
            self.cur = self.prev = None
            self.epoch = None

    def note(self, ino: int) -> None:
        """An open by the stream's processes (bounded by ``MAX_LEARNED``)."""
        if self.cur is not None and len(self.cur) < MAX_LEARNED:
            self.cur.append(ino)

    def take_pair(self) -> tuple[list[int], list[int]] | None:
        """The two complete epochs still to compare (once), or None."""
        pair, self.pair = self.pair, None
        return pair

    def sequence(self) -> list[int]:
        """The learned order: the last complete epoch's opens when they repeat, else
        nothing."""
        return list(self.prev or []) if self.stable else []


class LearnedOrder:
    """A learned order: the last epoch's opens, predicted to repeat when they repeated
    the epoch before (``stable``); else nothing is known."""

    def __init__(self, spec: SamplerSpec, n: int, epoch: int, stable: bool) -> None:
        self.spec, self.n, self.epoch, self.stable = spec, n, epoch, stable

    def known(self, epoch: int) -> bool:
        return self.stable and epoch >= self.epoch

    def order(self, epoch: int) -> list[int]:
        return list(range(self.n))


def similar(a: list[int], b: list[int], share: float = 0.9) -> bool:
    """Whether two epochs opened nearly the same files in nearly the same order: at least
    98% of the opens in common, and at least ``share`` of them within a window of where
    they were. Loader workers reorder by up to workers x prefetch_factor x batch under
    load; the window, 1/8 of the epoch, is far below what a reshuffle moves (a random
    permutation keeps about 2 x window / n = 25% of the files that near)."""
    if not a or not b:
        return False
    common = sum((Counter(a) & Counter(b)).values())
    if common < 0.98 * max(len(a), len(b)):
        log.info("learned order: %d of %d opens in common: a different set", common, len(a))
        return False
    window = max(16, len(a) // 8)
    where: dict[int, int] = {}
    for p, ino in enumerate(b):
        where.setdefault(ino, p)
    near = sum(1 for p, ino in enumerate(a) if ino in where and abs(where[ino] - p) <= window)
    log.info("learned order: %d of %d opens within %d positions of the last epoch's",
             near, len(a), window)
    return near >= share * len(a)
