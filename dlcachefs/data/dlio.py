"""DLIO's PyTorch loader (``dlio_benchmark``, MLPerf Storage's engine), as the hook sees it.

DLIO reads through a plain ``torch.utils.data.DataLoader``, but neither its dataset nor its
sampler is one the hook knows:

* its ``TorchDataset`` maps index ``i`` to a file through DLIO's own configuration
  (``ConfigArguments.file_list_train``: the data folder's files, sorted; one sample per
  file for the image formats), not through an ImageFolder;
* its ``dlio_sampler`` yields this MPI rank's share of the indices, shuffled in place at
  each ``iter()`` (``sample_shuffle: seed`` reseeds numpy's global generator first, so
  epoch ``e + 1``'s order is a shuffle of epoch ``e``'s; ``random`` draws from numpy's
  global generator as it stands).

:func:`view_of` names the dataset's files as a :class:`~dlcachefs.data.wrappers.View`: one
root, the folder holding DLIO's files, listed the way the mount lists it in timm's
unsorted order (``os.walk(topdown=False)``, each directory in the mount's listing order,
the files with DLIO's suffixes), and an index list from DLIO's index to that list.
:func:`preview` computes the sampler's next orders without touching it: it iterates a
copy (its own index list), with numpy's and ``random``'s global generators put back as they were, so
the training draws exactly what it would have drawn. The hook sends those orders to the
mount as ``sampler explicit world=W rank=R`` + ``order`` lines
(:mod:`dlcachefs.clairvoyance.control`): this epoch's and the next's. The next one is a
prediction where the sampler draws from numpy's global generator as it stands
(``sample_shuffle: random``): DLIO draws from it between epochs too (the evaluation
sampler, ``computation_time_stdev``), so at each epoch's start the epoch's order is
previewed again and sent anew when it is not the one predicted (:func:`orders_to_send`).

Only DLIO's own classes are recognised (by module and name: this module never imports
DLIO, and nothing here runs unless the training did). Pure Python, no torch import.
"""

from __future__ import annotations

import copy
import os
import random
import sys
from collections.abc import Callable

from dlcachefs.clairvoyance.protocol import (
    MAX_ORDER_LEN,
    index_list_id,
    paths_digest,
    set_digest,
    suffixes_of,
)
from dlcachefs.data.wrappers import Root, Unresolved, View

LOADER_MODULE = "dlio_benchmark.data_loader.torch_data_loader"
CONFIG_MODULE = "dlio_benchmark.utils.config"


def _is(obj: object, name: str) -> bool:
    cls = getattr(sys.modules.get(LOADER_MODULE), name, None)
    return isinstance(cls, type) and isinstance(obj, cls)


def is_dataset(ds: object) -> bool:
    """DLIO's ``TorchDataset`` (only once the training imported DLIO)."""
    return _is(ds, "TorchDataset")


def is_sampler(obj: object) -> bool:
    """DLIO's ``dlio_sampler``."""
    return _is(obj, "dlio_sampler")


def is_eval(ds: object) -> bool:
    """DLIO's evaluation dataset (announced weakly: the training loader's stream wins)."""
    return _kind(ds) != "train"


def _kind(ds: object) -> str:
    kind = getattr(ds, "dataset_type", None)
    return str(getattr(kind, "value", kind)).lower()


def _config() -> object:
    mod = sys.modules.get(CONFIG_MODULE)
    cls = getattr(mod, "ConfigArguments", None)
    if cls is None:
        raise Unresolved("DLIO's ConfigArguments is not loaded")
    return cls.get_instance()


def first_file(ds: object) -> str | None:
    """The first file DLIO's dataset ``ds`` names (for the mount it reads from, when its
    files cannot be named index by index), or None."""
    try:
        files = getattr(_config(), "file_list_train" if _kind(ds) == "train"
                        else "file_list_eval", None)
        return os.path.abspath(os.fspath(files[0])) if files else None
    except (Unresolved, TypeError, ValueError, IndexError):
        return None


def files_of(ds: object) -> list[str]:
    """The file each index of DLIO's dataset ``ds`` reads (absolute paths, as DLIO's
    ``get_global_map_index`` makes them). Raises :class:`Unresolved` when they cannot be
    named index by index (several samples per file, no file list)."""
    args = _config()
    per_file = getattr(args, "num_samples_per_file", 1)
    if per_file != 1:
        raise Unresolved(f"DLIO dataset with {per_file} samples per file: its indices name "
                         f"samples inside files, not files")
    kind = _kind(ds)
    files = getattr(args, "file_list_train" if kind == "train" else "file_list_eval", None)
    n = len(ds)  # type: ignore[arg-type]
    if not isinstance(files, list) or len(files) < n:
        raise Unresolved(f"DLIO's {kind} file list does not name the dataset's {n} samples")
    return [os.path.abspath(os.fspath(files[i])) for i in range(n)]


def walk_list(root: str, suffixes: tuple[str, ...]) -> list[str]:
    """The files under ``root`` with one of ``suffixes`` (lower case), relative to it, in
    ``os.walk(topdown=False, followlinks=True)``'s order: on a dlcachefs mount, the order
    the mount gives timm's unsorted list (:func:`dlcachefs.clairvoyance.samplelist.timm_folder`)."""
    out: list[str] = []
    for dirpath, _dirs, names in os.walk(root, topdown=False, followlinks=True):
        rel = os.path.relpath(dirpath, root)
        prefix = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        out += [prefix + name for name in names
                if os.path.splitext(name)[1].lower() in suffixes]
    return out


def view_of(ds: object, on_mount: Callable[[str], bool]) -> View | None:
    """The :class:`View` of DLIO's dataset ``ds`` (module doc); None when the folder
    holding its files is not on a mount (``on_mount``), checked before it is listed.
    Lists that folder once per call (the hook keeps the result per dataset object)."""
    files = files_of(ds)
    if not files:
        raise Unresolved("DLIO's dataset is empty")
    root = os.path.commonpath([os.path.dirname(f) for f in files])
    if not on_mount(root):
        return None
    rels = [os.path.relpath(f, root).replace(os.sep, "/") for f in files]
    suffixes = suffixes_of(rels)
    if suffixes is None:
        raise Unresolved("DLIO's files have no common suffixes to list them by")
    listed = walk_list(root, suffixes)
    pos = {p: i for i, p in enumerate(listed)}
    try:
        index = tuple(pos[p] for p in rels)
    except KeyError as e:
        raise Unresolved(f"DLIO's file {e.args[0]!r} is not listed under {root!r}") from None
    r = Root(root, None, len(listed), paths_digest(listed), set_digest(listed), suffixes)
    identity = len(index) == len(listed) and all(i == j for i, j in enumerate(index))
    return View((r,), None if identity else index, "DLIO TorchDataset")


def preview(sampler: object, epochs: int = 2) -> list[list[int]] | None:
    """The orders the next ``epochs`` iterations of DLIO's ``sampler`` will yield, from a
    copy of it; numpy's and ``random``'s global generators are put back as they were (the
    module doc). None when an order is longer than the protocol takes."""
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    py_state = random.getstate()
    try:
        # a shallow copy with its own index list: DLIO's sampler shuffles that list in
        # place and holds nothing else that changes (a deep copy of a million indices
        # costs about a second at each epoch's start)
        twin = copy.copy(sampler)
        indices = getattr(sampler, "indices", None)
        if isinstance(indices, list):
            twin.indices = list(indices)  # type: ignore[attr-defined]
        else:
            twin = copy.deepcopy(sampler)
        out: list[list[int]] = []
        for _ in range(epochs):
            order: list[int] = []
            for i in twin:  # type: ignore[attr-defined]
                order.append(int(i))
                if len(order) > MAX_ORDER_LEN:
                    return None
            out.append(order)
        return out
    finally:
        if np_state is not None:
            np.random.set_state(np_state)
        random.setstate(py_state)


def orders_to_send(sampler: object, epoch: int, predicted: str | None
                   ) -> tuple[list[tuple[int, list[int]]], str] | None:
    """The orders to send as ``epoch`` starts, as (epoch, order) pairs, and the id
    (:func:`~dlcachefs.clairvoyance.protocol.index_list_id`) of the next epoch's order
    they predict; None when an order is too long to send. ``predicted``: the id sent for
    ``epoch`` as the last epoch's next order (None: nothing was sent, or it is lost); the
    epoch's own order is sent again unless it is that one (module doc)."""
    orders = preview(sampler, 2)
    if orders is None:
        return None
    this, after = orders
    out = [] if predicted == index_list_id(this) else [(epoch, this)]
    return out + [(epoch + 1, after)], index_list_id(after)


def rank_of(sampler: object) -> tuple[int, int]:
    """(world, rank) of DLIO's sampler (its MPI communicator's size and rank)."""
    world = int(getattr(sampler, "size", 1))
    rank = int(getattr(sampler, "rank", 0))
    if not 0 <= rank < world:
        raise ValueError(f"DLIO sampler rank {rank} outside a world of {world}")
    return world, rank
