"""One ``--cache-size`` budget for several datasets (``--shared-cache``): each daemon's share.

Several daemons (one per mounted source) share a cache root; each keeps its own cache
under ``<root>/datasets/<id>/`` and its own policy, and they divide one budget through
the root's ledger (:mod:`dlcachefs.store.ledger`, where the protocol that keeps the sum
within the budget is written down). This module is one daemon's side:

* what it publishes (:meth:`ShareKeeper._measure`): its chunk bytes, its demand (the
  bytes its whole dataset would take cached), its source's measured re-fetch cost (the
  seconds the source's ``read_file`` calls took per MiB they returned, from the fetch
  path's latency histogram, and the bytes/s and mean latency behind it), and its value,
  DLCache's LRFU CRF: the passes over the dataset read through the mount (bytes served /
  demand), each weighted ``(1/2) ** (age / halflife)``; the age of a read counts only from
  ``--share-cooldown`` after the dataset's last read (DLCache's cooldown: a dataset
  between two epochs or two jobs keeps its value);
* the allocation every daemon computes alike from the same ledger document
  (:func:`allocate`): the entries of daemons that are gone keep their limits; the rest of
  the budget goes to the live datasets, each at least ``--share-floor`` of the budget (or
  an equal part when the floors do not fit) and at most its demand, the remainder in
  proportion to value per byte x re-fetch cost (``--share-policy cost``) or equally
  (``equal``, the baseline: plain per-dataset LRU with equal shares);
* enforcing its share with the writer's own eviction (:meth:`ChunkWriter.set_limit`):
  within the dataset the existing policy chooses the victims;
* taking back the room of stopped datasets when it needs it (DLCache's cost-aware LRFU
  eviction of idle datasets, section III-C2): a stopped dataset is *eligible* once
  ``--share-cooldown`` has passed since its last use (its last read through the mount, or
  its stop if later); eligible datasets go in the order of :func:`reclaim_order`: lowest
  CRF first, ties by the lowest re-fetch cost. The CRF of a stopped dataset ``d`` at
  ``now`` is what its entry in the ledger records, decayed::

      CRF(d, now) = crf_d * (1/2) ** (max(0, now - max(crf_t_d, last_read_d + cooldown))
                                      / halflife)

  where ``crf_d`` is the sum, over the share rounds in which the dataset was read, of the
  passes read in that round (bytes served / demand), each decayed the same way up to
  ``crf_t_d`` (LRFU's F(x) = (1/p) ** (step * x) with p = 2 and step = 1 / halflife; a
  reference is a round's reads, weighted by how much of the dataset they read). A
  dataset *needs room* when its writer's account is within an eighth of its limit and the
  allocation with the eligible datasets' bytes freed (:func:`reclaim_plan`) would give it
  more than it has; the difference is evicted from them, in order, by
  :func:`dlcachefs.store.reclaim.evict_stopped` (in a child process, under each one's cache
  lock, crash-safe),
  and grown into at once.

Concurrency: :class:`ShareKeeper` runs on the trio loop (one task, owned by the
engine's nursery); the ledger is read and written in a worker thread
(``trio.to_thread``), and the writer's limit is changed only on the loop, by this task.
Order of one round: publish and read the ledger (thread); grow the writer's limit to what
the ledger granted, or shrink it (victims doomed, their drop committed under the writer's
limiter) and publish the smaller limit (thread). The writer's ``--cache-size`` account
(``used - doomed + pending <= limit``) holds at every point for the limit it has then.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import TYPE_CHECKING, Any

import trio

from dlcachefs.config import DATASETS_DIR, Config
from dlcachefs.errors import DlcError
from dlcachefs.store import ledger as L
from dlcachefs.store import schema as S
from dlcachefs.store.chunkfmt import CHUNK_HEADER_SIZE, RECORD_HEADER_SIZE
from dlcachefs.store.integrity import log_failure
from dlcachefs.store.reclaim import UNFIT, Reclaimed, evict_stopped_in_child

if TYPE_CHECKING:
    from dlcachefs.cache.fetch import SourceCalls
    from dlcachefs.cache.stats import Counters
    from dlcachefs.cache.writer import ChunkWriter
    from dlcachefs.store.index import Index

log = logging.getLogger(__name__)

MIB = 1 << 20
#: bytes from the source below which a cost is not measured yet (a few files' latency
#: would say more about the thread pool's start than about the source)
MIN_COST_BYTES = 256 << 10
#: at most this many seconds before a stopped dataset that was in use, or whose reclaim
#: failed, is tried again: the wait doubles from one share round each time (each try
#: starts a child process)
RECLAIM_RETRY_S = 60.0


def demand_of(bytes_total: int, files: int, chunk_target: int) -> int:
    """What a dataset of ``files`` files and ``bytes_total`` bytes takes cached: its bytes,
    a record header and a key per file, a chunk header per chunk (a file larger than the
    writer's ``chunk_target`` is a chunk of its own), and 1% to spare. Never an
    underestimate that matters: a dataset read in a loop through an LRU cache a little
    smaller than itself misses every read."""
    chunk_target = max(chunk_target, 1)
    chunks = files if files and bytes_total // files >= chunk_target \
        else bytes_total // chunk_target + 1
    need = (bytes_total + files * (RECORD_HEADER_SIZE + 64)
            + (chunks + 1) * CHUNK_HEADER_SIZE)
    return need + need // 100


def allocate(doc: dict[str, Any], floor: float, policy: str = "cost") -> dict[str, int]:
    """The share of each live entry of the ledger ``doc`` (module docstring). Pure and
    deterministic: every daemon computes the same numbers from the same document."""
    budget = int(doc.get("budget", 0))
    entries = doc["datasets"]
    live = sorted(ds for ds, e in entries.items() if e.get("state") == "live")
    fixed = sum(int(e.get("limit", 0)) for ds, e in entries.items() if ds not in live)
    avail = max(0, budget - fixed)
    if not live:
        return {}
    demand = {ds: max(0, int(entries[ds].get("demand") or budget)) for ds in live}
    each = min(int(budget * floor), avail // len(live))
    share = {ds: min(each, demand[ds]) for ds in live}
    rest = avail - sum(share.values())
    weight = _weights(entries, live, demand, policy)
    open_ = [ds for ds in live if demand[ds] > share[ds]]
    while rest > 0 and open_:
        total = sum(weight[ds] for ds in open_)
        give = {ds: rest * weight[ds] / total for ds in open_}
        capped = [ds for ds in open_ if share[ds] + give[ds] >= demand[ds]]
        if not capped:
            for ds in open_:
                share[ds] += int(give[ds])
            break
        for ds in capped:  # at its demand: what it would not use goes to the others
            rest -= demand[ds] - share[ds]
            share[ds] = demand[ds]
            open_.remove(ds)
    return share


def _weights(entries: dict[str, Any], live: list[str], demand: dict[str, int],
             policy: str) -> dict[str, float]:
    """Value per byte x re-fetch cost of each live dataset (all 1.0 under ``equal``). A
    cost not measured yet is the median of the measured ones (1 when none is); a value
    of 0 (nothing read yet) counts as a small one, so that cost alone decides then."""
    if policy == "equal":
        return {ds: 1.0 for ds in live}
    costs = sorted(float(entries[ds]["cost"]) for ds in live if entries[ds].get("cost"))
    default_cost = costs[len(costs) // 2] if costs else 1.0
    out = {}
    for ds in live:
        e = entries[ds]
        value = float(e.get("crf") or 0.0)  # passes over the dataset: already per byte
        cost = float(e.get("cost") or default_cost)
        out[ds] = max(value, 1e-3) * max(cost, 1e-9)
    if all(w <= 0 for w in out.values()):
        return {ds: 1.0 for ds in live}
    return out


def reclaim_order(doc: dict[str, Any], now: float, cooldown: float,
                  halflife: float) -> list[str]:
    """The stopped entries of ``doc`` whose cooldown has passed (``now`` at least
    ``cooldown`` after the later of their last read and their stop) and that hold bytes,
    in the order their space is taken back (module doc): lowest CRF at ``now`` first
    (rounded to 0.001 passes, so that datasets of about equal value tie), then the
    lowest re-fetch cost (a cost not measured is the median of the measured ones), then
    the name. Pure."""
    entries = doc["datasets"]
    costs = sorted(float(e["cost"]) for e in entries.values() if e.get("cost"))
    default_cost = costs[len(costs) // 2] if costs else 1.0
    keyed = []
    for ds, e in entries.items():
        if e.get("state") != "stopped" or int(e.get("limit", 0)) <= 0:
            continue
        last_read = float(e.get("last_read") or 0.0)
        if now < max(last_read, float(e.get("heartbeat") or 0.0)) + cooldown:
            continue  # in its cooldown: a job may come back to it
        crf = decayed(float(e.get("crf") or 0.0), float(e.get("crf_t") or now), last_read,
                      now, cooldown, halflife)
        keyed.append((round(crf, 3), float(e.get("cost") or default_cost), ds))
    return [ds for _, _, ds in sorted(keyed)]


def reclaim_plan(doc: dict[str, Any], ds: str, floor: float, policy: str, have: int,
                 now: float, cooldown: float, halflife: float) -> list[tuple[str, int]]:
    """(stopped dataset, bytes) to evict so that the live dataset ``ds``, which has
    ``have`` bytes of limit or target, gets the share it would have if the eligible
    stopped datasets held nothing (:func:`reclaim_order`); empty when that is no more
    than ``have``. Pure."""
    order = reclaim_order(doc, now, cooldown, halflife)
    if not order:
        return []
    freed = {**doc, "datasets": {k: ({**e, "limit": 0} if k in order else e)
                                 for k, e in doc["datasets"].items()}}
    need = allocate(freed, floor, policy).get(ds, 0) - have
    plan = []
    for victim in order:
        if need <= 0:
            break
        take = min(need, int(doc["datasets"][victim].get("limit", 0)))
        plan.append((victim, take))
        need -= take
    return plan


def decayed(crf: float, crf_t: float, last_read: float, now: float, cooldown: float,
            halflife: float) -> float:
    """``crf`` measured at ``crf_t`` seen at ``now``: halved per ``halflife`` of the time
    past ``last_read + cooldown`` (DLCache's cooldown: no decay right after a use)."""
    start = max(crf_t, last_read + cooldown)
    if now <= start:
        return crf
    return crf * 0.5 ** ((now - start) / halflife)


class ShareKeeper:
    """This daemon's entry in the root's ledger and its writer's limit (module docstring)."""

    def __init__(self, cfg: Config, index: Index, writer: ChunkWriter, counters: Counters,
                 calls: SourceCalls) -> None:
        self.cfg = cfg
        self.ds = str(cfg.dataset_id)
        self.root = cfg.cache_dir
        self.ledger = L.Ledger(self.root)
        self.index = index
        self.writer = writer
        self.counters = counters
        self.calls = calls
        self.budget = cfg.cache_size
        now = time.time()
        self.crf = 0.0
        self.crf_t = now
        self.last_read = 0.0
        self.served_seen = 0
        self.cost: float | None = None  # seconds per MiB from the source
        self.bytes_per_s: float | None = None
        self.latency_s: float | None = None
        self.demand = 0
        self.target = 0
        self.rounds = 0
        self.errors = 0
        # a shrink whose victims' drop is not committed yet: the limit published stays
        # the larger one until it is (the disk may still hold those bytes)
        self._shrinking = False
        self._published = 0
        self.view: dict[str, Any] = {}
        #: bytes taken back from stopped datasets, by dataset (stats)
        self.reclaimed: dict[str, int] = {}
        #: (dataset, stop) whose index is not as a clean stop left it: not tried again
        self._unfit: set[tuple[str, float]] = set()
        #: (dataset, stop) skipped (in use) or failed: not tried again before this time
        self._retry_at: dict[tuple[str, float], tuple[float, float]] = {}  # (when, wait)

    # ----- blocking, before the loop (the daemon's start) and after it (its stop) -----

    def join(self) -> int:
        """Take this dataset's entry in the ledger (a dead or stopped one is taken over:
        its value and cost carry on) and return the writer's first limit: at least what
        the sub-cache holds now (the old entry counted it), grown towards this dataset's
        share where the others leave room. Raises DlcError when live mounts use another
        budget. Blocking; before recovery (whose shrink then applies this limit)."""
        on_disk = self.index.counter(S.K_CHUNK_BYTES)
        snap = self.index.snapshot()
        self.demand = (demand_of(snap["bytes_total"], snap["files"], self.writer.chunk_target)
                       if snap["files"] else 0)

        def fn(doc: dict[str, Any]) -> tuple[int, int]:
            now = time.time()
            L.expire(doc, self.root, DATASETS_DIR, now, self.cfg.share_interval)
            live = [ds for ds, e in doc["datasets"].items()
                    if ds != self.ds and e.get("state") == "live"]
            if live and int(doc.get("budget", 0)) != self.budget:
                raise DlcError(
                    f"shared cache {self.root} has a budget of {doc['budget']} bytes for the "
                    f"mounts running on it ({', '.join(sorted(live))}); give the same "
                    "--cache-size, or unmount them first")
            doc["budget"] = self.budget
            old = doc["datasets"].get(self.ds)
            if old is not None:  # a previous mount of this dataset: its history carries on
                self.crf = decayed(float(old.get("crf", 0.0)), float(old.get("crf_t", now)),
                                   float(old.get("last_read", 0.0)), now,
                                   self.cfg.share_cooldown, self.cfg.share_halflife)
                self.last_read = float(old.get("last_read", 0.0))
                self.cost = old.get("cost")
                self.bytes_per_s = old.get("bytes_per_s")
                self.latency_s = old.get("latency_s")
            e = doc["datasets"][self.ds] = self._entry(now, on_disk)
            e["limit"] = on_disk
            target = allocate(doc, self.cfg.share_floor, self.cfg.share_policy)[self.ds]
            return target, L.grant(doc, self.ds, target)

        self.target, limit = self.ledger.update(fn)
        log.info("joined shared cache %s as dataset %s: share %d of %d bytes, limit %d "
                 "(holds %d)", self.root, self.ds, self.target, self.budget, limit, on_disk)
        return limit

    def leave(self) -> None:
        """At a clean stop, after the last commit: the entry is ``stopped`` and counts
        exactly the chunk bytes left (until this dataset is mounted again or its
        directory removed). Blocking; best effort (a failure leaves a live entry that
        expires and keeps its limit)."""
        used = self.writer.used

        def fn(doc: dict[str, Any]) -> None:
            e = doc["datasets"].get(self.ds)
            if e is None or int(e.get("pid", 0)) != os.getpid():
                return  # taken over already (cannot happen while we hold the dataset lock)
            e.update(self._entry(time.time(), used))
            e["state"] = "stopped"
            e["limit"] = min(int(e.get("limit", used)), used)

        try:
            self.ledger.update(fn)
        except (OSError, DlcError) as e:
            log.warning("could not leave the shared cache's ledger: %s", e)

    # ----- the task (trio loop) ------------------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """A round every ``--share-interval`` seconds, until cancelled. A failing round
        (ledger unreadable, disk full) is logged and counted; the limit stays."""
        task_status.started()
        while True:
            try:
                await self.round()
            except (OSError, DlcError) as e:
                self.errors += 1
                log.warning("shared cache round failed: %s", e)
            except Exception:  # noqa: BLE001 - never the end of the mount; say where
                self.errors += 1
                log_failure(log, "shared cache round failed")
            await trio.sleep(self.cfg.share_interval)

    async def round(self) -> None:
        """Publish, read the allocation, then grow or shrink the writer's limit."""
        w = self.writer
        if self._shrinking:  # the last shrink's drop failed: try it again first
            await w.drop_doomed()
            self._shrinking = False
        self._measure()
        target, granted, view, plan = await trio.to_thread.run_sync(
            self._exchange, w.limit, self._needs_room())
        now = trio.current_time()
        # one stopped dataset per round: a child may take CHILD_TIMEOUT_S, and this
        # round's heartbeat must reach the ledger again before the others call it dead
        plan = [p for p in plan if (p[0], p[2]) not in self._unfit
                and self._retry_at.get((p[0], p[2]), (0.0, 0.0))[0] <= now][:1]
        if plan:
            done, failed, skipped = await trio.to_thread.run_sync(self._reclaim, plan)
            self.errors += failed
            for ds, stopped_at, why in skipped:
                if why == UNFIT:  # until it is mounted again (a new stop): not again
                    self._unfit.add((ds, stopped_at))
                else:  # in use, or the child failed: not every round
                    last = self._retry_at.get((ds, stopped_at), (0.0, 0.0))[1]
                    wait = min(RECLAIM_RETRY_S, max(self.cfg.share_interval, 2 * last))
                    self._retry_at[(ds, stopped_at)] = (now + wait, wait)
            for r in done:
                self.reclaimed[r.dataset] = self.reclaimed.get(r.dataset, 0) + r.freed
            if done:  # the stopped datasets' limits are lower now: grow into the room
                target, granted, view, _ = await trio.to_thread.run_sync(
                    self._exchange, w.limit, False)
        self.target, self.view, self._published = target, view, granted
        self.rounds += 1
        if granted > w.limit:
            w.set_limit(granted)
        elif target < w.limit:
            self._shrinking = True
            w.set_limit(target)  # victims doomed: the account fits the smaller limit now
            await w.drop_doomed()  # their drop committed: the disk holds no more either
            self._shrinking = False
            await trio.to_thread.run_sync(self._publish_limit, w.limit)
            self._published = min(self._published, w.limit)

    def _measure(self) -> None:
        """Loop: this dataset's numbers for the ledger (module docstring)."""
        c = self.counters
        now = time.time()
        snap = self.index.snapshot()
        if snap["files"]:
            self.demand = demand_of(snap["bytes_total"], snap["files"], self.writer.chunk_target)
        # bytes borrowed from another dataset of the root (dedup) are not this dataset's
        # cache at work: they do not raise its value (they are held in the other's share)
        served = c.bytes_from_cache + c.bytes_from_source + c.bytes_from_peers
        new = served - self.served_seen
        self.served_seen = served
        self.crf = decayed(self.crf, self.crf_t, self.last_read, now,
                           self.cfg.share_cooldown, self.cfg.share_halflife)
        self.crf_t = now
        if new > 0:
            self.crf += new / max(self.demand, 1)
            self.last_read = now
        h = self.calls.latency.by_op.get("read_file")
        if h is not None and h.count and c.bytes_from_source >= MIN_COST_BYTES and h.sum > 0:
            self.cost = h.sum / (c.bytes_from_source / MIB)
            self.bytes_per_s = c.bytes_from_source / h.sum
            self.latency_s = h.sum / h.count

    def _needs_room(self) -> bool:
        """Loop: whether the writer's account is within an eighth of its limit (it is
        using its share; more would be used)."""
        w = self.writer
        return w.account() >= w.limit - w.limit // 8

    def _reclaim(self, plan: list[tuple[str, int, float]]
                 ) -> tuple[list[Reclaimed], int, list[tuple[str, float, str]]]:
        """Thread: evict what ``plan`` says of each stopped dataset (each in a child
        process, under its own cache lock:
        :func:`dlcachefs.store.reclaim.evict_stopped_in_child`); what was freed where, how
        many failed, and (dataset, stop, why) of those skipped or failed, for the loop to
        hold back. A dataset in use meanwhile, or mounted again, is skipped; a failure is
        logged."""
        done, failed, skipped = [], 0, []
        for ds, nbytes, stopped_at in plan:
            try:
                r = evict_stopped_in_child(self.root, DATASETS_DIR, ds, nbytes, stopped_at)
            except OSError as e:  # another dataset's trouble: never ours
                failed += 1
                log.warning("taking back the space of stopped dataset %s failed: %s", ds, e)
                skipped.append((ds, stopped_at, "failed"))
                continue
            if r.skipped is not None:  # not fit, in use now, or mounted again
                if r.skipped == UNFIT:
                    log.info("stopped dataset %s: space not taken back (%s)", ds, r.skipped)
                skipped.append((ds, stopped_at, r.skipped))
                continue
            done.append(r)
        return done, failed, skipped

    def _entry(self, now: float, used: int) -> dict[str, Any]:
        return {"pid": os.getpid(), "host": socket.gethostname(), "state": "live",
                "heartbeat": now, "interval": self.cfg.share_interval, "used": used,
                "demand": self.demand, "cost": self.cost, "bytes_per_s": self.bytes_per_s,
                "latency_s": self.latency_s, "crf": self.crf, "crf_t": self.crf_t,
                "last_read": self.last_read, "source": self.cfg.source,
                "mountpoint": self.cfg.mountpoint}

    def _exchange(self, published: int, needs_room: bool
                  ) -> tuple[int, int, dict[str, Any], list[tuple[str, int, float]]]:
        """Thread: publish this entry (its limit no higher than ``published``, the
        writer's limit with every shrink committed), expire the dead, compute the
        allocation, grow into the room left. Returns (target, granted limit, a summary
        of every entry for the stats, and when ``needs_room``, what to evict of which
        stopped dataset, with the stop it was chosen at: :func:`reclaim_plan`)."""
        used = self.writer.used  # read off the loop: an int, a stale value is fine

        def fn(doc: dict[str, Any]) -> tuple[int, int, dict[str, Any]]:
            now = time.time()
            L.expire(doc, self.root, DATASETS_DIR, now, self.cfg.share_interval)
            old = doc["datasets"].get(self.ds, {})
            e = doc["datasets"][self.ds] = self._entry(now, used)
            # never raised here but by grant; never lowered below what the writer enforces
            e["limit"] = min(int(old.get("limit", published)), published) \
                if old.get("pid") == os.getpid() else published
            doc["budget"] = self.budget
            shares = allocate(doc, self.cfg.share_floor, self.cfg.share_policy)
            target = shares[self.ds]
            granted = L.grant(doc, self.ds, target)
            view = {ds: {"state": x.get("state"), "limit": int(x.get("limit", 0)),
                         "used": int(x.get("used", 0)), "target": shares.get(ds),
                         "cost_s_per_mib": x.get("cost"), "crf": x.get("crf"),
                         "reclaimed_bytes": int(x.get("reclaimed_bytes", 0))}
                    for ds, x in sorted(doc["datasets"].items())}
            plan = []
            if needs_room:
                c = self.cfg
                plan = [(v, n, float(doc["datasets"][v].get("heartbeat") or 0.0))
                        for v, n in reclaim_plan(doc, self.ds, c.share_floor, c.share_policy,
                                                 max(target, granted), now, c.share_cooldown,
                                                 c.share_halflife)]
            return target, granted, view, plan

        return self.ledger.update(fn)

    def _publish_limit(self, limit: int) -> None:
        """Thread: after a shrink was committed, publish the smaller limit at once (the
        others may grow into it at their next round)."""
        def fn(doc: dict[str, Any]) -> None:
            e = doc["datasets"].get(self.ds)
            if e is not None and int(e.get("pid", 0)) == os.getpid():
                e["limit"] = min(int(e.get("limit", limit)), limit)

        self.ledger.update(fn)

    def stats(self) -> dict[str, Any]:
        """The ``shared`` section of the stats document (loop)."""
        return {"root": self.root, "dataset": self.ds, "budget_bytes": self.budget,
                "policy": self.cfg.share_policy, "limit_bytes": self.writer.limit,
                "target_bytes": self.target, "demand_bytes": self.demand,
                "crf": round(self.crf, 6), "cost_s_per_mib": self.cost,
                "source_bytes_per_s": self.bytes_per_s, "source_latency_s": self.latency_s,
                "rounds": self.rounds, "errors": self.errors,
                "reclaimed_bytes": dict(self.reclaimed), "datasets": self.view}
