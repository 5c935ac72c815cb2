"""The local executor: builder processes plus one runner process on this machine.

See `measure.executor` for the interface; `measurer.make_executor` makes one
for the spec ``local``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from typing import Any

from mlir_ansor.measure import jobs
from mlir_ansor.measure.executor import (
    BuildJob,
    Executor,
    Outcome,
    ReferenceJob,
    RunJob,
    host_model,
    worker_env,
)
from mlir_ansor.measure.pool import JobResult, WorkerPool
from mlir_ansor.target import usable_cores

__all__ = ["LocalExecutor"]


class LocalExecutor(Executor):
    """Builder processes plus one runner process on this machine.

    `threads`: the kernels' threads. With `overlap`, and a core left over by
    the kernels, builds of the next batch use the cores the runner does not
    (`build_workers` builders, by default one per such core); else all cores.
    The build, run and reference functions have the signatures of
    `jobs.build_candidate`, `jobs.run_candidate`, `jobs.prepare_reference`.
    `gpu`: the runs go to this machine's GPU (cuda targets); `host` is then
    the GPU's name.
    """

    def __init__(
        self,
        threads: int = 1,
        *,
        build_workers: int | None = None,
        overlap: bool = True,
        memory_limit_mb: int | None = None,
        build_fn: Callable = jobs.build_candidate,
        run_fn: Callable = jobs.run_candidate,
        reference_fn: Callable = jobs.prepare_reference,
        gpu: bool = False,
    ) -> None:
        cores = usable_cores()
        self._overlap = overlap and threads < cores
        default_builders = max(1, cores - threads) if self._overlap else cores
        env = worker_env(threads)
        self.build_fn, self.run_fn, self.reference_fn = build_fn, run_fn, reference_fn
        self.workdir = tempfile.mkdtemp(prefix="mlir-ansor-")
        self.builders = WorkerPool(
            build_workers or default_builders, env=env, max_jobs_per_worker=200, memory_limit_mb=memory_limit_mb
        )
        self.runner = WorkerPool(1, env=env, max_jobs_per_worker=500, memory_limit_mb=memory_limit_mb)
        self._host = host_model(gpu)
        self._node = os.uname().nodename
        self._count = 0

    @property
    def host(self) -> str:
        return self._host

    @property
    def overlap(self) -> bool:
        return self._overlap

    def _path(self, stem: str, suffix: str) -> str:
        self._count += 1
        return os.path.join(self.workdir, f"{stem}{self._count}{suffix}")

    def _outcome(self, r: JobResult, artifact: Any = None) -> Outcome:
        return Outcome(
            value=r.value,
            error_kind=r.error_kind,
            error_msg=r.error_msg,
            elapsed_s=r.elapsed_s,
            host=self._host,
            node=self._node,
            artifact=artifact if r.ok else None,
        )

    def build(self, jobs: Sequence[BuildJob], timeout_s: float) -> list[Outcome]:
        paths = [j.out_path or self._path("c", ".so") for j in jobs]
        args = [(j.payload, j.script, j.threads, p, j.opt_level) for j, p in zip(jobs, paths)]
        results = self.builders.map(self.build_fn, args, timeout_s=timeout_s)
        return [self._outcome(r, p) for r, p in zip(results, paths)]

    def prepare_reference(self, job: ReferenceJob, timeout_s: float) -> Outcome:
        data_path = self._path("task", ".npz")
        args = (
            job.payload,
            [tuple(s) for s in job.inputs],
            [tuple(s) for s in job.outputs],
            job.seed,
            data_path[: -len(".npz")] + "_ref.so",
            data_path,
            job.threads,
            job.policy,
        )
        return self._outcome(self.runner.run(self.reference_fn, args, timeout_s=timeout_s), data_path)

    def run(self, job: RunJob, timeout_s: float) -> Outcome:
        args = (job.artifact, job.data, job.policy, job.tol, job.cutoff_s)
        return self._outcome(self.runner.run(self.run_fn, args, timeout_s=timeout_s))

    def release(self, artifact: Any) -> None:
        if isinstance(artifact, str):
            with contextlib.suppress(OSError):
                os.unlink(artifact)

    def close(self) -> None:
        self.builders.close()
        self.runner.close()
        shutil.rmtree(self.workdir, ignore_errors=True)
