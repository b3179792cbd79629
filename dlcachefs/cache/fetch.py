"""Reading from the source: the one wrapper every source call goes through.

:class:`SourceCalls` runs a blocking call on the source (a whole-file read, an ``lstat``,
a listing, a ranged read, ``statvfs``) the same way for every caller (the read path, the
namespace's revalidation, the packer, scan-ahead, the reorderer's fills, the FUSE
layer's ``statfs``):

* in a worker thread under the source limiter (``--source-threads``);
* given up after ``--source-timeout`` (:class:`~dlcachefs.errors.SourceTimeout`); the
  stuck thread is abandoned and the call is not retried (a hung source must not pile up
  more stuck threads);
* retried on transient errors (:data:`TRANSIENT`), at most ``--source-retries`` times,
  0.1 s, 0.4 s, 1.6 s ... apart;
* counted: ``source_errors``, ``source_retries``, ``source_timeouts``.

:class:`~dlcachefs.errors.NotFound` and :class:`~dlcachefs.errors.SourceChanged` are
answers, not failures: raised at once, neither retried nor counted.

Concurrency: called on the trio loop; the source call itself runs in a worker thread.
The counters are touched on the loop only.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from typing import TypeVar

import trio

from dlcachefs.cache.source import Identity, Source
from dlcachefs.cache.stats import Counters
from dlcachefs.config import Config
from dlcachefs.errors import NotFound, SourceChanged, SourceError, SourceTimeout

T = TypeVar("T")

#: errno values of the source worth another try
TRANSIENT = frozenset({errno.EIO, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ECONNRESET,
                       errno.ENOTCONN, errno.EHOSTUNREACH, errno.ENETUNREACH})


class SourceCalls:
    """The source, called under the rules of the module docstring."""

    def __init__(self, source: Source, cfg: Config, counters: Counters) -> None:
        self.source = source
        self.timeout = cfg.source_timeout
        self.retries = cfg.source_retries
        self.use_src_ino = cfg.use_source_inode
        self.counters = counters
        self.limiter = trio.CapacityLimiter(cfg.source_threads)

    async def call(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` (blocking, on the source) in a thread: timeout, retries, counters."""
        delay = 0.1
        for attempt in range(self.retries + 1):
            try:
                with trio.fail_after(self.timeout):
                    return await trio.to_thread.run_sync(
                        fn, *args, limiter=self.limiter, abandon_on_cancel=True)
            except trio.TooSlowError:
                # a hung source: do not pile up more stuck threads by retrying
                self.counters.source_timeouts += 1
                raise SourceTimeout(
                    f"source did not answer within {self.timeout:.0f} s",
                    errno.ETIMEDOUT) from None
            except (NotFound, SourceChanged):
                raise
            except SourceError as exc:
                self.counters.source_errors += 1
                if exc.errno not in TRANSIENT or attempt == self.retries:
                    raise
                self.counters.source_retries += 1
                await trio.sleep(delay)
                delay *= 4
        raise AssertionError("unreachable")

    async def read_file(self, rel: bytes) -> tuple[bytes, Identity]:
        """A whole file as one consistent version, and that version's identity."""
        return await self.call(self.source.read_file, rel, self.use_src_ino)
