"""Importance and substitution through a real mount (iCACHE): losses in, H-list built,
missed L-samples served with cached L-samples of the same class directory, H-samples
never substituted; bad loss lines refused with a reason."""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest
from conftest import requires_fuse

pytestmark = requires_fuse

CLASSES = ("ant", "bee", "cat")
PER_CLASS = 24


def make_tree(root: Path) -> list[Path]:
    rnd = random.Random(7)
    files = []
    for c in CLASSES:
        (root / "train" / c).mkdir(parents=True)
        for i in range(PER_CLASS):
            p = root / "train" / c / f"{i:03d}.jpg"
            p.write_bytes(rnd.randbytes(rnd.randint(1500, 2500)))
            files.append(p)
    return files  # ImageFolder order: classes sorted, files sorted


def write_control(mnt: Path, text: str) -> None:
    fd = os.open(mnt / ".dlcache" / "control", os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def wait_for(m, pred, timeout: float = 30.0) -> dict:
    return m.wait_stats(pred, timeout=timeout)


def epoch_order(n: int, epoch: int) -> list[int]:
    return random.Random(epoch).sample(range(n), n)  # a shuffled epoch, as training reads


def announce_epoch(mnt: Path, n: int, epoch: int) -> None:
    order = " ".join(map(str, epoch_order(n, epoch)))
    write_control(mnt, f"job j\ndataset train\nsampler explicit\norder {epoch} 0 {order}\n"
                       f"order {epoch} end {n}\nepoch {epoch}\n")


def test_substitution_stays_in_the_class_and_never_touches_h_samples(tmp_path, mount):
    src = tmp_path / "src"
    files = make_tree(src)
    n = len(files)
    losses = {i: float((i * 37) % n) for i in range(n)}  # a permutation: H and L mixed
    k = round(0.5 * n)
    high = set(sorted(range(n), key=losses.__getitem__, reverse=True)[:k])
    m = mount(src, "--policy", "icache:package=4K,h_ratio=0.5", "--substitute",
              "--h-fraction", "0.5", "--cache-size", "60K", "--chunk-size", "4K")
    loss_line = "loss " + " ".join(f"{i} {v}" for i, v in losses.items()) + "\n"
    by_dir: dict[Path, dict[bytes, Path]] = {}
    for p in files:
        by_dir.setdefault(p.parent, {})[p.read_bytes()] = p
    subs_total = 0
    for epoch in range(4):
        announce_epoch(m.mnt, n, epoch)
        st = wait_for(m, lambda s, e=epoch: s["streams"].get("j/0", {}).get("epoch") == e)
        if epoch >= 1:  # the H-list from the losses reported so far
            st = wait_for(m, lambda s, e=epoch: (s["importance"] or {}).get("version", 0) >= e)
            assert st["importance"]["h_samples"] == k
        for i in epoch_order(n, epoch):
            p = files[i]
            got = (m.mnt / p.relative_to(src)).read_bytes()
            want = p.read_bytes()
            if got == want:
                continue
            # a substitute: another file's exact bytes, from the SAME class directory,
            # for an L-sample only
            assert i not in high, f"H-sample {p.name} was substituted"
            assert got in by_dir[p.parent], f"{p} served bytes from outside its class"
            sub = by_dir[p.parent][got]
            assert sub != p and files.index(sub) not in high
            subs_total += 1
        write_control(m.mnt, "job j\n" + loss_line)
        wait_for(m, lambda s, e=epoch: s["losses"] >= n * (e + 1))
    st = m.stats()
    assert st["substitutions"] == subs_total > 0
    assert sum(st["streams"]["j/0"]["substitutions"].values()) >= 1
    assert st["policy"]["name"].startswith("icache")


def test_without_substitute_every_read_is_exact(tmp_path, mount):
    src = tmp_path / "src"
    files = make_tree(src)
    n = len(files)
    m = mount(src, "--policy", "icache:package=4K", "--cache-size", "40K", "--chunk-size", "4K")
    for epoch in range(3):
        announce_epoch(m.mnt, n, epoch)
        wait_for(m, lambda s, e=epoch: s["streams"].get("j/0", {}).get("epoch") == e)
        for i in epoch_order(n, epoch):
            p = files[i]
            assert (m.mnt / p.relative_to(src)).read_bytes() == p.read_bytes()
        write_control(m.mnt, "job j\nloss " + " ".join(f"{i} {i % 5}.5" for i in range(n)))
    assert m.stats()["substitutions"] == 0


@pytest.mark.parametrize("line, reason", [
    ("loss 1", "pairs"),
    ("loss 1 0.5 2", "pairs"),
    ("loss x 0.5", "integer"),
    ("loss 1 abc", "number"),
    ("loss 1 nan", "finite"),
    ("loss 1 inf", "finite"),
    ("loss 1 -inf", "finite"),
    ("loss 99999 0.5", "range"),
    ("loss -1 0.5", ""),
])
def test_bad_loss_lines_are_refused_with_a_reason(tmp_path, mount, line, reason):
    src = tmp_path / "src"
    make_tree(src)
    m = mount(src)
    write_control(m.mnt, "job j\ndataset train\nsampler sequential\nepoch 0\n")
    wait_for(m, lambda s: s["streams"].get("j/0", {}).get("samples") == len(CLASSES) * PER_CLASS)
    with pytest.raises(OSError) as ei:
        write_control(m.mnt, f"job j\n{line}\n")
    assert ei.value.errno == errno.EINVAL
    errors = (m.mnt / ".dlcache" / "errors").read_text()
    assert "refused" in errors and reason.lower() in errors.lower()
    write_control(m.mnt, "job j\nloss 0 1.5 1 2.5\n")  # the mount is fine afterwards
    assert wait_for(m, lambda s: s["losses"] >= 2)["losses"] == 2


def test_trace_recorded_by_the_mount_replays_in_simulate(tmp_path, mount):
    import json
    import subprocess
    import sys

    from dlcachefs.clairvoyance.trace import load_trace

    src = tmp_path / "src"
    files = make_tree(src)
    n = len(files)
    trace = tmp_path / "trace.json"
    m = mount(src, "--trace", str(trace))
    for epoch in range(2):
        announce_epoch(m.mnt, n, epoch)
        wait_for(m, lambda s, e=epoch: s["streams"].get("j/0", {}).get("epoch") == e)
        for i in epoch_order(n, epoch):
            (m.mnt / files[i].relative_to(src)).read_bytes()
        write_control(m.mnt, "job j\nloss " + " ".join(f"{i} {i / 10}" for i in range(n)))
        wait_for(m, lambda s, e=epoch: s["losses"] >= n * (e + 1))
    # the third epoch read at once after its announcement: its first opens may come
    # while its order is being computed, and are its own (they were recorded under the
    # epoch before, where they were dropped as repeats)
    announce_epoch(m.mnt, n, 2)
    for i in epoch_order(n, 2):
        (m.mnt / files[i].relative_to(src)).read_bytes()
    wait_for(m, lambda s: s["streams"].get("j/0", {}).get("epoch") == 2)
    m.umount()
    t = load_trace(str(trace))
    assert t.epochs[:2] == [epoch_order(n, 0), epoch_order(n, 1)]
    assert sorted(t.epochs[2]) == list(range(n)), t.epochs[2]
    assert t.sizes == [p.stat().st_size for p in files]
    assert t.classes == [CLASSES.index(p.parent.name) for p in files]
    assert t.losses[1][5] == 0.5
    out = tmp_path / "sim.json"
    r = subprocess.run([sys.executable, "-m", "dlcachefs.cli", "simulate", "--trace", str(trace),
                        "--cache", "0.3,0.6", "--json", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "belady" in r.stdout
    doc = json.loads(out.read_text())
    for row in doc["rows"]:
        assert row["lru"]["accesses"] == 3 * n
        assert row["reuse-distance"]["hit_ratio"] <= row["belady"]["hit_ratio"] + 1e-9


def test_two_jobs_keep_their_losses_apart(tmp_path, mount):
    src = tmp_path / "src"
    files = make_tree(src)
    n = len(files)
    m = mount(src)
    for job in ("a", "b"):
        write_control(m.mnt, f"job {job}\ndataset train\nsampler sequential\nepoch 0\n")
    wait_for(m, lambda s: all(s["streams"].get(f"{j}/0", {}).get("samples") == n for j in "ab"))
    write_control(m.mnt, "job a\nloss " + " ".join(f"{i} {i}" for i in range(10)) + "\n")
    write_control(m.mnt, "job b\nloss " + " ".join(f"{i} {n - i}" for i in range(n)) + "\n")
    st = wait_for(m, lambda s: s["losses"] >= 10 + n)
    jobs = st["importance"]["jobs"]
    assert jobs["a"]["reported"] == 10 and jobs["b"]["reported"] == n


# the out-of-range loss the test sends on purpose is dropped with a reason: in .dlcache/errors
# (asserted below) and in the log
@pytest.mark.daemon_log_allows(r"WARNING dlcachefs\.importance\.losses: 1 losses of job 'j' dropped: "
                               r"index out of range, dataset 'train' has 72 samples$")
def test_losses_sent_with_the_announcement_are_kept(tmp_path, mount):
    """A script that announces and reports losses at once: the dataset's sample list is
    not known when the write arrives, so nothing can be range-checked yet; the losses wait
    for the list and are applied, and an index that then turns out out of range is dropped
    with a reason in .dlcache/errors (never silently)."""
    src = tmp_path / "src"
    files = make_tree(src)
    n = len(files)
    m = mount(src)
    pairs = " ".join(f"{i} {1.0 + i}" for i in range(n))
    write_control(m.mnt, f"job j\ndataset train\nsampler sequential\nepoch 0\n"
                         f"loss {pairs} {n + 5} 1\n")
    st = wait_for(m, lambda s: s["losses"] + s["losses_ignored"] >= n + 1)
    assert st["losses"] == n and st["losses_ignored"] == 1
    assert st["losses_waiting"] == 0
    assert st["importance"]["jobs"]["j"]["reported"] == n
    errors = (m.mnt / ".dlcache" / "errors").read_text()
    assert "1 losses of job 'j' dropped: index out of range" in errors
    assert "has 72 samples" in errors


@pytest.mark.daemon_log_allows(r"importance now for dataset 'val' \(losses of job 'v'\): the "
                               r"72 losses reported for dataset 'train' are dropped")
def test_an_eval_job_over_another_dataset_keeps_the_training_losses(tmp_path, mount):
    """Importance is one dataset's per mount. A job that reports no losses (an eval loader
    over val/) starting its epochs does not take it away from train/ (before, the 72
    losses of train's job were dropped with one log line and no counter); the losses of
    another dataset do, and that is counted (``losses_dropped``) and said in
    .dlcache/errors."""
    src = tmp_path / "src"
    files = make_tree(src)
    n = len(files)
    for c in CLASSES:  # a val/ set, as small
        (src / "val" / c).mkdir(parents=True)
        (src / "val" / c / "000.jpg").write_bytes(b"v" * 100)
    m = mount(src)
    announce_epoch(m.mnt, n, 0)
    write_control(m.mnt, "job j\nloss " + " ".join(f"{i} {i}" for i in range(n)) + "\n")
    wait_for(m, lambda s: s["losses"] == n and s["importance"]["dataset"] == "train")
    write_control(m.mnt, "job e\ndataset val\nsampler sequential\nepoch 0\n")
    st = wait_for(m, lambda s: s["streams"].get("e/0", {}).get("samples") == len(CLASSES))
    for path in sorted((m.mnt / "val").rglob("*.jpg")):
        path.read_bytes()
    write_control(m.mnt, "job e\nepoch 1\n")
    st = wait_for(m, lambda s: s["streams"]["e/0"].get("epoch") == 1)
    assert st["importance"]["dataset"] == "train"
    assert st["importance"]["jobs"]["j"]["reported"] == n and st["losses_dropped"] == 0
    # losses for val/ from another job: the switch happens, counted and said
    write_control(m.mnt, "job v\ndataset val\nloss 0 1.0\n")
    st = wait_for(m, lambda s: s["importance"]["dataset"] == "val")
    assert st["losses_dropped"] == n
    assert "the 72 losses reported for dataset 'train' are dropped" in (
        m.mnt / ".dlcache" / "errors").read_text()


@pytest.mark.parametrize("next_known", [True, False])
def test_cache_size_holds_with_substitution_and_units_larger_than_the_cache(tmp_path, mount,
                                                                            next_known):
    """Issue 9, item 4: ``--policy icache --substitute`` with a cache smaller than the
    package size and than ``--chunk-size`` (a 2 MB cache over 27 MB, 1 MB packages and
    16 MB chunks, scaled down) once showed 3x the limit in one chunk of the next epoch's
    log. Over several shuffled epochs, with the next order known (next-epoch logs are
    planned) or not (packages and single samples go through the chunk writer), with
    losses reported: ``cached_bytes`` and ``chunk_bytes`` stay within the
    limit whenever stats is read, and every read returns the source's bytes (of the file
    asked for, or of a substitute of the same class)."""
    rnd = random.Random(11)
    src = tmp_path / "src"
    files = []
    for c in CLASSES:
        (src / "train" / c).mkdir(parents=True)
        for i in range(30):
            p = src / "train" / c / f"{i:03d}.jpg"
            p.write_bytes(rnd.randbytes(rnd.randint(6000, 10000)))
            files.append(p)
    n = len(files)
    by_dir: dict[Path, dict[bytes, Path]] = {}
    for p in files:
        by_dir.setdefault(p.parent, {})[p.read_bytes()] = p
    m = mount(src, "--policy", "icache:package=128K", "--substitute", "--h-fraction", "0.5",
              "--cache-size", "96K", "--chunk-size", "256K")
    limit = 96 << 10

    def within(st: dict) -> None:
        assert st["cache_limit_bytes"] == limit
        assert st["cached_bytes"] <= st["chunk_bytes"] <= limit, st
        assert st["invariant_violations"] == 0

    def order_lines(epoch: int) -> str:
        return (f"order {epoch} 0 {' '.join(map(str, epoch_order(n, epoch)))}\n"
                f"order {epoch} end {n}\n")

    write_control(m.mnt, "job j\ndataset train\nsampler explicit\n" + order_lines(0))
    for epoch in range(4):
        # this epoch starts (and when the next one's order is known, its log is planned)
        nxt = order_lines(epoch + 1) if next_known else ""
        write_control(m.mnt, "job j\n" + nxt + f"epoch {epoch}\n")
        if not next_known:
            write_control(m.mnt, "job j\n" + order_lines(epoch + 1))
        wait_for(m, lambda s, e=epoch: s["streams"].get("j/0", {}).get("epoch") == e)
        for k, i in enumerate(epoch_order(n, epoch)):
            p = files[i]
            got = (m.mnt / p.relative_to(src)).read_bytes()
            assert got == p.read_bytes() or (
                got in by_dir[p.parent] and m.stats()["substitutions"] > 0), p
            if k % 8 == 0:
                within(m.stats())
        write_control(m.mnt, "job j\nloss " + " ".join(
            f"{i} {(i * 37) % n}.5" for i in range(n)) + "\n")
        within(wait_for(m, lambda s, e=epoch: s["losses"] >= n * (e + 1)))
    st = m.stats()
    within(st)
    assert st["chunks_written"] + st["reorder_chunks"] > 0  # something was cached
    m.umount()  # the last commits are checked too (the fixture reads the daemon's log)


TRAIN_WITH_LOSSES = r'''
import hashlib, json, os, sys
import torch
from torchvision import datasets
from dlcachefs.data.hook import LossReporter, install, with_index

install()  # the sampler hook: each shuffled epoch is announced to the mount
root, mnt, out, epochs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
torch.manual_seed(0)
ds = with_index(datasets.ImageFolder(root, loader=lambda p: open(p, "rb").read()))
n = len(ds)


def collate(batch):
    return batch


dl = torch.utils.data.DataLoader(ds, batch_size=16, shuffle=True, num_workers=2,
                                 collate_fn=collate)
reporter = LossReporter(root)
with open(out, "w") as f:
    for epoch in range(epochs):
        items = []
        for batch in dl:
            idx = [i for _, _, i in batch]
            items += [(i, y, hashlib.sha256(x).hexdigest()) for x, y, i in batch]
            # a fixed loss per sample (a permutation of the indices): a known H-list
            reporter.report(idx, [((i * 37) % n) / n for i in idx])
        reporter.flush()
        with open(os.path.join(mnt, ".dlcache", "stats"), "rb") as s:
            st = json.loads(s.read())
        f.write(json.dumps({"epoch": epoch, "items": items,
                            "version": (st["importance"] or {}).get("version", 0)}) + "\n")
'''


@pytest.mark.parametrize("cache", ["2M", "1M"])  # 1M: packages shrink to the L-share
def test_training_with_defaults_and_a_small_cache_gets_substitutes_from_packages(
        tmp_path, mount, cache):
    """Issue 9, item 5: icache with its defaults (1 MiB packages), --substitute and a 2 MiB
    cache under a shuffled ImageFolder training that reports every sample's loss with
    LossReporter. The packer fills the L-cache once the H-list exists, so substitutions
    happen within two epochs of the first H-list; every byte served is a source file of
    the requested file's class directory, and an H-sample is always served itself. A
    cache of one package gets packages of half of it."""
    import hashlib
    import json
    import subprocess
    import sys

    pytest.importorskip("torchvision")
    src = tmp_path / "src"
    rnd = random.Random(3)
    for c in range(5):
        d = src / f"class{c}"
        d.mkdir(parents=True)
        for i in range(50):
            (d / f"{i:03d}.jpg").write_bytes(rnd.randbytes(rnd.randint(15_000, 25_000)))
    m = mount(src, "--policy", "icache", "--substitute", "--cache-size", cache)
    files = sorted(src.rglob("*.jpg"))  # ImageFolder order: classes sorted, files sorted
    n = len(files)
    sha = [hashlib.sha256(p.read_bytes()).hexdigest() for p in files]
    by_class: dict[str, set[str]] = {}
    for p, h in zip(files, sha, strict=True):
        by_class.setdefault(p.parent.name, set()).add(h)
    k = round(0.7 * n)  # --h-fraction 0.7 of the fixed losses (i * 37 % n) / n
    high = set(sorted(range(n), key=lambda i: (i * 37) % n, reverse=True)[:k])
    script = tmp_path / "train.py"
    script.write_text(TRAIN_WITH_LOSSES)
    out = tmp_path / "served.jsonl"
    epochs = 4
    r = subprocess.run([sys.executable, str(script), str(m.mnt), str(m.mnt), str(out),
                        str(epochs)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == epochs
    subs_by_epoch = [0] * epochs
    for row in rows:
        assert sorted(i for i, _, _ in row["items"]) == list(range(n))
        subs = [h for i, _, h in row["items"] if h != sha[i]]
        assert len(set(subs)) == len(subs)  # a substitute serves one miss an epoch
        for i, y, h in row["items"]:
            cls = files[i].parent.name
            assert y == int(cls[-1])  # ImageFolder's label of the requested path
            if h == sha[i]:
                continue
            assert i not in high, f"H-sample {files[i]} was substituted"
            assert h in by_class[cls], f"{files[i]} served bytes from outside its class"
            subs_by_epoch[row["epoch"]] += 1
    # the first H-list is built from epoch 0's losses when epoch 1 starts
    first = next(e for e, row in enumerate(rows) if row["version"] >= 1)
    assert first <= 1, [row["version"] for row in rows]
    assert sum(subs_by_epoch[first : first + 3]) > 0, subs_by_epoch
    st = m.stats()
    assert st["substitutions"] == sum(subs_by_epoch)
    assert st["packer"]["packages"] >= 1 and st["policy"]["packages"] >= 1
    limit = 2 << 20 if cache == "2M" else 1 << 20
    pol = st["policy"]
    assert pol["l_capacity"] >= min(1 << 20, limit // 2)  # one package, or half the cache
    assert pol["package_size"] == min(1 << 20, pol["l_capacity"])
    assert st["chunk_bytes"] <= limit
    assert sum(int(v) for v in st["policy"]["substitutions_by_epoch"].values()) == sum(
        subs_by_epoch)
