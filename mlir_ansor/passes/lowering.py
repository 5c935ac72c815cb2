"""Lowering from (scheduled) Linalg to LLVM, and native artifacts.

The pipelines here take a module whose `func.func`s operate on tensors or
memrefs (the transform script of a sketch bufferizes itself; the untuned
payload does not) to the LLVM dialect, then to machine code through the
ExecutionEngine: an object file, linked into a shared library with a C ABI
(`_mlir_ciface_<name>(memref descriptors...)`).

Why this order (measured with the pinned wheels, see shared/MLIR-NOTES.md):
- `buffer-results-to-out-params{hoist-static-allocs}` turns returned tensors
  into caller-provided output buffers, so kernels write into numpy arrays;
- `buffer-loop-hoisting` runs before `buffer-deallocation-pipeline` (after it,
  hoisted allocations kept their in-loop deallocs: a double free);
- `finalize-memref-to-llvm` before `convert-scf-to-cf`, else OpenMP regions
  with `memref.alloca_scope` fail to lower;
- `convert-vector-to-scf{full-unroll}` so no `llvm.alloca` stays in loops.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from mlir import ir, passmanager

from ..search.normalize import NORMALIZED_ATTR
from .math_approx import expand_math

BUFFERIZE = (
    "one-shot-bufferize{bufferize-function-boundaries "
    "function-boundary-type-conversion=identity-layout-map}"
)

# After this, every function takes its results as trailing memref arguments.
_BUFFER_CLEANUP = (
    "buffer-results-to-out-params{hoist-static-allocs=true modify-public-functions=true},"
    "func.func(buffer-loop-hoisting),"
    "buffer-deallocation-pipeline,"
    "canonicalize,cse"
)


def _threads_part(threads: int) -> str:
    # scf.forall -> scf.parallel -> OpenMP. With one thread we still go through
    # OpenMP so that schedules mean the same thing at every thread count.
    return f"scf-forall-to-parallel,convert-scf-to-openmp{{num-threads={max(1, threads)}}},"


def llvm_pipeline(threads: int = 1, *, bufferize: bool = True) -> str:
    """The textual pass pipeline from Linalg/vector/memref to the LLVM dialect."""
    return (
        "builtin.module("
        + _front(bufferize)
        + ","
        + _back(threads)
        + ")"
    )


def _front(bufferize: bool = True) -> str:
    return (BUFFERIZE + "," if bufferize else "") + _BUFFER_CLEANUP


def _back(threads: int) -> str:
    return (
        _threads_part(threads)
        + "convert-vector-to-scf{full-unroll=true},convert-linalg-to-loops,lower-affine,"
        "finalize-memref-to-llvm,"
        "convert-scf-to-cf,expand-strided-metadata,lower-affine,"
        "convert-vector-to-llvm,finalize-memref-to-llvm,convert-math-to-llvm,"
        "convert-arith-to-llvm,convert-openmp-to-llvm,"
        "convert-func-to-llvm,convert-cf-to-llvm,convert-index-to-llvm,"
        "convert-ub-to-llvm,reconcile-unrealized-casts"
    )


def mark_c_interface(module: ir.Module) -> None:
    """Ask for `_mlir_ciface_` wrappers on every function of `module`."""
    for op in module.body.operations:
        if op.operation.name == "func.func":
            op.operation.attributes["llvm.emit_c_interface"] = ir.UnitAttr.get()


def lower_to_llvm(module: ir.Module, threads: int = 1) -> None:
    """Lower `module` in place to the LLVM dialect (its context must be current)."""
    mark_c_interface(module)
    expand_math(module)  # exp/erf/tanh as SIMD arith ops, not one libm call per lane
    passmanager.PassManager.parse(f"builtin.module({_front()})").run(module.operation)
    forward_output_copies(module)
    static_driver_buffers(module)
    strided_copies_to_linalg(module)
    passmanager.PassManager.parse(f"builtin.module({_back(threads)})").run(module.operation)


def _identity_layout(t: ir.Type) -> bool:
    if not isinstance(t, ir.MemRefType):
        return True
    layout = ir.MemRefType(t).layout
    if not isinstance(layout, ir.AffineMapAttr):
        return False
    m = ir.AffineMapAttr(layout).value
    return m == ir.AffineMap.get_identity(m.n_dims)


def _block_ops(block: ir.Block) -> list[ir.Operation]:
    return [op.operation for op in block.operations]


def forward_output_copies(module: ir.Module) -> int:
    """Let each function compute its results in its output arguments; returns
    how many copies went away.

    `buffer-results-to-out-params` gives a function that returns what a call
    returned (a model's driver returning its last kernel's result) a fresh
    buffer for the call, then a ``memref.copy`` of it into the output
    argument, and a dealloc: on every call, an allocation and a copy of the
    whole result (a 112x112x32 depthwise convolution's 1.6 MB took its call
    from 147 us to 166 us). When the buffer is a
    ``memref.alloc`` of the output's exact type in the function's entry block,
    the output argument has no other use, and nothing but deallocs uses the
    buffer after the copy, the buffer *is* the output argument: its uses take
    the argument, and the alloc, copy and deallocs go."""
    count = 0
    for fn in module.body.operations:
        if fn.operation.name != "func.func" or not fn.operation.regions[0].blocks:
            continue
        entry = fn.operation.regions[0].blocks[0]
        # One rewrite at a time, the block read afresh after each: the
        # bindings' operation handles do not survive erasing their neighbours.
        while _forward_one_copy(entry):
            count += 1
    return count


def _forward_one_copy(entry: ir.Block) -> bool:
    args = list(entry.arguments)
    ops = _block_ops(entry)
    position = {op: i for i, op in enumerate(ops)}
    for copy in ops:
        if copy.name != "memref.copy":
            continue
        src, dst = copy.operands[0], copy.operands[1]
        if not any(dst == a for a in args) or src.type != dst.type or not _identity_layout(dst.type):
            continue
        if sum(1 for _ in dst.uses) != 1 or not isinstance(src, ir.OpResult):
            continue
        # The copied buffer, or a reshape of it used by the copy alone (the
        # driver of a 3-D convolution split into 2-D ones expands its last
        # result to 5-D): the buffer becomes the inverse reshape of `dst`.
        reshape = src.owner.operation if src.owner.operation.name in _INVERSE_RESHAPE else None
        if reshape is not None:
            if sum(1 for _ in src.uses) != 1 or not isinstance(reshape.operands[0], ir.OpResult):
                continue
            buf = reshape.operands[0]
        else:
            buf = src
        alloc = buf.owner.operation
        if alloc.name != "memref.alloc" or alloc not in position or not _identity_layout(buf.type):
            continue
        users = [u.owner.operation for u in buf.uses]
        others = [u for u in users if u != copy and (reshape is None or u != reshape) and u.name != "memref.dealloc"]
        if any(position[_top_level(u, entry)] > position[copy] for u in others):
            continue
        for u in users:
            if u.name == "memref.dealloc":
                u.erase()
        copy.erase()
        if reshape is not None:
            from mlir.dialects import memref

            reassociation = reshape.attributes["reassociation"]
            with ir.InsertionPoint(alloc), alloc.location:
                if reshape.name == "memref.expand_shape":
                    view = memref.collapse_shape(buf.type, dst, reassociation)
                else:
                    view = memref.expand_shape(buf.type, dst, reassociation, [], ir.MemRefType(buf.type).shape)
            reshape.erase()
            buf.replace_all_uses_with(view)
        else:
            buf.replace_all_uses_with(dst)
        alloc.erase()
        return True
    return False


_INVERSE_RESHAPE = ("memref.expand_shape", "memref.collapse_shape")


_VIEW_OPS = frozenset(
    {"memref.subview", "memref.collapse_shape", "memref.expand_shape", "memref.cast", "memref.reinterpret_cast"}
)


def static_driver_buffers(module: ir.Module) -> int:
    """Give each driver's intermediate buffers static storage, shared between
    buffers whose lifetimes do not overlap; returns how many allocations went.

    A driver (a function `normalize` marked with ``NORMALIZED_ATTR``, which
    `compile` turned into straight-line calls of kernels) allocates every
    intermediate result with ``malloc`` on every call. Large blocks come from
    fresh ``mmap`` pages that fault in on first touch, and the kernels pay
    for it: a 3-D convolution split into three 2-D ones (five buffers of
    13 MB) spent about a quarter of its call there. Here, every
    ``memref.alloc`` of static shape in a driver's entry block becomes a
    ``memref.get_global`` of an uninitialized, 64-byte-aligned global. A
    global is reused by a later allocation of the same type once the last
    use of its previous buffer (and of every view of it) is behind; the
    buffers' deallocs go.

    The price: a compiled driver is not reentrant (two threads calling it at
    once would share these buffers); its kernels still run in parallel with
    OpenMP inside each call."""
    from mlir.dialects import memref

    count = 0
    for fn in list(module.body.operations):
        op = fn.operation
        if op.name != "func.func" or NORMALIZED_ATTR not in op.attributes or not op.regions[0].blocks:
            continue
        name = ir.StringAttr(op.attributes["sym_name"]).value
        entry = op.regions[0].blocks[0]
        ops = _block_ops(entry)
        position = {o: i for i, o in enumerate(ops)}
        # The plan first (positions stay valid: each alloc is replaced in place).
        plan: list[tuple[int, ir.MemRefType, str]] = []
        free: dict[str, list[str]] = {}
        live: list[tuple[int, str, str]] = []  # (last use, type, global)
        symbols: list[tuple[str, ir.MemRefType]] = []
        for i, inner in enumerate(ops):
            if inner.name != "memref.alloc" or inner.operands:
                continue
            t = ir.MemRefType(inner.results[0].type)
            if not t.has_static_shape or not _identity_layout(t):
                continue
            for entry_live in [x for x in live if x[0] < i]:
                live.remove(entry_live)
                free.setdefault(entry_live[1], []).append(entry_live[2])
            key = str(t)
            if free.get(key):
                sym = free[key].pop()
            else:
                sym = f"__ansor_{name}_buf{len(symbols)}"
                symbols.append((sym, t))
            live.append((_last_use(inner.results[0], entry, position), key, sym))
            plan.append((i, t, sym))
        if not plan:
            continue
        with ir.InsertionPoint(op), op.location:  # before the driver
            for sym, t in symbols:
                memref.GlobalOp(sym, ir.TypeAttr.get(t), sym_visibility="private", initial_value=ir.UnitAttr.get(), alignment=64)
        for i, t, sym in plan:
            alloc = _block_ops(entry)[i]
            with ir.InsertionPoint(alloc), alloc.location:
                buf = memref.get_global(t, sym)
            alloc.results[0].replace_all_uses_with(buf)
            alloc.erase()
            count += 1
        for inner in _block_ops(entry):
            src = inner.operands[0] if inner.name == "memref.dealloc" else None
            if isinstance(src, ir.OpResult) and src.owner.operation.name == "memref.get_global":
                inner.erase()
    return count


def _last_use(value: ir.Value, block: ir.Block, position: dict) -> int:
    """Position in `block` of the last op (deallocs aside) that uses `value`
    or a view of it."""
    last = 0
    todo = [value]
    while todo:
        v = todo.pop()
        for use in v.uses:
            user = use.owner.operation
            if user.name == "memref.dealloc":
                continue
            last = max(last, position[_top_level(user, block)])
            if user.name in _VIEW_OPS:
                todo.extend(user.results)
    return last


def _top_level(op: ir.Operation, block: ir.Block) -> ir.Operation:
    """The ancestor of `op` (or `op`) that sits directly in `block`."""
    while op.block != block:
        op = op.parent.operation
    return op


def strided_copies_to_linalg(module: ir.Module) -> int:
    """Turn every ``memref.copy`` with a strided (non-identity) side into a
    ``linalg.copy``, which becomes loops that LLVM vectorizes; returns how
    many. Left alone, such a copy lowers to a call of the C runner's generic
    ``memrefCopy``, which walks the elements one at a time (the slices of a
    grouped convolution split per group, `search/split_conv.py`, spent 19 ms
    there against 0.8 ms in the convolutions). Contiguous copies stay
    ``memref.copy`` (a memcpy)."""
    from mlir.dialects import linalg

    copies: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "memref.copy" and not all(_identity_layout(v.type) for v in op.operands):
            copies.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    for op in copies:
        with ir.InsertionPoint(op), op.location:
            linalg.copy(op.operands[0], outs=[op.operands[1]])
        op.erase()
    return len(copies)


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
