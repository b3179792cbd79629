"""``dlcachefs stats MNT``: the stats document as a short summary a person reads at a glance.

What was served from where (the cache, the source, the peer tier, the training's own
processes), the hit ratio, what the cache holds against its limit, each stream (what it
is, why, and its last epochs' bytes from the source, hits and misses, its stalls), the
loader-worker advice and the warnings (errors, damaged records, failed writes...).
``--all`` prints every key instead (:func:`dlcachefs.cli.print_tree`) and ``--json`` the
document itself. A pure function of the document: standard library only, and any key may
be missing (a daemon of another version).
"""

from __future__ import annotations

import textwrap

from dlcachefs.admin import advise
from dlcachefs.units import format_size

#: epochs of a stream shown (the document keeps more: ``streams.*.epochs``)
SHOWN_EPOCHS = 8
#: lines are wrapped at this width (a stream's reason is a sentence or two)
WIDTH = 100
#: the column of the values (after the row's label)
LABEL = 11


def _n(x: object) -> int:
    """A count of the document as an int (0 when missing or not a number)."""
    return x if isinstance(x, int) and not isinstance(x, bool) else 0


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole > 0 else "-"


def _duration(s: float) -> str:
    s = int(s)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


def _row(label: str, text: str) -> list[str]:
    """``label`` then ``text``, wrapped under the value column."""
    return textwrap.wrap(text, WIDTH, initial_indent=f"{label:<{LABEL}}",
                         subsequent_indent=" " * LABEL, break_on_hyphens=False) or [label]


def _reasons(counts: dict) -> str:
    """``name n, name n`` of the non-zero counts, largest first."""
    items = sorted(((k, _n(v)) for k, v in counts.items() if _n(v)), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {v:,}" for k, v in items)


def summary(st: dict) -> list[str]:
    """The summary's lines for the stats document ``st``."""
    out = [f"{st.get('mountpoint', '?')} <- {st.get('source', '?')}  (dlcachefs "
           f"{st.get('version', '?')}, pid {st.get('pid', '?')}, up "
           f"{_duration(float(st.get('uptime_s') or 0))})"]
    out += _cache(st)
    out += _served(st)
    groups: dict[tuple, list[tuple[str, dict]]] = {}  # process groups that announced nothing
    for name, s in (st.get("streams") or {}).items():
        if not isinstance(s, dict):
            continue
        if "opens" in s and "epoch" not in s:
            groups.setdefault((s.get("mode"), s.get("reason")), []).append((name, s))
        else:
            out += _stream(name, s)
    for same in groups.values():  # one row per reason, however many groups it has
        out += _unannounced(same)
    for a in advise.advise(st):  # the recommendation alone: `dlcachefs advise` says why
        out += _row("advice", advise.text(a).splitlines()[0])
    warns = warnings(st)
    out += _row("warnings", "none") if not warns else [
        line for w in warns for line in _row("warning", w)]
    out.append("(every counter: dlcachefs stats MNT --all; the raw document: --json)")
    return out


def _cache(st: dict) -> list[str]:
    cached, limit, total = _n(st.get("cached_bytes")), _n(st.get("cache_limit_bytes")), \
        _n(st.get("bytes_total"))
    text = (f"{format_size(cached)} of the {format_size(limit)} limit ({_pct(cached, limit)}"
            f"); {_n(st.get('cached_files')):,} of {_n(st.get('files')):,} files "
            f"({_pct(cached, total)} of the dataset's {format_size(total)})")
    disk = st.get("cache_disk") or {}
    if isinstance(disk.get("free_bytes"), int):
        text += f"; {format_size(disk['free_bytes'])} free on its disk"
    return _row("cache", text)


def _served(st: dict) -> list[str]:
    """Opens and bytes by where they were served, the hit ratio, what was read ahead."""
    hits, misses = _n(st.get("hits")), _n(st.get("misses"))
    mem, subs = _n(st.get("prefetch_hits")), _n(st.get("substitutions"))
    zc = st.get("zerocopy") or {}
    zhits = _n(zc.get("hits"))
    opens = hits + misses + mem + subs
    text = (f"{opens:,} through the mount: {hits:,} from the cache, {misses:,} waited for "
            "the source")
    if mem:
        text += f", {mem:,} from memory (fetched ahead, not cached)"
    if subs:
        text += f", {subs:,} served another sample (--substitute)"
    out = _row("opens", text)
    # every read whose bytes came without waiting for the source, in-process ones included
    served = opens + zhits
    out += _row("hit ratio", f"{_pct(hits + mem + zhits, served)} of {served:,} reads "
                             "served without waiting for the source")
    falls = _n(zc.get("fallbacks"))
    if zhits or falls or _n(zc.get("readers")):
        text = (f"{zhits:,} reads ({format_size(_n(zc.get('hit_bytes')))}) served in the "
                f"training's processes, {falls:,} sent to the mount")
        why = _reasons({k: v for k, v in zc.items() if k not in (
            "hits", "hit_bytes", "fallbacks", "readers", "events", "events_lost")})
        out += _row("in-process", text + (f" ({why})" if why else ""))
    else:
        out += _row("in-process", "none (dlcachefs run serves reads of cached files in "
                                  "the training's processes)")
    text = (f"{format_size(_n(st.get('bytes_from_source')))} from the source, "
            f"{format_size(_n(st.get('bytes_from_cache')))} from the cache")
    peers = st.get("peers")
    if peers or _n(st.get("bytes_from_peers")):
        text += f", {format_size(_n(st.get('bytes_from_peers')))} from the peer tier"
    if _n(st.get("bytes_from_datasets")):
        text += (f", {format_size(_n(st['bytes_from_datasets']))} from other datasets of "
                 "the shared cache")
    out += _row("bytes", text)
    if isinstance(peers, dict):
        servers = peers.get("servers") or {}
        down = [n for n, s in servers.items() if isinstance(s, dict) and s.get("state") != "up"]
        text = (f"{len(servers) - len(down)} of {len(servers)} servers up"
                + (f" (down: {', '.join(down)})" if down else "")
                + f"; {sum(_n(s.get('hits')) for s in servers.values()):,} values served, "
                  f"{sum(_n(s.get('misses')) for s in servers.values()):,} not found, "
                  f"{_n(peers.get('leases')):,} fetched from the source for the cluster")
        out += _row("peer tier", text)
    ahead = _n(st.get("prefetched"))
    scanned = _n(st.get("scan_ahead_files"))
    if ahead or scanned:
        text = f"{ahead:,} files fetched ahead of a known order"
        if scanned:
            text += (f", {scanned:,} ({format_size(_n(st.get('scan_ahead_bytes')))}) "
                     "scanned ahead of readers with none")
        out += _row("ahead", text)
    return out


def _stream(name: str, s: dict) -> list[str]:
    """A stream: its mode and why; its epochs; its reads in the training's processes."""
    head = f"{name}: {s.get('mode', '?')}"
    if s.get("epoch") is not None:
        head += (f", epoch {s['epoch']}, {_n(s.get('position')):,} of "
                 f"{_n(s.get('samples')):,} samples read")
    head += f", {float(s.get('stall_seconds') or 0):.1f} s stalled on the source"
    out = _row("stream", head) + _row("", f"why: {s.get('reason', '-')}")
    if s.get("error"):
        out += _row("", f"error: {s['error']}")
    out += _epochs(s.get("epochs") or {},
                   (s.get("loader") or {}).get("workers_by_epoch") or {})
    reads = s.get("reads") or {}
    if _n(reads.get("in_process_opens")) or _reasons(reads.get("in_process_fallbacks") or {}):
        why = _reasons(reads.get("in_process_fallbacks") or {})
        out += _row("", f"reads: {_n(reads.get('mount_opens')):,} through the mount, "
                        f"{_n(reads.get('in_process_opens')):,} in-process "
                        f"({format_size(_n(reads.get('in_process_bytes')))})"
                        + (f", fell back: {why}" if why else ""))
    return out


def _unannounced(groups: list[tuple[str, dict]]) -> list[str]:
    """Process groups that read without announcing, for one reason: their opens and why."""
    name, first = groups[0]
    if len(groups) > 1:
        name += f" and {len(groups) - 1} more process groups"
    head = f"{name}: {first.get('mode', '?')}, {sum(_n(s.get('opens')) for _, s in groups):,} opens"
    commands = sorted({s["command"] for _, s in groups if s.get("command")})
    if commands:
        head += f" by {', '.join(commands)}"
    return _row("stream", head) + _row("", f"why: {first.get('reason', '-')}")


def _epochs(epochs: dict, workers: dict | None = None) -> list[str]:
    """The last epochs as a small table: bytes from the source, hits, misses, and the
    loader's workers (its batch hint of the epoch: ``--workers auto`` changes it)."""
    if not epochs:
        return []
    keys = list(epochs)[-SHOWN_EPOCHS:]
    rows = [("epoch", keys),
            ("from source", [format_size(_n(epochs[k].get("bytes_from_source"))) for k in keys]),
            ("hits", [f"{_n(epochs[k].get('hits')):,}" for k in keys]),
            ("misses", [f"{_n(epochs[k].get('misses')):,}" for k in keys])]
    if workers and any(str(k) in workers for k in keys):
        rows.append(("workers", [str(workers.get(str(k), "-")) for k in keys]))
    widths = [max(len(r[1][i]) for r in rows) for i in range(len(keys))]
    return [" " * LABEL + f"{label:<12}" + "  ".join(f"{v:>{w}}" for v, w in
                                                     zip(cells, widths, strict=True))
            for label, cells in rows]


def warnings(st: dict) -> list[str]:
    """What went wrong or needs a look, one sentence each (none: an empty list)."""
    out = []

    def count(key: str, text: str) -> None:
        n = _n(st.get(key))
        if n:
            out.append(f"{n:,} {text}")

    count("source_errors", "source errors (reads of the source that failed)")
    count("source_timeouts", "source calls timed out")
    count("checksum_failures", "cached records failed their checksum (fetched again from "
                               "the source)")
    count("stale_refetches", "cached files had changed on the source (fetched again)")
    count("write_errors", "cache writes failed (served from the source instead)")
    count("invariant_violations", "cache invariant violations after commits (see the log)")
    count("cache_skipped", "fetched files not cached (the cache full, its writer behind, or "
                           "its disk full)")
    count("read_through", f"opens of files above --max-cached-file "
                          f"({format_size(_n(st.get('max_cached_file')))}): read from the "
                          "source, never cached")
    disk = st.get("cache_disk") or {}
    if disk.get("paused_s"):
        out.append(f"caching is paused for {disk['paused_s']} s: {disk.get('paused_reason')}")
    elif disk.get("below_min_free"):
        out.append(f"the cache disk has {format_size(_n(disk.get('free_bytes')))} free, "
                   f"under --min-free {format_size(_n(disk.get('min_free_bytes')))}: new "
                   "files are cached only in room evictions free")
    for name, s in (st.get("streams") or {}).items():
        if isinstance(s, dict) and s.get("error"):
            out.append(f"stream {name}: {s['error']}")
    zc = st.get("zerocopy") or {}
    if _n(zc.get("events_lost")):
        out.append(f"{_n(zc['events_lost']):,} events of reads in training processes were "
                   "lost (their streams did not see them)")
    workers = st.get("fetch_workers") or {}
    if _n(workers.get("restarts")):
        out.append(f"fetch workers restarted {_n(workers['restarts']):,} times")
    peers = st.get("peers") or {}
    errors = sum(_n(s.get("errors")) for s in (peers.get("servers") or {}).values()
                 if isinstance(s, dict))
    if errors:
        out.append(f"{errors:,} failed calls to the peer tier's servers")
    for key in ("lookup_failures", "store_failures"):
        if _n(peers.get(key)):
            out.append(f"peer tier: {_n(peers[key]):,} {key.replace('_', ' ')} (see the log)")
    return out
