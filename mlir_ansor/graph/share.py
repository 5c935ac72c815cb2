"""Compute a costly subexpression that two Linalg ops repeat once, in an
elementwise op of its own that both read.

Why: a softmax written as three ops, the way TVM's topi and many
hand-written kernels spell it (maximum; sum of ``exp(x - max)``;
``exp(x - max) / sum``), evaluates every ``exp`` twice. Tasks are cut per
op, so no schedule can share the two; the exponential is the whole cost of
the last two tasks (1024x1024 on a Zen 4 core: 0.28 and 0.31 ms, against
0.07 ms for the maximum that only reads). Written once to a tensor, it
costs one more pass over memory and saves one exponential per element.
torch-mlir already materializes the exponential of its softmax, so its
output is left as it is.

What counts as the same subexpression: an expression tree in two
``linalg.generic`` bodies, rooted at a transcendental (``math.exp``,
``math.erf``, ``math.tanh``, ``math.log``...), whose ops and attributes match
and whose leaves are the same input tensors read through the same indexing
maps (or the same values from outside the ops), in two generics with the
same static loop ranges (loop d_k means the same loop in both). A leaf may
not be an output's block argument (an accumulator), and the leaves must
read every loop, so that the new op writes each element it computes once.

Entry point: :func:`share_subexpressions`, run by the task extraction
(`graph.task`) for the targets whose packing decision asks for it
(``share_costly``: CPUs, where an exp costs more than a pass over memory;
not GPUs, where a softmax is bound by memory and recomputing is cheaper).
"""

from __future__ import annotations

from mlir import ir

from mlir_ansor.ir.rewrite import backward_slice, clone_remapped, indexing_maps, parallel_generic, segments

__all__ = ["COSTLY", "share_subexpressions"]

COSTLY = frozenset(
    {"math.exp", "math.exp2", "math.expm1", "math.erf", "math.tanh", "math.log", "math.log1p", "math.log2"}
)
"""Body ops worth a pass over memory to compute once: a polynomial each."""


def _static_ranges(op: ir.Operation, maps: list[ir.AffineMap]) -> tuple[int, ...] | None:
    """The loop ranges of a generic whose maps are projected permutations of
    static shapes; None otherwise."""
    if not maps or not all(m.is_projected_permutation for m in maps):
        return None
    ranges: list[int | None] = [None] * maps[0].n_dims
    for value, amap in zip(op.operands, maps):
        if not isinstance(value.type, ir.RankedTensorType):
            return None
        shape = ir.RankedTensorType(value.type).shape
        for j, expr in enumerate(amap.results):
            d = ir.AffineDimExpr(expr).position
            if shape[j] < 0:
                return None
            ranges[d] = shape[j]
    if any(r is None for r in ranges):
        return None
    return tuple(int(r) for r in ranges)  # type: ignore[arg-type]


class _Generic:
    """One top-level ``linalg.generic`` and the keys of its costly subexpressions."""

    def __init__(self, op: ir.Operation) -> None:
        self.op = op
        self.n_ins, self.n_outs = segments(op)
        self.maps = indexing_maps(op)
        self.ranges = _static_ranges(op, self.maps)
        self.block = op.regions[0].blocks[0]
        self.args = list(self.block.arguments)
        self.owner = {}
        for inner in self.block.operations:
            for r in inner.operation.results:
                self.owner[r] = inner.operation
        self.memo: dict = {}

    def key(self, v: ir.Value):
        """A hashable description of the expression computing `v`, or None
        where it reads an accumulator or something without one."""
        if v in self.memo:
            return self.memo[v]
        key = None
        if v in self.args:
            k = self.args.index(v)
            if k < self.n_ins:
                key = ("in", self.op.operands[k], str(self.maps[k]))
        elif v in self.owner:
            op = self.owner[v]
            if not op.regions and len(op.results) == 1:
                parts = [self.key(x) for x in op.operands]
                if all(p is not None for p in parts):
                    named = [op.attributes[i] for i in range(len(op.attributes))]
                    attrs = tuple(sorted((a.name, str(a.attr)) for a in named))
                    key = ("op", op.name, str(op.results[0].type), attrs, tuple(parts))
        else:
            key = ("outside", v)  # a value from above the op (a scalar constant)
        self.memo[v] = key
        return key

    def candidates(self) -> dict:
        """key -> the root op in this body, for every costly op whose
        expression reads only inputs and values from outside the op."""
        found = {}
        if self.ranges is None:
            return found
        for inner in self.block.operations:
            op = inner.operation
            if op.name not in COSTLY:
                continue
            key = self.key(op.results[0])
            if key is not None:
                found.setdefault(key, op)
        return found


def _leaves(key) -> list:
    """The ("in", value, map) leaves of an expression key, first use first, once each."""
    out: list = []

    def walk(k) -> None:
        if k[0] == "in":
            if k not in out:
                out.append(k)
        elif k[0] == "op":
            for p in k[4]:
                walk(p)

    walk(key)
    return out


def _input_slot(g: _Generic, leaf) -> int:
    """The input of `g` that an ("in", value, map) leaf reads (the first that
    matches: the same tensor may be read twice)."""
    _, value, map_text = leaf
    for k in range(g.n_ins):
        if g.op.operands[k] == value and str(g.maps[k]) == map_text:
            return k
    raise AssertionError("leaf of an expression key that its generic does not read")


def _covers_all_loops(g: _Generic, leaves: list) -> bool:
    dims: set[int] = set()
    for leaf in leaves:
        dims |= {ir.AffineDimExpr(e).position for e in g.maps[_input_slot(g, leaf)].results}
    return len(dims) == len(g.ranges)


def _materialize(g: _Generic, root: ir.Operation, leaves: list, before: ir.Operation) -> ir.Value:
    """A new all-parallel generic before `before` computing `root`'s
    expression over `g`'s loops from `leaves`; returns its result."""
    out_type = ir.RankedTensorType.get(list(g.ranges), root.results[0].type)
    slots = [_input_slot(g, leaf) for leaf in leaves]
    with ir.InsertionPoint(before), before.location:
        new, block = parallel_generic([leaf[1] for leaf in leaves], [g.maps[k] for k in slots], out_type)
        mapping = {g.args[k]: block.arguments[j] for j, k in enumerate(slots)}
        with ir.InsertionPoint(block):
            needed = backward_slice(g.block, [root.results[0]])
            for inner in g.block.operations:
                if inner.operation in needed:
                    clone_remapped(inner.operation, mapping)
            ir.Operation.create("linalg.yield", operands=[mapping[root.results[0]]])
    return new.results[0]


def _read_instead(g: _Generic, root: ir.Operation, shared: ir.Value) -> None:
    """Rebuild `g`'s op with `shared` as one more input (identity map) whose
    element replaces `root`'s result in the body; the body ops and inputs
    only `root` needed are left out."""
    op = g.op
    ops = [o.operation for o in g.block.operations]
    yield_op = ops[-1]
    # The body ops the yielded values still need once root's result is read.
    needed: set = set()
    stack = [g.owner[v] for v in yield_op.operands if v in g.owner]
    while stack:
        o = stack.pop()
        if o == root or o in needed:
            continue
        needed.add(o)
        stack.extend(g.owner[v] for v in o.operands if v in g.owner)
    used = {v for o in [*needed, yield_op] for v in o.operands}
    kept = [k for k in range(g.n_ins) if g.args[k] in used]
    operands = list(op.operands)
    outs = operands[g.n_ins :]
    attrs = {op.attributes[i].name: op.attributes[i].attr for i in range(len(op.attributes))}
    maps = [g.maps[k] for k in kept] + [ir.AffineMap.get_identity(len(g.ranges))] + g.maps[g.n_ins :]
    attrs["indexing_maps"] = ir.ArrayAttr.get([ir.AffineMapAttr.get(m) for m in maps])
    attrs["operandSegmentSizes"] = ir.DenseI32ArrayAttr.get([len(kept) + 1, g.n_outs])
    with ir.InsertionPoint(op), op.location:
        new = ir.Operation.create(
            "linalg.generic",
            results=[r.type for r in op.results],
            operands=[operands[k] for k in kept] + [shared] + outs,
            attributes=attrs,
            regions=1,
        )
        elem = ir.RankedTensorType(shared.type).element_type
        old_args = [g.args[k] for k in kept] + [root.results[0]] + g.args[g.n_ins :]
        types = [g.args[k].type for k in kept] + [elem] + [a.type for a in g.args[g.n_ins :]]
        block = ir.Block.create_at_start(new.regions[0], types, [op.location] * len(types))
        mapping = dict(zip(old_args, block.arguments))
        with ir.InsertionPoint(block):
            for o in ops[:-1]:
                if o in needed:
                    clone_remapped(o, mapping)
            ir.Operation.create("linalg.yield", operands=[mapping.get(v, v) for v in yield_op.operands])
    for a, b in zip(op.results, new.results):
        a.replace_all_uses_with(b)
    op.erase()


def share_subexpressions(fn: ir.Operation) -> int:
    """Compute once each costly subexpression that two or more top-level
    generics of ``fn`` repeat (module docstring); returns how many
    subexpressions became ops of their own."""
    count = 0
    changed = True
    while changed:  # one subexpression at a time: each rewrite replaces ops
        changed = False
        block = fn.regions[0].blocks[0]
        generics = [_Generic(o.operation) for o in block.operations if o.operation.name == "linalg.generic"]
        seen: dict = {}
        for g in generics:
            for key, root in g.candidates().items():
                seen.setdefault((g.ranges, key), []).append((g, root))
        for (_, key), users in seen.items():
            if len(users) < 2:
                continue
            g0, root0 = users[0]
            leaves = _leaves(key)
            if not leaves or not _covers_all_loops(g0, leaves):
                continue
            shared = _materialize(g0, root0, leaves, g0.op)
            for g, root in users:
                _read_instead(g, root, shared)
            count += 1
            changed = True
            break
    return count
