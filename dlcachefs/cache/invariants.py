"""The cache's invariants as code (``--debug-invariants``, and after every core test).

:func:`check_cache` returns the violated invariants as readable lines: the
``--cache-size`` account (rule A always; rule B and the account equal to the index when
no commit is in flight, see :mod:`dlcachefs.cache.writer`), the writer's
pinned/doomed/protected sets, and, between commits, the index against itself and
against the live logs.

Concurrency: runs on the trio loop (LMDB read transactions only), cheap enough to run
after every seal in tests.
"""

from __future__ import annotations

import logging

from dlcachefs.cache.writer import ChunkWriter
from dlcachefs.store import integrity
from dlcachefs.store import schema as S
from dlcachefs.store.index import Index
from dlcachefs.store.logs import LogStore

log = logging.getLogger(__name__)


def check_cache(writer: ChunkWriter, index: Index, logs: LogStore, cap: int) -> list[str]:
    """Violated invariants of the cache (empty when all hold); ``cap`` is the writer's
    limit (--cache-size, or a shared root's share: :attr:`ChunkWriter.limit`)."""
    w = writer
    out: list[str] = []
    if w.used - w.doomed_bytes + w.pending_bytes > cap:
        out.append(f"cache account over --cache-size: used {w.used} - doomed "
                   f"{w.doomed_bytes} + pending {w.pending_bytes} > {cap}")
    if min(w.open_charge, w.sealing_bytes, w.reserved, w.doomed_bytes) < 0:
        out.append(f"negative account: open {w.open_charge} sealing {w.sealing_bytes} "
                   f"reserved {w.reserved} doomed {w.doomed_bytes}")
    if w.open_charge != sum(r.charge for r in w.open):
        out.append(f"open charge {w.open_charge} != the open records' "
                   f"{sum(r.charge for r in w.open)}")
    if w.doomed_bytes != sum(w.doomed.values()):
        out.append("doomed bytes != the doomed chunks' lengths")
    if any(n <= 0 for n in w.pins.values()):
        out.append("a pin count is not positive")
    if set(w.pins) & set(w.doomed):
        out.append(f"pinned chunks doomed: {sorted(set(w.pins) & set(w.doomed))[:5]}")
    if w.protected & set(w.doomed):
        out.append(f"protected chunks doomed: {sorted(w.protected & set(w.doomed))[:5]}")
    if not set(w.doomed) <= w.evicting:
        out.append("a doomed chunk is still served (not in evicting)")
    if any(w.pending.get(r.ino) is not r for r in w.open):
        out.append("an open record is not readable from pending")
    if w.commits == 0:  # nothing in flight: the index is the account's truth
        chunk_bytes = index.counter(S.K_CHUNK_BYTES)
        if chunk_bytes != w.used:
            out.append(f"account used {w.used} != index chunk_bytes {chunk_bytes}")
        if chunk_bytes > cap and not w.doomed:
            out.append(f"index chunk_bytes {chunk_bytes} > --cache-size {cap}")
        live: dict[int, int] = {}
        for c in index.iter_chunks():
            live[c.log_id] = live.get(c.log_id, 0) + c.length
        for lid, n in live.items():
            if logs.live.get(lid) != n:
                out.append(f"log {lid}: live bytes {logs.live.get(lid)} != its "
                           f"indexed chunks' {n}")
        missing = set(w.doomed) - {c.chunk_id for c in index.iter_chunks()}
        if missing:
            out.append(f"doomed chunks not in the index: {sorted(missing)[:5]}")
        out.extend(index.check_invariants())
    return out


def check_after_commit(writer: ChunkWriter) -> None:
    """``--debug-invariants``: the writer's ``after_commit``. A violation is an ERROR
    (and counted in ``invariant_violations``), never the end of the mount; it is noted as
    possible damage (:func:`~dlcachefs.store.integrity.note_damage`: a value read back
    from a damaged page disagrees with the account), so that the stop does not mark the
    index clean and the next start walks it and recounts what it derives."""
    problems = check_cache(writer, writer.index, writer.logs, writer.limit)
    if problems:
        writer.counters.invariant_violations += len(problems)
        for p in problems[:10]:
            log.error("invariant violated: %s", p)
        integrity.note_damage(f"invariant violated: {problems[0]}")
