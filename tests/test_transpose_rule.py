"""The transpose rule (mlir_ansor.search.rules.transpose): register blocks
turned with shuffles, checked against numpy at 1 and 2 threads."""

from __future__ import annotations

import numpy as np
import pytest

from mlir_ansor import TuneConfig, compile, load, tune
from mlir_ansor.graph.task import extract_tasks
from mlir_ansor.measure.builder import build
from mlir_ansor.measure.runner import TimingPolicy
from mlir_ansor.schedule.apply import apply_schedule
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.search.sketch import default_assignment
from mlir_ansor.search.space import make_assignment
from mlir_ansor.target import Target

# BERT's K^T: [1, s, h, d] -> [1, h, d, s] (the output's last loop is the
# input's second; the input's last is the output's third).
K_T = """
func.func @kt(%k: tensor<1x32x2x16x{t}>) -> tensor<1x2x16x32x{t}> {{
  %e = tensor.empty() : tensor<1x2x16x32x{t}>
  %r = linalg.transpose ins(%k : tensor<1x32x2x16x{t}>) outs(%e : tensor<1x2x16x32x{t}>) permutation = [0, 2, 3, 1]
  return %r : tensor<1x2x16x32x{t}>
}}
"""

FAST = TimingPolicy(min_repeat=1, max_repeat=2, min_time_s=0.0)


def _sketches(text: str):
    (task,) = extract_tasks(load(text=text))
    return task, generate_sketches(task.mlir, Target.host())


def test_a_transpose_that_moves_the_contiguous_dimension_gets_register_blocks():
    _, sketches = _sketches(K_T.format(t="f32"))
    assert [s.name for s in sketches] == ["cpu-transpose", "cpu-default"]
    blocks = {k.name: k.options for k in sketches[0].knobs if k.name.startswith("r_")}
    assert blocks == {"r_d3": (4, 8, 16), "r_d2": (4, 8, 16)}  # s (the output's last) and d (the input's last)


def test_a_transpose_without_a_dividing_block_keeps_the_default():
    # ResNet's input, NCHW -> NHWC with 3 channels: no block of 4, 8 or 16 divides them.
    text = """
func.func @nhwc(%x: tensor<1x3x20x20xf32>) -> tensor<1x20x20x3xf32> {
  %e = tensor.empty() : tensor<1x20x20x3xf32>
  %r = linalg.transpose ins(%x : tensor<1x3x20x20xf32>) outs(%e : tensor<1x20x20x3xf32>) permutation = [0, 2, 3, 1]
  return %r : tensor<1x20x20x3xf32>
}
"""
    _, sketches = _sketches(text)
    assert [s.name for s in sketches] == ["cpu-default"]


@pytest.mark.parametrize("r_v, r_c", [(16, 16), (8, 4), (4, 16)])
def test_blocks_lower_to_shuffles_without_scalar_loads(r_v, r_c):
    from mlir import ir

    _, sketches = _sketches(K_T.format(t="f32"))
    sk = sketches[0]
    a = make_assignment({**dict(default_assignment(sk, 1)), "r_d3": r_v, "r_d2": r_c})
    with ir.Context():
        text = str(apply_schedule(sk.payload, sk.concrete(a)))
    assert "vector.shuffle" in text and "vector.transpose" not in text
    assert "memref.load" not in text and "memref.store" not in text


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_tuned_transposes_match_numpy(tmp_path, threads, dtype):
    text = K_T.format(t=dtype)
    db = tmp_path / "t.db"
    result = tune(load(text=text), config=TuneConfig(trials=4, batch_size=4, threads=threads, timing=FAST, seed=0), db=db)
    assert result.tasks[0].best_sketch == "cpu-transpose"
    x = np.random.default_rng(0).standard_normal((1, 32, 2, 16)).astype(np.float32)
    if dtype == "bf16":
        from mlir_ansor.measure.runner import np_dtype

        x = x.astype(np_dtype("bf16"))
    cm = compile(load(text=text), db=db, threads=threads)
    try:
        out = cm(x)
    finally:
        cm.close()
    np.testing.assert_array_equal(np.asarray(out).view(np.uint8), x.transpose(0, 2, 3, 1).copy().view(np.uint8))


def test_every_block_builds(tmp_path):
    """Every block pair of the bf16 K^T builds (16-bit lanes take the flat
    shuffle, not the 32-bit 16 x 16 one)."""
    _, sketches = _sketches(K_T.format(t="bf16"))
    sk = sketches[0]
    for r_v in (4, 8, 16):
        for r_c in (4, 8, 16):
            a = make_assignment({**dict(default_assignment(sk, 1)), "r_d3": r_v, "r_d2": r_c})
            build(sk.payload, sk.concrete(a), 1, str(tmp_path / f"t{r_v}_{r_c}.so"))
