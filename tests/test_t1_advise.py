"""DLCache's Algorithm 2 on numbers, its inputs from a stream's measurements, and the
measurements themselves (the loader's pace seen from its opens)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dlcachefs.admin.advise import BUSY, algorithm2, measure, text
from dlcachefs.clairvoyance.pace import Pace


def test_algorithm2_lines():
    # line 2: ceil(t_fetch / t_req)
    d = algorithm2(omega=4, t_fetch=0.30, t_req=0.10, num_cores=8)
    assert (d.workers, d.delta, d.wanted, d.capped_by) == (3, -1, 3, None)
    d = algorithm2(omega=2, t_fetch=0.31, t_req=0.10, num_cores=8, prefetch_factor=2)
    assert (d.workers, d.delta, d.outstanding) == (4, 2, 8)  # line 12: 4 x 2
    # line 2's min with the cores
    d = algorithm2(omega=2, t_fetch=1.0, t_req=0.05, num_cores=8)
    assert (d.workers, d.wanted, d.capped_by) == (8, 20, "cores")
    # lines 3-5: 2 workers use 2 GB together, 1 GB each; 5 GB allowed -> 5, not 8
    d = algorithm2(omega=2, t_fetch=1.0, t_req=0.05, num_cores=8, mem_total=2e9, mem_up=5e9)
    assert (d.workers, d.capped_by) == (5, "memory")
    # memory not binding
    d = algorithm2(omega=2, t_fetch=0.3, t_req=0.1, num_cores=8, mem_total=2e9, mem_up=5e9)
    assert (d.workers, d.capped_by) == (3, None)
    with pytest.raises(ValueError):
        algorithm2(1, 0.1, 0.0, 4)


@given(omega=st.integers(0, 64), t_fetch=st.floats(1e-4, 100), t_req=st.floats(1e-4, 100),
       cores=st.integers(1, 256), mem_worker=st.floats(1e6, 1e10), mem_up=st.floats(1e6, 1e12))
def test_algorithm2_bounds(omega, t_fetch, t_req, cores, mem_worker, mem_up):
    d = algorithm2(omega, t_fetch, t_req, cores, mem_worker * omega, mem_up)
    assert d.wanted == math.ceil(t_fetch / t_req)
    assert 0 <= d.workers <= min(d.wanted, cores)
    assert d.delta == d.workers - omega
    if omega:
        assert d.workers * mem_worker <= mem_up * (1 + 1e-9) or d.workers == 0
    if d.capped_by is None:
        assert d.workers == d.wanted


def loader(batch=8, workers=2, pf=2, t_sample=0.01, between=0.01, opens=400, pids=(11, 12),
           gaps=300):
    return {"loader": {"batch": batch, "workers": workers, "prefetch_factor": pf,
                       "current": {"epoch": 1, "opens": opens, "workers_seen": len(pids),
                                   "span_s": 2.0, "sample_fetch_s": t_sample,
                                   "in_batch_gaps": gaps, "between_batches_s": between,
                                   "between_batch_gaps": 40, "open_s": 0.001,
                                   "worker_pids": list(pids)},
                       "previous": None}}


def test_measure_workers_waiting_for_the_training():
    # a worker fetches a batch in 8 x 10 ms = 80 ms, then waits: its batch boundary gap is
    # 10 ms + 150 ms idle -> cycle 70 + 160 = 230 ms, busy 35%; 2 workers -> t_req 115 ms
    a = measure("j/0", loader(between=0.160), cores=8, pss=lambda p: None)
    assert a.t_fetch == pytest.approx(0.08)
    assert a.t_cycle == pytest.approx(0.23)
    assert a.t_req == pytest.approx(0.115)
    assert a.busy == pytest.approx(0.08 / 0.23)
    assert a.recommended == 1 and a.bound is None  # ceil(80 / 115) = 1
    assert a.decision["delta"] == -1 and a.decision["outstanding"] == 2
    assert "num_workers=1 (now 2)" in text(a)


def test_measure_busy_workers_get_at_least_one_more():
    a = measure("j/0", loader(between=0.0105), cores=8, pss=lambda p: None)
    assert a.busy >= BUSY and a.bound == "lower"
    assert a.recommended == 3
    assert "at least" in text(a)
    # ... but never past the cores
    a = measure("j/0", loader(between=0.0105), cores=2, pss=lambda p: None)
    assert a.recommended == 2


def test_measure_memory_caps():
    # 2 workers of 1 GB PSS each; 2.5 GB allowed: 2 at most, though 4 would be wanted
    a = measure("j/0", loader(t_sample=0.05, between=0.3), cores=8, mem_limit=int(2.5e9),
                pss=lambda p: int(1e9))
    assert a.mem_total == int(2e9)
    assert a.decision["wanted"] >= 1
    a2 = measure("j/0", loader(workers=1, pids=(11,), t_sample=0.05, between=0.05), cores=8,
                 mem_limit=int(2.5e9), pss=lambda p: int(1e9))
    assert a2.bound == "lower" and a2.recommended == 2  # 1 -> 2 fits 2.5 GB
    a3 = measure("j/0", loader(workers=2, t_sample=0.05, between=0.05), cores=8,
                 mem_limit=int(2.5e9), pss=lambda p: int(1e9))
    assert a3.recommended == 2 and a3.decision["capped_by"] in (None, "memory")


def test_measure_main_process_loading():
    # num_workers=0: between batches the main process trains for 300 - 10 = 290 ms; a batch
    # takes 80 ms to load: 1 worker hides it
    a = measure("j/0", loader(workers=0, pf=None, between=0.3, pids=(11,)), cores=8,
                pss=lambda p: None)
    assert a.t_req == pytest.approx(0.29)
    assert a.recommended == 1 and a.decision["delta"] == 1


def test_measure_without_hint_or_data():
    a = measure("j/0", {"loader": {"batch": None}}, cores=4)
    assert a.recommended is None and "dlcachefs run" in a.why[0]
    a = measure("j/0", loader(gaps=2), cores=4)
    assert a.recommended is None and "not enough" in a.why[0]
    assert "no advice yet" in text(a)


def test_pace_splits_batches_per_worker():
    p = Pace()
    p.hint(4, 2, 2)
    t = 0.0
    # two workers alternate batches of 4; in a batch opens are 10 ms apart; after its
    # batch each worker waits 100 ms
    for batch in range(6):
        pid = 100 + batch % 2
        start = batch // 2 * (0.03 + 0.1 + 0.01)
        for k in range(4):
            t = start + k * 0.01
            p.note(pid, t, t + 0.002, 0)
    cur = p.stats()["current"]
    assert cur["opens"] == 24 and cur["workers_seen"] == 2
    assert cur["in_batch_gaps"] == 18 and cur["sample_fetch_s"] == pytest.approx(0.01)
    assert cur["between_batch_gaps"] == 4
    assert cur["between_batches_s"] == pytest.approx(0.11)
    assert cur["open_s"] == pytest.approx(0.002)
    p.note(100, 5.0, 5.001, 1)  # a new epoch: the last one is kept
    s = p.stats()
    assert s["previous"]["opens"] == 24 and s["current"]["opens"] == 1
    a = measure("j/0", {"loader": s}, cores=8, pss=lambda p: None)
    # t_fetch 40 ms, cycle 30 + 110 = 140 ms over 2 workers: t_req 70 ms -> 1 worker
    assert a.epoch == 0 and a.recommended == 1


def test_hook_batch_hint():
    from types import SimpleNamespace

    from dlcachefs.data.hook import _batch_hint

    assert _batch_hint(SimpleNamespace(batch_size=32, num_workers=4, prefetch_factor=2)) == [
        "batch 32 workers=4 prefetch_factor=2"]
    assert _batch_hint(SimpleNamespace(batch_size=32, num_workers=0, prefetch_factor=None)) == [
        "batch 32 workers=0"]
    assert _batch_hint(SimpleNamespace(batch_size=None, num_workers=2)) == []
    assert _batch_hint(None) == []


def test_measure_prefers_the_trainings_own_pace():
    # the workers look busy (the loader is the bottleneck), but the training said how long
    # its step takes: 20 ms a batch; t_fetch 80 ms -> 4 workers, no lower bound needed
    s = loader(between=0.0105)
    s["loader"]["training"] = {"iters": 50, "steps": 50, "wait_s": 3.0, "train_s": 1.0,
                               "age_s": 1.0}
    a = measure("j/0", s, cores=8, pss=lambda p: None)
    assert a.t_req_from == "training" and a.t_req == pytest.approx(0.02)
    assert a.stall == pytest.approx(0.75)
    assert a.bound is None and a.recommended == 4
    assert "waiting 75% of its time for data" in text(a)


def test_pace_control_line():
    from dlcachefs.clairvoyance.control import ControlError, ControlState
    from dlcachefs.clairvoyance.protocol import pace_line

    calls = []
    cs = ControlState(lambda rel: 1)
    cs.on_stream = lambda st, js, pid: calls.append(st)
    cs.apply(b"job j\ndataset d\nsampler sequential\nbatch 8 workers=2\nepoch 0\n", 1)
    assert len(calls) == 1
    line = pace_line(10, 9, 0.5, 1.25)
    assert line == "pace iters=10 steps=9 wait=0.500000 train=1.250000"
    cs.apply(f"job j\n{line}\n".encode(), 1)
    assert len(calls) == 1  # a measurement never restarts the stream
    assert cs.streams[("j", 0)].train_pace[:4] == (10, 9, 0.5, 1.25)
    cs.apply(f"job j\n{pace_line(3, 3, 0.0, 0.3, rank=5)}\n".encode(), 1)  # no such stream
    assert ("j", 5) not in cs.streams
    for bad in ("pace iters=0 steps=1 wait=0 train=0", "pace iters=1 steps=1 wait=nan train=0",
                "pace iters=1 steps=1 wait=-1 train=0", "pace iters=1 wait=0 train=0",
                "pace iters=1 steps=1 wait=0 train=0 x=1"):
        with pytest.raises(ControlError):
            cs.apply(f"job j\n{bad}\n".encode(), 1)


def test_pace_report_keeps_the_process_rank():
    # a rank-3 process's pace write ("job j" + "pace ... rank=3") must leave it bound to
    # rank 3: its next write without a sampler line (an epoch) is rank 3's, not rank 0's
    from dlcachefs.clairvoyance.control import ControlState
    from dlcachefs.clairvoyance.protocol import pace_line

    cs = ControlState(lambda rel: 1)
    cs.apply(b"job j\ndataset d\nsampler distributed seed=1 world=4 rank=3\nepoch 0\n", 7)
    cs.apply(f"job j\n{pace_line(4, 3, 0.1, 0.3, rank=3)}\n".encode(), 7)
    assert cs.streams[("j", 3)].train_pace[:2] == (4, 3)
    assert cs.binding_of(7) == ("j", 3)
    cs.apply(b"epoch 1\n", 7)
    assert cs.streams[("j", 3)].epoch == 1
    assert ("j", 0) not in cs.streams
    # without rank= (a rank-0 loader) the job line's rank 0 stands
    cs.apply(b"job j\nsampler sequential\nepoch 0\n", 8)
    cs.apply(f"job j\n{pace_line(1, 0, 0.0, 0.0)}\n".encode(), 8)
    assert cs.binding_of(8) == ("j", 0) and cs.streams[("j", 0)].train_pace[0] == 1
