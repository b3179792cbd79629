"""The systemd unit template (packaging/dlcachefs@.service): ``systemd-analyze verify``
accepts it, and its command lines, expanded as systemd expands them, mount and unmount
a real dlcachefs mount. The container example's command is a valid ``dlcachefs mount``."""

from __future__ import annotations

import configparser
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import requires_fuse

from dlcachefs.cli import build_parser
from dlcachefs.mountctl import is_mounted
from dlcachefs.testing.mounting import wait_until

ROOT = Path(__file__).resolve().parent.parent
UNIT = ROOT / "packaging" / "dlcachefs@.service"
DOCKERFILE = ROOT / "packaging" / "Dockerfile"
VENV_CLI = str(Path(sys.executable).parent / "dlcachefs")


def unit_for_here(tmp_path: Path) -> Path:
    """The template with ExecStart's command where this checkout installed it, and the
    environment file in ``tmp_path``."""
    text = UNIT.read_text().replace("/usr/local/bin/dlcachefs", VENV_CLI)
    text = text.replace("EnvironmentFile=/etc/dlcachefs/%i.env",
                        f"EnvironmentFile={tmp_path}/%i.env")
    out = tmp_path / "units" / "dlcachefs@.service"
    out.parent.mkdir()
    out.write_text(text)
    return out


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_unit_verifies(tmp_path):
    unit = unit_for_here(tmp_path)
    (tmp_path / "mnt-data.env").write_text("SOURCE=/srv/data\nOPTIONS=--cache-size 1G\n")
    instance = unit.parent / "dlcachefs@mnt-data.service"
    shutil.copy(unit, instance)
    for u in (unit, instance):
        r = subprocess.run(["systemd-analyze", "verify", "--man=no", str(u)],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        # unknown keys and bad values are only warned about: none may be
        assert r.stderr.strip() == "", r.stderr


def _service(unit: Path) -> configparser.SectionProxy:
    cp = configparser.ConfigParser(interpolation=None, strict=True)
    cp.optionxform = str  # keys are case-sensitive
    cp.read_string(unit.read_text())
    return cp["Service"]


def _expand(line: str, env: dict[str, str], mnt: str, instance: str) -> list[str]:
    """A command line as systemd expands it: specifiers, ``${VAR}`` as one word,
    ``$VAR`` split at whitespace."""
    words = []
    for w in shlex.split(line.replace("%f", mnt).replace("%i", instance)):
        if w.startswith("${") and w.endswith("}"):
            words.append(env[w[2:-1]])
        elif w.startswith("$") and w[1:] in env:
            words.extend(env[w[1:]].split())
        else:
            words.append(w)
    return words


@requires_fuse
def test_unit_commands_mount_and_unmount(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(5000))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    instance = subprocess.run(["systemd-escape", "--path", str(mnt)], capture_output=True,
                              text=True).stdout.strip() if shutil.which("systemd-escape") \
        else str(mnt).strip("/").replace("/", "-")
    env = {"SOURCE": str(src), "OPTIONS": f"--cache-dir {tmp_path / 'cache'} --cache-size 1G"}
    svc = _service(unit_for_here(tmp_path))
    start = _expand(svc["ExecStart"], env, str(mnt), instance)
    assert "--foreground" in start
    log = open(tmp_path / "daemon.log", "wb")  # noqa: SIM115 - the child keeps it
    proc = subprocess.Popen(start, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        post = _expand(svc["ExecStartPost"], env, str(mnt), instance)
        subprocess.run(post, check=True, timeout=120)  # returns once mounted
        assert is_mounted(mnt)
        assert (mnt / "a.bin").read_bytes() == (src / "a.bin").read_bytes()
        stop = _expand(svc["ExecStop"], env, str(mnt), instance)
        r = subprocess.run(stop, capture_output=True, text=True, timeout=200)
        assert r.returncode == 0, r.stderr
        assert proc.wait(timeout=60) == 0  # the daemon committed and exited
        assert not is_mounted(mnt)
    finally:
        if proc.poll() is None:
            subprocess.run(["fusermount3", "-u", "-z", str(mnt)], capture_output=True)
            proc.terminate()
            proc.wait(timeout=60)
        log.close()
    assert wait_until(lambda: not is_mounted(mnt), "still mounted")


def test_container_example_is_a_valid_mount_command():
    lines = DOCKERFILE.read_text().splitlines()
    instr = {ln.split()[0] for ln in lines if ln.strip() and not ln.startswith("#")
             and not ln.startswith(" ")}
    assert instr <= {"FROM", "RUN", "COPY", "ENV", "WORKDIR", "ENTRYPOINT", "CMD", "VOLUME",
                     "ARG", "LABEL"}, instr
    import json

    entry = json.loads(next(ln for ln in lines if ln.startswith("ENTRYPOINT"))[len("ENTRYPOINT"):])
    cmd = json.loads(next(ln for ln in lines if ln.startswith("CMD"))[len("CMD"):])
    assert entry == ["dlcachefs"]
    a = build_parser().parse_args(cmd)
    assert a.cmd == "mount" and a.foreground
