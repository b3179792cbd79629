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
from dlcachefs.testing import scenarios as S
from dlcachefs.testing.mounting import DLCACHEFS, STALE_MOUNT, drop_page_cache

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


# ----- the scenarios, short (bench/chaos.py runs them long) -------------------------------------
# Each scenario runs its own daemons (dlcachefs.testing.scenarios); the oracle reads their
# logs, with what the scenario provokes on purpose allowed.


def _watch(daemon_oracle, work, allows: tuple[str, ...] = S.EXPECTED_LOG):
    daemon_oracle.log_allows += allows
    daemon_oracle.watch(log=work / "daemon.log")


def test_kill9_cycles_lose_nothing_committed(tmp_path, daemon_oracle):
    """5 cycles of 8 reader threads and a training process under the launcher (reading in
    its own process) + an announced DistributedSampler (prefetch, the next epoch's log) +
    eviction, the daemon SIGKILLed at a random moment; a training process
    SIGKILLed mid-announcement in two of them; one (the third) killed while the next
    epoch's log is part-written."""
    _watch(daemon_oracle, tmp_path)
    r = S.kill_cycles(tmp_path, cycles=5, seed=11, n_files=120, trainer_every=2)
    assert r["cycles"] == 5 and r.get("mount_failures", 0) == 0, r
    assert r["wrong_bytes_reads"] == 0, r
    assert r["lost_committed_records"] == 0 and r["committed_before"] > 0, r
    assert r["verify_reads"]["errors_by_errno"] == {} and r["reads"]["errors_by_errno"] == {}, r
    assert r["verify_hits"] > 0  # the cache was reused across kills
    assert r["trainer_killed"] == 2 and r["announce_after_ok"] == 2, r
    # a training under the launcher read in its own process through every kill and
    # recovery: never killed, never a wrong byte, most reads served in the process
    assert r["trainings_killed"] == 0 and r["in_process_failed"] == 0, r
    assert r["in_process_served_in_process"] > 0, r
    # the third cycle waited for a part-written next-epoch log before the kill (whether
    # the log was still part-written at the kill is the bench's count: timing); the
    # remount after it lost nothing committed and served every byte exact (above)
    assert r["reorder_kill_cycles"] == 1, r
    assert not r.get("daemon_died_with_trainer") and not r.get("daemon_died_before_kill"), r
    assert r["verify_exit"] == 0 and r["verify_problems"] == 0, r
    assert r["tracebacks"] == 0, r["log_examples"]


def test_kill9_cycles_with_fetch_workers_lose_nothing_and_end_the_workers(tmp_path,
                                                                         daemon_oracle):
    """The kill scenario with ``--fetch-workers 2``: the prefetch's files are appended by
    worker processes; each SIGKILL of the daemon ends its workers too, and the remounts
    lose nothing committed, serve every byte exact, and verify finds nothing."""
    _watch(daemon_oracle, tmp_path)
    r = S.kill_cycles(tmp_path, cycles=3, seed=13, n_files=120, trainer_every=0,
                      reorder_every=0, fetch_workers=2)
    assert r["cycles"] == 3 and r.get("mount_failures", 0) == 0, r
    assert r["wrong_bytes_reads"] == 0, r
    assert r["lost_committed_records"] == 0, r
    assert r["workers_killed"] > 0 and r.get("workers_outlived_daemon", 0) == 0, r
    assert r["verify_exit"] == 0 and r["verify_problems"] == 0, r
    assert r["tracebacks"] == 0, r["log_examples"]


@pytest.mark.parametrize("seed", [5, 77, 101])
def test_damage_to_logs_and_index_is_detected_or_harmless(tmp_path, daemon_oracle, seed):
    """30 injections (bits, zeroed ranges, truncation) into logs (mounted and not) and the
    LMDB file (mounted and not); every file read after each: exact or an error; verify, then
    verify --repair, then a clean verify, every 15. Over several seeds: the promise (damage
    detected or harmless, never a failed mount, never a traceback) holds for each, not
    for one lucky draw."""
    _watch(daemon_oracle, tmp_path, S.DAMAGE_LOG)
    r = S.corruption(tmp_path, injections=30, seed=seed, n_files=40, verify_every=15)
    assert r["injections"] + r.get("skipped", 0) == 30, r
    assert not r.get("mount_failures"), r
    assert r["wrong_bytes_reads"] == 0 and not r.get("injections_with_wrong_bytes"), r
    assert not r.get("daemon_down") and r["daemon_up_at_end"] == 1, r
    assert r["detected"] > 0, r  # the damage was real, and seen
    # a training under the launcher after each injection: exact bytes or an error, never
    # killed by a damaged index it maps
    assert r["trainings_killed"] == 0 and r["in_process_failed"] == 0, r
    assert r["in_process_served_in_process"] > 0, r
    # LMDB damaged under the running daemon (EIO or SIGBUS then): the remount set it aside
    # or found it harmless, and served every file exact, with no error
    assert any(k.startswith("lmdb/") and k.endswith("/mounted") for k in r["by_kind"]), r
    assert r.get("lmdb_mounted_errors_after_remount", 0) == 0, r
    assert r["verify_runs"] == 2 and r["repair_clean"] == 2 and not r["verify_crashed"], r
    assert r["tracebacks"] == 0, r["log_examples"]


@pytest.mark.daemon_log_allows(r"WARNING dlcachefs\.cache\.")
def test_source_faults_give_old_or_new_bytes_or_their_errno(tmp_path, daemon_oracle):
    """Through a passthrough source that fails or hangs on demand: EACCES, EIO and a hang
    (ETIMEDOUT) come back as such; a file changed, truncated, replaced or removed while
    its fetch is half read gives the old bytes, the new ones, or ESTALE/ENOENT."""
    _watch(daemon_oracle, tmp_path)
    r = S.source_faults(tmp_path, rounds=1, seed=2)
    assert not r.get("mixed_reads") and not r.get("unexpected_errno"), r
    o = r["outcomes"]
    assert o["eacces"] == {"EACCES": 1} and o["eio"] == {"EIO": 1}, o
    assert o["hang"] == {"ETIMEDOUT": 1}, o
    assert not r.get("reads_after_fault_wrong") and r["source_fds_left"] == 0, r
    assert r["daemon_up_at_end"] == 1 and r["tracebacks"] == 0, r


def test_a_filling_disk_costs_no_client_a_byte_or_an_error(tmp_path, daemon_oracle):
    _watch(daemon_oracle, tmp_path)
    r = S.disk_full(tmp_path, seconds=8, seed=4, n_files=80)
    if r.get("skipped"):
        pytest.skip(r["skipped"])
    assert r["disk_filled"] > 0, r
    assert r["wrong_bytes_reads"] == 0 and r["client_errors"] == 0, r
    assert r["reads"]["reads_ok"] > 0 and r["daemon_up_at_end"] == 1, r
    assert r["write_errors"] + r["cache_skipped"] > 0, r  # the disk did refuse writes


def test_memory_limit_below_memory_flag_is_obeyed_not_oom_killed(tmp_path, daemon_oracle):
    """--memory 64M in a cgroup with 24 MB above the daemon's start-up charge (once OOM-killed):
    the daemon finds the limit, shrinks its buffers to fit, and serves on, exact bytes."""
    _watch(daemon_oracle, tmp_path)
    r = S.memory_pressure(tmp_path, seconds=8, seed=6, n_files=200, headroom_mb=24,
                          memory="64M")
    if r.get("skipped"):
        pytest.skip(r["skipped"])
    assert r["daemon_cgroup_limit"] == r["memory_limit"], r  # it saw the group's limit
    assert r["memory_tier_limit"] < 24 << 20, r  # and sized the tier to the headroom
    assert r["readahead_limit"] + r["backlog_limit"] < 24 << 20, r
    assert r["wrong_bytes_reads"] == 0 and r["client_errors"] == 0, r
    assert r["reads"]["reads_ok"] > 0, r
    assert r["daemon_up_at_end"] == 1 and r["oom_kills"] == 0, r


def test_soak_of_sixteen_readers_leaks_no_descriptor(tmp_path, daemon_oracle):
    """2 DataLoaders (2 workers each, announced), 4 threads, cat, find and du loops over a
    cache of half the dataset, 15 s: no error, no wrong byte; once the readers stop the
    daemon holds no descriptor of a source file and none of a deleted log."""
    _watch(daemon_oracle, tmp_path)
    r = S.soak(tmp_path, seconds=15, seed=8, n_files=160, sample_every=1.0)
    assert r["readers"] == 16
    assert r["wrong_bytes_reads"] == 0 and r["client_errors"] == 0, r
    assert all(x.get("samples", 0) > 0 for x in r["loaders"]), r["loaders"]
    assert r["cat_reads"] > 0 and r["find_runs"] > 0 and r["du_runs"] > 0, r
    assert r["chunks_evicted"] > 0, r  # eviction ran all along
    assert r["source_fds_after_settle"] == 0 and r["deleted_fds_after_settle"] == 0, r
    assert r["daemon_up_at_end"] == 1 and r["tracebacks"] == 0, r


def test_fuzzed_control_writes(tmp_path, daemon_oracle):
    """2,000 generated writes against the parser, 200 into a live mount: no crash, each
    refusal's reason in .dlcache/errors, nothing refused changed the state."""
    _watch(daemon_oracle, tmp_path)
    r = S.fuzz(tmp_path, parser_writes=2000, mount_writes=200, seed=9)
    p, m = r["parser"], r["mount"]
    assert p["crashes"] == 0, p["crash_examples"]
    assert p["refused_without_reason"] == 0 and p["refused_but_changed_state"] == 0, p
    assert p["accepted"] > 0 and p["refused"] > 0, p  # both paths were taken
    assert m["refused"] > 0 and m["refused_without_reason"] == 0 and m["other_errors"] == {}, m
    assert m["daemon_up_at_end"] == 1 and m["stats_readable"] == 1, m


def test_index_check_sees_records_that_do_not_fit_their_chunks(tmp_path):
    """A bit flipped in a chunk's key leaves records naming a missing chunk: the mount
    used to fail at start with --debug-invariants (and serve from a broken index without
    it); the check reports it, and the index is set aside like any damage."""
    from dlcachefs.store.index import Index
    from dlcachefs.store.integrity import check_index
    from dlcachefs.store.schema import Chunk, Entry, Record

    path = str(tmp_path / "meta.lmdb")
    ix = Index(path)
    with ix.write() as w:
        w.put_entry(Entry(20, 1, b"a", 0o100644, 1, 0, 0, 10, 1, 0, 0, 0, 0, 5, 0.0))
        w.put_chunk(Chunk(3, 1, 0, 100, 0, (20,)))
        w.put_record(20, Record(3, 1, 10, 10, 1234, 0, 5))
    ix.close()
    assert check_index(path) is None
    ix = Index(path)
    with ix.write() as w:
        w.put_record(20, Record(4, 1, 10, 10, 1234, 0, 5))  # chunk 4 does not exist
    ix.close()
    assert "names missing chunk 4" in check_index(path)


@pytest.mark.verify_allows(r"damaged chunk \d+: log \d+ is shorter than its index says")
def test_a_chunk_length_damaged_in_the_index_is_a_bad_chunk_not_a_huge_read(dataset, mount,
                                                                            tmp_path):
    """A flipped high bit in a chunk's length made verify (and the daemon's reader) ask
    for terabytes in one pread: MemoryError, a dead verify. The log's size bounds it."""
    from dlcachefs.store.index import Index
    from dlcachefs.store.schema import Chunk

    src, files = dataset
    m = mount(src)
    chaos.check_all(m.mnt, files)
    m.wait_cached(len(files))
    m.umount()
    ix = Index(str(tmp_path / "cache" / "meta.lmdb"))
    c = next(iter(ix.iter_chunks()))
    with ix.write() as w:  # the same bytes as a flip would leave: only the length differs
        w.txn.put(c.chunk_id.to_bytes(8, "big"),
                  Chunk(c.chunk_id, c.log_id, c.offset, c.length | (1 << 45), c.sealed_ns,
                        c.members).pack(), db=ix.chunk)
        w._add(b"chunk_bytes", 1 << 45)  # the counters agree: the index walk passes
    ix.close()
    rc, rep = _verify(tmp_path / "cache")
    assert rc == 1, rep
    assert not rep.get("index_damaged"), rep
    assert [b["chunk"] for b in rep["bad_chunks"]] == [c.chunk_id], rep


@pytest.mark.daemon_log_allows(STALE_MOUNT)
def test_the_index_walk_is_skipped_only_after_a_clean_stop(dataset, mount, tmp_path):
    """The walk reads the whole index (seconds for a million files): a start after a
    clean stop, with the file untouched since, skips it; a start after a crash walks."""
    src, files = dataset
    marker = tmp_path / "cache" / "meta.lmdb.clean"
    m = mount(src)
    chaos.check_all(m.mnt, files)
    m.umount()
    assert marker.exists()
    m2 = mount(src)
    assert not marker.exists()  # in use: a crash from here on must make the next start walk
    m2.kill9()
    m3 = mount(src)
    assert chaos.check_all(m3.mnt, files).ok == len(files)
    m3.umount()
    starts = [line for line in m.log.read_text().splitlines()
              if "not walked" in line or "index checked" in line]
    assert ["not walked" in line for line in starts] == [False, True, False], starts


def test_index_check_sees_a_directory_entry_naming_another_file(tmp_path):
    """A flipped directory entry that names a sibling would serve the sibling's bytes
    under this name, and they pass their checksum: the walk compares each directory
    entry with the entry of the inode it names."""
    from dlcachefs.store.index import Index
    from dlcachefs.store.integrity import check_index
    from dlcachefs.store.schema import Entry, dirent_key, ukey

    path = str(tmp_path / "meta.lmdb")
    ix = Index(path)
    with ix.write() as w:
        w.put_entry(Entry(1, 0, b"", 0o40755, 2, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0.0))
        for ino, name in ((20, b"a.jpg"), (21, b"b.jpg")):
            w.put_entry(Entry(ino, 1, name, 0o100644, 1, 0, 0, 10, 1, 0, 0, 0, 0, ino, 0.0))
    ix.close()
    assert check_index(path) is None
    ix = Index(path)
    with ix.write() as w:
        w.txn.put(dirent_key(1, b"a.jpg"), ukey(21), db=ix.dirent)
    ix.close()
    assert "names inode 21, whose entry disagrees" in check_index(path)


def test_index_check_sees_a_record_of_no_file(tmp_path):
    """Found by the corruption bench: a high bit flipped in a record's key left a record of
    an inode no entry has and its chunk does not list; the mount failed at start under
    --debug-invariants. The walk reports it, so the index is set aside instead."""
    from dlcachefs.store.index import Index
    from dlcachefs.store.integrity import check_index
    from dlcachefs.store.schema import Chunk, Entry, Record, ukey

    path = str(tmp_path / "meta.lmdb")
    ix = Index(path)
    with ix.write() as w:
        w.put_entry(Entry(1, 0, b"", 0o40755, 2, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0.0))
        w.put_entry(Entry(26, 1, b"a", 0o100644, 1, 0, 0, 10, 1, 0, 0, 0, 0, 5, 0.0))
        w.put_chunk(Chunk(3, 1, 0, 100, 0, (26,)))
        w.put_record(26, Record(3, 1, 10, 10, 1234, 0, 5))
    ix.close()
    assert check_index(path) is None
    ix = Index(path)
    with ix.write() as w:
        v = w.txn.get(ukey(26), db=ix.record)
        w.txn.delete(ukey(26), db=ix.record)
        w.txn.put(ukey(26 | (1 << 54)), v, db=ix.record)
    ix.close()
    why = check_index(path)
    assert "records of no namespace entry" in why and "not listed by their chunks" in why


# ----- what damage leaves derived: counters, next ids (found by the damage scenario, seed 77) ---

RECOUNTED = (r"WARNING dlcachefs\.cache\.recovery: the index's derived values disagreed with "
             r"its entries")


@pytest.mark.daemon_log_allows(
    r"ERROR dlcachefs\.cache\.invariants: invariant violated: ",
    r"WARNING dlcachefs\.store\.integrity: the index may be damaged \(invariant violated: ",
    # (the daemon's next write finds the file changed outside its commits: the same damage)
    r"WARNING dlcachefs\.store\.integrity: the index may be damaged \(the index file "
    r"changed outside",
    RECOUNTED + r".*recounted: cached_bytes -\d+ -> \d+, chunk_bytes -\d+ -> \d+")
def test_a_counter_damaged_under_the_daemon_is_recounted_at_the_next_start(dataset, mount,
                                                                           tmp_path):
    """``bench.chaos --scenario corrupt --seed 77``: the size counters damaged under the
    running daemon (what a value read back from a damaged page does) broke the cache's
    invariants after the next commit; the daemon logged it, its clean stop then marked
    the index clean, the next start skipped the walk and refused the mount
    (``--debug-invariants``; without it, the ``--cache-size`` account would start from
    the damaged counter). The violation is damage now: no clean marker, the next start
    walks the index, recounts (a WARNING) and mounts; every file exact."""
    from dlcachefs.store import schema as SC
    from dlcachefs.store.index import Index

    src, files = dataset
    names = sorted(files)
    m = mount(src)
    first = {k: files[k] for k in names[:30]}
    assert chaos.check_all(m.mnt, first).ok == 30
    m.wait_cached(30)
    ix = Index(str(tmp_path / "cache" / "meta.lmdb"))
    try:  # another process's write, as a flipped high bit would leave them
        with ix.write() as w:
            w._add(SC.K_CHUNK_BYTES, -(1 << 32))
            w._add(SC.K_CACHED_BYTES, -(1 << 32))
    finally:
        ix.close()
    assert chaos.check_all(m.mnt, files).ok == len(files)
    m.wait_cached(len(files))  # the commits after the damage: the check sees it
    m.umount()
    assert not (tmp_path / "cache" / "meta.lmdb.clean").exists()  # not blessed
    m2 = mount(src)
    log_text = m.log.read_text()
    assert "invariant violated" in log_text
    assert "recounted: cached_bytes" in log_text.split("index checked in")[-1]
    drop_page_cache()
    t = chaos.check_all(m2.mnt, files)
    assert (t.ok, t.wrong, dict(t.errors)) == (len(files), 0, {})
    st = m2.stats()  # the counters as the entries say: every file cached, once
    assert st["cached_bytes"] == sum(map(len, files.values())), st
    assert 0 < st["chunk_bytes"] < 1 << 31, st
    # (and the oracle's verify at teardown finds them right)


@pytest.mark.daemon_log_allows(DAMAGED_INDEX, RECOUNTED)
def test_an_index_recovery_cannot_recount_is_set_aside_not_a_failed_mount(dataset, mount,
                                                                          tmp_path):
    """Damage that changes neither the index file's size nor its times (a disk flipping
    bits) passes the clean-stop marker, so the start does not walk; recovery's check
    (``--debug-invariants``) then finds records of a chunk gone: the index is set aside
    (a WARNING) and the mount starts with an empty cache, never refuses."""
    from dlcachefs.store import integrity
    from dlcachefs.store.index import Index

    src, files = dataset
    m = mount(src)
    chaos.check_all(m.mnt, files)
    m.wait_cached(len(files))
    m.umount()
    index_dir = str(tmp_path / "cache" / "meta.lmdb")
    ix = Index(index_dir)
    try:
        c = next(iter(ix.iter_chunks()))
        with ix.write() as w:
            w.txn.delete(c.chunk_id.to_bytes(8, "big"), db=ix.chunk)
    finally:
        ix.close()
    integrity.mark_clean(index_dir)  # as if the file were as the clean stop left it
    m2 = mount(src)
    assert (tmp_path / "cache" / "meta.lmdb.damaged" / "QUARANTINED").exists()
    text = m.log.read_text()
    assert "not walked" in text and "index invariants violated: record of inode" in text
    drop_page_cache()
    t = chaos.check_all(m2.mnt, files)
    assert (t.ok, t.wrong, dict(t.errors)) == (len(files), 0, {})


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs: index \S+ not marked clean \(dirent: 1 keys or values of a wrong "
    r"length\): the next start walks it", DAMAGED_INDEX)
def test_damage_written_under_the_map_is_found_at_the_stop(dataset, mount, tmp_path):
    """``bench.chaos --scenario corrupt --injections 1000 --seed 2001``: damage written
    into the index while the daemon mapped it, on pages it never read again, passed its
    clean stop (its own commits move the file's times, so the marker matched), and the
    next start, skipping its walk, was aborted by an LMDB assertion. The stop walks the
    index now and marks it clean only when the walk passes."""
    from dlcachefs.store.index import Index

    src, files = dataset
    m = mount(src)
    chaos.check_all(m.mnt, files)
    m.wait_cached(len(files))
    ix = Index(str(tmp_path / "cache" / "meta.lmdb"))
    try:  # another process's write under the daemon's map, on a page it does not read
        with ix.write() as w:
            w.txn.put(bytes(9), b"bad", db=ix.dirent)
    finally:
        ix.close()
    m.umount()
    assert not (tmp_path / "cache" / "meta.lmdb.clean").exists()
    m2 = mount(src)
    assert (tmp_path / "cache" / "meta.lmdb.damaged" / "QUARANTINED").exists()
    assert "not marked clean" in m.log.read_text()
    drop_page_cache()
    t = chaos.check_all(m2.mnt, files)
    assert (t.ok, t.wrong, dict(t.errors)) == (len(files), 0, {})
