"""The bundled demo: make a small ImageFolder dataset, mount it with dlcachefs, train a
tiny CNN for a few epochs with a real torchvision ImageFolder DataLoader through the
mount, print per-epoch throughput and the mount's stats, unmount.

    .venv/bin/python scripts/demo.py [--classes 8] [--per-class 150] [--epochs 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path


def make_dataset(root: Path, classes: int, per_class: int, seed: int = 0) -> None:
    from PIL import Image

    rnd = random.Random(seed)
    for c in range(classes):
        d = root / f"class_{c:02d}"
        d.mkdir(parents=True, exist_ok=True)
        base = [rnd.randrange(256) for _ in range(3)]
        for i in range(per_class):
            w = h = rnd.choice([96, 128, 160])
            # a class-dependent colour plus noise, so the CNN has something to learn
            noise = rnd.randbytes(w * h * 3)
            px = bytes((base[j % 3] + noise[j] // 4) % 256 for j in range(len(noise)))
            Image.frombytes("RGB", (w, h), px).save(d / f"{i:05d}.jpg", quality=90)


def run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"demo: {' '.join(cmd)} failed:\n{r.stderr}")
    if r.stderr.strip():
        print(r.stderr.strip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--classes", type=int, default=8)
    ap.add_argument("--per-class", type=int, default=150)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--workdir", help="where to put the dataset, cache and mountpoint "
                    "(default: ~/.cache/dlcachefs-demo, or under $XDG_CACHE_HOME)")
    a = ap.parse_args()

    import torch
    from torch import nn
    from torchvision import datasets, transforms

    import dlcachefs.torch
    from dlcachefs import mountctl

    # what `dlcachefs run -- python train.py` does without editing the script: the
    # sampler tells the mount each epoch's order (the training is unchanged, bit for bit)
    dlcachefs.torch.install()

    # one place per user, reused: a second run keeps the dataset (and leaves no new
    # directory behind); the dataset is made again unless it was finished with these sizes
    cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    work = Path(a.workdir or os.path.join(cache_home, "dlcachefs-demo"))
    src, mnt, cache = work / "dataset", work / "mnt", work / "cache"
    done = src / f".complete-{a.classes}x{a.per_class}"
    if not done.exists():
        shutil.rmtree(src, ignore_errors=True)
        print(f"demo: writing {a.classes} x {a.per_class} JPEGs to {src}")
        make_dataset(src / "train", a.classes, a.per_class)
        done.touch()
    if mountctl.is_mounted(mnt):  # left by a demo that was killed: cleared
        mountctl.unmount(mnt, lazy="at_once")
    mnt.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(cache, ignore_errors=True)
    dlc = [sys.executable, "-m", "dlcachefs.cli"]
    run([*dlc, "mount", str(src), str(mnt), "--cache-dir", str(cache)])
    try:
        tf = transforms.Compose([transforms.Resize((64, 64)), transforms.ToTensor()])
        ds = datasets.ImageFolder(str(mnt / "train"), transform=tf)
        # DistributedSampler (one rank here) orders by seed + epoch, so the mount also knows
        # the next epoch's order (for a dataset larger than half of --memory it would lay out
        # the next epoch's log in that order, LCache; this one fits in memory)
        sampler = torch.utils.data.DistributedSampler(ds, num_replicas=1, rank=0, seed=0)
        dl = torch.utils.data.DataLoader(ds, batch_size=32, sampler=sampler,
                                         num_workers=a.workers)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
                              nn.Flatten(), nn.Linear(128, len(ds.classes)))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        print(f"demo: training on {len(ds)} images in {len(ds.classes)} classes through {mnt}")
        prev = json.loads((mnt / ".dlcache" / "stats").read_bytes())
        for epoch in range(1, a.epochs + 1):
            sampler.set_epoch(epoch - 1)
            t0 = time.perf_counter()
            correct = total = 0
            for x, y in dl:
                opt.zero_grad()
                out = model(x)
                loss = nn.functional.cross_entropy(out, y)
                loss.backward()
                opt.step()
                correct += int((out.argmax(1) == y).sum())
                total += len(y)
            dt = time.perf_counter() - t0
            st = json.loads((mnt / ".dlcache" / "stats").read_bytes())
            d = {k: st[k] - prev[k] for k in ("bytes_from_source", "hits", "misses",
                                               "prefetched", "cache_disk_bytes_read",
                                               "page_cache_opens")}
            # where the epoch's bytes came from: the slow source (fetched ahead of the
            # loader: prefetched), the cache's disk, or the kernel's page cache (its pages
            # kept from the last epoch: the daemon reads nothing for those opens)
            print(f"epoch {epoch}: {total / dt:6.0f} images/s  train acc {correct / total:.2f}  "
                  f"hits {d['hits']:>4}  misses {d['misses']:>4}  "
                  f"from source {d['bytes_from_source'] / 1e6:5.1f} MB "
                  f"(prefetched {d['prefetched']:>4} files)  "
                  f"from cache disk {d['cache_disk_bytes_read'] / 1e6:5.1f} MB  "
                  f"page-cache opens {d['page_cache_opens']:>4}")
            prev = st
            time.sleep(2.5)  # let the writer seal the last chunk before the next epoch
        print("demo: stats of the mount:")
        subprocess.run([*dlc, "stats", str(mnt)])
    finally:
        run([*dlc, "umount", str(mnt)])
    print(f"demo: done; dataset, cache and mountpoint are in {work} (unmounted now; "
          f"remove them with: rm -rf {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
