"""Time prebuilt GPU candidates against PyTorch (cuBLAS/cuDNN) on a GPU host.

Needs numpy, torch (CUDA) and cuda-python (or pycuda); no MLIR and nothing
of mlir_ansor installed: the runner module is loaded by its path. Input: a
folder written by `benchmarks/gpu_build.py` (cubins + manifest.json).

    python3 benchmarks/gpu_bench.py benchmarks/gpu_artifacts [--budget-s 360] [--json out.json]

For each workload: seeded inputs, a float64 reference computed on the host
with numpy (independent of the GPU), the peer's timing from torch on the
same GPU (f32 without TF32; f16 with f32 accumulation as cuBLAS does; its
output is checked against the host reference too), then every candidate is
checked against the host reference (every element, NaN-filled outputs, a
tolerance per dtype and accumulation: `tolerance`) and timed with CUDA
events; only correct candidates count, and the best one is the tuned result
("random search over the prebuilt set"). Prints a table of GFLOP/s and the
ratio to torch, then the error of every candidate.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def load_runner():
    path = ROOT / "mlir_ansor" / "measure" / "cuda_runner.py"
    spec = importlib.util.spec_from_file_location("ansor_cuda_runner", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ansor_cuda_runner"] = mod
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


def make_inputs(wl: dict, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    dt = np.float16 if wl["dtype"] == "f16" else np.float32
    if wl["kind"] == "matmul":
        m, n, k = wl["mnk"]
        return [rng.uniform(-1, 1, (m, k)).astype(dt), rng.uniform(-1, 1, (k, n)).astype(dt)]
    c = wl["conv"]
    return [rng.uniform(-1, 1, (c["n"], c["h"], c["w"], c["c"])).astype(dt),
            rng.uniform(-1, 1, (c["kh"], c["kw"], c["c"], c["f"])).astype(dt)]


def host_reference(wl: dict, inputs: list[np.ndarray]) -> np.ndarray:
    """The exact result in float64, computed on the host with numpy."""
    a, b = (x.astype(np.float64) for x in inputs)
    if wl["kind"] == "matmul":
        return a @ b
    c = wl["conv"]
    oh, ow = c["h"] - c["kh"] + 1, c["w"] - c["kw"] + 1
    out = np.zeros((c["n"], oh, ow, c["f"]))
    for i in range(c["kh"]):
        for j in range(c["kw"]):
            out += np.tensordot(a[:, i:i + oh, j:j + ow, :], b[i, j], axes=([3], [0]))
    return out


def torch_peer(wl: dict, inputs: list[np.ndarray], repeat: int = 20):
    """(torch's output as numpy, median seconds) from torch on the GPU."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    a, b = (torch.from_numpy(x).to(dev) for x in inputs)
    if wl["kind"] == "matmul":
        def fn():
            return a @ b
    else:
        x = a.permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)  # NHWC data
        w = b.permute(3, 2, 0, 1).contiguous(memory_format=torch.channels_last)  # HWCF -> FCHW
        torch.backends.cudnn.benchmark = True

        def fn():
            return torch.nn.functional.conv2d(x, w)
    out = fn()
    torch.cuda.synchronize()
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    costs = []
    for _ in range(repeat):
        start.record()
        fn()
        end.record()
        end.synchronize()
        costs.append(start.elapsed_time(end) / 1e3)
    if wl["kind"] != "matmul":
        out = out.permute(0, 2, 3, 1)  # NCHW view -> NHWC
    return out.float().contiguous().cpu().numpy(), float(np.median(costs))


def tolerance(wl: dict, sketch: str) -> float:
    """Largest |out - ref| / max|ref| accepted (ref: the float64 result).

    Inputs are uniform in [-1, 1], so outputs are about sqrt(K / 9) and a
    wrong index, a missed tile or a race gives errors of order 1. f16 output
    accumulated in f16 (every f16 sketch, tensor cores included): rounding
    of each partial sum, about 1e-2 at K = 4096; tf32 tensor cores
    (`cuda-mma` on f32): 10-bit mantissas, about 1e-3; f32 FMAs: 1e-6."""
    k = (wl.get("mnk") or [0, 0, 576])[2]
    if wl["dtype"] == "f16":
        return 3e-2 if k > 1024 else 1e-2
    if sketch == "cuda-mma":
        return 5e-3
    return 2e-5


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("folder", nargs="?", default=str(ROOT / "benchmarks" / "gpu_artifacts"))
    ap.add_argument("--budget-s", type=float, default=360.0, help="stop timing candidates after this long")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    runner = load_runner()
    folder = Path(args.folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    try:
        backend = runner.open_backend()
    except runner.CudaUnavailable as e:
        print(f"gpu_bench: no GPU to measure on: {e}", file=sys.stderr)
        return 2
    print(f"device: {backend.device_name} ({backend.name}); artifacts for {manifest['target']}")
    t0 = time.perf_counter()
    rows, results = [], []
    for wl in manifest["workloads"]:
        inputs = make_inputs(wl)
        ref = host_reference(wl, inputs)
        try:
            peer_out, peer_s = torch_peer(wl, inputs)
            peer_err = runner.relative_error(peer_out, ref)
            print(f"  {wl['name']:>22} {'torch':>17} {'ok ' if peer_err <= tolerance(wl, 'torch') else 'ERR'} "
                  f"{wl['flops'] / peer_s / 1e9:9.1f} GFLOP/s  err {peer_err:.2e}")
        except Exception as e:  # noqa: BLE001 - report and go on without the peer
            print(f"{wl['name']}: torch failed: {e}")
            peer_s = float("nan")
        best, best_c, errors = float("inf"), None, 0
        for c in wl["candidates"]:
            if time.perf_counter() - t0 > args.budget_s:
                print(f"{wl['name']}: time budget spent, {c['sketch']} {c['knobs']} not timed")
                continue
            r = runner.run(backend, c, folder, inputs, [ref], tolerance(wl, c["sketch"]))
            gf = wl["flops"] / r.latency_s / 1e9 if r.ok else 0.0
            print(f"  {wl['name']:>22} {c['sketch']:>17} {'ok ' if r.ok else 'ERR'} {gf:9.1f} GFLOP/s  "
                  f"err {r.max_rel_err:.2e} {c['knobs']} {r.error}")
            results.append({"workload": wl["name"], "sketch": c["sketch"], "knobs": c["knobs"], **r.to_json()})
            if not r.ok:
                errors += 1
            elif r.latency_s < best:
                best, best_c = r.latency_s, c
        peer_gf = wl["flops"] / peer_s / 1e9 if peer_s == peer_s else float("nan")
        ours = wl["flops"] / best / 1e9 if best_c else 0.0
        rows.append((wl["name"], len(wl["candidates"]), errors, ours, peer_gf, best_c["sketch"] if best_c else "-"))
    print()
    print(f"{'workload':>22} {'cands':>5} {'errs':>4} {'ours GFLOP/s':>13} {'torch GFLOP/s':>14} {'ratio':>6}  best sketch")
    for name, n, e, ours, peer, sk in rows:
        ratio = ours / peer if peer == peer and peer > 0 else float("nan")
        print(f"{name:>22} {n:>5} {e:>4} {ours:>13.1f} {peer:>14.1f} {ratio:>6.2f}  {sk}")
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
