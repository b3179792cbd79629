"""The control protocol's wire format, shared by the training process and the daemon.

Training code writes short UTF-8 lines into ``<mount>/.dlcache/control`` (the grammar and
what each line means are in :mod:`dlcachefs.clairvoyance.control`, which parses them).
This module is what both sides agree on:

* the limits of a write and of a line (the parser enforces them, the encoders stay within
  them);
* the content ids and digests (index-list ids, view ids, sample-list digests), which the
  daemon recomputes to check a definition;
* the encoder: one builder per line kind, and one packer that spreads a long list
  (``index``, ``order``, ``loss``) over lines and writes within the limits.

Paths (``dataset``, ``root``) are percent-encoded (``/`` kept, ``.`` for the mount's
root) so that any name, spaces and non-ASCII included, is one token on its line.

Standard library only: the training process imports it (through :mod:`dlcachefs.torch`)
without trio, numpy, lmdb or torch.
"""

from __future__ import annotations

import hashlib
import os
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol
from urllib.parse import quote

# ----- limits -----------------------------------------------------------------------------

#: set by ``dlcachefs run`` in the training's environment: the daemon tells a training
#: that lost the launcher's hook on the way (a wrapper replaced PYTHONPATH) from one
#: that was never launched by it (``attribution._unannounced_reason``)
ENV_LAUNCHED = "DLCACHEFS_RUN"
MAX_ORDER_LEN = 1 << 26  # indices of one epoch's order (``order`` lines)
MAX_WRITE = 64 * 1024  # bytes of one write(); a write is applied whole or refused whole
MAX_LINE = 4096  # characters of one line, except a sampler line
MAX_SAMPLER_LINE = 16384  # a "sampler ... state=B64" line carries a 5056-byte state
MAX_LOSS_PAIRS = 100_000  # loss pairs of one write
MAX_BATCH = 1 << 24  # "batch B": 1 <= B <= MAX_BATCH
MAX_WORKERS = 4096  # "batch B workers=K": 0 <= K <= MAX_WORKERS
MAX_PREFETCH_FACTOR = 4096  # "batch B prefetch_factor=F": 0 <= F <= MAX_PREFETCH_FACTOR
ID_HEX = 24  # hex digits of index-list and view ids
LOSS_FORMAT = ".9g"  # 9 significant digits: exact for float32 losses


# ----- ids and digests ----------------------------------------------------------------------


class RootLike(Protocol):
    """One ImageFolder root of a view, as both sides describe it."""

    @property
    def count(self) -> int: ...

    @property
    def sha(self) -> str: ...

    @property
    def extensions(self) -> tuple[str, ...] | None: ...

    # optional: ``set_sha`` (:func:`set_digest`) and ``suffixes`` (:func:`suffixes_of`)


def ext_token(extensions: Sequence[str] | None) -> str:
    """The ``ext=`` field: percent-encoded extensions joined by ``,``; ``any`` for none
    (a custom ``is_valid_file``). An extension spelled ``any`` is sent as ``%61ny`` so that
    it is not taken for that."""
    if extensions is None:
        return "any"
    return ",".join("%61ny" if e == "any" else quote(e, safe="") for e in extensions)


def paths_digest(rel_paths: Iterable[str]) -> str:
    """SHA-256 hex of the sample paths (relative to their root), each ``\\n``-terminated,
    as bytes (``os.fsencode``: undecodable names keep their bytes). The mount computes the
    same over its own listing."""
    h = hashlib.sha256()
    enc = os.fsencode
    for p in rel_paths:
        h.update(enc(p))
        h.update(b"\n")
    return h.hexdigest()


def set_digest(rel_paths: Iterable[str]) -> str:
    """:func:`paths_digest` of the paths sorted (as ``str``): the same for the same files
    in any order. It tells a list in another sort order (timm's, a custom one) from a list
    of other files."""
    return paths_digest(sorted(rel_paths))


#: at most this many suffixes are sent in ``sfx=``, in at most this many characters (more:
#: the mount keeps every file)
MAX_SUFFIXES = 32
MAX_SUFFIX_CHARS = 1024


def suffixes_of(rel_paths: Iterable[str]) -> tuple[str, ...] | None:
    """The file name suffixes (``os.path.splitext``, lower case) of a list's paths, sorted:
    a filter that keeps at least the list's files, for a root whose own filter is unknown
    (a custom ``is_valid_file``, timm's reader). None when a file has none or there are
    more than ``MAX_SUFFIXES`` or ``MAX_SUFFIX_CHARS`` (the mount then keeps every
    file)."""
    found: set[str] = set()
    split = os.path.splitext
    for p in rel_paths:
        ext = split(p)[1].lower()
        if not ext:
            return None
        found.add(ext)
        if len(found) > MAX_SUFFIXES:
            return None
    out = tuple(sorted(found))
    return out if len(ext_token(out)) <= MAX_SUFFIX_CHARS else None


def index_list_id(indices: Sequence[int]) -> str:
    """Content id of an index list: SHA-256 of the int64 little-endian values."""
    a = array("q", indices)
    if sys.byteorder != "little":
        a.byteswap()
    return hashlib.sha256(a.tobytes()).hexdigest()[:ID_HEX]


def normalize_rel(rel: str) -> str:
    """A path relative to the mount as the control protocol spells it ("" for the root)."""
    return "/".join(p for p in rel.split("/") if p not in ("", "."))


def view_id(rels: Sequence[str], roots: Sequence[RootLike], lid: str | None) -> str:
    """Content id of a view: its roots (mount-relative, normalized), and index-list id.
    The mount recomputes it to check a definition."""
    text = "".join(f"{rel}\t{r.count}\t{r.sha}\t{ext_token(r.extensions)}\n"
                   for rel, r in zip(rels, roots, strict=True))
    text += f"index={lid or '-'}\n"
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:ID_HEX]


# ----- one line each --------------------------------------------------------------------------


def quote_rel(rel: str) -> str:
    """A mount-relative directory as one token: percent-encoded, ``.`` for the root."""
    return quote(rel, safe="/") or "."


def job_line(name: str) -> str:
    return f"job {name}"


def dataset_line(rel: str, view: str | None = None) -> str:
    """The job's dataset: a directory of the mount, or the view ``view`` whose first root
    it is."""
    return f"dataset {quote_rel(rel)}" + (f" view={view}" if view else "")


def sampler_line(kind: str, **fields: object) -> str:
    """``sampler KIND key=value ...``, the fields in the order given. None (and "") is left
    out, a boolean is ``true``/``false``, ``reason`` is percent-encoded."""
    parts = ["sampler", kind]
    for key, value in fields.items():
        if value is None or value == "":
            continue
        if isinstance(value, bool):
            value = "true" if value else "false"
        elif key == "reason":
            value = quote(str(value), safe="")
        parts.append(f"{key}={value}")
    return " ".join(parts)


def epoch_line(epoch: int) -> str:
    return f"epoch {epoch}"


def batch_line(size: int, workers: int | None = None, prefetch_factor: int | None = None
               ) -> str:
    return (f"batch {size}" + (f" workers={workers}" if workers is not None else "")
            + (f" prefetch_factor={prefetch_factor}" if prefetch_factor is not None else ""))


def pace_line(iters: int, steps: int, wait_s: float, train_s: float, rank: int | None = None
              ) -> str:
    """The training's own pace over its last ``iters`` batches: ``wait_s`` seconds blocked
    in the loader's ``next()`` (its data stall), ``train_s`` seconds between ``next()``
    calls over ``steps`` intervals (its step). A measurement: it never restarts a stream.
    ``rank`` binds the writing process to that rank, as a distributed sampler line does:
    send it whenever the process announced one (after a ``job`` line, which resets the
    binding to rank 0)."""
    return (f"pace iters={iters} steps={steps} wait={wait_s:.6f} train={train_s:.6f}"
            + (f" rank={rank}" if rank is not None else ""))


def root_line(vid: str, rel: str, root: RootLike) -> str:
    """Root ``rel`` of view ``vid``, with the training's digest of its sample list (and,
    when known, the digest of its set of files and its files' suffixes)."""
    line = (f"root {vid} {quote_rel(rel)} count={root.count} sha={root.sha} "
            f"ext={ext_token(root.extensions)}")
    set_sha = getattr(root, "set_sha", None)
    if set_sha:
        line += f" set={set_sha}"
    suffixes = getattr(root, "suffixes", None)
    if suffixes and root.extensions is None:
        line += f" sfx={ext_token(suffixes)}"
    return line


def view_line(vid: str, n_roots: int, lid: str | None) -> str:
    """Closes the ``n_roots`` root lines of view ``vid`` just before it."""
    return f"view {vid} roots={n_roots}" + (f" index={lid}" if lid else "")


def view_lines(vid: str, rels: Sequence[str], roots: Sequence[RootLike], lid: str | None
               ) -> list[str]:
    """The ``root`` lines and the ``view`` line defining view ``vid`` (one write's worth:
    they must come in one write)."""
    out = [root_line(vid, rel, r) for rel, r in zip(rels, roots, strict=True)]
    out.append(view_line(vid, len(out), lid))
    return out


def text(lines: Iterable[str]) -> str:
    """Lines as the text of one write (each ends with a newline)."""
    return "".join(line + "\n" for line in lines)


# ----- lists in chunks ------------------------------------------------------------------------


def _pack(prefix: str, tokens: Iterable[str], *, numbered: bool,
          expand: Callable[[str], int] | None = None, head: str = "",
          next_head: str | None = None, tail: Callable[[int], str] | None = None,
          reserve: int = 0, max_tokens: int | None = None) -> list[tuple[str, int]]:
    """The one packer of long lists: ``tokens`` in lines ``PREFIX [START] TOKEN...`` of at
    most ``MAX_LINE`` characters (``START``, when ``numbered``: how many items come before
    the line's first token; a token stands for ``expand(token)`` items, default 1), the lines
    in writes of at most ``MAX_WRITE - reserve`` bytes and ``max_tokens`` tokens. The first
    write starts with ``head``, the others with ``next_head`` (default ``head``);
    ``tail(items)`` ends the last write (a write of its own when it does not fit). Returns
    (text, tokens in it) per write; none for no tokens and no tail.

    Tokens and prefix are ASCII (numbers and hex ids): characters are bytes."""
    limit = MAX_WRITE - reserve
    cap = max_tokens if max_tokens is not None else sys.maxsize
    later = head if next_head is None else next_head
    writes: list[tuple[str, int]] = []
    parts = [head]
    size = len(head.encode())  # bytes of the current write's closed lines and head
    count = 0  # tokens in the current write
    line: list[str] = []  # the open line: its lead, then tokens
    line_len = 0  # its characters, without the newline
    pos = 0  # items before the next token

    def close_line() -> None:
        nonlocal line, size
        if line:
            parts.append(" ".join(line) + "\n")
            size += line_len + 1
            line = []

    def close_write() -> None:
        nonlocal parts, size, count
        writes.append(("".join(parts), count))
        parts, size, count = [later], len(later.encode()), 0

    for tok in tokens:
        n = len(tok)
        if line and line_len + 1 + n <= MAX_LINE and size + line_len + n + 2 <= limit \
                and count < cap:
            line.append(tok)
            line_len += 1 + n
        else:
            close_line()
            lead = f"{prefix} {pos}" if numbered else prefix
            if count and (count >= cap or size + len(lead) + n + 2 > limit):
                close_write()
            line = [lead, tok]
            line_len = len(lead) + 1 + n
        count += 1
        pos += expand(tok) if expand is not None else 1
    close_line()
    if tail is not None:
        last = tail(pos)
        if count and size + len(last.encode()) > limit:
            close_write()
        parts.append(last)
    if count or tail is not None:
        writes.append(("".join(parts), count))
    return writes


def _index_tokens(indices: Sequence[int]) -> list[str]:
    """``I`` per index, ``A:B`` for a run ``A, A+1, ..., B-1`` of at least 3."""
    out: list[str] = []
    n = len(indices)
    i = 0
    while i < n:
        j = i + 1
        while j < n and indices[j] == indices[j - 1] + 1:
            j += 1
        if j - i >= 3:
            out.append(f"{indices[i]}:{indices[j - 1] + 1}")
        else:
            out.extend(str(x) for x in indices[i:j])
        i = j
    return out


def _span(token: str) -> int:
    a, _, b = token.partition(":")
    return int(b) - int(a) if b else 1


def index_writes(lid: str, indices: Sequence[int], head: str = "") -> list[str]:
    """The writes (each starting with ``head``) that define index list ``lid``: ``index LID
    START TOKENS...`` chunks, then ``index LID end COUNT``."""
    return [w for w, _ in _pack(f"index {lid}", _index_tokens(indices), numbered=True,
                                expand=_span, head=head,
                                tail=lambda n: f"index {lid} end {n}\n")]


def order_writes(epoch: int, order: Iterable[int], head: str = "",
                 next_head: str | None = None, after: Sequence[str] = ()) -> list[str]:
    """The writes that give ``epoch``'s explicit order: ``order E START I...`` chunks, then
    ``order E end COUNT`` and the lines ``after`` (e.g. the ``epoch`` line). The first
    write starts with ``head``, the others with ``next_head`` (default ``head``)."""
    return [w for w, _ in _pack(f"order {epoch}", map(str, order), numbered=True,
                                head=head, next_head=next_head,
                                tail=lambda n: text([f"order {epoch} end {n}", *after]))]


def loss_writes(indices: Iterable[int], values: Iterable[float], head: str = "",
                reserve: int = 0, max_pairs: int = MAX_LOSS_PAIRS) -> list[tuple[str, int]]:
    """``loss I V ...`` lines for these pairs, as (write, pairs in it): each write starts
    with ``head``, holds at most ``max_pairs`` pairs and leaves ``reserve`` bytes free (room
    for a line added later, such as a ``dataset`` line). Values are sent with
    ``LOSS_FORMAT``; they must be finite (the parser refuses the others)."""
    fmt = LOSS_FORMAT
    pairs = (f"{i} {v:{fmt}}" for i, v in zip(indices, values, strict=True))
    return _pack("loss", pairs, numbered=False, head=head, reserve=reserve,
                 max_tokens=max(1, min(max_pairs, MAX_LOSS_PAIRS)))
