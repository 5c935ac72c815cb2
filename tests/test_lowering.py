"""The lowering's own IR rewrites (`passes/lowering.py`)."""

from __future__ import annotations

import numpy as np
from mlir import ir, passmanager

import mlir_ansor
from mlir_ansor.passes.lowering import _front, forward_output_copies

# A kernel returning a fresh tensor, and drivers that return what it returned.
KERNEL = """
  func.func private @k(%a: tensor<4x8xf32>) -> tensor<4x8xf32> {
    %e = tensor.empty() : tensor<4x8xf32>
    %r = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>],
                         iterator_types = ["parallel", "parallel"]}
        ins(%a : tensor<4x8xf32>) outs(%e : tensor<4x8xf32>) {
      ^bb0(%x: f32, %o: f32):
        %y = arith.addf %x, %x : f32
        linalg.yield %y : f32
    } -> tensor<4x8xf32>
    return %r : tensor<4x8xf32>
  }
"""


def _front_ir(drivers: str) -> ir.Module:
    m = ir.Module.parse("module {" + KERNEL + drivers + "}")
    passmanager.PassManager.parse(f"builtin.module({_front()})").run(m.operation)
    return m


def _func(m: ir.Module, name: str) -> str:
    for op in m.body.operations:
        if op.operation.name == "func.func" and ir.StringAttr(op.operation.attributes["sym_name"]).value == name:
            return str(op)
    raise KeyError(name)


def test_driver_result_is_computed_in_the_output_argument():
    with ir.Context(), ir.Location.unknown():
        m = _front_ir("""
  func.func @main(%a: tensor<4x8xf32>) -> tensor<4x8xf32> {
    %r = call @k(%a) : (tensor<4x8xf32>) -> tensor<4x8xf32>
    return %r : tensor<4x8xf32>
  }""")
        before = _func(m, "main")
        assert "memref.copy" in before and "memref.alloc" in before  # what the upstream pass leaves
        assert forward_output_copies(m) == 1
        m.operation.verify()
        after = _func(m, "main")
    assert "memref.copy" not in after and "memref.alloc" not in after and "memref.dealloc" not in after
    assert "call @k(%arg0, %arg1)" in after


def test_buffer_still_read_after_the_copy_or_a_busy_output_keeps_the_copy():
    with ir.Context(), ir.Location.unknown():
        # the same result returned twice: two outputs, one buffer; only the
        # last copy may become the buffer (the first one reads it after)
        m = _front_ir("""
  func.func @twice(%a: tensor<4x8xf32>) -> (tensor<4x8xf32>, tensor<4x8xf32>) {
    %r = call @k(%a) : (tensor<4x8xf32>) -> tensor<4x8xf32>
    return %r, %r : tensor<4x8xf32>, tensor<4x8xf32>
  }""")
        assert forward_output_copies(m) == 1
        m.operation.verify()
        after = _func(m, "twice")
    assert after.count("memref.copy") == 1 and "memref.alloc" not in after


def test_compiled_driver_results_match_numpy(tmp_path):
    # compile makes each op a kernel, and @main a driver that returns what
    # they return: both outputs come from the rewritten copies
    path = tmp_path / "twice.mlir"
    path.write_text("""
func.func @main(%a: tensor<4x8xf32>) -> (tensor<4x8xf32>, tensor<4x8xf32>) {
  %r = linalg.add ins(%a, %a : tensor<4x8xf32>, tensor<4x8xf32>) outs(%a : tensor<4x8xf32>) -> tensor<4x8xf32>
  %e = tensor.empty() : tensor<4x8xf32>
  %s = linalg.mul ins(%r, %a : tensor<4x8xf32>, tensor<4x8xf32>) outs(%e : tensor<4x8xf32>) -> tensor<4x8xf32>
  return %s, %r : tensor<4x8xf32>, tensor<4x8xf32>
}
""")
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    s, r = mlir_ansor.compile(str(path), db=None)(x)
    np.testing.assert_allclose(r, 2 * x, rtol=1e-6)
    np.testing.assert_allclose(s, 2 * x * x, rtol=1e-6)


CHAIN = """
func.func @main(%a: tensor<8x8xf32>) -> tensor<1x8x8xf32> {
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<8x8xf32>
  %f = linalg.fill ins(%z : f32) outs(%e : tensor<8x8xf32>) -> tensor<8x8xf32>
  %r = linalg.matmul ins(%a, %a : tensor<8x8xf32>, tensor<8x8xf32>) outs(%f : tensor<8x8xf32>) -> tensor<8x8xf32>
  %s = linalg.matmul ins(%r, %a : tensor<8x8xf32>, tensor<8x8xf32>) outs(%f : tensor<8x8xf32>) -> tensor<8x8xf32>
  %t = linalg.matmul ins(%s, %a : tensor<8x8xf32>, tensor<8x8xf32>) outs(%f : tensor<8x8xf32>) -> tensor<8x8xf32>
  %u = linalg.matmul ins(%t, %s : tensor<8x8xf32>, tensor<8x8xf32>) outs(%f : tensor<8x8xf32>) -> tensor<8x8xf32>
  %x = tensor.expand_shape %u [[0, 1], [2]] output_shape [1, 8, 8] : tensor<8x8xf32> into tensor<1x8x8xf32>
  return %x : tensor<1x8x8xf32>
}
"""


def _lowered_driver(tmp_path, text: str) -> tuple[str, int, int]:
    """The driver of `text` after compile's front half and the two rewrites,
    with how many copies were forwarded and how many buffers made static."""
    from mlir_ansor.passes.lowering import static_driver_buffers

    path = tmp_path / "m.mlir"
    path.write_text(text)
    cm = mlir_ansor.compile(str(path), db=None)
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(cm.mlir)
        passmanager.PassManager.parse(f"builtin.module({_front()})").run(m.operation)
        forwarded = forward_output_copies(m)
        static = static_driver_buffers(m)
        m.operation.verify()
        return str(m), forwarded, static


def test_driver_buffers_are_static_and_shared_when_lifetimes_do_not_overlap(tmp_path):
    text, forwarded, static = _lowered_driver(tmp_path, CHAIN)
    # the last result is computed in the output (through the expand_shape);
    # r, s and t need buffers: r dies at s, so t takes r's; s lives to u
    assert forwarded == 1 and static == 3
    driver = text[text.index("func.func @main"):]
    assert "memref.alloc" not in driver and "memref.dealloc" not in driver and "memref.copy" not in driver
    assert driver.count("memref.get_global") == 3 and "memref.collapse_shape %arg1" in driver
    assert text.count('memref.global "private"') == 2


def test_static_buffers_give_the_same_results_call_after_call(tmp_path):
    path = tmp_path / "chain.mlir"
    path.write_text(CHAIN)
    cm = mlir_ansor.compile(str(path), db=None)
    rng = np.random.default_rng(1)
    for _ in range(3):  # the globals keep the previous call's values: they must not leak into this one
        a = rng.standard_normal((8, 8)).astype(np.float32)
        s = a @ a @ a
        np.testing.assert_allclose(cm(a), ((s @ a) @ s)[None], rtol=1e-4)
