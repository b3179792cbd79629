"""Tier 1: mount options (dlcachefs.config.OPTIONS), the command line, the fstab helper's
``-o`` and ``--config`` files, and the precedence rule command line > file > defaults.
Nothing here mounts (a mounted --config test is in test_t4_mounted.py)."""

from __future__ import annotations

import argparse
import dataclasses
import grp
import json
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlcachefs.cli import (
    build_parser,
    config_from_args,
    main,
    mount_helper_argv,
    mount_helper_main,
    split_mount_options,
)
from dlcachefs.config import OPTIONS, Config, default_cache_dir, option

SRC, MNT = "/data/src", "/mnt/dl"
POSITIONAL = {"source", "mountpoint"}


def cfg_of(*args: str) -> Config:
    return config_from_args(build_parser().parse_args(["mount", SRC, MNT, *args]))


def mount_parser() -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["mount"]


def toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string for these values
    return repr(v)


def write_toml(directory: str, values: dict[str, object], name: str = "c.toml") -> str:
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        f.writelines(f"{k} = {toml_value(v)}\n" for k, v in values.items())
    return path


# ----- one table ------------------------------------------------------------------------------

def test_every_config_field_has_an_option_and_every_option_a_field():
    fields = {f.name for f in dataclasses.fields(Config)}
    assert {o.field for o in OPTIONS} == fields - POSITIONAL
    actions = mount_parser()._actions
    assert {a.dest for a in actions if not a.option_strings} == POSITIONAL
    assert {a.dest for a in actions if a.option_strings} - {"help", "config"} == fields - POSITIONAL
    for o in OPTIONS:  # and the fstab helper knows every one of them
        key = o.key if o.kind == "flag" else f"{o.key}=x"
        assert mount_helper_argv([SRC, MNT, "-o", key])[3] == o.flag


def test_no_options_give_config_defaults():
    assert cfg_of() == Config(source=SRC, mountpoint=MNT, cache_dir=default_cache_dir(SRC))


def test_existing_spellings_still_work():
    cfg = cfg_of("--cache-dir", "/ssd/c", "--cache-size", "500G", "--chunk-size", "4M",
                 "--memory", "2G", "--min-free", "0", "--revalidate", "0", "--rescan",
                 "--ignore-source-inode", "--source-threads", "4", "--source-timeout", "5",
                 "--policy", "icache:package=1M,h_ratio=0.9", "--substitute", "--trace", "t.json",
                 "--h-fraction", "0.5", "--no-reorder", "-f", "--allow-other",
                 "--log-level", "debug", "--debug-invariants")
    assert cfg == Config(
        source=SRC, mountpoint=MNT, cache_dir="/ssd/c", cache_size=500 << 30, chunk_size=4 << 20,
        memory=2 << 30, min_free=0, revalidate=0.0, rescan=True, use_source_inode=False,
        source_threads=4, source_timeout=5.0, policy="icache:package=1M,h_ratio=0.9",
        substitute=True, trace=os.path.abspath("t.json"), h_fraction=0.5, reorder=False,
        foreground=True, allow_other=True, log_level="debug", debug_invariants=True)


def test_help_shows_exact_defaults():
    helps = mount_parser().format_help()
    for o in OPTIONS:
        assert o.flag in helps
        if o.kind != "flag" and o.show_default and o.default is not None:
            assert o.parse(o.show(o.default)) == o.default
    assert "cache size limit (default 200G)" in helps
    assert "in-memory chunk tier size (default 1G)" in helps


def test_bad_command_line_values_exit_2(capsys):
    for args in (["--source-threads", "x"], ["--cache-size", "4Q"], ["--log-level", "loud"]):
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(["mount", SRC, MNT, *args])
        assert e.value.code == 2
        assert args[0] in capsys.readouterr().err


# ----- precedence: command line > file > defaults -------------------------------------------

# (field, command-line values, file values); a flag's command line can only set it
PRECEDENCE = {
    "cache_size": (st.sampled_from(["4M", "3G", "12345"]),
                   st.sampled_from([4 << 20, "7M", "1T", 0])),
    "revalidate": (st.sampled_from(["0", "1.5", "600"]), st.sampled_from([0, 2.5, 7200])),
    "source_threads": (st.sampled_from(["1", "3"]), st.sampled_from([2, 64])),
    "policy": (st.sampled_from(["lcache", "icache:package=1M"]),
               st.sampled_from(["reuse-distance", "icache:h_ratio=0.9"])),
    "rescan": (st.just(None), st.booleans()),
    "use_source_inode": (st.just(None), st.booleans()),
    "reorder": (st.just(None), st.booleans()),
}


@st.composite
def layers(draw):
    cli, file = {}, {}
    for field, (cli_values, file_values) in PRECEDENCE.items():
        if draw(st.booleans()):
            cli[field] = draw(cli_values)
        if draw(st.booleans()):
            file[field] = draw(file_values)
    return cli, file


@settings(max_examples=150, deadline=None)
@given(layers=layers(), dash=st.booleans())
def test_command_line_over_file_over_defaults(layers, dash):
    cli, file = layers
    argv, toml = [], {}
    for field, v in cli.items():
        o = next(o for o in OPTIONS if o.field == field)
        argv += [o.flag] if o.kind == "flag" else [o.flag, v]
    for field, v in file.items():
        o = next(o for o in OPTIONS if o.field == field)
        toml[o.name if dash else o.key] = v
    with tempfile.TemporaryDirectory() as d:
        cfg = cfg_of(*argv, "--config", write_toml(d, toml)) if toml else cfg_of(*argv)
    defaults = Config(source=SRC, mountpoint=MNT, cache_dir=default_cache_dir(SRC))
    for field in PRECEDENCE:
        o = next(o for o in OPTIONS if o.field == field)
        if field in cli:
            want = o.const if o.kind == "flag" else o.parse(cli[field])
        elif field in file:
            want = o.from_file(file[field])
        else:
            want = getattr(defaults, field)
        assert getattr(cfg, field) == want, (field, cli, file)


def test_file_values_and_paths(tmp_path):
    sub = tmp_path / "conf"
    sub.mkdir()
    path = write_toml(str(sub), {"cache-dir": "cache", "trace": "~/t.json", "memory": 512,
                                 "h_fraction": 1, "log-level": "warning", "substitute": True,
                                 "no_reorder": False, "ignore_source_inode": True})
    cfg = cfg_of("--config", path)
    assert cfg.cache_dir == str(sub / "cache")  # relative to the file
    assert cfg.trace == os.path.expanduser("~/t.json")
    assert (cfg.memory, cfg.h_fraction, cfg.log_level) == (512, 1.0, "warning")
    assert cfg.substitute and cfg.reorder and not cfg.use_source_inode
    assert cfg_of("--config", path, "--cache-dir", "c2").cache_dir == os.path.abspath("c2")


BAD_FILES = [
    ("cache_sise = 1\n", "'cache_sise' (did you mean cache_size?)"),
    ("[mount]\ncache_size = 1\n", "unknown key 'mount'"),
    ("source = '/x'\n", "unknown key 'source'"),
    ("cache_size = [1]\n", "key 'cache_size': expected a size"),
    ("cache_size = '4Q'\n", "key 'cache_size': not a size"),
    ("cache_size = -1\n", "key 'cache_size'"),
    ("rescan = 1\n", "key 'rescan': expected true or false"),
    ("source_threads = '4'\n", "key 'source_threads': expected an integer"),
    ("source-threads = true\n", "key 'source-threads': expected an integer, got a boolean"),
    ("revalidate = '1h'\n", "key 'revalidate': expected a number"),
    ("log_level = 'loud'\n", "key 'log_level': expected one of debug, info"),
    ("trace = 3\n", "key 'trace'"),
    ("memory = 1\nmemory_x = 2\n", "unknown key 'memory_x'"),
    ("cache_size = 1\ncache-size = 2\n", "'cache_size' and 'cache-size'"),
    ("cache_size = \n", "not valid TOML"),
    ("chunk_size = 100\n", "--chunk-size must be at least 4K"),
    ("policy = 'bogus'\n", "unknown policy 'bogus'"),
]


@pytest.mark.parametrize("text, message", BAD_FILES)
def test_bad_config_file_exits_2_naming_the_key(tmp_path, capsys, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    # a source that does not exist: should the file be taken, nothing is mounted (exit 1)
    assert main(["mount", str(tmp_path / "nosrc"), str(tmp_path / "mnt"), "--config",
                 str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.startswith("dlcachefs: ")


def test_missing_config_file_exits_2(tmp_path, capsys):
    assert main(["mount", str(tmp_path), str(tmp_path / "m"), "--config",
                 str(tmp_path / "none.toml")]) == 2
    assert "none.toml: No such file" in capsys.readouterr().err


# ----- fstab ----------------------------------------------------------------------------------

def test_split_mount_options():
    assert split_mount_options('rw,a=1,b,,p="x:k=1,j=2",c=d=e') == [
        "rw", "a=1", "b", "p=x:k=1,j=2", "c=d=e"]


def values(o):
    """Field values of option ``o`` that Config accepts."""
    if o.kind == "flag":
        return st.just(o.const)
    if o.kind == "size":
        lo = 4096 if o.field in ("chunk_size", "peer_item_max") else 0
        return st.one_of(st.integers(lo, 1 << 50), st.integers(max(1, lo >> 20), 4096).map(
            lambda n: n << 20))
    if o.kind == "int":
        return st.integers(1, 10_000)
    if o.kind == "float":
        top = 1.0 if o.field in ("h_fraction", "share_floor") else 1e7
        return st.floats(0.001, top, allow_nan=False, allow_infinity=False)
    if o.kind == "path":
        return st.sampled_from(["/ssd/cache", "/ssd/a,b", "/x/é y"])
    if o.field == "policy":
        return st.sampled_from(["lru", "lcache", "icache:package=1M,h_ratio=0.9"])
    if o.field == "peers":  # commas: quoted in fstab
        return st.sampled_from(["h1:11211", "h1:11211,10.0.0.2:11211,[::1]:11212"])
    if o.field == "peer_namespace":
        return st.sampled_from(["imagenet", "/nfs/imagenet"])
    if o.field == "dataset":
        return st.sampled_from(["imagenet", "coco_2017", "a.b-c"])
    if o.field == "peer_self":
        return st.just("h1:11211")
    if o.field == "content_xattr":
        return st.sampled_from(["user.sha256", "user.checksum.sha256"])
    if o.field == "reader_group":  # a group this user is in (config_from_args checks it)
        return st.sampled_from([grp.getgrgid(os.getegid()).gr_name, str(os.getegid())])
    if o.field == "metrics_addr":
        return st.sampled_from(["127.0.0.1", "0.0.0.0", "::1"])
    return st.sampled_from(o.choices)


@st.composite
def option_sets(draw):
    chosen = draw(st.lists(st.sampled_from(OPTIONS), unique=True))
    vals = {o.field: draw(values(o)) for o in chosen}
    if vals.keys() & {"dataset", "content_manifest", "content_xattr"}:
        vals["shared_cache"] = True  # these need --shared-cache
        vals.pop("dedup", None)  # and dedup on (the flag is --no-dedup)
    if "peer_self" in vals:  # one of --peers
        vals["peers"] = "h1:11211,10.0.0.2:11211"
    return vals


def fstab_string(vals: dict) -> str:
    items = ["rw", "noauto", "x-systemd.automount"]
    for o in OPTIONS:
        if o.field in vals:
            if o.kind == "flag":
                items.append(o.key)
            else:
                text = o.show(vals[o.field])
                items.append(f'{o.key}="{text}"' if "," in text else f"{o.key}={text}")
    return ",".join(items)


@settings(max_examples=200, deadline=None)
@given(vals=option_sets())
def test_fstab_options_round_trip(vals):
    argv = mount_helper_argv([SRC, MNT, "-o", fstab_string(vals)])
    cfg = config_from_args(build_parser().parse_args(argv))
    assert {f: getattr(cfg, f) for f in vals} == vals


def test_fstab_helper_errors(capsys):
    for opts, message in [("bogus=1", "unknown mount option 'bogus=1'"),
                          ("rescan=1", "'rescan' is a flag"),
                          ("cache_size", "'cache_size' needs a value"),
                          ("config", "'config' needs a value")]:
        with pytest.raises(ValueError, match=message):
            mount_helper_argv([SRC, MNT, "-o", opts])
        assert mount_helper_main([SRC, MNT, "-o", opts]) == 1
        assert message in capsys.readouterr().err


def test_fstab_config_option_is_a_file_under_the_other_options(tmp_path):
    path = write_toml(str(tmp_path), {"cache_size": "4M", "memory": "2M"})
    argv = mount_helper_argv([SRC, MNT, "-o", f"memory=8M,config={path},no_reorder"])
    assert argv == ["mount", SRC, MNT, "--memory", "8M", "--config", path, "--no-reorder"]
    cfg = config_from_args(build_parser().parse_args(argv))
    assert (cfg.cache_size, cfg.memory, cfg.reorder) == (4 << 20, 8 << 20, False)


def test_option_lookup_accepts_both_spellings():
    assert option("cache_size") is option("cache-size") is not None
    assert option("no_reorder").field == "reorder"
    assert option("reorder") is None and option("config") is None
    assert Path(default_cache_dir(SRC)).name.startswith("src-")


# ----- the peer tier's options ----------------------------------------------------------------

def test_peers_are_parsed_and_checked(capsys):
    from dlcachefs.config import peer_list

    assert peer_list("a:1, b.example:11211,[::1]:2,") == [
        ("a", 1), ("b.example", 11211), ("::1", 2)]
    cfg = cfg_of("--peers", "h1:11211,h2:11211", "--peer-timeout", "0.25",
                 "--peer-item-max", "8M", "--peer-lease", "5", "--peer-namespace", "ds")
    assert (cfg.peers, cfg.peer_timeout, cfg.peer_item_max, cfg.peer_lease,
            cfg.peer_namespace) == ("h1:11211,h2:11211", 0.25, 8 << 20, 5.0, "ds")
    assert cfg_of().peers is None  # no --peers: no tier
    for bad in ("h1", "h1:", ":11211", "h1:0", "h1:70000", "h1:x", "h1:1,h1:1", ","):
        with pytest.raises(ValueError, match="--peers"):
            peer_list(bad)
        assert main(["mount", SRC, MNT, "--peers", bad]) == 2
        assert "--peers" in capsys.readouterr().err
    for args in (["--peer-timeout", "0"], ["--peer-item-max", "1K"], ["--peer-lease", "-1"],
                 ["--peer-dead-time", "0"]):
        assert main(["mount", SRC, MNT, "--peers", "h:1", *args]) == 2
        assert args[0] in capsys.readouterr().err


def test_peer_key_inode_is_off_by_default():
    assert cfg_of("--peers", "h:1").peer_key_inode is False
    assert cfg_of("--peers", "h:1", "--peer-key-inode").peer_key_inode is True


def test_the_core_does_not_import_pymemcache_without_peers():
    import subprocess
    import sys

    code = ("import sys, dlcachefs.cache.engine, dlcachefs.session, dlcachefs.cli; "
            "assert 'pymemcache' not in sys.modules, 'imported'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_metrics_port_without_prometheus_client_names_the_extra(tmp_path):
    """``--metrics-port`` where prometheus-client is not installed: refused before the
    daemon starts, naming the extra to install (as ``--peers`` names pymemcache's), not
    "No module named 'prometheus_client'" from the daemon; the module itself says the
    same if it is imported anyway."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['prometheus_client'] = None\n"
            "from dlcachefs.cli import main\n"
            f"rc = main(['mount', {SRC!r}, {MNT!r}, '--metrics-port', '9109'])\n"
            "print('rc', rc)\n"
            "try:\n"
            "    import dlcachefs.admin.metrics\n"
            "except ModuleNotFoundError as e:\n"
            "    print('import:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "rc 2" in r.stdout, r.stdout
    want = "--metrics-port needs prometheus-client: pip install 'dlcachefs[ops]'"
    assert want in r.stderr, r.stderr
    assert f"import: {want}" in r.stdout, r.stdout
    # with the module there, the same command line is accepted
    assert cfg_of("--metrics-port", "9109").metrics_port == 9109


def test_python_dash_m_dlcachefs_runs_the_command_line(tmp_path):
    """``python -m dlcachefs`` is the ``dlcachefs`` command: its help, and its exit
    statuses (a stats of a directory that is not a mount: 2)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "dlcachefs", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage: dlcachefs ") and "umount" in r.stdout
    r = subprocess.run([sys.executable, "-m", "dlcachefs", "stats", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("dlcachefs stats: "), r.stderr


@pytest.mark.parametrize("extra, message", [
    ({"peer_self": "h1:11211"}, "--peer-self needs --peers"),
    ({"peer_self": "h3:11211", "peers": "h1:11211,h2:11211"}, "is not one of --peers"),
    ({"content_manifest": "/x/SHA256SUMS"}, "need --shared-cache"),
    ({"content_xattr": "user.sha256", "shared_cache": True, "dedup": False},
     "drop --no-dedup"),
])
def test_options_that_need_another_are_refused_with_the_reason(extra, message):
    with pytest.raises(ValueError, match=message):
        Config(source=SRC, mountpoint=MNT, cache_dir="/c", **extra)


def test_human_stats_show_sections_as_indented_lines(capsys):
    """``dlcachefs stats`` without --json: sections (streams, fuse_ops, latencies) as
    indented key/value lines, not one-line dict dumps; sizes in units and exact."""
    from dlcachefs.cli import print_tree

    print_tree({"hits": 12, "bytes_from_source": 123456789, "cache_disk_bytes_read": 2 << 20,
                "cache_disk_bytes_read_back": 3 << 30, "wrong_bytes_reads": 2048,
                "policy": {"h_capacity": 11534336, "package_size": 1 << 20, "h_units": 3},
                "uptime_s": 12.34567,
                "streams": {"default/0": {"mode": "replayed", "loader": {"opens": 5},
                                          "substitutions": {}}},
                "fuse_ops": {"lookup": 10}, "sizes": [1, 2], "error": None,
                "le": [[0.0005, 0], [0.001, 1], [0.0025, 1], ["+Inf", 3]]})
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "hits                        12",
        "bytes_from_source           117.7M (123,456,789)",
        "cache_disk_bytes_read       2.0M (2,097,152)",
        "cache_disk_bytes_read_back  3.0G (3,221,225,472)",
        "wrong_bytes_reads           2048",
        "policy:",
        "  h_capacity    11.0M (11,534,336)",
        "  package_size  1.0M (1,048,576)",
        "  h_units       3",
        "uptime_s                    12.346",
        "streams:",
        "  default/0:",
        "    mode           replayed",
        "    loader:",
        "      opens  5",
        "    substitutions  -",
        "fuse_ops:",
        "  lookup  10",
        "sizes                       1, 2",
        "error                       None",
        "le                          0.0005: 0, 0.001: 1, 0.0025: 1, +Inf: 3",
    ]
    assert not any("{" in line for line in lines)


FLOAT_FIELDS = [f.name for f in dataclasses.fields(Config) if f.type == "float"]


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_number_option_that_is_not_finite_is_refused(field, value):
    """NaN passed every "<= 0" check (--share-interval nan ended the daemon after a mount
    that said it succeeded; --peer-timeout nan failed every lookup), inf overflowed timers."""
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')} must be a finite"):
        Config(source=SRC, mountpoint=MNT, cache_dir="/c", **{field: value})


def test_every_number_option_is_checked_for_finiteness():
    assert {"revalidate", "source_timeout", "peer_timeout", "share_interval",
            "share_halflife"} <= set(FLOAT_FIELDS)
