"""What the CLI reads of a running mount: its stats and its cache description.

Both are files of the mount's virtual ``.dlcache/`` directory (``mount/virtual.py``); each
read is a fresh snapshot the daemon builds on its event loop. Standard library only.
"""

from __future__ import annotations

import json
import os


class NotAMount(ValueError):
    """The path is not the root of a dlcachefs mount (no ``.dlcache/stats``)."""


def read_json(mnt: str, name: str) -> dict:
    """``MNT/.dlcache/NAME`` as JSON; :class:`NotAMount` when it cannot be read."""
    path = os.path.join(mnt, ".dlcache", name)
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError) as e:
        raise NotAMount(f"{mnt} is not a dlcachefs mount ({path}: "
                        f"{getattr(e, 'strerror', None) or e})") from None


def stats(mnt: str) -> dict:
    """The mount's ``.dlcache/stats`` document."""
    return read_json(mnt, "stats")


def cache_info(mnt: str) -> dict:
    """The mount's ``.dlcache/zerocopy`` document (index and logs directories,
    ``revalidate_s``)."""
    return read_json(mnt, "zerocopy")
