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
    sampler explicit [world=W rank=R]  # the orders come from ``order`` lines
    batch B [workers=K] [prefetch_factor=F]     # hints
    pace iters=N steps=M wait=S train=S [rank=R]  # the training's measured pace
    epoch E                  # the epoch this process starts now (0-based)
    loss I V [I V ...]       # per-sample training losses: dataset index I, finite float V
    order E START I1 I2 ...  # a chunk of epoch E's explicit sample order, from position START
    order E end COUNT        # epoch E's order is complete and has COUNT indices
    index LID START T1 T2 ...  # a chunk of index list LID (tokens: I, or A:B for A..B-1)
    index LID end COUNT      # index list LID is complete (COUNT indices; LID = its digest)
    root VID REL count=N sha=HEX [ext=E1,E2|any] [set=HEX] [sfx=S1,S2]
                             # root K of view VID (in order)
    view VID roots=R [index=LID]   # closes the R ``root`` lines of VID just before it
    dataset RELPATH view=VID # the job's dataset is view VID (RELPATH: its first root)

The limits, the ids and the encoder of every line (what the training process writes) are
in :mod:`dlcachefs.clairvoyance.protocol`; this module parses and applies.

See :mod:`dlcachefs.clairvoyance.replay` for what the sampler fields mean. Each (job, rank) is one
stream: a ``distributed`` sampler line binds the writing process to its rank, as does an
``explicit`` one with ``rank=`` (each rank sending its own orders: DLIO's MPI ranks),
other samplers to rank 0; a ``job`` line binds it to rank 0 of that job, and a ``pace`` line's
``rank=R`` to rank R (the training process repeats its whole binding, ``job`` and
``rank=``, with each pace report, so that report leaves the binding as its announcement
set it). A write is attributed to a job: the one its own ``job`` line names, else the
job this process named last, else ``default``; and to the rank this process was bound
to last. Reads are attributed to streams by process (the writer and its
descendants, such as DataLoader workers): see :mod:`dlcachefs.clairvoyance.streams`.

``loss`` and ``order`` indices are indices into the job's dataset sample list (as
torchvision's ``ImageFolder`` lists it), so the job must have a ``dataset`` (from an
earlier write, or an earlier line of the same write). They are checked against the
dataset's size (``0 <= I < n``) when the ``dataset_size`` callback knows it; when it does
not (yet), they are only checked to be in ``[0, MAX_INDEX)`` and the receiver of
``on_loss`` / ``on_order`` must check them against its sample list. A write may carry at
most ``MAX_LOSS_PAIRS`` loss pairs; the losses of one job must refer to one dataset per
write (a ``dataset`` line that changes the job's dataset after its ``loss`` lines is
refused). Losses are not stored here: they go to ``on_loss`` once the write is applied
(``JobState.losses`` counts them). Losses for a dataset whose size is not known yet are
kept by the receiver until it is, at most ``loss_room()`` pairs: a write with more is
refused, never silently dropped.

``order`` lines give a stream (job, rank) an explicit order for an epoch (an importance
sampler announcing the indices it drew; pair with ``sampler explicit``). The chunks of an
epoch come in sequence: ``START`` must be the number of indices received so far for that
epoch (``0`` restarts it); ``order E end COUNT`` must give that number, and completes the
order: it is stored in ``StreamState.orders[E]`` and passed to ``on_order``. A stream
keeps at most ``MAX_ORDER_EPOCHS`` completed orders and as many in progress (the oldest
is dropped), each at most ``MAX_ORDER_LEN`` indices, and the mount at most
``MAX_ORDER_TOTAL`` indices in all. A ``dataset`` line that changes a job's dataset drops
its streams' orders (their indices named samples of the old one).

Paths (RELPATH, REL) are relative to the mount, percent-encoded (so that any name is one
token: ``a%20b`` is ``a b``; ``%25`` is ``%``), ``.`` for the mount's root, without ``..``.

Views (wrapped datasets, :mod:`dlcachefs.data.wrappers`): the dataset a DataLoader sees is
the concatenation of the sample lists of one or more ImageFolder roots (``root`` lines;
``count``/``sha`` are the training's digest of each root's list, checked by the mount when
it lists the root; ``ext`` the DatasetFolder's extensions, percent-encoded, ``any`` for a
custom ``is_valid_file`` or another reader; ``set`` the digest of the same paths sorted,
which tells a list in another order from a list of other files; ``sfx``, with ``ext=any``,
the suffixes of its files, which the mount keeps; the mount tries torchvision's order and
timm's), optionally seen through an index list (``Subset``: dataset
index ``i`` is base index ``index[i]``). Index lists and views are content-addressed:
``LID`` is the first 24 hex digits of the SHA-256 of the indices as int64 little-endian,
``VID`` that of the view's definition (:func:`dlcachefs.clairvoyance.protocol.view_id`);
both are checked, so a client sends each once per process and mount and names it
afterwards. A ``dataset ... view=VID`` line
naming a view the mount does not hold (a new daemon) is refused: send it again. An index
list is received in chunks like an ``order``; at most ``MAX_LISTS`` complete lists,
``MAX_VIEWS`` views and ``MAX_LIST_TOTAL`` indices are kept (the oldest go first).
``loss``/``order`` indices of a job whose dataset is a view are checked against the
view's length. ``sampler random state=B64`` gives the generator's state (base64 of
``Generator.get_state()``) at this epoch's first draw of the sampler instead of a seed;
``sampler subset_random index=LID state=B64`` is a ``SubsetRandomSampler`` over list
LID; ``sampler unknown [reason=TEXT]`` says the order cannot be replayed (the mount
learns it from the opens). A ``sampler`` line may be up to ``MAX_SAMPLER_LINE``
characters (a generator state is 6.7 KB of base64).

State is bounded: at most ``MAX_JOBS`` jobs (a job idle for ``JOB_IDLE_S`` with none of
its writing processes alive is forgotten to make room for a new one), ``MAX_STREAMS``
streams and ``MAX_WRITE`` bytes per write; the error log keeps the last ``MAX_ERRORS`` refusals. Runs on the trio
loop (parsing plus dictionary updates); no I/O.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
import re
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from urllib.parse import unquote

import numpy as np

from dlcachefs.clairvoyance.protocol import (
    ID_HEX,
    MAX_BATCH,
    MAX_LINE,
    MAX_LOSS_PAIRS,
    MAX_ORDER_LEN,
    MAX_PREFETCH_FACTOR,
    MAX_SAMPLER_LINE,
    MAX_SUFFIXES,
    MAX_WORKERS,
    MAX_WRITE,
    index_list_id,
    view_id,
)
from dlcachefs.clairvoyance.replay import RANKED, SamplerSpec
from dlcachefs.errors import ControlError, DlcError

MAX_JOBS = 64
#: a job makes room for a new one (when MAX_JOBS are held) once it has written nothing
#: for this long and none of the processes that wrote for it is alive
JOB_IDLE_S = 600.0
MAX_STREAMS = 1024
MAX_PIDS = 4096
MAX_ERRORS = 100
MAX_EPOCH = 1 << 40
MAX_INDEX = 1 << 40  # indices are checked against this when the dataset's size is unknown
MAX_ORDER_EPOCHS = 2  # completed orders kept per stream (and as many in progress)
MAX_ORDER_TOTAL = 1 << 28  # order indices held by the mount, completed and in progress
MAX_LISTS = 16  # complete index lists kept (and as many in progress)
MAX_VIEWS = 64
MAX_LIST_TOTAL = 1 << 28  # indices held in index lists, complete and in progress
MAX_ROOTS = 1024  # roots of one view

_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# ASCII only: Python's int() and float() also take other scripts' digits ("٣"), "1_000"
# and surrounding spaces, which no writer means
_INT_RE = re.compile(r"^-?[0-9]{1,20}$")
_FLOAT_RE = re.compile(r"^[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?$")
_NOT_FINITE = frozenset(("nan", "inf", "infinity"))
COMMANDS = ("job", "dataset", "sampler", "batch", "epoch", "loss", "order", "index", "root",
            "view", "pace")
_ID_RE = re.compile(rf"^[0-9a-f]{{{ID_HEX}}}$")
_HEX_RE = re.compile(r"^[0-9a-f]{64}$")
_STATE_RE = re.compile(r"^[A-Za-z0-9+/]{1,12000}={0,2}$")

_SAMPLER_KEYS = {
    "random": {"seed", "num_samples", "replacement", "per_epoch", "loader_draws", "state"},
    "distributed": {"seed", "world", "rank", "shuffle", "drop_last"},
    "sequential": set(),
    "explicit": {"world", "rank"},
    "subset_random": {"index", "state", "per_epoch", "loader_draws"},
    "unknown": {"reason"},
}
_REQUIRED = {"random": set(), "distributed": {"world", "rank"}, "sequential": set(),
             "explicit": set(), "subset_random": {"index", "state"}, "unknown": set()}


@dataclass(frozen=True)
class RootDef:
    """One ImageFolder root of a view, as the training process listed it."""

    rel: str
    ino: int
    count: int
    sha: str
    extensions: tuple[str, ...] | None  # None: any file (a custom is_valid_file)
    set_sha: str | None = None  # the digest of its paths sorted (protocol.set_digest)
    #: with ``extensions`` None: the suffixes of its files (protocol.suffixes_of)
    suffixes: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ViewDef:
    """A dataset as the DataLoader sees it: roots concatenated, optionally indexed."""

    vid: str
    roots: tuple[RootDef, ...]
    lid: str | None = None
    index: array | None = None  # base index of each dataset index (do not modify)

    def __len__(self) -> int:
        return sum(r.count for r in self.roots) if self.index is None else len(self.index)


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
    #: the training's last ``pace`` report: (iters, steps, wait_s, train_s, time.time())
    train_pace: tuple[int, int, float, float, float] | None = None
    #: completed explicit orders (``order`` lines): epoch -> dataset indices, oldest first
    orders: dict[int, array] = field(default_factory=dict)
    #: orders still being received: epoch -> the indices so far, oldest first
    pending_orders: dict[int, array] = field(default_factory=dict)
    #: the index list of a ``subset_random`` sampler (``index=LID``)
    sampler_index: array | None = None
    updated: float = field(default_factory=time.time)


@dataclass
class JobState:
    name: str
    dataset: str | None = None
    dataset_ino: int | None = None
    losses: int = 0  # loss pairs accepted for this job
    view: ViewDef | None = None  # the dataset is a view (``dataset REL view=VID``)
    updated: float = field(default_factory=time.time)


@dataclass(frozen=True)
class _Op:
    verb: str
    arg: object
    extra: tuple = ()
    line: int = 0


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (the daemon's PID namespace is its clients')."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, another user's
    return True


def _int(n: int, key: str, text: str, lo: int | None = None, hi: int | None = None) -> int:
    if not _INT_RE.match(text):
        raise ControlError(f"line {n}: {key} must be an integer, got {text[:40]!r}")
    v = int(text)
    if lo is not None and v < lo:
        raise ControlError(f"line {n}: {key} must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ControlError(f"line {n}: {key} must be <= {hi}, got {v}")
    return v


def _indices(n: int, tokens: list[str]) -> list[int]:
    """Dataset indices: integers in [0, MAX_INDEX); the dataset's size is checked later."""
    out: list[int] = []
    match = _INT_RE.match
    for t in tokens:
        if not match(t):
            raise ControlError(f"line {n}: index must be an integer, got {t[:40]!r}")
        v = int(t)
        if not 0 <= v < MAX_INDEX:
            raise ControlError(f"line {n}: index {v} out of range (0 <= INDEX < {MAX_INDEX})")
        out.append(v)
    return out


def _bool(n: int, key: str, text: str) -> bool:
    low = text.lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no"):
        return False
    raise ControlError(f"line {n}: {key} must be true or false, got {text[:40]!r}")


def _seconds(n: int, key: str, text: str) -> float:
    if not _FLOAT_RE.match(text):
        raise ControlError(f"line {n}: {key} must be a number of seconds, got "
                           f"{text[:40]!r}")
    v = float(text)
    if not math.isfinite(v) or not 0.0 <= v <= 1e9:
        raise ControlError(f"line {n}: {key} must be within 0..1e9 seconds, got {text[:40]!r}")
    return v


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


def _receive(pending: dict, complete: dict, key: Hashable, done_key: Hashable,
             extra: tuple, keep: int) -> tuple[int, array | None]:
    """Applies one ``index`` or ``order`` line (validated by :class:`_ChunkDryRun`) to a
    list received in chunks. ``pending[key]`` holds what came so far: a chunk at 0 starts
    it again (at most ``keep`` lists in progress; the oldest is dropped), ``end`` moves it
    to ``complete[done_key]`` (at most ``keep`` kept, the oldest dropped). Returns the change
    in the number of indices held, and the list it completed (None for a chunk)."""
    delta = 0
    if extra[0] == "chunk":
        start, indices = extra[1], extra[2]
        if start == 0:
            old = pending.pop(key, None)
            if old is not None:
                delta -= len(old)
            while len(pending) >= keep:
                delta -= len(pending.pop(next(iter(pending))))
            pending[key] = array("q")
        pending[key].extend(indices)
        return delta + len(indices), None
    done = pending.pop(key, None)
    if done is None:  # "end 0" with nothing received: an empty list
        done = array("q")
    old = complete.pop(done_key, None)
    if old is not None:
        delta -= len(old)
    complete[done_key] = done
    while len(complete) > keep:
        delta -= len(complete.pop(next(iter(complete))))
    return delta, done


class _ChunkDryRun:
    """Tries ``index`` or ``order`` lines on the lists in progress as :func:`_receive`
    will apply them, and refuses a line it would not accept (for
    :meth:`ControlState._check`: a write is checked whole before any of it is applied).
    Keeps references to the received arrays and to this write's chunks, never copies."""

    def __init__(self, received: dict, keep: int) -> None:
        self.keep = keep
        # oldest first, as _receive drops them
        self.parts: dict[Hashable, list[Sequence[int]]] = {k: [a] for k, a in received.items()}

    def line(self, op: _Op, key: Hashable, what: str) -> list[Sequence[int]] | None:
        """Tries one line on list ``key`` (``what`` names it in messages); returns the
        list's parts when the line completes it."""
        parts = self.parts.get(key, [])
        have = sum(len(x) for x in parts)
        if op.extra[0] == "end":
            if op.extra[1] != have:
                raise ControlError(f"line {op.line}: {what} has {have} indices, 'end' says "
                                   f"{op.extra[1]}")
            self.parts.pop(key, None)
            return parts
        start, indices = op.extra[1], op.extra[2]
        if start == 0:
            self.parts.pop(key, None)
            while len(self.parts) >= self.keep:
                self.parts.pop(next(iter(self.parts)))
            parts, have = [], 0
            self.parts[key] = parts
        elif start != have:
            raise ControlError(f"line {op.line}: {what} continues at {have}, got {start}")
        if have + len(indices) > MAX_ORDER_LEN:
            raise ControlError(f"line {op.line}: {what} longer than {MAX_ORDER_LEN} indices")
        parts.append(indices)
        return None


class ErrorLog:
    """The control file's error log (``.dlcache/errors``): the last :data:`MAX_ERRORS`
    refused writes with their reasons, and input that was accepted but could not be used
    later (noted by the part that found out, e.g. the losses). Shared by the control
    state and those parts; trio loop."""

    def __init__(self) -> None:
        self.lines: deque[str] = deque(maxlen=MAX_ERRORS)

    def __len__(self) -> int:
        return len(self.lines)

    def refused(self, pid: int, reason: str) -> None:
        """A write of process ``pid`` refused, for ``reason``."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.lines.append(f"{stamp} pid={pid} refused: {_one_line(reason)}")

    def note(self, reason: str) -> None:
        """Input that was accepted but could not be used (e.g. loss indices out of range
        once the dataset's size became known)."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.lines.append(f"{stamp} dropped: {_one_line(reason)}")

    def text(self) -> bytes:
        return ("\n".join(self.lines) + ("\n" if self.lines else "")).encode()


class ControlState:
    """Accepted control state of all jobs and streams, and the log of refused writes.

    ``resolve_dir(relpath) -> ino`` maps a dataset path to a directory of the mirror; it
    raises a :class:`DlcError` when there is no such directory. The optional callbacks,
    all called after a write was applied (every state change of the write is visible by
    then), in this order:

    * ``on_order(stream, job, epoch, order, pid)``: for each ``order E end COUNT`` of the
      write, in write order; ``order`` is the ``array('q')`` stored in
      ``stream.orders[epoch]`` (do not modify it).
    * ``on_stream(stream, job, pid)``: for each stream a write changed (the engine starts
      or moves its prefetch). ``order`` lines do not count as a change. ``pid`` is the
      writer's, or None for a stream the write changed that is not the writer's (another
      rank's, when a ``dataset`` line changed its job's dataset): the writer is not its
      process. A ``dataset`` line that repeats the job's dataset changes nothing.
    * ``on_loss(job, indices, values)``: once per job that got ``loss`` pairs in the
      write (``job``: its :class:`JobState`), with all of them in write order
      (``list[int]``, ``list[float]``); an index may repeat: apply them in order, the
      later value wins. The indices refer to the job's current dataset (``job.dataset``).

    ``on_job_dropped(name)`` hears of a job forgotten to make room for a new one (its
    streams go too); ``job_reading(name)`` says whether a job's streams read lately (such
    a job is never forgotten). ``errors``: the error log, shared with the parts that note
    input they could not use (a new one by default).

    ``loss_room() -> int`` says how many loss pairs of datasets whose size is not known
    yet the receiver can still keep until it is (they are never dropped); a write with
    more is refused.

    ``dataset_size(relpath) -> int | None`` gives the number of samples of the dataset at
    ``relpath`` (the path of a ``dataset`` line, normalized), or None when it is not known
    (yet); ``loss`` and ``order`` indices are range-checked against it. It is called on
    the trio loop during :meth:`apply`, at most once per dataset per write: it must be
    cheap (answer None rather than list a directory).
    """

    def __init__(self, resolve_dir: Callable[[str], int],
                 on_stream: Callable[[StreamState, JobState, int | None], None] | None = None,
                 *,
                 dataset_size: Callable[[str], int | None] | None = None,
                 on_loss: Callable[[JobState, list[int], list[float]], None] | None = None,
                 on_order: Callable[[StreamState, JobState, int, Sequence[int], int], None]
                 | None = None,
                 loss_room: Callable[[], int] | None = None,
                 on_job_dropped: Callable[[str], None] | None = None,
                 job_reading: Callable[[str], bool] | None = None,
                 errors: ErrorLog | None = None) -> None:
        self._resolve_dir = resolve_dir
        self.on_stream = on_stream
        self.dataset_size = dataset_size
        self.on_loss = on_loss
        self.on_order = on_order
        self.loss_room = loss_room
        #: a job forgotten to make room for a new one (its streams go too)
        self.on_job_dropped = on_job_dropped
        #: whether a job's streams read lately (a job that did is never forgotten)
        self.job_reading = job_reading
        self._forget_next: list[str] = []  # set by _check, forgotten by apply
        self.jobs: dict[str, JobState] = {}
        self.streams: dict[tuple[str, int], StreamState] = {}
        self._pid_job: OrderedDict[int, tuple[str, int]] = OrderedDict()
        self.errors = errors if errors is not None else ErrorLog()
        self.accepted_writes = 0
        self.refused_writes = 0
        self.order_indices = 0  # held in all streams' orders, completed and in progress
        self.index_lists: OrderedDict[str, array] = OrderedDict()  # complete, oldest first
        self.pending_lists: OrderedDict[str, array] = OrderedDict()  # "PID/LID" -> received
        self.views: OrderedDict[str, ViewDef] = OrderedDict()
        self.list_indices = 0  # held in index lists, complete and in progress

    def binding_of(self, pid: int) -> tuple[str, int]:
        """(job, rank) a process writes for; ("default", 0) for one that never said."""
        return self._pid_job.get(pid, ("default", 0))

    def job_of(self, pid: int) -> str:
        return self.binding_of(pid)[0]

    def apply(self, data: bytes, pid: int) -> int:
        """Apply one write from process ``pid``; returns its length or raises ControlError."""
        try:
            ops = self._parse(data)
            self._check(ops, pid)
        except ControlError as e:
            reason = _one_line(str(e))
            self._refuse(pid, reason)
            if reason != str(e):  # the writer is told the reason the error log shows
                raise ControlError(reason) from None
            raise
        for name in self._forget_next:  # room for this write's new jobs (_check)
            self._forget_job(name)
        self._forget_next = []
        job, rank = self.binding_of(pid)
        # streams this write changed -> whether they are the writer's (a stream restarted
        # because its job's dataset changed is not: another rank's stays that rank's)
        touched: dict[tuple[str, int], tuple[StreamState, bool]] = {}
        completed: list[tuple[StreamState, int, array]] = []
        losses: dict[str, tuple[list[int], list[float]]] = {}
        for op in ops:  # validated: applying cannot fail half way
            if op.verb in ("index", "view"):  # mount-wide, not a job's
                self._apply_list_or_view(op, pid)
                continue
            if op.verb == "job":
                job, rank = str(op.arg), 0
            elif op.verb == "sampler":
                assert isinstance(op.arg, SamplerSpec)
                rank = op.arg.rank if op.arg.kind in RANKED else 0
            elif op.verb == "pace" and op.extra[0] is not None:
                rank = int(op.extra[0])  # its rank binds, as a distributed sampler's does
            js = self.jobs.setdefault(job, JobState(job))
            js.updated = time.time()
            if op.verb == "dataset":
                view = self.views.get(op.extra[1]) if len(op.extra) > 1 else None
                changed = js.dataset != op.arg or js.view != view
                js.dataset, js.dataset_ino = str(op.arg), int(op.extra[0])
                js.view = view
                if changed:  # every stream of the job starts over on the new dataset
                    self._drop_orders(job)
                    for (j, r), st in self.streams.items():
                        if j == job:
                            touched.setdefault((j, r), (st, False))
                continue
            if op.verb == "job":
                continue
            if op.verb == "loss":
                idx, vals = losses.setdefault(job, ([], []))
                idx.extend(op.arg)  # type: ignore[arg-type]
                vals.extend(op.extra[0])
                js.losses += len(op.extra[0])
                continue
            if op.verb == "pace":
                # a measurement of a known stream: stored, never a restart of the stream
                # (no on_stream); a stream not announced yet drops it
                pst = self.streams.get((job, rank))
                if pst is not None:
                    pst.train_pace = (*op.arg, time.time())  # type: ignore[misc]
                continue
            st = self.streams.setdefault((job, rank), StreamState(job, rank))
            st.updated = time.time()
            if op.verb == "order":
                self._apply_order(st, op, completed)
                continue
            if op.verb == "sampler":
                st.sampler = op.arg  # type: ignore[assignment]
                lid = st.sampler.index if st.sampler is not None else None
                st.sampler_index = self.index_lists.get(lid) if lid else None
            elif op.verb == "epoch":
                st.epoch = int(op.arg)  # type: ignore[call-overload]
            elif op.verb == "batch":
                st.batch = int(op.arg)  # type: ignore[call-overload]
                st.workers, st.prefetch_factor = op.extra
            touched[(job, rank)] = (st, True)
        self._pid_job[pid] = (job, rank)
        self._pid_job.move_to_end(pid)
        while len(self._pid_job) > MAX_PIDS:
            self._pid_job.popitem(last=False)
        self.accepted_writes += 1
        if self.on_order is not None:
            for st, epoch, order in completed:
                self.on_order(st, self.jobs[st.job], epoch, order, pid)
        if self.on_stream is not None:
            for st, own in touched.values():
                self.on_stream(st, self.jobs[st.job], pid if own else None)
        if self.on_loss is not None:
            for name, (idx, vals) in losses.items():
                self.on_loss(self.jobs[name], idx, vals)
        return len(data)

    def _apply_list_or_view(self, op: _Op, pid: int) -> None:
        """``index`` chunks and ends, ``view`` definitions (validated by :meth:`_check`).
        A list in transit is the writing process's own (``PID/LID``): two processes (DDP
        ranks of one ``Subset``) may send the same content-addressed list at once."""
        if op.verb == "view":
            vid, roots, lid = str(op.arg), op.extra[0], op.extra[1]
            self.views.pop(vid, None)
            self.views[vid] = ViewDef(vid, roots, lid,
                                      self.index_lists[lid] if lid else None)
            while len(self.views) > MAX_VIEWS:
                self.views.popitem(last=False)
            return
        lid = str(op.arg)
        delta, _ = _receive(self.pending_lists, self.index_lists, f"{pid}/{lid}", lid,
                            op.extra, MAX_LISTS)
        self.list_indices += delta

    def _idle_jobs(self, keep: set[str]) -> list[str]:
        """Jobs (not in ``keep``) that may make room for new ones, idlest first: nothing
        written for JOB_IDLE_S, none of their writing processes alive, and (asked of
        the mount, :attr:`job_reading`) no stream of theirs read lately: a job announced
        by a short-lived writer (``echo > control``) may be read by processes that never
        write. (A long-lived mount serving many named jobs in turn, ``dlcachefs run
        --job``, refused every new name after 64.)"""
        now = time.time()
        bound: dict[str, list[int]] = {}
        for pid, (job, _rank) in self._pid_job.items():
            bound.setdefault(job, []).append(pid)
        idle = sorted((js.updated, name) for name, js in self.jobs.items()
                      if name not in keep and now - js.updated >= JOB_IDLE_S
                      and not any(_alive(pid) for pid in bound.get(name, ()))
                      and not (self.job_reading is not None and self.job_reading(name)))
        return [name for _, name in idle]

    def _forget_job(self, name: str) -> None:
        """Forget job ``name``: its streams, orders and process bindings go, and
        :attr:`on_job_dropped` hears of it."""
        self._drop_orders(name)
        for key in [k for k in self.streams if k[0] == name]:
            del self.streams[key]
        for pid in [p for p, (j, _r) in self._pid_job.items() if j == name]:
            del self._pid_job[pid]
        del self.jobs[name]
        self.note(f"job {name!r} forgotten (idle, its processes gone) to make room for a "
                  f"new one")
        if self.on_job_dropped is not None:
            self.on_job_dropped(name)

    def _drop_orders(self, job: str) -> None:
        for (j, _r), st in self.streams.items():
            if j == job:
                for d in (st.orders, st.pending_orders):
                    self.order_indices -= sum(len(a) for a in d.values())
                    d.clear()

    def _apply_order(self, st: StreamState, op: _Op, completed: list) -> None:
        epoch = int(op.arg)  # type: ignore[call-overload]
        delta, order = _receive(st.pending_orders, st.orders, epoch, epoch, op.extra,
                                MAX_ORDER_EPOCHS)
        self.order_indices += delta
        if order is not None:
            completed.append((st, epoch, order))

    def _check(self, ops: list[_Op], pid: int) -> None:
        """What parsing alone cannot check: bounds, and the lines that depend on the state
        (the job's dataset, where an order continues). Tries the write on copies."""
        job, rank = self.binding_of(pid)
        new_jobs, new_streams = set(), set()
        datasets: dict[str, str | None] = {}  # job -> its dataset at this point
        loss_ds: dict[str, str] = {}  # job -> the dataset its losses of this write refer to
        sizes: dict[str, int | None] = {}
        orders: dict[tuple[str, int], _ChunkDryRun] = {}  # stream -> its orders in progress
        added = 0
        unsized_losses = 0  # loss pairs of datasets whose size is not known yet
        lists = _ListDryRun(self, pid)
        dviews: dict[str, str | None] = {}  # job -> the view of its dataset at this point
        for op in ops:
            if op.verb == "index":
                lists.index(op)
                continue
            if op.verb == "view":
                lists.view(op)
                continue
            if op.verb == "sampler" and isinstance(op.arg, SamplerSpec) and op.arg.index \
                    and not lists.complete(op.arg.index):
                raise ControlError(f"line {op.line}: unknown index list {op.arg.index}: send "
                                   f"its 'index' lines first")
            if op.verb == "job":
                job, rank = str(op.arg), 0
            elif op.verb == "sampler":
                assert isinstance(op.arg, SamplerSpec)
                rank = op.arg.rank if op.arg.kind in RANKED else 0
            elif op.verb == "pace" and op.extra[0] is not None:
                rank = int(op.extra[0])  # as in apply()
            if job not in self.jobs:
                new_jobs.add(job)
            if op.verb in ("sampler", "epoch", "batch", "order") \
                    and (job, rank) not in self.streams:
                new_streams.add((job, rank))
            if job not in datasets:
                datasets[job] = self.jobs[job].dataset if job in self.jobs else None
                v = self.jobs[job].view if job in self.jobs else None
                dviews[job] = v.vid if v is not None else None
            if op.verb == "dataset":
                rel = str(op.arg)
                vid = op.extra[1] if len(op.extra) > 1 else None
                if vid is not None and not lists.has_view(vid):
                    raise ControlError(f"line {op.line}: unknown view {vid}: send its 'root' "
                                       f"and 'view' lines first")
                if (datasets[job], dviews[job]) != (rel, vid):
                    if job in loss_ds:
                        raise ControlError(
                            f"line {op.line}: dataset of job {job!r} changes after its loss "
                            f"lines in the same write; send them in separate writes")
                    for key in [k for k in (*self.streams, *orders) if k[0] == job]:
                        orders[key] = _ChunkDryRun({}, MAX_ORDER_EPOCHS)  # dropped
                datasets[job] = rel
                dviews[job] = vid
            if op.verb not in ("loss", "order"):
                continue
            rel = datasets[job]
            if rel is None:
                raise ControlError(f"line {op.line}: {op.verb} before a dataset: job {job!r} "
                                   f"has no 'dataset' line yet")
            if op.verb == "order" and op.extra[0] == "end":
                self._check_order(op, (job, rank), orders)
                continue
            indices: list[int] = op.arg if op.verb == "loss" else op.extra[2]  # type: ignore[assignment]
            if dviews.get(job) is not None:
                n: int | None = lists.view_len(str(dviews[job]))
            else:
                if rel not in sizes:
                    sizes[rel] = self._size_of(rel)
                n = sizes[rel]
            if n is not None and indices and max(indices) >= n:
                bad = next(i for i in indices if i >= n)
                raise ControlError(f"line {op.line}: index {bad} out of range: dataset "
                                   f"{rel or '.'!r} of job {job!r} has {n} samples "
                                   f"(0 <= INDEX < {n})")
            if op.verb == "loss":
                loss_ds[job] = rel
                if n is None:
                    unsized_losses += len(indices)
            else:
                self._check_order(op, (job, rank), orders)
                added += len(indices)
        over = len(self.jobs) + len(new_jobs) - MAX_JOBS
        self._forget_next = []
        if over > 0:
            idle = self._idle_jobs(keep=set(datasets))
            if len(idle) < over:
                raise ControlError(f"too many jobs (at most {MAX_JOBS} per mount; a job is "
                                   f"forgotten once idle for {JOB_IDLE_S:.0f} s with none "
                                   f"of its processes alive)")
            self._forget_next = idle[:over]  # forgotten by apply(), once all is checked
        if len(self.streams) + len(new_streams) > MAX_STREAMS:
            raise ControlError(f"too many streams (at most {MAX_STREAMS} per mount)")
        if unsized_losses and self.loss_room is not None:
            room = self.loss_room()
            if unsized_losses > room:
                raise ControlError(
                    f"{unsized_losses} losses for a dataset whose sample list is still being "
                    f"made: only {max(room, 0)} more can wait for it; send them again once "
                    f"'stats' shows the stream's epoch")
        if self.list_indices + lists.added > MAX_LIST_TOTAL:
            raise ControlError(f"too many index-list indices held by the mount (at most "
                               f"{MAX_LIST_TOTAL})")
        if self.order_indices + added > MAX_ORDER_TOTAL:
            raise ControlError(f"too many order indices held by the mount (at most "
                               f"{MAX_ORDER_TOTAL}): {self.order_indices} held, "
                               f"{added} in this write")

    def _check_order(self, op: _Op, key: tuple[str, int],
                     orders: dict[tuple[str, int], _ChunkDryRun]) -> None:
        """Tries one ``order`` line on stream ``key``'s orders in progress."""
        if key not in orders:
            st = self.streams.get(key)
            orders[key] = _ChunkDryRun(st.pending_orders if st is not None else {},
                                       MAX_ORDER_EPOCHS)
        orders[key].line(op, op.arg, f"order for epoch {op.arg}")

    def _size_of(self, rel: str) -> int | None:
        if self.dataset_size is None:
            return None
        try:
            n = self.dataset_size(rel)
            return None if n is None else int(n)
        except Exception:  # noqa: BLE001 - a failing lookup is an unknown size, not a refusal
            return None

    def _parse(self, data: bytes) -> list[_Op]:
        if len(data) > MAX_WRITE:
            raise ControlError(f"write of {len(data)} bytes refused: at most {MAX_WRITE} per write")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ControlError(f"not UTF-8 text (byte {e.start})") from None
        ops: list[_Op] = []
        pairs = 0
        for n, raw in enumerate(text.split("\n"), 1):
            line = raw.rstrip("\r").strip()
            if not line or line.startswith("#"):
                continue
            limit = MAX_SAMPLER_LINE if line.startswith("sampler") else MAX_LINE
            if len(line) > limit:
                raise ControlError(f"line {n}: longer than {limit} characters")
            if "\x00" in line:
                raise ControlError(f"line {n}: contains a NUL character")
            op = self._parse_line(n, line)
            if op.verb == "loss":
                pairs += len(op.arg)  # type: ignore[arg-type]
                if pairs > MAX_LOSS_PAIRS:
                    raise ControlError(f"line {n}: more than {MAX_LOSS_PAIRS} loss pairs in "
                                       f"one write")
            ops.append(op if op.line == n else replace(op, line=n))
        ops = _fold_roots(ops)
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
            b = _int(n, "batch size", args[0], 1, MAX_BATCH)
            kv = _kv(n, args[1:], {"workers", "prefetch_factor"})
            workers = _int(n, "workers", kv["workers"], 0, MAX_WORKERS) \
                if "workers" in kv else None
            pf = _int(n, "prefetch_factor", kv["prefetch_factor"], 0, MAX_PREFETCH_FACTOR) \
                if "prefetch_factor" in kv else None
            return _Op("batch", b, (workers, pf))
        if verb == "pace":
            kv = _kv(n, args, {"iters", "steps", "wait", "train", "rank"})
            if not {"iters", "steps", "wait", "train"} <= kv.keys():
                raise ControlError(f"line {n}: 'pace' needs iters=N steps=M wait=S train=S")
            iters = _int(n, "iters", kv["iters"], 1, 1 << 40)
            steps = _int(n, "steps", kv["steps"], 0, 1 << 40)
            prank = _int(n, "rank", kv["rank"], 0, 1 << 20) if "rank" in kv else None
            return _Op("pace", (iters, steps, _seconds(n, "wait", kv["wait"]),
                                _seconds(n, "train", kv["train"])), (prank,))
        if verb == "loss":
            return self._parse_loss(n, args)
        if verb == "order":
            return self._parse_order(n, args)
        if verb == "index":
            return self._parse_index(n, args)
        if verb == "root":
            return self._parse_root(n, args)
        if verb == "view":
            return _parse_view(n, args)
        if verb == "dataset" and len(args) == 2 and args[1].startswith("view="):
            vid = args[1][len("view="):]
            if not _ID_RE.match(vid):
                raise ControlError(f"line {n}: view id must be 24 hex digits, got {vid[:40]!r}")
            rel, ino = self._rel_dir(n, args[0], "dataset")
            return _Op("dataset", rel, (ino, vid))
        if len(args) != 1:
            raise ControlError(f"line {n}: '{verb}' takes exactly one argument, got {len(args)}")
        arg = args[0]
        if verb == "epoch":
            return _Op("epoch", _int(n, "epoch", arg, 0, MAX_EPOCH))
        if verb == "job":
            if not _NAME_RE.match(arg):
                raise ControlError(f"line {n}: bad job name {arg[:80]!r}: use 1-64 of A-Z a-z 0-9 . _ -")
            return _Op("job", arg)
        rel, ino = self._rel_dir(n, arg, "dataset")
        return _Op("dataset", rel, (ino,))

    @staticmethod
    def _parse_loss(n: int, args: list[str]) -> _Op:
        if not args:
            raise ControlError(f"line {n}: 'loss' needs INDEX VALUE pairs")
        if len(args) % 2:
            raise ControlError(f"line {n}: 'loss' expects INDEX VALUE pairs, got {len(args)} "
                               f"tokens")
        indices = _indices(n, args[0::2])
        values: list[float] = []
        isfinite, match = math.isfinite, _FLOAT_RE.match
        for t in args[1::2]:
            if not match(t):
                if t.lower().lstrip("+-") in _NOT_FINITE:
                    raise ControlError(f"line {n}: loss must be a finite number, got "
                                       f"{t[:40]!r}")
                raise ControlError(f"line {n}: loss must be a number, got {t[:40]!r}")
            v = float(t)
            if not isfinite(v):  # 1e400
                raise ControlError(f"line {n}: loss must be a finite number, got {t[:40]!r}")
            values.append(v)
        return _Op("loss", indices, (values,), n)

    @staticmethod
    def _parse_order(n: int, args: list[str]) -> _Op:
        if len(args) < 2:
            raise ControlError(f"line {n}: 'order' needs EPOCH START INDEX... or EPOCH end COUNT")
        epoch = _int(n, "epoch", args[0], 0, MAX_EPOCH)
        if args[1] == "end":
            if len(args) != 3:
                raise ControlError(f"line {n}: 'order EPOCH end' takes exactly one COUNT")
            return _Op("order", epoch, ("end", _int(n, "count", args[2], 0, MAX_ORDER_LEN)), n)
        start = _int(n, "start", args[1], 0, MAX_ORDER_LEN)
        return _Op("order", epoch, ("chunk", start, _indices(n, args[2:])), n)

    @staticmethod
    def _parse_index(n: int, args: list[str]) -> _Op:
        if len(args) < 2 or not _ID_RE.match(args[0]):
            raise ControlError(f"line {n}: 'index' needs LID (24 hex digits) START TOKEN... or "
                               f"LID end COUNT")
        lid = args[0]
        if args[1] == "end":
            if len(args) != 3:
                raise ControlError(f"line {n}: 'index LID end' takes exactly one COUNT")
            return _Op("index", lid, ("end", _int(n, "count", args[2], 0, MAX_ORDER_LEN)), n)
        start = _int(n, "start", args[1], 0, MAX_ORDER_LEN)
        out: list[int] = []
        for t in args[2:]:
            a, colon, b = t.partition(":")
            if not colon:
                out.extend(_indices(n, [t]))
                continue
            lo, hi = _indices(n, [a])[0], _int(n, "range end", b, 0, MAX_INDEX)
            if hi <= lo or hi - lo > MAX_ORDER_LEN - len(out):
                raise ControlError(f"line {n}: bad index range {t[:40]!r} (A:B with A < B)")
            out.extend(range(lo, hi))
        return _Op("index", lid, ("chunk", start, out), n)

    def _parse_root(self, n: int, args: list[str]) -> _Op:
        if len(args) < 2 or not _ID_RE.match(args[0]):
            raise ControlError(f"line {n}: 'root' needs VID (24 hex digits) REL count=N sha=HEX "
                               f"[ext=...]")
        kv = _kv(n, args[2:], {"count", "sha", "ext", "set", "sfx"})
        if "count" not in kv or "sha" not in kv:
            raise ControlError(f"line {n}: 'root' needs count= and sha=")
        count = _int(n, "count", kv["count"], 0, MAX_INDEX)
        if not _HEX_RE.match(kv["sha"]):
            raise ControlError(f"line {n}: sha must be 64 hex digits")
        ext: tuple[str, ...] | None = None
        if kv.get("ext", "any") != "any":
            ext = tuple(unquote(e) for e in kv["ext"].split(","))
            if not all(ext):
                raise ControlError(f"line {n}: empty extension in ext=")
        set_sha = kv.get("set")
        if set_sha is not None and not _HEX_RE.match(set_sha):
            raise ControlError(f"line {n}: set must be 64 hex digits")
        sfx: tuple[str, ...] | None = None
        if "sfx" in kv:
            sfx = tuple(unquote(e) for e in kv["sfx"].split(","))
            if not all(sfx) or len(sfx) > MAX_SUFFIXES:
                raise ControlError(f"line {n}: sfx= needs 1-{MAX_SUFFIXES} non-empty suffixes")
        rel, ino = self._rel_dir(n, args[1], "root")
        return _Op("root", args[0], (RootDef(rel, ino, count, kv["sha"], ext, set_sha, sfx),),
                   n)

    def _rel_dir(self, n: int, token: str, what: str) -> tuple[str, int]:
        """A percent-encoded directory path relative to the mount: (normalized, inode)."""
        raw = unquote(token)
        parts = [p for p in raw.split("/") if p not in ("", ".")]
        if raw.startswith("/") or ".." in parts:
            raise ControlError(f"line {n}: {what} must be relative to the mount, without '..'")
        rel = "/".join(parts)
        try:
            ino = self._resolve_dir(rel)
        except DlcError as e:
            raise ControlError(f"line {n}: {what} {rel[:80]!r} is not a directory in the "
                               f"mount ({e})") from None
        return rel, ino

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
        if kind == "random" and ("seed" in kv) == ("state" in kv):
            raise ControlError(f"line {n}: sampler random needs seed= or state= (one of them)")
        if "state" in kv:
            st = kv["state"]
            try:
                ok = bool(_STATE_RE.match(st)) and len(base64.b64decode(st, validate=True)) > 0
            except (binascii.Error, ValueError):
                ok = False
            if not ok:
                raise ControlError(f"line {n}: state must be a generator state in base64")
            spec = replace(spec, state=st)
        if "index" in kv:
            if not _ID_RE.match(kv["index"]):
                raise ControlError(f"line {n}: index must be a list id (24 hex digits)")
            spec = replace(spec, index=kv["index"])
        if "reason" in kv:
            spec = replace(spec, reason=unquote(kv["reason"])[:300])
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
        if kind == "explicit" and ("world" in kv) != ("rank" in kv):
            raise ControlError(f"line {n}: sampler explicit takes world= and rank= together")
        if kind in RANKED and ("world" in kv or "rank" in kv):
            world = _int(n, "world", kv.get("world", "1"), 1, 1 << 20)
            rank = _int(n, "rank", kv.get("rank", "0"), 0, world - 1)
            spec = replace(spec, world=world, rank=rank)
        if spec.replacement and spec.num_samples is None:
            pass  # torch: num_samples defaults to len(dataset) also with replacement
        return spec

    def _refuse(self, pid: int, reason: str) -> None:
        self.refused_writes += 1
        self.errors.refused(pid, reason)

    def note(self, reason: str) -> None:
        """Log, next to the refused writes, input that was accepted but could not be used
        (:meth:`ErrorLog.note`)."""
        self.errors.note(reason)

    def errors_text(self) -> bytes:
        return self.errors.text()

    def state_text(self) -> bytes:
        jobs = {name: {"dataset": j.dataset, "losses": j.losses}
                for name, j in sorted(self.jobs.items())}
        streams = {f"{j}/{r}": {"sampler": s.sampler.__dict__ if s.sampler else None,
                                "epoch": s.epoch, "batch": s.batch,
                                "orders": {str(e): len(o) for e, o in s.orders.items()},
                                "pending_orders": {str(e): len(o)
                                                   for e, o in s.pending_orders.items()}}
                   for (j, r), s in sorted(self.streams.items())}
        return (json.dumps({"jobs": jobs, "streams": streams,
                            "accepted_writes": self.accepted_writes,
                            "refused_writes": self.refused_writes}, indent=2) + "\n").encode()


def _parse_view(n: int, args: list[str]) -> _Op:
    if not args or not _ID_RE.match(args[0]):
        raise ControlError(f"line {n}: 'view' needs VID (24 hex digits) roots=R [index=LID]")
    kv = _kv(n, args[1:], {"roots", "index"})
    if "roots" not in kv:
        raise ControlError(f"line {n}: 'view' needs roots=R")
    r = _int(n, "roots", kv["roots"], 1, MAX_ROOTS)
    lid = kv.get("index")
    if lid is not None and not _ID_RE.match(lid):
        raise ControlError(f"line {n}: index must be a list id (24 hex digits)")
    return _Op("view", args[0], ((), lid, r), n)


def _fold_roots(ops: list[_Op]) -> list[_Op]:
    """``root`` lines go into the ``view`` line that closes them (same write, same VID,
    the number it says); the view's id is checked against its content."""
    out: list[_Op] = []
    roots: list[_Op] = []
    for op in ops:
        if op.verb == "root":
            if roots and roots[0].arg != op.arg:
                raise ControlError(f"line {op.line}: root of view {op.arg} while view "
                                   f"{roots[0].arg} is not closed")
            roots.append(op)
            continue
        if op.verb == "view":
            vid, (_, lid, r) = str(op.arg), op.extra
            if len(roots) != r or (roots and roots[0].arg != vid):
                raise ControlError(f"line {op.line}: view {vid} says roots={r} but "
                                   f"{len(roots)} 'root' lines of it precede it in this write")
            defs = tuple(o.extra[0] for o in roots)
            if view_id([d.rel for d in defs], defs, lid) != vid:
                raise ControlError(f"line {op.line}: view {vid} does not match its definition "
                                   f"(see dlcachefs.clairvoyance.protocol.view_id)")
            out.append(_Op("view", vid, (defs, lid), op.line))
            roots = []
            continue
        if roots:
            raise ControlError(f"line {roots[0].line}: 'root' lines must be closed by their "
                               f"'view' line before other commands")
        out.append(op)
    if roots:
        raise ControlError(f"line {roots[0].line}: 'root' lines without their 'view' line")
    return out


class _ListDryRun:
    """Tries a write's ``index`` and ``view`` lines on what was received (for
    :meth:`ControlState._check`), as :meth:`ControlState._apply_list_or_view` applies them."""

    def __init__(self, cs: ControlState, pid: int) -> None:
        self.cs = cs
        self.pid = pid  # lists in transit are per writing process ("PID/LID")
        self.chunks = _ChunkDryRun(cs.pending_lists, MAX_LISTS)
        self.done: dict[str, tuple[int, int]] = {}  # lid -> (count, max + 1) completed here
        self.views: dict[str, int] = {}  # vid -> length, defined here
        self.added = 0

    def index(self, op: _Op) -> None:
        lid = str(op.arg)
        parts = self.chunks.line(op, f"{self.pid}/{lid}", f"index list {lid}")
        if parts is None:
            self.added += len(op.extra[2])
            return
        content = array("q")
        for x in parts:
            content.extend(x)
        if index_list_id(content) != lid:
            raise ControlError(f"line {op.line}: index list {lid} does not match its id "
                               f"(sha256 of the int64 little-endian indices)")
        self.done[lid] = (len(content), max(content) + 1 if content else 0)

    def complete(self, lid: str) -> bool:
        return lid in self.done or lid in self.cs.index_lists

    def _list_info(self, lid: str) -> tuple[int, int]:
        if lid in self.done:
            return self.done[lid]
        a = self.cs.index_lists[lid]  # up to MAX_ORDER_LEN indices: not a Python loop
        return len(a), (int(np.frombuffer(a, dtype=np.int64).max()) + 1 if len(a) else 0)

    def view(self, op: _Op) -> None:
        vid, (roots, lid) = str(op.arg), op.extra
        base = sum(r.count for r in roots)
        if lid is None:
            self.views[vid] = base
            return
        if not self.complete(lid):
            raise ControlError(f"line {op.line}: view {vid} names index list {lid}, which the "
                               f"mount does not hold: send its 'index' lines first")
        count, top = self._list_info(lid)
        if top > base:
            raise ControlError(f"line {op.line}: index list {lid} reaches index {top - 1}, but "
                               f"the roots of view {vid} hold {base} samples")
        self.views[vid] = count

    def has_view(self, vid: str) -> bool:
        return vid in self.views or vid in self.cs.views

    def view_len(self, vid: str) -> int:
        if vid in self.views:
            return self.views[vid]
        return len(self.cs.views[vid])


def _one_line(reason: str) -> str:
    """``reason`` with control characters escaped (a reason may quote the input it
    refuses): one entry of ``.dlcache/errors`` is one line."""
    if reason.isprintable():
        return reason
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in reason)
