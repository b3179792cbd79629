"""Tier 1: the control protocol (dlcachefs.control.ControlState), no I/O."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlcachefs.control import MAX_ERRORS, MAX_JOBS, MAX_LINE, MAX_WRITE, ControlState
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
    return ({n: (j.name, j.dataset, j.dataset_ino) for n, j in cs.jobs.items()},
            list(cs._pid_job.items()), cs.accepted_writes)


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


def test_comments_blank_lines_crlf_and_spaces(cs):
    data = b"# a comment\n\n   \r\n  job   x  \r\n# dataset nope\n\tdataset train\t\n"
    assert cs.apply(data, 3) == len(data)
    assert cs.jobs["x"].dataset == "train"


def test_state_text_is_json(cs):
    import json

    cs.apply(b"job j\ndataset val", 1)
    doc = json.loads(cs.state_text())
    assert doc["jobs"] == {"j": {"dataset": "val"}}
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
])
def test_refused_lines(cs, line, match):
    cs.apply(b"dataset val", 100)
    refuse(cs, line, match=match)
    assert cs.jobs["default"].dataset == "val"


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
])
TEXTS = st.lists(st.one_of(LINES, st.text(max_size=30)), max_size=8).map(
    lambda ls: "\n".join(ls).encode("utf-8", "surrogatepass"))
WRITES = st.one_of(st.binary(max_size=200), TEXTS)


@settings(max_examples=300, deadline=None)
@given(writes=st.lists(st.tuples(WRITES, st.integers(1, 4)), min_size=1, max_size=6))
def test_arbitrary_writes(writes):
    cs = ControlState(resolve_dir)
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
