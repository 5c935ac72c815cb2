"""bf16 and int8 matmuls and convolutions on AMX tiles (Sapphire /
Emerald / Granite Rapids).

TensorIR's tensorize on a matrix instruction: where the CPU has AMX
(``amx_tile`` with ``amx_bf16`` / ``amx_int8``), the innermost tile of a
matmul is a block of 16 x 16 accumulator tiles, and each step of its
reduction one instruction per accumulator. ``tdpbf16ps``: 16 x 16 x 32
products of bf16 pairs (A's 16 rows of 32 elements, B's 16 rows of 16
pairs) into 16 x 16 f32; ``tdpbssd`` the same on quads of bytes into i32
(``tdpbusd`` / ``tdpbsud`` with one unsigned operand). One instruction a
core every 16 cycles is 1024 flops a cycle for bf16, 16 times what AVX-512
FMAs do (and ``vdpbf16ps`` runs at half their rate on these cores:
`target.DOT_RATES`, so `cpu-dot-product` makes no bf16 sketch there).

The layout is the dot-product rule's, in AMX's groups (`passes.amx.GROUPS`: pairs
of bf16, quads of bytes): A[m, k/g, g] a free view of A and B[k/g, n, g] a
copy (or packed once at compile time when B is a constant,
`weight_packing`), so that A's tile rows are 64 contiguous bytes and B's 16
groups of columns, what ``tileloadd`` reads. A convolution's A is its
input's pixels (one output row), their channels in groups.

Threads over m and n (knobs; a convolution's output rows and channels), a
cache tile of the groups (a knob, whole steps of 16 groups), for matmuls
optionally the packed B tile copied to a contiguous buffer (``pack``: its
rows are otherwise 4 N bytes apart), then a register tile of ``tm`` x
``tn`` accumulator tiles (one sketch per shape: 2 x 2, 1 x 4, 4 x 1; AMX
has eight tile registers, the block needs ``tm * tn`` for the accumulators
and at most three more for the operands). The register tile is left as a
``linalg.generic``, tagged ``ansor.amx``, through vectorization (the fill,
the copies and the fused consumers are vectorized one by one) and
bufferization; `passes.amx.amx_microkernels` then replaces it, on memrefs,
with its tile loads, products and stores, the reduction unrolled (the
accumulators stay in their tiles within a cache tile; a convolution's are
loaded and stored at each window position).

Processes must ask Linux for the tile state before the first AMX
instruction (`passes.amx.request_amx`): `runner.Kernel` does, and the
libraries `compiler` links have a constructor that does.
"""

from __future__ import annotations

from mlir_ansor.passes.amx import GROUPS as AMX_GROUPS
from mlir_ansor.passes.amx import TILE, tile_rows
from mlir_ansor.schedule.writer import ANY, ScheduleWriter
from mlir_ansor.search.rules.base import (
    Rule,
    RuleResult,
    SketchContext,
    root_sizes_from_anchor,
    tile_root_and_fuse,
)
from mlir_ansor.search.rules.dot_product import (
    conv_dims,
    lanes_of,
    loop_sizes,
    matmul_dims,
    pack_reduction,
    packed_matmul_dims,
    takes_amx,
    tile_others_in_pieces,
    variant_of,
)
from mlir_ansor.search.sketch import OpStructure, Sketch
from mlir_ansor.search.space import KnobSpec, divisors

REGISTER_TILES = ((2, 2), (1, 4), (4, 1))
"""Accumulator tiles (rows x columns of tiles) of a register tile, best
first: 2 x 2 reads two A and two B tiles for four products; the others one
and four. With tiles that do not fit, (1, 2), (2, 1), (1, 1)."""

SMALL_TILES = ((1, 2), (2, 1), (1, 1))

MAX_STEPS = 32
"""Most reduction steps (16 groups each) the unrolled micro-kernel takes: the
cache tile of groups is at most 512."""


def amx_dims(a: OpStructure) -> tuple[int | None, int, int, int, bool] | None:
    """(batch, m, n, k, packed) loops of a bf16 -> f32 or int8 -> i32
    matmul the rule takes: a plain one, a batched one (attention's
    products; `batch` its loop, else None), or `graph.prepack`'s on a B
    packed in AMX's groups (then k is the groups' loop); None otherwise."""
    v = variant_of(a)
    if v is None or v.inputs not in AMX_GROUPS or a.num_inputs != 2 or not a.is_mul_add:
        return None
    packed = packed_matmul_dims(a)
    if packed is not None:
        m, n, pairs, pair, panel = packed
        return (None, m, n, pairs, True) if panel is None and a.loop_ranges[pair] == AMX_GROUPS[v.inputs] else None
    mm = matmul_dims(a)
    if mm is None:
        return None
    batch, m, n, k = mm
    return batch, m, n, k, False


def register_tiles(m: int, n: int) -> list[tuple[int, int]]:
    tiles = [(tm, tn) for tm, tn in REGISTER_TILES if m % (TILE * tm) == 0 and n % (TILE * tn) == 0]
    return tiles or [(tm, tn) for tm, tn in SMALL_TILES if m % (TILE * tm) == 0 and n % (TILE * tn) == 0][:1]


def conv_tiles(ow: int, f: int) -> list[tuple[int, int]]:
    """(pixels, tiles of channels) of a convolution's register tiles: for
    2 x 2, 1 x 4 and 4 x 1 accumulator tiles, the most pixels of an output
    row that the rows of tiles hold (at least 7 a tile: 56 pixels are 4
    tiles of 14, 28 two, 14 one); else one tile of as many as divide."""
    tiles = []
    for tm, tn in REGISTER_TILES:
        if f % (TILE * tn):
            continue
        rows = [d for d in divisors(ow) if tile_rows(d)[0] == tm and d // tm >= 7]
        if rows:
            tiles.append((max(rows), tn))
    if not tiles:
        rows = max(d for d in divisors(ow) if d <= TILE)
        tiles = [(rows, tn) for tn in (2, 1) if f % (TILE * tn) == 0][:1]
    return tiles


def _amx_conv(a: OpStructure, target) -> bool:
    """Whether the rule takes `a` as a convolution: bf16 or int8 inputs
    (f32, i32 accumulation), unit strides (`conv_dims`), channels in whole
    steps of 16 groups and filters in whole tiles of 16 (the pixel rows
    need not be: `conv_tiles`)."""
    v = variant_of(a)
    if v is None or v.inputs not in AMX_GROUPS or conv_dims(a) is None:
        return False
    r = a.loop_ranges
    return takes_amx(target, TILE, r[3], r[6], v.inputs)


class AmxTiling(Rule):
    name = "cpu-amx"

    def condition(self, ctx: SketchContext) -> RuleResult:
        if _amx_conv(ctx.anchor, ctx.target):
            return RuleResult.APPLY if conv_tiles(ctx.anchor.loop_ranges[2], ctx.anchor.loop_ranges[3]) else RuleResult.SKIP
        dims = amx_dims(ctx.anchor)
        if dims is None:
            return RuleResult.SKIP
        _, m, n, k, packed = dims
        r = ctx.anchor.loop_ranges
        inputs = variant_of(ctx.anchor).inputs
        extent = r[k] * (AMX_GROUPS[inputs] if packed else 1)
        return RuleResult.APPLY if takes_amx(ctx.target, r[m], r[n], extent, inputs) else RuleResult.SKIP

    def apply(self, ctx: SketchContext) -> list[Sketch]:
        r = ctx.anchor.loop_ranges
        if _amx_conv(ctx.anchor, ctx.target):
            return [self._conv_sketch(ctx, mr, tn) for mr, tn in conv_tiles(r[2], r[3])]
        batch, m, n, k, packed = amx_dims(ctx.anchor)
        return [self._sketch(ctx, batch, m, n, k, packed, tm, tn) for tm, tn in register_tiles(r[m], r[n])]

    def _conv_sketch(self, ctx: SketchContext, mr: int, tn: int) -> Sketch:
        """A convolution (n, oh, ow, f, kh, kw, c): the channels in pairs
        (the input's pack a view, the filter's a copy over threads),
        threads over output rows and channels, a cache tile of pairs, a
        register tile of `mr` pixels of an output row by 16 `tn` channels,
        the window one step at a time; the unit loops folded away, the
        register tile is a matmul of the pixels' channels (rows C apart in
        the input) by the filter's pairs, which `passes.amx` computes."""
        anchor = ctx.anchor
        r = anchor.loop_ranges
        n_, oh, ow, f, kh, kw, c = range(7)
        pair = 7
        nr = TILE * tn
        lanes = lanes_of(ctx.target)
        group = AMX_GROUPS[variant_of(anchor).inputs]
        pairs = r[c] // group
        specs = [
            KnobSpec(f"p_d{oh}", divisors(r[oh]), doc=f"parallel (scf.forall) tile of loop d{oh} (output rows)"),
            KnobSpec(f"p_d{f}", tuple(d for d in divisors(r[f]) if d % nr == 0), doc=f"parallel (scf.forall) tile of loop d{f}"),
            KnobSpec(f"k_d{c}", tuple(d for d in divisors(pairs) if d % TILE == 0 and d <= TILE * MAX_STEPS),
                     doc=f"reduction (cache) tile of loop d{c}, in pairs (whole steps of {TILE})"),
        ]
        w = ScheduleWriter()
        h = {sp.name: w.knob(sp.name, sp.options) for sp in specs}
        sizes = loop_sizes(pair + 1, {"n": n_, "oh": oh, "ow": ow, "f": f, "kh": kh, "kw": kw, "c": c, "pair": pair})
        pack_reduction(w, ctx, c, group, [1, 0, 0, 0], [1, 1, 1, lanes])
        forall = tile_root_and_fuse(w, ctx, root_sizes_from_anchor(ctx, {n_: 1, oh: h[f"p_d{oh}"], ow: r[ow], f: h[f"p_d{f}"]}))
        a_h, _ = w.tile_for(w.match_op_id(forall, anchor.op_id), sizes(c=h[f"k_d{c}"]))
        a_h, _ = w.tile_for(a_h, sizes(n=1, oh=1, ow=mr, f=nr))
        a_h, _ = w.tile_for(a_h, sizes(kh=1, kw=1))
        tile_others_in_pieces(w, ctx, forall, f, lanes)
        func = w.match_func("%root")
        self._vectorize_others(w, ctx, func)
        # The unit loops folded away: the register tile, the one linalg op
        # left, becomes (pixels, channels, pairs, pair) on slices. Tagged
        # after, since the folding makes it anew, without its tags.
        w.apply_patterns(func, ["linalg.fold_unit_extent_dims_via_slices", "canonicalization"])
        tile = w.match_ops(func, ["linalg.generic"])
        w.emit(f'transform.annotate {tile} "ansor.amx" : {ANY}')
        self._bufferize(w)
        return self._finish(ctx, w, specs, f"{mr}x{nr}", (oh, 8), (f, 64))

    @staticmethod
    def _vectorize_others(w: ScheduleWriter, ctx: SketchContext, func: str) -> None:
        """Vectorize every op but the register tile (which must stay a
        linalg op), one at a time."""
        others = [w.match_op_id(func, o.op_id) for o in ctx.ops if o.op_id != ctx.anchor.op_id]
        others.append(w.match_ops(func, ["linalg.copy", "linalg.pack", "linalg.transpose"]))
        for ops in others:
            w.emit(f"transform.foreach {ops} : {ANY} {{")
            w.emit(f"^bb0(%each: {ANY}):")
            w.emit("  transform.structured.vectorize %each : !transform.any_op")
            w.emit("}")
        w.cleanup(func)

    @staticmethod
    def _bufferize(w: ScheduleWriter) -> None:
        """Bufferize; the B pack's 2 x 16 -> 16 x 2 transposes as one shuffle
        each."""
        func = w.match_func(w.bufferize("%root"))
        w.apply_patterns(func, ['vector.lower_transpose lowering_strategy = "shuffle_1d"', "canonicalization"])

    def _sketch(self, ctx: SketchContext, batch: int | None, m: int, n: int, k: int, packed: bool, tm: int, tn: int) -> Sketch:
        """`batch`: the batch loop of a batched matmul, one step of it a
        thread step (the register tile keeps a unit batch dimension, which
        `passes.amx` collapses away)."""
        anchor = ctx.anchor
        r = anchor.loop_ranges
        group = AMX_GROUPS[variant_of(anchor).inputs]
        pairs = r[k] if packed else r[k] // group
        pair = len(r) - 1 if packed else len(r)
        mr, nr = TILE * tm, TILE * tn
        steps = tuple(d for d in divisors(pairs) if d % TILE == 0 and d <= TILE * MAX_STEPS)
        specs = [
            KnobSpec(f"p_d{m}", tuple(d for d in divisors(r[m]) if d % mr == 0), doc=f"parallel (scf.forall) tile of loop d{m}"),
            KnobSpec(f"p_d{n}", tuple(d for d in divisors(r[n]) if d % nr == 0), doc=f"parallel (scf.forall) tile of loop d{n}"),
            KnobSpec(f"k_d{k}", steps, doc=f"reduction (cache) tile of loop d{k}, in pairs (whole steps of {TILE})"),
            KnobSpec("pack", (0, 1), alternatives=True, doc="0: copy the packed B tile to a contiguous buffer; 1: read it in place"),
        ]
        w = ScheduleWriter()
        h = {sp.name: w.knob(sp.name, sp.options) for sp in specs if not sp.alternatives}
        names = {"m": m, "n": n, "k": k, "pair": pair, **({"b": batch} if batch is not None else {})}
        sizes = loop_sizes(pair + 1, names)
        lead = [1] if batch is not None else []
        lanes = lanes_of(ctx.target)
        if not packed:
            # A's pack is a view; B's a copy over threads, 16 pair rows by
            # one vector of columns a step.
            pack_reduction(w, ctx, k, group, lead + [TILE, 0], lead + [1, lanes])
        thread = {m: h[f"p_d{m}"], n: h[f"p_d{n}"], **({batch: 1} if batch is not None else {})}
        forall = tile_root_and_fuse(w, ctx, root_sizes_from_anchor(ctx, thread))
        a_h, _ = w.tile_for(w.match_op_id(forall, anchor.op_id), sizes(k=h[f"k_d{k}"]))
        v = variant_of(anchor)
        cur = a_h
        (a_h,) = w.alternatives(
            "pack",
            [lambda wr: [wr.pack_operand(cur, 1, 3, [v.inputs, v.inputs, v.output], sorted((k, n, pair)))], lambda wr: [cur]],
        )
        # The register tile: left whole for `passes.amx` (tagged).
        a_h, _ = w.tile_for(a_h, sizes(m=mr, n=nr))
        w.emit(f'transform.annotate {a_h} "ansor.amx" : {ANY}')
        # Everything else vectorized, one op at a time (the register tile
        # must stay a linalg op).
        w.tile_each(w.match_ops(forall, ["linalg.copy"]), lead + [1, lanes, 0])
        tile_others_in_pieces(w, ctx, forall, n, lanes)
        self._vectorize_others(w, ctx, w.match_func("%root"))
        self._bufferize(w)
        return self._finish(ctx, w, specs, f"{tm}x{tn}", (m, 128), (n, 128))

    def _finish(self, ctx: SketchContext, w: ScheduleWriter, specs: list[KnobSpec], shape: str,
                rows: tuple[int, int], cols: tuple[int, int]) -> Sketch:
        """The sketch: `specs` are the thread tiles of loops `rows` and
        `cols` (loop, preferred size), the cache tile of groups (preferred:
        256), and maybe ``pack`` (preferred: the copy)."""
        r = ctx.anchor.loop_ranges
        (lr, pr), (lc, pc) = rows, cols
        prefer = {
            specs[2].name: min(specs[2].options, key=lambda x: abs(x - 256)),
            specs[0].name: min(specs[0].options, key=lambda x: abs(x - pr)),
            specs[1].name: min(specs[1].options, key=lambda x: abs(x - pc)),
            **({"pack": 0} if any(sp.name == "pack" for sp in specs) else {}),
        }
        return Sketch(
            f"{self.name}-{shape}",
            ctx.payload,
            w.text(),
            tuple(specs),
            forall=((specs[0].name, r[lr]), (specs[1].name, r[lc])),
            prefer=tuple(sorted(prefer.items())),
        )
