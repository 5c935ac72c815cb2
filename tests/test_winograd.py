"""3x3 convolutions in Winograd's F(4x4, 3x3) (`graph.winograd`): the
transform matrices compute the convolution exactly, the rewrite leaves
tasks the CPU rules schedule and no convolution, the filter transform folds
with numpy, and a compiled module matches the direct convolution."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from mlir_ansor.graph import task as task_module
from mlir_ansor.graph.winograd import A_T, B_T, MIN_BLOCKS, MIN_CHANNELS, G
from mlir_ansor.ir.program import load
from mlir_ansor.search.tasks import tasks_for
from mlir_ansor.target import Target

CPU = Target.cpu("znver4", cores=1)


@pytest.fixture(autouse=True)
def winograd_on(monkeypatch):
    """The rewrite is off by default (`graph.task.WINOGRAD`); these tests
    turn it on."""
    monkeypatch.setattr(task_module, "WINOGRAD", True)


def _matmul(a, b):
    return [[sum((x * y for x, y in zip(row, col)), Fraction(0)) for col in zip(*b)] for row in a]


def _transpose(a):
    return [list(r) for r in zip(*a)]


def test_the_matrices_compute_a_3x3_correlation_exactly():
    """A^T [(G g G^T) * (B^T d B)] A is the 4x4 correlation of a 6x6 block
    d with a 3x3 filter g, in exact rational arithmetic."""
    rng = np.random.default_rng(0)
    for _ in range(3):
        d = [[Fraction(int(v)) for v in row] for row in rng.integers(-9, 10, (6, 6))]
        g = [[Fraction(int(v)) for v in row] for row in rng.integers(-9, 10, (3, 3))]
        u = _matmul(_matmul(G, g), _transpose(G))
        v = _matmul(_matmul(B_T, d), _transpose(B_T))
        m = [[u[i][j] * v[i][j] for j in range(6)] for i in range(6)]
        y = _matmul(_matmul(A_T, m), _transpose(A_T))
        want = [[sum(d[i + a][j + b] * g[a][b] for a in range(3) for b in range(3)) for j in range(4)] for i in range(4)]
        assert y == want


def conv_module(h: int, w: int, c: int, f: int, *, stride: int = 1, constant: bool = True, seed: int = 0):
    """relu(conv3x3(pad(x, 1), W) + bias), NHWC / HWCF, W a dense constant
    (or the function's second argument); returns (text, W, bias)."""
    rng = np.random.default_rng(seed)
    wts = (rng.standard_normal((3, 3, c, f)) / np.sqrt(9 * c)).astype(np.float32)
    bias = rng.standard_normal(f).astype(np.float32)
    ho, wo = (h - 1) // stride + 1, (w - 1) // stride + 1

    def t(*s):
        return "tensor<" + "x".join(map(str, s)) + "xf32>"

    def dense(a):
        return f'dense<"0x{a.tobytes().hex().upper()}">'

    args = f"%x: {t(1, h, w, c)}" + ("" if constant else f", %w: {t(3, 3, c, f)}")
    w_def = f"%w = arith.constant {dense(wts)} : {t(3, 3, c, f)}" if constant else ""
    text = f"""
func.func @conv({args}) -> {t(1, ho, wo, f)} {{
  {w_def}
  %b = arith.constant {dense(bias)} : tensor<{f}xf32>
  %z = arith.constant 0.0 : f32
  %p = tensor.pad %x low[0, 1, 1, 0] high[0, 1, 1, 0] {{
  ^bb0(%i: index, %j: index, %k: index, %l: index):
    tensor.yield %z : f32
  }} : {t(1, h, w, c)} to {t(1, h + 2, w + 2, c)}
  %e = tensor.empty() : {t(1, ho, wo, f)}
  %fl = linalg.fill ins(%z : f32) outs(%e : {t(1, ho, wo, f)}) -> {t(1, ho, wo, f)}
  %c = linalg.conv_2d_nhwc_hwcf {{dilations = dense<1> : tensor<2xi64>, strides = dense<{stride}> : tensor<2xi64>}}
    ins(%p, %w : {t(1, h + 2, w + 2, c)}, {t(3, 3, c, f)}) outs(%fl : {t(1, ho, wo, f)}) -> {t(1, ho, wo, f)}
  %r = linalg.generic {{indexing_maps = [affine_map<(a, b, c, d) -> (a, b, c, d)>, affine_map<(a, b, c, d) -> (d)>,
                                        affine_map<(a, b, c, d) -> (a, b, c, d)>],
                       iterator_types = ["parallel", "parallel", "parallel", "parallel"]}}
      ins(%c, %b : {t(1, ho, wo, f)}, tensor<{f}xf32>) outs(%e : {t(1, ho, wo, f)}) {{
  ^bb0(%in: f32, %bi: f32, %o: f32):
    %s = arith.addf %in, %bi : f32
    %m = arith.maximumf %s, %z : f32
    linalg.yield %m : f32
  }} -> {t(1, ho, wo, f)}
  return %r : {t(1, ho, wo, f)}
}}
"""
    return text, wts, bias


def _reference(x: np.ndarray, wts: np.ndarray, bias: np.ndarray) -> np.ndarray:
    xp = np.pad(x.astype(np.float64), ((0, 0), (1, 1), (1, 1), (0, 0)))
    h, w = x.shape[1:3]
    y = sum(np.einsum("nhwc,cf->nhwf", xp[:, i:i + h, j:j + w], wts[i, j].astype(np.float64)) for i in range(3) for j in range(3))
    return np.maximum(y + bias, 0.0)


def _names(text: str) -> list[str]:
    return [t.name for t in tasks_for(load(text=text), CPU)]


def test_a_3x3_convolution_becomes_transforms_and_a_batched_contraction():
    """56x56 (whole 4x4 blocks): two input passes, the 36 points' contraction
    (the filter transform folded away: not a task), two output passes and
    the bias with its ReLU; no convolution is left."""
    names = _names(conv_module(56, 56, 64, 64)[0])
    assert not any(n.startswith("conv") for n in names), names
    assert "contraction_36x196x64x64_f32" in names
    assert sum(n.startswith("generic_") for n in names) == 5, names


@pytest.mark.parametrize(
    "kwargs",
    [
        {"stride": 2},  # F(4x4, 3x3) is for unit strides
        {"constant": False},  # the filter's transform would run on every call
        {"c": MIN_CHANNELS // 2},  # too few channels to pay for the transforms
        {"h": 4 * 4, "w": 4 * (MIN_BLOCKS // 4 - 1)},  # too few blocks to pay for reading U
    ],
)
def test_what_stays_a_direct_convolution(kwargs):
    args = {"h": 32, "w": 32, "c": 64, "f": 64, **kwargs}
    c = args.pop("c")
    names = _names(conv_module(args.pop("h"), args.pop("w"), c, args.pop("f"), **args)[0])
    assert any(n.startswith("conv_2d_nhwc_hwcf") for n in names), names


def test_off_for_gpus_and_by_default(monkeypatch):
    text = conv_module(32, 32, 64, 64)[0]
    assert any(t.name.startswith("conv") for t in tasks_for(load(text=text), Target.cuda(90)))
    monkeypatch.undo()
    assert task_module.WINOGRAD is False
    assert any(n.startswith("conv") for n in _names(text))


@pytest.mark.parametrize("hw", [(24, 24), (26, 30)])
def test_a_compiled_module_matches_the_direct_convolution(hw):
    """Whole blocks (24x24) and a cropped image (26x30: 28x32 computed, the
    rest cut away), default schedules, the filter folded at compile time."""
    from mlir_ansor import compile  # noqa: A004

    h, w = hw
    text, wts, bias = conv_module(h, w, 32, 48, seed=3)
    cm = compile(load(text=text), target=Target.host(), cache_dir=False)
    assert any(k.task.name.startswith("contraction_36x") for k in cm.kernels)
    x = np.random.default_rng(5).standard_normal((1, h, w, 32)).astype(np.float32)
    got = np.asarray(cm(x))
    want = _reference(x, wts, bias)
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


def test_the_filter_transform_folds_with_numpy():
    """The filter's transform reads its taps through maps with constant
    results ((d0, d1, d2, d3) -> (2, 1, d2, d3)); `graph.fold_eval` evaluates
    such maps (it had to build them through LLVM before), and gets the same
    U = G g G^T as numpy."""
    from mlir import ir

    from mlir_ansor.graph.constants import FOLD_ENTRY
    from mlir_ansor.graph.fold_eval import evaluate
    from mlir_ansor.graph.winograd import filter_transform

    c = f = 2
    g = np.arange(3 * 3 * c * f, dtype=np.float32).reshape(3, 3, c, f) / 7
    columns = "\n".join(
        f"%g{j} = arith.constant dense<[{', '.join(repr(float(row[j])) for row in G)}]> : tensor<6xf32>" for j in range(3)
    )
    fold = (
        f"func.func @{FOLD_ENTRY}() -> tensor<6x6x{c}x{f}xf32> {{\n"
        f'%g = arith.constant dense<"0x{g.tobytes().hex().upper()}"> : tensor<3x3x{c}x{f}xf32>\n{columns}\n'
        + "\n".join(filter_transform(c, f))
        + f"\nreturn %u : tensor<6x6x{c}x{f}xf32>\n}}"
    )
    with ir.Context():
        (u,) = evaluate(ir.Module.parse(fold), FOLD_ENTRY, {})
    gm = np.array([[float(v) for v in row] for row in G])
    want = np.einsum("xk,klcf,yl->xycf", gm, g.astype(np.float64), gm)
    assert np.abs(u - want).max() < 1e-5 * np.abs(want).max()
