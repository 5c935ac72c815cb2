"""Tensorized contractions: the `cpu-dot-product` sketches (bf16 onto
vdpbf16ps, int8 onto vpdpwssd), the rewrites behind them
(`passes.vector_flatten`, `passes.dot_products`), object code built for a
named CPU on any host, and results checked where the host can run them."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import filecheck
from mlir import ir

from mlir_ansor.graph.task import extract_tasks
from mlir_ansor.ir.program import load
from mlir_ansor.measure.builder import build
from mlir_ansor.measure.runner import Kernel, aligned_copy, aligned_full
from mlir_ansor.passes.dot_products import lower_pair_contracts
from mlir_ansor.passes.lowering import lower_to_llvm
from mlir_ansor.passes.objcode import emit_object, instruction_counts
from mlir_ansor.passes.vector_flatten import flatten_contiguous_transfers
from mlir_ansor.schedule.apply import apply_schedule
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.search.sketch import default_assignment
from mlir_ansor.target import Target

ZNVER4 = Target.cpu("znver4", cores=1)
ZNVER3 = Target.cpu("znver3", cores=1)


def matmul(m: int, n: int, k: int, ins: str, out: str, ext: str = "") -> str:
    zero = "0.0" if out.startswith(("f", "bf")) else "0"
    if not ext:
        body = f"""linalg.matmul ins(%a, %b : tensor<{m}x{k}x{ins}>, tensor<{k}x{n}x{ins}>) outs(%c : tensor<{m}x{n}x{out}>) -> tensor<{m}x{n}x{out}>"""
    else:  # the same as a generic with an explicit widening
        body = f"""linalg.generic {{indexing_maps = [affine_map<(i, j, l) -> (i, l)>, affine_map<(i, j, l) -> (l, j)>, affine_map<(i, j, l) -> (i, j)>], iterator_types = ["parallel", "parallel", "reduction"]}} ins(%a, %b : tensor<{m}x{k}x{ins}>, tensor<{k}x{n}x{ins}>) outs(%c : tensor<{m}x{n}x{out}>) {{
    ^bb0(%x: {ins}, %y: {ins}, %acc: {out}):
      %xe = {ext} %x : {ins} to {out}
      %ye = {ext} %y : {ins} to {out}
      %p = arith.muli %xe, %ye : {out}
      %s = arith.addi %acc, %p : {out}
      linalg.yield %s : {out}
    }} -> tensor<{m}x{n}x{out}>"""
    return f"""
func.func @mm(%a: tensor<{m}x{k}x{ins}>, %b: tensor<{k}x{n}x{ins}>) -> tensor<{m}x{n}x{out}> {{
  %z = arith.constant {zero} : {out}
  %e = tensor.empty() : tensor<{m}x{n}x{out}>
  %c = linalg.fill ins(%z : {out}) outs(%e : tensor<{m}x{n}x{out}>) -> tensor<{m}x{n}x{out}>
  %r = {body}
  return %r : tensor<{m}x{n}x{out}>
}}
"""


def conv(ins: str, out: str, hw: int = 10, c: int = 32, f: int = 32) -> str:
    """A 3x3 NHWC convolution without strides or dilations attributes (their
    default, 1)."""
    zero = "0.0" if out.startswith("f") else "0"
    x, w, o = f"tensor<1x{hw + 2}x{hw + 2}x{c}x{ins}>", f"tensor<3x3x{c}x{f}x{ins}>", f"tensor<1x{hw}x{hw}x{f}x{out}>"
    return f"""
func.func @cv(%x: {x}, %w: {w}) -> {o} {{
  %z = arith.constant {zero} : {out}
  %e = tensor.empty() : {o}
  %c = linalg.fill ins(%z : {out}) outs(%e : {o}) -> {o}
  %r = linalg.conv_2d_nhwc_hwcf ins(%x, %w : {x}, {w}) outs(%c : {o}) -> {o}
  return %r : {o}
}}
"""


def batch_matmul(b: int, m: int, n: int, k: int, ins: str, out: str) -> str:
    zero = "0.0" if out.startswith("f") else "0"
    x, y, o = f"tensor<{b}x{m}x{k}x{ins}>", f"tensor<{b}x{k}x{n}x{ins}>", f"tensor<{b}x{m}x{n}x{out}>"
    return f"""
func.func @bmm(%a: {x}, %b: {y}) -> {o} {{
  %z = arith.constant {zero} : {out}
  %e = tensor.empty() : {o}
  %c = linalg.fill ins(%z : {out}) outs(%e : {o}) -> {o}
  %r = linalg.batch_matmul ins(%a, %b : {x}, {y}) outs(%c : {o}) -> {o}
  return %r : {o}
}}
"""


def dot_sketches(src: str, target: Target):
    (task,) = extract_tasks(load(text=src))
    return [s for s in generate_sketches(task.mlir, target) if s.name.startswith("cpu-dot-product")]


def test_sketches_where_the_instruction_is():
    bf16 = dot_sketches(matmul(64, 64, 64, "bf16", "f32"), ZNVER4)
    i8 = dot_sketches(matmul(64, 64, 64, "i8", "i32"), ZNVER4)
    assert {s.name for s in bf16} == {"cpu-dot-product-8x32", "cpu-dot-product-4x64"}
    assert {s.name for s in i8} == {s.name for s in bf16}
    assert all({k.name for k in s.knobs} == {"p_d0", "p_d1", "k_d2", "pack"} for s in bf16 + i8)
    # No AVX-512 BF16 (Zen 3; Skylake-X without VNNI for int8), unsigned
    # bytes, f32, odd shapes: none.
    assert dot_sketches(matmul(64, 64, 64, "bf16", "f32"), ZNVER3) == []
    assert dot_sketches(matmul(64, 64, 64, "i8", "i32"), Target.cpu("skylake-avx512", cores=1)) == []
    # AVX2 alone: int8 on 8 lanes (vpmaddwd and an add).
    assert {s.name for s in dot_sketches(matmul(64, 64, 64, "i8", "i32"), ZNVER3)} == {
        "cpu-dot-product-4x16", "cpu-dot-product-2x32"}
    assert dot_sketches(matmul(64, 64, 64, "i8", "i32", ext="arith.extui"), ZNVER4) == []
    assert dot_sketches(matmul(64, 64, 64, "f32", "f32"), ZNVER4) == []
    assert dot_sketches(matmul(64, 64, 63, "bf16", "f32"), ZNVER4) == []  # k not in pairs
    assert dot_sketches(matmul(64, 40, 64, "bf16", "f32"), ZNVER4) == []  # n not in vectors
    # The generic form with an explicit widening is the same op.
    assert {s.name for s in dot_sketches(matmul(64, 64, 64, "i8", "i32", ext="arith.extsi"), ZNVER4)} == {s.name for s in i8}


def test_no_bf16_sketch_where_the_core_runs_it_slower_than_fmas(tmp_path):
    """Sapphire / Emerald Rapids run vdpbf16ps at half the FMAs' rate
    (`Target.dot_rate`): a bf16 matmul gets no dot-product sketch there and
    `cpu-contraction` computes it in f32 (widened loads, FMAs); int8 keeps
    its vpdpbusd sketches. A core the table does not know gets the nominal
    rate, and the sketch."""
    spr = Target.cpu("sapphirerapids", cores=1)
    src = matmul(64, 64, 64, "bf16", "f32")
    assert dot_sketches(src, spr) == []
    assert {s.name for s in dot_sketches(matmul(64, 64, 64, "i8", "i32"), spr)} == {"cpu-dot-product-8x32", "cpu-dot-product-4x64"}
    unknown = Target("cpu", 512, 1, "t", spr.features)
    assert unknown.core == "" and len(dot_sketches(src, unknown)) == 2
    (task,) = extract_tasks(load(text=src))
    sketch = next(s for s in generate_sketches(task.mlir, spr) if s.name.startswith("cpu-contraction"))
    with ir.Context(), ir.Location.unknown():
        module = apply_schedule(sketch.payload, sketch.concrete(default_assignment(sketch, 1)))
        lower_to_llvm(module, 1)
        obj = emit_object(module, tmp_path / "k.o", cpu="sapphirerapids")
    counts = instruction_counts(obj, ["vdpbf16ps", "vfmadd231ps"])
    assert counts["vdpbf16ps"] == 0 and counts["vfmadd231ps"] > 0


def test_convolution_sketches():
    """A unit-stride NHWC convolution gets them too (its output row is the
    register tile's rows); a strided one, an odd channel count do not."""
    names = {s.name for s in dot_sketches(conv("bf16", "f32", hw=8), ZNVER4)}
    assert names == {"cpu-dot-product-8x32"}  # 32 channels: no 64-wide tile
    assert {s.name for s in dot_sketches(conv("i8", "i32", hw=8, f=64), ZNVER4)} == {"cpu-dot-product-8x32", "cpu-dot-product-4x64"}
    assert dot_sketches(conv("bf16", "f32", hw=8, c=31), ZNVER4) == []
    strided = conv("bf16", "f32", hw=8).replace("linalg.conv_2d_nhwc_hwcf ins", "linalg.conv_2d_nhwc_hwcf {strides = dense<2> : tensor<2xi64>} ins")
    strided = strided.replace("tensor<1x10x10x32xbf16>", "tensor<1x17x17x32xbf16>")
    assert dot_sketches(strided, ZNVER4) == []


def _object_for(src: str, tmp_path, cpu: str = "znver4") -> dict[str, int]:
    target = Target.cpu(cpu, cores=1)
    (sketch,) = [s for s in dot_sketches(src, target) if s.name.endswith("8x32" if target.vector_bits == 512 else "4x16")]
    script = sketch.concrete(default_assignment(sketch, 1))
    with ir.Context(), ir.Location.unknown():
        module = apply_schedule(sketch.payload, script)
        lower_to_llvm(module, 1)
        obj = emit_object(module, tmp_path / "k.o", cpu=cpu)
    return instruction_counts(obj, ["vdpbf16ps", "vpdpwssd", "vpdpbusd", "vpmaddwd", "vfmadd231ps", "vpmulld"])


def test_bf16_object_code_for_znver4(tmp_path):
    counts = _object_for(matmul(64, 64, 64, "bf16", "f32"), tmp_path)
    assert counts["vdpbf16ps"] == 16  # 8 rows x 2 vectors, unrolled
    assert counts["vfmadd231ps"] == 0


def test_int8_object_code_for_znver4(tmp_path):
    """Quads of bytes (512-bit VNNI): 16 vpdpbusd and the 2 corrections of
    the unsigned operand, one per B vector, shared by the 8 rows."""
    counts = _object_for(matmul(64, 64, 64, "i8", "i32"), tmp_path)
    assert counts["vpdpbusd"] == 18
    assert counts["vpmulld"] == counts["vpdpwssd"] == 0


def test_int8_object_code_for_avx2(tmp_path):
    """Zen 3 (AVX2, no VNNI): 4 rows x 2 vectors of vpmaddwd."""
    counts = _object_for(matmul(64, 64, 64, "i8", "i32"), tmp_path, cpu="znver3")
    assert counts["vpmaddwd"] == 8 and counts["vpdpwssd"] == 0 and counts["vpmulld"] == 0


@pytest.mark.parametrize("ins, out, instruction, count", [("bf16", "f32", "vdpbf16ps", 16), ("i8", "i32", "vpdpbusd", 18)])
def test_convolution_object_code_for_znver4(tmp_path, ins, out, instruction, count):
    counts = _object_for(conv(ins, out, hw=8), tmp_path)
    assert counts[instruction] == count


@pytest.mark.parametrize("ins, out, instruction, count", [("bf16", "f32", "vdpbf16ps", 16), ("i8", "i32", "vpdpbusd", 18)])
def test_batch_matmul_object_code_for_znver4(tmp_path, ins, out, instruction, count):
    counts = _object_for(batch_matmul(3, 16, 32, 64, ins, out), tmp_path)
    assert counts[instruction] == count


def _host_runs(feature: str) -> None:
    if not Target.host().has(feature):
        pytest.skip(f"this host has no {feature}: the object code is checked for znver4 instead")


@pytest.mark.parametrize("ins, out", [("bf16", "f32"), ("i8", "i32")])
def test_convolution_results(tmp_path, ins, out):
    _host_runs("avx512_bf16" if ins == "bf16" else "avx512_vnni")
    import ml_dtypes
    import torch

    rng = np.random.default_rng(2)
    if ins == "bf16":
        x = rng.uniform(-1, 1, (1, 10, 10, 32)).astype(ml_dtypes.bfloat16)
        w = rng.uniform(-1, 1, (3, 3, 32, 32)).astype(ml_dtypes.bfloat16)
    else:
        x = rng.integers(-128, 128, (1, 10, 10, 32)).astype(np.int8)
        w = rng.integers(-128, 128, (3, 3, 32, 32)).astype(np.int8)
    got = _run_default(conv(ins, out, hw=8), tmp_path, [x, w], (1, 8, 8, 32), np.float32 if out == "f32" else np.int32)
    want = torch.nn.functional.conv2d(
        torch.from_numpy(x.astype(np.float64)).permute(0, 3, 1, 2), torch.from_numpy(w.astype(np.float64)).permute(3, 2, 0, 1)
    ).permute(0, 2, 3, 1).numpy()
    if out == "i32":
        assert np.array_equal(got, want.astype(np.int64))  # exact in float64 at these sizes
    else:
        assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-5


def _run_default(src: str, tmp_path, inputs: list[np.ndarray], out_shape, out_dtype, *, target: Target | None = None,
                 sketch_name: str = "cpu-dot-product-8x32") -> np.ndarray:
    (task,) = extract_tasks(load(text=src))
    # Zen 4's sketches by default: they run on any host with the instruction
    # (Sapphire Rapids has vdpbf16ps but gets no bf16 sketch of this rule).
    (sketch,) = [s for s in generate_sketches(task.mlir, target or Target.cpu("znver4", cores=2)) if s.name == sketch_name]
    so = str(tmp_path / "k.so")
    build(sketch.payload, sketch.concrete(default_assignment(sketch, 2)), 2, so)
    kernel = Kernel(so)
    try:
        out = aligned_full(out_shape, out_dtype, 0)
        kernel.bind([aligned_copy(a) for a in inputs] + [out])()
    finally:
        kernel.close()
    return out


def test_bf16_results(tmp_path):
    _host_runs("avx512_bf16")
    import ml_dtypes

    rng = np.random.default_rng(0)
    a = rng.uniform(-1, 1, (64, 128)).astype(ml_dtypes.bfloat16)
    b = rng.uniform(-1, 1, (128, 96)).astype(ml_dtypes.bfloat16)
    out = _run_default(matmul(64, 96, 128, "bf16", "f32"), tmp_path, [a, b], (64, 96), np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) < 1e-5  # f32 accumulation of exact products


def test_int8_results_are_exact(tmp_path):
    _host_runs("avx512_vnni")
    rng = np.random.default_rng(1)
    # The extremes too: -128 * -128 pairs are what a 16-bit product must hold.
    a = rng.integers(-128, 128, (64, 256)).astype(np.int8)
    b = rng.integers(-128, 128, (256, 64)).astype(np.int8)
    a[0, :] = -128
    b[:, 0] = -128
    out = _run_default(matmul(64, 64, 256, "i8", "i32"), tmp_path, [a, b], (64, 64), np.int32)
    assert np.array_equal(out, a.astype(np.int64) @ b.astype(np.int64))


@pytest.mark.parametrize("ins, out", [("bf16", "f32"), ("i8", "i32")])
def test_batch_matmul_results(tmp_path, ins, out):
    _host_runs("avx512_bf16" if ins == "bf16" else "avx512_vnni")
    import ml_dtypes

    rng = np.random.default_rng(4)
    if ins == "bf16":
        a = rng.uniform(-1, 1, (3, 16, 64)).astype(ml_dtypes.bfloat16)
        b = rng.uniform(-1, 1, (3, 64, 32)).astype(ml_dtypes.bfloat16)
    else:
        a = rng.integers(-128, 128, (3, 16, 64)).astype(np.int8)
        b = rng.integers(-128, 128, (3, 64, 32)).astype(np.int8)
    got = _run_default(batch_matmul(3, 16, 32, 64, ins, out), tmp_path, [a, b], (3, 16, 32), np.float32 if out == "f32" else np.int32)
    if out == "i32":
        assert np.array_equal(got, a.astype(np.int64) @ b.astype(np.int64))
    else:
        want = a.astype(np.float64) @ b.astype(np.float64)
        assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-5


def test_int8_avx2_schedule_results_are_exact(tmp_path):
    """The 8-lane (AVX2) schedule, built for this host: it runs wherever AVX2 does."""
    _host_runs("avx2")
    rng = np.random.default_rng(3)
    a = rng.integers(-128, 128, (64, 128)).astype(np.int8)
    b = rng.integers(-128, 128, (128, 64)).astype(np.int8)
    out = _run_default(matmul(64, 64, 128, "i8", "i32"), tmp_path, [a, b], (64, 64), np.int32,
                       target=ZNVER3, sketch_name="cpu-dot-product-4x16")
    assert np.array_equal(out, a.astype(np.int64) @ b.astype(np.int64))


def mixed(m: int, n: int, k: int, unsigned: str) -> str:
    """An int8 matmul whose `unsigned` operand ("a" or "b") is unsigned
    bytes (``arith.extui`` in the body), the other signed."""
    src = matmul(m, n, k, "i8", "i32", ext="arith.extsi")
    var = "%xe" if unsigned == "a" else "%ye"
    return src.replace(f"{var} = arith.extsi", f"{var} = arith.extui")


def test_unsigned_bytes_sketches_and_object_code(tmp_path):
    """One unsigned operand is what vpdpbusd takes as it is: the sketches
    are those of signed int8, and the quads need no sign flip and no
    correction (16 vpdpbusd for the 8 x 32 tile, not 18, and no vpsubd);
    two unsigned operands get none."""
    names = {s.name for s in dot_sketches(matmul(64, 64, 64, "i8", "i32"), ZNVER4)}
    for unsigned in ("a", "b"):
        src = mixed(64, 64, 64, unsigned)
        assert {s.name for s in dot_sketches(src, ZNVER4)} == names
        counts = _object_for(src, tmp_path)
        assert counts["vpdpbusd"] == 16 and counts["vpmulld"] == 0
        assert instruction_counts(tmp_path / "k.o", ["vpsubd"]) == {"vpsubd": 0}
    assert _object_for(mixed(64, 64, 64, "a"), tmp_path, cpu="znver3")["vpmaddwd"] == 8
    assert dot_sketches(matmul(64, 64, 64, "i8", "i32", ext="arith.extui"), ZNVER4) == []


@pytest.mark.parametrize("unsigned, target, sketch_name, feature", [
    ("a", None, "cpu-dot-product-8x32", "avx512_vnni"),
    ("b", None, "cpu-dot-product-8x32", "avx512_vnni"),
    ("a", ZNVER3, "cpu-dot-product-4x16", "avx2"),
])
def test_unsigned_bytes_results_are_exact(tmp_path, unsigned, target, sketch_name, feature):
    _host_runs(feature)
    rng = np.random.default_rng(4)
    u = rng.integers(0, 256, (64, 128) if unsigned == "a" else (128, 64)).astype(np.uint8)
    s8 = rng.integers(-128, 128, (128, 64) if unsigned == "a" else (64, 128)).astype(np.int8)
    u[0, :] = 255  # the extremes: 255 * -128 pairs and quads
    s8[:, 0] = -128
    a, b = (u, s8) if unsigned == "a" else (s8, u)
    out = _run_default(mixed(64, 64, 128, unsigned), tmp_path, [a.view(np.int8), b.view(np.int8)], (64, 64), np.int32,
                       target=target, sketch_name=sketch_name)
    assert np.array_equal(out, a.astype(np.int64) @ b.astype(np.int64))


FLATTEN = """
func.func @f(%m: memref<64x128x2xbf16>, %s: memref<64x128x2xbf16, strided<[512, 4, 1]>>, %i: index, %j: index) -> (vector<16x2xbf16>, vector<16x2xbf16>) {
  %c0 = arith.constant 0 : index
  %p = ub.poison : bf16
  %0 = vector.transfer_read %m[%i, %j, %c0], %p {in_bounds = [true, true]} : memref<64x128x2xbf16>, vector<16x2xbf16>
  %1 = vector.transfer_read %s[%i, %j, %c0], %p {in_bounds = [true, true]} : memref<64x128x2xbf16, strided<[512, 4, 1]>>, vector<16x2xbf16>
  vector.transfer_write %0, %m[%j, %i, %c0] {in_bounds = [true, true]} : vector<16x2xbf16>, memref<64x128x2xbf16>
  return %0, %1 : vector<16x2xbf16>, vector<16x2xbf16>
}
"""


def test_contiguous_transfers_become_one_d():
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(FLATTEN)
        # The strided buffer (pairs 4 elements apart) is not contiguous: left.
        assert flatten_contiguous_transfers(module) == 2
        module.operation.verify()
        filecheck(
            str(module),
            """
            CHECK: memref.collapse_shape %{{.*}} {{\\[}}[0], [1, 2]] : memref<64x128x2xbf16> into memref<64x256xbf16>
            CHECK: vector.transfer_read {{.*}} : memref<64x256xbf16>, vector<32xbf16>
            CHECK: vector.shape_cast {{.*}} : vector<32xbf16> to vector<16x2xbf16>
            CHECK: vector.transfer_read {{.*}} strided<[512, 4, 1]>>, vector<16x2xbf16>
            CHECK: vector.shape_cast {{.*}} : vector<16x2xbf16> to vector<32xbf16>
            CHECK: vector.transfer_write {{.*}} : vector<32xbf16>, memref<64x256xbf16>
            """,
        )


def test_a_broadcast_read_is_left_as_it_is():
    """A bias read as the rows of a tile (``(d0) -> (0, d0)``: more results
    than dimensions) is no contiguous n-D read; it aborted the process
    (`AffineMap::getMinorIdentityMap`'s assertion) before it was checked."""
    text = """
func.func @f(%b: memref<768xf32>, %j: index) -> vector<1x16xf32> {
  %p = ub.poison : f32
  %0 = vector.transfer_read %b[%j], %p {in_bounds = [true, true], permutation_map = affine_map<(d0) -> (0, d0)>} : memref<768xf32>, vector<1x16xf32>
  return %0 : vector<1x16xf32>
}
"""
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        assert flatten_contiguous_transfers(module) == 0


PAIR = """
#a = affine_map<(d0, d1, d2, d3) -> (d0, d2, d3)>
#b = affine_map<(d0, d1, d2, d3) -> (d2, d1, d3)>
#c = affine_map<(d0, d1, d2, d3) -> (d0, d1)>
func.func @f(%x: vector<1x1x2xi8>, %y: vector<1x16x2xi8>, %acc: vector<1x16xi32>, %u: vector<1x1x4xi8>, %v: vector<1x16x4xi8>) -> (vector<1x16xi32>, vector<1x16xi32>) {
  %0 = vector.contract {indexing_maps = [#a, #b, #c], iterator_types = ["parallel", "parallel", "reduction", "reduction"], kind = #vector.kind<add>} %x, %y, %acc : vector<1x1x2xi8>, vector<1x16x2xi8> into vector<1x16xi32>
  %1 = vector.contract {indexing_maps = [#a, #b, #c], iterator_types = ["parallel", "parallel", "reduction", "reduction"], kind = #vector.kind<add>} %u, %v, %acc : vector<1x1x4xi8>, vector<1x16x4xi8> into vector<1x16xi32>
  return %0, %1 : vector<1x16xi32>, vector<1x16xi32>
}
"""


def test_int8_pairs_and_quads_become_dot_products():
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(PAIR)
        assert lower_pair_contracts(module) == 2
        module.operation.verify()
        filecheck(
            str(module),
            """
            CHECK: vector.broadcast {{.*}} : i16 to vector<16xi16>
            CHECK: arith.extsi {{.*}} : vector<32xi8> to vector<32xi16>
            CHECK: arith.extsi {{.*}} : vector<32xi8> to vector<32xi16>
            CHECK: llvm.call_intrinsic "llvm.x86.avx512.vpdpwssd.512"
            CHECK: arith.xori {{.*}} : vector<16xi32>
            CHECK: llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"
            CHECK: llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"
            CHECK: arith.subi
            CHECK-NOT: vector.contract
            """,
        )


QUAD_LOOP = """
#a = affine_map<(d0, d1, d2, d3) -> (d0, d2, d3)>
#b = affine_map<(d0, d1, d2, d3) -> (d2, d1, d3)>
#c = affine_map<(d0, d1, d2, d3) -> (d0, d1)>
func.func @f(%x: memref<2x8x4xi8>, %y: memref<8x16x4xi8>, %acc0: vector<1x16xi32>, %acc1: vector<1x16xi32>) -> (vector<1x16xi32>, vector<1x16xi32>) {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %c8 = arith.constant 8 : index
  %z = arith.constant 0 : i8
  %r:2 = scf.for %k = %c0 to %c8 step %c1 iter_args(%p = %acc0, %q = %acc1) -> (vector<1x16xi32>, vector<1x16xi32>) {
    %u0 = vector.transfer_read %x[%c0, %k, %c0], %z {in_bounds = [true, true, true]} : memref<2x8x4xi8>, vector<1x1x4xi8>
    %u1 = vector.transfer_read %x[%c1, %k, %c0], %z {in_bounds = [true, true, true]} : memref<2x8x4xi8>, vector<1x1x4xi8>
    %v = vector.transfer_read %y[%k, %c0, %c0], %z {in_bounds = [true, true, true]} : memref<8x16x4xi8>, vector<1x16x4xi8>
    %0 = vector.contract {indexing_maps = [#a, #b, #c], iterator_types = ["parallel", "parallel", "reduction", "reduction"], kind = #vector.kind<add>} %u0, %v, %p : vector<1x1x4xi8>, vector<1x16x4xi8> into vector<1x16xi32>
    %1 = vector.contract {indexing_maps = [#a, #b, #c], iterator_types = ["parallel", "parallel", "reduction", "reduction"], kind = #vector.kind<add>} %u1, %v, %q : vector<1x1x4xi8>, vector<1x16x4xi8> into vector<1x16xi32>
    scf.yield %0, %1 : vector<1x16xi32>, vector<1x16xi32>
  }
  return %r#0, %r#1 : vector<1x16xi32>, vector<1x16xi32>
}
"""


def test_int8_quad_correction_leaves_the_loop():
    """Quads carried by a reduction loop: inside it, one vpdpbusd per
    accumulator and one per B vector for the correction (shared by both rows,
    carried in a third iter_arg); the subtraction happens once, after it."""
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(QUAD_LOOP)
        assert lower_pair_contracts(module) == 2
        module.operation.verify()
        filecheck(
            str(module),
            """
            CHECK: scf.for {{.*}} iter_args({{.*}}, {{.*}}, %[[S:.*]] = %{{.*}}) -> (vector<1x16xi32>, vector<1x16xi32>, vector<16xi32>)
            CHECK-COUNT-3: llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"
            CHECK-NOT: arith.subi
            CHECK: scf.yield
            CHECK-NOT: vpdpbusd
            CHECK: arith.subi
            CHECK: arith.subi
            CHECK-NOT: vector.contract
            """,
        )
