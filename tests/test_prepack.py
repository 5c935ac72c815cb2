"""Constant weights packed once (`graph.prepack`): a narrow matmul whose B
is a constant reads it in the dot-product layout, which the compiler folds
at compile time; the `cpu-dot-product` rule takes the packed op as its own
packing's result."""

from __future__ import annotations

import dataclasses

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
    # Sapphire Rapids has it, but at half the FMAs' rate: without AMX, bf16
    # is computed in f32 there, from B as it is; with AMX, B is packed in
    # pairs for the tiles (`search.rules.amx`). Its int8 weights are packed
    # in quads either way.
    spr = Target.cpu("sapphirerapids", cores=1)
    no_amx = dataclasses.replace(spr, features=tuple(f for f in spr.features if not f.startswith("amx")))
    assert _task(weight_module(16, 32, 64, "bf16", "f32", b), no_amx).name == plain
    assert _task(weight_module(16, 32, 64, "bf16", "f32", b), spr).name == "matmul_packed_16x32x32x2_bf16_f32"
    for t in (spr, no_amx):
        assert _task(weight_module(16, 32, 64, "i8", "i32", _weights(64, 32, "i8")), t).name == "matmul_packed_16x32x16x4_i8_i32"
    assert _task(weight_module(16, 32, 64, "bf16", "f32", None), ZNVER4).name == plain  # B an argument
    assert _task(weight_module(16, 40, 64, "bf16", "f32", _weights(64, 40, "bf16")), ZNVER4).name == "matmul_16x40x64_bf16_f32"


def _packed_sketches(src: str, target: Target):
    task = _task(src, target)
    return task, [s for s in generate_sketches(task.mlir, target) if s.name.startswith("cpu-dot-product")]


def test_packed_sketches_do_not_pack_again():
    # int8: B in quads, [k / 4, n, 4]; a copy of its tile or B read in place
    _, sketches = _packed_sketches(weight_module(64, 64, 64, "i8", "i32", _weights(64, 64, "i8")), ZNVER4)
    assert {s.name for s in sketches} == {"cpu-dot-product-8x32", "cpu-dot-product-4x64"}
    assert all({k.name for k in s.knobs} == {"p_d0", "p_d1", "k_d2", "pack"} for s in sketches)
    assert all("transform.structured.pack " not in s.script for s in sketches)
    # bf16: pairs in column panels of 32, [n / 32, k / 2, 32, 2] (loops m,
    # panel, column, pair, element): threads over rows and panels, B read in
    # place, a register tile a panel wide
    task, sketches = _packed_sketches(weight_module(64, 64, 64, "bf16", "f32", _weights(64, 64, "bf16")), ZNVER4)
    assert task.name == "matmul_packed_64x2x32x32x2_bf16_f32"
    assert [i.shape for i in task.inputs] == [(64, 32, 2), (2, 32, 32, 2)] and task.outputs[0].shape == (64, 2, 32)
    assert [s.name for s in sketches] == ["cpu-dot-product-8x32"]
    assert {k.name for k in sketches[0].knobs} == {"p_d0", "p_d1", "p_d2", "k_d3"}
    assert "transform.structured.pack " not in sketches[0].script


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
    # Zen 4's sketches (they run on any host with the instruction): a host
    # with AMX packs bf16 for `cpu-amx` instead (`test_amx.py`).
    task, sketches = _packed_sketches(weight_module(m, n, k, ins, out, b.astype(np.float64)), Target.cpu("znver4", cores=2))
    g = task.inputs[0].shape[-1]
    (sketch,) = [s for s in sketches if s.name.endswith("8x32")]
    so = str(tmp_path / "k.so")
    build(sketch.payload, sketch.concrete(default_assignment(sketch, 2)), 2, so)
    a3 = a.reshape(m, k // g, g)
    if len(task.inputs[1].shape) == 4:  # bf16 in column panels: [n / w, k / g, w, g]
        w = task.inputs[1].shape[2]
        bp = b.reshape(k // g, g, n // w, w).transpose(2, 0, 3, 1).copy()
    else:  # [k / g, n, g]
        bp = b.reshape(k // g, g, n).transpose(0, 2, 1).copy()
    got = aligned_full(task.outputs[0].shape, np.float32 if out == "f32" else np.int32, 0)
    kernel = Kernel(so)
    try:
        kernel.bind([aligned_copy(a3), aligned_copy(bp), got])()
    finally:
        kernel.close()
    _check(got.reshape(m, n), a, b, ins)


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


def _mlp(m: int, k: int, n: int, seed: int = 7):
    """relu(x @ W1 + b1) @ W2, then y + y: W1, b1 and W2 dense constants."""
    rng = np.random.default_rng(seed)
    w1, b1, w2 = rng.uniform(-1, 1, (k, n)), rng.uniform(-1, 1, n), rng.uniform(-1, 1, (n, n))

    def dense(a: np.ndarray) -> str:
        return f'dense<"0x{a.astype(np.float32).tobytes().hex().upper()}">'

    t, tn = f"tensor<{m}x{n}xf32>", f"tensor<{n}x{n}xf32>"
    src = f"""
#id = affine_map<(d0, d1) -> (d0, d1)>
#col = affine_map<(d0, d1) -> (d1)>
func.func @mlp(%x: tensor<{m}x{k}xf32>) -> {t} {{
  %w1 = arith.constant {dense(w1)} : tensor<{k}x{n}xf32>
  %b1 = arith.constant {dense(b1)} : tensor<{n}xf32>
  %w2 = arith.constant {dense(w2)} : {tn}
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : {t}
  %c = linalg.fill ins(%z : f32) outs(%e : {t}) -> {t}
  %h = linalg.matmul ins(%x, %w1 : tensor<{m}x{k}xf32>, tensor<{k}x{n}xf32>) outs(%c : {t}) -> {t}
  %hb = linalg.generic {{indexing_maps = [#id, #col, #id], iterator_types = ["parallel", "parallel"]}}
      ins(%h, %b1 : {t}, tensor<{n}xf32>) outs(%e : {t}) {{
  ^bb0(%v: f32, %b: f32, %o: f32):
    %s = arith.addf %v, %b : f32
    %r = arith.maximumf %s, %z : f32
    linalg.yield %r : f32
  }} -> {t}
  %y = linalg.matmul ins(%hb, %w2 : {t}, {tn}) outs(%c : {t}) -> {t}
  %yy = linalg.generic {{indexing_maps = [#id, #id, #id], iterator_types = ["parallel", "parallel"]}}
      ins(%y, %y : {t}, {t}) outs(%e : {t}) {{
  ^bb0(%v: f32, %u: f32, %o: f32):
    %s = arith.addf %v, %u : f32
    linalg.yield %s : f32
  }} -> {t}
  return %yy : {t}
}}
"""
    f32 = np.float32
    want = lambda x: 2 * (np.maximum(x @ w1.astype(f32) + b1.astype(f32), 0) @ w2.astype(f32))  # noqa: E731
    return src, want


@pytest.mark.parametrize("target, width", [(ZNVER4, 32), (ZNVER3, 16)])
def test_f32_weights_are_read_in_column_panels_with_their_epilogue(target, width):
    """An f32 matmul with a constant B reads it as [n / w, k, w] (w: two
    vectors); the bias and ReLU after it (and the y + y after the second)
    are rewritten over the same loops and stay in its task."""
    m, k, n = 16, 64, 64
    src, _ = _mlp(m, k, n)
    tasks = extract_tasks(load(text=src), prepack=weight_packing(target))
    assert [t.name for t in tasks] == [
        f"contraction_{m}x{n // width}x{width}x{k}_f32_generic",
        f"contraction_{m}x{n // width}x{width}x{n}_f32_add",
    ]
    filecheck(tasks[0].mlir, f"""
        CHECK: func.func @kernel(%{{{{.*}}}}: tensor<{m}x{k}xf32>, %{{{{.*}}}}: tensor<{n // width}x{k}x{width}xf32>, %{{{{.*}}}}: tensor<{n // width}x{width}xf32>) -> tensor<{m}x{n // width}x{width}xf32>
        CHECK: linalg.generic {{indexing_maps = [#map, #map1, #map2], iterator_types = ["parallel", "parallel", "parallel", "reduction"]}}
        CHECK: arith.mulf
        CHECK: arith.addf
        CHECK: linalg.generic
        CHECK-SAME: ansor.fused
        CHECK: arith.addf
        CHECK: arith.maximumf
    """)
    assert "#map1 = affine_map<(d0, d1, d2, d3) -> (d1, d3, d2)>" in tasks[0].mlir
    # The register rows are m (d0), which B's panels do not index, the
    # vector the panel's columns (d2); not panels x columns.
    (sketch,) = [s for s in generate_sketches(tasks[0].mlir, target) if s.name == "cpu-contraction"]
    names = {kn.name for kn in sketch.knobs}
    assert {"r_d0", "r_d2"} <= names and "r_d1" not in names
    # B as it is with no target, with B an argument, and where a named
    # elementwise op follows (the panels would cut it off the task)
    assert [t.name for t in extract_tasks(load(text=src))] == [f"matmul_{m}x{n}x{k}_f32_generic", f"matmul_{m}x{n}x{n}_f32_add"]
    assert _task(weight_module(16, 64, 64, "f32", "f32", None), target).name == "matmul_16x64x64_f32"
    named = weight_module(16, 64, 64, "f32", "f32", _weights(64, 64, "f32")).replace(
        "  return %r : tensor<16x64xf32>",
        "  %s = linalg.add ins(%r, %r : tensor<16x64xf32>, tensor<16x64xf32>) outs(%e : tensor<16x64xf32>) -> tensor<16x64xf32>\n"
        "  return %s : tensor<16x64xf32>",
    )
    assert _task(named, target).name == "matmul_16x64x64_f32_add"


def test_compiled_module_with_weight_panels(tmp_path):
    """The panels are folded at compile time and the module computes the MLP."""
    from mlir_ansor import compile  # noqa: A004

    src, want = _mlp(16, 64, 64)
    cm = compile(load(text=src))
    assert [p.task.name.split("_")[0] for p in cm.kernels] == ["contraction", "contraction"]
    x = np.random.default_rng(8).uniform(-1, 1, (16, 64)).astype(np.float32)
    np.testing.assert_allclose(cm(x), want(x), rtol=1e-4, atol=1e-4)


def test_a_bf16_result_is_rounded_in_its_panelled_task():
    """A bf16 matmul with a bf16 result accumulates in f32 and rounds in an
    elementwise truncf (`graph.precision`), which changes the element type:
    the panels are carried through it and it stays in the matmul's task."""
    src = weight_module(16, 64, 64, "bf16", "f32", _weights(64, 64, "bf16"))
    src = src.replace("tensor<16x64xf32>", "tensor<16x64xbf16>").replace("arith.constant 0.0 : f32", "arith.constant 0.0 : bf16")
    src = src.replace("%z : f32", "%z : bf16")
    task = _task(src, ZNVER4)
    assert task.name == "matmul_packed_16x2x32x32x2_bf16_f32_truncf"
    assert task.outputs[0].shape == (16, 2, 32) and task.outputs[0].dtype == "bf16"
    filecheck(task.mlir, """
        CHECK: iterator_types = ["parallel", "parallel", "parallel", "reduction", "reduction"]
        CHECK: linalg.generic
        CHECK-SAME: ansor.fused
        CHECK: arith.truncf
    """)
