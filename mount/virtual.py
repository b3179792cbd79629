"""The virtual ``.dlcache/`` directory at the mount root.

Reachable by path (``lookup``) but never listed by ``readdir`` of the root, so that
torchvision's ImageFolder does not take it for a class. Its files:

* ``stats``   (0444) the engine's counters as JSON, a fresh snapshot at each open; other
  users than the mount's owner (with ``--allow-other``) see the mount-wide counters
  only, not the jobs' own sections (:func:`shared_stats`);
* ``control`` (0600, owner only) accepts control lines; reading shows the accepted state;
* ``errors``  (0400, owner only, as the writes it reports) the last refused control writes
  with their reasons;
* ``zerocopy`` (0444) where the cache is, for readers in the training process that read
  cached samples from it directly (:mod:`dlcachefs.data`), as JSON (:func:`zerocopy_info`).

Virtual files are opened with ``direct_io`` (their size is reported as 0, like /proc).
"""

from __future__ import annotations

import json
import os
import stat
import time

from dlcachefs.config import Config
from dlcachefs.store.readonly import INFO_FORMAT
from dlcachefs.store.tally import TALLY_DIR

VDIR_INO = 2
STATS_INO = 3
CONTROL_INO = 4
ERRORS_INO = 5
ZEROCOPY_INO = 6

VDIR_NAME = b".dlcache"
FILES: dict[bytes, int] = {b"stats": STATS_INO, b"control": CONTROL_INO, b"errors": ERRORS_INO,
                           b"zerocopy": ZEROCOPY_INO}
MODES: dict[int, int] = {
    VDIR_INO: stat.S_IFDIR | 0o555,
    STATS_INO: stat.S_IFREG | 0o444,
    CONTROL_INO: stat.S_IFREG | 0o600,
    ERRORS_INO: stat.S_IFREG | 0o400,  # the owner's refused writes (control is theirs)
    ZEROCOPY_INO: stat.S_IFREG | 0o444,
}
VIRTUAL = frozenset(MODES)

#: file handles of virtual files live above this, apart from the engine's
VFH_BASE = 1 << 62


class VirtualAttrs:
    """Owner and times of the virtual entries (the mounting user, the mount time)."""

    def __init__(self) -> None:
        self.uid = os.getuid()
        self.gid = os.getgid()
        self.time_ns = time.time_ns()


#: sections of ``stats`` that belong to the jobs (their streams: names, positions, stalls,
#: bytes; their datasets' importance; the trees their unannounced reads scan ahead in),
#: shown to the mount's owner (and root) only
JOB_SECTIONS = ("streams", "importance", "scan_ahead")


def shared_stats(stats: dict) -> dict:
    """``stats`` as another user sees it: the mount-wide counters, no job's sections."""
    return {k: v for k, v in stats.items() if k not in JOB_SECTIONS}


def zerocopy_info(cfg: Config) -> bytes:
    """The ``zerocopy`` file: the cache's index and logs (read-only for readers), where
    readers count (:mod:`dlcachefs.store.tally`), and the freshness window the mount's
    opens apply (``--revalidate``), which readers apply too."""
    return (json.dumps({
        "format": INFO_FORMAT,
        "cache_dir": cfg.data_dir,
        "index_dir": cfg.index_dir,
        "logs_dir": cfg.logs_dir,
        "tally_dir": os.path.join(cfg.data_dir, TALLY_DIR),
        "revalidate_s": cfg.revalidate,
        "mountpoint": cfg.mountpoint,
        "pid": os.getpid(),
    }, indent=2) + "\n").encode()
