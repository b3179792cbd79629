"""Tier 3: which opens scan-ahead hears as a reader group's (dlcachefs.cache.scanahead).

An open of a file among its stream's samples is the stream's known order's (its prefetch
covers it); an open by the same processes of a file outside them (a training's second
loader, its validation set, which the hook does not announce while the training loader
holds the job's stream) is no order's, and is grouped apart as the stream's ``outside``
group, the way an unannounced reader's opens are grouped by process group."""

from __future__ import annotations

from pathlib import Path

from dlcachefs.cache.readers import OpenEvent
from dlcachefs.cache.scanahead import OUTSIDE, ScanAhead, outside_group
from dlcachefs.clairvoyance.epochplan import plan_epoch
from dlcachefs.clairvoyance.samplelist import SampleList
from dlcachefs.clairvoyance.stream import Stream
from dlcachefs.testing.fakes import make_config

TRAIN = list(range(100, 140))  # the stream's samples' inodes
VAL = list(range(200, 240))  # files of another directory, read by the same processes
TRAIN_DIR, VAL_DIR = 10, 20


class _Sequential:
    """A sequential sampler's orders (what ``plan_epoch`` asks of a replayer)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def order(self, epoch: int) -> list[int]:
        return list(range(self.n))

    def known(self, epoch: int) -> bool:
        return True


def _samples() -> SampleList:
    return SampleList("train", ["c0"], TRAIN, [0] * len(TRAIN),
                      [f"c0/{i}.jpg" for i in TRAIN])


def _scan(tmp_path: Path) -> ScanAhead:
    cfg = make_config(tmp_path / "src", tmp_path / "cache", scan_ahead=2)
    # opened() and note_open() touch no other part while the parents stay the same and
    # no nursery runs (no tree is started: the groups are what is looked at)
    return ScanAhead(cfg, index=None, ns=None, writer=None, fetcher=None,  # type: ignore[arg-type]
                     prefetcher=None, group_of=lambda pid: f"unannounced/{pid}")


def _stream() -> Stream:
    s = Stream("job", 0)
    samples = _samples()
    plan = plan_epoch(_Sequential(len(samples)), 0, samples, last_order=None,
                      laid_order=None, cluster_world=None, key=s.key)
    s.samples, s.order, s.epoch, s.target_epoch = samples, plan.order, 0, 0
    return s


def test_sample_list_covers_its_inodes_once_built():
    samples = _samples()
    assert samples.covers(TRAIN[0]) is None  # not built on the loop
    samples.build_sorted()
    assert all(samples.covers(i) for i in TRAIN)
    assert not any(samples.covers(i) for i in [0, 99, 140, *VAL])


def test_a_streams_opens_outside_its_samples_are_scan_aheads(tmp_path):
    """The epoch's plan makes the stream's lookup; the stream's opens of its samples are
    not heard, its opens of other files are, as its ``outside`` group; an open with no
    stream goes to its process group, and one of a stream whose order is unknowable to
    the stream's own group."""
    scan, s = _scan(tmp_path), _stream()
    assert s.covers(TRAIN[3]) and not s.covers(VAL[3]) and not s.order_unknowable
    for ino in TRAIN:
        scan.opened(OpenEvent(ino, 42, TRAIN_DIR, 0.0, s))
    assert scan.groups == {}
    for ino in VAL[:5]:
        scan.opened(OpenEvent(ino, 42, VAL_DIR, 0.0, s))
        scan.opened(OpenEvent(ino, 43, VAL_DIR, 0.0, None))
    key = outside_group(s.key)
    assert key == "job/0" + OUTSIDE and " " not in s.key
    assert set(scan.groups) == {key, "unannounced/43"}
    assert scan.groups[key].opened == set(VAL[:5]) and scan.groups[key].root == VAL_DIR
    s.order, s.error = [], "replay failed"  # no order: every open is the stream's group's
    scan.opened(OpenEvent(TRAIN[0], 42, TRAIN_DIR, 0.0, s))
    assert scan.groups["job/0"].opened == {TRAIN[0]}


def test_a_stream_not_switched_yet_covers_everything(tmp_path):
    """Before its first epoch's order is known, a stream's opens wait for it (they are
    kept as the epoch's early opens): none is a guess's."""
    scan, s = _scan(tmp_path), Stream("job", 0)
    s.target_epoch = 0
    assert s.covers(VAL[0])
    scan.opened(OpenEvent(VAL[0], 42, VAL_DIR, 0.0, s))
    assert scan.groups == {}


def test_a_reader_gone_before_its_events_came_is_not_an_unannounced_one():
    """The events of reads served in a training's process come late: a loader worker may
    have ended by then. Its pid names no process: it is not counted as a process group
    that announced nothing (its stream is found by the job and rank it carried), while a
    live process that announced nothing is."""
    import os
    import subprocess
    import sys

    from dlcachefs.clairvoyance.attribution import Attribution
    from dlcachefs.clairvoyance.stream import StreamTable

    streams = StreamTable()
    streams[("job", 0)] = Stream("job", 0)  # announced by another process
    attr = Attribution(streams)
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                       capture_output=True, text=True, check=True)
    gone = int(p.stdout)
    assert attr.stream_of(gone) is None
    assert attr.stats() == {} and attr.group_of(gone) is None
    assert attr.stream_of(os.getpid()) is None
    assert list(attr.stats()) == [f"unannounced/{os.getpgid(0)}"]
