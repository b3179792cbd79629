"""Dedup from the first read (dlcachefs.cache.dedup), in the core: dataset ``a`` cached in a
shared root, then dataset ``b`` (the same bytes under other names, with a ``sha256sum``
list) read the moment its core starts, before its first look at the root (the walk of a's
index, a child process) could be done. Every read waits for that look and borrows; before,
the reads of the first seconds went to b's source."""

from __future__ import annotations

import hashlib
import random
import time
from pathlib import Path

from dlcachefs.testing.fakes import make_config, read_all, run_session, write_tree


def test_reads_at_once_after_the_start_borrow_from_the_first(tmp_path: Path):
    rnd = random.Random(11)
    files = {f"c{i % 2}/f{i:02d}".encode(): rnd.randbytes(rnd.randrange(5_000, 30_000))
             for i in range(12)}
    names = {rel: b"train/" + rel.replace(b"/", b"_") for rel in files}
    write_tree(tmp_path / "a", files)
    write_tree(tmp_path / "b", {names[r]: d for r, d in files.items()})
    time.sleep(0.05)  # the list's time clear of the files' (trusted: written after them)
    manifest = tmp_path / "b" / "SHA256SUMS"
    manifest.write_text("".join(f"{hashlib.sha256(d).hexdigest()}  {names[r].decode()}\n"
                                for r, d in files.items()))
    root = tmp_path / "root"
    common = dict(cache_size=16 << 20, shared_cache=True)

    async def cache_all(sess):
        for rel, data in files.items():
            assert await read_all(sess.engine, rel) == data
        await sess.engine.flush()

    run_session(make_config(tmp_path / "a", root, dataset="a", **common), cache_all)

    async def read_b_at_once(sess):
        for rel, data in files.items():
            assert await read_all(sess.engine, names[rel]) == data
        return sess.engine.counters.bytes_from_source, sess.dedup.stats()

    cfg = make_config(tmp_path / "b", root, dataset="b", content_manifest=str(manifest),
                      **common)
    (from_source, d), _ = run_session(cfg, read_b_at_once)
    assert from_source == 0, d  # the first reads too were borrowed
    assert d["borrowed_files"] == len(files) and d["siblings"] == ["a"], d
    assert d["held"] >= 1 and d["first_look_s"] is not None, d  # it did wait for the look
