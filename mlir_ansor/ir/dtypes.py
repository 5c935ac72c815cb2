"""Element types: the one table of their sizes and rounding, and the
tolerance a computed result is checked with.

Plain Python (no MLIR, no numpy), so that code running where MLIR is not
installed (a GPU host measuring cubins) uses the same rule as the tuner.
"""

from __future__ import annotations

ELEMENT_BYTES: dict[str, int] = {
    "f64": 8, "f32": 4, "f16": 2, "bf16": 2,
    "i64": 8, "i32": 4, "i16": 2, "i8": 1, "i1": 1, "index": 8,
}
"""Bytes per element, by the element type's MLIR spelling."""

EPSILON: dict[str, float] = {"f64": 2.0**-52, "f32": 2.0**-23, "f16": 2.0**-10, "bf16": 2.0**-7}
"""Machine epsilon (the gap above 1.0) of each floating-point type."""

MODULE_TOLERANCE_FACTOR = 8
"""How much looser a whole compiled module is checked than its worst kernel
(`tolerance(..., whole_module=True)`, what `mlir-ansor run` checks): its
outputs went through a chain of kernels, each rounding differently from the
untuned build it is compared with."""


def element_bytes(dtype: str, default: int = 4) -> int:
    """Bytes per element of `dtype` ("f32", "i8", ...); `default` for a type
    not in the table."""
    return ELEMENT_BYTES.get(dtype, default)


def tolerance(dtype: str, reduction_length: int = 1, *, whole_module: bool = False) -> float:
    """Relative error bound for comparing a result of element type `dtype`
    with its reference: rounding grows with the reduction length (the
    summation order differs between schedules), and is 0 for integers (exact).
    `whole_module` checks the output of a whole compiled module, with
    `reduction_length` its longest kernel's (`MODULE_TOLERANCE_FACTOR`)."""
    eps = EPSILON.get(dtype, 0.0) if dtype.startswith(("f", "bf")) else 0.0
    bound = max(16 * eps, 4 * eps * max(1, reduction_length))
    return bound * (MODULE_TOLERANCE_FACTOR if whole_module else 1)
