"""The source's whole-file read (``dlcachefs.cache.source._read_all``): exactly the bytes up
to EOF, at most one past the expected size (how a file that grew is noticed), whatever
sizes the reads come back in (a pipe gives short reads, as a network filesystem may)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlcachefs.cache.source import _read_all


@settings(max_examples=60, deadline=None)
@given(content=st.binary(max_size=70_000), delta=st.integers(-3, 3),
       piece=st.integers(1, 20_000))
def test_reads_to_eof_and_one_byte_past_the_size(content, delta, piece):
    size = max(0, len(content) + delta)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer, in pieces: the reader sees short reads
        try:
            os.close(r)
            for i in range(0, len(content), piece):
                os.write(w, content[i:i + piece])
        finally:
            os._exit(0)
    os.close(w)
    try:
        got = _read_all(r, size)
    finally:
        os.waitpid(pid, 0)
        os.close(r)
    assert got == content[: size + 1]


def test_a_regular_file_in_one_read(tmp_path):
    p = tmp_path / "f"
    data = os.urandom(300_000)
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY)
    try:
        assert _read_all(fd, len(data)) == data
        os.lseek(fd, 0, 0)
        assert _read_all(fd, len(data) - 10) == data[: len(data) - 9]  # it grew: one more
    finally:
        os.close(fd)


# ----- LocalSource's remembered directories (``DirDescriptors``) -----------------------------

import shutil  # noqa: E402

from hypothesis import HealthCheck  # noqa: E402

from dlcachefs.cache.source import DirDescriptors, LocalSource  # noqa: E402
from dlcachefs.errors import DlcError  # noqa: E402


def _expect(root, rel: bytes):
    """What the tree holds at ``rel`` now, read directly: bytes, or None (no such
    regular file reachable without a symlink)."""
    p = os.path.join(os.fsencode(root), rel)
    parts = rel.split(b"/")
    cur = os.fsencode(root)
    for name in parts[:-1]:
        cur = os.path.join(cur, name)
        if os.path.islink(cur) or not os.path.isdir(cur):
            return None
    if os.path.islink(p) or not os.path.isfile(p):
        return None
    with open(p, "rb") as f:
        return f.read()


OPS = st.lists(st.tuples(st.sampled_from(["read", "rename_dir", "swap_dir", "rewrite",
                                          "link_out", "remove"]),
                         st.integers(0, 2), st.integers(0, 2)), min_size=1, max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_remembered_directories_never_give_another_files_bytes(tmp_path, ops):
    """Directories renamed away, swapped for new ones or for symlinks out of the root,
    files rewritten or removed between reads: every read through the source gives what the
    tree holds at that path now, or an error when nothing regular is there; never the
    bytes of a file that was at that path before, never a file outside the root."""
    base = tmp_path / f"t{os.urandom(4).hex()}"
    root, outside = base / "root", base / "outside"
    for d in range(3):
        (root / f"d{d}").mkdir(parents=True)
        for f in range(3):
            (root / f"d{d}" / f"f{f}").write_bytes(b"orig %d %d\n" % (d, f))
    outside.mkdir()
    for f in range(3):
        (outside / f"f{f}").write_bytes(b"SECRET %d\n" % f)
    src = LocalSource(str(root))
    gen = 0
    try:
        for op, d, f in ops:
            dpath = root / f"d{d}"
            rel = b"d%d/f%d" % (d, f)
            gen += 1
            if op == "read":
                want = _expect(root, rel)
                try:
                    got, ident = src.read_file(rel, True)
                except DlcError:
                    assert want is None, f"{rel!r}: an error, but the tree holds {want!r}"
                else:
                    assert got == want, f"{rel!r}: got {got!r}, the tree holds {want!r}"
                    assert ident.size == len(got)
            elif op == "rename_dir" and dpath.is_dir() and not dpath.is_symlink():
                dpath.rename(root / f"moved{gen}")  # still under the root
            elif op == "swap_dir":
                if dpath.is_symlink() or dpath.is_file():
                    dpath.unlink()
                elif dpath.exists():
                    dpath.rename(root / f"old{gen}")
                dpath.mkdir()
                for k in range(3):
                    (dpath / f"f{k}").write_bytes(b"gen %d %d %d\n" % (gen, d, k))
            elif op == "rewrite" and dpath.is_dir() and not dpath.is_symlink():
                (dpath / f"f{f}").write_bytes(b"rewritten %d\n" % gen)
            elif op == "link_out":
                if dpath.is_symlink():
                    dpath.unlink()
                elif dpath.exists():
                    dpath.rename(base / f"gone{gen}")
                dpath.symlink_to(outside)
            elif op == "remove" and dpath.is_dir() and not dpath.is_symlink():
                (dpath / f"f{f}").unlink(missing_ok=True)
    finally:
        src._dirs.clear()
        shutil.rmtree(base)


def test_descriptors_in_use_are_closed_by_their_last_user(tmp_path):
    """A descriptor dropped while handed out stays open until given back (no thread ever
    uses a closed, maybe reused, number); the table holds at most MAX."""
    dirs = DirDescriptors()
    fds = [os.open(tmp_path, os.O_PATH) for _ in range(DirDescriptors.MAX + 5)]
    held = dirs.put(b"k0", fds[0])
    for i in range(1, len(fds)):  # k0 is pushed out while held
        dirs.give_back(dirs.put(b"k%d" % i, fds[i]))
    assert len(dirs._dirs) == DirDescriptors.MAX
    os.fstat(held.fd)  # still open
    dirs.give_back(held)
    try:
        os.fstat(held.fd)
    except OSError:
        pass
    else:
        raise AssertionError("the last user did not close a dropped descriptor")
    assert dirs.take(b"k0") is None
    dirs.clear()
    for d in fds[len(fds) - DirDescriptors.MAX:]:
        try:
            os.fstat(d)
        except OSError:
            continue
        raise AssertionError("clear() left a descriptor open")


def test_a_root_that_never_gives_exact_paths_stops_remembering(tmp_path, monkeypatch):
    """A source whose descriptors never show exactly root + rel (here: a path with a
    doubled slash after the root) is still read, checked against the root's prefix,
    and nothing is remembered from then on; one outside the root is refused."""
    import dlcachefs.cache.source as source_mod
    from dlcachefs.errors import OutsideSource

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"x" * 10)
    src = LocalSource(str(tmp_path))
    real_fd_path = source_mod._fd_path
    monkeypatch.setattr(source_mod, "_fd_path",
                        lambda fd: real_fd_path(fd).replace(src._prefix, src._prefix + b"/", 1))
    for k in range(LocalSource.INEXACT_LIMIT):  # a few in a row (not a racing rename)
        assert src._exact_paths, k
        assert src.read_file(b"d/f", True)[0] == b"x" * 10
    assert not src._exact_paths and not src._dirs._dirs
    assert src.read_file(b"d/f", True)[0] == b"x" * 10
    assert not src._dirs._dirs
    monkeypatch.setattr(source_mod, "_fd_path", lambda fd: b"/elsewhere/f")
    with pytest.raises(OutsideSource):
        src.read_file(b"d/f", True)


def test_an_idle_source_holds_no_descriptor(tmp_path, monkeypatch):
    """Directories remembered for fetches are let go once expired: after drop_idle no
    descriptor of this process points into the source (what the soak checks of the
    daemon once its readers stop)."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"y" * 5)
    src = LocalSource(str(tmp_path))

    def held() -> list[bytes]:
        out = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                p = os.readlink(f"/proc/self/fd/{fd}").encode()
            except OSError:
                continue
            if p == src.root or p.startswith(src._prefix):
                out.append(p)
        return out

    monkeypatch.setattr(DirDescriptors, "TTL_S", 3600.0)  # no expiry while the test runs
    assert src.read_file(b"d/f", True)[0] == b"y" * 5
    assert held()  # the parent directory is remembered
    assert src.drop_idle() == 1  # not expired yet: kept
    monkeypatch.setattr(DirDescriptors, "TTL_S", 0.0)
    assert src.drop_idle() == 0
    assert held() == []
