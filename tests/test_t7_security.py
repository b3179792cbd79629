"""The security matrix, mounted: other users (uid 65534 via ``setpriv``), the control
file, symlinks that point out of the source (also swapped in after the scan), odd and
long names, what one job can see of another, and the cache directory's own modes (under
any umask, over a loose directory, with a reader group made by ``groupadd``). :data:`MATRIX` is the table published
in docs/permissions.md ("The security matrix"); ``test_docs_publish_the_matrix`` checks
that the page holds exactly these rows, and each row's test checks what it says."""

from __future__ import annotations

import errno
import grp
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import requires_fuse

from dlcachefs.data.reader import CacheReader
from dlcachefs.testing.mounting import drop_page_cache, wait_until

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
    "umask": ("the daemon started under umask 022: its cache directory and a shared root, "
              "after reads, zero-copy reads and the unmount",
              "nothing readable by group or others: directories 0700, files 0600"),
    "cache-files": ("another user, --allow-other, the cache directory's parent open to all: "
                    "read meta.lmdb/data.mdb, dlcachefs.log, a log file; list the cache "
                    "directory", "EACCES for each"),
    "loose-cache": ("a mount over an existing cache directory made 0755/0644",
                    "tightened to 0700/0600, with a WARNING naming the paths and their "
                    "modes; --keep-cache-modes: left as they are, with the WARNING"),
    "reader-group": ("--reader-group G, a member of G (not the owner): read "
                     "meta.lmdb/data.mdb, a log file, dlcachefs.log; CacheReader over the "
                     "mount", "readable; every sample read from the cache, the same bytes; "
                     "the daemon counts them"),
    "reader-outsider": ("--reader-group G, a user outside G: the same",
                        "EACCES; CacheReader reads through the mount: the same bytes, one "
                        "warning, no traceback"),
    "unknown-group": ("--reader-group with a group that does not exist",
                      "refused at start (exit 2, 'no such group'); nothing created"),
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


# ----- the cache directory's own modes ---------------------------------------------------------

#: the files of a source the zero-copy tests read (readable by every user on the source)
ZC_FILES = ("img/c0/a.jpg", "img/c1/a.jpg", "open/pub.bin")

#: a training process's zero-copy reads of ZC_FILES as another user: the digests and counts
READER = r'''
import hashlib, json, sys, warnings
warnings.simplefilter("always")
from dlcachefs.data.reader import CacheReader
mnt, rels = sys.argv[1], sys.argv[2:]
r = CacheReader.for_path(mnt)
got = {rel: hashlib.sha256(r.read(f"{mnt}/{rel}")).hexdigest() for rel in rels}
got.update({rel: hashlib.sha256(r.read(f"{mnt}/{rel}")).hexdigest() for rel in rels})
print(json.dumps({"digests": got, "counts": r.counts()}))
'''

#: the daemon's warning of a cache directory other users could read (loose-cache)
LOOSE = (r"WARNING dlcachefs: cache directory \S+: \d+ entries could be read or written by "
         r"other users \(\S+ 0755, .*\); (tightened to owner-only|left as they are)")


def _as(groups: list[str], argv: list[str]) -> subprocess.CompletedProcess:
    """Run ``argv`` as uid/gid 65534 with the supplementary ``groups`` (none if empty)."""
    g = [f"--groups={','.join(groups)}"] if groups else ["--clear-groups"]
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", *g, *argv],
                          capture_output=True, text=True, errors="replace", timeout=120)


def _modes(top: Path) -> dict[str, int]:
    """Relative path -> permission bits of ``top`` and everything under it."""
    out = {".": stat.S_IMODE(os.lstat(top).st_mode)}
    for dp, dirs, files in os.walk(top):
        for n in dirs + files:
            p = Path(dp) / n
            out[str(p.relative_to(top))] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


def _loosen(top: Path) -> None:
    for p in [top, *top.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)


def _cache_files(cache: Path) -> list[Path]:
    """The index, a log file and the daemon's log of a cache directory."""
    return [cache / "meta.lmdb" / "data.mdb", min((cache / "logs").glob("*.log")),
            cache / "dlcachefs.log"]


def _warm(m, tree: Path) -> None:
    """Read ZC_FILES through the mount and wait until they are cached."""
    for rel in ZC_FILES:
        assert (m.mnt / rel).read_bytes() == (tree / rel).read_bytes()
    m.wait_cached(len(ZC_FILES))


@pytest.fixture
def reader_group():
    """A group made for the test (``groupadd``), removed afterwards: (name, gid)."""
    if shutil.which("groupadd") is None:
        pytest.skip("needs groupadd")
    name = f"dlc-rd-{os.getpid()}"
    subprocess.run(["groupadd", name], check=True, capture_output=True, timeout=60)
    try:
        yield name, grp.getgrnam(name).gr_gid
    finally:
        subprocess.run(["groupdel", name], capture_output=True, timeout=60)


def test_a_daemon_under_umask_022_makes_nothing_others_can_read(tree, shared, mount):
    """umask: a cache directory and a shared root, after reads (logs), zero-copy reads
    (counter files), a ledger's rewrites and the unmount (the clean marker)."""
    old = os.umask(0o022)
    try:
        plain = mount(tree, mnt=shared / "mnt", cache=shared / "cache")
        root = mount(tree, "--shared-cache", "--dataset", "d1", "--share-interval", "0.2",
                     mnt=shared / "mnt2", cache=shared / "root")
    finally:
        os.umask(old)
    for m in (plain, root):
        _warm(m, tree)
        reader = CacheReader.for_path(m.mnt)
        assert reader is not None and reader.read(m.mnt / ZC_FILES[0]) == (
            tree / ZC_FILES[0]).read_bytes()
        assert reader.counts()["hits"] == 1
        reader.close()
    wait_until(lambda: (shared / "root" / "ledger.json").exists(), "no ledger written")
    plain.umount()
    root.umount()
    made = {"cache": ["dlcachefs.log", "lock", "meta.lmdb/data.mdb", "meta.lmdb/lock.mdb",
                      "meta.lmdb.clean", "logs/00000001.log", "zerocopy"],
            "root": ["ledger.json", "ledger.lock", "datasets/d1/meta.lmdb/data.mdb",
                     "datasets/d1/dlcachefs.log", "datasets/d1/meta.lmdb.clean",
                     "datasets/d1/logs/00000001.log", "datasets/d1/zerocopy"]}
    for name, entries in made.items():
        top = shared / name
        modes = _modes(top)
        assert set(entries) <= set(modes), modes
        want = {k: 0o700 if (top / k).is_dir() else 0o600 for k in modes}
        assert modes == want, top


def test_another_user_cannot_read_the_cache_directory(tree, shared, mount):
    """cache-files: only the cache directory's own modes stand between another user and
    it here (its parent is open to all, and the mount lets other users in)."""
    cache = shared / "cache"
    m = mount(tree, "--allow-other", mnt=shared / "mnt", cache=cache)
    _warm(m, tree)
    assert _nobody_bytes(m.mnt / "open" / "pub.bin") == (0, b"public" * 100)  # the mount's
    for f in _cache_files(cache):
        rc, err = _nobody(f"cat {f}")
        assert rc != 0 and DENIED in err, (f, err)
    rc, err = _nobody(f"ls {cache}")
    assert rc != 0 and DENIED in err


@pytest.mark.daemon_log_allows(LOOSE)
def test_a_loose_cache_directory_is_tightened_with_a_warning(tree, shared, mount):
    """loose-cache: made 0755/0644 by hand (or another umask, or an older version)."""
    cache = shared / "cache"
    m = mount(tree, mnt=shared / "m1", cache=cache)
    _warm(m, tree)
    m.umount()
    _loosen(cache)
    loose = _modes(cache)
    assert _nobody_bytes(cache / "meta.lmdb" / "data.mdb")[0] == 0  # readable by all now
    m = mount(tree, "--keep-cache-modes", mnt=shared / "m2", cache=cache)
    assert (m.mnt / ZC_FILES[0]).read_bytes() == (tree / ZC_FILES[0]).read_bytes()
    m.umount()
    # left (but the clean marker, which the stop wrote anew: owner-only)
    del loose["meta.lmdb.clean"]
    assert {k: v for k, v in _modes(cache).items() if k in loose} == loose
    assert _modes(cache)["meta.lmdb.clean"] == 0o600
    kept = m.log.read_text()
    assert f"cache directory {cache}: " in kept and "left as they are (--keep-cache-modes)" in kept
    m = mount(tree, mnt=shared / "m3", cache=cache)
    log = m.log.read_text()
    warned = next(line for line in log.splitlines() if "could be read or written" in line)
    assert f"entries could be read or written by other users ({cache} 0755, " in warned
    assert "tightened to owner-only (directories 0700, files 0600)" in warned
    modes = _modes(cache)
    assert modes == {k: 0o700 if (cache / k).is_dir() else 0o600 for k in modes}
    rc, err = _nobody(f"cat {cache}/meta.lmdb/data.mdb")
    assert rc != 0 and DENIED in err
    assert (m.mnt / ZC_FILES[1]).read_bytes() == (tree / ZC_FILES[1]).read_bytes()


def test_a_reader_group_member_reads_the_cache_an_outsider_does_not(tree, shared, mount,
                                                                   reader_group):
    """reader-group and reader-outsider: the same mount, a member of the group and a user
    outside it (both uid 65534, not the owner)."""
    name, gid = reader_group
    cache = shared / "cache"
    m = mount(tree, "--allow-other", "--reader-group", name, mnt=shared / "mnt", cache=cache)
    _warm(m, tree)
    want = {rel: hashlib.sha256((tree / rel).read_bytes()).hexdigest() for rel in ZC_FILES}
    member, outsider = [str(gid)], []
    assert (os.stat(cache).st_gid, stat.S_IMODE(os.stat(cache).st_mode)) == (gid, 0o2750)
    for f in _cache_files(cache):
        r = _as(member, ["cat", str(f)])
        assert r.returncode == 0, (f, r.stderr)
        r = _as(outsider, ["cat", str(f)])
        assert r.returncode != 0 and DENIED in r.stderr, (f, r.stderr)
    before = m.stats()["zerocopy"]["hits"]
    r = _as(member, [sys.executable, "-c", READER, str(m.mnt), *ZC_FILES])
    assert r.returncode == 0 and r.stderr == "", r.stderr
    doc = json.loads(r.stdout)
    assert doc["digests"] == want
    assert doc["counts"]["hits"] == 2 * len(ZC_FILES) and doc["counts"]["errors"] == 0, doc
    # the daemon read the member's counter file (made in zerocopy/, the group's)
    m.wait_stats(lambda s: s["zerocopy"]["hits"] == before + 2 * len(ZC_FILES),
                 "the member's zero-copy reads were not counted by the daemon")
    r = _as(outsider, [sys.executable, "-c", READER, str(m.mnt), *ZC_FILES])
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    doc = json.loads(r.stdout)
    assert doc["digests"] == want  # through the mount
    assert doc["counts"]["hits"] == 0 and doc["counts"]["errors"] == 2 * len(ZC_FILES)
    warned = [line for line in r.stderr.splitlines() if "Warning" in line]
    assert len(warned) == 1 and "may not read the cache directory" in warned[0], r.stderr


def test_an_unknown_reader_group_is_refused_at_start(tree, shared):
    """unknown-group: a config error, before anything is made."""
    (shared / "mnt").mkdir()
    r = subprocess.run([sys.executable, "-m", "dlcachefs.cli", "mount", str(tree),
                        str(shared / "mnt"), "--cache-dir", str(shared / "cache"),
                        "--reader-group", "no-such-group-dlc"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert r.stderr == "dlcachefs: --reader-group no-such-group-dlc: no such group\n"
    assert not (shared / "cache").exists()


# ----- the published matrix -------------------------------------------------------------------


def test_docs_publish_the_matrix():
    readme = (Path(__file__).parent.parent / "docs" / "permissions.md").read_text()
    body = readme.split("<!-- security-matrix -->", 2)[1]
    rows = [line for line in body.splitlines() if line.startswith("| ") and "---" not in line]
    want = [f"| {case} | {expected} | {OBSERVED} (`{cid}`) |"
            for cid, (case, expected) in MATRIX.items()]
    assert rows[1:] == want, "\n".join(want)
