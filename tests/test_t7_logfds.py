"""Log descriptors are bounded (dlcachefs.store.logs.LogStore: an LRU of open logs, each
pinned while in use): many logs, reads from several threads, holes punched, logs deleted;
the bytes stay exact and the open descriptors stay under the cap."""

import os
import random
import threading

from dlcachefs.store.logs import LogStore


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_open_logs_stay_under_the_cap_and_reads_stay_exact(tmp_path):
    cap = 4
    store = LogStore(str(tmp_path / "logs"), log_size=64 << 10, max_open=cap)
    base = _fds()
    rnd = random.Random(7)
    where: list[tuple[int, int, bytes]] = []
    for i in range(40):  # 40 logs of a few chunks each (a new log per 2 chunks)
        if i % 2 == 0:
            store.start_log(100 + i)
        data = rnd.randbytes(rnd.randrange(1, 30 << 10))
        log_id, off = store.append(data)
        where.append((log_id, off, data))
        assert store.open_fds() <= cap, store.open_fds()
    assert len(store.log_ids()) == 20
    bad: list[str] = []
    peak = [0]

    def reader(seed: int) -> None:
        r = random.Random(seed)
        for _ in range(400):
            log_id, off, data = r.choice(where[10:])  # the rest is released meanwhile
            if store.read(log_id, off, len(data)) != data:
                bad.append(f"{log_id}@{off}")
            peak[0] = max(peak[0], store.open_fds())

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    # meanwhile: holes punched in, and whole logs released, through the same descriptors
    for log_id, off, data in where[:10]:
        store.release(log_id, off, len(data))
    for t in threads:
        t.join()
    assert not bad, bad
    # pinned descriptors may exceed the cap by the readers in flight, no more
    assert peak[0] <= cap + 4 and store.open_fds() <= cap
    assert _fds() - base <= cap
    for log_id, off, data in where[10:]:  # what was not released still reads exact
        assert store.read(log_id, off, len(data)) == data
    store.close()
    assert _fds() <= base
