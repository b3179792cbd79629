"""Tier 1: ``dlcachefs stats`` without a mount: the summary of a stats document
(:mod:`dlcachefs.admin.summary`), and ``--all`` / ``--json`` printing what they printed
before it (a mounted run: tests/test_t5_stats.py)."""

from __future__ import annotations

import json

from dlcachefs import cli
from dlcachefs.admin import advise, dlcachedir
from dlcachefs.admin.summary import summary

DOC = {"version": "0.1.0", "pid": 12, "source": "/src", "mountpoint": "/mnt/a",
       "uptime_s": 75.5, "files": 100, "bytes_total": 10 << 20, "cached_files": 100,
       "cached_bytes": 10 << 20, "cache_limit_bytes": 1 << 30, "hits": 150, "misses": 100,
       "prefetch_hits": 0, "substitutions": 0, "bytes_from_source": 10 << 20,
       "bytes_from_cache": 15 << 20, "bytes_from_peers": 0, "prefetched": 90,
       "cache_disk": {"free_bytes": 5 << 30, "below_min_free": False, "paused_s": 0},
       "source_latency": {"read_file": {"le": [[0.001, 3], ["+Inf", 4]], "sum": 0.01,
                                        "count": 4}},
       "fuse_ops": {"lookup": 10, "open": 250},
       "zerocopy": {"hits": 200, "hit_bytes": 20 << 20, "not_cached": 3, "fallbacks": 3,
                    "readers": 0, "events": 200, "events_lost": 0},
       "peers": None,
       "streams": {
           "default/0": {"mode": "replayed", "reason": "DistributedSampler replayed",
                         "epoch": 2, "position": 100, "samples": 100, "stall_seconds": 1.25,
                         "bytes_from_source": 10 << 20, "error": None,
                         "epochs": {"0": {"bytes_from_source": 10 << 20, "hits": 0,
                                          "misses": 100},
                                    "1": {"bytes_from_source": 0, "hits": 100, "misses": 0},
                                    "2": {"bytes_from_source": 0, "hits": 100, "misses": 0}},
                         "reads": {"mount_opens": 250, "in_process_opens": 200,
                                   "in_process_bytes": 20 << 20,
                                   "in_process_fallbacks": {"not_cached": 3}},
                         "loader": {}},
           "unannounced/7": {"mode": "none", "opens": 4, "command": "ls",
                             "reason": "announced nothing"}}}


def flat(text: str) -> str:
    """``text`` with its runs of spaces and line breaks as one space (wrapped lines
    joined, table columns as words)."""
    return " ".join(text.split())


def test_the_summary_reads_at_a_glance() -> None:
    lines = summary(DOC)
    print("\n".join(lines))
    out = flat("\n".join(lines))
    assert len(lines) <= 25
    assert lines[0] == "/mnt/a <- /src  (dlcachefs 0.1.0, pid 12, up 1 min 15 s)"
    assert lines[-1] == "(every counter: dlcachefs stats MNT --all; the raw document: --json)"
    for line in ("           epoch           0    1    2",  # the epochs as a table
                 "           from source 10.0M    0    0",
                 "           hits            0  100  100",
                 "           misses        100    0    0",
                 "warnings   none"):
        assert line in lines, line
    for text in (
            "cache 10.0M of the 1.0G limit (1.0%); 100 of 100 files (100.0% of the dataset's "
            "10.0M); 5.0G free on its disk",
            "opens 250 through the mount: 150 from the cache, 100 waited for the source",
            "hit ratio 77.8% of 450 reads served without waiting for the source",
            "in-process 200 reads (20.0M) served in the training's processes, 3 sent to the "
            "mount (not_cached 3)",
            "bytes 10.0M from the source, 15.0M from the cache",
            "ahead 90 files fetched ahead of a known order stream",
            "stream default/0: replayed, epoch 2, 100 of 100 samples read, 1.2 s stalled on "
            "the source why: DistributedSampler replayed epoch",
            "reads: 250 through the mount, 200 in-process (20.0M), fell back: not_cached 3",
            "stream unannounced/7: none, 4 opens by ls why: announced nothing",
            "advice stream default/0: no advice yet"):
        assert flat(text) in out, text
    assert "source_latency" not in out and "fuse_ops" not in out


def test_warnings_and_the_peer_tier() -> None:
    st = {"mountpoint": "/mnt/a", "source": "/src", "hits": 5, "misses": 5,
          "checksum_failures": 2, "write_errors": 1, "invariant_violations": 1,
          "stale_refetches": 3, "source_errors": 4, "bytes_from_peers": 1 << 20,
          "cache_disk": {"free_bytes": 1 << 30, "paused_s": 12, "paused_reason": "ENOSPC"},
          "peers": {"leases": 2, "servers": {"h1:1": {"state": "up", "hits": 3, "errors": 1},
                                             "h2:1": {"state": "down", "hits": 0}}},
          "streams": {"j/0": {"mode": "none", "reason": "r", "epoch": None,
                              "error": "the sampler replay worker failed: boom"}}}
    out = "\n".join(summary(st))
    for text in ("2 cached records failed their checksum", "1 cache writes failed",
                 "1 cache invariant violations", "3 cached files had changed on the source",
                 "4 source errors", "caching is paused for 12 s: ENOSPC",
                 "stream j/0: the sampler replay worker failed: boom",
                 "1 failed calls to the peer tier's servers",
                 "1 of 2 servers up (down: h2:1)", "1.0M from the peer tier",
                 "hit ratio  50.0% of 10 reads"):
        assert text in out, (text, out)
    assert "warnings   none" not in out
    assert summary({})  # a document of another version: no key is required


def test_all_and_json_print_what_they_did(monkeypatch, capsys) -> None:
    """``--all`` is the table of every key (then the peers and the advice), as ``stats``
    printed it before the summary; ``--json`` the document; neither is the summary."""
    monkeypatch.setattr(dlcachedir, "stats", lambda mnt: json.loads(json.dumps(DOC)))
    assert cli.main(["stats", "/mnt/a", "--all"]) == 0
    full = capsys.readouterr().out
    cli.print_tree(DOC)
    for a in advise.advise(DOC):
        print(advise.text(a))
    assert full == capsys.readouterr().out
    assert "source_latency:" in full and "fuse_ops:" in full and "why:" not in full
    assert cli.main(["stats", "/mnt/a", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == DOC
    assert cli.main(["stats", "/mnt/a"]) == 0
    assert capsys.readouterr().out == "\n".join(summary(DOC)) + "\n"


def test_a_streams_bytes_from_source_by_epoch() -> None:
    """A stream's ``epochs``: what the read path adds to its ``bytes_from_source`` counts
    in the epoch being read (the announced one from its announcement on), with its opens
    as hits or misses; the last MAX_EPOCHS epochs are kept."""
    from dlcachefs.clairvoyance.history import MAX_EPOCHS
    from dlcachefs.clairvoyance.stream import Stream

    s = Stream("j", 0)
    s.bytes_from_source += 7  # no epoch known yet: counted since mount only
    s.target_epoch = 0
    s.bytes_from_source += 100
    s.note_served(waited=True)
    s.epoch = 0
    s.target_epoch = 1  # announced: its opens and prefetch are the next epoch's
    s.bytes_from_source += 5
    s.note_served(waited=False)
    s.note_served(waited=False)
    assert s.bytes_from_source == 112
    assert s.stats()["epochs"] == {
        "0": {"bytes_from_source": 100, "hits": 0, "misses": 1},
        "1": {"bytes_from_source": 5, "hits": 2, "misses": 0}}
    for e in range(2, MAX_EPOCHS + 3):
        s.target_epoch = e
        s.note_served(waited=False)
    kept = s.stats()["epochs"]
    assert len(kept) == MAX_EPOCHS and list(kept)[0] == "3" and list(kept)[-1] == str(e)
    # a new run of the stream (the job restarted at epoch 0): its own rows, from its
    # first epoch on, not added to the last run's
    s.target_epoch = 0
    s.bytes_from_source += 9
    s.note_served(waited=True)
    s.target_epoch = 1
    s.note_served(waited=False)
    assert s.stats()["epochs"] == {
        "0": {"bytes_from_source": 9, "hits": 0, "misses": 1},
        "1": {"bytes_from_source": 0, "hits": 1, "misses": 0}}


def test_process_groups_that_announced_nothing_share_a_row_per_reason() -> None:
    st = {"streams": {f"unannounced/{pg}": {"mode": "none", "opens": 2, "command": "ls",
                                             "reason": "nothing announced"}
                      for pg in (5, 6, 7)}}
    lines = summary(st)
    rows = [line for line in lines if line.startswith("stream ")]
    assert rows == ["stream     unannounced/5 and 2 more process groups: none, 6 opens by ls"]
