"""Native artifacts: the runtime libraries generated code calls
(:func:`runtime_libs`: the OpenMP runtime, :func:`find_openmp`, and MLIR's C
runner utilities) and :func:`emit_shared_library`, which compiles an
LLVM-dialect module (from `lowering.lower_to_llvm`) to a shared library with
the ExecutionEngine and links it with the system's ``cc``; the same in two
steps for a module split into units (`split.split_units`): :func:`emit_object`
per unit, :func:`link_shared_library` of all the objects.
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
    path = Path(path)
    obj = path.with_suffix(".o")
    emit_object(llvm_module, obj, opt_level=opt_level, jit_libs=jit_libs)
    try:
        return link_shared_library([str(obj), *link_inputs], path)
    finally:
        obj.unlink(missing_ok=True)


LLVM_OPTIONS: tuple[str, ...] = ("-unroll-allow-partial=0",)
"""LLVM command-line options every process that generates code sets once
(:func:`llvm_options`; ``MLIR_ANSOR_LLVM_OPTIONS``, space-separated, stands
in for them, empty for none).

Why no partial unrolling: the kernels come vectorized and unrolled as their
schedules say, and LLVM's loop unroller, at O3, went on to unroll loops
whose bodies are already hundreds of vector instructions by 16. That made
some schedules take 5-8 s of code generation each (ResNet-50's
28x28x512x1x1x256 conv: 7.3 s at O3, 82% of its optimization time in
LoopUnrollPass, then code generation of the unrolled loops) where the same
kernel takes 1.7 s without it; a tuned ResNet-50 whose schedules had more
such kernels compiled in 36 s. Complete unrolling of short loops stays."""

_OPTIONS_SET: list[tuple[str, ...]] = []


def llvm_options() -> tuple[str, ...]:
    """The LLVM options code generation runs with in this process (they are
    part of the compile cache's key)."""
    env = os.environ.get("MLIR_ANSOR_LLVM_OPTIONS")
    return tuple(env.split()) if env is not None else LLVM_OPTIONS


def _set_llvm_options() -> None:
    """Give LLVM :func:`llvm_options` (once per process: LLVM keeps them in
    global state) through ``LLVMParseCommandLineOptions`` of the libLLVM the
    MLIR bindings load; a wheel without that library keeps LLVM's defaults."""
    if _OPTIONS_SET:
        return
    options = llvm_options()
    _OPTIONS_SET.append(options)
    if not options:
        return
    import ctypes

    import mlir

    lib = Path(mlir.__path__[0]).parent / "llvm" / "lib" / "libLLVM.so"
    try:
        parse = ctypes.CDLL(str(lib)).LLVMParseCommandLineOptions
    except (OSError, AttributeError):
        return
    argv = (ctypes.c_char_p * (len(options) + 1))(b"mlir-ansor", *(o.encode() for o in options))
    parse(len(options) + 1, argv, None)


def emit_object(
    llvm_module: ir.Module, path: str | os.PathLike, *, opt_level: int = 3, jit_libs: tuple[str, ...] = ()
) -> str:
    """Compile an LLVM-dialect module to a relocatable object at `path`
    (the ExecutionEngine's optimization and code generation for this host,
    with :data:`LLVM_OPTIONS`). Every symbol the module references must
    resolve while the engine links it in memory: the runtime libraries, and
    `jit_libs` for the rest (symbols that other objects of the same library
    will define)."""
    from mlir.execution_engine import ExecutionEngine

    _set_llvm_options()
    engine = ExecutionEngine(llvm_module, opt_level=opt_level, shared_libs=runtime_libs() + list(jit_libs))
    engine.dump_to_object_file(str(path))
    if not os.path.exists(path):
        raise RuntimeError(f"code generation wrote no object ({os.path.basename(path)}): a symbol it needs did not resolve")
    return str(path)


def link_shared_library(objects: list[str], path: str | os.PathLike) -> str:
    """Link `objects` with ``cc`` into a shared library at `path`, against
    the runtime libraries, with an rpath so that it loads from anywhere."""
    path = Path(path)
    cmd = ["cc", "-shared", "-o", str(path), *objects]
    for lib in runtime_libs():
        cmd += [lib, f"-Wl,-rpath,{os.path.dirname(lib)}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"linking {path.name} failed: {proc.stderr.strip()}")
    return str(path)


def symbol_stub(names: list[str], path: str | os.PathLike) -> str:
    """A shared library at `path` that defines each of `names` (one byte of
    data each): it gives the ExecutionEngine an address for the symbols of
    a unit that another object of the library defines, so that it can
    generate the unit's object (where they stay undefined references)."""
    src = Path(path).with_suffix(".s")
    lines = [".data"]
    for name in names:
        lines += [f'.globl "{name}"', f'"{name}":', ".byte 0"]
    src.write_text("\n".join(lines) + "\n")
    proc = subprocess.run(["cc", "-shared", "-o", str(path), str(src)], capture_output=True, text=True)
    src.unlink(missing_ok=True)
    if proc.returncode != 0:
        raise RuntimeError(f"assembling a symbol stub failed: {proc.stderr.strip()[-1000:]}")
    return str(path)
