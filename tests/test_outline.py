"""passes.outline: a function cut into outlined runs computes what it did."""

from __future__ import annotations

import numpy as np
from mlir import ir

from mlir_ansor.compiler import compile_untuned
from mlir_ansor.passes.outline import outline_runs

# A captured scalar (%s in the generic's body), a dense constant read by two
# runs, a value used three runs later, and ops between the Linalg ones.
SOURCE = """
func.func @f(%x: tensor<8x16xf32>, %st: tensor<f32>) -> tensor<8x4xf32> {
  %cst = arith.constant 0.0 : f32
  %s = tensor.extract %st[] : tensor<f32>
  %w = arith.constant dense<[[1.0, 2.0, 3.0, 4.0], [0.5, -1.0, 0.25, 2.0]]> : tensor<2x4xf32>
  %e = tensor.empty() : tensor<8x16xf32>
  %scaled = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>],
      iterator_types = ["parallel", "parallel"]} ins(%x : tensor<8x16xf32>) outs(%e : tensor<8x16xf32>) {
  ^bb0(%a: f32, %o: f32):
    %m = arith.mulf %a, %s : f32
    linalg.yield %m : f32
  } -> tensor<8x16xf32>
  %r = tensor.collapse_shape %scaled [[0, 1]] : tensor<8x16xf32> into tensor<128xf32>
  %r2 = tensor.expand_shape %r [[0, 1]] output_shape [64, 2] : tensor<128xf32> into tensor<64x2xf32>
  %e2 = tensor.empty() : tensor<64x4xf32>
  %z2 = linalg.fill ins(%cst : f32) outs(%e2 : tensor<64x4xf32>) -> tensor<64x4xf32>
  %p = linalg.matmul ins(%r2, %w : tensor<64x2xf32>, tensor<2x4xf32>) outs(%z2 : tensor<64x4xf32>) -> tensor<64x4xf32>
  %q = linalg.matmul ins(%r2, %w : tensor<64x2xf32>, tensor<2x4xf32>) outs(%p : tensor<64x4xf32>) -> tensor<64x4xf32>
  %t = tensor.extract_slice %q[0, 0] [8, 4] [1, 1] : tensor<64x4xf32> to tensor<8x4xf32>
  %e3 = tensor.empty() : tensor<8x4xf32>
  %u = linalg.add ins(%t, %t : tensor<8x4xf32>, tensor<8x4xf32>) outs(%e3 : tensor<8x4xf32>) -> tensor<8x4xf32>
  return %u : tensor<8x4xf32>
}
"""


def _want(x: np.ndarray, s: float) -> np.ndarray:
    w = np.array([[1.0, 2.0, 3.0, 4.0], [0.5, -1.0, 0.25, 2.0]], np.float32)
    r2 = (x * s).reshape(64, 2)
    q = 2 * (r2 @ w)
    return (q[:8] * 2).astype(np.float32)


def test_outlined_runs_compute_what_the_function_did(tmp_path):
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(SOURCE)
        made = outline_runs(module, per_function=1)
        module.operation.verify()
        text = str(module)
        funcs = [op.operation for op in module.body.operations if op.operation.name == "func.func"]
    # One Linalg op per run: generic, fill, matmul, matmul, add.
    assert made == 5
    names = [ir.StringAttr(f.attributes["sym_name"]).value for f in funcs]
    assert names[0] == "f" and names[1:] == [f"f__part{k}" for k in range(5)]
    # Constants are copied into the runs that read them, never passed.
    assert "arith.constant dense" in text.split("func.func private @f__part2")[1].split("func.func")[0]
    assert text.count("call @f__part") == 5
    path = tmp_path / "outlined.mlir"
    path.write_text(text)
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    for src in (path, tmp_path / "orig.mlir"):
        if src.name == "orig.mlir":
            src.write_text(SOURCE)
        cm = compile_untuned(str(src))
        assert list(cm.functions) == ["f"]  # the outlined functions are not entry points
        np.testing.assert_allclose(cm(x, np.array(1.5, np.float32)), _want(x, 1.5), rtol=1e-5, atol=1e-5)
        cm.close()


def test_short_functions_are_left_as_they_are():
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(SOURCE)
        before = str(module)
        assert outline_runs(module, per_function=5) == 0
        assert str(module) == before
