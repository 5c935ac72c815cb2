"""``cpu-default``: the sound default for any task on a CPU target: parallel
outer tiles over ``scf.forall`` with the whole task fused in, the rest
lowered as loops (LLVM may still vectorize them). Always applies on a CPU;
it is the fallback of every other CPU rule (`gpu_default` is the cuda one)."""

from __future__ import annotations

from mlir_ansor.schedule.writer import ScheduleWriter
from mlir_ansor.search.rules.base import Rule, RuleResult, SketchContext, finish, tile_root_and_fuse
from mlir_ansor.search.sketch import Sketch
from mlir_ansor.search.space import KnobSpec, divisors


class DefaultSchedule(Rule):
    name = "cpu-default"

    def condition(self, ctx: SketchContext) -> RuleResult:
        return RuleResult.APPLY if ctx.target.kind == "cpu" else RuleResult.SKIP

    def apply(self, ctx: SketchContext) -> list[Sketch]:
        root = ctx.root
        w = ScheduleWriter()
        specs: list[KnobSpec] = []
        sizes: list[int | str] = [0] * len(root.loop_ranges)
        for d in root.parallel:
            spec = KnobSpec(f"p_d{d}", divisors(root.loop_ranges[d]), doc=f"parallel tile of loop d{d}")
            specs.append(spec)
            sizes[d] = w.knob(spec.name, spec.options)
        if any(isinstance(s, str) for s in sizes):
            tile_root_and_fuse(w, ctx, sizes)
        finish(w, vectorize=False)
        forall = tuple((f"p_d{d}", root.loop_ranges[d]) for d in root.parallel)
        return [Sketch(self.name, ctx.payload, w.text(), tuple(specs), forall=forall)]
