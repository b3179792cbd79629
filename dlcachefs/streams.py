"""Streams: one per (job, rank) that announced its sampler; clairvoyant prefetch for each.

When a stream knows its dataset (an ImageFolder root), its sampler and its epoch, the
order of that epoch is known exactly (:mod:`dlcachefs.sampler`). The prefetcher then
fetches the samples from the source in that order, ahead of the reader, into the cache
(the chunk writer packs them into chunks in fetch order, so the epoch's log comes out in
its read order).

Reader position: opens are attributed to a stream by process (the process that wrote
the control lines and its descendants, i.e. DataLoader workers, found through
``/proc/<pid>/stat`` parents). Each open marks the first not-yet-consumed position of
that sample in the order; ``position`` is the first position not consumed. Workers read
slightly out of order; that only leaves a few holes behind ``position`` for a moment.

Bounds: at most ``lead`` samples (and ``lead_bytes``) ahead of the reader, at most
``concurrency`` fetches in flight, and never faster than the chunk writer takes them.

Concurrency: all state on the trio loop; each stream's prefetcher is a task in the
engine's nursery, cancelled and replaced when the stream's epoch or sampler changes.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import trio

from .control import JobState, StreamState
from .errors import DlcError
from .reorder import NextEpochLog
from .samplelist import SampleList, image_folder
from .sampler import OrderReplayer, SamplerSpec

log = logging.getLogger(__name__)


@dataclass
class Stream:
    job: str
    rank: int
    dataset: str | None = None
    samples: SampleList | None = None
    replayer: OrderReplayer | _Explicit | None = None
    epoch: int | None = None
    order: list[int] = field(default_factory=list)  # dataset indices of the current epoch
    positions: dict[int, list[int]] = field(default_factory=dict)  # ino -> positions, reversed
    consumed: bytearray = field(default_factory=bytearray)
    ready: bytearray = field(default_factory=bytearray)
    position: int = 0
    prefetched_upto: int = 0
    stall_seconds: float = 0.0
    bytes_from_source: int = 0
    prefetched: int = 0
    cancel: trio.CancelScope | None = None
    moved: trio.Event = field(default_factory=trio.Event)
    pids: set[int] = field(default_factory=set)
    error: str | None = None
    target_epoch: int | None = None  # announced; ``epoch`` catches up once its order is known
    early: list[int] = field(default_factory=list)  # opens seen before the order was known
    next_log: NextEpochLog | None = None  # the next epoch's log being laid out (LCache)
    memory_prefetch: bool = False  # dataset > half the cache: prefetch into memory only
    current_log: NextEpochLog | None = None  # the reordered log this epoch reads
    explicit: dict | None = None  # epoch -> order, for ``sampler explicit`` (order lines)
    # the next epoch's order when known: sample -> first position (the policy's future)
    next_first: dict[int, int] | None = None
    next_first_order: list[int] = field(default_factory=list)
    used: set[int] = field(default_factory=set)  # inodes served this epoch (substitution)
    substituted: dict[int, int] = field(default_factory=dict)  # requested -> served ino
    substituted_before: dict[int, int] = field(default_factory=dict)  # the last epoch's
    epoch_tick: int = 0  # the policy clock's tick when this epoch began
    # the announced epoch already begun for importance while its order is being replayed
    # (a replay restarted by ``on_order`` must not begin it twice)
    begun: int | None = None
    substitutions: dict[int, int] = field(default_factory=dict)  # epoch -> count
    # open latencies, for the job's measured caching benefit (iCACHE III-D)
    hit_s: float = 0.0
    hit_n: int = 0
    miss_s: float = 0.0
    miss_n: int = 0
    epoch_t0: float = 0.0

    def note_latency(self, cached: bool, seconds: float) -> None:
        if cached:
            self.hit_s += seconds
            self.hit_n += 1
        else:
            self.miss_s += seconds
            self.miss_n += 1

    def benefit(self, now: float) -> float | None:
        """Estimated T_cacheless / T_cache of this stream's epoch so far: its wall time
        per sample, and what it would be if its cache hits had waited like its misses
        (reads are sequential per loader worker). None until both were measured."""
        n = self.hit_n + self.miss_n
        if self.hit_n < 20 or self.miss_n < 20 or now <= self.epoch_t0:
            return None
        per = (now - self.epoch_t0) / n
        extra = self.hit_n / n * max(0.0, self.miss_s / self.miss_n - self.hit_s / self.hit_n)
        return (per + extra) / per

    @property
    def key(self) -> str:
        return f"{self.job}/{self.rank}"

    def stats(self) -> dict:
        hi = min(self.prefetched_upto, len(self.order))
        lead = sum(1 for p in range(self.position, hi) if self.ready[p])
        return {"epoch": self.epoch, "position": self.position, "samples": len(self.order),
                "prefetch_lead": lead, "prefetched": self.prefetched,
                "stall_seconds": round(self.stall_seconds, 3),
                "bytes_from_source": self.bytes_from_source, "dataset": self.dataset,
                "substitutions": {str(k): v for k, v in sorted(self.substitutions.items())},
                "error": self.error,
                "next_log": None if self.next_log is None else {
                    "epoch": self.next_log.epoch, "chunks": len(self.next_log.chunks),
                    "sealed": self.next_log.sealed, "failed": self.next_log.failed}}


class StreamManager:
    """Owns the streams and their prefetch tasks. ``engine`` provides ``ns``, ``writer``,
    ``cfg`` and the coroutine ``prefetch_one(ino, stream) -> bool``."""

    def __init__(self, engine, lead: int = 1024, lead_bytes: int = 512 << 20,
                 concurrency: int | None = None) -> None:
        self.engine = engine
        self.lead = lead
        self.lead_bytes = min(lead_bytes, engine.cfg.cache_size // 2)
        self.concurrency = concurrency or engine.cfg.source_threads
        self.streams: dict[tuple[str, int], Stream] = {}
        self._pid_stream: OrderedDict[int, Stream | None] = OrderedDict()
        self._nursery: trio.Nursery | None = None
        self._samplelists: dict[str, SampleList] = {}

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Owns the prefetch tasks, until :meth:`close` or cancellation."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def close(self) -> None:
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
            self._nursery = None

    # ----- control updates (trio loop, from ControlState.apply) ---------------------

    def on_stream(self, st: StreamState, js: JobState, pid: int) -> None:
        s = self.streams.get((st.job, st.rank))
        if s is None:
            s = self.streams[(st.job, st.rank)] = Stream(st.job, st.rank)
        s.pids.add(pid)
        self._pid_stream.clear()  # attribution may have changed
        if js.dataset is None or st.sampler is None or st.epoch is None:
            return
        if self._nursery is None:
            return
        # the previous epoch's prefetch stops now, even if its task has not started yet
        if s.cancel is not None:
            s.cancel.cancel()
        s.cancel = trio.CancelScope()
        s.target_epoch = st.epoch
        s.early = []
        s.explicit = st.orders if st.sampler.kind == "explicit" else None
        self._nursery.start_soon(self._configure, s, s.cancel, js.dataset, st.sampler, st.epoch)

    def on_order(self, st: StreamState, js: JobState, epoch: int, order, pid: int) -> None:
        """An explicit order (``order`` lines, the importance sampler) was completed."""
        s = self.streams.get((st.job, st.rank))
        if s is not None and s.target_epoch == epoch and s.epoch != epoch:
            self.on_stream(st, js, pid)  # its epoch was announced first: start it now

    async def _configure(self, s: Stream, cs: trio.CancelScope, dataset: str, spec: SamplerSpec,
                         epoch: int) -> None:
        """Replay the epoch's order, then prefetch it. Never raises: a background task's
        error is the stream's error, shown in stats, not the daemon's end."""
        with cs:
            try:
                await self._configure_now(s, dataset, spec, epoch)
            except Exception as e:  # noqa: BLE001
                s.error = f"{type(e).__name__}: {e}"
                log.exception("stream %s: prefetch stopped", s.key)

    async def _configure_now(self, s: Stream, dataset: str, spec: SamplerSpec, epoch: int
                             ) -> None:
        try:
            samples = self._samplelists.get(dataset)
            if samples is None:
                samples = await trio.to_thread.run_sync(image_folder, self.engine.ns, dataset)
                self._samplelists = {dataset: samples}  # keep one: they can be large
            if (s.target_epoch == epoch and s.begun != epoch
                    and trio.current_effective_deadline() != -float("inf")):
                # the epoch begins for importance and substitution once its dataset is
                # listed, not once its order is replayed (a torch sampler's replay first
                # imports torch: seconds on a busy machine, a whole epoch of a small
                # dataset): from here the job's losses count and the H-list is rebuilt
                s.dataset, s.begun = dataset, epoch
                self.engine.epoch_started(s, samples)
                s.used, s.substituted_before, s.substituted = set(), s.substituted, {}
            if spec.kind == "explicit":  # a copy: control may drop old epochs meanwhile
                s.replayer = _Explicit(spec, dict(s.explicit or {}), len(samples))
            elif (s.replayer is None or s.replayer.spec != spec or s.samples is not samples
                    or spec.per_epoch):
                s.replayer = OrderReplayer(spec, len(samples), base_epoch=epoch)
            order = await trio.to_thread.run_sync(s.replayer.order, epoch)
            nxt: list[int] = []
            nxt_first: dict[int, int] | None = None
            if s.replayer.known(epoch + 1):  # the policy's future reaches into it
                nxt = await trio.to_thread.run_sync(s.replayer.order, epoch + 1)
                nxt_first = await trio.to_thread.run_sync(_first_positions, nxt, samples)
            need = await trio.to_thread.run_sync(self._dataset_bytes, samples)
        except (DlcError, ValueError, OSError) as e:
            s.error = str(e)
            log.warning("stream %s: cannot replay its order: %s", s.key, e)
            return
        if s.target_epoch != epoch or trio.current_effective_deadline() == -float("inf"):
            return  # a newer announcement replaced this one while the order was computed
        # no await from here on: the stream switches epochs atomically
        s.error = None
        # partial caching the LCache way needs the next epoch's log; without a known next
        # order the cache is filled the ordinary way, by the policy's admission
        s.memory_prefetch = (2 * need > self.engine.cfg.cache_size and self.engine.cfg.reorder
                             and nxt_first is not None)
        s.dataset, s.samples, s.epoch, s.order = dataset, samples, epoch, order
        positions: dict[int, list[int]] = {}
        for p in range(len(order) - 1, -1, -1):
            ino = samples.inos[order[p]]
            if ino:
                positions.setdefault(ino, []).append(p)
        s.positions = positions
        # a sample that is not a readable file (dangling link) is never opened: count it read
        s.consumed = bytearray(0 if samples.inos[i] else 1 for i in order)
        s.ready = bytearray(len(order))
        s.position = s.prefetched_upto = 0
        self.engine.drop_ready(s.key)
        s.begun = None  # switched: announcing this epoch again begins it again
        s.epoch_tick = self.engine.future.tick
        s.hit_s = s.miss_s = 0.0
        s.hit_n = s.miss_n = 0
        s.epoch_t0 = time.monotonic()
        s.next_first, s.next_first_order = nxt_first, nxt
        early, s.early = s.early, []
        for ino in early:
            self.note_open(s, ino)
        log.info("stream %s: epoch %d, %d samples, order known", s.key, epoch, len(order))
        prev, s.next_log = s.next_log, None
        if s.current_log is not None and s.memory_prefetch and prev is not None:
            # LCache line 16, release after use: the last epoch's log is consumed; what of
            # it the new log did not take is not worth the room (partial caching only).
            # Only once the new log is complete: its gaps are filled from the old one.
            self._nursery.start_soon(self._release_after, prev, s.current_log)
        s.current_log = None
        if prev is not None:
            prev.unprotect()  # its epoch has come: its chunks are ordinary cache now
            if prev.epoch == epoch:
                prev.request_finish()  # this epoch's log: fill its gaps and seal it
                s.current_log = prev
                prev.start_reading()
            else:
                prev.abandon()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._prefetch, s)
            await self._plan_next(s, samples, epoch)

    async def _plan_next(self, s: Stream, samples: SampleList, epoch: int) -> None:
        """LCache: when epoch+1's order is known, lay out its log while this epoch runs."""
        assert s.replayer is not None and self._nursery is not None
        if not self.engine.cfg.reorder or not s.replayer.known(epoch + 1):
            return
        # LCache: two logs. When the cache cannot hold two copies of the dataset, the next
        # log holds the samples that come first in its epoch, as many as the cache holds
        # (the current log is released chunk by chunk as it is consumed, so the two fit);
        # the rest is prefetched from the source in order, into memory, when it runs.
        cfg = self.engine.cfg
        budget = max(cfg.cache_size - 2 * cfg.chunk_size, cfg.chunk_size) \
            if s.memory_prefetch else None
        order = await trio.to_thread.run_sync(s.replayer.order, epoch + 1)
        nl = NextEpochLog(self.engine, s.key, epoch + 1)
        await nl.plan([samples.inos[i] for i in order], budget)
        if budget is not None:
            log.info("stream %s: the cache holds %d of %d samples of epoch %d's log",
                     s.key, len(nl.slots), len(samples), epoch + 1)
        if s.target_epoch != epoch:  # a newer epoch began while planning
            nl.abandon()
        else:
            s.next_log = nl
            # samples this epoch already served before the plan existed go in from the cache
            done = [samples.inos[s.order[p]] for p in range(len(s.order)) if s.consumed[p]]
            self._nursery.start_soon(nl.backfill, done)
        self._nursery.start_soon(nl.run)

    async def _release_after(self, filling: NextEpochLog, old: NextEpochLog) -> None:
        await filling.done.wait()
        for c in old.chunks:
            if c.sealed:
                self.engine.writer.retire_chunk(c.chunk_id)

    def sample_list(self, dataset: str) -> SampleList | None:
        """The ImageFolder sample list of ``dataset`` if a stream has listed it."""
        return self._samplelists.get(dataset)

    def job_dataset(self, job: str) -> str | None:
        for s in self.streams.values():
            if s.job == job and s.dataset is not None:
                return s.dataset
        return None

    def _dataset_bytes(self, samples: SampleList) -> int:
        """Thread: total size of the dataset's files (LMDB reads only)."""
        return sum(self.engine.size_of(i) for i in set(samples.inos) if i)

    # ----- prefetch -------------------------------------------------------------------

    async def _prefetch(self, s: Stream) -> None:
        assert s.samples is not None
        slots = trio.Semaphore(self.concurrency)
        lead_bytes = self.lead_bytes
        if s.memory_prefetch:
            lead_bytes = min(lead_bytes, self.engine.ready_limit)
        sizes_ahead = 0
        window: list[tuple[int, int]] = []  # (position, size) prefetched, for lead_bytes
        async with trio.open_nursery() as nursery:
            for p in range(len(s.order)):
                ino = s.samples.inos[s.order[p]]
                size = self.engine.size_of(ino) if ino else 0
                # stay within `lead` samples and `lead_bytes` of the reader
                while True:
                    while window and window[0][0] < s.position:
                        sizes_ahead -= window.pop(0)[1]
                    if p - s.position < self.lead and (sizes_ahead + size <= lead_bytes
                                                       or not window):
                        break
                    await s.moved.wait()
                await slots.acquire()
                s.prefetched_upto = p + 1
                window.append((p, size))
                sizes_ahead += size
                nursery.start_soon(self._fetch_one, s, p, ino, slots)

    async def _fetch_one(self, s: Stream, p: int, ino: int, slots: trio.Semaphore) -> None:
        try:
            if ino and not s.consumed[p]:
                fetched = await self.engine.prefetch_one(ino, s)
                if fetched:
                    s.prefetched += 1
            s.ready[p] = 1
        except DlcError as e:
            log.debug("prefetch of inode %d failed: %s", ino, e)
        finally:
            slots.release()

    # ----- reader attribution ---------------------------------------------------------

    def stream_of(self, pid: int) -> Stream | None:
        if not self.streams:
            return None
        if pid in self._pid_stream:
            return self._pid_stream[pid]
        owners = {p: s for s in self.streams.values() for p in s.pids}
        found, cur = None, _tgid(pid)
        for _ in range(16):  # the writer itself, or an ancestor of the reader
            if cur in owners:
                found = owners[cur]
                break
            cur = _parent(cur)
            if cur <= 1:
                break
        self._pid_stream[pid] = found
        while len(self._pid_stream) > 4096:
            self._pid_stream.popitem(last=False)
        return found

    def note_open(self, s: Stream, ino: int) -> None:
        """Mark the sample consumed and move the stream's position."""
        if s.epoch != s.target_epoch:
            if len(s.early) < 1 << 20:
                s.early.append(ino)
            return
        ps = s.positions.get(ino)
        if not ps:
            return
        p = ps.pop()
        s.consumed[p] = 1
        if s.memory_prefetch and s.current_log is not None:
            done = s.current_log.used(ino)  # LCache line 16: release a chunk after use
            if done is not None:
                self.engine.writer.retire_chunk(done)
        moved = False
        while s.position < len(s.consumed) and s.consumed[s.position]:
            s.position += 1
            moved = True
        if moved:
            s.moved.set()
            s.moved = trio.Event()

    def stats(self) -> dict:
        return {s.key: s.stats() for s in self.streams.values()}


class _Explicit:
    """Orders announced with ``order`` lines, in place of a replayed sampler."""

    def __init__(self, spec: SamplerSpec, orders: dict, n: int) -> None:
        self.spec, self.orders, self.n = spec, orders, n

    def known(self, epoch: int) -> bool:
        return epoch in self.orders

    def order(self, epoch: int) -> list[int]:
        if epoch not in self.orders:
            raise ValueError(f"no order announced for epoch {epoch} (send 'order' lines first)")
        out = [int(i) for i in self.orders[epoch]]
        if any(not 0 <= i < self.n for i in out):
            raise ValueError(f"the order of epoch {epoch} names a sample outside 0..{self.n - 1}")
        return out


def _first_positions(order: list[int], samples: SampleList) -> dict[int, int]:
    first: dict[int, int] = {}
    for p, i in enumerate(order):
        ino = samples.inos[i]
        if ino and ino not in first:
            first[ino] = p
    return first


def _tgid(tid: int) -> int:
    """FUSE reports the calling thread's id: map it to its process."""
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return tid


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return 0
    # the command name may contain spaces and parentheses: split after the last ')'
    return int(data[data.rindex(b")") + 2 :].split()[1])

