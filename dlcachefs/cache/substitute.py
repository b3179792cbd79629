"""iCACHE's substitution (``--substitute``): a missed L-sample served with another one.

When a stream's reader opens an L-sample (the policy says which samples are
substitutable: never an H-sample) that is not cached, the open is served with the bytes
of a cached L-sample of the SAME directory (so that the class label taken from the path
stays right) not yet used this epoch. The stream remembers the substitution, so that a
loss reported for the requested sample is booked on the sample actually served
(:mod:`dlcachefs.importance.losses`). The packer is woken: a miss was recorded and a
cached L-sample used up.

Concurrency: trio loop; a directory's file list is read in a worker thread (LMDB read
transactions) and kept for the revalidation window.
"""

from __future__ import annotations

import time

import trio

from dlcachefs.cache.buffers import ReadAhead
from dlcachefs.cache.fetch import Fetcher
from dlcachefs.cache.namespace import Namespace, identity, is_file
from dlcachefs.cache.policy import CachingPolicy, may_substitute, substitute_for
from dlcachefs.cache.reader import LogReader
from dlcachefs.cache.stats import Counters
from dlcachefs.cache.versions import Versions
from dlcachefs.config import Config
from dlcachefs.errors import DlcError
from dlcachefs.store.index import Index
from dlcachefs.store.schema import Entry

#: directories whose file lists are kept (then all are forgotten at once)
MAX_DIRS = 4096


class Substitution:
    """Chooses and reads the substitute of a missed L-sample (module docstring)."""

    def __init__(self, cfg: Config, *, index: Index, ns: Namespace, versions: Versions,
                 fetcher: Fetcher, reader: LogReader, readahead: ReadAhead, policy: CachingPolicy,
                 packer, counters: Counters) -> None:
        self.cfg = cfg
        self.index = index
        self.ns = ns
        self.versions = versions
        self.fetcher = fetcher
        self.reader = reader
        self.readahead = readahead
        self.policy = policy
        self.packer = packer  # woken on every substitution attempt (or None)
        self.counters = counters
        self._children: dict[int, tuple[float, list[int]]] = {}  # dir -> (when, files)

    async def serve(self, e: Entry, stream) -> memoryview | None:
        """The bytes of a substitute for ``e`` opened by ``stream``'s reader, or None when
        ``e`` is not a missed L-sample or no substitute can be read."""
        if (self.versions.is_cached(e.ino, identity(e)) or e.ino in self.readahead
                or self.fetcher.in_flight(e.ino)):
            return None
        if not may_substitute(self.policy, e.ino):
            return None
        files = await self._files_in(e.parent)
        cands = [i for i in files if i != e.ino and i not in stream.used]
        if self.packer is not None:
            self.packer.wake()  # a miss is recorded and a cached L-sample used up
        while True:
            pick = substitute_for(self.policy, e.ino, cands)
            if pick is None:
                return None
            cands.remove(pick)
            try:  # the substitute's current version, by the same freshness rule as an open
                se = await self.ns.fresh_file(pick)
            except DlcError:
                continue
            rec = self.versions.record(pick, identity(se))
            if rec is None:
                continue
            data = await self.reader.read_record(pick, rec)  # tells the policy it was served
            if data is not None:
                break
        self.counters.substitutions += 1  # neither a hit nor a miss: counted apart
        stream.used.update((pick, e.ino))
        stream.substituted[e.ino] = pick
        # the announced epoch (its order may still be being replayed)
        ep = stream.target_epoch if stream.target_epoch is not None else stream.epoch or 0
        stream.substitutions[ep] = stream.substitutions.get(ep, 0) + 1
        return data

    async def _files_in(self, parent: int) -> list[int]:
        """Regular files of a directory (cached for the revalidation window)."""
        hit = self._children.get(parent)
        now = time.monotonic()
        if hit is not None and now - hit[0] < max(self.cfg.revalidate, 1.0):
            return hit[1]
        files = await trio.to_thread.run_sync(self._list_files, parent)
        if len(self._children) > MAX_DIRS:
            self._children.clear()
        self._children[parent] = (now, files)
        return files

    def _list_files(self, parent: int) -> list[int]:
        out = []
        for _name, ino in self.index.list_dir(parent):
            ent = self.index.get_entry(ino)
            if ent is not None and is_file(ent):
                out.append(ino)
        return out
