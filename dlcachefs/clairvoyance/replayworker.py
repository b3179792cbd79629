"""Sampler replay in a worker process, so the daemon never imports torch.

Replaying a torch sampler needs torch (:mod:`dlcachefs.clairvoyance.replay`). Importing it costs
~3-4 s of CPU and ~500 MB. Done in the daemon, even in a background thread, that import
holds the GIL while the first epoch is being served: every FUSE request waited on it
(the first pass after a mount ran at half speed, `bench.run` raw readers). So orders are
computed in one spawned process (``nice`` +10), which imports torch as soon as it starts
(when a training's hook first opens the control file, see
:meth:`~dlcachefs.clairvoyance.streams.StreamManager.start_replay`): the first announcement
finds it ready or nearly, and the daemon's own work never waits on it.

:class:`RemoteReplayer` has :class:`~dlcachefs.clairvoyance.replay.OrderReplayer`'s interface
(``spec``, ``known``, ``order``) for the streams. The worker keeps the replayers it made
(keyed by sampler, dataset size, base epoch and index list), so going from epoch E to
E+1 costs one permutation, as in-process.

Concurrency: ``order`` blocks (call it in a thread). One request at a time on the pipe
(a lock); a worker that died or does not answer within ``TIMEOUT_S`` is restarted on the
next request and the current one fails with ValueError (the stream reports it).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from dlcachefs.clairvoyance.replay import OrderReplayer, SamplerSpec, order_known

log = logging.getLogger(__name__)

TIMEOUT_S = 120.0  # a 1.28M-sample order takes well under a second; torch's import ~4 s
MAX_REPLAYERS = 16  # kept in the worker


class ReplayClosed(ValueError):
    """A replay asked of a worker that was closed: the mount is stopping. Not a failure of
    the order (it would have been replayed), so it is not reported as one."""


class ReplayWorker:
    """The worker process and the pipe to it (started lazily or by :meth:`start`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: mp.process.BaseProcess | None = None
        self._conn = None
        self.torch: bool | None = None  # torch imports in the worker (None: not known yet)
        self.error: str | None = None
        self._closed = False
        self._disabled: str | None = None  # why the worker must not be started

    def disable(self, reason: str) -> None:
        """Never start the worker (e.g. a memory cgroup limit with no room for torch):
        announcements then fail with ``reason``, reads are served as without them."""
        self._disabled = self.error = reason

    def start(self) -> None:
        """Spawn the worker (it imports torch right away). Blocking, a thread."""
        with self._lock:
            self._ensure()

    def _ensure(self) -> None:
        if self._closed:
            raise OSError("the sampler replay worker is closed (unmounting)")
        if self._disabled is not None:
            raise OSError(self._disabled)
        if self._proc is not None and self._proc.is_alive():
            return
        self._stop()
        ctx = mp.get_context("spawn")  # never fork a process with trio's threads
        mine, theirs = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(theirs, os.getpid()), daemon=True,
                                 name="dlcachefs-replay")
        self._proc.start()
        theirs.close()
        self._conn = mine

    def wait_ready(self, timeout: float = TIMEOUT_S) -> bool:
        """Block until the worker has imported torch; True when it could. Thread."""
        ok, value = self._call(("ping",), timeout)
        self.torch = ok and value is True
        if not self.torch:
            self.error = str(value) if not ok else (value or "torch is not installed")
        return self.torch

    def order(self, spec: SamplerSpec, n: int, base_epoch: int, subset, epoch: int
              ) -> list[int]:
        """The order of ``epoch`` (raises ValueError with the worker's reason). Thread."""
        sub = None if subset is None else np.asarray(subset, dtype=np.int64)
        ok, value = self._call(("order", spec, n, base_epoch, sub, epoch), TIMEOUT_S)
        if not ok:
            raise (ReplayClosed if self._closed else ValueError)(value)
        return value.tolist()

    def cluster_order(self, spec: SamplerSpec, n: int, base_epoch: int, epoch: int
                      ) -> list[int]:
        """A distributed sampler's global order of ``epoch`` (every rank's). Thread."""
        ok, value = self._call(("cluster", spec, n, base_epoch, None, epoch), TIMEOUT_S)
        if not ok:
            raise (ReplayClosed if self._closed else ValueError)(value)
        return value.tolist()

    def _call(self, msg: tuple, timeout: float) -> tuple[bool, object]:
        with self._lock:
            try:
                self._ensure()
                assert self._conn is not None
                self._conn.send(msg)
                waited = 0.0
                while not self._conn.poll(1.0):  # in slices: close() must not wait long
                    waited += 1.0
                    if self._closed or waited >= timeout:
                        self._stop()
                        return False, ("the sampler replay worker is closed" if self._closed
                                       else "the sampler replay worker did not answer in "
                                            f"{timeout:.0f} s")
                return self._conn.recv()
            except (OSError, EOFError) as e:
                self._stop()
                return False, f"the sampler replay worker failed: {e}"

    def _stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(5)
            self._proc = None

    def close(self) -> None:
        """End the worker (at unmount). Killed first, without the lock: a request
        waiting on it then returns at once instead of holding the lock."""
        self._closed = True  # no request spawns it again
        p = self._proc
        if p is not None and p.is_alive():
            p.kill()
        if self._lock.acquire(timeout=10):
            try:
                self._stop()
            finally:
                self._lock.release()


@dataclass
class RemoteReplayer:
    """:class:`OrderReplayer`'s interface, computed by a :class:`ReplayWorker`."""

    worker: ReplayWorker
    spec: SamplerSpec
    n: int
    base_epoch: int = 0
    subset: object | None = None
    _cache: OrderedDict = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        OrderReplayer.check(self.spec, self.n, self.subset)  # bad input fails here, no torch

    def known(self, epoch: int) -> bool:
        return order_known(self.spec, self.base_epoch, epoch)

    def order(self, epoch: int) -> list[int]:
        if not self.known(epoch):
            raise ValueError(f"the order of epoch {epoch} is not known from this sampler")
        with self._lock:
            hit = self._cache.get(epoch)
        if hit is not None:
            return hit
        if self.spec.kind == "sequential" or (self.spec.kind == "distributed"
                                              and not self.spec.shuffle):
            # no torch needed (and none loaded here): computed in place
            out = OrderReplayer(self.spec, self.n, self.base_epoch, self.subset).order(epoch)
        else:
            out = self.worker.order(self.spec, self.n, self.base_epoch, self.subset, epoch)
        with self._lock:
            self._cache[epoch] = out
            while len(self._cache) > 4:  # the current and next epochs matter
                self._cache.popitem(last=False)
        return out

    def cluster_order(self, epoch: int) -> list[int]:
        """A distributed sampler's global order of ``epoch``: every rank's samples (see
        :func:`~dlcachefs.clairvoyance.replay.distributed_epoch`). Thread."""
        if not self.known(epoch):
            raise ValueError(f"the order of epoch {epoch} is not known from this sampler")
        if self.spec.kind == "distributed" and not self.spec.shuffle:
            return OrderReplayer(self.spec, self.n, self.base_epoch).cluster_order(epoch)
        return self.worker.cluster_order(self.spec, self.n, self.base_epoch, epoch)


# ----- the worker process ---------------------------------------------------------------


def exit_with_parent(parent: int, every: float = 0.5) -> None:
    """End this process (``os._exit``) as soon as ``parent`` is no longer its parent.

    Why: a daemon killed with SIGKILL cannot end its worker, and the worker would only
    notice at its next ``recv`` (EOF), i.e. after torch's import: ~4 s of CPU and ~500 MB
    for nothing, once per kill (a remount right after a crash paid two imports at once).
    ``PR_SET_PDEATHSIG`` cannot do it: it fires when the parent *thread* that started the
    worker exits, and that is one of trio's worker threads, which come and go. So a
    daemon thread polls ``getppid`` (reparented to init or a subreaper = the daemon is gone)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(every)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _serve(conn, parent: int) -> None:
    """The worker's loop: ``("ping",)`` -> torch importable; ``("order", ...)`` -> array;
    ``("cluster", ...)`` -> a distributed sampler's global order (array).
    ``parent`` is the daemon's pid: the worker ends with it (:func:`exit_with_parent`)."""
    exit_with_parent(parent)
    with contextlib.suppress(OSError):
        os.nice(10)  # it must not take the daemon's CPU while the first epoch is served
    # the daemon handles ^C and SIGTERM (it ends this process); a foreground daemon's
    # process group gets the ^C too
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch_ok: object
    try:
        import torch  # noqa: F401, PLC0415 - the point of this process

        torch_ok = True
    except ImportError:
        torch_ok = False
    except Exception as e:  # noqa: BLE001 - a broken torch: every answer says so
        torch_ok = f"torch cannot be imported: {e}"
    replayers: OrderedDict[tuple, OrderReplayer] = OrderedDict()
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if msg[0] == "ping":
                _answer(conn, (True, torch_ok))
                continue
            _, spec, n, base_epoch, sub, epoch = msg
            if torch_ok is not True:
                _answer(conn, (False, torch_ok or "torch is not installed: orders cannot "
                                                  "be replayed"))
                continue
            key = (spec, n, base_epoch,
                   None if sub is None else hashlib.sha256(sub.tobytes()).digest())
            rep = replayers.get(key)
            if rep is None:
                rep = replayers[key] = OrderReplayer(spec, n, base_epoch=base_epoch,
                                                     subset=sub)
                while len(replayers) > MAX_REPLAYERS:
                    replayers.popitem(last=False)
            replayers.move_to_end(key)
            got = rep.cluster_order(epoch) if msg[0] == "cluster" else rep.order(epoch)
            _answer(conn, (True, np.asarray(got, dtype=np.int64)))
        except _ParentGone:
            return  # the daemon ended (a SIGKILL too): so does this process, quietly
        except Exception as e:  # noqa: BLE001 - an answer, never the end of the worker
            try:
                _answer(conn, (False, f"{type(e).__name__}: {e}"))
            except _ParentGone:
                return


class _ParentGone(Exception):
    pass


def _answer(conn, msg: tuple) -> None:
    try:
        conn.send(msg)
    except OSError as e:  # BrokenPipeError: the daemon is gone
        raise _ParentGone from e

