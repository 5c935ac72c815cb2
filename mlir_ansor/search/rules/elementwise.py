"""Elementwise tasks (no reduction loop): tiled over threads and vectorized.

The root's loops are tiled with ``scf.forall`` (``p_d<i>``), every op of the
task fused in; inside, each op is tiled to a register tile of ``r_d<i>``
vector lanes along the output's contiguous dimension (and ``r_d<j>`` rows of
the next one), then vectorized. Maps that transpose or broadcast become
vector transfers with permutation maps, lowered to shuffles.
"""

from __future__ import annotations

from mlir_ansor.schedule.writer import ScheduleWriter
from mlir_ansor.search.rules.base import (
    Rule,
    RuleResult,
    SketchContext,
    finish,
    reads_vector_dim_transposed,
    tile_root_and_fuse,
    vector_tile_options,
)
from mlir_ansor.search.sketch import Sketch
from mlir_ansor.search.space import KnobSpec, divisors

ROWS = (1, 2, 3, 4, 6, 8)


class ElementwiseVectorize(Rule):
    name = "cpu-elementwise"

    def condition(self, ctx: SketchContext) -> RuleResult:
        if ctx.target.kind != "cpu":
            return RuleResult.SKIP  # the GPU rules' (rules/gpu_*.py)
        ok = all(o.is_elementwise for o in ctx.ops) and all(d is not None for d in ctx.root.output_dims)
        if ok and _reads_across_vector_loop(ctx):
            # Transposes: vectorized, their permuted transfers sent the vector
            # canonicalization patterns into endless loops with these MLIR
            # wheels (a 1x8x8x8 [0, 3, 1, 2] transpose never finished at any
            # tile; one worker grew past 16 GB). The default schedule's loops
            # build in 0.4 s.
            return RuleResult.SKIP
        return RuleResult.APPLY_AND_SKIP_REST if ok else RuleResult.SKIP

    def apply(self, ctx: SketchContext) -> list[Sketch]:
        root = ctx.root
        ranges = root.loop_ranges
        out = [d for d in root.output_dims if d is not None]
        vec = out[-1]
        row = out[-2] if len(out) >= 2 else None
        specs = [KnobSpec(f"r_d{vec}", vector_tile_options(ranges[vec], ctx.lanes()), doc=f"vector tile of loop d{vec}")]
        if row is not None:
            specs.append(KnobSpec(f"r_d{row}", tuple(x for x in ROWS if ranges[row] % x == 0), doc=f"rows of loop d{row}"))
        for d in root.parallel:
            base = f"r_d{d}" if d in (vec, row) else None
            specs.append(KnobSpec(f"p_d{d}", divisors(ranges[d]), multiple_of=base, doc=f"parallel (scf.forall) tile of loop d{d}"))
        w = ScheduleWriter()
        h = {sp.name: w.knob(sp.name, sp.options) for sp in specs}
        forall = tile_root_and_fuse(w, ctx, [h[f"p_d{d}"] for d in range(len(ranges))])
        reg = [h.get(f"r_d{d}", 1) for d in range(len(ranges))]
        # Every op of the task, tiled like the root's output dimensions.
        for o in ctx.ops:
            sizes: list[int | str] = [0] * len(o.loop_ranges)
            for r_d, o_d in zip(root.output_dims, o.output_dims):
                if r_d is not None and o_d is not None:
                    sizes[o_d] = reg[r_d]
            if any(s != 0 for s in sizes):
                # each: a producer read twice by its consumer (x * x) is fused in twice
                w.tile_each(w.match_op_id(forall, o.op_id), sizes)
        finish(w, vectorize=True)
        # Default: two vectors per step, one row.
        prefer = ((f"r_d{vec}", 2 * ctx.lanes()),) + (((f"r_d{row}", 1),) if row is not None else ())
        forall = tuple((f"p_d{d}", ranges[d]) for d in root.parallel)
        return [Sketch(self.name, ctx.payload, w.text(), tuple(specs), forall=forall, prefer=prefer)]


def _reads_across_vector_loop(ctx: SketchContext) -> bool:
    """Whether some op of the task reads an input along the root's vector
    loop in a dimension other than the input's contiguous one."""
    out = [d for d in ctx.root.output_dims if d is not None]
    return bool(out) and any(reads_vector_dim_transposed(o, out[-1]) for o in ctx.ops)
