"""Tier 3: the filesystem facade's version-coherence rules against a reference model of
what the kernel holds, without FUSE (as mountpoint-s3 tests its filesystem against a model).

A hypothesis state machine drives :class:`dlcachefs.cache.filesystem.Filesystem` over a
real engine (built as a mount builds it, :func:`dlcachefs.session.build`) and a source
whose files change between steps, and plays the kernel itself: a small model of one
inode's attributes, size and pages that takes the facade's answers and directives the way
Linux's FUSE client does (attributes from LOOKUP, GETATTR and READDIRPLUS, a size or mtime
change dropping the pages, ``keep_cache`` off dropping them at an open, ``direct_io``
bypassing them, a READ reply filling them and a short one cutting the size, stored pages
raising the size, invalidations dropping attributes, or attributes and pages). The rules:

* every read through an open returns exactly its version's bytes at that offset: never
  bytes of two versions, never cut short; it may fail only once the file has changed;
* a READ that fills the page cache (an open without ``direct_io``), and pages given with an
  open, are of the newest version the mount knows;
* pages are given with an open only at the file's first open in the mount, when no other
  open of it is held, and never with ``direct_io``;
* an open that reads through the page cache finds nothing there of another version;
* an open that reads through the page cache has no open of another version beside it
  (the pages and the attributes are the inode's, shared by all its opens);
* while a file is open, LOOKUP, GETATTR and READDIRPLUS answer the version of one of its
  opens, the same one for as long as that version is open; ``fstat`` of an open that is
  the only version open gives its own size (the first open after a change drops the
  kernel's attributes at once);
* whenever the kernel may hold attributes or pages of a version older than the one the
  mount knows, the mount knows it is behind (the inode is in ``Namespace.changed``, so
  opens bypass the pages); when the last open of such a file closes, an invalidation of
  the inode is queued; once the invalidations went through, a closed file has nothing
  older in the kernel.

The invalidation worker runs after every request in half of the runs, and only at the
``kernel_told`` steps (lagging behind) in the others.

Two windows: ``--revalidate 0`` (every lookup and open checks the source) and 60 s with a
fake clock (the kernel's attributes and the snapshot expire together when it moves).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import trio
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from dlcachefs.cache import namespace as ns_mod
from dlcachefs.cache.filesystem import Attributes, Filesystem, Opened
from dlcachefs.cache.source import Identity
from dlcachefs.errors import SourceChanged
from dlcachefs.session import Session, build
from dlcachefs.store.schema import Entry
from dlcachefs.testing.fakes import Clock, CountingSource, make_config, write_tree

PAGE = 4096
FILES = (b"f0",)
SIZES = (0, 1, 100, PAGE - 1, PAGE, PAGE + 1, 2 * PAGE + 300)
#: sequences tried per window, and steps at most in each
EXAMPLES, STEPS = 100, 50


def content(f: int, version: int, size: int) -> bytes:
    """Version ``version`` of file ``f``: any two versions of a file differ at every
    offset (251 is prime), so bytes of two versions read as one are seen."""
    return bytes((version * 31 + f * 7 + k) % 251 for k in range(size))


class ChangingSource(CountingSource):
    """A source whose files the test changes, now or just before the mount reads them
    (``before_read``: path -> the change, made once, in the fetch's thread while the
    test's thread waits for the call that fetches)."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.before_read: dict[bytes, Callable[[], None]] = {}

    def read_file(self, rel: bytes, use_src_ino: bool) -> tuple[bytes, Identity]:
        change = self.before_read.pop(rel, None)
        if change is not None:
            change()
        return super().read_file(rel, use_src_ino)


class Core:
    """A mount's core and its facade without a kernel, run by trio in a thread of its
    own; the state machine's steps call into it and wait for the answer."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.engine = session.engine
        self.session.start()
        self.fs: Filesystem | None = None
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failed is not None:
            raise self._failed

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            self._failed = e
            self._ready.set()

    async def _main(self) -> None:
        eng = self.engine
        self.token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()

        async def statfs() -> os.statvfs_result:
            return await eng.calls.call(eng.source.statvfs)

        async with trio.open_nursery() as nursery:
            await nursery.start(eng.run)
            self.fs = Filesystem(eng, control=self.session.control, stats=self.session.stats,
                                 on_opendir=lambda e: None, on_control_open=lambda: None,
                                 statfs=statfs)
            self._ready.set()
            await self._stop.wait()
            await eng.close()
            nursery.cancel_scope.cancel()

    def call(self, afn, *args):
        """``await afn(*args)`` on the core's loop."""
        return trio.from_thread.run(afn, *args, trio_token=self.token)

    def call_sync(self, fn, *args):
        """``fn(*args)`` on the core's loop."""
        return trio.from_thread.run_sync(fn, *args, trio_token=self.token)

    def close(self) -> list[str]:
        """Stop the loop, close the engine; the cache's broken invariants."""
        trio.from_thread.run_sync(self._stop.set, trio_token=self.token)
        self._thread.join(timeout=60)
        assert not self._thread.is_alive(), "the core's loop did not stop"
        problems = self.engine.check_invariants()
        if self.engine.counters.invariant_violations:
            problems.append("invariant violations after commits")
        self.session.close_files()
        if self._failed is not None:
            raise self._failed
        return problems


@dataclass
class KInode:
    """What the kernel holds of one inode: its attributes (valid or not), its size, and
    its pages (each tagged with the version whose bytes it holds)."""

    attrs: Entry | None = None
    valid: bool = False
    size: int = 0
    pages: dict[int, tuple[int, bytes]] = field(default_factory=dict)

    def held(self) -> set[int]:
        """Versions (mtime_ns) of which the kernel holds something it would use."""
        out = {v for v, _ in self.pages.values()}
        if self.valid and self.attrs is not None:
            out.add(self.attrs.mtime_ns)
        return out


@dataclass
class Handle:
    ino: int
    f: int
    fh: int
    version: int  # mtime_ns of the version the open serves
    direct_io: bool


class CoherenceModel(RuleBasedStateMachine):
    revalidate = 0.0
    clock: Clock | None = None
    root: Path | None = None

    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        assert self.root is not None
        base = self.root
        n = 0
        while (base / f"ex{n}").exists():
            n += 1
        self.dir = base / f"ex{n}"
        self.src = self.dir / "src"
        self.mtime = 1_000_000_000_000_000_000
        self.cur: dict[int, int] = {}  # file -> its current version on the source (mtime)
        self.data: dict[tuple[int, int], bytes] = {}  # (file, mtime) -> bytes
        files = {}
        for f, name in enumerate(FILES):
            files[b"d/" + name] = content(f, 0, 100 * (f + 1))
        write_tree(self.src, files)
        for f, name in enumerate(FILES):
            self._stamp(f, files[b"d/" + name])
        self.source = ChangingSource(str(self.src))
        self.core = Core(build(make_config(
            self.src, self.dir / "cache", revalidate=self.revalidate, store_pages=1 << 20,
            chunk_size=1 << 20, flush_interval=3600.0), self.source))
        self.fs = self.core.fs
        assert self.fs is not None
        self.kernel: dict[int, KInode] = {}
        self.ino: dict[int, int] = {}
        self.opened_once: set[int] = set()  # inodes opened in this mount
        self.open: dict[int, list[Handle]] = {}  # ino -> its handles open
        self.answered_open: dict[int, int] = {}  # ino -> version answered while open
        self.versions = 0

    # ----- the source --------------------------------------------------------------

    def _stamp(self, f: int, data: bytes) -> None:
        self.mtime += 1_000_000_000
        path = self.src / "d" / os.fsdecode(FILES[f])
        os.utime(path, ns=(self.mtime, self.mtime))
        self.cur[f] = self.mtime
        self.data[(f, self.mtime)] = data

    def _current(self, ino: int) -> int | None:
        """The version (mtime) of ``ino`` the mount knows."""
        e = self.core.call_sync(self.core.engine.index.get_entry, ino)
        return None if e is None else e.mtime_ns

    # ----- the kernel ----------------------------------------------------------------

    def _take_attrs(self, a: Attributes) -> None:
        """Attributes given to the kernel (fuse_change_attributes with auto_inval_data:
        a size or mtime change drops the pages), kept until they time out (0: asked
        again at once)."""
        e = a.entry
        k = self.kernel.setdefault(e.ino, KInode())
        if k.attrs is not None and (k.size != e.size or k.attrs.mtime_ns != e.mtime_ns):
            k.pages.clear()
        k.attrs, k.valid, k.size = e, a.timeout > 0, e.size

    def _check_answer(self, e: Entry) -> None:
        hs = self.open.get(e.ino)
        if not hs:
            return
        versions = {h.version for h in hs}
        assert e.mtime_ns in versions, (
            "an open file answered with a version none of its opens reads")
        last = self.answered_open.get(e.ino)
        if last is not None and last in versions:
            assert e.mtime_ns == last, "an open file's attributes changed under its open version"
        self.answered_open[e.ino] = e.mtime_ns

    def _answered(self, a: Attributes) -> None:
        self._check_answer(a.entry)
        self._take_attrs(a)

    def _getattr(self, ino: int) -> None:
        self._answered(self.core.call(self.fs.getattr, ino))

    # ----- rules ---------------------------------------------------------------------

    @initialize(eager_worker=st.booleans())
    def look_up_everything(self, eager_worker: bool) -> None:
        """The kernel looks the files up. ``eager_worker``: in this run the invalidation
        worker sends what was queued right after each request (what it mostly does);
        otherwise only at the :meth:`kernel_told` steps (a worker that lags behind)."""
        self.eager_worker = eager_worker
        d = self.core.call(self.fs.lookup, ns_mod.ROOT_INO, b"d")
        for f, name in enumerate(FILES):
            a = self.core.call(self.fs.lookup, d.entry.ino, name)
            self.ino[f] = a.entry.ino
            self._answered(a)
        self.dir_ino = d.entry.ino

    @rule(f=st.sampled_from(range(len(FILES))),
          how=st.sampled_from(("lookup", "getattr", "readdirplus")))
    def kernel_asks(self, f: int, how: str) -> None:
        """The kernel asks for a file's attributes: a path walk's LOOKUP, a GETATTR, or
        an ``ls -l``'s READDIRPLUS (which answers every file of the directory)."""
        if how == "lookup":
            a = self.core.call(self.fs.lookup, self.dir_ino, FILES[f])
            assert a.entry.ino == self.ino[f]
            self._answered(a)
        elif how == "getattr":
            self._getattr(self.ino[f])
        else:
            dh = self.core.call(self.fs.opendir, self.dir_ino)
            listed = self.core.call_sync(lambda: list(self.fs.readdir(dh, 0)))
            self.core.call_sync(self.fs.releasedir, dh)
            for name, a, _ in listed:
                if name in FILES:
                    self._answered(a)
        self._requests_done()

    @rule(target=handles, f=st.sampled_from(range(len(FILES))), kernel_takes=st.booleans(),
          then_fstat=st.booleans())
    def open_file(self, f: int, kernel_takes: bool, then_fstat: bool) -> Handle:
        """An open; ``kernel_takes``: the kernel takes the pages given with it;
        ``then_fstat``: the opener asks ``fstat`` at once, ahead of the invalidation
        worker (as ``numpy.fromfile`` does)."""
        ino = self.ino[f]
        k = self.kernel.setdefault(ino, KInode())
        others = bool(self.open.get(ino))
        first = ino not in self.opened_once
        self.opened_once.add(ino)
        r: Opened = self.core.call(self.fs.open, ino, os.O_RDONLY, os.getuid(), 0)
        assert r.entry is not None and r.entry.ino == ino
        v = r.entry.mtime_ns
        if self.revalidate == 0:
            assert v == self.cur[f], "an open with --revalidate 0 served an older version"
        if r.drop_attrs:
            k.valid = False
        if r.pages is not None:
            assert first, "pages given at a later open than the file's first"
            assert not others, "pages given while another open of the file is held"
            assert not r.direct_io
            assert bytes(r.pages) == self.data[(f, v)], "pages given are not the open's file"
            assert self._current(ino) == v, "pages given of a version older than the known one"
            if kernel_takes:
                for p in range(0, (len(r.pages) + PAGE - 1) // PAGE):
                    k.pages[p] = (v, bytes(r.pages[p * PAGE : (p + 1) * PAGE]))
                k.size = max(k.size, len(r.pages))
                self.core.call_sync(self.fs.pages_stored, r)
                assert r.keep_cache
        if not r.keep_cache:
            k.pages.clear()
        if not r.direct_io:
            # the pages and the attributes are the inode's, shared by all its opens
            assert k.held() <= {v}, ("an open reads through the page cache while the kernel "
                                     "holds another version")
            assert all(o.version == v for o in self.open.get(ino, [])), (
                "an open reads through the page cache beside an open of another version")
        h = Handle(ino, f, r.fh, v, r.direct_io)
        self.open.setdefault(ino, []).append(h)
        if then_fstat:
            self._fstat(h)
        self._requests_done()
        return h

    @rule(h=handles, off=st.integers(0, 3 * PAGE), size=st.sampled_from((1, 16, PAGE, 3 * PAGE)))
    def read(self, h: Handle, off: int, size: int) -> None:
        if h not in self.open.get(h.ino, []):
            return  # released
        want = self.data[(h.f, h.version)][off : off + size]
        try:
            got = self._direct(h, off, size) if h.direct_io else self._paged(h, off, size)
        except SourceChanged:
            assert self.cur[h.f] != h.version, "a read failed while its version is current"
        else:
            assert got == want, (f"an open of version {h.version} read {len(got)} bytes at "
                                 f"{off} that are not its own {len(want)}")
        self._requests_done()

    @rule(h=handles)
    def fstat(self, h: Handle) -> None:
        """``fstat`` on an open: the kernel's attributes, asked again when it holds none.
        An open that is the only version open here gets its own size (a reader sizing its
        buffer by it, as ``numpy.fromfile`` does, reads it whole); beside opens of another
        version, the size their reads go by (:meth:`Coherence.answer`)."""
        if h in self.open.get(h.ino, []):
            self._fstat(h)
            self._requests_done()

    def _fstat(self, h: Handle) -> None:
        k = self.kernel[h.ino]
        if not k.valid:
            self._getattr(h.ino)
        if {o.version for o in self.open[h.ino]} == {h.version}:
            assert k.size == len(self.data[(h.f, h.version)]), (
                "fstat of an open gives another size than its version's")

    def _direct(self, h: Handle, off: int, size: int) -> bytes:
        return bytes(self.core.call(self.fs.read, h.fh, off, size))

    def _paged(self, h: Handle, off: int, size: int) -> bytes:
        k = self.kernel[h.ino]
        if not k.valid:  # auto_inval_data: attributes refreshed before a read
            self._getattr(h.ino)
        end = min(off + size, k.size)
        p = off // PAGE
        while p * PAGE < end:
            if p not in k.pages:
                r = bytes(self.core.call(self.fs.read, h.fh, p * PAGE, PAGE))
                assert self._current(h.ino) == h.version, (
                    "a READ filled the page cache with a version older than the known one")
                k.pages[p] = (h.version, r + bytes(PAGE - len(r)))
                if len(r) < PAGE and p * PAGE + len(r) < k.size:
                    k.size = p * PAGE + len(r)  # a short read: the kernel's end of file
                    end = min(end, k.size)
            p += 1
        out = b"".join(k.pages[q][1] for q in range(off // PAGE, p))
        start = off - (off // PAGE) * PAGE
        return out[start : start + max(0, end - off)]

    @rule(h=consumes(handles))
    def release(self, h: Handle) -> None:
        hs = self.open.get(h.ino, [])
        if h not in hs:
            return
        hs.remove(h)
        self.core.call_sync(self.fs.release, h.fh)
        if not hs:
            self.answered_open.pop(h.ino, None)
            if self.kernel[h.ino].held() - {self._current(h.ino)}:
                pending = self.core.call_sync(self.fs.coherence.pending)
                assert any(i.kind == "inode" and i.ino == h.ino for i in pending), (
                    "the last open closed with the kernel behind and no invalidation queued")
        self._requests_done()

    @rule(f=st.sampled_from(range(len(FILES))), size=st.sampled_from(SIZES),
          replace=st.booleans(), at_next_fetch=st.booleans())
    def change_on_source(self, f: int, size: int, replace: bool, at_next_fetch: bool
                         ) -> None:
        """The file changes on the source: now, or just before the mount's next read of
        it (the fetch then finds a newer version than the snapshot holds)."""
        rel = b"d/" + FILES[f]
        armed = self.source.before_read.pop(rel, None)
        if armed is not None:
            armed()  # the change armed before comes first
        if at_next_fetch:
            self.source.before_read[rel] = lambda: self._write(f, size, replace)
        else:
            self._write(f, size, replace)

    def _write(self, f: int, size: int, replace: bool) -> None:
        self.versions += 1
        data = content(f, self.versions, size)
        path = self.src / "d" / os.fsdecode(FILES[f])
        if replace:  # a new file renamed over the old one (a new source inode)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.rename(tmp, path)
        else:
            with open(path, "r+b") as fo:
                fo.truncate(0)
                fo.write(data)
        self._stamp(f, data)

    def _requests_done(self) -> None:
        if self.eager_worker:
            self.kernel_told()

    @rule()
    def kernel_told(self) -> None:
        """The invalidation worker's batch goes through."""
        for inv in self.core.call_sync(self.fs.coherence.take):
            mark = self.core.call_sync(self.fs.invalidation_mark, inv)
            if inv.kind == "inode" and inv.ino in self.kernel:
                k = self.kernel[inv.ino]
                k.valid = False
                k.pages.clear()
            self.core.call_sync(self.fs.invalidation_done, inv, mark)
        for f, ino in self.ino.items():
            if not self.open.get(ino) and ino in self.kernel:
                assert not self.kernel[ino].held() - {self._current(ino)}, (
                    f"file {f} is closed, the kernel was told, and it still holds an "
                    "older version than the mount knows")

    @rule(f=st.sampled_from(range(len(FILES))))
    def kernel_reclaims_pages(self, f: int) -> None:
        """Memory pressure: the kernel drops clean pages whenever it likes."""
        self.kernel.setdefault(self.ino[f], KInode()).pages.clear()

    @rule()
    def writer_seals(self) -> None:
        """What was fetched is sealed into the cache: later opens find it cached."""
        self.core.call(self.fs.engine.flush)

    @precondition(lambda self: self.revalidate > 0)
    @rule()
    def time_passes(self) -> None:
        """Past the window: the snapshot and the kernel's attributes expire together."""
        assert self.clock is not None
        self.clock.now += self.revalidate + 1
        for k in self.kernel.values():
            k.valid = False

    @invariant()
    def the_mount_knows_when_the_kernel_is_behind(self) -> None:
        if not self.ino:
            return
        changed = self.core.call_sync(lambda: dict(self.fs.ns.changed))
        for f, ino in self.ino.items():
            k = self.kernel.get(ino)
            cur = self._current(ino)
            if k is not None and k.held() - {cur}:
                assert ino in changed, (f"the kernel holds an older version of file {f} and "
                                        "the mount does not know it")

    def teardown(self) -> None:
        for hs in self.open.values():
            for h in hs:
                self.core.call_sync(self.fs.release, h.fh)
        problems = self.core.close()
        assert problems == [], problems


@pytest.mark.parametrize("revalidate", [0.0, 60.0])
def test_the_facade_keeps_the_kernel_coherent(tmp_path, monkeypatch, revalidate):
    clock = Clock()
    monkeypatch.setattr(ns_mod, "time", clock)

    class Machine(CoherenceModel):
        pass

    Machine.revalidate = revalidate
    Machine.clock = clock
    Machine.root = tmp_path
    # the same sequences at every run (a failure is not left to chance); a deeper search:
    # COHERENCE_EXAMPLES=1000
    examples = int(os.environ.get("COHERENCE_EXAMPLES", EXAMPLES))
    run_state_machine_as_test(Machine, settings=settings(
        max_examples=examples, stateful_step_count=STEPS, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
