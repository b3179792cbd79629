"""Tier 1: the control protocol's encoder (dlcachefs.clairvoyance.protocol) against its
parser (dlcachefs.clairvoyance.control): whatever the encoder writes, the parser accepts,
within the limits, and yields back the same values."""

from __future__ import annotations

import base64
import os
import random
import struct
import subprocess
import sys

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from dlcachefs.clairvoyance import protocol as P
from dlcachefs.clairvoyance.control import MAX_EPOCH, MAX_INDEX, ControlState
from dlcachefs.clairvoyance.replay import SamplerSpec

SLOW = settings(max_examples=25, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Receiver:
    """A ControlState whose mount holds every directory, and what it passed on."""

    def __init__(self) -> None:
        self.dirs: dict[str, int] = {}
        self.losses: list[tuple[str, list[int], list[float]]] = []
        self.orders: list[tuple[str, int, list[int]]] = []
        self.cs = ControlState(
            self._resolve, on_loss=lambda js, i, v: self.losses.append((js.name, i, v)),
            on_order=lambda st, job, e, order, pid: self.orders.append((job.name, e, list(order))))

    def _resolve(self, rel: str) -> int:
        return self.dirs.setdefault(rel, len(self.dirs) + 2)

    def apply(self, writes: list[str], pid: int = 7) -> None:
        """Each write as one write(), checked against the limits first."""
        for w in writes:
            data = w.encode()
            assert len(data) <= P.MAX_WRITE
            for line in w.splitlines():
                limit = P.MAX_SAMPLER_LINE if line.startswith("sampler") else P.MAX_LINE
                assert len(line) <= limit
            assert self.cs.apply(data, pid) == len(data)


# ----- strategies -------------------------------------------------------------------------

jobs = st.from_regex(r"[A-Za-z0-9._-]{1,64}", fullmatch=True)
# any name a directory can have (no "/", no NUL, no surrogates), and not "." or ".."
components = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\x00"),
                     min_size=1, max_size=16).filter(lambda c: c not in (".", ".."))
rel_paths = st.lists(components, max_size=4).map("/".join)
hex64 = st.text("0123456789abcdef", min_size=64, max_size=64)
extensions = st.one_of(st.none(), st.lists(st.text(min_size=1, max_size=8), min_size=1,
                                          max_size=3).map(tuple))
states = st.binary(min_size=1, max_size=5056).map(lambda b: base64.b64encode(b).decode())
bools = st.one_of(st.none(), st.booleans())
draws = st.one_of(st.none(), st.sampled_from(["none", "each", "first"]))


@st.composite
def samplers(draw) -> tuple[str, dict]:
    """A sampler kind and fields the hook (or a user) may send."""
    kind = draw(st.sampled_from(["random", "distributed", "sequential", "explicit",
                                 "subset_random", "unknown"]))
    f: dict = {}
    if kind == "random":
        if draw(st.booleans()):
            f["seed"] = draw(st.integers(-(1 << 63), (1 << 64) - 1))
        else:
            f["state"] = draw(states)
        f.update(num_samples=draw(st.one_of(st.none(), st.integers(1, 1 << 40))),
                 replacement=draw(bools), per_epoch=draw(bools), loader_draws=draw(draws))
    elif kind == "distributed":
        world = draw(st.integers(1, 1 << 20))
        f.update(seed=draw(st.integers(-(1 << 63), (1 << 64) - 1)), world=world,
                 rank=draw(st.integers(0, world - 1)), shuffle=draw(bools),
                 drop_last=draw(bools))
    elif kind == "subset_random":
        f.update(index=SUBSET_LID, state=draw(states), per_epoch=draw(bools),
                 loader_draws=draw(draws))
    elif kind == "unknown":
        f["reason"] = draw(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1,
                                   max_size=300))
    return kind, f


SUBSET = [4, 0, 2]
SUBSET_LID = P.index_list_id(SUBSET)


class RootDesc:
    """A root as the training describes it (what wrappers.Root carries)."""

    def __init__(self, count: int, sha: str, extensions) -> None:
        self.count, self.sha, self.extensions = count, sha, extensions


def same_float(a: float, b: float, fmt: str = "<d") -> bool:
    return struct.pack(fmt, a) == struct.pack(fmt, b)  # -0.0 is not 0.0


# ----- single lines -------------------------------------------------------------------------


def test_importing_the_protocol_imports_nothing_heavy():
    code = ("import sys, dlcachefs.clairvoyance.protocol\n"
            "heavy = {'trio', 'numpy', 'lmdb', 'torch', 'pyfuse3'} & set(sys.modules)\n"
            "assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True,
                   cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@FAST
@given(jobs, rel_paths, samplers(), st.integers(0, MAX_EPOCH),
       st.one_of(st.none(), st.tuples(st.integers(1, 1 << 24), st.one_of(
           st.none(), st.integers(0, 4096)), st.one_of(st.none(), st.integers(0, 4096)))))
def test_lines_round_trip(job, rel, sampler, epoch, batch):
    r = Receiver()
    kind, fields = sampler
    r.apply(P.index_writes(SUBSET_LID, SUBSET))
    lines = [P.job_line(job), P.dataset_line(rel), P.sampler_line(kind, **fields)]
    if batch is not None:
        lines.append(P.batch_line(*batch))
    lines.append(P.epoch_line(epoch))
    r.apply([P.text(lines)])
    js = r.cs.jobs[job]
    assert js.dataset == rel and js.dataset_ino == r.dirs[rel]
    expected = SamplerSpec(kind, **{k: v for k, v in fields.items() if v is not None})
    st_ = r.cs.streams[(job, expected.rank)]
    assert st_.sampler == expected
    assert st_.epoch == epoch
    if batch is not None:
        assert (st_.batch, st_.workers, st_.prefetch_factor) == batch


@FAST
@given(st.lists(st.tuples(rel_paths, st.integers(0, 1 << 20), hex64, extensions), min_size=1,
                max_size=4),
       st.one_of(st.none(), st.lists(st.integers(0, 1 << 30), max_size=50)), jobs)
@example([("a b/%41/é", 3, "0" * 64, ("any", "a,b", "%", ".JPG")), ("", 0, "f" * 64, None)],
         [2, 0, 0], "j")
def test_view_round_trip(roots, index, job):
    base = sum(count for _, count, _, _ in roots)
    if index is not None:
        index = [i % base for i in index] if base else []
    defs = [RootDesc(count, sha, ext) for _, count, sha, ext in roots]
    rels = [rel for rel, _, _, _ in roots]
    lid = P.index_list_id(index) if index is not None else None
    vid = P.view_id(rels, defs, lid)
    r = Receiver()
    writes = P.index_writes(lid, index) if lid else []
    writes.append(P.text(P.view_lines(vid, rels, defs, lid)))
    writes.append(P.text([P.job_line(job), P.dataset_line(rels[0], vid)]))
    r.apply(writes)
    v = r.cs.views[vid]
    assert [(d.rel, d.count, d.sha, d.extensions) for d in v.roots] == roots
    assert v.lid == lid and (v.index is None if index is None else list(v.index) == index)
    assert r.cs.jobs[job].view is v and r.cs.jobs[job].dataset == rels[0]


# ----- lists across writes ------------------------------------------------------------------

#: list lengths: short ones, and long ones that take several writes
lengths = st.one_of(st.integers(0, 60), st.integers(10_000, 40_000))


def _indices(n: int, seed: int, head: list[int]) -> list[int]:
    """``head`` then ``n`` pieces: ascending runs (sent as one A:B token) mixed with
    scattered indices."""
    rng = random.Random(seed)
    out = list(head)
    for _ in range(n):
        if rng.random() < 0.1:
            a = rng.randrange(MAX_INDEX - 1000)
            out.extend(range(a, a + rng.randrange(1, 300)))
        else:
            out.append(rng.randrange(rng.choice([10, 1 << 20, MAX_INDEX])))
    return out


@SLOW
@given(lengths, st.integers(0, 2**32), st.lists(st.integers(0, MAX_INDEX - 1),
                                                               max_size=20))
def test_index_list_round_trip_across_writes(n, seed, head):
    indices = _indices(n, seed, head)
    lid = P.index_list_id(indices)
    r = Receiver()
    r.apply(P.index_writes(lid, indices))
    assert list(r.cs.index_lists[lid]) == indices and not r.cs.pending_lists


@SLOW
@given(lengths, st.integers(0, 2**32), st.integers(0, MAX_EPOCH), jobs,
       rel_paths)
def test_order_round_trip_across_writes(n, seed, epoch, job, rel):
    rng = random.Random(seed)
    order = [rng.randrange(rng.choice([10, 1 << 20, MAX_INDEX])) for _ in range(n)]
    r = Receiver()
    first = P.text([P.job_line(job), P.dataset_line(rel), P.sampler_line("explicit")])
    writes = P.order_writes(epoch, order, first, next_head=P.text([P.job_line(job)]),
                            after=[P.epoch_line(epoch)])
    assert all(w.startswith(P.text([P.job_line(job)])) for w in writes)
    r.apply(writes)
    assert r.orders == [(job, epoch, order)]
    st_ = r.cs.streams[(job, 0)]
    assert list(st_.orders[epoch]) == order and st_.epoch == epoch


finite = st.floats(allow_nan=False, allow_infinity=False)
float32s = st.floats(width=32, allow_nan=False, allow_infinity=False)
EDGES = [0.0, -0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 1.7976931348623157e308,
         -1.7976931348623157e308, 1.401298464324817e-45, 3.4028234663852886e38, 1e-300,
         0.1, 1 / 3]


@SLOW
@given(st.lists(finite, max_size=200), st.lists(float32s, max_size=200),
       lengths, st.integers(0, 2**32), st.integers(1, P.MAX_LOSS_PAIRS),
       st.integers(0, 200), jobs)
def test_loss_round_trip_across_writes(f64, f32, n, seed, max_pairs, reserve, job):
    rng = random.Random(seed)
    values = EDGES + f64 + f32 + [rng.choice([-1, 1]) * rng.random() * 10.0 ** rng.randint(
        -320, 307) for _ in range(n)]
    indices = [rng.randrange(rng.choice([10, MAX_INDEX])) for _ in values]
    r = Receiver()
    r.apply([P.text([P.job_line(job), P.dataset_line("d")])])
    head = P.text([P.job_line(job)])
    writes = P.loss_writes(indices, values, head, reserve=reserve, max_pairs=max_pairs)
    assert sum(n for _, n in writes) == len(values)
    for w, pairs in writes:
        assert w.startswith(head) and len(w.encode()) + reserve <= P.MAX_WRITE
        assert pairs <= max_pairs
        assert sum(len(line.split()) - 1 for line in w.splitlines()[1:]) == 2 * pairs
    r.apply([w for w, _ in writes])
    got_i = [i for j, idx, _ in r.losses if j == job for i in idx]
    got_v = [v for j, _, vals in r.losses if j == job for v in vals]
    assert got_i == indices
    # the encoder's precision: 9 significant digits ...
    assert all(same_float(g, float(format(v, P.LOSS_FORMAT)))
               for g, v in zip(got_v, values, strict=True))
    # ... which is every float32 exactly
    k = len(EDGES) + len(f64)
    assert all(same_float(g, v, "<f") for g, v in zip(got_v[k:k + len(f32)], f32, strict=True))


def test_empty_lists():
    r = Receiver()
    lid = P.index_list_id([])
    r.apply(P.index_writes(lid, []))
    assert list(r.cs.index_lists[lid]) == []
    assert P.loss_writes([], []) == []
    r.apply([P.text([P.dataset_line("")])])
    r.apply(P.order_writes(3, []))
    assert r.orders == [("default", 3, [])]
