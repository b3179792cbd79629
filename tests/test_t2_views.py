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
