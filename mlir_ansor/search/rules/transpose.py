"""Transposes: register blocks, read along the input's contiguous
dimension, turned in registers, written along the output's.

A task that only permutes its input (a ``linalg.transpose``, or a generic
that only copies through permuted maps) and moves the output's contiguous
dimension is left alone by the elementwise rule (`elementwise.py`: its
permuted transfers, lowered with the rest of the vector patterns, sent the
canonicalization into endless loops), and the default schedule ran it one
element at a time: BERT's K^T (``[1, 128, 12, 64] -> [1, 12, 64, 128]``)
took 60 us warm at 1 thread on Zen 4.

Here each ``scf.forall`` tile (``p_d<i>``) is cut into blocks of ``r_d<v>``
x ``r_d<c>`` elements, v the output's contiguous loop and c the input's,
every other loop one step at a time. A block is vectorized on tensors, and
its permuted read becomes, before anything else runs on it, a read along c
and a ``vector.transpose`` (`transfer_permutation_patterns` alone); after
bufferization the unit dimensions are cast away and the transpose is
lowered to shuffles (``shuffle_16x16``: AVX-512's 16 x 16 f32 blocks in
64 two-source shuffles; other shapes one flat shuffle). The steps run one
pattern set at a time, the permutation patterns never beside the
canonicalization that folds their transposes back. K^T above: 9-12 us warm,
62-80 us with cold caches (60 and 98 for the default schedule).

Only blocks that divide their loops are offered (no masks); a task where
either loop has none of 4, 8 or 16 among its divisors keeps the default
schedule.
"""

from __future__ import annotations

from mlir_ansor.schedule.writer import ScheduleWriter
from mlir_ansor.search.rules.base import Rule, RuleResult, SketchContext, tile_root_and_fuse
from mlir_ansor.search.sketch import OpStructure, Sketch
from mlir_ansor.search.space import KnobSpec, divisors

BLOCKS = (4, 8, 16)


def _turned_loops(op: OpStructure) -> tuple[int, int] | None:
    """(v, c) for a pure permutation `op` that moves the output's contiguous
    dimension: v the output's last loop, c the input's last; else None."""
    if op.num_inputs != 1 or not op.is_elementwise or op.body_ops or len(op.operand_dims) != 2:
        return None
    ins, out = op.operand_dims
    if any(d is None for d in ins + out) or sorted(ins) != sorted(out) or len(set(out)) != len(out):
        return None
    v, c = out[-1], ins[-1]
    return (v, c) if v != c else None


class TransposeBlocks(Rule):
    name = "cpu-transpose"

    def condition(self, ctx: SketchContext) -> RuleResult:
        if ctx.target.kind != "cpu" or len(ctx.ops) != 1:
            return RuleResult.SKIP
        loops = _turned_loops(ctx.root)
        if loops is None:
            return RuleResult.SKIP
        ranges = ctx.root.loop_ranges
        if not all(any(ranges[d] % b == 0 for b in BLOCKS) for d in loops):
            return RuleResult.SKIP
        return RuleResult.APPLY_AND_SKIP_REST

    def apply(self, ctx: SketchContext) -> list[Sketch]:
        root = ctx.root
        ranges = root.loop_ranges
        v, c = _turned_loops(root)
        specs = [
            KnobSpec(f"r_d{d}", tuple(b for b in BLOCKS if ranges[d] % b == 0), doc=f"register block of loop d{d}")
            for d in (v, c)
        ]
        for d in range(len(ranges)):
            base = f"r_d{d}" if d in (v, c) else None
            specs.append(KnobSpec(f"p_d{d}", divisors(ranges[d]), multiple_of=base, doc=f"parallel (scf.forall) tile of loop d{d}"))
        w = ScheduleWriter()
        h = {sp.name: w.knob(sp.name, sp.options) for sp in specs}
        forall = tile_root_and_fuse(w, ctx, [h[f"p_d{d}"] for d in range(len(ranges))])
        block = [h[f"r_d{d}"] if d in (v, c) else 1 for d in range(len(ranges))]
        w.tile_each(w.match_op_id(forall, root.op_id), block)
        w.vectorize_each(w.match_op_id("%root", root.op_id), block)
        func = w.match_func("%root")
        w.cleanup(func)
        w.apply_patterns(func, ["vector.transfer_permutation_patterns"])
        func = w.match_func(w.bufferize("%root"))
        w.apply_patterns(func, ["memref.fold_memref_alias_ops"])
        w.apply_patterns(func, ["vector.cast_away_vector_leading_one_dim"])
        w.apply_patterns(func, ["vector.drop_unit_dims_with_shape_cast"])
        w.apply_patterns(func, ['vector.lower_transpose lowering_strategy = "shuffle_16x16"'])
        w.apply_patterns(
            func,
            ["vector.transfer_to_scf max_transfer_rank = 1 full_unroll = true", "vector.lower_transfer max_transfer_rank = 1"],
        )
        w.apply_patterns(func, ["vector.lower_shape_cast"])
        # Default: 16 x 16 blocks where they divide, one thread tile per core's share.
        prefer = tuple((sp.name, max(sp.options)) for sp in specs[:2])
        forall = tuple((f"p_d{d}", ranges[d]) for d in range(len(ranges)))
        return [Sketch(self.name, ctx.payload, w.text(), tuple(specs), forall=forall, prefer=prefer)]
