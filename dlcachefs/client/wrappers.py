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
its own snapshot and replays an order only if the two agree (a custom ``is_valid_file``
or ``find_classes`` cannot be replayed; the digest tells). See the README's "Clairvoyant
epochs" for the control lines (:func:`index_lines`, :func:`view_lines`).

Pure Python, no torch import (torchvision's classes are recognised only when the training
imported them already).
"""

from __future__ import annotations

import hashlib
import os
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import quote

#: limits of the control file, defined once here (this module runs in the training
#: process without trio): :mod:`dlcachefs.clairvoyance.control` enforces them, the client's encoders
#: (here and in :mod:`dlcachefs.torch`) stay within them
MAX_WRITE = 64 * 1024
MAX_LINE = 4096
ID_HEX = 24  # hex digits of index-list and view ids


class Unresolved(Exception):
    """The dataset's files cannot be named index by index; ``str(e)`` says why."""


@dataclass(frozen=True)
class Root:
    """One DatasetFolder: its root directory, extension filter and sample-list digest."""

    path: str
    extensions: tuple[str, ...] | None  # None: a custom is_valid_file (not replayable)
    count: int
    sha: str  # sha256 hex of the relative sample paths, "\n"-terminated

    @property
    def ext_token(self) -> str:
        return ext_token(self.extensions)


def ext_token(extensions: Sequence[str] | None) -> str:
    """The ``ext=`` field: percent-encoded extensions joined by ``,``; ``any`` for none."""
    if extensions is None:
        return "any"
    return ",".join(quote(e, safe="") for e in extensions)


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


def paths_digest(rel_paths: Sequence[str]) -> str:
    """SHA-256 hex of the sample paths (relative to their root), each ``\\n``-terminated,
    as bytes (``os.fsencode``: undecodable names keep their bytes). The mount computes the
    same over its own listing."""
    h = hashlib.sha256()
    enc = os.fsencode
    for p in rel_paths:
        h.update(enc(p))
        h.update(b"\n")
    return h.hexdigest()


def index_list_id(indices: Sequence[int]) -> str:
    """Content id of an index list: SHA-256 of the int64 little-endian values."""
    a = array("q", indices)
    if sys.byteorder != "little":
        a.byteswap()
    return hashlib.sha256(a.tobytes()).hexdigest()[:ID_HEX]


def normalize_rel(rel: str) -> str:
    """A path relative to the mount as the control protocol spells it ("" for the root)."""
    return "/".join(p for p in rel.split("/") if p not in ("", "."))


def view_id(rels: Sequence[str], roots: Sequence, lid: str | None) -> str:
    """Content id of a view: its roots (mount-relative, normalized; objects with
    ``count``, ``sha``, ``extensions``), and index-list id. The mount recomputes it to
    check a definition."""
    text = "".join(f"{rel}\t{r.count}\t{r.sha}\t{ext_token(r.extensions)}\n"
                   for rel, r in zip(rels, roots, strict=True))
    text += f"index={lid or '-'}\n"
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:ID_HEX]


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
    r = Root(root, ext, len(rels), paths_digest(rels))
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


# ----- control lines -----------------------------------------------------------------------


def _tokens(indices: Sequence[int]) -> list[str]:
    """``I`` per index, ``A:B`` for a run ``A, A+1, ..., B-1`` of at least 3."""
    out: list[str] = []
    n = len(indices)
    i = 0
    while i < n:
        j = i + 1
        while j < n and indices[j] == indices[j - 1] + 1:
            j += 1
        if j - i >= 3:
            out.append(f"{indices[i]}:{indices[j - 1] + 1}")
        else:
            out.extend(str(x) for x in indices[i:j])
        i = j
    return out


def _expanded(token: str) -> int:
    a, _, b = token.partition(":")
    return int(b) - int(a) if b else 1


def chunked_writes(prefix: str, tokens: Sequence[str], tail: Callable[[int], str],
                   head: str = "", next_head: str | None = None,
                   expand: Callable[[str], int] = lambda _t: 1) -> list[str]:
    """The one encoder of long index lists for the control file: writes of at most
    ``MAX_WRITE`` bytes whose lines (at most ``MAX_LINE`` characters) read
    ``PREFIX START TOKEN...`` (``START``: the position of the line's first index), then
    ``tail(count)``. The first write starts with ``head``, later ones with ``next_head``
    (default ``head``). ``expand(token)`` is how many indices a token stands for."""
    cont = head if next_head is None else next_head
    writes: list[str] = []
    buf: list[str] = [head]
    size = len(head)
    pos = 0
    line: list[str] = []
    line_start = 0
    line_len = 0

    def end_line() -> None:
        nonlocal size, line, line_len
        if line:
            text = f"{prefix} {line_start} " + " ".join(line) + "\n"
            buf.append(text)
            size += len(text)
            line, line_len = [], 0

    room = len(f"{prefix} {MAX_WRITE} \n") + 8
    for tok in tokens:
        if not line:
            line_start = pos
        elif room + line_len + 1 + len(tok) > MAX_LINE:
            end_line()
            line_start = pos
            if size > MAX_WRITE - 2 * MAX_LINE:
                writes.append("".join(buf))
                buf, size = [cont], len(cont)
        line.append(tok)
        line_len += 1 + len(tok)
        pos += expand(tok)
    end_line()
    last = tail(pos)
    if size + len(last) > MAX_WRITE:
        writes.append("".join(buf))
        buf = [cont]
    buf.append(last)
    writes.append("".join(buf))
    return writes


def index_lines(lid: str, indices: Sequence[int], head: str = "") -> list[str]:
    """Writes (each starting with ``head``) that define index list ``lid``: ``index LID
    START TOKENS...`` chunks, then ``index LID end COUNT``."""
    return chunked_writes(f"index {lid}", _tokens(indices), lambda n: f"index {lid} end {n}\n",
                          head, expand=_expanded)


def view_lines(vid: str, rels: Sequence[str], roots: Sequence[Root], lid: str | None
               ) -> list[str]:
    """The ``root``/``view`` lines defining view ``vid`` (one write's worth of lines)."""
    out = [f"root {vid} {quote(rel, safe='/') or '.'} count={r.count} sha={r.sha} "
           f"ext={r.ext_token}" for rel, r in zip(rels, roots, strict=True)]
    out.append(f"view {vid} roots={len(roots)}" + (f" index={lid}" if lid else ""))
    return out
