"""Transposes folded into the contractions that read them
(mlir_ansor.graph.fold_transpose), and the TBG subgraph tuned."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import filecheck
from mlir import ir

from mlir_ansor import TuneConfig, compile, load, tune
from mlir_ansor.examples import workloads
from mlir_ansor.graph.fold_transpose import fold_output_transposes, fold_transposes
from mlir_ansor.graph.task import extract_tasks
from mlir_ansor.measure.runner import TimingPolicy

PERMUTING_GENERIC = """
func.func @f(%a: tensor<8x16xf32>, %b: tensor<8x4xf32>) -> (tensor<16x4xf32>, tensor<16x8xf32>) {
  %e = tensor.empty() : tensor<16x8xf32>
  %t = linalg.generic {indexing_maps = [affine_map<(i, j) -> (j, i)>, affine_map<(i, j) -> (i, j)>],
                       iterator_types = ["parallel", "parallel"]} ins(%a : tensor<8x16xf32>) outs(%e : tensor<16x8xf32>) {
  ^bb0(%x: f32, %o: f32):
    linalg.yield %x : f32
  } -> tensor<16x8xf32>
  %z = arith.constant 0.0 : f32
  %e2 = tensor.empty() : tensor<16x4xf32>
  %f = linalg.fill ins(%z : f32) outs(%e2 : tensor<16x4xf32>) -> tensor<16x4xf32>
  %r = linalg.matmul ins(%t, %b : tensor<16x8xf32>, tensor<8x4xf32>) outs(%f : tensor<16x4xf32>) -> tensor<16x4xf32>
  %e3 = tensor.empty() : tensor<16x8xf32>
  %t2 = linalg.transpose ins(%a : tensor<8x16xf32>) outs(%e3 : tensor<16x8xf32>) permutation = [1, 0]
  return %r, %t2 : tensor<16x4xf32>, tensor<16x8xf32>
}
"""


def test_batch_matmul_reads_q_untransposed_and_keeps_k_transposed():
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(workloads.transpose_batch_matmul(16, 2, 8))
        # Q's transpose folds (the contraction reads Q[m, b, k]: its rows).
        # K's stays: folded, the scores' columns (the vector loop) would read
        # K's rows, a stride of h*d floats between lanes.
        assert fold_transposes(m, m.body.operations[0].operation) == 1
        assert m.operation.verify()
        text = str(m)
    # Q (s, h, d) read as Q[m, b, k]; K^T (h, d, s) read as K^T[b, k, n]; out
    # (b, m, n), by a generic contraction in place of the batch_matmul
    filecheck(text, r"""
CHECK-DAG:   #[[MAP_Q:\w+]] = affine_map<(d0, d1, d2, d3) -> (d1, d0, d3)>
CHECK-DAG:   #[[MAP_K:\w+]] = affine_map<(d0, d1, d2, d3) -> (d0, d3, d2)>
CHECK-DAG:   #[[MAP_O:\w+]] = affine_map<(d0, d1, d2, d3) -> (d0, d1, d2)>
CHECK-LABEL: func.func @transpose_batch_matmul(
CHECK-SAME:    %[[Q:\w+]]: tensor<16x2x8xf32>, %[[K:\w+]]: tensor<16x2x8xf32>)
CHECK-NOT:     linalg.transpose ins(%[[Q]]
CHECK:         %[[KT:\w+]] = linalg.transpose ins(%[[K]] : tensor<16x2x8xf32>) outs(%{{\w+}} : tensor<2x8x16xf32>) permutation = [1, 2, 0]
CHECK-NOT:     linalg.transpose
CHECK:         %[[R:\w+]] = linalg.generic {indexing_maps = [#[[MAP_Q]], #[[MAP_K]], #[[MAP_O]]]
CHECK-SAME:      iterator_types = ["parallel", "parallel", "parallel", "reduction"]
CHECK-SAME:      ins(%[[Q]], %[[KT]] : tensor<16x2x8xf32>, tensor<2x8x16xf32>)
CHECK-NOT:     linalg.transpose
CHECK:         return %[[R]]
""")
    filecheck(text, "CHECK-NOT: linalg.batch_matmul")


def test_transposes_of_narrow_values_stay():
    """A bf16 batch matmul keeps its transposed operands: the dot-product
    rules pack a plain batch matmul's operands for vdpbf16ps; read through
    the heads' permuted maps, a bf16 BERT's attention contractions ran on
    widening FMAs, 1.8x slower."""
    text = workloads.transpose_batch_matmul(16, 2, 8).replace("f32", "bf16")
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(text)
        assert fold_transposes(m, m.body.operations[0].operation) == 0
    names = sorted(t.name for t in extract_tasks(load(text=text)))
    assert names == ["batch_matmul_2x16x16x8_bf16_f32_truncf", "transpose_2x16x8_bf16", "transpose_2x8x16_bf16"], names


def test_only_transposes_that_feed_reductions_only_fold():
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(PERMUTING_GENERIC)
        # The permuting generic feeds the matmul: folded. The linalg.transpose
        # is a result of the function: kept.
        assert fold_transposes(m, m.body.operations[0].operation) == 1
        assert m.operation.verify()
        text = str(m)
    # the matmul, now a generic, reads %a through the permutation; the
    # permuting generic is gone; the returned transpose stays
    filecheck(text, r"""
CHECK:       #[[MAP_A:\w+]] = affine_map<(d0, d1, d2) -> (d2, d0)>
CHECK-LABEL: func.func @f(
CHECK-SAME:    %[[A:\w+]]: tensor<8x16xf32>, %[[B:\w+]]: tensor<8x4xf32>)
CHECK-NOT:     linalg.transpose
CHECK:         %[[R:\w+]] = linalg.generic {indexing_maps = [#[[MAP_A]],
CHECK-SAME:      iterator_types = ["parallel", "parallel", "reduction"]
CHECK-SAME:      ins(%[[A]], %[[B]] : tensor<8x16xf32>, tensor<8x4xf32>)
CHECK-NOT:     linalg.generic
CHECK:         %[[T:\w+]] = linalg.transpose ins(%[[A]] : tensor<8x16xf32>) outs(%{{\w+}} : tensor<16x8xf32>) permutation = [1, 0]
CHECK-NOT:     linalg.generic
CHECK-NEXT:    return %[[R]], %[[T]]
""")
    filecheck(text, "CHECK-COUNT-1: linalg.generic\nCHECK-NOT: linalg.generic")


@pytest.mark.slow
def test_tbg_tunes_and_matches_numpy(tmp_path):
    text = workloads.transpose_batch_matmul(16, 2, 8)
    program = load(text=text)
    tasks = extract_tasks(program)
    assert sorted(t.flops for t in tasks) == [0, 2 * 2 * 16 * 16 * 8]  # K's transpose, the contraction
    fast = TimingPolicy(warmup=0, min_repeat=1, max_repeat=2, min_time_s=0.0)
    result = tune(program, config=TuneConfig(trials=4, batch_size=4, timing=fast), db=tmp_path / "t.db")
    assert np.isfinite(result.tasks[0].best_latency_s)
    fn = compile(load(text=text), db=tmp_path / "t.db")
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((16, 2, 8)).astype(np.float32) for _ in range(2))
    np.testing.assert_allclose(fn(q, k), workloads.numpy_reference("transpose_batch_matmul")(q, k), rtol=1e-4, atol=1e-4)


def test_depends_on_arguments_on_a_chain_deeper_than_the_stack():
    """ResNet-50 imported from a torch.compile graph: a transpose at its end
    reads a chain of a few hundred ops; the walk back must not recurse."""
    import sys

    from mlir_ansor.ir.rewrite import depends_on_arguments

    n = sys.getrecursionlimit() * 2
    lines = ["func.func @f(%a: f32) -> (f32, f32) {", "  %c0 = arith.constant 1.0 : f32", "  %v0 = arith.addf %a, %a : f32"]
    for i in range(1, n):
        lines.append(f"  %v{i} = arith.mulf %v{i - 1}, %c0 : f32")
        lines.append(f"  %c{i} = arith.addf %c{i - 1}, %c{i - 1} : f32")
    lines += [f"  return %v{n - 1}, %c{n - 1} : f32, f32", "}"]
    program = load(text="\n".join(lines))
    with program.context:
        ret = list(program.module.body.operations)[0].regions[0].blocks[0].operations[-1]
        seen: dict = {}
        assert depends_on_arguments(ret.operands[0], seen) is True
        assert depends_on_arguments(ret.operands[1], seen) is False  # constants only
        assert depends_on_arguments(ret.operands[0], {}) is True  # and without a warm cache


def test_attention_block_reads_q_v_and_writes_its_output_in_place():
    """torch-mlir's heads split and merge around an attention: Q's and V's
    transposes fold through the collapse of their unit batch, the output's
    into P.V's output map; K's stays (its fold would stride the scores'
    vector loop)."""
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(workloads.attention_block(2, 32, 16))
        fn = m.body.operations[0].operation
        assert fold_transposes(m, fn) == 2
        assert fold_output_transposes(m, fn) == 1
        assert m.operation.verify()
        text = str(m)
    filecheck(text, r"""
CHECK-DAG:   #[[MAP_Q:\w+]] = affine_map<(d0, d1, d2, d3) -> (d1, d0, d3)>
CHECK-DAG:   #[[MAP_V:\w+]] = affine_map<(d0, d1, d2, d3) -> (d3, d0, d2)>
CHECK-DAG:   #[[MAP_O:\w+]] = affine_map<(d0, d1, d2, d3) -> (d1, d0, d2)>
CHECK-LABEL: func.func @attention_block(
CHECK:         %[[Q:\w+]] = tensor.collapse_shape %{{\w+}} {{\[\[}}0, 1], [2], [3]] : tensor<1x32x2x16xf32> into tensor<32x2x16xf32>
CHECK:         linalg.transpose ins(%{{\w+}} : tensor<1x32x2x16xf32>) outs(%{{\w+}} : tensor<1x2x16x32xf32>) permutation = [0, 2, 3, 1]
CHECK:         %[[V:\w+]] = tensor.collapse_shape %{{\w+}} {{\[\[}}0, 1], [2], [3]] : tensor<1x32x2x16xf32> into tensor<32x2x16xf32>
CHECK:         linalg.generic {indexing_maps = [#[[MAP_Q]],
CHECK-SAME:      ins(%[[Q]],
CHECK:         %[[INIT:\w+]] = linalg.fill ins(%{{\w+}} : f32) outs(%{{\w+}} : tensor<32x2x16xf32>)
CHECK:         %[[O:\w+]] = linalg.generic {indexing_maps = [#{{\w+}}, #[[MAP_V]], #[[MAP_O]]]
CHECK-SAME:      ins(%{{\w+}}, %[[V]] : tensor<2x32x32xf32>, tensor<32x2x16xf32>) outs(%[[INIT]] : tensor<32x2x16xf32>)
CHECK:         %[[E:\w+]] = tensor.expand_shape %[[O]] {{\[\[}}0, 1], [2], [3]] output_shape [1, 32, 2, 16]
CHECK:         %[[R:\w+]] = tensor.collapse_shape %[[E]] {{\[\[}}0, 1], [2, 3]] : tensor<1x32x2x16xf32> into tensor<32x32xf32>
CHECK:         return %[[R]]
""")
    filecheck(text, "CHECK-COUNT-1: linalg.transpose\nCHECK-NOT: linalg.transpose")


def test_a_transpose_that_moves_the_last_dimension_of_a_result_stays():
    """A contraction's result transposed so its last dimension moves: folded,
    the contraction would write its vector loop across a stride."""
    text = """
func.func @f(%a: tensor<8x16xf32>, %b: tensor<16x4xf32>) -> tensor<4x8xf32> {
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<8x4xf32>
  %f = linalg.fill ins(%z : f32) outs(%e : tensor<8x4xf32>) -> tensor<8x4xf32>
  %r = linalg.matmul ins(%a, %b : tensor<8x16xf32>, tensor<16x4xf32>) outs(%f : tensor<8x4xf32>) -> tensor<8x4xf32>
  %e2 = tensor.empty() : tensor<4x8xf32>
  %t = linalg.transpose ins(%r : tensor<8x4xf32>) outs(%e2 : tensor<4x8xf32>) permutation = [1, 0]
  return %t : tensor<4x8xf32>
}
"""
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(text)
        assert fold_output_transposes(m, m.body.operations[0].operation) == 0
        assert m.operation.verify()
        # untouched: the matmul is not even generalized
        filecheck(str(m), "CHECK: linalg.matmul\nCHECK: linalg.transpose ins(%{{\\w+}} : tensor<8x4xf32>)")


@pytest.mark.parametrize("threads, s", [(1, 32), (2, 32), (1, 16)])
def test_attention_block_is_one_task_and_matches_numpy(threads, s):
    """On a CPU the block is K's transpose and one attention task, and its
    default schedule (Q, V and the output read and written with the heads'
    stride) matches numpy; also where the sequence length equals the head
    dimension, and the scores and the output share one zero fill."""
    from mlir_ansor.search.rules.dot_product import weight_packing
    from mlir_ansor.target import Target

    h, d = 2, 16
    text = workloads.attention_block(h, s, d)
    if s == d:  # one zero fill for both, as torch-mlir writes it
        text = text.replace("outs(%fo :", "outs(%f :")
    names = [t.name for t in extract_tasks(load(text=text), prepack=weight_packing(Target.host()))]
    assert names == [f"transpose_1x{h}x{d}x{s}_f32", f"attention_{h}x{s}x{s}x{d}_f32"]
    fn = compile(load(text=text), threads=threads)
    rng = np.random.default_rng(threads)
    q, k, v = (rng.standard_normal((s, h * d)).astype(np.float32) for _ in range(3))
    want = workloads.attention_block_reference(h)(q, k, v)
    np.testing.assert_allclose(fn(q, k, v), want, rtol=1e-4, atol=1e-5)


def test_a_transposed_result_of_dynamic_shape_stays():
    """The output fold makes the result's init anew in the permuted shape,
    which needs static sizes: a dynamic one is left as it is."""
    text = """
func.func @f(%a: tensor<?x8x16xf32>, %b: tensor<?x16x4xf32>) -> tensor<8x?x4xf32> {
  %c0 = arith.constant 0 : index
  %z = arith.constant 0.0 : f32
  %n = tensor.dim %a, %c0 : tensor<?x8x16xf32>
  %e = tensor.empty(%n) : tensor<?x8x4xf32>
  %f = linalg.fill ins(%z : f32) outs(%e : tensor<?x8x4xf32>) -> tensor<?x8x4xf32>
  %r = linalg.batch_matmul ins(%a, %b : tensor<?x8x16xf32>, tensor<?x16x4xf32>) outs(%f : tensor<?x8x4xf32>) -> tensor<?x8x4xf32>
  %e2 = tensor.empty(%n) : tensor<8x?x4xf32>
  %t = linalg.transpose ins(%r : tensor<?x8x4xf32>) outs(%e2 : tensor<8x?x4xf32>) permutation = [1, 0, 2]
  return %t : tensor<8x?x4xf32>
}
"""
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(text)
        assert fold_output_transposes(m, m.body.operations[0].operation) == 0
        assert m.operation.verify()
        filecheck(str(m), "CHECK: linalg.transpose ins(%{{\\w+}} : tensor<?x8x4xf32>)")
