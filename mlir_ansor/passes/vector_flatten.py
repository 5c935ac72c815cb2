"""Vector transfers of contiguous memory as one 1-D transfer.

A tensorized kernel reads a register tile of a packed operand as an n-D
vector: 16 columns by a bf16 pair (``vector<16x2xbf16>``, 64 contiguous
bytes) for AVX-512 BF16's ``vdpbf16ps``. The upstream lowering
(``convert-vector-to-scf`` and the transfer patterns) unrolls such a read
into one 2-element read per row, and LLVM reassembles the 512-bit register
from 16 pieces (about 30 shuffles and inserts per dot product: GEMM 1024 in
bf16 ran at the speed of f32). The pinned wheels expose no transform op for
the upstream flattening patterns, hence :func:`flatten_contiguous_transfers`.
"""

from __future__ import annotations

import math

from mlir import ir

from mlir_ansor.ir.types import identity_layout


def flatten_contiguous_transfers(module: ir.Module) -> int:
    """Rewrite every ``vector.transfer_read``/``transfer_write`` of an n-D
    vector (n >= 2) that covers contiguous memory into a 1-D transfer of
    the same elements on a ``memref.collapse_shape`` of its buffer, with a
    ``vector.shape_cast`` between the two shapes. Contiguous: in bounds, no
    mask, a minor-identity map, the trailing vector dimensions equal to the
    buffer's (all but the first of them, which may be shorter), their
    indices 0 except that first one, unit strides inside, and only unit
    vector dimensions before them. Returns how many transfers changed."""
    found: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name in ("vector.transfer_read", "vector.transfer_write"):
            found.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return sum(1 for op in found if _flatten_one(op))


def _flatten_one(op: ir.Operation) -> bool:
    from mlir.dialects import arith, memref, vector

    reading = op.name == "vector.transfer_read"
    vec_value = op.results[0] if reading else op.operands[0]
    source = op.operands[0] if reading else op.operands[1]
    try:
        vtype, mtype = ir.VectorType(vec_value.type), ir.MemRefType(source.type)
    except (ValueError, TypeError):
        return False  # a transfer on a tensor
    if vtype.rank < 2 or vtype.scalable:
        return False
    if not mtype.has_static_shape:
        return False
    n_idx = mtype.rank
    first_idx = 1 if reading else 2
    indices = list(op.operands[first_idx : first_idx + n_idx])
    # Anything after the indices is the padding (read) or a mask: a mask means no.
    extra = len(op.operands) - first_idx - n_idx
    if extra > (1 if reading else 0):
        return False
    if "in_bounds" not in op.attributes or not all(ir.BoolAttr(b).value for b in ir.ArrayAttr(op.attributes["in_bounds"])):
        return False
    pmap = ir.AffineMapAttr(op.attributes["permutation_map"]).value
    # A broadcast (a bias vector<16xf32> read as vector<1x16xf32>: more
    # results than dimensions) is no minor identity, and asking for one
    # of that shape aborts.
    if len(pmap.results) > pmap.n_dims or pmap != ir.AffineMap.get_minor_identity(pmap.n_dims, len(pmap.results)):
        return False
    vshape, mshape = list(vtype.shape), list(mtype.shape)
    lead = mtype.rank - vtype.rank  # buffer dims the vector does not span
    strides, offset = mtype.get_strides_and_offset()
    # The group to collapse: buffer dims g..rank-1, where the vector spans
    # every dim after g whole; vector dims before g must be 1.
    g = mtype.rank - 1
    while g - 1 >= lead and vshape[g - lead] == mshape[g]:
        g -= 1
    if g == mtype.rank - 1:
        return False  # only the last dim is partial: already 1-D in effect
    if any(vshape[d - lead] != 1 for d in range(lead, g)):
        return False
    for d in range(g, mtype.rank - 1):
        if strides[d] != strides[d + 1] * mshape[d + 1]:
            return False
    if strides[-1] != 1:
        return False
    for d in range(g + 1, mtype.rank):
        idx = indices[d]
        owner = idx.owner
        if not (isinstance(owner, ir.OpView) and owner.operation.name == "arith.constant" and ir.IntegerAttr(owner.operation.attributes["value"]).value == 0):
            return False

    group = mtype.rank - g
    inner = math.prod(mshape[g + 1 :])
    c_shape = mshape[:g] + [math.prod(mshape[g:])]
    c_strides = strides[:g] + [strides[-1]]
    if identity_layout(mtype):
        c_type = ir.MemRefType.get(c_shape, mtype.element_type, memory_space=mtype.memory_space)
    else:
        layout = ir.StridedLayoutAttr.get(offset, c_strides)
        c_type = ir.MemRefType.get(c_shape, mtype.element_type, layout, memory_space=mtype.memory_space)
    reassoc = [[d] for d in range(g)] + [list(range(g, g + group))]
    flat_len = math.prod(vshape[g - lead :])
    flat_type = ir.VectorType.get([flat_len], vtype.element_type)
    with ir.InsertionPoint(op), op.location:
        collapsed = memref.collapse_shape(c_type, source, ir.ArrayAttr.get([ir.ArrayAttr.get([ir.IntegerAttr.get(ir.IntegerType.get_signless(64), d) for d in grp]) for grp in reassoc]))
        index = ir.IndexType.get()
        scaled = indices[g]
        if inner != 1:
            scaled = arith.muli(indices[g], arith.constant(index, inner))
        new_indices = indices[:g] + [scaled]
        one_d = ir.AffineMapAttr.get(ir.AffineMap.get_minor_identity(g + 1, 1))
        bounds = ir.ArrayAttr.get([ir.BoolAttr.get(True)])
        if reading:
            pad = op.operands[first_idx + n_idx]
            flat = vector.transfer_read(flat_type, collapsed, new_indices, one_d, pad, in_bounds=bounds)
            shaped = vector.shape_cast(vtype, flat)
            op.results[0].replace_all_uses_with(shaped)
        else:
            flat = vector.shape_cast(flat_type, vec_value)
            vector.transfer_write(None, flat, collapsed, new_indices, one_d, in_bounds=bounds)
    op.erase()
    return True
