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

from dlcachefs.store import schema as S
from dlcachefs.testing.fakes import make_config, read_all, run_session, write_tree


def _copies(tmp_path: Path) -> tuple[dict[bytes, bytes], dict[bytes, bytes], Path]:
    """a cached in the root; b the same bytes under other names, and b's sha256sum list."""
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
    return files, names, manifest


def test_reads_at_once_after_the_start_borrow_from_the_first(tmp_path: Path):
    files, names, manifest = _copies(tmp_path)
    root = tmp_path / "root"

    async def read_b_at_once(sess):
        for rel, data in files.items():
            assert await read_all(sess.engine, names[rel]) == data
        return sess.engine.counters.bytes_from_source, sess.dedup.stats()

    cfg = make_config(tmp_path / "b", root, dataset="b", content_manifest=str(manifest),
                      cache_size=16 << 20, shared_cache=True)
    (from_source, d), _ = run_session(cfg, read_b_at_once)
    assert from_source == 0, d  # the first reads too were borrowed
    assert d["borrowed_files"] == len(files) and d["siblings"] == ["a"], d
    assert d["held"] >= 1 and d["first_look_s"] is not None, d  # it did wait for the look


def test_without_a_list_a_read_at_once_is_not_held_and_no_second_copy_is_made(tmp_path):
    """No list: b's files are read from b's source (their digests are unknown before);
    the reader gets them at once, and whether they are cached in b is decided once the
    first look reached a: a holds them, so nothing is cached in b."""
    files, names, _ = _copies(tmp_path)
    root = tmp_path / "root"

    async def read_b_at_once(sess):
        for rel, data in files.items():
            assert await read_all(sess.engine, names[rel]) == data
        await sess.engine.flush()  # the backlog too: decided in the background
        return (sess.engine.counters.bytes_from_source, sess.dedup.stats(),
                sess.engine.index.counter(S.K_CHUNK_BYTES))

    cfg = make_config(tmp_path / "b", root, dataset="b", cache_size=16 << 20,
                      shared_cache=True)
    (from_source, d, chunk_bytes), _ = run_session(cfg, read_b_at_once)
    assert from_source == sum(map(len, files.values()))  # read once, to learn the digests
    assert d["held"] == 0, d  # no reader waited for the look
    assert d["held_elsewhere"] == len(files) and chunk_bytes == 0, d  # no second copy
