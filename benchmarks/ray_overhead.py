"""Ray executor overhead: candidates built and measured per minute through a
local Ray instance against the local process pool, on this machine.

Both executors tune the same task with the same trials, seed and settings
(random search, so both draw the same candidates), each into its own fresh
database; runs alternate (local, Ray, local, Ray, ...) so that drift in the
machine's load hits both. The figure is the tuner's own search throughput
(`TuneResult.candidates_per_s`: builds and measurements, after the one-time
reference of the task), plus the wall time of the whole `tune` call. Ray's
start (`ray.init`, once) is reported apart. The target is a Ray overhead of
at most 20% (Ray / local >= 0.8).

The Ray instance gets this machine's CPUs (`ray.init(num_cpus=...)`), so
builds and the runner share the same cores as the local pool's: one core is
reserved for measurement, the others build.

Usage:
  python benchmarks/ray_overhead.py                      # 256^3 f32 matmul, 48 trials, 2 rounds
  python benchmarks/ray_overhead.py --size 128 --trials 32 --rounds 3
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

from mlir_ansor import TuneConfig, tune
from mlir_ansor.examples import workloads as wl
from mlir_ansor.measure.ray_executor import LOCAL_RAY_CONFIG
from mlir_ansor.measure.runner import TimingPolicy
from mlir_ansor.records import Database


def run_once(path: str, executor: str, args: argparse.Namespace, workdir: str, tag: str) -> dict:
    db = os.path.join(workdir, f"{tag}.db")
    config = TuneConfig(
        trials=args.trials,
        batch_size=args.batch_size,
        seed=args.seed,
        threads=args.threads,
        executor=executor,
        timing=TimingPolicy(warmup=1, min_repeat=3, max_repeat=20, min_time_s=0.01),
    )
    t0 = time.perf_counter()
    result = tune(path, config=config, db=db)
    wall = time.perf_counter() - t0
    with Database(db) as d:
        recs = d.records()
    (task,) = result.tasks
    return {
        "cand_per_min": result.candidates_per_s * 60.0,
        "wall_per_min": result.measured / wall * 60.0,
        "wall_s": wall,
        "measured": result.measured,
        "records": len(recs),
        "keys": sorted((r.sketch_hash, r.knobs) for r in recs),
        "gflops": task.gflops,
        "errors": sum(task.errors.values()),
        "hosts": sorted({r.host for r in recs}),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=256, help="the matmul's M = N = K")
    ap.add_argument("--trials", type=int, default=48)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each executor, alternating")
    ap.add_argument("--cpus", type=int, default=os.cpu_count() or 1, help="CPUs given to the Ray instance")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    import ray

    workdir = tempfile.mkdtemp(prefix="ray-overhead-")
    path = os.path.join(workdir, "matmul.mlir")
    with open(path, "w") as f:
        f.write(wl.matmul(args.size, args.size, args.size))

    t0 = time.perf_counter()
    ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, _system_config=LOCAL_RAY_CONFIG)
    ray_start = time.perf_counter() - t0
    print(f"ray.init: {ray_start:.1f} s ({args.cpus} CPUs); matmul {args.size}^3 f32, {args.trials} trials, "
          f"batch {args.batch_size}, seed {args.seed}, {args.threads} thread(s)", file=sys.stderr)

    runs: dict[str, list[dict]] = {"local": [], "ray": []}
    try:
        for rnd in range(args.rounds):
            for name, spec in (("local", "local"), ("ray", "auto")):
                r = run_once(path, spec, args, workdir, f"{name}{rnd}")
                runs[name].append(r)
                print(f"  round {rnd + 1} {name:>5}: {r['cand_per_min']:.1f} candidates/min (search), "
                      f"{r['wall_per_min']:.1f}/min (whole tune, {r['wall_s']:.1f} s), best {r['gflops']:.1f} GFLOP/s",
                      file=sys.stderr, flush=True)
    finally:
        ray.shutdown()

    loc = statistics.median(r["cand_per_min"] for r in runs["local"])
    loc_wall = statistics.median(r["wall_per_min"] for r in runs["local"])
    same = all(r["keys"] == runs["local"][0]["keys"] for rs in runs.values() for r in rs)
    complete = all(r["records"] == r["measured"] == args.trials for rs in runs.values() for r in rs)
    print()
    print(f"matmul {args.size}^3 f32, {args.trials} trials, batch {args.batch_size}, seed {args.seed}, "
          f"{args.threads} thread(s), {os.cpu_count()} cores (median of {args.rounds} alternating runs; "
          f"the machine may be shared: compare the ratios)")
    header = (f"{'executor':<14} {'cand/min (search)':>18} {'ratio':>7} {'cand/min (whole tune)':>22} {'ratio':>7} "
              f"{'best GFLOP/s':>13} {'errors':>7}")
    print(header)
    print("-" * len(header))
    for name, label in (("local", "local pool"), ("ray", "Ray (local)")):
        cpm = statistics.median(r["cand_per_min"] for r in runs[name])
        wpm = statistics.median(r["wall_per_min"] for r in runs[name])
        gf = statistics.median(r["gflops"] for r in runs[name])
        errs = sum(r["errors"] for r in runs[name])
        print(f"{label:<14} {cpm:>18.1f} {cpm / loc:>7.2f} {wpm:>22.1f} {wpm / loc_wall:>7.2f} {gf:>13.1f} {errs:>7}")
    ray_cpm = statistics.median(r["cand_per_min"] for r in runs["ray"])
    overhead = 1.0 - ray_cpm / loc
    print(f"Ray overhead on search throughput: {overhead * 100:.1f}% (target: at most 20%); "
          f"ray.init once: {ray_start:.1f} s")
    print(f"same candidates measured by both: {'yes' if same else 'NO'}; every trial recorded: "
          f"{'yes' if complete else 'NO'}; hosts in records: {sorted({h for rs in runs.values() for r in rs for h in r['hosts']})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
