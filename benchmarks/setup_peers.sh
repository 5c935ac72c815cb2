#!/usr/bin/env bash
# Install the peers of benchmarks/peers.py that cannot share .venv (and the
# 'bench' extra into .venv):
# TVM MetaSchedule (apache-tvm from PyPI) in its own virtual env, .venv-tvm,
# driven from the benchmark in a subprocess (benchmarks/peers_tvm.py).
#
#   bash benchmarks/setup_peers.sh           # TVM + xgboost (operators)
#   bash benchmarks/setup_peers.sh --models  # also PyTorch CPU, for the model rows
#   bash benchmarks/setup_peers.sh --iree    # only IREE, in .venv-iree (no TVM)
#
# IREE (benchmarks/peers_iree.py, driven by benchmarks/low_precision.py): the
# compiler and runtime wheels from PyPI, pinned to one release, in their own
# env (.venv-iree, python3.11) so that IREE's MLIR never meets ours or
# torch-mlir's in one process; the benchmark runs its command-line tools
# (iree-compile, iree-benchmark-module, iree-run-module) from there.
#
# Pins, and why (see also the notes at the top of benchmarks/peers_tvm.py):
# - apache-tvm 0.27.0.post1 with apache-tvm-ffi 0.1.14.post1: with ffi 0.1.15
#   `tvm.ir.save_json` segfaults, which kills MetaSchedule's tuning context.
# - xgboost-cpu (MetaSchedule's XGB cost model): same `import xgboost` as
#   `xgboost`, without its 470 MB NCCL wheel.
# Safe to run again: it installs only when the stamp is missing or older than
# this script.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
models=0
iree=0
for arg in "$@"; do
  case "$arg" in
    --models) models=1 ;;
    --iree) iree=1 ;;
    *) echo "setup_peers.sh: unknown option '$arg' (known: --models, --iree)" >&2; exit 2 ;;
  esac
done
# The benchmarks' own extra in .venv (threadpoolctl: numpy's BLAS on the
# row's thread count, else its 1-thread rows run on every core).
if [ -x .venv/bin/python ] && ! .venv/bin/python -c 'import threadpoolctl, matplotlib' 2>/dev/null; then
  .venv/bin/python -m pip install -q 'threadpoolctl>=3' 'matplotlib>=3.7'
fi
if [ "$iree" = 1 ]; then
  IREE_PY=${IREE_PYTHON:-python3.11}
  if [ ! -x .venv-iree/bin/python ]; then
    "$IREE_PY" -m venv .venv-iree
    echo '*' > .venv-iree/.gitignore  # the repository's .gitignore names only .venv and .venv-tvm
  fi
  stamp=.venv-iree/.peers-installed
  if [ ! -f "$stamp" ] || [ "$0" -nt "$stamp" ]; then
    .venv-iree/bin/python -m pip install -q --upgrade pip
    .venv-iree/bin/python -m pip install -q \
      'iree-base-compiler==3.13.0' 'iree-base-runtime==3.13.0' 'numpy>=1.26' 'ml_dtypes>=0.4'
    touch "$stamp"
  fi
  .venv-iree/bin/iree-compile --version | grep "compiler version"
  .venv-iree/bin/python -c 'import importlib.metadata as m; print("IREE", m.version("iree-base-compiler"), "in .venv-iree")'
  exit 0
fi
if [ ! -x .venv-tvm/bin/python ]; then
  "$PY" -m venv .venv-tvm
fi
stamp=.venv-tvm/.peers-installed
if [ ! -f "$stamp" ] || [ "$0" -nt "$stamp" ]; then
  .venv-tvm/bin/python -m pip install -q --upgrade pip
  .venv-tvm/bin/python -m pip install -q \
    'apache-tvm==0.27.0.post1' 'apache-tvm-ffi==0.1.14.post1' \
    'xgboost-cpu>=2.1' 'numpy>=1.26' psutil cloudpickle tornado scipy
  touch "$stamp"
fi
if [ "$models" = 1 ] && [ ! -f .venv-tvm/.peers-models-installed ]; then
  .venv-tvm/bin/python -m pip install -q 'torch==2.13.0'
  touch .venv-tvm/.peers-models-installed
fi
.venv-tvm/bin/python -c 'import tvm, tvm.s_tir.meta_schedule; print("TVM", tvm.__version__, "in .venv-tvm")'
