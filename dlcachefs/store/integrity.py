"""Is the LMDB index safe to open? A structural check run in a child process, and the
quarantine of an index that fails it.

LMDB has no page checksums and trusts its file: a truncated ``data.mdb`` kills the
process that maps it with SIGBUS, zeroed or flipped page headers abort it
(``mdb_assert``, SIGABRT) or make it raise ``MDB_CORRUPTED``, and a damaged value makes
the schema's ``unpack`` fail. Python cannot catch a signal raised inside LMDB's C code,
so the daemon and ``dlcachefs verify`` first walk the whole index in a child process
(:func:`check_index`): every sub-database with a cursor (every B-tree page is touched),
every key and value checked against the lengths :mod:`dlcachefs.store.schema` gives
them. A child that dies, raises or finds a bad length means the index is damaged; the
caller then moves it aside (:func:`quarantine`) and starts from an empty one: the cache
is only a cache, and the daemon's recovery deletes the logs nothing indexes any more.

The walk reads every page once (a cache of a million files: 250 MB, one to a few
seconds depending on the page cache; the daemon's log line says how long it took). A
clean stop walks the index too (:func:`check_at_stop`), after its final commit, and only
when that walk passes marks it clean (:func:`mark_clean`: size, mtime and inode of
``data.mdb``; removed at start, so a crash leaves none); a start then skips its walk when
the file is exactly as marked. Whatever wrote to the file since, a crash, a damaging
process, ``verify --repair``, makes the next start walk it; damage written under the map
while the daemon ran is found by the walk at its stop. Damage that changes neither size
nor mtime while no daemon runs (a disk flipping bits under the filesystem) is found by
recovery's checks (``--debug-invariants``) or ``dlcachefs verify``, which always walks;
while mapped, LMDB is trusted (see docs/faults.md).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import stat
import struct
import subprocess
import sys
import threading
import time

from dlcachefs.store import schema as S

log = logging.getLogger(__name__)

#: the directory a damaged index is moved to (the latest one only is kept)
DAMAGED_SUFFIX = ".damaged"

_ENTRY = S.Entry._S.size
_RECORD = S.Record._S.size
_CHUNK = S.Chunk._S.size
_CKEY = S.ContentKey._S.size


def probe(path: str, readonly: bool = False) -> list[str]:
    """Walk the index at ``path`` (an LMDB environment directory) and return what is
    wrong with it (empty: fine). Meant to run in a child process: a damaged file may
    kill the process that reads it.

    Checks: every page of every sub-database (all keys and values are read), the key and
    value lengths the schema gives, each record against its chunk (it exists, lists the
    record's inode, same log, the record inside it) and its namespace entry (it exists),
    each directory entry against the inode it names, and one write transaction
    (put and delete a key: LMDB's free list is read only when a transaction allocates
    pages, and a damaged one fails the daemon's next commit). The record checks are
    vectorized (numpy)."""
    import lmdb  # noqa: PLC0415 - the child imports it, callers of check_index need not

    problems: list[str] = []
    # lock=True: zero-copy readers of a crashed daemon may still hold read transactions;
    # the write below must not reuse pages they see (CacheLock keeps other writers out)
    # readonly: another daemon's live index (dedup), never written to (no write probe)
    env = lmdb.open(path, readonly=readonly, lock=True, max_dbs=8, subdir=True,
                    readahead=False, map_size=1 << 36, max_readers=S.MAX_READERS)
    try:
        with env.begin() as txn:
            names = [bytes(k) for k in txn.cursor().iternext(keys=True, values=False)]
        items: dict[bytes, tuple[list[bytes], list[bytes]]] = {}
        for name in (S.DB_META, S.DB_INODE, S.DB_DIRENT, S.DB_RECORD, S.DB_CHUNK,
                     S.DB_CKEY, S.DB_CONTENT):
            if name not in names:
                # a fresh index has all of them; an empty file has none; an index made
                # before content keys has no ckey/content (added at its next open)
                if names and name not in (S.DB_CKEY, S.DB_CONTENT):
                    problems.append(f"sub-database {name.decode()} is missing")
                items[name] = ([], [])
                continue
            db = env.open_db(name, create=False)
            with env.begin(db=db) as txn:
                cur = txn.cursor()
                keys = list(cur.iternext(keys=True, values=False))
                vals = list(cur.iternext(keys=False, values=True)) if cur.first() else []
            items[name] = (keys, vals)
        problems += _check_items(items)
        if names and not problems and not readonly:
            meta = env.open_db(S.DB_META, create=False)
            with env.begin(db=meta, write=True) as txn:
                txn.put(b"integrity_probe", b"1")
                txn.delete(b"integrity_probe")
    finally:
        env.close()
    return problems[:20]


def _n_bad(xs: list[bytes], ok) -> int:
    """How many of ``xs`` have a length ``ok(len)`` refuses."""
    if all(ok(n) for n in set(map(len, xs))):
        return 0
    return sum(1 for x in xs if not ok(len(x)))


def _check_items(items: dict[bytes, tuple[list[bytes], list[bytes]]]) -> list[str]:
    import numpy as np  # noqa: PLC0415 - in the child only

    problems: list[str] = []
    meta_k, meta_v = items[S.DB_META]
    if len(meta_k) != len(meta_v):
        return ["meta: keys and values do not pair"]
    meta = dict(zip(meta_k, meta_v, strict=True))
    if meta_k and S.K_FORMAT not in meta:
        problems.append("meta: no format key")
    for db, keys_ok, vals_ok in (
            (S.DB_INODE, lambda n: n == 8, lambda n: n >= _ENTRY),
            (S.DB_DIRENT, lambda n: n > 8, lambda n: n == 8),
            (S.DB_RECORD, lambda n: n == 8, lambda n: n == _RECORD),
            (S.DB_CHUNK, lambda n: n == 8, lambda n: n >= _CHUNK),
            (S.DB_CKEY, lambda n: n == 8, lambda n: n == _CKEY),
            (S.DB_CONTENT, lambda n: n == 32, lambda n: n == 8)):
        ks, vs = items[db]
        bad = _n_bad(ks, keys_ok) + _n_bad(vs, vals_ok) + abs(len(ks) - len(vs))
        if bad:
            problems.append(f"{db.decode()}: {bad} keys or values of a wrong length")
    if problems:
        return problems
    chunk_ids, chunk_log, chunk_off, chunk_len = [], [], [], []
    members: dict[int, frozenset[int]] = {}
    for k, v in zip(*items[S.DB_CHUNK], strict=True):
        n = struct.unpack_from("<I", v, _CHUNK - 4)[0]
        if len(v) != _CHUNK + 8 * n:
            problems.append(f"chunk {S.unkey(k)}: {len(v)} bytes for {n} members")
            continue
        log_id, off, length = struct.unpack_from("<QQQ", v, 0)
        members[S.unkey(k)] = frozenset(struct.unpack_from(f"<{n}Q", v, _CHUNK))
        chunk_ids.append(S.unkey(k))
        chunk_log.append(log_id)
        chunk_off.append(off)
        chunk_len.append(length)
    ids = np.array(chunk_ids, dtype=np.uint64)  # sorted: LMDB's key order is numeric
    rec = np.frombuffer(b"".join(items[S.DB_RECORD][1]), dtype=np.dtype(
        [("chunk", "<u8"), ("log", "<u8"), ("off", "<u8"), ("size", "<u8"), ("xxh", "<u8"),
         ("mtime", "<i8"), ("ino", "<u8")]))
    if len(rec):
        if len(ids):
            pos = np.minimum(np.searchsorted(ids, rec["chunk"]), len(ids) - 1)
            found = ids[pos] == rec["chunk"]
        else:
            pos, found = np.zeros(len(rec), np.int64), np.zeros(len(rec), bool)
        if not found.all():
            problems.append(f"{int((~found).sum())} records name missing chunks (first: "
                            f"names missing chunk {int(rec['chunk'][~found][0])})")
        if len(ids):
            logs = np.array(chunk_log, dtype=np.uint64)[pos]
            offs = np.array(chunk_off, dtype=np.uint64)[pos]
            lens = np.array(chunk_len, dtype=np.uint64)[pos]
            with np.errstate(over="ignore"):
                fits = (logs == rec["log"]) & (rec["off"] >= offs) & \
                    (rec["off"] + rec["size"] <= offs + lens)
            if not (fits | ~found).all():
                problems.append(f"{int((~fits & found).sum())} records do not fit their chunks")
        rec_inos = np.frombuffer(b"".join(items[S.DB_RECORD][0]), dtype=">u8")
        inodes = np.frombuffer(b"".join(items[S.DB_INODE][0]), dtype=">u8")
        no_entry = ~np.isin(rec_inos, inodes)
        if no_entry.any():
            problems.append(f"{int(no_entry.sum())} records of no namespace entry (first: "
                            f"inode {int(rec_inos[no_entry][0])})")
        unlisted = sum(1 for ino, c in zip(rec_inos.tolist(), rec["chunk"].tolist(), strict=True)
                       if ino not in members.get(c, ()))
        if unlisted:
            problems.append(f"{unlisted} records not listed by their chunks")
    # the size counters and next ids are not checked: the start after a walk recounts
    # them from the entries (:meth:`~dlcachefs.store.index.Index.recount`), so a counter
    # damaged alone costs a WARNING, not the whole cache
    problems += _check_names(items)
    return problems


def _check_names(items: dict[bytes, tuple[list[bytes], list[bytes]]]) -> list[str]:
    """Every directory entry names an inode whose entry says the same parent and name,
    every inode but the root is named by its parent's directory entry, and each entry's
    name and link target fit its value (a flipped dirent would serve another file's
    bytes under this name; those bytes would pass their checksum)."""
    problems: list[str] = []
    named: dict[int, tuple[int, bytes]] = {}
    unpack_lens = struct.Struct("<II").unpack_from
    for k, v in zip(*items[S.DB_INODE], strict=True):
        nl, tl = unpack_lens(v, _ENTRY - 8)
        if len(v) != _ENTRY + nl + tl:
            problems.append(f"inode {S.unkey(k)}: {len(v)} bytes, its names say {nl}+{tl}")
            if len(problems) >= 5:
                return problems
            continue
        named[S.unkey(k)] = (int.from_bytes(v[:8], "little"), bytes(v[_ENTRY:_ENTRY + nl]))
    seen = 0
    for k, v in zip(*items[S.DB_DIRENT], strict=True):
        ino = int.from_bytes(v, "big")
        if named.get(ino) != (int.from_bytes(k[:8], "big"), bytes(k[8:])):
            problems.append(f"directory entry {bytes(k[8:])[:60]!r} of {S.unkey(k[:8])} "
                            f"names inode {ino}, whose entry disagrees")
            if len(problems) >= 5:
                return problems
        else:
            seen += 1
    if problems:
        return problems
    orphans = len(named) - seen - (1 if 1 in named else 0)
    if orphans:
        problems.append(f"{orphans} inodes are named by no directory entry")
    return problems


#: the child's program: a report on stdout whatever happens that Python can catch; damage
#: is what reading the index raises, not what keeps the check from running (its own
#: import, memory, a full disk, a lock: those leave the index as it is)
_CHILD = r"""
import json, sys
try:
    import lmdb
    from dlcachefs.store.integrity import probe
except BaseException as e:
    print(json.dumps({"unchecked": f"cannot run the check: {e!r}"[:300]}))
    sys.exit(0)
NOT_DAMAGE = (MemoryError, OSError, lmdb.MapFullError, lmdb.DiskError, lmdb.LockError,
              lmdb.ReadersFullError, lmdb.ReadonlyError, lmdb.TlsFullError)
try:
    print(json.dumps({"problems": probe(sys.argv[1], readonly=sys.argv[2:] == ["ro"])}))
except NOT_DAMAGE as e:
    print(json.dumps({"unchecked": f"{type(e).__name__}: {e}"[:300]}))
except Exception as e:
    print(json.dumps({"problems": [f"reading it fails: {type(e).__name__}: {e}"[:300]]}))
"""

#: signals of a process that read damaged memory-mapped data (not an OOM kill, SIGKILL)
_DAMAGE_SIGNALS = {"SIGBUS", "SIGSEGV", "SIGABRT", "SIGILL", "SIGFPE"}


def check_index(path: str, timeout: float = 600.0, other: bool = False) -> str | None:
    """Check the index at ``path`` in a child process: why it is damaged, or None when it
    is fine, absent, or could not be checked (a warning is logged: the child could not
    import the check, ran out of memory or was killed, the disk is full, or it did not
    finish in ``timeout`` seconds). Only what reading the index does (a crash by SIGBUS,
    SIGSEGV, SIGABRT; an LMDB or format error; a structural problem the walk finds)
    counts as damage: a good cache is never thrown away because its check did not run.

    ``other``: the index of another daemon's dataset (content dedup reads it): opened
    read-only (no write probe, nothing of it changes), and a check that could not run is
    a reason too (``"not checked: ..."``: such an index is not read)."""
    damaged, unchecked = _walk(path, timeout, readonly=other)
    if unchecked is not None:
        return _unchecked(path, unchecked, other)
    return damaged


def check_at_stop(path: str, timeout: float = 300.0) -> str | None:
    """The walk of :func:`check_index`, at a clean stop before :func:`mark_clean`: why
    the index must not be marked clean (damage found, or the walk could not run), or None.
    Damage written into the file while the daemon mapped it, on pages the daemon did not
    read again, changes nothing the clean marker compares (the daemon's own commits move
    the file's times): without this walk the next start would skip its walk and map a
    damaged file (an ``mdb_assert`` then aborts it, which no Python code can catch)."""
    damaged, unchecked = _walk(path, timeout, readonly=False)
    return damaged if unchecked is None else unchecked


def _walk(path: str, timeout: float, readonly: bool) -> tuple[str | None, str | None]:
    """(why the index is damaged, why the walk could not run): at most one is not None."""
    if not os.path.exists(os.path.join(path, "data.mdb")):
        return None, None
    # the same dlcachefs as ours, wherever the working directory is (a daemon is in /)
    pkg_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (pkg_root, env.get("PYTHONPATH"))))
    try:
        r = subprocess.run([sys.executable, "-c", _CHILD, path, *(["ro"] if readonly else [])],
                           capture_output=True,
                           text=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env)
    except subprocess.TimeoutExpired:
        return None, f"the check did not finish in {timeout:g} s"
    if r.returncode < 0:
        name = _signame(-r.returncode)
        if name in _DAMAGE_SIGNALS:
            return f"reading it kills a process ({name})", None
        return None, f"the check was killed ({name})"
    try:
        report = json.loads(r.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"the check gave no report (exit {r.returncode}: {last[:300]})"
    if "unchecked" in report:
        return None, f"could not be checked ({report['unchecked']})"
    problems = report.get("problems") or []
    return ("; ".join(problems[:5]) if problems else None), None


def _unchecked(path: str, why: str, other: bool) -> str | None:
    """A check that could not run: our own index is kept (a warning says so); another
    dataset's is not read (the reason is returned)."""
    if other:
        return f"not checked: {why}"
    log.warning("index %s: %s; kept unchecked", path, why)
    return None


def _signame(sig: int) -> str:
    import signal  # noqa: PLC0415

    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _clean_marker(path: str) -> str:
    return path.rstrip("/") + ".clean"


def _stamp(path: str) -> str | None:
    try:
        st = os.stat(os.path.join(path, "data.mdb"))
    except OSError:
        return None
    return f"{st.st_size} {st.st_mtime_ns} {st.st_ino}"


#: signs of a damaged index seen by the daemon this run (:func:`note_error`,
#: :func:`note_damage`); a stop after one does not mark the index clean, so the next start
#: walks it (and recounts or sets it aside)
_run_errors: list[str] = []
#: the class of the last LMDB error :func:`is_damage` saw: a ``BadTxnError`` (a
#: transaction LMDB refuses to go on with) is damage unless the error before it was about
#: resources
_last_lmdb_error: list[type] = []


def is_damage(exc: BaseException) -> bool:
    """Whether ``exc`` is a sign of a damaged index (see :func:`note_error`), without
    noting it."""
    import lmdb  # noqa: PLC0415 - the daemon has it loaded already

    not_damage = (lmdb.MapFullError, lmdb.DiskError, lmdb.LockError, lmdb.ReadersFullError,
                  lmdb.ReadonlyError, lmdb.TlsFullError, lmdb.MemoryError, lmdb.TxnFullError,
                  lmdb.MapResizedError, MemoryError)
    # a value of the wrong length unpacked from the index (struct.error: the only structs
    # unpacked while serving are the index's records, entries and chunks; chunk and
    # record headers raise FormatError) is the same damage, found in a value not a page
    if isinstance(exc, struct.error):
        return True
    if not isinstance(exc, lmdb.Error) or isinstance(exc, not_damage):
        if isinstance(exc, lmdb.Error):
            _last_lmdb_error[:] = [type(exc)]
        return False
    if isinstance(exc, lmdb.BadTxnError):
        # MDB_BAD_TXN: LMDB flagged the transaction after an error in it: a full map or
        # disk (not damage) or a page read wrong. The chaos suite saw it first in a read
        # transaction over damaged pages, with no error before it in the process.
        return not (_last_lmdb_error and issubclass(_last_lmdb_error[0], not_damage))
    _last_lmdb_error[:] = [type(exc)]
    return True


def note_error(exc: BaseException) -> bool:
    """The one damage path for an error met while serving: an LMDB error that is not
    about resources (``MDB_CORRUPTED``, ``MDB_CURSOR_FULL``, ``MDB_PAGE_NOTFOUND``... from
    a data page damaged while mapped; a ``BadTxnError`` unless a full map or disk came
    before it) or a value of
    the wrong length means the index may be damaged. Remembered for the stop, which then
    leaves no clean marker. Returns whether ``exc`` is such an error (a WARNING, once per
    run, without a traceback). Any thread (list updates under the GIL)."""
    if not is_damage(exc):
        return False
    note_damage(f"{type(exc).__name__}: {exc}")
    return True


def note_damage(why: str) -> None:
    """A sign of damage found some other way (the cache's invariants violated while
    running): the stop leaves no clean marker, so the next start walks the index and
    recounts what it derives from it, or sets it aside; readers in other processes stop
    mapping it (:func:`hold_sound`). A WARNING, once per run."""
    first = not _run_errors
    _run_errors.append(why[:200])  # (before the drop: no flag is written after it)
    del _run_errors[1:]  # the first is enough
    drop_sound()
    if first:
        log.warning("the index may be damaged (%s); the next start checks it", why[:300])


def log_failure(logger: logging.Logger, msg: str, *args: object) -> None:
    """Log the exception being handled by a loop that degrades instead of crashing
    (``except Exception:``): damage (:func:`note_error`) is a WARNING without a traceback,
    anything else an ERROR with one. Call it only inside an ``except`` block."""
    exc = sys.exc_info()[1]
    if exc is not None and note_error(exc):
        logger.warning(msg + " (the index may be damaged: %s: %s)", *args,
                       type(exc).__name__, str(exc)[:200])
    else:
        logger.exception(msg, *args)


#: the length the sound flag is written at (the stamp, padded)
FLAG_BYTES = 96


class SoundFlag:
    """The daemon's word to readers in training processes (:mod:`dlcachefs.data`) that its
    index is sound, kept in the file ``flag``: the index file's identity (size,
    modification time, inode: :func:`stamp_of`) as the daemon's last commit left it.

    A damaged LMDB file can kill the process that maps it, and a training must never die
    of the cache. So a reader maps the index only while the flag names the index file as
    it is now: found sound at this start (walked, or exactly as the walk of the last clean
    stop left it: :func:`hold_sound`), and changed since by nothing but the daemon's own
    commits, each vouched for after it (:meth:`after_write`). A change the daemon did not
    make (damage written under the map) leaves the file unlike the flag, so readers stop
    mapping it at their next check; and the daemon, at its next write, finds the file
    unlike its last commit left it and notes damage (:meth:`before_write`), which removes
    the flag for good. Writes are serialized by the index (its write lock), so
    ``before_write`` and ``after_write`` of one transaction are never interleaved with
    another's."""

    def __init__(self, flag: str, index_dir: str) -> None:
        self.flag = flag
        self.index_dir = index_dir
        self.stamp: str | None = None

    def hold(self) -> None:
        with _sound_lock:
            self.stamp = _stamp(self.index_dir)
            self._write()

    def before_write(self) -> None:
        if self.stamp is not None and _stamp(self.index_dir) != self.stamp:
            note_damage("the index file changed outside the daemon's commits")

    def after_write(self, exc: BaseException | None = None) -> None:
        """After a write transaction: its commit vouched for. One that failed (a full
        disk) may have written pages all the same: vouched for too, unless the failure
        is itself a sign of damage."""
        if exc is not None and is_damage(exc):
            return
        with _sound_lock:
            if self.stamp is None:
                return
            self.stamp = _stamp(self.index_dir)
            self._write()

    def _write(self) -> None:
        """(under _sound_lock)"""
        if _run_errors or self.stamp is None:
            self._unlink()
            return
        # Rewritten in place, at a fixed length: no block to allocate (a full cache disk
        # must not take the readers' word away), one small pwrite a reader sees whole or,
        # torn, unlike the file (it then reads through the mount once, and looks again)
        # (in the cache directory, which only the daemon's user may write: never a link
        # or a FIFO someone else put there; checked all the same)
        line = (self.stamp + "\n").encode().ljust(FLAG_BYTES, b" ")
        try:
            fd = os.open(self.flag, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
                         | os.O_NONBLOCK, 0o640)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                    raise OSError(errno.EPERM, "not the daemon's regular file")
                os.pwrite(fd, line, 0)
            finally:
                os.close(fd)
        except OSError as e:
            # readers stop at once; the next commit tries again (a disk full for now)
            with contextlib.suppress(OSError):
                os.unlink(self.flag)
            log.info("cannot write %s (%s): training processes read through the mount",
                     self.flag, e)

    def drop(self) -> None:
        with _sound_lock:
            self.stamp = None
            self._unlink()

    def _unlink(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.flag)


#: the flags of :func:`hold_sound`
_sound_flags: list[SoundFlag] = []
#: a flag's write and its drop (a commit's thread, damage noted in another) never cross
_sound_lock = threading.Lock()


def hold_sound(flag: str, index_dir: str) -> SoundFlag:
    """The daemon's index was found sound at this start: say so to readers in training
    processes by ``flag`` (:class:`SoundFlag`) until the first sign of damage
    (:func:`note_damage`) or :func:`drop_sound`. The daemon's index calls its
    ``before_write`` and ``after_write`` around each write transaction."""
    os.makedirs(os.path.dirname(flag), exist_ok=True)
    f = SoundFlag(flag, index_dir)
    _sound_flags.append(f)
    f.hold()
    return f


def drop_sound() -> None:
    """Take the flags of :func:`hold_sound` away (damage seen, or the daemon stops)."""
    for f in _sound_flags:
        f.drop()
    _sound_flags.clear()


def stamp_of(index_dir: str) -> str | None:
    """The index file's identity as :class:`SoundFlag` writes it (None: no file)."""
    return _stamp(index_dir)


def damage_seen() -> bool:
    """Whether :func:`note_error` or :func:`note_damage` saw damage this run."""
    return bool(_run_errors)


def mark_clean(path: str) -> None:
    """After a clean stop (the index committed and closed): remember the index file as it
    is, so that the next start need not walk it (:func:`unchanged_since_clean_stop`)."""
    stamp = _stamp(path)
    if stamp is not None:
        with open(_clean_marker(path), "w") as f:
            f.write(stamp + "\n")
            f.flush()
            os.fsync(f.fileno())


def unchanged_since_clean_stop(path: str) -> bool:
    """True when the index file is as the last clean stop left it; the marker is removed
    either way (the daemon now uses the index: a crash must make the next start walk)."""
    marker = _clean_marker(path)
    try:
        with open(marker) as f:
            saved = f.read().strip()
    except OSError:
        return False
    os.unlink(marker)
    return saved == _stamp(path)


def quarantine(path: str) -> str:
    """Move a damaged index aside (``<path>.damaged``, replacing an older one) and return
    where it went; the next :class:`~dlcachefs.store.index.Index` there starts empty."""
    dest = path.rstrip("/") + DAMAGED_SUFFIX
    if os.path.exists(dest):
        shutil.rmtree(dest)
    os.rename(path, dest)
    with open(os.path.join(dest, "QUARANTINED"), "w") as f:
        f.write(time.strftime("%Y-%m-%dT%H:%M:%SZ\n", time.gmtime()))
    return dest
