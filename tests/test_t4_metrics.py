"""``--metrics-port``: Prometheus metrics of a real mount, scraped over HTTP."""

from __future__ import annotations

import random
import socket
import subprocess
import urllib.request
from pathlib import Path

import pytest
from conftest import requires_fuse

from dlcachefs.mountctl import is_mounted
from dlcachefs.testing.mounting import DLCACHEFS, drop_page_cache

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from dlcachefs.admin.metrics import families  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of the endpoint: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        assert r.status == 200
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def make_src(root: Path, n: int = 20) -> dict[str, bytes]:
    rnd = random.Random(5)
    files = {}
    for i in range(n):
        (root / "d").mkdir(parents=True, exist_ok=True)
        data = rnd.randbytes(10_000 + i)
        (root / "d" / f"f{i}.bin").write_bytes(data)
        files[f"d/f{i}.bin"] = data
    return files


@requires_fuse
def test_metrics_move_with_reads(tmp_path, mount):
    files = make_src(tmp_path / "src")
    port = free_port()
    m = mount(tmp_path / "src", "--metrics-port", str(port))
    before = scrape(port)
    assert before[("dlcachefs_up", ())] == 1
    assert before[("dlcachefs_misses_total", ())] == 0
    assert before[("dlcachefs_cache_limit_bytes", ())] == 200 << 30
    total = sum(len(b) for b in files.values())
    for rel, data in files.items():
        assert (m.mnt / rel).read_bytes() == data
    m.wait_cached(len(files))
    after = scrape(port)
    assert after[("dlcachefs_misses_total", ())] == len(files)
    assert after[("dlcachefs_tier_bytes_total", (("tier", "source"),))] == total
    assert after[("dlcachefs_cached_files", ())] == len(files)
    assert after[("dlcachefs_chunks_written_total", ())] >= 1
    assert after[("dlcachefs_cache_fill_ratio", ())] > 0
    assert after[("dlcachefs_errors_total", (("kind", "source_errors"),))] == 0
    # one source read per file, each in the latency histogram (le=+Inf counts all)
    op = (("op", "read_file"),)
    assert after[("dlcachefs_source_latency_seconds_count", op)] == len(files)
    assert after[("dlcachefs_source_latency_seconds_bucket", (("le", "+Inf"), *op))] == len(files)
    assert after[("dlcachefs_source_latency_seconds_sum", op)] > 0
    # read again (the kernel's pages dropped): hits, served from the cache tier, no new
    # source read
    drop_page_cache()
    for rel, data in files.items():
        assert (m.mnt / rel).read_bytes() == data
    again = scrape(port)
    assert again[("dlcachefs_hits_total", ())] >= len(files)
    assert again[("dlcachefs_tier_bytes_total", (("tier", "cache"),))] >= total
    assert again[("dlcachefs_source_latency_seconds_count", op)] == len(files)
    # the metrics are the stats document's numbers
    st = m.stats()
    assert again[("dlcachefs_bytes_from_source_total", ())] == st["bytes_from_source"]


@requires_fuse
def test_port_in_use_fails_the_mount(tmp_path):
    make_src(tmp_path / "src", 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        (tmp_path / "mnt").mkdir()
        r = subprocess.run([*DLCACHEFS, "mount", str(tmp_path / "src"), str(tmp_path / "mnt"),
                            "--cache-dir", str(tmp_path / "cache"), "--metrics-port", str(port)],
                           capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "Address already in use" in r.stderr
    assert f"--metrics-port {port}" in r.stderr  # which port of the mount's
    assert not is_mounted(tmp_path / "mnt")
    # and an unmount of what is not mounted says so
    r = subprocess.run([*DLCACHEFS, "umount", str(tmp_path / "mnt")], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1 and "is not mounted" in r.stderr, r.stderr


def test_families_of_a_document():
    st = {"version": "x", "pid": 3, "hits": 4, "cached_bytes": 10, "cache_limit_bytes": 100,
          "chunk_bytes": 30, "evicting_bytes": 10, "reserved_bytes": 5,
          "bytes_from_source": 7, "bytes_from_peer": 2, "bytes_from_cache": 9,
          "cache_disk_bytes_read": 11, "sampler_replay_ready": True,
          "zerocopy": {"hit_bytes": 3},
          "streams": {"job/0": {"stall_seconds": 1.5, "bytes_from_source": 6, "epoch": 2,
                                "position": 40, "samples": 100, "prefetch_lead": 8}},
          "source_latency": {"lstat": {"le": [[0.001, 1], [0.01, 2], ["+Inf", 2]],
                                       "sum": 0.004, "count": 2}}}
    got = {}
    for fam in families(st):
        for s in fam.samples:
            got[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert got[("dlcachefs_hits_total", ())] == 4  # a Counters field: a counter
    assert got[("dlcachefs_cached_bytes", ())] == 10  # any other number: a gauge
    assert ("dlcachefs_pid", ()) not in got and ("dlcachefs_sampler_replay_ready", ()) not in got
    assert got[("dlcachefs_cache_fill_ratio", ())] == pytest.approx(0.25)
    tiers = {dict(k[1])["tier"]: v for k, v in got.items() if k[0] == "dlcachefs_tier_bytes_total"}
    assert tiers == {"source": 7, "peer": 2, "cache": 9, "cache_disk": 11, "zerocopy": 3}
    assert got[("dlcachefs_stream_stall_seconds_total", (("stream", "job/0"),))] == 1.5
    assert got[("dlcachefs_stream_position", (("stream", "job/0"),))] == 40
    assert got[("dlcachefs_source_latency_seconds_bucket", (("le", "0.01"), ("op", "lstat")))] == 2
    assert got[("dlcachefs_source_latency_seconds_count", (("op", "lstat"),))] == 2


def test_families_of_the_peer_tier():
    # the shape of PeerTier.stats() (dlcachefs.peers.tier): tier counts, queue levels,
    # and per server counts, state and seconds marked down
    st = {"bytes_from_peers": 5,
          "peers": {"lookups": 9, "leases": 2, "store_dropped": 1, "store_queue_bytes": 300,
                    "store_pending": 2, "item_max": 1 << 20,
                    "servers": {
                        "10.0.0.1:11211": {"hits": 4, "misses": 3, "bytes": 400, "stored": 1,
                                           "stored_bytes": 100, "rejected": 0, "errors": 0,
                                           "marked_down": 0, "state": "up",
                                           "marked_down_s": 0.0},
                        "10.0.0.2:11211": {"hits": 0, "misses": 0, "bytes": 0, "stored": 0,
                                           "stored_bytes": 0, "rejected": 1, "errors": 7,
                                           "marked_down": 2, "state": "down",
                                           "marked_down_s": 12.5}}}}
    got = {}
    for fam in families(st):
        for s in fam.samples:
            got[(s.name, tuple(sorted(s.labels.items())))] = s.value
    a, b = (("server", "10.0.0.1:11211"),), (("server", "10.0.0.2:11211"),)
    assert got[("dlcachefs_peer_hits_total", a)] == 4
    assert got[("dlcachefs_peer_misses_total", a)] == 3
    assert got[("dlcachefs_peer_errors_total", b)] == 7
    assert got[("dlcachefs_peer_marked_down_total", b)] == 2
    assert got[("dlcachefs_peer_rejected_total", b)] == 1
    assert got[("dlcachefs_peer_up", a)] == 1 and got[("dlcachefs_peer_up", b)] == 0
    assert got[("dlcachefs_peer_down_seconds_total", b)] == 12.5
    assert got[("dlcachefs_peers_lookups_total", ())] == 9
    assert got[("dlcachefs_peers_store_dropped_total", ())] == 1
    assert got[("dlcachefs_peers_store_queue_bytes", ())] == 300  # a level: a gauge
    assert got[("dlcachefs_tier_bytes_total", (("tier", "peers"),))] == 5
    # the exposition is valid (names unique, parseable)
    from prometheus_client import CollectorRegistry, generate_latest

    class C:
        def collect(self):
            return families(st)

    reg = CollectorRegistry(auto_describe=False)
    reg.register(C())
    names = [f.name for f in text_string_to_metric_families(generate_latest(reg).decode())]
    assert len(names) == len(set(names)) and "dlcachefs_peer_hits" in names
    # no peer tier: no peer families
    assert not [f for f in families({"peers": None}) if "peer" in f.name]
