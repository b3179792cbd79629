"""Fake sources and a small harness to drive the core (dlcachefs.cache.engine.Engine) without a kernel.

The fakes wrap :class:`dlcachefs.cache.source.LocalSource` over a real temporary directory, so
the bytes they serve are the files' real bytes, and add one misbehaviour each: slow,
failing, hanging, or changing under the reader. All of them count their calls.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import dlcachefs.cache.source as source_mod
from dlcachefs.cache.engine import Engine
from dlcachefs.cache.source import Identity, LocalSource
from dlcachefs.config import Config
from dlcachefs.errors import NotFound, SourceError
from dlcachefs.session import Session, build

# ----- sources -------------------------------------------------------------------------


class CountingSource(LocalSource):
    """A LocalSource that counts calls (per method, and read_file per path)."""

    def __init__(self, root: str | bytes) -> None:
        super().__init__(root)
        self.calls: Counter[str] = Counter()
        self.reads: Counter[bytes] = Counter()
        self._lock = threading.Lock()

    def _count(self, name: str, rel: bytes | None = None) -> None:
        with self._lock:
            self.calls[name] += 1
            if rel is not None:
                self.reads[rel] += 1

    def lstat(self, rel: bytes) -> os.stat_result:
        self._count("lstat")
        return super().lstat(rel)

    def list_dir(self, rel: bytes):
        self._count("list_dir")
        return super().list_dir(rel)

    def read_file(self, rel: bytes, use_src_ino: bool) -> tuple[bytes, Identity]:
        self._count("read_file", rel)
        return super().read_file(rel, use_src_ino)


class SlowSource(CountingSource):
    """Every read_file sleeps ``delay`` seconds first (a slow network filesystem)."""

    def __init__(self, root: str | bytes, delay: float = 0.05) -> None:
        super().__init__(root)
        self.delay = delay

    def read_file(self, rel: bytes, use_src_ino: bool) -> tuple[bytes, Identity]:
        time.sleep(self.delay)  # what this fake simulates, not a wait for the engine
        return super().read_file(rel, use_src_ino)


class FailingSource(CountingSource):
    """read_file raises SourceError(err) for the first ``fail_times`` calls (``None``: always).

    Only paths in ``paths`` fail when it is given. ``err`` is an errno: EIO is transient
    (the engine retries), EACCES is not; ENOENT raises NotFound, as LocalSource does for a
    file that vanished.
    """

    def __init__(self, root: str | bytes, err: int = errno.EIO, fail_times: int | None = 1,
                 paths: set[bytes] | None = None) -> None:
        super().__init__(root)
        self.err = err
        self.fail_times = fail_times
        self.paths = paths
        self.failures = 0

    def read_file(self, rel: bytes, use_src_ino: bool) -> tuple[bytes, Identity]:
        self._count("read_file", rel)
        if self.paths is None or rel in self.paths:
            with self._lock:
                fail = self.fail_times is None or self.failures < self.fail_times
                if fail:
                    self.failures += 1
            if fail:
                msg = f"read {os.fsdecode(rel)}: {os.strerror(self.err)}"
                if self.err == errno.ENOENT:
                    raise NotFound(msg)
                raise SourceError(msg, self.err)
        return LocalSource.read_file(self, rel, use_src_ino)


class HangingSource(CountingSource):
    """read_file blocks until :meth:`release` (or ``max_hang`` seconds) on ``paths`` (all if None)."""

    def __init__(self, root: str | bytes, paths: set[bytes] | None = None,
                 max_hang: float = 30.0) -> None:
        super().__init__(root)
        self.paths = paths
        self.max_hang = max_hang
        self.gate = threading.Event()
        self.entered = threading.Event()

    def release(self) -> None:
        self.gate.set()

    def read_file(self, rel: bytes, use_src_ino: bool) -> tuple[bytes, Identity]:
        if self.paths is None or rel in self.paths:
            self.entered.set()
            self.gate.wait(self.max_hang)
        return super().read_file(rel, use_src_ino)


class HangingMetaSource(CountingSource):
    """lstat and list_dir of paths in ``paths`` block until :meth:`release`, once ``armed``
    (the start-up scan is not affected; arm it afterwards)."""

    def __init__(self, root: str | bytes, paths: set[bytes], max_hang: float = 30.0) -> None:
        super().__init__(root)
        self.paths = paths
        self.max_hang = max_hang
        self.armed = False
        self.gate = threading.Event()

    def release(self) -> None:
        self.gate.set()

    def _maybe_hang(self, rel: bytes) -> None:
        if self.armed and rel in self.paths:
            self.gate.wait(self.max_hang)

    def lstat(self, rel: bytes) -> os.stat_result:
        self._maybe_hang(rel)
        return super().lstat(rel)

    def list_dir(self, rel: bytes):
        self._maybe_hang(rel)
        return super().list_dir(rel)


class ChangingSource(CountingSource):
    """A source whose file ``target`` changes while it is being fetched.

    ``mode="before"``: the first ``times`` read_file calls of ``target`` rewrite the file
    and then read it (the fetched version differs from the one the namespace listed).
    ``mode="during"``: the file is rewritten between read_file's first ``fstat`` and its
    read, ``times`` times, so the real LocalSource.read_file must notice and retry (or
    raise SourceChanged when it changes on every attempt).
    Each rewrite grows the file by ``grow`` bytes and sets a new mtime.
    """

    def __init__(self, root: str | bytes, target: bytes, times: int = 1, mode: str = "during",
                 grow: int = 7) -> None:
        super().__init__(root)
        assert mode in ("before", "during")
        self.target = target
        self.remaining = times
        self.mode = mode
        self.grow = grow
        self.mutations = 0

    def mutate(self) -> None:
        path = self.full(self.target)
        with open(path, "r+b") as f:
            old = f.read()
            f.seek(0)
            f.write(bytes((b + 1) & 0xFF for b in old) + os.urandom(self.grow))
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        self.mutations += 1

    def read_file(self, rel: bytes, use_src_ino: bool) -> tuple[bytes, Identity]:
        if rel != self.target or self.remaining <= 0:
            return super().read_file(rel, use_src_ino)
        if self.mode == "before":
            self.remaining -= 1
            self.mutate()
            return super().read_file(rel, use_src_ino)
        orig = source_mod._read_all

        def mutating_read_all(fd: int, size: int) -> bytes:
            if self.remaining > 0:
                self.remaining -= 1
                self.mutate()
            return orig(fd, size)

        source_mod._read_all = mutating_read_all
        try:
            return super().read_file(rel, use_src_ino)
        finally:
            source_mod._read_all = orig


# ----- trees and configs ---------------------------------------------------------------


def write_tree(root: Path, files: dict[bytes, bytes]) -> None:
    """Create ``files`` (relative bytes path -> content) under ``root``."""
    rootb = os.fsencode(root)
    os.makedirs(rootb, exist_ok=True)
    for rel, data in files.items():
        p = os.path.join(rootb, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)


def read_source(root: Path, rel: bytes) -> bytes:
    with open(os.path.join(os.fsencode(root), rel), "rb") as f:
        return f.read()


def make_config(source: Path, cache: Path, **kw: Any) -> Config:
    """A Config for tests: small chunks, quick flushes, no free-space floor, the cache's
    invariants checked after every commit (``debug_invariants``)."""
    args: dict[str, Any] = dict(chunk_size=64 << 10, flush_interval=0.05, min_free=0,
                                source_timeout=10.0, source_threads=4, memory=64 << 20,
                                log_size=1 << 20, debug_invariants=True)
    args.update(kw)
    return Config(source=str(source), mountpoint="/nonexistent", cache_dir=str(cache), **args)


# ----- driving an engine ---------------------------------------------------------------


async def read_all(engine: Engine, rel: bytes, step: int = 100_000) -> bytes:
    """open + read (in ``step`` pieces, to EOF) + release of one file, as the kernel would."""
    e = engine.ns.resolve(rel)
    r = await engine.open(e.ino)
    try:
        out = bytearray()
        while True:
            piece = await engine.read(r.fh, len(out), step)
            out += piece
            if len(piece) < step:
                break
        return bytes(out)
    finally:
        engine.release(r.fh)


def run_session(cfg: Config, body: Callable[[Session], Awaitable[Any]], source=None,
                check_invariants: bool = True) -> tuple[Any, Session]:
    """Build the core as a mount does (:func:`dlcachefs.session.build`: every part, the
    policy of ``cfg.policy``, the control state), start it (blocking start-up, as the
    daemon does), run ``body(session)`` inside trio with the background tasks running,
    close it, and check the cache's invariants (:meth:`Engine.check_invariants`: the
    --cache-size account and the index) and that no check after a commit found a
    violation (``invariant_violations``).

    Returns (body's result, session); its files are closed by then (counters stay)."""
    problems: list[str] = []
    with build(cfg, source) as sess:
        eng = sess.engine
        result = sess.run(body)
        if check_invariants:
            problems = eng.check_invariants()
            if eng.counters.invariant_violations:
                problems.append(f"{eng.counters.invariant_violations} invariant violations "
                                "after commits (see the ERROR log lines)")
    assert problems == [], problems
    return result, sess


def run_engine(cfg: Config, body: Callable[[Engine], Awaitable[Any]], source=None,
               check_invariants: bool = True) -> tuple[Any, Engine]:
    """:func:`run_session` for a body that needs the read path only: ``body(engine)``;
    returns (body's result, engine)."""
    result, sess = run_session(cfg, lambda s: body(s.engine), source, check_invariants)
    return result, sess.engine


class Clock:
    """``time`` as the namespace sees it (monkeypatched over its ``time`` module): a wall
    clock the test moves by setting ``now``; monotonic and perf counters stay real."""

    def __init__(self) -> None:
        self.now = time.time()
        self.monotonic = time.monotonic
        self.perf_counter = time.perf_counter

    def time(self) -> float:
        return self.now

    def time_ns(self) -> int:
        return int(self.now * 1e9)
