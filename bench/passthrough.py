"""The floor cost of a Python FUSE daemon: a minimal pyfuse3 + trio read-only passthrough
over a local directory (:mod:`dlcachefs.testing.passthrough`, where the daemon lives, with
its ``--delay-ms`` and ``--faults``). Whatever dlcachefs costs above this is its own doing.

    python -m bench.passthrough SRC MNT [--direct-io] [--keep-cache] [--delay-ms MS]  # daemon
    python -m bench.passthrough measure [--files 3000] [--threads 1,8] [--modes plain,direct_io]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dlcachefs.testing import passthrough as _daemon
from dlcachefs.testing.passthrough import passthrough_mount, set_read_ahead_kb

__all__ = ["main", "measure", "passthrough_mount", "set_read_ahead_kb"]


# ----- the measurement -----------------------------------------------------------------------

MODES = {
    "plain": {"direct_io": False, "keep_cache": False},
    "direct_io": {"direct_io": True, "keep_cache": False},
    "keep_cache": {"direct_io": False, "keep_cache": True},
}


def measure(a: argparse.Namespace) -> dict:
    from .remote import (
        STATE_ROOT,
        ensure_random_files,
        parse_list,
        reference_hashes,
        timed_pass,
    )

    rels = ensure_random_files(a.data, a.files, a.size)
    expected = reference_hashes(a.data, rels)
    mnt = a.mount or os.path.join(STATE_ROOT + "-mnt", "passthrough")
    doc = {"bench": "passthrough", "files": len(rels), "file_size": a.size, "data": a.data,
           "read_ahead_kb": a.read_ahead_kb, "runs": []}
    threads = parse_list(a.threads, int)
    if a.direct:
        for th in threads:
            for phase, drop in (("cold", True), ("warm", False)):
                rec = timed_pass(a.data, rels, th, expected, drop, f"direct (no FUSE) {phase}")
                rec.update(mode="no_fuse", phase=phase)
                doc["runs"].append(rec)
    for mode in parse_list(a.modes):
        with passthrough_mount(a.data, mnt, read_ahead_kb=a.read_ahead_kb, **MODES[mode]):
            for th in threads:
                for phase, drop in (("cold", True), ("warm", False)):
                    rec = timed_pass(mnt, rels, th, expected, drop, f"passthrough {mode} {phase}")
                    rec.update(mode=mode, phase=phase)
                    doc["runs"].append(rec)
    return doc


def _measure_main(argv: list[str]) -> int:
    from .remote import DEFAULT_DATA

    p = argparse.ArgumentParser(prog="python -m bench.passthrough measure")
    p.add_argument("--data", default=DEFAULT_DATA)
    p.add_argument("--files", type=int, default=3000)
    p.add_argument("--size", type=int, default=110_000)
    p.add_argument("--threads", default="1,8")
    p.add_argument("--modes", default="plain,direct_io", help=f"of {','.join(MODES)}")
    p.add_argument("--read-ahead-kb", type=int, default=None)
    p.add_argument("--no-direct", dest="direct", action="store_false",
                   help="skip the reads of the directory itself (no FUSE)")
    p.add_argument("--mount", default=None)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    doc = measure(a)
    print(json.dumps(doc, indent=2))
    if a.out:
        from .util import write_json
        write_json(a.out, doc)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["measure"]:
        return _measure_main(argv[1:])
    return _daemon.main(argv)  # the daemon, in the foreground


if __name__ == "__main__":
    sys.exit(main())
