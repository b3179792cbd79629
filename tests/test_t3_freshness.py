"""Tier 3: an open checks its directory's freshness from memory, and the ``--revalidate``
rule still holds exactly (the namespace's directory cache, dlcachefs.cache.namespace).

A fake wall clock (the namespace's ``time``) moves past the window instead of sleeping."""

from __future__ import annotations

import os
import time

import pytest
import trio

from dlcachefs.cache import namespace as ns_mod
from dlcachefs.testing.fakes import (
    Clock,
    CountingSource,
    make_config,
    read_all,
    run_engine,
    run_session,
    write_tree,
)


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(ns_mod, "time", c)
    return c


def test_open_reads_the_directory_freshness_from_memory_and_revalidates_on_time(
        tmp_path, clock):
    src, cache = tmp_path / "src", tmp_path / "cache"
    write_tree(src, {b"d/x.bin": b"a" * 3000, b"d/y.bin": b"b" * 5000, b"e/z.bin": b"z"})
    source = CountingSource(str(src))

    async def body(eng):
        # the mount's scan left every directory unchecked: the first open lists d
        assert await read_all(eng, b"d/x.bin") == b"a" * 3000
        lists = source.calls["list_dir"]
        gets = 0
        real_get = eng.index.get_entry

        def counting_get(ino):
            nonlocal gets
            gets += 1
            return real_get(ino)

        d = eng.ns.resolve(b"d")
        y = eng.ns.resolve(b"d/y.bin")
        eng.index.get_entry = counting_get
        for _ in range(5):  # fresh: no listing, and the parent's entry is not read
            r = await eng.open(y.ino)
            assert bytes(await eng.read(r.fh, 0, 1 << 20)) == b"b" * 5000
            eng.release(r.fh)
        assert source.calls["list_dir"] == lists
        assert gets == 5  # the file's own entry, once per open; never the directory's
        eng.index.get_entry = real_get
        # the source changes; within the window the snapshot is trusted
        (src / "d" / "y.bin").write_bytes(b"c" * 7000)
        os.utime(src / "d" / "y.bin", ns=(1, 2_000_000_000_000_000_000))
        (src / "d" / "new.bin").write_bytes(b"n")
        clock.now += 50
        assert await read_all(eng, b"d/y.bin") == b"b" * 5000
        assert source.calls["list_dir"] == lists
        # past the window: listed again at the next open, and the new version served
        clock.now += 60
        assert await read_all(eng, b"d/y.bin") == b"c" * 7000
        assert source.calls["list_dir"] == lists + 1
        assert eng.ns.lookup(d.ino, b"new.bin").size == 1
        # the listing's own time is what the next opens see: no second listing
        for _ in range(3):
            assert await read_all(eng, b"d/x.bin") == b"a" * 3000
        assert source.calls["list_dir"] == lists + 1
        # another directory keeps its own time
        clock.now += 101
        assert await read_all(eng, b"e/z.bin") == b"z"
        assert await read_all(eng, b"d/x.bin") == b"a" * 3000
        assert source.calls["list_dir"] == lists + 3

    run_engine(make_config(src, cache, revalidate=100), body, source)


def test_a_vanished_directory_is_not_found_after_revalidation(tmp_path, clock):
    src, cache = tmp_path / "src", tmp_path / "cache"
    write_tree(src, {b"top/d/x.bin": b"a" * 300, b"top/keep.bin": b"k"})
    source = CountingSource(str(src))

    async def body(eng):
        assert await read_all(eng, b"top/d/x.bin") == b"a" * 300
        x = eng.ns.resolve(b"top/d/x.bin")
        os.remove(src / "top" / "d" / "x.bin")
        os.rmdir(src / "top" / "d")
        clock.now += 1000
        assert await read_all(eng, b"top/keep.bin") == b"k"  # lists top: d is gone
        from dlcachefs.errors import NotFound  # noqa: PLC0415

        with pytest.raises(NotFound):
            await eng.open(x.ino)
        await trio.sleep(0)

    run_engine(make_config(src, cache, revalidate=100), body, source)


def test_a_name_added_on_the_source_is_found_by_its_path_after_the_window(tmp_path, clock):
    """A file or directory added on the source is found by a lookup of its path once the
    parent's listing is older than --revalidate (no ls of the directory needed), and not
    before: inside the window, a lookup of an unknown name lists nothing."""
    from dlcachefs.errors import NotFound  # noqa: PLC0415

    src, cache = tmp_path / "src", tmp_path / "cache"
    write_tree(src, {b"train/a/x.bin": b"x" * 100})
    source = CountingSource(str(src))

    async def body(eng):
        ns = eng.ns
        train = ns.resolve(b"train")
        await ns.fresh_dir(train.ino)
        a = ns.resolve(b"train/a")
        await ns.fresh_dir(a.ino)
        write_tree(src, {b"train/a/new.bin": b"n" * 7, b"train/b/y.bin": b"y" * 9})
        lists = source.calls["list_dir"]
        with pytest.raises(NotFound):  # inside the window: the snapshot answers
            await ns.fresh_lookup(a.ino, b"new.bin")
        assert source.calls["list_dir"] == lists
        clock.now += 101
        e = await ns.fresh_lookup(a.ino, b"new.bin")
        assert e.size == 7 and source.calls["list_dir"] == lists + 1
        b = await ns.fresh_lookup(train.ino, b"b")  # a new directory, then its file
        y = await ns.fresh_lookup(b.ino, b"y.bin")
        assert await read_all(eng, b"train/b/y.bin") == b"y" * 9 and y.size == 9
        with pytest.raises(NotFound):  # still missing after the fresh listing
            await ns.fresh_lookup(a.ino, b"nothing.bin")

    run_engine(make_config(src, cache, revalidate=100), body, source)


def test_lookups_of_missing_names_list_a_directory_at_most_once_a_second(tmp_path, clock):
    """With --revalidate 0 a missing name re-lists its directory, but a loop probing for
    absent side files lists it once per MISSING_RELIST_S, not once per probe; and a
    listing that fails answers "not found" (the snapshot's answer), not EIO."""
    from dlcachefs.errors import NotFound, SourceError  # noqa: PLC0415

    src, cache = tmp_path / "src", tmp_path / "cache"
    write_tree(src, {b"d/x.bin": b"x"})
    source = CountingSource(str(src))
    now = [1000.0]
    clock.monotonic = lambda: now[0]  # the namespace's clock only

    async def body(eng):
        d = eng.ns.resolve(b"d")
        lists = source.calls["list_dir"]
        for _ in range(50):
            with pytest.raises(NotFound):
                await eng.ns.fresh_lookup(d.ino, b"x.json")
        assert source.calls["list_dir"] == lists + 1
        now[0] += ns_mod.MISSING_RELIST_S
        write_tree(src, {b"d/x.json": b"{}"})
        assert (await eng.ns.fresh_lookup(d.ino, b"x.json")).size == 2
        assert source.calls["list_dir"] == lists + 2
        now[0] += ns_mod.MISSING_RELIST_S

        def failing(rel):
            raise SourceError("list: injected", 5)

        source.list_dir = failing
        with pytest.raises(NotFound):
            await eng.ns.fresh_lookup(d.ino, b"other")

    run_engine(make_config(src, cache, revalidate=0), body, source)


class SlowListSource(CountingSource):
    def list_dir(self, rel: bytes):
        time.sleep(0.3)  # part of the scenario: a listing is under way meanwhile
        return super().list_dir(rel)


def test_a_lookup_joins_the_listing_under_way(tmp_path):
    """Two new files looked up 50 ms apart while the first lookup's listing is under way:
    the second joins it (the once-a-second bound must not answer ENOENT for a name the
    listing in flight holds)."""
    src, cache = tmp_path / "src", tmp_path / "cache"
    write_tree(src, {b"d/x.bin": b"x"})
    source = SlowListSource(str(src))

    async def body(eng):
        d = eng.ns.resolve(b"d")
        await eng.ns.fresh_dir(d.ino)
        write_tree(src, {b"d/s1.bin": b"1", b"d/s2.bin": b"22"})
        found = {}

        async def look(name, delay):
            await trio.sleep(delay)
            found[name] = (await eng.ns.fresh_lookup(d.ino, name)).size

        async with trio.open_nursery() as n:
            n.start_soon(look, b"s1.bin", 0)
            n.start_soon(look, b"s2.bin", 0.05)
        assert found == {b"s1.bin": 1, b"s2.bin": 2}

    run_engine(make_config(src, cache, revalidate=0), body, source)


class BlockingListSource(CountingSource):
    """list_dir of ``d`` waits until released, then fails (EIO) or succeeds."""

    def __init__(self, root, fail: bool) -> None:
        super().__init__(root)
        import threading

        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail = fail
        self.block = False

    def list_dir(self, rel: bytes):
        if self.block and rel == b"d":
            self.entered.set()
            self.gate.wait(30)
            if self.fail:
                import errno

                from dlcachefs.errors import SourceError  # noqa: PLC0415

                raise SourceError("list d: injected", errno.EIO)
        return super().list_dir(rel)


@pytest.mark.parametrize("fail", [True, False])
def test_opens_waiting_for_a_relisting_fail_as_it_fails(tmp_path, clock, fail):
    """Opens that wait for a directory's re-listing already under way share its outcome:
    when it fails they fail too (never served from the listing that was due for
    revalidation, past --revalidate), when it succeeds they see its result."""
    from dlcachefs.errors import SourceError  # noqa: PLC0415

    src, cache = tmp_path / "src", tmp_path / "cache"
    write_tree(src, {b"d/x.bin": b"a" * 300, b"d/y.bin": b"b" * 400})
    source = BlockingListSource(str(src), fail)

    async def body(eng):
        assert await read_all(eng, b"d/x.bin") == b"a" * 300
        y, d = eng.ns.resolve(b"d/y.bin"), eng.ns.resolve(b"d")
        (src / "d" / "y.bin").write_bytes(b"c" * 500)
        clock.now += 1000  # past the window: the next opens re-list d
        source.block = True
        outcomes = []

        async def opener():
            try:
                r = await eng.open(y.ino)
            except SourceError as e:
                outcomes.append(("error", e.errno))
                return
            outcomes.append(("data", bytes(await eng.read(r.fh, 0, 1 << 20))))
            eng.release(r.fh)

        async with trio.open_nursery() as n:
            for _ in range(4):
                n.start_soon(opener)
            with trio.fail_after(30):  # the leader is listing, the three others wait for it
                while not (source.entered.is_set() and d.ino in eng.ns._refreshing
                           and eng.ns._refreshing[d.ino][0].statistics().tasks_waiting == 3):
                    await trio.sleep(0.01)
            source.gate.set()
        if fail:
            import errno

            assert outcomes == [("error", errno.EIO)] * 4
        else:
            assert outcomes == [("data", b"c" * 500)] * 4

    run_engine(make_config(src, cache, revalidate=100), body, source)


def test_files_gone_from_the_source_are_passed_by_a_streams_position(tmp_path):
    """Sweep F1: a file deleted from the source never opens again (its LOOKUP fails), so
    a stream whose order holds it stopped there for the rest of the epoch, and its
    prefetch with it. Once the namespace finds it gone (a re-listing), every stream's
    position passes it; a class directory deleted whole passes all its files."""
    import shutil

    from test_t3_limits import Driver, dataset

    files = dataset(5)
    src, cache = tmp_path / "src", tmp_path / "cache"
    write_tree(src, files)

    async def body(sess):
        eng = sess.engine
        d = Driver(sess, files, 1, False)
        await d.announce(0)
        s = sess.streams.streams[("j", 0)]
        order = [s.samples.inos[i] for i in s.order]
        parent_of = {i: eng.ns.get(i).parent for i in order}
        path_of = {i: eng.ns.path_of(eng.ns.get(i)) for i in order}
        first = order[0]
        assert s.position == 0
        os.unlink(src / os.fsdecode(path_of[first]))
        await eng.ns.refresh_dir(parent_of[first])
        assert first in eng.ns.gone
        assert s.position == 1  # passed without an open
        # a whole class directory: its files are gone too (a subtree's inodes)
        cls = parent_of[order[1]]
        top = eng.ns.get(cls).parent  # (train/)
        shutil.rmtree(src / os.fsdecode(eng.ns.path_of(eng.ns.get(cls))))
        await eng.ns.refresh_dir(top)
        members = [i for i in order if parent_of[i] == cls]
        assert members and all(i in eng.ns.gone for i in members)
        k = 0  # the gone files at the head of the order: the position is past them all
        while k < len(order) and order[k] in eng.ns.gone:
            k += 1
        assert s.position == k >= 2

    run_session(make_config(src, cache, policy="lru", revalidate=0), body)
