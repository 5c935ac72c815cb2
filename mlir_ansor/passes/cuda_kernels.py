"""The kernels of a whole-module CUDA compile: one task's schedule to PTX and
a cubin, and the PTX of several kernels as one file.

:func:`build_module_kernel` is the chain of `passes.nvvm.build_cuda` (apply
the schedule, map to a ``gpu.launch``, outline, NVVM, PTX, ``ptxas``) with
two differences that a kernel run many times in a model needs and a
candidate timed a few times did not:

  * the task's ``@kernel`` is renamed to a symbol of its own, so that the
    kernels of different tasks have different entry names (one PTX file can
    hold them all, :func:`merge_ptx`), and its arguments are marked
    read-only (``bufferization.writable = false``), so that a kernel never
    writes a buffer it reads (a weight, a model input);
  * a buffer allocated inside a kernel (the anchor's tile that a fused
    epilogue reads: every thread computes and reads back its own part of
    it) becomes a ``memref.alloca`` at the kernel's entry, i.e. per-thread
    local memory, by :func:`device_allocs_to_stack`. Left alone it lowers to
    device ``malloc`` without ``free``: each launch leaks it, and after a few
    megabytes (the device heap) malloc returns null. ptxas reports it as a
    stack frame, which the whole-module compile accepts (a tuned record
    avoids it where tuning finds faster schedules).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict

from mlir import ir, passmanager

from mlir_ansor.ir.rewrite import walk_op
from mlir_ansor.passes.nvvm import (
    GpuBuildError,
    assemble,
    extract_ptx,
    input_rounding,
    launches,
    lower_scheduled_to_launches,
    nvvm_pipeline,
    ptxas_features,
)
from mlir_ansor.target import Target

__all__ = ["build_module_kernel", "device_allocs_to_stack", "merge_ptx", "prepare_payload_for_module"]


def prepare_payload_for_module(payload: str, symbol: str) -> str:
    """`payload` (a task module with ``@kernel``) with the function renamed
    to `symbol`, every argument marked read-only, and an argument that only
    a fill writes replaced by a `tensor.empty` (:func:`_fill_destinations_to_empty`)."""
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(payload)
        for op in module.body.operations:
            op = op.operation
            if op.name != "func.func" or ir.StringAttr(op.attributes["sym_name"]).value != "kernel":
                continue
            n = len(ir.FunctionType(ir.TypeAttr(op.attributes["function_type"]).value).inputs)
            op.attributes["arg_attrs"] = ir.ArrayAttr.get(
                [ir.DictAttr.get({"bufferization.writable": ir.BoolAttr.get(False)}) for _ in range(n)]
            )
            ir.SymbolTable.set_symbol_name(op, symbol)
            _fill_destinations_to_empty(op)
            return str(module)
    raise GpuBuildError("the task module has no @kernel")


def _fill_destinations_to_empty(func: ir.Operation) -> int:
    """Give each argument of `func` that is only ever the destination of a
    `linalg.fill` (a `tensor.empty` the user's function shares between ops,
    passed in rather than cloned) a `tensor.empty` of its own in place of
    the argument; returns how many. The fill overwrites it all, so its
    contents never mattered; read-only, the argument made bufferization copy
    it into a new buffer on the host, which no kernel can hold."""
    from mlir.dialects import tensor

    block = func.regions[0].blocks[0]
    first = block.operations[0]
    replaced = 0
    for arg in block.arguments:
        uses = list(arg.uses)
        if not uses or not isinstance(arg.type, ir.RankedTensorType):
            continue
        if not all(u.owner.name == "linalg.fill" and u.operand_number == len(u.owner.operands) - 1 for u in uses):
            continue
        t = ir.RankedTensorType(arg.type)
        with ir.InsertionPoint(first), func.location:
            empty = tensor.EmptyOp(list(t.shape), t.element_type)
        arg.replace_all_uses_with(empty.result)
        replaced += 1
    return replaced


def device_allocs_to_stack(module: ir.Module) -> int:
    """Replace every static ``memref.alloc`` in global memory inside an
    outlined ``gpu.func`` by a ``memref.alloca`` at the function's entry (its
    deallocs dropped); returns how many. Workgroup buffers are already
    attributions (`nvvm.hoist_workgroup_allocs`) and are left alone."""
    from mlir.dialects import memref

    moved = 0
    for alloc in walk_op(module.operation, "memref.alloc"):
        mtype = ir.MemRefType(alloc.results[0].type)
        if mtype.memory_space is not None or not mtype.has_static_shape or len(alloc.operands):
            continue
        func = alloc.parent
        while func is not None and func.name != "gpu.func":
            func = func.parent
        if func is None:
            continue
        with ir.InsertionPoint.at_block_begin(func.regions[0].blocks[0]), alloc.location:
            new = memref.AllocaOp(mtype, [], [])
        for use in list(alloc.results[0].uses):
            if use.owner.name == "memref.dealloc":
                use.owner.erase()
        alloc.results[0].replace_all_uses_with(new.result)
        alloc.erase()
        moved += 1
    return moved


_MALLOC = re.compile(r"\bcall(\.uni)?\s+\(?[^;]*\bmalloc\b")


def build_module_kernel(payload: str, script: str | None, symbol: str, target: Target, folder: str) -> dict:
    """Build one task of a whole module: apply `script` to `payload`, lower
    to PTX, assemble ``<folder>/<symbol>.cubin`` (and write the PTX beside
    it). Returns the manifest entry: launches (kernel argument i is host
    argument ``args[i]``: the task's inputs, then its outputs), ptxas's
    figures, features, the build time, and how many buffers went to local
    memory, and the type it rounds its inputs to ("tf32" or "",
    `nvvm.input_rounding`). Raises `GpuBuildError` when MLIR or ptxas fail, or when ptxas's
    figures break the target's limits (spills, registers, shared memory)."""
    from mlir_ansor.schedule.apply import apply_schedule

    t0 = time.perf_counter()
    text = prepare_payload_for_module(payload, symbol)
    with ir.Context(), ir.Location.unknown():
        module = apply_schedule(text, script)
        lower_scheduled_to_launches(module, target)
        host = [f for f in walk_op(module.operation, "func.func")]
        if len(host) != 1:
            raise GpuBuildError(f"expected one host function, found {len(host)}")
        kernels = launches(module, host[0])
        stacked = device_allocs_to_stack(module)
        try:
            passmanager.PassManager.parse(nvvm_pipeline(target)).run(module.operation)
        except (ir.MLIRError, ValueError) as e:
            raise GpuBuildError(f"NVVM lowering failed: {e}") from None
        ptx = extract_ptx(module)
    if _MALLOC.search(ptx):
        raise GpuBuildError("a kernel calls device malloc (an allocation left inside the kernel)")
    cubin = os.path.join(folder, f"{symbol}.cubin")
    report = assemble(ptx, target, cubin)
    for k in kernels:
        fig = report.get(k.entry)
        if fig is None:
            raise GpuBuildError(f"ptxas reported nothing for kernel {k.entry}")
        threads = k.block[0] * k.block[1] * k.block[2]
        if fig["spill_stores"] or fig["spill_loads"]:
            raise GpuBuildError(f"{k.entry}: spills registers ({fig['spill_stores']} bytes stored)")
        if fig["smem"] > target.smem_per_block:
            raise GpuBuildError(f"{k.entry}: {fig['smem']} bytes of shared memory > {target.smem_per_block}")
        if fig["registers"] * threads > target.registers_per_block:
            raise GpuBuildError(f"{k.entry}: {fig['registers']} registers x {threads} threads "
                                f"> {target.registers_per_block}")
    with open(os.path.join(folder, f"{symbol}.ptx"), "w", encoding="utf-8") as f:
        f.write(ptx)
    return {
        "symbol": symbol,
        "cubin": f"{symbol}.cubin",
        "ptx": f"{symbol}.ptx",
        "rounds_to": input_rounding(ptx),
        "launches": [asdict(k) for k in kernels],
        "ptxas": report,
        "features": ptxas_features(report, kernels, target, ptx),
        "local_buffers": stacked,
        "build_s": time.perf_counter() - t0,
    }


_HEADER = re.compile(r"^\s*\.(version|target|address_size)\b")


def merge_ptx(texts: list[str]) -> str:
    """The PTX modules `texts` (one target, distinct entry names) as one
    module: the first module's header (``.version``, ``.target``,
    ``.address_size``), then every module's body, each declaration that
    repeats an earlier one (an ``.extern`` function) kept once."""
    if not texts:
        raise GpuBuildError("no PTX to merge")
    out: list[str] = []
    seen: set[str] = set()
    for i, text in enumerate(texts):
        for line in text.splitlines():
            if i and _HEADER.match(line):
                continue
            stripped = line.strip()
            if stripped.startswith(".extern"):
                if stripped in seen:
                    continue
                seen.add(stripped)
            out.append(line)
        out.append("")
    return "\n".join(out)
