"""Tier 3: a mount's core as :func:`dlcachefs.session.build` makes it, driven by a training
without FUSE, over every registered policy: control -> streams -> engine.

The training side is real: torch's ``DistributedSampler`` patched by the torch hook
(:mod:`dlcachefs.data.hook`) announces each epoch when it is iterated, and
``LossReporter`` reports losses, over a torchvision ``ImageFolder``. They write to a
directory standing in for the mount (its ``.dlcache/control``, and the dataset as a
symlink to the source's, so the client lists the names the mount shows); each
``os.write`` to that control file goes to :meth:`Session.write`, as the FUSE layer hands
it over (a refusal is EINVAL). The reads go through the engine in the order the sampler
yielded, by the process that announced (the test's own), as a loader worker's would.
"""

from __future__ import annotations

import errno
import os
import random
import time
from pathlib import Path

import pytest
import trio

from dlcachefs.errors import ControlError
from dlcachefs.session import Session, build, policies
from dlcachefs.store import schema as S
from dlcachefs.testing.fakes import CountingSource, make_config, write_tree

folder = pytest.importorskip("torchvision.datasets.folder")
torch_data = pytest.importorskip("torch.utils.data")

import dlcachefs.data.hook as hook  # noqa: E402 - after torch, as a training imports it

POLICIES = sorted(policies())
SEED = 7
WAIT = 120  # seconds: a safety net; the first replay waits for the worker's torch import


def dataset(seed: int = 5) -> dict[bytes, bytes]:
    """An ImageFolder tree under ``train``: 3 classes of 10 images (500 B .. 6 KB)."""
    rng = random.Random(seed)
    return {b"train/c%d/%02d.jpg" % (c, i): rng.randbytes(rng.randrange(500, 6000))
            for c in range(3) for i in range(10)}


class Client:
    """The training process's side of a mount: the stand-in directory, torch's samplers
    patched by the hook (restored afterwards), and the control writes handed to
    :attr:`session` (set by the test once it is built)."""

    def __init__(self, root: Path, src: Path, monkeypatch) -> None:
        self.root = root
        (root / ".dlcache").mkdir(parents=True)
        control = root / ".dlcache" / "control"
        control.write_bytes(b"")
        (root / "train").symlink_to(src / "train", target_is_directory=True)
        self.session: Session | None = None
        self.writes: list[bytes] = []
        self.refused: list[str] = []
        st = os.stat(control)
        ctl = (st.st_dev, st.st_ino)
        real_write = os.write

        def write(fd: int, data) -> int:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != ctl:
                return real_write(fd, data)
            data = bytes(data)
            self.writes.append(data)
            assert self.session is not None
            try:
                return self.session.write(data, os.getpid())
            except ControlError as e:
                self.refused.append(str(e))
                raise OSError(errno.EINVAL, os.strerror(errno.EINVAL)) from None

        monkeypatch.setattr(os, "write", write)
        # the hook's per-process memory starts empty: nothing sent, claimed or warned yet
        monkeypatch.setattr(hook, "_sent", set())
        monkeypatch.setattr(hook, "_claims", {})
        monkeypatch.setattr(hook, "_warned", set())
        monkeypatch.setattr(hook, "_targets", {})
        monkeypatch.delenv(hook.ENV_JOB, raising=False)
        hook.find_mount.cache_clear()

    def image_folder(self):
        return folder.ImageFolder(str(self.root / "train"), loader=lambda p: p)


@pytest.fixture
def client(tmp_path, monkeypatch):
    """(Client, source dir, files); torch.utils.data is patched by the hook meanwhile."""
    src = tmp_path / "src"
    files = dataset()
    write_tree(src, files)
    classes = (torch_data.RandomSampler, torch_data.DistributedSampler,
               torch_data.SubsetRandomSampler, torch_data.DataLoader)
    saved = {c: c.__dict__["__iter__"] for c in classes}
    c = Client(tmp_path / "client", src, monkeypatch)
    hook._patch(torch_data)
    try:
        yield c, src, files
    finally:
        for cls, it in saved.items():
            cls.__iter__ = it
        if "_dlcachefs_patched" in torch_data.RandomSampler.__dict__:
            del torch_data.RandomSampler._dlcachefs_patched
        hook.find_mount.cache_clear()


async def poll(check, what: str):
    """``check()``'s first true value, polled until the safety deadline."""
    with trio.fail_after(WAIT):
        while not (out := check()):
            await trio.sleep(0.01)
    assert out, what
    return out


async def announced(sess, epoch: int):
    """The stream of the test's job once epoch ``epoch``'s order is known."""
    def ready():
        s = sess.streams.streams.get(("default", 0))
        return s if s is not None and s.epoch == epoch and s.order else None

    return await poll(ready, f"epoch {epoch} announced")


async def read_file(eng, ino: int) -> bytes:
    """open + read to EOF + release, by the announcing process (the stream's reader)."""
    h = await eng.open(ino, os.getpid())
    try:
        out = bytearray()
        while piece := await eng.read(h.fh, len(out), 1 << 20):
            out += piece
        return bytes(out)
    finally:
        eng.release(h.fh)


def losses_of(order: list[int], epoch: int) -> list[float]:
    rng = random.Random(epoch)
    return [rng.uniform(0.01, 5.0) for _ in order]


@pytest.mark.parametrize("policy", POLICIES)
def test_announced_epochs_through_the_session(client, tmp_path, policy):
    """The dataset fits: epoch 0 is fetched ahead of the reader (each file once), the next
    epoch's order reaches the policy's future and its log is laid out, so epochs 1 and 2
    never touch the source; every byte is the source's; losses land in the importance
    table the policy reads."""
    c, src, files = client
    source = CountingSource(src)
    n = len(files)
    # reorder_min=0: the 100 KB dataset fits in memory, where no next log would be laid out
    cfg = make_config(src, tmp_path / "cache", policy=policy, chunk_size=16 << 10,
                      reorder_min=0)

    async def body(sess: Session):
        eng = sess.engine
        # the wiring: cfg.policy's registered class decides from the engine's views, and
        # the control state is the engine's
        assert type(sess.policy) is policies()[policy]
        assert sess.policy is eng.policy and sess.losses.errors is sess.control.errors
        assert sess.policy.ctx.future is sess.future
        assert sess.policy.ctx.importance is sess.importance
        ds = c.image_folder()
        by_index = {i: os.fsencode(os.path.relpath(p, c.root)) for i, (p, _) in
                    enumerate(ds.samples)}
        sampler = torch_data.DistributedSampler(ds, num_replicas=1, rank=0, seed=SEED)
        reporter = hook.LossReporter(ds)
        planned_next: list[int] | None = None
        for epoch in range(3):
            sampler.set_epoch(epoch)
            order = list(sampler)  # the hook announces the epoch as it starts
            assert c.refused == []
            s = await announced(sess, epoch)
            assert s.mode == "replayed", s.reason
            assert s.order == order  # the replayed order is the sampler's
            if planned_next is not None:
                assert order == planned_next  # what the future told the policy came true
            # the next epoch's order is known to the policy's future (a seeded sampler)
            planned_next = list(s.next_first_order)
            assert len(planned_next) == n
            inos = {i: eng.ns.resolve(by_index[i]).ino for i in order}
            before = sess.stats()
            if epoch == 0:
                # prefetch: every sample of the epoch fetched ahead of the reader
                await poll(lambda s=s: all(s.ready), "epoch 0 prefetched")
                assert s.prefetched == n
                assert sum(source.reads.values()) == n
            else:
                assert s.current_log is not None and s.current_log.epoch == epoch
            for i in order:
                assert await read_file(eng, inos[i]) == files[by_index[i]], by_index[i]
            after = sess.stats()
            assert max(source.reads.values()) == 1  # no file ever fetched twice
            if epoch > 0:  # the cache serves the epoch, from the log laid out for it
                assert after["bytes_from_source"] == before["bytes_from_source"]
                assert after["misses"] == before["misses"]
                assert after["hits"] - before["hits"] == n
            assert s.position == n  # every open was attributed to the stream
            # the next epoch's log (LCache): complete before that epoch begins
            nl = await poll(lambda s=s, e=epoch: s.next_log is not None
                            and s.next_log.epoch == e + 1 and s.next_log, "next log")
            await poll(lambda nl=nl: nl.sealed == len(nl.chunks), "next log sealed")
            assert nl.failed == 0
            # losses, as the training reports them (dataset indices of the ImageFolder)
            values = losses_of(order, epoch)
            reporter.report(order, values)
            reporter.flush()
            assert reporter.sent_pairs == n * (epoch + 1) and reporter.dropped_pairs == 0
            assert c.refused == []
            table = sess.importance.table
            assert table is not None and table.jobs["default"].reported == n * (epoch + 1)
            assert list(table.jobs["default"].iv) == pytest.approx(
                [dict(zip(order, values, strict=True))[i] for i in range(n)], rel=1e-8)
            assert eng.counters.losses_ignored == 0
            assert eng.check_invariants() == []
            if epoch > 0:  # the H-list was rebuilt from the losses as this epoch began
                await poll(lambda e=epoch: sess.policy.ctx.importance.version() >= e,
                           "H-list rebuilt")
        assert eng.counters.reorder_chunks > 0
        assert sum(source.reads.values()) == n  # the whole run read the source once

    with build(cfg, source) as sess:
        c.session = sess
        sess.run(body)
        assert sess.engine.check_invariants() == []
        assert sess.engine.counters.invariant_violations == 0


def test_an_epoch_announced_again_is_a_repeat_only_once_it_was_read_through(client,
                                                                             tmp_path):
    """A DistributedSampler iterated again without set_epoch: announced again part way
    (a peek at one batch, a restart), its epoch restarts and its next epoch's log is laid
    out again; announced again once the epoch was read to its end, the order repeats: the
    next epoch is taken to repeat it, no log is laid out in a guessed order."""
    c, src, files = client
    cfg = make_config(src, tmp_path / "cache", policy="lru", chunk_size=16 << 10,
                      reorder_min=0)

    async def body(sess: Session):
        eng = sess.engine
        ds = c.image_folder()
        by_index = {i: os.fsencode(os.path.relpath(p, c.root)) for i, (p, _) in
                    enumerate(ds.samples)}
        sampler = torch_data.DistributedSampler(ds, num_replicas=1, rank=0, seed=SEED)
        order = list(sampler)
        s = await announced(sess, 0)
        first = await poll(lambda: s.next_log, "the next epoch's log")
        assert list(sampler) == order  # again, nothing read: a restart
        await poll(lambda: s.next_log is not None and s.next_log is not first,
                   "the restart's next log")
        s2 = sess.streams.streams[("default", 0)]
        assert s2 is s and not s.repeats and "repeats" not in s.reason
        for i in order:
            assert await read_file(eng, eng.ns.resolve(by_index[i]).ino) == files[by_index[i]]
        assert s2.position == len(order)
        assert list(sampler) == order  # read through, then again: a repeat
        await poll(lambda: s2.repeats, "the repeat")
        assert "set_epoch is not called" in s2.reason and s2.next_log is None
        assert s2.next_first_order == order  # the next epoch is taken to repeat it

    with build(cfg, CountingSource(src)) as sess:
        c.session = sess
        sess.run(body)


def test_a_forgotten_job_ends_its_streams_and_gives_up_their_logs(client, tmp_path):
    """Control forgets an idle job to make room for a new one: its stream ends, the next
    epoch's log it was laying out is given up and no longer protected, the cache's
    invariants hold, and the same job announcing again later starts afresh."""
    c, src, files = client
    cfg = make_config(src, tmp_path / "cache", policy="lru", chunk_size=16 << 10,
                      reorder_min=0)

    async def body(sess: Session):
        eng = sess.engine
        ds = c.image_folder()
        sampler = torch_data.DistributedSampler(ds, num_replicas=1, rank=0, seed=SEED)
        sampler.set_epoch(0)
        order = list(sampler)
        s = await announced(sess, 0)
        nl = await poll(lambda: s.next_log, "the next epoch's log")
        sess.control.on_job_dropped("default")  # as ControlState._forget_idle_jobs calls it
        assert ("default", 0) not in sess.streams.streams
        assert nl.failed and not any(ch.chunk_id in eng.writer.protected for ch in nl.chunks)
        await eng.flush()
        assert eng.check_invariants() == []
        sampler.set_epoch(1)
        assert list(sampler) != order
        s2 = await announced(sess, 1)
        assert s2 is not s and s2.mode == "replayed", s2.reason

    with build(cfg, CountingSource(src)) as sess:
        c.session = sess
        sess.run(body)
        assert sess.engine.counters.invariant_violations == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_cache_smaller_than_the_dataset(client, tmp_path, policy):
    """A cache of 40% of the dataset: every byte read is the source's, the cache stays
    within --cache-size at every epoch's end, and later epochs are partly served by it."""
    c, src, files = client
    total = sum(map(len, files.values()))
    cap = int(0.4 * total)
    cfg = make_config(src, tmp_path / "cache", policy=policy, chunk_size=4096,
                      cache_size=cap)

    async def body(sess: Session):
        eng = sess.engine
        ds = c.image_folder()
        rels = [os.fsencode(os.path.relpath(p, c.root)) for p, _ in ds.samples]
        sampler = torch_data.DistributedSampler(ds, num_replicas=1, rank=0, seed=SEED)
        reporter = hook.LossReporter(ds)
        hits = []
        for epoch in range(3):
            sampler.set_epoch(epoch)
            order = list(sampler)
            s = await announced(sess, epoch)
            assert s.mode == "replayed" and s.order == order
            log = s.current_log if epoch and s.memory_prefetch else None
            if log is not None:
                await poll(lambda log=log: log.done.is_set(), "this epoch's log finished")
            before = sess.stats()
            for k, i in enumerate(order):
                ino = eng.ns.resolve(rels[i]).ino
                assert await read_file(eng, ino) == files[rels[i]], rels[i]
                if log is not None and k == len(log.slots) // 2:  # in the log's part
                    await eng.flush()
                    # LCache with a cache too small for the dataset: the part of this
                    # epoch's log still ahead stays in the cache while the next epoch's
                    # log is written (LRU evicted exactly those chunks, its oldest)
                    ahead = [c.chunk_id for c in log.chunks if c.sealed and c.unread]
                    assert ahead, "nothing of this epoch's log is left to read"
                    assert all(eng.index.get_chunk(c) is not None for c in ahead)
                    assert set(ahead) <= eng.writer.protected
            await eng.flush()
            after = sess.stats()
            hits.append(after["hits"] - before["hits"])
            if log is not None:
                # its chunks were released once read, and counted
                assert after["released_after_use"] > before["released_after_use"]
                assert log.missing_at_start is not None
                # the next epoch's log got its samples as they were read (per-slot room)
                assert log.missing_at_start <= len(log.slots) // 2, log.missing_at_start
            reporter.report(order, losses_of(order, epoch))
            reporter.flush()
            assert reporter.dropped_pairs == 0 and c.refused == []
            assert eng.check_invariants() == []
            assert eng.index.counter(S.K_CHUNK_BYTES) <= cap
        assert sum(hits[1:]) > 0, hits
        # a training that stops opening (ended, died mid-epoch) lets its logs go
        from dlcachefs.clairvoyance.stream import IDLE_S

        cur, nxt = s.current_log, s.next_log
        if s.memory_prefetch:
            assert cur is not None and cur.release_after_use
            ids = {c.chunk_id for c in cur.chunks}
            sess.streams.unprotect_idle(time.monotonic() + IDLE_S / 2)
            assert cur.release_after_use  # not idle yet
            sess.streams.unprotect_idle(time.monotonic() + IDLE_S + 1)
            assert not cur.release_after_use and not ids & eng.writer.protected
            # a zero-copy reader's hits reach the log as events (released after use):
            # its log stays protected, unless events were lost (a full ring)
            from dlcachefs.store.tally import TallyWriter

            cur.release_after_use = True
            eng.writer.protected.update(ids)
            sess.streams.unprotect_idle(time.monotonic())
            assert cur.release_after_use  # no reader
            reader = TallyWriter(sess.zerocopy.dir)  # this process, counting: alive
            try:
                sess.streams.unprotect_idle(time.monotonic())
                assert cur.release_after_use and ids <= eng.writer.protected
                sess.in_process.events.lost += 5
                sess.streams.unprotect_idle(time.monotonic())
            finally:
                reader.close()
            assert not cur.release_after_use and not ids & eng.writer.protected
        if nxt is not None and s.memory_prefetch:
            # the next epoch's log of an idle stream too (a training that ended planned
            # it for an epoch that never comes); protected again if its epoch begins
            assert not {c.chunk_id for c in nxt.chunks} & eng.writer.protected
            nxt.protect()
            assert {c.chunk_id for c in nxt.chunks} <= eng.writer.protected

    with build(cfg) as sess:
        c.session = sess
        sess.run(body)
        assert sess.engine.check_invariants() == []
        assert sess.engine.counters.invariant_violations == 0


def test_opens_before_the_epoch_switch_count_against_its_log(client, tmp_path):
    """A loader that reads as soon as it announces: opens that reach the mount before
    the stream switches epochs are counted against the new epoch's log, so every chunk of
    it is released once read (none stays protected, unread, all epoch)."""
    c, src, files = client
    total = sum(map(len, files.values()))
    cap = int(0.4 * total)
    cfg = make_config(src, tmp_path / "cache", policy="lru", chunk_size=4096, cache_size=cap)
    out = {}

    async def body(sess):
        eng = sess.engine
        ds = c.image_folder()
        rels = [os.fsencode(os.path.relpath(p, c.root)) for p, _ in ds.samples]
        sampler = torch_data.DistributedSampler(ds, num_replicas=1, rank=0, seed=SEED)
        for epoch in range(2):
            sampler.set_epoch(epoch)
            order = list(sampler)
            k0 = 0
            if epoch == 1:
                # the loader's workers start reading at once: before the switch
                for i in order[:3]:
                    ino = eng.ns.resolve(rels[i]).ino
                    assert await read_file(eng, ino) == files[rels[i]]
                s = sess.streams.streams[("default", 0)]
                out["early"] = len(s.early)
                k0 = 3
            s = await announced(sess, epoch)
            if epoch == 1:
                log = s.current_log
                out["mp"] = s.memory_prefetch
                await poll(lambda log=log: log.done.is_set(), "log done")
            for i in order[k0:]:
                ino = eng.ns.resolve(rels[i]).ino
                assert await read_file(eng, ino) == files[rels[i]]
            if epoch == 0:
                await poll(lambda s=s: s.next_log is not None and s.next_log.sealed > 0, "nl")
            await eng.flush()
        out["stuck"] = [(cc.chunk_id, cc.unread, cc.sealed, cc.chunk_id in eng.writer.protected)
                        for cc in log.chunks if cc.unread]
        out["first_chunk_inos"] = [sl.ino for sl in log.chunks[0].slots]
        out["early_inos"] = [eng.ns.resolve(rels[i]).ino for i in order[:3]]

    with build(cfg) as sess:
        c.session = sess
        sess.run(body)
    assert out["mp"]
    assert not out["stuck"], out
