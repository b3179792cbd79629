"""The peer tier of a mount: files looked up at their owner's memcached before the
source, and files read from the source stored there, so each file leaves the remote once
per cluster (iCACHE III-E, Lobster 4.5, KSPEED III-B: the nodes' caches pooled).

Read path of a whole-file fetch (:meth:`dlcachefs.cache.fetch.Fetcher.read_whole`): the
local cache has missed; :meth:`PeerTier.lookup` asks the owner of the file's content key
(:mod:`dlcachefs.peers.valuefmt`), a plain get first, then (on a miss, once the fetch
holds a source slot) a get with the lease:

* a value that checks out: served (``bytes_from_peers``);
* a miss: ``add`` of the lease key (atomic on the owner, expiring after ``--peer-lease``)
  decides who reads the source. The winner reads it and stores the value; the others poll
  the owner for the value (and the lease) until ``--peer-lease`` has passed, then read the
  source themselves. A lease that disappears without a value (its holder failed) is taken
  over by the next poller;
* a value that must not be served (another version, partial, damaged): the source, and
  the good value replaces it;
* the owner down or failing: the source at once;
* a miss at an owner that *this node* marked down and then found up again, less than
  ``REFILL_S`` ago (empty: memcached keeps nothing across a restart), when the lookup won
  the lease at its first call: the next server by rendezvous order, which held its keys
  meanwhile, is asked too, and a value found there is stored at the owner again
  (``refills``). Not after a wait for another node's lease, nor on nodes that never saw
  the server down.

What this node reads from the source is stored at the owner by :meth:`store_later`, in
the background, never on the reader's path: a queue bounded in bytes (a value that does
not fit is dropped and counted in ``store_dropped``; a lease is always released; files
in pieces have a bound of their own, ``PIECED_QUEUE_FILES`` x ``--max-cached-file``).

Large files. A file whose value would not fit the servers' item limit
(``--peer-item-max``) is stored in pieces that do (:mod:`dlcachefs.peers.valuefmt`):
each piece at the owner of its own key (rendezvous over the piece keys, so a large file
spreads over the servers), at most ``PIECE_PARALLEL`` at once, then the manifest under
the file's key at its owner, then the lease goes; a piece not stored means no manifest.
The lease, the waits and the lookups are the file's, as for a small file: a hit on a
manifest reads the pieces back, ``PIECE_PARALLEL`` gets at once, each checked, then the
whole file against the manifest's checksum. A piece missing (evicted, its server down)
or refused is forgotten: that node deletes the manifest at the file's owner, then asks
for the file's lease as on a miss, so one node reads the source and stores the file
again while the others wait for it (not every node at once). Only files up to ``--max-cached-file`` (the largest file a node caches, and so
reads whole): larger ones are read through, in ranges, and skip the tier. Pieced files
are not kept at eviction (:meth:`PeerTier.keep`) nor refilled (:meth:`_refill`), and a
``touch`` (:meth:`PeerTier.held`) renews the manifest's expiry, not its pieces'.

A server that does not answer (refused, reset, ``--peer-timeout``) is marked down at the
first failure: its keys go to the next server by rendezvous order (only its share moves)
until a probe in the background finds it up again (every ``--peer-dead-time``). So a dead
or hung peer costs a reader at most its timeout once; nothing a client sees changes but
speed.

Keep the last copy in the cluster (Lobster 4.4). The rule: before a local policy's
victim is dropped, each of its current records is offered to :meth:`PeerTier.keep`
(the chunk writer reads them back in its commit thread, see
:mod:`dlcachefs.cache.writer`), which makes sure the record's owner holds it: a
``touch`` (it holds it: nothing sent, its expiry renewed) and only when it has none an
``add`` of the bytes (``keep_pushed``), in the background store queue, never on a
reader's path. Bounded: records are read back only while the queue has room
(:meth:`room`); the rest are counted (``keep_unread``) and cost a remote read later if
the cluster had lost them. Usually the owner holds the file (it was stored there when
fetched) and a touch is all it costs; the push matters when the tier lost the value
(a server restarted, memcached evicted or expired it) and this node's copy is the last.

Expiry at the last planned use: a value stored or kept gets the expiry
:attr:`PeerTier.expiry_of` gives for its inode (computed from the announced orders and
the loaders' pace, :mod:`dlcachefs.peers.expiry`); 0 (never) when no order
or pace is known. Counted in ``expiries_set``.

Concurrency rules: the tier's state (which servers are down, the store queue, the
counters) lives on the trio loop and is touched only there. Every memcached call blocks
and runs in a worker thread (``trio.to_thread.run_sync``): lookups and polls under
:attr:`PeerTier.limiter` (``LOOKUP_THREADS``), stores in ``STORE_WORKERS`` tasks of
:meth:`PeerTier.run`, one thread each, probes in one (see :meth:`PeerTier._in_thread`
for how admission, timeouts and abandoned threads are bounded). A thread does only
network I/O on a pool of connections (thread-safe) and the value's encoding and checksum, and returns
its outcome; the loop books it. A call is bounded on the loop by ``--peer-timeout`` (the
sockets by the same timeout, so an abandoned thread ends soon after). A lookup abandoned
after its thread won a lease (cancelled, or timed out) leaves that lease to expire: the
other nodes then wait at most ``--peer-lease`` before reading the source themselves.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import trio

from dlcachefs.cache.fetch import Prepaid
from dlcachefs.cache.source import Identity
from dlcachefs.config import Config, peer_list
from dlcachefs.peers.servers import ServerDown, ServerError, Servers
from dlcachefs.peers.valuefmt import (
    MAX_PIECES,
    BadValue,
    ContentKey,
    Manifest,
    content_key,
    fits,
    join_pieces,
    manifest_of,
    piece_key,
    piece_size_for,
    value_size,
)
from dlcachefs.store.integrity import log_failure

log = logging.getLogger(__name__)

#: threads looking values up at once (the reader's path and prefetch)
LOOKUP_THREADS = 8
#: tasks storing values at once (the background)
STORE_WORKERS = 2
#: bytes of values waiting to be stored; past it a value is dropped (and counted)
STORE_QUEUE_BYTES = 64 << 20
#: files in pieces have a bound of their own: this many times --max-cached-file (the
#: node that read a file for the cluster must store it, or the others read it too)
PIECED_QUEUE_FILES = 2
#: the first and the longest pause between two polls of a lease's value
POLL_FIRST, POLL_MAX = 0.01, 0.2
#: how long an orderly unmount waits for stores still queued
DRAIN_S = 10.0
#: how long after a server came back a miss there asks the next server too (see _refill)
REFILL_S = 3600.0
#: pieces of one file read (or stored) at once
PIECE_PARALLEL = 4

# a store waiting for a worker: (owner, key, data or None, holds the lease, expiry s,
# a kept evicted record, piece size: 0 for a whole value)
_Item = tuple[str, ContentKey, bytes | None, bool, int, bool, int]


class _Skipped(Exception):
    """A call not made: its server was marked down while the call waited (_in_thread)."""


@dataclass(slots=True)
class PeerCounters:
    """One server's counts since mount (``stats`` -> ``peers`` -> ``servers``)."""

    hits: int = 0  # values served
    misses: int = 0  # lookups that found no value
    bytes: int = 0  # bytes of values served
    stored: int = 0  # values stored
    stored_bytes: int = 0
    rejected: int = 0  # values refused: another version, partial, damaged
    errors: int = 0  # failed calls (the server down, or an error answer)
    marked_down: int = 0  # times it was marked down
    down_since: float | None = None  # monotonic time it was marked down (None: up)
    down_s: float = 0.0  # seconds it was down, until it was last found up

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        since = d.pop("down_since")
        d["state"] = "up" if since is None else "down"
        d["marked_down_s"] = round(self.down_s + (
            0.0 if since is None else time.monotonic() - since), 3)
        d.pop("down_s")
        return d


@dataclass(slots=True)
class TierCounters:
    """The tier's counts since mount (``stats`` -> ``peers``)."""

    lookups: int = 0  # whole-file fetches that asked the tier
    skipped_large: int = 0  # fetches of files too large for the tier (> --max-cached-file)
    pieced_hits: int = 0  # files served from their pieces
    pieced_bytes: int = 0
    pieced_misses: int = 0  # files whose manifest was found, a piece not: from the source
    pieced_rejected: int = 0  # ... a piece or the whole file refused: from the source
    pieced_forgotten: int = 0  # manifests deleted for those: a lease decides who reads
    pieced_stored: int = 0  # files stored in pieces (their manifest written)
    pieces_stored: int = 0
    pieced_store_failures: int = 0  # files whose pieces were not all stored (no manifest)
    no_server: int = 0  # lookups with every server down
    leases: int = 0  # leases won: this node read the source for the cluster
    lease_waits: int = 0  # lookups that found another node's lease and waited
    lease_wait_hits: int = 0  # ... and got its value
    lease_wait_timeouts: int = 0  # ... and read the source themselves after --peer-lease
    lease_wait_owner_down: int = 0  # ... and read the source: the owner went down meanwhile
    lease_takeovers: int = 0  # leases taken after their holder's disappeared without a value
    refills: int = 0  # misses at a server back from down found at the next one (see _refill)
    store_queued: int = 0
    store_dropped: int = 0  # values not stored: the queue's bytes were full
    store_dropped_bytes: int = 0
    lookup_failures: int = 0  # lookups that failed unexpectedly (a bug): read from the source
    store_failures: int = 0  # stores that failed unexpectedly (a bug): not stored
    keep_offered: int = 0  # evicted records offered to keep the last copy (Lobster 4.4)
    keep_held: int = 0  # ... whose owner held them already (touched)
    keep_pushed: int = 0  # ... whose owner did not: stored there
    keep_pushed_bytes: int = 0
    keep_dropped: int = 0  # ... not kept: the queue was full, no server was up, or in pieces
    keep_unread: int = 0  # evicted records not read back: no room in the queue
    expiries_set: int = 0  # values stored or kept with an expiry (a known last use)


@dataclass(slots=True)
class Lookup:
    """What :meth:`PeerTier.lookup` found: the file's bytes (a hit), or None and whether
    this caller holds the lease (then it must pass ``lease=True`` to :meth:`store_later`
    or call :meth:`release`)."""

    data: bytes | None
    lease: bool = False
    key: ContentKey | None = None
    owner: str | None = None


class PeerTier:
    """The cluster's shared tier, as one mount uses it (see the module docstring)."""

    def __init__(self, cfg: Config, source_root: bytes,
                 expiry_of: Callable[[int], int] | None = None) -> None:
        """``expiry_of(ino)``: the memcached expiry (s, 0: never) of a file's value (its
        last planned use: :func:`dlcachefs.peers.expiry.expiry_of_streams`)."""
        assert cfg.peers is not None
        self.cfg = cfg
        self.namespace = (cfg.peer_namespace.encode() if cfg.peer_namespace
                          else source_root)
        self.timeout = cfg.peer_timeout
        self.lease_s = max(1, math.ceil(cfg.peer_lease))
        if cfg.peer_key_inode and not cfg.use_source_inode:
            log.warning("--peer-key-inode has no effect with --ignore-source-inode "
                        "(the source's inode numbers are not read)")
        self.limiter = trio.CapacityLimiter(LOOKUP_THREADS)  # lookups admitted at once
        # threads of every call: the admitted ones (lookups, stores, the probe) and room
        # for abandoned ones (see _in_thread)
        self._threads = trio.CapacityLimiter(3 * (LOOKUP_THREADS + STORE_WORKERS + 1))
        # a connection per thread that may call one server at once: a smaller pool raises
        # RuntimeError('Too many objects') while abandoned threads still hold connections
        self.servers = Servers(peer_list(cfg.peers), cfg.peer_timeout,
                               pool_size=int(self._threads.total_tokens))
        self.per_server = {n: PeerCounters() for n in self.servers.names}
        #: this node's own server (--peer-self), named as in :attr:`servers`
        self.self_name: str | None = None
        if cfg.peer_self is not None:
            h, p = peer_list(cfg.peer_self)[0]
            self.self_name = f"[{h}]:{p}" if ":" in h else f"{h}:{p}"
        self.counters = TierCounters()
        self._down: frozenset[str] = frozenset()
        self._down_until: dict[str, float] = {}
        self._back_at: dict[str, float] = {}  # servers found up again, and when
        # (owner, key, data or None, holds the lease, expiry s, a kept evicted record)
        # waiting for a store worker
        self._queue: deque[_Item] = deque()
        self._pieced_bytes = 0  # bytes of files in pieces queued or being stored
        # piece stores at once (each its own thread call, under its server's timeout)
        self._piece_stores = trio.CapacityLimiter(PIECE_PARALLEL)
        #: inode -> the memcached expiry (s) of its value, 0: never
        self.expiry_of = expiry_of
        self.queue_bytes = 0
        self._storing = 0
        self._queued = trio.Event()  # set when the queue gets an item
        self._idle = trio.Event()  # set when the queue is empty and no store runs
        self._idle.set()
        self._running = False

    # ----- routing, and servers marked down ------------------------------------------

    def key_of(self, rel: bytes, ident: Identity) -> ContentKey:
        # the inode only with --peer-key-inode: it differs per client on sshfs
        return content_key(self.namespace, rel, ident.size, ident.mtime_ns,
                           ident.src_ino if self.cfg.peer_key_inode else None)

    def fits(self, rel: bytes, ident: Identity) -> bool:
        """Whether the tier may hold the file (else it skips the tier, counted): a value
        that fits an item, or pieces of one that does not, up to --max-cached-file."""
        if self._piece_size(self.key_of(rel, ident)) >= 0:
            return True
        self.counters.skipped_large += 1
        return False

    def _piece_size(self, ck: ContentKey) -> int:
        """0: ``ck``'s file is stored as one value; > 0: in pieces of that size; -1: not
        at all (larger than --max-cached-file, or not even a piece fits an item)."""
        item_max = self.cfg.peer_item_max
        if fits(ck, item_max):
            return 0
        if ck.size > self.cfg.max_cached_file:
            return -1
        size = piece_size_for(ck, item_max)
        if size <= 0 or -(-ck.size // size) > MAX_PIECES:
            return -1  # (a reader refuses a manifest of more pieces)
        return size

    def owner(self, ck: ContentKey) -> str | None:
        return self.servers.owner(ck.key, self._down)

    def mine(self, rel: bytes, ident: Identity) -> bool:
        """Whether this node's own server (``--peer-self``) owns the file's value now."""
        return self.self_name is not None and self.owner(self.key_of(rel, ident)) == self.self_name

    def _mark_down(self, name: str, why: object) -> None:
        c = self.per_server[name]
        c.errors += 1
        if c.down_since is not None:
            return
        c.down_since = time.monotonic()
        c.marked_down += 1
        self._down = self._down | {name}
        self._down_until[name] = c.down_since + self.cfg.peer_dead_time
        log.warning("peer %s marked down for %.0f s: %s", name, self.cfg.peer_dead_time, why)

    def _mark_up(self, name: str) -> None:
        c = self.per_server[name]
        if c.down_since is None:
            return
        c.down_s += time.monotonic() - c.down_since
        c.down_since = None
        self._down = self._down - {name}
        self._down_until.pop(name, None)
        self._back_at[name] = time.monotonic()  # empty, probably: see _refill
        log.info("peer %s is up again", name)

    async def _in_thread(self, fn, *args, admit: trio.CapacityLimiter | None = None,
                         server: str | None = None):
        """``fn(*args)`` in a worker thread, bounded by --peer-timeout on the loop:
        :class:`ServerDown` when it does not return in time; :class:`_Skipped` when
        ``server`` was marked down while the call waited for its admission.

        A call is admitted by ``admit`` (:attr:`limiter` by default) and gets its thread's
        token of :attr:`_threads` *before* its timeout starts, so a call queued behind
        others (or behind the abandoned threads of a hung server) never counts its wait
        against a server. Once admitted, a call to a server marked down meanwhile is not
        made: a hung server costs a reader its timeout once, not once per queued lookup. A
        call that times out is abandoned (its thread ends with its socket's timeout, the
        same) and gives its admission back; its thread keeps its token of
        :attr:`_threads`, which has room for the abandoned calls of a hung server next to
        the admitted ones (a server is marked down at its first timeout)."""
        async with admit or self.limiter:
            borrower = object()
            await self._threads.acquire_on_behalf_of(borrower)
            paid = Prepaid(self._threads, borrower)
            try:
                if server is not None and server in self._down:
                    raise _Skipped(server)
                with trio.move_on_after(self.timeout):
                    return await trio.to_thread.run_sync(
                        fn, *args, limiter=paid, abandon_on_cancel=True)
            finally:
                if not paid.used:  # no thread started: the token is still ours
                    self._threads.release_on_behalf_of(borrower)
        raise ServerDown(f"no answer within {self.timeout:g} s")

    async def _ask(self, owner: str, ck: ContentKey, take: bool,
                   first: bool = True) -> tuple[str, Any]:
        """One lookup on ``owner``, booked; ``("error", None)`` when it failed,
        ``("down", None)`` when ``owner`` was marked down before the call was made (not
        an error: the call was not made). ``first``: the lookup's first call (a miss is
        counted once per lookup, not at each poll of a lease's value)."""
        c = self.per_server[owner]
        try:
            kind, got = await self._in_thread(
                self.servers.get_or_lease, owner, ck, self.lease_s, take, server=owner)
        except _Skipped:
            return "down", None
        except ServerDown as e:
            self._mark_down(owner, e)
            return "error", None
        except ServerError as e:
            c.errors += 1
            log.debug("peer %s: %s", owner, e)
            return "error", None
        if kind == "hit":
            c.hits += 1
            c.bytes += 0 if isinstance(got, Manifest) else len(got)
        elif kind == "bad":
            c.rejected += 1
            log.warning("peer %s: refused a value of %r: %s", owner, ck.content[-200:], got)
        elif first:
            c.misses += 1
        return kind, got

    # ----- the read path ---------------------------------------------------------------

    async def lookup(self, rel: bytes, ident: Identity,
                     before_lease: Callable[[], Awaitable[None]] | None = None,
                     on_wait: Callable[[], None] | None = None) -> Lookup:
        """The file's bytes from its owner, or who reads the source (module docstring).
        Never raises but Cancelled: a failure of the tier is a miss (the source serves).

        ``before_lease``: awaited before this node tries for a lease (the caller takes a
        source slot: it leases only what it can read at once); the lookup is then a plain
        get first, and on a miss a second call takes the lease. ``on_wait``: called when
        the lookup starts waiting for another node's lease (the slot goes back)."""
        try:
            return await self._lookup(rel, ident, before_lease, on_wait)
        except Exception:  # noqa: BLE001 - a bug here must cost speed, never a read
            self.counters.lookup_failures += 1
            if self.counters.lookup_failures == 1:
                log_failure(log, "peer tier: a lookup failed (read from the source)")
            return Lookup(None)

    async def _lookup(self, rel: bytes, ident: Identity,
                      before_lease: Callable[[], Awaitable[None]] | None,
                      on_wait: Callable[[], None] | None) -> Lookup:
        self.counters.lookups += 1
        ck = self.key_of(rel, ident)
        owner = self.owner(ck)
        if owner is None:
            self.counters.no_server += 1
            return Lookup(None)
        first = True
        if before_lease is not None:
            kind, got = await self._ask(owner, ck, take=False)
            if kind == "hit":
                served = await self._served(ck, owner, got)
                if served is not None:
                    return served
                # (its pieces are lost and the manifest forgotten: a lease as on a miss)
            elif kind != "miss":  # an error, the owner down, a value not to be served
                return Lookup(None, key=ck, owner=owner)
            await before_lease()
            owner2 = self.owner(ck)
            if owner2 is None:
                return Lookup(None)
            owner, first = owner2, False
        kind, got = await self._ask(owner, ck, take=True, first=first)
        if kind == "hit":
            served = await self._served(ck, owner, got)
            if served is not None:
                return served
            # its pieces are lost and the manifest forgotten: the lease, as on a miss
            kind, got = await self._ask(owner, ck, take=True, first=False)
            if kind == "hit":  # stored again meanwhile
                return await self._served(ck, owner, got) or Lookup(None, key=ck, owner=owner)
        if kind == "lease":
            self.counters.leases += 1
            log.debug("lease on %s (%s) at %s", ck.key, rel, owner)
            got = Lookup(None, lease=True, key=ck, owner=owner)
            return await self._refill(got) if owner in self._back_at else got
        if kind != "wait":  # an error, or a value that must not be served
            return Lookup(None, key=ck, owner=owner)
        # another node reads the source: wait for its value, bounded
        self.counters.lease_waits += 1
        if on_wait is not None:
            on_wait()
        deadline = trio.current_time() + self.cfg.peer_lease
        pause = POLL_FIRST
        while trio.current_time() < deadline:
            await trio.sleep(min(pause, max(0.0, deadline - trio.current_time())))
            pause = min(POLL_MAX, pause * 1.5)
            if self.owner(ck) != owner:
                # the owner went down meanwhile (its lease with it): read the source
                self.counters.lease_wait_owner_down += 1
                return Lookup(None, key=ck, owner=owner)
            kind, got = await self._ask(owner, ck, take=True, first=False)
            if kind == "hit":
                self.counters.lease_wait_hits += 1
                return await self._served(ck, owner, got) or Lookup(None, key=ck, owner=owner)
            if kind == "lease":  # its holder gave up (or its lease expired): ours now
                self.counters.leases += 1
                self.counters.lease_takeovers += 1
                log.debug("lease taken over on %s (%s) at %s", ck.key, rel, owner)
                return Lookup(None, lease=True, key=ck, owner=owner)
            if kind == "down":
                self.counters.lease_wait_owner_down += 1
                return Lookup(None, key=ck, owner=owner)
            if kind != "wait":
                return Lookup(None, key=ck, owner=owner)
        self.counters.lease_wait_timeouts += 1
        return Lookup(None, key=ck, owner=owner)

    async def _served(self, ck: ContentKey, owner: str, got: memoryview | Manifest
                      ) -> Lookup | None:
        """A hit at ``owner``: the file's bytes, from its value or from the pieces its
        manifest names (read from their servers, each checked, then the whole file). A
        piece missing or refused: None, once the manifest is forgotten at ``owner``, so
        that the caller asks for the file's lease as on a miss (one node reads the source
        and stores the file again, the others wait for it)."""
        if not isinstance(got, Manifest):
            return Lookup(bytes(got), key=ck, owner=owner)
        data = await self._read_pieces(ck, got)
        if data is None:
            await self._forget(ck, owner)
            return None
        self.counters.pieced_hits += 1
        self.counters.pieced_bytes += len(data)
        return Lookup(data, key=ck, owner=owner)

    async def _forget(self, ck: ContentKey, owner: str) -> None:
        """Delete ``ck``'s manifest at ``owner``, best effort: its pieces are not all
        there. (A node that only missed them, say with a server it alone saw down, costs
        the cluster one more source read of the file, under a lease.)"""
        self.counters.pieced_forgotten += 1
        try:
            await self._in_thread(self.servers.forget, owner, ck, server=owner)
        except _Skipped:
            pass
        except ServerDown as e:
            self._mark_down(owner, e)
        except ServerError as e:
            self.per_server[owner].errors += 1
            log.debug("peer %s: %s", owner, e)

    async def _read_pieces(self, ck: ContentKey, m: Manifest) -> bytes | None:
        """The file ``m`` describes from its pieces, :data:`PIECE_PARALLEL` gets at once
        (each a call of :attr:`limiter`, like a lookup); None at the first piece missing
        or refused (the others are not read), or when the whole file is refused."""
        parts: list[memoryview | None] = [None] * m.pieces
        missing: list[str] = []

        async def get(i: int) -> bool:
            key = piece_key(ck, m.piece_size, i)
            name = self.servers.owner(key, self._down)
            if name is None:
                missing.append("miss")
                return False
            c = self.per_server[name]
            try:
                kind, got = await self._in_thread(self.servers.get_piece, name, ck, m, i,
                                                  server=name)
            except _Skipped:
                kind, got = "miss", None
            except ServerDown as e:
                self._mark_down(name, e)
                kind, got = "miss", None
            except ServerError as e:
                c.errors += 1
                log.debug("peer %s: %s", name, e)
                kind, got = "miss", None
            if kind == "hit":
                c.hits += 1
                c.bytes += len(got)
                parts[i] = got
                return True
            if kind == "bad":
                c.rejected += 1
                log.warning("peer %s: refused piece %d of %r: %s", name, i,
                            ck.content[-200:], got)
            else:
                c.misses += 1
            missing.append(kind)
            return False

        if not await self._each_piece(m.pieces, get):
            if "bad" in missing:
                self.counters.pieced_rejected += 1
            else:
                self.counters.pieced_misses += 1
            return None
        try:
            return await trio.to_thread.run_sync(join_pieces, ck, m, parts)
        except BadValue as e:
            self.counters.pieced_rejected += 1
            log.warning("peer tier: refused the pieces of %r: %s", ck.content[-200:],
                        e.reason)
            return None

    @staticmethod
    async def _each_piece(n: int, fn: Callable[[int], Awaitable[bool]]) -> bool:
        """``fn(i)`` for each piece ``i`` of ``n``, :data:`PIECE_PARALLEL` at once, in
        order of index; False (and no piece started after it) at the first False."""
        todo = iter(range(n))
        ok = True

        async def worker() -> None:
            nonlocal ok
            for i in todo:  # (shared by the workers: the loop's thread only)
                if not ok:
                    return
                if not await fn(i):
                    ok = False
                    return

        async with trio.open_nursery() as nursery:
            for _ in range(min(PIECE_PARALLEL, n)):
                nursery.start_soon(worker)
        return ok

    async def _refill(self, got: Lookup) -> Lookup:
        """A miss (lease won) at an owner that came back less than ``REFILL_S`` ago: it
        came back empty, and while it was down its keys were stored at the next server by
        rendezvous order. Ask that one (a get, no lease); a value found there is served
        and stored at the owner again (releasing the lease), so a server's comeback does
        not cost its share from the remote a second time."""
        assert got.key is not None and got.owner is not None
        if time.monotonic() - self._back_at[got.owner] > REFILL_S:
            del self._back_at[got.owner]
            return got
        alt = self.servers.owner(got.key.key, self._down | {got.owner})
        if alt is None:
            return got
        kind, data = await self._ask(alt, got.key, take=False)
        if kind != "hit" or isinstance(data, Manifest):  # (pieces are not refilled)
            return got
        self.counters.refills += 1
        value = bytes(data)
        self._store_key(got.key, value, got)  # at the owner; then its lease goes
        return Lookup(value, key=got.key, owner=alt)

    async def held(self, rel: bytes, ident: Identity, ino: int = 0) -> bool:
        """Whether the file's owner holds a value under its key now (a ``touch``: its
        expiry is renewed, nothing is sent; the value is checked only when read). False
        when the owner is down or the call fails. For the owner's prefetch
        (:mod:`dlcachefs.peers.ownerprefetch`), which needs no bytes it already has."""
        ck = self.key_of(rel, ident)
        owner = self.owner(ck)
        if owner is None:
            return False
        try:
            return bool(await self._in_thread(self.servers.touch, owner, ck,
                                              self._expiry(ino), server=owner))
        except _Skipped:
            return False
        except ServerDown as e:
            self._mark_down(owner, e)
            return False
        except ServerError:
            self.per_server[owner].errors += 1
            return False

    def store_later(self, rel: bytes, ident: Identity, data: bytes | memoryview,
                    got: Lookup | None = None, ino: int = 0) -> None:
        """Store this version of ``rel``, read from the source, at its owner, in the
        background; release ``got``'s lease (after the store). ``ino``: the file's inode,
        for its expiry (:attr:`expiry_of`). Never blocks, never raises."""
        self._store_key(self.key_of(rel, ident), data, got, self._expiry(ino))

    def _expiry(self, ino: int) -> int:
        if self.expiry_of is None or not ino:
            return 0
        try:
            return max(0, int(self.expiry_of(ino)))
        except Exception:  # noqa: BLE001 - an expiry is a hint: never
            log.debug("peer tier: no expiry for inode %d", ino, exc_info=True)
            return 0

    # ----- keeping the last copy (Lobster 4.4; module docstring) ----------------------

    def room(self) -> int:
        """Bytes of evicted records :meth:`keep` accepts now (the chunk writer reads no
        more back). Trio loop."""
        return STORE_QUEUE_BYTES - self._whole_bytes() if self._running else 0

    def _whole_bytes(self) -> int:
        """Bytes of whole values queued or being stored (bounded by STORE_QUEUE_BYTES)."""
        return self.queue_bytes - self._pieced_bytes

    def keep(self, records: list[tuple[int, bytes, Identity, bytes]], unread: int) -> None:
        """Make sure each evicted record's owner holds it, in the background (touch, else
        add). Trio loop; never blocks, never raises."""
        self.counters.keep_unread += unread
        for ino, rel, ident, data in records:
            self.counters.keep_offered += 1
            ck = self.key_of(rel, ident)
            owner = self.owner(ck)
            size = value_size(ck)
            # (a file in pieces is not kept: its pieces are at several servers)
            if (owner is None or not fits(ck, self.cfg.peer_item_max) or not self._running
                    or self._whole_bytes() + size > STORE_QUEUE_BYTES):
                self.counters.keep_dropped += 1
                continue
            self.queue_bytes += size
            self._push((owner, ck, data, False, self._expiry(ino), True, 0))

    def _store_key(self, ck: ContentKey, data: bytes | memoryview,
                   got: Lookup | None, expire: int = 0) -> None:
        if got is not None and got.lease and got.key != ck:
            self.release(got)  # the file changed: the lease was on the old version
            got = None
        lease = got is not None and got.lease
        owner = got.owner if lease and got is not None else self.owner(ck)
        piece_size = self._piece_size(ck)
        if owner is None or piece_size < 0:
            if lease:
                self.release(got)
            return
        size = value_size(ck)
        if piece_size:  # their own bound; one file always fits (its bytes are in memory)
            room = (not self._pieced_bytes or self._pieced_bytes + size
                    <= PIECED_QUEUE_FILES * self.cfg.max_cached_file)
        else:
            room = self._whole_bytes() + size <= STORE_QUEUE_BYTES
        if not self._running or not room:
            self.counters.store_dropped += 1
            self.counters.store_dropped_bytes += size
            if lease:
                self.release(got)
            return
        self.counters.store_queued += 1
        self.queue_bytes += size
        if piece_size:
            self._pieced_bytes += size
        self._push((owner, ck, bytes(data), lease, expire, False, piece_size))

    def release(self, got: Lookup | None) -> None:
        """Give up ``got``'s lease (its holder will not store a value): the others stop
        waiting for it at their next poll. In the background."""
        if got is None or not got.lease or got.key is None or got.owner is None:
            return
        log.debug("lease released without a value on %s", got.key)
        got.lease = False
        if self._running:
            self._push((got.owner, got.key, None, True, 0, False, 0))

    def _push(self, item: _Item) -> None:
        self._queue.append(item)
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self._queued.set()

    # ----- background: stores and probes ----------------------------------------------

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The store workers and the prober, until cancelled."""
        async with trio.open_nursery() as nursery:
            store_limiter = trio.CapacityLimiter(STORE_WORKERS)
            for _ in range(STORE_WORKERS):
                nursery.start_soon(self._store_worker, store_limiter)
            nursery.start_soon(self._prober)
            self._running = True
            task_status.started()
            try:
                await trio.sleep_forever()
            finally:
                self._running = False

    async def _store_worker(self, limiter: trio.CapacityLimiter) -> None:
        while True:
            while not self._queue:
                if self._queued.is_set():  # never replace an event a worker waits on
                    self._queued = trio.Event()
                await self._queued.wait()
            owner, ck, data, lease, expire, kept, piece_size = self._queue.popleft()
            self._storing += 1
            try:
                if kept:
                    assert data is not None
                    await self._keep(owner, ck, data, expire, limiter)
                elif piece_size:
                    assert data is not None
                    await self._store_pieced(owner, ck, data, lease, limiter, expire,
                                             piece_size)
                else:
                    await self._store(owner, ck, data, lease, limiter, expire)
            except Exception:  # noqa: BLE001 - one item's failure must not end the tier
                self.counters.store_failures += 1
                if self.counters.store_failures == 1:
                    log_failure(log, "peer tier: a store to %s failed", owner)
            finally:
                self._storing -= 1
                if data is not None:
                    self.queue_bytes -= value_size(ck)
                    if piece_size:
                        self._pieced_bytes -= value_size(ck)
                if not self._queue and not self._storing:
                    self._idle.set()

    async def _keep(self, owner: str, ck: ContentKey, data: bytes, expire: int,
                    limiter: trio.CapacityLimiter) -> None:
        if owner in self._down:
            owner2 = self.owner(ck)  # its keys went to the next server by rendezvous order
            if owner2 is None:
                self.counters.keep_dropped += 1
                return
            owner = owner2
        c = self.per_server[owner]
        try:
            outcome = await self._in_thread(self.servers.keep, owner, ck, data, expire,
                                            admit=limiter)
        except ServerDown as e:
            self._mark_down(owner, e)
            self.counters.keep_dropped += 1
            return
        except ServerError as e:
            c.errors += 1
            self.counters.keep_dropped += 1
            log.debug("peer %s: keep refused: %s", owner, e)
            return
        if expire:
            self.counters.expiries_set += 1
        if outcome == "pushed":
            self.counters.keep_pushed += 1
            self.counters.keep_pushed_bytes += len(data)
            c.stored += 1
            c.stored_bytes += len(data)
        else:
            self.counters.keep_held += 1

    async def _store(self, owner: str, ck: ContentKey, data: bytes | Manifest | None,
                     lease: bool, limiter: trio.CapacityLimiter, expire: int = 0) -> bool:
        """Store ``data`` (a value's bytes, or the manifest of pieces stored already) at
        ``owner``; True if it was stored."""
        if owner in self._down:
            # its holder's owner is down: the lease is gone with it; the value goes to the
            # key's owner now (the next server by rendezvous order)
            owner2 = self.owner(ck)
            if owner2 is None or data is None:
                return False
            owner, lease = owner2, False
        c = self.per_server[owner]
        stored = await self._stored_at(owner, "store", self.servers.store, owner, ck, data,
                                       lease, expire, admit=limiter)
        if stored:
            if expire:
                self.counters.expiries_set += 1
            c.stored += 1
            c.stored_bytes += len(data) if isinstance(data, bytes) else 0
        return stored

    async def _stored_at(self, name: str, what: str, fn, *args, **kw) -> bool:
        """A store call to server ``name`` (``fn(*args)`` in a thread, see
        :meth:`_in_thread`): whether it stored. A server down is marked, a refusal
        counted (``what`` names it in the log)."""
        try:
            return await self._in_thread(fn, *args, **kw)
        except ServerDown as e:
            self._mark_down(name, e)
            return False
        except ServerError as e:
            self.per_server[name].errors += 1
            log.debug("peer %s: %s refused: %s", name, what, e)
            return False

    async def _store_pieced(self, owner: str, ck: ContentKey, data: bytes, lease: bool,
                            limiter: trio.CapacityLimiter, expire: int,
                            piece_size: int) -> None:
        """Store ``data`` in pieces (each at the owner of its own key, at most
        :data:`PIECE_PARALLEL` at once), then its manifest at ``owner`` (and the lease
        goes). A piece not stored: no manifest (a reader would miss that piece), the lease
        released."""
        if owner in self._down:  # as in _store: the lease went with the server
            owner2 = self.owner(ck)
            if owner2 is None:
                return
            owner, lease = owner2, False
        try:
            await self._store_pieces(owner, ck, data, lease, limiter, expire, piece_size)
        except BaseException:
            if lease:  # (others would wait --peer-lease for a manifest never written)
                with trio.CancelScope(shield=True), contextlib.suppress(Exception):
                    await self._store(owner, ck, None, True, limiter)
            raise

    async def _store_pieces(self, owner: str, ck: ContentKey, data: bytes, lease: bool,
                            limiter: trio.CapacityLimiter, expire: int,
                            piece_size: int) -> None:
        m = await trio.to_thread.run_sync(manifest_of, ck, data, piece_size)

        async def put(i: int) -> bool:
            name = self.servers.owner(piece_key(ck, piece_size, i), self._down)
            if name is None:
                return False
            c = self.per_server[name]
            try:
                stored = await self._stored_at(name, "piece", self.servers.set_piece, name,
                                               ck, m, i, data, expire,
                                               admit=self._piece_stores, server=name)
            except _Skipped:
                return False
            if stored:
                lo, hi = m.bounds(i)
                c.stored += 1
                c.stored_bytes += hi - lo
                self.counters.pieces_stored += 1
            return stored

        if not await self._each_piece(m.pieces, put):
            self.counters.pieced_store_failures += 1
            if lease:
                await self._store(owner, ck, None, True, limiter)  # the lease goes
            return
        if await self._store(owner, ck, m, lease, limiter, expire):
            self.counters.pieced_stored += 1

    async def _prober(self) -> None:
        """Probe servers marked down once their --peer-dead-time has passed; one answer
        brings a server back (its keys return to it)."""
        limiter = trio.CapacityLimiter(1)
        while True:
            await trio.sleep(min(1.0, self.cfg.peer_dead_time))
            now = time.monotonic()
            for name, until in list(self._down_until.items()):
                if until > now:
                    continue
                try:
                    await self._in_thread(self.servers.probe, name, admit=limiter)
                except (ServerDown, ServerError):
                    self._down_until[name] = time.monotonic() + self.cfg.peer_dead_time
                    continue
                self._mark_up(name)

    async def drain(self, timeout: float = DRAIN_S) -> bool:
        """Wait until the queued stores are done (tests, an orderly unmount); False if
        they were not within ``timeout``."""
        with trio.move_on_after(timeout):
            while not self._idle.is_set():
                await self._idle.wait()
            return True
        return False

    async def close(self) -> None:
        """Finish the queued stores (bounded), then close the connections (in a thread)."""
        if self._running:
            await self.drain()
        await trio.to_thread.run_sync(self.servers.close)

    # ----- stats -------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {
            **asdict(self.counters),
            "store_queue_bytes": self.queue_bytes,
            "store_pending": len(self._queue) + self._storing,
            "item_max": self.cfg.peer_item_max,
            "servers": {n: c.as_dict() for n, c in self.per_server.items()},
        }
