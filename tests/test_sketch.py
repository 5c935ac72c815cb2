"""Sketch generation: structure analysis, knobs, golden FileCheck tests, and
that a concrete schedule applies with plain `mlir-opt --transform-interpreter`."""

from __future__ import annotations

import random
import subprocess

import pytest
from conftest import INPUTS, filecheck, mlir_opt

from mlir_ansor.graph.task import extract_tasks
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.search.sketch import prepare_payload
from mlir_ansor.search.space import is_valid, sample
from mlir_ansor.target import Target

AVX2 = Target("cpu", 256, 2, "test", ("avx2", "fma"))


def _task(name: str):
    (task,) = extract_tasks(str(INPUTS / name))
    return task


def test_structure_of_matmul():
    payload, ops = prepare_payload(_task("matmul.mlir").mlir)
    assert "ansor.op = 0" in payload and "ansor.op = 1" in payload
    fill, mm = ops
    assert (fill.role, mm.role) == ("producer", "anchor")
    assert mm.loop_ranges == (128, 256, 64)
    assert mm.iterator_types == ("parallel", "parallel", "reduction")
    # A[m, k], B[k, n], C[m, n]
    assert mm.operand_dims == ((0, 2), (2, 1), (0, 1))
    assert mm.is_root and not fill.is_root


def test_generic_matmul_gets_the_contraction_sketch():
    named = generate_sketches(_task("matmul.mlir").mlir, AVX2)[0]
    generic = generate_sketches(_task("matmul_generic.mlir").mlir, AVX2)[0]
    assert named.name == generic.name == "cpu-contraction"
    assert [k.name for k in named.knobs] == [k.name for k in generic.knobs]


def test_matmul_sketch_golden(tmp_path):
    sk = generate_sketches(_task("matmul.mlir").mlir, AVX2)[0]
    knobs = {k.name: k for k in sk.knobs}
    # Register tile first, then the outer tiles as its multiples.
    assert [k.name for k in sk.knobs] == ["r_d0", "r_d1", "u_d2", "p_d0", "p_d1", "k_d2", "pack"]
    assert knobs["r_d1"].options == (8, 16, 32)  # AVX2: 8 f32 lanes
    # 6 rows do not divide 128: offered anyway, the remainder peeled, and
    # the thread tile of the rows is then any divisor of at least 6.
    assert knobs["r_d0"].options == (1, 2, 4, 6, 8)
    assert knobs["p_d0"].multiple_of == "r_d0"
    assert knobs["p_d0"].allowed({"r_d0": 4}) == (4, 8, 16, 32, 64, 128)
    assert knobs["p_d0"].allowed({"r_d0": 6}) == (8, 16, 32, 64, 128)
    assert knobs["k_d2"].options == (1, 2, 4, 8, 16, 32, 64)
    assert knobs["pack"].alternatives
    filecheck(
        sk.script,
        """
CHECK: transform.named_sequence @__transform_main
CHECK-DAG: transform.tune.knob<"r_d0"> options = [1, 2, 4, 6, 8]
CHECK-DAG: transform.tune.knob<"r_d1"> options = [8, 16, 32]
CHECK-DAG: transform.tune.knob<"p_d0"> options = [1, 2, 4, 8, 16, 32, 64, 128]
CHECK: transform.structured.tile_using_forall {{.*}} tile_sizes [%{{.*}}, %{{.*}}, 0]
CHECK: transform.structured.fuse_into_containing_op
CHECK: transform.structured.tile_using_for {{.*}} tile_sizes [0, 0, %{{.*}}]
CHECK: transform.apply_registered_pass "scf-for-loop-peeling"
CHECK: transform.tune.alternatives<"pack">
CHECK:   transform.structured.pad
CHECK:   transform.structured.rewrite_in_destination_passing_style
CHECK: }, {
CHECK: transform.structured.tile_using_for {{.*}} tile_sizes [%{{.*}}, %{{.*}}, 0]
CHECK: transform.apply_registered_pass "scf-for-loop-peeling"
CHECK: transform.structured.vectorize_children_and_apply_patterns
CHECK: transform.loop.hoist_loop_invariant_subsets
CHECK: transform.bufferization.one_shot_bufferize
CHECK: transform.apply_patterns.vector.lower_contraction lowering_strategy = "outerproduct"
""",
        tmp_path,
    )


def test_conv_sketch_forces_unit_window_loops():
    sk = generate_sketches(_task("conv_small.mlir").mlir, AVX2)[0]
    names = [k.name for k in sk.knobs]
    # conv_2d_nhwc_hwcf loops: n oh ow f | kh kw c. oh and kh are tiled to 1
    # (so the convolution decomposes to 1-D); ow is the row loop, f the vector.
    assert "r_d2" in names and "r_d3" in names
    assert "k_d4" not in names and "k_d1" not in names
    assert "transform.structured.decompose" in sk.script


def test_conv_filter_packing_copies_one_row_per_step():
    # The packed filter tile (kh, kw, c, f) is copied one f-row per step.
    # Tiled along kh only, its [kw, c, f] rest was vectorized and unrolled
    # into thousands of vector transfers in one block: LLVM took minutes per
    # kernel, and ResNet-50's whole-module build (layout pass on) never ended.
    sk = generate_sketches(_task("conv_small.mlir").mlir, AVX2)[0]
    assert "pack" in [k.name for k in sk.knobs]
    after = sk.script.split('ops{["linalg.copy"]}', 1)[1]
    copy_tiling = after.split("tile_sizes", 1)[1].split("]", 1)[0]
    assert copy_tiling.strip() == "[1, 1, 1, 0"


def test_samples_are_valid_and_deterministic():
    sk = generate_sketches(_task("matmul.mlir").mlir, AVX2)[0]
    a = [sample(sk.knobs, random.Random(7)) for _ in range(1)]
    b = [sample(sk.knobs, random.Random(7)) for _ in range(1)]
    assert a == b
    rng = random.Random(1)
    for _ in range(200):
        s = dict(sample(sk.knobs, rng))
        assert is_valid(sk.knobs, tuple(sorted(s.items())))
        # rows: a multiple of the register rows, except 6 rows (which no
        # divisor of 128 is a multiple of: the rest is peeled), then larger
        assert (s["p_d0"] % s["r_d0"] == 0 or (s["r_d0"] == 6 and s["p_d0"] > 6)) and 128 % s["p_d0"] == 0
        assert s["p_d1"] % s["r_d1"] == 0 and s["k_d2"] % s["u_d2"] == 0


def test_concrete_schedule_sets_selected(tmp_path):
    sk = generate_sketches(_task("matmul.mlir").mlir, AVX2)[0]
    knobs = sample(sk.knobs, random.Random(3))
    text = sk.concrete(knobs)
    values = dict(knobs)
    filecheck(
        text,
        f"""
CHECK: transform.tune.knob<"r_d0"> = {values['r_d0']} : i64 from options
CHECK: transform.tune.alternatives<"pack"> selected_region = {values['pack']}
""",
        tmp_path,
    )
    with pytest.raises(ValueError, match="no value given"):
        sk.concrete(knobs[:-1])


def test_concrete_schedule_applies_with_mlir_opt(tmp_path):
    """The interface to the MLIR world: a printed schedule with its knobs
    selected applies to the tagged payload with plain mlir-opt."""
    sk = generate_sketches(_task("matmul.mlir").mlir, AVX2)[0]
    knobs = dict(sample(sk.knobs, random.Random(5)))
    knobs["pack"] = 0
    script = tmp_path / "schedule.mlir"
    script.write_text(sk.concrete(tuple(sorted(knobs.items()))))
    payload = tmp_path / "payload.mlir"
    payload.write_text(sk.payload)
    proc = subprocess.run(
        [mlir_opt(), str(payload), f"--transform-preload-library=transform-library-paths={script}", "--transform-interpreter"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    filecheck(
        proc.stdout,
        """
CHECK: func.func @kernel(%{{.*}}: memref<128x64xf32>, %{{.*}}: memref<64x256xf32>) -> memref<128x256xf32>
CHECK: scf.forall
CHECK: memref.alloc(){{.*}}: memref<{{[0-9]+}}x{{[0-9]+}}xf32>
CHECK: vector.fma
CHECK-NOT: linalg.matmul
""",
        tmp_path,
    )


EPILOGUE = """
#id = affine_map<(i, j) -> (i, j)>
#col = affine_map<(i, j) -> (j)>
func.func @f(%a: tensor<64x32xf32>, %b: tensor<32x48xf32>, %bias: tensor<48xf32>, %scale: tensor<48xf32>,
             %r: tensor<64x48xf32>) -> (tensor<64x48xf32>, tensor<64x48xbf16>) {
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<64x48xf32>
  %ea = tensor.empty() : tensor<64x32xf32>
  %x = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%a : tensor<64x32xf32>) outs(%ea : tensor<64x32xf32>) {
  ^bb0(%v: f32, %o: f32):
    %n = arith.negf %v : f32
    linalg.yield %n : f32
  } -> tensor<64x32xf32>
  %f = linalg.fill ins(%z : f32) outs(%e : tensor<64x48xf32>) -> tensor<64x48xf32>
  %m = linalg.matmul ins(%x, %b : tensor<64x32xf32>, tensor<32x48xf32>) outs(%f : tensor<64x48xf32>) -> tensor<64x48xf32>
  %s = linalg.generic {indexing_maps = [#id, #col, #id], iterator_types = ["parallel", "parallel"]}
      ins(%m, %bias : tensor<64x48xf32>, tensor<48xf32>) outs(%e : tensor<64x48xf32>) {
  ^bb0(%v: f32, %c: f32, %o: f32):
    %y = arith.subf %v, %c : f32
    linalg.yield %y : f32
  } -> tensor<64x48xf32>
  %t = linalg.generic {indexing_maps = [#id, #col, #id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%s, %scale, %r : tensor<64x48xf32>, tensor<48xf32>, tensor<64x48xf32>) outs(%e : tensor<64x48xf32>) {
  ^bb0(%v: f32, %c: f32, %w: f32, %o: f32):
    %y = arith.mulf %v, %c : f32
    %y2 = arith.addf %y, %w : f32
    %y3 = arith.maximumf %y2, %z : f32
    linalg.yield %y3 : f32
  } -> tensor<64x48xf32>
  %eb = tensor.empty() : tensor<64x48xbf16>
  %h = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%t : tensor<64x48xf32>) outs(%eb : tensor<64x48xbf16>) {
  ^bb0(%v: f32, %o: bf16):
    %y = arith.truncf %v : f32 to bf16
    linalg.yield %y : bf16
  } -> tensor<64x48xbf16>
  return %t, %h : tensor<64x48xf32>, tensor<64x48xbf16>
}
"""


TASK_WITH_PROLOGUE = """
#id = affine_map<(i, j) -> (i, j)>
module {
  func.func @kernel(%a: tensor<64x32xf32>, %b: tensor<32x48xf32>) -> tensor<64x48xbf16> {
    %z = arith.constant 0.0 : f32
    %e = tensor.empty() : tensor<64x48xf32>
    %ea = tensor.empty() : tensor<64x32xf32>
    %x = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
        ins(%a : tensor<64x32xf32>) outs(%ea : tensor<64x32xf32>) {
    ^bb0(%v: f32, %o: f32):
      %n = arith.negf %v : f32
      linalg.yield %n : f32
    } -> tensor<64x32xf32>
    %f = linalg.fill ins(%z : f32) outs(%e : tensor<64x48xf32>) -> tensor<64x48xf32>
    %m = linalg.matmul {ansor.anchor} ins(%x, %b : tensor<64x32xf32>, tensor<32x48xf32>) outs(%f : tensor<64x48xf32>) -> tensor<64x48xf32>
    %s = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
        ins(%m : tensor<64x48xf32>) outs(%e : tensor<64x48xf32>) attrs = {ansor.fused} {
    ^bb0(%v: f32, %o: f32):
      %y = arith.maximumf %v, %z : f32
      linalg.yield %y : f32
    } -> tensor<64x48xf32>
    %eb = tensor.empty() : tensor<64x48xbf16>
    %h = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
        ins(%s : tensor<64x48xf32>) outs(%eb : tensor<64x48xbf16>) attrs = {ansor.fused} {
    ^bb0(%v: f32, %o: bf16):
      %y = arith.truncf %v : f32 to bf16
      linalg.yield %y : bf16
    } -> tensor<64x48xbf16>
    return %h : tensor<64x48xbf16>
  }
}
"""


def test_the_ops_after_the_anchor_fuse_into_one_that_writes_in_place():
    """`fuse_epilogue` (the CPU rules' payload): the bias subtraction and
    the scale-residual-ReLU after the matmul become one generic whose
    `outs` is the matmul's result, and the compiled module computes what
    numpy does. An elementwise op before the anchor stays as it is; a
    result of another element type (bf16) keeps an output of its own."""
    import numpy as np

    import mlir_ansor

    task = next(t for t in extract_tasks(mlir_ansor.load(text=EPILOGUE)) if t.anchor_op == "linalg.matmul")
    _, plain = prepare_payload(task.mlir)
    payload, ops = prepare_payload(task.mlir, fuse=True)
    assert [o.role for o in plain] == ["producer", "anchor", "fused", "fused"]
    assert [(o.name, o.role) for o in ops] == [("linalg.fill", "producer"), ("linalg.matmul", "anchor"),
                                               ("linalg.generic", "fused")]
    fused_line = next(line for line in payload.splitlines() if "ansor.fused" in line)
    anchor_value = next(line for line in payload.splitlines() if "linalg.matmul" in line).split("=")[0].strip()
    assert f"outs({anchor_value} : tensor<64x48xf32>)" in fused_line

    payload, ops = prepare_payload(TASK_WITH_PROLOGUE, fuse=True)
    assert [(o.name, o.role) for o in ops] == [("linalg.generic", "producer"), ("linalg.fill", "producer"),
                                               ("linalg.matmul", "anchor"), ("linalg.generic", "fused")]
    fused = payload[payload.index("ansor.fused"):]
    assert "arith.negf" in payload and "arith.maximumf" in fused and "arith.truncf" in fused
    empty = next(line for line in payload.splitlines() if "tensor.empty() : tensor<64x48xbf16>" in line).split("=")[0].strip()
    assert f"outs({empty} : tensor<64x48xbf16>)" in next(line for line in payload.splitlines() if "ansor.fused" in line)

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((64, 32)).astype(np.float32), rng.standard_normal((32, 48)).astype(np.float32)
    bias, scale = rng.standard_normal(48).astype(np.float32), rng.standard_normal(48).astype(np.float32)
    r = rng.standard_normal((64, 48)).astype(np.float32)
    t, h = mlir_ansor.compile(mlir_ansor.load(text=EPILOGUE), cache_dir=False)(a, b, bias, scale, r)
    want = np.maximum(((-a) @ b - bias) * scale + r, 0)
    np.testing.assert_allclose(t, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h.astype(np.float32), want, rtol=1e-2, atol=1e-2)
