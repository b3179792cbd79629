"""Command line: ``dlcachefs mount|umount|stats|verify`` and the ``mount.dlcachefs`` helper.

Only the ``mount`` command imports the FUSE layer (lazily), so ``stats``/``verify`` work
where pyfuse3 is not installed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import sys

from dlcachefs import mountctl
from dlcachefs.admin.commands import ADMIN_COMMANDS, add_admin_commands, run_admin_command
from dlcachefs.clairvoyance.protocol import ENV_LAUNCHED
from dlcachefs.config import (
    DATASETS_DIR,
    OPTIONS,
    Config,
    Option,
    build_config,
    option,
    read_config_file,
)
from dlcachefs.errors import DlcError
from dlcachefs.store import ledger
from dlcachefs.store import modes as cache_modes
from dlcachefs.units import format_size, parse_size


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dlcachefs", description=(
        "A read-only FUSE mirror of a slow dataset directory, cached on local disk."))
    sub = p.add_subparsers(dest="cmd", required=True)

    m = sub.add_parser("mount", help="mount SOURCE at MOUNTPOINT")
    m.add_argument("source")
    m.add_argument("mountpoint")
    m.add_argument("--config", metavar="FILE",
                   help="TOML file of the options below (cache_size = \"500G\", rescan = "
                        "true, ...); the command line overrides it")
    add_config_options(m)

    u = sub.add_parser("umount", help="unmount (lazily if files are open) and wait for the commit")
    u.add_argument("mountpoint")
    u.add_argument("--timeout", type=float, default=120.0)

    s = sub.add_parser("stats", help="show a mount's statistics: a short summary (what was "
                                     "served from where, each stream, warnings)")
    s.add_argument("mountpoint")
    s.add_argument("--all", action="store_true", help="print every key of the stats as a "
                                                      "table (latency histograms included)")
    s.add_argument("--json", action="store_true", help="print the raw JSON")

    add_admin_commands(sub)

    r = sub.add_parser("run", help="run a training command with the sampler hook installed "
                                   "(no edit to the script)")
    r.add_argument("--job", help="job name announced to the mount (default: 'default')")
    r.add_argument("--no-intercept", action="store_true",
                   help="read every file through the mount (by default, read-only binary "
                        "opens of cached files are served in the training's processes: "
                        "docs/reading.md)")
    r.add_argument("--workers", metavar="auto[:MIN-MAX]",
                   help="set each DataLoader's num_workers at the start of every epoch from "
                        "the last epoch's measurements (DLCache's Algorithm 2), within "
                        "MIN-MAX (auto:2-8, auto:2-, auto:-8; default 0 to the cores): "
                        "docs/operating.md")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- python train.py ...")

    sm = sub.add_parser("simulate", help="replay an access trace against every caching "
                                          "policy and cache size, with Belady's bound")
    sm.add_argument("--trace", help="trace file (JSON, see dlcachefs.sim.simulate); default: "
                                    "generate one from the sampler settings below")
    sm.add_argument("--sampler", default="random", choices=["random", "distributed", "iis"],
                    help="generated trace: torch's orders, or iCACHE's importance sampling")
    sm.add_argument("--samples", type=int, default=5000)
    sm.add_argument("--epochs", type=int, default=6)
    sm.add_argument("--seed", type=int, default=0)
    sm.add_argument("--classes", type=int, default=10)
    sm.add_argument("--cache", default="0.1,0.2,0.4,0.6,0.8",
                    help="cache sizes as fractions of the dataset's bytes")
    sm.add_argument("--policies", default="all", help="comma-separated specs, or 'all'")
    sm.add_argument("--chunk-size", type=_size, default="0",
                    help="unit size for policies that use the chunk size (0: one sample)")
    sm.add_argument("--substitute", action="store_true", help="let icache substitute")
    sm.add_argument("--h-fraction", type=float, default=0.7)
    sm.add_argument("--json", metavar="FILE", help="also write the results as JSON")

    v = sub.add_parser("verify", help="check every cached record against its checksum (fsck)")
    v.add_argument("--cache-dir", required=True)
    v.add_argument("--repair", action="store_true", help="drop damaged records and chunks")
    v.add_argument("--json", action="store_true")
    return p


def add_config_options(p: argparse.ArgumentParser) -> None:
    """One option per Config field (dlcachefs.config.OPTIONS). Defaults are SUPPRESSed: the
    namespace holds only what the command line set, so build_config can apply the rule
    command line > --config file > defaults."""
    for o in OPTIONS:
        names = [o.flag, o.short] if o.short else [o.flag]
        if o.kind == "flag":
            p.add_argument(*names, dest=o.field, action="store_const", const=o.const,
                           default=argparse.SUPPRESS, help=o.help_text())
        else:
            p.add_argument(*names, dest=o.field, type=_value_parser(o), metavar=o.metavar,
                           choices=o.choices, default=argparse.SUPPRESS, help=o.help_text())


def _value_parser(o: Option):
    """argparse's type= for ``o``: Option.parse, its ValueError shown as the reason."""

    def parse(text: str):
        try:
            return o.parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse


def config_from_args(a: argparse.Namespace) -> Config:
    # the plugins alone (pure Python), not the session: the core's imports (numpy starts
    # threads) would come before the daemon forks
    from dlcachefs.policies import make_policy  # noqa: PLC0415 - a bad --policy fails here

    cli = {o.field: getattr(a, o.field) for o in OPTIONS if hasattr(a, o.field)}
    file = read_config_file(a.config) if a.config else None
    cfg = build_config(a.source, a.mountpoint, cli, file)
    make_policy(cfg.policy)
    try:  # an unknown --reader-group: refused here, before the daemon forks
        cache_modes.reader_group(cfg.reader_group)
    except DlcError as e:
        raise ValueError(str(e)) from None
    if cfg.peers is not None and importlib.util.find_spec("pymemcache") is None:
        raise ValueError("--peers needs pymemcache: pip install 'dlcachefs[peers]'")
    if cfg.metrics_port and importlib.util.find_spec("prometheus_client") is None:
        raise ValueError("--metrics-port needs prometheus-client: pip install 'dlcachefs[ops]'")
    return cfg


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        if a.cmd == "mount":
            return cmd_mount(config_from_args(a))
        if a.cmd == "umount":
            return cmd_umount(a.mountpoint, a.timeout)
        if a.cmd == "stats":
            return cmd_stats(a.mountpoint, a.json, a.all)
        if a.cmd == "run":
            return cmd_run(a.command, a.job, intercept=not a.no_intercept,
                           workers=a.workers)
        if a.cmd == "simulate":
            return cmd_simulate(a)
        if a.cmd in ADMIN_COMMANDS:
            return run_admin_command(a)
        if a.cmd == "verify":
            from dlcachefs.store.verify import cmd_verify  # noqa: PLC0415

            # what --repair makes in the cache directory (a new index, the note of a
            # damaged one set aside) is the owner's, as what the daemon makes there
            os.umask(cache_modes.daemon_umask(False))
            return cmd_verify(a.cache_dir, a.repair, a.json,
                              is_mounted=lambda mp: mountctl.is_mounted(mp, fuse=True))
    except ValueError as e:
        print(f"dlcachefs: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `dlcachefs stats MNT | head`: the reader left; no traceback, and none at exit
        # when Python flushes stdout again (the descriptor now goes nowhere)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 2


def cmd_simulate(a: argparse.Namespace) -> int:
    """Print the hit-ratio table (and write JSON) of every policy at every cache size."""
    import json  # noqa: PLC0415

    from dlcachefs.clairvoyance.trace import load_trace  # noqa: PLC0415
    from dlcachefs.session import policies  # noqa: PLC0415
    from dlcachefs.sim.simulate import generate_trace, simulate, table  # noqa: PLC0415

    trace = load_trace(a.trace) if a.trace else generate_trace(
        a.samples, a.epochs, a.sampler, a.seed, a.classes)
    fracs = [float(x) for x in a.cache.split(",") if x.strip()]
    if not fracs or any(not 0 < f <= 1 for f in fracs):
        raise ValueError("--cache takes fractions within (0, 1]")
    pols = sorted(policies()) if a.policies == "all" else [
        p.strip() for p in a.policies.split(",") if p.strip()]
    res = simulate(trace, pols, fracs, chunk_size=a.chunk_size, substitute=a.substitute,
                   h_fraction=a.h_fraction)
    res["trace"] = a.trace or {"sampler": a.sampler, "samples": a.samples,
                               "epochs": a.epochs, "seed": a.seed}
    print(f"{res['samples']} samples, {res['epochs']} epochs, {res['accesses']} accesses, "
          f"{res['dataset_bytes'] / 1e9:.2f} GB; hit ratio (GB read from the source)")
    print(table(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


# ----- mount --------------------------------------------------------------------------

def _progress_printer():
    tty = sys.stderr.isatty()
    shown = False

    def show(line: str) -> None:
        nonlocal shown
        _, entries, dirs, elapsed = line.split()
        if tty:
            sys.stderr.write(f"\rscanning source: {int(entries):,} entries in "
                             f"{int(dirs):,} directories ({float(elapsed):.0f} s)")
            sys.stderr.flush()
            shown = True

    def done() -> None:
        if shown:
            sys.stderr.write("\n")

    return show, done


def _non_empty(path: str) -> bool:
    try:
        with os.scandir(path) as it:
            return any(True for _ in it)
    except OSError:
        return False  # missing or unreadable: the daemon refuses it with the reason


def _warn_disk_short(cfg: Config) -> None:
    """Say at mount when the cache disk has less free space than ``--min-free``: the
    mount works, but a new cache would keep nothing (the floor is never given up)."""
    d = os.path.abspath(cfg.cache_dir)
    while not os.path.exists(d) and os.path.dirname(d) != d:
        d = os.path.dirname(d)
    try:
        free = shutil.disk_usage(d).free
    except OSError:
        return
    if cfg.min_free > 0 and free < cfg.min_free:
        print(f"dlcachefs: warning: the cache disk has {format_size(free)} free, under "
              f"--min-free {format_size(cfg.min_free)}: files are cached only in room that "
              f"evictions free (none, in a new cache); lower --min-free or give --cache-dir "
              f"more room", file=sys.stderr)


def cmd_mount(cfg: Config) -> int:
    if not os.path.isdir(cfg.source):
        what = "is not a directory" if os.path.exists(cfg.source) else "does not exist"
        print(f"dlcachefs: source {what}: {cfg.source}", file=sys.stderr)
        return 1
    try:  # before anything is created in it (the daemon checks again, under its lock)
        mountctl.check_apart(cfg.source, cfg.mountpoint, cfg.cache_dir)
        ledger.check_root(cfg.cache_dir, cfg.shared_cache, DATASETS_DIR)
    except DlcError as e:
        print(f"dlcachefs: cannot mount: {e}", file=sys.stderr)
        return 1
    _warn_disk_short(cfg)
    if not os.path.ismount(cfg.mountpoint) and _non_empty(cfg.mountpoint):
        # allowed, as FUSE 3 and gcsfuse allow it; but said (a mount point in use is
        # refused by the daemon, with that reason)
        print(f"dlcachefs: warning: mountpoint {cfg.mountpoint} is not empty: its files "
              f"are hidden while mounted", file=sys.stderr)
    if cfg.foreground:
        from dlcachefs.mount import daemon  # noqa: PLC0415

        show, done = _progress_printer()

        def report(line: str) -> None:
            if line.startswith("progress"):
                show(line)
            elif line.startswith("error"):
                done()
                print(f"dlcachefs: {line[6:]}", file=sys.stderr)
            elif line == "ready":
                done()
                print(f"dlcachefs: mounted {cfg.source} at {cfg.mountpoint}", file=sys.stderr)

        daemon.begin(cfg)
        return daemon.run(cfg, report)
    return _daemonize(cfg)


def _daemonize(cfg: Config) -> int:
    """Fork a daemon and wait until it reports that the mount is ready (or failed)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: new session, fork again so the daemon is not a session leader
        os.close(r)
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        os.chdir("/")
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        wf = os.fdopen(w, "w", buffering=1)

        def report(line: str) -> None:
            try:
                wf.write(line + "\n")
                if line == "ready" or line.startswith("error"):
                    wf.close()
            except (OSError, ValueError):
                pass  # the parent is gone; keep serving

        code = 1
        try:
            from dlcachefs.mount import daemon  # noqa: PLC0415

            daemon.begin(cfg)
            code = daemon.run(cfg, report)
        except BaseException as e:  # noqa: BLE001 - last resort: say why before dying
            report(f"error {type(e).__name__}: {e}")
        finally:
            os._exit(code)
    os.close(w)
    os.waitpid(pid, 0)
    show, done = _progress_printer()
    with os.fdopen(r) as rf:
        for line in rf:
            line = line.rstrip("\n")
            if line.startswith("progress"):
                show(line)
            elif line == "ready":
                done()
                print(f"dlcachefs: mounted {cfg.source} at {cfg.mountpoint} "
                      f"(cache {cfg.data_dir})", file=sys.stderr)
                return 0
            elif line.startswith("error"):
                done()
                print(f"dlcachefs: cannot mount: {line[6:]}", file=sys.stderr)
                return 1
    done()
    print("dlcachefs: the daemon exited before the mount was ready; see "
          f"{os.path.join(cfg.data_dir, 'dlcachefs.log')}", file=sys.stderr)
    return 1


# ----- run ------------------------------------------------------------------------------

def cmd_run(command: list[str], job: str | None, intercept: bool = True,
            workers: str | None = None) -> int:
    """exec ``command`` with ``dlcachefs/data/_boot`` (a sitecustomize) first on PYTHONPATH
    (``intercept``: opens of cached files served in the process, :mod:`dlcachefs.data.intercept`;
    ``workers``: ``auto[:MIN-MAX]``, :mod:`dlcachefs.data.autoworkers`)."""
    if workers is not None:
        from dlcachefs.data.autoworkers import parse  # noqa: PLC0415

        try:
            parse(workers)  # checked here too: the training's hook would only warn
        except ValueError as e:
            print(f"dlcachefs run: {e}", file=sys.stderr)
            return 2
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("dlcachefs run: no command (usage: dlcachefs run -- python train.py ...)",
              file=sys.stderr)
        return 2
    if not mountctl.mounts_of("fuse.dlcachefs"):
        # the hook would announce nothing: say so once, here, rather than run silently
        print("dlcachefs run: warning: no dlcachefs mount is mounted here: the training "
              "runs as it would without the launcher (mount the dataset first: "
              "dlcachefs mount SOURCE MOUNTPOINT)", file=sys.stderr)
    boot = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "_boot")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (boot, env.get("PYTHONPATH")) if p)
    env[ENV_LAUNCHED] = "1"
    env["DLCACHEFS_INTERCEPT"] = "1" if intercept else "0"
    if job:
        env["DLCACHEFS_JOB"] = job
    if workers is not None:
        env["DLCACHEFS_WORKERS"] = workers
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        print(f"dlcachefs run: cannot run {command[0]}: {e.strerror}", file=sys.stderr)
        return 127
    return 0  # unreachable


# ----- umount -------------------------------------------------------------------------

def cmd_umount(mountpoint: str, timeout: float) -> int:
    mountpoint = os.path.abspath(mountpoint)
    if not mountctl.is_mounted(mountpoint):
        print(f"dlcachefs: {mountpoint} is not mounted", file=sys.stderr)
        return 1
    from dlcachefs.admin import dlcachedir  # noqa: PLC0415

    try:
        pid = dlcachedir.stats(mountpoint).get("pid")
    except dlcachedir.NotAMount:  # a daemon killed: its stale mount is cleared all the same
        pid = None
    # a plain unmount; lazily when files are open (their reads go on being served)
    u = mountctl.unmount(mountpoint, lazy="if_busy")
    if not u.ok:
        print(f"dlcachefs: cannot unmount {mountpoint}: {u.error}", file=sys.stderr)
        return 1
    if u.lazy:
        print(f"dlcachefs: {mountpoint} detached lazily: files are still open; the daemon "
              "commits and exits when the last one is closed", file=sys.stderr)
        return 0
    if pid and not mountctl.wait_gone(pid, timeout):
        print(f"dlcachefs: unmounted, but daemon {pid} is still committing", file=sys.stderr)
        return 1
    print(f"dlcachefs: unmounted {mountpoint}", file=sys.stderr)
    return 0


# ----- stats --------------------------------------------------------------------------

def cmd_stats(mountpoint: str, as_json: bool, everything: bool = False) -> int:
    """Print a mount's stats: the summary (:mod:`dlcachefs.admin.summary`), every key
    (``everything``) or the JSON document (``as_json``)."""
    from dlcachefs.admin import dlcachedir  # noqa: PLC0415

    try:
        st = dlcachedir.stats(mountpoint)
    except dlcachedir.NotAMount as e:  # exit 2, as top, advise and warmup
        print(f"dlcachefs stats: {e}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps(st, indent=2))
        return 0
    if not everything:
        from dlcachefs.admin.summary import summary  # noqa: PLC0415

        print("\n".join(summary(st)))
        return 0
    print_tree({k: v for k, v in st.items() if not (k == "peers" and v)})
    if st.get("peers"):
        print_peers(st["peers"])
    from dlcachefs.admin import advise  # noqa: PLC0415 - loader-worker advice (Algorithm 2)

    for a in advise.advise(st):
        print(advise.text(a))
    return 0


#: keys that name bytes but count something else (reads, injections)
_COUNTS_OF_BYTES = frozenset({"injections_with_wrong_bytes", "wrong_bytes_reads"})


def _is_size(key: str) -> bool:
    """Whether a stats key holds a number of bytes (shown as a size)."""
    if key in _COUNTS_OF_BYTES:
        return False
    return (key.endswith(("bytes", "_file", "_capacity")) or key.startswith("bytes_")
            or key == "package_size" or "_bytes_read" in key or key.endswith("_bytes_dropped"))


def _shown(key: str, v: object) -> str:
    """A value as the human stats show it: sizes in units (and exact), lists inline."""
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int) and _is_size(key):
        return f"{format_size(v)} ({v:,})"
    if isinstance(v, float):
        return str(round(v, 3))
    if isinstance(v, (list, tuple)):
        if not v:
            return "-"
        if all(isinstance(x, (list, tuple)) and len(x) == 2 for x in v):  # (bucket, count)
            # a bucket's bound as it is (0.0005 s is not 0.001 s: rounding merged them)
            return ", ".join(f"{a}: {_shown(key, b)}" for a, b in v)
        return ", ".join(_shown(key, x) for x in v)
    return str(v)


def print_tree(doc: dict, indent: int = 0) -> None:
    """The stats document as aligned ``key  value`` lines; a section (a mapping: streams,
    fuse_ops, latencies...) as its key, then its own lines indented below it."""
    width = max((len(str(k)) for k in doc), default=0)
    pad = " " * indent
    for k, v in doc.items():
        if isinstance(v, dict) and v:
            print(f"{pad}{k}:")
            print_tree(v, indent + 2)
        else:
            print(f"{pad}{k!s:<{width}}  {'-' if isinstance(v, dict) else _shown(str(k), v)}")


def print_peers(peers: dict) -> None:
    """The ``peers`` section of the stats: the tier's counts, then one line per server."""
    print("\npeer tier (--peers):")
    for k, v in peers.items():
        if k != "servers":
            print(f"  {k:<22}  {v}")
    cols = ("state", "hits", "misses", "bytes", "stored", "rejected", "errors",
            "marked_down", "marked_down_s")
    servers = peers.get("servers", {})
    w = max([len(n) for n in servers] + [6])
    print(f"  {'server':<{w}}  " + "  ".join(f"{c:>13}" for c in cols))
    for name, s in servers.items():
        cells = [format_size(s[c]) if c == "bytes" else s[c] for c in cols]
        print(f"  {name:<{w}}  " + "  ".join(f"{c!s:>13}" for c in cells))


# ----- mount.dlcachefs (for /etc/fstab) ------------------------------------------------

_IGNORED = {"rw", "ro", "defaults", "auto", "noauto", "user", "nouser", "users", "nofail",
            "_netdev", "exec", "noexec", "suid", "nosuid", "dev", "nodev", "async", "sync"}
# an option is a run of non-commas or "quoted text": policy="icache:package=1M,h_ratio=0.9"
_FSTAB_OPTION = re.compile(r'(?:[^,"]|"[^"]*")+')


def split_mount_options(text: str) -> list[str]:
    """``a=1,b,c="x,y"`` -> ``['a=1', 'b', 'c=x,y']``: commas inside double quotes are
    part of the value, and the quotes around a value are dropped."""
    out = []
    for item in _FSTAB_OPTION.findall(text):
        key, eq, val = item.partition("=")
        if len(val) >= 2 and val[0] == val[-1] == '"':
            val = val[1:-1]
        out.append(key + eq + val)
    return out


def mount_helper_argv(argv: list[str]) -> list[str]:
    """Translate ``mount.dlcachefs SOURCE DIR [-o a=b,c] [-sfnv]`` into ``dlcachefs mount`` args.

    ``-o`` takes the options of ``dlcachefs mount`` spelled with ``_`` (or ``-``): a flag
    alone (``rescan``), the others as ``key=value``; ``config=FILE`` is ``--config FILE``;
    mount(8)'s generic options and ``x-*`` are ignored."""
    pos: list[str] = []
    opts: list[str] = []
    it = iter(argv)
    for a in it:
        if a == "-o":
            opts.extend(split_mount_options(next(it, "")))
        elif a.startswith("-o") and len(a) > 2:
            opts.extend(split_mount_options(a[2:]))
        elif a.startswith("-") and len(a) > 1:
            continue  # -s, -f (fake), -n (no mtab), -v: nothing to do for us
        else:
            pos.append(a)
    if len(pos) != 2:
        raise ValueError("usage: mount.dlcachefs SOURCE MOUNTPOINT [-o cache_dir=DIR,...]")
    out = ["mount", *pos]
    for o in opts:
        key, eq, val = o.partition("=")
        if key in _IGNORED or key.startswith("x-"):
            continue
        opt = option(key)
        if key == "config" or (opt is not None and opt.kind != "flag"):
            if not eq:
                raise ValueError(f"mount option {key!r} needs a value ({key}=...)")
            out += ["--config" if opt is None else opt.flag, val]
        elif opt is not None:
            if eq:
                raise ValueError(f"mount option {key!r} is a flag: it takes no value")
            out.append(opt.flag)
        else:
            raise ValueError(f"unknown mount option {o!r}")
    return out


def mount_helper_main(argv: list[str] | None = None) -> int:
    try:
        args = mount_helper_argv(sys.argv[1:] if argv is None else argv)
    except ValueError as e:
        print(f"mount.dlcachefs: {e}", file=sys.stderr)
        return 1
    return main(args)


if __name__ == "__main__":
    sys.exit(main())
