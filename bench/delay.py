"""A stdio <-> TCP relay that delays every byte by a fixed time in each direction.

There is no netem in this kernel; this adds round-trip latency to an ssh connection
(and so to sshfs) as ssh's ProxyCommand, to emulate a far remote (another region, an
object store) where each request waits for the network:

    sshfs -o ProxyCommand="python3 -m bench.delay 10.233.0.2 22 20" ...   # +40 ms RTT

Data keeps its order; throughput is not limited (tbf shapes bandwidth separately).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from collections import deque


def _pump(read, write, delay: float) -> None:
    q: deque[tuple[float, bytes]] = deque()
    cv = threading.Condition()
    done = threading.Event()

    def reader() -> None:
        try:
            while True:
                data = read()
                with cv:
                    q.append((time.monotonic() + delay, data))
                    cv.notify()
                if not data:
                    return
        finally:
            done.set()

    threading.Thread(target=reader, daemon=True).start()
    while True:
        with cv:
            while not q:
                cv.wait()
            due, data = q.popleft()
        wait = due - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        if not data:
            write(b"")
            return
        write(data)


def main() -> int:
    host, port, delay_ms = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    delay = delay_ms / 1000.0
    sock = socket.create_connection((host, port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def to_remote(data: bytes) -> None:
        if data:
            sock.sendall(data)
        else:
            sock.shutdown(socket.SHUT_WR)

    def to_local(data: bytes) -> None:
        if data:
            view = memoryview(data)
            while view:
                view = view[os.write(1, view):]
        else:
            os.close(1)

    up = threading.Thread(target=_pump, args=(lambda: os.read(0, 1 << 16), to_remote, delay),
                          daemon=True)
    up.start()
    _pump(lambda: sock.recv(1 << 16), to_local, delay)
    return 0


if __name__ == "__main__":
    sys.exit(main())
