"""The background packer (iCACHE III-C dynamic packaging) in the core, without a kernel:
packages of L-samples read from the source once per file and stored as one unit each,
within the L-share and --cache-size; substitution serves from them."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from dlcachefs.testing.fakes import CountingSource, make_config, run_session, write_tree


def dataset(classes: int = 4, per_class: int = 40, seed: int = 0) -> dict[bytes, bytes]:
    rnd = random.Random(seed)
    return {f"c{c}/{i:03d}.jpg".encode(): rnd.randbytes(rnd.randint(3000, 6000))
            for c in range(classes) for i in range(per_class)}


async def with_h_list(sess, losses) -> list[int]:
    """The dataset listed and an H-list from ``losses`` (by dataset index), as a stream's
    epoch start does; the inodes of the samples."""
    sl = await sess.streams.lists.ensure_sample_list("")
    sess.importance.bind("", sl.inos, sess.cfg.h_fraction)
    sess.importance.table.update("j", list(range(len(sl.inos))), losses)
    sess.importance.table.rebuild()
    return sl.inos


def test_packer_reads_each_member_once_into_one_unit_within_the_l_share(tmp_path):
    files = dataset()
    write_tree(tmp_path / "src", files)
    src = CountingSource(str(tmp_path / "src"))
    n = len(files)
    losses = [float(random.Random(1).random()) for _ in range(n)]
    cfg = make_config(tmp_path / "src", tmp_path / "cache", cache_size=200_000,
                      policy="icache:package=40000", substitute=True)

    async def body(sess):
        eng = sess.engine
        await with_h_list(sess, losses)
        while await sess.packer.step():  # (the packer's own task may build some too)
            pass
        await eng.flush()

    _, sess = run_session(cfg, body, source=src)
    eng = sess.engine
    pol = eng.policy
    assert pol.packages == sess.packer.stats.packages >= 1
    # every packed sample is L, read from the source exactly once
    imp = sess.importance
    packed = [m for u, (members, _) in pol._l.items() for m in members]
    assert packed and len(set(packed)) == len(packed)
    assert not any(imp.is_high(m) for m in packed)
    assert max(src.reads.values()) == 1 and sum(src.reads.values()) == len(packed)
    # one unit per package, each at least the package size unless the share ran out,
    # all of them within the L-share
    sizes = [size for _, (_, size) in pol._l.items()]
    assert sum(sizes) <= pol.l_capacity()
    assert all(s >= pol.package_size() - 6000 for s in sizes)


def test_substitution_serves_packed_samples_of_the_same_directory(tmp_path):
    files = dataset(classes=3, per_class=30)
    write_tree(tmp_path / "src", files)
    n = len(files)
    losses = [float((i * 7) % n) for i in range(n)]  # a permutation: H and L mixed
    cfg = make_config(tmp_path / "src", tmp_path / "cache", cache_size=150_000,
                      policy="icache:package=30000", substitute=True)
    by_bytes = {v: k for k, v in files.items()}

    async def body(sess):
        eng = sess.engine
        await with_h_list(sess, losses)
        while await sess.packer.step():
            pass
        await eng.flush()
        # a stream reads every file once (as an epoch would); misses of L-samples
        # not in a package are substituted from one
        from dlcachefs.clairvoyance.streams import Stream

        s = Stream("j", 0)
        sess.streams.stream_of = lambda pid: s  # every open is this stream's
        served = {}
        for rel in sorted(files):
            e = eng.ns.resolve(rel)
            r = await eng.open(e.ino, pid=1)
            try:
                served[rel] = bytes(await eng.read(r.fh, 0, 1 << 20))
            finally:
                eng.release(r.fh)
        high = {rel for rel in files if sess.importance.is_high(eng.ns.resolve(rel).ino)}
        return high, served

    (high, served), sess = run_session(cfg, body)
    eng = sess.engine
    assert 0 < len(high) < n
    subs = 0
    for rel, got in served.items():
        if got == files[rel]:
            continue
        subs += 1
        other = by_bytes[got]
        assert other.split(b"/")[0] == rel.split(b"/")[0]  # the same class directory
        assert rel not in high and other not in high  # never for an H-sample, nor one
    assert subs > 0 and eng.counters.substitutions == subs
    assert len({by_bytes[g] for r, g in served.items() if g != files[r]}) == subs  # once each


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 3000, 10_000]), st.integers(1, 5000),
                          st.integers(0, 3)), max_size=60))
def test_writer_keeps_each_package_whole_in_one_unit(recs):
    """The chunk writer's grouping with packages: every record in exactly one unit, the
    records of a package (unit tag) together and alone in theirs, never cut however
    large; the other records grouped by target as before."""
    from dlcachefs.cache.source import Identity
    from dlcachefs.cache.writer import Pending, _units

    pend = [Pending(i, b"k", Identity(n, 0, 0), b"x" * n, t, tag)
            for i, (t, n, tag) in enumerate(recs)]
    units = _units(pend)
    assert sorted(r.ino for u in units for r in u) == list(range(len(pend)))
    for tag in {r.unit for r in pend if r.unit}:
        holding = [u for u in units if any(r.unit == tag for r in u)]
        assert len(holding) == 1
        assert {r.ino for r in holding[0]} == {r.ino for r in pend if r.unit == tag}
    for u in units:
        assert len({r.unit for r in u}) == 1
        if not u[0].unit:
            assert len({r.target for r in u}) == 1
