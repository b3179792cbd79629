"""A running mount's ``.dlcache/`` directory, read from outside (the CLI's ``stats``,
``top``, ``advise``, ``warmup``, ``umount``): its stats and its cache description.

Both are files of the mount's virtual ``.dlcache/`` directory
(``dlcachefs/cache/virtual.py``); each read is a fresh snapshot the daemon builds on its
event loop. Standard library only.
"""

from __future__ import annotations

import errno
import json
import os

VDIR = ".dlcache"  # the mount's own directory at its root (cache/virtual.py)


class NotAMount(ValueError):
    """The path is not the root of a dlcachefs mount (no ``.dlcache/stats``)."""


def read_json(mnt: str, name: str) -> dict:
    """``MNT/.dlcache/NAME`` as JSON; :class:`NotAMount` when it cannot be read."""
    path = os.path.join(mnt, VDIR, name)
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except OSError as e:
        if e.errno == errno.ENOTCONN:  # the daemon was killed: its mount is left behind
            raise NotAMount(f"{mnt}: the daemon of this mount is gone ({e.strerror}); "
                            f"'dlcachefs umount {mnt}' clears it, 'dlcachefs mount' mounts "
                            "it again") from None
        raise NotAMount(f"{mnt} is not a dlcachefs mount ({path}: {e.strerror or e})"
                        ) from None
    except ValueError as e:
        raise NotAMount(f"{mnt} is not a dlcachefs mount ({path}: {e})") from None


def stats(mnt: str) -> dict:
    """The mount's ``.dlcache/stats`` document."""
    return read_json(mnt, "stats")


def cache_info(mnt: str) -> dict:
    """The mount's ``.dlcache/zerocopy`` document (index and logs directories,
    ``revalidate_s``)."""
    return read_json(mnt, "zerocopy")
