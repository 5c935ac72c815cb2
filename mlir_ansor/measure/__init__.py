"""Layer 5: building and measuring candidates, each in an isolated process.

- `pool`: worker processes with time and memory limits; a crash or a hang is
  a recorded error, never a dead tuner.
- `builder` / `jobs`: build a candidate (apply the schedule, lower, emit a
  shared library or cubins) and the jobs the executors run.
- `runner` / `cuda_runner`: time a kernel and check it against the
  reference (CPU through ctypes, GPU through cuda-python; neither needs MLIR).
- `executor`: the interface of where jobs run, and the jobs' data;
  `local_executor` (a local process pool) and `ray_executor` (a Ray
  cluster) implement it.
- `measurer`: the `Measurer` the tuner drives (candidates in,
  `Measurement`s out), and `make_executor`, which picks an executor by name.
- `gpu_measure`: measure built cubins on a GPU host that has no MLIR
  (`python -m mlir_ansor.measure.gpu_measure`; it, `executor`, `pool`,
  `runner` and `cuda_runner` import no MLIR).

May import: `errors`, `target`, `records`, `ir`, `graph`, `schedule`, `passes`.
"""

from mlir_ansor.measure.pool import ErrorKind, JobResult, WorkerPool

__all__ = ["ErrorKind", "JobResult", "WorkerPool"]
