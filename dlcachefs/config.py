"""The one frozen configuration of a mount, and the options it is made from.

Every option of ``dlcachefs mount`` is a field of :class:`Config`: its name, type, default
and help are written once, on the field (:func:`_opt`), and :data:`OPTIONS` is made from
them. The command line, the fstab helper's ``-o key=value`` (both in ``dlcachefs.cli``)
and a ``--config`` TOML file (:func:`read_config_file`) are read through that table and
merged by one rule, in :func:`build_config`: command line > file > defaults.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dlcachefs.units import format_size_exact, parse_size


def default_cache_dir(source: str) -> str:
    """``$XDG_CACHE_HOME/dlcachefs/<name>-<hash of the source's real path>``.

    One cache per source: mounting the same source again finds its cache; two sources
    with the same base name do not collide.
    """
    real = os.path.realpath(source)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    tag = hashlib.sha256(os.fsencode(real)).hexdigest()[:12]
    name = os.path.basename(real.rstrip("/")) or "root"
    return os.path.join(base, "dlcachefs", f"{name}-{tag}")


#: a ``--dataset`` name: a directory name under ``<root>/datasets/``, never hidden
_DATASET_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,63}")
#: where a shared cache root keeps its datasets' own caches (``--shared-cache``)
DATASETS_DIR = "datasets"


def default_dataset_id(source: str) -> str:
    """``<name>-<hash of the source's real path>``: a source's dataset in a shared root, named
    as :func:`default_cache_dir` names a source's own cache."""
    real = os.path.realpath(source)
    tag = hashlib.sha256(os.fsencode(real)).hexdigest()[:12]
    name = os.path.basename(real.rstrip("/")) or "root"
    name = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:48].lstrip(".") or "root"
    return f"{name}-{tag}"


def default_shared_root() -> str:
    """``$XDG_CACHE_HOME/dlcachefs/shared``: the cache root of ``--shared-cache`` mounts
    given no ``--cache-dir``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "dlcachefs", "shared")


def peer_list(text: str) -> list[tuple[str, int]]:
    """``"h1:11211,[::1]:11212"`` -> ``[("h1", 11211), ("::1", 11212)]``, duplicates
    refused. Raises ValueError naming the bad entry."""
    out: list[tuple[str, int]] = []
    for item in (t.strip() for t in text.split(",")):
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--peers: not HOST:PORT: {item!r}")
        if (host, int(port)) in out:
            raise ValueError(f"--peers: {item!r} is listed twice")
        out.append((host, int(port)))
    if not out:
        raise ValueError("--peers: no server given")
    return out


def _opt(default: Any = dataclasses.MISSING, text: str = "", **spec: Any) -> Any:
    """A Config field that is a mount option; ``spec`` holds :class:`Option`'s other
    attributes (``name``, ``kind``, ``short``, ``metavar``, ``choices``, ``show_default``);
    the rest comes from the field."""
    return dataclasses.field(default=default, metadata={"option": {"help": text, **spec}})


@dataclass(frozen=True)
class Config:
    """Everything a mount is configured with. Sizes in bytes, times in seconds.

    The order of the fields is the order of ``dlcachefs mount --help``."""

    source: str
    mountpoint: str
    cache_dir: str = _opt(text="cache directory (default: ~/.cache/dlcachefs/<source>-<hash>)",
                          kind="path", show_default=False)
    cache_size: int = _opt(200 << 30, "cache size limit", kind="size")
    chunk_size: int = _opt(16 << 20, "chunk size", kind="size")
    memory: int = _opt(1 << 30, "in-memory chunk tier size", kind="size")
    min_free: int = _opt(1 << 30, "free space to leave on the cache disk", kind="size")
    log_size: int = _opt(1 << 30, "a new log file is started past this size", kind="size")
    revalidate: float = _opt(  # see dlcachefs.cache.namespace for the rule
        3600.0, "how old source metadata may be before an open checks it again; "
                "0 = check at every open", metavar="SECONDS")
    rescan: bool = _opt(False, "re-list the whole source at mount")
    use_source_inode: bool = _opt(
        True, "identify source versions by size and mtime only (for sources whose inode "
              "numbers change, e.g. sshfs without -o use_ino)", name="ignore-source-inode")
    source_threads: int = _opt(16, "parallel source reads")
    fetch_workers: int = _opt(  # see dlcachefs.cache.fetchpool
        0, "processes that read, checksum and append the files fetched ahead of readers "
           "(0: the daemon does it itself)", metavar="N")
    source_timeout: float = _opt(
        60.0, "give up on a source read after this long: ETIMEDOUT", metavar="SECONDS")
    source_retries: int = _opt(
        2, "retries of a source read that failed with a transient error (EIO, ENOTCONN, ...)")
    flush_interval: float = _opt(
        2.0, "seal a partly filled chunk this long after its first record", metavar="SECONDS")
    max_cached_file: int = _opt(
        256 << 20, "larger files are read through from the source, never cached", kind="size")
    policy: str = _opt(  # see dlcachefs.policies
        "lru", "caching policy: lru (default), reuse-distance, lcache, icache; "
               "options after a colon, e.g. icache:package=1M,h_ratio=0.9",
        metavar="NAME[:KEY=VALUE,...]", show_default=False)
    substitute: bool = _opt(
        False, "serve a missed low-importance sample with a cached one of the same class "
               "directory not yet used this epoch (iCACHE; needs losses)")
    trace: str | None = _opt(
        None, "record what announced trainings read (and their losses) into FILE at "
              "unmount, for 'dlcachefs simulate --trace FILE'", kind="path", metavar="FILE")
    h_fraction: float = _opt(
        0.7, "share of the dataset that counts as important, the H-list")
    scan_ahead: int = _opt(
        2, "when a reader with no known order reads a tree through (an epoch of a script "
           "that announced nothing, tar, cp -r), fetch the tree's other files ahead of it, "
           "N at a time (with --fetch-workers: N batches, read one file per worker at "
           "a time), into free cache room only; 0 = off", metavar="N")
    store_pages: int = _opt(
        4 << 20, "give the kernel's page cache, with the open, the bytes of a file up to "
                 "SIZE that the open holds in memory already (a miss just fetched, a file "
                 "fetched ahead): its READs then never come to the daemon; 0 = off",
        kind="size", metavar="SIZE")
    reorder: bool = _opt(
        True, "do not lay out each next epoch's log in its order (LCache)", name="no-reorder")
    reorder_min: int | None = _opt(
        None, "lay out the next epoch's log only for a dataset larger than SIZE (default: half "
              "of --memory: a dataset that fits in memory is read from it in any order, and a "
              "second copy written during an epoch would only take disk and CPU from it); "
              "0 = always", kind="size", metavar="SIZE")
    peers: str | None = _opt(
        None, "memcached servers of the cluster's shared peer tier, HOST:PORT,... (the same "
              "list on every node): a file missing here is looked up at its owner (rendezvous "
              "hash of path, size and mtime) before the source, and what this node reads from "
              "the source is stored there in the background (needs pymemcache)",
        metavar="HOST:PORT,...")
    peer_timeout: float = _opt(
        1.0, "a peer that does not answer within this long is marked down", metavar="SECONDS")
    peer_dead_time: float = _opt(
        30.0, "a peer marked down is probed again after this long (in the background)",
        metavar="SECONDS")
    peer_lease: float = _opt(
        10.0, "on a miss at the owner one node takes a lease and reads the source; the others "
              "wait for its value up to this long, then read the source themselves",
        metavar="SECONDS")
    peer_item_max: int = _opt(
        1 << 20, "the servers' item size limit (memcached -I); larger files are stored "
                 "in pieces that fit it (up to --max-cached-file)",
        kind="size")
    peer_namespace: str | None = _opt(
        None, "names this dataset in the tier (default: the source's real path; give the "
              "same name on every node when nodes mount it at different paths)",
        metavar="NAME", show_default=False)
    peer_key_inode: bool = _opt(
        False, "name a file version in the tier by its source inode too (size, mtime and "
               "inode, as the local cache does), for sources whose inode numbers agree "
               "across nodes (NFS, Lustre); not for sshfs, where they differ per node and "
               "no node would find another's values")
    peer_self: str | None = _opt(
        None, "this node's own server among --peers (HOST:PORT, as listed there): with it, "
              "the node fetches ahead, in the cluster's first-use order, the files it owns "
              "that a DistributedSampler's ranks will read (each file leaves the remote "
              "once, before any rank waits for it)", metavar="HOST:PORT", show_default=False)
    peer_keep: bool = _opt(
        True, "do not make sure the owner holds a file this node evicts (keeping the last "
              "copy in the cluster, Lobster 4.4, is on by default with --peers)",
        name="no-peer-keep")
    shared_cache: bool = _opt(
        False, "--cache-dir is a cache root shared by several mounts of different sources: "
               "each keeps its own cache under <root>/datasets/<id>/, and --cache-size is "
               "the budget of the whole root, divided among the datasets mounted by "
               "their re-fetch cost and use (see docs/shared-cache.md)")
    dataset: str | None = _opt(
        None, "with --shared-cache: this mount's dataset id under the root (default: the "
              "source's name and a hash of its real path)", metavar="NAME",
        show_default=False)
    share_policy: str = _opt(
        "cost", "with --shared-cache: how the budget is divided: cost (value per byte x "
                "re-fetch cost, DLCache's cost-aware LRFU) or equal",
        choices=("cost", "equal"))
    share_floor: float = _opt(
        0.1, "with --shared-cache: the share of the budget a mounted dataset never goes "
             "below (while its demand is that large), as a fraction")
    share_interval: float = _opt(
        2.0, "with --shared-cache: how often the daemon publishes its use in the root's "
             "ledger and adjusts its share", metavar="SECONDS")
    share_cooldown: float = _opt(
        60.0, "with --shared-cache: a dataset's value does not decay until this long after "
              "its last read (DLCache's cooldown)", metavar="SECONDS")
    share_halflife: float = _opt(
        600.0, "with --shared-cache: past the cooldown, a dataset's value halves in this "
               "long (LRFU's decay)", metavar="SECONDS")
    dedup: bool = _opt(
        True, "with --shared-cache: do not share identical bytes with the root's other "
              "datasets (by default a file whose SHA-256 another dataset holds is served "
              "from that copy and not cached twice)", name="no-dedup")
    content_manifest: str | None = _opt(
        None, "with --shared-cache: a SHA-256 list of the source's files (sha256sum's "
              "output; its paths are relative to the list's directory): a file it names "
              "that another dataset holds is served from there without a read of the "
              "source (trusted for files not modified after the list)", kind="path",
        metavar="FILE")
    content_xattr: str | None = _opt(
        None, "with --shared-cache: an extended attribute of the source's files holding "
              "their SHA-256 (64 hex digits, or 32 bytes), e.g. user.sha256", metavar="NAME")
    foreground: bool = _opt(False, "do not daemonize", short="-f")
    allow_other: bool = _opt(
        False, "let other users use the mount (with default_permissions)")
    reader_group: str | None = _opt(
        None, "make the cache directory (a shared root too) readable by group NAME, for "
              "its members' zero-copy readers: they can read every cached byte, whatever "
              "the source's modes (docs/permissions.md); default: the owner's alone",
        metavar="NAME", show_default=False)
    keep_cache_modes: bool = _opt(
        False, "leave the modes of an existing cache directory as they are, only warn "
               "(by default what other users could read is tightened, with a warning)")
    metrics_port: int = _opt(
        0, "serve Prometheus metrics over HTTP on this port (/metrics); 0 = off",
        metavar="PORT")
    metrics_addr: str = _opt(
        "127.0.0.1", "address the metrics server listens on (0.0.0.0: every interface)",
        metavar="ADDR")
    log_level: str = _opt("info", "daemon log level",
                          choices=("debug", "info", "warning", "error"))
    debug_invariants: bool = _opt(
        False, "check the cache's invariants (--cache-size account, index, logs) after "
               "every commit; a violation is logged as an ERROR and counted in stats "
               "(invariant_violations). For tests: it scans the index")

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            # NaN passes every "<= 0" check below, and inf overflows timers: a number
            # option is finite (--peer-timeout nan made every lookup fail, --share-interval
            # nan ended the daemon after a "successful" mount)
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"--{f.name.replace('_', '-')} must be a finite number, "
                                 f"not {v}")
        if self.chunk_size < 4096:
            raise ValueError("--chunk-size must be at least 4K")
        if self.revalidate < 0:
            raise ValueError("--revalidate must be >= 0")
        if self.source_timeout <= 0:
            raise ValueError("--source-timeout must be > 0")
        if self.fetch_workers < 0:
            raise ValueError("--fetch-workers must be >= 0")
        if self.source_threads < 1:
            raise ValueError("--source-threads must be >= 1")
        if self.source_retries < 0:
            raise ValueError("--source-retries must be >= 0")
        if self.flush_interval <= 0:
            raise ValueError("--flush-interval must be > 0")
        if self.scan_ahead < 0:
            raise ValueError("--scan-ahead must be >= 0")
        if self.reader_group is not None and not self.reader_group.strip():
            raise ValueError("--reader-group needs a group name")
        if not 0 <= self.metrics_port <= 65535:
            raise ValueError("--metrics-port must be within 0..65535")
        if not 0.0 < self.h_fraction <= 1.0:
            raise ValueError("--h-fraction must be within (0, 1]")
        if self.peers is not None:
            peer_list(self.peers)  # raises ValueError naming the bad entry
        if self.peer_timeout <= 0 or self.peer_dead_time <= 0 or self.peer_lease <= 0:
            raise ValueError("--peer-timeout, --peer-dead-time and --peer-lease must be > 0")
        if self.peer_self is not None:
            if self.peers is None:
                raise ValueError("--peer-self needs --peers")
            if peer_list(self.peer_self)[0] not in peer_list(self.peers):
                raise ValueError(f"--peer-self {self.peer_self} is not one of --peers")
        if self.peer_item_max < 4096:
            raise ValueError("--peer-item-max must be at least 4K")
        if self.dataset is not None:
            if not self.shared_cache:
                raise ValueError("--dataset needs --shared-cache")
            if not _DATASET_NAME.fullmatch(self.dataset):
                raise ValueError("--dataset: 1-64 letters, digits, '.', '_' or '-', not "
                                 f"starting with '.' or '-': {self.dataset!r}")
        if (self.content_manifest or self.content_xattr) and not self.shared_cache:
            raise ValueError("--content-manifest and --content-xattr need --shared-cache "
                             "(identical bytes are shared between the datasets of a root)")
        if (self.content_manifest or self.content_xattr) and not self.dedup:
            raise ValueError("--content-manifest and --content-xattr are for dedup: "
                             "drop --no-dedup")
        if not 0.0 <= self.share_floor <= 1.0:
            raise ValueError("--share-floor must be within [0, 1]")
        if self.share_interval <= 0 or self.share_cooldown < 0 or self.share_halflife <= 0:
            raise ValueError("--share-interval and --share-halflife must be > 0, "
                             "--share-cooldown >= 0")

    @property
    def dataset_id(self) -> str | None:
        """This mount's dataset in a shared root (``--shared-cache``), else None."""
        if not self.shared_cache:
            return None
        return self.dataset or default_dataset_id(self.source)

    @property
    def data_dir(self) -> str:
        """This mount's own cache directory (index, logs, lock, log file): ``cache_dir``,
        or ``cache_dir/datasets/<id>`` with ``--shared-cache`` (then ``cache_dir`` is the
        root, shared by several mounts)."""
        if not self.shared_cache:
            return self.cache_dir
        return os.path.join(self.cache_dir, DATASETS_DIR, str(self.dataset_id))

    @property
    def index_dir(self) -> str:
        return os.path.join(self.data_dir, "meta.lmdb")

    @property
    def logs_dir(self) -> str:
        return os.path.join(self.data_dir, "logs")


# ----- the options table ------------------------------------------------------------------

_KIND_OF_TYPE = {"bool": "flag", "int": "int", "float": "float", "str": "str",
                 "str | None": "str"}
_EXPECTED = {"size": 'a size (an integer or a string like "4M")', "int": "an integer",
             "float": "a number", "str": "a string", "path": "a string (a path)",
             "flag": "true or false"}
_TOML_TYPES = {bool: "a boolean", int: "an integer", float: "a float", str: "a string",
               list: "an array", dict: "a table"}


@dataclass(frozen=True)
class Option:
    """One option of ``dlcachefs mount``, made from a :class:`Config` field.

    ``name`` is the command-line spelling (``--cache-size``); the fstab and file key is the
    same with ``_`` (``cache_size``), and both spellings are accepted there. A ``flag``
    takes no value on the command line or in fstab: it sets the field to the opposite of
    its default (``--no-reorder`` sets ``reorder`` to False).
    """

    field: str
    name: str
    kind: str                 # flag, size, int, float, str or path
    default: Any              # dataclasses.MISSING: computed (cache_dir, see build_config)
    help: str
    short: str | None = None
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    show_default: bool = True

    @property
    def flag(self) -> str:
        return "--" + self.name

    @property
    def key(self) -> str:
        return self.name.replace("-", "_")

    @property
    def const(self) -> bool:
        """What a flag sets its field to."""
        return not self.default

    def parse(self, text: str) -> Any:
        """The field value of a command-line (or fstab) value. Raises ValueError."""
        if self.kind == "size":
            return parse_size(text)
        try:
            if self.kind == "int":
                return int(text)
            if self.kind == "float":
                return float(text)
        except ValueError:
            raise ValueError(f"not {_EXPECTED[self.kind]}: {text!r}") from None
        return text

    def from_file(self, value: object) -> Any:
        """The field value of a TOML value. Raises ValueError saying what was expected."""
        if self.kind == "flag" and isinstance(value, bool):
            return self.const if value else not self.const
        if not isinstance(value, bool):  # a TOML boolean is never a number
            if self.kind == "size" and isinstance(value, int | str):
                return parse_size(value)
            if self.kind == "int" and isinstance(value, int):
                return value
            if self.kind == "float" and isinstance(value, int | float):
                return float(value)
            if self.kind in ("str", "path") and isinstance(value, str):
                if self.choices and value not in self.choices:
                    raise ValueError(f"expected one of {', '.join(self.choices)}, "
                                     f"got {value!r}")
                return value
        got = _TOML_TYPES.get(type(value), type(value).__name__)
        raise ValueError(f"expected {_EXPECTED[self.kind]}, got {got}")

    def show(self, value: Any) -> str:
        """``value`` as text that :meth:`parse` reads back (sizes in their unit)."""
        if self.kind == "size":
            return format_size_exact(value)
        if self.kind == "float":
            return repr(float(value)).removesuffix(".0")
        return str(value)

    def help_text(self) -> str:
        if (not self.show_default or self.kind == "flag"
                or self.default in (None, dataclasses.MISSING)):
            return self.help
        return f"{self.help} (default {self.show(self.default)})"


def _options() -> tuple[Option, ...]:
    out = []
    for f in dataclasses.fields(Config):
        spec = dict(f.metadata.get("option", ()))
        if not spec:
            continue  # source, mountpoint: the command's positional arguments
        spec.setdefault("name", f.name.replace("_", "-"))
        if "kind" not in spec:
            spec["kind"] = _KIND_OF_TYPE[f.type]
        out.append(Option(field=f.name, default=f.default, **spec))
    return tuple(out)


#: every mount option, in Config's field order
OPTIONS: tuple[Option, ...] = _options()
_BY_KEY = {o.key: o for o in OPTIONS}


def option(key: str) -> Option | None:
    """The option named ``key`` (``cache_size`` or ``cache-size``), or None."""
    return _BY_KEY.get(key.replace("-", "_"))


def unknown_key(key: str) -> str:
    """``unknown key 'cache_sise' (did you mean cache_size?)``"""
    close = difflib.get_close_matches(key.replace("-", "_"), list(_BY_KEY), n=1)
    return f"unknown key {key!r}" + (f" (did you mean {close[0]}?)" if close else "")


# ----- the --config file, and the precedence rule -------------------------------------------

def read_config_file(path: str) -> dict[str, Any]:
    """Field values from a TOML file of mount options (``cache_size = "4M"``, ``rescan =
    true``): keys are option names, with ``_`` or ``-``. Relative paths are taken from the
    file's directory. Raises ValueError naming the file and the key."""
    try:
        import tomllib  # noqa: PLC0415 - Python >= 3.11
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # noqa: PLC0415
        except ModuleNotFoundError:
            raise ValueError("--config needs Python >= 3.11 or the tomli package") from None
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"--config {path}: not valid TOML: {e}") from None
    base = os.path.dirname(os.path.abspath(path))
    out: dict[str, Any] = {}
    given: dict[str, str] = {}
    for key, value in data.items():
        o = option(key)
        if o is None:
            raise ValueError(f"--config {path}: {unknown_key(key)}")
        if o.field in given:
            raise ValueError(f"--config {path}: keys {given[o.field]!r} and {key!r} "
                             "set the same option")
        try:
            v = o.from_file(value)
        except ValueError as e:
            raise ValueError(f"--config {path}: key {key!r}: {e}") from None
        if o.kind == "path" and v:
            v = os.path.join(base, os.path.expanduser(v))
        out[o.field] = v
        given[o.field] = key
    return out


def build_config(source: str, mountpoint: str, cli: Mapping[str, Any],
                 file: Mapping[str, Any] | None = None) -> Config:
    """The Config of a mount, field by field from the command line, else the ``--config``
    file, else the field's default: the one precedence rule. ``cli`` and ``file`` map field
    names to field values (see :class:`Option`); paths are made absolute, and an empty
    ``cache_dir`` is :func:`default_cache_dir` of the source."""
    values = {**(file or {}), **cli}
    source = os.path.abspath(source)
    for o in OPTIONS:
        if o.kind == "path" and o.field in values:
            values[o.field] = os.path.abspath(values[o.field]) if values[o.field] else None
    if not values.get("cache_dir"):
        values["cache_dir"] = (default_shared_root() if values.get("shared_cache")
                               else default_cache_dir(source))
    return Config(source=source, mountpoint=os.path.abspath(mountpoint), **values)
