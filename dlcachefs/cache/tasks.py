"""The base of a part that owns background tasks of its own.

Concurrency: trio loop. :meth:`TaskOwner.run` is started in the engine's nursery and
opens the nursery the part's tasks run in, until it is cancelled at close; before it has
started (or after it ended) :attr:`TaskOwner.running` is False and nothing is spawned, so a
caller that needs the work done falls back to doing it itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio


class TaskOwner:
    """Owns the background tasks it starts with :meth:`spawn` (in :meth:`run`'s nursery)."""

    def __init__(self) -> None:
        self._nursery: trio.Nursery | None = None

    @property
    def running(self) -> bool:
        """Whether :meth:`run` is running, so that :meth:`spawn` can start a task."""
        return self._nursery is not None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Hold the nursery of this part's tasks, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None

    def spawn(self, fn: Callable[..., Awaitable[object]], *args: object) -> bool:
        """Start ``fn(*args)`` as a task of this part; False when it is not running."""
        if self._nursery is None:
            return False
        self._nursery.start_soon(fn, *args)
        return True
