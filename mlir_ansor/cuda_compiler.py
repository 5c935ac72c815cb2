"""Compile a whole module for an NVIDIA GPU: kernels (PTX and cubins) and a
host-side plan, written as a bundle folder that `measure.cuda_module.CudaModule`
runs without MLIR.

Roadmap: :func:`compile_cuda` (what ``compile(..., target=Target.cuda())``
returns) calls :func:`build_bundle`:

1. the module is loaded, its constant-only Linalg ops are folded with numpy
   (`graph.constants`, `graph.fold_eval`), and the entry function is split
   into task occurrences (`graph.task.partition`, as the CPU compiler does);
2. :func:`plan_cuda_kernels` lists, per distinct task, the schedules to try
   in order: the best valid records of the database for this target (any
   host, any thread count: GPU records do not depend on CPU threads), then
   sound defaults: each GPU sketch in rule order with its best few default
   assignments (`search.gpu_defaults`: for a contraction a register tile of
   16-64 outputs per thread, never one thread per output);
3. every distinct task is built, in isolated worker processes (an MLIR build
   with assertions can abort), by `passes.cuda_kernels.build_module_kernel`
   (PTX, cubin, ptxas's figures checked); one that fails falls to its next
   schedule, and a task with none left is an error naming it;
4. :func:`host_plan` walks the entry function in program order and makes the
   plan: one buffer per function argument, per constant (a weight, written
   to ``weights/`` and uploaded once), per task result (a distinct buffer
   each: no reuse yet) and per ``tensor.empty`` a task reads; expand_shape,
   collapse_shape and same-shape casts are views (the same bytes: tensors
   are dense and row-major); the launches of each occurrence in order. Any
   other op outside the tasks whose value the plan needs is an error naming
   the op: the plan has no host computation.

The bundle's layout and plan format are documented in `measure.cuda_module`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field

import numpy as np
from mlir import ir

from mlir_ansor.errors import AnsorError, UnsupportedError
from mlir_ansor.graph.task import Occurrence, Task
from mlir_ansor.importers import load
from mlir_ansor.ir.program import Program, location_str, resource_blobs, resource_bytes
from mlir_ansor.measure.cuda_module import FORMAT, PLAN_FILE, VERSION, CudaModule
from mlir_ansor.measure.cuda_runner import np_dtype
from mlir_ansor.measure.pool import WorkerPool
from mlir_ansor.passes.cuda_kernels import build_module_kernel, merge_ptx
from mlir_ansor.search.tasks import occurrences_for
from mlir_ansor.target import Target, usable_cores

__all__ = ["CudaKernelPlan", "build_bundle", "bundle_ptx", "compile_cuda", "host_plan", "plan_cuda_kernels"]

log = logging.getLogger("mlir_ansor")

DEFAULTS_PER_SKETCH = 2
"""Default assignments tried per GPU sketch before the next sketch."""


@dataclass
class CudaKernelPlan:
    """How one distinct task is compiled for the GPU: the schedules to try
    (`candidates`, best first) and, once built, the one that was.

    source: "tuned" (a record of the database) or "default"."""

    task: Task
    symbol: str
    candidates: list[tuple[str, str, str, tuple, float]] = field(default_factory=list)
    """(source, sketch name, concrete script, knobs, record latency) per schedule to try."""
    source: str = ""
    sketch_name: str = ""
    knobs: tuple = ()
    latency_s: float = math.inf
    trials: int = 0
    errors: list[str] = field(default_factory=list)
    """Why each schedule tried before the one built failed."""
    payload: str = ""

    def to_json(self) -> dict:
        """The task's line of a report (the keys of `compiler.KernelPlan.to_json`)."""
        lat = self.latency_s if math.isfinite(self.latency_s) else None
        return {
            "name": self.task.name,
            "workload_key": self.task.workload_key,
            "flops": self.task.flops,
            "weight": self.task.weight,
            "trials": self.trials,
            "schedule": self.source,
            "sketch": self.sketch_name,
            "knobs": dict(self.knobs),
            "best_latency_s": lat,
            "gflops": self.task.flops / lat / 1e9 if lat else 0.0,
            "baseline_latency_s": None,
            "error": "; ".join(self.errors),
            "reduction_length": self.task.reduction_length,
            "rounding_dtype": self.task.rounding_dtype,
        }


def _symbol(task: Task) -> str:
    return "ansor_" + "".join(c if c.isalnum() or c == "_" else "_" for c in task.name)


def plan_cuda_kernels(tasks: list[Task], *, db: str | os.PathLike | None, target: Target) -> list[CudaKernelPlan]:
    """Per task, the schedules to try in order (see the module's roadmap, step 2)."""
    from mlir_ansor.records import Database
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.gpu_defaults import default_gpu_assignments

    database = None
    if db is not None:
        if os.path.exists(db) and os.path.getsize(db) > 0:
            database = Database(db, readonly=True)
        else:
            log.warning("compile: no records database at %s; every task gets the default GPU schedule", db)
    plans = []
    try:
        for task in tasks:
            plan = CudaKernelPlan(task, _symbol(task))
            try:
                sketches = generate_sketches(task.mlir, target)
            except AnsorError as e:
                raise AnsorError(f"task {task.name}: no GPU sketch ({e})") from None
            plan.payload = sketches[0].payload
            if database is not None:
                plan.trials = database.count(task.workload_key, target.key)
                by_hash = {sk.hash: sk for sk in sketches}
                for rec in database.best(task.workload_key, target.key, k=16):
                    sk = by_hash.get(rec.sketch_hash)
                    if sk is None or sk.knob_problem(rec.knobs) is not None:
                        continue
                    plan.candidates.append(("tuned", sk.name, sk.concrete(rec.knobs), tuple(rec.knobs), rec.latency_s))
                if plan.trials and not plan.candidates:
                    log.warning("compile: task %s: no valid record whose sketch is still generated", task.name)
            for sk in sketches:
                try:
                    assignments = default_gpu_assignments(sk, target, count=DEFAULTS_PER_SKETCH)
                except UnsupportedError as e:
                    log.info("compile: task %s: sketch %s has no default (%s)", task.name, sk.name, e)
                    continue
                for a in assignments:
                    try:
                        plan.candidates.append(("default", sk.name, sk.concrete(a), tuple(a), math.inf))
                    except ir.MLIRError as e:
                        log.info("compile: task %s: sketch %s does not parse (%s)", task.name, sk.name, e)
                        break
            if not plan.candidates:
                raise AnsorError(f"task {task.name}: no GPU schedule within the limits of {target.key}")
            plans.append(plan)
    finally:
        if database is not None:
            database.close()
    return plans


_POOL: list[WorkerPool] = []


def _pool() -> WorkerPool:
    """The worker processes kernels are built in, started once per process."""
    if not _POOL:
        import atexit

        pool = WorkerPool(max(1, min(usable_cores(), 4)), max_jobs_per_worker=50)
        atexit.register(pool.close)
        _POOL.append(pool)
    return _POOL[0]


def build_kernels(plans: list[CudaKernelPlan], target: Target, folder: str) -> dict[str, dict]:
    """Build every plan's first schedule that works (in worker processes,
    all tasks at once, then the failed ones with their next schedule);
    returns symbol -> manifest entry (`passes.cuda_kernels.build_module_kernel`)."""
    built: dict[str, dict] = {}
    next_try = {p.symbol: 0 for p in plans}
    pending = list(plans)
    while pending:
        jobs = [(p.payload, p.candidates[next_try[p.symbol]][2], p.symbol, target, folder) for p in pending]
        results = _pool().map(build_module_kernel, jobs, timeout_s=300)
        again = []
        for p, r in zip(pending, results):
            source, sketch, _, knobs, latency = p.candidates[next_try[p.symbol]]
            if r.ok:
                built[p.symbol] = r.value
                p.source, p.sketch_name, p.knobs, p.latency_s = source, sketch, knobs, latency
                continue
            lines = r.error_msg.strip().splitlines()
            why = f"{source} {sketch} {dict(knobs)}: {r.error_kind.value}: {lines[-1] if lines else ''}"
            p.errors.append(why)
            log.warning("compile: task %s: schedule failed (%s)", p.task.name, why)
            next_try[p.symbol] += 1
            if next_try[p.symbol] >= len(p.candidates):
                raise AnsorError(f"task {p.task.name}: no GPU schedule builds; the last failure: {why}")
            again.append(p)
        pending = again
    for p in plans:
        k = built[p.symbol]
        if k["local_buffers"] and any(f["stack"] for f in k["ptxas"].values()):
            log.warning("compile: task %s: %d buffer(s) of its fused epilogue in local memory "
                        "(a %d-byte stack frame per thread); a tuned schedule may avoid it",
                        p.task.name, k["local_buffers"], max(f["stack"] for f in k["ptxas"].values()))
        log.info("compile: task %s (x%d): %s %s %s", p.task.name, p.task.weight, p.source, p.sketch_name, dict(p.knobs))
    return built


# --------------------------------------------------------------------------
# The host side


_VIEWS = ("tensor.expand_shape", "tensor.collapse_shape", "tensor.cast")


def _spec(t: ir.Type) -> tuple[list[int], str]:
    st = ir.ShapedType(t)
    if not st.has_static_shape:
        raise UnsupportedError(f"a value of type {t} has dynamic dimensions: a CUDA module needs static shapes")
    return [int(d) for d in st.shape], str(st.element_type)


def _constant_array(op: ir.Operation, shape: list[int], dtype: str, blobs: dict[str, str]) -> np.ndarray:
    """The value of a tensor `arith.constant` as an array of its type."""
    dt = np_dtype(dtype)
    attr = op.attributes["value"]
    text = str(attr)
    if text.startswith("dense_resource<"):
        _, data = resource_bytes(text, blobs)
        if data is None:
            raise UnsupportedError(f"{location_str(op)}: the constant's resource blob is missing")
        return np.frombuffer(data, dtype=dt).reshape(shape).copy()
    dense = ir.DenseElementsAttr(attr)
    if text.startswith('dense<"0x'):
        data = bytes.fromhex(text[len('dense<"0x'):].split('"', 1)[0])
        if len(data) == dt.itemsize:  # a splat in hex form
            return np.full(shape, np.frombuffer(data, dtype=dt)[0], dtype=dt)
        return np.frombuffer(data, dtype=dt).reshape(shape).copy()
    if dense.is_splat:
        value = dense.get_splat_value()
        scalar = ir.FloatAttr(value).value if isinstance(value, ir.FloatAttr) or "f" in dtype else ir.IntegerAttr(value).value
        return np.full(shape, scalar, dtype=dt)
    array = np.array(dense)
    if array.dtype == object:
        raise UnsupportedError(f"{location_str(op)}: a {dtype} constant that numpy cannot read")
    return np.ascontiguousarray(array.reshape(shape), dtype=dt)


class _PlanBuilder:
    """The buffers and launches of one function (:func:`host_plan`)."""

    def __init__(self, blobs: dict[str, str], weights_dir: str | None) -> None:
        self.buffers: list[dict] = []
        self.of: dict[ir.Value, int] = {}
        self.blobs = blobs
        self.weights_dir = weights_dir
        self.pending: set[ir.Value] = set()  # results of occurrences not emitted yet

    def new(self, role: str, t: ir.Type, **extra) -> int:
        shape, dtype = _spec(t)
        try:
            np_dtype(dtype)  # an element type the runtime has
        except ValueError as e:
            raise UnsupportedError(f"a {role} buffer of type {t}: {e}") from None
        buf = {"id": len(self.buffers), "role": role, "shape": shape, "dtype": dtype, **extra}
        self.buffers.append(buf)
        return buf["id"]

    def buffer(self, v: ir.Value) -> int:
        """The buffer holding value `v`, made from its producer where it is outside every task."""
        if v in self.of:
            return self.of[v]
        if v in self.pending:
            raise UnsupportedError("a task reads the result of a task that comes after it in the function")
        owner = v.owner
        if isinstance(owner, ir.Block):
            raise UnsupportedError("a block argument that is no argument of the function")
        op = owner.operation if hasattr(owner, "operation") else owner
        if not isinstance(v.type, ir.RankedTensorType):
            raise UnsupportedError(f"{location_str(op)}: {op.name} gives a {v.type}, not a tensor")
        if op.name == "arith.constant":
            shape, dtype = _spec(v.type)
            bid = len(self.buffers)
            suffix = ".npy" if dtype != "bf16" else ".bin"
            name = f"weights/{bid}{suffix}"
            if self.weights_dir is not None:  # (None: a dry run, before the kernels are built)
                array = _constant_array(op, shape, dtype, self.blobs)
                path = os.path.join(self.weights_dir, f"{bid}{suffix}")
                np.save(path, array) if suffix == ".npy" else array.tofile(path)
            self.of[v] = self.new("constant", v.type, file=name)
        elif op.name == "tensor.empty":
            self.of[v] = self.new("intermediate", v.type)
        elif op.name in _VIEWS:
            base = self.buffer(op.operands[0])
            if math.prod(_spec(op.operands[0].type)[0]) != math.prod(_spec(v.type)[0]):
                raise UnsupportedError(f"{location_str(op)}: {op.name} changes the number of elements")
            self.of[v] = self.new("view", v.type, of=base)
        else:
            raise UnsupportedError(
                f"{location_str(op)}: {op.name} computes a value outside every task, and a CUDA module "
                "runs only kernels and views (reshapes); it is not supported yet"
            )
        return self.of[v]


def host_plan(program: Program, occs: list[Occurrence], built: dict[str, dict], plans: dict[str, CudaKernelPlan],
              entry: str, weights_dir: str | None) -> dict:
    """The buffers, launches and outputs of function `entry` (see the
    module's roadmap, step 4); constants are written to `weights_dir`."""
    with program.context:
        fn = next((o.operation for o in program.module.body.operations
                   if o.operation.name == "func.func" and ir.StringAttr(o.operation.attributes["sym_name"]).value == entry),
                  None)
        if fn is None or not fn.regions[0].blocks:
            raise AnsorError(f"no function @{entry} to compile")
        block = fn.regions[0].blocks[0]
        pb = _PlanBuilder(resource_blobs(str(program.module)), weights_dir)
        for i, arg in enumerate(block.arguments):
            if not isinstance(arg.type, ir.RankedTensorType):
                raise UnsupportedError(f"@{entry}: argument {i} is a {arg.type}; a CUDA module takes tensors "
                                       "(a function on memrefs is compiled for the CPU only)")
            pb.of[arg] = pb.new("input", arg.type, index=i)
        position = {op.operation: k for k, op in enumerate(block.operations)}
        mine = sorted((o for o in occs if o.func_name == entry), key=lambda o: position[o.ops[-1]])
        for o in mine:
            pb.pending.update(o.results)
        launches: list[dict] = []
        kernel_index = {sym: i for i, sym in enumerate(built)}
        for o in mine:
            plan = plans[o.task.workload_key]
            args = [pb.buffer(v) for v in o.args]
            for v in o.results:
                pb.pending.discard(v)
                pb.of[v] = pb.new("intermediate", v.type)
            host_args = args + [pb.of[v] for v in o.results]
            for ln in built[plan.symbol]["launches"]:
                launches.append({
                    "kernel": kernel_index[plan.symbol], "entry": ln["entry"], "grid": list(ln["grid"]),
                    "block": list(ln["block"]), "dynamic_smem": ln.get("dynamic_smem", 0),
                    "args": [host_args[i] for i in ln["args"]], "task": o.task.name,
                    "task_args": host_args, "task_inputs": len(args),
                })
        ret = block.operations[len(block.operations) - 1]
        if ret.operation.name != "func.return":
            raise UnsupportedError(f"@{entry} does not end with func.return")
        outputs = [pb.buffer(v) for v in ret.operation.operands]
        return {"buffers": pb.buffers, "launches": launches, "outputs": outputs}


def _entry_of(program: Program, occs: list[Occurrence], entry: str | None) -> str:
    names = [ir.StringAttr(o.operation.attributes["sym_name"]).value for o in program.module.body.operations
             if o.operation.name == "func.func" and o.operation.regions[0].blocks]
    if entry is not None:
        if entry not in names:
            raise AnsorError(f"no function @{entry} to compile ({', '.join(names) or 'none'})")
        return entry
    with_tasks = {o.func_name for o in occs}
    return next((n for n in names if n in with_tasks), names[0] if names else "")


def _fold(program: Program) -> None:
    """Fold the constant-only Linalg ops (weight transposes...) with numpy."""
    from mlir_ansor.graph.constants import fold_constants
    from mlir_ansor.graph.fold_eval import NotEvaluable, evaluate

    blobs: dict[str, str] | None = None

    def run(fold: ir.Module, name: str) -> tuple[np.ndarray, ...]:
        nonlocal blobs
        if blobs is None:
            blobs = resource_blobs(str(program.module))
        try:
            return evaluate(fold, name, blobs)
        except NotEvaluable as e:
            raise UnsupportedError(f"constant-only ops that numpy cannot evaluate exactly ({e}): "
                                   "a CUDA module cannot fold them yet") from None

    if fold_constants(program, run):
        log.info("compile: folded the constant-only ops with numpy")


def build_bundle(source, folder: str | os.PathLike, *, db: str | os.PathLike | None = None,
                 target: Target | None = None, entry: str | None = None) -> dict:
    """Compile `source` (a path, "-", an ``ir.Module`` or a :class:`Program`)
    for the CUDA `target` into the bundle folder `folder` (made if missing;
    see `measure.cuda_module` for its layout); returns the plan."""
    target = target or Target.cuda()
    if target.kind != "cuda":
        raise AnsorError(f"build_bundle: {target.key} is not a CUDA target")
    program = load(source.module if isinstance(source, Program) else source)
    _fold(program)
    occs = occurrences_for(program, target)  # as the tuner extracts them: the same workload keys
    name = _entry_of(program, occs, entry)
    tasks: dict[str, Task] = {}
    for o in occs:
        if o.func_name == name:
            tasks.setdefault(o.task.workload_key, o.task)
    if not tasks:
        raise AnsorError(f"@{name} has no task to compile for the GPU")
    plans = plan_cuda_kernels(list(tasks.values()), db=db, target=target)
    by_key = {p.task.workload_key: p for p in plans}
    # A dry run first: an op the plan cannot express fails before any kernel is built.
    host_plan(program, occs, {p.symbol: {"launches": []} for p in plans}, by_key, name, None)
    # Written beside `folder` and renamed into place at the end: a compile
    # that fails leaves no half bundle (and an earlier bundle is replaced whole).
    folder = os.path.abspath(os.fspath(folder))
    work = f"{folder}.tmp{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    kernels_dir, weights_dir = os.path.join(work, "kernels"), os.path.join(work, "weights")
    os.makedirs(kernels_dir)
    os.makedirs(weights_dir)
    try:
        plan = _write_bundle(program, occs, plans, by_key, name, target, work)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.replace(work, folder)
    log.info("compile: wrote %s (%d kernel(s), %d launch(es), %d buffer(s))", folder, len(plans),
             len(plan["launches"]), len(plan["buffers"]))
    return plan


def _write_bundle(program: Program, occs: list[Occurrence], plans: list[CudaKernelPlan],
                  by_key: dict[str, CudaKernelPlan], name: str, target: Target, folder: str) -> dict:
    """Build the kernels into ``folder/kernels``, the weights into
    ``folder/weights``, and write ``folder/plan.json``; returns the plan."""
    kernels_dir, weights_dir = os.path.join(folder, "kernels"), os.path.join(folder, "weights")
    built = build_kernels(plans, target, kernels_dir)
    host = host_plan(program, occs, built, by_key, name, weights_dir)
    plan = {
        "format": FORMAT,
        "version": VERSION,
        "entry": name,
        "target": target.key,
        "kernels": [{k: v for k, v in built[p.symbol].items() if k != "launches"} | {"task": p.task.name}
                    for p in plans],
        **host,
        "tasks": [p.to_json() for p in plans],
    }
    with open(os.path.join(folder, PLAN_FILE), "w", encoding="utf-8") as f:
        json.dump(plan, f, indent=1)
    return plan


def bundle_ptx(folder: str | os.PathLike) -> str:
    """The PTX of every kernel of the bundle in `folder`, as one module
    (`passes.cuda_kernels.merge_ptx`)."""
    from mlir_ansor.measure.cuda_module import read_plan

    plan = read_plan(folder)
    texts = [open(os.path.join(folder, "kernels", k["ptx"]), encoding="utf-8").read() for k in plan["kernels"]]
    return merge_ptx(texts)


def compile_cuda(source, *, db: str | os.PathLike | None = None, target: Target | None = None,
                 entry: str | None = None, folder: str | os.PathLike | None = None, backend=None) -> CudaModule:
    """`compile` for a CUDA target: the bundle (in `folder`, else a temporary
    folder removed with the returned module) as a :class:`CudaModule`,
    which opens the GPU (or `backend`) on its first call."""
    owned = folder is None
    path = tempfile.mkdtemp(prefix="mlir-ansor-cuda-") if owned else os.fspath(folder)
    try:
        build_bundle(source, path, db=db, target=target, entry=entry)
    except BaseException:
        if owned:
            shutil.rmtree(path, ignore_errors=True)
        raise
    module = CudaModule(path, backend=backend)
    if owned:
        weakref.finalize(module, shutil.rmtree, path, True)
    return module
