"""An attention (scores, softmax, P.V) as one task, a block of query rows
at a time.

The partitioner joins ``S = Q.K^T`` with its scaling, the softmax over the
rows of S and ``O = P.V`` into one task (`graph.task._merge_attention`).
This rule computes it with ``scf.forall`` over the batch loops and blocks
of query rows (``p_d<i>``), every op fused into it; inside, for one block:

- the scores: register tiles of ``r_rows`` query rows by ``r_keys`` keys
  (vectors along the keys, K^T read in place), the head dimension unrolled
  by ``u_head``, the accumulators starting from zero in registers;
- the scaling and the softmax: one row at a time, reductions in partial
  results two vectors wide (rfactor), elementwise ops two vectors a step
  (as `row_fused` does);
- P.V: register tiles of ``r_rows`` rows by ``r_out`` output columns, the
  keys unrolled by ``u_keys``.

A block's scores (rows x keys) stay in the cache between the three, where
apart they go to memory and back twice. The whole row of keys is in the
block: this is not the online softmax of flash attention, and rows longer
than `row_fused.LONGEST_ROW` are left to the per-op rules.
"""

from __future__ import annotations

import math

from mlir_ansor.schedule.writer import ScheduleWriter
from mlir_ansor.search.rules.base import (
    Rule,
    RuleResult,
    SketchContext,
    finish,
    tile_root_and_fuse,
    vector_tile_options,
)
from mlir_ansor.search.rules.multi_level_tiling import UNROLLS
from mlir_ansor.search.rules.row_fused import LONGEST_ROW, own_inits, row_steps
from mlir_ansor.search.sketch import OpStructure, Sketch, nearest_option
from mlir_ansor.search.space import KnobSpec, divisors

ROWS = (1, 2, 4, 6, 8)
"""Register rows of both matmuls (with two vectors of columns: 2 to 16
accumulators)."""


def attention_ops(ops: tuple[OpStructure, ...]) -> tuple[OpStructure, OpStructure] | None:
    """The scores matmul and the P.V matmul of an attention task, or None:
    two multiply-accumulate ops with one reduction each, the second the
    task's anchor, with the same leading (batch and query row) loops."""
    mats = [o for o in ops if o.name != "linalg.fill" and o.is_mul_add]
    if len(mats) != 2 or any(len(o.reductions) != 1 or o.compound_dims for o in mats):
        return None
    scores, out = mats
    nr = len(out.loop_ranges) - 2
    if nr < 1 or out.role != "anchor" or scores.loop_ranges[:nr] != out.loop_ranges[:nr]:
        return None
    if out.reductions != (nr + 1,) or scores.reductions != (nr + 1,) or out.loop_ranges[-1] != scores.loop_ranges[nr]:
        return None
    return scores, out


class Attention(Rule):
    name = "cpu-attention"

    def condition(self, ctx: SketchContext) -> RuleResult:
        if ctx.target.kind != "cpu":
            return RuleResult.SKIP
        found = attention_ops(ctx.ops)
        if found is None or found[1].loop_ranges[-1] > LONGEST_ROW:
            return RuleResult.SKIP
        return RuleResult.APPLY_AND_SKIP_REST

    def apply(self, ctx: SketchContext) -> list[Sketch]:
        scores, out = attention_ops(ctx.ops)
        ranges = out.loop_ranges  # batch..., query rows, output columns, keys
        nr = len(ranges) - 2
        keys, head, cols = scores.loop_ranges[nr], scores.loop_ranges[-1], ranges[nr]
        lanes = ctx.lanes()
        rows_d = nr - 1
        specs = [KnobSpec("r_rows", tuple(x for x in ROWS if ranges[rows_d] % x == 0), doc="register rows of both matmuls")]
        # Keys that no vector divides (a sequence of 100) also get key tiles
        # of whole vectors, their remainder peeled, beside the divisors.
        odd_keys = keys % lanes != 0
        key_opts = set(vector_tile_options(keys, lanes))
        if odd_keys:
            key_opts |= set(vector_tile_options(keys, lanes, partial=True))
        specs.append(KnobSpec("r_keys", tuple(sorted(key_opts)), doc="vector tile of the scores' key loop"))
        specs.append(KnobSpec("u_head", tuple(x for x in UNROLLS if head % x == 0), doc="inner unroll of the scores' head loop"))
        specs.append(KnobSpec("r_out", vector_tile_options(cols, lanes), doc="vector tile of P.V's output columns"))
        specs.append(KnobSpec("u_keys", tuple(x for x in UNROLLS if keys % x == 0), doc="inner unroll of P.V's key loop"))
        for d in range(nr):
            doc = f"parallel (scf.forall) tile of loop d{d}" + (" (query rows)" if d == rows_d else " (batch)")
            specs.append(KnobSpec(f"p_d{d}", divisors(ranges[d]), multiple_of="r_rows" if d == rows_d else None, doc=doc))

        w = ScheduleWriter()
        h = {sp.name: w.knob(sp.name, sp.options) for sp in specs}
        forall = tile_root_and_fuse(w, ctx, [h[f"p_d{d}"] for d in range(nr)] + [0, 0])
        ones = [1] * rows_d
        # The scores: register tiles, accumulators from a zero fill fused in.
        # Keys outer, rows inner: a panel of K^T (head dim x r_keys) is
        # read from L2 once per block and reused by every register tile
        # of rows from L1.
        w.tile_for(w.match_op_id(forall, scores.op_id), [0] * nr + [h["r_keys"], 0], fuse=True)
        w.tile_for(w.match_op_id(forall, scores.op_id), ones + [h["r_rows"], 0, 0], fuse=True)
        w.tile_each(w.match_op_id(forall, scores.op_id), [0] * (nr + 1) + [h["u_head"]])
        # The scaling and the softmax: a row at a time.
        rows = tuple(o for o in ctx.ops if o.name != "linalg.fill" and o.op_id not in (scores.op_id, out.op_id))
        row_steps(w, forall, rows, nr, lanes)
        # P.V: register tiles.
        # Columns outer, rows inner, for the same reason (a V panel of keys
        # x r_out: 24 KB at 384 keys by 16 columns).
        w.tile_for(w.match_op_id(forall, out.op_id), [0] * nr + [h["r_out"], 0], fuse=True)
        w.tile_for(w.match_op_id(forall, out.op_id), ones + [h["r_rows"], 0, 0], fuse=True)
        w.tile_each(w.match_op_id(forall, out.op_id), [0] * (nr + 1) + [h["u_keys"]])
        if odd_keys:
            w.peel_partial_loops("%root")
        finish(w, vectorize=True, reduction="innerreduction")
        block = nearest_option(divisors(ranges[rows_d]), 16)
        prefer = (
            ("r_rows", nearest_option(specs[0].options, 4)),
            ("r_keys", nearest_option(specs[1].options, 2 * lanes)),
            ("u_head", max(specs[2].options)),
            ("r_out", nearest_option(specs[3].options, 2 * lanes)),
            ("u_keys", max(specs[4].options)),
        ) + tuple((f"p_d{d}", block if d == rows_d else 1) for d in range(nr))
        forall_dims = tuple((f"p_d{d}", ranges[d]) for d in range(nr))
        notes = (f"attention: {math.prod(ranges[:nr])} query rows of {keys} keys",)
        return [Sketch(self.name, own_inits(ctx.payload), w.text(), tuple(specs), notes=notes, forall=forall_dims, prefer=prefer)]
