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

EPSILON: dict[str, float] = {"f64": 2.0**-52, "f32": 2.0**-23, "f16": 2.0**-10, "bf16": 2.0**-7, "tf32": 2.0**-10}
"""Machine epsilon (the gap above 1.0) of each floating-point type. tf32 is
what tensor cores read f32 operands as (10 bits of mantissa): a kernel whose
PTX has a tf32 ``mma.sync`` rounds its f32 inputs to it
(`passes.nvvm.input_rounding`), and is checked with ``rounds_to="tf32"``."""

MODULE_TOLERANCE_FACTOR = 8
"""How much looser a whole compiled module is checked than its worst kernel
(`tolerance(..., whole_module=True)`, what `mlir-ansor run` checks): its
outputs went through a chain of kernels, each rounding differently from the
untuned build it is compared with."""


def element_bytes(dtype: str, default: int = 4) -> int:
    """Bytes per element of `dtype` ("f32", "i8", ...); `default` for a type
    not in the table."""
    return ELEMENT_BYTES.get(dtype, default)


ACCUMULATION_DTYPE: dict[str, str] = {"bf16": "f32", "f16": "f32"}
"""The floating-point types too narrow to accumulate in, and the type a
reduction writing one of them accumulates in instead (what torch and oneDNN
do for bf16 and f16; `graph.precision`), which is also the type their
reference is computed in."""


def is_float(dtype: str) -> bool:
    """Whether `dtype` is a floating-point type ("f32", "bf16", ...)."""
    return dtype in EPSILON


def _narrower(a: str, b: str) -> str:
    return a if EPSILON.get(a, 0.0) >= EPSILON.get(b, 0.0) else b


def tolerance(
    dtype: str,
    reduction_length: int = 1,
    *,
    accumulate: str | None = None,
    rounds_to: str | None = None,
    whole_module: bool = False,
) -> float:
    """Relative error bound for comparing a result of element type `dtype`
    with its reference, from where it is rounded:

    * the accumulation, in `accumulate` (default: `ACCUMULATION_DTYPE` of
      `dtype`, else `dtype` itself): ``max(16, 4 * reduction_length)``
      epsilons of that type, since rounding grows with the reduction length
      and the summation order differs between schedules;
    * where the result, or a value on its way (`rounds_to`: the narrowest
      float type the computation rounds to, a bf16 product feeding an f32
      op), is narrower than the accumulation: 4 epsilons of the narrowest,
      for the rounding to it and those of the elementwise ops computed in it
      (the reference of such a task is computed in f32,
      `graph.precision.widen_payload`, and rounds none of them).

    0 for integers (exact), unless `rounds_to` is a narrower float (an i32
    sum requantized through bf16): then that rounding's 4 epsilons. `whole_module`
    checks the output of a whole compiled module, with `reduction_length`
    its longest kernel's (`MODULE_TOLERANCE_FACTOR`)."""
    factor = MODULE_TOLERANCE_FACTOR if whole_module else 1
    if not is_float(dtype):
        if rounds_to in ACCUMULATION_DTYPE:
            return 4 * EPSILON[rounds_to] * factor
        return 0.0
    acc = accumulate if accumulate and is_float(accumulate) else ACCUMULATION_DTYPE.get(dtype, dtype)
    eps_acc = EPSILON[acc]
    bound = max(16 * eps_acc, 4 * eps_acc * max(1, reduction_length))
    narrowest = _narrower(dtype, rounds_to) if rounds_to and is_float(rounds_to) else dtype
    if EPSILON[narrowest] > eps_acc:
        bound += 4 * EPSILON[narrowest]
    return bound * factor
