"""Row-wise chains of reductions (softmax, layer norm) as one task.

The partitioner joins a softmax (scale, maximum, exp, sum, divide) or a
layer norm (mean, centred square, variance, normalize) into one task when
its ops share leading row loops (`graph.task._merge_rows`). This rule
computes such a task block of rows by block of rows: ``scf.forall`` over
the row loops (``p_d<i>``: rows per thread tile), every op fused into it,
and inside, each op one row at a time (``scf.for``): a reduction along the
row accumulates partial results two vectors wide (rfactor) and combines
them once, an elementwise op steps two vectors at a time. Each op writes a
block of rows, in cache, instead of a whole tensor in memory.

BERT's attention softmax at 12x384x384 (1 thread, Zen 4, caches flushed):
five tasks 1.93 ms (64 trials), one task 1.59 ms (16 trials); holding a
whole row as one vector value instead spilled exp's polynomial (1.98 ms).
"""

from __future__ import annotations

import math

from mlir import ir

from mlir_ansor.graph.task import row_rank
from mlir_ansor.ir.rewrite import one_per_use
from mlir_ansor.schedule.writer import ScheduleWriter
from mlir_ansor.search.rules.base import Rule, RuleResult, SketchContext, finish, tile_root_and_fuse
from mlir_ansor.search.sketch import OpStructure, Sketch, nearest_option
from mlir_ansor.search.space import KnobSpec, divisors

LONGEST_ROW = 4096
"""Rows longer than this (elements) are left to the per-op rules: each op
of the task keeps at least one row in a buffer of its own (16 KB at 4096
f32), and longer rows leave the L1 cache the rule is made for."""


def row_loops(ops: tuple[OpStructure, ...]) -> int:
    """How many leading loops every op of `ops` computes row by row
    (`graph.task.row_rank`, the partitioner's rows), with extents that
    agree across the ops."""
    p = min(row_rank(o.iterator_types, o.operand_dims, o.num_inputs) for o in ops)
    first = ops[0].loop_ranges
    while p and any(o.loop_ranges[:p] != first[:p] for o in ops):
        p -= 1
    return p


class RowFused(Rule):
    name = "cpu-row-fused"

    def condition(self, ctx: SketchContext) -> RuleResult:
        if ctx.target.kind != "cpu":
            return RuleResult.SKIP
        compute = [o for o in ctx.ops if o.name != "linalg.fill"]
        if sum(1 for o in compute if o.reductions) < 2 or any(o.compound_dims for o in compute):
            return RuleResult.SKIP
        p = row_loops(tuple(compute))
        if p == 0:
            return RuleResult.SKIP
        row = max(math.prod(o.loop_ranges[p:]) for o in compute)
        if row > LONGEST_ROW:
            return RuleResult.SKIP
        return RuleResult.APPLY_AND_SKIP_REST

    def apply(self, ctx: SketchContext) -> list[Sketch]:
        compute = tuple(o for o in ctx.ops if o.name != "linalg.fill")
        p = row_loops(compute)
        root = ctx.root
        ranges = root.loop_ranges
        lanes = ctx.lanes()
        specs: list[KnobSpec] = []
        for d in range(p):
            specs.append(KnobSpec(f"p_d{d}", divisors(ranges[d]), doc=f"parallel (scf.forall) tile of row loop d{d}"))
        w = ScheduleWriter()
        h = {sp.name: w.knob(sp.name, sp.options) for sp in specs}
        forall = tile_root_and_fuse(w, ctx, [h[f"p_d{d}"] if d < p else 0 for d in range(len(ranges))])
        row_steps(w, forall, compute, p, lanes)
        finish(w, vectorize=True, reduction="innerreduction")
        inner = p - 1
        prefer = tuple((f"p_d{d}", 1 if d < inner else nearest_option(divisors(ranges[d]), 8)) for d in range(p))
        forall_dims = tuple((f"p_d{d}", ranges[d]) for d in range(p))
        payload = own_inits(ctx.payload)
        return [Sketch(self.name, payload, w.text(), tuple(specs), forall=forall_dims, prefer=prefer)]


def row_steps(w: ScheduleWriter, forall: str, ops: tuple[OpStructure, ...], p: int, lanes: int) -> None:
    """Tile each op of `ops` inside `forall` one row (of its first `p`
    loops) at a time: an elementwise op in register-sized steps along the
    row (a whole row as one vector value spilled most of exp's polynomial),
    a reduction along the row's last loop in partial results two vectors
    wide, combined once (rfactor; a knob would need
    `transform.tune.alternatives`: the width of tile_reduction_using_for is
    an attribute)."""
    extents = {o.loop_ranges[-1] for o in ops if o.reductions == (len(o.loop_ranges) - 1,)}
    widths = tuple(x for x in (lanes, 2 * lanes, 4 * lanes) if all(e % x == 0 for e in extents))
    width = nearest_option(widths, 2 * lanes) if extents and widths else 0
    for o in ops:
        n = len(o.loop_ranges)
        t = w.match_op_id(forall, o.op_id)
        sizes = [1] * p + [0] * (n - p)
        if not o.reductions and n > p:
            sizes = [1] * (n - 1) + [_step(o.loop_ranges[-1], lanes)]
        if any(s == 1 and o.loop_ranges[d] > 1 or s > 1 for d, s in enumerate(sizes)):
            t = w.tile_for(t, sizes)[0]
        if width and o.reductions == (n - 1,) and n - 1 >= p:
            w.tile_reduction(t, [0] * (n - 1) + [width])


def own_inits(payload: str) -> str:
    """`payload` with a ``tensor.empty`` of its own for each op that writes
    into one: torch-mlir shares one empty tensor among a softmax's ops, and
    once they are fused into the row loop, each op's block of rows is a
    slice of the task's output, which bufferization copied into a fresh
    buffer before every op (values never read)."""
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(payload)
        return str(module) if one_per_use(module.operation, "tensor.empty") else payload


def _step(extent: int, lanes: int) -> int:
    """Two vectors, one, or the whole extent, whichever divides it first."""
    for x in (2 * lanes, lanes):
        if extent % x == 0:
            return x
    return extent
