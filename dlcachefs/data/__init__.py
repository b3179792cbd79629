"""What runs in the training process: the fast lane to the cache and the torch hook.

The mount stays the way in for unmodified scripts; this package is what a training
process runs itself, beside the mount:

* zero-copy reads of cached samples (:mod:`dlcachefs.data.reader`,
  :class:`CacheReader`: ``read(path) -> bytes`` for any file of a mount, no torch; the
  daemon's LMDB index opened read-only, one ``pread`` of the record, its checksum
  checked, the mount as the fallback; the safety protocol is written there) and
  :class:`CachedImageFolder` (:mod:`dlcachefs.data.folder`): a drop-in for torchvision's
  ``ImageFolder`` over a mounted path, with ``read_bytes(i)`` / ``read_array(i)`` for
  custom loaders (torchvision is imported when the class is first used);
* the torch hook (:mod:`dlcachefs.data.hook`, public as :mod:`dlcachefs.torch`): announces
  the samplers of DataLoaders over a mount to its control file; the dataset found behind
  wrappers (:mod:`dlcachefs.data.wrappers`); the ``dlcachefs run`` launcher's
  ``sitecustomize`` (``_boot``).

Both read the same cache as the mount; the daemon stays its only writer. Nothing here
imports trio; lmdb only with the reader (this package's names are loaded when first used:
the hook, loaded in every process of a training, imports neither lmdb nor torch before the
training did).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dlcachefs.data.folder import CachedImageFolder, decode_image
    from dlcachefs.data.reader import CacheReader, find_mount

__all__ = ["CacheReader", "CachedImageFolder", "decode_image", "find_mount"]


def __getattr__(name: str):
    if name in ("CacheReader", "find_mount"):  # lmdb only when asked for
        from dlcachefs.data import reader

        return getattr(reader, name)
    if name in ("CachedImageFolder", "decode_image"):  # torchvision only when asked for
        from dlcachefs.data import folder

        return getattr(folder, name)
    raise AttributeError(f"module 'dlcachefs.data' has no attribute {name!r}")
