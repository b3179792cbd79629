"""Tier 2: the mount's composite sample list of a view (wrapped DatasetFolders) over a
scanned namespace names, index for index, the file torch reads; a list that differs from
the training's (custom is_valid_file) is refused with the reason, never replayed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_t2_samplelist import scanned, touch

folder = pytest.importorskip("torchvision.datasets.folder")
data = pytest.importorskip("torch.utils.data")

from dlcachefs.clairvoyance import protocol as P  # noqa: E402
from dlcachefs.clairvoyance.control import ControlState  # noqa: E402
from dlcachefs.clairvoyance.listings import SampleLists  # noqa: E402
from dlcachefs.clairvoyance.stream import StreamTable  # noqa: E402
from dlcachefs.data import wrappers as w  # noqa: E402


def _lists(eng) -> SampleLists:
    """The mount's sample lists, which list views (no trio: view_samples is called as
    its thread would)."""
    return SampleLists(eng.ns, eng.index, StreamTable())


def announce_view(eng, src: Path, ds) -> tuple[ControlState, str]:
    """The view lines the hook would send for ``ds`` (roots under ``src``), applied."""
    view = w.resolve(ds)
    rels = [os.path.relpath(r.path, src) for r in view.roots]
    rels = [P.normalize_rel(r) for r in rels]
    lid = P.index_list_id(view.index) if view.index is not None else None
    vid = P.view_id(rels, view.roots, lid)
    cs = ControlState(lambda rel: eng.ns.resolve(os.fsencode(rel)).ino)
    writes = P.index_writes(lid, view.index) if lid else []
    writes.append(P.text(P.view_lines(vid, rels, view.roots, lid)))
    for text in writes:
        cs.apply(text.encode(), 1)
    return cs, vid


def test_composite_list_matches_torch(tmp_path):
    src = tmp_path / "src"
    touch(src, "train/b/1.txt", "train/b/2.dat", "train/a/3.TXT", "train/a/skip.jpg",
          "train/a/sub/4.dat", "val/x/5.png", "val/y/6.jpg", "val/y/7.txt")
    tr = folder.DatasetFolder(str(src / "train"), loader=lambda p: p,
                              extensions=(".txt", ".dat"))
    va = folder.ImageFolder(str(src / "val"), loader=lambda p: p)
    ds = data.Subset(data.ConcatDataset([tr, data.Subset(va, [1, 0])]), [5, 0, 4, 2, 2])
    with scanned(src, tmp_path / "cache") as eng:
        cs, vid = announce_view(eng, src, ds)
        sl = _lists(eng).view_samples("k", cs.views[vid])
        assert len(sl) == len(ds)
        for i in range(len(ds)):
            path, _label = ds[i]
            assert sl.paths[i] == os.path.relpath(path, src)
            assert eng.ns.path_of(eng.ns.get(sl.inos[i])) == os.fsencode(os.path.relpath(path, src))


def test_custom_is_valid_file_mismatch_is_refused(tmp_path):
    src = tmp_path / "src"
    touch(src, "a/1.jpg", "a/2.jpg", "b/3.jpg", "b/notes.txt")
    ok = folder.DatasetFolder(str(src), loader=lambda p: p, is_valid_file=lambda p: True)
    odd = folder.DatasetFolder(str(src), loader=lambda p: p,
                               is_valid_file=lambda p: not p.endswith("2.jpg"))
    with scanned(src, tmp_path / "cache") as eng:
        cs, vid = announce_view(eng, src, ok)  # accepts every file: the listing agrees
        assert len(_lists(eng).view_samples("k", cs.views[vid])) == 4
        cs, vid = announce_view(eng, src, odd)
        with pytest.raises(ValueError, match="sample list mismatch.*3.*is_valid_file"):
            _lists(eng).view_samples("k", cs.views[vid])


def test_a_root_rebuilt_after_files_were_added_is_listed_anew(tmp_path):
    """Sweep F2: a training that rebuilds its ImageFolder after files were added (or
    deleted) announces a new view over the same root. The root's list verified for the
    first view was reused for it without a check, so the order was replayed over the old
    samples (403 misses of 600, and the stream's stats showed the old count). The root is
    now listed anew when the training's count or digest differs."""
    src = tmp_path / "src"
    touch(src, "a/1.jpg", "a/2.jpg", "b/3.jpg", "b/4.jpg")
    mgr = None
    with scanned(src, tmp_path / "cache1") as eng:
        mgr = _lists(eng)
        first = folder.ImageFolder(str(src), loader=lambda p: p)
        cs, vid = announce_view(eng, src, data.Subset(first, [3, 2, 1, 0]))
        assert len(mgr.view_samples("k1", cs.views[vid])) == 4
    touch(src, "a/0.jpg", "b/5.jpg")  # added on the source; the training lists again
    with scanned(src, tmp_path / "cache2") as eng:
        mgr.ns, mgr.index = eng.ns, eng.index  # (its cache of verified roots is kept)
        again = folder.ImageFolder(str(src), loader=lambda p: p)
        ds = data.Subset(again, [5, 0, 3])
        cs, vid = announce_view(eng, src, ds)
        sl = mgr.view_samples("k2", cs.views[vid])
        assert [sl.paths[i] for i in range(len(ds))] == [
            os.path.relpath(ds[i][0], src) for i in range(len(ds))]


# ----- timm's folder reader: another order over the same tree ---------------------------------

#: names that sort differently naturally (timm) and lexically (torchvision): img2 before
#: img10, class2 before class10; files in the root and in nested directories (timm keeps
#: them, its class is the directory's own name); names timm's key ties (case)
TIMM_TREE = ("class2/img10.jpg", "class2/img2.jpg", "class2/img1.png", "class10/img3.jpg",
             "class10/IMG3.jpg", "class10/sub/img7.jpeg", "class10/sub/img07b.jpg",
             "class1/a9.jpg", "class1/a10.jpg", "top5.jpg", "top40.jpg",
             "class2/notes.txt", "README")


class _SortedScandir:
    """``os.scandir`` in name order: the order the mount lists a directory in (the
    source's own order is its file system's), for timm's unsorted walk."""

    def __init__(self, path) -> None:
        with _REAL_SCANDIR(path) as it:
            self._entries = iter(sorted(it, key=lambda e: os.fsencode(e.name)))

    def __iter__(self):
        return self

    def __next__(self):
        return next(self._entries)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def close(self) -> None:
        pass


_REAL_SCANDIR = os.scandir


@pytest.mark.parametrize("sort", [True, False])
def test_timm_folder_order_is_replayed(tmp_path, monkeypatch, sort):
    """timm's reader sorts by its natural_key (or not at all): the mount's list is the
    training's, index for index, where torchvision's order is another."""
    rif = pytest.importorskip("timm.data.readers.reader_image_folder")
    src = tmp_path / "src"
    touch(src, *TIMM_TREE)
    monkeypatch.setattr(os, "scandir", _SortedScandir)
    if sort:
        reader = rif.ReaderImageFolder(str(src))
    else:  # (the reader always sorts; its function has the flag)
        reader = rif.ReaderImageFolder(str(src))
        reader.samples, reader.class_to_idx = rif.find_images_and_targets(str(src), sort=False)
    monkeypatch.undo()
    with scanned(src, tmp_path / "cache") as eng:
        cs, vid = announce_view(eng, src, reader)
        (root,) = cs.views[vid].roots
        assert root.extensions is None and root.suffixes == (".jpeg", ".jpg", ".png")
        sl = _lists(eng).view_samples("k", cs.views[vid])
        assert sl.paths == [os.path.relpath(p, src) for p, _ in reader.samples]
        # the same classes: the mount's labels group the samples as timm's do
        pairs = {(a, b) for a, (_, b) in zip(sl.labels, reader.samples, strict=True)}
        assert len(pairs) == len({a for a, _ in pairs}) == len({b for _, b in pairs})
        for i, p in enumerate(sl.paths):
            assert eng.ns.path_of(eng.ns.get(sl.inos[i])) == os.fsencode(p)


def test_another_sort_order_and_other_files_are_told_apart(tmp_path):
    """A list of the mount's files in an order neither torchvision nor timm makes, and a
    list of other files: each mismatch says which (the stream then learns its order)."""
    from dlcachefs.clairvoyance.listings import SampleListMismatch

    src = tmp_path / "src"
    touch(src, *TIMM_TREE)
    tv = folder.ImageFolder(str(src), loader=lambda p: p)
    tv.samples = tv.samples[::-1]  # a custom order over the same files
    tv.imgs = tv.samples
    odd = folder.ImageFolder(str(src), loader=lambda p: p,
                             is_valid_file=lambda p: "img2" not in p)
    with scanned(src, tmp_path / "cache") as eng:
        cs, vid = announce_view(eng, src, tv)
        with pytest.raises(SampleListMismatch) as e:
            _lists(eng).view_samples("k", cs.views[vid])
        assert str(e.value) == ("sample list mismatch under '.': the training's sample list "
                                "is in another sort order than torchvision's or timm's (the "
                                "same 9 files)")
        cs, vid = announce_view(eng, src, odd)
        with pytest.raises(SampleListMismatch) as e:
            _lists(eng).view_samples("k", cs.views[vid])
        assert str(e.value) == ("sample list mismatch under '.': the mount lists 10 files, "
                                "the training 9 (a custom is_valid_file, or timm's "
                                "class_map?)")
