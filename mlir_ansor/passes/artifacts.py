"""Native artifacts: the runtime libraries generated code calls
(:func:`runtime_libs`: the OpenMP runtime, :func:`find_openmp`, and MLIR's C
runner utilities) and :func:`emit_shared_library`, which compiles an
LLVM-dialect module (from `lowering.lower_to_llvm`) to a shared library with
the ExecutionEngine and links it with the system's ``cc``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mlir import ir


def runtime_libs() -> list[str]:
    """Shared libraries the generated code may call: the OpenMP runtime
    (libiomp5 from the `intel-openmp` wheel) and MLIR's C runner utilities
    (`memrefCopy`, from the MLIR wheel)."""
    libs: list[str] = []
    import mlir

    mlir_lib = Path(mlir.__path__[0]) / "lib" / "libmlir_c_runner_utils.so"
    if mlir_lib.exists():
        libs.append(str(mlir_lib))
    omp = find_openmp()
    if omp:
        libs.insert(0, omp)
    return libs


def find_openmp() -> str | None:
    """Path of the OpenMP runtime that the project's install brings."""
    candidates = [Path(sys.prefix) / "lib" / "libiomp5.so"]
    for entry in sys.path:
        candidates.append(Path(entry).parent.parent.parent / "libiomp5.so")
    env = os.environ.get("MLIR_ANSOR_OPENMP")
    if env:
        candidates.insert(0, Path(env))
    for c in candidates:
        if c.exists():
            return str(c)
    return None


def emit_shared_library(
    llvm_module: ir.Module,
    path: str | os.PathLike,
    *,
    opt_level: int = 3,
    jit_libs: tuple[str, ...] = (),
    link_inputs: tuple[str, ...] = (),
) -> str:
    """Compile an LLVM-dialect module to a shared library at `path`.

    The ExecutionEngine does the code generation (object file); the system's
    `cc` links it against the runtime libraries, with an rpath so that the
    library loads from anywhere. `link_inputs` (objects) are linked in too;
    `jit_libs` are shared libraries that only resolve, during code
    generation, the symbols those objects will define (external data).
    """
    from mlir.execution_engine import ExecutionEngine

    path = Path(path)
    obj = path.with_suffix(".o")
    libs = runtime_libs()
    engine = ExecutionEngine(llvm_module, opt_level=opt_level, shared_libs=libs + list(jit_libs))
    engine.dump_to_object_file(str(obj))
    cmd = ["cc", "-shared", "-o", str(path), str(obj), *link_inputs]
    for lib in libs:
        d = os.path.dirname(lib)
        cmd += [lib, f"-Wl,-rpath,{d}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    obj.unlink(missing_ok=True)
    if proc.returncode != 0:
        raise RuntimeError(f"linking {path.name} failed: {proc.stderr.strip()}")
    return str(path)
