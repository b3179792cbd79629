"""Several datasets in one cache (--shared-cache): two daemons, one root, one budget.

Mounted for real: a fast source (a local directory) and a slow one (the same kind of
tree behind ``dlcachefs.testing.passthrough --delay-ms``, so every open of a source file waits), each
mounted by its own daemon on one cache root with a budget smaller than either dataset.
The ledger's lock is held while both daemons' chunk bytes are sampled: no limit can grow
then (store.ledger), so the sum read is a sum at one instant.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import requires_fuse
from hypothesis import given, settings
from hypothesis import strategies as st

from dlcachefs.cache.shares import allocate, decayed, reclaim_order, reclaim_plan
from dlcachefs.mountctl import MountError
from dlcachefs.store import ledger as L
from dlcachefs.store import schema as S
from dlcachefs.testing.mounting import DLCACHEFS, STALE_MOUNT, Mount, drop_page_cache

KIB = 1024
BUDGET = 1536 * KIB
N_FILES, FILE_SIZE = 40, 48 * KIB  # 1.9 MiB per dataset: each alone is over the budget


def _tree(root: Path, seed: int, n: int = N_FILES) -> dict[str, bytes]:
    rnd = random.Random(seed)
    files = {}
    for i in range(n):
        rel = f"c{i % 4}/f{i:03d}.bin"
        data = rnd.randbytes(FILE_SIZE - rnd.randrange(0, 4 * KIB))
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        files[rel] = data
    return files


def _shared_args(name: str, *extra: str) -> list[str]:
    return ["--shared-cache", "--dataset", name, "--cache-size", str(BUDGET),
            "--share-interval", "0.3", "--flush-interval", "0.2", "--scan-ahead", "0",
            *extra]


def _read_all(mnt: Path, files: dict[str, bytes], wrong: list[str]) -> None:
    for rel, data in files.items():
        got = (mnt / rel).read_bytes()
        if got != data:
            wrong.append(f"{mnt}/{rel}: {len(got)} bytes, not the source's {len(data)}")


@requires_fuse
def test_two_daemons_share_one_budget_and_the_slow_source_keeps_more(
        tmp_path, mount, daemon_oracle):
    from dlcachefs.testing.passthrough import passthrough_mount  # noqa: PLC0415 - FUSE

    fast_src, slow_real = tmp_path / "fast", tmp_path / "slow_real"
    fast_src.mkdir()
    slow_real.mkdir()
    fast_files, slow_files = _tree(fast_src, 1), _tree(slow_real, 2)
    root = tmp_path / "root"
    ledger = L.Ledger(str(root))
    for ds in ("fast", "slow"):
        daemon_oracle.watch(cache=root / "datasets" / ds)  # verify each dataset's cache
    with passthrough_mount(str(slow_real), str(tmp_path / "slow"), delay_ms=15):
        fast = mount(fast_src, *_shared_args("fast"), name="mfast", cache=root)
        slow = mount(tmp_path / "slow", *_shared_args("slow"), name="mslow", cache=root)
        assert (root / "datasets" / "fast" / "meta.lmdb").is_dir()
        assert (root / "datasets" / "slow" / "meta.lmdb").is_dir()

        # one daemon per dataset id: a second one on "slow" is refused, saying why
        again = Mount(tmp_path / "slow", tmp_path / "mslow2", root, *_shared_args("slow"))
        with pytest.raises(MountError, match=r"dataset slow of the shared cache .* is in "
                                             r"use by another dlcachefs daemon"):
            again.start()
        again.cleanup()

        samples, over, wrong = [], [], []
        stop = threading.Event()

        def sample() -> None:
            while not stop.is_set():
                with ledger.locked():  # no daemon can grow its limit meanwhile
                    doc = ledger.read()
                    a, b = fast.stats(), slow.stats()
                limits = sum(int(e["limit"]) for e in doc["datasets"].values())
                samples.append((a["chunk_bytes"], b["chunk_bytes"]))
                if a["chunk_bytes"] + b["chunk_bytes"] > BUDGET or limits > BUDGET:
                    over.append((a["chunk_bytes"], b["chunk_bytes"], limits))
                for st_ in (a, b):  # each daemon's own account, against its current share
                    if st_["cache_account_bytes"] > st_["cache_limit_bytes"]:
                        over.append(("account", st_["cache_account_bytes"],
                                     st_["cache_limit_bytes"]))
                stop.wait(0.05)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        try:
            # equal use: both trees read whole, alternately, round after round, until
            # the shares have settled (a bounded number of rounds, not a time)
            for rnd in range(12):
                drop_page_cache()  # every round's reads reach the daemons
                _read_all(tmp_path / "mfast", fast_files, wrong)
                _read_all(tmp_path / "mslow", slow_files, wrong)
                a, b = fast.stats(), slow.stats()
                if rnd >= 3 and b["chunk_bytes"] > 2 * a["chunk_bytes"] and \
                        a["shared"]["cost_s_per_mib"] and b["shared"]["cost_s_per_mib"]:
                    break
        finally:
            stop.set()
            sampler.join(30)
        assert not wrong, wrong[:5]
        assert len(samples) > 5 and not over, (over[:5], len(samples))
        a, b = fast.stats(), slow.stats()
        # both measured their sources: the slow one costs more per byte to fetch again
        assert b["shared"]["cost_s_per_mib"] > a["shared"]["cost_s_per_mib"], (a, b)
        # at equal use, the slow dataset holds the larger share, and the larger cache
        assert b["shared"]["limit_bytes"] > a["shared"]["limit_bytes"], (a["shared"],
                                                                       b["shared"])
        assert b["chunk_bytes"] > a["chunk_bytes"], (a["chunk_bytes"], b["chunk_bytes"])
        assert a["chunk_bytes"] + b["chunk_bytes"] <= BUDGET
        # a dataset never below its floor (10% of the budget by default)
        assert a["shared"]["limit_bytes"] >= BUDGET // 10
        assert a["chunks_evicted"] > 0 or b["chunks_evicted"] > 0  # the budget did bind
        assert a["invariant_violations"] == 0 and b["invariant_violations"] == 0
        # both see both datasets in the ledger
        assert set(b["shared"]["datasets"]) == {"fast", "slow"}
        fast.umount()
        slow.umount()
    doc = json.loads((root / "ledger.json").read_text())
    # stopped cleanly: each entry counts exactly the bytes its cache keeps
    for ds in ("fast", "slow"):
        e = doc["datasets"][ds]
        assert e["state"] == "stopped" and e["limit"] == e["used"], e
    assert sum(e["limit"] for e in doc["datasets"].values()) <= BUDGET


@requires_fuse
def test_live_daemons_take_back_a_stopped_datasets_room_and_it_refetches_only_that(
        tmp_path, mount, daemon_oracle):
    """c is read whole, then unmounted: its bytes stay counted. a and b, mounted after,
    each need more than the budget c leaves them: past the cooldown they take c's room
    back (c's oldest chunks evicted under c's lock, c's ledger limit lowered after), the
    sum of what the three may hold never past the budget. c mounted again (a and b gone)
    serves what it kept and reads from its source exactly the files it lost."""
    import shutil  # noqa: PLC0415

    srcs = {ds: tmp_path / f"src_{ds}" for ds in "abc"}
    files = {}
    for k, (ds, src) in enumerate(srcs.items()):
        src.mkdir()
        files[ds] = _tree(src, 20 + k, n=20 if ds == "c" else 12)  # c 0.9, a/b 0.55 MiB
    root = tmp_path / "root"
    led = L.Ledger(str(root))
    for ds in "abc":
        daemon_oracle.watch(cache=root / "datasets" / ds)  # verify each dataset's cache
    wrong: list[str] = []
    args = ("--share-cooldown", "1")
    c = mount(srcs["c"], *_shared_args("c", *args), name="mc", cache=root)
    _read_all(c.mnt, files["c"], wrong)
    c.wait_cached(len(files["c"]))  # all of c: it fits the budget alone
    c.umount()
    held = led.read()["datasets"]["c"]
    assert held["state"] == "stopped" and held["limit"] == held["used"] > 0, held
    # a and b: each would take its demand, but c's bytes leave them less than that
    a = mount(srcs["a"], *_shared_args("a", *args), name="ma", cache=root)
    b = mount(srcs["b"], *_shared_args("b", *args), name="mb", cache=root)
    over = []
    # polled with a deadline (the share rounds, the cooldown and the reclaim's child take
    # their time: 20 quick rounds were too few on a loaded machine)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        drop_page_cache()
        _read_all(a.mnt, files["a"], wrong)
        _read_all(b.mnt, files["b"], wrong)
        with led.locked():  # no limit can grow meanwhile: a sum at one instant
            doc = led.read()
            sa, sb = a.stats(), b.stats()
        if sa["chunk_bytes"] + sb["chunk_bytes"] + doc["datasets"]["c"]["limit"] > BUDGET \
                or L.counted(doc) > BUDGET:
            over.append((sa["chunk_bytes"], sb["chunk_bytes"], doc["datasets"]["c"]))
        if doc["datasets"]["c"].get("reclaimed_bytes") and \
                sa["cache_limit_bytes"] + sb["cache_limit_bytes"] > BUDGET - held["limit"]:
            break
        time.sleep(0.2)
    assert not wrong and not over, (wrong[:5], over[:5])
    # a and b grew into the room c gave back
    assert sa["cache_limit_bytes"] + sb["cache_limit_bytes"] > BUDGET - held["limit"]

    def took(_st: dict) -> bool:  # what a and b count they took is what c's entry gave
        return sum(m.stats()["shared"]["reclaimed_bytes"].get("c", 0) for m in (a, b)) \
            == led.read()["datasets"]["c"]["reclaimed_bytes"]

    a.wait_stats(took, "a's and b's counts agree with c's entry")
    a.umount()
    b.umount()
    e = led.read()["datasets"]["c"]
    assert e["state"] == "stopped" and e["reclaimed_bytes"] > 0 and e["limit"] == e["used"]
    assert e["limit"] < held["limit"], e  # c gave room back ...
    assert e["limit"] > 0, e  # ... what a and b needed, not all of it
    for ds in "ab":  # given up: c may take the whole budget again
        shutil.rmtree(root / "datasets" / ds)
    c = mount(srcs["c"], *_shared_args("c", *args), name="mc", cache=root)
    st0 = c.stats()
    assert st0["chunk_bytes"] == e["limit"]  # the ledger counted exactly what c holds
    kept = st0["cached_bytes"]
    assert 0 < st0["cached_files"] < len(files["c"]), st0
    drop_page_cache()
    _read_all(c.mnt, files["c"], wrong)
    st = c.stats()
    assert not wrong, wrong[:5]
    # what c kept is served; only what it lost is read from its source again
    assert st["bytes_from_source"] == sum(map(len, files["c"].values())) - kept, st
    c.umount()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*DLCACHEFS, *args], capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def test_a_root_and_a_single_cache_are_not_mixed_up(tmp_path):
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    root = tmp_path / "root"
    (root / "datasets" / "x").mkdir(parents=True)
    r = _cli("mount", str(src), str(mnt), "--cache-dir", str(root), "--foreground")
    assert r.returncode == 1 and "is a shared cache root" in r.stderr, r.stderr
    single = tmp_path / "single"
    (single / "meta.lmdb").mkdir(parents=True)
    r = _cli("mount", str(src), str(mnt), "--cache-dir", str(single), "--shared-cache",
             "--foreground")
    assert r.returncode == 1 and "is the cache of one dataset" in r.stderr, r.stderr
    assert not (single / "datasets").exists()  # refused before anything was created
    r = _cli("mount", str(src), str(mnt), "--dataset", "x", "--foreground")
    assert r.returncode != 0 and "--dataset needs --shared-cache" in r.stderr, r.stderr
    # a root's datasets/ directory, or a dataset's directory in it, as a plain cache: its
    # bytes would sit in the root uncounted by the root's budget
    (root / L.LEDGER).write_text("{}")
    for inside in (root / "datasets", root / "datasets" / "x"):
        r = _cli("mount", str(src), str(mnt), "--cache-dir", str(inside), "--foreground")
        assert r.returncode == 1 and "is inside the shared cache root" in r.stderr, r.stderr
        assert not (inside / "meta.lmdb").exists()


# ----- the ledger's rules, without daemons ---------------------------------------------------

def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_dead_daemons_keep_counting_until_their_dataset_is_removed(tmp_path):
    root = tmp_path / "root"
    for ds in ("a", "b"):
        (root / "datasets" / ds).mkdir(parents=True)
    led = L.Ledger(str(root))
    now = 1000.0

    def seed(doc):
        doc["budget"] = 100
        doc["datasets"]["a"] = {"pid": _dead_pid(), "host": os.uname().nodename,
                                "state": "live", "heartbeat": now, "limit": 60}
        doc["datasets"]["b"] = {"pid": os.getpid(), "host": os.uname().nodename,
                                "state": "live", "heartbeat": now, "limit": 40}

    led.update(seed)

    def look(doc):
        L.expire(doc, str(root), "datasets", now + 1, 1.0)
        return {k: (e["state"], e["limit"]) for k, e in doc["datasets"].items()}, \
            L.grant(doc, "b", 100)

    states, granted = led.update(look)
    # a's daemon is gone: dead, and its 60 bytes still count, so b cannot grow into them
    assert states == {"a": ("dead", 60), "b": ("live", 40)} and granted == 40
    assert allocate(led.read(), 0.1)["b"] == 40  # the live ones share what is left
    # b's heartbeat stops: dead too, although its pid lives (a hung daemon)
    _, states = led.update(lambda d: (L.expire(d, str(root), "datasets", now + 500, 1.0),
                                      {k: e["state"] for k, e in d["datasets"].items()}))
    assert states == {"a": "dead", "b": "dead"}
    # a's directory removed: its entry goes, and its bytes with it
    (root / "datasets" / "a").rmdir()
    _, states = led.update(lambda d: (L.expire(d, str(root), "datasets", now + 501, 1.0),
                                      sorted(d["datasets"])))
    assert states == ["b"]


entries = st.dictionaries(
    st.sampled_from("abcdef"),
    st.fixed_dictionaries({
        "state": st.sampled_from(["live", "live", "dead", "stopped"]),
        "limit": st.integers(0, 1 << 20), "demand": st.integers(0, 4 << 20),
        "cost": st.one_of(st.none(), st.floats(1e-4, 10.0)),
        "crf": st.floats(0.0, 50.0)}),
    max_size=6)


@settings(max_examples=300, deadline=None)
@given(ents=entries, budget=st.integers(0, 4 << 20), floor=st.floats(0.0, 0.5),
       policy=st.sampled_from(["cost", "equal"]))
def test_allocation_stays_within_the_budget_and_floors_hold(ents, budget, floor, policy):
    doc = {"version": 1, "budget": budget, "datasets": {k: dict(v) for k, v in ents.items()}}
    shares = allocate(doc, floor, policy)
    live = {k for k, e in ents.items() if e["state"] == "live"}
    assert set(shares) == live
    fixed = sum(e["limit"] for k, e in ents.items() if k not in live)
    avail = max(0, budget - fixed)
    assert sum(shares.values()) <= avail
    if live:
        each = min(int(budget * floor), avail // len(live))
        for k in live:
            demand = ents[k]["demand"] or budget
            assert min(each, demand) <= shares[k] <= max(demand, 0)
    assert allocate(doc, floor, policy) == shares  # every daemon computes the same
    # and grants never take the limits' sum past the budget
    if budget >= fixed + sum(ents[k]["limit"] for k in live):
        for k in sorted(live):
            L.grant(doc, k, shares[k])
        assert L.counted(doc) <= budget


def test_costlier_source_gets_more_at_equal_value_and_cooldown_holds_value():
    doc = {"version": 1, "budget": 1000, "datasets": {
        "slow": {"state": "live", "limit": 0, "demand": 2000, "cost": 1.0, "crf": 3.0},
        "fast": {"state": "live", "limit": 0, "demand": 2000, "cost": 0.01, "crf": 3.0}}}
    s = allocate(doc, 0.1)
    assert s["slow"] > s["fast"] >= 100 and s["slow"] + s["fast"] <= 1000
    e = allocate(doc, 0.1, "equal")
    assert e["slow"] == e["fast"] == 500
    # no decay within the cooldown after the last read, half per halflife past it
    assert decayed(4.0, 100.0, 100.0, 150.0, cooldown=60, halflife=10) == 4.0
    assert decayed(4.0, 100.0, 100.0, 170.0, cooldown=60, halflife=10) == 2.0


def test_stopped_datasets_give_room_lowest_crf_first_ties_by_cost_after_the_cooldown():
    now = 10_000.0
    live = {"state": "live", "limit": 100, "demand": 900, "cost": 1.0, "crf": 2.0,
            "heartbeat": now}

    def stopped(crf: float, cost: float | None, at: float = now - 100, limit: int = 300):
        return {"state": "stopped", "limit": limit, "demand": 900, "cost": cost, "crf": crf,
                "crf_t": at, "last_read": at, "heartbeat": at}

    doc = {"version": 1, "budget": 1000, "datasets": {
        "live": live,
        "used_much": stopped(5.0, 0.01),
        "cheap": stopped(1.0, 0.01),
        "dear": stopped(1.0, 1.0),
        "unmeasured": stopped(1.0, None),  # the median cost of the measured ones: 0.01
        "cooling": stopped(0.0, 0.01, at=now - 30),  # stopped 30 s ago: still cooling down
        "empty": stopped(0.0, 0.01, limit=0),
        "dead": {**stopped(0.0, 0.01), "state": "dead"}}}
    order = reclaim_order(doc, now, cooldown=60, halflife=600)
    # lowest CRF first; equal CRF: the cheapest to fetch again first (name after)
    assert order == ["cheap", "unmeasured", "dear", "used_much"]
    # long idle: a CRF once higher decays below the others' (LRFU's recency)
    doc["datasets"]["used_much"] = stopped(5.0, 0.01, at=now - 3000)
    assert reclaim_order(doc, now, 60, 600)[0] == "used_much"
    # the live dataset would get the budget less the ineligible ones' limits (cooling,
    # dead: 600), 400 of its demand of 900: what it lacks is taken in that order, no more
    plan = reclaim_plan(doc, "live", 0.1, "cost", 0, now, 60, 600)
    assert plan == [("used_much", 300), ("cheap", 100)]
    assert reclaim_plan(doc, "live", 0.1, "cost", 350, now, 60, 600) == [("used_much", 50)]
    assert reclaim_plan(doc, "live", 0.1, "cost", 10_000, now, 60, 600) == []


def test_a_malformed_ledger_is_an_error_that_says_what_to_do(tmp_path):
    led = L.Ledger(str(tmp_path))
    (tmp_path / "ledger.json").write_text('{"version": 1, "budget": 5, "datasets": '
                                          '{"a": {"limit": "many"}}}')
    with pytest.raises(L.DlcError, match="malformed entry"):
        led.update(lambda d: L.counted(d))
    (tmp_path / "ledger.json").write_text('{"version": 1, "datasets": {"a": 3}}')
    with pytest.raises(L.DlcError, match="not an object"):
        led.read()


# ----- a shrinking share, in the core (no kernel): the writer evicts before it holds -----

@settings(max_examples=8, deadline=None)
@given(cuts=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=4), seed=st.integers(0, 99))
def test_set_limit_evicts_before_the_account_is_held_to_the_smaller_limit(
        tmp_path_factory, cuts, seed):
    import trio  # noqa: PLC0415

    from dlcachefs.testing.fakes import make_config, read_all, run_engine, write_tree

    base = tmp_path_factory.mktemp("core")
    rnd = random.Random(seed)
    files = {f"d/f{i:02d}".encode(): rnd.randbytes(rnd.randrange(1000, 9000))
             for i in range(24)}
    write_tree(base / "src", files)
    cfg = make_config(base / "src", base / "cache", cache_size=200_000)

    async def body(eng):
        for rel, data in files.items():
            assert await read_all(eng, rel) == data
        await eng.flush()
        w = eng.writer
        for cut in cuts:
            got = w.set_limit(int(w.limit * cut))
            # rule A for the limit it has now, at once (victims doomed, not yet dropped)
            assert w.account() <= got == w.limit
            await w.drop_doomed()
            assert eng.index.counter(S.K_CHUNK_BYTES) <= w.limit or w.pins
            assert eng.check_invariants() == []
            for rel, data in list(files.items())[:6]:  # still served, byte for byte
                assert await read_all(eng, rel) == data
            await trio.sleep(0)
        w.set_limit(200_000)  # grows at once
        assert w.limit == 200_000

    run_engine(cfg, body)


def test_metrics_of_a_shared_root():
    from dlcachefs.admin.metrics import families  # noqa: PLC0415

    st = {"cache_limit_bytes": 100, "chunk_bytes": 50, "cache_account_bytes": 50,
          "shared": {"budget_bytes": 300, "limit_bytes": 100, "target_bytes": 120,
                     "cost_s_per_mib": None, "crf": 1.5,
                     "datasets": {"a": {"limit": 100, "used": 50, "target": 120},
                                  "b": {"limit": 200, "used": 10, "target": None}}}}
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for fam in families(st) for s in fam.samples}
    assert got[("dlcachefs_shared_budget_bytes", ())] == 300
    assert got[("dlcachefs_cache_account_bytes", ())] == 50
    assert ("dlcachefs_shared_cost_s_per_mib", ()) not in got  # not measured yet
    assert got[("dlcachefs_shared_dataset_limit_bytes", (("dataset", "b"),))] == 200
    assert ("dlcachefs_shared_dataset_target_bytes", (("dataset", "b"),)) not in got


@requires_fuse
@pytest.mark.daemon_log_allows(STALE_MOUNT)
def test_a_killed_daemons_bytes_count_until_remounted_or_removed(tmp_path, mount):
    """kill -9 one of two daemons: the other sees its entry dead, its limit still counted
    (it cannot grow into those bytes); the dataset mounted again takes its entry over
    with what its cache holds; unmounted and its directory removed, the space is free."""
    import shutil  # noqa: PLC0415

    srcs = {ds: tmp_path / f"src_{ds}" for ds in ("a", "b")}
    files = {}
    for k, (ds, src) in enumerate(srcs.items()):
        src.mkdir()
        files[ds] = _tree(src, 10 + k)
    root = tmp_path / "root"
    led = L.Ledger(str(root))
    a = mount(srcs["a"], *_shared_args("a"), name="ma", cache=root)
    wrong: list[str] = []
    _read_all(a.mnt, files["a"], wrong)
    a.wait_stats(lambda st: st["chunk_bytes"] > BUDGET // 2, "a fills its share")
    b = mount(srcs["b"], *_shared_args("b"), name="mb", cache=root)
    _read_all(b.mnt, files["b"], wrong)
    b.wait_stats(lambda st: st["shared"]["datasets"].get("a", {}).get("state") == "live")
    # one budget per root: a mount with another --cache-size is refused while these run
    other = Mount(srcs["b"], tmp_path / "mc", root,
                  *_shared_args("c"), "--cache-size", str(2 * BUDGET))
    with pytest.raises(MountError, match="give the same --cache-size"):
        other.start()
    other.cleanup()
    a.kill9()
    st = b.wait_stats(lambda st: st["shared"]["datasets"]["a"]["state"] == "dead",
                      "b sees a's daemon dead")
    dead_limit = st["shared"]["datasets"]["a"]["limit"]
    assert dead_limit > 0
    for _ in range(3):  # b keeps reading; it never grows into the dead dataset's bytes
        drop_page_cache()
        _read_all(b.mnt, files["b"], wrong)
        with led.locked():
            doc = led.read()
            sb = b.stats()
        assert doc["datasets"]["a"]["limit"] == dead_limit
        assert sb["cache_limit_bytes"] + dead_limit <= BUDGET
        assert L.counted(doc) <= BUDGET
    # mounted again: the entry is live again, counting what a's cache holds (<= its limit)
    a2 = mount(srcs["a"], *_shared_args("a"), name="ma", cache=root)
    # its stats carry the ledger as of its first share round (moments after the mount)
    st = a2.wait_stats(lambda st: "a" in st["shared"]["datasets"], "a2's first share round")
    assert st["shared"]["datasets"]["a"]["state"] == "live"
    assert st["chunk_bytes"] <= dead_limit
    drop_page_cache()
    _read_all(a2.mnt, files["a"], wrong)  # the cache a crash left serves exact bytes
    a2.umount()
    stopped = b.wait_stats(lambda st: st["shared"]["datasets"]["a"]["state"] == "stopped")
    e = stopped["shared"]["datasets"]["a"]
    assert e["limit"] == e["used"] > 0  # a clean stop counts exactly what it keeps
    before = stopped["cache_limit_bytes"]
    shutil.rmtree(root / "datasets" / "a")  # the dataset given up: its bytes are free
    st = b.wait_stats(lambda st: "a" not in st["shared"]["datasets"]
                      and st["cache_limit_bytes"] > before, "b grows into a's space")
    assert st["cache_limit_bytes"] <= BUDGET
    drop_page_cache()
    _read_all(b.mnt, files["b"], wrong)
    assert not wrong, wrong[:5]


def test_verify_points_at_a_roots_datasets(tmp_path):
    (tmp_path / "root" / "datasets" / "imagenet").mkdir(parents=True)
    r = _cli("verify", "--cache-dir", str(tmp_path / "root"))
    assert r.returncode == 2 and "is a shared cache root" in r.stderr, r.stderr
    assert str(tmp_path / "root" / "datasets" / "imagenet") in r.stderr


def test_a_dataset_name_given_again_for_another_source_is_refused(tmp_path, mount):
    """The same --dataset on one root (or the same --cache-dir) for a second source: the
    cache holds the first source's tree and bytes, so the mount is refused with the reason
    (it served the first source's bytes as the second's); the first source mounts again."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d, fill in ((a, b"A"), (b, b"B")):
        d.mkdir()
        (d / "f.bin").write_bytes(fill * 4096)
    root = tmp_path / "root"
    args = ("--shared-cache", "--dataset", "train", "--cache-size", "8M")
    m = mount(a, *args, cache=root, name="m1")
    assert (m.mnt / "f.bin").read_bytes() == b"A" * 4096
    m.umount()
    refused = Mount(b, tmp_path / "m2", root, *args)  # not watched: it must fail
    with pytest.raises(MountError, match="holds the cache of .*/a, not of .*/b"):
        refused.start()
    refused.cleanup()
    m = mount(a, *args, cache=root, name="m3")  # its own source: still its cache
    assert (m.mnt / "f.bin").read_bytes() == b"A" * 4096
    m.umount()
    single = tmp_path / "single"
    mount(a, cache=single, name="m4").umount()
    refused = Mount(b, tmp_path / "m5", single)
    # the way out it names works without --shared-cache (--dataset alone is refused)
    with pytest.raises(MountError, match="holds the cache of.*another --cache-dir for this "
                                          "source \\(or, with --shared-cache, another "
                                          "--dataset\\)"):
        refused.start()
    refused.cleanup()


def test_verify_creates_nothing_where_there_is_no_cache(tmp_path):
    """A mistyped --cache-dir, or the dataset itself, is refused (exit 2) and left as it
    was: an fsck that made a lock and an index there reported a clean, empty cache."""
    missing = tmp_path / "typo"
    r = _cli("verify", "--cache-dir", str(missing))
    assert r.returncode == 2 and "no such directory" in r.stderr, r.stderr
    assert not missing.exists()
    data = tmp_path / "dataset"
    (data / "class0").mkdir(parents=True)
    (data / "class0" / "a.jpg").write_bytes(b"x")
    r = _cli("verify", "--cache-dir", str(data))
    assert r.returncode == 2 and "not a dlcachefs cache directory" in r.stderr, r.stderr
    assert sorted(p.name for p in data.iterdir()) == ["class0"]


@pytest.mark.parametrize("manifest", ["/dev/zero", "dir"])
def test_a_manifest_that_is_not_a_regular_file_is_refused(tmp_path, manifest):
    """``--content-manifest /dev/zero`` read until the machine ran out of memory (the
    daemon was OOM-killed, its log saying nothing); now refused, with the reason."""
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    (src / "f").write_bytes(b"x")
    path = str(tmp_path) if manifest == "dir" else manifest
    r = _cli("mount", str(src), str(mnt), "--cache-dir", str(tmp_path / "root"),
             "--shared-cache", "--content-manifest", path, "--foreground")
    assert r.returncode == 1, r.stderr
    assert "--content-manifest" in r.stderr and ("not a regular file" in r.stderr
                                                 or "Is a directory" in r.stderr), r.stderr
