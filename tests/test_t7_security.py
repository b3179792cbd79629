"""The security matrix, mounted: other users (uid 65534 via ``setpriv``), the control
file, symlinks that point out of the source (also swapped in after the scan), odd and
long names, and what one job can see of another. :data:`MATRIX` is the table published
in docs/permissions.md ("The security matrix"); ``test_docs_publish_the_matrix`` checks
that the page holds exactly these rows, and each row's test checks what it says."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from conftest import requires_fuse

from dlcachefs.testing.mounting import drop_page_cache

pytestmark = [requires_fuse,
              pytest.mark.skipif(os.getuid() != 0 or shutil.which("setpriv") is None,
                                 reason="needs root and setpriv to act as another user")]

#: case id -> (case, expected); docs/permissions.md lists these rows in this order
MATRIX: dict[str, tuple[str, str]] = {
    "no-allow-other": ("another user, mount without --allow-other: ls, stat, cat, cat "
                       ".dlcache/stats, write .dlcache/control", "EACCES for each"),
    "modes": ("another user, --allow-other: a 0644 file / a 0600 file / ls of a 0700 "
              "directory / a file in a 0711 directory / ls of it",
              "bytes / EACCES / EACCES / bytes / EACCES (the source's modes, "
              "default_permissions)"),
    "control": ("another user, --allow-other: write or read .dlcache/control, read "
                ".dlcache/errors", "EACCES (0600 and 0400, the mount's owner)"),
    "stats": ("another user, --allow-other: read .dlcache/stats",
              "mount-wide counters only: no streams, no importance"),
    "losses": ("loss values written by a job", "never shown: control shows counts, stats "
               "and errors no values"),
    "abs-link": ("absolute symlink to a file outside the root",
                 "shown as a symlink; the reader's kernel resolves it; the daemon reads nothing"),
    "rel-link": ("relative symlink ../outside/secret", "as above"),
    "dir-link": ("directory symlink to outside, read through", "as above"),
    "dir-swapped": ("a directory replaced by a symlink to outside after the scan",
                    "ENOENT; its outside names are never listed; nothing read"),
    "file-swapped": ("a file replaced by a symlink to outside after the scan",
                     "ESTALE or ENOENT; nothing read"),
    "fifo-swapped": ("a file replaced by a FIFO after the scan",
                     "ESTALE at once (no fetch thread hangs)"),
    "names": ("names with odd bytes (0xff, newline, %, backslash, spaces) and of 255 bytes",
              "listed with the same bytes, read exactly; a 'dataset' line names them "
              "percent-encoded"),
}

OBSERVED = "as expected"


def _nobody(script: str) -> tuple[int, str]:
    """Run ``sh -c script`` as uid/gid 65534 with no groups; (exit status, stderr)."""
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        "sh", "-c", script], capture_output=True, text=True, timeout=60)
    return r.returncode, r.stderr


def _nobody_bytes(path: Path) -> tuple[int, bytes]:
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                        "cat", str(path)], capture_output=True, timeout=60)
    return r.returncode, r.stdout


DENIED = "Permission denied"


@pytest.fixture
def shared(tmp_path):
    """A base directory other users can reach (pytest's are 0700), removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix="dlc-sec-"))
    base.chmod(0o755)
    yield base
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def tree(shared):
    src = shared / "src"
    (src / "open").mkdir(parents=True)
    (src / "open" / "pub.bin").write_bytes(b"public" * 100)
    (src / "open" / "priv.bin").write_bytes(b"private" * 100)
    (src / "open" / "priv.bin").chmod(0o600)
    (src / "closed").mkdir()
    (src / "closed" / "x.bin").write_bytes(b"x")
    (src / "closed").chmod(0o700)
    (src / "traverse").mkdir()
    (src / "traverse" / "t.bin").write_bytes(b"traverse")
    (src / "traverse").chmod(0o711)
    for c in ("c0", "c1"):  # an ImageFolder: a job's dataset
        (src / "img" / c).mkdir(parents=True)
        (src / "img" / c / "a.jpg").write_bytes(c.encode())
    src.chmod(0o755)
    return src


def test_without_allow_other_another_user_gets_eacces_everywhere(tree, shared, mount):
    m = mount(tree, mnt=shared / "mnt")
    for script in (f"ls {m.mnt}", f"stat {m.mnt}/open/pub.bin", f"cat {m.mnt}/open/pub.bin",
                   f"cat {m.mnt}/.dlcache/stats", f"echo 'job x' > {m.mnt}/.dlcache/control"):
        rc, err = _nobody(script)
        assert rc != 0 and DENIED in err, (script, err)
    assert (m.mnt / "open" / "pub.bin").read_bytes() == b"public" * 100  # the owner can


def test_with_allow_other_the_source_modes_are_enforced(tree, shared, mount):
    m = mount(tree, "--allow-other", mnt=shared / "mnt")
    assert "default_permissions" in Path("/proc/self/mountinfo").read_text().split(
        str(m.mnt), 1)[1].split("\n", 1)[0]
    assert _nobody_bytes(m.mnt / "open" / "pub.bin") == (0, b"public" * 100)
    rc, err = _nobody(f"cat {m.mnt}/open/priv.bin")
    assert rc != 0 and DENIED in err
    rc, err = _nobody(f"ls {m.mnt}/closed")
    assert rc != 0 and DENIED in err
    assert _nobody_bytes(m.mnt / "traverse" / "t.bin") == (0, b"traverse")
    rc, err = _nobody(f"ls {m.mnt}/traverse")
    assert rc != 0 and DENIED in err


def test_control_and_errors_are_the_owners(tree, shared, mount):
    m = mount(tree, "--allow-other", mnt=shared / "mnt")
    ctl = m.mnt / ".dlcache" / "control"
    with pytest.raises(OSError):
        ctl.write_text("bogus\n")  # the owner's refusal, in errors
    refused = json.loads(ctl.read_text())["refused_writes"]
    for script in (f"echo 'job x' > {ctl}", f"cat {ctl}", f"cat {m.mnt}/.dlcache/errors"):
        rc, err = _nobody(script)
        assert rc != 0 and DENIED in err, (script, err)
    assert "bogus" in (m.mnt / ".dlcache" / "errors").read_text()
    # the kernel refused the other user's write: it never reached the daemon
    assert json.loads(ctl.read_text())["refused_writes"] == refused


def test_other_users_see_shared_counters_not_the_jobs(tree, shared, mount):
    m = mount(tree, "--allow-other", mnt=shared / "mnt")
    (m.mnt / ".dlcache" / "control").write_text(
        "job private-job\ndataset img\nsampler random seed=3\nepoch 0\n")
    mine = m.stats()
    assert "private-job/0" in mine["streams"]
    rc, out = _nobody_bytes(m.mnt / ".dlcache" / "stats")
    assert rc == 0
    theirs = json.loads(out)
    assert "streams" not in theirs and "importance" not in theirs
    assert "scan_ahead" in mine and "scan_ahead" not in theirs  # trees jobs read
    assert b"private-job" not in out
    assert theirs["files"] == mine["files"] and "hits" in theirs  # the shared counters


def test_loss_values_are_never_shown(tree, shared, mount):
    m = mount(tree, mnt=shared / "mnt")
    ctl = m.mnt / ".dlcache" / "control"
    ctl.write_text("job j\ndataset img\nloss 0 0.123456789 1 7.654321\n")
    with pytest.raises(OSError):
        ctl.write_text("job j\ndataset img\nloss 0 nan\n")
    state = ctl.read_text()
    assert json.loads(state)["jobs"]["j"]["losses"] == 2
    shown = state + json.dumps(m.stats()) + (m.mnt / ".dlcache" / "errors").read_text()
    assert "0.123456789" not in shown and "7.654321" not in shown


# ----- symlinks out of the root --------------------------------------------------------------


@pytest.fixture
def linked(tmp_path):
    src, outside = tmp_path / "src", tmp_path / "outside"
    (src / "d").mkdir(parents=True)
    (src / "d" / "f.bin").write_bytes(b"inside")
    (src / "g.bin").write_bytes(b"g inside")
    (src / "h.bin").write_bytes(b"h inside")
    outside.mkdir()
    (outside / "secret").write_bytes(b"SECRET" * 1000)
    os.symlink(outside / "secret", src / "abs_link")
    os.symlink("../outside/secret", src / "rel_link")
    os.symlink(outside, src / "dir_link")
    return src, outside


def test_symlinks_out_of_the_root_are_the_readers_own(linked, mount):
    """abs-link, rel-link, dir-link: shown as symlinks, resolved by the reader's kernel
    (its own access rights); the daemon reads nothing."""
    src, outside = linked
    m = mount(src)
    assert os.readlink(m.mnt / "abs_link") == str(outside / "secret")
    assert os.readlink(m.mnt / "rel_link") == "../outside/secret"
    assert os.readlink(m.mnt / "dir_link") == str(outside)
    # the reader's own paths: ../outside from the mountpoint is tmp_path/outside here too
    for p in ("abs_link", "dir_link/secret", "rel_link"):
        assert (m.mnt / p).read_bytes() == b"SECRET" * 1000
    st = m.stats()
    assert st["bytes_from_source"] == 0 and st["misses"] == 0


def test_a_directory_swapped_for_a_link_is_never_listed_or_read(linked, mount):
    """Regression: a directory replaced by a symlink after the scan was listed through it
    (the outside directory's names and attributes appeared in the mount) by the next
    revalidation; reads were refused only by the real-path check after opening."""
    src, outside = linked
    m = mount(src, "--revalidate", "0")
    assert os.listdir(m.mnt / "d") == ["f.bin"]
    shutil.rmtree(src / "d")
    os.symlink(outside, src / "d")
    # d's listing finds it gone (ENOENT), or its lookup finds it changed first (its own
    # lstat, at most once a second with --revalidate 0) and re-lists the parent: then d
    # is what it is on the source, a symlink with the same target, which the kernel
    # follows in the reader's own context (out of the mount, as on the source itself).
    # Either way the daemon never lists or reads through it
    try:
        got = sorted(os.listdir(m.mnt / "d"))
    except FileNotFoundError:
        got = None
    assert got in (None, sorted(os.listdir(src / "d")))
    assert os.path.islink(m.mnt / "d") and os.readlink(m.mnt / "d") == str(outside)
    assert (m.mnt / "d" / "secret").read_bytes() == (src / "d" / "secret").read_bytes()
    assert m.stats()["bytes_from_source"] == 0
    assert sorted(os.listdir(m.mnt)) == sorted(os.listdir(src))  # the parent, re-listed


def test_a_file_swapped_for_a_link_or_a_fifo_is_not_followed(linked, mount):
    src, outside = linked
    m = mount(src)  # default --revalidate: the snapshot still says regular files
    (src / "g.bin").unlink()
    os.symlink(outside / "secret", src / "g.bin")
    (src / "h.bin").unlink()
    os.mkfifo(src / "h.bin")
    for name in ("g.bin", "h.bin"):
        with pytest.raises(OSError) as ei:
            (m.mnt / name).read_bytes()
        assert ei.value.errno in (errno.ESTALE, errno.ENOENT), (name, ei.value)
    assert m.stats()["bytes_from_source"] == 0


# ----- names -------------------------------------------------------------------------------------


def test_odd_and_long_names(tmp_path, mount):
    src = tmp_path / "src"
    d = os.fsencode(src / "cls a%b")
    os.makedirs(d)
    names = [b"x" * 255, b"bad_\xff_\xfe", b"new\nline", b"back\\slash", b"100%", b" lead",
             b"...", b"..dots", "é✓".encode()]
    files = {}
    for i, n in enumerate(names):
        files[n] = os.urandom(100 + i)
        with open(os.path.join(d, n), "wb") as f:
            f.write(files[n])
    m = mount(src)
    md = os.fsencode(m.mnt / "cls a%b")
    assert sorted(os.listdir(md)) == sorted(names)
    drop_page_cache()
    for n, data in files.items():
        with open(os.path.join(md, n), "rb") as f:
            assert f.read() == data, n
    (m.mnt / ".dlcache" / "control").write_text("job n\ndataset cls%20a%25b\n")
    assert json.loads((m.mnt / ".dlcache" / "control").read_text())["jobs"]["n"][
        "dataset"] == "cls a%b"
    with pytest.raises(OSError) as ei:
        os.stat(os.path.join(md, b"y" * 256))
    assert ei.value.errno in (errno.ENAMETOOLONG, errno.ENOENT)


# ----- the published matrix -------------------------------------------------------------------


def test_docs_publish_the_matrix():
    readme = (Path(__file__).parent.parent / "docs" / "permissions.md").read_text()
    body = readme.split("<!-- security-matrix -->", 2)[1]
    rows = [line for line in body.splitlines() if line.startswith("| ") and "---" not in line]
    want = [f"| {case} | {expected} | {OBSERVED} (`{cid}`) |"
            for cid, (case, expected) in MATRIX.items()]
    assert rows[1:] == want, "\n".join(want)
