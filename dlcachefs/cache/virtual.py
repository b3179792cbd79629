"""The virtual ``.dlcache/`` directory at the mount root: its entries, its open files and
what they hold.

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
What the files show comes from outside the cache (the control state, the stats document),
through :class:`ControlFile` and callables given to :class:`VirtualDir`.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from collections.abc import Callable
from typing import Protocol

from dlcachefs.cache.namespace import ROOT_INO
from dlcachefs.config import Config
from dlcachefs.errors import IsADirectory, NotFound, PermissionDenied, ReadOnly
from dlcachefs.store.integrity import log_failure
from dlcachefs.store.readonly import INFO_FORMAT
from dlcachefs.store.schema import Entry
from dlcachefs.store.tally import SOUND_FILE, TALLY_DIR

log = logging.getLogger(__name__)

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

#: seconds the kernel may keep the virtual entries and their attributes
TIMEOUT = 1.0


class ControlFile(Protocol):
    """What ``.dlcache/control`` and ``.dlcache/errors`` need of the control state
    (:class:`dlcachefs.clairvoyance.control.ControlState`)."""

    def apply(self, data: bytes, pid: int) -> int:
        """Apply one write of process ``pid`` whole (its length) or refuse it whole
        (:class:`~dlcachefs.errors.ControlError`)."""
        ...

    def state_text(self) -> bytes:
        """The accepted state, as ``control`` shows it when read."""
        ...

    def errors_text(self) -> bytes:
        """The last refused writes with their reasons."""
        ...


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
        "sound": os.path.join(cfg.data_dir, SOUND_FILE),
        # substitution decides at open which file's bytes an open gets: opens stay the
        # mount's then (dlcachefs.data.intercept)
        "intercept": not cfg.substitute,
        "mountpoint": cfg.mountpoint,
        "pid": os.getpid(),
    }, indent=2) + "\n").encode()


class _Handle:
    __slots__ = ("ino", "data", "pid")

    def __init__(self, ino: int, data: bytes, pid: int) -> None:
        self.ino, self.data, self.pid = ino, data, pid


class VirtualDir:
    """The ``.dlcache/`` directory: entries, opens, reads and control writes.

    ``stats`` builds the stats document at each open of ``stats``; ``on_control_open`` is
    called at each open of ``control`` (a training process is here: the sampler replay
    worker starts then, see :meth:`dlcachefs.clairvoyance.streams.StreamManager.start_replay`).
    """

    def __init__(self, cfg: Config, control: ControlFile, stats: Callable[[], dict],
                 on_control_open: Callable[[], None]) -> None:
        self.cfg = cfg
        self.control = control
        self._stats = stats
        self._on_control_open = on_control_open
        self.owner = VirtualAttrs()
        self._handles: dict[int, _Handle] = {}
        self._next_fh = VFH_BASE
        o = self.owner
        self._entries = {
            ino: Entry(ino=ino, parent=ROOT_INO if ino == VDIR_INO else VDIR_INO,
                       name=VDIR_NAME if ino == VDIR_INO else _name_of(ino), mode=mode,
                       nlink=2 if ino == VDIR_INO else 1, uid=o.uid, gid=o.gid, size=0,
                       blocks=0, rdev=0, atime_ns=o.time_ns, mtime_ns=o.time_ns,
                       ctime_ns=o.time_ns, src_ino=0, checked_at=0.0)
            for ino, mode in MODES.items()}

    @staticmethod
    def is_lookup(parent: int, name: bytes) -> bool:
        """Whether a lookup of ``name`` in ``parent`` is one of the virtual directory's."""
        return (parent == ROOT_INO and name == VDIR_NAME) or parent == VDIR_INO

    def entry(self, ino: int) -> Entry:
        """The attributes of virtual inode ``ino`` (size 0, like /proc)."""
        return self._entries[ino]

    def lookup(self, parent: int, name: bytes) -> Entry:
        if parent == ROOT_INO and name == VDIR_NAME:
            return self._entries[VDIR_INO]
        if name in FILES:
            return self._entries[FILES[name]]
        raise NotFound(os.fsdecode(name))

    def listing(self) -> list[tuple[bytes, int]]:
        return [(b".", VDIR_INO), (b"..", ROOT_INO), *sorted(FILES.items())]

    def may_write(self, ino: int) -> bool:
        """Only ``control`` is writable (and truncated to 0 by ``echo ... >``)."""
        return ino == CONTROL_INO

    def open(self, ino: int, writing: bool, uid: int, pid: int) -> int:
        """Open virtual file ``ino`` for process ``pid`` of user ``uid``: its handle. What
        a read shows is taken now (a snapshot)."""
        if ino == VDIR_INO:
            raise IsADirectory(".dlcache")
        if writing and ino != CONTROL_INO:
            raise ReadOnly("only .dlcache/control is writable")
        owner = uid in (self.owner.uid, 0)
        if ino == CONTROL_INO and not owner:
            raise PermissionDenied("the control file belongs to the mount's owner")
        if ino == CONTROL_INO:
            # a training process is here (the hook opens it at interpreter start): the
            # sampler replay worker imports torch while the script imports its own
            try:
                self._on_control_open()
            except Exception:  # noqa: BLE001 - never fail the open for it (unmounting)
                log_failure(log, "starting the sampler replay worker failed")
        if ino == STATS_INO:
            doc = self._stats()
            if not owner:
                doc = shared_stats(doc)  # another user's job sees no job's own sections
            data = (json.dumps(doc, indent=2) + "\n").encode()
        elif ino == ERRORS_INO:
            data = self.control.errors_text()
        elif ino == ZEROCOPY_INO:
            data = zerocopy_info(self.cfg)
        else:
            data = b"" if writing else self.control.state_text()
        fh = self._next_fh
        self._next_fh += 1
        self._handles[fh] = _Handle(ino, data, pid)
        return fh

    def read(self, fh: int, off: int, size: int) -> bytes:
        return self._handles[fh].data[off : off + size]

    def write(self, fh: int, data: bytes) -> int:
        """A write to an open virtual file: the control file applies it whole."""
        h = self._handles.get(fh)
        if h is None or h.ino != CONTROL_INO:
            raise ReadOnly("read-only mirror")
        return self.control.apply(data, h.pid)

    def release(self, fh: int) -> None:
        self._handles.pop(fh, None)


def _name_of(ino: int) -> bytes:
    return next(name for name, i in FILES.items() if i == ino)
