"""Scan-ahead (dlcachefs.scanahead) through a real mount: a reader that announced nothing
and reads a tree through gets the tree's other files fetched ahead of it; the fetches stay
in free cache room, never for re-reads, never with --scan-ahead 0, and bytes stay exact."""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest
from conftest import requires_fuse

pytestmark = requires_fuse


def make_tree(root: Path, classes: int = 4, per_class: int = 40, seed: int = 3,
              lo: int = 3000, hi: int = 9000) -> list[Path]:
    rnd = random.Random(seed)
    files = []
    for c in range(classes):
        d = root / "train" / f"class{c}"
        d.mkdir(parents=True)
        for i in range(per_class):
            p = d / f"{i:04d}.jpg"
            p.write_bytes(rnd.randbytes(rnd.randint(lo, hi)))
            files.append(p)
    return files


def read_all(m, src: Path, files: list[Path]) -> None:
    for p in files:
        assert (m.mnt / p.relative_to(src)).read_bytes() == p.read_bytes(), p


def test_a_random_reader_gets_the_rest_of_its_tree_fetched_ahead(tmp_path, mount):
    """An unannounced reader opens the files of an ImageFolder tree in a random order:
    after MIN_OPENS distinct opens the tree's other files are fetched ahead; the rest of
    the epoch is then all hits, each file came from the source once, and stats say which
    tree, how much and why."""
    src = tmp_path / "src"
    files = make_tree(src)
    (src / "README").write_bytes(b"not part of the tree\n")
    order = files[:]
    random.Random(5).shuffle(order)
    m = mount(src)
    read_all(m, src, order[:40])
    st = m.wait_stats(lambda s: s["scan_ahead"].get("train", {}).get("state") == "done",
                      "scan-ahead of train did not finish")
    tree = st["scan_ahead"]["train"]
    assert tree["listed"] == len(files)
    assert tree["files"] == st["scan_ahead_files"] > 0
    before = st["misses"]
    read_all(m, src, order[40:])
    st = m.stats()
    assert st["misses"] == before  # all the rest were in the cache
    # every file of the tree from the source exactly once (the README never: not a guess)
    assert st["bytes_from_source"] == sum(p.stat().st_size for p in files)
    group = [v for k, v in st["streams"].items() if k.startswith("unannounced/")]
    assert group and group[0]["mode"] == "none"
    assert group[0].get("scan_ahead") == "train"


def test_a_sequential_reader_is_followed(tmp_path, mount):
    """``cat`` of the files in listing order (a separate process group, like ``tar``):
    the scan starts after the reader's latest open, so the reader finds what follows
    fetched or in flight; bytes exact."""
    src = tmp_path / "src"
    files = make_tree(src, classes=2, per_class=60)
    m = mount(src)
    names = [str(m.mnt / p.relative_to(src)) for p in sorted(files)]
    out = subprocess.run(["cat", *names], check=True, capture_output=True,
                         start_new_session=True).stdout
    assert out == b"".join(p.read_bytes() for p in sorted(files))
    st = m.wait_stats(lambda s: s["scan_ahead"].get("train", {}).get("state")
                      in ("done", "paused", "idle"), "no scan-ahead for cat")
    assert st["scan_ahead_files"] > 0
    assert st["bytes_from_source"] == sum(p.stat().st_size for p in files)


def test_scan_ahead_fills_free_room_only(tmp_path, mount):
    """With a cache smaller than the tree, the scan stops when the free room is used up
    (it never evicts for a guess): state ``full``, nothing evicted, the limit held."""
    src = tmp_path / "src"
    files = make_tree(src, classes=4, per_class=50, lo=8000, hi=12000)
    limit = 640 << 10  # about a third of the tree
    m = mount(src, "--cache-size", str(limit), "--chunk-size", "64K")
    order = files[:]
    random.Random(8).shuffle(order)
    read_all(m, src, order[:40])
    st = m.wait_stats(lambda s: s["scan_ahead"].get("train", {}).get("state") == "full",
                      "the scan did not stop at the cache's room")
    assert st["chunks_evicted"] == 0
    assert st["chunk_bytes"] <= limit
    assert st["cached_bytes"] < sum(p.stat().st_size for p in files)
    read_all(m, src, order[40:])
    assert m.stats()["chunk_bytes"] <= limit


@pytest.mark.parametrize("case", ["off", "rereads"])
def test_no_scan_ahead_when_off_or_for_rereads(tmp_path, mount, case):
    """``--scan-ahead 0`` turns it off; a reader that keeps re-reading a few files is
    not reading a tree through and gets nothing fetched ahead."""
    src = tmp_path / "src"
    files = make_tree(src)
    m = mount(src, *(["--scan-ahead", "0"] if case == "off" else []))
    if case == "off":
        read_all(m, src, files)
    else:
        for _ in range(20):
            read_all(m, src, files[:8])
        read_all(m, src, files[8:40])  # 40 distinct, 152 repeats
    st = m.stats()
    assert st["scan_ahead"] == {} and st["scan_ahead_files"] == 0


def test_a_reader_leaving_its_tree_widens_the_scan(tmp_path, mount):
    """A reader of train/ that goes on into val/: the train scan is superseded by one of
    their common parent, which then covers val/ too."""
    src = tmp_path / "src"
    files = make_tree(src)
    val = make_tree(src / "v", classes=2, per_class=20, seed=4)
    m = mount(src)
    order = files[:]
    random.Random(6).shuffle(order)
    read_all(m, src, order[:40])
    m.wait_stats(lambda s: s["scan_ahead"].get("train", {}).get("state") == "done",
                 "scan-ahead of train did not finish")
    read_all(m, src, val[:5])
    st = m.wait_stats(lambda s: s["scan_ahead"].get(".", {}).get("state") == "done",
                      "the wider scan did not finish")
    read_all(m, src, val)
    assert m.stats()["bytes_from_source"] == sum(p.stat().st_size for p in files + val)
    assert st["scan_ahead"]["train"]["state"] == "done"
