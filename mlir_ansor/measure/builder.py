"""Build a candidate: apply a concrete schedule, lower, emit a shared library.

These functions run inside worker processes (see `pool.py`): an invalid
schedule can make the MLIR build abort, and the pool turns that into a
recorded error. They take and return plain data (text, paths, dicts).
"""

from __future__ import annotations

import hashlib
import struct
import time
from pathlib import Path

from mlir import ir
from mlir.dialects.transform import interpreter

from ..passes.lowering import FLOPS_ATTR, emit_shared_library, lower_to_llvm
from ..search.task import linalg_flops


class BuildError(RuntimeError):
    """The schedule or the lowering failed (the message holds MLIR's diagnostics)."""


def apply_schedule(payload: str, script: str | None) -> ir.Module:
    """Parse `payload` and apply the transform `script` (None: no schedule).

    The current MLIR context is used; returns the transformed module. Each
    function of it carries the payload's Linalg operation count
    (`lowering.FLOPS_ATTR`, from which the lowering picks the OpenMP
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


def build(payload: str, script: str | None, threads: int, out_path: str, opt_level: int = 3) -> dict:
    """Build one candidate into the shared library `out_path`.

    Returns {"path", "build_s", "binary_hash"}: `binary_hash` identifies the
    generated code, so two schedules that produce the same machine code are
    measured once.
    """
    t0 = time.perf_counter()
    with ir.Context(), ir.Location.unknown():
        module = apply_schedule(payload, script)
        try:
            lower_to_llvm(module, threads)
        except (ir.MLIRError, ValueError) as e:
            raise BuildError(f"lowering failed: {e}") from None
        emit_shared_library(module, out_path, opt_level=opt_level)
    digest = hashlib.sha256(_code_bytes(out_path)).hexdigest()[:20]
    return {"path": out_path, "build_s": time.perf_counter() - t0, "binary_hash": digest}


def _code_bytes(path: str) -> bytes:
    """The code and constant sections of a shared library (`.text`, `.ltext`,
    `.rodata`, `.lrodata`: the ExecutionEngine uses the large code model), so
    the hash ignores build ids and paths. Falls back to the whole file."""
    data = Path(path).read_bytes()
    try:
        shoff = struct.unpack_from("<Q", data, 0x28)[0]
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

        def section(i: int) -> tuple[int, int, int]:
            base = shoff + i * shentsize
            (name,) = struct.unpack_from("<I", data, base)
            off, size = struct.unpack_from("<QQ", data, base + 0x18)
            return name, off, size

        _, stroff, _ = section(shstrndx)
        parts = []
        for i in range(shnum):
            name, off, size = section(i)
            end = data.index(b"\0", stroff + name)
            if data[stroff + name : end] in (b".text", b".ltext", b".rodata", b".lrodata"):
                parts.append(data[off : off + size])
        if parts:
            return b"".join(parts)
    except (struct.error, ValueError):
        pass
    return data
