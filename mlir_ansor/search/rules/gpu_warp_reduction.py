"""``cuda-warp-reduction``: a row reduction (softmax's max and sum, layer
norm's mean and variance: one parallel loop, then one reduction loop) with
the lanes of a warp sharing each row.

Per block (``#gpu.block<x>``) R rows; the reduction loop split over T lanes
(``#gpu.thread<x>``) with ``tile_reduction_using_forall``: lane t reduces
its part of each row into an R x T partials buffer in shared memory, then
`passes/warp_reduce.py` combines the T partials of a row with
``shfl.sync.bfly`` butterflies (log2 T steps) instead of the serial merge.
Knobs: ``b_d0`` (R, rows per block) and ``lanes`` (T, lanes per row: 8,
16 or 32, a block of T threads; an alternatives knob, one region per T,
because ``tile_reduction_using_forall`` takes static thread counts). ``cuda-default`` reduces each row in one
thread; this rule is tried before it.

Not yet: more than a warp per row (a second, cross-warp step through
shared memory), reductions with fused consumers or more than one parallel
loop (those keep ``cuda-default``).
"""

from __future__ import annotations

from mlir_ansor.schedule.gpu_writer import GpuScheduleWriter
from mlir_ansor.schedule.writer import ANY
from mlir_ansor.search.gpu_sketch import GpuSketch, target_limits
from mlir_ansor.search.rules.base import Rule, RuleResult, SketchContext
from mlir_ansor.search.rules.gpu_base import is_cuda
from mlir_ansor.search.sketch import Sketch
from mlir_ansor.search.space import KnobSpec, divisors

LANES = (8, 16, 32)
"""Options of the lanes-per-row knob (a power of two up to the warp size)."""


class WarpReduction(Rule):
    name = "cuda-warp-reduction"

    def condition(self, ctx: SketchContext) -> RuleResult:
        a = ctx.anchor
        if not is_cuda(ctx) or a.iterator_types != ("parallel", "reduction") or a.num_inputs < 1:
            return RuleResult.SKIP
        if a.output_dims != (0,) or a.dtype not in ("f32", "f16"):
            return RuleResult.SKIP
        if any(o.op_id != a.op_id and o.name != "linalg.fill" for o in ctx.ops):
            return RuleResult.SKIP  # fused consumers or producers: cuda-default
        rows, n = a.loop_ranges
        if not any(n % t == 0 and n >= t for t in LANES):
            return RuleResult.SKIP
        return RuleResult.APPLY

    def apply(self, ctx: SketchContext) -> list[Sketch]:
        anchor, ops = ctx.anchor, ctx.ops
        rows, n = anchor.loop_ranges
        lanes = tuple(t for t in LANES if n % t == 0)
        specs = [
            KnobSpec("b_d0", tuple(x for x in divisors(rows) if x <= 8), doc="rows per block (#gpu.block<x>)"),
            KnobSpec("lanes", tuple(range(len(lanes))), alternatives=True,
                     doc="lanes per row (#gpu.thread<x>, shuffles): " + ", ".join(f"{i}: {t}" for i, t in enumerate(lanes))),
        ]
        w = GpuScheduleWriter()
        h = {sp.name: w.knob(sp.name, sp.options) for sp in specs if not sp.alternatives}
        _, forall = w.tile_forall_mapped(w.match_op_id("%root", anchor.op_id), [h["b_d0"], 0], ["#gpu.block<x>"])
        for o in ops:
            if o.op_id != anchor.op_id:
                _, forall = w.fuse_into(w.match_op_id("%root", o.op_id), forall)
        red = w.match_op_id(forall, anchor.op_id)

        def split(t: int):
            # num_threads takes static counts only: one region per option
            def region(wr: GpuScheduleWriter) -> list[str]:
                outs = [wr._fresh(s) for s in ("fill", "partial", "merge", "lanes")]
                wr.emit(f"{', '.join(outs)} = transform.structured.tile_reduction_using_forall {red} "
                        f"by num_threads = [0, {t}] tile_sizes = [0, 1] mapping = [#gpu.thread<x>] "
                        f": ({ANY}) -> ({ANY}, {ANY}, {ANY}, {ANY})")
                return [outs[3]]
            return region

        w.alternatives("lanes", [split(t) for t in lanes])
        w.apply_patterns(w.match_func("%root"), ["tensor.fold_tensor_empty", "canonicalization"])
        w.empty_tensors_to_allocations(forall)
        w.to_workgroup_memory(forall)
        w.gpu_bufferize("%root")
        return [GpuSketch(self.name, ctx.payload, w.text(), tuple(specs), **target_limits(ctx.target),
                          threads=(("x", "lanes"),), choices=(("lanes", lanes),), max_register_tile=1 << 30)]
