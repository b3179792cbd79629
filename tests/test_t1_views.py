"""Tier 1: wrapped datasets as views (dlcachefs.data.wrappers), their control lines, and the
replay of samplers announced by their generator state (the torch hook, no mount)."""

from __future__ import annotations

import base64

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_t1_sampler import IndexDataset

from dlcachefs.clairvoyance import protocol as P
from dlcachefs.clairvoyance.control import MAX_LINE, MAX_WRITE, ControlState
from dlcachefs.clairvoyance.replay import OrderReplayer
from dlcachefs.data import wrappers as w
from dlcachefs.errors import ControlError, NotFound

torch = pytest.importorskip("torch")
data = pytest.importorskip("torch.utils.data")

DIRS = {"": 1, "train": 20, "val": 21, "extra": 22}


def resolve_dir(rel: str) -> int:
    if rel in DIRS:
        return DIRS[rel]
    raise NotFound(rel)


# ----- resolving wrapped datasets ----------------------------------------------------------


class FakeFolder:
    """Shaped like a DatasetFolder: ``root`` + ``samples``; item ``i`` is its path."""

    def __init__(self, root: str, n: int, extensions=(".jpg",)) -> None:
        self.root = root
        self.samples = [(f"{root}/c{i % 3}/{i:04d}.jpg", i % 3) for i in range(n)]
        self.extensions = extensions

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i][0]


class UserWrap(data.Dataset):
    """A user's wrapper: forwards ``i`` to what it holds; has a cycle and a config."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.me = self
        self.config = {"lr": 0.1, "name": "x"}

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i):
        return self.inner[i]


def trees():
    counter = iter(range(10**9))
    leaves = st.integers(0, 6).map(lambda n: FakeFolder(f"/m/root{next(counter)}", n))

    def extend(children):
        def subset(ds, draw):
            n = len(ds)
            if n == 0:
                return data.Subset(ds, [])
            idx = draw(st.lists(st.integers(-n, n - 1), max_size=12))
            return data.Subset(ds, idx)

        return st.one_of(
            st.builds(lambda c: UserWrap(c), children),
            st.lists(children, min_size=1, max_size=3).map(data.ConcatDataset),
            st.tuples(children, st.data()).map(lambda t: subset(t[0], t[1].draw)),
        )

    return st.recursive(leaves, extend, max_leaves=8)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(trees())
def test_view_names_what_torch_indexes(ds):
    """Index i of the wrapped dataset names, through the view, the file torch reads."""
    view = w.resolve(ds)
    assert len(view) == len(ds)
    for i in range(len(ds)):
        k, j = view.base_index(i)
        root = view.roots[k]
        assert ds[i] == f"{root.path}/c{j % 3}/{j:04d}.jpg"


def test_resolve_reasons():
    a, b = FakeFolder("/m/a", 4), FakeFolder("/m/b", 4)

    class Two(data.Dataset):
        def __init__(self):
            self.left, self.right = a, b

        def __len__(self):
            return 4

    with pytest.raises(w.Unresolved, match="several datasets"):
        w.resolve(Two())

    class Filtered(data.Dataset):
        def __init__(self):
            self.base = a

        def __len__(self):
            return 3

    with pytest.raises(w.Unresolved, match="indices cannot be mapped"):
        w.resolve(Filtered())

    class Nothing(data.Dataset):
        def __len__(self):
            return 3

    with pytest.raises(w.Unresolved, match="holds none"):
        w.resolve(Nothing())

    deep = a
    for _ in range(6):
        deep = UserWrap(deep)
    with pytest.raises(w.Unresolved, match="depth"):
        w.resolve(deep)

    class Named(data.Dataset):  # several, but one is "dataset": the conventional name
        def __init__(self):
            self.dataset, self.other = a, b

        def __len__(self):
            return 4

    assert w.resolve(Named()).roots[0].path == "/m/a"


def test_with_index_and_real_dataset_folder(tmp_path):
    """A torchvision DatasetFolder with its own loader and extensions; with_index."""
    folder = pytest.importorskip("torchvision.datasets.folder")
    from dlcachefs.data.hook import with_index

    for c in ("b", "a"):
        for name in ("x.TXT", "y.dat", "z.jpg"):
            (tmp_path / c).mkdir(exist_ok=True)
            (tmp_path / c / name).write_text(name)
    ds = folder.DatasetFolder(str(tmp_path), loader=lambda p: p, extensions=(".txt", ".dat"))
    view = w.resolve(data.Subset(with_index(ds), [3, 0]))
    (root,) = view.roots
    assert root.extensions == (".txt", ".dat") and root.count == 4
    assert root.sha == P.paths_digest(["a/x.TXT", "a/y.dat", "b/x.TXT", "b/y.dat"])
    assert view.index == (3, 0)


# ----- index lists and views on the wire ----------------------------------------------------


def apply_all(cs: ControlState, writes: list[str], pid: int = 7) -> None:
    for text in writes:
        assert len(text.encode()) <= MAX_WRITE
        assert all(len(line) <= MAX_LINE for line in text.splitlines())
        cs.apply(text.encode(), pid)


def test_two_processes_send_the_same_list_at_once():
    """DDP ranks of one Subset define the same (content-addressed) list at the same time:
    their writes interleave, and each is accepted (a list in transit is per process)."""
    indices = list(range(0, 60000, 3)) + list(range(7, 30000, 7))
    lid = P.index_list_id(indices)
    writes = P.index_writes(lid, indices)
    assert len(writes) >= 2
    cs = ControlState(resolve_dir)
    for a, b in zip(writes, writes, strict=True):
        cs.apply(a.encode(), 11)
        cs.apply(b.encode(), 12)
    assert list(cs.index_lists[lid]) == indices
    assert not cs.pending_lists


@settings(max_examples=60, deadline=None)
@given(st.lists(st.one_of(st.integers(0, 2000), st.integers(0, 1 << 39)), max_size=3000),
       st.booleans())
def test_index_lines_round_trip(indices, runs):
    if runs:  # long ascending runs become A:B tokens
        indices = list(range(5, 4000)) + indices + list(range(100, 103))
    lid = P.index_list_id(indices)
    cs = ControlState(resolve_dir)
    apply_all(cs, P.index_writes(lid, indices))
    assert list(cs.index_lists[lid]) == indices
    assert not cs.pending_lists


def test_large_index_list_spans_writes():
    indices = list(range(0, 600_000, 7))
    lid = P.index_list_id(indices)
    writes = P.index_writes(lid, indices)
    assert len(writes) > 1
    cs = ControlState(resolve_dir)
    apply_all(cs, writes)
    assert list(cs.index_lists[lid]) == indices


def define(cs: ControlState, roots: list[tuple[str, w.Root]], index=None) -> str:
    lid = P.index_list_id(index) if index is not None else None
    rels = [r for r, _ in roots]
    vid = P.view_id(rels, [r for _, r in roots], lid)
    writes = P.index_writes(lid, index) if lid else []
    writes.append(P.text(P.view_lines(vid, rels, [r for _, r in roots], lid)))
    apply_all(cs, writes)
    return vid


def root(n: int, ext=(".jpg", ".png")) -> w.Root:
    return w.Root("/x", ext, n, P.paths_digest([f"{i}.jpg" for i in range(n)]))


def test_view_dataset_and_loss_range():
    cs = ControlState(resolve_dir, dataset_size=lambda rel: 1000)
    vid = define(cs, [("train", root(10)), ("val", root(5, None))], index=[14, 0, 3])
    v = cs.views[vid]
    assert [r.rel for r in v.roots] == ["train", "val"] and v.roots[1].extensions is None
    assert list(v.index) == [14, 0, 3] and len(v) == 3
    cs.apply(f"dataset train view={vid}\nsampler random seed=1\nepoch 0\nloss 2 0.5\n".encode(), 9)
    js = cs.jobs["default"]
    assert js.dataset == "train" and js.view is v
    # indices are the view's (3 samples), not the root's (1000)
    with pytest.raises(ControlError, match="3 samples"):
        cs.apply(b"loss 3 0.5\n", 9)
    # switching back to the plain root changes the index space
    cs.apply(b"dataset train\nloss 999 1.0\n", 9)
    assert js.view is None


def refused(cs: ControlState, text: str, match: str) -> None:
    before = (dict(cs.views), dict(cs.index_lists), dict(cs.pending_lists), cs.accepted_writes)
    with pytest.raises(ControlError) as ei:
        cs.apply(text.encode(), 5)
    assert match in str(ei.value)
    assert match in cs.errors_text().decode().splitlines()[-1]
    assert (dict(cs.views), dict(cs.index_lists), dict(cs.pending_lists),
            cs.accepted_writes) == before


def test_refusals_with_reasons():
    cs = ControlState(resolve_dir)
    vid = define(cs, [("train", root(4))])
    other = "0" * 24
    refused(cs, f"dataset train view={other}\n", "unknown view")
    refused(cs, f"index {other} 0 1 2\nindex {other} end 2\n", "does not match its id")
    refused(cs, f"index {other} 0 1 2\nindex {other} end 3\n", "has 2 indices")
    refused(cs, f"index {other} 5 1\n", "continues at 0")
    refused(cs, "index xyz 0 1\n", "24 hex")
    refused(cs, f"index {other} 0 5:3\n", "bad index range")
    r = root(4)
    good = P.view_lines(vid, ["train"], [r], None)
    refused(cs, good[0].replace("count=4", "count=5") + "\n" + good[1] + "\n", "does not match")
    refused(cs, good[1] + "\n", "roots=1 but 0")
    refused(cs, good[0] + "\nepoch 1\n", "closed by their 'view'")
    refused(cs, good[0].replace(" train ", " nowhere ") + "\n" + good[1] + "\n",
            "not a directory")
    lid = P.index_list_id([9])
    apply_all(cs, P.index_writes(lid, [9]))
    vid2 = P.view_id(["train"], [r], lid)
    refused(cs, P.text(P.view_lines(vid2, ["train"], [r], lid)), "reaches index 9")
    refused(cs, f"sampler subset_random index={other} state=AAAA\n", "unknown index list")
    refused(cs, "sampler random state=!!\n", "base64")
    refused(cs, "sampler random seed=1 state=AAAA\n", "one of them")
    refused(cs, "sampler random\n", "seed= or state=")
    refused(cs, "sampler random state=" + "A" * 20000 + "\n", "longer than")
    refused(cs, "epoch " + "1" * 5000 + "\n", f"longer than {MAX_LINE}")


def test_sampler_state_line_fits():
    g = torch.Generator()
    g.manual_seed(3)
    from dlcachefs.clairvoyance.replay import encode_state

    cs = ControlState(resolve_dir)
    cs.apply(f"dataset train\nsampler random state={encode_state(g.get_state())} "
             f"loader_draws=each\nepoch 4\nsampler unknown reason=My%20Sampler\n".encode(), 3)
    assert cs.streams[("default", 0)].sampler.reason == "My Sampler"


# ----- generator states: the hook's announcement replays torch ----------------------------


Idx = IndexDataset  # ds[i] == i (module level: DataLoader workers pickle it)


@pytest.fixture
def hooked(monkeypatch):
    """torch.utils.data patched by the hook, announcing into a list (no mount); the
    originals are restored afterwards."""
    import dlcachefs.data.hook as hook

    classes = (data.RandomSampler, data.DistributedSampler, data.SubsetRandomSampler,
               data.DataLoader)
    saved = {c: c.__dict__["__iter__"] for c in classes}
    sent: list[list[str]] = []
    monkeypatch.setattr(hook, "target_of", lambda ds: object())
    monkeypatch.setattr(hook, "_send", lambda t, lines, job=None, extra_defs=(), weak=False,
                        loader=None: sent.append(lines) or True)
    hook._patch(data)
    try:
        yield sent
    finally:
        for c, it in saved.items():
            c.__iter__ = it
        if "_dlcachefs_patched" in data.RandomSampler.__dict__:
            del data.RandomSampler._dlcachefs_patched


def spec_of(line: str):
    return ControlState(resolve_dir)._parse_sampler(1, line.split()[1:])


def loader_orders(make, epochs: int) -> tuple[list[list[int]], float]:
    torch.manual_seed(11)
    dl = make()
    out = []
    for e in range(epochs):
        if hasattr(dl.sampler, "set_epoch"):
            dl.sampler.set_epoch(e)
        out.append([int(i) for b in dl for i in b])
    return out, float(torch.rand(()))  # what the global RNG continues with


CASES = ["shuffle_gen", "sampler_gen", "sampler_gen_shared", "subset_gen", "subset_global",
         "random_global", "distributed"]


def make_loader(case: str, n: int, seed: int, pre: int, batch: int):
    g = torch.Generator()
    g.manual_seed(seed)
    for _ in range(pre):  # the script drew from its generator before
        torch.randperm(3, generator=g)
    ds = Idx(n)
    sub = list(range(0, n, 2))
    if case == "shuffle_gen":
        return data.DataLoader(ds, batch_size=batch, shuffle=True, generator=g)
    if case == "sampler_gen":
        return data.DataLoader(ds, batch_size=batch, sampler=data.RandomSampler(ds, generator=g))
    if case == "sampler_gen_shared":
        return data.DataLoader(ds, generator=g, batch_sampler=data.BatchSampler(
            data.RandomSampler(ds, generator=g), batch, drop_last=False))
    if case == "subset_gen":
        return data.DataLoader(ds, batch_size=batch, generator=g,
                               sampler=data.SubsetRandomSampler(sub, generator=g))
    if case == "subset_global":
        return data.DataLoader(ds, batch_size=batch, sampler=data.SubsetRandomSampler(sub))
    if case == "distributed":
        return data.DataLoader(ds, batch_size=batch, sampler=data.DistributedSampler(
            ds, num_replicas=3, rank=2, seed=seed % 2**31, drop_last=pre % 2 == 1))
    return data.DataLoader(ds, batch_size=batch, shuffle=True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])
@given(st.sampled_from(CASES), st.integers(1, 60), st.integers(0, 2**63 - 1), st.integers(0, 3),
       st.integers(1, 9))
def test_hook_announces_replayable_orders_and_changes_nothing(hooked, case, n, seed, pre, batch):
    plain = None
    hooked.clear()
    got, after = loader_orders(lambda: make_loader(case, n, seed, pre, batch), 3)
    announced = [lines for lines in hooked]
    assert len(announced) == 3, announced
    # without the hook: the same orders and the same global RNG stream
    import dlcachefs.data.hook as hook  # noqa: F401

    saved = {c: c.__dict__["__iter__"] for c in _ORIG}
    try:
        for c, it in _ORIG.items():
            c.__iter__ = it
        plain = loader_orders(lambda: make_loader(case, n, seed, pre, batch), 3)
    finally:
        for c, it in saved.items():
            c.__iter__ = it
    assert plain == (got, after)
    sub = list(range(0, n, 2))
    for e, lines in enumerate(announced):
        sampler_line, epoch_line = lines
        assert epoch_line == f"epoch {e}"
        spec = spec_of(sampler_line)
        r = OrderReplayer(spec, n, base_epoch=e,
                          subset=sub if spec.kind == "subset_random" else None)
        assert r.order(e) == got[e]
        if e + 1 < len(got) and r.known(e + 1):
            assert r.order(e + 1) == got[e + 1]  # the next epoch is known exactly
        expect_next = case not in ("subset_global", "random_global")
        assert r.known(e + 1) == expect_next


_ORIG = {c: c.__dict__["__iter__"] for c in (data.RandomSampler, data.SubsetRandomSampler,
                                              data.DistributedSampler, data.DataLoader)}


def test_persistent_workers_draw_first_only(hooked):
    g = torch.Generator()
    g.manual_seed(5)
    dl = data.DataLoader(Idx(20), batch_size=4, shuffle=True, generator=g, num_workers=1,
                         persistent_workers=True)
    got = [[int(i) for b in dl for i in b] for _ in range(3)]
    assert [spec_of(lines[0]).loader_draws for lines in hooked] == ["first"] * 3
    spec = spec_of(hooked[0][0])
    r = OrderReplayer(spec, 20, base_epoch=0)
    assert [r.order(e) for e in range(3)] == got


def test_custom_sampler_is_announced_unknown(hooked, monkeypatch):
    import dlcachefs.data.hook as hook

    unknown: list[tuple[str, int]] = []
    monkeypatch.setattr(hook, "_unknown", lambda ds, reason, epoch, loader=None: unknown.append(
        (reason, epoch)))

    class Evens(data.Sampler):
        def __init__(self, n):
            self.n = n

        def __iter__(self):
            return iter(range(0, self.n, 2))

        def __len__(self):
            return self.n // 2

    dl = data.DataLoader(Idx(10), sampler=Evens(10), batch_size=2)
    for _ in range(2):
        assert [int(i) for b in dl for i in b] == [0, 2, 4, 6, 8]
    assert unknown == [("sampler Evens is not replayable", 0),
                       ("sampler Evens is not replayable", 1)]
    dl = data.DataLoader(Idx(6), batch_size=2)  # SequentialSampler
    list(dl)
    assert hooked[-1] == ["sampler sequential", "epoch 0"]


def test_state_base64_is_the_generator_state():
    from dlcachefs.clairvoyance.replay import decode_state, encode_state

    g = torch.Generator()
    g.manual_seed(123)
    torch.randperm(10, generator=g)
    s = encode_state(g.get_state())
    assert len(base64.b64decode(s)) == g.get_state().numel()
    h = torch.Generator()
    h.set_state(decode_state(s))
    assert torch.randperm(50, generator=h).tolist() == torch.randperm(50, generator=g).tolist()


# ----- the client's writes, applied by the mount's parser ----------------------------------


def test_client_view_writes_are_accepted(tmp_path, monkeypatch):
    """What the hook writes for a wrapped dataset (definition, large index list over
    several writes, announcement) is accepted; a new daemon gets the definition again."""
    import errno

    import dlcachefs.data.hook as hook

    folder = pytest.importorskip("torchvision.datasets.folder")
    mnt = tmp_path / "m"
    (mnt / ".dlcache").mkdir(parents=True)
    (mnt / ".dlcache" / "control").touch()
    for rel in ("train/a/1.jpg", "train/b/2.png", "train/b/3.jpg", "val/x/4.jpg"):
        (mnt / rel).parent.mkdir(parents=True, exist_ok=True)
        (mnt / rel).write_bytes(b"x")
    tr = folder.ImageFolder(str(mnt / "train"), loader=lambda p: p)
    va = folder.ImageFolder(str(mnt / "val"), loader=lambda p: p)
    import random

    idx = [random.Random(0).randrange(4) for _ in range(60_000)]
    ds = UserWrap(data.Subset(data.ConcatDataset([tr, va]), idx))
    state = {"cs": ControlState(resolve_dir)}

    def write_control(mount, writes):
        assert mount == str(mnt)
        for w_ in writes:
            try:
                state["cs"].apply(w_, 42)
            except ControlError as e:
                raise OSError(errno.EINVAL, str(e)) from None

    monkeypatch.setattr(hook, "write_control", write_control)
    monkeypatch.setattr(hook, "_sent", set())
    t = hook.target_of(ds)
    assert isinstance(t, hook.Target) and t.rels == ("train", "val")
    assert hook._send(t, ["sampler random seed=3 per_epoch=true", "epoch 0"])
    cs = state["cs"]
    js = cs.jobs["default"]
    assert js.dataset == "train" and js.view.vid == t.vid
    assert list(js.view.index) == idx and len(js.view) == len(ds)
    assert cs.accepted_writes > 3  # the index list took several writes
    n = cs.accepted_writes
    assert hook._send(t, ["epoch 1"])
    assert cs.accepted_writes == n + 1  # named, not sent again
    state["cs"] = ControlState(resolve_dir)  # a new daemon: the view is unknown to it
    assert hook._send(t, ["epoch 2"])
    assert state["cs"].jobs["default"].view.vid == t.vid
    assert state["cs"].refused_writes == 1  # the first try, before the definition
    # the importance sampler names the same view for the dataset the loader reads
    state["cs"] = ControlState(resolve_dir)
    sampler = hook.ImportanceSampler(hook.with_index(ds), seed=1)
    list(iter(sampler))
    js = state["cs"].jobs["default"]
    assert js.view.vid == t.vid and len(state["cs"].streams[("default", 0)].orders[0]) == len(ds)


def test_a_daemon_older_than_the_list_fields_gets_the_definition_without_them(
        tmp_path, monkeypatch):
    """A mount started before the roots' ``set=``/``sfx=`` fields refuses a definition
    holding them (EINVAL, an unknown field): the hook sends it again without them, and
    the training keeps its clairvoyance (it went without any)."""
    import errno

    import dlcachefs.data.hook as hook

    folder = pytest.importorskip("torchvision.datasets.folder")
    mnt = tmp_path / "m"
    (mnt / ".dlcache").mkdir(parents=True)
    (mnt / ".dlcache" / "control").touch()
    for rel in ("train/a/1.jpg", "train/b/2.png", "train/b/3.jpg"):
        (mnt / rel).parent.mkdir(parents=True, exist_ok=True)
        (mnt / rel).write_bytes(b"x")
    ds = UserWrap(data.Subset(folder.ImageFolder(str(mnt / "train"), loader=lambda p: p),
                              [2, 0, 1, 1]))
    cs = ControlState(resolve_dir)
    refused = []

    def write_control(mount, writes):
        for w_ in writes:
            if b" set=" in w_ or b" sfx=" in w_:
                refused.append(w_)
                raise OSError(errno.EINVAL, "unknown field 'set'")
            cs.apply(w_, 42)

    monkeypatch.setattr(hook, "write_control", write_control)
    monkeypatch.setattr(hook, "_sent", set())
    monkeypatch.setattr(hook, "_no_list_fields", set())
    t = hook.target_of(ds)
    assert hook._send(t, ["sampler random seed=3 per_epoch=true", "epoch 0"])
    assert len(refused) == 1 and cs.jobs["default"].view.vid == t.vid
    assert hook._send(t, ["epoch 1"]) and len(refused) == 1  # not tried again


def test_validation_loader_does_not_take_the_training_stream(monkeypatch):
    """A sequential (or unknown) loader announces only while no other dataset's loader
    owns the job's stream; a replayable one always does and takes it."""
    import dlcachefs.data.hook as hook

    monkeypatch.setattr(hook, "_claims", {})
    assert hook._claim("j", "val", weak=True)  # a sanity validation before training
    assert hook._claim("j", "train", weak=False)  # the training loader takes the stream
    assert not hook._claim("j", "val", weak=True)  # validation no longer replaces it
    assert hook._claim("j", "train", weak=True) and hook._claim("k", "val", weak=True)
    assert hook._claim("j", "other", weak=False)  # a second shuffled loader: as before


@settings(max_examples=100, deadline=None)
@given(st.integers(100, 3000), st.integers(0, 2**32), st.integers(1, 40))
def test_learned_order_similarity(n, seed, jitter):
    """A repeated order with loader-like local reordering is the same order; a reshuffle
    is not."""
    import random

    from dlcachefs.clairvoyance.learned import similar as _similar

    rnd = random.Random(seed)
    base = rnd.sample(range(10**6), n)
    jitter = min(jitter, n // 16)  # blocks up to 1/16 of the epoch reordered

    def jittered(xs):
        xs = list(xs)
        for i in range(0, len(xs), jitter):
            seg = xs[i:i + jitter]
            rnd.shuffle(seg)
            xs[i:i + jitter] = seg
        return xs

    assert _similar(jittered(base), jittered(base))
    assert _similar(jittered(base)[:-1], base)  # a missed open is tolerated
    other = base[:]
    rnd.shuffle(other)
    assert not _similar(other, base)


# ----- the hook never raises, never wastes the mount's error list ---------------------------


class _Loader:
    """Just what a pace report reads of a DataLoader (weakly referenced, a __dict__)."""


def test_pace_reports_stop_at_a_mount_that_refuses_them(monkeypatch):
    # a daemon older than the pace line refuses it (EINVAL): one refusal, then no more
    # (each would push a real error out of the mount's bounded .dlcache/errors)
    import errno

    import dlcachefs.data.hook as hook

    calls: list[str] = []

    def write_control(mount, writes):
        calls.append(mount)
        raise OSError(errno.EINVAL if mount == "/old" else errno.EIO, "refused")

    monkeypatch.setattr(hook, "write_control", write_control)
    monkeypatch.setattr(hook, "_no_pace", set())
    monkeypatch.setattr(hook, "_warned", set())
    recs = {}
    for mount in ("/old", "/flaky"):
        loader = _Loader()
        loader.__dict__["_dlcachefs_target"] = (mount, "j", None)
        recs[mount] = (hook._PaceReport(loader), loader)
    with pytest.warns(RuntimeWarning):
        for k in range(3):
            for rec, _loader in recs.values():
                rec.step(2.0 * k, 2.0 * k + 1, False)
                rec.flush(2.0 * k + 1)
    assert calls.count("/old") == 1
    assert calls.count("/flaky") == 3  # a transient error does not stop the reports


def test_pace_restarts_with_a_persistent_iterator(hooked, monkeypatch):
    # persistent_workers: DataLoader.__iter__ returns the same iterator each epoch; after
    # an epoch left early, the time until the next epoch is not a training step
    import dlcachefs.data.hook as hook

    monkeypatch.setattr(hook._PaceReport, "EVERY", float("inf"))  # no flush mid-test
    dl = data.DataLoader(Idx(12), batch_size=2, num_workers=1, persistent_workers=True)
    try:
        it = iter(dl)
        for _ in range(3):
            next(it)
        rec = it.__dict__["_dlcachefs_pace"]
        assert (rec.iters, rec.steps) == (3, 2)
        it2 = iter(dl)  # the next epoch, after a break
        assert it2 is it
        assert [int(i) for i in next(it2)] == [0, 1]
        assert (rec.iters, rec.steps) == (4, 2)  # the gap between epochs is not a step
        next(it2)
        assert (rec.iters, rec.steps) == (5, 3)
    finally:
        del dl, it
        import gc
        gc.collect()


def test_loader_iter_never_raises_from_the_pace_report(hooked, monkeypatch):
    import dlcachefs.data.hook as hook

    class Broken:
        def __init__(self, loader):
            raise RuntimeError("broken pace report")

    monkeypatch.setattr(hook, "_PaceReport", Broken)
    monkeypatch.setattr(hook, "_warned", set())  # the warning is expected here
    dl = data.DataLoader(Idx(6), batch_size=4)
    with pytest.warns(RuntimeWarning, match="pace"):
        assert [[int(i) for i in b] for b in dl] == [[0, 1, 2, 3], [4, 5]]


def test_batch_hint_stays_within_the_parsers_limits(monkeypatch):
    from types import SimpleNamespace as NS

    import dlcachefs.data.hook as hook
    from dlcachefs.data.hook import _batch_hint

    monkeypatch.setattr(hook, "_warned", set())

    assert _batch_hint(data.DataLoader(Idx(3), batch_size=P.MAX_BATCH + 1)) == []
    assert _batch_hint(NS(batch_size=32, num_workers=P.MAX_WORKERS + 1, prefetch_factor=2)
                       ) == ["batch 32"]
    assert _batch_hint(NS(batch_size=32, num_workers=4,
                          prefetch_factor=P.MAX_PREFETCH_FACTOR + 1)) == ["batch 32 workers=4"]

    class Odd:
        batch_size = 8

        @property
        def num_workers(self):
            raise RuntimeError("a property that raises")

    with pytest.warns(RuntimeWarning, match="batch hint"):
        assert _batch_hint(Odd()) == []


@given(st.integers(-2, P.MAX_BATCH + 2) | st.none(),
       st.integers(-2, P.MAX_WORKERS + 2) | st.none(),
       st.integers(-2, P.MAX_PREFETCH_FACTOR + 2) | st.none())
def test_batch_hint_is_always_accepted(size, workers, pf):
    from types import SimpleNamespace as NS

    from dlcachefs.data.hook import _batch_hint

    for line in _batch_hint(NS(batch_size=size, num_workers=workers, prefetch_factor=pf)):
        cs = ControlState(resolve_dir)
        cs.apply(f"job j\n{line}\n".encode(), 1)  # raises ControlError when refused
        assert cs.streams[("j", 0)].batch == size


def test_send_never_raises(monkeypatch):
    import dlcachefs.data.hook as hook

    monkeypatch.setattr(hook, "_warned", set())

    class BadTarget:
        vid = "bad-target-for-send"
        mount = "/nowhere"

        def dataset_line(self):
            raise RuntimeError("broken view")

    with pytest.warns(RuntimeWarning, match="could not announce"):
        assert hook._send(BadTarget(), ["epoch 0"]) is False


# ----- which mounts a starting training tells (the replay worker's start) -----------------


def test_the_mounts_a_training_names_are_prepared_else_all():
    from dlcachefs.data.hook import mounts_to_prepare

    mounts = ["/mnt/a", "/mnt/ab", "/data"]
    pick = mounts_to_prepare
    assert pick(mounts, ["train.py", "/mnt/a/train"], "/home/u") == ["/mnt/a"]
    # a prefix of a name is not a mount of it; --opt=PATH and relative paths count
    assert pick(mounts, ["t.py", "--data=/mnt/ab/x", "../../mnt/a"], "/home/u") == [
        "/mnt/ab", "/mnt/a"]
    assert pick(mounts, ["t.py", "--epochs", "3"], "/data/run") == ["/data"]  # the cwd
    assert pick(mounts, ["t.py", "--config", "c.yaml"], "/home/u") == mounts  # none named
    assert pick([], ["t.py", "/mnt/a"], "/") == []


def test_preparing_stats_only_the_named_mounts_when_one_is_the_users(tmp_path, monkeypatch):
    """prepare_mounts: a training that names one of its user's mounts touches no other
    (a stopped daemon's mount would hang the stat); one that names none, or only another
    user's, tells every mount of its user, as before."""
    import os
    import sys

    from dlcachefs.data import hook

    mnts = []
    for name in ("a", "b", "c"):
        (tmp_path / name / ".dlcache").mkdir(parents=True)
        (tmp_path / name / ".dlcache" / "control").write_text("")
        mnts.append(str(tmp_path / name))
    os.chown(tmp_path / "b" / ".dlcache" / "control", 4242, 4242)  # another user's
    monkeypatch.setattr(hook, "dlcachefs_mounts", lambda: list(mnts))
    statted = []
    real_stat = os.stat
    monkeypatch.setattr(hook.os, "stat", lambda p, *a, **k: statted.append(p) or real_stat(
        p, *a, **k))
    monkeypatch.chdir(tmp_path)

    def prepare(*argv: str) -> list[str]:
        statted.clear()
        monkeypatch.setattr(sys, "argv", ["train.py", *argv])
        return hook.prepare_mounts()

    assert prepare(mnts[0] + "/train") == [mnts[0]]
    assert [os.path.dirname(os.path.dirname(p)) for p in statted] == [mnts[0]]
    assert prepare("--epochs", "3") == [mnts[0], mnts[2]]  # none named: all of the user's
    assert prepare(mnts[1]) == [mnts[0], mnts[2]]  # only another user's named


def test_preparing_never_raises_where_the_working_directory_is_gone(tmp_path):
    """The hook's thread at interpreter start: a removed working directory is no error
    of the training's (a stand-in mount: a directory holding ``.dlcache/control``)."""
    import subprocess
    import sys

    fake = tmp_path / "mnt"
    (fake / ".dlcache").mkdir(parents=True)
    (fake / ".dlcache" / "control").write_text("")
    gone = tmp_path / "gone"
    gone.mkdir()
    code = ("import os, sys; from dlcachefs.data import hook;"
            "hook.dlcachefs_mounts = lambda: [sys.argv[2]];"
            "os.chdir(sys.argv[1]); os.rmdir(sys.argv[1]);"
            "print(hook.prepare_mounts())")
    r = subprocess.run([sys.executable, "-c", code, str(gone), str(fake)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == repr([str(fake)])  # told (none named: every one of them)
