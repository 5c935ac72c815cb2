"""``cuda-contraction``: the matmul family and convolutions (read from the
op's structure: a reduction, every output dimension a loop, two or more
inputs), with fused consumers.

Four levels: block tiles (``#gpu.block``) over the root with the rest of the
task fused in; a reduction (cache) tile of the innermost reduction loop; an
alternative ``smem`` that copies the input tiles into shared memory
(cooperatively, by all threads of the block) or reads them in place; and
threads (``#gpu.thread``), each computing a register tile.
"""

from __future__ import annotations

from mlir_ansor.ir.dtypes import element_bytes
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
    operand_dtypes,
)
from mlir_ansor.search.sketch import OpStructure, Sketch
from mlir_ansor.search.space import KnobSpec, divisors


def _is_contraction(op: OpStructure) -> bool:
    out = op.output_dims
    return (
        bool(op.reductions)
        and all(d is not None for d in out)
        and "pooling" not in op.name
        and op.num_inputs >= 2
    )


def _parallel_and_reduction(op: OpStructure) -> tuple[list[int], list[int]]:
    """The op's parallel and reduction loops of more than one iteration."""
    ranges = op.loop_ranges
    return [d for d in op.parallel if ranges[d] > 1], [d for d in op.reductions if ranges[d] > 1]


def _sizes_for(o: OpStructure, anchor: OpStructure, per_anchor_dim: dict[int, Size]) -> list[Size]:
    """Tile sizes for op `o` that follow the anchor's output tiling."""
    sizes: list[Size] = [0] * len(o.loop_ranges)
    for a_d, o_d in zip(anchor.output_dims, o.output_dims):
        if a_d is not None and o_d is not None and a_d in per_anchor_dim:
            sizes[o_d] = per_anchor_dim[a_d]
    return sizes


def _operand_tile_terms(op: OpStructure, operand: int, tile: dict[int, str]) -> tuple[tuple[str, ...], ...]:
    """Per dimension of `operand`, the tile-extent terms (see `GpuSketch.smem_tiles`)."""
    compound = list(op.compound_dims)
    index = 0
    for i in range(operand):
        index += sum(1 for d in op.operand_dims[i] if d is None)
    dims = []
    for d in op.operand_dims[operand]:
        if d is not None:
            dims.append((tile.get(d, str(op.loop_ranges[d])),))
        else:
            loops = compound[index] if index < len(compound) else ()
            index += 1
            dims.append(tuple(tile.get(l_, str(op.loop_ranges[l_])) for l_ in loops) or ("1",))
    return tuple(dims)


class GpuContraction(Rule):
    name = "cuda-contraction"

    def condition(self, ctx: SketchContext) -> RuleResult:
        if not is_cuda(ctx) or not _is_contraction(ctx.anchor):
            return RuleResult.SKIP
        par, reds = _parallel_and_reduction(ctx.anchor)
        return RuleResult.APPLY if par and len(par) <= 3 and reds else RuleResult.SKIP

    def apply(self, ctx: SketchContext) -> list[Sketch]:
        anchor, ops, target = ctx.anchor, ctx.ops, ctx.target
        ranges = anchor.loop_ranges
        par, reds = _parallel_and_reduction(anchor)
        kr = reds[-1]
        axes = axes_of(par)
        thread_dims = [d for d in par if axes[d] in ("x", "y")]

        specs: list[KnobSpec] = []
        for d in par:
            limit = 256 if axes[d] in ("x", "y") else 4
            opts = tuple(x for x in divisors(ranges[d]) if x <= limit)
            specs.append(KnobSpec(f"b_d{d}", opts, doc=f"block tile of loop d{d} (#gpu.block<{axes[d]}>)"))
        for d in thread_dims:
            specs.append(
                KnobSpec(f"t_d{d}", THREAD_COUNTS, divides=f"b_d{d}",
                         doc=f"threads along loop d{d} (#gpu.thread<{axes[d]}>)")
            )
        specs.append(
            KnobSpec(f"k_d{kr}", tuple(x for x in divisors(ranges[kr]) if x <= 64), doc=f"reduction tile of loop d{kr}")
        )
        inputs = [i for i in range(anchor.num_inputs) if len(anchor.operand_dims[i]) >= 1]
        specs.append(
            KnobSpec("smem", (0, 1), alternatives=True,
                     doc="0: copy the input tiles to shared memory; 1: read them from global memory")
        )

        w = GpuScheduleWriter()
        h = {sp.name: w.knob(sp.name, sp.options) for sp in specs if not sp.alternatives}
        root = ctx.root

        # Level 1: blocks, over the root, with the rest of the task fused in.
        block = {d: h[f"b_d{d}"] for d in par}
        root_sizes = _sizes_for(root, anchor, block)
        root_axes = {o_d: axes[a_d] for a_d, o_d in zip(anchor.output_dims, root.output_dims) if a_d in axes}
        _, forall = w.tile_forall_mapped(
            w.match_op_id("%root", root.op_id), root_sizes, device_mapping(root_sizes, root_axes, "block")
        )
        forall = fuse_others(w, ops, root, forall)

        # Level 2: the reduction (cache) tile of the innermost reduction loop.
        a_h = w.match_op_id(forall, anchor.op_id)
        k_sizes: list[Size] = [0] * len(ranges)
        k_sizes[kr] = h[f"k_d{kr}"]
        a_h, _ = w.tile_for(a_h, k_sizes)

        threads = {d: h[f"t_d{d}"] for d in thread_dims}
        thread_axes = {d: axes[d] for d in thread_dims}

        # Level 3 (structural): the input tiles in shared memory, copied by all
        # threads of the block, or read in place.
        def in_place(wr: GpuScheduleWriter) -> list[str]:
            return [a_h]

        # Copies are distributed over the last two dimensions of each tile,
        # with the thread counts of the compute level (same block shape).
        def promote_real(wr: GpuScheduleWriter) -> list[str]:
            padded, copies = wr.promote_inputs(a_h, inputs, len(anchor.operand_dims), operand_dtypes(anchor))
            for i, c in zip(inputs, copies):
                rank = len(anchor.operand_dims[i])
                counts: list[Size] = [0] * rank
                ts = [threads[d] for d in sorted(thread_dims)]  # y (outer) then x
                tail = ts[-rank:] if rank < len(ts) else ts
                for j, t in enumerate(tail):
                    counts[rank - len(tail) + j] = t
                cmap = [f"#gpu.thread<{a}>" for a in ("y", "x")[2 - len(tail):]]
                wr.tile_forall_mapped(c, counts, cmap, num_threads=True)
            wr.to_workgroup_memory(forall)
            return [padded]

        (a_h,) = w.alternatives("smem", [promote_real, in_place])

        # Level 4: threads, each computing a register tile.
        t_sizes: list[Size] = [0] * len(ranges)
        for d in thread_dims:
            t_sizes[d] = threads[d]
        w.tile_forall_mapped(a_h, t_sizes, device_mapping(t_sizes, thread_axes, "thread"), num_threads=True)
        for o in ops:
            if o.op_id == anchor.op_id:
                continue
            sizes = _sizes_for(o, anchor, threads)
            o_axes = {
                o_d: axes[a_d]
                for a_d, o_d in zip(anchor.output_dims, o.output_dims)
                if a_d in thread_axes and o_d is not None
            }
            if any(not (isinstance(s, int) and s == 0) for s in sizes):
                w.tile_forall_mapped(
                    w.match_op_id(forall, o.op_id), sizes, device_mapping(sizes, o_axes, "thread"), num_threads=True
                )
        w.gpu_bufferize("%root")

        tile_terms = {d: f"b_d{d}" for d in par}
        tile_terms[kr] = f"k_d{kr}"
        dtypes = operand_dtypes(anchor)
        smem_tiles = tuple((element_bytes(dtypes[i]), _operand_tile_terms(anchor, i, tile_terms)) for i in inputs)
        return [
            GpuSketch(
                self.name,
                ctx.payload,
                w.text(),
                tuple(specs),
                **target_limits(target),
                threads=tuple((axes[d], f"t_d{d}") for d in thread_dims),
                register_tile=tuple((f"b_d{d}", f"t_d{d}") for d in thread_dims),
                smem_tiles=smem_tiles,
                smem_knob="smem",
                min_threads=min_block_threads(ranges, thread_dims, target),
            )
        ]
