"""The caching policy contract: decisions only, over a read-only view of the cache.

A policy never does I/O and never touches the index. Whoever runs it (the chunk writer of
a mount, or ``dlcachefs simulate`` replaying a trace) tells it what happens and asks it
what to do. **Units** are what the cache stores and evicts as a whole: a chunk of the log
(one or more samples). Samples are ints (inode numbers in a mount, dataset indices in a
simulation); so are units.

**The core**, :class:`CachingPolicy`, is what every policy answers:

* :meth:`~CachingPolicy.on_request`: every sample asked for, hit or miss;
* :meth:`~CachingPolicy.admit`: cache this fetched sample at all? and
  :meth:`~CachingPolicy.on_dropped`: an admitted sample was not inserted after all;
* :meth:`~CachingPolicy.on_insert` / :meth:`~CachingPolicy.on_access` /
  :meth:`~CachingPolicy.on_remove`: the unit's life;
* :meth:`~CachingPolicy.victims`: which units to give up for ``need`` bytes;
* :meth:`~CachingPolicy.maintain`: a bounded step of background work, and
  :meth:`~CachingPolicy.stats`: numbers for ``.dlcache/stats``.

Only ``on_insert``, ``on_access``, ``on_remove`` and ``victims`` must be written; the
others have defaults that do nothing (admit everything, no background work, no numbers).
The core is a base class rather than a Protocol because it also carries what the registry
needs of a policy: its ``name``, its ``options`` and their check in ``__init__``.

**Capabilities** are what only some policies do, each a small contract of its own that a
policy *declares* by deriving from it:

* :class:`SupportsPacking` (``pack``): the size of the unit a fetched sample goes into
  (alone, a package of about N bytes, or the runner's ``--chunk-size``);
* :class:`SupportsPackagePlanning` (``plan_package``): iCACHE's dynamic packaging, which
  samples the runner's background packer reads from the source together into one unit;
* :class:`SupportsSubstitution` (``substitutable``, ``choose_substitute``): iCACHE's
  substitution of a missed sample by a cached one (the runner finds the candidates);
* :class:`SupportsReleaseAfterUse` (``release_after_use``): after one of its samples was
  served, should the unit go right away (Lobster's reuse rules, LCache's release)?

A runner asks a capability through the functions below (:func:`unit_target`,
:func:`plans_packages`, :func:`may_substitute`, :func:`substitute_for`,
:func:`releases_after_use`), which give the default answer for a policy without it: the
runner's chunk size, no packer, never substitute, never release after use.

Why the split, and why declared: a runner that asks a hook every policy carries cannot
tell "this policy packs" from "this policy inherited a packing hook that does nothing",
and then has to compare methods with the base class's to decide whether to start a
background packer. A capability the policy derives from says it in the class itself,
``isinstance`` answers it, and the core a new policy must understand stays small.
Capabilities are abstract base classes, not structural (``runtime_checkable``)
Protocols: a structural check only asks whether the methods exist, and every policy
written against :class:`CachePolicy` has them all. Packing and package planning are two
capabilities because a policy may choose unit sizes without planning packages (and its
runner must then not start a packer).

**Compatibility.** :class:`CachePolicy` (and its older name :data:`EvictionPolicy`), the
contract before the split, stays: a :class:`CachingPolicy` that still carries every hook
with its old default. A subclass of it is declared, when its class is made, to support
each capability one of whose hooks it (or a class between it and :class:`CachePolicy`)
defines, so a third-party policy that overrides ``plan_package`` is given a packer and
one that overrides ``release_after_use`` is asked after each use, as before; a hook it
does not override keeps its old default, which is the runner's default too. A subclass of
:class:`CachingPolicy` (e.g. of a built-in policy) that defines a capability's hook
without declaring the capability is declared to support it the same way, with a
:class:`DeprecationWarning` saying which capability to derive from.

What a policy may look at is a :class:`PolicyContext`: the cache (:class:`CacheView`),
the known future (:class:`FutureView`: clairvoyance from the announced sampler) and the
samples' importance (:class:`ImportanceView`: from the training's losses).

Concurrency: a policy runs on the trio loop in a mount (single-threaded, no locks) and is
called on the read path, so every call must be quick; long work (rebuilding a heap) is
cut into steps done by :meth:`CachingPolicy.maintain`, which the runner calls when idle.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

#: "no known next use" (beyond what the announced order tells)
NEVER = float("inf")

#: :meth:`SupportsPacking.pack` answers: the sample is a unit of its own / use the chunk size
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
    tell (this epoch and, when already known, the next), or :data:`NEVER`: an estimate
    that holds still between :meth:`generation` changes (it may then lie before
    ``now()`` for a reader running late).
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

    def used_by_next_epoch_end(self, sample: int) -> bool | None:
        """Is ``sample`` read again before the end of the next epoch (Lobster's release
        limit)? With several readers, each reader's own next epoch: True when one of them
        reads it before the end of its next epoch, False when none does, None when a
        reader's next epoch is not known."""

    def generation(self) -> int:
        """Changes whenever next uses may have moved other than by a read of their
        sample (new orders, a new estimate of the readers' paces): a policy that keeps
        next uses it computed (a heap by next use) computes them all again then."""


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

    def used_by_next_epoch_end(self, sample: int) -> bool | None:
        return None

    def generation(self) -> int:
        return 0


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


class CachingPolicy(ABC):
    """Chooses what to cache and what to evict: the hooks every policy answers (module
    docstring). Optional capabilities are declared by also deriving from
    :class:`SupportsPacking`, :class:`SupportsPackagePlanning`,
    :class:`SupportsSubstitution` or :class:`SupportsReleaseAfterUse`."""

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

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        _declare_implied_capabilities(cls)

    # ----- requests and admission ------------------------------------------------------

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

    @abstractmethod
    def victims(self, need: int, exclude: Collection[int]) -> list[int]:
        """Units whose removal frees at least ``need`` bytes (fewer if impossible), never
        one in ``exclude`` (pinned by reads in flight). The runner removes them and calls
        :meth:`on_remove` for each."""

    # ----- background ----------------------------------------------------------------

    def maintain(self) -> bool:
        """Do a bounded step of background work; True while more remains."""
        return False

    def stats(self) -> dict:
        """Numbers for ``.dlcache/stats`` (policy-specific)."""
        return {}

    def __len__(self) -> int:  # number of units tracked
        return 0


# ----- capabilities ------------------------------------------------------------------


class SupportsPacking(ABC):
    """The policy chooses the size of the unit each fetched sample goes into. Without
    it, the runner packs samples into units of its chunk size (:data:`PACK_CHUNK`)."""

    @abstractmethod
    def pack(self, sample: int, size: int) -> int:
        """Target size in bytes of the unit ``sample`` is packed into (:data:`PACK_ALONE`
        for a unit of its own, :data:`PACK_CHUNK` for the runner's chunk size). Samples
        with different answers never share a unit."""


class SupportsPackagePlanning(ABC):
    """The policy plans packages that a background packer reads from the source and
    inserts as one unit each (iCACHE III-C). Without it, no packer runs."""

    @abstractmethod
    def plan_package(self, pool: Sequence[int], size_of: Callable[[int], int | None],
                     unit_overhead: int = 0) -> list[int]:
        """Background packaging (the runner asks only when substitution is on): samples
        of ``pool`` (the dataset's) to read from the source together and insert as ONE
        unit, or ``[]`` for nothing now. ``size_of(s)`` is the bytes ``s`` takes inside a
        unit (None if gone); ``unit_overhead`` the unit's own header. The answer's
        members count as admitted: each ends in :meth:`~CachingPolicy.on_insert` or
        :meth:`~CachingPolicy.on_dropped`."""


class SupportsSubstitution(ABC):
    """The policy lets a missed sample be served with another cached sample's bytes
    (iCACHE's substitution, when the runner enables it). Without it, never."""

    @abstractmethod
    def substitutable(self, sample: int) -> bool:
        """May a miss of ``sample`` be served with another cached sample's bytes?"""

    @abstractmethod
    def choose_substitute(self, sample: int, candidates: Sequence[int]) -> int | None:
        """Pick one of ``candidates`` (cached, not yet used this epoch, same class), or
        None for no substitute."""


class SupportsReleaseAfterUse(ABC):
    """The policy may give a unit up as soon as one of its samples was served. Without
    it, a unit goes only as a victim."""

    @abstractmethod
    def release_after_use(self, unit: int, sample: int) -> bool:
        """Called after :meth:`~CachingPolicy.on_access`: True to remove the unit now (it
        will not be needed soon enough to be worth its room)."""


#: every capability a policy may declare
CAPABILITIES: tuple[type[ABC], ...] = (SupportsPacking, SupportsPackagePlanning,
                                       SupportsSubstitution, SupportsReleaseAfterUse)


# ----- what a runner asks (the default when a policy lacks the capability) ------------


def unit_target(policy: CachingPolicy, sample: int, size: int) -> int:
    """The unit size ``sample`` goes into (:meth:`SupportsPacking.pack`), else
    :data:`PACK_CHUNK`."""
    return policy.pack(sample, size) if isinstance(policy, SupportsPacking) else PACK_CHUNK


def plans_packages(policy: CachingPolicy) -> bool:
    """Does the policy plan packages (:class:`SupportsPackagePlanning`)? A runner starts
    its background packer only then."""
    return isinstance(policy, SupportsPackagePlanning)


def may_substitute(policy: CachingPolicy, sample: int) -> bool:
    """May a miss of ``sample`` be substituted (:meth:`SupportsSubstitution.substitutable`)?
    Never for a policy without substitution."""
    return isinstance(policy, SupportsSubstitution) and policy.substitutable(sample)


def substitute_for(policy: CachingPolicy, sample: int, candidates: Sequence[int]) -> int | None:
    """The substitute chosen among ``candidates`` for a miss of ``sample``
    (:meth:`SupportsSubstitution.choose_substitute`), None without substitution."""
    if not isinstance(policy, SupportsSubstitution):
        return None
    return policy.choose_substitute(sample, candidates)


def releases_after_use(policy: CachingPolicy, unit: int, sample: int) -> bool:
    """Remove ``unit`` now that ``sample`` was served from it
    (:meth:`SupportsReleaseAfterUse.release_after_use`)? Never without the capability."""
    return isinstance(policy, SupportsReleaseAfterUse) and policy.release_after_use(unit, sample)


def _declare_implied_capabilities(cls: type[CachingPolicy]) -> None:
    """Declare ``cls`` to support each capability it does not derive from but defines a
    hook of (a hook found in its MRO before any class holding only the defaults, i.e.
    :class:`CachePolicy`). Runs once per class, when it is made; runners only ever ask
    ``isinstance``. A subclass of :class:`CachePolicy` is declared silently (that is its
    contract); any other is warned, as its author meant to declare the capability."""
    if vars(cls).get("_hook_defaults"):
        return  # CachePolicy itself: its hooks are the runner's defaults
    legacy = any(vars(k).get("_hook_defaults") for k in cls.__mro__)
    for cap in CAPABILITIES:
        if issubclass(cls, cap):
            continue  # declared (or inherited from a declared class)
        hooks = sorted(h for h in cap.__abstractmethods__ if _implements(cls, h))
        if not hooks:
            continue
        cap.register(cls)
        if not legacy:
            warnings.warn(
                f"policy class {cls.__qualname__} defines {', '.join(hooks)} without "
                f"declaring {cap.__name__}: it is treated as declared; derive from "
                f"dlcachefs.cache.policy.{cap.__name__} to say so", DeprecationWarning,
                stacklevel=4)


def _implements(cls: type, hook: str) -> bool:
    """Does ``cls`` have its own ``hook`` (not only :class:`CachePolicy`'s default)?"""
    for k in cls.__mro__:
        if hook in vars(k):
            return not vars(k).get("_hook_defaults", False)
    return False


# ----- the contract before the split -------------------------------------------------


class CachePolicy(CachingPolicy):
    """The policy contract before capabilities, kept for third-party policies: every hook
    of every capability, with the default a runner uses for a policy without it. A
    subclass supports each capability one of whose hooks it overrides (module docstring);
    new policies derive from :class:`CachingPolicy` and declare their capabilities."""

    #: the hooks defined here are the defaults, not an implementation (see
    #: :func:`_declare_implied_capabilities`)
    _hook_defaults: ClassVar[bool] = True

    def pack(self, sample: int, size: int) -> int:
        """See :meth:`SupportsPacking.pack`; by default the runner's chunk size."""
        return PACK_CHUNK

    def release_after_use(self, unit: int, sample: int) -> bool:
        """See :meth:`SupportsReleaseAfterUse.release_after_use`; by default never."""
        return False

    def substitutable(self, sample: int) -> bool:
        """See :meth:`SupportsSubstitution.substitutable`; by default never."""
        return False

    def choose_substitute(self, sample: int, candidates: Sequence[int]) -> int | None:
        """See :meth:`SupportsSubstitution.choose_substitute`; by default none."""
        return None

    def plan_package(self, pool: Sequence[int], size_of: Callable[[int], int | None],
                     unit_overhead: int = 0) -> list[int]:
        """See :meth:`SupportsPackagePlanning.plan_package`; by default nothing."""
        return []


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
