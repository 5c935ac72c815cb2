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

from mlir_ansor.passes.artifacts import emit_shared_library
from mlir_ansor.passes.lowering import lower_to_llvm
from mlir_ansor.schedule.apply import BuildError, apply_schedule


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
