"""Real memcached servers for tests and benchmarks of the peer tier: :class:`Memcached`
starts one on 127.0.0.1 at a free port, with extstore on a file of its own, and always
stops it (only the process it started, by its pid); :func:`cluster` starts several."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def memcached_available() -> bool:
    return shutil.which("memcached") is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Memcached:
    """One memcached on 127.0.0.1: ``-m`` MiB of memory, items up to ``item_mb`` MiB,
    extstore (the flash tier) on ``<workdir>/ext-PORT`` of ``ext_mb`` MiB. ``.address``
    is ``"127.0.0.1:PORT"``. As a context manager: started on the way in, stopped on the
    way out."""

    def __init__(self, workdir: str | os.PathLike, memory_mb: int = 64, item_mb: int = 8,
                 ext_mb: int = 64) -> None:
        self.workdir = Path(workdir)
        self.memory_mb, self.item_mb, self.ext_mb = memory_mb, item_mb, ext_mb
        self.port = 0
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        """memcached's stderr (a file: a pipe nobody reads would block it once full)."""
        return self.workdir / f"memcached-{self.port}.log"

    def argv(self) -> list[str]:
        # extstore's write buffer must hold the largest item, and its page size must be
        # given before ext_path (memcached 1.6 refuses otherwise)
        wbuf = max(4, self.item_mb)
        ext = (f"ext_page_size={max(wbuf, 8)},ext_wbuf_size={wbuf},"
               f"ext_path={self.workdir / f'ext-{self.port}'}:{self.ext_mb}m")
        argv = ["memcached", "-l", "127.0.0.1", "-p", str(self.port), "-U", "0",
                "-m", str(self.memory_mb), "-I", f"{self.item_mb}m", "-o", ext]
        if os.geteuid() == 0:
            argv[1:1] = ["-u", "root"]  # memcached refuses to run as root without it
        return argv

    def start(self, timeout: float = 10.0, port: int = 0) -> Memcached:
        """Start on ``port`` (0: a free one), wait until it answers."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        for _ in range(1 if port else 5):  # a free port may be taken before the bind
            self.port = port or _free_port()
            with open(self.log_path, "wb") as err_file:  # the child keeps its own fd
                self.proc = subprocess.Popen(self.argv(), stdout=subprocess.DEVNULL,
                                             stderr=err_file, start_new_session=True)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                        s.sendall(b"version\r\n")
                        if s.recv(64).startswith(b"VERSION"):
                            return self
                except OSError:
                    time.sleep(0.05)
            self.stop()
            err = self.log_path.read_text(errors="replace")
            if "Address already in use" not in err:
                raise RuntimeError(f"memcached did not start: {err.strip()}")
        raise RuntimeError("memcached: no free port")

    def restart(self) -> Memcached:
        """Start again on the same port, empty (memcached keeps nothing across restarts)."""
        self.stop()
        return self.start(port=self.port)

    def pause(self) -> None:
        """SIGSTOP: a hung server (connections are still accepted by the kernel, nothing
        answers). :meth:`resume` undoes it; :meth:`stop` resumes it first."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def kill9(self) -> None:
        """``kill -9`` (a node's tier dying mid-epoch)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.resume()  # a paused one would not see its SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill9()
        self.proc = None
        (self.workdir / f"ext-{self.port}").unlink(missing_ok=True)  # keeps .port

    def __enter__(self) -> Memcached:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextmanager
def cluster(n: int, workdir: str | os.PathLike, **kw: int) -> Iterator[list[Memcached]]:
    """``n`` memcached servers (:class:`Memcached` options in ``kw``), started on the way
    in; every one started is stopped on the way out, even when a later one failed to
    start."""
    ms = [Memcached(workdir, **kw) for _ in range(n)]
    try:
        for m in ms:
            m.start()
        yield ms
    finally:
        for m in ms:
            m.stop()
