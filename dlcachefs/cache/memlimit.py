"""Container awareness: the daemon's memory cgroup limit, and what ``--memory`` becomes under it.

At start the engine asks :func:`cgroup_limit` for the limit of the memory cgroup it runs in
(cgroup v2: the smaller of ``memory.max`` and ``memory.high`` of the path in
``/proc/self/cgroup``; cgroup v1: ``memory.limit_in_bytes`` of the memory controller's path),
and :func:`fit` sizes what the daemon holds in memory to stay well inside that limit minus
what it already uses (its RSS at that moment): the memory tier (``--memory``), the read-ahead
buffer (a quarter of it), planned reads (half of it, taken from the tier) and the fetch
backlog (:data:`dlcachefs.cache.buffers.LATER_CHUNKS` chunks). Without a limit, or with a
limit far above what ``--memory`` asks, nothing changes.

Why half of the headroom only: Python's allocator, FUSE request buffers, thread stacks,
LMDB's dirty pages and the page cache charged to the group (v1 charges it) take their share,
and none of them is bounded by ``--memory``. The sampler replay worker, a child process that
imports torch (~500 MB), is charged to the same group: with less headroom than
:data:`REPLAY_WORKER_BYTES` it is not started (announced orders are not replayed; reads
are served as without an announcement) rather than be OOM-killed. A limit set after the start (a process moved into
a group later) is not seen: the daemon reads it once, as a JVM does.

Pure functions and file reads; called once from the engine's constructor (no concurrency).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: share of (limit - RSS at start) that the sized buffers may take together
HEADROOM_SHARE = 0.5
#: cgroup "no limit" values are huge (v1: PAGE_COUNTER_MAX pages); above this it is no limit
_NO_LIMIT = 1 << 60
#: what the sampler replay worker (a process importing torch) is charged, roughly: below this
#: much headroom it is not started (dlcachefs.clairvoyance.replayworker), it would be OOM-killed
REPLAY_WORKER_BYTES = 640 << 20


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text in ("", "max"):
        return None
    try:
        v = int(text)
    except ValueError:
        return None
    return v if 0 < v < _NO_LIMIT else None


def cgroup_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> int | None:
    """The memory limit in bytes of this process's cgroup (v2, else v1), or None."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    limits: list[int] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        path = path.lstrip("/")
        if controllers == "":  # v2 unified hierarchy
            base = os.path.join(root, path)
            for name in ("memory.max", "memory.high"):
                v = _read_int(os.path.join(base, name))
                if v is not None:
                    limits.append(v)
        elif "memory" in controllers.split(","):  # v1 memory controller
            for mount in (os.path.join(root, "memory"), os.path.join(root, controllers)):
                v = _read_int(os.path.join(mount, path, "memory.limit_in_bytes"))
                if v is not None:
                    limits.append(v)
                    break
    return min(limits) if limits else None


def current_rss() -> int:
    """This process's resident set size in bytes (0 when unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """What the engine sizes its buffers from."""

    memory: int  # the memory tier's limit (--memory, or less under a cgroup limit)
    backlog: int  # bytes fetched files may wait for the writer's room
    readahead: int  # bytes read ahead of opens
    cgroup_limit: int | None  # the limit found, None: none
    rss_at_start: int
    reason: str  # empty when --memory was taken as given
    replay_worker: bool = True  # room for the sampler replay worker (torch) in the group

    @property
    def replay_reason(self) -> str:
        return "" if self.replay_worker else (
            f"memory cgroup limit {self.cgroup_limit >> 20} MiB leaves "  # type: ignore[operator]
            f"{(self.cgroup_limit - self.rss_at_start) >> 20} MiB, less than the "  # type: ignore[operator]
            f"~{REPLAY_WORKER_BYTES >> 20} MiB the sampler replay worker (torch) needs: "
            "announced samplers are not replayed")


def fit(memory: int, chunk_size: int, backlog: int, limit: int | None, rss: int) -> MemoryBudget:
    """Size the tier (``--memory``), the read-ahead buffer and the backlog to fit
    ``HEADROOM_SHARE`` of ``limit - rss``. Without a limit: the tier as asked, read-ahead a
    quarter of it (at least a chunk), the backlog as asked. Under a limit too small for that:
    the backlog and read-ahead get a quarter of the budget each at most, the tier what is left.
    Never below zero: a tier of 0 holds nothing, reads go to the logs."""
    readahead = max(memory // 4, chunk_size)
    if limit is None:
        return MemoryBudget(memory, backlog, readahead, None, rss, "")
    budget = max(int((limit - rss) * HEADROOM_SHARE), 0)
    replay = limit - rss >= REPLAY_WORKER_BYTES
    if memory + readahead + backlog <= budget:
        return MemoryBudget(memory, backlog, readahead, limit, rss, "", replay)
    new_backlog = min(backlog, budget // 4)
    new_memory = min(memory, max((budget - new_backlog) * 4 // 5, 0))
    new_readahead = min(readahead, max(new_memory // 4, budget // 4))
    new_memory = min(new_memory, max(budget - new_backlog - new_readahead, 0))
    reason = (f"memory cgroup limit {limit >> 20} MiB, {rss >> 20} MiB resident at start: "
              f"buffers sized to {budget >> 20} MiB ({HEADROOM_SHARE:.0%} of the headroom): "
              f"memory tier (--memory) {memory >> 20} -> {new_memory >> 20} MiB, read-ahead "
              f"{readahead >> 20} -> {new_readahead >> 20} MiB, fetch backlog "
              f"{backlog >> 20} -> {new_backlog >> 20} MiB")
    return MemoryBudget(new_memory, new_backlog, new_readahead, limit, rss, reason, replay)
