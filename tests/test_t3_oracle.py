"""The tests' oracle itself (mounting.log_problems, verify_problems, Mount.exit_problem):
it finds what it must, lets through only what a test allows, and never swallows a
problem."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from dlcachefs.testing.fakes import make_config, read_all, run_engine, write_tree
from dlcachefs.testing.mounting import STALE_MOUNT, Mount, log_problems, verify_problems

LOG = """\
2026-01-02 10:00:00,001 INFO dlcachefs: started: {'chunks': 0}
dlcachefs: mounted /src at /mnt
2026-01-02 10:00:01,002 WARNING dlcachefs: mountpoint /tmp/x/mnt is a stale FUSE mount; unmounting it
2026-01-02 10:00:02,003 ERROR dlcachefs.cache.writer: sealing a chunk failed; serving from the source for 30 s
Traceback (most recent call last):
  File "/x/writer.py", line 1, in _loop
    await self._seal()
OSError: [Errno 28] No space left on device
2026-01-02 10:00:03,004 INFO dlcachefs: an info line that mentions an error is fine
2026-01-02 10:00:04,005 ERROR dlcachefs.store.index: invariant violated after a commit: x
/usr/lib/python3/dist-packages/foo.py:12: DeprecationWarning: old
Exception ignored in: <function X.__del__ at 0x7f>
Traceback (most recent call last):
  File "/x/y.py", line 3, in __del__
ValueError: boom
  + Exception Group Traceback (most recent call last):
  |   File "/x/trio.py", line 9, in run
  | ExceptionGroup: one (1 sub-exception)
2026-01-02 10:00:05,006 CRITICAL dlcachefs: right after a traceback, still seen
"""


def test_log_problems_finds_each_problem_once(tmp_path):
    log = tmp_path / "mnt.daemon.log"
    log.write_text(LOG)
    got = log_problems(log)
    starts = ["2026-01-02 10:00:01,002 WARNING dlcachefs: mountpoint",
              "2026-01-02 10:00:02,003 ERROR dlcachefs.cache.writer: sealing",
              "Traceback (most recent call last):",
              "2026-01-02 10:00:04,005 ERROR dlcachefs.store.index: invariant violated",
              "/usr/lib/python3/dist-packages/foo.py:12: DeprecationWarning: old",
              "Traceback (most recent call last):",
              "  + Exception Group Traceback (most recent call last):",
              "2026-01-02 10:00:05,006 CRITICAL dlcachefs: right after"]
    assert len(got) == len(starts), got
    for problem, start in zip(got, starts, strict=True):
        assert problem.startswith(start), (problem, start)
    # a traceback is one problem, down to its exception's line
    assert got[2].endswith("OSError: [Errno 28] No space left on device")
    assert got[5].endswith("ValueError: boom")
    assert log_problems(tmp_path / "missing.log") == []


def test_log_problems_lets_through_only_what_is_allowed(tmp_path):
    log = tmp_path / "mnt.daemon.log"
    log.write_text(LOG)
    allows = [STALE_MOUNT, r"sealing a chunk failed", r"No space left on device$",
              r"invariant violated", r"DeprecationWarning", r"ValueError: boom",
              r"ExceptionGroup", r"CRITICAL"]
    assert log_problems(log, allows) == []
    for a in allows:  # each one is needed: none allows more than its own problem
        assert len(log_problems(log, [x for x in allows if x != a])) == 1, a


def test_verify_problems_reports_a_damaged_record_unless_allowed(tmp_path):
    src, cache = tmp_path / "src", tmp_path / "cache"
    files = {b"d/a.bin": b"a" * 5000, b"d/b.bin": b"b" * 7000}
    write_tree(src, files)

    async def body(eng):
        for rel in files:
            assert await read_all(eng, rel) == files[rel]
        await eng.flush()
        rec = eng.index.get_record(eng.ns.resolve(b"d/b.bin").ino)
        return Path(eng.logs.path(rec.log_id)), rec.offset

    (log, offset), _ = run_engine(make_config(src, cache), body)
    assert verify_problems(cache) == []
    with open(log, "r+b") as f:  # one byte of b.bin's record, in place
        f.seek(offset + 10)
        f.write(b"X")
    got = verify_problems(cache)
    assert len(got) == 1 and "damaged record: inode" in got[0] and "(b.bin)" in got[0], got
    assert verify_problems(cache, [r"^damaged record: inode \d+ \(b\.bin\)"]) == []
    assert len(verify_problems(cache, [r"\(a\.bin\)"])) == 1
    assert verify_problems(tmp_path / "never_mounted") == []


def test_exit_problem_says_how_a_daemon_ended(tmp_path):
    def ended(code: str, killed: bool = False) -> str | None:
        m = Mount(tmp_path / "src", tmp_path / "mnt", tmp_path / "cache")
        m.proc = subprocess.Popen([sys.executable, "-c", code])
        m.proc.wait(timeout=60)
        m.killed = killed
        return m.exit_problem()

    assert ended("pass") is None
    assert ended("raise SystemExit(3)").endswith("exited with status 3")
    segv = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    assert ended(segv).endswith("died of SIGSEGV")
    kill = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    assert ended(kill, killed=True) is None  # the test's own kill9
