#!/usr/bin/env bash
# One command for the tests: set up this machine, lint, then run the whole suite
# (unit, core, mounted through the kernel, torchvision). Extra args go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
exec .venv/bin/python -m pytest -q "$@"
