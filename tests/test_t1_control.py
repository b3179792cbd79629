"""Tier 1: the control protocol (dlcachefs.clairvoyance.control.ControlState), no I/O."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlcachefs.clairvoyance.control import (
    MAX_ERRORS,
    MAX_JOBS,
    MAX_LINE,
    MAX_LOSS_PAIRS,
    MAX_ORDER_EPOCHS,
    MAX_WRITE,
    ControlState,
)
from dlcachefs.clairvoyance.replay import SamplerSpec
from dlcachefs.errors import ControlError, NotADirectory, NotFound

DIRS = {"": 1, "train": 20, "val": 21, "train/cls0": 22}
FILES = {"train/cls0/a.jpg"}


def resolve_dir(rel: str) -> int:
    if rel in DIRS:
        return DIRS[rel]
    if rel in FILES:
        raise NotADirectory(rel)
    raise NotFound(rel)


@pytest.fixture
def cs() -> ControlState:
    return ControlState(resolve_dir)


def snapshot(cs: ControlState):
    """Everything a refused write must leave unchanged."""
    return ({n: (j.name, j.dataset, j.dataset_ino, j.losses) for n, j in cs.jobs.items()},
            {k: (s.sampler, s.epoch, s.batch,
                 {e: list(o) for e, o in s.orders.items()},
                 {e: list(o) for e, o in s.pending_orders.items()})
             for k, s in cs.streams.items()},
            list(cs._pid_job.items()), cs.accepted_writes, cs.order_indices)


def refuse(cs: ControlState, data: bytes, pid: int = 100, match: str | None = None) -> str:
    before = snapshot(cs)
    n_err = len(cs.errors)
    refused = cs.refused_writes
    with pytest.raises(ControlError) as ei:
        cs.apply(data, pid)
    reason = str(ei.value)
    assert reason
    if match is not None:
        assert match in reason
    assert snapshot(cs) == before
    assert cs.refused_writes == refused + 1
    # the reason is readable in .dlcache/errors, with the writer's pid
    assert len(cs.errors) == min(n_err + 1, MAX_ERRORS)
    last = cs.errors_text().decode().splitlines()[-1]
    assert reason in last and f"pid={pid}" in last
    return reason


# ----- accepted lines ------------------------------------------------------------------


def test_dataset_goes_to_default_job(cs):
    assert cs.apply(b"dataset train\n", 100) == len(b"dataset train\n")
    assert cs.jobs["default"].dataset == "train"
    assert cs.jobs["default"].dataset_ino == 20
    assert cs.accepted_writes == 1 and cs.refused_writes == 0
    assert cs.errors_text() == b""


def test_job_then_dataset_same_write(cs):
    cs.apply(b"job resnet-1.a_b\ndataset train/cls0\n", 7)
    assert cs.jobs["resnet-1.a_b"].dataset == "train/cls0"
    assert cs.jobs["resnet-1.a_b"].dataset_ino == 22
    assert "default" not in cs.jobs
    assert cs.job_of(7) == "resnet-1.a_b"
    assert cs.job_of(8) == "default"


def test_pid_remembers_its_job_across_writes(cs):
    cs.apply(b"job alpha", 7)
    cs.apply(b"dataset val", 7)
    cs.apply(b"dataset train", 8)
    assert cs.jobs["alpha"].dataset == "val"
    assert cs.jobs["default"].dataset == "train"


def test_several_jobs_in_one_write_apply_in_order(cs):
    cs.apply(b"job a\ndataset train\njob b\ndataset val\n", 1)
    assert cs.jobs["a"].dataset == "train"
    assert cs.jobs["b"].dataset == "val"
    assert cs.job_of(1) == "b"


def test_dataset_path_normalized(cs):
    cs.apply(b"dataset ./train//cls0/\n", 1)
    assert cs.jobs["default"].dataset == "train/cls0"
    cs.apply(b"dataset .\n", 1)
    assert cs.jobs["default"].dataset == ""
    assert cs.jobs["default"].dataset_ino == 1


def test_dataset_path_percent_encoded(cs):
    """Percent-encoded like a ``root`` path, so that any name is one token."""
    cs.apply(b"dataset tr%61in%2Fcls0\n", 1)
    assert cs.jobs["default"].dataset == "train/cls0"


def test_comments_blank_lines_crlf_and_spaces(cs):
    data = b"# a comment\n\n   \r\n  job   x  \r\n# dataset nope\n\tdataset train\t\n"
    assert cs.apply(data, 3) == len(data)
    assert cs.jobs["x"].dataset == "train"


def test_state_text_is_json(cs):
    import json

    cs.apply(b"job j\ndataset val", 1)
    doc = json.loads(cs.state_text())
    assert doc["jobs"] == {"j": {"dataset": "val", "losses": 0}}
    assert doc["accepted_writes"] == 1


# ----- refused writes ------------------------------------------------------------------


def test_one_bad_line_refuses_the_whole_write(cs):
    cs.apply(b"job keep\ndataset train\n", 5)
    reason = refuse(cs, b"job other\ndataset val\nbogus 1\n", pid=5, match="line 3")
    assert "bogus" in reason
    assert "other" not in cs.jobs
    assert cs.jobs["keep"].dataset == "train"
    assert cs.job_of(5) == "keep"


def test_bad_dataset_refuses_earlier_job_line(cs):
    refuse(cs, b"job newjob\ndataset nosuchdir\n", match="nosuchdir")
    assert "newjob" not in cs.jobs
    assert cs.job_of(100) == "default"


@pytest.mark.parametrize("line,match", [
    (b"dataset /etc", "relative"),
    (b"dataset /", "relative"),
    (b"dataset train/../..", ".."),
    (b"dataset ..", ".."),
    (b"dataset %2E%2E", ".."),
    (b"dataset %2Fetc", "relative"),
    (b"dataset nosuch", "not a directory"),
    (b"dataset train/cls0/a.jpg", "not a directory"),
    (b"dataset", "exactly one argument"),
    (b"dataset a b", "exactly one argument"),
    (b"job", "exactly one argument"),
    (b"job bad/name", "bad job name"),
    (b"job " + b"x" * 65, "bad job name"),
    (b"job \xc3\xa9t\xc3\xa9", "bad job name"),
    (b"epochs 3", "unknown command"),
    (b"JOB a", "unknown command"),
    (b"", "empty"),
    (b"# only a comment\n\n", "empty"),
    (b"loss 5 1_000", "loss must be a number"),
    ("loss 5 \u0663".encode(), "loss must be a number"),  # an Arabic-Indic 3
    ("loss \u0663 1".encode(), "index must be an integer"),
    (b"loss 5 nan", "finite"),
    (b"loss 5 -Infinity", "finite"),
    (b"epoch 1_0", "epoch must be an integer"),
])
def test_refused_lines(cs, line, match):
    cs.apply(b"dataset val", 100)
    refuse(cs, line, match=match)
    assert cs.jobs["default"].dataset == "val"


@pytest.mark.parametrize("name", [b"%00", b"\xed\x9f\xbf", b"a%0Ab"])
def test_a_reason_quoting_odd_input_is_the_one_in_the_error_log(cs, name):
    """A refusal that quotes control or unassigned characters (here a directory that
    does not exist, whose lookup error quotes it too) is told to the writer with them
    escaped, exactly as .dlcache/errors shows it (100,000 fuzzed writes found 37 that
    were not)."""
    reason = refuse(cs, b"dataset " + name + b"\n", match="is not a directory")
    assert reason.isprintable()
    assert reason in cs.errors_text().decode().splitlines()[-1]


def test_non_utf8(cs):
    refuse(cs, b"job a\ndataset \xff\xfe\n", match="UTF-8")


def test_max_write_size(cs):
    line = b"dataset train\n"
    pad = b"#" * (MAX_WRITE - len(line) - 1) + b"\n"
    ok = pad + line
    assert len(ok) == MAX_WRITE
    assert cs.apply(ok, 1) == MAX_WRITE
    refuse(cs, b"#" + ok, match=str(MAX_WRITE))


def test_max_line(cs):
    ok = b"dataset train/" + b"/" * (MAX_LINE - 14)
    assert len(ok) == MAX_LINE
    cs.apply(ok, 1)
    assert cs.jobs["default"].dataset == "train"
    refuse(cs, b"dataset " + b"a" * MAX_LINE, match="longer than")


def test_too_many_jobs(cs):
    for i in range(MAX_JOBS):
        cs.apply(f"job j{i}".encode(), i)
    assert len(cs.jobs) == MAX_JOBS
    refuse(cs, b"job one-too-many", pid=9999, match="too many jobs")
    refuse(cs, b"job x1\njob x2", pid=9999, match="too many jobs")
    # existing jobs stay usable
    cs.apply(b"job j3\ndataset val", 9999)
    assert cs.jobs["j3"].dataset == "val"
    assert len(cs.jobs) == MAX_JOBS


def test_an_idle_job_whose_processes_are_gone_makes_room_for_a_new_one(cs):
    """A long-lived mount serving named jobs in turn (``dlcachefs run --job``): once 64
    jobs were seen, a new one takes the place of the one idle longest whose processes are
    all gone (its streams go, the engine hears of it); a job with a live process, or one
    not idle for JOB_IDLE_S, is never forgotten. Before, every new name was refused."""
    import os
    import subprocess

    from dlcachefs.clairvoyance.control import JOB_IDLE_S

    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that existed and is gone
    dropped: list[str] = []
    cs.on_job_dropped = dropped.append
    for i in range(MAX_JOBS):
        pid = os.getpid() if i == 0 else dead.pid
        cs.apply(f"job j{i}\ndataset train\nsampler sequential\nepoch 0".encode(), pid)
    assert len(cs.jobs) == MAX_JOBS and ("j5", 0) in cs.streams
    refuse(cs, b"job new1", pid=9999, match="too many jobs")  # none idle long enough yet
    for i, js in enumerate(cs.jobs.values()):
        js.updated -= JOB_IDLE_S + 100 - i  # j0 idle longest, then j1, ...
    # a job whose streams still read (its readers never write: echo > control) stays
    cs.job_reading = lambda name: name == "j1"
    # a refused write forgets nothing, even when it names new jobs
    refuse(cs, b"job new1\nbogus", pid=4242, match="unknown")
    assert dropped == []
    cs.apply(b"job new1\ndataset train", 4242)
    # j0's process is alive (this one), j1 reads: j2 went, the idlest of the others
    assert dropped == ["j2"] and "j2" not in cs.jobs and ("j2", 0) not in cs.streams
    assert "j0" in cs.jobs and "j1" in cs.jobs and cs.jobs["new1"].dataset == "train"
    assert "job 'j2' forgotten" in cs.errors_text().decode()
    cs.apply(b"job new2\njob new3", 4243)  # two at once: two more go
    assert dropped == ["j2", "j3", "j4"] and len(cs.jobs) == MAX_JOBS
    assert cs.binding_of(dead.pid) == ("j63", 0)  # j63's binding stays (it stays)


def test_error_log_is_bounded(cs):
    for i in range(MAX_ERRORS + 20):
        with pytest.raises(ControlError):
            cs.apply(f"nope{i}".encode(), 1)
    lines = cs.errors_text().decode().splitlines()
    assert len(lines) == MAX_ERRORS
    assert "nope20" in lines[0] and f"nope{MAX_ERRORS + 19}" in lines[-1]
    assert cs.refused_writes == MAX_ERRORS + 20


# ----- arbitrary input -----------------------------------------------------------------

LINES = st.sampled_from([
    "job a", "job b", "job default", "dataset train", "dataset val", "dataset train/cls0",
    "dataset /abs", "dataset ../x", "dataset nosuch", "# c", "", "  ", "job", "frob x",
    "dataset train/cls0/a.jpg", "job a b",
    "loss 0 1.5", "loss 3 nan", "loss 1", "loss 99 2", "sampler explicit", "order 0 0 1 2",
    "order 0 2 3", "order 0 end 3", "order 1 end 0", "order 0 1", "order 0 0 99",
])
TEXTS = st.lists(st.one_of(LINES, st.text(max_size=30)), max_size=8).map(
    lambda ls: "\n".join(ls).encode("utf-8", "surrogatepass"))
WRITES = st.one_of(st.binary(max_size=200), TEXTS)


@settings(max_examples=300, deadline=None)
@given(writes=st.lists(st.tuples(WRITES, st.integers(1, 4)), min_size=1, max_size=6))
def test_arbitrary_writes(writes):
    cs = ControlState(resolve_dir, dataset_size={"train": 10, "val": 50}.get)
    for data, pid in writes:
        before = snapshot(cs)
        try:
            n = cs.apply(data, pid)
        except ControlError as e:
            assert str(e)
            assert snapshot(cs) == before
            assert str(e) in cs.errors_text().decode()
        else:
            assert n == len(data)
        assert len(cs.jobs) <= MAX_JOBS + 1  # + "default"
        for j in cs.jobs.values():
            assert j.dataset is None or j.dataset in DIRS
        assert cs.order_indices == sum(len(o) for s in cs.streams.values()
                                       for d in (s.orders, s.pending_orders) for o in d.values())
        for s in cs.streams.values():
            assert len(s.orders) <= MAX_ORDER_EPOCHS and len(s.pending_orders) <= MAX_ORDER_EPOCHS


# ----- loss lines ----------------------------------------------------------------------

SIZES = {"train": 10, "val": 5, "": 100}  # dataset_size: None for train/cls0 (unknown)


class Recorder:
    """A ControlState with every callback recorded."""

    def __init__(self, sizes: dict[str, int] | None = None) -> None:
        self.losses: list[tuple[str, list[int], list[float]]] = []
        self.orders: list[tuple[str, int, int, list[int], int]] = []
        self.streams: list[tuple[str, int]] = []
        sz = SIZES if sizes is None else sizes
        self.cs = ControlState(
            resolve_dir,
            lambda s, j, pid: self.streams.append((s.job, s.rank)),
            dataset_size=sz.get,
            on_loss=lambda js, i, v: self.losses.append((js.name, i, v)),
            on_order=lambda s, j, e, o, pid: self.orders.append((s.job, s.rank, e, list(o), pid)),
        )


@pytest.fixture
def rec() -> Recorder:
    return Recorder()


def test_ranks_of_one_job_never_take_each_others_streams():
    """Each rank of a DDP job announces job + dataset + sampler + epoch (the hook's write):
    only its own stream starts, bound to its own process; the other rank's stream is
    restarted (without the writer bound to it) only when the job's dataset changes."""
    calls = []
    cs = ControlState(resolve_dir, lambda st, js, pid: calls.append(((st.job, st.rank), pid)))

    def announce(rank: int, epoch: int, dataset: str = "train") -> list:
        calls.clear()
        cs.apply(f"job default\ndataset {dataset}\nsampler distributed seed=1 world=2 "
                 f"rank={rank}\nepoch {epoch}\n".encode(), 1000 + rank)
        return list(calls)

    assert announce(1, 0) == [(("default", 1), 1001)]
    assert announce(0, 0) == [(("default", 0), 1000)]
    assert announce(1, 1) == [(("default", 1), 1001)]
    assert cs.streams[("default", 0)].epoch == 0  # rank 0's stream stays where it was
    # a new dataset: both streams start over on it, the other rank's without the writer
    assert sorted(announce(1, 2, "val"), key=str) == [(("default", 0), None),
                                                      (("default", 1), 1001)]
    assert cs.binding_of(1001) == ("default", 1) and cs.binding_of(1000) == ("default", 0)


def test_loss_delivered_after_apply(rec):
    rec.cs.apply(b"dataset train\n", 1)
    assert rec.cs.apply(b"loss 0 1.5 9 -2 3 1e-3\nloss 0 7\n", 1)
    assert rec.losses == [("default", [0, 9, 3, 0], [1.5, -2.0, 1e-3, 7.0])]
    assert rec.cs.jobs["default"].losses == 4
    assert json_state(rec.cs)["jobs"]["default"]["losses"] == 4


def test_loss_values_must_be_numbers_of_any_finite_kind(rec):
    rec.cs.apply(b"dataset train\n", 1)
    rec.cs.apply(b"loss 1 -0 2 +3.25 3 1E+2 4 -1.5e-300 5 .5\n", 1)
    assert rec.losses[0][2] == [0.0, 3.25, 100.0, -1.5e-300, 0.5]


def test_loss_job_attribution(rec):
    rec.cs.apply(b"job a\ndataset train\njob b\ndataset val\n", 1)
    # pid 1 is bound to b; a job line in the same write switches it for the lines after it
    rec.cs.apply(b"loss 4 1\njob a\nloss 9 2 8 3\njob b\nloss 0 4\n", 1)
    assert rec.losses == [("b", [4, 0], [1.0, 4.0]), ("a", [9, 8], [2.0, 3.0])]
    assert rec.cs.jobs["a"].losses == 2 and rec.cs.jobs["b"].losses == 2
    assert rec.cs.job_of(1) == "b"
    # another process writes for the default job, which has no dataset
    refuse(rec.cs, b"loss 1 5\n", pid=2, match="job 'default' has no 'dataset' line")
    assert len(rec.losses) == 2


def test_loss_with_dataset_in_same_write(rec):
    rec.cs.apply(b"job n\ndataset val\nloss 4 0.25\n", 3)
    assert rec.losses == [("n", [4], [0.25])]
    # the size of the dataset given in the same write is the one checked
    refuse(rec.cs, b"job m\ndataset val\nloss 5 1\n", match="index 5 out of range")
    rec.cs.apply(b"job n\ndataset train\nloss 9 1\n", 3)
    assert rec.losses[-1] == ("n", [9], [1.0])


def test_loss_unknown_size_only_checks_sign(rec):
    rec.cs.apply(b"dataset train/cls0\nloss 123456 1\n", 1)
    assert rec.losses == [("default", [123456], [1.0])]
    cs = ControlState(resolve_dir)  # no dataset_size, no on_loss at all
    cs.apply(b"dataset train\nloss 50 1\n", 1)
    assert cs.jobs["default"].losses == 1


#: loss lines refused after ``dataset train`` (10 samples), with the reason's words
#: (checked by test_loss_or_order_line_refused, with the order lines)
LOSS_REFUSALS = [
    (b"loss", "INDEX VALUE pairs"),
    (b"loss 1", "expects INDEX VALUE pairs, got 1"),
    (b"loss 1 2 3", "expects INDEX VALUE pairs, got 3"),
    (b"loss x 1", "index must be an integer"),
    (b"loss 1.0 1", "index must be an integer"),
    (b"loss 1e3 1", "index must be an integer"),
    (b"loss -1 1", "out of range"),
    (b"loss 10 1", "index 10 out of range"),
    (b"loss 0 1 10 1", "0 <= INDEX < 10"),
    (b"loss 99999999999999999999 1", "out of range"),
    (b"loss 1 abc", "loss must be a number"),
    (b"loss 1 1,5", "loss must be a number"),
    (b"loss 1 nan", "finite"),
    (b"loss 1 NaN", "finite"),
    (b"loss 1 inf", "finite"),
    (b"loss 1 -inf", "finite"),
    (b"loss 1 +Infinity", "finite"),
    (b"loss 1 1e999", "finite"),
    (b"loss 0 1\nloss 2 nan", "line 2"),
]


def test_loss_before_dataset(rec):
    refuse(rec.cs, b"loss 0 1\n", match="before a dataset")
    refuse(rec.cs, b"loss 0 1\ndataset train\n", match="before a dataset")
    refuse(rec.cs, b"job x\nloss 0 1\n", match="before a dataset")
    rec.cs.apply(b"job y\ndataset val\n", 5)
    refuse(rec.cs, b"job x\nloss 0 1\n", pid=5, match="before a dataset")
    assert rec.losses == []


def test_loss_dataset_change_after_losses_in_one_write(rec):
    rec.cs.apply(b"dataset train\n", 1)
    refuse(rec.cs, b"loss 0 1\ndataset val\nloss 0 2\n", pid=1, match="separate writes")
    rec.cs.apply(b"loss 0 1\ndataset train\nloss 0 2\n", 1)  # the same dataset is fine
    assert rec.losses == [("default", [0, 0], [1.0, 2.0])]


def test_loss_pairs_per_write_bounded(rec, monkeypatch):
    import dlcachefs.clairvoyance.control as control

    rec.cs.apply(b"dataset .\n", 1)
    monkeypatch.setattr(control, "MAX_LOSS_PAIRS", 10)
    rec.cs.apply(b"loss " + b" ".join(b"%d 1" % i for i in range(10)), 1)
    refuse(rec.cs, b"loss 0 1 1 1\nloss " + b" ".join(b"%d 1" % i for i in range(9)),
           pid=1, match="more than 10 loss pairs")
    assert MAX_LOSS_PAIRS == 100_000


def test_loss_large_write_is_fast(rec):
    import time

    rec.cs.apply(b"dataset .\n", 1)
    pairs = [(i % 100, i / 7) for i in range(3000)]
    body = b""
    for k in range(0, len(pairs), 200):
        body += b"loss " + " ".join(f"{i} {v!r}" for i, v in pairs[k:k + 200]).encode() + b"\n"
    assert len(body) < MAX_WRITE
    t = time.perf_counter()
    rec.cs.apply(body, 1)
    assert time.perf_counter() - t < 0.5
    assert rec.losses == [("default", [i for i, _ in pairs], [v for _, v in pairs])]


def json_state(cs: ControlState) -> dict:
    import json

    return json.loads(cs.state_text())


# ----- order lines and sampler explicit ------------------------------------------------


def test_sampler_explicit(rec):
    rec.cs.apply(b"dataset train\nsampler explicit\nepoch 0\n", 1)
    assert rec.cs.streams[("default", 0)].sampler == SamplerSpec("explicit")
    refuse(rec.cs, b"sampler explicit seed=1", match="unknown field")


def test_explicit_orders_of_several_ranks_go_to_each_ranks_stream(rec):
    """DLIO's MPI ranks each send their own order (``sampler explicit world=W rank=R``):
    the sampler line binds the writing process to its rank, and its later writes without
    a ``job`` line (the order chunks, the epoch line) stay that rank's."""
    cs = rec.cs
    for pid, rank in ((11, 0), (12, 1)):
        cs.apply(b"job dlio\ndataset train\nsampler explicit world=2 rank=%d\n" % rank, pid)
    for pid, order in ((12, b"5 3 1"), (11, b"4 2 0")):
        cs.apply(b"order 0 0 " + order + b"\n", pid)
        cs.apply(b"order 0 end 3\nepoch 0\n", pid)
    assert cs.streams[("dlio", 0)].sampler == SamplerSpec("explicit", world=2, rank=0)
    assert cs.streams[("dlio", 1)].sampler == SamplerSpec("explicit", world=2, rank=1)
    assert list(cs.streams[("dlio", 0)].orders[0]) == [4, 2, 0]
    assert list(cs.streams[("dlio", 1)].orders[0]) == [5, 3, 1]
    assert ("dlio", 1, 0, [5, 3, 1], 12) in rec.orders
    refuse(cs, b"sampler explicit world=2 rank=2", match="rank")
    refuse(cs, b"sampler explicit world=0 rank=0", match="world")
    refuse(cs, b"sampler explicit world=4", match="together")  # a pair, or neither
    refuse(cs, b"sampler explicit rank=1", match="together")
    cs.apply(b"job solo\ndataset train\nsampler explicit world=1 rank=0\n", 13)
    assert cs.streams[("solo", 0)].sampler == SamplerSpec("explicit")  # the defaults


def test_order_in_chunks(rec):
    cs = rec.cs
    cs.apply(b"dataset train\nsampler explicit\norder 0 0 3 1 4\n", 7)
    assert rec.orders == []
    assert list(cs.streams[("default", 0)].pending_orders[0]) == [3, 1, 4]
    cs.apply(b"order 0 3 1 5\norder 0 5 9\n", 7)
    assert cs.order_indices == 6
    cs.apply(b"order 0 end 6\n", 7)
    st = cs.streams[("default", 0)]
    assert list(st.orders[0]) == [3, 1, 4, 1, 5, 9]
    assert st.pending_orders == {}
    assert rec.orders == [("default", 0, 0, [3, 1, 4, 1, 5, 9], 7)]
    assert json_state(cs)["streams"]["default/0"]["orders"] == {"0": 6}
    assert cs.order_indices == 6


def test_order_whole_in_one_write_with_job_and_dataset(rec):
    rec.cs.apply(b"job imp\ndataset val\norder 3 0 4 3 2 1 0\norder 3 end 5\nepoch 3\n", 9)
    assert rec.orders == [("imp", 0, 3, [4, 3, 2, 1, 0], 9)]
    assert list(rec.cs.streams[("imp", 0)].orders[3]) == [4, 3, 2, 1, 0]
    assert rec.streams == [("imp", 0)]  # the epoch line; order lines alone touch no stream


def test_order_follows_distributed_rank(rec):
    rec.cs.apply(b"dataset train\nsampler distributed seed=0 world=2 rank=1\n", 4)
    rec.cs.apply(b"order 0 0 1\norder 0 end 1\n", 4)
    assert rec.orders[0][:2] == ("default", 1)


def test_order_restart_and_empty(rec):
    cs = rec.cs
    cs.apply(b"dataset train\norder 0 0 1 2 3\n", 1)
    cs.apply(b"order 0 0 7\norder 0 end 1\n", 1)  # START 0 restarts the epoch
    assert rec.orders[-1][2:4] == (0, [7])
    cs.apply(b"order 1 end 0\n", 1)  # nothing received: an empty order
    assert rec.orders[-1][2:4] == (1, [])
    cs.apply(b"order 1 0\norder 1 0 2\norder 1 end 1\n", 1)
    assert rec.orders[-1][2:4] == (1, [2])
    assert cs.order_indices == 2


def test_order_keeps_two_epochs(rec):
    cs = rec.cs
    cs.apply(b"dataset train\n", 1)
    for e in range(5):
        cs.apply(f"order {e} 0 {e} {e}\norder {e} end 2\n".encode(), 1)
    st = cs.streams[("default", 0)]
    assert list(st.orders) == [3, 4] and MAX_ORDER_EPOCHS == 2
    assert cs.order_indices == 4
    # in progress: at most two epochs as well; a third drops the oldest
    cs.apply(b"order 10 0 1\norder 11 0 1\norder 12 0 1\n", 1)
    assert list(st.pending_orders) == [11, 12]
    refuse(cs, b"order 10 1 5\n", pid=1, match="order for epoch 10 continues at 0, got 1")
    assert cs.order_indices == 6
    # completing an epoch again replaces it
    cs.apply(b"order 4 0 1\norder 4 end 1\n", 1)  # (starting epoch 4 dropped 11)
    assert list(st.orders) == [3, 4] and list(st.orders[4]) == [1]
    assert list(st.pending_orders) == [12]
    assert cs.order_indices == 2 + 1 + 1


def test_order_dropped_when_dataset_changes(rec):
    cs = rec.cs
    cs.apply(b"dataset train\norder 0 0 9 8\norder 0 end 2\norder 1 0 7\n", 1)
    cs.apply(b"dataset train\n", 1)  # same dataset: kept
    st = cs.streams[("default", 0)]
    assert list(st.orders) == [0] and list(st.pending_orders) == [1]
    refuse(cs, b"dataset val\norder 1 1 2\n", pid=1, match="continues at 0, got 1")
    cs.apply(b"dataset val\norder 1 0 4\n", 1)
    assert st.orders == {} and list(st.pending_orders[1]) == [4]
    assert cs.order_indices == 1


#: order lines refused after ``dataset train`` (10 samples), with the reason's words
ORDER_REFUSALS = [
    (b"order", "needs EPOCH START"),
    (b"order 0", "needs EPOCH START"),
    (b"order x 0 1", "epoch must be an integer"),
    (b"order -1 0 1", "epoch must be >= 0"),
    (b"order 0 y 1", "start must be an integer"),
    (b"order 0 0 1 z", "index must be an integer"),
    (b"order 0 0 1 -2", "out of range"),
    (b"order 0 0 10", "index 10 out of range"),
    (b"order 0 1 1", "order for epoch 0 continues at 0, got 1"),
    (b"order 0 end", "exactly one COUNT"),
    (b"order 0 end 1 2", "exactly one COUNT"),
    (b"order 0 end x", "count must be an integer"),
    (b"order 0 end 1", "order for epoch 0 has 0 indices, 'end' says 1"),
    (b"order 0 0 1 2\norder 0 1 3", "line 2: order for epoch 0 continues at 2, got 1"),
    (b"order 0 0 1 2\norder 0 end 3", "has 2 indices, 'end' says 3"),
    (b"order 0 0 1 2\norder 0 end 2\norder 0 end 2", "has 0 indices"),
]


@pytest.mark.parametrize("line,match", LOSS_REFUSALS + ORDER_REFUSALS)
def test_loss_or_order_line_refused(rec, line, match):
    rec.cs.apply(b"dataset train\n", 100)
    refuse(rec.cs, line, match=match)
    assert rec.losses == [] and rec.orders == []
    assert rec.cs.jobs["default"].losses == 0


def test_order_refusals_against_state(rec):
    cs = rec.cs
    refuse(cs, b"order 0 0 1\n", match="before a dataset")
    cs.apply(b"dataset train\norder 2 0 1 2 3\n", 1)
    refuse(cs, b"order 2 4 1\n", pid=1, match="order for epoch 2 continues at 3, got 4")
    refuse(cs, b"order 2 2 1\n", pid=1, match="continues at 3, got 2")
    refuse(cs, b"order 2 end 4\n", pid=1, match="has 3 indices, 'end' says 4")
    # another process writes for the same stream: the order continues
    cs.apply(b"order 2 3 4\norder 2 end 4\n", 2)
    assert rec.orders == [("default", 0, 2, [1, 2, 3, 4], 2)]


def test_order_length_bounded(rec, monkeypatch):
    import dlcachefs.clairvoyance.control as control

    monkeypatch.setattr(control, "MAX_ORDER_LEN", 4)
    rec.cs.apply(b"dataset train\norder 0 0 1 2 3\n", 1)
    refuse(rec.cs, b"order 0 3 1 2\n", pid=1, match="longer than 4 indices")
    rec.cs.apply(b"order 0 3 1\norder 0 end 4\n", 1)
    monkeypatch.setattr(control, "MAX_ORDER_TOTAL", 5)
    refuse(rec.cs, b"order 1 0 1 2\n", pid=1, match="too many order indices")


def test_callbacks_order(rec):
    calls = []
    cs = ControlState(resolve_dir, lambda *a: calls.append("stream"), dataset_size=SIZES.get,
                      on_loss=lambda *a: calls.append("loss"),
                      on_order=lambda *a: calls.append("order"))
    cs.apply(b"loss 0 1\n".join([b"dataset train\n", b"order 0 0 1\norder 0 end 1\nepoch 0\n"]), 1)
    assert calls == ["order", "stream", "loss"]


# ----- arbitrary loss lines ------------------------------------------------------------

N_SAMPLES = 10
GOOD_INDEX = st.integers(0, N_SAMPLES - 1).map(str)
GOOD_VALUE = st.floats(allow_nan=False, allow_infinity=False).map(
    lambda v: st.sampled_from([repr(v), format(v, ".6g"), format(v, "e")])).flatmap(lambda s: s)
NO_SPACE = st.text(st.characters(blacklist_categories=("Zs", "Zl", "Zp", "Cc", "Cs")),
                   min_size=1, max_size=12)
ANY_TOKEN = st.one_of(
    GOOD_INDEX, GOOD_VALUE, NO_SPACE,
    st.sampled_from(["nan", "-nan", "inf", "-inf", "Infinity", "1e999", "-1", "10", "1.5",
                     "0x10", "1_0", "٣", "", "00", "+1", "-0", "1e3"]),
    st.integers(-(10 ** 25), 10 ** 25).map(str),
)


def oracle(line: str) -> list[tuple[int, float]] | None:
    """What an accepted ``loss`` line must deliver (independent of the parser's code);
    None when the line must be refused."""
    import math

    toks = line.split()[1:]
    if not toks or len(toks) % 2:
        return None
    out = []
    for i, v in zip(toks[0::2], toks[1::2], strict=True):
        digits = i[1:] if i.startswith("-") else i
        # ASCII digits only (not "٣", "1_0" or " 1", which int() and float() take)
        if not digits or set(digits) - set("0123456789") or len(digits) > 20:
            return None
        if not v or set(v) - set("0123456789+-.eE"):
            return None
        try:
            idx, val = int(i), float(v)
        except ValueError:
            return None
        if not 0 <= idx < N_SAMPLES or not math.isfinite(val):
            return None
        out.append((idx, val))
    return out


@settings(max_examples=400, deadline=None)
@given(good=st.lists(st.tuples(GOOD_INDEX, GOOD_VALUE), max_size=20),
       tokens=st.lists(ANY_TOKEN, max_size=12), mix=st.booleans(), pid=st.integers(1, 3))
def test_arbitrary_loss_lines(good, tokens, mix, pid):
    rec = Recorder({"train": N_SAMPLES, "val": N_SAMPLES})
    cs = rec.cs
    cs.apply(b"dataset train\n", 1)
    cs.apply(b"job other\ndataset val\n", 3)
    toks = [t for pair in good for t in pair]
    if mix:
        toks += tokens
    line = "loss " + " ".join(toks)
    want = oracle(line)
    if not mix:
        assert want == [(int(i), float(v)) for i, v in good] or not good
    before = snapshot(cs)
    data = line.encode("utf-8", "surrogatepass")
    job = "other" if pid == 3 else "default"
    try:
        cs.apply(data, pid)
    except ControlError as e:
        assert want is None, (line, e)
        assert snapshot(cs) == before
        assert rec.losses == []
        assert str(e) in cs.errors_text().decode()
    else:
        assert want is not None, line
        assert rec.losses == [(job, [i for i, _ in want], [v for _, v in want])]
        assert cs.jobs[job].losses == len(want)


def test_losses_for_an_unlisted_dataset_wait_within_a_bound():
    """Losses whose dataset size is unknown yet are passed on (the receiver keeps them);
    beyond the receiver's room the whole write is refused with a reason, never dropped."""
    got: list = []
    room = [5]
    cs = ControlState(resolve_dir, dataset_size=lambda rel: None,
                      on_loss=lambda js, i, v: got.append(i), loss_room=lambda: room[0])
    cs.apply(b"dataset train\nloss 0 1 1 1 2 1\n", 1)
    assert got == [[0, 1, 2]]
    room[0] = 2
    refuse(cs, b"loss 3 1 4 1 5 1\n", match="only 2 more can wait")
    assert got == [[0, 1, 2]]
    assert "only 2 more can wait" in cs.errors_text().decode()
    # a dataset of known size is not limited by the waiting room
    cs2 = ControlState(resolve_dir, dataset_size=lambda rel: 100,
                       on_loss=lambda js, i, v: got.append(i), loss_room=lambda: 0)
    cs2.apply(b"dataset train\nloss 7 1 8 1\n", 1)
    assert got[-1] == [7, 8]


def test_note_goes_to_the_error_log_without_counting_a_refusal(cs):
    cs.note("3 losses of job 'j' dropped: index out of range")
    assert "dropped: 3 losses" in cs.errors_text().decode()
    assert cs.refused_writes == 0
