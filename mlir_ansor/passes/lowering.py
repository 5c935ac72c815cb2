"""Lowering from (scheduled) Linalg to the LLVM dialect: the pipelines.

The pipelines here take a module whose `func.func`s operate on tensors or
memrefs (the transform script of a sketch bufferizes itself; the untuned
payload does not) to the LLVM dialect; `artifacts.py` turns that into
machine code and a shared library with a C ABI
(`_mlir_ciface_<name>(memref descriptors...)`, :func:`mark_c_interface`).

:func:`lower_to_llvm` is the one entry point (``ansor-lower-to-llvm`` in an
mlir-opt style pipeline, `tools/pipeline.py`): between its upstream pass
pipelines it runs the Python rewrites of `drivers.py` (output buffers,
views and accumulation in place, static driver buffers, strided copies,
byte-wide booleans) and gives large kernels dynamic OpenMP schedules
(:func:`dynamic_schedules`), so no textual pipeline of upstream passes
alone lowers a compiled module the same way. :data:`BUFFERIZE` is the
bufferization the compiler also runs on its own.

Why this order (measured with the pinned wheels, see shared/MLIR-NOTES.md):
- `buffer-results-to-out-params{hoist-static-allocs}` turns returned tensors
  into caller-provided output buffers, so kernels write into numpy arrays;
- `buffer-loop-hoisting` runs before `buffer-deallocation-pipeline` (after it,
  hoisted allocations kept their in-loop deallocs: a double free);
- `finalize-memref-to-llvm` before `convert-scf-to-cf`, else OpenMP regions
  with `memref.alloca_scope` fail to lower;
- `convert-vector-to-scf{full-unroll}` so no `llvm.alloca` stays in loops.
"""

from __future__ import annotations

from mlir import ir, passmanager

from mlir_ansor.ir.attrs import FLOPS_ATTR
from mlir_ansor.ir.rewrite import defining_op, walk_op
from mlir_ansor.passes.amx import amx_microkernels
from mlir_ansor.passes.dot_products import lower_pair_contracts
from mlir_ansor.passes.drivers import (
    accumulate_in_place,
    forward_output_copies,
    static_driver_buffers,
    strided_copies_to_linalg,
    views_into_kernels,
    widen_bool_buffers,
)
from mlir_ansor.passes.lane_loads import scalarize_lane_loads
from mlir_ansor.passes.math_approx import expand_math
from mlir_ansor.passes.vector_flatten import flatten_contiguous_transfers
from mlir_ansor.target import Target

BUFFERIZE = (
    "one-shot-bufferize{bufferize-function-boundaries "
    "function-boundary-type-conversion=identity-layout-map}"
)

# After this, every function takes its results as trailing memref arguments.
_BUFFER_CLEANUP = (
    "buffer-results-to-out-params{hoist-static-allocs=true modify-public-functions=true},"
    "func.func(buffer-loop-hoisting),"
    "buffer-deallocation-pipeline,"
    "canonicalize,cse"
)


def _threads_part(threads: int) -> str:
    # scf.forall -> scf.parallel -> OpenMP. With one thread we still go through
    # OpenMP so that schedules mean the same thing at every thread count.
    return f"scf-forall-to-parallel,convert-scf-to-openmp{{num-threads={max(1, threads)}}},"


def _front(bufferize: bool = True) -> str:
    return (BUFFERIZE + "," if bufferize else "") + _BUFFER_CLEANUP


_TO_LOOPS = "convert-vector-to-scf{full-unroll=true},convert-linalg-to-loops,lower-affine"
_LOOPS_TO_LLVM = (
    "finalize-memref-to-llvm,"
    "convert-scf-to-cf,expand-strided-metadata,lower-affine,"
    "convert-vector-to-llvm{enable-x86vector=true enable-amx=true},finalize-memref-to-llvm,convert-math-to-llvm,"
    "convert-arith-to-llvm,convert-openmp-to-llvm,"
    "convert-func-to-llvm,convert-cf-to-llvm,convert-index-to-llvm,"
    "convert-ub-to-llvm,reconcile-unrealized-casts"
)

DYNAMIC_MIN_FLOPS = 100_000_000
"""Kernels of at least this many operations run their parallel loops with a
dynamic OpenMP schedule on two or more threads (:func:`dynamic_schedules`)."""


def mark_c_interface(module: ir.Module) -> None:
    """Ask for `_mlir_ciface_` wrappers on every function of `module`."""
    for op in module.body.operations:
        if op.operation.name == "func.func":
            op.operation.attributes["llvm.emit_c_interface"] = ir.UnitAttr.get()


def lower_to_llvm(module: ir.Module, threads: int = 1, target: Target | None = None) -> None:
    """Lower `module` in place to the LLVM dialect (its context must be current),
    for `target`'s instructions where they differ (None: the host, which the
    ExecutionEngine builds for)."""
    mark_c_interface(module)
    # Math on bf16/f16 (a GELU's erf in a module lowered untuned) computed in
    # f32: LLVM has no erf, and expand_math handles f32 only.
    passmanager.PassManager.parse("builtin.module(func.func(math-extend-to-supported-types))").run(module.operation)
    passmanager.PassManager.parse(f"builtin.module({_front()})").run(module.operation)
    forward_output_copies(module)
    views_into_kernels(module)
    accumulate_in_place(module)
    static_driver_buffers(module)
    strided_copies_to_linalg(module)
    amx_microkernels(module)
    passmanager.PassManager.parse(f"builtin.module({_threads_part(threads).rstrip(',')})").run(module.operation)
    if threads > 1:
        dynamic_schedules(module)
    lower_pair_contracts(module)
    if flatten_contiguous_transfers(module):
        passmanager.PassManager.parse("builtin.module(canonicalize,cse)").run(module.operation)
    scalarize_lane_loads(module)
    # exp/erf/tanh as SIMD arith ops, not one libm call per lane; after
    # bufferization, which refuses the `ldexp` intrinsic call it may emit.
    expand_math(module, None if target is None else target.has("avx512f"))
    tree_reductions(module)
    constant_divisors(module)
    passmanager.PassManager.parse(f"builtin.module({_TO_LOOPS})").run(module.operation)
    widen_bool_buffers(module)
    passmanager.PassManager.parse(f"builtin.module({_LOOPS_TO_LLVM})").run(module.operation)


def tree_reductions(module: ir.Module) -> int:
    """Let LLVM combine the lanes of every floating-point sum or product
    across a vector (``vector.reduction <add>``/``<mul>``) as a tree
    (``fastmath<reassoc>``), not one lane after the other. Returns how many
    reductions changed.

    Why: without the flag, `llvm.vector.reduce.fadd` keeps the order of the
    lanes, a chain of 32 dependent scalar adds for two AVX-512 vectors
    (about 100 cycles); the softmax's row sums of an attention over 128
    keys spent more time there than in their exp. Sound: a reduction that
    reaches a vector of lanes was already reassociated by vectorizing it
    (each lane sums its own elements), so the order of the final combine is
    one more choice of the same kind."""
    reassoc = ir.Attribute.parse("#arith.fastmath<reassoc,contract>")
    count = 0
    for op in walk_op(module.operation, "vector.reduction"):
        kind = str(op.attributes["kind"])
        if kind in ("#vector.kind<add>", "#vector.kind<mul>") and isinstance(op.results[0].type, ir.FloatType):
            op.attributes["fastmath"] = reassoc
            count += 1
    return count


_CONSTANT_OPS = ("arith.constant", "vector.broadcast", "vector.splat")


def _constant(v: ir.Value) -> bool:
    """Whether `v` is a float constant: an ``arith.constant`` (scalar or
    splat) or a vector made of one."""
    owner = defining_op(v)
    if owner is None or owner.name not in _CONSTANT_OPS:
        return False
    return owner.name == "arith.constant" or _constant(owner.operands[0])


def constant_divisors(module: ir.Module) -> int:
    """Let LLVM turn every float division by a constant into a
    multiplication by its reciprocal (``fastmath<arcp>`` on ``arith.divf``
    whose divisor is a constant). Returns how many divisions changed.

    Why: torch-mlir writes a GELU as ``erf(x / sqrt(2))``; LLVM keeps an
    exact division by 1.41421354 (its reciprocal is not a power of two), a
    ``vdivps`` per vector with ten times a multiply's cost, where PyTorch
    computes ``x * M_SQRT1_2``. The result differs by at most an ulp."""
    count = 0
    for op in walk_op(module.operation, "arith.divf"):
        if _constant(op.operands[1]):
            flags = str(op.attributes["fastmath"]) if "fastmath" in op.attributes else "#arith.fastmath<none>"
            inner = flags[len("#arith.fastmath<") : -1]
            kept = [f for f in inner.split(",") if f and f not in ("none", "arcp")]
            op.attributes["fastmath"] = ir.Attribute.parse(f"#arith.fastmath<{','.join([*kept, 'arcp'])}>")
            count += 1
    return count


def dynamic_schedules(module: ir.Module, min_flops: int = DYNAMIC_MIN_FLOPS) -> int:
    """Give the OpenMP loops (``omp.wsloop``, after convert-scf-to-openmp)
    of every function whose `FLOPS_ATTR` is at least `min_flops` a dynamic
    schedule: each thread takes the next iteration when it is done with its
    last, instead of a fixed half. Returns how many loops changed.

    Why: on shared machines one of two cores often runs slower for seconds
    at a time, and a static split then waits for the slow thread; large
    kernels gain, small ones lose (the interleaved iterations cost locality
    and a dispatch each), hence the threshold. The measurements are in
    ``docs/tuning.md`` (under `threads`)."""
    kind = ir.Attribute.parse("#omp<schedulekind dynamic>")
    count = 0

    def visit(op: ir.Operation) -> ir.WalkResult:
        nonlocal count
        if op.name == "omp.wsloop" and "schedule_kind" not in op.attributes:
            op.attributes["schedule_kind"] = kind
            count += 1
        return ir.WalkResult.ADVANCE

    for fn in module.body.operations:
        attrs = fn.operation.attributes
        if fn.operation.name == "func.func" and FLOPS_ATTR in attrs and ir.IntegerAttr(attrs[FLOPS_ATTR]).value >= min_flops:
            fn.operation.walk(visit)
    return count
