"""The metaindex: an LMDB environment holding the namespace snapshot and the cache index.

Concurrency rule (py-lmdb's, and ours): read transactions are cheap and may be opened on
any thread, including the trio loop (a lookup is a few microseconds on memory-mapped
pages). A write transaction runs start to finish inside ONE call on a worker thread
(``trio.to_thread.run_sync``), never on the trio loop, because commit fsyncs; LMDB
serializes concurrent writers itself. Batch index updates: one write transaction per
sealed chunk or per directory refresh, never one per read.

Entries and records read outside a write transaction are kept in a memo of the current
snapshot (:meth:`Index.get_entry`, :meth:`Index.get_record`): a warm open, its GETATTR
and its release read the same few keys, and answer from a dict instead of a read
transaction each. The memo is good only while no write transaction has begun since its
values were read (:attr:`Index.generation` moves at every write's start and end; the
daemon is the index's only writer, and every write goes through :meth:`Index.write`), so
it never answers with an older version than LMDB would. Its objects are shared between
callers: never change one (``dataclasses.replace`` makes a changed copy).
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import lmdb

from dlcachefs.store import schema as S
from dlcachefs.store.modes import DIR_MODE
from dlcachefs.store.schema import Chunk, ContentKey, Entry, Record, dirent_key, ukey, unkey

_Q = struct.Struct("<Q")
_q = struct.Struct("<q")


def _counter_in(txn: lmdb.Transaction, db: lmdb._Database, key: bytes) -> int:
    v = txn.get(key, db=db)
    return _q.unpack(v)[0] if v is not None else 0

FIRST_INO = 16  # 1 is the root; 2..15 are reserved for the virtual .dlcache/ files

#: entries (and, apart, records) the memo of the current snapshot holds at most; emptied
#: when full (about 20 MB of objects; a working set larger than this still answers a
#: file's GETATTR and RELEASE from it, right after its open read it)
MEMO_MAX = 1 << 16

_ABSENT = object()  # not in the memo (None there: not in the index either)


class WriteGuard(Protocol):
    """What is told around each write transaction (its commit included)."""

    def before_write(self) -> None: ...

    def after_write(self, exc: BaseException | None = None) -> None: ...


class Index:
    """Typed access to the LMDB sub-databases described in :mod:`dlcachefs.store.schema`."""

    def __init__(self, path: str, map_size: int = 1 << 36) -> None:
        # owner-only whatever the umask (data.mdb and lock.mdb take LMDB's mode minus the
        # x bits); a reader group's bits are given by the daemon (store.modes.enforce)
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)
        self.path = path
        # the memo of the current snapshot (see the module docstring): its generation, and
        # per key (inode) the entry and the record, None for one the index does not hold
        self.generation = 0  # +1 when a write transaction begins, +1 when it has ended
        self._writers = 0  # write transactions under way (LMDB runs one at a time)
        self._gen_lock = threading.Lock()  # (the two move together, from any thread)
        self._write_lock = threading.Lock()  # a write transaction and its guard's checks
        #: checks around each write (the daemon's SoundFlag: integrity.hold_sound)
        self.guard: WriteGuard | None = None
        self._memo: tuple[int, dict[int, Entry | None], dict[int, Record | None]] = (0, {}, {})
        # reads of entries and records that needed a read transaction, and those the memo
        # answered (stats: index_reads, index_memo_hits; on any thread, so approximate)
        self.reads = 0
        self.memo_hits = 0
        # readahead=False: lookups are random; OS readahead only wastes page cache.
        self.env = lmdb.open(path, map_size=map_size, max_dbs=8, subdir=True,
                             readahead=False, metasync=True, sync=True,
                             max_readers=S.MAX_READERS, mode=DIR_MODE)
        self.reap_readers()  # slots of processes killed since the last mount
        self.meta = self.env.open_db(S.DB_META)
        self.inode = self.env.open_db(S.DB_INODE)
        self.dirent = self.env.open_db(S.DB_DIRENT)
        self.record = self.env.open_db(S.DB_RECORD)
        self.chunk = self.env.open_db(S.DB_CHUNK)
        self.ckey = self.env.open_db(S.DB_CKEY)
        self.content = self.env.open_db(S.DB_CONTENT)
        with self._writing(), self.env.begin(write=True) as txn:
            fmt = txn.get(S.K_FORMAT, db=self.meta)
            if fmt is None:
                txn.put(S.K_FORMAT, _Q.pack(S.SCHEMA_VERSION), db=self.meta)
                txn.put(S.K_NEXT_INO, _Q.pack(FIRST_INO), db=self.meta)
            elif _Q.unpack(fmt)[0] != S.SCHEMA_VERSION:
                raise RuntimeError(
                    f"cache index at {path} has schema {_Q.unpack(fmt)[0]}, this build "
                    f"needs {S.SCHEMA_VERSION}; use a new --cache-dir")

    def reap_readers(self) -> int:
        """Free the reader slots of processes that died holding them (a zero-copy reader
        killed with its environment open keeps its slot until someone checks); how many
        were freed. Blocking (scans the lock table), any thread."""
        return self.env.reader_check()

    def close(self) -> None:
        self.env.close()

    # ----- reads (any thread) -------------------------------------------------------

    def _current_memo(self) -> tuple[int, dict[int, Entry | None], dict[int, Record | None]]:
        """The memo of the snapshot at the current generation (a new, empty one after a
        write began)."""
        memo = self._memo
        gen = self.generation
        if memo[0] != gen:
            memo = self._memo = (gen, {}, {})
        return memo

    def _may_keep(self, gen: int, memo: dict) -> bool:
        """Whether a value read in a read transaction that began after generation ``gen``
        was read may go into the memo: no write was under way then, none began since
        (every write's start and end move the generation), and there is room."""
        return self.generation == gen and not self._writers and len(memo) < MEMO_MAX

    def get_entry(self, ino: int) -> Entry | None:
        """The entry of ``ino`` (None: not in the index). Shared: never change it."""
        return self._memo_get(ino, 1, self.inode,
                              lambda v: Entry.unpack(ino, v))  # type: ignore[return-value]

    def _memo_get(self, ino: int, which: int, db, unpack):
        """``ino``'s value in ``db``, unpacked, from the memo (``which``: 1 entries, 2
        records) or read and kept there when :meth:`_may_keep` allows."""
        memo = self._current_memo()
        gen, values = memo[0], memo[which]
        got = values.get(ino, _ABSENT)
        if got is not _ABSENT:
            self.memo_hits += 1
            return got
        self.reads += 1
        with self.env.begin(db=db, buffers=False) as txn:
            v = txn.get(ukey(ino))
        got = unpack(v) if v is not None else None
        if self._may_keep(gen, values):
            values[ino] = got
        return got

    def lookup(self, parent: int, name: bytes) -> int | None:
        with self.env.begin(db=self.dirent) as txn:
            v = txn.get(dirent_key(parent, name))
        return unkey(v) if v is not None else None

    def list_dir_typed(self, parent: int, limit: int | None = None
                       ) -> list[tuple[bytes, int, int, int]]:
        """(name, ino, mode, size) of the children of ``parent``, sorted by name bytes, in
        one read transaction (listing a dataset of a million files calls this per
        directory: no :class:`Entry` is built); the first ``limit`` only, if given."""
        prefix = ukey(parent)
        out: list[tuple[bytes, int, int, int]] = []
        mode_size = S.Entry.MODE_SIZE
        with self.env.begin() as txn:
            cur = txn.cursor(db=self.dirent)
            get = txn.cursor(db=self.inode).get
            if cur.set_range(prefix):
                for k, v in cur:
                    if not k.startswith(prefix):
                        break
                    ent = get(v)
                    if ent is not None:
                        mode, size = mode_size(ent)
                        out.append((k[8:], unkey(v), mode, size))
                        if limit is not None and len(out) >= limit:
                            break
        return out

    def list_dir(self, parent: int) -> list[tuple[bytes, int]]:
        """(name, ino) of the children of ``parent``, sorted by name bytes."""
        with self.env.begin(db=self.dirent) as txn:
            return _children(txn.cursor(), parent)

    def get_record(self, ino: int) -> Record | None:
        """The record of ``ino`` (None: not cached), of whatever version: the caller
        compares (:mod:`dlcachefs.cache.versions`)."""
        return self._memo_get(ino, 2, self.record, Record.unpack)  # type: ignore[return-value]

    def get_key(self, ino: int) -> ContentKey | None:
        """The content key known for ``ino`` (of any version: the caller compares)."""
        with self.env.begin(db=self.ckey) as txn:
            v = txn.get(ukey(ino))
        return ContentKey.unpack(v) if v is not None else None

    def get_chunk(self, chunk_id: int) -> Chunk | None:
        with self.env.begin(db=self.chunk) as txn:
            v = txn.get(ukey(chunk_id))
        return Chunk.unpack(chunk_id, v) if v is not None else None

    def last_chunk_id(self) -> int:
        """The largest chunk id indexed (0: none). Keys are big-endian: the last key."""
        with self.env.begin(db=self.chunk) as txn:
            cur = txn.cursor()
            return unkey(cur.key()) if cur.last() else 0

    def iter_chunks(self) -> Iterator[Chunk]:
        with self.env.begin(db=self.chunk) as txn:
            for k, v in txn.cursor():
                yield Chunk.unpack(unkey(k), v)

    def iter_records(self) -> Iterator[tuple[int, Record]]:
        with self.env.begin(db=self.record) as txn:
            for k, v in txn.cursor():
                yield unkey(k), Record.unpack(v)

    def iter_entries(self) -> Iterator[Entry]:
        with self.env.begin(db=self.inode) as txn:
            for k, v in txn.cursor():
                yield Entry.unpack(unkey(k), v)

    def counter(self, key: bytes) -> int:
        with self.env.begin(db=self.meta) as txn:
            return _counter_in(txn, self.meta, key)

    def get_meta(self, key: bytes) -> bytes | None:
        with self.env.begin(db=self.meta) as txn:
            v = txn.get(key)
        return bytes(v) if v is not None else None

    def with_records(self, inos: list[int]) -> set[int]:
        """Those of ``inos`` that have a record, in one read transaction."""
        with self.env.begin(db=self.record) as txn:
            get = txn.get
            return {ino for ino in inos if get(ukey(ino)) is not None}

    def snapshot(self) -> dict[str, int]:
        """The size counters and entry counts read in one transaction, so that a commit
        in between cannot make them disagree (``cached_bytes <= chunk_bytes`` holds)."""
        with self.env.begin() as txn:
            out = {name: _counter_in(txn, self.meta, k) for name, k in (
                ("files", S.K_FILES), ("bytes_total", S.K_BYTES_TOTAL),
                ("cached_bytes", S.K_CACHED_BYTES), ("chunk_bytes", S.K_CHUNK_BYTES))}
            out["records"] = txn.stat(self.record)["entries"]
            out["chunks"] = txn.stat(self.chunk)["entries"]
        return out

    def n_records(self) -> int:
        with self.env.begin() as txn:
            return txn.stat(self.record)["entries"]

    def n_chunks(self) -> int:
        with self.env.begin() as txn:
            return txn.stat(self.chunk)["entries"]

    # ----- writes (worker thread only, one call = one transaction) ------------------

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """Around a write transaction, its commit included: the memo's generation moves
        at both ends, and nothing read meanwhile goes into it."""
        with self._gen_lock:
            self._writers += 1
            self.generation += 1
        try:
            # one write at a time (LMDB's own rule too), its guard's checks around it
            with self._write_lock:
                guard = self.guard
                if guard is not None:
                    guard.before_write()
                try:
                    yield
                except BaseException as e:
                    if guard is not None:
                        guard.after_write(e)  # (a failed commit may have written pages)
                    raise
                if guard is not None:
                    guard.after_write()
        finally:
            with self._gen_lock:
                self._writers -= 1
                self.generation += 1

    @contextmanager
    def write(self) -> Iterator[IndexTxn]:
        """A write transaction; commits on normal exit, aborts on exception."""
        with self._writing(), self.env.begin(write=True) as txn:
            yield IndexTxn(self, txn)

    def recount(self, full: bool) -> dict[str, tuple[int, int]]:
        """Set the values derived from the index to what its entries say, and return the
        ones that disagreed (name: (stored, counted)). A damaged page can leave a counter
        or a sequence wrong while every entry is sound (a flipped size subtracted on a
        drop, a flipped counter): the start-up trusts none of them.

        Always (cheap: a walk of the chunks, which recovery makes anyway, and the last
        keys): ``chunk_bytes`` (the ``--cache-size`` account starts from it) and the
        sequences ``next_ino``, ``next_chunk``, ``next_log``, which must lie beyond every
        id in use (a lower one would give a new file an inode that names another's bytes).
        With ``full`` (after the start-up walked the index; a second or so per million
        files): ``cached_bytes``, ``n_files`` and ``bytes_total`` too (statistics only).
        One write transaction, worker thread or start-up only."""
        counted: dict[bytes, int] = {}
        floors: dict[bytes, int] = {}
        with self._writing(), self.env.begin(write=True) as txn:
            size_of = S.Record._S.unpack_from
            chunk_bytes = 0
            last_log = 0
            for _, v in txn.cursor(db=self.chunk):
                c_log, _off, length = struct.unpack_from("<QQQ", v, 0)
                chunk_bytes += length
                last_log = max(last_log, c_log)
            counted[S.K_CHUNK_BYTES] = chunk_bytes
            for key, db in ((S.K_NEXT_INO, self.inode), (S.K_NEXT_CHUNK, self.chunk)):
                cur = txn.cursor(db=db)
                floors[key] = unkey(cur.key()) + 1 if cur.last() else 0
            # never an inode of the virtual .dlcache/ files (2..15)
            floors[S.K_NEXT_INO] = max(floors[S.K_NEXT_INO], FIRST_INO)
            floors[S.K_NEXT_LOG] = last_log + 1 if last_log else 0
            if full:
                counted[S.K_CACHED_BYTES] = sum(
                    size_of(v)[3] for v in txn.cursor(db=self.record).iternext(keys=False))
                files = total = 0
                mode_size = S.Entry.MODE_SIZE
                for v in txn.cursor(db=self.inode).iternext(keys=False):
                    mode, size = mode_size(v)
                    if _is_file(mode):
                        files += 1
                        total += size
                counted[S.K_FILES], counted[S.K_BYTES_TOTAL] = files, total
            fixed: dict[str, tuple[int, int]] = {}
            for key, n in counted.items():
                was = _counter_in(txn, self.meta, key)
                if was != n:
                    txn.put(key, _q.pack(n), db=self.meta)
                    fixed[key.decode()] = (was, n)
            for key, floor in floors.items():
                v = txn.get(key, db=self.meta)
                was = _Q.unpack(v)[0] if v is not None and len(v) == 8 else 0
                if floor and was < floor:
                    txn.put(key, _Q.pack(floor), db=self.meta)
                    fixed[key.decode()] = (was, floor)
        return fixed

    def check_invariants(self) -> list[str]:
        """Return a list of violated invariants (empty when the index is consistent)."""
        problems: list[str] = []
        chunks = {c.chunk_id: c for c in self.iter_chunks()}
        cached_bytes = 0
        for ino, rec in self.iter_records():
            cached_bytes += rec.size
            c = chunks.get(rec.chunk_id)
            if c is None:
                problems.append(f"record of inode {ino} names missing chunk {rec.chunk_id}")
                continue
            if ino not in c.members:
                problems.append(f"chunk {rec.chunk_id} does not list inode {ino}")
            if not (c.offset <= rec.offset and rec.offset + rec.size <= c.offset + c.length):
                problems.append(f"record of inode {ino} lies outside chunk {rec.chunk_id}")
            if c.log_id != rec.log_id:
                problems.append(f"record of inode {ino} names log {rec.log_id}, chunk says {c.log_id}")
            if self.get_entry(ino) is None:
                problems.append(f"record of inode {ino} has no namespace entry")
        if cached_bytes != self.counter(S.K_CACHED_BYTES):
            problems.append(f"cached_bytes counter {self.counter(S.K_CACHED_BYTES)} != {cached_bytes}")
        chunk_bytes = sum(c.length for c in chunks.values())
        if chunk_bytes != self.counter(S.K_CHUNK_BYTES):
            problems.append(f"chunk_bytes counter {self.counter(S.K_CHUNK_BYTES)} != {chunk_bytes}")
        # an offer whose inode has no record of the key's version is tolerated (readers
        # check it; a build without content keys may have written the index in between)
        with self.env.begin() as txn:
            for sha, v in txn.cursor(db=self.content):
                k = txn.get(v, db=self.ckey)
                if k is None or ContentKey.unpack(k).sha256 != sha:
                    problems.append(f"content {sha.hex()[:16]} names inode {unkey(v)}, "
                                    "whose key is another")
        return problems


class IndexTxn:
    """Mutations inside one write transaction. Keeps the counters in ``meta`` in step.

    Code outside :mod:`dlcachefs.store` goes through these methods, never through
    ``txn`` and the sub-databases directly: the counters and the schema stay in here."""

    def __init__(self, index: Index, txn: lmdb.Transaction) -> None:
        self.ix = index
        self.txn = txn

    def _add(self, key: bytes, delta: int) -> None:
        if delta:
            v = self.txn.get(key, db=self.ix.meta)
            cur = _q.unpack(v)[0] if v is not None else 0
            self.txn.put(key, _q.pack(cur + delta), db=self.ix.meta)

    def set_meta(self, key: bytes, value: bytes) -> None:
        self.txn.put(key, value, db=self.ix.meta)

    def meta_keys(self, prefix: bytes) -> list[bytes]:
        """The ``meta`` keys that start with ``prefix``, in key order."""
        out: list[bytes] = []
        cur = self.txn.cursor(db=self.ix.meta)
        if cur.set_range(prefix):
            for k in cur.iternext(keys=True, values=False):
                if not k.startswith(prefix):
                    break
                out.append(bytes(k))
        return out

    def delete_meta(self, key: bytes) -> bool:
        """Delete one ``meta`` key; False when it was not there."""
        return self.txn.delete(key, db=self.ix.meta)

    def bump(self, key: bytes, value: int) -> None:
        """Raise a persistent sequence to at least ``value`` (never lowers it)."""
        v = self.txn.get(key, db=self.ix.meta)
        if v is None or _Q.unpack(v)[0] < value:
            self.txn.put(key, _Q.pack(value), db=self.ix.meta)

    def alloc(self, key: bytes, start: int = 1) -> int:
        """Next value of a persistent sequence (inode numbers, chunk ids, log ids)."""
        v = self.txn.get(key, db=self.ix.meta)
        n = _Q.unpack(v)[0] if v is not None else start
        self.txn.put(key, _Q.pack(n + 1), db=self.ix.meta)
        return n

    def get_entry(self, ino: int) -> Entry | None:
        v = self.txn.get(ukey(ino), db=self.ix.inode)
        return Entry.unpack(ino, v) if v is not None else None

    def lookup(self, parent: int, name: bytes) -> int | None:
        v = self.txn.get(dirent_key(parent, name), db=self.ix.dirent)
        return unkey(v) if v is not None else None

    def list_dir(self, parent: int) -> list[tuple[bytes, int]]:
        """(name, ino) of the children of ``parent``, sorted by name bytes (as
        :meth:`Index.list_dir`, inside this transaction)."""
        return _children(self.txn.cursor(db=self.ix.dirent), parent)

    def put_entry(self, e: Entry) -> None:
        """Insert or update an entry (and its dirent), keeping file counters right."""
        old = self.get_entry(e.ino)
        if old is not None and _is_file(old.mode):
            self._add(S.K_FILES, -1)
            self._add(S.K_BYTES_TOTAL, -old.size)
        if _is_file(e.mode):
            self._add(S.K_FILES, 1)
            self._add(S.K_BYTES_TOTAL, e.size)
        self.txn.put(ukey(e.ino), e.pack(), db=self.ix.inode)
        if e.parent:
            self.txn.put(dirent_key(e.parent, e.name), ukey(e.ino), db=self.ix.dirent)

    def delete_tree(self, ino: int) -> list[int]:
        """Remove an entry, its descendants and their records. Returns the removed inodes."""
        removed: list[int] = []
        stack = [ino]
        while stack:
            cur = stack.pop()
            e = self.get_entry(cur)
            if e is None:
                continue
            prefix = ukey(cur)
            c = self.txn.cursor(db=self.ix.dirent)
            if c.set_range(prefix):
                for k, v in c:
                    if not k.startswith(prefix):
                        break
                    stack.append(unkey(v))
            self.drop_record(cur)
            self.txn.delete(ukey(cur), db=self.ix.ckey)
            if _is_file(e.mode):
                self._add(S.K_FILES, -1)
                self._add(S.K_BYTES_TOTAL, -e.size)
            self.txn.delete(ukey(cur), db=self.ix.inode)
            if e.parent:
                self.txn.delete(dirent_key(e.parent, e.name), db=self.ix.dirent)
            removed.append(cur)
        # children dirents of removed directories
        for cur in removed:
            prefix = ukey(cur)
            c = self.txn.cursor(db=self.ix.dirent)
            while c.set_range(prefix) and c.key().startswith(prefix):
                c.delete()
        return removed

    def get_record(self, ino: int) -> Record | None:
        v = self.txn.get(ukey(ino), db=self.ix.record)
        return Record.unpack(v) if v is not None else None

    def put_record(self, ino: int, rec: Record) -> None:
        old = self.get_record(ino)
        if old is not None:
            self._add(S.K_CACHED_BYTES, -old.size)
        self.txn.put(ukey(ino), rec.pack(), db=self.ix.record)
        self._add(S.K_CACHED_BYTES, rec.size)
        k = self.get_key(ino)
        if k is not None and not k.same_version(rec):
            # other bytes than the key's now: never offered under the old key again
            self._unpublish(ino)
            self.txn.delete(ukey(ino), db=self.ix.ckey)

    def drop_record(self, ino: int, only_chunk: int | None = None) -> Record | None:
        """Delete the record of ``ino`` (only if it lives in ``only_chunk``, when given);
        its bytes are no longer offered to the other datasets (``content``)."""
        old = self.get_record(ino)
        if old is None or (only_chunk is not None and old.chunk_id != only_chunk):
            return None
        self.txn.delete(ukey(ino), db=self.ix.record)
        self._add(S.K_CACHED_BYTES, -old.size)
        self._unpublish(ino)
        return old

    # content keys (--shared-cache dedup): see the schema

    def get_key(self, ino: int) -> ContentKey | None:
        v = self.txn.get(ukey(ino), db=self.ix.ckey)
        return ContentKey.unpack(v) if v is not None else None

    def put_key(self, ino: int, key: ContentKey) -> None:
        """Remember ``ino``'s content key (a key of another version is replaced, and the
        bytes offered under it withdrawn)."""
        old = self.get_key(ino)
        if old is not None and old != key:
            self._unpublish(ino)
        self.txn.put(ukey(ino), key.pack(), db=self.ix.ckey)

    def publish(self, ino: int, key: ContentKey) -> None:
        """Offer ``ino``'s record (whose bytes hash to ``key``) to the other datasets."""
        self.put_key(ino, key)
        self.txn.put(key.sha256, ukey(ino), db=self.ix.content)

    def _unpublish(self, ino: int) -> None:
        """Withdraw what ``ino`` offered under its content key (the key stays known)."""
        k = self.get_key(ino)
        if k is not None and self.txn.get(k.sha256, db=self.ix.content) == ukey(ino):
            self.txn.delete(k.sha256, db=self.ix.content)

    def get_chunk(self, chunk_id: int) -> Chunk | None:
        v = self.txn.get(ukey(chunk_id), db=self.ix.chunk)
        return Chunk.unpack(chunk_id, v) if v is not None else None

    def put_chunk(self, c: Chunk) -> None:
        self.txn.put(ukey(c.chunk_id), c.pack(), db=self.ix.chunk)
        self._add(S.K_CHUNK_BYTES, c.length)

    def drop_chunk(self, chunk_id: int) -> Chunk | None:
        """Delete a chunk and every record that still points into it."""
        c = self.get_chunk(chunk_id)
        if c is None:
            return None
        for ino in c.members:
            self.drop_record(ino, only_chunk=chunk_id)
        self.txn.delete(ukey(chunk_id), db=self.ix.chunk)
        self._add(S.K_CHUNK_BYTES, -c.length)
        return c


def _children(dirents: lmdb.Cursor, parent: int) -> list[tuple[bytes, int]]:
    """(name, ino) of the children of ``parent``, from a cursor on ``dirent``."""
    prefix = ukey(parent)
    out: list[tuple[bytes, int]] = []
    if dirents.set_range(prefix):
        for k, v in dirents:
            if not k.startswith(prefix):
                break
            out.append((bytes(k[8:]), unkey(v)))
    return out


def _is_file(mode: int) -> bool:
    return (mode & 0o170000) == 0o100000
