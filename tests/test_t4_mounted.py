"""Mounted tests: a real dlcachefs daemon in a subprocess, read through the kernel."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from conftest import requires_fuse

from dlcachefs.mountctl import is_mounted, unmount
from dlcachefs.store.index import Index
from dlcachefs.testing.mounting import (
    DLCACHEFS,
    STALE_MOUNT,
    drop_page_cache,
    read_tree,
    wait_until,
)

pytestmark = requires_fuse


def make_tree(root: Path, n_files: int = 60, seed: int = 1) -> dict[str, bytes]:
    """A source tree with nested dirs, odd names, symlinks, empty files and dirs."""
    rnd = random.Random(seed)
    files: dict[str, bytes] = {}
    for i in range(n_files):
        d = root / f"cls{i % 4}" / ("sub" if i % 7 == 0 else "")
        d.mkdir(parents=True, exist_ok=True)
        size = rnd.choice([0, 1, 100, 4096, 30_000, 110_000, 250_000])
        data = rnd.randbytes(size)
        p = d / f"f{i:03d}.bin"
        p.write_bytes(data)
        files[str(p.relative_to(root))] = data
    (root / "empty_dir").mkdir()
    (root / "name with spaces é.txt").write_bytes(b"spaces\n")
    files["name with spaces é.txt"] = b"spaces\n"
    os.symlink("cls1/f001.bin", root / "link_to_file")
    os.symlink("../cls1", root / "cls0" / "link_to_dir")
    os.symlink("/etc/hostname", root / "abs_link")
    bad = os.fsencode(str(root)) + b"/bad_\xff_name"
    with open(bad, "wb") as f:
        f.write(b"non-utf8 name\n")
    os.chmod(root / "cls1" / "f001.bin", 0o600)
    return files


def listing(root: Path) -> list[str]:
    out = subprocess.run(["find", ".", "-printf", r"%p|%y|%s|%m|%T@|%l|%n|%U|%G\n"],
                         cwd=root, capture_output=True, check=True).stdout
    return sorted(out.decode("utf-8", "surrogateescape").splitlines())


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    make_tree(root)
    return root


def test_tree_and_bytes_match_the_source(src, mount):
    m = mount(src)
    assert subprocess.run(["diff", "-r", "--no-dereference", str(src), str(m.mnt)]).returncode == 0
    assert listing(m.mnt) == listing(src)
    du = lambda p, *a: subprocess.run(["du", "-s", *a, str(p)], capture_output=True,  # noqa: E731
                                      text=True, check=True).stdout.split()[0]
    assert du(m.mnt) == du(src)
    assert du(m.mnt, "--apparent-size") == du(src, "--apparent-size")
    # df: the source's filesystem, as a read-only bind mount shows it (not 100% used)
    vm, vs = os.statvfs(m.mnt), os.statvfs(src)
    assert (vm.f_frsize, vm.f_blocks) == (vs.f_frsize, vs.f_blocks)
    assert vm.f_bavail > 0 and abs(vm.f_bavail - vs.f_bavail) <= vs.f_blocks // 100
    stat = lambda p: subprocess.run(["stat", "-c", "%s %a %Y %F %h", str(p)],  # noqa: E731
                                    capture_output=True, text=True, check=True).stdout
    for rel in ["cls1/f001.bin", "cls0", "link_to_file", "empty_dir"]:
        assert stat(m.mnt / rel) == stat(src / rel)
    cat = subprocess.run(["cat", str(m.mnt / "cls2" / "f002.bin")], capture_output=True, check=True)
    assert cat.stdout == (src / "cls2" / "f002.bin").read_bytes()
    assert os.readlink(m.mnt / "link_to_file") == "cls1/f001.bin"
    assert os.listdir(os.fsencode(str(m.mnt))) .count(b"bad_\xff_name") == 1
    assert (m.mnt / "link_to_file").read_bytes() == (src / "cls1" / "f001.bin").read_bytes()


def test_second_pass_is_served_from_the_cache(src, mount):
    m = mount(src)
    first = read_tree(m.mnt)
    assert first == read_tree(src)
    n = m.stats()["files"]
    st1 = m.wait_cached(n)
    drop_page_cache()
    assert read_tree(m.mnt) == first
    st2 = m.stats()
    assert st2["bytes_from_source"] == st1["bytes_from_source"]
    assert st2["hits"] > st1["hits"]


def test_a_pass_the_page_cache_serves_reads_nothing_from_the_cache_disk(src, mount):
    """Cached files keep their kernel pages (keep_cache): a pass those pages serve sends
    opens but no READ, and the daemon must not read the files from its logs anyway (a
    memory tier too small for the chunks: every load would be a read of the disk)."""
    m = mount(src, "--memory", "256K")
    first = read_tree(m.mnt)
    m.wait_cached(m.stats()["files"])
    drop_page_cache()
    assert read_tree(m.mnt) == first  # from the logs, into the page cache
    st1 = m.stats()
    assert st1["cache_disk_bytes_read"] > 0
    assert read_tree(m.mnt) == first  # from the page cache
    st2 = m.stats()
    assert st2["fuse_ops"]["open"] > st1["fuse_ops"]["open"]
    assert st2["fuse_ops"].get("read", 0) == st1["fuse_ops"].get("read", 0)
    assert st2["cache_disk_bytes_read"] == st1["cache_disk_bytes_read"]
    assert st2["hits"] > st1["hits"] and st2["bytes_from_source"] == st1["bytes_from_source"]
    opens = st2["fuse_ops"]["open"] - st1["fuse_ops"]["open"]
    assert st2["page_cache_opens"] - st1["page_cache_opens"] == opens  # said in stats


@pytest.mark.daemon_log_allows(STALE_MOUNT)  # the second daemon mounts over the killed one's
def test_kill9_then_remount_serves_from_the_log(src, mount):
    m = mount(src)
    expected = read_tree(m.mnt)
    m.wait_cached(m.stats()["files"])
    m.kill9()
    assert is_mounted(m.mnt)  # the dead daemon left a stale mount; the next mount cleans it
    m2 = mount(src, name="mnt")
    drop_page_cache()
    assert read_tree(m2.mnt) == expected
    st = m2.stats()
    assert st["bytes_from_source"] == 0 and st["misses"] == 0 and st["hits"] > 0


def test_sigterm_commits_pending_records(src, mount):
    m = mount(src)
    expected = read_tree(m.mnt)  # then stop at once: records are still pending in memory
    m.proc.terminate()
    assert m.proc.wait(timeout=60) == 0
    assert not is_mounted(m.mnt)
    m2 = mount(src)
    assert read_tree(m2.mnt) == expected
    assert m2.stats()["bytes_from_source"] == 0


def test_sigterm_while_stopping_is_harmless(src, mount):
    """Regression: a SIGTERM that came while the daemon stopped (here right after a lazy
    unmount, as Mount.cleanup sends it) made it segfault (pyfuse3.terminate() after
    pyfuse3.close()) or die of SIGTERM before its last lines (trio hands a signal still
    pending when its receiver closes to the default handler). A few rounds: the signal
    has to come at the right moment."""
    expected = read_tree(src)
    for _ in range(3):
        m = mount(src)
        assert read_tree(m.mnt) == expected  # records pending in the writer
        assert unmount(m.mnt, lazy="at_once").ok
        m.proc.terminate()
        assert m.proc.wait(timeout=60) == 0
        assert m.log.read_text().rstrip().endswith("stopped; index committed")


@pytest.mark.daemon_log_allows(STALE_MOUNT)  # the second daemon mounts over the killed one's
def test_torn_tail_after_crash_is_dropped(src, mount, tmp_path):
    m = mount(src)
    expected = read_tree(m.mnt)
    m.wait_cached(m.stats()["files"])
    m.kill9()
    logs = sorted((tmp_path / "cache" / "logs").iterdir())
    with open(logs[-1], "ab") as f:  # a chunk that was being appended when the power went
        f.write(b"DLCCHNK1" + os.urandom(5000))
    m2 = mount(src)
    assert read_tree(m2.mnt) == expected
    assert m2.stats()["bytes_from_source"] == 0


@pytest.mark.daemon_log_allows(r"WARNING dlcachefs\.cache\.reader: cached copy of .* is "
                               r"damaged or unreadable")
def test_corrupted_chunk_byte_is_refetched(src, mount, tmp_path):
    m = mount(src)
    expected = read_tree(m.mnt)
    m.wait_cached(m.stats()["files"])
    m.umount()
    ix = Index(str(tmp_path / "cache" / "meta.lmdb"))
    try:
        ino, rec = next((i, r) for i, r in ix.iter_records() if r.size > 1000)
        name = ix.get_entry(ino).name
    finally:
        ix.close()
    log = tmp_path / "cache" / "logs" / f"{rec.log_id:08d}.log"
    with open(log, "r+b") as f:
        f.seek(rec.offset + rec.size // 2)
        b = f.read(1)
        f.seek(rec.offset + rec.size // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    m2 = mount(src)
    drop_page_cache()
    assert read_tree(m2.mnt) == expected
    st = m2.stats()
    assert st["checksum_failures"] >= 1
    assert st["bytes_from_source"] >= rec.size  # the damaged file came from the source again
    assert name  # the record we damaged belonged to a real file
    # and the log names the damaged file, for whoever wonders about the disk
    assert (f"cached copy of {os.fsdecode(name)!r} (inode {ino}, chunk {rec.chunk_id}) "
            f"is damaged or unreadable") in m2.log.read_text()


def test_modified_source_file_gives_new_bytes(src, mount):
    m = mount(src, "--revalidate", "0")
    p = "cls3/f003.bin"
    old = (m.mnt / p).read_bytes()
    assert old == (src / p).read_bytes()
    m.wait_cached(1)
    new = os.urandom(len(old) + 777)
    (src / p).write_bytes(new)
    assert (m.mnt / p).read_bytes() == new
    # same size, new content and mtime
    same = os.urandom(len(new))
    (src / p).write_bytes(same)
    os.utime(src / p, ns=(time.time_ns(), time.time_ns() + 5_000_000_000))
    assert (m.mnt / p).read_bytes() == same
    assert m.stats()["stale_refetches"] >= 1
    # a new file appears in a listing, a removed one disappears
    (src / "cls3" / "brand_new.bin").write_bytes(b"new")
    (src / "cls3" / "f007.bin").unlink(missing_ok=True)
    names = os.listdir(m.mnt / "cls3")
    assert "brand_new.bin" in names and "f007.bin" not in names
    assert (m.mnt / "cls3" / "brand_new.bin").read_bytes() == b"new"


def test_files_too_large_to_cache_are_read_through_and_can_be_mapped(tmp_path, mount):
    """A file above --max-cached-file is read from the source at each read, byte for byte,
    by read() and by mmap (numpy.load(mmap_mode="r") of a large shard: it was ENODEV),
    and a new version on the source is what a new open sees."""
    import mmap

    import numpy as np

    src = tmp_path / "src"
    src.mkdir()
    arr = np.arange(300_000, dtype=np.float32)
    np.save(src / "big.npy", arr)
    (src / "small.bin").write_bytes(b"x" * 1000)
    m = mount(src, "--max-cached-file", "100K", "--revalidate", "0")
    p = m.mnt / "big.npy"
    assert p.read_bytes() == (src / "big.npy").read_bytes()
    got = np.load(p, mmap_mode="r")
    assert np.array_equal(got, arr)
    del got
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        assert mm[-4096:] == (src / "big.npy").read_bytes()[-4096:]
    for arr2 in (arr[::-1].copy(), np.arange(400_000, dtype=np.float32) * 2):
        np.save(src / "big.npy", arr2)  # the same size, then larger
        os.utime(src / "big.npy", ns=(time.time_ns(), time.time_ns() + 5_000_000_000))
        assert p.read_bytes() == (src / "big.npy").read_bytes()
        assert np.array_equal(np.load(p, mmap_mode="r"), arr2)
    assert (m.mnt / "small.bin").read_bytes() == b"x" * 1000
    st = m.stats()
    assert st["cached_files"] <= 1  # the large one never cached
    assert st["bytes_from_source"] >= 5 * arr.nbytes


def test_files_added_on_the_source_are_found_by_path(src, mount):
    """A file, and a directory with a file, added on the source while mounted: opened by
    path without listing the directory first (a manifest-driven dataset does that), they
    are found: a lookup of an unknown name re-lists a stale directory."""
    m = mount(src, "--revalidate", "0")
    assert (m.mnt / "cls1" / "f001.bin").read_bytes() == (src / "cls1" / "f001.bin").read_bytes()
    (src / "cls1" / "added.bin").write_bytes(b"new file\n")
    (src / "new_cls" / "deeper").mkdir(parents=True)
    (src / "new_cls" / "deeper" / "a.bin").write_bytes(b"in a new dir\n")
    assert (m.mnt / "cls1" / "added.bin").read_bytes() == b"new file\n"
    assert (m.mnt / "new_cls" / "deeper" / "a.bin").read_bytes() == b"in a new dir\n"
    with pytest.raises(FileNotFoundError):
        (m.mnt / "cls1" / "never.bin").read_bytes()


def test_vanished_source_file_is_enoent(src, mount):
    m = mount(src, "--revalidate", "0")
    (src / "cls2" / "f002.bin").unlink()
    with pytest.raises(FileNotFoundError):
        (m.mnt / "cls2" / "f002.bin").read_bytes()


def test_an_open_file_shrunk_on_the_source_is_never_read_cut_short(src, mount):
    """The kernel asks GETATTR before reads of an open file and cuts the file at the size
    it gets: answering with the size found on the source meanwhile (smaller) made an open
    read 50 KB of its 250 KB version and stop, with no error. An open file's attributes
    are its open's: the read gets its whole version, or ESTALE, never a part."""
    m = mount(src, "--revalidate", "0")
    f = "cls1/f001.bin"
    old = (src / f).read_bytes()
    assert len(old) > 100_000
    fd = os.open(m.mnt / f, os.O_RDONLY)
    try:
        got = os.read(fd, 16384)
        (src / f).write_bytes(old[:50_000])  # truncated in place on the source
        try:
            while chunk := os.read(fd, 16384):
                got += chunk
                os.fstat(fd)  # a GETATTR between reads, as tools do
        except OSError as e:
            assert e.errno == errno.ESTALE
        else:
            assert got == old, (len(got), len(old))
    finally:
        os.close(fd)
    assert (m.mnt / f).read_bytes() == old[:50_000]  # the next open follows the source


def test_stats_piped_into_head_ends_without_a_traceback(src, mount):
    """The reader of the pipe has gone before the first write (``| head`` after its lines):
    a short exit, no traceback."""
    m = mount(src)
    r_fd, w_fd = os.pipe()
    os.close(r_fd)  # every write now fails with EPIPE
    try:
        r = subprocess.run([*DLCACHEFS, "stats", str(m.mnt)], stdout=w_fd,
                           stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w_fd)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr


def test_stat_follows_the_source_as_an_open_would(src, mount):
    """``--revalidate 0``: ``stat`` (a LOOKUP, or a GETATTR) checks the file as an open
    does: a size changed on the source shows at once, a file deleted there is ENOENT.
    Before, both showed the listing's old attributes until something opened the file."""
    m = mount(src, "--revalidate", "0")
    f = "cls1/f001.bin"
    assert os.stat(m.mnt / f).st_size == os.stat(src / f).st_size
    with open(src / f, "ab") as out:
        out.write(b"0123456789")
    assert os.stat(m.mnt / f).st_size == os.stat(src / f).st_size
    gone = (src / "cls2" / "f002.bin").read_bytes()
    fd = os.open(m.mnt / "cls2" / "f002.bin", os.O_RDONLY)
    try:
        (src / "cls2" / "f002.bin").unlink()
        assert _errno_of(lambda: os.stat(m.mnt / "cls2" / "f002.bin")) == errno.ENOENT
        # still open: fstat (a GETATTR) answers as for an unlinked open local file, and
        # the open reads its version on
        assert os.fstat(fd).st_size == len(gone)
        assert os.pread(fd, len(gone) + 1, 0) == gone
    finally:
        os.close(fd)
    assert _errno_of(lambda: os.stat(m.mnt / "cls2" / "f002.bin")) == errno.ENOENT
    assert (m.mnt / f).read_bytes() == (src / f).read_bytes()


def _cached_then_root_moved_away(src, mount, tmp_path):
    """A mount (``--revalidate 0``) whose every file is read and cached, then its source
    root renamed away: (mount, the tree's bytes, stats once cached, where the root went)."""
    m = mount(src, "--revalidate", "0")
    want = read_tree(src)
    assert read_tree(m.mnt) == want
    st = m.wait_cached(m.stats()["files"])
    away = tmp_path / "src.away"
    src.rename(away)
    return m, want, st, away


def test_a_source_root_moved_away_and_back_is_an_error_meanwhile_and_keeps_the_cache(
        src, mount, tmp_path):
    """The source root renamed away (an automount lapsing, a dataset moved): listing the
    mount is a clean ENOENT, with no ERROR in the daemon's log (the daemon oracle fails the
    test on one); back again, the cached files are served from the cache, not fetched
    again (a failing root is a source error: nothing of the snapshot or cache is dropped)."""
    m, want, st, away = _cached_then_root_moved_away(src, mount, tmp_path)
    try:
        assert _errno_of(lambda: os.listdir(m.mnt / "cls1")) == errno.ENOENT
        assert _errno_of(lambda: (m.mnt / "cls1" / "f001.bin").read_bytes()) == errno.ENOENT
    finally:
        away.rename(src)
    drop_page_cache()
    assert read_tree(m.mnt) == want
    after = m.stats()
    assert after["bytes_from_source"] == st["bytes_from_source"]
    assert after["cached_files"] == st["cached_files"]


@pytest.mark.daemon_log_allows("taken for a fault of the source")
def test_a_source_root_that_lists_empty_for_a_while_loses_nothing(src, mount, tmp_path):
    """What an NFS automount that lapsed looks like: the source root's path is an empty
    directory for a while. Reads fail with EIO meanwhile (not ENOENT: nothing was
    deleted), no entry and no cached file is dropped for it, and once the real tree is back
    every file is served from the cache, with no byte fetched again. Before, the tree and
    its cache were dropped, and every file fetched again afterwards."""
    m, want, st, away = _cached_then_root_moved_away(src, mount, tmp_path)
    src.mkdir()  # the empty mountpoint an unmounted NFS leaves behind
    try:
        assert _errno_of(lambda: os.listdir(m.mnt)) == errno.EIO
        assert _errno_of(lambda: os.listdir(m.mnt / "cls1")) == errno.EIO
        assert _errno_of(lambda: (m.mnt / "cls1" / "f001.bin").read_bytes()) == errno.EIO
        assert m.stats()["files"] == st["files"]
    finally:
        src.rmdir()
        away.rename(src)
    drop_page_cache()
    assert read_tree(m.mnt) == want
    after = m.stats()
    assert after["bytes_from_source"] == st["bytes_from_source"]
    assert (after["files"], after["cached_files"]) == (st["files"], st["cached_files"])
    # a tree really changed is still followed: a class directory removed goes
    shutil.rmtree(src / "cls2")
    assert "cls2" not in os.listdir(m.mnt)


def _errno_of(fn) -> int:
    try:
        fn()
    except OSError as e:
        return e.errno
    return 0


def test_every_modification_is_erofs(src, mount):
    m = mount(src)
    f = m.mnt / "cls0" / "f004.bin"
    d = m.mnt / "cls0"
    checks = {
        "open w": lambda: open(f, "wb"),
        "open r+": lambda: open(f, "r+b"),
        "open a": lambda: open(f, "ab"),
        "create": lambda: open(d / "new", "wb"),
        "mkdir": lambda: os.mkdir(d / "newdir"),
        "unlink": lambda: os.unlink(f),
        "rmdir": lambda: os.rmdir(m.mnt / "empty_dir"),
        "rename": lambda: os.rename(f, d / "renamed"),
        "symlink": lambda: os.symlink("x", d / "ln"),
        "link": lambda: os.link(f, d / "hard"),
        "mknod": lambda: os.mkfifo(d / "fifo"),
        "chmod": lambda: os.chmod(f, 0o777),
        "chown": lambda: os.chown(f, 1, 1),
        "truncate": lambda: os.truncate(f, 0),
        "utime": lambda: os.utime(f, (1, 1)),
        "setxattr": lambda: os.setxattr(f, "user.x", b"1"),
        "removexattr": lambda: os.removexattr(f, "user.x"),
    }
    got = {name: _errno_of(fn) for name, fn in checks.items()}
    assert got == {name: errno.EROFS for name in checks}, got
    assert f.read_bytes() == (src / "cls0" / "f004.bin").read_bytes()


def test_dlcache_is_hidden_but_reachable(src, mount):
    m = mount(src)
    assert ".dlcache" not in os.listdir(m.mnt)
    assert sorted(os.listdir(m.mnt)) == sorted(os.listdir(src))
    assert sorted(os.listdir(m.mnt / ".dlcache")) == ["control", "errors", "stats", "zerocopy"]
    st = json.loads(subprocess.run(["cat", str(m.mnt / ".dlcache" / "stats")],
                                   capture_output=True, check=True).stdout)
    for key in ["files", "bytes_total", "cached_files", "cached_bytes", "hits", "misses",
                "bytes_from_source", "bytes_from_cache", "chunks", "cache_limit_bytes",
                "checksum_failures", "stale_refetches"]:
        assert isinstance(st[key], int), key
    assert st["files"] == sum(1 for _ in read_tree(src))
    assert _errno_of(lambda: open(m.mnt / ".dlcache" / "stats", "wb")) == errno.EROFS


def test_control_lines_refused_with_reason(src, mount):
    m = mount(src)
    ctl = m.mnt / ".dlcache" / "control"

    def write(data: bytes) -> int:
        fd = os.open(ctl, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, data)
        except OSError as e:
            return e.errno
        finally:
            os.close(fd)
        return 0

    assert write(b"job train1\ndataset cls1\n") == 0
    state = json.loads(ctl.read_bytes())
    assert state["jobs"]["train1"]["dataset"] == "cls1"
    bad = [b"frobnicate 3\n", b"job\n", b"job a b\n", b"job bad/name\n", b"dataset ../etc\n",
           b"dataset /abs\n", b"dataset missing_dir\n", b"dataset cls0/f004.bin\n",
           b"job ok\nnonsense\n", b"\xff\xfe\n", b"x" * (1 << 20)]
    for data in bad:
        assert write(data) == errno.EINVAL, data[:40]
    errors = (m.mnt / ".dlcache" / "errors").read_text()
    assert "unknown command 'frobnicate'" in errors
    assert "not UTF-8" in errors
    assert "not a directory" in errors
    # nothing already accepted was lost, and the half-bad write changed nothing
    state2 = json.loads(ctl.read_bytes())
    assert state2["jobs"] == state["jobs"]
    # the shell way works too
    r = subprocess.run(["bash", "-c", f"echo 'dataset cls2' > '{ctl}'"], capture_output=True)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(["bash", "-c", f"echo 'bogus' > '{ctl}'"], capture_output=True, text=True)
    assert r.returncode != 0 and "Invalid argument" in r.stderr


def test_second_daemon_on_the_same_cache_refuses(src, mount, tmp_path):
    mount(src)
    other = tmp_path / "mnt2"
    other.mkdir()
    r = subprocess.run([*DLCACHEFS, "mount", str(src), str(other), "--cache-dir",
                        str(tmp_path / "cache")], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "in use by another dlcachefs daemon" in r.stderr
    assert not is_mounted(other)


def test_a_mount_right_after_fusermount_waits_for_the_stopping_daemon(src, mount, tmp_path):
    """``fusermount3 -u MNT`` and at once ``dlcachefs mount`` again: the old daemon still
    holds the cache while it stops. The new mount waits for it to exit (a few seconds, as
    ``dlcachefs umount`` waits), then mounts; before, it was refused. The old daemon is
    held stopped (SIGSTOP) until the new one says it waits for it, so that it is still
    there whatever the machine's speed."""
    import signal
    import threading

    m = mount(src)
    assert read_tree(m.mnt) == read_tree(src)  # something for it to commit as it stops
    old = m.pid
    assert old is not None
    waiting = f"the cache is held by daemon {old}, which is no longer mounted"
    done = threading.Event()

    def resume_once_waited_for() -> None:
        try:
            wait_until(lambda: done.is_set() or waiting in m.log.read_text(errors="replace"),
                       timeout=120)
        except AssertionError:
            pass  # the mount below fails, and says why
        finally:
            os.kill(old, signal.SIGCONT)

    os.kill(old, signal.SIGSTOP)
    resumer = threading.Thread(target=resume_once_waited_for)
    try:
        subprocess.run(["fusermount3", "-u", str(m.mnt)], check=True, timeout=60)
        assert not is_mounted(m.mnt)
        resumer.start()
        again = mount(src)  # the same mountpoint and cache (and log)
    finally:
        done.set()
        if resumer.ident is not None:
            resumer.join()
        else:
            os.kill(old, signal.SIGCONT)
    assert m.proc is not None and m.proc.wait(timeout=60) == 0
    m.pid = None
    assert again.pid != old and is_mounted(again.mnt)
    assert read_tree(again.mnt) == read_tree(src)
    assert again.stats()["misses"] == 0  # the old daemon's commit is the new one's cache


def test_bad_mount_arguments_fail_clearly(tmp_path):
    r = subprocess.run([*DLCACHEFS, "mount", str(tmp_path / "nope"), str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "source does not exist" in r.stderr
    (tmp_path / "s").mkdir()
    r = subprocess.run([*DLCACHEFS, "mount", str(tmp_path / "s"), str(tmp_path / "missing"),
                        "--cache-dir", str(tmp_path / "c")], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "mountpoint does not exist" in r.stderr
    # the mount over its own source, inside it, or hiding the source or the cache: the
    # daemon would wait on itself; each is refused and nothing is mounted
    (tmp_path / "s" / "sub").mkdir()
    (tmp_path / "m").mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "m" / "link").symlink_to(tmp_path / "out")
    for source, mnt, cache, why in [
            ("s", "s", "c", "is the source"), ("s", "s/sub", "c", "is the source"),
            ("m/..", "./s", "c", "is the source"), ("s/sub", "s", "c", "inside the mountpoint"),
            ("s", "m", "m/cache", "cache directory"),
            ("s", "m", "m/link", "cache directory")]:  # a symlink inside leading out
        r = subprocess.run([*DLCACHEFS, "mount", source, mnt, "--cache-dir", cache],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert r.returncode != 0 and why in r.stderr, (source, mnt, r.stderr)
        assert not is_mounted(tmp_path / mnt)
    # refused before anything was made (not even the log)
    assert not (tmp_path / "m" / "cache").exists() and not list((tmp_path / "out").iterdir())


@pytest.mark.daemon_log_allows("is not empty")
def test_a_mountpoint_with_files_is_mounted_with_a_warning(src, mount, tmp_path):
    """FUSE 3 mounts over a non-empty directory; its files are hidden meanwhile. Allowed
    (as gcsfuse allows it), but said, so that nobody looks for them in vain."""
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine\n")
    log = tmp_path / "full.log"
    m = mount(src, name="full", log=log)
    assert not (m.mnt / "keep.txt").exists()
    assert (m.mnt / "cls1" / "f001.bin").read_bytes() == (src / "cls1" / "f001.bin").read_bytes()
    assert "mountpoint" in log.read_text() and "is not empty" in log.read_text()


@pytest.mark.daemon_log_allows(r"ERROR dlcachefs: mount failed: cache directory \S+ is in "
                               r"use by another dlcachefs daemon \(pid \d+\), not mounted "
                               r"at \S+ now")  # the second mount, refused on purpose
def test_daemonized_mount_and_umount_while_a_file_is_open(src, tmp_path, daemon_oracle):
    mnt = tmp_path / "dmnt"
    mnt.mkdir()
    # a daemonized mount logs to <cache-dir>/dlcachefs.log only
    daemon_oracle.watch(log=tmp_path / "dcache" / "dlcachefs.log", cache=tmp_path / "dcache")
    r = subprocess.run([*DLCACHEFS, "mount", str(src), str(mnt), "--cache-dir",
                        str(tmp_path / "dcache")], capture_output=True, text=True, timeout=120)
    try:
        assert r.returncode == 0, r.stderr
        pid = json.loads((mnt / ".dlcache" / "stats").read_bytes())["pid"]
        f = open(mnt / "cls0" / "f004.bin", "rb")  # noqa: SIM115
        r = subprocess.run([*DLCACHEFS, "umount", str(mnt)], capture_output=True, text=True)
        assert r.returncode == 0 and "lazily" in r.stderr
        # the cache is still the old daemon's: a new mount is refused, and told why
        again = subprocess.run([*DLCACHEFS, "mount", str(src), str(mnt), "--cache-dir",
                                str(tmp_path / "dcache")], capture_output=True, text=True,
                               timeout=120)
        assert again.returncode != 0 and "or unmounted lazily" in again.stderr, again.stderr
        assert f.read() == (src / "cls0" / "f004.bin").read_bytes()
        f.close()
        wait_until(lambda: not os.path.exists(f"/proc/{pid}"),
                   "the daemon did not exit after the last file was closed")
    finally:
        if is_mounted(mnt):
            unmount(mnt, lazy="at_once")


def test_fstab_helper_mounts(src, tmp_path, daemon_oracle):
    mnt = tmp_path / "fmnt"
    mnt.mkdir()
    daemon_oracle.watch(log=tmp_path / "fcache" / "dlcachefs.log", cache=tmp_path / "fcache")
    helper = [sys.executable, "-c", "import sys; from dlcachefs.cli import mount_helper_main as m; sys.exit(m())"]
    r = subprocess.run([*helper, str(src), str(mnt), "-o",
                        f"rw,noauto,cache_dir={tmp_path / 'fcache'},revalidate=0,x-systemd.automount"],
                       capture_output=True, text=True, timeout=120)
    try:
        assert r.returncode == 0, r.stderr
        st = json.loads((mnt / ".dlcache" / "stats").read_bytes())
        assert st["revalidate_s"] == 0 and st["cache_dir"] == str(tmp_path / "fcache")
    finally:
        subprocess.run([*DLCACHEFS, "umount", str(mnt)], capture_output=True)
        if is_mounted(mnt):
            unmount(mnt, lazy="at_once")


def test_config_file_under_the_command_line(src, mount, tmp_path):
    conf = tmp_path / "dlcachefs.toml"
    conf.write_text('cache_size = "3M"\nchunk-size = "128K"\nrevalidate = 5\n'
                    'policy = "lcache"\n')
    m = mount(src, "--config", str(conf), "--revalidate", "0")
    st = m.stats()
    assert st["cache_limit_bytes"] == 3 << 20  # from the file
    assert st["policy"]["name"] == "lcache"
    assert st["revalidate_s"] == 0  # the command line wins over the file
    assert read_tree(m.mnt) == read_tree(src)
    m.umount()


@pytest.fixture
def tiny_disk(tmp_path):
    """A 600 KiB tmpfs. Ask for it before ``mount``: it is then unmounted after the mounts
    on it have stopped and the oracle has checked the cache on it."""
    small = tmp_path / "tiny"
    small.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(small)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield small
    subprocess.run(["umount", "-l", str(small)])


# the disk fills up on purpose: log appends fail (short, or at once with ENOSPC) and the
# writer says so, then serves from the source
@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.cache\.writer: cache write failed \(\[Errno 5\] short write to log ",
    r"WARNING dlcachefs\.cache\.writer: cache write failed \(\[Errno 28\] No space left on device")
def test_full_cache_disk_falls_back_to_the_source(src, tiny_disk, mount, tmp_path):
    # the daemon's output goes to the roomy disk: only the cache is on the full one
    m = mount(src, "--min-free", "0", "--chunk-size", "256K", cache=tiny_disk / "cache",
              log=tmp_path / "mnt.daemon.log")
    expected = read_tree(src)
    assert read_tree(m.mnt) == expected
    # the writer tries (and fails) to seal what did not fit
    m.wait_stats(lambda st: st["write_errors"] + st["cache_skipped"] > 0,
                 "nothing was refused by the full disk")
    drop_page_cache()
    assert read_tree(m.mnt) == expected


def test_a_cache_disk_under_min_free_is_said_at_mount_and_in_stats(src, tiny_disk, tmp_path):
    """--min-free larger than the cache disk's free space: the mount works (every byte
    right) and keeps nothing new; it says so at mount, and ``stats`` shows why."""
    mnt = tmp_path / "mf"
    mnt.mkdir()
    r = subprocess.run([*DLCACHEFS, "mount", str(src), str(mnt), "--cache-dir",
                        str(tiny_disk / "c"), "--min-free", "1G"],
                       capture_output=True, text=True, timeout=120)
    try:
        assert r.returncode == 0, r.stderr
        assert "under --min-free 1.0G" in r.stderr, r.stderr
        assert read_tree(mnt) == read_tree(src)
        st = json.loads((mnt / ".dlcache" / "stats").read_bytes())
        assert st["cache_disk"]["below_min_free"] is True
        assert st["cache_disk"]["min_free_bytes"] == 1 << 30
    finally:
        subprocess.run([*DLCACHEFS, "umount", str(mnt)], capture_output=True, timeout=120)


def test_cache_size_limit_evicts_whole_chunks(src, mount):
    m = mount(src, "--cache-size", "600K", "--chunk-size", "128K")
    expected = read_tree(src)
    for _ in range(2):
        assert read_tree(m.mnt) == expected
        # the writer sealed what the pass read (a partly filled chunk after flush_interval)
        m.wait_stats(lambda st: st["pending_bytes"] == 0, "the writer did not seal the pass")
        drop_page_cache()
    st = m.stats()
    assert st["chunk_bytes"] <= 600 * 1024
    assert st["chunks_evicted"] > 0


def test_symlink_swapped_in_after_the_scan_is_not_followed(tmp_path, mount):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f").write_bytes(b"inside")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "f").write_bytes(b"SECRET")
    m = mount(src)
    assert os.listdir(m.mnt / "d") == ["f"]
    (src / "d" / "f").unlink()
    (src / "d").rmdir()
    os.symlink(outside, src / "d")
    assert _errno_of(lambda: (m.mnt / "d" / "f").read_bytes()) in (errno.EACCES, errno.ESTALE,
                                                                   errno.ENOENT)


def _as_nobody(fn) -> int:
    """Run fn() in a child process as uid/gid 65534; return its errno (0 on success)."""
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            fn()
        except OSError as e:
            code = e.errno or 1
        except BaseException:
            code = 255
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to switch users")
@pytest.mark.parametrize("allow_other", [False, True])
def test_other_users_only_with_allow_other(src, tmp_path, mount, allow_other):
    # another user must be able to reach the mountpoint: pytest's tmp dirs are 0700
    base = Path(tempfile.mkdtemp(prefix="dlc-perm-"))
    base.chmod(0o755)
    os.chmod(src, 0o755)
    m = None
    try:
        m = mount(src, *(["--allow-other"] if allow_other else []), mnt=base / "mnt")
        ls = _as_nobody(lambda: os.listdir(m.mnt))
        if not allow_other:
            assert ls == errno.EACCES
            return
        assert ls == 0
        ctl = _as_nobody(lambda: open(m.mnt / ".dlcache" / "control", "w").write("job x\n"))
        assert ctl == errno.EACCES  # the control file is the owner's
        private = _as_nobody(lambda: (m.mnt / "cls1" / "f001.bin").read_bytes())
        assert private == errno.EACCES  # mode 0600 on the source, mirrored and enforced
        assert _as_nobody(lambda: (m.mnt / "cls2" / "f002.bin").read_bytes()) == 0
    finally:
        if m is not None:
            m.cleanup()  # before its mountpoint goes
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to switch users")
@pytest.mark.parametrize("revalidate", ["0", "1"])
def test_a_directory_closed_on_the_source_is_closed_here(src, tmp_path, mount, revalidate):
    """A directory's (and the root's) own mode follows the source by the rule files follow
    (``--revalidate``), and the kernel enforces it (``default_permissions``). Before, a
    directory's attributes changed only when its parent was listed again, and the root's
    never without ``--rescan``: a directory chmod 700 on the source stayed readable here
    by every user."""
    base = Path(tempfile.mkdtemp(prefix="dlc-perm-"))
    base.chmod(0o755)
    os.chmod(src, 0o755)
    for d in ("cls1", "cls2"):
        os.chmod(src / d, 0o755)
    os.chmod(src / "cls2" / "f002.bin", 0o644)
    m = None
    try:
        m = mount(src, "--allow-other", "--revalidate", revalidate, mnt=base / "mnt")
        inner = m.mnt / "cls2" / "f002.bin"
        assert _as_nobody(inner.read_bytes) == 0
        assert _as_nobody(lambda: os.listdir(m.mnt)) == 0
        os.chmod(src / "cls2", 0o700)
        os.chmod(src, 0o711)
        # past the window (with 0: a directory's own lstat at most once a second): not a
        # timing assertion, the rule's input
        time.sleep(1.2)
        assert stat.S_IMODE(os.stat(m.mnt / "cls2").st_mode) == 0o700
        assert stat.S_IMODE(os.stat(m.mnt).st_mode) == 0o711
        assert _as_nobody(inner.read_bytes) == errno.EACCES
        assert _as_nobody(lambda: os.listdir(m.mnt)) == errno.EACCES
        os.chmod(src / "cls2", 0o755)  # and open again
        os.chmod(src, 0o755)
        time.sleep(1.2)
        assert _as_nobody(inner.read_bytes) == 0
        assert _as_nobody(lambda: os.listdir(m.mnt)) == 0
        assert m.stats()["files"] > 0
    finally:
        if m is not None:
            m.cleanup()
        shutil.rmtree(base, ignore_errors=True)


def test_stats_of_a_killed_daemons_mount_says_the_daemon_is_gone(src, mount):
    """A daemon killed with SIGKILL leaves its mount behind (ENOTCONN): ``stats`` says the
    daemon is gone and how to clear it (exit 2), not that it is no dlcachefs mount; then
    ``umount`` clears it."""
    m = mount(src)
    m.kill9()
    r = subprocess.run([*DLCACHEFS, "stats", str(m.mnt)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "daemon of this mount is gone" in r.stderr, r.stderr
    assert "dlcachefs umount" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([*DLCACHEFS, "umount", str(m.mnt)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert not is_mounted(str(m.mnt))


def test_a_name_whose_type_changed_is_found_at_the_first_stat(src, mount):
    """``--revalidate 0``: a directory replaced by a file on the source (and a file by a
    directory) is found by the first ``stat`` of its path, in its new type, not after one
    spurious ENOENT (the check re-lists its directory, where the name has a new inode)."""
    m = mount(src, "--revalidate", "0")
    (src / "d").mkdir()
    (src / "d" / "inner").write_bytes(b"in")
    assert stat.S_ISDIR(os.stat(m.mnt / "d").st_mode)
    (src / "d" / "inner").unlink()
    (src / "d").rmdir()
    (src / "d").write_bytes(b"now a file")
    time.sleep(1.2)  # past the once-a-second bound of a directory's own lstat (the rule)
    st = os.stat(m.mnt / "d")
    assert stat.S_ISREG(st.st_mode) and st.st_size == len(b"now a file")
    assert (m.mnt / "d").read_bytes() == b"now a file"
    f = "cls1/f001.bin"
    assert stat.S_ISREG(os.stat(m.mnt / f).st_mode)
    os.unlink(src / f)
    os.mkdir(src / f)
    assert stat.S_ISDIR(os.stat(m.mnt / f).st_mode)
