"""Asynchronous, multi-stage global-to-shared copies (``cp.async``) for the
staged GEMM and conv sketches.

A sketch asks for them by annotating its function with
``ansor.copy_stages = S`` (`GpuScheduleWriter.annotate_stages`, the
``stages`` knob). With S > 1, :func:`pipeline_shared_copies` rewrites the K
loop of each ``gpu.launch`` whose body copies operand tiles to shared
memory, after the thread mapping and the accumulator hoisting
(`passes/nvvm.py`), in four steps:

  1. multi-buffering: each workgroup buffer used only inside that loop
     becomes S buffers (``memref<S x ...>``), and iteration i works on
     buffer ``i mod S`` (subviews at the top of the loop body: one for the
     copies' stores, one for the reads, so the reads' view is not carried
     around the pipelined loop and keeps its 16-byte alignment visible);
  2. a barrier between two groups of copies that only write shared memory
     (other buffers) is dropped, so all of an iteration's copies form one
     group;
  3. ``transform.nvgpu.create_async_groups`` turns each 16-byte global load
     stored to shared memory into ``nvgpu.device_async_copy`` (``cp.async``,
     ``bypass_l1``: ``.cg``) with a ``commit_group`` and a ``wait_group``;
  4. ``transform.nvgpu.pipeline_shared_memory_copies {depth = S}`` issues
     the copies of iteration i + S while iteration i computes (the wait
     keeps S - 1 groups in flight); the epilogue is not peeled: the last S
     iterations' copies are predicated off (``cp.async`` with a source size
     of 0), which keeps the kernel about as small as the synchronous one.

Why S buffers for depth S: the copy for iteration i + S is issued after
the barrier that ends iteration i's compute, so it reuses the buffer
iteration i has just finished reading.

What the pipeliner refuses (shared/MLIR-NOTES.md): a loop body with any op
that has regions (a copy predicated with ``scf.if``, because its pieces do
not cover every thread of the block exactly: `GpuSketch.violation` rules
those assignments out), and any ``gpu.barrier`` before a copy in the body
(an assertion in these wheels aborts the process: step 2 removes the only
one the sketches leave).
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import affine, memref

from mlir_ansor.ir.rewrite import walk_op
from mlir_ansor.schedule.gpu_writer import STAGES_ATTR

__all__ = ["STAGES_ATTR", "CopyStagesError", "pipeline_shared_copies"]


class CopyStagesError(ValueError):
    """MLIR refused to pipeline the copies (`passes.nvvm` reports it as a
    `GpuBuildError`, as every other lowering failure)."""


def _apply(module: ir.Module, body: list[str]) -> None:
    """Run a transform sequence of `body` lines on `module`."""
    from mlir.dialects.transform import interpreter

    any_op = "!transform.any_op"
    lines = "\n".join("    " + b for b in body)
    sched = ir.Module.parse(
        "module attributes {transform.with_named_sequence} {\n"
        f"  transform.named_sequence @__transform_main(%root: {any_op} {{transform.readonly}}) {{\n"
        f"{lines}\n    transform.yield\n  }}\n}}\n"
    )
    entry = next(op for op in sched.body.operations if op.operation.name == "transform.named_sequence")
    try:
        interpreter.apply_named_sequence(module.operation, entry, sched)
    except (ir.MLIRError, ValueError) as e:
        raise CopyStagesError(f"pipelining the copies failed: {e}") from None

_SHARED_ACCESS = {
    "vector.load", "vector.store", "vector.transfer_read", "vector.transfer_write", "memref.load", "memref.store",
    "nvgpu.ldmatrix", "nvgpu.device_async_copy",
}


_SHARED_WRITES = {"vector.store", "vector.transfer_write", "memref.store", "nvgpu.device_async_copy"}
"""Ops that write the shared buffer among their operands (the copies)."""


def _is_workgroup(value: ir.Value) -> bool:
    return isinstance(value.type, ir.MemRefType) and "workgroup" in str(ir.MemRefType(value.type).memory_space)


def _shared_operand(op: ir.Operation) -> ir.Value | None:
    if op.name not in _SHARED_ACCESS:
        return None
    return next((v for v in op.operands if _is_workgroup(v)), None)


def _inside(op: ir.Operation, ancestor: ir.Operation) -> bool:
    p = op
    while p is not None:
        if p == ancestor:
            return True
        p = p.parent
    return False


def _copy_loops(launch: ir.Operation) -> list[ir.Operation]:
    """The `scf.for` ops directly in the launch body whose own body stores to
    shared memory (the K loops of the staged sketches)."""
    body = launch.regions[0].blocks[0]
    out = []
    for op in body.operations:
        op = op.operation
        if op.name != "scf.for":
            continue
        inner = op.regions[0].blocks[0].operations
        if any(o.operation.name == "vector.store" and _shared_operand(o.operation) is not None for o in inner):
            out.append(op)
    return out


def multibuffer(launch: ir.Operation, loop: ir.Operation, stages: int) -> int:
    """Give each workgroup attribution of `launch` used only inside `loop`
    `stages` copies, iteration i using copy i mod `stages`; returns how
    many buffers were multiplied."""
    body = launch.regions[0].blocks[0]
    count = ir.IntegerAttr(launch.attributes["workgroup_attributions"]).value if "workgroup_attributions" in launch.attributes else 0
    loop_body = loop.regions[0].blocks[0]
    iv = loop_body.arguments[0]
    lower, step = loop.operands[0], loop.operands[2]
    dyn = ir.ShapedType.get_dynamic_stride_or_offset()
    done = 0
    for arg in list(body.arguments)[12:12 + count]:
        users = [u.owner for u in arg.uses]
        if not users or not all(_inside(u, loop) for u in users):
            continue  # an epilogue tile, read after the loop: one copy
        old = ir.MemRefType(arg.type)
        shape = list(old.shape)
        arg.set_type(ir.MemRefType.get([stages, *shape], old.element_type, memory_space=old.memory_space))
        strides = [1]
        for d in reversed(shape[1:]):
            strides.insert(0, strides[0] * d)
        view_type = ir.MemRefType.get(shape, old.element_type, ir.StridedLayoutAttr.get(dyn, strides), old.memory_space)
        d0, s0, s1 = ir.AffineExpr.get_dim(0), ir.AffineExpr.get_symbol(0), ir.AffineExpr.get_symbol(1)
        which = ir.AffineMap.get(1, 2, [ir.AffineExpr.get_mod(ir.AffineExpr.get_floor_div(d0 - s0, s1), stages)])
        # One view for the copies' stores and one for the reads: the
        # pipeliner puts the copies (and what they use) S - 1 iterations
        # ahead, so a view both use would become a loop-carried memref,
        # whose offset LLVM cannot see (the reads' 16-byte ld.shared.v4
        # became scalar ld.shared); the reads' own view stays a function
        # of the loop's index, a multiple of the tile.
        uses = list(arg.uses)
        for writes in (True, False):
            mine = [u for u in uses if (u.owner.name in _SHARED_WRITES) == writes]
            if not mine:
                continue
            with ir.InsertionPoint.at_block_begin(loop_body), loop.location:
                index = affine.AffineApplyOp(which, [iv, lower, step]).result
                view = memref.SubViewOp(view_type, arg, [index], [], [], [dyn] + [0] * len(shape),
                                        [1, *shape], [1] * (1 + len(shape)))
            for use in mine:
                use.owner.operands[use.operand_number] = view.result
        done += 1
    return done


def drop_barriers_between_copies(loop: ir.Operation) -> int:
    """Erase each `gpu.barrier` of `loop`'s body that has only stores to
    shared memory between it and its neighbouring barriers, to buffers
    other than those written on its other side (nothing reads shared
    memory there, so it orders nothing); returns how many were erased."""
    erased = 0
    while True:
        ops = [o.operation for o in loop.regions[0].blocks[0].operations]
        bars = [i for i, o in enumerate(ops) if o.name == "gpu.barrier"]
        for j, i in enumerate(bars):
            lo = bars[j - 1] if j else -1
            hi = bars[j + 1] if j + 1 < len(bars) else len(ops)
            before = [o for o in ops[lo + 1:i] if _shared_operand(o) is not None]
            after = [o for o in ops[i + 1:hi] if _shared_operand(o) is not None]
            if not before or not after or any(o.name != "vector.store" for o in before + after):
                continue
            written = [{_shared_operand(o).get_name() for o in side} for side in (before, after)]
            if written[0] & written[1]:
                continue
            ops[i].erase()
            erased += 1
            break
        else:
            return erased


def pipeline_shared_copies(module: ir.Module) -> int:
    """Turn the shared-memory copies of every K loop into `cp.async`
    pipelined over the stages its function asks for (`STAGES_ATTR`; see
    the module docstring); returns how many loops were pipelined. Raises
    `CopyStagesError` when MLIR refuses."""
    done = 0
    for func in walk_op(module.operation, "func.func"):
        if STAGES_ATTR not in func.attributes:
            continue
        stages = ir.IntegerAttr(func.attributes[STAGES_ATTR]).value
        if stages <= 1:
            continue
        loops = []
        for launch in walk_op(func, "gpu.launch"):
            for loop in _copy_loops(launch):
                if not multibuffer(launch, loop, stages):
                    raise CopyStagesError("copy stages: no shared buffer is used only inside the K loop")
                drop_barriers_between_copies(loop)
                loop.attributes["ansor.pipeline"] = ir.UnitAttr.get()
                loops.append(loop)
        if not loops:
            raise CopyStagesError(f"copy stages = {stages}: no loop copies operand tiles to shared memory")
        name = ir.StringAttr(func.attributes["sym_name"]).value
        any_op = "!transform.any_op"
        _apply(module, [
            f'%f = transform.structured.match ops{{["func.func"]}} attributes {{sym_name = "{name}"}} in %root '
            f": ({any_op}) -> {any_op}",
            f"%g = transform.nvgpu.create_async_groups %f {{bypass_l1}} : ({any_op}) -> {any_op}",
            f'%l = transform.structured.match ops{{["scf.for"]}} attributes {{ansor.pipeline}} in %g '
            f": ({any_op}) -> {any_op}",
            f"%p = transform.nvgpu.pipeline_shared_memory_copies failures(propagate) %l {{depth = {stages}}} "
            f": ({any_op}) -> {any_op}",
        ])
        if not walk_op(func, "nvgpu.device_async_copy"):
            raise CopyStagesError(f"copy stages = {stages}: no copy became cp.async")
        done += len(loops)
    return done
