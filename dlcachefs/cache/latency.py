"""Latency histograms with fixed buckets: the source calls' latency, for stats and metrics.

Cumulative counts per upper bound, as Prometheus histograms are (``le``), so the metrics
endpoint exports them without conversion. Updated on the trio loop only (by
:class:`dlcachefs.cache.fetch.SourceCalls`, after each attempt); read on the loop by the
stats document.
"""

from __future__ import annotations

import bisect

#: upper bounds in seconds: a local read (~0.1 ms) to a source timeout (60 s)
BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                              0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    """Observations counted in :data:`BUCKETS` (plus one past the last), their sum."""

    __slots__ = ("counts", "sum", "count")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def as_dict(self) -> dict:
        """``{"le": [[bound, cumulative count], ..., ["+Inf", count]], "sum", "count"}``."""
        cum, out = 0, []
        for bound, n in zip((*BUCKETS, "+Inf"), self.counts, strict=True):
            cum += n
            out.append([bound, cum])
        return {"le": out, "sum": round(self.sum, 6), "count": self.count}


class Latencies:
    """One :class:`Histogram` per kind of call (``read_file``, ``lstat``, ``list_dir``...)."""

    def __init__(self) -> None:
        self.by_op: dict[str, Histogram] = {}

    def observe(self, op: str, seconds: float) -> None:
        h = self.by_op.get(op)
        if h is None:
            h = self.by_op[op] = Histogram()
        h.observe(seconds)

    def as_dict(self) -> dict:
        return {op: h.as_dict() for op, h in sorted(self.by_op.items())}
