"""Scan-ahead (dlcachefs.cache.scanahead) through a real mount: a reader that announced nothing
and reads a tree through gets the tree's other files fetched ahead of it; the fetches stay
in free cache room, never for re-reads, never with --scan-ahead 0, and bytes stay exact."""

from __future__ import annotations

import random
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


def wait_tree(m, src: Path, keep: Path, tree: str, states: tuple[str, ...]) -> dict:
    """Stats once ``tree``'s scan is in one of ``states``. The reader stays active
    meanwhile (it re-opens ``keep``): a scan pauses when its readers are idle, and this
    machine may take longer than that pause to fetch the rest."""
    def pred(st: dict) -> bool:
        assert (m.mnt / keep.relative_to(src)).read_bytes() == keep.read_bytes()
        return st["scan_ahead"].get(tree, {}).get("state") in states
    return m.wait_stats(pred, f"scan-ahead of {tree} not in {states}")


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
    m = mount(src, "--chunk-size", "64K")  # chunks sealed while the reader goes on
    read_all(m, src, order[:40])
    st = wait_tree(m, src, order[0], "train", ("done",))
    tree = st["scan_ahead"]["train"]
    assert tree["listed"] == len(files)
    assert tree["files"] == st["scan_ahead_files"] > 0
    before = st["misses"]
    read_all(m, src, order[40:])
    st = m.stats()
    assert st["misses"] == before  # all the rest were in the cache
    # ... and came from the bytes fetched ahead, held in memory: none was read back
    # from the log it had just been written to (one read is wait_tree's: it re-opens a
    # file the reader itself fetched)
    assert st["chunk_reads"] + st["record_reads"] <= 1, (st["chunk_reads"], st["record_reads"])
    # every file of the tree from the source exactly once (the README never: not a guess)
    assert st["bytes_from_source"] == sum(p.stat().st_size for p in files)
    group = [v for k, v in st["streams"].items() if k.startswith("unannounced/")]
    assert group and group[0]["mode"] == "none"
    assert group[0].get("scan_ahead") == "train"


def test_a_sequential_reader_is_followed(tmp_path, mount):
    """A reader going through the files in listing order (an unshuffled loader, ``tar``):
    the scan starts after its latest open, so it fetches exactly the files that follow,
    and they are hits when the reader gets there."""
    src = tmp_path / "src"
    files = sorted(make_tree(src, classes=1, per_class=120))
    m = mount(src)
    read_all(m, src, files[:40])
    st = wait_tree(m, src, files[39], "train/class0", ("done",))
    # everything after the reader's 40 opens came from the scan (and maybe some of files
    # 33-40 too: the scan starts just after the 32nd open); nothing twice (see below)
    scanned = st["scan_ahead"]["train/class0"]["files"]
    assert len(files) - 40 <= scanned <= len(files) - 32
    before = st["misses"]
    read_all(m, src, files[40:])
    st = m.stats()
    assert st["misses"] == before
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
    read_all(m, src, order[:32])  # the 32nd open starts the scan; nothing else in flight
    st = wait_tree(m, src, order[0], "train", ("full",))
    assert st["chunks_evicted"] == 0
    assert st["chunk_bytes"] <= limit
    assert st["cached_bytes"] < sum(p.stat().st_size for p in files)
    read_all(m, src, order[32:])
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
    """A reader of train/ that opens one file elsewhere keeps its tree; one that goes on
    into v/ (32 opens outside) gets the scan of their common parent, which covers v/."""
    src = tmp_path / "src"
    files = make_tree(src)
    (src / "labels.json").write_bytes(b"{}")
    val = make_tree(src / "v", classes=2, per_class=25, seed=4)
    m = mount(src)
    order = files[:]
    random.Random(6).shuffle(order)
    read_all(m, src, order[:40])
    wait_tree(m, src, order[0], "train", ("done",))
    read_all(m, src, [src / "labels.json"])
    assert "." not in m.stats()["scan_ahead"]  # one open outside: no wider guess
    read_all(m, src, val[:32])
    st = wait_tree(m, src, val[0], ".", ("done",))
    read_all(m, src, val)
    st = m.stats()
    assert st["bytes_from_source"] == sum(p.stat().st_size
                                          for p in [*files, *val, src / "labels.json"])
    assert st["scan_ahead"]["train"]["state"] == "done"
