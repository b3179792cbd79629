"""The ordered sample list of a dataset directory, as torchvision's ImageFolder builds it
(:func:`image_folder`), or timm's folder reader (:func:`timm_folder`).

Sampler index ``i`` must name the same file in the training process and in the
filesystem, so this replays ``torchvision.datasets.folder.find_classes`` and
``make_dataset`` over the namespace snapshot (never over the mount itself):

* classes: the sorted names of the root's entries that are directories, following
  symlinks (``os.scandir(root)`` + ``entry.is_dir()``);
* samples: for each class in sorted order, ``sorted(os.walk(class_dir, followlinks=True))``
  (so subdirectories ordered by their full path string), and in each directory its
  non-directory names sorted, kept when ``name.lower()`` ends with one of
  ``IMG_EXTENSIONS``.

timm's ``find_images_and_targets`` (``timm.data.readers.reader_image_folder``, timm 0.9
to 1.0) builds another list over the same tree:

* ``os.walk(root, topdown=False, followlinks=True)``: files of every directory, the root's
  own included, a directory's after those of its subdirectories, each directory's in
  listing order (the mount's: by name bytes), kept when ``splitext(name)[1].lower()`` is
  one of its types;
* a sample's class is the name of the directory holding it (``''`` for the root's own
  files), the classes sorted by ``natural_key``;
* the samples sorted (stably) by ``natural_key`` of their paths (``img2`` before
  ``img10``), unless its ``sort`` flag is off.

Names are compared as Python ``str`` decoded with ``os.fsdecode`` (surrogateescape), the
way torchvision and timm see them. Symlinks are followed inside the mirror (relative targets, or
absolute ones under the source root); a link that leaves the tree counts as a file.
Pure: reads the snapshot only.
"""

from __future__ import annotations

import os
import re
import stat as stat_mod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dlcachefs.cache.namespace import ROOT_INO, Namespace
from dlcachefs.errors import NotFound
from dlcachefs.store.schema import Entry

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

_MAX_LINK_HOPS = 40
_DIGITS = re.compile(r"(\d+)")


def natural_key(name: str) -> list[int | str]:
    """timm's ``timm.utils.misc.natural_key``: the name lower-cased, its digit runs as
    numbers (``img2`` before ``img10``). The same code, not an import: the daemon does
    not import timm."""
    return [int(t) if t.isdigit() else t for t in _DIGITS.split(name.lower())]


def keeper(extensions: tuple[str, ...] | None, suffixes: tuple[str, ...] | None = None
           ) -> Callable[[str], bool] | None:
    """Which file names a list keeps: a DatasetFolder's ``extensions`` (torchvision's
    test, ``name.lower().endswith``), else the ``suffixes`` of the training's files
    (``splitext``, timm's test), else every file (None)."""
    if extensions is not None:
        return lambda name: name.lower().endswith(extensions)
    if suffixes is not None:
        wanted = frozenset(suffixes)
        return lambda name: os.path.splitext(name)[1].lower() in wanted
    return None


@dataclass(frozen=True)
class SampleList:
    """``inos[i]`` is the inode of sample ``i`` (the regular file read; 0 when it is not a
    readable file), ``labels[i]`` its class."""

    root: str
    classes: list[str]
    inos: list[int]
    labels: list[int]
    paths: list[str]  # relative to the dataset root, for diagnostics
    nbytes: int = 0  # total size of the samples' files (a file listed twice counts twice)

    def __len__(self) -> int:
        return len(self.inos)

    def members(self) -> frozenset[int] | None:
        """The samples' inodes as a set, once :meth:`build_members` made it (else None:
        1.28M inodes take ~0.2 s, never on the trio loop)."""
        return self.__dict__.get("_members")

    def build_members(self) -> frozenset[int]:
        """Make (once) and return :meth:`members`. Blocking: a thread."""
        m = self.__dict__.get("_members")
        if m is None:
            m = frozenset(self.inos)
            object.__setattr__(self, "_members", m)
        return m

    def covers(self, ino: int) -> bool | None:
        """Whether ``ino`` is one of the samples; None until :meth:`build_sorted` (or
        :meth:`build_members`) made the lookup (never built on the trio loop). Trio loop:
        a binary search, ~1 us."""
        m = self.__dict__.get("_members")
        if m is not None:
            return ino in m
        arr = self.__dict__.get("_sorted_inos")
        if arr is None:
            return None
        i = int(np.searchsorted(arr, ino))
        return i < len(arr) and int(arr[i]) == ino

    def build_sorted(self) -> None:
        """Make (once) the lookup :meth:`covers` uses: the samples' inodes sorted (8 bytes
        each: a set would take ~50). Blocking: a thread."""
        if "_sorted_inos" not in self.__dict__:
            object.__setattr__(self, "_sorted_inos", np.unique(self.inos_array()))

    def inos_array(self) -> np.ndarray:
        """``inos`` as an int64 array (made once; used to map orders to inodes fast)."""
        arr = self.__dict__.get("_inos_array")
        if arr is None:
            arr = np.asarray(self.inos, dtype=np.int64)
            object.__setattr__(self, "_inos_array", arr)
        return arr


def _realpath(ns: Namespace, parts: list[str]) -> Entry | None:
    """Resolve a path (components from the mirror's root) like ``os.path.realpath``:
    every symlink on the way is followed, relative to the directory it physically sits
    in. None when it dangles, loops, or leaves the mirror."""
    root_s = os.fsdecode(ns.source.root).rstrip("/")
    cur = ns.get(ROOT_INO)
    trail: list[Entry] = [cur]  # physical directories from the root down to cur
    todo = list(parts)
    hops = 0
    while todo:
        comp = todo.pop(0)
        if comp in ("", "."):
            continue
        if comp == "..":
            if len(trail) == 1:
                return None  # above the mirror's root
            trail.pop()
            cur = trail[-1]
            continue
        if not stat_mod.S_ISDIR(cur.mode):
            return None
        try:
            child = ns.lookup(cur.ino, os.fsencode(comp))
        except NotFound:
            return None
        if stat_mod.S_ISLNK(child.mode):
            hops += 1
            if hops > _MAX_LINK_HOPS:
                return None
            target = os.fsdecode(child.target)
            if target.startswith("/"):
                if not (target == root_s or target.startswith(root_s + "/")):
                    return None
                trail = [ns.get(ROOT_INO)]
                target = target[len(root_s):]
            cur = trail[-1]
            todo = target.split("/") + todo
            continue
        cur = child
        trail.append(child)
    return cur


def _follow(ns: Namespace, e: Entry) -> Entry | None:
    """An entry, or what its symlink (chain) resolves to inside the mirror."""
    if not stat_mod.S_ISLNK(e.mode):
        return e
    parent = ns.path_of(ns.get(e.parent))
    base = os.fsdecode(parent).split("/") if parent else []
    return _realpath(ns, [*base, os.fsdecode(e.name)])


def _dataset_root(ns: Namespace, dataset_rel: str) -> Entry | None:
    """The directory ``dataset_rel`` names (links followed), the mirror's root for ""."""
    rel = dataset_rel.strip("/")
    return _realpath(ns, rel.split("/")) if rel else ns.get(ROOT_INO)


def links_leaving(ns: Namespace, dataset_rel: str, limit: int = 100_000) -> int:
    """How many symlinks under the directory ``dataset_rel`` dangle or lead out of the
    mirror (at most ``limit`` entries looked at). A training follows them (out of the
    mount, to the real target) and lists files the mount cannot: the likely cause of a
    sample list that differs, said in its reason."""
    root = _dataset_root(ns, dataset_rel)
    if root is None:
        return 0
    n, seen, stack = 0, 0, [root.ino]
    while stack and seen < limit:
        for _name, ino, mode, _size in ns.index.list_dir_typed(stack.pop()):
            seen += 1
            if stat_mod.S_ISDIR(mode):
                stack.append(ino)
            elif stat_mod.S_ISLNK(mode):
                e = ns.index.get_entry(ino)
                n += e is None or _follow(ns, e) is None
    return n


class _Tree:
    """The snapshot's directories as a list builder walks them (links followed)."""

    def __init__(self, ns: Namespace) -> None:
        self.ns = ns
        self.index = ns.index

    def children(self, d: Entry) -> list[tuple[str, int, int, int]]:
        """(name, ino, mode, size) by name bytes: one LMDB transaction per directory, no
        Entry objects (a million-file dataset is listed when a stream announces it)."""
        fsdecode = os.fsdecode
        return [(fsdecode(name), ino, mode, size)
                for name, ino, mode, size in self.index.list_dir_typed(d.ino)]

    def resolved(self, ino: int) -> Entry | None:
        """What a symlink resolves to (None: dangling, a loop, or out of the tree)."""
        e = self.index.get_entry(ino)
        return None if e is None else _follow(self.ns, e)

    def as_dir(self, ino: int, mode: int) -> Entry | None:
        """The directory an entry is (a link to one followed), else None."""
        if stat_mod.S_ISDIR(mode):
            return self.index.get_entry(ino)
        if not stat_mod.S_ISLNK(mode):
            return None
        t = self.resolved(ino)
        return t if t is not None and stat_mod.S_ISDIR(t.mode) else None

    def sample(self, ino: int, mode: int, size: int) -> tuple[int, int]:
        """(inode, size) of the regular file a listed non-directory is. torchvision and
        timm keep a dangling or odd entry (and fail when they open it): its index is kept
        too, as inode 0, so that every later index lines up."""
        if stat_mod.S_ISREG(mode):
            return ino, size
        t = self.resolved(ino) if stat_mod.S_ISLNK(mode) else None
        return (t.ino, t.size) if t is not None and stat_mod.S_ISREG(t.mode) else (0, 0)


def _root_dir(ns: Namespace, dataset_rel: str) -> Entry:
    root = _dataset_root(ns, dataset_rel)
    if root is None or not stat_mod.S_ISDIR(root.mode):
        raise NotFound(f"dataset {dataset_rel!r} is not a directory")
    return root


def image_folder(ns: Namespace, dataset_rel: str,
                 extensions: tuple[str, ...] | None = IMG_EXTENSIONS,
                 suffixes: tuple[str, ...] | None = None) -> SampleList:
    """The ImageFolder sample list of the directory ``dataset_rel`` inside the mount (a
    ``DatasetFolder`` with these ``extensions``; None keeps every file, or those with the
    ``suffixes`` given, for a custom ``is_valid_file`` whose result the caller checks by
    the training's digest)."""
    dataset_rel = dataset_rel.strip("/")
    root = _root_dir(ns, dataset_rel)
    tree = _Tree(ns)
    children, as_dir = tree.children, tree.as_dir
    keep = keeper(extensions, suffixes)
    S_ISREG = stat_mod.S_ISREG

    classes: list[tuple[str, Entry]] = []
    for name, ino, mode, _size in children(root):
        d = as_dir(ino, mode)
        if d is not None:
            classes.append((name, d))
    classes.sort(key=lambda t: t[0])
    inos: list[int] = []
    labels: list[int] = []
    paths: list[str] = []
    nbytes = 0
    for label, (cname, cdir) in enumerate(classes):
        # os.walk(top, followlinks=True), then sorted by the root path string. A directory
        # is walked again each time a link reaches it, except inside itself (a loop).
        walked: list[tuple[str, list[tuple[str, int, int, int]]]] = []
        stack: list[tuple[str, Entry, frozenset[int]]] = [(cname, cdir, frozenset())]
        while stack:
            shown, d, ancestors = stack.pop()
            if d.ino in ancestors:  # a symlink loop; os.walk would recurse until ELOOP
                continue
            inner = ancestors | {d.ino}
            files = []
            for child in children(d):
                mode = child[2]
                if S_ISREG(mode):
                    files.append(child)
                    continue
                sub = as_dir(child[1], mode)
                if sub is not None:
                    stack.append((shown + "/" + child[0], sub, inner))
                else:
                    files.append(child)
            walked.append((shown, files))
        walked.sort(key=lambda t: t[0])
        for shown, files in walked:
            files.sort(key=lambda t: t[0])
            prefix = shown + "/"
            for name, ino, mode, size in files:
                if keep is not None and not keep(name):
                    continue
                if not S_ISREG(mode):
                    ino, size = tree.sample(ino, mode, size)
                inos.append(ino)
                labels.append(label)
                paths.append(prefix + name)
                nbytes += size
    return SampleList(dataset_rel, [c for c, _ in classes], inos, labels, paths, nbytes)


def timm_folder(ns: Namespace, dataset_rel: str,
                extensions: tuple[str, ...] | None = None,
                suffixes: tuple[str, ...] | None = None, sort: bool = True) -> SampleList:
    """timm's folder reader's sample list of the directory ``dataset_rel`` (see the
    module doc), keeping the files :func:`keeper` keeps; ``sort``: timm's flag (its
    reader sorts)."""
    dataset_rel = dataset_rel.strip("/")
    root = _root_dir(ns, dataset_rel)
    tree = _Tree(ns)
    keep = keeper(extensions, suffixes)
    # (rel path, inode, size, class name) in os.walk(topdown=False)'s order
    found: list[tuple[str, int, int, str]] = []
    # a directory to walk: (entry, its path from the root, the directories above it), or
    # a walked directory's files, emitted once its subdirectories' are
    stack: list = [(root, "", frozenset((root.ino,)))]
    while stack:
        top = stack.pop()
        if isinstance(top, list):
            found += top
            continue
        d, rel, above = top
        label = rel.rpartition("/")[2]  # leaf_name_only: the directory's own name
        prefix = rel + "/" if rel else ""
        files: list[tuple[str, int, int, str]] = []
        subdirs: list[tuple[Entry, str, frozenset[int]]] = []
        for name, ino, mode, size in tree.children(d):
            sub = tree.as_dir(ino, mode)
            if sub is not None:
                if sub.ino not in above:  # a link loop; os.walk would recurse until ELOOP
                    subdirs.append((sub, prefix + name, above | {sub.ino}))
            elif keep is None or keep(name):
                ino, size = tree.sample(ino, mode, size)
                files.append((prefix + name, ino, size, label))
        stack.append(files)
        stack.extend(reversed(subdirs))
    classes = sorted({f[3] for f in found}, key=natural_key)
    if sort:
        found.sort(key=lambda f: natural_key(f[0]))
    ids = {c: i for i, c in enumerate(classes)}
    return SampleList(dataset_rel, classes, [f[1] for f in found], [ids[f[3]] for f in found],
                      [f[0] for f in found], sum(f[2] for f in found))
