"""Tier 2: the index check at start (dlcachefs.store.integrity) throws a cache away only
for what reading its index does, never because the check itself could not run."""

from __future__ import annotations

import logging
import os

import pytest

from dlcachefs.store import integrity
from dlcachefs.store.index import Index


@pytest.fixture
def index_dir(tmp_path):
    ix = Index(str(tmp_path / "meta.lmdb"))
    ix.close()
    return str(tmp_path / "meta.lmdb")


def test_a_good_index_passes_from_any_working_directory(index_dir, monkeypatch):
    monkeypatch.chdir("/")  # as the daemon, after it daemonized
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert integrity.check_index(index_dir) is None


@pytest.mark.parametrize("child, damaged", [
    ("import os, signal; os.kill(os.getpid(), signal.SIGBUS)", True),
    ("import os, signal; os.kill(os.getpid(), signal.SIGABRT)", True),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", False),  # the OOM killer
    ("raise SystemExit(1)", False),  # no report: e.g. the check could not be imported
    ("print('{\"unchecked\": \"MemoryError\"}')", False),
    ("print('{\"problems\": [\"inode 3: 9 bytes\"]}')", True),
    ("print('{\"problems\": []}')", False),
])
@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.store\.integrity: index .*(could not be checked|gave no report|was killed).*; kept unchecked")
def test_only_what_reading_the_index_does_counts_as_damage(index_dir, monkeypatch, caplog,
                                                           child, damaged):
    monkeypatch.setattr(integrity, "_CHILD", child)
    with caplog.at_level(logging.WARNING, logger=integrity.__name__):
        why = integrity.check_index(index_dir)
    assert (why is not None) == damaged, why
    if not damaged and "problems" not in child:
        assert "kept unchecked" in caplog.text  # said, not silent


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.store\.integrity: index .* could not be checked \(cannot run the check")
def test_the_real_child_reports_a_failure_to_run_as_unchecked(index_dir, monkeypatch, caplog):
    """The check's own import failing (an old install, a broken path) keeps the index."""
    monkeypatch.setattr(integrity, "_CHILD",
                        integrity._CHILD.replace("from dlcachefs.store.integrity import probe",
                                                 "from dlcachefs.store.no_such import probe"))
    with caplog.at_level(logging.WARNING, logger=integrity.__name__):
        assert integrity.check_index(index_dir) is None
    assert "cannot run the check" in caplog.text
    assert os.path.exists(os.path.join(index_dir, "data.mdb"))


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.store\.integrity: index .* the check did not finish in [\d.]+ s; kept unchecked")
def test_a_timeout_keeps_the_index_and_says_so(index_dir, monkeypatch, caplog):
    monkeypatch.setattr(integrity, "_CHILD", "import time; time.sleep(30)")
    with caplog.at_level(logging.WARNING, logger=integrity.__name__):
        assert integrity.check_index(index_dir, timeout=0.5) is None
    assert "did not finish" in caplog.text


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.store\.integrity: the index may be damaged \(error: unpack_from")
def test_a_value_unpacked_short_is_damage_not_an_unexpected_error(monkeypatch):
    """An index value of the wrong length (struct.error while serving; the chaos suite's
    injections into a mapped index found one) is the damage an LMDB page error is: noted
    (the stop leaves no clean marker, so the next start walks the index), answered EIO
    without an ERROR traceback. Other errors are not."""
    import struct

    monkeypatch.setattr(integrity, "_run_errors", [])
    assert not integrity.note_error(ValueError("x")) and not integrity.damage_seen()
    try:
        struct.unpack_from("<QQ", b"short")
    except struct.error as e:
        assert integrity.note_error(e)
    assert integrity.damage_seen()


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.store\.integrity: the index may be damaged \(BadTxnError",
    r"WARNING tests: a loop failed \(the index may be damaged: CorruptedError: ")
def test_one_damage_path_classifies_lmdb_errors(monkeypatch, caplog):
    """Which LMDB errors mean damage: a page error does; a full map or disk does not; a
    BadTxnError (LMDB refusing a transaction after an error in it) is damage unless a
    full map or disk came before it. A loop that degrades (:func:`integrity.log_failure`) logs damage as a
    WARNING without a traceback, anything else with its traceback."""
    import lmdb

    monkeypatch.setattr(integrity, "_run_errors", [])
    monkeypatch.setattr(integrity, "_last_lmdb_error", [])
    assert not integrity.note_error(lmdb.MapFullError("full"))
    assert not integrity.note_error(lmdb.BadTxnError("after a full map"))
    assert not integrity.damage_seen()
    monkeypatch.setattr(integrity, "_last_lmdb_error", [])
    assert integrity.note_error(lmdb.BadTxnError("a read over damaged pages"))  # none before
    assert integrity.note_error(lmdb.CorruptedError("page"))
    assert integrity.note_error(lmdb.BadTxnError("after damage"))
    assert integrity.note_error(lmdb.PageNotFoundError("gone"))
    assert integrity.damage_seen()
    log = logging.getLogger("tests")
    caplog.set_level(logging.INFO)
    for exc in (lmdb.CorruptedError("page again"), ValueError("a bug")):
        try:
            raise exc
        except Exception:  # noqa: BLE001
            integrity.log_failure(log, "a loop failed")
    mine = [r for r in caplog.records if r.name == "tests"]
    assert [(r.levelname, bool(r.exc_info)) for r in mine] == [("WARNING", False),
                                                               ("ERROR", True)]
    caplog.clear()  # the ERROR was the point (tests is not the dlcachefs logger anyway)


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.store\.integrity: the index may be damaged \(invariant violated: x\)")
def test_note_damage_keeps_the_stop_from_blessing_the_index(monkeypatch, caplog):
    monkeypatch.setattr(integrity, "_run_errors", [])
    with caplog.at_level(logging.WARNING):
        integrity.note_damage("invariant violated: x")
        integrity.note_damage("invariant violated: y")
    assert integrity.damage_seen()
    warned = [r for r in caplog.records if "may be damaged" in r.getMessage()]
    assert len(warned) == 1 and "invariant violated: x" in warned[0].getMessage()
    caplog.clear()


def test_recount_sets_every_derived_value_to_what_the_entries_say(tmp_path):
    """Counters and sequences damaged while every entry is sound: ``recount`` puts them
    right and says which; without ``full`` the statistics counters are left alone."""
    from dlcachefs.store import schema as S
    from dlcachefs.store.schema import Chunk, Entry, Record

    ix = Index(str(tmp_path / "meta.lmdb"))
    try:
        with ix.write() as w:
            w.put_entry(Entry(1, 0, b"", 0o40755, 2, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0.0))
            for ino, size in ((20, 10), (21, 30)):
                w.put_entry(Entry(ino, 1, b"f%d" % ino, 0o100644, 1, 0, 0, size, 1, 0, 0, 0,
                                  0, ino, 0.0))
            w.put_chunk(Chunk(7, 3, 0, 100, 0, (20, 21)))
            w.put_record(20, Record(7, 3, 10, 10, 1, 0, 20))
            w.put_record(21, Record(7, 3, 20, 30, 2, 0, 21))
        # entries put by hand, the sequences not moved past them: recount moves them
        assert set(ix.recount(full=True)) == {"next_ino", "next_chunk", "next_log"}
        assert ix.recount(full=True) == {}  # consistent: nothing to say
        right = ix.snapshot()
        with ix.write() as w:
            w._add(S.K_CHUNK_BYTES, -(1 << 32))
            w._add(S.K_CACHED_BYTES, 1 << 40)
            w._add(S.K_FILES, 5)
            w.set_meta(S.K_NEXT_INO, (3).to_bytes(8, "little"))
            w.set_meta(S.K_NEXT_CHUNK, (2).to_bytes(8, "little"))
        fixed = ix.recount(full=False)
        assert set(fixed) == {"chunk_bytes", "next_ino", "next_chunk"}, fixed
        assert fixed["next_ino"] == (3, 22) and fixed["next_chunk"] == (2, 8)
        assert fixed["chunk_bytes"] == (100 - (1 << 32), 100)
        assert ix.counter(S.K_CACHED_BYTES) == right["cached_bytes"] + (1 << 40)
        assert set(ix.recount(full=True)) == {"cached_bytes", "n_files"}
        assert ix.snapshot() == right and ix.check_invariants() == []
        with ix.write() as w:
            assert w.alloc(S.K_NEXT_INO) == 22  # a new file never takes an inode in use
    finally:
        ix.close()


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.store\.logs: could not punch a hole in log \d+ at \d+\+\d+ "
    r"\(File too large\): the chunk's index entry may be damaged")
def test_a_hole_past_any_log_size_is_damage_said_without_a_traceback(tmp_path, caplog):
    """``bench.chaos --scenario corrupt --seed 1008``: evicting a chunk whose index entry
    had a flipped offset asked the kernel for a hole at 2^60 (EFBIG), logged with a
    traceback. Such a range is a damaged entry: a WARNING says so, nothing else fails."""
    from dlcachefs.store.logs import LogStore

    logs = LogStore(str(tmp_path / "logs"), 1 << 20)
    try:
        logs.start_log(1)
        log_id, off = logs.append(b"x" * 8192)
        with caplog.at_level(logging.WARNING):
            logs.punch(log_id, 1 << 62, 4096)
        assert logs.read(log_id, off, 8192) == b"x" * 8192
    finally:
        logs.close()
    warned = [r for r in caplog.records if r.name == "dlcachefs.store.logs"]
    assert len(warned) == 1 and not warned[0].exc_info, warned


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.store\.integrity: the index may be damaged \(the index file changed")
def test_the_sound_flag_follows_the_daemons_commits_and_nothing_else(tmp_path, monkeypatch,
                                                                      caplog):
    """The flag names the index file as the daemon's last commit left it: it follows each
    of its writes; a change made outside them is noted as damage at the next write, and
    the flag is taken away for good (readers in training processes map the index only
    while the flag names the file as it is)."""
    monkeypatch.setattr(integrity, "_run_errors", [])
    monkeypatch.setattr(integrity, "_sound_flags", [])
    ix = Index(str(tmp_path / "meta.lmdb"))
    flag = tmp_path / "zerocopy" / "index-sound"
    try:
        ix.guard = integrity.hold_sound(str(flag), ix.path)
        assert flag.read_text().strip() == integrity.stamp_of(ix.path)
        for i in range(3):
            with ix.write() as txn:
                txn.set_meta(b"k", b"x" * (i + 1) * 5000)
            assert flag.read_text().strip() == integrity.stamp_of(ix.path)
        assert not integrity.damage_seen()
        data = tmp_path / "meta.lmdb" / "data.mdb"
        st = data.stat()
        os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # as a write under the map
        assert flag.read_text().strip() != integrity.stamp_of(ix.path)  # readers: not sound
        with caplog.at_level(logging.WARNING), ix.write() as txn:
            txn.set_meta(b"k", b"y")
        assert integrity.damage_seen() and not flag.exists()
        with ix.write() as txn:  # and it stays away
            txn.set_meta(b"k", b"z")
        assert not flag.exists()
    finally:
        ix.close()
    caplog.clear()
