"""bf16, f16 and i8 (i32 accumulation) element types: tasks in the forms
Linalg and torch-mlir write, f32 accumulation for narrow float results, the
wider reference candidates are checked against, tolerances, and tuning and
compiling them (small shapes: 64x64x64)."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from conftest import filecheck

import mlir_ansor
from mlir_ansor import TuneConfig, tune
from mlir_ansor.graph.precision import widen_payload
from mlir_ansor.ir.dtypes import EPSILON, tolerance
from mlir_ansor.measure.jobs import prepare_reference
from mlir_ansor.measure.measurer import arg_specs
from mlir_ansor.measure.runner import TimingPolicy, np_dtype, read_data, run, save_data
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.target import Target

M = N = K = 64
FAST = TimingPolicy(warmup=0, min_repeat=1, max_repeat=2, min_time_s=0.0)
BF16 = np.dtype(ml_dtypes.bfloat16)


def _t(shape, dtype: str) -> str:
    return "tensor<" + "x".join(str(d) for d in shape) + f"x{dtype}>"


def _zero(dtype: str) -> str:
    return "0" if dtype.startswith("i") else "0.0"


def matmul(tin: str, tout: str, *, m: int = M, n: int = N, k: int = K, init: str = "zero") -> str:
    """A named ``linalg.matmul`` with `tin` operands and a `tout` result;
    `init`: "zero" (a zero fill), "one" (a fill of 1), "arg" (a third argument)."""
    a, b, c = _t((m, k), tin), _t((k, n), tin), _t((m, n), tout)
    args = f"%a: {a}, %b: {b}" + (f", %c: {c}" if init == "arg" else "")
    body = ""
    if init != "arg":
        value = _zero(tout) if init == "zero" else ("1" if tout.startswith("i") else "1.0")
        body = (f"  %z = arith.constant {value} : {tout}\n  %e = tensor.empty() : {c}\n"
                f"  %c = linalg.fill ins(%z : {tout}) outs(%e : {c}) -> {c}\n")
    body += f"  %r = linalg.matmul ins(%a, %b : {a}, {b}) outs(%c : {c}) -> {c}\n  return %r : {c}\n"
    return f"func.func @mm({args}) -> {c} {{\n{body}}}\n"


def generic_matmul(tin: str, tout: str, ext_a: str, ext_b: str) -> str:
    """The same matmul as a ``linalg.generic`` whose body extends the
    operands (`ext_a`, `ext_b`: "arith.extf", "arith.extsi", "arith.extui")."""
    a, b, c = _t((M, K), tin), _t((K, N), tin), _t((M, N), tout)
    mul, add = ("arith.mulf", "arith.addf") if tout.startswith("f") else ("arith.muli", "arith.addi")
    return f"""func.func @g(%a: {a}, %b: {b}) -> {c} {{
  %z = arith.constant {_zero(tout)} : {tout}
  %e = tensor.empty() : {c}
  %f = linalg.fill ins(%z : {tout}) outs(%e : {c}) -> {c}
  %r = linalg.generic {{indexing_maps = [affine_map<(i, j, k) -> (i, k)>, affine_map<(i, j, k) -> (k, j)>,
                                        affine_map<(i, j, k) -> (i, j)>],
                       iterator_types = ["parallel", "parallel", "reduction"]}}
      ins(%a, %b : {a}, {b}) outs(%f : {c}) {{
    ^bb0(%x: {tin}, %y: {tin}, %o: {tout}):
      %x2 = {ext_a} %x : {tin} to {tout}
      %y2 = {ext_b} %y : {tin} to {tout}
      %p = {mul} %x2, %y2 : {tout}
      %s = {add} %o, %p : {tout}
      linalg.yield %s : {tout}
  }} -> {c}
  return %r : {c}
}}
"""


def conv_bf16(n: int = 1, h: int = 10, w: int = 10, c: int = 8, f: int = 16) -> str:
    x, wt, o = _t((n, h, w, c), "bf16"), _t((3, 3, c, f), "bf16"), _t((n, h - 2, w - 2, f), "bf16")
    return f"""func.func @conv(%x: {x}, %w: {wt}) -> {o} {{
  %z = arith.constant 0.0 : bf16
  %e = tensor.empty() : {o}
  %f = linalg.fill ins(%z : bf16) outs(%e : {o}) -> {o}
  %r = linalg.conv_2d_nhwc_hwcf {{dilations = dense<1> : tensor<2xi64>, strides = dense<1> : tensor<2xi64>}}
      ins(%x, %w : {x}, {wt}) outs(%f : {o}) -> {o}
  return %r : {o}
}}
"""


REQUANTIZE = f"""func.func @q(%a: {_t((M, K), "i8")}, %b: {_t((K, N), "i8")}) -> {_t((M, N), "i8")} {{
  %z = arith.constant 0 : i32
  %scale = arith.constant 0.0625 : f32
  %lo = arith.constant -128.0 : f32
  %hi = arith.constant 127.0 : f32
  %e = tensor.empty() : {_t((M, N), "i32")}
  %f = linalg.fill ins(%z : i32) outs(%e : {_t((M, N), "i32")}) -> {_t((M, N), "i32")}
  %r = linalg.matmul ins(%a, %b : {_t((M, K), "i8")}, {_t((K, N), "i8")}) outs(%f : {_t((M, N), "i32")}) -> {_t((M, N), "i32")}
  %e8 = tensor.empty() : {_t((M, N), "i8")}
  %q = linalg.generic {{indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>],
                       iterator_types = ["parallel", "parallel"]}}
      ins(%r : {_t((M, N), "i32")}) outs(%e8 : {_t((M, N), "i8")}) {{
    ^bb0(%x: i32, %o: i8):
      %xf = arith.sitofp %x : i32 to f32
      %s = arith.mulf %xf, %scale : f32
      %rn = math.roundeven %s : f32
      %c1 = arith.maximumf %rn, %lo : f32
      %c2 = arith.minimumf %c1, %hi : f32
      %i = arith.fptosi %c2 : f32 to i8
      linalg.yield %i : i8
  }} -> {_t((M, N), "i8")}
  return %q : {_t((M, N), "i8")}
}}
"""

QUANTIZED = f"""func.func @qmm(%a: {_t((M, K), "i8")}, %b: {_t((K, N), "i8")}) -> {_t((M, N), "i32")} {{
  %z = arith.constant 0 : i32
  %za = arith.constant 3 : i32
  %zb = arith.constant -2 : i32
  %e = tensor.empty() : {_t((M, N), "i32")}
  %f = linalg.fill ins(%z : i32) outs(%e : {_t((M, N), "i32")}) -> {_t((M, N), "i32")}
  %r = linalg.quantized_matmul ins(%a, %b, %za, %zb : {_t((M, K), "i8")}, {_t((K, N), "i8")}, i32, i32)
      outs(%f : {_t((M, N), "i32")}) -> {_t((M, N), "i32")}
  return %r : {_t((M, N), "i32")}
}}
"""

BF16_CHAIN = f"""func.func @e(%a: {_t((M, N), "bf16")}, %b: {_t((M, N), "bf16")}) -> {_t((M, N), "bf16")} {{
  %z = arith.constant 0.0 : bf16
  %e = tensor.empty() : {_t((M, N), "bf16")}
  %r = linalg.generic {{indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>,
                                        affine_map<(i, j) -> (i, j)>], iterator_types = ["parallel", "parallel"]}}
      ins(%a, %b : {_t((M, N), "bf16")}, {_t((M, N), "bf16")}) outs(%e : {_t((M, N), "bf16")}) {{
    ^bb0(%x: bf16, %y: bf16, %o: bf16):
      %s = arith.addf %x, %y : bf16
      %m = arith.maximumf %s, %z : bf16
      linalg.yield %m : bf16
  }} -> {_t((M, N), "bf16")}
  return %r : {_t((M, N), "bf16")}
}}
"""


def _task(text: str):
    (task,) = mlir_ansor.extract_tasks(mlir_ansor.load(text=text))
    return task


def _draw(shape, dtype: str, rng) -> np.ndarray:
    if dtype.startswith("i"):
        return rng.integers(-8, 8, size=shape).astype(np_dtype(dtype))
    return rng.uniform(-1, 1, size=shape).astype(np_dtype(dtype))


def _rel(out: np.ndarray, want: np.ndarray) -> float:
    out, want = out.astype(np.float64), want.astype(np.float64)
    return float(np.max(np.abs(out - want)) / np.max(np.abs(want)))


# --- tasks --------------------------------------------------------------------


@pytest.mark.parametrize("tin, tout", [("bf16", "f32"), ("f16", "f32"), ("i8", "i32")])
def test_mixed_type_named_matmuls_are_tasks(tin, tout):
    task = _task(matmul(tin, tout))
    assert task.name == f"matmul_64x64x64_{tin}_{tout}"
    assert [i.dtype for i in task.inputs] == [tin, tin] and [o.dtype for o in task.outputs] == [tout]
    assert task.flops == 2 * M * N * K and task.kind == "contraction" and task.accumulator_dtype == tout
    assert task.tolerance == tolerance(tout, K)
    assert (task.tolerance == 0.0) == tout.startswith("i")


def test_workload_keys_and_names_differ_by_element_type():
    tasks = {
        (tin, tout): _task(matmul(tin, tout))
        for tin, tout in [("f32", "f32"), ("f64", "f64"), ("bf16", "f32"), ("bf16", "bf16"),
                          ("f16", "f32"), ("f16", "f16"), ("i8", "i32"), ("i8", "i16"), ("i32", "i32")]
    }
    keys = [t.workload_key for t in tasks.values()]
    assert len(set(keys)) == len(keys)
    assert len({t.name for t in tasks.values()}) == len(tasks)
    # f32 names (and so databases tuned before) are unchanged.
    assert tasks["f32", "f32"].name == "matmul_64x64x64_f32"
    assert tasks["i8", "i16"].name == "matmul_64x64x64_i8_i16"


@pytest.mark.parametrize(
    "tin, tout, ext",
    [("bf16", "f32", "arith.extf"), ("f16", "f32", "arith.extf"), ("i8", "i32", "arith.extsi")],
)
def test_a_generic_with_extensions_is_the_named_op(tin, tout, ext):
    """torch-mlir's form (a generic extending its operands in the body) and
    the named op with mixed types are one task: same workload key."""
    generic = _task(generic_matmul(tin, tout, ext, ext))
    assert generic.workload_key == _task(matmul(tin, tout)).workload_key
    assert generic.name == f"contraction_64x64x64_{tin}_{tout}" and generic.flops == 2 * M * N * K


def test_unsigned_operands_are_a_task_of_their_own():
    """u8 x s8 (``arith.extui``): another computation, another key."""
    u8 = _task(generic_matmul("i8", "i32", "arith.extui", "arith.extsi"))
    s8 = _task(generic_matmul("i8", "i32", "arith.extsi", "arith.extsi"))
    assert u8.workload_key != s8.workload_key and u8.tolerance == 0.0
    assert "arith.extui" in u8.mlir


def test_a_bf16_result_accumulates_in_f32_and_is_rounded_once():
    task = _task(matmul("bf16", "bf16"))
    assert task.name == "matmul_64x64x64_bf16_f32_truncf"
    assert [o.dtype for o in task.outputs] == ["bf16"] and task.accumulator_dtype == "f32"
    assert task.flops == 2 * M * N * K  # the rounding is no arithmetic
    filecheck(task.mlir, """
CHECK:      linalg.fill ins(%{{.*}} : f32) outs(%{{.*}} : tensor<64x64xf32>)
CHECK:      linalg.matmul {ansor.anchor} ins(%{{.*}} : tensor<64x64xbf16>, tensor<64x64xbf16>) outs(%{{.*}} : tensor<64x64xf32>)
CHECK:      linalg.generic
CHECK-SAME:   ins(%{{.*}} : tensor<64x64xf32>) outs(%{{.*}} : tensor<64x64xbf16>) attrs = {ansor.fused}
CHECK-NEXT: ^bb0(%[[IN:.*]]: f32, %{{.*}}: bf16):
CHECK-NEXT:   arith.truncf %[[IN]] : f32 to bf16
""")
    # The bound: the f32 accumulation's plus a few bf16 roundings, no more.
    assert task.tolerance == tolerance("bf16", K, accumulate="f32")
    assert 4 * EPSILON["bf16"] < task.tolerance < 5 * EPSILON["bf16"]


BF16_GENERIC = f"""func.func @g(%a: {_t((M, K), "bf16")}, %b: {_t((K, N), "bf16")}, %c: {_t((M, N), "bf16")}) -> {_t((M, N), "bf16")} {{
  %r = linalg.generic {{indexing_maps = [affine_map<(i, j, k) -> (i, k)>, affine_map<(i, j, k) -> (k, j)>,
                                        affine_map<(i, j, k) -> (i, j)>],
                       iterator_types = ["parallel", "parallel", "reduction"]}}
      ins(%a, %b : {_t((M, K), "bf16")}, {_t((K, N), "bf16")}) outs(%c : {_t((M, N), "bf16")}) {{
    ^bb0(%x: bf16, %y: bf16, %o: bf16):
      %p = arith.mulf %x, %y : bf16
      %s = arith.addf %o, %p : bf16
      linalg.yield %s : bf16
  }} -> {_t((M, N), "bf16")}
  return %r : {_t((M, N), "bf16")}
}}
"""


def test_a_bf16_generic_body_is_widened():
    """A generic summing in bf16 gets an f32 accumulator: its operands are
    extended in the body, every product is computed in f32, and its init
    (an argument) is added to the sum before the rounding."""
    task = _task(BF16_GENERIC)
    assert task.accumulator_dtype == "f32" and [o.dtype for o in task.outputs] == ["bf16"]
    filecheck(task.mlir, """
CHECK:      linalg.generic
CHECK-SAME:   outs(%{{.*}} : tensor<64x64xf32>) attrs = {ansor.anchor}
CHECK-NEXT: ^bb0(%[[X:.*]]: bf16, %[[Y:.*]]: bf16, %[[O:.*]]: f32):
CHECK-NEXT:   %[[X2:.*]] = arith.extf %[[X]] : bf16 to f32
CHECK-NEXT:   %[[Y2:.*]] = arith.extf %[[Y]] : bf16 to f32
CHECK-NEXT:   %[[P:.*]] = arith.mulf %[[X2]], %[[Y2]] : f32
CHECK-NEXT:   arith.addf %[[O]], %[[P]] : f32
CHECK:      ansor.fused
CHECK:        arith.extf
CHECK:        arith.addf
CHECK:        arith.truncf %{{.*}} : f32 to bf16
""")


@pytest.mark.parametrize("init", ["arg", "one"])
def test_a_nonzero_init_of_a_bf16_result(init):
    """An init that is not a zero fill: a constant fill becomes the same f32
    fill; any other init is added to the f32 sum before the rounding, in
    the fused op (one task)."""
    task = _task(matmul("bf16", "bf16", init=init))
    if init == "one":
        assert "linalg.fill ins(%cst : f32)" in task.mlir and "1.000000e+00 : f32" in task.mlir
        assert task.name == "matmul_64x64x64_bf16_f32_truncf"
    else:
        assert task.name == "matmul_64x64x64_bf16_f32_add" and len(task.inputs) == 3
        filecheck(task.mlir, """
CHECK:      linalg.generic
CHECK-SAME:   ins(%{{.*}}, %{{.*}} : tensor<64x64xf32>, tensor<64x64xbf16>) outs(%{{.*}} : tensor<64x64xbf16>) attrs = {ansor.fused}
CHECK:        arith.extf
CHECK:        arith.addf
CHECK:        arith.truncf
""")
    rng = np.random.default_rng(1)
    a, b, c = (_draw((M, N), "bf16", rng) for _ in range(3))
    cm = mlir_ansor.compile(mlir_ansor.load(text=matmul("bf16", "bf16", init=init)), db=None)
    try:
        out = cm(a, b, c) if init == "arg" else cm(a, b)
    finally:
        cm.close()
    want = (c.astype(np.float64) if init == "arg" else 1.0) + a.astype(np.float64) @ b.astype(np.float64)
    assert out.dtype == BF16 and _rel(out, want) <= task.tolerance


def _quantized_batch(za: int, zb: int) -> str:
    x, y, o = _t((2, M, K), "i8"), _t((2, K, N), "i8"), _t((2, M, N), "i32")
    return f"""func.func @qbmm(%a: {x}, %b: {y}) -> {o} {{
  %z = arith.constant 0 : i32
  %za = arith.constant {za} : i32
  %zb = arith.constant {zb} : i32
  %e = tensor.empty() : {o}
  %f = linalg.fill ins(%z : i32) outs(%e : {o}) -> {o}
  %r = linalg.quantized_batch_matmul ins(%a, %b, %za, %zb : {x}, {y}, i32, i32) outs(%f : {o}) -> {o}
  return %r : {o}
}}
"""


def test_quantized_matmul_is_a_dot_product_and_its_zero_points():
    """sum (a - za)(b - zb) = sum a b - zb sum a - za sum b + K za zb: the
    contraction only widens (the dot-product rule's, with the zero points'
    terms fused after it), the row and column sums are tasks of their own;
    exact."""
    tasks = mlir_ansor.extract_tasks(mlir_ansor.load(text=QUANTIZED))
    (mm,) = [t for t in tasks if t.kind == "contraction"]
    assert sorted(t.kind for t in tasks) == ["contraction", "reduction", "reduction"]
    assert mm.tolerance == 0.0 and "linalg.quantized_matmul" not in mm.mlir
    filecheck(mm.mlir, """
CHECK:      linalg.generic {{.*}} ins(%{{.*}}, %{{.*}} : tensor<64x64xi8>, tensor<64x64xi8>) outs(%{{.*}} : tensor<64x64xi32>) attrs = {ansor.anchor}
CHECK-NEXT: ^bb0
CHECK-NEXT:   arith.extsi
CHECK-NEXT:   arith.extsi
CHECK-NEXT:   arith.muli
CHECK-NEXT:   arith.addi
CHECK:      arith.constant -384 : i32
CHECK:      {ansor.fused}
CHECK-COUNT-2: arith.subi
""")
    znver4 = Target.cpu("znver4", cores=1)
    assert any(s.name.startswith("cpu-dot-product") for s in generate_sketches(mm.mlir, znver4))
    rng = np.random.default_rng(2)
    a, b = _draw((M, K), "i8", rng), _draw((K, N), "i8", rng)
    cm = mlir_ansor.compile(mlir_ansor.load(text=QUANTIZED), db=None)
    try:
        out = cm(a, b)
    finally:
        cm.close()
    np.testing.assert_array_equal(out, (a.astype(np.int64) - 3) @ (b.astype(np.int64) + 2))


def _quantized_conv(layout: str, stride: int) -> tuple[str, tuple, tuple]:
    """A 3x3 ``_q`` convolution (input zero point 3, filter -2), its input
    and filter shapes."""
    hw = 8 * stride + 2
    o = (1, 8, 8, 32) if layout == "nhwc" else (1, 32, 8, 8)
    x = (1, hw, hw, 16) if layout == "nhwc" else (1, 16, hw, hw)
    w = (3, 3, 16, 32) if layout == "nhwc" else (32, 16, 3, 3)
    op = "conv_2d_nhwc_hwcf_q" if layout == "nhwc" else "conv_2d_nchw_fchw_q"
    xt, wt, ot = _t(x, "i8"), _t(w, "i8"), _t(o, "i32")
    return f"""func.func @cq(%x: {xt}, %w: {wt}) -> {ot} {{
  %z = arith.constant 0 : i32
  %zx = arith.constant 3 : i32
  %zw = arith.constant -2 : i32
  %e = tensor.empty() : {ot}
  %f = linalg.fill ins(%z : i32) outs(%e : {ot}) -> {ot}
  %r = linalg.{op} {{strides = dense<{stride}> : tensor<2xi64>, dilations = dense<1> : tensor<2xi64>}}
      ins(%x, %w, %zx, %zw : {xt}, {wt}, i32, i32) outs(%f : {ot}) -> {ot}
  return %r : {ot}
}}
""", x, w


@pytest.mark.parametrize("layout, stride", [("nhwc", 1), ("nchw", 2)])
def test_quantized_convolution_is_a_convolution_and_its_zero_points(layout, stride):
    """A ``_q`` convolution: the convolution without zero points (the
    dot-product rule's, NHWC with unit strides), the input's window sums, the
    filters' sums; exact."""
    src, xs, ws = _quantized_conv(layout, stride)
    tasks = mlir_ansor.extract_tasks(mlir_ansor.load(text=src))
    assert sorted(t.kind for t in tasks) == ["convolution", "pooling", "reduction"]
    (conv,) = [t for t in tasks if t.kind == "convolution"]
    assert "_q " not in conv.mlir and conv.mlir.count("arith.subi") == 2
    if layout == "nhwc":
        assert any(s.name.startswith("cpu-dot-product") for s in generate_sketches(conv.mlir, Target.cpu("znver4", cores=1)))
    rng = np.random.default_rng(6)
    x, w = _draw(xs, "i8", rng), _draw(ws, "i8", rng)
    x.flat[0], w.flat[0] = -128, 127
    cm = mlir_ansor.compile(mlir_ansor.load(text=src), db=None)
    try:
        out = cm(x, w)
    finally:
        cm.close()
    xv, wv = x.astype(np.int64) - 3, w.astype(np.int64) + 2
    if layout == "nchw":  # to NHWC / HWCF for the reference
        xv, wv = xv.transpose(0, 2, 3, 1), wv.transpose(2, 3, 1, 0)
    ref = sum(np.einsum("nhwc,cf->nhwf", xv[:, i:i + 8 * stride:stride, j:j + 8 * stride:stride, :], wv[i, j])
              for i in range(3) for j in range(3))
    if layout == "nchw":
        ref = ref.transpose(0, 3, 1, 2)
    np.testing.assert_array_equal(out, ref)


@pytest.mark.parametrize("za, zb, sums", [(5, -7, 2), (0, 4, 1), (0, 0, 0)])
def test_quantized_batch_matmul_results(za, zb, sums):
    """A zero point that is the constant 0 needs no sum of the other operand."""
    src = _quantized_batch(za, zb)
    tasks = mlir_ansor.extract_tasks(mlir_ansor.load(text=src))
    assert sum(t.kind == "reduction" for t in tasks) == sums
    rng = np.random.default_rng(5)
    a, b = _draw((2, M, K), "i8", rng), _draw((2, K, N), "i8", rng)
    a[0, 0, :] = -128
    b[1, :, 0] = 127
    cm = mlir_ansor.compile(mlir_ansor.load(text=src), db=None)
    try:
        out = cm(a, b)
    finally:
        cm.close()
    np.testing.assert_array_equal(out, (a.astype(np.int64) - za) @ (b.astype(np.int64) - zb))


def test_a_bf16_convolution_accumulates_in_f32():
    task = _task(conv_bf16())
    assert task.kind == "convolution" and task.name.startswith("conv_2d_nhwc_hwcf_") and "_bf16_f32_truncf" in task.name
    assert task.accumulator_dtype == "f32" and [o.dtype for o in task.outputs] == ["bf16"]
    filecheck(task.mlir, """
CHECK:      linalg.conv_2d_nhwc_hwcf {ansor.anchor
CHECK-SAME:   ins(%{{.*}} : tensor<1x10x10x8xbf16>, tensor<3x3x8x16xbf16>) outs(%{{.*}} : tensor<1x8x8x16xf32>)
CHECK:      arith.truncf %{{.*}} : f32 to bf16
""")


def test_bf16_elementwise_ops_stay_in_bf16():
    """What ``model.to(torch.bfloat16)`` gives between its matmuls: ops in
    bf16, one task, checked within a few bf16 roundings."""
    task = _task(BF16_CHAIN)
    assert task.kind == "elementwise" and task.accumulator_dtype == ""
    assert [i.dtype for i in task.inputs] == ["bf16", "bf16"] and [o.dtype for o in task.outputs] == ["bf16"]
    assert task.tolerance == tolerance("bf16") < 5 * EPSILON["bf16"]


def test_a_requantizing_epilogue_is_fused_and_exact():
    task = _task(REQUANTIZE)
    assert task.name == "matmul_64x64x64_i8_i32_generic" and task.kind == "contraction"
    assert [o.dtype for o in task.outputs] == ["i8"] and task.tolerance == 0.0
    rng = np.random.default_rng(3)
    a, b = _draw((M, K), "i8", rng), _draw((K, N), "i8", rng)
    cm = mlir_ansor.compile(mlir_ansor.load(text=REQUANTIZE), db=None)
    try:
        out = cm(a, b)
    finally:
        cm.close()
    acc = a.astype(np.int64) @ b.astype(np.int64)
    np.testing.assert_array_equal(out, np.clip(np.round(acc * 0.0625), -128, 127).astype(np.int8))


def test_a_large_bf16_constant_goes_in_as_raw_data():
    """A bf16 weight of 64 KiB and more is kept out of LLVM like an f32 one
    (`compiler._EXTERNAL_TYPES`): its bytes come from MLIR's hex form."""
    rng = np.random.default_rng(4)
    w = _draw((256, 128), "bf16", rng)
    hexdata = w.view(np.uint16).astype("<u2").tobytes().hex().upper()
    a_t, w_t, o_t = _t((8, 256), "bf16"), _t((256, 128), "bf16"), _t((8, 128), "f32")
    text = f"""func.func @lin(%a: {a_t}) -> {o_t} {{
  %w = arith.constant dense<"0x{hexdata}"> : {w_t}
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : {o_t}
  %f = linalg.fill ins(%z : f32) outs(%e : {o_t}) -> {o_t}
  %r = linalg.matmul ins(%a, %w : {a_t}, {w_t}) outs(%f : {o_t}) -> {o_t}
  return %r : {o_t}
}}
"""
    a = _draw((8, 256), "bf16", rng)
    cm = mlir_ansor.compile(mlir_ansor.load(text=text), db=None)
    try:
        out = cm(a)
    finally:
        cm.close()
    assert _rel(out, a.astype(np.float64) @ w.astype(np.float64)) <= tolerance("f32", 256)


# --- the reference and the check ----------------------------------------------


def test_widened_payload_computes_in_f32():
    task = _task(matmul("bf16", "bf16", init="arg"))
    wide = widen_payload(task.mlir)
    assert "bf16" not in wide and "f16" not in wide
    assert "arith.extf" not in wide and "arith.truncf" not in wide
    assert "func.func @kernel(%arg0: tensor<64x64xf32>, %arg1: tensor<64x64xf32>, %arg2: tensor<64x64xf32>)" in wide
    integer = _task(matmul("i8", "i32")).mlir
    assert widen_payload(integer) == integer


def _reference(task, tmp_path, name: str = "ref"):
    data = str(tmp_path / f"{name}.npz")
    info = prepare_reference(
        task.mlir, arg_specs(task.inputs), arg_specs(task.outputs), 0, str(tmp_path / f"{name}.so"), data, 1, FAST
    )
    return data, info


def _candidate(task, tmp_path) -> str:
    """A scheduled build of `task` (the default sketch)."""
    from mlir_ansor.measure.builder import build
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.sketch import default_assignment
    from mlir_ansor.target import Target

    sk = generate_sketches(task.mlir, Target.host())[-1]
    so = str(tmp_path / "cand.so")
    build(sk.payload, sk.concrete(default_assignment(sk, 1)), 1, so)
    return so


def test_a_bf16_task_is_checked_against_an_f32_reference(tmp_path):
    """The reference is the widened task on the same inputs (stored in f32);
    the candidate writes bf16 buffers, compared in float64; a reference
    perturbed past the bf16 bound catches it."""
    task = _task(matmul("bf16", "bf16"))
    data, info = _reference(task, tmp_path)
    assert info["costs"] and info["build_s"] > 0  # the baseline: the untuned bf16 kernel
    inputs, refs, dtypes = read_data(data)
    assert [a.dtype for a in inputs] == [BF16, BF16] and refs[0].dtype == np.float32 and dtypes == [BF16]
    exact = inputs[0].astype(np.float64) @ inputs[1].astype(np.float64)
    assert _rel(refs[0], exact) < 1e-6  # f32 accumulation, no bf16 rounding (that would be ~4e-3)
    so = _candidate(task, tmp_path)
    got = run(so, data, FAST, tol=task.tolerance)
    assert got["ok"], got
    # Checked as bf16: its rounding shows (a widened output would be ~1e-7 off).
    assert EPSILON["bf16"] / 16 < got["error"] <= task.tolerance
    bad = str(tmp_path / "bad.npz")
    scale = float(np.max(np.abs(refs[0])))
    save_data(bad, inputs, [refs[0] + np.float32(2 * task.tolerance * scale)], ["bf16"])
    wrong = run(so, bad, FAST, tol=task.tolerance)
    assert not wrong["ok"] and wrong["error"] > task.tolerance


@pytest.mark.parametrize("ext", ["arith.extsi", "arith.extui"])
def test_an_i8_task_is_checked_exactly(tmp_path, ext):
    task = _task(generic_matmul("i8", "i32", ext, "arith.extsi"))
    data, _ = _reference(task, tmp_path)
    inputs, refs, dtypes = read_data(data)
    a = inputs[0].astype(np.int64)
    if ext == "arith.extui":
        a = a % 256  # -8..-1 read unsigned: 248..255
    np.testing.assert_array_equal(refs[0], a @ inputs[1].astype(np.int64))
    assert dtypes == [np.dtype(np.int32)]
    so = _candidate(task, tmp_path)
    got = run(so, data, FAST, tol=0.0)
    assert got["ok"] and got["error"] == 0.0
    bad = str(tmp_path / "bad.npz")
    off = refs[0].copy()
    off[3, 5] += 1
    save_data(bad, inputs, [off], ["i32"])
    assert not run(so, bad, FAST, tol=0.0)["ok"]


ROUNDED_ON_THE_WAY = f"""func.func @r(%a: {_t((M, K), "f32")}, %b: {_t((K, N), "f32")}) -> {_t((M, N), "f32")} {{
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : {_t((M, N), "f32")}
  %f = linalg.fill ins(%z : f32) outs(%e : {_t((M, N), "f32")}) -> {_t((M, N), "f32")}
  %r = linalg.matmul ins(%a, %b : {_t((M, K), "f32")}, {_t((K, N), "f32")}) outs(%f : {_t((M, N), "f32")}) -> {_t((M, N), "f32")}
  %e2 = tensor.empty() : {_t((M, N), "f32")}
  %q = linalg.generic {{indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>],
                       iterator_types = ["parallel", "parallel"]}}
      ins(%r : {_t((M, N), "f32")}) outs(%e2 : {_t((M, N), "f32")}) {{
    ^bb0(%x: f32, %o: f32):
      %t = arith.truncf %x : f32 to bf16
      %w = arith.extf %t : bf16 to f32
      linalg.yield %w : f32
  }} -> {_t((M, N), "f32")}
  return %q : {_t((M, N), "f32")}
}}
"""


def test_a_value_rounded_to_bf16_on_the_way_is_allowed_for(tmp_path):
    """An f32 task that rounds to bf16 between its ops (torch-mlir's linear
    -> bf16 relu -> linear): its reference does not round, so its bound
    takes the bf16 rounding in, and a correct candidate passes."""
    task = _task(ROUNDED_ON_THE_WAY)
    assert [o.dtype for o in task.outputs] == ["f32"] and task.rounding_dtype == "bf16"
    assert task.tolerance == tolerance("f32", K, rounds_to="bf16") > 4 * EPSILON["bf16"]
    data, _ = _reference(task, tmp_path)
    got = run(_candidate(task, tmp_path), data, FAST, tol=task.tolerance)
    assert got["ok"] and got["error"] > EPSILON["bf16"] / 16


def test_a_bf16_torch_model(torch):
    """``model.to(torch.bfloat16)`` through torch-mlir: its tasks, and the
    compiled module against torch in float64."""
    from mlir_ansor.importers.pytorch import import_module

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
    model = model.to(torch.bfloat16).eval()
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    program = mlir_ansor.load(text=import_module(model, (x,)))
    tasks = mlir_ansor.extract_tasks(program)
    assert [o.dtype for o in tasks[-1].outputs] == ["bf16"]
    assert all(t.rounding_dtype in ("bf16", "") for t in tasks) and any(t.rounding_dtype == "bf16" for t in tasks)
    cm = mlir_ansor.compile(program, db=None)
    try:
        out = cm(x.float().numpy().astype(BF16))
    finally:
        cm.close()
    want = model.double()(x.double()).detach().numpy()
    assert out.dtype == BF16 and _rel(out, want) <= max(t.tolerance for t in tasks)


def test_tolerance_rule():
    # f32 and f64: as before (16 epsilons, 4 per term of the reduction).
    for d in ("f32", "f64"):
        assert tolerance(d) == 16 * EPSILON[d] and tolerance(d, 1024) == 4 * 1024 * EPSILON[d]
    # bf16 over K = 512 (the old rule: > 1, no check at all): the f32 sum and the rounding.
    assert tolerance("bf16", 512) == 4 * 512 * EPSILON["f32"] + 4 * EPSILON["bf16"] < 0.04
    assert tolerance("f16", 512) == 4 * 512 * EPSILON["f32"] + 4 * EPSILON["f16"]
    assert tolerance("i32", 4096) == tolerance("i8") == 0.0
    # A value rounded to bf16 on the way counts, in floats and integers alike.
    assert tolerance("f32", 64, rounds_to="bf16") == tolerance("bf16", 64)
    assert tolerance("f32", 64, rounds_to="f32") == tolerance("f32", 64)
    assert tolerance("i8", rounds_to="bf16") == 4 * EPSILON["bf16"] and tolerance("i8", rounds_to="f32") == 0.0
    assert tolerance("bf16", 8, whole_module=True) == 8 * tolerance("bf16", 8)


# --- tuning and compiling -------------------------------------------------------


def _numpy_conv(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    x, w = x.astype(np.float64), w.astype(np.float64)
    kh, kw = w.shape[:2]
    oh, ow = x.shape[1] - kh + 1, x.shape[2] - kw + 1
    out = np.zeros((x.shape[0], oh, ow, w.shape[3]))
    for i in range(kh):
        for j in range(kw):
            out += np.einsum("nhwc,cf->nhwf", x[:, i : i + oh, j : j + ow, :], w[i, j])
    return out


# The multi-level tiling sketch's packing pads every operand with a zero of
# the result's type (schedule/writer.py): `0.0 : f32` for bf16 operands fails
# to apply, and `0.0 : i32` does not parse (test_multi_level_tiling_with_packing_builds).
# So float contractions are tuned without packing, integer ones with the
# default rule only.
CASES = {
    "bf16_f32": (matmul("bf16", "f32"), ("bf16", "bf16"), None),
    "bf16_bf16": (matmul("bf16", "bf16"), ("bf16", "bf16"), None),
    "f16_f32": (matmul("f16", "f32"), ("f16", "f16"), None),
    "i8_i32": (matmul("i8", "i32"), ("i8", "i8"), None),
    "u8_i32": (generic_matmul("i8", "i32", "arith.extui", "arith.extsi"), ("i8", "i8"), None),
    "conv_bf16": (conv_bf16(), ("bf16", "bf16"), None),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_tune_and_compile(tmp_path, case):
    text, in_types, rules = CASES[case]
    path = tmp_path / f"{case}.mlir"
    path.write_text(text)
    db = tmp_path / "t.db"
    cfg = TuneConfig(trials=2, batch_size=2, build_workers=2, timing=FAST, build_timeout_s=60, run_timeout_s=30,
                     rules=rules)
    result = tune(str(path), config=cfg, db=db)
    (r,) = result.tasks
    assert r.trials == 2 and np.isfinite(r.best_latency_s) and r.baseline_latency_s > 0
    rng = np.random.default_rng(5)
    if case == "conv_bf16":
        x, w = _draw((1, 10, 10, 8), "bf16", rng), _draw((3, 3, 8, 16), "bf16", rng)
        args, want = (x, w), _numpy_conv(x, w)
    else:
        a, b = _draw((M, K), in_types[0], rng), _draw((K, N), in_types[1], rng)
        a64 = a.astype(np.int64) % 256 if case == "u8_i32" else a.astype(np.float64)
        args, want = (a, b), a64 @ b.astype(np.float64 if a64.dtype == np.float64 else np.int64)
    cm = mlir_ansor.compile(str(path), db=db)
    try:
        assert [k.source for k in cm.kernels] == ["tuned"]
        out = cm(*args)
    finally:
        cm.close()
    assert out.dtype == np_dtype(r.task.outputs[0].dtype)
    if r.task.tolerance == 0.0:
        np.testing.assert_array_equal(out, want)
    else:
        assert _rel(out, want) <= r.task.tolerance


@pytest.mark.parametrize("tin, tout", [("bf16", "bf16"), ("i8", "i32")])
def test_multi_level_tiling_with_packing_builds(tmp_path, tin, tout):
    """The multi-level tiling sketch's default point (it packs) builds for
    narrow operand types."""
    from mlir_ansor.measure.builder import build
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.sketch import default_assignment
    from mlir_ansor.target import Target

    task = _task(matmul(tin, tout))
    (sk,) = [s for s in generate_sketches(task.mlir, Target.host()) if s.name == "cpu-contraction"]
    build(sk.payload, sk.concrete(default_assignment(sk, 1)), 1, str(tmp_path / "k.so"))


def test_run_checks_a_bf16_module_against_an_f32_reference(tmp_path, capsys):
    """`mlir-ansor run` draws bf16 inputs, and its untuned reference computes
    in f32 (`compile_untuned(widen=True)`): the error left is the bf16
    rounding of the result."""
    from mlir_ansor.tools.cli import main

    path = tmp_path / "mm.mlir"
    path.write_text(matmul("bf16", "bf16"))
    assert main(["run", str(path), "--json", "--repeat", "1", "--db", str(tmp_path / "none.db")]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["tolerance"] == tolerance("bf16", K, whole_module=True)
    assert 0 < out["max_relative_error"] <= 2 * EPSILON["bf16"]
