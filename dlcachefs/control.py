"""The control protocol: what training code writes into ``<mount>/.dlcache/control``.

Short UTF-8 text lines; one ``write()`` may carry several and is applied whole or refused
whole (the FUSE layer answers EINVAL and the reason goes to ``.dlcache/errors``). Blank
lines and ``#`` comments are ignored. Accepted so far::

    job NAME          # names the writing process's job (default: "default"); A-Z a-z 0-9 . _ -
    dataset RELPATH   # the dataset root of that job: a directory inside the mount, e.g. train

A write is attributed to a job: the one its own ``job`` line names, else the job this
process named last, else ``default``. State is bounded: at most ``MAX_JOBS`` jobs and
``MAX_WRITE`` bytes per write; the error log keeps the last ``MAX_ERRORS`` refusals.

Runs on the trio loop (pure parsing plus dictionary updates); no I/O.
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import ControlError, DlcError

MAX_WRITE = 64 * 1024
MAX_LINE = 4096
MAX_JOBS = 64
MAX_PIDS = 4096
MAX_ERRORS = 100

_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
COMMANDS = ("job", "dataset")


@dataclass
class JobState:
    name: str
    dataset: str | None = None
    dataset_ino: int | None = None
    updated: float = field(default_factory=time.time)


@dataclass(frozen=True)
class _Op:
    verb: str
    arg: str
    dataset_ino: int | None = None


class ControlState:
    """Accepted control state of all jobs, and the log of refused writes.

    ``resolve_dir(relpath) -> ino`` maps a dataset path to a directory of the mirror; it
    raises a :class:`DlcError` when there is no such directory.
    """

    def __init__(self, resolve_dir: Callable[[str], int]) -> None:
        self._resolve_dir = resolve_dir
        self.jobs: dict[str, JobState] = {}
        self._pid_job: OrderedDict[int, str] = OrderedDict()
        self.errors: deque[str] = deque(maxlen=MAX_ERRORS)
        self.accepted_writes = 0
        self.refused_writes = 0

    def job_of(self, pid: int) -> str:
        return self._pid_job.get(pid, "default")

    def apply(self, data: bytes, pid: int) -> int:
        """Apply one write from process ``pid``; returns its length or raises ControlError."""
        try:
            ops = self._parse(data)
            job = self.job_of(pid)
            new_jobs = {op.arg for op in ops if op.verb == "job"} - set(self.jobs)
            new_jobs.discard("default")
            if len(self.jobs) + len(new_jobs) > MAX_JOBS:
                raise ControlError(f"too many jobs (at most {MAX_JOBS} per mount)")
        except ControlError as e:
            self._refuse(pid, str(e))
            raise
        for op in ops:  # validated: applying cannot fail half way
            if op.verb == "job":
                job = op.arg
                self._pid_job[pid] = job
                self._pid_job.move_to_end(pid)
                while len(self._pid_job) > MAX_PIDS:
                    self._pid_job.popitem(last=False)
            st = self.jobs.setdefault(job, JobState(job))
            st.updated = time.time()
            if op.verb == "dataset":
                st.dataset, st.dataset_ino = op.arg, op.dataset_ino
        self.accepted_writes += 1
        return len(data)

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
            ops.append(self._parse_line(n, line))
        if not ops:
            raise ControlError("empty write: no command")
        return ops

    def _parse_line(self, n: int, line: str) -> _Op:
        verb, _, rest = line.partition(" ")
        args = rest.split()
        if verb not in COMMANDS:
            raise ControlError(f"line {n}: unknown command {verb[:40]!r} (known: {', '.join(COMMANDS)})")
        if len(args) != 1:
            raise ControlError(f"line {n}: '{verb}' takes exactly one argument, got {len(args)}")
        arg = args[0]
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
        return _Op("dataset", rel, ino)

    def _refuse(self, pid: int, reason: str) -> None:
        self.refused_writes += 1
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.errors.append(f"{stamp} pid={pid} refused: {reason}")

    def errors_text(self) -> bytes:
        return ("\n".join(self.errors) + ("\n" if self.errors else "")).encode()

    def state_text(self) -> bytes:
        jobs = {name: {"dataset": j.dataset} for name, j in sorted(self.jobs.items())}
        return (json.dumps({"jobs": jobs, "accepted_writes": self.accepted_writes,
                            "refused_writes": self.refused_writes}, indent=2) + "\n").encode()
