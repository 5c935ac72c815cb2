"""Single-operator workloads as MLIR text: Ansor's operator set and friends.

Each function returns a module (text) with one `func.func` on tensors, ready
for `mlir_ansor.tune`; `ANSOR_SET` names the shapes the benchmarks use
(Ansor's paper, section 7.1: C1D, C2D, C3D, GMM, GRP, DIL, DEP, T2D, NRM,
SFM, a conv + batch-norm + ReLU layer, and the transpose + batch-matmul
subgraph TBG). `numpy_reference` computes the same function with numpy, for
tests on awkward shapes.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np


def _t(shape: tuple[int, ...], dtype: str = "f32") -> str:
    return "tensor<" + "x".join(str(d) for d in shape) + f"x{dtype}>"


def _zero_init(shape: tuple[int, ...], dtype: str = "f32", name: str = "%init") -> str:
    t = _t(shape, dtype)
    return (
        f"  %zero = arith.constant 0.0 : {dtype}\n"
        f"  %empty = tensor.empty() : {t}\n"
        f"  {name} = linalg.fill ins(%zero : {dtype}) outs(%empty : {t}) -> {t}\n"
    )


def _func(name: str, args: list[tuple[str, tuple[int, ...]]], out: tuple[int, ...], body: str, dtype: str = "f32") -> str:
    params = ", ".join(f"%{a}: {_t(s, dtype)}" for a, s in args)
    return f"func.func @{name}({params}) -> {_t(out, dtype)} {{\n{body}}}\n"


def matmul(m: int, n: int, k: int, dtype: str = "f32") -> str:
    body = _zero_init((m, n), dtype) + (
        f"  %r = linalg.matmul ins(%A, %B : {_t((m, k), dtype)}, {_t((k, n), dtype)}) "
        f"outs(%init : {_t((m, n), dtype)}) -> {_t((m, n), dtype)}\n  return %r : {_t((m, n), dtype)}\n"
    )
    return _func("matmul", [("A", (m, k)), ("B", (k, n))], (m, n), body, dtype)


def batch_matmul(b: int, m: int, n: int, k: int) -> str:
    body = _zero_init((b, m, n)) + (
        f"  %r = linalg.batch_matmul ins(%A, %B : {_t((b, m, k))}, {_t((b, k, n))}) "
        f"outs(%init : {_t((b, m, n))}) -> {_t((b, m, n))}\n  return %r : {_t((b, m, n))}\n"
    )
    return _func("batch_matmul", [("A", (b, m, k)), ("B", (b, k, n))], (b, m, n), body)


def matmul_transposed_b(m: int, n: int, k: int) -> str:
    """C = A . B^T with B stored (n, k), written as a linalg.generic."""
    body = _zero_init((m, n)) + (
        "  %r = linalg.generic {indexing_maps = [affine_map<(m, n, k) -> (m, k)>, affine_map<(m, n, k) -> (n, k)>, "
        "affine_map<(m, n, k) -> (m, n)>], iterator_types = [\"parallel\", \"parallel\", \"reduction\"]}\n"
        f"      ins(%A, %B : {_t((m, k))}, {_t((n, k))}) outs(%init : {_t((m, n))}) {{\n"
        "  ^bb0(%a: f32, %b: f32, %c: f32):\n"
        "    %p = arith.mulf %a, %b : f32\n    %s = arith.addf %c, %p : f32\n    linalg.yield %s : f32\n"
        f"  }} -> {_t((m, n))}\n  return %r : {_t((m, n))}\n"
    )
    return _func("matmul_transposed_b", [("A", (m, k)), ("B", (n, k))], (m, n), body)


def conv1d_nwc(n: int, w: int, c: int, f: int, kw: int, stride: int = 1) -> str:
    ow = (w - kw) // stride + 1
    body = _zero_init((n, ow, f)) + (
        f"  %r = linalg.conv_1d_nwc_wcf {{dilations = dense<1> : tensor<1xi64>, strides = dense<{stride}> : tensor<1xi64>}}\n"
        f"      ins(%I, %K : {_t((n, w, c))}, {_t((kw, c, f))}) outs(%init : {_t((n, ow, f))}) -> {_t((n, ow, f))}\n"
        f"  return %r : {_t((n, ow, f))}\n"
    )
    return _func("conv1d", [("I", (n, w, c)), ("K", (kw, c, f))], (n, ow, f), body)


def conv2d_nhwc(n: int, h: int, w: int, c: int, f: int, kh: int, kw: int, stride: int = 1, dilation: int = 1) -> str:
    """`h`, `w` are the (already padded) input sizes."""
    oh = (h - dilation * (kh - 1) - 1) // stride + 1
    ow = (w - dilation * (kw - 1) - 1) // stride + 1
    out = (n, oh, ow, f)
    body = _zero_init(out) + (
        f"  %r = linalg.conv_2d_nhwc_hwcf {{dilations = dense<{dilation}> : tensor<2xi64>, strides = dense<{stride}> : tensor<2xi64>}}\n"
        f"      ins(%I, %K : {_t((n, h, w, c))}, {_t((kh, kw, c, f))}) outs(%init : {_t(out)}) -> {_t(out)}\n"
        f"  return %r : {_t(out)}\n"
    )
    return _func("conv2d", [("I", (n, h, w, c)), ("K", (kh, kw, c, f))], out, body)


def conv2d_nchw(n: int, c: int, h: int, w: int, f: int, kh: int, kw: int, stride: int = 1) -> str:
    oh = (h - kh) // stride + 1
    ow = (w - kw) // stride + 1
    out = (n, f, oh, ow)
    body = _zero_init(out) + (
        f"  %r = linalg.conv_2d_nchw_fchw {{dilations = dense<1> : tensor<2xi64>, strides = dense<{stride}> : tensor<2xi64>}}\n"
        f"      ins(%I, %K : {_t((n, c, h, w))}, {_t((f, c, kh, kw))}) outs(%init : {_t(out)}) -> {_t(out)}\n"
        f"  return %r : {_t(out)}\n"
    )
    return _func("conv2d_nchw", [("I", (n, c, h, w)), ("K", (f, c, kh, kw))], out, body)


def depthwise_conv2d_nhwc(n: int, h: int, w: int, c: int, kh: int, kw: int, stride: int = 1) -> str:
    oh = (h - kh) // stride + 1
    ow = (w - kw) // stride + 1
    out = (n, oh, ow, c)
    body = _zero_init(out) + (
        f"  %r = linalg.depthwise_conv_2d_nhwc_hwc {{dilations = dense<1> : tensor<2xi64>, strides = dense<{stride}> : tensor<2xi64>}}\n"
        f"      ins(%I, %K : {_t((n, h, w, c))}, {_t((kh, kw, c))}) outs(%init : {_t(out)}) -> {_t(out)}\n"
        f"  return %r : {_t(out)}\n"
    )
    return _func("depthwise_conv2d", [("I", (n, h, w, c)), ("K", (kh, kw, c))], out, body)


def grouped_conv2d_nhwgc(n: int, h: int, w: int, g: int, c: int, f: int, kh: int, kw: int) -> str:
    """Grouped convolution: `g` groups of `c` input and `f` output channels."""
    oh, ow = h - kh + 1, w - kw + 1
    out = (n, oh, ow, g, f)
    body = _zero_init(out) + (
        "  %r = linalg.conv_2d_nhwgc_gfhwc {dilations = dense<1> : tensor<2xi64>, strides = dense<1> : tensor<2xi64>}\n"
        f"      ins(%I, %K : {_t((n, h, w, g, c))}, {_t((g, f, kh, kw, c))}) outs(%init : {_t(out)}) -> {_t(out)}\n"
        f"  return %r : {_t(out)}\n"
    )
    return _func("grouped_conv2d", [("I", (n, h, w, g, c)), ("K", (g, f, kh, kw, c))], out, body)


def conv3d_ndhwc(n: int, d: int, h: int, w: int, c: int, f: int, k: int) -> str:
    od, oh, ow = d - k + 1, h - k + 1, w - k + 1
    out = (n, od, oh, ow, f)
    body = _zero_init(out) + (
        "  %r = linalg.conv_3d_ndhwc_dhwcf {dilations = dense<1> : tensor<3xi64>, strides = dense<1> : tensor<3xi64>}\n"
        f"      ins(%I, %K : {_t((n, d, h, w, c))}, {_t((k, k, k, c, f))}) outs(%init : {_t(out)}) -> {_t(out)}\n"
        f"  return %r : {_t(out)}\n"
    )
    return _func("conv3d", [("I", (n, d, h, w, c)), ("K", (k, k, k, c, f))], out, body)


def conv2d_transpose_nhwc(n: int, h: int, w: int, c: int, f: int, k: int, stride: int, pad: int) -> str:
    """Transposed 2-D convolution (DCGAN's up-sampling layer, Ansor's T2D),
    NHWC input, filter (kh, kw, c, f), output (n, stride*h, stride*w, f).

    Linalg has no named op for it; written here as what it is, without the
    zeros a dilated input would multiply: output row ``o = stride*m + p``
    (phase ``p``) gathers the taps ``kh = r + stride*u`` with
    ``r = (p + pad) % stride``, from input row ``m + (p + pad) // stride - u``.
    So each (phase, tap) pair is a 1x1 convolution (a GEMM over the channels)
    of a shifted window of the zero-padded input with one ``[c, f]`` slab of
    the filter; every phase accumulates its ``(k/stride)^2`` taps, and its
    result is inserted with stride ``stride`` into the output. Slices and the
    pad are views and copies outside the tasks; the 1x1 convolutions are two
    tasks (the first tap of a phase starts from zero, the others accumulate).
    Requires ``k % stride == 0`` and ``k - 2*pad == stride`` (output
    ``stride*h``), the shape of every DCGAN generator layer.
    """
    if k % stride or k - 2 * pad != stride:
        raise ValueError(f"conv2d_transpose_nhwc: needs k % stride == 0 and k - 2*pad == stride (k={k}, stride={stride}, pad={pad})")
    t = k // stride
    taps = {p: [((p + pad) % stride + stride * u, (p + pad) // stride - u) for u in range(t)] for p in range(stride)}
    offs = [off for p in taps for _, off in taps[p]]
    lo, hi = -min(offs), max(offs)
    xp = (n, h + lo + hi, w + lo + hi, c)
    out = (n, stride * h, stride * w, f)
    y = (n, h, w, f)
    x_t, k_t, y_t = _t((n, h, w, c)), _t((1, 1, c, f)), _t(y)
    conv = "linalg.conv_2d_nhwc_hwcf {dilations = dense<1> : tensor<2xi64>, strides = dense<1> : tensor<2xi64>}"
    body = (
        "  %zero = arith.constant 0.0 : f32\n"
        f"  %xp = tensor.pad %I low[0, {lo}, {lo}, 0] high[0, {hi}, {hi}, 0] {{\n"
        "  ^bb0(%i0: index, %i1: index, %i2: index, %i3: index):\n    tensor.yield %zero : f32\n"
        f"  }} : {_t((n, h, w, c))} to {_t(xp)}\n"
        f"  %ye = tensor.empty() : {y_t}\n"
        f"  %y0 = linalg.fill ins(%zero : f32) outs(%ye : {y_t}) -> {y_t}\n"
        f"  %o0 = tensor.empty() : {_t(out)}\n"
    )
    last = "%o0"
    for p in range(stride):
        for q in range(stride):
            acc = "%y0"
            for i, (kh, dh) in enumerate(taps[p]):
                for j, (kw, dw) in enumerate(taps[q]):
                    v = f"p{p}q{q}_{i}{j}"
                    body += (
                        f"  %x_{v} = tensor.extract_slice %xp[0, {dh + lo}, {dw + lo}, 0] [{n}, {h}, {w}, {c}] [1, 1, 1, 1] : {_t(xp)} to {x_t}\n"
                        f"  %k_{v} = tensor.extract_slice %K[{kh}, {kw}, 0, 0] [1, 1, {c}, {f}] [1, 1, 1, 1] : {_t((k, k, c, f))} to {k_t}\n"
                        f"  %y_{v} = {conv}\n      ins(%x_{v}, %k_{v} : {x_t}, {k_t}) outs({acc} : {y_t}) -> {y_t}\n"
                    )
                    acc = f"%y_{v}"
            body += f"  %o_p{p}q{q} = tensor.insert_slice {acc} into {last}[0, {p}, {q}, 0] [{n}, {h}, {w}, {f}] [1, {stride}, {stride}, 1] : {y_t} into {_t(out)}\n"
            last = f"%o_p{p}q{q}"
    body += f"  return {last} : {_t(out)}\n"
    return _func("conv2d_transpose", [("I", (n, h, w, c)), ("K", (k, k, c, f))], out, body)


def pool2d_nhwc(n: int, h: int, w: int, c: int, k: int, stride: int, kind: str = "max") -> str:
    oh, ow = (h - k) // stride + 1, (w - k) // stride + 1
    out = (n, oh, ow, c)
    init = "0xFF800000" if kind == "max" else "0.0"
    body = (
        f"  %zero = arith.constant {init} : f32\n"
        f"  %empty = tensor.empty() : {_t(out)}\n"
        f"  %init = linalg.fill ins(%zero : f32) outs(%empty : {_t(out)}) -> {_t(out)}\n"
        f"  %win = tensor.empty() : {_t((k, k))}\n"
        f"  %r = linalg.pooling_nhwc_{kind} {{dilations = dense<1> : tensor<2xi64>, strides = dense<{stride}> : tensor<2xi64>}}\n"
        f"      ins(%I, %win : {_t((n, h, w, c))}, {_t((k, k))}) outs(%init : {_t(out)}) -> {_t(out)}\n"
        f"  return %r : {_t(out)}\n"
    )
    return _func(f"pool_{kind}", [("I", (n, h, w, c))], out, body)


def reduce_last(m: int, n: int) -> str:
    """Row sums: out[i] = sum_j in[i, j]."""
    body = _zero_init((m,)) + (
        "  %r = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i)>], "
        "iterator_types = [\"parallel\", \"reduction\"]}\n"
        f"      ins(%X : {_t((m, n))}) outs(%init : {_t((m,))}) {{\n"
        "  ^bb0(%x: f32, %acc: f32):\n    %s = arith.addf %acc, %x : f32\n    linalg.yield %s : f32\n"
        f"  }} -> {_t((m,))}\n  return %r : {_t((m,))}\n"
    )
    return _func("reduce_sum", [("X", (m, n))], (m,), body)


def elementwise_add_relu(m: int, n: int) -> str:
    t = _t((m, n))
    body = (
        "  %zero = arith.constant 0.0 : f32\n"
        f"  %e = tensor.empty() : {t}\n"
        "  %r = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>, "
        "affine_map<(i, j) -> (i, j)>], iterator_types = [\"parallel\", \"parallel\"]}\n"
        f"      ins(%X, %Y : {t}, {t}) outs(%e : {t}) {{\n"
        "  ^bb0(%x: f32, %y: f32, %o: f32):\n    %s = arith.addf %x, %y : f32\n"
        "    %m = arith.maximumf %s, %zero : f32\n    linalg.yield %m : f32\n"
        f"  }} -> {t}\n  return %r : {t}\n"
    )
    return _func("add_relu", [("X", (m, n)), ("Y", (m, n))], (m, n), body)


def softmax(m: int, n: int) -> str:
    """Row softmax as a chain of linalg.generic ops (max, exp-sum, divide)."""
    t, r = _t((m, n)), _t((m,))
    red = "affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i)>"
    body = (
        "  %ninf = arith.constant 0xFF800000 : f32\n  %zero = arith.constant 0.0 : f32\n"
        f"  %er = tensor.empty() : {r}\n  %e = tensor.empty() : {t}\n"
        f"  %mi = linalg.fill ins(%ninf : f32) outs(%er : {r}) -> {r}\n"
        f"  %mx = linalg.generic {{indexing_maps = [{red}], iterator_types = [\"parallel\", \"reduction\"]}}\n"
        f"      ins(%X : {t}) outs(%mi : {r}) {{\n"
        "  ^bb0(%x: f32, %a: f32):\n    %v = arith.maximumf %a, %x : f32\n    linalg.yield %v : f32\n"
        f"  }} -> {r}\n"
        f"  %si = linalg.fill ins(%zero : f32) outs(%er : {r}) -> {r}\n"
        f"  %sm = linalg.generic {{indexing_maps = [{red}, affine_map<(i, j) -> (i)>], iterator_types = [\"parallel\", \"reduction\"]}}\n"
        f"      ins(%X, %mx : {t}, {r}) outs(%si : {r}) {{\n"
        "  ^bb0(%x: f32, %m: f32, %a: f32):\n    %d = arith.subf %x, %m : f32\n    %ex = math.exp %d : f32\n"
        "    %v = arith.addf %a, %ex : f32\n    linalg.yield %v : f32\n"
        f"  }} -> {r}\n"
        "  %o = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i)>, "
        "affine_map<(i, j) -> (i)>, affine_map<(i, j) -> (i, j)>], iterator_types = [\"parallel\", \"parallel\"]}\n"
        f"      ins(%X, %mx, %sm : {t}, {r}, {r}) outs(%e : {t}) {{\n"
        "  ^bb0(%x: f32, %m: f32, %s: f32, %out: f32):\n    %d = arith.subf %x, %m : f32\n"
        "    %ex = math.exp %d : f32\n    %v = arith.divf %ex, %s : f32\n    linalg.yield %v : f32\n"
        f"  }} -> {t}\n  return %o : {t}\n"
    )
    return _func("softmax", [("X", (m, n))], (m, n), body)


_NEG_INF = {"f32": "0xFF800000", "bf16": "0xFF80", "f16": "0xFC00"}


def attention(h: int, s: int, d: int, dtype: str = "f32") -> str:
    """Scaled dot-product attention over `h` heads of `s` positions: the
    scores ``Q.K^T / sqrt(d)`` (K given transposed, [h, d, s]), a softmax
    over each row of keys, then ``P.V``; as torch-mlir writes it (batch
    matmuls, a division by the scale, the softmax's four generics)."""
    t, r, o = _t((h, s, s), dtype), _t((h, s), dtype), _t((h, s, d), dtype)
    m3, m2 = "affine_map<(b, i, j) -> (b, i, j)>", "affine_map<(b, i, j) -> (b, i)>"

    def generic(ins: list[tuple[str, str, str]], out: tuple[str, str, str], body: str, reduce: bool = False) -> str:
        maps = ", ".join(m for _, _, m in ins + [out])
        its = '"parallel", "parallel", ' + ('"reduction"' if reduce else '"parallel"')
        args = ", ".join(f"%{n}_in: {dtype}" for n, _, _ in ins) + f", %acc: {dtype}"
        return (
            f"linalg.generic {{indexing_maps = [{maps}], iterator_types = [{its}]}}\n"
            f"      ins({', '.join('%' + n for n, _, _ in ins)} : {', '.join(ty for _, ty, _ in ins)}) outs(%{out[0]} : {out[1]}) {{\n"
            f"  ^bb0({args}):\n{body}  }} -> {out[1]}\n"
        )

    body = (
        f"  %zero = arith.constant 0.0 : {dtype}\n  %ninf = arith.constant {_NEG_INF[dtype]} : {dtype}\n"
        f"  %scale = arith.constant {math.sqrt(d)!r} : {dtype}\n"
        f"  %e = tensor.empty() : {t}\n  %er = tensor.empty() : {r}\n  %eo = tensor.empty() : {o}\n"
        f"  %f = linalg.fill ins(%zero : {dtype}) outs(%e : {t}) -> {t}\n"
        f"  %S = linalg.batch_matmul ins(%Q, %Kt : {o}, {_t((h, d, s), dtype)}) outs(%f : {t}) -> {t}\n"
        f"  %s = " + generic([("S", t, m3)], ("e", t, m3), f"    %v = arith.divf %S_in, %scale : {dtype}\n    linalg.yield %v : {dtype}\n")
        + f"  %mi = linalg.fill ins(%ninf : {dtype}) outs(%er : {r}) -> {r}\n"
        f"  %mx = " + generic([("s", t, m3)], ("mi", r, m2), f"    %v = arith.maximumf %s_in, %acc : {dtype}\n    linalg.yield %v : {dtype}\n", True)
        + "  %ex = " + generic(
            [("s", t, m3), ("mx", r, m2)], ("e", t, m3),
            f"    %c = arith.subf %s_in, %mx_in : {dtype}\n    %v = math.exp %c : {dtype}\n    linalg.yield %v : {dtype}\n",
        )
        + f"  %si = linalg.fill ins(%zero : {dtype}) outs(%er : {r}) -> {r}\n"
        f"  %sm = " + generic([("ex", t, m3)], ("si", r, m2), f"    %v = arith.addf %ex_in, %acc : {dtype}\n    linalg.yield %v : {dtype}\n", True)
        + "  %p = " + generic([("ex", t, m3), ("sm", r, m2)], ("e", t, m3), f"    %v = arith.divf %ex_in, %sm_in : {dtype}\n    linalg.yield %v : {dtype}\n")
        + f"  %fo = linalg.fill ins(%zero : {dtype}) outs(%eo : {o}) -> {o}\n"
        f"  %O = linalg.batch_matmul ins(%p, %V : {t}, {o}) outs(%fo : {o}) -> {o}\n  return %O : {o}\n"
    )
    return _func("attention", [("Q", (h, s, d)), ("Kt", (h, d, s)), ("V", (h, s, d))], (h, s, d), body, dtype)


def attention_block(h: int, s: int, d: int) -> str:
    """:func:`attention` as it sits in a torch-mlir BERT layer: Q, K and V
    arrive as the projections' ``[s, h*d]`` results, are split into heads
    (``expand_shape`` to ``[1, s, h, d]``, ``linalg.transpose`` to ``[1, h,
    s, d]`` or ``[1, h, d, s]`` for K, ``collapse_shape`` of the unit
    batch), and the attention's ``[h, s, d]`` output goes back to ``[s,
    h*d]`` the same way, for the output projection."""
    e, o = _t((1, s, h, d)), _t((h, s, d))
    inner = attention(h, s, d)
    inner = inner[inner.index("{", inner.index("func.func")) + 1 : inner.rindex("return")]
    split = "".join(
        f"  %{n}e = tensor.expand_shape %{n}p [[0, 1], [2, 3]] output_shape [1, {s}, {h}, {d}] : {_t((s, h * d))} into {e}\n"
        f"  %{n}0 = tensor.empty() : {_t((1, *shape))}\n"
        f"  %{n}t = linalg.transpose ins(%{n}e : {e}) outs(%{n}0 : {_t((1, *shape))}) permutation = {perm}\n"
        f"  %{name} = tensor.collapse_shape %{n}t [[0, 1], [2], [3]] : {_t((1, *shape))} into {_t(shape)}\n"
        for n, name, shape, perm in (
            ("q", "Q", (h, s, d), [0, 2, 1, 3]),
            ("k", "Kt", (h, d, s), [0, 2, 3, 1]),
            ("v", "V", (h, s, d), [0, 2, 1, 3]),
        )
    )
    merge = (
        f"  %oe = tensor.expand_shape %O [[0, 1], [2], [3]] output_shape [1, {h}, {s}, {d}] : {o} into {_t((1, h, s, d))}\n"
        f"  %o0 = tensor.empty() : {e}\n"
        f"  %ot = linalg.transpose ins(%oe : {_t((1, h, s, d))}) outs(%o0 : {e}) permutation = [0, 2, 1, 3]\n"
        f"  %r = tensor.collapse_shape %ot [[0, 1], [2, 3]] : {e} into {_t((s, h * d))}\n  return %r : {_t((s, h * d))}\n"
    )
    return _func("attention_block", [("qp", (s, h * d)), ("kp", (s, h * d)), ("vp", (s, h * d))], (s, h * d), split + inner + merge)


def attention_block_reference(h: int) -> Callable[..., np.ndarray]:
    """A numpy implementation of :func:`attention_block` with `h` heads."""

    def ref(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        s, hd = q.shape
        heads = [x.reshape(s, h, hd // h).transpose(1, 0, 2) for x in (q, k, v)]
        out = _attention_ref(heads[0], heads[1].transpose(0, 2, 1), heads[2])
        return out.transpose(1, 0, 2).reshape(s, hd)

    return ref


def conv_bias_relu(n: int, h: int, w: int, c: int, f: int, k: int) -> str:
    """conv2d NHWC + per-channel bias (folded batch norm) + ReLU: one task."""
    oh, ow = h - k + 1, w - k + 1
    out = (n, oh, ow, f)
    t = _t(out)
    idm = "affine_map<(n, h, w, f) -> (n, h, w, f)>"
    body = _zero_init(out) + (
        "  %c = linalg.conv_2d_nhwc_hwcf {dilations = dense<1> : tensor<2xi64>, strides = dense<1> : tensor<2xi64>}\n"
        f"      ins(%I, %K : {_t((n, h, w, c))}, {_t((k, k, c, f))}) outs(%init : {t}) -> {t}\n"
        f"  %e2 = tensor.empty() : {t}\n"
        f"  %r = linalg.generic {{indexing_maps = [{idm}, affine_map<(n, h, w, f) -> (f)>, {idm}], "
        "iterator_types = [\"parallel\", \"parallel\", \"parallel\", \"parallel\"]}\n"
        f"      ins(%c, %B : {t}, {_t((f,))}) outs(%e2 : {t}) {{\n"
        "  ^bb0(%x: f32, %b: f32, %o: f32):\n    %s = arith.addf %x, %b : f32\n"
        "    %m = arith.maximumf %s, %zero : f32\n    linalg.yield %m : f32\n"
        f"  }} -> {t}\n  return %r : {t}\n"
    )
    return _func("conv_bias_relu", [("I", (n, h, w, c)), ("K", (k, k, c, f)), ("B", (f,))], out, body)


def transpose_batch_matmul(s: int, h: int, d: int) -> str:
    """Attention scores from (seq, heads, dim) inputs, Ansor's TBG subgraph:
    Q -> (heads, seq, dim) and K -> (heads, dim, seq) by ``linalg.transpose``,
    then ``linalg.batch_matmul`` -> (heads, seq, seq)."""
    q, qt, kt, out = (s, h, d), (h, s, d), (h, d, s), (h, s, s)
    body = (
        f"  %eq = tensor.empty() : {_t(qt)}\n"
        f"  %qt = linalg.transpose ins(%Q : {_t(q)}) outs(%eq : {_t(qt)}) permutation = [1, 0, 2]\n"
        f"  %ek = tensor.empty() : {_t(kt)}\n"
        f"  %kt = linalg.transpose ins(%K : {_t(q)}) outs(%ek : {_t(kt)}) permutation = [1, 2, 0]\n"
    ) + _zero_init(out) + (
        f"  %r = linalg.batch_matmul ins(%qt, %kt : {_t(qt)}, {_t(kt)}) "
        f"outs(%init : {_t(out)}) -> {_t(out)}\n  return %r : {_t(out)}\n"
    )
    return _func("transpose_batch_matmul", [("Q", q), ("K", q)], out, body)


def _conv_nhwc_ref(x: np.ndarray, k: np.ndarray, stride: int = 1, dilation: int = 1) -> np.ndarray:
    n, h, w, c = x.shape
    kh, kw, _, f = k.shape
    oh = (h - dilation * (kh - 1) - 1) // stride + 1
    ow = (w - dilation * (kw - 1) - 1) // stride + 1
    out = np.zeros((n, oh, ow, f), dtype=np.float64)
    for i in range(kh):
        for j in range(kw):
            patch = x[:, i * dilation : i * dilation + stride * oh : stride, j * dilation : j * dilation + stride * ow : stride, :]
            out += np.einsum("nhwc,cf->nhwf", patch, k[i, j])
    return out


def _conv_transpose_nhwc_ref(x: np.ndarray, k: np.ndarray, stride: int = 2, pad: int = 1, out_pad: int = 0) -> np.ndarray:
    """By definition: input pixel i and tap kh add to output row stride*i +
    kh - pad; `out_pad` (at most `pad`) more rows at the end, as PyTorch's
    ``output_padding``."""
    n, h, w, _ = x.shape
    kh, kw, _, f = k.shape
    oh, ow = (h - 1) * stride - 2 * pad + kh + out_pad, (w - 1) * stride - 2 * pad + kw + out_pad
    full = np.zeros((n, (h - 1) * stride + kh, (w - 1) * stride + kw, f), dtype=np.float64)
    for i in range(kh):
        for j in range(kw):
            full[:, i : i + stride * h : stride, j : j + stride * w : stride, :] += np.einsum("nhwc,cf->nhwf", x.astype(np.float64), k[i, j])
    return full[:, pad : pad + oh, pad : pad + ow, :]


def numpy_reference(name: str) -> Callable[..., np.ndarray]:
    """A numpy implementation of the workload called `name` (see ANSOR_SET)."""
    return {
        "matmul": lambda a, b: a.astype(np.float64) @ b,
        "matmul_transposed_b": lambda a, b: a.astype(np.float64) @ b.T,
        "batch_matmul": lambda a, b: np.matmul(a.astype(np.float64), b),
        "conv2d": _conv_nhwc_ref,
        "conv2d_transpose": _conv_transpose_nhwc_ref,
        "add_relu": lambda x, y: np.maximum(x + y, 0),
        "reduce_sum": lambda x: x.astype(np.float64).sum(axis=1),
        "softmax": lambda x: np.exp(x - x.max(1, keepdims=True)) / np.exp(x - x.max(1, keepdims=True)).sum(1, keepdims=True),
        "conv_bias_relu": lambda x, k, b: np.maximum(_conv_nhwc_ref(x, k) + b, 0),
        "transpose_batch_matmul": lambda q, k: np.matmul(q.astype(np.float64).transpose(1, 0, 2), k.transpose(1, 2, 0)),
        "attention": _attention_ref,
    }[name]


def _attention_ref(q: np.ndarray, kt: np.ndarray, v: np.ndarray) -> np.ndarray:
    s = np.matmul(q.astype(np.float64), kt) / math.sqrt(q.shape[-1])
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.matmul(p / p.sum(-1, keepdims=True), v)


# Ansor's single-operator set (batch 1), as our workloads. T2D, which has no
# Linalg named op, is DCGAN's first up-sampling layer written as phases of
# 1x1 convolutions (`conv2d_transpose_nhwc`).
ANSOR_SET: dict[str, Callable[[], str]] = {
    "C1D": lambda: conv1d_nwc(1, 258, 64, 128, 3),
    "C2D": lambda: conv2d_nhwc(1, 58, 58, 64, 64, 3, 3),
    "C3D": lambda: conv3d_ndhwc(1, 18, 58, 58, 64, 64, 3),
    "T2D": lambda: conv2d_transpose_nhwc(1, 4, 4, 512, 256, 4, 2, 1),
    "GMM": lambda: matmul(1024, 1024, 1024),
    "GRP": lambda: grouped_conv2d_nhwgc(1, 58, 58, 4, 16, 16, 3, 3),
    "DIL": lambda: conv2d_nhwc(1, 60, 60, 64, 64, 3, 3, dilation=2),
    "DEP": lambda: depthwise_conv2d_nhwc(1, 114, 114, 32, 3, 3),
    "NRM": lambda: reduce_last(1024, 1024),
    "SFM": lambda: softmax(1024, 1024),
    "CBR": lambda: conv_bias_relu(1, 58, 58, 64, 64, 3),
    # BERT-base attention scores (sequence 128, 12 heads of 64).
    "TBG": lambda: transpose_batch_matmul(128, 12, 64),
}

SUBGRAPHS: tuple[str, ...] = ("CBR", "TBG")
"""The names of ANSOR_SET that are subgraphs of several ops rather than
single operators (conv + bias + ReLU, transpose + batch matmul)."""
