"""A softmax or a layer norm is one task on a CPU, computed row by row
(`graph.task._merge_rows`, the ``cpu-row-fused`` rule), and the rewrites of
normalization that let torch-mlir's spelling of them join
(`graph.normalize.forward_identity_gathers`, `drop_unit_loops`)."""

from __future__ import annotations

import numpy as np
import pytest

import mlir_ansor
import mlir_ansor.graph.task as graph_task
from mlir_ansor import TuneConfig, tune
from mlir_ansor.graph.task import extract_tasks
from mlir_ansor.measure.runner import TimingPolicy
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.search.rules.dot_product import weight_packing
from mlir_ansor.target import Target

FAST = TimingPolicy(warmup=0, min_repeat=1, max_repeat=2, min_time_s=0.0)
CPU = Target.cpu("znver3", cores=2)

# BERT's attention softmax as torch-mlir writes it: scale, maximum, exp of
# the difference, sum, divide; one empty tensor shared by every op.
SOFTMAX = """
#m = affine_map<(d0, d1, d2) -> (d0, d1, d2)>
#r = affine_map<(d0, d1, d2) -> (d0, d1)>
func.func @attn(%X: tensor<2x16x32xf32>) -> tensor<2x16x32xf32> {
  %ninf = arith.constant 0xFF800000 : f32
  %zero = arith.constant 0.0 : f32
  %c8 = arith.constant 8.0 : f32
  %er = tensor.empty() : tensor<2x16xf32>
  %e = tensor.empty() : tensor<2x16x32xf32>
  %s = linalg.generic {indexing_maps = [#m, #m], iterator_types = ["parallel", "parallel", "parallel"]} ins(%X : tensor<2x16x32xf32>) outs(%e : tensor<2x16x32xf32>) {
  ^bb0(%x: f32, %o: f32):
    %v = arith.divf %x, %c8 : f32
    linalg.yield %v : f32
  } -> tensor<2x16x32xf32>
  %mi = linalg.fill ins(%ninf : f32) outs(%er : tensor<2x16xf32>) -> tensor<2x16xf32>
  %mx = linalg.generic {indexing_maps = [#m, #r], iterator_types = ["parallel", "parallel", "reduction"]} ins(%s : tensor<2x16x32xf32>) outs(%mi : tensor<2x16xf32>) {
  ^bb0(%x: f32, %a: f32):
    %v = arith.maximumf %x, %a : f32
    linalg.yield %v : f32
  } -> tensor<2x16xf32>
  %ex = linalg.generic {indexing_maps = [#m, #r, #m], iterator_types = ["parallel", "parallel", "parallel"]} ins(%s, %mx : tensor<2x16x32xf32>, tensor<2x16xf32>) outs(%e : tensor<2x16x32xf32>) {
  ^bb0(%x: f32, %m: f32, %o: f32):
    %d = arith.subf %x, %m : f32
    %v = math.exp %d : f32
    linalg.yield %v : f32
  } -> tensor<2x16x32xf32>
  %si = linalg.fill ins(%zero : f32) outs(%er : tensor<2x16xf32>) -> tensor<2x16xf32>
  %sm = linalg.generic {indexing_maps = [#m, #r], iterator_types = ["parallel", "parallel", "reduction"]} ins(%ex : tensor<2x16x32xf32>) outs(%si : tensor<2x16xf32>) {
  ^bb0(%x: f32, %a: f32):
    %v = arith.addf %x, %a : f32
    linalg.yield %v : f32
  } -> tensor<2x16xf32>
  %o = linalg.generic {indexing_maps = [#m, #r, #m], iterator_types = ["parallel", "parallel", "parallel"]} ins(%ex, %sm : tensor<2x16x32xf32>, tensor<2x16xf32>) outs(%e : tensor<2x16x32xf32>) {
  ^bb0(%x: f32, %d: f32, %out: f32):
    %v = arith.divf %x, %d : f32
    linalg.yield %v : f32
  } -> tensor<2x16x32xf32>
  RETURN
}
"""


def _softmax_ref(x: np.ndarray) -> np.ndarray:
    s = x.astype(np.float64) / 8.0
    e = np.exp(s - s.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)).astype(np.float32)


# A residual add and a layer norm as torch-mlir writes them: keepdim means
# are reductions to [1, 8] expanded to [1, 8, 1], divided there, and read
# back through maps with a constant 0.
LAYER_NORM = """
#m = affine_map<(d0, d1, d2) -> (d0, d1, d2)>
#r = affine_map<(d0, d1, d2) -> (d0, d1)>
#b = affine_map<(d0, d1, d2) -> (d0, d1, 0)>
#c = affine_map<(d0, d1, d2) -> (d2)>
func.func @ln(%x: tensor<1x8x64xf32>, %res: tensor<1x8x64xf32>, %g: tensor<64xf32>, %bias: tensor<64xf32>) -> tensor<1x8x64xf32> {
  %zero = arith.constant 0.0 : f32
  %n = arith.constant 64.0 : f32
  %eps = arith.constant 1.0e-05 : f32
  %e = tensor.empty() : tensor<1x8x64xf32>
  %e1 = tensor.empty() : tensor<1x8x1xf32>
  %er = tensor.empty() : tensor<1x8xf32>
  %a = linalg.generic {indexing_maps = [#m, #m, #m], iterator_types = ["parallel", "parallel", "parallel"]} ins(%x, %res : tensor<1x8x64xf32>, tensor<1x8x64xf32>) outs(%e : tensor<1x8x64xf32>) {
  ^bb0(%p: f32, %q: f32, %o: f32):
    %v = arith.addf %p, %q : f32
    linalg.yield %v : f32
  } -> tensor<1x8x64xf32>
  %z = linalg.fill ins(%zero : f32) outs(%er : tensor<1x8xf32>) -> tensor<1x8xf32>
  %s = linalg.generic {indexing_maps = [#m, #r], iterator_types = ["parallel", "parallel", "reduction"]} ins(%a : tensor<1x8x64xf32>) outs(%z : tensor<1x8xf32>) {
  ^bb0(%p: f32, %acc: f32):
    %v = arith.addf %p, %acc : f32
    linalg.yield %v : f32
  } -> tensor<1x8xf32>
  %s3 = tensor.expand_shape %s [[0], [1, 2]] output_shape [1, 8, 1] : tensor<1x8xf32> into tensor<1x8x1xf32>
  %mean = linalg.generic {indexing_maps = [#m, #m], iterator_types = ["parallel", "parallel", "parallel"]} ins(%s3 : tensor<1x8x1xf32>) outs(%e1 : tensor<1x8x1xf32>) {
  ^bb0(%p: f32, %o: f32):
    %v = arith.divf %p, %n : f32
    linalg.yield %v : f32
  } -> tensor<1x8x1xf32>
  %c = linalg.generic {indexing_maps = [#m, #b, #m], iterator_types = ["parallel", "parallel", "parallel"]} ins(%a, %mean : tensor<1x8x64xf32>, tensor<1x8x1xf32>) outs(%e : tensor<1x8x64xf32>) {
  ^bb0(%p: f32, %q: f32, %o: f32):
    %v = arith.subf %p, %q : f32
    linalg.yield %v : f32
  } -> tensor<1x8x64xf32>
  %sq = linalg.generic {indexing_maps = [#m, #m], iterator_types = ["parallel", "parallel", "parallel"]} ins(%c : tensor<1x8x64xf32>) outs(%e : tensor<1x8x64xf32>) {
  ^bb0(%p: f32, %o: f32):
    %v = arith.mulf %p, %p : f32
    linalg.yield %v : f32
  } -> tensor<1x8x64xf32>
  %z2 = linalg.fill ins(%zero : f32) outs(%er : tensor<1x8xf32>) -> tensor<1x8xf32>
  %vs = linalg.generic {indexing_maps = [#m, #r], iterator_types = ["parallel", "parallel", "reduction"]} ins(%sq : tensor<1x8x64xf32>) outs(%z2 : tensor<1x8xf32>) {
  ^bb0(%p: f32, %acc: f32):
    %v = arith.addf %p, %acc : f32
    linalg.yield %v : f32
  } -> tensor<1x8xf32>
  %vs3 = tensor.expand_shape %vs [[0], [1, 2]] output_shape [1, 8, 1] : tensor<1x8xf32> into tensor<1x8x1xf32>
  %rs = linalg.generic {indexing_maps = [#m, #m], iterator_types = ["parallel", "parallel", "parallel"]} ins(%vs3 : tensor<1x8x1xf32>) outs(%e1 : tensor<1x8x1xf32>) {
  ^bb0(%p: f32, %o: f32):
    %v = arith.divf %p, %n : f32
    %w = arith.addf %v, %eps : f32
    %y = math.rsqrt %w : f32
    linalg.yield %y : f32
  } -> tensor<1x8x1xf32>
  %y = linalg.generic {indexing_maps = [#m, #b, #c, #c, #m], iterator_types = ["parallel", "parallel", "parallel"]} ins(%c, %rs, %g, %bias : tensor<1x8x64xf32>, tensor<1x8x1xf32>, tensor<64xf32>, tensor<64xf32>) outs(%e : tensor<1x8x64xf32>) {
  ^bb0(%p: f32, %q: f32, %gg: f32, %bb: f32, %o: f32):
    %v = arith.mulf %p, %q : f32
    %w = arith.mulf %v, %gg : f32
    %u = arith.addf %w, %bb : f32
    linalg.yield %u : f32
  } -> tensor<1x8x64xf32>
  return %y : tensor<1x8x64xf32>
}
"""


def _layer_norm_ref(x, res, g, b):
    a = (x + res).astype(np.float64)
    c = a - a.mean(-1, keepdims=True)
    return (c / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-5) * g + b).astype(np.float32)


def _softmax_text(ret: str = "return %o : tensor<2x16x32xf32>") -> str:
    return SOFTMAX.replace("RETURN", ret)


def _case(name: str):
    """(MLIR, numpy reference) of the softmax or the layer norm."""
    return (_softmax_text(), _softmax_ref) if name == "softmax" else (LAYER_NORM, _layer_norm_ref)


def _inputs(text: str, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    if "@ln" in text:
        return [rng.standard_normal((1, 8, 64)).astype(np.float32) * 3 for _ in range(2)] + [
            rng.standard_normal(64).astype(np.float32) for _ in range(2)
        ]
    return [rng.uniform(-40, 40, (2, 16, 32)).astype(np.float32)]


@pytest.mark.parametrize("name", ["softmax", "layer_norm"])
def test_one_task_on_a_cpu_several_elsewhere(name):
    text, _ = _case(name)
    (task,) = extract_tasks(mlir_ansor.load(text=text), prepack=weight_packing(CPU))
    assert task.kind == "reduction"
    # every op of the chain is in it: 6 (softmax) or 8 (layer norm)
    # arithmetic ops per element, the softmax's reciprocal of each row sum
    # and the layer norm's 4 per row
    if name == "softmax":
        assert task.flops == 2 * 16 * 32 * 6 + 2 * 16
    else:
        assert task.flops == 8 * 64 * 8 + 8 * 4
    names = [s.name for s in generate_sketches(task.mlir, CPU)]
    assert names[0] == "cpu-row-fused", names
    # On a GPU (warp reductions take them one by one), with no target, or
    # with the merge off, each reduction is a task of its own.
    for prepack in (weight_packing(Target.cuda(90)), None):
        tasks = extract_tasks(mlir_ansor.load(text=text), prepack=prepack)
        assert sum(1 for t in tasks if t.kind == "reduction") == 2, [t.name for t in tasks]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graph_task, "FUSE_ROWS", False)
        tasks = extract_tasks(mlir_ansor.load(text=text), prepack=weight_packing(CPU))
    assert sum(1 for t in tasks if t.kind == "reduction") == 2


def test_a_value_read_outside_the_chain_stops_the_merge():
    """The maximum is also returned: a task has one result, so the ops that
    make it stay tasks of their own (the scale, the exp and the divide are
    still merged with what they can)."""
    text = _softmax_text(
        "return %o, %mx : tensor<2x16x32xf32>, tensor<2x16xf32>"
    ).replace("-> tensor<2x16x32xf32> {\n  %ninf", "-> (tensor<2x16x32xf32>, tensor<2x16xf32>) {\n  %ninf")
    tasks = extract_tasks(mlir_ansor.load(text=text), prepack=weight_packing(CPU))
    assert all(len(t.outputs) == 1 for t in tasks)
    assert any("maximumf" in t.mlir and "math.exp" not in t.mlir for t in tasks), [t.name for t in tasks]
    got = mlir_ansor.compile(mlir_ansor.load(text=text), target=CPU)(*_inputs(text))
    np.testing.assert_allclose(got[0], _softmax_ref(*_inputs(text)), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["softmax", "layer_norm"])
@pytest.mark.parametrize("threads", [1, 2])
def test_row_fused_default_schedule_matches_numpy(name, threads):
    text, ref = _case(name)
    args = _inputs(text)
    got = mlir_ansor.compile(mlir_ansor.load(text=text), threads=threads)(*args)
    np.testing.assert_allclose(got, ref(*args), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("name", ["softmax", "layer_norm"])
def test_row_fused_candidates_build_and_match(tmp_path, name):
    text, ref = _case(name)
    path = tmp_path / f"{name}.mlir"
    path.write_text(text)
    db = tmp_path / "t.db"
    result = tune(
        str(path),
        config=TuneConfig(trials=4, batch_size=4, timing=FAST, build_workers=2, build_timeout_s=60, seed=5),
        db=db,
    )
    (r,) = result.tasks
    assert np.isfinite(r.best_latency_s) and not r.errors, dict(r.errors)
    args = _inputs(text, seed=1)
    got = mlir_ansor.compile(str(path), db=db)(*args)
    np.testing.assert_allclose(got, ref(*args), rtol=2e-5, atol=2e-6)


GATHER = """
#m = affine_map<(d0, d1, d2) -> (d0, d1, d2)>
func.func @g(%x: tensor<1x4x8xf32>) -> tensor<1x4x8xf32> {
  %c0 = arith.constant 0 : index
  %e = tensor.empty() : tensor<1x4x8xf32>
  %y = linalg.generic {indexing_maps = [#m], iterator_types = ["parallel", "parallel", "parallel"]} outs(%e : tensor<1x4x8xf32>) {
  ^bb0(%out: f32):
    %i = linalg.index 1 : index
    %j = linalg.index 2 : index
    %v = tensor.extract %x[%c0, INDICES] : tensor<1x4x8xf32>
    linalg.yield %v : f32
  } -> tensor<1x4x8xf32>
  %z = linalg.generic {indexing_maps = [#m, #m], iterator_types = ["parallel", "parallel", "parallel"]} ins(%y : tensor<1x4x8xf32>) outs(%e : tensor<1x4x8xf32>) {
  ^bb0(%p: f32, %o: f32):
    %w = arith.addf %p, %p : f32
    linalg.yield %w : f32
  } -> tensor<1x4x8xf32>
  return %z : tensor<1x4x8xf32>
}
"""


def test_an_identity_gather_is_forwarded():
    """torch-mlir's dynamic `expand`, at a static size, is a generic that
    copies its input through `tensor.extract`: forwarded, it is no task."""
    from mlir import ir

    from mlir_ansor.graph.normalize import forward_identity_gathers
    from mlir_ansor.ir.program import load

    for indices, forwarded in (("%i, %j", 1), ("%i, %i", 0)):
        program = load(text=GATHER.replace("INDICES", indices))
        fn = program.module.body.operations[0].operation
        with program.context, ir.Location.unknown():
            assert forward_identity_gathers(fn) == forwarded
        assert ("tensor.extract" in str(program.module)) is (not forwarded)
    text = GATHER.replace("INDICES", "%i, %j")
    (task,) = extract_tasks(mlir_ansor.load(text=text))
    x = np.arange(32, dtype=np.float32).reshape(1, 4, 8)
    np.testing.assert_array_equal(mlir_ansor.compile(mlir_ansor.load(text=text))(x), 2 * x)


ACTIVATION_AFTER_EXPAND = """
#m = affine_map<(d0, d1, d2) -> (d0, d1, d2)>
func.func @ffn(%x: tensor<8x16xf32>, %w: tensor<16x32xf32>) -> tensor<1x8x32xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<8x32xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e : tensor<8x32xf32>) -> tensor<8x32xf32>
  %mm = linalg.matmul ins(%x, %w : tensor<8x16xf32>, tensor<16x32xf32>) outs(%z : tensor<8x32xf32>) -> tensor<8x32xf32>
  %ex = tensor.expand_shape %mm [[0, 1], [2]] output_shape [1, 8, 32] : tensor<8x32xf32> into tensor<1x8x32xf32>
  %e3 = tensor.empty() : tensor<1x8x32xf32>
  %g = linalg.generic {indexing_maps = [#m, #m], iterator_types = ["parallel", "parallel", "parallel"]} ins(%ex : tensor<1x8x32xf32>) outs(%e3 : tensor<1x8x32xf32>) {
  ^bb0(%p: f32, %o: f32):
    %t = math.tanh %p : f32
    linalg.yield %t : f32
  } -> tensor<1x8x32xf32>
  return %g : tensor<1x8x32xf32>
}
"""


def test_an_activation_after_an_expand_joins_its_matmul():
    """torch-mlir expands a linear layer's [s, n] result to [1, s, n] for
    the activation after it (BERT's GELU); normalized (`drop_unit_loops`),
    the activation reads the matmul's result and is fused into its task,
    instead of a task that reads and writes the whole tensor again."""
    (task,) = extract_tasks(mlir_ansor.load(text=ACTIVATION_AFTER_EXPAND))
    assert task.kind == "contraction" and "math.tanh" in task.mlir, task.name
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((8, 16)).astype(np.float32), rng.standard_normal((16, 32)).astype(np.float32)
    got = mlir_ansor.compile(mlir_ansor.load(text=ACTIVATION_AFTER_EXPAND))(x, w)
    np.testing.assert_allclose(got, np.tanh(x @ w)[None], rtol=1e-5, atol=1e-5)
