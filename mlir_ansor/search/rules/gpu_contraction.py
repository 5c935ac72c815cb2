"""``cuda-contraction``: the matmul family and convolutions (read from the
op's structure: a reduction, every output dimension a loop, two or more
inputs), with fused consumers.

Four levels: block tiles (``#gpu.block``) over the root with the rest of the
task fused in; a reduction (cache) tile of the innermost reduction loop; an
alternative ``smem`` that copies the input tiles into shared memory
(cooperatively, by all threads of the block) or reads them in place; and
threads (``#gpu.thread``), each computing a register tile.

For a plain 2-D NHWC/HWCF convolution with unit strides and dilations (no
fused consumers; f32 or f16) the rule first makes ``cuda-conv-smem``, the
conv as a GEMM over shared-memory tiles, with cp.async stages as a knob:

  * per block (``#gpu.block<z, y, x>``) a tile of b_d1 output rows x b_d2
    output columns x b_d3 filters;
  * one K loop over (kh, kw, c / k_d6): the filter taps are tiled by 1 and
    the three loops coalesced (``transform.loop.coalesce``), so a K step
    reads one tap's 1 x b_d1 x b_d2 x k_d6 input window (with unit strides
    that is the output tile's own shape: no halo) and its k_d6 x b_d3
    filter slice, both copied to `.shared` by all threads of the block in
    16-byte pieces (``cp_i``, ``cp_f``: derived rows per piece);
  * per thread (``#gpu.thread<z, y, x>``) one output row (b_d1 threads
    along z: `decompose` needs a unit row to make the tap a 1-D conv, which
    vectorizes to a contraction) x b_d2 / t_d2 columns x b_d3 / t_d3
    filters in registers (hoisted out of the K loop by `passes/nvvm.py`);
  * ``stages``: 1 copies synchronously; S = 2 or 3 multi-buffers both tiles
    and copies with ``cp.async`` S - 1 K steps ahead
    (`passes/async_copies.py`). `GpuSketch.smem_bytes` counts S x the
    tiles; `GpuSketch.violation` excludes S > 1 where a copy does not give
    every thread exactly one piece (the predicated copy's ``scf.if`` is an
    op with a region, which the nvgpu pipeliner refuses) or the K loop has
    fewer than S steps.
"""

from __future__ import annotations

import re

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
        staged = staged_conv_sketch(ctx)
        return ([staged] if staged is not None else []) + self._contraction(ctx)

    def _contraction(self, ctx: SketchContext) -> list[Sketch]:
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


#: Options of the staged conv's ``stages`` knob (as `gpu_staged_matmul.STAGES`).
CONV_STAGES = (1, 2, 3)


def _is_staged_conv(op: OpStructure) -> bool:
    """A 2-D NHWC/HWCF convolution with unit strides and dilations (the
    input window of an output tile is then the tile itself once the filter
    loops are tiled by 1)."""
    return (
        op.name == "linalg.conv_2d_nhwc_hwcf"
        and op.operand_dims == ((0, None, None, 6), (4, 5, 6, 3), (0, 1, 2, 3))
        and op.compound_dims == ((1, 4), (2, 5))
        and op.num_inputs == 2
        and op.is_mul_add
    )


def _unit_windows(payload: str) -> bool:
    """Whether every conv of the task has unit strides and dilations."""
    attrs = re.findall(r"(strides|dilations) = dense<([^>]*)>", payload)
    return bool(attrs) and all(v.strip() == "1" for _, v in attrs)


def staged_conv_sketch(ctx: SketchContext) -> GpuSketch | None:
    """``cuda-conv-smem``: the conv as a GEMM over shared-memory tiles (see
    the module docstring); None where the op or its sizes do not fit (a
    batch above 1, channels or filters not a multiple of a 16-byte vector)."""
    anchor, ops, target = ctx.anchor, ctx.ops, ctx.target
    if not _is_staged_conv(anchor) or anchor.dtype not in ("f16", "f32"):
        return None
    if set(operand_dtypes(anchor)) != {anchor.dtype}:
        return None
    if any(o.op_id != anchor.op_id and o.name != "linalg.fill" for o in ops):
        return None  # fused consumers: the plain contraction sketch takes them
    if not _unit_windows(ctx.payload):
        return None
    n, oh, ow, f, kh, kw, c = anchor.loop_ranges
    nbytes = element_bytes(anchor.dtype)
    vw = 16 // nbytes
    if n != 1 or c % vw or f % vw:
        return None
    specs = [
        KnobSpec("b_d1", tuple(x for x in divisors(oh) if x <= 8), doc="block tile of OH (#gpu.block<z>; one "
                 "thread row each: #gpu.thread<z>)"),
        KnobSpec("b_d2", tuple(x for x in divisors(ow) if x <= 64), doc="block tile of OW (#gpu.block<y>)"),
        KnobSpec("b_d3", tuple(x for x in divisors(f) if x % vw == 0 and x <= 128), doc="block tile of F "
                 "(#gpu.block<x>)"),
        KnobSpec("t_d2", THREAD_COUNTS, divides="b_d2", doc="threads along OW (#gpu.thread<y>)"),
        KnobSpec("t_d3", THREAD_COUNTS, divides="b_d3", doc="threads along F (#gpu.thread<x>)"),
        KnobSpec("k_d6", tuple(x for x in divisors(c) if x % vw == 0 and x <= 64),
                 doc="reduction tile of C (one shared-memory stage, with one filter tap)"),
    ]
    stages = CONV_STAGES if target.arch >= 80 else (1,)
    specs.append(KnobSpec("stages", stages, doc="shared-memory stages of the input/filter tiles: 1 copies "
                          "synchronously; S > 1 copies with cp.async, S - 1 K steps ahead (passes/async_copies.py)"))
    rows = tuple(sorted(x for x in set(divisors(ow)) | set(divisors(c)) if x <= 64))
    copies = [("cp_i", "b_d2", "b_d1*k_d6"), ("cp_f", "k_d6", "b_d3")]
    what = {"cp_i": "the input tile copy (rows of OW)", "cp_f": "the filter tile copy (rows of C)"}
    for name, *_ in copies:
        specs.append(KnobSpec(name, rows, doc=f"rows per thread and piece of {what[name]} (derived)"))

    w = GpuScheduleWriter()
    h = {sp.name: w.knob(sp.name, sp.options) for sp in specs}
    _, forall = w.tile_forall_mapped(
        w.match_op_id("%root", anchor.op_id), [0, h["b_d1"], h["b_d2"], h["b_d3"]],
        ["#gpu.block<z>", "#gpu.block<y>", "#gpu.block<x>"],
    )
    forall = fuse_others(w, ops, anchor, forall)
    a_h = w.match_op_id(forall, anchor.op_id)
    k_sizes: list[Size] = [0, 0, 0, 0, 1 if kh > 1 else 0, 1 if kw > 1 else 0, h["k_d6"]]
    a_h, loops = w.tile_for(a_h, k_sizes)
    if len(loops) > 1:
        # one K loop over (kh, kw, c / k_d6): the form the pipeliner takes
        a_h = w.match_op_id(w.coalesce(loops[0]), anchor.op_id)  # the old handle died with the loops
    padded, (copy_i, copy_f) = w.promote_inputs(a_h, [0, 1], 3, (anchor.dtype,) * 3)
    w.tile_forall_mapped(copy_i, [0, 1, h["cp_i"], vw], ["#gpu.thread<linear_dim_2>", "#gpu.thread<linear_dim_1>",
                                                           "#gpu.thread<linear_dim_0>"])
    w.distribute_linear(copy_f, [0, 0, h["cp_f"], vw])
    w.to_workgroup_memory(forall)
    mapping = ["#gpu.thread<z>", "#gpu.thread<y>", "#gpu.thread<x>"]
    t_conv, _ = w.tile_forall_mapped(padded, [0, h["b_d1"], h["t_d2"], h["t_d3"]], mapping, num_threads=True)
    for o in ops:
        if o.op_id != anchor.op_id:
            w.tile_forall_mapped(w.match_op_id(forall, o.op_id), [0, h["b_d1"], h["t_d2"], h["t_d3"]], mapping,
                                 num_threads=True)
    w.decompose(t_conv)
    func = w.vectorize_children(w.match_func("%root"))
    w.apply_patterns(func, ["vector.cast_away_vector_leading_one_dim"])
    w.cleanup(func)
    w.annotate_stages(w.gpu_bufferize("%root"), h["stages"])
    tiles = (
        (nbytes, (("1",), ("b_d1",), ("b_d2",), ("k_d6",))),
        (nbytes, (("1",), ("1",), ("k_d6",), ("b_d3",))),
    )
    return GpuSketch(
        "cuda-conv-smem", ctx.payload, w.text(), tuple(specs),
        **target_limits(target),
        threads=(("z", "b_d1"), ("y", "t_d2"), ("x", "t_d3")),
        register_tile=(("b_d2", "t_d2"), ("b_d3", "t_d3")),
        max_register_tile=64, min_register_dim=1,
        smem_tiles=tiles, staged=True, stages_knob="stages", multibuffered=(0, 1),
        pipelined_copies=("cp_i", "cp_f"),
        stage_loop=("k_d6", kh * kw * c),
        derived=tuple((name, r, col, vw) for name, r, col in copies),
        min_threads=32,
    )
