"""``CachedImageFolder``: torchvision's ``ImageFolder`` over a dlcachefs mount, reading its
samples straight from the cache (:mod:`dlcachefs.data.reader`).

    from dlcachefs.data import CachedImageFolder
    ds = CachedImageFolder("/mnt/imagenet/train", transform=tf)   # the mounted path
    loader = DataLoader(ds, batch_size=256, shuffle=True, num_workers=8)

It IS an ImageFolder (a subclass): the class list, ``samples``, ``targets`` and
``class_to_idx`` are ImageFolder's own, made by listing the mounted path, so they are
the same as ``ImageFolder(path)``'s, and ``dlcachefs run`` / :mod:`dlcachefs.torch`
recognise it (announced samplers, views, losses). Only the reading of a sample differs:
``__getitem__`` gets the file's bytes from the cache when its current version is there
(else one ``open`` + ``read`` through the mount, which caches it as usual) and decodes
them from memory. The bytes are the file's bytes either way.

Decoding: ``decode(data)`` turns a sample's bytes (a ``bytes`` object) into the sample;
the default is PIL's, as torchvision's ``pil_loader`` (``Image.open`` + ``convert("RGB")``).
``io.BytesIO`` shares a ``bytes`` object rather than copying it (CPython copies any
other buffer, a ``memoryview`` included), so decoding reads the bytes ``pread`` returned,
with no copy on our side. A ``loader`` (a function of a path, as ImageFolder takes) is
still accepted: then samples are read by it, through the mount, as ImageFolder would.

Not on a dlcachefs mount (or with ``zero_copy=False``) it reads the files directly and
behaves as ImageFolder.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from typing import Any

from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import default_loader

from dlcachefs.data.reader import CacheReader


def decode_image(data: bytes | memoryview) -> Any:
    """A sample's bytes as an RGB PIL image (what torchvision's ``pil_loader`` makes of
    the file)."""
    from PIL import Image

    img = Image.open(io.BytesIO(data))
    return img.convert("RGB")


class CachedImageFolder(ImageFolder):
    """An ``ImageFolder`` whose samples are read from the dlcachefs cache directly.

    Same arguments as ``ImageFolder`` (``transform``, ``target_transform``, ``loader``,
    ``is_valid_file``, ``allow_empty`` ...), plus, keyword-only:

    * ``decode``: bytes -> sample, used unless ``loader`` is given (default
      :func:`decode_image`);
    * ``zero_copy``: False reads every sample through the path (as ImageFolder).
    """

    def __init__(self, root: str | os.PathLike, transform: Callable | None = None,
                 target_transform: Callable | None = None,
                 loader: Callable[[str], Any] | None = None,
                 is_valid_file: Callable[[str], bool] | None = None, *,
                 decode: Callable[[bytes], Any] | None = None, zero_copy: bool = True,
                 **kwargs: Any) -> None:
        super().__init__(root, transform=transform, target_transform=target_transform,
                         loader=loader if loader is not None else default_loader,
                         is_valid_file=is_valid_file, **kwargs)
        self.path_loader = loader is not None
        self.decode = decode if decode is not None else decode_image
        self.reader: CacheReader | None = CacheReader.for_path(root) if zero_copy else None

    def _bytes(self, path: str) -> bytes:
        if self.reader is not None:
            return self.reader.read(path)
        with open(path, "rb") as f:
            return f.read()

    def read_bytes(self, index: int) -> memoryview:
        """Sample ``index``'s file bytes, as a read-only view (no copy is made: the view
        owns the ``bytes`` read; keep it as long as you like)."""
        return memoryview(self._bytes(self.samples[index][0]))

    def read_array(self, index: int):
        """Sample ``index``'s file bytes as a read-only ``numpy.uint8`` array (a view of
        the bytes read, no copy)."""
        import numpy as np

        return np.frombuffer(self._bytes(self.samples[index][0]), dtype=np.uint8)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        path, target = self.samples[index]
        sample = self.loader(path) if self.path_loader else self.decode(self._bytes(path))
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target

    def cache_counts(self) -> dict[str, int] | None:
        """This process's zero-copy counts (hits, fallbacks by reason); None when the
        dataset is not read from a dlcachefs cache. The mount's stats sum every
        process's under ``zerocopy``."""
        return self.reader.counts() if self.reader is not None else None
