"""Public helpers for rewriting Linalg on tensors: slices of a block,
cloning with remapped operands, transposes and the permutations they make.

The graph rewrites (`mlir_ansor.graph`) and the compiler's driver building
share them; each works at the caller's insertion point and location.
"""

from __future__ import annotations

from mlir import ir


def backward_slice(block: ir.Block, roots: list[ir.Value]) -> set:
    """The ops of ``block`` that the values ``roots`` depend on (values read
    inside their regions included), and those values themselves."""
    owner_of = {}
    for inner in block.operations:
        for r in inner.operation.results:
            owner_of[r] = inner.operation
    needed: set = set()
    stack = list(roots)
    while stack:
        v = stack.pop()
        if v in needed:
            continue
        needed.add(v)
        op = owner_of.get(v)
        if op is None:
            continue
        if op not in needed:
            needed.add(op)
            stack.extend(op.operands)
            # Values read inside nested regions count too.

            def collect(inner: ir.Operation) -> ir.WalkResult:
                stack.extend(inner.operands)
                return ir.WalkResult.ADVANCE

            for region in op.regions:
                for b in region.blocks:
                    for o in b.operations:
                        o.operation.walk(collect)
    return needed


def clone_remapped(op: ir.Operation, mapping: dict) -> ir.Operation:
    """Clone `op` at the current insertion point with every operand (its
    nested ops' too) found in `mapping` replaced, and map `op`'s results to
    the clone's; returns the clone."""
    clone = op.clone()

    def remap(inner: ir.Operation) -> ir.WalkResult:
        for idx, v in enumerate(inner.operands):
            if v in mapping:
                inner.operands[idx] = mapping[v]
        return ir.WalkResult.ADVANCE

    clone.operation.walk(remap)
    for a, b in zip(op.results, clone.results):
        mapping[a] = b
    return clone


def segments(op: ir.Operation) -> tuple[int, int]:
    """(number of ins, number of outs) of a Linalg op."""
    if "operandSegmentSizes" in op.attributes:
        sizes = list(ir.DenseI32ArrayAttr(op.attributes["operandSegmentSizes"]))
        return sizes[0], sizes[1]
    n = len(op.operands)
    return n - 1, 1  # pragma: no cover - every Linalg structured op has segments


def indexing_maps(op: ir.Operation) -> list[ir.AffineMap]:
    """The indexing maps of a ``linalg.generic`` (ins, then outs)."""
    return [ir.AffineMapAttr(a).value for a in ir.ArrayAttr(op.attributes["indexing_maps"])]


def inverse_permutation(perm: list[int]) -> list[int]:
    """The permutation that undoes `perm`."""
    inv = [0] * len(perm)
    for k, p in enumerate(perm):
        inv[p] = k
    return inv


def static_tensor_type(v: ir.Value) -> ir.RankedTensorType | None:
    """`v`'s ranked tensor type if it has a static shape, else None."""
    if not isinstance(v.type, ir.RankedTensorType):
        return None
    t = ir.RankedTensorType(v.type)
    return t if t.has_static_shape else None


def transpose(v: ir.Value, perm: list[int]) -> ir.Value:
    """``linalg.transpose`` of `v` (result dim k is `v`'s dim perm[k]) at the
    current insertion point, on a fresh ``tensor.empty``."""
    from mlir.dialects import linalg, tensor

    t = ir.RankedTensorType(v.type)
    empty = tensor.EmptyOp([t.shape[p] for p in perm], t.element_type)
    return linalg.transpose(v, outs=[empty.result], permutation=perm).results[0]


def permutation_of(v: ir.Value) -> list[int] | None:
    """The permutation of the ``linalg.transpose`` that produced `v`, if one did."""
    if isinstance(v, ir.BlockArgument) or v.owner.name != "linalg.transpose":
        return None
    return list(ir.DenseI64ArrayAttr(v.owner.attributes["permutation"]))


def dense_ints(attr: ir.Attribute) -> list[int]:
    """The integers of a dense integer elements attribute (strides, dilations)."""
    return [int(x) for x in ir.DenseIntElementsAttr(attr)]


def window_ints(op: ir.Operation, name: str) -> list[int]:
    """A convolution's or pooling's `name` ("strides", "dilations"), one per
    spatial dimension of its result; 1s where the op leaves it out (the
    default: `linalg.conv_2d_nhwc_hwcf ins(...)` without attributes)."""
    if name in op.attributes:
        return dense_ints(op.attributes[name])
    rank = ir.ShapedType(op.results[0].type if len(op.results) else op.operands[-1].type).rank
    return [1] * (rank - 2)


def depends_on_arguments(value: ir.Value, seen: dict) -> bool:
    """Whether `value` depends on a block argument (not on constants only:
    a transposed weight is computed once at compile time, not folded)."""
    if isinstance(value, ir.BlockArgument):
        return True
    root = value.owner
    if root in seen:
        return seen[root]
    # Depth first without recursion: a chain of a few hundred ops (ResNet-50
    # from its logits back to its image) is deeper than Python's stack.
    # Each frame: [op, its operands still to look at, the producer visited last].
    seen[root] = False
    stack = [[root, iter(root.operands), None]]
    while stack:
        frame = stack[-1]
        op, operands, child = frame
        if child is not None and seen[child]:
            seen[op] = True
            stack.pop()
            continue
        frame[2] = None
        for v in operands:
            if isinstance(v, ir.BlockArgument) or seen.get(v.owner, False):
                seen[op] = True
                break
            if v.owner not in seen:
                seen[v.owner] = False
                frame[2] = v.owner
                stack.append([v.owner, iter(v.owner.operands), None])
                break
        if frame[2] is None:  # decided: an operand depends on an argument, or none does
            stack.pop()
    return seen[root]


def defining_op(v: ir.Value, name: str | None = None) -> ir.Operation | None:
    """The operation `v` is a result of (None for a block argument); with
    `name`, only an operation of that name."""
    owner = v.owner
    if not isinstance(owner, (ir.Operation, ir.OpView)):
        return None
    op = owner.operation
    return op if name is None or op.name == name else None


def cast_source(v: ir.Value) -> ir.Value:
    """The source of the ``tensor.cast`` that makes `v`, else `v`."""
    cast = defining_op(v, "tensor.cast")
    return v if cast is None else cast.operands[0]


def concat(values: list[ir.Value], dim: int) -> ir.Value:
    """``tensor.concat`` of static `values` along `dim` at the current
    insertion point, with its static result type (the bindings infer none):
    the operands' shape, their extents along `dim` summed."""
    from mlir.dialects import tensor

    types = [ir.RankedTensorType(v.type) for v in values]
    shape = list(types[0].shape)
    shape[dim] = sum(t.shape[dim] for t in types)
    out = ir.RankedTensorType.get(shape, types[0].element_type, types[0].encoding)
    return tensor.ConcatOp(out, dim, values).result


def walk_op(root: ir.Operation, name: str) -> list[ir.Operation]:
    """Every op named `name` inside `root` (`root` included), in walk order."""
    found: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == name:
            found.append(op)
        return ir.WalkResult.ADVANCE

    root.walk(visit)
    return found


def one_per_use(root: ir.Operation, name: str) -> int:
    """Give each use of every single-result op named `name` inside `root` a
    clone of that op of its own, placed before it (a ``linalg.fill`` or a
    ``tensor.empty`` that several ops read); returns how many clones."""
    count = 0
    for op in walk_op(root, name):
        for use in list(op.results[0].uses)[1:]:
            with ir.InsertionPoint(op), op.location:
                clone = op.clone()
            use.owner.operands[use.operand_number] = clone.results[0]
            count += 1
    return count


def parallel_generic(inputs: list[ir.Value], maps: list[ir.AffineMap], out_type: ir.RankedTensorType) -> tuple[ir.Operation, ir.Block]:
    """At the current insertion point and location: a ``tensor.empty`` of
    `out_type` and an all-parallel ``linalg.generic`` over its loops that
    reads `inputs` through `maps` and writes it (identity map). Returns the
    generic and its body block, with the element arguments and no ops: the
    caller fills it and ends it with ``linalg.yield``."""
    n = out_type.rank
    elem = out_type.element_type
    empty = ir.Operation.create("tensor.empty", results=[out_type])
    attrs = {
        "indexing_maps": ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in list(maps) + [ir.AffineMap.get_identity(n)]]),
        "iterator_types": ir.ArrayAttr.get([ir.Attribute.parse("#linalg.iterator_type<parallel>") for _ in range(n)]),
        "operandSegmentSizes": ir.DenseI32ArrayAttr.get([len(inputs), 1]),
    }
    new = ir.Operation.create(
        "linalg.generic", results=[out_type], operands=list(inputs) + [empty.results[0]], attributes=attrs, regions=1
    )
    arg_types = [ir.RankedTensorType(v.type).element_type for v in inputs] + [elem]
    block = ir.Block.create_at_start(new.regions[0], arg_types, [ir.Location.current] * len(arg_types))
    return new, block


def unit_reassociation(rank: int, dropped: list[int]) -> list[list[int]]:
    """Contiguous groups of ``range(rank)`` with one kept dimension each (the
    dropped unit dimensions join a neighbour); [] when all are dropped."""
    kept = [j for j in range(rank) if j not in dropped]
    if not kept:
        return []
    groups: list[list[int]] = [[j] for j in kept]
    for j in dropped:
        after = [g for g in groups if g[0] > j]
        (after[0] if j < kept[0] else [g for g in groups if g[-1] < j][-1]).append(j)
    return [sorted(g) for g in groups]


def reassociation_attr(groups: list[list[int]]) -> ir.ArrayAttr:
    """`groups` as the reassociation attribute of a ``tensor`` reshape."""
    i64 = ir.IntegerType.get_signless(64)
    return ir.ArrayAttr.get([ir.ArrayAttr.get([ir.IntegerAttr.get(i64, j) for j in g]) for g in groups])


def erase_unused(block: ir.Block, names) -> int:
    """Erase the ops of `block` named in `names` whose results nothing reads,
    users first and until none is left (a chain goes whole); returns how
    many were erased. Rewrites leave such ops behind (an old output's fill,
    a transpose of a rewritten input), and the generalized copy of a
    function, whose Linalg ops must line up with its own, loses them to the
    generalizing pass's folding."""
    erased = 0
    changed = True
    while changed:
        changed = False
        for opview in reversed(list(block.operations)):
            op = opview.operation
            if op.name in names and not any(True for r in op.results for _ in r.uses):
                op.erase()
                erased += 1
                changed = True
    return erased


def is_float_zero(v: ir.Value) -> bool:
    """Whether `v` is an ``arith.constant`` float 0.0 (a pad's or a fill's
    zero)."""
    const = defining_op(v, "arith.constant")
    if const is None:
        return False
    attr = const.attributes["value"]
    return isinstance(attr, ir.FloatAttr) and ir.FloatAttr(attr).value == 0.0


def inline_body(func: ir.Operation, args: list[ir.Value]) -> list[ir.Value]:
    """Clone the body of `func` (a ``func.func`` of one block, parsed from a
    program text) at the current insertion point, its arguments replaced by
    `args`; returns the values its ``func.return`` returns, as cloned."""
    body = func.regions[0].blocks[0]
    mapping = dict(zip(body.arguments, args))
    for inner in body.operations:
        inner = inner.operation
        if inner.name == "func.return":
            return [mapping.get(v, v) for v in inner.operands]
        clone_remapped(inner, mapping)
    raise ValueError("inline_body: a function without func.return")
