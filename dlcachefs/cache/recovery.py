"""Start-up of a cache directory: crash recovery, then the namespace scan.

Runs once, blocking, before the filesystem is served (no trio loop yet, so plain calls,
LMDB write transactions included, are fine here):

0. (before it, :func:`check_source`: a cache of another source is refused);
1. chunks whose log file is gone are dropped from the index;
2. each log is cut after its last indexed chunk (:meth:`LogStore.recover`): a crash
   between a seal's append and its commit leaves an unindexed tail (see
   :mod:`dlcachefs.cache.writer` for the order of a seal);
3. the policy is told about every chunk that survived, and the logs' live bytes are
   counted;
4. the values derived from the index (the size counters, the next ids) are recounted
   from its entries (:meth:`Index.recount`: damage can leave them wrong while every entry
   is sound; a WARNING says which), before a scan allocates inodes from them;
5. the source tree is listed when there is no snapshot yet, or ``--rescan`` was given,
   and with ``--debug-invariants`` the index is checked:
   what is still wrong raises :class:`~dlcachefs.errors.IndexDamaged` (the daemon then
   sets the index aside and starts empty, never refuses the mount);
6. the ``--cache-size`` account starts from what recovery left, and a cache over a
   smaller ``--cache-size`` than last time is shrunk by the writer's first commit.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

from dlcachefs.cache.namespace import Namespace
from dlcachefs.cache.writer import ChunkWriter
from dlcachefs.config import Config
from dlcachefs.errors import IndexDamaged, SourceMismatch
from dlcachefs.store import schema as S
from dlcachefs.store.index import Index
from dlcachefs.store.logs import LogStore

log = logging.getLogger(__name__)


def check_source(cfg: Config, index: Index, root: bytes) -> None:
    """SourceMismatch when the cache directory holds the cache of another source: its
    snapshot and records must never be served as this one's (a ``--dataset`` name or a
    ``--cache-dir`` given again for another source)."""
    was = index.get_meta(S.K_SOURCE)
    if was is not None and was != root:
        raise SourceMismatch(
            f"the cache in {cfg.data_dir} holds the cache of {os.fsdecode(was)}, not of "
            f"{os.fsdecode(root)}: use another --cache-dir for this source (or, with "
            "--shared-cache, another --dataset), or remove that cache directory")


def recover(cfg: Config, index: Index, logs: LogStore, ns: Namespace, writer: ChunkWriter,
            policy, progress: Callable[[int, int, float], None] | None = None,
            recount_all: bool = True) -> dict:
    """Recover the cache directory and list the source if needed (module docstring);
    what was found, for the daemon's start-up log line. ``recount_all``: recount the
    statistics counters too (the daemon passes False when the index is as its last clean
    stop left it, so not walked: those counters are as trusted as the stop was)."""
    info: dict = {}
    chunks = sorted(index.iter_chunks(), key=lambda c: c.chunk_id)
    present = set(logs.log_ids())
    lost = [c for c in chunks if c.log_id not in present]
    if lost:
        log.warning("%d chunks point at missing log files; dropping them", len(lost))
        with index.write() as w:
            for c in lost:
                w.drop_chunk(c.chunk_id)
        chunks = [c for c in chunks if c.log_id in present]
    ends: dict[int, int] = {}
    for c in chunks:
        ends[c.log_id] = max(ends.get(c.log_id, 0), c.offset + c.length)
        logs.live[c.log_id] = logs.live.get(c.log_id, 0) + c.length
        policy.on_insert(c.chunk_id, c.members, c.length)
    info.update(logs.recover(ends))
    info["chunks"] = len(chunks)
    info["lost_chunks"] = len(lost)
    # before the scan: a --rescan allocates inodes from next_ino
    # under --debug-invariants the check below compares every counter: recount them all
    fixed = index.recount(full=recount_all or cfg.debug_invariants)
    if fixed:
        log.warning("the index's derived values disagreed with its entries (damage, or a "
                    "crash of an older build); recounted: %s", ", ".join(
                        f"{k} {was} -> {now}" for k, (was, now) in sorted(fixed.items())))
        info["recounted"] = sorted(fixed)
    if cfg.rescan or not ns.has_snapshot():
        entries, dirs = ns.scan(threads=cfg.source_threads, progress=progress)
        info.update(scanned_entries=entries, scanned_dirs=dirs)
    if cfg.debug_invariants:
        problems = index.check_invariants()
        if problems:
            raise IndexDamaged("index invariants violated: " + "; ".join(problems[:5]))
    # the account starts from what recovery left; a cache over a smaller --cache-size
    # than last time is shrunk by the writer's first commit
    writer.used = index.counter(S.K_CHUNK_BYTES)
    writer.shrink_to_limit()
    return info
