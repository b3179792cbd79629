"""The lock pyfuse3's session loop gets from :mod:`dlcachefs.mount.fuseloop`: mutual
exclusion, FIFO hand-over, cancelled waiters leave the queue (the daemon's shutdown cancels
every loop task parked on it). Mounted use is covered by every mounted test (the daemon
installs it); the concurrent-reader ones (test_t4_requests, bench) put many tasks on it."""

from __future__ import annotations

import os

import pyfuse3
import pytest
import trio
from dlcachefs.mount import fuseloop
from dlcachefs.mount.fuseloop import FifoLock, wait_readable
from hypothesis import given, settings
from hypothesis import strategies as st


@pytest.fixture(autouse=True)
def fresh_poll_state(monkeypatch):
    """Each test starts with the shortcut armed: wait_readable's back-off counter and its
    poll objects are module state, and a test that left ``_skip`` set would make the next
    one take trio's path and never the shortcut it means to test."""
    monkeypatch.setattr(fuseloop, "_skip", 0)
    monkeypatch.setattr(fuseloop, "_polls", {})


def test_install_gives_pyfuse3_the_lock_and_keeps_the_rest_of_trio():
    saved = pyfuse3.trio
    try:
        assert fuseloop.install() is True
        shim = pyfuse3.trio
        assert shim.Lock is FifoLock
        assert shim.lowlevel.wait_readable is fuseloop.wait_readable
        # everything else pyfuse3's loop uses is trio's own
        for name in ("current_task", "current_trio_token", "notify_closing", "checkpoint"):
            assert getattr(shim.lowlevel, name) is getattr(trio.lowlevel, name)
        assert trio.lowlevel.wait_readable is not fuseloop.wait_readable  # trio untouched
        assert shim.open_nursery is trio.open_nursery
        assert shim.ClosedResourceError is trio.ClosedResourceError
        assert fuseloop.install() is False  # a second call leaves it (no shim of a shim)
    finally:
        pyfuse3.trio = saved


@settings(max_examples=30, deadline=None)
@given(tasks=st.integers(1, 8), yields=st.lists(st.integers(0, 3), min_size=1, max_size=8))
def test_mutual_exclusion_and_fifo(tasks, yields):
    async def main():
        lock = FifoLock()
        inside = 0
        order: list[int] = []
        arrived: list[int] = []

        async def worker(i: int) -> None:
            nonlocal inside
            for k in range(3):
                arrived.append(i)
                async with lock:
                    order.append(i)
                    inside += 1
                    assert inside == 1
                    for _ in range(yields[(i + k) % len(yields)]):
                        await trio.sleep(0)
                    inside -= 1
                await trio.sleep(0)

        async with trio.open_nursery() as n:
            for i in range(tasks):
                n.start_soon(worker, i)
        assert sorted(order) == sorted(arrived)
        assert not lock.locked()

    trio.run(main)


def test_waiters_get_the_lock_in_arrival_order():
    async def main():
        lock = FifoLock()
        got: list[int] = []

        async def waiter(i: int) -> None:
            async with lock:
                got.append(i)

        async with trio.open_nursery() as n:
            await lock.__aenter__()
            for i in range(5):  # one at a time: trio starts a batch of tasks in any order
                n.start_soon(waiter, i)
                await trio.testing.wait_all_tasks_blocked()
            await lock.__aexit__(None, None, None)
        assert got == [0, 1, 2, 3, 4]

    import trio.testing  # noqa: F401, PLC0415
    trio.run(main)


def test_a_cancelled_waiter_leaves_the_queue():
    async def main():
        lock = FifoLock()
        got: list[str] = []

        async def waiter(name: str, scope_box: list) -> None:
            with trio.CancelScope() as scope:
                scope_box.append(scope)
                async with lock:
                    got.append(name)

        import trio.testing  # noqa: PLC0415
        async with trio.open_nursery() as n:
            await lock.__aenter__()
            a, b = [], []
            n.start_soon(waiter, "a", a)
            n.start_soon(waiter, "b", b)
            await trio.testing.wait_all_tasks_blocked()
            a[0].cancel()  # "a" gives up waiting
            await trio.testing.wait_all_tasks_blocked()
            await lock.__aexit__(None, None, None)
        assert got == ["b"]
        assert not lock.locked()

    trio.run(main)


def test_an_exception_inside_releases_to_the_next():
    async def main():
        lock = FifoLock()
        got: list[int] = []

        async def failing() -> None:
            with pytest.raises(trio.ClosedResourceError):
                async with lock:
                    await trio.sleep(0)
                    raise trio.ClosedResourceError  # pyfuse3's loop at unmount

        async def after() -> None:
            async with lock:
                got.append(1)

        async with trio.open_nursery() as n:
            n.start_soon(failing)
            n.start_soon(after)
        assert got == [1] and not lock.locked()

    trio.run(main)


def test_wait_readable_returns_at_once_when_readable_and_waits_otherwise():
    r, w = os.pipe()

    async def main():
        os.write(w, b"x")
        await wait_readable(r)  # readable: returns after one checkpoint
        os.read(r, 1)
        woke = []

        async def waiter():
            await wait_readable(r)
            woke.append(os.read(r, 1))

        async with trio.open_nursery() as n:
            n.start_soon(waiter)
            await trio.testing.wait_all_tasks_blocked()
            assert woke == []  # nothing to read: it waits, as trio's does
            os.write(w, b"y")
        assert woke == [b"y"]

    import trio.testing  # noqa: F401, PLC0415
    try:
        trio.run(main)
    finally:
        os.close(r)
        os.close(w)


def test_wait_readable_still_checkpoints_and_ends_on_notify_closing():
    r, w = os.pipe()

    async def main():
        os.write(w, b"x")
        with trio.CancelScope() as scope:
            scope.cancel()
            await wait_readable(r)  # readable, but the scope is cancelled: it must land
            raise AssertionError("not cancelled")
        assert scope.cancelled_caught
        os.read(r, 1)

        async def closer():
            await trio.testing.wait_all_tasks_blocked()
            trio.lowlevel.notify_closing(r)  # what pyfuse3.terminate() does

        async with trio.open_nursery() as n:
            n.start_soon(closer)
            with pytest.raises(trio.ClosedResourceError):
                await wait_readable(r)

    import trio.testing  # noqa: F401, PLC0415
    try:
        trio.run(main)
    finally:
        os.close(r)
        os.close(w)


def test_wait_readable_stops_asking_poll_after_a_miss_and_asks_again_later(monkeypatch):
    r, w = os.pipe()
    polls = 0
    real_poll = fuseloop.select.poll

    class CountingPoll:
        def __init__(self) -> None:
            self.p = real_poll()

        def register(self, *a) -> None:
            self.p.register(*a)

        def poll(self, *a):
            nonlocal polls
            polls += 1
            return self.p.poll(*a)

    monkeypatch.setattr(fuseloop.select, "poll", CountingPoll)
    monkeypatch.setattr(fuseloop, "_polls", {})
    monkeypatch.setattr(fuseloop, "_skip", 0)

    async def main():
        nonlocal polls

        async def writer():
            await trio.testing.wait_all_tasks_blocked()
            os.write(w, b"x")

        async with trio.open_nursery() as n:  # a miss: nothing to read yet
            n.start_soon(writer)
            await wait_readable(r)
        os.read(r, 1)
        assert polls == 1
        os.write(w, b"y" * (fuseloop.SKIP_AFTER_MISS + 1))
        for _ in range(fuseloop.SKIP_AFTER_MISS):
            await wait_readable(r)  # straight to trio's wait: no poll
        assert polls == 1
        await wait_readable(r)  # asks again
        assert polls == 2

    import trio.testing  # noqa: F401, PLC0415
    try:
        trio.run(main)
    finally:
        os.close(r)
        os.close(w)
