"""Counters since mount, and the ``.dlcache/stats`` document built from every part.

Counters are updated on the trio loop only; :func:`stats_document` runs on the loop too
(LMDB read transactions, and the zero-copy readers' small counter files).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from dlcachefs import __version__

if TYPE_CHECKING:
    from dlcachefs.cache.engine import Engine


@dataclass(slots=True)
class Counters:
    hits: int = 0                  # opens served from the cache (log, memory or not yet sealed)
    misses: int = 0                # opens that waited for the source
    prefetched: int = 0            # files fetched ahead of the reader (clairvoyant prefetch)
    scan_ahead_files: int = 0      # files fetched ahead of readers with no known order
    scan_ahead_bytes: int = 0
    fetch_waits: int = 0           # misses that joined a fetch already in flight
    prefetch_hits: int = 0         # opens served from memory, fetched ahead of the reader
                                   # and not cached (the dataset is larger than the cache)
    bytes_from_source: int = 0
    bytes_from_datasets: int = 0   # whole files read from another dataset's cache in a
                                   # shared root (--shared-cache dedup) instead
    bytes_from_peers: int = 0      # whole files served by the peer tier (--peers) instead
    bytes_from_cache: int = 0      # bytes returned to readers from cached data
    page_cache_opens: int = 0      # opens of cached files no READ followed: the kernel's
                                   # page cache served them (not in bytes_from_cache)
    pages_stored: int = 0          # opens whose bytes were given to the kernel's page cache
                                   # with the open (--store-pages): no READ came for them
    chunk_reads: int = 0           # whole-chunk reads from the logs
    sequential_chunk_reads: int = 0  # chunk reads asked for next to one (id +-1) of the last 64
    record_reads: int = 0          # single-record reads from the logs
    checksum_failures: int = 0     # cached records that failed their checksum (then refetched)
    stale_refetches: int = 0       # cached records whose source changed (then refetched)
    lazy_refetches: int = 0        # opened as cached, evicted before their first READ
                                   # (then fetched from the source, the opened version)
    source_errors: int = 0
    source_timeouts: int = 0
    source_retries: int = 0
    chunks_written: int = 0
    chunks_evicted: int = 0
    chunks_superseded: int = 0  # of chunks_evicted: holding no record any more (moved, stale)
    cache_skipped: int = 0         # fetched files not cached (cache full, writer behind, disk full)
    read_through: int = 0          # opens of files above --max-cached-file: read from the
                                   # source, never cached (also counted in misses)
    reorder_chunks: int = 0        # chunks of a next epoch's log sealed by the reorderer
    chunk_preloads: int = 0        # chunks read ahead of the reader into the memory tier
    record_preloads: int = 0       # single records read ahead of the reader
    fill_reads: int = 0            # records read to fill gaps of a reordered log
    substitutions: int = 0         # misses served with another cached sample (--substitute)
    not_admitted: int = 0          # fetched files the policy chose not to cache
    losses: int = 0                # per-sample losses received (loss control lines)
    losses_ignored: int = 0        # losses of a job with no listed dataset, or out of range
    losses_dropped: int = 0        # losses of a dataset whose importance another's replaced
    released_after_use: int = 0    # chunks released right after their last use (policy, laid-out log)
    planned_reads: int = 0         # preads of planned reads (a known order read ahead)
    planned_records: int = 0       # records those reads delivered (checksum verified)
    planned_bytes: int = 0         # bytes those reads read from the logs
    planned_hits: int = 0          # opens served with a record read by a plan
    write_errors: int = 0          # failed log appends (ENOSPC, EIO): served from the source instead
    invariant_violations: int = 0  # --debug-invariants: problems found after commits

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def stats_document(eng: Engine) -> dict:
    """The ``.dlcache/stats`` document (counters since mount; cache state cumulative).
    It reads every part of the engine: the one place that does."""
    snap = eng.index.snapshot()
    out = {
        "version": __version__,
        "pid": os.getpid(),
        "source": os.fsdecode(eng.source.root),
        "mountpoint": eng.cfg.mountpoint,
        "cache_dir": eng.cfg.data_dir,
        "uptime_s": round(time.time() - eng.started, 3),
        "files": snap["files"],
        "bytes_total": snap["bytes_total"],
        "cached_files": snap["records"],
        "cached_bytes": snap["cached_bytes"],
        "chunks": snap["chunks"],
        "chunk_bytes": snap["chunk_bytes"],
        # --cache-size, or with --shared-cache this dataset's share of it now
        "cache_limit_bytes": eng.writer.limit,
        # the disk under the cache: free space, --min-free, a pause after a failed write
        "cache_disk": eng.writer.disk_state(),
        "max_cached_file": eng.cfg.max_cached_file,  # larger files are read through
        "memory_bytes": eng.memtier.bytes,
        "memory_limit_bytes": eng.memtier.limit,
        # the daemon's memory cgroup limit found at start (None: none); --memory and the
        # buffers were sized to fit it (dlcachefs.cache.memlimit)
        "cgroup_memory_limit": eng.memory.cgroup_limit,
        "readahead_limit_bytes": eng.readahead.limit,
        "backlog_limit_bytes": eng.backlog.limit,
        # fetched, not yet in a sealed chunk (waiting for the writer's room included)
        "pending_bytes": eng.writer.open_bytes + eng.writer.sealing_bytes
        + eng.backlog.bytes,
        # the --cache-size account: chunk_bytes - evicting_bytes + reserved_bytes
        # <= cache_limit_bytes (see dlcachefs.cache.writer)
        "reserved_bytes": eng.writer.pending_bytes,
        "evicting_bytes": eng.writer.doomed_bytes,
        # the account itself as the writer keeps it (its "used" follows the index once
        # a commit's bookkeeping is done: chunk_bytes may be ahead meanwhile)
        "cache_account_bytes": eng.writer.account(),
        "open_files": len(eng.handles),
        "revalidate_s": eng.cfg.revalidate,
        # torch loaded (from a training's first contact on, in the background): announced samplers replay
        "sampler_replay_ready": eng.streams.replay_ready,
        "losses_waiting": eng.losses.waiting,
        # trees fetched ahead of readers whose order is unknown (dlcachefs.cache.scanahead)
        "scan_ahead": eng.scan.stats(),
    }
    out.update(eng.counters.as_dict())
    out["cache_disk_bytes_read"] = eng.logs.bytes_read  # every pread of the logs (serving, and background fills)
    # reordered logs' chunks read back (just written) to checksum them before a seal
    out["cache_disk_bytes_read_back"] = eng.logs.bytes_read_back
    out["read_plans"] = eng.plans.stats()
    out["source_latency"] = eng.calls.latency.as_dict()  # seconds per attempt, by call
    # samples training processes read from the cache directly, and their fallbacks.
    # Blocking on the loop on purpose, as the LMDB reads: a listing and two small opens
    # of a local file per reading process (tens of microseconds each), only when stats
    # are read
    out["zerocopy"] = eng.zerocopy.collect()
    out["streams"] = eng.streams.stats()
    for key, rel in eng.scan.tree_of_groups().items():
        if key in out["streams"]:
            out["streams"][key]["scan_ahead"] = rel
    # --shared-cache: the root's budget, this dataset's share, the ledger's entries
    out["shared"] = None if eng.shares is None else eng.shares.stats()
    # --shared-cache dedup: files served from the root's other datasets (bytes_from_datasets)
    out["dedup"] = None if eng.dedup is None else eng.dedup.stats()
    out["policy"] = {"name": eng.cfg.policy, **eng.policy.stats()}
    # the cluster's shared tier (--peers): per server and lease counts
    out["peers"] = None if eng.peers is None else eng.peers.stats()
    if eng.owner_prefetch is not None:  # --peer-self: fetched ahead for the cluster
        out["peers"]["owner_prefetch"] = eng.owner_prefetch.stats()
    out["packer"] = None if eng.packer is None else eng.packer.as_dict()
    t = eng.importance.table
    out["importance"] = None if t is None else {
        "dataset": eng.importance.dataset, "samples": t.n, "version": t.version(),
        "h_samples": None if t.high is None else sum(t.high),
        "jobs": {k: {"reported": j.reported, "benefit": j.benefit}
                 for k, j in t.jobs.items()}}
    return out
