"""A peer: Debian's rclone mounting the same slow remote, with its full VFS disk cache.

    with slow_remote(data, None, rate="400mbit") as r:          # network + sshd only
        with rclone_mount("sftp", r, "/mnt/rc", fast=True) as m:
            ...  # read /mnt/rc; m.pid, m.cache_dir

    python -m bench.rclone measure [--files 3000] [--threads 1,8] [--rates none]
                                   [--default-files 150]

``rclone mount --read-only --vfs-cache-mode full`` over an sftp remote given on the fly as
a connection string (rclone >= 1.55; Debian 12 has 1.60):
``:sftp,host=10.233.0.2,user=root,port=22,key_file=KEY:EXPORT``, so no rclone.conf is
needed (``--config`` points at an empty file in a temp dir so that the user's own config
is never read). ``fast=True`` adds ``--vfs-fast-fingerprint --sftp-disable-hashcheck``
(without them rclone runs ``md5sum``/``sha1sum`` over ssh to fingerprint every file it
opens, which is what makes the default so slow). The VFS cache lives in its own temp
``--cache-dir`` (removed afterwards unless one is given).

``remote_kind`` is ``"sftp"`` (``source`` is a :class:`bench.remote.Remote`, or a dict
with host, user, key_file, export) or ``"local"`` (``source`` is a directory: rclone's VFS
over the local filesystem, no network).

rclone runs in the foreground as our child in its own session (so its pid is known);
the context manager waits until it is mounted and on the way out always unmounts
(``fusermount3 -u``) and ends it by its pid if it did not exit by itself.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from dlcachefs.mountctl import MountError, is_mounted, stop_daemon, wait_mounted

from .remote import (
    DEFAULT_DATA,
    STATE_ROOT,
    Remote,
    RemoteError,
    ensure_random_files,
    log,
    parse_list,
    reference_hashes,
    route_ok,
    slow_remote,
    timed_pass,
)

FAST_ARGS = ("--vfs-fast-fingerprint", "--sftp-disable-hashcheck")


@dataclass
class RcloneMount:
    pid: int
    mnt: str
    cache_dir: str
    remote_spec: str
    args: list[str]
    log_path: str


def _spec_value(v: str) -> str:
    # connection string values with , or : must be quoted
    return f'"{v}"' if ("," in v or ":" in v) else v


def remote_spec(remote_kind: str, source) -> str:
    if remote_kind == "local":
        return os.path.abspath(source)
    if remote_kind != "sftp":
        raise ValueError(f"remote_kind must be 'sftp' or 'local', not {remote_kind!r}")
    r = source.describe() if isinstance(source, Remote) else dict(source)
    params = [f"host={r['host']}", f"user={r.get('user', 'root')}",
              f"port={r.get('port', 22)}", f"key_file={_spec_value(r['key_file'])}"]
    return f":sftp,{','.join(params)}:{r['export']}"


@contextlib.contextmanager
def rclone_mount(remote_kind: str, source, mnt: str, fast: bool = True,
                 cache_dir: str | None = None, extra_args: Sequence[str] = (),
                 log_level: str = "NOTICE") -> Iterator[RcloneMount]:
    if not shutil.which("rclone"):
        raise RemoteError("rclone not found: apt-get install -y rclone")
    if remote_kind == "sftp":
        name = source.name if isinstance(source, Remote) else source.get("name", "dlcbench")
        if not route_ok(name):
            raise RemoteError("the slow remote's address is not routed through its own veth; "
                              "is the remote up?")
    mnt = os.path.abspath(mnt)
    os.makedirs(mnt, exist_ok=True)
    if is_mounted(mnt):
        raise RemoteError(f"{mnt} is already a mountpoint")
    tmp = tempfile.mkdtemp(prefix="dlcbench-rclone-", dir="/var/tmp")
    own_cache = cache_dir is None
    cache_dir = cache_dir or os.path.join(tmp, "cache")
    conf = os.path.join(tmp, "rclone.conf")
    open(conf, "w").close()
    log_path = os.path.join(tmp, "rclone.log")
    spec = remote_spec(remote_kind, source)
    args = ["rclone", "mount", spec, mnt, "--config", conf, "--cache-dir", cache_dir,
            "--read-only", "--vfs-cache-mode", "full", "--log-file", log_path,
            "--log-level", log_level]
    if fast:
        args += FAST_ARGS
    args += list(extra_args)
    proc = None
    try:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_mounted(mnt, proc, timeout=60, what="rclone mount")
        except MountError as e:
            with contextlib.suppress(OSError), open(log_path) as f:
                log("rclone log: " + f.read()[-2000:])
            raise RemoteError(str(e)) from None
        yield RcloneMount(pid=proc.pid, mnt=mnt, cache_dir=cache_dir, remote_spec=spec,
                          args=args, log_path=log_path)
    finally:
        if proc is not None:
            problems = stop_daemon(mnt, proc, None, None)
            if problems:
                log(f"rclone: {'; '.join(problems)}")
        if own_cache:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.remove(conf)


# ----- the measurement -----------------------------------------------------------------------

def _du(path: str) -> int:
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, n)).st_blocks * 512
    return total


def measure(a: argparse.Namespace) -> dict:
    rels_all = ensure_random_files(a.data, a.files, a.size)
    expected_all = reference_hashes(a.data, rels_all)
    mnt = a.mount or os.path.join(STATE_ROOT + "-mnt", "rclone")
    doc = {"bench": "rclone", "rclone": _rclone_version(), "files": len(rels_all),
           "file_size": a.size, "data": a.data, "runs": []}
    for rate in parse_list(a.rates):
        rate = None if rate == "none" else rate
        with slow_remote(a.data, None, rate=rate, name=a.name) as remote:
            for fast in (True, False) if a.default_files else (True,):
                n = len(rels_all) if fast else min(a.default_files, len(rels_all))
                rels, expected = rels_all[:n], expected_all[:n]
                opts = "fast" if fast else "default"
                for th in parse_list(a.threads, int):
                    # a fresh mount and an empty cache for every thread count
                    with rclone_mount("sftp", remote, mnt, fast=fast) as m:
                        for phase in ("pass1", "pass2"):
                            rec = timed_pass(mnt, rels, th, expected, True,
                                             f"rclone {opts} rate={rate or 'none'} {phase}")
                            rec.update(rate=rate or "none", options=opts, phase=phase,
                                       cache_bytes_after=_du(m.cache_dir))
                            doc["runs"].append(rec)
                        doc.setdefault("commands", {})[opts] = " ".join(m.args)
    return doc


def _rclone_version() -> str | None:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(["rclone", "version"], capture_output=True, text=True,
                              timeout=30).stdout.splitlines()[0]
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rclone")
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="files/s through rclone mount over the slow remote")
    m.add_argument("--data", default=DEFAULT_DATA)
    m.add_argument("--files", type=int, default=3000)
    m.add_argument("--size", type=int, default=110_000)
    m.add_argument("--threads", default="1,8")
    m.add_argument("--rates", default="none")
    m.add_argument("--default-files", type=int, default=150,
                   help="files read with rclone's default options (slow); 0 skips them")
    m.add_argument("--mount", default=None)
    m.add_argument("--name", default="dlcbench")
    m.add_argument("--out", default=None)
    a = p.parse_args(argv)
    try:
        doc = measure(a)
    except RemoteError as e:
        print(f"bench.rclone: {e}", file=sys.stderr)
        return 1
    print(json.dumps(doc, indent=2))
    if a.out:
        from .util import write_json
        write_json(a.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
