"""Tell a dlcachefs mount how a PyTorch training samples its dataset.

``install()`` patches ``RandomSampler``, ``SubsetRandomSampler``, ``DistributedSampler``
and ``DataLoader.__iter__`` so that, at the start of every epoch, the sampler and epoch
are written into ``<mount>/.dlcache/control`` of the mount that holds the dataset. The
dataset may be an ImageFolder (any torchvision ``DatasetFolder``) or wrap some:
``Subset``, ``ConcatDataset``, a user class holding one in an attribute (see
:mod:`dlcachefs.data.wrappers`); it is announced as a *view* (``root``/``view``/``index`` lines,
sent once per process and mount, then named by its id). The training itself is
unchanged, bit for bit:

* ``RandomSampler`` without a generator draws its per-epoch seed from the global RNG with
  ``torch.empty((), dtype=torch.int64).random_()``; the patch makes exactly that draw, at
  the same moment (the first ``next()``), builds the same generator from it, lets torch's
  own ``__iter__`` run with it, and announces the seed (``per_epoch=true``).
* ``RandomSampler`` / ``SubsetRandomSampler`` with their own generator: at the first
  ``next()`` of the epoch the patch reads ``generator.get_state()`` (which does not
  advance it) and announces it (``state=``, base64), with ``loader_draws=each`` when the
  DataLoader draws its base seed from the same generator (``first`` with persistent
  workers), so the mount knows the next epoch's order too. A ``SubsetRandomSampler``
  without a generator announces the global generator's state (this epoch only).
* ``DistributedSampler`` orders by ``seed + epoch``: the patch announces them and calls
  torch's own ``__iter__``.
* ``DataLoader.__iter__`` binds the loader (its dataset and generator) to its sampler and
  batch sampler (a ``SubsetRandomSampler`` has no dataset of its own), announces
  ``sampler sequential`` for a ``SequentialSampler``, and ``sampler unknown reason=...``
  for a sampler it cannot replay (the mount then learns the order from the opens).
  With an announcement it sends the loader's ``batch B workers=K prefetch_factor=F``.
  DLIO's ``dlio_sampler`` over its ``TorchDataset`` (MLPerf Storage's engine) is
  previewed on a copy and announced as its rank's explicit orders, this epoch's and the
  next's (:mod:`dlcachefs.data.dlio`).
* ``_BaseDataLoaderIter.__next__`` is timed (two clock reads per batch) for a loader
  that announced: every 5 s and at the end of an epoch the training's own pace (seconds
  waiting in ``next()``, seconds of its step between ``next()`` calls) is written as a
  ``pace`` line, for the mount's loader-worker advice (``dlcachefs advise``).
* With ``--workers auto`` (``DLCACHEFS_WORKERS``, or ``install(workers=...)``), each
  loader's ``num_workers`` is set at the start of every epoch by DLCache's Algorithm 2
  from the last epoch's measurements (:mod:`dlcachefs.data.autoworkers`); the count of
  each epoch is a log line on stderr and :func:`workers_report`. The sample order stays
  the same; random augmentations follow the workers' seeds, and may not.

``dlcachefs run -- python train.py`` installs this without editing the script (through
a ``sitecustomize`` on ``PYTHONPATH`` that patches torch when ``torch.utils.data`` is
imported). Nothing here ever breaks a training: a failed announcement is a warning.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import math
import os
import re
import sys
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from dlcachefs import mountctl
from dlcachefs.clairvoyance import protocol as _p
from dlcachefs.data import dlio as _dlio
from dlcachefs.data import wrappers as _w
from dlcachefs.data.onimport import PatchOnImport

ENV_JOB = "DLCACHEFS_JOB"
#: ``dlcachefs run --workers auto[:MIN-MAX]`` passes its bounds to the training here
ENV_WORKERS = "DLCACHEFS_WORKERS"
_installed = False
_auto = None  # autoworkers.Bounds when --workers auto is on (set by install())
_warned: set[str] = set()


def _warn_once(key: str, msg: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"dlcachefs: {msg}", RuntimeWarning, stacklevel=3)


@lru_cache(maxsize=64)
def find_mount(path: str) -> tuple[str, str] | None:
    """(mount root, path relative to it) when ``path`` lies inside a dlcachefs mount."""
    p = os.path.abspath(path)
    cur = p
    while True:
        if os.path.exists(os.path.join(cur, ".dlcache", "control")):
            return cur, os.path.relpath(p, cur)
        parent = os.path.dirname(cur)
        if parent == cur:
            return None
        cur = parent


def announce(dataset_root: str, lines: list[str], job: str | None = None) -> bool:
    """Write ``lines`` (e.g. ``["sampler random seed=7", "epoch 0"]``) for the dataset at
    ``dataset_root`` to its mount, in one write. Returns False (and warns once) when the
    dataset is not on a dlcachefs mount or the mount refused the lines."""
    target = find_mount(str(dataset_root))
    if target is None:
        return False
    mount, rel = target
    job = job or os.environ.get(ENV_JOB) or "default"
    text = _p.text([_p.job_line(job), _p.dataset_line(rel), *lines])
    try:
        write_control(mount, [text.encode()])
    except OSError as e:
        _warn_once(f"write:{mount}", f"could not announce to {mount} ({e}); see "
                   f"{mount}/.dlcache/errors. Training goes on without clairvoyance.")
        return False
    return True


def write_control(mount: str, writes: list[bytes]) -> None:
    """Each item of ``writes`` as one ``write()`` to the mount's control file (each is
    applied whole or refused whole: OSError EINVAL, reason in ``.dlcache/errors``)."""
    fd = os.open(os.path.join(mount, ".dlcache", "control"), os.O_WRONLY)
    try:
        for w in writes:
            os.write(fd, w)
    finally:
        os.close(fd)


def dlcachefs_mounts() -> list[str]:
    """Mountpoints of the dlcachefs mounts this process sees (``/proc/self/mounts``)."""
    return mountctl.mounts_of("fuse.dlcachefs")


@dataclass(frozen=True)
class Target:
    """Where and as what a dataset is announced: its mount, its view's id and lines."""

    mount: str
    rel: str  # the first root, relative to the mount ("" for the mount's root)
    vid: str
    view: _w.View
    rels: tuple[str, ...]
    lid: str | None

    def dataset_line(self) -> str:
        return _p.dataset_line(self.rel, self.vid)

    def definition(self) -> list[str]:
        """The writes that define the view (its index list first)."""
        writes = []
        if self.lid is not None and self.view.index is not None:
            writes += _p.index_writes(self.lid, self.view.index)
        writes.append(_p.text(_p.view_lines(self.vid, self.rels, self.view.roots, self.lid)))
        return writes


_targets: dict[int, tuple[object, Target | str | None]] = {}
_sent: set[tuple[str, str]] = set()  # (mount, view or list id) this process has sent


def target_of(ds) -> Target | str | None:
    """The :class:`Target` of the dataset ``ds``; a reason (str) when it lies on a mount
    but cannot be named index by index; None when it is not on a dlcachefs mount."""
    hit = _targets.get(id(ds))
    if hit is not None and hit[0] is ds:
        return hit[1]
    out = _target_now(ds)
    if len(_targets) > 64:
        _targets.clear()
    _targets[id(ds)] = (ds, out)
    return out


def _target_now(ds) -> Target | str | None:
    try:
        if _dlio.is_dataset(ds):  # (its folder listed only when it is on a mount)
            dv = _dlio.view_of(ds, lambda root: find_mount(root) is not None)
            if dv is None:
                return None
            view = dv
        else:
            view = _w.resolve(ds)
    except _w.Unresolved as e:
        return f"{type(ds).__name__}: {e}"
    found = [find_mount(r.path) for r in view.roots]
    if all(f is None for f in found):
        return None
    mounts = {f[0] for f in found if f is not None}
    if None in found or len(mounts) > 1:
        return f"{view.how}: its ImageFolders are not all on one dlcachefs mount"
    rels = tuple(_p.normalize_rel(f[1]) for f in found if f is not None)
    lid = _p.index_list_id(view.index) if view.index is not None else None
    return Target(mounts.pop(), rels[0], _p.view_id(rels, view.roots, lid), view, rels, lid)


_claims: dict[str, str] = {}  # job -> the dataset (view id) whose loader owns its stream


def _claim(job: str, key: str, weak: bool) -> bool:
    """Whether a loader over dataset ``key`` may announce for ``job`` in this process.
    A replayable sampler (strong) always may, and takes the job's stream; a sequential
    or unknown one (weak: typically a validation loader) only while no other dataset
    took it, so it does not keep replacing the training loader's stream."""
    owner = _claims.get(job)
    if weak and owner is not None and owner != key:
        return False
    if owner is None or not weak:
        _claims[job] = key
    return True


def _batch_hint(loader) -> list[str]:
    """The ``batch B workers=K prefetch_factor=F`` hint of ``loader`` (the mount measures
    its workers' fetch times against it: ``dlcachefs advise``), or nothing. Within the
    parser's limits (:data:`protocol.MAX_BATCH` ...): a value outside them would make the
    mount refuse the whole announcement, so it is left out (the whole hint for a batch
    size, the field for the others). Never raises (a loader's attribute may be a property
    that does)."""
    try:
        size = getattr(loader, "batch_size", None) if loader is not None else None
        if not _in_range(size, 1, _p.MAX_BATCH):
            return []  # a custom batch sampler (no fixed batch size), or beyond the limit
        nw = getattr(loader, "num_workers", None)
        nw = nw if _in_range(nw, 0, _p.MAX_WORKERS) else None
        pf = getattr(loader, "prefetch_factor", None)
        pf = pf if nw and _in_range(pf, 0, _p.MAX_PREFETCH_FACTOR) else None
        return [_p.batch_line(size, nw, pf)]
    except Exception as e:  # noqa: BLE001 - never break the training
        _warn_once("batch-hint", f"no batch hint for this loader: {e}")
        return []


def _in_range(x: object, lo: int, hi: int) -> bool:
    """``x`` is an int (not a bool) with ``lo <= x <= hi``."""
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


_RANK = re.compile(r"\brank=(\d+)")
#: mounts that refused a pace report (EINVAL: a daemon older than the ``pace`` line). No
#: more reports go there from this process: each refusal would land in the mount's bounded
#: ``.dlcache/errors`` list and push the real errors out.
_no_pace: set[str] = set()


class _PaceReport:
    """The training's pace over one loader's batches, reported to the mount its loader
    announced to: seconds blocked in ``next()`` (the data stall) and seconds between a
    ``next()`` returning and the next call (the training's step; DLCache's t_req). A
    ``pace`` line every :attr:`EVERY` seconds and at the end of each epoch."""

    EVERY = 5.0

    def __init__(self, loader) -> None:
        self.loader = weakref.ref(loader)
        self.iters = self.steps = 0
        self.wait = self.train = 0.0
        self.last_end: float | None = None
        self.sent = time.monotonic()
        # the same, since the epoch began (--workers auto reads them at the next epoch)
        self.ep_iters = self.ep_steps = 0
        self.ep_wait = self.ep_train = 0.0

    def take_epoch(self) -> tuple[int, int, float, float]:
        """(batches, steps, seconds waiting, seconds of steps) since the last call."""
        out = (self.ep_iters, self.ep_steps, self.ep_wait, self.ep_train)
        self.ep_iters = self.ep_steps = 0
        self.ep_wait = self.ep_train = 0.0
        return out

    def restart(self) -> None:
        """The loader's iterator starts an epoch again (``persistent_workers``: the same
        iterator is reused): the time since the last batch of an epoch that was left
        early (a ``break``, then validation) is not a training step."""
        self.last_end = None

    def step(self, t0: float, t1: float, done: bool) -> None:
        """One ``next()`` from ``t0`` to ``t1``; ``done``: it ended the epoch."""
        if self.last_end is not None:
            self.train += t0 - self.last_end
            self.steps += 1
            self.ep_train += t0 - self.last_end
            self.ep_steps += 1
        if done:
            self.last_end = None
            self.flush(t1)
            return
        self.wait += t1 - t0
        self.iters += 1
        self.ep_wait += t1 - t0
        self.ep_iters += 1
        self.last_end = t1
        if t1 - self.sent >= self.EVERY:
            self.flush(t1)

    def flush(self, now: float) -> None:
        if self.iters:
            loader = self.loader()
            target = loader.__dict__.get("_dlcachefs_target") if loader is not None else None
            if target is not None and target[0] not in _no_pace:
                mount, job, rank = target
                # the job line and rank= together: the write leaves this process bound
                # to its (job, rank) (see the grammar in clairvoyance.control)
                text = _p.text([_p.job_line(job), _p.pace_line(
                    self.iters, self.steps, self.wait, self.train, rank)])
                try:
                    write_control(mount, [text.encode()])
                except OSError as e:
                    if e.errno == errno.EINVAL:
                        _no_pace.add(mount)
                    _warn_once(f"pace:{mount}", f"could not report the training's pace to "
                               f"{mount} ({e})" + ("; no more pace reports go there (an "
                               "older dlcachefs daemon?)" if e.errno == errno.EINVAL else ""))
        self.iters = self.steps = 0
        self.wait = self.train = 0.0
        self.sent = now


def _send(t: Target, lines: list[str], job: str | None = None,
          extra_defs: Sequence[tuple[str, Callable[[], list[str]]]] = (),
          weak: bool = False, loader=None) -> bool:
    """``job`` + the view's ``dataset`` line + ``lines`` as one write, after the view's
    definition (and ``extra_defs``: (id, a function returning its writes)) unless this
    process sent them already (they are only encoded when they are sent).
    A refusal that may come from a new daemon (it lost the definitions) is retried once
    with them. ``weak``: see :func:`_claim`. ``loader``: its batch hint goes with the
    lines (same write: a ``batch`` line alone would restart the stream's set-up). Never
    raises: False and a warning once."""
    try:
        return _send_now(t, lines, job, extra_defs, weak, loader)
    except Exception as e:  # noqa: BLE001 - never break the training
        _warn_once("send", f"could not announce to {getattr(t, 'mount', '?')} ({e})")
        return False


#: mounts that refused a root line's ``set=``/``sfx=`` fields (EINVAL: an older daemon)
_no_list_fields: set[str] = set()
_LIST_FIELDS = re.compile(r" (?:set|sfx)=\S*")


def _for_mount(mount: str, line: str) -> str:
    """A definition line as ``mount``'s daemon takes it."""
    return _LIST_FIELDS.sub("", line) if mount in _no_list_fields else line


def _send_now(t: Target, lines: list[str], job: str | None,
              extra_defs: Sequence[tuple[str, Callable[[], list[str]]]], weak: bool,
              loader) -> bool:
    """:func:`_send`; raises on the unexpected (OSError of a write excepted)."""
    job = job or os.environ.get(ENV_JOB) or "default"
    if not _claim(job, t.vid, weak):
        return False
    text = _p.text([_p.job_line(job), t.dataset_line(), *lines, *_batch_hint(loader)])
    defs = [(t.vid, t.definition), *extra_defs]
    for attempt in range(3):
        had_all = all((t.mount, key) in _sent for key, _ in defs)
        sent_def = False
        try:
            for key, make in defs:
                if (t.mount, key) not in _sent:
                    sent_def = True
                    write_control(t.mount, [_for_mount(t.mount, w).encode()
                                            for w in make()])
                    _sent.add((t.mount, key))
            write_control(t.mount, [text.encode()])
            if loader is not None and hasattr(loader, "__dict__"):
                m = next((_RANK.search(x) for x in lines if x.startswith("sampler ")), None)
                loader.__dict__["_dlcachefs_target"] = (t.mount, job,
                                                        int(m.group(1)) if m else None)
            return True
        except OSError as e:
            if e.errno == errno.EINVAL and attempt == 0 and had_all:
                for key, _ in defs:
                    _sent.discard((t.mount, key))
                continue
            if e.errno == errno.EINVAL and sent_def and t.mount not in _no_list_fields:
                # a daemon older than the roots' ``set=``/``sfx=`` fields refuses the
                # definition whole: sent again without them (its own lexical check)
                _no_list_fields.add(t.mount)
                continue
            _warn_once(f"write:{t.mount}", f"could not announce to {t.mount} ({e}); see "
                       f"{t.mount}/.dlcache/errors. Training goes on without clairvoyance.")
            return False
    return False


def _mount_hint(ds) -> str | None:
    """The mount a dataset that cannot be resolved reads from: a path among its attributes
    (or the first item of a list/tuple attribute), two levels deep; a relative one is taken
    from the working directory, as the dataset's ``open`` takes it."""
    seen: set[int] = set()
    todo = [(ds, 0)]
    while todo:
        obj, depth = todo.pop(0)
        if id(obj) in seen or depth > 2:
            continue
        seen.add(id(obj))
        attrs = getattr(obj, "__dict__", None)
        if not isinstance(attrs, dict):
            continue
        for v in list(attrs.values())[:64]:
            if isinstance(v, (list, tuple)) and v:
                v = v[0][0] if isinstance(v[0], tuple) and v[0] else v[0]
            if isinstance(v, (str, os.PathLike)):
                try:
                    hit = find_mount(os.path.abspath(os.fspath(v))) if v else None
                except (TypeError, ValueError, OSError):
                    hit = None
                if hit is not None:
                    return hit[0]
            elif hasattr(v, "__dict__") and not isinstance(v, type):
                todo.append((v, depth + 1))
    return None


def _unknown(ds, reason: str, epoch: int, loader=None) -> None:
    """Tell the mount that this process reads in an order it cannot replay (it learns the
    order from the opens); warns once with the reason."""
    t = target_of(ds)
    if isinstance(t, Target):
        mount: str | None = t.mount
    elif _dlio.is_dataset(ds):  # its files are named in DLIO's configuration
        first = _dlio.first_file(ds)
        hit = find_mount(first) if first is not None else None
        mount = hit[0] if hit is not None else None
    else:
        mount = _mount_hint(ds)
    if mount is None:  # not reading from a dlcachefs mount, that we can tell
        if dlcachefs_mounts():  # (the stats of a mount it reads point here)
            _warn_once("nomount", f"the mount cannot know this training's order ({reason}), "
                       f"and the hook found no dlcachefs mount behind its dataset "
                       f"{type(ds).__name__} (no ImageFolder in it, no path in its "
                       f"attributes): nothing is announced; the mount serves its reads "
                       f"without knowing their order")
        return
    job = os.environ.get(ENV_JOB) or "default"
    if not _claim(job, t.vid if isinstance(t, Target) else f"unknown:{id(ds)}", weak=True):
        return
    _warn_once(f"unknown:{reason}", f"the mount cannot replay this training's order "
               f"({reason}); it learns it from the files read")
    text = _p.text([_p.job_line(job), _p.sampler_line("unknown", reason=reason[:200]),
                    _p.epoch_line(epoch), *_batch_hint(loader)])
    try:
        write_control(mount, [text.encode()])
        if loader is not None and hasattr(loader, "__dict__"):  # its pace goes there too
            loader.__dict__["_dlcachefs_target"] = (mount, job, None)
    except OSError as e:
        _warn_once(f"write:{mount}", f"could not announce to {mount} ({e})")


def _dataset_root(ds) -> str | None:
    root = getattr(ds, "root", None)
    if isinstance(root, (str, os.PathLike)) and hasattr(ds, "samples"):
        return os.fspath(root)
    return None


def _loader_of(sampler):
    """The DataLoader iterating ``sampler`` (bound by the DataLoader patch), or None."""
    ref = sampler.__dict__.get("_dlcachefs_loader")
    return ref() if ref is not None else None


def _draws(loader, g) -> str:
    """How the DataLoader draws from the sampler's generator ``g`` (its base seed)."""
    if loader is None or g is None or getattr(loader, "generator", None) is not g:
        return "none"
    return "first" if loader.persistent_workers and loader.num_workers > 0 else "each"


#: the next epoch number per announced view (mount, view id), for every loader of this
#: process: see _next_epoch
_epochs: OrderedDict[tuple[str, str], int] = OrderedDict()


def _next_epoch(obj, ds) -> int:
    """The epoch number an iteration of ``obj`` (a sampler or a DataLoader) over ``ds``
    announces: one past the last this process announced for the same dataset. Counted per
    dataset, not per object: a script that builds its DataLoader (and so its sampler)
    anew each epoch would otherwise announce epoch 0 again and again, and the mount would
    take each for a restart (its next-epoch log laid out for nothing, a learned order
    never seen to repeat). The dataset is its announced view when it has one (a dataset
    object built anew each epoch is the same view), else the dataset object itself (the
    count kept on it: an id() could be reused by the next object)."""
    own = obj.__dict__.get("_dlcachefs_epoch", 0)
    t = target_of(ds)
    if isinstance(t, Target):
        key = (t.mount, t.vid)
        epoch = max(own, _epochs.get(key, 0))
        _epochs[key] = epoch + 1
        _epochs.move_to_end(key)
        if len(_epochs) > 4096:  # bounded: the least recently announced view goes
            _epochs.popitem(last=False)
    else:
        d = getattr(ds, "__dict__", None)
        epoch = max(own, d.get("_dlcachefs_epoch", 0) if d is not None else 0)
        if d is not None and ds is not obj:
            d["_dlcachefs_epoch"] = epoch + 1
    obj._dlcachefs_epoch = epoch + 1
    return epoch


def _patch(data_module) -> None:
    import torch

    from dlcachefs.clairvoyance.replay import encode_state

    RandomSampler = data_module.RandomSampler
    DistributedSampler = data_module.DistributedSampler
    SubsetRandomSampler = data_module.SubsetRandomSampler
    SequentialSampler = data_module.SequentialSampler
    BatchSampler = data_module.BatchSampler
    DataLoader = data_module.DataLoader
    if getattr(RandomSampler, "_dlcachefs_patched", False):
        return
    orig_random_iter = RandomSampler.__iter__
    orig_dist_iter = DistributedSampler.__iter__
    orig_subset_iter = SubsetRandomSampler.__iter__
    orig_loader_iter = DataLoader.__iter__

    def dataset_of(sampler, own):
        loader = _loader_of(sampler)
        return loader.dataset if loader is not None else own

    def usable(ds, owner) -> Target | None:
        """The dataset's target; None (after telling the mount why, if it can be found)
        when it cannot be announced. ``owner`` counts the epochs of unknown orders."""
        t = target_of(ds)
        if isinstance(t, str):
            _unknown(ds, t, _next_epoch(owner, ds))
            return None
        return t

    def random_iter(self):
        try:
            t = usable(dataset_of(self, self.data_source), self)
        except Exception as e:  # noqa: BLE001 - never break the training
            _warn_once("hook", f"sampler hook failed: {e}")
            t = None
        if t is None:
            yield from orig_random_iter(self)
            return
        size = {"num_samples": self.num_samples, "replacement": bool(self.replacement)}
        epoch = _next_epoch(self, dataset_of(self, self.data_source))
        if self.generator is None:
            # exactly torch's own draw, at the same moment: the RNG stream is unchanged
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            g = torch.Generator()
            g.manual_seed(seed)
            _send(t, [_p.sampler_line("random", seed=seed, per_epoch=True, **size),
                      _p.epoch_line(epoch)], loader=_loader_of(self))
            proxy = copy.copy(self)
            proxy.generator = g
            yield from orig_random_iter(proxy)
            return
        g = self.generator
        try:  # get_state() does not advance the generator
            if g.device.type == "cpu":
                state = encode_state(g.get_state())
                _send(t, [_p.sampler_line("random", state=state, **size,
                                          loader_draws=_draws(_loader_of(self), g)),
                          _p.epoch_line(epoch)], loader=_loader_of(self))
            else:
                _unknown(dataset_of(self, self.data_source),
                         f"RandomSampler with a {g.device.type} generator", epoch)
        except Exception as e:  # noqa: BLE001
            _warn_once("hook", f"sampler hook failed: {e}")
        yield from orig_random_iter(self)

    def subset_iter(self):
        try:
            loader = _loader_of(self)
            t = usable(loader.dataset, self) if loader is not None else None
            if t is not None:
                idx = self.indices.tolist() if hasattr(self.indices, "tolist") \
                    else [int(i) for i in self.indices]
                lid = _p.index_list_id(idx)
                g = self.generator
                epoch = _next_epoch(self, loader.dataset)
                fields: dict[str, object] | None
                if g is None:  # torch.randperm(generator=None): the global generator
                    fields = {"state": encode_state(torch.default_generator.get_state()),
                              "per_epoch": True}
                elif g.device.type == "cpu":
                    fields = {"state": encode_state(g.get_state()),
                              "loader_draws": _draws(loader, g)}
                else:
                    fields = None
                    _unknown(loader.dataset, f"SubsetRandomSampler with a {g.device.type} "
                             f"generator", epoch)
                if fields is not None:
                    _send(t, [_p.sampler_line("subset_random", index=lid, **fields),
                              _p.epoch_line(epoch)],
                          extra_defs=[(lid, lambda: _p.index_writes(lid, idx))],
                          loader=loader)
        except Exception as e:  # noqa: BLE001 - never break the training
            _warn_once("hook", f"sampler hook failed: {e}")
        yield from orig_subset_iter(self)

    def dist_iter(self):
        try:
            t = usable(dataset_of(self, self.dataset), self)
            if t is not None:
                _send(t, [_p.sampler_line("distributed", seed=self.seed,
                                          world=self.num_replicas, rank=self.rank,
                                          shuffle=bool(self.shuffle),
                                          drop_last=bool(self.drop_last)),
                          _p.epoch_line(self.epoch)], loader=_loader_of(self))
        except Exception as e:  # noqa: BLE001
            _warn_once("hook", f"sampler hook failed: {e}")
        return orig_dist_iter(self)

    replayable = {RandomSampler: random_iter, DistributedSampler: dist_iter,
                  SubsetRandomSampler: subset_iter}

    def bind(loader) -> None:
        """Bind the loader to its samplers; announce what the sampler hooks cannot."""
        ref = weakref.ref(loader)
        bs = loader.batch_sampler
        inner = getattr(bs, "sampler", None) if bs is not None else loader.sampler
        for obj in (loader.sampler, bs, inner):
            if obj is not None and hasattr(obj, "__dict__"):
                obj.__dict__["_dlcachefs_loader"] = ref
        ds = loader.dataset
        if isinstance(ds, data_module.IterableDataset):
            _unknown(ds, f"{type(ds).__name__} is an IterableDataset", _next_epoch(loader, ds))
            return
        if bs is not None and type(bs) is not BatchSampler:
            reason = f"batch sampler {type(bs).__name__} is not replayable"
        elif inner is None:
            reason = f"batch sampler {type(bs).__name__} has no sampler attribute"
        elif type(inner).__iter__ in replayable.values():
            return  # its own hook announces it
        elif getattr(type(inner), "dlcachefs_announces", False):
            return  # it announces its own order (ImportanceSampler: sampler explicit)
        elif _dlio.is_sampler(inner):
            announce_dlio(loader, inner)
            return
        elif type(inner).__iter__ is SequentialSampler.__iter__:
            t = usable(ds, loader)
            if t is not None:
                _send(t, [_p.sampler_line("sequential"), _p.epoch_line(_next_epoch(loader, ds))],
                      weak=True, loader=loader)
            return
        else:
            reason = f"sampler {type(inner).__name__} is not replayable"
        _unknown(ds, reason, _next_epoch(loader, ds), loader)

    def announce_dlio(loader, sampler) -> None:
        """DLIO's sampler (:mod:`dlcachefs.data.dlio`): its orders previewed and sent as
        this rank's explicit orders, this epoch's (unless the last epoch sent it, as its
        next, rightly) and the next's, then the ``epoch`` line and the batch hint. The
        dataset and sampler lines (the head) go first, once per mount; the writes after
        the head carry no ``job`` line (it would bind the process to rank 0): they are
        this process's, bound to its rank by the head's sampler line. A refused write
        (a daemon that restarted lost the head) is sent again once with the head."""
        ds = loader.dataset
        t = usable(ds, loader)
        if t is None:
            return
        job = os.environ.get(ENV_JOB) or "default"
        weak = _dlio.is_eval(ds)
        if weak and _claims.get(job, t.vid) != t.vid:
            return  # the training loader's stream (_claim): no preview for nothing
        epoch = _next_epoch(loader, ds)
        memo = sampler.__dict__.get("_dlcachefs_sent")  # (mount, epoch, predicted id)
        predicted = memo[2] if memo is not None and memo[:2] == (t.mount, epoch) else None
        world, rank = _dlio.rank_of(sampler)
        for head in ([False, True] if memo is not None and memo[0] == t.mount else [True]):
            planned = _dlio.orders_to_send(sampler, epoch, None if head else predicted)
            if planned is None:
                _unknown(ds, "the DLIO sampler's order is longer than the mount takes",
                         epoch, loader)
                return
            orders, nxt = planned
            if head and not _send(t, [_p.sampler_line("explicit", world=world, rank=rank)],
                                  weak=weak):
                return
            writes: list[str] = []
            for k, (ep, order) in enumerate(orders):
                last = k == len(orders) - 1
                writes += _p.order_writes(ep, order, after=[_p.epoch_line(epoch),
                                                           *_batch_hint(loader)]
                                          if last else ())
            try:
                write_control(t.mount, [w.encode() for w in writes])
            except OSError as e:
                sampler.__dict__.pop("_dlcachefs_sent", None)
                if e.errno == errno.EINVAL and not head:
                    continue  # sent again with the head
                _warn_once(f"write:{t.mount}", f"could not announce DLIO's order to "
                           f"{t.mount} ({e}); see {t.mount}/.dlcache/errors. Training "
                           f"goes on.")
                return
            sampler.__dict__["_dlcachefs_sent"] = (t.mount, epoch + 1, nxt)
            if hasattr(loader, "__dict__"):  # its pace reports go to this rank's stream
                loader.__dict__["_dlcachefs_target"] = (t.mount, job, rank)
            return

    def loader_iter(self):
        tuner = _tuner(self, data_module) if _auto is not None else None
        if tuner is not None:
            try:  # before the announcement: its batch hint says the epoch's count
                tuner.epoch_start(self)
            except Exception as e:  # noqa: BLE001 - never break the training
                _warn_once("auto", f"--workers auto failed (the count stays): {e}")
        try:
            bind(self)
        except Exception as e:  # noqa: BLE001 - never break the training
            _warn_once("bind", f"DataLoader hook failed: {e}")
        if tuner is not None:
            it = tuner.make_iterator(self, lambda: orig_loader_iter(self))
        else:
            it = orig_loader_iter(self)
        try:
            d = getattr(it, "__dict__", None)
            if isinstance(d, dict):
                rec = d.get("_dlcachefs_pace")
                if isinstance(rec, _PaceReport):
                    rec.restart()  # persistent_workers: the same iterator, a new epoch
                else:
                    rec = d["_dlcachefs_pace"] = _PaceReport(self)
                if tuner is not None:
                    d["_dlcachefs_tuner"] = tuner
                    tuner.track(rec)
        except Exception as e:  # noqa: BLE001 - never break the training
            _warn_once("pace", f"pace report failed: {e}")
        return it

    RandomSampler.__iter__ = random_iter
    DistributedSampler.__iter__ = dist_iter
    SubsetRandomSampler.__iter__ = subset_iter
    DataLoader.__iter__ = loader_iter
    _time_next(getattr(getattr(data_module, "dataloader", None), "_BaseDataLoaderIter", None))
    RandomSampler._dlcachefs_patched = True


def _time_next(cls) -> None:
    """Time ``cls.__next__`` (torch's loader iterator) for iterators given a
    :class:`_PaceReport`; once per class."""
    if cls is None or cls.__dict__.get("_dlcachefs_timed"):
        return
    orig_next = cls.__next__

    def timed_next(self):
        rec = self.__dict__.get("_dlcachefs_pace")
        if rec is None:
            return orig_next(self)
        t0 = time.perf_counter()
        done = False
        try:
            return orig_next(self)
        except StopIteration:
            done = True
            raise
        finally:
            try:
                t1 = time.perf_counter()
                rec.step(t0, t1, done)
                tuner = self.__dict__.get("_dlcachefs_tuner") if not done else None
                if tuner is not None:
                    tuner.batch(self, t1)
            except Exception as e:  # noqa: BLE001 - never break the training
                _warn_once("pace", f"pace report failed: {e}")

    cls.__next__ = timed_next
    cls._dlcachefs_timed = True


def mounts_to_prepare(mounts: Sequence[str], argv: Sequence[str], cwd: str) -> list[str]:
    """The mounts a training starting with ``argv`` in ``cwd`` will likely read: those
    its command line names (an argument that is a mountpoint or a path inside one, also
    as ``--opt=PATH``) or its working directory is in; if none, every one of ``mounts``
    (the dataset may come from a config file)."""
    def inside(path: str, mnt: str) -> bool:
        return path == mnt or path.startswith(mnt.rstrip("/") + "/")

    named = []
    for a in [*argv, cwd]:
        a = a.partition("=")[2] if a.startswith("-") else a
        if a:
            p = os.path.abspath(os.path.join(cwd, a))
            named += [m for m in mounts if inside(p, m) and m not in named]
    return named or list(mounts)


def prepare_mounts(mounts: Sequence[str] | None = None) -> list[str]:
    """Tell dlcachefs mounts that a training is starting: one ``open`` of each one's
    control file, which starts the mount's sampler replay worker (it imports torch, ~3-4
    s, while the script imports its own). Default: the mounts of this user (their control
    file is the user's; root's for root) that :func:`mounts_to_prepare` picks from this
    process's command line and working directory. Errors are ignored. Returns the mounts
    told."""
    if mounts is None:
        def mine(ms: list[str]) -> list[str]:
            out = []
            for m in ms:
                with contextlib.suppress(OSError):
                    if os.stat(os.path.join(m, ".dlcache", "control")).st_uid == os.geteuid():
                        out.append(m)
            return out

        try:
            argv, cwd = list(getattr(sys, "argv", [])), os.getcwd()
        except OSError:  # the working directory was removed
            argv, cwd = [], "/"
        every = dlcachefs_mounts()
        named = mounts_to_prepare(every, argv, cwd)
        # the named ones first: a mount the training does not name (another user's, one
        # whose daemon is stopped) is not even stat'ed when it names one of its own
        mounts = mine(named) if len(named) < len(every) else []
        if not mounts:
            ours = mine(every)
            mounts = mounts_to_prepare(ours, argv, cwd) if ours else []
    told = []
    for mnt in mounts:
        with contextlib.suppress(OSError):
            os.close(os.open(os.path.join(mnt, ".dlcache", "control"), os.O_RDONLY))
            told.append(mnt)
    return told


def _prepare_quietly() -> None:
    """:func:`prepare_mounts` in the hook's thread: nothing it meets may print a traceback
    into the user's training (a mount table that cannot be read, say)."""
    with contextlib.suppress(Exception):  # a hint to the mounts, never the training's problem
        prepare_mounts()


def install(workers: str | None = None) -> None:
    """Patch the samplers now if torch is imported, else as soon as it is; and tell the
    mounts the training will read that it is starting (:func:`prepare_mounts`, in a
    background thread: a mount that does not answer must not hold the script back).
    ``workers``: ``auto`` or ``auto:MIN-MAX`` tunes every loader's ``num_workers`` each
    epoch (:mod:`dlcachefs.data.autoworkers`); default: ``$DLCACHEFS_WORKERS``, which
    ``dlcachefs run --workers`` sets."""
    global _installed, _auto
    if _installed:
        return
    _installed = True
    spec = workers if workers is not None else os.environ.get(ENV_WORKERS)
    if spec:
        from dlcachefs.data import autoworkers  # noqa: PLC0415 - only with --workers auto

        try:
            _auto = autoworkers.parse(spec)
        except ValueError as e:
            _warn_once("auto-spec", f"{e}: num_workers is left as the script sets it")
    import threading  # noqa: PLC0415 - only here

    threading.Thread(target=_prepare_quietly, name="dlcachefs-prepare", daemon=True).start()
    mod = sys.modules.get("torch.utils.data")
    if mod is not None:
        _patch(mod)
    else:
        sys.meta_path.insert(0, PatchOnImport("torch.utils.data", _patch, _patch_failed))


def _tuner(loader, data_module):
    """``loader``'s :class:`autoworkers.Tuner` (made at its first iteration); None when it
    is not tuned (the reason is a warning, once)."""
    from dlcachefs.data import autoworkers  # noqa: PLC0415

    try:
        t = loader.__dict__.get("_dlcachefs_tuner")
        if t is None and "_dlcachefs_untuned" not in loader.__dict__:
            why = autoworkers.eligible(loader, data_module)
            if why is None:
                t = loader.__dict__["_dlcachefs_tuner"] = autoworkers.Tuner(loader, _auto)
                t.sampler_global = autoworkers.sampler_draws_global(loader, data_module)
            else:
                loader.__dict__["_dlcachefs_untuned"] = why
                _warn_once(f"auto:{why}", f"--workers auto leaves a loader over {why} alone")
        return t
    except Exception as e:  # noqa: BLE001 - never break the training
        _warn_once("auto", f"--workers auto failed (the count stays): {e}")
        return None


def workers_report(loader) -> list[dict]:
    """``--workers auto``: the count of each epoch of ``loader`` and the measurements
    behind it (``epoch``, ``workers``, ``previous``, ``wanted``, ``capped_by``,
    ``t_fetch``, ``t_req``, ``mem_worker``, ``mem_up``, ``cpu_share``, ``kept``); empty
    when the loader is not tuned."""
    t = getattr(loader, "__dict__", {}).get("_dlcachefs_tuner")
    return [dict(r) for r in t.history] if t is not None else []


def _patch_failed(e: Exception) -> None:
    _warn_once("patch", f"could not install the sampler hook: {e}")


# ----- per-sample losses and explicit orders (importance sampling) ----------------------

def _as_list(x) -> list:
    """A flat Python list from a torch tensor (any device), a numpy array or a sequence."""
    if hasattr(x, "detach"):  # torch.Tensor
        x = x.detach().cpu().reshape(-1).tolist()
    elif hasattr(x, "tolist"):  # numpy array or scalar
        x = x.tolist()
    if isinstance(x, (int, float)):
        return [x]
    return list(x)


class LossReporter:
    """Sends per-sample training losses to the dlcachefs mount that holds a dataset, as
    ``loss INDEX VALUE ...`` lines of ``<mount>/.dlcache/control`` (an importance sampler
    on the mount side can then favour the hard samples)::

        reporter = LossReporter(train_set.root)
        for images, targets, indices in loader:      # see with_index()
            loss = F.cross_entropy(model(images), targets, reduction="none")
            reporter.report(indices, loss)
            loss.mean().backward()
            ...
        reporter.close()

    ``indices`` are indices of the dataset the DataLoader sees (what :func:`with_index`
    around that dataset yields): the ImageFolder's own indices when the loader reads the
    ImageFolder, the wrapper's when it reads a ``Subset``/``ConcatDataset``/user wrapper
    (the hook announces such a dataset as a view, and the mount maps the indices through
    it). ``dataset_root`` may be that dataset itself instead of a path: then a refused
    first write is retried with the view's ``dataset`` line (and definition). Pairs are
    buffered and written once ``max_pairs_per_write`` of them are pending, and by
    :meth:`flush` / :meth:`close` (also the end of a ``with`` block). Each write holds at
    most ``max_pairs_per_write`` pairs and 64 KiB, in lines of at most 4096 characters;
    values are sent with 9 significant digits (exact for float32 losses).

    The lines count for ``job`` (default: ``$DLCACHEFS_JOB``; if neither, the job this
    process announced last, as for every control write). The job needs a dataset on the
    mount side: the sampler hook (:func:`install`) sends it; if the first write is refused
    (EINVAL), it is sent again once with ``dataset RELPATH`` for ``dataset_root``.

    Nothing here breaks a training: when ``dataset_root`` is not on a dlcachefs mount,
    every call is a no-op (one warning); non-finite losses and negative indices are
    dropped (one warning); a refused or failed write is dropped with one warning (the
    reason is in ``<mount>/.dlcache/errors``).
    """

    def __init__(self, dataset_root, job: str | None = None,
                 max_pairs_per_write: int = 3000) -> None:
        self._view: Target | None = None
        if not isinstance(dataset_root, (str, os.PathLike)):  # the loader's dataset
            t = target_of(dataset_root)
            if isinstance(t, Target):
                self._view = t
                dataset_root = os.path.join(t.mount, t.rel)
            else:
                dataset_root = _dataset_root(dataset_root) or "/nonexistent-dataset"
        self.dataset_root = os.fspath(dataset_root)
        self.job = job or os.environ.get(ENV_JOB) or None
        self.max_pairs = max(1, int(max_pairs_per_write))
        self._indices: list[int] = []
        self._values: list[float] = []
        self._dataset_sent = False
        self.sent_pairs = 0  # pairs written and accepted
        self.dropped_pairs = 0  # non-finite, negative or refused
        target = find_mount(self.dataset_root)
        if target is None:
            self.mount: str | None = None
            self.rel: str | None = None
            _warn_once(f"loss-nomount:{self.dataset_root}",
                       f"{self.dataset_root} is not on a dlcachefs mount: losses are not reported")
        else:
            self.mount, self.rel = target

    @property
    def enabled(self) -> bool:
        """True when the dataset is on a dlcachefs mount (else every call is a no-op)."""
        return self.mount is not None

    def report(self, indices, losses) -> None:
        """Queue the losses of the samples ``indices`` (same length; torch tensors on any
        device, numpy arrays or sequences). Writes when enough pairs are pending."""
        if self.mount is None:
            return
        idx, vals = _as_list(indices), _as_list(losses)
        if len(idx) != len(vals):
            raise ValueError(f"LossReporter.report: {len(idx)} indices but {len(vals)} losses")
        bad = 0
        isfinite = math.isfinite
        for i, v in zip(idx, vals, strict=True):
            i, v = int(i), float(v)
            if i < 0 or not isfinite(v):
                bad += 1
                continue
            self._indices.append(i)
            self._values.append(v)
        if bad:
            self.dropped_pairs += bad
            _warn_once("loss-nonfinite", "non-finite losses (or negative indices) are not "
                       "reported to the mount")
        if len(self._indices) >= self.max_pairs:
            self.flush()

    def flush(self) -> None:
        """Write every pending pair now (one ``os.write`` per batch of lines)."""
        if self.mount is None or not self._indices:
            return
        idx, vals = self._indices, self._values
        self._indices, self._values = [], []
        writes = self._encode(idx, vals)
        path = os.path.join(self.mount, ".dlcache", "control")
        try:
            fd = os.open(path, os.O_WRONLY)
        except OSError as e:
            self._failed(len(idx), e)
            return
        try:
            for data, n in writes:
                try:
                    os.write(fd, data)
                except OSError as e:
                    if e.errno == errno.EINVAL and not self._dataset_sent and self.rel:
                        # maybe the job has no dataset yet: name it and try once more
                        self._dataset_sent = True
                        try:
                            if self._view is not None:  # its definition, if not sent yet
                                for key, defs in [(self._view.vid, self._view.definition())]:
                                    if (self._view.mount, key) not in _sent:
                                        write_control(self._view.mount,
                                                      [d.encode() for d in defs])
                                        _sent.add((self._view.mount, key))
                            os.write(fd, self._head(with_dataset=True) + data[len(self._head()):])
                        except OSError as e2:
                            self._failed(n, e2)
                        else:
                            self.sent_pairs += n
                        continue
                    self._failed(n, e)
                else:
                    self.sent_pairs += n
        finally:
            os.close(fd)

    def close(self) -> None:
        """Flush; the reporter can still be used afterwards."""
        self.flush()

    def __enter__(self) -> LossReporter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _failed(self, n: int, e: OSError) -> None:
        self.dropped_pairs += n
        _warn_once(f"loss-write:{self.mount}",
                   f"could not report losses to {self.mount} ({e}); see "
                   f"{self.mount}/.dlcache/errors. Training goes on.")

    def _head(self, with_dataset: bool = False) -> bytes:
        lines = [_p.job_line(self.job)] if self.job else []
        if with_dataset:
            lines.append(self._view.dataset_line() if self._view is not None
                         else _p.dataset_line(self.rel or ""))
        return _p.text(lines).encode()

    def _encode(self, idx: list[int], vals: list[float]) -> list[tuple[bytes, int]]:
        """The writes for these pairs: (bytes, number of pairs) each, at most ``max_pairs``
        pairs each, with room for the ``dataset`` line a refused write is sent again with."""
        head = self._head()
        reserve = len(self._head(with_dataset=True)) - len(head)
        return [(w.encode(), n) for w, n in _p.loss_writes(idx, vals, head.decode(), reserve,
                                                           self.max_pairs)]


def with_index(dataset):
    """Wrap ``dataset`` so that item ``i`` is ``(*dataset[i], i)``: ``(sample, target,
    index)`` for an ImageFolder, what :class:`LossReporter` needs. Other attributes
    (``root``, ``samples``, ``targets``, ``classes``...) are the wrapped dataset's, so
    the sampler hook still finds the dataset's root. Returns a
    ``torch.utils.data.Dataset`` (torch is imported here, not with this module).

    Wrap the dataset the DataLoader reads (``with_index(Subset(...))``, not
    ``Subset(with_index(...))``): its indices are the ones the mount knows (the sampler
    hook announces that dataset, wrappers included)."""
    return _with_index_class()(dataset)


@lru_cache(maxsize=1)
def _with_index_class() -> type:
    from torch.utils.data import Dataset

    class WithIndex(Dataset):
        """``dataset[i]`` followed by ``i``; attributes pass through to ``dataset``."""

        def __init__(self, dataset) -> None:
            self.dataset = dataset

        def __len__(self) -> int:
            return len(self.dataset)

        def __getitem__(self, i):
            item = self.dataset[i]
            if isinstance(item, tuple):
                return (*item, i)
            return (item, i)

        def __getattr__(self, name: str):
            # only called for what the wrapper lacks; never for dunders (DataLoader probes
            # __getitems__, which would bypass __getitem__) nor before __init__ (unpickling)
            if name.startswith("__") or "dataset" not in self.__dict__:
                raise AttributeError(name)
            return getattr(self.__dict__["dataset"], name)

        def __repr__(self) -> str:
            return f"WithIndex({self.dataset!r})"

    WithIndex.__module__ = __name__
    WithIndex.__qualname__ = "WithIndex"
    return WithIndex


class ImportanceSampler:
    """iCACHE's I/O-oriented importance sampling (IIS) as a DataLoader sampler.

    Before each epoch it decides which samples the epoch trains on from their latest
    losses (:func:`dlcachefs.importance.scores.select_epoch`: a seeded permutation; full epochs
    during ``warmup`` and every ``full_every``-th epoch; otherwise sample ``s`` is kept
    with probability ``rank(s) ** beta``), and announces that exact order to the mount
    (``sampler explicit`` + ``order`` lines + ``epoch``), so the mount prefetches and lays
    out what is read, and caches by importance. Feed it the losses with :meth:`record`
    (and the mount with a :class:`LossReporter`)::

        ds = with_index(ImageFolder(root))
        sampler = ImportanceSampler(ds, seed=0)
        loader = DataLoader(ds, sampler=sampler, batch_size=64, num_workers=4)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for x, y, idx in loader:
                loss = F.cross_entropy(model(x), y, reduction="none")
                sampler.record(idx, loss); reporter.report(idx, loss)
                loss.mean().backward(); ...

    Works without a mount too (the selection is the same; nothing is announced).
    """

    #: the DataLoader hook leaves its announcement alone (it would say ``unknown``)
    dlcachefs_announces = True

    def __init__(self, dataset, seed: int = 0, beta: float = 0.33, warmup: int = 2,
                 full_every: int = 3, job: str | None = None, announce: bool = True) -> None:
        self.n = len(dataset)
        self.seed, self.beta, self.warmup, self.full_every = seed, beta, warmup, full_every
        self.iv = [math.nan] * self.n
        self.epoch = 0
        self.job = job or os.environ.get(ENV_JOB) or "default"
        root = _dataset_root(dataset)
        view = target_of(dataset) if announce else None
        # a wrapped dataset (Subset, ...) is announced as a view: its indices are ours
        self._view: Target | None = view if isinstance(view, Target) else None
        self._target = (view.mount, view.rel) if self._view is not None else \
            find_mount(root) if (announce and root) else None
        self._order: list[int] | None = None
        self._announced: int | None = None
        self._announced_head = False

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self._order = None

    def record(self, indices, losses) -> None:
        """Latest loss per sample (non-finite values are ignored)."""
        for i, v in zip(_as_list(indices), _as_list(losses), strict=True):
            v = float(v)
            if math.isfinite(v) and 0 <= int(i) < self.n:
                self.iv[int(i)] = v

    def order(self) -> list[int]:
        """The samples of the current epoch, in order (computed once per epoch)."""
        if self._order is None:
            from dlcachefs.importance.scores import select_epoch  # noqa: PLC0415

            known = any(not math.isnan(v) for v in self.iv)
            self._order = select_epoch(self.n, self.epoch, self.seed,
                                       self.iv if known else None, beta=self.beta,
                                       warmup=self.warmup, full_every=self.full_every)
        return self._order

    def __len__(self) -> int:
        return len(self.order())

    def __iter__(self):
        order = self.order()
        if self._target is not None and self._announced != self.epoch:
            self._announced = self.epoch
            self._announce(order)
        return iter(order)

    def _announce(self, order: list[int]) -> None:
        assert self._target is not None
        mount, rel = self._target
        # dataset and sampler once: re-sending the sampler would restart the running
        # epoch's stream before this epoch's order is complete
        job = _p.text([_p.job_line(self.job)])
        ds_line = self._view.dataset_line() if self._view is not None else _p.dataset_line(rel)
        head = job if self._announced_head else (
            job + _p.text([ds_line, _p.sampler_line("explicit")]))
        epoch = self.epoch
        loader = _loader_of(self)  # its batch hint too (dlcachefs advise uses it)
        writes = _p.order_writes(epoch, order, head, next_head=job,
                                 after=[_p.epoch_line(epoch), *_batch_hint(loader)])
        if self._view is not None and not self._announced_head:
            writes = self._view.definition() + writes
        try:
            write_control(mount, [w.encode() for w in writes])
            self._announced_head = True
            if loader is not None and hasattr(loader, "__dict__"):  # and its pace
                loader.__dict__["_dlcachefs_target"] = (mount, self.job, None)
        except OSError as e:
            _warn_once(f"iis:{mount}", f"could not announce the importance order to {mount} "
                       f"({e}); see {mount}/.dlcache/errors. Training goes on.")


def __getattr__(name: str):
    # ``dlcachefs.torch.WithIndex``: the class, built (and torch imported) on first use
    if name == "WithIndex":
        return _with_index_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
