"""Grouped and 3-D convolutions rewritten as plain 2-D ones, and convolutions
of inputs with zeros between their pixels (transposed convolutions) as
phases of 1x1 ones (`graph/split_conv.py`), and strided copies lowered to loops, not to the C
runner's element-by-element `memrefCopy` (`passes/lowering.py`)."""

from __future__ import annotations

import numpy as np
import pytest
from mlir import ir

import mlir_ansor
from mlir_ansor.compiler import compile_untuned
from mlir_ansor.examples import workloads
from mlir_ansor.graph.split_conv import split_conv3d, split_dilated_input, split_groups
from mlir_ansor.graph.task import extract_tasks
from mlir_ansor.passes.lowering import strided_copies_to_linalg


def _grouped_numpy(x: np.ndarray, k: np.ndarray) -> np.ndarray:
    n, h, w, g, c = x.shape
    _, f, kh, kw, _ = k.shape
    out = np.zeros((n, h - kh + 1, w - kw + 1, g, f), dtype=np.float64)
    for i in range(kh):
        for j in range(kw):
            win = x[:, i : i + h - kh + 1, j : j + w - kw + 1].astype(np.float64)  # n oh ow g c
            out += np.einsum("nhwgc,gfc->nhwgf", win, k[:, :, i, j, :].astype(np.float64))
    return out


def _lowered_driver(scheduled: str) -> tuple[str, int]:
    """The driver of a compiled module once the lowering's driver rewrites
    have run, and how many of its calls accumulate in place."""
    from mlir import passmanager

    from mlir_ansor.passes.lowering import (
        _front,
        accumulate_in_place,
        forward_output_copies,
        views_into_kernels,
    )

    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(scheduled)
        passmanager.PassManager.parse(f"builtin.module({_front()})").run(m.operation)
        forward_output_copies(m)
        views_into_kernels(m)
        in_place = accumulate_in_place(m)
        m.operation.verify()
        driver = next(str(f) for f in m.body.operations if "ansor.normalized" in f.operation.attributes)
    return driver, in_place


def _driver_copies(scheduled: str) -> int:
    """Copies left in the driver of a compiled module (`_lowered_driver`)."""
    driver, _ = _lowered_driver(scheduled)
    return driver.count("memref.copy") + driver.count("linalg.copy")


def test_split_makes_one_plain_conv_per_group():
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(workloads.grouped_conv2d_nhwgc(1, 9, 8, 3, 4, 5, 3, 2))
        fn = m.body.operations[0].operation
        assert split_groups(fn) == 1
        m.operation.verify()
        text = str(m)
    assert "conv_2d_nhwgc_gfhwc" not in text
    assert text.count("linalg.conv_2d_nhwc_hwcf") == 3 and text.count("tensor.insert_slice") == 3
    # the original filled init is gone (every output element is inserted)
    assert text.count("linalg.fill") == 3


def test_grouped_conv_compiles_to_merged_tasks_and_matches_numpy(tmp_path):
    path = tmp_path / "grp.mlir"
    path.write_text(workloads.grouped_conv2d_nhwgc(1, 10, 9, 3, 4, 8, 3, 3))
    tasks = extract_tasks(str(path))  # normalized: split per group
    by_name = {t.name: t for t in tasks}
    conv = next(t for n, t in by_name.items() if n.startswith("conv_2d_nhwc_hwcf"))
    assert conv.weight == 3 and len(tasks) == 2  # the convolution and the filter transpose, once each
    cm = mlir_ansor.compile(str(path), db=None)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 10, 9, 3, 4)).astype(np.float32)
    k = rng.standard_normal((3, 8, 3, 3, 4)).astype(np.float32)
    got = cm(x, k)
    np.testing.assert_allclose(got, _grouped_numpy(x, k), rtol=1e-4, atol=1e-4)
    # each group's convolution reads its slice of the input, and writes its
    # slice of the output, in place (`views_into_kernels`): no copies left
    assert _driver_copies(cm.mlir) == 0
    np.testing.assert_allclose(compile_untuned(str(path))(x, k), got, rtol=1e-4, atol=1e-4)


def test_strided_copies_become_linalg_copies():
    text = """
    func.func @f(%a: memref<4x8xf32>, %b: memref<4x4xf32>, %c: memref<4x8xf32>) {
      %s = memref.subview %a[0, 2] [4, 4] [1, 1] : memref<4x8xf32> to memref<4x4xf32, strided<[8, 1], offset: 2>>
      memref.copy %s, %b : memref<4x4xf32, strided<[8, 1], offset: 2>> to memref<4x4xf32>
      memref.copy %a, %c : memref<4x8xf32> to memref<4x8xf32>
      return
    }"""
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(text)
        assert strided_copies_to_linalg(m) == 1
        out = str(m)
    assert out.count("linalg.copy") == 1 and out.count("memref.copy") == 1  # the contiguous one stays a memcpy


def test_conv3d_becomes_2d_convs_over_the_depth_window(tmp_path):
    text = workloads.conv3d_ndhwc(1, 6, 8, 7, 4, 8, 3)
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(text)
        assert split_conv3d(m.body.operations[0].operation) == 1
        m.operation.verify()
        out = str(m)
    assert "conv_3d" not in out and out.count("linalg.conv_2d_nhwc_hwcf") == 3
    path = tmp_path / "c3d.mlir"
    path.write_text(text)
    names = sorted(t.name for t in extract_tasks(str(path)))
    assert all(n.startswith("conv_2d_nhwc_hwcf_4x6x5x8x3x3x4") for n in names)
    cm = mlir_ansor.compile(str(path), db=None)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 6, 8, 7, 4)).astype(np.float32)
    k = rng.standard_normal((3, 3, 3, 4, 8)).astype(np.float32)
    want = np.zeros((1, 4, 6, 5, 8))
    for a in range(3):
        for b in range(3):
            for c in range(3):
                want += np.einsum("ndhwc,cf->ndhwf", x[:, a : a + 4, b : b + 6, c : c + 5].astype(np.float64), k[a, b, c])
    for _ in range(2):  # the output buffer holds the last call's sum: nothing of it may leak in
        np.testing.assert_allclose(cm(x, k), want, rtol=1e-4, atol=1e-4)
    driver, in_place = _lowered_driver(cm.mlir)
    assert driver.count("memref.copy") + driver.count("linalg.copy") == 0  # the depth windows are read in place
    # the second and third depth taps add to the first in the output itself
    assert in_place == 2 and "memref.alloc" not in driver and driver.count("__inplace(") == 2


def _dilated_conv(n, h, w, c, f, k, stride, pad, out_pad=0, bias=False, channel_first=False) -> str:
    """A transposed convolution as torch-mlir writes one: the input with
    stride-1 zeros between its pixels (``insert_slice`` into a zero fill;
    channel-first then transposed, as the layout pass leaves it, when
    `channel_first`), a plain convolution with the (already flipped) filter
    %K, optionally from a broadcast bias."""
    e = k - 1 - pad
    dh, dw = (h - 1) * stride + 1 + 2 * e + out_pad, (w - 1) * stride + 1 + 2 * e + out_pad
    oh, ow = dh - k + 1, dw - k + 1
    t = lambda *s: "tensor<" + "x".join(map(str, s)) + "xf32>"  # noqa: E731
    if channel_first:
        x_arg, dil = t(n, c, h, w), t(n, c, dh, dw)
        ins = (
            f"  %d0 = tensor.empty() : {dil}\n  %d1 = linalg.fill ins(%zero : f32) outs(%d0 : {dil}) -> {dil}\n"
            f"  %d2 = tensor.insert_slice %I into %d1[0, 0, {e}, {e}] [{n}, {c}, {h}, {w}] [1, 1, {stride}, {stride}] : {x_arg} into {dil}\n"
            f"  %d3 = tensor.empty() : {t(n, dh, dw, c)}\n"
            f"  %x = linalg.transpose ins(%d2 : {dil}) outs(%d3 : {t(n, dh, dw, c)}) permutation = [0, 2, 3, 1]\n"
        )
    else:
        x_arg, dil = t(n, h, w, c), t(n, dh, dw, c)
        ins = (
            f"  %d0 = tensor.empty() : {dil}\n  %d1 = linalg.fill ins(%zero : f32) outs(%d0 : {dil}) -> {dil}\n"
            f"  %x = tensor.insert_slice %I into %d1[0, {e}, {e}, 0] [{n}, {h}, {w}, {c}] [1, {stride}, {stride}, 1] : {x_arg} into {dil}\n"
        )
    out = t(n, oh, ow, f)
    if bias:
        init = f"  %o0 = tensor.empty() : {out}\n  %init = linalg.broadcast ins(%B : {t(f)}) outs(%o0 : {out}) dimensions = [0, 1, 2]\n"
    else:
        init = f"  %o0 = tensor.empty() : {out}\n  %init = linalg.fill ins(%zero : f32) outs(%o0 : {out}) -> {out}\n"
    args = f"%I: {x_arg}, %K: {t(k, k, c, f)}" + (f", %B: {t(f)}" if bias else "")
    return (
        f"func.func @t2d({args}) -> {out} {{\n  %zero = arith.constant 0.0 : f32\n" + ins + init
        + "  %r = linalg.conv_2d_nhwc_hwcf {dilations = dense<1> : tensor<2xi64>, strides = dense<1> : tensor<2xi64>}\n"
        f"      ins(%x, %K : {t(n, dh, dw, c)}, {t(k, k, c, f)}) outs(%init : {out}) -> {out}\n  return %r : {out}\n}}\n"
    )


@pytest.mark.parametrize(
    "shape, opts",
    [
        ((1, 4, 4, 8, 16, 4, 2, 1), {}),  # DCGAN's layer: output 2x the input
        ((2, 3, 5, 4, 8, 3, 2, 1), {"out_pad": 1, "bias": True}),  # taps per phase 2 and 1, a bias
        ((1, 3, 4, 4, 8, 5, 3, 2), {"channel_first": True}),  # stride 3, transposed from NCHW
        ((1, 4, 4, 8, 8, 2, 2, 0), {"bias": True, "channel_first": True}),  # U-Net's 2x2 up-sampling
    ],
)
def test_transposed_conv_skips_the_zeros_and_matches_numpy(tmp_path, shape, opts):
    n, h, w, c, f, k, stride, pad = shape
    text = _dilated_conv(*shape, **opts)
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(text)
        assert split_dilated_input(m.body.operations[0].operation) == 1
        m.operation.verify()
    path = tmp_path / "t2d.mlir"
    path.write_text(text)
    tasks = extract_tasks(str(path))
    convs = [t for t in tasks if t.kind == "convolution"]
    # Only the products with input pixels are left: each pixel meets each tap once.
    assert sum(t.flops * t.weight for t in convs) <= 2 * n * h * w * c * f * k * k
    assert all("1x1" in t.name for t in convs)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((n, c, h, w) if opts.get("channel_first") else (n, h, w, c)).astype(np.float32)
    kf = rng.standard_normal((k, k, c, f)).astype(np.float32)
    args = [x, kf] + ([rng.standard_normal(f).astype(np.float32)] if opts.get("bias") else [])
    got = mlir_ansor.compile(str(path), db=None)(*args)
    xn = x.transpose(0, 2, 3, 1) if opts.get("channel_first") else x
    want = workloads.numpy_reference("conv2d_transpose")(xn, kf[::-1, ::-1], stride, pad, opts.get("out_pad", 0))
    if opts.get("bias"):
        want = want + args[2]
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(compile_untuned(str(path))(*args), got, rtol=1e-4, atol=1e-4)
