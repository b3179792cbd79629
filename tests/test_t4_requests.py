"""Mounted tests: how many FUSE requests a file costs (``fuse_ops`` in stats), and that
the cuts that keep the count low never cost exact bytes or freshness.

Each request is a round trip through the kernel to a single-threaded Python daemon, so
the count per file bounds files/s (DESIGN.md, "FUSE facts"). What the kernel sends is
decided by what the daemon answers: entry and attribute timeouts (lookups and getattrs
cached for ``--revalidate`` seconds), ``keep_cache`` (a cached file's pages survive the
next open, so a warm read sends no READ), FLUSH answered once with ENOSYS.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import requires_fuse

from dlcachefs.testing.mounting import drop_page_cache, wait_until

pytestmark = requires_fuse

N_FILES = 24


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "src"
    for i in range(N_FILES):
        d = root / f"c{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        # sizes below and above one 128 KiB request, and an empty file
        (d / f"{i:02d}.bin").write_bytes(os.urandom((0, 1000, 70_000, 200_000)[i % 4]))
    return root


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.bin"))


def _ops(m) -> dict[str, int]:
    return m.stats()["fuse_ops"]


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def _read_python(p: Path) -> bytes:
    with open(p, "rb") as f:
        return f.read()


def _read_cat(p: Path) -> bytes:
    return subprocess.run(["cat", str(p)], capture_output=True, check=True).stdout


def _pass(m, src: Path, rels: list[str], read) -> dict[str, int]:
    """Read every file through the mount (checking its bytes); the requests it cost,
    once every RELEASE arrived (the kernel sends them after close returns)."""
    before = _ops(m)
    for rel in rels:
        assert read(m.mnt / rel) == (src / rel).read_bytes(), rel
    wait_until(lambda: _delta(before, _ops(m)).get("release", 0) >= len(rels),
               "releases of the pass")
    d = _delta(before, _ops(m))
    d.pop("dlcache", None)  # reading the stats themselves
    return d


@pytest.mark.parametrize("reader", [_read_python, _read_cat], ids=["python", "cat"])
def test_warm_file_costs_an_open_and_a_release(src, mount, reader):
    m = mount(src)
    rels = _files(src)
    first = _pass(m, src, rels, reader)
    assert first["open"] == len(rels)
    assert first["lookup"] >= len(rels)  # every name once (and the directories)
    m.wait_cached(len(rels))
    # cached now: keep_cache keeps the pages the first pass read, and the kernel still
    # holds every entry and attribute (long timeouts): no LOOKUP, no READ. Reads of the
    # first pass invalidated each inode's atime (the mount is not `ro`): at most one
    # GETATTR per file, then none. (Up to 10 tries: anything on the machine that drops the
    # page cache or the dentries, e.g. a benchmark's drop_caches, makes one pass send
    # lookups and reads again; a daemon that breaks the rule does it on every pass.)
    passes = []
    for _ in range(10):
        d = _pass(m, src, rels, reader)
        passes.append(d)
        assert d["open"] == len(rels) and d["release"] == len(rels), d
        assert d.get("getattr", 0) <= len(rels), d
        if set(d) <= {"open", "release"}:
            break
    assert set(passes[-1]) <= {"open", "release"}, passes
    assert _ops(m)["flush"] <= 1  # answered ENOSYS once; the kernel stops sending it


def _drop_mount_pages(m, rels: list[str]) -> None:
    """The mount's pages of these files only (``posix_fadvise`` through the mount: an OPEN
    and a RELEASE each, nothing else on the machine dropped)."""
    for rel in rels:
        fd = os.open(m.mnt / rel, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def test_a_warm_open_reads_no_index(src, mount):
    """A cached file's OPEN, GETATTR, READ and RELEASE take its entry and record from the
    memo of the index's current snapshot, not from an LMDB read transaction each
    (``index_reads``: three or four per file without it). Up to 5 passes of each kind: a
    background commit (nothing is fetched here, but the writer's timers run) empties the
    memo once, and the pass after it reads each key once more."""
    m = mount(src)
    rels = _files(src)
    _pass(m, src, rels, _read_python)
    m.wait_cached(len(rels))
    nonempty = [r for r in rels if (src / r).stat().st_size]
    for drop in (False, True):
        tries = []
        for _ in range(5):
            if drop:
                _drop_mount_pages(m, nonempty)
            before = m.stats()
            d = _pass(m, src, rels, _read_python)
            after = m.stats()
            tries.append((after["index_reads"] - before["index_reads"], d))
            if tries[-1][0] == 0:
                break
        assert tries[-1][0] == 0, (drop, tries)
        if drop:
            assert tries[-1][1].get("read", 0) >= len(nonempty), tries  # the daemon served
        assert after["index_memo_hits"] - before["index_memo_hits"] >= 2 * len(rels)


def test_a_record_whose_log_pages_are_in_memory_is_read_without_a_thread(src, mount):
    """Pages of the mount dropped, the logs' kept (they were just written): each READ's
    record is copied from the page cache on the daemon's loop (``RWF_NOWAIT``), no hop to
    a worker thread (``record_reads_in_memory``), and the bytes are the source's. A small
    memory tier, so that records are read alone, not their whole chunks. Up to 5 passes:
    anything on the machine that drops the page cache sends one pass's reads to the disk
    (through the thread), which brings the pages back."""
    m = mount(src, "--memory", "1M", "--chunk-size", "1M")
    rels = [r for r in _files(src) if (src / r).stat().st_size]
    _pass(m, src, rels, _read_python)
    m.wait_cached(len(rels))
    tries = []
    for _ in range(5):
        _drop_mount_pages(m, rels)
        before = m.stats()
        _pass(m, src, rels, _read_python)  # (checks every file's bytes)
        after = m.stats()
        got = {k: after[k] - before[k] for k in ("record_reads", "record_reads_in_memory",
                                                 "chunk_reads", "checksum_failures")}
        tries.append(got)
        if got["record_reads_in_memory"] == got["record_reads"] == len(rels):
            break
    assert tries[-1] == {"record_reads": len(rels), "record_reads_in_memory": len(rels),
                         "chunk_reads": 0, "checksum_failures": 0}, tries


def test_dropped_pages_are_read_again_once(src, mount):
    m = mount(src)
    rels = _files(src)
    _pass(m, src, rels, _read_python)
    m.wait_cached(len(rels))
    drop_page_cache()  # as the kernel does to pages nobody touched for a while
    d = _pass(m, src, rels, _read_python)
    nonempty = sum(1 for r in rels if (src / r).stat().st_size)
    assert nonempty <= d.get("read", 0) <= 2 * nonempty, d
    assert d["open"] == len(rels), d


def test_changed_source_file_is_served_new_after_revalidation(tmp_path, mount):
    """The long kernel timeouts and keep_cache hold only within ``--revalidate``: a file
    changed on the source is served new (and whole) once its directory is revalidated,
    even when the kernel held pages of the old version."""
    root = tmp_path / "src"
    (root / "d").mkdir(parents=True)
    f = root / "d" / "x.bin"
    f.write_bytes(b"a" * 50_000)
    m = mount(root, "--revalidate", "1")
    assert (m.mnt / "d" / "x.bin").read_bytes() == b"a" * 50_000
    m.wait_cached(1)
    assert (m.mnt / "d" / "x.bin").read_bytes() == b"a" * 50_000  # kept pages
    new = b"b" * 70_000
    f.write_bytes(new)
    os.utime(f, ns=(time.time_ns(), time.time_ns() + 5_000_000_000))
    seen = []

    def served_new() -> bool:
        data = (m.mnt / "d" / "x.bin").read_bytes()
        seen.append(data)
        assert data in (b"a" * 50_000, new), f"{len(data)} bytes, neither version"
        return data == new

    wait_until(served_new, "the new version through the mount", timeout=30, interval=0.3)
    assert (m.mnt / "d" / "x.bin").read_bytes() == new


def test_an_open_of_a_replaced_file_gives_fstat_the_size_it_reads(tmp_path, mount):
    """Files replaced on the source (tmp + rename, every ~20 ms) while a reader opens each,
    ``fstat``s it and reads it to its end: the size ``fstat`` gives is the size of the
    version read, and ``numpy.fromfile`` (which reads as many bytes as the file's size)
    gets a whole version. An open that found a new version before the kernel's queued
    invalidation went through read the new bytes but showed the older size (a sweep:
    47 in 40,020 reads, and 4 ``fromfile`` results cut at the older size)."""
    np = pytest.importorskip("numpy")
    import random  # noqa: PLC0415

    root = tmp_path / "src"
    (root / "d").mkdir(parents=True)
    names = [f"f{i:02d}.bin" for i in range(20)]
    versions = {}
    for i, n in enumerate(names):
        data = os.urandom(20_000 + 1000 * i)
        (root / "d" / n).write_bytes(data)
        versions[n] = {data}
    m = mount(root, "--revalidate", "1")
    stop = time.monotonic() + 8
    lock = threading.Lock()

    def writer() -> None:
        rnd = random.Random(0)
        while time.monotonic() < stop:
            n = rnd.choice(names)
            data = os.urandom(rnd.randrange(20_000, 60_000))
            with lock:
                versions[n].add(data)
            tmp = root / "d" / (n + ".tmp")
            tmp.write_bytes(data)
            os.rename(tmp, root / "d" / n)
            time.sleep(0.02)

    t = threading.Thread(target=writer)
    t.start()
    reads, wrong = 0, []
    try:
        while time.monotonic() < stop:
            for n in names:
                p = m.mnt / "d" / n
                with open(p, "rb") as f:
                    size = os.fstat(f.fileno()).st_size
                    data = f.read()
                whole = np.fromfile(p, dtype=np.uint8).tobytes()
                reads += 1
                with lock:
                    if size != len(data) or data not in versions[n] \
                            or whole not in versions[n]:
                        wrong.append((n, size, len(data), len(whole)))
    finally:
        t.join()
    assert reads > 100
    assert not wrong, (len(wrong), reads, wrong[:5])


@pytest.mark.parametrize("bound", [None, "64K", "0"], ids=["default", "64K", "off"])
def test_a_fetched_file_comes_with_its_pages_and_sends_no_read(src, mount, bound):
    """``--store-pages``: a file the open fetched is given to the kernel's page cache with
    the open (``notify_store``), so the reader's READs never reach the daemon; the bytes
    are the source's. Files above the bound (and every file with 0) are read as before."""
    m = mount(src) if bound is None else mount(src, "--store-pages", bound)
    limit = {None: 4 << 20, "64K": 64 << 10, "0": 0}[bound]
    rels = _files(src)
    sizes = {r: (src / r).stat().st_size for r in rels}
    stored = [r for r in rels if 0 < sizes[r] <= limit]
    above = [r for r in rels if sizes[r] > limit]
    d = _pass(m, src, rels, _read_python)  # every byte compared with the source
    assert d["open"] == len(rels)
    assert m.stats()["pages_stored"] == len(stored), (d, m.stats()["pages_stored"])
    # a file above the bound needs at least one READ; one below it none
    assert len(above) <= d.get("read", 0) <= 4 * len(above), d
    # the kernel keeps the stored pages: a second pass reads nothing either (up to 10
    # tries, as above: something else on the machine may drop the page cache)
    m.wait_cached(len(rels))
    for _ in range(10):
        again = _pass(m, src, stored, _read_cat)
        if again.get("read", 0) == 0:
            break
    assert again.get("read", 0) == 0, again


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "not-cached"])
def test_a_file_that_shrinks_is_never_served_with_the_old_tail(tmp_path, mount, cached):
    """Stored pages never cut the kernel's idea of a file's size: a file read once (its
    pages given with the open), then shrunk on the source to a length inside one of its
    pages, is read whole and new, never as the new bytes followed by the old tail. Also
    when it is not cached and every open fetches it (``--cache-size`` below its size)."""
    root = tmp_path / "src"
    root.mkdir()
    f = root / "x.bin"
    old = os.urandom(12_000)
    f.write_bytes(old)
    m = mount(root, "--revalidate", "0",
              *(() if cached else ("--cache-size", "8K", "--chunk-size", "4K")))
    for _ in range(2):
        assert (m.mnt / "x.bin").read_bytes() == old
        assert _read_cat(m.mnt / "x.bin") == old
    new = os.urandom(5_000)
    f.write_bytes(new)
    os.utime(f, ns=(time.time_ns(), time.time_ns() + 5_000_000_000))
    for _ in range(3):
        assert (m.mnt / "x.bin").read_bytes() == new
        assert _read_cat(m.mnt / "x.bin") == new
        with open(m.mnt / "x.bin", "rb") as fh:
            assert os.pread(fh.fileno(), 20_000, 4000) == new[4000:]


@pytest.mark.parametrize(("old_size", "new_size", "seen_by"),
                         [(70_000, 70_000, "opens"), (70_000, 5_000, "opens"),
                          (12_000, 70_000, "opens"), (70_000, 5_000, "listing")],
                         ids=["same-size", "shorter", "longer", "shorter-listed"])
def test_an_open_file_replaced_on_the_source_never_reads_the_new_bytes(tmp_path, mount,
                                                                         old_size, new_size,
                                                                         seen_by):
    """A file open here (read in part), then replaced on the source (tmp + rename) and
    read whole by two newer opens (or seen by a listing): the older open's next reads
    give its own version's bytes or fail (ESTALE), never the new version's tail after
    its own head, nor end early at the new size. (The
    kernel's pages are shared by every open of an inode and read without asking the
    daemon: before, the second newer open filled them with the new bytes, and the older
    open read those.)"""
    root = tmp_path / "src"
    root.mkdir()
    f = root / "f"
    old = b"A" * old_size
    f.write_bytes(old)
    # a listing re-lists once the window has passed, while the kernel keeps the
    # attributes it was given for that window: its READDIRPLUS alone sets the size
    m = mount(root, "--revalidate", "0" if seen_by == "opens" else "1")
    fd = os.open(m.mnt / "f", os.O_RDONLY)
    try:
        assert os.read(fd, 4096) == old[:4096]
        tmp = root / "f.tmp"
        new = b"B" * new_size
        tmp.write_bytes(new)
        os.utime(tmp, ns=(time.time_ns(), time.time_ns() + 5_000_000_000))
        os.rename(tmp, f)
        if seen_by == "listing":
            # a listing's READDIRPLUS gives the kernel attributes too: not the new size
            # (the kernel would cut the open's reads there, a clean EOF mid-file)
            time.sleep(1.5)
            subprocess.run(["ls", "-l", str(m.mnt)], check=True, capture_output=True)
        else:
            for _ in range(2):
                assert _read_cat(m.mnt / "f") == new
                assert (m.mnt / "f").read_bytes() == new
        try:
            rest = b""
            while chunk := os.read(fd, 1 << 16):
                rest += chunk
        except OSError as exc:
            assert exc.errno == errno.ESTALE, exc
        else:
            # its own version, whole: not cut short by the newer version's size
            assert old[:4096] + rest == old, (len(rest), set(rest))
    finally:
        os.close(fd)
    assert (m.mnt / "f").read_bytes() == new  # and the newer opens stay right after it


def _size_of(b: int) -> int:
    return (5000, 12_000, 70_000)[b % 3] + b


@pytest.mark.parametrize("revalidate", ["0", "1"])
def test_readers_beside_a_writer_that_replaces_the_file_read_whole_versions(tmp_path, mount,
                                                                           revalidate):
    """A writer replaces a file on the source (tmp + rename) every few ms with versions of
    other sizes, while cat, dd, head, tail and Python read it through the mount: every
    read that succeeds is one whole version (one byte value, that version's length),
    never a mix, zeros, or a version cut at another's size. (Before: 7-31 bad reads in
    20 s. The kernel's pages and its idea of the size are per inode, shared by every
    open: an open bypasses them while the kernel may hold another version's.)"""
    root = tmp_path / "src"
    root.mkdir()
    (root / "v").write_bytes(b"\x01" * _size_of(1))
    m = mount(root, "--revalidate", revalidate)
    v = m.mnt / "v"
    stop = time.monotonic() + 10
    bad: list = []
    reads = [0]
    whole = [0]

    def writer() -> None:
        n = 0
        while time.monotonic() < stop:
            b = 1 + n % 250
            (root / "v.tmp").write_bytes(bytes([b]) * _size_of(b))
            os.rename(root / "v.tmp", root / "v")
            n += 1
            time.sleep(0.002)

    def reader(cmd: list[str]) -> None:
        while time.monotonic() < stop:
            r = subprocess.run(cmd, capture_output=True)
            reads[0] += 1
            if r.returncode != 0:
                continue  # an error (ESTALE) is allowed; wrong bytes are not
            d = r.stdout
            if cmd[0] == "ls":
                continue  # (its READDIRPLUS gives the kernel attributes)
            if not d or len(set(d)) != 1 or len(d) != _size_of(d[0]):
                bad.append((cmd[0], len(d), sorted(set(d))[:4]))
            else:
                whole[0] += 1

    cmds = [["cat", str(v)], ["dd", f"if={v}", "bs=777", "status=none"],
            ["head", "-c", "80000", str(v)], ["tail", "-c", "80000", str(v)],
            [sys.executable, "-c", f"import sys; sys.stdout.buffer.write(open({str(v)!r}, "
                                   "'rb').read())"],
            ["ls", "-l", str(m.mnt)]]
    threads = [threading.Thread(target=writer)]
    threads += [threading.Thread(target=reader, args=(c,)) for c in cmds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert whole[0] > 50, (whole[0], reads[0])  # most reads succeed, whole
    assert bad == [], (len(bad), reads[0], bad[:10])
