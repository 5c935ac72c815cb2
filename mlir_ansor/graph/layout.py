"""Channel-last layout for imported convolutions: convert, then sink transposes.

Entry point: :func:`convert_layout`, run by :func:`.normalize.normalize` on
every function before transposes are folded.

Why: torch-mlir writes convolutions and poolings channel-first
(``linalg.conv_2d_nchw_fchw``, ``linalg.pooling_nchw_max``). Our CPU
sketches vectorize along the output's contiguous dimension, which for NCHW is
the image width, with one output channel per register tile (see
``CHANNEL_FIRST`` in ``rules/multi_level_tiling.py``); channel-last
(``conv_2d_nhwc_hwcf``) vectorizes along the output channels with several
rows of width per tile: a 3x3 conv 56x56x64->64 ran 18 ms NCHW and 7 ms NHWC
with the default schedules (1 core). TVM's answer is ConvertLayout plus
transpose sinking; this is ours, on Linalg.

What it does (local rewrites, swept over the function's body to a fixpoint):

1. A ``linalg.conv_2d_nchw_fchw`` whose filter is computed from constants
   only (an imported model's weights) becomes transpose(input, NCHW->NHWC),
   transpose(filter, FCHW->HWCF) (folded at compile time: constant-only ops
   are evaluated once), ``linalg.conv_2d_nhwc_hwcf`` (same strides and
   dilations) on an NHWC init (the original init's ``linalg.fill`` re-made in
   NHWC), and a transpose of the result back to NCHW. A filter that is a
   function argument would be transposed on every call, and a hand-written
   NCHW module is left to the channel-first sketch rules.
2. A ``linalg.pooling_nchw_max``/``_sum`` whose input is (or pads) a
   transposed value becomes its NHWC twin the same way (window unchanged).
3. Transposes sink until they meet and cancel:
   * an elementwise ``linalg.generic`` (parallel loops, identity output map,
     input maps made of loop dimensions and constant 0s, so the batch norm's
     ``(n, c, h, w) -> (c, 0, 0)`` broadcasts qualify) whose full-rank inputs
     are all transposes implying the same permutation is rebuilt in the
     permuted iteration space on the untransposed values, and its result
     transposed back (the residual add sinks too: both its operands are
     transposed);
   * transpose(transpose(x, p), q) becomes x when q undoes p (one transpose
     otherwise);
   * transpose(pad(transpose(x))) (the padding between a ReLU and the next
     convolution or pooling) becomes pad'(transpose(transpose(x))) with the
     padding amounts permuted, so the two transposes meet.
   * a ``tensor.concat`` whose operands are all transposes of one
     permutation (``torch.cat`` of two convolutions' outputs along the
     channels) becomes the transpose of the concatenation of the
     untransposed values, along the dimension the permutation maps the
     joined one to.
   Transposes left without uses are erased. What stays (a flatten's
   ``collapse_shape``, the global average pool's reduction) keeps one
   transpose; :mod:`.fold_transpose` folds those that feed reductions.

A function without channel-first ops is not changed.
"""

from __future__ import annotations

from mlir import ir

from mlir_ansor.ir.rewrite import (
    clone_remapped,
    concat,
    defining_op,
    depends_on_arguments,
    erase_unused,
    inverse_permutation,
    permutation_of,
    static_tensor_type,
    transpose,
    window_ints,
)

__all__ = ["convert_layout"]

_TO_LAST = [0, 2, 3, 1]  # NCHW -> NHWC (and FCHW -> HWCF is [2, 3, 1, 0])
_TO_FIRST = [0, 3, 1, 2]  # NHWC -> NCHW
_POOLS = {"linalg.pooling_nchw_max": "pooling_nhwc_max", "linalg.pooling_nchw_sum": "pooling_nhwc_sum"}


def fill_value(init: ir.Value) -> ir.Value | None:
    """The scalar of ``linalg.fill(scalar, tensor.empty)``, if `init` is one
    (an init that can be re-made in another shape at no cost)."""
    fill = defining_op(init, "linalg.fill")
    if fill is None or defining_op(fill.operands[1], "tensor.empty") is None:
        return None
    return fill.operands[0]


def _init_like(init: ir.Value, perm: list[int]) -> ir.Value:
    """`init` permuted by `perm`: a ``linalg.fill`` of a ``tensor.empty``
    is re-made in the new shape (no copy at run time), anything else is
    transposed."""
    from mlir.dialects import linalg, tensor

    fill = fill_value(init)
    if fill is not None:
        t = ir.RankedTensorType(init.type)
        empty = tensor.EmptyOp([t.shape[p] for p in perm], t.element_type)
        return linalg.fill(fill, outs=[empty.result])
    owner = None if isinstance(init, ir.BlockArgument) else init.owner
    if owner is not None and owner.name == "tensor.empty":
        t = ir.RankedTensorType(init.type)
        return tensor.EmptyOp([t.shape[p] for p in perm], t.element_type).result
    return transpose(init, perm)


def _convert_conv(op: ir.Operation) -> bool:
    from mlir.dialects import linalg

    x, w, init = op.operands
    if not all(static_tensor_type(v) for v in (x, w, init)) or depends_on_arguments(w, {}):
        return False
    with ir.InsertionPoint(op), op.location:
        xt = transpose(x, _TO_LAST)
        wt = transpose(w, [2, 3, 1, 0])
        conv = linalg.conv_2d_nhwc_hwcf(
            xt, wt, outs=[_init_like(init, _TO_LAST)],
            strides=window_ints(op, "strides"), dilations=window_ints(op, "dilations"),
        )
        back = transpose(conv, _TO_FIRST)
    op.results[0].replace_all_uses_with(back)
    return True


def _reads_transposed(v: ir.Value) -> bool:
    if permutation_of(v) is not None:
        return True
    return not isinstance(v, ir.BlockArgument) and v.owner.name == "tensor.pad" and permutation_of(v.owner.operands[0]) is not None


def _convert_pool(op: ir.Operation) -> bool:
    from mlir.dialects import linalg

    x, window, init = op.operands
    if not all(static_tensor_type(v) for v in (x, window, init)) or not _reads_transposed(x):
        return False
    with ir.InsertionPoint(op), op.location:
        xt = transpose(x, _TO_LAST)
        pool = getattr(linalg, _POOLS[op.name])(
            xt, window, outs=[_init_like(init, _TO_LAST)],
            strides=window_ints(op, "strides"), dilations=window_ints(op, "dilations"),
        )
        back = transpose(pool, _TO_FIRST)
    op.results[0].replace_all_uses_with(back)
    return True


def _cancel_transposes(op: ir.Operation) -> bool:
    """transpose(transpose(x, p), q) -> x, or one transpose of x."""
    p = permutation_of(op.operands[0])
    if p is None:
        return False
    q = list(ir.DenseI64ArrayAttr(op.attributes["permutation"]))
    x = op.operands[0].owner.operands[0]
    composed = [p[k] for k in q]  # result dim k is x's dim p[q[k]]
    if composed == list(range(len(q))):
        op.results[0].replace_all_uses_with(x)
    else:
        with ir.InsertionPoint(op), op.location:
            op.results[0].replace_all_uses_with(transpose(x, composed))
    return True


def static_pad(op: ir.Operation) -> tuple[list[int], list[int]] | None:
    """(low, high) of a ``tensor.pad`` with static amounts whose body only
    yields a value defined outside it; None otherwise."""
    if len(op.operands) != 1:  # dynamic low/high amounts are operands
        return None
    body = op.regions[0].blocks[0]
    ops = list(body.operations)
    if len(ops) != 1 or any(v in list(body.arguments) for v in ops[0].operands):
        return None
    return list(ir.DenseI64ArrayAttr(op.attributes["static_low"])), list(ir.DenseI64ArrayAttr(op.attributes["static_high"]))


def _pad(src: ir.Value, like: ir.Operation, low: list[int], high: list[int]) -> ir.Value:
    """A ``tensor.pad`` of `src` by (low, high), yielding what `like` yields."""
    t = ir.RankedTensorType(src.type)
    shape = [s + lo + hi for s, lo, hi in zip(t.shape, low, high)]
    attrs = {like.attributes[i].name: like.attributes[i].attr for i in range(len(like.attributes))}
    attrs["static_low"] = ir.DenseI64ArrayAttr.get(low)
    attrs["static_high"] = ir.DenseI64ArrayAttr.get(high)
    new = ir.Operation.create(
        "tensor.pad", results=[ir.RankedTensorType.get(shape, t.element_type)], operands=[src], attributes=attrs, regions=1
    )
    index = ir.IndexType.get()
    block = ir.Block.create_at_start(new.regions[0], [index] * len(shape))
    old = like.regions[0].blocks[0]
    mapping = dict(zip(old.arguments, block.arguments))
    with ir.InsertionPoint(block):
        for inner in old.operations:
            clone_remapped(inner.operation, mapping)
    return new.results[0]


def _hoist_over_pad(op: ir.Operation) -> bool:
    """transpose(pad(transpose(y)), q) -> pad'(transpose(transpose(y), q))."""
    src = op.operands[0]
    if isinstance(src, ir.BlockArgument) or src.owner.name != "tensor.pad":
        return False
    pad = src.owner
    amounts = static_pad(pad)
    if amounts is None or permutation_of(pad.operands[0]) is None:
        return False
    q = list(ir.DenseI64ArrayAttr(op.attributes["permutation"]))
    low, high = amounts
    with ir.InsertionPoint(op), op.location:
        inner = transpose(pad.operands[0], q)
        op.results[0].replace_all_uses_with(_pad(inner, pad, [low[k] for k in q], [high[k] for k in q]))
    return True


def _sink_through_concat(op: ir.Operation) -> bool:
    """concat(transpose(x_i, p), dim d) -> transpose(concat(x_i, dim p[d]), p)."""
    perms = [permutation_of(v) for v in op.operands]
    if perms[0] is None or any(q != perms[0] for q in perms):
        return False
    p = perms[0]
    xs = [v.owner.operands[0] for v in op.operands]
    if not all(ir.RankedTensorType(x.type).has_static_shape for x in xs):
        return False
    with ir.InsertionPoint(op), op.location:
        joined = concat(xs, p[ir.IntegerAttr(op.attributes["dim"]).value])
        op.results[0].replace_all_uses_with(transpose(joined, p))
    return True


def _map_dims(m: ir.AffineMap) -> list[int | None] | None:
    """The loop dimension of each result of `m` (None for the constant 0);
    None if a result is anything else or a dimension repeats."""
    dims: list[int | None] = []
    for e in m.results:
        if isinstance(e, ir.AffineDimExpr):
            if e.position in dims:
                return None
            dims.append(e.position)
        elif isinstance(e, ir.AffineConstantExpr) and e.value == 0:
            dims.append(None)
        else:
            return None
    return dims


def _sink_through_generic(op: ir.Operation) -> bool:
    """Rebuild an elementwise generic whose full-rank inputs are all
    transposes (with one implied permutation) on the untransposed values,
    in the permuted iteration space; its result is transposed back."""
    sizes = list(ir.DenseI32ArrayAttr(op.attributes["operandSegmentSizes"]))
    n_ins, n_outs = sizes
    if n_outs != 1 or len(op.results) != 1:
        return False
    if any(str(t) != "#linalg.iterator_type<parallel>" for t in ir.ArrayAttr(op.attributes["iterator_types"])):
        return False
    maps = [ir.AffineMapAttr(a).value for a in ir.ArrayAttr(op.attributes["indexing_maps"])]
    n = maps[-1].n_dims
    if maps[-1] != ir.AffineMap.get_identity(n) or any(m.n_symbols for m in maps):
        return False
    out_t = static_tensor_type(op.results[0])
    if out_t is None:
        return False
    body = op.regions[0].blocks[0]
    uses_index = False

    def find_index(inner: ir.Operation) -> ir.WalkResult:
        nonlocal uses_index
        if inner.name == "linalg.index":
            uses_index = True
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    for inner in body.operations:
        inner.operation.walk(find_index)
    if uses_index:
        return False
    operands = list(op.operands)
    dims = [_map_dims(m) for m in maps[:n_ins]]
    if any(d is None for d in dims):
        return False
    # Old loop d_k is new loop e_{p[k]}. A full-rank input read through the
    # permutation m from transpose(x, q) reads x in the new space through the
    # identity when p[m[r]] = q[r], for every r.
    perm: list[int] | None = None
    full = [i for i in range(n_ins) if len(dims[i]) == n and None not in dims[i]]
    if not full:
        return False
    for i in full:
        q = permutation_of(operands[i])
        if q is None:
            return False
        p = [0] * n
        for r, k in enumerate(dims[i]):
            p[k] = q[r]
        if perm is not None and p != perm:
            return False
        perm = p
    if perm == list(range(n)):
        return False
    assert perm is not None
    inv = inverse_permutation(perm)
    new_operands, new_maps = [], []
    for i in range(n_ins):
        if i in full:
            x = operands[i].owner.operands[0]
            new_operands.append(x)
            new_maps.append(ir.AffineMap.get_identity(n))
        else:
            exprs = [ir.AffineDimExpr.get(perm[k]) if k is not None else ir.AffineConstantExpr.get(0) for k in dims[i]]
            new_operands.append(operands[i])
            new_maps.append(ir.AffineMap.get(n, 0, exprs))
    new_maps.append(ir.AffineMap.get_identity(n))
    out_arg = body.arguments[n_ins]
    out_used = any(True for _ in out_arg.uses)
    with ir.InsertionPoint(op), op.location:
        init = operands[n_ins]
        if out_used:
            new_init = transpose(init, inv)
        else:
            from mlir.dialects import tensor

            new_init = tensor.EmptyOp([out_t.shape[k] for k in inv], out_t.element_type).result
        attrs = {op.attributes[k].name: op.attributes[k].attr for k in range(len(op.attributes))}
        attrs["indexing_maps"] = ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in new_maps])
        new = ir.Operation.create(
            "linalg.generic", results=[new_init.type], operands=new_operands + [new_init], attributes=attrs, regions=1
        )
        block = ir.Block.create_at_start(new.regions[0], [a.type for a in body.arguments], [a.location for a in body.arguments])
        mapping = dict(zip(body.arguments, block.arguments))
        with ir.InsertionPoint(block):
            for inner in body.operations:
                clone_remapped(inner.operation, mapping)
        # new dim j is old dim inv[j]; old result dim k is new dim perm[k]
        back = transpose(new.results[0], perm)
    op.results[0].replace_all_uses_with(back)
    return True


_CLEANED = ("linalg.transpose", "linalg.generic", "linalg.fill", "tensor.empty", "tensor.pad", "tensor.concat", "linalg.conv_2d_nchw_fchw", *_POOLS)


def convert_layout(fn: ir.Operation) -> int:
    """Convert the channel-first convolutions and poolings directly in
    `fn`'s body (on tensors) to channel-last and sink the transposes this
    makes until they cancel (module docstring); returns how many rewrites
    were made (0: `fn` is unchanged)."""
    body = fn.regions[0].blocks[0]
    if not any(o.operation.name == "linalg.conv_2d_nchw_fchw" for o in body.operations):
        return 0
    total = 0
    with fn.context:
        while True:
            changed = 0
            # Rewritten ops are left in place, dead, until the sweep ends:
            # the snapshot below never meets an erased op.
            for opview in list(body.operations):
                op = opview.operation
                name = op.name
                if not any(True for r in op.results for _ in r.uses):
                    continue
                if name == "linalg.conv_2d_nchw_fchw":
                    done = _convert_conv(op)
                elif name in _POOLS:
                    done = _convert_pool(op)
                elif name == "linalg.transpose":
                    done = _cancel_transposes(op) or _hoist_over_pad(op)
                elif name == "linalg.generic":
                    done = _sink_through_generic(op)
                elif name == "tensor.concat":
                    done = _sink_through_concat(op)
                else:
                    done = False
                changed += done
            erase_unused(body, _CLEANED)
            total += changed
            if not changed:
                return total
