"""Lowering to NVIDIA GPUs: scheduled Linalg -> gpu.launch -> NVVM -> PTX -> cubin.

Roadmap (:func:`build_cuda` runs the whole chain on one candidate):

  1. the sketch's transform script has left bufferized loops whose
     ``scf.forall`` ops carry ``#gpu.block`` / ``#gpu.thread`` /
     ``#gpu.warp`` mappings; results become out-parameters;
  2. :func:`map_to_gpu` reads the thread counts of the mapped foralls (the
     mapping ops take static block sizes, the knobs are only known here) and
     applies ``map_forall_to_blocks generate_gpu_launch`` and
     ``map_nested_forall_to_threads``;
  3. :func:`hoist_workgroup_allocs` turns each ``memref.alloc`` in workgroup
     memory inside a ``gpu.launch`` into a workgroup attribution of the
     launch: the only form that became real ``.shared`` buffers (an alloc left
     in the kernel lowers to device ``malloc``; see shared/MLIR-NOTES.md);
  3b. :func:`keep_accumulators_in_registers` (vectorized sketches): folds
     subviews, hoists each thread's (or warp's) output-tile read/write out of
     the K loop, so the accumulator is loop-carried in registers, and lowers
     the vectors (FMAs, or ``ldmatrix`` + ``mma.sync`` for warp tiles);
  3a'. `warp_reduce.shuffle_reductions` (``cuda-warp-reduction``): a row
     merge of per-lane partials becomes ``shfl.sync.bfly`` butterflies;
  3c. `async_copies.pipeline_shared_copies` (a sketch whose ``stages`` knob
     is 2 or more): the K loop's copies to shared memory become ``cp.async``,
     multi-buffered and software-pipelined;
  4. outlining (kernel buffers marked 16-byte aligned and `noalias`,
     :func:`annotate_kernel_pointers`, for 128-bit global loads), then :func:`launches` reads every ``gpu.launch_func`` (kernel
     name, grid, block, which host argument each kernel argument is); host
     code other than launches is refused: all computation must be on the GPU;
  5. ``gpu-lower-to-nvvm-pipeline`` (``cubin-format=isa``, bare-pointer
     kernel arguments), and the PTX is read from the ``gpu.binary`` object
     through ``gpu.ObjectAttr``;
  6. :func:`assemble` runs the CUDA toolkit's ``ptxas -v`` for the cubin, and
     :func:`parse_ptxas_report` turns its report into numbers (registers,
     spills, shared memory) that :func:`check_limits` filters on and
     :func:`ptxas_features` turns into cost-model features (with occupancy
     and the PTX instruction mix).

The result is plain data (a manifest entry plus the cubin file), so the GPU
host that measures it needs no MLIR (`measure/cuda_runner.py`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlir import ir, passmanager
from mlir.dialects import gpu

from mlir_ansor.ir.rewrite import walk_op
from mlir_ansor.passes.async_copies import pipeline_shared_copies
from mlir_ansor.passes.warp_reduce import shuffle_reductions
from mlir_ansor.target import Target

_DTYPES = {"f32": "f32", "f16": "f16", "f64": "f64", "bf16": "bf16", "i32": "i32", "i64": "i64", "i8": "i8"}


class GpuBuildError(RuntimeError):
    """The candidate cannot become a valid cubin (MLIR or ptxas said why)."""


@dataclass
class KernelLaunch:
    """One `gpu.launch_func`: what the runner needs to launch a kernel.

    args: per kernel argument, the index of the host function argument it
    is (inputs first, then outputs); every kernel argument is a pointer.
    """

    entry: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    args: tuple[int, ...]
    dynamic_smem: int = 0


@dataclass
class CudaBuild:
    """A built candidate: PTX, cubin and how to launch it."""

    ptx: str
    cubin_path: str
    launches: list[KernelLaunch]
    buffers: list[dict]  # host arguments: {"role", "shape", "dtype"}
    ptxas: dict = field(default_factory=dict)  # entry -> report figures
    build_s: float = 0.0
    features: dict = field(default_factory=dict)  # `ptxas_features`: cost-model inputs

    def dropped(self, target: Target) -> str | None:
        """Why this candidate is not worth measuring (`check_limits`)."""
        return check_limits(self.ptxas, self.launches, target)

    def to_json(self) -> dict:
        return {
            "cubin": os.path.basename(self.cubin_path),
            "rounds_to": input_rounding(self.ptx),
            "launches": [asdict(k) for k in self.launches],
            "buffers": self.buffers,
            "ptxas": self.ptxas,
            "features": self.features,
            "build_s": self.build_s,
        }


_TF32_MMA = re.compile(r"\bmma\.sync\.\S*\.tf32\b")


def input_rounding(ptx: str) -> str:
    """The type a kernel rounds its f32 inputs to: "tf32" when its PTX has a
    tensor-core mma on tf32 operands (`cuda-mma` on f32), else "". Its check
    against an f32 reference then admits that rounding (`ir.dtypes.tolerance`
    with ``rounds_to``; `measure.cuda_runner.run` reads it from the manifest)."""
    return "tf32" if _TF32_MMA.search(ptx) else ""


def ptx_features(target: Target) -> str:
    """The PTX ISA version the arch needs (sm_90 needs >= 7.8)."""
    return "+ptx86" if target.arch >= 100 else "+ptx80"


def nvvm_pipeline(target: Target) -> str:
    return (
        "builtin.module(gpu-lower-to-nvvm-pipeline{"
        f"cubin-chip={target.chip} cubin-features={ptx_features(target)} cubin-format=isa "
        "kernel-bare-ptr-calling-convention=true})"
    )


# --------------------------------------------------------------------------
# IR steps (the current MLIR context is used)
# --------------------------------------------------------------------------


def _walk(module: ir.Module, name: str) -> list[ir.Operation]:
    return walk_op(module.operation, name)


def erase_self_copies(module: ir.Module) -> int:
    """Drop `memref.copy`/`linalg.copy` of a buffer onto itself (left by
    bufferizing `scf.forall`; on the device they would be real copies)."""
    dead = [
        op
        for name in ("memref.copy", "linalg.copy")
        for op in _walk(module, name)
        if len(op.operands) == 2 and op.operands[0] == op.operands[1]
    ]
    for op in dead:
        op.erase()
    return len(dead)


def _trip_counts(forall: ir.Operation) -> list[int]:
    attrs = forall.attributes
    ub = list(ir.DenseI64ArrayAttr(attrs["staticUpperBound"]))
    lb = list(ir.DenseI64ArrayAttr(attrs["staticLowerBound"])) if "staticLowerBound" in attrs else [0] * len(ub)
    st = list(ir.DenseI64ArrayAttr(attrs["staticStep"])) if "staticStep" in attrs else [1] * len(ub)
    dyn = ir.ShapedType.get_dynamic_size()
    if dyn in ub or dyn in lb or dyn in st:
        raise GpuBuildError("a mapped scf.forall has dynamic bounds: its thread count is unknown")
    return [-(-(u - low) // s) for u, low, s in zip(ub, lb, st)]


def block_dims(module: ir.Module, warp_size: int = 32) -> tuple[int, int, int]:
    """The block size the thread/warp-mapped foralls need (max per axis)."""
    dims = {"x": 1, "y": 1, "z": 1}
    for forall in _walk(module, "scf.forall"):
        if "mapping" not in forall.attributes:
            continue
        for attr, count in zip(ir.ArrayAttr(forall.attributes["mapping"]), _trip_counts(forall)):
            text = str(attr)
            for axis in dims:
                if text == f"#gpu.thread<{axis}>":
                    dims[axis] = max(dims[axis], count)
                elif text == f"#gpu.warp<{axis}>":
                    dims[axis] = max(dims[axis], count * (warp_size if axis == "x" else 1))
    return dims["x"], dims["y"], dims["z"]


def _apply_script(module: ir.Module, script: str) -> None:
    from mlir.dialects.transform import interpreter

    sched = ir.Module.parse(script)
    entry = next(op for op in sched.body.operations if op.operation.name == "transform.named_sequence")
    try:
        interpreter.apply_named_sequence(module.operation, entry, sched)
    except (ir.MLIRError, ValueError) as e:
        raise GpuBuildError(f"mapping to the GPU failed: {e}") from None


def map_to_gpu(module: ir.Module, target: Target) -> tuple[int, int, int]:
    """Map the block forall to a `gpu.launch` and the nested foralls to
    threads/warps; returns the block size."""
    bx, by, bz = block_dims(module, target.warp_size or 32)
    if bx * by * bz > (target.max_threads_per_block or 1024):
        raise GpuBuildError(f"block of {bx}x{by}x{bz} threads exceeds {target.max_threads_per_block}")
    any_op = "!transform.any_op"
    script = (
        "module attributes {transform.with_named_sequence} {\n"
        f"  transform.named_sequence @__transform_main(%root: {any_op} {{transform.readonly}}) {{\n"
        f'    %f = transform.structured.match ops{{["func.func"]}} in %root : ({any_op}) -> {any_op}\n'
        f"    %l = transform.gpu.map_forall_to_blocks %f generate_gpu_launch : ({any_op}) -> {any_op}\n"
        f"    %t = transform.gpu.map_nested_forall_to_threads %l block_dims = [{bx}, {by}, {bz}] "
        f"warp_size = {target.warp_size or 32} : ({any_op}) -> {any_op}\n"
        "    transform.yield\n  }\n}\n"
    )
    _apply_script(module, script)
    return bx, by, bz


def hoist_workgroup_allocs(module: ir.Module) -> int:
    """Replace each static `memref.alloc` in workgroup memory inside a
    `gpu.launch` by a workgroup attribution of that launch (a `.shared`
    buffer); returns how many were moved."""
    moved = 0
    for launch in _walk(module, "gpu.launch"):
        allocs = [
            op
            for inner in launch.regions[0].blocks[0].operations
            for op in walk_op(inner.operation, "memref.alloc")
            if "workgroup" in str(ir.MemRefType(op.results[0].type).memory_space)
        ]
        if not allocs:
            continue
        body = launch.regions[0].blocks[0]
        count = ir.IntegerAttr(launch.attributes["workgroup_attributions"]).value if "workgroup_attributions" in launch.attributes else 0
        if len(body.arguments) != 12 + count:
            raise GpuBuildError("gpu.launch has private attributions; cannot add workgroup buffers")
        for alloc in allocs:
            mtype = ir.MemRefType(alloc.results[0].type)
            if not mtype.has_static_shape or len(alloc.operands) != 0:
                raise GpuBuildError("a shared-memory buffer has a dynamic shape")
            arg = body.add_argument(mtype, alloc.location)
            for use in list(alloc.results[0].uses):
                if use.owner.name == "memref.dealloc":
                    use.owner.erase()
            alloc.results[0].replace_all_uses_with(arg)
            alloc.erase()
            count += 1
            moved += 1
        launch.attributes["workgroup_attributions"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), count)
    return moved


#: The mma.sync shape warp-level f16 contractions are unrolled to.
MMA_SHAPE = (16, 8, 16)

_VECTOR_LOWERING = (
    'transform.apply_patterns.vector.lower_contraction lowering_strategy = "outerproduct"',
    "transform.apply_patterns.vector.transfer_permutation_patterns",
    'transform.apply_patterns.vector.lower_multi_reduction lowering_strategy = "innerparallel"',
    "transform.apply_patterns.vector.transfer_to_scf max_transfer_rank = 1 full_unroll = true",
    "transform.apply_patterns.vector.lower_transfer max_transfer_rank = 1",
    "transform.apply_patterns.vector.lower_shape_cast",
    'transform.apply_patterns.vector.lower_transpose lowering_strategy = "shuffle_1d"',
    "transform.apply_patterns.vector.lower_outerproduct",
    "transform.apply_patterns.canonicalization",
)


def uses_warp_mapping(module: ir.Module) -> bool:
    """Whether an `scf.forall` is mapped to `#gpu.warp` (a tensor-core schedule)."""
    return any(
        "#gpu.warp<" in str(f.attributes["mapping"]) for f in _walk(module, "scf.forall") if "mapping" in f.attributes
    )


def _script(body: list[str]) -> str:
    any_op = "!transform.any_op"
    lines = "\n".join("    " + b for b in body)
    return (
        "module attributes {transform.with_named_sequence} {\n"
        f"  transform.named_sequence @__transform_main(%root: {any_op} {{transform.readonly}}) {{\n"
        f"{lines}\n    transform.yield\n  }}\n}}\n"
    )


def keep_accumulators_in_registers(module: ir.Module, mma_shape: tuple[int, int, int] | None = None) -> None:
    """Inside the mapped launch: fold subviews into the vector transfers,
    hoist loop-invariant code, then move each thread's (or warp's) read and
    write of its output tile out of the reduction loop (the accumulator
    becomes a loop-carried vector, i.e. registers), and lower the vectors:
    to 1-D loads/stores and FMAs, or, with `mma_shape` (warp-level
    contractions), unrolled to that shape and turned into `nvgpu.mma.sync`
    with `nvgpu.ldmatrix` reads of shared memory. A no-op on kernels without
    vector ops.

    Why after mapping: before it, the thread-level `scf.forall` sits inside
    the reduction loop (the block's copies to shared memory need every
    thread between two barriers), so the output tile's indices only become
    loop-invariant once the forall has turned into thread ids."""
    if not _walk(module, "vector.contract") and not _walk(module, "vector.transfer_read"):
        return
    any_op = "!transform.any_op"
    func = f'%f = transform.structured.match ops{{["func.func"]}} in %root : ({any_op}) -> {any_op}'
    hoist = [
        func,
        "transform.apply_patterns to %f {",
        "  transform.apply_patterns.memref.fold_memref_alias_ops",
        "  transform.apply_patterns.canonicalization",
        f"}} : {any_op}",
        f"transform.apply_cse to %f : {any_op}",
    ]
    if mma_shape is not None:
        # Unrolled first, so that each mma-sized piece of the accumulator
        # gets its own read/write pair to hoist (one loop-carried vector per
        # mma tile, the form convert-vector-to-gpu takes).
        m, n, k = mma_shape
        hoist += [
            "transform.apply_patterns to %f {",
            f"  transform.apply_patterns.gpu.unroll_vectors_subgroup_mma [{m}, {n}, {k}]",
            "  transform.apply_patterns.canonicalization",
            f"}} : {any_op}",
            f"transform.apply_cse to %f : {any_op}",
        ]
    hoist += [
        f'%loops = transform.structured.match ops{{["scf.for"]}} in %f : ({any_op}) -> {any_op}',
        f"transform.apply_licm to %loops : {any_op}",
        f"%h = transform.structured.hoist_redundant_vector_transfers %f : ({any_op}) -> {any_op}",
    ]
    _apply_script(module, _script(hoist))
    barrier_after_hoisted_shared_writes(module)
    if mma_shape is not None:
        try:
            passmanager.PassManager.parse(
                "builtin.module(func.func(convert-vector-to-gpu{use-nvgpu=true}),canonicalize,cse)"
            ).run(module.operation)
        except (ir.MLIRError, ValueError) as e:
            raise GpuBuildError(f"turning warp-level contractions into mma.sync failed: {e}") from None
    lower = [func, "transform.apply_patterns to %f {"]
    lower += ["  " + p for p in _VECTOR_LOWERING]
    lower += [f"}} : {any_op}", f"transform.apply_cse to %f : {any_op}"]
    # Broadcasts to n-D vectors (a register tile of one row) are lowered on
    # their own: together with canonicalization the patterns never settle.
    lower += [
        "transform.apply_patterns to %f {",
        "  transform.apply_patterns.vector.lower_broadcast",
        "  transform.apply_patterns.vector.lower_shape_cast",
        f"}} : {any_op}",
    ]
    _apply_script(module, _script(lower))


def barrier_after_hoisted_shared_writes(module: ir.Module) -> int:
    """Put a `gpu.barrier` after the writes that hoisting moved to just
    after a loop inside a `gpu.launch` when they write workgroup memory;
    returns how many barriers were added.

    Why: a warp's accumulator tile written to shared memory once, after the
    K loop (`keep_accumulators_in_registers`), is read by other threads
    next (an epilogue distributed over the whole block, `cuda-mma-smem` on
    an f16 GEMM); the barriers the thread mapping put after each forall are
    inside the loop, so without this one those reads raced the writes."""
    added = 0
    for launch in _walk(module, "gpu.launch"):
        for loop in walk_op(launch, "scf.for"):
            ops = [o.operation for o in loop.block.operations]
            i = next(k for k, o in enumerate(ops) if o == loop) + 1
            last = None
            while i < len(ops) and ops[i].name == "vector.transfer_write":
                if "workgroup" in str(ir.MemRefType(ops[i].operands[1].type).memory_space):
                    last = ops[i]
                i += 1
            if last is None or (i < len(ops) and ops[i].name == "gpu.barrier"):
                continue
            with ir.InsertionPoint(ops[i]) if i < len(ops) else ir.InsertionPoint(loop.block), last.location:
                gpu.BarrierOp()
            added += 1
    return added


#: Byte alignment promised for every kernel buffer: the runner allocates
#: each one with cuMemAlloc (256-byte aligned); 16 is what 128-bit loads need.
BUFFER_ALIGNMENT = 16


def annotate_kernel_pointers(module: ir.Module) -> int:
    """Mark every memref argument of every outlined kernel `llvm.align =
    BUFFER_ALIGNMENT`: the runner passes cuMemAlloc'd buffers. With this,
    LLVM proves from the index arithmetic which accesses are 16-byte aligned
    and emits `ld.global.v4` for them (a bare pointer has element alignment
    only, and 4-wide vector loads were split into scalar ones). Returns how
    many arguments were marked.

    Not `llvm.noalias`: it gave `ld.global.nc`, but LLVM then also kept the
    unstaged sketches' whole per-thread output tiles in registers, and
    fully unrolled loops spilled (up to 2 KB of stack)."""
    count = 0
    for func in _walk(module, "gpu.func"):
        if "gpu.kernel" not in func.attributes:
            continue
        args = func.regions[0].blocks[0].arguments
        n = len(list(ir.FunctionType(ir.TypeAttr(func.attributes["function_type"]).value).inputs))
        dicts = []
        for i in range(n):
            entries: dict[str, ir.Attribute] = {}
            if "arg_attrs" in func.attributes:
                old = ir.DictAttr(ir.ArrayAttr(func.attributes["arg_attrs"])[i])
                entries = {old[j].name: old[j].attr for j in range(len(old))}
            if isinstance(args[i].type, ir.MemRefType):
                entries["llvm.align"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), BUFFER_ALIGNMENT)
                count += 1
            dicts.append(ir.DictAttr.get(entries))
        func.attributes["arg_attrs"] = ir.ArrayAttr.get(dicts)
    return count


def _constant(value: ir.Value) -> int:
    owner = value.owner
    if not isinstance(owner, ir.Block) and owner.name in ("arith.constant", "llvm.mlir.constant"):
        return ir.IntegerAttr(owner.attributes["value"]).value
    raise GpuBuildError("a launch dimension is not a constant")


_HOST_OPS = {"arith.constant", "gpu.launch_func", "func.return"}


def launches(module: ir.Module, func: ir.Operation) -> list[KernelLaunch]:
    """The kernel launches of the outlined host function `func`, in order."""
    body = func.regions[0].blocks[0]
    args = list(body.arguments)
    out: list[KernelLaunch] = []
    for op in body.operations:
        name = op.operation.name
        if name not in _HOST_OPS:
            raise GpuBuildError(f"host code has a {name}: the schedule left work outside the GPU kernels")
        if name != "gpu.launch_func":
            continue
        lf = op.opview if hasattr(op, "opview") else op
        kernel = str(lf.operation.attributes["kernel"])  # @module::@entry
        entry = kernel.split("::")[-1].lstrip("@")
        grid = tuple(_constant(v) for v in (lf.gridSizeX, lf.gridSizeY, lf.gridSizeZ))
        block = tuple(_constant(v) for v in (lf.blockSizeX, lf.blockSizeY, lf.blockSizeZ))
        kargs = []
        for v in lf.kernelOperands:
            if v not in args:
                raise GpuBuildError("a kernel argument is not an argument of the host function")
            kargs.append(args.index(v))
        out.append(KernelLaunch(entry, grid, block, tuple(kargs)))  # type: ignore[arg-type]
    if not out:
        raise GpuBuildError("no GPU kernel was generated")
    return out


def extract_ptx(module: ir.Module) -> str:
    """The PTX of the (single) `gpu.binary` of a lowered module."""
    texts = []
    for binary in _walk(module, "gpu.binary"):
        for obj in ir.ArrayAttr(binary.attributes["objects"]):
            data = gpu.ObjectAttr(obj).object
            texts.append(data.decode() if isinstance(data, bytes) else str(data))
    if len(texts) != 1:
        raise GpuBuildError(f"expected one GPU binary object, found {len(texts)}")
    return texts[0]


def _buffers(func: ir.Operation, num_inputs: int) -> list[dict]:
    out = []
    for i, arg in enumerate(func.regions[0].blocks[0].arguments):
        t = ir.MemRefType(arg.type)
        out.append({"role": "input" if i < num_inputs else "output", "shape": list(t.shape), "dtype": str(t.element_type)})
    return out


# --------------------------------------------------------------------------
# ptxas
# --------------------------------------------------------------------------


def find_ptxas() -> str | None:
    """The CUDA toolkit's ptxas: $PTXAS, PATH, $CUDA_HOME/bin, /usr/local/cuda/bin."""
    env = os.environ.get("PTXAS")
    if env and Path(env).exists():
        return env
    found = shutil.which("ptxas")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (Path(root) / "bin" / "ptxas").exists():
            return str(Path(root) / "bin" / "ptxas")
    return None


_FUNC_RE = re.compile(r"(?:Compiling entry function|Function properties for) '?([\w$.]+)'?")
_STACK_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED_RE = re.compile(r"Used (\d+) registers")
_SMEM_RE = re.compile(r"(\d+) bytes smem")
_BARRIERS_RE = re.compile(r"used (\d+) barriers")


def parse_ptxas_report(text: str) -> dict[str, dict]:
    """Per kernel entry, the figures of `ptxas -v`: registers, spill_stores,
    spill_loads, stack, smem (static shared bytes), barriers."""
    report: dict[str, dict] = {}
    current: dict | None = None
    for line in text.splitlines():
        m = _FUNC_RE.search(line)
        if m:
            current = report.setdefault(
                m.group(1), {"registers": 0, "spill_stores": 0, "spill_loads": 0, "stack": 0, "smem": 0, "barriers": 0}
            )
            continue
        if current is None:
            continue
        m = _STACK_RE.search(line)
        if m:
            current["stack"], current["spill_stores"], current["spill_loads"] = (int(g) for g in m.groups())
        m = _USED_RE.search(line)
        if m:
            current["registers"] = int(m.group(1))
            s = _SMEM_RE.search(line)
            current["smem"] = int(s.group(1)) if s else 0
            b = _BARRIERS_RE.search(line)
            current["barriers"] = int(b.group(1)) if b else 0
    return report


def assemble(ptx: str, target: Target, cubin_path: str, ptxas: str | None = None, timeout_s: float = 60.0) -> dict[str, dict]:
    """Assemble `ptx` into `cubin_path` with `ptxas -v`; returns its report."""
    exe = ptxas or find_ptxas()
    if exe is None:
        raise GpuBuildError("ptxas not found (install the CUDA toolkit, or set $PTXAS / $CUDA_HOME)")
    with tempfile.TemporaryDirectory(prefix="ansor-ptx-") as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(ptx)
        proc = subprocess.run(
            [exe, f"-arch={target.chip}", "-v", "-o", cubin_path, str(src)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    if proc.returncode != 0:
        raise GpuBuildError(f"ptxas failed: {(proc.stderr or proc.stdout).strip()[-2000:]}")
    return parse_ptxas_report(proc.stdout + proc.stderr)


def check_limits(report: dict[str, dict], launches_: list[KernelLaunch], target: Target) -> str | None:
    """Why a built candidate is dropped before measuring (None: keep it):
    spills or a stack frame (local-memory traffic), shared memory or
    registers past the target's limits."""
    for k in launches_:
        fig = report.get(k.entry)
        if fig is None:
            return f"ptxas reported nothing for kernel {k.entry}"
        if fig["spill_stores"] or fig["spill_loads"]:
            return f"{k.entry}: spills registers ({fig['spill_stores']} bytes stored)"
        if fig["stack"]:
            return f"{k.entry}: a {fig['stack']}-byte stack frame (local memory)"
        if fig["smem"] > target.smem_per_block:
            return f"{k.entry}: {fig['smem']} bytes of shared memory > {target.smem_per_block}"
        threads = k.block[0] * k.block[1] * k.block[2]
        if fig["registers"] * threads > target.registers_per_block:
            return f"{k.entry}: {fig['registers']} registers x {threads} threads > {target.registers_per_block}"
    return None


# Per streaming multiprocessor: (threads, shared memory bytes, blocks), by
# compute capability; registers per SM equal `Target.registers_per_block`.
_SM_LIMITS = {70: (2048, 96 * 1024, 32), 75: (1024, 64 * 1024, 16), 80: (2048, 164 * 1024, 32),
              86: (1536, 100 * 1024, 16), 89: (1536, 100 * 1024, 24), 90: (2048, 228 * 1024, 32)}

#: PTX opcode families counted by :func:`ptx_instruction_mix`.
PTX_FAMILIES = (
    "mma.sync", "ldmatrix", "cp.async", "bar.sync", "fma", "ld.global.v", "ld.global", "st.global.v", "st.global",
    "ld.shared", "st.shared", "ld.local", "st.local",
)


def ptx_instruction_mix(ptx: str) -> dict[str, int]:
    """Static count of the PTX instructions of each family in `PTX_FAMILIES`
    (vector and scalar global accesses apart: "ld.global" counts the scalar
    ones, "ld.global.v" the 2- and 4-wide ones; ".nc" loads included)."""
    counts = dict.fromkeys(PTX_FAMILIES, 0)
    for line in ptx.splitlines():
        text = line.strip()
        if not text or text.startswith(("//", ".", "{", "}")) or text.endswith(":"):
            continue
        if text.startswith("@"):  # predicated: drop the guard
            text = text.split(None, 1)[1] if " " in text else ""
        op = text.split(None, 1)[0] if text else ""
        parts = op.split(".")
        for fam in ("mma.sync", "ldmatrix", "cp.async", "bar.sync", "ld.shared", "st.shared", "ld.local", "st.local"):
            if op.startswith(fam):
                counts[fam] += 1
        if parts[0] == "fma":
            counts["fma"] += 1
        for kind in ("ld", "st"):
            if parts[0] == kind and len(parts) > 1 and parts[1] == "global":
                vector = any(p in ("v2", "v4", "v8") for p in parts[2:])
                counts[f"{kind}.global.v" if vector else f"{kind}.global"] += 1
    return counts


def ptxas_features(report: dict[str, dict], launches_: list[KernelLaunch], target: Target, ptx: str = "") -> dict[str, float]:
    """Numeric features of a built candidate for a cost model: ptxas's
    figures (registers, spill bytes, stack, static shared memory) of its
    heaviest kernel, the block shape, the occupancy they allow (resident
    blocks and warps per SM, from registers, shared memory and threads), and
    with `ptx` the static instruction mix (`ptx_instruction_mix`)."""
    sm_threads, sm_smem, sm_blocks = _SM_LIMITS.get(target.arch, (2048, target.smem_per_block_optin or 48 * 1024, 16))
    regs_sm = target.registers_per_block or 65536
    best: dict[str, float] = {}
    for k in launches_:
        fig = report.get(k.entry, {})
        threads = k.block[0] * k.block[1] * k.block[2]
        warps = -(-threads // (target.warp_size or 32))
        regs = max(1, int(fig.get("registers", 0)))
        regs_per_warp = -(-regs * (target.warp_size or 32) // 256) * 256  # allocation unit: 256 per warp
        by_regs = regs_sm // max(1, regs_per_warp * warps)
        smem = int(fig.get("smem", 0))
        by_smem = sm_smem // smem if smem else sm_blocks
        blocks = max(0, min(sm_blocks, sm_threads // max(1, threads), by_regs, by_smem))
        feats = {
            "registers": float(regs),
            "spill_bytes": float(fig.get("spill_stores", 0) + fig.get("spill_loads", 0)),
            "stack": float(fig.get("stack", 0)),
            "smem": float(smem),
            "threads": float(threads),
            "grid_blocks": float(k.grid[0] * k.grid[1] * k.grid[2]),
            "blocks_per_sm": float(blocks),
            "occupancy": blocks * warps / (sm_threads / (target.warp_size or 32)),
        }
        if not best or feats["grid_blocks"] * feats["threads"] > best["grid_blocks"] * best["threads"]:
            best = feats
    if ptx:
        best.update({f"ptx_{name}": float(v) for name, v in ptx_instruction_mix(ptx).items()})
    return best


# --------------------------------------------------------------------------
# The whole chain
# --------------------------------------------------------------------------


def _num_inputs(payload: str) -> int:
    module = ir.Module.parse(payload)
    (func,) = _walk(module, "func.func")
    return len(func.regions[0].blocks[0].arguments)


def lower_scheduled_to_launches(module: ir.Module, target: Target) -> None:
    """A GPU-scheduled module (block and thread `scf.forall`s, bufferized)
    to host code with `gpu.launch_func`s and outlined kernels, in place."""
    try:
        passmanager.PassManager.parse(
            "builtin.module(buffer-results-to-out-params{hoist-static-allocs=true modify-public-functions=true},"
            "canonicalize,cse)"
        ).run(module.operation)
        erase_self_copies(module)
        warps = uses_warp_mapping(module)
        map_to_gpu(module, target)
        hoist_workgroup_allocs(module)
        shuffle_reductions(module, target.warp_size or 32)
        keep_accumulators_in_registers(module, MMA_SHAPE if warps else None)
        pipeline_shared_copies(module)
        passmanager.PassManager.parse(
            "builtin.module(func.func(convert-linalg-to-loops,lower-affine,canonicalize,cse),"
            "gpu-launch-sink-index-computations,gpu-kernel-outlining,canonicalize,cse)"
        ).run(module.operation)
        annotate_kernel_pointers(module)
    except (ir.MLIRError, ValueError) as e:
        raise GpuBuildError(f"lowering to gpu.launch_func failed: {e}") from None


def lower_to_nvvm(module: ir.Module, target: Target) -> None:
    """A GPU-scheduled module all the way to NVVM, with the kernels' PTX/ISA
    in a `gpu.binary` (read it with :func:`extract_ptx`), in place."""
    lower_scheduled_to_launches(module, target)
    try:
        passmanager.PassManager.parse(nvvm_pipeline(target)).run(module.operation)
    except (ir.MLIRError, ValueError) as e:
        raise GpuBuildError(f"NVVM lowering failed: {e}") from None


def build_cuda(payload: str, script: str | None, target: Target, cubin_path: str) -> CudaBuild:
    """Apply `script` to `payload`, lower to PTX and assemble `cubin_path`.

    Raises :class:`GpuBuildError` (or `measure.builder.BuildError` for a
    failing schedule) with the reason."""
    from mlir_ansor.schedule.apply import apply_schedule

    t0 = time.perf_counter()
    with ir.Context(), ir.Location.unknown():
        n_inputs = _num_inputs(payload)
        module = apply_schedule(payload, script)
        lower_scheduled_to_launches(module, target)
        host = [f for f in _walk(module, "func.func")]
        if len(host) != 1:
            raise GpuBuildError(f"expected one host function, found {len(host)}")
        buffers = _buffers(host[0], n_inputs)
        kernels = launches(module, host[0])
        try:
            passmanager.PassManager.parse(nvvm_pipeline(target)).run(module.operation)
        except (ir.MLIRError, ValueError) as e:
            raise GpuBuildError(f"NVVM lowering failed: {e}") from None
        ptx = extract_ptx(module)
    report = assemble(ptx, target, cubin_path)
    features = ptxas_features(report, kernels, target, ptx)
    return CudaBuild(ptx, cubin_path, kernels, buffers, report, time.perf_counter() - t0, features)
