"""The sample lists a mount made of its datasets: made once, kept few, guessed ahead.

A stream's order is a list of dataset indices; its sample list
(:mod:`dlcachefs.clairvoyance.samplelist`) says which file each index names. Lists are
made in a worker thread from the namespace snapshot, once however many callers wait
(:meth:`SampleLists.ensure_sample_list`); a dataset that is a *view* (wrapped
ImageFolders, :mod:`dlcachefs.data.wrappers`) is the concatenation of its roots'
lists seen through its index list, each root's list checked against the training's
digest first (:meth:`SampleLists.view_samples`): the training's list is the truth, and
the known orders are tried in turn (torchvision's ImageFolder, timm's folder reader
sorted by its ``natural_key``, the same unsorted); a root none of them gives is a
:class:`SampleListMismatch`, whose reason says whether the training lists the same
files in another order or other files (the stream then learns its order from the
opens). A training builds its ImageFolder
before it announces: when a directory is opened right after its parent and the parent
looks like a dataset root, the parent's list is made ahead (:meth:`note_opendir`); or the
directory's own, when it is such a root itself (a split, ``train/`` of a root that holds
``train/`` and ``val/``).

Concurrency: trio loop; the listings run in worker threads, as tasks of
:meth:`SampleLists.run`'s nursery (or of their caller's).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections import OrderedDict
from collections.abc import Callable

import trio

from dlcachefs.cache.namespace import Namespace
from dlcachefs.cache.tasks import TaskOwner
from dlcachefs.clairvoyance.control import JobState, RootDef, ViewDef
from dlcachefs.clairvoyance.protocol import paths_digest, set_digest
from dlcachefs.clairvoyance.samplelist import (
    IMG_EXTENSIONS,
    SampleList,
    image_folder,
    links_leaving,
    timm_folder,
)
from dlcachefs.clairvoyance.stream import StreamTable
from dlcachefs.errors import DlcError
from dlcachefs.store.index import Index
from dlcachefs.store.integrity import log_failure
from dlcachefs.store.schema import Entry

log = logging.getLogger(__name__)

MAX_SAMPLE_LISTS = 4  # sample lists kept (train and val views of the jobs, a guess)
MAX_GUESSES = 8  # directories listed ahead of an announcement, per mount
LIST_RETRY_S = 30.0  # a dataset whose listing failed is not listed again before this
#: a directory of at most this many subdirectories, each an ImageFolder root itself, holds
#: splits (train/, val/, test/), not classes (an ImageFolder of a few classes, each of
#: subdirectories of samples, is taken for one too: then its list is made at the
#: announcement instead of ahead)
MAX_SPLITS = 8


class SampleListMismatch(ValueError):
    """The mount cannot make a root's list as the training has it (see the module doc):
    its order is learned from the opens instead. ``str(e)`` says why."""


def dataset_key(js: JobState) -> str | None:
    """The key of a job's sample list: its ImageFolder root, or ``ROOT@VID`` for a view
    (a wrapped dataset: several roots and/or an index list, see :mod:`dlcachefs.data.wrappers`)."""
    if js.dataset is None or js.view is None:
        return js.dataset
    return f"{js.dataset or '.'}@{js.view.vid}"


class SampleLists(TaskOwner):
    """The mount's sample lists by dataset key (see the module doc)."""

    def __init__(self, ns: Namespace, index: Index, streams: StreamTable) -> None:
        """``streams``: the lists they read by stay found when evicted from the few kept."""
        super().__init__()
        self.ns = ns
        self.index = index
        self.streams = streams
        # the last sample lists made (a 1.28M-sample list is ~150 MB: keep a few)
        self._samplelists: OrderedDict[str, SampleList] = OrderedDict()
        self._last_opendir = 0
        self._guessed: set[int] = set()  # directories listed ahead of an announcement
        self._listing: dict[str, trio.Event] = {}  # dataset -> its list is being made
        # dataset -> (when, why, a mismatch?)
        self._list_failed: dict[str, tuple[float, str, bool]] = {}
        # (rel, extensions) -> a root's list verified against a training's, with its
        # count and digest: a view built later (the files changed) is checked against it
        self._roots: dict[tuple, tuple[SampleList, int, str]] = {}

    def sample_list(self, dataset: str) -> SampleList | None:
        """The ImageFolder sample list of ``dataset`` if it has been made."""
        sl = self._samplelists.get(dataset)
        if sl is not None:
            self._samplelists.move_to_end(dataset)
            return sl
        # a list evicted from the few kept (guesses ahead of announcements) is still the
        # one a stream reads by
        return self.streams.samples_read(dataset)

    def dataset_size(self, rel: str) -> int | None:
        """Samples in the ImageFolder at ``rel`` when a stream has listed it (else None)."""
        sl = self.sample_list(rel)
        return None if sl is None else len(sl.inos)

    def note_opendir(self, d: Entry) -> None:
        """A directory of the mirror was opened. A training script builds its ImageFolder
        before it announces: it lists the root, then walks each class directory. When a
        directory is opened right after its parent and the parent looks like a dataset
        root (mostly subdirectories), the parent's sample list is made in the background,
        so that the announcement that follows finds it ready (listing 1.28M samples takes
        seconds). Bounded: one guess in flight, each directory once, ``MAX_GUESSES`` per
        mount. (The replay worker is not started here: a training under the hook starts
        it at its start, any announcement starts it, and a script that does neither
        never needs torch in the daemon.)
        Trio loop."""
        try:
            self._guess(d)
        except Exception:  # noqa: BLE001 - a guess must never fail the opendir
            log_failure(log, "listing ahead of an announcement failed")

    def _guess(self, d: Entry) -> None:
        parent, self._last_opendir = self._last_opendir, d.ino
        if (d.parent != parent or parent in self._guessed or self._listing
                or len(self._guessed) >= MAX_GUESSES or not self.running):
            return
        try:
            p = self.ns.get(parent)
        except DlcError:
            return
        dirs = self._mostly_dirs(parent)
        if dirs is None:
            return
        if len(dirs) <= MAX_SPLITS and all(self._holds_classes(k[1]) for k in dirs):
            # each subdirectory is such a root itself (its subdirectories hold the
            # files): the parent holds splits (train/, val/), not classes. The split
            # opened is the dataset being scanned; the parent is no ImageFolder root
            p, parent = d, d.ino
            if parent in self._guessed:
                return
        self._guessed.add(parent)
        rel = os.fsdecode(self.ns.path_of(p))
        if rel not in self._samplelists:
            log.info("listing %r ahead of an announcement (an ImageFolder scan was seen)",
                     rel or ".")
            self.list_soon(rel, lambda _d: None)

    def _mostly_dirs(self, ino: int) -> list[tuple[bytes, int, int, int]] | None:
        """The subdirectories of directory ``ino`` when it looks like a dataset root: at
        least two, and at least half of its entries (else None)."""
        kids = self.index.list_dir_typed(ino)
        dirs = [k for k in kids if stat.S_ISDIR(k[2])]
        return dirs if len(dirs) >= 2 and 2 * len(dirs) >= len(kids) else None

    def _holds_classes(self, ino: int) -> bool:
        """Whether directory ``ino`` looks like an ImageFolder root itself: mostly
        subdirectories, the first of which holds files (a class directory of samples).
        A listing of the directory and of the first entries of its first subdirectory."""
        dirs = self._mostly_dirs(ino)
        if dirs is None:
            return False
        # (the first entries only: this runs on the loop, and a class directory may
        # hold 50,000 files)
        first = self.index.list_dir_typed(dirs[0][1], limit=64)
        return any(stat.S_ISREG(k[2]) for k in first)

    async def ensure_sample_list(self, dataset: str, view: ViewDef | None = None
                                 ) -> SampleList:
        """The sample list of ``dataset`` (an ImageFolder root, or a view's key with its
        ``view``), made in a thread from the snapshot on first use (once, however many
        callers wait for it). Raises what listing raises."""
        while True:
            samples = self.sample_list(dataset)
            if samples is not None:
                return samples
            busy = self._listing.get(dataset)
            if busy is None:
                break
            await busy.wait()  # then look again: made, or failed (and maybe retried)
        failed = self._list_failed.get(dataset)
        if failed is not None and time.monotonic() - failed[0] < LIST_RETRY_S:
            # a listing that just failed is not redone at once
            raise (SampleListMismatch if failed[2] else DlcError)(failed[1])
        done = self._listing[dataset] = trio.Event()
        try:
            if view is None:
                samples = await trio.to_thread.run_sync(image_folder, self.ns, dataset)
            else:
                samples = await trio.to_thread.run_sync(self.view_samples, dataset, view)
        except (DlcError, ValueError, OSError) as e:
            self._list_failed[dataset] = (time.monotonic(), str(e),
                                          isinstance(e, SampleListMismatch))
            while len(self._list_failed) > 64:
                self._list_failed.pop(next(iter(self._list_failed)))
            raise
        finally:
            if self._listing.get(dataset) is done:
                del self._listing[dataset]
            done.set()
        self._list_failed.pop(dataset, None)
        self._samplelists[dataset] = samples
        while len(self._samplelists) > MAX_SAMPLE_LISTS:
            self._samplelists.popitem(last=False)
        return samples

    def list_soon(self, dataset: str, then: Callable[[str], None],
                  view: ViewDef | None = None) -> None:
        """Make the sample list of ``dataset`` (with its ``view``, see
        :meth:`ensure_sample_list`) in the background, then call ``then(dataset)`` on the
        loop (also when listing failed: the list is then None)."""

        async def task() -> None:
            try:
                await self.ensure_sample_list(dataset, view)
            except SampleListMismatch as e:  # the stream learns its order: said there
                log.info("dataset %r: %s", dataset, e)
            except Exception as e:  # noqa: BLE001 - reported through then()
                log.warning("dataset %r: cannot make its sample list: %s", dataset, e)
            try:
                then(dataset)
            except Exception:  # noqa: BLE001 - a background task must not end the mount
                log_failure(log, "dataset %r: applying what waited for its list failed",
                              dataset)

        if not self.spawn(task):
            then(dataset)

    def view_samples(self, key: str, view: ViewDef) -> SampleList:
        """Thread: the view's sample list; :class:`SampleListMismatch` when a root's
        listing differs from the training's (never a silently wrong order)."""
        inos: list[int] = []
        labels: list[int] = []
        paths: list[str] = []
        nbytes = 0
        for r in view.roots:
            rk = (r.rel, r.extensions, r.suffixes)
            known = self._roots.get(rk)
            # a root's list made or verified earlier holds only while the training's is
            # the same: one that rebuilt its ImageFolder after files were added or
            # deleted has another count or digest, and the earlier list replayed its
            # order over the wrong samples (403 misses of 600 in the sweep)
            sl = known[0] if known is not None and known[1:] == (r.count, r.sha) else None
            if sl is None:
                sl = self._root_list(r)
                if len(self._roots) > 16:
                    self._roots.clear()
                self._roots[rk] = (sl, r.count, r.sha)
            inos += sl.inos
            labels += sl.labels
            nbytes += sl.nbytes
            prefix = f"{r.rel}/" if r.rel else ""
            paths += [prefix + p for p in sl.paths]
        if view.index is not None:
            idx = view.index
            inos = [inos[j] for j in idx]
            labels = [labels[j] for j in idx]
            paths = [paths[j] for j in idx]
            nbytes = sum(self.ns.size_of(i) for i in inos if i)
        return SampleList(key, [], inos, labels, paths, nbytes)

    def _root_list(self, r: RootDef) -> SampleList:
        """Thread: the list of root ``r`` in the order the training has it: the known
        orders tried in turn (see the module doc), each only when the one before is not
        the training's; raises :class:`SampleListMismatch` when none is."""
        tried: list[SampleList] = []

        def matches(sl: SampleList) -> bool:
            tried.append(sl)
            return len(sl) == r.count and paths_digest(sl.paths) == r.sha

        sl = self._samplelists.get(r.rel) if r.extensions == IMG_EXTENSIONS else None
        if sl is not None and matches(sl):
            return sl
        tv = image_folder(self.ns, r.rel, r.extensions, r.suffixes)  # (listed anew)
        if matches(tv):
            return tv
        timm = timm_folder(self.ns, r.rel, r.extensions, r.suffixes)
        if matches(timm):
            log.info("root %r: the training's list is in timm's order (natural_key)",
                     r.rel or ".")
            return timm
        walk = timm_folder(self.ns, r.rel, r.extensions, r.suffixes, sort=False)
        if matches(walk):
            log.info("root %r: the training's list is in timm's unsorted order", r.rel or ".")
            return walk
        raise SampleListMismatch(self._mismatch(r, tv, tried))

    def _mismatch(self, r: RootDef, tv: SampleList, tried: list[SampleList]) -> str:
        """Thread: why no list of the mount's is root ``r``'s (the cause, as far as the
        training's digests tell it)."""
        where = f"sample list mismatch under {r.rel or '.'!r}"
        if r.set_sha is not None:
            same = next((sl for sl in tried if len(sl) == r.count
                         and set_digest(sl.paths) == r.set_sha), None)
            if same is not None:
                return (f"{where}: the training's sample list is in another sort order than "
                        f"torchvision's or timm's (the same {r.count} files)")
        # the list nearest in length is the one compared (timm's for a timm training)
        near = min(tried, key=lambda sl: abs(len(sl) - r.count)) if tried else tv
        hint = " (a custom is_valid_file, or timm's class_map?)" if r.extensions is None else ""
        out = links_leaving(self.ns, r.rel)
        if out:
            hint += (f" ({out} symlinks in it dangle or lead out of the source: the "
                     f"training follows them to files the mount does not hold)")
        if len(near) != r.count:
            what = ""
        elif r.set_sha is not None:
            what = " (same count, other files)"
        else:
            what = " (same count, other files or order)"
        return (f"{where}: the mount lists {len(near)} files, the training {r.count}"
                f"{what}{hint}")
