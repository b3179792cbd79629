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
