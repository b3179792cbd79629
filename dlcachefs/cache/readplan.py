"""Planned reads: when an epoch's order is known, read the local log in that order.

A stream whose order is known (``sampler`` announced, :mod:`dlcachefs.clairvoyance.streams`) but whose
log was not laid out for this epoch (a ``RandomSampler`` without a generator: each epoch's
seed is drawn at its start, so the next order is never known and LCache cannot reorder)
reads its samples from chunks in a shuffled order. Whole-chunk reads then mostly serve
one or two records each before the chunk leaves the memory tier: the disk reads several
times the bytes served. Instead, a :class:`ReadPlan` walks the epoch's order ahead of the
reader, inside a bounded window, and reads exactly the records it will ask for:

* **Window**: positions ``[reader position, reader position + lead)`` (the prefetcher's
  sample bound), holding at most ``budget`` bytes of read data for all plans together
  (half of ``--memory``). That memory is taken from the memory tier
  (:meth:`MemoryTier.reserve`), so chunks + planned reads stay within ``--memory``.
* **Batches**: a new batch is read once half of the plan's share of the budget (or
  ``max_batch``, 2 chunks and at least 4 MiB) is free, so each batch covers many
  positions and records of one chunk needed close together land in one batch, while
  the first open of an epoch never waits for more than one ``max_batch`` of reads.
  Several streams split the budget evenly.
* **Grouping** (:func:`group_reads`, pure): the batch's records are grouped by chunk and
  sorted by offset; a run grows by the next record of the same chunk while its useful
  bytes (record data) stay at least ``MIN_USEFUL`` of the bytes it covers. Each run is
  one ``pread``: a run of one record reads exactly that record. So every planned read has
  an amplification of at most ``1 / MIN_USEFUL``, and each record is read once.
* **Verification**: every record is checked against its own xxh3 checksum (the index's
  ``data_xxh``) in the worker thread; a mismatch is a checksum failure (the record is
  dropped and refetched from the source by its open), never served.
* **Hand-off**: an open of a sample the plan holds takes its bytes
  (:meth:`ReadPlan.take`); one in flight waits for its batch (records at positions the
  reader has passed are dropped, never one an open waits for: its open moved the position
  before it took); one the plan has not read (the reader got ahead, or the record was not
  indexed when the window passed it) is read as a single record, never with a whole-chunk
  probe; so is one the plan no longer holds (a second open of the sample in the epoch:
  it is loaded at its first READ, if one comes, :meth:`ReadPlan.holds`). A plan that
  has handed out its whole epoch is closed.
* **Pages**: an epoch whose opens stop READing (the kernel's page cache holds what the
  last epoch read: ``Stream.pages_served`` turns on, judged every ``PAGED_MIN_OPENS``
  opens' outcomes) pauses its plan: it reads nothing more ahead, and what it holds is
  taken or dropped as the reader passes; READs coming back resume it from the reader's
  position. An epoch that starts so served gets no plan until READs come back
  (``pages_lost``). Until its first window is judged a plan reads at most ``FIRST_LEAD`` positions ahead
  (a dataset that fits in the budget would otherwise be read whole at once, for pages
  the kernel may hold); so does a plan until an open of its stream tells where the
  epoch's reads are served (through the mount, or in the training's processes: those
  read the logs themselves, and records read into memory for them are read twice).
* **Idle**: a plan holding memory whose reader made no progress (its position did not
  move and no open took from the plan) for ``IDLE`` seconds (the job ended, crashed or
  hangs mid-epoch) gives back everything it holds (its reservation in the memory tier)
  and reads nothing more until the reader moves again; it then reads its window again
  from the reader's position. So a job that stops mid-epoch never keeps memory reserved.

* **Readers in the training's processes** (``Stream.in_process``: the stream's reads are
  served in its processes, :mod:`dlcachefs.data.intercept`): they read the logs
  themselves, so nothing read into the daemon's memory would be taken. The plan walks
  the same window and has the kernel read each run into the page cache
  (``POSIX_FADV_WILLNEED``): their ``pread`` calls then find the bytes in memory, and the
  daemon copies nothing. The daemon only posts the runs on the readers' board
  (:mod:`dlcachefs.store.advice`); the readers ask the kernel for them, so its page
  allocations and I/O submission run on their cores, not on the daemon's one (without a
  board, the daemon asks itself: :func:`advise_runs`, in a thread).

Streams reading a log laid out for their epoch (LCache, ``current_log``) get no plan:
they keep sequential whole-chunk reads. Opens not attributed to a stream with a plan
work as before.

Concurrency: all plan state lives on the trio loop and is changed only there. File I/O
and checksums of one batch run in ONE worker thread hop (:func:`read_runs`, under the
engine's ``disk_limiter``); the thread gets immutable inputs (the runs) and returns new
objects, touching no shared state except ``LogStore.read`` (thread-safe). Chunks of a
batch are pinned (``writer.pin``) for the duration of the hop so they are not evicted
(hole-punched) under the read. Each plan is a task in the stream's epoch nursery: a new
epoch (or sampler) cancels it; cancellation releases everything it held.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import trio

from dlcachefs.cache.readers import Observer, OpenEvent
from dlcachefs.errors import FormatError
from dlcachefs.store.chunkfmt import checksum
from dlcachefs.store.integrity import log_failure
from dlcachefs.store.schema import Record

if TYPE_CHECKING:
    from dlcachefs.cache.buffers import ReadAhead
    from dlcachefs.cache.memtier import MemoryTier
    from dlcachefs.cache.reader import LogReader
    from dlcachefs.cache.stats import Counters
    from dlcachefs.cache.versions import Versions
    from dlcachefs.cache.writer import ChunkWriter
    from dlcachefs.store.advice import AdviceBoard
    from dlcachefs.store.index import Index
    from dlcachefs.store.logs import LogStore

log = logging.getLogger(__name__)

#: a covering read is made only while at least this fraction of its bytes is wanted
MIN_USEFUL = 0.9

#: an epoch's plan reads at most this many positions ahead until a window of its opens
#: was judged (``Stream.pages_judged``, every ``pagecache.PAGED_MIN_OPENS`` opens of cached
#: files), or its reader is this far: the kernel's page cache may serve the epoch
FIRST_LEAD = 64

#: seconds without progress of its reader after which a plan gives back what it holds
IDLE = 10.0


@dataclass(frozen=True, slots=True)
class Want:
    """One record the plan will read: the sample's inode and where its bytes live."""

    ino: int
    rec: Record


@dataclass(slots=True)
class Run:
    """One ``pread``: ``[offset, offset + length)`` of one chunk in one log, covering the
    data of ``wants`` (sorted by offset)."""

    log_id: int
    chunk_id: int
    offset: int
    length: int
    wants: list[Want] = field(default_factory=list)

    @property
    def useful(self) -> int:
        return sum(w.rec.size for w in self.wants)


def group_reads(wants: Iterable[Want], min_useful: float = MIN_USEFUL) -> list[Run]:
    """Which records are read together (pure).

    Records are grouped per chunk and sorted by offset; a run takes the next record of its
    chunk while ``useful bytes >= min_useful * covered bytes`` still holds, else a new
    run starts at that record. Every want is in exactly one run (a second want of the same
    inode is ignored); every run has a useful fraction of at least ``min_useful`` (a run
    of one record reads exactly its data). Runs come out per chunk, in offset order.
    """
    by_chunk: dict[int, list[Want]] = {}
    seen: set[int] = set()
    for w in wants:
        if w.ino in seen:
            continue
        seen.add(w.ino)
        by_chunk.setdefault(w.rec.chunk_id, []).append(w)
    runs: list[Run] = []
    for chunk_id, ws in by_chunk.items():
        ws.sort(key=lambda w: w.rec.offset)
        cur: Run | None = None
        useful = 0
        for w in ws:
            r = w.rec
            if cur is not None and r.log_id == cur.log_id:
                end = max(cur.offset + cur.length, r.offset + r.size)
                if useful + r.size >= min_useful * (end - cur.offset):
                    cur.wants.append(w)
                    cur.length = end - cur.offset
                    useful += r.size
                    continue
            cur = Run(r.log_id, chunk_id, r.offset, r.size, [w])
            useful = r.size
            runs.append(cur)
    return runs


def read_runs(logs, runs: Sequence[Run]) -> list[tuple[bytes | None, list[bool]]]:
    """Thread: one ``pread`` per run, and each of its records checked against its xxh3.
    Returns, per run, its bytes (None when the log could not be read) and, per want,
    whether the checksum held."""
    out: list[tuple[bytes | None, list[bool]]] = []
    for run in runs:
        try:
            data = logs.read(run.log_id, run.offset, run.length)
        except (FormatError, OSError) as e:
            log.warning("planned read of chunk %d failed: %s", run.chunk_id, e)
            out.append((None, []))
            continue
        mv = memoryview(data)
        oks = []
        for w in run.wants:
            a = w.rec.offset - run.offset
            oks.append(checksum(mv[a : a + w.rec.size]) == w.rec.data_xxh)
        out.append((data, oks))
    return out


#: bytes asked into the page cache at once for a stream read in training processes
ADVISE_BATCH = 64 << 20


def advise_runs(logs, runs: Sequence[Run]) -> int:
    """Thread: each run asked into the page cache (:meth:`LogStore.advise`); the bytes."""
    n = 0
    for run in runs:
        try:
            logs.advise(run.log_id, run.offset, run.length)
        except OSError as e:
            log.info("read-ahead advice for chunk %d failed: %s", run.chunk_id, e)
            continue
        n += run.length
    return n


@dataclass(slots=True)
class _Buf:
    """The bytes of one run, accounted against the budget until every record read from
    it was taken or dropped."""

    length: int
    remaining: int


@dataclass(slots=True)
class _Ready:
    rec: Record
    data: memoryview
    buf: _Buf
    pos: int


class ReadPlanner(Observer):
    """Mount-wide: the read plans of all streams and their shared memory budget. It
    hears every open (:class:`~dlcachefs.cache.readers.OpenObserver`): a stream's reader
    moved.

    What it uses: ``versions.servable`` (which records to read), the logs and the disk
    limiter (the reads), ``writer.pin``/``unpin`` (no eviction under a read), the memory
    tier's ``reserve``/``unreserve`` (the budget), ``index.get_record`` (is a failed
    record still the indexed one), ``reader.bad`` (drop a record that failed its
    checksum), the read-ahead set (files held for their opens are not read again) and
    the counters; ``board``: where the read-ahead of streams read in training processes
    is posted for those processes to carry out (None: the daemon advises the kernel
    itself)."""

    def __init__(self, *, index: Index, logs: LogStore, writer: ChunkWriter,
                 memtier: MemoryTier, counters: Counters,
                 disk_limiter: trio.CapacityLimiter, reader: LogReader, versions: Versions,
                 readahead: ReadAhead, budget: int, lead: int = 1024,
                 max_batch: int = 4 << 20, idle: float = IDLE,
                 board: AdviceBoard | None = None) -> None:
        self.index = index
        self.logs = logs
        self.writer = writer
        self.memtier = memtier
        self.counters = counters
        self.disk_limiter = disk_limiter
        self.reader = reader
        self.versions = versions
        self.readahead = readahead
        self.board = board
        self.idle = idle
        self.budget = max(budget, 1)
        self.lead = lead
        self.max_batch = max_batch
        self.held = 0  # bytes reserved by all plans (in flight or waiting to be taken)
        self.plans: dict[str, ReadPlan] = {}
        # per stream, the order whose plan task has begun (its plan may be over since)
        self._begun: dict[str, list[int]] = {}

    def drop_board(self) -> None:
        """The board failed: closed, and the daemon asks the kernel itself from now on."""
        if self.board is not None:
            self.board.close()
            self.board = None

    def forget(self, stream) -> None:
        """A stream that ended (its job forgotten): its plan and its last order go."""
        p = self.plans.pop(stream.key, None)
        if p is not None:
            p.close()
        self._begun.pop(stream.key, None)

    def plan_for(self, stream) -> ReadPlan | None:
        """The active plan of a stream's current epoch, or None."""
        if stream is None:
            return None
        p = self.plans.get(stream.key)
        if (p is None or p.closed or p.order is not stream.order
                or stream.epoch != stream.target_epoch):
            return None  # no plan, or a new epoch was announced and is not planned yet
        return p

    def pending(self, stream) -> bool:
        """A new epoch was announced and its order is being computed (or it was just
        configured and its plan's task has not begun yet), and no log was laid out for it:
        it will be read through a plan, so its first opens read single records rather
        than probe with whole chunks."""
        if stream is None or stream.target_epoch is None or stream.error is not None:
            return False
        if stream.epoch == stream.target_epoch:
            return self.wanted(stream) and self._begun.get(stream.key) is not stream.order
        nl = stream.next_log
        return nl is None or nl.epoch != stream.target_epoch

    def opened(self, ev: OpenEvent) -> None:
        """An open of a stream's reader: its plan may have room or positions to plan, and
        it knows now where the epoch's reads are served."""
        p = self.plans.get(ev.stream.key) if ev.stream is not None else None
        if p is not None:
            p.told = True
            p.poke()

    def poke(self, stream) -> None:
        """The stream's reader moved: its plan may have room or positions to plan."""
        p = self.plans.get(stream.key) if stream is not None else None
        if p is not None:
            p.poke()

    def reads_records(self, stream, ino: int) -> bool:
        """Whether ``ino`` is a sample of a stream's epoch read record by record (a known
        order and no log laid out for it, served by pages or not): its chunk is never
        read whole for one open (a probe would read records the plan reads, or the
        kernel holds). Not a file outside the dataset (a validation set the same
        process reads keeps the ordinary path), nor before a plan listed the members,
        nor while the next epoch, announced, is being configured and was laid out (its
        first opens, before the switch, read the new log's chunks whole: alone, they
        read records the preloads then read again with their chunks)."""
        if (stream is None or stream.samples is None or not stream.order
                or stream.current_log is not None):
            return False
        nl = stream.next_log
        if (nl is not None and stream.target_epoch is not None
                and stream.target_epoch != stream.epoch and nl.epoch == stream.target_epoch):
            return False
        members = stream.samples.members()
        return members is not None and ino in members

    def reads_whole(self, stream, ino: int, rec) -> bool:
        """Whether an open of ``ino`` (cached in ``rec``) may read the record's whole
        chunk (the reader's choice then, :meth:`LogReader._whole_chunk`): not for a
        sample read record by record (:meth:`reads_records`) or while the stream's plan
        is being made, nor for a record outside the log laid out for the stream's epoch
        (a file changed since the log was planned, or a slot not sealed yet): that
        epoch's other samples come from its log, so such a chunk serves one record."""
        if stream is not None:
            laid = stream.laid_out_log()
            if laid is not None and rec.log_id != laid:
                return False
        return not self.reads_records(stream, ino) and not self.pending(stream)

    def wanted(self, stream) -> bool:
        """Whether this stream's epoch should be read through a plan: its order is known
        and its log was not laid out for it (that one is read whole chunk by chunk), and
        the kernel's page cache did not serve its last epoch (it holds the dataset: a
        plan would read from the logs what no READ asks for)."""
        return (stream.samples is not None and bool(stream.order)
                and stream.current_log is None and not stream.pages_served)

    async def run(self, stream) -> None:
        """The plan of the stream's epoch that starts now (a task of its epoch nursery);
        replaces its previous plan. Never raises, except cancellation."""
        self._begun[stream.key] = stream.order
        old = self.plans.pop(stream.key, None)
        if old is not None:
            old.close()
        while stream.pages_served and not self.wanted(stream):
            # the kernel's pages served the last epoch: no plan unless READs come back
            # this epoch (then it starts from the reader's position; the verdict may have
            # turned again before this task ran)
            await stream.pages_lost.wait()
        if not self.wanted(stream):
            return
        plan = self.plans[stream.key] = ReadPlan(self, stream)
        try:
            await plan.run()
            plan.close()  # done: the epoch's later opens read as if it had no plan
        except Exception:  # noqa: BLE001 - a background task must never end the daemon
            log_failure(log, "stream %s: read plan stopped", stream.key)
            plan.close()
        except BaseException:
            plan.close()
            raise
        finally:
            if plan.closed and self.plans.get(stream.key) is plan:
                del self.plans[stream.key]

    def _reserve(self, n: int) -> None:
        self.held += n
        self.memtier.reserve(n)

    def _unreserve(self, n: int) -> None:
        self.held -= n
        self.memtier.unreserve(n)

    def stats(self) -> dict:
        return {k: p.stats() for k, p in self.plans.items()}


class ReadPlan:
    """One stream's epoch, read in its order ahead of the reader (see the module doc)."""

    def __init__(self, planner: ReadPlanner, stream) -> None:
        self.planner = planner
        self.stream = stream
        self.order = stream.order  # identity tells a plan of a replaced epoch apart
        self.inos = stream.samples.inos
        self.consumed = stream.consumed
        self.members: frozenset[int] | None = None  # the dataset's inodes (None: not yet)
        self.next = 0  # first position not yet planned
        self.held = 0  # bytes this plan reserved
        self.ready: dict[int, _Ready] = {}
        self.inflight: dict[int, trio.Event] = {}
        # inodes whose open waits in take() for their batch: the reader's position already
        # moved past them (note_open runs before the open loads), so _drop_behind must
        # leave their records for the open
        self.taking: dict[int, int] = {}
        self.closed = False
        self.idle = False  # gave back what it held: reads nothing until the reader moves
        self._seen = (-1, -1)  # (reader's position, takes) when progress was last noted
        self._takes = 0
        self._progress_at = 0.0
        self._changed = trio.Event()
        # an open of the stream was seen since the plan began: whether its reads are served
        # in the training's processes (Stream.in_process, from the last open) is known
        self.told = False

    def poke(self) -> None:
        self._changed.set()

    def stats(self) -> dict:
        return {"next": self.next, "ready": len(self.ready), "in_flight": len(self.inflight),
                "held_bytes": self.held, "idle": self.idle}

    def covers(self, ino: int) -> bool:
        """Whether ``ino`` is a sample of this epoch's dataset (not, say, a validation
        file the same process reads: that one keeps the ordinary read path)."""
        return self.members is None or ino in self.members

    def holds(self, ino: int) -> bool:
        """Whether the plan has read ``ino``'s record or is reading it (an open takes
        those bytes). False once handed out: a second open of the sample in the epoch
        (a loader that opens each file twice) reads it itself, if a READ comes."""
        return ino in self.ready or ino in self.inflight

    def _reserve(self, n: int) -> None:
        self.held += n
        self.planner._reserve(n)

    def _unreserve(self, n: int) -> None:
        self.held -= n
        self.planner._unreserve(n)

    async def take(self, ino: int, rec: Record) -> memoryview | None:
        """The bytes of ``rec`` when the plan read them (waits for a batch in flight);
        None when it did not (the open reads the record itself)."""
        self._takes += 1
        self.taking[ino] = self.taking.get(ino, 0) + 1
        try:
            while (ev := self.inflight.get(ino)) is not None:
                await ev.wait()
        finally:
            if self.taking[ino] == 1:
                del self.taking[ino]
            else:
                self.taking[ino] -= 1
        r = self.ready.pop(ino, None)
        self.poke()
        if r is None:
            return None
        self._release(r.buf)
        if r.rec != rec:  # moved or replaced since it was read
            return None
        return r.data

    def close(self) -> None:
        """Give back everything held; later takes find nothing."""
        if self.closed:
            return
        self.closed = True
        for r in self.ready.values():
            self._release(r.buf)
        self.ready.clear()
        self.poke()

    def _release(self, buf: _Buf) -> None:
        buf.remaining -= 1
        if buf.remaining == 0:
            self._unreserve(buf.length)

    # ----- the task -------------------------------------------------------------------

    async def run(self) -> None:
        self.members = await trio.to_thread.run_sync(self.stream.samples.build_members)
        self._progressed()
        while not self.closed:
            if self._progressed():
                self.idle = False
            self._drop_behind()
            # paused while the kernel's pages serve the epoch's opens (what it would read
            # ahead would not be asked for); what it holds is taken or dropped as the
            # reader passes. READs coming back resume it from the reader's position.
            paused = self.stream.pages_served
            batch = [] if self.idle or paused else self._collect()
            if batch:
                await self._read(batch)
                continue
            if self.next >= len(self.order) and not self.ready and not self.inflight:
                return  # the whole epoch was planned and everything handed out
            if self.idle or not self.held:
                await self._changed.wait()  # nothing held: wait for the reader as long
            else:
                with trio.move_on_at(self._progress_at + self.planner.idle):
                    await self._changed.wait()
                if not self._progressed() and not self._changed.is_set() and \
                        trio.current_time() >= self._progress_at + self.planner.idle:
                    self._go_idle()
            self._changed = trio.Event()

    def _progressed(self) -> bool:
        """Whether the reader moved or took since the last call (then notes the time)."""
        mark = (self.stream.position, self._takes)
        if mark == self._seen:
            return False
        self._seen = mark
        self._progress_at = trio.current_time()
        return True

    def _go_idle(self) -> None:
        """The reader stopped (the job ended or hangs mid-epoch): give back the memory
        held and read nothing until it moves again; then the window is read again from
        its position."""
        log.info("stream %s: no reads for %.0f s: the read plan gives back %d bytes",
                 self.stream.key, self.planner.idle, self.held)
        for r in self.ready.values():
            self._release(r.buf)
        self.ready.clear()
        self.next = self.stream.position
        self.idle = True

    def _drop_behind(self) -> None:
        """Records at positions the reader has passed were served some other way, except
        those whose open is waiting in :meth:`take` (it moved the position itself)."""
        pos = self.stream.position
        for ino in [i for i, r in self.ready.items() if r.pos < pos and i not in self.taking]:
            self._release(self.ready.pop(ino).buf)

    def _collect(self) -> list[tuple[int, Want]]:
        """The next positions to read: within the lead, within the free budget."""
        pl = self.planner
        s = self.stream
        if s.order is not self.order:
            self.close()
            return []
        share = pl.budget // max(1, len(pl.plans))
        room = min(pl.budget - pl.held, share - self.held, pl.max_batch)
        if self.held > 0 and room < min(share // 2, pl.max_batch):
            return []  # read in batches (grouping), not one record at a time
        self.next = max(self.next, s.position)
        lead = pl.lead
        if not s.pages_judged and s.position < FIRST_LEAD:
            # the epoch's first opens tell whether the kernel's pages serve it
            # (pages_served): until then, read only a little ahead of them, not a whole
            # small dataset the kernel may hold already
            lead = min(lead, FIRST_LEAD)
        if not self.told:
            # where this epoch's reads are served is not known yet (a new stream, or one
            # whose last epoch was read otherwise): records read into memory for readers
            # that read the logs themselves would be read twice, so only a few
            lead = min(lead, FIRST_LEAD)
        if s.in_process:
            # advised, not held: no memory to wait for; asked in quarters of the lead
            # (a thread and a few calls per quarter, not per record the reader passes)
            room = ADVISE_BATCH
            if self.next - s.position > lead - lead // 4:
                return []
        out: list[tuple[int, Want]] = []
        seen: set[int] = set()
        size = 0
        n = len(self.order)
        while self.next < n and self.next - s.position < lead:
            p = self.next
            ino = self.inos[self.order[p]]
            if (not ino or self.consumed[p] or ino in self.ready or ino in self.inflight
                    or ino in seen or ino in pl.readahead):
                # (held in memory already: fetched ahead, its open takes those bytes)
                self.next += 1
                continue
            rec = pl.versions.servable(ino)  # any version: take() compares records
            if rec is None or rec.size > pl.budget * MIN_USEFUL:
                self.next += 1  # not cached (yet), or too large to hold: the open's job
                continue
            # a run covers at most useful / MIN_USEFUL bytes: reserve for that
            if (size + rec.size) / MIN_USEFUL > room and (out or self.held):
                break
            out.append((p, Want(ino, rec)))
            seen.add(ino)
            size += rec.size
            self.next += 1
        return out

    async def _read(self, batch: list[tuple[int, Want]]) -> None:
        pl = self.planner
        if self.stream.in_process:
            # its reader reads the logs itself: into the page cache, not our memory
            runs = group_reads(w for _, w in batch)
            if pl.board is not None:
                # the readers ask the kernel for it (the kernel's work on their cores,
                # not on the daemon's one: dlcachefs.store.advice); a few bytes here.
                # Unless they do not take what was posted (none reads now, or one holds
                # the board): then this batch is asked here, as without a board.
                try:
                    if not pl.board.lagging():
                        n = pl.board.post((r.log_id, r.offset, r.length) for r in runs)
                        pl.counters.planned_posted_bytes += n
                        return
                    pl.counters.planned_lagged += 1
                except Exception as e:  # noqa: BLE001 - OSError, or a board someone wrote
                    log.warning("read-ahead board: %s; the daemon reads ahead for in-process "
                                "readers itself", e)
                    pl.drop_board()
            n = await trio.to_thread.run_sync(advise_runs, pl.logs, runs,
                                              limiter=pl.disk_limiter)
            pl.counters.planned_advised_bytes += n
            return
        pos = {w.ino: p for p, w in batch}
        runs = []
        for r in group_reads(w for _, w in batch):
            if pl.writer.pin(r.chunk_id):  # False: being evicted right now
                runs.append(r)
        if not runs:
            return
        total = sum(r.length for r in runs)
        self._reserve(total)
        ev = trio.Event()
        for r in runs:
            for w in r.wants:
                self.inflight[w.ino] = ev
        kept = 0
        try:
            results = await trio.to_thread.run_sync(read_runs, pl.logs, runs,
                                                    limiter=pl.disk_limiter)
            c = pl.counters
            for r, (data, oks) in zip(runs, results, strict=True):
                if data is None:
                    continue
                c.planned_reads += 1
                c.planned_bytes += r.length
                mv = memoryview(data)
                buf = _Buf(r.length, 0)
                for w, ok in zip(r.wants, oks, strict=True):
                    if not ok:
                        if pl.index.get_record(w.ino) == w.rec:  # pinned: real damage
                            pl.reader.bad(w.ino, w.rec.chunk_id)
                        continue
                    a = w.rec.offset - r.offset
                    if not self.closed:
                        self.ready[w.ino] = _Ready(w.rec, mv[a : a + w.rec.size], buf,
                                                   pos[w.ino])
                        buf.remaining += 1
                        c.planned_records += 1
                if buf.remaining:
                    kept += r.length
        finally:
            for r in runs:
                pl.writer.unpin(r.chunk_id)
                for w in r.wants:
                    if self.inflight.get(w.ino) is ev:
                        del self.inflight[w.ino]
            ev.set()
            self._unreserve(total - kept)
