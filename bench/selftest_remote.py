"""Self-test of bench/remote.py, bench/remote_setup.sh, bench/passthrough.py and
bench/rclone.py: they mount what they say, serve the right bytes, and leave nothing behind
(no mount, no process, no netns, no veth), also after failures. No timings are asserted.

    python -m bench.selftest_remote            # prints "N passed, N failed"
    python -m pytest bench/selftest_remote.py  # the same tests under pytest

Needs root, /dev/fuse, iproute2, openssh-server, sshfs and rclone; a test whose tools are
missing is skipped. Uses the remote name ``dlcselftest`` (not the benchmarks' default), on
the same addresses, so it cannot run while another slow remote is up.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import sys
import tempfile
import traceback

from dlcachefs.mountctl import alive, is_mounted, unmount

from .remote import (
    Remote,
    RemoteError,
    down,
    ensure_random_files,
    route_ok,
    slow_remote,
    state_dir,
    up,
)

NAME = "dlcselftest"
FILES = 120
SIZE = 110_000


class Skip(Exception):
    pass


_STANDALONE = False  # set by main(): skip with Skip, not pytest.skip


def _skip(msg: str) -> None:
    if _STANDALONE:
        raise Skip(msg)
    import pytest

    pytest.skip(msg)


def _need(*tools: str) -> None:
    if os.geteuid() != 0:
        _skip("needs root")
    if not os.path.exists("/dev/fuse"):
        _skip("needs /dev/fuse")
    missing = [t for t in tools if not shutil.which(t)]
    if missing:
        _skip(f"missing: {', '.join(missing)}")


def _netns_exists(name: str) -> bool:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return any(line.split()[:1] == [name] for line in out.splitlines())


def _link_exists(dev: str) -> bool:
    return subprocess.run(["ip", "link", "show", "dev", dev], capture_output=True).returncode == 0


def _nothing_left(name: str, mnt: str | None = None) -> None:
    assert not _netns_exists(name), f"netns {name} left behind"
    assert not _link_exists(f"{name}-h"), f"veth {name}-h left behind"
    assert not os.path.exists(state_dir(name)), "state dir left behind"
    assert not route_ok(name)
    if mnt:
        assert not is_mounted(mnt), f"{mnt} left mounted"


@contextlib.contextmanager
def _workdir():
    d = tempfile.mkdtemp(prefix="dlcbench-selftest-", dir="/var/tmp")
    try:
        data = os.path.join(d, "data")
        ensure_random_files(data, FILES, SIZE, seed=7, per_dir=40)
        yield d, data
    finally:
        for sub in ("mnt", "pt", "rc"):
            p = os.path.join(d, sub)
            if is_mounted(p):  # a failed test must not leave a mount under a dir we delete
                unmount(p, lazy="at_once")
        shutil.rmtree(d, ignore_errors=True)


def _same_tree(root: str, data: str) -> None:
    names = sorted(os.listdir(root))
    assert names == sorted(os.listdir(data)), names
    for sub in names:
        for n in sorted(os.listdir(os.path.join(data, sub))):
            with open(os.path.join(root, sub, n), "rb") as f, \
                    open(os.path.join(data, sub, n), "rb") as g:
                assert f.read() == g.read(), f"{sub}/{n} differs"


def _read_only(root: str) -> None:
    try:
        open(os.path.join(root, "new-file"), "wb").close()
    except OSError as e:
        assert e.errno in (errno.EROFS, errno.EACCES, errno.EPERM), e
    else:
        raise AssertionError("a write succeeded on a read-only mount")


# ----- the slow remote ----------------------------------------------------------------------

def test_down_when_nothing_is_up():
    _need("ip", "sshd", "sshfs")
    down(NAME)
    down(NAME)
    _nothing_left(NAME)


def test_remote_serves_the_tree_and_cleans_up():
    _need("ip", "tc", "sshd", "sshfs")
    with _workdir() as (d, data):
        mnt = os.path.join(d, "mnt")
        with slow_remote(data, mnt, rate="400mbit", name=NAME) as r:
            assert isinstance(r, Remote) and is_mounted(mnt)
            assert route_ok(NAME)
            pid = r.sshfs_pid
            assert pid and alive(pid)
            qd = subprocess.run(["tc", "qdisc", "show", "dev", f"{NAME}-h"],
                                capture_output=True, text=True).stdout
            assert "tbf" in qd, qd
            _same_tree(mnt, data)
            _read_only(mnt)
        _nothing_left(NAME, mnt)
        assert not alive(pid), "sshfs still running"


def test_remote_unmounts_when_the_body_fails():
    _need("ip", "sshd", "sshfs")
    with _workdir() as (d, data):
        mnt = os.path.join(d, "mnt")
        try:
            with slow_remote(data, mnt, name=NAME):
                raise KeyError("boom")
        except KeyError:
            pass
        _nothing_left(NAME, mnt)


def test_failed_up_leaves_nothing():
    _need("ip", "sshd", "sshfs")
    with _workdir() as (d, data):
        mnt = os.path.join(d, "mnt")
        try:
            up(data, mnt, name=NAME, sshfs_options=["no_such_sshfs_option_x"])
        except RemoteError:
            pass
        else:
            down(NAME)
            raise AssertionError("up with a bad sshfs option succeeded")
        _nothing_left(NAME, mnt)
        try:  # a bad rate is refused before anything is made
            up(data, mnt, rate="fast", name=NAME)
        except RemoteError:
            pass
        else:
            down(NAME)
            raise AssertionError("up with a bad rate succeeded")
        _nothing_left(NAME, mnt)


def test_down_after_a_partial_up_ends_only_its_own():
    _need("ip")
    sd = state_dir(NAME)
    bystander = subprocess.Popen(["sleep", "60"])  # must survive: not our sshd
    try:
        subprocess.run(["ip", "netns", "add", NAME], check=True)
        subprocess.run(["ip", "link", "add", f"{NAME}-h", "type", "veth", "peer", "name",
                        f"{NAME}-n"], check=True)
        subprocess.run(["ip", "link", "set", f"{NAME}-n", "netns", NAME], check=True)
        os.makedirs(sd, exist_ok=True)
        with open(os.path.join(sd, "sshd.pid"), "w") as f:
            f.write(f"{bystander.pid}\n")
        with open(os.path.join(sd, "sshfs.pid"), "w") as f:
            f.write(f"{bystander.pid}\n")
        down(NAME)
        _nothing_left(NAME)
        assert bystander.poll() is None, "down ended a process it did not start"
    finally:
        bystander.kill()
        bystander.wait()
        with contextlib.suppress(RemoteError):
            down(NAME)


# ----- the passthrough ------------------------------------------------------------------------

def test_passthrough_serves_the_tree_and_cleans_up():
    _need("fusermount3")
    from .passthrough import passthrough_mount

    with _workdir() as (d, data):
        mnt = os.path.join(d, "pt")
        for direct_io in (False, True):
            with passthrough_mount(data, mnt, direct_io=direct_io) as pid:
                assert is_mounted(mnt) and alive(pid)
                _same_tree(mnt, data)
                _same_tree(mnt, data)  # a second pass (cached entries) too
                assert not os.path.exists(os.path.join(mnt, "d000", "nope"))
                assert os.stat(os.path.join(mnt, "d000", "f000000.bin")).st_size == SIZE
                _read_only(mnt)
            assert not is_mounted(mnt) and not alive(pid)


def test_passthrough_unmounts_when_the_body_fails():
    _need("fusermount3")
    from .passthrough import passthrough_mount

    with _workdir() as (d, data):
        mnt = os.path.join(d, "pt")
        pid = None
        try:
            with passthrough_mount(data, mnt) as pid:
                # a file held open does not stop the cleanup (lazy unmount)
                f = open(os.path.join(mnt, "d000", "f000001.bin"), "rb")  # noqa: SIM115
                raise KeyError("boom")
        except KeyError:
            with contextlib.suppress(OSError):  # its daemon is gone by now
                f.close()
        assert pid is not None and not alive(pid)
        assert not is_mounted(mnt)


# ----- rclone -----------------------------------------------------------------------------------

def test_rclone_over_the_remote():
    _need("ip", "sshd", "sshfs", "rclone")
    from .rclone import rclone_mount

    with _workdir() as (d, data):
        rc = os.path.join(d, "rc")
        with slow_remote(data, None, name=NAME) as r:
            for fast in (True, False):
                with rclone_mount("sftp", r, rc, fast=fast) as m:
                    assert is_mounted(rc) and alive(m.pid)
                    assert ("--vfs-fast-fingerprint" in m.args) == fast
                    sub = sorted(os.listdir(data))[0]
                    for n in sorted(os.listdir(os.path.join(data, sub)))[:10]:
                        with open(os.path.join(rc, sub, n), "rb") as f, \
                                open(os.path.join(data, sub, n), "rb") as g:
                            assert f.read() == g.read()
                    _read_only(rc)
                    cache = m.cache_dir
                assert not is_mounted(rc) and not alive(m.pid)
                assert not os.path.exists(cache), "temp cache dir left behind"
        _nothing_left(NAME, rc)


def test_rclone_local_unmounts_when_the_body_fails():
    _need("rclone", "fusermount3")
    from .rclone import rclone_mount

    with _workdir() as (d, data):
        rc = os.path.join(d, "rc")
        pid = None
        try:
            with rclone_mount("local", data, rc) as m:
                pid = m.pid
                _same_tree(rc, data)
                raise KeyError("boom")
        except KeyError:
            pass
        assert pid is not None and not alive(pid) and not is_mounted(rc)


def main() -> int:
    global _STANDALONE
    _STANDALONE = True
    tests = [(k, v) for k, v in globals().items() if k.startswith("test_") and callable(v)]
    passed = failed = skipped = 0
    for name, fn in tests:
        try:
            fn()
        except Skip as e:
            skipped += 1
            print(f"SKIP {name}: {e}", flush=True)
        except Exception:
            failed += 1
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
        else:
            passed += 1
            print(f"ok   {name}", flush=True)
    print(f"{passed} passed, {failed} failed" + (f", {skipped} skipped" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
