"""The caching policy interface: decisions only, over a read-only view of the cache.

A policy never does I/O and never touches the index. Whoever runs it (the chunk writer of
a mount, or ``dlcachefs simulate`` replaying a trace) tells it what happens and asks it
what to do:

* **units** are what the cache stores and evicts as a whole: a chunk of the log (one or
  more samples). :meth:`CachePolicy.pack` says how big the unit a fetched sample goes
  into should be (alone, a package of about N bytes, or the mount's ``--chunk-size``);
* :meth:`CachePolicy.admit`: cache this fetched sample at all?
* :meth:`CachePolicy.on_insert` / :meth:`on_access` / :meth:`on_remove`: the unit's life;
* :meth:`CachePolicy.release_after_use`: after one of its samples was served, should the
  unit go right away (Lobster's reuse rules, LCache's release after use)?
* :meth:`CachePolicy.victims`: which units to give up for ``need`` bytes;
* :meth:`CachePolicy.substitutable` / :meth:`choose_substitute`: iCACHE's substitution
  of a missed sample by a cached one (the runner finds the candidates);
* :meth:`CachePolicy.plan_package`: iCACHE's dynamic packaging, which samples the
  runner's background packer reads from the source together into one unit.

What a policy may look at is a :class:`PolicyContext`: the cache (:class:`CacheView`),
the known future (:class:`FutureView`: clairvoyance from the announced sampler) and the
samples' importance (:class:`ImportanceView`: from the training's losses). Samples are
ints (inode numbers in a mount, dataset indices in a simulation); so are units.

Concurrency: a policy runs on the trio loop in a mount (single-threaded, no locks) and is
called on the read path, so every call must be quick; long work (rebuilding a heap) is
cut into steps done by :meth:`CachePolicy.maintain`, which the runner calls when idle.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

#: "no known next use" (beyond what the announced order tells)
NEVER = float("inf")

#: :meth:`CachePolicy.pack` answers: the sample is a unit of its own / use the chunk size
PACK_ALONE = 0
PACK_CHUNK = -1


class CacheView(Protocol):
    """What is cached now (read-only)."""

    def capacity(self) -> int:
        """Bytes the cache may hold."""

    def used(self) -> int:
        """Bytes held by units now."""

    def members(self, unit: int) -> Sequence[int]:
        """Samples stored in a unit (in storage order)."""

    def unit_size(self, unit: int) -> int:
        """Bytes the unit takes."""


class FutureView(Protocol):
    """Known future accesses, on one logical clock (one tick per sample served).

    ``next_use(s)`` is the tick of ``s``'s next access as far as the announced orders
    tell (this epoch and, when already known, the next), or :data:`NEVER`.
    ``horizon()`` is the last tick the orders cover (``now()`` when nothing is known):
    a sample with ``next_use == NEVER`` is certainly not read before it.
    """

    def now(self) -> int: ...

    def next_use(self, sample: int) -> float: ...

    def horizon(self) -> int: ...

    def epoch_length(self) -> int | None:
        """Samples per epoch of the stream (I in Lobster's rule), None when unknown."""

    def epoch_start(self) -> int:
        """Tick at which the current epoch began."""

    def next_epoch_end(self) -> int | None:
        """Last tick of the next epoch when its order is known, else None."""


class ImportanceView(Protocol):
    """Per-sample importance (iCACHE's IV, or the aggregated AIV of several jobs)."""

    def importance(self, sample: int) -> float | None:
        """The sample's importance, None when no loss was reported for it yet."""

    def is_high(self, sample: int) -> bool:
        """True for H-samples (members of the H-list)."""

    def version(self) -> int:
        """Changes whenever the H-list was rebuilt (the shadow heap rebuild trigger)."""

    def epoch(self) -> int:
        """Epoch the samples are being read in (substitution: "not used this epoch")."""


class _NoFuture:
    def now(self) -> int:
        return 0

    def next_use(self, sample: int) -> float:
        return NEVER

    def horizon(self) -> int:
        return 0

    def epoch_length(self) -> int | None:
        return None

    def epoch_start(self) -> int:
        return 0

    def next_epoch_end(self) -> int | None:
        return None


class _NoImportance:
    def importance(self, sample: int) -> float | None:
        return None

    def is_high(self, sample: int) -> bool:
        return False

    def version(self) -> int:
        return 0

    def epoch(self) -> int:
        return 0


class _NoCache:
    def capacity(self) -> int:
        return 0

    def used(self) -> int:
        return 0

    def members(self, unit: int) -> Sequence[int]:
        return ()

    def unit_size(self, unit: int) -> int:
        return 0


@dataclass
class PolicyContext:
    """The read-only views a policy decides from (defaults: nothing known)."""

    cache: CacheView = field(default_factory=_NoCache)
    future: FutureView = field(default_factory=_NoFuture)
    importance: ImportanceView = field(default_factory=_NoImportance)


class CachePolicy(ABC):
    """Chooses what to cache, what to evict, and what may be substituted."""

    #: the name it is registered and selected under (``--policy NAME``)
    name: ClassVar[str] = ""
    #: options accepted as ``--policy NAME:key=value,...`` and their types
    options: ClassVar[Mapping[str, type]] = {}

    def __init__(self, ctx: PolicyContext | None = None, **opts: object) -> None:
        self.ctx = ctx or PolicyContext()
        unknown = set(opts) - set(self.options)
        if unknown:
            raise ValueError(f"policy {self.name!r} has no option(s) {', '.join(sorted(unknown))}"
                             f" (known: {', '.join(sorted(self.options)) or 'none'})")

    # ----- placement and admission ---------------------------------------------------

    def pack(self, sample: int, size: int) -> int:
        """Target size in bytes of the unit ``sample`` is packed into (:data:`PACK_ALONE`
        for a unit of its own, :data:`PACK_CHUNK` for the runner's chunk size). Samples
        with different answers never share a unit."""
        return PACK_CHUNK

    def on_request(self, sample: int) -> None:  # noqa: B027 - optional hook
        """Every sample asked for, hit or miss, before anything else (access counts)."""

    def admit(self, sample: int, size: int) -> bool:
        """Cache this sample, just fetched from the source? (It is served either way.)"""
        return True

    def on_dropped(self, sample: int) -> None:  # noqa: B027 - optional hook
        """An admitted sample will not be inserted after all (the writer could not)."""

    # ----- life of a unit ------------------------------------------------------------

    @abstractmethod
    def on_insert(self, unit: int, members: Sequence[int], size: int) -> None:
        """A unit of ``size`` bytes holding ``members`` entered the cache."""

    @abstractmethod
    def on_access(self, unit: int, sample: int) -> None:
        """``sample`` was served from ``unit``."""

    @abstractmethod
    def on_remove(self, unit: int) -> None:
        """The unit left the cache (evicted, released or dropped)."""

    def release_after_use(self, unit: int, sample: int) -> bool:
        """Called after :meth:`on_access`: True to remove the unit now (it will not be
        needed soon enough to be worth its room)."""
        return False

    @abstractmethod
    def victims(self, need: int, exclude: Collection[int]) -> list[int]:
        """Units whose removal frees at least ``need`` bytes (fewer if impossible), never
        one in ``exclude`` (pinned by reads in flight). The runner removes them and calls
        :meth:`on_remove` for each."""

    # ----- substitution (iCACHE) -----------------------------------------------------

    def substitutable(self, sample: int) -> bool:
        """May a miss of ``sample`` be served with another cached sample's bytes?"""
        return False

    def choose_substitute(self, sample: int, candidates: Sequence[int]) -> int | None:
        """Pick one of ``candidates`` (cached, not yet used this epoch, same class)."""
        return None

    def plan_package(self, pool: Sequence[int], size_of: Callable[[int], int | None],
                     unit_overhead: int = 0) -> list[int]:
        """Background packaging (iCACHE III-C; the runner asks only when substitution is
        on): samples of ``pool`` (the dataset's) to read from the source
        together and insert as ONE unit, or ``[]`` for nothing now. ``size_of(s)`` is the
        bytes ``s`` takes inside a unit (None if gone); ``unit_overhead`` the unit's own
        header. The answer's members count as admitted: each ends in :meth:`on_insert`
        or :meth:`on_dropped`."""
        return []

    # ----- background ----------------------------------------------------------------

    def maintain(self) -> bool:
        """Do a bounded step of background work; True while more remains."""
        return False

    def stats(self) -> dict:
        """Numbers for ``.dlcache/stats`` (policy-specific)."""
        return {}

    def __len__(self) -> int:  # number of units tracked
        return 0


#: the name used before the interface had a context (kept for third-party imports)
EvictionPolicy = CachePolicy


def parse_policy_spec(spec: str) -> tuple[str, dict[str, str]]:
    """``"icache:package=1M,h_ratio=0.9"`` -> ``("icache", {"package": "1M", ...})``."""
    name, _, rest = spec.partition(":")
    opts: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, val = item.partition("=")
        if not eq or not key:
            raise ValueError(f"policy option {item!r}: expected key=value")
        opts[key.strip()] = val.strip()
    return name.strip(), opts
