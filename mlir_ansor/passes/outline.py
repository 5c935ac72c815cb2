"""Outline runs of a function's ops into functions of their own, so that a
module without tasks (the untuned reference, `compiler.compile_untuned`)
code-generates in pieces.

Why: LLVM's cost on one huge function is more than linear. ResNet-50
lowered as it is, one ``@main`` of about 300 loop nests, took 127 s to
code-generate at O3 and 98 s at O1 (2-core Zen 5), most of it in the call
graph's and the verifier's scans of that one function (``perf``:
``LazyCallGraph::visitReferences``, ``SmallPtrSet`` growth,
``Verifier::visitInstruction``), each pass over it seeing it whole again.
Cut into functions of 8 Linalg ops each (65 of them), the units split
(`passes.split`) and compile in parallel workers: 28 s of code generation
(31 s with 24 ops per function), the whole untuned build 144 -> 36 s.

:func:`outline_runs` cuts the body of every function with more than
`per_function` Linalg ops into runs of consecutive top-level ops holding
`per_function` Linalg ops each, and moves each run into a private
``func.func`` that takes the values the run uses from outside (its
operands, and those its regions capture) and returns the values used
after it; the run is replaced by a ``func.call``. Nothing else changes:
the ops, their order and their types are the same, so the outlined module
computes exactly what the original does.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import func

__all__ = ["outline_runs"]


def _is_linalg(op: ir.Operation) -> bool:
    return op.name.startswith("linalg.")


def _rematerialized(op: ir.Operation) -> bool:
    """A constant or an operand-free ``tensor.empty``: it stays where it is
    and each outlined function that reads it gets a copy of its own (no data
    is copied: the attribute is shared). Passed or returned across a call
    instead, a constant's buffer crashed ``buffer-results-to-out-params``
    (LLVM 22.1.8) on ResNet-50."""
    return op.name == "arith.constant" or (op.name == "tensor.empty" and len(op.operands) == 0)


def _op(x) -> ir.Operation:
    return getattr(x, "operation", x)


def _top_level(op, fn: ir.Operation) -> ir.Operation | None:
    """The ancestor of `op` (or `op`) directly in `fn`'s body; None when
    `op` is not inside `fn`."""
    op = _op(op)
    while True:
        parent = op.parent
        if parent is None:
            return None
        parent = _op(parent)
        if parent == fn:
            return op
        op = parent


def _defined_within(ops: list[ir.Operation]) -> set[ir.Value]:
    """Every value defined by `ops` or inside their regions (results and
    block arguments)."""
    values: set[ir.Value] = set()

    def visit(op: ir.Operation) -> ir.WalkResult:
        values.update(op.results)
        for region in op.regions:
            for block in region.blocks:
                values.update(block.arguments)
        return ir.WalkResult.ADVANCE

    for op in ops:
        op.walk(visit)
    return values


def _used_from_outside(ops: list[ir.Operation], inside: set[ir.Value]) -> list[ir.Value]:
    """The values `ops` (and their regions) read that are defined elsewhere,
    in first-use order."""
    seen: dict[ir.Value, None] = {}

    def visit(op: ir.Operation) -> ir.WalkResult:
        for v in op.operands:
            if v not in inside:
                seen.setdefault(v, None)
        return ir.WalkResult.ADVANCE

    for op in ops:
        op.walk(visit)
    return list(seen)


def outline_runs(module: ir.Module, per_function: int = 8) -> int:
    """Outline `module`'s functions in runs of `per_function` Linalg ops
    (see the module's docstring), in place; returns how many functions it
    made. The module's context must be current."""
    made = 0
    names = {ir.StringAttr(op.operation.attributes["sym_name"]).value for op in module.body.operations
             if "sym_name" in op.operation.attributes}
    for fn_view in list(module.body.operations):
        fn = fn_view.operation
        if fn.name != "func.func" or not fn.regions[0].blocks:
            continue
        block = fn.regions[0].blocks[0]
        ops = [op.operation for op in block.operations][:-1]  # the terminator stays
        if sum(_is_linalg(op) for op in ops) <= per_function:
            continue
        runs: list[list[ir.Operation]] = [[]]
        count = 0
        for op in ops:
            if _rematerialized(op):
                continue
            if count == per_function and _is_linalg(op):
                runs.append([])
                count = 0
            runs[-1].append(op)
            count += _is_linalg(op)
        fn_name = ir.StringAttr(fn.attributes["sym_name"]).value
        for run in runs:
            made += _outline(module, fn, run, fn_name, names)
    return made


def _outline(module: ir.Module, fn: ir.Operation, run: list[ir.Operation], fn_name: str, names: set[str]) -> int:
    inside = _defined_within(run)
    used = _used_from_outside(run, inside)
    copied = [v for v in used if isinstance(v.owner, ir.OpView | ir.Operation) and _rematerialized(_op(v.owner))]
    kept = set(copied)
    inputs = [v for v in used if v not in kept]
    run_set = set(run)
    outputs = [r for op in run for r in op.results
               if any(_top_level(u.owner, fn) not in run_set for u in r.uses)]
    k = 0
    while f"{fn_name}__part{k}" in names:
        k += 1
    name = f"{fn_name}__part{k}"
    names.add(name)
    loc = run[0].location
    with ir.InsertionPoint(module.body), loc:
        callee = func.FuncOp(name, ir.FunctionType.get([v.type for v in inputs], [v.type for v in outputs]),
                             visibility="private")
        entry = callee.add_entry_block()
    with ir.InsertionPoint(run[-1]), loc:
        # Placed before the run's last op, then that op moves out with the rest.
        call = func.CallOp([v.type for v in outputs], ir.FlatSymbolRefAttr.get(name), inputs)
    call.operation.move_after(run[-1])
    with ir.InsertionPoint(entry), loc:
        ret = func.ReturnOp(outputs)
    for op in run:
        op.move_before(ret.operation)
    callee_op = callee.operation
    with ir.InsertionPoint.at_block_begin(entry):
        copies = [_op(v.owner).clone() for v in copied]
    for v, c in zip(copied, copies):
        for use in list(v.uses):
            if _top_level(use.owner, callee_op) is not None:
                _op(use.owner).operands[use.operand_number] = c.results[0]
    for v, arg in zip(inputs, entry.arguments):
        for use in list(v.uses):
            if _top_level(use.owner, callee_op) is not None:
                _op(use.owner).operands[use.operand_number] = arg
    for v, res in zip(outputs, call.results):
        for use in list(v.uses):
            if _top_level(use.owner, callee_op) is None:
                _op(use.owner).operands[use.operand_number] = res
    return 1
