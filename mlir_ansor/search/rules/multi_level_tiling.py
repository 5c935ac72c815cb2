"""Multi-level tiling for contractions, convolutions and pooling (CPU).

Ansor's "SSRSRS" structure, adapted to what MLIR's transform dialect and a
2-core AVX2 machine reward:

  S  ``scf.forall`` over the parallel loops of the task's root, with the
     whole task (fill, anchor, fused elementwise consumers) fused in: the
     thread level (knobs ``p_d<i>``);
  R  ``scf.for`` over the reduction loops: the cache level (``k_d<i>``);
     then, as a ``transform.tune.alternatives`` choice, *packing*: the tile
     of the reused operand (B of a matmul, the filter of a convolution) is
     copied into a contiguous buffer;
  S  ``scf.for`` over a register tile: rows x vector lanes (``r_d<i>``);
  R  ``scf.for`` over the remaining reduction, the innermost unrolled by
     ``u_d<i>``;
  then vectorization, with the output tile kept in registers across the
  reduction loops ("cache write" to registers: `hoist_loop_invariant_subsets`),
  bufferization and FMA lowering.

Convolutions and pooling must decompose to 1-D to vectorize: every window
pair but the innermost (oh/kh of a 2-D convolution) is tiled to 1, then
`transform.structured.decompose`.

Knobs are sampled register-first, the outer tiles after them: every level
nests by construction. On loops whose extent is a multiple of 8 (of the
lanes, for the vector loop) tile sizes divide the extents, as they always
did. On other ("odd") loops, 367 or 7 or 35, tiles need not divide:

* register tiles (rows, vector, unroll) and cache tiles of reductions may
  leave a remainder; after tiling, `scf-for-loop-peeling` splits every such
  loop into full tiles of static shape and a remainder, static too when the
  loop's extent is, and both are vectorized as usual;
* the thread tile of a contraction's row loop may leave a partial last tile
  (a prime row extent has no other divisors); its register loops then have
  dynamic bounds, and the remainder rows after peeling, of a dynamic count,
  are tiled into static tiles of the powers of two from 4 up (a 4-row tile
  below 5-8 register rows; 8 and 4 below 12 or 14) and rows of one
  (`ScheduleWriter.tile_dynamic_rows`), so that every tile is static
  (masked to the register tile's shape, the remainder cost about two whole
  tiles). Packing is not offered there (a pad of the dynamic output tile
  would copy it at every cache step). Window ops keep thread tiles that
  divide their loops.

What not to do, measured on 367^3: padding whole operands with
`structured.pad` and vectorizing the pad copies (tensor.pad / insert_slice of
a 48x64 or 16x368 tile) made single vectors of thousands of elements, built
up row by row through chains of `scf.if` with full unrolling; LLVM's code
generation of that took minutes (436 s for one candidate).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from mlir_ansor.schedule.writer import ScheduleWriter
from mlir_ansor.search.rules.base import (
    Rule,
    RuleResult,
    SketchContext,
    finish,
    reads_vector_dim_transposed,
    root_sizes_from_anchor,
    tile_others_like,
    tile_root_and_fuse,
    vector_tile_options,
)
from mlir_ansor.search.sketch import OpStructure, Sketch
from mlir_ansor.search.space import KnobSpec, divisors, partial_tile_options

ROW_TILES = (1, 2, 3, 4, 5, 6, 8)
UNROLLS = (1, 2, 4)
# Register rows offered to a contraction even where they do not divide the
# row loop (its remainder rows are peeled): 6 rows by 2 vectors keep 12
# accumulators in AVX2's 16 registers, the shape of the usual f32 AVX2
# micro-kernel. With 8 accumulators (4 x 2, the best a 1024 row loop offered
# before), the FMA chains (latency 4, two per cycle) just fill the pipes and
# every late load stalls them: GEMM 1024 went from 0.77 to 0.90 of OpenBLAS at
# the default point, 0.95 with 256-row thread tiles (llvm-mca: both loops
# FMA-bound, 2 FMAs per cycle; no spills).
EXTRA_ROW_TILES = (6,)
# And on a target with 32 vector registers (AVX-512): 12 or 14 rows by 2
# vectors keep 24 or 28 accumulators, the shape of AVX-512 f32 micro-kernels.
# BERT's FFN output (384 x 3072 x 768, B in 32-wide panels, so at most 2
# vectors wide), 2 threads, Emerald Rapids: 352 GFLOP/s with 8 rows, 377
# with 12, 381 with 14; its FFN input: 340, 338, 347.
WIDE_ROW_TILES = (12, 14)

# Ops that `transform.structured.decompose` turns into 1-D ones once their
# outer window loops are tiled to 1 (upstream DecomposeConvolutionPatterns).
DECOMPOSABLE = frozenset(
    {
        "linalg.conv_2d_nhwc_hwcf",
        "linalg.conv_2d_nchw_fchw",
        "linalg.depthwise_conv_2d_nhwc_hwc",
        "linalg.pooling_nhwc_sum",
        "linalg.pooling_nhwc_max",
        "linalg.pooling_nchw_sum",
        "linalg.pooling_nchw_max",
    }
)
# 1-D window ops the vectorizer handles directly.
ONE_D = frozenset({"linalg.conv_1d_nwc_wcf", "linalg.conv_1d_ncw_fcw", "linalg.depthwise_conv_1d_nwc_wc"})
# Channel-first layouts: with more than one output channel per register tile,
# vectorized 1-D NCW convolutions gave wrong results with these MLIR wheels
# (caught by the reference check), so their row tile stays 1.
CHANNEL_FIRST = ("nchw", "ncw")


def channel_first(anchor: OpStructure) -> bool:
    """Whether the op is a channel-first convolution or pooling (NCHW, NCW)."""
    return any(tag in anchor.name for tag in CHANNEL_FIRST)


def forced_unit_loops(anchor: OpStructure) -> set[int]:
    """Loops tiled to 1 so that a window op decomposes to 1-D: every window
    pair except the innermost one (oh and kh of a 2-D NHWC convolution)."""
    windows = [c for c in anchor.compound_dims if len(c) >= 2]
    forced: set[int] = set()
    for w in windows[:-1]:
        forced.update(w)
    return forced


def vector_and_row_dims(anchor: OpStructure) -> tuple[int, int | None]:
    """The vectorized loop (the output's contiguous dimension) and the
    register-row loop: the innermost other output dimension that may be
    tiled and that an input read along the vector loop does not index, so
    that its vector loads serve every register row (B's row of C = A.B, the
    filter's of a convolution). Where each such input indexes every output
    dimension, the innermost one that may be tiled.

    The second condition decides only where the output has a dimension
    between the rows and the vector: a matmul whose constant B is packed in
    column panels (``C[m, n1, n2] += A[m, k] Bp[n1, k, n2]``) tiles its rows
    along m, not n1, which indexes Bp (1 x 8 panels of 32 would load 16 B
    vectors per 16 FMAs, where 8 rows x 32 load 2)."""
    out = [d for d in anchor.output_dims if d is not None]
    vec = out[-1]
    if channel_first(anchor):
        return vec, None
    forced = forced_unit_loops(anchor)
    candidates = [d for d in reversed(out[:-1]) if d not in forced]
    carriers = [dims for dims in anchor.operand_dims[: anchor.num_inputs] if vec in dims]
    for d in candidates:
        if any(d not in dims for dims in carriers):
            return vec, d
    return vec, candidates[0] if candidates else None


def reused_operand(anchor: OpStructure, row: int | None) -> int | None:
    """The input reused across the row loop (B of C = A.B, the filter of a
    convolution): read by the body, indexed by plain loops, not by the row."""
    if row is None or not anchor.is_mul_add:
        return None
    for i in range(anchor.num_inputs):
        dims = anchor.operand_dims[i]
        used = anchor.used_inputs[i] if i < len(anchor.used_inputs) else True
        if used and len(dims) >= 2 and None not in dims and row not in dims:
            return i
    return None


def in_panels(anchor: OpStructure, operand: int, vec: int | None, lanes: int) -> bool:
    """Whether `operand` (the reused one) is laid out as column panels
    already, as `graph.prepack` writes a constant B (``[N / 32, K, 32]``):
    its last dimension is the vector loop, no wider than the widest
    register tile (4 vectors), and the one before it a reduction. Its
    tile is then read in place as contiguously as the packing copy would
    lay it out. BERT's FFN-out at 100 rows carried from 128 rows: the best
    record there copied B; the best that read it in place ran 1.65x its
    time, and the best with the copy left out 1.46x faster than that (2
    threads, Emerald Rapids)."""
    dims = anchor.operand_dims[operand]
    return (
        vec is not None
        and len(dims) >= 2
        and dims[-1] == vec
        and anchor.loop_ranges[vec] <= 4 * lanes
        and dims[-2] in anchor.reductions
    )


class MultiLevelTiling(Rule):
    name = "cpu-contraction"

    def condition(self, ctx: SketchContext) -> RuleResult:
        a = ctx.anchor
        if ctx.target.kind != "cpu":
            return RuleResult.SKIP  # the GPU rules' (rules/gpu_*.py)
        if not a.reductions or any(d is None for d in a.output_dims):
            return RuleResult.SKIP
        if a.compound_dims:
            ok = a.name in DECOMPOSABLE or a.name in ONE_D
            return RuleResult.APPLY if ok and (a.is_mul_add or "pooling" in a.name) else RuleResult.SKIP
        return RuleResult.APPLY if a.is_mul_add else RuleResult.SKIP

    def apply(self, ctx: SketchContext) -> list[Sketch]:
        anchor = ctx.anchor
        is_window = bool(anchor.compound_dims)
        ranges = anchor.loop_ranges
        lanes = ctx.lanes()
        vec, row = vector_and_row_dims(anchor)
        forced = forced_unit_loops(anchor) if is_window else set()
        inner_red = [d for d in anchor.reductions if d not in forced]
        reused = reused_operand(anchor, row)
        transposed = reads_vector_dim_transposed(anchor, vec)
        # Loops whose extent is a multiple of 8 (of the lanes, for the vector
        # loop) keep tiles that divide them: the schedules, their IR and the
        # cost model's templates stay what they were. Other loops ("odd":
        # 367, 129, 7, 35) also get tiles that do not divide them; the
        # schedule peels their remainders (see the module docstring).
        odd = {d: ranges[d] % (lanes if d == vec else 8) != 0 for d in range(len(ranges))}
        b = reused
        b_in_panels = b is not None and in_panels(anchor, b, vec, lanes)
        wide = ctx.target.vector_registers >= 32 and not is_window
        streams_b = (
            wide and b is not None and not b_in_panels and row is not None and ranges[row] <= _FEW_ROWS
            and math.prod(ranges[d] for d in anchor.operand_dims[b] if d is not None) >= _LARGE_B
        )
        # A contraction with odd rows may end its thread tiles of the row
        # loop in a partial tile, whose remainder rows are vectorized with
        # masks. The packing copy pads only the loops of B (static tiles),
        # so it applies there too where the thread tile of rows divides
        # them (`Sketch.requires`: in a partial one, of a dynamic row
        # count, the cache loop's output tile fails to bufferize), except
        # to a few rows streaming B: there B is read in place (a copy would
        # serve only those rows; the rule below). Until session 50 partial
        # rows had no packing alternative, and a relative's record that
        # copied B was carried in place: 256 rows' best (8 x 32 registers,
        # k 1024, 64 columns a thread tile) ran 333 rows in 0.96x the
        # static 333-row module's time with the copy, 2.07x without (2
        # threads, Emerald Rapids, in turns). Their default stays in place.
        # Window ops cannot be masked (the vectorizer has no masked
        # convolutions), so their thread tiles divide the extents.
        partial_rows = not is_window and row is not None and odd[row]
        if partial_rows and streams_b:
            reused = None
        # Nor where B is in column panels already (`in_panels`: the weights
        # `graph.prepack` lays out): each cache tile of a panel is as
        # contiguous as the copy would make it, so the copy is a pass over
        # B for nothing. BERT's weight matmuls, 2 threads, Emerald Rapids,
        # the tuned knobs with the copy and without, in turns: FFN-in at 128
        # rows 1.80 / 1.62 ms (64 MB touched between calls: 1.84 / 1.69),
        # a Q/K/V projection at 384 rows 1.66 / 1.28, FFN-out at 16 rows
        # 0.37 / 0.25 (0.47 / 0.27); FFN-in at 384 rows 5.30 / 5.38 (5.61 /
        # 5.36). Later, in a slower phase of that VM, with B in memory
        # (600 MB written between calls), the same within 2%: 2.59 / 2.60
        # (FFN-in, 128), 1.61 / 1.63 (projection, 384), 0.72 / 0.71
        # (FFN-out, 16). The tune at 128 had chosen the copy for 3 of its 4
        # weight matmuls. Window ops keep the choice (not measured).
        if reused is not None and not is_window and in_panels(anchor, reused, vec, lanes):
            reused = None
        extra_rows = EXTRA_ROW_TILES + (WIDE_ROW_TILES if ctx.target.vector_registers >= 32 else ())

        # The knobs, in sampling order: register tile first, then outer tiles.
        specs: list[KnobSpec] = []
        for d in anchor.parallel:
            if d == vec:
                opts = vector_tile_options(ranges[d], lanes, partial=odd[d])
                specs.append(KnobSpec(f"r_d{d}", opts, doc=f"vector tile of loop d{d}"))
            elif d == row:
                opts = tuple(x for x in ROW_TILES if (x <= ranges[d] if odd[d] else ranges[d] % x == 0))
                if not is_window:
                    # Peeled like the rows of odd loops; the thread tile of the
                    # rows is then any larger divisor (`KnobSpec.multiple_of`).
                    opts = tuple(sorted(set(opts) | {x for x in extra_rows if x <= ranges[d]}))
                specs.append(KnobSpec(f"r_d{d}", opts, doc=f"register rows of loop d{d}"))
        if inner_red:
            d = inner_red[-1]
            # Window loops (kw = 3) keep tiles that divide them: a partial
            # unroll or cache tile of one sent the transform interpreter into
            # a loop that never ended (a 3x3 NCHW conv with k = u = 2 ran past
            # 400 s before it was killed; with k = 3, u = 1 it builds in 0.2 s).
            if transposed or not odd[d] or is_window:
                opts = tuple(x for x in UNROLLS if ranges[d] % x == 0)
                # The whole window (kw = 3) of a channel-last op: neighbouring
                # taps share input loads. Not channel-first ones: a 3x3 NCHW
                # convolution with u = 3 never finished building (one worker
                # passed 22 GB).
                if is_window and not channel_first(anchor) and 2 < ranges[d] <= 7 and ranges[d] not in opts:
                    opts += (ranges[d],)
                if is_window and channel_first(anchor):
                    # Channel-first windows are not unrolled at all: torch's
                    # Conv1d(8, 16, 4) (NCW) at its default point (u = 4), or
                    # with u = 2, and a kernel of 2 with u = 2, built for
                    # minutes until their worker was killed; u = 1 builds in
                    # a second (odd windows never offered more).
                    opts = (1,)
            else:
                opts = tuple(x for x in UNROLLS if x <= ranges[d])
            if transposed and len(opts) > 1:
                # A [rows, lanes, 1] contraction over an operand read
                # transposed along the vector loop sent the vector
                # canonicalization patterns into an endless loop with these
                # MLIR wheels (builds hung until their timeout): unroll >= 2,
                # dividing the extent (no remainder of 1 either).
                opts = tuple(x for x in opts if x > 1)
            specs.append(KnobSpec(f"u_d{d}", opts, doc=f"inner unroll of reduction loop d{d}"))
        reg = {sp.name for sp in specs}
        for d in anchor.parallel:
            r_name = f"r_d{d}" if f"r_d{d}" in reg else None
            doc = f"parallel (scf.forall) tile of loop d{d}"
            if d == row and partial_rows:
                opts = partial_tile_options(ranges[d], ROW_TILES + extra_rows)
                # Or the whole loop in one tile, its last register tile
                # masked: 100 rows in register tiles of 6 had thread tiles of
                # 96 and 4 rows, and each 4-row tile streamed all of B.
                specs.append(KnobSpec(f"p_d{d}", opts, multiple_of=r_name, or_whole=True, doc=doc + " (the last may be partial)"))
            elif odd[d]:
                specs.append(KnobSpec(f"p_d{d}", divisors(ranges[d]), at_least=r_name, doc=doc))
            else:
                specs.append(KnobSpec(f"p_d{d}", divisors(ranges[d]), multiple_of=r_name, doc=doc))
        for d in anchor.reductions:
            if d in forced:
                continue
            u_name = f"u_d{d}" if f"u_d{d}" in reg else None
            doc = f"reduction (cache) tile of loop d{d}"
            if odd[d] and u_name is not None and not transposed and not is_window:
                opts = partial_tile_options(ranges[d], UNROLLS)
                specs.append(KnobSpec(f"k_d{d}", opts, multiple_of=u_name, doc=doc + " (the last may be partial)"))
            else:
                specs.append(KnobSpec(f"k_d{d}", divisors(ranges[d]), multiple_of=u_name, doc=doc))
        if reused is not None:
            specs.append(
                KnobSpec("pack", (0, 1), alternatives=True, doc=f"0: copy the tile of operand {reused} to a contiguous buffer; 1: read it in place")
            )

        w = ScheduleWriter()
        h = {sp.name: w.knob(sp.name, sp.options) for sp in specs if not sp.alternatives}

        # S: threads.
        forall = tile_root_and_fuse(
            w, ctx, root_sizes_from_anchor(ctx, {d: h[f"p_d{d}"] for d in anchor.parallel if f"p_d{d}" in h})
        )
        # R: cache tiles of the reductions, their partial last tile peeled
        # off (static: reduction extents are), so that what follows sees
        # static reduction extents.
        a_h = w.match_op_id(forall, anchor.op_id)
        k_sizes: list[int | str] = [h.get(f"k_d{d}", 0) if d in anchor.reductions else 0 for d in range(len(ranges))]
        if any(isinstance(s, str) for s in k_sizes):
            w.tile_for(a_h, k_sizes)
            forall = w.peel_partial_loops("%root")
            a_h = w.match_op_id(forall, anchor.op_id)
        # S: register tile. R: the remaining reductions, the innermost
        # unrolled. Each tile of the anchor separately (a peeled cache loop
        # leaves two).
        r_sizes: list[int | str] = [0] * len(ranges)
        for d in anchor.parallel:
            r_sizes[d] = h.get(f"r_d{d}", 1)
        for d in forced:
            r_sizes[d] = 1
        # A decomposed window's register tile takes its accumulator's fill
        # with it (`ScheduleWriter.tile_for`'s `fuse`), where no packing copy
        # feeds it: a depthwise convolution, 9 multiply-adds per output,
        # otherwise spends a fifth of its time in the fill's pass over the
        # output and in reading it back. The window's loops are tiled after,
        # inside.
        decomposed = is_window and anchor.name in DECOMPOSABLE

        def register_tiles(wr: ScheduleWriter, op: str, fuse: bool) -> list[str]:
            if not fuse:
                wr.tile_each(op, r_sizes)
                return []
            window = [d for d in forced if d in anchor.reductions]
            wr.tile_each(op, [0 if d in window else s for d, s in enumerate(r_sizes)], fuse=True)
            if window:
                wr.tile_each(wr.match_op_id(forall, anchor.op_id), [1 if d in window else 0 for d in range(len(ranges))])
            return []

        # Packing, or not. Only the loops of the packed operand are padded:
        # their tiles are static, so the pad copies and pads nothing else.
        if reused is not None:
            n_ops = len(anchor.operand_dims)
            cur = a_h
            dims = tuple(d for d in anchor.operand_dims[reused] if d is not None)
            types = list(anchor.input_dtypes) + [anchor.dtype] * (n_ops - len(anchor.input_dtypes))
            w.alternatives(
                "pack",
                [lambda wr: register_tiles(wr, wr.pack_operand(cur, reused, n_ops, types, dims), False),
                 lambda wr: register_tiles(wr, cur, decomposed)],
                results=0,
            )
        else:
            register_tiles(w, a_h, decomposed)
        if partial_rows:
            # The register tiles of a partial thread tile of rows leave a
            # remainder of a dynamic row count. Peeled, it is tiled by the
            # powers of two from 4 up to below the register rows (8 rows: 4),
            # each tile static and vectorized as any is, before the
            # reduction is unrolled, so that each keeps its accumulators in
            # registers over the cache tile; the rest, fewer than 4 rows,
            # runs in rows of one inside the unrolled reduction, where the
            # rows share each step's vectors of B (below). In turns, 2
            # threads, Emerald Rapids, M x 1024 x 1024 on dynamic rows with
            # 16's knobs (8 x 64 registers, k = 256), rows of one against
            # this: 5 rows 0.143 / 0.125 ms, 13 rows (8 + 5) 0.250 / 0.214,
            # 20 rows 0.278 / 0.230, 3 rows 0.101 / 0.103; with 3 rows as
            # 2 + 1, 0.095 / 0.116: each tile read the cache tile of B
            # again, where rows of one read it once. Masked to the register
            # tile's vector shape (until session 44) the remainder cost
            # about two whole tiles, its contraction an FMA and a select per
            # row and step.
            tile_others_like(w, ctx, forall, r_sizes, skip={anchor.op_id})
            forall = w.peel_partial_loops("%root")
            at = anchor.output_dims.index(row)
            kinds = [(anchor.name, row, len(ranges))]
            for o in ctx.ops:
                if o.op_id != anchor.op_id and at < len(o.output_dims) and o.output_dims[at] is not None:
                    kinds.append((o.name, o.output_dims[at], len(o.loop_ranges)))
            row_opts = next(sp.options for sp in specs if sp.name == f"r_d{row}")
            w.tile_dynamic_rows(forall, kinds, r_sizes[row], row_opts, down_to=4)
            forall = w.match_func("%root")
        u_sizes: list[int | str] = [0] * len(ranges)
        for d in anchor.reductions:
            u_sizes[d] = h.get(f"u_d{d}", 1)
        w.tile_each(w.match_op_id(forall, anchor.op_id), u_sizes, peel=partial_rows)
        if partial_rows:
            w.apply_patterns(forall, ["canonicalization"])
            w.tile_dynamic_rows(forall, kinds, 2)  # rows of one
            forall = w.match_func("%root")
        else:
            tile_others_like(w, ctx, forall, r_sizes, skip={anchor.op_id})
        if reused is not None:
            # The packing copy: one row of the innermost dimension per step.
            # Tiled along its first dimension only, a convolution filter's
            # copy kept a [kw, c, f] tile (3x256x128), vectorized and fully
            # unrolled into thousands of vector transfers in one block; LLVM
            # took minutes per kernel (ResNet-50 with the layout pass).
            rank = sum(1 for d in anchor.operand_dims[reused] if d is not None)
            w.tile_each(w.match_ops(forall, ["linalg.copy"]), [1] * (rank - 1) + [0])
        # Register tiles and unrolls that do not divide their loop leave
        # remainders: peel them, so full tiles are static.
        if not partial_rows:
            forall = w.peel_partial_loops("%root")
        if decomposed:
            w.decompose(w.match_op_id(forall, anchor.op_id))
        finish(w, vectorize=True, unit_dims=decomposed)
        forall_knobs = tuple((f"p_d{d}", ranges[d]) for d in anchor.parallel)
        panels = {d: ranges[vec] for d in anchor.operand_dims[b][:-2] if d in anchor.parallel and d != row} if b_in_panels else {}
        few_rows = streams_b and reused is not None
        prefer = _preferred(
            specs, vec, row, inner_red, lanes, narrow=is_window and reused is not None,
            wide=wide, panels=panels, few_rows=few_rows, stream_rows=ranges[row] if streams_b else None,
            in_place=partial_rows,
        )
        # Without the packing alternative (partial rows streaming B), B is
        # read in place: a schedule of another size that copied B is a
        # different one (`search.transfer.faithful`).
        implied = (("pack", 1),) if partial_rows and streams_b else ()
        requires = ()
        if partial_rows and reused is not None:
            requires = (("pack", 0, f"p_d{row}", divisors(ranges[row])),)
        return [Sketch(self.name, ctx.payload, w.text(), tuple(specs), forall=forall_knobs, prefer=prefer, implied=implied,
                       requires=requires)]


# The default point of the space (`sketch.default_assignment`): a register
# tile of 6 rows by 2 vectors (12 accumulators of AVX2's 16 registers, see
# EXTRA_ROW_TILES) where 6 rows are offered, else 4 rows (8 accumulators:
# the nearest option to 6 on a log scale would be 8 rows, 16 accumulators,
# which spill), the innermost reduction unrolled by
# 4, cache tiles of up to 256 along the reductions, thread tiles of 64 rows
# by 128 vector columns (a packed 256x128 f32 tile is 128 KiB, a quarter of
# Zen 3's L2), and the reused operand packed.
#
# A convolution (a window op with a filter to pack; not pooling) instead
# gets thread tiles one register tile wide along its vector loop (16 output
# channels, `narrow`): its packed filter tile (kh x kw x channels x 16,
# 36 KiB for 3x3x64) then serves every pixel of the thread tile from L1,
# where 64 channels (147 KiB) stream from L2 for each register tile. One
# depth tap of Ansor's C3D (16x56x56, 64 -> 64, 3x3) at 1 thread: 38.9 ms
# with 16, 41.7 with 32, 42.2 with 64; the searches of C2D, DIL, CBR and
# C3D found 16 (or 32) on their own.
#
# Contractions on a target with 32 vector registers (AVX-512; every such x86
# part has 1 MiB of L2 or more, Zen 3 had 512 KiB) get 12 rows by 2 vectors
# (24 accumulators, WIDE_ROW_TILES) and thread tiles of 256 rows, so each
# packed tile of B serves 4 times the rows. GEMM 1024, Emerald Rapids, 12 x 32
# registers, thread tiles of 64 / 128 / 256 / 512 rows: 138, 169, 170, 178
# GFLOP/s at 1 thread; 286, 320, 347, 338 at 2.
#
# Where B is in column panels (`in_panels`: [N / 32, K, 32]), the loop over
# panels gets thread tiles of 128 columns too (4 panels of 32), not the
# whole loop: the packed B tile of BERT's FFN input with all 96 panels (3072
# columns by a 256 cache tile) is 3 MiB, copied for every row tile.
#
# BERT's four matmuls at 384 rows (QKV, output, FFN in, FFN out), 2 threads,
# Emerald Rapids, default points timed in turns: 6 rows, all panels and
# 64-row thread tiles 298, 302, 151, 294 GFLOP/s; 12 rows and 4 panels 313,
# 311, 283, 312; with 256-row (192) thread tiles as well 349, 324, 314, 337.
#
# A contraction of few rows against a large B (at most 16 rows; B of
# 256 Ki elements or more, not in panels; 32 registers) spends its time
# streaming B. Its register tiles are 4 vectors wide (each B load feeds
# every row of the tile), over all its rows up to 8 (the largest row tile
# offered: 7 rows take 6 and one), else 6 rows (16 rows: 6 + 6 + 4; 8
# rows by 4 vectors hold 32 accumulators, all of the registers, and
# spill). Where packing B is a choice (8 or 16 rows, in whole tiles of 8),
# it reads B in place (`pack` = 1: a packed copy of B serves only these
# few rows), in thread tiles of 4 vectors of columns. Timed in turns, GEMM
# M x 1024 x 1024, Emerald Rapids, the default before (12 or 6 rows by 2
# vectors, 128 columns, B packed) against reading B in place by 8 rows by
# 4 vectors: at 2 threads M = 8 0.223 -> 0.135 ms, M = 16 0.263 -> 0.227;
# at 1 thread 0.453 -> 0.276 and 0.543 -> 0.393. Then (session 48, the
# same host, in turns, 2 threads | 1 thread), against 2 vectors (or 8 rows
# by 4 at 16 rows): 16 rows by 6 x 4, 0.197 -> 0.165 ms and 0.266 ->
# 0.237 | 0.349 -> 0.320; 12 rows by 6 x 4, 0.150 -> 0.138 | 0.296 ->
# 0.255; 7 rows by 6 x 4, 0.124 -> 0.107 | 0.249 -> 0.203; 5 rows by
# 5 x 4, 0.107 -> 0.074 | 0.199 -> 0.141; 4 rows 0.076 -> 0.071 | 0.161 ->
# 0.157; 1 row 0.084 -> 0.080 | 0.147 -> 0.144. 8 rows keep 8 x 4 (4 x 4:
# the same at 2 threads, 9% slower at 1). Not taken: 32 rows (8 x 4 in
# place lost at 1 thread, 0.755 -> 0.803 ms).
_PREFER_ROWS, _FALLBACK_ROWS, _PREFER_UNROLL, _PREFER_K = 6, 4, 4, 256
_PREFER_P_ROWS, _PREFER_P_COLS = 64, 128
_PREFER_WIDE_ROWS, _PREFER_WIDE_P_ROWS = 12, 256
_FEW_ROWS, _LARGE_B, _FEW_ROWS_TILE, _FEW_ROWS_VECTORS = 16, 1 << 18, 8, 4
_STREAM_ROWS = 6
"""The row register tile of a contraction of 9 to 16 rows that streams B."""


def _preferred(
    specs: list[KnobSpec],
    vec: int | None,
    row: int | None,
    inner_red: list[int],
    lanes: int,
    *,
    narrow: bool = False,
    wide: bool = False,
    panels: Mapping[int, int] | None = None,
    few_rows: bool = False,
    stream_rows: int | None = None,
    in_place: bool = False,
) -> tuple[tuple[str, int], ...]:
    """`wide`: a contraction (not a window op) on a target with 32 vector
    registers; `panels`: the loops over column panels of B, each with the
    columns one panel holds; `stream_rows`: the rows of a wide contraction
    of few rows against a large B (`_FEW_ROWS`), None for any other;
    `few_rows`: such a one where packing B is a choice; `in_place`: read
    B in place by default (partial rows, where the copy is offered since
    session 50, as they read it before)."""
    prefer: dict[str, int] = {}
    for sp in specs:
        kind, _, d = sp.name.partition("_d")
        if sp.name == "pack":
            prefer[sp.name] = int(few_rows or in_place)
        elif stream_rows and kind == "r" and int(d) == vec or few_rows and kind == "p" and int(d) == vec:
            prefer[sp.name] = _FEW_ROWS_VECTORS * lanes
        elif stream_rows and kind == "r" and int(d) == row:
            whole = [o for o in sp.options if o <= stream_rows]
            prefer[sp.name] = max(whole) if stream_rows <= _FEW_ROWS_TILE and whole else _STREAM_ROWS
        elif kind == "r":
            if int(d) == vec:
                prefer[sp.name] = 2 * lanes
            elif wide and _PREFER_WIDE_ROWS in sp.options:
                prefer[sp.name] = _PREFER_WIDE_ROWS
            else:
                prefer[sp.name] = _PREFER_ROWS if _PREFER_ROWS in sp.options else _FALLBACK_ROWS
        elif kind == "u":
            prefer[sp.name] = _PREFER_UNROLL
        elif kind == "k":
            prefer[sp.name] = _PREFER_K
        elif kind == "p" and int(d) == vec:
            prefer[sp.name] = 2 * lanes if narrow else _PREFER_P_COLS
        elif kind == "p" and int(d) == row:
            prefer[sp.name] = _PREFER_WIDE_P_ROWS if wide else _PREFER_P_ROWS
        elif kind == "p" and panels and int(d) in panels:
            prefer[sp.name] = max(1, _PREFER_P_COLS // panels[int(d)])
    return tuple(sorted(prefer.items()))
