"""Next-epoch planning (LCache): whether, and how large, each stream's next epoch's log is
laid out while its epoch runs, and what becomes of the logs at an epoch switch.

When a stream knows its next epoch's order, :meth:`NextEpochPlanner.plan_next` plans a
:class:`~dlcachefs.clairvoyance.reorder.NextEpochLog` of it (unless the order repeats,
the kernel's page cache serves the epochs, or the datasets read now fit in the memory
tier), sized for the cache shared by the streams laying out theirs
(:meth:`_ranks_laying_out`). At the switch (:meth:`begin_epoch`) the log laid out in the
new epoch's order becomes its current log; when the cache cannot hold two copies of the
dataset (``memory_prefetch``) its chunks stay protected until read and are released
after use (LCache line 16), and the last epoch's log is released once the new one is
complete. Logs of streams that stopped opening are no longer protected
(:meth:`unprotect_idle`).

The planner also reads back into the next logs the samples served elsewhere: the reads
served in training processes (:meth:`NextEpochPlanner.backfill_reads`, :data:`BACKFILLS`
logs at a time, from chunks pinned when the reads were reported), and, each time room
is freed, the slots that found none (:meth:`NextEpochPlanner.retry_no_room`: one round
shares the room freed between the logs, less the room promised to retries still
reading).

Concurrency: trio loop; the next order's inodes and the samples already served are
listed in worker threads. The planner owns no nursery: a log's tasks (``run``, the
backfill of samples already served) go to the nursery the stream manager hands to
:meth:`~NextEpochPlanner.plan_next` and :meth:`~NextEpochPlanner.begin_epoch`, and the
read-backs to the one it binds (:meth:`~NextEpochPlanner.bind`: its own, from its
``run`` until its ``close``; before and after, nothing is read back). Both outlive the
epoch that planned them. ``_promised`` and ``_rounds`` are changed only on the trio
loop, without an await between reading and writing them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import trio

from dlcachefs.cache.memtier import MemoryTier
from dlcachefs.cache.namespace import Namespace
from dlcachefs.cache.writer import ChunkWriter
from dlcachefs.clairvoyance.positions import consumed_inos, order_inos
from dlcachefs.clairvoyance.reorder import NextEpochLog, RoomRound
from dlcachefs.clairvoyance.replay import RANKED
from dlcachefs.clairvoyance.samplelist import SampleList
from dlcachefs.clairvoyance.stream import GIVEN_UP, IDLE_S, Stream, StreamTable, same_dataset
from dlcachefs.config import Config
from dlcachefs.store.integrity import log_failure

log = logging.getLogger(__name__)

#: next-epoch logs backfilled at once from one drain of reads served in training
#: processes (each reads its records back from pinned chunks, on the disk limiter)
BACKFILLS = 2


class NextEpochPlanner:
    """Lays out the streams' next epochs' logs (see the module doc)."""

    def __init__(self, cfg: Config, streams: StreamTable, ns: Namespace,
                 writer: ChunkWriter, memtier: MemoryTier, events_lost: Callable[[], int],
                 new_log: Callable[[str, int], NextEpochLog]) -> None:
        """``writer``: its limit (the cache, or a shared root's share), its protected
        chunks, ``retire_chunk``; ``memtier``: its limit (whether a log is worth laying
        out); ``events_lost()``: how many events of reads served in training processes
        were lost (dropped from a full ring: those reads never reach a log's release after
        use, see :meth:`unprotect_idle`); ``new_log(stream key,
        epoch)``: a next epoch's log (:class:`NextEpochLog` with its collaborators)."""
        self.cfg = cfg
        self.streams = streams
        self.ns = ns
        self.writer = writer
        self.memtier = memtier
        self.events_lost = events_lost
        self._lost_seen = 0  # events_lost() when the current logs were last let go
        self.new_log = new_log
        # (job, dataset) -> (the epoch its ranks first planned a next-epoch log here, the
        # most of its DistributedSampler's ranks seen on this mount then; _ranks_laying_out)
        self._local_ranks: dict[tuple, tuple[int, int]] = {}
        # the read-backs' nursery (bind): the stream manager's, once it runs
        self._nursery: trio.Nursery | None = None
        # the retries of slots that found no room (retry_no_room): room handed out and
        # not yet reserved, and the rounds so far (the log each starts at)
        self._promised = 0
        self._rounds = 0

    def bind(self, nursery: trio.Nursery | None) -> None:
        """The nursery the logs' read-backs (:meth:`backfill_reads`,
        :meth:`retry_no_room`) start in: the stream manager's, from its ``run``; None
        once it closed (nothing starts before or after)."""
        self._nursery = nursery

    def partial(self, dataset_bytes: int, next_known: bool) -> bool:
        """Whether a stream's epoch over ``dataset_bytes`` caches partially (LCache:
        ``memory_prefetch``): the cache holds less than two copies of the dataset, and
        the next epoch's order is known. The writer's limit: ``--cache-size``, or a shared
        root's share (:mod:`dlcachefs.cache.shares`)."""
        # partial caching the LCache way needs the next epoch's log; without a known next
        # order the cache is filled the ordinary way, by the policy's admission
        return 2 * dataset_bytes > self.writer.limit and self.cfg.reorder and next_known

    def next_logs(self) -> list[NextEpochLog]:
        """The next epochs' logs being laid out, every stream's: an open by any of them
        (or by any reader) may fill a slot of another's. With a DistributedSampler about
        half of a rank's next-epoch samples are read by the other ranks in this epoch;
        filled only from its own rank's opens, each log was completed at the epoch
        boundary from the cache, both ranks at once, in scattered order (two ranks on a
        mount read 5.8x what they served with ``--memory 8M``)."""
        return [s.next_log for s in self.streams.values()
                if s.next_log is not None and not s.next_log.failed]

    # ----- an epoch switch (synchronous: part of the stream manager's one step) --------

    def begin_epoch(self, s: Stream, epoch: int, laid: NextEpochLog | None, laid_ok: bool,
                    nursery: trio.Nursery) -> None:
        """``s`` switched to ``epoch``: the log laid out for it (``laid``, in the epoch's
        order when ``laid_ok``) becomes its current log, if it is still its next log;
        the last epoch's log is ordinary cache now. Trio loop, no await."""
        prev, s.next_log = s.next_log, None
        if s.current_log is not None:
            # its epoch is over: ordinary cache now (the new log's gaps are filled from it)
            s.current_log.release_after_use = False
            s.current_log.unprotect()
            if s.memory_prefetch and prev is not None:
                # LCache line 16, release after use: the last epoch's log is consumed;
                # what of it the new log did not take is not worth the room (partial
                # caching only). Only once the new log is complete: its gaps are filled
                # from the old one.
                nursery.start_soon(self._release_after, prev, s.current_log)
        s.current_log = None
        if prev is None:
            return
        if prev.epoch == epoch and prev is laid and laid_ok:
            prev.request_finish()  # this epoch's log: fill its gaps and seal it
            s.current_log = prev
            prev.start_reading()
            if s.memory_prefetch:
                # its chunks stay protected until read (LCache's release after use,
                # note_open): the next epoch's log, written meanwhile into the room
                # they free, must not evict the part of this epoch's log still ahead
                # (LRU would take exactly those, its oldest chunks, and every one
                # evicted is a sample fetched again this epoch). Reads served in
                # training processes release too: their events reach the log's
                # ``used`` (cache/inprocess.py), a drain (50 ms) later.
                prev.release_after_use = True
                prev.protect()  # (again, if an idle pause let it go)
            else:
                # the whole dataset fits: ordinary cache now
                prev.unprotect()
        else:
            prev.abandon()

    def end_stream(self, s: Stream) -> None:
        """``s`` ended (its job forgotten): its logs become ordinary cache (an unfinished
        next-epoch log is given up)."""
        if s.next_log is not None:
            s.next_log.abandon()
            s.next_log = None
        if s.current_log is not None:
            s.current_log.release_after_use = False
            s.current_log.unprotect()
            s.current_log = None

    async def _release_after(self, filling: NextEpochLog, old: NextEpochLog) -> None:
        await filling.done.wait()
        for c in old.chunks:
            if c.sealed:
                self.writer.retire_chunk(c.chunk_id)

    # ----- the next epoch's log --------------------------------------------------------

    async def plan_next(self, s: Stream, samples: SampleList, epoch: int,
                        order: list[int], nursery: trio.Nursery) -> None:
        """LCache: when epoch+1's order (``order``) is known, lay out its log while this
        epoch runs. The log's tasks go to ``nursery`` (the stream manager's: a close
        while the plan is made cancels them at once there, and the log's cleanup runs)."""
        assert s.replayer is not None
        s.reorder = ""
        cfg = self.cfg
        if not cfg.reorder or not s.replayer.known(epoch + 1):
            return
        if s.repeats:
            s.reorder = ("not needed: this epoch's order repeats the last one's (the sampler "
                         "re-seeded the same way, or its epoch was not advanced: "
                         "DistributedSampler.set_epoch); the next is taken to repeat it, and "
                         "the logs are read in that order")
            return
        if s.pages_served and not s.memory_prefetch:
            # the kernel's page cache served the last epoch's READs (the dataset fits in
            # RAM): the next is read from it in any order, and a log laid out for it would
            # be written and read back for nothing, each epoch (the opens that take its
            # bytes could not be lazy either). Pages that go end this at the next epoch.
            s.reorder = ("not needed: the kernel's page cache served the last epoch "
                         "(page_cache.serves_this_epoch); laid out again once its READs "
                         "come back")
            return
        limit = self.memtier.limit
        floor = cfg.reorder_min if cfg.reorder_min is not None else limit // 2
        # the memory tier is one for the mount: every dataset streams read now counts
        # (several ranks of one dataset count it once)
        read_now = {st.dataset: st.samples.nbytes for st in self.streams.values()
                    if st.samples is not None and st.dataset is not None}
        read_now[s.dataset] = samples.nbytes
        total = sum(read_now.values())
        if not s.memory_prefetch and total <= floor:
            # LCache lays the next epoch's log out in its order so that an epoch whose data
            # does not fit in memory reads whole chunks front to back. Data that fits in the
            # memory tier is read a chunk at a time in any order (each chunk loaded once by
            # the read plan, then kept): a second copy written and read back during this
            # epoch would buy nothing, and it takes the disk and ~0.6 ms of CPU per sample
            # from a first epoch's loader. A cache too small for the dataset
            # (memory_prefetch) always needs the log: it says which samples stay cached.
            s.reorder = (f"not needed: the {total / 2**20:.1f} MiB of the datasets read now "
                         f"are at most --reorder-min ({floor / 2**20:.1f} MiB; by default half of "
                         f"the memory tier, {limit / 2**20:.1f} MiB)")
            return
        # LCache: two logs. When the cache cannot hold two copies of the dataset, the next
        # log holds the samples that come first in its epoch, as many as the cache holds
        # (the current log is released chunk by chunk as it is consumed, so the two fit);
        # the rest is prefetched from the source in order, into memory, when it runs.
        budget = max(self.writer.limit, cfg.chunk_size) if s.memory_prefetch else None
        inos = await trio.to_thread.run_sync(_inos_of, order, samples)
        nl = self.new_log(s.key, epoch + 1)
        nl.order = order
        ranks = self._ranks_laying_out(s)
        await nl.plan(inos, budget, ranks=ranks)
        if budget is not None:
            # (of the stream's own order: a DistributedSampler rank's is its shard)
            log.info("stream %s: the cache holds %d of the %d samples of epoch %d's order",
                     s.key, len(nl.slots), len(order), epoch + 1)
        if s.target_epoch != epoch:  # a newer epoch began while planning
            nl.abandon()
        elif s.pages_served and not s.memory_prefetch:
            # judged served by the kernel's pages while planning (a large dataset takes a
            # second or more): PageVerdict found no log to give up then
            nl.abandon()
            s.reorder = GIVEN_UP
        else:
            s.next_log = nl
            for ino in list(self.ns.gone):  # gone while it was planned: fillers
                nl.gone(ino)
            # samples this epoch already served before the plan existed go in from the
            # cache: this stream's, and those the other ranks of the dataset served (its
            # slots are filled from every stream's opens: next_logs). Their flags are
            # copied now (an open from here on fills its slot itself), listed in a thread.
            served = [(st.order, bytes(st.consumed), st.samples)
                      for st in self.streams.values()
                      if same_dataset(st.samples, samples) and st.epoch == epoch and st.order]
            nursery.start_soon(self._backfill, nl, served)
        nursery.start_soon(nl.run)

    async def _backfill(self, nl: NextEpochLog,
                        served: list[tuple[list[int], bytes, SampleList]]) -> None:
        """The samples in ``served`` (orders with their consumed flags) go into ``nl``
        from the cache (:meth:`NextEpochLog.backfill`)."""
        try:
            done = await trio.to_thread.run_sync(_served_inos, served)
        except Exception:  # noqa: BLE001 - a background task must never end the daemon
            log_failure(log, "stream %s: listing the samples served for epoch %d's log failed",
                          nl.key, nl.epoch)
            return
        await nl.backfill(done)

    def _ranks_laying_out(self, s: Stream) -> int:
        """How many streams share the cache with ``s``'s next-epoch log: every stream
        that knows its order, and for a DistributedSampler the ranks of its job expected
        on this mount, not only those that announced yet. Counted alone, the first rank
        to announce planned its log for the whole cache, and with a cache smaller than
        the dataset the other ranks' logs found no room (the sweep: two ranks, 16 chunks
        planned for a 12 MiB cache, epoch 2 read 103% of the dataset from the source).
        In the job's first epoch on the mount all of the world's ranks are expected (a
        node holding fewer then lays out smaller logs for one epoch: the rest of that
        epoch is prefetched in order); after, as many as it saw. No waiting for the
        ranks: the plan is not delayed (a first epoch shorter than a wait got no log)."""
        n = self.streams.ordered()
        spec = getattr(s.replayer, "spec", None)
        if spec is None or spec.kind not in RANKED or spec.world < 2:
            return n
        key = (s.job, s.dataset)
        seen = sum(1 for o in self.streams.values()
                   if o.job == s.job and o.order and o.dataset == s.dataset)
        first, most = self._local_ranks.get(key, (s.epoch, 0))
        most = max(most, seen)
        self._local_ranks[key] = (first, most)
        while len(self._local_ranks) > 64:
            self._local_ranks.pop(next(iter(self._local_ranks)))
        # (in the job's first epoch here, its ranks may still be announcing)
        expected = spec.world if s.epoch == first else most
        return max(n, n - seen + min(expected, spec.world))

    # ----- read-backs of samples served elsewhere (in the nursery bound by ``bind``) ---

    def backfill_reads(self, inos: Sequence[int]) -> None:
        """Files read in training processes: each next-epoch log that waits for some
        reads them from the cache (:meth:`NextEpochLog.backfill`), in the background."""
        if self._nursery is None:
            return
        jobs = []
        for nl in self.next_logs():
            wanted = [i for i in inos if nl.wants(i)]
            if wanted:  # their chunks pinned now, before a seal drops those they released
                jobs.append((nl, wanted, nl.hold(wanted)))
        if jobs:
            self._nursery.start_soon(self._backfill_reads, jobs)

    async def _backfill_reads(self, jobs: list[tuple[NextEpochLog, list[int], list[int]]]) -> None:
        """The logs' backfills of reads served in training processes, :data:`BACKFILLS`
        at a time (each log its own; their reads of one record from the source are one
        fetch); then every log's slots that found no room try again: the chunks those
        reads released were pinned when the opens asked."""
        limiter = trio.CapacityLimiter(BACKFILLS)
        async with trio.open_nursery() as nursery:
            for nl, wanted, pinned in jobs:  # (no checkpoint: every job's task starts)
                nursery.start_soon(self._backfill_one, limiter, nl, wanted, pinned)
        self.retry_no_room()

    @staticmethod
    async def _backfill_one(limiter: trio.CapacityLimiter, nl: NextEpochLog,
                            wanted: list[int], pinned: list[int]) -> None:
        """One log's backfill under ``limiter``. Its pins have one owner at a time: the
        backfill once it started (it unpins them, whatever happens), this task until
        then (cancelled while waiting for its turn, the daemon stopping: unpinned here)."""
        started = False
        try:
            async with limiter:
                started = True  # (no checkpoint between the acquire and the backfill)
                await nl.backfill(wanted, pinned)
        finally:
            if not started:
                for cid in pinned:
                    nl.writer.unpin(cid)

    def retry_no_room(self) -> None:
        """Room was freed (a chunk released after use, or unpinned): every next log's
        slots that found none try again, in the background."""
        if self._nursery is None:
            return
        room: RoomRound | None = None  # (one room for the round: every log shares it)
        logs = self.next_logs()
        if logs:  # each round starts at another log: the first does not take every room
            self._rounds += 1
            k = self._rounds % len(logs)
            logs = logs[k:] + logs[:k]
        for nl in logs:
            nl.room_freed()
            if room is None:
                # less what earlier rounds handed to retries still reading (they reserve
                # after their reads): a release a few opens later would hand it again
                room = RoomRound(max(0, nl.writer.reclaimable() - self._promised))
            before = room.left
            retry = nl.take_no_room(room)
            if retry:
                # counted now, not when the task starts: the next open's round may come
                # in the same drain, before any checkpoint
                self._promised += before - room.left
                self._nursery.start_soon(self._retry_backfill, nl, retry, before - room.left)

    async def _retry_backfill(self, nl: NextEpochLog, retry: list[int], promised: int) -> None:
        """One log's retry of a round: its ``promised`` bytes of the room (counted by
        :meth:`retry_no_room`) count as taken until it has reserved its slots or given
        them up."""
        try:
            await nl.backfill(retry)
        finally:
            self._promised -= promised

    # ----- idle streams ------------------------------------------------------------------

    def unprotect_idle(self, now: float) -> None:
        """Stop protecting the current epoch's log of a stream that opened nothing for
        :data:`IDLE_S` (a training that ended or died mid-epoch), or of every stream once
        events of reads served in training processes were lost (those reads never reach
        the log, so their chunks would never be released): their chunks become ordinary
        cache, so another training can evict them. The next epoch's log of an idle stream too (a training
        that ended planned one for an epoch that never comes); if its epoch does begin
        after the pause, it is protected again then. Trio loop; every few seconds."""
        lost = self.events_lost()
        for s in self.streams.values():
            if s.chunks_ahead is not None and now - s.last_open >= IDLE_S:
                # a reader that stopped short of its epoch's end: its chunks ahead are
                # wanted no more (they would shrink every other stream's room)
                s.chunks_ahead.clear()
            nxt = s.next_log
            if nxt is not None and now - s.last_open >= IDLE_S and any(
                    c.chunk_id in self.writer.protected for c in nxt.chunks):
                # a training that ended (its last epoch planned a next one that never
                # comes): others may evict it; protected again if its epoch does begin
                nxt.unprotect()
                log.info("stream %s: nothing opened for %.0f s: epoch %d's planned log is "
                         "no longer protected from eviction", s.key, now - s.last_open,
                         nxt.epoch)
            cur = s.current_log
            if cur is None or not cur.release_after_use:
                continue
            if now - s.last_open >= IDLE_S:
                why = f"nothing opened for {now - s.last_open:.0f} s"
            elif lost > self._lost_seen:
                why = f"{lost - self._lost_seen} events of in-process reads were lost"
            else:
                continue
            cur.release_after_use = False  # (not protected again this epoch)
            cur.unprotect()
            log.info("stream %s: %s: epoch %d's log is no longer protected from eviction",
                     s.key, why, cur.epoch)
        self._lost_seen = lost


def _inos_of(order: list[int], samples: SampleList) -> list[int]:
    """Thread: the inodes of ``order``'s samples, as a list."""
    return order_inos(order, samples).tolist()


def _served_inos(served: list[tuple[list[int], bytes, SampleList]]) -> list[int]:
    """Thread: the inodes consumed in each (order, flags, samples), in order."""
    out: list[int] = []
    for order, flags, samples in served:
        out += consumed_inos(order, flags, samples)
    return out
