"""Normalization of imported Linalg (torch-mlir's patterns, written by hand so
these tests need no torch) and compile-time folding of constant-only ops."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import filecheck
from mlir import ir

import mlir_ansor
from mlir_ansor.compiler import compile_untuned
from mlir_ansor.graph.task import extract_tasks
from mlir_ansor.ir.program import load

# torch-mlir's softmax: a max reduction that also computes an (unused) i64
# argmax, keepdim reductions writing (d0, 0), and broadcasts reading (d0, 0).
SOFTMAX = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
#keep = affine_map<(d0, d1) -> (d0, 0)>
func.func @softmax(%x: tensor<4x16xf32>) -> tensor<4x16xf32> {
  %zero = arith.constant 0.0 : f32
  %ninf = arith.constant 0xFF800000 : f32
  %c0 = arith.constant 0 : i64
  %ei = tensor.empty() : tensor<4xi64>
  %fi = linalg.fill ins(%c0 : i64) outs(%ei : tensor<4xi64>) -> tensor<4xi64>
  %em = tensor.empty() : tensor<4xf32>
  %fm = linalg.fill ins(%ninf : f32) outs(%em : tensor<4xf32>) -> tensor<4xf32>
  %max:2 = linalg.generic {indexing_maps = [#id, #row, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<4x16xf32>) outs(%fm, %fi : tensor<4xf32>, tensor<4xi64>) {
  ^bb0(%in: f32, %m: f32, %i: i64):
    %j = linalg.index 1 : index
    %ji = arith.index_cast %j : index to i64
    %mx = arith.maximumf %in, %m : f32
    %gt = arith.cmpf ogt, %in, %m : f32
    %sel = arith.select %gt, %ji, %i : i64
    linalg.yield %mx, %sel : f32, i64
  } -> (tensor<4xf32>, tensor<4xi64>)
  %mk = tensor.expand_shape %max#0 [[0, 1]] output_shape [4, 1] : tensor<4xf32> into tensor<4x1xf32>
  %e = tensor.empty() : tensor<4x16xf32>
  %ex = linalg.generic {indexing_maps = [#id, #keep, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x, %mk : tensor<4x16xf32>, tensor<4x1xf32>) outs(%e : tensor<4x16xf32>) {
  ^bb0(%a: f32, %b: f32, %o: f32):
    %d = arith.subf %a, %b : f32
    %v = math.exp %d : f32
    linalg.yield %v : f32
  } -> tensor<4x16xf32>
  %es = tensor.empty() : tensor<4x1xf32>
  %fs = linalg.fill ins(%zero : f32) outs(%es : tensor<4x1xf32>) -> tensor<4x1xf32>
  %sum = linalg.generic {indexing_maps = [#id, #keep], iterator_types = ["parallel", "reduction"]}
      ins(%ex : tensor<4x16xf32>) outs(%fs : tensor<4x1xf32>) {
  ^bb0(%a: f32, %o: f32):
    %s = arith.addf %a, %o : f32
    linalg.yield %s : f32
  } -> tensor<4x1xf32>
  %r = linalg.generic {indexing_maps = [#id, #keep, #id], iterator_types = ["parallel", "parallel"]}
      ins(%ex, %sum : tensor<4x16xf32>, tensor<4x1xf32>) outs(%e : tensor<4x16xf32>) {
  ^bb0(%a: f32, %b: f32, %o: f32):
    %q = arith.divf %a, %b : f32
    linalg.yield %q : f32
  } -> tensor<4x16xf32>
  return %r : tensor<4x16xf32>
}
"""

# A linear layer as torch-mlir writes it: the weight is transposed at run
# time, and a batch-norm-like factor 1/sqrt(v + eps) is computed from
# constants, with a cf.assert in the body.
LINEAR = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#col = affine_map<(d0, d1) -> (d1)>
#v = affine_map<(d0) -> (d0)>
func.func @linear(%x: tensor<8x32xf32>) -> tensor<8x16xf32> {
  %zero = arith.constant 0.0 : f32
  %one = arith.constant 1.0 : f32
  %eps = arith.constant 1.0e-05 : f64
  %w = arith.constant dense<[[0.5, -1.0, 0.25, 2.0, 1.5, -0.5, 0.75, -2.0, 1.0, 0.125, -0.25, 3.0, -1.5, 0.5, 2.5, -0.75,
                              1.25, -0.125, 0.375, -3.0, 0.625, 1.75, -2.5, 0.875, -0.375, 2.25, -1.25, 0.0625, 1.125, -1.75, 0.3, -0.6]]> : tensor<1x32xf32>
  %wb = tensor.empty() : tensor<16x32xf32>
  %wfull = linalg.generic {indexing_maps = [affine_map<(d0, d1) -> (0, d1)>, #id], iterator_types = ["parallel", "parallel"]}
      ins(%w : tensor<1x32xf32>) outs(%wb : tensor<16x32xf32>) {
  ^bb0(%a: f32, %o: f32):
    %i = linalg.index 0 : index
    %ii = arith.index_cast %i : index to i32
    %f = arith.sitofp %ii : i32 to f32
    %s = arith.addf %a, %f : f32
    linalg.yield %s : f32
  } -> tensor<16x32xf32>
  %var = arith.constant dense<[1.0, 4.0, 0.25, 9.0, 2.0, 0.5, 1.5, 3.0, 1.0, 4.0, 0.25, 9.0, 2.0, 0.5, 1.5, 3.0]> : tensor<16xf32>
  %ev = tensor.empty() : tensor<16xf32>
  %inv = linalg.generic {indexing_maps = [#v, #v], iterator_types = ["parallel"]} ins(%var : tensor<16xf32>) outs(%ev : tensor<16xf32>) {
  ^bb0(%a: f32, %o: f32):
    %e32 = arith.truncf %eps : f64 to f32
    %p = arith.addf %a, %e32 : f32
    %r = math.sqrt %p : f32
    %nz = arith.cmpf one, %r, %zero : f32
    cf.assert %nz, "unimplemented: tensor with zero element"
    %q = arith.divf %one, %r : f32
    linalg.yield %q : f32
  } -> tensor<16xf32>
  %et = tensor.empty() : tensor<32x16xf32>
  %wt = linalg.transpose ins(%wfull : tensor<16x32xf32>) outs(%et : tensor<32x16xf32>) permutation = [1, 0]
  %e = tensor.empty() : tensor<8x16xf32>
  %f = linalg.fill ins(%zero : f32) outs(%e : tensor<8x16xf32>) -> tensor<8x16xf32>
  %mm = linalg.matmul ins(%x, %wt : tensor<8x32xf32>, tensor<32x16xf32>) outs(%f : tensor<8x16xf32>) -> tensor<8x16xf32>
  %y = linalg.generic {indexing_maps = [#id, #col, #id], iterator_types = ["parallel", "parallel"]}
      ins(%mm, %inv : tensor<8x16xf32>, tensor<16xf32>) outs(%e : tensor<8x16xf32>) {
  ^bb0(%a: f32, %b: f32, %o: f32):
    %m = arith.mulf %a, %b : f32
    linalg.yield %m : f32
  } -> tensor<8x16xf32>
  return %y : tensor<8x16xf32>
}
"""

W_ROW = np.array(
    [0.5, -1.0, 0.25, 2.0, 1.5, -0.5, 0.75, -2.0, 1.0, 0.125, -0.25, 3.0, -1.5, 0.5, 2.5, -0.75,
     1.25, -0.125, 0.375, -3.0, 0.625, 1.75, -2.5, 0.875, -0.375, 2.25, -1.25, 0.0625, 1.125, -1.75, 0.3, -0.6],
    dtype=np.float32,
)
VAR = np.array([1.0, 4.0, 0.25, 9.0, 2.0, 0.5, 1.5, 3.0] * 2, dtype=np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_softmax_drops_the_argmax_and_unit_broadcasts():
    from mlir_ansor.graph.normalize import normalize

    program = load(text=SOFTMAX)
    normalize(program.module)
    text = str(program.module)
    # the i64 argmax is gone (it would make the max untunable), and the
    # keepdim reductions and their broadcasts read and write rows (d0) of
    # 4xf32, not (d0, 0) of 4x1xf32
    filecheck(text, r"""
CHECK-DAG:   #[[ID:\w+]] = affine_map<(d0, d1) -> (d0, d1)>
CHECK-DAG:   #[[ROW:\w+]] = affine_map<(d0, d1) -> (d0)>
CHECK-LABEL: func.func @softmax(
CHECK-SAME:    %[[X:\w+]]: tensor<4x16xf32>) -> tensor<4x16xf32> attributes {ansor.normalized}
CHECK:         %[[MAX:\w+]] = linalg.generic {indexing_maps = [#[[ID]], #[[ROW]]], iterator_types = ["parallel", "reduction"]}
CHECK-SAME:      ins(%[[X]] : tensor<4x16xf32>) outs(%{{\w+}} : tensor<4xf32>)
CHECK-NEXT:    ^bb0(%{{\w+}}: f32, %{{\w+}}: f32):
CHECK-NEXT:      arith.maximumf
CHECK:         %[[EXP:\w+]] = linalg.generic {indexing_maps = [#[[ID]], #[[ROW]], #[[ID]]], iterator_types = ["parallel", "parallel"]}
CHECK-SAME:      ins(%[[X]], %[[MAX]] : tensor<4x16xf32>, tensor<4xf32>)
CHECK:         %[[SUM:\w+]] = linalg.generic {indexing_maps = [#[[ID]], #[[ROW]]], iterator_types = ["parallel", "reduction"]}
CHECK-SAME:      ins(%[[EXP]] : tensor<4x16xf32>) outs(%{{\w+}} : tensor<4xf32>)
CHECK:         %[[R:\w+]] = linalg.generic {indexing_maps = [#[[ID]], #[[ROW]], #[[ID]]], iterator_types = ["parallel", "parallel"]}
CHECK-SAME:      ins(%[[EXP]], %[[SUM]] : tensor<4x16xf32>, tensor<4xf32>)
CHECK:         return %[[R]]
""")
    filecheck(text, """
CHECK-NOT: i64
CHECK-NOT: linalg.index
CHECK-NOT: (d0, 0)
""")
    tasks = extract_tasks(load(text=SOFTMAX))
    assert all(s.dtype == "f32" for t in tasks for s in t.inputs + t.outputs)
    assert [t.kind for t in tasks] == ["reduction", "elementwise", "reduction", "elementwise"]
    # no task reads or writes through a constant-0 map any more
    filecheck("\n".join(t.mlir for t in tasks), "CHECK-NOT: (d0, 0)")
    assert tasks[2].outputs[0].shape == (4,)


def test_softmax_compiles_to_the_right_values():
    x = np.random.default_rng(0).uniform(-3, 3, size=(4, 16)).astype(np.float32)
    cm = mlir_ansor.compile(load(text=SOFTMAX))
    np.testing.assert_allclose(cm(x), _softmax(x), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(cm(x), compile_untuned(load(text=SOFTMAX))(x), rtol=1e-6, atol=1e-7)


def test_constant_only_ops_are_no_tasks_and_are_folded():
    tasks = extract_tasks(load(text=LINEAR))
    # the transpose, the broadcast of the weight row and the 1/sqrt factor
    # depend on constants only: one task is left, the matmul and its scaling
    assert [(t.anchor_op, t.kind, t.weight) for t in tasks] == [("linalg.matmul", "contraction", 1)]
    x = np.random.default_rng(1).uniform(-1, 1, size=(8, 32)).astype(np.float32)
    w = W_ROW[None, :] + np.arange(16, dtype=np.float32)[:, None]
    expected = (x @ w.T) / np.sqrt(VAR + np.float32(1e-5))
    cm = mlir_ansor.compile(load(text=LINEAR))
    np.testing.assert_allclose(cm(x), expected, rtol=1e-5, atol=1e-5)
    # folded at compile time into constants (the transposed weight, the
    # factors): none of those ops is left in the scheduled module
    filecheck(cm.mlir, r"""
CHECK-DAG: memref.global "private" constant @{{\w+}} : memref<32x16xf32> = dense<
CHECK-DAG: memref.global "private" constant @{{\w+}} : memref<16xf32> = dense<
""")
    filecheck(cm.mlir, """
CHECK-NOT: linalg.transpose
CHECK-NOT: math.sqrt
CHECK-NOT: cf.assert
""")
    # the untuned reference computes them at run time, and agrees
    np.testing.assert_allclose(compile_untuned(load(text=LINEAR))(x), expected, rtol=1e-5, atol=1e-5)


def test_normalize_is_idempotent_and_leaves_memref_functions():
    from mlir_ansor.graph.normalize import normalize
    from mlir_ansor.ir.attrs import NORMALIZED_ATTR

    program = load(text=SOFTMAX)
    normalize(program.module)
    once = str(program.module)
    normalize(program.module)
    assert str(program.module) == once
    filecheck(once, "CHECK: func.func @softmax({{.*}}) -> tensor<4x16xf32> attributes {" + NORMALIZED_ATTR + "}")
    memref = load(
        text="""
func.func @f(%a: memref<4x1xf32>, %b: memref<4x8xf32>) {
  linalg.generic {indexing_maps = [affine_map<(d0, d1) -> (d0, 0)>, affine_map<(d0, d1) -> (d0, d1)>],
                  iterator_types = ["parallel", "parallel"]} ins(%a : memref<4x1xf32>) outs(%b : memref<4x8xf32>) {
  ^bb0(%x: f32, %y: f32):
    linalg.yield %x : f32
  }
  return
}
"""
    )
    before = str(memref.module)
    normalize(memref.module)
    assert str(memref.module) == before


def test_large_weights_are_linked_as_raw_data(tmp_path):
    """Weights of 64 KiB and more leave the LLVM module (both forms torch-mlir
    and our folding write: dense_resource blobs and dense hex) and come back
    as raw data; the results must not change."""
    rng = np.random.default_rng(2)
    w1 = rng.uniform(-1, 1, size=(128, 256)).astype(np.float32)
    w2 = rng.uniform(-1, 1, size=(256, 64)).astype(np.float32)
    text = f"""
func.func @mlp(%x: tensor<4x128xf32>) -> tensor<4x64xf32> {{
  %zero = arith.constant 0.0 : f32
  %w1 = arith.constant dense_resource<w1_blob> : tensor<128x256xf32>
  %w2 = arith.constant dense<"0x{w2.tobytes().hex().upper()}"> : tensor<256x64xf32>
  %e1 = tensor.empty() : tensor<4x256xf32>
  %f1 = linalg.fill ins(%zero : f32) outs(%e1 : tensor<4x256xf32>) -> tensor<4x256xf32>
  %h = linalg.matmul ins(%x, %w1 : tensor<4x128xf32>, tensor<128x256xf32>) outs(%f1 : tensor<4x256xf32>) -> tensor<4x256xf32>
  %e2 = tensor.empty() : tensor<4x64xf32>
  %f2 = linalg.fill ins(%zero : f32) outs(%e2 : tensor<4x64xf32>) -> tensor<4x64xf32>
  %y = linalg.matmul ins(%h, %w2 : tensor<4x256xf32>, tensor<256x64xf32>) outs(%f2 : tensor<4x64xf32>) -> tensor<4x64xf32>
  return %y : tensor<4x64xf32>
}}
{{-#
  dialect_resources: {{
    builtin: {{
      w1_blob: "0x04000000{w1.tobytes().hex().upper()}"
    }}
  }}
#-}}
"""
    from mlir import ir

    from mlir_ansor.compiler import _externalize_weights, schedule_module
    from mlir_ansor.ir.program import resource_blobs
    from mlir_ansor.search.rules.dot_product import lanes_of
    from mlir_ansor.target import Target

    scheduled = schedule_module(load(text=text)).mlir
    with ir.Context():
        module = ir.Module.parse(scheduled)
        jit_libs, objects = _externalize_weights(module, resource_blobs(scheduled), str(tmp_path))
        globals_ = [o.operation for o in module.body.operations if o.operation.name == "memref.global"]
        assert len(jit_libs) == len(objects) == 1
        # in the column panels the contraction rule reads (`graph.prepack.Panels`)
        w = 2 * lanes_of(Target.host())
        assert sorted(str(ir.TypeAttr(g.attributes["type"]).value) for g in globals_ if "initial_value" not in g.attributes) == sorted([
            f"memref<{256 // w}x128x{w}xf32>",
            f"memref<{64 // w}x256x{w}xf32>",
        ])
    x = rng.uniform(-1, 1, size=(4, 128)).astype(np.float32)
    cm = mlir_ansor.compile(load(text=text))
    np.testing.assert_allclose(cm(x), (x @ w1) @ w2, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(compile_untuned(load(text=text))(x), (x @ w1) @ w2, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_task_defined_for_positive_inputs_only_gets_a_reference(tmp_path):
    """A layer norm's rsqrt(var + eps) is NaN on the usual [-1, 1) inputs;
    the reference is then computed on positive inputs, and tuning goes on."""
    from mlir_ansor import TuneConfig
    from mlir_ansor.measure.runner import TimingPolicy

    text = """
#id = affine_map<(d0) -> (d0)>
func.func @rsqrt(%v: tensor<256xf32>) -> tensor<256xf32> {
  %eps = arith.constant 1.0e-05 : f32
  %e = tensor.empty() : tensor<256xf32>
  %r = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel"]} ins(%v : tensor<256xf32>) outs(%e : tensor<256xf32>) {
  ^bb0(%a: f32, %o: f32):
    %s = arith.addf %a, %eps : f32
    %q = math.rsqrt %s : f32
    linalg.yield %q : f32
  } -> tensor<256xf32>
  return %r : tensor<256xf32>
}
"""
    fast = TimingPolicy(warmup=0, min_repeat=1, max_repeat=2, min_time_s=0.001)
    result = mlir_ansor.tune(load(text=text), config=TuneConfig(trials=2, batch_size=2, build_workers=1, timing=fast), db=tmp_path / "r.db")
    (task,) = result.tasks
    assert task.trials == 2 and np.isfinite(task.baseline_latency_s)
    v = np.random.default_rng(0).uniform(0.5, 1.5, 256).astype(np.float32)
    np.testing.assert_allclose(mlir_ansor.compile(load(text=text), db=tmp_path / "r.db")(v), 1 / np.sqrt(v + 1e-5), rtol=1e-5)


# torch-mlir's variance of a layer norm: the f32 rows widened to f64, their
# mean and the mean of the squared deviations in f64, rounded back to f32.
VARIANCE = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#keep = affine_map<(d0, d1) -> (d0, 0)>
func.func @var(%x: tensor<8x96xf32>) -> tensor<8x1xf32> {
  %zero = arith.constant 0.0 : f64
  %n = arith.constant 96.0 : f64
  %e = tensor.empty() : tensor<8x96xf64>
  %w = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x : tensor<8x96xf32>) outs(%e : tensor<8x96xf64>) {
  ^bb0(%in: f32, %o: f64):
    %d = arith.extf %in : f32 to f64
    linalg.yield %d : f64
  } -> tensor<8x96xf64>
  %er = tensor.empty() : tensor<8x1xf64>
  %z = linalg.fill ins(%zero : f64) outs(%er : tensor<8x1xf64>) -> tensor<8x1xf64>
  %s = linalg.generic {indexing_maps = [#id, #keep], iterator_types = ["parallel", "reduction"]}
      ins(%w : tensor<8x96xf64>) outs(%z : tensor<8x1xf64>) {
  ^bb0(%in: f64, %o: f64):
    %a = arith.addf %in, %o : f64
    linalg.yield %a : f64
  } -> tensor<8x1xf64>
  %dev = linalg.generic {indexing_maps = [#id, #keep, #id], iterator_types = ["parallel", "parallel"]}
      ins(%w, %s : tensor<8x96xf64>, tensor<8x1xf64>) outs(%e : tensor<8x96xf64>) {
  ^bb0(%in: f64, %sum: f64, %o: f64):
    %m = arith.divf %sum, %n : f64
    %d = arith.subf %in, %m : f64
    %q = arith.mulf %d, %d : f64
    linalg.yield %q : f64
  } -> tensor<8x96xf64>
  %ss = linalg.generic {indexing_maps = [#id, #keep], iterator_types = ["parallel", "reduction"]}
      ins(%dev : tensor<8x96xf64>) outs(%z : tensor<8x1xf64>) {
  ^bb0(%in: f64, %o: f64):
    %a = arith.addf %in, %o : f64
    linalg.yield %a : f64
  } -> tensor<8x1xf64>
  %ef = tensor.empty() : tensor<8x1xf32>
  %v = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%ss : tensor<8x1xf64>) outs(%ef : tensor<8x1xf32>) {
  ^bb0(%in: f64, %o: f32):
    %m = arith.divf %in, %n : f64
    %t = arith.truncf %m : f64 to f32
    linalg.yield %t : f32
  } -> tensor<8x1xf32>
  return %v : tensor<8x1xf32>
}
"""


def test_f64_between_f32_values_is_computed_in_f32(tmp_path):
    """torch-mlir's f64 variance of f32 rows is computed in f32 (as PyTorch's
    own layer norm kernel does): no f64 is left, and the compiled result is
    the f64 one within f32 rounding."""
    from mlir import ir

    from mlir_ansor.graph.normalize import normalize

    program = load(text=VARIANCE)
    normalize(program.module)
    with program.context:
        assert "f64" not in str(program.module).replace("f64 to f32", "")
    path = tmp_path / "var.mlir"
    path.write_text(VARIANCE)
    x = np.random.default_rng(3).standard_normal((8, 96)).astype(np.float32) + 4.0
    got = mlir_ansor.compile(str(path), cache_dir=False)(x)
    np.testing.assert_allclose(got[:, 0], x.astype(np.float64).var(axis=1), rtol=1e-5)
    # f64 that the function takes or returns, or that leaves it other than
    # rounded to f32, stays f64.
    for text in (VARIANCE.replace("%t = arith.truncf %m : f64 to f32", "%t = arith.cmpf ogt, %m, %n : f64")
                 .replace("tensor<8x1xf32>", "tensor<8x1xi1>").replace("%o: f32", "%o: i1").replace(": f32\n  } -> tensor<8x1xi1>", ": i1\n  } -> tensor<8x1xi1>"),
                 VARIANCE.replace("-> tensor<8x1xf32> {", "-> tensor<8x1xf64> {").replace("return %v : tensor<8x1xf32>", "return %ss : tensor<8x1xf64>")):
        program = load(text=text)
        with program.context, ir.Location.unknown():
            from mlir_ansor.graph.precision import narrow_f64_islands

            fn = next(o.operation for o in program.module.body.operations if o.operation.name == "func.func")
            assert narrow_f64_islands(fn) == 0
            assert "tensor<8x96xf64>" in str(program.module)


def test_an_exp_two_ops_repeat_is_computed_once():
    """TVM's softmax spelling (sum of exp(x - max); exp(x - max) / sum)
    evaluates each exp in two tasks; normalized, one elementwise op computes
    it and both read it, and the result is still the softmax."""
    from mlir import ir

    import mlir_ansor.graph.task as graph_task
    from mlir_ansor.examples.workloads import softmax
    from mlir_ansor.graph.normalize import normalize
    from mlir_ansor.graph.share import share_subexpressions
    from mlir_ansor.search.rules.dot_product import weight_packing
    from mlir_ansor.target import Target

    src = softmax(8, 32)
    program = load(text=src)
    normalize(program.module)
    with program.context, ir.Location.unknown():
        assert share_subexpressions(program.module.body.operations[0].operation) == 1
    filecheck(str(program.module), r"""
CHECK-DAG:   #[[ID:\w+]] = affine_map<(d0, d1) -> (d0, d1)>
CHECK-DAG:   #[[ROW:\w+]] = affine_map<(d0, d1) -> (d0)>
CHECK-LABEL: func.func @softmax(
CHECK-SAME:    %[[X:\w+]]: tensor<8x32xf32>)
CHECK:         %[[MAX:\w+]] = linalg.generic {{.*}}"reduction"
CHECK:         %[[EXP:\w+]] = linalg.generic {indexing_maps = [#[[ID]], #[[ROW]], #[[ID]]], iterator_types = ["parallel", "parallel"]}
CHECK-SAME:      ins(%[[X]], %[[MAX]] : tensor<8x32xf32>, tensor<8xf32>)
CHECK:           math.exp
CHECK:         %[[SUM:\w+]] = linalg.generic {indexing_maps = [#[[ID]], #[[ROW]]], iterator_types = ["parallel", "reduction"]}
CHECK-SAME:      ins(%[[EXP]] : tensor<8x32xf32>)
CHECK-NOT:       math.exp
CHECK:         %[[R:\w+]] = linalg.generic
CHECK-SAME:      ins(%[[SUM]], %[[EXP]] : tensor<8xf32>, tensor<8x32xf32>)
CHECK-NOT:       math.exp
CHECK:         return %[[R]]
""")
    # Tasks for a CPU share it (and are one task, computed row by row:
    # `graph.task._merge_rows`); for a GPU (a softmax bound by memory) and
    # with no target named, each task computes its own.
    tasks = extract_tasks(load(text=src), prepack=weight_packing(Target.host()))
    assert [t.kind for t in tasks] == ["reduction"] and tasks[0].flops == 8 * 32 * 5 + 8  # and a reciprocal per row
    graph_task.FUSE_ROWS = False
    try:
        tasks = extract_tasks(load(text=src), prepack=weight_packing(Target.host()))
    finally:
        graph_task.FUSE_ROWS = True
    assert [t.kind for t in tasks] == ["reduction", "elementwise", "reduction", "elementwise"]
    for prepack in (weight_packing(Target.cuda(90)), None):
        assert [t.kind for t in extract_tasks(load(text=src), prepack=prepack)] == ["reduction", "reduction", "elementwise"]
    x = np.random.default_rng(3).uniform(-20, 20, size=(8, 32)).astype(np.float32)
    np.testing.assert_allclose(mlir_ansor.compile(load(text=src))(x), _softmax(x), rtol=1e-5, atol=1e-7)


SHARE_NOT = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#tr = affine_map<(d0, d1) -> (d1, d0)>
#row = affine_map<(d0, d1) -> (d0)>
func.func @f(%x: tensor<16x16xf32>, %m: tensor<16xf32>) -> (tensor<16x16xf32>, tensor<16x16xf32>, tensor<16x16xf32>) {
  %e = tensor.empty() : tensor<16x16xf32>
  // exp(x[i, j])
  %a = linalg.generic {indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x : tensor<16x16xf32>) outs(%e : tensor<16x16xf32>) {
  ^bb0(%v: f32, %o: f32):
    %r = math.exp %v : f32
    linalg.yield %r : f32
  } -> tensor<16x16xf32>
  // exp(x[j, i]): the same tensor through another map, another value
  %b = linalg.generic {indexing_maps = [#tr, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x : tensor<16x16xf32>) outs(%e : tensor<16x16xf32>) {
  ^bb0(%v: f32, %o: f32):
    %r = math.exp %v : f32
    %s = arith.addf %r, %o : f32
    linalg.yield %s : f32
  } -> tensor<16x16xf32>
  // exp(m[i]) twice: one value per row, shared it would be a broadcast
  %c = linalg.generic {indexing_maps = [#row, #id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%m, %a : tensor<16xf32>, tensor<16x16xf32>) outs(%e : tensor<16x16xf32>) {
  ^bb0(%v: f32, %w: f32, %o: f32):
    %r = math.exp %v : f32
    %s = arith.mulf %r, %w : f32
    linalg.yield %s : f32
  } -> tensor<16x16xf32>
  %d = linalg.generic {indexing_maps = [#row, #id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%m, %b : tensor<16xf32>, tensor<16x16xf32>) outs(%e : tensor<16x16xf32>) {
  ^bb0(%v: f32, %w: f32, %o: f32):
    %r = math.exp %v : f32
    %s = arith.addf %r, %w : f32
    linalg.yield %s : f32
  } -> tensor<16x16xf32>
  return %a, %c, %d : tensor<16x16xf32>, tensor<16x16xf32>, tensor<16x16xf32>
}
"""


def test_exps_of_other_values_or_of_fewer_loops_are_left_alone():
    from mlir import ir

    from mlir_ansor.graph.share import share_subexpressions

    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(SHARE_NOT)
        fn = module.body.operations[0].operation
        assert share_subexpressions(fn) == 0
        assert str(module).count("math.exp") == 4


def test_invalid_ir_left_by_a_rewrite_is_an_error_not_an_abort():
    """A rewrite bug that leaves invalid IR (here made by hand: a gathered
    element given the wrong type) is caught by the verifier before a pass
    runs on it; the wheels' MLIR aborted the process in canonicalize."""
    from mlir_ansor.errors import AnsorError
    from mlir_ansor.graph.normalize import normalize

    text = """
    #ids = affine_map<(d0, d1) -> (d0)>
    #out = affine_map<(d0, d1) -> (d0, d1)>
    func.func @embed(%ids: tensor<3xindex>, %table: tensor<10x4xf32>) -> tensor<3x4xf32> {
      %e0 = tensor.empty() : tensor<3x4xf32>
      %r = linalg.generic {indexing_maps = [#ids, #out], iterator_types = ["parallel", "parallel"]}
          ins(%ids : tensor<3xindex>) outs(%e0 : tensor<3x4xf32>) {
      ^bb0(%i: index, %o: f32):
        %col = linalg.index 1 : index
        %e = tensor.extract %table[%i, %col] : tensor<10x4xf32>
        linalg.yield %e : f32
      } -> tensor<3x4xf32>
      return %r : tensor<3x4xf32>
    }"""
    with ir.Context():
        module = ir.Module.parse(text)
        fn = module.body.operations[0].operation
        generic = [op for op in fn.regions[0].blocks[0].operations if op.operation.name == "linalg.generic"][0]
        extract = [op for op in generic.operation.regions[0].blocks[0].operations if op.operation.name == "tensor.extract"][0]
        extract.operation.results[0].set_type(ir.F16Type.get())
        with pytest.raises(AnsorError, match=r"normalizing @embed made invalid IR .*: 'tensor.extract' op"):
            normalize(module)


_BROADCAST_BMM = """
#w = affine_map<(b, k, n) -> (k, n)>
#id = affine_map<(b, k, n) -> (b, k, n)>
func.func @f(%a: tensor<5x3x8xf32>, %w: tensor<8x6xf32>, %x: tensor<5x8x3xf32>) -> (tensor<5x3x6xf32>, tensor<5x8x6xf32>) {
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<5x8x6xf32>
  %b = linalg.generic {indexing_maps = [#w, #id], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%w : tensor<8x6xf32>) outs(%e : tensor<5x8x6xf32>) {
  ^bb0(%i: f32, %o: f32):
    linalg.yield %i : f32
  } -> tensor<5x8x6xf32>
  %c0 = tensor.empty() : tensor<5x3x6xf32>
  %c = linalg.fill ins(%z : f32) outs(%c0 : tensor<5x3x6xf32>) -> tensor<5x3x6xf32>
  %r = linalg.batch_matmul ins(%a, %b : tensor<5x3x8xf32>, tensor<5x8x6xf32>) outs(%c : tensor<5x3x6xf32>) -> tensor<5x3x6xf32>
  %d0 = tensor.empty() : tensor<5x8x6xf32>
  %d = linalg.fill ins(%z : f32) outs(%d0 : tensor<5x8x6xf32>) -> tensor<5x8x6xf32>
  %s = linalg.batch_matmul ins(%x, %r : tensor<5x8x3xf32>, tensor<5x3x6xf32>) outs(%d : tensor<5x8x6xf32>) -> tensor<5x8x6xf32>
  return %r, %s : tensor<5x3x6xf32>, tensor<5x8x6xf32>
}"""


def test_a_batch_matmul_by_a_broadcast_matrix_becomes_one_matmul():
    """ONNX's ``MatMul`` of a 3-D input by a weight comes from torch-mlir as
    a batch matmul of the weight broadcast along the batch (ViT-B/16: 197
    copies of a 768x2304 weight, a 1.4 GB constant once folded); it becomes
    a matmul of the batch and rows joined. A batch matmul of a batched
    right operand is left alone."""
    from mlir_ansor.graph.normalize import unbatch_broadcast_matmuls

    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(_BROADCAST_BMM)
        assert unbatch_broadcast_matmuls(m.body.operations[0].operation) == 1
        m.operation.verify()
        out = str(m)
    filecheck(out, r"""
CHECK-LABEL: func.func @f(
CHECK-SAME:    %[[A:\w+]]: tensor<5x3x8xf32>, %[[W:\w+]]: tensor<8x6xf32>
CHECK:         %[[C:\w+]] = linalg.fill
CHECK:         %[[A2:\w+]] = tensor.collapse_shape %[[A]] {{\[}}[0, 1], [2]] : tensor<5x3x8xf32> into tensor<15x8xf32>
CHECK-NEXT:    %[[C2:\w+]] = tensor.collapse_shape %[[C]] {{\[}}[0, 1], [2]] : tensor<5x3x6xf32> into tensor<15x6xf32>
CHECK-NEXT:    %[[M:\w+]] = linalg.matmul ins(%[[A2]], %[[W]] : tensor<15x8xf32>, tensor<8x6xf32>) outs(%[[C2]] : tensor<15x6xf32>)
CHECK-NEXT:    %[[R:\w+]] = tensor.expand_shape %[[M]] {{\[}}[0, 1], [2]] output_shape [5, 3, 6]
CHECK:         linalg.batch_matmul ins(%{{\w+}}, %[[R]] :
""")
    rng = np.random.default_rng(0)
    a, w, x = (rng.uniform(-1, 1, s).astype(np.float32) for s in ((5, 3, 8), (8, 6), (5, 8, 3)))
    r, s = mlir_ansor.compile(load(text=_BROADCAST_BMM))(a, w, x)
    np.testing.assert_allclose(r, a @ w, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(s, x @ (a @ w), rtol=1e-5, atol=1e-5)


def test_a_constant_broadcast_much_larger_than_its_input_is_not_folded(monkeypatch, caplog):
    """Folding a broadcast of a constant stores a copy of it per row (ViT-B/16
    through ONNX: 1.4 GB per layer, and the compile ran out of memory); past
    `constants.LARGE_BYTES` (lowered here to 1 KB) and 4x the constants it
    reads, it is computed on each call instead, with a warning."""
    import mlir_ansor.graph.constants as constants

    w = np.arange(32, dtype=np.float32).reshape(4, 8)
    dense = "[" + ", ".join("[" + ", ".join(f"{v:.1f}" for v in row) + "]" for row in w) + "]"
    text = f"""
func.func @f(%x: tensor<64x4x8xf32>) -> tensor<64x4x8xf32> {{
  %w = arith.constant dense<{dense}> : tensor<4x8xf32>
  %e = tensor.empty() : tensor<64x4x8xf32>
  %b = linalg.generic {{indexing_maps = [affine_map<(b, k, n) -> (k, n)>, affine_map<(b, k, n) -> (b, k, n)>],
                        iterator_types = ["parallel", "parallel", "parallel"]}} ins(%w : tensor<4x8xf32>) outs(%e : tensor<64x4x8xf32>) {{
  ^bb0(%i: f32, %o: f32):
    %s = arith.mulf %i, %i : f32
    linalg.yield %s : f32
  }} -> tensor<64x4x8xf32>
  %r = linalg.generic {{indexing_maps = [affine_map<(b, k, n) -> (b, k, n)>, affine_map<(b, k, n) -> (b, k, n)>,
                                        affine_map<(b, k, n) -> (b, k, n)>], iterator_types = ["parallel", "parallel", "parallel"]}}
      ins(%x, %b : tensor<64x4x8xf32>, tensor<64x4x8xf32>) outs(%e : tensor<64x4x8xf32>) {{
  ^bb0(%i: f32, %j: f32, %o: f32):
    %s = arith.addf %i, %j : f32
    linalg.yield %s : f32
  }} -> tensor<64x4x8xf32>
  return %r : tensor<64x4x8xf32>
}}"""
    x = np.random.default_rng(0).uniform(-1, 1, (64, 4, 8)).astype(np.float32)
    folded = mlir_ansor.compile(load(text=text), cache_dir=False)
    assert "memref<64x4x8xf32> = dense<" in folded.mlir
    monkeypatch.setattr(constants, "LARGE_BYTES", 1024)
    with caplog.at_level("WARNING", logger="mlir_ansor"):
        cm = mlir_ansor.compile(load(text=text), cache_dir=False)
    assert "memref<64x4x8xf32> = dense<" not in cm.mlir
    assert "computed on each call, not folded" in caplog.text
    np.testing.assert_allclose(cm(x), x + w * w, rtol=1e-6)
    np.testing.assert_allclose(folded(x), x + w * w, rtol=1e-6)
