"""Tier 1: dlcachefs.mountctl without a kernel mount: the mount table, the unmount fallback
(against a fake fusermount3), waiting for a mount, ending a daemon by pid."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from dlcachefs import mountctl
from dlcachefs.mountctl import MountError, Unmounted


def test_mount_table_unescapes_and_keeps_the_last():
    table = mountctl.parse_mount_table(
        b"proc /proc proc rw 0 0\n"
        b"dlcachefs /mnt/a\\040b\\134c fuse.dlcachefs rw,nosuid 0 0\n"
        b"dlcachefs /mnt/donn\xc3\xa9es fuse.dlcachefs rw 0 0\n"
        b"tmpfs /mnt/x tmpfs rw 0 0\n"
        b"sshfs /mnt/x fuse.sshfs ro 0 0\n"
        b"short line\n")
    assert table["/mnt/a b\\c"] == "fuse.dlcachefs"
    assert table["/mnt/données"] == "fuse.dlcachefs"
    assert table["/mnt/x"] == "fuse.sshfs"  # mounted over the tmpfs: the visible one
    assert "short" not in table and len(table) == 4


def test_is_mounted(monkeypatch, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real", target_is_directory=True)
    (tmp_path / "real").mkdir()
    table = {str(tmp_path / "real" / "mnt"): "fuse.dlcachefs", "/mnt/disk": "ext4"}
    monkeypatch.setattr(mountctl, "mount_table", lambda: table)
    assert mountctl.is_mounted(tmp_path / "real" / "mnt", fuse=True)
    assert mountctl.is_mounted(link / "mnt")  # the kernel names it by its real parent
    assert mountctl.is_mounted("/mnt/disk") and not mountctl.is_mounted("/mnt/disk", fuse=True)
    assert not mountctl.is_mounted("/mnt/none")
    assert mountctl.mounts_of("fuse.dlcachefs") == [str(tmp_path / "real" / "mnt")]


@pytest.fixture
def fusermount(tmp_path, monkeypatch):
    """A fake fusermount3 on PATH: it records its arguments; a plain unmount fails with
    $PLAIN_ERR when set, a lazy one with $LAZY_ERR."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    script = bin_dir / "fusermount3"
    script.write_text(f"""#!/bin/sh
echo "$*" >> {calls}
case "$*" in
  *-z*) [ -n "$LAZY_ERR" ] && {{ echo "$LAZY_ERR" >&2; exit 1; }} ;;
  *) [ -n "$PLAIN_ERR" ] && {{ echo "$PLAIN_ERR" >&2; exit 1; }} ;;
esac
exit 0
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("PLAIN_ERR", raising=False)
    monkeypatch.delenv("LAZY_ERR", raising=False)

    def read() -> list[str]:
        got = calls.read_text().splitlines() if calls.exists() else []
        calls.unlink(missing_ok=True)
        return got

    return read


BUSY = "fusermount3: failed to unmount /m: Device or resource busy"


def test_unmount_fallbacks(fusermount, monkeypatch):
    assert mountctl.unmount("/m") == Unmounted(True)
    assert fusermount() == ["-u /m"]
    monkeypatch.setenv("PLAIN_ERR", BUSY)
    assert mountctl.unmount("/m") == Unmounted(True, lazy=True)
    assert fusermount() == ["-u /m", "-u -z /m"]
    assert mountctl.unmount("/m", lazy="never") == Unmounted(False, error=BUSY)
    assert fusermount() == ["-u /m"]
    monkeypatch.setenv("PLAIN_ERR", "fusermount3: entry for /m not found")
    assert mountctl.unmount("/m") == Unmounted(False, error="fusermount3: entry for /m not found")
    assert fusermount() == ["-u /m"]  # not busy: no lazy detach
    assert mountctl.unmount("/m", lazy="if_failed") == Unmounted(True, lazy=True)
    assert fusermount() == ["-u /m", "-u -z /m"]
    monkeypatch.setenv("LAZY_ERR", "no")
    assert mountctl.unmount("/m", lazy="at_once") == Unmounted(False, error="no")
    assert fusermount() == ["-u -z /m"]


def test_wait_mounted(monkeypatch, tmp_path):
    mounted = {"n": 0}

    def table() -> dict[str, str]:
        mounted["n"] += 1
        return {"/m": "fuse.x"} if mounted["n"] > 3 else {}

    monkeypatch.setattr(mountctl, "mount_table", table)
    answers = iter([OSError("not yet"), {}, {"pid": 1}])

    def ready():
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    assert mountctl.wait_mounted("/m", ready=ready, interval=0.001) >= 0
    monkeypatch.setattr(mountctl, "mount_table", dict)
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    with pytest.raises(MountError, match="exited with status 3 before /m was mounted"):
        mountctl.wait_mounted("/m", proc, timeout=60, what="x", interval=0.01)
    with pytest.raises(MountError, match="not mounted after 0.05 s"):
        mountctl.wait_mounted("/m", timeout=0.05, interval=0.01)


def test_ending_processes():
    code = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "print('ready', flush=True); time.sleep(60)")
    stubborn = subprocess.Popen([sys.executable, "-c", code, "marker"], stdout=subprocess.PIPE)
    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert stubborn.stdout.readline() == b"ready\n"  # SIGTERM is ignored from now on
        assert mountctl.alive(polite.pid) and mountctl.cmdline(polite.pid)
        assert not mountctl.wait_gone(polite.pid, 0.05)
        assert mountctl.end_child(polite, grace=30) is False and polite.returncode == -15
        assert not mountctl.alive(polite.pid)
        # not its command line: left alone
        assert mountctl.end_pid(stubborn.pid, must_contain=b"no such marker")
        assert stubborn.poll() is None
        assert mountctl.end_pid(stubborn.pid, must_contain=b"marker", grace=0.2)  # SIGKILL
        assert stubborn.wait(timeout=30) == -9
        assert mountctl.end_pid(stubborn.pid)  # gone already
    finally:
        for p in (stubborn, polite):
            if p.poll() is None:
                p.kill()
                p.wait()
        stubborn.stdout.close()


@pytest.mark.parametrize("mounted", [[], ["/mnt/imagenet"]])
def test_run_says_when_no_mount_would_hear_the_training(monkeypatch, capsys, mounted):
    """`dlcachefs run` with no dlcachefs mount at all: the hook would announce nothing,
    so the launcher says it once instead of running silently; with a mount, nothing."""
    from dlcachefs import cli  # noqa: PLC0415

    ran = []
    monkeypatch.setattr(cli.mountctl, "mounts_of", lambda fstype: list(mounted))
    monkeypatch.setattr(cli.os, "execvpe", lambda *a: ran.append(a))
    cli.cmd_run(["--", "python3", "train.py"], None)
    assert ran and ran[0][1] == ["python3", "train.py"]
    err = capsys.readouterr().err
    assert ("no dlcachefs mount" in err) is (not mounted)
