"""A sampler replay worker that dies, through a real mount: the stream's reason (in
``dlcachefs stats``) and the daemon's log name the worker's own error and its exit
status, not the broken pipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import requires_fuse
from test_t5_torch import make_images

from dlcachefs.testing.mounting import DLCACHEFS, Mount

pytest.importorskip("torchvision")
pytestmark = requires_fuse

TRAIN = r'''
import json, os, sys, time, torch
from torchvision import datasets
root = sys.argv[1]
ds = datasets.ImageFolder(root, loader=lambda p: open(p, "rb").read())
g = torch.Generator()
g.manual_seed(3)
dl = torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True, generator=g,
                                 collate_fn=lambda b: b)
n = sum(len(b) for b in dl)
stats_path = os.path.join(root, ".dlcache", "stats")
deadline = time.monotonic() + 120  # the replay fails in the background (nothing timed)
while True:
    with open(stats_path) as f:
        st = json.load(f)["streams"].get("default/0", {})
    if st.get("error") or time.monotonic() > deadline:
        break
    time.sleep(0.05)
print(json.dumps({"n": n, "stream": st}))
'''

#: a ``torch`` the daemon's replay worker finds first: it raises what nothing catches as
#: it is imported (as a broken install, or a native crash, ends the worker)
FAKE_TORCH = ("class TorchAbort(BaseException):\n    pass\n\n\n"
              "raise TorchAbort('this torch cannot be loaded here (test)')\n")

WHY = ("the sampler replay worker failed (exit code 1): torch.TorchAbort: this torch cannot "
       "be loaded here (test)")


@pytest.mark.daemon_log_allows(r"replay worker failed \(exit code 1\): torch\.TorchAbort: "
                               r"this torch cannot be loaded here \(test\)")
def test_a_dying_replay_worker_says_why(tmp_path, daemon_oracle):
    src = tmp_path / "src"
    make_images(src, classes=2, per_class=6)
    fake = tmp_path / "fake"
    (fake / "torch").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text(FAKE_TORCH)
    # the daemon (and so its worker) finds the fake torch; the training the real one
    path = os.pathsep.join(p for p in (str(fake), os.environ.get("PYTHONPATH")) if p)
    m = Mount(src, tmp_path / "mnt", tmp_path / "cache",
              cli=["env", f"PYTHONPATH={path}", *DLCACHEFS])
    daemon_oracle.watch(mount=m)
    with m:
        script = tmp_path / "train.py"
        script.write_text(TRAIN)
        r = subprocess.run([*DLCACHEFS, "run", "--no-intercept", "--", sys.executable,
                            str(script), str(m.mnt)], capture_output=True, text=True,
                           timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got["n"] == 12
        st = got["stream"]
        assert st["mode"] == "none" and st["reason"] == WHY, st
        assert st["error"] == WHY
    # the daemon's log says it too, without a traceback (the worker's stderr is its own)
    log = Path(m.log).read_text()
    assert f"WARNING dlcachefs.clairvoyance.replayworker: {WHY}" in log
    assert "Traceback" not in log
