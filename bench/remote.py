"""A slow remote that is a real network filesystem: sshfs over a veth pair into a network
namespace of our own, optionally rate limited with tbf.

    python -m bench.remote up --export DIR --mount MNT [--rate 400mbit] [--name dlcbench]
    python -m bench.remote down [--name dlcbench]       # idempotent, also after a failed up
    python -m bench.remote status [--name dlcbench]
    python -m bench.remote measure [--files 1000] [--threads 1,8] [--rates none,400mbit]

    with slow_remote("/data/ds", "/mnt/remote", rate="400mbit") as r:
        ...  # read /mnt/remote; r.host, r.user, r.key_file, r.export for sftp clients

``bench/remote_setup.sh`` makes the network half: netns NAME, veth NAME-h (10.233.0.1/30,
host) <-> NAME-n (10.233.0.2/30, in the netns), tbf on both ends when a rate is given,
and an sshd inside the netns with its own config, host key and authorized key in
``/run/dlcbench-remote/NAME`` (root by key only, ``Subsystem sftp internal-sftp``). This
module then mounts the export read-only with sshfs (``-f`` child in its own session, its
pid in the state dir), without ``kernel_cache``: every open drops the file's pages, so
every read goes over the network. The sshd shares the host's files (only the network is
namespaced), so DIR is the same path on both sides.

Nothing here sends a packet anywhere but between 10.233.0.1 and 10.233.0.2, and only
after checking that the route to 10.233.0.2 goes through our own veth.

Mounts are watched and ended with :mod:`dlcachefs.mountctl` (as every mount of the
project). The random test dataset (``ensure_random_files``) is shared with
``bench/passthrough.py`` and ``bench/rclone.py``. Standard library only at import time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

from dlcachefs.mountctl import MountError, end_pid, is_mounted, stop_daemon, wait_mounted

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = os.path.join(REPO, "bench", "remote_setup.sh")
STATE_ROOT = "/run/dlcbench-remote"
HOST_IP = "10.233.0.1"
NS_IP = "10.233.0.2"
DEFAULT_NAME = "dlcbench"
DEFAULT_DATA = "/var/tmp/dlcbench-random"


class RemoteError(RuntimeError):
    pass


def log(msg: str) -> None:
    print(f"[remote {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def route_ok(name: str = DEFAULT_NAME) -> bool:
    """True when 10.233.0.2 is reached through our own veth ``NAME-h`` (never let a
    packet for it leave by the default route)."""
    try:
        out = subprocess.run(["ip", "route", "get", NS_IP], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return f"dev {name}-h " in out


# ----- the remote ----------------------------------------------------------------------------

@dataclass
class Remote:
    name: str
    state_dir: str
    export: str                # the exported directory (same path on both sides)
    mount: str | None          # the sshfs mountpoint (None: network and sshd only)
    rate: str | None           # tbf rate of both directions, None = unshaped
    host: str = NS_IP
    user: str = "root"
    port: int = 22
    key_file: str = ""
    sshfs_pid: int | None = None
    max_conns: int | None = None

    def describe(self) -> dict:
        return asdict(self)


def state_dir(name: str) -> str:
    return os.path.join(STATE_ROOT, name)


def _setup(*args: str) -> None:
    if os.geteuid() != 0:
        raise RemoteError("the slow remote needs root (network namespaces, veth, tc)")
    needed = ("ip", "tc", "ssh", "ssh-keygen", "sshfs", "fusermount3") if args[0] == "up" \
        else ("ip",)
    for tool in needed:
        if not shutil.which(tool):
            raise RemoteError(f"{tool} not found: apt-get install -y iproute2 openssh-server "
                              "openssh-client sshfs fuse3")
    r = subprocess.run(["bash", SETUP, *args], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True)
    for line in (r.stdout + r.stderr).splitlines():
        log(line)
    if r.returncode != 0:
        raise RemoteError(f"remote_setup.sh {args[0]} failed (status {r.returncode})")


def sshfs_supports(option: str) -> bool:
    try:
        text = subprocess.run(["sshfs", "--help"], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return option in (text.stdout + text.stderr)


def up(export: str, mount: str | None, rate: str | None = None, name: str = DEFAULT_NAME,
       max_conns: int | None = 4, sshfs_options: Sequence[str] = ()) -> Remote:
    """Bring the remote up (see the module doc). On any failure everything made so far is
    torn down again and RemoteError is raised."""
    export = os.path.abspath(export)
    if not os.path.isdir(export):
        raise RemoteError(f"export directory does not exist: {export}")
    if mount is not None:
        mount = os.path.abspath(mount)
        os.makedirs(mount, exist_ok=True)
        if is_mounted(mount):
            raise RemoteError(f"{mount} is already a mountpoint")
    rate = None if rate in (None, "", "none") else rate
    sd = state_dir(name)
    _setup("up", name, sd, rate or "none")
    remote = Remote(name=name, state_dir=sd, export=export, mount=mount, rate=rate,
                    key_file=os.path.join(sd, "id_ed25519"))
    try:
        with open(os.path.join(sd, "remote.json"), "w") as f:
            json.dump(remote.describe(), f)
        if not route_ok(name):
            raise RemoteError(f"{NS_IP} is not routed through {name}-h; not connecting")
        if mount is not None:
            _mount_sshfs(remote, max_conns, sshfs_options)
        return remote
    except BaseException:
        with contextlib.suppress(Exception):
            down(name)
        raise


def _mount_sshfs(remote: Remote, max_conns: int | None, extra: Sequence[str]) -> None:
    opts = ["ro", f"IdentityFile={remote.key_file}", "IdentitiesOnly=yes",
            "StrictHostKeyChecking=no", "UserKnownHostsFile=/dev/null", "BatchMode=yes",
            "LogLevel=ERROR", f"fsname=dlcbench-sshfs:{remote.export}"]
    # no kernel_cache (nor auto_cache): the kernel drops a file's pages at each open, so
    # every pass reads over the network
    if max_conns and max_conns > 1:
        if sshfs_supports("max_conns"):
            opts.append(f"max_conns={max_conns}")
        else:
            log("this sshfs has no -o max_conns; using one connection")
            max_conns = 1
    remote.max_conns = max_conns or 1
    opts.extend(extra)
    args = ["sshfs", "-f", "-o", ",".join(opts),
            f"{remote.user}@{remote.host}:{remote.export}", remote.mount]
    logf = open(os.path.join(remote.state_dir, "sshfs.log"), "ab")  # noqa: SIM115
    try:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                start_new_session=True)
    finally:
        logf.close()
    remote.sshfs_pid = proc.pid
    with open(os.path.join(remote.state_dir, "sshfs.pid"), "w") as f:
        f.write(f"{proc.pid}\n")
    with open(os.path.join(remote.state_dir, "remote.json"), "w") as f:
        json.dump(remote.describe(), f)
    try:
        wait_mounted(remote.mount, proc, what="sshfs")
    except MountError as e:
        raise RemoteError(str(e)) from None
    log(f"sshfs pid {proc.pid}: {remote.user}@{remote.host}:{remote.export} on "
        f"{remote.mount} (max_conns={remote.max_conns})")


def down(name: str = DEFAULT_NAME) -> None:
    """Unmount, end the sshfs and sshd this module started (by pid), delete the veth and
    the netns, remove the state dir. Safe to call any number of times, also after a
    partial ``up``. Raises RemoteError when something could not be removed."""
    sd = state_dir(name)
    problems: list[str] = []
    info: dict = {}
    with contextlib.suppress(OSError, ValueError), open(os.path.join(sd, "remote.json")) as f:
        info = json.load(f)
    sshfs_pid = None
    with contextlib.suppress(OSError, ValueError), open(os.path.join(sd, "sshfs.pid")) as f:
        sshfs_pid = int(f.read().strip())
    mnt = info.get("mount")
    if mnt:
        problems += stop_daemon(mnt, None, sshfs_pid, b"sshfs")
    elif sshfs_pid:
        end_pid(sshfs_pid, b"sshfs")
    try:
        _setup("down", name, sd)
    except RemoteError as e:
        problems.append(str(e))
    if not problems:
        shutil.rmtree(sd, ignore_errors=True)
    if problems:
        raise RemoteError("; ".join(problems))


@contextlib.contextmanager
def slow_remote(export_dir: str, mount_dir: str | None, rate: str | None = None,
                name: str = DEFAULT_NAME, max_conns: int | None = 4,
                sshfs_options: Sequence[str] = ()) -> Iterator[Remote]:
    """``up`` on the way in, ``down`` on the way out (also when the body fails).
    ``mount_dir=None`` brings up the network and the sshd only (for rclone's sftp)."""
    remote = up(export_dir, mount_dir, rate=rate, name=name, max_conns=max_conns,
                sshfs_options=sshfs_options)
    try:
        yield remote
    except BaseException:
        try:  # the body's exception is the one to see; a failed cleanup is logged
            down(name)
        except RemoteError as e:
            log(f"down after a failure: {e}")
        raise
    down(name)


# ----- a random test dataset (shared) -------------------------------------------------------

def random_file_list(n: int, per_dir: int = 100, ext: str = ".bin") -> list[str]:
    """Relative paths, in ImageFolder's order (classes ``dNNN`` sorted, files sorted)."""
    return [f"d{i // per_dir:03d}/f{i:06d}{ext}" for i in range(n)]


def ensure_random_files(root: str, n: int, size: int = 110_000, seed: int = 0,
                        per_dir: int = 100, ext: str = ".bin") -> list[str]:
    """``n`` files of ``size`` random bytes under ``root`` (``per_dir`` per folder), made
    once and kept (a file of the right size is reused). Returns the relative paths
    (``ext`` ``.jpg``: an ImageFolder's samples, in its order)."""
    import random

    rels = random_file_list(n, per_dir, ext)
    made = 0
    for i, rel in enumerate(rels):
        p = os.path.join(root, rel)
        with contextlib.suppress(OSError):
            if os.stat(p).st_size == size:
                continue
        os.makedirs(os.path.dirname(p), exist_ok=True)
        data = random.Random(seed * 1_000_003 + i).randbytes(size)
        tmp = p + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, p)
        made += 1
    if made:
        os.sync()
        log(f"made {made} random files of {size} bytes under {root}")
    return rels


def timed_pass(root: str, rels: Sequence[str], threads: int, expected: Sequence[str] | None,
               drop: bool, label: str) -> dict:
    """One pass of ``open().read()`` over ``rels`` under ``root`` with ``threads``
    threads (bench.readers), page cache dropped first when ``drop``. Bytes are checked
    against ``expected`` hashes; mismatches and errors are counted, not raised."""
    from .readers import read_all
    from .util import drop_page_cache

    how = drop_page_cache() if drop else "kept"
    load = os.getloadavg()[0]  # other work on the machine distorts the numbers: say so
    paths = [os.path.join(root, r) for r in rels]
    res = read_all(paths, threads=threads)
    s = res.summary()
    bad = sum(1 for a, b in zip(res.hashes, expected, strict=True) if a != b) if expected else None
    rec = {"label": label, "threads": threads, "page_cache": how,
           "files": s["files"], "files_per_s": s["files_per_s"], "mb_per_s": s["mb_per_s"],
           "wall_s": s["wall_s"], "latency_ms": s["latency_ms"], "errors": s["errors"],
           "mismatches": bad, "reader_cpu_s": s["reader_cpu_s"],
           "loadavg_1m_before": round(load, 2)}
    log(f"{label:<34} threads={threads} {s['files_per_s']:>9} files/s  "
        f"{s['mb_per_s']:>8} MB/s  p50 {s['latency_ms']['p50']} ms  "
        f"errors {s['errors']} mismatches {bad}  load {load:.2f}")
    return rec


def reference_hashes(root: str, rels: Sequence[str]) -> list[str]:
    from .readers import read_all

    res = read_all([os.path.join(root, r) for r in rels], threads=4)
    if res.errors:
        raise RemoteError(f"cannot read the dataset itself: {res.errors[:3]}")
    return res.hashes


def parse_list(text: str, conv=str) -> list:
    return [conv(x) for x in text.split(",") if x.strip()]


# ----- the measurement -------------------------------------------------------------------------

def measure(a: argparse.Namespace) -> dict:
    rels = ensure_random_files(a.data, a.files, a.size)
    expected = reference_hashes(a.data, rels)
    mnt = a.mount or os.path.join(STATE_ROOT + "-mnt", a.name)
    doc = {"bench": "remote-sshfs", "files": len(rels), "file_size": a.size,
           "data": a.data, "max_conns": a.max_conns, "runs": []}
    for rate in parse_list(a.rates):
        rate = None if rate == "none" else rate
        with slow_remote(a.data, mnt, rate=rate, name=a.name, max_conns=a.max_conns) as r:
            for th in parse_list(a.threads, int):
                for phase, drop in (("cold", True), ("warm", False)):
                    rec = timed_pass(mnt, rels, th, expected, drop,
                                     f"sshfs rate={rate or 'none'} {phase}")
                    rec.update(rate=rate or "none", phase=phase, max_conns=r.max_conns)
                    doc["runs"].append(rec)
    return doc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.remote", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up", help="netns + veth + sshd (+ tbf) and an sshfs mount")
    u.add_argument("--export", required=True, help="directory to serve")
    u.add_argument("--mount", help="sshfs mountpoint (omit: network and sshd only)")
    u.add_argument("--rate", default=None, help="tbf rate both ways, e.g. 400mbit (default: none)")
    u.add_argument("--name", default=DEFAULT_NAME)
    u.add_argument("--max-conns", type=int, default=4, help="sshfs -o max_conns (default 4)")
    u.add_argument("-o", dest="sshfs_options", action="append", default=[],
                   help="extra sshfs -o option (repeatable)")
    d = sub.add_parser("down", help="undo up (idempotent)")
    d.add_argument("--name", default=DEFAULT_NAME)
    s = sub.add_parser("status")
    s.add_argument("--name", default=DEFAULT_NAME)
    m = sub.add_parser("measure", help="files/s through the sshfs mount")
    m.add_argument("--data", default=DEFAULT_DATA, help=f"dataset dir (made if missing; default {DEFAULT_DATA})")
    m.add_argument("--files", type=int, default=1000)
    m.add_argument("--size", type=int, default=110_000)
    m.add_argument("--threads", default="1,8")
    m.add_argument("--rates", default="none,400mbit")
    m.add_argument("--max-conns", type=int, default=4)
    m.add_argument("--mount", default=None)
    m.add_argument("--name", default=DEFAULT_NAME)
    m.add_argument("--out", default=None, help="write the JSON here too")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        if a.cmd == "up":
            r = up(a.export, a.mount, rate=a.rate, name=a.name, max_conns=a.max_conns,
                   sshfs_options=a.sshfs_options)
            print(json.dumps(r.describe(), indent=2))
        elif a.cmd == "down":
            down(a.name)
        elif a.cmd == "status":
            subprocess.run(["bash", SETUP, "status", a.name, state_dir(a.name)])
            with contextlib.suppress(OSError):
                with open(os.path.join(state_dir(a.name), "remote.json")) as f:
                    info = json.load(f)
                print(json.dumps(info, indent=2))
                if info.get("mount"):
                    print(f"mounted: {is_mounted(info['mount'])}")
        elif a.cmd == "measure":
            doc = measure(a)
            text = json.dumps(doc, indent=2)
            print(text)
            if a.out:
                from .util import write_json
                write_json(a.out, doc)
    except RemoteError as e:
        print(f"bench.remote: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
