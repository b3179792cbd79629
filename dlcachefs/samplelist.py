"""The ordered sample list of a dataset directory, as torchvision's ImageFolder builds it.

Sampler index ``i`` must name the same file in the training process and in the
filesystem, so this replays ``torchvision.datasets.folder.find_classes`` and
``make_dataset`` over the namespace snapshot (never over the mount itself):

* classes: the sorted names of the root's entries that are directories, following
  symlinks (``os.scandir(root)`` + ``entry.is_dir()``);
* samples: for each class in sorted order, ``sorted(os.walk(class_dir, followlinks=True))``
  (so subdirectories ordered by their full path string), and in each directory its
  non-directory names sorted, kept when ``name.lower()`` ends with one of
  ``IMG_EXTENSIONS``.

Names are compared as Python ``str`` decoded with ``os.fsdecode`` (surrogateescape), the
way torchvision sees them. Symlinks are followed inside the mirror (relative targets, or
absolute ones under the source root); a link that leaves the tree counts as a file.
Pure: reads the snapshot only.
"""

from __future__ import annotations

import os
import posixpath
import stat as stat_mod
from dataclasses import dataclass

from .errors import NotFound
from .namespace import ROOT_INO, Namespace
from .schema import Entry

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

_MAX_LINK_HOPS = 40


@dataclass(frozen=True)
class SampleList:
    """``inos[i]`` is the inode of sample ``i`` (the regular file read; 0 when it is not a
    readable file), ``labels[i]`` its class."""

    root: str
    classes: list[str]
    inos: list[int]
    labels: list[int]
    paths: list[str]  # relative to the dataset root, for diagnostics

    def __len__(self) -> int:
        return len(self.inos)


def _follow(ns: Namespace, e: Entry, rel: str) -> Entry | None:
    """Resolve a symlink entry within the mirror; None when it leaves it or dangles."""
    root_s = os.fsdecode(ns.source.root)
    for _ in range(_MAX_LINK_HOPS):
        if not stat_mod.S_ISLNK(e.mode):
            return e
        target = os.fsdecode(e.target)
        if target.startswith("/"):
            if not (target == root_s or target.startswith(root_s.rstrip("/") + "/")):
                return None
            full = posixpath.normpath(target[len(root_s):].lstrip("/"))
        else:
            full = posixpath.normpath(posixpath.join(posixpath.dirname(rel), target))
        if full.startswith("..") or full.startswith("/"):
            return None
        rel = "" if full == "." else full
        try:
            e = ns.resolve(os.fsencode(rel))
        except (NotFound, OSError):
            return None
        except Exception:  # noqa: BLE001 - NotADirectory on the way
            return None
    return None


def image_folder(ns: Namespace, dataset_rel: str, extensions: tuple[str, ...] = IMG_EXTENSIONS
                 ) -> SampleList:
    """The ImageFolder sample list of the directory ``dataset_rel`` inside the mount."""
    dataset_rel = dataset_rel.strip("/")
    root = ns.resolve(os.fsencode(dataset_rel)) if dataset_rel else ns.get(ROOT_INO)
    root = _follow(ns, root, dataset_rel) or root

    def children(d: Entry) -> list[tuple[str, Entry]]:
        out = []
        for name, ino in ns.index.list_dir(d.ino):
            e = ns.index.get_entry(ino)
            if e is not None:
                out.append((os.fsdecode(name), e))
        return out

    def is_dir(e: Entry, rel: str) -> Entry | None:
        t = _follow(ns, e, rel)
        return t if t is not None and stat_mod.S_ISDIR(t.mode) else None

    classes: list[tuple[str, Entry]] = []
    for name, e in children(root):
        d = is_dir(e, posixpath.join(dataset_rel, name))
        if d is not None:
            classes.append((name, d))
    classes.sort(key=lambda t: t[0])
    inos: list[int] = []
    labels: list[int] = []
    paths: list[str] = []
    for label, (cname, cdir) in enumerate(classes):
        # os.walk(top, followlinks=True), then sorted by the root path string
        walked: list[tuple[str, str, list[tuple[str, Entry]]]] = []
        stack = [(cname, posixpath.join(dataset_rel, cname), cdir)]
        seen = set()
        while stack:
            shown, rel, d = stack.pop()
            if d.ino in seen:  # a symlink loop; os.walk would recurse until ELOOP
                continue
            seen.add(d.ino)
            files = []
            for name, e in children(d):
                sub = is_dir(e, posixpath.join(rel, name))
                if sub is not None:
                    stack.append((shown + "/" + name, posixpath.join(rel, name), sub))
                else:
                    files.append((name, e))
            walked.append((shown, rel, files))
        walked.sort(key=lambda t: t[0])
        for shown, rel, files in walked:
            for name, e in sorted(files, key=lambda t: t[0]):
                if not name.lower().endswith(extensions):
                    continue
                target = _follow(ns, e, posixpath.join(rel, name))
                # torchvision keeps a dangling or odd entry (and fails when it opens it): keep
                # its index too, as inode 0, so that every later index still lines up
                ok = target is not None and stat_mod.S_ISREG(target.mode)
                inos.append(target.ino if ok else 0)
                labels.append(label)
                paths.append(shown + "/" + name)
    return SampleList(dataset_rel, [c for c, _ in classes], inos, labels, paths)
