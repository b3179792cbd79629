"""Replaying PyTorch's samplers: the exact index order of any epoch, computed with torch.

The training process tells the filesystem how it samples (the control file); this module
turns that into the list of dataset indices each epoch reads, bit for bit what torch's
samplers yield, by running the same torch calls on a generator in the same state.

Supported (the ``sampler`` control line):

* ``random``: ``torch.utils.data.RandomSampler``. ``seed=S`` seeds one generator that the
  sampler owns across epochs: epoch ``E`` is its ``E+1``-th iteration. ``loader_draws``
  says whether a DataLoader sharing that generator draws its base seed from it before the
  sampler: ``none`` (generator given to the sampler), ``each`` (``DataLoader(shuffle=True,
  generator=g)``), ``first`` (the same with ``persistent_workers=True``). ``per_epoch=true``
  means ``S`` is that epoch's own seed (RandomSampler without a generator draws one per
  epoch from the global RNG; the torch hook sends it at each epoch). ``num_samples`` and
  ``replacement`` as in torch.
* ``distributed``: ``torch.utils.data.DistributedSampler`` with ``seed``, ``world``
  (num_replicas), ``rank``, ``shuffle``, ``drop_last``; epoch ``E`` uses ``seed + E``.
* ``sequential``: indices in order.
* ``random`` or ``subset_random`` with ``state=B64`` (the hook of a sampler that owns a
  generator): the generator's state (``get_state()``, base64) at the *base epoch*'s first
  draw of the sampler, i.e. after the DataLoader's own draw of that epoch. Later epochs
  continue from it (``loader_draws=each``: the loader draws once before each later
  epoch; ``first``/``none``: never again), so the next epoch is known too; with
  ``per_epoch=true`` the state is the global generator's and only the base epoch is known.
  ``subset_random`` is ``SubsetRandomSampler(indices)``: one ``randperm(len(indices))``
  per epoch, mapped through the indices (``OrderReplayer.subset``).

Orders are cached per (sampler, epoch); the state of a ``random`` generator is kept after
each replayed epoch so that going from epoch E to E+1 costs one permutation.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

# torch is imported inside the functions that replay orders, not at import time: the
# daemon never loads it (it costs ~3-4 s of CPU and ~500 MB); orders are computed in
# dlcachefs.clairvoyance.replayworker's process.


#: sampler kinds whose ``world``/``rank`` say which of a job's ranks announces (a
#: ``distributed`` sampler's, or the rank an ``explicit`` order is sent for)
RANKED = ("distributed", "explicit")


@dataclass(frozen=True)
class SamplerSpec:
    kind: str  # "random" | "distributed" | "sequential"
    seed: int = 0
    num_samples: int | None = None
    replacement: bool = False
    per_epoch: bool = False
    loader_draws: str = "none"  # "none" | "each" | "first"
    world: int = 1
    rank: int = 0
    shuffle: bool = True
    drop_last: bool = False
    #: base64 of ``Generator.get_state()`` at the base epoch's first draw of the sampler
    #: (``random``, ``subset_random``), in place of ``seed``
    state: str | None = None
    index: str | None = None  # ``subset_random``: the id of its index list
    reason: str | None = None  # ``unknown``: why the training could not say its order

    def validate(self, n: int) -> None:
        """Raise ValueError when the spec cannot describe a sampler over ``n`` samples."""
        if self.kind not in ("random", "distributed", "sequential", "subset_random"):
            raise ValueError(f"unknown sampler kind {self.kind!r}")
        if self.kind == "distributed":
            if self.world < 1:
                raise ValueError("world must be >= 1")
            if not 0 <= self.rank < self.world:
                raise ValueError(f"rank must be in [0, {self.world - 1}]")
        if self.num_samples is not None and self.num_samples <= 0:
            raise ValueError("num_samples must be positive")
        if self.kind == "random" and not self.replacement and n == 0:
            raise ValueError("empty dataset")
        if self.loader_draws not in ("none", "each", "first"):
            raise ValueError("loader_draws must be none, each or first")
        if not -(1 << 63) <= self.seed < (1 << 64):
            raise ValueError("seed out of the 64-bit range")


def _int64_draw(g: torch.Generator) -> None:
    import torch

    torch.empty((), dtype=torch.int64).random_(generator=g)


def decode_state(b64: str) -> torch.Tensor:
    """A generator state from its base64 text (``torch.ByteTensor``)."""
    import base64

    import torch

    return torch.frombuffer(bytearray(base64.b64decode(b64)), dtype=torch.uint8).clone()


def encode_state(state: torch.Tensor) -> str:
    """The base64 text of ``Generator.get_state()``."""
    import base64

    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def _manual(seed: int) -> torch.Generator:
    import torch

    g = torch.Generator()
    g.manual_seed(seed)
    return g


def random_epoch(g: torch.Generator, n: int, num_samples: int, replacement: bool) -> list[int]:
    """One iteration of RandomSampler.__iter__ with generator ``g`` (advances ``g``)."""
    import torch

    if replacement:
        out: list[int] = []
        for _ in range(num_samples // 32):
            out += torch.randint(high=n, size=(32,), dtype=torch.int64, generator=g).tolist()
        out += torch.randint(high=n, size=(num_samples % 32,), dtype=torch.int64,
                             generator=g).tolist()
        return out
    out = []
    for _ in range(num_samples // n):
        out += torch.randperm(n, generator=g).tolist()
    out += torch.randperm(n, generator=g).tolist()[: num_samples % n]
    return out


def distributed_epoch(spec: SamplerSpec, n: int, epoch: int, whole: bool = False) -> list[int]:
    """DistributedSampler.__iter__ for ``epoch`` (see torch/utils/data/distributed.py).
    ``whole``: every rank's samples, the padded global order, whose position ``g`` rank
    ``g % world`` reads at its step ``g // world`` (the ranks step together)."""
    if spec.drop_last and n % spec.world != 0:
        per_rank = math.ceil((n - spec.world) / spec.world)
    else:
        per_rank = math.ceil(n / spec.world)
    total = per_rank * spec.world
    if spec.shuffle:
        import torch

        indices = torch.randperm(n, generator=_manual(spec.seed + epoch)).tolist()
    else:
        indices = list(range(n))
    if not spec.drop_last:
        pad = total - len(indices)
        if pad <= len(indices):
            indices += indices[:pad]
        else:
            indices += (indices * math.ceil(pad / len(indices)))[:pad]
    else:
        indices = indices[:total]
    if whole:
        return indices[:total]
    return indices[spec.rank : total : spec.world]


def order_known(spec: SamplerSpec, base_epoch: int, epoch: int) -> bool:
    """Whether ``spec`` (announced at ``base_epoch``) tells the order of ``epoch``."""
    if spec.kind in ("random", "subset_random") and spec.per_epoch:
        return epoch == base_epoch
    if spec.state is not None:
        return epoch >= base_epoch
    return epoch >= 0


@dataclass
class OrderReplayer:
    """Orders of successive epochs for one sampler over ``n`` samples."""

    spec: SamplerSpec
    n: int
    base_epoch: int = 0  # for per_epoch seeds and states: the epoch they belong to
    subset: object | None = None  # subset_random: the sampler's indices (a sequence)
    _states: dict[int, torch.Tensor] = field(default_factory=dict)  # epoch -> state before it
    _cache: dict[int, list[int]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)  # order() runs in threads

    def __post_init__(self) -> None:
        self.check(self.spec, self.n, self.subset)

    @staticmethod
    def check(spec: SamplerSpec, n: int, subset) -> None:
        """Raise ValueError when ``spec`` (with its ``subset``) cannot replay over ``n``."""
        spec.validate(n)
        if spec.kind == "subset_random":
            if subset is None:
                raise ValueError("subset_random needs its index list")
            a = np.asarray(subset, dtype=np.int64)  # an array('q') is not copied
            if a.size and (int(a.min()) < 0 or int(a.max()) >= n):
                raise ValueError(f"the sampler's indices reach outside 0..{n - 1}")

    @property
    def num_samples(self) -> int:
        return self.spec.num_samples if self.spec.num_samples is not None else self.n

    def known(self, epoch: int) -> bool:
        """Whether the order of ``epoch`` can be computed (per-epoch seeds only know theirs)."""
        return order_known(self.spec, self.base_epoch, epoch)

    def order(self, epoch: int) -> list[int]:
        """Dataset indices of ``epoch``, in the order the sampler yields them."""
        with self._lock:
            return self._order(epoch)

    def cluster_order(self, epoch: int) -> list[int]:
        """A distributed sampler's global order of ``epoch`` (every rank's samples; see
        :func:`distributed_epoch`); ValueError for other samplers."""
        if self.spec.kind != "distributed":
            raise ValueError("only a distributed sampler has a cluster-wide order")
        if not self.known(epoch):
            raise ValueError(f"the order of epoch {epoch} is not known from this sampler")
        return distributed_epoch(self.spec, self.n, epoch, whole=True)

    def _order(self, epoch: int) -> list[int]:
        if not self.known(epoch):
            raise ValueError(f"the order of epoch {epoch} is not known from this sampler")
        hit = self._cache.get(epoch)
        if hit is not None:
            return hit
        s = self.spec
        if s.kind == "sequential":
            out = list(range(self.n))
        elif s.kind == "distributed":
            out = distributed_epoch(s, self.n, epoch)
        elif s.per_epoch and s.state is None:
            out = random_epoch(_manual(s.seed), self.n, self.num_samples, s.replacement)
        else:
            out = self._random_from_state(epoch)
        self._cache[epoch] = out
        while len(self._cache) > 4:  # bounded: the current and next epochs matter
            self._cache.pop(min(self._cache))
        return out

    def _random_from_state(self, epoch: int) -> list[int]:
        import torch

        s = self.spec
        g = torch.Generator()
        start = max((e for e in self._states if e <= epoch), default=None)
        if start is None and s.state is not None:
            g.set_state(decode_state(s.state))
            start = self.base_epoch
        elif start is None:
            g.manual_seed(s.seed)
            start = 0
        else:
            g.set_state(self._states[start])
        out: list[int] = []
        for e in range(start, epoch + 1):
            self._states[e] = g.get_state()
            if s.state is not None:  # the state is after the loader's draw of base_epoch
                draw = s.loader_draws == "each" and e > self.base_epoch
            else:
                draw = s.loader_draws == "each" or (s.loader_draws == "first" and e == 0)
            if draw:
                _int64_draw(g)
            if s.kind == "subset_random":
                sub = self.subset
                out = [int(sub[i]) for i in  # type: ignore[index]
                       torch.randperm(len(sub), generator=g).tolist()]  # type: ignore[arg-type]
            else:
                out = random_epoch(g, self.n, self.num_samples, s.replacement)
        self._states[epoch + 1] = g.get_state()
        while len(self._states) > 8:
            self._states.pop(min(self._states))
        return out
