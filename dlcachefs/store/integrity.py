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

The walk reads every page once (a cache of a million files: about a second; the
daemon's start-up log line says how long it took). Damage that appears while a daemon
has the index open is not covered: LMDB is trusted while mapped (see README,
"Faults").
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time

from dlcachefs.store import schema as S

#: the directory a damaged index is moved to (the latest one only is kept)
DAMAGED_SUFFIX = ".damaged"

_ENTRY = S.Entry._S.size
_RECORD = S.Record._S.size
_CHUNK = S.Chunk._S.size


def probe(path: str) -> list[str]:
    """Walk the index at ``path`` (an LMDB environment directory) and return what is
    wrong with it (empty: fine). Meant to run in a child process: a damaged file may
    kill the process that reads it.

    Checks: every page of every sub-database (a cursor walk), every key and value's
    length against the schema, each record against its chunk (it exists, same log, the
    record inside it, the chunk lists the inode), the size counters against the sums,
    and one write transaction (put and delete a key: LMDB's free list is read only when
    a transaction allocates pages, and a damaged one fails the daemon's next commit)."""
    import lmdb  # noqa: PLC0415 - the child imports it, callers of check_index need not

    problems: list[str] = []
    env = lmdb.open(path, readonly=False, lock=False, max_dbs=8, subdir=True,
                    readahead=False, map_size=1 << 36)
    try:
        with env.begin(buffers=True) as txn:
            names = [bytes(k) for k, _ in txn.cursor()]
        chunks: dict[int, tuple[int, int, int, frozenset]] = {}
        records: list[tuple[int, bytes]] = []
        counters: dict[bytes, int] = {}
        for name in (S.DB_META, S.DB_INODE, S.DB_DIRENT, S.DB_RECORD, S.DB_CHUNK):
            if name not in names:
                if names:  # a fresh index has all of them; an empty file has none
                    problems.append(f"sub-database {name.decode()} is missing")
                continue
            db = env.open_db(name, create=False)
            with env.begin(db=db, buffers=True) as txn:
                n = 0
                for k, v in txn.cursor():
                    n += 1
                    why = _bad_item(name, k, v)
                    if why:
                        problems.append(f"{name.decode()}: {why}")
                        if len(problems) >= 20:
                            return problems
                        continue
                    if name == S.DB_CHUNK:
                        c = S.Chunk.unpack(S.unkey(k), bytes(v))
                        chunks[c.chunk_id] = (c.log_id, c.offset, c.length, frozenset(c.members))
                    elif name == S.DB_RECORD:
                        records.append((S.unkey(k), bytes(v)))
                    elif name == S.DB_META and bytes(k) in (S.K_CACHED_BYTES, S.K_CHUNK_BYTES) \
                            and len(v) == 8:
                        counters[bytes(k)] = struct.unpack("<q", v)[0]
                if name == S.DB_META and n and txn.get(S.K_FORMAT) is None:
                    problems.append("meta: no format key")
        problems += _cross_check(chunks, records, counters)
        if names and not problems:
            meta = env.open_db(S.DB_META, create=False)
            with env.begin(db=meta, write=True) as txn:
                txn.put(b"integrity_probe", b"1")
                txn.delete(b"integrity_probe")
    finally:
        env.close()
    return problems[:20]


def _cross_check(chunks: dict, records: list[tuple[int, bytes]], counters: dict) -> list[str]:
    """Records against their chunks, and the size counters against the sums."""
    problems: list[str] = []
    cached = 0
    for ino, v in records:
        r = S.Record.unpack(v)
        cached += r.size
        c = chunks.get(r.chunk_id)
        if c is None:
            problems.append(f"record of inode {ino} names missing chunk {r.chunk_id}")
        elif c[0] != r.log_id or not (c[1] <= r.offset and r.offset + r.size <= c[1] + c[2]) \
                or ino not in c[3]:
            problems.append(f"record of inode {ino} does not fit chunk {r.chunk_id}")
        if len(problems) >= 20:
            return problems
    if counters.get(S.K_CACHED_BYTES, 0) != cached:
        problems.append(f"cached_bytes counter {counters.get(S.K_CACHED_BYTES, 0)} != {cached}")
    chunk_bytes = sum(c[2] for c in chunks.values())
    if counters.get(S.K_CHUNK_BYTES, 0) != chunk_bytes:
        problems.append(f"chunk_bytes counter {counters.get(S.K_CHUNK_BYTES, 0)} != {chunk_bytes}")
    return problems


def _bad_item(db: bytes, k, v) -> str | None:
    """Why one key/value pair cannot be what the schema says (None: it can)."""
    kl, vl = len(k), len(v)
    if db == S.DB_META:
        return None if kl else "empty key"
    if db == S.DB_DIRENT:
        return None if kl > 8 and vl == 8 else f"dirent of {kl} / {vl} bytes"
    if kl != 8:
        return f"key of {kl} bytes"
    if db == S.DB_RECORD:
        return None if vl == _RECORD else f"record of {vl} bytes"
    if db == S.DB_INODE:
        if vl < _ENTRY:
            return f"entry of {vl} bytes"
        nl, tl = struct.unpack_from("<II", v, _ENTRY - 8)
        return None if vl == _ENTRY + nl + tl else f"entry of {vl} bytes, names say {nl}+{tl}"
    if db == S.DB_CHUNK:
        if vl < _CHUNK:
            return f"chunk of {vl} bytes"
        n = struct.unpack_from("<I", v, _CHUNK - 4)[0]
        return None if vl == _CHUNK + 8 * n else f"chunk of {vl} bytes for {n} members"
    return None


def check_index(path: str, timeout: float = 600.0) -> str | None:
    """Check the index at ``path`` in a child process: None when it is fine (or absent),
    else why it is damaged. A child that cannot finish in ``timeout`` seconds is not
    taken as damage (the index is kept; the caller logs it)."""
    if not os.path.exists(os.path.join(path, "data.mdb")):
        return None
    cmd = [sys.executable, "-c", "import sys, json; from dlcachefs.store.integrity import "
           "probe; print(json.dumps(probe(sys.argv[1])))", path]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None
    if r.returncode < 0:
        return f"reading it kills a process ({_signame(-r.returncode)})"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"reading it fails: {last[:300]}"
    try:
        problems = json.loads(r.stdout)
    except ValueError:
        return f"the check printed no report: {r.stdout[-200:]!r}"
    return "; ".join(problems[:5]) if problems else None


def _signame(sig: int) -> str:
    import signal  # noqa: PLC0415

    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


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
