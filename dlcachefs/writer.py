"""The chunk writer: packs fetched files into chunks, makes them durable, then indexes them.

Order of one seal (the crash-consistency argument):

1. choose victims on the trio loop (policy; pinned chunks excluded) and stop serving them;
2. in ONE worker thread: append the new chunks (the policy's units: one or several) to
   the active log in one write and ``fdatasync`` it; then one LMDB write transaction drops
   the victims' and dropped records and indexes the new records and chunks; commit (LMDB
   fsyncs); then punch the victims' holes.

So the index only ever points at bytes that were already durable, and never at a punched
range. A crash between the append and the commit leaves an unindexed tail, which
:meth:`LogStore.recover` cuts off at the next start.

Concurrency: every attribute is owned by the trio loop. The blocking commit runs in a
thread under a limiter of one, so appends to the active log are serial. Records waiting
to be sealed stay readable from :attr:`pending`.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import trio

from dlcachefs.policies.base import PACK_CHUNK

from . import schema as S
from .chunkfmt import CHUNK_HEADER_SIZE, RECORD_HEADER_SIZE, RecordIn, encode_chunk
from .config import Config
from .index import Index
from .logstore import LogStore
from .memtier import MemoryTier
from .namespace import identity
from .schema import Chunk, Record
from .source import Identity
from .stats import Counters

log = logging.getLogger(__name__)

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

    @property
    def encoded_len(self) -> int:
        return RECORD_HEADER_SIZE + len(self.key) + len(self.data)


@dataclass(slots=True)
class _Result:
    written: tuple[int, int, int] | None = None  # (log id, offset, length)
    indexed: list[int] = field(default_factory=list)
    chunks: list[tuple[int, tuple[int, ...], int]] = field(default_factory=list)  # id, members, len
    evicted: list[Chunk] = field(default_factory=list)
    error: OSError | None = None
    disk_free: int = 0


class ChunkWriter:
    def __init__(self, cfg: Config, index: Index, logs: LogStore, policy, memtier: MemoryTier,
                 counters: Counters) -> None:
        self.cfg = cfg
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
        self.retire: set[int] = set()  # chunks to evict once unpinned (fully superseded)
        self.protected: set[int] = set()  # next-epoch log chunks: never the policy's victims
        self.pins: Counter[int] = Counter()  # chunk id -> in-flight reads
        self.evicting: set[int] = set()
        self.backoff_until = 0.0
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
        self._next_chunk = max(1, _meta_u64(index, S.K_NEXT_CHUNK))
        self._next_log = max(1, _meta_u64(index, S.K_NEXT_LOG), max(logs.log_ids(), default=0) + 1)

    # ----- called from the read path (trio loop) -------------------------------------

    def submit(self, ino: int, key: bytes, ident: Identity, data: bytes) -> bool:
        """Queue a fetched file for caching. False when it is not cached (and why is counted)."""
        p = self.pending.get(ino)
        if p is not None and p.ident == ident:
            return True
        if self._closing or time.monotonic() < self.backoff_until:
            self.counters.cache_skipped += 1
            return False
        target = self.policy.pack(ino, len(data))
        rec = Pending(ino, key, ident, data,
                      self.cfg.chunk_size if target == PACK_CHUNK else target)
        # bounded memory: one chunk filling, one being sealed, and a little slack
        if self.open_bytes + self.sealing_bytes + rec.encoded_len > 3 * self.cfg.chunk_size and (
                self.open or self.sealing_bytes):
            self.counters.cache_skipped += 1
            return False
        if not self.open:
            self.open_since = time.monotonic()
        self.open.append(rec)
        self.open_bytes += rec.encoded_len
        self.pending[ino] = rec
        group = self._group_bytes.get(rec.target, 0) + rec.encoded_len
        self._group_bytes[rec.target] = group
        if group >= rec.target or self.open_bytes >= self.cfg.chunk_size:
            self._full = True
            self._wake.set()
        return True

    def submit_package(self, recs: list[tuple[int, bytes, Identity, bytes]]) -> bool:
        """Queue ``(ino, key, identity, data)`` records to be sealed at once as ONE unit
        (a package the core built; iCACHE III-C). All or nothing: False (counted) when
        caching pauses or too much is queued already."""
        recs = [r for r in recs if (p := self.pending.get(r[0])) is None or p.ident != r[2]]
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
        room for one record when nothing is queued, however large it is)."""
        queued = self.open_bytes + self.sealing_bytes
        return queued == 0 or queued + nbytes <= 2 * self.cfg.chunk_size

    async def wait_room(self, nbytes: int = 0) -> None:
        """Backpressure (prefetch, fast readers): wait until ``nbytes`` more would fit."""
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

    def retire_chunk(self, chunk_id: int) -> None:
        """A chunk whose records all moved elsewhere: evict it at the next seal."""
        self.retire.add(chunk_id)
        self._wake.set()

    async def make_room(self, nbytes: int) -> bool:
        """Evict (by the policy) so that ``nbytes`` more chunk bytes fit in --cache-size;
        for chunks written outside this writer (the reorderer). False if it cannot."""
        async with self._limiter:
            need = self.index.counter(S.K_CHUNK_BYTES) + nbytes - self.cfg.cache_size
            if need <= 0:
                return True
            victims = self.policy.victims(need, exclude=set(self.pins) | self.protected)
            freed = sum(c.length for c in map(self.index.get_chunk, victims) if c)
            for v in victims:
                self.evicting.add(v)
                self.memtier.discard(v)
            try:
                res = await trio.to_thread.run_sync(self._commit, 0, [], victims, set(), None)
            finally:
                self.evicting.difference_update(victims)
            for c in res.evicted:
                self.policy.on_remove(c.chunk_id)
            self.counters.chunks_evicted += len(res.evicted)
            self.disk_free = res.disk_free
            return freed >= need

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

    # ----- the task ------------------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Seal chunks as they fill or age, until :meth:`close`."""
        task_status.started()
        self._running = True
        try:
            await self._loop()
        finally:
            self._running = False

    async def _loop(self) -> None:
        while True:
            with trio.move_on_after(max(0.05, self.cfg.flush_interval / 4)):
                await self._wake.wait()
            self._wake = trio.Event()
            aged = self.open and time.monotonic() - self.open_since >= self.cfg.flush_interval
            if self._closing or self._full or aged or self.drops or self.retire:
                try:
                    await self._seal()
                except Exception:  # noqa: BLE001 - LMDB full, statvfs failing...: keep serving
                    log.exception("sealing a chunk failed; serving from the source for %.0f s",
                                  WRITE_BACKOFF)
                    self.counters.write_errors += 1
                    self.backoff_until = time.monotonic() + WRITE_BACKOFF
                    for r in self.open:
                        self.policy.on_dropped(r.ino)
                    self.open, self.open_bytes = [], 0
                    self._group_bytes, self._full = {}, False
                    self.pending.clear()
                    self._space.set()
                    self._space = trio.Event()
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
        if self.open or self.drops:
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
        if not self.open and not self.drops and not self.retire:
            return
        records, drops = self._take_batch(force)
        # a record already indexed for the same version (moved by the reorderer meanwhile)
        # would only be a dead copy in a chunk nobody reads
        kept = []
        for r in records:
            if self._indexed(r):
                self.policy.on_dropped(r.ino)
            else:
                kept.append(r)
        records = kept
        groups = _units(records)
        new_len = sum(CHUNK_HEADER_SIZE + sum(r.encoded_len for r in g) for g in groups)
        # superseded chunks go first (release after use); pinned ones wait for a later
        # seal; a next-epoch log chunk is never given up this way
        self.retire -= self.protected
        retired = [c for c in self.retire if c not in self.pins]
        self.retire.difference_update(retired)
        victims: list[int] = list(retired)
        write = bool(records)
        if records:
            retired_len = sum(c.length for c in map(self.index.get_chunk, retired) if c)
            used = self.index.counter(S.K_CHUNK_BYTES) - retired_len
            need = max(used + new_len - self.cfg.cache_size,
                       self.cfg.min_free - (self.disk_free + retired_len - new_len), 0)
            if need > 0:
                chosen = self.policy.victims(
                    need, exclude=set(self.pins) | set(retired) | self.protected)
                freed = sum(c.length for c in map(self.index.get_chunk, chosen) if c)
                if freed < need:
                    # cannot make room (everything pinned, or one chunk bigger than the cache)
                    chosen, write = [], False
                    self.counters.cache_skipped += len(records)
                victims += chosen
        for v in victims:
            self.evicting.add(v)
            self.memtier.discard(v)
        cid = self._next_chunk
        if write:
            self._next_chunk += len(groups)
        self.sealing_bytes += new_len
        self.committing = True
        try:
            new_log = None
            if write and self.logs.needs_new_log(new_len):  # no commit runs now: safe to read
                new_log = self.reserve_log_id()
            res = await trio.to_thread.run_sync(self._commit, cid, groups if write else [],
                                                victims, drops, new_log)
        finally:
            self.committing = False
            self.sealing_bytes -= new_len
            self.evicting.difference_update(victims)
        self.drops -= drops  # committed: the index no longer has those records
        self.disk_free = res.disk_free
        for c in res.evicted:
            self.policy.on_remove(c.chunk_id)
        self.counters.chunks_evicted += len(res.evicted)
        if res.error is not None or not write:
            for r in records:
                self.policy.on_dropped(r.ino)
        if res.error is not None:
            self.counters.write_errors += 1
            self.counters.cache_skipped += len(records)
            self.backoff_until = time.monotonic() + WRITE_BACKOFF
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

    def _indexed(self, r: Pending) -> bool:
        cur = self.index.get_record(r.ino)
        if cur is None or r.ino in self.drops:
            return False
        if Identity(cur.size, cur.mtime_ns, cur.src_ino) != r.ident:
            return False
        if self.pending.get(r.ino) is r:
            del self.pending[r.ino]
        return True

    def _take_batch(self, force: bool = False) -> tuple[list[Pending], set[int]]:
        """The records to seal now: every group, when aged or closing; else the groups
        at their target size (a package is not sealed short because another filled)."""
        aged = self.open and time.monotonic() - self.open_since >= self.cfg.flush_interval
        # with only chunk-size groups (lru), any seal takes everything open, as it always did
        if (force or aged or self._closing or self.open_bytes >= self.cfg.chunk_size
                or set(self._group_bytes) <= {self.cfg.chunk_size}):
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
                drops: set[int], new_log: int | None) -> _Result:
        """Thread: the groups as consecutive chunks ``cid, cid+1, ...`` in ONE append (one
        fdatasync), then one LMDB transaction indexes them and drops the victims."""
        res = _Result()
        encoded = []
        for k, g in enumerate(groups):
            encoded.append(encode_chunk(cid + k, [
                RecordIn(r.ino, r.key, r.ident.mtime_ns, r.ident.src_ino, r.data) for r in g]))
        if encoded:
            data = b"".join(d for d, _ in encoded)
            try:
                if new_log is not None:
                    self.logs.start_log(new_log)
                log_id, off = self.logs.append(data)
                res.written = (log_id, off, len(data))
            except OSError as e:
                res.error = e
        with self.index.write() as w:
            for v in victims:
                c = w.drop_chunk(v)
                if c is not None:
                    res.evicted.append(c)
            for ino in drops:
                w.drop_record(ino)
            if res.written is not None:
                log_id, off, _ = res.written
                for k, (g, (chunk, metas)) in enumerate(zip(groups, encoded, strict=True)):
                    for m, r in zip(metas, g, strict=True):
                        e = w.get_entry(r.ino)
                        if e is None or identity(e) != r.ident:
                            continue  # changed or removed while it waited: never index it
                        cur = w.get_record(r.ino)
                        if cur is not None and Identity(
                                cur.size, cur.mtime_ns, cur.src_ino) == r.ident:
                            continue  # indexed elsewhere (the reorderer moved it): keep that
                        w.put_record(r.ino, Record(cid + k, log_id, off + m.data_offset, m.size,
                                                   m.data_xxh, m.mtime_ns, m.src_ino))
                        res.indexed.append(r.ino)
                    members = tuple(r.ino for r in g)
                    w.put_chunk(Chunk(cid + k, log_id, off, len(chunk), time.time_ns(), members))
                    res.chunks.append((cid + k, members, len(chunk)))
                    off += len(chunk)
                w.bump(S.K_NEXT_CHUNK, cid + len(groups))
            if new_log is not None:
                w.bump(S.K_NEXT_LOG, new_log + 1)
        for c in res.evicted:
            self.logs.release(c.log_id, c.offset, c.length)
        res.disk_free = _free_bytes(self.cfg.cache_dir)
        return res


def _units(records: list[Pending]) -> list[list[Pending]]:
    """Records grouped into units: a package (unit tag) whole; else by target, a target-0
    record alone, and a group cut where it reaches its target (a seal may take more than
    one target's worth)."""
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
