"""The control protocol: what training code writes into ``<mount>/.dlcache/control``.

Short UTF-8 text lines; one ``write()`` may carry several and is applied whole or refused
whole (the FUSE layer answers EINVAL and the reason goes to ``.dlcache/errors``). Blank
lines and ``#`` comments are ignored. The lines::

    job NAME                 # the writing process's job (default "default"); A-Z a-z 0-9 . _ -
    dataset RELPATH          # the job's ImageFolder root, a directory inside the mount
    sampler random seed=S [num_samples=N] [replacement=false] [per_epoch=false]
                          [loader_draws=none|each|first]
    sampler distributed seed=S world=W rank=R [shuffle=true] [drop_last=false]
    sampler sequential
    batch B [workers=K] [prefetch_factor=F]     # hints
    epoch E                  # the epoch this process starts now (0-based)

See :mod:`dlcachefs.sampler` for what the sampler fields mean. Each (job, rank) is one
stream: a ``distributed`` sampler line binds the writing process to its rank, other
samplers to rank 0. A write is attributed to a job: the one its own ``job`` line names,
else the job this process named last, else ``default``; and to the rank this process
was bound to last. Reads are attributed to streams by process (the writer and its
descendants, such as DataLoader workers): see :mod:`dlcachefs.streams`.

State is bounded: at most ``MAX_JOBS`` jobs, ``MAX_STREAMS`` streams and ``MAX_WRITE``
bytes per write; the error log keeps the last ``MAX_ERRORS`` refusals. Runs on the trio
loop (parsing plus dictionary updates); no I/O.
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from .errors import ControlError, DlcError
from .sampler import SamplerSpec

MAX_WRITE = 64 * 1024
MAX_LINE = 4096
MAX_JOBS = 64
MAX_STREAMS = 1024
MAX_PIDS = 4096
MAX_ERRORS = 100
MAX_EPOCH = 1 << 40

_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_INT_RE = re.compile(r"^-?\d{1,20}$")
COMMANDS = ("job", "dataset", "sampler", "batch", "epoch")

_SAMPLER_KEYS = {
    "random": {"seed", "num_samples", "replacement", "per_epoch", "loader_draws"},
    "distributed": {"seed", "world", "rank", "shuffle", "drop_last"},
    "sequential": set(),
}
_REQUIRED = {"random": {"seed"}, "distributed": {"world", "rank"}, "sequential": set()}


@dataclass
class StreamState:
    """What one (job, rank) announced."""

    job: str
    rank: int
    sampler: SamplerSpec | None = None
    epoch: int | None = None
    batch: int | None = None
    workers: int | None = None
    prefetch_factor: int | None = None
    updated: float = field(default_factory=time.time)


@dataclass
class JobState:
    name: str
    dataset: str | None = None
    dataset_ino: int | None = None
    updated: float = field(default_factory=time.time)


@dataclass(frozen=True)
class _Op:
    verb: str
    arg: object
    extra: tuple = ()


def _int(n: int, key: str, text: str, lo: int | None = None, hi: int | None = None) -> int:
    if not _INT_RE.match(text):
        raise ControlError(f"line {n}: {key} must be an integer, got {text[:40]!r}")
    v = int(text)
    if lo is not None and v < lo:
        raise ControlError(f"line {n}: {key} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ControlError(f"line {n}: {key} must be <= {hi}, got {v}")
    return v


def _bool(n: int, key: str, text: str) -> bool:
    low = text.lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise ControlError(f"line {n}: {key} must be true or false, got {text[:40]!r}")


def _kv(n: int, args: list[str], allowed: set[str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for a in args:
        key, eq, val = a.partition("=")
        if not eq or not key or not val:
            raise ControlError(f"line {n}: expected key=value, got {a[:40]!r}")
        if key not in allowed:
            raise ControlError(f"line {n}: unknown field {key[:40]!r} (allowed: "
                               f"{', '.join(sorted(allowed)) or 'none'})")
        if key in out:
            raise ControlError(f"line {n}: field {key!r} given twice")
        out[key] = val
    return out


class ControlState:
    """Accepted control state of all jobs and streams, and the log of refused writes.

    ``resolve_dir(relpath) -> ino`` maps a dataset path to a directory of the mirror; it
    raises a :class:`DlcError` when there is no such directory. ``on_stream(stream, pid)``
    is called after a write changed a stream (the engine starts or moves its prefetch).
    """

    def __init__(self, resolve_dir: Callable[[str], int],
                 on_stream: Callable[[StreamState, JobState, int], None] | None = None) -> None:
        self._resolve_dir = resolve_dir
        self.on_stream = on_stream
        self.jobs: dict[str, JobState] = {}
        self.streams: dict[tuple[str, int], StreamState] = {}
        self._pid_job: OrderedDict[int, tuple[str, int]] = OrderedDict()
        self.errors: deque[str] = deque(maxlen=MAX_ERRORS)
        self.accepted_writes = 0
        self.refused_writes = 0

    def binding_of(self, pid: int) -> tuple[str, int]:
        """(job, rank) a process writes for; ("default", 0) for one that never said."""
        return self._pid_job.get(pid, ("default", 0))

    def job_of(self, pid: int) -> str:
        return self.binding_of(pid)[0]

    def apply(self, data: bytes, pid: int) -> int:
        """Apply one write from process ``pid``; returns its length or raises ControlError."""
        try:
            ops = self._parse(data)
            self._check_bounds(ops, pid)
        except ControlError as e:
            self._refuse(pid, str(e))
            raise
        job, rank = self.binding_of(pid)
        touched: dict[tuple[str, int], StreamState] = {}
        for op in ops:  # validated: applying cannot fail half way
            if op.verb == "job":
                job, rank = str(op.arg), 0
            elif op.verb == "sampler":
                assert isinstance(op.arg, SamplerSpec)
                rank = op.arg.rank if op.arg.kind == "distributed" else 0
            js = self.jobs.setdefault(job, JobState(job))
            js.updated = time.time()
            if op.verb == "dataset":
                js.dataset, js.dataset_ino = str(op.arg), int(op.extra[0])
                for (j, _r), st in self.streams.items():
                    if j == job:
                        touched[(j, _r)] = st
                continue
            if op.verb == "job":
                continue
            st = self.streams.setdefault((job, rank), StreamState(job, rank))
            st.updated = time.time()
            if op.verb == "sampler":
                st.sampler = op.arg  # type: ignore[assignment]
            elif op.verb == "epoch":
                st.epoch = int(op.arg)  # type: ignore[call-overload]
            elif op.verb == "batch":
                st.batch = int(op.arg)  # type: ignore[call-overload]
                st.workers, st.prefetch_factor = op.extra
            touched[(job, rank)] = st
        self._pid_job[pid] = (job, rank)
        self._pid_job.move_to_end(pid)
        while len(self._pid_job) > MAX_PIDS:
            self._pid_job.popitem(last=False)
        self.accepted_writes += 1
        if self.on_stream is not None:
            for st in touched.values():
                self.on_stream(st, self.jobs[st.job], pid)
        return len(data)

    def _check_bounds(self, ops: list[_Op], pid: int) -> None:
        job, rank = self.binding_of(pid)
        new_jobs, new_streams = set(), set()
        for op in ops:
            if op.verb == "job":
                job, rank = str(op.arg), 0
            elif op.verb == "sampler":
                assert isinstance(op.arg, SamplerSpec)
                rank = op.arg.rank if op.arg.kind == "distributed" else 0
            if job not in self.jobs:
                new_jobs.add(job)
            if op.verb in ("sampler", "epoch", "batch") and (job, rank) not in self.streams:
                new_streams.add((job, rank))
        if len(self.jobs) + len(new_jobs) > MAX_JOBS:
            raise ControlError(f"too many jobs (at most {MAX_JOBS} per mount)")
        if len(self.streams) + len(new_streams) > MAX_STREAMS:
            raise ControlError(f"too many streams (at most {MAX_STREAMS} per mount)")

    def _parse(self, data: bytes) -> list[_Op]:
        if len(data) > MAX_WRITE:
            raise ControlError(f"write of {len(data)} bytes refused: at most {MAX_WRITE} per write")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ControlError(f"not UTF-8 text (byte {e.start})") from None
        ops: list[_Op] = []
        for n, raw in enumerate(text.split("\n"), 1):
            line = raw.rstrip("\r").strip()
            if not line or line.startswith("#"):
                continue
            if len(line) > MAX_LINE:
                raise ControlError(f"line {n}: longer than {MAX_LINE} characters")
            if "\x00" in line:
                raise ControlError(f"line {n}: contains a NUL character")
            ops.append(self._parse_line(n, line))
        if not ops:
            raise ControlError("empty write: no command")
        return ops

    def _parse_line(self, n: int, line: str) -> _Op:
        verb, *args = line.split()
        if verb not in COMMANDS:
            raise ControlError(f"line {n}: unknown command {verb[:40]!r} (known: {', '.join(COMMANDS)})")
        if verb == "sampler":
            return _Op("sampler", self._parse_sampler(n, args))
        if verb == "batch":
            if not args:
                raise ControlError(f"line {n}: 'batch' needs a batch size")
            b = _int(n, "batch size", args[0], 1, 1 << 24)
            kv = _kv(n, args[1:], {"workers", "prefetch_factor"})
            workers = _int(n, "workers", kv["workers"], 0, 4096) if "workers" in kv else None
            pf = _int(n, "prefetch_factor", kv["prefetch_factor"], 0, 4096) \
                if "prefetch_factor" in kv else None
            return _Op("batch", b, (workers, pf))
        if len(args) != 1:
            raise ControlError(f"line {n}: '{verb}' takes exactly one argument, got {len(args)}")
        arg = args[0]
        if verb == "epoch":
            return _Op("epoch", _int(n, "epoch", arg, 0, MAX_EPOCH))
        if verb == "job":
            if not _NAME_RE.match(arg):
                raise ControlError(f"line {n}: bad job name {arg[:80]!r}: use 1-64 of A-Z a-z 0-9 . _ -")
            return _Op("job", arg)
        # dataset
        if arg.startswith("/"):
            raise ControlError(f"line {n}: dataset path must be relative to the mount, got {arg[:80]!r}")
        parts = [p for p in arg.split("/") if p not in ("", ".")]
        if ".." in parts:
            raise ControlError(f"line {n}: dataset path must not contain '..'")
        rel = "/".join(parts)
        try:
            ino = self._resolve_dir(rel)
        except DlcError as e:
            raise ControlError(f"line {n}: dataset {arg[:80]!r} is not a directory in the mount ({e})") from None
        return _Op("dataset", rel, (ino,))

    def _parse_sampler(self, n: int, args: list[str]) -> SamplerSpec:
        if not args:
            raise ControlError(f"line {n}: 'sampler' needs a kind ({', '.join(_SAMPLER_KEYS)})")
        kind = args[0]
        if kind not in _SAMPLER_KEYS:
            raise ControlError(f"line {n}: unknown sampler kind {kind[:40]!r} (known: "
                               f"{', '.join(_SAMPLER_KEYS)})")
        kv = _kv(n, args[1:], _SAMPLER_KEYS[kind])
        missing = _REQUIRED[kind] - set(kv)
        if missing:
            raise ControlError(f"line {n}: sampler {kind} needs {', '.join(sorted(missing))}=")
        spec = SamplerSpec(kind)
        if "seed" in kv:
            spec = replace(spec, seed=_int(n, "seed", kv["seed"], -(1 << 63), (1 << 64) - 1))
        if "num_samples" in kv:
            spec = replace(spec, num_samples=_int(n, "num_samples", kv["num_samples"], 1, 1 << 40))
        for key in ("replacement", "per_epoch", "shuffle", "drop_last"):
            if key in kv:
                spec = replace(spec, **{key: _bool(n, key, kv[key])})
        if "loader_draws" in kv:
            if kv["loader_draws"] not in ("none", "each", "first"):
                raise ControlError(f"line {n}: loader_draws must be none, each or first")
            spec = replace(spec, loader_draws=kv["loader_draws"])
        if kind == "distributed":
            world = _int(n, "world", kv["world"], 1, 1 << 20)
            rank = _int(n, "rank", kv["rank"], 0, world - 1)
            spec = replace(spec, world=world, rank=rank)
        if spec.replacement and spec.num_samples is None:
            pass  # torch: num_samples defaults to len(dataset) also with replacement
        return spec

    def _refuse(self, pid: int, reason: str) -> None:
        self.refused_writes += 1
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.errors.append(f"{stamp} pid={pid} refused: {reason}")

    def errors_text(self) -> bytes:
        return ("\n".join(self.errors) + ("\n" if self.errors else "")).encode()

    def state_text(self) -> bytes:
        jobs = {name: {"dataset": j.dataset} for name, j in sorted(self.jobs.items())}
        streams = {f"{j}/{r}": {"sampler": s.sampler.__dict__ if s.sampler else None,
                                "epoch": s.epoch, "batch": s.batch}
                   for (j, r), s in sorted(self.streams.items())}
        return (json.dumps({"jobs": jobs, "streams": streams,
                            "accepted_writes": self.accepted_writes,
                            "refused_writes": self.refused_writes}, indent=2) + "\n").encode()
