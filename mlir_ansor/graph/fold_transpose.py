"""Fold transposes into the contractions and reductions that read them.

Why: a `linalg.transpose` (or a `linalg.generic` that only permutes) whose
result feeds a matmul is a task of its own, with no arithmetic, that writes
a whole tensor the next task reads back; the task scheduler even spends
trials on it. Reading the untransposed tensor through a permuted indexing
map costs the contraction nothing its sketch cannot fix (packing copies the
reused operand's tile to a contiguous buffer anyway). Ansor's TBG subgraph
(transpose + batch matmul, BERT's attention scores) and every attention
layer torch-mlir imports have this shape. torch-mlir puts a
``tensor.collapse_shape`` of the unit batch between an attention's
transposes and its batch matmuls; the fold looks through one that only
drops unit dimensions. The same holds for a transpose of a contraction's
result (the attention's heads merged back before the output projection):
:func:`fold_output_transposes` makes the contraction write the permuted
tensor itself. In a BERT layer on a CPU, the attention task then reads Q
and V and writes its output with the heads' stride (a row of 64 floats
at a time), and three of its four transposes are gone.

Not folded: a transpose whose fold would make the consumer read its vector
loop (the output's last dimension) across a stride, where it read it
contiguously (K of Q.K^T); see `_strides_the_vector_loop`. Nor one of bf16,
f16 or int8 values (`_wide_float`): their contractions want the
dot-product rules' own layout.

Upstream's `linalg-fuse-elementwise-ops` does this too, but only between
`linalg.generic` ops and on every elementwise chain of the function at
once; here only transposes fold, only into consumers with a reduction loop,
and a named consumer (`linalg.batch_matmul`) is generalized first, alone.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import linalg as linalg_d
from mlir.dialects import tensor as tensor_d

from mlir_ansor.ir.rewrite import defining_op, depends_on_arguments, reassociation_attr, unit_reassociation

__all__ = ["fold_output_transposes", "fold_transposes"]

_TAG = "ansor.generalize"


def _source_of_dim(op: ir.Operation) -> list[int] | None:
    """For a pure permutation op (result T of input X): sigma with
    X's dim j read at T's dim sigma[j]; None for any other op."""
    if op.name == "linalg.transpose":
        perm = list(ir.DenseI64ArrayAttr(op.attributes["permutation"]))
        inv = [0] * len(perm)
        for k, p in enumerate(perm):  # T dim k is X dim perm[k]
            inv[p] = k
        return inv
    if op.name != "linalg.generic" or len(op.operands) != 2 or len(op.results) != 1:
        return None
    if any(str(t) != "#linalg.iterator_type<parallel>" for t in ir.ArrayAttr(op.attributes["iterator_types"])):
        return None
    in_map, out_map = (ir.AffineMapAttr(m).value for m in ir.ArrayAttr(op.attributes["indexing_maps"]))
    if not in_map.is_permutation or out_map != ir.AffineMap.get_identity(out_map.n_dims):
        return None
    block = op.regions[0].blocks[0]
    ops = list(block.operations)
    if len(ops) != 1 or ops[0].operation.name != "linalg.yield" or ops[0].operands[0] != block.arguments[0]:
        return None
    return [ir.AffineDimExpr(e).position for e in in_map.results]


def _num_inputs(op: ir.Operation) -> int:
    if "operandSegmentSizes" in op.attributes:
        return list(ir.DenseI32ArrayAttr(op.attributes["operandSegmentSizes"]))[0]
    return len(op.operands) - len(op.results)


def _has_reduction(op: ir.Operation) -> bool:
    """Whether a linalg op (named or generic) has a reduction loop."""
    if op.name == "linalg.generic":
        return any("reduction" in str(t) for t in ir.ArrayAttr(op.attributes["iterator_types"]))
    return op.name in ("linalg.matmul", "linalg.batch_matmul", "linalg.batch_reduce_matmul", "linalg.matvec", "linalg.vecmat", "linalg.dot")


def _generalize(module: ir.Module, body: ir.Block, ops) -> None:
    """Generalize the linalg `ops` of `body` (a function's block of
    `module`), alone: tagged with `_TAG`, matched by it, the tag dropped
    after. Handles to them are stale afterwards; walk `body` again."""
    from mlir.dialects.transform import interpreter

    ops = list(ops)
    if not ops:
        return
    for op in ops:
        op.attributes[_TAG] = ir.UnitAttr.get()

    script = ir.Module.parse(
        f"""
        module attributes {{transform.with_named_sequence}} {{
          transform.named_sequence @__transform_main(%root: !transform.any_op {{transform.readonly}}) {{
            %ops = transform.structured.match attributes{{{_TAG}}} in %root : (!transform.any_op) -> !transform.any_op
            %g = transform.structured.generalize %ops : (!transform.any_op) -> !transform.any_op
            transform.yield
          }}
        }}"""
    )
    interpreter.apply_named_sequence(module.operation, script.body.operations[0], script)
    for opview in body.operations:
        if _TAG in opview.operation.attributes:
            del opview.operation.attributes[_TAG]


def _only_use(v: ir.Value) -> ir.Operation | None:
    uses = list(v.uses)
    return uses[0].owner.operation if len(uses) == 1 else None


def _read_only_by(v: ir.Value, op: ir.Operation) -> bool:
    reader = _only_use(v)
    return reader is not None and reader == op


def _static(v: ir.Value) -> bool:
    return isinstance(v.type, ir.RankedTensorType) and v.type.has_static_shape


def _big_dims(reshape: ir.Operation, shape: list[int]) -> dict[int, int] | None:
    """For a ``tensor`` reshape whose reassociation groups dimensions of
    `shape` (its expanded side), each group's one dimension of size > 1
    mapped to the group's index; None where a group has none or several
    (the reshape does more than add or drop unit dimensions)."""
    group_of: dict[int, int] = {}
    for g, dims in enumerate(ir.ArrayAttr(reshape.attributes["reassociation"])):
        big = [ir.IntegerAttr(d).value for d in ir.ArrayAttr(dims) if shape[ir.IntegerAttr(d).value] != 1]
        if len(big) != 1:
            return None
        group_of[big[0]] = g
    return group_of


def _unit_collapse(op: ir.Operation, sigma: list[int]) -> tuple[ir.Operation, list[list[int]], list[int]] | None:
    """Where the permutation `op`'s only reader is a ``tensor.collapse_shape``
    that drops unit dimensions only (each of its groups holds one dimension
    of size > 1: torch-mlir's ``[1, 12, s, 64] -> [12, s, 64]`` between an
    attention's transpose and its batch matmul): (that collapse, the
    reassociation that drops the unit dimensions of `op`'s input, and the
    permutation from the collapsed input's dimensions to the collapse's);
    None otherwise."""
    collapse = _only_use(op.results[0])
    if collapse is None or collapse.name != "tensor.collapse_shape" or not _static(op.operands[0]):
        return None
    x_shape = ir.RankedTensorType(op.operands[0].type).shape
    group_of = _big_dims(collapse, ir.RankedTensorType(op.results[0].type).shape)
    if group_of is None:
        return None
    kept = [j for j, n in enumerate(x_shape) if n != 1]
    groups = unit_reassociation(len(x_shape), [j for j in range(len(x_shape)) if j not in kept])
    return collapse, groups, [group_of[sigma[j]] for j in kept]


def _wide_float(value: ir.Value) -> bool:
    """Whether `value` holds f32 or f64: contractions of narrow types
    (bf16, f16, int8) map onto the dot-product instructions, whose sketches
    pack their operands from a plain batch matmul; a bf16 BERT's attention
    contractions reading Q and V through the heads' permuted maps ran on
    widening FMAs (12 x 128 x 128 x 64: 370 us against 210, 1 thread, Zen
    4), far more than the two transposes cost (about 20 us each)."""
    t = value.type
    return isinstance(t, ir.ShapedType) and isinstance(t.element_type, (ir.F32Type, ir.F64Type))


def _reads_only(value: ir.Value) -> bool:
    """Whether every use of `value` is an input of a linalg op with a reduction loop."""
    uses = list(value.uses)
    return bool(uses) and all(
        u.owner.name.startswith("linalg.") and _has_reduction(u.owner) and u.operand_number < _num_inputs(u.owner)
        for u in uses
    )


def fold_transposes(module: ir.Module, fn: ir.Operation) -> int:
    """Fold every permutation op directly in `fn`'s body (on tensors) of a
    value computed from the function's arguments, whose every use is an
    input of a linalg op with a reduction loop, into those consumers'
    indexing maps; also through a ``tensor.collapse_shape`` that only drops
    unit dimensions (the consumers then read the input with its unit
    dimensions dropped). Returns how many permutations were folded.
    Named consumers are generalized (they keep their structure, which is
    what the sketch rules read)."""
    body = fn.regions[0].blocks[0]
    # (permutation op, sigma over the value read, the value its consumers read, the unit collapse or None)
    folds: list[tuple[ir.Operation, list[int], ir.Value, tuple | None]] = []
    seen: dict = {}
    for opview in body.operations:
        op = opview.operation
        sigma = _source_of_dim(op)
        if sigma is None or not _wide_float(op.operands[0]) or not depends_on_arguments(op.operands[0], seen):
            continue
        if _reads_only(op.results[0]):
            folds.append((op, sigma, op.results[0], None))
            continue
        through = _unit_collapse(op, sigma)
        if through is not None and _reads_only(through[0].results[0]):
            folds.append((op, through[2], through[0].results[0], through))
    if not folds:
        return 0
    _generalize(module, body, {u.owner for _, _, read, _ in folds for u in read.uses if u.owner.name != "linalg.generic"})
    folded = 0
    for op, sigma, read, through in folds:
        edits = []
        for u in list(read.uses):
            consumer, i = u.owner, u.operand_number
            maps = [ir.AffineMapAttr(m).value for m in ir.ArrayAttr(consumer.attributes["indexing_maps"])]
            m = maps[i]
            maps[i] = ir.AffineMap.get(m.n_dims, m.n_symbols, [m.results[s] for s in sigma])
            edits.append((consumer, i, maps, m))
        if any(_strides_the_vector_loop(old, maps[i], maps[-1]) for _, i, maps, old in edits):
            continue
        src = op.operands[0]
        if through is not None:
            collapse, groups, _ = through
            x_type = ir.RankedTensorType(src.type)
            shape = [n for n in x_type.shape if n != 1]
            with ir.InsertionPoint(collapse), collapse.location:
                src = tensor_d.CollapseShapeOp(
                    ir.RankedTensorType.get(shape, x_type.element_type), src, reassociation_attr(groups)
                ).result
        for consumer, i, maps, _ in edits:
            consumer.attributes["indexing_maps"] = ir.ArrayAttr.get([ir.AffineMapAttr.get(x) for x in maps])
            consumer.operands[i] = src
        if through is not None:
            through[0].erase()
        op.erase()
        folded += 1
    return folded


def _written_transposed(op: ir.Operation, sigma: list[int]) -> tuple[ir.Operation, ir.Operation | None, ir.Operation] | None:
    """For a permutation `op` (a transpose) of a contraction's result, read
    by nothing else, directly or through a ``tensor.expand_shape`` that
    only adds unit dimensions (torch-mlir's ``[12, s, 64] -> [1, 12, s,
    64]`` before an attention's output transpose): (the contraction, the
    expand or None, `op`); the contraction's init is a ``tensor.empty`` or a
    fill of one (made anew in the new shape), and the result's last
    dimension stays last. None otherwise."""
    x = op.operands[0]
    if not _static(x):
        return None
    expand = defining_op(x)
    if expand is not None and expand.name == "tensor.expand_shape":
        if _big_dims(expand, ir.RankedTensorType(x.type).shape) is None:
            return None
        x = expand.operands[0]
    else:
        expand = None
    producer = defining_op(x)
    if producer is None or not producer.name.startswith("linalg.") or not _has_reduction(producer):
        return None
    if len(producer.results) != 1 or not _read_only_by(producer.results[0], expand if expand is not None else op):
        return None
    if expand is not None and not _read_only_by(expand.results[0], op):
        return None
    init = defining_op(producer.operands[_num_inputs(producer)])
    if init is not None and init.name == "linalg.fill":
        init = defining_op(init.operands[1])
    if init is None or init.name != "tensor.empty":
        return None
    # The output's last dimension stays last: the vector loop keeps writing
    # whole vectors, not across a stride.
    if _result_dims(expand, op, sigma)[-1] != ir.RankedTensorType(producer.results[0].type).rank - 1:
        return None
    return producer, expand, op


def _result_dims(expand: ir.Operation | None, op: ir.Operation, sigma: list[int]) -> list[int]:
    """For each dimension of the permutation `op`'s result (its unit ones
    left out where `expand` added them), the dimension of the contraction's
    result it reads."""
    t_shape = ir.RankedTensorType(op.results[0].type).shape
    perm = [0] * len(sigma)
    for j, k in enumerate(sigma):  # T dim k is X dim j
        perm[k] = j
    if expand is None:
        return perm
    to_p = _big_dims(expand, ir.RankedTensorType(expand.results[0].type).shape)
    return [to_p[perm[k]] for k, n in enumerate(t_shape) if n != 1]


def _fold_into_producer(producer: ir.Operation, expand: ir.Operation | None, op: ir.Operation, sigma: list[int]) -> None:
    """Make the contraction `producer` write its result in the order the
    permutation `op` reads it (its output map permuted, its init
    re-created in the new shape) and replace `op`'s result with it
    (expanded back to `op`'s unit dimensions)."""
    t_shape = ir.RankedTensorType(op.results[0].type).shape
    kept = [k for k, n in enumerate(t_shape) if n != 1] if expand is not None else list(range(len(t_shape)))
    maps = [ir.AffineMapAttr(m).value for m in ir.ArrayAttr(producer.attributes["indexing_maps"])]
    out = maps[-1]
    new_out = ir.AffineMap.get(out.n_dims, out.n_symbols, [out.results[p] for p in _result_dims(expand, op, sigma)])
    elem = ir.RankedTensorType(producer.results[0].type).element_type
    new_type = ir.RankedTensorType.get([t_shape[k] for k in kept], elem)
    init_index = _num_inputs(producer)
    with ir.InsertionPoint(producer), producer.location:
        init = defining_op(producer.operands[init_index])
        fill = init if init.name == "linalg.fill" else None
        empty = defining_op(fill.operands[1]) if fill is not None else init
        value = tensor_d.EmptyOp(new_type.shape, elem).result
        if fill is not None:
            value = linalg_d.fill(fill.operands[0], outs=[value])
        producer.operands[init_index] = value
    producer.results[0].set_type(new_type)
    producer.attributes["indexing_maps"] = ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in [*maps[:-1], new_out]])
    result = producer.results[0]
    if expand is not None:
        with ir.InsertionPoint(op), op.location:
            units = [k for k, n in enumerate(t_shape) if n == 1]
            result = tensor_d.ExpandShapeOp(
                op.results[0].type, result, reassociation_attr(unit_reassociation(len(t_shape), units)), [], list(t_shape)
            ).result
    op.results[0].replace_all_uses_with(result)
    op.erase()
    if expand is not None:
        expand.erase()
    for dead in (fill, empty):  # unless another op shares them (a CSE'd zero fill)
        if dead is not None and not list(dead.results[0].uses):
            dead.erase()


def fold_output_transposes(module: ir.Module, fn: ir.Operation) -> int:
    """Fold every permutation op directly in `fn`'s body that only
    reorders a contraction's result (read by nothing else; through a
    ``tensor.expand_shape`` that adds unit dimensions) into that
    contraction's output map: the contraction writes the permuted tensor
    itself, where the transpose was a task of its own that read and wrote
    the whole result again (an attention's ``[heads, s, d] -> [s, heads,
    d]`` before the output projection). Not where the output's last
    dimension would change. Returns how many were folded."""
    body = fn.regions[0].blocks[0]

    def found() -> list[tuple[ir.Operation, ir.Operation | None, ir.Operation, list[int]]]:
        out = []
        for opview in body.operations:
            sigma = _source_of_dim(opview.operation)
            hit = None if sigma is None else _written_transposed(opview.operation, sigma)
            if hit is not None:
                out.append((*hit, sigma))
        return out

    _generalize(module, body, [producer for producer, _, _, _ in found() if producer.name != "linalg.generic"])
    hits = found()
    for hit in hits:
        _fold_into_producer(*hit)
    return len(hits)


def _strides_the_vector_loop(before: ir.AffineMap, after: ir.AffineMap, out: ir.AffineMap) -> bool:
    """Whether folding turns a read that is contiguous along the consumer's
    vector loop (the loop of its output's last dimension) into one that is
    not: K of Q.K^T, whose transpose makes the attention scores' columns K's
    rows. Such a fold is left alone: the transpose, a cheap task of its own,
    lets the contraction load whole vectors (TBG, 12x128x128x64, default
    schedules: 1.07 ms folded, 0.49 ms for the transpose and the
    contraction)."""
    if not out.results:
        return False
    vec = out.results[-1]
    contiguous = lambda m: bool(m.results) and m.results[-1] == vec  # noqa: E731
    return contiguous(before) and not contiguous(after) and any(r == vec for r in after.results)
