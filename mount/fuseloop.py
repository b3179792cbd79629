"""Cheaper per-request overhead in pyfuse3's main loop.

pyfuse3's session loop (``pyfuse3/internal.pxi``, ``_wait_fuse_readable``) runs, for every
request, ``async with trio.Lock(): await trio.lowlevel.wait_readable(session_fd)`` before it
reads the request. Two costs of that, measured in isolation (CPU per call, this machine):

* ``trio.Lock`` is built for generality (KeyboardInterrupt protection, a parking lot with
  lot breakers that inspect the owner's coroutine state, a checkpoint on every acquire):
  acquire + release around a yield 9.2 us with one task, 11.6 with 8; :class:`FifoLock`,
  which does only what the loop needs, 4.4 and 8.6 (py-spy: the lock was ~8% of the
  daemon's CPU on a warm 8-reader pass).
* ``wait_readable`` re-arms the fd in epoll (one ``epoll_ctl``) and parks the task until
  the next ``epoll_wait``, even when a request is already waiting, which is the common
  case with several readers on cached files: 8.1 us; :func:`wait_readable` first asks
  ``poll`` with no timeout and, when the fd is readable, only yields once (a trio
  checkpoint, so other tasks still run and cancellation still lands): 5.0 us. While
  ``poll`` finds nothing waiting it stops asking for a while (:data:`SKIP_AFTER_MISS`).

pyfuse3 looks both up through its module global ``trio`` (``trio.Lock`` at the first
request, ``trio.lowlevel.wait_readable`` at each): the hook its own asyncio mode uses
(``pyfuse3.asyncio.enable`` replaces that global). :func:`install` puts a copy of trio's
namespace there with these two replaced; everything else is trio's own. Best effort: if a
later pyfuse3 has no such global, :func:`install` says so in the log and the daemon runs
as before.

(Measured and left alone: trio sets the OS thread name twice per ``to_thread`` job, through
ctypes; turning that off changed nothing measurable next to the ~70 us of CPU a thread hop
costs here, so the hops themselves are what to cut.)
"""

from __future__ import annotations

import collections
import logging
import select
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


#: after a ``poll`` that found nothing to read, this many waits go straight to trio's:
#: when requests do not queue up (a first epoch whose readers wait for the source), asking
#: first is a syscall, and a GIL release, for nothing. (Measured on a first pass, 8
#: readers, local source: no difference in daemon CPU per file either way, within the
#: +-30% the loaded machine gave; warm, where requests queue, ~10% less.)
SKIP_AFTER_MISS = 16

_polls: dict[int, select.poll] = {}
_skip = 0


async def wait_readable(fd: int) -> None:
    """``trio.lowlevel.wait_readable`` that returns after one checkpoint when ``fd`` is
    readable already, else waits as trio does (so ``notify_closing`` still ends the wait
    with ClosedResourceError, and a hung-up fd is trio's to report). It asks ``poll``
    first only while that keeps finding requests waiting (see :data:`SKIP_AFTER_MISS`).
    Trio loop."""
    global _skip
    if _skip:
        _skip -= 1
        await trio.lowlevel.wait_readable(fd)
        return
    p = _polls.get(fd)
    if p is None:
        p = _polls[fd] = select.poll()
        p.register(fd, select.POLLIN)
    ready = p.poll(0)
    if ready and ready[0][1] & select.POLLIN:
        await trio.lowlevel.checkpoint()
        return
    _skip = SKIP_AFTER_MISS
    await trio.lowlevel.wait_readable(fd)


def install() -> bool:
    """Give pyfuse3's session loop :class:`FifoLock` and :func:`wait_readable` (before
    ``pyfuse3.main``). True when installed."""
    if getattr(pyfuse3, "trio", None) is not trio:
        log.info("pyfuse3 has no module global 'trio' to give a cheaper loop; left as is")
        return False
    lowlevel = types.ModuleType("trio.lowlevel")
    lowlevel.__dict__.update(trio.lowlevel.__dict__)
    lowlevel.wait_readable = wait_readable  # type: ignore[attr-defined]
    shim = types.ModuleType("trio")
    shim.__dict__.update(trio.__dict__)
    shim.Lock = FifoLock  # type: ignore[attr-defined]
    shim.lowlevel = lowlevel  # type: ignore[attr-defined]
    pyfuse3.trio = shim  # type: ignore[attr-defined]
    return True
