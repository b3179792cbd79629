"""Tier 1: every ``dlcachefs`` command shown in README.md and docs/*.md still parses.

Each line of a code block (fenced, or indented by four spaces or more after a blank line)
that starts with ``dlcachefs `` is taken, with its backslash continuations joined and a
trailing ``# comment`` dropped, and given to the CLI's own argparse parser
(:func:`dlcachefs.cli.build_parser`): parsed only, never run. A ``mount`` line is also made
into a :class:`~dlcachefs.config.Config` (the options' own checks, e.g. ``--dataset`` needs
``--shared-cache``) and its ``--policy`` built, as ``dlcachefs mount`` does before it mounts.

A synopsis line (one with ``[optional]`` parts) is skipped: it is not a command. Every other
line is a concrete example and must parse, so a documented option that no longer exists
fails here, naming the file and the line.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from dlcachefs.cli import build_parser
from dlcachefs.config import OPTIONS, build_config

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^\s*(```|~~~)\s*(\S*)")


def code_lines(text: str) -> list[tuple[int, str]]:
    """(line number, text) of each line inside a code block of the markdown ``text``, with
    backslash continuations joined onto their first line. A fenced block marked ``text``
    holds a command's output, not commands: it is left out."""
    out: list[tuple[int, str]] = []
    lines = text.splitlines()
    fence: str | None = None
    output = False
    indent: int | None = None  # the indentation of the indented block we are in, if any
    prev_blank = True
    for no, line in enumerate(lines, 1):
        stripped = line.strip()
        m = _FENCE.match(line)
        if fence is not None:
            if m and m.group(1) == fence and not m.group(2):
                fence = None
            elif not output:
                out.append((no, stripped))
            prev_blank = False
            continue
        if m:
            fence, indent = m.group(1), None
            output = m.group(2) == "text"
            prev_blank = False
            continue
        width = len(line) - len(line.lstrip(" "))
        if not stripped:
            prev_blank = True
            continue
        if indent is not None and width < indent:
            indent = None
        if indent is None and prev_blank and width >= 4:
            # an indented block: four spaces, or a list item's text (2) and four more;
            # a list item's own text never starts after a blank line this deep
            indent = width
        if indent is not None:
            out.append((no, stripped))
        prev_blank = False
    joined: list[tuple[int, str]] = []
    cont = False
    for no, text_ in out:
        if cont:
            first, prev = joined[-1]
            joined[-1] = (first, prev[:-1].rstrip() + " " + text_)
        else:
            joined.append((no, text_))
        cont = joined[-1][1].endswith("\\")
    return joined


def commands(path: Path) -> list[tuple[int, str]]:
    """The ``dlcachefs`` command lines of the markdown file ``path``."""
    return [(no, line) for no, line in code_lines(path.read_text())
            if line.startswith("dlcachefs ")]


def is_synopsis(line: str) -> bool:
    """A usage line (``dlcachefs mount SOURCE MOUNTPOINT [--cache-size SIZE] ...``): not an
    example to parse. The part after ``--`` of ``dlcachefs run`` is the script's, and a
    comment is not part of the command."""
    argv = argv_of(line)
    if "--" in argv:
        argv = argv[:argv.index("--")]
    return any("[" in arg for arg in argv)


def argv_of(line: str) -> list[str]:
    """The arguments after ``dlcachefs``, as the shell would split them, comments dropped."""
    return shlex.split(line, comments=True)[1:]


def check(argv: list[str]) -> str | None:
    """None if ``argv`` parses (and, for ``mount``, makes a valid Config and policy); else
    why not."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            a = build_parser().parse_args(argv)
    except SystemExit:
        return err.getvalue().strip().splitlines()[-1] if err.getvalue() else "SystemExit"
    if a.cmd != "mount":
        return None
    from dlcachefs.policies import make_policy  # noqa: PLC0415 - as cli.config_from_args

    cli = {o.field: getattr(a, o.field) for o in OPTIONS if hasattr(a, o.field)}
    try:
        cfg = build_config(a.source, a.mountpoint, cli)
        make_policy(cfg.policy)
    except ValueError as e:
        return str(e)
    return None


def all_commands() -> list[tuple[str, int, str]]:
    return [(p.relative_to(ROOT).as_posix(), no, line)
            for p in DOCS for no, line in commands(p)]


@pytest.mark.parametrize(("where", "no", "line"),
                         [pytest.param(*c, id=f"{c[0]}:{c[1]}") for c in all_commands()
                          if not is_synopsis(c[2])])
def test_documented_command_parses(where: str, no: int, line: str) -> None:
    why = check(argv_of(line))
    assert why is None, f"{where}:{no}: {line}\n  {why}"


def test_the_docs_show_the_main_commands() -> None:
    """Not vacuous: the README shows a concrete mount, run, stats and umount, and the
    extraction finds commands in the docs pages too."""
    readme = [argv_of(line)[0] for _, line in commands(ROOT / "README.md")
              if not is_synopsis(line)]
    for cmd in ("mount", "run", "stats", "umount"):
        assert cmd in readme, f"README.md shows no concrete 'dlcachefs {cmd}'"
    in_docs = [c for c in all_commands() if c[0].startswith("docs/")]
    assert len(in_docs) >= 20, in_docs


def test_a_removed_option_is_caught() -> None:
    """The check itself: an option the parser does not know, a bad value, a contradiction."""
    assert check(["mount", "/src", "/mnt", "--no-such-option"]) is not None
    assert check(["mount", "/src", "/mnt", "--cache-size", "lots"]) is not None
    assert check(["mount", "/src", "/mnt", "--dataset", "a"]) is not None
    assert check(["mount", "/src", "/mnt", "--policy", "nosuchpolicy"]) is not None
    assert check(["mount", "/src", "/mnt", "--cache-size", "10G"]) is None
    assert check(["run", "--job", "a", "--", "python", "train.py", "--epochs", "3"]) is None


def test_extraction() -> None:
    md = ("Text `dlcachefs prose` is not code.\n\n"
          "    dlcachefs stats /mnt/a   # a comment\n"
          "    dlcachefs mount /src /mnt \\\n"
          "        --cache-size 10G\n\n"
          "* an item\n\n"
          "      dlcachefs umount /mnt/b\n"
          "  more text of the item\n"
          "  dlcachefs not-code\n\n"
          "```sh\n"
          "dlcachefs mount SOURCE MOUNTPOINT [--memory SIZE]\n"
          "dlcachefs run -- python train.py --lr 0.1  # [not a synopsis]\n"
          "```\n\n"
          "```text\n"
          "dlcachefs top: /mnt/a <- /src (output, not a command)\n"
          "```\n")
    lines = [line for _, line in code_lines(md) if line.startswith("dlcachefs ")]
    assert lines == ["dlcachefs stats /mnt/a   # a comment",
                     "dlcachefs mount /src /mnt --cache-size 10G",
                     "dlcachefs umount /mnt/b",
                     "dlcachefs mount SOURCE MOUNTPOINT [--memory SIZE]",
                     "dlcachefs run -- python train.py --lr 0.1  # [not a synopsis]"]
    assert [is_synopsis(line) for line in lines] == [False, False, False, True, False]
    assert argv_of(lines[0]) == ["stats", "/mnt/a"]


def test_no_merge_conflict_is_left_in_the_tree():
    """A merge's conflict markers committed by mistake (DESIGN.md carried one) fail here:
    every tracked text file of the repository, the lines git writes at a conflict."""
    import subprocess

    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    marker = re.compile(r"^(<{7} |>{7} |={7}$)", re.M)
    found = []
    for name in files:
        path = ROOT / name
        if path.suffix not in {".md", ".py", ".toml", ".sh", ".txt", ".cfg", ".yml", ""}:
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        found += [f"{name}:{text.count(chr(10), 0, m.start()) + 1}" for m in marker.finditer(text)]
    assert found == [], found
