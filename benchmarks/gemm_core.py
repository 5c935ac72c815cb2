"""The core-loop benchmark: GEMM 1024x1024x1024 f32 on the CPU.

Runs `mlir-ansor tune --trials N --threads T --json` as a user would (one
process per thread count), re-times the best schedule in a fresh process
(in-search timings run hot), and measures numpy/OpenBLAS at the same thread
count in the same run, each in its own process with the BLAS thread count
pinned. Prints every figure and the ratios the core-loop issue asks for:

  tuned (1 thread) / numpy (1 thread)       target >= 0.50
  tuned (1 thread) / untuned lowering       target >= 5
  tuned (2 threads) / tuned (1 thread)      target >= 1.7
  candidates built and measured per second  target >= 3 per core

Usage: python benchmarks/gemm_core.py [--trials 64] [--size 1024] [--threads 1,2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from mlir_ansor.examples import workloads

NUMPY_TIMER = """
import json, sys, time, statistics
import numpy as np
n = int(sys.argv[1])
rng = np.random.default_rng(0)
a = rng.uniform(-1, 1, (n, n)).astype(np.float32)
b = rng.uniform(-1, 1, (n, n)).astype(np.float32)
for _ in range(3):
    a @ b
ts = []
t_end = time.perf_counter() + 1.0
while len(ts) < 10 or time.perf_counter() < t_end:
    t0 = time.perf_counter(); a @ b; ts.append(time.perf_counter() - t0)
print(json.dumps({"median_s": statistics.median(ts)}))
"""

RETIMER = """
import json, sys, statistics
from mlir_ansor.measure.builder import build
from mlir_ansor.measure.runner import Kernel, TimingPolicy, random_inputs, time_callable
import numpy as np
payload, script, threads, so, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
build(open(payload).read(), open(script).read(), threads, so)
a, b = random_inputs([((n, n), "f32"), ((n, n), "f32")], 1)
c = np.empty((n, n), np.float32)
k = Kernel(so)
call = k.bind([a, b, c])
call()
err = float(np.max(np.abs(c - a @ b)) / np.max(np.abs(a @ b)))
costs = time_callable(call, TimingPolicy(warmup=2, min_repeat=10, max_repeat=200, min_time_s=1.0))
print(json.dumps({"median_s": statistics.median(costs), "rel_err": err}))
"""


def numpy_time(n: int, threads: int) -> float:
    env = dict(os.environ)
    # Pin BLAS threads; unset the core-type override together with the L2
    # size (see the env notes: they slow a current OpenBLAS down).
    env.pop("OPENBLAS_CORETYPE", None)
    env.pop("OPENBLAS_L2_SIZE", None)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    out = subprocess.run([sys.executable, "-c", NUMPY_TIMER, str(n)], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["median_s"]


def tune(input_path: str, trials: int, threads: int, db: str, seed: int) -> dict:
    exe = Path(sys.executable).parent / "mlir-ansor"
    cmd = [str(exe), "tune", input_path, "--trials", str(trials), "--threads", str(threads), "--db", db, "--seed", str(seed), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"tuning failed:\n{proc.stderr}")
    return json.loads(proc.stdout)


def retime_best(result: dict, threads: int, workdir: str, n: int) -> dict:
    """Rebuild the best schedule in a fresh process and time it there."""
    from mlir_ansor.graph.task import extract_tasks
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.target import Target

    (task_json,) = result["tasks"]
    (task,) = extract_tasks(os.path.join(workdir, "gemm.mlir"))
    sk = next(s for s in generate_sketches(task.mlir, Target.host()) if s.name == task_json["best_sketch"])
    script = sk.concrete(tuple(sorted(task_json["best_knobs"].items())))
    p_payload = os.path.join(workdir, f"payload{threads}.mlir")
    p_script = os.path.join(workdir, f"best{threads}.mlir")
    Path(p_payload).write_text(sk.payload)
    Path(p_script).write_text(script)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    so = os.path.join(workdir, f"best{threads}.so")
    out = subprocess.run(
        [sys.executable, "-c", RETIMER, p_payload, p_script, str(threads), so, str(n)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=1024)
    ap.add_argument("--trials", type=int, default=64)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    n = args.size
    flops = 2 * n**3
    gf = lambda s: flops / s / 1e9  # noqa: E731
    thread_counts = [int(t) for t in args.threads.split(",")]
    rows = {}
    with tempfile.TemporaryDirectory(prefix="gemm-bench-") as wd:
        Path(wd, "gemm.mlir").write_text(workloads.matmul(n, n, n))
        for t in thread_counts:
            res = tune(os.path.join(wd, "gemm.mlir"), args.trials, t, os.path.join(wd, f"t{t}.db"), args.seed)
            task = res["tasks"][0]
            re = retime_best(res, t, wd, n)
            np_s = numpy_time(n, t)
            rows[t] = {
                "tuned_search_s": task["best_latency_s"],
                "tuned_s": re["median_s"],
                "rel_err": re["rel_err"],
                "untuned_s": task["baseline_latency_s"],
                "numpy_s": np_s,
                "tuning_time_s": res["tuning_time_s"],
                "trials": res["trials"],
                "cand_per_s": res["candidates_per_s"],
                "knobs": task["best_knobs"],
            }
    print(f"\nGEMM {n}x{n}x{n} f32, {args.trials} trials, seed {args.seed}, host {os.uname().nodename}")
    hdr = (
        f"{'threads':>7} {'tuned GF/s':>10} {'(in search)':>11} {'numpy GF/s':>10} {'untuned GF/s':>12} "
        f"{'tuned/numpy':>11} {'tuned/untuned':>13} {'cand/s':>7} {'cand/s/core':>11} {'tune time':>9}"
    )
    print(hdr)
    print("-" * len(hdr))
    cores = os.cpu_count() or 1
    for t, r in rows.items():
        print(
            f"{t:>7} {gf(r['tuned_s']):>10.1f} {gf(r['tuned_search_s']):>11.1f} {gf(r['numpy_s']):>10.1f} "
            f"{gf(r['untuned_s']):>12.2f} {r['numpy_s'] / r['tuned_s']:>11.2f} {r['untuned_s'] / r['tuned_s']:>13.1f} "
            f"{r['cand_per_s']:>7.2f} {r['cand_per_s'] / cores:>11.2f} {r['tuning_time_s']:>8.0f}s"
        )
    for t, r in rows.items():
        print(f"best schedule, {t} thread(s): {r['knobs']} (re-timed, max rel. error {r['rel_err']:.1e})")
    if 1 in rows:
        r1 = rows[1]
        print("\ntargets:")
        print(f"  tuned(1) / numpy(1)   = {r1['numpy_s'] / r1['tuned_s']:.2f}  (target >= 0.50)")
        print(f"  tuned(1) / untuned    = {r1['untuned_s'] / r1['tuned_s']:.1f}  (target >= 5)")
        if 2 in rows:
            print(f"  tuned(2) / tuned(1)   = {r1['tuned_s'] / rows[2]['tuned_s']:.2f}  (target >= 1.7)")
        print(f"  candidates/s per core = {r1['cand_per_s'] / cores:.2f}  (target >= 3)")


if __name__ == "__main__":
    main()
