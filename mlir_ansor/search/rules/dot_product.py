"""Tensorized contractions and convolutions on the CPU's dot-product
instructions (bf16 and int8).

TensorIR's tensorize rule on MLIR: the innermost tile of a matmul or a
convolution with narrow inputs becomes one instruction that multiplies
pairs along the reduction and adds both products to each 32-bit lane:

* bf16 inputs, f32 accumulation: AVX-512 BF16's ``vdpbf16ps``;
* i8 inputs, i32 accumulation (signed): AVX-512 VNNI's ``vpdpwssd`` on the
  bytes widened to 16 bits in registers (`passes.dot_products`; exact).

32 multiply-adds per instruction, twice an f32 FMA. The instructions want
the reduction in pairs next to each other, so the sketch first changes the
data layout (``transform.structured.pack`` of the reduction loop by 2, what
IREE's data tiling and oneDNN's VNNI formats do):

* A[m, k] becomes A[m, k/2, 2] and a convolution's input [n, h, w, c]
  becomes [n, h, w, c/2, 2]: free views (an ``expand_shape``);
* B[k, n] becomes B[k/2, n, 2] and a filter [kh, kw, c, f] becomes
  [kh, kw, c/2, f, 2]: one copy per call (a ``linalg.pack``, tiled over
  threads), a small part of the work of the op;
* the op becomes a ``linalg.generic`` with the pair loop last.

Then the usual structure: threads over the output (m and n; output rows and
channels of a convolution), a cache tile of pairs (a matmul's packed B tile
copied to a contiguous buffer), a register tile of ``rows`` x ``cols``
(output pixels of a row x channels for a convolution) cut into 1 x 16 x 2
pieces and unrolled, the accumulators carried in registers across the
reduction loops (`hoist_loop_invariant_subsets`). Each piece vectorizes to a
``vector.contract`` on narrow operands (`fold_arith_extension` folds the
widening into it): a matmul's bf16 pieces go through
``x86vector.vector_contract_to_packed_type_dot_product``; the others
(int8, and convolution pieces, which `fold_unit_extent_dims` leaves as a
16 x 2 by 2 contraction) through `passes.dot_products`. The packed
operands' n-D reads become single loads (`passes.vector_flatten`).

The register tile is fixed per sketch (``transform.loop.unroll`` takes no
knob), so the rule makes one sketch per tile shape that fits the loops;
thread and cache tiles are knobs, and the search picks among these sketches
and `cpu-contraction` (widening plus FMAs) like among any other choices.
Targets without the instruction (Zen 3, `Target.dot_product_kinds`), or
whose core runs it no faster than FMAs (``vdpbf16ps`` on Sapphire and
Emerald Rapids, `Target.dot_rate`), get no such sketch.

Measured on the 2-core Zen 5 host (AMD family 26, avx512_bf16 and VNNI), at
1 thread with 24 trials, GEMM 1024: bf16 5.9 ms (363 GFLOP/s), i8 5.8 ms
(371 GOP/s); the ResNet 3x3 64->64 convolution (56x56), 10 trials: bf16
0.53 ms, i8 0.58 ms. Our f32 GEMM is about 100 GFLOP/s on it;
`benchmarks/low_precision.py` has the table against IREE and torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlir_ansor.graph.prepack import Panels
from mlir_ansor.passes.amx import GROUPS as AMX_GROUPS
from mlir_ansor.passes.amx import TILE as AMX_TILE
from mlir_ansor.schedule.writer import ScheduleWriter
from mlir_ansor.search.rules.base import (
    Rule,
    RuleResult,
    SketchContext,
    root_sizes_from_anchor,
    tile_root_and_fuse,
)
from mlir_ansor.search.sketch import OpStructure, Sketch
from mlir_ansor.search.space import KnobSpec, divisors


@dataclass(frozen=True)
class Variant:
    """One element-type combination the rule tensorizes."""

    inputs: str
    """Element type of both inputs."""
    output: str
    """Element type of the accumulator and result."""
    kind: str
    """The dot product it maps onto (`Target.dot_product_kinds`)."""
    extension: str
    """The widening op the body must use on both inputs."""


VARIANTS = (
    Variant("bf16", "f32", "bf16xbf16->f32", "arith.extf"),
    # int8 through vpdpwssd (pairs of 16-bit products, exact in i32; with
    # AVX2 only, vpmaddwd and an add): the packed operands stay i8 in memory
    # and are sign-extended in registers (`passes.dot_products`).
    Variant("i8", "i32", "s16xs16->i32", "arith.extsi"),
)

def group_of(a: OpStructure, target) -> int:
    """How many reduction elements one lane's dot product takes: pairs
    (bf16, and int8 through 16-bit products), or quads for int8 where the
    CPU has 512-bit VNNI (``vpdpbusd``: 64 byte products per instruction,
    twice ``vpdpwssd``; `passes.dot_products` corrects its unsigned operand)."""
    v = variant_of(a)
    return _group(v, target) if v is not None else 2


def _group(v: Variant, target) -> int:
    if v.inputs == "i8" and lanes_of(target) == 16:
        quads = target.dot_product("u8xs8->i32", bits=512)
        pairs = target.dot_product("s16xs16->i32", bits=512)
        if quads is not None and quads.bits == 512 and (pairs is None or target.dot_rate(quads) > target.dot_rate(pairs)):
            return 4
    return 2


def _maps_instruction(v: Variant, target) -> bool:
    """Whether `target` has the instruction of `v` at the width the sketch
    uses, and it computes faster than widening plus FMAs would: 512-bit
    with AVX-512 (Skylake-X has only AVX2's 256-bit vpmaddwd: no sketch),
    256-bit with AVX2; 256-bit vdpbf16ps (AVX512-VL) is not mapped. Intel's
    server cores run vdpbf16ps at half the FMAs' rate (`Target.dot_rate`):
    no bf16 sketch there, `cpu-contraction` computes it in f32."""
    if target.kind != "cpu" or target.vector_bits < 256:
        return False
    bits = 32 * lanes_of(target)
    d = target.dot_product(v.kind, bits=bits)
    if d is None or d.bits != bits or (v.inputs == "bf16" and bits != 512):
        return False
    return target.dot_rate(d) >= 1.0


def _fitting_tiles(rows: int, cols: int, reduction: int, lanes: int, group: int) -> list[tuple[int, int]]:
    """The register tiles of :data:`REGISTER_TILES` that fit loops of these
    ranges (none when the reduction is not whole groups)."""
    if reduction % group or cols % lanes:
        return []
    return [(mr, nr) for mr, nr in REGISTER_TILES[lanes] if rows % mr == 0 and cols % nr == 0]


def weight_packing(target):
    """The :data:`graph.prepack.Decide` of `target`: the group this rule
    packs a matmul's B in when it makes sketches of it (B constant: packed
    once at compile time, `graph.prepack`), None where it makes none; for an
    f32 matmul on a CPU, the column panels the contraction rule reads B in
    (`graph.prepack.Panels`). Its ``share_costly`` attribute says whether
    `graph.task` computes costly repeated subexpressions once (`graph.share`),
    its ``fuse_rows`` whether it joins row-wise chains of reductions into one
    task (`graph.task._merge_rows`), and attentions too (`_merge_attention`),
    its ``reciprocals`` whether a division by a broadcast value becomes a
    multiplication by its reciprocal (`graph.normalize.reciprocal_divisors`),
    its ``winograd`` whether 3x3 convolutions are computed in F(4x4, 3x3)
    (`graph.winograd`, while `graph.task.WINOGRAD` is on)."""

    def decide(inputs: str, output: str, m: int, n: int, k: int) -> int | Panels | None:
        if (inputs, output) == ("f32", "f32"):
            # FMA, no dot product: B in panels of two vectors, the width of
            # the register tiles the contraction rule picks (8 x 32, 6 x 16).
            width = 2 * lanes_of(target)
            return Panels(width) if target.kind == "cpu" and n % width == 0 and n > width else None
        v = next((v for v in VARIANTS if (v.inputs, v.output) == (inputs, output)), None)
        if v is not None and takes_amx(target, m, n, k, v.inputs):
            return AMX_GROUPS[v.inputs]  # B in the groups of AMX's B tiles' rows (`search.rules.amx`)
        if v is None or not _maps_instruction(v, target):
            return None
        group = _group(v, target)
        if not _fitting_tiles(m, n, k, lanes_of(target), group):
            return None
        width = 2 * lanes_of(target)
        if v.inputs == "bf16" and n % width == 0 and n > width:
            # bf16 pairs in column panels (the int8 contractions are lowered
            # by `passes.dot_products` from their own layout).
            return Panels(width, group)
        return group

    # On a CPU an exp costs more than a pass over memory: a subexpression two
    # tasks repeat is computed once (`graph.share`). On a GPU the softmax
    # is bound by memory, and recomputing is the cheaper of the two.
    decide.share_costly = target.kind == "cpu"
    # On a CPU a softmax's or a layer norm's ops are one task computed row
    # by row (`graph.task._merge_rows`, the `cpu-row-fused` rule); the GPU
    # rules take them one by one (warp reductions).
    decide.fuse_rows = target.kind == "cpu"
    # On a CPU a division by a row's value (a softmax's sum) is a
    # multiplication by its reciprocal (`graph.normalize.reciprocal_divisors`):
    # vdivps costs 5-10 multiplications. The GPU's warp reductions take a
    # reduction without an epilogue, and its softmax is bound by memory.
    decide.reciprocals = target.kind == "cpu"
    # On a CPU a 3x3 f32 convolution with constant weights is computed in
    # Winograd's F(4x4, 3x3) (`graph.winograd`): a quarter of the
    # multiply-adds, for transforms bound by memory.
    decide.winograd = target.kind == "cpu"
    return decide


def takes_amx(target, m: int, n: int, k: int, inputs: str = "bf16") -> bool:
    """Whether `search.rules.amx` computes a matmul of these extents (k in
    elements) on `inputs` (bf16 or i8) on `target`: the CPU has AMX tiles
    for the type, and the extents are whole 16 x 16 tiles and steps of 16
    groups."""
    group = AMX_GROUPS.get(inputs)
    feature = "amx_bf16" if inputs == "bf16" else "amx_int8"
    if group is None or target.kind != "cpu" or not (target.has("amx_tile") and target.has(feature)):
        return False
    return m % AMX_TILE == 0 and n % AMX_TILE == 0 and k % (AMX_TILE * group) == 0


def lanes_of(target) -> int:
    """32-bit lanes of one accumulator: 16 with AVX-512, 8 with AVX2."""
    return 16 if target.vector_bits >= 512 else 8


# (rows, columns) of the register tile, by lanes: rows x columns / lanes
# accumulators of AVX-512's 32 registers (AVX2's 16), the rest for the B
# vectors and the broadcast A.
REGISTER_TILES = {16: ((8, 32), (4, 64), (6, 64), (12, 32)), 8: ((4, 16), (6, 16), (2, 32))}


def variant_of(a: OpStructure) -> Variant | None:
    """The variant whose types and widening `a`'s body has. int8 operands
    may be unsigned (``arith.extui``), one of the two: `passes.dot_products`
    widens each as its body does, and ``vpdpbusd`` takes an unsigned byte
    operand as it is; two unsigned operands are not mapped."""
    for v in VARIANTS:
        if a.input_dtypes[:2] == (v.inputs, v.inputs) and a.dtype == v.output and v.extension in a.body_ops:
            return v
        if v.inputs == "i8" and a.input_dtypes[:2] == ("i8", "i8") and a.dtype == "i32":
            if sorted(a.input_extensions[:2]) == ["arith.extsi", "arith.extui"]:
                return v
    return None


def matmul_dims(a: OpStructure) -> tuple[int | None, int, int, int] | None:
    """(batch, m, n, k) when `a` is C[m, n] += A[m, k] * B[k, n], or with a
    leading batch loop C[b, m, n] += A[b, m, k] * B[b, k, n] (attention's
    products in a transformer; `batch` is None without one), with narrow
    inputs widened in the body (:data:`VARIANTS`), each operand's last
    dimension contiguous."""
    if len(a.loop_ranges) not in (3, 4) or len(a.reductions) != 1 or a.compound_dims or not a.is_mul_add:
        return None
    if a.num_inputs != 2 or variant_of(a) is None:
        return None
    (k,) = a.reductions
    out = a.output_dims
    if len(out) != len(a.loop_ranges) - 1 or None in out:
        return None
    *lead, m, n = out
    if a.operand_dims[0] != (*lead, m, k) or a.operand_dims[1] != (*lead, k, n):
        return None
    return (lead[0] if lead else None), m, n, k


def packed_matmul_dims(a: OpStructure) -> tuple[int, int, int, int, int | None] | None:
    """(m, n, pairs, pair, panel) loops when `a` is `graph.prepack`'s matmul
    C[m, n] += A[m, pairs, pair] * B[pairs, n, pair] on narrow inputs (panel
    None), or its form on B in column panels, C[m, q, n] += A[m, pairs, pair]
    * B[q, pairs, n, pair] (panel the loop q of the panels)."""
    if a.compound_dims or not a.is_mul_add or a.num_inputs != 2 or variant_of(a) is None:
        return None
    if len(a.loop_ranges) == 4 and a.reductions == (2, 3):
        if a.operand_dims[0] == (0, 2, 3) and a.operand_dims[1] == (2, 1, 3) and a.output_dims == (0, 1):
            return 0, 1, 2, 3, None
    if len(a.loop_ranges) == 5 and a.reductions == (3, 4):
        if a.operand_dims[0] == (0, 3, 4) and a.operand_dims[1] == (1, 3, 2, 4) and a.output_dims == (0, 1, 2):
            return 0, 2, 3, 4, 1
    return None


def conv_dims(a: OpStructure) -> tuple[int, int, int] | None:
    """(ow, f, c) loops of a 2-D NHWC/HWCF convolution with unit strides
    and dilations (loops n, oh, ow, f, kh, kw, c) on narrow inputs."""
    if a.name != "linalg.conv_2d_nhwc_hwcf" or len(a.loop_ranges) != 7 or len(a.shapes) < 2:
        return None
    n, oh, ow, f, kh, kw, c = a.loop_ranges
    if tuple(a.shapes[0]) != (n, oh + kh - 1, ow + kw - 1, c):
        return None  # strided or dilated
    return 2, 3, 6


def loop_sizes(loops: int, names: dict[str, int]):
    """A builder of tile-size lists over `loops` loops, by loop name."""

    def sizes(**at: int | str) -> list[int | str]:
        out: list[int | str] = [0] * loops
        for d, val in at.items():
            out[names[d]] = val
        return out

    return sizes


def pack_reduction(w: ScheduleWriter, ctx: SketchContext, red: int, group: int, copy_tile: list[int], copy_step: list[int]) -> None:
    """Pack the reduction loop `red` of the anchor by `group`: the first
    input's pack becomes a view, the second's a copy over threads
    (`copy_tile` a thread step, `copy_step` a vector step)."""
    anchor = ctx.anchor
    loops = len(anchor.loop_ranges)
    packed = w.pack_loops(
        w.match_op_id("%root", anchor.op_id), [group if d == red else 0 for d in range(loops)], op_id=anchor.op_id
    )
    pack_b = w.producer_of(packed, 1)
    w.lower_pack(w.producer_of(packed, 0))
    tb, _ = w.tile_forall(pack_b, copy_tile)
    w.tile_for(tb, copy_step)


def _register_pieces(w: ScheduleWriter, op: str, piece: list[int | str], rows: int, cols: int, mr: int, nr: int, lanes: int) -> None:
    """Tile `op` into 1 x lanes pieces (loops `rows` < or > `cols`) and
    unroll them over the mr x nr register tile."""
    _, loops = w.tile_for(op, piece)
    l_rows, l_cols = loops if rows < cols else loops[::-1]
    if nr > lanes:
        w.unroll(l_cols, nr // lanes)
    if mr > 1:
        w.unroll(l_rows, mr)


def tile_others_in_pieces(w: ScheduleWriter, ctx: SketchContext, forall: str, cols: int, lanes: int) -> None:
    """The fill and the fused consumers in pieces of one accumulator (a
    whole thread tile's row as one vector, 1024 x i32, crashed LLVM's code
    generation)."""
    anchor = ctx.anchor
    for o in ctx.ops:
        if o.op_id == anchor.op_id:
            continue
        o_sizes = [0] * len(o.loop_ranges)
        for a_d, o_d in zip(anchor.output_dims, o.output_dims):
            if o_d is not None and a_d is not None:
                o_sizes[o_d] = lanes if a_d == cols else 1
        w.tile_each(w.match_op_id(forall, o.op_id), o_sizes)


def _vectorize(w: ScheduleWriter, func: str, *, extra_hoist: bool = False, shuffles: bool = False) -> str:
    """Vectorize with the widening folded into the contractions, the
    accumulators in registers (`extra_hoist`: one more round, for the
    third reduction loop of a convolution), then bufferize; returns the
    function. `shuffles`: lower the packing's transposes to one shuffle
    each (bf16 pairs)."""
    func = w.vectorize_children(func)
    w.apply_patterns(
        func, ["canonicalization", "tensor.fold_tensor_subset_ops_into_vector_transfers", "vector.fold_arith_extension"]
    )
    w.hoist_accumulators(func)
    w.cleanup(func)
    if extra_hoist:
        loops = w.match_ops(func, ["scf.for"])
        w.emit(f"transform.loop.hoist_loop_invariant_subsets {loops} : !transform.any_op")
        w.cleanup(func)
    func = w.match_func(w.bufferize("%root"))
    if shuffles:
        # The packing's 2 x 16 -> 16 x 2 transposes of bf16 pairs as one
        # shuffle each (LLVM: one vpermw of two rows). Left to the LLVM
        # conversion, each was about 60 instructions with stack spills, 5%
        # of the bf16 GEMM 1024 (4% faster at the same knobs, Zen 5). The
        # int8 quads' 4 x 16 transposes are left to it: it makes them
        # vpermt2b already, and the shuffle took three times the code.
        w.apply_patterns(func, ['vector.lower_transpose lowering_strategy = "shuffle_1d"', "canonicalization"])
    return func


class DotProductTiling(Rule):
    name = "cpu-dot-product"

    def condition(self, ctx: SketchContext) -> RuleResult:
        a = ctx.anchor
        v = variant_of(a) if a.num_inputs == 2 and a.is_mul_add else None
        if v is None or not _maps_instruction(v, ctx.target):
            return RuleResult.SKIP
        return RuleResult.APPLY if self._tiles(a, lanes_of(ctx.target), group_of(a, ctx.target)) else RuleResult.SKIP

    @staticmethod
    def _tiles(a: OpStructure, lanes: int, group: int) -> list[tuple[int, int]]:
        """The register tiles that fit the op's loops (none: not an op of
        this rule)."""
        r = a.loop_ranges
        packed = packed_matmul_dims(a)
        if packed is not None:
            m, n, pairs, pair, _ = packed
            return _fitting_tiles(r[m], r[n], r[pairs] * r[pair], lanes, group) if r[pair] == group else []
        mm = matmul_dims(a)
        dims = mm[1:] if mm else conv_dims(a)
        if dims is None:
            return []
        rows, cols, red = dims
        return _fitting_tiles(r[rows], r[cols], r[red], lanes, group)

    def apply(self, ctx: SketchContext) -> list[Sketch]:
        tiles = self._tiles(ctx.anchor, lanes_of(ctx.target), group_of(ctx.anchor, ctx.target))
        packed = packed_matmul_dims(ctx.anchor)
        if packed is not None:
            m, n, pairs, _, panel = packed
            return [self._sketch(ctx, m, n, pairs, mr, nr, packed=True, panel=panel) for mr, nr in tiles]
        mm = matmul_dims(ctx.anchor)
        if mm is None:
            return [self._conv_sketch(ctx, mr, nr) for mr, nr in tiles]
        batch, m, n, k = mm
        return [self._sketch(ctx, m, n, k, mr, nr, batch=batch) for mr, nr in tiles]

    def _sketch(
        self,
        ctx: SketchContext,
        m: int,
        n: int,
        k: int,
        mr: int,
        nr: int,
        batch: int | None = None,
        packed: bool = False,
        panel: int | None = None,
    ) -> Sketch:
        """A matmul, or with `batch` (its loop) a batched one: each batch a
        thread step, and its 1 x 16 pieces folded to (16 x 2) . (2) like a
        convolution's (`passes.dot_products` lowers them). `packed`: the
        anchor is `graph.prepack`'s matmul on a packed constant B, loops
        (m, n, pairs `k`, pair), which the packing here would make; with
        `panel` (the loop of B's column panels, before n), threads over
        panels too, a panel a step in the register tile, and B read in
        place (its panel is already the contiguous tile a copy would make)."""
        lanes = lanes_of(ctx.target)
        anchor = ctx.anchor
        r = anchor.loop_ranges
        group = group_of(anchor, ctx.target)
        pairs = r[k] if packed else r[k] // group
        pair = len(r) - 1 if packed else len(r)  # the loop of the two elements of a pair, after packing
        specs = [
            KnobSpec(f"p_d{m}", tuple(d for d in divisors(r[m]) if d % mr == 0), doc=f"parallel (scf.forall) tile of loop d{m}"),
            KnobSpec(f"p_d{n}", tuple(d for d in divisors(r[n]) if d % nr == 0), doc=f"parallel (scf.forall) tile of loop d{n}"),
            KnobSpec(f"k_d{k}", divisors(pairs), doc=f"reduction (cache) tile of loop d{k}, in pairs"),
        ]
        if panel is not None:
            specs.append(KnobSpec(f"p_d{panel}", divisors(r[panel]), doc=f"parallel (scf.forall) tile of loop d{panel} (panels)"))
        else:
            # The packed B read in place saves a copy of it per thread tile of
            # rows (B's rows are then N x 4 bytes apart; 4 KiB at N = 1024).
            specs.append(
                KnobSpec("pack", (0, 1), alternatives=True, doc="0: copy the packed B tile to a contiguous buffer; 1: read it in place")
            )
        w = ScheduleWriter()
        h = {sp.name: w.knob(sp.name, sp.options) for sp in specs if not sp.alternatives}

        names = {"m": m, "n": n, "k": k, "pair": pair}
        if batch is not None:
            names["b"] = batch
        if panel is not None:
            names["q"] = panel
        sizes = loop_sizes(pair + 1, names)
        lead = [1] if batch is not None else []  # the batch loop, a step at a time
        # The layout: the reduction in pairs (A's pack is a view, B's a copy
        # over threads, 16 pair rows by 16 columns a step).
        if not packed:
            pack_reduction(w, ctx, k, group, lead + [16 if pairs % 16 == 0 else 1, 0], lead + [1, lanes])

        # Threads, the cache tile of pairs, the packed B tile.
        thread = {m: h[f"p_d{m}"], n: h[f"p_d{n}"]}
        if batch is not None:
            thread[batch] = 1
        if panel is not None:
            thread[panel] = h[f"p_d{panel}"]
        forall = tile_root_and_fuse(w, ctx, root_sizes_from_anchor(ctx, thread))
        a_h, _ = w.tile_for(w.match_op_id(forall, anchor.op_id), sizes(k=h[f"k_d{k}"]))
        v = variant_of(anchor)
        if panel is None:
            cur = a_h
            (a_h,) = w.alternatives(
                "pack",
                [lambda wr: [wr.pack_operand(cur, 1, 3, [v.inputs, v.inputs, v.output], sorted((k, n, pair)))], lambda wr: [cur]],
            )
        # The register tile, the pairs loop inside it, 1 x 16 pieces unrolled.
        a_h, _ = w.tile_for(a_h, sizes(m=mr, n=nr, **({"q": 1} if panel is not None else {})))
        a_h, _ = w.tile_for(a_h, sizes(k=1))
        _register_pieces(w, a_h, sizes(m=1, n=lanes), m, n, mr, nr, lanes)
        # The packed tile's copy a row of 16 pairs per step.
        w.tile_each(w.match_ops(forall, ["linalg.copy"]), lead + [1, lanes, 0])
        tile_others_in_pieces(w, ctx, forall, n, lanes)
        if batch is not None:
            # As a convolution's: accumulators carried as tensors first, then
            # the unit loops folded away, then vectorized.
            func = w.match_func("%root")
            for _ in range(2):
                loops = w.match_ops(func, ["scf.for"])
                w.emit(f"transform.loop.hoist_loop_invariant_subsets {loops} : !transform.any_op")
                w.cleanup(func)
            w.apply_patterns(func, ["linalg.fold_unit_extent_dims_via_slices", "canonicalization"])
            _vectorize(w, w.match_func("%root"), shuffles=v.inputs == "bf16")
            return self._finish(ctx, w, specs, m, n, k, mr, nr, panel=panel)
        func = _vectorize(w, w.match_func("%root"), shuffles=v.inputs == "bf16")
        if v.inputs != "bf16":
            # The int8 contractions stay as they are: `passes.dot_products`
            # rewrites them when the module is lowered; the rest is plain
            # transfers, lowered there too.
            return self._finish(ctx, w, specs, m, n, k, mr, nr, panel=panel)
        w.apply_patterns(func, ["x86vector.vector_contract_to_packed_type_dot_product"])
        # The rest (fill, consumers, copies) as in `lower_vectors`, except that
        # transfers stay n-D: `passes.vector_flatten` makes the packed tile's
        # reads one load each when the module is lowered.
        w.apply_patterns(func, ["vector.cast_away_vector_leading_one_dim", "canonicalization"])
        w.apply_patterns(func, ['vector.lower_contraction lowering_strategy = "outerproduct"'])
        w.apply_patterns(
            func,
            [
                "vector.transfer_permutation_patterns",
                'vector.lower_multi_reduction lowering_strategy = "innerparallel"',
                "vector.lower_outerproduct",
                "canonicalization",
            ],
        )
        return self._finish(ctx, w, specs, m, n, k, mr, nr, panel=panel)

    def _conv_sketch(self, ctx: SketchContext, mr: int, nr: int) -> Sketch:
        """A convolution (n, oh, ow, f, kh, kw, c): the channels in pairs
        (the input's pack a view, the filter's a copy), threads over output
        rows and channels, the pairs in cache tiles, a register tile of
        `mr` output pixels of a row by `nr` channels, the window and pair
        loops inside it, and 1 x 16 pieces that `fold_unit_extent_dims`
        leaves as (16 x 2) . (2) contractions (`passes.dot_products` lowers
        them, bf16 as int8)."""
        lanes = lanes_of(ctx.target)
        anchor = ctx.anchor
        r = anchor.loop_ranges
        n_, oh, ow, f, kh, kw, c = range(7)
        pair = 7
        group = group_of(anchor, ctx.target)
        pairs = r[c] // group
        specs = [
            KnobSpec(f"p_d{oh}", divisors(r[oh]), doc=f"parallel (scf.forall) tile of loop d{oh} (output rows)"),
            KnobSpec(f"p_d{f}", tuple(d for d in divisors(r[f]) if d % nr == 0), doc=f"parallel (scf.forall) tile of loop d{f}"),
            KnobSpec(f"k_d{c}", divisors(pairs), doc=f"reduction (cache) tile of loop d{c}, in pairs"),
        ]
        w = ScheduleWriter()
        h = {sp.name: w.knob(sp.name, sp.options) for sp in specs}

        sizes = loop_sizes(pair + 1, {"n": n_, "oh": oh, "ow": ow, "f": f, "kh": kh, "kw": kw, "c": c, "pair": pair})
        pack_reduction(w, ctx, c, group, [1, 0, 0, 0], [1, 1, 1, lanes])
        forall = tile_root_and_fuse(
            w, ctx, root_sizes_from_anchor(ctx, {n_: 1, oh: h[f"p_d{oh}"], ow: r[ow], f: h[f"p_d{f}"]})
        )
        a_h, _ = w.tile_for(w.match_op_id(forall, anchor.op_id), sizes(c=h[f"k_d{c}"]))
        a_h, _ = w.tile_for(a_h, sizes(n=1, oh=1, ow=mr, f=nr))
        a_h, _ = w.tile_for(a_h, sizes(kh=1, kw=1, c=1))
        _register_pieces(w, a_h, sizes(ow=1, f=lanes), ow, f, mr, nr, lanes)
        tile_others_in_pieces(w, ctx, forall, f, lanes)
        # The output tile is carried by the window and pair loops as a
        # tensor before the unit loops are folded away (after, the slices
        # no longer match and every pair step reloaded its accumulators).
        func = w.match_func("%root")
        for _ in range(3):
            loops = w.match_ops(func, ["scf.for"])
            w.emit(f"transform.loop.hoist_loop_invariant_subsets {loops} : !transform.any_op")
            w.cleanup(func)
        w.apply_patterns(func, ["linalg.fold_unit_extent_dims_via_slices", "canonicalization"])
        _vectorize(w, w.match_func("%root"), extra_hoist=True, shuffles=variant_of(anchor).inputs == "bf16")
        return self._finish(ctx, w, specs, oh, f, c, mr, nr, prefer_rows=8)

    def _finish(self, ctx, w, specs, m, n, k, mr, nr, prefer_rows: int = 64, panel: int | None = None) -> Sketch:
        r = ctx.anchor.loop_ranges
        prefer = {
            **({"pack": 0} if any(sp.name == "pack" for sp in specs) else {}),
            f"k_d{k}": min(specs[2].options, key=lambda x: abs(x - 128)),
            f"p_d{m}": min(specs[0].options, key=lambda x: abs(x - prefer_rows)),
            f"p_d{n}": min(specs[1].options, key=lambda x: abs(x - 128)),
        }
        forall = [(f"p_d{m}", r[m]), (f"p_d{n}", r[n])]
        if panel is not None:  # 128 columns of panels, as the unpanelled default
            prefer[f"p_d{panel}"] = min(specs[3].options, key=lambda x: abs(x * r[n] - 128))
            forall.append((f"p_d{panel}", r[panel]))
        return Sketch(
            f"{self.name}-{mr}x{nr}",
            ctx.payload,
            w.text(),
            tuple(specs),
            forall=tuple(forall),
            prefer=tuple(sorted(prefer.items())),
        )
