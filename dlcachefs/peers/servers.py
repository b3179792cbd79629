"""The memcached servers of the peer tier, as pymemcache clients: who owns a key, and the
blocking calls on one server.

Why not ``pymemcache.HashClient`` itself: it is what this wraps, part by part, with its
semantics kept but made safe for concurrent threads and visible in stats:

* routing is HashClient's: rendezvous hashing (:class:`Rendezvous`, pymemcache's
  ``RendezvousHash`` with a faster hash) over the servers' ``"host:port"`` names, so
  ``HashClient(servers, hasher=Rendezvous)`` given the same key finds the same server
  (operators and tests can read and write the tier with it); a
  server marked down is left out of the hash, so its keys go to the next server by
  rendezvous order (HashClient's ``remove_server``), and only its share moves;
* each server is a :class:`~pymemcache.client.base.PooledClient` (HashClient's
  ``use_pooling=True``): a pool of connections, safe to use from several threads, a
  connection that failed is dropped from the pool;
* ``retry_attempts=0`` and ``dead_timeout``: the first connection error or timeout marks
  the server down at once (a dead or hung peer costs at most its timeout once), and it is
  probed again after ``--peer-dead-time`` by the tier's background task, never by a
  reader; ``ignore_exc``: errors are never raised to a reader, they are misses (the
  source serves) and are counted per server.

HashClient keeps its failure bookkeeping (``_failed_clients``, ``_dead_clients``, the
hasher's node list) in plain dicts and lists changed by whichever thread saw the failure:
two threads failing on the same server at once make ``remove_server`` raise (the node is
removed twice), and a reader's thread would pay a dead server's timeout again at each
``dead_timeout``. Here that state is the tier's, on the trio loop
(:mod:`dlcachefs.peers.tier`).

Concurrency: :meth:`Servers.owner` is called on the loop with the current set of servers
that are up; everything else blocks on the network and runs in worker threads. The
clients are made once and never changed; pymemcache's pools hold their own locks.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import xxhash

from dlcachefs.peers.valuefmt import (
    BadValue,
    ContentKey,
    Manifest,
    decode_piece,
    decode_stored,
    encode,
    encode_manifest,
    encode_piece,
    piece_key,
)

try:  # only a mount with --peers imports this module (pymemcache is optional)
    import pymemcache.client.base as _pymemcache_base
    from pymemcache.client.base import PooledClient
    from pymemcache.client.rendezvous import RendezvousHash
    from pymemcache.exceptions import MemcacheError, MemcacheUnexpectedCloseError
except ModuleNotFoundError as _e:  # pragma: no cover - the CLI checks first
    raise ModuleNotFoundError("--peers needs pymemcache: pip install 'dlcachefs[peers]'") from _e


log = logging.getLogger(__name__)

# pymemcache reads a value in recv() calls of RECV_SIZE bytes (4 KiB), each taking the GIL
# again: a 4 MB value (a piece of a large file) took ~1,000 calls, ~18 ms on one core,
# and ~1.5 ms in calls of 256 KiB. A module constant read at each call, set once here.
if getattr(_pymemcache_base, "RECV_SIZE", 0) < 256 << 10:
    _pymemcache_base.RECV_SIZE = 256 << 10


def _xxh3(text: str, seed: int) -> int:
    return xxhash.xxh3_64_intdigest(text.encode(), seed)


class Rendezvous(RendezvousHash):
    """HashClient's rendezvous hash (highest score of ``"{server}-{key}"`` wins) with xxh3
    in place of its pure-Python murmur3, which costs ~3.5 ms per key over 64 servers on
    this machine (46 us with xxh3) and runs on the trio loop here. To find the same
    owners from outside: ``HashClient(servers, hasher=Rendezvous)``."""

    def __init__(self, nodes: list[str] | None = None, seed: int = 0) -> None:
        super().__init__(nodes, seed, hash_function=_xxh3)


class ServerDown(Exception):
    """A server that did not answer (connection refused or reset, timeout): mark it down."""


class ServerError(Exception):
    """A server that answered with an error (the item too large, out of memory), or a call
    that failed some other way (pymemcache's pool full, a bug): count it, the server stays
    up."""


class Servers:
    """The tier's servers: names, owners, and one blocking call each (in threads)."""

    def __init__(self, servers: list[tuple[str, int]], timeout: float,
                 pool_size: int = 16) -> None:
        """``pool_size``: connections per server; at least the threads that may call one
        server at once (the tier's thread capacity, abandoned threads included), else
        pymemcache's pool raises ``RuntimeError('Too many objects')``."""
        self._logged: set[str] = set()  # kinds of unexpected failures logged once
        self.names = [f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in servers]
        self.clients = {
            name: PooledClient(
                srv, connect_timeout=timeout, timeout=timeout, no_delay=True,
                max_pool_size=pool_size, default_noreply=False)
            for name, srv in zip(self.names, servers, strict=True)}
        self._hashes: dict[frozenset[str], Any] = {}

    def owner(self, key: str, down: frozenset[str]) -> str | None:
        """The server that owns ``key`` among those not ``down`` (None: all are down).
        Trio loop (a rendezvous hash over each live server: microseconds per server)."""
        h = self._hashes.get(down)
        if h is None:
            if len(self._hashes) >= 64:  # down-sets seen: a few, unless servers flap
                self._hashes.clear()
            h = self._hashes[down] = Rendezvous([n for n in self.names if n not in down])
        return h.get_node(key)

    # ----- blocking calls, in worker threads ---------------------------------------------

    def _call(self, name: str, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return getattr(self.clients[name], method)(*args, **kwargs)
        except (OSError, MemcacheUnexpectedCloseError) as e:  # TimeoutError is an OSError
            raise ServerDown(f"{name}: {e!r}") from e
        except MemcacheError as e:
            if "too large" in str(e):
                self._log_once("too large", "peer %s refused a value as too large (%r): "
                               "--peer-item-max is larger than its memcached -I", name, e)
            raise ServerError(f"{name}: {e!r}") from e
        except Exception as e:  # noqa: BLE001 - the pool full, a bug: a miss, never a reader's error
            self._log_once(type(e).__name__, "peer %s: unexpected failure %r", name, e)
            raise ServerError(f"{name}: {e!r}") from e

    def _log_once(self, kind: str, msg: str, *args: object) -> None:
        # worker threads: a race logs twice at worst
        if kind not in self._logged:
            self._logged.add(kind)
            log.warning(msg, *args)

    def _drop_lease(self, name: str, ck: ContentKey) -> None:
        """Delete ``ck``'s lease, best effort: after a failure, so that the other nodes do
        not wait the whole --peer-lease for a value that will not come."""
        with contextlib.suppress(ServerDown, ServerError):
            self._call(name, "delete", ck.lease, noreply=False)

    def get_or_lease(self, name: str, ck: ContentKey, lease_s: int, take: bool
                     ) -> tuple[str, memoryview | Manifest | str | None]:
        """Look ``ck`` up on ``name`` (one thread hop, at most two round trips):
        ``("hit", bytes)`` (or ``("hit", Manifest)``: the file is stored in pieces),
        ``("bad", reason)`` for a value that must not be served,
        ``("lease", None)`` when this caller won the lease (it reads the source and stores
        the value), ``("wait", None)`` when another node holds it (``take``: try for the
        lease on a miss; else ``("miss", None)``)."""
        # the lease before the value (memcached reads a multi-get's keys in order): a
        # holder stores the value, then deletes its lease, so "no lease" read first and
        # "no value" read after mean no holder has finished yet
        got = self._call(name, "get_many", [ck.lease, ck.key])
        found = self._found(got.get(ck.key), ck)
        if found is not None or not take:
            return found or ("miss", None)
        if ck.lease in got:
            return "wait", None
        if not self._call(name, "add", ck.lease, b"1", expire=lease_s, noreply=False):
            return "wait", None
        # won: a holder that finished between the two calls stored the value already
        try:
            found = self._found(self._call(name, "get", ck.key), ck)
        except ServerError:  # (a server down: its leases go with it, no second timeout)
            self._drop_lease(name, ck)  # the caller will not know it held it
            raise
        if found is not None:
            self._drop_lease(name, ck)
            return found
        return "lease", None

    @staticmethod
    def _found(value: bytes | None, ck: ContentKey
               ) -> tuple[str, memoryview | Manifest | str] | None:
        if value is None:
            return None
        try:
            return "hit", decode_stored(value, ck)
        except BadValue as e:
            return "bad", e.reason

    def forget(self, name: str, ck: ContentKey) -> None:
        """Delete the value stored under ``ck`` on ``name`` (a manifest whose pieces are
        lost); its lease, if any, stays with its holder."""
        self._call(name, "delete", ck.key, noreply=False)

    def store(self, name: str, ck: ContentKey, data: bytes | memoryview | Manifest | None,
              lease: bool, expire: int = 0) -> bool:
        """Store ``data`` under ``ck`` on ``name`` (a :class:`Manifest`: the manifest of
        pieces stored already; None: store nothing), expiring after ``expire`` seconds
        (0: never), then drop the lease on it if this caller held it. True if a value was
        stored."""
        stored = False
        if data is not None:
            value = (encode_manifest(ck, data) if isinstance(data, Manifest)
                     else encode(ck, data))
            try:
                stored = bool(self._call(name, "set", ck.key, value,
                                         expire=expire, noreply=False))
            except ServerError:
                # refused (too large, out of memory): the lease still goes, else the other
                # nodes wait --peer-lease for this file. (A server down: its leases go with
                # it, and a delete would cost a second timeout.)
                if lease:
                    self._drop_lease(name, ck)
                raise
        if lease:
            self._call(name, "delete", ck.lease, noreply=False)
        return stored

    def set_piece(self, name: str, ck: ContentKey, m: Manifest, i: int,
                  data: bytes | memoryview, expire: int) -> bool:
        """Store piece ``i`` of ``data`` (the whole file) on ``name``; True if stored."""
        return bool(self._call(name, "set", piece_key(ck, m.piece_size, i),
                               encode_piece(ck, m, i, data), expire=expire, noreply=False))

    def get_piece(self, name: str, ck: ContentKey, m: Manifest, i: int
                  ) -> tuple[str, memoryview | str | None]:
        """Piece ``i`` of the file ``m`` describes, from ``name``: ``("hit", bytes)``,
        ``("miss", None)``, or ``("bad", reason)`` for one that must not be served."""
        value = self._call(name, "get", piece_key(ck, m.piece_size, i))
        if value is None:
            return "miss", None
        try:
            return "hit", decode_piece(value, ck, m, i)
        except BadValue as e:
            return "bad", e.reason

    def keep(self, name: str, ck: ContentKey, data: bytes | memoryview, expire: int
             ) -> str:
        """Make sure ``name`` holds ``ck`` (a record about to be evicted here): a ``touch``
        first (the value stays, its expiry becomes ``expire``), and only when it has no
        value an ``add`` of ``data`` (never replaces a value stored meanwhile). ``"held"``
        or ``"pushed"``."""
        if self._call(name, "touch", ck.key, expire=expire, noreply=False):
            return "held"
        if self._call(name, "add", ck.key, encode(ck, data), expire=expire, noreply=False):
            return "pushed"
        return "held"  # another node stored it between the two calls

    def touch(self, name: str, ck: ContentKey, expire: int) -> bool:
        """Whether ``name`` holds a value under ``ck``'s key (its expiry becomes
        ``expire``), without sending it: a ``touch``."""
        return bool(self._call(name, "touch", ck.key, expire=expire, noreply=False))

    def probe(self, name: str) -> None:
        """A round trip to ``name`` (raises :class:`ServerDown` if it does not answer)."""
        self._call(name, "version")

    def close(self) -> None:
        for c in self.clients.values():
            with contextlib.suppress(Exception):  # closing sockets of a dead server
                c.close()
