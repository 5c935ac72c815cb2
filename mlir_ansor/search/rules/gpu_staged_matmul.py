"""``cuda-staged-matmul``: a plain f16/f32 matmul with its operand tiles
staged in shared memory and its output tile kept in registers across the
whole K loop (the GPU rule tried first).

Per block (``#gpu.block``) a BM x BN tile of C; a loop over K in steps of
BK; in each step all threads of the block copy the BM x BK tile of A and the
BK x BN tile of B to `.shared` in 16-byte pieces (the copy is a forall over
the block's linear thread id, so the copy's shape does not need to match the
compute's thread shape; a barrier follows), then compute from shared memory.
Two sketches:

  * ``cuda-mma-smem`` (f16, sm_80+): each warp (``#gpu.warp``) a WM x WN
    tile, as a vector contraction that `passes/nvvm.py` unrolls to 16x8x16
    and turns into ``ldmatrix`` + ``mma.sync``;
  * ``cuda-tiled`` (f16, f32): each thread (``#gpu.thread``) a register tile
    of (BM / threads_y) x (BN / threads_x), as a vector contraction lowered
    to FMAs.

The operand tiles are vectorized here; `passes/nvvm.py` hoists the output
tile's read and write out of the K loop once the thread foralls are mapped,
which is what keeps the accumulator in registers.

Both sketches have a ``stages`` knob: 1 copies synchronously (load, store
to shared, barrier); S = 2 or 3 keeps S copies of the A/B tiles in shared
memory and copies with ``cp.async`` S - 1 K steps ahead of the compute
(`passes/async_copies.py`, after the thread mapping). The shared-memory
bound counts S x the tiles (`GpuSketch.smem_bytes`), and S > 1 needs the
copies to give every thread of the block a piece (`GpuSketch.violation`).
"""

from __future__ import annotations

from mlir_ansor.ir.dtypes import element_bytes
from mlir_ansor.schedule.gpu_writer import GpuScheduleWriter
from mlir_ansor.search.gpu_sketch import GpuSketch, target_limits
from mlir_ansor.search.rules.base import Rule, RuleResult, SketchContext
from mlir_ansor.search.rules.gpu_base import THREAD_COUNTS, fuse_others, is_cuda
from mlir_ansor.search.sketch import OpStructure, Sketch
from mlir_ansor.search.space import KnobSpec, divisors

STAGES = (1, 2, 3)
"""Options of the ``stages`` knob (how many K steps of A/B tiles live in
shared memory at once; 4 and more rarely fit 48 KB of static shared memory
with tiles worth having)."""

#: The layout of a plain matmul: A(m, k), B(k, n), C(m, n) over loops (m, n, k).
MATMUL_DIMS = ((0, 2), (2, 1), (0, 1))


def _input_dtype(op: OpStructure) -> str:
    """The element type of both operands ("" when they differ)."""
    types = set(op.input_dtypes or (op.dtype,))
    return types.pop() if len(types) == 1 else ""


def _is_epilogue(op: OpStructure, anchor: OpStructure) -> bool:
    """An elementwise op over the matmul's (m, n) that reads only the
    matmul's result (an f16 GEMM's rounding of its f32 accumulator)."""
    return (
        op.iterator_types == ("parallel", "parallel")
        and op.loop_ranges == anchor.loop_ranges[:2]
        and op.num_inputs == 1
        and op.operand_dims == ((0, 1), (0, 1))
        and op.dtype in ("f16", "f32")
    )


def is_plain_matmul(op: OpStructure) -> bool:
    """C(m, n) += A(m, k) * B(k, n), whatever the op is called."""
    return (
        op.operand_dims == MATMUL_DIMS
        and op.iterator_types == ("parallel", "parallel", "reduction")
        and op.is_mul_add
        and op.num_inputs == 2
    )


class StagedMatmul(Rule):
    name = "cuda-staged-matmul"

    def condition(self, ctx: SketchContext) -> RuleResult:
        a = ctx.anchor
        if not is_cuda(ctx) or not is_plain_matmul(a) or a.dtype not in ("f16", "f32"):
            return RuleResult.SKIP
        if _input_dtype(a) != a.dtype and (_input_dtype(a), a.dtype) != ("f16", "f32"):
            return RuleResult.SKIP  # operands and accumulator: both f16, both f32, or f16 into f32
        others = [o for o in ctx.ops if o.op_id != a.op_id and o.name != "linalg.fill"]
        if others and not (len(others) == 1 and _is_epilogue(others[0], a)):
            return RuleResult.SKIP  # fused consumers: the contraction rule handles them
        return RuleResult.APPLY

    def apply(self, ctx: SketchContext) -> list[Sketch]:
        out: list[Sketch] = []
        for tensor_cores in (True, False):
            sk = self._sketch(ctx, tensor_cores=tensor_cores)
            if sk is not None:
                out.append(sk)
        return out

    def _sketch(self, ctx: SketchContext, *, tensor_cores: bool) -> GpuSketch | None:
        anchor, ops, target = ctx.anchor, ctx.ops, ctx.target
        in_dtype = _input_dtype(anchor)
        mixed = in_dtype != anchor.dtype  # f16 operands, an f32 accumulator
        epilogue = next((o for o in ops if o.op_id != anchor.op_id and o.name != "linalg.fill"), None)
        if epilogue is not None and not tensor_cores:
            return None
        if tensor_cores and (in_dtype != "f16" or target.arch < 80):
            return None
        if mixed and not tensor_cores:
            return None  # FMAs on extended f16 vectors left vector.insert_strided_slice the NVVM lowering refuses
        m, n, k = anchor.loop_ranges
        nbytes = element_bytes(in_dtype)
        vw = 16 // nbytes  # elements per 16-byte global load
        out_vw = 16 // element_bytes(anchor.dtype)
        if tensor_cores:
            if m % 16 or n % 8 or k % 16 or n % vw:
                return None
            block_m = tuple(x for x in divisors(m) if x % 16 == 0 and 32 <= x <= 256)
            block_n = tuple(x for x in divisors(n) if x % 8 == 0 and x % vw == 0 and 32 <= x <= 256)
            k_opts = tuple(x for x in divisors(k) if x % 16 == 0 and x <= 64)
        else:
            if k % vw or n % vw:
                return None
            block_m = tuple(x for x in divisors(m) if 8 <= x <= 256)
            block_n = tuple(x for x in divisors(n) if x % vw == 0 and 16 <= x <= 256)
            k_opts = tuple(x for x in divisors(k) if x % vw == 0 and x <= 64)
        if not block_m or not block_n or not k_opts:
            return None
        specs = [
            KnobSpec("b_d0", block_m, doc="block tile of M (#gpu.block<y>)"),
            KnobSpec("b_d1", block_n, doc="block tile of N (#gpu.block<x>)"),
        ]
        if tensor_cores:
            specs += [
                KnobSpec("w_d0", tuple(x for x in (16, 32, 64, 128) if m % x == 0), divides="b_d0",
                         doc="warp tile of M (#gpu.warp<y>)"),
                KnobSpec("w_d1", tuple(x for x in (8, 16, 32, 64, 128) if n % x == 0), divides="b_d1",
                         doc="warp tile of N (#gpu.warp<x>)"),
            ]
        else:
            specs += [
                KnobSpec("t_d0", THREAD_COUNTS, divides="b_d0", doc="threads along M (#gpu.thread<y>)"),
                KnobSpec("t_d1", THREAD_COUNTS, divides="b_d1", doc="threads along N (#gpu.thread<x>)"),
            ]
        specs.append(KnobSpec("k_d2", k_opts, doc="reduction tile of K (one shared-memory stage)"))
        stages = STAGES if target.arch >= 80 else (1,)  # cp.async is sm_80+
        specs.append(KnobSpec("stages", stages, doc="shared-memory stages of the A/B tiles: 1 copies synchronously; "
                              "S > 1 copies with cp.async, S - 1 K steps ahead (passes/async_copies.py)"))
        rows = tuple(x for x in divisors(max(m, k)) if x <= 256)
        copies = [("cp_a", "b_d0", "k_d2"), ("cp_b", "k_d2", "b_d1")]
        what = {"cp_a": "the A tile copy", "cp_b": "the B tile copy", "cp_c": "the zero fill of C",
                "cp_e": "the epilogue"}
        if tensor_cores:
            copies.append(("cp_c", "b_d0", "b_d1"))
        ep_vw = 16 // element_bytes(epilogue.dtype) if epilogue is not None else 0
        if epilogue is not None:
            if n % ep_vw:
                return None
            copies.append(("cp_e", "b_d0", "b_d1"))
        for name, *_ in copies:
            specs.append(KnobSpec(name, rows, doc=f"rows per thread and piece of {what[name]} (derived)"))

        w = GpuScheduleWriter()
        h = {sp.name: w.knob(sp.name, sp.options) for sp in specs}
        top = epilogue or anchor
        _, forall = w.tile_forall_mapped(
            w.match_op_id("%root", top.op_id), [h["b_d0"], h["b_d1"]], ["#gpu.block<y>", "#gpu.block<x>"]
        )
        forall = fuse_others(w, ops, top, forall)
        if epilogue is not None:
            # The block's accumulator tile (what the epilogue reads) in shared
            # memory: the warps write their mma tiles to it once, after the K
            # loop; all threads then apply the epilogue to it.
            w.apply_patterns(w.match_func("%root"), ["tensor.fold_tensor_empty", "canonicalization"])
            w.empty_tensors_to_allocations(forall)
        a_h = w.match_op_id(forall, anchor.op_id)
        a_h, _ = w.tile_for(a_h, [0, 0, h["k_d2"]])
        padded, (copy_a, copy_b) = w.promote_inputs(a_h, [0, 1], 3, (in_dtype, in_dtype, anchor.dtype))
        w.distribute_linear(copy_a, [h["cp_a"], vw])
        w.distribute_linear(copy_b, [h["cp_b"], vw])
        w.to_workgroup_memory(forall)
        fills = [o for o in ops if o.op_id != anchor.op_id]
        if tensor_cores:
            w.tile_forall_mapped(padded, [h["w_d0"], h["w_d1"]], ["#gpu.warp<y>", "#gpu.warp<x>"])
            for o in fills:
                if o.name == "linalg.fill":
                    w.distribute_linear(w.match_op_id(forall, o.op_id), [h["cp_c"], out_vw])
            if epilogue is not None:
                w.distribute_linear(w.match_op_id(forall, epilogue.op_id), [h["cp_e"], ep_vw])
        else:
            # The fill gets the compute's thread tiles, so each thread zeroes
            # exactly its own accumulator tile (LLVM then forwards the zeros).
            mapping = ["#gpu.thread<y>", "#gpu.thread<x>"]
            w.tile_forall_mapped(padded, [h["t_d0"], h["t_d1"]], mapping, num_threads=True)
            for o in fills:
                w.tile_forall_mapped(w.match_op_id(forall, o.op_id), [h["t_d0"], h["t_d1"]], mapping, num_threads=True)
        func = w.vectorize_children(w.match_func("%root"))
        if mixed:
            # the operands' extf folded into the contraction (f16 x f16 -> f32):
            # the form mma.sync with f32 accumulators is made from (and FMAs
            # on each element, extended as it is read)
            w.apply_patterns(func, ["vector.fold_arith_extension"])
        if epilogue is not None:
            # a one-row piece of the epilogue (vector<1x8xf32>) left a 2-D
            # broadcast the NVVM lowering refuses
            w.apply_patterns(func, ["vector.cast_away_vector_leading_one_dim"])
        w.cleanup(func)
        w.annotate_stages(w.gpu_bufferize("%root"), h["stages"])

        common = dict(
            **target_limits(target),
            smem_tiles=((nbytes, (("b_d0",), ("k_d2",))), (nbytes, (("k_d2",), ("b_d1",))))
            + (((element_bytes(anchor.dtype), (("b_d0",), ("b_d1",))),) if epilogue is not None else ()),
            staged=True,
            stages_knob="stages",
            multibuffered=(0, 1),
            pipelined_copies=("cp_a", "cp_b"),
            stage_loop=("k_d2", k),
            derived=tuple((name, r, c, {"cp_c": out_vw, "cp_e": ep_vw}.get(name, vw)) for name, r, c in copies),
            min_threads=32,
        )
        if tensor_cores:
            return GpuSketch(
                "cuda-mma-smem", ctx.payload, w.text(), tuple(specs),
                warps=(("b_d0", "w_d0"), ("b_d1", "w_d1")), max_mma_per_warp=32, **common,
            )
        return GpuSketch(
            "cuda-tiled", ctx.payload, w.text(), tuple(specs),
            threads=(("y", "t_d0"), ("x", "t_d1")),
            register_tile=(("b_d0", "t_d0"), ("b_d1", "t_d1")),
            max_register_tile=64, min_register_dim=2, **common,
        )
