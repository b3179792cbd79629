"""Tier 3: sample lists made ahead of an announcement (:meth:`SampleLists.note_opendir`),
through a session's filesystem facade, without a kernel: which directory an ImageFolder
scan is taken to be of."""

from __future__ import annotations

import logging

import pytest

from dlcachefs.cache.namespace import ROOT_INO
from dlcachefs.testing.fakes import make_config, run_session, write_tree

LISTINGS = "dlcachefs.clairvoyance.listings"


def image_folder(prefix: bytes, classes: int = 3, per_class: int = 4) -> dict[bytes, bytes]:
    return {prefix + b"c%d/%03d.jpg" % (c, i): b"x" * (100 + i)
            for c in range(classes) for i in range(per_class)}


async def scan(sess, *dirs: bytes) -> None:
    """OPENDIR of each directory in turn (relative paths; b"" is the root), as a listing
    by a training script's ImageFolder comes to the mount."""
    fs = sess.filesystem()
    for rel in dirs:
        ino = ROOT_INO if not rel else sess.engine.ns.resolve(rel).ino
        fs.releasedir(await fs.opendir(ino))


def guessed(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LISTINGS and "ahead of an announcement" in r.getMessage()]


def test_a_root_of_splits_is_not_taken_for_an_imagefolder(tmp_path, caplog):
    """The root holds train/ and val/, each an ImageFolder: the root listed, then train/
    (an ``ls`` of the mount, then ``ImageFolder(MNT/train)``) is a scan of train/, not of
    '.' (before: "listing '.' ahead of an announcement", a list of the splits as classes)."""
    src = tmp_path / "src"
    write_tree(src, {**image_folder(b"train/"), **image_folder(b"val/", 2)})
    caplog.set_level(logging.INFO, logger=LISTINGS)

    async def body(sess):
        await scan(sess, b"", b"train", b"train/c0", b"train/c1")

    run_session(make_config(src, tmp_path / "cache"), body)
    assert guessed(caplog) == [
        "listing 'train' ahead of an announcement (an ImageFolder scan was seen)"]


@pytest.mark.parametrize("prefix", [b"", b"data/"])
def test_an_imagefolder_root_is_still_listed_ahead(tmp_path, caplog, prefix):
    """A real ImageFolder root (classes of files), at the mount's root or below it: its
    scan (the root, then its first class) still lists it ahead."""
    src = tmp_path / "src"
    write_tree(src, image_folder(prefix))
    caplog.set_level(logging.INFO, logger=LISTINGS)
    root = prefix.rstrip(b"/")

    async def body(sess):
        await scan(sess, root, prefix + b"c0", prefix + b"c1")

    run_session(make_config(src, tmp_path / "cache"), body)
    name = root.decode() or "."
    assert guessed(caplog) == [
        f"listing {name!r} ahead of an announcement (an ImageFolder scan was seen)"]
