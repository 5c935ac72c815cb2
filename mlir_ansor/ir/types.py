"""Predicates on MLIR types that several layers need."""

from __future__ import annotations

from mlir import ir


def sub_byte_elements(t: ir.Type) -> bool:
    """Whether `t` is a tensor or memref of integers narrower than a byte
    (``i1`` masks): the LLVM 22.1.8 wheels' ``finalize-memref-to-llvm``
    aborts on a ``memref.store`` of those (assertion
    ``integralElementType.getWidth() >= 8``)."""
    if not isinstance(t, (ir.RankedTensorType, ir.MemRefType)):
        return False
    e = ir.ShapedType(t).element_type
    return isinstance(e, ir.IntegerType) and ir.IntegerType(e).width < 8


def identity_layout(t: ir.Type) -> bool:
    """Whether `t` is laid out row-major without offset: a memref whose
    layout is the identity map (any other type: True)."""
    if not isinstance(t, ir.MemRefType):
        return True
    layout = ir.MemRefType(t).layout
    if not isinstance(layout, ir.AffineMapAttr):
        return False
    m = ir.AffineMapAttr(layout).value
    return m == ir.AffineMap.get_identity(m.n_dims)
