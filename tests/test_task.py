"""Tests of mlir_ansor.graph.task: partition into tasks, keys, flops, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlir import ir

from mlir_ansor.errors import InputError, UnsupportedError
from mlir_ansor.graph.task import Task, TensorSpec, extract_tasks, workload_key
from mlir_ansor.ir.program import load

INPUTS = Path(__file__).parent / "inputs"


def _path(name: str) -> str:
    return str(INPUTS / name)


def _one(source) -> Task:
    tasks = extract_tasks(source)
    assert len(tasks) == 1
    return tasks[0]


def _reparses(task: Task) -> ir.Module:
    ctx = ir.Context()
    module = ir.Module.parse(task.mlir, ctx)
    module.operation.verify()
    fns = [o for o in module.body.operations if o.operation.name == "func.func"]
    assert [ir.StringAttr(f.attributes["sym_name"]).value for f in fns] == ["kernel"]
    return module


MATMUL = """func.func @{fn}(%{a}: tensor<{m}x{k}xf32>, %{b}: tensor<{k}x{n}xf32>) -> tensor<{m}x{n}xf32> {{
  %cst = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<{m}x{n}xf32>
  %{c} = linalg.fill ins(%cst : f32) outs(%e : tensor<{m}x{n}xf32>) -> tensor<{m}x{n}xf32>
  %r = linalg.matmul ins(%{a}, %{b} : tensor<{m}x{k}xf32>, tensor<{k}x{n}xf32>) outs(%{c} : tensor<{m}x{n}xf32>) -> tensor<{m}x{n}xf32>
  return %r : tensor<{m}x{n}xf32>
}}
"""


def _matmul(fn="f", a="A", b="B", c="C", m=128, n=256, k=64) -> str:
    return MATMUL.format(fn=fn, a=a, b=b, c=c, m=m, n=n, k=k)


# --- a single matmul ---------------------------------------------------------


def test_matmul_task_fields():
    path = _path("matmul.mlir")
    t = _one(path)
    assert t.name == "matmul_128x256x64_f32"
    assert len(t.workload_key) == 16 and int(t.workload_key, 16) >= 0
    assert t.anchor_op == "linalg.matmul"
    assert t.kind == "contraction"
    assert t.loop_ranges == (128, 256, 64)
    assert t.iterator_types == ("parallel", "parallel", "reduction")
    assert t.flops == 2 * 128 * 256 * 64
    assert t.weight == 1
    assert t.inputs == (TensorSpec((128, 64), "f32"), TensorSpec((64, 256), "f32"))
    assert t.outputs == (TensorSpec((128, 256), "f32"),)
    assert t.locations == (f"{path}:5:8",)
    assert t.func_name == "matmul"
    _reparses(t)
    # fill, tensor.empty and the constant are cloned in; the anchor is marked.
    assert t.mlir.count("ansor.anchor") == 1
    assert "ansor.fused" not in t.mlir
    assert "linalg.fill" in t.mlir and "tensor.empty" in t.mlir
    assert "linalg.matmul {ansor.anchor}" in t.mlir  # stays a named op


def test_matmul_and_generic_have_same_key():
    named = _one(_path("matmul.mlir"))
    generic = _one(_path("matmul_generic.mlir"))
    assert generic.anchor_op == "linalg.generic"
    assert generic.kind == "contraction"
    assert generic.loop_ranges == named.loop_ranges
    assert generic.flops == named.flops
    assert generic.workload_key == named.workload_key


def test_key_ignores_ssa_and_function_names():
    k1 = _one(load(text=_matmul())).workload_key
    k2 = _one(load(text=_matmul(fn="other", a="x", b="weights", c="acc"))).workload_key
    assert k1 == k2


def test_key_depends_on_shape_and_dtype():
    k1 = _one(load(text=_matmul())).workload_key
    k2 = _one(load(text=_matmul(k=32))).workload_key
    k3 = _one(load(text=_matmul().replace("f32", "f64"))).workload_key
    assert len({k1, k2, k3}) == 3


def test_workload_key_is_stable_on_task_text():
    t = _one(_path("matmul.mlir"))
    assert workload_key(t.mlir) == t.workload_key
    assert workload_key(t.mlir) == workload_key(t.mlir)


# --- several ops ---------------------------------------------------------------


def test_identical_tasks_merge_with_weight():
    path = _path("two_matmuls.mlir")
    tasks = extract_tasks(path)
    assert [t.name for t in tasks] == ["matmul_32x64x64_f32", "matmul_32x16x64_f32"]
    assert [t.weight for t in tasks] == [2, 1]
    assert tasks[0].locations == (f"{path}:5:9", f"{path}:6:9")
    assert tasks[1].locations == (f"{path}:9:9",)
    assert tasks[0].workload_key != tasks[1].workload_key
    assert tasks[0].flops == 2 * 32 * 64 * 64
    assert tasks[1].flops == 2 * 32 * 16 * 64
    for t in tasks:
        _reparses(t)


def test_conv_bias_relu_is_one_task():
    path = _path("conv_bias_relu.mlir")
    t = _one(path)
    assert t.anchor_op == "linalg.conv_2d_nhwc_hwcf"
    assert t.kind == "convolution"
    assert t.name == "conv_2d_nhwc_hwcf_1x56x56x128x3x3x64_f32_add_relu"
    assert t.loop_ranges == (1, 56, 56, 128, 3, 3, 64)
    assert t.iterator_types == ("parallel",) * 4 + ("reduction",) * 3
    assert t.mlir.count("ansor.fused") == 2
    assert t.mlir.count("ansor.anchor") == 1
    conv = 2 * 1 * 56 * 56 * 128 * 3 * 3 * 64
    assert t.flops == conv + 1 * 56 * 56 * 128 * 2  # + bias add + relu
    assert t.inputs == (
        TensorSpec((1, 58, 58, 64), "f32"),
        TensorSpec((3, 3, 64, 128), "f32"),
        TensorSpec((128,), "f32"),
    )
    assert t.outputs == (TensorSpec((1, 56, 56, 128), "f32"),)
    assert t.locations == (f"{path}:7:11",)
    module = _reparses(t)
    # The relu's constant 0.0, captured by its body, is cloned into the task.
    assert "arith.maximumf" in str(module)
    assert "arith.constant 0.000000e+00 : f32" in str(module)


def test_memref_matmul_becomes_tensor_task():
    path = _path("matmul_memref.mlir")
    t = _one(path)
    assert t.anchor_op == "linalg.matmul"
    assert len(t.inputs) == 3
    # first-use order: the fill of C comes first, then A and B
    assert t.inputs == (
        TensorSpec((64, 16), "f64"),
        TensorSpec((64, 32), "f64"),
        TensorSpec((32, 16), "f64"),
    )
    assert t.outputs == (TensorSpec((64, 16), "f64"),)
    assert t.flops == 2 * 64 * 16 * 32
    assert t.name == "matmul_64x16x32_f64"
    assert t.locations == (f"{path}:4:3",)
    assert "memref" not in t.mlir
    assert "linalg.fill" in t.mlir
    _reparses(t)


def test_memref_matmul_without_fill_keeps_operand_order():
    text = """func.func @mm(%A: memref<8x4xf32>, %B: memref<4x2xf32>, %C: memref<8x2xf32>) {
  linalg.matmul ins(%A, %B : memref<8x4xf32>, memref<4x2xf32>) outs(%C : memref<8x2xf32>)
  return
}"""
    t = _one(load(text=text))
    assert t.inputs == (
        TensorSpec((8, 4), "f32"),
        TensorSpec((4, 2), "f32"),
        TensorSpec((8, 2), "f32"),
    )
    assert t.outputs == (TensorSpec((8, 2), "f32"),)
    assert "-> tensor<8x2xf32>" in t.mlir
    _reparses(t)


ELEMENTWISE_CHAIN = """#id = affine_map<(d0, d1) -> (d0, d1)>
func.func @ew(%a: tensor<16x32xf32>, %b: tensor<16x32xf32>) -> tensor<16x32xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<16x32xf32>
  %s = linalg.add ins(%a, %b : tensor<16x32xf32>, tensor<16x32xf32>) outs(%e : tensor<16x32xf32>) -> tensor<16x32xf32>
  %r = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%s : tensor<16x32xf32>) outs(%e : tensor<16x32xf32>) {
  ^bb0(%x: f32, %o: f32):
    %m = arith.maximumf %x, %zero : f32
    linalg.yield %m : f32
  } -> tensor<16x32xf32>
  return %r : tensor<16x32xf32>
}
"""


def test_elementwise_chain_is_one_task():
    t = _one(load(text=ELEMENTWISE_CHAIN))
    assert t.kind == "elementwise"
    assert t.anchor_op == "linalg.add"
    assert t.name == "add_16x32_f32_relu"
    assert t.iterator_types == ("parallel", "parallel")
    assert t.loop_ranges == (16, 32)
    assert t.flops == 2 * 16 * 32
    assert t.mlir.count("ansor.fused") == 1
    assert len(t.inputs) == 2 and len(t.outputs) == 1
    _reparses(t)


def test_reduction_and_pooling_kinds():
    text = """#in = affine_map<(d0, d1) -> (d0, d1)>
#out = affine_map<(d0, d1) -> (d0)>
func.func @rp(%x: tensor<64x128xf32>, %img: tensor<1x16x16x8xf32>, %win: tensor<2x2xf32>) -> (tensor<64xf32>, tensor<1x8x8x8xf32>) {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<64xf32>
  %acc = linalg.fill ins(%zero : f32) outs(%e : tensor<64xf32>) -> tensor<64xf32>
  %sum = linalg.generic {indexing_maps = [#in, #out], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<64x128xf32>) outs(%acc : tensor<64xf32>) {
  ^bb0(%v: f32, %o: f32):
    %s = arith.addf %o, %v : f32
    linalg.yield %s : f32
  } -> tensor<64xf32>
  %pe = tensor.empty() : tensor<1x8x8x8xf32>
  %pacc = linalg.fill ins(%zero : f32) outs(%pe : tensor<1x8x8x8xf32>) -> tensor<1x8x8x8xf32>
  %pool = linalg.pooling_nhwc_max {dilations = dense<1> : tensor<2xi64>, strides = dense<2> : tensor<2xi64>}
      ins(%img, %win : tensor<1x16x16x8xf32>, tensor<2x2xf32>) outs(%pacc : tensor<1x8x8x8xf32>) -> tensor<1x8x8x8xf32>
  return %sum, %pool : tensor<64xf32>, tensor<1x8x8x8xf32>
}
"""
    red, pool = extract_tasks(load(text=text))
    assert red.kind == "reduction"
    assert red.loop_ranges == (64, 128)
    assert red.flops == 64 * 128
    assert red.name == "reduction_64x128_f32"
    assert pool.kind == "pooling"
    assert pool.anchor_op == "linalg.pooling_nhwc_max"
    assert pool.loop_ranges == (1, 8, 8, 8, 2, 2)
    assert pool.flops == 1 * 8 * 8 * 8 * 2 * 2
    assert red.workload_key != pool.workload_key
    _reparses(red)
    _reparses(pool)


def test_matmul_with_shared_result_is_not_fused():
    # The matmul result has two users: the relu cannot be fused into it.
    text = """#id = affine_map<(d0, d1) -> (d0, d1)>
func.func @two_uses(%a: tensor<8x8xf32>, %b: tensor<8x8xf32>, %c: tensor<8x8xf32>) -> (tensor<8x8xf32>, tensor<8x8xf32>) {
  %zero = arith.constant 0.0 : f32
  %mm = linalg.matmul ins(%a, %b : tensor<8x8xf32>, tensor<8x8xf32>) outs(%c : tensor<8x8xf32>) -> tensor<8x8xf32>
  %r = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%mm : tensor<8x8xf32>) outs(%c : tensor<8x8xf32>) {
  ^bb0(%x: f32, %o: f32):
    %m = arith.maximumf %x, %zero : f32
    linalg.yield %m : f32
  } -> tensor<8x8xf32>
  return %mm, %r : tensor<8x8xf32>, tensor<8x8xf32>
}
"""
    mm, relu = extract_tasks(load(text=text))
    assert mm.kind == "contraction" and "ansor.fused" not in mm.mlir
    assert relu.kind == "elementwise" and relu.name == "relu_8x8_f32"
    assert mm.inputs == (TensorSpec((8, 8), "f32"),) * 3
    _reparses(relu)


def test_func_selection_and_module_input():
    text = _matmul(fn="first") + _matmul(fn="second", m=32, n=32, k=32)
    program = load(text=text)
    assert [t.func_name for t in extract_tasks(program)] == ["first", "second"]
    only = extract_tasks(program, func="second")
    assert [t.loop_ranges for t in only] == [(32, 32, 32)]
    with pytest.raises(UnsupportedError, match="no function @third"):
        extract_tasks(program, func="third")
    # An ir.Module from the caller's own context works too.
    theirs = ir.Module.parse(text, ir.Context())
    assert [t.workload_key for t in extract_tasks(theirs)] == [
        t.workload_key for t in extract_tasks(program)
    ]


def test_names_are_unique_when_keys_differ():
    # Same op and ranges, different operand layout: different keys, one name.
    text = """func.func @u(%a: tensor<8x8xf32>, %b: tensor<8x8xf32>, %c: tensor<8x8xf32>) -> (tensor<8x8xf32>, tensor<8x8xf32>) {
  %x = linalg.matmul ins(%a, %b : tensor<8x8xf32>, tensor<8x8xf32>) outs(%c : tensor<8x8xf32>) -> tensor<8x8xf32>
  %y = linalg.matmul ins(%a, %a : tensor<8x8xf32>, tensor<8x8xf32>) outs(%c : tensor<8x8xf32>) -> tensor<8x8xf32>
  return %x, %y : tensor<8x8xf32>, tensor<8x8xf32>
}
"""
    tasks = extract_tasks(load(text=text))
    assert len(tasks) == 2
    assert tasks[0].workload_key != tasks[1].workload_key
    assert [t.name for t in tasks] == ["matmul_8x8x8_f32", "matmul_8x8x8_f32_2"]


# --- errors ---------------------------------------------------------------------


def test_dynamic_shape_is_unsupported():
    path = _path("dynamic.mlir")
    with pytest.raises(UnsupportedError) as err:
        extract_tasks(path)
    msg = str(err.value)
    assert f"{path}:2:8:" in msg
    assert "linalg.matmul" in msg and "dynamic shape" in msg


def test_unsupported_element_type():
    path = _path("mask_only.mlir")
    with pytest.raises(UnsupportedError) as err:
        extract_tasks(path)
    msg = str(err.value)
    assert f"{path}:4:8:" in msg and "linalg.generic" in msg
    # The only op is left out (an op on i1 masks next to tunable ones stays in
    # the driver, lowered as loops), so nothing is left to tune, and why.
    assert "no Linalg operation to tune" in msg and "element type i1, which tasks do not take yet (f32, f64, bf16" in msg


def test_integer_matmul_is_a_task():
    """i32 (like i8 with i32 accumulation, tests/test_low_precision.py) is
    a type tasks take."""
    (task,) = extract_tasks(_path("i32_matmul.mlir"))
    assert task.name == "matmul_8x8x8_i32" and task.accumulator_dtype == "i32"
    assert [i.dtype for i in task.inputs] == ["i32"] * 3 and task.tolerance == 0.0


def test_other_floats_are_refused_not_left_out(tmp_path):
    """Integer masks stay out of tasks (lowered as loops); a model in a float
    type tasks do not take (f8) is refused instead of silently compiled to loops."""
    t = "tensor<8x8xf8E4M3FN>"
    path = tmp_path / "f8.mlir"
    path.write_text(
        f"func.func @m(%a: {t}, %b: {t}) -> {t} {{\n  %z = arith.constant 0.0 : f8E4M3FN\n  %e = tensor.empty() : {t}\n"
        f"  %f = linalg.fill ins(%z : f8E4M3FN) outs(%e : {t}) -> {t}\n"
        f"  %r = linalg.matmul ins(%a, %b : {t}, {t}) outs(%f : {t}) -> {t}\n  return %r : {t}\n}}\n"
    )
    with pytest.raises(UnsupportedError, match=r"f8.mlir:4:8: linalg.fill: element type f8E4M3FN is not supported yet"):
        extract_tasks(str(path))


def test_unsupported_op_in_function():
    path = _path("unsupported_op.mlir")
    with pytest.raises(UnsupportedError) as err:
        extract_tasks(path)
    msg = str(err.value)
    assert f"{path}:2:8:" in msg and "tensor.splat" in msg


def test_scf_for_is_unsupported():
    text = """func.func @loop(%a: tensor<4xf32>) -> tensor<4xf32> {
  %c0 = arith.constant 0 : index
  %c4 = arith.constant 4 : index
  %c1 = arith.constant 1 : index
  %r = scf.for %i = %c0 to %c4 step %c1 iter_args(%t = %a) -> tensor<4xf32> {
    scf.yield %t : tensor<4xf32>
  }
  return %r : tensor<4xf32>
}"""
    with pytest.raises(UnsupportedError, match=r"<string>:5:8: scf\.for"):
        extract_tasks(load(text=text))


def test_no_linalg_op():
    path = _path("no_linalg.mlir")
    with pytest.raises(
        UnsupportedError, match=f"no Linalg operation to tune in {path}"
    ):
        extract_tasks(path)


def test_bad_input_is_input_error():
    with pytest.raises(InputError, match="malformed.mlir:3:94"):
        extract_tasks(_path("malformed.mlir"))


def test_workload_key_of_garbage_is_input_error():
    with pytest.raises(InputError):
        workload_key("this is not mlir")
