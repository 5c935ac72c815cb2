"""Short vector loads read lane by lane, as scalar loads.

A contraction's register tile reads A as one short vector per row, one
element per unrolled reduction step (``vector.load ... : vector<2xf32>``),
and broadcasts each lane against B's vectors. LLVM keeps such a load whole
and broadcasts its lanes from the register: for two lanes a ``vmovsd`` and a
``vpermps`` per lane, and on Intel cores shuffles share port 5 with the
second 512-bit FMA unit. Loaded one lane at a time, each broadcast reads
memory (``vbroadcastss m32``, or an FMA's embedded broadcast), which takes a
load port instead. (With four lanes LLVM splits the load itself.)

BERT's FFN output, 128 x 3072 x 768 with B in panels, 6 x 32 registers, 2
threads, Emerald Rapids, timed in turns: u = 2 ran at 199 GFLOP/s with the
short loads, 279-288 split (u = 1: 283-285 either way).
"""

from __future__ import annotations

from mlir import ir

# Loads this short or shorter are split: each lane is used on its own.
_MAX_LANES = 4


def scalarize_lane_loads(module: ir.Module) -> int:
    """Replace every 1-D ``vector.load`` of at most 4 lanes whose every use
    is a ``vector.extract`` of one lane at a constant position with one
    ``memref.load`` per extract, at the load's last index plus the lane.
    Returns how many loads were split."""
    found: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "vector.load":
            found.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return sum(1 for op in found if _split(op))


def _lane(user: ir.Operation) -> int | None:
    """The constant lane a ``vector.extract`` takes a scalar from, else None."""
    if user.name != "vector.extract" or len(user.operands) != 1:
        return None  # not an extract, or one at a dynamic position
    if isinstance(user.results[0].type, ir.VectorType):
        return None
    pos = ir.DenseI64ArrayAttr(user.attributes["static_position"])
    return pos[0] if len(pos) == 1 else None


def _split(op: ir.Operation) -> bool:
    from mlir.dialects import arith, memref

    vtype = ir.VectorType(op.results[0].type)
    if vtype.rank != 1 or vtype.scalable or vtype.shape[0] > _MAX_LANES:
        return False
    if isinstance(vtype.element_type, ir.IntegerType) and vtype.element_type.width == 1:
        return False  # masks: bool buffers are widened to bytes later (`widen_bool_buffers`)
    users = [use.owner.operation if isinstance(use.owner, ir.OpView) else use.owner for use in op.results[0].uses]
    lanes = [_lane(u) for u in users]
    if not users or any(lane is None for lane in lanes):
        return False
    source, indices = op.operands[0], list(op.operands[1:])
    if not indices:
        return False
    index = ir.IndexType.get()
    for user, lane in zip(users, lanes, strict=True):
        with ir.InsertionPoint(user), user.location:
            last = indices[-1] if lane == 0 else arith.addi(indices[-1], arith.constant(index, lane))
            scalar = memref.load(source, indices[:-1] + [last])
        user.results[0].replace_all_uses_with(scalar)
        user.erase()
    op.erase()
    return True
