"""The one frozen configuration of a mount. The CLI and the fstab helper both build it."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass


def default_cache_dir(source: str) -> str:
    """``$XDG_CACHE_HOME/dlcachefs/<name>-<hash of the source's real path>``.

    One cache per source: mounting the same source again finds its cache; two sources
    with the same base name do not collide.
    """
    real = os.path.realpath(source)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    tag = hashlib.sha256(os.fsencode(real)).hexdigest()[:12]
    name = os.path.basename(real.rstrip("/")) or "root"
    return os.path.join(base, "dlcachefs", f"{name}-{tag}")


@dataclass(frozen=True)
class Config:
    """Everything a mount is configured with. Sizes in bytes, times in seconds."""

    source: str
    mountpoint: str
    cache_dir: str
    cache_size: int = 200 << 30
    chunk_size: int = 16 << 20
    memory: int = 1 << 30            # in-memory chunk tier
    min_free: int = 1 << 30          # free-space floor on the cache disk
    log_size: int = 1 << 30          # a new log file starts past this size
    revalidate: float = 3600.0       # see dlcachefs.namespace for the rule
    rescan: bool = False
    use_source_inode: bool = True
    source_threads: int = 16
    source_timeout: float = 60.0
    source_retries: int = 2
    flush_interval: float = 2.0      # a partly filled chunk is sealed after this long
    max_cached_file: int = 256 << 20  # larger files are read through, never cached
    policy: str = "lru"              # NAME[:key=value,...], see dlcachefs.policies
    substitute: bool = False         # iCACHE substitution of missed L-samples
    h_fraction: float = 0.7          # share of the dataset in the H-list (by importance)
    trace: str | None = None         # record the streams' reads here (dlcachefs simulate)
    scan_ahead: int = 4              # fetches in flight ahead of readers with no known order
    reorder: bool = True             # LCache log reordering for streams with a known next order
    allow_other: bool = False
    foreground: bool = False
    log_level: str = "info"
    debug_invariants: bool = False

    def __post_init__(self) -> None:
        if self.chunk_size < 4096:
            raise ValueError("--chunk-size must be at least 4K")
        if self.revalidate < 0:
            raise ValueError("--revalidate must be >= 0")
        if self.source_timeout <= 0:
            raise ValueError("--source-timeout must be > 0")
        if self.source_threads < 1:
            raise ValueError("--source-threads must be >= 1")
        if self.scan_ahead < 0:
            raise ValueError("--scan-ahead must be >= 0")
        if not 0.0 < self.h_fraction <= 1.0:
            raise ValueError("--h-fraction must be within (0, 1]")

    @property
    def index_dir(self) -> str:
        return os.path.join(self.cache_dir, "meta.lmdb")

    @property
    def logs_dir(self) -> str:
        return os.path.join(self.cache_dir, "logs")
