"""Constant weights packed once, at compile time, in the dot-product layout.

The CPU's dot-product instructions (``vdpbf16ps``, ``vpdpbusd``,
``vpdpwssd``) want a matmul's reduction in groups of 2 or 4 next to each
other: B[k, n] read as B[k/g, n, g]. The `cpu-dot-product` sketches pack B
into that layout inside the kernel, a copy of the whole of B per call. When
B is a constant (a model's weight) that copy is the same on every call; in
a BERT layer's 128-row matmuls it was about a fifth of the kernel (128 x
3072 x 768 bf16, 1 thread, Zen 4: 4.0 ms with the copy).

:func:`prepack_weights` does what IREE's data tiling does with constant
encodings: it rewrites ``linalg.matmul(A, B)`` with a constant B as

* ``A3 = tensor.expand_shape A`` to [m, k/g, g] (a free view, outside tasks);
* ``Bp = linalg.generic`` copying B to [k/g, n, g], an op on constants only, which :func:`.constants.fold_constants` evaluates once;
* a ``linalg.generic`` over (m, n, k/g, g) reading A3 and Bp, with the
  widening of the matmul written out in its body and ``ansor.packed`` (the
  group) among its attributes; the `cpu-dot-product` rule takes it as the
  op its own packing makes.

Which matmuls, and in which group, is the target's business (the rule
knows which instructions it maps): the caller passes a :data:`Decide`.
Without one (``extract_tasks(..., prepack=None)``) nothing is rewritten.
"""

from __future__ import annotations

from collections.abc import Callable

from mlir import ir

from mlir_ansor.ir.attrs import PACKED_ATTR

__all__ = ["Decide", "prepack_weights"]

Decide = Callable[[str, str, int, int, int], "int | None"]
"""``decide(input type, accumulator type, m, n, k)``: the reduction group
to pack a matmul's constant B in (2 or 4), or None to leave it."""

def _is_default_matmul(op: ir.Operation) -> bool:
    """A plain ``linalg.matmul`` (no transposing ``indexing_maps``, no
    ``cast`` other than the default signed one)."""
    if op.name != "linalg.matmul" or len(op.operands) != 3:
        return False
    if "indexing_maps" in op.attributes:
        maps = [ir.AffineMapAttr(m).value for m in ir.ArrayAttr(op.attributes["indexing_maps"])]
        if [str(m) for m in maps] != [
            "(d0, d1, d2) -> (d0, d2)",
            "(d0, d1, d2) -> (d2, d1)",
            "(d0, d1, d2) -> (d0, d1)",
        ]:
            return False
    if "cast" in op.attributes and "unsigned" in str(op.attributes["cast"]):
        return False
    return True


def _identity_map(rank: int) -> ir.AffineMapAttr:
    return ir.AffineMapAttr.get(ir.AffineMap.get_identity(rank))


def _element(v: ir.Value) -> str:
    return str(ir.RankedTensorType(v.type).element_type)


def _packed_matmul(op: ir.Operation, group: int) -> ir.Operation:
    """The rewrite of one matmul (see the module's docstring), at `op`."""
    from mlir.dialects import arith, linalg, tensor

    a, b, c = op.operands
    a_t, b_t, c_t = (ir.RankedTensorType(v.type) for v in (a, b, c))
    (m, k), (_, n) = a_t.shape, b_t.shape
    pairs = k // group
    elem_in, elem_acc = a_t.element_type, c_t.element_type
    with op.location, ir.InsertionPoint(op):
        a3_t = ir.RankedTensorType.get([m, pairs, group], elem_in)
        a3 = tensor.ExpandShapeOp(a3_t, a, [[0], [1, 2]], [], [m, pairs, group]).result
        # Bp[p, j, e] = B[p * group + e, j]: one generic on constants (an
        # expand_shape of a dense constant would be folded by the next
        # greedy rewrite, and the ops of the function's generalized copy
        # would no longer line up with its own).
        bp_t = ir.RankedTensorType.get([pairs, n, group], b_t.element_type)
        p_, j_, e_ = (ir.AffineExpr.get_dim(i) for i in range(3))
        row = ir.AffineExpr.get_add(ir.AffineExpr.get_mul(p_, ir.AffineConstantExpr.get(group)), e_)
        pack = linalg.GenericOp(
            [bp_t], [b], [tensor.EmptyOp([pairs, n, group], b_t.element_type).result],
            ir.ArrayAttr.get([ir.AffineMapAttr.get(ir.AffineMap.get(3, 0, [row, j_])), _identity_map(3)]),
            ir.ArrayAttr.get([ir.Attribute.parse("#linalg.iterator_type<parallel>")] * 3),
        )
        pb = pack.regions[0].blocks.append(b_t.element_type, b_t.element_type)
        with ir.InsertionPoint(pb):
            linalg.YieldOp([pb.arguments[0]])
        bp = pack.results[0]
        dims = [ir.AffineExpr.get_dim(i) for i in range(4)]  # m, n, pair, element of the pair
        maps = [
            ir.AffineMap.get(4, 0, [dims[0], dims[2], dims[3]]),
            ir.AffineMap.get(4, 0, [dims[2], dims[1], dims[3]]),
            ir.AffineMap.get(4, 0, [dims[0], dims[1]]),
        ]
        it = [ir.Attribute.parse(f"#linalg.iterator_type<{t}>") for t in ("parallel", "parallel", "reduction", "reduction")]
        generic = linalg.GenericOp(
            [c_t], [a3, bp], [c], ir.ArrayAttr.get([ir.AffineMapAttr.get(mp) for mp in maps]), ir.ArrayAttr.get(it)
        )
        generic.operation.attributes[PACKED_ATTR] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), group)
        block = generic.regions[0].blocks.append(elem_in, b_t.element_type, elem_acc)
        with ir.InsertionPoint(block):
            x, y, acc = block.arguments
            if not isinstance(elem_acc, ir.IntegerType):
                x, y = arith.extf(elem_acc, x), arith.extf(elem_acc, y)
                linalg.YieldOp([arith.addf(acc, arith.mulf(x, y))])
            else:
                x, y = arith.extsi(elem_acc, x), arith.extsi(elem_acc, y)
                linalg.YieldOp([arith.addi(acc, arith.muli(x, y))])
    return generic.operation


def prepack_weights(fn: ir.Operation, decide: Decide, constant: set) -> int:
    """Rewrite each plain ``linalg.matmul`` of `fn` whose B is in `constant`
    (the values computed from constants only) and that `decide` gives a
    group (see the module's docstring); returns how many were rewritten."""
    if not fn.regions[0].blocks:
        return 0
    count = 0
    for opview in list(fn.regions[0].blocks[0].operations):
        op = opview.operation
        if not _is_default_matmul(op) or op.operands[1] not in constant:
            continue
        types = [_element(v) for v in op.operands]
        if types[0] != types[1]:
            continue  # `decide` takes one input type
        a_t, b_t = (ir.RankedTensorType(v.type) for v in op.operands[:2])
        if not (a_t.has_static_shape and b_t.has_static_shape):
            continue
        (m, k), (_, n) = a_t.shape, b_t.shape
        group = decide(types[0], types[2], m, n, k)
        if not group or k % group:
            continue
        new = _packed_matmul(op, group)
        op.results[0].replace_all_uses_with(new.results[0])
        op.erase()
        count += 1
    return count
