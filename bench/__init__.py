"""Reproducible benchmarks of dlcachefs (see bench/README.md).

Run from the repository root, with the venv's python::

    python -m bench.make_dataset OUT --classes 10 --per-class 300 --seed 0
    python -m bench.passes --files 3000 --out bench/results/passes.json
"""
