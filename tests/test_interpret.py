"""graph.interpret: whole Linalg functions evaluated with numpy, `run`'s
reference. Checked against independent numpy formulas (float64) and, for
torch-mlir's models, against the untuned build it replaces."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
from conftest import INPUTS, small_torch_model

from mlir_ansor.examples import workloads as W
from mlir_ansor.graph.interpret import NotInterpretable, interpret
from mlir_ansor.importers import load
from mlir_ansor.ir.program import resource_blobs
from mlir_ansor.tools.cli import main

BF16 = np.dtype(ml_dtypes.bfloat16)


def _eval(text: str, *args: np.ndarray, entry: str | None = None) -> tuple[np.ndarray, ...]:
    program = load(text=text)
    with program.context:
        if entry is None:
            fn = next(o for o in program.module.body.operations if o.operation.name == "func.func")
            entry = fn.attributes["sym_name"].value
        return interpret(program.module, entry, list(args), resource_blobs(text))


def _rng():
    return np.random.default_rng(7)


def _rel(out: np.ndarray, want: np.ndarray) -> float:
    want = np.asarray(want, dtype=np.float64)
    return float(np.max(np.abs(np.asarray(out, dtype=np.float64) - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("stride,dilation", [(1, 1), (2, 1), (1, 2)])
def test_convolution_windows_are_strided_views(stride, dilation):
    r = _rng()
    x = r.standard_normal((1, 11, 13, 5)).astype(np.float32)
    k = r.standard_normal((3, 3, 5, 7)).astype(np.float32)
    (out,) = _eval(W.conv2d_nhwc(1, 11, 13, 5, 7, 3, 3, stride=stride, dilation=dilation), x, k)
    want = W.numpy_reference("conv2d")(x.astype(np.float64), k, stride, dilation)
    assert out.dtype == np.float32 and out.shape == want.shape
    assert _rel(out, want) < 1e-6


def test_awkward_matmul_and_its_sums_in_float64():
    r = _rng()
    a = r.standard_normal((37, 367)).astype(np.float32)
    b = r.standard_normal((367, 29)).astype(np.float32)
    (out,) = _eval(W.matmul(37, 29, 367), a, b)
    want = a.astype(np.float64) @ b
    # rounded once from float64: within half an f32 ulp of the exact sum, which
    # a float32 accumulation (numpy's own a @ b) is not
    assert np.all(np.abs(out - want) <= np.spacing(np.abs(want).astype(np.float32)))
    assert np.max(np.abs((a @ b) - want)) > np.max(np.abs(out - want))


@pytest.mark.parametrize("name,build,shapes", [
    ("transposed_b", lambda: W.matmul_transposed_b(9, 17, 33), [(9, 33), (17, 33)]),
    ("batch", lambda: W.batch_matmul(3, 9, 17, 33), [(3, 9, 33), (3, 33, 17)]),
    ("softmax", lambda: W.softmax(13, 50), [(13, 50)]),
    ("reduce_sum", lambda: W.reduce_last(13, 50), [(13, 50)]),
    ("add_relu", lambda: W.elementwise_add_relu(13, 50), [(13, 50), (13, 50)]),
    ("conv_bias_relu", lambda: W.conv_bias_relu(1, 10, 10, 4, 6, 3), [(1, 10, 10, 4), (3, 3, 4, 6), (6,)]),
    ("transpose_batch_matmul", lambda: W.transpose_batch_matmul(16, 2, 8), [(16, 2, 8), (16, 2, 8)]),
    ("conv2d_transpose", lambda: W.conv2d_transpose_nhwc(1, 4, 4, 6, 5, 4, 2, 1), [(1, 4, 4, 6), (4, 4, 6, 5)]),
])
def test_workloads_match_their_numpy_formulas(name, build, shapes):
    r = _rng()
    args = [r.standard_normal(s).astype(np.float32) for s in shapes]
    (out,) = _eval(build(), *args)
    ref = {"transposed_b": "matmul_transposed_b", "batch": "batch_matmul"}.get(name, name)
    want = W.numpy_reference(ref)(*[a.astype(np.float64) for a in args])
    assert out.shape == want.shape
    assert _rel(out, want) < 2e-6


def test_max_pooling_and_depthwise_windows():
    r = _rng()
    x = r.standard_normal((1, 9, 9, 3)).astype(np.float32)
    (pooled,) = _eval(W.pool2d_nhwc(1, 9, 9, 3, 3, 2, "max"), x)
    want = np.lib.stride_tricks.sliding_window_view(x, (3, 3), axis=(1, 2))[:, ::2, ::2].max(axis=(-1, -2))
    np.testing.assert_array_equal(pooled, want)
    k = r.standard_normal((3, 3, 3)).astype(np.float32)
    (dw,) = _eval(W.depthwise_conv2d_nhwc(1, 9, 9, 3, 3, 3), x, k)
    win = np.lib.stride_tricks.sliding_window_view(x.astype(np.float64), (3, 3), axis=(1, 2))  # n, oh, ow, c, kh, kw
    assert _rel(dw, np.einsum("nhwcij,ijc->nhwc", win, k)) < 1e-6


_INT8 = """
func.func @q(%a: tensor<5x40xi8>, %b: tensor<40x6xi8>) -> tensor<5x6xi8> {
  %c0 = arith.constant 0 : i32
  %e = tensor.empty() : tensor<5x6xi32>
  %z = linalg.fill ins(%c0 : i32) outs(%e : tensor<5x6xi32>) -> tensor<5x6xi32>
  %m = linalg.matmul ins(%a, %b : tensor<5x40xi8>, tensor<40x6xi8>) outs(%z : tensor<5x6xi32>) -> tensor<5x6xi32>
  %e8 = tensor.empty() : tensor<5x6xi8>
  %r = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>],
                       iterator_types = ["parallel", "parallel"]}
      ins(%m : tensor<5x6xi32>) outs(%e8 : tensor<5x6xi8>) {
  ^bb0(%x: i32, %o: i8):
    %s = arith.constant 3 : i32
    %y = arith.shrsi %x, %s : i32
    %t = arith.trunci %y : i32 to i8
    linalg.yield %t : i8
  } -> tensor<5x6xi8>
  return %r : tensor<5x6xi8>
}
"""


def test_int8_sums_are_exact_and_narrowing_wraps():
    r = _rng()
    a = r.integers(-128, 128, (5, 40), dtype=np.int8)
    b = r.integers(-128, 128, (40, 6), dtype=np.int8)
    (out,) = _eval(_INT8, a, b)
    exact = a.astype(np.int64) @ b.astype(np.int64)
    want = (exact >> 3).astype(np.int8)  # numpy's astype wraps as trunci does
    assert out.dtype == np.int64
    np.testing.assert_array_equal(out, want)


def test_quantized_matmul_with_zero_points_is_exact():
    from test_low_precision import K, M, N, _quantized_batch

    r = _rng()
    a = r.integers(-128, 128, (2, M, K), dtype=np.int8)
    b = r.integers(-128, 128, (2, K, N), dtype=np.int8)
    (out,) = _eval(_quantized_batch(3, -5), a, b)
    want = np.matmul(a.astype(np.int64) - 3, b.astype(np.int64) + 5)
    np.testing.assert_array_equal(out, want)


def test_bf16_inputs_are_widened_not_rounded():
    r = _rng()
    a = r.standard_normal((8, 32)).astype(BF16)
    b = r.standard_normal((32, 4)).astype(BF16)
    from test_low_precision import matmul as lp_matmul

    (out,) = _eval(lp_matmul("bf16", "bf16", m=8, n=4, k=32), a, b)
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert out.dtype == np.float32  # the bf16 result held unrounded in f32
    assert _rel(out, want) < 1e-6


_ARGMAX = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
#col0 = affine_map<(d0, d1) -> (d0, 0)>
func.func @head(%x: tensor<3x7xf32>) -> (tensor<3xf32>, tensor<3xi64>, tensor<3x1xf32>) {
  %ninf = arith.constant 0xFF800000 : f32
  %zero = arith.constant 0 : i64
  %z32 = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<3xf32>
  %m0 = linalg.fill ins(%ninf : f32) outs(%e : tensor<3xf32>) -> tensor<3xf32>
  %ei = tensor.empty() : tensor<3xi64>
  %i0 = linalg.fill ins(%zero : i64) outs(%ei : tensor<3xi64>) -> tensor<3xi64>
  %r:2 = linalg.generic {indexing_maps = [#id, #row, #row], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<3x7xf32>) outs(%m0, %i0 : tensor<3xf32>, tensor<3xi64>) {
  ^bb0(%in: f32, %m: f32, %i: i64):
    %j = linalg.index 1 : index
    %ji = arith.index_cast %j : index to i64
    %mx = arith.maximumf %in, %m : f32
    %gt = arith.cmpf ogt, %in, %m : f32
    %ni = arith.select %gt, %ji, %i : i64
    linalg.yield %mx, %ni : f32, i64
  } -> (tensor<3xf32>, tensor<3xi64>)
  %es = tensor.empty() : tensor<3x1xf32>
  %s0 = linalg.fill ins(%z32 : f32) outs(%es : tensor<3x1xf32>) -> tensor<3x1xf32>
  %s = linalg.generic {indexing_maps = [#id, #col0], iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<3x7xf32>) outs(%s0 : tensor<3x1xf32>) {
  ^bb0(%in: f32, %acc: f32):
    %a = arith.addf %in, %acc : f32
    linalg.yield %a : f32
  } -> tensor<3x1xf32>
  return %r#0, %r#1, %s : tensor<3xf32>, tensor<3xi64>, tensor<3x1xf32>
}
"""


def test_argmax_the_first_maximum_and_a_constant_output_map():
    x = np.array([[1, 5, 5, 0, 0, 0, 0], [-3, -2, -9, -1, -1, -4, -5], [0, 0, 0, 0, 0, 0, 7]], dtype=np.float32)
    mx, idx, s = _eval(_ARGMAX, x)
    np.testing.assert_array_equal(mx, x.max(1))
    np.testing.assert_array_equal(idx, [1, 3, 6])  # ties: the first (a strict compare keeps it)
    np.testing.assert_allclose(s, x.sum(1, keepdims=True))


_PAD_SLICES = """
func.func @f(%x: tensor<2x3xf32>, %y: tensor<2x2xf32>) -> (tensor<4x7xf32>, tensor<3x2xf32>) {
  %one = arith.constant 1.5 : f32
  %p = tensor.pad %x low[1, 0] high[1, 2] {
  ^bb0(%i: index, %j: index):
    tensor.yield %one : f32
  } : tensor<2x3xf32> to tensor<4x5xf32>
  %q = tensor.pad %y low[1, 0] high[1, 0] {
  ^bb0(%i: index, %j: index):
    tensor.yield %one : f32
  } : tensor<2x2xf32> to tensor<4x2xf32>
  %c = tensor.concat dim(1) %p, %q, %q : (tensor<4x5xf32>, tensor<4x2xf32>, tensor<4x2xf32>) -> tensor<4x9xf32>
  %s = tensor.extract_slice %c[0, 1] [4, 7] [1, 1] : tensor<4x9xf32> to tensor<4x7xf32>
  %e = tensor.empty() : tensor<3x2xf32>
  %t = tensor.extract_slice %c[1, 0] [1, 3] [1, 2] : tensor<4x9xf32> to tensor<3xf32>
  %u = tensor.insert_slice %y into %e[1, 0] [2, 2] [1, 1] : tensor<2x2xf32> into tensor<3x2xf32>
  %w = tensor.insert_slice %t into %u[0, 1] [3, 1] [1, 1] : tensor<3xf32> into tensor<3x2xf32>
  return %s, %w : tensor<4x7xf32>, tensor<3x2xf32>
}
"""


def test_tensor_ops_that_move_data():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = -np.arange(1, 5, dtype=np.float32).reshape(2, 2)
    s, w = _eval(_PAD_SLICES, x, y)
    c = np.concatenate([np.pad(x, ((1, 1), (0, 2)), constant_values=1.5),
                        np.pad(y, ((1, 1), (0, 0)), constant_values=1.5)[:, [0, 1, 0, 1]]], axis=1)
    np.testing.assert_array_equal(s, c[:, 1:8])
    # the rows of the tensor.empty no slice writes are zeros here (undefined in MLIR)
    np.testing.assert_array_equal(w, [[0, c[1, 0]], [y[0, 0], c[1, 2]], [y[1, 0], c[1, 4]]])


def test_what_it_cannot_evaluate_is_named_with_its_location():
    text = (INPUTS / "matmul_memref.mlir").read_text()
    with pytest.raises(NotInterpretable, match="memref"):
        _eval(text, *[np.zeros(1)] * 3)
    softmax = """
func.func @s(%x: tensor<4x8xf32>) -> tensor<4x8xf32> {
  %e = tensor.empty() : tensor<4x8xf32>
  %r = linalg.softmax dimension(1) ins(%x : tensor<4x8xf32>) outs(%e : tensor<4x8xf32>) -> tensor<4x8xf32>
  return %r : tensor<4x8xf32>
}
"""
    with pytest.raises(NotInterpretable, match=r"<string>:4:\d+: linalg.softmax"):
        _eval(softmax, np.zeros((4, 8), np.float32))


def test_run_checks_against_numpy_unless_the_untuned_build_is_cached(tmp_path, capsys):
    path = str(INPUTS / "mini_net.mlir")
    common = ["run", path, "--db", str(tmp_path / "none.db"), "--cache-dir", str(tmp_path / "cache"), "--json",
              "--repeat", "1"]
    results = []
    for extra in ([], ["--reference", "untuned"], [], ["--reference", "numpy"]):
        assert main(common + extra) == 0
        results.append(json.loads(capsys.readouterr().out))
    refs = [r["reference"] for r in results]
    assert refs == ["numpy evaluation", "untuned build", "untuned build (from the compile cache)", "numpy evaluation"]
    assert results[0]["untuned_latency_s"] is None and results[0]["speedup"] is None
    assert results[1]["untuned_latency_s"] > 0 and results[2]["speedup"] > 0
    assert all(r["ok"] and r["max_relative_error"] <= r["tolerance"] for r in results)


_DECAY = """
func.func @decay(%x: tensor<4x8xf32>) -> tensor<4xf32> {
  %z = arith.constant 0.0 : f32
  %h = arith.constant 0.5 : f32
  %e = tensor.empty() : tensor<4xf32>
  %i = linalg.fill ins(%z : f32) outs(%e : tensor<4xf32>) -> tensor<4xf32>
  %r = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i)>],
                       iterator_types = ["parallel", "reduction"]}
      ins(%x : tensor<4x8xf32>) outs(%i : tensor<4xf32>) {
  ^bb0(%in: f32, %acc: f32):
    %d = arith.mulf %acc, %h : f32
    %s = arith.addf %d, %in : f32
    linalg.yield %s : f32
  } -> tensor<4xf32>
  return %r : tensor<4xf32>
}
"""
"""A reduction whose order matters (acc * 0.5 + x): not ``out <op> x``."""


def test_run_falls_back_to_the_untuned_build(tmp_path, capsys):
    """A function numpy cannot evaluate is checked against the untuned
    build under auto, and is an error under --reference numpy."""
    with pytest.raises(NotInterpretable, match="not out <op> x"):
        _eval(_DECAY, np.zeros((4, 8), np.float32))
    src = tmp_path / "decay.mlir"
    src.write_text(_DECAY)
    common = ["run", str(src), "--db", str(tmp_path / "none.db"), "--no-cache", "--json", "--repeat", "1"]
    assert main(common) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["reference"] == "untuned build" and res["ok"]
    assert main(common + ["--reference", "numpy"]) != 0
    assert "cannot be evaluated with numpy" in capsys.readouterr().err


@pytest.mark.parametrize("which", ["bert", "resnet_block"])
def test_torch_models_match_torch(torch, which):
    """torch-mlir's f32 modules (weights as dense_resource blobs, erf, softmax,
    layer norm, batch norm, padding) against torch's own output."""
    from mlir_ansor.importers.pytorch import import_module

    model, x = small_torch_model(torch, which)
    with torch.no_grad():
        want = model(x).numpy()
    text = import_module(model, (x,))
    assert "dense_resource" in text
    (out,) = _eval(text, x.numpy())
    assert out.shape == want.shape
    assert _rel(out, want) < 2e-6


def test_a_fault_of_the_evaluator_falls_back_to_the_untuned_build(tmp_path, capsys, monkeypatch):
    import mlir_ansor.graph.interpret as interp

    def broken(*args, **kwargs):
        raise IndexError("an evaluator bug")

    monkeypatch.setattr(interp, "interpret", broken)
    common = ["run", str(INPUTS / "mini_net.mlir"), "--db", str(tmp_path / "none.db"), "--no-cache", "--json",
              "--repeat", "1"]
    assert main(common) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["reference"] == "untuned build" and res["ok"]
    assert main(common + ["--reference", "numpy"]) != 0
    assert "IndexError: an evaluator bug" in capsys.readouterr().err
