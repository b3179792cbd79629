"""Which stream an open belongs to, by process.

A stream's processes are the ones that wrote its control lines and their descendants
(DataLoader workers), found through ``/proc/<pid>/stat`` parents; FUSE reports the
calling thread, mapped to its process (``Tgid``). An open by a process tree that
announced nothing is counted in a bounded ``unannounced/PGID`` entry per process group
(a training and its loader workers share one), with the reason read from its
environment.

Concurrency: trio loop; the ``/proc`` reads are a few small files per new reader pid
(answers are kept, at most 4096 pids).
"""

from __future__ import annotations

from collections import OrderedDict

from dlcachefs.clairvoyance.protocol import ENV_LAUNCHED
from dlcachefs.clairvoyance.stream import Stream, StreamTable

MAX_UNANNOUNCED = 8  # stats entries for processes that read without announcing
NOTHING_ANNOUNCED = ("nothing announced: run the script under `dlcachefs run` or call "
                     "dlcachefs.torch.install()")
HOOKED_SILENT = ("nothing announced although the torch hook is installed (`dlcachefs run`): "
                 "no DataLoader iterated over a dataset on this mount (samples read as "
                 "dataset[i] without a DataLoader are not seen by the hook), or the hook "
                 "could not map it (its warnings on the training's stderr say why)")
HOOK_LOST = ("nothing announced: started by `dlcachefs run`, but PYTHONPATH was replaced on "
             "the way (a wrapper script that sets PYTHONPATH=...), so the torch hook is not "
             "loaded: extend it instead (export PYTHONPATH=...:$PYTHONPATH), or call "
             "dlcachefs.torch.install()")


class Attribution:
    """Reader pid -> its stream (or its process group's ``unannounced`` entry)."""

    def __init__(self, streams: StreamTable) -> None:
        self.streams = streams
        self._pid_stream: OrderedDict[int, Stream | None] = OrderedDict()
        self.unannounced: OrderedDict[int, dict] = OrderedDict()  # pgid -> stats entry
        self._pid_group: OrderedDict[int, int] = OrderedDict()  # reader pid -> pgid

    def announced(self, pid: int) -> None:
        """``pid`` announced a stream (it was added to the stream's ``pids``): the pids
        seen so far may belong elsewhere now, and its process group is announced."""
        self._pid_stream.clear()
        if self.unannounced:
            pg = _pgid(_tgid(pid))
            if pg is not None:
                self.unannounced.pop(pg, None)

    def forget(self) -> None:
        """Streams ended: attribution is found anew."""
        self._pid_stream.clear()

    def stream_of(self, pid: int) -> Stream | None:
        """The stream an open by ``pid`` belongs to (None: counted as unannounced)."""
        found = self._stream_of(pid)
        if found is None:
            self._unannounced_open(pid)
        return found

    def group_of(self, pid: int) -> str | None:
        """The ``unannounced/PGID`` key of a reader seen by :meth:`stream_of`."""
        pg = self._pid_group.get(pid)
        return None if pg is None else f"unannounced/{pg}"

    def stats(self) -> dict:
        """The ``unannounced/PGID`` entries."""
        return {f"unannounced/{pg}": dict(e) for pg, e in self.unannounced.items()}

    def _unannounced_open(self, pid: int) -> None:
        """An open by a process tree that announced nothing: a bounded ``none`` entry per
        process group (a training and its loader workers share one)."""
        pg = self._pid_group.get(pid)
        tgid = 0
        if pg is None:
            tgid = _tgid(pid)
            pg = _pgid(tgid)
            if pg is None:
                # gone: the late events of reads served in a process that ended since (a
                # loader worker at the end of its epoch), whose stream, if any, its job
                # and rank name; not a reader that announced nothing
                return
            self._pid_group[pid] = pg
            while len(self._pid_group) > 4096:
                self._pid_group.popitem(last=False)
        e = self.unannounced.get(pg)
        if e is None:
            tgid = tgid or _tgid(pid)
            e = {"mode": "none", "opens": 0, "command": _comm(tgid),
                 "reason": _unannounced_reason(tgid)}
            self.unannounced[pg] = e
            while len(self.unannounced) > MAX_UNANNOUNCED:
                self.unannounced.popitem(last=False)
        e["opens"] += 1

    def _stream_of(self, pid: int) -> Stream | None:
        if not self.streams:
            return None
        if pid in self._pid_stream:
            return self._pid_stream[pid]
        owners = {p: s for s in self.streams.values() for p in s.pids}
        found, cur = None, _tgid(pid)
        for _ in range(16):  # the writer itself, or an ancestor of the reader
            if cur in owners:
                found = owners[cur]
                break
            cur = _parent(cur)
            if cur <= 1:
                break
        self._pid_stream[pid] = found
        while len(self._pid_stream) > 4096:
            self._pid_stream.popitem(last=False)
        return found


def _tgid(tid: int) -> int:
    """FUSE reports the calling thread's id: map it to its process."""
    try:
        with open(f"/proc/{tid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return tid


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return 0
    # the command name may contain spaces and parentheses: split after the last ')'
    return int(data[data.rindex(b")") + 2 :].split()[1])


def _pgid(pid: int) -> int | None:
    """The process group of ``pid``: None when the process is gone, itself when its
    ``stat`` cannot be read otherwise."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2 :].split()[2])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, IndexError):
        return pid


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().decode(errors="replace").strip()
    except OSError:
        return ""


def _unannounced_reason(pid: int) -> str:
    """Why a process that reads announced nothing, from its environment: the launcher's
    hook on its PYTHONPATH (then no DataLoader was seen), the launcher's mark without the
    hook (a wrapper replaced PYTHONPATH), or neither (not launched)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return NOTHING_ANNOUNCED
    hooked = launched = False
    for var in env.split(b"\0"):
        if var.startswith(b"PYTHONPATH="):
            hooked = b"dlcachefs/data/_boot" in var
        elif var.startswith(ENV_LAUNCHED.encode() + b"="):
            launched = True
    if hooked:
        return HOOKED_SILENT
    return HOOK_LOST if launched else NOTHING_ANNOUNCED
