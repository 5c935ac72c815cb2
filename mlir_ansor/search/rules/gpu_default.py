"""``cuda-default``: the sound default for any task on an NVIDIA target
(reductions, softmax pieces, elementwise ops, and whatever the other GPU
rules skip). Blocks (``#gpu.block``) and threads (``#gpu.thread``) over the
innermost parallel loops of the root, the rest of the task fused in;
reductions run serially in each thread. Always applies on a cuda target; it
is the fallback of every other GPU rule, as ``cpu-default`` is on a CPU."""

from __future__ import annotations

from mlir_ansor.errors import UnsupportedError
from mlir_ansor.schedule.gpu_writer import GpuScheduleWriter
from mlir_ansor.schedule.writer import Size
from mlir_ansor.search.gpu_sketch import GpuSketch, target_limits
from mlir_ansor.search.rules.base import Rule, RuleResult, SketchContext
from mlir_ansor.search.rules.gpu_base import (
    THREAD_COUNTS,
    axes_of,
    device_mapping,
    fuse_others,
    is_cuda,
    min_block_threads,
)
from mlir_ansor.search.sketch import Sketch
from mlir_ansor.search.space import KnobSpec, divisors


class GpuDefaultSchedule(Rule):
    name = "cuda-default"

    def condition(self, ctx: SketchContext) -> RuleResult:
        return RuleResult.APPLY if is_cuda(ctx) else RuleResult.SKIP

    def apply(self, ctx: SketchContext) -> list[Sketch]:
        ops, target = ctx.ops, ctx.target
        root = ctx.root
        ranges = root.loop_ranges
        par = [d for d in root.parallel if ranges[d] > 1][-3:]
        if not par:
            raise UnsupportedError(f"{root.name}: no parallel loop to map to GPU blocks")
        axes = axes_of(par)
        thread_dims = [d for d in par if axes[d] in ("x", "y")]
        specs: list[KnobSpec] = []
        for d in par:
            limit = {"x": 1024, "y": 64, "z": 8}[axes[d]]
            specs.append(
                KnobSpec(f"b_d{d}", tuple(x for x in divisors(ranges[d]) if x <= limit), doc=f"block tile of loop d{d}")
            )
        for d in thread_dims:
            opts = THREAD_COUNTS + ((64, 128, 256, 512, 1024) if axes[d] == "x" else ())
            specs.append(KnobSpec(f"t_d{d}", opts, divides=f"b_d{d}", doc=f"threads along loop d{d}"))
        w = GpuScheduleWriter()
        h = {sp.name: w.knob(sp.name, sp.options) for sp in specs}
        sizes: list[Size] = [0] * len(ranges)
        for d in par:
            sizes[d] = h[f"b_d{d}"]
        _, forall = w.tile_forall_mapped(
            w.match_op_id("%root", root.op_id), sizes, device_mapping(sizes, axes, "block")
        )
        forall = fuse_others(w, ops, root, forall)
        t_sizes: list[Size] = [0] * len(ranges)
        for d in thread_dims:
            t_sizes[d] = h[f"t_d{d}"]
        _, tforall = w.tile_forall_mapped(
            w.match_op_id(forall, root.op_id), t_sizes, device_mapping(t_sizes, axes, "thread"), num_threads=True
        )
        for o in reversed(ops):
            if o.op_id != root.op_id:
                _, tforall = w.fuse_into(w.match_op_id(forall, o.op_id), tforall)
        w.gpu_bufferize("%root")
        return [
            GpuSketch(
                self.name,
                ctx.payload,
                w.text(),
                tuple(specs),
                **target_limits(target),
                threads=tuple((axes[d], f"t_d{d}") for d in thread_dims),
                max_register_tile=256,
                min_threads=min_block_threads(ranges, thread_dims, target),
                register_tile=tuple((f"b_d{d}", f"t_d{d}") for d in thread_dims),
            )
        ]
