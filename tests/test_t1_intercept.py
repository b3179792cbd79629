"""Tier 1: the object an intercepted open returns (dlcachefs.data.intercept.CachedFile)
behaves as the BufferedReader the real open returns, call for call (hypothesis); the
interception's switches (on, off, never in a process that says no) without a mount."""

from __future__ import annotations

import builtins
import io
import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlcachefs.data import intercept
from dlcachefs.data.intercept import CachedFile
from dlcachefs.store.readonly import Located

OPS = st.one_of(
    st.tuples(st.just("read"), st.integers(-1, 300)),
    st.tuples(st.just("read1"), st.integers(-1, 300)),
    st.tuples(st.just("readinto"), st.integers(0, 300)),
    st.tuples(st.just("readline"), st.integers(-1, 300)),
    st.tuples(st.just("seek"), st.tuples(st.integers(-50, 400), st.sampled_from(
        [0, 1, 2, os.SEEK_DATA, os.SEEK_HOLE]))),
    st.tuples(st.just("tell"), st.none()),
    st.tuples(st.just("peek"), st.integers(0, 20)),
    st.tuples(st.just("readlines"), st.none()),
    st.tuples(st.just("iter"), st.integers(0, 3)),
)


def apply(f, op, arg):
    """The result of one call, or the type of what it raised."""
    try:
        if op == "read":
            return f.read(arg)
        if op == "read1":
            return f.read1(arg)
        if op == "readinto":
            buf = bytearray(arg)
            n = f.readinto(buf)
            return n, bytes(buf[:n])
        if op == "readline":
            return f.readline(arg)
        if op == "seek":
            return f.seek(*arg)
        if op == "tell":
            return f.tell()
        if op == "peek":
            pos = f.tell()
            got = f.peek(arg)
            # BufferedReader.peek returns what its buffer holds: at least one byte when
            # any is left, a prefix of what follows; the position does not move
            return ("peek", got[:1], f.tell() == pos)
        if op == "readlines":
            return f.readlines()
        if op == "iter":
            return [line for _, line in zip(range(arg), f, strict=False)]
    except (OSError, ValueError) as e:
        return type(e)
    raise AssertionError(op)


def cached(data: bytes, path: str = "/nowhere") -> CachedFile:
    return CachedFile(data, path, os.fsencode(path), Located(1, 1, 0, len(data), 0, 0),
                      reader=None)  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(data=st.binary(max_size=400) | st.lists(st.binary(max_size=30), max_size=12).map(
    b"\n".join), ops=st.lists(OPS, max_size=25))
def test_cached_file_answers_as_a_buffered_reader(tmp_path_factory, data, ops):
    path = tmp_path_factory.mktemp("f") / "x"
    path.write_bytes(data)
    with intercept.real_open(path, "rb") as real:
        ours = cached(data, str(path))
        for op, arg in ops:
            assert apply(ours, op, arg) == apply(real, op, arg), (op, arg)
        ours.close()
    assert ours.closed
    assert apply(ours, "read", 1) is ValueError  # as a closed file


def test_cached_file_is_read_only_and_reads_like_a_file():
    f = cached(b"abc\ndef\n")
    assert f.readable() and f.seekable() and not f.writable()
    assert f.mode == "rb" and f.name == "/nowhere"
    assert isinstance(f, io.BufferedIOBase)
    # not a BufferedReader: numpy.load takes one for a real descriptor and asks fileno()
    assert not isinstance(f, io.BufferedReader)
    for call in (lambda: f.write(b"x"), lambda: f.truncate(0), f.detach):
        with pytest.raises(io.UnsupportedOperation):
            call()
    assert list(f) == [b"abc\n", b"def\n"]
    with f as g:
        assert g is f
    assert f.closed


def test_installed_open_is_the_real_one_off_the_mounts(tmp_path):
    """Installed, ``open`` of a file on no dlcachefs mount returns what the real one
    does (the type, the bytes), for every mode; uninstalled, the real one is back and
    the children are told (the environment)."""
    p = tmp_path / "f.bin"
    p.write_bytes(b"x" * 100)
    code = f"""
import builtins, io, os, pathlib
from dlcachefs.data import intercept
assert intercept.install()
assert builtins.open is intercept.open and io.open is intercept.open
with open({str(p)!r}, "rb") as f:
    assert type(f) is io.BufferedReader and f.read() == b"x" * 100
with open({str(p)!r}) as f:
    assert type(f) is io.TextIOWrapper
assert pathlib.Path({str(p)!r}).read_bytes() == b"x" * 100
intercept.uninstall()
assert builtins.open is intercept.real_open and os.environ["DLCACHEFS_INTERCEPT"] == "0"
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "DLCACHEFS_INTERCEPT"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    # DLCACHEFS_INTERCEPT=0 (dlcachefs run --no-intercept, a daemon's children): not installed
    r = subprocess.run([sys.executable, "-c",
                        "from dlcachefs.data import intercept; import builtins; "
                        "print(intercept.install(), builtins.open is intercept.real_open)"],
                       capture_output=True, text=True, timeout=120,
                       env={**env, "DLCACHEFS_INTERCEPT": "0"})
    assert r.stdout.split() == ["False", "True"], r.stderr
    assert builtins.open is intercept.real_open  # (this process: never installed)


def test_a_fork_never_inherits_an_import_made_for_a_mounts_reader(tmp_path):
    """A thread making a mount's reader imports (the reader module, lmdb) under the
    mounts' lock; a DataLoader worker forked meanwhile inherited that module's import lock
    held by a thread it does not have, and hung at its first read (seen in the race test).
    A fork now waits until the reader is made: the child imports nothing half-done."""
    (tmp_path / "slowmod.py").write_text("import time\ntime.sleep(0.5)\nDONE = True\n")
    code = f"""
import os, signal, sys, threading
sys.path.insert(0, {str(tmp_path)!r})
from dlcachefs.data import intercept
started = threading.Event()
def slow(root):
    started.set()
    import slowmod  # noqa: F401 - an import under the mounts' lock, as _reader_for's
    return None
intercept._reader_for = slow
t = threading.Thread(target=intercept._mounts.reader, args=("/x",))
t.start()
started.wait()
pid = os.fork()
if pid == 0:
    signal.alarm(10)  # (a hang is the bug: SIGALRM ends the child)
    import slowmod
    os._exit(0 if slowmod.DONE else 1)
_, status = os.waitpid(pid, 0)
t.join()
print(os.waitstatus_to_exitcode(status))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0", (r.stdout, r.stderr)
