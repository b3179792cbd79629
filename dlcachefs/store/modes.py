"""Who may read the cache directory: its own modes, whatever the umask.

A cache directory holds the bytes of every cached file, whatever the source's modes, and
its index names every file of the source with its size, times and checksums. So it is
its owner's alone: directories 0700, files 0600 (:data:`OWNER_ONLY`). A reader group
(``--reader-group``) opens it to the zero-copy readers of one group
(:meth:`CacheModes.wanted`): directories 2750 (setgid: what is made in them later is the
group's too), files 0640; ``zerocopy/`` 3770 (the readers make their counter files in
it; sticky: none removes another's), ``meta.lmdb/lock.mdb`` 0660 (LMDB's reader table,
which a read-only environment opens for writing); the daemon's own files (its lock, a
shared root's ledger and its lock) stay 0600, as no reader opens them.

Three things keep it so:

* the store makes what it creates owner-only (``DIR_MODE``, ``FILE_MODE``), or with the
  group's read bit where the directory it is made in grants it (:func:`file_mode_in`: a
  new log in a group-readable ``logs/``), whatever the umask;
* the daemon's umask (:meth:`CacheModes.umask`) covers what other code creates there
  (its log file as it rotates, the index's clean marker, a ledger being replaced);
* at start, :func:`enforce` walks the whole directory and sets every entry it owns to
  the modes above: a directory made by hand, under another umask or by an older version
  is tightened (the caller warns of it), and the group's bits and group are given.

The walk never follows a symlink and changes an entry only through a descriptor of what
it checked (``O_PATH``), so an entry swapped for a link meanwhile is not what it changes;
it leaves alone entries owned by another user (a group member's counter file) and files
with more than one link (the cache makes none: a hard link made by someone else). Blocking
code.
"""

from __future__ import annotations

import contextlib
import grp
import os
import stat
from dataclasses import dataclass, field

from dlcachefs.errors import DlcError
from dlcachefs.store.advice import BOARD
from dlcachefs.store.ledger import LEDGER, LEDGER_LOCK
from dlcachefs.store.lock import LOCK_NAME
from dlcachefs.store.tally import TALLY_DIR

#: what the store makes: directories and files for the owner alone (see the module doc)
DIR_MODE = 0o700
FILE_MODE = 0o600
#: the files a reader opens for writing: LMDB's lock table
LMDB_LOCK = "lock.mdb"
#: and the read-ahead board (:mod:`dlcachefs.store.advice`: readers note what they took)
GROUP_WRITABLE = frozenset({LMDB_LOCK, BOARD})
#: the daemon's own files, 0600 even with a reader group (no reader opens them)
PRIVATE = frozenset({LOCK_NAME, LEDGER, LEDGER_LOCK})
#: the bits that let someone other than the owner in
OTHERS = 0o077
_MODE_BITS = 0o7777


@dataclass(frozen=True)
class CacheModes:
    """The modes a cache directory's entries must have: the owner's alone, or readable by
    the reader group ``gid`` (named ``group``)."""

    gid: int | None = None
    group: str | None = None

    @property
    def umask(self) -> int:
        """The daemon's umask (:func:`daemon_umask`)."""
        return daemon_umask(self.gid is not None)

    def wanted(self, name: str, is_dir: bool) -> int:
        """The mode of an entry called ``name`` (a directory if ``is_dir``)."""
        if self.gid is None:
            return DIR_MODE if is_dir else FILE_MODE
        if is_dir:
            # the readers make their counter files in zerocopy/ (sticky: each removes only
            # its own; the daemon, the directory's owner, removes those of ended readers)
            return 0o3770 if name == TALLY_DIR else 0o2750
        if name in PRIVATE or _is_ledger_temp(name):
            return FILE_MODE
        if name in GROUP_WRITABLE:
            return 0o660
        return 0o640

    def describe(self) -> str:
        """The rule in words, for messages."""
        if self.gid is None:
            return "owner-only (directories 0700, files 0600)"
        return (f"the owner's and readable by group {self.group} (directories 2750, "
                f"files 0640, {TALLY_DIR}/ 3770, {LMDB_LOCK} and {TALLY_DIR}/{BOARD} 0660, "
                f"the daemon's own 0600)")


def daemon_umask(reader_group: bool) -> int:
    """The umask of a daemon: nothing for group or others, or read for its reader group
    (what it makes outside the cache directory, a ``--trace`` file, follows it too)."""
    return 0o027 if reader_group else 0o077


def _is_ledger_temp(name: str) -> bool:
    return name.startswith(LEDGER + ".") and name.endswith(".tmp")


def reader_group(name: str | None) -> CacheModes:
    """The modes of ``--reader-group name`` (None: owner-only). Raises DlcError when the
    group does not exist or this user cannot give a directory to it (``chgrp`` needs
    membership, or root)."""
    if name is None:
        return CacheModes()
    try:
        g = grp.getgrgid(int(name)) if name.isdigit() else grp.getgrnam(name)
    except (KeyError, ValueError, OverflowError):
        raise DlcError(f"--reader-group {name}: no such group") from None
    if os.geteuid() != 0 and g.gr_gid not in (os.getegid(), *os.getgroups()):
        raise DlcError(f"--reader-group {name}: this user is not a member of it, so it "
                       "cannot give the cache directory to it (only root can)")
    return CacheModes(g.gr_gid, g.gr_name)


def file_mode_in(directory: str) -> int:
    """The mode of a file to make in ``directory``: 0640 where the directory grants its
    group read and search (a reader group's), else 0600."""
    try:
        m = os.stat(directory).st_mode
    except OSError:
        return FILE_MODE
    return 0o640 if m & 0o050 == 0o050 else FILE_MODE


def mode_text(mode: int) -> str:
    """``0755``, ``2750``: a mode as ``chmod`` takes it."""
    return f"{mode & _MODE_BITS:04o}"


@dataclass
class Findings:
    """What :func:`enforce` found and did."""

    #: entries that let other users in beyond the rule: (path, mode found), all of them
    loose: list[tuple[str, int]] = field(default_factory=list)
    #: entries changed (modes tightened or given, group given)
    changed: int = 0
    #: entries that could not be checked or changed: (path, reason)
    failed: list[tuple[str, str]] = field(default_factory=list)
    #: entries owned by another user or with other links, left as they are
    foreign: list[str] = field(default_factory=list)


def enforce(top: str, modes: CacheModes, keep: bool = False) -> Findings:
    """Walk ``top`` (a cache directory or a shared root, itself included) and give every
    entry the modes of ``modes`` (and its group). With ``keep``, nothing is taken away:
    the group's bits and group are given, loose entries are only reported."""
    found = Findings()
    try:
        pfd = os.open(top, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        found.failed.append((top, e.strerror or str(e)))
        return found
    try:
        _visit(pfd, top, os.path.basename(top.rstrip("/")), modes, keep, found)
    finally:
        os.close(pfd)
    return found


def _visit(pfd: int, path: str, name: str, modes: CacheModes, keep: bool,
           found: Findings) -> None:
    """Check and fix the entry open as ``pfd`` (an ``O_PATH`` descriptor), then the
    entries of a directory."""
    try:
        st = os.fstat(pfd)
    except OSError as e:
        found.failed.append((path, e.strerror or str(e)))
        return
    is_dir = stat.S_ISDIR(st.st_mode)
    if not (is_dir or stat.S_ISREG(st.st_mode)):
        return  # a link, a socket...: the cache makes none; never followed
    if st.st_uid != os.geteuid() or (not is_dir and st.st_nlink > 1):
        # another user's (a group member's counter file; under a root daemon too: it
        # stays theirs), or a hard link someone made to a file of ours elsewhere
        found.foreign.append(path)
        return
    want = modes.wanted(name, is_dir)
    have = st.st_mode & _MODE_BITS
    if have & ~want & OTHERS:
        found.loose.append((path, have))
    new = (have | want) if keep else want
    via = f"/proc/self/fd/{pfd}"  # this very inode, never a link swapped in since
    try:
        changed = False
        if modes.gid is not None and st.st_gid != modes.gid:
            os.chown(via, -1, modes.gid)  # (clears setgid bits: the chmod comes after)
            changed = True
        if new != have or changed:
            os.chmod(via, new)
            changed = True
        found.changed += changed
    except OSError as e:
        found.failed.append((path, e.strerror or str(e)))
        return
    if not is_dir:
        return
    try:
        dfd = os.open(via, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        found.failed.append((path, e.strerror or str(e)))
        return
    try:
        with os.scandir(dfd) as it:
            names = [e.name for e in it]
        for n in names:
            try:
                cfd = os.open(n, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            except FileNotFoundError:
                continue  # removed meanwhile (a log deleted, a reader's counter file)
            except OSError as e:
                found.failed.append((os.path.join(path, n), e.strerror or str(e)))
                continue
            try:
                _visit(cfd, os.path.join(path, n), n, modes, keep, found)
            finally:
                os.close(cfd)
    except OSError as e:
        found.failed.append((path, e.strerror or str(e)))
    finally:
        os.close(dfd)


def unreachable(path: str, modes: CacheModes) -> str | None:
    """With a reader group: the first directory above ``path`` that its members may not
    search (neither others nor, if it is the group's, the group have ``x``), shown with
    its mode; None when every one lets them through (or there is no group)."""
    if modes.gid is None:
        return None
    d = os.path.dirname(os.path.abspath(path))
    chain = []
    while True:
        chain.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    for d in reversed(chain):
        with contextlib.suppress(OSError):
            st = os.stat(d)
            if not (st.st_mode & 0o001 or (st.st_gid == modes.gid and st.st_mode & 0o010)):
                return f"{d} ({mode_text(st.st_mode)})"
    return None
