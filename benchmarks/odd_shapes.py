"""Shapes whose extents have no good divisors, tuned, against their peers.

Matmuls of 367^3 (prime), 129x257x511 and 1000^3, and convolutions with a
7x7 window or odd channel counts, tuned at one thread; the compiled module is
then re-timed interleaved with its peer in the same process (numpy/OpenBLAS
for matmuls, PyTorch CPU channels-last for convolutions, both limited to one
thread), min of the rounds. Prints GFLOP/s, the ratio to the peer, the
largest relative error against the peer's result, and the build time per
candidate (median and max over the tuning records)::

    python benchmarks/odd_shapes.py [--trials 48] [--only mm367,conv7x7]

Timings on a shared machine are noisy: read the ratios, measured in one run.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

import mlir_ansor
from mlir_ansor import TuneConfig
from mlir_ansor.examples import workloads
from mlir_ansor.records.database import Database

# name -> (module text, flops, kind, shapes for the peer)
CASES = {
    "mm367": (workloads.matmul(367, 367, 367), 2 * 367**3, "matmul"),
    "mm129x257x511": (workloads.matmul(129, 257, 511), 2 * 129 * 257 * 511, "matmul"),
    "mm1000": (workloads.matmul(1000, 1000, 1000), 2 * 1000**3, "matmul"),
    # ResNet's first layer (7x7 window, 3 input channels, stride 2; input
    # padded to 229 so the output is 112x112).
    "conv7x7_c3": (workloads.conv2d_nhwc(1, 229, 229, 3, 64, 7, 7, stride=2), 2 * 112 * 112 * 64 * 7 * 7 * 3, "conv"),
    # 56x56 with odd channel counts.
    "conv56_c13_f37": (workloads.conv2d_nhwc(1, 58, 58, 13, 37, 3, 3), 2 * 56 * 56 * 37 * 9 * 13, "conv"),
    # 7x7 images (ResNet's last stage), 35 -> 19 channels.
    "conv7_c35_f19": (workloads.conv2d_nhwc(1, 9, 9, 35, 19, 3, 3), 2 * 7 * 7 * 19 * 9 * 35, "conv"),
}


def _peer(kind: str, args: list[np.ndarray], stride: int):
    if kind == "matmul":
        a, b = args
        return lambda: a @ b
    import torch

    torch.set_num_threads(1)
    x = torch.from_numpy(args[0]).permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
    w = torch.from_numpy(args[1]).permute(3, 2, 0, 1).contiguous()
    conv = torch.nn.functional.conv2d

    def run():
        with torch.no_grad():
            return conv(x, w, stride=stride).permute(0, 2, 3, 1).numpy()

    return run


def bench(name: str, trials: int, rounds: int) -> dict:
    text, flops, kind = CASES[name]
    work = Path(tempfile.mkdtemp(prefix="odd_"))
    path = work / f"{name}.mlir"
    path.write_text(text)
    db = work / "t.db"
    t0 = time.time()
    mlir_ansor.tune(str(path), config=TuneConfig(trials=trials, threads=1), db=db)
    tune_s = time.time() - t0
    builds = [r.build_s for r in Database(db).records() if r.build_s > 0]
    compiled = mlir_ansor.compile(str(path), db=db, threads=1)
    rng = np.random.default_rng(0)
    args = [rng.standard_normal(shape).astype(np.float32) for shape, _ in compiled.functions[compiled.entry][0]]
    run, (out,) = compiled.bind(*args)
    peer = _peer(kind, args, 2 if name == "conv7x7_c3" else 1)
    run()
    ref = peer()
    err = float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))
    ours, theirs = [], []
    with threadpool_limits(1):
        for _ in range(rounds):
            t = time.perf_counter()
            run()
            ours.append(time.perf_counter() - t)
            t = time.perf_counter()
            peer()
            theirs.append(time.perf_counter() - t)
    return {
        "name": name,
        "ours": flops / min(ours) / 1e9,
        "peer": flops / min(theirs) / 1e9,
        "peer_name": "numpy" if kind == "matmul" else "torch",
        "err": err,
        "build_med": statistics.median(builds) if builds else float("nan"),
        "build_max": max(builds) if builds else float("nan"),
        "tune_s": tune_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--only", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    args = ap.parse_args()
    rows = [bench(n, args.trials, args.rounds) for n in args.only.split(",")]
    print(f"\n1 thread, {args.trials} trials each; GFLOP/s are best of {args.rounds} interleaved runs")
    print(f"{'workload':16s} {'ours':>8s} {'peer':>8s} {'':6s} {'ours/peer':>9s} {'rel.err':>8s} {'build s med/max':>16s} {'tune s':>7s}")
    for r in rows:
        print(
            f"{r['name']:16s} {r['ours']:8.1f} {r['peer']:8.1f} {r['peer_name']:6s} {r['ours'] / r['peer']:9.2f} "
            f"{r['err']:8.1e} {r['build_med']:7.2f}/{r['build_max']:<8.2f} {r['tune_s']:7.0f}"
        )


if __name__ == "__main__":
    main()
