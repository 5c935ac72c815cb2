"""The measurer: builds candidates and measures them through an executor.

- :class:`Candidate`: one concrete schedule of a task on its way through the
  measurer (the payload it applies to, its knobs and script, the reference
  data it is checked against, the handle of its built library).
- :class:`Measurement`: what measuring a candidate gave (its costs, or why
  it has none, and the host), as its record holds it.
- :class:`Measurer`: owns the executor (:func:`make_executor`: worker
  processes on this machine, `local_executor`, or a Ray cluster,
  `ray_executor`); builds batches of candidates, prepares a task's
  reference, checks and times one candidate.

The tuner (`mlir_ansor.tuner`) drives it; `tools.replay` re-measures records
with it. What it reads of the tuner's configuration is :class:`MeasureConfig`
(`tuner.TuneConfig` has it all), so this layer imports nothing above it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, Self, TypeVar

from mlir_ansor.graph.task import Task
from mlir_ansor.measure import jobs
from mlir_ansor.measure.executor import BuildJob, Executor, Outcome, ReferenceJob, RunJob, parse_executor
from mlir_ansor.measure.local_executor import LocalExecutor
from mlir_ansor.measure.pool import ErrorKind, JobResult
from mlir_ansor.measure.ray_executor import RayExecutor
from mlir_ansor.measure.runner import TimingPolicy
from mlir_ansor.passes.compile_cache import CompileCache
from mlir_ansor.target import Target

__all__ = [
    "Candidate",
    "MeasureConfig",
    "Measurement",
    "Measurer",
    "Payload",
    "arg_specs",
    "make_executor",
]

log = logging.getLogger("mlir_ansor")

_REFERENCES = "references"  # the reference cache's kind of entry (its folder in the cache)


class MeasureConfig(Protocol):
    """The settings a :class:`Measurer` reads (see `tuner.TuneConfig`, which
    has them all, for what each means)."""

    @property
    def executor(self) -> str: ...
    @property
    def threads(self) -> int: ...
    @property
    def build_workers(self) -> int | None: ...
    @property
    def overlap(self) -> bool: ...
    @property
    def memory_limit_mb(self) -> int | None: ...
    @property
    def runner_resource(self) -> str | None: ...
    @property
    def build_only(self) -> bool: ...
    @property
    def opt_level(self) -> int: ...
    @property
    def build_timeout_s(self) -> float: ...
    @property
    def run_timeout_s(self) -> float: ...
    @property
    def timing(self) -> TimingPolicy: ...
    @property
    def baseline_timing(self) -> TimingPolicy: ...
    @property
    def cutoff_factor(self) -> float: ...
    @property
    def hang_factor(self) -> float: ...
    @property
    def min_run_timeout_s(self) -> float: ...


class Payload(Protocol):
    """What a candidate's `sketch` must offer the measurer: the task's MLIR
    (tagged for the schedule) that its script applies to. The tuner's are
    `search.sketch.Sketch`s."""

    @property
    def payload(self) -> str: ...


S = TypeVar("S", bound=Payload)


@dataclass
class Candidate(Generic[S]):
    """One concrete schedule to build and measure.

    sketch: where it comes from (a `search.sketch.Sketch` for the tuner; the
      measurer reads only its ``payload``).
    knobs: its knob assignment, ``(name, value)`` pairs.
    data: the handle of the task's reference data (`Measurer.reference`)
      that its run is checked against; unused by a build-only run.
    script: the concrete schedule (transform IR) applied to the payload.
    so_path: where the local executor writes the library ("" = a path of its own).
    artifact: the built library's handle (`Outcome.artifact`), set by `Measurer.build`.
    """

    sketch: S
    knobs: tuple[tuple[str, Any], ...]
    data: Any = None
    script: str = ""
    so_path: str = ""
    artifact: Any = None


@dataclass(frozen=True)
class Measurement:
    """What measuring one candidate gave, as its record holds it.

    costs: the timings (seconds) of a candidate that ran and matched the
      reference; empty otherwise.
    error_kind: ``ErrorKind.NONE`` when it did; else why not (``build_error``,
      ``ptxas_limit``, ``not_measured``, ``run_error``, ``wrong_answer``,
      ``crash``, ``timeout``).
    error_msg: what went wrong ("" when it ran fine).
    host: the machine that ran it (CPU model or GPU name); for a candidate
      that never ran, the kind of host the run measures on; "" when the
      executor did not say.
    rel_error: the largest relative error against the reference, when it
      was checked (None when it did not get that far).
    """

    costs: tuple[float, ...] = ()
    error_kind: ErrorKind = ErrorKind.NONE
    error_msg: str = ""
    host: str = ""
    rel_error: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "costs", tuple(float(c) for c in self.costs))
        object.__setattr__(self, "error_kind", ErrorKind(self.error_kind))

    @property
    def valid(self) -> bool:
        """It ran, matched the reference and was timed."""
        return self.error_kind == ErrorKind.NONE and bool(self.costs)

    @property
    def latency_s(self) -> float:
        """Median of ``costs``; ``inf`` when there are none."""
        return statistics.median(self.costs) if self.costs else math.inf

    @classmethod
    def failed(cls, kind: ErrorKind, msg: str = "", host: str = "") -> Measurement:
        """A candidate with no timing: `kind` says why."""
        return cls((), kind, msg, host)

    @classmethod
    def of_build(cls, build: JobResult, host: str = "") -> Measurement | None:
        """A failed build's measurement (an exception in the build is a
        ``build_error``), on `host`; None when the build succeeded."""
        if build.ok:
            return None
        kind = ErrorKind.BUILD_ERROR if build.error_kind == ErrorKind.EXCEPTION else build.error_kind
        return cls.failed(kind, build.error_msg, host)

    @classmethod
    def of_run(cls, run: JobResult, tol: float) -> Measurement:
        """A checking run's measurement (`Executor.run`'s outcome, whose
        ``value`` is `jobs.run_candidate`'s): its costs, a ``wrong_answer``
        past `tol`, or a ``run_error`` (an exception in the run) or the
        run's own error kind; the host is the outcome's."""
        host = getattr(run, "host", "")  # the machine that ran it
        if not run.ok:
            kind = ErrorKind.RUN_ERROR if run.error_kind == ErrorKind.EXCEPTION else run.error_kind
            return cls.failed(kind, run.error_msg, host)
        if not run.value["ok"]:
            err = run.value["error"]
            msg = f"relative error {err:.3g} exceeds tolerance {tol:.3g}"
            return cls((), ErrorKind.WRONG_ANSWER, msg, host, err)
        return cls(tuple(run.value["costs"]), ErrorKind.NONE, "", host, run.value.get("error"))


def arg_specs(specs) -> tuple[tuple[tuple[int, ...], str], ...]:
    """(shape, dtype) of each of a task's `TensorSpec`s, as jobs take them."""
    return tuple((tuple(t.shape), t.dtype) for t in specs)


class Measurer:
    """Builds and measures candidates through an executor
    (`measure.executor`): worker processes on this machine by default
    (``config.executor == "local"``), or a Ray cluster.

    `config`: the tuner's settings (:class:`MeasureConfig`; a `TuneConfig`).
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
        config: MeasureConfig,
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
        self.reference_cache: CompileCache | None = None
        """The cache that keeps each task's reference data and untuned
        timings for the next run, under ``references/`` (the tuner sets the
        one of ``<db>.cache``); None: every run computes them."""
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

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def path(self, name: str) -> str:
        return os.path.join(self.workdir, name)

    def build(self, cands: Sequence[Candidate]) -> list[Outcome]:
        """Build the candidates (in parallel); each gets its library's handle
        (``artifact``). Outcomes in input order, errors included."""
        cfg = self.config
        specs = [
            BuildJob(c.sketch.payload, c.script, cfg.threads, cfg.opt_level, c.so_path or None) for c in cands
        ]
        outs = self.executor.build(specs, cfg.build_timeout_s)
        for c, o in zip(cands, outs):
            c.artifact = o.artifact
        return outs

    def reference(self, payload: str, task: Task, seed: int, index: int) -> tuple[Any, Outcome]:
        """Lower `payload` (the task, tagged) without a schedule, compute the
        reference outputs on seeded inputs and time the untuned kernel, on the
        runner. Returns the handle of the data candidates are checked against
        (a `Candidate`'s ``data``), and the job's result (``value["costs"]``:
        the baseline timings). `index` is kept for callers that number their tasks.
        It may take `reference_timeout_s`: a build and a run."""
        cfg = self.config
        ins, outs = arg_specs(task.inputs), arg_specs(task.outputs)
        job = ReferenceJob(payload, ins, outs, seed, cfg.threads, cfg.baseline_timing)
        key = self._reference_key(job)
        if key is not None:
            hit = self._cached_reference(key, index)
            if hit is not None:
                log.info("task %s: the reference and untuned baseline from the cache (%s)", task.name,
                         self.reference_cache.path(_REFERENCES, key, ".npz"))
                return hit.artifact, hit
        res = self.executor.prepare_reference(job, self.reference_timeout_s)
        if key is not None and res.ok:
            self._keep_reference(key, res)
        return res.artifact, res

    def _reference_key(self, job: ReferenceJob) -> str | None:
        """The key of `job` in the reference cache, or None when there is no
        cache or the reference is not a local file (a Ray runner's, a GPU's,
        one a test substitutes). It holds everything the reference depends
        on: the task's MLIR, its buffers, the seed, the threads and timing of
        the baseline, the runner's machine, and (`CompileCache.key`) the
        toolchain: our version and source, the wheels, the host CPU."""
        if self.reference_cache is None or not isinstance(self.executor, LocalExecutor):
            return None
        if self.executor.reference_fn is not jobs.prepare_reference:
            return None
        import json

        what = json.dumps([job.inputs, job.outputs, job.seed, job.threads, repr(job.policy), self.host], default=str)
        return self.reference_cache.key(_REFERENCES, job.payload, what)

    def _cached_reference(self, key: str, index: int) -> Outcome | None:
        """The cached reference of `key`, its data copied into this
        measurer's folder; None when either file is absent or damaged."""
        import json

        info = self.reference_cache.get(_REFERENCES, key, ".json", count=False)
        data = self.reference_cache.get(_REFERENCES, key, ".npz", count=False)
        if info is None or data is None:
            return None
        try:
            value = json.loads(info)
        except ValueError:
            return None
        local = self.path(f"task{index}_cached.npz")
        with open(local, "wb") as f:
            f.write(data)
        return Outcome(value=value, host=self.host, artifact=local)

    def _keep_reference(self, key: str, res: Outcome) -> None:
        """Put a computed reference into the cache: the data first, then the
        timings that make it an entry (`CompileCache.put` writes each file
        aside and renames it)."""
        import json

        try:
            with open(res.artifact, "rb") as f:
                data = f.read()
            info = json.dumps(res.value).encode()
        except (OSError, TypeError, ValueError) as exc:
            log.warning("the reference of %s is not kept in the cache (%s)", res.artifact, exc)
            return
        self.reference_cache.put(_REFERENCES, key, ".npz", data)
        self.reference_cache.put(_REFERENCES, key, ".json", info)

    @property
    def reference_timeout_s(self) -> float:
        """Seconds a task's reference may take: it builds the untuned
        lowering (`build_timeout_s`) and runs it (`run_timeout_s`)."""
        return self.config.build_timeout_s + self.config.run_timeout_s

    def run(self, cand: Candidate, tol: float, best_s: float = math.inf) -> Outcome:
        """Check (against ``cand.data``, within `tol`) and time one built
        candidate. With a best latency known, a candidate whose checking run
        and one warm run are `cutoff_factor` times slower is not timed
        further, and one `hang_factor` times slower is a timeout.
        ``Outcome.host`` is the machine that ran it."""
        cfg = self.config
        cutoff = cfg.cutoff_factor * best_s
        timeout = cfg.run_timeout_s
        if math.isfinite(best_s):
            timeout = min(timeout, max(cfg.min_run_timeout_s, cfg.hang_factor * best_s))
        return self.executor.run(RunJob(cand.artifact, cand.data, cfg.timing, tol, cutoff), timeout)

    def measure(self, cand: Candidate, tol: float, best_s: float = math.inf) -> Measurement:
        """`run`, as a :class:`Measurement`: its costs, or why it failed, and
        the host that ran it."""
        return Measurement.of_run(self.run(cand, tol, best_s), tol)

    def release(self, cand: Candidate) -> None:
        """Free a measured candidate's library."""
        if cand.artifact is not None:
            self.executor.release(cand.artifact)
            cand.artifact = None
        if cand.so_path:
            with contextlib.suppress(OSError):
                os.unlink(cand.so_path)


def make_executor(
    spec: str,
    threads: int = 1,
    *,
    build_workers: int | None = None,
    overlap: bool = True,
    memory_limit_mb: int | None = None,
    runner_resource: str | None = None,
    gpu: bool = False,
    build_fn: Callable = jobs.build_candidate,
    run_fn: Callable = jobs.run_candidate,
    reference_fn: Callable = jobs.prepare_reference,
) -> Executor:
    """The executor a spec names (`executor.parse_executor`): ``local`` (a
    process pool on this machine, :class:`~local_executor.LocalExecutor`),
    ``auto`` or ``ray://HOST:PORT`` (:class:`~ray_executor.RayExecutor`)."""
    spec = parse_executor(spec)
    common = dict(
        build_workers=build_workers,
        overlap=overlap,
        memory_limit_mb=memory_limit_mb,
        build_fn=build_fn,
        run_fn=run_fn,
        reference_fn=reference_fn,
    )
    if spec == "local":
        if runner_resource:
            log.warning("runner resource %r: only the Ray executor places runners; ignored", runner_resource)
        return LocalExecutor(threads, gpu=gpu, **common)
    t0 = time.perf_counter()
    ex = RayExecutor(spec, threads, runner_resource=runner_resource, gpu=gpu, **common)
    log.info("Ray executor ready in %.1f s", time.perf_counter() - t0)
    return ex
