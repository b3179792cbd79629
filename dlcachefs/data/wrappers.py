"""Which files a training's dataset reads: ImageFolders behind wrappers, as a *view*.

The dataset a DataLoader sees is often not an ImageFolder itself: a ``Subset`` of it
(``random_split``), a ``ConcatDataset`` of several, or a small user class holding one in
an attribute (``self.base = ImageFolder(...)``). :func:`resolve` finds the torchvision
``DatasetFolder`` s (``ImageFolder`` or any ``DatasetFolder``, custom ``loader`` and
``extensions`` included) behind such a dataset and returns a :class:`View`:

* ``roots``: the folders, in ``ConcatDataset`` order; their sample lists concatenated
  are the *base list* (a folder reached twice is listed twice, as torch indexes it);
* ``index``: ``None`` when index ``i`` of the dataset is index ``i`` of the base list,
  else the list mapping the dataset's indices to base indices (``Subset`` indices,
  composed through nested ``Subset`` s and ``ConcatDataset`` offsets).

So index ``i`` of the dataset the DataLoader sees names the file
``base[index[i]]`` on both sides. A user class is searched through its instance
attributes (and the items of list/tuple/dict attributes), breadth first, at most
``max_depth`` levels, cycles skipped; it is taken to forward index ``i`` to the dataset it
holds (``__getitem__(i)`` -> ``self.base[i]``), which is only assumed when both have the
same length, and refused (with the reason) when it holds several different ones.

Each root carries a digest of its sample list (the number of samples and a SHA-256 of
their paths relative to the root, one per line): the mount derives the list again from
its own snapshot, in torchvision's order and in timm's (``natural_key``), and replays an
order only if one agrees (a custom ``is_valid_file`` or ``find_classes`` cannot be
replayed; the digest tells, and the digest of the paths sorted tells a list in another
order from a list of other files). A folder whose extension filter is unknown (a custom
``is_valid_file``, timm's reader) sends its files' suffixes, which the mount keeps. The digest, the ids and the
control lines that announce a view are the protocol's
(:mod:`dlcachefs.clairvoyance.protocol`); see docs/clairvoyance.md.

Pure Python, no torch import (torchvision's classes are recognised only when the training
imported them already).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from dlcachefs.clairvoyance.protocol import paths_digest, set_digest, suffixes_of


class Unresolved(Exception):
    """The dataset's files cannot be named index by index; ``str(e)`` says why."""


@dataclass(frozen=True)
class Root:
    """One DatasetFolder: its root directory, extension filter and sample-list digest."""

    path: str
    extensions: tuple[str, ...] | None  # None: a custom is_valid_file, or another reader
    count: int
    sha: str  # sha256 hex of the relative sample paths, "\n"-terminated
    set_sha: str | None = None  # the same of the paths sorted (protocol.set_digest)
    #: with ``extensions`` None: the suffixes of the samples' files (protocol.suffixes_of)
    suffixes: tuple[str, ...] | None = None


@dataclass(frozen=True)
class View:
    """Concatenated roots, optionally seen through an index list (see the module doc)."""

    roots: tuple[Root, ...]
    index: tuple[int, ...] | None
    how: str  # e.g. "Subset(ImageFolder)", for messages

    @property
    def base_len(self) -> int:
        return sum(r.count for r in self.roots)

    def __len__(self) -> int:
        return self.base_len if self.index is None else len(self.index)

    def base_index(self, i: int) -> tuple[int, int]:
        """(root number, index in that root) of dataset index ``i`` (0 <= i < len)."""
        j = i if self.index is None else self.index[i]
        for k, r in enumerate(self.roots):
            if j < r.count:
                return k, j
            j -= r.count
        raise IndexError(i)


# ----- finding the folders ---------------------------------------------------------------

_digests: dict[int, tuple[object, Root]] = {}  # id(folder) -> (folder, its Root): once each
_PREFERRED = ("dataset", "ds", "base", "data", "inner", "wrapped", "source", "dset")


def _is_subclass_of(obj: object, module: str, name: str) -> bool:
    mod = sys.modules.get(module)
    cls = getattr(mod, name, None) if mod is not None else None
    return isinstance(cls, type) and isinstance(obj, cls)


def _is_folder(ds: object) -> bool:
    """A torchvision DatasetFolder, or something shaped like one (``root`` + ``samples``
    with one entry per item, e.g. :func:`dlcachefs.torch.with_index` around one)."""
    if _is_subclass_of(ds, "torchvision.datasets.folder", "DatasetFolder"):
        return True
    try:
        root = getattr(ds, "root", None)
        samples = getattr(ds, "samples", None)
        return (isinstance(root, (str, os.PathLike)) and isinstance(samples, list)
                and len(samples) == len(ds))  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - odd attributes: not a folder
        return False


def folder_root(ds: object) -> Root:
    """The :class:`Root` of a DatasetFolder (its digest computed once per object)."""
    hit = _digests.get(id(ds))
    if hit is not None and hit[0] is ds:
        return hit[1]
    root = os.fspath(ds.root)  # type: ignore[attr-defined]
    prefix = root.rstrip(os.sep) + os.sep
    rels = []
    for s in ds.samples:  # type: ignore[attr-defined]
        p = os.fspath(s[0] if isinstance(s, (tuple, list)) else s)
        rels.append(p[len(prefix):] if p.startswith(prefix) else os.path.relpath(p, root))
    ext = getattr(ds, "extensions", None)
    if isinstance(ext, str):
        ext = (ext,)
    elif ext is not None:
        ext = tuple(str(e) for e in ext)
    # (sorting a list already in order costs one comparison per path)
    r = Root(root, ext, len(rels), paths_digest(rels), set_digest(rels),
             suffixes_of(rels) if ext is None else None)
    if len(_digests) > 64:
        _digests.clear()
    _digests[id(ds)] = (ds, r)
    return r


def _indices_of(subset: object, n: int) -> list[int]:
    raw = subset.indices  # type: ignore[attr-defined]
    if hasattr(raw, "tolist"):
        raw = raw.tolist()
    out = []
    for i in raw:
        i = int(i)
        if i < 0:  # Python indexing: what dataset[i] reads
            i += n
        if not 0 <= i < n:
            raise Unresolved(f"Subset index {i} out of range for {n} samples")
        out.append(i)
    return out


def _concat(parts: list[View]) -> View:
    roots = tuple(r for v in parts for r in v.roots)
    how = "ConcatDataset(" + ", ".join(v.how for v in parts) + ")"
    if all(v.index is None for v in parts):
        return View(roots, None, how)
    index: list[int] = []
    off = 0
    for v in parts:
        if v.index is None:
            index.extend(range(off, off + v.base_len))
        else:
            index.extend(off + j for j in v.index)
        off += v.base_len
    return View(roots, tuple(index), how)


def resolve(ds: object, max_depth: int = 4) -> View:
    """The :class:`View` of ``ds`` (raises :class:`Unresolved` with the reason)."""
    return _resolve(ds, max_depth, set())


def _resolve(ds: object, depth: int, active: set[int]) -> View:
    if id(ds) in active:
        raise Unresolved(f"{type(ds).__name__} contains itself")
    if _is_folder(ds):
        return View((folder_root(ds),), None, type(ds).__name__)
    active = active | {id(ds)}
    if _is_subclass_of(ds, "torch.utils.data.dataset", "Subset"):
        inner = _resolve(ds.dataset, depth, active)  # type: ignore[attr-defined]
        idx = _indices_of(ds, len(inner))
        if inner.index is not None:
            idx = [inner.index[i] for i in idx]
        return View(inner.roots, tuple(idx), f"Subset({inner.how})")
    if _is_subclass_of(ds, "torch.utils.data.dataset", "ConcatDataset"):
        return _concat([_resolve(d, depth, active)
                        for d in ds.datasets])  # type: ignore[attr-defined]
    return _search(ds, depth, active)


def _dataset_like(v: object) -> bool:
    t = type(v)
    return (hasattr(t, "__getitem__") and hasattr(t, "__len__")
            and not isinstance(v, (str, bytes, bytearray, list, tuple, dict, range))
            and not (t.__module__ or "").startswith(("numpy", "torch._", "builtins")))


def _search(ds: object, depth: int, active: set[int]) -> View:
    """A user class: the dataset it holds in an attribute (breadth first)."""
    name = type(ds).__name__
    if depth <= 0:
        raise Unresolved(f"no ImageFolder found within the attribute depth limit "
                         f"(reached {name})")
    try:
        n = len(ds)  # type: ignore[arg-type]
    except Exception as e:  # noqa: BLE001
        raise Unresolved(f"{name} has no length ({e})") from None
    attrs = getattr(ds, "__dict__", None)
    if not isinstance(attrs, dict):
        raise Unresolved(f"{name} is not a Subset, ConcatDataset or ImageFolder and has "
                         f"no attributes to search")
    found: list[tuple[str, View]] = []
    reasons: list[str] = []
    for attr, val in list(attrs.items()):
        items: list[tuple[str, object]]
        if isinstance(val, (list, tuple)):
            items = [(f"{attr}[{i}]", v) for i, v in enumerate(val[:16])]
        elif isinstance(val, dict):
            items = [(f"{attr}[{k!r}]", v) for k, v in list(val.items())[:16]]
        else:
            items = [(attr, val)]
        for label, v in items:
            if not _dataset_like(v) or id(v) in active:
                continue
            try:
                view = _resolve(v, depth - 1, active)
            except Unresolved as e:
                reasons.append(f"{label}: {e}")
                continue
            if len(view) != n:
                reasons.append(f"{name} has {n} samples but {name}.{label} "
                               f"({view.how}) has {len(view)}: indices cannot be mapped")
                continue
            found.append((label, view))
    distinct = {(v.roots, v.index) for _, v in found}
    if len(distinct) == 1:
        label, view = found[0]
        return View(view.roots, view.index, f"{name}.{label}={view.how}")
    if len(distinct) > 1:
        for pref in _PREFERRED:
            for label, view in found:
                if label == pref:
                    return View(view.roots, view.index, f"{name}.{label}={view.how}")
        raise Unresolved(f"{name} holds several datasets ("
                         + ", ".join(label for label, _ in found) + "): which one it reads "
                         "is unknown")
    if reasons:
        raise Unresolved("; ".join(reasons[:3]))
    raise Unresolved(f"{name} is not a Subset, ConcatDataset or DatasetFolder and holds "
                     f"none in its attributes")
