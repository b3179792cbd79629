"""The owner's prefetch (``--peers`` with ``--peer-self``): each file leaves the remote
once per cluster, before a rank waits for it.

A DistributedSampler's ranks read one global order together (rank ``g % world`` reads
position ``g`` at its step ``g // world``; :class:`~dlcachefs.clairvoyance.streams.ClusterUse`
holds it, computed from the announced seed, world size and epoch). Every node knows that
order, so every node can walk it ahead of the cluster and fetch, in first-use order, the
files *it* owns in the peer tier (the rendezvous owner of the file's content key is its
own server, ``--peer-self``): a rank that reaches the file later finds it at the owner.
Without this, the first rank to miss takes the lease and the others wait for it.

What one step does, for the next file of the walk that this node owns and does not hold
in its local cache: a ``touch`` at its server (:meth:`PeerTier.held`: held already, its
expiry renewed, nothing sent); else :meth:`~dlcachefs.cache.fetch.Fetcher.read_whole`,
the one place whole files are read, where the lease decides who reads the source (this
node, or a rank that got there first) and what this node read is stored at the owner in
the background. The bytes are not cached locally: this node's own ranks fetch what they
read as always.

Bounds: at most ``lead x world`` global positions ahead of this node's rank (the
streams' prefetch lead per rank; the ranks step together, so this node's position is the
cluster's), at most :data:`PARALLEL` fetches at once, and only while no reader of this
node waits for the source (``Fetcher.demand_fetches``), as scan-ahead yields to readers.

Concurrency: one task on the trio loop (:meth:`OwnerPrefetch.run`, in the session's
nursery) and its fetch tasks; no threads of its own (the fetch's source read and the
tier's calls run in theirs).
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING

import trio

from dlcachefs.cache.namespace import identity, is_file
from dlcachefs.errors import DlcError
from dlcachefs.store.integrity import log_failure

if TYPE_CHECKING:
    from dlcachefs.cache.fetch import Fetcher
    from dlcachefs.cache.namespace import Namespace
    from dlcachefs.clairvoyance.streams import StreamManager
    from dlcachefs.config import Config
    from dlcachefs.peers.tier import PeerTier
    from dlcachefs.store.index import Index

log = logging.getLogger(__name__)

#: owner fetches in flight at once
PARALLEL = 2
#: how long the walk sleeps when there is nothing to do (no stream, all done, readers)
IDLE_S = 0.05
#: positions one step of the walk looks at before it yields the trio loop (each costs
#: two LMDB reads, ~10-25 us)
STEP_POSITIONS = 256


class OwnerPrefetch:
    """Walks each distributed stream's global order and fetches the files this node owns
    (see the module doc)."""

    def __init__(self, cfg: Config, *, index: Index, ns: Namespace, fetcher: Fetcher,
                 peers: PeerTier, streams: StreamManager) -> None:
        self.cfg = cfg
        self.index = index
        self.ns = ns
        self.fetcher = fetcher
        self.peers = peers
        self.streams = streams  # the distributed streams' global orders, and their lead
        self.counts: Counter[str] = Counter()
        # job -> (the ClusterUse walked, the next global position to look at)
        self._cursor: dict[str, tuple[object, int]] = {}
        self._limiter = trio.CapacityLimiter(PARALLEL)

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled."""
        task_status.started()
        async with trio.open_nursery() as nursery:
            while True:
                try:
                    ino = self._next()
                except Exception:  # noqa: BLE001 - a bug here must cost speed, never the mount
                    self.counts["errors"] += 1
                    if self.counts["errors"] == 1:
                        log_failure(log, "owner prefetch: the walk failed (it goes on)")
                    ino = None
                if ino is None:
                    await trio.sleep(IDLE_S)
                    continue
                if ino == 0:  # the walk's budget for one step is spent: let others run
                    await trio.sleep(0)
                    continue
                token = object()  # an inode may be walked again (a new order) while in flight
                await self._limiter.acquire_on_behalf_of(token)
                nursery.start_soon(self._fetch, ino, token)

    def _next(self) -> int | None:
        """The next inode to fetch for the cluster; 0 when this call's budget of
        :data:`STEP_POSITIONS` positions is spent (more to walk: call again after
        yielding); None when there is nothing to do now."""
        fetcher = self.fetcher
        if fetcher.demand_fetches:  # a reader waits for the source: leave it the link
            return None
        peers = self.peers
        budget = STEP_POSITIONS
        for s in self._walkers():
            cu = s.cluster
            assert cu is not None and cu.inos is not None
            walked, g = self._cursor.get(s.job, (None, 0))
            if walked is not cu:
                g = 0  # a new epoch (or order): walk it from the cluster's position
            g = max(g, s.position * cu.world)
            end = min(len(cu.inos), (s.position + self.streams.lead) * cu.world)
            while g < end:
                if budget <= 0:
                    self._cursor[s.job] = (cu, g)
                    return 0
                budget -= 1
                ino = int(cu.inos[g])
                g += 1
                if ino == 0 or fetcher.in_flight(ino):
                    continue
                e = self.index.get_entry(ino)
                if e is None or not is_file(e) or e.size > self.cfg.max_cached_file:
                    continue
                if self.index.get_record(ino) is not None:
                    continue  # held here: stored at its owner when it was fetched
                rel = self.ns.path_of(e)
                ident = identity(e)
                # a file the tier cannot hold (above --max-cached-file): nothing to fetch
                if not peers.mine(rel, ident) or not peers.fits(rel, ident):
                    continue
                self._cursor[s.job] = (cu, g)
                return ino
            self._cursor[s.job] = (cu, g)
        return None

    def _walkers(self) -> list:
        """One stream per job (the lowest rank of this node): the ranks of one job walk
        the same global order, once is enough (its position is the cluster's)."""
        by_job: dict[str, object] = {}
        for s in list(self.streams.streams.values()):
            cu = s.cluster
            if cu is None or cu.inos is None or not s.order:
                continue
            cur = by_job.get(s.job)
            if cur is None or s.rank < cur.rank:  # type: ignore[attr-defined]
                by_job[s.job] = s
        return list(by_job.values())

    async def _fetch(self, ino: int, token: object) -> None:
        try:
            e = self.index.get_entry(ino)
            if e is None:
                return
            rel = self.ns.path_of(e)
            peers = self.peers
            if await peers.held(rel, identity(e), ino):  # no bytes sent: a touch
                self.counts["held"] += 1
                return
            data, _ = await self.fetcher.read_whole(e, rel)
            self.counts["files"] += 1
            self.counts["bytes"] += len(data)
        except DlcError as e:  # the file's own problem: its readers will see it
            self.counts["errors"] += 1
            log.debug("owner prefetch of inode %d: %s", ino, e)
        except Exception:  # noqa: BLE001 - a bug here must cost speed, never the mount
            self.counts["errors"] += 1
            if self.counts["errors"] == 1:
                log_failure(log, "owner prefetch failed (it goes on)")
        finally:
            self._limiter.release_on_behalf_of(token)

    def stats(self) -> dict:
        """``peers.owner_prefetch`` in ``.dlcache/stats``: files fetched for the cluster
        (read from the remote by this node when the owner had none and this node got the
        lease: counted in ``bytes_from_source``), their bytes, files the owner held
        already (``held``: a touch, nothing sent), errors, fetches in flight, and the
        global positions of the streams' current epochs not walked yet."""
        left = 0
        for s in self._walkers():
            cu = s.cluster
            walked, g = self._cursor.get(s.job, (None, 0))
            left += len(cu.inos) - (g if walked is cu else 0)
        return {**{k: self.counts[k] for k in ("files", "bytes", "held", "errors")},
                "in_flight": self._limiter.borrowed_tokens, "walk_left": left}
