"""The virtual ``.dlcache/`` directory at the mount root.

Reachable by path (``lookup``) but never listed by ``readdir`` of the root, so that
torchvision's ImageFolder does not take it for a class. Its files:

* ``stats``   (0444) the engine's counters as JSON, a fresh snapshot at each open;
* ``control`` (0600, owner only) accepts control lines; reading shows the accepted state;
* ``errors``  (0444) the last refused control writes with their reasons.

Virtual files are opened with ``direct_io`` (their size is reported as 0, like /proc).
"""

from __future__ import annotations

import os
import stat
import time

VDIR_INO = 2
STATS_INO = 3
CONTROL_INO = 4
ERRORS_INO = 5

VDIR_NAME = b".dlcache"
FILES: dict[bytes, int] = {b"stats": STATS_INO, b"control": CONTROL_INO, b"errors": ERRORS_INO}
MODES: dict[int, int] = {
    VDIR_INO: stat.S_IFDIR | 0o555,
    STATS_INO: stat.S_IFREG | 0o444,
    CONTROL_INO: stat.S_IFREG | 0o600,
    ERRORS_INO: stat.S_IFREG | 0o444,
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
