"""Warp-shuffle row reductions: the merge step of ``cuda-warp-reduction``.

The sketch (`search/rules/gpu_warp_reduction.py`) splits each row's
reduction over the T lanes of a warp with
``transform.structured.tile_reduction_using_forall`` (``#gpu.thread<x>``):
lane t reduces its part of each of the block's R rows into column t of an
R x T partials buffer in shared memory, and a ``linalg.reduce`` over that
buffer's columns combines them. Left alone, that merge runs in every thread
of the block, each reading all R x T partials serially.
:func:`shuffle_reductions` (after the thread mapping, `passes/nvvm.py`)
rewrites it: per row, lane t loads its own partial and log2(T) butterfly
steps of ``gpu.shuffle xor`` (``shfl.sync.bfly``, width T: the lane mask
is exactly the block's T lanes) give every lane the row's value, which
lane 0 combines with the output's initial value and stores. It also narrows the partials' initialisation to
each lane's own column: filling the whole buffer from every thread raced
with other lanes' partial results.

Applies where the block is exactly T threads along x (T a power of two up
to the warp size), the buffer is R x T and the merge reduces dimension 1.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects import arith, gpu, memref, scf

from mlir_ansor.ir.rewrite import walk_op

__all__ = ["WarpReduceError", "shuffle_reductions"]


class WarpReduceError(ValueError):
    """A merge the shuffles cannot take (`passes.nvvm` reports it as a
    `GpuBuildError`, as every other lowering failure)."""


def _launch_dims(launch: ir.Operation) -> tuple[int, int, int]:
    """The block sizes of a ``gpu.launch`` (operands: grid x, y, z, block
    x, y, z, ...), which must be constants."""
    dims = []
    for v in list(launch.operands)[3:6]:
        owner = v.owner
        if isinstance(owner, ir.Block) or owner.name != "arith.constant":
            raise WarpReduceError("warp reduction: a block dimension is not a constant")
        dims.append(ir.IntegerAttr(owner.attributes["value"]).value)
    return tuple(dims)  # type: ignore[return-value]


def _is_workgroup(value: ir.Value) -> bool:
    return isinstance(value.type, ir.MemRefType) and "workgroup" in str(ir.MemRefType(value.type).memory_space)


def _named(op: ir.Operation) -> list[ir.NamedAttribute]:
    attrs = op.attributes
    return [attrs[i] for i in range(len(attrs))]


def shuffle_reductions(module: ir.Module, warp_size: int = 32) -> int:
    """Rewrite each lane-split row merge into warp shuffles (module
    docstring); returns how many merges were rewritten."""
    done = 0
    for launch in walk_op(module.operation, "gpu.launch"):
        bx, by, bz = _launch_dims(launch)
        for merge in walk_op(launch, "linalg.reduce"):
            src, out = merge.operands[0], merge.operands[1]
            if not _is_workgroup(src) or list(ir.DenseI64ArrayAttr(merge.attributes["dimensions"])) != [1]:
                continue
            rows, lanes = ir.MemRefType(src.type).shape
            if lanes != bx or by != 1 or bz != 1 or lanes > warp_size or lanes & (lanes - 1):
                raise WarpReduceError(f"warp reduction: {rows}x{lanes} partials in a {bx}x{by}x{bz} block")
            body = merge.regions[0].blocks[0]
            (combine, _yield) = [o.operation for o in body.operations]
            f_type = ir.MemRefType(src.type).element_type
            # each lane initialises only its own column of partials
            for fill in walk_op(launch, "linalg.fill"):
                if fill.operands[1] == src:
                    col = next(v for v in (u.owner for u in src.uses) if v.name == "memref.subview" and v != fill)
                    fill.move_after(col)
                    fill.operands[1] = col.results[0]
            with ir.InsertionPoint(merge), merge.location:
                lane = gpu.thread_id(gpu.Dimension.x)
                i32 = ir.IntegerType.get_signless(32)
                width = arith.constant(i32, lanes)  # the shuffle's lane mask: exactly the block's lanes
                for r in range(rows):
                    row = arith.constant(ir.IndexType.get(), r)
                    v = memref.load(src, [row, lane])
                    step = lanes // 2
                    while step:
                        other = gpu.shuffle(v, arith.constant(i32, step), width, gpu.ShuffleMode.XOR)[0]
                        v = ir.Operation.create(combine.name, results=[f_type], operands=[v, other],
                                                attributes={a.name: a.attr for a in _named(combine)}).result
                        step //= 2
                    # lane 0 alone combines with the initial value and stores
                    # (another lane reading it after lane 0's store would
                    # count the row twice)
                    first = arith.cmpi(arith.CmpIPredicate.eq, lane, arith.constant(ir.IndexType.get(), 0))
                    branch = scf.IfOp(first)
                    with ir.InsertionPoint(branch.then_block):
                        init = memref.load(out, [row])
                        total = ir.Operation.create(combine.name, results=[f_type], operands=[v, init],
                                                    attributes={a.name: a.attr for a in _named(combine)}).result
                        memref.store(total, out, [row])
                        scf.YieldOp([])
            merge.erase()
            done += 1
    return done
