"""Reading from the source: the one wrapper every source call goes through.

:class:`SourceCalls` runs a blocking call on the source (a whole-file read, an ``lstat``,
a listing, a ranged read, ``statvfs``) the same way for every caller (the read path, the
namespace's revalidation, the packer, scan-ahead, the reorderer's fills, the FUSE
layer's ``statfs``):

* in a worker thread under the source limiter (``--source-threads``);
* given up after ``--source-timeout`` (:class:`~dlcachefs.errors.SourceTimeout`); the
  stuck thread is abandoned and the call is not retried (a hung source must not pile up
  more stuck threads);
* retried on transient errors (:data:`TRANSIENT`), at most ``--source-retries`` times,
  0.1 s, 0.4 s, 1.6 s ... apart;
* counted: ``source_errors``, ``source_retries``, ``source_timeouts``; every attempt's
  time goes to a latency histogram per kind of call (``latency``, by the function's name).

:class:`~dlcachefs.errors.NotFound` and :class:`~dlcachefs.errors.SourceChanged` are
answers, not failures: raised at once, neither retried nor counted.

Concurrency: called on the trio loop; the source call itself runs in a worker thread.
The counters are touched on the loop only.
"""

from __future__ import annotations

import contextlib
import errno
import logging
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Protocol, TypeVar

import trio

from dlcachefs.cache.latency import Latencies
from dlcachefs.cache.namespace import identity
from dlcachefs.cache.source import Identity, Source
from dlcachefs.cache.stats import Counters
from dlcachefs.cache.tasks import TaskOwner
from dlcachefs.config import Config
from dlcachefs.errors import NotFound, SourceChanged, SourceError, SourceTimeout
from dlcachefs.store.integrity import log_failure
from dlcachefs.store.schema import Entry

if TYPE_CHECKING:
    from dlcachefs.cache.buffers import Backlog
    from dlcachefs.cache.dedup import ContentStore
    from dlcachefs.cache.namespace import Namespace
    from dlcachefs.cache.policy import CachingPolicy
    from dlcachefs.cache.versions import Versions
    from dlcachefs.cache.writer import ChunkWriter

log = logging.getLogger(__name__)

T = TypeVar("T")

#: errno values of the source worth another try
TRANSIENT = frozenset({errno.EIO, errno.EAGAIN, errno.EINTR, errno.ETIMEDOUT, errno.ECONNRESET,
                       errno.ENOTCONN, errno.EHOSTUNREACH, errno.ENETUNREACH})


class SourceCalls:
    """The source, called under the rules of the module docstring."""

    def __init__(self, source: Source, cfg: Config, counters: Counters) -> None:
        self.source = source
        self.timeout = cfg.source_timeout
        self.retries = cfg.source_retries
        self.use_src_ino = cfg.use_source_inode
        self.counters = counters
        self.limiter = trio.CapacityLimiter(cfg.source_threads)
        self.latency = Latencies()  # per attempt, by fn.__name__ (stats: source_latency)

    async def call(self, fn: Callable[..., T], *args: object,
                   slot: SourceSlot | None = None) -> T:
        """``fn(*args)`` (blocking, on the source) in a thread: timeout, retries, counters.
        ``slot``: a token of :attr:`limiter` the caller holds already; the first attempt
        runs on it (and its thread gives it back), a retry queues again."""
        delay = 0.1
        op = getattr(fn, "__name__", "call")
        for attempt in range(self.retries + 1):
            t0 = trio.current_time()
            paid = slot.hand_over() if slot is not None else None
            try:
                with trio.fail_after(self.timeout):
                    return await trio.to_thread.run_sync(
                        fn, *args, limiter=paid or self.limiter, abandon_on_cancel=True)
            except trio.TooSlowError:
                # a hung source: do not pile up more stuck threads by retrying
                self.counters.source_timeouts += 1
                raise SourceTimeout(
                    f"source did not answer within {self.timeout:.0f} s",
                    errno.ETIMEDOUT) from None
            except (NotFound, SourceChanged):
                raise
            except SourceError as exc:
                self.counters.source_errors += 1
                if exc.errno not in TRANSIENT or attempt == self.retries:
                    raise
                self.counters.source_retries += 1
            finally:
                if paid is not None and not paid.used:  # no thread started: give it back
                    paid.release_on_behalf_of(None)
                # the attempt, the wait for a thread of the limiter included (what the
                # caller waited), not the pause before a retry
                self.latency.observe(op, trio.current_time() - t0)
            await trio.sleep(delay)
            delay *= 4
        raise AssertionError("unreachable")

    async def read_file(self, rel: bytes, slot: SourceSlot | None = None
                        ) -> tuple[bytes, Identity]:
        """A whole file as one consistent version, and that version's identity."""
        return await self.call(self.source.read_file, rel, self.use_src_ino, slot=slot)


class Prepaid:
    """A limiter for ``trio.to_thread.run_sync`` whose token was taken beforehand:
    acquiring is free, the thread's end gives the token back to the real limiter.
    ``used``: a thread was started on it (then the thread releases it)."""

    def __init__(self, limiter: trio.CapacityLimiter, borrower: object) -> None:
        self.limiter, self.borrower, self.used = limiter, borrower, False

    async def acquire_on_behalf_of(self, _placeholder: object) -> None:
        self.used = True

    def release_on_behalf_of(self, _placeholder: object) -> None:
        self.limiter.release_on_behalf_of(self.borrower)


class SourceSlot:
    """One token of the source limiter (``--source-threads``) held by a fetch before it
    reads: :meth:`Fetcher.read_whole` takes it before the peer tier's lease, so a node
    leases only what it can read at once (a lease must not wait in this node's queue
    while the other nodes wait for its value). Trio loop."""

    def __init__(self, limiter: trio.CapacityLimiter) -> None:
        self.limiter = limiter
        self._borrower: object | None = None

    async def take(self) -> None:
        if self._borrower is None:
            b = object()
            await self.limiter.acquire_on_behalf_of(b)
            self._borrower = b

    def drop(self) -> None:
        """Give the token back (idempotent)."""
        if self._borrower is not None:
            self.limiter.release_on_behalf_of(self._borrower)
            self._borrower = None

    def hand_over(self) -> Prepaid | None:
        """The held token as a limiter for one thread (None: none held)."""
        if self._borrower is None:
            return None
        b, self._borrower = self._borrower, None
        return Prepaid(self.limiter, b)


class PeerLookup(Protocol):
    """What a peer-tier lookup found: the file's bytes (a hit), or None."""

    data: bytes | None


class PeerReads(Protocol):
    """What the fetcher uses of the cluster's shared tier (``--peers``:
    :class:`dlcachefs.peers.tier.PeerTier`, built by the composition root only then)."""

    def fits(self, rel: bytes, ident: Identity) -> bool:
        """Whether this version of ``rel`` may be held by the tier (its size)."""

    def lookup(self, rel: bytes, ident: Identity,
               before_lease: Callable[[], Awaitable[None]] | None = None,
               on_wait: Callable[[], None] | None = None) -> Awaitable[PeerLookup]:
        """The bytes from the owner, or a lease to read the source (never raises)."""

    def release(self, got: PeerLookup | None) -> None:
        """Give up ``got``'s lease (no value will be stored)."""

    def store_later(self, rel: bytes, ident: Identity, data: bytes | memoryview,
                    got: PeerLookup | None = None, ino: int = 0) -> None:
        """Store this version at its owner in the background (and release the lease)."""


class _Inflight:
    """One fetch in progress; later opens of the same file wait for it."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.result: tuple[bytes, Entry] | None = None
        self.error: BaseException | None = None
        self.waiters = 0  # opens waiting for it (a held fetch reads its bytes back for them)


class Fetcher(TaskOwner):
    """Whole files from the source: to the reader, and on to the cache.

    * concurrent fetches of one file share one source read (:meth:`fetch`);
    * a file that changed since it was listed is served in its new version, recorded in
      the namespace, and the kernel is told (its pages of the old version go);
    * the bytes go to the chunk writer when the policy admits them; when the writer has
      no room, the reader does not wait for the cache disk: the file waits in the
      :class:`~dlcachefs.cache.buffers.Backlog` (a task of this object's nursery hands it
      over once there is room), and only past the backlog's bound does the reader wait
      (backpressure: memory stays bounded and nothing is left uncached);
    * whole files are read through :meth:`read_whole`: the peer tier (``--peers``) first,
      then the source; with ``--shared-cache`` dedup, a file whose bytes another dataset
      of the root holds is read from there before either, and not cached twice
      (:mod:`dlcachefs.cache.dedup`);
    * ``demand_fetches`` counts readers waiting for the source right now (scan-ahead
      then leaves them the link); ``demand_idle`` is set when it drops to 0.

    Concurrency: trio loop; source reads through :class:`SourceCalls`. The backlog's
    hand-over tasks belong to :meth:`run`'s nursery.
    """

    def __init__(self, cfg: Config, calls: SourceCalls, ns: Namespace, writer: ChunkWriter,
                 policy: CachingPolicy, versions: Versions, backlog: Backlog,
                 counters: Counters, peers: PeerReads | None = None,
                 dedup: ContentStore | None = None) -> None:
        self.cfg = cfg
        self.calls = calls
        self.peers = peers  # the cluster's shared tier (--peers), looked up before the source
        #: the root's other datasets (--shared-cache dedup), looked up before the peers
        self.dedup = dedup
        self.ns = ns
        self.writer = writer
        self.policy = policy
        self.versions = versions
        self.backlog = backlog
        self.counters = counters
        self._inflight: dict[int, _Inflight] = {}
        self.demand_fetches = 0
        self.demand_idle = trio.Event()  # set (and replaced) when demand_fetches drops to 0
        super().__init__()  # run() holds the backlog's hand-over tasks

    def in_flight(self, ino: int) -> bool:
        """Whether a fetch of ``ino`` is in progress."""
        return ino in self._inflight

    @contextlib.contextmanager
    def hold(self, ino: int) -> Iterator[_Inflight]:
        """Mark ``ino`` as being fetched elsewhere (a fetch worker, ``--fetch-workers``)
        for the ``with`` body: prefetch and scan-ahead leave it, an open waits for it and
        takes the ``result`` the holder sets (else fetches it itself)."""
        assert ino not in self._inflight
        inf = self._inflight[ino] = _Inflight()
        try:
            yield inf
        finally:
            del self._inflight[ino]
            inf.done.set()

    async def fetch_for_reader(self, e: Entry, cache: bool = True) -> tuple[bytes, Entry]:
        """A reader's miss: :meth:`fetch` (the bytes and the entry of their version),
        counted as a miss and as demand on the link. A fetch already in flight (a
        prefetch) is joined, and its bytes are cached."""
        waits = e.ino in self._inflight
        self.demand_fetches += 1
        try:
            data, got = await self.fetch(e, cache or waits)
        finally:
            self.demand_fetches -= 1
            if not self.demand_fetches:
                self.demand_idle.set()
                self.demand_idle = trio.Event()
        self.counters.misses += 1
        self.counters.fetch_waits += waits
        return data, got

    async def fetch(self, e: Entry, cache: bool = True) -> tuple[bytes, Entry]:
        """Fetch a whole file from the source (concurrent fetches of one file share it);
        its bytes and its entry (updated if the file changed since it was listed)."""
        while (inf := self._inflight.get(e.ino)) is not None:
            inf.waiters += 1
            await inf.done.wait()
            if inf.result is not None:
                return inf.result
            if isinstance(inf.error, Exception):
                raise inf.error
            # the fetching task was cancelled, not this one: never re-raise its Cancelled
        inf = self._inflight[e.ino] = _Inflight()
        try:
            inf.result = await self._fetch_now(e, cache)
            return inf.result
        except BaseException as exc:
            inf.error = exc
            raise
        finally:
            del self._inflight[e.ino]
            inf.done.set()

    async def read_whole(self, e: Entry, rel: bytes) -> tuple[bytes, Identity]:
        """One version of the whole file ``e`` (at ``rel``) and its identity, from the
        peer tier when there is one and it holds the entry's version
        (:mod:`dlcachefs.peers.tier`), else from the source; what comes from the source
        is stored in the tier in the background. Counted in ``bytes_from_peers`` or
        ``bytes_from_source``. The one place whole files are read (fetches, the packer)."""
        peers = self.peers
        want = identity(e)
        if peers is None or not peers.fits(rel, want):
            data, ident = await self.calls.read_file(rel)
            self.counters.bytes_from_source += len(data)
            return data, ident
        # a source slot before the lease (not before a plain lookup: a hit needs none):
        # a lease waiting in this node's queue for --source-threads would make the other
        # nodes wait for it; a lookup that waits for another node's lease gives it back
        slot = SourceSlot(self.calls.limiter)
        try:
            got = await peers.lookup(rel, want, before_lease=slot.take, on_wait=slot.drop)
            if got.data is not None:
                self.counters.bytes_from_peers += len(got.data)
                return got.data, want
            try:
                data, ident = await self.calls.read_file(rel, slot)
            except BaseException:
                peers.release(got)  # the others stop waiting for a value that will not come
                raise
        finally:
            slot.drop()
        self.counters.bytes_from_source += len(data)
        peers.store_later(rel, ident, data, got, ino=e.ino)
        return data, ident

    async def _fetch_now(self, e: Entry, cache: bool = True) -> tuple[bytes, Entry]:
        rel = self.ns.path_of(e)
        dedup = self.dedup
        if dedup is not None:
            data = await dedup.borrow(e, rel)
            if data is not None:  # another dataset's copy: charged there, not cached here
                self.counters.bytes_from_datasets += len(data)
                return data, e
        data, ident = await self.read_whole(e, rel)
        if ident != identity(e):
            # changed since it was listed: serve the new version, and tell the kernel
            e = await self.ns.note_identity(e, ident)
        if not cache:
            return data, e
        sha = None
        gate = None
        if dedup is not None:
            # the reader is not held for the first look at the root (its bytes are here):
            # with the look under way, whether they are cached is decided after it
            sha, elsewhere = await dedup.after_fetch(e, ident, data, wait=False)
            if elsewhere:
                return data, e  # the same bytes are another dataset's: not a second copy
            if sha is not None and dedup.looking():
                gate = dedup
        if not self.policy.admit(e.ino, len(data)):
            self.counters.not_admitted += 1
            return data, e
        if gate is not None:
            if self._submit_later(e.ino, rel, ident, data, sha, gate):
                return data, e
            # the backlog is full: the reader waits for the look instead
            if await gate.held_after_look(e.ino, ident, sha, len(data)):
                self.policy.on_dropped(e.ino)
                return data, e
        if not self.writer.has_room(len(data)):
            # the reader has its bytes and does not wait for the cache disk (an fdatasync
            # under load takes 100s of ms): the file waits for the writer's room in the
            # background, up to the backlog's bound; past that the reader waits
            # (backpressure: memory stays bounded and nothing is left uncached)
            if self._submit_later(e.ino, rel, ident, data, sha):
                return data, e
            await self.writer.wait_room(len(data))
        if not self.writer.submit(e.ino, rel, ident, data, sha):
            self.policy.on_dropped(e.ino)
        return data, e

    def _submit_later(self, ino: int, rel: bytes, ident: Identity, data: bytes,
                      sha: bytes | None = None, gate: ContentStore | None = None) -> bool:
        """Queue the file for the writer in the background; False when the backlog's
        bound is reached. ``gate``: not cached if another dataset of the root holds the
        bytes once dedup's first look got to it (:meth:`ContentStore.held_after_look`)."""
        if not self.running or not self.backlog.try_hold(ino, ident, data):
            return False
        return self.spawn(self._submit_when_room, ino, rel, ident, data, sha, gate)

    async def _submit_when_room(self, ino: int, rel: bytes, ident: Identity,
                                data: bytes, sha: bytes | None = None,
                                gate: ContentStore | None = None) -> None:
        try:
            if gate is not None and sha is not None and \
                    await gate.held_after_look(ino, ident, sha, len(data)):
                self.policy.on_dropped(ino)  # another dataset's bytes: not a second copy
                return
            await self.writer.wait_room(len(data))
            if self.versions.in_writer(ino, ident):
                pass  # this version is already on its way
            elif not self.versions.is_listed(ino, ident) or ino in self.writer.pending:
                self.policy.on_dropped(ino)  # a newer version came meanwhile: not this one
            elif not self.writer.submit(ino, rel, ident, data, sha):
                self.policy.on_dropped(ino)
        except Exception:  # noqa: BLE001 - a policy's failure must not end the mount
            log_failure(log, "caching a fetched file failed")
        finally:
            self.backlog.release(ino, len(data))
