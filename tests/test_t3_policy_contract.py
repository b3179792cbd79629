"""The policy contract: the core every policy answers, the capabilities a policy declares
(packing, package planning, substitution, release after use) and how a runner asks them,
and policies written against the contract before capabilities (:class:`CachePolicy`),
registered through the entry-point group and run by the simulator and by the engine."""

from __future__ import annotations

import random
import warnings
from collections.abc import Callable, Collection, Sequence
from importlib.metadata import EntryPoint

import dlcachefs.policies as policies_pkg
import pytest
from dlcachefs.policies import (
    ENTRY_POINT_GROUP,
    ICachePolicy,
    LRUPolicy,
    ReuseDistancePolicy,
    make_policy,
    registry,
)

from dlcachefs.cache.policy import (
    CAPABILITIES,
    PACK_ALONE,
    PACK_CHUNK,
    CachePolicy,
    CachingPolicy,
    SupportsPackagePlanning,
    SupportsPacking,
    SupportsReleaseAfterUse,
    SupportsSubstitution,
    may_substitute,
    plans_packages,
    releases_after_use,
    substitute_for,
    unit_target,
)
from dlcachefs.sim.simulate import Trace, run_policy
from dlcachefs.testing.fakes import make_config, run_session, write_tree


def caps(obj: object) -> set[str]:
    cls = obj if isinstance(obj, type) else type(obj)
    return {c.__name__ for c in CAPABILITIES if issubclass(cls, c)}


# ----- policies written against the contract before capabilities ----------------------


class LegacyLRU(CachePolicy):
    """Only the hooks that were abstract: no capability."""

    name = "legacy-lru"

    def __init__(self, ctx=None, **opts: object) -> None:
        super().__init__(ctx, **opts)
        self.inner = LRUPolicy(self.ctx)

    def __len__(self) -> int:
        return len(self.inner)

    def on_insert(self, unit: int, members: Sequence[int], size: int) -> None:
        self.inner.on_insert(unit, members, size)

    def on_access(self, unit: int, sample: int) -> None:
        self.inner.on_access(unit, sample)

    def on_remove(self, unit: int) -> None:
        self.inner.on_remove(unit)

    def victims(self, need: int, exclude: Collection[int]) -> list[int]:
        return self.inner.victims(need, exclude)


class LegacyReuseDistance(LegacyLRU):
    """Admission and release after use overridden (Lobster's rules, by the built-in)."""

    name = "legacy-reuse-distance"
    options = ReuseDistancePolicy.options

    def __init__(self, ctx=None, **opts: object) -> None:
        CachePolicy.__init__(self, ctx, **opts)
        self.inner = ReuseDistancePolicy(self.ctx, **opts)

    def admit(self, sample: int, size: int) -> bool:
        return self.inner.admit(sample, size)

    def release_after_use(self, unit: int, sample: int) -> bool:
        return self.inner.release_after_use(unit, sample)

    def stats(self) -> dict:
        return self.inner.stats()


class LegacyICache(CachePolicy):
    """Every hook overridden (iCACHE, by the built-in): every capability."""

    name = "legacy-icache"
    options = ICachePolicy.options

    def __init__(self, ctx=None, **opts: object) -> None:
        super().__init__(ctx, **opts)
        self.inner = ICachePolicy(self.ctx, **opts)

    def __len__(self) -> int:
        return len(self.inner)

    def pack(self, sample: int, size: int) -> int:
        return self.inner.pack(sample, size)

    def on_request(self, sample: int) -> None:
        self.inner.on_request(sample)

    def admit(self, sample: int, size: int) -> bool:
        return self.inner.admit(sample, size)

    def on_dropped(self, sample: int) -> None:
        self.inner.on_dropped(sample)

    def on_insert(self, unit: int, members: Sequence[int], size: int) -> None:
        self.inner.on_insert(unit, members, size)

    def on_access(self, unit: int, sample: int) -> None:
        self.inner.on_access(unit, sample)

    def on_remove(self, unit: int) -> None:
        self.inner.on_remove(unit)

    def release_after_use(self, unit: int, sample: int) -> bool:
        return self.inner.release_after_use(unit, sample)

    def victims(self, need: int, exclude: Collection[int]) -> list[int]:
        return self.inner.victims(need, exclude)

    def substitutable(self, sample: int) -> bool:
        return self.inner.substitutable(sample)

    def choose_substitute(self, sample: int, candidates: Sequence[int]) -> int | None:
        return self.inner.choose_substitute(sample, candidates)

    def plan_package(self, pool: Sequence[int], size_of: Callable[[int], int | None],
                     unit_overhead: int = 0) -> list[int]:
        return self.inner.plan_package(pool, size_of, unit_overhead)

    def maintain(self) -> bool:
        return self.inner.maintain()

    def stats(self) -> dict:
        return self.inner.stats()


LEGACY = (LegacyLRU, LegacyReuseDistance, LegacyICache)


@pytest.fixture
def legacy_registered(monkeypatch):
    """The legacy policies installed as a third-party package would be: entry points of
    the group ``dlcachefs.policies`` naming their classes."""
    eps = [EntryPoint(cls.name, f"{__name__}:{cls.__name__}", ENTRY_POINT_GROUP)
           for cls in LEGACY]

    def entry_points(*, group: str):
        return [ep for ep in eps if ep.group == group]

    monkeypatch.setattr(policies_pkg, "entry_points", entry_points)


# ----- capabilities: declared, asked, defaulted -----------------------------------------


def test_builtin_policies_declare_their_capabilities():
    assert caps(LRUPolicy) == set()
    assert caps(registry()["reuse-distance"]) == caps(registry()["lcache"]) == {
        "SupportsReleaseAfterUse"}
    assert caps(ICachePolicy) == {"SupportsPacking", "SupportsPackagePlanning",
                                  "SupportsSubstitution", "SupportsReleaseAfterUse"}
    for cls in registry().values():
        assert issubclass(cls, CachingPolicy) and not issubclass(cls, CachePolicy)


def test_a_policy_without_a_capability_gets_the_runners_defaults():
    pol = make_policy("lru")
    for hook in ("pack", "plan_package", "substitutable", "choose_substitute",
                 "release_after_use"):
        assert not hasattr(pol, hook)  # the core holds none of them
    pol.on_insert(1, (1, 2), 100)
    assert unit_target(pol, 1, 100) == PACK_CHUNK
    assert not plans_packages(pol)
    assert not may_substitute(pol, 1) and substitute_for(pol, 1, [2]) is None
    assert not releases_after_use(pol, 1, 1)


def test_the_runner_asks_a_declared_capability():
    class Packs(LRUPolicy, SupportsPacking, SupportsSubstitution, SupportsReleaseAfterUse):
        def pack(self, sample, size):
            return PACK_ALONE

        def substitutable(self, sample):
            return sample % 2 == 0

        def choose_substitute(self, sample, candidates):
            return candidates[-1]

        def release_after_use(self, unit, sample):
            return unit == 7

    pol = Packs()
    assert caps(pol) == {"SupportsPacking", "SupportsSubstitution", "SupportsReleaseAfterUse"}
    assert unit_target(pol, 3, 10) == PACK_ALONE and not plans_packages(pol)
    assert may_substitute(pol, 2) and not may_substitute(pol, 3)
    assert substitute_for(pol, 2, [5, 6]) == 6
    assert releases_after_use(pol, 7, 1) and not releases_after_use(pol, 8, 1)


def test_a_declared_capability_must_be_implemented():
    class Forgot(LRUPolicy, SupportsPackagePlanning):
        pass

    with pytest.raises(TypeError, match="plan_package"):
        Forgot()


def test_an_undeclared_hook_on_the_new_contract_is_declared_with_a_warning():
    """A subclass of a built-in written as before (it defines the hook, declares
    nothing) keeps being asked, and its author is told what to declare."""
    with pytest.warns(DeprecationWarning, match="SupportsReleaseAfterUse") as rec:
        class Releasing(LRUPolicy):
            def release_after_use(self, unit, sample):
                return True

    assert rec[0].filename == __file__  # the warning points at the class statement
    assert caps(Releasing) == {"SupportsReleaseAfterUse"}
    assert releases_after_use(Releasing(), 1, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # declared, or inherited: no warning

        class Declared(LRUPolicy, SupportsReleaseAfterUse):
            def release_after_use(self, unit, sample):
                return True

        class Inherits(Releasing):
            pass

    assert caps(Declared) == caps(Inherits) == {"SupportsReleaseAfterUse"}


# ----- the contract before capabilities ------------------------------------------------


def _legacy(**hooks) -> type[CachePolicy]:
    return type("P", (LegacyLRU,), dict(hooks))


@pytest.mark.parametrize(("hooks", "expected"), [
    ({}, set()),
    ({"pack": lambda self, s, n: PACK_ALONE}, {"SupportsPacking"}),
    ({"plan_package": lambda self, pool, size_of, o=0: []}, {"SupportsPackagePlanning"}),
    ({"substitutable": lambda self, s: True}, {"SupportsSubstitution"}),
    ({"choose_substitute": lambda self, s, c: None}, {"SupportsSubstitution"}),
    ({"release_after_use": lambda self, u, s: True}, {"SupportsReleaseAfterUse"}),
    ({"pack": lambda self, s, n: 0, "release_after_use": lambda self, u, s: False},
     {"SupportsPacking", "SupportsReleaseAfterUse"}),
])
def test_a_legacy_policy_supports_each_capability_it_overrides_a_hook_of(hooks, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the old contract: overriding is declaring
        cls = _legacy(**hooks)
        sub = type("Q", (cls,), {})
    assert caps(cls) == caps(sub) == expected
    assert caps(CachePolicy) == set()  # its own hooks are the defaults


def test_a_legacy_policy_keeps_the_old_defaults_for_hooks_it_did_not_override():
    """Overriding one hook of a capability declares it; the capability's other hooks
    answer what they always did, which is the runner's default."""
    pol = _legacy(choose_substitute=lambda self, s, c: c[0])()
    assert isinstance(pol, SupportsSubstitution)
    assert not may_substitute(pol, 1)  # substitutable: CachePolicy's default, False
    plain = LegacyLRU()
    assert unit_target(plain, 1, 10) == plain.pack(1, 10) == PACK_CHUNK
    assert plain.plan_package([1], lambda s: 1) == [] and not plans_packages(plain)
    assert not releases_after_use(plain, 1, 1)


def test_the_old_names_stay_importable():
    import dlcachefs.policies.base as base

    import dlcachefs.cache.policy as contract

    assert policies_pkg.EvictionPolicy is policies_pkg.CachePolicy is CachePolicy
    assert base.CachePolicy is base.EvictionPolicy is contract.EvictionPolicy is CachePolicy
    assert base.CachingPolicy is policies_pkg.CachingPolicy is CachingPolicy
    assert issubclass(CachePolicy, CachingPolicy)


def test_legacy_policies_register_through_entry_points(legacy_registered):
    reg = registry()
    for cls in LEGACY:
        assert reg[cls.name] is cls
    pol = make_policy("legacy-icache:package=20000,h_ratio=0.8")
    assert pol.inner.package == 20000 and pol.inner.h_ratio == 0.8
    assert caps(pol) == caps(ICachePolicy)
    assert caps(reg["legacy-reuse-distance"]) == {"SupportsReleaseAfterUse"}
    with pytest.raises(ValueError, match="no option"):
        make_policy("legacy-lru:eager=1")


def _trace(seed: int = 4, n: int = 400, classes: int = 5, epochs: int = 4) -> Trace:
    rnd = random.Random(seed)
    sizes = [rnd.randint(1000, 3000) for _ in range(n)]
    orders = [rnd.sample(range(n), n) for _ in range(epochs)]
    losses = [{s: rnd.random() for s in range(n)} for _ in range(epochs)]
    return Trace(sizes, [s % classes for s in range(n)], orders, losses)


def _outcome(res) -> tuple:
    return (res.hits, res.misses, res.substituted, res.accesses, res.bytes_from_source,
            res.policy_stats)


@pytest.mark.parametrize(("builtin", "legacy"), [
    ("lru", "legacy-lru"),
    ("reuse-distance", "legacy-reuse-distance"),
    ("icache:package=20000", "legacy-icache:package=20000"),
])
@pytest.mark.parametrize("substitute", [False, True])
def test_a_legacy_policy_runs_as_the_policy_it_wraps(legacy_registered, builtin, legacy,
                                                     substitute):
    """The simulator (the chunk writer's and the engine's calls) drives a legacy policy
    through the registry exactly as the built-in whose hooks it overrides: same hits,
    misses, substitutions, bytes from the source and policy numbers."""
    tr = _trace()
    cap = sum(tr.sizes) // 5
    for chunk_size in (0, 8000):
        want = run_policy(tr, builtin, cap, chunk_size=chunk_size, substitute=substitute)
        got = run_policy(tr, legacy, cap, chunk_size=chunk_size, substitute=substitute)
        assert _outcome(got) == _outcome(want)
    if substitute and "icache" in builtin:
        assert want.substituted > 0 and want.policy_stats["packages"] > 0


def test_a_legacy_planner_gets_the_engines_packer_and_substitutes(legacy_registered, tmp_path):
    """A mount of a legacy policy that overrides ``plan_package``: the engine starts its
    packer and serves L-misses by substitution, as for the built-in iCACHE; a legacy
    policy that does not plan gets no packer."""
    rnd = random.Random(0)
    files = {f"c{c}/{i:03d}.jpg".encode(): rnd.randbytes(rnd.randint(3000, 6000))
             for c in range(3) for i in range(30)}
    write_tree(tmp_path / "src", files)
    n = len(files)
    losses = [float((i * 7) % n) for i in range(n)]  # a permutation: H and L mixed

    async def body(sess):
        eng = sess.engine
        sl = await sess.streams.lists.ensure_sample_list("")
        sess.importance.bind("", sl.inos, eng.cfg.h_fraction)
        sess.importance.table.update("j", list(range(len(sl.inos))), losses)
        sess.importance.table.rebuild()
        while await sess.packer.step():
            pass
        await eng.flush()
        from dlcachefs.clairvoyance.streams import Stream

        s = Stream("j", 0)
        sess.streams.stream_of = lambda pid: s  # every open is this stream's
        served = {}
        for rel in sorted(files):
            r = await eng.open(eng.ns.resolve(rel).ino, pid=1)
            try:
                served[rel] = bytes(await eng.read(r.fh, 0, 1 << 20))
            finally:
                eng.release(r.fh)
        return served

    cfg = make_config(tmp_path / "src", tmp_path / "cache", cache_size=150_000,
                      policy="legacy-icache:package=30000", substitute=True)
    served, sess = run_session(cfg, body)
    eng = sess.engine
    assert isinstance(eng.policy, LegacyICache) and sess.packer is not None
    assert sess.packer.stats.packages >= 1
    subs = sum(1 for rel, got in served.items() if got != files[rel])
    assert subs > 0 and eng.counters.substitutions == subs

    async def read_all(eng):
        for rel in sorted(files):
            r = await eng.open(eng.ns.resolve(rel).ino, pid=1)
            try:
                assert bytes(await eng.read(r.fh, 0, 1 << 20)) == files[rel]
            finally:
                eng.release(r.fh)

    cfg = make_config(tmp_path / "src", tmp_path / "cache2", cache_size=150_000,
                      policy="legacy-lru", substitute=True)
    _, sess = run_session(cfg, lambda s: read_all(s.engine))
    eng = sess.engine
    assert isinstance(eng.policy, LegacyLRU) and sess.packer is None
    assert eng.counters.substitutions == 0
