"""The functions worker processes run: module-level, plain data in and out.

- :func:`prepare_reference`: lower the task without a schedule (the
  "untuned lowering"), make seeded random inputs, run it once to get the
  reference outputs, time it (the baseline), and save everything to an .npz
  that the runner reads. A task in bf16 or f16 gets its reference from a
  widened copy (f32 in their place, `graph.precision.widen_payload`), so it
  rounds less than the candidates it checks.
- :func:`build_candidate`: apply a concrete schedule and emit a library.
- :func:`run_candidate`: check a library against the reference and time it.

For CUDA targets (`measurer.Measurer` picks these for ``target.kind == "cuda"``):

- :func:`prepare_cuda_reference`: first make sure this host sees a GPU
  (else fail with the reason: the tuner stops before building anything),
  then the reference outputs as above, from the untuned CPU lowering;
- :func:`build_cuda_candidate`: schedule, lower to PTX, assemble a cubin
  with ptxas, and say whether ptxas's figures drop it
  (`passes.nvvm.check_limits`); the artifact is one bundle file
  (`cuda_runner.write_bundle`: manifest entry + cubin);
- :func:`run_cuda_candidate`: load the bundle's cubin on the GPU, check it
  against the reference and time it with CUDA events (`cuda_runner.run`);
- :func:`prepare_offline_cuda_reference`: a build-only run's reference (no
  GPU needed), kept with the bundles for `gpu_measure` on a GPU host.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from mlir_ansor.graph.precision import widen_payload, widened_dtype
from mlir_ansor.measure import cuda_runner
from mlir_ansor.measure.builder import build
from mlir_ansor.measure.runner import (
    Kernel,
    TimingPolicy,
    aligned_copy,
    aligned_empty,
    aligned_full,
    is_float_array,
    load_data,
    np_dtype,
    random_inputs,
    run,
    save_data,
    time_callable,
)
from mlir_ansor.target import Target


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
    """Build and run the untuned task; returns {"costs", "build_s",
    "input_range" (the [low, high) the inputs were drawn from)}.

    The run that computes the reference is timed; when it is slower than
    `policy.min_time_s` it is the baseline's only timing (an untuned kernel
    can take seconds), else the baseline is timed per `policy`.

    A task with bf16 or f16 values is computed in f32 for its reference
    (`widen_payload`), on the same inputs widened exactly, and the reference
    outputs are kept in f32; the baseline is then the untuned kernel in the
    task's own types, built beside `so_path` and timed on the inputs as
    drawn. The data file names each output's own element type, which the
    candidates' output buffers are allocated in (`runner.save_data`).
    """
    wide = widen_payload(payload)
    info = build(wide, None, threads, so_path)
    build_s = info["build_s"]
    kernel = Kernel(so_path)
    try:
        # Inputs in [-1, 1) first; a task defined only for positive inputs
        # (the rsqrt of a layer norm's variance, a log) gets [0.5, 1.5).
        for low, high in ((-1.0, 1.0), (0.5, 1.5)):
            arrays = random_inputs(inputs, seed, low, high)
            outs = [aligned_full(shape, np_dtype(widened_dtype(dt)), 0) for shape, dt in outputs]
            ins = [aligned_copy(a, np_dtype(widened_dtype(dt))) for a, (_, dt) in zip(arrays, inputs)]
            t0 = time.perf_counter()
            kernel.bind(ins + outs)()
            first = time.perf_counter() - t0
            if all(np.all(np.isfinite(o)) for o in outs if is_float_array(o)):
                break
        else:
            raise RuntimeError("the untuned lowering produced non-finite values; it cannot serve as a reference")
        if wide == payload:
            if first >= policy.min_time_s:
                costs = [first]
            else:
                costs = time_callable(kernel.bind(ins + [aligned_empty(o.shape, o.dtype) for o in outs]), policy)
    finally:
        kernel.close()
    if wide != payload:
        costs, typed_build_s = _time_untuned(payload, arrays, outputs, threads, so_path, policy)
        build_s += typed_build_s
    save_data(data_path, arrays, outs, [dt for _, dt in outputs])
    return {"costs": costs, "build_s": build_s, "input_range": [low, high]}


def _time_untuned(
    payload: str,
    arrays: list[np.ndarray],
    outputs: list[tuple[tuple[int, ...], str]],
    threads: int,
    so_path: str,
    policy: TimingPolicy,
) -> tuple[list[float], float]:
    """(timings, build seconds) of the untuned `payload` in its own element
    types on `arrays`: the baseline of a task whose reference was computed
    wider. Its library lives beside `so_path` while it runs."""
    path = (so_path[: -len(".so")] if so_path.endswith(".so") else so_path) + "-typed.so"
    try:
        info = build(payload, None, threads, path)
        kernel = Kernel(path)
        try:
            call = kernel.bind([aligned_copy(a) for a in arrays] + [aligned_empty(s, np_dtype(dt)) for s, dt in outputs])
            t0 = time.perf_counter()
            call()
            first = time.perf_counter() - t0
            costs = [first] if first >= policy.min_time_s else time_callable(call, policy)
        finally:
            kernel.close()
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return costs, info["build_s"]


def build_candidate(payload: str, script: str, threads: int, so_path: str, opt_level: int = 3) -> dict:
    return build(payload, script, threads, so_path, opt_level=opt_level)


def run_candidate(so_path: str, data_path: str, policy: TimingPolicy, tol: float, cutoff_s: float = float("inf")) -> dict:
    return run(so_path, data_path, policy, check=True, tol=tol, cutoff_s=cutoff_s)


# --------------------------------------------------------------------------
# CUDA targets


class NoGpuError(RuntimeError):
    """The runner host cannot run CUDA candidates (no driver binding, no
    driver, or no device)."""


_BACKENDS: list = []  # this worker's CUDA backend, opened on first use


def _backend():
    if not _BACKENDS:
        try:
            _BACKENDS.append(cuda_runner.open_backend())
        except cuda_runner.CudaUnavailable as e:
            raise NoGpuError(f"no GPU on the runner host: {e}") from None
    return _BACKENDS[0]


def prepare_cuda_reference(
    payload: str,
    inputs: list[tuple[tuple[int, ...], str]],
    outputs: list[tuple[tuple[int, ...], str]],
    seed: int,
    so_path: str,
    data_path: str,
    threads: int,
    policy: TimingPolicy,
) -> dict:
    """A CUDA task's reference: fail with :class:`NoGpuError` unless this
    host can run a kernel, then compute the reference outputs with the
    untuned CPU lowering (`prepare_offline_cuda_reference`). Returns
    {"costs": [] (a CPU time is no GPU baseline), "build_s", "input_range",
    "device"}."""
    device = _backend().device_name
    info = prepare_offline_cuda_reference(payload, inputs, outputs, seed, so_path, data_path, threads, policy)
    return {**info, "device": device}


def prepare_offline_cuda_reference(
    payload: str,
    inputs: list[tuple[tuple[int, ...], str]],
    outputs: list[tuple[tuple[int, ...], str]],
    seed: int,
    so_path: str,
    data_path: str,
    threads: int,
    policy: TimingPolicy,
) -> dict:
    """A CUDA task's reference for a build-only run, computed here without a
    GPU (the untuned CPU lowering, run once), for `gpu_measure` to check the
    candidates against on a GPU host that has no MLIR. Returns {"costs": [],
    "build_s", "input_range"}."""
    once = TimingPolicy(warmup=0, min_repeat=1, max_repeat=1, min_time_s=0.0)
    info = prepare_reference(payload, inputs, outputs, seed, so_path, data_path, threads, once)
    return {"costs": [], "build_s": info["build_s"], "input_range": info["input_range"]}


def build_cuda_candidate(
    payload: str, script: str, threads: int, out_path: str, opt_level: int = 3, *, target: Target | None = None
) -> dict:
    """Build one candidate for the cuda `target` (default sm_90) into the
    bundle `out_path`; ptxas's figures are checked against `target`'s limits.

    Returns {"path", "build_s", "binary_hash" (of the cubin), "ptxas" (per
    kernel: registers, spills, stack, smem, barriers), "features"
    (`nvvm.ptxas_features`), "launches", "dropped" (why ptxas's figures
    rule it out, `nvvm.check_limits`; "" when they do not)}. `threads` and
    `opt_level` are the CPU build's and unused here."""
    from mlir_ansor.passes.nvvm import build_cuda

    target = target or Target.cuda(90)
    with tempfile.TemporaryDirectory(prefix="ansor-cubin-") as tmp:
        cubin = os.path.join(tmp, "kernel.cubin")
        b = build_cuda(payload, script, target, cubin)
        image = Path(cubin).read_bytes()
    entry = b.to_json()
    write = {**entry, "cubin": os.path.basename(out_path)}
    cuda_runner.write_bundle(out_path, write, image)
    return {
        "path": out_path,
        "build_s": b.build_s,
        "binary_hash": hashlib.sha256(image).hexdigest()[:20],
        "ptxas": b.ptxas,
        "features": b.features,
        "launches": entry["launches"],
        "dropped": b.dropped(target) or "",
    }


def run_cuda_candidate(path: str, data_path: str, policy: TimingPolicy, tol: float, cutoff_s: float = float("inf")) -> dict:
    """Check a built bundle on the GPU against the reference, then time it
    with CUDA events (the CPU runner's contract: {"costs", "error" (relative
    error), "ok"}). A driver error raises (a recorded run error)."""
    be = _backend()
    entry, image = cuda_runner.read_bundle(path)
    inputs, refs = load_data(data_path)
    slow = min(cutoff_s, 1.0) if math.isfinite(cutoff_s) else 1.0
    r = cuda_runner.run(
        be, entry, os.path.dirname(path), inputs, refs, tol,
        warmup=policy.warmup, min_repeat=policy.min_repeat, max_repeat=policy.max_repeat,
        min_time_s=policy.min_time_s, slow_s=slow, image=image,
    )
    if r.ok:
        return {"costs": r.costs, "error": r.max_rel_err, "ok": True, "device": be.device_name}
    if r.error.startswith("wrong answer"):
        return {"costs": [], "error": r.max_rel_err, "ok": False}
    raise cuda_runner.CudaRunError(r.error)
