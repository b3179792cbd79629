"""Where each sample comes in an epoch's order: positions per inode, built with numpy.

* :class:`Positions`: inode -> its positions not consumed yet (a stream's reader
  position, the policy's next use);
* :func:`order_inos`, :func:`epoch_positions`, :func:`first_positions`: an order of
  dataset indices seen as inodes;
* :class:`ClusterUse`: a distributed sampler's every rank's order (``--peers``).

Concurrency: everything here is built in a worker thread (an epoch's order of 1.28M
samples takes ~0.1 s), then handed to the trio loop and used only there: nothing here is
thread-safe once in use.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from dlcachefs.clairvoyance.samplelist import SampleList


class Positions:
    """Inode -> its positions in an epoch's order that were not consumed yet, smallest
    first. Built with numpy (a 1.28M-sample epoch in ~0.1 s, where a dict took 1-2 s on
    the loaded daemon): the first position of every inode in an array indexed by inode
    (inode numbers are dense: the namespace hands them out in sequence; a dict when they
    are not), and a queue only for inodes that occur more than once (sampling with
    replacement, DistributedSampler's padding). Inode 0 (not a readable file) is never
    listed. Not thread-safe: built in a thread, then used on the trio loop only."""

    __slots__ = ("_first", "_dict", "_more")

    def __init__(self, order_inos) -> None:
        oi = np.asarray(order_inos, dtype=np.int64)
        self._first: np.ndarray | None = None
        self._dict: dict[int, int] | None = None
        self._more: dict[int, deque[int]] = {}
        if len(oi) == 0:
            self._dict = {}
            return
        top = int(oi.max())
        if int(oi.min()) >= 0 and top <= 4 * len(oi) + (1 << 20):
            counts = np.bincount(oi, minlength=top + 1)
            counts[0] = 0
            if int(counts.max(initial=0)) <= 1:  # a permutation (the common case): O(n)
                arr = np.full(top + 1, -1, dtype=np.int64)
                arr[oi] = np.arange(len(oi), dtype=np.int64)
                arr[0] = -1
                self._first = arr
                return
        uniq, first = np.unique(oi, return_index=True)
        if uniq[0] == 0:
            uniq, first = uniq[1:], first[1:]
        top = int(uniq[-1]) if len(uniq) else 0
        if top <= 4 * len(oi) + (1 << 20):
            arr = np.full(top + 1, -1, dtype=np.int64)
            arr[uniq] = first
            self._first = arr
        else:  # sparse inode numbers: a dict is smaller
            self._dict = dict(zip(uniq.tolist(), first.tolist(), strict=True))
        if len(uniq) < np.count_nonzero(oi):  # some inode occurs more than once
            is_first = np.zeros(len(oi), dtype=bool)
            is_first[first] = True
            for p in np.flatnonzero(~is_first & (oi != 0)).tolist():
                self._more.setdefault(int(oi[p]), deque()).append(p)

    def next(self, ino: int) -> int | None:
        """The smallest position of ``ino`` not consumed yet."""
        if self._first is not None:
            if 0 < ino < len(self._first):
                p = int(self._first[ino])
                return p if p >= 0 else None
            return None
        return self._dict.get(ino)  # type: ignore[union-attr]

    def __contains__(self, ino: int) -> bool:
        return self.next(ino) is not None

    def pop(self, ino: int) -> int | None:
        """Consume and return the smallest position of ``ino`` (None: none is left)."""
        p = self.next(ino)
        if p is None:
            return None
        q = self._more.get(ino)
        nxt = -1
        if q:
            nxt = q.popleft()
            if not q:
                del self._more[ino]
        if self._first is not None:
            self._first[ino] = nxt
        elif nxt >= 0:
            self._dict[ino] = nxt  # type: ignore[index]
        else:
            del self._dict[ino]  # type: ignore[union-attr]
        return p


def order_inos(order: list[int], samples: SampleList) -> np.ndarray:
    """The inodes of ``order``'s samples. An index outside the sample list (a subset's
    indices, or an order, announced for a larger dataset than the one listed) is a
    ValueError, which makes the stream's order unknown with that reason."""
    idx = np.asarray(order, dtype=np.int64)
    inos = samples.inos_array()
    if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= len(inos)):
        bad = int(idx.max()) if int(idx.max()) >= len(inos) else int(idx.min())
        raise ValueError(f"the order names sample {bad}, outside the dataset's "
                         f"{len(inos)} samples")
    return inos[idx]


def epoch_positions(order: list[int], samples: SampleList) -> tuple[Positions, bytearray]:
    """Thread: the order's positions per inode, and the consumed flags, with a sample that
    is not a readable file (dangling link) counted read: it is never opened."""
    oi = order_inos(order, samples)
    return Positions(oi), bytearray((oi == 0).astype(np.uint8).tobytes())


def first_positions(order: list[int], samples: SampleList) -> Positions:
    """Thread: inode -> its first position in ``order`` (the next epoch's, for the policy)."""
    return Positions(order_inos(order, samples))


def consumed_inos(order: list[int], consumed: bytes, samples: SampleList) -> list[int]:
    """Thread: the inodes at the positions of ``order`` flagged in ``consumed`` (a copy of
    a stream's flags), in order."""
    flags = np.frombuffer(consumed, dtype=np.uint8)[:len(order)].astype(bool)
    return order_inos(order, samples)[flags].tolist()


@dataclass(frozen=True, slots=True)
class ClusterUse:
    """When a distributed sampler's samples are read cluster-wide, from each epoch's
    global order (every rank's; position ``g`` is read at step ``g // world``, the ranks
    stepping together): ``current`` and ``next`` are :class:`Positions` of the REVERSED
    orders (of ``current_len`` and ``next_len`` positions), so that they give each inode's
    last position (DistributedSampler's padding repeats a few samples at the end)."""

    world: int
    current: Positions
    current_len: int
    next: Positions | None = None
    next_len: int = 0
    #: this epoch's global order as inodes (the owner's prefetch walks it)
    inos: np.ndarray | None = None

    @classmethod
    def of(cls, world: int, cur: list[int], nxt: list[int] | None,
           samples: SampleList) -> ClusterUse:
        """Thread: from the global orders (dataset indices) of this epoch and the next."""
        return cls(world, first_positions(cur[::-1], samples), len(cur),
                   None if nxt is None else first_positions(nxt[::-1], samples),
                   0 if nxt is None else len(nxt), order_inos(cur, samples))

    def steps(self, ino: int) -> tuple[int | None, int | None]:
        """The last step at which the cluster reads ``ino`` in this epoch and the next."""
        c = self.current.next(ino)
        n = self.next.next(ino) if self.next is not None else None
        return (None if c is None else (self.current_len - 1 - c) // self.world,
                None if n is None else (self.next_len - 1 - n) // self.world)
