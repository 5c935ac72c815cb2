"""Convolutions our sketches cannot vectorize, as plain 2-D ones.

Entry point: :func:`split_convolutions`, run by :func:`.normalize.normalize`.

Why: only ``conv_2d_nhwc_hwcf``-like ops decompose to the 1-D convolutions
the vectorizer knows (upstream ``DecomposeConvolutionPatterns``); a grouped
or a 3-D convolution falls back to loops. Measured on one core: Ansor's GRP
(56x56, 4 groups of 16 channels) ran at 2.5 GFLOP/s and C3D (16x56x56,
64 -> 64, 3x3x3) at 1.9, where the plain 64-channel 2-D convolution of the
same image ran at 68.

* A grouped ``conv_2d_nhwgc_gfhwc`` is G independent ``conv_2d_nhwc_hwcf``:
  each group's input channels are a slice of the input, its filter a slice
  of the filter (transposed FHWC -> HWCF), its output a slice of the output.
  The G convolutions have the same shapes, so task extraction merges them
  into one task of weight G, tuned once.
* A ``conv_3d_ndhwc_dhwcf`` is a sum over the depth window: for each kd, the
  input's depths kd .. kd + OD - 1 as a batch of N * OD images, convolved in
  2-D with the filter's slice kd (already HWCF), each accumulating into the
  same output (``outs`` chains them); the output is reshaped back.

Slices and reshapes stay outside the tasks (``tensor.extract_slice`` /
``insert_slice`` are glue, like reshapes): the tasks read and write whole
tensors. Only static shapes with unit strides and dilations along the split
dimension are rewritten; anything else is left alone.
"""

from __future__ import annotations

from mlir import ir

from .layout import _ints, _static_tensor, fill_value

__all__ = ["split_conv3d", "split_convolutions", "split_groups"]

_GROUPED = "linalg.conv_2d_nhwgc_gfhwc"
_CONV3D = "linalg.conv_3d_ndhwc_dhwcf"


def _slice(src: ir.Value, offsets: list[int], sizes: list[int], result_shape: list[int]) -> ir.Value:
    """A rank-reducing ``tensor.extract_slice`` of `src` (unit strides)."""
    from mlir.dialects import tensor

    t = ir.RankedTensorType(src.type)
    result = ir.RankedTensorType.get(result_shape, t.element_type)
    return tensor.ExtractSliceOp(
        result, src, [], [], [], ir.DenseI64ArrayAttr.get(offsets), ir.DenseI64ArrayAttr.get(sizes),
        ir.DenseI64ArrayAttr.get([1] * len(sizes)),
    ).result


def _insert(src: ir.Value, dest: ir.Value, offsets: list[int], sizes: list[int]) -> ir.Value:
    from mlir.dialects import tensor

    return tensor.InsertSliceOp(
        src, dest, [], [], [], ir.DenseI64ArrayAttr.get(offsets), ir.DenseI64ArrayAttr.get(sizes),
        ir.DenseI64ArrayAttr.get([1] * len(sizes)),
    ).result


def _split(op: ir.Operation) -> bool:
    from mlir.dialects import linalg, tensor

    x, w, init = op.operands
    if not all(_static_tensor(v) for v in (x, w, init)):
        return False
    n, h, wd, g, c = ir.RankedTensorType(x.type).shape
    _, f, kh, kw, _ = ir.RankedTensorType(w.type).shape
    _, oh, ow, _, _ = ir.RankedTensorType(init.type).shape
    elem = ir.RankedTensorType(init.type).element_type
    fill = fill_value(init)
    strides, dilations = _ints(op.attributes["strides"]), _ints(op.attributes["dilations"])
    with ir.InsertionPoint(op), op.location:
        # Every element of the result is written by one group's insert, so a
        # filled init needs no copy: start from an empty tensor.
        acc = tensor.EmptyOp([n, oh, ow, g, f], elem).result if fill is not None else init
        for k in range(g):
            xk = _slice(x, [0, 0, 0, k, 0], [n, h, wd, 1, c], [n, h, wd, c])
            wk = _slice(w, [k, 0, 0, 0, 0], [1, f, kh, kw, c], [f, kh, kw, c])
            hwcf = tensor.EmptyOp([kh, kw, c, f], ir.RankedTensorType(w.type).element_type).result
            wk = linalg.transpose(wk, outs=[hwcf], permutation=[1, 2, 3, 0])
            if fill is not None:
                ik = linalg.fill(fill, outs=[tensor.EmptyOp([n, oh, ow, f], elem).result])
            else:
                ik = _slice(init, [0, 0, 0, k, 0], [n, oh, ow, 1, f], [n, oh, ow, f])
            yk = linalg.conv_2d_nhwc_hwcf(xk, wk, outs=[ik], strides=strides, dilations=dilations)
            acc = _insert(yk, acc, [0, 0, 0, k, 0], [n, oh, ow, 1, f])
    op.results[0].replace_all_uses_with(acc)
    op.erase()
    return True


def split_groups(fn: ir.Operation) -> int:
    """Split every static ``linalg.conv_2d_nhwgc_gfhwc`` directly in `fn`'s
    body into one ``linalg.conv_2d_nhwc_hwcf`` per group; returns how many
    grouped convolutions were split."""
    return _rewrite_all(fn, _GROUPED, _split)


def _rewrite_all(fn: ir.Operation, name: str, rewrite) -> int:
    """Apply `rewrite` to every op called `name` directly in `fn`'s body;
    the filled inits it leaves without uses are erased."""
    body = fn.regions[0].blocks[0]
    count = 0
    for op in [opv.operation for opv in body.operations if opv.operation.name == name]:
        init = op.operands[2]
        if not rewrite(op):
            continue
        count += 1
        owner = None if isinstance(init, ir.BlockArgument) else init.owner
        if owner is not None and owner.name == "linalg.fill" and not list(owner.results[0].uses):
            base = owner.operands[1]
            owner.erase()
            if not isinstance(base, ir.BlockArgument) and not list(base.uses):
                base.owner.erase()
    return count


def _split_3d(op: ir.Operation) -> bool:
    from mlir.dialects import linalg, tensor

    x, w, init = op.operands
    if not all(_static_tensor(v) for v in (x, w, init)):
        return False
    strides, dilations = _ints(op.attributes["strides"]), _ints(op.attributes["dilations"])
    if strides[0] != 1 or dilations[0] != 1:
        return False
    n, _, h, wd, c = ir.RankedTensorType(x.type).shape
    kd, kh, kw, _, f = ir.RankedTensorType(w.type).shape
    _, od, oh, ow, _ = ir.RankedTensorType(init.type).shape
    elem = ir.RankedTensorType(init.type).element_type
    with ir.InsertionPoint(op), op.location:
        fill = fill_value(init)
        if fill is not None:  # the same fill, made in the collapsed shape
            acc = linalg.fill(fill, outs=[tensor.EmptyOp([n * od, oh, ow, f], elem).result])
        else:
            acc = tensor.CollapseShapeOp(
                ir.RankedTensorType.get([n * od, oh, ow, f], elem), init, [[0, 1], [2], [3], [4]]
            ).result
        for k in range(kd):
            xk = _slice(x, [0, k, 0, 0, 0], [n, od, h, wd, c], [n, od, h, wd, c])
            xk = tensor.CollapseShapeOp(
                ir.RankedTensorType.get([n * od, h, wd, c], ir.RankedTensorType(x.type).element_type), xk,
                [[0, 1], [2], [3], [4]],
            ).result
            wk = _slice(w, [k, 0, 0, 0, 0], [1, kh, kw, c, f], [kh, kw, c, f])
            acc = linalg.conv_2d_nhwc_hwcf(xk, wk, outs=[acc], strides=strides[1:], dilations=dilations[1:])
        out = tensor.ExpandShapeOp(
            init.type, acc, [[0, 1], [2], [3], [4]], [], ir.DenseI64ArrayAttr.get([n, od, oh, ow, f])
        ).result
    op.results[0].replace_all_uses_with(out)
    op.erase()
    return True


def split_conv3d(fn: ir.Operation) -> int:
    """Rewrite every static ``linalg.conv_3d_ndhwc_dhwcf`` (unit depth stride
    and dilation) directly in `fn`'s body as 2-D convolutions accumulated over
    the depth window; returns how many were rewritten."""
    return _rewrite_all(fn, _CONV3D, _split_3d)


def split_convolutions(fn: ir.Operation) -> int:
    """:func:`split_groups` and :func:`split_conv3d` on `fn`; returns how many
    convolutions were rewritten."""
    return split_groups(fn) + split_conv3d(fn)
