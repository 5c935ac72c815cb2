"""Time prebuilt GPU candidates against PyTorch (cuBLAS/cuDNN) on a GPU host.

Needs numpy, torch (CUDA) and cuda-python (or pycuda); no MLIR and nothing
of mlir_ansor installed: the runner module is loaded by its path. Input: a
folder written by `benchmarks/gpu_build.py` (cubins + manifest.json).

    python3 benchmarks/gpu_bench.py benchmarks/gpu_artifacts [--budget-s 360] [--json out.json]

For each workload: seeded inputs, the reference and the peer's timing from
torch on the same GPU (f32 without TF32; f16 with f32 accumulation as cuBLAS
does), then every candidate is checked against that reference and timed with
CUDA events; the best one is the tuned result ("random search over the
prebuilt set"). Prints a table of GFLOP/s and the ratio to torch.
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


def torch_peer(wl: dict, inputs: list[np.ndarray], repeat: int = 20):
    """(reference output as numpy, median seconds) from torch on the GPU."""
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
    # The reference in f32 (for f16 inputs: what an f32 accumulation gives).
    if wl["dtype"] == "f16":
        ref = (a.float() @ b.float()) if wl["kind"] == "matmul" else out.float()
    else:
        ref = out
    return ref.contiguous().cpu().numpy(), float(np.median(costs))


def tolerance(wl: dict, sketch: str) -> float:
    if wl["dtype"] == "f16":
        return 5e-2  # f16 accumulation over K = 4096 (mma.sync f16.f16.f16.f16)
    if sketch == "cuda-mma":
        return 2e-2  # tf32 inputs
    return 1e-4 * max(1, (wl.get("mnk") or [0, 0, 576])[2] // 256)


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
        try:
            ref, peer_s = torch_peer(wl, inputs)
        except Exception as e:  # noqa: BLE001 - report and go on without the peer
            print(f"{wl['name']}: torch failed: {e}")
            ref, peer_s = None, float("nan")
        best, best_c, errors = float("inf"), None, 0
        for c in wl["candidates"]:
            if time.perf_counter() - t0 > args.budget_s:
                print(f"{wl['name']}: time budget spent, {c['sketch']} {c['knobs']} not timed")
                continue
            r = runner.run(backend, c, folder, inputs, [ref] if ref is not None else None, tolerance(wl, c["sketch"]))
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
