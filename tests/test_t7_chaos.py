"""Faults on purpose, short versions of ``bench/chaos.py``'s scenarios (the bench runs them
long): kill -9 cycles, damaged cache files, a misbehaving source, a full cache disk and
a memory limit, a soak with many kinds of readers, and fuzzed control writes. Every read
is checked against the source's bytes: exact, or an error."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import requires_fuse

from dlcachefs.testing import chaos
from dlcachefs.testing.mounting import DLCACHEFS, drop_page_cache

pytestmark = requires_fuse

DAMAGED_INDEX = r"WARNING dlcachefs: cache index \S+ is damaged \(.*\); moved to \S+\.damaged"


def _verify(cache, *extra: str) -> tuple[int, dict]:
    r = subprocess.run([*DLCACHEFS, "verify", "--cache-dir", str(cache), "--json", *extra],
                       capture_output=True, text=True, timeout=600)
    return r.returncode, json.loads(r.stdout)


@pytest.fixture
def dataset(tmp_path):
    src = tmp_path / "src"
    return src, chaos.make_dataset(src, 60, seed=3)


# ----- a damaged LMDB index --------------------------------------------------------------------


@pytest.mark.daemon_log_allows(DAMAGED_INDEX)
@pytest.mark.parametrize("kind", ["truncate", "zero"])
def test_damaged_index_is_moved_aside_not_fatal(dataset, mount, tmp_path, kind):
    """Regression: a truncated index killed the daemon at start (SIGBUS inside LMDB) and
    ``dlcachefs verify`` with it; zeroed pages aborted it (SIGABRT). The cache could not be
    mounted again until someone deleted it by hand."""
    src, files = dataset
    m = mount(src)
    assert chaos.check_all(m.mnt, files).ok == len(files)
    m.wait_cached(len(files))
    m.umount()
    data = tmp_path / "cache" / "meta.lmdb" / "data.mdb"
    size = data.stat().st_size
    with open(data, "r+b") as f:  # damage past the two meta pages: the B-tree itself
        if kind == "truncate":
            f.truncate(size // 2)
        else:
            f.seek(2 * 4096)
            f.write(bytes(size - 2 * 4096))
    rc, rep = _verify(tmp_path / "cache")
    assert rc == 1 and rep["index_damaged"], rep  # reported, not a dead verify
    m2 = mount(src)  # the daemon starts: the index moved aside, the cache empty
    assert (tmp_path / "cache" / "meta.lmdb.damaged" / "QUARANTINED").exists()
    drop_page_cache()
    t = chaos.check_all(m2.mnt, files)
    assert (t.ok, t.wrong, dict(t.errors)) == (len(files), 0, {})
    assert m2.stats()["bytes_from_source"] == sum(map(len, files.values()))


def test_verify_repair_of_a_damaged_index_leaves_a_clean_cache(dataset, mount, tmp_path):
    src, files = dataset
    m = mount(src)
    chaos.check_all(m.mnt, files)
    m.wait_cached(len(files))
    m.umount()
    data = tmp_path / "cache" / "meta.lmdb" / "data.mdb"
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 3)
    rc, rep = _verify(tmp_path / "cache", "--repair")
    assert rc == 0 and rep["repaired"] and rep["quarantined_to"].endswith(".damaged")
    rc, rep = _verify(tmp_path / "cache")
    assert rc == 0 and not rep.get("index_damaged") and rep["bad_records"] == []
    m2 = mount(src)
    t = chaos.check_all(m2.mnt, files)
    assert (t.ok, t.wrong) == (len(files), 0)
