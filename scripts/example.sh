#!/usr/bin/env bash
# The main job: set up, then tune the bundled example (a 256^3 f32 matmul)
# and print the table of results. Extra arguments go to `mlir-ansor tune`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/mlir-ansor tune --trials 32 --db example.db "$@"
