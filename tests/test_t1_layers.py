"""Tier 1: every import of the package follows the dependency table of DESIGN.md.

The table ("What may import what") is parsed from DESIGN.md itself, so the document and
the code cannot drift apart: an import the table does not allow fails here, and so does a
new subpackage the table does not name. Imports are read with ``ast`` from the source,
inside functions and under ``TYPE_CHECKING`` too (a lazy import is still a dependency).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: source folders and the package each one is installed as (pyproject's package-dir)
FOLDERS = {"dlcachefs": "dlcachefs", "mount": "dlcachefs.mount",
           "policies": "dlcachefs.policies"}


def modules() -> dict[str, Path]:
    """Every module of the installed package, by dotted name."""
    out: dict[str, Path] = {}
    for folder, pkg in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([pkg, *parts])] = path
    return out


MODULES = modules()
PACKAGES = {name for name, path in MODULES.items() if path.name == "__init__.py"}


def node_of(module: str) -> str:
    """The table's node a module belongs to: a subpackage of dlcachefs, one of its
    top-level modules, or ``dlcachefs`` for the package's own ``__init__``."""
    parts = module.split(".")
    return "dlcachefs" if len(parts) == 1 else parts[1]


def imports_of(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import in the file, wherever it stands."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for a in node.names:  # ``from pkg import module`` imports that module
                sub = f"{mod}.{a.name}"
                out.append((node.lineno, sub if sub in MODULES else mod))
    return out


def parse_table(text: str) -> dict[str, list[str]]:
    """The rows of DESIGN.md's "What may import what" table: node -> allowed entries."""
    start = text.index("### What may import what")
    rows: dict[str, list[str]] = {}
    in_table = False
    for line in text[start:].splitlines()[1:]:
        if line.startswith("|"):
            in_table = True
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) != 2 or cells[0] in ("node", "---"):
                continue
            node = re.findall(r"`([^`]+)`", cells[0])[0]
            rows[node] = re.findall(r"`([^`]+)`", cells[1])
        elif in_table:
            break
    return rows


TABLE = parse_table((ROOT / "DESIGN.md").read_text())


def allowed(src_node: str, target: str, table: dict[str, list[str]] = TABLE) -> bool:
    """Whether a module of ``src_node`` may import module ``target`` (dotted, under
    dlcachefs)."""
    tgt_node = node_of(target)
    if tgt_node == src_node:
        return True
    rel = target.split(".", 1)[1] if "." in target else "dlcachefs"
    for entry in table[src_node]:
        if "." in entry:  # one module of a node (and the modules under it)
            if rel == entry or rel.startswith(entry + "."):
                return True
        elif entry == tgt_node:
            return True
    return False


def test_the_table_is_read_and_says_no_to_a_wrong_arrow():
    """The parser finds the table, and the checker refuses what the layering forbids (so
    the test below can fail)."""
    assert {"store", "cache", "clairvoyance", "session", "policies"} <= set(TABLE)
    assert allowed("clairvoyance", "dlcachefs.cache.engine")
    assert not allowed("cache", "dlcachefs.clairvoyance.streams")
    assert not allowed("store", "dlcachefs.mountctl")
    assert allowed("policies", "dlcachefs.cache.policy")
    assert not allowed("policies", "dlcachefs.cache.engine")


def test_the_table_has_no_cycle():
    graph = {n: {e.split(".")[0] for e in entries} - {n} for n, entries in TABLE.items()}
    for n, deps in graph.items():
        unknown = deps - set(graph)
        assert not unknown, f"{n}: the table names {unknown}, which have no row"
    state: dict[str, int] = {}

    def visit(n: str, path: list[str]) -> None:
        if state.get(n) == 1:
            pytest.fail("the table has a cycle: " + " -> ".join([*path, n]))
        if state.get(n) == 2:
            return
        state[n] = 1
        for d in sorted(graph[n]):
            visit(d, [*path, n])
        state[n] = 2

    for n in sorted(graph):
        visit(n, [])


def test_every_import_follows_the_table():
    wrong = []
    for module, path in MODULES.items():
        src = node_of(module)
        assert src in TABLE, f"{module}: node {src!r} has no row in DESIGN.md's table"
        for line, target in imports_of(module, path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if target == "bench" or target.startswith("bench."):
                wrong.append(f"{where}: imports {target} (bench/ is not installed)")
            elif target.split(".")[0] == "dlcachefs" and not allowed(src, target):
                wrong.append(f"{where}: {src} -> {target}")
    assert not wrong, "imports against DESIGN.md's table:\n" + "\n".join(wrong)
