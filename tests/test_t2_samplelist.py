"""Tier 2: dlcachefs.clairvoyance.samplelist.image_folder over a scanned namespace equals torchvision's
ImageFolder over the same directory tree: same classes, and sample ``i`` is the same path
with the same label (and its inode names the file torchvision would open)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dlcachefs import session
from dlcachefs.testing.fakes import make_config

folder = pytest.importorskip("torchvision.datasets.folder")

from dlcachefs.cache.engine import Engine  # noqa: E402
from dlcachefs.clairvoyance.samplelist import (  # noqa: E402
    IMG_EXTENSIONS,
    SampleList,
    image_folder,
    links_leaving,
)


@contextlib.contextmanager
def scanned(src: Path, cache: Path) -> Iterator[Engine]:
    """An engine whose namespace snapshot is a fresh scan of ``src`` (no FUSE, no trio)."""
    with session.build(make_config(src, cache)) as sess:
        sess.start()
        yield sess.engine


def touch(root: Path, *rels: str | bytes, data: bytes = b"x") -> None:
    rootb = os.fsencode(root)
    for rel in rels:
        p = os.path.join(rootb, os.fsencode(rel))
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)


def link(root: Path, rel: str | bytes, target: str | bytes) -> None:
    p = os.path.join(os.fsencode(root), os.fsencode(rel))
    os.makedirs(os.path.dirname(p), exist_ok=True)
    os.symlink(os.fsencode(target), p)


def torchvision_image_folder(root: str) -> folder.ImageFolder:
    return folder.ImageFolder(root, loader=lambda p: p, allow_empty=True)


def check_same(eng: Engine, src: Path, rel: str) -> SampleList:
    """image_folder(ns, rel) must equal ImageFolder(src/rel), index for index."""
    ns = eng.ns
    root = os.path.join(str(src), rel)
    tv = torchvision_image_folder(root)
    sl = image_folder(ns, rel)
    assert sl.classes == tv.classes
    assert sl.paths == [os.path.relpath(p, root) for p, _ in tv.samples]
    assert sl.labels == [t for _, t in tv.samples]
    assert len(sl) == len(tv)
    src_real = os.path.realpath(str(src))
    for i, (p, _) in enumerate(tv.samples):
        real = os.path.realpath(p)
        inside = real.startswith(src_real + os.sep)
        if inside and os.path.isfile(real) and not os.path.islink(real):
            # the file torchvision opens (after following every link) is the inode's
            want = os.fsencode(os.path.relpath(real, src_real))
            assert sl.inos[i] != 0, (i, p)
            assert ns.path_of(ns.get(sl.inos[i])) == want, (i, p)
        else:
            assert sl.inos[i] == 0, (i, p)
    return sl


@pytest.fixture
def src(tmp_path: Path) -> Path:
    p = tmp_path / "src"
    p.mkdir()
    return Path(os.path.realpath(p))


# ----- fixed trees -----------------------------------------------------------------------


def test_extensions_match_torchvision():
    assert tuple(IMG_EXTENSIONS) == tuple(folder.IMG_EXTENSIONS)


def test_basic_nested_and_filtered(src, tmp_path):
    touch(src,
          "cat/b.jpg", "cat/a.jpeg", "cat/C.JPG", "cat/d.Png", "cat/readme.txt", "cat/noext",
          "cat/x.jpg.txt", "cat/.hidden.png",
          "cat/sub/z.png", "cat/sub/deeper/y.bmp", "cat/sub/deeper/deepest/x.tif",
          "cat/sub/deeper/deepest/notes.TXT",
          "dog/1.webp", "dog/0.ppm", "dog/2.PGM", "dog/3.TIFF", "dog/in/side/4.jpg",
          "Zebra/only.jpg",
          "root_file.jpg", "root_notes.txt")
    with scanned(src, tmp_path / "cache") as eng:
        sl = check_same(eng, src, "")
    assert sl.classes == ["Zebra", "cat", "dog"]
    assert "readme.txt" not in " ".join(sl.paths)
    assert "root_file.jpg" not in sl.paths


def test_walk_order_is_by_full_path_string(src, tmp_path):
    """os.walk results are sorted by their root path: 'a-b' < 'a.b' < 'a/b' < 'a0'
    ('-' 0x2d, '.' 0x2e, '/' 0x2f, '0' 0x30), which a depth-first walk would not give."""
    touch(src, "c/a/f.jpg", "c/a/b/f.jpg", "c/a/b/c/f.jpg", "c/a-b/f.jpg", "c/a.b/f.jpg",
          "c/a0/f.jpg", "c/A/f.jpg", "c/_/f.jpg", "c/a b/f.jpg", "c/f.jpg", "c/a/f-1.jpg",
          "c/a/b-/f.jpg", "c/a/b./f.jpg")
    with scanned(src, tmp_path / "cache") as eng:
        sl = check_same(eng, src, "")
    assert sl.paths.index("c/a-b/f.jpg") < sl.paths.index("c/a/b/f.jpg")
    assert sl.paths.index("c/a/b-/f.jpg") < sl.paths.index("c/a/b/c/f.jpg")


def test_names_sorting_differently_as_str_and_bytes(src, tmp_path):
    """A non-UTF-8 byte decodes to a lone surrogate (U+DC80..U+DCFF): as str it sorts before
    U+E000.. and astral characters, as bytes after them."""
    names = [b"\xff.jpg", "\ue000.jpg".encode(), "\U0001f600.jpg".encode(), "\uff71.jpg".encode(),
             "é.jpg".encode(), b"z.jpg", b"\xc3.jpg"]
    touch(src, *[b"cls/" + n for n in names])
    touch(src, *[b"cls/" + n[:-4] + b"/in.png" for n in names])
    touch(src, b"\xfeclass/a.jpg", "\U0001f600class/a.jpg".encode(), b"plain/a.jpg")
    with scanned(src, tmp_path / "cache") as eng:
        sl = check_same(eng, src, "")
    # really a case where the orders differ
    assert sorted(names) != sorted(names, key=os.fsdecode)
    # str order puts the lone surrogate U+DCFE first; bytes order would put b"\xfe" last
    assert sl.classes == ["cls", "plain", "\udcfeclass", "\U0001f600class"]
    assert sl.paths.index("cls/\udcff.jpg") < sl.paths.index("cls/\ue000.jpg")


def test_spaces_and_unicode(src, tmp_path):
    touch(src, "my class/a b.jpg", "my class/ c.png", "my class/sub dir/ü ñ.JPEG",
          "日本/写真 1.jpg", "日本/写真 2.jpg", "Ωmega/ä.png", "emoji 😀/x y z.jpg",
          "tab\tname/x.jpg", "new\nline/y.jpg")
    with scanned(src, tmp_path / "cache") as eng:
        check_same(eng, src, "")


def test_empty_classes(src, tmp_path):
    touch(src, "full/a.jpg", "only_text/a.txt", "nested_empty/sub/deeper/readme.md")
    (src / "empty").mkdir()
    with pytest.raises(FileNotFoundError):  # torchvision's default refuses empty classes
        folder.ImageFolder(str(src), loader=lambda p: p)
    with scanned(src, tmp_path / "cache") as eng:
        sl = check_same(eng, src, "")  # allow_empty=True: the empty classes keep their labels
    assert sl.classes == ["empty", "full", "nested_empty", "only_text"]
    assert sl.labels == [1]


def test_symlinks(src, tmp_path):
    touch(src,
          "data/cat/a.jpg", "data/cat/b.png", "data/cat/sub/c.jpg",
          "data/dog/d.jpg",
          "elsewhere/bird/e.jpg", "elsewhere/bird/f.bmp", "elsewhere/real.png",
          "elsewhere/blob.bin", "elsewhere/dir/g.jpg")
    link(src, "data/bird", "../elsewhere/bird")            # a symlinked class directory
    link(src, "data/cat/link.jpg", "../../elsewhere/real.png")  # a symlink to an image
    link(src, "data/cat/blob.jpg", "../../elsewhere/blob.bin")  # image name, other target
    link(src, "data/cat/real_link.txt", "a.jpg")           # a link with a non-image name
    link(src, "data/cat/dangling.jpg", "missing.jpg")      # kept by torchvision, inode 0
    link(src, "data/dog/subdir", "../../elsewhere/dir")    # a symlinked subdirectory
    link(src, "data/dog/chain.png", "chain2.png")          # link -> link -> file
    link(src, "data/dog/chain2.png", "../cat/b.png")
    link(src, "data/dog/abs.jpg", str(src / "data/cat/a.jpg"))  # absolute, inside the source
    link(src, "data/cls_abs", str(src / "elsewhere/bird"))  # absolute class link
    link(src, "data/not_a_class.jpg", "cat/a.jpg")         # a file link in the root
    with scanned(src, tmp_path / "cache") as eng:
        sl = check_same(eng, src, "data")
        assert sl.classes == ["bird", "cat", "cls_abs", "dog"]
        assert "cat/dangling.jpg" in sl.paths
        assert sl.inos[sl.paths.index("cat/dangling.jpg")] == 0
        ns = eng.ns
        assert sl.inos[sl.paths.index("cat/link.jpg")] == ns.resolve(b"elsewhere/real.png").ino
        assert sl.inos[sl.paths.index("dog/chain.png")] == ns.resolve(b"data/cat/b.png").ino
        assert sl.inos[sl.paths.index("dog/subdir/g.jpg")] == \
            ns.resolve(b"elsewhere/dir/g.jpg").ino


def test_links_leaving_the_source_are_counted(src, tmp_path):
    """Symlinks that dangle or lead out of the source: a training follows them to files
    the mount cannot list, so a differing sample list names them as the likely cause."""
    outside = tmp_path / "outside"
    touch(outside, "x/o.jpg")
    touch(src, "data/cat/a.jpg", "data/dog/sub/d.jpg", "other/z.jpg")
    link(src, "data/linked", str(outside / "x"))      # a class dir outside the source
    link(src, "data/dog/sub/gone.jpg", "missing.jpg")  # dangling
    link(src, "data/dog/in.jpg", "../cat/a.jpg")       # inside: fine
    link(src, "other/out", str(outside))               # not under the dataset
    with scanned(src, tmp_path / "cache") as eng:
        assert links_leaving(eng.ns, "data") == 2
        assert links_leaving(eng.ns, "data/cat") == 0
        assert links_leaving(eng.ns, "") == 3


def test_dataset_is_a_subdirectory(src, tmp_path):
    touch(src, "train/b/1.jpg", "train/a/2.jpg", "train/a/x/3.png", "train/top.jpg",
          "val/a/9.jpg", "val/c/8.jpg", "README.txt", "x.jpg")
    link(src, "current", "train")   # the dataset root itself through a link
    with scanned(src, tmp_path / "cache") as eng:
        tr = check_same(eng, src, "train")
        va = check_same(eng, src, "val")
        check_same(eng, src, "current")
        assert image_folder(eng.ns, "/train/").paths == tr.paths
        assert image_folder(eng.ns, "current").inos == tr.inos
        assert tr.classes == ["a", "b"] and va.classes == ["a", "c"]
        whole = check_same(eng, src, "")
        assert whole.classes == ["current", "train", "val"]


def test_symlink_loop_does_not_hang(src, tmp_path):
    """os.walk would follow a loop until ELOOP; dlcachefs stops at the first repeat.
    Not compared with torchvision (a degenerate tree); it must just terminate."""
    touch(src, "c/a.jpg", "c/sub/b.jpg")
    link(src, "c/sub/loop", "..")
    with scanned(src, tmp_path / "cache") as eng:
        sl = image_folder(eng.ns, "")
    assert sl.paths[:1] == ["c/a.jpg"] and "c/sub/b.jpg" in sl.paths


# ----- symlink layouts that once diverged from torchvision (regression tests) ---


def test_two_links_to_the_same_directory(src, tmp_path):
    touch(src, "c/x/a.jpg", "shared/s.jpg")
    link(src, "c/l1", "../shared")
    link(src, "c/l2", "../shared")
    with scanned(src, tmp_path / "cache") as eng:
        sl = check_same(eng, src, "")
    assert sl.paths[:2] == ["c/l1/s.jpg", "c/l2/s.jpg"]


def test_relative_link_inside_a_linked_directory(src, tmp_path):
    touch(src, "data/cat/a.jpg", "elsewhere/real.png", "elsewhere/bird/b.jpg")
    link(src, "data/bird", "../elsewhere/bird")
    link(src, "elsewhere/bird/x.jpg", "../real.png")  # -> elsewhere/real.png
    with scanned(src, tmp_path / "cache") as eng:
        check_same(eng, src, "data")


def test_link_target_through_a_linked_directory(src, tmp_path):
    touch(src, "data/cat/a.jpg", "real/a/r.jpg")
    link(src, "cur", "real")
    link(src, "data/via", "../cur/a")                  # a class, through cur -> real
    link(src, "data/cat/through.jpg", "../../cur/a/r.jpg")
    with scanned(src, tmp_path / "cache") as eng:
        check_same(eng, src, "data")


def test_links_under_a_linked_dataset_root(src, tmp_path):
    """A common layout: /data/imagenet -> imagenet-2012."""
    touch(src, "imagenet-2012/cls/a.jpg", "imagenet-2012/other/o.jpg")
    link(src, "imagenet", "imagenet-2012")
    link(src, "imagenet-2012/sib", "other")            # a class that links to a sibling
    link(src, "imagenet-2012/cls/b.jpg", "a.jpg")
    with scanned(src, tmp_path / "cache") as eng:
        check_same(eng, src, "imagenet-2012")          # fine through the real path
        check_same(eng, src, "imagenet")


# ----- random trees --------------------------------------------------------------------------

NAME = st.text(alphabet="aAbBzZ-_.019", min_size=1, max_size=4).filter(
    lambda s: s not in (".", ".."))
EXT = st.sampled_from([*folder.IMG_EXTENSIONS, ".txt", ".JPG", ".Png", ".JPEG", ""])
FILE = st.tuples(st.lists(NAME, max_size=3), NAME, EXT)  # (subdirs, stem, ext)
CLASS = st.tuples(NAME, st.lists(FILE, min_size=0, max_size=8))


def build(root: Path, classes, root_files, links) -> None:
    for cname, files in classes:
        with contextlib.suppress(OSError):
            (root / cname).mkdir(parents=True, exist_ok=True)
        for subdirs, stem, ext in files:
            rel = "/".join([cname, *subdirs, stem + ext])
            with contextlib.suppress(OSError):  # a name taken by a file and a directory
                touch(root, rel)
    for name in root_files:
        with contextlib.suppress(OSError):
            touch(root, name)
    for name, target in links:
        with contextlib.suppress(OSError):
            link(root, name, target)


@settings(deadline=None, max_examples=200,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(classes=st.lists(CLASS, min_size=1, max_size=4),
       root_files=st.lists(st.builds(lambda s, e: s + e, NAME, EXT), max_size=3),
       sub=st.booleans())
def test_random_trees_match_torchvision(classes, root_files, sub):
    with tempfile.TemporaryDirectory() as tmp:
        tmp_p = Path(os.path.realpath(tmp))
        src = tmp_p / "src"
        data = src / "train" if sub else src
        data.mkdir(parents=True)
        build(data, classes, root_files, [])
        if sub:
            touch(src, "val/k/a.jpg", "top.png")
        if not any(e.is_dir() for e in os.scandir(data)):
            return  # torchvision refuses a dataset without classes
        with scanned(src, tmp_p / "cache") as eng:
            check_same(eng, src, "train" if sub else "")


@settings(deadline=None, max_examples=120,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(classes=st.lists(CLASS, min_size=1, max_size=3), data=st.data())
def test_random_trees_with_class_and_file_links(classes, data):
    """Random relative links: class directories linking to other classes, and file links
    (to existing images, to other files, dangling)."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp_p = Path(os.path.realpath(tmp))
        src = tmp_p / "src"
        src.mkdir()
        build(src, classes, [], [])
        names = sorted({c for c, _ in classes})
        files = sorted(os.path.relpath(os.path.join(d, f), src)
                       for d, _, fs in os.walk(src) for f in fs)
        links = []
        for _ in range(data.draw(st.integers(0, 3), label="class links")):
            links.append((data.draw(NAME, label="link name") + "_L",
                          data.draw(st.sampled_from(names), label="class target")))
        for _ in range(data.draw(st.integers(0, 4), label="file links")):
            cname = data.draw(st.sampled_from(names), label="in class")
            lname = data.draw(NAME, label="file link") + data.draw(EXT, label="ext")
            target = data.draw(st.sampled_from([*files, "missing.jpg"]), label="target")
            links.append((f"{cname}/{lname}", os.path.join("..", target)))
        build(src, [], [], links)
        if not any(e.is_dir() for e in os.scandir(src)):
            return
        with scanned(src, tmp_p / "cache") as eng:
            check_same(eng, src, "")
