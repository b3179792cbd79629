"""``dlcachefs top``: one frame as text (``--once``) of a real mount, and the frame's numbers."""

from __future__ import annotations

import random
import subprocess

from conftest import requires_fuse

from dlcachefs.admin.top import frame, quantile, render_rich, render_text
from dlcachefs.testing.mounting import DLCACHEFS


@requires_fuse
def test_top_once_prints_a_frame_of_the_mount(tmp_path, mount):
    rnd = random.Random(2)
    (tmp_path / "src" / "a").mkdir(parents=True)
    files = {}
    for i in range(12):
        data = rnd.randbytes(5000 + i)
        (tmp_path / "src" / "a" / f"{i}.bin").write_bytes(data)
        files[f"a/{i}.bin"] = data
    m = mount(tmp_path / "src")
    for rel, data in files.items():
        assert (m.mnt / rel).read_bytes() == data
    m.wait_cached(len(files))
    r = subprocess.run([*DLCACHEFS, "top", str(m.mnt), "--once", "--interval", "0.2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    print(out)  # the text capture, in the test's output
    assert out.startswith(f"dlcachefs top: {m.mnt} <- {tmp_path / 'src'}")
    assert "files cached        12 of 12" in out
    assert "hits / misses              0 / 12" in out
    assert "read_file" in out or "no source calls" in out
    # the reading process announced nothing: its stream is listed as such
    assert "unannounced/" in out
    r = subprocess.run([*DLCACHEFS, "top", str(tmp_path), "--once"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "not a dlcachefs mount" in r.stderr
    # not a terminal, no --once: frame after frame as plain text, each written at once
    # (read until two came; before, nothing was written until the command ended)
    p = subprocess.Popen([*DLCACHEFS, "top", str(m.mnt), "--interval", "0.1"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        seen = 0
        for line in p.stdout:
            seen += line.startswith("dlcachefs top: ")
            assert "\x1b" not in line
            if seen == 2:
                break
        assert seen == 2, p.stderr.read()
    finally:
        p.terminate()
        p.wait(timeout=30)


def test_frame_rates_and_latency_window():
    prev = {"hits": 10, "misses": 5, "bytes_from_source": 0, "bytes_from_cache": 0,
            "cache_limit_bytes": 1000, "chunk_bytes": 100,
            "source_latency": {"read_file": {"le": [[0.001, 1], [0.01, 2], ["+Inf", 2]],
                                             "sum": 0.005, "count": 2}}}
    cur = {**prev, "hits": 30, "misses": 15, "bytes_from_source": 4096,
           "chunk_bytes": 500,
           "source_latency": {"read_file": {"le": [[0.001, 1], [0.01, 2], ["+Inf", 6]],
                                            "sum": 4.005, "count": 6}},
           "streams": {"j/0": {"mode": "replayed", "epoch": 1, "position": 5, "samples": 9,
                               "prefetch_lead": 3, "stall_seconds": 0.5,
                               "bytes_from_source": 10,
                               "loader": {"batch": 8, "workers": 2, "prefetch_factor": 2,
                                          "current": {"epoch": 1, "opens": 400,
                                                      "workers_seen": 2, "span_s": 2.0,
                                                      "sample_fetch_s": 0.01,
                                                      "in_batch_gaps": 300,
                                                      "between_batches_s": 0.16,
                                                      "worker_pids": []}}}}}
    f = frame(cur, prev, 2.0, "/m")
    text = render_text(f)
    assert "10.0/s hits, 5.0/s misses (hit ratio 66.7%)" in text
    assert "2.0K/s" in text  # 4096 bytes from the source in 2 s
    assert "50.0%" in text  # 500 of 1000
    # only the 4 calls of the interval, all above 10 ms: mean 1 s, p50 in the +Inf bucket
    assert "4 calls, mean 1000.0 ms, p50 <= inf" in text
    assert "j/0" in text and "2 -> 1" in text  # see test_t1_advise's waiting workers
    render_rich(f)  # builds


def test_quantile():
    le = [[0.001, 50], [0.01, 99], [0.1, 100], ["+Inf", 100]]
    assert quantile(le, 0.5) == 0.001
    assert quantile(le, 0.99) == 0.01
    assert quantile(le, 1.0) == 0.1
    assert quantile([["+Inf", 0]], 0.5) is None


@requires_fuse
def test_paths_with_brackets_are_shown_as_they_are(tmp_path, mount):
    # rich reads "[...]" as markup: a source directory named like a tag must not change
    # the view nor break it ("[/y]" closes nothing: MarkupError)
    import io

    from rich.console import Console

    from dlcachefs.admin import dlcachedir

    src = tmp_path / "[bold]x[/y]"
    (src / "[red]d").mkdir(parents=True)
    (src / "[red]d" / "f.bin").write_bytes(b"abc" * 100)
    m = mount(src)
    assert (m.mnt / "[red]d" / "f.bin").read_bytes() == b"abc" * 100
    r = subprocess.run([*DLCACHEFS, "top", str(m.mnt), "--once", "--interval", "0.1"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"<- {src}" in r.stdout
    f = frame(dlcachedir.stats(str(m.mnt)), None, 0.0, str(m.mnt))
    out = io.StringIO()
    Console(file=out, width=400, color_system=None).print(render_rich(f))
    assert f"<- {src} (pid" in out.getvalue()
