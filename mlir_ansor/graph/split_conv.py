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

* A ``conv_2d_nhwc_hwcf`` (unit strides and dilations) whose input has
  zeros inserted between its pixels -- ``tensor.insert_slice`` with strides
  ``s`` into a zero-filled tensor, perhaps then transposed to channel-last:
  torch-mlir's transposed convolution (``ConvTranspose2d``: a flipped filter,
  the dilated input, a plain convolution) -- multiplies zeros for all but
  ``1/s^2`` of its work. Output row ``o = s*m + p`` (phase ``p``) only meets
  the filter rows ``k = r_p + s*u`` and input rows ``m + u + delta_p``, so it
  becomes, per phase and per such tap, a 1x1 convolution of a shifted window
  of the (undilated, zero-padded) input with one ``[c, f]`` slab of the
  filter, accumulated over the phase's taps and inserted with stride ``s``
  into the output (:func:`split_dilated_input`; the hand-written form of
  ``workloads.conv2d_transpose_nhwc``).

Slices and reshapes stay outside the tasks (``tensor.extract_slice`` /
``insert_slice`` are glue, like reshapes): the tasks read and write whole
tensors. Only static shapes with unit strides and dilations along the split
dimension are rewritten; anything else is left alone.
"""

from __future__ import annotations

from mlir import ir

from mlir_ansor.graph.layout import fill_value
from mlir_ansor.ir.rewrite import (
    defining_op,
    is_float_zero,
    permutation_of,
    static_tensor_type,
    transpose,
    window_ints,
)

__all__ = ["split_conv3d", "split_convolutions", "split_dilated_input", "split_groups"]

_GROUPED = "linalg.conv_2d_nhwgc_gfhwc"
_CONV3D = "linalg.conv_3d_ndhwc_dhwcf"


def _slice(src: ir.Value, offsets: list[int], sizes: list[int], result_shape: list[int], strides: list[int] | None = None) -> ir.Value:
    """A ``tensor.extract_slice`` of `src` (rank-reducing to `result_shape`;
    unit strides unless told)."""
    from mlir.dialects import tensor

    t = ir.RankedTensorType(src.type)
    result = ir.RankedTensorType.get(result_shape, t.element_type)
    return tensor.ExtractSliceOp(
        result, src, [], [], [], ir.DenseI64ArrayAttr.get(offsets), ir.DenseI64ArrayAttr.get(sizes),
        ir.DenseI64ArrayAttr.get(strides or [1] * len(sizes)),
    ).result


def _insert(src: ir.Value, dest: ir.Value, offsets: list[int], sizes: list[int], strides: list[int] | None = None) -> ir.Value:
    from mlir.dialects import tensor

    return tensor.InsertSliceOp(
        src, dest, [], [], [], ir.DenseI64ArrayAttr.get(offsets), ir.DenseI64ArrayAttr.get(sizes),
        ir.DenseI64ArrayAttr.get(strides or [1] * len(sizes)),
    ).result


def _arith_zero(elem: ir.Type) -> ir.Value:
    from mlir.dialects import arith

    return arith.ConstantOp(elem, ir.FloatAttr.get(elem, 0.0)).result


def _tensor_pad(v: ir.Value, low: list[int], high: list[int], value: ir.Value) -> ir.Value:
    """``tensor.pad`` of `v` with the scalar `value`, static amounts."""
    from mlir.dialects import tensor

    t = ir.RankedTensorType(v.type)
    shape = [d + lo + hi for d, lo, hi in zip(t.shape, low, high)]
    pad = tensor.PadOp(ir.RankedTensorType.get(shape, t.element_type), v, [], [], ir.DenseI64ArrayAttr.get(low), ir.DenseI64ArrayAttr.get(high))
    block = pad.regions[0].blocks.append(*([ir.IndexType.get()] * len(shape)))
    with ir.InsertionPoint(block):
        tensor.YieldOp(value)
    return pad.result


def _split(op: ir.Operation) -> bool:
    from mlir.dialects import linalg, tensor

    x, w, init = op.operands
    if not all(static_tensor_type(v) for v in (x, w, init)):
        return False
    n, h, wd, g, c = ir.RankedTensorType(x.type).shape
    _, f, kh, kw, _ = ir.RankedTensorType(w.type).shape
    _, oh, ow, _, _ = ir.RankedTensorType(init.type).shape
    elem = ir.RankedTensorType(init.type).element_type
    fill = fill_value(init)
    strides, dilations = window_ints(op, "strides"), window_ints(op, "dilations")
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
        fill = defining_op(init, "linalg.fill")
        if fill is not None and not list(fill.results[0].uses):
            base = fill.operands[1]
            fill.erase()
            empty = defining_op(base)
            if empty is not None and not list(base.uses):
                empty.erase()
    return count


def _split_3d(op: ir.Operation) -> bool:
    from mlir.dialects import linalg, tensor

    x, w, init = op.operands
    if not all(static_tensor_type(v) for v in (x, w, init)):
        return False
    strides, dilations = window_ints(op, "strides"), window_ints(op, "dilations")
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


def _dilated_source(x: ir.Value) -> tuple[ir.Value, list[int], list[int], list[int], list[int]] | None:
    """If `x` (NHWC) is an input with zeros inserted between its pixels --
    ``tensor.insert_slice %src into zeros[offsets][sizes][strides]``, perhaps
    transposed by ``linalg.transpose`` -- return (src, the transpose's
    permutation or the identity, offsets, strides and src's shape, these three
    in `x`'s dimension order); else None."""
    perm = permutation_of(x)
    v = x if perm is None else x.owner.operands[0]
    perm = perm or [0, 1, 2, 3]
    ins = defining_op(v, "tensor.insert_slice")
    if ins is None or len(ins.operands) != 2:
        return None
    src, dest = ins.operands
    fill = fill_value(dest)
    if fill is None or not is_float_zero(fill) or not static_tensor_type(src):
        return None
    offsets = _ints_array(ins.attributes["static_offsets"])
    sizes = _ints_array(ins.attributes["static_sizes"])
    strides = _ints_array(ins.attributes["static_strides"])
    src_shape = list(ir.RankedTensorType(src.type).shape)
    if len(src_shape) != 4 or sizes != src_shape:
        return None
    off, st, shape = [offsets[p] for p in perm], [strides[p] for p in perm], [src_shape[p] for p in perm]
    # Batch and channels untouched; zeros between pixels in H and W only.
    if off[0] or off[3] or st[0] != 1 or st[3] != 1 or (st[1] == 1 and st[2] == 1):
        return None
    return src, perm, off, st, shape


def _ints_array(attr: ir.Attribute) -> list[int]:
    return [int(x) for x in ir.DenseI64ArrayAttr(attr)]


def _phase_taps(offset: int, stride: int, out: int, k: int) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """Along one dimension of a convolution over `src` dilated by `stride`
    (``x[offset + stride*i] = src[i]``, zeros elsewhere): per output phase
    ``p`` (rows ``o = stride*m + p``), (p, rows, [(filter row, input shift)])
    such that ``y[stride*m + p] = sum src[m + shift] * w[row]`` over the
    listed taps (a shift may take ``m + shift`` outside src: zeros there)."""
    phases = []
    for p in range(min(stride, out)):
        rows = (out - p + stride - 1) // stride
        r = (offset - p) % stride
        taps = [(kk, (p + kk - offset) // stride) for kk in range(r, k, stride)]
        phases.append((p, rows, taps))
    return phases


def _split_dilated(op: ir.Operation) -> bool:
    from mlir.dialects import linalg, tensor

    x, w, init = op.operands
    if not all(static_tensor_type(v) for v in (x, w, init)):
        return False
    if window_ints(op, "strides") != [1, 1] or window_ints(op, "dilations") != [1, 1]:
        return False
    found = _dilated_source(x)
    if found is None:
        return False
    src, perm, off, st, shape = found
    n, sh, sw, c = shape
    kh, kw, _, f = ir.RankedTensorType(w.type).shape
    _, oh, ow, _ = ir.RankedTensorType(init.type).shape
    elem = ir.RankedTensorType(init.type).element_type
    rows_h = _phase_taps(off[1], st[1], oh, kh)
    rows_w = _phase_taps(off[2], st[2], ow, kw)
    # One zero padding of src covers every shifted window.
    lo_h = max([0] + [-d for _, _, t in rows_h for _, d in t])
    hi_h = max([0] + [m - 1 + d - (sh - 1) for _, m, t in rows_h for _, d in t])
    lo_w = max([0] + [-d for _, _, t in rows_w for _, d in t])
    hi_w = max([0] + [m - 1 + d - (sw - 1) for _, m, t in rows_w for _, d in t])
    fill = fill_value(init)
    with ir.InsertionPoint(op), op.location:
        xs = src if perm == [0, 1, 2, 3] else transpose(src, perm)
        if lo_h or hi_h or lo_w or hi_w:
            zero = _arith_zero(elem)
            xs = _tensor_pad(xs, [0, lo_h, lo_w, 0], [0, hi_h, hi_w, 0], zero)
        acc = tensor.EmptyOp([n, oh, ow, f], elem).result
        for p, mh, taps_h in rows_h:
            for q, mw, taps_w in rows_w:
                phase = [n, mh, mw, f]
                if fill is not None:
                    y = linalg.fill(fill, outs=[tensor.EmptyOp(phase, elem).result])
                else:
                    y = _slice(init, [0, p, q, 0], phase, phase, [1, st[1], st[2], 1])
                for rh, dh in taps_h:
                    for rw, dw in taps_w:
                        xk = _slice(xs, [0, lo_h + dh, lo_w + dw, 0], [n, mh, mw, c], [n, mh, mw, c])
                        wk = _slice(w, [rh, rw, 0, 0], [1, 1, c, f], [1, 1, c, f])
                        y = linalg.conv_2d_nhwc_hwcf(xk, wk, outs=[y], strides=[1, 1], dilations=[1, 1])
                acc = _insert(y, acc, [0, p, q, 0], phase, [1, st[1], st[2], 1])
    op.results[0].replace_all_uses_with(acc)
    op.erase()
    return True


def split_dilated_input(fn: ir.Operation) -> int:
    """Rewrite every static ``linalg.conv_2d_nhwc_hwcf`` directly in `fn`'s
    body whose input has zeros inserted between its pixels (a transposed
    convolution, as torch-mlir writes it) as phases of 1x1 convolutions that
    skip the zeros (module docstring); returns how many were rewritten."""
    return _rewrite_all(fn, "linalg.conv_2d_nhwc_hwcf", _split_dilated)


def split_convolutions(fn: ir.Operation) -> int:
    """:func:`split_groups`, :func:`split_conv3d` and
    :func:`split_dilated_input` on `fn`; returns how many convolutions were
    rewritten."""
    return split_groups(fn) + split_conv3d(fn) + split_dilated_input(fn)
