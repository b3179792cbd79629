"""iCACHE's packages in the peer tier: would one tier item per package pay?

iCACHE (III-C) packs L-samples into files of >= 1 MB so that storage serves them in one
large read. dlcachefs cannot write packages to a read-only source; its packer reads a
package's members one by one (from the peer tier when another node stored them, else
from the source) and keeps the package as one contiguous unit in the local log. The one
place a shared package could still save work is the tier: a node reading a package
another node built could get it as ONE item instead of one item per member. This bench
measures that gain on real memcached servers with the tier's own client and value format:

* ``per_sample``: each member its own item, read as the packer reads them (the tier's
  ``get_or_lease`` without taking a lease, ``--threads`` at once, each value checked);
* ``one_item``: the package stored as one value (the members concatenated, one checksum),
  read with one ``get`` and checked.

    python -m bench.packages [--servers 3] [--package-mb 1] [--sample-kb 110,16]
                             [--packages 200] [--threads 8] [--out FILE]

Prints JSON: per sample size, wall and CPU (this process, every thread) per package for
both ways, and their ratios. Nothing here is asserted; the numbers go into
docs/importance.md ("Packages and a read-only source").
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from dlcachefs.peers.servers import Servers
from dlcachefs.peers.valuefmt import content_key
from dlcachefs.testing.memcached import cluster as memcached_cluster
from dlcachefs.testing.memcached import memcached_available


def cpu() -> float:
    """This process's CPU seconds, every thread's (nanosecond resolution, not os.times's
    clock ticks)."""
    return time.process_time()


def run(servers: Servers, sample_kb: int, package_mb: float, packages: int,
        threads: int) -> dict:
    """Store ``packages`` packages both ways, then read each back both ways (alternated,
    so that drift on a shared machine hits both alike)."""
    per = max(1, int(package_mb * 1024 / sample_kb))
    rnd = random.Random(sample_kb)
    pkgs = []
    for p in range(packages):
        members = []
        for i in range(per):
            data = rnd.randbytes(sample_kb * 1024)
            ck = content_key(b"bench", b"s/%d/%d/%d" % (sample_kb, p, i), len(data), 1)
            owner = servers.owner(ck.key, frozenset())
            servers.store(owner, ck, data, lease=False)
            members.append((ck, owner))
        whole = rnd.randbytes(sample_kb * 1024 * per)
        pck = content_key(b"bench", b"pkg/%d/%d" % (sample_kb, p), len(whole), 1)
        powner = servers.owner(pck.key, frozenset())
        servers.store(powner, pck, whole, lease=False)
        pkgs.append((members, pck, powner))
    pool = ThreadPoolExecutor(threads)
    res = {"per_sample": {"wall": 0.0, "cpu": 0.0}, "one_item": {"wall": 0.0, "cpu": 0.0}}
    for members, pck, powner in pkgs:
        for way in ("per_sample", "one_item"):
            c0, t0 = cpu(), time.perf_counter()
            if way == "per_sample":
                got = list(pool.map(lambda m: servers.get_or_lease(m[1], m[0], 30, False),
                                    members))
                assert all(k == "hit" for k, _ in got), got[:1]
            else:
                kind, _ = servers.get_or_lease(powner, pck, 30, False)
                assert kind == "hit"
            res[way]["wall"] += time.perf_counter() - t0
            res[way]["cpu"] += cpu() - c0
    pool.shutdown()
    out = {"sample_kb": sample_kb, "samples_per_package": per, "packages": packages}
    for way, v in res.items():
        out[way] = {"wall_ms_per_package": round(1000 * v["wall"] / packages, 3),
                    "cpu_ms_per_package": round(1000 * v["cpu"] / packages, 3)}
    out["one_item_vs_per_sample"] = {
        k: round(out["one_item"][f"{k}_ms_per_package"]
                 / out["per_sample"][f"{k}_ms_per_package"], 3) for k in ("wall", "cpu")}
    out["saved_cpu_ms_per_sample"] = round(
        (out["per_sample"]["cpu_ms_per_package"] - out["one_item"]["cpu_ms_per_package"])
        / per, 4)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, default=3)
    p.add_argument("--package-mb", type=float, default=1.0)
    p.add_argument("--sample-kb", default="110,16")
    p.add_argument("--packages", type=int, default=200)
    p.add_argument("--threads", type=int, default=8, help="the packer's reads at once")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if not memcached_available():
        print("bench.packages: needs memcached (apt-get install memcached)", file=sys.stderr)
        return 2
    sizes = [int(s) for s in a.sample_kb.split(",") if s.strip()]
    # (4x the bytes: memcached gives its pages to the first slab class that asks, and the
    # packages come after their members)
    need_mb = int(a.packages * a.package_mb * 2 * 4 / a.servers) + 64
    with tempfile.TemporaryDirectory(prefix="dlc-packages-") as work, \
            memcached_cluster(a.servers, work, memory_mb=max(64, need_mb),
                              item_mb=max(2, int(a.package_mb) + 1)) as mcs:
        servers = Servers([("127.0.0.1", m.port) for m in mcs], timeout=5.0)
        try:
            rows = [run(servers, kb, a.package_mb, a.packages, a.threads) for kb in sizes]
        finally:
            servers.close()
    res = {"servers": a.servers, "package_mb": a.package_mb, "threads": a.threads,
           "rows": rows}
    text = json.dumps(res, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
