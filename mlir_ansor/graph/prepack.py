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

An f32 matmul with a constant B is read in column panels instead
(:class:`Panels`): ``Bp[n / w, k, w] = B[k, n]``, so that each register
tile's B (w columns, all of K) is one contiguous stream rather than K rows
N floats apart. The matmul becomes a ``linalg.generic`` over (m, n / w, w, k)
writing ``C3[m, n / w, w]``, a free view of C
(``tensor.expand_shape`` / ``tensor.collapse_shape`` around it), and the
elementwise ops after it (a bias, an activation: the epilogue its task
fuses) are rewritten over the same three loops, so the view is taken after
them. Timed with cold caches, as a model runs its weights, a 128 x 768 x 768
matmul took 1.43 ms with B as it is and 1.32 ms in panels of 32; 128 x 768
x 3072 6.53 and 5.99 ms (Zen 4, 1 thread, 64 trials each). bf16 weights for
``vdpbf16ps`` are laid out both ways, pairs in column panels
(``Bp[n / w, k / 2, w, 2]``, loops (m, n / w, w, k / 2, 2)); int8 ones keep
the layout `passes.dot_products` lowers from.

Which matmuls, and in which group, is the target's business (the rule
knows which instructions it maps): the caller passes a :data:`Decide`.
Without one (``extract_tasks(..., prepack=None)``) nothing is rewritten.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlir import ir

from mlir_ansor.ir.attrs import PACKED_ATTR
from mlir_ansor.ir.rewrite import clone_remapped, defining_op, erase_unused, indexing_maps, segments

__all__ = ["Decide", "Panels", "prepack_weights"]


@dataclass(frozen=True)
class Panels:
    """Read a matmul's constant B in column panels `width` wide, with its
    reduction in groups of `group` (1: f32 for FMAs; 2: bf16 pairs for
    ``vdpbf16ps``, ``Bp[n / w, k / 2, w, 2]``)."""

    width: int
    group: int = 1


Decide = Callable[[str, str, int, int, int], "int | Panels | None"]
"""``decide(input type, accumulator type, m, n, k)``: the reduction group
to pack a matmul's constant B in (2 or 4), the :class:`Panels` to read it
in, or None to leave it."""

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


def _relayout(value: ir.Value, shape: list[int], source: list[ir.AffineExpr]) -> ir.Value:
    """A generic copying `value` into a new tensor of `shape`: element
    (d0, d1, ...) is `value`'s element at `source` (its indices as affine
    expressions of the d's). On constants it is evaluated once at compile
    time; an ``expand_shape`` of a dense constant would be folded by the
    next greedy rewrite, and the ops of the function's generalized copy
    would no longer line up with its own."""
    from mlir.dialects import linalg, tensor

    elem = ir.RankedTensorType(value.type).element_type
    rank = len(shape)
    copy = linalg.GenericOp(
        [ir.RankedTensorType.get(shape, elem)], [value], [tensor.EmptyOp(shape, elem).result],
        ir.ArrayAttr.get([ir.AffineMapAttr.get(ir.AffineMap.get(rank, 0, source)), _identity_map(rank)]),
        _parallel(rank),
    )
    block = copy.regions[0].blocks.append(elem, elem)
    with ir.InsertionPoint(block):
        linalg.YieldOp([block.arguments[0]])
    return copy.results[0]


def _times_plus(a: ir.AffineExpr, factor: int, b: ir.AffineExpr) -> ir.AffineExpr:
    """a * factor + b."""
    return ir.AffineExpr.get_add(ir.AffineExpr.get_mul(a, ir.AffineConstantExpr.get(factor)), b)


def _packed_matmul(op: ir.Operation, group: int, width: int = 0, constant: set | None = None) -> ir.Operation:
    """The rewrite of one matmul (see the module's docstring), at `op`;
    with `width`, on B in panels too: loops (m, n / w, w, pairs, pair),
    ``Bp[n / w, pairs, w, pair]``, writing the [m, n / w, w] view of C."""
    from mlir.dialects import arith, linalg, tensor

    a, b, c = op.operands
    a_t, b_t, c_t = (ir.RankedTensorType(v.type) for v in (a, b, c))
    (m, k), (_, n) = a_t.shape, b_t.shape
    pairs = k // group
    elem_in, elem_acc = a_t.element_type, c_t.element_type
    with op.location, ir.InsertionPoint(op):
        a3_t = ir.RankedTensorType.get([m, pairs, group], elem_in)
        a3 = tensor.ExpandShapeOp(a3_t, a, [[0], [1, 2]], [], [m, pairs, group]).result
        # Bp[p, j, e] = B[p * group + e, j], or in panels
        # Bp[q, p, j, e] = B[p * group + e, q * width + j]
        if width:
            q_, p_, j_, e_ = (ir.AffineExpr.get_dim(i) for i in range(4))
            shape, col = [n // width, pairs, width, group], _times_plus(q_, width, j_)
        else:
            p_, col, e_ = (ir.AffineExpr.get_dim(i) for i in range(3))
            shape = [pairs, n, group]
        bp = _relayout(b, shape, [_times_plus(p_, group, e_), col])
        if width:
            c = _split(c, 1, width, constant or set())
            m_, q_, j_, p_, e_ = (ir.AffineExpr.get_dim(i) for i in range(5))
            maps = [ir.AffineMap.get(5, 0, [m_, p_, e_]), ir.AffineMap.get(5, 0, [q_, p_, j_, e_]), ir.AffineMap.get(5, 0, [m_, q_, j_])]
            kinds = ("parallel", "parallel", "parallel", "reduction", "reduction")
        else:
            dims = [ir.AffineExpr.get_dim(i) for i in range(4)]  # m, n, pair, element of the pair
            maps = [
                ir.AffineMap.get(4, 0, [dims[0], dims[2], dims[3]]),
                ir.AffineMap.get(4, 0, [dims[2], dims[1], dims[3]]),
                ir.AffineMap.get(4, 0, [dims[0], dims[1]]),
            ]
            kinds = ("parallel", "parallel", "reduction", "reduction")
        it = [ir.Attribute.parse(f"#linalg.iterator_type<{t}>") for t in kinds]
        generic = linalg.GenericOp(
            [c.type], [a3, bp], [c], ir.ArrayAttr.get([ir.AffineMapAttr.get(mp) for mp in maps]), ir.ArrayAttr.get(it)
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


def _parallel(n: int) -> ir.ArrayAttr:
    return ir.ArrayAttr.get([ir.Attribute.parse("#linalg.iterator_type<parallel>")] * n)


def _split_type(t: ir.RankedTensorType, pos: int, width: int) -> ir.RankedTensorType:
    shape = list(t.shape)
    return ir.RankedTensorType.get(shape[:pos] + [shape[pos] // width, width] + shape[pos + 1 :], t.element_type)


def _split_reassociation(rank: int, pos: int) -> list[list[int]]:
    """Dimension `pos` of a rank-`rank` tensor into two."""
    return [[j] if j < pos else ([pos, pos + 1] if j == pos else [j + 1]) for j in range(rank)]


def _split(value: ir.Value, pos: int, width: int, constant: set) -> ir.Value:
    """`value` with its dimension `pos` split into (size / width, width), at
    the current insertion point: a fresh tensor.empty or fill for one, a
    copying generic for a constant (:func:`_relayout`), else a view."""
    from mlir.dialects import linalg, tensor

    t = ir.RankedTensorType(value.type)
    new_t = _split_type(t, pos, width)
    owner = defining_op(value)
    if owner is not None and owner.name == "tensor.empty":
        return tensor.EmptyOp(list(new_t.shape), new_t.element_type).result
    if owner is not None and owner.name == "linalg.fill":
        empty = tensor.EmptyOp(list(new_t.shape), new_t.element_type).result
        return linalg.fill(owner.operands[0], outs=[empty])
    if value in constant:
        dims = [ir.AffineExpr.get_dim(i) for i in range(t.rank + 1)]
        src = [dims[j] if j < pos else dims[j + 1] for j in range(t.rank)]
        src[pos] = _times_plus(dims[pos], width, dims[pos + 1])
        return _relayout(value, list(new_t.shape), src)
    return tensor.ExpandShapeOp(new_t, value, _split_reassociation(t.rank, pos), [], list(new_t.shape)).result


def _collapse(value: ir.Value, pos: int, like: ir.Type) -> ir.Value:
    from mlir.dialects import tensor

    rank = ir.RankedTensorType(like).rank
    return tensor.CollapseShapeOp(like, value, _split_reassociation(rank, pos)).result


def _panel_matmul(op: ir.Operation, width: int, constant: set) -> ir.Value:
    """C[m, n] = A[m, k] B[k, n] as a generic on B in panels (see the
    module's docstring), at `op`; returns its [m, n / w, w] result."""
    from mlir.dialects import arith, linalg

    a, b, c = op.operands
    b_t, c_t = ir.RankedTensorType(b.type), ir.RankedTensorType(c.type)
    k, n = b_t.shape
    with op.location, ir.InsertionPoint(op):
        # Bp[q, k, e] = B[k, q * width + e]
        q_, k_, e_ = (ir.AffineExpr.get_dim(i) for i in range(3))
        bp = _relayout(b, [n // width, k, width], [k_, _times_plus(q_, width, e_)])
        c3 = _split(c, 1, width, constant)
        m_, q_, e_, r_ = (ir.AffineExpr.get_dim(i) for i in range(4))
        maps = [
            ir.AffineMap.get(4, 0, [m_, r_]),
            ir.AffineMap.get(4, 0, [q_, r_, e_]),
            ir.AffineMap.get(4, 0, [m_, q_, e_]),
        ]
        it = [ir.Attribute.parse(f"#linalg.iterator_type<{t}>") for t in ("parallel", "parallel", "parallel", "reduction")]
        generic = linalg.GenericOp(
            [c3.type], [a, bp], [c3], ir.ArrayAttr.get([ir.AffineMapAttr.get(mp) for mp in maps]),
            ir.ArrayAttr.get(it),
        )
        block = generic.regions[0].blocks.append(c_t.element_type, b_t.element_type, c_t.element_type)
        with ir.InsertionPoint(block):
            x, y, acc = block.arguments
            linalg.YieldOp([arith.addf(acc, arith.mulf(x, y))])
        return generic.results[0]


def _single_owner(value: ir.Value) -> ir.Operation | None:
    owners = []
    for use in value.uses:
        o = use.owner.operation if isinstance(use.owner, ir.OpView) else use.owner
        if o not in owners:
            owners.append(o)
    return owners[0] if len(owners) == 1 else None


def _elementwise_user(value: ir.Value) -> ir.Operation | None:
    """The one op that reads `value`, when it is an elementwise generic
    (all loops parallel, plain-dimension maps, one result written through
    the identity, no ``linalg.index``) reading it through the identity."""
    user = _single_owner(value)
    if user is None or user.name != "linalg.generic" or len(user.results) != 1:
        return None
    n_ins, n_outs = segments(user)
    maps = indexing_maps(user)
    if n_outs != 1 or any("reduction" in str(t) for t in ir.ArrayAttr(user.attributes["iterator_types"])):
        return None
    identity = str(ir.AffineMap.get_identity(maps[-1].n_dims))
    if not all(m.is_projected_permutation for m in maps) or str(maps[-1]) != identity:
        return None
    if any(user.operands[k] == value and str(maps[k]) != identity for k in range(n_ins)):
        return None
    if ir.RankedTensorType(user.results[0].type).shape != ir.RankedTensorType(value.type).shape:
        return None  # (its element type may differ: a bf16 result's truncf)
    for inner in user.regions[0].blocks[0].operations:
        if inner.operation.name == "linalg.index":
            return None
    return user


def _fused_after(value: ir.Value) -> bool:
    """Whether the task partitioner might fuse the op reading `value` after
    its producer (`graph.task`): one Linalg op reads it, with no reduction.
    A chain of panels ending there would cut that op off its task."""
    user = _single_owner(value)
    if user is None or not user.name.startswith("linalg."):
        return False
    if user.name == "linalg.generic":
        return not any("reduction" in str(t) for t in ir.ArrayAttr(user.attributes["iterator_types"]))
    return not user.name.startswith(_REDUCING)


# Named ops with a reduction loop: never fused after another op.
_REDUCING = tuple(
    f"linalg.{n}"
    for n in ("matmul", "batch_", "conv", "depthwise", "pooling", "reduce", "contract", "dot", "matvec", "vecmat",
              "mmt4d", "quantized", "fill")
)


def _split_elementwise(user: ir.Operation, value: ir.Value, value3: ir.Value, pos: int, width: int, constant: set):
    """`user` (an :func:`_elementwise_user` of `value`) rewritten over one
    more loop: loop `pos` split in (panel, column), reading `value3` (value
    split at `pos`) for `value`; returns the new op's result."""
    from mlir.dialects import linalg

    n_ins, _ = segments(user)
    maps = indexing_maps(user)
    rank = maps[0].n_dims
    dims = [ir.AffineExpr.get_dim(i) for i in range(rank + 1)]
    with user.location, ir.InsertionPoint(user):
        operands, new_maps = [], []
        for k, (v, amap) in enumerate(zip(user.operands, maps)):
            loops = [ir.AffineDimExpr(e).position for e in amap.results]
            exprs = []
            for j in loops:
                exprs += [dims[j]] if j < pos else ([dims[pos], dims[pos + 1]] if j == pos else [dims[j + 1]])
            new_maps.append(ir.AffineMap.get(rank + 1, 0, exprs))
            if v == value and k < n_ins:
                operands.append(value3)
            elif pos in loops:
                operands.append(_split(v, loops.index(pos), width, constant))
            else:
                operands.append(v)
        out_t = operands[-1].type
        new = linalg.GenericOp(
            [out_t], operands[:n_ins], operands[n_ins:],
            ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in new_maps]), _parallel(rank + 1),
        )
        old_block = user.regions[0].blocks[0]
        block = new.regions[0].blocks.append(*[a.type for a in old_block.arguments])
        mapping = dict(zip(old_block.arguments, block.arguments))
        with ir.InsertionPoint(block):
            for inner in old_block.operations:
                clone_remapped(inner.operation, mapping)
    return new.results[0]


def _panel_chain(op: ir.Operation) -> list[ir.Operation] | None:
    """The matmul `op` and the elementwise generics after it that its panels
    would be carried through; None where the chain would end at an op the
    partitioner fuses today (a named elementwise op, a transposing
    generic), which reading B as it is keeps in the task."""
    chain = [op]
    while (user := _elementwise_user(chain[-1].results[0])) is not None:
        chain.append(user)
    return None if _fused_after(chain[-1].results[0]) else chain


def panel_matmul(op: ir.Operation, width: int, constant: set, group: int = 1) -> bool:
    """Rewrite a plain f32 ``linalg.matmul`` with a constant B to read B in
    panels of `width` columns, and the elementwise chain after it over the
    panels (see the module's docstring); returns whether it did."""
    chain = _panel_chain(op)
    if chain is None:
        return False
    if group > 1:
        value3 = _packed_matmul(op, group, width, constant).results[0]
    else:
        value3 = _panel_matmul(op, width, constant)
    for prev, user in zip(chain, chain[1:]):
        # Its output map is the identity, so loop d1 is the output's column.
        value3 = _split_elementwise(user, prev.results[0], value3, 1, width, constant)
    last = chain[-1]
    with last.location, ir.InsertionPoint(last):
        view = _collapse(value3, 1, last.results[0].type)
    last.results[0].replace_all_uses_with(view)
    for old in reversed(chain):  # each read only by the next, erased first
        old.erase()
    return True


def prepack_weights(fn: ir.Operation, decide: Decide, constant: set) -> int:
    """Rewrite each plain ``linalg.matmul`` of `fn` whose B is in `constant`
    (the values computed from constants only) and that `decide` gives a
    group (see the module's docstring); returns how many were rewritten."""
    if not fn.regions[0].blocks:
        return 0
    count = 0
    # Listed first: rewriting one erases the elementwise ops after it.
    matmuls = [o.operation for o in fn.regions[0].blocks[0].operations if _is_default_matmul(o.operation)]
    for op in matmuls:
        if op.operands[1] not in constant:
            continue
        types = [_element(v) for v in op.operands]
        if types[0] != types[1]:
            continue  # `decide` takes one input type
        a_t, b_t = (ir.RankedTensorType(v.type) for v in op.operands[:2])
        if not (a_t.has_static_shape and b_t.has_static_shape):
            continue
        (m, k), (_, n) = a_t.shape, b_t.shape
        group = decide(types[0], types[2], m, n, k)
        if isinstance(group, Panels):
            if (
                n % group.width == 0
                and n > group.width
                and k % group.group == 0
                and panel_matmul(op, group.width, constant, group.group)
            ):
                count += 1
                continue
            group = group.group if group.group > 1 else None  # pairs without panels
        if not group or k % group:
            continue
        new = _packed_matmul(op, group)
        op.results[0].replace_all_uses_with(new.results[0])
        op.erase()
        count += 1
    if count:
        erase_unused(fn.regions[0].blocks[0], _PURE)
    return count


_PURE = frozenset({"tensor.empty", "linalg.fill", "tensor.expand_shape", "tensor.collapse_shape", "arith.constant"})
"""The ops a rewrite leaves unread (a panelled matmul's old output fill)."""
