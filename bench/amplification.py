"""Read amplification of a shuffled epoch: bytes read from the cache disk per byte served.

An ordinary training script (torchvision ``ImageFolder`` + ``DataLoader(shuffle=True,
num_workers=2)``, no generator: the per-epoch seed is drawn from the global RNG) runs for
``--epochs`` epochs through a dlcachefs mount under ``dlcachefs run``, so each epoch's
order is announced at its start. Between epochs the training script waits for the chunk
writer to go idle and drops the page cache (so every read reaches the daemon; not with
``--keep-pages``, where the kernel serves what it holds). ``--opens 2``: the loader opens
each sample twice (a 16-byte header check, then the read). Per epoch
it records the daemon's ``rchar`` (``/proc/PID/io``: every byte the daemon read with a
syscall: cache logs, source files, /dev/fuse, /proc) and the stats counters.

Output (JSON on stdout and ``--out``, progress on stderr), per epoch: ``daemon_rchar``,
``bytes_served`` (``bytes_from_cache`` + ``bytes_from_source`` delta; in epoch 1 the
latter also counts files fetched ahead of the reader), ``amplification`` (rchar /
served), ``chunk_reads``, ``record_reads``, ``planned_reads`` and, when the daemon counts
it, ``cache_disk_bytes_read`` and ``cache_amplification`` (that / ``bytes_from_cache``:
the same ratio from the stats alone).

    python -m bench.amplification                       # this checkout's code
    python -m bench.amplification --core-rev c444447    # the daemon of a revision
    python -m bench.amplification --venv /work/main/.venv   # another checkout's code
    python -m bench.amplification --opens 2 [--keep-pages]   # a loader that opens twice
    python -m bench.amplification --generator           # a seeded generator (LCache's logs)
    python -m bench.amplification --generator --replace 10   # files changed between epochs
    python -m bench.amplification --generator --delete 5     # files deleted between epochs

Every sample's bytes are hashed in the training script and compared with the source's:
a difference exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import make_dataset as md
from .fidelity import core_from_rev
from .mounting import DlcMount

TRAIN = r'''
import hashlib, json, os, sys, time, torch
from torchvision import datasets, transforms
root, epochs, mnt = sys.argv[1], int(sys.argv[2]), sys.argv[3]
twice, keep = "twice" in sys.argv[4:], "keep" in sys.argv[4:]
gen = "generator" in sys.argv[4:]
opts = dict(a.split("=", 1) for a in sys.argv[4:] if "=" in a)
replace, delete, src = int(opts.get("replace", 0)), int(opts.get("delete", 0)), opts.get("src")
digests = {}
def loader(path):
    from PIL import Image
    try:
        if twice:  # a header check first, as loaders that validate their files do
            with open(path, "rb") as f:
                f.read(16)
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:  # deleted since the listing (--delete): skipped
        return Image.new("RGB", (16, 16))
    digests[os.path.relpath(path, root)] = hashlib.sha256(data).hexdigest()
    from PIL import Image
    import io
    return Image.open(io.BytesIO(data)).convert("RGB")
class Tracked(datasets.ImageFolder):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        path = self.samples[i][0]
        return x, y, digests.pop(os.path.relpath(path, root), "")
ds = Tracked(root, loader=loader, transform=transforms.Compose(
    [transforms.Resize((16, 16)), transforms.ToTensor()]))
torch.manual_seed(3)
dl = torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True, num_workers=2,
                                 generator=torch.Generator().manual_seed(5) if gen else None)
stats_path = os.path.join(mnt, ".dlcache", "stats")
def stats():
    with open(stats_path) as f:
        return json.load(f)
def rchar(pid):
    with open(f"/proc/{pid}/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
def settle():
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and stats()["pending_bytes"]:
        time.sleep(0.1)
    if keep:
        return
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
def replace_files(epoch):
    # a dataset that changes between epochs: ``replace`` files get new bytes and sizes
    # in the source (still decodable: a JPEG decoder ignores bytes after its end marker)
    import random
    rng = random.Random(epoch)
    picked = rng.sample(ds.samples, replace + delete)
    for path, _ in picked[replace:]:  # deleted: the loader skips them
        p = os.path.join(src, os.path.relpath(path, root))
        if os.path.exists(p):
            os.unlink(p)
    for path, _ in picked[:replace]:
        p = os.path.join(src, os.path.relpath(path, root))
        if not os.path.exists(p):
            continue
        with open(p, "rb") as f:
            data = f.read()
        with open(p + ".tmp", "wb") as f:
            f.write(data + os.urandom(rng.randrange(100, 5000)))
        os.replace(p + ".tmp", p)
    truth = []
    for path, _ in ds.samples:
        p = os.path.join(src, os.path.relpath(path, root))
        if os.path.exists(p):
            with open(p, "rb") as f:
                truth.append(hashlib.sha256(f.read()).hexdigest())
    return sorted(truth)
out = []
pid = stats()["pid"]
for epoch in range(epochs):
    truth = replace_files(epoch) if (replace or delete) and epoch else None
    settle()
    before, r0 = stats(), rchar(pid)
    t0 = time.perf_counter()
    seen = []
    for _x, _y, d in dl:
        seen.extend(x for x in d if x)  # (a deleted file has no digest)
    secs = time.perf_counter() - t0
    r1, after = rchar(pid), stats()
    out.append({"before": before, "after": after, "rchar": r1 - r0, "seconds": secs,
                "digests": sorted(seen), "truth": truth})
print(json.dumps(out))
'''

COUNTERS = ("chunk_reads", "sequential_chunk_reads", "chunk_preloads", "record_reads",
            "record_preloads", "fill_reads", "planned_reads", "planned_records", "planned_bytes", "planned_hits",
            "cache_disk_bytes_read", "cache_disk_bytes_read_back", "hits", "misses",
            "bytes_from_source", "bytes_from_cache")


def log(msg: str) -> None:
    print(f"[amplification {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(a: argparse.Namespace) -> dict:
    spec = md.Spec(classes=a.classes, per_class=a.per_class, seed=0, mean_kb=a.mean_kb,
                   style="noise")
    manifest, reused = md.ensure_dataset(a.dataset, spec)
    src = os.path.join(a.dataset, "train")
    import hashlib

    truth = []
    for dirpath, _, names in os.walk(src):
        for n in names:
            if n.lower().endswith((".jpg", ".jpeg", ".png")):
                with open(os.path.join(dirpath, n), "rb") as f:
                    truth.append(hashlib.sha256(f.read()).hexdigest())
    truth.sort()
    total = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(src) for n in ns)
    log(f"dataset {src}: {len(truth)} files, {total / 2**20:.1f} MiB (reused={reused})")
    py = os.path.join(a.venv, "bin", "python")
    exe = os.path.join(a.venv, "bin", "dlcachefs")
    work = tempfile.mkdtemp(prefix="dlc-amp-")
    core = {"venv": a.venv}
    try:
        if a.core_rev:  # the daemon from a revision; the launcher from the venv
            exe, core = core_from_rev(a.core_rev, Path(work))
        script = os.path.join(work, "train.py")
        with open(script, "w") as f:
            f.write(TRAIN)
        mnt, cache = os.path.join(work, "mnt"), os.path.join(work, "cache")
        args = ["--chunk-size", a.chunk_size, "--memory", a.memory, *a.mount_arg]
        root = a.dataset
        if a.replace or a.delete:  # the files change: a copy, so the dataset stays as made
            root = os.path.join(work, "src")
            shutil.copytree(a.dataset, root)
            src = os.path.join(root, "train")
        with DlcMount(root, mnt, cache, args, exe=exe) as m:
            log(f"mounted with {' '.join(args)} ({exe})")
            flags = ((["twice"] if a.opens == 2 else []) + (["keep"] if a.keep_pages else [])
                     + (["generator"] if a.generator else [])
                     + ([f"replace={a.replace}", f"delete={a.delete}", f"src={src}"]
                        if a.replace or a.delete else []))
            r = subprocess.run([py, "-m", "dlcachefs.cli", "run", "--", py, script,
                                os.path.join(mnt, "train"), str(a.epochs), mnt, *flags],
                               capture_output=True, text=True, timeout=1800, cwd=work)
            if r.returncode != 0:
                raise SystemExit(f"training failed:\n{r.stderr[-4000:]}")
            epochs = json.loads(r.stdout.strip().splitlines()[-1])
            final = m.stats()
    finally:
        if a.keep_log and os.path.exists(os.path.join(work, "cache", "dlcachefs.log")):
            shutil.copy(os.path.join(work, "cache", "dlcachefs.log"), a.keep_log)
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    ok = True
    for i, ep in enumerate(epochs):
        d = {k: ep["after"].get(k, 0) - ep["before"].get(k, 0) for k in COUNTERS
             if k in ep["after"]}
        served = d["bytes_from_cache"] + d["bytes_from_source"]
        same = ep["digests"] == (ep.get("truth") or truth)
        ok &= same
        row = {"epoch": i + 1, "daemon_rchar": ep["rchar"], "bytes_served": served,
               "amplification": round(ep["rchar"] / served, 3) if served else None,
               "seconds": round(ep["seconds"], 2), "bytes_equal_source": same, **d}
        if "cache_disk_bytes_read" in d and d["bytes_from_cache"]:
            row["cache_amplification"] = round(d["cache_disk_bytes_read"] / d["bytes_from_cache"], 3)
        rows.append(row)
        log(f"epoch {i + 1}: rchar {ep['rchar'] / 2**20:.1f} MiB, served {served / 2**20:.1f} "
            f"MiB, x{row['amplification']}, chunk_reads {d['chunk_reads']}, record_reads "
            f"{d['record_reads']}, planned_reads {d.get('planned_reads', '-')}")
    return {"core": core, "files": len(truth), "dataset_bytes": total,
            "chunk_size": a.chunk_size, "memory": a.memory, "opens": a.opens,
            "keep_pages": a.keep_pages, "generator": a.generator, "replace": a.replace,
            "delete": a.delete,
            "epochs": rows,
            "bytes_equal_source": ok, "final_streams": final.get("streams")}


def main(argv: list[str] | None = None) -> int:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--venv", default=os.path.join(here, ".venv"),
                   help="the venv whose dlcachefs runs (default: this checkout's .venv)")
    p.add_argument("--dataset", default="/tmp/dlc-amp-dataset")
    p.add_argument("--classes", type=int, default=5)
    p.add_argument("--per-class", type=int, default=100)
    p.add_argument("--mean-kb", type=float, default=30.0)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--chunk-size", default="1M")
    p.add_argument("--memory", default="4M")
    p.add_argument("--opens", type=int, choices=(1, 2), default=1,
                   help="2: the loader opens each sample twice (a header check, then "
                        "the read)")
    p.add_argument("--keep-pages", action="store_true",
                   help="keep the page cache between epochs (a dataset that fits in RAM: "
                        "the kernel serves what the last epoch read)")
    p.add_argument("--generator", action="store_true",
                   help="the DataLoader has its own seeded generator: every epoch's order is "
                        "known ahead, so the next epoch's log is laid out in its order")
    p.add_argument("--replace", type=int, default=0, metavar="N",
                   help="before each epoch after the first, give N files of the source new "
                        "bytes and sizes (a dataset that changes between epochs; with "
                        "--mount-arg=--revalidate=0, else the mount may serve the version "
                        "it listed, within --revalidate, and the digest check fails)")
    p.add_argument("--delete", type=int, default=0, metavar="N",
                   help="before each epoch after the first, delete N files of the source (the "
                        "training's loader skips them; with --mount-arg=--revalidate=0)")
    p.add_argument("--core-rev", metavar="REV",
                   help="run the daemon from this git revision (git archive)")
    p.add_argument("--mount-arg", action="append", default=[], metavar="ARG",
                   help="one more argument of the mount (repeat; --mount-arg=--flag=VALUE)")
    p.add_argument("--keep-log", metavar="FILE", help="copy the daemon's log here")
    p.add_argument("--out", help="also write the JSON here")
    a = p.parse_args(argv)
    out = run(a)
    text = json.dumps(out, indent=1)
    print(text)
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(text + "\n")
    return 0 if out["bytes_equal_source"] else 1


if __name__ == "__main__":
    sys.exit(main())
