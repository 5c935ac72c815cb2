"""An attention (scores, softmax, P.V) is one task on a CPU
(`graph.task._merge_attention`), computed a block of query rows at a time
by the ``cpu-attention`` rule; and a division by a broadcast value is a
multiplication by its reciprocal (`graph.normalize.reciprocal_divisors`)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import run_schedule

import mlir_ansor
import mlir_ansor.graph.task as graph_task
from mlir_ansor import TuneConfig, tune
from mlir_ansor.examples import workloads
from mlir_ansor.graph.task import extract_tasks
from mlir_ansor.measure.runner import TimingPolicy
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.search.rules.dot_product import weight_packing
from mlir_ansor.search.sketch import select_knobs
from mlir_ansor.target import Target

AVX2 = Target.cpu("znver3", cores=2)
FAST = TimingPolicy(warmup=0, min_repeat=1, max_repeat=2, min_time_s=0.0)
H, S, D = 2, 48, 16


def _inputs(seed: int = 0, h: int = H, s: int = S, d: int = D) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((h, s, d)).astype(np.float32) * 2
    kt = rng.standard_normal((h, d, s)).astype(np.float32) * 2
    v = rng.standard_normal((h, s, d)).astype(np.float32)
    return [q, kt, v]


def _ref(q, kt, v):
    return workloads.numpy_reference("attention")(q, kt, v).astype(np.float32)


def test_one_task_on_a_cpu_three_elsewhere():
    text = workloads.attention(H, S, D)
    (task,) = extract_tasks(mlir_ansor.load(text=text), prepack=weight_packing(AVX2))
    assert task.name == f"attention_{H}x{S}x{S}x{D}_f32"
    # two matmuls, the scale, max, exp of the difference, sum, multiply by
    # the reciprocal; and the reciprocal of each row sum
    assert task.flops == 2 * (2 * H * S * S * D) + 6 * H * S * S + H * S
    assert [s.name for s in generate_sketches(task.mlir, AVX2)][0] == "cpu-attention"
    # On a GPU, with no target, or with the merge off: the matmuls are
    # tasks of their own.
    for prepack in (weight_packing(Target.cuda(90)), None):
        tasks = extract_tasks(mlir_ansor.load(text=text), prepack=prepack)
        assert sum(1 for t in tasks if t.kind == "contraction") == 2, [t.name for t in tasks]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(graph_task, "FUSE_ATTENTION", False)
        tasks = extract_tasks(mlir_ansor.load(text=text), prepack=weight_packing(AVX2))
    assert [t.kind for t in tasks] == ["contraction", "reduction", "contraction"], [t.name for t in tasks]


def test_what_is_not_joined():
    """The scores also returned (a task has one result), or bf16 (its
    matmuls are the dot-product rules'): the matmuls stay apart."""
    text = workloads.attention(H, S, D)
    both = text.replace("return %O : tensor<2x48x16xf32>", "return %O, %S : tensor<2x48x16xf32>, tensor<2x48x48xf32>").replace(
        "-> tensor<2x48x16xf32> {\n  %zero", "-> (tensor<2x48x16xf32>, tensor<2x48x48xf32>) {\n  %zero"
    )
    assert both != text
    for t in (both, workloads.attention(H, S, D, "bf16")):
        tasks = extract_tasks(mlir_ansor.load(text=t), prepack=weight_packing(Target.cpu("znver4", cores=2)))
        assert not any(x.name.startswith("attention") for x in tasks), [x.name for x in tasks]
        assert sum(1 for x in tasks if x.kind == "contraction") == 2


@pytest.mark.parametrize(
    "values",
    [
        {"r_rows": 6, "r_keys": 16, "u_head": 4, "r_out": 16, "u_keys": 2, "p_d0": 1, "p_d1": 12},
        {"r_rows": 1, "r_keys": 8, "u_head": 1, "r_out": 8, "u_keys": 1, "p_d0": 2, "p_d1": 48},
        {"r_rows": 8, "r_keys": 16, "u_head": 2, "r_out": 16, "u_keys": 4, "p_d0": 1, "p_d1": 24},
    ],
)
def test_register_tiles_compute_the_attention(tmp_path, values):
    (task,) = extract_tasks(mlir_ansor.load(text=workloads.attention(H, S, D)), prepack=weight_packing(AVX2))
    sk = generate_sketches(task.mlir, AVX2)[0]
    assert {k.name for k in sk.knobs} == set(values)
    args = _inputs(seed=values["r_rows"])
    out = np.zeros((H, S, D), np.float32)
    run_schedule(sk.payload, select_knobs(sk.script, values), [*args, out], tmp_path)
    np.testing.assert_allclose(out, _ref(*args), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("r_keys", [16, 32])
def test_keys_no_vector_divides_get_whole_vector_tiles_with_a_peeled_remainder(tmp_path, r_keys):
    """50 keys: besides the divisors up to a vector (1, 2, 5), key tiles of
    whole vectors (3 x 16 + 2, 32 + 18), the remainder peeled."""
    s = 50
    (task,) = extract_tasks(mlir_ansor.load(text=workloads.attention(H, s, D)), prepack=weight_packing(AVX2))
    sk = generate_sketches(task.mlir, AVX2)[0]
    assert sk.name == "cpu-attention"
    assert {k.name: k.options for k in sk.knobs}["r_keys"] == (1, 2, 5, 8, 16, 32)
    values = {"r_rows": 2, "r_keys": r_keys, "u_head": 4, "r_out": 16, "u_keys": 2, "p_d0": 1, "p_d1": 10}
    args = _inputs(seed=r_keys, s=s)
    out = np.zeros((H, s, D), np.float32)
    run_schedule(sk.payload, select_knobs(sk.script, values), [*args, out], tmp_path)
    np.testing.assert_allclose(out, _ref(*args), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(H, S, D), (2, 32, 32)])
def test_default_schedule_matches_numpy(threads, shape):
    """(2, 32, 32): the scores and the output have one shape, and the
    task's two zero fills were one (`search.sketch._fill_per_use` splits them)."""
    args = _inputs(3, *shape)
    got = mlir_ansor.compile(mlir_ansor.load(text=workloads.attention(*shape)), threads=threads)(*args)
    np.testing.assert_allclose(got, _ref(*args), rtol=2e-5, atol=2e-6)


def test_tuned_candidates_build_and_match(tmp_path):
    path = tmp_path / "attention.mlir"
    path.write_text(workloads.attention(4, 64, 32))
    db = tmp_path / "t.db"
    config = TuneConfig(trials=4, batch_size=4, timing=FAST, build_workers=2, build_timeout_s=60, seed=2)
    result = tune(str(path), config=config, db=db)
    (r,) = result.tasks
    assert r.task.name.startswith("attention_") and np.isfinite(r.best_latency_s) and not r.errors, dict(r.errors)
    args = _inputs(seed=4, h=4, s=64, d=32)
    np.testing.assert_allclose(mlir_ansor.compile(str(path), db=db)(*args), _ref(*args), rtol=2e-5, atol=2e-6)


def test_a_division_by_a_row_value_is_a_multiplication():
    """``x / s[row]`` becomes ``x * r[row]`` with ``r = 1 / s`` computed once
    per row; a division by a constant or by a value read per element stays."""
    from mlir import ir

    from mlir_ansor.graph.normalize import reciprocal_divisors
    from mlir_ansor.ir.program import load

    program = load(text=workloads.attention(H, S, D))
    with program.context, ir.Location.unknown():
        fn = program.module.body.operations[0].operation
        assert reciprocal_divisors(fn) == 1
        assert reciprocal_divisors(fn) == 0
        text = str(program.module)
    # the scale (a constant) and the reciprocal itself still divide
    assert text.count("arith.divf") == 2 and "arith.mulf %in" in text
    x = np.random.default_rng(0).uniform(-30, 30, (16, 64)).astype(np.float32)
    got = mlir_ansor.compile(mlir_ansor.load(text=workloads.softmax(16, 64)))(x)
    np.testing.assert_allclose(got, workloads.numpy_reference("softmax")(x.astype(np.float64)), rtol=2e-6, atol=1e-8)
