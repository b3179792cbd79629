"""Caching policies, registered by name.

Built-in policies are listed here; third-party ones register through the entry-point
group ``dlcachefs.policies`` (an entry point names a class derived from
:class:`EvictionPolicy`). Duplicate names are refused.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from .base import EvictionPolicy
from .lru import LRUPolicy

ENTRY_POINT_GROUP = "dlcachefs.policies"

_BUILTIN: dict[str, type[EvictionPolicy]] = {LRUPolicy.name: LRUPolicy}


def registry() -> dict[str, type[EvictionPolicy]]:
    """All policies by name: the built-in ones and those installed through entry points."""
    out = dict(_BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in out:
            raise ValueError(f"policy name {ep.name!r} is registered twice")
        cls = ep.load()
        if not (isinstance(cls, type) and issubclass(cls, EvictionPolicy)):
            raise TypeError(f"entry point {ep.name!r} is not an EvictionPolicy class")
        out[ep.name] = cls
    return out


def make_policy(name: str) -> EvictionPolicy:
    reg = registry()
    if name not in reg:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(sorted(reg))}")
    return reg[name]()


__all__ = ["EvictionPolicy", "LRUPolicy", "make_policy", "registry"]
