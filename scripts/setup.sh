#!/usr/bin/env bash
# Set up a fresh Debian/Ubuntu machine for dlcachefs: system packages, a venv in .venv,
# the package itself (editable) with its test, torch and bench extras.
# Idempotent: a second run only checks. Run as root or with sudo available.
set -euo pipefail
cd "$(dirname "$0")/.."

APT_PKGS=(fuse3 libfuse3-dev pkg-config python3-venv python3-dev gcc memcached)
# Used by bench/ only (a slow remote over sshfs, rclone as a peer, MPI for DLIO).
BENCH_PKGS=(sshfs openssh-server openssh-client rclone iproute2 procps openmpi-bin libopenmpi-dev)

missing=()
for p in "${APT_PKGS[@]}" ${DLCACHEFS_BENCH:+"${BENCH_PKGS[@]}"}; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "setup: installing system packages: ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv"
  "$PY" -m venv .venv
fi
VPIP=(.venv/bin/python -m pip --disable-pip-version-check -q)
# torch: the package needs torch>=2.1 only; this pin is the pair that imports together on a
# CPU-only machine with Python 3.11 (torchvision has no CPU wheel on PyPI).
TORCH_PIN=${DLCACHEFS_TORCH_PIN:-"torch==2.12.0 torchvision==0.27.0"}
if ! .venv/bin/python -c "import torch, torchvision" >/dev/null 2>&1; then
  echo "setup: installing $TORCH_PIN (large download, about two minutes)"
  # shellcheck disable=SC2086
  "${VPIP[@]}" install $TORCH_PIN
fi
# the package and its extras: again only when pyproject.toml changed since the last run
# (a stamp in the venv), so that a second run only checks
STAMP=.venv/.dlcachefs-setup
WANT=$(sha256sum pyproject.toml | cut -d' ' -f1)
# (-I: not from the current directory, the repository itself, but as installed)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ] || [ ! -x .venv/bin/dlcachefs ] \
    || ! .venv/bin/python -I -c "import dlcachefs" >/dev/null 2>&1; then
  "${VPIP[@]}" install -e ".[test,bench,torch,peers,ops]"
  echo "$WANT" > "$STAMP"
fi
if [ -n "${DLCACHEFS_BENCH:-}" ]; then
  # DLIO (bench/dlio.py) in its own venv, never in .venv: bench/out/dlio-venv
  # (mpi4py is built from source against Open MPI: a few minutes the first time)
  echo "setup: DLIO venv for bench.dlio"
  .venv/bin/python -m bench.dlio --setup-only >/dev/null
fi
echo "setup: ready (.venv/bin/dlcachefs)"
