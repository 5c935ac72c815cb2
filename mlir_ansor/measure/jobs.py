"""The functions worker processes run: module-level, plain data in and out.

- :func:`prepare_reference`: lower the task without a schedule (the
  "untuned lowering"), make seeded random inputs, run it once to get the
  reference outputs, time it (the baseline), and save everything to an .npz
  that the runner reads.
- :func:`build_candidate`: apply a concrete schedule and emit a library.
- :func:`run_candidate`: check a library against the reference and time it.
"""

from __future__ import annotations

import time

import numpy as np

from .builder import build
from .runner import Kernel, TimingPolicy, np_dtype, run, time_callable


def random_inputs(
    specs: list[tuple[tuple[int, ...], str]], seed: int, low: float = -1.0, high: float = 1.0
) -> list[np.ndarray]:
    """Seeded inputs, uniform in [low, high) (integers in [-8, 8))."""
    rng = np.random.default_rng(seed)
    arrays = []
    for shape, dtype in specs:
        dt = np_dtype(dtype)
        if np.issubdtype(dt, np.floating):
            arrays.append(rng.uniform(low, high, size=shape).astype(dt))
        else:
            arrays.append(rng.integers(-8, 8, size=shape).astype(dt))
    return arrays


def prepare_reference(
    payload: str,
    inputs: list[tuple[tuple[int, ...], str]],
    outputs: list[tuple[tuple[int, ...], str]],
    seed: int,
    so_path: str,
    data_path: str,
    threads: int,
    policy: TimingPolicy,
) -> dict:
    """Build and run the untuned task; returns {"costs", "build_s"}.

    The run that computes the reference is timed; when it is slower than
    `policy.min_time_s` it is the baseline's only timing (an untuned kernel
    can take seconds), else the baseline is timed per `policy`.
    """
    info = build(payload, None, threads, so_path)
    kernel = Kernel(so_path)
    try:
        # Inputs in [-1, 1) first; a task defined only for positive inputs
        # (the rsqrt of a layer norm's variance, a log) gets [0.5, 1.5).
        for low, high in ((-1.0, 1.0), (0.5, 1.5)):
            arrays = random_inputs(inputs, seed, low, high)
            outs = [np.zeros(shape, dtype=np_dtype(dt)) for shape, dt in outputs]
            ins = [a.copy() for a in arrays]
            t0 = time.perf_counter()
            kernel.bind(ins + outs)()
            first = time.perf_counter() - t0
            if all(np.all(np.isfinite(o)) for o in outs if np.issubdtype(o.dtype, np.floating)):
                break
        else:
            raise RuntimeError("the untuned lowering produced non-finite values; it cannot serve as a reference")
        if first >= policy.min_time_s:
            costs = [first]
        else:
            costs = time_callable(kernel.bind(ins + [np.empty_like(o) for o in outs]), policy)
    finally:
        kernel.close()
    payload_arrays = {f"in{i}": a for i, a in enumerate(arrays)}
    payload_arrays.update({f"ref{i}": o for i, o in enumerate(outs)})
    np.savez(data_path, **payload_arrays)
    return {"costs": costs, "build_s": info["build_s"]}


def build_candidate(payload: str, script: str, threads: int, so_path: str, opt_level: int = 3) -> dict:
    return build(payload, script, threads, so_path, opt_level=opt_level)


def run_candidate(so_path: str, data_path: str, policy: TimingPolicy, tol: float, cutoff_s: float = float("inf")) -> dict:
    return run(so_path, data_path, policy, check=True, tol=tol, cutoff_s=cutoff_s)
