"""Grouped and 3-D convolutions rewritten as plain 2-D ones, and convolutions
of inputs with zeros between their pixels (transposed convolutions) as
phases of 1x1 ones (`graph/split_conv.py`), and strided copies lowered to loops, not to the C
runner's element-by-element `memrefCopy` (`passes/drivers.py`)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import filecheck, lowered_driver
from mlir import ir

import mlir_ansor
from mlir_ansor.compiler import compile_untuned
from mlir_ansor.examples import workloads
from mlir_ansor.graph.split_conv import split_conv3d, split_dilated_input, split_groups
from mlir_ansor.graph.task import extract_tasks
from mlir_ansor.passes.drivers import strided_copies_to_linalg


def _grouped_numpy(x: np.ndarray, k: np.ndarray) -> np.ndarray:
    n, h, w, g, c = x.shape
    _, f, kh, kw, _ = k.shape
    out = np.zeros((n, h - kh + 1, w - kw + 1, g, f), dtype=np.float64)
    for i in range(kh):
        for j in range(kw):
            win = x[:, i : i + h - kh + 1, j : j + w - kw + 1].astype(np.float64)  # n oh ow g c
            out += np.einsum("nhwgc,gfc->nhwgf", win, k[:, :, i, j, :].astype(np.float64))
    return out


# Over all of a driver: no copy is left in it.
NO_COPIES = """
CHECK-NOT: memref.copy
CHECK-NOT: linalg.copy
"""


def test_split_makes_one_plain_conv_per_group():
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(workloads.grouped_conv2d_nhwgc(1, 9, 8, 3, 4, 5, 3, 2))
        fn = m.body.operations[0].operation
        assert split_groups(fn) == 1
        m.operation.verify()
        text = str(m)
    # group g: the input's channels g, the filter's group g (transposed to
    # hwcf), a plain convolution from its own zero fill, inserted at g
    filecheck(text, r"""
CHECK-LABEL: func.func @grouped_conv2d(
CHECK-SAME:    %[[X:\w+]]: tensor<1x9x8x3x4xf32>, %[[W:\w+]]: tensor<3x5x3x2x4xf32>)
CHECK:         %[[OUT:\w+]] = tensor.empty() : tensor<1x7x7x3x5xf32>
CHECK:         %[[X0:\w+]] = tensor.extract_slice %[[X]][0, 0, 0, 0, 0] [1, 9, 8, 1, 4] [1, 1, 1, 1, 1] : tensor<1x9x8x3x4xf32> to tensor<1x9x8x4xf32>
CHECK:         %[[W0:\w+]] = tensor.extract_slice %[[W]][0, 0, 0, 0, 0] [1, 5, 3, 2, 4] [1, 1, 1, 1, 1] : tensor<3x5x3x2x4xf32> to tensor<5x3x2x4xf32>
CHECK:         %[[F0:\w+]] = linalg.transpose ins(%[[W0]] : tensor<5x3x2x4xf32>) outs(%{{\w+}} : tensor<3x2x4x5xf32>) permutation = [1, 2, 3, 0]
CHECK:         %[[I0:\w+]] = linalg.fill ins(%{{\w+}} : f32) outs(%{{\w+}} : tensor<1x7x7x5xf32>)
CHECK:         %[[C0:\w+]] = linalg.conv_2d_nhwc_hwcf
CHECK-SAME:      ins(%[[X0]], %[[F0]] : tensor<1x9x8x4xf32>, tensor<3x2x4x5xf32>) outs(%[[I0]] : tensor<1x7x7x5xf32>)
CHECK:         %[[R0:\w+]] = tensor.insert_slice %[[C0]] into %[[OUT]][0, 0, 0, 0, 0] [1, 7, 7, 1, 5] [1, 1, 1, 1, 1]
CHECK:         tensor.extract_slice %[[X]][0, 0, 0, 1, 0] [1, 9, 8, 1, 4]
CHECK:         tensor.extract_slice %[[W]][1, 0, 0, 0, 0] [1, 5, 3, 2, 4]
CHECK:         linalg.fill
CHECK:         %[[C1:\w+]] = linalg.conv_2d_nhwc_hwcf
CHECK:         %[[R1:\w+]] = tensor.insert_slice %[[C1]] into %[[R0]][0, 0, 0, 1, 0] [1, 7, 7, 1, 5]
CHECK:         tensor.extract_slice %[[X]][0, 0, 0, 2, 0] [1, 9, 8, 1, 4]
CHECK:         tensor.extract_slice %[[W]][2, 0, 0, 0, 0] [1, 5, 3, 2, 4]
CHECK:         linalg.fill
CHECK:         %[[C2:\w+]] = linalg.conv_2d_nhwc_hwcf
CHECK:         %[[R2:\w+]] = tensor.insert_slice %[[C2]] into %[[R1]][0, 0, 0, 2, 0] [1, 7, 7, 1, 5]
CHECK-NOT:     linalg.conv
CHECK:         return %[[R2]]
""")
    # no grouped convolution is left, nor the original filled init (every
    # output element is inserted)
    filecheck(text, """
CHECK-NOT: linalg.conv_2d_nhwgc_gfhwc
CHECK-NOT: linalg.fill {{.*}}tensor<1x7x7x3x5xf32>
""")


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
    driver, _ = lowered_driver(cm.mlir)
    filecheck(driver, r"""
CHECK-LABEL: func.func @grouped_conv2d(
CHECK-SAME:    %[[X:\w+]]: memref<1x10x9x3x4xf32>, %{{\w+}}: memref<3x8x3x3x4xf32>, %[[OUT:\w+]]: memref<1x8x7x3x8xf32>)
CHECK-COUNT-3: call @ansor_conv_2d_nhwc_hwcf_{{\w+}}({{.*}}) : (memref<1x10x9x4xf32, strided<[1080, 108, 12, 1], offset: ?>>, memref<3x3x4x8xf32>, memref<1x8x7x8xf32, strided<[1344, 168, 24, 1], offset: ?>>) -> ()
CHECK-NOT:     call @ansor_conv
""")
    filecheck(driver, NO_COPIES)
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
    # the strided copy becomes a linalg.copy (loops); the contiguous one stays a memcpy
    filecheck(out, r"""
CHECK-LABEL: func.func @f(
CHECK-SAME:    %[[A:\w+]]: memref<4x8xf32>, %[[B:\w+]]: memref<4x4xf32>, %[[C:\w+]]: memref<4x8xf32>)
CHECK-NEXT:    %[[S:\w+]] = memref.subview %[[A]][0, 2] [4, 4] [1, 1]
CHECK-NEXT:    linalg.copy {{.*}}ins(%[[S]] : memref<4x4xf32, strided<[8, 1], offset: 2>>) outs(%[[B]] : memref<4x4xf32>)
CHECK-NEXT:    memref.copy %[[A]], %[[C]] : memref<4x8xf32> to memref<4x8xf32>
CHECK-NEXT:    return
""")


_DRIVER_COPIES = """
func.func @f(%a: memref<2x8x6xf32>, %b: memref<2x8x10xf32>, %c: memref<2x4x10xf32>, %d: memref<6x8xf32>,
             %e: memref<2x8x6xf32>) attributes {ansor.normalized} {
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %c2 = arith.constant 2 : index
  %s0 = memref.subview %b[0, 0, 4] [2, 8, 6] [1, 1, 1] : memref<2x8x10xf32> to memref<2x8x6xf32, strided<[80, 10, 1], offset: 4>>
  memref.copy %a, %s0 : memref<2x8x6xf32> to memref<2x8x6xf32, strided<[80, 10, 1], offset: 4>>
  %s1 = memref.subview %b[0, 2, 0] [2, 4, 10] [1, 1, 1] : memref<2x8x10xf32> to memref<2x4x10xf32, strided<[80, 10, 1], offset: 20>>
  memref.copy %s1, %c : memref<2x4x10xf32, strided<[80, 10, 1], offset: 20>> to memref<2x4x10xf32>
  %t = memref.transpose %d (i, j) -> (j, i) : memref<6x8xf32> to memref<8x6xf32, strided<[1, 8]>>
  %s2 = memref.subview %e[1, 0, 0] [1, 8, 6] [1, 1, 1] : memref<2x8x6xf32> to memref<8x6xf32, strided<[6, 1], offset: 48>>
  memref.copy %t, %s2 : memref<8x6xf32, strided<[1, 8]>> to memref<8x6xf32, strided<[6, 1], offset: 48>>
  scf.for %i = %c0 to %c2 step %c1 {
    %s3 = memref.subview %a[%i, 0, 0] [1, 8, 6] [1, 1, 1] : memref<2x8x6xf32> to memref<8x6xf32, strided<[6, 1], offset: ?>>
    %s4 = memref.subview %e[0, 0, 0] [1, 8, 6] [1, 1, 1] : memref<2x8x6xf32> to memref<8x6xf32, strided<[6, 1]>>
    memref.copy %s3, %s4 : memref<8x6xf32, strided<[6, 1], offset: ?>> to memref<8x6xf32, strided<[6, 1]>>
  }
  return
}"""


def test_a_drivers_strided_copies_call_one_routine_per_rank_and_element_type():
    """DenseNet-121's driver held 711 strided copies (its concatenations),
    each a loop nest LLVM's loop passes took 40 s over; a driver's copies
    outside loops now call one routine of any sizes and strides per rank
    (innermost stride 1 or not). A copy in a loop stays inline."""
    import ctypes

    from mlir import runtime as rt
    from mlir.execution_engine import ExecutionEngine

    from mlir_ansor.passes.lowering import lower_to_llvm

    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(_DRIVER_COPIES)
        assert strided_copies_to_linalg(m) == 4
        m.operation.verify()
        out = str(m)
    filecheck(out, r"""
CHECK-LABEL: func.func @f(
CHECK:         %[[A:\w+]] = memref.cast %{{\w+}} : memref<2x8x6xf32> to memref<?x?x?xf32, strided<[?, ?, 1], offset: ?>>
CHECK-NEXT:    %[[B:\w+]] = memref.cast %{{\w+}} : memref<2x8x6xf32, strided<[80, 10, 1], offset: 4>> to memref<?x?x?xf32, strided<[?, ?, 1], offset: ?>>
CHECK-NEXT:    call @__ansor_copy_3d_f32_unit(%[[A]], %[[B]])
CHECK:         call @__ansor_copy_3d_f32_unit(
CHECK:         call @__ansor_copy_2d_f32(
CHECK:         scf.for
CHECK:           linalg.copy
CHECK-LABEL: func.func private @__ansor_copy_3d_f32_unit(
CHECK-SAME:    %{{\w+}}: memref<?x?x?xf32, strided<[?, ?, 1], offset: ?>>, %{{\w+}}: memref<?x?x?xf32, strided<[?, ?, 1], offset: ?>>)
CHECK-NEXT:    linalg.copy
CHECK-NEXT:    return
CHECK-LABEL: func.func private @__ansor_copy_2d_f32(
CHECK-SAME:    memref<?x?xf32, strided<[?, ?], offset: ?>>
""")
    assert out.count("func.func private @__ansor_copy_") == 2
    # and they copy what the copies did
    rng = np.random.default_rng(0)
    a, d = rng.random((2, 8, 6), np.float32), rng.random((6, 8), np.float32)
    b, c, e = rng.random((2, 8, 10), np.float32), np.zeros((2, 4, 10), np.float32), np.zeros((2, 8, 6), np.float32)
    want_b = b.copy()
    want_b[:, :, 4:] = a
    want_c = want_b[:, 2:6, :]
    want_e = np.stack([a[1], d.T])
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(_DRIVER_COPIES)
        lower_to_llvm(m)
        ExecutionEngine(m, opt_level=2).invoke(
            "f", *[ctypes.pointer(ctypes.pointer(rt.get_ranked_memref_descriptor(v))) for v in (a, b, c, d, e)])
    np.testing.assert_array_equal(b, want_b)
    np.testing.assert_array_equal(c, want_c)
    np.testing.assert_array_equal(e, want_e)


def test_conv3d_becomes_2d_convs_over_the_depth_window(tmp_path):
    text = workloads.conv3d_ndhwc(1, 6, 8, 7, 4, 8, 3)
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(text)
        assert split_conv3d(m.body.operations[0].operation) == 1
        m.operation.verify()
        out = str(m)
    # depth tap d: the input's depths d..d+3 and the filter's tap d, a 2-D
    # convolution (depth folded into the batch) adding to the previous tap's
    # result; the last one expanded back to the 3-D output
    filecheck(out, r"""
CHECK-LABEL: func.func @conv3d(
CHECK-SAME:    %[[X:\w+]]: tensor<1x6x8x7x4xf32>, %[[W:\w+]]: tensor<3x3x3x4x8xf32>)
CHECK:         %[[INIT:\w+]] = linalg.fill ins(%{{\w+}} : f32) outs(%{{\w+}} : tensor<4x6x5x8xf32>)
CHECK:         tensor.extract_slice %[[X]][0, 0, 0, 0, 0] [1, 4, 8, 7, 4]
CHECK:         tensor.extract_slice %[[W]][0, 0, 0, 0, 0] [1, 3, 3, 4, 8]
CHECK:         %[[C0:\w+]] = linalg.conv_2d_nhwc_hwcf {{.*}} outs(%[[INIT]] : tensor<4x6x5x8xf32>)
CHECK:         tensor.extract_slice %[[X]][0, 1, 0, 0, 0] [1, 4, 8, 7, 4]
CHECK:         tensor.extract_slice %[[W]][1, 0, 0, 0, 0] [1, 3, 3, 4, 8]
CHECK:         %[[C1:\w+]] = linalg.conv_2d_nhwc_hwcf {{.*}} outs(%[[C0]] : tensor<4x6x5x8xf32>)
CHECK:         tensor.extract_slice %[[X]][0, 2, 0, 0, 0] [1, 4, 8, 7, 4]
CHECK:         tensor.extract_slice %[[W]][2, 0, 0, 0, 0] [1, 3, 3, 4, 8]
CHECK:         %[[C2:\w+]] = linalg.conv_2d_nhwc_hwcf {{.*}} outs(%[[C1]] : tensor<4x6x5x8xf32>)
CHECK-NOT:     linalg.conv
CHECK:         %[[Y:\w+]] = tensor.expand_shape %[[C2]] {{\[\[}}0, 1], [2], [3], [4]] output_shape [1, 4, 6, 5, 8]
CHECK-NEXT:    return %[[Y]]
""")
    filecheck(out, "CHECK-NOT: linalg.conv_3d")
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
    driver, in_place = lowered_driver(cm.mlir)
    # the depth windows are read in place (views of the input), and the
    # second and third depth taps add to the first in the output itself
    assert in_place == 2
    filecheck(driver, r"""
CHECK-LABEL: func.func @conv3d(
CHECK-SAME:    %[[X:\w+]]: memref<1x6x8x7x4xf32>, %{{\w+}}: memref<3x3x3x4x8xf32>, %[[OUT:\w+]]: memref<1x4x6x5x8xf32>)
CHECK-DAG:     memref.subview %[[X]][0, 0, 0, 0, 0] [1, 4, 8, 7, 4]
CHECK-DAG:     %[[Y:\w+]] = memref.collapse_shape %[[OUT]] {{\[\[}}0, 1], [2], [3], [4]] : memref<1x4x6x5x8xf32> into memref<4x6x5x8xf32>
CHECK:         call @ansor_conv_2d_nhwc_hwcf_{{\w+}}(%{{\w+}}, %{{\w+}}, %[[Y]])
CHECK:         memref.subview %[[X]][0, 1, 0, 0, 0] [1, 4, 8, 7, 4]
CHECK:         call @{{\w+}}__inplace(%{{\w+}}, %{{\w+}}, %[[Y]], %[[Y]])
CHECK:         memref.subview %[[X]][0, 2, 0, 0, 0] [1, 4, 8, 7, 4]
CHECK:         call @{{\w+}}__inplace(%{{\w+}}, %{{\w+}}, %[[Y]], %[[Y]])
CHECK-NEXT:    return
""")
    filecheck(driver, NO_COPIES + "CHECK-NOT: memref.alloc\n")


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
