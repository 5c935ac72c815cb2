"""Fold transposes into the contractions and reductions that read them.

Why: a `linalg.transpose` (or a `linalg.generic` that only permutes) whose
result feeds a matmul is a task of its own, with no arithmetic, that writes
a whole tensor the next task reads back; the task scheduler even spends
trials on it. Reading the untransposed tensor through a permuted indexing
map costs the contraction nothing its sketch cannot fix (packing copies the
reused operand's tile to a contiguous buffer anyway). Ansor's TBG subgraph
(transpose + batch matmul, BERT's attention scores) and every attention
layer torch-mlir imports have this shape.

Not folded: a transpose whose fold would make the consumer read its vector
loop (the output's last dimension) across a stride, where it read it
contiguously (K of Q.K^T); see `_strides_the_vector_loop`.

Upstream's `linalg-fuse-elementwise-ops` does this too, but only between
`linalg.generic` ops and on every elementwise chain of the function at
once; here only transposes fold, only into consumers with a reduction loop,
and a named consumer (`linalg.batch_matmul`) is generalized first, alone.
"""

from __future__ import annotations

from mlir import ir

from mlir_ansor.ir.rewrite import depends_on_arguments

__all__ = ["fold_transposes"]

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


def _generalize(module: ir.Module) -> None:
    """Generalize the ops tagged with `_TAG` (and drop the tag)."""
    from mlir.dialects.transform import interpreter

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


def fold_transposes(module: ir.Module, fn: ir.Operation) -> int:
    """Fold every permutation op directly in `fn`'s body (on tensors) of a
    value computed from the function's arguments, whose every use is an input of a linalg op with a reduction loop into those
    consumers' indexing maps; returns how many permutations were folded.
    Named consumers are generalized (they keep their structure, which is
    what the sketch rules read)."""
    body = fn.regions[0].blocks[0]
    folds: list[tuple[ir.Operation, list[int]]] = []
    seen: dict = {}
    for opview in body.operations:
        op = opview.operation
        sigma = _source_of_dim(op)
        if sigma is None:
            continue
        uses = list(op.results[0].uses)
        if uses and depends_on_arguments(op.operands[0], seen) and all(
            u.owner.name.startswith("linalg.") and _has_reduction(u.owner) and u.operand_number < _num_inputs(u.owner)
            for u in uses
        ):
            folds.append((op, sigma))
    if not folds:
        return 0
    named = {u.owner for op, _ in folds for u in op.results[0].uses if u.owner.name != "linalg.generic"}
    for c in named:
        c.attributes[_TAG] = ir.UnitAttr.get()
    if named:
        _generalize(module)
    for opview in body.operations:
        if _TAG in opview.operation.attributes:
            del opview.operation.attributes[_TAG]
    folded = 0
    for op, sigma in folds:
        src = op.operands[0]
        edits = []
        for u in list(op.results[0].uses):
            consumer, i = u.owner, u.operand_number
            maps = [ir.AffineMapAttr(m).value for m in ir.ArrayAttr(consumer.attributes["indexing_maps"])]
            m = maps[i]
            maps[i] = ir.AffineMap.get(m.n_dims, m.n_symbols, [m.results[s] for s in sigma])
            edits.append((consumer, i, maps, m))
        if any(_strides_the_vector_loop(old, maps[i], maps[-1]) for _, i, maps, old in edits):
            continue
        for consumer, i, maps, _ in edits:
            consumer.attributes["indexing_maps"] = ir.ArrayAttr.get([ir.AffineMapAttr.get(x) for x in maps])
            consumer.operands[i] = src
        op.erase()
        folded += 1
    return folded


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
