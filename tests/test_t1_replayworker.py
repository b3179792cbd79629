"""The sampler replay worker (dlcachefs.clairvoyance.replayworker): orders computed in a spawned process
are the in-process replayer's, bit for bit; a worker that dies is replaced; bad specs and
a closed worker give clear errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch")

from dlcachefs.clairvoyance.replay import OrderReplayer, SamplerSpec  # noqa: E402
from dlcachefs.clairvoyance.replayworker import (  # noqa: E402
    RemoteReplayer,
    ReplayClosed,
    ReplayWorker,
)


@pytest.fixture(scope="module")
def worker():
    w = ReplayWorker()
    assert w.wait_ready()
    yield w
    w.close()


SPECS = [
    (SamplerSpec("random", seed=3), None),
    (SamplerSpec("random", seed=5, loader_draws="each"), None),
    (SamplerSpec("random", seed=7, num_samples=50, replacement=True), None),
    (SamplerSpec("distributed", seed=2, world=3, rank=1), None),
    (SamplerSpec("distributed", seed=2, world=2, rank=0, shuffle=False), None),
    (SamplerSpec("sequential"), None),
    (SamplerSpec("subset_random", seed=9), [5, 3, 40, 41, 7, 0]),
]


@pytest.mark.parametrize("spec,subset", SPECS)
def test_orders_are_the_in_process_ones(worker, spec, subset):
    n = 97
    remote = RemoteReplayer(worker, spec, n, base_epoch=0, subset=subset)
    local = OrderReplayer(spec, n, base_epoch=0, subset=subset)
    for epoch in (0, 1, 2, 5, 1):
        assert remote.order(epoch) == local.order(epoch)


def test_bad_specs_fail_before_the_worker():
    w = ReplayWorker()
    with pytest.raises(ValueError):
        RemoteReplayer(w, SamplerSpec("distributed", world=2, rank=5), 10)
    with pytest.raises(ValueError):
        RemoteReplayer(w, SamplerSpec("subset_random", seed=1), 10, subset=[3, 11])
    assert w._proc is None  # nothing was spawned for them
    w.close()


@pytest.mark.daemon_log_allows(r"replay worker failed \(killed by SIGKILL\)")
def test_a_dead_worker_is_replaced_and_a_closed_one_refuses(caplog):
    w = ReplayWorker()
    try:
        rep = RemoteReplayer(w, SamplerSpec("random", seed=1), 20)
        first = rep.order(0)
        w._proc.kill()
        w._proc.wait(5)
        rep2 = RemoteReplayer(w, SamplerSpec("random", seed=1), 20)
        assert rep2.order(0) == first  # a new worker, the same order
        # the death between requests is said, with how it ended
        assert any("killed by SIGKILL" in r.getMessage() for r in caplog.records)
    finally:
        w.close()
    rep3 = RemoteReplayer(w, SamplerSpec("random", seed=2), 20)
    with pytest.raises(ReplayClosed, match="closed"):
        rep3.order(0)


def _gone(pid: int) -> bool:
    """No such process, or a zombie (reparented to a reaper that has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_worker_ends_when_its_daemon_is_killed():
    """A SIGKILLed daemon cannot end its replay worker: the worker's watch of its parent
    does (otherwise it would live on through torch's import, or here for 10 minutes)."""
    grandchild = ("import os, time\n"
                  "from dlcachefs.clairvoyance.replayworker import exit_with_parent\n"
                  "exit_with_parent(os.getppid(), every=0.05)\n"
                  "print(os.getpid(), flush=True)\n"
                  "time.sleep(600)\n")
    parent = ("import subprocess, sys, time\n"
              f"p = subprocess.Popen([sys.executable, '-c', {grandchild!r}])\n"
              "time.sleep(600)\n")
    mid = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    pid = 0
    try:
        pid = int(mid.stdout.readline())
        time.sleep(0.3)
        assert not _gone(pid)  # its parent lives: it stays
        mid.send_signal(signal.SIGKILL)
        mid.wait()
        for _ in range(600):  # a bound for a loaded machine, not a speed check
            if _gone(pid):
                break
            time.sleep(0.1)
        assert _gone(pid)
    finally:
        mid.kill()
        mid.wait()
        if pid and not _gone(pid):
            os.kill(pid, signal.SIGKILL)


# ----- a worker that dies says why ---------------------------------------------------------

#: torch packages that kill the worker as it imports them: an exception nothing catches (a
#: BaseException, as SystemExit or KeyboardInterrupt are), and a native crash
FAKE_TORCH = {
    "raises": "class TorchAbort(BaseException):\n    pass\n\n\n"
              "raise TorchAbort('the fake torch refuses to load (test)')\n",
    "segfault": "import ctypes\n\nctypes.string_at(0)\n",
}


def fake_torch(tmp_path, kind: str) -> str:
    """A directory holding a ``torch`` package that kills its importer (``kind``)."""
    pkg = tmp_path / kind / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_TORCH[kind])
    return str(pkg.parent)


@pytest.mark.daemon_log_allows(r"replay worker failed \(exit code 1\): torch\.TorchAbort")
def test_a_worker_dying_of_an_exception_says_which_and_its_exit_code(tmp_path, monkeypatch,
                                                                    caplog):
    """The worker's own exception (the last line of its traceback) and its exit status
    are the reason, not the broken pipe's "[Errno 104] Connection reset by peer"."""
    monkeypatch.setenv("PYTHONPATH", fake_torch(tmp_path, "raises"))
    w = ReplayWorker()
    try:
        assert not w.wait_ready()
        want = ("the sampler replay worker failed (exit code 1): torch.TorchAbort: the fake "
                "torch refuses to load (test)")
        assert w.error == want
        rep = RemoteReplayer(w, SamplerSpec("random", seed=1), 20)
        with pytest.raises(ValueError) as e:
            rep.order(0)  # a new worker, which dies the same way
        assert str(e.value) == want
        assert [r.getMessage() for r in caplog.records
                if r.name == "dlcachefs.clairvoyance.replayworker"] == [want, want]
    finally:
        w.close()


@pytest.mark.daemon_log_allows(r"replay worker failed \(killed by SIGSEGV\)")
def test_a_worker_killed_by_a_signal_says_which(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", fake_torch(tmp_path, "segfault"))
    w = ReplayWorker()
    try:
        assert not w.wait_ready()
        assert w.error == ("the sampler replay worker failed (killed by SIGSEGV): Fatal "
                           "Python error: Segmentation fault")
    finally:
        w.close()


def test_the_worker_error_is_the_last_line_of_its_last_traceback():
    from dlcachefs.clairvoyance.replayworker import death_reason, worker_error

    chained = ("Traceback (most recent call last):\n  File \"a.py\", line 1, in <module>\n"
               "KeyError: 'x'\n\nDuring handling of the above exception, another exception "
               "occurred:\n\nTraceback (most recent call last):\n  File \"a.py\", line 3\n"
               "    raise RuntimeError('boom')\n    ^^^^^\nRuntimeError: boom\n")
    assert worker_error(chained) == "RuntimeError: boom"
    assert worker_error("some warning\nanother line\n") == "another line"
    assert worker_error("") == ""
    assert worker_error("x" * 900).endswith("...")
    assert death_reason(3, "", OSError(104, "Connection reset by peer")) == (
        "the sampler replay worker failed (exit code 3): [Errno 104] Connection reset by peer")
    assert death_reason(None, "") == ("the sampler replay worker failed (still running, its "
                                      "pipe closed)")


@pytest.mark.skipif(sys.version_info < (3, 11), reason="-P is Python 3.11's")
def test_the_worker_never_imports_from_the_daemons_directory(tmp_path, monkeypatch):
    """``python -m`` puts the current directory first on the path: a daemon started in a
    training's directory that holds a ``torch.py`` must still replay with the real one."""
    (tmp_path / "torch.py").write_text("raise ImportError('the directory was imported')\n")
    monkeypatch.chdir(tmp_path)
    w = ReplayWorker()
    try:
        assert w.wait_ready(), w.error
    finally:
        w.close()
