"""``dlcachefs advise MNT``: how many DataLoader workers each stream should use.

DLCache (../shared/papers/002_*, section III-E) tunes ``num_workers`` online with its
Algorithm 2, "Tune the num_workers Knob". Its inputs: the current number of workers ω,
the average time to fetch one batch t_fetch (I/O and processing), the average interval
between consecutive training iterations t_req, the machine's cores, and the memory upper
bound mem_up. Its lines, as :func:`algorithm2` implements them:

    2   ω' = min(ceil(t_fetch / t_req), num_cores)
    3   mem_worker = mem_total / ω                 (average memory per worker)
    4-5 if mem_worker * ω' > mem_up: ω' = floor(mem_up / mem_worker)
    7   Δ = ω' - ω
    8-11 spawn Δ workers (Δ > 0) or pause -Δ (Δ < 0); prime new ones with prefetch_factor
    12  at most ω' * prefetch_factor batches outstanding

Lines 1 and 8-11 act on a running DataLoader, which the mount cannot do: it advises, the
training applies it at its next start (``DataLoader(num_workers=ω')``).

Where the inputs come from (:func:`measure`, from the stream's ``loader`` entry in
``.dlcache/stats``, :mod:`dlcachefs.clairvoyance.pace`):

* ω, the batch size B and prefetch_factor: the ``batch B workers=K prefetch_factor=F`` hint
  the torch hook sends with each epoch (``dlcachefs run``);
* t_fetch = B * t_sample, t_sample the mean time between two consecutive opens of one
  worker within a batch (a sample's open, read, decode and transform);
* t_req: measured in the training when it runs under the torch hook (``dlcachefs run``):
  its ``pace`` reports give the seconds between a ``next()`` of the loader returning and
  the next call (the training's step) per batch, as DLCache's own DataLoader measures
  it. Otherwise from the opens: a worker's full cycle over one batch is t_cycle = (B - 1) * t_sample + g, g the
  mean gap across its batch boundaries (which holds any wait for the next index); with ω
  workers taking batches in turn the training asks for one every t_req = t_cycle / ω.
  The workers are busy t_fetch / t_cycle of the time. When they are busy (>= 90%), the
  training waits for data and its own interval is shorter than what the mount sees: t_req
  is then an upper bound, ω' a lower bound, and the advice is at least ω + 1 (within the
  CPU and memory caps); apply it and ask again. With ``num_workers=0`` the main process
  loads: g is then one sample's processing plus the training step, so t_req = g - t_sample.
* mem_total: the proportional set size (PSS: shared pages split between their users) of
  the stream's worker processes still running; mem_up: ``--mem-limit``, else mem_total
  plus half of the memory available now. num_cores: ``--cores``, else the cores this
  process may run on.

Standard library only (reads ``/proc``); no trio.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass, field

from dlcachefs.admin import dlcachedir
from dlcachefs.units import format_size

#: busy share of the workers above which the loader, not the training, sets the pace
BUSY = 0.9
#: in-batch gaps needed before an epoch's numbers are used
MIN_GAPS = 8


@dataclass(frozen=True)
class Decision:
    """Algorithm 2's result: ω' and Δ, the uncapped ceil(t_fetch / t_req), and what capped
    it (``cores``, ``memory``, or None)."""

    workers: int
    delta: int
    wanted: int
    capped_by: str | None
    outstanding: int | None  # line 12: at most ω' * prefetch_factor batches


def algorithm2(omega: int, t_fetch: float, t_req: float, num_cores: int,
               mem_total: float | None = None, mem_up: float | None = None,
               prefetch_factor: int | None = None) -> Decision:
    """DLCache's Algorithm 2 on numbers (see the module doc for its lines).
    ``mem_total``: memory the ω current workers use together (None: not measured, lines
    3-5 are skipped)."""
    if t_fetch < 0 or t_req <= 0 or num_cores < 1:
        raise ValueError("t_fetch >= 0, t_req > 0 and num_cores >= 1 are needed")
    wanted = math.ceil(t_fetch / t_req)                      # line 2
    w, capped = wanted, None
    if w > num_cores:
        w, capped = num_cores, "cores"
    if mem_total is not None and mem_up is not None and omega > 0:
        mem_worker = mem_total / omega                       # line 3
        if mem_worker > 0 and mem_worker * w > mem_up:        # line 4
            w, capped = math.floor(mem_up / mem_worker), "memory"  # line 5
    return Decision(w, w - omega, wanted, capped,             # line 7
                    w * prefetch_factor if prefetch_factor is not None else None)  # line 12


@dataclass
class Advice:
    """The advice for one stream, with every measurement behind it."""

    stream: str
    recommended: int | None = None
    current: int | None = None
    bound: str | None = None        # "lower" when the training's own pace is not visible
    batch: int | None = None
    prefetch_factor: int | None = None
    epoch: int | None = None
    opens: int = 0
    workers_seen: int = 0
    t_sample: float | None = None
    t_fetch: float | None = None
    t_req: float | None = None
    t_cycle: float | None = None
    busy: float | None = None
    t_req_from: str = "workers"     # "training": the hook's pace report; "workers": the opens
    stall: float | None = None      # share of the training's time spent waiting for data
    cores: int | None = None
    mem_total: int | None = None
    mem_up: int | None = None
    decision: dict | None = None
    why: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _cgroup_dirs(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
                 ) -> list[tuple[str, str]]:
    """(controllers, directory) of this process's cgroups: ``""`` for the v2 hierarchy,
    ``"cpu,cpuacct"``, ``"memory"``... for v1."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            _, controllers, path = parts
            path = path.lstrip("/")
            if controllers == "":
                out.append(("", os.path.join(root, path)))
            else:
                for c in controllers.split(","):
                    out.append((c, os.path.join(root, controllers, path)))
    return out


def _ints(path: str) -> list[int] | None:
    try:
        with open(path) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return None  # (also "max": no limit)


def cgroup_cpus(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup"
                ) -> float | None:
    """CPUs this process's cgroup may use (its quota over its period: ``cpu.max``, v1
    ``cpu.cfs_quota_us``), None without a quota. A container's share of a large host is
    this, not the affinity."""
    for kind, d in _cgroup_dirs(proc_cgroup, root):
        if kind == "":
            q = _ints(os.path.join(d, "cpu.max"))
        elif kind == "cpu":
            quota = _ints(os.path.join(d, "cpu.cfs_quota_us"))
            period = _ints(os.path.join(d, "cpu.cfs_period_us"))
            q = quota + period if quota and period else None
        else:
            continue
        if q and len(q) == 2 and q[0] > 0 and q[1] > 0:
            return q[0] / q[1]
    return None


def cgroup_memory_room(proc_cgroup: str = "/proc/self/cgroup",
                       root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes this process's cgroup may still use (its limit minus its usage), None
    without a limit."""
    for kind, d in _cgroup_dirs(proc_cgroup, root):
        names = {"": ("memory.max", "memory.current"),
                 "memory": ("memory.limit_in_bytes", "memory.usage_in_bytes")}.get(kind)
        if names is None:
            continue
        limit, used = (_ints(os.path.join(d, n)) for n in names)
        if limit and used and 0 < limit[0] < 1 << 60:  # (v1 says "no limit" with a huge one)
            return max(0, limit[0] - used[0])
    return None


def local_ranks() -> int:
    """Training processes of this job on this machine (``LOCAL_WORLD_SIZE``, which
    torchrun sets; 1 without it): they share its cores and memory."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def rank_cores() -> int:
    """The cores one training process may give its loader workers: the usable ones (the
    affinity, at most the cgroup's quota), shared by the job's ranks on this machine."""
    n = usable_cores()
    q = cgroup_cpus()
    if q is not None:
        n = min(n, max(1, math.ceil(q)))
    return max(1, n // local_ranks())


def rank_memory_available() -> int | None:
    """Memory one training process may count on: ``MemAvailable``, at most what the
    cgroup still allows, shared by the job's ranks on this machine."""
    avail = mem_available()
    room = cgroup_memory_room()
    if room is not None:
        avail = room if avail is None else min(avail, room)
    return None if avail is None else avail // local_ranks()


def pss_bytes(pid: int) -> int | None:
    """A process's proportional set size (``/proc/PID/smaps_rollup``), None if gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _epoch_of(loader: dict) -> dict | None:
    """The current epoch's measurements when there are enough, else the last complete
    epoch's."""
    for key in ("current", "previous"):
        m = loader.get(key)
        if m and m.get("in_batch_gaps", 0) >= MIN_GAPS and m.get("sample_fetch_s"):
            return m
    return None


def measure(name: str, s: dict, cores: int, mem_limit: int | None = None,
            pss=pss_bytes, available=mem_available) -> Advice:
    """Algorithm 2's inputs from a stream's stats entry, and its decision."""
    a = Advice(name, cores=cores)
    loader = s.get("loader") or {}
    a.batch, a.prefetch_factor = loader.get("batch"), loader.get("prefetch_factor")
    a.current = loader.get("workers")
    if not a.batch:
        a.why.append("no batch hint: run the training under `dlcachefs run` (its torch hook "
                     "sends `batch B workers=K prefetch_factor=F` with each epoch)")
        return a
    m = _epoch_of(loader)
    if m is None:
        a.why.append(f"not enough opens measured yet (need {MIN_GAPS} in-batch gaps of a "
                     "worker); ask again after some batches")
        return a
    a.epoch, a.opens, a.workers_seen = m.get("epoch"), m["opens"], m["workers_seen"]
    omega = a.current if a.current is not None else a.workers_seen
    a.current = omega
    b = a.batch
    a.t_sample = m["sample_fetch_s"]
    a.t_fetch = b * a.t_sample
    gap = m.get("between_batches_s")
    tr = loader.get("training")
    if gap is None and not (tr and tr.get("steps")):
        a.why.append("no batch boundary measured yet; ask again after more batches")
        return a
    if gap is not None and omega > 0:
        a.t_cycle = (b - 1) * a.t_sample + gap
        a.busy = a.t_fetch / a.t_cycle if a.t_cycle > 0 else 1.0
    if tr and tr.get("steps"):
        # the training's own measurement (the torch hook's pace line): DLCache's t_req
        a.t_req = tr["train_s"] / tr["steps"]
        if a.t_req <= 0:
            a.t_req = a.t_sample / 100
        total = tr["wait_s"] + tr["train_s"]
        a.stall = tr["wait_s"] / total if total > 0 else 0.0
        a.t_req_from = "training"
    elif omega == 0:
        a.t_req = gap - a.t_sample
        if a.t_req <= 0:
            a.t_req = a.t_sample / 100  # the training step is lost in the measurement
        a.why.append("num_workers=0: the main process loads; t_req = the gap between its "
                     "batches minus one sample's processing")
    else:
        assert a.t_cycle is not None
        workers = max(1, min(a.workers_seen, omega)) if a.workers_seen else omega
        a.t_req = a.t_cycle / workers
    pids = [p for p in m.get("worker_pids", []) if p]
    sizes = [x for x in (pss(p) for p in pids) if x]
    if omega > 0 and sizes and len(sizes) >= min(omega, len(pids)):
        a.mem_total = int(sum(sizes) / len(sizes) * omega)
        avail = available()
        a.mem_up = mem_limit if mem_limit is not None else (
            a.mem_total + avail // 2 if avail is not None else None)
    elif mem_limit is not None:
        a.mem_up = mem_limit
    d = algorithm2(omega, a.t_fetch, a.t_req, cores, a.mem_total, a.mem_up,
                   a.prefetch_factor)
    a.decision = asdict(d)
    a.recommended = d.workers
    if a.t_req_from == "workers" and a.busy is not None and a.busy >= BUSY:
        a.bound = "lower"
        # at least one more worker, under the same caps as line 2 and lines 4-5
        more = algorithm2(omega, omega + 1, 1.0, cores, a.mem_total, a.mem_up,
                          a.prefetch_factor)
        a.recommended = max(d.workers, more.workers)
        a.why.append(f"the workers are busy {100 * a.busy:.0f}% of the time: the training "
                     "waits for data, and its own interval is shorter than the measured "
                     "t_req (an upper bound): at least one more worker; apply it and ask "
                     "again")
    return a


def advise(st: dict, cores: int | None = None, mem_limit: int | None = None) -> list[Advice]:
    """The advice for every announced stream of a stats document."""
    cores = cores or usable_cores()
    return [measure(name, s, cores, mem_limit)
            for name, s in sorted((st.get("streams") or {}).items())
            if isinstance(s, dict) and "loader" in s]


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f} ms"


def text(a: Advice) -> str:
    """The advice as readable lines: the number and the measurements behind it."""
    head = (f"stream {a.stream}: " + (f"num_workers={a.recommended}" if a.recommended
                                       is not None else "no advice yet"))
    if a.recommended is not None and a.current is not None:
        head += f" (now {a.current}" + (", at least" if a.bound == "lower" else "") + ")"
    lines = [head]
    if a.t_fetch is not None:
        lines.append(f"  measured: epoch {a.epoch}, {a.opens:,} opens by {a.workers_seen} "
                     f"worker processes; batch {a.batch}, prefetch_factor {a.prefetch_factor}")
        lines.append(f"  t_fetch = {a.batch} x {_ms(a.t_sample)} = {_ms(a.t_fetch)} per batch "
                     "(open, read and processing of a sample in a worker)")
    if a.t_req is not None:
        extra = f"; workers busy {100 * a.busy:.0f}%" if a.busy is not None else ""
        if a.t_req_from == "training":
            extra += (f"; measured in the training: its step between batches, waiting "
                      f"{100 * (a.stall or 0):.0f}% of its time for data")
        lines.append(f"  t_req   = {_ms(a.t_req)} between batches the training takes"
                     + (" (at most)" if a.bound == "lower" else "") + extra)
    if a.decision is not None:
        d = a.decision
        lines.append(f"  Algorithm 2: min(ceil(t_fetch / t_req) = {d['wanted']}, cores "
                     f"{a.cores}) -> {min(d['wanted'], a.cores or d['wanted'])}"
                     + (f"; memory: {format_size(a.mem_total / max(a.current or 1, 1))} per "
                        f"worker, limit {format_size(a.mem_up)}" if a.mem_total and a.mem_up
                        else "; memory: not measured (no worker process running)")
                     + (f"; capped by {d['capped_by']}" if d["capped_by"] else ""))
        out = (f"; at most {d['outstanding']} batches outstanding"
               if d["outstanding"] is not None else "")
        lines.append(f"  delta = {a.recommended - (a.current or 0):+d}{out}")
    lines += [f"  note: {w}" for w in a.why]
    return "\n".join(lines)


def main(mnt: str, cores: int | None, mem_limit: int | None, as_json: bool) -> int:
    """The ``dlcachefs advise`` command."""
    st = dlcachedir.stats(os.path.abspath(mnt))
    out = advise(st, cores, mem_limit)
    if as_json:
        print(json.dumps([a.as_dict() for a in out], indent=2))
        return 0
    if not out:
        print("no announced stream: run the training under `dlcachefs run` (or call "
              "dlcachefs.torch.install()) so the mount knows its loader", file=sys.stderr)
        return 1
    print("\n".join(text(a) for a in out))
    return 0
