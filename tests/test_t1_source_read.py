"""The source's whole-file read (``dlcachefs.cache.source._read_all``): exactly the bytes up
to EOF, at most one past the expected size (how a file that grew is noticed), whatever
sizes the reads come back in (a pipe gives short reads, as a network filesystem may)."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from dlcachefs.cache.source import _read_all


@settings(max_examples=60, deadline=None)
@given(content=st.binary(max_size=70_000), delta=st.integers(-3, 3),
       piece=st.integers(1, 20_000))
def test_reads_to_eof_and_one_byte_past_the_size(content, delta, piece):
    size = max(0, len(content) + delta)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer, in pieces: the reader sees short reads
        try:
            os.close(r)
            for i in range(0, len(content), piece):
                os.write(w, content[i:i + piece])
        finally:
            os._exit(0)
    os.close(w)
    try:
        got = _read_all(r, size)
    finally:
        os.waitpid(pid, 0)
        os.close(r)
    assert got == content[: size + 1]


def test_a_regular_file_in_one_read(tmp_path):
    p = tmp_path / "f"
    data = os.urandom(300_000)
    p.write_bytes(data)
    fd = os.open(p, os.O_RDONLY)
    try:
        assert _read_all(fd, len(data)) == data
        os.lseek(fd, 0, 0)
        assert _read_all(fd, len(data) - 10) == data[: len(data) - 9]  # it grew: one more
    finally:
        os.close(fd)
