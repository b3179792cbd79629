"""The chunk writer: packs fetched files into chunks, makes them durable, then indexes them.

Order of one seal (the crash-consistency argument):

1. choose victims on the trio loop (policy; pinned chunks excluded) and stop serving them;
2. in ONE worker thread: append the new chunks (the policy's units: one or several) to
   the active log in one write and ``fdatasync`` it; then one LMDB write transaction
   (:func:`dlcachefs.store.seal.seal_chunks`, the reorderer's too) drops the victims' and
   dropped records and indexes the new records and chunks; commit (LMDB fsyncs); then
   punch the victims' holes.

So the index only ever points at bytes that were already durable, and never at a punched
range. A crash between the append and the commit leaves an unindexed tail, which
:meth:`LogStore.recover` cuts off at the next start.

``--cache-size`` (the space account). Bytes are reserved BEFORE they can land, and the
writer is the one owner of the account, for every policy and for the reordered logs:

* ``used``: bytes of the chunks in the index (a loop-side mirror of the index's
  ``chunk_bytes`` counter, moved only when a commit has returned);
* ``doomed``: chunks chosen as victims to make room, no longer served (``evicting``:
  pins are refused), dropped from the index by the next commit, whichever it is;
* ``pending``: bytes that will become chunk bytes through work already accepted:
  (a) each open record, ``encoded_len + CHUNK_HEADER_SIZE`` (a record never costs more
  than that in its chunk, whatever unit it ends up in), charged at :meth:`submit`;
  (b) the exact length of the chunks of the seal being committed (``sealing_bytes``);
  (c) reservations of chunks written outside this writer (a next epoch's log, see
  :mod:`dlcachefs.clairvoyance.reorder`: each slot's record, and its chunk's header with
  the first, as the slot is claimed, until the chunk is indexed or given up),
  :meth:`try_reserve` / :meth:`unreserve`.

The limit is ``--cache-size``, or with ``--shared-cache`` this dataset's share of the
root's budget (:attr:`ChunkWriter.limit`, moved at run time only by :meth:`set_limit`,
which dooms victims before it holds the account to a smaller limit; see
:mod:`dlcachefs.cache.shares`).

Rule A, at every point of the trio loop: ``used - doomed + pending <= limit``. A
charge that does not fit dooms victims of the policy first (pinned, protected and doomed
chunks excluded), all or nothing; if they are not enough the record is not cached (it is
served all the same). Rule B: every commit runs under the writer's limiter (the
reorderer's too) and drops every chunk doomed so far, so after each commit the index's
``chunk_bytes`` <= ``limit`` (the new chunks were in ``pending``, the dropped ones in
``doomed``). A unit never exceeds :attr:`max_unit` (half the cache): a policy's package
larger than that is cut, and ``--chunk-size`` chunks to an eighth of a small cache
(:attr:`chunk_target`); one record larger than the whole cache is not cached. The disk holds a seal's new bytes shortly before its victims' holes are punched
(crash order above); the account is of the index.

Keep the last copy in the cluster (``--peers``, Lobster 4.4): with a
:attr:`ChunkWriter.keeper` (the peer tier), the commit that drops victims first reads
their current records back from the log (in the same thread, before the index forgets
them and their holes are punched), at most :meth:`LastCopyKeeper.room` bytes of them, and
hands them to the keeper on the loop once the commit returned; the keeper makes sure each
one's owner holds it, in the background. So a file this node evicts does not vanish from
the cluster when the tier lost it meanwhile (its server restarted, memcached evicted or
expired it). Records past the room are counted, not read: a copy lost that way costs a
remote read later, never a reader's error. No keeper: nothing is read.

Concurrency: every attribute is owned by the trio loop. The blocking commit runs in a
thread under a limiter of one, so appends to the active log are serial. Records waiting
to be sealed stay readable from :attr:`pending`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import trio

from dlcachefs.cache.memtier import MemoryTier
from dlcachefs.cache.policy import PACK_CHUNK, unit_target
from dlcachefs.cache.source import Identity
from dlcachefs.cache.stats import Counters
from dlcachefs.cache.versions import record_is_current
from dlcachefs.config import Config
from dlcachefs.store import schema as S
from dlcachefs.store.chunkfmt import (
    CHUNK_HEADER_SIZE,
    RECORD_HEADER_SIZE,
    RecordIn,
    checksum,
    decode_chunk_header,
    encode_chunk_parts,
    iter_records,
)
from dlcachefs.store.index import Index
from dlcachefs.store.integrity import log_failure
from dlcachefs.store.logs import LogStore
from dlcachefs.store.schema import Chunk, Record
from dlcachefs.store.seal import NewChunk, NewRecord, seal_chunks

log = logging.getLogger(__name__)

T = TypeVar("T")

#: after a failed append (disk full), how long to serve from the source before retrying
WRITE_BACKOFF = 30.0


@dataclass(slots=True)
class Pending:
    """A fetched file waiting to be sealed into a chunk."""

    ino: int
    key: bytes
    ident: Identity
    data: bytes
    target: int = 0  # bytes of the unit it goes into (the policy's pack answer)
    unit: int = 0  # nonzero: member of a package submitted whole (one unit per tag)
    sha256: bytes | None = None  # its content key, when the fetch computed it already

    @property
    def encoded_len(self) -> int:
        return RECORD_HEADER_SIZE + len(self.key) + len(self.data)

    @property
    def charge(self) -> int:
        """What it may cost in chunk bytes: its record, and a chunk header at most."""
        return self.encoded_len + CHUNK_HEADER_SIZE


#: (inode, relative path, identity, bytes) of a record read back before its eviction
Evicted = tuple[int, bytes, Identity, bytes]


class LastCopyKeeper(Protocol):
    """Who keeps evicted records in the cluster (the peer tier; see the module doc).
    Both on the trio loop, neither blocks."""

    def room(self) -> int:
        """Bytes of evicted records it accepts now (0: none; they are not read)."""

    def keep(self, records: list[Evicted], unread: int) -> None:
        """Make sure each record's owner holds it, in the background; ``unread``: the
        current records of the victims left unread for lack of room (counted)."""


@dataclass(slots=True)
class _Result:
    written: tuple[int, int, int] | None = None  # (log id, offset, length)
    indexed: list[int] = field(default_factory=list)
    chunks: list[tuple[int, tuple[int, ...], int]] = field(default_factory=list)  # id, members, len
    evicted: list[Chunk] = field(default_factory=list)
    error: OSError | None = None
    disk_free: int = 0
    kept: list[Evicted] = field(default_factory=list)  # victims' records read back
    unread: int = 0  # victims' current records not read back (no room)
    dead: list[int] = field(default_factory=list)  # chunks left holding no record


class AccountLimit:
    """The limit of the ``--cache-size`` account, read by the chunk writer (which keeps
    the account within it) and by the policy's view of the cache (``capacity()``, see
    :class:`~dlcachefs.cache.views.IndexCacheView`): one number, moved at run time only
    through :meth:`ChunkWriter.set_limit` (a shared root's share). Calling it reads it."""

    __slots__ = ("value",)

    def __init__(self, value: int) -> None:
        self.value = value

    def __call__(self) -> int:
        return self.value


class ChunkWriter:
    """Packs fetched records into chunks (the policy's units), seals and indexes them, and
    keeps the ``--cache-size`` account (see the module docstring)."""

    def __init__(self, cfg: Config, index: Index, logs: LogStore, policy, memtier: MemoryTier,
                 counters: Counters, *, limit: AccountLimit | None = None,
                 unit_basis: int | None = None, keeper: LastCopyKeeper | None = None,
                 content_keys: bool = False,
                 after_commit: Callable[[ChunkWriter], None] | None = None) -> None:
        """``limit``: the account's limit, shared with the policy's view of the cache
        (default: ``--cache-size``, alone). ``unit_basis``: the cache size units are cut
        for (default ``--cache-size``; with ``--shared-cache`` the smallest share a
        dataset may get). ``keeper``, ``content_keys``, ``after_commit``: see their
        attributes."""
        self.cfg = cfg
        self._limit = limit if limit is not None else AccountLimit(cfg.cache_size)
        self.index = index
        self.logs = logs
        self.policy = policy
        self.memtier = memtier
        self.counters = counters
        self.open: list[Pending] = []
        self.open_bytes = 0
        self.open_since = 0.0
        self.sealing_bytes = 0
        self.committing = False  # a seal's commit is running in its thread
        self.pending: dict[int, Pending] = {}  # ino -> record not yet indexed
        self.drops: set[int] = set()
        self.retire: set[int] = set()  # indexed chunks to evict once unpinned (superseded)
        # indexed chunks known to hold no record (all moved or stale): retired whenever
        # not protected, however long that takes (chunks_superseded counts them)
        self._held_nothing: set[int] = set()
        # chunks of a next epoch's log, and of the current epoch's log until read (a cache
        # too small for the dataset): never the policy's victims
        self.protected: set[int] = set()
        self.pins: Counter[int] = Counter()  # chunk id -> in-flight reads
        self.evicting: set[int] = set()  # not served any more: doomed or being dropped
        # the --cache-size account (module docstring): all of it on the trio loop
        self.used = index.counter(S.K_CHUNK_BYTES)
        self.doomed: dict[int, int] = {}  # chunk id -> length, dropped by the next commit
        self.doomed_bytes = 0
        self.open_charge = 0  # sum of Pending.charge over self.open
        self.reserved = 0  # chunks written outside this writer (reorderer), not indexed yet
        #: the largest unit: half the cache, so that evicting one unit makes room for the next
        basis = cfg.cache_size if unit_basis is None else unit_basis
        self.max_unit = max(basis // 2, 1)
        #: --chunk-size, cut to an eighth of the cache when the cache is small (at least
        #: 4K, at most max_unit): evicting one chunk should not empty half the cache
        self.chunk_target = min(cfg.chunk_size, self.max_unit, max(basis // 8, 4096))
        self.commits = 0  # commits in flight (index counters may be ahead of the mirror)
        #: called with this writer on the loop after every commit, under the limiter
        #: (--debug-invariants: :func:`dlcachefs.cache.invariants.check_after_commit`)
        self.after_commit = after_commit
        #: keeps victims' records in the cluster (``--peers``; the module docstring)
        self.keeper = keeper
        self.backoff_until = 0.0
        #: failed seals in a row, and when the loop may try again (:meth:`_loop`)
        self._seal_failures = 0
        self._seal_retry_at = 0.0
        self.backoff_reason: str | None = None  # why caching pauses until backoff_until
        #: index every record with its SHA-256 and offer it to the other datasets of a
        #: shared root (``--shared-cache`` dedup, :mod:`dlcachefs.cache.dedup`); hashed in
        #: the commit's thread unless the fetch hashed it already
        self.content_keys = content_keys
        self.disk_free = _free_bytes(cfg.cache_dir)
        self._limiter = trio.CapacityLimiter(1)
        self._wake = trio.Event()
        self._closing = False
        self._running = False
        self._idle = trio.Event()
        self._space = trio.Event()  # set whenever a seal finished (room for more records)
        # open records by unit target size; a group at its target makes a seal due
        self._group_bytes: dict[int, int] = {}
        self._full = False
        self._package_tag = 0
        # past every chunk indexed too, as log ids past every log file: a sequence counter
        # damaged on disk (a flipped bit the index's structural check cannot see) gave a
        # new chunk the id of an indexed one; indexing it replaced that chunk's entry while
        # its log kept counting its bytes, and a later eviction by that id deleted the new
        # chunk's log under its entry (the chaos suite's damage scenario, 3 in 17 runs)
        self._next_chunk = max(1, _meta_u64(index, S.K_NEXT_CHUNK), index.last_chunk_id() + 1)
        self._next_log = max(1, _meta_u64(index, S.K_NEXT_LOG), max(logs.log_ids(), default=0) + 1)

    # ----- called from the read path (trio loop) -------------------------------------


    @property
    def limit(self) -> int:
        """The limit of the account (rule A): ``--cache-size``, or this dataset's share
        of a shared root's budget, changed at run time by :meth:`set_limit` only."""
        return self._limit.value

    @limit.setter
    def limit(self, value: int) -> None:
        self._limit.value = value

    def submit(self, ino: int, key: bytes, ident: Identity, data: bytes,
               sha256: bytes | None = None) -> bool:
        """Queue a fetched file for caching. False when it is not cached (and why is counted).
        ``sha256``: the bytes' digest, when the caller has it (see :attr:`content_keys`)."""
        p = self.pending.get(ino)
        if p is not None:
            if p.ident == ident:
                return True
            # another version of it is waiting for its chunk: a second open record of
            # one inode would leave the first unreadable from pending, and the two could
            # be indexed in either order. Not cached now (nor the older one: the seal
            # skips a record whose version is no longer listed): the next open fetches
            # this version and caches it.
            self.counters.cache_skipped += 1
            return False
        if self._closing or time.monotonic() < self.backoff_until:
            self.counters.cache_skipped += 1
            return False
        target = unit_target(self.policy, ino, len(data))
        target = self.chunk_target if target == PACK_CHUNK else min(target, self.max_unit)
        rec = Pending(ino, key, ident, data, target, sha256=sha256)
        # bounded memory: one chunk filling, one being sealed, and a little slack
        if self.open_bytes + self.sealing_bytes + rec.encoded_len > 3 * self.cfg.chunk_size and (
                self.open or self.sealing_bytes):
            self.counters.cache_skipped += 1
            return False
        # bounded disk: its bytes are reserved now, or it is not cached
        if not self.try_reserve(rec.charge):
            self.counters.cache_skipped += 1
            return False
        self.open_charge += rec.charge
        self.reserved -= rec.charge  # counted as open_charge from here on
        if not self.open:
            self.open_since = time.monotonic()
        self.open.append(rec)
        self.open_bytes += rec.encoded_len
        self.pending[ino] = rec
        group = self._group_bytes.get(rec.target, 0) + rec.encoded_len
        self._group_bytes[rec.target] = group
        if group >= rec.target or self.open_bytes >= self.chunk_target:
            self._full = True
            self._wake.set()
        return True

    def submit_package(self, recs: list[tuple[int, bytes, Identity, bytes]]) -> bool:
        """Queue ``(ino, key, identity, data)`` records to be sealed at once as ONE unit
        (a package the core built; iCACHE III-C). All or nothing: False (counted) when
        caching pauses or too much is queued already."""
        # a member already waiting here (this version or another one, which would leave
        # two open records for one inode) stays out of the package
        recs = [r for r in recs if r[0] not in self.pending]
        if not recs:
            return False
        if self._closing or time.monotonic() < self.backoff_until:
            self.counters.cache_skipped += len(recs)
            return False
        self._package_tag += 1
        tag = self._package_tag
        pend = [Pending(ino, key, ident, data, 0, tag) for ino, key, ident, data in recs]
        total = sum(r.encoded_len for r in pend)
        # bounded memory as in submit, with room for one package larger than the chunks
        if self.open_bytes + self.sealing_bytes + total > 3 * max(self.cfg.chunk_size, total) \
                and (self.open or self.sealing_bytes):
            self.counters.cache_skipped += len(recs)
            return False
        # bounded disk: the whole package's bytes are reserved now (one unit, one chunk
        # header), dooming the policy's victims if needed, or it is not cached
        charge = CHUNK_HEADER_SIZE + total
        if charge > self.max_unit or not self.try_reserve(charge):
            self.counters.cache_skipped += len(recs)
            return False
        # the account charges each open record its own header: the package's one header
        # is carried by its first member (open_charge == sum of the open records' charge)
        extra = sum(r.charge for r in pend) - charge
        if extra > 0 and not self.try_reserve(extra):
            self.unreserve(charge)
            self.counters.cache_skipped += len(recs)
            return False
        charge += max(extra, 0)
        self.open_charge += charge
        self.reserved -= charge  # counted as open_charge from here on
        if not self.open:
            self.open_since = time.monotonic()
        for r in pend:
            r.target = total
            self.open.append(r)
            self.pending[r.ino] = r
        self.open_bytes += total
        self._full = True  # complete on arrival: seal it now
        self._wake.set()
        return True

    async def sealed(self) -> None:
        """Wait for the next seal to finish (its records indexed, skipped or dropped)."""
        await self._space.wait()

    def has_room(self, nbytes: int = 0) -> bool:
        """Room for ``nbytes`` more without passing two chunks' worth in memory (and always
        room for one record when nothing is queued, however large it is). Chunks are cut to
        a fraction of the cache when it is small, so a reader waits for a seal rather than
        find the whole cache reserved by records still in memory."""
        queued = self.open_bytes + self.sealing_bytes
        return queued == 0 or queued + nbytes <= 2 * self.chunk_target

    async def wait_room(self, nbytes: int = 0) -> None:
        """Backpressure (prefetch, files fetched for readers): wait until ``nbytes`` more would fit."""
        while not self.has_room(nbytes) and not self._closing:
            self._wake.set()
            await self._space.wait()

    def reserve_chunk_ids(self, n: int) -> int:
        """Chunk ids for chunks written outside this writer (the reorderer)."""
        first = self._next_chunk
        self._next_chunk += n
        return first

    def reserve_log_id(self) -> int:
        lid = self._next_log
        self._next_log += 1
        return lid

    def retire_chunk(self, chunk_id: int, empty: bool = False) -> None:
        """A chunk released after use, or (``empty``) one that holds no record any more
        (all moved elsewhere, or dropped as stale): evict it at the next seal. A
        protected chunk is not evicted this way; an empty one waits until it is not."""
        # several paths release the same chunk (after use, when its plan ends, when its
        # records moved): one that is gone already is not retired again, or it would be
        # doomed with no bytes to give back (retire holds indexed chunks only)
        if self.index.get_chunk(chunk_id) is None:
            return
        if empty:
            self._held_nothing.add(chunk_id)
        self.retire.add(chunk_id)
        self._wake.set()

    # ----- the --cache-size account (trio loop; see the module docstring) ----------------

    @property
    def pending_bytes(self) -> int:
        """Bytes that will become chunk bytes through work already accepted (rule A)."""
        return self.open_charge + self.sealing_bytes + self.reserved

    def room(self) -> int:
        """Bytes that may still be reserved without dooming anything."""
        return self.limit - self.account()

    def reclaimable(self) -> int:
        """Bytes a reservation could have now without the policy's victims: the free room
        and the retired chunks not yet doomed (released after use, superseded)."""
        skip = set(self.pins) | self.protected | set(self.doomed)
        return max(0, self.room()) + sum(self._length(c) for c in self.retire
                                         if c not in skip)

    def account(self) -> int:
        """The bytes rule A holds below :attr:`limit`: ``used - doomed + pending``."""
        return self.used - self.doomed_bytes + self.pending_bytes

    def try_reserve(self, nbytes: int) -> bool:
        """Reserve ``nbytes`` of future chunk bytes, dooming victims of the policy when the
        room is short (all or nothing). False, and nothing doomed, when it cannot be done:
        more than :attr:`max_unit` for one record is fine, more than the cache is not."""
        if nbytes > self.limit:
            return False
        short = nbytes - self.room()
        if short > 0 and not self._make_room(short):
            return False
        self.reserved += nbytes
        return True

    def _make_room(self, short: int, partial: bool = False) -> bool:
        """Doom victims (superseded chunks first, then the policy's) for ``short`` bytes;
        all or nothing unless ``partial`` (then whatever the policy gives up is doomed).
        Whether ``short`` bytes were freed."""
        if short > 0:
            # superseded chunks go first (they were to be evicted at the next seal anyway)
            chosen = [c for c in self.retire
                      if c not in self.pins and c not in self.protected and c not in self.doomed]
            sizes = {c: self._length(c) for c in chosen}
            freed = sum(sizes.values())
            if freed < short:
                more = self.policy.victims(short - freed, exclude=(
                    set(self.pins) | self.protected | set(self.doomed) | self.evicting
                    | set(chosen)))
                more = [c for c in more if c not in sizes]
                sizes.update((c, self._length(c)) for c in more)
                chosen += more
                freed = sum(sizes.values())
            if freed < short and not partial:
                return False  # everything pinned or protected, or too little to give up
            for c in chosen:
                self._doom(c, sizes[c])
            self.retire.difference_update(chosen)
            self._wake.set()  # the next commit drops them
            return freed >= short
        return True

    def set_limit(self, limit: int) -> int:
        """Change :attr:`limit` (a shared root's share moved, :mod:`dlcachefs.cache.shares`).
        Growing is immediate. Shrinking dooms the policy's victims first, so that rule A
        holds for the new limit at once; what cannot be doomed now (pinned chunks, records
        in flight) keeps the limit at the account, above ``limit``, and a later call goes
        on. The doomed chunks leave the disk with the next commit (:meth:`drop_doomed`).
        Returns the limit now enforced. Trio loop."""
        limit = max(0, limit)
        if limit < self.limit:
            self._make_room(self.account() - limit, partial=True)
            limit = max(limit, self.account())
        grew = limit > self.limit
        self.limit = limit
        if grew:  # waiting readers and prefetchers may find room now
            self._space.set()
            self._space = trio.Event()
        return self.limit

    async def drop_doomed(self) -> None:
        """Commit the drop of every chunk doomed so far (after a shrink: then the index,
        and the disk, hold no more than :attr:`limit`). Waits for a commit in flight."""
        async with self._limiter:
            await self._drop_doomed_locked()

    def unreserve(self, nbytes: int) -> None:
        """Give back a reservation whose bytes will not land (a plan given up)."""
        self.reserved -= nbytes
        self._space.set()
        self._space = trio.Event()

    def _length(self, chunk_id: int) -> int:
        c = self.index.get_chunk(chunk_id)
        return c.length if c is not None else 0

    def _doom(self, chunk_id: int, length: int) -> None:
        self.doomed[chunk_id] = length
        self.doomed_bytes += length
        self.evicting.add(chunk_id)
        self.memtier.discard(chunk_id)

    def _take_doomed(self) -> list[int]:
        """Every doomed chunk, for the commit about to run (under the limiter)."""
        return list(self.doomed)

    def _keep_room(self, victims: list[int]) -> int:
        """Bytes of the victims' records the commit may read back for the keeper."""
        if self.keeper is None or not victims:
            return 0
        return max(0, self.keeper.room())

    def _committed(self, res: _Result, victims: list[int], added: int) -> None:
        """Loop bookkeeping of a commit that returned: the mirror follows the index."""
        if self.keeper is not None and (res.kept or res.unread):
            self.keeper.keep(res.kept, res.unread)
        self.used += added - sum(c.length for c in res.evicted)
        for v in victims:
            n = self.doomed.pop(v, None)
            if n is not None:
                self.doomed_bytes -= n
            self.evicting.discard(v)
        for c in res.evicted:
            self.policy.on_remove(c.chunk_id)
            self.retire.discard(c.chunk_id)  # evicted as a victim while it waited there
            if c.chunk_id in self._held_nothing:
                self._held_nothing.discard(c.chunk_id)
                self.counters.chunks_superseded += 1
        self.counters.chunks_evicted += len(res.evicted)
        self.disk_free = res.disk_free
        # chunks whose last records were dropped (stale: their files changed) or replaced
        # by newer versions hold nothing any open can read: retired at the next seal.
        # (They stayed until the policy evicted them, which a cache with room never did:
        # a dataset changing between epochs left 28 of 49 chunks, 27.5 MB, holding no
        # record.)
        for cid in res.dead:
            self.retire_chunk(cid, empty=True)

    def shrink_to_limit(self) -> None:
        """A cache over ``--cache-size`` (mounted again with a smaller one): doom victims
        of the policy down to the limit; the writer's first commit drops them."""
        if self.room() < 0:
            self.try_reserve(0)

    async def commit_external(self, nbytes: int, fn: Callable[..., T], *args: object) -> T:
        """Run ``fn(*args)`` in a thread: it indexes ``nbytes`` of chunks written outside
        this writer (the reorderer's seal), reserved with :meth:`try_reserve`. Serialized
        with this writer's commits (rule B): the doomed chunks are dropped first, in their
        own transaction. On return the reservation has become chunk bytes; if ``fn``
        raises, the caller still holds it (and gives it back with :meth:`unreserve`)."""
        async with self._limiter:
            await self._drop_doomed_locked()
            self.commits += 1
            try:
                out = await trio.to_thread.run_sync(fn, *args)
            finally:
                self.commits -= 1
            self.reserved -= nbytes
            self.used += nbytes
            if self.after_commit is not None:
                self.after_commit(self)
            return out

    async def _drop_doomed_locked(self) -> None:
        victims = self._take_doomed()
        if not victims:
            return
        self.commits += 1
        try:  # on an error they stay doomed (not served) for the next commit to drop
            res = await trio.to_thread.run_sync(self._commit, 0, [], victims, set(), None,
                                                self._keep_room(victims))
        finally:
            self.commits -= 1
        self._committed(res, victims, 0)

    def drop(self, ino: int) -> None:
        """Forget the cached record of ``ino`` at the next commit (stale or corrupt)."""
        self.drops.add(ino)
        self._wake.set()

    def pin(self, chunk_id: int) -> bool:
        """Keep a chunk from eviction while it is read. False if it is being evicted."""
        if chunk_id in self.evicting:
            return False
        self.pins[chunk_id] += 1
        return True

    def unpin(self, chunk_id: int) -> None:
        self.pins[chunk_id] -= 1
        if self.pins[chunk_id] <= 0:
            del self.pins[chunk_id]
            if chunk_id in self.retire:
                self._wake.set()  # retired while pinned: the next seal evicts it

    # ----- the task ------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Seal chunks as they fill or age, until :meth:`close`."""
        task_status.started()
        self._running = True
        try:
            await self._loop()
        finally:
            self._running = False

    def _pause(self, reason: str) -> None:
        self.backoff_until = time.monotonic() + WRITE_BACKOFF
        self.backoff_reason = reason

    def disk_state(self) -> dict:
        """The cache disk as caching sees it (``cache_disk`` in stats): free bytes at the
        last commit, the ``--min-free`` floor, whether the floor is reached (new files are
        then cached only in the room evictions free), and a pause after a failed write
        (``paused_s`` left, and why)."""
        left = self.backoff_until - time.monotonic()
        return {"free_bytes": self.disk_free, "min_free_bytes": self.cfg.min_free,
                "below_min_free": self.cfg.min_free > 0 and self.disk_free < self.cfg.min_free,
                "paused_s": round(left, 1) if left > 0 else 0,
                "paused_reason": self.backoff_reason if left > 0 else None}

    def short_of_disk(self) -> str | None:
        """Why the cache disk keeps new files out now, or None: a pause after a failed
        write, or free space under ``--min-free``."""
        d = self.disk_state()
        if d["paused_s"]:
            return f"caching is paused for {d['paused_s']:.0f} s: {d['paused_reason']}"
        if d["below_min_free"]:
            return (f"the cache disk has {d['free_bytes']:,} bytes free, under --min-free "
                    f"({d['min_free_bytes']:,})")
        return None

    async def _loop(self) -> None:
        while True:
            with trio.move_on_after(max(0.05, self.cfg.flush_interval / 4)):
                await self._wake.wait()
            self._wake = trio.Event()
            aged = self.open and time.monotonic() - self.open_since >= self.cfg.flush_interval
            if (self._closing or self._full or aged or self.drops or self.retire
                    or self.doomed):
                if not self._closing and time.monotonic() < self._seal_retry_at:
                    continue  # after a failed seal: its drops wait, no retry storm
                try:
                    await self._seal()
                    self._seal_failures = 0
                except Exception:  # noqa: BLE001 - LMDB full, statvfs failing...: keep serving
                    log_failure(log, "sealing a chunk failed; serving from the source for %.0f s",
                                WRITE_BACKOFF)
                    self.counters.write_errors += 1
                    self._pause("sealing a chunk failed (see the log)")
                    for r in self.open:
                        self.policy.on_dropped(r.ino)
                    self.open, self.open_bytes, self.open_charge = [], 0, 0
                    self._group_bytes, self._full = {}, False
                    self.pending.clear()
                    self._space.set()
                    self._space = trio.Event()
                    # drops, evictions and retired chunks stay queued: retried after 0.5 s,
                    # doubling up to the pause (a damaged page fails every retry: seed 1005
                    # of the damage scenario logged one every 50 ms, and its stop never ended)
                    self._seal_failures += 1
                    self._seal_retry_at = time.monotonic() + min(
                        WRITE_BACKOFF, 0.5 * 2 ** (self._seal_failures - 1))
                    if self._closing:
                        # the stop must end: what was not committed stays as the index has
                        # it (the next start recovers from that)
                        self._idle.set()
                        return
            if self._closing and not self.open and not self.drops:
                self._idle.set()
                return

    async def close(self) -> None:
        """Seal what is open and stop the task (used at unmount)."""
        self._closing = True
        if not self._running:  # the task is gone (cancelled): seal here
            await self.flush()
            return
        self._wake.set()
        await self._idle.wait()

    async def flush(self) -> None:
        """Seal and commit everything queued so far (tests and clean shutdown)."""
        if self.open or self.drops or self.doomed or self.retire:
            await self._seal(force=True)
        async with self._limiter:  # FIFO: returns once any commit in flight is done
            pass

    async def _seal(self, force: bool = False) -> None:
        # One seal at a time, from planning to bookkeeping: a plan made while another
        # seal's commit is in flight would see stale chunk_bytes and could choose the
        # same victims again, and the cache would outgrow --cache-size.
        async with self._limiter:
            await self._seal_locked(force)

    async def _seal_locked(self, force: bool = False) -> None:
        if not self.open and not self.drops and not self.retire and not self.doomed:
            return
        records, drops = self._take_batch(force)
        charged = sum(r.charge for r in records)
        # a record already indexed for the same version (moved by the reorderer meanwhile)
        # would only be a dead copy in a chunk nobody reads
        kept = []
        for r in records:
            if self._indexed(r):
                self.policy.on_dropped(r.ino)
            else:
                kept.append(r)
        records = kept
        groups = _units(records, self.max_unit)
        new_len = sum(CHUNK_HEADER_SIZE + sum(r.encoded_len for r in g) for g in groups)
        # superseded chunks go now (release after use); pinned ones wait for a later
        # seal; a protected (epoch log) chunk is never given up this way
        self.retire -= self.protected
        for c in [c for c in self._held_nothing if c not in self.protected]:
            if self.index.get_chunk(c) is None:  # (dropped meanwhile, by a victim's path)
                self._held_nothing.discard(c)
            else:  # (an empty chunk protected when its last record went: now it is not)
                self.retire.add(c)
        for c in [c for c in self.retire if c not in self.pins]:
            self.retire.discard(c)
            if c not in self.doomed:
                self._doom(c, self._length(c))
        write = bool(records)
        if records and self.cfg.min_free > 0:
            # the free-space floor on the cache disk (--cache-size was reserved at submit)
            need = self.cfg.min_free - (self.disk_free + self.doomed_bytes - new_len)
            if need > 0:
                chosen = self.policy.victims(need, exclude=(
                    set(self.pins) | self.protected | set(self.doomed) | self.evicting))
                freed = sum(self._length(c) for c in chosen)
                if freed < need:
                    # cannot make room on the disk (everything pinned): not cached
                    write = False
                    self.counters.cache_skipped += len(records)
                else:
                    for c in chosen:
                        self._doom(c, self._length(c))
        victims = self._take_doomed()
        cid = self._next_chunk
        if write:
            self._next_chunk += len(groups)
        # the charges of these records become the exact length of their chunks
        self.open_charge -= charged
        if write:
            self.sealing_bytes += new_len
        self._space.set()  # charges given back (the cut records, the header estimates)
        self._space = trio.Event()
        self.committing = True
        self.commits += 1
        res: _Result | None = None
        try:
            new_log = None
            if write and self.logs.needs_new_log(new_len):  # no commit runs now: safe to read
                new_log = self.reserve_log_id()
            res = await trio.to_thread.run_sync(self._commit, cid, groups if write else [],
                                                victims, drops, new_log,
                                                self._keep_room(victims))
        finally:
            self.committing = False
            self.commits -= 1
            if write:
                self.sealing_bytes -= new_len
            if res is None:  # the commit raised: nothing of it happened (doomed stay doomed)
                for r in records:
                    if self.pending.get(r.ino) is r:
                        del self.pending[r.ino]
                    self.policy.on_dropped(r.ino)
        self.drops -= drops  # committed: the index no longer has those records
        self._committed(res, victims, sum(length for _, _, length in res.chunks))
        if res.error is not None or not write:
            for r in records:
                self.policy.on_dropped(r.ino)
        if res.error is not None:
            self.counters.write_errors += 1
            self.counters.cache_skipped += len(records)
            self._pause(f"cache write failed: {res.error}")
            log.warning("cache write failed (%s); serving from the source for %.0f s",
                        res.error, WRITE_BACKOFF)
        else:
            for chunk_id, members, length in res.chunks:
                self.policy.on_insert(chunk_id, members, length)
                self.counters.chunks_written += 1
        for r in records:
            if self.pending.get(r.ino) is r:
                del self.pending[r.ino]
        self._space.set()
        self._space = trio.Event()
        if self.after_commit is not None:
            self.after_commit(self)

    def _indexed(self, r: Pending) -> bool:
        """Whether the index already holds ``r``'s version (then it is pending no more)."""
        if not record_is_current(r.ino, self.index.get_record(r.ino), r.ident, self.drops):
            return False
        if self.pending.get(r.ino) is r:
            del self.pending[r.ino]
        return True

    def _take_batch(self, force: bool = False) -> tuple[list[Pending], set[int]]:
        """The records to seal now: every group, when aged or closing; else the groups
        at their target size (a package is not sealed short because another filled)."""
        aged = self.open and time.monotonic() - self.open_since >= self.cfg.flush_interval
        # with only chunk-size groups (lru), any seal takes everything open, as it always did
        if (force or aged or self._closing or self.open_bytes >= self.chunk_target
                or set(self._group_bytes) <= {self.chunk_target}):
            records, self.open, self.open_bytes = self.open, [], 0
            self._group_bytes = {}
        else:
            full = {t for t, b in self._group_bytes.items() if b >= t}
            # a package (unit tag) is complete on arrival: always taken
            records = [r for r in self.open if r.unit or r.target in full]
            self.open = [r for r in self.open if not r.unit and r.target not in full]
            self.open_bytes = sum(r.encoded_len for r in self.open)
            for t in full:
                del self._group_bytes[t]
        self._full = False
        # drops stay in self.drops until their commit is done (see _seal_locked): the read
        # path must keep ignoring those records while the index still has them
        return records, set(self.drops)

    # ----- worker thread -------------------------------------------------------------

    def _commit(self, cid: int, groups: list[list[Pending]], victims: list[int],
                drops: set[int], new_log: int | None, keep_room: int = 0) -> _Result:
        """Thread: the groups as consecutive chunks ``cid, cid+1, ...`` in ONE append (one
        fdatasync), then one LMDB transaction indexes them and drops the victims (whose
        current records are read back first, up to ``keep_room`` bytes, for the keeper)."""
        res = _Result()
        if keep_room > 0:
            res.kept, res.unread = self._read_victims(victims, drops, keep_room)
        encoded = []
        for k, g in enumerate(groups):
            encoded.append(encode_chunk_parts(cid + k, [
                RecordIn(r.ino, r.key, r.ident.mtime_ns, r.ident.src_ino, r.data) for r in g]))
        if encoded:
            parts = [b for chunk_parts, _, _ in encoded for b in chunk_parts]
            total = sum(n for _, _, n in encoded)
            try:
                if new_log is not None:
                    self.logs.start_log(new_log)
                log_id, off = self.logs.append(parts)
                res.written = (log_id, off, total)
            except OSError as e:
                res.error = e
        new: list[NewChunk] = []
        if res.written is not None:
            log_id, off, _ = res.written
            for k, (g, (_, metas, length)) in enumerate(zip(groups, encoded, strict=True)):
                recs = [NewRecord(r.ino, r.ident, Record(cid + k, log_id, off + m.data_offset,
                                                         m.size, m.data_xxh, m.mtime_ns,
                                                         m.src_ino),
                                  self._sha256(r))
                        for m, r in zip(metas, g, strict=True)]
                members = tuple(r.ino for r in g)
                new.append(NewChunk(Chunk(cid + k, log_id, off, length, time.time_ns(),
                                          members), recs))
                res.chunks.append((cid + k, members, length))
                off += length
        # keep_indexed: a record of the same version indexed elsewhere meanwhile was put
        # there by the reorderer, in the next epoch's order: this copy is the one to waste.
        sealed = seal_chunks(self.index, new, keep_indexed=True, victims=victims, drops=drops,
                             new_log=new_log)
        res.indexed, res.evicted, res.dead = sealed.indexed, sealed.evicted, sealed.dead
        for c in res.evicted:
            self.logs.release(c.log_id, c.offset, c.length)
        res.disk_free = _free_bytes(self.cfg.cache_dir)
        return res


    def _sha256(self, r: Pending) -> bytes | None:
        """Thread: the record's content key, when records are keyed (:attr:`content_keys`)."""
        if not self.content_keys:
            return None
        return r.sha256 if r.sha256 is not None else hashlib.sha256(r.data).digest()

    def _read_victims(self, victims: list[int], drops: set[int], room: int
                      ) -> tuple[list[Evicted], int]:
        """Thread (the commit's, before it drops them): the victims' records that the
        index still serves from them, checked, up to ``room`` bytes; and how many such
        records were left unread. A chunk that cannot be read is skipped (its records
        are then not kept: speed, never an error)."""
        kept: list[Evicted] = []
        unread = 0
        for chunk_id in victims:
            c = self.index.get_chunk(chunk_id)
            if c is None:
                continue
            current = [r for ino in c.members if ino not in drops
                       and (r := self.index.get_record(ino)) is not None
                       and r.chunk_id == chunk_id]
            if not current:
                continue  # nothing of it is the last copy of anything: not read
            if all(r.size > room for r in current):
                # none of it fits what room is left: counted from the index, not read
                unread += len(current)
                continue
            try:
                buf = memoryview(self.logs.read(c.log_id, c.offset, c.length))
                header = decode_chunk_header(buf)
                metas = list(iter_records(buf, header))
            except Exception as e:  # noqa: BLE001 - a damaged victim is dropped anyway
                log.debug("eviction: chunk %d not read back: %r", chunk_id, e)
                continue
            for m in metas:
                rec = self.index.get_record(m.ino)
                if m.ino in drops or rec is None or rec.chunk_id != chunk_id:
                    continue  # stale, dropped, or served from elsewhere: not the last copy
                if m.size > room:
                    unread += 1
                    continue
                data = buf[m.data_offset:m.data_offset + m.size]
                if checksum(data) != m.data_xxh:
                    continue
                room -= m.size
                kept.append((m.ino, bytes(m.key), Identity(m.size, m.mtime_ns, m.src_ino),
                             bytes(data)))
        return kept, unread


def _units(records: list[Pending], max_unit: int | None = None) -> list[list[Pending]]:
    """Records grouped into units: a package (unit tag) whole; else by target, a
    target-0 record alone, and a group cut where it reaches its target (a seal may take
    more than one target's worth), or before a record that would take its chunk past
    ``max_unit`` bytes (a record larger than that is a unit of its own)."""
    out: list[list[Pending]] = []
    by_target: dict[int, list[Pending]] = {}
    sizes: dict[int, int] = {}
    packages: dict[int, list[Pending]] = {}
    for r in records:
        if r.unit:  # a package submitted whole: one unit, never cut
            packages.setdefault(r.unit, []).append(r)
            continue
        if r.target <= 0:
            out.append([r])
            continue
        g = by_target.setdefault(r.target, [])
        if g and max_unit is not None and (
                CHUNK_HEADER_SIZE + sizes[r.target] + r.encoded_len > max_unit):
            out.append(g)
            g = by_target[r.target] = []
            sizes[r.target] = 0
        g.append(r)
        sizes[r.target] = sizes.get(r.target, 0) + r.encoded_len
        if sizes[r.target] >= r.target:
            out.append(g)
            by_target[r.target], sizes[r.target] = [], 0
    out.extend(g for g in by_target.values() if g)
    out.extend(packages.values())
    return out


def _meta_u64(index: Index, key: bytes) -> int:
    v = index.get_meta(key)
    return int.from_bytes(v, "little") if v else 0


def _free_bytes(path: str) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
