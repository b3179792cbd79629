"""Three nodes on one machine over one slow remote: three independent dlcachefs mounts
against three mounts sharing a peer tier (``--peers``, three memcached servers with
extstore), side by side in one run. Remote bytes, epoch-1 and epoch-2 times.

    sudo .venv/bin/python -m bench.peers [--files 1500] [--size 110000] [--epochs 2]
        [--workload distributed|full] [--remote delay|sshfs] [--delay-ms 4] [--rate 400mbit]
        [--threads 4] [--scan-ahead N] [--node-cache 4G] [--tier-mb 256 --tier-ext-mb 1024 --tier-item-mb 8]
        [--keep-control] [--announce] [--shards N --shard-mb M [--sample-kb K]]
        [--peer-timeout S]
        [--out bench/results/peers-<ts>.json]

* The remote: ``delay`` (default) is ``bench.passthrough --delay-ms`` over the dataset
  directory (every open waits, concurrent opens overlap: an object store's per-request
  latency, no bandwidth limit); ``sshfs`` is ``bench.remote.slow_remote`` (an sshd in a
  network namespace, both directions shaped to ``--rate``; needs root). Each node's
  dlcachefs mounts the same remote mount, each with its own cache directory.
* ``--workload distributed``: DistributedSampler, world 3: each epoch a permutation
  (seed + epoch) cut into 3 disjoint shards, node r reads shard r (``--threads``
  threads), the three nodes at once. Epoch 1 reads the dataset once over the cluster
  either way; epoch 2 reshuffles, so a node reads ~2/3 of its shard from somewhere else:
  the remote (independent) or the tier (peers). ``full``: every node reads the whole
  dataset each epoch, in its own order (three jobs on one dataset).
* Reported per configuration and epoch: wall time (the slowest node), files/s over the
  cluster, bytes from the remote (``bytes_from_source`` summed over the nodes, and as a
  multiple of the dataset), bytes from the tier (``bytes_from_peers``), errors and
  mismatches (every file's sha256 is compared with the dataset's); then ratios
  peers / independent. The page cache is not dropped: both configurations see the same.
* ``--announce`` (with ``distributed``): each node announces its rank of a
  DistributedSampler (world 3) to its mount at the start of each epoch, and reads
  torch's ``DistributedSampler`` shard of the dataset (files named
  ``.jpg``, so the mount's ImageFolder sample list is the dataset in the same order); a
  third configuration, ``peers-owner``, adds ``--peer-self`` (each node fetches ahead
  the files its own server owns, in the cluster's first-use order); ratios owner /
  peers.
* ``--shards N --shard-mb M``: a WebDataset-style shard set in place of the files: N tar
  files of about M MB, each of samples of ``--sample-kb`` (``KEY.jpg`` random bytes and
  ``KEY.cls``), read whole as a WebDataset loader streams a shard. With ``--tier-item-mb``
  below the shard size, the tier holds each shard in pieces (up to ``--max-cached-file``,
  256 MiB: larger shards are read through and skip the tier). Reported per node:
  ``remote_bytes_per_node``.
* Smaller than the dataset: ``--node-cache`` (each mount's ``--cache-size``) and
  ``--tier-mb``/``--tier-ext-mb`` (each memcached's memory and extstore). Then nodes evict
  and the tier loses values; ``--keep-control`` adds a third configuration, the peers
  with ``--no-peer-keep`` (no keep-the-last-copy push at eviction), and its ratios to
  ``peers``.

One machine (2 cores here) runs the remote, three daemons, three memcached and the
readers: read the ratios and the remote bytes, not the absolute times.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import sys
import tarfile
import tempfile
import threading
import time

from dlcachefs.testing.memcached import cluster as memcached_cluster
from dlcachefs.testing.memcached import memcached_available

from .mounting import DlcMount
from .readers import read_all
from .remote import ensure_random_files, log, reference_hashes
from .util import machine_info, write_json

NODES = 3
HERE = os.path.dirname(os.path.abspath(__file__))


def ensure_tar_shards(root: str, n: int, shard_mb: int, sample_kb: int) -> list[str]:
    """``n`` WebDataset-style tar shards of about ``shard_mb`` MB under ``root`` (samples
    ``KEY.jpg``, ``sample_kb`` KB of random bytes, and ``KEY.cls``), made once and kept
    (a shard there is reused: it was written whole, then renamed; the default directory
    names the sizes). Returns the relative paths."""
    rels = [f"shards/shard-{i:06d}.tar" for i in range(n)]
    per = max(1, shard_mb * 1_000_000 // (sample_kb * 1000 + 2048))  # 3 headers of 512 B
    made = 0
    for i, rel in enumerate(rels):
        p = os.path.join(root, rel)
        if os.path.exists(p):
            continue
        os.makedirs(os.path.dirname(p), exist_ok=True)
        rnd = random.Random(i)
        tmp = p + ".tmp"
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            for j in range(per):
                key = f"{i:06d}{j:06d}"
                for name, data in ((f"{key}.jpg", rnd.randbytes(sample_kb * 1000)),
                                   (f"{key}.cls", b"%d" % rnd.randrange(1000))):
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime = len(data), 1_700_000_000
                    tar.addfile(info, io.BytesIO(data))
        os.replace(tmp, p)
        made += 1
    if made:
        os.sync()
        log(f"made {made} tar shards of {per} samples of {sample_kb} KB under {root}")
    return rels


def shards(n: int, epoch: int, workload: str, seed: int = 0,
           torch_sampler: bool = False) -> list[list[int]]:
    """Each node's indices of one epoch (DistributedSampler-style, or the whole set;
    ``torch_sampler``: torch's DistributedSampler itself, as the announcement says)."""
    if torch_sampler:
        from torch.utils.data import DistributedSampler  # noqa: PLC0415

        out = []
        for r in range(NODES):
            s = DistributedSampler(range(n), num_replicas=NODES, rank=r, seed=seed)
            s.set_epoch(epoch)
            out.append(list(s))
        return out
    if workload == "full":
        out = []
        for r in range(NODES):
            order = list(range(n))
            random.Random(seed * 1000 + epoch * 10 + r).shuffle(order)
            out.append(order)
        return out
    order = list(range(n))
    random.Random(seed + epoch).shuffle(order)
    per = -(-n // NODES)
    order += order[: per * NODES - n]  # padded as DistributedSampler pads
    return [order[r::NODES] for r in range(NODES)]


def run_epoch(mounts, rels, expected, idx_lists, threads: int) -> dict:
    """The nodes read their lists at once; per-node results and the cluster's totals."""
    results: list[dict | None] = [None] * NODES

    def node(r: int) -> None:
        paths = [os.path.join(mounts[r].mnt, rels[i]) for i in idx_lists[r]]
        res = read_all(paths, threads=threads)
        bad = sum(1 for h, i in zip(res.hashes, idx_lists[r], strict=True)
                  if h != expected[i])
        results[r] = {**res.summary(), "mismatches": bad}

    before = [m.stats() for m in mounts]
    t0 = time.perf_counter()
    ts = [threading.Thread(target=node, args=(r,)) for r in range(NODES)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    after = [m.stats() for m in mounts]
    files = sum(len(x) for x in idx_lists)
    src = sum(a["bytes_from_source"] - b["bytes_from_source"] for a, b in zip(after, before, strict=True))
    peers = sum(a.get("bytes_from_peers", 0) - b.get("bytes_from_peers", 0)
                for a, b in zip(after, before, strict=True))
    return {
        "wall_s": round(wall, 3), "files": files, "files_per_s": round(files / wall, 1),
        "remote_bytes": src, "peer_bytes": peers,
        "errors": sum(r["errors"] for r in results),
        "mismatches": sum(r["mismatches"] for r in results),
        "remote_bytes_per_node": [a["bytes_from_source"] - b["bytes_from_source"]
                                  for a, b in zip(after, before, strict=True)],
        "nodes": [{"wall_s": r["wall_s"], "files_per_s": r["files_per_s"],
                   "p50_ms": r["latency_ms"]["p50"], "p99_ms": r["latency_ms"]["p99"],
                   "remote_bytes": a["bytes_from_source"] - b["bytes_from_source"],
                   "bytes_read": r["bytes"]}
                  for r, a, b in zip(results, after, before, strict=True)],
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def announce(mounts, epoch: int) -> None:
    """Each node's rank of a DistributedSampler (world NODES, seed 0) for ``epoch``, as
    ``dlcachefs run`` sends it at the loader's ``iter()``: the epoch's reads start at once
    (a daemon's first announcement waits for its torch import, ~4 s, before it replays)."""
    for r, m in enumerate(mounts):
        fd = os.open(os.path.join(m.mnt, ".dlcache", "control"), os.O_WRONLY)
        try:
            os.write(fd, (f"job bench\ndataset .\nsampler distributed seed=0 world={NODES} "
                          f"rank={r}\nepoch {epoch}\n").encode())
        finally:
            os.close(fd)


def run_config(label: str, remote_mnt: str, work: str, rels, expected, a,
               peers: list[str] | None, more: tuple[str, ...] = ()) -> dict:
    extra = ["--ignore-source-inode", "--cache-size", a.node_cache]
    if a.scan_ahead is not None:
        extra += ["--scan-ahead", str(a.scan_ahead)]
    if peers:
        extra += ["--peers", ",".join(peers), "--peer-item-max", f"{a.tier_item_mb}M",
                  *(["--peer-timeout", str(a.peer_timeout)] if a.peer_timeout else []),
                  *(m for m in more if m != "--peer-self")]
    out = {"label": label, "epochs": []}
    with contextlib.ExitStack() as stack:
        mounts = []
        for r in range(NODES):
            own = ["--peer-self", peers[r]] if peers and "--peer-self" in more else []
            m = DlcMount(remote_mnt, os.path.join(work, f"{label}-mnt{r}"),
                         os.path.join(work, f"{label}-cache{r}"),
                         [*extra, *own] if own else extra)
            stack.enter_context(m)
            mounts.append(m)
        for epoch in range(a.epochs):
            # the shards first: the first import of torch here takes seconds, and the
            # daemons would prefetch meanwhile, before the epoch's counts begin
            idx = shards(len(rels), epoch, a.workload, torch_sampler=a.announce)
            if a.announce:
                announce(mounts, epoch)
            ep = run_epoch(mounts, rels, expected, idx, a.threads)
            ep["epoch"] = epoch + 1
            ep["remote_x_dataset"] = round(ep["remote_bytes"] / a.dataset_bytes, 3)
            log(f"{label:<12} epoch {epoch + 1}: {ep['wall_s']:>7} s  "
                f"{ep['files_per_s']:>7} files/s  remote {ep['remote_x_dataset']}x dataset  "
                f"peers {ep['peer_bytes'] / 1e6:.1f} MB  errors {ep['errors']} "
                f"mismatches {ep['mismatches']}")
            out["epochs"].append(ep)
            if peers:  # the stores of this epoch are done before the next (background)
                for m in mounts:
                    deadline = time.monotonic() + 60
                    while (m.stats()["peers"]["store_pending"] and
                           time.monotonic() < deadline):
                        time.sleep(0.1)
        if peers:
            out["peers"] = [m.stats()["peers"] for m in mounts]
    return out


@contextlib.contextmanager
def the_remote(a, data: str, work: str):
    mnt = os.path.join(work, "remote")
    if a.remote == "sshfs":
        from .remote import slow_remote  # noqa: PLC0415
        with slow_remote(data, mnt, rate=a.rate):
            yield mnt
    else:
        from .passthrough import passthrough_mount  # noqa: PLC0415
        with passthrough_mount(data, mnt, delay_ms=a.delay_ms):
            yield mnt


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=1500)
    p.add_argument("--size", type=int, default=110_000)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--workload", choices=("distributed", "full"), default="distributed")
    p.add_argument("--remote", choices=("delay", "sshfs"), default="delay")
    p.add_argument("--delay-ms", type=float, default=4.0)
    p.add_argument("--rate", default="400mbit")
    p.add_argument("--threads", type=int, default=4)
    p.add_argument("--scan-ahead", type=int, help="the mounts' --scan-ahead (default theirs)")
    p.add_argument("--data", help="dataset directory (default bench/out/peers/data-FILES-SIZE: "
                                  "only the files read, or scan-ahead would fetch others)")
    p.add_argument("--node-cache", default="4G", help="each mount's --cache-size")
    p.add_argument("--tier-mb", type=int, default=256, help="each memcached's -m (MiB)")
    p.add_argument("--tier-ext-mb", type=int, default=1024, help="each memcached's extstore")
    p.add_argument("--tier-item-mb", type=int, default=8,
                   help="each memcached's -I (MiB; at most half of --tier-mb)")
    p.add_argument("--peer-timeout", type=float,
                   help="the mounts' --peer-timeout (default theirs)")
    p.add_argument("--keep-control", action="store_true",
                   help="also run the peers with --no-peer-keep")
    p.add_argument("--announce", action="store_true",
                   help="announce each node's DistributedSampler rank, and also run the "
                        "peers with --peer-self (the owner's prefetch)")
    p.add_argument("--shards", type=int, help="a WebDataset-style set of this many tar "
                                               "shards in place of --files")
    p.add_argument("--shard-mb", type=int, default=100, help="each shard's size (MB)")
    p.add_argument("--sample-kb", type=int, default=110, help="each shard sample's size (KB)")
    p.add_argument("--out")
    a = p.parse_args(argv)
    if a.announce and a.workload != "distributed":
        p.error("--announce needs --workload distributed")
    if a.shards and a.announce:
        p.error("--shards reads tar files: nothing to announce")
    if not memcached_available():
        print("bench.peers: needs memcached (apt-get install memcached)", file=sys.stderr)
        return 2
    if a.shards:
        a.data = a.data or os.path.join(HERE, "out", "peers",
                                        f"shards-{a.shards}-{a.shard_mb}-{a.sample_kb}")
        rels = ensure_tar_shards(a.data, a.shards, a.shard_mb, a.sample_kb)
    else:
        ext = ".jpg" if a.announce else ".bin"
        a.data = a.data or os.path.join(HERE, "out", "peers", f"data-{a.files}-{a.size}"
                                        + ("-jpg" if a.announce else ""))
        rels = ensure_random_files(a.data, a.files, size=a.size, ext=ext)
    a.dataset_bytes = sum(os.path.getsize(os.path.join(a.data, r)) for r in rels)
    expected = reference_hashes(a.data, rels)
    work = tempfile.mkdtemp(prefix="peers-", dir=os.path.join(HERE, "out", "peers"))
    doc = {"bench": "peers", "args": vars(a), "machine": machine_info(os.path.dirname(HERE)),
           "dataset_bytes": a.dataset_bytes, "configs": []}
    try:
        with the_remote(a, a.data, work) as remote_mnt:
            doc["configs"].append(run_config("independent", remote_mnt, work, rels, expected,
                                             a, None))
            controls = ([("peers", ())]
                        + ([("peers-nokeep", ("--no-peer-keep",))] if a.keep_control else [])
                        + ([("peers-owner", ("--peer-self",))] if a.announce else []))
            for label, more in controls:  # a fresh (empty) tier for each
                with memcached_cluster(NODES, os.path.join(work, "mc"),
                                       memory_mb=a.tier_mb, item_mb=a.tier_item_mb,
                                       ext_mb=a.tier_ext_mb) as servers:
                    doc["configs"].append(run_config(label, remote_mnt, work, rels,
                                                     expected, a,
                                                     [s.address for s in servers], more))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ind, peer = (c["epochs"] for c in doc["configs"][:2])
    doc["ratios"] = [{
        "epoch": i + 1,
        "remote_bytes_peers_over_independent": round(
            peer[i]["remote_bytes"] / max(1, ind[i]["remote_bytes"]), 3),
        "wall_peers_over_independent": round(peer[i]["wall_s"] / ind[i]["wall_s"], 3),
    } for i in range(len(ind))]
    if a.keep_control:
        nokeep = doc["configs"][2]["epochs"]
        for i, r in enumerate(doc["ratios"]):
            r["remote_bytes_peers_over_nokeep"] = round(
                peer[i]["remote_bytes"] / max(1, nokeep[i]["remote_bytes"]), 3)
            r["wall_peers_over_nokeep"] = round(peer[i]["wall_s"] / nokeep[i]["wall_s"], 3)
    if a.announce:
        owner = next(c for c in doc["configs"] if c["label"] == "peers-owner")["epochs"]
        for i, r in enumerate(doc["ratios"]):
            r["wall_owner_over_peers"] = round(owner[i]["wall_s"] / peer[i]["wall_s"], 3)
            r["remote_bytes_owner_over_dataset"] = owner[i]["remote_x_dataset"]
    out = a.out or os.path.join(HERE, "results", f"peers-{time.strftime('%Y%m%d-%H%M%S')}.json")
    write_json(out, doc)
    print(json.dumps({"ratios": doc["ratios"],
                      "epochs": {c["label"]: [{k: e[k] for k in (
                          "epoch", "wall_s", "files_per_s", "remote_x_dataset", "remote_bytes",
                          "remote_bytes_per_node", "peer_bytes", "errors", "mismatches")}
                          for e in c["epochs"]]
                          for c in doc["configs"]}}, indent=2))
    print(f"bench.peers: wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
