"""Tier 1: dlcachefs.clairvoyance.replay replays the orders of torch's REAL samplers, bit for bit.

Every expected order here comes from torch itself (RandomSampler, DataLoader,
DistributedSampler, SequentialSampler), never from a reimplementation.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from torch.utils.data import (  # noqa: E402
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
)

from dlcachefs.clairvoyance.replay import OrderReplayer, SamplerSpec  # noqa: E402

SEEDS = st.integers(min_value=0, max_value=2**63 - 1)


class IndexDataset(Dataset):
    """``ds[i] == i``; defined at module level so that DataLoader workers can pickle it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def loader_epoch(loader: DataLoader) -> list[int]:
    """The dataset indices one pass over ``loader`` reads, in order."""
    out: list[int] = []
    for batch in loader:
        out += batch.tolist()
    return out


# ----- RandomSampler with its own generator ----------------------------------------------


@settings(deadline=None, max_examples=200)
@given(seed=SEEDS, n=st.integers(1, 300), data=st.data(), replacement=st.booleans(),
       epochs=st.integers(1, 4))
def test_random_sampler_matches_torch(seed, n, data, replacement, epochs):
    num_samples = data.draw(st.none() | st.integers(1, 3 * n), label="num_samples")
    g = torch.Generator().manual_seed(seed)
    sampler = RandomSampler(IndexDataset(n), replacement=replacement, num_samples=num_samples,
                            generator=g)
    expected = [list(sampler) for _ in range(epochs)]
    rep = OrderReplayer(SamplerSpec("random", seed=seed, num_samples=num_samples,
                                    replacement=replacement), n)
    for e in range(epochs):
        assert rep.order(e) == expected[e], e
        assert len(rep.order(e)) == (num_samples if num_samples is not None else n)


@settings(deadline=None, max_examples=100)
@given(seed=SEEDS, n=st.integers(1, 120), replacement=st.booleans(),
       num_samples=st.none() | st.integers(1, 200),
       asked=st.lists(st.integers(0, 14), min_size=1, max_size=12))
def test_random_sampler_epochs_out_of_order(seed, n, replacement, num_samples, asked):
    """Epochs asked in any order (going back, skipping ahead, past the bounded caches)."""
    g = torch.Generator().manual_seed(seed)
    sampler = RandomSampler(IndexDataset(n), replacement=replacement, num_samples=num_samples,
                            generator=g)
    expected = [list(sampler) for _ in range(max(asked) + 1)]
    rep = OrderReplayer(SamplerSpec("random", seed=seed, num_samples=num_samples,
                                    replacement=replacement), n)
    for e in asked:
        assert rep.order(e) == expected[e], (asked, e)


def test_random_sampler_fixed_out_of_order():
    seed, n = 1234, 50
    g = torch.Generator().manual_seed(seed)
    sampler = RandomSampler(IndexDataset(n), generator=g)
    expected = [list(sampler) for _ in range(20)]
    rep = OrderReplayer(SamplerSpec("random", seed=seed), n)
    for e in (3, 1, 5, 0, 19, 2, 18, 4, 10, 9, 11, 3):
        assert rep.order(e) == expected[e], e


def test_random_sampler_extreme_seeds():
    for seed in (0, 1, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1, -1, -(2**63)):
        g = torch.Generator()
        g.manual_seed(seed)
        sampler = RandomSampler(IndexDataset(37), generator=g)
        expected = [list(sampler) for _ in range(3)]
        rep = OrderReplayer(SamplerSpec("random", seed=seed), 37)
        assert [rep.order(e) for e in (2, 0, 1)] == [expected[2], expected[0], expected[1]]


# ----- DataLoader(shuffle=True, generator=g) ---------------------------------------------


@settings(deadline=None, max_examples=100)
@given(seed=SEEDS, n=st.integers(1, 200), batch=st.integers(1, 17), epochs=st.integers(1, 4),
       drop_last=st.booleans())
def test_dataloader_shuffle_generator_each(seed, n, batch, epochs, drop_last):
    """num_workers=0: every epoch's iterator draws a base seed from g before the sampler."""
    g = torch.Generator().manual_seed(seed)
    loader = DataLoader(IndexDataset(n), shuffle=True, generator=g, batch_size=batch,
                        num_workers=0, drop_last=drop_last)
    got = [loader_epoch(loader) for _ in range(epochs)]
    rep = OrderReplayer(SamplerSpec("random", seed=seed, loader_draws="each"), n)
    for e in reversed(range(epochs)):
        want = rep.order(e)
        if drop_last:
            want = want[: n // batch * batch]
        assert got[e] == want, e


@pytest.mark.parametrize("seed,n,batch", [(0, 23, 4), (2**63 - 7, 64, 5)])
def test_dataloader_persistent_workers_first(seed, n, batch):
    """persistent_workers=True: only the first iterator draws a base seed."""
    g = torch.Generator().manual_seed(seed)
    loader = DataLoader(IndexDataset(n), shuffle=True, generator=g, batch_size=batch,
                        num_workers=2, persistent_workers=True)
    got = [loader_epoch(loader) for _ in range(3)]
    rep = OrderReplayer(SamplerSpec("random", seed=seed, loader_draws="first"), n)
    assert [rep.order(e) for e in (2, 0, 1)] == [got[2], got[0], got[1]]
    each = OrderReplayer(SamplerSpec("random", seed=seed, loader_draws="each"), n)
    assert each.order(0) == got[0]
    assert each.order(1) != got[1]  # a second base-seed draw would shift epoch 1


# ----- RandomSampler without a generator (a seed per epoch from the global RNG) ----------


@settings(deadline=None, max_examples=100)
@given(x=st.integers(0, 2**63 - 1), n=st.integers(1, 300), data=st.data(),
       replacement=st.booleans(), epochs=st.integers(1, 3))
def test_random_sampler_per_epoch_seed(x, n, data, replacement, epochs):
    num_samples = data.draw(st.none() | st.integers(1, 3 * n), label="num_samples")
    sampler = RandomSampler(IndexDataset(n), replacement=replacement, num_samples=num_samples)
    saved = torch.get_rng_state()
    try:
        torch.manual_seed(x)
        for e in range(epochs):
            state = torch.get_rng_state()
            drawn = int(torch.empty((), dtype=torch.int64).random_().item())
            torch.set_rng_state(state)  # the sampler draws the very same value
            got = list(sampler)
            rep = OrderReplayer(SamplerSpec("random", seed=drawn, per_epoch=True,
                                            num_samples=num_samples, replacement=replacement),
                                n, base_epoch=e)
            assert rep.known(e)
            assert not rep.known(e + 1)
            assert rep.order(e) == got, e
            with pytest.raises(ValueError):
                rep.order(e + 1)
    finally:
        torch.set_rng_state(saved)


# ----- DistributedSampler ------------------------------------------------------------------


@settings(deadline=None, max_examples=150)
@given(seed=st.integers(0, 2**63 - 100), n=st.integers(1, 200), world=st.integers(1, 8),
       shuffle=st.booleans(), drop_last=st.booleans())
def test_distributed_sampler_matches_torch(seed, n, world, shuffle, drop_last):
    ds = IndexDataset(n)
    for rank in range(world):
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=shuffle,
                                     seed=seed, drop_last=drop_last)
        rep = OrderReplayer(SamplerSpec("distributed", seed=seed, world=world, rank=rank,
                                        shuffle=shuffle, drop_last=drop_last), n)
        for e in (0, 1, 2, 3, 4, 5):
            sampler.set_epoch(e)
            want = list(sampler)
            assert len(want) == len(sampler)
            assert rep.order(e) == want, (rank, e)
        assert rep.order(2) == rep.order(2)  # from the cache, unchanged


@pytest.mark.parametrize("world", range(1, 9))
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_distributed_sampler_small_datasets(world, drop_last, shuffle):
    """n < world (padding repeats the list several times; drop_last can leave nothing)."""
    for n in range(1, world + 2):
        ds = IndexDataset(n)
        for rank in range(world):
            sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=shuffle,
                                         seed=7, drop_last=drop_last)
            rep = OrderReplayer(SamplerSpec("distributed", seed=7, world=world, rank=rank,
                                            shuffle=shuffle, drop_last=drop_last), n)
            for e in (5, 0, 3):
                sampler.set_epoch(e)
                assert rep.order(e) == list(sampler), (n, rank, e)


@pytest.mark.parametrize("n", [1, 2, 17, 300])
def test_sequential_matches_torch(n):
    rep = OrderReplayer(SamplerSpec("sequential"), n)
    want = list(SequentialSampler(IndexDataset(n)))
    assert rep.order(0) == want
    assert rep.order(7) == want


# ----- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize("spec,n", [
    (SamplerSpec("distributed", world=4, rank=4), 10),
    (SamplerSpec("distributed", world=4, rank=9), 10),
    (SamplerSpec("distributed", world=2, rank=-1), 10),
    (SamplerSpec("distributed", world=0, rank=0), 10),
    (SamplerSpec("distributed", world=-3, rank=0), 10),
    (SamplerSpec("shuffled"), 10),
    (SamplerSpec(""), 10),
    (SamplerSpec("random", loader_draws="all"), 10),
    (SamplerSpec("random", loader_draws=""), 10),
    (SamplerSpec("random", num_samples=0), 10),
    (SamplerSpec("random", num_samples=-5), 10),
    (SamplerSpec("random"), 0),
    (SamplerSpec("random", seed=1 << 64), 10),
    (SamplerSpec("random", seed=-(1 << 63) - 1), 10),
])
def test_validate_refuses(spec, n):
    with pytest.raises(ValueError):
        spec.validate(n)
    with pytest.raises(ValueError):
        OrderReplayer(spec, n)


@pytest.mark.parametrize("spec,n", [
    (SamplerSpec("distributed", world=4, rank=3), 10),
    (SamplerSpec("distributed", world=8, rank=0), 3),
    (SamplerSpec("random", loader_draws="first", num_samples=5), 10),
    (SamplerSpec("random", loader_draws="each", replacement=True), 10),
    (SamplerSpec("random", seed=(1 << 64) - 1), 10),
    (SamplerSpec("random", seed=-(1 << 63)), 10),
    (SamplerSpec("sequential"), 0),
])
def test_validate_accepts(spec, n):
    spec.validate(n)
    OrderReplayer(spec, n)


@given(st.lists(st.integers(0, 12), max_size=60), st.lists(st.integers(0, 80), max_size=80))
def test_positions_match_a_plain_model(order_inos, pops):
    """Positions (the stream's inode -> not yet consumed positions) against a dict of
    lists: smallest pending position first, inode 0 never listed, repeats in order."""
    from dlcachefs.clairvoyance.positions import Positions

    pos = Positions(list(order_inos))
    model: dict[int, list[int]] = {}
    for p, ino in enumerate(order_inos):
        if ino:
            model.setdefault(ino, []).append(p)
    for ino in pops:
        ino %= 14
        want = model[ino][0] if model.get(ino) else None
        assert pos.next(ino) == want
        assert pos.pop(ino) == want
        if want is not None:
            model[ino].pop(0)


def test_an_order_naming_samples_outside_the_list_is_a_reason_not_a_crash():
    """A subset's indices or an order announced for a larger dataset than the one listed
    (an empty class directory, in 100,000 fuzzed writes to a live mount) make the
    stream's order unknown with a reason (ValueError, as every other replay failure), not
    an IndexError out of the prefetch task."""
    from dlcachefs.clairvoyance.positions import (  # noqa: PLC0415
        epoch_positions as _positions,
    )
    from dlcachefs.clairvoyance.positions import (  # noqa: PLC0415
        first_positions as _first_positions,
    )
    from dlcachefs.clairvoyance.samplelist import SampleList  # noqa: PLC0415

    empty = SampleList("d", [], [], [], [])
    three = SampleList("d", ["a"], [5, 6, 7], [0, 0, 0], ["x", "y", "z"])
    for samples, order in ((empty, [25]), (three, [0, 3]), (three, [-1, 2])):
        with pytest.raises(ValueError, match="outside the dataset's"):
            _first_positions(order, samples)
        with pytest.raises(ValueError, match="outside the dataset's"):
            _positions(order, samples)
    positions, consumed = _positions([2, 0, 2], three)
    assert bytes(consumed) == b"\0\0\0"
    assert _positions([], empty)[1] == bytearray()


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 50), world=st.integers(1, 6), seed=st.integers(0, 2**31),
       epoch=st.integers(0, 5), shuffle=st.booleans(), drop_last=st.booleans())
def test_the_cluster_order_holds_every_ranks_order(n, world, seed, epoch, shuffle,
                                                   drop_last):
    """A DistributedSampler's global order (every rank's, for the peer tier's expiry):
    rank r reads its position g at step g // world, exactly as torch's sampler of rank r
    yields them."""
    from dlcachefs.clairvoyance.replay import distributed_epoch  # noqa: PLC0415

    if drop_last and n < world:
        return  # torch's sampler would have no samples for some ranks
    whole = distributed_epoch(SamplerSpec(kind="distributed", seed=seed, world=world, rank=0,
                                          shuffle=shuffle, drop_last=drop_last),
                              n, epoch, whole=True)
    for r in range(world):
        s = DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=shuffle,
                               seed=seed, drop_last=drop_last)
        s.set_epoch(epoch)
        assert whole[r::world] == list(s)
