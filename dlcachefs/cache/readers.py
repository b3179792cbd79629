"""The readers as the read path sees them, and what it tells the parts that watch them.

The read path (:class:`~dlcachefs.cache.engine.Engine`) serves opens; the parts that work
for readers in the background (the streams and their next-epoch logs, the read planner,
scan-ahead, the trace recorder: :mod:`dlcachefs.clairvoyance`, built by the composition
root :mod:`dlcachefs.session`) are not its to know. Between them, in this module:

* **queries** the read path asks: :class:`Readers` (the stream an open belongs to, whether
  a next-epoch log still wants a sample's bytes), answered with a :class:`ReaderStream`
  (what the read path and the other parts of :mod:`dlcachefs.cache` read and note of a
  reader's stream);
* **events** it tells: an :class:`OpenObserver` hears that a file was opened
  (:class:`OpenEvent`), served (:class:`Served`), released, or found gone from the
  source. :class:`Observers` fans them out, in the order the parts were added.

An open event says what happened and when (``t``), not what to do: it may arrive late
and in batches (events of reads served in a training process, collected there and
delivered afterwards; ``in_process``), so an observer never assumes an event is the
newest thing that happened to its file. The mount's own opens are delivered at once, in
the order they came, on the trio loop.

Concurrency: everything here runs on the trio loop; an observer must not block (no I/O,
no await: it starts tasks of its own for work that waits).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import trio

from dlcachefs.cache.source import Identity


class LaidOutLog(Protocol):
    """The log laid out in a stream's epoch order (LCache's reordered log), as the read
    path sees it: whether each chunk is released once its last record was served."""

    release_after_use: bool


class Samples(Protocol):
    """A stream's dataset as a list of samples (a
    :class:`dlcachefs.clairvoyance.samplelist.SampleList`): sample ``i`` is file
    ``inos[i]``."""

    inos: list[int]

    def members(self) -> frozenset[int] | None:
        """The set of ``inos``, once it was made off the loop (else None)."""


class ReaderStream(Protocol):
    """One reader of a known order (a job's rank), as the cache's parts read and note it
    (:class:`dlcachefs.clairvoyance.streams.Stream` is one). The read path: ``next_log``,
    ``current_log``, ``memory_prefetch``, ``order_unknowable`` and the page-cache verdict
    (``note_cached_open`` / ``note_cached_read`` / ``note_unread``); substitution:
    ``used``, ``substituted``, ``substitutions``; prefetch and read plans: the rest."""

    key: str
    dataset: str | None
    epoch: int | None
    target_epoch: int | None
    order: list[int]
    position: int
    consumed: bytearray
    error: str | None
    #: the next epoch's log being laid out, and the log this epoch reads (LCache)
    next_log: object | None
    current_log: LaidOutLog | None
    memory_prefetch: bool
    bytes_from_source: int
    pages_served: bool
    pages_lost: trio.Event
    used: set[int]
    substituted: dict[int, int]
    substitutions: dict[int, int]

    samples: Samples | None
    #: its opens by where they were served (stats)
    reads: ReadCounts
    #: its last open was served in the training's process
    in_process: bool

    @property
    def order_unknowable(self) -> bool:
        """No order will cover this reader's opens now (scan-ahead may guess)."""

    def covers(self, ino: int) -> bool:
        """Whether ``ino`` is one of this stream's samples (True while not known): an
        open of another file by its processes is no order's (scan-ahead may guess)."""

    def laid_out_log(self) -> int | None:
        """The id of the log laid out for the epoch being read, if any."""

    def note_cached_open(self) -> int:
        """An open of a cached file, counted for the page-cache verdict; the count's id."""

    def note_cached_read(self, count: int) -> None:
        """Such an open was READ (the kernel's pages did not serve it)."""

    def note_unread(self, count: int) -> None:
        """Such an open was released with no READ (the kernel's pages served it)."""


class Readers(Protocol):
    """What the read path asks of the parts that know the readers."""

    def stream_of(self, pid: int) -> ReaderStream | None:
        """The stream process ``pid`` reads for, if any."""

    def stream_named(self, job: str, rank: int) -> ReaderStream | None:
        """The stream of ``job``'s rank ``rank`` (rank -1: its only one), if any: how a
        reading process that :meth:`stream_of` does not know is attributed."""

    def wanted_by_next_log(self, ino: int) -> bool:
        """Whether a next-epoch log still waits for ``ino``'s bytes from its open (its
        slot is written from the bytes the open is served)."""

    def backfill(self, inos: Sequence[int]) -> None:
        """These files were read without their bytes reaching the daemon (in a training
        process): the next-epoch logs that wait for them read them from the cache."""


class NoReaders:
    """Readers when no part knows any (a core without streams)."""

    def stream_of(self, pid: int) -> ReaderStream | None:
        return None

    def stream_named(self, job: str, rank: int) -> ReaderStream | None:
        return None

    def wanted_by_next_log(self, ino: int) -> bool:
        return False

    def backfill(self, inos: Sequence[int]) -> None:
        pass


@dataclass(slots=True)
class ReadCounts:
    """A stream's opens by where they were served: through the mount, or in the training
    process (:mod:`dlcachefs.data.intercept`: opens and bytes, and the opens its
    processes sent through the mount, by reason: the names of
    :data:`dlcachefs.store.tally.FALLBACKS`)."""

    mount_opens: int = 0
    in_process_opens: int = 0
    in_process_bytes: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)

    def stats(self) -> dict:
        return {"mount_opens": self.mount_opens, "in_process_opens": self.in_process_opens,
                "in_process_bytes": self.in_process_bytes,
                "in_process_fallbacks": dict(sorted(self.fallbacks.items()))}


@dataclass(slots=True)
class OpenEvent:
    """A file opened for reading.

    ``stream`` is the reader's stream as :meth:`Readers.stream_of` answered when the
    event was made (None: none); ``parent`` the file's directory; ``t`` when the open came
    (``time.monotonic()``); ``in_process``: served inside the training process, not by
    the mount (such events come late, in batches)."""

    ino: int
    pid: int
    parent: int
    t: float
    stream: ReaderStream | None = None
    in_process: bool = False


@dataclass(slots=True)
class Served:
    """How the mount served an open (after :meth:`OpenObserver.opened`): ``data`` the
    file's bytes when the open holds them (None for an open that loads at its first READ),
    ``version`` their version, ``cached`` from the cache, ``waited`` for the source (a
    miss), ``joined`` a fetch already under way (its bytes counted where it began);
    ``done`` when the bytes were there (``time.monotonic()``), for events that come late
    (None: now)."""

    data: bytes | memoryview | None
    version: Identity | None
    cached: bool
    waited: bool = False
    joined: bool = False
    done: float | None = None


class OpenObserver(Protocol):
    """A part that hears what happens to readers' files. Every method is quick and
    synchronous (trio loop)."""

    def opened(self, ev: OpenEvent) -> None:
        """``ev.ino`` was opened (before its bytes are looked for)."""

    def served(self, ev: OpenEvent, how: Served) -> None:
        """The open ``ev`` was answered with bytes (not for substituted or read-through
        opens)."""

    def released(self, ino: int, read: bool) -> None:
        """An open of ``ino`` was closed; ``read``: a READ of it reached the daemon."""

    def gone(self, inos: Sequence[int]) -> None:
        """These files were found gone from the source (their opens will fail at
        lookup: they never come)."""


class Observer:
    """A base for observers that hear only some events: the others do nothing."""

    def opened(self, ev: OpenEvent) -> None:
        pass

    def served(self, ev: OpenEvent, how: Served) -> None:
        pass

    def released(self, ino: int, read: bool) -> None:
        pass

    def gone(self, inos: Sequence[int]) -> None:
        pass


class Observers(Observer):
    """Fans each event out to the observers added, in the order they were added (the
    composition root adds them once, before anything is served)."""

    def __init__(self) -> None:
        self._all: list[OpenObserver] = []

    def add(self, observer: OpenObserver) -> None:
        self._all.append(observer)

    def opened(self, ev: OpenEvent) -> None:
        for o in self._all:
            o.opened(ev)

    def served(self, ev: OpenEvent, how: Served) -> None:
        for o in self._all:
            o.served(ev, how)

    def released(self, ino: int, read: bool) -> None:
        for o in self._all:
            o.released(ino, read)

    def gone(self, inos: Sequence[int]) -> None:
        for o in self._all:
            o.gone(inos)
