"""Sketch rules: which rule applies to which op (by structure), golden knob
lists, and end-to-end tuning of every op family, checked against the
reference (and, where the workload has one, numpy)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import PANELS_MATMUL, run_schedule

import mlir_ansor
from mlir_ansor import TuneConfig, tune
from mlir_ansor.examples import workloads
from mlir_ansor.graph.task import extract_tasks
from mlir_ansor.measure.runner import TimingPolicy
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.search.sketch import select_knobs
from mlir_ansor.search.space import is_valid, make_assignment
from mlir_ansor.target import Target

AVX2 = Target("cpu", 256, 2, "test", ("avx2", "fma"))
FAST = TimingPolicy(warmup=0, min_repeat=1, max_repeat=2, min_time_s=0.0)


def _sketch_names(text: str, tmp_path) -> list[list[str]]:
    path = tmp_path / "w.mlir"
    path.write_text(text)
    return [[s.name for s in generate_sketches(t.mlir, AVX2)] for t in extract_tasks(str(path))]


@pytest.mark.parametrize(
    "text, expected",
    [
        (workloads.matmul(64, 64, 32), ["cpu-contraction", "cpu-default"]),
        (workloads.matmul_transposed_b(64, 64, 32), ["cpu-contraction", "cpu-default"]),
        (workloads.batch_matmul(2, 32, 32, 16), ["cpu-contraction", "cpu-default"]),
        (workloads.conv2d_nhwc(1, 10, 10, 8, 16, 3, 3), ["cpu-contraction", "cpu-default"]),
        (workloads.pool2d_nhwc(1, 10, 10, 8, 3, 1, "max"), ["cpu-contraction", "cpu-default"]),
        (workloads.reduce_last(16, 64), ["cpu-reduction", "cpu-default"]),
        (workloads.elementwise_add_relu(16, 64), ["cpu-elementwise", "cpu-default"]),
        # No 1-D decomposition upstream: normalization makes it 2-D
        # convolutions over the depth window (graph/split_conv.py).
        (workloads.conv3d_ndhwc(1, 4, 6, 6, 4, 8, 3), ["cpu-contraction", "cpu-default"]),
    ],
)
def test_rule_choice_follows_structure(tmp_path, text, expected):
    assert _sketch_names(text, tmp_path)[0] == expected


CUDA = Target.cuda(90)

#: Workloads that between them make every CPU and every GPU rule apply.
TARGET_CASES = {
    "matmul": workloads.matmul(64, 64, 32),
    "matmul_f16": workloads.matmul(128, 128, 64, "f16"),
    "matmul_bf16": workloads.matmul(64, 64, 32, "bf16"),
    "conv2d": workloads.conv2d_nhwc(1, 10, 10, 8, 16, 3, 3),
    "reduce": workloads.reduce_last(16, 64),
    "elementwise": workloads.elementwise_add_relu(16, 64),
    "softmax": workloads.softmax(16, 64),
}


def _contexts(text: str) -> list:
    """(task, CPU context, cuda context) of each task of `text` (the f16
    matmul as a hand-written task that accumulates in f16: extraction makes
    it accumulate in f32 and round once, `graph.precision`, a form the GPU
    tensor-core rules do not take yet)."""
    from mlir_ansor.search.rules import SketchContext
    from mlir_ansor.search.sketch import prepare_payload

    if text == TARGET_CASES["matmul_f16"]:
        tasks = [text]
    else:
        tasks = [t.mlir for t in extract_tasks(mlir_ansor.load(text=text))]
    out = []
    for t in tasks:
        payload, ops = prepare_payload(t)
        anchor = next((o for o in ops if o.role == "anchor"), ops[-1])
        out.append((t, SketchContext(payload, ops, anchor, AVX2), SketchContext(payload, ops, anchor, CUDA)))
    return out


@pytest.mark.parametrize("name", sorted(TARGET_CASES))
def test_rules_serve_their_own_kind_of_target(name):
    """Each rule's condition reads the target: a CPU rule (the default
    included) skips every cuda task, a GPU rule every CPU task; and each
    workload's sketches on either target come from that target's rules."""
    from mlir_ansor.search.registry import sketch_rules
    from mlir_ansor.search.rules import CPU_RULES, DEFAULT_RULE, GPU_DEFAULT_RULE, GPU_RULES, RuleResult

    assert [r.name for r in sketch_rules()] == [r.name for r in CPU_RULES + GPU_RULES]
    for task, cpu_ctx, cuda_ctx in _contexts(TARGET_CASES[name]):
        for rule in [*CPU_RULES, DEFAULT_RULE]:
            assert rule.condition(cuda_ctx) is RuleResult.SKIP, (name, rule.name)
        for rule in [*GPU_RULES, GPU_DEFAULT_RULE]:
            assert rule.condition(cpu_ctx) is RuleResult.SKIP, (name, rule.name)
        assert DEFAULT_RULE.condition(cpu_ctx) is GPU_DEFAULT_RULE.condition(cuda_ctx) is RuleResult.APPLY
        cpu_names = [s.name for s in generate_sketches(task, AVX2)]
        cuda_names = [s.name for s in generate_sketches(task, CUDA)]
        assert cpu_names[-1] == "cpu-default" and all(n.startswith("cpu-") for n in cpu_names), cpu_names
        assert cuda_names[-1] == "cuda-default" and all(n.startswith("cuda-") for n in cuda_names), cuda_names


def test_every_rule_applies_somewhere():
    """The skip test above is not vacuous: on its own kind of target, every
    rule applies to one of the workloads (the dot-product rule on a CPU
    with AVX-512 BF16, Zen 4; the AMX rule on Sapphire Rapids)."""
    import dataclasses

    from mlir_ansor.search.rules import CPU_RULES, GPU_RULES, RuleResult

    znver4 = Target.cpu("znver4", cores=2)
    spr = Target.cpu("sapphirerapids", cores=2)  # AMX
    applied = set()
    for text in TARGET_CASES.values():
        for _, cpu_ctx, cuda_ctx in _contexts(text):
            for ctx in (cpu_ctx, dataclasses.replace(cpu_ctx, target=znver4), dataclasses.replace(cpu_ctx, target=spr)):
                applied |= {r.name for r in CPU_RULES if r.condition(ctx) is not RuleResult.SKIP}
            applied |= {r.name for r in GPU_RULES if r.condition(cuda_ctx) is not RuleResult.SKIP}
    # A softmax cut for a CPU is one task, computed row by row.
    from mlir_ansor.search.rules import SketchContext
    from mlir_ansor.search.rules.dot_product import weight_packing
    from mlir_ansor.search.sketch import prepare_payload

    (task,) = extract_tasks(mlir_ansor.load(text=workloads.softmax(16, 64)), prepack=weight_packing(AVX2))
    payload, ops = prepare_payload(task.mlir)
    anchor = next(o for o in ops if o.role == "anchor")
    applied |= {r.name for r in CPU_RULES if r.condition(SketchContext(payload, ops, anchor, AVX2)) is not RuleResult.SKIP}
    # So is an attention (scores, softmax, P.V).
    (task,) = extract_tasks(mlir_ansor.load(text=workloads.attention(2, 32, 16)), prepack=weight_packing(AVX2))
    payload, ops = prepare_payload(task.mlir)
    anchor = next(o for o in ops if o.role == "anchor")
    applied |= {r.name for r in CPU_RULES if r.condition(SketchContext(payload, ops, anchor, AVX2)) is not RuleResult.SKIP}
    # So is K's transpose beside the attention scores (Ansor's TBG).
    for task in extract_tasks(mlir_ansor.load(text=workloads.transpose_batch_matmul(16, 2, 8)), prepack=weight_packing(AVX2)):
        payload, ops = prepare_payload(task.mlir)
        anchor = next(o for o in ops if o.role == "anchor")
        applied |= {r.name for r in CPU_RULES if r.condition(SketchContext(payload, ops, anchor, AVX2)) is not RuleResult.SKIP}
    assert applied == {r.name for r in CPU_RULES + GPU_RULES}


@pytest.mark.parametrize(
    "text, expected",
    [
        (workloads.matmul(128, 128, 64, "f16"), ["cuda-mma-smem", "cuda-tiled", "cuda-mma", "cuda-contraction", "cuda-default"]),
        (workloads.matmul(64, 64, 32), ["cuda-tiled", "cuda-mma", "cuda-contraction", "cuda-default"]),
        (workloads.conv2d_nhwc(1, 10, 10, 8, 16, 3, 3), ["cuda-conv-smem", "cuda-contraction", "cuda-default"]),
        (workloads.reduce_last(16, 64), ["cuda-warp-reduction", "cuda-default"]),
        (workloads.elementwise_add_relu(16, 64), ["cuda-default"]),
    ],
)
def test_gpu_rule_choice_follows_structure(text, expected):
    assert [s.name for s in generate_sketches(_contexts(text)[0][0], CUDA)] == expected


def test_reduction_sketch_knobs(tmp_path):
    path = tmp_path / "r.mlir"
    path.write_text(workloads.reduce_last(16, 64))
    (task,) = extract_tasks(str(path))
    sk = generate_sketches(task.mlir, AVX2)[0]
    knobs = {k.name: k for k in sk.knobs}
    # Lanes along the contiguous (reduced) loop d1, rows of the output d0.
    assert knobs["v_d1"].options == (8, 16, 32)
    assert knobs["r_d0"].options == (1, 2, 4, 8)
    assert knobs["p_d0"].multiple_of == "r_d0"
    assert "vector.multi_reduction" not in sk.script  # made by the vectorizer, not written
    assert "transform.structured.vectorize_children_and_apply_patterns" in sk.script
    # rfactor: horizontal, or partial results 8, 16 or 32 wide.
    assert knobs["rfactor"].alternatives and knobs["rfactor"].options == (0, 1, 2, 3)
    assert sk.script.count("transform.structured.tile_reduction_using_for") == 3


@pytest.mark.parametrize("rfactor", [0, 1, 2, 3])
@pytest.mark.parametrize("workload", ["reduce_last", "softmax"])
def test_every_rfactor_choice_computes_the_reduction(tmp_path, workload, rfactor):
    """Each alternative of the rfactor choice, built and run, against numpy
    (the row sums of a reduction; the max and the exp-sum of softmax)."""
    text = workloads.reduce_last(12, 64) if workload == "reduce_last" else workloads.softmax(12, 64)
    path = tmp_path / "w.mlir"
    path.write_text(text)
    rng = np.random.default_rng(rfactor)
    checked = 0
    for task in extract_tasks(str(path)):
        sk = generate_sketches(task.mlir, AVX2)[0]
        knobs = {k.name: k for k in sk.knobs}
        if "rfactor" not in knobs:
            continue  # the final divide of softmax: no reduction
        values = {"rfactor": rfactor, "v_d1": 8, "r_d0": 2, "p_d0": 4}
        x = rng.standard_normal((12, 64)).astype(np.float32)
        inputs = [x] if len(task.inputs) == 1 else [x, x.max(1)]
        out = np.zeros(tuple(task.outputs[0].shape), np.float32)
        run_schedule(sk.payload, select_knobs(sk.script, values), [*inputs, out], tmp_path)
        body = task.mlir
        if "math.exp" in body:
            want = np.exp(x - x.max(1, keepdims=True)).sum(1)
        elif "maximumf" in body:
            want = x.max(1)
        else:
            want = x.astype(np.float64).sum(1)
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        checked += 1
    assert checked == (1 if workload == "reduce_last" else 2)


def test_channel_first_convolution_keeps_one_output_channel_per_tile(tmp_path):
    path = tmp_path / "c.mlir"
    path.write_text(workloads.conv2d_nchw(1, 4, 8, 8, 8, 3, 3))
    (task,) = extract_tasks(str(path))
    names = [k.name for k in generate_sketches(task.mlir, AVX2)[0].knobs]
    # loops n f oh ow | c kh kw: ow vectorized, no register rows over f.
    assert "r_d3" in names and "r_d1" not in names


def _knob_options(text: str, tmp_path) -> dict[str, tuple[int, ...]]:
    path = tmp_path / "k.mlir"
    path.write_text(text)
    (task,) = extract_tasks(str(path))
    return {k.name: tuple(k.options) for k in generate_sketches(task.mlir, AVX2)[0].knobs}


def test_whole_window_unroll_for_channel_last_ops_only(tmp_path):
    # depthwise NHWC (n oh ow c | kh kw): kw may unroll whole, its taps share input loads
    assert 3 in _knob_options(workloads.depthwise_conv2d_nhwc(1, 10, 10, 16, 3, 3), tmp_path)["u_d5"]
    # NCHW (n f oh ow | c kh kw): never u = 3 on kw, whose build did not finish
    assert 3 not in _knob_options(workloads.conv2d_nchw(1, 4, 8, 8, 8, 3, 3), tmp_path)["u_d6"]


def test_channel_first_windows_are_not_unrolled_and_build(tmp_path):
    """torch's Conv1d(8, 16, 4) (NCW, n f ow | c kw): u = 4 or 2 on the window
    built for minutes until the worker was killed; only u = 1 is offered."""
    t = lambda *s: "tensor<" + "x".join(map(str, s)) + "xf32>"  # noqa: E731
    text = (
        f"func.func @c(%x: {t(1, 8, 20)}, %w: {t(16, 8, 4)}) -> {t(1, 16, 17)} {{\n"
        f"  %z = arith.constant 0.0 : f32\n  %e = tensor.empty() : {t(1, 16, 17)}\n"
        f"  %i = linalg.fill ins(%z : f32) outs(%e : {t(1, 16, 17)}) -> {t(1, 16, 17)}\n"
        "  %r = linalg.conv_1d_ncw_fcw {dilations = dense<1> : tensor<1xi64>, strides = dense<1> : tensor<1xi64>}\n"
        f"      ins(%x, %w : {t(1, 8, 20)}, {t(16, 8, 4)}) outs(%i : {t(1, 16, 17)}) -> {t(1, 16, 17)}\n"
        f"  return %r : {t(1, 16, 17)}\n}}\n"
    )
    assert _knob_options(text, tmp_path)["u_d4"] == (1,)
    path = tmp_path / "ncw.mlir"
    path.write_text(text)
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((1, 8, 20)).astype(np.float32), rng.standard_normal((16, 8, 4)).astype(np.float32)
    want = sum(np.einsum("ncw,fc->nfw", x[:, :, k : k + 17], w[:, :, k]) for k in range(4))
    np.testing.assert_allclose(mlir_ansor.compile(str(path), db=None)(x, w), want, rtol=1e-4, atol=1e-4)


CASES = {
    "matmul_transposed_b": workloads.matmul_transposed_b(32, 48, 16),
    "batch_matmul": workloads.batch_matmul(2, 16, 32, 8),
    "conv1d": workloads.conv1d_nwc(1, 18, 8, 16, 3),
    "conv2d_stride2": workloads.conv2d_nhwc(1, 9, 9, 8, 16, 3, 3, stride=2),
    "conv2d_dilated": workloads.conv2d_nhwc(1, 10, 10, 8, 8, 3, 3, dilation=2),
    "conv2d_nchw": workloads.conv2d_nchw(1, 8, 10, 10, 16, 3, 3),
    "depthwise": workloads.depthwise_conv2d_nhwc(1, 10, 10, 16, 3, 3),
    "grouped": workloads.grouped_conv2d_nhwgc(1, 6, 6, 2, 4, 4, 3, 3),
    "conv3d": workloads.conv3d_ndhwc(1, 4, 6, 6, 4, 8, 3),
    "maxpool": workloads.pool2d_nhwc(1, 10, 10, 8, 3, 2, "max"),
    "sumpool": workloads.pool2d_nhwc(1, 10, 10, 8, 3, 2, "sum"),
    "reduce_last": workloads.reduce_last(16, 64),
    "add_relu": workloads.elementwise_add_relu(16, 64),
    "softmax": workloads.softmax(8, 64),
    "conv_bias_relu": workloads.conv_bias_relu(1, 8, 8, 8, 16, 3),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES))
def test_every_op_family_tunes_and_verifies(tmp_path, name):
    path = tmp_path / f"{name}.mlir"
    path.write_text(CASES[name])
    n_tasks = len(extract_tasks(str(path)))
    result = tune(
        str(path),
        config=TuneConfig(
            trials=3 * n_tasks, batch_size=3, timing=FAST, build_workers=2, task_scheduler="round-robin", build_timeout_s=30
        ),
        db=tmp_path / "t.db",
    )
    for r in result.tasks:
        # Every task got a candidate that matched the reference.
        assert np.isfinite(r.best_latency_s), (r.task.name, dict(r.errors))
        assert "wrong_answer" not in r.errors, (r.task.name, dict(r.errors))


# Shapes whose extents have no useful divisors (367 and 257 are prime, 129 =
# 3 x 43): tiles that do not divide the loops, peeled remainders, masked
# vectors for partial thread tiles. Checked against numpy, where a padding
# or remainder bug cannot hide.
ODD = {
    "matmul_367": (workloads.matmul(367, 367, 367), "matmul"),
    "matmul_129x257x511": (workloads.matmul(129, 257, 511), "matmul"),
    "batch_matmul_odd": (workloads.batch_matmul(2, 67, 33, 45), "batch_matmul"),
    "conv2d_odd_channels": (workloads.conv2d_nhwc(1, 9, 9, 35, 19, 3, 3), "conv2d"),
}


def test_odd_shapes_sample_tiles_that_do_not_divide(tmp_path):
    path = tmp_path / "m.mlir"
    path.write_text(workloads.matmul(367, 367, 367))
    (task,) = extract_tasks(str(path))
    knobs = {k.name: k for k in generate_sketches(task.mlir, AVX2)[0].knobs}
    # Register tiles of 6 rows x 16 lanes are offered on a prime extent, and
    # thread tiles of the rows are multiples of them (the last one partial).
    assert 6 in knobs["r_d0"].options and 16 in knobs["r_d1"].options
    assert knobs["p_d0"].multiple_of == "r_d0" and 48 in knobs["p_d0"].options
    assert knobs["k_d2"].multiple_of == "u_d2" and 64 in knobs["k_d2"].options
    # The vector loop's thread tile divides it (its remainder stays static).
    assert knobs["p_d1"].options == (1, 367) and knobs["p_d1"].at_least == "r_d1"


@pytest.mark.parametrize("p_rows", [8, 64])
@pytest.mark.parametrize("pack", [0, 1])
def test_six_row_tiles_on_even_rows_match_numpy(tmp_path, p_rows, pack):
    """6 register rows in a loop of 64 (offered although they do not divide
    it): the thread tile leaves a remainder of 2 or 4 rows, peeled."""
    path = tmp_path / "m.mlir"
    path.write_text(workloads.matmul(64, 48, 32))
    (task,) = extract_tasks(str(path))
    sk = generate_sketches(task.mlir, AVX2)[0]
    assert 6 in {k.name: k for k in sk.knobs}["r_d0"].options
    values = {"r_d0": 6, "r_d1": 16, "u_d2": 4, "p_d0": p_rows, "p_d1": 48, "k_d2": 16, "pack": pack}
    rng = np.random.default_rng(pack)
    a = rng.standard_normal((64, 32)).astype(np.float32)
    b = rng.standard_normal((32, 48)).astype(np.float32)
    out = np.zeros((64, 48), np.float32)
    run_schedule(sk.payload, select_knobs(sk.script, values), [a, b, out], tmp_path)
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("pack", [0, 1])
def test_a_whole_odd_row_loop_is_one_thread_tile_of_six_row_tiles(tmp_path, pack):
    """100 rows in register tiles of 6: the thread tile may be the whole
    loop (its last register tile partial), not only multiples of 6 (96 and a
    4-row tile that streams all of B for 4 rows); B copied or read in place
    (partial rows offer the copy since session 50, in thread tiles that
    divide the rows; B is read in place by default)."""
    path = tmp_path / "m.mlir"
    path.write_text(workloads.matmul(100, 48, 32))
    (task,) = extract_tasks(str(path))
    sk = generate_sketches(task.mlir, AVX2)[0]
    knobs = {k.name: k for k in sk.knobs}
    assert knobs["pack"].options == (0, 1) and sk.implied == () and dict(sk.prefer)["pack"] == 1
    allowed = knobs["p_d0"].allowed({"r_d0": 6})
    assert {96, 100} <= set(allowed) and 50 in knobs["p_d0"].options and 50 not in allowed
    values = {"r_d0": 6, "r_d1": 16, "u_d2": 4, "p_d0": 100, "p_d1": 48, "k_d2": 16, "pack": pack}
    assert is_valid(sk.knobs, make_assignment(values)) and sk.violation(make_assignment(values)) is None
    rng = np.random.default_rng(pack)
    a = rng.standard_normal((100, 32)).astype(np.float32)
    b = rng.standard_normal((32, 48)).astype(np.float32)
    out = np.zeros((100, 48), np.float32)
    run_schedule(sk.payload, select_knobs(sk.script, values), [a, b, out], tmp_path)
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("m, p_rows", [(100, 48), (37, 12)])
def test_the_rows_past_a_partial_thread_tiles_register_tiles_run_in_static_tiles(tmp_path, m, p_rows):
    """A thread tile of rows that does not divide the loop leaves its last
    tile partial, and the register tiles' remainder there of a dynamic row
    count: it runs in a static tile of 4 rows that keeps its accumulators
    in registers over the reduction, the rest in rows of one, with no masks
    (masked to the register tile's shape, it cost about two whole tiles; in
    rows of one only, each row loaded and stored its accumulators at every
    step). B read in place: its copy needs whole thread tiles of rows
    (`Sketch.requires`)."""
    from mlir import ir

    from mlir_ansor.schedule.apply import apply_schedule

    path = tmp_path / "m.mlir"
    path.write_text(workloads.matmul(m, 48, 32))
    (task,) = extract_tasks(str(path))
    sk = generate_sketches(task.mlir, AVX2)[0]
    values = {"r_d0": 6, "r_d1": 16, "u_d2": 4, "p_d0": p_rows, "p_d1": 48, "k_d2": 16, "pack": 1}
    assert is_valid(sk.knobs, make_assignment(values)) and sk.violation(make_assignment(values)) is None
    assert "p_d0" in sk.violation(make_assignment({**values, "pack": 0}))  # a partial thread tile: no copy
    script = select_knobs(sk.script, values)
    assert "transform.foreach_match" in script
    with ir.Context(), ir.Location.unknown():
        text = str(apply_schedule(sk.payload, script))
    assert "vector.fma" in text and not any(m in text for m in ("vector.create_mask", "vector.mask", "maskedload"))
    assert "-> (vector<6x16xf32>)" in text and "-> (vector<4x16xf32>)" in text  # accumulators of 6 and 4 rows
    rng = np.random.default_rng(m)
    a = rng.standard_normal((m, 32)).astype(np.float32)
    b = rng.standard_normal((32, 48)).astype(np.float32)
    out = np.zeros((m, 48), np.float32)
    run_schedule(sk.payload, script, [a, b, out], tmp_path)
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-4)


def test_rows_one_by_one_in_panels_with_an_epilogue_of_another_loop_count(tmp_path):
    """Two linalg.generic ops of one task, the contraction in panels (4
    loops) and its epilogue (3 loops): each remainder of a dynamic row
    count is tiled by its own loop count (a tile size per loop of the other
    fails to apply), and the result matches numpy."""
    text = PANELS_MATMUL.format(m=37, p=2).replace(
        "  return %r : tensor<37x2x32xf32>",
        """  %relu = linalg.generic {indexing_maps = [#c3, #c3], iterator_types = ["parallel", "parallel", "parallel"]}
      ins(%r : tensor<37x2x32xf32>) outs(%e : tensor<37x2x32xf32>) {
  ^bb0(%v: f32, %o: f32):
    %m = arith.maximumf %v, %zero : f32
    linalg.yield %m : f32
  } -> tensor<37x2x32xf32>
  return %relu : tensor<37x2x32xf32>""").replace("#c = affine_map", "#c3 = affine_map<(d0, d1, d2) -> (d0, d1, d2)>\n#c = affine_map")
    (sk,) = [s for s in generate_sketches(text, AVX2) if s.name == "cpu-contraction"]
    values = {"r_d0": 6, "r_d2": 32, "u_d3": 4, "p_d0": 12, "p_d1": 1, "p_d2": 32, "k_d3": 64}
    assert is_valid(sk.knobs, make_assignment(values))
    rng = np.random.default_rng(0)
    x = rng.standard_normal((37, 64)).astype(np.float32)
    w = rng.standard_normal((2, 64, 32)).astype(np.float32)
    out = np.zeros((37, 2, 32), np.float32)
    run_schedule(sk.payload, select_knobs(sk.script, values), [x, w, out], tmp_path)
    np.testing.assert_allclose(out, np.maximum(np.einsum("mk,pkl->mpl", x, w), 0), rtol=1e-5, atol=1e-4)


def test_odd_rows_of_a_matmul_in_panels_unrolled_once_still_use_fmas(tmp_path):
    """A contraction in a linalg.generic (B in panels) at odd rows is
    vectorized with explicit sizes, as a multiply and a one-element
    reduction at u = 1; folded back into `vector.contract` before
    canonicalization, it lowers to FMAs, not lane-by-lane multiplies (BERT's
    FFN output at 100 rows: 194 -> 294 GFLOP/s)."""
    from mlir import ir

    from mlir_ansor.schedule.apply import apply_schedule

    (sk,) = [s for s in generate_sketches(PANELS_MATMUL.format(m=100, p=2), AVX2) if s.name == "cpu-contraction"]
    knobs = {k.name: k for k in sk.knobs}
    assert "pack" not in knobs and 1 in knobs["u_d3"].options  # partial rows
    values = {"r_d0": 6, "r_d2": 32, "u_d3": 1, "p_d0": 100, "p_d1": 1, "p_d2": 32, "k_d3": 64}
    assert is_valid(sk.knobs, make_assignment(values))
    script = select_knobs(sk.script, values)
    with ir.Context(), ir.Location.unknown():
        text = str(apply_schedule(sk.payload, script))
    # one FMA per row of the 6-row tiles and of the 4-row remainder (static
    # here: the thread tile is the whole loop), no multiply left over
    # (unfolded: a multiply of [6, 1, 32, 1] vectors)
    assert text.count("vector.fma") == 10 and "arith.mulf" not in text, text.count("vector.fma")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((100, 64)).astype(np.float32)
    w = rng.standard_normal((2, 64, 32)).astype(np.float32)
    out = np.zeros((100, 2, 32), np.float32)
    run_schedule(sk.payload, script, [x, w, out], tmp_path)
    np.testing.assert_allclose(out, np.einsum("mk,pkl->mpl", x, w), rtol=1e-5, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ODD))
def test_odd_shapes_tune_and_match_numpy(tmp_path, name):
    text, ref_name = ODD[name]
    path = tmp_path / f"{name}.mlir"
    path.write_text(text)
    db = tmp_path / "t.db"
    result = tune(
        str(path),
        config=TuneConfig(trials=4, batch_size=4, timing=FAST, build_workers=2, build_timeout_s=30, seed=3),
        db=db,
    )
    (r,) = result.tasks
    assert np.isfinite(r.best_latency_s), dict(r.errors)
    assert not r.errors, dict(r.errors)  # every candidate built and matched the reference
    compiled = mlir_ansor.compile(str(path), db=db)
    ins_spec = compiled.functions[compiled.entry][0]
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(shape).astype(np.float32) for shape, _ in ins_spec]
    got = compiled(*args)
    want = workloads.numpy_reference(ref_name)(*args)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * float(np.abs(want).max()))


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(1, 3, 3, 8, 16, 4, 2, 1), (2, 3, 4, 4, 8, 6, 2, 2), (1, 2, 3, 4, 8, 3, 3, 0)])
def test_transposed_conv_tunes_and_matches_numpy(tmp_path, shape):
    """T2D, which Linalg has no named op for: phases of 1x1 convolutions on
    shifted windows of the padded input (`workloads.conv2d_transpose_nhwc`),
    two tasks (a phase's first tap from zero, the others accumulating)."""
    n, h, w, c, f, k, stride, pad = shape
    path = tmp_path / "t2d.mlir"
    path.write_text(workloads.conv2d_transpose_nhwc(*shape))
    tasks = extract_tasks(str(path))
    taps = (k // stride) ** 2
    assert sorted(t.weight for t in tasks) == sorted([stride**2, stride**2 * (taps - 1)] if taps > 1 else [stride**2])
    assert sum(t.flops * t.weight for t in tasks) == 2 * n * h * w * c * f * k * k
    db = tmp_path / "t.db"
    result = tune(
        str(path),
        config=TuneConfig(trials=3 * len(tasks), batch_size=3, timing=FAST, build_workers=2, task_scheduler="round-robin", build_timeout_s=30),
        db=db,
    )
    for r in result.tasks:
        assert np.isfinite(r.best_latency_s), (r.task.name, dict(r.errors))
        assert "wrong_answer" not in r.errors, (r.task.name, dict(r.errors))
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, h, w, c)).astype(np.float32)
    kernel = rng.standard_normal((k, k, c, f)).astype(np.float32)
    got = mlir_ansor.compile(str(path), db=db)(x, kernel)
    want = workloads.numpy_reference("conv2d_transpose")(x, kernel, stride, pad)
    assert got.shape == (n, stride * h, stride * w, f)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * float(np.abs(want).max()))


def test_transposed_conv_shapes_it_cannot_write_are_refused():
    with pytest.raises(ValueError, match="k % stride == 0"):
        workloads.conv2d_transpose_nhwc(1, 4, 4, 8, 8, 3, 2, 1)


@pytest.mark.parametrize("pack", [0, 1])
@pytest.mark.parametrize("unroll", [1, 3])
def test_depthwise_accumulators_stay_in_registers_and_start_at_zero(tmp_path, pack, unroll):
    """A depthwise convolution's register tile keeps its accumulators in
    registers across the window (no store and reload per kh) and, read in
    place (pack = 1), starts them as zero vectors: its fill is fused into
    the tile rather than a pass over the output that the op reads back."""
    from mlir_ansor.compiler import schedule_kernel

    path = tmp_path / "dw.mlir"
    path.write_text(workloads.depthwise_conv2d_nhwc(1, 10, 10, 16, 3, 3))
    (task,) = extract_tasks(str(path))
    sk = generate_sketches(task.mlir, AVX2)[0]
    values = {"r_d2": 4, "r_d3": 16, "u_d5": unroll, "p_d0": 1, "p_d1": 2, "p_d2": 8, "p_d3": 16, "k_d5": 3, "pack": pack}
    script = select_knobs(sk.script, values)
    text = schedule_kernel(sk.payload, script, "dw", 1, False)
    output = "memref<1x8x8x16xf32>"
    loads = [ln for ln in text.splitlines() if "vector.load" in ln and ln.rstrip().endswith(f"{output}, vector<16xf32>")]
    zeros = [ln for ln in text.splitlines() if "vector.store %cst" in ln and output in ln]
    assert "iter_args" in text and "-> (vector<4x16xf32>)" in text, "the kh loop does not carry the accumulators"
    assert (not loads and not zeros) if pack == 1 else (len(loads) == 4 and len(zeros) == 4)

    rng = np.random.default_rng(unroll)
    x = rng.standard_normal((1, 10, 10, 16)).astype(np.float32)
    w = rng.standard_normal((3, 3, 16)).astype(np.float32)
    out = np.full((1, 8, 8, 16), np.nan, np.float32)
    run_schedule(sk.payload, script, [x, w, out], tmp_path)
    want = sum(x[:, i : i + 8, j : j + 8, :] * w[i, j] for i in range(3) for j in range(3))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
