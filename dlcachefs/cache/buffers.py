"""The two places fetched bytes wait in memory outside the chunk writer.

* :class:`Backlog`: files fetched while the chunk writer had no room. A reader that
  missed got its bytes and did not wait for the cache disk (an ``fdatasync`` under load
  takes 100s of ms); its file waits here for the writer's room, in the background, up
  to a bound (``LATER_CHUNKS`` chunks' worth). Scan-ahead's guesses also wait here
  while they wait for room, without taking any of that bound. Opens of a file that
  waits here are hits.
* :class:`ReadAhead`: files read ahead of the reader and held in memory until its open
  takes them: records read from the logs ahead of a stream (record mode), files
  prefetched from the source but not cached (the dataset is larger than the cache, or
  the policy did not admit them), and files prefetched from the source and cached, while
  there is room (their open then takes the bytes fetched moments before rather than
  read them back from the log it just wrote: a thread hop, a read and a checksum per
  file of a first epoch), and files scan-ahead fetched and cached, as spares (let go
  first when room is asked for). Bounded by ``limit`` bytes.

Both are plain bookkeeping: what to put there, and when, is decided by their users
(:mod:`dlcachefs.cache.fetch`, :mod:`dlcachefs.cache.prefetch`,
:mod:`dlcachefs.cache.reader`, and the engine's open).

Concurrency: trio loop only (no locks).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import trio

from dlcachefs.cache.source import Identity
from dlcachefs.store.schema import Record

#: fetched bytes that may wait for the chunk writer's room, in chunks (--chunk-size)
LATER_CHUNKS = 2
#: seconds a spare (a file scan-ahead fetched and cached) is held for its open at most
SPARE_S = 60.0


class Backlog:
    """Files fetched while the chunk writer had no room, waiting for it: ino ->
    (identity, bytes). ``bytes`` counts readers' files only (the bound)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit  # LATER_CHUNKS * --chunk-size
        self.bytes = 0
        self._files: dict[int, tuple[Identity, bytes]] = {}
        self._empty = trio.Event()  # set (and replaced) when the backlog drains

    def __contains__(self, ino: int) -> bool:
        return ino in self._files

    def holds_firmly(self, ino: int) -> bool:
        """Held, and not as a spare (a spare may be let go before its open comes)."""
        return ino in self._files and ino not in self._spare

    def __bool__(self) -> bool:
        return bool(self._files)

    def get(self, ino: int, ident: Identity) -> bytes | None:
        """The waiting bytes of this version of ``ino``, or None."""
        held = self._files.get(ino)
        return held[1] if held is not None and held[0] == ident else None

    def try_hold(self, ino: int, ident: Identity, data: bytes) -> bool:
        """Hold a reader's file, counted against the bound; False when the bound is
        reached (one file waits whatever its size, as the writer takes one whatever its
        size) or the file already waits. Release it with :meth:`release`."""
        if ino in self._files or (self._files and self.bytes + len(data) > self.limit):
            return False
        self._files[ino] = (ident, data)
        self.bytes += len(data)
        return True

    def hold_guess(self, ino: int, ident: Identity, data: bytes) -> None:
        """Hold a file fetched on a guess (scan-ahead), outside the bound: readers find it
        while it waits. Release it with :meth:`release` (``counted=False``)."""
        self._files[ino] = (ident, data)

    def release(self, ino: int, counted: int = 0) -> None:
        """The file no longer waits; ``counted``: the bytes :meth:`try_hold` counted."""
        self.bytes -= counted
        self._files.pop(ino, None)
        if not self._files:
            self._empty.set()
            self._empty = trio.Event()

    async def drained(self) -> None:
        """Wait until nothing waits any more."""
        while self._files:
            await self._empty.wait()


@dataclass(slots=True)
class ReadyFile:
    """A file read ahead of its open."""

    ident: Identity
    rec: Record | None  # the record it was read from; None: fetched from the source
    data: bytes | memoryview
    owner: str  # the stream it was read for
    cached: bool = False  # fetched from the source and handed to the chunk writer too


class ReadAhead:
    """Files read ahead of the reader, until its open takes them (or their stream's
    epoch ends), at most ``limit`` bytes as far as the callers check :meth:`has_room`."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0
        self.spare_bytes = 0  # of them, the spares
        self._files: dict[int, ReadyFile] = {}
        # files held on a guess whose bytes are in the cache as well, oldest first (with
        # when they came): the first to go when room is asked for, and after SPARE_S
        # (nothing is lost: their opens read the log)
        self._spare: OrderedDict[int, float] = OrderedDict()

    def __contains__(self, ino: int) -> bool:
        return ino in self._files

    def holds_firmly(self, ino: int) -> bool:
        """Held, and not as a spare (a spare may be let go before its open comes)."""
        return ino in self._files and ino not in self._spare

    def has_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit; spare files are let go, oldest first, to make room
        (none when that would not be enough)."""
        if self.bytes - self.spare_bytes + nbytes > self.limit:
            return False
        while self.bytes + nbytes > self.limit and self._spare:
            self._pop(next(iter(self._spare)))
        return self.bytes + nbytes <= self.limit

    def put(self, ino: int, ident: Identity, rec: Record | None, data: bytes | memoryview,
            owner: str, cached: bool = False, spare: bool = False) -> None:
        """Hold a file; ``cached``: its bytes went to the chunk writer as well; ``spare``
        (a guess, cached): let go first when room is asked for. Spares make room for it."""
        self._pop(ino)
        self.has_room(len(data))
        self._files[ino] = ReadyFile(ident, rec, data, owner, cached)
        self.bytes += len(data)
        if spare:
            self._spare[ino] = time.monotonic()
            self.spare_bytes += len(data)

    def drop_old_spares(self, age_s: float = SPARE_S) -> None:
        """Let go of the spares held longer than ``age_s`` (an idle daemon does not keep
        a pass's guesses in memory)."""
        limit = time.monotonic() - age_s
        while self._spare:
            ino, since = next(iter(self._spare.items()))
            if since > limit:
                break
            self._pop(ino)

    def take(self, ino: int) -> ReadyFile | None:
        """What was read ahead for ``ino`` (any version), no longer held."""
        return self._pop(ino)

    def drop_owner(self, owner: str) -> None:
        """Forget what was read ahead for one stream's epoch that is over."""
        for ino in [i for i, f in self._files.items() if f.owner == owner]:
            self._pop(ino)

    def _pop(self, ino: int) -> ReadyFile | None:
        f = self._files.pop(ino, None)
        if f is not None:
            self.bytes -= len(f.data)
            if ino in self._spare:
                del self._spare[ino]
                self.spare_bytes -= len(f.data)
        return f
