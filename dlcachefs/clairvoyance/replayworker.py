"""Sampler replay in a worker process, so the daemon never imports torch.

Replaying a torch sampler needs torch (:mod:`dlcachefs.clairvoyance.replay`). Importing it costs
~3-4 s of CPU and ~500 MB. Done in the daemon, even in a background thread, that import
holds the GIL while the first epoch is being served: every FUSE request waited on it
(the first pass after a mount ran at half speed, `bench.run` raw readers). So orders are
computed in one worker process (``nice`` +10), which imports torch as soon as it starts
(when a training's hook first opens the control file, see
:meth:`~dlcachefs.clairvoyance.streams.StreamManager.start_replay`): the first announcement
finds it ready or nearly, and the daemon's own work never waits on it.

:class:`RemoteReplayer` has :class:`~dlcachefs.clairvoyance.replay.OrderReplayer`'s interface
(``spec``, ``known``, ``order``) for the streams. The worker keeps the replayers it made
(keyed by sampler, dataset size, base epoch and index list), so going from epoch E to
E+1 costs one permutation, as in-process.

The worker is a new interpreter (``python -m dlcachefs.clairvoyance.replayworker``), not a
``multiprocessing`` spawn: a spawn imports the daemon's ``__main__`` again in the child,
and a main that cannot be imported twice (a script that mounts, a wrapper) killed every
worker at its start. Its stderr is a pipe whose last 8 KiB a thread keeps: when it dies,
the last line of its traceback (or of ``faulthandler``'s report of a fatal signal) and its
exit status are the failure's reason (:func:`death_reason`), in the stream's ``reason`` and the log.

Concurrency: ``order`` blocks (call it in a thread). One request at a time on the pipe
(a lock); a worker that died or does not answer within ``TIMEOUT_S`` is restarted on the
next request and the current one fails with ValueError (the stream reports it).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import numpy as np

from dlcachefs.clairvoyance.replay import OrderReplayer, SamplerSpec, order_known

log = logging.getLogger(__name__)

TIMEOUT_S = 120.0  # a 1.28M-sample order takes well under a second; torch's import ~4 s
MAX_REPLAYERS = 16  # kept in the worker
EXIT_WAIT_S = 5.0  # a worker whose pipe closed is given this long to exit (its status)
#: ``-P``: ``-m`` puts no current directory first on the worker's path (a training's
#: directory holding a ``numpy.py`` would shadow the real one); Python 3.11+
SAFE_PATH = ["-P"] if sys.version_info >= (3, 11) else []
STDERR_TAIL = 8192  # bytes of a dead worker's stderr read for its reason


class ReplayClosed(ValueError):
    """A replay asked of a worker that was closed: the mount is stopping. Not a failure of
    the order (it would have been replayed), so it is not reported as one."""


class ReplayWorker:
    """The worker process and the pipe to it (started lazily or by :meth:`start`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._stderr: StderrTail | None = None  # the end of what the worker writes
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
        if self._proc is not None:
            if self._proc.poll() is None:
                return
            # it died between requests: said now, then a new one is started
            log.warning("%s", self._death())
        self._stop()
        mine, theirs = socket.socketpair()
        err_r, err = os.pipe()
        try:
            # fork + exec (never a bare fork of a process with trio's threads); the
            # worker's copy of ``theirs`` is its only end of the pipe
            self._proc = subprocess.Popen(
                [sys.executable, *SAFE_PATH, "-X", "faulthandler", "-m", __name__,
                 str(theirs.fileno()), str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                pass_fds=(theirs.fileno(),))
        except BaseException:
            mine.close()
            os.close(err_r)
            raise
        finally:
            theirs.close()
            os.close(err)  # (the worker's copy is its stderr)
        self._stderr = StderrTail(err_r)
        self._conn = Connection(mine.detach())

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
                if self._closed:
                    self._stop()
                    return False, "the sampler replay worker is closed"
                # the pipe broke: the worker died (or is dying). Its own words say why.
                why = self._death(e)
                log.warning("%s", why)
                self._stop()
                return False, why

    def _death(self, pipe_error: BaseException | None = None) -> str:
        """Why the worker died: :func:`death_reason` of its exit status (waited for a
        moment: its pipe closes as it exits) and its stderr. Lock held."""
        proc = self._proc
        status = None
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                status = proc.wait(EXIT_WAIT_S)
        text = self._stderr.text() if self._stderr is not None else ""
        return death_reason(status, text, pipe_error)

    def _stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(5)
            self._proc = None
        self._stderr = None  # (its thread ends at the pipe's end, with the worker)

    def close(self) -> None:
        """End the worker (at unmount). Killed first, without the lock: a request
        waiting on it then returns at once instead of holding the lock."""
        self._closed = True  # no request spawns it again
        p = self._proc
        if p is not None and p.poll() is None:
            p.kill()
        if self._lock.acquire(timeout=10):
            try:
                self._stop()
            finally:
                self._lock.release()


def death_reason(status: int | None, stderr: str, pipe_error: BaseException | None = None
                 ) -> str:
    """The reason of a worker's death: its exit status (``status`` as
    :attr:`subprocess.Popen.returncode`: negative for a signal; None when it had not
    exited) and its own error, the last line of what it wrote on ``stderr``
    (:func:`worker_error`; the broken pipe's ``pipe_error`` when it wrote nothing)."""
    if status is None:
        how = "still running, its pipe closed"
    elif status < 0:
        try:
            how = f"killed by {signal.Signals(-status).name}"
        except ValueError:
            how = f"killed by signal {-status}"
    else:
        how = f"exit code {status}"
    what = worker_error(stderr) or (str(pipe_error) if pipe_error is not None else "")
    return f"the sampler replay worker failed ({how})" + (f": {what}" if what else "")


def worker_error(stderr: str, limit: int = 500) -> str:
    """The worker's own error in what it wrote on stderr: the last line of its last
    Python traceback (``Type: message``), or ``faulthandler``'s ``Fatal Python error``
    line of a fatal signal; else its last line ("" for nothing), at most ``limit``
    characters."""
    lines = [ln.rstrip() for ln in stderr.splitlines() if ln.strip()]
    found = lines[-1] if lines else ""
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("Traceback (most recent call last):"):
            own = [ln for ln in lines[i + 1:] if not ln[:1].isspace()]
            found = own[-1] if own else found
            break
        if lines[i].startswith("Fatal Python error:"):
            found = lines[i]
            break
    return found if len(found) <= limit else found[:limit - 3] + "..."


class StderrTail:
    """The last :data:`STDERR_TAIL` bytes a worker wrote on its stderr, read from a pipe
    by a thread of its own until the worker's end closes it (no file is kept: a
    descriptor of an unnamed file would stay open in the daemon for the worker's life)."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buf = bytearray()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, name="replay-stderr",
                                        daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            while chunk := os.read(self._fd, 65536):
                with self._lock:
                    self._buf += chunk
                    del self._buf[:-STDERR_TAIL]
        except OSError:
            pass
        finally:
            os.close(self._fd)

    def text(self, wait: float = EXIT_WAIT_S) -> str:
        """What was read, as text; waits up to ``wait`` seconds for the pipe's end (the
        worker exited: its last words are in the pipe)."""
        self._thread.join(wait)
        with self._lock:
            return self._buf.decode("utf-8", "replace")


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


def main(argv: list[str]) -> None:
    """The worker process: ``python -m dlcachefs.clairvoyance.replayworker FD PARENT``
    serves the pipe end ``FD`` until it closes or the daemon ``PARENT`` is gone."""
    _serve(Connection(int(argv[0])), int(argv[1]))


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



if __name__ == "__main__":
    main(sys.argv[1:])
