"""The streams as the read path sees them: who an open is for, and what it did.

:class:`StreamEvents` answers the read path's questions (:class:`~dlcachefs.cache.readers.Readers`:
the stream a process reads for, whether a next-epoch log waits for a file's bytes) and
hears its events (:class:`~dlcachefs.cache.readers.OpenObserver`), on behalf of the
mount's :class:`~dlcachefs.clairvoyance.streams.StreamManager`:

* an open moves its stream's position (the prefetch follows);
* an open's bytes fill the slots of every stream's next-epoch log that waits for them
  (LCache's reordering writes the next epoch's log from the bytes this one is served);
* the stream's loader is timed (t_fetch, for the worker advice), its stalls and its bytes
  from the source counted, and the file marked used this epoch (substitution);
* files gone from the source are passed by the streams' positions.

Concurrency: trio loop, called by the read path at each open; nothing here waits.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dlcachefs.cache.readers import Observer, OpenEvent, Served

if TYPE_CHECKING:
    from dlcachefs.clairvoyance.streams import Stream, StreamManager


class StreamEvents(Observer):
    """The read path's :class:`~dlcachefs.cache.readers.Readers` and one of its
    observers, over the mount's streams."""

    def __init__(self, streams: StreamManager) -> None:
        self.streams = streams

    # ----- Readers ------------------------------------------------------------------

    def stream_of(self, pid: int) -> Stream | None:
        return self.streams.stream_of(pid)

    def stream_named(self, job: str, rank: int) -> Stream | None:
        return self.streams.stream_named(job, rank)

    def wanted_by_next_log(self, ino: int) -> bool:
        return any(nl.wants(ino) for nl in self.streams.next_logs())

    def backfill(self, inos: Sequence[int]) -> None:
        self.streams.backfill(inos)

    # ----- OpenObserver -------------------------------------------------------------

    def opened(self, ev: OpenEvent) -> None:
        if ev.stream is not None:
            if not ev.in_process:
                ev.stream.reads.mount_opens += 1
            ev.stream.in_process = ev.in_process
            self.streams.note_open(ev.stream, ev.ino)  # type: ignore[arg-type]

    def served(self, ev: OpenEvent, how: Served) -> None:
        if how.data is not None:
            for nl in self.streams.next_logs():  # (every stream's: see next_logs)
                nl.consumed(ev.ino, how.data, how.version)
        s: Stream | None = ev.stream  # type: ignore[assignment]
        if s is None:
            return
        # the loader's t_fetch: from the open to its bytes
        s.used.add(ev.ino)
        t1 = time.monotonic() if how.done is None else how.done
        s.note_latency(how.cached, t1 - ev.t)
        s.pace.note(ev.pid, ev.t, t1, s.target_epoch)
        s.note_served(how.waited and not how.cached)
        if how.waited:
            s.stall_seconds += time.monotonic() - ev.t
            if not how.cached and not how.joined and how.data is not None:
                s.bytes_from_source += len(how.data)

    def gone(self, inos: Sequence[int]) -> None:
        self.streams.note_gone(list(inos))
