"""Bring imported Linalg (torch-mlir's output) into the shape tasks are cut from.

Entry point: :func:`normalize`, run by the partitioner on every function
that works on tensors, in place, before tasks are formed (so tuning and
compiling cut the same tasks from the same IR).

What it does, and why:

* drops results of a ``linalg.generic`` that nothing uses, with the body
  ops only they need. torch-mlir lowers ``max`` along a dimension (softmax)
  to a generic computing the maximum *and* its i64 index; the index is never
  used, and an i64 output would make the whole softmax untunable.
* turns the bounds checks of a gather (``cf.assert`` in a body: torch-mlir's
  ``nn.Embedding``, ``index_select``) into clamps of its indices
  (:func:`clamp_gathers`): a body holds no control flow that the vectorizer
  or the task lowering take, and an index out of range then reads the
  nearest row instead of memory outside the table.
* forwards identity gathers (:func:`forward_identity_gathers`): a generic
  that only copies a tensor of its own type through ``tensor.extract``,
  which is what torch-mlir's dynamic ``expand`` becomes at a static size.
* drops the unit dimensions an operand is indexed by the constant 0 in
  (:func:`drop_unit_broadcasts`): torch-mlir broadcasts through them
  (``tensor<64x1x1xf32>`` read with the map ``(n, c, h, w) -> (c, 0, 0)``,
  a ``keepdim`` reduction writing ``(..., 0)``). The operand becomes a
  ``tensor.collapse_shape`` (an output: the result is expanded back), so
  every map is a projected permutation, which the fusion and sketch rules
  understand, and the reshapes stay outside tasks as free views.
  ``canonicalize`` then folds the reshape pairs this leaves. (Upstream's
  ``linalg-fold-unit-extent-dims`` also drops unit *loops*, which puts a
  reshape between a convolution and its batch-norm chain and stops their
  fusion into one task.)

* writes each ``tensor.concat`` of static operands (``torch.cat``: a
  KV cache's past and new rows, a U-Net's skip connection) as a
  ``tensor.empty`` of its result and one ``tensor.insert_slice`` per operand
  (:func:`decompose_concats`): slices stay outside tasks, each operand's
  producer is a task of its own, and the driver copies it into place.

* converts channel-first convolutions and poolings to channel-last and
  sinks the transposes this makes until they cancel (:mod:`.layout`;
  on by default; ``normalize(module, layout=False)`` or
  :data:`CONVERT_LAYOUT` turn it off): our CPU sketches vectorize NHWC
  convolutions along the output channels, NCHW ones only along the image
  width (ResNet-50 with the default schedules, 1 core: about 0.2-0.4 s a
  call channel-last, 2.3-3 s channel-first).

* rewrites grouped and 3-D convolutions as plain 2-D ones
  (:mod:`.split_conv`): only those decompose to the 1-D convolutions the
  vectorizer knows (GRP ran at 2.5 GFLOP/s and C3D at 1.9 before).

* folds transposes into the contractions and reductions that read them
  (:mod:`.fold_transpose`): a transpose feeding a matmul would otherwise be
  a task of its own with no arithmetic (BERT's attention scores, TBG),
  also through torch-mlir's collapse of a unit batch (an attention's Q and
  V), and folds a transpose of a contraction's result into its output map
  (the attention's heads merged back: ``[h, s, d] -> [s, h, d]``).

* rewrites ``linalg.quantized_matmul`` (batch too) and the ``_q``
  convolutions as the plain int8 contraction and its zero points' terms
  (:func:`.precision.lower_quantized_ops`): tasks take tensors, not the
  scalar zero-point operands, and the contraction is a dot product.

* folds an elementwise widening (``arith.extf`` bf16 -> f32, ``arith.extsi``
  i8 -> i32) of a contraction's input into the contraction, which then
  reads the narrow tensor (:func:`.precision.fold_widening`): torch-mlir's
  bf16 linear layers widen both operands and multiply in f32, which no bf16
  dot-product sketch would match.

* makes every contraction, convolution or sum with a bf16 or f16 result
  accumulate in f32 and round once, in an elementwise ``arith.truncf`` the
  anchor's task fuses (:func:`.precision.accumulate_wide`): a bf16
  accumulator over K = 512 loses most of its digits.

* makes every generic that computes on bf16 or f16 values compute in f32
  and round once per output (:func:`.precision.compute_wide`): torch's
  numerics, and no bf16 ``math.erf`` left for the lowering, which has none.

Functions on memrefs are left as they are (the unit-dimension folding would
introduce memref reshapes, which tasks do not take).
"""

from __future__ import annotations

from mlir import ir
from mlir.passmanager import PassManager

from mlir_ansor.errors import AnsorError
from mlir_ansor.graph.fold_transpose import fold_output_transposes, fold_transposes
from mlir_ansor.graph.layout import convert_layout
from mlir_ansor.graph.precision import (
    accumulate_wide,
    compute_wide,
    fold_widening,
    lower_quantized_ops,
    narrow_f64_islands,
)
from mlir_ansor.graph.split_conv import split_convolutions
from mlir_ansor.ir.attrs import NORMALIZED_ATTR
from mlir_ansor.ir.program import first_diagnostic
from mlir_ansor.ir.rewrite import (
    backward_slice,
    cast_source,
    clone_remapped,
    defining_op,
    indexing_maps,
    parallel_generic,
    reassociation_attr,
    segments,
    unit_reassociation,
    walk_op,
)

__all__ = [
    "CONVERT_LAYOUT",
    "clamp_gathers",
    "decompose_concats",
    "drop_dead_results",
    "drop_unit_broadcasts",
    "forward_identity_gathers",
    "normalize",
    "reciprocal_divisors",
    "unbatch_broadcast_matmuls",
]

_FUNC_PIPELINE = "func.func(canonicalize,cse)"

CONVERT_LAYOUT = True
"""Whether :func:`normalize` runs the channel-last layout pass when not told
(the task extraction behind tune and compile does not tell it). It was off
while two builds never finished: the elementwise rule's schedule of the
NHWC->NCHW transpose left before a flatten (fixed in that rule), and
ResNet-50's whole module, whose NHWC convolutions pack their filter tiles
with a copy that was unrolled into thousands of vector transfers (fixed in
the multi-level tiling rule: one row per step)."""


def _on_tensors(fn: ir.Operation) -> bool:
    ftype = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
    if any(isinstance(t, ir.MemRefType) for t in list(ftype.inputs) + list(ftype.results)):
        return False
    found_memref = False

    def visit(op: ir.Operation) -> ir.WalkResult:
        nonlocal found_memref
        if any(isinstance(r.type, ir.MemRefType) for r in op.results):
            found_memref = True
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    fn.walk(visit)
    return not found_memref


def _drop_dead_results_of(op: ir.Operation) -> bool:
    """Rebuild a multi-result ``linalg.generic`` without its unused results;
    returns whether it did. Only when the dropped results' output block
    arguments feed none of the kept results (so the kept ones mean the same)."""
    results = list(op.results)
    live = [k for k, r in enumerate(results) if any(True for _ in r.uses)]
    if not live or len(live) == len(results):
        return False
    sizes = list(ir.DenseI32ArrayAttr(op.attributes["operandSegmentSizes"]))
    n_ins, n_outs = sizes[0], sizes[1]
    if n_outs != len(results):
        return False
    body = op.regions[0].blocks[0]
    ops = [o.operation for o in body.operations]
    yield_op = ops[-1]
    needed = backward_slice(body, [yield_op.operands[k] for k in live])
    args = list(body.arguments)
    if any(args[n_ins + k] in needed for k in range(n_outs) if k not in live):
        return False
    operands = list(op.operands)
    maps = list(ir.ArrayAttr(op.attributes["indexing_maps"]))
    attrs = {op.attributes[i].name: op.attributes[i].attr for i in range(len(op.attributes))}
    attrs["indexing_maps"] = ir.ArrayAttr.get(maps[:n_ins] + [maps[n_ins + k] for k in live])
    attrs["operandSegmentSizes"] = ir.DenseI32ArrayAttr.get([n_ins, len(live)])
    with op.context, op.location, ir.InsertionPoint(op):
        new = ir.Operation.create(
            "linalg.generic",
            results=[results[k].type for k in live],
            operands=operands[:n_ins] + [operands[n_ins + k] for k in live],
            attributes=attrs,
            regions=1,
        )
        kept_args = args[:n_ins] + [args[n_ins + k] for k in live]
        block = ir.Block.create_at_start(new.regions[0], [a.type for a in kept_args], [a.location for a in kept_args])
        mapping = dict(zip(kept_args, block.arguments))
        with ir.InsertionPoint(block):
            for inner in ops[:-1]:
                if inner not in needed:
                    continue
                clone_remapped(inner, mapping)
            kept = [yield_op.operands[k] for k in live]
            ir.Operation.create("linalg.yield", operands=[mapping.get(v, v) for v in kept])
    for j, k in enumerate(live):
        results[k].replace_all_uses_with(new.results[j])
    op.erase()
    return True


def drop_dead_results(fn: ir.Operation) -> int:
    """Drop the unused results of every ``linalg.generic`` directly in ``fn``'s
    body where that is sound; returns how many ops were rebuilt."""
    count = 0
    for block in fn.regions[0].blocks:
        for opview in list(block.operations):
            op = opview.operation
            if op.name == "linalg.generic" and len(op.results) > 1 and _drop_dead_results_of(op):
                count += 1
    return count


def decompose_concats(fn: ir.Operation) -> int:
    """Rewrite each ``tensor.concat`` whose operands and result are static
    as a ``tensor.empty`` of the result and a chain of ``tensor.insert_slice``,
    one per operand, at its offset along the joined dimension. Returns how
    many it rewrote (a dynamic one is left: specializing the function makes
    it static first, `graph.dynamic.specialize`).

    Concatenations that grow one from another (:func:`_growing_concats`:
    each joins the previous one's operands and more, DenseNet's dense block)
    share one tensor of the last one's size: each is a leading slice of it,
    and only its new operands are inserted, so that each operand is written
    once, not once per concatenation that holds it (DenseNet-121: 711 copies
    of its layers' outputs for 58 concatenations)."""
    from mlir.dialects import tensor

    done = 0
    for chain in _growing_concats(fn):
        last = chain[-1][0]
        full = ir.RankedTensorType(last.results[0].type)
        dim = ir.IntegerAttr(last.attributes["dim"]).value
        acc, written, offset = None, 0, 0
        for op, inputs in chain:
            out = ir.RankedTensorType(op.results[0].type)
            with ir.InsertionPoint(op), op.location:
                if acc is None:
                    acc = tensor.EmptyOp(list(full.shape), full.element_type).result
                for v in inputs[written:]:
                    t = ir.RankedTensorType(v.type)
                    offsets = [offset if d == dim else 0 for d in range(full.rank)]
                    acc = tensor.InsertSliceOp(v, acc, [], [], [], offsets, list(t.shape), [1] * full.rank).result
                    offset += t.shape[dim]
                result = acc if op == last else tensor.ExtractSliceOp(
                    out, acc, [], [], [], [0] * full.rank, list(out.shape), [1] * full.rank).result
            written = len(inputs)
            op.results[0].replace_all_uses_with(result)
            op.erase()
            done += 1
    return done


def _growing_concats(fn: ir.Operation) -> list[list[tuple[ir.Operation, list[ir.Value]]]]:
    """The static ``tensor.concat``s of `fn` with their operands (through
    casts), grouped into chains where each one's operands begin with all of
    the previous one's, along the same dimension, in the same block; a
    concat no other extends is a chain of its own."""
    chains: list[list[tuple[ir.Operation, list[ir.Value]]]] = []
    for op in walk_op(fn, "tensor.concat"):
        out = ir.RankedTensorType(op.results[0].type)
        # (through casts to dynamic types: torch-mlir's roll joins two slices cast to tensor<6x?xf32>)
        inputs = [cast_source(v) for v in op.operands]
        if not out.has_static_shape or not all(ir.RankedTensorType(v.type).has_static_shape for v in inputs):
            continue
        dim = ir.IntegerAttr(op.attributes["dim"]).value
        for chain in chains:
            last, prev = chain[-1]
            if (len(prev) < len(inputs) and inputs[:len(prev)] == prev and last.parent == op.parent
                    and ir.IntegerAttr(last.attributes["dim"]).value == dim):
                chain.append((op, inputs))
                break
        else:
            chains.append([(op, inputs)])
    return chains


def _batch_broadcast_source(v: ir.Value) -> ir.Value | None:
    """The 2-D tensor `v` broadcasts along a leading batch dimension, where
    a ``linalg.broadcast`` (dimensions [0]) or a ``linalg.generic`` that only
    copies its input through ``(b, k, n) -> (k, n)`` makes `v`; else None."""
    op = defining_op(v)
    if op is None or len(op.results) != 1:
        return None
    if op.name == "linalg.broadcast":
        dims = list(ir.DenseI64ArrayAttr(op.attributes["dimensions"]))
        return op.operands[0] if dims == [0] else None
    if op.name != "linalg.generic" or segments(op) != (1, 1):
        return None
    body = op.regions[0].blocks[0]
    ops = list(body.operations)
    if len(ops) != 1 or ops[0].operation.operands[0] != body.arguments[0]:
        return None
    maps = indexing_maps(op)
    if maps[1] != ir.AffineMap.get_identity(3) or [str(e) for e in maps[0].results] != ["d1", "d2"]:
        return None
    return op.operands[0]


def unbatch_broadcast_matmuls(fn: ir.Operation) -> int:
    """Rewrite each ``linalg.batch_matmul`` of static shapes whose right
    operand is one matrix broadcast along the batch as a ``linalg.matmul`` of
    the left operand's batch and rows joined (collapsed) by that matrix,
    expanded back; returns how many. ONNX's ``MatMul`` of a 3-D input by a
    weight (ViT-B/16's attention projections, as torch-mlir lowers them)
    comes as such a broadcast: 197 copies of a 768x2304 weight, which
    constant folding would have made a 1.4 GB constant per layer."""
    from mlir.dialects import linalg, tensor

    done = 0
    for op in walk_op(fn, "linalg.batch_matmul"):
        if "indexing_maps" in op.attributes and indexing_maps(op) != _batch_matmul_maps():
            continue  # transposed operands
        a, b, init = op.operands
        w = _batch_broadcast_source(b)
        types = [ir.RankedTensorType(v.type) for v in (a, init)]
        if w is None or not all(t.has_static_shape for t in types) or not ir.RankedTensorType(w.type).has_static_shape:
            continue
        (bat, m, k), (_, _, n) = types[0].shape, types[1].shape
        groups = reassociation_attr([[0, 1], [2]])
        with ir.InsertionPoint(op), op.location:
            a2 = tensor.CollapseShapeOp(ir.RankedTensorType.get([bat * m, k], types[0].element_type), a, groups).result
            out_t = ir.RankedTensorType.get([bat * m, n], types[1].element_type)
            init2 = tensor.CollapseShapeOp(out_t, init, groups).result
            mm = linalg.matmul(a2, w, outs=[init2])
            back = tensor.ExpandShapeOp(types[1], mm, groups, [], list(types[1].shape)).result
        op.results[0].replace_all_uses_with(back)
        op.erase()
        done += 1
    return done


def _batch_matmul_maps() -> list[ir.AffineMap]:
    d = [ir.AffineDimExpr.get(i) for i in range(4)]  # (batch, m, n, k)
    return [ir.AffineMap.get(4, 0, [d[0], d[1], d[3]]), ir.AffineMap.get(4, 0, [d[0], d[3], d[2]]),
            ir.AffineMap.get(4, 0, [d[0], d[1], d[2]])]


def _is_zero(expr: ir.AffineExpr) -> bool:
    return isinstance(expr, ir.AffineConstantExpr) and expr.value == 0


def _drop_unit_broadcasts_of(op: ir.Operation) -> bool:
    from mlir.dialects import tensor as tensor_d

    sizes = list(ir.DenseI32ArrayAttr(op.attributes["operandSegmentSizes"]))
    n_ins = sizes[0]
    maps = [ir.AffineMapAttr(a).value for a in ir.ArrayAttr(op.attributes["indexing_maps"])]
    operands = list(op.operands)
    changes = {}
    for i, (v, amap) in enumerate(zip(operands, maps)):
        if not isinstance(v.type, ir.RankedTensorType):
            return False
        shape = list(ir.RankedTensorType(v.type).shape)
        dropped = [j for j, e in enumerate(amap.results) if _is_zero(e) and shape[j] == 1]
        if dropped:
            changes[i] = dropped
    if not changes:
        return False
    new_maps = list(maps)
    new_operands = list(operands)
    expand_back: dict[int, tuple[ir.Type, list[list[int]]]] = {}
    with op.context, op.location, ir.InsertionPoint(op):
        for i, dropped in changes.items():
            amap = maps[i]
            t = ir.RankedTensorType(operands[i].type)
            shape = list(t.shape)
            groups = unit_reassociation(len(shape), dropped)
            kept = [j for j in range(len(shape)) if j not in dropped]
            new_maps[i] = ir.AffineMap.get(amap.n_dims, amap.n_symbols, [amap.results[j] for j in kept])
            new_t = ir.RankedTensorType.get([shape[j] for j in kept], t.element_type)
            new_operands[i] = tensor_d.CollapseShapeOp(new_t, operands[i], reassociation_attr(groups)).result
            if i >= n_ins:
                expand_back[i - n_ins] = (t, groups)
    _replace_generic(op, new_operands, new_maps, expand_back)
    return True


def _replace_generic(
    op: ir.Operation,
    operands: list[ir.Value],
    maps: list[ir.AffineMap],
    expand_back: dict[int, tuple[ir.Type, list[list[int]]]],
    iterators: list[ir.Attribute] | None = None,
) -> None:
    """Replace the ``linalg.generic`` `op` by one on `operands` with `maps`
    (and `iterators`), its body moved over; result k in `expand_back`
    (its old type, the reassociation) is expanded back to the old type."""
    from mlir.dialects import tensor as tensor_d

    n_ins, _ = segments(op)
    attrs = {op.attributes[k].name: op.attributes[k].attr for k in range(len(op.attributes))}
    attrs["indexing_maps"] = ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in maps])
    if iterators is not None:
        attrs["iterator_types"] = ir.ArrayAttr.get(iterators)
    with op.context, op.location, ir.InsertionPoint(op):
        new = ir.Operation.create(
            "linalg.generic", results=[v.type for v in operands[n_ins:]], operands=operands, attributes=attrs, regions=1
        )
        op.regions[0].blocks[0].append_to(new.regions[0])
    with op.context, op.location, ir.InsertionPoint.after(new):
        replacements = list(new.results)
        for k, (t, groups) in expand_back.items():
            replacements[k] = tensor_d.ExpandShapeOp(t, new.results[k], reassociation_attr(groups), [], list(t.shape)).result
    for old, rep in zip(op.results, replacements):
        old.replace_all_uses_with(rep)
    op.erase()


def _gathered_source(op: ir.Operation) -> ir.Value | None:
    """The tensor a ``linalg.generic`` copies unchanged, if it is an identity
    gather: no inputs, every loop parallel, an identity output map, and a
    body that yields ``tensor.extract %src[i0, ..., in]`` where each index
    is ``linalg.index k`` at position k (or the constant 0 where the
    dimension is 1) and ``%src`` has the result's static type."""
    if op.name != "linalg.generic" or len(op.results) != 1:
        return None
    n_ins, n_outs = segments(op)
    if n_ins != 0 or n_outs != 1:
        return None
    (amap,) = indexing_maps(op)
    if list(amap.results) != [ir.AffineExpr.get_dim(k) for k in range(amap.n_dims)]:
        return None
    result_t = op.results[0].type
    if not isinstance(result_t, ir.RankedTensorType) or not ir.RankedTensorType(result_t).has_static_shape:
        return None
    body = [o.operation for o in op.regions[0].blocks[0].operations]
    yield_op = body[-1]
    if len(yield_op.operands) != 1 or not isinstance(yield_op.operands[0].owner, ir.OpView):
        return None
    extract = yield_op.operands[0].owner.operation
    if extract.name != "tensor.extract" or extract not in body:
        return None
    src, *indices = list(extract.operands)
    if src.type != result_t:
        return None
    shape = list(ir.RankedTensorType(result_t).shape)
    for k, index in enumerate(indices):
        owner = defining_op(index)
        if owner is None:
            return None
        if owner.name == "linalg.index" and ir.IntegerAttr(owner.attributes["dim"]).value == k:
            continue
        if owner.name == "arith.constant" and shape[k] == 1 and ir.IntegerAttr(owner.attributes["value"]).value == 0:
            continue
        return None
    if any(o.name not in ("linalg.index", "arith.constant", "tensor.extract", "linalg.yield") for o in body):
        return None
    return src


def clamp_gathers(fn: ir.Operation) -> int:
    """In each Linalg body of `fn` that checks its indices (``cf.assert``),
    drop the checks and clamp every index of its ``tensor.extract``s into
    the extent it reads (``max(0, min(i, n - 1))``); returns how many
    bodies it changed. torch raises on an out-of-range index (a token id
    past the vocabulary); the compiled module reads the table's nearest
    row instead of memory beyond it."""
    from mlir.dialects import arith

    bodies: list[ir.Block] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name.startswith("linalg.") and op.regions and op.regions[0].blocks:
            block = op.regions[0].blocks[0]
            if any(inner.operation.name == "cf.assert" for inner in block.operations):
                bodies.append(block)
        return ir.WalkResult.ADVANCE

    fn.walk(visit)
    index = ir.IndexType.get()
    for block in bodies:
        for inner in list(block.operations):
            op = inner.operation
            if op.name == "cf.assert":
                op.erase()
            elif op.name == "tensor.extract":
                shape = ir.RankedTensorType(op.operands[0].type).shape
                for k, (i, n) in enumerate(zip(list(op.operands)[1:], shape)):
                    if n == ir.ShapedType.get_dynamic_size() or defining_op(i, "linalg.index") is not None:
                        continue
                    with ir.InsertionPoint(op), op.location:
                        low = arith.ConstantOp(index, 0).result
                        high = arith.ConstantOp(index, n - 1).result
                        clamped = arith.MaxSIOp(arith.MinSIOp(i, high).result, low).result
                    op.operands[1 + k] = clamped
    return len(bodies)


def forward_identity_gathers(fn: ir.Operation) -> int:
    """Replace every identity gather directly in ``fn``'s body
    (:func:`_gathered_source`) by the tensor it copies; returns how many.
    torch-mlir writes ``expand`` to a dynamic size as such a gather (each
    index ``select(dim == 1, 0, i)``); once the size is static and not 1,
    canonicalization leaves a copy, which would be a task reading and
    writing the whole tensor (BERT's attention scores at sequence length
    384: 0.5 ms)."""
    count = 0
    for block in fn.regions[0].blocks:
        for opview in list(block.operations):
            op = opview.operation
            src = _gathered_source(op)
            if src is not None:
                op.results[0].replace_all_uses_with(src)
                op.erase()
                count += 1
    return count


def _added_unit_dims(expand: ir.Operation) -> list[int]:
    """The dimensions of size 1 a ``tensor.expand_shape`` adds: in each
    group of its reassociation of more than one dimension, those of size 1
    (all but the last if the whole group is)."""
    shape = list(ir.RankedTensorType(expand.results[0].type).shape)
    added = []
    for group in ir.ArrayAttr(expand.attributes["reassociation"]):
        dims = [ir.IntegerAttr(x).value for x in ir.ArrayAttr(group)]
        if len(dims) < 2:
            continue
        units = [j for j in dims if shape[j] == 1]
        added += units[:-1] if len(units) == len(dims) else units
    return added


def _unit_loop(op: ir.Operation, maps: list[ir.AffineMap], operands: list) -> int | None:
    """A parallel loop of `op` that indexes a unit dimension an input's
    ``tensor.expand_shape`` added, that every operand indexing it indexes at
    a dimension of size 1, and that every output indexes; None if none."""
    n_ins, _ = segments(op)
    iterators = list(ir.ArrayAttr(op.attributes["iterator_types"]))
    candidates: list[int] = []
    for v, m in zip(operands[:n_ins], maps[:n_ins]):
        expand = defining_op(v, "tensor.expand_shape")
        if expand is not None:
            for j in _added_unit_dims(expand):
                e = list(m.results)[j]
                if isinstance(e, ir.AffineDimExpr):
                    candidates.append(e.position)
    for d in dict.fromkeys(candidates):
        if "reduction" in str(iterators[d]):
            continue
        dim = ir.AffineExpr.get_dim(d)
        ok = True
        for k, (v, m) in enumerate(zip(operands, maps)):
            results = list(m.results)
            if dim in results:
                if ir.RankedTensorType(v.type).shape[results.index(dim)] != 1 or len(results) < 2:
                    ok = False
            elif k >= n_ins:
                ok = False
        if ok:
            return d
    return None


def _drop_unit_loop_of(op: ir.Operation) -> bool:
    from mlir.dialects import tensor as tensor_d

    if op.name != "linalg.generic":
        return False
    n_ins, _ = segments(op)
    maps = indexing_maps(op)
    operands = list(op.operands)
    if not maps or maps[0].n_dims < 2 or any(not isinstance(v.type, ir.RankedTensorType) for v in operands):
        return False
    if any(m.n_symbols or not m.is_projected_permutation for m in maps):
        return False
    if any(o.operation.name == "linalg.index" for o in op.regions[0].blocks[0].operations):
        return False
    d = _unit_loop(op, maps, operands)
    if d is None:
        return False
    dim = ir.AffineExpr.get_dim(d)
    n = maps[0].n_dims

    def renumber(e: ir.AffineExpr) -> ir.AffineExpr:
        pos = ir.AffineDimExpr(e).position
        return ir.AffineExpr.get_dim(pos - 1 if pos > d else pos)

    expand_back: dict[int, tuple[ir.Type, list[list[int]]]] = {}
    new_operands, new_maps = [], []
    with op.context, op.location, ir.InsertionPoint(op):
        for k, (v, m) in enumerate(zip(operands, maps)):
            t = ir.RankedTensorType(v.type)
            results = list(m.results)
            if dim in results:
                j = results.index(dim)
                groups = unit_reassociation(len(t.shape), [j])
                nt = ir.RankedTensorType.get([x for i, x in enumerate(t.shape) if i != j], t.element_type)
                if defining_op(v, "tensor.empty") is not None:
                    # (canonicalization leaves a collapsed empty tensor)
                    v = tensor_d.EmptyOp(list(nt.shape), nt.element_type).result
                else:
                    v = tensor_d.CollapseShapeOp(nt, v, reassociation_attr(groups)).result
                results = results[:j] + results[j + 1 :]
                if k >= n_ins:
                    expand_back[k - n_ins] = (t, groups)
            new_operands.append(v)
            new_maps.append(ir.AffineMap.get(n - 1, 0, [renumber(e) for e in results]))
    iters = list(ir.ArrayAttr(op.attributes["iterator_types"]))
    _replace_generic(op, new_operands, new_maps, expand_back, iters[:d] + iters[d + 1 :])
    return True


def drop_unit_loops(fn: ir.Operation) -> int:
    """Rewrite every ``linalg.generic`` directly in ``fn``'s body that reads
    a ``tensor.expand_shape`` and has a parallel loop of extent 1 that each
    operand indexes at a unit dimension (every output does): the loop
    and those dimensions go (operands collapsed, results expanded back), and
    canonicalization then folds the reshape pairs this leaves. Returns how
    many ops were rewritten (one unit loop each; call again for more).

    Two of torch-mlir's spellings need it:
    - a keepdim mean, ``sum(x, -1, keepdim) / n``, is a reduction to
      ``[b, s]`` expanded to ``[b, s, 1]`` and divided there: after the
      rewrite the division reads the reduction directly, and the
      partitioner can join the layer norm's ops into one task
      (``graph.task._merge_rows``);
    - a linear layer's result ``[s, n]`` is expanded to ``[1, s, n]`` for
      the activation after it (BERT's GELU): after the rewrite the
      activation reads the matmul's result, and is fused into its task."""
    count = 0
    for block in fn.regions[0].blocks:
        for opview in list(block.operations):
            if _drop_unit_loop_of(opview.operation):
                count += 1
    return count


def drop_unit_broadcasts(fn: ir.Operation) -> int:
    """Rewrite every ``linalg.generic`` directly in ``fn``'s body whose maps
    index a unit dimension by the constant 0: that operand is collapsed
    (outputs expanded back after the op) and the map loses the result.
    Returns how many ops were rewritten."""
    count = 0
    for block in fn.regions[0].blocks:
        for opview in list(block.operations):
            op = opview.operation
            if op.name == "linalg.generic" and _drop_unit_broadcasts_of(op):
                count += 1
    return count


def _reciprocal_divisor_of(op: ir.Operation) -> bool:
    """Make the elementwise ``linalg.generic`` `op` multiply by the
    reciprocal of an input it only divides by, where that input is
    broadcast along some loop (a softmax's row sums) and made by a generic
    that nothing else reads: ``x / s`` becomes ``x * r`` with ``r = 1 / s``
    computed once per element of ``s`` by a generic of its own, which the
    partitioner fuses into the task that makes ``s``. Returns whether it
    did (one input each time)."""
    from mlir.dialects import arith

    if op.name != "linalg.generic" or "reduction" in str(op.attributes["iterator_types"]):
        return False
    n_ins, _ = segments(op)
    maps = indexing_maps(op)
    operands = list(op.operands)
    block = op.regions[0].blocks[0]
    for k in range(n_ins):
        v, amap, arg = operands[k], maps[k], block.arguments[k]
        if not isinstance(v.type, ir.RankedTensorType) or not isinstance(arg.type, ir.FloatType):
            continue
        if not amap.is_projected_permutation or len(amap.results) >= amap.n_dims:
            continue
        uses = list(arg.uses)
        if not uses or any(u.owner.name != "arith.divf" or u.operand_number != 1 for u in uses):
            continue
        # Only where the reciprocal joins the task that makes the divisor
        # (its one reader is this op): else it would be a task of its own.
        if len(list(v.uses)) != 1 or defining_op(v, "linalg.generic") is None:
            continue
        t = ir.RankedTensorType(v.type)
        with op.context, op.location, ir.InsertionPoint(op):
            recip, body = parallel_generic([v], [ir.AffineMap.get_identity(t.rank)], t)
            with ir.InsertionPoint(body):
                one = arith.ConstantOp(t.element_type, 1.0).result
                ir.Operation.create("linalg.yield", operands=[arith.DivFOp(one, body.arguments[0]).result])
        op.operands[k] = recip.results[0]
        for u in uses:
            div = u.owner
            with op.context, div.location, ir.InsertionPoint(div):
                mul = arith.MulFOp(div.operands[0], arg, fastmath=div.attributes["fastmath"] if "fastmath" in div.attributes else None)
            div.results[0].replace_all_uses_with(mul.result)
            div.erase()
        return True
    return False


def reciprocal_divisors(fn: ir.Operation) -> int:
    """Rewrite every elementwise ``linalg.generic`` directly in ``fn``'s
    body that divides by an input broadcast along one of its loops into a
    multiplication by that input's reciprocal (:func:`_reciprocal_divisor_of`),
    as PyTorch's softmax does: a softmax over rows of 384 then divides 384
    times less. A division is 5-10 times the cost of a multiplication on
    these cores (``vdivps``): in an attention over 384 keys at 1 thread on
    Zen 4 the division pass was a tenth of the time. The quotient changes by
    at most an ulp or so. Returns how many inputs were rewritten."""
    count = 0
    for block in fn.regions[0].blocks:
        for opview in list(block.operations):
            while _reciprocal_divisor_of(opview.operation):
                count += 1
    if count:
        PassManager.parse(_FUNC_PIPELINE).run(fn)  # as normalize leaves a function
    return count


def _verify(fn: ir.Operation) -> None:
    """Check the rewritten function before a pass runs on it: a pass given
    invalid IR may abort the process (an assertion in the wheels' MLIR),
    where the verifier raises. An :class:`AnsorError` naming the function
    and the first diagnostic: a bug of these rewrites, not of the input."""
    try:
        fn.verify()
    except ir.MLIRError as err:
        name = ir.StringAttr(fn.attributes["sym_name"]).value
        raise AnsorError(f"normalizing @{name} made invalid IR (a bug of mlir-ansor's rewrites, please report it "
                         f"with the input): {first_diagnostic(err)}") from None


def normalize(module: ir.Module, *, layout: bool | None = None) -> None:
    """Normalize every function of ``module`` that works on tensors, in place
    (idempotent: a function already normalized is skipped). `layout`: run the
    channel-last layout pass (:func:`.layout.convert_layout`); None reads
    :data:`CONVERT_LAYOUT`."""
    if layout is None:
        layout = CONVERT_LAYOUT
    with module.context, ir.Location.unknown():
        for opview in module.body.operations:
            fn = opview.operation
            if fn.name != "func.func" or not fn.regions[0].blocks:
                continue
            if NORMALIZED_ATTR in fn.attributes or not _on_tensors(fn):
                continue
            drop_dead_results(fn)
            clamp_gathers(fn)
            forward_identity_gathers(fn)
            narrow_f64_islands(fn)
            lower_quantized_ops(fn)
            if layout:
                convert_layout(fn)  # (sinks transposes through concatenations: before they go)
            decompose_concats(fn)
            split_convolutions(fn)
            unbatch_broadcast_matmuls(fn)
            drop_unit_broadcasts(fn)
            _verify(fn)
            pm = PassManager.parse(_FUNC_PIPELINE)
            for _ in range(4):  # one unit loop per op each time
                if not drop_unit_loops(fn):
                    break
                pm.run(fn)
            fold_widening(fn)
            fold_transposes(module, fn)
            fold_output_transposes(module, fn)
            accumulate_wide(fn)
            compute_wide(fn)
            _verify(fn)
            pm.run(fn)
            fn.attributes[NORMALIZED_ATTR] = ir.UnitAttr.get()
