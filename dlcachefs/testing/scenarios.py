"""The chaos scenarios, each one function that runs real mounts and returns its counts as
a dict: ``bench/chaos.py`` runs them long, ``tests/test_t7_chaos.py`` short. What each
must show is in its docstring; the numbers a bug would move are ``wrong_reads`` (bytes
that differ from the source), ``lost_committed_records``, ``mixed_reads``,
``daemon_up``, ``crashes`` and the errors by errno.

All daemons are started through :class:`~dlcachefs.testing.mounting.Mount` (our children,
killed only by their pid) and cleaned up on the way out, also on failure.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from dlcachefs.mountctl import MountError
from dlcachefs.testing import chaos
from dlcachefs.testing.mounting import (
    DLCACHEFS,
    STALE_MOUNT,
    Mount,
    drop_page_cache,
    log_problems,
    wait_until,
)

Log = Callable[[str], None]

#: what a daemon of these scenarios may log without it being a problem: the stale mount a
#: SIGKILL leaves, damage it found, a full disk, a misbehaving source
EXPECTED_LOG = (
    STALE_MOUNT,
    r"WARNING dlcachefs: cache index \S+ is damaged",
    r"WARNING dlcachefs: index \S+ not marked clean",
    r"WARNING dlcachefs\.cache\.\w+: (checksum|damaged|chunk|record|log|short|cache write)",
    r"WARNING dlcachefs\.cache\.writer: ",
    r"WARNING dlcachefs\.cache\.(fetch|source|engine|reader|readplan|recovery): ",
    r"WARNING dlcachefs\.cache\.recovery: ",
    r"WARNING dlcachefs\.clairvoyance\.",
    r"WARNING dlcachefs\.importance\.view: importance: ",
    r"WARNING dlcachefs\.importance\.losses: \d+ losses of job ",
    r"WARNING dlcachefs\.importance\.losses: importance now for dataset ",
    r"WARNING dlcachefs\.store\.integrity: the index may be damaged",
    r"WARNING dlcachefs\.[\w.]+: .*\(the index may be damaged: ",
)

#: what damage to a mapped index may also make the daemon log: values read back from a
#: damaged page disagree with the cache's account (``--debug-invariants``, which these
#: scenarios run with), noted as damage so that the next start walks and recounts
DAMAGE_LOG = (
    *EXPECTED_LOG,
    r"ERROR dlcachefs\.cache\.invariants: invariant violated: ",
)


def _quiet(_: str) -> None:
    return None


def _log_summary(log: Path, allows: tuple[str, ...] = EXPECTED_LOG) -> dict:
    """Unexpected problems in a daemon log (tracebacks above all), as counts + examples."""
    probs = log_problems(log, allows)
    tb = [p for p in probs if "Traceback" in p]
    return {"unexpected_log_problems": len(probs), "tracebacks": len(tb),
            "log_examples": [p[-400:] for p in probs[:5]]}


def _verify(cache: Path, *extra: str) -> tuple[int, dict]:
    r = subprocess.run([*DLCACHEFS, "verify", "--cache-dir", str(cache), "--json", *extra],
                       capture_output=True, text=True, timeout=1800)
    try:
        return r.returncode, json.loads(r.stdout)
    except ValueError:
        return r.returncode, {"crashed": r.stderr[-2000:]}


def _verify_found(rep: dict) -> int:
    return (len(rep.get("bad_chunks", [])) + len(rep.get("bad_records", []))
            + len(rep.get("invariant_problems", [])) + bool(rep.get("index_damaged")))


# ----- 1. kill -9 ---------------------------------------------------------------------------


def _announce(mnt: Path, epoch: int, seed: int) -> bool:
    """A DistributedSampler's announcement (the next epoch's order is known, so the daemon
    prefetches and lays out the next epoch's log while the readers run)."""
    text = (f"job chaos\ndataset train\nsampler distributed seed={seed} world=1 rank=0\n"
            f"epoch {epoch}\n")
    try:
        with open(mnt / ".dlcache" / "control", "w") as f:
            f.write(text)
        return True
    except OSError:
        return False


#: a training process that writes announcements and losses as fast as it can (killed)
_TRAINER = r"""
import os, sys, random
ctl = os.path.join(sys.argv[1], ".dlcache", "control")
n = int(sys.argv[2]); rnd = random.Random(int(sys.argv[3]))
fd = os.open(ctl, os.O_WRONLY)
print("ready", flush=True)
e = 0
while True:
    e += 1
    body = "job trainer\ndataset train\nsampler random seed=%d\nepoch %d\n" % (e, e % 50)
    body += "loss " + " ".join("%d %.4f" % (rnd.randrange(n), rnd.random()) for _ in range(3000))
    try:
        os.write(fd, body.encode())
    except OSError:
        pass
"""


def _kill_trainer(mnt: Path, n_samples: int, rnd: random.Random) -> dict:
    """SIGKILL a process in the middle of its control writes; the daemon must stay up and
    take the next announcement."""
    p = subprocess.Popen([sys.executable, "-c", _TRAINER, str(mnt), str(n_samples),
                          str(rnd.randrange(1 << 30))], stdout=subprocess.PIPE,
                         stdin=subprocess.DEVNULL)
    try:
        p.stdout.readline()
        time.sleep(rnd.uniform(0.0, 0.4))
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    ok = _announce(mnt, 0, 1)
    return {"trainer_killed": 1, "announce_after_ok": int(ok)}


def kill_cycles(work: Path, cycles: int, seed: int = 0, threads: int = 8, n_files: int = 200,
                trainer_every: int = 5, reorder_every: int = 3, fetch_workers: int = 0,
                log: Log = _quiet) -> dict:
    """Reader threads over a mount while the daemon is SIGKILLed at a random moment, with
    eviction (the cache holds ~60% of the data), prefetch and the next epoch's log being
    written (a DistributedSampler is announced). Then remount, and check: every record
    committed before the kill is still indexed (the same chunk, offset and checksum),
    every byte read through the new mount equals the source, the cache is reused. Every
    ``trainer_every`` cycles a training process is SIGKILLed mid-announcement first.

    The random moment (0.05-1.5 s after the readers start) comes before the replay worker
    has imported torch, so no next epoch's log is being written yet; every
    ``reorder_every``-th cycle therefore waits instead until the stream's next-epoch log has
    sealed a chunk and has more to seal, and kills then (``killed_while_reordering``: the
    last stats before the kill showed the log part-written; ``reorder_wait_timeouts``: it
    never was within 60 s, killed anyway)."""
    rnd = random.Random(seed)
    src, cache, mnt = work / "src", work / "cache", work / "mnt"
    files = chaos.make_dataset(src, n_files, seed)
    total = sum(map(len, files.values()))
    opts = ("--cache-size", str(max(total * 6 // 10, 1 << 20)), "--chunk-size", "256K",
            "--memory", "4M", "--flush-interval", "0.3", "--min-free", "0",
            "--source-threads", "4")
    if fetch_workers:
        opts += ("--fetch-workers", str(fetch_workers))
    index_dir = str(cache / "meta.lmdb")
    daemon_log = work / "daemon.log"
    out: Counter = Counter()
    reads = chaos.ReadTally()
    verify_reads = chaos.ReadTally()
    kill_after: list[float] = []
    m: Mount | None = None
    in_process: chaos.InProcessReader | None = None
    try:
        for cycle in range(cycles):
            before = chaos.committed_records(index_dir) if os.path.exists(index_dir) else {}
            m = Mount(src, mnt, cache, *opts, log=daemon_log)
            try:
                m.start()
            except Exception as e:  # noqa: BLE001 - counted: a mount that fails is a finding
                out["mount_failures"] += 1
                log(f"cycle {cycle}: mount failed: {e}")
                m.cleanup()
                continue
            after = chaos.committed_records(index_dir)
            lost = {k for k, v in before.items() if after.get(k) != v}
            out["committed_before"] += len(before)
            out["lost_committed_records"] += len(lost)
            out["cached_at_start"] += m.stats()["cached_files"]
            # every byte, through the new mount, page cache dropped: from the logs
            drop_page_cache()
            chaos.check_all(m.mnt, files, verify_reads)
            st = m.stats()
            out["verify_hits"] += st["hits"]
            out["verify_misses"] += st["misses"]
            if trainer_every and cycle % trainer_every == trainer_every - 1:
                for k, v in _kill_trainer(m.mnt, n_files, rnd).items():
                    out[k] += v
                if not chaos.alive(m.pid):
                    out["daemon_died_with_trainer"] += 1
            out["announced"] += _announce(m.mnt, cycle % 5, seed)
            # a training under the launcher reads in its own process through the kill
            # (stopped before the remount: its misses through the new mount would fetch,
            # and evict, before the committed records are compared)
            in_process = chaos.InProcessReader(m.mnt, files, work, seed=cycle).__enter__()
            with chaos.ReaderThreads(m.mnt, files, threads, seed=cycle) as readers:
                t0 = time.monotonic()
                if reorder_every and cycle % reorder_every == reorder_every - 1:
                    now = _wait_mid_reorder(m, rnd)
                    out["reorder_kill_cycles"] += 1
                    out["reorder_wait_timeouts"] += now is None
                else:
                    time.sleep(rnd.uniform(0.05, 1.5))
                    now = _stats_or(m, {})
                kill_after.append(time.monotonic() - t0)
                if not chaos.alive(m.pid):
                    out["daemon_died_before_kill"] += 1
                if now:
                    _note_in_flight(out, st, now)
                workers = list((now.get("fetch_workers") or {}).get("pids") or []) if now else []
                m.kill9()
                for k, v in _workers_gone(workers).items():
                    out[k] += v
                time.sleep(0.2)  # its reads go on a moment without the daemon
                chaos.add_in_process(out, in_process.stop())
                in_process = None
            out["reads_cut_by_kill"] += readers.gone
            _merge(reads, readers.tally)
            out["cycles"] += 1
            if cycle % 10 == 0:
                log(f"cycle {cycle}: {len(after)} records, {reads.ok} reads ok, "
                    f"{reads.wrong} wrong, lost {out['lost_committed_records']}")
        # the last remount: bytes, a clean unmount, and verify finds nothing
        before = chaos.committed_records(index_dir) if os.path.exists(index_dir) else {}
        m = Mount(src, mnt, cache, *opts, log=daemon_log)
        m.start()
        after = chaos.committed_records(index_dir)
        out["lost_committed_records"] += sum(1 for k, v in before.items() if after.get(k) != v)
        drop_page_cache()
        chaos.check_all(m.mnt, files, verify_reads)
        m.umount()
        rc, rep = _verify(cache)
        out["verify_exit"] = rc
        out["verify_problems"] = _verify_found(rep)
    finally:
        if in_process is not None:
            in_process.stop()
        if m is not None:
            m.cleanup()
    return {"scenario": "kill", **out, "kill_after_s_median": _median(kill_after),
            "reads": reads.as_dict(), "verify_reads": verify_reads.as_dict(),
            "wrong_bytes_reads": reads.wrong + verify_reads.wrong + out["in_process_wrong"],
            **_log_summary(daemon_log)}


def _workers_gone(pids: list[int], wait_s: float = 30.0) -> dict:
    """After the daemon's SIGKILL: its fetch workers die with it (PR_SET_PDEATHSIG)."""
    deadline = time.monotonic() + wait_s
    while any(chaos.alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if chaos.alive(p)]
    return {"workers_killed": len(pids) - len(left), "workers_outlived_daemon": len(left)}


def _mid_reorder(st: dict) -> bool:
    """Whether a stream's next-epoch log is part-written (a chunk sealed, more to come)."""
    for s in (st.get("streams") or {}).values():
        nl = s.get("next_log") if isinstance(s, dict) else None
        if nl and not nl["failed"] and 0 < nl["sealed"] < nl["chunks"]:
            return True
    return False


def _wait_mid_reorder(m: Mount, rnd: random.Random, timeout: float = 60.0) -> dict | None:
    """Poll the stats until a next-epoch log is part-written, then wait 0-30 ms more; those
    stats (None: not within ``timeout``)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = _stats_or(m, {})
        if _mid_reorder(st):
            time.sleep(rnd.uniform(0.0, 0.03))
            return st
        time.sleep(0.02)
    return None


def _note_in_flight(out: Counter, before: dict, now: dict) -> None:
    """What the daemon was doing when it was killed (from its stats just before)."""
    out["killed_with_records_pending"] += now["pending_bytes"] > 0
    out["killed_while_evicting"] += (now["evicting_bytes"] > 0
                                     or now["chunks_evicted"] > before["chunks_evicted"])
    out["killed_while_fetching"] += now["misses"] + now["prefetched"] > \
        before["misses"] + before["prefetched"]
    out["killed_while_reordering"] += _mid_reorder(now)


def _merge(into: chaos.ReadTally, t: chaos.ReadTally) -> None:
    into.ok += t.ok
    into.wrong += t.wrong
    into.wrong_files += t.wrong_files[: max(0, 20 - len(into.wrong_files))]
    into.errors.update(t.errors)


def _stats_or(m: Mount, default: dict) -> dict:
    """The mount's stats, or ``default`` when they cannot be read (an index damaged under
    the running daemon makes them fail with EIO)."""
    try:
        return m.stats()
    except (OSError, ValueError):
        return default


def _median(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


# ----- 2. damaged cache files -----------------------------------------------------------------


def corruption(work: Path, injections: int, seed: int = 0, n_files: int = 120,
               verify_every: int = 50, log: Log = _quiet) -> dict:
    """Bits flipped, ranges zeroed and files truncated in the chunk logs and in the LMDB
    file, while mounted and while not. LMDB trusts its map: damage under a running daemon
    makes its reads fail (answered EIO; the stop then leaves no clean marker) or, for a
    truncated file, kills it with SIGBUS (clients get ENOTCONN, as for a crash); either way
    the next mount walks the index and sets it aside. So a mounted LMDB injection is
    followed by a remount and a second read of every file, which must be exact with no
    error (``lmdb_mounted_*`` counts). After each injection every file is read through
    the mount (page cache dropped): exact bytes or an error, the daemon up. Each injection
    is detected (a checksum failure, a damaged index set aside, ``verify``) or harmless
    (nothing read differs). Every ``verify_every`` injections and at the end: ``verify``,
    ``verify --repair``, and ``verify`` again must be clean."""
    rnd = random.Random(seed)
    src, cache, mnt = work / "src", work / "cache", work / "mnt"
    files = chaos.make_dataset(src, n_files, seed)
    opts = ("--memory", "1M", "--chunk-size", "128K", "--flush-interval", "0.2",
            "--min-free", "0", "--scan-ahead", "0")
    daemon_log = work / "daemon.log"
    out: Counter = Counter()
    kinds: Counter = Counter()
    reads = chaos.ReadTally()
    m = Mount(src, mnt, cache, *opts, log=daemon_log)
    damaged_dir = cache / "meta.lmdb.damaged"

    def quarantines() -> int:
        return int(damaged_dir.exists() and (damaged_dir / "QUARANTINED").stat().st_mtime_ns)

    def start() -> None:
        """Mount; a mount that fails is counted, then verify --repair and mount again."""
        try:
            m.start()
        except MountError as e:
            out["mount_failures"] += 1
            log(f"mount failed: {e}"[:500])
            m.cleanup()
            _verify(cache, "--repair")
            m.start()

    try:
        m.start()
        chaos.check_all(m.mnt, files, reads)
        m.wait_cached(len(files))
        for i in range(injections):
            target = "lmdb" if rnd.random() < 0.25 else "log"
            mounted = rnd.random() < 0.5
            kind = rnd.choice(chaos.DAMAGE_KINDS)
            if kind == "truncate" and rnd.random() < 0.7:
                kind = "flip"  # truncation wipes the most; keep it the rarer one
            if not mounted and m.pid is not None:
                m.umount()
            q0 = quarantines()
            if target == "lmdb":
                path = cache / "meta.lmdb" / "data.mdb"
            else:
                logs = sorted((cache / "logs").glob("*.log"))
                path = rnd.choice(logs) if logs else None
            if path is None or not path.exists():
                out["skipped"] += 1
                if m.pid is None:
                    start()
                continue
            kinds[f"{target}/{kind}/{'mounted' if mounted else 'unmounted'}"] += 1
            chaos.damage_file(path, kind, rnd, lo=4096 if target == "log" else 0)
            out["injections"] += 1
            if m.pid is None:
                start()
            st0 = _stats_or(m, {"checksum_failures": 0})
            drop_page_cache()
            t = chaos.check_all(m.mnt, files)
            _merge(reads, t)
            # and by a training under the launcher, reading in its own process: exact
            # bytes or an error, and never killed (a damaged index is not mapped)
            ip = chaos.check_in_process(m.mnt, files, work, seed=i)
            chaos.add_in_process(out, ip)
            t.wrong += ip["wrong"]
            up = chaos.alive(m.pid)
            st1 = _stats_or(m, st0) if up else st0
            if not up:
                out["lmdb_mounted_daemon_died" if target == "lmdb" and mounted
                    else "daemon_down"] += 1
                m.cleanup()
                start()
            if target == "lmdb" and mounted:
                # the remount after damage under the map: the index checked, set aside if
                # damaged; every file exact, no error
                try:
                    m.umount()
                except MountError:
                    out["lmdb_mounted_unclean_stop"] += 1
                    m.cleanup()
                start()
                drop_page_cache()
                t2 = chaos.check_all(m.mnt, files)
                _merge(reads, t2)
                t.wrong += t2.wrong
                out["lmdb_mounted_errors_after_remount"] += sum(t2.errors.values())
                out["lmdb_mounted_quarantined"] += quarantines() != q0
                out["lmdb_mounted_errors_before_remount"] += sum(t.errors.values())
            if t.wrong:
                out["injections_with_wrong_bytes"] += 1
            elif st1["checksum_failures"] > st0["checksum_failures"] or quarantines() != q0:
                out["detected"] += 1
            elif t.errors:
                out["detected_as_errors"] += 1
            else:
                out["harmless_or_latent"] += 1
            if (i + 1) % verify_every == 0 or i == injections - 1:
                m.umount()
                rc, rep = _verify(cache)
                out["verify_runs"] += 1
                out["verify_found"] += _verify_found(rep)
                out["verify_crashed"] += "crashed" in rep
                rc2, _ = _verify(cache, "--repair")
                rc3, rep3 = _verify(cache)
                out["repair_clean"] += int(rc2 == 0 and rc3 == 0 and _verify_found(rep3) == 0)
                start()
                log(f"injection {i + 1}: {dict(out)}")
        out["daemon_up_at_end"] = int(chaos.alive(m.pid))
        m.umount()
    finally:
        m.cleanup()
    return {"scenario": "corrupt", **out, "by_kind": dict(kinds), "reads": reads.as_dict(),
            "wrong_bytes_reads": reads.wrong + out["in_process_wrong"],
            **_log_summary(daemon_log, DAMAGE_LOG)}


# ----- 3. a misbehaving source ---------------------------------------------------------------

#: what each source fault may give a reader: the old bytes, the new ones, or these errnos
SOURCE_CASES: dict[str, tuple[str, ...]] = {
    "eacces": ("EACCES",),
    "eio": ("EIO",),
    "hang": ("ETIMEDOUT",),
    "change": ("ESTALE",),
    "truncate": ("ESTALE",),
    "replace": ("ESTALE", "ENOENT"),
    "remove": ("ESTALE", "ENOENT"),
}


def source_faults(work: Path, rounds: int, seed: int = 0, cases: tuple[str, ...] = tuple(SOURCE_CASES),
                  log: Log = _quiet) -> dict:
    """The source is a FUSE passthrough that fails or hangs on demand
    (:mod:`dlcachefs.testing.passthrough` ``--faults``); files are changed, truncated, replaced and removed
    while the daemon's fetch of them hangs half read. Each read through the mount must be
    the old bytes, the new bytes, or the case's errno: never a mix (``mixed_reads``)."""
    from dlcachefs.testing.passthrough import passthrough_mount  # noqa: PLC0415 - FUSE

    rnd = random.Random(seed)
    real, pt, cache, mnt = work / "real", work / "pt", work / "cache", work / "mnt"
    per = len(cases) * rounds
    names = [f"f{i:05d}.bin" for i in range(per)]
    (real / "d").mkdir(parents=True, exist_ok=True)
    for n in names:
        (real / "d" / n).write_bytes(rnd.randbytes(rnd.randrange(300_000, 600_000)))
    faults = work / "faults.json"
    faults.write_text("{}")
    hits = Path(str(faults) + ".hit")
    outcomes: dict[str, Counter] = {c: Counter() for c in cases}
    out: Counter = Counter()
    daemon_log = work / "daemon.log"

    def set_faults(d: dict) -> None:
        tmp = work / "faults.tmp"
        tmp.write_text(json.dumps(d))
        os.replace(tmp, faults)

    with passthrough_mount(str(real), str(pt), faults=str(faults),
                           log_path=str(work / "passthrough.log")):
        m = Mount(pt, mnt, cache, "--revalidate", "0", "--source-timeout", "3",
                  "--scan-ahead", "0", "--min-free", "0", log=daemon_log)
        try:
            m.start()
            order = [c for _ in range(rounds) for c in cases]
            rnd.shuffle(order)
            for i, case in enumerate(order):
                name = names[i]
                p = real / "d" / name
                old = p.read_bytes()
                new = old
                hits.write_text("")
                result: dict = {}

                def reader(result=result, name=name) -> None:
                    try:
                        with open(mnt / "d" / name, "rb") as f:
                            result["data"] = f.read()
                    except OSError as e:
                        result["errno"] = errno.errorcode.get(e.errno or 0, "?")

                if case in ("eacces", "eio"):
                    set_faults({name: {"errno": errno.EACCES if case == "eacces" else errno.EIO}})
                    reader()
                elif case == "hang":
                    set_faults({name: {"hang": "open"}})
                    reader()  # ETIMEDOUT after --source-timeout; the fetch still hangs
                else:
                    set_faults({name: {"hang": "read2"}})
                    th = threading.Thread(target=reader)
                    th.start()
                    wait_until(lambda name=name: name in hits.read_text(), "no fetch hung", 60)
                    if case == "change":
                        new = bytes(b ^ 0x5A for b in old)
                        p.write_bytes(new)
                        os.utime(p, ns=(time.time_ns(), time.time_ns() + 2_000_000_000))
                    elif case == "truncate":
                        with open(p, "r+b") as f:
                            f.truncate(len(old) // 3)
                        new = old[: len(old) // 3]
                    elif case == "replace":
                        new = rnd.randbytes(len(old) + 1000)
                        tmp = p.with_suffix(".new")
                        tmp.write_bytes(new)
                        os.replace(tmp, p)
                    elif case == "remove":
                        p.unlink()
                        new = b""
                    set_faults({})
                    th.join(120)
                set_faults({})
                if "data" in result:
                    got = result["data"]
                    what = "old" if got == old else "new" if got == new else "MIXED"
                else:
                    what = result.get("errno", "none")
                outcomes[case][what] += 1
                if what == "MIXED":
                    out["mixed_reads"] += 1
                elif what not in ("old", "new") and what not in SOURCE_CASES[case]:
                    out["unexpected_errno"] += 1
                if not chaos.alive(m.pid):
                    out["daemon_down"] += 1
                    break
                # after the fault: the file reads as the source has it now
                if case in ("eacces", "eio", "hang", "change", "truncate", "replace"):
                    now = p.read_bytes()
                    t = chaos.ReadTally()
                    wait_until(lambda t=t, now=now, name=name:
                               t.read_one(mnt, f"d/{name}", now) == 0 or t.errors.total() > 20,
                               "the file did not read again after its fault", 60)
                    out["reads_after_fault_wrong"] += t.wrong
            out["daemon_up_at_end"] = int(chaos.alive(m.pid))
            out["source_fds_left"] = _source_fds_once_idle(m.pid, pt)
            m.umount()
        finally:
            set_faults({})
            m.cleanup()
    return {"scenario": "source", "rounds": rounds, **out,
            "outcomes": {c: dict(v) for c, v in outcomes.items()}, **_log_summary(daemon_log)}


# ----- 4. a full disk, a memory limit ---------------------------------------------------------


def disk_full(work: Path, seconds: float, seed: int = 0, threads: int = 4, n_files: int = 150,
              tmpfs_size: str = "3m", log: Log = _quiet) -> dict:
    """The cache on a small tmpfs that another process fills (to ENOSPC), holds full for a
    moment and empties again, over and over, while readers read: no reader sees an error
    or a wrong byte; the writer's failures are counted (``write_errors``)."""
    src, disk, mnt = work / "src", work / "tiny", work / "mnt"
    files = chaos.make_dataset(src, n_files, seed)
    disk.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={tmpfs_size}", "tmpfs", str(disk)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        return {"scenario": "diskfull", "skipped": f"cannot mount a tmpfs: {r.stderr.strip()}"}
    out: Counter = Counter()
    stop = threading.Event()
    rnd = random.Random(seed)

    def filler() -> None:
        while not stop.is_set():
            with contextlib.suppress(OSError), open(disk / "filler", "wb") as f:
                while not stop.is_set():
                    f.write(b"\0" * 65536)
                    f.flush()
            out["disk_filled"] += 1
            stop.wait(rnd.uniform(0.2, 1.0))
            with contextlib.suppress(OSError):
                os.unlink(disk / "filler")
            stop.wait(rnd.uniform(0.1, 0.5))

    m = Mount(src, mnt, disk / "cache", "--min-free", "0", "--chunk-size", "256K",
              "--flush-interval", "0.2", log=work / "daemon.log")
    st: dict = {}
    try:
        m.start()
        fill = threading.Thread(target=filler, daemon=True)
        fill.start()
        with chaos.ReaderThreads(mnt, files, threads, seed) as readers:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and chaos.alive(m.pid):
                time.sleep(0.5)
                drop_page_cache()
        stop.set()
        fill.join(30)
        st = m.stats()
        out["daemon_up_at_end"] = int(chaos.alive(m.pid))
        with contextlib.suppress(OSError):
            os.unlink(disk / "filler")
        m.umount()
    finally:
        stop.set()
        m.cleanup()
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)
    return {"scenario": "diskfull", "seconds": seconds, **out, "reads": readers.tally.as_dict(),
            "wrong_bytes_reads": readers.tally.wrong,
            "client_errors": sum(readers.tally.errors.values()),
            "write_errors": st.get("write_errors"), "cache_skipped": st.get("cache_skipped"),
            **_log_summary(work / "daemon.log")}


class _MemCgroup:
    """A new memory cgroup for one process: cgroup v2 (``memory.max``) where the unified
    hierarchy has the memory controller, else cgroup v1 (``memory.limit_in_bytes``) under
    this process's own memory group. :meth:`make` returns None and says why otherwise."""

    def __init__(self, path: Path, v2: bool, parent: Path) -> None:
        self.path, self.v2, self.parent = path, v2, parent
        self.version = 2 if v2 else 1

    @classmethod
    def make(cls) -> tuple[_MemCgroup | None, str]:
        name = f"dlcachefs-chaos-{os.getpid()}"
        for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
            ctl = root / "cgroup.controllers"
            if ctl.exists() and "memory" in ctl.read_text().split():
                try:
                    if "memory" not in (root / "cgroup.subtree_control").read_text().split():
                        (root / "cgroup.subtree_control").write_text("+memory")
                    (root / name).mkdir()
                    return cls(root / name, True, root), ""
                except OSError as e:
                    return None, f"cgroup v2 at {root}: cannot make a child group ({e})"
        v1 = Path("/sys/fs/cgroup/memory")
        if not (v1 / "memory.limit_in_bytes").exists():
            return None, "no cgroup v2 memory controller and no cgroup v1 memory hierarchy"
        own = next((line.split(":", 2)[2].strip() for line in
                    Path("/proc/self/cgroup").read_text().splitlines()
                    if line.split(":")[1] == "memory"), "/")
        parent = v1 / own.lstrip("/")
        try:
            (parent / name).mkdir()
        except OSError as e:
            return None, f"cgroup v1 memory at {parent}: cannot make a child group ({e})"
        return cls(parent / name, False, parent), ""

    def add(self, pid: int) -> int:
        """Move ``pid`` in; returns the group's memory use then (bytes)."""
        if not self.v2:  # v1 charges only new pages unless told to move the process's own
            with contextlib.suppress(OSError):
                (self.path / "memory.move_charge_at_immigrate").write_text("3")
        (self.path / "cgroup.procs").write_text(str(pid))
        return int((self.path / ("memory.current" if self.v2 else "memory.usage_in_bytes"))
                   .read_text())

    def limit(self, nbytes: int) -> None:
        (self.path / ("memory.max" if self.v2 else "memory.limit_in_bytes")).write_text(str(nbytes))

    def events(self) -> dict:
        if self.v2:
            ev = dict(line.split() for line in (self.path / "memory.events").read_text().splitlines())
            peak = self.path / "memory.peak"
            return {"oom_kills": int(ev.get("oom_kill", 0)), "limit_hits": int(ev.get("max", 0)),
                    "usage_peak": int(peak.read_text()) if peak.exists() else None}
        oc = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
        return {"oom_kills": int(oc.get("oom_kill", 0)),
                "limit_hits": int((self.path / "memory.failcnt").read_text()),
                "usage_peak": int((self.path / "memory.max_usage_in_bytes").read_text())}

    def remove(self) -> None:
        with contextlib.suppress(OSError):
            for pid in (self.path / "cgroup.procs").read_text().split():
                (self.parent / "cgroup.procs").write_text(pid)
        with contextlib.suppress(OSError):
            self.path.rmdir()


def memory_pressure(work: Path, seconds: float, seed: int = 0, threads: int = 4,
                    n_files: int = 600, headroom_mb: int = 24, memory: str = "64M",
                    log: Log = _quiet) -> dict:
    """The daemon started inside a memory cgroup (v2, else v1) whose limit is what a daemon
    is charged for at the start (measured by a first mount, outside the group) plus
    ``headroom_mb``, with a memory tier (``--memory``) larger than the headroom, while readers
    read a dataset bigger than the headroom. The daemon reads the limit at start and sizes
    its buffers to it (:mod:`dlcachefs.cache.memlimit`): no wrong byte, no client error, no
    OOM kill; the result says what the daemon chose (its stats) and the group's counters."""
    cg, why = _MemCgroup.make()
    if cg is None:
        return {"scenario": "memory", "skipped": why}
    src, cache, mnt = work / "src", work / "cache", work / "mnt"
    files = chaos.make_dataset(src, n_files, seed)
    opts = ("--memory", memory, "--min-free", "0")
    out: dict = {"scenario": "memory", "seconds": seconds, "memory_flag": memory,
                 "headroom_mb": headroom_mb}
    # the start-up charge, measured on a mount outside the group (same cache, same data)
    probe = Mount(src, mnt, cache, *opts, log=work / "daemon.log")
    try:
        probe.start()
        chaos.check_all(probe.mnt, files, chaos.ReadTally())  # the cache filled, as later
        base = (chaos.proc_sample(probe.pid) or {"rss": 0})["rss"]
        probe.umount()
    finally:
        probe.cleanup()
    limit = base + headroom_mb * (1 << 20)
    cg.limit(limit)
    # the daemon joins the group before it execs: it sees the limit from its first instruction
    procs = cg.path / "cgroup.procs"
    cli = ["sh", "-c", f'echo $$ > "{procs}" && exec "$@"', "sh", *DLCACHEFS]
    m = Mount(src, mnt, cache, *opts, log=work / "daemon.log", cli=cli)
    try:
        m.start()
        st = m.stats()
        out.update(cgroup_version=cg.version, rss_start=base, memory_limit=limit,
                   daemon_cgroup_limit=st.get("cgroup_memory_limit"),
                   memory_tier_limit=st["memory_limit_bytes"],
                   readahead_limit=st.get("readahead_limit_bytes"),
                   backlog_limit=st.get("backlog_limit_bytes"))
        peak = 0
        with chaos.ReaderThreads(mnt, files, threads, seed) as readers:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and chaos.alive(m.pid):
                time.sleep(0.5)
                s = chaos.proc_sample(m.pid)
                peak = max(peak, s["rss"] if s else 0)
                drop_page_cache()
        out.update(rss_peak=peak, **cg.events(), daemon_up_at_end=int(chaos.alive(m.pid)),
                   reads=readers.tally.as_dict(), wrong_bytes_reads=readers.tally.wrong,
                   client_errors=sum(readers.tally.errors.values()))
        if chaos.alive(m.pid):
            m.umount()
    finally:
        m.cleanup()
        cg.remove()
    return out


# ----- 5. soak ---------------------------------------------------------------------------------

_LOADER = r"""
import os, sys, json, time
import torch
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder
import dlcachefs.torch as dt
dt.install()
root, src_root, seconds, seed = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])

class Raw(ImageFolder):
    def __getitem__(self, i):
        path, _ = self.samples[i]
        with open(path, "rb") as f:
            return path, f.read()

ds = Raw(root)
g = torch.Generator(); g.manual_seed(seed)
dl = DataLoader(ds, batch_size=16, shuffle=True, generator=g, num_workers=2,
                collate_fn=lambda b: b)
ok = wrong = epochs = 0
end = time.monotonic() + seconds
base = os.path.dirname(root)
while time.monotonic() < end:
    for batch in dl:
        for path, data in batch:
            with open(os.path.join(src_root, os.path.relpath(path, base)), "rb") as f:
                if f.read() == data:
                    ok += 1
                else:
                    wrong += 1
        if time.monotonic() > end:
            break
    epochs += 1
print(json.dumps({"samples": ok, "epochs": epochs, "wrong": wrong}))
"""


def _source_fds_once_idle(pid: int, source: Path, wait_s: float = 60.0) -> int:
    """The daemon's descriptors into ``source`` once it is idle. It keeps the directories
    of recent fetches for a few seconds (O_PATH, ``dlcachefs.cache.source.DirDescriptors``):
    wait for the state where it holds nothing (bounded), then count what is left."""
    deadline = time.monotonic() + wait_s
    while chaos.fds_under(pid, str(source)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return len(chaos.fds_under(pid, str(source)))


def soak(work: Path, seconds: float, seed: int = 0, n_files: int = 400, loaders: int = 2,
         threads: int = 4, cats: int = 2, finds: int = 2, dus: int = 2,
         sample_every: float = 2.0, log: Log = _quiet) -> dict:
    """16 readers by default for ``seconds``: ``loaders`` DataLoaders (ImageFolder, 2
    workers each, announced by the torch hook, so orders are replayed and the next
    epoch's log laid out), ``threads`` reader threads checking bytes, ``cat``, ``find`` and
    ``du`` loops, over a cache of half the dataset (eviction all along). The daemon's RSS
    and open descriptors are sampled; after the readers stop and the writer settles, the
    daemon holds no descriptor of a source file and none of a deleted log."""
    src, cache, mnt = work / "src", work / "cache", work / "mnt"
    files = chaos.make_dataset(src, n_files, seed, classes=8)
    total = sum(map(len, files.values()))
    m = Mount(src, mnt, cache, "--cache-size", str(max(total // 2, 2 << 20)), "--chunk-size",
              "256K", "--memory", "8M", "--min-free", "0", log=work / "daemon.log")
    samples: list[dict] = []
    out: Counter = Counter()
    stop = threading.Event()
    procs: list[subprocess.Popen] = []
    shell_errors: Counter = Counter()
    try:
        m.start()
        t0 = time.monotonic()
        names = sorted(files)

        def shell_loop(kind: str, k: int) -> None:
            rnd = random.Random(seed * 100 + k)
            while not stop.is_set():
                if kind == "cat":
                    rel = rnd.choice(names)
                    r = subprocess.run(["cat", str(mnt / rel)], capture_output=True)
                    if r.returncode != 0:
                        shell_errors["cat"] += 1
                    elif r.stdout != files[rel]:
                        shell_errors["cat_wrong"] += 1
                    else:
                        out["cat_reads"] += 1
                elif kind == "find":
                    r = subprocess.run(["find", str(mnt), "-type", "f"], capture_output=True)
                    if r.returncode != 0 or r.stdout.count(b"\n") != len(files):
                        shell_errors["find"] += 1
                    out["find_runs"] += 1
                else:
                    r = subprocess.run(["du", "-s", "--apparent-size", "-B1", str(mnt)],
                                       capture_output=True, text=True)
                    if r.returncode != 0:
                        shell_errors["du"] += 1
                    out["du_runs"] += 1

        shells = [threading.Thread(target=shell_loop, args=(kind, i), daemon=True)
                  for i, kind in enumerate(["cat"] * cats + ["find"] * finds + ["du"] * dus)]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        for i in range(loaders):
            procs.append(subprocess.Popen(
                [sys.executable, "-c", _LOADER, str(mnt / "train"), str(src), str(seconds),
                 str(seed + i)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env=env, stdin=subprocess.DEVNULL))
        for s in shells:
            s.start()
        with chaos.ReaderThreads(mnt, files, threads, seed) as readers:
            while time.monotonic() - t0 < seconds and chaos.alive(m.pid):
                s = chaos.proc_sample(m.pid)
                if s:
                    samples.append({"t": round(time.monotonic() - t0, 1), **s})
                stop.wait(sample_every)
        stop.set()
        for s in shells:
            s.join(120)
        loader_res = []
        for p in procs:
            o, e = p.communicate(timeout=max(120.0, seconds))
            try:
                loader_res.append(json.loads(o.strip().splitlines()[-1]))
            except (ValueError, IndexError):
                loader_res.append({"failed": p.returncode, "stderr": e[-1500:]})
        m.wait_stats(lambda st: st["pending_bytes"] == 0, "the writer did not settle", 120)
        end = chaos.proc_sample(m.pid) or {}
        st = m.stats()
        out["daemon_up_at_end"] = int(chaos.alive(m.pid))
        out["source_fds_after_settle"] = _source_fds_once_idle(m.pid, src)
        out["deleted_fds_after_settle"] = end.get("deleted_fds", -1)
        out["chunks_evicted"] = st["chunks_evicted"]
        out["reorder_chunks"] = st["reorder_chunks"]
        m.umount()
    finally:
        stop.set()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)
        m.cleanup()
    rss = [s["rss"] for s in samples]
    fds = [s["fds"] for s in samples]
    q = max(1, len(samples) // 4)
    return {"scenario": "soak", "seconds": seconds,
            "readers": loaders * 3 + threads + cats + finds + dus, **out,
            "reads": readers.tally.as_dict(), "wrong_bytes_reads": readers.tally.wrong
            + sum(r.get("wrong", 0) for r in loader_res) + shell_errors["cat_wrong"],
            "client_errors": sum(readers.tally.errors.values()) + sum(shell_errors.values()),
            "shell_errors": dict(shell_errors), "loaders": loader_res,
            "rss_first_quarter_median": _median(rss[:q]), "rss_last_quarter_median":
            _median(rss[-q:]), "rss_max": max(rss, default=None),
            "fds_first_quarter_max": max(fds[:q], default=None),
            "fds_last_quarter_max": max(fds[-q:], default=None),
            "samples": samples, **_log_summary(work / "daemon.log")}


# ----- 6. fuzzing ------------------------------------------------------------------------------


def fuzz(work: Path, parser_writes: int, mount_writes: int, seed: int = 0,
         log: Log = _quiet) -> dict:
    """Generated control writes (:class:`chaos.ControlFuzzer`): ``parser_writes`` against the
    parser alone, ``mount_writes`` into a live mount's control file. 0 crashes; every
    refusal's reason in ``.dlcache/errors``; the daemon up and its stats readable."""
    t0 = time.monotonic()
    parser = chaos.fuzz_parser(parser_writes, seed)
    parser["seconds"] = round(time.monotonic() - t0, 1)
    src, cache, mnt = work / "src", work / "cache", work / "mnt"
    chaos.make_dataset(src, 100, seed)
    m = Mount(src, mnt, cache, log=work / "daemon.log")
    live: dict = {}
    try:
        m.start()
        t0 = time.monotonic()
        live = chaos.fuzz_mount(mnt, mount_writes, seed, dirs=("train", "train/cls1", "."))
        live["seconds"] = round(time.monotonic() - t0, 1)
        live["daemon_up_at_end"] = int(chaos.alive(m.pid))
        st = m.stats()
        live["stats_readable"] = int(isinstance(st.get("files"), int))
        m.umount()
    finally:
        m.cleanup()
    return {"scenario": "fuzz", "parser": parser, "mount": live, **_log_summary(work / "daemon.log")}


SCENARIOS = ("kill", "corrupt", "source", "diskfull", "memory", "soak", "fuzz")


def fresh(work: Path) -> Path:
    """An empty work directory (what a previous run left is removed)."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    return work
