"""The operators' subcommands of ``dlcachefs``: ``warmup``, ``top``, ``advise``.

Kept apart from :mod:`dlcachefs.cli` (which only registers them): each command's module is
imported when it runs, so ``dlcachefs --help`` imports none of them.
"""

from __future__ import annotations

import argparse

ADMIN_COMMANDS = ("warmup", "top", "advise")


def add_admin_commands(sub) -> None:
    """Add the subcommands to ``dlcachefs``'s subparsers."""
    w = sub.add_parser("warmup", help="fill the cache with files of a mount before training "
                                      "(resumable; --dry-run shows what fits)")
    w.add_argument("mountpoint")
    w.add_argument("paths", nargs="*", metavar="PATH",
                   help="files or directories inside the mount (relative to it, or "
                        "absolute); default: the whole mount")
    w.add_argument("--order", metavar="FILE",
                   help="warm the paths listed in FILE (one a line, relative to the mount), "
                        "in that order")
    w.add_argument("--dry-run", action="store_true",
                   help="print what is cached, what would be fetched and what fits the "
                        "cache budget; read nothing")
    w.add_argument("--jobs", "-j", type=int, default=8, help="files opened at once (default 8)")
    w.add_argument("--json", action="store_true", help="print the plan and result as JSON")
    w.add_argument("--no-wait", dest="wait", action="store_false",
                   help="do not wait for the daemon to seal what was fetched (and so do "
                        "not count what is cached at the end)")

    t = sub.add_parser("top", help="live view of a mount's statistics")
    t.add_argument("mountpoint")
    t.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    t.add_argument("--once", action="store_true",
                   help="print one frame as text (rates over --interval) and exit")

    a = sub.add_parser("advise", help="recommend a DataLoader num_workers per stream "
                                      "(DLCache's Algorithm 2, from measured fetch and "
                                      "request times)")
    a.add_argument("mountpoint")
    a.add_argument("--cores", type=int, help="CPU cores for the loader (default: this "
                                             "machine's usable cores)")
    a.add_argument("--mem-limit", metavar="SIZE",
                   help="memory the loader workers may use together (default: what they "
                        "use now plus half of the memory available)")
    a.add_argument("--json", action="store_true")


def run_admin_command(a: argparse.Namespace) -> int:
    """Run the parsed subcommand ``a``; its exit status."""
    if a.cmd == "warmup":
        from dlcachefs.admin import warmup  # noqa: PLC0415

        return warmup.main(a.mountpoint, a.paths, a.order, a.dry_run, a.jobs, a.json, a.wait)
    if a.cmd == "top":
        from dlcachefs.admin import top  # noqa: PLC0415

        return top.main(a.mountpoint, a.interval, a.once)
    if a.cmd == "advise":
        from dlcachefs.admin import advise  # noqa: PLC0415
        from dlcachefs.units import parse_size  # noqa: PLC0415

        mem = parse_size(a.mem_limit) if a.mem_limit else None
        return advise.main(a.mountpoint, a.cores, mem, a.json)
    raise ValueError(f"unknown command {a.cmd}")
