"""One suite for every registered caching policy (built-in and entry-point ones), plus
the algorithms' own properties (Lobster's rules, iCACHE's heap and substitution) and the
simulator against Belady's bound."""

from __future__ import annotations

import random

import pytest
from dlcachefs.policies import (
    NEVER,
    PACK_ALONE,
    CachingPolicy,
    PolicyContext,
    make_policy,
    parse_policy_spec,
    registry,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlcachefs.cache.policy import releases_after_use, unit_target
from dlcachefs.importance.scores import Importance, percentile_ranks, select_epoch
from dlcachefs.sim.simulate import Trace, belady, run_policy, simulate

ALL = sorted(registry())


class Cache:
    def __init__(self, cap: int) -> None:
        self.cap, self.bytes, self.units = cap, 0, {}

    def capacity(self) -> int:
        return self.cap

    def used(self) -> int:
        return self.bytes

    def members(self, unit):
        return self.units.get(unit, ((), 0))[0]

    def unit_size(self, unit):
        return self.units.get(unit, ((), 0))[1]


class Future:
    def __init__(self, uses: dict[int, float], now: int = 0, horizon: int = 0,
                 length: int | None = None) -> None:
        self.uses, self.t, self.h, self.length = uses, now, horizon, length

    def now(self):
        return self.t

    def next_use(self, s):
        return self.uses.get(s, NEVER)

    def horizon(self):
        return self.h

    def epoch_length(self):
        return self.length

    def epoch_start(self):
        return 0

    def next_epoch_end(self):
        return self.h if self.length and self.h >= 2 * self.length - 1 else None

    def used_by_next_epoch_end(self, s):
        end = self.next_epoch_end()
        return None if end is None else self.next_use(s) <= end

    def generation(self):
        return hash(tuple(sorted(self.uses.items())))  # (a test may change the uses)


class Imp:
    def __init__(self, values: dict[int, float], high: set[int] | None, version: int = 1):
        self.values, self.high, self.v, self.ep = values, high, version, 0

    def importance(self, s):
        return self.values.get(s)

    def is_high(self, s):
        return self.high is None or s in self.high

    def version(self):
        return self.v

    def epoch(self):
        return self.ep


# ----- the shared contract ---------------------------------------------------------------


@pytest.mark.parametrize("name", ALL)
def test_registered_policy_is_a_cache_policy(name):
    cls = registry()[name]
    assert issubclass(cls, CachingPolicy) and cls.name == name
    assert isinstance(make_policy(name), CachingPolicy)


@pytest.mark.parametrize("name", ALL)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["insert", "access", "remove", "victims"]),
                              st.integers(0, 30), st.integers(1, 5000)), max_size=120),
       seed=st.integers(0, 1000))
def test_policy_contract(name, ops, seed):
    """Whatever happens, victims are tracked units, never excluded ones, never repeated,
    and free at least ``need`` bytes when the unexcluded units hold that much."""
    rnd = random.Random(seed)
    cache = Cache(20_000)
    uses = {s: rnd.choice([NEVER, rnd.randint(1, 500)]) for s in range(64)}
    imp = Imp({s: rnd.random() for s in range(64)}, {s for s in range(64) if s % 3 == 0})
    pol = make_policy(name, PolicyContext(cache, Future(uses, 0, 1000, 100), imp))
    live: dict[int, int] = {}
    for op, unit, size in ops:
        if op == "insert" and unit not in live:
            members = (unit, unit + 32) if unit_target(pol, unit, size) != PACK_ALONE else (unit,)
            pol.on_insert(unit, members, size)
            live[unit] = size
            cache.units[unit] = (members, size)
            cache.bytes += size
        elif op == "access" and unit in live:
            pol.on_access(unit, unit)
            if releases_after_use(pol, unit, unit):
                pass  # allowed at any time; the runner removes it
        elif op == "remove" and unit in live:
            pol.on_remove(unit)
            cache.bytes -= live.pop(unit)
            del cache.units[unit]
        elif op == "victims":
            exclude = {u for u in live if rnd.random() < 0.3}
            need = size
            vs = pol.victims(need, exclude)
            assert len(vs) == len(set(vs))
            assert set(vs) <= set(live) - exclude
            avail = sum(s for u, s in live.items() if u not in exclude)
            if avail >= need:
                assert sum(live[u] for u in vs) >= need
            for u in vs:
                pol.on_remove(u)
                cache.bytes -= live.pop(u)
                del cache.units[u]
        while pol.maintain():
            pass


@pytest.mark.parametrize("name", ALL)
def test_policy_options_are_checked(name):
    with pytest.raises(ValueError, match="no option"):
        make_policy(f"{name}:no_such_option=1")


def test_policy_spec_parsing_and_errors():
    assert parse_policy_spec("icache:package=2M, h_ratio=0.8") == (
        "icache", {"package": "2M", "h_ratio": "0.8"})
    assert make_policy("icache:package=2M").package == 2 << 20
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")
    with pytest.raises(ValueError, match="not a valid"):
        make_policy("icache:h_ratio=lots")


# ----- Lobster (reuse-distance) ------------------------------------------------------------


def test_reuse_distance_evicts_farthest_next_use_and_refuses_farther_admission():
    cache = Cache(300)
    fut = Future({1: 50, 2: 10, 3: 400, 4: 700}, now=0, horizon=1000, length=500)
    pol = make_policy("reuse-distance", PolicyContext(cache, fut))
    for u in (1, 2, 3):
        pol.on_insert(u, (u,), 100)
        cache.units[u] = ((u,), 100)
    cache.bytes = 300
    assert pol.victims(100, ()) == [3]
    assert pol.victims(200, {3}) == [1, 2]
    assert not pol.admit(4, 100)  # needed after everything cached: bypass
    fut.uses[5] = 20
    assert pol.admit(5, 100)


def test_reuse_distance_release_rules_need_a_known_next_epoch():
    cache = Cache(10_000)
    fut = Future({1: NEVER, 2: 900, 3: 1200}, now=100, horizon=500, length=500)
    pol = make_policy("reuse-distance", PolicyContext(cache, fut))
    for u in (1, 2, 3):
        pol.on_insert(u, (u,), 100)
    # the next epoch is not known (horizon = end of this epoch): nothing released
    assert not pol.release_after_use(1, 1)
    fut.h = 999  # now it is: limit = end of the next epoch = 100 + 2*500 - 100 - 1
    assert pol.release_after_use(1, 1)      # (a) no further use
    assert not pol.release_after_use(2, 2)  # used in the next epoch
    assert pol.release_after_use(3, 3)      # (b) farther than 2I - h


def test_reuse_distance_matches_belady_on_a_replayed_random_trace():
    rnd = random.Random(3)
    n = 300
    sizes = [rnd.randint(1000, 3000) for _ in range(n)]
    orders = [rnd.sample(range(n), n) for _ in range(4)]
    tr = Trace(sizes, [0] * n, orders)
    cap = sum(sizes) // 3
    rd, lru, opt = (run_policy(tr, "reuse-distance", cap), run_policy(tr, "lru", cap),
                    belady(tr, cap))
    assert opt.hit_ratio > 0
    assert rd.hit_ratio >= 0.9 * opt.hit_ratio
    assert rd.hit_ratio > 2 * lru.hit_ratio


# ----- iCACHE ----------------------------------------------------------------------------------


def test_icache_h_admission_by_heap_min_and_shadow_rebuild():
    cache = Cache(1000)
    imp = Imp({1: 0.5, 2: 0.2, 3: 0.9, 4: 0.1, 5: 0.6}, high={1, 2, 3, 4, 5})
    pol = make_policy("icache:h_ratio=0.5,package=100", PolicyContext(cache, Future({}), imp))
    assert pol.h_capacity() == 500
    for u in (1, 2, 3):
        assert pol.admit(u, 150) and pol.pack(u, 150) == PACK_ALONE
        pol.on_insert(u, (u,), 150)
    assert not pol.admit(4, 150)  # 0.1 is not greater than the heap min 0.2
    assert pol.admit(5, 150)      # 0.6 > 0.2: replaces the top-node
    assert pol.victims(150, ()) == [2]
    pol.on_remove(2)
    # importance changes: the old heap decides until the shadow heap is complete
    imp.values.update({1: 0.05})
    imp.v += 1
    pol.on_request(1)
    assert pol.victims(150, ()) == [3] or pol.stats()["rebuilding"]
    while pol.maintain():
        pass
    assert pol.stats()["shadow_swaps"] == 1
    assert pol.victims(150, ()) == [1]


def test_icache_substitutes_only_l_samples_from_the_l_cache_not_used_this_epoch():
    cache = Cache(10_000)
    imp = Imp({}, high={1})
    pol = make_policy("icache:package=200", PolicyContext(cache, Future({}), imp))
    assert not pol.substitutable(1)
    assert pol.choose_substitute(1, [10, 11]) is None  # never for an H-sample
    pol.on_insert(7, (10, 11), 220)  # an L package
    assert pol.substitutable(2)
    assert pol.choose_substitute(2, [1, 99]) is None  # candidates not in the L-cache
    first = pol.choose_substitute(2, [10, 11])
    pol.on_access(7, first)  # the runner served it
    second = pol.choose_substitute(3, [10, 11])
    pol.on_access(7, second)
    assert {first, second} == {10, 11}
    assert pol.choose_substitute(4, [10, 11]) is None  # both used this epoch
    imp.ep = 1
    assert pol.choose_substitute(4, [10, 11]) in (10, 11)


def test_icache_beats_lru_under_importance_sampling_in_simulation():
    n = 600
    rnd = random.Random(1)
    sizes = [rnd.randint(1000, 3000) for _ in range(n)]
    diff = [rnd.lognormvariate(0, 1) for _ in range(n)]
    iv = [float("nan")] * n
    orders, losses = [], []
    for e in range(6):
        o = select_epoch(n, e, 1, iv)
        orders.append(o)
        rep = {s: diff[s] for s in o}
        losses.append(rep)
        for s, v in rep.items():
            iv[s] = v
    tr = Trace(sizes, [s * 5 // n for s in range(n)], orders, losses)
    cap = sum(sizes) // 5
    ic = run_policy(tr, "icache", cap)
    lru = run_policy(tr, "lru", cap)
    assert ic.hit_ratio > 1.5 * lru.hit_ratio
    sub = run_policy(tr, "icache", cap, substitute=True)
    assert sub.substituted > 0 and sub.bytes_from_source < ic.bytes_from_source


# ----- importance, IIS and the simulator --------------------------------------------------


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=60))
def test_percentile_ranks_preserve_order(values):
    r = percentile_ranks(values)
    for i in range(len(values)):
        for j in range(len(values)):
            if values[i] < values[j]:
                assert r[i] < r[j]
            elif values[i] == values[j]:
                assert r[i] == r[j]
    assert all(0.0 <= x <= 1.0 for x in r)


def test_aiv_weights_jobs_by_benefit_and_h_list_takes_the_top():
    imp = Importance(4, h_fraction=0.5)
    imp.update("a", [0, 1, 2, 3], [4.0, 3.0, 2.0, 1.0])
    imp.update("b", [0, 1, 2, 3], [1.0, 2.0, 3.0, 4.0])
    assert imp.is_high(3)  # no H-list yet: everything counts as H
    imp.jobs["a"].benefit, imp.jobs["b"].benefit = 3.0, 1.2  # b is not cache-eligible
    imp.rebuild()
    assert imp.version() == 1
    assert [imp.is_high(i) for i in range(4)] == [True, True, False, False]
    imp.jobs["b"].benefit = 2.0  # both eligible: AIV = 3*RIV_a + 2*RIV_b
    imp.rebuild()
    assert imp.value(0) == pytest.approx(3.0) and imp.value(3) == pytest.approx(2.0)


def test_iis_selection_is_deterministic_full_in_warmup_and_favours_important():
    n = 2000
    iv = [float(i) for i in range(n)]
    assert sorted(select_epoch(n, 0, 5, iv)) == list(range(n))  # warm-up
    a, b = select_epoch(n, 4, 5, iv), select_epoch(n, 4, 5, iv)
    assert a == b and len(set(a)) == len(a) < n
    top, bottom = sum(1 for s in a if s >= n // 2), sum(1 for s in a if s < n // 2)
    assert top > bottom
    assert n - 1 in a  # the most important sample is always kept


def test_simulate_reports_every_policy_and_belady_bounds_them():
    rnd = random.Random(2)
    n = 200
    tr = Trace([rnd.randint(500, 1500) for _ in range(n)], [0] * n,
               [rnd.sample(range(n), n) for _ in range(3)])
    res = simulate(tr, ALL, [0.2, 0.5])
    for row in res["rows"]:
        for p in ALL:
            assert row[p]["accesses"] == 3 * n
            assert row[p]["hits"] + row[p]["misses"] + row[p]["substituted"] == 3 * n
            assert row[p]["hit_ratio"] <= row["belady"]["hit_ratio"] + 1e-9


@given(st.lists(st.tuples(st.sampled_from([0, 3000, 10_000]), st.integers(1, 5000)),
                max_size=60))
def test_writer_packs_records_into_units_by_target(recs):
    """The chunk writer's grouping: each record in exactly one unit, a target-0 record
    alone, one target per unit, and every unit but a target's last reaches its target."""
    from dlcachefs.cache.source import Identity
    from dlcachefs.cache.writer import Pending, _units

    pend = [Pending(i, b"k", Identity(n, 0, 0), b"x" * n, t) for i, (t, n) in enumerate(recs)]
    units = _units(pend)
    assert sorted(r.ino for u in units for r in u) == list(range(len(pend)))
    last: dict[int, int] = {}
    for k, u in enumerate(units):
        targets = {r.target for r in u}
        assert len(targets) == 1
        t = targets.pop()
        if t == 0:
            assert len(u) == 1
        last[t] = k
    for k, u in enumerate(units):
        t = u[0].target
        if t > 0 and k != last[t]:
            assert sum(r.encoded_len for r in u) >= t


def test_icache_pending_bytes_follow_admissions_inserts_and_drops():
    cache = Cache(10_000)
    imp = Imp({}, high={1, 2})
    pol = make_policy("icache:package=100,h_ratio=0.5", PolicyContext(cache, Future({}), imp))
    assert pol.admit(1, 300) and pol.admit(1, 300)  # admitted twice: counted once
    assert pol.admit(5, 80)                          # an L-sample
    assert (pol._pending_h, pol._pending_l) == (300, 80)
    pol.on_dropped(1)                                # the writer could not cache it
    pol.on_insert(9, (5,), 120)                      # the package, with its header
    assert (pol._pending_h, pol._pending_l) == (0, 0)


def _two_packages() -> tuple[CachingPolicy, Imp]:
    """iCACHE holding two packages of L-samples: chunk 1 = (10, 11), then 2 = (20, 21)."""
    imp = Imp({}, high=set())
    pol = make_policy("icache:package=100", PolicyContext(Cache(10_000), Future({}), imp))
    pol.on_insert(1, (10, 11), 200)
    pol.on_insert(2, (20, 21), 200)
    return pol, imp


def test_icache_gives_up_used_up_packages_first():
    pol, imp = _two_packages()
    for s in (20, 21):
        pol.on_access(2, s)
    assert pol.victims(100, ()) == [2]  # served whole this epoch, though newer
    assert pol.victims(300, ()) == [2, 1]
    imp.ep = 1  # a new epoch: nothing is used up any more
    pol.on_request(99)
    assert pol.victims(100, ()) == [1]


def test_icache_packages_that_became_mostly_h_are_given_up_after_the_rebuild():
    pol, imp = _two_packages()
    assert pol.victims(100, ()) == [1]  # the oldest
    imp.high = {20, 21}  # the H-list changed: package 2 holds H-samples now
    imp.v += 1
    while pol.maintain():
        pass
    assert pol.stats()["stale_packages"] == 1
    assert pol.victims(100, ()) == [2]


# ----- iCACHE dynamic packaging (III-C): the packer's choices ------------------------------


def _packaging_policy(cap: int, package: int, n: int, high: set[int] | None, **opts):
    cache = Cache(cap)
    imp = Imp({}, high=high)
    spec = f"icache:package={package}" + "".join(f",{k}={v}" for k, v in opts.items())
    return make_policy(spec, PolicyContext(cache, Future({}), imp)), cache, imp


def _insert(pol, cache: Cache, uid: int, members, size: int) -> None:
    cache.units[uid] = (tuple(members), size)
    cache.bytes += size
    pol.on_insert(uid, tuple(members), size)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=200),
       classes=st.integers(1, 6),
       h_share=st.floats(0.0, 1.0),
       cap=st.integers(0, 400_000),
       package=st.integers(1, 200_000),
       overhead=st.integers(0, 64),
       seed=st.integers(0, 3))
def test_icache_packages_hold_only_uncached_l_samples_within_the_l_share(
        sizes, classes, h_share, cap, package, overhead, seed):
    """Whatever the sizes, classes and H/L split: a package holds distinct L-samples of
    the dataset, none cached or pending; the packages never take more than the L-share;
    each reaches the package size unless no other L-sample would fit; and packing stops
    only when there is no room for a package or nothing left to pack."""
    n = len(sizes)
    rnd = random.Random(seed)
    high = {s for s in range(n) if rnd.random() < h_share}
    pol, cache, _ = _packaging_policy(cap, package, n, high, seed=seed)
    cls = [s % classes for s in range(n)]
    # some H-samples cached already (the H-cache), as a mount would have them
    uid = 1
    for s in sorted(high)[: n // 4]:
        if cache.bytes + sizes[s] <= pol.h_capacity():
            _insert(pol, cache, uid, (s,), sizes[s])
            uid += 1
    pool = list(range(n))
    packed: set[int] = set()
    l_bytes = 0
    assert pol.package_size() <= pol.l_capacity() <= max(cap, 0)
    assert pol.l_capacity() >= min(package, cap // 2)
    for _ in range(n + 1):
        room = pol._l_room()
        plan = pol.plan_package(pool, sizes.__getitem__, overhead)
        if not plan:
            break
        assert len(set(plan)) == len(plan) and set(plan) <= set(pool)
        assert not (set(plan) & high) and not (set(plan) & packed)
        size = overhead + sum(sizes[s] for s in plan)
        assert size <= room
        assert {cls[s] for s in plan} <= set(range(classes))
        if size < pol.package_size():  # short: no other L-sample fits what was left
            left = [s for s in range(n) if s not in high and s not in packed and s not in plan]
            assert all(size + sizes[s] > room for s in left)
        packed.update(plan)
        _insert(pol, cache, uid, plan, size)
        uid += 1
        l_bytes += size
    else:
        raise AssertionError("the packer never stopped")
    assert l_bytes <= pol.l_capacity()
    unpacked = [s for s in range(n) if s not in high and s not in packed]
    room = pol.l_capacity() - l_bytes
    # stopped: no room for a package, or no L-sample left that fits the room
    assert room < pol.package_size() or all(overhead + sizes[s] > room for s in unpacked)


def test_icache_packs_nothing_before_the_h_list_and_caps_packages_by_the_l_share():
    pol, _, imp = _packaging_policy(1 << 20, 1 << 20, 100, None)
    assert pol.plan_package(list(range(100)), lambda s: 1000, 0) == []  # all H: no H-list
    assert pol.l_capacity() == 1 << 19  # a cache of one package: half of it for L
    assert pol.package_size() == 1 << 19
    imp.high = set()
    plan = pol.plan_package(list(range(1000)), lambda s: 1000, 0)
    assert 1000 * len(plan) >= (1 << 19) - 1000 and 1000 * len(plan) <= 1 << 19


def test_icache_turns_the_l_cache_over_and_repacks_missed_ids_first():
    n = 100
    pol, cache, imp = _packaging_policy(40_000, 10_000, n, set(range(50, 100)), h_ratio=0.5)
    pool = list(range(n))
    assert pol.l_capacity() == 20_000
    p1 = pol.plan_package(pool, lambda s: 1000, 0)
    p2 = pol.plan_package(pool, lambda s: 1000, 0)
    assert len(p1) == len(p2) == 10 and not set(p1) & set(p2)
    assert pol.plan_package(pool, lambda s: 1000, 0) == []  # the L-share is full
    _insert(pol, cache, 1, p1, 10_000)
    _insert(pol, cache, 2, p2, 10_000)
    assert pol.stats()["packages"] == 2
    # the reader: every sample of package 1 is served this epoch (hits or substitutes),
    # and some uncached L-samples miss (substituted: their IDs are recorded)
    missed = [s for s in range(50) if s not in p1 and s not in p2][:5]
    for s in p1:
        pol.on_request(s)
        pol.on_access(1, s)
    for s in missed:
        pol.on_request(s)
        assert pol.choose_substitute(s, p2) in p2
    assert not pol.admit(missed[0], 1000)  # packaging: L misses are not admitted alone
    p3 = pol.plan_package(pool, lambda s: 1000, 0)  # package 1 used up: room again
    assert len(p3) == 10
    assert not set(p3) & set(missed)  # requested this epoch: useless as substitutes now
    assert not set(p3) & (set(p1) | set(p2))
    assert pol.victims(10_000, ()) == [1]  # the used-up package makes the room
    pol.on_remove(1)
    _insert(pol, cache, 3, p3, 10_000)
    # the H-list changes at the next epoch: the missed IDs are repacked first
    imp.v += 1
    imp.ep = 1
    pol.on_request(99)
    for u in (2, 3):
        pol.on_remove(u)
    p4 = pol.plan_package(pool, lambda s: 1000, 0)
    assert p4[: len(missed)] == missed
    assert pol.stats()["repack_queue"] == 0


def test_simulated_substitution_with_packaging_stays_in_the_class_and_spares_h_samples():
    rnd = random.Random(4)
    n, classes = 400, 5
    sizes = [rnd.randint(1000, 3000) for _ in range(n)]
    orders = [rnd.sample(range(n), n) for _ in range(4)]
    losses = [{s: rnd.random() for s in range(n)} for _ in range(4)]
    tr = Trace(sizes, [s % classes for s in range(n)], orders, losses)
    from dlcachefs.policies.icache import ICachePolicy

    seen: list[tuple[int, int, bool]] = []
    orig = ICachePolicy.choose_substitute

    def spy(self, sample, candidates):
        pick = orig(self, sample, candidates)
        if pick is not None:
            seen.append((sample, pick, self._high(pick) or self._high(sample)))
        return pick

    ICachePolicy.choose_substitute = spy
    try:
        res = run_policy(tr, "icache:package=20000", sum(sizes) // 5, substitute=True)
    finally:
        ICachePolicy.choose_substitute = orig
    assert res.substituted > 0 and res.policy_stats["packages"] > 0
    assert all(tr.classes[s] == tr.classes[p] and not h for s, p, h in seen)
    assert sum(res.policy_stats["substitutions_by_epoch"].values()) == res.substituted


def test_icache_repacks_a_missed_id_only_while_it_can_still_be_read_this_epoch():
    n = 60
    pol, _, imp = _packaging_policy(40_000, 10_000, n, set(range(30, 60)), h_ratio=0.5)
    pool = list(range(n))
    pol.plan_package([], lambda s: 1000, 0)  # the packer's first look: packaging on
    for s in (1, 2, 3):
        pol.on_request(s)
        assert not pol.admit(s, 1000)  # an L miss: recorded, not cached alone
    imp.ep = 1  # the next epoch: the missed IDs go first...
    pol.on_request(2)  # ...except one already asked for again
    plan = pol.plan_package(pool, lambda s: 1000, 0)
    assert plan[:2] == [1, 3] and 2 not in plan
    assert pol.stats()["missed_l"] == 1  # 2 waits for the epoch after
    pol.on_dropped(1)
    imp.ep = 2
    assert pol.plan_package(pool, lambda s: 1000, 0)[0] == 2


def test_icache_counts_a_substitute_when_served_and_never_picks_one_twice_at_once():
    cache = Cache(10_000)
    imp = Imp({}, high=set())
    pol = make_policy("icache:package=200", PolicyContext(cache, Future({}), imp))
    pol.on_insert(7, (10, 11), 220)
    a = pol.choose_substitute(2, [10, 11])  # two misses in flight at once
    b = pol.choose_substitute(3, [10, 11])
    assert {a, b} == {10, 11}
    assert pol.choose_substitute(4, [10, 11]) is None  # both taken, though not served yet
    assert pol.stats()["substitutions"] == 0  # chosen, not served
    pol.on_access(7, a)
    assert pol.stats()["substitutions"] == 1
    assert pol.stats()["substitutions_by_epoch"] == {"0": 1}


@settings(max_examples=40, deadline=None)
@given(st.integers(5, 40), st.integers(1, 4), st.integers(0, 2**16), st.floats(0.1, 0.9))
def test_the_lru_policy_is_the_reference_lru(n, epochs, seed, frac):
    """The ``lru`` policy, replayed by the simulator with one sample per unit, makes the
    same hits as the reference LRU (``lru_counts``, the offline baseline of the benches),
    and neither beats Belady."""
    from dlcachefs.sim.simulate import belady_counts, lru_counts

    rnd = random.Random(seed)
    sizes = [rnd.randint(1, 1000) for _ in range(n)]
    orders = [rnd.sample(range(n), n) for _ in range(epochs)]
    tr = Trace(sizes, [0] * n, orders)
    cap = max(1, int(sum(sizes) * frac))
    seq = [s for o in orders for s in o]
    ref = lru_counts(seq, sizes, cap)
    got = run_policy(tr, "lru", cap)
    assert got.hits == ref[0]
    assert ref[0] <= belady_counts(seq, sizes, cap)[0]
