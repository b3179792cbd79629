"""DLIO's dataset and sampler as the hook sees them (:mod:`dlcachefs.data.dlio`), without a
mount: the preview leaves the training's draws untouched and predicts what the sampler
yields; an epoch whose order was mispredicted (``sample_shuffle: random`` with numpy
draws between epochs) has its order sent again; the dataset's files become a view of
the folder holding them, listed only when it is on a mount. The stand-in sampler is DLIO
2.0's ``dlio_sampler`` code as it is (the mounted test, ``test_t6_dlio.py``, runs it
through a real mount)."""

from __future__ import annotations

import math
import random
import sys
import types
from enum import Enum

import numpy as np
import pytest
from dlio_standin import SAMPLER_SRC
from hypothesis import given, settings
from hypothesis import strategies as st

from dlcachefs.clairvoyance.protocol import index_list_id
from dlcachefs.data import dlio
from dlcachefs.data.wrappers import Unresolved


class Shuffle(Enum):
    OFF = "off"
    SEED = "seed"
    RANDOM = "random"


_ns = {"math": math, "np": np, "Shuffle": Shuffle, "Sampler": object}
exec(SAMPLER_SRC, _ns)  # DLIO 2.0's dlio_sampler, its code as it is
Sampler = _ns["dlio_sampler"]


@settings(max_examples=60, deadline=None)
@given(shuffle=st.sampled_from(list(Shuffle)), seed=st.integers(0, 2**32 - 1),
       n=st.integers(1, 300), rank=st.integers(0, 3))
def test_the_preview_predicts_the_next_two_orders_and_draws_nothing(shuffle, seed, n, rank):
    np.random.seed(seed % 1000)
    random.seed(seed)
    s = Sampler(rank, 4, n, shuffle, 3, seed)
    np_before, py_before = np.random.get_state(), random.getstate()
    orders = dlio.preview(s, 2)
    np_after = np.random.get_state()
    assert np_after[0] == np_before[0] and (np_after[1] == np_before[1]).all() \
        and np_after[2:] == np_before[2:]
    assert random.getstate() == py_before
    assert orders == [list(s), list(s)]  # what the sampler then yields, epoch by epoch


def test_a_mispredicted_order_is_sent_again_at_its_epoch():
    np.random.seed(5)
    s = Sampler(1, 2, 40, Shuffle.RANDOM, 3, 7)
    orders, nxt = dlio.orders_to_send(s, 0, None)  # the first epoch: both
    assert [e for e, _ in orders] == [0, 1]
    assert list(s) == orders[0][1]  # epoch 0 read
    # nothing drawn between epochs: the prediction holds, only the next one is sent
    orders, nxt2 = dlio.orders_to_send(s, 1, nxt)
    assert [e for e, _ in orders] == [2]
    list(s)  # epoch 1 read
    np.random.normal(0, 1)  # DLIO's computation_time_stdev, between epochs
    orders, _ = dlio.orders_to_send(s, 2, nxt2)
    assert [e for e, _ in orders] == [2, 3]  # epoch 2's order sent again, rightly
    assert index_list_id(orders[0][1]) != nxt2
    assert orders[0][1] == list(s)


def test_seeded_orders_are_predicted_exactly():
    s = Sampler(0, 2, 50, Shuffle.SEED, 3, 11)
    _, nxt = dlio.orders_to_send(s, 0, None)
    list(s)
    np.random.normal(0, 1)  # draws between epochs do not matter: it reseeds
    orders, _ = dlio.orders_to_send(s, 1, nxt)
    assert [e for e, _ in orders] == [2]


@pytest.fixture
def dlio_config(monkeypatch):
    """A stand-in ``dlio_benchmark.utils.config`` with DLIO's ConfigArguments singleton."""
    args = types.SimpleNamespace(file_list_train=[], file_list_eval=[], num_samples_per_file=1)
    mod = types.ModuleType(dlio.CONFIG_MODULE)
    mod.ConfigArguments = types.SimpleNamespace(get_instance=lambda: args)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, dlio.CONFIG_MODULE, mod)
    return args


class Dataset:
    def __init__(self, n, kind="train"):
        self.n = n
        self.dataset_type = types.SimpleNamespace(value=kind)

    def __len__(self):
        return self.n


def test_a_subset_of_the_folder_is_a_view_with_an_index(tmp_path, dlio_config):
    train = tmp_path / "data" / "train"
    train.mkdir(parents=True)
    for i in range(12):
        (train / f"img_{i}_of_12.jpeg").write_bytes(b"x")
    (train / "notes.txt").write_bytes(b"not DLIO's")
    names = sorted(p.name for p in train.glob("*.jpeg"))
    dlio_config.file_list_train = [str(train / n) for n in names[3:9]]  # num_files_train
    view = dlio.view_of(Dataset(6), on_mount=lambda root: True)
    assert view is not None and len(view) == 6
    (root,) = view.roots
    assert root.path == str(train) and root.count == 12 and root.suffixes == (".jpeg",)
    listed = dlio.walk_list(str(train), (".jpeg",))
    assert [listed[view.base_index(i)[1]] for i in range(6)] == names[3:9]
    assert dlio.first_file(Dataset(6)) == str(train / names[3])


def test_a_folder_off_the_mounts_is_not_listed(tmp_path, dlio_config, monkeypatch):
    (tmp_path / "img_0.jpeg").write_bytes(b"x")
    dlio_config.file_list_train = [str(tmp_path / "img_0.jpeg")]

    def no_walk(*a):
        raise AssertionError("listed a folder that is on no mount")

    monkeypatch.setattr(dlio, "walk_list", no_walk)
    assert dlio.view_of(Dataset(1), on_mount=lambda root: False) is None


def test_several_samples_per_file_cannot_be_named(dlio_config):
    dlio_config.num_samples_per_file = 4
    dlio_config.file_list_train = ["/x/a.npz"]
    with pytest.raises(Unresolved, match="4 samples per file"):
        dlio.view_of(Dataset(4), on_mount=lambda root: True)
    assert dlio.first_file(Dataset(4)) == "/x/a.npz"  # the mount it reads, still found
