#!/usr/bin/env bash
# One command for a newcomer: set up this machine, then run the bundled demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"
