"""Identical bytes cached once in a shared root (--shared-cache dedup), mounted for real.

Two sources hold the same bytes under other names, other directories and other mtimes (a
dataset copied to another path, re-uploaded). Dataset ``a`` is mounted and read whole, so
its cache holds every file; then dataset ``b`` is mounted on the same root and read
through the kernel. Every byte read is compared with ``b``'s source; ``b``'s names and
metadata must be its own.
"""

from __future__ import annotations

import hashlib
import os
import random
import time
from pathlib import Path

import pytest
from conftest import requires_fuse

from dlcachefs.testing.mounting import drop_page_cache

KIB = 1024
N = 30


def _copies(tmp_path: Path, n: int = N) -> tuple[Path, Path, dict[str, bytes], dict[str, str]]:
    """Source ``a`` (``cK/fNNN.jpg``) and source ``b``, the same bytes at other paths
    (``train/kK_NNN.jpg``), written later (other mtimes). Returns both roots, ``a``'s
    files and the name in ``b`` of each of them."""
    rnd = random.Random(7)
    a, b = tmp_path / "a", tmp_path / "b"
    files, names = {}, {}
    for i in range(n):
        rel = f"c{i % 3}/f{i:03d}.jpg"
        data = rnd.randbytes(rnd.randrange(1, 80 * KIB))
        (a / rel).parent.mkdir(parents=True, exist_ok=True)
        (a / rel).write_bytes(data)
        files[rel] = data
    for i, (rel, data) in enumerate(files.items()):
        other = f"train/k{i % 3}_{i:03d}.jpg"
        (b / other).parent.mkdir(parents=True, exist_ok=True)
        (b / other).write_bytes(data)
        os.utime(b / other, ns=(1_600_000_000_000_000_000 + i, 1_600_000_000_000_000_000 + i))
        names[rel] = other
    return a, b, files, names


def _args(name: str, *extra: str) -> list[str]:
    return ["--shared-cache", "--dataset", name, "--cache-size", "64M",
            "--flush-interval", "0.2", "--scan-ahead", "0", *extra]


def _manifest(b: Path) -> Path:
    """``sha256sum`` of ``b``'s files, written in ``b`` (as datasets ship one). Files are
    trusted when their ctime is before the list's: the pause keeps the list's timestamp
    clear of the files' on a filesystem with coarse (jiffy) timestamps."""
    time.sleep(0.05)
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  ./{p.relative_to(b)}"
             for p in sorted(b.rglob("*.jpg"))]
    out = b / "SHA256SUMS"
    out.write_text("\n".join(lines) + "\n")
    return out


def _read_b(mb, b: Path, files: dict[str, bytes], names: dict[str, str]) -> None:
    """Every file of ``b`` through the mount (page cache dropped first): ``b``'s bytes,
    and ``b``'s own metadata."""
    drop_page_cache()
    for rel, data in files.items():
        p = mb.mnt / names[rel]
        assert p.read_bytes() == data, names[rel]
        assert p.stat().st_mtime_ns == (b / names[rel]).stat().st_mtime_ns
    assert sorted(os.listdir(mb.mnt / "train")) == sorted(os.listdir(b / "train"))


def _mount_b(mount, b: Path, root: Path, *extra: str, sees: str = "siblings"):
    """b's mount, once its daemon has walked a's index (``sees``: ``siblings`` when it
    reads from a, ``not_read`` when it refused to); until then b reads its own source."""
    mb = mount(b, *_args("b", *extra), name="mb", cache=root)
    mb.wait_stats(lambda st: st["dedup"][sees] == ["a"], f"b's dedup {sees} is not ['a']")
    return mb


def _cached_a(mount, a: Path, root: Path, files: dict[str, bytes]):
    ma = mount(a, *_args("a"), name="ma", cache=root)
    for rel, data in files.items():
        assert (ma.mnt / rel).read_bytes() == data
    ma.wait_cached(len(files))
    return ma


@requires_fuse
def test_a_copy_with_a_manifest_is_served_from_the_first_without_a_source_read(
        tmp_path, mount):
    a, b, files, names = _copies(tmp_path)
    root = tmp_path / "root"
    ma = _cached_a(mount, a, root, files)
    total = sum(map(len, files.values()))
    mb = _mount_b(mount, b, root, "--content-manifest", str(_manifest(b)))
    for _ in range(2):  # twice: a second epoch borrows again, still nothing cached in b
        _read_b(mb, b, files, names)
    st = mb.stats()
    assert st["bytes_from_source"] == 0, st  # b's source was not read at all
    assert st["bytes_from_datasets"] == 2 * total
    assert st["cached_bytes"] == 0 and st["chunk_bytes"] == 0  # not a second copy
    d = st["dedup"]
    assert d["siblings"] == ["a"] and d["manifest_files"] == N
    assert d["borrowed_files"] == 2 * N and d["mismatches"] == 0
    assert ma.stats()["cached_bytes"] == total  # the one copy, charged to a


@requires_fuse
@pytest.mark.parametrize("keyed", ["manifest", "hashed"])
def test_a_copy_read_at_once_after_its_mount_borrows_from_the_first_read(
        tmp_path, mount, keyed):
    """b is read the moment its mount returns, before its daemon could have walked a's
    index: the first fetches wait for that walk (bounded) instead of going on without a.
    With a manifest, b's source is not read at all; hashed, nothing is stored in b.
    Before, the reads of the first seconds after a mount went to b's source and were
    cached a second time in b."""
    a, b, files, names = _copies(tmp_path)
    root = tmp_path / "root"
    ma = _cached_a(mount, a, root, files)
    total = sum(map(len, files.values()))
    extra = ["--content-manifest", str(_manifest(b))] if keyed == "manifest" else []
    mb = mount(b, *_args("b", *extra), name="mb", cache=root)
    _read_b(mb, b, files, names)  # at once: no wait for b's dedup to see a
    st = mb.wait_stats(lambda st: st["pending_bytes"] == 0, "b's writer did not settle")
    d = st["dedup"]
    if keyed == "manifest":
        assert st["bytes_from_source"] == 0, st  # every file borrowed, the first too
        assert d["borrowed_files"] == N and st["bytes_from_datasets"] == total, d
    else:
        assert st["bytes_from_source"] == total, st  # read once, to learn its digest
        assert d["held_elsewhere"] == N, d
    assert st["chunk_bytes"] == 0 and st["cached_files"] == 0, st  # no second copy
    assert ma.stats()["cached_bytes"] == total
    assert d["siblings"] == ["a"] and d["first_look_s"] is not None, d


@requires_fuse
@pytest.mark.parametrize("keyed", ["manifest", "hashed"])
def test_scan_ahead_of_a_copy_caches_no_second_copy(tmp_path, mount, keyed):
    """Scan-ahead (on by default) fetches the rest of ``b``'s tree while a reader goes
    through it in random order: what it fetches is borrowed from ``a`` (a manifest keys
    it) or found held there once read (hashed), and is not cached a second time in
    ``b``. Before, scan-ahead submitted its own fetches to the writer past the dedup."""
    n = 96  # past scan-ahead's 32 opens before it starts
    a, b, files, names = _copies(tmp_path, n)
    root = tmp_path / "root"
    ma = _cached_a(mount, a, root, files)
    extra = ["--content-manifest", str(_manifest(b))] if keyed == "manifest" else []
    mb = _mount_b(mount, b, root, *extra, "--scan-ahead", "2")
    order = list(files)
    random.Random(3).shuffle(order)
    drop_page_cache()
    for rel in order[:40]:  # past the 32 opens: scan-ahead starts on the rest of train/
        assert (mb.mnt / names[rel]).read_bytes() == files[rel], names[rel]
    mb.wait_stats(lambda st: st["scan_ahead_files"] > 0, "scan-ahead fetched nothing")
    for rel in order[40:]:
        assert (mb.mnt / names[rel]).read_bytes() == files[rel], names[rel]
    st = mb.wait_stats(lambda st: st["pending_bytes"] == 0, "b's writer did not settle")
    assert st["chunk_bytes"] == 0 and st["cached_files"] == 0, st
    assert ma.stats()["cached_bytes"] == sum(map(len, files.values()))


@requires_fuse
def test_a_copy_keyed_by_an_attribute_is_served_from_the_first(tmp_path, mount):
    a, b, files, names = _copies(tmp_path)
    try:
        for rel, data in files.items():
            os.setxattr(b / names[rel], "user.sha256", hashlib.sha256(data).hexdigest().encode())
    except OSError as e:
        pytest.skip(f"no user xattrs on {tmp_path}: {e.strerror}")
    root = tmp_path / "root"
    _cached_a(mount, a, root, files)
    mb = _mount_b(mount, b, root, "--content-xattr", "user.sha256")
    _read_b(mb, b, files, names)
    st = mb.stats()
    assert st["bytes_from_source"] == 0 and st["cached_bytes"] == 0, st
    assert st["dedup"]["key_xattr"] == N and st["dedup"]["borrowed_files"] == N


@requires_fuse
def test_without_keys_a_copy_is_read_once_stored_once_and_then_borrowed(tmp_path, mount):
    """No manifest, no attribute: b's first read of each file goes to its source (the
    only way to know its digest), finds a's copy and stores nothing; later opens, and a
    new mount of b, borrow a's copy by the key b learned."""
    a, b, files, names = _copies(tmp_path)
    root = tmp_path / "root"
    _cached_a(mount, a, root, files)
    total = sum(map(len, files.values()))
    mb = _mount_b(mount, b, root)
    _read_b(mb, b, files, names)
    st = mb.stats()
    assert st["bytes_from_source"] == total and st["dedup"]["held_elsewhere"] == N, st
    _read_b(mb, b, files, names)
    st = mb.stats()
    assert st["bytes_from_source"] == total and st["dedup"]["borrowed_files"] == N, st
    assert st["cached_bytes"] == 0 and st["chunk_bytes"] == 0
    mb.umount()  # the learned keys are in b's index now
    mb2 = _mount_b(mount, b, root)
    _read_b(mb2, b, files, names)
    st = mb2.stats()
    assert st["bytes_from_source"] == 0 and st["dedup"]["key_learned"] == N, st


@requires_fuse
def test_a_damaged_or_vanished_copy_is_never_served_and_the_borrower_caches_its_own(
        tmp_path, mount, daemon_oracle):
    """a's logs are damaged under b (as an eviction's punched hole would leave them, but
    with a's index still pointing at them), then deleted: b reads b's source each time,
    never a's bad bytes, and keeps its own copy once a's failed its check."""
    a, b, files, names = _copies(tmp_path)
    root = tmp_path / "root"
    ma = _cached_a(mount, a, root, files)
    ma.umount()  # a's cache stays, unmounted: nobody repairs it
    logs = sorted((root / "datasets" / "a" / "logs").glob("*.log"))
    assert logs
    for p in logs:  # zero everything past each log's header
        size = p.stat().st_size
        with open(p, "r+b") as f:
            f.seek(4096)
            f.write(b"\0" * max(0, size - 4096))
    index = root / "datasets" / "a" / "meta.lmdb" / "data.mdb"
    stamp = index.stat().st_mtime_ns
    mb = _mount_b(mount, b, root, "--content-manifest", str(_manifest(b)))
    _read_b(mb, b, files, names)
    st = mb.stats()
    assert st["dedup"]["borrowed_files"] == 0 and st["dedup"]["mismatches"] == N, st["dedup"]
    assert index.stat().st_mtime_ns == stamp  # b's walk of a's index wrote nothing
    assert st["bytes_from_source"] == sum(map(len, files.values()))
    st = mb.wait_cached(N)  # its own copies now
    for p in logs:
        p.unlink()
    _read_b(mb, b, files, names)  # from b's own cache
    assert mb.stats()["hits"] >= N


def _one_file_changed_after_the_manifest(tmp_path, mount, change) -> None:
    """a cached; b's manifest written; then ``change(path, old bytes) -> new bytes`` on
    one of b's files. b must read that file's new bytes from its source (the manifest's
    digest not used for it) and borrow the others."""
    a, b, files, names = _copies(tmp_path)
    root = tmp_path / "root"
    _cached_a(mount, a, root, files)
    manifest = _manifest(b)
    rel = next(iter(files))
    new = change(b / names[rel], files[rel])
    files = {**files, rel: new}
    mb = _mount_b(mount, b, root, "--content-manifest", str(manifest))
    _read_b(mb, b, files, names)
    st = mb.stats()
    assert st["dedup"]["key_manifest"] == N - 1 and st["bytes_from_source"] == len(new), st


@requires_fuse
def test_a_file_changed_after_the_manifest_is_read_from_its_source(tmp_path, mount):
    def change(p: Path, old: bytes) -> bytes:
        new = b"changed after the manifest was written"
        p.write_bytes(new)  # now later than the manifest
        return new

    _one_file_changed_after_the_manifest(tmp_path, mount, change)


@requires_fuse
def test_a_file_replaced_with_its_old_mtime_is_not_trusted_to_the_manifest(tmp_path, mount):
    """rsync -a, cp -p, tar x: a new version of the same size whose mtime is set back to
    before the list. Its ctime is not: the list's digest is not used for it, and the
    reader gets the new bytes (not a's copy of the old ones)."""
    def change(p: Path, old: bytes) -> bytes:
        st = p.stat()
        new = bytes(x ^ 0xFF for x in old)  # same size, other bytes
        p.write_bytes(new)
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))  # the old mtime, as rsync -a keeps
        return new

    _one_file_changed_after_the_manifest(tmp_path, mount, change)


@requires_fuse
@pytest.mark.daemon_log_allows("its index is damaged")
@pytest.mark.verify_allows("damaged")
def test_a_damaged_index_of_another_dataset_is_not_read(tmp_path, mount):
    """a's index truncated while a is unmounted (reading it would kill a process with
    SIGBUS): b walks it in a child process first, finds the damage, and never opens it;
    b serves every file from its own source, and stays up."""
    a, b, files, names = _copies(tmp_path)
    root = tmp_path / "root"
    ma = _cached_a(mount, a, root, files)
    ma.umount()
    data = root / "datasets" / "a" / "meta.lmdb" / "data.mdb"
    os.truncate(data, data.stat().st_size // 3)
    mb = _mount_b(mount, b, root, "--content-manifest", str(_manifest(b)), sees="not_read")
    _read_b(mb, b, files, names)
    st = mb.stats()
    assert st["dedup"]["siblings"] == [] and st["dedup"]["borrowed_files"] == 0, st["dedup"]
    assert st["bytes_from_source"] == sum(map(len, files.values()))


@requires_fuse
def test_content_options_need_a_shared_cache(tmp_path):
    import subprocess  # noqa: PLC0415

    from dlcachefs.testing.mounting import DLCACHEFS  # noqa: PLC0415

    (tmp_path / "src").mkdir()
    r = subprocess.run([*DLCACHEFS, "mount", str(tmp_path / "src"), str(tmp_path / "m"),
                        "--content-xattr", "user.sha256"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "need --shared-cache" in r.stderr, r.stderr
