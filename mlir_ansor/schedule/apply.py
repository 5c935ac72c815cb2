"""Apply a schedule: parse a task's payload and run a concrete transform
script (every knob selected) on it with the transform interpreter.

This is where a schedule meets the IR; the builders (CPU and CUDA), the
feature extractor and `compile` all schedule through :func:`apply_schedule`.
"""

from __future__ import annotations

from mlir import ir
from mlir.dialects.transform import interpreter

from mlir_ansor.graph.task import linalg_flops
from mlir_ansor.ir.attrs import FLOPS_ATTR

__all__ = ["BuildError", "apply_schedule"]


class BuildError(RuntimeError):
    """The schedule or the lowering failed (the message holds MLIR's diagnostics)."""


def apply_schedule(payload: str, script: str | None) -> ir.Module:
    """Parse `payload` and apply the transform `script` (None: no schedule).

    The current MLIR context is used; returns the transformed module. Each
    function of it carries the payload's Linalg operation count
    (`ir.attrs.FLOPS_ATTR`, from which the lowering picks the OpenMP
    schedule)."""
    module = ir.Module.parse(payload)
    flops = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), linalg_flops(module))
    for op in module.body.operations:
        if op.operation.name == "func.func" and op.operation.regions[0].blocks:
            op.operation.attributes[FLOPS_ATTR] = flops
    if script is not None:
        sched = ir.Module.parse(script)
        entry = None
        for op in sched.body.operations:
            if op.operation.name == "transform.named_sequence":
                entry = op
                break
        if entry is None:
            raise BuildError("the schedule has no transform.named_sequence")
        try:
            interpreter.apply_named_sequence(module.operation, entry, sched)
        except ir.MLIRError as e:
            raise BuildError(_diagnostics(e)) from None
        except ValueError as e:  # the bindings raise ValueError with diagnostics
            raise BuildError(str(e)) from None
    return module


def _diagnostics(e: ir.MLIRError) -> str:
    lines = [e.message]
    for d in getattr(e, "error_diagnostics", []):
        lines.append(str(d.message))
    return "\n".join(lines)
