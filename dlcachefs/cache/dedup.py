"""Identical bytes cached once across the datasets of a shared root (``--shared-cache``).

DLCache (section III, dataset preparation) keys every file by a content hash, so a dataset
uploaded twice, or copied to another NFS path, is stored once. Here each dataset of a
shared root keeps its own cache (:mod:`dlcachefs.cache.shares`); this module lets one
dataset serve a file from the bytes another dataset of the root already holds, instead of
reading its own source and storing a second copy.

**The key** is the SHA-256 of the file's whole bytes. DLCache hashes the first MiB plus the
size, to keep its preparation from reading large files whole; two files equal there and
different later would then be served each other's bytes, and this cache never serves
bytes other than the source's. So a key is only ever the digest of the whole content:

* computed by the daemon that holds the bytes (the chunk writer hashes each record in its
  commit thread; :attr:`ChunkWriter.content_keys`) and stored with the record: index
  ``ckey`` (inode -> digest and the version it is of) and ``content`` (digest -> inode,
  the offer to the root's other datasets; :mod:`dlcachefs.store.schema`);
* for a file about to be fetched (:meth:`ContentStore.key_of`): the key this dataset
  learned for the entry's version before; else ``--content-manifest`` (sha256sum output,
  trusted for files whose mtime is not after the list's); else ``--content-xattr`` (an
  attribute the source keeps, e.g. an object store's checksum exposed by its mount);
* otherwise the file is read from the source and hashed (:meth:`after_fetch`): if another
  dataset holds those bytes, nothing is written here and the key is remembered, so the
  next open of the file borrows them. Only the space is saved then, not the read; a
  manifest or an attribute saves the read too.

**Borrowing** (:meth:`borrow`): each other dataset's index is opened read-only, as the
zero-copy reader opens one (:class:`~dlcachefs.store.readonly.IndexReader`, ``lock=True``);
``content[digest]`` gives an inode whose key must be that digest and whose record must have
the key's version (:meth:`IndexReader.by_content`); the record is read from that dataset's
log through a read-only descriptor (:class:`~dlcachefs.store.readonly.LogFiles`) and served
only if its xxh3 is the record's. An eviction in the other dataset at the same moment
(index entry gone, hole punched, log deleted) makes one of these checks fail, and the fetch
goes on to the peers and the source: never other bytes. Nothing here writes to another
dataset's cache, and nothing here holds a read transaction between calls.

**Budget**: a borrowed file is charged to the dataset whose record holds it, never to the
borrower: bytes held once are charged once. When the holder evicts them, the borrower's
next open reads its own source and caches them as its own (and offers them in turn).

**Other datasets' damage**: an LMDB file read while damaged can kill the reading process
(SIGBUS), so another dataset's index is opened only after the walk the daemon makes of
its own index after a crash (:func:`~dlcachefs.store.integrity.check_index`, in a child
process) found it sound, and any error reading it later is a miss. Damage done to it
after that, while it is open here, can still take this daemon down as damage to its own
index would (a known limit, as for the zero-copy reader).

**Trust**: a manifest's digest is used only for a file whose ctime (which, unlike the
mtime, cannot be set back) is before the list was written; an attribute's only when it
was read from the version listed (size, mtime, inode). Both are claims the source makes:
a list or an attribute that was wrong when written is served as written.

**Not shared**: a stream whose next epoch's log is laid out (LCache) copies the files it
borrowed into that log, and the packer packs borrowed files into its packages: those
are second copies (charged to this dataset, so the budget still holds).

**From the first read**: another dataset is read only once its index was walked (above),
and the walks of the first look at the root take a moment per dataset (a child process
each). :meth:`run` starts that look as the mount starts, and publishes each dataset as
soon as its walk passed. A fetch that could be served from another dataset (its digest
known without a read) while the first look is still going on waits for it
(:meth:`_wait_first_look`), dataset by dataset, so the first reads after a mount borrow
as later ones do; the wait ends at :data:`HOLD_S` after the look began. A file read from
the source meanwhile (its digest unknown before) is given to its reader at once: whether
it is cached here is decided in the background once the look got to the datasets
(:meth:`held_after_look`), so no second copy is made of bytes another dataset holds. Past
that bound (a root of many datasets, each walk slow), fetches no longer wait: they borrow
from the datasets checked so far and read the rest from their source, as before the look
ends; the look goes on in the background.

Concurrency: on the trio loop, but for the threads: index reads of other datasets, log
reads and hashing (:class:`IndexReader` opens a read transaction per call;
:class:`LogFiles` is thread-safe), and :meth:`refresh` (the root's dataset list and the
walks, every :data:`RESCAN_S` from :meth:`run`, one dataset per thread call, each
published when done). The ``_siblings`` dict is replaced, never mutated; a thread takes
a dataset for one lookup or read (``users``, under ``_lock``), and a dataset replaced or
gone is closed by whoever lets go of it last, never under a read. ``known`` and the
counters are touched on the loop only. Learned keys are written to this dataset's index
by :meth:`run`'s task, one write transaction every :data:`PERSIST_S`, and then dropped
from memory (``key_of`` reads the index).
"""

from __future__ import annotations

import binascii
import contextlib
import hashlib
import logging
import os
import stat
import threading
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

import lmdb
import trio

from dlcachefs.cache.namespace import identity
from dlcachefs.cache.source import Identity
from dlcachefs.config import DATASETS_DIR, Config
from dlcachefs.errors import DlcError, InvalidArgument
from dlcachefs.store.chunkfmt import checksum
from dlcachefs.store.index import Index
from dlcachefs.store.integrity import check_index, log_failure, note_error
from dlcachefs.store.readonly import IndexReader, LogFiles
from dlcachefs.store.schema import ContentKey, Entry

if TYPE_CHECKING:
    from dlcachefs.cache.fetch import SourceCalls

log = logging.getLogger(__name__)

#: how often the root's list of datasets is read again (a dataset mounted later is seen)
RESCAN_S = 5.0
#: how long after a mount starts a fetch may wait for the first look at the root's other
#: datasets (their index walks) before it reads its own source (module doc)
HOLD_S = 10.0
#: how often keys learned from reads are written to this dataset's index
PERSIST_S = 2.0
#: digests remembered as failed (see ``ContentStore._failed``)
FAILED_MAX = 10_000
#: the largest --content-manifest read (a sha256sum line is ~100 bytes a file: about 10
#: million files; a larger dataset keys its files by --content-xattr)
MANIFEST_MAX = 1 << 30


@dataclass(slots=True)
class _Sibling:
    """Another dataset of the root: its index, read-only, and its logs' descriptors."""

    name: str
    reader: IndexReader
    logs: LogFiles
    users: int = 0  # threads reading it now (ContentStore._lock)
    retired: bool = False  # replaced or gone: closed by its last user


def parse_manifest(text: bytes, base: bytes, root: bytes) -> dict[bytes, bytes]:
    """``sha256sum`` output -> {path relative to ``root``: digest}. Paths in the list are
    relative to ``base`` (the list's directory) or absolute; lines that are not
    ``<64 hex> <space><space or *><path>``, and paths outside ``root``, are skipped.
    sha256sum's escaped form (a line starting with a backslash) is not supported."""
    out: dict[bytes, bytes] = {}
    root = os.path.normpath(root)
    for line in text.split(b"\n"):
        line = line.rstrip(b"\r")
        if len(line) < 67 or line[64:65] != b" " or line[65:66] not in (b" ", b"*"):
            continue
        try:
            digest = binascii.unhexlify(line[:64])
        except (binascii.Error, ValueError):
            continue
        path = os.path.normpath(os.path.join(base, line[66:]))
        rel = os.path.relpath(path, root)
        if rel == b"." or rel.startswith(b"../") or rel == b"..":
            continue
        out[rel] = digest
    return out


def parse_key(value: bytes) -> bytes | None:
    """An attribute's value as a digest: 32 raw bytes, or 64 hex digits (optionally
    ``sha256:``-prefixed, surrounding whitespace ignored); None otherwise."""
    if len(value) == 32:
        return bytes(value)
    v = value.strip().removeprefix(b"sha256:")
    if len(v) == 64:
        with contextlib.suppress(binascii.Error, ValueError):
            return binascii.unhexlify(v)
    return None


class ContentStore:
    """This dataset's side of content dedup in a shared root (see the module doc)."""

    def __init__(self, cfg: Config, index: Index, calls: SourceCalls) -> None:
        self.root = os.path.join(cfg.cache_dir, DATASETS_DIR)
        self.own = cfg.dataset_id
        self.index = index
        self.calls = calls
        self.source_root = os.fsencode(os.path.realpath(cfg.source))
        self.xattr = cfg.content_xattr
        self.manifest_path = cfg.content_manifest
        self.manifest: dict[bytes, bytes] = {}
        #: files whose ctime is before this are trusted to have the list's digest
        self.manifest_trust_ns = 0
        #: keys learned for inodes without a record here (their bytes are a sibling's)
        self.known: dict[int, ContentKey] = {}
        self._learned: dict[int, ContentKey] = {}  # not yet in the index
        self._siblings: dict[str, _Sibling] = {}
        # a dataset replaced or gone is closed by its last user (a thread may read it now)
        self._lock = threading.Lock()  # the siblings' users and retired flags
        #: datasets whose index failed the walk, by the stamp of the file walked
        self._bad: dict[str, tuple[int, int, int]] = {}
        #: digests whose copy elsewhere failed its check lately: a file read from the
        #: source for one of them is cached here (the other dataset re-fetches its own
        #: when it reads it); bounded, forgotten when full
        self._failed: set[bytes] = set()
        self.counts: Counter[str] = Counter()
        #: the first look at the root's datasets is done (every walk passed or failed)
        self._looked = False
        #: set, and replaced, each time a dataset is published during a look (waiters
        #: try the new one)
        self._published = trio.Event()
        #: fetches wait for the first look until then (trio clock; set by :meth:`run`)
        self._hold_until = float("-inf")
        #: seconds the first look took (None: not done yet)
        self.first_look_s: float | None = None

    # ----- start and background ------------------------------------------------------

    def load_manifest(self) -> None:
        """Blocking (at start): read ``--content-manifest``. A list that cannot be read
        fails the mount (:class:`InvalidArgument`, with the reason)."""
        if not self.manifest_path:
            return
        path = os.fsencode(self.manifest_path)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                if not stat.S_ISREG(st.st_mode):
                    raise InvalidArgument(f"--content-manifest {self.manifest_path}: not a "
                                          "regular file")
                if st.st_size > MANIFEST_MAX:
                    raise InvalidArgument(f"--content-manifest {self.manifest_path}: larger "
                                          f"than {MANIFEST_MAX >> 20} MiB")
                # bounded: /dev/zero or a runaway file must not take the machine's memory
                text = f.read(MANIFEST_MAX + 1)
        except OSError as e:
            raise InvalidArgument(f"--content-manifest {self.manifest_path}: "
                                  f"{e.strerror}") from None
        if len(text) > MANIFEST_MAX:
            raise InvalidArgument(f"--content-manifest {self.manifest_path}: larger than "
                                  f"{MANIFEST_MAX >> 20} MiB")
        self.manifest = parse_manifest(text, os.path.dirname(os.path.realpath(path)),
                                       self.source_root)
        # a file's ctime cannot be set back (its mtime can: rsync -a, cp -p, tar x): a file
        # is trusted only if nothing about it changed since before the list was written
        # (the earlier of the list's mtime and ctime: a list copied with its old mtime
        # describes the files as they were then)
        self.manifest_trust_ns = min(st.st_mtime_ns, st.st_ctime_ns)
        log.info("content manifest %s: %d files", self.manifest_path, len(self.manifest))

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Write learned keys to the index every :data:`PERSIST_S` (and read the root's
        dataset list when due), until cancelled; the last batch at the end."""
        t0 = trio.current_time()
        self._hold_until = t0 + HOLD_S
        task_status.started()  # the mount does not wait for the look: fetches do
        last_scan = float("-inf")
        try:
            while True:
                if trio.current_time() - last_scan >= RESCAN_S:
                    last_scan = trio.current_time()
                    try:
                        await self.refresh()
                    finally:
                        if not self._looked:
                            self._looked = True
                            self.first_look_s = round(trio.current_time() - t0, 3)
                            self._wake()
                await trio.sleep(PERSIST_S)
                await self.persist()
        finally:
            with trio.CancelScope(shield=True):
                await self.persist()
                await trio.to_thread.run_sync(self._close_all)

    async def persist(self) -> None:
        """Write the keys learned so far (one transaction, in a thread)."""
        if not self._learned:
            return
        batch, self._learned = self._learned, {}
        try:
            await trio.to_thread.run_sync(self._persist, batch)
        except lmdb.Error as e:  # a full or damaged index: keys are only an optimisation
            note_error(e)
            log.warning("content keys not saved (%s)", e)
            return
        # in the index now (key_of reads them there): memory holds only what is not yet,
        # so it stays bounded by what is learned in PERSIST_S
        for ino, k in batch.items():
            if self.known.get(ino) == k and ino not in self._learned:
                del self.known[ino]

    def _persist(self, batch: dict[int, ContentKey]) -> None:
        with self.index.write() as w:
            for ino, k in batch.items():
                e = w.get_entry(ino)
                if e is not None and k.same_version(e):
                    w.put_key(ino, k)

    # ----- the read path (trio loop) -------------------------------------------------

    async def key_of(self, e: Entry, rel: bytes) -> bytes | None:
        """The digest of ``e``'s current version when it is known without reading it."""
        k = self.known.get(e.ino)
        if k is None:
            k = self.index.get_key(e.ino)
        if k is not None and k.same_version(e):
            self.counts["key_learned"] += 1
            return k.sha256
        sha = self.manifest.get(rel)
        if sha is not None and e.ctime_ns < self.manifest_trust_ns:
            self.counts["key_manifest"] += 1
            return sha
        if self.xattr:
            try:
                got = await self.calls.call(_get_xattr, self.calls.source, rel, self.xattr,
                                            self.calls.use_src_ino)
            except DlcError:
                got = None
            # the attribute of the version listed, not of one that replaced it since
            if got is not None and got[1] == identity(e):
                sha = parse_key(got[0]) if got[0] is not None else None
                if sha is not None:
                    self.counts["key_xattr"] += 1
                    return sha
        return None

    async def borrow(self, e: Entry, rel: bytes) -> bytes | None:
        """``e``'s bytes from another dataset of the root, checked; None when its key is
        not known without a read, or no other dataset holds them intact."""
        if self._looked and not self._siblings:  # none: the source
            return None
        sha = await self.key_of(e, rel)
        if sha is None:
            return None
        tried: set[str] = set()
        failed = errors = 0
        while True:
            todo = {n: s for n, s in self._siblings.items() if n not in tried}
            tried.update(todo)
            got = None
            if todo:
                got, f, err = await trio.to_thread.run_sync(
                    self._read_from_siblings, todo, sha, e.size)
                failed, errors = failed + f, errors + err
            if got is not None or not await self._wait_first_look(tried):
                break
        self.counts["mismatches"] += failed
        self.counts["errors"] += errors
        if got is None:
            if failed:  # held, but no copy passed its check: cache this one here
                if len(self._failed) >= FAILED_MAX:
                    self._failed.clear()
                self._failed.add(sha)
            else:
                self.counts["key_not_held"] += 1
            return None
        self.counts["borrowed_files"] += 1
        self.counts["borrowed_bytes"] += len(got)
        self._learn(e.ino, identity(e), sha)
        return got

    async def after_fetch(self, e: Entry, ident: Identity, data: bytes, wait: bool = True
                          ) -> tuple[bytes | None, bool]:
        """A file just read from the source (``ident``: the version read): its digest
        (None: let the writer hash it) and whether another dataset holds the same bytes
        (then it is not cached here; its key is remembered for the next open). ``wait``:
        while the first look at the root is under way, wait for it (bounded, as
        :meth:`borrow` does); else only the datasets looked at so far are asked, and a
        caller that gets False while :meth:`looking` asks :meth:`held_after_look` later."""
        if self._looked and not self._siblings:
            return None, False
        tried = set(self._siblings)
        sha, holder = await trio.to_thread.run_sync(self._hash_and_find, self._siblings, data)
        if holder is None and wait:
            holder = await self._find_during_look(sha, len(data), tried)
        if holder is None:
            return sha, False
        self.counts["held_elsewhere"] += 1
        self._learn(e.ino, ident, sha)
        return sha, True

    def looking(self) -> bool:
        """Whether the first look at the root is under way (and fetches may wait for it)."""
        return not self._looked and trio.current_time() < self._hold_until

    async def held_after_look(self, ino: int, ident: Identity, sha: bytes, size: int) -> bool:
        """In the background, for bytes read from the source while the first look was
        under way (:meth:`after_fetch` with ``wait=False``): whether another dataset
        holds them once the look got to it (then the caller does not cache them; the key
        is remembered)."""
        if await self._find_during_look(sha, size, set(), count=False) is None:
            return False
        self.counts["held_elsewhere"] += 1
        self._learn(ino, ident, sha)
        return True

    async def _find_during_look(self, sha: bytes, size: int, tried: set[str],
                                count: bool = True) -> str | None:
        """A dataset, not in ``tried``, that holds ``sha``, waiting for the first look's
        datasets as they are published (:meth:`_wait_first_look`); None when none does."""
        while sha not in self._failed and await self._wait_first_look(tried, count):
            todo = {n: s for n, s in self._siblings.items() if n not in tried}
            tried.update(todo)
            holder = await trio.to_thread.run_sync(self._held_by, todo, sha, size)
            if holder is not None:
                return holder
        return None

    async def _wait_first_look(self, tried: set[str], count: bool = True) -> bool:
        """While the first look at the root is going on (and :data:`HOLD_S` has not
        passed since it began): wait until a dataset not in ``tried`` is published, or the
        look ends; True when there may be more to try. False at once after the look.
        ``count``: a wait is counted as a read held (``held``)."""
        held = not count
        while not self._looked and trio.current_time() < self._hold_until:
            if any(n not in tried for n in self._siblings):
                return True
            if not held:
                held = True
                self.counts["held"] += 1
            with trio.move_on_at(self._hold_until):
                await self._published.wait()
        return any(n not in tried for n in self._siblings)

    def _wake(self) -> None:
        """Loop: tell the fetches waiting for the first look that something changed."""
        self._published.set()
        self._published = trio.Event()

    def _learn(self, ino: int, v: Identity, sha: bytes) -> None:
        k = ContentKey(sha, v.size, v.mtime_ns, v.src_ino)
        if self.known.get(ino) != k:
            self.known[ino] = k
            self._learned[ino] = k

    # ----- other datasets (threads) --------------------------------------------------

    async def refresh(self) -> None:
        """Read the root's dataset list again (:meth:`run` does, every :data:`RESCAN_S`):
        new datasets are opened once their index passed the walk (one thread call each,
        published as soon as it is open: fetches waiting for the first look try it at
        once), replaced or removed ones retired. A failure is logged; the datasets not
        looked at yet stay as they were."""
        old = self._siblings
        new: dict[str, _Sibling] = {}
        done = False
        try:
            names = await trio.to_thread.run_sync(self._names)
            for k, name in enumerate(names):
                s = await trio.to_thread.run_sync(self._take, name, old.get(name))
                if s is not None:
                    new[name] = s
                if s is not None and s is not old.get(name):
                    # published at once: the ones not looked at yet as they were
                    later = set(names[k + 1:])
                    self._siblings = {**{n: x for n, x in old.items() if n in later}, **new}
                    self._wake()
            done = True
        except Exception:  # noqa: BLE001 - dedup is an optimisation: never the mount's end
            log_failure(log, "reading the shared root's datasets failed")
        finally:
            if done:
                self._siblings = new
            # what is no longer published is retired (on a failure or a cancel too)
            published = {id(x) for x in self._siblings.values()}
            for s in old.values():
                if id(s) not in published:
                    self._retire(s)

    def _names(self) -> list[str]:
        """Thread: the root's other datasets."""
        try:
            return sorted(n for n in os.listdir(self.root) if n != self.own)
        except OSError:
            return []

    def _take(self, name: str, s: _Sibling | None) -> _Sibling | None:
        """Thread: dataset ``name`` to read from now (``s``: as the last look opened it;
        reopened when its index was replaced), or None."""
        try:
            if s is not None and s.reader.replaced():
                s = None  # the old one is retired by refresh
            if s is None:
                s = self._open(name)
            if s is not None:
                s.reader.open_content()
                s.logs.sweep()  # descriptors of logs deleted since go
            return s
        except Exception as e:  # noqa: BLE001 - a dataset removed or damaged meanwhile
            log.info("dataset %s of the shared root: not read (%s)", name, e)
            return None

    def _open(self, name: str) -> _Sibling | None:
        """Thread: another dataset's index, read-only, once the same walk the daemon
        makes of its own index after a crash found it sound
        (:func:`dlcachefs.store.integrity.check_index`, in a child process, read-only:
        nothing of the other dataset changes): reading a damaged LMDB file can kill the
        reading process (SIGBUS), and this daemon must not die of another's damage. An
        index that failed the walk, or could not be walked, is walked again only once
        its file changed."""
        d = os.path.join(self.root, name)
        ix = os.path.join(d, "meta.lmdb")
        try:
            st = os.stat(os.path.join(ix, "data.mdb"))
        except OSError:
            return None
        stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
        if self._bad.get(name) == stamp:
            return None
        why = check_index(ix, other=True)
        if why is not None:
            self._bad[name] = stamp
            log.warning("dataset %s of the shared root: its index is damaged or could "
                        "not be checked (%s); not borrowed from", name, why)
            return None
        self._bad.pop(name, None)
        reader = IndexReader(ix)
        return _Sibling(name, reader, LogFiles(os.path.join(d, "logs")))

    # a sibling in use by a thread is closed by its last user (never under a read)

    def _use(self, s: _Sibling) -> bool:
        with self._lock:
            if s.retired:
                return False
            s.users += 1
            return True

    def _done(self, s: _Sibling) -> None:
        with self._lock:
            s.users -= 1
            close = s.retired and s.users == 0
        if close:
            self._close(s)

    def _retire(self, s: _Sibling) -> None:
        with self._lock:
            if s.retired:
                return
            s.retired = True
            close = s.users == 0
        if close:
            self._close(s)

    @staticmethod
    def _close(s: _Sibling) -> None:
        s.logs.sweep(everything=True)
        with contextlib.suppress(lmdb.Error):
            s.reader.close()

    def _close_all(self) -> None:
        siblings, self._siblings = self._siblings, {}
        for s in siblings.values():
            self._retire(s)

    def _hash_and_find(self, siblings: dict[str, _Sibling], data: bytes
                       ) -> tuple[bytes, str | None]:
        """The digest of ``data`` and a dataset that holds the same bytes (or None)."""
        sha = hashlib.sha256(data).digest()
        if sha in self._failed:
            return sha, None
        return sha, self._held_by(siblings, sha, len(data))

    def _held_by(self, siblings: dict[str, _Sibling], sha: bytes, size: int) -> str | None:
        for s in siblings.values():
            if not self._use(s):
                continue
            try:
                loc = s.reader.by_content(sha)
            except Exception:  # noqa: BLE001 - a value of a damaged index: a miss
                continue
            finally:
                self._done(s)
            if loc is not None and loc.size == size:
                return s.name
        return None

    def _read_from_siblings(self, siblings: dict[str, _Sibling], sha: bytes, size: int
                            ) -> tuple[bytes | None, int, int]:
        """The bytes from the first dataset that holds them intact (or None), how many
        copies failed their check, how many indexes could not be read."""
        failed = errors = 0
        for s in siblings.values():
            if not self._use(s):
                continue
            try:
                try:
                    loc = s.reader.by_content(sha)
                except Exception:  # noqa: BLE001 - a value of a damaged index: a miss
                    errors += 1
                    continue
                if loc is None or loc.size != size:
                    continue
                try:
                    data = s.logs.pread(loc.log_id, loc.size, loc.offset)
                except OSError:  # the log was deleted (evicted) meanwhile
                    failed += 1
                    continue
            finally:
                self._done(s)
            if len(data) != loc.size or checksum(data) != loc.data_xxh:
                failed += 1  # evicted under us (a punched hole), or damaged
                continue
            return data, failed, errors
        return None, failed, errors

    def stats(self) -> dict:
        """The ``dedup`` section of ``.dlcache/stats``."""
        return {"siblings": sorted(self._siblings), "not_read": sorted(self._bad),
                "first_look_s": self.first_look_s,
                "manifest_files": len(self.manifest),
                "xattr": self.xattr, "known_keys": len(self.known),
                **{k: self.counts[k] for k in (
                    "borrowed_files", "borrowed_bytes", "held_elsewhere", "key_learned",
                    "key_manifest", "key_xattr", "key_not_held", "mismatches", "errors",
                    "held")}}


def _get_xattr(source: object, rel: bytes, name: str, use_src_ino: bool
               ) -> tuple[bytes | None, Identity] | None:
    """Blocking: attribute ``name`` of the source file ``rel`` and the identity of the
    file it was read from (None: a source that has no attributes; see
    :meth:`LocalSource.get_xattr`)."""
    get = getattr(source, "get_xattr", None)
    return None if get is None else get(rel, name, use_src_ino)
