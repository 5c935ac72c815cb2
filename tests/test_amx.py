"""bf16 matmuls on AMX tiles: the `cpu-amx` sketches, the micro-kernels
`passes.amx` puts in their register tiles, object code built for Sapphire
Rapids on any host, and results checked where the host has AMX."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
from mlir import ir
from test_dot_product import batch_matmul, conv, matmul, mixed

from mlir_ansor.errors import AnsorError
from mlir_ansor.graph.task import extract_tasks
from mlir_ansor.ir.program import load
from mlir_ansor.measure.builder import build
from mlir_ansor.measure.runner import Kernel, aligned_copy, aligned_full
from mlir_ansor.passes.amx import amx_microkernels, request_amx
from mlir_ansor.passes.lowering import lower_to_llvm
from mlir_ansor.passes.objcode import emit_object, instruction_counts
from mlir_ansor.schedule.apply import apply_schedule
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.search.rules.dot_product import weight_packing
from mlir_ansor.search.sketch import default_assignment
from mlir_ansor.target import Target

SPR = Target.cpu("sapphirerapids", cores=2)
ZNVER4 = Target.cpu("znver4", cores=2)


def amx_sketches(src: str, target: Target = SPR, prepack=None):
    (task,) = [t for t in extract_tasks(load(text=src), prepack=prepack) if t.kind in ("contraction", "convolution")]
    return [s for s in generate_sketches(task.mlir, target) if s.name.startswith("cpu-amx")]


def _knobs(sketch, threads: int, **fixed) -> tuple:
    knobs = dict(default_assignment(sketch, threads))
    knobs.update(fixed)
    return tuple(sorted(knobs.items()))


_PRODUCTS = ("tdpbf16ps", "tdpbssd", "tdpbusd", "tdpbsud")


def _run(tmp_path, sketch, threads: int, inputs: list, out_shape, out_dtype, **fixed) -> np.ndarray:
    """Build `sketch` at its default knobs (`fixed` overriding), check that
    its products are on the tiles (not left to loops), run it on `inputs`."""
    so = str(tmp_path / f"{sketch.name}-{threads}-{fixed.get('pack', '')}.so")
    build(sketch.payload, sketch.concrete(_knobs(sketch, threads, **fixed)), threads, so)
    assert sum(instruction_counts(so, list(_PRODUCTS)).values()) > 0
    kernel = Kernel(so)
    try:
        out = aligned_full(out_shape, out_dtype, 7)  # the kernel's fill overwrites it
        kernel.bind([aligned_copy(x) for x in inputs] + [out])()
    finally:
        kernel.close()
    return out


def test_sketches_where_the_cpu_has_amx():
    """One sketch per register tile that fits; none without AMX, none for
    f32, none where the extents are not whole tiles."""
    assert [s.name for s in amx_sketches(matmul(64, 64, 64, "bf16", "f32"))] == ["cpu-amx-2x2", "cpu-amx-1x4", "cpu-amx-4x1"]
    assert [s.name for s in amx_sketches(matmul(32, 48, 64, "bf16", "f32"))] == ["cpu-amx-2x1"]
    assert amx_sketches(matmul(64, 64, 64, "bf16", "f32"), ZNVER4) == []
    assert amx_sketches(matmul(64, 64, 64, "f32", "f32")) == []
    assert amx_sketches(matmul(64, 64, 48, "bf16", "f32")) == []  # k not whole steps of 32
    assert amx_sketches(matmul(24, 64, 64, "bf16", "f32")) == []
    (sk, *_) = amx_sketches(matmul(64, 64, 1024, "bf16", "f32"))
    (k,) = [s for s in sk.knobs if s.name.startswith("k_")]
    assert set(k.options) == {16, 32, 64, 128, 256, 512}  # whole steps, at most 32 of them


def test_a_constant_b_is_packed_in_pairs_for_amx():
    """`weight_packing` packs a constant bf16 B in pairs (no column panels)
    where the rule takes the matmul; the packed matmul gets the sketches."""
    decide = weight_packing(SPR)
    assert decide("bf16", "f32", 64, 64, 64) == 2
    assert decide("bf16", "f32", 64, 64, 48) is None  # vdpbf16ps is slower than FMAs there: no packing
    src = """
func.func @lin(%a: tensor<32x64xbf16>) -> tensor<32x64xf32> {
  %w = arith.constant dense<0.5> : tensor<64x64xbf16>
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<32x64xf32>
  %c = linalg.fill ins(%z : f32) outs(%e : tensor<32x64xf32>) -> tensor<32x64xf32>
  %r = linalg.matmul ins(%a, %w : tensor<32x64xbf16>, tensor<64x64xbf16>) outs(%c : tensor<32x64xf32>) -> tensor<32x64xf32>
  return %r : tensor<32x64xf32>
}
"""
    names = [s.name for s in amx_sketches(src, prepack=decide)]
    assert names == ["cpu-amx-2x2", "cpu-amx-1x4"]


def _object(src: str, tmp_path, name: str, **fixed) -> dict[str, int]:
    (sketch,) = [s for s in amx_sketches(src) if s.name == name]
    with ir.Context(), ir.Location.unknown():
        module = apply_schedule(sketch.payload, sketch.concrete(_knobs(sketch, 1, **fixed)))
        lower_to_llvm(module, 1)
        obj = emit_object(module, tmp_path / "k.o", cpu="sapphirerapids")
    return instruction_counts(obj, ["tdpbf16ps", "tileloadd", "tilestored", "vdpbf16ps", "vfmadd231ps"])


def test_object_code_for_sapphire_rapids(tmp_path):
    """64 x 64 x 128 in one register tile pass of 2 x 2 accumulators over
    a cache tile of 64 pairs: 4 steps x 4 products, each accumulator
    loaded and stored once per cache tile, 2 A and 2 B tiles a step; no
    FMA in the product."""
    counts = _object(matmul(64, 64, 128, "bf16", "f32"), tmp_path, "cpu-amx-2x2", p_d0=64, p_d1=64, k_d2=64, pack=1)
    assert counts["tdpbf16ps"] == 16
    assert counts["tileloadd"] == 4 + 4 * 4
    assert counts["tilestored"] == 4
    assert counts["vdpbf16ps"] == counts["vfmadd231ps"] == 0


def test_convolution_object_code_for_sapphire_rapids(tmp_path):
    """A 3 x 3 convolution, 14 pixels by 64 channels (one row of 14-row
    tiles by four columns), 64 channels in 2 steps of 16 pairs: in the loop
    over the window positions, 2 steps x 4 products, the four accumulators
    loaded and stored around them (at each position)."""
    counts = _object(conv("bf16", "f32", hw=14, c=64, f=64), tmp_path, "cpu-amx-14x64", p_d1=14, p_d3=64, k_d6=32)
    assert counts["tdpbf16ps"] == 2 * 4
    assert counts["tileloadd"] == 4 + 2 * (1 + 4)
    assert counts["tilestored"] == 4
    assert counts["vdpbf16ps"] == counts["vfmadd231ps"] == 0


def test_a_register_tile_the_kernel_cannot_compute_is_an_error():
    text = """
func.func @f(%a: memref<16x16x2xbf16>, %b: memref<16x16x2xbf16>, %c: memref<16x16xf32>) {
  linalg.generic {indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d0, d2, d3)>, affine_map<(d0, d1, d2, d3) -> (d1, d2, d3)>,
                                   affine_map<(d0, d1, d2, d3) -> (d0, d1)>],
                  iterator_types = ["parallel", "parallel", "reduction", "reduction"]}
      ins(%a, %b : memref<16x16x2xbf16>, memref<16x16x2xbf16>) outs(%c : memref<16x16xf32>) attrs = {ansor.amx} {
  ^bb0(%x: bf16, %y: bf16, %acc: f32):
    %xe = arith.extf %x : bf16 to f32
    %ye = arith.extf %y : bf16 to f32
    %p = arith.mulf %xe, %ye : f32
    %s = arith.addf %acc, %p : f32
    linalg.yield %s : f32
  }
  return
}
"""
    with ir.Context():
        module = ir.Module.parse(text)
        with pytest.raises(AnsorError, match="reads its operands as"):
            amx_microkernels(module)
        untagged = ir.Module.parse(text.replace(" attrs = {ansor.amx}", ""))
        assert amx_microkernels(untagged) == 0


def _host_has_amx() -> None:
    if not Target.host().has("amx_bf16"):
        pytest.skip("this host has no AMX: the object code is checked for sapphirerapids instead")
    if not request_amx():
        pytest.skip("Linux refused the AMX tile state to this process")


@pytest.mark.parametrize("name", ["cpu-amx-2x2", "cpu-amx-1x4", "cpu-amx-4x1"])
@pytest.mark.parametrize("threads, pack", [(1, 0), (2, 1)])
def test_results(tmp_path, name, threads, pack):
    """Each register tile, B copied or read in place, at 1 and 2 threads,
    two cache tiles of pairs (the accumulators go back to C between them):
    products of bf16 are exact in f32, so the sums match float64 to f32
    rounding."""
    _host_has_amx()
    m, n, k = 128, 128, 256
    src = matmul(m, n, k, "bf16", "f32")
    (sketch,) = [s for s in amx_sketches(src, Target.host()) if s.name == name]
    rng = np.random.default_rng(0)
    a = rng.uniform(-1, 1, (m, k)).astype(ml_dtypes.bfloat16)
    b = rng.uniform(-1, 1, (k, n)).astype(ml_dtypes.bfloat16)
    out = _run(tmp_path, sketch, threads, [a, b], (m, n), np.float32, p_d0=64, p_d1=64, k_d2=64, pack=pack)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) < 1e-5


def test_batched_results(tmp_path):
    """Attention's products: a batch a thread step, its unit dimension
    collapsed away in the micro-kernel; reductions of two steps, fewer than
    the 1 x 4 tile's B tiles."""
    _host_has_amx()
    b, m, n, k = 3, 32, 64, 64
    src = batch_matmul(b, m, n, k, "bf16", "f32")
    sketches = amx_sketches(src, Target.host())
    assert [s.name for s in sketches] == ["cpu-amx-2x2", "cpu-amx-1x4"]
    rng = np.random.default_rng(1)
    x = rng.uniform(-1, 1, (b, m, k)).astype(ml_dtypes.bfloat16)
    y = rng.uniform(-1, 1, (b, k, n)).astype(ml_dtypes.bfloat16)
    ref = x.astype(np.float64) @ y.astype(np.float64)
    for sketch in sketches:
        for pack in (0, 1):
            out = _run(tmp_path, sketch, 2, [x, y], (b, m, n), np.float32, pack=pack)
            assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) < 1e-5, (sketch.name, pack)


def test_convolution_register_tiles():
    """Pixels of an output row in rows of tiles (at least 7 rows a tile),
    channels in tiles of 16; no sketch for strided convolutions or channels
    that are not whole steps."""
    from mlir_ansor.search.rules.amx import conv_tiles

    assert conv_tiles(56, 64) == [(28, 2), (14, 4), (56, 1)]
    assert conv_tiles(28, 128) == [(28, 2), (14, 4)]
    assert conv_tiles(7, 512) == [(7, 4)]
    assert conv_tiles(8, 32) == [(8, 2)]
    names = [s.name for s in amx_sketches(conv("bf16", "f32", hw=14, c=64, f=64))]
    assert names == ["cpu-amx-14x64"]
    assert amx_sketches(conv("bf16", "f32", hw=14, c=48, f=64)) == []
    assert amx_sketches(conv("f32", "f32", hw=14, c=64, f=64)) == []


@pytest.mark.parametrize("hw, c, f", [(14, 64, 64), (8, 32, 32), (28, 64, 32)])
def test_convolution_results(tmp_path, hw, c, f):
    _host_has_amx()
    src = conv("bf16", "f32", hw=hw, c=c, f=f)
    rng = np.random.default_rng(2)
    x = rng.uniform(-1, 1, (1, hw + 2, hw + 2, c)).astype(ml_dtypes.bfloat16)
    w = rng.uniform(-1, 1, (3, 3, c, f)).astype(ml_dtypes.bfloat16)
    xd, wd = x.astype(np.float64), w.astype(np.float64)
    ref = np.zeros((1, hw, hw, f))
    for i in range(3):
        for j in range(3):
            ref[0] += xd[0, i : i + hw, j : j + hw, :] @ wd[i, j]
    sketches = amx_sketches(src, Target.host())
    assert sketches
    for sketch in sketches:
        out = _run(tmp_path, sketch, 2, [x, w], (1, hw, hw, f), np.float32)
        assert np.max(np.abs(out - ref)) / np.max(np.abs(ref)) < 1e-5, sketch.name


def test_int8_object_code_for_sapphire_rapids(tmp_path):
    """Bytes in quads (64 a tile row): signed x signed is tdpbssd; one
    unsigned operand, tdpbusd (A) or tdpbsud (B), no correction; two
    unsigned operands get no sketch (as in `cpu-dot-product`)."""
    names = ["tdpbssd", "tdpbusd", "tdpbsud", "tilestored", "vpdpbusd"]

    def counts(src):
        (sketch,) = [s for s in amx_sketches(src) if s.name == "cpu-amx-2x2"]
        with ir.Context(), ir.Location.unknown():
            module = apply_schedule(sketch.payload, sketch.concrete(_knobs(sketch, 1, p_d0=64, p_d1=64, k_d2=32, pack=1)))
            lower_to_llvm(module, 1)
            obj = emit_object(module, tmp_path / "k.o", cpu="sapphirerapids")
        return instruction_counts(obj, names)

    # 64 x 64 x 128: 2 x 2 accumulators, 32 quads = 2 steps
    assert counts(matmul(64, 64, 128, "i8", "i32")) == dict(zip(names, [8, 0, 0, 4, 0]))
    assert counts(mixed(64, 64, 128, "a")) == dict(zip(names, [0, 8, 0, 4, 0]))
    assert counts(mixed(64, 64, 128, "b")) == dict(zip(names, [0, 0, 8, 4, 0]))
    assert amx_sketches(matmul(64, 64, 128, "i8", "i32", ext="arith.extui")) == []
    assert amx_sketches(matmul(64, 64, 96, "i8", "i32")) == []  # not whole steps of 64 bytes
    no_int8 = dataclasses.replace(SPR, features=tuple(f for f in SPR.features if f != "amx_int8"))
    assert amx_sketches(matmul(64, 64, 128, "i8", "i32"), no_int8) == []


@pytest.mark.parametrize("unsigned", ["", "a", "b"])
def test_int8_results_are_exact(tmp_path, unsigned):
    _host_has_amx()
    m, n, k = 64, 96, 256
    src = mixed(m, n, k, unsigned) if unsigned else matmul(m, n, k, "i8", "i32")
    rng = np.random.default_rng(3)
    a = rng.integers(-128, 128, (m, k)).astype(np.int8)
    b = rng.integers(-128, 128, (k, n)).astype(np.int8)
    a[0, :] = -128  # the extremes: 255 or -128 times -128
    b[:, 0] = -128
    wa = a.view(np.uint8) if unsigned == "a" else a
    wb = b.view(np.uint8) if unsigned == "b" else b
    ref = wa.astype(np.int64) @ wb.astype(np.int64)
    sketches = amx_sketches(src, Target.host())
    assert [s.name for s in sketches] == ["cpu-amx-2x2", "cpu-amx-4x1"]
    for sketch in sketches:
        for threads, pack in ((1, 0), (2, 1)):
            out = _run(tmp_path, sketch, threads, [a, b], (m, n), np.int32, pack=pack)
            assert np.array_equal(out, ref), (sketch.name, threads, pack)


def test_int8_convolution_results_are_exact(tmp_path):
    _host_has_amx()
    hw, c, f = 14, 64, 64
    src = conv("i8", "i32", hw=hw, c=c, f=f)
    rng = np.random.default_rng(4)
    x = rng.integers(-128, 128, (1, hw + 2, hw + 2, c)).astype(np.int8)
    w = rng.integers(-128, 128, (3, 3, c, f)).astype(np.int8)
    ref = np.zeros((1, hw, hw, f), np.int64)
    for i in range(3):
        for j in range(3):
            ref[0] += x[0, i : i + hw, j : j + hw, :].astype(np.int64) @ w[i, j].astype(np.int64)
    (sketch,) = amx_sketches(src, Target.host())
    out = _run(tmp_path, sketch, 2, [x, w], (1, hw, hw, f), np.int32)
    assert np.array_equal(out, ref)


_PERMISSION = """
import ctypes, sys
ctypes.CDLL(sys.argv[1])
libc = ctypes.CDLL(None)
mask = ctypes.c_uint64(0)
libc.syscall(158, 0x1022, ctypes.byref(mask))  # ARCH_GET_XCOMP_PERM
print(int(bool(mask.value & (1 << 18))))  # XFEATURE_XTILEDATA
"""


def test_a_compiled_library_asks_for_the_tile_state_itself(tmp_path):
    """Loaded by a process that never imports mlir_ansor (a C program's
    dlopen), the library's constructor has asked Linux for AMX's tile
    state; the module computes on the tiles."""
    import subprocess
    import sys

    import mlir_ansor

    _host_has_amx()
    cm = mlir_ansor.compile(mlir_ansor.load(text=matmul(64, 64, 128, "bf16", "f32")))
    assert [k.sketch_name for k in cm.kernels] == ["cpu-amx-2x2"]
    assert instruction_counts(cm.library_path, ["tdpbf16ps"])["tdpbf16ps"] > 0
    out = subprocess.run([sys.executable, "-c", _PERMISSION, cm.library_path], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "1", out.stderr
    rng = np.random.default_rng(5)
    a = rng.uniform(-1, 1, (64, 128)).astype(ml_dtypes.bfloat16)
    b = rng.uniform(-1, 1, (128, 64)).astype(ml_dtypes.bfloat16)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    assert np.max(np.abs(cm(a, b) - ref)) / np.max(np.abs(ref)) < 1e-5


def test_a_linear_layer_with_its_epilogue(tmp_path):
    """BERT's bf16 linear as torch-mlir writes it: a constant B (packed at
    compile time), the bias added and the result truncated to bf16 in the
    same task (the bias read as the rows of a tile once crashed the
    lowering)."""
    import mlir_ansor

    _host_has_amx()
    m, k, n = 32, 64, 64
    rng = np.random.default_rng(6)
    w = rng.uniform(-1, 1, (k, n)).astype(ml_dtypes.bfloat16)
    bias = rng.uniform(-1, 1, n).astype(np.float32)

    def dense(x):
        return f'dense<"0x{x.tobytes().hex().upper()}">'

    t, tb = f"tensor<{m}x{n}xf32>", f"tensor<{m}x{n}xbf16>"
    src = f"""
#id = affine_map<(d0, d1) -> (d0, d1)>
#col = affine_map<(d0, d1) -> (d1)>
func.func @lin(%a: tensor<{m}x{k}xbf16>) -> {tb} {{
  %w = arith.constant {dense(w.view(np.uint16))} : tensor<{k}x{n}xbf16>
  %b = arith.constant {dense(bias)} : tensor<{n}xf32>
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : {t}
  %c = linalg.fill ins(%z : f32) outs(%e : {t}) -> {t}
  %r = linalg.matmul ins(%a, %w : tensor<{m}x{k}xbf16>, tensor<{k}x{n}xbf16>) outs(%c : {t}) -> {t}
  %rb = linalg.generic {{indexing_maps = [#id, #col, #id], iterator_types = ["parallel", "parallel"]}}
      ins(%r, %b : {t}, tensor<{n}xf32>) outs(%e : {t}) {{
  ^bb0(%v: f32, %u: f32, %o: f32):
    %s = arith.addf %v, %u : f32
    linalg.yield %s : f32
  }} -> {t}
  %eb = tensor.empty() : {tb}
  %y = linalg.generic {{indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}}
      ins(%rb : {t}) outs(%eb : {tb}) {{
  ^bb0(%v: f32, %o: bf16):
    %q = arith.truncf %v : f32 to bf16
    linalg.yield %q : bf16
  }} -> {tb}
  return %y : {tb}
}}
"""
    cm = mlir_ansor.compile(mlir_ansor.load(text=src))
    assert [k.sketch_name for k in cm.kernels] == ["cpu-amx-2x2"]
    a = rng.uniform(-1, 1, (m, k)).astype(ml_dtypes.bfloat16)
    want = a.astype(np.float64) @ w.astype(np.float64) + bias
    got = np.asarray(cm(a)).astype(np.float64)
    assert np.max(np.abs(got - want)) / np.max(np.abs(want)) < 1e-2  # one bf16 rounding
