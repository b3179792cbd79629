"""Tier 3: the zero-copy reader (dlcachefs.data) over caches made by the core, no FUSE.

The "mount" here is the source directory itself: a fallback is an ``open`` + ``read`` of
the path, which then reads the source, so every byte a reader returns can be compared
with the source's. The cache is made by the engine (as a mount makes it), closed, and
read by :class:`CacheReader` with the protocol of :mod:`dlcachefs.data.reader`: what it
returns equals the source or it falls back, whatever happens to the cache between its
lookup and its read."""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dlcachefs.data import reader as R
from dlcachefs.data.reader import CacheInfo, CacheReader
from dlcachefs.store import readonly
from dlcachefs.store import tally as T
from dlcachefs.store.index import Index
from dlcachefs.testing.fakes import make_config, read_all, run_engine, write_tree


def regular_files(src: Path) -> list[bytes]:
    """Relative paths of the regular files under ``src`` (symlinks not followed)."""
    out = []
    for dp, _dirs, names in os.walk(os.fsencode(src)):
        for n in names:
            p = os.path.join(dp, n)
            if stat.S_ISREG(os.lstat(p).st_mode):
                out.append(os.path.relpath(p, os.fsencode(src)))
    return sorted(out)


def fill_cache(src: Path, cache: Path, only: list[bytes] | None = None,
               flush_each: bool = False, **kw) -> None:
    """Make a cache of ``src`` with the engine: every regular file (or ``only`` those)
    read once, sealed (each in a chunk of its own with ``flush_each``), the engine
    closed (as after an unmount)."""
    rels = regular_files(src) if only is None else only

    async def body(eng):
        for rel in rels:
            assert await read_all(eng, rel) == (src / os.fsdecode(rel)).read_bytes()
            if flush_each:
                await eng.flush()
        await eng.flush()

    run_engine(make_config(src, cache, **kw), body)


def reader_of(src: Path, cache: Path, revalidate: float = 3600.0) -> CacheReader:
    return CacheReader(src, CacheInfo(str(cache / "meta.lmdb"), str(cache / "logs"),
                                      str(cache / T.TALLY_DIR), revalidate))


@contextlib.contextmanager
def reading(src: Path, cache: Path, revalidate: float = 3600.0):
    r = reader_of(src, cache, revalidate)
    try:
        yield r
    finally:
        r.close()  # this process's environment on that cache: tests make many caches


def fallbacks(counts: dict) -> int:
    return sum(counts[k] for k in T.FALLBACKS)


FILES = {b"train/a/1.jpg": os.urandom(3000), b"train/a/2.jpg": os.urandom(5000),
         b"train/b/3.png": os.urandom(7000), b"train/b/deep/4.jpg": b"",
         b"train/c/5.jpg": bytes(4096), b"top.txt": b"hello"}


@pytest.fixture
def src(tmp_path: Path) -> Path:
    write_tree(tmp_path / "src", FILES)
    return tmp_path / "src"


# ----- reads ---------------------------------------------------------------------------------


def test_cached_files_are_read_from_the_cache(src, tmp_path):
    fill_cache(src, tmp_path / "cache")
    with reading(src, tmp_path / "cache") as r:
        for rel, data in FILES.items():
            got = r.read(src / os.fsdecode(rel))
            assert got == data and type(got) is bytes
        c = r.counts()
        assert c["hits"] == len(FILES) and fallbacks(c) == 0
        assert c["hit_bytes"] == sum(len(d) for d in FILES.values())
        # a relative path is taken from the working directory, as open() takes it
        with contextlib.chdir(src / "train"):
            assert r.read("a/1.jpg") == FILES[b"train/a/1.jpg"]
        assert r.counts()["hits"] == len(FILES) + 1


def test_what_is_not_cached_or_not_current_goes_through_the_path(src, tmp_path):
    cache = tmp_path / "cache"
    fill_cache(src, cache, only=[b"train/a/1.jpg", b"train/a/2.jpg", b"train/b/3.png"])
    # the source changed and the mount noticed (the entry has the new identity): stale
    new = os.urandom(3001)
    (src / "train/a/2.jpg").write_bytes(new)
    ix = Index(str(cache / "meta.lmdb"))
    try:
        st = os.stat(src / "train/a/2.jpg")
        with ix.write() as w:
            e = entry_at(ix, b"train/a/2.jpg")
            e.size, e.mtime_ns = st.st_size, st.st_mtime_ns
            w.put_entry(e)
    finally:
        ix.close()
    with reading(src, cache) as r:
        assert r.read(src / "train/a/1.jpg") == FILES[b"train/a/1.jpg"]
        assert r.read(src / "train/a/2.jpg") == new
        assert r.read(src / "train/c/5.jpg") == FILES[b"train/c/5.jpg"]
        with pytest.raises(IsADirectoryError):
            r.read(src / "train")
        with pytest.raises(FileNotFoundError):
            r.read(src / "train/nope.jpg")
        assert r.read_cached(tmp_path / "elsewhere.jpg") is None  # not inside the mount
        c = r.counts()
    assert (c["hits"], c["stale"], c["not_cached"]) == (1, 1, 1)
    assert c["unresolved"] == 3  # the directory, the missing name, the outside path


def test_revalidation_window_is_the_mounts(src, tmp_path):
    """Past ``--revalidate`` seconds after its directory was listed, a file is read
    through the mount (whose open re-lists it); ``--revalidate 0``: always."""
    cache = tmp_path / "cache"
    fill_cache(src, cache)
    p = src / "train/a/1.jpg"
    with reading(src, cache, revalidate=0) as r:
        assert r.read(p) == FILES[b"train/a/1.jpg"]
        assert r.counts()["stale"] == 1 and r.counts()["hits"] == 0
    time.sleep(0.3)  # the listing is now older than 0.2 s (a clock, not a timing check)
    with reading(src, cache, revalidate=0.2) as r:
        assert r.read(p) == FILES[b"train/a/1.jpg"]
        assert r.counts()["stale"] == 1
    with reading(src, cache, revalidate=3600) as r:
        assert r.read(p) == FILES[b"train/a/1.jpg"]
        assert r.counts()["hits"] == 1


def _swap_dirs(index_dir: str, parent: bytes, a: bytes, b: bytes) -> None:
    """In another process (py-lmdb allows one environment per files and process), as a
    daemon re-listing ``parent`` would: directories ``a`` and ``b`` swap names."""
    code = f"""
from dlcachefs.store.index import Index
ix = Index({index_dir!r})
p = 1
for part in {parent!r}.split(b"/"):
    p = ix.lookup(p, part)
ea, eb = ix.get_entry(ix.lookup(p, {a!r})), ix.get_entry(ix.lookup(p, {b!r}))
ea.name, eb.name = eb.name, ea.name
with ix.write() as w:
    w.put_entry(ea)
    w.put_entry(eb)
ix.close()
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_remembered_directory_walk_is_never_used_after_a_commit(src, tmp_path):
    """The walk to a file's directory is remembered per snapshot: once the daemon commits
    a rename, paths resolve by the new names (a walk remembered from before would serve
    ``a``'s files under ``a`` still)."""
    cache = tmp_path / "cache"
    fill_cache(src, cache)
    with reading(src, cache) as r:
        assert r.read_cached(src / "train/a/1.jpg") == FILES[b"train/a/1.jpg"]
        assert r.read_cached(src / "train/b/3.png") == FILES[b"train/b/3.png"]
        _swap_dirs(str(cache / "meta.lmdb"), b"train", b"a", b"b")
        assert r.read_cached(src / "train/a/1.jpg") is None  # "a" is b's directory now
        assert r.read_cached(src / "train/a/3.png") == FILES[b"train/b/3.png"]
        assert r.read_cached(src / "train/b/2.jpg") == FILES[b"train/a/2.jpg"]
        assert r.read_cached(src / "train/b/3.png") is None
        c = r.counts()
    assert (c["hits"], c["unresolved"]) == (4, 2)


def test_a_located_file_is_remembered_per_snapshot_user_and_freshness(src, tmp_path,
                                                                      monkeypatch):
    """A file read again in the same snapshot is served without walking the index again,
    but never for another uid, nor once its directory's listing is older than
    --revalidate; the bound on what is remembered holds."""
    from dlcachefs.store import readonly

    cache = tmp_path / "cache"
    os.chmod(src / "train/a/1.jpg", 0o600)  # root's: others may not read it
    fill_cache(src, cache)
    walks = []
    real = readonly.IndexReader._locate
    monkeypatch.setattr(readonly.IndexReader, "_locate",
                        lambda self, *a: walks.append(a[1]) or real(self, *a))
    p = src / "train/a/1.jpg"
    with reading(src, cache, revalidate=0.5) as r:
        assert r.read_cached(p) == FILES[b"train/a/1.jpg"]
        assert r.read_cached(p) == FILES[b"train/a/1.jpg"]
        assert len(walks) == 1  # the second read: remembered
        with monkeypatch.context() as m:  # another user, same process, same snapshot
            m.setattr(readonly.os, "geteuid", lambda: 4242)
            m.setattr(readonly.os, "getegid", lambda: 4242)
            m.setattr(readonly.os, "getgroups", lambda: [])
            assert r.read_cached(p) is None
        assert r.counts()["denied"] == 1 and len(walks) == 2
        assert r.read_cached(p) == FILES[b"train/a/1.jpg"] and len(walks) == 2
        time.sleep(0.6)  # the listing is now older than 0.5 s (a clock, not a timing check)
        assert r.read_cached(p) is None
        assert r.counts()["stale"] == 1 and len(walks) == 3
    monkeypatch.setattr(readonly, "MAX_FILES", 2)
    with reading(src, cache) as r:
        for _ in range(3):
            for rel, data in FILES.items():
                assert r.read_cached(src / os.fsdecode(rel)) == data
        assert len(R._process(r.info).index()._files) <= 2
        assert r.counts()["hits"] == 3 * len(FILES)


def entry_at(ix: Index, rel: bytes):
    """The entry of a path, through a writable Index (the test edits what a daemon would)."""
    ino = 1
    for part in rel.split(b"/"):
        ino = ix.lookup(ino, part)
    return ix.get_entry(ino)


# ----- the protocol: damage between the lookup and the read ---------------------------------

DAMAGE = ("punch", "truncate", "garbage", "flip_byte", "unlink_before_open",
          "unlink_after_open")


def _damage(kind: str, log: str, offset: int, size: int) -> None:
    """What the daemon (or a disk) may do to a record's range of ``log``."""
    from dlcachefs.store.logs import punch_hole

    if kind == "punch":  # an eviction: the index commit, then the hole
        with open(log, "r+b") as f:
            punch_hole(f.fileno(), offset, max(size, 1))
    elif kind == "truncate":  # a new daemon's recovery cut the log short
        os.truncate(log, offset + size // 2)
    elif kind == "garbage":
        with open(log, "r+b") as f:
            f.seek(offset)
            f.write(os.urandom(max(size, 1)))
    elif kind == "flip_byte" and size:
        with open(log, "r+b") as f:
            f.seek(offset + size // 2)
            b = f.read(1)
            f.seek(offset + size // 2)
            f.write(bytes([b[0] ^ 0x40]))
    elif kind == "unlink_after_open":
        os.unlink(log)  # the whole log deleted: its last chunk was evicted


@pytest.fixture(scope="module")
def damage_cache(tmp_path_factory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("damage")
    write_tree(base / "src", FILES)
    fill_cache(base / "src", base / "cache")
    return base / "src", base / "cache"


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(DAMAGE), rel=st.sampled_from(sorted(FILES)))
def test_damage_between_lookup_and_read_never_returns_wrong_bytes(
        damage_cache, tmp_path, monkeypatch, kind, rel):
    """The record is looked up, then the daemon (or the disk) changes its range, then
    the reader reads it: the bytes returned are the file's, always; whether they came
    from the cache is what the damage allows."""
    src0, cache0 = damage_cache
    cache = tmp_path / f"cache{len(list(tmp_path.iterdir()))}"
    shutil.copytree(cache0, cache)
    if kind == "unlink_before_open":
        for f in (cache / "logs").iterdir():
            f.unlink()

    def damaging_pread(fd: int, size: int, offset: int) -> bytes:
        _damage(kind, os.readlink(f"/proc/self/fd/{fd}"), offset, size)
        return os.pread(fd, size, offset)

    monkeypatch.setattr(readonly, "_pread", damaging_pread)
    with reading(src0, cache) as r:
        assert r.read(src0 / os.fsdecode(rel)) == FILES[rel]
        c = r.counts()
    if kind == "unlink_before_open":
        assert c["missing_log"] == 1 and c["hits"] == 0
    elif kind == "unlink_after_open":
        # the open descriptor still reads the deleted file: the bytes of the version
        # looked up, whole (the checksum says so)
        assert c["hits"] == 1
    elif not FILES[rel] or (not any(FILES[rel]) and kind == "punch"):
        assert c["hits"] == 1  # an empty file; zeros punched into zeros: the same bytes
    else:
        assert c["mismatch"] == 1 and c["hits"] == 0


def test_truncated_log_under_a_reader_is_a_fallback_not_a_crash(src, tmp_path):
    """What would kill a process that mapped the log (SIGBUS) is a short read here."""
    cache = tmp_path / "cache"
    fill_cache(src, cache)
    with reading(src, cache) as r:
        assert r.read(src / "train/b/3.png") == FILES[b"train/b/3.png"]  # log open now
        for log in (cache / "logs").glob("*.log"):
            os.truncate(log, 100)
        for rel, data in FILES.items():
            assert r.read(src / os.fsdecode(rel)) == data
        c = r.counts()
    assert c["hits"] == 1 + sum(1 for d in FILES.values() if not d)  # an empty file is whole
    assert c["mismatch"] == len(FILES) - sum(1 for d in FILES.values() if not d)


def test_descriptors_of_deleted_logs_are_closed(src, tmp_path, monkeypatch):
    """A deleted log keeps its disk space while a descriptor is open: the reader closes
    descriptors whose file is gone, at its periodic sweep."""
    cache = tmp_path / "cache"
    fill_cache(src, cache, flush_each=True, log_size=4096)  # several logs
    monkeypatch.setattr(R, "SWEEP_EVERY", 8)
    with reading(src, cache) as r:
        for rel in FILES:
            r.read(src / os.fsdecode(rel))
        proc = R._process(r.info)
        opened = proc.logs.open_count()
        assert opened >= 2
        victim = sorted((cache / "logs").glob("*.log"))[0]
        victim.unlink()
        for _ in range(16):
            r.read(src / "top.txt")
        assert proc.logs.open_count() == opened - 1
        fds = {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}")}
        assert not any(str(victim) in f for f in fds)


def test_a_cache_made_anew_is_reopened(src, tmp_path, monkeypatch):
    """A cache directory removed and made again is reopened at the next check (every
    SWEEP_EVERY reads and CHECK_EVERY_S seconds); before it, a read may still be served
    from what the removed cache held (its descriptors keep its logs), never after."""
    cache = tmp_path / "cache"
    fill_cache(src, cache)
    monkeypatch.setattr(R, "SWEEP_EVERY", 4)
    monkeypatch.setattr(R, "CHECK_EVERY_S", 3600.0)  # the count of reads decides
    with reading(src, cache) as r:
        assert r.read(src / "top.txt") == b"hello"  # read 1: checked, opened
        shutil.rmtree(cache)
        (src / "top.txt").write_bytes(b"changed")
        fill_cache(src, cache, only=[b"top.txt"])  # (its own process state is closed)
        got = [r.read(src / "top.txt") for _ in range(8)]  # reads 2-9: checked at 4 and 8
        assert got == [b"hello"] * 2 + [b"changed"] * 6
        assert r.counts()["hits"] == 1 + 2 + 6
    monkeypatch.setattr(R, "CHECK_EVERY_S", 0.0)  # every read checks
    shutil.rmtree(cache)
    fill_cache(src, cache, only=[b"top.txt"])
    with reading(src, cache) as r:
        assert r.read(src / "top.txt") == b"changed"
        shutil.rmtree(cache)
        (src / "top.txt").write_bytes(b"again")
        fill_cache(src, cache, only=[b"top.txt"])
        assert r.read(src / "top.txt") == b"again"
        assert r.counts()["hits"] == 2


def test_a_removed_cache_is_let_go_and_read_through_the_path(src, tmp_path, monkeypatch):
    """A cache directory removed for good: the reader closes the removed index (its
    deleted files keep their disk space while they are open), warns once, reads through
    the path, and tries to open it again only every RETRY_EVERY reads."""
    cache = tmp_path / "cache"
    fill_cache(src, cache)
    monkeypatch.setattr(R, "SWEEP_EVERY", 4)
    monkeypatch.setattr(R, "CHECK_EVERY_S", 3600.0)
    with reading(src, cache) as r:
        assert r.read(src / "top.txt") == b"hello"
        proc = R._process(r.info)
        old = proc._index
        shutil.rmtree(cache)
        with pytest.warns(RuntimeWarning, match="cannot open the cache index") as w:
            got = [r.read(src / "top.txt") for _ in range(12)]
        assert got == [b"hello"] * 12  # the source's bytes through the path
        assert len(w) == 1
        assert proc._index is None and proc._failed_at == 4
        assert proc.logs.open_count() == 0
        with pytest.raises(Exception):  # noqa: B017 - closed, not left mapped
            old.env.info()


# ----- processes -----------------------------------------------------------------------------


def test_forked_child_opens_its_own_and_counts_apart(src, tmp_path):
    cache = tmp_path / "cache"
    fill_cache(src, cache)
    tallies = T.TallyReader(str(cache / T.TALLY_DIR))  # as a daemon starting now
    with reading(src, cache) as r:
        assert r.read(src / "train/a/1.jpg") == FILES[b"train/a/1.jpg"]  # parent env open
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: read everything, report, exit without cleanup
            ok = 0
            try:
                ok = all(r.read(src / os.fsdecode(k)) == v for k, v in FILES.items())
                ok = ok and r.counts()["hits"] == len(FILES)  # its own counts, from 0
            finally:
                os.write(wfd, b"1" if ok else b"0")
                os._exit(0)
        os.close(wfd)
        assert os.read(rfd, 1) == b"1"
        os.close(rfd)
        os.waitpid(pid, 0)
        # the parent's environment and descriptors still work after the child is gone
        for k, v in FILES.items():
            assert r.read(src / os.fsdecode(k)) == v
        assert r.counts()["hits"] == 1 + len(FILES)
        total = tallies.collect()
        assert total["hits"] == 1 + 2 * len(FILES) and total["readers"] == 1
    # spawned workers get the reader pickled: paths only
    r2 = pickle.loads(pickle.dumps(r))
    assert r2.mount_root == r.mount_root and r2.info == r.info


# ----- the daemon's side of counting ----------------------------------------------------------


def test_tally_counts_since_start_and_folds_ended_readers(tmp_path):
    d = tmp_path / "zc"

    def child(hits: int, stay: bool) -> tuple[int, int]:
        """A process that counts ``hits`` and stays alive (until we close its pipe) or ends."""
        rfd, wfd = os.pipe()
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(wfd)
            t = T.TallyWriter(str(d))
            t.add(0, hits)
            t.add(1, hits * 10)
            os.write(ready_w, b"1")
            if stay:
                os.read(rfd, 1)  # until the parent closes its end
            os._exit(0)
        os.close(rfd)
        os.read(ready_r, 1)
        os.close(ready_r)
        os.close(ready_w)
        if not stay:
            os.waitpid(pid, 0)
        return pid, wfd

    early_dead, _ = child(5, stay=False)
    early_live, early_pipe = child(7, stay=True)
    reader = T.TallyReader(str(d))  # the daemon starts: neither counts
    assert len(list(d.glob("*.tally"))) == 1  # the ended one's file is gone
    assert reader.collect()["hits"] == 0 and reader.collect()["readers"] == 1
    late, late_pipe = child(3, stay=True)
    got = reader.collect()
    assert (got["hits"], got["hit_bytes"], got["readers"]) == (3, 30, 2)
    os.close(late_pipe)
    os.waitpid(late, 0)
    for _ in range(2):  # folded once, then kept
        got = reader.collect()
        assert (got["hits"], got["readers"]) == (3, 1)
    assert len(list(d.glob("*.tally"))) == 1
    os.close(early_pipe)
    os.waitpid(early_live, 0)
    assert reader.collect()["hits"] == 3  # it counted nothing after the start
    assert list(d.glob("*.tally")) == []


def test_threads_read_while_the_process_forks(src, tmp_path):
    """Threads look records up while the main thread forks children that read too: the
    fork waits for lookups in flight and the child inherits no LMDB environment (py-lmdb
    would refuse it its own); nothing deadlocks, every byte is right on both sides."""
    import threading

    cache = tmp_path / "cache"
    fill_cache(src, cache)
    with reading(src, cache) as r:
        stop = threading.Event()
        wrong: list[bytes] = []

        def spin() -> None:
            while not stop.is_set():
                for k, v in FILES.items():
                    if r.read(src / os.fsdecode(k)) != v:
                        wrong.append(k)

        threads = [threading.Thread(target=spin) for _ in range(3)]
        for t in threads:
            t.start()
        try:
            for _ in range(10):
                pid = os.fork()
                if pid == 0:
                    ok = all(r.read(src / os.fsdecode(k)) == v for k, v in FILES.items())
                    os._exit(0 if ok and r.counts()["hits"] == len(FILES) else 1)
                _, status = os.waitpid(pid, 0)
                assert os.waitstatus_to_exitcode(status) == 0
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert wrong == []
        c = r.counts()
        assert c["hits"] > 0 and c["errors"] == 0


# ----- resolution: the path walked as the kernel walks it -------------------------------------

samplelist = pytest.importorskip("test_t2_samplelist")


def kernel_walk(src: Path, rel: str) -> str | None:
    """The real path (relative to ``src``) of the regular file the kernel opens for
    ``rel``, when it gets there without leaving ``src`` or following an absolute link;
    None otherwise. Walks the real tree (os.lstat/readlink), not the snapshot."""
    todo, cur, links = list(reversed(rel.split("/"))), [], 0
    while todo:
        name = todo.pop()
        if name in ("", "."):
            continue
        if name == "..":
            if not cur:
                return None
            cur.pop()
            continue
        p = os.path.join(src, *cur, name)
        try:
            st_ = os.lstat(p)
        except OSError:
            return None
        if stat.S_ISLNK(st_.st_mode):
            links += 1
            target = os.readlink(p)
            if links > 40 or not target or target.startswith("/"):
                return None
            todo.extend(reversed(target.split("/")))
            continue
        if todo and not stat.S_ISDIR(st_.st_mode):
            return None
        cur.append(name)
    if not cur or not stat.S_ISREG(os.lstat(os.path.join(src, *cur)).st_mode):
        return None
    return "/".join(cur)


@settings(deadline=None, max_examples=40,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(classes=st.lists(samplelist.CLASS, min_size=1, max_size=3), data=st.data())
def test_paths_resolve_as_the_kernel_resolves_them(tmp_path, classes, data):
    """Random trees with links (relative to classes and files, absolute, through "..",
    dangling, loops): every path ImageFolder would open reads the kernel's bytes, and
    is served from the cache exactly when the kernel's walk stays in the snapshot."""
    base = tmp_path / f"ex{len(list(tmp_path.iterdir()))}"
    src = base / "src"
    src.mkdir(parents=True)
    samplelist.build(src, classes, [], [])
    files = sorted(os.path.relpath(os.path.join(d, f), src)
                   for d, _, fs in os.walk(src) for f in fs)
    for f in files:  # every file its own bytes: a wrong resolution shows
        (src / f).write_bytes(f.encode() + os.urandom(8))
    names = sorted({c for c, _ in classes})
    targets = [*files, *names, "missing.jpg"]
    links = []
    for _ in range(data.draw(st.integers(0, 6), label="links")):
        where = data.draw(st.sampled_from([*names, ""]), label="in")
        lname = data.draw(samplelist.NAME, label="name") + data.draw(samplelist.EXT, label="ext")
        t = data.draw(st.sampled_from(targets), label="target")
        up = "../" if where else ""
        kind = data.draw(st.sampled_from(["rel", "abs", "up", "self", "dotdot"]), label="kind")
        target = {"rel": up + t, "abs": str(src / t), "up": up + "../" + t,
                  "self": lname, "dotdot": up + f"{where or '.'}/../{t}"}[kind]
        links.append((f"{where}/{lname}" if where else lname, target))
    samplelist.build(src, [], [], links)
    fill_cache(src, base / "cache")
    paths = {a for a, _ in links}
    for d, dirs, fs in os.walk(src, followlinks=True):
        if len(Path(d).relative_to(src).parts) >= 4:
            dirs[:] = []  # a link to a directory above it is a loop: bounded, not endless
        paths.update(os.path.relpath(os.path.join(d, f), src) for f in fs)
    expect_hits = 0
    with reading(src, base / "cache") as r:
        # twice: the second pass finds what the first located remembered
        for rel in [*sorted(paths), *sorted(paths)]:
            try:
                want: bytes | type = (src / rel).read_bytes()
            except OSError as e:
                want = type(e)
            try:
                got: bytes | type = r.read(str(src / rel))
            except OSError as e:
                got = type(e)
            assert got == want, rel
            expect_hits += kernel_walk(src, rel) is not None
        c = r.counts()
    assert c["hits"] == expect_hits
    assert c["errors"] == c["mismatch"] == c["missing_log"] == 0
    event(f"some paths resolved through links: {any(kernel_walk(src, a) for a, _ in links)}")
    event(f"some paths left for the kernel: {c['unresolved'] > 0}")


def test_an_index_error_reopens_the_index(src, tmp_path, monkeypatch):
    """A lookup that raises (an LMDB error: a full reader table, a map resized) is read
    through the mount, and the next reads use a fresh environment (the failed one is
    closed once no lookup runs: py-lmdb would refuse the same files twice)."""
    from dlcachefs.store import readonly

    cache = tmp_path / "cache"
    fill_cache(src, cache)
    real = readonly.IndexReader.locate_path
    calls = []

    def flaky(self, *a):
        calls.append(self)
        if len(calls) == 2:
            import lmdb

            raise lmdb.MapResizedError("mdb_txn_begin: MDB_MAP_RESIZED")
        return real(self, *a)

    monkeypatch.setattr(readonly.IndexReader, "locate_path", flaky)
    with reading(src, cache) as r:
        for k, v in FILES.items():
            assert r.read(src / os.fsdecode(k)) == v
        c = r.counts()
        assert c["errors"] == 1 and c["hits"] == len(FILES) - 1
        assert calls[0] is not calls[-1]  # another environment after the error
        with pytest.raises(Exception):  # noqa: B017 - the failed one is closed
            calls[0].env.info()


def test_links_loops_and_dotdot(tmp_path):
    """Fixed shapes: a directory link looping to its parent, ``..`` through a linked
    directory (the kernel's ``..`` is the physical parent), an absolute link (left to
    the kernel), a link chain, a dangling link, a link loop, ``..`` above the root."""
    src = tmp_path / "src"
    write_tree(src, {b"c/a.jpg": b"A" * 100, b"d/sub/b.jpg": b"B" * 50, b"d/e.jpg": b"E"})
    for name, target in (("c/loop", "../c"), ("c/up", ".."), ("c/abs.jpg", str(src / "c/a.jpg")),
                         ("c/chain.jpg", "chain2.jpg"), ("c/chain2.jpg", "../d/e.jpg"),
                         ("c/dangling.jpg", "nope.jpg"), ("c/self.jpg", "self.jpg"),
                         ("c/sublink", "../d/sub")):
        os.symlink(target, src / name)
    fill_cache(src, tmp_path / "cache")
    cases = {  # path -> served from the cache?
        "c/loop/loop/loop/a.jpg": True, "c/up/d/e.jpg": True, "c/chain.jpg": True,
        "c/sublink/../e.jpg": True,  # .. of d/sub (physical), not of c
        "c/sublink/b.jpg": True, "c/abs.jpg": False, "c/dangling.jpg": False,
        "c/self.jpg": False, "../src/c/a.jpg": False, "c/a.jpg/x": False}
    with reading(src, tmp_path / "cache") as r:
        for rel, cached in cases.items():
            p = os.path.join(src, rel)
            try:
                want: bytes | type = Path(p).read_bytes()
            except OSError as e:
                want = type(e)
            assert (r.read_cached(p) is not None) == cached, rel
            try:
                got: bytes | type = r.read(p)
            except OSError as e:
                got = type(e)
            assert got == want, rel
        assert r.counts()["hits"] == 2 * sum(cases.values())


# ----- permissions, the reader table, the mount's root ----------------------------------------


@pytest.fixture
def as_user(monkeypatch):
    """The reader's lookups run as uid/gid 4242 with supplementary group 777 (the test
    itself stays root, so its fallback ``open`` of the source still succeeds: only the
    counts tell a hit from a denial)."""
    from dlcachefs.store import readonly

    monkeypatch.setattr(readonly.os, "geteuid", lambda: 4242)
    monkeypatch.setattr(readonly.os, "getegid", lambda: 4242)
    monkeypatch.setattr(readonly.os, "getgroups", lambda: [777])


def test_permissions_are_checked_as_the_kernel_checks_them(src, tmp_path, as_user):
    """A file the mount would refuse (default_permissions over the mirrored modes) is never
    read from the cache: r on the file by owner, then group, then others' bits; x on every
    directory looked up in."""
    os.chmod(src / "train/a/1.jpg", 0o600)  # root's, others may not read
    os.chmod(src / "train/b", 0o744)  # others may list it but not search it
    os.chown(src / "train/c/5.jpg", 4242, 0)
    os.chmod(src / "train/c/5.jpg", 0o044)  # the owner's bits rule: no r for 4242
    os.chown(src / "train/a/2.jpg", 0, 777)
    os.chmod(src / "train/a/2.jpg", 0o040)  # group 777 may read
    os.chown(src / "top.txt", 4242, 0)
    os.chmod(src / "top.txt", 0o400)  # the owner may read
    fill_cache(src, tmp_path / "cache")
    with reading(src, tmp_path / "cache") as r:
        for rel, data in FILES.items():  # denied ones come through the path (as root here)
            assert r.read(src / os.fsdecode(rel)) == data
        c = r.counts()
    # denied: 1.jpg (others' bits), 3.png and deep/4.jpg (train/b not searchable), 5.jpg
    assert c["denied"] == 4 and c["hits"] == 2, c
    assert fallbacks(c) == 4


def test_root_reads_whatever_the_modes_say(src, tmp_path):
    os.chmod(src / "train/a/1.jpg", 0o000)
    os.chmod(src / "train/b", 0o000)
    fill_cache(src, tmp_path / "cache")
    os.chmod(src / "train/b", 0o755)  # (the test reads its fallbacks from the source)
    with reading(src, tmp_path / "cache") as r:
        for rel, data in FILES.items():
            assert r.read(src / os.fsdecode(rel)) == data
        assert r.counts()["hits"] == len(FILES)


def test_a_full_reader_table_is_a_fallback_that_keeps_the_environment(src, tmp_path,
                                                                        monkeypatch):
    import lmdb

    from dlcachefs.store import readonly

    fill_cache(src, tmp_path / "cache")
    with reading(src, tmp_path / "cache") as r:
        assert r.read(src / "top.txt") == b"hello"
        ix = R._process(r.info)._index
        real = readonly.IndexReader.locate_path

        def full(self, *a):
            raise lmdb.ReadersFullError("MDB_READERS_FULL")

        monkeypatch.setattr(readonly.IndexReader, "locate_path", full)
        assert r.read(src / "top.txt") == b"hello"  # through the path
        assert R._process(r.info)._index is ix  # not retired: nothing is wrong with it
        monkeypatch.setattr(readonly.IndexReader, "locate_path", real)
        assert r.read(src / "top.txt") == b"hello"
        c = r.counts()
        assert c["hits"] == 2 and c["errors"] == 1


def test_the_index_has_room_for_many_readers_and_frees_dead_ones(src, tmp_path):
    """Slots of processes killed in a lookup (a read transaction open) are freed (the
    daemon does it at start and every READER_REAP_S); the table is far larger than LMDB's
    126, so 8 ranks x 16 workers, each in a lookup at once, still fit."""
    import signal

    from dlcachefs.store.schema import MAX_READERS

    cache = tmp_path / "cache"
    fill_cache(src, cache)
    code = ("import os, signal, sys\n"
            "from dlcachefs.store.readonly import IndexReader\n"
            "ix = IndexReader(sys.argv[1])\n"
            "txn = ix.env.begin()\n"  # killed in the middle of a lookup
            "txn.get(b'x', db=ix.meta)\n"
            "print('open', flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n")
    ix = Index(str(cache / "meta.lmdb"))
    try:
        assert ix.env.max_readers() == MAX_READERS
        ix.reap_readers()
        for _ in range(3):
            p = subprocess.run([sys.executable, "-c", code, str(cache / "meta.lmdb")],
                               capture_output=True, text=True, timeout=60)
            assert p.returncode == -signal.SIGKILL and "open" in p.stdout, p.stderr
        assert ix.reap_readers() == 3
        assert ix.reap_readers() == 0
    finally:
        ix.close()


def test_only_a_mount_root_describes_a_cache(src, tmp_path):
    """A ``.dlcache/zerocopy`` in an ordinary directory (a source tree, another file
    system) never binds a reader: the path is read as it is."""
    fake = src / "train" / ".dlcache"
    fake.mkdir()
    (fake / "zerocopy").write_text('{"format": 1, "index_dir": "/x", "logs_dir": "/x", '
                                   '"tally_dir": "/x", "revalidate_s": 60}')
    assert R.find_mount(src / "train" / "a" / "1.jpg") is None
    assert CacheReader.for_path(src / "train" / "a" / "1.jpg") is None


@pytest.mark.filterwarnings("ignore:.*already open in this process:RuntimeWarning")
def test_close_waits_for_lookups_in_flight(src, tmp_path, monkeypatch):
    """close() under reads in other threads: every read returns the right bytes (from the
    cache or the path) and none raises."""
    import threading

    fill_cache(src, tmp_path / "cache")
    r = reader_of(src, tmp_path / "cache")
    errors: list[BaseException] = []
    stop = threading.Event()

    def loop():
        try:
            while not stop.is_set():
                for rel, data in FILES.items():
                    assert r.read(src / os.fsdecode(rel)) == data
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=loop) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for _ in range(50):
            r.close()
            time.sleep(0.002)
    finally:
        stop.set()
        for t in threads:
            t.join()
        r.close()
    assert errors == []
