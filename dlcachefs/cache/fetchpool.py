"""Fetch workers (``--fetch-workers N``): files fetched ahead of readers are read from the
source, checksummed and appended to the cache by N processes, and only indexed here.

Who does what:

* the daemon (this module, trio loop) decides what to fetch (the prefetcher asks
  :meth:`FetchPool.fetch` for one file, for a stream or for scan-ahead: a guess, only
  into free room), asks the policy to admit it, reserves its
  bytes in the ``--cache-size`` account (:meth:`ChunkWriter.try_reserve`) and holds the
  file as in flight (:meth:`Fetcher.hold`: opens join it, prefetch skips it) BEFORE a
  worker may write it;
* each worker task batches what is queued (up to a chunk's worth; scan-ahead's guesses
  one at a time while a reader waits for the source), gives it a chunk id
  and the offset in its worker's own log file (created here, kept in
  :attr:`LogStore.filling` while it is appended to), sends the job and awaits the answer
  (:mod:`dlcachefs.cache.fetchworker`: the worker reads, encodes ONE chunk, appends it
  and ``fdatasync``\\ s before it answers);
* the indexer task indexes the answered chunks, several at a time, in ONE transaction
  through the writer (:meth:`ChunkWriter.commit_external`: serialized with its commits,
  so the daemon stays the only LMDB writer and rule B holds), then gives back the part
  of each reservation the chunk did not take.

Crash order: as the writer's (a chunk is indexed only after its bytes are durable).
Each worker's log is appended in order and its chunks are indexed in that order, so
what a crash leaves unindexed is a tail, which recovery cuts
(:meth:`LogStore.recover`); a log with nothing indexed is deleted. A worker that dies
(killed, or its pipe broken) fails its job: its files are given back (reservation,
policy) and fetched the usual way by their caller; its log is appended to no more (a
torn append may lie past the last indexed chunk), and a new worker with a new log takes
its place.

Files that do not come back written (changed on the source since listed, unreadable, no
room) are answered None: the caller fetches them the usual way
(:meth:`Fetcher.fetch`), which records a new version, counts errors and retries.

Concurrency: trio loop; the workers' pipes are read and written through trio
(``FdStream``), no thread per job; only spawning a worker, creating a log and the index
transaction run in threads.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field

import trio

from dlcachefs.cache.fetch import Fetcher
from dlcachefs.cache.fetchworker import Done, Job, frame
from dlcachefs.cache.namespace import Namespace, identity
from dlcachefs.cache.policy import CachingPolicy
from dlcachefs.cache.stats import Counters
from dlcachefs.cache.tasks import TaskOwner
from dlcachefs.cache.versions import record_identity
from dlcachefs.cache.writer import ChunkWriter
from dlcachefs.config import Config
from dlcachefs.errors import FormatError
from dlcachefs.store.chunkfmt import CHUNK_HEADER_SIZE, LOG_HEADER_SIZE, checksum, record_len
from dlcachefs.store.index import Index
from dlcachefs.store.integrity import log_failure
from dlcachefs.store.lock import LOCK_NAME
from dlcachefs.store.logs import LogStore
from dlcachefs.store.schema import Chunk, Entry, Record
from dlcachefs.store.seal import NewChunk, NewRecord, seal_chunks

log = logging.getLogger(__name__)

#: ``-P``: ``-m`` puts no current directory first on a worker's path (Python 3.11+)
SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []

#: files of one job at most (one chunk; the answer's size stays small)
MAX_JOB_FILES = 64
#: scan-ahead's guesses in the pool at once (queued or in a job), per worker
GUESSES_PER_WORKER = 8
#: seconds a worker is given to exit once its stdin is closed, before SIGKILL
EXIT_GRACE = 2.0


@dataclass(slots=True)
class _Request:
    e: Entry
    rel: bytes
    charge: int  # bytes reserved in the account for it (record + a chunk header)
    guess: bool = False  # scan-ahead's
    done: trio.Event = field(default_factory=trio.Event)
    ok: bool = False  # written and indexed


@dataclass(slots=True)
class _Written:
    log_id: int
    offset: int
    chunk_id: int
    done: Done
    reqs: list[_Request]


class _Worker:
    """One worker process, its pipes and the log it appends to."""

    def __init__(self, proc: subprocess.Popen, log_id: int) -> None:
        self.proc = proc
        self.to = trio.lowlevel.FdStream(os.dup(proc.stdin.fileno()))  # type: ignore[union-attr]
        self.frm = trio.lowlevel.FdStream(os.dup(proc.stdout.fileno()))  # type: ignore[union-attr]
        proc.stdin.close()  # type: ignore[union-attr]  # (the dups above are the ends used)
        proc.stdout.close()  # type: ignore[union-attr]
        self.log_id = log_id
        self.end = LOG_HEADER_SIZE
        self.buf = bytearray()

    async def call(self, job: Job) -> Done:
        """Send ``job``, await the answer; raises ``BrokenPipe``/``EOFError`` when the
        worker is gone."""
        await self.to.send_all(frame(job))
        need = 4
        while len(self.buf) < need or (need == 4 and len(self.buf) >= 4 and (
                need := 4 + int.from_bytes(self.buf[:4], "little")) > len(self.buf)):
            more = await self.frm.receive_some(1 << 16)
            if not more:
                raise EOFError("fetch worker gone")
            self.buf += more
        import pickle  # noqa: PLC0415 - the daemon's own worker's answer

        body = bytes(self.buf[4:need])
        del self.buf[:need]
        out = pickle.loads(body)  # noqa: S301
        assert isinstance(out, Done)
        return out

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await self.to.aclose()
        with contextlib.suppress(Exception):
            await self.frm.aclose()
        proc = self.proc
        with trio.move_on_after(EXIT_GRACE):
            while proc.poll() is None:
                await trio.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
            await trio.to_thread.run_sync(proc.wait)


def _lock_fd(data_dir: str) -> int | None:
    """This process's descriptor of the cache lock (held by the daemon), if any: handed to
    the workers so that the lock is held while any of them lives."""
    want = os.path.realpath(os.path.join(data_dir, LOCK_NAME))
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/self/fd/{name}") == want:
                    return int(name)
    return None


class FetchPool(TaskOwner):
    """N fetch worker processes for the files fetched ahead (see the module doc)."""

    def __init__(self, cfg: Config, *, index: Index, logs: LogStore, writer: ChunkWriter,
                 policy: CachingPolicy, ns: Namespace, fetcher: Fetcher,
                 counters: Counters) -> None:
        self.cfg = cfg
        self.n = cfg.fetch_workers
        self.index = index
        self.logs = logs
        self.writer = writer
        self.policy = policy
        self.ns = ns
        self.fetcher = fetcher
        self.counters = counters
        # what waits for a worker: the prefetch's requests (an announced stream's next
        # files) go before scan-ahead's guesses, and at most GUESSES_PER_WORKER guesses
        # per worker are in the pool (queued or in a job) at once: a guess is held in
        # flight from here (an open of it joins it), so a long queue of guesses would
        # make readers and streams wait behind them
        self._asked: deque[_Request] = deque()
        self._guessed: deque[_Request] = deque()
        self._arrived = trio.Event()
        self.guess_slots = trio.Semaphore(GUESSES_PER_WORKER * max(1, self.n))
        self._written: deque[_Written] = deque()
        self._unindexed: Counter[int] = Counter()  # log id -> its chunks written, not indexed
        self._wake_indexer = trio.Event()
        self._closing = False
        #: counts for stats (``fetch_workers``)
        self.files = 0  # files written by workers and indexed
        self.guesses = 0  # of them, scan-ahead's
        self.jobs = 0
        self.fallbacks = 0  # files handed back to the usual fetch
        self.refused = 0  # files the policy did not admit
        self.restarts = 0  # workers that died and were replaced
        self.pids: list[int] = []
        super().__init__()

    def stats(self) -> dict:
        return {"workers": self.n, "pids": list(self.pids), "files": self.files,
                "scan_ahead": self.guesses, "jobs": self.jobs, "fallbacks": self.fallbacks,
                "refused": self.refused,
                "restarts": self.restarts}

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for k in range(self.n):
                nursery.start_soon(self._serve, k)
            nursery.start_soon(self._indexer)
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._nursery = None
                self._closing = True

    # ----- the prefetcher's call -------------------------------------------------------

    async def fetch(self, e: Entry, *, spare: int | None = None) -> bool | None:
        """Have a worker fetch and cache the current version of ``e``: True once it is
        indexed; False when the policy did not admit it, or (a guess) the free room does
        not hold it; None when it was not written for another reason. The caller fetches
        it the usual way unless True (a guess: unless True or False, since the usual way
        would read it only to drop it).

        ``spare``: a guess (scan-ahead), which never evicts: only when the free room holds
        it with ``spare`` bytes to spare (else False before the policy is asked)."""
        if not self.running or self._closing or self.fetcher.in_flight(e.ino):
            return None
        rel = self.ns.path_of(e)
        charge = record_len(len(rel), e.size) + CHUNK_HEADER_SIZE
        if spare is not None and self.writer.room() < charge + spare:
            return False  # (so try_reserve below dooms nothing: no await in between)
        if not self.policy.admit(e.ino, e.size):
            # (the prefetch's usual path asks again, counts it, keeps it in memory; a
            # guess ends here)
            self.refused += 1
            if spare is not None:
                self.counters.not_admitted += 1
            return False
        if not self.writer.try_reserve(charge):
            self.policy.on_dropped(e.ino)
            return None
        req = _Request(e, rel, charge, guess=spare is not None)
        with self.fetcher.hold(e.ino) as inf:
            (self._guessed if req.guess else self._asked).append(req)
            self._arrived.set()
            await req.done.wait()
            if req.ok and inf.waiters:
                # an open caught up with it: it gets the bytes from the log
                data = await self._read_back(e)
                if data is not None:
                    inf.result = (data, e)
        if not req.ok:
            self.fallbacks += 1
            return None
        if spare is not None:
            self.guesses += 1
        return True

    async def _read_back(self, e: Entry) -> bytes | None:
        """The bytes of ``e``'s record just indexed, checked (None: not there, or bad)."""
        rec = self.index.get_record(e.ino)
        if rec is None or record_identity(rec) != identity(e):
            return None
        try:
            data = await trio.to_thread.run_sync(self.logs.read, rec.log_id, rec.offset,
                                                 rec.size)
        except (OSError, FormatError):
            return None
        return data if checksum(data) == rec.data_xxh else None

    # ----- workers (trio loop) ----------------------------------------------------------

    async def _spawn(self) -> _Worker:
        lock = _lock_fd(self.cfg.data_dir)
        cmd = [sys.executable, *SAFE_PATH, "-m", "dlcachefs.cache.fetchworker",
               os.fsdecode(self.ns_root()), "1" if self.cfg.use_source_inode else "0"]
        # Started from the loop's own thread, not a worker thread: the worker's
        # PR_SET_PDEATHSIG fires when the THREAD that forked it exits, and trio's cached
        # threads exit after 10 s idle (the workers were SIGKILLed mid-append then). A
        # fork/exec blocks the loop for a few milliseconds, once per worker.
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            pass_fds=(lock,) if lock is not None else (), start_new_session=False)
        log_id = self.writer.reserve_log_id()
        try:
            await trio.to_thread.run_sync(self.logs.create_sized, log_id, LOG_HEADER_SIZE)
        except BaseException:
            proc.kill()
            raise
        self.logs.filling.add(log_id)
        return _Worker(proc, log_id)

    def ns_root(self) -> bytes:
        return os.path.realpath(os.fsencode(self.cfg.source))

    def _retire_log(self, log_id: int) -> None:
        """Append to this log no more; deleted once nothing in it is indexed or waits to
        be (:meth:`LogStore.release` deletes it when its last indexed chunk goes)."""
        self.logs.filling.discard(log_id)
        self._discard_if_empty(log_id)

    def _discard_if_empty(self, log_id: int) -> None:
        if log_id not in self.logs.filling and not self._unindexed[log_id]:
            del self._unindexed[log_id]
            with contextlib.suppress(OSError):
                self.logs.discard_log(log_id)  # (only when nothing in it is indexed)

    async def _serve(self, k: int) -> None:
        w: _Worker | None = None
        try:
            while True:
                if w is None:  # started before any job: it dies with the daemon from now
                    try:
                        w = await self._spawn()
                    except Exception:  # noqa: BLE001 - no worker now: the usual fetch does it
                        log_failure(log, "starting a fetch worker failed")
                        self._fail(self._take_queued())
                        await trio.sleep(1.0)
                        continue
                    self.pids.append(w.proc.pid)
                batch = [await self._take()]
                size = batch[0].charge
                while len(batch) < MAX_JOB_FILES and size < self.writer.chunk_target:
                    # while a reader waits for the source, a job takes one guess at most:
                    # the link serves at most one guess per worker beside its miss
                    guesses = sum(r.guess for r in batch)
                    r = self._take_nowait(guesses == 0 or not self.fetcher.demand_fetches)
                    if r is None:
                        break
                    batch.append(r)
                    size += r.charge
                try:
                    if w.end + size > self.cfg.log_size and w.end > LOG_HEADER_SIZE:
                        self._retire_log(w.log_id)
                        w.log_id = self.writer.reserve_log_id()
                        await trio.to_thread.run_sync(self.logs.create_sized, w.log_id,
                                                      LOG_HEADER_SIZE)
                        self.logs.filling.add(w.log_id)
                        w.end = LOG_HEADER_SIZE
                except Exception:  # noqa: BLE001 - no new log: the usual fetch does it
                    log_failure(log, "starting a fetch worker's log failed")
                    self._fail(batch)
                    await trio.sleep(1.0)
                    continue
                chunk_id = self.writer.reserve_chunk_ids(1)
                job = Job(self.logs.path(w.log_id), w.end, size, chunk_id,
                          [(r.e.ino, r.rel, identity(r.e)) for r in batch])
                try:
                    done = await w.call(job)
                except (OSError, EOFError, trio.BrokenResourceError,
                        trio.ClosedResourceError) as exc:
                    # the worker died: its files go back, its log takes no more appends
                    log.warning("fetch worker %d (pid %d) is gone (%s); starting another",
                                k, w.proc.pid, exc)
                    self._fail(batch)
                    self._retire_log(w.log_id)
                    with trio.CancelScope(shield=True):
                        await w.stop()
                    if w.proc.pid in self.pids:
                        self.pids.remove(w.proc.pid)
                    w = None
                    self.restarts += 1
                    continue
                self.jobs += 1
                if done.error is not None:
                    log.warning("a fetch worker's append failed: %s", done.error)
                if done.length:
                    self._written.append(_Written(w.log_id, w.end, chunk_id, done, batch))
                    self._unindexed[w.log_id] += 1
                    w.end += done.length
                    self._wake_indexer.set()
                else:
                    self._fail(batch)
        finally:
            if w is not None:
                with trio.CancelScope(shield=True):
                    await w.stop()
                # (a tail not indexed, if any, waits for recovery; an empty log goes now)
                self._retire_log(w.log_id)

    async def _take(self) -> _Request:
        """The next request for a worker (the prefetch's first), once there is one."""
        while True:
            r = self._take_nowait(True)
            if r is not None:
                return r
            if self._arrived.is_set():  # (set for a request another task took)
                self._arrived = trio.Event()
            await self._arrived.wait()

    def _take_nowait(self, guess: bool) -> _Request | None:
        """The next queued request (a guess only if ``guess``), or None."""
        if self._asked:
            return self._asked.popleft()
        if guess and self._guessed:
            return self._guessed.popleft()
        return None

    def _take_queued(self) -> list[_Request]:
        out = [*self._asked, *self._guessed]
        self._asked.clear()
        self._guessed.clear()
        return out

    def _fail(self, reqs: list[_Request]) -> None:
        """Give back what ``reqs`` held (reservation, admission) and wake their callers."""
        for r in reqs:
            self.writer.unreserve(r.charge)
            self.policy.on_dropped(r.e.ino)
            r.done.set()

    # ----- indexing (trio loop; the transaction in the writer's commit thread) -----------

    async def _indexer(self) -> None:
        while True:
            await self._wake_indexer.wait()
            self._wake_indexer = trio.Event()
            while self._written:
                batch = list(self._written)
                self._written.clear()
                try:
                    await self._index(batch)
                finally:
                    for wr in batch:
                        self._unindexed[wr.log_id] -= 1
                        self._discard_if_empty(wr.log_id)

    async def _index(self, batch: list[_Written]) -> None:
        chunks: list[NewChunk] = []
        now = time.time_ns()
        for wr in batch:
            by_ino = {r.e.ino: r for r in wr.reqs}
            recs = []
            for ino, data_off, size, xxh, mtime_ns, src_ino in wr.done.records:
                r = by_ino[ino]
                recs.append(NewRecord(ino, identity(r.e), Record(
                    wr.chunk_id, wr.log_id, wr.offset + data_off, size, xxh, mtime_ns,
                    src_ino)))
            members = tuple(ino for ino, *_ in wr.done.records)
            chunks.append(NewChunk(Chunk(wr.chunk_id, wr.log_id, wr.offset, wr.done.length,
                                         now, members), recs))
        total = sum(wr.done.length for wr in batch)

        def commit() -> list[int]:
            sealed = seal_chunks(self.index, chunks, keep_indexed=True,
                                 new_log=max(wr.log_id for wr in batch))
            for wr in batch:
                self.logs.add_live(wr.log_id, wr.done.length)
            return sealed.dead

        try:
            dead = await self.writer.commit_external(total, commit)
        except Exception:  # noqa: BLE001 - not indexed: the files are fetched again
            log_failure(log, "indexing fetch workers' chunks failed")
            for wr in batch:
                self._fail(wr.reqs)
            return
        for wr in batch:
            written = {ino for ino, *_ in wr.done.records}
            # the reservations' part the chunk did not take (its files' headers, skipped files)
            self.writer.unreserve(sum(r.charge for r in wr.reqs) - wr.done.length)
            self.policy.on_insert(wr.chunk_id, tuple(written), wr.done.length)
            self.counters.chunks_written += 1
            for r in wr.reqs:
                if r.e.ino in written:
                    r.ok = True
                    self.files += 1
                    self.counters.bytes_from_source += r.e.size
                else:
                    self.policy.on_dropped(r.e.ino)
                r.done.set()
        for old in dead:
            self.writer.retire_chunk(old, empty=True)
