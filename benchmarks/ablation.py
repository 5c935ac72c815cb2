"""Ablation table: the evolutionary search with each part switched off by one flag.

For each workload (GEMM NxNxN f32, default N = 1024, and the ResNet 3x3
convolution 1x56x56x64 -> 64, NHWC, input padded to 1x58x58x64), each
variant and each seed, runs the command line a user would:

  mlir-ansor tune W.mlir --search evolutionary --trials T --seed S --json [FLAGS]

with FLAGS one of (docs/extending.md, "Ablations"):

  full               (none)
  no cost model      --no-cost-model            evolution ranks at random
  no crossover       --no-crossover             mutations only
  no packing         --no-packing               the pack alternative held at "in place"
  round-robin tasks  --task-scheduler round-robin
  random tasks       --random-task-scheduler
  no default point   --no-default-candidate   the rule's default knobs not measured first
  shared best        --share-best               tasks with the same knobs seed each other (an addition, off by default)

and prints, per workload, the median (over seeds) best GFLOP/s of each
variant as found in the search, the same best record re-timed in a fresh
process (`mlir-ansor replay`), its ratio to the full search (re-timed), the
untuned GFLOP/s and the tuning time. Run it on an otherwise idle machine:
variants that measure the same candidates (the first `min_train` trials of
the evolutionary search are random) differ only by timing noise. Each run is its own process with its own database, so no variant
profits from another's records. Both workloads are single tasks, so the two
task-scheduler rows and "shared best" equal the full search up to timing
noise: they are there so the same loop serves multi-task models (`--input`).

Usage:
  python benchmarks/ablation.py                                   # full: GEMM 1024 + conv, 200 trials, 3 seeds
  python benchmarks/ablation.py --gemm-size 256 --trials 16 --seeds 0 --workloads gemm   # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mlir_ansor.examples import workloads as wl

VARIANTS: list[tuple[str, list[str]]] = [
    ("full", []),
    ("no cost model", ["--no-cost-model"]),
    ("no crossover", ["--no-crossover"]),
    ("no packing", ["--no-packing"]),
    ("round-robin tasks", ["--task-scheduler", "round-robin"]),
    ("random tasks", ["--random-task-scheduler"]),
    ("no default candidate", ["--no-default-candidate"]),
    ("shared best", ["--share-best"]),
]


def run_variant(path: str, flags: list[str], args: argparse.Namespace, seed: int, workdir: str, tag: str) -> dict:
    db = os.path.join(workdir, f"{tag}.db")
    cmd = [
        sys.executable, "-m", "mlir_ansor.tools.cli", "tune", path, "--search", "evolutionary",
        "--trials", str(args.trials), "--seed", str(seed), "--threads", str(args.threads),
        "--batch-size", str(args.batch_size), "--db", db, "--json", "--progress", "none", *flags,
    ]
    log = os.path.join(workdir, f"{tag}.log")
    print(f"  {' '.join(['mlir-ansor', 'tune', os.path.basename(path)] + cmd[5:9] + flags)} (seed {seed})",
          file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = Path(log).read_text().strip().splitlines()[-5:]
        raise SystemExit(f"{tag} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    data = json.loads(proc.stdout)
    (task,) = data["tasks"]
    # Re-time the best record in a fresh process (in-search timings run on a
    # machine busy building the next batch).
    rp = subprocess.run([sys.executable, "-m", "mlir_ansor.tools.cli", "replay", db, "--json"],
                        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    retimed = 0.0
    if rp.returncode == 0:
        rows = json.loads(rp.stdout)["rows"]
        if rows and rows[0]["new_latency_s"]:
            retimed = task["flops"] / rows[0]["new_latency_s"] / 1e9
    return {"gflops": task["gflops"], "retimed_gflops": retimed, "baseline_gflops": task["baseline_gflops"],
            "wall_s": wall, "trials": task["trials"], "knobs": task["best_knobs"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", default="gemm,conv", help="comma-separated: gemm, conv")
    p.add_argument("--gemm-size", type=int, default=1024)
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--variants", default=None, help="comma-separated subset of the variant names")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    variants = VARIANTS
    if args.variants:
        wanted = {v.strip() for v in args.variants.split(",")}
        variants = [v for v in VARIANTS if v[0] in wanted]
    workdir = tempfile.mkdtemp(prefix="mlir-ansor-ablation-")
    workloads = []
    for w in args.workloads.split(","):
        w = w.strip()
        if w == "gemm":
            workloads.append((f"GEMM {args.gemm_size}", wl.matmul(args.gemm_size, args.gemm_size, args.gemm_size)))
        elif w == "conv":
            workloads.append(("ResNet conv 3x3 56x56x64", wl.conv2d_nhwc(1, 58, 58, 64, 64, 3, 3)))
        else:
            raise SystemExit(f"unknown workload {w!r}: expected gemm or conv")
    tables = []
    for name, text in workloads:
        path = os.path.join(workdir, name.split()[0].lower() + ".mlir")
        Path(path).write_text(text)
        print(f"{name}:", file=sys.stderr)
        rows = []
        for vname, flags in variants:
            runs = [run_variant(path, flags, args, s, workdir, f"{name.split()[0]}-{vname.replace(' ', '_')}-{s}")
                    for s in seeds]
            rows.append((vname, flags, runs))
        tables.append((name, rows))

    print(f"\nablation: evolutionary search, {args.trials} trials, {args.threads} thread(s), "
          f"seeds {','.join(map(str, seeds))} (median over seeds)")
    for name, rows in tables:
        full = statistics.median(r["retimed_gflops"] for r in rows[0][2]) if rows and rows[0][0] == "full" else None
        print(f"\n{name}")
        header = (f"{'variant':<18} {'flags':<30} {'search':>8} {'re-timed':>8} {'vs full':>8} {'untuned':>8} "
                  f"{'time':>7}  best pack")
        print(header)
        print("-" * len(header))
        for vname, flags, runs in rows:
            g = statistics.median(r["gflops"] for r in runs)
            rt = statistics.median(r["retimed_gflops"] for r in runs)
            base = statistics.median(r["baseline_gflops"] for r in runs)
            wall = statistics.median(r["wall_s"] for r in runs)
            ratio = f"{rt / full:.2f}x" if full else "-"
            packs = ",".join(str(r["knobs"].get("pack", "-")) for r in runs)
            print(f"{vname:<18} {' '.join(flags) or '-':<30} {g:>8.1f} {rt:>8.1f} {ratio:>8} {base:>8.2f} "
                  f"{wall:>6.0f}s  {packs}")
    print(f"\n(GFLOP/s of the best record: found in the search / re-timed by `mlir-ansor replay`; "
          f"pack 0 = packed, 1 = in place; records and logs in {workdir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
