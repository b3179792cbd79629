"""Caching policies, registered by name.

Built-in policies are listed here; third-party ones register through the entry-point
group ``dlcachefs.policies``: an entry point names a class derived from
:class:`CachingPolicy` (the contract, :mod:`dlcachefs.cache.policy`), e.g. in the
plugin's ``pyproject.toml``::

    [project.entry-points."dlcachefs.policies"]
    mine = "my_package.policy:MyPolicy"

Duplicate names are refused. A policy is chosen with ``--policy NAME[:key=value,...]``;
the options a policy takes are its ``options``, passed to its ``__init__`` by keyword.

A policy implements the core hooks of :class:`CachingPolicy` and declares what else it
does by also deriving from capabilities: :class:`SupportsPacking` (unit sizes),
:class:`SupportsPackagePlanning` (packages built by a background packer),
:class:`SupportsSubstitution` (a miss served with another sample) and
:class:`SupportsReleaseAfterUse` (a unit given up once used); a runner does its default
for a capability a policy lacks (chunk-sized units, no packer, no substitution, a unit
goes only as a victim). The built-in ones: ``lru`` (core only), ``reuse-distance`` and
``lcache`` (release after use), ``icache`` (all four).

A class derived from :class:`CachePolicy` (or :data:`EvictionPolicy`), the contract
before capabilities, still registers and runs as before: it supports each capability one
of whose hooks it overrides.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from dlcachefs.policies.icache import ICachePolicy
from dlcachefs.policies.lcache import LCachePolicy
from dlcachefs.policies.lru import LRUPolicy
from dlcachefs.policies.reuse_distance import ReuseDistancePolicy

from dlcachefs.cache.policy import (
    NEVER,
    PACK_ALONE,
    PACK_CHUNK,
    CachePolicy,
    CacheView,
    CachingPolicy,
    EvictionPolicy,
    FutureView,
    ImportanceView,
    PolicyContext,
    SupportsPackagePlanning,
    SupportsPacking,
    SupportsReleaseAfterUse,
    SupportsSubstitution,
    parse_policy_spec,
)

ENTRY_POINT_GROUP = "dlcachefs.policies"

_BUILTIN: dict[str, type[CachingPolicy]] = {
    cls.name: cls for cls in (LRUPolicy, ReuseDistancePolicy, LCachePolicy, ICachePolicy)}


def registry() -> dict[str, type[CachingPolicy]]:
    """All policies by name: the built-in ones and those installed through entry points."""
    out = dict(_BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in out:
            raise ValueError(f"policy name {ep.name!r} is registered twice")
        cls = ep.load()
        if not (isinstance(cls, type) and issubclass(cls, CachingPolicy)):
            raise TypeError(f"entry point {ep.name!r} is not a CachingPolicy class")
        out[ep.name] = cls
    return out


def _convert(policy: str, key: str, typ: type, text: str) -> object:
    try:
        if typ is bool:
            low = text.lower()
            if low not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return low in ("true", "1", "yes")
        if typ is int:
            from dlcachefs.units import parse_size  # noqa: PLC0415 - sizes like 1M

            return parse_size(text) if not text.lstrip("-").isdigit() else int(text)
        return typ(text)
    except ValueError:
        raise ValueError(f"policy {policy!r}: option {key}={text!r} is not a valid "
                         f"{typ.__name__}") from None


def make_policy(spec: str, ctx: PolicyContext | None = None) -> CachingPolicy:
    """Build a policy from ``NAME[:key=value,...]`` with the given context."""
    name, raw = parse_policy_spec(spec)
    reg = registry()
    if name not in reg:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(sorted(reg))}")
    cls = reg[name]
    unknown = set(raw) - set(cls.options)
    if unknown:
        raise ValueError(f"policy {name!r} has no option(s) {', '.join(sorted(unknown))} "
                         f"(known: {', '.join(sorted(cls.options)) or 'none'})")
    opts = {k: _convert(name, k, cls.options[k], v) for k, v in raw.items()}
    return cls(ctx, **opts)


__all__ = ["NEVER", "PACK_ALONE", "PACK_CHUNK", "CachePolicy", "CacheView", "CachingPolicy",
           "EvictionPolicy", "FutureView", "ICachePolicy", "ImportanceView", "LCachePolicy",
           "LRUPolicy", "PolicyContext", "ReuseDistancePolicy", "SupportsPackagePlanning",
           "SupportsPacking", "SupportsReleaseAfterUse", "SupportsSubstitution", "make_policy",
           "parse_policy_spec", "registry"]
