"""The memory cgroup limit the daemon finds at start, and what it sizes its buffers to
(dlcachefs.cache.memlimit). The mounted case is tests/test_t7_chaos.py's memory test."""

from hypothesis import given
from hypothesis import strategies as st

from dlcachefs.cache.memlimit import REPLAY_WORKER_BYTES, cgroup_limit, fit

MiB = 1 << 20


def _tree(tmp_path, proc: str, files: dict[str, str]):
    (tmp_path / "cgroup").write_text(proc)
    for rel, text in files.items():
        p = tmp_path / "fs" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(tmp_path / "cgroup"), str(tmp_path / "fs")


def test_v1_limit_of_own_memory_group(tmp_path):
    proc, root = _tree(tmp_path, "5:cpu:/x\n4:memory:/a/b\n", {
        "memory/a/b/memory.limit_in_bytes": "104857600\n"})
    assert cgroup_limit(proc, root) == 100 * MiB


def test_v1_unlimited_is_none(tmp_path):
    proc, root = _tree(tmp_path, "4:memory:/a\n", {
        "memory/a/memory.limit_in_bytes": "9223372036854771712\n"})
    assert cgroup_limit(proc, root) is None


def test_v2_smaller_of_max_and_high(tmp_path):
    proc, root = _tree(tmp_path, "0::/svc/job\n", {
        "svc/job/memory.max": "max\n", "svc/job/memory.high": "50000000\n"})
    assert cgroup_limit(proc, root) == 50000000
    proc, root = _tree(tmp_path, "0::/svc/job\n", {
        "svc/job/memory.max": "max\n", "svc/job/memory.high": "max\n"})
    assert cgroup_limit(proc, root) is None


def test_no_cgroup_file_is_none(tmp_path):
    assert cgroup_limit(str(tmp_path / "absent"), str(tmp_path)) is None


def test_no_limit_keeps_the_flags():
    b = fit(1 << 30, 16 * MiB, 32 * MiB, None, 60 * MiB)
    assert (b.memory, b.readahead, b.backlog, b.reason) == (1 << 30, 256 * MiB, 32 * MiB, "")
    assert b.replay_worker


@given(memory=st.integers(0, 1 << 34), chunk=st.integers(4096, 256 * MiB),
       rss=st.integers(0, 1 << 31), headroom=st.integers(-(1 << 30), 1 << 34))
def test_buffers_fit_half_the_headroom(memory, chunk, rss, headroom):
    limit = max(rss + headroom, 1)
    b = fit(memory, chunk, 2 * chunk, limit, rss)
    budget = max((limit - rss) // 2, 0)
    assert 0 <= b.memory <= memory and 0 <= b.backlog <= 2 * chunk and b.readahead >= 0
    if b.reason:  # shrunk: all of it inside the budget
        assert b.memory + b.readahead + b.backlog <= budget + 1
    else:  # kept: it fitted as asked
        assert (b.memory, b.backlog) == (memory, 2 * chunk)
        assert b.memory + b.readahead + b.backlog <= budget + 1
    assert b.replay_worker == (limit - rss >= REPLAY_WORKER_BYTES)
