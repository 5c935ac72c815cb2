"""Constant folding: the Linalg ops that compute from constants only.

Weight transposes, batch-norm factors and the like are no tasks (the
partitioner leaves them out, `graph.task.constant_linalg_ops`), and their
results are the same on every call, so computing them per call is wasted
time (six transposes of BERT's weights are about 40 MB of memory traffic per
call). :func:`fold_constants` gathers them into one function, has the caller
evaluate it once, and puts the results in the module as dense constants.

Evaluating needs a compiler, which sits above this layer: the caller passes
one in (`compiler` evaluates it with the untuned lowering, in a worker).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import numpy as np
from mlir import ir, passmanager

from mlir_ansor.graph.task import constant_linalg_ops
from mlir_ansor.ir.dtypes import element_bytes
from mlir_ansor.ir.program import Program
from mlir_ansor.ir.rewrite import backward_slice, clone_remapped
from mlir_ansor.ir.types import sub_byte_elements

__all__ = ["FOLD_ENTRY", "Evaluate", "fold_constants"]

log = logging.getLogger("mlir_ansor")

FOLD_ENTRY = "__ansor_fold"
"""The name of the function holding a function's constant-only ops."""

LARGE_BYTES = 64 << 20
"""A value computed from constants is not folded when it is larger than
this and more than :data:`GROWTH` times the constants it reads: a broadcast,
which would hold a copy of its input per row (ONNX's ``MatMul`` of a 3-D
input by a weight broadcasts the weight to 197 copies, 1.4 GB per layer of
ViT-B/16, before `normalize` turned those into matmuls). Its ops then run
on each call."""
GROWTH = 4

Evaluate = Callable[[ir.Module, str], tuple[np.ndarray, ...]]
"""``evaluate(module, entry)``: run function `entry` of `module` (on tensors,
no arguments) once and return its results as arrays, in order."""


def fold_constants(program: Program, evaluate: Evaluate) -> int:
    """Evaluate, once, the Linalg ops of each function of `program` that
    compute from constants only, and replace their results that the rest of
    the function reads with dense constants; returns how many values were
    folded. `evaluate` runs the gathered module (see :data:`Evaluate`)."""
    from mlir.dialects import arith as arith_d
    from mlir.dialects import func as func_d

    folded = 0
    for fn in [o.operation for o in program.module.body.operations if o.operation.name == "func.func"]:
        if not fn.regions[0].blocks:
            continue
        block = fn.regions[0].blocks[0]
        consts = constant_linalg_ops(block)
        if not consts:
            continue
        const_set = set(consts)
        frontier: list[ir.Value] = []
        for op in consts:
            for r in op.results:
                if sub_byte_elements(r.type):
                    # Masks stay ops of the driver (lowered as loops, stored
                    # as bytes): a fold function returning i1 buffers would
                    # store i1, which the wheels' LLVM lowering aborts on.
                    continue
                if any(u.owner.operation not in const_set for u in r.uses):
                    frontier.append(r)
        frontier = [v for v in frontier if not _grows(block, v, fn)]
        if not frontier:
            continue
        # The ops the frontier depends on, in program order.
        order = {opview.operation: k for k, opview in enumerate(block.operations)}
        needed = {x for x in backward_slice(block, frontier) if isinstance(x, ir.Operation)}
        with program.context, ir.Location.unknown():
            fold = ir.Module.create()
            with ir.InsertionPoint(fold.body):
                f = func_d.FuncOp(FOLD_ENTRY, ([], [v.type for v in frontier]))
            body = f.add_entry_block()
            mapping: dict[ir.Value, ir.Value] = {}
            # Sorted once, here: replacing an op's operands below changes its
            # hash with these bindings, and it would no longer be found in
            # `order` (ops whose operand became a folded constant).
            ordered = sorted(needed, key=order.__getitem__)
            with ir.InsertionPoint(body):
                for op in ordered:
                    clone_remapped(op, mapping)
                func_d.ReturnOp([mapping[v] for v in frontier])
            values = evaluate(fold, FOLD_ENTRY)
        with program.context, ir.Location.unknown():
            for v, arr in zip(frontier, values):
                with ir.InsertionPoint(v.owner):
                    attr = ir.DenseElementsAttr.get(np.ascontiguousarray(arr), type=ir.ShapedType(v.type).element_type)
                    c = arith_d.ConstantOp(v.type, attr)
                v.replace_all_uses_with(c.result)
                folded += 1
            # canonicalize keeps a dead op whose body asserts (cf.assert), so
            # erase the now unused ones here.
            for op in reversed(ordered):
                if not any(True for r in op.results for _ in r.uses):
                    op.erase()
        log.info("compile: @%s: %d value(s) computed from constants only, folded at compile time",
                 ir.StringAttr(fn.attributes["sym_name"]).value, len(frontier))
    if folded:
        passmanager.PassManager.parse("builtin.module(canonicalize,cse)", program.context).run(program.module.operation)
    return folded


def _bytes(t: ir.Type) -> int:
    st = ir.ShapedType(t)
    return math.prod(st.shape) * element_bytes(str(st.element_type), 8) if st.has_static_shape else 0


def _grows(block: ir.Block, v: ir.Value, fn: ir.Operation) -> bool:
    """Whether folding `v` would make a constant larger than
    :data:`LARGE_BYTES` and :data:`GROWTH` times the constants it reads
    (logged: it is computed on each call instead)."""
    size = _bytes(v.type)
    if size <= LARGE_BYTES:
        return False
    read = sum(_bytes(x.results[0].type) for x in backward_slice(block, [v])
               if isinstance(x, ir.Operation) and x.name == "arith.constant"
               and isinstance(x.results[0].type, ir.RankedTensorType))
    if size <= GROWTH * read:
        return False
    log.warning("compile: @%s: a value of %.1f MB computed from %.1f MB of constants (%s) is computed on each call, "
                "not folded into a constant", ir.StringAttr(fn.attributes["sym_name"]).value, size / 2**20, read / 2**20,
                v.owner.operation.name if isinstance(v, ir.OpResult) else "?")
    return True
