"""Constant weights packed once (`graph.prepack`): a narrow matmul whose B
is a constant reads it in the dot-product layout, which the compiler folds
at compile time; the `cpu-dot-product` rule takes the packed op as its own
packing's result."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import filecheck
from mlir import ir

from mlir_ansor.graph.task import extract_tasks
from mlir_ansor.ir.program import load
from mlir_ansor.measure.builder import build
from mlir_ansor.measure.runner import Kernel, aligned_copy, aligned_full
from mlir_ansor.passes.lowering import lower_to_llvm
from mlir_ansor.passes.objcode import emit_object, instruction_counts
from mlir_ansor.schedule.apply import apply_schedule
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.search.rules.dot_product import weight_packing
from mlir_ansor.search.sketch import default_assignment
from mlir_ansor.target import Target

ZNVER4 = Target.cpu("znver4", cores=1)
ZNVER3 = Target.cpu("znver3", cores=1)


def _weights(k: int, n: int, ins: str, seed: int = 0) -> np.ndarray:
    """B's values: small integers (exact in bf16), as float64 or int64."""
    rng = np.random.default_rng(seed)
    if ins == "i8":
        return rng.integers(-128, 128, (k, n))
    return rng.integers(-8, 9, (k, n)) / 4.0


def weight_module(m: int, n: int, k: int, ins: str, out: str, b: np.ndarray | None) -> str:
    """C = A @ B with B a dense constant (`b`), or with `b` None the
    function's second argument; fill 0."""
    zero = "0.0" if out.startswith("f") else "0"
    bt = f"tensor<{k}x{n}x{ins}>"
    if b is None:
        args, b_def = f"%a: tensor<{m}x{k}x{ins}>, %b: {bt}", ""
    else:
        rows = ", ".join("[" + ", ".join(str(int(x)) if ins == "i8" else repr(float(x)) for x in row) + "]" for row in b)
        args, b_def = f"%a: tensor<{m}x{k}x{ins}>", f"%b = arith.constant dense<[{rows}]> : {bt}"
    return f"""
func.func @mm({args}) -> tensor<{m}x{n}x{out}> {{
  {b_def}
  %z = arith.constant {zero} : {out}
  %e = tensor.empty() : tensor<{m}x{n}x{out}>
  %c = linalg.fill ins(%z : {out}) outs(%e : tensor<{m}x{n}x{out}>) -> tensor<{m}x{n}x{out}>
  %r = linalg.matmul ins(%a, %b : tensor<{m}x{k}x{ins}>, {bt}) outs(%c : tensor<{m}x{n}x{out}>) -> tensor<{m}x{n}x{out}>
  return %r : tensor<{m}x{n}x{out}>
}}
"""


def _task(src: str, target: Target | None):
    (task,) = extract_tasks(load(text=src), prepack=weight_packing(target) if target else None)
    return task


def test_constant_weights_are_read_packed():
    b = _weights(64, 32, "bf16")
    task = _task(weight_module(16, 32, 64, "bf16", "f32", b), ZNVER4)
    assert task.name == "matmul_packed_16x32x32x2_bf16_f32"
    assert task.flops == 2 * 16 * 32 * 64
    assert [i.shape for i in task.inputs] == [(16, 32, 2), (32, 32, 2)]
    filecheck(task.mlir, """
        CHECK: func.func @kernel(%{{.*}}: tensor<16x32x2xbf16>, %{{.*}}: tensor<32x32x2xbf16>) -> tensor<16x32xf32>
        CHECK: linalg.generic {indexing_maps = [#map, #map1, #map2], iterator_types = ["parallel", "parallel", "reduction", "reduction"]}
        CHECK-SAME: ansor.packed = 2
        CHECK: arith.extf
        CHECK: arith.extf
        CHECK: arith.mulf
        CHECK: arith.addf
    """)
    # int8: quads where 512-bit VNNI is (vpdpbusd), pairs with AVX2 alone.
    bi = _weights(64, 32, "i8")
    assert _task(weight_module(16, 32, 64, "i8", "i32", bi), ZNVER4).name == "matmul_packed_16x32x16x4_i8_i32"
    assert _task(weight_module(16, 32, 64, "i8", "i32", bi), ZNVER3).name == "matmul_packed_16x32x32x2_i8_i32"


def test_what_is_not_packed():
    b = _weights(64, 32, "bf16")
    plain = "matmul_16x32x64_bf16_f32"
    assert _task(weight_module(16, 32, 64, "bf16", "f32", b), None).name == plain  # no target given
    assert _task(weight_module(16, 32, 64, "bf16", "f32", b), ZNVER3).name == plain  # no vdpbf16ps
    # Sapphire Rapids has it, but at half the FMAs' rate: bf16 is computed in
    # f32 there, from B as it is; its int8 weights are still packed in quads.
    spr = Target.cpu("sapphirerapids", cores=1)
    assert _task(weight_module(16, 32, 64, "bf16", "f32", b), spr).name == plain
    assert _task(weight_module(16, 32, 64, "i8", "i32", _weights(64, 32, "i8")), spr).name == "matmul_packed_16x32x16x4_i8_i32"
    assert _task(weight_module(16, 32, 64, "bf16", "f32", None), ZNVER4).name == plain  # B an argument
    assert _task(weight_module(16, 40, 64, "bf16", "f32", _weights(64, 40, "bf16")), ZNVER4).name == "matmul_16x40x64_bf16_f32"


def _packed_sketches(src: str, target: Target):
    task = _task(src, target)
    return task, [s for s in generate_sketches(task.mlir, target) if s.name.startswith("cpu-dot-product")]


def test_packed_sketches_do_not_pack_again():
    _, sketches = _packed_sketches(weight_module(64, 64, 64, "bf16", "f32", _weights(64, 64, "bf16")), ZNVER4)
    assert {s.name for s in sketches} == {"cpu-dot-product-8x32", "cpu-dot-product-4x64"}
    assert all({k.name for k in s.knobs} == {"p_d0", "p_d1", "k_d2", "pack"} for s in sketches)
    assert all("transform.structured.pack " not in s.script for s in sketches)


@pytest.mark.parametrize("ins, out, instruction, count", [("bf16", "f32", "vdpbf16ps", 16), ("i8", "i32", "vpdpbusd", 18)])
def test_packed_object_code_for_znver4(tmp_path, ins, out, instruction, count):
    _, sketches = _packed_sketches(weight_module(64, 64, 64, ins, out, _weights(64, 64, ins)), ZNVER4)
    (sketch,) = [s for s in sketches if s.name.endswith("8x32")]
    with ir.Context(), ir.Location.unknown():
        module = apply_schedule(sketch.payload, sketch.concrete(default_assignment(sketch, 1)))
        lower_to_llvm(module, 1)
        obj = emit_object(module, tmp_path / "k.o", cpu="znver4")
    assert instruction_counts(obj, [instruction])[instruction] == count


def _host_runs(feature: str) -> None:
    if not Target.host().has(feature):
        pytest.skip(f"this host has no {feature}: the object code is checked for znver4 instead")


def _a_and_b(ins: str, m: int, k: int, n: int):
    import ml_dtypes

    rng = np.random.default_rng(5)
    b = _weights(k, n, ins)
    if ins == "i8":
        a = rng.integers(-128, 128, (m, k)).astype(np.int8)
        a[0, :] = -128
        return a, b.astype(np.int8)
    return rng.uniform(-1, 1, (m, k)).astype(ml_dtypes.bfloat16), b.astype(ml_dtypes.bfloat16)


def _check(got: np.ndarray, a: np.ndarray, b: np.ndarray, ins: str) -> None:
    want = a.astype(np.float64) @ b.astype(np.float64)
    if ins == "i8":
        assert np.array_equal(got, want.astype(np.int64))
    else:
        assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-5


@pytest.mark.parametrize("ins, out, feature", [("bf16", "f32", "avx512_bf16"), ("i8", "i32", "avx512_vnni")])
def test_packed_kernel_results(tmp_path, ins, out, feature):
    """The tensorized kernel of the packed task, on A and B packed by numpy."""
    _host_runs(feature)
    m, n, k = 64, 96, 128
    a, b = _a_and_b(ins, m, k, n)
    host = Target.host()
    task, sketches = _packed_sketches(weight_module(m, n, k, ins, out, b.astype(np.float64)), host)
    g = task.inputs[0].shape[-1]
    (sketch,) = [s for s in sketches if s.name.endswith("8x32")]
    so = str(tmp_path / "k.so")
    build(sketch.payload, sketch.concrete(default_assignment(sketch, 2)), 2, so)
    a3 = a.reshape(m, k // g, g)
    bp = b.reshape(k // g, g, n).transpose(0, 2, 1).copy()
    got = aligned_full((m, n), np.float32 if out == "f32" else np.int32, 0)
    kernel = Kernel(so)
    try:
        kernel.bind([aligned_copy(a3), aligned_copy(bp), got])()
    finally:
        kernel.close()
    _check(got, a, b, ins)


@pytest.mark.parametrize("ins, out, feature", [("bf16", "f32", "avx512_bf16"), ("i8", "i32", "avx512_vnni")])
def test_compiled_module_packs_its_weights_once(tmp_path, ins, out, feature):
    """A whole module: the packing of B is folded into a constant at compile
    time, and the module's results are A @ B."""
    _host_runs(feature)
    from mlir_ansor import compile  # noqa: A004

    m, n, k = 32, 64, 64
    a, b = _a_and_b(ins, m, k, n)
    cm = compile(load(text=weight_module(m, n, k, ins, out, b.astype(np.float64))))
    assert [p.task.name.startswith("matmul_packed_") for p in cm.kernels] == [True]
    _check(cm(a), a, b, ins)
