"""Run the whole-module CUDA bundles of `cuda_module_build.py` on a GPU host
(numpy and cuda-python, no MLIR): each one is checked against its float64
numpy reference (or the outputs saved with it) and timed with CUDA events;
GEMMs and softmax are also timed with torch (cuBLAS; torch.softmax) where
torch sees the GPU.

  python benchmarks/cuda_module_check.py [benchmarks/cuda_modules] [--json OUT] [--repeat N]

Prints one line per module: latency, relative error against the tolerance,
and torch's latency where there is one. Exits 1 if a module is wrong or
fails to run, 0 otherwise; without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mlir_ansor.examples.workloads import numpy_reference  # noqa: E402
from mlir_ansor.ir.dtypes import tolerance  # noqa: E402
from mlir_ansor.measure.cuda_module import CudaModule  # noqa: E402
from mlir_ansor.measure.cuda_runner import CudaUnavailable, device_count, relative_error  # noqa: E402
from mlir_ansor.measure.runner import random_inputs  # noqa: E402


def _torch_gemm_s(inputs: list[np.ndarray], repeat: int) -> float | None:
    """torch.matmul's median time on the GPU for the same operands (TF32
    allowed for f32, as cuBLAS's default in torch is not), or None."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.backends.cuda.matmul.allow_tf32 = True
    a, b = (torch.from_numpy(np.ascontiguousarray(x)).cuda() for x in inputs)
    torch.matmul(a, b)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    costs = []
    for _ in range(repeat):
        start.record()
        torch.matmul(a, b)
        end.record()
        end.synchronize()
        costs.append(start.elapsed_time(end) / 1e3)
    return statistics.median(costs)


def _torch_softmax_s(inputs: list[np.ndarray], repeat: int) -> float | None:
    """torch.softmax over the last dimension: its median time on the GPU
    for the same input (the peer of the warp-shuffle reductions), or None."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    x = torch.from_numpy(np.ascontiguousarray(inputs[0])).cuda()
    torch.softmax(x, dim=-1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    costs = []
    for _ in range(repeat):
        start.record()
        torch.softmax(x, dim=-1)
        end.record()
        end.synchronize()
        costs.append(start.elapsed_time(end) / 1e3)
    return statistics.median(costs)


PEERS = {"matmul": _torch_gemm_s, "softmax": _torch_softmax_s}
"""The torch peer of each reference kind (timed in the same run)."""


def check(folder: Path, entry: dict, repeat: int) -> dict:
    """Run one bundle: its outputs against the reference, and its times."""
    module = CudaModule(folder / entry["bundle"])
    try:
        inputs = random_inputs(module.inputs, entry["seed"])
        outs = module(*inputs)
        outs = list(outs) if isinstance(outs, tuple) else [outs]
        if entry["reference"].endswith(".npz"):
            saved = np.load(folder / entry["bundle"] / entry["reference"])
            refs = [saved[f"arr_{i}"] for i in range(len(saved.files))]
        else:
            refs = [numpy_reference(entry["reference"])(*[x.astype(np.float64) for x in inputs])]
        plan = module.plan
        red = max((t.get("reduction_length", 1) for t in plan["tasks"]), default=1)
        rounded = sorted({k.get("rounds_to", "") for k in plan["kernels"]} - {""}) or [None]
        tol = max(tolerance(d, red, rounds_to=n, whole_module=True) for _, d in module.outputs for n in rounded)
        err = max(relative_error(np.asarray(o, dtype=np.float64), np.asarray(r, dtype=np.float64))
                  for o, r in zip(outs, refs))
        lat = statistics.median(module.time(*inputs, repeat=repeat))
        peer = PEERS.get(entry["reference"])
        torch_s = peer(inputs, repeat) if peer else None
        return {"name": entry["name"], "ok": bool(err <= tol), "latency_s": lat, "max_relative_error": err,
                "tolerance": tol, "torch_s": torch_s, "schedules": entry.get("schedules", [])}
    finally:
        module.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", nargs="?", default=str(ROOT / "benchmarks" / "cuda_modules"))
    p.add_argument("--json", default=None)
    p.add_argument("--repeat", type=int, default=20)
    args = p.parse_args(argv)
    n, why = device_count()
    if not n:
        print(f"cuda_module_check: no GPU here ({why}); nothing run")
        return 0
    folder = Path(args.folder)
    results, bad = [], 0
    for entry in json.loads((folder / "index.json").read_text()):
        try:
            r = check(folder, entry, args.repeat)
        except (CudaUnavailable, Exception) as e:  # noqa: BLE001 - one module's failure is its line
            r = {"name": entry["name"], "ok": False, "error": f"{type(e).__name__}: {e}",
                 "trace": traceback.format_exc(limit=3)}
        results.append(r)
        bad += not r["ok"]
        if "error" in r:
            print(f"{r['name']:<18} ERROR {r['error']}")
            continue
        ratio = f", torch {r['torch_s'] * 1e3:.3f} ms ({r['torch_s'] / r['latency_s']:.0%} of ours)" if r["torch_s"] else ""
        print(f"{r['name']:<18} {r['latency_s'] * 1e3:9.3f} ms  err {r['max_relative_error']:.2e} "
              f"(tol {r['tolerance']:.1e}) {'ok' if r['ok'] else 'WRONG'}{ratio}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
