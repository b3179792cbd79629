"""Tier 1: a non-editable install holds every module of the tree.

The editable install the tests run from maps whole directories, so a package missing from
``pyproject.toml``'s list would only show in ``pip install .``: this builds the package (setuptools'
``build_py``, what a wheel is made of) from a copy of the tree and compares its modules
with the source files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# folder in the tree -> package it installs as (pyproject's package-dir)
FOLDERS = {"dlcachefs": "dlcachefs", "mount": "dlcachefs/mount",
           "policies": "dlcachefs/policies"}


def test_the_build_holds_every_module(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    out = tmp_path / "build"
    r = subprocess.run([sys.executable, "-c", "from setuptools import setup; setup()", "-q",
                        "build_py", "--build-lib", str(out)],
                       cwd=src, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    in_build = {p.relative_to(out).as_posix() for p in out.rglob("*.py")}
    expected = {f"{pkg}/{p.relative_to(ROOT / folder).as_posix()}"
                for folder, pkg in FOLDERS.items()
                for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts}
    assert expected - in_build == set(), "modules missing from a non-editable install"
    assert "dlcachefs/cache/engine.py" in in_build  # the comparison is not vacuous
