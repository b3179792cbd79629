"""The known future a caching policy sees (its :class:`~dlcachefs.cache.policy.FutureView`),
from the streams' announced orders.

The clock (:class:`~dlcachefs.cache.views.PolicyClock`) ticks once per open, on the
engine's open path, whoever opens: several streams (the DDP ranks of a node) share it.
Each stream counts in its own positions, so a distance in a stream's order becomes ticks
at that stream's own pace: the ticks per position it took since its epoch began (with N
ranks in step, about N; a stream that stalls sees its uses recede). Before a stream has
read enough of its epoch to measure (:data:`RATE_MIN_POSITIONS`), its last epoch's pace
serves, else an equal share of the ticks among the streams still reading. A sample's next
use is ``now`` plus the nearest of those distances over every stream that knows its
order, in this epoch, in the next when that order is known, and in the known epochs after
it that the stream's plan holds (the policy's horizon: while the epochs after this one
read fewer bytes than the cache holds; see
:func:`~dlcachefs.clairvoyance.epochplan.plan_epoch`).

Lobster's release limit ("not read during the next epoch") is each stream's own: a
sample goes only when no stream reads it before the end of that stream's next epoch,
counted in that stream's positions (:meth:`StreamFuture.used_by_next_epoch_end`), so
one rank's pace never stands for another's.

Next uses are taken in a frame per stream that holds still between decisions: position
``p`` of the stream's epoch is tick ``start + pace * p``, both fixed when the frame is
made. Counted from the live pace instead, every cached sample's next use moves each time
a pace moves, and a policy that keeps its units in a heap by next use (reuse-distance)
would pass over an entry whose key grew beneath the top: not always the farthest victim.
In a frame a key changes only when its sample is read (the policy re-keys that unit) or
when the frame is made again, which :meth:`StreamFuture.generation` tells: the policy
then re-keys everything. A frame is made again when its stream's order, next epoch or
later epochs change, when the set of streams changes, and when the stream's reader has
drifted from its frame by more than :data:`REFIT_DRIFT` of an epoch, and at least
:data:`REFIT_MIN_TICKS` (a stall, a pace that changed); then every stream's frame is
made again at once. So the keys follow the paces within that, and the policy's re-keys
of every unit come once per stream per epoch (its switch) and about once per that much
drift. (A sample's position is consumed at its open, and the policy hears of the read
after it was served: in between, that one key is stale.)

Concurrency: trio loop, like the policy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from dlcachefs.cache.views import NEVER, PolicyClock
from dlcachefs.clairvoyance.stream import IDLE_S, Stream, StreamTable

#: positions a stream reads in an epoch before its pace is measured from that epoch
RATE_MIN_POSITIONS = 32
#: the frames are made again when a reader is this far from its frame (a fraction of
#: the stream's epoch in ticks, at least REFIT_MIN_TICKS): the keys then follow a stall or
#: a new pace. Each time, the policy keys every cached unit again (cached samples x
#: streams look-ups), so not more often than that
REFIT_DRIFT = 0.05
REFIT_MIN_TICKS = 1024


@dataclass(slots=True)
class _Frame:
    """A stream's next uses held still: position ``p`` of its epoch is tick
    ``start + pace * p`` (later epochs' positions count on past this one's end). The
    orders it was made for are kept by identity: any of them replaced makes a new frame."""

    start: float
    pace: float
    order: list[int]
    next_first: object
    later: tuple


class StreamFuture:
    """Next uses from every stream that knows its order (the nearest wins), each
    stream's distance in ticks at its own pace (module docstring)."""

    def __init__(self, streams: StreamTable, clock: PolicyClock) -> None:
        self.streams = streams
        self.clock = clock
        self._active_at: tuple[int, list[tuple[Stream, float]]] = (-1, [])
        #: the last pace measured of each stream (key -> ticks per position)
        self._paces: dict[str, float] = {}
        self._frames: dict[str, _Frame] = {}
        self._framed: list[tuple[Stream, _Frame]] = []
        self._framed_at = -1
        self._generation = 0

    def _active(self) -> list[tuple[Stream, float]]:
        """The streams that know their order, each with its pace (ticks per position).
        Listed once per tick (asked by the frames and the aggregate questions)."""
        tick = self.clock.tick
        if self._active_at[0] != tick:
            # a stream that opened nothing for IDLE_S (a training that ended) is not the
            # future: its next epoch would keep its samples from every release, forever
            # (0.0: no open or switch seen yet, as in a stream built by hand)
            now = time.monotonic()
            act = [s for s in self.streams.values() if s.order and s.samples is not None
                   and (s.last_open == 0.0 or now - s.last_open < IDLE_S)]
            reading = sum(1 for s in act if s.position < len(s.order))
            self._active_at = (tick, [(s, self._pace(s, tick, reading)) for s in act])
        return self._active_at[1]

    def _pace(self, s: Stream, tick: int, reading: int) -> float:
        """Ticks per position of ``s``: measured over its epoch so far, else its last
        epoch's, else an equal share among the ``reading`` streams. At least 1 (a
        position is one open, and one open is one tick)."""
        if s.position >= RATE_MIN_POSITIONS:
            pace = max(1.0, (tick - s.epoch_tick) / s.position)
            if s.position < len(s.order):  # (a finished stream's pace only grows)
                self._paces[s.key] = pace
            return pace
        return self._paces.get(s.key, float(max(1, reading)))

    def now(self) -> int:
        return self.clock.tick

    def next_use(self, sample: int) -> float:
        """The nearest tick a stream reads ``sample``, in the streams' frames (module
        docstring): still between the frames' remakes, whatever the clock does."""
        if self._framed_at != self.clock.tick:
            self._sync()
        best = NEVER
        for s, f in self._framed:
            p = _ahead_of_epoch_start(s, sample)
            if p is not None:
                best = min(best, f.start + f.pace * p)
        return best

    def generation(self) -> int:
        """Changes whenever a frame was made again (module docstring): next uses may
        then have moved either way, not only nearer."""
        self._sync()
        return self._generation

    def _sync(self) -> None:
        """The streams' frames brought up to date (made again where the module docstring
        says): O(streams)."""
        tick = self.clock.tick
        act = self._active()
        old = self._frames
        same = len(act) == len(old) and all(
            (f := old.get(s.key)) is not None and f.order is s.order
            and f.next_first is s.next_first and f.later is s.later_first for s, _ in act)
        # a reader off its frame makes every frame again (one re-key of the policy for
        # all of them); one with nothing ahead (its epoch read, the next not known) has
        # no next use to move
        if same and not any(drifted(old[s.key], s, tick) for s, _ in act):
            frames = old
        else:
            self._generation += 1
            frames = {s.key: _Frame(tick - pace * s.position, pace, s.order, s.next_first,
                                    s.later_first) for s, pace in act}
        self._frames = frames
        self._framed = [(s, frames[s.key]) for s, _ in act]
        self._framed_at = tick

    def horizon(self) -> int:
        tick = self.clock.tick
        ends = [tick + int(pace * _known_ahead(s)) for s, pace in self._active()]
        return max(ends, default=tick)

    def epoch_length(self) -> int | None:
        """Ticks an epoch of the node takes (Lobster's I over every stream): the longest
        of the streams' epochs at their paces."""
        act = self._active()
        return max(int(pace * len(s.order)) for s, pace in act) if act else None

    def epoch_start(self) -> int:
        """When the epoch every stream reads now began: the latest stream's switch is
        the one that completes it, so the earliest of the current starts moves once per
        epoch of the node, when the last stream switched."""
        act = self._active()
        return min(s.epoch_tick for s, _ in act) if act else 0

    def next_epoch_end(self) -> int | None:
        """The last tick of the next epoch of every stream (the latest of them, each at
        its pace) when every stream knows its next epoch, else None."""
        act = self._active()
        if not act or any(s.next_first is None for s, _ in act):
            return None
        tick = self.clock.tick
        return max(tick + int(pace * (len(s.order) - s.position + len(s.next_first_order)))
                   - 1 for s, pace in act)

    def used_by_next_epoch_end(self, sample: int) -> bool | None:
        """Does a stream read ``sample`` before the end of its own next epoch? None when
        some stream's next epoch is not known (its reads after this epoch are not)."""
        act = self._active()
        if not act:
            return None
        if any(s.positions.next(sample) is not None
               or (s.next_first is not None and s.next_first.next(sample) is not None)
               for s, _ in act):
            return True
        return None if any(s.next_first is None for s, _ in act) else False


def drifted(f: _Frame, s: Stream, tick: int) -> bool:
    """Is the reader of ``s`` farther from its frame ``f`` than the frames allow
    (:data:`REFIT_DRIFT`, :data:`REFIT_MIN_TICKS`)? Never when nothing is ahead of it."""
    if s.position >= len(s.order) and s.next_first is None:
        return False
    limit = max(REFIT_DRIFT * f.pace * len(s.order), REFIT_MIN_TICKS)
    return abs(f.start + f.pace * s.position - tick) > limit


def _ahead_of_epoch_start(s: Stream, sample: int) -> int | None:
    """Positions from the start of the epoch ``s`` reads to its next read of ``sample``:
    in this epoch, the next, or a later known one (:attr:`Stream.later_first`); None
    when none of them reads it."""
    p = s.positions.next(sample)
    if p is not None:
        return p
    if s.next_first is None:
        return None
    ahead = len(s.order)
    q = s.next_first.next(sample)
    if q is not None:
        return ahead + q
    ahead += len(s.next_first_order)
    for first, length in s.later_first:
        q = first.next(sample)
        if q is not None:
            return ahead + q
        ahead += length
    return None


def _known_ahead(s: Stream) -> int:
    """Positions of ``s`` its known orders reach ahead of its reader."""
    if s.next_first is None:
        return len(s.order) - s.position
    return (len(s.order) - s.position + len(s.next_first_order)
            + sum(length for _, length in s.later_first))
