"""Counters since mount: the mount-wide numbers of the ``.dlcache/stats`` document
(which :meth:`dlcachefs.session.Session.stats` builds from every part).

Counters are updated on the trio loop only.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


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
    record_reads_in_memory: int = 0  # of record_reads, those whose log pages were in memory:
                                     # copied on the loop, no thread hop (LogStore.read_cached)
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
    planned_advised_bytes: int = 0  # asked into the page cache for in-process readers
    planned_posted_bytes: int = 0  # or posted for them to ask themselves (store.advice)
    planned_lagged: int = 0        # batches asked by the daemon: the readers took no posts
    planned_hits: int = 0          # opens served with a record read by a plan
    write_errors: int = 0          # failed log appends (ENOSPC, EIO): served from the source instead
    invariant_violations: int = 0  # --debug-invariants: problems found after commits

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
