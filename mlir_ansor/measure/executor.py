"""Where candidates are built and measured: the interface every executor implements.

Roadmap: the measurer (`measure.measurer.Measurer`) talks to an
:class:`Executor` only: :meth:`~Executor.build` a batch of concrete schedules
into libraries, :meth:`~Executor.prepare_reference` of a task (the untuned
lowering, its seeded inputs and reference outputs, and its baseline timing),
:meth:`~Executor.run` one built candidate against that reference, and
:meth:`~Executor.close`. What a build or a reference produces comes back as
an opaque *handle* (``Outcome.artifact``) that is handed to `run`: a file
path for `local_executor.LocalExecutor` (a process pool on this machine), a
Ray object holding the bytes for `ray_executor.RayExecutor` (a Ray cluster).
`measurer.make_executor` picks one from a spec string (``local``, ``auto``,
``ray://HOST:PORT``; :func:`parse_executor` checks it).

The job functions themselves (`jobs.build_candidate`, `jobs.run_candidate`,
`jobs.prepare_reference`, or a test's faulty stand-ins) keep their path-based
signatures: each executor turns its handles into local files where a job
runs, and every job runs in an isolated `pool.WorkerPool` subprocess with a
time and memory limit, on a cluster too, because an MLIR assertion aborts
the process and a JIT'd kernel can segfault or hang. A crash is then a
recorded error, never a dead executor.

This module imports no MLIR (nor do `pool` and `runner`, which it uses).
"""

from __future__ import annotations

import abc
import contextlib
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

from mlir_ansor.errors import AnsorError
from mlir_ansor.measure.pool import JobResult
from mlir_ansor.measure.runner import TimingPolicy

__all__ = [
    "BuildJob",
    "Executor",
    "Outcome",
    "ReferenceJob",
    "RunJob",
    "host_model",
    "parse_executor",
    "worker_env",
]


@dataclass
class Outcome(JobResult):
    """A job's result, plus where it ran and what it produced.

    host: CPU model (or GPU name) of the machine that ran the job; a record
      carries the host of its run.
    node: which machine (the host name locally, the Ray node id on a cluster).
    artifact: the handle of what the job produced (a build: the library; a
      reference: its data), to hand to `Executor.run`; None when it failed.
    retries: attempts lost with a worker or node before this outcome.
    """

    host: str = ""
    node: str = ""
    artifact: Any = None
    retries: int = 0


@dataclass(frozen=True)
class BuildJob:
    """Apply `script` to `payload` (None: no schedule), lower on `threads`
    threads, emit a library. `out_path` is where the local executor writes
    it (None: a file of its own); remote executors ignore it."""

    payload: str
    script: str | None
    threads: int
    opt_level: int = 3
    out_path: str | None = None


@dataclass(frozen=True)
class ReferenceJob:
    """The untuned lowering of a task, run on inputs drawn with `seed`:
    its outputs are the reference candidates are checked against, and its
    timing (per `policy`) the baseline. Shapes are ``(shape, dtype)``."""

    payload: str
    inputs: tuple[tuple[tuple[int, ...], str], ...]
    outputs: tuple[tuple[tuple[int, ...], str], ...]
    seed: int
    threads: int
    policy: TimingPolicy


@dataclass(frozen=True)
class RunJob:
    """Check a built library (`artifact`, from a build `Outcome`) against a
    reference (`data`, from `prepare_reference`), then time it. A checking
    run slower than `cutoff_s` is the candidate's only timing."""

    artifact: Any
    data: Any
    policy: TimingPolicy
    tol: float
    cutoff_s: float = float("inf")


def host_model(gpu: bool = False) -> str:
    """The kind of machine measurements are compared within: the GPU's name
    (first device, from ``nvidia-smi``) when `gpu`, else the CPU model."""
    if gpu:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
            if out.returncode == 0 and names:
                return names[0]
    from mlir_ansor.target import Target

    return Target.host().model


def worker_env(threads: int) -> dict[str, str]:
    """The environment of a worker process whose kernels run on `threads`
    threads (OpenMP), for every executor's pools."""
    return {"OMP_NUM_THREADS": str(threads), "KMP_WARNINGS": "0"}


class Executor(abc.ABC):
    """Builds candidates and measures them; see the module's docstring.

    Implementations never raise because of a candidate: every job gets an
    :class:`Outcome`, errors included (``ErrorKind``)."""

    @property
    @abc.abstractmethod
    def host(self) -> str:
        """CPU model (or GPU name) of the machine the runs go to."""

    @property
    @abc.abstractmethod
    def overlap(self) -> bool:
        """Whether builds may run while a candidate is measured without
        taking the measured kernel's cores."""

    @abc.abstractmethod
    def build(self, jobs: Sequence[BuildJob], timeout_s: float) -> list[Outcome]:
        """Build every job (in parallel); outcomes in input order. A job past
        `timeout_s` is a ``timeout``; ``value`` holds the build function's
        result (``build_s``, ``binary_hash``), ``artifact`` the library."""

    @abc.abstractmethod
    def prepare_reference(self, job: ReferenceJob, timeout_s: float) -> Outcome:
        """Compute and time the reference of a task on the runner host;
        ``value["costs"]`` are the baseline timings, ``artifact`` the data
        handle that `run` takes."""

    @abc.abstractmethod
    def run(self, job: RunJob, timeout_s: float) -> Outcome:
        """Check and time one library on the runner host; ``value`` is the
        run function's result (``ok``, ``costs``, ``error``)."""

    def release(self, artifact: Any) -> None:  # noqa: B027 - optional hook
        """Free a library handle once its candidate is measured."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the workers (and a Ray instance this executor started)."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def parse_executor(spec: str) -> str:
    """Check an executor spec (``local``, ``auto``, ``ray://HOST:PORT``);
    returns it normalized, raises AnsorError naming the accepted forms."""
    s = (spec or "local").strip()
    if s in ("local", "auto"):
        return s
    if s == "ray":
        return "auto"
    if s.startswith("ray://") and len(s) > len("ray://"):
        return s
    raise AnsorError(f"unknown executor {spec!r}: expected 'local', 'auto' (Ray) or 'ray://HOST:PORT'")
