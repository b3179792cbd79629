"""``dlcachefs verify``: the fsck of a cache directory.

Reads every indexed chunk once, checks its header and payload checksum, checks every
record the index points into it against the record's own checksum, and checks the index
invariants. With ``--repair``, damaged records (and chunks whose header is unreadable)
are dropped from the index, so that they are fetched from the source again, and the
counters and next ids the index derives are recounted from its entries. Needs the
cache lock: a mounted cache is refused.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

from dlcachefs.errors import CacheLocked, FormatError
from dlcachefs.store.chunkfmt import checksum, decode_chunk_header
from dlcachefs.store.index import Index
from dlcachefs.store.integrity import check_index, quarantine
from dlcachefs.store.lock import CacheLock
from dlcachefs.store.logs import LogStore


def verify(cache_dir: str, repair: bool) -> dict:
    """Check (and with ``repair``, fix) a cache directory no daemon holds; the report.

    The index itself is checked first, in a child process (:mod:`.integrity`): a damaged
    one is reported as ``index_damaged``, and ``repair`` moves it aside so that the cache
    starts empty (the next mount deletes the logs nothing indexes)."""
    import os  # noqa: PLC0415

    index_dir = os.path.join(cache_dir, "meta.lmdb")
    damaged = check_index(index_dir)
    if damaged is not None:
        report: dict = {"chunks": 0, "records": 0, "bad_chunks": [], "bad_records": [],
                        "invariant_problems": [], "index_damaged": damaged}
        if repair:
            report["quarantined_to"] = quarantine(index_dir)
            report["repaired"] = True
        return report
    ix = Index(index_dir)
    logs = LogStore(os.path.join(cache_dir, "logs"), 1 << 30)
    report = {"chunks": 0, "records": 0, "bad_chunks": [], "bad_records": [],
              "invariant_problems": []}
    try:
        by_chunk: dict[int, list] = {}
        for ino, rec in ix.iter_records():
            by_chunk.setdefault(rec.chunk_id, []).append((ino, rec))
        for c in list(ix.iter_chunks()):
            report["chunks"] += 1
            try:
                data = logs.read(c.log_id, c.offset, c.length)
                decode_chunk_header(data)
            except (FormatError, OSError) as e:
                report["bad_chunks"].append({"chunk": c.chunk_id, "reason": str(e)})
                continue
            for ino, rec in by_chunk.get(c.chunk_id, []):
                report["records"] += 1
                start = rec.offset - c.offset
                if checksum(memoryview(data)[start : start + rec.size]) != rec.data_xxh:
                    e = ix.get_entry(ino)
                    report["bad_records"].append({"inode": ino, "chunk": c.chunk_id,
                                                  "name": e.name.decode(errors="replace") if e else "?"})
        report["invariant_problems"] = ix.check_invariants()
        if repair and (report["bad_chunks"] or report["bad_records"]):
            with ix.write() as w:
                for b in report["bad_chunks"]:
                    w.drop_chunk(b["chunk"])
                for b in report["bad_records"]:
                    w.drop_record(b["inode"])
            report["repaired"] = True
        if repair and report["invariant_problems"]:
            # counters and next ids are derived: set to what the entries say (the rest of
            # what the check finds the walk has refused already, or the drops above fixed)
            report["recounted"] = ix.recount(full=True)
            report["repaired"] = True
    finally:
        logs.close()
        ix.close()
    return report


def cmd_verify(cache_dir: str, repair: bool, as_json: bool,
               is_mounted: Callable[[str], bool] | None = None) -> int:
    """``dlcachefs verify``: ``is_mounted`` as :class:`CacheLock` takes it (the CLI
    passes :func:`dlcachefs.mountctl.is_mounted`)."""
    import os  # noqa: PLC0415

    datasets = os.path.join(cache_dir, "datasets")
    if os.path.isdir(datasets) and not os.path.exists(os.path.join(cache_dir, "meta.lmdb")):
        # a shared root (--shared-cache): each dataset's cache is checked on its own
        names = sorted(os.listdir(datasets))
        print(f"dlcachefs verify: {cache_dir} is a shared cache root; verify each dataset: "
              + ", ".join(f"--cache-dir {os.path.join(datasets, n)}" for n in names[:10])
              + (" ..." if len(names) > 10 else ""), file=sys.stderr)
        return 2
    # an fsck creates nothing: a mistyped path, or a directory that is not a cache (the
    # dataset itself), is refused before the lock file or an index could be made in it
    if not os.path.isdir(cache_dir):
        print(f"dlcachefs verify: {cache_dir}: no such directory", file=sys.stderr)
        return 2
    # what every cache has (an index moved aside by --repair leaves logs/ and the lock)
    if not (os.path.isdir(os.path.join(cache_dir, "meta.lmdb"))
            or os.path.isdir(os.path.join(cache_dir, "logs"))):
        print(f"dlcachefs verify: {cache_dir} is not a dlcachefs cache directory (no "
              "meta.lmdb, no logs/); give the --cache-dir the mount used (by default "
              "~/.cache/dlcachefs/<source name>-<hash>)", file=sys.stderr)
        return 2
    lock = CacheLock(cache_dir, is_mounted=is_mounted)
    try:
        lock.acquire("(dlcachefs verify)")
    except CacheLocked as e:
        print(f"dlcachefs verify: {e}", file=sys.stderr)
        return 2
    try:
        rep = verify(cache_dir, repair)
    finally:
        lock.release()
    bad = bool(rep["bad_chunks"] or rep["bad_records"] or rep["invariant_problems"]
               or rep.get("index_damaged"))
    if as_json:
        print(json.dumps(rep, indent=2))
    else:
        print(f"checked {rep['chunks']} chunks, {rep['records']} records: "
              f"{len(rep['bad_chunks'])} damaged chunks, {len(rep['bad_records'])} damaged "
              f"records, {len(rep['invariant_problems'])} index problems")
        for b in rep["bad_chunks"]:
            print(f"  damaged chunk {b['chunk']}: {b['reason']}")
        for b in rep["bad_records"]:
            print(f"  damaged record: inode {b['inode']} ({b['name']}) in chunk {b['chunk']}")
        for p in rep["invariant_problems"]:
            print(f"  index: {p}")
        if rep.get("index_damaged"):
            print(f"  index damaged: {rep['index_damaged']}")
            if rep.get("quarantined_to"):
                print(f"  moved to {rep['quarantined_to']}; the cache starts empty")
        if bad:
            print("repaired: damaged entries dropped, they will be fetched again" if repair
                  else "run with --repair to drop damaged entries")
    return 1 if bad and not repair else 0
