"""Scan-ahead: the files of a tree fetched ahead of a reader whose order is unknown.

A first epoch read by something the daemon cannot replay (DLIO's own sampler, a C++
loader, ``tar``, ``cp -r``, a DataLoader that announced nothing) still reads every file of
a dataset once, in an order the daemon does not know. When the link to the source is the
bottleneck, a cache in the path is only as fast as reading the source directly if the link
never idles between one file and the next (the FUSE hop adds latency per file that a
direct reader does not pay). So once a reader looks like an epoch's scan of a tree, the
other files of that tree are fetched, a few at a time, while it reads: the link stays
busy and the reader's later opens are hits.

When: a reader group (a stream whose order is not known, a stream's opens of files
that are not among its samples, or a process group that announced nothing) has opened ``MIN_OPENS`` distinct files with few repeats (at most one
in ``REPEAT_SHARE``: an epoch's scan, not a re-read). The tree is the deepest directory
holding all of the group's opens (for an ImageFolder read in random order: its root after
a few files); a reader that leaves it widens it after ``MIN_OPENS`` opens outside (one
file at the top of the mount does not make the whole mount a guess).

What: the tree's regular files in listing order (depth first, names sorted), starting
after the reader's latest open (a sequential reader, e.g. an unshuffled loader or ``tar``,
is followed; a random one finds any order as good), skipping what was opened or is cached.

Bounds: ``Config.scan_ahead`` fetches in flight (0: off; with fetch workers each hands
up to ``Prefetcher.scan_batch`` files and a chunk's worth of bytes to the workers' queue,
where at most ``GUESSES_PER_WORKER`` per worker wait or are read, behind the prefetch's
requests), and only one while a reader waits for the source (its own miss gets the link: a
guess must not slow what is asked; with workers: one guess per job then); only into free cache room, never
evicting anything for a guess (the tree stops when the room left would fall below an eighth
of the cache); paused while the tree's readers are idle for ``IDLE_S``, ended after
``END_IDLE_S``; at most ``MAX_TREES`` trees and ``MAX_FILES`` files listed per tree; a tree
whose fetches the policy does not keep (``MAX_UNKEPT`` in a row) stops.

Concurrency: all state on the trio loop (:meth:`ScanAhead.opened` hears every open of
the mount, at the open); listing the tree and checking what is cached run in threads.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import trio

from dlcachefs.cache.namespace import ROOT_INO
from dlcachefs.cache.readers import Observer, OpenEvent
from dlcachefs.errors import DlcError
from dlcachefs.store.integrity import log_failure, note_error

if TYPE_CHECKING:
    from dlcachefs.cache.fetch import Fetcher
    from dlcachefs.cache.namespace import Namespace
    from dlcachefs.cache.prefetch import Prefetcher
    from dlcachefs.cache.writer import ChunkWriter
    from dlcachefs.config import Config
    from dlcachefs.store.index import Index

log = logging.getLogger(__name__)

MIN_OPENS = 32  # distinct files a group opens before its tree is scanned ahead
REPEAT_SHARE = 8  # at most one open in this many may be a repeat
IDLE_S = 5.0  # no open in the tree for this long: pause
END_IDLE_S = 60.0  # paused this long: the tree is done with
MAX_TREES = 4
MAX_GROUPS = 64
MAX_OPENED = 4096  # distinct opens remembered per group (enough to tell a scan)
MAX_EARLY = 1 << 20  # opens remembered while a tree is being listed
MAX_FILES = 1 << 23  # files listed per tree
MAX_UNKEPT = 16  # fetched files in a row the cache did not keep: stop the tree
DEMAND_POLL_S = 0.05  # how often a scan held back by readers' own fetches looks again
CHECK_BATCH = 256
MAX_LEFT_OUT = 256  # files in a row that did not fit: the tree is full  # candidates checked against the index per thread hop


RUNNING = ("listing", "scanning", "paused")


@dataclass
class _Group:
    """The opens of one reader group (stream key or process group) not covered by an order."""

    root: int | None = None
    opened: set[int] = field(default_factory=set)
    repeats: int = 0
    outside: int = 0  # opens outside ``root`` since it was last set
    wider: int | None = None  # the directory holding ``root`` and those opens
    tree: _Tree | None = None


@dataclass
class _Tree:
    root: int
    rel: str
    state: str = "listing"  # RUNNING, or done, full, idle, unkept, failed, stopped
    reason: str = ""
    inos: np.ndarray | None = None  # listing order
    sizes: np.ndarray | None = None
    sorted_pos: np.ndarray | None = None  # argsort of inos, to find an ino's position
    done: bytearray = field(default_factory=bytearray)  # position opened/cached/fetched
    last_pos: int = -1  # the readers' latest open, as a position in the listing
    last_open: float = field(default_factory=time.monotonic)
    wake: trio.Event = field(default_factory=trio.Event)
    pending_opens: list[int] = field(default_factory=list)  # opens while listing
    listed: int = 0
    left_out: int = 0  # files that did not fit in the free room
    files: int = 0
    bytes: int = 0
    unkept: int = 0  # fetched files in a row the cache did not keep
    active: int = 0  # fetches in flight
    active_bytes: int = 0  # their sizes (not yet charged to the cache's room)
    freed: trio.Event = field(default_factory=trio.Event)  # set when one ends

    def position(self, ino: int) -> int:
        if self.inos is None or self.sorted_pos is None or not len(self.inos):
            return -1
        i = int(np.searchsorted(self.inos, ino, sorter=self.sorted_pos))
        if i < len(self.inos):
            p = int(self.sorted_pos[i])
            if int(self.inos[p]) == ino:
                return p
        return -1

    def opened(self, ino: int) -> None:
        self.last_open = time.monotonic()
        if self.state not in RUNNING:
            return
        if self.inos is None:
            if len(self.pending_opens) < MAX_EARLY:
                self.pending_opens.append(ino)
            return
        p = self.position(ino)
        if p >= 0:
            self.done[p] = 1
            self.last_pos = p
        self.wake.set()

    def stats(self) -> dict:
        return {"state": self.state, "reason": self.reason, "listed": self.listed,
                "files": self.files, "bytes": self.bytes}


class ScanAhead(Observer):
    """Watches opens not covered by a known order and scans trees ahead of them.

    What it uses: the index (listings, entries, which files have records), the
    namespace's paths, ``writer.room()`` and ``writer.short_of_disk()``, the readers'
    demand on the source link (``fetcher.demand_fetches`` / ``fetcher.demand_idle``),
    ``prefetcher.scan_one(ino) -> (fetched bytes, kept)``, and ``group_of(pid)``: the
    group of readers (a process tree) an open of no stream belongs to."""

    def __init__(self, cfg: Config, *, index: Index, ns: Namespace, writer: ChunkWriter,
                 fetcher: Fetcher, prefetcher: Prefetcher,
                 group_of: Callable[[int], str | None]) -> None:
        self.cfg = cfg
        self.index = index
        self.ns = ns
        self.writer = writer
        self.fetcher = fetcher
        self.prefetcher = prefetcher
        self.group_of = group_of
        self.concurrency = cfg.scan_ahead
        self.groups: OrderedDict[str, _Group] = OrderedDict()
        self.trees: OrderedDict[int, _Tree] = OrderedDict()
        self._chains: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # dir -> ancestors
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Owns the trees' tasks, until cancelled."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    def close(self) -> None:
        """Stop every tree (at unmount, before the last commit)."""
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
            self._nursery = None

    # ----- watching opens (trio loop, called for every open: cheap) -------------------

    def opened(self, ev: OpenEvent) -> None:
        """An open no known order covers (no stream, one whose order is unknowable, or a
        file that is not among its stream's samples) is noted for its group of readers:
        maybe an epoch's scan of a tree."""
        if not ev.pid:
            return
        s = ev.stream
        if s is None:
            group = self.group_of(ev.pid)
        elif s.order_unknowable:
            group = s.key
        elif not s.covers(ev.ino):
            # a second loader of the training (its validation set, which the hook does not
            # announce while the training loader holds the job's stream) reads files of
            # no order: a group of its own, apart from the stream's own opens
            group = outside_group(s.key)
        else:
            return
        if group is not None:
            self.note_open(group, ev.ino, ev.parent)

    def note_open(self, group_key: str, ino: int, parent: int) -> None:
        """A file ``ino`` (in directory ``parent``) was opened by ``group_key``'s readers."""
        if self.concurrency <= 0:
            return
        g = self.groups.get(group_key)
        if g is None:
            g = self.groups[group_key] = _Group()
            while len(self.groups) > MAX_GROUPS:
                self.groups.popitem(last=False)
        else:
            self.groups.move_to_end(group_key)
        if ino in g.opened:
            g.repeats += 1
        elif len(g.opened) < MAX_OPENED:
            g.opened.add(ino)
        if g.root is None:
            g.root = parent
        else:
            wider = self._common(g.root, parent)
            if wider != g.root:
                # a reader that leaves its tree widens it only after MIN_OPENS opens
                # outside (one labels.json at the top must not scan the whole mount), to
                # the directory holding all of them; the old tree is a part of the new one
                # and runs on (its fetches are not lost)
                g.outside += 1
                g.wider = wider if g.wider is None else self._common(g.wider, wider)
                if g.outside >= MIN_OPENS or g.tree is None:
                    g.root, g.outside, g.wider = g.wider, 0, None
        t = g.tree
        if t is not None and t.root != g.root:
            t = g.tree = None
        if t is None and (len(g.opened) >= MIN_OPENS
                          and g.repeats * REPEAT_SHARE <= len(g.opened)):
            t = g.tree = self._tree(g)
        if t is not None:
            t.opened(ino)

    def _tree(self, g: _Group) -> _Tree | None:
        assert g.root is not None
        t = self.trees.get(g.root)
        if t is not None and t.state in RUNNING:
            return t
        if t is not None:  # finished (maybe long ago): scanned again for this reader
            del self.trees[g.root]
        if self._nursery is None:
            return None
        if len(self.trees) >= MAX_TREES:
            # the oldest finished tree makes room; running ones are never cut short
            old = next((k for k, v in self.trees.items() if v.state not in RUNNING), None)
            if old is None:
                return None
            del self.trees[old]
        try:
            rel = os.fsdecode(self.ns.path_of(self.ns.get(g.root))) or "."
        except DlcError:
            return None
        t = self.trees[g.root] = _Tree(g.root, rel)
        for ino in g.opened:
            t.pending_opens.append(ino)
        log.info("scan-ahead of %r: a reader with no known order is reading it through "
                 "(%d files opened)", rel, len(g.opened))
        self._nursery.start_soon(self._scan, t)
        return t

    def _chain(self, d: int) -> tuple[int, ...]:
        """``d`` and its ancestors up to the root (cached: called on every open)."""
        c = self._chains.get(d)
        if c is not None:
            self._chains.move_to_end(d)
            return c
        out, cur = [], d
        for _ in range(256):
            out.append(cur)
            if cur == ROOT_INO:
                break
            e = self.index.get_entry(cur)
            if e is None:
                break
            cur = e.parent
        c = self._chains[d] = tuple(out)
        while len(self._chains) > 4096:
            self._chains.popitem(last=False)
        return c

    def _common(self, a: int, b: int) -> int:
        if a == b:
            return a
        cb = self._chain(b)
        if a in cb:
            return a
        sb = set(cb)
        for x in self._chain(a):
            if x in sb:
                return x
        return ROOT_INO

    # ----- one tree (a task in this object's nursery) -----------------------------

    async def _scan(self, t: _Tree) -> None:
        try:
            await self._scan_tree(t)
        except Exception as e:  # noqa: BLE001 - a guess must never end the mount
            note_error(e)
            t.state, t.reason = "failed", str(e)
            log.warning("scan-ahead of %r stopped: %s", t.rel, e)
        finally:
            if t.state in RUNNING:
                t.state = "stopped"
            # a finished tree keeps its counts only (a listing is ~25 bytes a file)
            t.inos = t.sizes = t.sorted_pos = None
            t.done = bytearray()
            t.pending_opens = []

    async def _scan_tree(self, t: _Tree) -> None:
        inos, sizes = await trio.to_thread.run_sync(
            list_tree, self.index, t.root, self.cfg.max_cached_file, MAX_FILES)
        t.sizes, t.sorted_pos = sizes, np.argsort(inos, kind="stable")
        t.inos, t.done, t.listed = inos, bytearray(len(inos)), len(inos)
        for ino in t.pending_opens:
            t.opened(ino)
        t.pending_opens = []
        t.state = "scanning"
        n = len(inos)
        margin = self.writer.limit // 8  # --cache-size, or a shared root's share
        # (with fetch workers, each of them a batch: Prefetcher.scan_batch)
        slots = trio.Semaphore(self.concurrency * self.prefetcher.scan_batch)
        cursor = (t.last_pos + 1) % n if n else 0
        left_before = 0  # left_out when the last file was fetched
        async with trio.open_nursery() as nursery:
            while n:
                # follow a reader that is ahead of the scan (a sequential one)
                if t.last_pos >= cursor and t.last_pos - cursor < 4 * self.concurrency + 64:
                    cursor = (t.last_pos + 1) % n
                p = t.done.find(0, cursor)
                if p < 0:
                    p = t.done.find(0)
                    if p < 0:
                        break
                # which of the next candidates are already cached (one thread hop)
                batch = [q for q in range(p, min(n, p + CHECK_BATCH)) if not t.done[q]]
                cached = await trio.to_thread.run_sync(  # any version: it is a guess
                    self.index.with_records, [int(inos[q]) for q in batch])
                for q in batch:
                    if int(inos[q]) in cached:
                        t.done[q] = 1
                for q in batch:
                    if t.done[q]:
                        continue
                    while time.monotonic() - t.last_open > IDLE_S:
                        t.state = "paused"
                        t.wake = trio.Event()
                        with trio.move_on_after(END_IDLE_S):
                            await t.wake.wait()
                        if time.monotonic() - t.last_open > END_IDLE_S:
                            t.state, t.reason = "idle", f"no open for {END_IDLE_S:.0f} s"
                            return
                        t.state = "scanning"
                    if t.done[q]:
                        continue
                    await slots.acquire()
                    # a reader waiting for the source gets the link: one guess at a time
                    # then (a guess shares the link with it; it is only a guess)
                    while self.fetcher.demand_fetches and t.active >= 1:
                        with trio.move_on_after(DEMAND_POLL_S):
                            await self.fetcher.demand_idle.wait()
                    # batches (fetch workers): beyond one file per fetch, a chunk's worth
                    # of bytes per fetch at most (large files are not queued by the dozen)
                    while (t.active >= self.concurrency and t.active_bytes + int(sizes[q])
                           > self.concurrency * self.cfg.chunk_size):
                        t.freed = trio.Event()
                        await t.freed.wait()
                    if t.done[q]:
                        slots.release()
                        continue
                    # the room now, less what is in flight (charged only once submitted;
                    # a fetch worker's file is reserved at once: counted twice meanwhile,
                    # a few chunks' worth at most, so the tree stops a little early)
                    free = self.writer.room() - t.active_bytes - margin
                    if free <= 0:
                        slots.release()
                        t.state, t.reason = "full", "free cache room used up"
                        return
                    t.done[q] = 1
                    if int(sizes[q]) > free:  # too large for what is left: left out
                        t.left_out += 1
                        slots.release()
                        if t.left_out - left_before >= MAX_LEFT_OUT:
                            break  # the room is as good as used up
                        continue
                    left_before = t.left_out
                    # counted now (the task starts later): the next look at the room and
                    # at the readers' demand sees it
                    t.active += 1
                    t.active_bytes += int(sizes[q])
                    nursery.start_soon(self._one, t, int(inos[q]), int(sizes[q]), slots)
                    if t.unkept >= MAX_UNKEPT:
                        t.state = "unkept"
                        t.reason = (self.writer.short_of_disk()
                                    or "the cache policy does not keep them")
                        return
                if t.left_out - left_before >= MAX_LEFT_OUT:
                    break
                cursor = (batch[-1] + 1) % n if batch else (p + 1) % n
        if t.left_out:
            t.state, t.reason = "full", f"free cache room used up ({t.left_out} files left out)"
        else:
            t.state = "done"

    async def _one(self, t: _Tree, ino: int, size: int, slots: trio.Semaphore) -> None:
        try:
            nbytes, kept = await self.prefetcher.scan_one(ino)
            if nbytes:
                t.files += 1
                t.bytes += nbytes
                t.unkept = 0 if kept else t.unkept + 1
        except DlcError as e:
            log.debug("scan-ahead of inode %d failed: %s", ino, e)
        except Exception:  # noqa: BLE001 - a policy's or the index's failure: logged
            log_failure(log, "scan-ahead of inode %d failed", ino)
        finally:
            t.active -= 1
            t.active_bytes -= size
            t.freed.set()
            slots.release()

    def stats(self) -> dict:
        return {t.rel: t.stats() for t in self.trees.values()}

    def tree_of_groups(self) -> dict[str, str]:
        """Reader group -> the tree scanned ahead of it (for its stats entry)."""
        return {k: g.tree.rel for k, g in self.groups.items() if g.tree is not None}


#: the group of a stream's opens outside its samples: ``KEY outside`` (a stream key, like
#: a job name, holds no space)
OUTSIDE = " outside"


def outside_group(stream_key: str) -> str:
    """The reader group of ``stream_key``'s opens of files outside its samples."""
    return stream_key + OUTSIDE


def list_tree(index, root: int, max_size: int, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """(inos, sizes) of the regular files under directory ``root``: depth first, names
    sorted (the index lists them so), files no larger than ``max_size``, at most ``limit``.
    Symlinks are not followed (a guess never leaves the tree). Blocking: a thread."""
    inos: list[int] = []
    sizes: list[int] = []
    stack = [root]
    S_ISDIR, S_ISREG = stat.S_ISDIR, stat.S_ISREG
    while stack and len(inos) < limit:
        d = stack.pop()
        subdirs = []
        for _name, ino, mode, size in index.list_dir_typed(d):
            if S_ISDIR(mode):
                subdirs.append(ino)
            elif S_ISREG(mode) and size <= max_size:
                inos.append(ino)
                sizes.append(size)
        stack.extend(reversed(subdirs))
    return np.asarray(inos[:limit], dtype=np.int64), np.asarray(sizes[:limit], dtype=np.int64)
