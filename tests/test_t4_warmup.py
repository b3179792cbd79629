"""``dlcachefs warmup`` over real mounts: what it fetches, what it skips, what fits."""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import pytest
from conftest import requires_fuse
from hypothesis import given
from hypothesis import strategies as st

from dlcachefs.admin.warmup import Item, cost, make_plan, read_order
from dlcachefs.store.chunkfmt import CHUNK_HEADER_SIZE, RECORD_HEADER_SIZE
from dlcachefs.testing.mounting import DLCACHEFS


def make_src(root: Path, n: int = 40, size: int = 20_000, seed: int = 3) -> dict[str, bytes]:
    rnd = random.Random(seed)
    files = {}
    for i in range(n):
        d = root / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        data = rnd.randbytes(size + i)
        (d / f"s{i:03d}.bin").write_bytes(data)
        files[f"c{i % 3}/s{i:03d}.bin"] = data
    return files


def warmup(mnt: Path, *args: str) -> dict:
    r = subprocess.run([*DLCACHEFS, "warmup", str(mnt), *args, "--json"], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "src"
    files = make_src(root)
    return root, files


@requires_fuse
def test_warmup_fetches_everything_then_skips_it(src, mount):
    root, files = src
    m = mount(root)
    first = warmup(m.mnt)
    assert first["plan"]["files"]["files"] == len(files)
    assert first["plan"]["to_fetch"]["files"] == len(files)
    assert first["result"]["fetched"] == len(files)
    assert first["result"]["errors"] == []
    assert first["result"]["cached_after"] == len(files)  # sealed and indexed
    st = m.stats()
    assert st["cached_files"] == len(files)
    assert st["bytes_from_source"] == sum(len(b) for b in files.values())
    # resumable: a second run fetches nothing and opens nothing
    misses, hits = st["misses"], st["hits"]
    second = warmup(m.mnt)
    assert second["plan"]["cached"]["files"] == len(files)
    assert second["result"]["fetched"] == 0
    st2 = m.stats()
    assert (st2["misses"], st2["hits"]) == (misses, hits)
    assert st2["bytes_from_source"] == st["bytes_from_source"]
    # what the training reads afterwards: every byte as the source, all hits
    for rel, data in files.items():
        assert (m.mnt / rel).read_bytes() == data
    assert m.stats()["misses"] == misses


@requires_fuse
def test_warmup_counts_what_it_cached_under_a_short_revalidate(src, mount):
    """The count at the end is of the files the index holds, not of those whose listing
    is still within --revalidate (0 here: none is): it said "cached now: 0"."""
    root, files = src
    m = mount(root, "--revalidate", "0")
    res = warmup(m.mnt)
    assert res["result"]["fetched"] == len(files)
    assert res["result"]["cached_after"] == len(files) == m.stats()["cached_files"]


@requires_fuse
def test_warmup_of_paths_and_resume_after_a_partial_run(src, mount):
    root, files = src
    m = mount(root)
    part = warmup(m.mnt, "c1", str(m.mnt / "c2" / "s002.bin"))
    want = {r for r in files if r.startswith("c1/")} | {"c2/s002.bin"}
    assert part["result"]["fetched"] == len(want)
    assert m.stats()["cached_files"] == len(want)
    rest = warmup(m.mnt)
    assert rest["plan"]["cached"]["files"] == len(want)
    assert rest["result"]["fetched"] == len(files) - len(want)
    assert m.stats()["bytes_from_source"] == sum(len(b) for b in files.values())


@requires_fuse
def test_dry_run_reads_nothing_and_the_budget_keeps_the_order(tmp_path, mount):
    root = tmp_path / "src"
    files = make_src(root, n=30, size=100_000)
    # a cache of 1M holds 10 of the 30 files of ~100 KB
    m = mount(root, "--cache-size", "1M", "--chunk-size", "256K")
    order = sorted(files, reverse=True)
    (tmp_path / "order.txt").write_text("# newest first\n" + "\n".join(order) + "\n\n")
    plan = warmup(m.mnt, "--order", str(tmp_path / "order.txt"), "--dry-run")["plan"]
    total, n_fit, used = 0, 0, 0
    for r in order:  # each file takes its bytes, its record's header and path, a chunk header
        c = len(files[r]) + RECORD_HEADER_SIZE + len(r) + CHUNK_HEADER_SIZE
        if used + c > (1 << 20):
            break
        used += c
        total += len(files[r])
        n_fit += 1
    assert plan["to_fetch"] == {"files": n_fit, "bytes": total}
    assert plan["left_out"]["files"] == len(files) - n_fit
    assert plan["last_fitting"] == order[n_fit - 1]
    st = m.stats()
    assert st["misses"] == st["hits"] == st["bytes_from_source"] == 0  # read nothing
    res = warmup(m.mnt, "--order", str(tmp_path / "order.txt"))
    assert res["result"]["fetched"] == n_fit
    assert res["result"]["cached_after"] == n_fit
    # exactly the first files of the order were fetched
    assert m.stats()["bytes_from_source"] == total
    for r in order[:n_fit]:
        assert (m.mnt / r).read_bytes() == files[r]
    assert m.stats()["bytes_from_source"] == total


@requires_fuse
def test_text_output_and_errors(src, mount, tmp_path):
    root, files = src
    m = mount(root)
    r = subprocess.run([*DLCACHEFS, "warmup", str(m.mnt), "--dry-run"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "everything fits" in r.stdout and f"{len(files):,} files" in r.stdout
    r = subprocess.run([*DLCACHEFS, "warmup", str(m.mnt), "nope"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "nope" in r.stderr
    r = subprocess.run([*DLCACHEFS, "warmup", str(m.mnt), "/etc"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "not inside the mount" in r.stderr
    r = subprocess.run([*DLCACHEFS, "warmup", str(tmp_path)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "not a dlcachefs mount" in r.stderr
    # a file removed from the source after the listing: the open fails, the rest is warmed
    os.unlink(root / "c0" / "s000.bin")
    r = subprocess.run([*DLCACHEFS, "warmup", str(m.mnt), "c0"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 1
    assert "c0/s000.bin" in r.stderr
    assert "fetched 13 files" in r.stdout and "1 errors" in r.stdout


@requires_fuse
def test_warmup_follows_links_only_within_the_mount(src, mount):
    """Links given by name: one to a file of the mount is warmed as that file (counted
    once with it), one leading outside the mount and the mount's own ``.dlcache`` are
    refused (exit 2, nothing opened); before, they were "fetched" and counted."""
    root, files = src
    os.symlink("/etc/hostname", root / "outside")
    os.symlink("c0/s000.bin", root / "inside")
    m = mount(root)
    got = warmup(m.mnt, "c0", "inside")
    assert got["plan"]["files"]["files"] == sum(1 for r in files if r.startswith("c0/"))
    for bad, why in (("outside", "leads outside the mount"),
                     (".dlcache", "the mount's own control directory")):
        r = subprocess.run([*DLCACHEFS, "warmup", str(m.mnt), bad], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 2 and why in r.stderr, (bad, r.returncode, r.stderr)
    assert m.stats()["bytes_from_source"] == sum(len(b) for r, b in files.items()
                                                 if r.startswith("c0/"))


def test_plan_units():
    items = [Item(f"f{i}", s) for i, s in enumerate([10, 20, 500, 30, 5])]
    st = {"cache_limit_bytes": 65, "max_cached_file": 100}
    p = make_plan(items, st, lambda rel: rel == "f1", cost=lambda it: it.size)
    assert [i.rel for i in p.too_large] == ["f2"]
    assert [i.rel for i in p.cached] == ["f1"]
    assert [i.rel for i in p.to_fetch] == ["f0", "f3", "f4"]  # 10+20+30+5 = 65 fits exactly
    p = make_plan(items, {"cache_limit_bytes": 59}, lambda rel: False, cost=lambda it: it.size)
    # no max_cached_file known: f2 (500) is past the budget, and so is all after it
    assert [i.rel for i in p.to_fetch] == ["f0", "f1"]
    assert [i.rel for i in p.left_out] == ["f2", "f3", "f4"]


def test_read_order(tmp_path):
    f = tmp_path / "o"
    f.write_text("a/b\n# c\n\n  \nd e\n")
    assert read_order(str(f)) == ["a/b", "d e"]


def test_progress_lines_off_a_terminal(capsys):
    from dlcachefs.admin.warmup import _Progress

    p = _Progress(4, 4000, enabled=True, every=0.0)
    for _ in range(2):
        p.advance(1000)
    p.close()
    err = capsys.readouterr().err.splitlines()
    assert err[-1].startswith("warmup: 2/4 files, 2.0K/3.9K, ")
    assert "/s, ETA " in err[-1]


@given(sizes=st.lists(st.integers(0, 1000), max_size=40), budget=st.integers(0, 5000),
       max_file=st.one_of(st.none(), st.integers(0, 1000)), seed=st.integers(0, 1 << 16))
def test_plan_is_the_longest_prefix_within_the_budget(sizes, budget, max_file, seed):
    rnd = random.Random(seed)
    items = [Item(f"f{i}", s) for i, s in enumerate(sizes)]
    cached = {it.rel for it in items if rnd.random() < 0.3}
    st_ = {"cache_limit_bytes": budget, "max_cached_file": max_file}
    p = make_plan(items, st_, lambda rel: rel in cached, cost=lambda it: it.size)
    eligible = [it for it in items if max_file is None or it.size <= max_file]
    taken = [it for it in eligible if it in p.to_fetch or it in p.cached]
    assert taken == eligible[:len(taken)]  # a prefix, in order
    assert sum(it.size for it in taken) <= budget
    if len(taken) < len(eligible):  # the next one would not fit
        assert sum(it.size for it in taken) + eligible[len(taken)].size > budget
    assert p.left_out == eligible[len(taken):]
    assert {it.rel for it in p.cached} == {it.rel for it in taken} & cached
    assert len(p.to_fetch) + len(p.cached) + len(p.left_out) + len(p.too_large) == len(items)


def test_plan_counts_the_record_and_chunk_overhead_and_other_cached_files():
    # "ab" of 100 bytes takes 100 + 56 (record header) + 2 (its path) + 48 (a chunk header)
    it = Item("ab", 100)
    assert cost(it) == 100 + RECORD_HEADER_SIZE + 2 + CHUNK_HEADER_SIZE == 206
    items = [Item("ab", 100), Item("cd", 100)]
    p = make_plan(items, {"cache_limit_bytes": 411}, lambda rel: False)
    assert [i.rel for i in p.to_fetch] == ["ab"]  # 200 bytes of files, but 412 in the cache
    p = make_plan(items, {"cache_limit_bytes": 412}, lambda rel: False)
    assert [i.rel for i in p.to_fetch] == ["ab", "cd"]
    # cached files outside the list are counted (and not taken off the budget)
    st_ = {"cache_limit_bytes": 206, "cached_files": 5, "cached_bytes": 1000}
    p = make_plan(items, st_, lambda rel: True)
    assert [i.rel for i in p.cached] == ["ab"] and [i.rel for i in p.left_out] == ["cd"]
    assert p.other_cached == (3, 800)  # "cd" is cached too, past the budget
    assert p.as_dict()["other_cached"] == {"files": 3, "bytes": 800}
    assert make_plan(items, st_, lambda rel: False, cached_known=False).other_cached is None


@requires_fuse
def test_the_budget_leaves_room_for_the_records(tmp_path, mount):
    # 8 files of 128 KiB are exactly the 1 MiB budget in bytes, but not in the cache's
    # chunks (record and chunk headers, paths): warming 8 would evict the first
    root = tmp_path / "src"
    files = {}
    for i in range(8):
        data = random.Random(i).randbytes(128 << 10)
        (root / "d").mkdir(parents=True, exist_ok=True)
        (root / "d" / f"f{i}").write_bytes(data)
        files[f"d/f{i}"] = data
    m = mount(root, "--cache-size", "1M", "--chunk-size", "128K")
    res = warmup(m.mnt, "d")
    assert res["plan"]["to_fetch"]["files"] == 7 and res["plan"]["left_out"]["files"] == 1
    assert res["plan"]["cost_bytes"] <= 1 << 20
    assert res["result"]["fetched"] == 7
    assert res["result"]["cached_after"] == 7  # everything warmed stayed
    for rel, data in files.items():
        assert (m.mnt / rel).read_bytes() == data


@requires_fuse
def test_order_paths_missing_on_the_mount_are_skipped(src, mount, tmp_path):
    root, files = src
    m = mount(root)
    order = ["c0/s000.bin", "gone/x.bin", "c1", "/etc/passwd", "c2/s002.bin"] + \
        [f"gone/{i}" for i in range(6)]
    (tmp_path / "order.txt").write_text("\n".join(order) + "\n")
    r = subprocess.run([*DLCACHEFS, "warmup", str(m.mnt), "--order", str(tmp_path / "order.txt"),
                        "--json"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr  # something could not be warmed: said at the end
    out = json.loads(r.stdout)
    want = {"c0/s000.bin", "c2/s002.bin"} | {x for x in files if x.startswith("c1/")}
    assert out["result"]["fetched"] == len(want) and out["result"]["errors"] == []
    assert [s["path"] for s in out["plan"]["skipped"]] == \
        ["gone/x.bin", "/etc/passwd"] + [f"gone/{i}" for i in range(6)]
    assert m.stats()["cached_files"] == len(want)
    # the text output: how many, the first few
    r = subprocess.run([*DLCACHEFS, "warmup", str(m.mnt), "--order", str(tmp_path / "order.txt")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    assert "8 paths of" in r.stderr and "gone/x.bin" in r.stderr and "and 3 more" in r.stderr
    assert "8 --order paths skipped" in r.stdout
    for rel in want:
        assert (m.mnt / rel).read_bytes() == files[rel]
