"""Element types narrower than the arithmetic done on them (bf16, f16, and
i8 with i32 accumulation).

Entry points:

* :func:`accumulate_wide` (run by :func:`.normalize.normalize`): a
  contraction, convolution or sum whose result is bf16 or f16 accumulates in
  f32, and one elementwise ``arith.truncf`` writes the narrow result. Why:
  bf16 keeps 8 significant bits, so a bf16 accumulator over K = 512 terms
  loses most of them (what torch and oneDNN do: f32 accumulation, one
  rounding at the end). The truncation is an elementwise consumer of the
  anchor, so the task partition fuses it into the same task. A zero or
  constant ``linalg.fill`` init becomes the same fill in f32; any other init
  is added to the f32 sum in that same elementwise op (before the rounding).
* :func:`lower_quantized_ops` (also run by normalization):
  ``linalg.quantized_matmul``, ``linalg.quantized_batch_matmul`` and the
  ``_q`` convolutions become a plain int8 contraction (tensorized like any),
  the sums of A and of B, and one elementwise op that takes the zero
  points' terms off;
  it reads the zero points from outside: tasks take tensors, and a scalar
  operand is no tensor (a constant zero point is cloned into the task like
  any constant).
* :func:`fold_widening` (run by normalization, before the transposes are
  folded): an elementwise generic that only widens (``arith.extf``
  bf16/f16 -> f32, ``arith.extsi``/``extui`` i8 -> i32) an input of a
  contraction is folded into it: the contraction reads the narrow tensor
  and widens in its body (a named op with mixed element types,
  ``linalg.matmul ins(bf16, bf16) outs(f32)``, or a generic whose body
  starts with the extension). torch-mlir writes every bf16 ``nn.Linear``
  as such a widening and an f32 matmul; folded, the task is a bf16 matmul
  (the ``cpu-dot-product`` rule's) and reads half the bytes.
* :func:`compute_wide` (run by normalization, last): the body of a generic
  computing on bf16/f16 values (torch-mlir's GELU, residual adds, scalings)
  computes in f32 and rounds once per output, as torch's CPU kernels do.
  Why: ``math.erf`` on bf16 has no lowering (`passes.math_approx` expands
  f32 only, and nothing else converts it), so the JIT failed on BERT's GELU
  task; and the LLVM back end handles bf16 vector arithmetic poorly.
* :func:`widen_payload`: the copy of a task module a reference is computed
  with (`measure.jobs.prepare_reference`): every bf16 and f16 replaced by
  f32, and the ``arith.extf``/``arith.truncf`` that this makes no-ops
  removed, so the reference rounds less than any candidate. Narrow
  constants it cannot rewrite (``dense_resource`` blobs, torch-mlir's
  weights) stay narrow and are extended by a generic after them.
"""

from __future__ import annotations

from mlir import ir

from mlir_ansor.errors import UnsupportedError
from mlir_ansor.ir.dtypes import ACCUMULATION_DTYPE
from mlir_ansor.ir.program import location_str
from mlir_ansor.ir.rewrite import defining_op

__all__ = [
    "accumulate_wide",
    "compute_wide",
    "fold_widening",
    "is_narrow_float",
    "lower_quantized_ops",
    "narrow_f64_islands",
    "widen_payload",
    "widened_dtype",
]

_QUANTIZED = {"linalg.quantized_matmul": 2, "linalg.quantized_batch_matmul": 3}
_QUANTIZED_CONVS = {"linalg.conv_2d_nhwc_hwcf_q": "nhwc", "linalg.conv_2d_nchw_fchw_q": "nchw"}
"""Quantized named ops -> their number of parallel loops (then one reduction)."""


def is_narrow_float(t: ir.Type) -> bool:
    """Whether `t` (a scalar, tensor or memref type) has bf16 or f16 elements."""
    if isinstance(t, (ir.RankedTensorType, ir.MemRefType, ir.UnrankedTensorType)):
        t = ir.ShapedType(t).element_type
    return isinstance(t, (ir.BF16Type, ir.F16Type))


def widened_dtype(dtype: str) -> str:
    """The element type a reference computes `dtype` in ("bf16" -> "f32")."""
    return ACCUMULATION_DTYPE.get(dtype, dtype)


def _wide(t: ir.Type) -> ir.Type:
    """`t` with f32 in place of a narrow float element type."""
    f32 = ir.F32Type.get()
    if isinstance(t, ir.RankedTensorType):
        rt = ir.RankedTensorType(t)
        return ir.RankedTensorType.get(list(rt.shape), f32, rt.encoding)
    if isinstance(t, ir.MemRefType):
        mt = ir.MemRefType(t)
        return ir.MemRefType.get(list(mt.shape), f32, mt.layout, mt.memory_space)
    if isinstance(t, ir.UnrankedTensorType):
        return ir.UnrankedTensorType.get(f32)
    return f32


def _wide_attr(attr: ir.Attribute, new_type: ir.Type) -> ir.Attribute:
    """An ``arith.constant`` value of narrow floats as the same values of `new_type`."""
    if isinstance(attr, ir.FloatAttr):
        return ir.FloatAttr.get(new_type, ir.FloatAttr(attr).value)
    if isinstance(attr, ir.DenseFPElementsAttr):
        dense = ir.DenseFPElementsAttr(attr)
        if dense.is_splat:
            value = ir.FloatAttr(dense.get_splat_value()).value
            return ir.DenseElementsAttr.get_splat(new_type, ir.FloatAttr.get(ir.F32Type.get(), value))
        import numpy as np

        values = np.array([float(x) for x in dense], dtype=np.float32)
        return ir.DenseElementsAttr.get(values.reshape(ir.ShapedType(new_type).shape), type=new_type)
    raise UnsupportedError(f"cannot widen the constant {attr} to f32")


def _widen_in_place(root: ir.Operation, *, include_root: bool = True, keep: frozenset = frozenset(),
                    retype=is_narrow_float) -> None:
    """Give every narrow-float value under `root` (block arguments of its
    regions, results of its nested ops, and `root`'s own results when
    `include_root`) the f32 type, constants their f32 values, and remove the
    ``arith.extf``/``arith.truncf`` this leaves from f32 to f32. The ops of
    `keep` (and what they hold) are left as they are. `retype`: which types
    count (f64 ones for :func:`narrow_f64_islands`)."""
    noop: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op in keep:
            return ir.WalkResult.SKIP
        for region in op.regions:
            for block in region.blocks:
                for arg in block.arguments:
                    if retype(arg.type):
                        arg.set_type(_wide(arg.type))
        if op == root and not include_root:
            return ir.WalkResult.ADVANCE
        for r in op.results:
            if retype(r.type):
                r.set_type(_wide(r.type))
                if op.name == "arith.constant":
                    op.attributes["value"] = _wide_attr(op.attributes["value"], r.type)
        if op.name in ("arith.extf", "arith.truncf") and op.operands[0].type == op.results[0].type:
            noop.append(op)
        elif op.name == "arith.bitcast" and any(
            isinstance(t, ir.F32Type) for t in (op.operands[0].type, op.results[0].type)
        ):
            raise UnsupportedError(f"{location_str(op)}: arith.bitcast of a bf16 or f16 value cannot be widened")
        return ir.WalkResult.ADVANCE

    root.walk(visit, ir.WalkOrder.PRE_ORDER)
    for op in noop:
        op.results[0].replace_all_uses_with(op.operands[0])
        op.erase()


def _extend_opaque_constants(module: ir.Module) -> frozenset:
    """Put an elementwise ``arith.extf`` generic after every narrow tensor
    constant of `module` whose values this module cannot rewrite (a
    ``dense_resource`` blob: torch-mlir's weights), its users reading the f32
    result; returns those constants and generics (to be kept as they are)."""
    from mlir.dialects import arith, linalg, tensor

    kept: list[ir.Operation] = []
    constants: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "arith.constant" and isinstance(op.results[0].type, ir.RankedTensorType):
            if is_narrow_float(op.results[0].type) and not isinstance(op.attributes["value"], ir.DenseFPElementsAttr):
                constants.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    f32 = ir.F32Type.get()
    parallel = ir.Attribute.parse("#linalg.iterator_type<parallel>")
    for op in constants:
        narrow = ir.RankedTensorType(op.results[0].type)
        with op.location, ir.InsertionPoint.after(op):
            empty = tensor.EmptyOp(list(narrow.shape), f32)
            generic = linalg.GenericOp(
                [_wide(narrow)], [op.results[0]], [empty.result],
                ir.ArrayAttr.get([_identity_map(narrow.rank)] * 2),
                ir.ArrayAttr.get([parallel] * narrow.rank),
            )
            block = generic.regions[0].blocks.append(narrow.element_type, f32)
            with ir.InsertionPoint(block):
                linalg.YieldOp([arith.extf(f32, block.arguments[0])])
        op.results[0].replace_all_uses_except(generic.results[0], generic.operation)
        kept += [op, generic.operation]
    return frozenset(kept)


def widen_payload(text: str) -> str:
    """`text` (a task module) computed in f32 wherever it computes in bf16 or
    f16: arguments, results, intermediate tensors, bodies and constants,
    with the extensions and truncations between them removed. Returns
    `text` itself when it has no such type. Raises :class:`UnsupportedError`
    for what cannot be widened (a bitcast of a narrow float)."""
    if "bf16" not in text and "f16" not in text:
        return text
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        _widen_in_place(module.operation, keep=_extend_opaque_constants(module))
        for opview in module.body.operations:
            fn = opview.operation
            if fn.name != "func.func" or not fn.regions[0].blocks:
                continue
            block = fn.regions[0].blocks[0]
            ret = [o.operation for o in block.operations][-1]
            ftype = ir.FunctionType.get([a.type for a in block.arguments], [v.type for v in ret.operands])
            fn.attributes["function_type"] = ir.TypeAttr.get(ftype)
        module.operation.verify()
        return str(module)


# --------------------------------------------------------------------------
# f32 accumulation for narrow-float reductions.


def _out_arg_accumulates(op: ir.Operation) -> bool:
    """Whether `op`'s body yields ``arith.addf`` of its (only) output block
    argument and something else: a sum into its output."""
    if not op.regions or not op.regions[0].blocks:
        return False
    block = op.regions[0].blocks[0]
    ops = [o.operation for o in block.operations]
    if not ops or ops[-1].name != "linalg.yield" or len(ops[-1].operands) != 1:
        return False
    out_arg = block.arguments[len(block.arguments) - 1]
    add = defining_op(ops[-1].operands[0], "arith.addf")
    if add is None:
        return False
    return out_arg in list(add.operands) and not all(x == out_arg for x in add.operands)


def _is_narrow_sum(op: ir.Operation) -> bool:
    """A Linalg op on tensors with one bf16/f16 result that sums into it
    (contraction, convolution, sum reduction or sum pooling)."""
    if not op.name.startswith("linalg.") or op.name in ("linalg.fill", "linalg.reduce", "linalg.map"):
        return False
    if len(op.results) != 1 or not isinstance(op.results[0].type, ir.RankedTensorType):
        return False
    if not is_narrow_float(op.results[0].type) or "operandSegmentSizes" not in op.attributes:
        return False
    sizes = list(ir.DenseI32ArrayAttr(op.attributes["operandSegmentSizes"]))
    if sizes[1] != 1:
        return False
    if op.name == "linalg.generic":
        iterators = [str(a) for a in ir.ArrayAttr(op.attributes["iterator_types"])]
        if not any("reduction" in s for s in iterators):
            return False
    return _out_arg_accumulates(op)


def _constant_fill_value(init: ir.Value) -> ir.Attribute | None:
    """The constant a ``linalg.fill`` of `init` writes, if `init` is one."""
    fill = defining_op(init, "linalg.fill")
    scalar = defining_op(fill.operands[0], "arith.constant") if fill is not None else None
    return scalar.attributes["value"] if scalar is not None else None


def _identity_map(rank: int) -> ir.AffineMapAttr:
    return ir.AffineMapAttr.get(ir.AffineMap.get_identity(rank))


def _epilogue(acc: ir.Value, init: ir.Value | None, out_type: ir.RankedTensorType) -> ir.Value:
    """``linalg.generic`` rounding the f32 `acc` to `out_type` (adding the
    narrow `init` first when given), at the current insertion point."""
    from mlir.dialects import arith, linalg, tensor

    rank = out_type.rank
    ins = [acc] + ([init] if init is not None else [])
    empty = tensor.EmptyOp(list(out_type.shape), out_type.element_type).result
    parallel = ir.Attribute.parse("#linalg.iterator_type<parallel>")
    generic = linalg.GenericOp(
        [out_type], ins, [empty],
        ir.ArrayAttr.get([_identity_map(rank)] * (len(ins) + 1)),
        ir.ArrayAttr.get([parallel] * rank),
    )
    elem = out_type.element_type
    block = generic.regions[0].blocks.append(*([ir.F32Type.get()] + [elem] * (len(ins))))
    with ir.InsertionPoint(block):
        v = block.arguments[0]
        if init is not None:
            v = arith.addf(arith.extf(ir.F32Type.get(), block.arguments[1]), v)
        linalg.YieldOp([arith.truncf(elem, v)])
    return generic.results[0]


def _accumulate_wide_of(op: ir.Operation) -> None:
    from mlir.dialects import arith, linalg, tensor

    out_type = ir.RankedTensorType(op.results[0].type)
    f32 = ir.F32Type.get()
    wide_type = ir.RankedTensorType.get(list(out_type.shape), f32)
    operands = list(op.operands)
    init = operands[-1]
    fill_value = _constant_fill_value(init)
    with op.location, ir.InsertionPoint(op):
        if fill_value is not None:
            value = ir.FloatAttr.get(f32, ir.FloatAttr(fill_value).value)
            extra = None
        else:
            value = ir.FloatAttr.get(f32, 0.0)
            extra = init
        empty = tensor.EmptyOp(list(out_type.shape), f32).result
        start = linalg.fill(arith.constant(f32, value), outs=[empty])
        attrs = {op.attributes[i].name: op.attributes[i].attr for i in range(len(op.attributes))}
        new = ir.Operation.create(
            op.name, results=[wide_type], operands=operands[:-1] + [start], attributes=attrs, regions=1
        )
        if op.name == "linalg.generic":
            op.regions[0].blocks[0].append_to(new.regions[0])
            _widen_body(new)
        else:
            linalg.fill_builtin_region(new)
    with op.location, ir.InsertionPoint.after(new):
        result = _epilogue(new.results[0], extra, out_type)
    op.results[0].replace_all_uses_with(result)
    op.erase()


def _widen_body(generic: ir.Operation) -> None:
    """Make the body of `generic` (whose output is now f32) compute in f32:
    its narrow inputs extended at the top, every narrow value widened."""
    from mlir.dialects import arith

    block = generic.regions[0].blocks[0]
    args = list(block.arguments)
    f32 = ir.F32Type.get()
    first = [o.operation for o in block.operations][0]
    out_arg = args[-1]
    out_arg.set_type(f32)
    with ir.InsertionPoint(first), generic.location:
        for arg in args[:-1]:
            if is_narrow_float(arg.type):
                ext = arith.extf(f32, arg)
                arg.replace_all_uses_except(ext, ext.owner.operation)
    for o in [o.operation for o in block.operations]:
        _widen_in_place(o)


def accumulate_wide(fn: ir.Operation) -> int:
    """Rewrite every sum into a bf16/f16 result directly in `fn`'s body
    (see the module docstring) to accumulate in f32 and round once after it;
    returns how many ops were rewritten."""
    count = 0
    for block in fn.regions[0].blocks:
        for opview in list(block.operations):
            op = opview.operation
            if _is_narrow_sum(op):
                _accumulate_wide_of(op)
                count += 1
    return count


# --------------------------------------------------------------------------
# Quantized matmuls.


def _cast_int(value: ir.Value, to: ir.Type) -> ir.Value:
    """`value` (an integer scalar) as `to`, sign-extended or truncated (the
    quantized ops' ``cast_signed``)."""
    from mlir.dialects import arith

    width = ir.IntegerType(value.type).width
    target = ir.IntegerType(to).width
    if width < target:
        return arith.extsi(to, value)
    if width > target:
        return arith.trunci(to, value)
    return value


def _is_zero(value: ir.Value) -> bool:
    """Whether `value` is the integer constant 0 (``arith.constant``)."""
    owner = defining_op(value, "arith.constant")
    if owner is None:
        return False
    attr = owner.attributes["value"]
    return isinstance(attr, ir.IntegerAttr) and ir.IntegerAttr(attr).value == 0


def _affine(dims: int, rows: list) -> ir.ArrayAttr:
    return ir.ArrayAttr.get([ir.AffineMapAttr.get(ir.AffineMap.get(dims, 0, r)) for r in rows])


def _iterators(kinds: str) -> ir.ArrayAttr:
    """"ppr" -> [parallel, parallel, reduction]."""
    names = {"p": "parallel", "r": "reduction"}
    return ir.ArrayAttr.get([ir.Attribute.parse(f"#linalg.iterator_type<{names[k]}>") for k in kinds])


def _sums(x: ir.Value, kept: int, summed: int, x_map: list, shape: list[int], acc: ir.Type,
          window: tuple[int, int] | None = None) -> ir.Value:
    """A reduction of `x` (widened to `acc`) over loops `kept`..`kept +
    summed`, into a zero-filled tensor of `shape` indexed by the first
    `kept` loops; `x_map` reads `x` in those loops. `window`: the extents of
    the first two summed loops, which `x_map` reads only in sums (a
    convolution's window): a window operand gives them, as pooling ops do."""
    from mlir.dialects import arith, linalg, tensor

    dims = [ir.AffineDimExpr.get(i) for i in range(kept + summed)]
    zero = arith.constant(acc, ir.IntegerAttr.get(acc, 0))
    init = linalg.fill(zero, outs=[tensor.EmptyOp(shape, acc).result])
    ins, maps = [x], [x_map]
    if window is not None:
        ins.append(tensor.EmptyOp(list(window), ir.ShapedType(x.type).element_type).result)
        maps.append(dims[kept:kept + 2])
    g = linalg.GenericOp([ir.RankedTensorType.get(shape, acc)], ins, [init], _affine(kept + summed, [*maps, dims[:kept]]),
                         _iterators("p" * kept + "r" * summed))
    elem = ir.ShapedType(x.type).element_type
    blk = g.regions[0].blocks.append(*([elem] * len(ins)), acc)
    with ir.InsertionPoint(blk):
        linalg.YieldOp([arith.addi(blk.arguments[len(ins)], _cast_int(blk.arguments[0], acc))])
    return g.results[0]


def _minus_zero_points(op: ir.Operation, product: ir.Value, a_zp: ir.Value, b_zp: ir.Value, reduction: int,
                       a_sums, b_sums) -> None:
    """Replace `op` by `product` - zb * A's sums - za * B's sums + K za zb,
    one elementwise op over the output. `a_sums()` / `b_sums()` build the
    sums (only where the other zero point is not the constant 0) and give
    (the tensor, its map in the output's loops)."""
    from mlir.dialects import arith, linalg, tensor

    out_t = ir.RankedTensorType(product.type)
    acc, rank = out_t.element_type, out_t.rank
    terms = []  # (zero point, sums, map)
    if not _is_zero(b_zp):
        terms.append((b_zp, *a_sums()))
    if not _is_zero(a_zp):
        terms.append((a_zp, *b_sums()))
    if not terms:
        op.results[0].replace_all_uses_with(product)
        op.erase()
        return
    e = [ir.AffineDimExpr.get(i) for i in range(rank)]
    out = linalg.GenericOp(
        [out_t], [product] + [t[1] for t in terms], [tensor.EmptyOp(list(out_t.shape), acc).result],
        _affine(rank, [e] + [t[2] for t in terms] + [e]), _iterators("p" * rank),
    )
    blk = out.regions[0].blocks.append(*([acc] * (len(terms) + 2)))
    with ir.InsertionPoint(blk):
        val = blk.arguments[0]
        for i, (zp, _, _) in enumerate(terms):
            val = arith.subi(val, arith.muli(_cast_int(zp, acc), blk.arguments[1 + i]))
        if len(terms) == 2:
            zz = arith.muli(_cast_int(a_zp, acc), _cast_int(b_zp, acc))
            val = arith.addi(val, arith.muli(zz, arith.constant(acc, ir.IntegerAttr.get(acc, reduction))))
        linalg.YieldOp([val])
    op.results[0].replace_all_uses_with(out.results[0])
    op.erase()


def _lower_quantized_of(op: ir.Operation) -> bool:
    """One quantized (batch) matmul or convolution as a plain int8
    contraction and its zero-point terms:

        sum_k (a - za)(b - zb) = sum_k a b - zb sum_k a - za sum_k b + K za zb

    The contraction (a generic, or the convolution without ``_q``) is what
    the dot-product instructions compute (its body only widens: the
    ``cpu-dot-product`` rule tensorizes it); the sums of A (rows of a
    matmul, windows of a convolution) and of B (columns, filters) are small
    reductions of their own (a constant B's fold at compile time), left out
    where the other zero point is the constant 0; the rest is one
    elementwise op after the contraction, fused into its task. Exact: the
    same sum in i32, reordered (modulo 2^32 as the original)."""
    from mlir.dialects import arith, linalg

    a, b, a_zp, b_zp, c = list(op.operands)
    acc = ir.RankedTensorType(c.type).element_type
    if not isinstance(acc, ir.IntegerType) or not all(
        isinstance(ir.ShapedType(v.type).element_type, ir.IntegerType) for v in (a, b)
    ):
        return False
    a_t, b_t, c_t = (ir.RankedTensorType(v.type) for v in (a, b, c))
    if not (a_t.has_static_shape and b_t.has_static_shape and c_t.has_static_shape):
        return False
    if op.name in _QUANTIZED_CONVS:
        return _lower_quantized_conv(op, _QUANTIZED_CONVS[op.name])
    n_par = _QUANTIZED[op.name]
    d = [ir.AffineDimExpr.get(k) for k in range(n_par + 1)]
    *batch, m_, n_, k = d
    lead = [int(x) for x in c_t.shape[:-2]]
    rows, cols = int(c_t.shape[-2]), int(c_t.shape[-1])
    with op.location, ir.InsertionPoint(op):
        g = linalg.GenericOp([c.type], [a, b], [c], _affine(n_par + 1, [[*batch, m_, k], [*batch, k, n_], [*batch, m_, n_]]),
                             _iterators("p" * n_par + "r"))
        elems = [ir.ShapedType(v.type).element_type for v in (a, b)]
        block = g.regions[0].blocks.append(elems[0], elems[1], acc)
        with ir.InsertionPoint(block):
            x, y = (_cast_int(block.arguments[i], acc) for i in (0, 1))
            linalg.YieldOp([arith.addi(block.arguments[2], arith.muli(x, y))])
        e = [ir.AffineDimExpr.get(i) for i in range(n_par)]  # the output's loops
        sd = [ir.AffineDimExpr.get(i) for i in range(n_par)]  # batch..., m or n, k
        _minus_zero_points(
            op, g.results[0], a_zp, b_zp, int(a_t.shape[-1]),
            lambda: (_sums(a, n_par - 1, 1, sd, lead + [rows], acc), e[:-1]),
            lambda: (_sums(b, n_par - 1, 1, [*sd[:-2], sd[-1], sd[-2]], lead + [cols], acc), [*e[:-2], e[-1]]),
        )
    return True


def _lower_quantized_conv(op: ir.Operation, layout: str) -> bool:
    """A ``conv_2d_nhwc_hwcf_q`` / ``conv_2d_nchw_fchw_q``: the same
    convolution without the zero points, the window sums of the input
    (loops n, oh, ow, kh, kw, c) and the sums of each filter (f, kh, kw, c)."""
    from mlir.dialects import linalg

    x, w, x_zp, w_zp, c = list(op.operands)
    strides = [int(v) for v in ir.DenseIntElementsAttr(op.attributes["strides"])] if "strides" in op.attributes else [1, 1]
    dilations = [int(v) for v in ir.DenseIntElementsAttr(op.attributes["dilations"])] if "dilations" in op.attributes else [1, 1]
    ws, cs = list(ir.RankedTensorType(w.type).shape), list(ir.RankedTensorType(c.type).shape)
    if layout == "nhwc":
        kh, kw, ch, _ = ws
        conv, (n, oh, ow, f) = linalg.conv_2d_nhwc_hwcf, cs
    else:
        _, ch, kh, kw = ws
        conv, (n, f, oh, ow) = linalg.conv_2d_nchw_fchw, cs
    d = [ir.AffineDimExpr.get(i) for i in range(6)]  # n, oh, ow, kh, kw, c
    row = d[1] * strides[0] + d[3] * dilations[0]
    col = d[2] * strides[1] + d[4] * dilations[1]
    x_map = [d[0], row, col, d[5]] if layout == "nhwc" else [d[0], d[5], row, col]
    g = [ir.AffineDimExpr.get(i) for i in range(4)]  # f, kh, kw, c
    w_map = [g[1], g[2], g[3], g[0]] if layout == "nhwc" else [g[0], g[3], g[1], g[2]]
    e = [ir.AffineDimExpr.get(i) for i in range(4)]  # the output's loops
    s_map, f_map = ([e[0], e[1], e[2]], [e[3]]) if layout == "nhwc" else ([e[0], e[2], e[3]], [e[1]])
    with op.location, ir.InsertionPoint(op):
        product = conv(x, w, outs=[c], strides=strides, dilations=dilations)
        _minus_zero_points(
            op, product, x_zp, w_zp, kh * kw * ch,
            lambda: (_sums(x, 3, 3, x_map, [n, oh, ow], ir.RankedTensorType(c.type).element_type, window=(kh, kw)), s_map),
            lambda: (_sums(w, 1, 3, w_map, [f], ir.RankedTensorType(c.type).element_type), f_map),
        )
    return True


def lower_quantized_ops(fn: ir.Operation) -> int:
    """Rewrite every ``linalg.quantized_matmul``,
    ``linalg.quantized_batch_matmul``, ``linalg.conv_2d_nhwc_hwcf_q`` and
    ``linalg.conv_2d_nchw_fchw_q`` on tensors directly in `fn`'s body as an
    int8 contraction and its zero points' terms (:func:`_lower_quantized_of`);
    returns how many ops were rewritten."""
    count = 0
    for block in fn.regions[0].blocks:
        for opview in list(block.operations):
            op = opview.operation
            if (op.name in _QUANTIZED or op.name in _QUANTIZED_CONVS) and op.results and _lower_quantized_of(op):
                count += 1
    return count


# --------------------------------------------------------------------------
# Widening folded into the contractions that read it.

_WIDENINGS = frozenset({"arith.extf", "arith.extsi", "arith.extui"})
"""The widening ops folded into contractions (bf16/f16 -> f32, i8 -> i32: `_is_widening`)."""

_NAMED_CONTRACTIONS = frozenset({
    "linalg.matmul", "linalg.batch_matmul", "linalg.batch_reduce_matmul",
    "linalg.matmul_transpose_a", "linalg.matmul_transpose_b",
    "linalg.batch_matmul_transpose_a", "linalg.batch_matmul_transpose_b",
    "linalg.matvec", "linalg.vecmat", "linalg.batch_matvec", "linalg.dot", "linalg.contract",
})
"""Named contractions whose builtin body widens mixed-type operands itself
(``arith.extf``, or ``arith.extsi``/``extui`` as their ``cast`` attribute says)."""

_UNSIGNED = "#linalg.type_fn<cast_unsigned>"


def _is_widening(ext: str, narrow: ir.Type, wide: ir.Type) -> bool:
    """Whether ``ext`` from `narrow` to `wide` is one of :data:`_WIDENINGS`."""
    if ext == "arith.extf":
        return isinstance(narrow, (ir.BF16Type, ir.F16Type)) and isinstance(wide, ir.F32Type)
    return (
        isinstance(narrow, ir.IntegerType) and isinstance(wide, ir.IntegerType)
        and ir.IntegerType(narrow).width == 8 and ir.IntegerType(wide).width == 32
    )


def _only_widens(op: ir.Operation) -> tuple[ir.Value, str] | None:
    """(the narrow input, the widening op's name) when `op` is a
    ``linalg.generic`` on tensors that only widens its one input
    elementwise (identity maps, parallel loops, a body of one widening op
    of :data:`_WIDENINGS` and the yield); None for any other op."""
    if op.name != "linalg.generic" or len(op.operands) != 2 or len(op.results) != 1:
        return None
    if any(str(t) != "#linalg.iterator_type<parallel>" for t in ir.ArrayAttr(op.attributes["iterator_types"])):
        return None
    maps = [ir.AffineMapAttr(m).value for m in ir.ArrayAttr(op.attributes["indexing_maps"])]
    if any(m != ir.AffineMap.get_identity(m.n_dims) for m in maps):
        return None
    block = op.regions[0].blocks[0]
    ops = [o.operation for o in block.operations]
    if len(ops) != 2 or ops[0].name not in _WIDENINGS or ops[1].name != "linalg.yield":
        return None
    ext, yield_op = ops
    if ext.operands[0] != block.arguments[0] or list(yield_op.operands) != [ext.results[0]]:
        return None
    src = op.operands[0]
    if not isinstance(src.type, ir.RankedTensorType):
        return None
    if not _is_widening(ext.name, block.arguments[0].type, ext.results[0].type):
        return None
    return src, ext.name


def _is_contraction(op: ir.Operation) -> bool:
    """A named contraction, or a ``linalg.generic`` with a reduction loop
    whose body multiplies and adds (a matmul written out)."""
    if op.name in _NAMED_CONTRACTIONS:
        return True
    if op.name != "linalg.generic" or len(op.results) != 1:
        return False
    if not any("reduction" in str(t) for t in ir.ArrayAttr(op.attributes["iterator_types"])):
        return False
    names = {o.operation.name for o in op.regions[0].blocks[0].operations}
    return bool(names & {"arith.mulf", "arith.muli"}) and bool(names & {"arith.addf", "arith.addi"})


def _num_inputs(op: ir.Operation) -> int:
    return list(ir.DenseI32ArrayAttr(op.attributes["operandSegmentSizes"]))[0]


def _fold_into_generic(op: ir.Operation, i: int, narrow: ir.Value, ext: str) -> None:
    """`op` (a generic) reads `narrow` as input `i` and widens it in its body."""
    block = op.regions[0].blocks[0]
    arg = block.arguments[i]
    wide = arg.type
    op.operands[i] = narrow
    arg.set_type(ir.RankedTensorType(narrow.type).element_type)
    first = [o.operation for o in block.operations][0]
    with ir.InsertionPoint(first), op.location:
        widened = ir.Operation.create(ext, results=[wide], operands=[arg]).results[0]
    arg.replace_all_uses_except(widened, widened.owner.operation)


def _fold_into_named(op: ir.Operation, folds: dict[int, tuple[ir.Value, str]]) -> ir.Operation | None:
    """A copy of the named contraction `op` reading the narrow operands of
    `folds` (input index -> (narrow value, widening op)), its builtin body
    widening them; None where one ``cast`` cannot express the widenings (an
    unsigned operand beside a signed one)."""
    from mlir.dialects import linalg

    operands = list(op.operands)
    unsigned = "cast" in op.attributes and str(op.attributes["cast"]) == _UNSIGNED
    narrow_ints = {
        k for k in range(_num_inputs(op))
        if isinstance(ir.ShapedType(operands[k].type).element_type, ir.IntegerType)
        and k not in folds and ir.IntegerType(ir.ShapedType(operands[k].type).element_type).width < 32
    }
    exts = {e for _, e in folds.values() if e != "arith.extf"}
    if "arith.extui" in exts and ("arith.extsi" in exts or (narrow_ints and not unsigned)):
        return None
    if "arith.extsi" in exts and unsigned and narrow_ints:
        return None
    for k, (narrow, _) in folds.items():
        operands[k] = narrow
    attrs = {op.attributes[j].name: op.attributes[j].attr for j in range(len(op.attributes))}
    if "arith.extui" in exts:
        attrs["cast"] = ir.Attribute.parse(_UNSIGNED)
    elif "arith.extsi" in exts:
        attrs.pop("cast", None)
    with op.location, ir.InsertionPoint(op):
        new = ir.Operation.create(
            op.name, results=[r.type for r in op.results], operands=operands, attributes=attrs, regions=1
        )
        linalg.fill_builtin_region(new)
    return new


def fold_widening(fn: ir.Operation) -> int:
    """Let every contraction directly in `fn`'s body read the narrow tensor
    that an elementwise widening generic (``arith.extf`` bf16/f16 -> f32,
    ``arith.extsi``/``extui`` i8 -> i32) turns into one of its inputs, and
    widen it in its own body: a named op with mixed element types
    (``linalg.matmul ins(bf16, bf16) outs(f32)``) or a generic whose body
    starts with the extension. The widening stays for its other users
    (canonicalization removes it where none is left). Returns how many
    operands were folded.

    Why: torch-mlir writes a bf16 ``nn.Linear`` as ``arith.extf`` of the
    activations and the weights, then an f32 matmul: no task would read bf16,
    so no bf16 dot-product instruction (the ``cpu-dot-product`` rule) could
    apply, and every call would write and read the widened copies (twice the
    bytes). Weights that are constants fold the same way: the contraction
    reads the bf16 constant."""
    count = 0
    for block in fn.regions[0].blocks:
        for opview in list(block.operations):
            op = opview.operation
            if not op.name.startswith("linalg.") or "operandSegmentSizes" not in op.attributes:
                continue
            if not _is_contraction(op):
                continue
            folds: dict[int, tuple[ir.Value, str]] = {}
            for k in range(_num_inputs(op)):
                v = op.operands[k]
                if isinstance(v, ir.OpResult) and isinstance(v.type, ir.RankedTensorType):
                    found = _only_widens(v.owner.operation)
                    if found is not None:
                        folds[k] = found
            if not folds:
                continue
            if op.name == "linalg.generic":
                for k, (narrow, ext) in folds.items():
                    _fold_into_generic(op, k, narrow, ext)
                count += len(folds)
                continue
            new = _fold_into_named(op, folds)
            if new is None:
                continue
            op.results[0].replace_all_uses_with(new.results[0])
            op.erase()
            count += len(folds)
    return count


# --------------------------------------------------------------------------
# Narrow-float arithmetic computed in f32.

_EXACT = frozenset({"linalg.yield", "linalg.index", "arith.constant", "arith.extf", "arith.truncf", "tensor.extract"})
"""Body ops that compute nothing in a narrow type (or only round to it;
``tensor.extract``: an embedding's gather moves bf16 values)."""


def _computes_narrow(block: ir.Block) -> bool:
    """Whether an op of `block` other than :data:`_EXACT` has a bf16/f16
    operand or result."""
    for o in block.operations:
        op = o.operation
        if op.name in _EXACT:
            continue
        if any(is_narrow_float(v.type) for v in list(op.operands) + list(op.results)):
            return True
    return False


def _widen_generic_body(op: ir.Operation) -> None:
    """Rewrite `op`'s body to compute in f32: its narrow block arguments and
    captured narrow scalars extended at the top, every narrow value widened,
    each narrow output rounded once (``arith.truncf``) at the yield."""
    from mlir.dialects import arith

    f32 = ir.F32Type.get()
    block = op.regions[0].blocks[0]
    body = [o.operation for o in block.operations]
    first = body[0]
    with ir.InsertionPoint(first), op.location:
        for arg in block.arguments:
            if is_narrow_float(arg.type) and any(True for _ in arg.uses):
                ext = arith.extf(f32, arg)
                arg.replace_all_uses_except(ext, ext.owner.operation)
        captured: dict = {}
        for inner in body:
            for j, v in enumerate(list(inner.operands)):
                if not is_narrow_float(v.type) or isinstance(v, ir.BlockArgument) and v.owner == block:
                    continue
                if isinstance(v.type, ir.ShapedType):
                    continue  # a tensor a gather reads (tensor.extract): its element is extended below
                if isinstance(v, ir.OpResult) and v.owner.operation.parent == op:
                    continue  # made in the body (a set of wrappers did not find it: they hash by object)
                if v not in captured:
                    captured[v] = arith.extf(f32, v)
                inner.operands[j] = captured[v]
    yield_op = body[-1]
    for inner in body[:-1]:
        if inner.name == "tensor.extract" and is_narrow_float(inner.results[0].type):
            # The element read keeps its type; what uses it reads it extended.
            with ir.InsertionPoint.after(inner), op.location:
                ext = arith.extf(f32, inner.results[0])
            inner.results[0].replace_all_uses_except(ext, ext.owner.operation)
            continue
        _widen_in_place(inner)
    out_args = list(block.arguments)[_num_inputs(op):]
    with ir.InsertionPoint(yield_op), op.location:
        for j, v in enumerate(list(yield_op.operands)):
            want = out_args[j].type
            if is_narrow_float(want) and not is_narrow_float(v.type):
                yield_op.operands[j] = arith.truncf(want, v)


def compute_wide(fn: ir.Operation) -> int:
    """Rewrite every ``linalg.generic`` directly in `fn`'s body that computes
    on bf16 or f16 values to compute in f32 instead: the narrow tensors it
    reads are extended in the body, the results rounded once when they are
    written. Data movement (copies, transposes, extensions, truncations)
    is left as it is. Returns how many ops were rewritten.

    Why: torch-mlir writes GELU, residual adds, ReLU and scalings of a bf16
    model as bf16 arithmetic in the body, which is what neither torch (whose
    CPU kernels compute bf16 in f32 and round once) nor the LLVM backend
    handles: bf16 ``math.erf`` has no lowering the JIT can link, and bf16
    vector arithmetic crashes instruction selection at -O3 ("Do not know how
    to soft promote this operator's operand", a ``v8bf16`` splat). In f32
    only loads, stores and the conversions touch bf16."""
    count = 0
    for block in fn.regions[0].blocks:
        for opview in list(block.operations):
            op = opview.operation
            if op.name != "linalg.generic" or not op.regions[0].blocks:
                continue
            if _computes_narrow(op.regions[0].blocks[0]):
                _widen_generic_body(op)
                count += 1
    return count


# --------------------------------------------------------------------------
# f64 intermediates between f32 values.


def _is_f64(t: ir.Type) -> bool:
    if isinstance(t, (ir.RankedTensorType, ir.MemRefType)):
        t = ir.ShapedType(t).element_type
    return isinstance(t, ir.F64Type)


def _f64_tensor(t: ir.Type) -> bool:
    return isinstance(t, ir.RankedTensorType) and _is_f64(t)


def _owner(use) -> ir.Operation:
    owner = use.owner
    return owner.operation if hasattr(owner, "operation") else owner


def _captured(op: ir.Operation) -> list[tuple[ir.Operation, int, ir.Value]]:
    """The uses, inside `op`'s regions, of f64 values made outside it: (the
    user, the operand's index, the value)."""
    found = []

    def inside(v: ir.Value) -> bool:
        p = v.owner.owner if isinstance(v, ir.BlockArgument) else v.owner
        while p is not None:
            p = p.operation if hasattr(p, "operation") else p
            if p == op:
                return True
            p = p.parent
        return False

    def visit(inner: ir.Operation) -> ir.WalkResult:
        if inner != op:
            for i, v in enumerate(inner.operands):
                if _is_f64(v.type) and not inside(v):
                    found.append((inner, i, v))
        return ir.WalkResult.ADVANCE

    op.walk(visit)
    return found


_F64_ARITH = frozenset({
    "arith.addf", "arith.subf", "arith.mulf", "arith.divf", "arith.negf", "arith.maximumf", "arith.minimumf",
    "arith.maxnumf", "arith.minnumf", "math.sqrt", "math.rsqrt",
})
"""What a generic that reads an f64 tensor may do with its f64 values,
besides rounding them to f32, for :func:`narrow_f64_islands` to compute it
in f32."""


def _f32_body(generic: ir.Operation) -> bool:
    """Whether every f64 value in `generic`'s body only goes through
    :data:`_F64_ARITH` into an ``arith.truncf`` to f32, and its results are
    no f64."""
    if any(_is_f64(r.type) for r in generic.results):
        return False
    ok = True

    def visit(op: ir.Operation) -> ir.WalkResult:
        nonlocal ok
        if op != generic and any(_is_f64(v.type) for v in op.operands):
            if op.name == "arith.truncf":
                ok = ok and isinstance(op.results[0].type, ir.F32Type)
            elif op.name not in _F64_ARITH:
                ok = False
        return ir.WalkResult.ADVANCE

    generic.walk(visit)
    return ok


def narrow_f64_islands(fn: ir.Operation) -> int:
    """Compute in f32 the f64 tensors of `fn` that lie between f32 values:
    every f64 tensor made by ``tensor.empty``, ``linalg.fill`` or a
    ``linalg.generic``, none an argument or a result of `fn`, read only by
    those ops or by generics whose f64 values only go through arithmetic
    (:data:`_F64_ARITH`) into an ``arith.truncf`` to f32. Returns how many ops changed (0: the function is left as
    it is, also when any f64 tensor does not fit that shape).

    Why: torch-mlir's decomposition of a layer norm (``aten.var_mean``)
    computes the variance of f32 (or bf16) activations in f64 and rounds it
    back to f32; f64 vectors hold half the lanes, and those tasks took about
    a tenth of a bf16 BERT layer. PyTorch's own CPU kernel for the same
    layer norm computes in f32, and so does this; the f32 (or bf16) result
    differs from the f64 computation by less than the result type's
    tolerance. A function whose arguments or results are f64 asked for
    f64, and is left alone."""
    from mlir.dialects import arith

    block = fn.regions[0].blocks[0]
    ops = [o.operation for o in block.operations]
    island = [o for o in ops if any(_f64_tensor(r.type) for r in o.results)]
    if not island or any(_is_f64(a.type) for a in block.arguments) or any(_is_f64(v.type) for v in ops[-1].operands):
        return 0
    members = set(island)
    boundary: list[ir.Operation] = []
    for o in island:
        if o.name not in ("tensor.empty", "linalg.fill", "linalg.generic") or not all(_f64_tensor(r.type) for r in o.results):
            return 0
        for r in o.results:
            for use in r.uses:
                user = _owner(use)
                if user in members:
                    continue
                if user.name != "linalg.generic" or user.parent != fn or use.operand_number >= len(user.regions[0].blocks[0].arguments):
                    return 0
                if user not in boundary:
                    if not _f32_body(user):
                        return 0
                    boundary.append(user)
    f32 = ir.F32Type.get()
    # (Setting an op's operand changes its Python hash: no sets from here on.)
    for k, o in enumerate(island + boundary):
        for inner, i, v in _captured(o) + ([(o, 0, o.operands[0])] if o.name == "linalg.fill" else []):
            with inner.location, ir.InsertionPoint(inner):
                if isinstance(v, ir.OpResult) and v.owner.operation.name == "arith.constant":
                    narrowed = arith.constant(f32, ir.FloatAttr.get(f32, ir.FloatAttr(v.owner.operation.attributes["value"]).value))
                else:
                    narrowed = arith.truncf(f32, v)
            inner.operands[i] = narrowed
        _widen_in_place(o, include_root=k < len(island), retype=_is_f64)
    return len(island) + len(boundary)
