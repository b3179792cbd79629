"""``--metrics-port``: the mount's statistics as Prometheus metrics over HTTP.

One source of truth: a scrape reads the same document as ``.dlcache/stats``
(:meth:`dlcachefs.session.Session.stats`) and converts it; nothing is counted twice.
:func:`families` is that conversion (a pure function of the document, tested on its
own); :class:`StatsCollector` is the prometheus-client ``Collector`` calling it.

Concurrency rule. The HTTP server runs in its own threads (prometheus-client's
``ThreadingWSGIServer``); the engine's state lives on the trio loop and is touched only
there (see :mod:`dlcachefs.cache.engine`). A scrape therefore never reads the engine: it
asks the loop to build the stats document with ``trio.from_thread.run_sync(snapshot,
trio_token=...)`` and blocks until the loop has run it, between two of the loop's
steps, as an ``open`` of ``.dlcache/stats`` does (LMDB read transactions on the loop,
never a write transaction; no lock is added). The document is a new dict of plain values,
owned by the scraping thread from then on. Before the loop runs (the server is bound
before the mount so that a port in use fails the mount) and after it ended, a scrape
answers ``dlcachefs_up 0`` and nothing else.

Metric names: every field of :class:`dlcachefs.cache.stats.Counters` is a counter
``dlcachefs_<field>_total``; other numbers at the top of the document are gauges
``dlcachefs_<key>``; then labelled families: bytes by tier, per-stream stalls and
positions, the source latency histogram, cache fill, errors by kind, and the peer tier
(``--peers``: the ``peers`` section, :meth:`dlcachefs.peers.tier.PeerTier.stats`): its
counts as ``dlcachefs_peers_<key>_total`` (queue sizes as gauges), and per memcached
server ``dlcachefs_peer_<key>_total{server}`` (hits, misses, errors, marked_down, ...),
``dlcachefs_peer_up{server}`` and ``dlcachefs_peer_down_seconds_total{server}``; and a
shared root's share (``--shared-cache``: the ``shared`` section) as
``dlcachefs_shared_<key>`` gauges and ``dlcachefs_shared_dataset_*_bytes{dataset}``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterator

try:  # only a mount with --metrics-port imports this module (prometheus-client is optional)
    from prometheus_client.core import (
        CollectorRegistry,
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
    from prometheus_client.registry import Collector
except ModuleNotFoundError as _e:  # pragma: no cover - the CLI checks first
    raise ModuleNotFoundError("--metrics-port needs prometheus-client: "
                              "pip install 'dlcachefs[ops]'") from _e

from dlcachefs.cache.stats import Counters
from dlcachefs.store import integrity

log = logging.getLogger(__name__)

PREFIX = "dlcachefs_"
COUNTER_FIELDS = frozenset(f.name for f in dataclasses.fields(Counters))
#: error counters, also exported as one family labelled by kind
ERROR_KINDS = ("source_errors", "source_timeouts", "checksum_failures", "write_errors",
               "stale_refetches", "invariant_violations")
#: numbers of the ``peers`` section that are levels, not counts since mount
PEER_GAUGES = frozenset({"store_queue_bytes", "store_pending", "item_max"})


def _num(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def families(st: dict) -> Iterator:
    """The metric families of one stats document (see the module doc for the names)."""
    up = GaugeMetricFamily(PREFIX + "up", "1 when the mount's stats could be read")
    up.add_metric([], 1)
    yield up
    for key, v in st.items():
        x = _num(v)
        if x is None or key in ("pid", "version"):
            continue
        if key in COUNTER_FIELDS:
            yield CounterMetricFamily(PREFIX + key, f"{key} since mount (stats: {key})",
                                      value=x)
        else:
            yield GaugeMetricFamily(PREFIX + key, f"stats: {key}", value=x)

    # bytes by tier: served from the cache (memory or local log), fetched from the source,
    # read from the cache disk, read by zero-copy readers, and any bytes_from_<tier>
    tiers = CounterMetricFamily(PREFIX + "tier_bytes", "bytes by tier since mount",
                                labels=["tier"])
    for key, v in st.items():
        if key.startswith("bytes_from_") and _num(v) is not None:
            tiers.add_metric([key.removeprefix("bytes_from_")], float(v))
    if _num(st.get("cache_disk_bytes_read")) is not None:
        tiers.add_metric(["cache_disk"], float(st["cache_disk_bytes_read"]))
    zc = st.get("zerocopy") or {}
    if _num(zc.get("hit_bytes")) is not None:
        tiers.add_metric(["zerocopy"], float(zc["hit_bytes"]))
    yield tiers

    errors = CounterMetricFamily(PREFIX + "errors", "errors since mount, by kind",
                                 labels=["kind"])
    for k in ERROR_KINDS:
        if _num(st.get(k)) is not None:
            errors.add_metric([k], float(st[k]))
    yield errors

    limit = _num(st.get("cache_limit_bytes"))
    if limit:
        used = (st.get("chunk_bytes", 0) - st.get("evicting_bytes", 0)
                + st.get("reserved_bytes", 0))
        yield GaugeMetricFamily(PREFIX + "cache_fill_ratio",
                                "share of --cache-size in use (sealed chunks not being "
                                "evicted, plus space reserved for pending ones)",
                                value=used / limit)

    streams = st.get("streams") or {}
    stall = CounterMetricFamily(PREFIX + "stream_stall_seconds",
                                "seconds a stream's opens waited for the source",
                                labels=["stream"])
    sbytes = CounterMetricFamily(PREFIX + "stream_source_bytes",
                                 "bytes a stream's opens waited for", labels=["stream"])
    gauges = {k: GaugeMetricFamily(PREFIX + "stream_" + k, f"streams: {k}", labels=["stream"])
              for k in ("epoch", "position", "samples", "prefetch_lead")}
    for name, s in sorted(streams.items()):
        if not isinstance(s, dict):
            continue
        if _num(s.get("stall_seconds")) is not None:
            stall.add_metric([name], float(s["stall_seconds"]))
        if _num(s.get("bytes_from_source")) is not None:
            sbytes.add_metric([name], float(s["bytes_from_source"]))
        for k, g in gauges.items():
            if _num(s.get(k)) is not None:
                g.add_metric([name], float(s[k]))
    yield stall
    yield sbytes
    yield from gauges.values()

    lat = HistogramMetricFamily(PREFIX + "source_latency_seconds",
                                "time of each source call attempt, by call",
                                labels=["op"])
    for op, h in sorted((st.get("source_latency") or {}).items()):
        buckets = [("+Inf" if b == "+Inf" else repr(float(b)), float(n)) for b, n in h["le"]]
        lat.add_metric([op], buckets, sum_value=float(h["sum"]))
    yield lat

    peers = st.get("peers")
    if isinstance(peers, dict):
        yield from peer_families(peers)

    shared = st.get("shared")
    if isinstance(shared, dict):
        yield from shared_families(shared)


#: numbers of the ``shared`` section (``--shared-cache``), exported as
#: ``dlcachefs_shared_<key>`` gauges; every dataset of the root as
#: ``dlcachefs_shared_dataset_{limit,used,target}_bytes{dataset}``
SHARED_GAUGES = ("budget_bytes", "limit_bytes", "target_bytes", "demand_bytes", "crf",
                 "cost_s_per_mib", "source_bytes_per_s", "source_latency_s")


def shared_families(shared: dict) -> Iterator:
    """The metric families of a shared root's section (:class:`dlcachefs.cache.shares.ShareKeeper`)."""
    for key in SHARED_GAUGES:
        x = _num(shared.get(key))
        if x is not None:
            yield GaugeMetricFamily(PREFIX + "shared_" + key, f"stats: shared.{key}", value=x)
    per = {k: GaugeMetricFamily(PREFIX + f"shared_dataset_{k}_bytes",
                                f"every dataset of the shared root: its {k} bytes",
                                labels=["dataset"]) for k in ("limit", "used", "target")}
    for ds, e in sorted((shared.get("datasets") or {}).items()):
        if not isinstance(e, dict):
            continue
        for k, g in per.items():
            if _num(e.get(k)) is not None:
                g.add_metric([ds], float(e[k]))
    yield from per.values()


def peer_families(peers: dict) -> Iterator:
    """The ``peers`` section of a stats document (the tier's counts, and ``servers``:
    each memcached server's counts, ``state`` up/down and ``marked_down_s``) as metric
    families. Read from the document's shape, not from :mod:`dlcachefs.peers` (not
    imported here: it needs pymemcache): a count the tier adds is exported as it comes."""
    for key, v in sorted(peers.items()):
        x = _num(v)
        if x is None:
            continue
        if key in PEER_GAUGES:
            yield GaugeMetricFamily(PREFIX + "peers_" + key, f"stats: peers.{key}", value=x)
        else:
            yield CounterMetricFamily(PREFIX + "peers_" + key,
                                      f"{key} since mount (stats: peers.{key})", value=x)
    servers = peers.get("servers")
    servers = servers if isinstance(servers, dict) else {}
    counts: dict[str, CounterMetricFamily] = {}
    up = GaugeMetricFamily(PREFIX + "peer_up", "1 while the peer server is up, 0 while it "
                           "is marked down", labels=["server"])
    down_s = CounterMetricFamily(PREFIX + "peer_down_seconds", "seconds the peer server was "
                                 "marked down since mount", labels=["server"])
    for name, c in sorted(servers.items()):
        if not isinstance(c, dict):
            continue
        if c.get("state") in ("up", "down"):
            up.add_metric([str(name)], 1.0 if c["state"] == "up" else 0.0)
        for key, v in c.items():
            x = _num(v)
            if x is None:
                continue
            if key == "marked_down_s":
                down_s.add_metric([str(name)], x)
                continue
            fam = counts.get(key)
            if fam is None:
                fam = counts[key] = CounterMetricFamily(
                    PREFIX + "peer_" + key, f"{key} of each peer server since mount "
                    f"(stats: peers.servers.*.{key})", labels=["server"])
            fam.add_metric([str(name)], x)
    yield from counts.values()
    yield up
    yield down_s


class StatsCollector(Collector):
    """Converts a fresh stats document at each scrape. ``snapshot`` returns it, or raises
    when the mount cannot answer (then only ``dlcachefs_up 0`` is exported)."""

    def __init__(self, snapshot: Callable[[], dict]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator:
        try:
            st = self.snapshot()
        except Exception as e:  # noqa: BLE001 - a scrape never takes the daemon down
            integrity.note_error(e)  # the stats read the index: damage is noted as such
            log.debug("metrics: no stats: %s", e)
            down = GaugeMetricFamily(PREFIX + "up", "1 when the mount's stats could be read")
            down.add_metric([], 0)
            yield down
            return
        yield from families(st)


class MetricsServer:
    """The HTTP server of one mount. Bound at construction (an address in use raises
    OSError before anything is mounted); serves ``dlcachefs_up 0`` until :meth:`attach`
    gives it the trio loop's token and the stats function."""

    def __init__(self, addr: str, port: int) -> None:
        from prometheus_client import start_http_server  # noqa: PLC0415

        self._stats: Callable[[], dict] | None = None
        self._token = None
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatsCollector(self._snapshot))
        self.server, self.thread = start_http_server(port, addr, registry=self.registry)
        self.address = self.server.server_address[:2]

    def attach(self, stats: Callable[[], dict], token) -> None:
        """From now on a scrape runs ``stats()`` on the trio loop of ``token``."""
        self._stats, self._token = stats, token

    def detach(self) -> None:
        self._stats = self._token = None

    def _snapshot(self) -> dict:
        import trio  # noqa: PLC0415 - only the daemon has a loop to ask

        stats, token = self._stats, self._token
        if stats is None or token is None:
            raise RuntimeError("the mount is not being served")
        return trio.from_thread.run_sync(stats, trio_token=token)

    def close(self) -> None:
        self.detach()
        self.server.shutdown()
        self.server.server_close()
