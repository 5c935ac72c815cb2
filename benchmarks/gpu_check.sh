#!/usr/bin/env bash
# The prepared GPU check, for a machine with an NVIDIA GPU, Python 3.12,
# torch, cupy and cuda-bindings, and no MLIR (shared/DESIGN.md, decision 6).
#
# Built here beforehand (needs MLIR + ptxas, no GPU; about 20 s, 435 KiB):
#   .venv/bin/python benchmarks/gpu_build.py --out benchmarks/gpu_artifacts -n 8   # 42 candidates, 620 KiB, 8 s
#   .venv/bin/python benchmarks/gpu_build.py --preset test --out tests/inputs/gpu -n 5
#   .venv/bin/python benchmarks/cuda_module_build.py --out benchmarks/cuda_modules   # whole modules, 6 s, 200 KiB
# The artifact set holds the staged kernels (cuda-mma-smem: ldmatrix +
# mma.sync f16; cuda-tiled: register tiles, f32/f16), plus one candidate of
# each older sketch (cuda-mma, cuda-contraction, cuda-default) as fallbacks;
# the first staged candidate of each GEMM 4096 and of the ResNet convs (3x3
# and 1x1, cuda-conv-smem: input/filter tiles in shared memory, one filter
# tap x 16 channels a K step) comes at cp.async stages 1, 2 and 3 (same
# tiles: the "stages" knob in the list tells them apart; the convs against
# cuDNN through torch), and the
# softmax bundle's reductions are warp-shuffle kernels, timed against
# torch.softmax by cuda_module_check.py:
# a wrong new kernel shows as ERR in the list and the table still fills.
# On the GPU host:
#   bash benchmarks/gpu_check.sh [ARTIFACTS_DIR]
#
# 1. the GPU tests (the runner on the small test artifacts, every sketch
#    checked against float64 numpy; `gpu_measure` measuring the prebuilt
#    build-only database tests/inputs/gpu_db on the device; MLIR-side tests
#    skip there), 2. every
#    prebuilt candidate of GEMM 4096 f16/f32 and the ResNet conv checked
#    element-wise against a float64 host reference (numpy) and timed with
#    CUDA events, against torch (cuBLAS/cuDNN) timed in the same run;
#    3. the whole-module bundles (`mlir_ansor.measure.cuda_module`: GEMM 4096
#    f32/f16, the ResNet conv+bias+ReLU, softmax, mini_net) checked against
#    float64 numpy and timed, GEMMs against torch (cap: 90 s).
#    Budget: under 9 minutes (caps: 120 s + 330 s + 90 s = 9 min; the bench stops
#    starting candidates after 270 s).
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
ART=${1:-benchmarks/gpu_artifacts}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
echo "== GPU tests"
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_gpu_measure.py -rs 2>&1 | tail -40
echo "== candidates vs torch ($ART)"
timeout 330 "$PY" benchmarks/gpu_bench.py "$ART" --budget-s 270 --json "${OUT:-/tmp}/gpu_bench.json"
MODS=${MODS:-benchmarks/cuda_modules}
if [ -f "$MODS/index.json" ]; then
  echo "== whole modules ($MODS)"
  timeout 90 "$PY" benchmarks/cuda_module_check.py "$MODS" --json "${OUT:-/tmp}/cuda_modules.json"
fi
