"""Zero-copy reads of a dlcachefs mount from the training process (issue 11).

The mount stays the way in for unmodified scripts; this package is the fast lane for
scripts that opt in: samples already in the cache are read straight from the cache
directory (the daemon's LMDB index opened read-only, one ``pread`` of the record, its
checksum checked), without a FUSE request; everything else is read through the mount.

* :class:`CachedImageFolder` (:mod:`dlcachefs.data.folder`): a drop-in for torchvision's
  ``ImageFolder`` over a mounted path, with ``read_bytes(i)`` / ``read_array(i)`` for
  custom loaders. Needs torchvision (imported when the class is first used).
* :class:`CacheReader` (:mod:`dlcachefs.data.reader`): ``read(path) -> bytes`` for any
  file of a mount; no torch. The safety protocol is written there.

Both read the same cache as the mount; the daemon stays its only writer. This package
runs in the training process: it imports lmdb and the store's format, never trio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dlcachefs.data.reader import CacheReader, find_mount

if TYPE_CHECKING:
    from dlcachefs.data.folder import CachedImageFolder, decode_image

__all__ = ["CacheReader", "CachedImageFolder", "decode_image", "find_mount"]


def __getattr__(name: str):
    if name in ("CachedImageFolder", "decode_image"):  # torchvision only when asked for
        from dlcachefs.data import folder

        return getattr(folder, name)
    raise AttributeError(f"module 'dlcachefs.data' has no attribute {name!r}")
