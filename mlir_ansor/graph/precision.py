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
* :func:`lower_quantized_matmuls` (also run by normalization):
  ``linalg.quantized_matmul`` and ``linalg.quantized_batch_matmul`` become a
  ``linalg.generic`` that subtracts the zero points in its body, which reads
  them from outside: tasks take tensors, and a scalar operand is no tensor
  (a constant zero point is cloned into the task like any constant).
* :func:`widen_payload`: the copy of a task module a reference is computed
  with (`measure.jobs.prepare_reference`): every bf16 and f16 replaced by
  f32, and the ``arith.extf``/``arith.truncf`` that this makes no-ops
  removed, so the reference rounds less than any candidate.
"""

from __future__ import annotations

from mlir import ir

from mlir_ansor.errors import UnsupportedError
from mlir_ansor.ir.program import location_str

__all__ = ["accumulate_wide", "is_narrow_float", "lower_quantized_matmuls", "widen_payload", "widened_dtype"]

_QUANTIZED = {"linalg.quantized_matmul": 2, "linalg.quantized_batch_matmul": 3}
"""Quantized named ops -> their number of parallel loops (then one reduction)."""


def is_narrow_float(t: ir.Type) -> bool:
    """Whether `t` (a scalar, tensor or memref type) has bf16 or f16 elements."""
    if isinstance(t, (ir.RankedTensorType, ir.MemRefType, ir.UnrankedTensorType)):
        t = ir.ShapedType(t).element_type
    return isinstance(t, (ir.BF16Type, ir.F16Type))


def widened_dtype(dtype: str) -> str:
    """The element type a reference computes `dtype` in ("bf16" -> "f32")."""
    return "f32" if dtype in ("bf16", "f16") else dtype


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


def _widen_in_place(root: ir.Operation, *, include_root: bool = True) -> None:
    """Give every narrow-float value under `root` (block arguments of its
    regions, results of its nested ops, and `root`'s own results when
    `include_root`) the f32 type, constants their f32 values, and remove the
    ``arith.extf``/``arith.truncf`` this leaves from f32 to f32."""
    noop: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        for region in op.regions:
            for block in region.blocks:
                for arg in block.arguments:
                    if is_narrow_float(arg.type):
                        arg.set_type(_wide(arg.type))
        if op == root and not include_root:
            return ir.WalkResult.ADVANCE
        for r in op.results:
            if is_narrow_float(r.type):
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
        _widen_in_place(module.operation)
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
    v = ops[-1].operands[0]
    if isinstance(v, ir.BlockArgument) or v.owner.name != "arith.addf":
        return False
    return out_arg in list(v.owner.operands) and not all(x == out_arg for x in v.owner.operands)


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
    if isinstance(init, ir.BlockArgument) or init.owner.name != "linalg.fill":
        return None
    scalar = init.owner.operands[0]
    if isinstance(scalar, ir.BlockArgument) or scalar.owner.name != "arith.constant":
        return None
    return scalar.owner.attributes["value"]


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


def _lower_quantized_of(op: ir.Operation) -> bool:
    from mlir.dialects import arith, linalg

    n_par = _QUANTIZED[op.name]
    a, b, a_zp, b_zp, c = list(op.operands)
    acc = ir.RankedTensorType(c.type).element_type
    if not isinstance(acc, ir.IntegerType) or not all(
        isinstance(ir.ShapedType(v.type).element_type, ir.IntegerType) for v in (a, b)
    ):
        return False
    n = n_par + 1
    d = [ir.AffineDimExpr.get(k) for k in range(n)]
    k = d[-1]
    if n_par == 2:
        maps = [[d[0], k], [k, d[1]], [d[0], d[1]]]
    else:
        maps = [[d[0], d[1], k], [d[0], k, d[2]], [d[0], d[1], d[2]]]
    par = ir.Attribute.parse("#linalg.iterator_type<parallel>")
    red = ir.Attribute.parse("#linalg.iterator_type<reduction>")
    with op.location, ir.InsertionPoint(op):
        generic = linalg.GenericOp(
            [c.type], [a, b], [c],
            ir.ArrayAttr.get([ir.AffineMapAttr.get(ir.AffineMap.get(n, 0, m)) for m in maps]),
            ir.ArrayAttr.get([par] * n_par + [red]),
        )
        elems = [ir.ShapedType(v.type).element_type for v in (a, b)]
        block = generic.regions[0].blocks.append(elems[0], elems[1], acc)
        with ir.InsertionPoint(block):
            x = arith.subi(_cast_int(block.arguments[0], acc), _cast_int(a_zp, acc))
            y = arith.subi(_cast_int(block.arguments[1], acc), _cast_int(b_zp, acc))
            linalg.YieldOp([arith.addi(block.arguments[2], arith.muli(x, y))])
    op.results[0].replace_all_uses_with(generic.results[0])
    op.erase()
    return True


def lower_quantized_matmuls(fn: ir.Operation) -> int:
    """Rewrite every ``linalg.quantized_matmul`` and
    ``linalg.quantized_batch_matmul`` on tensors directly in `fn`'s body as
    the equivalent ``linalg.generic``, its zero points read in the body;
    returns how many ops were rewritten."""
    count = 0
    for block in fn.regions[0].blocks:
        for opview in list(block.operations):
            op = opview.operation
            if op.name in _QUANTIZED and op.results and _lower_quantized_of(op):
                count += 1
    return count
