"""Reads served inside training processes, told to the read path's observers as the mount's
own opens are.

A training under ``dlcachefs run`` reads cached files in its own processes
(:mod:`dlcachefs.data.intercept`): no FUSE request reaches the daemon for them. Each such
process writes an event per file it served (inode, when, how long, size) into its tally
file's ring (:mod:`dlcachefs.store.tally`). :class:`InProcessReads` drains the rings every
:data:`DRAIN_S` seconds and, for each event, does what an open through the mount does for
the parts that watch readers: the policy hears the request and the access to the
record's chunk (LRU recency, iCACHE's counts, LCache's release after use), the observers hear the open and that it was served from the cache
(:class:`~dlcachefs.cache.readers.OpenEvent` with ``in_process``: a stream's position,
its prefetch and read plan, scan-ahead, the trace, the loader's pace and t_fetch, the
files used this epoch for substitution), and the stream counts it apart
(:class:`~dlcachefs.cache.readers.ReadCounts`, with the process's fallbacks by reason).

Attribution: by the reading process (its pid, as an open through the mount is, which
follows DataLoader workers to their training), else by the job and rank the process
carries in its environment (``$DLCACHEFS_JOB``, ``$RANK``).

Next-epoch logs (LCache) are written from the bytes each open is served; an in-process
read's bytes stay in the training process, so the logs that wait for a file read that
way read it back from the cache in the background (:meth:`Readers.backfill`: the
relayout's own read, counted by the logs as their backfill).

Concurrency: trio loop. The drain is blocking but short (a ``pread`` of a few hundred
bytes per reading process, an entry looked up per event); events arrive up to
:data:`DRAIN_S` late, which positions and pacing tolerate (they are observed, not
waited on).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from dlcachefs.cache.readers import OpenEvent, OpenObserver, Readers, ReaderStream, Served
from dlcachefs.store.integrity import log_failure
from dlcachefs.store.tally import FIELDS, TallyEvents

if TYPE_CHECKING:
    from dlcachefs.cache.policy import CachingPolicy
    from dlcachefs.cache.views import PolicyClock
    from dlcachefs.store.index import Index

log = logging.getLogger(__name__)

#: seconds between drains of the readers' event rings, while some process reads
DRAIN_S = 0.05
#: seconds between looks for a reading process while there is none
IDLE_S = 0.25


class InProcessReads:
    """Drains the readers' event rings into the read path's events (see the module doc)."""

    def __init__(self, events: TallyEvents, *, index: Index, readers: Readers,
                 observers: OpenObserver, policy: CachingPolicy, clock: PolicyClock,
                 after_use: Callable[[int, int], None]) -> None:
        """``after_use(chunk id, inode)``: a record of the chunk was served (the policy's
        access, release after use: :meth:`LogReader.after_use`)."""
        self.events = events
        self.after_use = after_use
        self.index = index
        self.readers = readers
        self.observers = observers
        self.policy = policy
        self.clock = clock
        #: events taken (stats)
        self.taken = 0

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                # (an idle mount costs ~1 ms of CPU a second for this, not ~5)
                await trio.sleep(DRAIN_S if self.events.readers() else IDLE_S)
                try:
                    self.drain()
                except Exception:  # noqa: BLE001 - a drain that fails must not end the mount
                    log_failure(log, "taking the in-process reads' events failed")
                    await trio.sleep(1)
        finally:
            self.events.close()

    def drain(self, scan: bool = False) -> int:
        """Take every reader's new events; returns how many. ``scan``: look for readers
        that started or ended now (before the stats remove the files of those that
        ended: their last events would be lost). The events of all processes are told in
        the order their opens began (a learned order is the order of the opens, across
        the loader's workers, as the mount sees it)."""
        merged: list[tuple[float, int, int, float, int, int, ReaderStream | None]] = []
        for ring, events, delta in self.events.drain(time.monotonic(), scan):
            stream = self.readers.stream_of(ring.pid) if ring.pid else None
            if stream is None and ring.job:
                stream = self.readers.stream_named(ring.job, ring.rank)
            if stream is not None and any(delta):
                f = stream.reads.fallbacks
                for name, d in zip(FIELDS[2:], delta[2:], strict=True):
                    if d:
                        f[name] = f.get(name, 0) + d
            merged += [(t, ino, ring.pid, seconds, size, k, stream)
                       for k, (ino, t, seconds, size) in enumerate(events)]
        merged.sort(key=lambda x: (x[0], x[5]))
        wanted = []
        for t, ino, pid, seconds, size, _, stream in merged:
            e = self.index.get_entry(ino)
            if e is None:
                continue  # gone since (its read was of a version the index had)
            ev = OpenEvent(ino, pid, e.parent, t, stream, in_process=True)
            self.observers.opened(ev)
            self.clock.tick += 1
            self.policy.on_request(ino)
            rec = self.index.get_record(ino)
            if rec is not None and rec.size == size:  # (the record it read, or its move)
                self.after_use(rec.chunk_id, ino)
            self.observers.served(ev, Served(None, None, True, done=t + seconds))
            if stream is not None:
                stream.reads.in_process_opens += 1
                stream.reads.in_process_bytes += size
            if self.readers.wanted_by_next_log(ino):
                wanted.append(ino)
        if wanted:
            self.readers.backfill(wanted)
        self.taken += len(merged)
        return len(merged)

    def stats(self) -> dict:
        return {"events": self.taken, "events_lost": self.events.lost}
