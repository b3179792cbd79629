"""The background packer: iCACHE's dynamic packaging (section III-C, Fig. 6) in a mount.

With ``--substitute``, the L-cache is filled the iCACHE way rather than by the misses of
the read path: once an H-list exists, this task asks the policy for the next package
(:meth:`~dlcachefs.cache.policy.SupportsPackagePlanning.plan_package`: which L-samples, how many
bytes), reads its members from the source in one batch (each file once, several at a
time), and hands them to the chunk writer as ONE unit (:meth:`ChunkWriter.submit_package`).
The paper's two threads are one task here: its *packaging thread* chooses the members
(the policy), its *loading thread* reads them into the L-cache (this task); there is no
intermediate package file, the source files are read directly in one pass.

It runs whenever the L-cache has room for a package (the policy decides): at the first
H-list, when the packages in the cache have all been served this epoch (each substitution
uses one up), and after every H-list change, when the L-samples missed meanwhile
(substituted or not) are repacked first. So a substituted miss is still fetched, in the
background, and the L-cache keeps turning over while substitution serves the reader.

Concurrency: a task in the session's nursery, on the trio loop like the policy and the
writer (no locks). Whole files are read through the fetcher
(:meth:`~dlcachefs.cache.fetch.Fetcher.read_whole`: the peer tier if any, else the one
source wrapper with its worker threads, limiter, timeout, retries), at most ``READ_CONCURRENCY`` at a
time so that the reader's own misses still find free source threads. The task wakes at
least every ``POLL`` seconds and at once when :meth:`Packer.wake` is called (a
substitution, an epoch start).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from dlcachefs.cache.namespace import identity, is_file
from dlcachefs.cache.source import Identity
from dlcachefs.errors import DlcError
from dlcachefs.store.chunkfmt import CHUNK_HEADER_SIZE, RECORD_HEADER_SIZE
from dlcachefs.store.integrity import log_failure

if TYPE_CHECKING:
    from dlcachefs.cache.fetch import Fetcher
    from dlcachefs.cache.namespace import Namespace
    from dlcachefs.cache.policy import CachingPolicy
    from dlcachefs.cache.writer import ChunkWriter
    from dlcachefs.clairvoyance.samplelist import SampleList
    from dlcachefs.config import Config
    from dlcachefs.importance.view import InodeImportance
    from dlcachefs.store.index import Index

log = logging.getLogger(__name__)

#: seconds between looks at the policy when nothing wakes the packer
POLL = 0.2
#: source reads of one package in flight at once (at most; also half the source threads)
READ_CONCURRENCY = 8
#: after a package that could not be stored, wait this long (doubling up to BACKOFF_MAX)
#: before the next one: its members would only be read from the source again
BACKOFF = 1.0
BACKOFF_MAX = 30.0
#: at most this long waiting for a package's seal (the writer seals a package at once)
SEAL_WAIT = 60.0


@dataclass
class PackerStats:
    """What the packer did since the mount (``.dlcache/stats`` -> ``packer``)."""

    packages: int = 0  # stored in the cache
    samples: int = 0
    bytes: int = 0  # payload bytes read from the source for packages
    read_failures: int = 0  # members left out: gone, changed or unreadable
    refused: int = 0  # packages the writer would not take (caching paused, memory, room)
    skipped: int = 0  # packages taken but not stored (their seal could not make room)
    last_plan: int = 0  # members of the last package planned


class Packer:
    """Builds the L-cache's packages in the background (one per policy plan).

    What it uses: the policy's plans and drops, the index and namespace (sizes, paths),
    whole files through ``fetcher.read_whole`` (the peer tier, else the source), the
    writer (``wait_room``, ``submit_package``, ``pending``, ``sealed``), the importance
    table's dataset and that dataset's sample list (``sample_list(dataset)``: the
    streams')."""

    def __init__(self, cfg: Config, *, index: Index, ns: Namespace, policy: CachingPolicy,
                 writer: ChunkWriter, fetcher: Fetcher, importance: InodeImportance,
                 sample_list: Callable[[str], SampleList | None]) -> None:
        self.cfg = cfg
        self.index = index
        self.ns = ns
        self.policy = policy
        self.writer = writer
        self.fetcher = fetcher
        self.importance = importance
        self.sample_list = sample_list
        self.stats = PackerStats()
        self._wake = trio.Event()
        self._backoff = BACKOFF

    def wake(self) -> None:
        """Look at the policy now (e.g. a substitution used a cached L-sample up)."""
        self._wake.set()

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled. A failing step is logged, never the end of the mount."""
        task_status.started()
        while True:
            with trio.move_on_after(POLL):
                await self._wake.wait()
            self._wake = trio.Event()
            try:
                while (done := await self.step()) is True:
                    self._backoff = BACKOFF
                    await trio.sleep(0)
                if done is None:  # planned, but not stored: do not read it all again now
                    await trio.sleep(self._backoff)
                    self._backoff = min(2 * self._backoff, BACKOFF_MAX)
            except Exception:  # noqa: BLE001 - third-party policies plan here too
                log_failure(log, "packer: building a package failed")
                await trio.sleep(10)

    def _pool(self) -> list[int]:
        """The inodes of the dataset whose losses make the H-list (none listed yet: [];
        the policy is asked all the same, so that it packs from the start on: an L miss
        is never cached on its own once substitution is on)."""
        imp = self.importance
        if imp.table is None or imp.dataset is None:
            return []
        sl = self.sample_list(imp.dataset)
        return [] if sl is None else sl.inos

    def _size_of(self, ino: int) -> int | None:
        """Bytes the file takes as a record of a unit (index lookup; None if not a file)."""
        e = self.index.get_entry(ino)
        if e is None or not is_file(e) or e.size > self.cfg.max_cached_file:
            return None
        return RECORD_HEADER_SIZE + len(self.ns.path_of(e)) + e.size

    async def step(self) -> bool | None:
        """Plan one package and build it: True when one was handed to the writer (try
        the next one), False when there is nothing to pack now, None when a package was
        planned but could not be stored."""
        plan = self.policy.plan_package(self._pool(), self._size_of, CHUNK_HEADER_SIZE)
        if not plan:
            return False
        self.stats.last_plan = len(plan)
        return True if await self.build(plan) else None

    async def build(self, plan: list[int]) -> bool:
        """Read ``plan`` from the source (each file once, ``READ_CONCURRENCY`` at a time)
        and submit what was read as one unit. Members not read are dropped with the
        policy; True when the writer took the package."""
        got: dict[int, tuple[bytes, Identity, bytes]] = {}
        slots = trio.Semaphore(max(1, min(READ_CONCURRENCY, self.cfg.source_threads // 2)))

        async def read_one(ino: int) -> None:
            async with slots:
                try:
                    e = self.index.get_entry(ino)
                    if e is None or not is_file(e):
                        return
                    rel = self.ns.path_of(e)
                    data, ident = await self.fetcher.read_whole(e, rel)
                except DlcError as exc:
                    log.debug("packer: %d not read: %s", ino, exc)
                    return
                if ident != identity(e):
                    return  # changed since it was listed: the read path will notice it
                got[ino] = (rel, ident, data)

        async with trio.open_nursery() as nursery:
            for ino in plan:
                nursery.start_soon(read_one, ino)
        # in plan order (the policy's choice), without what could not be read
        recs = [(ino, *got[ino]) for ino in plan if ino in got]
        for ino in plan:
            if ino not in got:
                self.stats.read_failures += 1
                self.policy.on_dropped(ino)
        if not recs:
            return False
        nbytes = sum(len(r[3]) for r in recs)  # counted by read_whole (source or peers)
        await self.writer.wait_room(nbytes)
        # the writer reserves its room in --cache-size (dooming the policy's victims:
        # used-up packages, or the side over its share); one that cannot get room is not
        # cached
        if not self.writer.submit_package(recs):
            self.stats.refused += 1
            for r in recs:
                self.policy.on_dropped(r[0])
            return False
        # wait for its seal: a seal that cannot make room (chunks pinned by reads) skips
        # its records, and then the next package should not be read right away
        with trio.move_on_after(SEAL_WAIT):
            while any(self.writer.pending.get(r[0]) is not None for r in recs):
                await self.writer.sealed()
        if not any(self.index.get_record(r[0]) is not None for r in recs):
            self.stats.skipped += 1
            return False
        self.stats.packages += 1
        self.stats.samples += len(recs)
        self.stats.bytes += nbytes
        return True

    def as_dict(self) -> dict:
        return {"packages": self.stats.packages, "samples": self.stats.samples,
                "bytes": self.stats.bytes, "read_failures": self.stats.read_failures,
                "refused": self.stats.refused, "skipped": self.stats.skipped,
                "last_plan": self.stats.last_plan}
