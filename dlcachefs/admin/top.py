"""``dlcachefs top MNT``: a live view of a mount, refreshed from ``.dlcache/stats``.

Each frame is made from two stats documents ``interval`` seconds apart: rates are the
differences of the counters over that time. :func:`frame` builds it as plain data
(sections of rows, and the streams' table); :func:`render_text` prints it as text
(``--once``, and terminals without rich) and :func:`render_rich` as rich tables (the live
view, redrawn with :class:`rich.live.Live`). Standard library plus rich; no trio.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

from dlcachefs.admin import advise, dlcachedir
from dlcachefs.units import format_size


@dataclass
class Frame:
    title: str
    sections: list[tuple[str, list[tuple[str, str]]]] = field(default_factory=list)
    stream_cols: list[str] = field(default_factory=list)
    streams: list[list[str]] = field(default_factory=list)


def _rate(cur: dict, prev: dict | None, key: str, dt: float) -> float | None:
    if prev is None or dt <= 0 or key not in cur or key not in prev:
        return None
    return max(0.0, (cur[key] - prev[key]) / dt)


def quantile(le: list, q: float) -> float | None:
    """The bucket bound under which a share ``q`` of the observations fall, from
    cumulative ``[[bound, count], ..., ["+Inf", count]]`` (None when empty)."""
    total = le[-1][1] if le else 0
    if total <= 0:
        return None
    for bound, n in le:
        if n >= q * total:
            return float("inf") if bound == "+Inf" else float(bound)
    return None


def _window(cur: dict, prev: dict | None) -> dict:
    """The latency histograms of the observations made between ``prev`` and ``cur``."""
    out = {}
    old = (prev or {}).get("source_latency") or {}
    for op, h in (cur.get("source_latency") or {}).items():
        o = old.get(op)
        if o is None:
            out[op] = h
            continue
        out[op] = {"le": [[b, n - m] for (b, n), (_, m) in zip(h["le"], o["le"], strict=False)],
                   "sum": h["sum"] - o["sum"], "count": h["count"] - o["count"]}
    return out


def _ms(s: float | None) -> str:
    if s is None:
        return "-"
    return "inf" if s == float("inf") else f"{s * 1000:.1f} ms"


def frame(cur: dict, prev: dict | None, dt: float, mnt: str) -> Frame:
    """One frame of the view: ``cur`` and the document ``dt`` seconds before it."""
    f = Frame(f"dlcachefs top: {mnt} <- {cur.get('source')} (pid {cur.get('pid')}, up "
              f"{cur.get('uptime_s', 0):.0f} s, rates over {dt:.1f} s)")
    limit = cur.get("cache_limit_bytes") or 0
    used = cur.get("chunk_bytes", 0) - cur.get("evicting_bytes", 0) + cur.get("reserved_bytes", 0)
    f.sections.append(("cache", [
        ("used", f"{format_size(used)} of {format_size(limit)}"
                 + (f" ({100 * used / limit:.1f}%)" if limit else "")),
        ("files cached", f"{cur.get('cached_files', 0):,} of {cur.get('files', 0):,} "
                         f"({format_size(cur.get('cached_bytes', 0))} of "
                         f"{format_size(cur.get('bytes_total', 0))})"),
        ("chunks", f"{cur.get('chunks', 0):,}"),
        ("memory tier", f"{format_size(cur.get('memory_bytes', 0))} of "
                        f"{format_size(cur.get('memory_limit_bytes', 0))}"),
        ("pending / evicting", f"{format_size(cur.get('pending_bytes', 0))} / "
                               f"{format_size(cur.get('evicting_bytes', 0))}"),
        ("open files", f"{cur.get('open_files', 0)}"),
    ]))

    def r(key: str, size: bool = False) -> str:
        v = _rate(cur, prev, key, dt)
        if v is None:
            return "-"
        return f"{format_size(v)}/s" if size else f"{v:,.1f}/s"

    hits, misses = _rate(cur, prev, "hits", dt), _rate(cur, prev, "misses", dt)
    ratio = "-"
    if hits is not None and misses is not None and hits + misses > 0:
        ratio = f"{100 * hits / (hits + misses):.1f}%"
    zc_prev = {"zc": (prev or {}).get("zerocopy", {}).get("hit_bytes", 0)} if prev else None
    zc = _rate({"zc": cur.get("zerocopy", {}).get("hit_bytes", 0)}, zc_prev, "zc", dt)
    f.sections.append(("now", [
        ("opens", f"{r('hits')} hits, {r('misses')} misses (hit ratio {ratio})"),
        ("from the source", r("bytes_from_source", True)),
        ("from the cache", r("bytes_from_cache", True)),
        ("zero-copy reads", "-" if zc is None else f"{format_size(zc)}/s"),
        ("prefetched", f"{r('prefetched')} (+{r('scan_ahead_files')} scanned ahead)"),
        ("chunks written / evicted (superseded)",
         f"{r('chunks_written')} / {r('chunks_evicted')} ({r('chunks_superseded')})"),
    ]))
    f.sections.append(("since mount", [
        ("hits / misses", f"{cur.get('hits', 0):,} / {cur.get('misses', 0):,}"),
        ("bytes from source / cache", f"{format_size(cur.get('bytes_from_source', 0))} / "
                                      f"{format_size(cur.get('bytes_from_cache', 0))}"),
        ("errors", ", ".join(f"{k} {cur.get(k, 0)}" for k in (
            "source_errors", "source_timeouts", "checksum_failures", "write_errors"))),
    ]))
    lat = []
    for op, h in sorted(_window(cur, prev).items()):
        if h["count"] <= 0:
            continue
        lat.append((op, f"{h['count']:,} calls, mean {_ms(h['sum'] / h['count'])}, "
                        f"p50 <= {_ms(quantile(h['le'], 0.5))}, "
                        f"p99 <= {_ms(quantile(h['le'], 0.99))}"))
    f.sections.append(("source latency" + (" (this interval)" if prev else ""),
                       lat or [("", "no source calls")]))
    f.stream_cols = ["stream", "mode", "epoch", "position", "lead", "stall s", "from source",
                     "num_workers (advice)"]
    cores = advise.usable_cores()
    for name, s in sorted((cur.get("streams") or {}).items()):
        if not isinstance(s, dict):
            continue
        workers = "-"
        if s.get("loader"):  # DLCache's Algorithm 2 on the stream's measurements
            adv = advise.measure(name, s, cores)
            if adv.recommended is not None:
                workers = f"{adv.current} -> {adv.recommended}" + (
                    "+" if adv.bound == "lower" else "")
        pos = s.get("position")
        f.streams.append([
            name, str(s.get("mode", "")), str(s.get("epoch", "-")),
            "-" if pos is None else f"{pos:,}/{s.get('samples', 0):,}",
            str(s.get("prefetch_lead", "-")), str(s.get("stall_seconds", "-")),
            format_size(s.get("bytes_from_source", 0)) if "bytes_from_source" in s else
            f"{s.get('opens', 0)} opens", workers])
    return f


def render_text(f: Frame) -> str:
    lines = [f.title, ""]
    for name, rows in f.sections:
        lines.append(f"{name}:")
        width = max((len(k) for k, _ in rows), default=0)
        lines += [f"  {k:<{width}}  {v}" for k, v in rows]
        lines.append("")
    lines.append("streams:" if f.streams else "streams: none")
    if f.streams:
        table = [f.stream_cols, *f.streams]
        widths = [max(len(row[i]) for row in table) for i in range(len(f.stream_cols))]
        for row in table:
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))
    return "\n".join(lines).rstrip() + "\n"


def render_rich(f: Frame):
    """The frame as rich tables. Every text of the frame goes in as a :class:`rich.text.Text`,
    never as markup: paths and names (a source directory called ``[bold]x``) are shown as
    they are, and a ``[/x]`` in one cannot raise MarkupError."""
    from rich.console import Group  # noqa: PLC0415
    from rich.table import Table  # noqa: PLC0415
    from rich.text import Text  # noqa: PLC0415

    parts = []
    grid = Table.grid(padding=(0, 4))
    row = []
    for name, rows in f.sections:
        t = Table(title=Text(name), show_header=False, box=None, title_justify="left")
        t.add_column(style="bold")
        t.add_column()
        for k, v in rows:
            t.add_row(Text(k), Text(v))
        row.append(t)
    for i in range(0, len(row), 2):
        grid.add_row(*row[i:i + 2])
    parts.append(grid)
    st = Table(title="streams", title_justify="left")
    for c in f.stream_cols:
        st.add_column(Text(c))
    for r in f.streams:
        st.add_row(*(Text(c) for c in r))
    parts.append(st)
    return Group(Text(f.title, style="bold"), *parts)


def main(mnt: str, interval: float, once: bool) -> int:
    """The ``dlcachefs top`` command."""
    import os  # noqa: PLC0415

    mnt = os.path.abspath(mnt)
    if interval <= 0:
        raise ValueError("--interval must be > 0")
    prev = dlcachedir.stats(mnt)
    t_prev = time.monotonic()
    if once:
        time.sleep(interval)
        cur = dlcachedir.stats(mnt)
        sys.stdout.write(render_text(frame(cur, prev, time.monotonic() - t_prev, mnt)))
        return 0
    try:
        from rich.live import Live  # noqa: PLC0415
    except ImportError:
        Live = None  # noqa: N806
    # not a terminal (a pipe, a log file, `timeout`): one plain frame after another, each
    # written at once, as `top -b` does (a live view there wrote nothing until its end)
    tty = sys.stdout.isatty()
    try:
        if Live is None or not tty:
            while True:
                time.sleep(interval)
                cur, now = dlcachedir.stats(mnt), time.monotonic()
                text = render_text(frame(cur, prev, now - t_prev, mnt))
                sys.stdout.write(("\x1b[H\x1b[2J" if tty else "\n") + text)
                sys.stdout.flush()
                prev, t_prev = cur, now
        with Live(render_rich(frame(prev, None, 0.0, mnt)), refresh_per_second=4,
                  screen=False) as live:
            while True:
                time.sleep(interval)
                cur, now = dlcachedir.stats(mnt), time.monotonic()
                live.update(render_rich(frame(cur, prev, now - t_prev, mnt)))
                prev, t_prev = cur, now
    except KeyboardInterrupt:
        return 0
    except dlcachedir.NotAMount as e:
        print(f"dlcachefs top: {e}", file=sys.stderr)
        return 1
