"""Reductions that are not multiply-accumulates (sums, maxima, norms, the
pieces of softmax and layer norm).

``scf.forall`` over the parallel loops (``p_d<i>``); inside, a register tile
of ``r_d<i>`` rows of the output and ``v_d<j>`` lanes of the contiguous
input dimension, vectorized: a reduction along the contiguous dimension
becomes a `vector.multi_reduction` whose accumulator stays in registers
across the reduction loop; a reduction across rows vectorizes the parallel
dimension instead.

As a `transform.tune.alternatives` choice, *rfactor*: the reduction is first
split into `v` partial results (`tile_reduction_using_for`), reduced
elementwise in vector registers and combined once at the end (Ansor's
rfactor), which avoids a horizontal reduction per step.
"""

from __future__ import annotations

from ...dialects.schedule import ScheduleWriter
from ..sketch import Sketch
from ..space import KnobSpec, divisors
from .base import (
    Rule,
    RuleResult,
    SketchContext,
    finish,
    root_sizes_from_anchor,
    tile_others_like,
    tile_root_and_fuse,
    vector_tile_options,
)

ROWS = (1, 2, 4, 8)


class ReductionVectorize(Rule):
    name = "cpu-reduction"

    def condition(self, ctx: SketchContext) -> RuleResult:
        a = ctx.anchor
        if not a.reductions or a.compound_dims or a.is_mul_add:
            return RuleResult.SKIP
        if any(d is None for d in a.output_dims) or not a.operand_dims or None in a.operand_dims[0]:
            return RuleResult.SKIP
        return RuleResult.APPLY

    def apply(self, ctx: SketchContext) -> list[Sketch]:
        a = ctx.anchor
        ranges = a.loop_ranges
        lanes = ctx.lanes()
        contiguous = a.operand_dims[0][-1]
        out = [d for d in a.output_dims if d is not None]
        row = out[-1] if out else None
        specs: list[KnobSpec] = [
            KnobSpec(f"v_d{contiguous}", vector_tile_options(ranges[contiguous], lanes), doc=f"vector lanes of loop d{contiguous}")
        ]
        if row is not None and row != contiguous:
            specs.append(KnobSpec(f"r_d{row}", tuple(x for x in ROWS if ranges[row] % x == 0), doc=f"register rows of loop d{row}"))
        reg = {sp.name for sp in specs}
        for d in a.parallel:
            base = f"r_d{d}" if f"r_d{d}" in reg else f"v_d{d}" if f"v_d{d}" in reg else None
            specs.append(KnobSpec(f"p_d{d}", divisors(ranges[d]), multiple_of=base, doc=f"parallel (scf.forall) tile of loop d{d}"))
        w = ScheduleWriter()
        h = {sp.name: w.knob(sp.name, sp.options) for sp in specs}
        forall = tile_root_and_fuse(w, ctx, root_sizes_from_anchor(ctx, {d: h[f"p_d{d}"] for d in a.parallel}))
        sizes: list[int | str] = [0] * len(ranges)
        for d in range(len(ranges)):
            if f"r_d{d}" in h:
                sizes[d] = h[f"r_d{d}"]
            elif f"v_d{d}" in h:
                sizes[d] = h[f"v_d{d}"]
            else:
                sizes[d] = 1
        a_h, _ = w.tile_for(w.match_op_id(forall, a.op_id), sizes)
        tile_others_like(w, ctx, forall, [sizes[d] if d in a.parallel else 0 for d in range(len(ranges))], skip={a.op_id})
        finish(w, vectorize=True)
        return [Sketch(self.name, ctx.payload, w.text(), tuple(specs), forall=tuple((f"p_d{d}", ranges[d]) for d in a.parallel))]
