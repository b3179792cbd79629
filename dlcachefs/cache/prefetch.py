"""Work ahead of the reader, one file at a time, for the background parts:

* :meth:`Prefetcher.prefetch_one`: a stream whose order is known
  (:mod:`dlcachefs.clairvoyance.streams`) makes sure the current version of its next
  samples is in the cache (fetched from the source, or its chunk loaded ahead); in
  memory only when the dataset is larger than the cache;
* :meth:`Prefetcher.scan_one`: scan-ahead (:mod:`dlcachefs.cache.scanahead`) fetches a
  file of a tree read in an unknown order, into free cache room only (a guess never
  evicts, and never takes the room readers' own files wait in); with fetch workers
  (``--fetch-workers``) a worker fetches and appends it, else the daemon does;
* :meth:`Prefetcher.bytes_for`: the reorderer (:mod:`dlcachefs.clairvoyance.reorder`)
  asks for a version of a file to fill its next epoch's log: from the cache, else the
  source.

None of them fetches a file that is cached (:mod:`dlcachefs.cache.versions`), being
fetched, or held for its reader; an L-sample under ``--substitute`` is left to its open
(substitution may serve it instead).

Concurrency: trio loop; the work happens in the parts it calls (the fetcher's source
threads, the reader's disk threads). Each caller runs its own tasks in its own nursery.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from dlcachefs.cache.buffers import Backlog, ReadAhead
from dlcachefs.cache.fetch import Fetcher
from dlcachefs.cache.namespace import Namespace, identity
from dlcachefs.cache.policy import CachingPolicy, may_substitute
from dlcachefs.cache.reader import LogReader
from dlcachefs.cache.readplan import ReadPlanner
from dlcachefs.cache.source import Identity
from dlcachefs.cache.stats import Counters
from dlcachefs.cache.versions import Versions
from dlcachefs.cache.writer import ChunkWriter
from dlcachefs.config import Config
from dlcachefs.store.schema import Chunk, Entry

if TYPE_CHECKING:
    from dlcachefs.cache.fetchpool import FetchPool

#: the owner of scan-ahead's files in the read-ahead set (no stream's epoch ends them)
SCAN_OWNER = "scan-ahead"
#: bytes of free cache room a guess leaves beyond its own (it never evicts)
GUESS_SPARE = 4096
#: with fetch workers, files scan-ahead has in flight per fetch it may have (``--scan-ahead
#: N``): a worker reads its job's files one after another, so the source still sees at most
#: one read per worker, and a job of many files costs the daemon about what one file does
POOL_SCAN_BATCH = 32


class Prefetcher:
    """Fetches ahead of readers for streams, scan-ahead and the reorderer."""

    def __init__(self, cfg: Config, *, ns: Namespace, versions: Versions, fetcher: Fetcher,
                 reader: LogReader, writer: ChunkWriter, policy: CachingPolicy,
                 backlog: Backlog, readahead: ReadAhead, plans: ReadPlanner,
                 counters: Counters, pool: FetchPool | None = None) -> None:
        """``pool``: the fetch workers (``--fetch-workers``) that fetch streams' and
        scan-ahead's files into the cache, off the daemon's core (None: the fetcher does)."""
        self.cfg = cfg
        self.pool = pool
        self.ns = ns
        self.versions = versions
        self.fetcher = fetcher
        self.reader = reader
        self.writer = writer
        self.policy = policy
        self.backlog = backlog
        self.readahead = readahead
        self.plans = plans
        self.counters = counters
        self._scan_here_slots = trio.Semaphore(max(1, cfg.scan_ahead))

    @property
    def scan_batch(self) -> int:
        """Files scan-ahead may have in flight per fetch ``--scan-ahead`` allows: 1, or
        :data:`POOL_SCAN_BATCH` when fetch workers fetch them (see there)."""
        return 1 if self.pool is None else POOL_SCAN_BATCH

    def _left_to_open(self, ino: int) -> bool:
        """An L-sample under --substitute: its open may be served by substitution."""
        return self.cfg.substitute and may_substitute(self.policy, ino)

    async def prefetch_one(self, ino: int, stream) -> bool:
        """Make sure the current version of ``ino`` is in the cache (and its chunk in the
        memory tier, when whole chunks are being read); True if it was fetched."""
        e = await self.ns.fresh_file(ino)
        if (e.size > self.cfg.max_cached_file or self.fetcher.in_flight(ino)
                or self.readahead.holds_firmly(ino)):
            # (a spare, kept on a guess or for a header check's next open, may be let go
            # before the open: its chunk is still preloaded)
            return False
        if self.versions.is_cached(ino, identity(e)):
            # a plan reads it ahead instead; or the kernel's pages serve the stream
            if not self.plans.wanted(stream) and not stream.pages_served:
                # (with a log laid out for the epoch, whole chunks of that log only)
                await self.reader.preload(ino, stream.key, stream.laid_out_log())
            return False
        if self._left_to_open(ino):
            return False
        await self.writer.wait_room()
        if self.versions.is_cached(ino, identity(e)) or self.fetcher.in_flight(ino):
            return False
        if stream.memory_prefetch:
            # the disk cache is kept for the logs: hold it in memory until it is read
            data, e = await self.fetcher.fetch(e, cache=False)
            self.readahead.put(ino, identity(e), None, data, stream.key)
        elif self.pool is not None and await self.pool.fetch(e):
            # a worker read, checked and appended it; it is indexed: the open reads it
            # from the log (its pages are in memory, written moments ago)
            stream.bytes_from_source += e.size
            self.counters.prefetched += 1
            return True
        else:
            data, e = await self.fetcher.fetch(e)
            if self.readahead.has_room(len(data)):
                # held in memory until it is read: when the policy did not admit it (or
                # the writer skipped it), rather than fetch it twice; when it is on its
                # way to the log, rather than read it back from there moments later
                cached = self.versions.in_writer(ino, identity(e))
                self.readahead.put(ino, identity(e), None, data, stream.key, cached)
        stream.bytes_from_source += len(data)
        self.counters.prefetched += 1
        return True

    def settled(self, ino: int, stream) -> bool:
        """Whether :meth:`prefetch_one` would find nothing to do for ``ino`` without
        checking the source: its listing is fresh, its version cached and no chunk is
        loaded ahead for ``stream`` (a read plan or the kernel's pages serve it). The
        prefetch loop passes such positions without a task (most of a warm epoch)."""
        e = self.ns.file_if_fresh(ino)
        return (e is not None and (self.plans.wanted(stream) or stream.pages_served)
                and self.versions.is_cached(ino, identity(e)))

    def chunk_ahead(self, ino: int, stream) -> Chunk | None:
        """The chunk :meth:`prefetch_one` would load whole into the memory tier for
        ``ino`` (its cached record's), if any: the stream keeps its lead of such chunks
        within the tier, so that none is evicted before its reader comes."""
        if self.plans.wanted(stream) or stream.pages_served:
            return None
        # with a log laid out for the epoch, only that log's chunks are loaded whole; a
        # record elsewhere (a file changed since the log was planned) is loaded alone
        return self.reader.chunk_to_preload(ino, stream.laid_out_log())

    async def scan_one(self, ino: int) -> tuple[int, bool]:
        """Fetch ``ino`` into the cache unless it is there or on its way; (bytes fetched,
        whether the cache kept them). With fetch workers a worker fetches it when it can
        (see :meth:`FetchPool.fetch`'s ``spare``), else the daemon does."""
        e = await self.ns.fresh_file(ino)
        if self._not_to_scan(ino, e):
            return 0, False
        if self.pool is None:
            return await self._scan_here(ino, e)
        async with self.pool.guess_slots:
            # waited for a place among the pool's guesses (nothing held meanwhile: an open
            # of the file fetches it itself): checked again
            if self._not_to_scan(ino, e):
                return 0, False
            # (a file with another version waiting here stays with the in-daemon path
            # below, which knows what to do with it)
            if ino not in self.writer.pending and ino not in self.backlog:
                written = await self.pool.fetch(e, spare=GUESS_SPARE)
                if written:
                    # a worker read, checked and appended it into free room (the pool
                    # asked the policy and reserved it; nothing was evicted); it is
                    # indexed: its open reads it from the log
                    self.counters.scan_ahead_files += 1
                    self.counters.scan_ahead_bytes += e.size
                    return e.size, True
                if written is False:
                    # no free room for it, or the policy would not keep it: the path
                    # below would read it from the source only to drop it (the pool
                    # counted a refusal)
                    return 0, False
        # the pool did not write it (no room, not admitted, changed on the source, a
        # worker died): the usual way, which counts and decides as before, as many at a
        # time as --scan-ahead allows (scan-ahead has a batch in flight per fetch then;
        # the bound is the daemon's, over all trees)
        async with self._scan_here_slots:
            return await self._scan_here(ino, e)

    def _not_to_scan(self, ino: int, e: Entry) -> bool:
        """Whether scan-ahead leaves ``ino`` (at ``e``'s version) alone: too large, on
        its way, held in memory, cached, or an L-sample substitution may serve."""
        return (e.size > self.cfg.max_cached_file or self.fetcher.in_flight(ino)
                or ino in self.readahead or self.versions.is_cached(ino, identity(e))
                or self._left_to_open(ino))

    async def _scan_here(self, ino: int, e: Entry) -> tuple[int, bool]:
        """:meth:`scan_one`'s fetch in the daemon."""
        await self.writer.wait_room(e.size)
        if self.versions.is_cached(ino, identity(e)) or self.fetcher.in_flight(ino):
            return 0, False
        # fetched without caching, then submitted here once the writer has room: a guess
        # never takes the bounded room readers' own files wait in (the backlog's bound)
        data, e = await self.fetcher.fetch(e, cache=False)
        self.counters.scan_ahead_files += 1
        self.counters.scan_ahead_bytes += len(data)
        ident = identity(e)
        if ino in self.backlog or self.versions.is_cached(ino, ident):
            return len(data), self.versions.is_cached(ino, ident)
        # readers find it while it waits (held before the next await: an open meanwhile
        # would fetch it again)
        self.backlog.hold_guess(ino, ident, data)
        try:
            sha = None
            dedup = self.fetcher.dedup
            if dedup is not None:
                # as a reader's fetch (Fetcher._fetch_now): bytes another dataset of the
                # root holds (borrowed from it, or the same bytes read from the source) are
                # not cached a second time here; they count as kept, being cached
                sha, elsewhere = await dedup.after_fetch(e, ident, data)
                if elsewhere:
                    return len(data), True
            await self.writer.wait_room(len(data))
            if not self.versions.is_listed(ino, ident):
                return len(data), False  # a newer version came meanwhile
            if ino in self.writer.pending:  # this version, or a newer one
                return len(data), self.versions.in_writer(ino, ident)
            if self.writer.room() < len(data) + GUESS_SPARE:
                return len(data), False  # room taken meanwhile: never evict for a guess
            if not self.policy.admit(ino, len(data)):
                self.counters.not_admitted += 1
                return len(data), False
            if not self.writer.submit(ino, self.ns.path_of(e), ident, data, sha):
                self.policy.on_dropped(ino)
                return len(data), False
            if self.readahead.has_room(len(data)):
                # its open (if it comes) takes these bytes rather than read them back from
                # the log; a spare: let go first when the room is wanted
                self.readahead.put(ino, ident, None, data, SCAN_OWNER, cached=True, spare=True)
            return len(data), True
        finally:
            self.backlog.release(ino)

    async def bytes_for(self, ino: int, ident: Identity) -> bytes | memoryview | None:
        """The bytes of this version of ``ino`` from the cache, else the source; None when
        the file is gone or no longer this version (used to fill reordered logs)."""
        e = self.versions.listed_entry(ino, ident)
        if e is None:
            return None
        rec = self.versions.record(ino, ident)
        if rec is not None:
            data = await self.reader.read_record(ino, rec, background=True)
            if data is not None:
                return data
        data = self.versions.unsealed(ino, ident)
        if data is not None:
            return data
        data, e2 = await self.fetcher.fetch(e)
        return data if identity(e2) == ident else None

