"""bf16 models as torch-mlir imports them: the widening ``arith.extf`` before
each matmul folded into it (`graph.precision.fold_widening`), bf16
arithmetic (GELU's erf, residual adds, scalings) computed in f32
(`graph.precision.compute_wide`), and a small BERT layer and ResNet
bottleneck in bf16 tuned, compiled and compared with PyTorch's bf16 eager
output."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest
from conftest import filecheck, small_torch_model
from mlir import ir

import mlir_ansor
from mlir_ansor import TuneConfig
from mlir_ansor.graph.normalize import normalize
from mlir_ansor.graph.precision import widen_payload
from mlir_ansor.ir.dtypes import EPSILON
from mlir_ansor.measure.runner import TimingPolicy

FAST = TimingPolicy(warmup=0, min_repeat=1, max_repeat=2, min_time_s=0.0)
BF16 = np.dtype(ml_dtypes.bfloat16)
M, N, K = 16, 32, 64


def _t(shape, dtype: str) -> str:
    return "tensor<" + "x".join(str(d) for d in shape) + f"x{dtype}>"


def _widen(name: str, src: str, shape, tin: str, tout: str, ext: str) -> str:
    """An elementwise generic `name` = `ext`(`src`), as torch-mlir writes it."""
    rank = len(shape)
    dims = ", ".join(f"d{i}" for i in range(rank))
    m = f"affine_map<({dims}) -> ({dims})>"
    iterators = ", ".join(['"parallel"'] * rank)
    return (
        f"  %{name}_e = tensor.empty() : {_t(shape, tout)}\n"
        f"  %{name} = linalg.generic {{indexing_maps = [{m}, {m}], iterator_types = [{iterators}]}}\n"
        f"      ins(%{src} : {_t(shape, tin)}) outs(%{name}_e : {_t(shape, tout)}) {{\n"
        f"    ^bb0(%x: {tin}, %o: {tout}):\n"
        f"      %{name}_v = {ext} %x : {tin} to {tout}\n"
        f"      linalg.yield %{name}_v : {tout}\n"
        f"  }} -> {_t(shape, tout)}\n"
    )


def torch_linear(tin: str = "bf16", tout: str = "f32", ext: str = "arith.extf") -> str:
    """torch-mlir's bf16 ``nn.Linear`` without the bias: both operands
    widened by generics, then a matmul in the wide type; the widened
    activations have a second user (an elementwise add), the widened
    weight is a constant."""
    a, b, c = (M, K), (K, N), (M, N)
    zero = "0" if tout.startswith("i") else "0.0"
    add = "arith.addi" if tout.startswith("i") else "arith.addf"
    rng = np.random.default_rng(0)
    if tin == "bf16":
        w = ", ".join(f"{v:.3f}" for v in rng.integers(-8, 8, size=K * N) / 8)
    else:
        w = ", ".join(str(v) for v in rng.integers(-8, 8, size=K * N))
    m2 = "affine_map<(d0, d1) -> (d0, d1)>"
    return (
        f"func.func @linear(%a: {_t(a, tin)}, %other: {_t((M, K), tout)}) -> ({_t(c, tout)}, {_t((M, K), tout)}) {{\n"
        f"  %wt = arith.constant dense<[{w}]> : {_t((K * N,), tin)}\n"
        f"  %w = tensor.expand_shape %wt [[0, 1]] output_shape [{K}, {N}] : {_t((K * N,), tin)} into {_t(b, tin)}\n"
        + _widen("aw", "a", a, tin, tout, ext)
        + _widen("ww", "w", b, tin, tout, ext)
        + f"  %z = arith.constant {zero} : {tout}\n"
        f"  %e = tensor.empty() : {_t(c, tout)}\n"
        f"  %f = linalg.fill ins(%z : {tout}) outs(%e : {_t(c, tout)}) -> {_t(c, tout)}\n"
        f"  %r = linalg.matmul ins(%aw, %ww : {_t(a, tout)}, {_t(b, tout)}) outs(%f : {_t(c, tout)}) -> {_t(c, tout)}\n"
        f"  %se = tensor.empty() : {_t((M, K), tout)}\n"
        f"  %s = linalg.generic {{indexing_maps = [{m2}, {m2}, {m2}], iterator_types = [\"parallel\", \"parallel\"]}}\n"
        f"      ins(%aw, %other : {_t(a, tout)}, {_t((M, K), tout)}) outs(%se : {_t((M, K), tout)}) {{\n"
        f"    ^bb0(%p: {tout}, %q: {tout}, %o: {tout}):\n"
        f"      %v = {add} %p, %q : {tout}\n"
        f"      linalg.yield %v : {tout}\n"
        f"  }} -> {_t((M, K), tout)}\n"
        f"  return %r, %s : {_t(c, tout)}, {_t((M, K), tout)}\n}}\n"
    )


def _weight(text: str, tin: str) -> np.ndarray:
    values = text.split("dense<[", 1)[1].split("]>", 1)[0]
    return np.array([float(v) for v in values.split(",")]).reshape(K, N)


def _normalized(text: str) -> str:
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        normalize(module)
        return str(module)


def test_widening_folds_into_the_matmul():
    out = _normalized(torch_linear())
    # the matmul reads the bf16 argument and the bf16 constant; the widened
    # activations stay for the add, their only other user
    filecheck(out, """
    CHECK: %[[W:.*]] = arith.constant dense<{{.*}}> : tensor<{{.*}}xbf16>
    CHECK: %[[AW:.*]] = linalg.generic {{.*}} ins(%arg0 : tensor<16x64xbf16>) outs({{.*}} : tensor<16x64xf32>)
    CHECK: arith.extf
    CHECK: linalg.matmul ins(%arg0, %{{.*}} : tensor<16x64xbf16>, tensor<64x32xbf16>) outs({{.*}} : tensor<16x32xf32>)
    CHECK: linalg.generic {{.*}} ins(%[[AW]], %arg1 : tensor<16x64xf32>, tensor<16x64xf32>)
    """)
    assert out.count("arith.extf") == 1  # the weight's widening is gone, not kept


def test_folded_matmul_is_a_bf16_task_of_the_dot_product_rule():
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.target import Target

    tasks = mlir_ansor.extract_tasks(mlir_ansor.load(text=torch_linear()))
    (mm,) = [t for t in tasks if t.kind == "contraction"]
    assert mm.anchor_op == "linalg.matmul" and [s.dtype for s in mm.inputs] == ["bf16", "bf16"]
    assert mm.name == f"matmul_{M}x{N}x{K}_bf16_f32"
    # Named CPUs, not the host: Zen 4 maps it onto vdpbf16ps; Sapphire Rapids
    # runs vdpbf16ps at half the FMAs' rate and computes it in f32.
    names = {c: {s.name for s in generate_sketches(mm.mlir, Target.cpu(c, cores=1))} for c in ("znver4", "sapphirerapids")}
    assert any(n.startswith("cpu-dot-product") for n in names["znver4"])
    assert not any(n.startswith("cpu-dot-product") for n in names["sapphirerapids"])


@pytest.mark.parametrize("tin, tout, ext", [("bf16", "f32", "arith.extf"), ("i8", "i32", "arith.extsi"),
                                            ("i8", "i32", "arith.extui")])
def test_folded_widening_computes_the_same(tin, tout, ext):
    text = torch_linear(tin, tout, ext)
    out = _normalized(text)
    assert ("linalg.matmul {cast = #linalg.type_fn<cast_unsigned>}" in out) == (ext == "arith.extui")
    (mm,) = [line for line in out.splitlines() if "linalg.matmul" in line]
    assert re.search(rf"ins\(%arg0, %cst\w* : tensor<16x64x{tin}>, tensor<64x32x{tin}>\)", mm), mm
    rng = np.random.default_rng(3)
    if tin == "bf16":
        a = rng.uniform(-1, 1, size=(M, K)).astype(BF16)
        x = rng.uniform(-1, 1, size=(M, K)).astype(np.float32)
    else:
        a = rng.integers(-128, 128, size=(M, K)).astype(np.int8)
        x = rng.integers(-100, 100, size=(M, K)).astype(np.int32)
    wide_a = (a.astype(np.int64) % 256) if ext == "arith.extui" else a.astype(np.float64)
    w = _weight(text, tin)
    if ext == "arith.extui":
        w = w % 256
    cm = mlir_ansor.compile(mlir_ansor.load(text=text))
    try:
        r, s = cm(a, x)
    finally:
        cm.close()
    want_r, want_s = wide_a @ w, wide_a + x
    if tin == "bf16":
        assert np.max(np.abs(r - want_r)) / np.max(np.abs(want_r)) <= 64 * EPSILON["f32"]
        np.testing.assert_array_equal(s, (a.astype(np.float32) + x))
    else:
        np.testing.assert_array_equal(r, want_r.astype(np.int32))
        np.testing.assert_array_equal(s, want_s.astype(np.int32))


def generic_linear_bt() -> str:
    """C = A . B^T written as a ``linalg.generic`` (mul-add body, B read
    through a transposed map), both operands widened before it."""
    a, b, c = (M, K), (N, K), (M, N)
    return (
        f"func.func @bt(%a: {_t(a, 'bf16')}, %b: {_t(b, 'bf16')}) -> {_t(c, 'f32')} {{\n"
        + _widen("aw", "a", a, "bf16", "f32", "arith.extf")
        + _widen("bw", "b", b, "bf16", "f32", "arith.extf")
        + f"  %z = arith.constant 0.0 : f32\n"
        f"  %e = tensor.empty() : {_t(c, 'f32')}\n"
        f"  %f = linalg.fill ins(%z : f32) outs(%e : {_t(c, 'f32')}) -> {_t(c, 'f32')}\n"
        "  %r = linalg.generic {indexing_maps = [affine_map<(i, j, k) -> (i, k)>, affine_map<(i, j, k) -> (j, k)>,\n"
        "                                        affine_map<(i, j, k) -> (i, j)>],\n"
        "                       iterator_types = [\"parallel\", \"parallel\", \"reduction\"]}\n"
        f"      ins(%aw, %bw : {_t(a, 'f32')}, {_t(b, 'f32')}) outs(%f : {_t(c, 'f32')}) {{\n"
        "    ^bb0(%p: f32, %q: f32, %o: f32):\n"
        "      %m = arith.mulf %p, %q : f32\n"
        "      %s = arith.addf %o, %m : f32\n"
        "      linalg.yield %s : f32\n"
        f"  }} -> {_t(c, 'f32')}\n"
        f"  return %r : {_t(c, 'f32')}\n}}\n"
    )


def test_widening_folds_into_a_generic_contraction():
    text = generic_linear_bt()
    out = _normalized(text)
    filecheck(out, """
    CHECK-NOT: outs({{.*}} : tensor<16x64xf32>)
    CHECK: linalg.generic {{.*}} ins(%arg0, %arg1 : tensor<16x64xbf16>, tensor<32x64xbf16>) outs(%{{.*}} : tensor<16x32xf32>)
    CHECK-NEXT: ^bb0(%[[P:.*]]: bf16, %[[Q:.*]]: bf16, %{{.*}}: f32):
    CHECK-DAG: arith.extf %[[P]] : bf16 to f32
    CHECK-DAG: arith.extf %[[Q]] : bf16 to f32
    CHECK: arith.mulf
    """)
    (task,) = mlir_ansor.extract_tasks(mlir_ansor.load(text=text))
    assert [s.dtype for s in task.inputs] == ["bf16", "bf16"] and task.kind == "contraction"
    rng = np.random.default_rng(4)
    a, b = (rng.uniform(-1, 1, size=s).astype(BF16) for s in ((M, K), (N, K)))
    cm = mlir_ansor.compile(mlir_ansor.load(text=text))
    try:
        r = cm(a, b)
    finally:
        cm.close()
    want = a.astype(np.float64) @ b.astype(np.float64).T
    assert np.max(np.abs(r - want)) / np.max(np.abs(want)) <= 64 * EPSILON["f32"]


GELU = """#map = affine_map<(d0, d1) -> (d0, d1)>
func.func @gelu(%arg0: tensor<16x128xbf16>) -> tensor<16x128xbf16> {
  %one = arith.constant 1.000000e+00 : bf16
  %two = arith.constant 2.000000e+00 : bf16
  %half = arith.constant 5.000000e-01 : bf16
  %e = tensor.empty() : tensor<16x128xbf16>
  %r = linalg.generic {indexing_maps = [#map, #map], iterator_types = ["parallel", "parallel"]}
      ins(%arg0 : tensor<16x128xbf16>) outs(%e : tensor<16x128xbf16>) {
  ^bb0(%in: bf16, %out: bf16):
    %s = math.sqrt %two : bf16
    %d = arith.divf %in, %s : bf16
    %f = math.erf %d : bf16
    %a = arith.addf %f, %one : bf16
    %m = arith.mulf %a, %half : bf16
    %y = arith.mulf %in, %m : bf16
    linalg.yield %y : bf16
  } -> tensor<16x128xbf16>
  return %r : tensor<16x128xbf16>
}
"""


def test_bf16_arithmetic_is_computed_in_f32():
    """torch-mlir's bf16 GELU: its erf had no lowering in bf16 (the JIT
    failed: "Failure while creating the ExecutionEngine"); normalized, the
    body computes in f32 and rounds once, as torch does."""
    out = _normalized(GELU)
    filecheck(out, """
    CHECK: ^bb0(%[[IN:.*]]: bf16, %{{.*}}: bf16):
    CHECK-NEXT: %[[X:.*]] = arith.extf %[[IN]] : bf16 to f32
    CHECK: math.erf %{{.*}} : f32
    CHECK: %[[Y:.*]] = arith.truncf %{{.*}} : f32 to bf16
    CHECK-NEXT: linalg.yield %[[Y]] : bf16
    """)
    body = out.split("^bb0", 1)[1].split("linalg.yield", 1)[0].splitlines()[1:]
    assert [line.split("=")[1].split()[0] for line in body if "bf16" in line] == ["arith.extf", "arith.truncf"]
    (task,) = mlir_ansor.extract_tasks(mlir_ansor.load(text=GELU))
    assert task.rounding_dtype == "bf16" and task.tolerance < 5 * EPSILON["bf16"]
    x = np.random.default_rng(1).uniform(-3, 3, size=(16, 128)).astype(BF16)
    cm = mlir_ansor.compile(mlir_ansor.load(text=GELU))
    try:
        y = cm(x)
    finally:
        cm.close()
    from math import erf

    xf = x.astype(np.float64)
    want = xf * 0.5 * (1 + np.vectorize(erf)(xf / np.sqrt(2)))
    assert y.dtype == BF16
    # f32 arithmetic, one rounding: within one bf16 rounding of the exact GELU
    assert np.max(np.abs(y.astype(np.float64) - want)) <= EPSILON["bf16"] * max(1.0, np.max(np.abs(want)))


def test_widened_reference_of_resource_weights():
    """A reference widens a module with bf16 weights held as
    ``dense_resource`` blobs (torch-mlir's) by extending them in f32."""
    text = """func.func @f(%a: tensor<2x2xbf16>) -> tensor<2x2xbf16> {
  %w = arith.constant dense_resource<blob> : tensor<2x2xbf16>
  %e = tensor.empty() : tensor<2x2xbf16>
  %r = linalg.add ins(%a, %w : tensor<2x2xbf16>, tensor<2x2xbf16>) outs(%e : tensor<2x2xbf16>) -> tensor<2x2xbf16>
  return %r : tensor<2x2xbf16>
}
{-#
  dialect_resources: { builtin: { blob: "0x02000000803F0040404080400000" } }
#-}
"""
    wide = widen_payload(text)
    filecheck(wide, """
    CHECK: func.func @f(%arg0: tensor<2x2xf32>) -> tensor<2x2xf32>
    CHECK: %[[W:.*]] = arith.constant dense_resource<blob> : tensor<2x2xbf16>
    CHECK: %[[WW:.*]] = linalg.generic {{.*}} ins(%[[W]] : tensor<2x2xbf16>) outs(%{{.*}} : tensor<2x2xf32>)
    CHECK: arith.extf %{{.*}} : bf16 to f32
    CHECK: linalg.add ins(%arg0, %[[WW]] : tensor<2x2xf32>, tensor<2x2xf32>)
    """)


# --------------------------------------------------------------------------
# Whole models from torch-mlir.


def _bf16_model(torch, which: str):
    """(bf16 module, bf16 input, torch's bf16 eager output as f32, MLIR text):
    `conftest.small_torch_model` in bf16."""
    from mlir_ansor.importers.pytorch import import_module

    model, x = small_torch_model(torch, which)
    model = model.to(torch.bfloat16).eval()
    xb = x.to(torch.bfloat16)
    with torch.no_grad():
        want = model(xb).float().numpy()
    return model, xb, want, import_module(model, (xb,))


@pytest.fixture(scope="module")
def bert(torch):
    return _bf16_model(torch, "bert")


@pytest.fixture(scope="module")
def resnet_block(torch):
    return _bf16_model(torch, "resnet")


def test_bert_bf16_tasks(bert):
    _, _, _, text = bert
    tasks = mlir_ansor.extract_tasks(mlir_ansor.load(text=text))
    names = [t.name for t in tasks]
    mms = [t for t in tasks if t.anchor_op == "linalg.matmul"]
    # Q, K, V (one task, weight 3), the output projection and FFN out with
    # their residual adds, FFN in with its GELU (`normalize.drop_unit_loops`
    # lets the ops after torch-mlir's [1, s, n] expand join the matmul)
    assert sorted(t.name for t in mms) == [
        "matmul_16x128x64_bf16_f32_add_truncf_generic", "matmul_16x64x128_bf16_f32_add_truncf_add_extf",
        "matmul_16x64x64_bf16_f32_add_truncf", "matmul_16x64x64_bf16_f32_add_truncf_add_extf",
    ]
    assert all([s.dtype for s in t.inputs[:2]] == ["bf16", "bf16"] for t in mms)
    assert sum(t.weight for t in mms) == 6
    # no task only widens for a matmul any more
    assert not [n for n in names if n.startswith("extf_") and n.endswith("_bf16_f32")]
    # GELU computes in f32 inside FFN in's task, rounded to bf16 once
    (gelu,) = [t for t in tasks if "math.erf" in t.mlir]
    assert gelu.name == "matmul_16x128x64_bf16_f32_add_truncf_generic"
    assert "arith.extf" in gelu.mlir and gelu.rounding_dtype == "bf16"


def _tune_compile_run(tmp_path, text: str, x, trials: int):
    program = mlir_ansor.load(text=text)
    db = tmp_path / "bf16.db"
    cfg = TuneConfig(trials=trials, batch_size=2, build_workers=2, timing=FAST, build_timeout_s=60, run_timeout_s=30,
                     seed=1)
    result = mlir_ansor.tune(program, config=cfg, db=db)
    assert sum(r.trials for r in result.tasks) >= trials
    assert any(np.isfinite(r.best_latency_s) for r in result.tasks)
    cm = mlir_ansor.compile(program, db=db)
    try:
        assert "tuned" in {k.source for k in cm.kernels}
        out = cm(x.view(__import__("torch").int16).numpy().view(BF16))
    finally:
        cm.close()
    assert out.dtype == BF16
    return out.astype(np.float32)


def _rel(out: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(out.astype(np.float64) - want)) / np.max(np.abs(want)))


@pytest.mark.slow
def test_bert_bf16_tune_compile_matches_torch(bert, tmp_path):
    _, x, want, text = bert
    out = _tune_compile_run(tmp_path, text, x, trials=4)
    assert out.shape == want.shape == (1, 16, 64)
    # a few bf16 roundings apart at most (LayerNorm output, |y| ~ 1-4)
    assert np.std(want) > 0.5 and _rel(out, want) <= 4 * EPSILON["bf16"]


@pytest.mark.slow
def test_resnet_block_bf16_tune_compile_matches_torch(resnet_block, tmp_path):
    _, x, want, text = resnet_block
    tasks = mlir_ansor.extract_tasks(mlir_ansor.load(text=text))
    convs = [t for t in tasks if t.kind == "convolution"]
    assert len(convs) == 3 and all([s.dtype for s in t.inputs[:2]] == ["bf16", "bf16"] for t in convs)
    out = _tune_compile_run(tmp_path, text, x, trials=4)
    assert out.shape == want.shape == (1, 32, 8, 8)
    assert _rel(out, want) <= 4 * EPSILON["bf16"]


@pytest.mark.parametrize("scale", [False, True])
def test_a_bf16_gather_keeps_its_element_type_and_computes_in_f32(scale):
    """A body that gathers bf16 values (``nn.Embedding``: ``tensor.extract``
    of a bf16 table, checked by ``cf.assert``s) is data movement; one that
    also scales them computes in f32 on the extended element. Widening the
    table itself made invalid IR that aborted the process in canonicalize."""
    table = (np.arange(40, dtype=np.float32).reshape(10, 4) / 8).astype(ml_dtypes.bfloat16)
    hexes = table.tobytes().hex().upper()  # (little-endian bf16, as MLIR reads a hex dense)
    dense = f'dense<"0x{hexes}"> : tensor<10x4xbf16>'
    payload = "%s = arith.mulf %e, %two : bf16\n      linalg.yield %s : bf16" if scale else "linalg.yield %e : bf16"
    text = f"""
    #ids = affine_map<(d0, d1) -> (d0)>
    #out = affine_map<(d0, d1) -> (d0, d1)>
    func.func @embed(%ids: tensor<3xi64>) -> tensor<3x4xbf16> {{
      %table = arith.constant {dense}
      %n = arith.constant 10 : index
      %two = arith.constant 2.0 : bf16
      %e0 = tensor.empty() : tensor<3x4xbf16>
      %r = linalg.generic {{indexing_maps = [#ids, #out], iterator_types = ["parallel", "parallel"]}}
          ins(%ids : tensor<3xi64>) outs(%e0 : tensor<3x4xbf16>) {{
      ^bb0(%i: i64, %o: bf16):
        %row = arith.index_cast %i : i64 to index
        %ok = arith.cmpi slt, %row, %n : index
        cf.assert %ok, "index must be smaller than dim size"
        %col = linalg.index 1 : index
        %e = tensor.extract %table[%row, %col] : tensor<10x4xbf16>
        {payload}
      }} -> tensor<3x4xbf16>
      return %r : tensor<3x4xbf16>
    }}"""
    ids = np.array([7, 0, 3], dtype=np.int64)
    out = mlir_ansor.compile(mlir_ansor.load(text=text), cache_dir=False)(ids)
    want = table.astype(np.float32)[ids] * (2 if scale else 1)
    np.testing.assert_array_equal(np.asarray(out, dtype=np.float32), want)
