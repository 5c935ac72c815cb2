"""The machine's roofline: FMA peak and memory bandwidth, measured and cached.

Entry points: :func:`measure_peak` (measure, a few seconds), :func:`load_peak`
(the cached figures, or None) and :func:`save_peak`. `mlir-ansor peak` measures
and saves; `mlir-ansor show` divides each task's GFLOP/s by the cached peak.

Why the kernels are MLIR, lowered by our own pipeline (passes/lowering.py),
rather than C with intrinsics: the figure a report compares a tuned kernel
with should be what *our* code generator can reach on this host, with the
same LLVM, the same host CPU features picked by the ExecutionEngine (AVX2,
AVX-512 or NEON without per-ISA compiler flags) and the same OpenMP runtime
the kernels use for threads. The C compiler is only the linker, as for every
kernel.

* FMA peak: each thread (an ``scf.forall`` iteration) runs a loop of
  ``ACCUMULATORS`` independent ``vector.fma`` chains on full-width vectors.
  Twelve independent chains hide the FMA latency (4-5 cycles) on two FMA
  ports; the chains are loop-carried and, without fast-math, cannot be folded,
  so every FMA executes. FLOPs = 2 x lanes x chains x iterations x threads.
* Bandwidth: a STREAM-like triad ``a = b + s * c`` on f32 arrays of
  ``BANDWIDTH_ELEMENTS`` elements each (three 64 MiB arrays, far beyond the
  last-level cache), split in contiguous chunks over the threads; bytes per
  run = 3 x array size (write-allocate traffic is not counted, as in STREAM).

The cache is JSON at ``$MLIR_ANSOR_PEAK`` or ``~/.cache/mlir-ansor/peak.json``;
it records the host model so that a cache copied from another machine is
ignored.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

from mlir_ansor.target import Target

__all__ = ["Peak", "load_peak", "measure_peak", "peak_cache_path", "save_peak"]

ACCUMULATORS = 12
FMA_ITERATIONS = 1 << 18
BANDWIDTH_ELEMENTS = 1 << 24
ENV_VAR = "MLIR_ANSOR_PEAK"


@dataclass(frozen=True)
class Peak:
    """Measured figures of one host (GFLOP/s are f32)."""

    host: str
    target: str
    threads: int
    fma_gflops_1t: float
    fma_gflops: float
    bandwidth_gbs_1t: float
    bandwidth_gbs: float
    timestamp: float = 0.0

    def gflops(self, threads: int) -> float:
        """The FMA peak for kernels on `threads` threads (linear in between)."""
        if threads <= 1:
            return self.fma_gflops_1t
        if threads >= self.threads:
            return self.fma_gflops
        return self.fma_gflops_1t * threads

    def bandwidth(self, threads: int) -> float:
        return self.bandwidth_gbs_1t if threads <= 1 else self.bandwidth_gbs


def peak_cache_path() -> str:
    return os.environ.get(ENV_VAR) or os.path.join(os.path.expanduser("~"), ".cache", "mlir-ansor", "peak.json")


def load_peak(path: str | None = None, *, host: str | None = None) -> Peak | None:
    """The cached figures, or None (no cache, unreadable, or another host's)."""
    path = path or peak_cache_path()
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        peak = Peak(**{k: d[k] for k in Peak.__dataclass_fields__ if k in d})
    except (OSError, ValueError, TypeError, KeyError):
        return None
    if host is not None and peak.host != host:
        return None
    return peak


def save_peak(peak: Peak, path: str | None = None) -> str:
    path = path or peak_cache_path()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(asdict(peak), f, indent=2)
    os.replace(tmp, path)
    return path


def _fma_mlir(threads: int, lanes: int) -> str:
    vt = f"vector<{lanes}xf32>"
    accs = [f"%a{j}" for j in range(ACCUMULATORS)]
    init = ", ".join(f"{a} = %z" for a in accs)
    body = "\n".join(f"          %b{j} = vector.fma %x, %y, %a{j} : {vt}" for j in range(ACCUMULATORS))
    yields = ", ".join(f"%b{j}" for j in range(ACCUMULATORS))
    stores = "\n".join(
        f"      %i{j} = arith.constant {j} : index\n"
        f"      vector.store %r#{j}, %out[%t, %i{j}, %c0] : memref<{threads}x{ACCUMULATORS}x{lanes}xf32>, {vt}"
        for j in range(ACCUMULATORS)
    )
    types = ", ".join([vt] * ACCUMULATORS)
    return f"""
func.func @fma_peak(%out: memref<{threads}x{ACCUMULATORS}x{lanes}xf32>) {{
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %n = arith.constant {FMA_ITERATIONS} : index
  %x = arith.constant dense<0.999999> : {vt}
  %y = arith.constant dense<1.000001> : {vt}
  %z = arith.constant dense<0.0> : {vt}
  scf.forall (%t) in ({threads}) {{
    %r:{ACCUMULATORS} = scf.for %i = %c0 to %n step %c1 iter_args({init}) -> ({types}) {{
{body}
          scf.yield {yields} : {types}
    }}
{stores}
  }}
  return
}}
"""


def _triad_mlir(threads: int, lanes: int, n: int) -> str:
    vt = f"vector<{lanes}xf32>"
    chunk = n // threads
    mt = f"memref<{n}xf32>"
    return f"""
func.func @triad(%b: {mt}, %c: {mt}, %a: {mt}) {{
  %c0 = arith.constant 0 : index
  %chunk = arith.constant {chunk} : index
  %step = arith.constant {lanes} : index
  %s = arith.constant dense<3.0> : {vt}
  scf.forall (%t) in ({threads}) {{
    %lo = arith.muli %t, %chunk : index
    %hi = arith.addi %lo, %chunk : index
    scf.for %i = %lo to %hi step %step {{
      %vb = vector.load %b[%i] : {mt}, {vt}
      %vc = vector.load %c[%i] : {mt}, {vt}
      %va = vector.fma %s, %vc, %vb : {vt}
      vector.store %va, %a[%i] : {mt}, {vt}
    }}
  }}
  return
}}
"""


def _build(mlir_text: str, name: str, threads: int, workdir: str):
    from mlir import ir

    from mlir_ansor.measure.runner import Kernel
    from mlir_ansor.passes.artifacts import emit_shared_library
    from mlir_ansor.passes.lowering import lower_to_llvm

    so = os.path.join(workdir, f"{name}_{threads}.so")
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(mlir_text)
        lower_to_llvm(module, threads)
        emit_shared_library(module, so)
    return Kernel(so, name)


def _best_time(call, min_time_s: float) -> float:
    call()  # warm-up: page faults, OpenMP thread start
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - start < min_time_s:
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    # the best run: peak figures are what the machine can do, not the average
    return min(times)


def measure_peak(threads: int | None = None, *, min_time_s: float = 0.3, target: Target | None = None) -> Peak:
    """Measure FMA peak and triad bandwidth on 1 thread and on `threads`
    (default: every core). Takes a few seconds."""
    target = target or Target.host()
    threads = threads or os.cpu_count() or 1
    lanes = target.lanes("f32")
    workdir = tempfile.mkdtemp(prefix="mlir-ansor-peak-")
    old_omp = os.environ.get("KMP_WARNINGS")
    os.environ.setdefault("KMP_WARNINGS", "0")
    try:
        fma: dict[int, float] = {}
        bw: dict[int, float] = {}
        b = np.random.default_rng(0).random(BANDWIDTH_ELEMENTS, dtype=np.float32)
        c = np.ones(BANDWIDTH_ELEMENTS, np.float32)
        a = np.zeros(BANDWIDTH_ELEMENTS, np.float32)
        for t in sorted({1, threads}):
            k = _build(_fma_mlir(t, lanes), "fma_peak", t, workdir)
            out = np.zeros((t, ACCUMULATORS, lanes), np.float32)
            s = _best_time(k.bind([out]), min_time_s)
            fma[t] = 2.0 * lanes * ACCUMULATORS * FMA_ITERATIONS * t / s / 1e9
            k = _build(_triad_mlir(t, lanes, BANDWIDTH_ELEMENTS), "triad", t, workdir)
            run = k.bind([b, c, a])
            s = _best_time(run, min_time_s)
            if not np.allclose(a[:: 1 << 12], b[:: 1 << 12] + 3.0 * c[:: 1 << 12]):
                raise RuntimeError("the triad kernel computed a wrong answer")
            bw[t] = 3.0 * 4 * BANDWIDTH_ELEMENTS / s / 1e9
    finally:
        if old_omp is None:
            os.environ.pop("KMP_WARNINGS", None)
        shutil.rmtree(workdir, ignore_errors=True)
    return Peak(
        host=target.model,
        target=target.key,
        threads=threads,
        fma_gflops_1t=fma[1],
        fma_gflops=fma[threads],
        bandwidth_gbs_1t=bw[1],
        bandwidth_gbs=bw[threads],
        timestamp=time.time(),
    )

