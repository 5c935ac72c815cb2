"""``cuda-mma``: tensor cores for an f16/f32 ``linalg.matmul`` (sm_80+) with
no fused consumers. Block tiles mapped to ``#gpu.block``, warp tiles mapped
to ``#gpu.warp``, the warp tile cut into 16x8xK pieces that
``transform.nvgpu.rewrite_matmul_as_mma_sync`` turns into ``mma.sync``
(f16, or tf32 for f32). The operands are read from global memory; the
staged rule (`gpu_staged_matmul`) is the one with shared memory."""

from __future__ import annotations

from mlir_ansor.schedule.gpu_writer import GpuScheduleWriter
from mlir_ansor.search.gpu_sketch import GpuSketch, target_limits
from mlir_ansor.search.rules.base import Rule, RuleResult, SketchContext
from mlir_ansor.search.rules.gpu_base import fuse_others, is_cuda
from mlir_ansor.search.sketch import Sketch
from mlir_ansor.search.space import KnobSpec, divisors


def _k_piece(dtype: str) -> int:
    """The K extent of one mma.sync piece (m16n8k16 for f16, m16n8k4 for tf32)."""
    return 16 if dtype == "f16" else 4


class TensorCoreMatmul(Rule):
    name = "cuda-mma"

    def condition(self, ctx: SketchContext) -> RuleResult:
        a = ctx.anchor
        if not is_cuda(ctx) or a.name != "linalg.matmul" or a.dtype not in ("f16", "f32") or ctx.target.arch < 80:
            return RuleResult.SKIP
        if any(t != a.dtype for t in a.input_dtypes):
            return RuleResult.SKIP  # mixed precision (f16 into f32): rewrite_matmul_as_mma_sync takes one type; cuda-mma-smem
        m, n, k = a.loop_ranges
        if m % 16 or n % 8 or k % _k_piece(a.dtype):
            return RuleResult.SKIP
        if any(o.op_id != a.op_id and o.name != "linalg.fill" for o in ctx.ops):
            return RuleResult.SKIP  # fused consumers: the contraction rule handles them
        return RuleResult.APPLY

    def apply(self, ctx: SketchContext) -> list[Sketch]:
        anchor, ops = ctx.anchor, ctx.ops
        m, n, k = anchor.loop_ranges
        kmma = _k_piece(anchor.dtype)
        specs = [
            KnobSpec("b_d0", tuple(x for x in divisors(m) if x % 16 == 0 and x <= 256),
                     doc="block tile of M (#gpu.block<y>)"),
            KnobSpec("b_d1", tuple(x for x in divisors(n) if x % 8 == 0 and x <= 256),
                     doc="block tile of N (#gpu.block<x>)"),
            KnobSpec("w_d0", tuple(x for x in (16, 32, 64, 128) if m % x == 0), divides="b_d0",
                     doc="warp tile of M (#gpu.warp<y>)"),
            KnobSpec("w_d1", tuple(x for x in (8, 16, 32, 64, 128) if n % x == 0), divides="b_d1",
                     doc="warp tile of N (#gpu.warp<x>)"),
            KnobSpec("k_d2", tuple(x for x in divisors(k) if x % kmma == 0 and x <= 128), doc="reduction tile of K"),
        ]
        w = GpuScheduleWriter()
        h = {sp.name: w.knob(sp.name, sp.options) for sp in specs}
        _, forall = w.tile_forall_mapped(
            w.match_op_id("%root", anchor.op_id), [h["b_d0"], h["b_d1"]], ["#gpu.block<y>", "#gpu.block<x>"]
        )
        forall = fuse_others(w, ops, anchor, forall)
        a_h = w.match_op_id(forall, anchor.op_id)
        a_h, _ = w.tile_for(a_h, [0, 0, h["k_d2"]])
        a_h, _ = w.tile_forall_mapped(a_h, [h["w_d0"], h["w_d1"]], ["#gpu.warp<y>", "#gpu.warp<x>"])
        for o in ops:
            if o.op_id != anchor.op_id:
                w.tile_forall_mapped(
                    w.match_op_id(forall, o.op_id), [h["w_d0"], h["w_d1"]], ["#gpu.warp<y>", "#gpu.warp<x>"]
                )
        w.tile_for(a_h, [16, 8, kmma])
        buf = w.gpu_bufferize("%root")
        w.mma_sync(w.match_func(buf))
        return [
            GpuSketch(
                self.name,
                ctx.payload,
                w.text(),
                tuple(specs),
                **target_limits(ctx.target),
                warps=(("b_d0", "w_d0"), ("b_d1", "w_d1")),
            )
        ]
