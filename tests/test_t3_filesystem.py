"""Tier 3: the filesystem facade (:class:`dlcachefs.cache.filesystem.Filesystem`) without a
kernel: the answers the FUSE adapter turns into replies, the ``.dlcache/`` directory, the
read-only refusals, and the requests counted for ``fuse_ops``."""

from __future__ import annotations

import json
import os

import pytest

from dlcachefs.cache import virtual as V
from dlcachefs.cache.filesystem import OPS, Filesystem, ServedEngine
from dlcachefs.cache.namespace import ROOT_INO
from dlcachefs.errors import ControlError, IsADirectory, NotFound, PermissionDenied, ReadOnly
from dlcachefs.session import Session
from dlcachefs.testing.fakes import make_config, run_engine, run_session, write_tree

FILES = {b"train/a/x.bin": b"x" * 3000, b"train/a/y.bin": b"y" * 10}


def facade(sess: Session, opened_dirs: list | None = None, control_opens: list | None = None
           ) -> Filesystem:
    """The facade over ``sess`` as the session wires it, with what it calls recorded."""
    eng = sess.engine

    async def statfs() -> os.statvfs_result:
        return await eng.calls.call(eng.source.statvfs)

    return Filesystem(eng, control=sess.control, stats=sess.stats,
                      on_opendir=(opened_dirs if opened_dirs is not None else []).append,
                      on_control_open=lambda: (control_opens if control_opens is not None
                                               else []).append(1),
                      statfs=statfs)


def test_the_engine_provides_what_the_facade_declares(tmp_path):
    write_tree(tmp_path / "src", FILES)

    async def body(eng):
        names = {n for k in ServedEngine.__mro__ for n in vars(k)
                 if not n.startswith("_")} | set(ServedEngine.__annotations__)
        assert {"open", "read", "release", "ns", "cfg"} <= names
        assert not [n for n in sorted(names) if not hasattr(eng, n)]

    run_engine(make_config(tmp_path / "src", tmp_path / "cache"), body)


def test_files_directories_and_refusals(tmp_path):
    write_tree(tmp_path / "src", FILES)
    dirs: list = []

    async def body(sess):
        eng = sess.engine
        fs = facade(sess, opened_dirs=dirs)
        train = (await fs.lookup(ROOT_INO, b"train")).entry
        a = (await fs.lookup(train.ino, b"a")).entry
        x = await fs.lookup(a.ino, b"x.bin")
        assert x.entry.size == 3000 and x.timeout == eng.cfg.revalidate
        assert (await fs.getattr(x.entry.ino)).entry == x.entry
        with pytest.raises(NotFound):
            await fs.lookup(a.ino, b"nope")
        dh = await fs.opendir(a.ino)
        assert [d.name for d in dirs] == [b"a"]  # the streams hear of it
        listed = list(fs.readdir(dh, 0))
        assert [(n, at.entry.ino, i) for n, at, i in listed] == [
            (b".", a.ino, 1), (b"..", train.ino, 2),
            (b"x.bin", x.entry.ino, 3), (b"y.bin", listed[3][1].entry.ino, 4)]
        assert [n for n, _, _ in fs.readdir(dh, 3)] == [b"y.bin"]
        fs.releasedir(dh)
        r = await fs.open(x.entry.ino, os.O_RDONLY, 0, 0)
        assert r.entry is not None and r.entry.size == 3000 and not r.direct_io
        assert bytes(await fs.read(r.fh, 2990, 100)) == b"x" * 10
        fs.release(r.fh)
        for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC):
            with pytest.raises(ReadOnly):
                await fs.open(x.entry.ino, flags, 0, 0)
        with pytest.raises(ReadOnly):
            fs.write(r.fh, b"no")
        with pytest.raises(ReadOnly):
            fs.access(x.entry.ino, writing=True)
        fs.access(x.entry.ino, writing=False)
        with pytest.raises(ReadOnly):
            fs.setattr(x.entry.ino, size=0, mode_or_owner=False)
        assert (await fs.statfs()).f_bsize > 0
        assert fs.requests["lookup"] == 4 and fs.requests["open"] == 4
        assert fs.requests["read"] == 1 and fs.requests["release"] == 1
        assert fs.requests["dlcache"] == 0 and set(fs.requests) == set(OPS)

    run_session(make_config(tmp_path / "src", tmp_path / "cache"), body)


def test_the_dlcache_directory(tmp_path):
    write_tree(tmp_path / "src", FILES)
    control_opens: list = []

    async def body(sess):
        fs = facade(sess, control_opens=control_opens)
        d = await fs.lookup(ROOT_INO, V.VDIR_NAME)
        assert d.entry.ino == V.VDIR_INO and d.timeout == V.TIMEOUT
        assert (await fs.lookup(V.VDIR_INO, b"stats")).entry.ino == V.STATS_INO
        with pytest.raises(NotFound):
            await fs.lookup(V.VDIR_INO, b"nope")
        dh = await fs.opendir(V.VDIR_INO)
        assert [n for n, _, _ in fs.readdir(dh, 0)] == [b".", b"..", b"control", b"errors",
                                                        b"stats", b"zerocopy"]
        fs.releasedir(dh)
        # the root's listing does not show it
        dh = await fs.opendir(ROOT_INO)
        assert V.VDIR_NAME not in [n for n, _, _ in fs.readdir(dh, 0)]
        fs.releasedir(dh)
        with pytest.raises(IsADirectory):
            await fs.open(V.VDIR_INO, os.O_RDONLY, 0, 0)
        uid = os.getuid()
        r = await fs.open(V.STATS_INO, os.O_RDONLY, uid, 1)
        assert r.direct_io and not r.keep_cache
        doc = json.loads(await fs.read(r.fh, 0, 1 << 20))
        assert doc["fuse_ops"]["lookup"] == 0 and doc["fuse_ops"]["dlcache"] >= 3
        fs.release(r.fh)
        with pytest.raises(ReadOnly):
            await fs.open(V.STATS_INO, os.O_WRONLY, uid, 1)
        # the control file: its owner's, written whole, truncated by `echo >`
        w = await fs.open(V.CONTROL_INO, os.O_WRONLY | os.O_TRUNC, uid, 1)
        assert control_opens == [1]  # the sampler replay worker may start
        assert fs.setattr(V.CONTROL_INO, size=0, mode_or_owner=False).entry.size == 0
        with pytest.raises(ReadOnly):
            fs.setattr(V.CONTROL_INO, size=0, mode_or_owner=True)
        assert fs.write(w.fh, b"job j1\n") == 7
        with pytest.raises(ControlError):
            fs.write(w.fh, b"nonsense\n")
        fs.release(w.fh)
        e = await fs.open(V.ERRORS_INO, os.O_RDONLY, uid, 1)
        assert b"nonsense" in bytes(await fs.read(e.fh, 0, 1 << 16))
        fs.release(e.fh)
        with pytest.raises(PermissionDenied):  # another user (with --allow-other)
            await fs.open(V.CONTROL_INO, os.O_RDONLY, uid + 1, 1)
        r = await fs.open(V.STATS_INO, os.O_RDONLY, uid + 1, 1)
        other = json.loads(await fs.read(r.fh, 0, 1 << 20))
        fs.release(r.fh)
        assert "fuse_ops" in other and not set(V.JOB_SECTIONS) & set(other)
        fs.access(V.CONTROL_INO, writing=True)
        assert fs.requests["lookup"] == 0 and fs.requests["open"] == 0

    run_session(make_config(tmp_path / "src", tmp_path / "cache"), body)
