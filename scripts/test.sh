#!/usr/bin/env bash
# Set up, then run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check mlir_ansor tests benchmarks
exec .venv/bin/python -m pytest -q "$@"
