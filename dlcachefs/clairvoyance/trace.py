"""A training's access trace: its format, and its recording by a mount (``--trace FILE``).

:class:`Trace` is what ``dlcachefs simulate --trace`` replays (every epoch's order over
samples 0..n-1, their sizes, classes and reported losses), written and read as JSON by
:func:`save_trace` / :func:`load_trace`.

:class:`TraceRecorder` records one: each open attributed to a stream is noted as (epoch,
dataset index) of the stream's dataset; losses are noted per epoch. At unmount the trace
is written: every epoch's order as read (the first open of each sample per epoch), file
sizes and classes from the sample list, and the losses. One dataset per trace (the first
one a stream reads). Runs on the trio loop; memory is one int per first read of a sample
in an epoch, and one byte per sample.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from dlcachefs.cache.readers import Observer, OpenEvent
from dlcachefs.clairvoyance.samplelist import SampleList

log = logging.getLogger(__name__)


@dataclass
class Trace:
    """Orders per epoch over samples 0..n-1, their sizes, classes and reported losses."""

    sizes: list[int]
    classes: list[int]
    epochs: list[list[int]]
    losses: list[dict[int, float]] = field(default_factory=list)

    @property
    def n(self) -> int:
        return len(self.sizes)

    def total_bytes(self) -> int:
        return sum(self.sizes)

    def accesses(self) -> int:
        return sum(len(e) for e in self.epochs)


def save_trace(trace: Trace, path: str) -> None:
    with open(path, "w") as f:
        json.dump({"sizes": trace.sizes, "classes": trace.classes, "epochs": trace.epochs,
                   "losses": [{str(k): v for k, v in d.items()} for d in trace.losses]}, f)


def load_trace(path: str) -> Trace:
    with open(path) as f:
        d = json.load(f)
    n = len(d["sizes"])
    t = Trace([int(s) for s in d["sizes"]], [int(c) for c in d.get("classes") or [0] * n],
              [[int(i) for i in e] for e in d["epochs"]],
              [{int(k): float(v) for k, v in e.items()} for e in d.get("losses", [])])
    for e in t.epochs:
        if any(not 0 <= i < n for i in e):
            raise ValueError(f"{path}: a sample index is out of range 0..{n - 1}")
    return t


class TraceRecorder(Observer):
    """Records the opens of streams (it hears every open of the mount) and the losses
    the jobs report; :meth:`save` writes the trace."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.samples: SampleList | None = None
        self.dataset: str | None = None
        self._index: dict[int, int] = {}
        self.epochs: dict[int, list[int]] = {}
        self._seen_epoch: int | None = None
        self._seen = bytearray()  # samples already read in the epoch being recorded
        self.losses: dict[int, dict[int, float]] = {}

    def _bind(self, dataset: str, samples: SampleList) -> bool:
        if self.dataset is None:
            self.dataset, self.samples = dataset, samples
            self._index = {ino: i for i, ino in enumerate(samples.inos) if ino}
        return self.dataset == dataset

    def opened(self, ev: OpenEvent) -> None:
        """An open of the mount: recorded when a stream's."""
        s = ev.stream
        if s is not None:
            # the epoch announced, not the one configured: an open that comes while the
            # new epoch's order is computed is the new epoch's (recorded under the old
            # one, it was dropped there as a repeat)
            ep = s.epoch if s.target_epoch is None else s.target_epoch
            self.note(s.dataset, s.samples, ep, ev.ino)

    def note(self, dataset: str | None, samples: SampleList | None, epoch: int | None,
             ino: int) -> None:
        """Sample ``ino`` of ``dataset`` (listed as ``samples``) read in ``epoch``."""
        if dataset is None or samples is None or epoch is None or not self._bind(dataset, samples):
            return
        i = self._index.get(ino)
        if i is None:
            return
        if epoch != self._seen_epoch:
            self._seen_epoch = epoch
            self._seen = bytearray(len(samples.inos))
            for j in self.epochs.get(epoch, ()):
                self._seen[j] = 1
        if not self._seen[i]:
            self._seen[i] = 1
            self.epochs.setdefault(epoch, []).append(i)

    def lost(self, dataset: str, epoch: int, indices: list[int], values: list[float]) -> None:
        if dataset != self.dataset:
            return
        d = self.losses.setdefault(epoch, {})
        for i, v in zip(indices, values, strict=True):
            d[i] = v

    def save(self, size_of) -> None:
        """Write the trace (``size_of(ino)`` gives file sizes); nothing when empty."""
        if self.samples is None or not self.epochs:
            return
        eps = sorted(self.epochs)
        trace = Trace([size_of(ino) if ino else 0 for ino in self.samples.inos],
                      list(self.samples.labels), [self.epochs[e] for e in eps],
                      [self.losses.get(e, {}) for e in eps])
        try:
            save_trace(trace, self.path)
            log.info("trace of %d epochs written to %s", len(eps), self.path)
        except OSError as e:
            log.error("could not write the trace to %s: %s", self.path, e)
