"""``dlcachefs warmup MNT [PATH...] [--order FILE]``: fill the cache before training.

How: each file to warm is opened through the mount and one byte of it is read. The
daemon's ``open`` fetches the whole file from the source and hands it to the chunk writer
(:mod:`dlcachefs.cache.engine`), so the open is the warm-up and nothing else is needed:
no control command, and the files are cached exactly as a training's reads cache them
(same policy, same chunks, same checksums). ``--jobs`` opens run at once (threads; the
daemon bounds the source reads with ``--source-threads``).

What is cached already is asked of the cache's index, opened read-only from this process
(:class:`dlcachefs.store.readonly.IndexReader`, where ``.dlcache/zerocopy`` says it is),
with the rule an ``open`` through the mount applies: the path resolved through the
snapshot, its directory fresh, the record of the file's current version present. Those
files are skipped, so an interrupted warm-up resumes where it stopped. When the index
cannot be opened here (another user's cache, no lmdb), nothing is skipped; an open of a
cached file is then a cache hit, which costs no source read.

What fits: the files are taken in order (``--order FILE``, else the paths given, each
directory walked in sorted order), and the cache's budget (``--cache-size``) is spent on
them from the first: the warm-up stops before the first file that would take the total of
the files warmed (cached ones included) past the budget, since warming more would evict
files warmed earlier. A file counts as what it takes in the cache's chunk logs, which is
what the budget bounds (:mod:`dlcachefs.cache.writer`): its bytes, its record's header
and key (its path; :func:`dlcachefs.store.chunkfmt.record_len`) and one chunk header (an
upper bound: a chunk holds one record or more). Files larger than ``--max-cached-file``
are never cached and are left out. ``--dry-run`` prints this plan and reads nothing.

Files cached already that are not in the list are counted and shown (``other_cached``),
not taken off the budget: the cache's policy chooses what to evict to make room for the
warm-up, and with the default ``lru`` those files, used longer ago than anything the
warm-up opens, go first. Taking them off would let an old dataset's files keep a new
one from being warmed at all.

A path of ``--order`` that does not exist on the mount (any more), or cannot be used (not
inside the mount, not a file or directory, a directory that cannot be listed), is
skipped and reported (how many, and the first few); the rest is warmed and the exit
status is 1 at the end. A path given on the command line that cannot be used stops the
command before anything is read (exit 2), as a mistyped argument should.

Standard library, plus :mod:`rich` for the progress bar when it is installed and stderr
is a terminal; lmdb only to ask what is cached. No trio.
"""

from __future__ import annotations

import json
import os
import queue
import stat
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from dlcachefs.admin import dlcachedir
from dlcachefs.admin.dlcachedir import VDIR
from dlcachefs.store.chunkfmt import CHUNK_HEADER_SIZE, record_len
from dlcachefs.units import format_size

#: ``--order`` paths that were skipped shown in the text output (all are in the JSON)
SHOW_SKIPPED = 5


@dataclass(frozen=True, slots=True)
class Item:
    """A file to warm: its path relative to the mount's root and its size."""

    rel: str
    size: int


@dataclass
class Plan:
    """The warm-up of a list of files, split by what will happen to each."""

    files: list[Item]            # every file asked for, in order
    to_fetch: list[Item]         # not cached, within the budget: opened
    cached: list[Item]           # cached already, within the budget: skipped
    left_out: list[Item]         # past the budget (would evict files warmed earlier)
    too_large: list[Item]        # > --max-cached-file: never cached
    budget: int                  # --cache-size of the mount
    max_cached_file: int | None
    cached_known: bool           # False: the index could not be read, nothing is skipped
    #: cached files not in the list: (files, bytes) from the mount's stats; None when the
    #: index could not be read (then which cached files are in the list is not known)
    other_cached: tuple[int, int] | None = None
    #: ``--order`` paths skipped: (path, why), in order
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def as_dict(self) -> dict:
        def part(items: list[Item]) -> dict:
            return {"files": len(items), "bytes": sum(i.size for i in items)}

        return {"files": part(self.files), "to_fetch": part(self.to_fetch),
                "cached": part(self.cached), "left_out": part(self.left_out),
                "too_large": part(self.too_large), "budget_bytes": self.budget,
                "max_cached_file": self.max_cached_file, "cached_known": self.cached_known,
                "cost_bytes": sum(cost(i) for i in self.to_fetch + self.cached),
                "other_cached": {"files": self.other_cached[0], "bytes": self.other_cached[1]}
                if self.other_cached is not None else None,
                "skipped": [{"path": p, "error": e} for p, e in self.skipped],
                "last_fitting": (self.to_fetch + self.cached)[-1].rel
                if (self.to_fetch or self.cached) else None}


# ----- which files ---------------------------------------------------------------------

def _rel_of(mnt: str, path: str) -> str:
    """``path`` (absolute inside ``mnt``, or relative to it) as a path relative to
    ``mnt``; ValueError when it is outside."""
    full = os.path.normpath(path if os.path.isabs(path) else os.path.join(mnt, path))
    rel = os.path.relpath(full, mnt)
    if rel == ".":
        return ""
    if rel.startswith(".."):
        raise ValueError(f"{path} is not inside the mount {mnt}")
    return rel


def _walk(mnt: str, rel: str) -> Iterator[Item]:
    """Regular files under ``rel``, depth first in sorted order (links not followed; the
    mount lists from its snapshot, so this reads nothing from the source)."""
    stack = [rel]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(os.path.join(mnt, d)) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as e:
            raise ValueError(f"cannot list {os.path.join(mnt, d)}: {e.strerror}") from None
        subdirs = []
        for e in entries:
            if not d and e.name == VDIR:
                continue  # the mount's own files, should a listing show them
            r = os.path.join(d, e.name) if d else e.name
            if e.is_dir(follow_symlinks=False):
                subdirs.append(r)
            elif e.is_file(follow_symlinks=False):
                yield Item(r, e.stat(follow_symlinks=False).st_size)
        stack.extend(reversed(subdirs))


def _one(mnt: str, rel: str) -> Iterator[Item]:
    full = os.path.join(mnt, rel)
    # a symlink given by name is followed, but only within the mount: its target is what
    # is warmed (counted once however it is named), never a file elsewhere
    real = os.path.realpath(full)
    inside = os.path.relpath(real, os.path.realpath(mnt))
    if inside == os.pardir or inside.startswith(os.pardir + os.sep):
        raise ValueError(f"{full} leads outside the mount (to {real})")
    rel = "" if inside == os.curdir else inside
    if rel.split(os.sep)[0] == VDIR:
        raise ValueError(f"{full} is the mount's own control directory, not the dataset's")
    full = os.path.join(mnt, rel)
    try:
        st = os.stat(full)
    except OSError as e:
        raise ValueError(f"{full}: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        yield from _walk(mnt, rel)
    elif stat.S_ISREG(st.st_mode):
        yield Item(rel, st.st_size)
    else:
        raise ValueError(f"{full} is neither a file nor a directory")


def read_order(path: str) -> list[str]:
    """The paths of an order file: one a line, relative to the mount (or absolute inside
    it); blank lines and lines starting with ``#`` are skipped."""
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            lines = [ln.rstrip("\n") for ln in f]
    except OSError as e:
        raise ValueError(f"--order {path}: {e.strerror}") from None
    return [ln for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


def collect(mnt: str, paths: Iterable[str] = (), order: list[str] | None = None,
            skipped: list[tuple[str, str]] | None = None) -> list[Item]:
    """The files to warm, in order, each once: the order file's paths (files, or
    directories walked), else ``paths``, else the whole mount. A path that cannot be used
    raises ValueError, except an order file's when ``skipped`` is given: it is appended
    there as (path, why) and the others are taken (a directory that fails half way keeps
    the files listed before)."""
    todo = order if order is not None else (list(paths) or [mnt])
    out: list[Item] = []
    seen: set[str] = set()
    for p in todo:
        try:
            for it in _one(mnt, _rel_of(mnt, p)):
                if it.rel not in seen:
                    seen.add(it.rel)
                    out.append(it)
        except ValueError as e:
            if order is None or skipped is None:
                raise
            skipped.append((p, str(e)))
    return out


# ----- what is cached ------------------------------------------------------------------

class CachedCheck:
    """Whether a file's current version is in the cache, asked of the mount's index
    opened read-only (see the module doc). ``known`` is False when it cannot be opened."""

    def __init__(self, mnt: str) -> None:
        self.reader = None
        self.why: str | None = None
        try:
            info = dlcachedir.cache_info(mnt)
            # lmdb, only for this command
            from dlcachefs.store.readonly import IndexReader, Located  # noqa: PLC0415

            self._located = Located
            self.revalidate = float(info["revalidate_s"])
            self.reader = IndexReader(str(info["index_dir"]))
        except Exception as e:  # noqa: BLE001 - any reason: warm without skipping
            self.why = f"{type(e).__name__}: {e}"

    @property
    def known(self) -> bool:
        return self.reader is not None

    def __call__(self, rel: str, fresh: bool = True) -> bool:
        """``fresh``: only if the listing it was found in is within the mount's
        revalidation window (a file to skip must be the current version); else whether
        the index holds it at all (the count at the end: a short window must not make
        files just cached look uncached)."""
        if self.reader is None:
            return False
        parts = os.fsencode(rel).split(b"/")
        window = self.revalidate if fresh else float("inf")
        return isinstance(self.reader.locate(parts, window, time.time()), self._located)

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None


def cost(it: Item) -> int:
    """Bytes ``it`` takes of the cache's budget once cached: its record (header, key: the
    path, data) and a chunk header (an upper bound: one chunk per record)."""
    return record_len(len(os.fsencode(it.rel)), it.size) + CHUNK_HEADER_SIZE


def make_plan(files: list[Item], stats: dict, is_cached, cached_known: bool = True,
              cost=cost) -> Plan:
    """Split ``files`` (in order) by the budget, each counting ``cost(item)`` bytes, and
    by what ``is_cached(rel)`` says."""
    budget = int(stats.get("cache_limit_bytes") or 0)
    max_file = stats.get("max_cached_file")
    to_fetch: list[Item] = []
    cached: list[Item] = []
    left_out: list[Item] = []
    too_large: list[Item] = []
    total = 0
    for it in files:
        if max_file is not None and it.size > max_file:
            too_large.append(it)
            continue
        c = cost(it)
        if left_out or total + c > budget:
            left_out.append(it)  # the order is kept: nothing after the first that misses
            continue
        total += c
        (cached if is_cached(it.rel) else to_fetch).append(it)
    other = None
    if cached_known and "cached_files" in stats and "cached_bytes" in stats:
        # the list's cached files: `cached`, and those past the budget or too large
        # (asked here: the loop above does not ask about them)
        listed = cached + [it for it in (*left_out, *too_large) if is_cached(it.rel)]
        other = (max(0, int(stats["cached_files"]) - len(listed)),
                 max(0, int(stats["cached_bytes"]) - sum(it.size for it in listed)))
    return Plan(files, to_fetch, cached, left_out, too_large, budget, max_file, cached_known,
                other)


# ----- warming -------------------------------------------------------------------------

@dataclass
class Result:
    fetched: int = 0
    fetched_bytes: int = 0
    errors: list[tuple[str, str]] = field(default_factory=list)
    seconds: float = 0.0
    interrupted: bool = False
    cached_after: int | None = None  # files of the plan found cached at the end

    def as_dict(self) -> dict:
        return {"fetched": self.fetched, "fetched_bytes": self.fetched_bytes,
                "errors": [{"path": p, "error": e} for p, e in self.errors],
                "seconds": round(self.seconds, 3),
                "bytes_per_s": round(self.fetched_bytes / self.seconds, 1)
                if self.seconds > 0 else None,
                "interrupted": self.interrupted, "cached_after": self.cached_after}


def touch(path: str) -> None:
    """Open ``path`` through the mount and read one byte: the daemon's open fetches and
    caches the whole file (see the module doc)."""
    with open(path, "rb", buffering=0) as f:
        f.read(1)


class _Progress:
    """A rich progress bar (files, bytes, throughput, ETA) on a terminal; otherwise a
    line every ``every`` seconds on stderr."""

    def __init__(self, total_files: int, total_bytes: int, enabled: bool,
                 every: float = 10.0) -> None:
        self.files, self.bytes = total_files, total_bytes
        self.done_files = self.done_bytes = 0
        self.t0 = time.monotonic()
        self.last = self.t0
        self.every = every
        self.enabled = enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from rich.console import Console  # noqa: PLC0415
                from rich.progress import (  # noqa: PLC0415
                    BarColumn,
                    DownloadColumn,
                    Progress,
                    TextColumn,
                    TimeRemainingColumn,
                    TransferSpeedColumn,
                )
            except ImportError:
                pass
            else:
                self.bar = Progress(TextColumn("warmup"), BarColumn(), DownloadColumn(),
                                    TransferSpeedColumn(), TextColumn("{task.fields[files]}"),
                                    TextColumn("ETA"), TimeRemainingColumn(),
                                    console=Console(stderr=True))
                self.task = self.bar.add_task("warmup", total=max(total_bytes, 1),
                                              files=self._files())
                self.bar.start()

    def advance(self, size: int) -> None:
        self.done_files += 1
        self.done_bytes += size
        if self.bar is not None:
            self.bar.update(self.task, advance=size, files=self._files())
            return
        now = time.monotonic()
        if self.enabled and now - self.last >= self.every:
            self.last = now
            rate = self.done_bytes / max(now - self.t0, 1e-9)
            eta = (self.bytes - self.done_bytes) / rate if rate > 0 else float("inf")
            print(f"warmup: {self.done_files:,}/{self.files:,} files, "
                  f"{format_size(self.done_bytes)}/{format_size(self.bytes)}, "
                  f"{format_size(rate)}/s, ETA {eta:.0f} s", file=sys.stderr, flush=True)

    def _files(self) -> str:
        return f"{self.done_files:,}/{self.files:,} files"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def warm(mnt: str, items: list[Item], jobs: int, progress: bool = True) -> Result:
    """Open each of ``items`` through the mount, ``jobs`` at a time. Ctrl-C stops after
    the opens in progress (what was fetched stays cached)."""
    res = Result()
    it = iter(items)
    lock = threading.Lock()
    stop = threading.Event()
    done: queue.Queue = queue.Queue()

    def worker() -> None:
        while not stop.is_set():
            with lock:
                item = next(it, None)
            if item is None:
                break
            try:
                touch(os.path.join(mnt, item.rel))
                done.put((item, None))
            except OSError as e:
                done.put((item, e.strerror or str(e)))
        done.put(None)

    bar = _Progress(len(items), sum(i.size for i in items), progress)
    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, daemon=True, name=f"warmup-{i}")
               for i in range(max(1, jobs))]
    for t in threads:
        t.start()
    running = len(threads)
    try:
        while running:
            got = done.get()
            if got is None:
                running -= 1
                continue
            item, err = got
            if err is None:
                res.fetched += 1
                res.fetched_bytes += item.size
            else:
                res.errors.append((item.rel, err))
            bar.advance(item.size)
    except KeyboardInterrupt:
        stop.set()
        res.interrupted = True
    finally:
        bar.close()
        res.seconds = time.monotonic() - t0
    return res


def wait_settled(mnt: str, timeout: float = 30.0) -> bool:
    """Wait until the daemon has sealed what it fetched (``pending_bytes`` 0 in stats),
    so the index answers for it; False after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if not dlcachedir.stats(mnt).get("pending_bytes"):
                return True
        except dlcachedir.NotAMount:
            return False
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


# ----- the command ---------------------------------------------------------------------

def print_plan(mnt: str, plan: Plan, out=sys.stdout) -> None:
    def line(label: str, items: list[Item]) -> None:
        print(f"  {label:<16} {len(items):>10,} files  {format_size(sum(i.size for i in items)):>9}",
              file=out)

    print(f"warmup plan for {mnt}:", file=out)
    line("asked for", plan.files)
    if plan.cached_known:
        line("already cached", plan.cached)
    else:
        print("  already cached   unknown (the cache index cannot be read here; "
              "cached files are opened again, as hits)", file=out)
    line("to fetch", plan.to_fetch)
    print(f"  cache budget     {format_size(plan.budget):>27} (--cache-size)", file=out)
    fit = plan.as_dict()["last_fitting"]
    if plan.left_out:
        line("do not fit", plan.left_out)
        print(f"  the budget ends after {fit!r}; the rest would evict files warmed "
              "earlier", file=out)
    else:
        print("  everything fits", file=out)
    if plan.too_large:
        line("too large", plan.too_large)
        print(f"  (larger than --max-cached-file {format_size(plan.max_cached_file or 0)}: "
              "read through, never cached)", file=out)
    if plan.other_cached is not None and plan.other_cached[0]:
        n, b = plan.other_cached
        print(f"  {'cached, not here':<16} {n:>10,} files  {format_size(b):>9}  (the policy "
              "evicts from these too, to make room)", file=out)


def print_skipped(order_file: str, skipped: list[tuple[str, str]], out=sys.stderr) -> None:
    """How many ``--order`` paths were skipped, and the first :data:`SHOW_SKIPPED`."""
    if not skipped:
        return
    print(f"dlcachefs warmup: {len(skipped):,} paths of {order_file} skipped (the rest is "
          f"warmed):", file=out)
    for _p, why in skipped[:SHOW_SKIPPED]:
        print(f"  {why}", file=out)  # it names the path
    if len(skipped) > SHOW_SKIPPED:
        print(f"  ... and {len(skipped) - SHOW_SKIPPED:,} more", file=out)


def main(mnt: str, paths: list[str], order_file: str | None, dry_run: bool, jobs: int,
         as_json: bool = False, wait: bool = True) -> int:
    """The ``dlcachefs warmup`` command; its exit status."""
    mnt = os.path.abspath(mnt)
    st = dlcachedir.stats(mnt)  # NotAMount (a ValueError) when it is not a mount
    if jobs < 1:
        raise ValueError("--jobs must be >= 1")
    order = read_order(order_file) if order_file else None
    skipped: list[tuple[str, str]] = []
    files = collect(mnt, paths, order, skipped)
    check = CachedCheck(mnt)
    try:
        plan = make_plan(files, st, check, check.known)
        plan.skipped = skipped
        if order_file and not as_json:
            print_skipped(order_file, skipped)
        if check.why:
            print(f"dlcachefs warmup: cannot read the cache index ({check.why}); cached "
                  "files are not skipped", file=sys.stderr)
        if dry_run:
            if as_json:
                print(json.dumps({"plan": plan.as_dict()}, indent=2))
            else:
                print_plan(mnt, plan)
            return 1 if skipped else 0
        res = warm(mnt, plan.to_fetch, jobs, progress=not as_json)
        if wait and not res.interrupted and check.known and wait_settled(mnt):
            fits = plan.to_fetch + plan.cached
            res.cached_after = sum(1 for it in fits if check(it.rel, fresh=False))
    finally:
        check.close()
    if as_json:
        print(json.dumps({"plan": plan.as_dict(), "result": res.as_dict()}, indent=2))
    else:
        rate = f", {format_size(res.fetched_bytes / res.seconds)}/s" if res.seconds > 0 else ""
        print(f"warmup: fetched {res.fetched:,} files ({format_size(res.fetched_bytes)}) in "
              f"{res.seconds:.1f} s{rate}; skipped {len(plan.cached):,} cached, "
              f"{len(plan.left_out):,} past the budget, {len(plan.too_large):,} too large; "
              f"{len(res.errors)} errors"
              + (f", {len(skipped):,} --order paths skipped" if skipped else "")
              + (f"; cached now: {res.cached_after:,} of "
                 f"{len(plan.to_fetch) + len(plan.cached):,}"
                 if res.cached_after is not None else "")
              + ("; interrupted (run it again to resume)" if res.interrupted else ""))
        for rel, err in res.errors[:20]:
            print(f"  {rel}: {err}", file=sys.stderr)
    if res.interrupted:
        return 130
    return 1 if res.errors or skipped else 0
