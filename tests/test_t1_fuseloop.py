"""The lock pyfuse3's session loop gets from :mod:`dlcachefs.mount.fuseloop`: mutual
exclusion, FIFO hand-over, cancelled waiters leave the queue (the daemon's shutdown cancels
every loop task parked on it). Mounted use is covered by every mounted test (the daemon
installs it); the concurrent-reader ones (test_t4_requests, bench) put many tasks on it."""

from __future__ import annotations

import pyfuse3
import pytest
import trio
from dlcachefs.mount import fuseloop
from dlcachefs.mount.fuseloop import FifoLock
from hypothesis import given, settings
from hypothesis import strategies as st


def test_install_gives_pyfuse3_the_lock_and_keeps_the_rest_of_trio():
    saved = pyfuse3.trio
    try:
        assert fuseloop.install() is True
        shim = pyfuse3.trio
        assert shim.Lock is FifoLock
        # everything else pyfuse3's loop uses is trio's own
        assert shim.lowlevel is trio.lowlevel
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
