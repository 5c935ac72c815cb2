"""Compile a whole module with the best schedules found: callable, .so, MLIR.

Roadmap: :func:`compile` is the entry point.

1. ``graph.task.partition`` splits every function into task occurrences and
   says which of the function's values feed each task's ``@kernel`` and which
   values its results stand for.
2. :func:`plan_kernels` picks one schedule per *distinct* task (identical
   tasks share one kernel): the best valid record of the records database
   for this target and thread count; else the task's default sketch with a
   heuristic assignment (parallel tiles for the threads); else, if that fails
   to build, no schedule at all (the naive lowering).
3. :func:`schedule_kernel` (in an isolated worker process: an MLIR build with
   assertions can abort on a bad schedule) applies the schedule to the task
   module, bufferizes it and renames ``@kernel`` to a unique symbol.
4. :func:`_build_driver` rewrites each user function: the ops of every
   occurrence are replaced by a ``func.call`` of its kernel, with everything
   outside tasks (weights, reshapes, allocations) left in place. The driver is
   bufferized (kernel declarations carry ``bufferization.access = "read"``,
   which is true because kernels are scheduled with read-only arguments), then
   the scheduled kernels replace their declarations. That module, on memrefs,
   is the scheduled MLIR.
5. :func:`lower_and_split` (in a worker too) lowers it to LLVM with the same
   pipeline candidates are measured with (the driver rewrites see the whole
   module) and splits it into units (`passes.split`: the drivers, one per
   kernel); :func:`emit_unit` code-generates the units in parallel workers,
   and ``cc`` links one shared library; every function gets a C entry point
   ``_mlir_ciface_<name>(inputs..., outputs...)`` (memref descriptors,
   results as trailing out-parameters).

The compile cache (`passes.compile_cache`) keeps each unit's object code,
the folded constants (evaluated with numpy where that is exact,
`graph.fold_eval`) and, for a file input, the whole result, so a second
compile of the same module with the same database copies a library.

Why one MLIR driver rather than Python glue between separate kernel
libraries: the shared library is then self-contained (a C program can call
it), the Python callable is a thin ctypes call into that same library (so the
tests of the callable test the library), intermediate buffers are allocated and
freed by MLIR's own bufferization and deallocation passes, and weights become
``memref.global`` constants inside the library instead of numpy arrays.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import math
import os
import re
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from mlir import ir, passmanager

from mlir_ansor.errors import AnsorError, UnsupportedError
from mlir_ansor.graph.constants import fold_constants
from mlir_ansor.graph.dynamic import argument_shapes
from mlir_ansor.graph.task import Occurrence, Task
from mlir_ansor.importers import load
from mlir_ansor.ir.dtypes import ELEMENT_BYTES
from mlir_ansor.ir.program import Program, resource_blobs, resource_bytes
from mlir_ansor.ir.rewrite import defining_op
from mlir_ansor.measure.pool import WorkerPool
from mlir_ansor.measure.runner import (
    ALIGNMENT,
    ONE_BYTE,
    Kernel,
    aligned_copy,
    aligned_empty,
    aligned_empty_at,
    data_pointer,
    descriptor,
    np_dtype,
)
from mlir_ansor.passes.artifacts import symbol_stub
from mlir_ansor.passes.compile_cache import CompileCache, cache_for, file_digest
from mlir_ansor.passes.drivers import copy_read_inits, linalg_inits
from mlir_ansor.passes.lowering import BUFFERIZE, lower_to_llvm
from mlir_ansor.search.tasks import occurrences_for, tasks_for
from mlir_ansor.target import Target, usable_cores

__all__ = ["CompiledModule", "DynamicModule", "KernelPlan", "ScheduledModule", "cached_compile", "compile", "compile_untuned",
           "plan_kernels", "schedule_module"]

log = logging.getLogger("mlir_ansor")

_ACCESS = "bufferization.access"
_WRITABLE = "bufferization.writable"


@dataclass
class KernelPlan:
    """How one distinct task is compiled.

    source: "tuned" (best record of the database), "transferred" (the best
    record of the same task at other sizes, `search.transfer`), "default"
    (the default sketch with a heuristic assignment) or "naive" (no schedule).
    """

    task: Task
    symbol: str
    source: str
    payload: str
    script: str | None = None
    sketch_name: str = ""
    knobs: tuple = ()
    latency_s: float = math.inf
    """Measured latency of the record (tuned only)."""
    error: str = ""
    """Why a schedule was dropped for the naive lowering, if it was."""
    trials: int = 0
    """Records of this task in the database (this target, any thread count)."""
    origin: str = ""
    """A transferred plan's source: the task (at other sizes) it was tuned for."""

    def to_json(self) -> dict:
        lat = self.latency_s if math.isfinite(self.latency_s) else None
        return {
            "name": self.task.name,
            "workload_key": self.task.workload_key,
            "flops": self.task.flops,
            "weight": self.task.weight,
            "trials": self.trials,
            "schedule": self.source,
            **({"transferred_from": self.origin} if self.origin else {}),
            "sketch": self.sketch_name,
            "knobs": dict(self.knobs),
            "best_latency_s": lat,
            "gflops": self.task.flops / lat / 1e9 if lat else 0.0,
            "baseline_latency_s": None,
            "error": self.error,
        }


@dataclass
class CompiledModule:
    """A compiled module: call it on numpy arrays, or use its library.

    ``__call__`` runs the entry function (the only function with tasks, or
    the first one; ``entry=`` picks another) and returns its results: a single
    array, or a tuple. A function on memrefs returns the memref arguments it
    writes, as new arrays (the caller's arrays are not modified).

    Not reentrant: the library keeps the intermediate results of its drivers
    in static buffers (`passes.drivers.static_driver_buffers`), so one
    compiled module must not run on two threads at once.
    """

    library_path: str
    mlir_text: str | Callable[[], str]
    """What gives :attr:`mlir`: the text, or what prints it on first use."""
    functions: dict[str, tuple[list[tuple[tuple[int, ...], str]], list[tuple[tuple[int, ...], str]], list[int]]]
    """name -> (input specs, output specs, indices of written memref inputs)."""
    entry: str
    kernels: list[KernelPlan] = field(default_factory=list)
    threads: int = 1
    weights_library: str | None = None
    """The shared library that holds the weights, where they are not in
    :attr:`library_path` itself (a `DynamicModule`'s specializations share
    one: :func:`shared_weights_library`)."""
    cache_stats: dict = field(default_factory=dict)
    """What the compile cache gave this compile (`passes.compile_cache.CompileCache.stats`:
    ``module_hit``, ``obj_hit``, ``obj_miss``, ``fold_hit``...); empty without a cache."""
    _lib: dict = field(default_factory=dict, repr=False)
    _plans: dict = field(default_factory=dict, repr=False)

    @property
    def mlir(self) -> str:
        """The scheduled module: kernels after their schedules, and the
        drivers, on memrefs (printed when first asked for: a ResNet-50's is
        200 MB)."""
        if callable(self.mlir_text):
            self.mlir_text = self.mlir_text()
        return self.mlir_text

    def function(self, name: str):
        """A callable for another function of the module."""
        if name not in self.functions:
            raise AnsorError(f"no function @{name} in the compiled module ({', '.join(self.functions)})")
        return lambda *arrays: self._plan(name).call(*arrays)

    def __call__(self, *arrays: np.ndarray):
        plan = self._plans.get(self.entry) or self._plan(self.entry)
        return plan.call(*arrays)

    def _kernel(self, name: str) -> Kernel:
        if name not in self._lib:
            self._lib[name] = Kernel(self.library_path, name)
        return self._lib[name]

    def bind(self, *arrays: np.ndarray, name: str | None = None):
        """(run, outputs): a no-argument callable that runs the function on
        copies of `arrays`, and the arrays it writes its outputs to (timing).
        The copies and outputs are cache-line aligned (`runner.ALIGNMENT`), as
        the tuner's were when it timed the kernels."""
        name = name or self.entry
        plan = self._plan(name)
        ins = plan.inputs(name, arrays, copy=True)
        outs = plan.outputs()
        return self._kernel(name).bind(ins + outs), plan.results(ins, outs)

    def _plan(self, name: str) -> CallPlan:
        plan = self._plans.get(name)
        if plan is None:
            plan = self._plans[name] = CallPlan(self._kernel(name), *self.functions[name], expected_s=expected_seconds(self.kernels),
                                                name=name)
        return plan

    def close(self) -> None:
        for k in self._lib.values():
            k.close()
        self._lib.clear()


# --------------------------------------------------------------------------
# Choosing a schedule per task.


class CallPlan:
    """One function's call, set up once: its argument types and memref
    descriptors (static shapes: only the data pointers change from call to
    call) and a ctypes prototype of its own. A call of an aligned,
    C-contiguous argument of the right type passes it as it is, and costs
    about 0.2 us per argument the last call passed too (weights), 0.6 us
    per other one and 1 us per output beyond the kernels: 2.9 us for a
    one-kernel module of two arguments and one output called on the same
    arrays, 4.7 on others (`benchmarks/call_overhead.py`, Emerald Rapids).
    It was 9.7 us, and about 20 with descriptors made per call. A function
    with dynamic dimensions gets one per argument shapes
    (`dispatch.DynamicLibrary`).

    An argument that starts off a cache line (numpy's own buffers are
    16-byte aligned) is copied to one that starts on one where the copy is
    cheap beside the call (`copy_pays`, from `expected_s`, what the call's
    kernels take), and passed as it is where it is not: the 1024 x 1024
    weights of a 7-row GEMM took 0.305 ms to copy, and the kernel 0.086 ms
    (0.104 on the misaligned weights)."""

    def __init__(self, kernel: Kernel, ins_spec, outs_spec, written, expected_s: float | None = None,
                 name: str = "") -> None:
        self.kernel = kernel  # keeps the library loaded
        self.name = name  # the function's, for errors
        self.ins = [(tuple(shape), np_dtype(dtype)) for shape, dtype in ins_spec]
        self.outs = [(tuple(shape), np_dtype(dtype)) for shape, dtype in outs_spec]
        self.out_bytes = [math.prod(shape) * dt.itemsize for shape, dt in self.outs]
        self.written = list(written)
        self.copied = set(self.written)
        # The alignment below which an argument is copied: a cache line, or
        # its element's where the copy would cost more than it saves.
        self.align = [
            ALIGNMENT if copy_pays(math.prod(shape) * dt.itemsize, expected_s) else dt.itemsize
            for shape, dt in self.ins
        ]
        self.descs = [descriptor(aligned_empty(shape, dtype)) for shape, dtype in self.ins + self.outs]
        self.out_descs = self.descs[len(self.ins):]
        self.raw = [ctypes.addressof(d) for d in self.descs]
        # A prototype of its own: the library's function object is shared
        # with `Kernel.bind`, which sets its argtypes; setting them per call
        # cost as much as a small kernel.
        proto = ctypes.CFUNCTYPE(None, *([ctypes.c_void_p] * len(self.descs)))
        self.fn = proto(ctypes.cast(kernel.fn, ctypes.c_void_p).value)
        self.call = self._fast_call()

    def _argument(self, name: str, i: int, a, copy: bool) -> tuple[np.ndarray, int]:
        """Argument `i` as the kernel reads it, and its data pointer: `a`
        itself, or an aligned copy (`copy`; a written argument, another
        type, not C-contiguous or not aligned)."""
        shape, dtype = self.ins[i]
        if type(a) is not np.ndarray:
            a = np.asarray(a)
        if a.shape != shape:
            raise AnsorError(f"@{name}: argument {i} has shape {a.shape}, expected {shape}")
        if not (copy or i in self.copied) and a.dtype == dtype and a.flags.c_contiguous:
            ptr = data_pointer(a)
            if ptr % self.align[i] == 0:
                return a, ptr
        a = aligned_copy(a, dtype)
        return a, data_pointer(a)

    def inputs(self, name: str, arrays, copy: bool) -> list[np.ndarray]:
        """`arrays` checked against the signature, as the kernel reads them
        (:meth:`_argument`)."""
        self._count(name, arrays)
        return [self._argument(name, i, a, copy)[0] for i, a in enumerate(arrays)]

    def _count(self, name: str, arrays) -> None:
        if len(arrays) != len(self.ins):
            raise AnsorError(f"@{name} takes {len(self.ins)} argument(s), got {len(arrays)}")

    def outputs(self) -> list[np.ndarray]:
        return [aligned_empty_at(shape, dt, n)[0] for (shape, dt), n in zip(self.outs, self.out_bytes)]

    def results(self, bufs: list[np.ndarray], outs: list[np.ndarray]) -> list[np.ndarray]:
        """What a call returns: its outputs, or the memref arguments it wrote."""
        return outs if self.outs else [bufs[i] for i in self.written]

    def _fast_call(self):
        """The call, ``call(*arrays)``, as straight-line Python made for this
        signature (one block per argument and output, the count of arguments
        checked by unpacking them): it returns what the function does, one
        array, a tuple of them, or None. About 1 us less than the same steps
        in loops, and 0.6 us less than behind the dispatch through the plan
        and a list of results it replaced (`benchmarks/call_overhead.py`).
        An argument that is not passed as it is goes through :meth:`_argument`."""
        name = self.name
        env = {"np": np, "ndarray": np.ndarray, "uint8": np.uint8, "addressof": ctypes.addressof,
               "BYTE": ONE_BYTE, "A": ALIGNMENT, "argument": self._argument, "fn": self.fn,
               "count": self._count, "NAME": name, "ref": weakref.ref}
        params = [f"a{i}" for i in range(len(self.ins))]
        cached = [f"W{i}, P{i}" for i in range(len(self.ins)) if i not in self.copied]
        lines = ["def call(*args):"] + ([f"    global {', '.join(cached)}"] if cached else []) + ["    try:"]
        lines.append(f"        {', '.join(params)}{',' if len(params) == 1 else ''} = args" if params else "        () = args")
        lines += ["    except ValueError:", "        count(NAME, args)"]
        for i, ((shape, dtype), d) in enumerate(zip(self.ins, self.descs)):
            env.update({f"S{i}": shape, f"D{i}": dtype, f"d{i}": d, f"A{i}": self.align[i]})
            test = f"type(a{i}) is ndarray and a{i}.shape == S{i} and a{i}.dtype == D{i} and a{i}.flags.c_contiguous"
            if i in self.copied:
                lines.append(f"    a{i}, p{i} = argument(NAME, {i}, a{i}, False)")
            else:
                # The array of the last call again (weights, mostly): its data
                # pointer is known (0.4 us less); its shape, type and layout
                # are checked again, since they can be set in place.
                env.update({f"W{i}": _DEAD, f"P{i}": 0})
                lines += [
                    f"    if W{i}() is a{i} and a{i}.shape == S{i} and a{i}.dtype == D{i} and a{i}.flags.c_contiguous:",
                    f"        p{i} = P{i}",
                    "    else:",
                    f"        b{i} = a{i}",
                    "        try:",  # p = 0: not an array to pass as it is
                    f"            p{i} = addressof(BYTE.from_buffer(a{i})) if {test} else 0",
                    "        except (TypeError, ValueError, BufferError):",
                    f"            p{i} = 0",
                    f"        if not p{i} or p{i} % A{i}:",
                    f"            a{i}, p{i} = argument(NAME, {i}, a{i}, False)",
                    # kept where passed as it is (read-only ones too), not a copy
                    f"        if a{i} is b{i} and type(a{i}) is ndarray:",
                    f"            W{i}, P{i} = ref(a{i}), p{i}",
                ]
            lines.append(f"    d{i}.allocated = d{i}.aligned = p{i}")
        outs = []
        for j, ((shape, dtype), n, d) in enumerate(zip(self.outs, self.out_bytes, self.out_descs)):
            env.update({f"SO{j}": shape, f"DO{j}": dtype, f"NO{j}": n + ALIGNMENT, f"e{j}": d})
            lines += [
                f"    r = np.empty(NO{j}, uint8)",
                "    q = addressof(BYTE.from_buffer(r))",
                "    s = -q % A",
                f"    o{j} = ndarray(SO{j}, DO{j}, r, s)",
                f"    e{j}.allocated = e{j}.aligned = q + s",
            ]
            outs.append(f"o{j}")
        env.update({f"R{i}": r for i, r in enumerate(self.raw)})
        lines.append(f"    fn({', '.join(f'R{i}' for i in range(len(self.raw)))})")
        results = outs if self.outs else [f"a{i}" for i in self.written]
        lines.append(f"    return {results[0]}" if len(results) == 1 else f"    return ({', '.join(results)},)" if results else "    return None")
        exec("\n".join(lines), env)  # noqa: S102 - our own text, from the signature
        return env["call"]


class _Gone:
    pass


_DEAD = weakref.ref(_Gone())
"""A reference to nothing: no argument is the last call's before the first call."""

COPY_BYTES_PER_S = 12e9
"""What copying an argument to an aligned buffer moves per second, one
thread (4 MiB in 0.305 ms on an Emerald Rapids core)."""

COPY_CALL_S = 3e-6
"""What a copy costs besides its bytes (allocating, aligning, numpy's call:
`aligned_copy` of 16 KiB took 3.2 us)."""

MISALIGNED_SHARE = 0.2
"""What a kernel may lose on arguments off cache lines, as a share of its
time: Ansor's DIL ran 20% and 36% slower 16 and 32 bytes past one (its
vector loads straddle lines); a 7-row GEMM 21%, a 100-row one 7%."""

FALLBACK_FLOPS_PER_S = 50e9
"""The rate a kernel with no measured latency is taken to run at (`expected_seconds`)."""


def copy_pays(nbytes: int, expected_s: float | None) -> bool:
    """Whether copying a misaligned argument of `nbytes` to an aligned
    buffer costs less than what misalignment may cost a call that takes
    `expected_s` (None: unknown, copied)."""
    return expected_s is None or COPY_CALL_S + nbytes / COPY_BYTES_PER_S <= MISALIGNED_SHARE * expected_s


def expected_seconds(kernels: Sequence[KernelPlan]) -> float:
    """What `kernels` take together, as measured (tuned records), or at
    `FALLBACK_FLOPS_PER_S` where nothing was."""
    total = 0.0
    for k in kernels:
        lat = k.latency_s if math.isfinite(k.latency_s) else k.task.flops / FALLBACK_FLOPS_PER_S
        total += lat * k.task.weight
    return total


def _symbol(task: Task) -> str:
    return "ansor_" + "".join(c if c.isalnum() or c == "_" else "_" for c in task.name)


def _transferred_plan(database, task: Task, sym: str, sketches, target: Target, threads: int) -> KernelPlan | None:
    """The plan of a task without records of its own that has a tuned
    relative at other sizes (`search.transfer`): its best schedule, made
    valid for this task's extents; None when there is none."""
    from mlir_ansor.search.transfer import transferred

    for t in transferred(database, task, sketches, target, threads=threads, prefer_host=target.model, relatives=1, per_relative=4):
        try:
            script = t.sketch.concrete(t.knobs)
        except ir.MLIRError:
            continue
        return KernelPlan(task, sym, "transferred", t.sketch.payload, script, t.sketch.name, t.knobs, origin=t.source)
    return None


def _earlier_sketch_plan(records, task: Task, sym: str, sketches) -> KernelPlan | None:
    """The best of `task`'s `records` (best first, as `plan_kernels` read
    them) whose sketch the rules no longer make as it was (a newer
    mlir-ansor changed the sketch's script or payload:
    `search.sketch.fuse_epilogue` changed every task with ops after its
    anchor), applied to a sketch that has the record's knobs
    (`search.transfer.earlier_forms`: exactly, or but a structural choice
    the sketch no longer offers, such as the copy of a B in column panels,
    or with one it offers now at the value the earlier form behaved as,
    such as B read in place at partial rows), if its values are valid
    there; None when no record fits."""
    from mlir_ansor.search.transfer import earlier_forms, with_added

    for rec in records:
        for sk in earlier_forms(sketches, rec.knobs):
            mine = {spec.name for spec in sk.knobs}
            knobs = with_added(sk, tuple((k, v) for k, v in rec.knobs if k in mine))
            if sk.knob_problem(knobs) is None and sk.violation(knobs) is None:
                dropped = ", ".join(f"{k} = {v}" for k, v in rec.knobs if k not in mine)
                log.info("compile: task %s: record %s was tuned on an earlier form of sketch %s; its knobs apply%s",
                         task.name, rec.row_id, sk.name, f" but {dropped}, which it no longer offers" if dropped else "")
                return KernelPlan(task, sym, "tuned", sk.payload, sk.concrete(knobs), sk.name, knobs,
                                  rec.latency_s, origin="an earlier form of its sketch")
    return None


def plan_kernels(
    tasks: list[Task], *, db: str | os.PathLike | None, target: Target, threads: int, default: str = "sketch"
) -> list[KernelPlan]:
    """One :class:`KernelPlan` per task: the best valid record of `db` whose
    sketch the current sketch rules still make, else the default."""
    from mlir_ansor.records import Database
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.sketch import default_assignment

    database = None
    if db is not None:
        if os.path.exists(db) and os.path.getsize(db) > 0:
            database = Database(db, readonly=True)  # only read: a database that cannot be written will do
        else:
            log.warning("compile: no records database at %s; every task gets the default schedule", db)
    plans: list[KernelPlan] = []
    try:
        for task in tasks:
            sym = _symbol(task)
            try:
                sketches = generate_sketches(task.mlir, target)
            except AnsorError as e:
                log.warning("compile: task %s: no sketch (%s); naive lowering", task.name, e)
                plans.append(KernelPlan(task, sym, "naive", task.mlir))
                continue
            plan = None
            trials = 0
            if database is not None:
                trials = database.count(task.workload_key, target.key)
                by_hash = {sk.hash: sk for sk in sketches}
                # Records measured on this kind of machine first; else those of
                # the host with the most records (a schedule tuned elsewhere).
                records = database.best(task.workload_key, target.key, threads=threads, k=16, prefer_host=target.model)
                for rec in records:
                    sk = by_hash.get(rec.sketch_hash)
                    if sk is None:
                        continue
                    problem = sk.knob_problem(rec.knobs)
                    if problem is not None:
                        log.warning("compile: %s: record %s is invalid and is skipped: %s", db, rec.row_id, problem)
                        continue
                    plan = KernelPlan(
                        task, sym, "tuned", sk.payload, sk.concrete(rec.knobs), sk.name, tuple(rec.knobs), rec.latency_s
                    )
                    break
                if plan is None and trials:
                    plan = _earlier_sketch_plan(records, task, sym, sketches)
                if plan is None and trials:
                    log.warning(
                        "compile: task %s: no valid record for %d thread(s) whose sketch is still generated",
                        task.name,
                        threads,
                    )
                if plan is None and default == "sketch":
                    plan = _transferred_plan(database, task, sym, sketches, target, threads)
            if plan is None and default == "sketch":
                # The first rule-made sketch with a preferred point; else the
                # default schedule (parallel tiles only).
                sk = next((s for s in sketches if s.prefer), sketches[-1])
                knobs = default_assignment(sk, threads)
                try:
                    plan = KernelPlan(task, sym, "default", sk.payload, sk.concrete(knobs), sk.name, knobs)
                except ir.MLIRError as e:  # a rule wrote a script that does not parse for these types
                    log.warning("compile: task %s: sketch %s does not parse (%s); naive lowering",
                                task.name, sk.name, str(e).splitlines()[-1].strip())
            if plan is None:
                plan = KernelPlan(task, sym, "naive", task.mlir)
            plan.trials = trials
            log.info(
                "compile: task %s (x%d): %s%s%s",
                task.name,
                task.weight,
                plan.source,
                f" from {plan.origin}" if plan.origin else "",
                f" {plan.sketch_name} {dict(plan.knobs)}" if plan.knobs else "",
            )
            plans.append(plan)
    finally:
        if database is not None:
            database.close()
    return plans


# --------------------------------------------------------------------------
# Worker jobs (module-level: they run in isolated processes).


def _kernel_func(module: ir.Module) -> ir.Operation:
    for op in module.body.operations:
        if op.operation.name == "func.func" and ir.StringAttr(op.operation.attributes["sym_name"]).value == "kernel":
            return op.operation
    raise AnsorError("the task module has no @kernel")


_TENSOR_CHAIN = {"tensor.insert_slice": 1, "tensor.cast": 0, "tensor.expand_shape": 0, "tensor.collapse_shape": 0}
"""Ops whose tensor result is written over their operand of this index."""


def _result_inits(fn: ir.Operation) -> list[int | None]:
    """For each result of a task's ``@kernel`` on tensors: the argument whose
    values it starts from (the init of the Linalg op that makes it, through
    slices, casts and reshapes: a bias broadcast, a residual), or None (an
    empty tensor, a fill): what `passes.drivers.copy_read_inits` copies."""
    args = list(fn.regions[0].blocks[0].arguments)
    ret = list(fn.regions[0].blocks[0].operations)[-1]
    found: list[int | None] = []
    for v in ret.operands:
        while (op := defining_op(v)) is not None:
            if op.name in _TENSOR_CHAIN:
                v = op.operands[_TENSOR_CHAIN[op.name]]
            elif op.name.startswith("linalg.") and "operandSegmentSizes" in op.attributes:
                v = linalg_inits(op)[list(op.results).index(v)]
            else:
                break
        found.append(args.index(v) if op is None and v in args else None)
    return found


def schedule_kernel(payload: str, script: str | None, symbol: str, threads: int, check: bool) -> str:
    """Apply `script` (None: no schedule) to a task module with read-only
    arguments, bufferize it, rename ``@kernel`` to `symbol` (and its private
    symbols after it); returns the module's text. With `check`, the result is
    also lowered to LLVM once, so a schedule that does not lower fails here."""
    from mlir_ansor.schedule.apply import apply_schedule

    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(payload)
        fn = _kernel_func(module)
        n_args = len(ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value).inputs)
        fn.attributes["arg_attrs"] = ir.ArrayAttr.get(
            [ir.DictAttr.get({_WRITABLE: ir.BoolAttr.get(False)}) for _ in range(n_args)]
        )
        inits = _result_inits(fn)
        module = apply_schedule(str(module), script)
        passmanager.PassManager.parse(f"builtin.module({BUFFERIZE},canonicalize,cse)").run(module.operation)
        copy_read_inits(_kernel_func(module), inits)
        for op in list(module.body.operations):
            if "sym_name" not in op.operation.attributes:
                continue
            name = ir.StringAttr(op.operation.attributes["sym_name"]).value
            new = symbol if name == "kernel" else f"{symbol}__{name}"
            ir.SymbolTable.replace_all_symbol_uses(name, new, module.operation)
            ir.SymbolTable.set_symbol_name(op.operation, new)
        text = str(module)
        if check:
            probe = ir.Module.parse(text)
            lower_to_llvm(probe, threads)
        return text


_EXTERNAL_MIN_BYTES = 1 << 16
"""Constant globals from this size on are kept out of LLVM (:func:`_externalize_weights`)."""
_EXTERNAL_TYPES = ("f32", "f64", "bf16", "f16", "i64", "i32", "i16", "i8")
"""Element types whose large constant globals are kept out of LLVM."""

_ASM_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.$]*")


def _dense_bytes(dense: ir.DenseElementsAttr) -> bytes | None:
    """The raw little-endian elements of a non-splat dense attribute:
    through numpy's buffer where numpy has the type, else from the hex form
    MLIR prints large attributes in (bf16, which numpy lacks); None when
    neither gives them."""
    try:
        array = np.array(dense)
    except TypeError:  # bf16: "Unsupported floating-point type"
        array = None
    if array is not None and array.dtype != object:
        return np.ascontiguousarray(array).tobytes()
    text = str(dense)
    if text.startswith('dense<"0x'):
        return bytes.fromhex(text[len('dense<"0x') :].split('"', 1)[0])
    return None


def _global_data(op: ir.Operation, blobs) -> bytes | None:
    """The raw bytes of a large constant ``memref.global`` (`op`) that
    LLVM should not see (:func:`_externalize_weights`), or None: a small,
    splat or non-constant global, a type kept in LLVM, a symbol the
    assembler cannot name. `blobs`: a callable giving the module's
    ``dense_resource`` blobs (`ir.program.resource_blobs`), or None to leave
    such globals alone."""
    if op.name != "memref.global" or "constant" not in op.attributes or "initial_value" not in op.attributes:
        return None
    mtype = ir.MemRefType(ir.TypeAttr(op.attributes["type"]).value)
    width = ELEMENT_BYTES.get(str(mtype.element_type)) if str(mtype.element_type) in _EXTERNAL_TYPES else None
    if width is None or math.prod(mtype.shape) * width < _EXTERNAL_MIN_BYTES:
        return None
    if not _ASM_NAME.fullmatch(ir.StringAttr(op.attributes["sym_name"]).value):
        return None
    attr = op.attributes["initial_value"]
    data: bytes | None = None
    if isinstance(attr, ir.DenseElementsAttr):  # op.attributes gives the concrete class
        data = None if attr.is_splat else _dense_bytes(attr)
    elif blobs is not None:
        text = str(attr)
        if text.startswith("dense_resource<"):
            _, data = resource_bytes(text, blobs())
    if data is None or len(data) != math.prod(mtype.shape) * width:
        return None
    return data


def _move_out_weights(module: ir.Module, workdir: str, blobs=None) -> list[tuple]:
    """Write the data of every large constant global of `module` to a file
    in `workdir` and make the global an external declaration. Returns
    (symbol, file, bytes, its visibility or None) of each
    (:func:`_text_with_weights` puts them back in a printed module).
    `blobs`: as :func:`_global_data`'s."""
    moved = []
    for opview in module.body.operations:
        op = opview.operation
        data = _global_data(op, blobs)
        if data is None:
            continue
        path = os.path.join(workdir, f"w{len(moved)}.bin")
        with open(path, "wb") as f:
            f.write(data)
        visibility = ir.StringAttr(op.attributes["sym_visibility"]).value if "sym_visibility" in op.attributes else None
        moved.append((ir.StringAttr(op.attributes["sym_name"]).value, path, len(data), visibility))
        del op.attributes["initial_value"]
        if "sym_visibility" in op.attributes:
            del op.attributes["sym_visibility"]
    return moved


def _text_with_weights(text: str, weights: list[tuple[str, str, str | None]]) -> str:
    """`text`, a module whose large constant globals :func:`_move_out_weights`
    made external, with each one's data (symbol, file, visibility or None)
    put back as a dense initializer."""
    files = {sym: (path, visibility) for sym, path, visibility in weights}
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        for opview in module.body.operations:
            op = opview.operation
            if op.name != "memref.global" or ir.StringAttr(op.attributes["sym_name"]).value not in files:
                continue
            path, visibility = files[ir.StringAttr(op.attributes["sym_name"]).value]
            mtype = ir.MemRefType(ir.TypeAttr(op.attributes["type"]).value)
            raw = np.fromfile(path, dtype=f"<u{ELEMENT_BYTES[str(mtype.element_type)]}")
            op.attributes["initial_value"] = ir.DenseElementsAttr.get(raw, type=mtype.element_type, shape=mtype.shape)
            if visibility is not None:
                op.attributes["sym_visibility"] = ir.StringAttr.get(visibility)
        return str(module)


def _externalize_weights(module: ir.Module, blobs: dict[str, str], workdir: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Move the data of large constant ``memref.global``s out of the module.

    Why: LLVM is slow with large constant initializers (ResNet-50's 100 MB of
    weights took most of a 3-minute build; the same module with splat weights
    builds in a tenth of the time). Each such global becomes an external
    declaration; its bytes go to a file that an assembler ``.incbin``
    directive places in ``.rodata`` (:func:`_weights_objects`, whose
    results this returns). `blobs`: the module's ``dense_resource`` data
    (`ir.program.resource_blobs` of its text).
    """
    return _weights_objects([m[:3] for m in _move_out_weights(module, workdir, lambda: blobs)], workdir)


def _weights_source(entries, path: str, exported: bool = False) -> str:
    """Write the assembly source that defines the globals `entries`
    ((symbol, file, bytes) each) at `path`: hidden in the library it is
    linked into, or `exported` to the libraries that load it."""
    lines = []
    for sym, file, size in entries:
        lines += [
            ".section .rodata",
            f".globl {sym}",
            *([] if exported else [f".hidden {sym}"]),
            f".type {sym}, @object",
            ".p2align 6",
            f"{sym}:",
            f'.incbin "{file}"',
            f".size {sym}, {size}",
        ]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _weights_objects(entries, workdir: str, name: str = "weights") -> tuple[tuple[str, ...], tuple[str, ...]]:
    """For globals made external with their data in files ((symbol, file,
    bytes) each): (shared libraries that resolve the symbols while the
    ExecutionEngine generates code, the assembly source that defines them,
    hidden, in the library: :func:`lower_and_link` assembles it while the
    units are code-generated); empty without entries."""
    if not entries:
        return (), ()
    src = _weights_source(entries, os.path.join(workdir, f"{name}.s"))
    # While the ExecutionEngine generates code, the weights only need an
    # address: a stub of the names, not a second copy of the data.
    try:
        stub = symbol_stub([sym for sym, _, _ in entries], os.path.join(workdir, f"{name}-jit.so"))
    except RuntimeError as e:
        raise AnsorError(str(e)) from None
    return (stub,), (src,)


_SHARED_WEIGHTS: dict[str, str] = {}
"""Weights libraries this process built or found, by content: key -> path."""

_SHARED_DIR: list[str] = []
"""The folder of this process's weights libraries, where there is no compile cache."""


def shared_weights_library(entries, cache: CompileCache | None) -> str:
    """A shared library that defines the globals `entries` ((symbol, file,
    bytes) each), exported, named by their names and bytes: the
    specializations of a `DynamicModule` link against it instead of holding
    the weights each (a BERT layer's 28 MB a size), so the loader maps them
    once. It goes to the compile cache's ``weights`` folder (a library
    cached there names it, so a later process loads the same file), else to
    a folder of this process."""
    digest = CompileCache.key("weights", *(f"{sym}:{size}:{file_digest(path)}" for sym, path, size in entries))
    known = _SHARED_WEIGHTS.get(digest)
    if known is not None and os.path.exists(known):
        return known
    if cache is not None:
        folder = str(cache.root / "weights")
    else:
        if not _SHARED_DIR:
            _SHARED_DIR.append(tempfile.mkdtemp(prefix="mlir-ansor-weights-"))
            atexit.register(shutil.rmtree, _SHARED_DIR[0], True)
        folder = _SHARED_DIR[0]
    path = os.path.join(folder, f"{digest}.so")
    if not os.path.exists(path):
        import subprocess

        os.makedirs(folder, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".weights-", dir=folder)
        try:
            src = _weights_source(entries, os.path.join(tmp, "weights.s"), exported=True)
            # Its soname is the path that the libraries linked against it name (DT_NEEDED).
            proc = subprocess.run(["cc", "-shared", "-o", os.path.join(tmp, "weights.so"), src, f"-Wl,-soname,{path}"],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise AnsorError(f"linking the weights' library failed: {proc.stderr.strip()[-1000:]}")
            os.replace(os.path.join(tmp, "weights.so"), path)  # whole or not at all, for concurrent compiles
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    _SHARED_WEIGHTS[digest] = path
    return path


def lower_and_split(mlir_path: str, threads: int, workdir: str, drivers: list[str], outline: bool = False) -> dict:
    """Lower the scheduled whole module (the file at `mlir_path`: a file,
    not an argument, since ResNet-50's 200 MB took a second longer through
    the worker's pipe) to LLVM (large constants go in as
    raw data, see :func:`_externalize_weights`; their files go to
    `workdir`) and split it into units that compile apart
    (`passes.split.split_units`: the drivers, and one per kernel), or one
    unit of the whole module where it does not split. Returns the units
    (name, text, symbols defined, symbols needed) and the weights' jit
    libraries and objects (:func:`_externalize_weights`)."""
    from mlir_ansor.passes.split import split_units

    with open(mlir_path, encoding="utf-8") as f:
        mlir_text = f.read()
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(mlir_text)
        blobs = resource_blobs(mlir_text)  # read once: the weights' data and the units' resources
        jit_libs, link_inputs = _externalize_weights(module, blobs, workdir)
        if outline:
            from mlir_ansor.passes.outline import outline_runs

            outline_runs(module)
        lower_to_llvm(module, threads)
        units = split_units(module, set(drivers), blobs)
        if units is None:
            units_out = [("module", str(module), (), ())]
        else:
            units_out = [(u.name, u.text, u.defines, u.needs) for u in units]
    return {"units": units_out, "jit_libs": jit_libs, "link_inputs": link_inputs, "split": units is not None}


def emit_unit(text: str, obj_path: str, opt_level: int, jit_libs: tuple[str, ...]) -> bytes:
    """Code-generate one unit (an LLVM-dialect module's text) to an object;
    returns its bytes (a worker job)."""
    from mlir_ansor.passes.artifacts import emit_object

    with ir.Context(), ir.Location.unknown():
        emit_object(ir.Module.parse(text), obj_path, opt_level=opt_level, jit_libs=jit_libs)
    with open(obj_path, "rb") as f:
        return f.read()


def lower_and_link(module_text: str, signatures: dict, threads: int, so_path: str, opt_level: int,
                    cache: CompileCache | None, outline: bool = False, weights: tuple = (),
                    weights_library: str | None = None) -> None:
    """Lower `module_text` in a worker, code-generate its units in parallel
    workers (the cached ones come from `cache`) and link them at `so_path`.
    `weights`: (symbol, file, bytes) of the globals `module_text` declares
    without their data (:func:`schedule_module`'s ``_weights_dir``); they
    are assembled while the worker lowers, or, with `weights_library` (one
    that defines them: :func:`shared_weights_library`), linked against."""
    import subprocess

    from mlir_ansor.passes.amx import AMX_ATTR, request_amx_object
    from mlir_ansor.passes.artifacts import link_shared_library

    pool = _pool()
    workdir = tempfile.mkdtemp(prefix="units-", dir=os.path.dirname(so_path) or None)
    assembling: list[tuple[str, str, subprocess.Popen]] = []

    def assemble(sources) -> None:
        for src in sources:
            obj = os.path.splitext(src)[0] + ".o"
            proc = subprocess.Popen(["cc", "-c", "-o", obj, src], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            assembling.append((src, obj, proc))

    try:
        start = time.perf_counter()
        jit_given, sources = _weights_objects(weights, workdir, "weights-given")
        if weights_library is None:
            assemble(sources)
        mlir_path = os.path.join(workdir, "scheduled.mlir")
        with open(mlir_path, "w", encoding="utf-8") as f:
            f.write(module_text)
        res = pool.run(lower_and_split, (mlir_path, threads, workdir, list(signatures), outline), timeout_s=1800)
        if not res.ok:
            raise AnsorError(f"lowering the whole module failed ({res.error_kind.value}): {res.error_msg.strip()[-2000:]}")
        lowered = res.value
        lower_s = time.perf_counter() - start
        units = lowered["units"]
        objs = [os.path.join(workdir, f"u{i}.o") for i in range(len(units))]
        keys = [cache.key("obj", text, opt_level) if cache else "" for _, text, _, _ in units]
        missing = []
        for i, key in enumerate(keys):
            data = cache.get("obj", key, ".o") if cache else None
            if data is None:
                missing.append(i)
            else:
                with open(objs[i], "wb") as f:
                    f.write(data)
        # The weights' assembly (100 MB of .incbin for ResNet-50) while the units compile.
        assemble(lowered["link_inputs"])
        start = time.perf_counter()
        if missing:
            needs = sorted({n for i in missing for n in units[i][3]})
            jit = jit_given + tuple(lowered["jit_libs"])
            if needs:
                jit += (symbol_stub(needs, os.path.join(workdir, "stub.so")),)
            results = pool.map(emit_unit, [(units[i][1], objs[i], opt_level, jit) for i in missing], timeout_s=1800)
            for i, r in zip(missing, results):
                if not r.ok:
                    raise AnsorError(f"code generation of {units[i][0]} failed ({r.error_kind.value}): "
                                     f"{r.error_msg.strip()[-2000:]}")
                if cache:
                    cache.put("obj", keys[i], ".o", r.value)
        gen_s = time.perf_counter() - start
        start = time.perf_counter()
        for src, _, proc in assembling:
            _, err = proc.communicate()
            if proc.returncode != 0:
                raise AnsorError(f"assembling {os.path.basename(src)} failed: {err.decode(errors='replace').strip()[-1000:]}")
        if AMX_ATTR in module_text:  # AMX kernels: the library asks for the tile state as it loads
            amx = request_amx_object(workdir)
            objs = objs + ([amx] if amx else [])
        try:
            link_shared_library(objs + [o for _, o, _ in assembling] + ([weights_library] if weights_library else []),
                                so_path)
        except RuntimeError as e:
            raise AnsorError(str(e)) from None
        log.info("compile: lowered in %.1f s; %d unit(s)%s, %d from the cache, %d code-generated in %.1f s; "
                 "linked in %.1f s", lower_s, len(units), "" if lowered["split"] else " (the whole module: it does not split)",
                 len(units) - len(missing), len(missing), gen_s, time.perf_counter() - start)
    finally:
        for _, _, proc in assembling:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(workdir, ignore_errors=True)


# --------------------------------------------------------------------------
# The driver.


def _memref_type(t: ir.Type) -> ir.Type:
    st = ir.ShapedType(t)
    return ir.MemRefType.get(list(st.shape), st.element_type)


def _func_ops(module: ir.Module) -> list[ir.Operation]:
    return [o.operation for o in module.body.operations if o.operation.name == "func.func"]


def _name(op: ir.Operation) -> str:
    return ir.StringAttr(op.attributes["sym_name"]).value


def _build_driver(program: Program, occs: list[Occurrence], plans: dict[str, KernelPlan]) -> None:
    """Rewrite `program.module` in place: every occurrence becomes a call of
    its kernel's declaration (tensor form, or ``<symbol>__m`` in memref form)."""
    from mlir.dialects import func as func_d
    from mlir.dialects import memref as memref_d

    module = program.module
    declared: dict[str, ir.Operation] = {}
    with program.context, ir.Location.unknown():
        first = module.body.operations[0] if len(module.body.operations) else None

        def declare(sym: str, arg_types: list[ir.Type], res_types: list[ir.Type], read_only: bool) -> None:
            if sym in declared:
                return
            ip = ir.InsertionPoint(first) if first is not None else ir.InsertionPoint(module.body)
            with ip:
                f = func_d.FuncOp(sym, (arg_types, res_types), visibility="private")
            if read_only:
                f.operation.attributes["arg_attrs"] = ir.ArrayAttr.get(
                    [ir.DictAttr.get({_ACCESS: ir.StringAttr.get("read")}) for _ in arg_types]
                )
            declared[sym] = f.operation

        # Calls first, erasures last: a later occurrence's arguments may be
        # results of an earlier one (replaced by the call's results).
        remap: dict[ir.Value, ir.Value] = {}
        for occ in occs:
            plan = plans[occ.task.workload_key]
            last = occ.ops[-1]
            args = [remap.get(v, v) for v in occ.args]
            with ir.InsertionPoint(last), last.location:
                if not occ.on_memref:
                    arg_types = [v.type for v in args]
                    res_types = [v.type for v in occ.results]
                    declare(plan.symbol, arg_types, res_types, True)
                    call = func_d.CallOp(res_types, ir.FlatSymbolRefAttr.get(plan.symbol), args)
                    for v, r in zip(occ.results, call.results):
                        v.replace_all_uses_with(r)
                        remap[v] = r
                else:
                    sym = plan.symbol + "__m"
                    arg_types = [_memref_type(v.type) for v in args]
                    res_types = [_memref_type(v.type) for v in occ.results]
                    declare(sym, arg_types, res_types, False)
                    call = func_d.CallOp(res_types, ir.FlatSymbolRefAttr.get(sym), args)
                    for v, r in zip(occ.results, call.results):
                        memref_d.CopyOp(r, v)
        for occ in reversed(occs):
            for op in reversed(occ.ops):
                op.erase()
    passmanager.PassManager.parse("builtin.module(canonicalize,cse)", program.context).run(module.operation)


def _evaluate_fold(fold: ir.Module, entry: str, cache: CompileCache | None = None) -> tuple[np.ndarray, ...]:
    """Run `entry` of the constants-only module `fold` (graph.constants) once
    and return its results: with numpy where it computes them exactly as
    LLVM would (`graph.fold_eval`), else through the untuned lowering in a
    worker; with a `cache`, the results of the same fold function come from
    there."""
    from mlir_ansor.graph.fold_eval import NotEvaluable, evaluate

    signatures = _signatures(fold)
    text = str(fold)
    specs = [(shape, np_dtype(dtype)) for shape, dtype in signatures[entry][1]]
    key = cache.key("fold", text) if cache else ""
    data = cache.get("fold", key, ".bin") if cache else None
    if data is not None:
        sizes = [math.prod(shape) * dt.itemsize for shape, dt in specs]
        if sum(sizes) == len(data):
            values, at = [], 0
            for (shape, dt), size in zip(specs, sizes):
                values.append(np.frombuffer(data, dtype=dt, count=math.prod(shape), offset=at).reshape(shape).copy())
                at += size
            log.info("compile: the folded constants come from the compile cache")
            return tuple(values)
    try:
        values = evaluate(fold, entry, resource_blobs(text))
    except NotEvaluable as e:
        log.info("compile: the constant-only ops are built through LLVM (numpy does not evaluate them exactly: %s)", e)
    else:
        values = tuple(np.ascontiguousarray(v, dtype=dt) for v, (_, dt) in zip(values, specs))
        if all(v.shape == tuple(shape) for v, (shape, _) in zip(values, specs)):
            log.info("compile: the constant-only ops evaluated with numpy")
            if cache:
                cache.put("fold", key, ".bin", b"".join(v.tobytes() for v in values))
            return values
        log.info("compile: numpy's results of the constant-only ops have other shapes; built through LLVM")
    # Bufferized here, so that its constants are memref.globals when
    # lower_and_split looks for large ones to keep out of LLVM: on
    # tensors, ResNet-50's filters (the layout pass's transposes)
    # went through LLVM as 100 MB of initializers, 135 s of a build.
    passmanager.PassManager.parse(f"builtin.module({BUFFERIZE})", fold.context).run(fold.operation)
    text = str(fold)
    cm = _finish(text, signatures, entry, 1, [], 2, outline=True)
    try:
        values = cm()
    finally:
        cm.close()
    values = values if isinstance(values, tuple) else (values,)
    if cache:
        cache.put("fold", key, ".bin", b"".join(np.ascontiguousarray(v, dtype=dt).tobytes() for v, (_, dt) in zip(values, specs)))
    return values


def _spec(t: ir.Type) -> tuple[tuple[int, ...], str]:
    st = ir.ShapedType(t)
    return tuple(int(d) for d in st.shape), str(st.element_type)


def _signatures(module: ir.Module) -> dict:
    """name -> (input specs, output specs, written memref inputs) of every defined function."""
    out = {}
    for fn in _func_ops(module):
        if not fn.regions[0].blocks or "sym_visibility" in fn.attributes:
            continue
        ftype = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
        for t in list(ftype.inputs) + list(ftype.results):
            if not isinstance(t, (ir.RankedTensorType, ir.MemRefType)):
                raise AnsorError(f"@{_name(fn)}: argument/result type {t} is not a tensor or memref")
        written = _written_args(fn)
        out[_name(fn)] = ([_spec(t) for t in ftype.inputs], [_spec(t) for t in ftype.results], sorted(written))
    return out


def _written_args(fn: ir.Operation) -> list[int]:
    """Indices of the memref arguments a function writes (Linalg outs, copy targets)."""
    args = list(fn.regions[0].blocks[0].arguments)
    written: set[int] = set()

    def mark(v: ir.Value) -> None:
        for i, a in enumerate(args):
            if v == a:
                written.add(i)

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name.startswith("linalg."):
            # Named outputs too: transpose, broadcast and map have no operand segments.
            for v in linalg_inits(op):
                mark(v)
        elif op.name == "memref.copy":
            mark(op.operands[1])
        return ir.WalkResult.ADVANCE

    fn.walk(visit)
    return sorted(written)


def _pick_entry(signatures: dict, occs: list[Occurrence], entry: str | None) -> str:
    if entry is not None:
        if entry not in signatures:
            raise AnsorError(f"no function @{entry} to call ({', '.join(signatures) or 'none'})")
        return entry
    with_tasks = [o.func_name for o in occs]
    for name in signatures:
        if name in with_tasks:
            return name
    return next(iter(signatures))


def _workdir() -> str:
    return tempfile.mkdtemp(prefix="mlir-ansor-compile-")


_POOL: list[WorkerPool] = []


def _warm_worker() -> None:
    """A worker's first act: import what its jobs need (the MLIR bindings,
    the ExecutionEngine), while the parent still parses the input."""
    import mlir.execution_engine  # noqa: F401

    import mlir_ansor.schedule.apply  # noqa: F401


def _pool() -> WorkerPool:
    """The worker processes compile jobs run in, started once per process
    (a crash in one job only costs that worker)."""
    if not _POOL:
        import atexit

        pool = WorkerPool(usable_cores(), env={"KMP_WARNINGS": "0"}, max_jobs_per_worker=100, initializer=_warm_worker)
        atexit.register(pool.close)
        _POOL.append(pool)
    return _POOL[0]


def _finish(module_text: str, signatures: dict, entry: str, threads: int, plans: list[KernelPlan], opt_level: int,
            cache: CompileCache | None = None, outline: bool = False, *, weights: tuple = (),
            workdir: str | None = None, full_text: Callable[[], str] | None = None,
            share_weights: bool = False) -> CompiledModule:
    """Lower, code-generate and link `module_text`. `outline`: a module
    without kernels (the untuned reference, a fold function) has its
    functions cut into pieces first (`passes.outline`), so that it
    code-generates in parallel units and LLVM never sees one huge function.
    `weights`: the globals `module_text` holds as external declarations
    (:func:`lower_and_split`); `workdir`: the folder they are in, which the
    library goes to (else a new one); `full_text`: what gives the module
    with its weights back (the compiled module's ``mlir``); `share_weights`:
    link against a library of the weights (:func:`shared_weights_library`)
    instead of holding them."""
    workdir = workdir or _workdir()
    so_path = os.path.join(workdir, "module.so")
    start = time.perf_counter()
    shared = None
    try:
        shared = shared_weights_library(weights, cache) if share_weights and weights else None
        lower_and_link(module_text, signatures, threads, so_path, opt_level, cache, outline, weights, shared)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    # The weights' files stay (on disk, not in memory) until the module goes:
    # its ``mlir`` puts them back into the printed text (`_text_with_weights`).
    log.info("compile: lowered and linked @%s's module in %.1f s", entry, time.perf_counter() - start)
    cm = CompiledModule(so_path, full_text or module_text, signatures, entry, plans, threads, weights_library=shared)
    weakref.finalize(cm, shutil.rmtree, workdir, True)
    return cm


def compile(  # noqa: A001 - the public name the design asks for
    source,
    *,
    db: str | os.PathLike | None = None,
    threads: int = 1,
    target: Target | None = None,
    default: str = "sketch",
    entry: str | None = None,
    opt_level: int = 3,
    cache_dir: str | os.PathLike | bool | None = None,
    source_key: tuple[str, str] | None = None,
    share_weights: bool = False,
) -> CompiledModule:
    """Compile a whole module with the best schedule of every task.

    `source`: a path, "-", an ``ir.Module`` or a loaded :class:`Program`.
    `db`: the records database (best valid record per task for `target` and
    `threads`); None or a missing file: every task gets the default.
    `default`: "sketch" (the default sketch with parallel tiles; the naive
    lowering where it fails to build) or "naive" (no schedule).
    `cache_dir`: the compile cache (`passes.compile_cache`): None for the default
    folder (``<db>.cache``, or ``$MLIR_ANSOR_CACHE_DIR``...), a folder, or
    False for none.
    A CUDA `target` (``Target.cuda()``) gives a
    `measure.cuda_module.CudaModule` instead (`cuda_compiler.compile_cuda`:
    kernels and a host plan; `threads`, `opt_level` and the cache do not apply).
    `source_key`: ``(name, digest)``, what identifies the source's text,
    vouched for by the caller (the torch backend: its graph's code and input
    types, and a digest of those and the weights), in place of a file's path
    and bytes: a whole compile of a module object is cached under it too
    (one entry per name), and :func:`cached_compile` finds it without the
    source.
    `share_weights`: the library links against a library of its weights
    (:func:`shared_weights_library`, found by their bytes) instead of
    holding them: compiles of one model at several sizes (`DynamicModule`'s)
    map its weights once.
    """
    if target is not None and target.kind == "cuda":  # kernels and a host plan: `cuda_compiler`
        from mlir_ansor.cuda_compiler import compile_cuda

        return compile_cuda(source, db=None if default == "naive" else db, target=target, entry=entry)
    if default not in ("sketch", "naive"):
        raise AnsorError(f"default={default!r}: expected 'sketch' or 'naive'")
    target = target or Target.host()
    cache = cache_for(cache_dir, db)
    mkey = _module_key(source, db, threads, target, default, entry, opt_level, source_key) if cache else None
    if mkey is not None:
        def again() -> str:
            return schedule_module(source, db=db, threads=threads, target=target, default=default, entry=entry,
                                   cache=cache).mlir

        cm = _cached_module(cache, mkey[0], again)
        if cm is not None:
            cm.cache_stats = dict(cache.stats)
            return cm
    _pool()  # the workers start (and import MLIR) while this process parses the input
    program = load(source.module if isinstance(source, Program) else source)
    if _has_dynamic_arguments(program, entry):
        return DynamicModule(program, entry=entry, db=db, threads=threads, target=target, default=default,
                             opt_level=opt_level, cache_dir=cache_dir)
    warnings = _Warnings()
    log.addHandler(warnings)
    workdir = _workdir()
    try:
        # The weights go to files here rather than through the scheduled
        # module's text (ResNet-50's: 200 MB printed, written, read and
        # parsed again by the lowering worker: 2 s of a 19 s compile).
        s = schedule_module(program, db=db, threads=threads, target=target, default=default, entry=entry, cache=cache,
                            _owned=True, _weights_dir=workdir)
        cm = _finish(s.mlir, s.signatures, s.entry, threads, s.kernels, opt_level, cache, weights=s.weights,
                     workdir=workdir, full_text=s.full_mlir, share_weights=share_weights)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    finally:
        log.removeHandler(warnings)
    if mkey is not None:
        _store_module(cache, mkey, cm, warnings.messages)
    if cache is not None:
        cm.cache_stats = dict(cache.stats)
    return cm


def _has_dynamic_arguments(program: Program, entry: str | None) -> bool:
    from mlir_ansor.graph.dynamic import dynamic_dims

    for fn in _func_ops(program.module):
        if fn.regions[0].blocks and (entry is None or _name(fn) == entry) and dynamic_dims(fn):
            return True
    return False


class DynamicModule:
    """What :func:`compile` returns for a function with dynamic dimensions
    in its arguments: called on arrays, it reads their sizes, and runs the
    function's static specialization at those sizes
    (`graph.dynamic.specializations`), compiled with the database's records
    the first time a size is seen and kept for the next calls. Dimensions
    the function's ops tie together must have the same size (an error names
    them otherwise). `sizes` lists the specializations compiled so far;
    they link against one library of the function's weights
    (``compile(..., share_weights=True)``), so each adds its code only, and
    each is kept whole in the compile cache, named by its text.

    A specialization is compiled like any static module: the records of a
    size tuned with ``tune --sizes`` apply to it; a size nobody tuned gets
    the schedule of its nearest tuned size (`search.transfer`), else the
    default schedules.

    A size nobody tuned runs as it is. ``pad=True`` runs such a size that
    is not a multiple of :data:`PAD_TO` padded instead, where the function
    allows it (`graph.dynamic.paddable`: a GEMM's rows, not a sequence that
    attention reduces over), it costs at most :data:`PAD_WORK` more work
    and it pads to more than :data:`PAD_FROM`: the inputs are copied into
    zero-padded arrays, the specialization of the padded size runs, and
    each result is its first rows. It is off by default: the schedule a
    size between tuned ones takes from its neighbour (`search.transfer`)
    runs as well on the exact rows, whose sketch offers the same copy of
    B (since session 50), and the padding costs two copies and rows the
    other core finds dirty in the caller's cache. With a 200-trial tune at
    1, 16, 64, 256 and 1024 rows of the M x 1024 . 1024 x 1024 GEMM, the
    caller writing its rows before each call, exact over padded was 0.88,
    0.95 and 1.00 at 30, 100 and 333 rows at 2 threads, and 0.87, 0.96 and
    0.99 at 1 (Emerald Rapids, 9 rounds in turns; the records there, 12 x
    32 registers, ran as fast reading B in place as copying it). Before, a
    record that copied B was passed over at odd rows, or carried without
    the copy: the exact 333 rows ran 1.8x a module tuned at 333, padded
    1.04x (Zen 5, 1 thread)."""

    PAD_TO = 8
    """Padded sizes are multiples of this (the register tiles' rows)."""
    PAD_WORK = 1.15
    """The most a padded size may exceed the size it stands for, as a ratio."""
    PAD_FROM = 16
    """Extents that would pad to this many or fewer are not padded (with
    ``pad=True``): 7 and 15 rows of the GEMM above ran 11% faster exact
    than padded to 8 and 16 at 2 threads, 4-6% at 1."""
    SHAPES_KEPT = 256
    """Argument shapes whose specialization a call finds without checking them again."""

    def __init__(self, program: Program, *, entry: str | None, pad: bool = False, **options) -> None:
        from mlir_ansor.graph.dynamic import dynamic_function, symbols_with_padding

        with program.context:
            self.text = str(program.module)
            fn = dynamic_function(program.module, entry)
            self.entry = _name(fn)
            self.symbols, paddable = symbols_with_padding(program.module, self.entry)
            on_memrefs = any(isinstance(a.type, ir.MemRefType) for a in fn.regions[0].blocks[0].arguments)
            # (a function on memrefs writes its arguments: nothing to cut back)
            self.paddable = paddable if pad and not on_memrefs else [False] * len(self.symbols)
            self.n_args = len(fn.regions[0].blocks[0].arguments)
            self.n_results = len(ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value).results)
        self.source = program.source
        self.options = options
        self._compiled: dict[tuple, CompiledModule] = {}
        self._runs: dict[tuple, tuple] = {}  # sizes -> (compiled module, padded sizes or None, result shapes)
        self._by_shapes: dict[tuple, tuple] = {}  # argument shapes -> the same, once checked (the call's fast path)

    @property
    def sizes(self) -> list[dict[tuple[int, int], int]]:
        return [dict(k) for k in self._compiled]

    def _values(self, arrays) -> dict[tuple[int, int], int]:
        from mlir_ansor.graph.dynamic import extents

        if len(arrays) != self.n_args:
            raise AnsorError(f"@{self.entry} takes {self.n_args} argument(s), got {len(arrays)}")
        return extents(self.symbols, [np.shape(a) for a in arrays], self.entry)

    def _text_at(self, values: dict[tuple[int, int], int]) -> str:
        from mlir_ansor.graph.dynamic import specializations

        first = {g[0]: (values[g[0]],) for g in self.symbols}
        text, _ = specializations(self.text, first, func=self.entry, keep_name=True)
        return text

    def _compile_at(self, values: dict[tuple[int, int], int], text: str | None = None) -> CompiledModule:
        """The specialization at `values` (`text`: its module, when the caller has made it)."""
        from mlir_ansor.graph.dynamic import size_label
        from mlir_ansor.ir.program import load as load_text

        key = tuple(sorted(values.items()))
        cm = self._compiled.get(key)
        if cm is None:
            import hashlib

            sizes = size_label(values)
            log.info("compile: @%s at sizes %s", self.entry, sizes)
            text = text or self._text_at(values)
            name = f"<{self.source} at {sizes}>"
            # Named by its text, the whole compile of the size is cached like
            # a file's: a later process that meets the size loads it.
            cm = compile(load_text(text=text, name=name), entry=self.entry, share_weights=True,
                         source_key=(name, hashlib.sha256(text.encode()).hexdigest()), **self.options)
            self._compiled[key] = cm
        return cm

    def _tuned(self, text: str) -> bool:
        """Whether the database has records of a task of `text`'s module."""
        from mlir_ansor.ir.program import load as load_text
        from mlir_ansor.records import Database

        db = self.options.get("db")
        if db is None or not os.path.exists(db) or os.path.getsize(db) == 0:
            return False
        target = self.options.get("target") or Target.host()
        tasks = tasks_for(load_text(text=text), target, func=self.entry)
        with Database(db, readonly=True) as d:
            return any(d.count(t.workload_key, target.key) for t in tasks)

    def _padded(self, values: dict[tuple[int, int], int], exact: str) -> dict[tuple[int, int], int] | None:
        """The sizes to run `values` (whose specialization is the module
        `exact`) at, padded (None: as they are)."""
        out = dict(values)
        for group, ok in zip(self.symbols, self.paddable):
            v = values[group[0]]
            p = -(-v // self.PAD_TO) * self.PAD_TO
            if ok and p != v and self.PAD_FROM < p <= self.PAD_WORK * v:
                out.update({dim: p for dim in group})
        if out == values or self._tuned(exact):
            return None
        return out

    def _run(self, arrays) -> tuple:
        arg_shapes = argument_shapes(arrays)
        run = self._by_shapes.get(arg_shapes)
        if run is not None:
            return run
        values = self._values(arrays)
        key = tuple(sorted(values.items()))
        run = self._runs.get(key)
        if run is None:
            exact = self._text_at(values)  # made once: the database check, the result shapes, or the compile
            padded = self._padded(values, exact)
            cm = self._compile_at(padded) if padded is not None else self._compile_at(values, exact)
            shapes = None
            if padded is not None:
                from mlir_ansor.graph.dynamic import size_label

                with ir.Context():
                    module = ir.Module.parse(exact)
                    fn = next(op.operation for op in module.body.operations
                              if op.operation.name == "func.func" and _name(op.operation) == self.entry)
                    shapes = [tuple(ir.ShapedType(t).shape) for t in ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value).results]
                log.info("compile: @%s at sizes %s runs padded to %s", self.entry, size_label(values), size_label(padded))
            run = self._runs[key] = (cm, padded, shapes)
        if len(self._by_shapes) >= self.SHAPES_KEPT:
            del self._by_shapes[next(iter(self._by_shapes))]
        self._by_shapes[arg_shapes] = run
        return run

    def text_at(self, *arrays: np.ndarray) -> str:
        """The module of the function's static specialization at the sizes
        of `arrays` (what ``tune`` tunes to give calls at those sizes their
        own records; the function keeps its name)."""
        return self._text_at(self._values(arrays))

    def specialization(self, *arrays: np.ndarray) -> CompiledModule:
        """The compiled specialization that runs `arrays` (at their sizes,
        or padded ones: `padded_sizes`)."""
        return self._run(arrays)[0]

    def padded_sizes(self, *arrays: np.ndarray) -> dict[tuple[int, int], int] | None:
        """The sizes the arrays run at when they are padded (None: as they are)."""
        return self._run(arrays)[1]

    def __call__(self, *arrays: np.ndarray):
        cm, padded, shapes = self._run(arrays)
        if padded is None:
            return cm(*arrays)
        ins = []
        for i, a in enumerate(arrays):
            a = np.asarray(a)
            want = list(a.shape)
            for (j, d), p in padded.items():
                if j == i:
                    want[d] = p
            if want != list(a.shape):
                b = aligned_empty(tuple(want), a.dtype)  # aligned: passed to the kernels as it is
                b[tuple(slice(0, n) for n in a.shape)] = a
                for d, n in enumerate(a.shape):
                    if want[d] != n:
                        b[(slice(None),) * d + (slice(n, None),)] = 0
                a = b
            ins.append(a)
        out = cm(*ins)
        if out is None:
            return None
        outs = out if isinstance(out, tuple) else (out,)
        cut = tuple(np.ascontiguousarray(o[tuple(slice(0, n) for n in shape)]) if o.shape != shape else o
                    for o, shape in zip(outs, shapes))
        return cut if isinstance(out, tuple) else cut[0]

    def close(self) -> None:
        for cm in self._compiled.values():
            cm.close()
        self._compiled.clear()
        self._runs.clear()


def cached_compile(
    source_key: tuple[str, str],
    *,
    db: str | os.PathLike | None = None,
    threads: int = 1,
    target: Target | None = None,
    default: str = "sketch",
    entry: str | None = None,
    opt_level: int = 3,
    cache_dir: str | os.PathLike | bool | None = None,
) -> CompiledModule | None:
    """The whole compile that :func:`compile` with the same arguments and
    ``source_key`` stored in the compile cache, or None (a miss, or no
    cache): a caller whose source is dear to make (a model to import) asks
    here first."""
    target = target or Target.host()
    cache = cache_for(cache_dir, db)
    if cache is None:
        return None
    mkey = _module_key(None, db, threads, target, default, entry, opt_level, source_key)
    cm = _cached_module(cache, mkey[0])
    if cm is not None:
        cm.cache_stats = dict(cache.stats)
    return cm


class _Warnings(logging.Handler):
    """The warnings a compile logs (a skipped record, a schedule that failed),
    kept with its cache entry and logged again when the entry is used."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _module_key(source, db, threads: int, target: Target, default: str, entry: str | None,
                opt_level: int, source_key: tuple[str, str] | None = None) -> tuple[str, str] | None:
    """The compile cache's key of a whole compile (`passes.compile_cache`): the
    input file's path and bytes, the records database's path and bytes (and
    its write-ahead log's), the options, the target, the sketch rules that
    are registered and the runtime libraries linked in; and its slot, the same without the files' bytes
    (one entry per slot is kept: a re-tuned database replaces the entry of
    the database before). None for a source that is no file (stdin, a
    module object: only its units and folded constants are cached), unless
    the caller names the source by `source_key` ``(name, digest)``, which
    stand for the path and the bytes."""
    if source_key is None and (not isinstance(source, (str, os.PathLike)) or os.fspath(source) == "-"
                               or not os.path.isfile(source)):
        return None
    dbs = [os.fspath(db), os.fspath(db) + "-wal"] if db is not None else []
    from mlir_ansor.passes.artifacts import runtime_libs

    name = f"key:{source_key[0]}" if source_key is not None else os.path.abspath(source)
    options = [name, *(os.path.abspath(p) for p in dbs[:1]), threads, repr(target), default,
               entry or "", opt_level, _rules_fingerprint(), *runtime_libs()]
    # An empty write-ahead log is no log: SQLite leaves one behind when a
    # reader opens the database (a first compile of a copied database made
    # one, and the second compile missed).
    digests = ([source_key[1] if source_key is not None else file_digest(source)]
               + [file_digest(p) if os.path.isfile(p) and os.path.getsize(p) else "-" for p in dbs])
    return CompileCache.key("module", *options, *digests), CompileCache.key("module-slot", *options)


def _rules_fingerprint() -> str:
    """The registered sketch rules, by name and class (plugins change the
    sketches, and so what a record applies to)."""
    from mlir_ansor.search import registry

    return ";".join(f"{name}={type(rule).__module__}.{type(rule).__qualname__}"
                    for name, rule in zip(registry.rules(), registry.sketch_rules()))


def _no_mlir() -> str:
    raise AnsorError("this compiled module came from the compile cache by its key, which keeps no scheduled MLIR; "
                     "compile the source with the cache off (cache_dir=False, --no-cache) to get it")


def _cached_module(cache: CompileCache, key: str, mlir: Callable[[], str] = _no_mlir) -> CompiledModule | None:
    """The whole compile stored under `key`, in a fresh folder; None on a
    miss. Its scheduled MLIR is the entry's where it keeps one (an untuned
    build), else what `mlir` makes when asked for."""
    import pickle

    meta = cache.get("module", key, ".meta", count=False)
    lib = cache.get("module", key, ".so", count=False) if meta is not None else None
    text = cache.get("module", key, ".mlir", count=False) if lib is not None else None
    weights_library = None
    try:
        signatures, entry, plans, threads, warnings, weights_library = (
            pickle.loads(meta) if lib is not None else (None,) * 6)
    except Exception:  # noqa: BLE001 - any damage is a miss
        signatures = None
    if weights_library is not None and not os.path.exists(weights_library):
        signatures = None  # the library of its weights went with part of the cache: build again
    cache.count("module", signatures is not None)
    if signatures is None:
        return None
    workdir = _workdir()
    so_path = os.path.join(workdir, "module.so")
    with open(so_path, "wb") as f:
        f.write(lib)
    log.info("compile: the whole module comes from the compile cache (%s)", cache.root)
    for message in warnings:
        log.warning("%s", message)
    cm = CompiledModule(so_path, text.decode() if text is not None else mlir, signatures, entry, plans, threads,
                        weights_library=weights_library)
    weakref.finalize(cm, shutil.rmtree, workdir, True)
    return cm


def _store_module(cache: CompileCache, keys: tuple[str, str], cm: CompiledModule, warnings: list[str]) -> None:
    """Store a whole compile under ``keys[0]``, and drop the entry its slot
    (``keys[1]``) held before (a ResNet-50's library takes 100 MB). The
    scheduled MLIR is kept only where the compile printed it already (200
    MB more; a tuned compile's is printed again from the source when asked
    for, see :func:`compile`)."""
    import pickle

    key, slot = keys
    previous = cache.get("module", slot, ".slot", count=False)
    with open(cm.library_path, "rb") as f:
        cache.put("module", key, ".so", f.read())
    if isinstance(cm.mlir_text, str):
        cache.put("module", key, ".mlir", cm.mlir_text.encode())
    cache.put("module", key, ".meta", pickle.dumps((cm.functions, cm.entry, cm.kernels, cm.threads, warnings,
                                                    cm.weights_library)))
    cache.put("module", slot, ".slot", key.encode())
    if previous is not None and previous.decode(errors="replace") != key:
        for suffix in (".so", ".mlir", ".meta"):
            cache.path("module", previous.decode(errors="replace"), suffix).unlink(missing_ok=True)


@dataclass
class ScheduledModule:
    """Steps 1-4 of :func:`compile`: the scheduled module, before LLVM."""

    mlir: str
    """Kernels after their schedules and the drivers, on memrefs."""
    signatures: dict
    entry: str
    kernels: list[KernelPlan]
    weights: tuple[tuple[str, str, int], ...] = ()
    """(symbol, file, bytes) of the constant globals `mlir` declares
    without their data, which is in the files (``_weights_dir``); empty
    otherwise."""
    full_mlir: Callable[[], str] | None = None
    """With `weights`: prints the module with its weights back in."""


def schedule_module(
    source,
    *,
    db: str | os.PathLike | None = None,
    threads: int = 1,
    target: Target | None = None,
    default: str = "sketch",
    entry: str | None = None,
    cache: CompileCache | None = None,
    _owned: bool = False,
    _weights_dir: str | None = None,
) -> ScheduledModule:
    """The whole module with the best schedule of every task applied, not
    lowered (what ``ansor-apply-best`` splices into a pass pipeline); the
    arguments are those of :func:`compile`; `cache` keeps the folded
    constants (`passes.compile_cache`)."""
    if default not in ("sketch", "naive"):
        raise AnsorError(f"default={default!r}: expected 'sketch' or 'naive'")
    target = target or Target.host()
    # `_owned`: a Program this module loaded for the call (compile's), changed
    # in place; any other source is loaded afresh, the caller's left as it is.
    program = source if _owned and isinstance(source, Program) else load(
        source.module if isinstance(source, Program) else source)
    occs = occurrences_for(program, target)
    tasks: dict[str, Task] = {}
    for o in occs:
        tasks.setdefault(o.task.workload_key, o.task)
    plans = plan_kernels(list(tasks.values()), db=db, target=target, threads=threads, default=default)
    by_key = {p.task.workload_key: p for p in plans}

    # Schedule every distinct task in isolated workers; meanwhile, this
    # process builds the driver and folds its constants, which need only
    # the kernels' symbols (a fold built through LLVM waits for the pool).
    import concurrent.futures

    pool = _pool()
    args = [(p.payload, p.script, p.symbol, threads, p.source in ("default", "transferred")) for p in plans]
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(1) as scheduler:
        scheduled = scheduler.submit(pool.map, schedule_kernel, args, timeout_s=600)
        user_funcs = [_name(f) for f in _func_ops(program.module)]
        _build_driver(program, occs, by_key)
        fold_start = time.perf_counter()
        if fold_constants(program, lambda fold, name: _evaluate_fold(fold, name, cache)):
            log.info("compile: folded the constant-only ops in %.1f s", time.perf_counter() - fold_start)
        results = scheduled.result()
    log.info("compile: scheduled %d kernel(s) in %.1f s", len(plans), time.perf_counter() - start)
    retry = [i for i, r in enumerate(results) if not r.ok and plans[i].script is not None]
    for i in retry:
        p = plans[i]
        msg = results[i].error_msg.strip().splitlines()
        p.error = f"{results[i].error_kind.value}: {msg[-1] if msg else ''}"
        log.warning("compile: task %s: the %s schedule failed (%s); naive lowering", p.task.name, p.source, p.error)
        p.source, p.payload, p.script = "naive", p.task.mlir, None
    if retry:
        again = pool.map(schedule_kernel, [(plans[i].payload, None, plans[i].symbol, threads, False) for i in retry], timeout_s=600)
        for i, r in zip(retry, again):
            results[i] = r
    for p, r in zip(plans, results):
        if not r.ok:
            raise AnsorError(f"task {p.task.name}: cannot lower even without a schedule: {r.error_msg.strip()[-1000:]}")

    with program.context, ir.Location.unknown():
        module = program.module
        _stub_kernel_bodies(module)
        passmanager.PassManager.parse(f"builtin.module({BUFFERIZE})").run(module.operation)
        kernels = {}
        for p, r in zip(plans, results):
            kmod = ir.Module.parse(r.value)
            kernels[p.symbol] = kmod
        _link_kernels(module, kernels)
        try:
            module.operation.verify()
        except ir.MLIRError as e:
            raise AnsorError(f"the scheduled module does not verify: {e}") from None
        moved = _move_out_weights(module, _weights_dir) if _weights_dir is not None else []
        text = str(module)
        signatures = {k: v for k, v in _signatures(module).items() if k in user_funcs}
    entry_name = _pick_entry(signatures, occs, entry)
    full_mlir = None
    if moved:
        # From the printed text and the weights' files, not the module: a
        # closure over it kept its context alive, and with it every copy of
        # the weights (about 60 MB a BERT layer; a dynamic module compiles
        # one specialization per size).
        weights = [(sym, path, visibility) for sym, path, _, visibility in moved]

        def full_mlir() -> str:
            return _text_with_weights(text, weights)
    # The signatures above are the bufferized ones; the C ABI is the same
    # (memrefs in, results as trailing out-parameters).
    return ScheduledModule(text, signatures, entry_name, plans, tuple(m[:3] for m in moved), full_mlir)


def _stub_kernel_bodies(module: ir.Module) -> int:
    """Give each kernel declaration of the driver's module (tensors in,
    tensors out, its arguments read-only: ``bufferization.access``) a
    stand-in body for bufferization to analyse: it reads each argument and
    returns fresh tensors. Without a body, one-shot bufferization takes a
    call's results to alias all its operands, constants included, and then
    copies every buffer a kernel's result may reach before writing into it:
    each step of a concatenation that grows (DenseNet's dense block, one
    tensor written a slice per layer, `graph.normalize.decompose_concats`)
    copied the whole tensor. A kernel's results are fresh buffers indeed
    (the caller's, once they become out-parameters), and
    :func:`_link_kernels` replaces the stand-ins. Returns how many."""
    from mlir.dialects import arith as arith_d
    from mlir.dialects import func as func_d
    from mlir.dialects import tensor as tensor_d

    done = 0
    for fn in _func_ops(module):
        if fn.regions[0].blocks or "arg_attrs" not in fn.attributes:
            continue
        ftype = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
        types = list(ftype.inputs) + list(ftype.results)
        if not all(isinstance(t, ir.RankedTensorType) and ir.RankedTensorType(t).has_static_shape for t in types):
            continue
        access = [ir.DictAttr(a) for a in ir.ArrayAttr(fn.attributes["arg_attrs"])]
        if not all(_ACCESS in a and ir.StringAttr(a[_ACCESS]).value == "read" for a in access):
            continue
        block = fn.regions[0].blocks.append(*ftype.inputs)
        with ir.InsertionPoint(block), fn.location:
            zero = arith_d.ConstantOp(ir.IndexType.get(), 0).result
            for arg in block.arguments:
                shape = ir.RankedTensorType(arg.type).shape
                if 0 not in shape:
                    tensor_d.ExtractOp(arg, [zero] * len(shape))
            outs = [tensor_d.EmptyOp(list(ir.RankedTensorType(t).shape), ir.RankedTensorType(t).element_type).result
                    for t in ftype.results]
            func_d.ReturnOp(outs)
        done += 1
    return done


def _link_kernels(module: ir.Module, kernels: dict[str, ir.Module]) -> None:
    """Replace each kernel declaration (and its memref-form alias) by the
    scheduled kernel."""
    funcs = {_name(f): f for f in _func_ops(module)}
    for sym, kmod in kernels.items():
        alias = sym + "__m"
        if alias in funcs:
            ir.SymbolTable.replace_all_symbol_uses(alias, sym, module.operation)
            if sym in funcs:
                funcs[alias].erase()
            else:
                ir.SymbolTable.set_symbol_name(funcs[alias], sym)
                funcs[sym] = funcs[alias]
            del funcs[alias]
        decl = funcs.get(sym)
        if decl is None:
            continue
        for op in list(kmod.body.operations):
            op.operation.move_before(decl)
        decl.erase()


def compile_untuned(source, *, threads: int = 1, opt_level: int = 3, widen: bool = False,
                    cache_dir: str | os.PathLike | bool | None = False, db: str | os.PathLike | None = None,
                    only_cached: bool = False) -> CompiledModule | None:
    """The whole module lowered as it is, without tasks or schedules: the
    reference a compiled module is checked against. `widen`: compute in f32
    wherever the module computes in bf16 or f16 (`graph.precision.widen_payload`;
    its functions then take and return f32 arrays, and the callable casts
    narrower arrays given to it), so that the reference rounds less than the
    module it checks; a module that cannot be widened (its weights held as
    resources, a bitcast) is lowered as it is.

    `cache_dir` (as :func:`compile`'s, with `db` naming the default folder;
    False by default): a file's untuned build is kept in the compile cache,
    keyed by the file's bytes and the options, and a later call with the same
    file loads it (``cache_stats`` says ``module_hit``) instead of building it
    again (a ResNet-50's took about 100 s). `only_cached`: return that
    cached build, or None where there is none (nothing is built)."""
    cache = cache_for(cache_dir, db) if cache_dir is not False else None
    keys = _untuned_key(source, threads, opt_level, widen) if cache is not None else None
    if keys is not None:
        cm = _cached_module(cache, keys[0])
        if cm is not None:
            cm.cache_stats = dict(cache.stats)
            return cm
    if only_cached:
        return None
    cm = _build_untuned(source, threads, opt_level, widen, cache)
    if keys is not None:
        _store_module(cache, keys, cm, [])
    if cache is not None:
        cm.cache_stats = dict(cache.stats)
    return cm


def _untuned_key(source, threads: int, opt_level: int, widen: bool) -> tuple[str, str] | None:
    """The compile cache's key of an untuned build of a file, and its slot
    (one entry per file and options); None for a source that is no file."""
    if not isinstance(source, (str, os.PathLike)) or os.fspath(source) == "-" or not os.path.isfile(source):
        return None
    from mlir_ansor.passes.artifacts import runtime_libs

    options = [os.path.abspath(source), threads, opt_level, widen, *runtime_libs()]
    return CompileCache.key("untuned", *options, file_digest(source)), CompileCache.key("untuned-slot", *options)


def _build_untuned(source, threads: int, opt_level: int, widen: bool, cache: CompileCache | None) -> CompiledModule:
    program = load(source.module if isinstance(source, Program) else source)
    with program.context, ir.Location.unknown():
        text = str(program.module)
        signatures = _signatures(program.module)
    if widen:
        from mlir_ansor.graph.precision import widen_payload

        try:
            wide = widen_payload(text)
        except (UnsupportedError, ir.MLIRError, ValueError) as e:
            log.info("compile_untuned: the module is not widened (%s); it is lowered in its own types", e)
        else:
            if wide != text:
                with ir.Context(), ir.Location.unknown():
                    text = wide
                    signatures = _signatures(ir.Module.parse(wide))
    entry = next((n for n in signatures), None)
    if entry is None:
        raise AnsorError(f"no function to call in {program.source}")
    return _finish(text, signatures, entry, threads, [], opt_level, cache, outline=True)
