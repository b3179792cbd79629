"""Tier 2: the cache directory's own modes (dlcachefs.store.modes), without a mount: what
the store makes is the owner's whatever the umask, the walk that tightens an existing
directory (never through a link), the reader group's modes, and ``--reader-group``'s
checks. The mounted cases are in test_t7_security.py."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

import pytest

from dlcachefs import cli
from dlcachefs.errors import DlcError
from dlcachefs.store import ledger as L
from dlcachefs.store import modes as M
from dlcachefs.store import tally as T
from dlcachefs.store.index import Index
from dlcachefs.store.lock import CacheLock
from dlcachefs.store.logs import LogStore

ROOT = os.geteuid() == 0
#: a group no entry has: root may give a file to any gid, known to the system or not
OTHER_GID = 43210


def mode(p: Path | str) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def every_entry(top: Path) -> dict[str, int]:
    """Relative path -> mode of ``top`` and everything under it (links not followed)."""
    out = {".": mode(top)}
    for dp, dirs, files in os.walk(top):
        for n in dirs + files:
            p = Path(dp) / n
            out[str(p.relative_to(top))] = mode(p)
    return out


@contextlib.contextmanager
def umask(value: int):
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


def loose_tree(top: Path) -> None:
    """A cache directory as ``mkdir``/``cp`` under umask 022 leave it (0755 and 0644)."""
    for d in ("meta.lmdb", "logs", "zerocopy"):
        (top / d).mkdir(parents=True)
    for f in ("meta.lmdb/data.mdb", "meta.lmdb/lock.mdb", "logs/00000001.log",
              "dlcachefs.log", "lock", "meta.lmdb.clean"):
        (top / f).write_bytes(b"x")
    for p in [top, *top.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


# ----- what the store makes ------------------------------------------------------------------


def test_the_store_makes_owner_only_entries_whatever_the_umask(tmp_path):
    cache = tmp_path / "cache"
    with umask(0):
        lock = CacheLock(str(cache))
        lock.acquire("/mnt")
        ix = Index(str(cache / "meta.lmdb"))
        logs = LogStore(str(cache / "logs"), 1 << 20)
        logs.start_log(1)
        L.Ledger(str(tmp_path / "root")).update(lambda doc: None)
        w = T.TallyWriter(str(cache / T.TALLY_DIR))
    try:
        got = {**every_entry(cache), **{f"root/{k}": v
                                         for k, v in every_entry(tmp_path / "root").items()}}
        assert set(got) >= {".", "lock", "meta.lmdb", "meta.lmdb/data.mdb",
                            "meta.lmdb/lock.mdb", "logs", "logs/00000001.log", "zerocopy",
                            "root/.", "root/ledger.json", "root/ledger.lock"}, got
        assert {k: v for k, v in got.items() if v & M.OTHERS} == {}
    finally:
        w.close()
        logs.close()
        ix.close()
        lock.release()


def test_new_files_take_the_group_read_bit_of_their_directory(tmp_path):
    d = tmp_path / "logs"
    d.mkdir()
    d.chmod(0o700)
    assert M.file_mode_in(str(d)) == 0o600
    d.chmod(0o2750)
    assert M.file_mode_in(str(d)) == 0o640
    with umask(0o077):  # a reader group's log file, whatever the umask
        logs = LogStore(str(d), 1 << 20)
        logs.start_log(1)
        logs.close()
    assert mode(d / "00000001.log") == 0o640
    z = tmp_path / "zerocopy"
    z.mkdir()
    z.chmod(0o700)
    assert T.counter_mode(str(z)) == 0o600
    z.chmod(0o3770)
    with umask(0o077):  # a member's counter file: the daemon, in the group, reads it
        w = T.TallyWriter(str(z))
    try:
        assert mode(w.path) == 0o640
    finally:
        w.close()


# ----- the walk ------------------------------------------------------------------------------


def test_a_loose_cache_directory_is_tightened_and_reported(tmp_path):
    top = tmp_path / "cache"
    loose_tree(top)
    found = M.enforce(str(top), M.CacheModes())
    assert {p for p, _ in found.loose} == {str(top / k) for k in every_entry(top)} | {str(top)}
    assert (str(top), 0o755) in found.loose and (str(top / "meta.lmdb/data.mdb"), 0o644) in found.loose
    assert not found.failed and not found.foreign
    modes = every_entry(top)
    assert all(v == (0o700 if (top / k).is_dir() else 0o600) for k, v in modes.items()), modes
    again = M.enforce(str(top), M.CacheModes())  # nothing left to say
    assert not again.loose and again.changed == 0


def test_keep_leaves_the_modes_and_still_reports_them(tmp_path):
    top = tmp_path / "cache"
    loose_tree(top)
    before = every_entry(top)
    found = M.enforce(str(top), M.CacheModes(), keep=True)
    assert len(found.loose) == len(before) and every_entry(top) == before


def test_links_and_foreign_entries_are_never_changed(tmp_path):
    top = tmp_path / "cache"
    loose_tree(top)
    outside = tmp_path / "outside"
    outside.write_bytes(b"secret")
    outside.chmod(0o644)
    os.symlink(outside, top / "logs" / "00000002.log")
    outdir = tmp_path / "outdir"
    outdir.mkdir()
    outdir.chmod(0o755)
    (outdir / "f").write_bytes(b"x")
    (outdir / "f").chmod(0o644)
    os.symlink(outdir, top / "meta.lmdb.damaged")  # a directory link: not walked into
    linked = tmp_path / "linked"
    linked.write_bytes(b"x")
    linked.chmod(0o644)
    os.link(linked, top / "logs" / "00000003.log")  # a hard link someone made
    found = M.enforce(str(top), M.CacheModes())
    assert mode(outside) == mode(linked) == mode(outdir / "f") == 0o644
    assert mode(outdir) == 0o755
    assert found.foreign == [str(top / "logs" / "00000003.log")]
    if ROOT:  # another user's file (a group member's counter file) stays theirs
        mine = top / "zerocopy" / "1-a.tally"
        mine.write_bytes(b"x")
        os.chown(mine, 4242, 4242)
        mine.chmod(0o644)
        found = M.enforce(str(top), M.CacheModes())
        assert str(mine) in found.foreign and mode(mine) == 0o644


@pytest.mark.skipif(not ROOT, reason="gives files to a group this user is not in")
def test_a_reader_groups_modes(tmp_path):
    top = tmp_path / "cache"
    loose_tree(top)
    (top / "zerocopy" / "1-a.tally").write_bytes(b"x")
    (top / "zerocopy" / "1-a.tally").chmod(0o600)
    (top / "zerocopy" / "advice").write_bytes(b"x")
    (top / "zerocopy" / "advice").chmod(0o600)
    modes = M.CacheModes(OTHER_GID, "readers")
    found = M.enforce(str(top), modes)
    # others' bits go (with a warning); the group's are given (quietly)
    assert (str(top), 0o755) in found.loose
    assert every_entry(top) == {
        ".": 0o2750, "meta.lmdb": 0o2750, "logs": 0o2750, "zerocopy": 0o3770,
        "meta.lmdb/data.mdb": 0o640, "meta.lmdb/lock.mdb": 0o660, "logs/00000001.log": 0o640,
        "dlcachefs.log": 0o640, "meta.lmdb.clean": 0o640, "zerocopy/1-a.tally": 0o640,
        "zerocopy/advice": 0o660, "lock": 0o600}
    assert {os.lstat(top / k).st_gid for k in every_entry(top)} == {OTHER_GID}
    assert M.enforce(str(top), modes).changed == 0
    # back to the owner's alone: the group's bits were "other users" too
    found = M.enforce(str(top), M.CacheModes())
    assert (str(top), 0o2750) in found.loose
    assert set(every_entry(top).values()) == {0o700, 0o600}


def test_a_shared_roots_ledger_stays_the_daemons(tmp_path):
    modes = M.CacheModes(OTHER_GID, "readers")
    assert modes.wanted(L.LEDGER, False) == modes.wanted(L.LEDGER_LOCK, False) == 0o600
    assert modes.wanted(f"{L.LEDGER}.123.tmp", False) == 0o600
    assert modes.wanted("datasets", True) == 0o2750
    assert M.CacheModes().umask == 0o077 and modes.umask == 0o027


def test_unreachable_names_the_directory_that_stops_the_group(tmp_path):
    base = tmp_path / "base"
    (base / "cache").mkdir(parents=True)
    modes = M.CacheModes(OTHER_GID, "readers")
    assert M.unreachable(str(base / "cache"), M.CacheModes()) is None
    base.chmod(0o750)
    # tmp_path's own parents are pytest's (0700): the first one found stops the group
    assert M.unreachable(str(base / "cache"), modes) is not None
    assert M.unreachable("/cache", modes) is None  # / lets everyone search


# ----- --reader-group --------------------------------------------------------------------------


def test_reader_group_is_resolved_or_refused():
    assert M.reader_group(None) == M.CacheModes()
    own = M.reader_group(str(os.getegid()))
    assert own.gid == os.getegid() and own.group
    with pytest.raises(DlcError, match="--reader-group no-such-group-dlc: no such group"):
        M.reader_group("no-such-group-dlc")


def test_an_unknown_reader_group_is_a_config_error_not_a_traceback(tmp_path, capsys):
    src, mnt = tmp_path / "src", tmp_path / "mnt"
    src.mkdir()
    mnt.mkdir()
    rc = cli.main(["mount", str(src), str(mnt), "--cache-dir", str(tmp_path / "cache"),
                   "--reader-group", "no-such-group-dlc"])
    err = capsys.readouterr().err
    assert rc == 2 and err == "dlcachefs: --reader-group no-such-group-dlc: no such group\n"
    assert not (tmp_path / "cache").exists()
    with pytest.raises(ValueError, match="needs a group name"):
        cli.config_from_args(cli.build_parser().parse_args(
            ["mount", str(src), str(mnt), "--reader-group", " "]))
