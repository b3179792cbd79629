"""Tier 5: reads served in the training's own processes under ``dlcachefs run``
(dlcachefs.data.intercept) over real mounts: the loaders' usual ways in read the source's
bytes with no FUSE request for a cached file; each fallback goes through the mount and is
counted by reason; a descriptor asked for switches to the mount for the same version, or
ESTALE; DataLoader workers (fork, spawn) train bit-identically with interception on and
off, and the daemon still follows the stream (positions, per-stream counts); eviction and
replacement under readers never give a wrong byte."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import requires_fuse

from dlcachefs.data.reader import CacheReader
from dlcachefs.store import integrity

torch = pytest.importorskip("torch")
pytest.importorskip("torchvision")
np = pytest.importorskip("numpy")
t5 = pytest.importorskip("test_t5_torch")

pytestmark = requires_fuse

#: mounts of these tests: chunks sealed quickly, nothing fetched ahead of the readers
QUICK = ("--flush-interval", "0.1", "--scan-ahead", "0")


def run(script: Path, *args: str, launcher: bool = True, intercept: bool = True,
        env: dict | None = None) -> str:
    """``script`` under ``dlcachefs run`` (or not); its stdout. Fails on a non-zero exit
    or anything on stderr that is not torch's own chatter."""
    pre = [sys.executable, "-m", "dlcachefs.cli", "run",
           *([] if intercept else ["--no-intercept"]), "--"] if launcher else []
    r = subprocess.run([*pre, sys.executable, str(script), *args], capture_output=True,
                       text=True, timeout=600, env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr
    assert "dlcachefs" not in r.stderr, r.stderr  # no warning of ours reaches the training
    return r.stdout


def file_opens(st: dict) -> int:
    """Opens of files the daemon served (hits and misses)."""
    return st["hits"] + st["misses"]


LOADERS = r'''
import hashlib, io, json, os, pathlib, sys
import numpy as np
import torchvision.io
from PIL import Image
root = sys.argv[1]
out = {}
for dirpath, _, names in sorted(os.walk(root)):
    for n in sorted(names):
        p = os.path.join(dirpath, n)
        rel = os.path.relpath(p, root)
        got = {}
        with open(p, "rb") as f:  # read, seek, tell, readinto, iteration
            whole = f.read()
            f.seek(3)
            buf = bytearray(5)
            n5 = f.readinto(buf)
            got["open"] = hashlib.sha256(whole).hexdigest()
            got["seek"] = [f.tell(), n5, bytes(buf[:n5]).hex()]
            f.seek(0)
            got["iter"] = hashlib.sha256(b"".join(f)).hexdigest()
            got["type"] = type(f).__name__
        got["pathlib"] = hashlib.sha256(pathlib.Path(p).read_bytes()).hexdigest()
        with open(pathlib.Path(p), "rb") as f:  # the name as the real open gives it
            got["name"] = [f.name == p, type(f.name).__name__]
        if n.endswith(".jpg"):
            with Image.open(p) as im:  # PIL opens the path itself (DLIO's image readers)
                got["pil"] = hashlib.sha256(im.convert("RGB").tobytes()).hexdigest()
            with open(p, "rb") as f:  # timm's folder reader: PIL over the file object
                got["pil_fileobj"] = hashlib.sha256(
                    Image.open(f).convert("RGB").tobytes()).hexdigest()
            got["tv_read_file"] = hashlib.sha256(
                torchvision.io.read_file(p).numpy().tobytes()).hexdigest()
            got["tv_decode"] = hashlib.sha256(
                torchvision.io.decode_image(p).numpy().tobytes()).hexdigest()
        if n.endswith(".npy"):
            got["np_load"] = hashlib.sha256(np.load(p).tobytes()).hexdigest()
        out[rel] = got
print(json.dumps(out, sort_keys=True))
'''


def make_tree(src: Path) -> int:
    """Images, arrays, odd names and a symlink; returns the number of regular files."""
    t5.make_images(src, classes=2, per_class=6)
    rng = np.random.default_rng(3)
    (src / "arrays").mkdir()
    for i in range(4):
        np.save(src / "arrays" / f"a {i} é.npy", rng.standard_normal((7, 5 + i)))
    (src / "arrays" / "link.npy").symlink_to("a 0 é.npy")
    return 12 + 1 + 4


def test_every_loader_reads_the_source_bytes_in_the_process(tmp_path, mount):
    """A warm cache: open/read/seek/readinto/iteration, pathlib, PIL (by path and by file
    object), torchvision.io.read_file and decode_image, numpy.load give what they give
    over the source, with the opens served in the process (CachedFile) and not one file
    opened through FUSE."""
    src = tmp_path / "src"
    n = make_tree(src)
    m = mount(src, *QUICK)
    script = tmp_path / "loaders.py"
    script.write_text(LOADERS)
    reference = json.loads(run(script, str(src), launcher=False))
    for p in sorted(m.mnt.rglob("*")):  # warm: every file read once through the mount
        if p.is_file():
            p.read_bytes()
    m.wait_cached(n)
    before = m.stats()
    got = json.loads(run(script, str(m.mnt)))
    for rel, r in reference.items():
        g = got[rel]
        assert g.pop("type") == "CachedFile", rel
        r.pop("type")
        assert g == r, rel
    st = m.wait_stats(lambda s: s["zerocopy"]["readers"] == 0, "the reader still counts")
    assert file_opens(st) == file_opens(before)  # no file opened through FUSE
    zc = st["zerocopy"]
    assert zc["hits"] > 0 and zc["fallbacks"] == 0 and zc["events_lost"] == 0
    # without the launcher, the same bytes through the mount
    assert json.loads(run(script, str(m.mnt), launcher=False)) == {
        rel: {**r, "type": "BufferedReader"} for rel, r in reference.items()}
    # paths through symlinks outside the mount (a link to a file in it, a link to one of
    # its directories) are served in the process too, as what they point at
    links = tmp_path / "links"
    links.mkdir()
    (links / "one.npy").symlink_to(m.mnt / "arrays" / "a 1 é.npy")
    (links / "dir").symlink_to(m.mnt / "arrays")
    via = tmp_path / "via.py"
    via.write_text("import sys, hashlib\nfor p in sys.argv[1:]:\n"
                   "    with open(p, 'rb') as f:\n"
                   "        print(type(f).__name__, hashlib.sha256(f.read()).hexdigest())\n")
    got = run(via, str(links / "one.npy"), str(links / "dir" / "a 2 é.npy")).split()
    want = [hashlib.sha256((src / "arrays" / n).read_bytes()).hexdigest()
            for n in ("a 1 é.npy", "a 2 é.npy")]
    assert got == ["CachedFile", want[0], "CachedFile", want[1]]


FALLBACKS = r'''
import errno, json, os, sys
mnt, src = sys.argv[1], sys.argv[2]
out = {}
def kind(p, mode="rb"):
    with open(p, mode) as f:
        return type(f).__name__
out["cached"] = kind(mnt + "/big.bin")  # (DLCACHEFS_INTERCEPT_MAX: too large)
out["small"] = kind(mnt + "/small.bin")
out["text"] = kind(mnt + "/small.bin", "r")
out["new"] = kind(mnt + "/new.bin")  # not cached yet
f = open(mnt + "/small.bin", "rb")
f.seek(7)
fd = f.fileno()  # a descriptor: the mount's file, same version, same position
out["switched"] = [type(f).__name__, os.read(fd, 4) == open(src + "/small.bin", "rb").read()[7:11]]
f.close()
g = open(mnt + "/stale.bin", "rb")  # served in the process; then the source changes
print(json.dumps(out), flush=True)
sys.stdin.readline()  # the test replaces stale.bin at the source and lists its directory
try:
    g.fileno()
    out["estale"] = "no error"
except OSError as e:
    out["estale"] = errno.errorcode[e.errno]
print(json.dumps(out), flush=True)
'''


def test_fallbacks_go_through_the_mount_and_are_counted(tmp_path, mount):
    """Too large, another mode, not cached: the real open, through the mount, each counted
    by reason; fileno() switches to the mount at the same position for the same version,
    and ESTALE when the mount now has another one (never the newer bytes)."""
    src = tmp_path / "src"
    src.mkdir()
    for name, size in (("big.bin", 300_000), ("small.bin", 5000), ("stale.bin", 4000)):
        (src / name).write_bytes(os.urandom(size))
    (src / "new.bin").write_bytes(b"n" * 100)  # never read before: not cached
    # (--revalidate 0 would send every open through the mount: the source is asked each time)
    m = mount(src, *QUICK, "--revalidate", "1")
    for name in ("big.bin", "small.bin", "stale.bin"):
        (m.mnt / name).read_bytes()
    m.wait_cached(3)
    script = tmp_path / "fallbacks.py"
    script.write_text(FALLBACKS)
    p = subprocess.Popen(
        [sys.executable, "-m", "dlcachefs.cli", "run", "--", sys.executable, str(script),
         str(m.mnt), str(src)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ,
                                                 "DLCACHEFS_INTERCEPT_MAX": "100000"})
    try:
        line = p.stdout.readline()
        if not line:
            p.kill()
            pytest.fail(f"the reader failed: {p.stderr.read()}")
        first = json.loads(line)
        assert first == {"cached": "BufferedReader", "small": "CachedFile",
                         "text": "TextIOWrapper", "new": "BufferedReader",
                         "switched": ["CachedFile", True]}
        (src / "stale.bin").write_bytes(os.urandom(4100))  # another version
        time.sleep(1.2)  # (--revalidate 1: the mount lists the directory again after it)
        os.listdir(m.mnt)
        assert (m.mnt / "stale.bin").stat().st_size == 4100
        out, err = p.communicate("\n", timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    assert json.loads(out)["estale"] == "ESTALE"
    zc = m.wait_stats(lambda s: s["zerocopy"]["readers"] == 0, "still counting")["zerocopy"]
    assert zc["too_large"] == 1 and zc["mode"] == 1 and zc["not_cached"] == 1
    assert zc["switched"] == 1 and zc["hits"] == 3  # small.bin twice, stale.bin


@pytest.mark.daemon_log_allows(r"the index may be damaged \(the index file changed outside")
def test_an_index_not_held_sound_is_not_mapped(tmp_path, mount):
    """While the daemon does not hold its index sound (its flag file gone: damage seen),
    the training process does not map it: every read goes through the mount, counted
    ``unsound``; once the flag is back, reads are served in the process again."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(os.urandom(3000))
    m = mount(src, *QUICK)
    (m.mnt / "a.bin").read_bytes()
    m.wait_cached(1)
    info = json.loads((m.mnt / ".dlcache" / "zerocopy").read_bytes())
    flag = Path(info["sound"])
    assert flag.exists()
    script = tmp_path / "kind.py"
    script.write_text("import sys\nwith open(sys.argv[1], 'rb') as f: print(type(f).__name__)")
    said = flag.read_text()
    flag.unlink()
    try:
        assert run(script, str(m.mnt / "a.bin")).strip() == "BufferedReader"
    finally:
        # the daemon's word on the file as it is (a commit meanwhile rewrote it anyway)
        flag.write_text(said if said.strip() == integrity.stamp_of(info["index_dir"])
                        else integrity.stamp_of(info["index_dir"]) + "\n")
    assert run(script, str(m.mnt / "a.bin")).strip() == "CachedFile"
    # the index file changed outside the daemon (as damage written under its map would):
    # not vouched for, not read; the daemon notes it at its next write
    data = Path(info["index_dir"]) / "data.mdb"
    st = data.stat()
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert run(script, str(m.mnt / "a.bin")).strip() == "BufferedReader"
    zc = m.wait_stats(lambda s: s["zerocopy"]["readers"] == 0, "still counting")["zerocopy"]
    assert zc["unsound"] == 2 and zc["hits"] == 1
    # (the daemon's side, its next write noting the damage: test_t2_integrity)


TRAIN = r'''
import hashlib, sys, torch
from torchvision import datasets, transforms

def main():
    torch.manual_seed(0)
    tf = transforms.Compose([transforms.Resize((16, 16)), transforms.ToTensor()])
    ds = datasets.ImageFolder(sys.argv[1], transform=tf)
    dl = torch.utils.data.DataLoader(ds, batch_size=8, shuffle=True, num_workers=2,
                                     multiprocessing_context=sys.argv[2])
    h = hashlib.sha256()
    for epoch in range(int(sys.argv[3])):
        for x, y in dl:
            h.update(y.numpy().tobytes())
            h.update(x.numpy().tobytes())
    print(h.hexdigest())

if __name__ == "__main__":
    main()
'''


@pytest.mark.parametrize("ctx", ["fork", "spawn"])
def test_imagefolder_workers_train_identically_and_the_daemon_follows(tmp_path, mount, ctx):
    """An unmodified ImageFolder loop with 2 workers: bit-identical with interception on,
    off, and over the source; on a warm cache its samples are read in the workers with
    no FUSE open, and the daemon still follows the stream: its position reaches the end
    of the epoch and its counts say where the opens were served."""
    src = tmp_path / "src"
    t5.make_images(src)
    m = mount(src, *QUICK)
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    reference = run(script, str(src), ctx, "2", launcher=False).strip()
    assert run(script, str(m.mnt), ctx, "1", intercept=False).strip() != ""  # warms it
    m.wait_cached(120)
    before = m.stats()
    assert run(script, str(m.mnt), ctx, "2").strip() == reference
    def followed(s: dict) -> bool:  # (the loop may end before its order is replayed)
        got = s["streams"].get("default/0") or {}
        return s["zerocopy"]["readers"] == 0 and got.get("epoch") == 1 and \
            got.get("position") == 120

    st = m.wait_stats(followed, "the daemon did not follow the loop")
    assert file_opens(st) == file_opens(before)  # every sample read in the workers
    assert st["zerocopy"]["hits"] == 240 and st["zerocopy"]["fallbacks"] == 0
    s = st["streams"]["default/0"]
    assert s["mode"] == "replayed" and s["epoch"] == 1
    assert s["position"] == s["samples"] == 120  # the daemon followed the reads
    mount_opens = before["streams"]["default/0"]["reads"]["mount_opens"]  # (the warm-up's)
    assert s["reads"]["in_process_opens"] == 240 and s["reads"]["mount_opens"] == mount_opens
    assert s["reads"]["in_process_bytes"] == st["zerocopy"]["hit_bytes"]
    # the read-ahead of its plan was posted for the workers, never asked by the daemon,
    # and the readers took what was posted (the last posts may come after the last
    # sample: one more read in a process of ours takes them)
    assert st["cache_disk_bytes_advised"] == 0
    for one in sorted((m.mnt).rglob("*.jpg")):  # (a few ranges per sample read)
        assert CacheReader.for_path(one).read(one) == (src / one.relative_to(m.mnt)).read_bytes()
        board = m.stats()["read_ahead_board"]
        if board["waiting"] == 0:
            break
    assert board["waiting"] == 0 and board["taken_bytes"] == board["posted_bytes"], board
    assert run(script, str(m.mnt), ctx, "2", intercept=False).strip() == reference


RACE = r'''
import hashlib, json, os, random, sys, threading, torch
root, expected = sys.argv[1], json.load(open(sys.argv[2]))
versions = json.load(open(sys.argv[3]))  # rel -> every digest a version of it may have
wrong, reads = [], [0]
stop = threading.Event()
def reader(seed):
    rng = random.Random(seed)
    rels = list(versions)
    while not stop.is_set():
        rel = rng.choice(rels)
        try:
            with open(os.path.join(root, rel), "rb") as f:
                d = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            continue  # (a file being replaced: an error is allowed, wrong bytes are not)
        reads[0] += 1
        if d not in versions[rel]:
            wrong.append(rel)
class DS(torch.utils.data.Dataset):
    def __len__(self): return 400
    def __getitem__(self, i):
        rel = sorted(versions)[i % len(versions)]
        try:
            with open(os.path.join(root, rel), "rb") as f:
                d = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            return 1
        return 0 if d in versions[rel] else 2
threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
for t in threads: t.start()
bad_workers = 0
for _ in range(3):
    for b in torch.utils.data.DataLoader(DS(), batch_size=16, num_workers=2):
        bad_workers += int((b == 2).sum())
sys.stdin.readline()  # the test is done evicting and replacing
stop.set()
for t in threads: t.join()
print(json.dumps({"wrong": wrong, "reads": reads[0], "bad_workers": bad_workers}))
'''


def test_eviction_and_replacement_under_in_process_readers(tmp_path, mount):
    """8 reading threads and a DataLoader with 2 workers read in the process while the
    daemon evicts (a cache far smaller than what is read) and files are replaced at the
    source: every sample read is a whole version of its file, never a wrong byte."""
    import random as _random

    rnd = _random.Random(5)
    src = tmp_path / "src"
    versions: dict[str, list[str]] = {}
    for i in range(120):
        rel = f"d{i % 4}/f{i:03d}.bin"
        data = rnd.randbytes(rnd.randint(3000, 9000))
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
        versions[rel] = [hashlib.sha256(data).hexdigest()]
    m = mount(src, *QUICK, "--cache-size", "256K", "--chunk-size", "32K", "--memory", "1M",
              "--revalidate", "1")
    for rel in versions:
        (m.mnt / rel).read_bytes()
    # the replacements the test makes below, known to the readers as allowed versions
    replaced = sorted(versions)[::3]
    new = {rel: rnd.randbytes(rnd.randint(3000, 9000)) for rel in replaced}
    for rel, data in new.items():
        versions[rel].append(hashlib.sha256(data).hexdigest())
    (tmp_path / "versions.json").write_text(json.dumps(versions))
    (tmp_path / "expected.json").write_text("{}")
    script = tmp_path / "race.py"
    script.write_text(RACE)
    evicted0 = m.stats()["chunks_evicted"]
    p = subprocess.Popen(
        [sys.executable, "-m", "dlcachefs.cli", "run", "--", sys.executable, str(script),
         str(m.mnt), str(tmp_path / "expected.json"), str(tmp_path / "versions.json")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for rnd_pass in range(3):  # through the mount: fills the cache, evicting
            for rel in versions:
                (m.mnt / rel).read_bytes()
            if rnd_pass == 1:
                for rel, data in new.items():  # replaced at the source, atomically
                    tmp = src / (rel + ".tmp")
                    tmp.write_bytes(data)
                    os.replace(tmp, src / rel)
        out, err = p.communicate("\n", timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err
    got = json.loads(out)
    assert got["wrong"] == [] and got["bad_workers"] == 0
    assert got["reads"] > 0
    st = m.stats()
    assert st["chunks_evicted"] > evicted0  # the readers ran under eviction
    assert st["zerocopy"]["hits"] > 0


RANKS = r'''
import hashlib, json, os, sys, torch
from torchvision import datasets, transforms

def main():
    rank = int(os.environ["RANK"])
    ds = datasets.ImageFolder(sys.argv[1], transform=transforms.Compose(
        [transforms.Resize((16, 16)), transforms.ToTensor()]))
    sampler = torch.utils.data.DistributedSampler(ds, num_replicas=2, rank=rank, seed=7)
    dl = torch.utils.data.DataLoader(ds, batch_size=8, sampler=sampler, num_workers=2)
    out = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        h = hashlib.sha256()
        for x, y in dl:
            h.update(x.numpy().tobytes())
            h.update(y.numpy().tobytes())
        out.append(h.hexdigest())
    print(json.dumps(out))

if __name__ == "__main__":
    main()
'''


def test_two_ranks_read_in_their_processes_and_each_stream_follows(tmp_path, mount):
    """Two DistributedSampler ranks (RANK=0, 1, as torchrun sets it) under the launcher on
    a warm cache: each trains bit-identically to the same rank over the source, reads its
    shard in its own workers with no FUSE open, and the daemon attributes each read to the
    rank's own stream, whose position reaches the end of its shard."""
    src = tmp_path / "src"
    t5.make_images(src)
    m = mount(src, *QUICK)
    for p in sorted(m.mnt.rglob("*.jpg")):
        p.read_bytes()
    m.wait_cached(120)
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)

    def both(root: Path, launcher: bool) -> list:
        pre = [sys.executable, "-m", "dlcachefs.cli", "run", "--"] if launcher else []
        procs = [subprocess.Popen([*pre, sys.executable, str(script), str(root)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2"})
                 for r in (0, 1)]
        outs = [p.communicate(timeout=600) for p in procs]
        for p, (_, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0, err[-3000:]
            assert "dlcachefs" not in err, err[-3000:]
        return [json.loads(o) for o, _ in outs]

    direct = both(src, False)
    before = m.stats()
    assert both(m.mnt, True) == direct
    def followed(s: dict) -> bool:  # (the ranks may end before their orders are replayed)
        got = [s["streams"].get(f"default/{r}") or {} for r in (0, 1)]
        return s["zerocopy"]["readers"] == 0 and all(
            g.get("epoch") == 1 and g.get("position") == 60 for g in got)

    st = m.wait_stats(followed, "the daemon did not follow both ranks")
    assert file_opens(st) == file_opens(before)
    for rank in (0, 1):
        s = st["streams"][f"default/{rank}"]
        assert s["mode"] == "replayed" and s["epoch"] == 1, s
        assert s["samples"] == 60 and s["position"] == 60
        assert s["reads"]["in_process_opens"] == 120 and s["reads"]["mount_opens"] == 0
