"""Tier 3: the peer tier (--peers) in the core, over real memcached servers (extstore on
temp files) and engines with a counting source: files read by one node are served to the
others by their owner; what must not be served (another version, a damaged or foreign
value) is not; a hung server costs its timeout once and is marked down."""

from __future__ import annotations

import os
import socket
from concurrent.futures import ThreadPoolExecutor

import pytest

pymemcache = pytest.importorskip("pymemcache")

from pymemcache.client.hash import HashClient  # noqa: E402

from dlcachefs.cache.source import Identity  # noqa: E402
from dlcachefs.peers.servers import Rendezvous  # noqa: E402
from dlcachefs.peers.valuefmt import content_key, encode  # noqa: E402
from dlcachefs.testing.fakes import (  # noqa: E402
    CountingSource,
    SlowSource,
    make_config,
    read_all,
    run_engine,
    run_session,
    write_tree,
)
from dlcachefs.testing.memcached import Memcached, cluster, memcached_available  # noqa: E402

pytestmark = pytest.mark.skipif(not memcached_available(), reason="needs memcached")


def _tree(n: int = 40) -> dict[bytes, bytes]:
    return {b"c%d/f%03d.bin" % (i % 3, i): os.urandom(1000 + 997 * i) for i in range(n)}


@pytest.fixture
def servers(tmp_path):
    with cluster(3, tmp_path / "mc") as ms:
        yield ms


def _read_everything(files, cfg, src, drain=True):
    async def body(eng):
        out = {rel: await read_all(eng, rel) for rel in files}
        if drain:
            assert await eng.fetcher.peers.drain()
        return out
    return run_engine(cfg, body, src)


def _cfg(tmp_path, name, peers, **kw):
    return make_config(tmp_path / "src", tmp_path / name, peers=",".join(peers),
                       peer_item_max=8 << 20, **kw)


def test_a_file_leaves_the_source_once_for_the_cluster(tmp_path, servers):
    files = _tree()
    write_tree(tmp_path / "src", files)
    peers = [m.address for m in servers]
    total = sum(map(len, files.values()))
    src_a = CountingSource(tmp_path / "src")
    got, a = _read_everything(files, _cfg(tmp_path, "a", peers), src_a)
    assert got == files
    assert a.counters.bytes_from_source == total and a.counters.bytes_from_peers == 0
    st = a.fetcher.peers.stats()
    assert st["leases"] == len(files) and st["store_dropped"] == 0
    assert sum(s["stored"] for s in st["servers"].values()) == len(files)
    # every server owns a share (rendezvous over 3)
    assert all(s["stored"] > 0 for s in st["servers"].values())

    for name in ("b", "c"):  # other nodes, their own caches: the tier serves everything
        src = CountingSource(tmp_path / "src")
        got, eng = _read_everything(files, _cfg(tmp_path, name, peers), src)
        assert got == files
        assert src.calls["read_file"] == 0
        assert eng.counters.bytes_from_source == 0
        assert eng.counters.bytes_from_peers == total
        st = eng.fetcher.peers.stats()
        assert sum(s["hits"] for s in st["servers"].values()) == len(files)
        assert st["leases"] == 0


@pytest.mark.daemon_log_allows(r"WARNING dlcachefs\.peers\.tier: peer \S+: refused a value of ")
def test_a_damaged_or_foreign_value_is_never_served(tmp_path, servers):
    files = _tree(12)
    write_tree(tmp_path / "src", files)
    peers = [m.address for m in servers]
    cfg_a = _cfg(tmp_path, "a", peers)
    _read_everything(files, cfg_a, CountingSource(tmp_path / "src"))
    # overwrite every value, each a different way, directly with pymemcache (a plain
    # HashClient finds the same owner as the mount: the same rendezvous hash)
    hc = HashClient([tuple(a.split(":")) for a in peers], default_noreply=False,
                    hasher=Rendezvous)
    ns = os.fsencode(os.path.realpath(tmp_path / "src"))
    bad = {}
    for i, (rel, data) in enumerate(sorted(files.items())):
        st = os.stat(tmp_path / "src" / os.fsdecode(rel))
        ck = content_key(ns, rel, st.st_size, st.st_mtime_ns)
        good = encode(ck, data)
        kind = i % 6
        if kind == 0:  # one flipped bit in the file bytes
            v = bytearray(good)
            v[-1] ^= 1
        elif kind == 1:  # cut short
            v = good[:-10]
        elif kind == 2:  # trailing bytes
            v = good + b"x"
        elif kind == 3:  # another file's value under this key
            other = sorted(files)[(i + 1) % len(files)]
            ost = os.stat(tmp_path / "src" / os.fsdecode(other))
            v = encode(content_key(ns, other, ost.st_size, ost.st_mtime_ns), files[other])
        elif kind == 4:  # another version of this file (older mtime)
            v = encode(content_key(ns, rel, st.st_size, st.st_mtime_ns - 1), data)
        else:  # not ours at all
            v = b"hello"
        assert hc.get(ck.key) is not None  # the mount stored it where HashClient looks
        hc.set(ck.key, bytes(v))
        bad[rel] = kind
    src = CountingSource(tmp_path / "src")
    got, eng = _read_everything(files, _cfg(tmp_path, "b", peers), src)
    assert got == files  # exact: every damaged value was refused
    assert eng.counters.bytes_from_peers == 0
    assert src.calls["read_file"] == len(files)
    st = eng.fetcher.peers.stats()
    assert sum(s["rejected"] for s in st["servers"].values()) == len(files)
    # and the node that refused them stored the good value again
    got, c = _read_everything(files, _cfg(tmp_path, "c", peers), CountingSource(tmp_path / "src"))
    assert got == files and c.counters.bytes_from_source == 0


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.peers\.tier: peer \S+ marked down for \d+ s: no answer within ")
def test_a_hung_server_costs_its_timeout_once(tmp_path, servers, caplog):
    files = _tree(30)
    write_tree(tmp_path / "src", files)
    # a server that accepts connections (the kernel's backlog) and never answers
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)
    try:
        addr = f"127.0.0.1:{hung.getsockname()[1]}"
        peers = [servers[0].address, addr, servers[1].address]
        src = CountingSource(tmp_path / "src")
        cfg = _cfg(tmp_path, "a", peers, peer_timeout=0.5, peer_dead_time=600)
        got, eng = _read_everything(files, cfg, src)
        assert got == files
        st = eng.fetcher.peers.stats()["servers"][addr]
        assert st["state"] == "down" and st["marked_down"] == 1
        assert st["hits"] == st["misses"] == st["stored"] == 0
        # its share went to the others: each file was stored by a live server
        live = [eng.fetcher.peers.stats()["servers"][m.address] for m in servers[:2]]
        assert sum(s["stored"] for s in live) == len(files)
        # a second node pays the timeout once too, then never asks it again
        src_b = CountingSource(tmp_path / "src")
        got, b = _read_everything(files, _cfg(tmp_path, "b", peers, peer_timeout=0.5,
                                              peer_dead_time=600), src_b)
        assert got == files
        # its share was stored at the others by node a: served from there
        sb = b.fetcher.peers.stats()["servers"][addr]
        assert sb["marked_down"] == 1
        assert b.counters.bytes_from_peers + b.counters.bytes_from_source == sum(
            map(len, files.values()))
        # one at a time: only the lookup that met its timeout went to the source
        assert src_b.calls["read_file"] == 1
    finally:
        hung.close()


def test_without_peers_nothing_changes(tmp_path):
    files = _tree(5)
    write_tree(tmp_path / "src", files)
    cfg = make_config(tmp_path / "src", tmp_path / "a")

    async def body(sess):
        eng = sess.engine
        assert sess.peers is None and eng.fetcher.peers is None
        assert sess.stats()["peers"] is None
        return {rel: await read_all(eng, rel) for rel in files}
    got, sess = run_session(cfg, body, CountingSource(tmp_path / "src"))
    eng = sess.engine
    assert got == files
    assert eng.counters.bytes_from_peers == 0


def test_the_content_key_names_one_version():
    """The content key is the listed version's: a changed mtime is another key."""
    ns = b"/x"
    a = content_key(ns, b"a/b", 10, 5)
    assert a == content_key(ns, b"a/b", 10, 5)
    assert a.key != content_key(ns, b"a/b", 10, 6).key
    assert a.key != content_key(ns, b"a/c", 10, 5).key
    assert a.key != content_key(b"/y", b"a/b", 10, 5).key
    assert len(a.key) < 250 and a.key.isascii() and " " not in a.key


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.peers\.tier: peer \S+ marked down for \d+ s: \S+: ConnectionRefusedError")
def test_a_server_back_up_is_found_by_the_probe_and_owns_its_share_again(tmp_path, servers):
    """A killed server is marked down at its first failure; once it answers again the
    background probe (every --peer-dead-time) brings it back, and its keys return to it:
    the files it owns are stored there again."""
    import trio

    from dlcachefs.cache.namespace import identity

    files = _tree(30)
    write_tree(tmp_path / "src", files)
    peers = [m.address for m in servers]
    cfg = _cfg(tmp_path, "a", peers, peer_timeout=0.5, peer_dead_time=0.2)
    rels = sorted(files)
    victim = None

    async def body(eng):
        nonlocal victim
        # the victim owns the first file: the first reads must meet it (a fixed victim
        # owned none of 15 random-port-hashed keys once in a few hundred runs)
        e = eng.ns.resolve(rels[0])
        owner = eng.fetcher.peers.owner(eng.fetcher.peers.key_of(rels[0], identity(e)))
        victim = next(m for m in servers if m.address == owner)
        victim.kill9()
        first = {rel: await read_all(eng, rel) for rel in rels[:15]}
        st = eng.fetcher.peers.stats()["servers"][victim.address]
        assert st["state"] == "down" and st["marked_down"] == 1 and st["stored"] == 0
        await trio.to_thread.run_sync(victim.restart)
        with trio.fail_after(30):
            while eng.fetcher.peers.stats()["servers"][victim.address]["state"] != "up":
                await trio.sleep(0.05)
        rest = {rel: await read_all(eng, rel) for rel in rels[15:]}
        assert await eng.fetcher.peers.drain()
        return {**first, **rest}
    got, eng = run_engine(cfg, body, CountingSource(tmp_path / "src"))
    assert got == files
    st = eng.fetcher.peers.stats()["servers"][victim.address]
    assert st["marked_down"] == 1 and st["marked_down_s"] > 0
    assert st["stored"] > 0  # its share of the second half went to it


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.peers\.tier: peer \S+ marked down for \d+ s: (test: seen down|\S+: ConnectionRefusedError)")
def test_a_server_back_from_down_is_refilled_from_the_next_one(tmp_path, servers):
    """Node a reads everything while one server is dead (its share is stored at the
    next server by rendezvous order); the server comes back empty; node b reads
    everything: the dead server's share is found at the next server (and stored at its
    owner again), nothing is read from the source twice."""
    import trio

    files = _tree(30)
    write_tree(tmp_path / "src", files)
    peers = [m.address for m in servers]
    victim = servers[1]
    victim.kill9()
    kw = dict(peer_timeout=0.5, peer_dead_time=0.2)
    _, a = _read_everything(files, _cfg(tmp_path, "a", peers, **kw),
                            CountingSource(tmp_path / "src"))
    assert a.counters.bytes_from_source == sum(map(len, files.values()))
    victim.restart()
    src = CountingSource(tmp_path / "src")

    async def body(eng):
        # the node sees the server down once, then up again (the probe)
        eng.fetcher.peers._mark_down(victim.address, "test: seen down")
        with trio.fail_after(30):
            while eng.fetcher.peers.stats()["servers"][victim.address]["state"] != "up":
                await trio.sleep(0.05)
        out = {rel: await read_all(eng, rel) for rel in files}
        assert await eng.fetcher.peers.drain()
        return out
    got, b = run_engine(_cfg(tmp_path, "b", peers, **kw), body, src)
    assert got == files
    assert src.calls["read_file"] == 0 and b.counters.bytes_from_source == 0
    st = b.fetcher.peers.stats()
    assert st["refills"] > 0
    assert st["servers"][victim.address]["stored"] == st["refills"]  # its share, back


class _HungListener:
    """A server that accepts connections and never answers; counts what it accepted."""

    def __init__(self) -> None:
        import threading
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(10)
        for c in self.conns:
            c.close()


def _start_reads(nursery, eng, files) -> dict:
    """Every file read at once in ``nursery``; the dict fills as the reads end."""
    out = {}

    async def one(rel):
        out[rel] = await read_all(eng, rel)
    for rel in files:
        nursery.start_soon(one, rel)
    return out


def _read_concurrently(files, cfg, src):
    import trio

    async def body(eng):
        async with trio.open_nursery() as n:
            out = _start_reads(n, eng, files)
        assert await eng.fetcher.peers.drain()
        return out
    return run_engine(cfg, body, src)


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.peers\.tier: peer \S+ marked down for \d+ s: no answer within ")
def test_many_lookups_at_a_hung_server_pay_its_timeout_once(tmp_path):
    """24 readers at once, every file owned by a server that accepts and never answers:
    the first admitted lookups time out and mark it down; the lookups queued for a slot
    meanwhile do not call it again (at most LOOKUP_THREADS connections), nothing escapes
    to a reader (not pymemcache's pool running out either), it is marked down once."""
    from dlcachefs.peers.tier import LOOKUP_THREADS

    files = _tree(24)
    write_tree(tmp_path / "src", files)
    hung = _HungListener()
    try:
        cfg = _cfg(tmp_path, "a", [hung.address], peer_timeout=0.5, peer_dead_time=600)
        src = CountingSource(tmp_path / "src")
        got, eng = _read_concurrently(files, cfg, src)
        assert got == files
        accepted = len(hung.conns)
        st = eng.fetcher.peers.stats()
        assert st["servers"][hung.address]["marked_down"] == 1
        assert 1 <= accepted <= LOOKUP_THREADS, accepted
        assert st["lookup_failures"] == st["store_failures"] == 0
        assert src.calls["read_file"] == len(files)
    finally:
        hung.close()


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.peers\.servers: peer \S+: unexpected failure RuntimeError")
def test_an_unexpected_failure_of_a_call_is_a_miss_and_never_ends_the_tier(tmp_path, servers):
    """pymemcache's pool raises RuntimeError('Too many objects') when it is full: on the
    read path it is a miss (the source serves, exact bytes), on the store path one
    failed store (counted); the store workers go on. The pool is as large as the threads
    that may hold its connections."""
    files = _tree(12)
    write_tree(tmp_path / "src", files)
    peers = [m.address for m in servers]
    rels = sorted(files)

    def full(*a, **kw):
        raise RuntimeError("Too many objects, 16 >= 16")

    async def body(eng):
        tier = eng.fetcher.peers
        for c in tier.servers.clients.values():
            assert c.client_pool.max_size >= tier._threads.total_tokens
        real = {n: c.get_many for n, c in tier.servers.clients.items()}
        for c in tier.servers.clients.values():
            c.get_many = full
            c.set = full
        out = {rel: await read_all(eng, rel) for rel in rels[:6]}  # lookups fail
        for n, c in tier.servers.clients.items():
            c.get_many = real[n]
        out |= {rel: await read_all(eng, rel) for rel in rels[6:]}  # stores fail
        assert await tier.drain()
        for c in tier.servers.clients.values():
            del c.set
        # the store workers still run: what is read now is stored
        tier.store_later(rels[0], _ident(tmp_path, rels[0]), files[rels[0]])
        assert await tier.drain()
        return out
    got, eng = run_engine(_cfg(tmp_path, "a", peers), body, CountingSource(tmp_path / "src"))
    assert got == files
    st = eng.fetcher.peers.stats()
    # 6 lookups failed, then 12 stores (the 6 read after the failed lookups too)
    assert sum(s["errors"] for s in st["servers"].values()) == 6 + 12
    assert sum(s["stored"] for s in st["servers"].values()) == 1
    assert st["lookup_failures"] == st["store_failures"] == 0


def _ident(tmp_path, rel):
    from dlcachefs.cache.source import Identity
    st = os.stat(tmp_path / "src" / os.fsdecode(rel))
    return Identity(st.st_size, st.st_mtime_ns, st.st_ino)


def _client(address: str):
    from pymemcache.client.base import Client
    host, port = address.split(":")
    return Client((host, int(port)), default_noreply=False)


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.peers\.servers: peer \S+ refused a value as too large")
def test_a_store_refused_as_too_large_releases_its_lease(tmp_path, caplog):
    """--peer-item-max (8M) above the server's -I (1m): the set of a 1.5 MB file is
    refused; its lease is deleted all the same (the other nodes do not wait --peer-lease
    for it), and the mismatch is logged as a warning."""
    import logging
    files = {b"big.bin": os.urandom(1_500_000), b"small.bin": os.urandom(5000)}
    write_tree(tmp_path / "src", files)
    with Memcached(tmp_path / "mc", item_mb=1) as m:
        with caplog.at_level(logging.WARNING, logger="dlcachefs.peers"):
            got, a = _read_everything(files, _cfg(tmp_path, "a", [m.address]),
                                      CountingSource(tmp_path / "src"))
        assert got == files
        st = a.fetcher.peers.stats()
        assert st["leases"] == 2
        assert st["servers"][m.address]["stored"] == 1  # the small one
        assert st["servers"][m.address]["errors"] == 1
        ck = a.fetcher.peers.key_of(b"big.bin", _ident(tmp_path, b"big.bin"))
        mc = _client(m.address)
        try:
            assert mc.get(ck.lease) is None, "the lease was left behind"
            assert mc.get(ck.key) is None
        finally:
            mc.close()
        assert "-I" in caplog.text and "too large" in caplog.text
        # another node reads it at once: takes the lease itself, no wait
        got, b = _read_everything(files, _cfg(tmp_path, "b", [m.address]),
                                  CountingSource(tmp_path / "src"))
        assert got == files
        assert b.fetcher.peers.stats()["lease_waits"] == 0


def _hold_lease(tmp_path, address: str, rel: bytes) -> None:
    """Another node's lease on ``rel`` (written directly, expiring in a minute)."""
    ns = os.fsencode(os.path.realpath(tmp_path / "src"))
    st = os.stat(tmp_path / "src" / os.fsdecode(rel))
    ck = content_key(ns, rel, st.st_size, st.st_mtime_ns)
    mc = _client(address)
    try:
        assert mc.add(ck.lease, b"1", expire=60)
    finally:
        mc.close()


@pytest.mark.daemon_log_allows(
    r"WARNING dlcachefs\.peers\.tier: peer \S+ marked down for \d+ s: test: gone")
def test_a_lease_wait_counts_one_miss_and_tells_an_owner_gone_from_a_timeout(tmp_path, servers):
    """A lookup that waits for another node's lease polls the owner many times: one miss
    is counted (per lookup). A wait that ends because --peer-lease passed is a
    lease_wait_timeout; one that ends because the owner went down is lease_wait_owner_down."""
    import trio

    files = {b"a.bin": os.urandom(3000), b"b.bin": os.urandom(4000)}
    write_tree(tmp_path / "src", files)
    m = servers[0]
    _hold_lease(tmp_path, m.address, b"a.bin")
    got, eng = run_engine(_cfg(tmp_path, "a", [m.address], peer_lease=1),
                          lambda eng: read_all(eng, b"a.bin"), CountingSource(tmp_path / "src"))
    assert got == files[b"a.bin"]
    st = eng.fetcher.peers.stats()
    assert st["servers"][m.address]["misses"] == 1
    assert st["lease_waits"] == 1 and st["lease_wait_timeouts"] == 1
    assert st["lease_wait_owner_down"] == 0

    _hold_lease(tmp_path, m.address, b"b.bin")

    async def body(eng):
        out = []
        async with trio.open_nursery() as n:
            async def reader():
                out.append(await read_all(eng, b"b.bin"))
            n.start_soon(reader)
            with trio.fail_after(30):
                while eng.fetcher.peers.stats()["lease_waits"] == 0:
                    await trio.sleep(0.01)
            eng.fetcher.peers._mark_down(m.address, "test: gone")
        return out[0]
    got, eng = run_engine(_cfg(tmp_path, "b", [m.address], peer_lease=60, peer_dead_time=600),
                          body, CountingSource(tmp_path / "src"))
    assert got == files[b"b.bin"]
    st = eng.fetcher.peers.stats()
    assert st["lease_waits"] == 1 and st["lease_wait_owner_down"] == 1
    assert st["lease_wait_timeouts"] == 0
    assert st["servers"][m.address]["misses"] == 1


def test_a_test_memcached_that_logs_a_lot_does_not_block(tmp_path):
    """The test helper's memcached writes its stderr to a file: with -vv (a line per
    command) it logs far more than a pipe holds (64 KiB), and still answers every call."""

    class Verbose(Memcached):
        def argv(self):
            return [*super().argv(), "-vv"]

    with Verbose(tmp_path / "mc") as m:
        host, port = m.address.split(":")
        from pymemcache.client.base import Client
        mc = Client((host, int(port)), default_noreply=False, timeout=10, connect_timeout=10)
        try:
            for i in range(3000):
                assert mc.set(f"k{i}", b"v" * 10)
        finally:
            mc.close()
        assert m.log_path.stat().st_size > 64 << 10


def test_with_peer_key_inode_a_replaced_file_of_the_same_size_and_mtime_is_another_key(
        tmp_path, servers):
    """A file replaced atomically by one of the same size and mtime (1-second mtimes,
    ``touch -r``): by default the content key (path, size, mtime) is the same; with
    --peer-key-inode the source inode is in it, so a node reading the new file does
    not get the old one's value from the tier: exact new bytes."""
    from dlcachefs.cache.source import Identity
    from dlcachefs.peers.tier import PeerTier

    peers = [m.address for m in servers[:1]]
    old, new = os.urandom(5000), os.urandom(5000)
    write_tree(tmp_path / "src", {b"x.bin": old})
    path = tmp_path / "src" / "x.bin"
    st0 = os.stat(path)
    got, _ = _read_everything({b"x.bin": old}, _cfg(tmp_path, "a", peers, peer_key_inode=True),
                              CountingSource(tmp_path / "src"))
    assert got == {b"x.bin": old}
    tmp = tmp_path / "src" / "x.bin.tmp"
    tmp.write_bytes(new)
    os.utime(tmp, ns=(st0.st_atime_ns, st0.st_mtime_ns))
    os.replace(tmp, path)
    st1 = os.stat(path)
    assert (st1.st_size, st1.st_mtime_ns) == (st0.st_size, st0.st_mtime_ns)
    assert st1.st_ino != st0.st_ino
    src = CountingSource(tmp_path / "src")
    got, b = _read_everything({b"x.bin": new}, _cfg(tmp_path, "b", peers, peer_key_inode=True),
                              src)
    assert got == {b"x.bin": new}
    assert b.counters.bytes_from_peers == 0 and src.calls["read_file"] == 1

    # the key itself: the inode counts only with the option
    i0, i1 = (Identity(s.st_size, s.st_mtime_ns, s.st_ino) for s in (st0, st1))
    with_ino = PeerTier(_cfg(tmp_path, "c", peers, peer_key_inode=True), b"/src")
    plain = PeerTier(_cfg(tmp_path, "d", peers), b"/src")
    try:
        assert with_ino.key_of(b"x.bin", i0).key != with_ino.key_of(b"x.bin", i1).key
        assert plain.key_of(b"x.bin", i0) == plain.key_of(b"x.bin", i1)
        assert plain.key_of(b"x.bin", i0) == content_key(b"/src", b"x.bin", st0.st_size,
                                                         st0.st_mtime_ns)
    finally:
        with_ino.servers.close()
        plain.servers.close()


def test_a_node_leases_only_what_it_can_read_at_once(tmp_path, servers):
    """10 fetches at once on a node with --source-threads 2 and a source that hangs: the
    lease (which makes the other nodes wait) is taken once a source slot is held, so 2
    leases exist in memcached, not 10 queued behind this node's source reads; every
    lookup asked the tier (10 misses)."""
    import trio

    from dlcachefs.testing.fakes import HangingSource

    files = _tree(10)
    write_tree(tmp_path / "src", files)
    m = servers[0]
    src = HangingSource(tmp_path / "src")
    cfg = _cfg(tmp_path, "a", [m.address], source_threads=2, scan_ahead=0)

    def leases_in_memcached(eng) -> int:
        mc = _client(m.address)
        try:
            keys = [eng.fetcher.peers.key_of(rel, _ident(tmp_path, rel)).lease for rel in files]
            return len(mc.get_many(keys))
        finally:
            mc.close()

    async def body(eng):
        async with trio.open_nursery() as n:
            out = _start_reads(n, eng, files)
            with trio.fail_after(30):
                # every lookup asked, and the two that hold a slot leased
                while (eng.fetcher.peers.stats()["servers"][m.address]["misses"] < len(files)
                       or eng.fetcher.peers.stats()["leases"] < 2 or not src.entered.is_set()):
                    await trio.sleep(0.01)
            held = await trio.to_thread.run_sync(leases_in_memcached, eng)
            leases = eng.fetcher.peers.stats()["leases"]
            src.release()
        assert await eng.fetcher.peers.drain()
        return out, held, leases
    (got, held, leases), eng = run_engine(cfg, body, src)
    assert got == files
    assert held == 2 and leases == 2
    st = eng.fetcher.peers.stats()
    assert st["leases"] == len(files)  # each read in turn, each stored for the cluster
    assert st["servers"][m.address]["stored"] == len(files)


def test_a_call_waiting_for_a_thread_does_not_count_the_wait_against_its_server(
        tmp_path, servers):
    """Every thread of the tier taken (as by the abandoned calls of hung servers): a
    lookup at a healthy server waits for a thread before its --peer-timeout starts, so
    the server is not marked down however long the wait; the file is served exactly."""
    import trio

    files = _tree(3)
    write_tree(tmp_path / "src", files)
    peers = [servers[0].address]
    _read_everything(files, _cfg(tmp_path, "a", peers), CountingSource(tmp_path / "src"))
    rel = sorted(files)[0]

    async def body(eng):
        threads = eng.fetcher.peers._threads
        held = [object() for _ in range(int(threads.total_tokens))]
        for b in held:
            threads.acquire_on_behalf_of_nowait(b)
        out = []
        async with trio.open_nursery() as n:
            async def reader():
                out.append(await read_all(eng, rel))
            n.start_soon(reader)
            with trio.fail_after(30):
                while eng.fetcher.peers.stats()["lookups"] == 0:
                    await trio.sleep(0.01)
            await trio.sleep(4 * eng.fetcher.peers.timeout)  # longer than --peer-timeout: no answer
            assert not out  # it waits for a thread
            for b in held:
                threads.release_on_behalf_of(b)
        return out[0]
    got, eng = run_engine(_cfg(tmp_path, "b", peers, peer_timeout=0.25), body,
                          CountingSource(tmp_path / "src"))
    assert got == files[rel]
    st = eng.fetcher.peers.stats()["servers"][peers[0]]
    assert st["marked_down"] == 0 and st["errors"] == 0 and st["hits"] == 1


def _ttl(address: str, key: str) -> int | None:
    """A value's remaining TTL (memcached's meta get ``t``): -1 never, None no value."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(f"mg {key} t\r\n".encode())
        line = b""
        while not line.endswith(b"\r\n"):
            got = s.recv(4096)
            assert got
            line += got
    words = line.decode().split()
    if words[0] == "EN":
        return None
    return int(next(w[1:] for w in words[1:] if w.startswith("t")))


def test_the_expiry_the_tier_computes_is_the_one_memcached_gets(tmp_path, servers):
    """Each stored value gets exactly the expiry ``expiry_of`` gives for its inode (0: a
    value that never expires); a record kept at eviction whose owner holds it is touched
    with its own (counted held, not pushed)."""
    files = _tree(12)
    write_tree(tmp_path / "src", files)
    peers = [m.address for m in servers]
    h = Rendezvous(peers)
    want: dict[bytes, int] = {}

    async def body(eng):
        rels = {eng.ns.resolve(rel).ino: rel for rel in files}
        eng.fetcher.peers.expiry_of = lambda ino: 0 if ino % 3 == 0 else 5000 + 100 * ino
        for ino, rel in rels.items():
            want[rel] = eng.fetcher.peers.expiry_of(ino)
            assert await read_all(eng, rel) == files[rel]
        assert await eng.fetcher.peers.drain()
        # an evicted record whose owner holds it: touched with its expiry, not pushed
        ino, rel = next((i, r) for i, r in rels.items() if i % 3 == 0)
        e = eng.ns.resolve(rel)
        eng.fetcher.peers.expiry_of = lambda _ino: 7777
        want[rel] = 7777
        eng.fetcher.peers.keep([(ino, rel, Identity(e.size, e.mtime_ns, e.src_ino), files[rel])], 0)
        assert await eng.fetcher.peers.drain()
        st = eng.fetcher.peers.stats()
        assert (st["keep_offered"], st["keep_held"], st["keep_pushed"]) == (1, 1, 0)

    _, eng = run_engine(_cfg(tmp_path, "a", peers), body, CountingSource(tmp_path / "src"))
    ns = os.fsencode(os.path.realpath(tmp_path / "src"))
    for rel, data in files.items():
        st = os.stat(tmp_path / "src" / os.fsdecode(rel))
        ck = content_key(ns, rel, len(data), st.st_mtime_ns)
        ttl = _ttl(h.get_node(ck.key), ck.key)
        if want[rel] == 0:
            assert ttl == -1, rel
        else:  # memcached counts down in whole seconds: a test run is far shorter than 60
            assert want[rel] - 60 < ttl <= want[rel], (rel, ttl, want[rel])
    # the stores with an expiry, and the touch
    assert eng.fetcher.peers.stats()["expiries_set"] == sum(1 for v in want.values() if v)


@pytest.mark.daemon_log_allows(r"WARNING dlcachefs\.peers\.tier: peer \S+: refused piece \d+ ")
def test_a_file_larger_than_an_item_is_shared_in_checked_pieces(tmp_path, servers):
    """--peer-item-max 1M and a 5 MB file: one node stores it in pieces spread over the
    servers (and a manifest); the others read it back from the pieces, none from the
    source. A damaged piece, then a missing one (evicted): the file comes from the
    source with exact bytes, and that node stores it again."""
    from dlcachefs.peers.valuefmt import piece_key, piece_size_for
    big = os.urandom(5 << 20) + b"tail"
    files = {b"shards/big.tar": big, b"small/a.bin": os.urandom(3000),
             b"small/b.bin": os.urandom(70_000)}
    write_tree(tmp_path / "src", files)
    peers = [m.address for m in servers]
    total = sum(map(len, files.values()))

    def node(name, src=None):
        src = src or CountingSource(tmp_path / "src")
        cfg = make_config(tmp_path / "src", tmp_path / name, peers=",".join(peers),
                          peer_item_max=1 << 20)
        got, eng = _read_everything(files, cfg, src)
        assert got == files  # exact, always
        return src, eng, eng.fetcher.peers.stats()

    src, a, st = node("a")
    assert a.counters.bytes_from_source == total
    ck = a.fetcher.peers.key_of(b"shards/big.tar", _ident(tmp_path, b"shards/big.tar"))
    ps = piece_size_for(ck, 1 << 20)
    n = -(-len(big) // ps)
    assert n > 5 and st["pieced_stored"] == 1 and st["pieces_stored"] == n
    assert st["pieced_store_failures"] == 0 and st["store_dropped"] == 0
    # spread over the servers by rendezvous over each piece's own key (not all at the
    # file's owner): each server stored what that hash gives it, the pieces, the manifest
    # (at the file's owner) and the small files whole. (Asserting that every server holds
    # a piece failed one run in four: 6 pieces over 3 servers.)
    tier = a.fetcher.peers
    owners = [tier.servers.owner(piece_key(ck, ps, i), frozenset()) for i in range(n)]
    owners += [tier.servers.owner(tier.key_of(rel, _ident(tmp_path, rel)).key, frozenset())
               for rel in files]  # (big.tar's: its manifest)
    assert {k: s["stored"] for k, s in st["servers"].items()} == {
        k: owners.count(k) for k in st["servers"]}

    src, b, st = node("b")
    assert src.calls["read_file"] == 0 and b.counters.bytes_from_source == 0
    assert b.counters.bytes_from_peers == total
    assert (st["pieced_hits"], st["pieced_bytes"]) == (1, len(big))

    hc = HashClient([tuple(a.split(":")) for a in peers], default_noreply=False,
                    hasher=Rendezvous)
    try:
        k = piece_key(ck, ps, n // 2)
        v = bytearray(hc.get(k))
        v[-7] ^= 4  # one flipped bit in a piece's bytes
        hc.set(k, bytes(v))
        src, c, st = node("c")
        assert src.calls["read_file"] == 1 and c.counters.bytes_from_source == len(big)
        assert st["pieced_rejected"] == 1 and st["pieced_hits"] == 0
        assert st["pieced_stored"] == 1  # stored again: the damaged piece replaced
        src, _, st = node("d")
        assert src.calls["read_file"] == 0 and st["pieced_hits"] == 1

        hc.delete(piece_key(ck, ps, n - 1))  # the last piece evicted
        src, e, st = node("e")
        assert src.calls["read_file"] == 1 and e.counters.bytes_from_source == len(big)
        assert st["pieced_misses"] == 1 and st["pieced_stored"] == 1
        src, _, st = node("f")
        assert src.calls["read_file"] == 0 and st["pieced_hits"] == 1

        # a piece lost again, and two nodes read the file at once from a slow remote: the
        # manifest is forgotten, one node reads the remote under the file's lease, the
        # other waits for its store (both read the remote before: a herd)
        hc.delete(piece_key(ck, ps, 0))
        slow = [SlowSource(tmp_path / "src", delay=1.0) for _ in range(2)]
        with ThreadPoolExecutor(2) as ex:
            outs = list(ex.map(node, ["g", "h"], slow))
        assert sum(s.calls["read_file"] for s in slow) == 1
        assert sum(st["pieced_forgotten"] for *_, st in outs) >= 1
        assert sum(st["lease_waits"] for *_, st in outs) == 1
    finally:
        hc.close()


def test_a_file_above_max_cached_file_skips_the_tier(tmp_path, servers):
    """Files larger than --max-cached-file are read through, in ranges: not in pieces."""
    files = {b"huge.bin": os.urandom(3 << 20), b"s.bin": os.urandom(1000)}
    write_tree(tmp_path / "src", files)
    cfg = make_config(tmp_path / "src", tmp_path / "a", peers=",".join(m.address for m in servers),
                      peer_item_max=1 << 20, max_cached_file=2 << 20)
    got, eng = _read_everything(files, cfg, CountingSource(tmp_path / "src"))
    assert got == files
    st = eng.fetcher.peers.stats()
    assert st["pieces_stored"] == 0 and st["pieced_stored"] == 0
    assert sum(s["stored"] for s in st["servers"].values()) == 1
