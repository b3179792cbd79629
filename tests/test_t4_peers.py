"""Tier 4: a cluster on one machine. Three memcached servers on 127.0.0.1 (extstore on temp
files) and three dlcachefs mounts of one source, each with its own cache dir, all with
``--peers`` naming the three servers: a file leaves the source once for the cluster
(read by one node, then by the others; read by all at once, the lease decides), a
DistributedSampler world of 3 (one process per rank, each through its own mount) reads
epoch 2 with nothing from the source, ``kill -9`` of a server mid-epoch costs only its
share and no client error, and a damaged value is never served. Every byte is compared
with the source; source reads are counted by the mounts' ``bytes_from_source``."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import requires_fuse

from dlcachefs.testing.memcached import cluster as memcached_cluster
from dlcachefs.testing.memcached import memcached_available

pymemcache = pytest.importorskip("pymemcache")

from dlcachefs.peers.valuefmt import content_key  # noqa: E402

pytestmark = [requires_fuse,
              pytest.mark.skipif(not memcached_available(), reason="needs memcached")]

NODES = 3
# a killed server is logged once per node that saw it fail
DOWN = pytest.mark.daemon_log_allows(r"peer 127\.0\.0\.1:\d+ marked down")


def make_tree(root: Path, n: int = 150, seed: int = 7) -> list[Path]:
    rnd = random.Random(seed)
    files = []
    for i in range(n):
        p = root / "train" / f"class{i % 5}" / f"{i:04d}.jpg"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rnd.randbytes(rnd.randint(1_000, 60_000)))
        files.append(p)
    return files


@pytest.fixture
def servers(tmp_path):
    with memcached_cluster(NODES, tmp_path / "memcached") as ms:
        yield ms


@pytest.fixture
def make_cluster(tmp_path, mount, servers):
    """Factory: (source, files, [mounts]): NODES mounts of one source, each its own
    cache, with ``extra`` mount options."""
    def make(*extra: str):
        src = tmp_path / "src"
        files = make_tree(src)
        peers = ",".join(m.address for m in servers)
        mounts = [mount(src, "--peers", peers, "--peer-item-max", "8M", "--peer-lease", "60",
                        "--peer-timeout", "2", *extra, name=f"mnt{i}",
                        cache=tmp_path / f"cache{i}")
                  for i in range(NODES)]
        return src, files, mounts
    return make


@pytest.fixture
def cluster(make_cluster):
    """(source, files, [mounts]) with scan-ahead on (the default)."""
    return make_cluster()


def read_exact(m, src: Path, files: list[Path]) -> None:
    for p in files:
        assert (m.mnt / p.relative_to(src)).read_bytes() == p.read_bytes(), p


def drained(m) -> dict:
    """Stats once the node's stores to the tier are done (they run in the background)."""
    return m.wait_stats(lambda st: st["peers"]["store_pending"] == 0, "stores not done")


def total(files: list[Path]) -> int:
    return sum(p.stat().st_size for p in files)


def test_files_read_by_one_node_come_from_the_tier_on_the_others(cluster):
    src, files, (a, b, c) = cluster
    read_exact(a, src, files)
    st = drained(a)
    assert st["bytes_from_source"] == total(files) and st["bytes_from_peers"] == 0
    assert st["peers"]["store_dropped"] == 0
    for m in (b, c):
        order = files[:]
        random.Random(m.mnt.name).shuffle(order)
        read_exact(m, src, order)
        st = m.stats()
        assert st["bytes_from_source"] == 0, "a file left the source twice"
        assert st["bytes_from_peers"] == total(files)
        servers = st["peers"]["servers"].values()
        assert sum(s["hits"] for s in servers) == len(files)
        assert all(s["hits"] > 0 and s["errors"] == 0 for s in servers)  # each owns a share
    # the human stats show the tier: every key, one line per server (--all) ...
    out = subprocess.run([sys.executable, "-m", "dlcachefs.cli", "stats", str(c.mnt), "--all"],
                         capture_output=True, text=True, check=True).stdout
    assert "bytes_from_peers" in out and "peer tier (--peers):" in out
    for name in st["peers"]["servers"]:
        assert any(line.split()[:2] == [name, "up"] for line in out.splitlines()), out
    # ... and in the summary, the bytes it served and its servers up
    out = subprocess.run([sys.executable, "-m", "dlcachefs.cli", "stats", str(c.mnt)],
                         capture_output=True, text=True, check=True).stdout
    n = len(st["peers"]["servers"])
    assert "from the peer tier" in out and f"{n} of {n} servers up" in out, out


READER = r"""
import hashlib, json, os, sys
mnt, listing = sys.argv[1], sys.argv[2]
out = {}
for rel in open(listing).read().split("\n"):
    if rel:
        with open(os.path.join(mnt, rel), "rb") as f:
            out[rel] = hashlib.sha256(f.read()).hexdigest()
print(json.dumps(out))
"""


def run_ranks(mounts, lists: list[list[str]], tmp: Path) -> list[dict[str, str]]:
    """One reader process per rank, all at once, each through its own mount: the sha256
    of every file of its list."""
    procs = []
    for r, (m, rels) in enumerate(zip(mounts, lists, strict=True)):
        listing = tmp / f"rank{r}.txt"
        listing.write_text("\n".join(rels))
        procs.append(subprocess.Popen([sys.executable, "-c", READER, str(m.mnt), str(listing)],
                                      stdout=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0
        outs.append(json.loads(out))
    return outs


def sha_of(src: Path, rel: str) -> str:
    return hashlib.sha256((src / rel).read_bytes()).hexdigest()


def test_all_nodes_at_once_the_lease_lets_one_read_the_source(cluster, tmp_path):
    """Concurrent first epoch, overlapping: every rank reads every file, each in its own
    order, at the same time. Each file leaves the source exactly once: the bytes read
    from the source over the cluster are the dataset's (each file must be read once by
    someone, so a file read twice would show as more)."""
    src, files, mounts = cluster
    rels = [str(p.relative_to(src)) for p in files]
    lists = []
    for r in range(NODES):
        order = rels[:]
        random.Random(r).shuffle(order)
        lists.append(order)
    outs = run_ranks(mounts, lists, tmp_path)
    for out in outs:
        assert out == {rel: sha_of(src, rel) for rel in rels}
    stats = [drained(m) for m in mounts]
    assert sum(st["bytes_from_source"] for st in stats) == total(files), [
        st["peers"] for st in stats]
    assert sum(st["bytes_from_peers"] for st in stats) == (NODES - 1) * total(files)
    assert sum(st["peers"]["leases"] for st in stats) == len(files)
    # (whether another node waited on a lease or found the value already stored depends on
    # timing: that each file left the source once, above, is what the lease promises;
    # test_t3_peers' lease-wait test makes a node wait on a lease deterministically)
    assert all(st["peers"]["lease_wait_timeouts"] == 0 for st in stats)


def test_distributed_sampler_epoch_two_reads_nothing_from_the_source(cluster, tmp_path):
    """DistributedSampler, world 3, one process per rank through its own mount: epoch 1's
    shards are disjoint, so the cluster reads the dataset once; epoch 2 reshuffles, so a
    rank reads mostly samples another node fetched: all of them from the tier."""
    torch_data = pytest.importorskip("torch.utils.data")
    src, files, mounts = cluster
    rels = [str(p.relative_to(src)) for p in files]
    before = [0] * NODES
    for epoch in range(2):
        lists = []
        for r in range(NODES):
            s = torch_data.DistributedSampler(range(len(rels)), num_replicas=NODES, rank=r,
                                              seed=0)
            s.set_epoch(epoch)
            lists.append([rels[i] for i in s])
        outs = run_ranks(mounts, lists, tmp_path)
        for out, lst in zip(outs, lists, strict=True):
            assert out == {rel: sha_of(src, rel) for rel in lst}
        stats = [drained(m) for m in mounts]
        from_source = sum(st["bytes_from_source"] for st in stats) - sum(before)
        if epoch == 0:
            assert from_source == total(files)
            before = [st["bytes_from_source"] for st in stats]
        else:
            assert from_source == 0, "epoch 2 read from the source"
            assert sum(st["bytes_from_peers"] for st in stats) > 0


def owner_shares(src: Path, files: list[Path], servers) -> dict[str, list[Path]]:
    """Which server owns each file (the mounts' rendezvous hash over the content key)."""
    from dlcachefs.peers.servers import Rendezvous  # noqa: PLC0415
    h = Rendezvous([m.address for m in servers])
    ns = os.fsencode(os.path.realpath(src))
    out: dict[str, list[Path]] = {m.address: [] for m in servers}
    for p in files:
        st = p.stat()
        ck = content_key(ns, os.fsencode(p.relative_to(src)), st.st_size, st.st_mtime_ns)
        out[h.get_node(ck.key)].append(p)
    return out


@DOWN
def test_kill_9_of_a_server_mid_epoch_costs_only_its_share(make_cluster, servers):
    """Node a fills the tier; b reads half, one server is killed (-9), b reads the rest,
    then c reads everything. No client error, every byte exact; the dead server's share
    is read from the source again, each file once (by b after the kill, or by c for the
    files b had from the dead server), the rest still comes from the tier. Scan-ahead is
    off so that b's second half is read after the kill, not fetched ahead before it."""
    src, files, (a, b, c) = make_cluster("--scan-ahead", "0")
    read_exact(a, src, files)
    drained(a)
    shares = owner_shares(src, files, servers)
    victim = servers[1]
    lost = shares[victim.address]
    assert lost and len(lost) < len(files)
    half = len(files) // 2
    read_exact(b, src, files[:half])
    victim.kill9()  # mid-epoch: b has read half
    read_exact(b, src, files[half:])  # no client error, every byte exact
    st_b = drained(b)
    read_exact(c, src, files)
    st_c = c.stats()
    # only the dead server's share was read again, each file once over b and c; b read
    # the rest of its share from the source (the survivors own it now and got it from b)
    lost_after = [p for p in lost if p in files[half:]]
    assert st_b["bytes_from_source"] == total(lost_after) > 0
    assert st_b["bytes_from_source"] + st_c["bytes_from_source"] == total(lost)
    assert st_c["bytes_from_peers"] == total(files) - total(lost) + total(lost_after)
    down = st_b["peers"]["servers"][victim.address]
    assert down["state"] == "down" and down["marked_down"] == 1
    assert st_c["peers"]["servers"][victim.address]["marked_down"] <= 1


@pytest.mark.daemon_log_allows(r"peer 127\.0\.0\.1:\d+: refused a value of")
def test_a_damaged_value_is_never_served_through_the_mount(cluster, servers):
    """Values overwritten directly with pymemcache under the mount's keys (a flipped bit,
    a cut value) are refused: the node reads the source, and the bytes are exact."""
    from pymemcache.client.hash import HashClient  # noqa: PLC0415

    from dlcachefs.peers.servers import Rendezvous  # noqa: PLC0415
    from dlcachefs.peers.valuefmt import encode  # noqa: PLC0415
    src, files, (a, b, _) = cluster
    read_exact(a, src, files)
    drained(a)
    hc = HashClient([tuple(m.address.split(":")) for m in servers], default_noreply=False,
                    hasher=Rendezvous)
    ns = os.fsencode(os.path.realpath(src))
    for i, p in enumerate(files):
        st = p.stat()
        ck = content_key(ns, os.fsencode(p.relative_to(src)), st.st_size, st.st_mtime_ns)
        v = bytearray(encode(ck, p.read_bytes()))
        if i % 2:
            v[len(v) // 2] ^= 0x10
        else:
            v = v[: len(v) - 1]
        assert hc.set(ck.key, bytes(v))
    read_exact(b, src, files)
    st = b.stats()
    assert st["bytes_from_peers"] == 0 and st["bytes_from_source"] == total(files)
    assert sum(s["rejected"] for s in st["peers"]["servers"].values()) == len(files)


@DOWN
def test_kill_9_of_a_server_while_all_ranks_read(cluster, servers, tmp_path):
    """The same kill, while three rank processes read every file at once: no reader sees
    an error, every byte is exact, and the nodes mark the server down (once each)."""
    src, files, mounts = cluster
    rels = [str(p.relative_to(src)) for p in files]
    lists = []
    for r in range(NODES):
        order = rels[:]
        random.Random(10 + r).shuffle(order)
        lists.append(order)
    victim = servers[2]
    procs = []
    for r, (m, rel_list) in enumerate(zip(mounts, lists, strict=True)):
        listing = tmp_path / f"rank{r}.txt"
        listing.write_text("\n".join(rel_list))
        procs.append(subprocess.Popen([sys.executable, "-c", READER, str(m.mnt), str(listing)],
                                      stdout=subprocess.PIPE, text=True))
    try:
        # mid-epoch: once the first node has served a third of the files
        mounts[0].wait_stats(lambda st: st["hits"] + st["misses"] >= len(files) // 3,
                             "rank 0 made no progress")
        victim.kill9()
        outs = []
        for p in procs:
            out, _ = p.communicate(timeout=300)
            assert p.returncode == 0  # no client error
            outs.append(json.loads(out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    want = {rel: sha_of(src, rel) for rel in rels}
    assert all(out == want for out in outs)
    stats = [drained(m) for m in mounts]
    assert sum(st["peers"]["servers"][victim.address]["marked_down"] for st in stats) <= NODES
    # at most the dead server's share (and the lookups in flight at the kill) read again
    shares = owner_shares(src, files, servers)
    lost = total(shares[victim.address])
    assert sum(st["bytes_from_source"] for st in stats) <= total(files) + lost + NODES * 8 * max(
        p.stat().st_size for p in files)


@DOWN
def test_a_hung_server_costs_its_timeout_once_and_no_client_error(make_cluster, servers):
    """A server that accepts connections and never answers (SIGSTOP): node b reads
    everything; its first lookup there waits --peer-timeout, then the server is marked
    down and its share comes from the source (the survivors do not hold it), read once;
    no reader sees an error and every byte is exact."""
    src, files, (a, b, _) = make_cluster("--scan-ahead", "0", "--peer-timeout", "1")
    read_exact(a, src, files)
    drained(a)
    shares = owner_shares(src, files, servers)
    victim = servers[0]
    victim.pause()
    try:
        read_exact(b, src, files)
        st = drained(b)
    finally:
        victim.resume()
    sv = st["peers"]["servers"][victim.address]
    assert sv["state"] == "down" and sv["marked_down"] == 1 and sv["hits"] == 0
    assert st["bytes_from_source"] == total(shares[victim.address])
    assert st["bytes_from_peers"] == total(files) - total(shares[victim.address])


def flush_tier(servers) -> None:
    """Empty every server (the cluster lost its copies: restarts, memcached's own LRU)."""
    from pymemcache.client.base import Client  # noqa: PLC0415
    for m in servers:
        c = Client(("127.0.0.1", m.port), default_noreply=False)
        try:
            assert c.flush_all(noreply=False)
        finally:
            c.close()


def test_an_evicted_file_the_tier_lost_is_pushed_to_its_owner_first(tmp_path, mount, servers):
    """Lobster 4.4, keep the last copy in the cluster: node a (a cache smaller than the
    dataset) reads the first files, then the tier loses them (flushed), then a reads the
    rest, which evicts the first files from its cache. Before their bytes are dropped they
    are stored at their owners (a touch finds nothing there, an add pushes them), so node
    b reads them from the tier: nothing of them leaves the source a second time."""
    src = tmp_path / "src"
    files = make_tree(src)
    first, rest = files[:30], files[30:]
    assert total(first) < 1_500_000 and total(rest) > 3 * 2_000_000 // 2
    peers = ",".join(m.address for m in servers)
    common = ("--peers", peers, "--peer-item-max", "8M", "--peer-timeout", "2",
              "--scan-ahead", "0")
    a = mount(src, *common, "--cache-size", "2M", "--chunk-size", "128K", name="mnta",
              cache=tmp_path / "cachea")
    read_exact(a, src, first)
    drained(a)
    flush_tier(servers)
    read_exact(a, src, rest)
    st = a.wait_stats(lambda st: st["chunks_evicted"] > 0
                      and st["peers"]["keep_offered"] + st["peers"]["keep_unread"] >= len(first)
                      and st["peers"]["store_pending"] == 0, "evicted files not kept")
    pa = st["peers"]
    assert pa["keep_unread"] == 0 and pa["keep_dropped"] == 0
    assert pa["keep_pushed"] >= len(first)  # the tier had lost them: pushed, not touched
    assert pa["keep_held"] > 0  # files of `rest` evicted too: their owners held them
    assert st["bytes_from_source"] == total(files)
    b = mount(src, *common, name="mntb", cache=tmp_path / "cacheb")
    read_exact(b, src, first)
    sb = b.stats()
    assert sb["bytes_from_source"] == 0, "an evicted file vanished from the cluster"
    assert sb["bytes_from_peers"] == total(first)


def test_with_no_peer_keep_evicted_files_the_tier_lost_come_from_the_source(
        tmp_path, mount, servers):
    """The control of the test above (its setup does tell where b's bytes come from): the
    same run with ``--no-peer-keep`` on node a offers nothing at eviction, and b reads
    the first files from the source; the bytes are exact either way."""
    src = tmp_path / "src"
    files = make_tree(src)
    first, rest = files[:30], files[30:]
    peers = ",".join(m.address for m in servers)
    common = ("--peers", peers, "--peer-item-max", "8M", "--peer-timeout", "2",
              "--scan-ahead", "0")
    a = mount(src, *common, "--cache-size", "2M", "--chunk-size", "128K", "--no-peer-keep",
              name="mnta", cache=tmp_path / "cachea")
    read_exact(a, src, first)
    drained(a)
    flush_tier(servers)
    read_exact(a, src, rest)
    st = drained(a)
    assert st["chunks_evicted"] > 0 and st["peers"]["keep_offered"] == 0
    b = mount(src, *common, name="mntb", cache=tmp_path / "cacheb")
    read_exact(b, src, first)
    assert b.stats()["bytes_from_source"] == total(first)


def remaining_ttl(server, key: str) -> int | None:
    """The value's remaining TTL at ``server`` (meta get ``t``): -1 never expires, None
    no value."""
    import socket  # noqa: PLC0415
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
        s.sendall(f"mg {key} t\r\n".encode())
        line = b""
        while not line.endswith(b"\r\n"):
            got = s.recv(4096)
            assert got, "memcached closed the connection"
            line += got
    words = line.decode().split()
    if words[0] == "EN":
        return None
    assert words[0] == "HD", line
    return int(next(w[1:] for w in words[1:] if w.startswith("t")))


def test_values_get_an_expiry_once_an_order_is_announced(tmp_path, mount, servers):
    """Expiry at the last planned use: a file read before any order is known is stored
    with no expiry. Then epoch 0's order is announced and read (the loader's pace is
    measured), then epochs 1 and 2's orders at once, and epoch 1 is read through a cache
    smaller than the dataset: the files it evicts are kept at their owners with the
    expiry of their use in epoch 2 (a TTL within memcached's relative range), counted."""
    from dlcachefs.peers.servers import Rendezvous  # noqa: PLC0415
    src = tmp_path / "src"
    files = make_tree(src)
    by_name = {s.address: s for s in servers}
    h = Rendezvous(list(by_name))
    ns = os.fsencode(os.path.realpath(src))

    def ttl_of(p: Path) -> int | None:
        st = p.stat()
        ck = content_key(ns, os.fsencode(p.relative_to(src)), st.st_size, st.st_mtime_ns)
        return remaining_ttl(by_name[h.get_node(ck.key)], ck.key)

    def control(text: str) -> None:
        fd = os.open(m.mnt / ".dlcache" / "control", os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def order_lines(epoch: int, order: list[int]) -> str:
        return (f"order {epoch} 0 {' '.join(map(str, order))}\n"
                f"order {epoch} end {len(order)}\n")

    m = mount(src, "--peers", ",".join(by_name), "--peer-item-max", "8M", "--scan-ahead",
              "0", "--cache-size", "2M", "--chunk-size", "128K")
    # ImageFolder's order: classes sorted, files sorted in each
    imagefolder = sorted(files, key=lambda p: (p.parent.name, p.name))
    read_exact(m, src, imagefolder[:5])
    drained(m)
    assert [ttl_of(p) for p in imagefolder[:5]] == [-1] * 5
    orders = [random.Random(e).sample(range(len(files)), len(files)) for e in range(3)]
    control("job j\ndataset train\nsampler explicit\n" + order_lines(0, orders[0])
            + "epoch 0\n")
    read_exact(m, src, [imagefolder[i] for i in orders[0]])
    before = drained(m)["peers"]
    control("job j\n" + order_lines(1, orders[1]) + order_lines(2, orders[2]) + "epoch 1\n")
    read_exact(m, src, [imagefolder[i] for i in orders[1]])
    st = m.wait_stats(lambda st: st["peers"]["keep_offered"] > before["keep_offered"]
                      and st["peers"]["store_pending"] == 0, "epoch 1 evicted nothing")
    ttls = [ttl_of(p) for p in files]
    assert None not in ttls  # every value is there
    with_expiry = [t for t in ttls if t != -1]
    assert with_expiry, "no value got an expiry under a known order"
    assert all(0 < t <= 30 * 24 * 3600 for t in with_expiry)
    assert st["peers"]["expiries_set"] - before["expiries_set"] > 0
    assert st["peers"]["expiries_set"] >= len(with_expiry)


def test_a_distributed_sampler_gives_the_tier_every_ranks_use(tmp_path, mount, servers):
    """With --peers, a DistributedSampler's announcement makes the daemon compute every
    rank's order (the replay worker's global order), so the expiries it sets follow the
    cluster's last use, not only this node's rank: the stream says so
    (``cluster_ranks``), and the values this rank keeps in the tier at eviction get an
    expiry. (Values its first epoch's prefetch stores before the loader's pace is known
    get none: on a loaded machine that can be all of them, so the expiry is looked for
    in epoch 1, whose evictions offer values with the pace of epoch 0 known.)"""
    from torch.utils.data import DistributedSampler  # noqa: PLC0415

    src = tmp_path / "src"
    files = make_tree(src)
    imagefolder = sorted(files, key=lambda p: (p.parent.name, p.name))
    m = mount(src, "--peers", ",".join(s.address for s in servers), "--peer-item-max", "8M",
              "--scan-ahead", "0", "--cache-size", "2M", "--chunk-size", "128K")

    def control(text: bytes) -> None:
        fd = os.open(m.mnt / ".dlcache" / "control", os.O_WRONLY)
        try:
            os.write(fd, text)
        finally:
            os.close(fd)

    announce = b"job d\ndataset train\nsampler distributed seed=5 world=3 rank=1\n"
    control(announce + b"epoch 0\n")
    st = m.wait_stats(lambda st: (st["streams"].get("d/1") or {}).get("cluster_ranks") == 3,
                      "no cluster-wide order", timeout=120)
    assert st["streams"]["d/1"]["mode"] == "replayed", st["streams"]["d/1"]
    sampler = DistributedSampler(range(len(files)), num_replicas=3, rank=1, seed=5)
    sampler.set_epoch(0)
    read_exact(m, src, [imagefolder[i] for i in sampler])
    before = drained(m)["peers"]
    control(announce + b"epoch 1\n")
    m.wait_stats(lambda st: (st["streams"].get("d/1") or {}).get("epoch") == 1
                 and st["streams"]["d/1"].get("cluster_ranks") == 3, "epoch 1 not configured",
                 timeout=120)
    sampler.set_epoch(1)
    read_exact(m, src, [imagefolder[i] for i in sampler])
    st = m.wait_stats(lambda st: st["peers"]["keep_offered"] > before["keep_offered"]
                      and st["peers"]["store_pending"] == 0, "epoch 1 evicted nothing")
    assert st["peers"]["expiries_set"] > before["expiries_set"], st["peers"]


def test_an_owner_fetches_the_files_it_owns_for_the_other_ranks(tmp_path, mount, servers):
    """--peer-self: three nodes; only node 0 has announced its rank (0 of a
    DistributedSampler of world 3), the other ranks have not started. Node 0 walks the
    cluster's global order and fetches every file its own server owns, the other ranks'
    included: each is at its owner before anyone reads it. Files node 0 neither owns nor
    reads stay out of the tier. Then ranks 1 and 2 start and read: each file left the
    remote once across the cluster, every byte exact."""
    from torch.utils.data import DistributedSampler  # noqa: PLC0415

    from dlcachefs.peers.servers import Rendezvous  # noqa: PLC0415
    from dlcachefs.testing.mounting import wait_until  # noqa: PLC0415

    src = tmp_path / "src"
    files = make_tree(src)
    imagefolder = sorted(files, key=lambda p: (p.parent.name, p.name))
    by_name = {s.address: s for s in servers}
    h = Rendezvous(list(by_name))
    ns = os.fsencode(os.path.realpath(src))

    def key_of(p: Path):
        st = p.stat()
        return content_key(ns, os.fsencode(p.relative_to(src)), st.st_size, st.st_mtime_ns).key

    def announce(m, rank: int) -> None:
        fd = os.open(m.mnt / ".dlcache" / "control", os.O_WRONLY)
        try:
            os.write(fd, f"job d\ndataset train\nsampler distributed seed=9 world={NODES} "
                         f"rank={rank}\nepoch 0\n".encode())
        finally:
            os.close(fd)

    def rank_files(rank: int) -> list[Path]:
        sampler = DistributedSampler(range(len(files)), num_replicas=NODES, rank=rank, seed=9)
        sampler.set_epoch(0)
        return [imagefolder[i] for i in sampler]

    peers = ",".join(by_name)
    mounts = [mount(src, "--peers", peers, "--peer-self", servers[i].address,
                    "--peer-item-max", "8M", "--peer-lease", "60", "--peer-timeout", "2",
                    "--scan-ahead", "0", name=f"mnt{i}", cache=tmp_path / f"cache{i}")
              for i in range(NODES)]
    announce(mounts[0], 0)

    def walked() -> dict | None:
        st = mounts[0].stats()
        op = st["peers"].get("owner_prefetch") or {}
        s = st["streams"].get("d/0") or {}
        done = (s.get("cluster_ranks") == NODES and op.get("walk_left") == 0
                and op.get("in_flight") == 0 and st["peers"]["store_pending"] == 0
                and s.get("prefetch_lead", 0) + s.get("position", 0) >= s.get("samples", 1))
        return st if done else None

    st = wait_until(walked, "node 0 did not walk the cluster's order", timeout=180)
    assert st["peers"]["owner_prefetch"]["errors"] == 0, st["peers"]
    own = servers[0].address
    owned = [p for p in files if h.get_node(key_of(p)) == own]
    mine = set(rank_files(0))
    others = [p for p in owned if p not in mine]  # owned by node 0, read by ranks 1 and 2
    assert others and st["peers"]["owner_prefetch"]["files"] >= len(others)
    for p in owned:  # at its owner before any rank that reads it has started
        assert remaining_ttl(by_name[own], key_of(p)) is not None, p
    for p in files:  # nothing else went into the tier
        if p not in mine and p not in owned:
            assert remaining_ttl(by_name[h.get_node(key_of(p))], key_of(p)) is None, p
    for r in (1, 2):
        announce(mounts[r], r)
        read_exact(mounts[r], src, rank_files(r))
    read_exact(mounts[0], src, rank_files(0))
    after = [drained(m) for m in mounts]
    assert sum(a["bytes_from_source"] for a in after) == total(files)  # once per cluster


# sizes of the large-file test: 5 MB to 250 MB (under --max-cached-file's 256 MiB), 303 MB
# in all; the test takes ~25 s on 2 cores (the 250 MB file is read by 3 nodes, and each
# node writes what it read to its own cache)
LARGE_SIZES = {"shards/shard-000000.tar": 5_000_000,
               "shards/shard-000001.tar": 48_000_000,
               "shards/shard-000002.tar": 250_000_000}


@pytest.mark.daemon_log_allows(r"WARNING dlcachefs\.peers\.tier: peer \S+: refused piece \d+ ")
def test_large_files_leave_the_source_once_in_pieces(tmp_path, mount):
    """Three nodes read 5, 48 and 250 MB files at once, each in its own order, over
    servers whose item limit is 1 MB (memcached -I 1m, --peer-item-max 1M): each file
    leaves the source once for the cluster (stored in pieces by the node that read it,
    read back from the pieces by the others), every byte exact on every node. Then a
    damaged piece and an evicted one: a fourth node reads those files from the source,
    exact, and every other from the pieces."""
    from pymemcache.client.hash import HashClient  # noqa: PLC0415

    from dlcachefs.peers.servers import Rendezvous  # noqa: PLC0415
    from dlcachefs.peers.valuefmt import piece_key, piece_size_for  # noqa: PLC0415
    src = tmp_path / "src"
    rnd = random.Random(35)
    for rel, size in LARGE_SIZES.items():
        p = src / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        with open(p, "wb") as f:  # random blocks: no piece equals another
            for off in range(0, size, 1 << 20):
                f.write(rnd.randbytes(min(1 << 20, size - off)))
    rels = list(LARGE_SIZES)
    large = sum(LARGE_SIZES.values())
    with memcached_cluster(NODES, tmp_path / "memcached", memory_mb=256, item_mb=1) as servers:
        peers = ",".join(m.address for m in servers)
        opts = ("--peers", peers, "--peer-item-max", "1M", "--peer-lease", "120",
                "--peer-timeout", "5")
        mounts = [mount(src, *opts, name=f"mnt{i}", cache=tmp_path / f"cache{i}")
                  for i in range(NODES)]
        lists = [rels[r:] + rels[:r] for r in range(NODES)]  # each starts on another file
        want = {rel: sha_of(src, rel) for rel in rels}
        for out in run_ranks(mounts, lists, tmp_path):
            assert out == want
        stats = [drained(m) for m in mounts]
        detail = [st["peers"] for st in stats]
        assert sum(st["bytes_from_source"] for st in stats) == large, detail
        assert sum(st["bytes_from_peers"] for st in stats) == (NODES - 1) * large, detail
        tiers = [st["peers"] for st in stats]
        assert sum(t["pieced_stored"] for t in tiers) == len(rels), detail
        assert sum(t["pieced_hits"] for t in tiers) == (NODES - 1) * len(rels), detail
        assert all(t["lease_wait_timeouts"] == 0 and t["store_dropped"] == 0
                   and t["pieced_store_failures"] == 0 for t in tiers), detail

        # a flipped bit in a piece of one file, a piece of another evicted
        hc = HashClient([("127.0.0.1", m.port) for m in servers], default_noreply=False,
                        hasher=Rendezvous)
        try:
            ns = os.fsencode(os.path.realpath(src))
            damaged, evicted = rels[1], rels[0]
            for rel, how in ((damaged, "flip"), (evicted, "delete")):
                st = (src / rel).stat()
                ck = content_key(ns, rel.encode(), st.st_size, st.st_mtime_ns)
                k = piece_key(ck, piece_size_for(ck, 1 << 20), 3)
                if how == "delete":
                    assert hc.delete(k)
                else:
                    v = bytearray(hc.get(k))
                    v[len(v) // 2] ^= 1
                    hc.set(k, bytes(v))
        finally:
            hc.close()
        d = mount(src, *opts, name="mnt3", cache=tmp_path / "cache3")
        assert run_ranks([d], [rels], tmp_path)[0] == want
        st = drained(d)
        assert st["bytes_from_source"] == LARGE_SIZES[damaged] + LARGE_SIZES[evicted]
        assert st["bytes_from_peers"] == large - st["bytes_from_source"]
        t = st["peers"]
        assert (t["pieced_rejected"], t["pieced_misses"], t["pieced_hits"]) == (1, 1, 1)
        assert t["pieced_stored"] == 2  # the node that read them stored them again
        for m in (*mounts, d):
            m.umount()  # before the servers stop: no store is left to fail
