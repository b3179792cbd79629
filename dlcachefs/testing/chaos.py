"""Faults on purpose, shared by ``tests/test_t7_chaos.py`` (short runs) and ``bench/chaos.py``
(long runs): a generator of control writes for fuzzing, damage to cache files, readers
that check every byte against the source, and samples of a daemon's memory and
descriptors.

Every reader here compares what the mount returned with the source's bytes: a read is
either exactly right, or an error (counted by errno), never silently wrong.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import random
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dlcachefs.clairvoyance import protocol as P

# ----- a source tree and what it holds ----------------------------------------------------


def make_dataset(root: Path, n_files: int, seed: int = 0, classes: int = 4,
                 sizes: tuple[int, ...] = (0, 1, 700, 4096, 20_000, 60_000, 150_000)
                 ) -> dict[str, bytes]:
    """An ImageFolder-shaped tree under ``root`` (``train/clsK/NNNNN.jpg``, random bytes):
    relative path -> content."""
    rnd = random.Random(seed)
    out: dict[str, bytes] = {}
    for i in range(n_files):
        rel = f"train/cls{i % classes}/{i:05d}.jpg"
        data = rnd.randbytes(rnd.choice(sizes))
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
        out[rel] = data
    return out


@dataclass
class ReadTally:
    """What readers saw: reads exact, reads with wrong bytes, errors by errno name."""

    ok: int = 0
    wrong: int = 0
    wrong_files: list[str] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def read_one(self, mnt: Path, rel: str, expected: bytes | tuple[bytes, ...]) -> int:
        """Read ``mnt/rel`` whole and count the outcome; returns the errno (0: read)."""
        try:
            with open(mnt / rel, "rb") as f:
                got = f.read()
        except OSError as e:
            with self._lock:
                self.errors[errno.errorcode.get(e.errno or 0, str(e.errno))] += 1
            return e.errno or -1
        good = got in expected if isinstance(expected, tuple) else got == expected
        with self._lock:
            if good:
                self.ok += 1
            else:
                self.wrong += 1
                if len(self.wrong_files) < 20:
                    self.wrong_files.append(rel)
        return 0

    def as_dict(self) -> dict:
        return {"reads_ok": self.ok, "wrong_reads": self.wrong,
                "wrong_files": self.wrong_files, "errors_by_errno": dict(self.errors)}


def check_all(mnt: Path, expected: dict[str, bytes], tally: ReadTally | None = None
              ) -> ReadTally:
    """Read every file of ``expected`` through the mount once."""
    tally = tally if tally is not None else ReadTally()
    for rel, data in expected.items():
        tally.read_one(mnt, rel, data)
    return tally


class ReaderThreads:
    """``n`` threads reading random files of ``expected`` through ``mnt`` until stopped,
    or until the mount stops answering (ENOTCONN: its daemon was killed)."""

    #: what a read returns once the daemon is gone
    GONE = (errno.ENOTCONN, errno.ECONNABORTED)

    def __init__(self, mnt: Path, expected: dict[str, bytes], n: int, seed: int = 0) -> None:
        self.mnt, self.expected, self.n = mnt, expected, n
        self.tally = ReadTally()
        self.gone = 0  # reads cut by the daemon's death (not errors of the mount)
        self._stop = threading.Event()
        self._names = sorted(expected)
        self._threads = [threading.Thread(target=self._run, args=(seed * 1000 + i,),
                                          daemon=True) for i in range(n)]

    def _run(self, seed: int) -> None:
        rnd = random.Random(seed)
        while not self._stop.is_set():
            rel = rnd.choice(self._names)
            try:
                with open(self.mnt / rel, "rb") as f:
                    got = f.read()
            except OSError as e:
                if e.errno in self.GONE:
                    with self.tally._lock:
                        self.gone += 1
                    return
                with self.tally._lock:
                    self.tally.errors[errno.errorcode.get(e.errno or 0, "?")] += 1
                continue
            with self.tally._lock:
                if got == self.expected[rel]:
                    self.tally.ok += 1
                else:
                    self.tally.wrong += 1
                    if len(self.tally.wrong_files) < 20:
                        self.tally.wrong_files.append(rel)

    def __enter__(self) -> ReaderThreads:
        for t in self._threads:
            t.start()
        return self

    def stop(self, timeout: float = 120.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout)

    def __exit__(self, *exc) -> None:
        self.stop()


# ----- damage to cache files ---------------------------------------------------------------

DAMAGE_KINDS = ("flip", "zero", "truncate")


# ----- readers in a training process, under `dlcachefs run` -------------------------------

#: a training process's reads under the launcher: every open of a cached file is served in
#: the process (dlcachefs.data.intercept). ``once``: every file once; ``loop``: random files
#: with two threads until a line comes on stdin. Prints what it saw as JSON.
_IN_PROCESS = r"""
import errno, hashlib, json, os, random, sys, threading
root, mode, seed = sys.argv[1], sys.argv[2], int(sys.argv[4])
expected = json.load(open(sys.argv[3]))
out = {"ok": 0, "wrong": 0, "wrong_files": [], "errors": {}, "in_process": 0}
lock = threading.Lock()
def read(rel):
    try:
        with open(os.path.join(root, rel), "rb") as f:
            inproc = type(f).__name__ == "CachedFile"
            d = f.read()
    except OSError as e:
        with lock:
            name = errno.errorcode.get(e.errno or 0, str(e.errno))
            out["errors"][name] = out["errors"].get(name, 0) + 1
        return
    with lock:
        if hashlib.sha256(d).hexdigest() == expected[rel]:
            out["ok"] += 1
            out["in_process"] += inproc
        else:
            out["wrong"] += 1
            out["wrong_files"] = (out["wrong_files"] + [rel])[:10]
if mode == "once":
    for rel in expected:
        read(rel)
else:
    stop = threading.Event()
    def loop(k):
        rnd, rels = random.Random(seed + k), list(expected)
        while not stop.is_set():
            read(rnd.choice(rels))
    ts = [threading.Thread(target=loop, args=(k,), daemon=True) for k in range(2)]
    for t in ts:
        t.start()
    print("ready", flush=True)
    sys.stdin.readline()
    stop.set()
    for t in ts:
        t.join()
print(json.dumps(out), flush=True)
"""


def _digests(expected: dict[str, bytes], work: Path) -> Path:
    path = work / "in_process_expected.json"
    if not path.exists():
        path.write_text(json.dumps({rel: hashlib.sha256(d).hexdigest()
                                    for rel, d in expected.items()}))
    return path


def _in_process_cmd(mnt: Path, mode: str, digests: Path, seed: int) -> list[str]:
    return [sys.executable, "-m", "dlcachefs.cli", "run", "--", sys.executable, "-c",
            _IN_PROCESS, str(mnt), mode, str(digests), str(seed)]


def _in_process_result(rc: int, stdout: str, stderr: str) -> dict:
    """What a reader process reported, with ``killed``: it died of a signal (a training
    killed by the cache: never allowed)."""
    lines = [x for x in stdout.splitlines() if x.startswith("{")]
    got = json.loads(lines[-1]) if lines else {"ok": 0, "wrong": 0, "errors": {},
                                                   "in_process": 0}
    got["killed"] = int(rc < 0)
    got["failed"] = int(rc != 0)
    if rc != 0:
        got["stderr"] = stderr[-500:]
    return got


def check_in_process(mnt: Path, expected: dict[str, bytes], work: Path, seed: int = 0
                     ) -> dict:
    """Every file of ``expected`` read once by a training process under ``dlcachefs
    run`` (its opens of cached files served in the process): ``ok``, ``wrong``,
    ``errors`` by errno, ``in_process`` (reads served in the process), ``killed``."""
    r = subprocess.run(_in_process_cmd(mnt, "once", _digests(expected, work), seed),
                       capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    return _in_process_result(r.returncode, r.stdout, r.stderr)


class InProcessReader:
    """A training process under ``dlcachefs run`` reading random files with two threads
    until :meth:`stop` (a context manager: started on enter): its result, as
    :func:`check_in_process`'s."""

    def __init__(self, mnt: Path, expected: dict[str, bytes], work: Path, seed: int = 0):
        self.cmd = _in_process_cmd(mnt, "loop", _digests(expected, work), seed)
        self.proc: subprocess.Popen | None = None
        self.result: dict | None = None

    def __enter__(self) -> InProcessReader:
        self.proc = subprocess.Popen(self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.proc.stdout.readline()  # "ready" (or nothing: it failed, reported by stop)
        return self

    def stop(self) -> dict:
        if self.result is None:
            assert self.proc is not None
            try:
                out, err = self.proc.communicate("\n", timeout=300)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                out, err = self.proc.communicate()
            self.result = _in_process_result(self.proc.returncode, out, err)
        return self.result

    def __exit__(self, *exc) -> None:
        self.stop()


def add_in_process(into: Counter, got: dict, prefix: str = "in_process") -> None:
    """Fold a reader process's result into a scenario's counts."""
    into[f"{prefix}_reads_ok"] += got["ok"]
    into[f"{prefix}_served_in_process"] += got["in_process"]
    into[f"{prefix}_wrong"] += got["wrong"]
    into[f"{prefix}_errors"] += sum(got["errors"].values())
    into["trainings_killed"] += got["killed"]
    into[f"{prefix}_failed"] += got["failed"]


def damage_file(path: Path, kind: str, rnd: random.Random, lo: int = 0,
                hi: int | None = None) -> str:
    """Damage ``path`` between offsets ``lo`` and ``hi`` (default: the whole file):
    ``flip`` one random bit, ``zero`` a range of 1 byte to 64 KiB, ``truncate`` at a
    random offset. Returns a description of what was done."""
    size = path.stat().st_size
    hi = size if hi is None else min(hi, size)
    if hi <= lo:
        return f"{kind} {path.name}: nothing in range"
    pos = rnd.randrange(lo, hi)
    with open(path, "r+b") as f:
        if kind == "flip":
            f.seek(pos)
            b = f.read(1)
            f.seek(pos)
            f.write(bytes([b[0] ^ (1 << rnd.randrange(8))]))
            what = f"flip a bit at {pos}"
        elif kind == "zero":
            n = min(rnd.randrange(1, 65536), hi - pos)
            f.seek(pos)
            f.write(bytes(n))
            what = f"zero {n} bytes at {pos}"
        elif kind == "truncate":
            f.truncate(pos)
            what = f"truncate at {pos}"
        else:
            raise ValueError(kind)
        f.flush()
        os.fsync(f.fileno())
    return f"{path.name}: {what}"


def committed_records(index_dir: str) -> dict[int, tuple[int, int, int]]:
    """inode -> (chunk, offset, checksum) of every record indexed in ``index_dir``,
    read-only (a daemon may hold the index: LMDB readers never block it)."""
    import lmdb  # noqa: PLC0415

    from dlcachefs.store.schema import DB_RECORD, Record, unkey  # noqa: PLC0415

    env = lmdb.open(index_dir, readonly=True, max_dbs=8, subdir=True, readahead=False)
    try:
        db = env.open_db(DB_RECORD, create=False)
        with env.begin(db=db) as txn:
            return {unkey(k): (r.chunk_id, r.offset, r.data_xxh)
                    for k, v in txn.cursor() for r in (Record.unpack(v),)}
    finally:
        env.close()


# ----- a daemon from outside -------------------------------------------------------------


def proc_sample(pid: int) -> dict | None:
    """RSS (bytes), open descriptors, threads of process ``pid``, and which of its
    descriptors point at deleted files (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    if "VmRSS" not in status:  # a zombie
        return None
    deleted = 0
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").endswith(" (deleted)"):
                deleted += 1
    return {"rss": int(status["VmRSS"].split()[0]) * 1024, "fds": len(fds),
            "threads": int(status["Threads"]), "deleted_fds": deleted}


def fds_under(pid: int, root: str) -> list[str]:
    """The open descriptors of ``pid`` that point under ``root`` (e.g. source files)."""
    out = []
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith(root.rstrip("/") + "/"):
                    out.append(target)
    return out


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][:1] not in ("Z", "X")
    except OSError:
        return False


# ----- control writes for fuzzing ------------------------------------------------------------


class ControlFuzzer:
    """Generated control writes: well-formed lines from the protocol's own encoder, the
    same lines mutated (tokens dropped, doubled, swapped, replaced by extreme numbers,
    odd characters or overlong text, bytes flipped), and raw bytes. ``dirs`` are dataset
    paths that exist in the mount (relative, '/'-separated)."""

    EXTREMES = ("-1", "0", "1", "18446744073709551616", "9" * 30, "nan", "inf", "-inf",
                "1e308", "-0", "0x10", "1_000", "", "=", "==", "%", "%zz", "%00", "..",
                "/", "a" * 5000, "\u00e9", "\ud7ff", "\t", "\r", "#")

    def __init__(self, seed: int, dirs: list[str], n_samples: int = 100) -> None:
        self.rnd = random.Random(seed)
        self.dirs = dirs or ["."]
        self.n = n_samples

    def valid_line(self) -> str:
        r = self.rnd
        k = r.randrange(12)
        if k == 0:
            return P.job_line(r.choice(["a", "job-1", "default", "x.y_z"]))
        if k == 1:
            return P.dataset_line(r.choice(self.dirs))
        if k == 2:
            return P.sampler_line("random", seed=r.randrange(1 << 32),
                                  num_samples=r.randrange(1, 2 * self.n))
        if k == 3:
            w = r.randrange(1, 5)
            return P.sampler_line("distributed", seed=r.randrange(100), world=w,
                                  rank=r.randrange(w))
        if k == 4:
            return P.sampler_line(r.choice(["sequential", "explicit"]))
        if k == 5:
            return P.epoch_line(r.randrange(10))
        if k == 6:
            return P.batch_line(r.randrange(1, 512), r.randrange(0, 9), r.randrange(1, 5))
        if k == 7:
            pairs = [(r.randrange(self.n), r.random() * 10) for _ in range(r.randrange(1, 20))]
            return "loss " + " ".join(f"{i} {v:.6g}" for i, v in pairs)
        if k == 8:
            e = r.randrange(3)
            idx = [r.randrange(self.n) for _ in range(r.randrange(0, 20))]
            return f"order {e} 0 " + " ".join(map(str, idx)) if r.random() < 0.7 \
                else f"order {e} end {r.randrange(0, 20)}"
        if k == 9:
            idx = [r.randrange(self.n) for _ in range(r.randrange(0, 10))]
            lid = P.index_list_id(idx)
            return f"index {lid} 0 " + " ".join(map(str, idx)) + f"\nindex {lid} end {len(idx)}"
        if k == 10:
            return f"sampler unknown reason={r.choice(['x', 'custom%20one', ''])}"
        return "# a comment"

    def mutate(self, line: str) -> str:
        r = self.rnd
        toks = line.split(" ")
        k = r.randrange(8)
        if k == 0 and len(toks) > 1:
            del toks[r.randrange(len(toks))]
        elif k == 1:
            i = r.randrange(len(toks))
            toks.insert(i, toks[i])
        elif k == 2:
            toks[r.randrange(len(toks))] = r.choice(self.EXTREMES)
        elif k == 3 and len(toks) > 1:
            i, j = r.randrange(len(toks)), r.randrange(len(toks))
            toks[i], toks[j] = toks[j], toks[i]
        elif k == 4:
            i = r.randrange(len(toks))
            key, eq, _ = toks[i].partition("=")
            toks[i] = f"{key}={r.choice(self.EXTREMES)}" if eq else toks[i] + "=1"
        elif k == 5:
            return line[: r.randrange(len(line) + 1)]
        elif k == 6:
            return line + " " + r.choice(self.EXTREMES)
        else:
            return r.choice(["frob", "JOB", "loss", "order", "index", "root", "view",
                             "dataset", "sampler"]) + " " + " ".join(toks[1:])
        return " ".join(toks)

    def write(self) -> bytes:
        """One generated write (bytes, at most a bit over the protocol's write limit)."""
        r = self.rnd
        k = r.random()
        if k < 0.1:
            return r.randbytes(r.randrange(1, 300))
        lines = []
        for _ in range(r.randrange(1, 6)):
            line = self.valid_line()
            if r.random() < 0.6:
                line = self.mutate(line)
            lines.append(line)
        data = "\n".join(lines).encode("utf-8", "surrogatepass")
        if k > 0.97:
            data = data * (P.MAX_WRITE // max(len(data), 1) + 1)  # over the write limit
        elif k > 0.9 and data:
            b = bytearray(data)
            b[r.randrange(len(b))] ^= 1 << r.randrange(8)
            data = bytes(b)
        return data


def fuzz_parser(n: int, seed: int = 0, dirs: tuple[str, ...] = ("train", "train/cls0", "."),
                n_samples: int = 100) -> dict:
    """``n`` generated writes applied to a :class:`ControlState` (no mount): accepted,
    refused, crashes (any exception but ControlError), refusals whose reason is not the
    last line of the error log, refusals that changed the state."""
    from dlcachefs.clairvoyance.control import ControlState  # noqa: PLC0415
    from dlcachefs.errors import ControlError, NotFound  # noqa: PLC0415

    inos = {d if d != "." else "": 100 + i for i, d in enumerate(dirs)}

    def resolve_dir(rel: str) -> int:
        if rel in inos:
            return inos[rel]
        raise NotFound(rel)

    cs = ControlState(resolve_dir, lambda *a: None, dataset_size=lambda rel: n_samples,
                      on_loss=lambda *a: None, on_order=lambda *a: None,
                      loss_room=lambda: 1 << 20)
    fz = ControlFuzzer(seed, list(dirs), n_samples)
    out = Counter()
    crashes: list[str] = []
    for _ in range(n):
        data = fz.write()
        pid = fz.rnd.randrange(1, 6)
        before = _control_snapshot(cs)
        try:
            cs.apply(data, pid)
            out["accepted"] += 1
        except ControlError as e:
            out["refused"] += 1
            last = cs.errors.lines[-1] if cs.errors else ""
            if not str(e) or str(e) not in last or f"pid={pid}" not in last:
                out["refused_without_reason"] += 1
            if _control_snapshot(cs) != before:
                out["refused_but_changed_state"] += 1
        except Exception as e:  # noqa: BLE001 - what the fuzzing is looking for
            out["crashes"] += 1
            if len(crashes) < 10:
                crashes.append(f"{type(e).__name__}: {e} <- {data[:200]!r}")
    return {"writes": n, "accepted": out["accepted"], "refused": out["refused"],
            "crashes": out["crashes"], "crash_examples": crashes,
            "refused_without_reason": out["refused_without_reason"],
            "refused_but_changed_state": out["refused_but_changed_state"]}


def _control_snapshot(cs) -> tuple:
    """What a refused write must leave as it was (cheap enough to take per write)."""
    return (cs.accepted_writes, cs.order_indices, cs.list_indices, len(cs.views),
            len(cs.index_lists), tuple(cs._pid_job.items()),
            tuple((n, j.dataset, j.losses, j.view) for n, j in cs.jobs.items()),
            tuple((k, s.sampler, s.epoch, s.batch, s.workers) for k, s in cs.streams.items()))


def fuzz_mount(mnt: Path, n: int, seed: int = 0, dirs: tuple[str, ...] = ("train", "."),
               n_samples: int = 100, check_reason: Callable[[int], bool] | None = None
               ) -> dict:
    """``n`` generated writes into ``mnt/.dlcache/control``, each its own ``write()``;
    each refusal (EINVAL) must put a new line naming this process in ``.dlcache/errors``.
    Counts accepted, refused, other errnos, refusals without their reason."""
    ctl = mnt / ".dlcache" / "control"
    errs = mnt / ".dlcache" / "errors"
    fz = ControlFuzzer(seed, list(dirs), n_samples)
    out: Counter = Counter()
    other: Counter = Counter()
    me = f"pid={os.getpid()}"
    for _ in range(n):
        data = fz.write()
        fd = os.open(ctl, os.O_WRONLY)
        try:
            os.write(fd, data)
            out["accepted"] += 1
        except OSError as e:
            if e.errno == errno.EINVAL:
                out["refused"] += 1
                after = errs.read_bytes().splitlines()
                # the refusal's line is at the end, give or take a "dropped:" note of an
                # earlier accepted write landing next to it. (Comparing with ``before`` is
                # no test: the list is bounded, so a full list of 100 identical refusals
                # in one second is the same list after one more.)
                if not any(me.encode() in x and b"refused: " in x
                           and x.split(b"refused: ", 1)[1].strip() for x in after[-3:]):
                    out["refused_without_reason"] += 1
            else:
                other[errno.errorcode.get(e.errno or 0, "?")] += 1
        finally:
            os.close(fd)
    return {"writes": n, "accepted": out["accepted"], "refused": out["refused"],
            "refused_without_reason": out["refused_without_reason"],
            "other_errors": dict(other)}
