"""Tell a dlcachefs mount how a PyTorch training samples its dataset.

``install()`` patches ``RandomSampler`` and ``DistributedSampler`` so that, at the start
of every epoch, they write their sampler and epoch into ``<mount>/.dlcache/control`` of
the mount that holds their dataset (an ImageFolder-like dataset with a ``root``). The
training itself is unchanged, bit for bit:

* ``RandomSampler`` without a generator draws its per-epoch seed from the global RNG with
  ``torch.empty((), dtype=torch.int64).random_()``; the patch makes exactly that draw, at
  the same moment (the first ``next()``), builds the same generator from it, lets torch's
  own ``__iter__`` run with it, and announces the seed (``per_epoch=true``).
* ``DistributedSampler`` orders by ``seed + epoch``: the patch announces them and calls
  torch's own ``__iter__``.
* A ``RandomSampler`` with its own generator is left alone (its state cannot be written
  as a seed); call :func:`announce` for it, or let it run without clairvoyance.

``dlcachefs run -- python train.py`` installs this without editing the script (through
a ``sitecustomize`` on ``PYTHONPATH`` that patches torch when ``torch.utils.data`` is
imported). Nothing here ever breaks a training: a failed announcement is a warning.
"""

from __future__ import annotations

import copy
import importlib.abc
import importlib.util
import os
import sys
import warnings
from functools import lru_cache

ENV_JOB = "DLCACHEFS_JOB"
_installed = False
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
    text = f"job {job}\ndataset {rel}\n" + "".join(line + "\n" for line in lines)
    try:
        fd = os.open(os.path.join(mount, ".dlcache", "control"), os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)
    except OSError as e:
        _warn_once(f"write:{mount}", f"could not announce to {mount} ({e}); see "
                   f"{mount}/.dlcache/errors. Training goes on without clairvoyance.")
        return False
    return True


def _dataset_root(ds) -> str | None:
    root = getattr(ds, "root", None)
    if isinstance(root, (str, os.PathLike)) and hasattr(ds, "samples"):
        return os.fspath(root)
    return None


def _patch(data_module) -> None:
    import torch

    RandomSampler = data_module.RandomSampler
    DistributedSampler = data_module.DistributedSampler
    if getattr(RandomSampler, "_dlcachefs_patched", False):
        return
    orig_random_iter = RandomSampler.__iter__
    orig_dist_iter = DistributedSampler.__iter__

    def random_iter(self):
        root = _dataset_root(self.data_source)
        if root is None or find_mount(root) is None:
            yield from orig_random_iter(self)
            return
        if self.generator is not None:
            _warn_once("gen", "a RandomSampler with its own generator is not announced; "
                       "use dlcachefs.torch.announce() to give the mount its order")
            yield from orig_random_iter(self)
            return
        # exactly torch's own draw, at the same moment: the RNG stream is unchanged
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        g = torch.Generator()
        g.manual_seed(seed)
        epoch = self.__dict__.get("_dlcachefs_epoch", 0)
        self._dlcachefs_epoch = epoch + 1
        announce(root, [f"sampler random seed={seed} per_epoch=true "
                        f"num_samples={self.num_samples} "
                        f"replacement={str(bool(self.replacement)).lower()}",
                        f"epoch {epoch}"])
        proxy = copy.copy(self)
        proxy.generator = g
        yield from orig_random_iter(proxy)

    def dist_iter(self):
        root = _dataset_root(self.dataset)
        if root is not None and find_mount(root) is not None:
            announce(root, [f"sampler distributed seed={self.seed} world={self.num_replicas} "
                            f"rank={self.rank} shuffle={str(bool(self.shuffle)).lower()} "
                            f"drop_last={str(bool(self.drop_last)).lower()}",
                            f"epoch {self.epoch}"])
        return orig_dist_iter(self)

    RandomSampler.__iter__ = random_iter
    DistributedSampler.__iter__ = dist_iter
    RandomSampler._dlcachefs_patched = True


def install() -> None:
    """Patch the samplers now if torch is imported, else as soon as it is."""
    global _installed
    if _installed:
        return
    _installed = True
    mod = sys.modules.get("torch.utils.data")
    if mod is not None:
        _patch(mod)
    else:
        sys.meta_path.insert(0, _PatchOnImport())


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Runs :func:`_patch` right after ``torch.utils.data`` is executed (one shot)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch.utils.data":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        orig_exec = spec.loader.exec_module

        def exec_module(module):
            orig_exec(module)
            try:
                _patch(module)
            except Exception as e:  # noqa: BLE001 - never break the training
                _warn_once("patch", f"could not install the sampler hook: {e}")

        spec.loader.exec_module = exec_module
        return spec
