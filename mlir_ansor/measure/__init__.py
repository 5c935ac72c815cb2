"""Measurement: builders, runners and the isolated worker pool they run in."""

from mlir_ansor.measure.pool import ErrorKind, JobResult, WorkerPool

__all__ = ["ErrorKind", "JobResult", "WorkerPool"]
