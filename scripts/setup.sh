#!/usr/bin/env bash
# Create .venv (once) and install mlir-ansor with its pinned MLIR wheels,
# the OpenMP runtime, the dev tools and the PyTorch path (torch, torch-mlir:
# the 'torch' extra, so the tests of that path run too). Safe to run again:
# it only installs what is missing or changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.mlir-ansor-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ scripts/setup.sh -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e '.[dev,torch]'
  touch "$stamp"
fi
