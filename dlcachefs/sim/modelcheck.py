"""The simulator's check: a trace replayed through a real mount's core, counted alike.

:func:`dlcachefs.sim.simulate.run_policy` drives the policies with a model of the chunk
writer and the engine; its tables are worth what that model is worth. :func:`run_through_core`
replays a (small) trace through the real core instead: it writes the trace's samples as
files of their sizes into a source directory (one directory per class), builds the core
as a mount does (:func:`dlcachefs.session.build`: the registry's policy, the engine, the
control state; no kernel), reads every epoch's order through ``Engine.open``/``read``/
``release``, and returns the engine's counters as a
:class:`~dlcachefs.sim.simulate.Result`, to be compared with the simulator's.

Why a replay mode rather than a simulator built on sessions: the simulator is there to
sweep long traces over every policy and many cache sizes in seconds; a session costs
real files, a log append, an fdatasync and an LMDB commit per seal. So the simulator
keeps its model, and this mode checks the model on traces of a few hundred accesses
(``tests/test_t3_simulate.py``).

What is held equal, so that the counts can agree exactly:

* **units**: the engine packs records into chunks sealed on size or age; here every read
  is sealed before the next one starts (:meth:`Engine.flush`), so each sample is a unit
  of its own, as in the simulator with ``chunk_size=0``, and no read finds another one's
  record still waiting to be sealed;
* **sizes**: a chunk on disk is larger than its file (a chunk header, a record header
  and the file's path), and the engine charges those bytes to ``--cache-size``.
  :func:`unit_trace` is the trace with these sizes: given to the simulator, both charge
  the same bytes to the same capacity (checked after the replay: every chunk left in
  the index is exactly its one member's unit size);
* **nothing else reads**: nothing is announced (no stream: no prefetch, no read plans,
  no next-epoch logs) and scan-ahead is off, so the engine's reads are the trace's;
* **the policy**: the same class from the same registry, told the same events in the
  same order (request, hit, admission, insertion at the seal, victims for the room a
  new unit needs, removal).

So the counts agree exactly for decisions made from the cache's state alone: ``lru``,
and ``icache`` on a trace without losses (no importance known on either side: every
sample is an H-sample, admitted while the H-cache has room and refused after); the
tests hold both to equality. Not the others, by design of this mode: ``lcache``'s
release after use retires a unit that the engine drops at its writer's next seal (a
background task), so a re-read in between may still hit in the engine where the
simulator has removed it at once; ``reuse-distance`` and iCACHE with losses decide from
the future and the H-list, which the simulator knows from each epoch's first tick while
a mount learns orders from an announced stream (replayed in another process) and
rebuilds the H-list in a thread; that timing is not modelled here, and with nothing
announced the engine's policies see no future at all.
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path

from dlcachefs.config import Config
from dlcachefs.session import Session, build
from dlcachefs.sim.simulate import Result, Trace
from dlcachefs.store.chunkfmt import CHUNK_HEADER_SIZE, RECORD_HEADER_SIZE


class ReplayMismatch(Exception):
    """The engine did not do what the replay's comparison rests on."""


def sample_key(trace: Trace, i: int) -> bytes:
    """Path of sample ``i`` relative to the source root (the key of its record)."""
    return b"c%d/%07d" % (trace.classes[i], i)


def unit_trace(trace: Trace) -> Trace:
    """``trace`` with each sample's size as the engine stores it alone in a chunk:
    chunk header + record header + key + data. The simulator given this trace (with
    ``chunk_size=0``) charges the cache what the engine charges ``--cache-size``."""
    sizes = [CHUNK_HEADER_SIZE + RECORD_HEADER_SIZE + len(sample_key(trace, i)) + size
             for i, size in enumerate(trace.sizes)]
    return Trace(sizes, list(trace.classes), [list(e) for e in trace.epochs],
                 [dict(d) for d in trace.losses])


def write_source(trace: Trace, root: str | os.PathLike, seed: int = 0) -> list[bytes]:
    """Write sample ``i`` as ``root/c<class>/<i>``: ``trace.sizes[i]`` random bytes.
    Returns the samples' keys (their paths relative to ``root``)."""
    rng = random.Random(seed)
    rootb = os.fsencode(root)
    keys = [sample_key(trace, i) for i in range(trace.n)]
    for key, size in zip(keys, trace.sizes, strict=True):
        path = os.path.join(rootb, key)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(rng.randbytes(size))
    return keys


def session_config(source: str | os.PathLike, cache_dir: str | os.PathLike, spec: str,
                   capacity: int) -> Config:
    """A mount's config for the replay: ``--cache-size capacity``, the policy ``spec``,
    no scan-ahead, no next-epoch logs, no free-space floor, the smallest chunks, and
    seals only when asked (the replay flushes after every read)."""
    return Config(source=os.fspath(source), mountpoint="/nonexistent",
                  cache_dir=os.fspath(cache_dir), cache_size=capacity, chunk_size=4096,
                  memory=16 << 20, min_free=0, log_size=64 << 20, flush_interval=3600.0,
                  scan_ahead=0, reorder=False, policy=spec)


def run_through_core(trace: Trace, spec: str, capacity: int, workdir: str | os.PathLike
                ) -> Result:
    """Replay ``trace`` through a real session with ``--policy spec`` and a cache of
    ``capacity`` bytes, under ``workdir`` (its ``src`` and ``cache``, made here). Every
    byte read is checked against the file written; the counts are the engine's. Raises
    :class:`ReplayMismatch` when a read differs from the source or the engine did not
    store what :func:`unit_trace` assumes (then the counts compare nothing)."""
    work = Path(workdir)
    keys = write_source(trace, work / "src")
    expected = [os.path.join(os.fsencode(work / "src"), k) for k in keys]
    cfg = session_config(work / "src", work / "cache", spec, capacity)
    res = Result(spec, capacity)

    async def replay(sess: Session) -> None:
        eng = sess.engine
        inos = [eng.ns.resolve(k).ino for k in keys]
        for order in trace.epochs:
            for s in order:
                h = await eng.open(inos[s])
                try:
                    data = bytes(await eng.read(h.fh, 0, trace.sizes[s] + 1))
                finally:
                    eng.release(h.fh)
                with open(expected[s], "rb") as f:
                    if data != f.read():
                        raise ReplayMismatch(f"sample {s}: the bytes read differ from the "
                                             "source's")
                res.accesses += 1
                await eng.flush()  # one unit per sample (the module docstring)

    with build(cfg) as sess:
        sess.run(replay)
        eng = sess.engine
        c = eng.counters
        res.hits, res.misses, res.bytes_from_source = c.hits, c.misses, c.bytes_from_source
        res.policy_stats = sess.policy.stats()
        unit_sizes = unit_trace(trace).sizes
        sample_of = {eng.ns.resolve(k).ino: i for i, k in enumerate(keys)}
        for chunk in eng.index.iter_chunks():
            _check_unit(chunk.members, chunk.length, [unit_sizes[sample_of[m]]
                                                      for m in chunk.members])
    return res


def _check_unit(members: Sequence[int], length: int, unit_sizes: Sequence[int]) -> None:
    if len(members) != 1 or length != unit_sizes[0]:
        raise ReplayMismatch(f"a chunk of {length} bytes holds {len(members)} records (the "
                             f"replay assumes one record per chunk, of {list(unit_sizes)} "
                             "bytes)")
