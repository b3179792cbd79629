"""Clairvoyant epochs through a real mount: the sampler announced by the launcher, the
next epoch's log laid out in its order (LCache), prefetch ahead of the reader."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import requires_fuse
from test_t5_torch import make_images

from dlcachefs.testing.mounting import STALE_MOUNT

pytest.importorskip("torchvision")
pytestmark = requires_fuse

TRAIN = r'''
import hashlib, json, os, sys, time, torch
from torchvision import datasets, transforms
root, epochs, kind = sys.argv[1], int(sys.argv[2]), sys.argv[3]
first = int(sys.argv[4]) if len(sys.argv) > 4 else 0
def tolerant(path):  # a loader that skips files deleted since the listing
    try:
        return datasets.folder.default_loader(path)
    except FileNotFoundError:
        from PIL import Image
        return Image.new("RGB", (16, 16))
ds = datasets.ImageFolder(root, transform=transforms.Compose(
    [transforms.Resize((16, 16)), transforms.ToTensor()]),
    **({"loader": tolerant} if os.environ.get("DLC_REPLACE") else {}))
if kind == "distributed":
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=1, rank=0, seed=7)
    dl = torch.utils.data.DataLoader(ds, batch_size=32, sampler=sampler, num_workers=2)
else:
    sampler = None
    torch.manual_seed(3)
    dl = torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True, num_workers=2)
stats_path = os.path.join(root, ".dlcache", "stats")

def stats():
    if not os.path.exists(stats_path):
        return None
    with open(stats_path) as f:
        return json.load(f)

out = []
# the replay worker has imported torch (niced, it may take seconds on a loaded machine):
# the first epoch's order is known when it is announced, so it is fetched ahead (polled
# with a deadline; nothing timed)
deadline = time.monotonic() + 120
while stats() is not None and time.monotonic() < deadline:
    if stats()["sampler_replay_ready"]:
        break
    time.sleep(0.1)
def replace_files(src, n, gone, epoch):
    # the dataset changes between epochs: n files get bytes appended in the source (a
    # JPEG decoder ignores bytes after its end marker: the same images, new sizes), and
    # ``gone`` others are deleted
    import random
    picked = random.Random(epoch).sample(ds.samples, n + gone)
    for path, _ in picked[n:]:
        p = os.path.join(src, os.path.relpath(path, root))
        if os.path.exists(p):
            os.unlink(p)
    for path, _ in picked[:n]:
        p = os.path.join(src, os.path.relpath(path, root))
        if not os.path.exists(p):
            continue
        with open(p, "rb") as f:
            data = f.read()
        with open(p + ".tmp", "wb") as f:
            f.write(data + bytes(range(256)) * (epoch + 3))
        os.replace(p + ".tmp", p)
for epoch in range(first, first + epochs):
    if sampler is not None:
        sampler.set_epoch(epoch)
    if epoch > first and os.environ.get("DLC_REPLACE"):
        src, n, gone = os.environ["DLC_REPLACE"].rsplit(":", 2)
        replace_files(src, int(n), int(gone), epoch)
    before = stats()
    samples = []
    for x, y in dl:
        for xi, yi in zip(x, y):
            samples.append((hashlib.sha256(xi.numpy().tobytes()).hexdigest()[:16], int(yi)))
    after = stats()
    if after is not None:
        # let the background work for the next epoch settle (no timing is asserted)
        deadline = time.monotonic() + float(os.environ.get("DLC_SETTLE_S", "300"))
        while time.monotonic() < deadline:
            s = stats()
            st = s["streams"].get("default/0", {})
            nl = st.get("next_log")
            if (s["pending_bytes"] == 0 and st.get("position") == len(samples)
                    and (nl is None or nl["sealed"] == nl["chunks"])):
                break
            time.sleep(0.1)
        else:  # say what never settled (the caller's timeout reports it)
            print("not settled: pending_bytes", s["pending_bytes"], "position",
                  st.get("position"), "of", len(samples), "next_log", nl, file=sys.stderr)
            if os.environ.get("DLC_UNSETTLED"):
                with open(os.environ["DLC_UNSETTLED"], "a") as f:
                    json.dump(s, f)
                    f.write("\n")
        if os.environ.get("DLC_DROP"):  # the next epoch finds no page of the files
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
    out.append({"samples": samples, "before": before, "after": after})
print(json.dumps(out))
'''


#: files changed, and deleted, in the source before each epoch after the first
#: ("changing")
REPLACED, DELETED = 20, 3


def _run(cmd: list[str], env: dict | None = None) -> list[dict]:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                       env=None if env is None else {**os.environ, **env})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _delta(ep: dict, key: str) -> int:
    return ep["after"][key] - ep["before"][key]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("clair") / "src"
    make_images(src, classes=8, per_class=250)  # 2,000 files
    return src


@pytest.mark.parametrize("reorder", [
    pytest.param(mode, marks=pytest.mark.skipif(
        os.geteuid() != 0, reason="drops the page cache between epochs"))
    for mode in ("always", "small-memory", "changing")] + ["default"])
def test_three_epochs_with_the_launcher(dataset, mount, tmp_path, reorder):
    """``always`` (``--reorder-min 0``, the page cache dropped between epochs, else the
    kernel serves epochs 2 and 3 and no log is read): LCache's next-epoch log is laid out
    and epochs 2 and 3 read it front to back, each chunk once. ``small-memory``: the same
    with a memory tier of 3 chunks for a log of ~19 (chunks loaded ahead of the
    reader, or left by one loader worker for a moment while the other still reads them,
    were evicted before their records were read, and read again: 38 reads for 19).
    ``default``: the dataset fits in half the memory tier, so no second copy is written
    during epoch 1 (the stream says why) and epochs 2 and 3 read each chunk of the first
    epoch's logs at most once, whole, into memory."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    extra = {"always": ["--reorder-min", "0"], "default": [],
             "small-memory": ["--reorder-min", "0", "--memory", "1M"],
             "changing": ["--reorder-min", "0", "--revalidate", "0"]}[reorder]
    env = None if reorder == "default" else {"DLC_DROP": "1"}
    src, direct_src, direct_env = dataset, dataset, None
    if reorder == "changing":  # files change between epochs: on copies of the dataset
        src, direct_src = tmp_path / "src", tmp_path / "direct"
        shutil.copytree(dataset, src)
        shutil.copytree(dataset, direct_src)
        env["DLC_REPLACE"] = f"{src}:{REPLACED}:{DELETED}"
        direct_env = {"DLC_REPLACE": f"{direct_src}:{REPLACED}:{DELETED}"}
        # (a log left with unsealed chunks, or a position that stops, never settles: its
        # assertion below says so after 2 minutes, not at the test's timeout)
        env["DLC_SETTLE_S"] = "120"
    m = mount(src, "--chunk-size", "256K", *extra)
    direct = _run([sys.executable, str(script), str(direct_src), "3", "distributed"],
                  env=direct_env)
    # (--no-intercept: this is the daemon's read path; in-process reads: test_t5_intercept)
    through = _run([sys.executable, "-m", "dlcachefs.cli", "run", "--no-intercept", "--",
                    sys.executable, str(script), str(m.mnt), "3", "distributed"], env=env)
    for d, t in zip(direct, through, strict=True):
        assert t["samples"] == d["samples"]  # same samples, same labels, same order
    e1, e2, e3 = through
    assert _delta(e1, "bytes_from_source") > 0
    # epoch 1: what was fetched ahead of the reader is served from memory, never read
    # back from the log it was just written to (with 1M of memory, the fetches ahead of
    # the reader that memory cannot hold are, a record at a time: no more reads than
    # samples)
    assert _delta(e1, "prefetched") > 0
    backs = len(e1["samples"]) if reorder == "small-memory" else 0
    assert _delta(e1, "record_reads") <= backs and _delta(e1, "chunk_reads") == 0, (
        _delta(e1, "record_reads"), _delta(e1, "chunk_reads"))
    st = m.stats()
    chunks = st["chunks"]
    for ep in (e2, e3):
        if reorder == "changing":  # the changed files come from the source, nothing else
            assert 0 < _delta(ep, "bytes_from_source") <= REPLACED * 16 << 10
            assert _delta(ep, "misses") <= REPLACED
            # the deleted files' positions were passed (the stream's position stopped at
            # the first of them for the rest of the epoch, and its prefetch with it)
            assert ep["after"]["streams"]["default/0"]["position"] == len(ep["samples"])
        else:
            assert _delta(ep, "bytes_from_source") == 0  # the cache serves epochs 2 and 3
            assert _delta(ep, "misses") == 0
        reads = _delta(ep, "chunk_reads")
        stream = ep["before"]["streams"]["default/0"]
        if reorder != "default":
            # the epoch's reordered log, each chunk once, front to back: every read but
            # the first follows a neighbour (counted in the order the reads are asked
            # for, so preloads finishing out of order do not matter)
            seq = _delta(ep, "sequential_chunk_reads")
            # (changing: epoch 3's log was planned before epoch 2 opened the files changed
            # since epoch 1; their slots hold filler records and every chunk was sealed:
            # before, those chunks stayed unsealed and epoch 3 read 8.8x what it served)
            assert stream["next_log"]["sealed"] == stream["next_log"]["chunks"], stream
            assert reads == stream["next_log"]["chunks"], reads
            assert reads > 0 and seq >= reads - 1, (reads, seq)
            # (an open between the epoch's announcement and its switch may read its
            # record alone, at the pace of the machine: a few, never a chunk's worth)
            singles = 4
            if reorder == "changing":
                # the files changed before epoch 2 were cached apart, in epoch 2, in the
                # writer's chunks: in epoch 3 each is read alone, never its whole chunk
                # for one record (1.25x read per byte served with two ranks, 1.03x now)
                singles += REPLACED
                disk, served = _delta(ep, "cache_disk_bytes_read"), _delta(ep, "bytes_from_cache")
                assert disk <= 1.2 * served, (disk, served)
            assert _delta(ep, "record_reads") <= singles, _delta(ep, "record_reads")
        else:
            assert stream["next_log"] is None and "not needed" in stream["reorder"], stream
            # no read amplification: what is not in memory already (chunks epoch 1
            # sealed stay there) is read once, a chunk whole or a record planned or
            # asked for, never both
            singles = _delta(ep, "record_reads") + _delta(ep, "planned_records")
            assert reads <= chunks and singles <= len(ep["samples"]), (reads, singles)
            assert reads * 256 * 1024 + _delta(ep, "planned_bytes") <= 2 * st["cached_bytes"]
    if reorder != "default":
        assert st["reorder_chunks"] > 0
    else:
        assert st["reorder_chunks"] == 0  # no second copy was written
    assert st["streams"]["default/0"]["epoch"] == 2
    assert st["prefetched"] > 0  # epoch 1 was fetched ahead of the reader


TRAIN_RANK = r"""
import hashlib, json, os, sys, time, torch
from torchvision import datasets, transforms
root, epochs, rank, sync = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ds = datasets.ImageFolder(root, transform=transforms.Compose(
    [transforms.Resize((16, 16)), transforms.ToTensor()]))
sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=rank, seed=7)
dl = torch.utils.data.DataLoader(ds, batch_size=32, sampler=sampler, num_workers=2)
stats_path = os.path.join(root, ".dlcache", "stats")
def stats():
    if not os.path.exists(stats_path):  # (the run without the mount)
        return None
    with open(stats_path) as f:
        return json.load(f)
step = 0
def barrier():  # as DDP's collectives keep the ranks in step (files, no timing)
    global step
    step += 1
    open(os.path.join(sync, f"{step}.{rank}"), "w").close()
    deadline = time.monotonic() + 600
    while not os.path.exists(os.path.join(sync, f"{step}.{1 - rank}")):
        assert time.monotonic() < deadline, "the other rank never came"
        time.sleep(0.05)
deadline = time.monotonic() + 120
while stats() is not None and not stats()["sampler_replay_ready"]:
    assert time.monotonic() < deadline
    time.sleep(0.1)
out = []
for epoch in range(epochs):
    sampler.set_epoch(epoch)
    before = stats()  # (before the barrier: no rank reads this epoch before rank 0's)
    barrier()
    samples = []
    for x, y in dl:
        for xi, yi in zip(x, y):
            samples.append((hashlib.sha256(xi.numpy().tobytes()).hexdigest()[:16], int(yi)))
    barrier()
    after = stats()  # both ranks' epoch: the mount's counters are shared
    # the next epoch's logs settle, the page cache goes (every read reaches the daemon)
    deadline = time.monotonic() + 120  # (not asserted: the reads below would show it)
    while after is not None and time.monotonic() < deadline:
        s = stats()
        logs = [st.get("next_log") for st in s["streams"].values()]
        if s["pending_bytes"] == 0 and all(nl is None or nl["sealed"] == nl["chunks"]
                                           for nl in logs):
            break
        time.sleep(0.1)
    barrier()
    if rank == 0 and after is not None:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    out.append({"samples": samples, "before": before, "after": after})
print(json.dumps(out))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="drops the page cache between epochs")
def test_two_ranks_on_one_mount_read_each_laid_out_chunk_once(dataset, mount, tmp_path):
    """Two DistributedSampler ranks (two processes in step, as DDP keeps them) on one mount,
    each laying out its next epoch's log (LCache) over a dataset ~20 chunks long, with a
    memory tier of ~15: about half of a rank's next-epoch samples are read by the other
    rank, and those opens fill its log too (and those served before the log was planned
    are backfilled). Before, each log took only its own rank's opens and was completed at
    the epoch boundary from the cache, both at once, in scattered order: epochs 2 and 3
    read 5.2x and 2.9x what they served (1.03x now; 5.8x in a sweep with 1M chunks and
    ``--memory 8M``)."""
    script = tmp_path / "train_rank.py"
    script.write_text(TRAIN_RANK)
    m = mount(dataset, "--chunk-size", "256K", "--memory", "4M", "--reorder-min", "0",
              cache=tmp_path / "cache5", name="mnt5")
    runs = []
    for sync, root, launch in ((tmp_path / "sync-direct", dataset, []),
                               (tmp_path / "sync-mount", m.mnt,
                                # (the daemon's read path: in-process reads read no chunk)
                                [sys.executable, "-m", "dlcachefs.cli", "run",
                                 "--no-intercept", "--"])):
        sync.mkdir()
        procs = [subprocess.Popen([*launch, sys.executable, str(script), str(root), "3",
                                   str(rank), str(sync)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
        outs = [p.communicate(timeout=900) for p in procs]
        for p, (_, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0, err[-3000:]
        runs.append([json.loads(o.strip().splitlines()[-1]) for o, _ in outs])
    direct, through = runs
    for rank in (0, 1):  # same samples, same labels, same order on each rank
        assert [e["samples"] for e in through[rank]] == [e["samples"] for e in direct[rank]]
    st = m.stats()
    served = sum(p.stat().st_size for p in dataset.rglob("*.jpg"))
    for epoch in (1, 2):
        ep = through[0][epoch]  # rank 0's snapshots bracket both ranks' epoch
        assert _delta(ep, "misses") == 0 and _delta(ep, "bytes_from_source") == 0
        read = _delta(ep, "cache_disk_bytes_read")
        assert _delta(ep, "bytes_from_cache") >= served
        # each rank's laid-out log read front to back, each chunk about once (a chunk a
        # loader worker's first record of shares with the rank's last can be read twice)
        assert read <= 1.3 * served, (epoch, read, served, _delta(ep, "chunk_reads"),
                                      _delta(ep, "record_reads"), _delta(ep, "fill_reads"))
    assert st["reorder_chunks"] > 0


def test_random_sampler_without_generator_is_cached_after_epoch_one(dataset, mount, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    m = mount(dataset, "--chunk-size", "256K", cache=tmp_path / "cache2", name="mnt2")
    direct = _run([sys.executable, str(script), str(dataset), "2", "random"])
    through = _run([sys.executable, "-m", "dlcachefs.cli", "run", "--", sys.executable,
                    str(script), str(m.mnt), "2", "random"])
    assert [t["samples"] for t in through] == [d["samples"] for d in direct]
    assert _delta(through[1], "bytes_from_source") == 0
    assert m.stats()["streams"]["default/0"]["epoch"] == 1


def test_dataset_larger_than_the_cache(dataset, mount, tmp_path):
    """LCache III-B: the next log holds the samples that come first in its epoch; the rest
    is fetched in order ahead of the reader. Bytes stay exact; the cache stays bounded."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    total = sum(p.stat().st_size for p in dataset.rglob("*.jpg"))
    limit = int(total * 0.3)
    m = mount(dataset, "--chunk-size", "128K", "--cache-size", str(limit), "--min-free", "0",
              cache=tmp_path / "cache3", name="mnt3")
    direct = _run([sys.executable, str(script), str(dataset), "3", "distributed"])
    through = _run([sys.executable, "-m", "dlcachefs.cli", "run", "--", sys.executable,
                    str(script), str(m.mnt), "3", "distributed"])
    assert [t["samples"] for t in through] == [d["samples"] for d in direct]
    for ep in through[1:]:
        from_source = _delta(ep, "bytes_from_source")
        assert 0 < from_source < total  # part of the epoch came from the cache
        # (served in the training's processes under the launcher, or by the mount)
        hits = _delta(ep, "hits") + (ep["after"]["zerocopy"]["hits"]
                                     - ep["before"]["zerocopy"]["hits"])
        assert hits > 0
    st = m.stats()
    assert st["chunk_bytes"] <= limit
    assert st["reorder_chunks"] > 0


@pytest.mark.daemon_log_allows(STALE_MOUNT)  # the second daemon mounts over the killed one's
def test_restart_between_epochs_reads_nothing_again(dataset, mount, tmp_path):
    """The daemon dies (kill -9) after two epochs; the job resumes at epoch 2 on a new
    daemon: what is on disk is served from the logs, nothing is fetched again."""
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    cache = tmp_path / "cache4"
    m = mount(dataset, "--chunk-size", "256K", cache=cache, name="mnt4")
    launcher = [sys.executable, "-m", "dlcachefs.cli", "run", "--", sys.executable, str(script)]
    _run([*launcher, str(m.mnt), "2", "distributed"])
    m.wait_cached(2000)
    m.kill9()
    m2 = mount(dataset, "--chunk-size", "256K", cache=cache, name="mnt4")
    resumed = _run([*launcher, str(m2.mnt), "1", "distributed", "2"])
    direct = _run([sys.executable, str(script), str(dataset), "1", "distributed", "2"])
    assert resumed[0]["samples"] == direct[0]["samples"]
    assert _delta(resumed[0], "bytes_from_source") == 0
    assert _delta(resumed[0], "misses") == 0
