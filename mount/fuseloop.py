"""A cheaper lock in pyfuse3's main loop (one per FUSE request).

pyfuse3's session loop (``pyfuse3/internal.pxi``, ``_wait_fuse_readable``) takes a
``trio.Lock`` around every wait for ``/dev/fuse`` to become readable, so that one task at a
time waits on the fd. ``trio.Lock`` is built for generality (KeyboardInterrupt protection,
a parking lot with lot breakers that inspect the owner's coroutine state, a checkpoint on
every acquire): ~8% of the daemon's CPU on a warm 8-reader pass (py-spy), 3-5 us of CPU
per request in isolation (``FifoLock`` vs ``trio.Lock``, acquire + release around a
yield: 9.2 -> 4.4 us with one task, 11.6 -> 8.6 us with 8).

pyfuse3 looks the lock class up as ``trio.Lock`` in its module global ``trio`` at the first
request: the hook its own asyncio mode uses (``pyfuse3.asyncio.enable`` replaces that
global). :func:`install` puts a copy of trio's namespace there whose ``Lock`` is
:class:`FifoLock`, which does only what that loop needs. Best effort: if a later pyfuse3
has no such global, :func:`install` says so in the log and the daemon runs as before.

(Measured and left alone: trio sets the OS thread name twice per ``to_thread`` job, through
ctypes; turning that off changed nothing measurable next to the ~70 us of CPU a thread hop
costs here, so the hops themselves are what to cut.)
"""

from __future__ import annotations

import collections
import logging
import types

import pyfuse3
import trio

log = logging.getLogger(__name__)


class FifoLock:
    """An async mutex for trio tasks: FIFO hand-over, no checkpoint when it is free.

    The minimum pyfuse3's session loop needs (``async with lock:`` around a wait on the
    FUSE fd; one waiter at a time). A release with waiters hands the lock straight to the
    first of them (it stays held), so no task can take it out of turn. A waiter that is
    cancelled leaves the queue. Trio loop only, like every lock of trio."""

    __slots__ = ("_held", "_waiters")

    def __init__(self) -> None:
        self._held = False
        self._waiters: collections.deque[trio.lowlevel.Task] = collections.deque()

    def locked(self) -> bool:
        return self._held

    async def __aenter__(self) -> None:
        if not self._held:
            self._held = True
            return
        task = trio.lowlevel.current_task()
        self._waiters.append(task)

        def abort(_raise_cancel) -> trio.lowlevel.Abort:
            # only called while the task still waits (a hand-over reschedules it first)
            self._waiters.remove(task)
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    async def __aexit__(self, *exc: object) -> None:
        if self._waiters:
            trio.lowlevel.reschedule(self._waiters.popleft())  # the lock stays held: theirs
        else:
            self._held = False


def install() -> bool:
    """Give pyfuse3's session loop :class:`FifoLock` (before ``pyfuse3.main``). True when
    installed."""
    if getattr(pyfuse3, "trio", None) is not trio:
        log.info("pyfuse3 has no module global 'trio' to give a cheaper lock; left as is")
        return False
    shim = types.ModuleType("trio")
    shim.__dict__.update(trio.__dict__)
    shim.Lock = FifoLock  # type: ignore[attr-defined]
    pyfuse3.trio = shim  # type: ignore[attr-defined]
    return True
