"""The read-ahead board (dlcachefs.store.advice): the daemon posts ranges of its logs, the
reading processes carry each out once, none waits for another, and a board a reader may
write cannot make the daemon fail."""

from __future__ import annotations

import fcntl
import os
import threading
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from dlcachefs.store import advice
from dlcachefs.store.advice import (
    MERGE_GAP,
    RING,
    TAKE_RANGES,
    AdviceBoard,
    AdviceTaker,
    merge_ranges,
)


def collect() -> tuple[list[tuple[int, int, int]], object]:
    got: list[tuple[int, int, int]] = []
    return got, lambda log_id, off, n: got.append((log_id, off, n))


def drain(board: AdviceBoard, taker: AdviceTaker, advise) -> int:
    """Takes until nothing waits (each take carries out TAKE_RANGES at most); returns
    how many takes that needed."""
    for n in range(1, 10_000):
        taker.take(advise)
        if board.stats()["waiting"] == 0:
            return n
    raise AssertionError("the board never drained")


def test_posted_ranges_are_taken_once_merged_and_in_order(tmp_path):
    board = AdviceBoard(str(tmp_path))
    n = board.post([(2, 0, 100), (1, 5000, 10), (1, 0, 4096), (2, 100 + MERGE_GAP + 1, 5)])
    assert n == 100 + 10 + 5000 + 5  # (1, 0..5010) merged: 5010 bytes
    got, advise = collect()
    taker = AdviceTaker(board.path)
    assert taker.take(advise) == 3
    assert got == [(1, 0, 5010), (2, 0, 100), (2, 100 + MERGE_GAP + 1, 5)]
    assert taker.take(advise) == 0 and len(got) == 3  # nothing twice
    other = AdviceTaker(board.path)  # another process's view of the same board
    assert other.take(advise) == 0
    board.post([(3, 0, 7)])
    assert other.take(advise) == 1 and got[-1] == (3, 0, 7)
    assert board.stats() == {"posted": 4, "posted_bytes": n + 7, "taken": 4,
                             "taken_bytes": n + 7, "waiting": 0}


def test_a_reader_never_waits_for_another_taking(tmp_path):
    """While one reader holds the board (another process: its own descriptor), the next
    returns at once with nothing, and the backlog is taken by whoever comes after."""
    board = AdviceBoard(str(tmp_path))
    board.post([(1, 0, 10)])
    fd = os.open(board.path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        got, advise = collect()
        taker = AdviceTaker(board.path)
        assert taker.take(advise) == 0 and got == []
        assert board.stats()["waiting"] == 1
    finally:
        os.close(fd)  # (the lock goes with it)
    assert taker.take(advise) == 1 and got == [(1, 0, 10)]


def test_threads_of_one_process_take_each_range_once(tmp_path):
    """Threads share the process's descriptor (flock does not tell them apart): the
    thread lock does. Eight threads, 500 posts: every range exactly once."""
    board = AdviceBoard(str(tmp_path))
    taker = AdviceTaker(board.path)
    got: list[tuple[int, int, int]] = []
    lock = threading.Lock()
    stop = threading.Event()

    def advise(log_id, off, n):
        with lock:
            got.append((log_id, off, n))

    def reader():
        while not stop.is_set():
            taker.take(advise)

    threads = [threading.Thread(target=reader) for _ in range(8)]
    for t in threads:
        t.start()
    try:
        for i in range(500):
            board.post([(i, 0, 1)])
    finally:
        stop.set()
        for t in threads:
            t.join()
    drain(board, taker, advise)
    assert sorted(got) == [(i, 0, 1) for i in range(500)]


def test_a_forked_child_takes_with_its_own_descriptor(tmp_path):
    """A child that abandons its parent's descriptor (as dlcachefs.data does at fork)
    excludes its parent with the lock: ranges are taken once across both."""
    board = AdviceBoard(str(tmp_path))
    taker = AdviceTaker(board.path)
    taker.take(lambda *a: None)  # the parent's descriptor is open
    board.post([(1, 0, 10)])
    fd = taker._fd
    fcntl.flock(fd, fcntl.LOCK_EX)  # the parent is taking
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            taker.abandon()
            blocked = taker.take(lambda *a: None)  # the parent holds it: nothing
            os.write(w, str(blocked).encode())
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 16)
    os.waitpid(pid, 0)
    os.close(r)
    fcntl.flock(fd, fcntl.LOCK_UN)
    assert got == b"0"  # a shared descriptor would have shared the parent's lock: 1
    assert board.stats()["waiting"] == 1


def test_a_reader_far_behind_skips_what_the_ring_overwrote(tmp_path):
    board = AdviceBoard(str(tmp_path))
    for i in range(RING + 10):
        board.post([(i, 0, 1)])
    got, advise = collect()
    taker = AdviceTaker(board.path)
    assert taker.take(advise) == TAKE_RANGES  # a few per sample, the rest at the next
    assert drain(board, taker, advise) == RING // TAKE_RANGES - 1
    assert got == [(i, 0, 1) for i in range(10, RING + 10)]


def test_a_slot_overwritten_while_read_is_skipped(tmp_path, monkeypatch):
    """The daemon wraps around between the reader's header and its slots: a slot that
    names another sequence number is not carried out."""
    board = AdviceBoard(str(tmp_path))
    board.post([(1, 0, 1), (2, 0, 1)])
    real = advice._slots

    def late(fd, start, end):
        board.post([(100 + i, 0, 1) for i in range(RING - 1)])
        return real(fd, start, end)

    monkeypatch.setattr(advice, "_slots", late)
    got, advise = collect()
    AdviceTaker(board.path).take(advise)
    assert (1, 0, 1) not in got  # seq 0's slot now holds seq RING
    assert (2, 0, 1) in got  # seq 1 was not overwritten


def test_a_new_mount_carries_the_board_on_and_a_bad_one_is_made_anew(tmp_path):
    board = AdviceBoard(str(tmp_path))
    board.post([(1, 0, 10), (5, 0, 10)])
    taker = AdviceTaker(board.path)
    board.close()
    again = AdviceBoard(str(tmp_path))  # what the last mount left untaken is moot
    got, advise = collect()
    assert taker.take(advise) == 0 and again.stats()["waiting"] == 0
    again.post([(3, 0, 1)])
    assert taker.take(advise) == 1 and got == [(3, 0, 1)]  # the reader's descriptor works on
    again.close()
    with open(board.path, "r+b") as f:  # a reader group member wrote garbage
        f.write(b"garbage!" * 4)
        f.truncate(100)
    third = AdviceBoard(str(tmp_path))
    assert third.stats()["posted"] == 0
    third.post([(4, 0, 1)])
    got.clear()
    assert AdviceTaker(board.path).take(advise) == 1 and got == [(4, 0, 1)]


def test_a_reader_without_a_board_takes_nothing_and_never_raises(tmp_path):
    taker = AdviceTaker(str(tmp_path / "advice"))
    assert taker.take(lambda *a: None) == 0
    (tmp_path / "advice").mkdir()
    assert AdviceTaker(str(tmp_path / "advice")).take(lambda *a: None) == 0
    board = AdviceBoard(str(tmp_path / "x"))
    board.post([(1, 0, 1)])
    gone = AdviceTaker(board.path)

    def fails(*a):
        raise FileNotFoundError("the log is gone")

    assert gone.take(fails) == 0  # skipped, and taken: not tried again
    assert board.stats()["waiting"] == 0


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 1 << 20),
                          st.integers(0, 1 << 16)), max_size=40))
def test_merged_ranges_cover_exactly_what_was_asked_and_little_more(ranges):
    merged = merge_ranges(ranges)
    # sorted, one log's ranges disjoint and more than MERGE_GAP apart
    assert merged == sorted(merged)
    for a, b in zip(merged, merged[1:], strict=False):
        if a[0] == b[0]:
            assert b[1] > a[1] + a[2] + MERGE_GAP
    # every byte asked for is covered
    for log_id, off, n in ranges:
        if n:
            assert any(m[0] == log_id and m[1] <= off and off + n <= m[1] + m[2]
                       for m in merged)
    # and each merged range starts and ends on a range asked for
    for log_id, off, n in merged:
        assert any(r[0] == log_id and r[1] == off for r in ranges)
        assert any(r[0] == log_id and r[1] + r[2] == off + n for r in ranges if r[2])


def test_what_a_reader_group_member_put_in_the_boards_place_is_replaced(tmp_path):
    """A member may make entries in zerocopy/ (group-writable): a link to another file, a
    FIFO or a hard link in the board's place is removed, never written through."""
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    (tmp_path / "advice").symlink_to(target)
    board = AdviceBoard(str(tmp_path))
    board.post([(1, 0, 1)])
    assert target.read_bytes() == b"keep me" and not (tmp_path / "advice").is_symlink()
    board.close()
    os.unlink(tmp_path / "advice")
    os.link(target, tmp_path / "advice")
    AdviceBoard(str(tmp_path)).close()
    assert target.read_bytes() == b"keep me"
    os.unlink(tmp_path / "advice")
    os.mkfifo(tmp_path / "advice")
    board = AdviceBoard(str(tmp_path))
    board.post([(2, 0, 1)])
    got, advise = collect()
    assert AdviceTaker(board.path).take(advise) == 1 and got == [(2, 0, 1)]


def test_nothing_on_the_board_makes_a_take_raise_or_carry_out_a_wild_range(tmp_path):
    """A reader group member may write the board (0660): huge offsets and lengths, empty
    ranges, counters at their limits. A take never raises (the training's open calls it),
    carries out no such range, and at most TAKE_RANGES per call."""
    import struct

    board = AdviceBoard(str(tmp_path))
    board.post([(1, 0, 10)])
    fd = os.open(board.path, os.O_RDWR)
    try:
        slot = struct.Struct("<QQQQ")
        wild = [(1, 1 << 63, 5), (2, 0, 0), (3, 0, (1 << 64) - 1), (4, (1 << 62), 1 << 20),
                (5, 0, advice.MAX_RANGE + 1)]
        for i, (log_id, off, n) in enumerate(wild, start=1):
            os.pwrite(fd, slot.pack(i, log_id, off, n), 32 + i * slot.size)
        # posted past the ring, taken bytes at the top of a u64
        os.pwrite(fd, struct.pack("<QQQ", 1 + len(wild), 0, (1 << 64) - 1), 8)
        got, advise = collect()
        taker = AdviceTaker(board.path)
        assert taker.take(advise) == 1 and got == [(1, 0, 10)]  # the wild ones skipped

        def boom(*a):
            raise ValueError("not an OSError")

        os.pwrite(fd, struct.pack("<QQ", 100, 0), 8)  # 100 posted, none taken
        assert taker.take(boom) == 0  # (ValueError: swallowed, as anything else)
        os.pwrite(fd, struct.pack("<QQ", (1 << 64) - 1, 0), 8)
        got.clear()
        assert taker.take(advise) <= TAKE_RANGES
        os.pwrite(fd, b"\xff" * 32, 0)  # no magic
        assert taker.take(advise) == 0
    finally:
        os.close(fd)


def test_a_board_with_planted_counters_is_made_anew_by_the_next_mount(tmp_path):
    import struct

    board = AdviceBoard(str(tmp_path))
    board.close()
    with open(board.path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<QQ", (1 << 64) - 5, 0))
    again = AdviceBoard(str(tmp_path))
    assert again.posted == 0
    assert again.post([(1, 0, 1)]) == 1  # (a posted near 2**64 would not pack)
    got, advise = collect()
    assert AdviceTaker(board.path).take(advise) == 1 and got == [(1, 0, 1)]


def test_the_daemon_sees_when_no_reader_takes(tmp_path):
    board = AdviceBoard(str(tmp_path))
    assert not board.lagging()
    board.post([(1, 0, 1)])
    now = time.monotonic()
    assert not board.lagging(now)  # just posted
    assert board.lagging(now + advice.LAG_S + 1)  # nobody took it since
    fd = os.open(board.path, os.O_RDWR)  # a reader holds the board's lock for good
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        taker = AdviceTaker(board.path)
        assert taker.take(lambda *a: None) == 0
        assert board.lagging(now + advice.LAG_S + 1)
    finally:
        os.close(fd)
    assert taker.take(lambda *a: None) == 1
    assert not board.lagging(now + advice.LAG_S + 1)  # the readers caught up


def test_a_reader_uses_only_the_daemons_board(tmp_path):
    """The board must belong to the directory's owner and have one link: a file a
    member put there while the daemon had none (or a link to the daemon's) is not used."""
    board = AdviceBoard(str(tmp_path / "z"))
    board.post([(1, 0, 1)])
    os.link(board.path, tmp_path / "second-link")
    assert AdviceTaker(board.path).take(lambda *a: None) == 0
    os.unlink(tmp_path / "second-link")
    assert AdviceTaker(board.path).take(lambda *a: None) == 1
    if os.geteuid() == 0:
        board.post([(2, 0, 1)])
        os.chown(board.path, 4242, 4242)
        assert AdviceTaker(board.path).take(lambda *a: None) == 0


def test_one_take_asks_for_a_samples_worth_of_bytes_at_most(tmp_path):
    board = AdviceBoard(str(tmp_path))
    big = advice.MAX_RANGE
    board.post([(i, 0, big) for i in range(4)])  # (other logs: not merged)
    got, advise = collect()
    taker = AdviceTaker(board.path)
    assert taker.take(advise) == advice.TAKE_BYTES // big
    assert drain(board, taker, advise) > 1
    assert got == [(i, 0, big) for i in range(4)]  # each once, in order


def test_a_range_longer_than_a_reader_takes_is_posted_in_pieces(tmp_path):
    board = AdviceBoard(str(tmp_path))
    n = 2 * advice.MAX_RANGE + 5
    assert board.post([(7, 100, n)]) == n
    got, advise = collect()
    drain(board, taker := AdviceTaker(board.path), advise)
    assert got == [(7, 100, advice.MAX_RANGE), (7, 100 + advice.MAX_RANGE, advice.MAX_RANGE),
                   (7, 100 + 2 * advice.MAX_RANGE, 5)]
    assert taker.take(advise) == 0


def test_take_soon_takes_in_a_thread_of_its_own_one_at_a_time(tmp_path):
    board = AdviceBoard(str(tmp_path))
    taker = AdviceTaker(board.path)
    gate = threading.Event()
    got: list[tuple[int, int, int]] = []
    caller = threading.current_thread()

    def advise(log_id, off, n):
        assert threading.current_thread() is not caller
        gate.wait(10)
        got.append((log_id, off, n))

    assert taker.take(advise) == 0  # (opens the board: nothing posted)
    taker.take_soon(advise)  # nothing posted: no thread
    assert taker._thread is None
    board.post([(1, 0, 1)])
    taker.take_soon(advise)
    first = taker._thread
    assert first is not None
    board.post([(2, 0, 1)])
    taker.take_soon(advise)  # one running: no second
    assert taker._thread is first
    gate.set()
    first.join(10)
    taker.take_soon(advise)
    if taker._thread is not first:
        taker._thread.join(10)
    assert got == [(1, 0, 1), (2, 0, 1)] and board.stats()["waiting"] == 0
