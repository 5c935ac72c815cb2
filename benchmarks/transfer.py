"""Transfer learning: does a cost model trained on some tasks speed up tuning of others?

The loop a user would run, with the command line:

  1. tune the *source* tasks (matmuls and convolutions of other shapes than
     the targets) with random search, one database:
       mlir-ansor tune SRC.mlir --search random --trials T_SRC --db source.db
  2. export them and train a cost model offline:
       mlir-ansor export-dataset source.db -o dataset/
       mlir-ansor train-model dataset/ -o model.json
  3. tune each *target* task (GEMM 1024 and the ResNet 3x3 convolution
     1x56x56x64 -> 64, by default; neither shape is among the sources) with
     the evolutionary search, cold (its model learns from this task's records
     only, after the first random batch) and warm (`--pretrained-model
     model.json`: it ranks from the first batch), same budget, same seeds.

Prints, per target: the median (over seeds) best-so-far GFLOP/s after a few
trial counts, cold and warm; after how many trials the warm search reached
the cold search's final best; and the zero-shot ranking quality of the
pretrained model on the target's measured records (pairwise accuracy),
against a model trained on the first batch of the target itself (what the
cold search ranks with when it starts ranking).

Usage (the default takes about an hour on an idle 2-core machine):
  python benchmarks/transfer.py
  python benchmarks/transfer.py --source-trials 16 --trials 16 --seeds 0 --targets gemm   # a quick look
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mlir_ansor import load
from mlir_ansor.examples import workloads as wl
from mlir_ansor.graph.task import extract_tasks
from mlir_ansor.records import Database
from mlir_ansor.search.cost_model import XGBModel, pairwise_accuracy
from mlir_ansor.search.features import extractor_for
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.target import Target

# Shapes the model learns from: neither target's shape, both op families.
SOURCES = {
    "matmul_512x768x256": wl.matmul(512, 768, 256),
    "matmul_256x256x2048": wl.matmul(256, 256, 2048),
    "conv_28x28x128_3x3": wl.conv2d_nhwc(1, 30, 30, 128, 128, 3, 3),
    "conv_14x14x256_1x1": wl.conv2d_nhwc(1, 14, 14, 256, 256, 1, 1),
}
TARGETS = {
    "gemm": ("GEMM 1024", wl.matmul(1024, 1024, 1024)),
    "conv": ("ResNet conv 3x3 56x56x64", wl.conv2d_nhwc(1, 58, 58, 64, 64, 3, 3)),
}


def cli(*args: str, log: str) -> str:
    """Run `mlir-ansor ARGS` in a fresh process; its stdout, or exit with the log's tail."""
    cmd = [sys.executable, "-m", "mlir_ansor.tools.cli", *args]
    with open(log, "w") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    if proc.returncode != 0:
        tail = Path(log).read_text().strip().splitlines()[-8:]
        raise SystemExit(f"mlir-ansor {' '.join(args[:2])} failed (exit {proc.returncode}):\n" + "\n".join(tail))
    return proc.stdout


def curve(db_path: str) -> tuple[list[float], str]:
    """Best-so-far GFLOP/s after every measured record (in measuring order)
    of the single task in `db_path`, and that task's workload key."""
    with Database(db_path) as db:
        (w,) = db.workloads()
        recs = db.records(w["workload_key"])
    best, out = math.inf, []
    for r in recs:
        if r.valid:
            best = min(best, r.latency_s)
        out.append(w["flops"] / best / 1e9 if math.isfinite(best) else 0.0)
    return out, w["workload_key"]


def ranking(model_path: str, src: str, dbs: list[str], first: int, seed: int = 0) -> tuple[float, float, int]:
    """Pairwise accuracy on the target's valid records (all runs, duplicates
    dropped) of the pretrained model, and of a model trained on `first`
    records of the target (tested on the rest)."""
    (task,) = extract_tasks(load(text=src))
    sketches = {sk.hash: sk for sk in generate_sketches(task.mlir, Target.host())}
    seen, recs = set(), []
    for path in dbs:
        with Database(path) as db:
            for r in db.records(task.workload_key):
                key = (r.sketch_hash, r.knobs)
                if r.valid and r.sketch_hash in sketches and key not in seen:
                    seen.add(key)
                    recs.append(r)
    if len(recs) <= first + 8:
        return math.nan, math.nan, len(recs)
    random.Random(seed).shuffle(recs)
    feats = [extractor_for(sketches[r.sketch_hash]).features([r.knobs])[0] for r in recs]
    thr = [task.flops / r.latency_s for r in recs]
    warm = XGBModel()
    warm.load(model_path)
    test_f, test_t = feats[first:], thr[first:]
    acc_warm = pairwise_accuracy(warm.predict(test_f), test_t)
    cold = XGBModel()
    cold.update(list(zip(feats[:first], thr[:first])))
    acc_cold = pairwise_accuracy(cold.predict(test_f), test_t) if cold.trained else math.nan
    return acc_warm, acc_cold, len(recs)


def first_reaching(c: list[float], level: float) -> int | None:
    return next((i + 1 for i, g in enumerate(c) if g >= level * (1 - 1e-9)), None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source-trials", type=int, default=64, help="random-search trials per source task")
    ap.add_argument("--trials", type=int, default=100, help="trials per target run")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--targets", default="gemm,conv", help="comma-separated: " + ", ".join(TARGETS))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--workdir", default=None, help="keep databases, dataset and model here (default: a temp dir)")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    wd = args.workdir or tempfile.mkdtemp(prefix="mlir-ansor-transfer-")
    os.makedirs(wd, exist_ok=True)
    common = ["--threads", str(args.threads), "--batch-size", str(args.batch_size), "--progress", "none"]

    # 1-2. Source records, dataset, model.
    t0 = time.perf_counter()
    source_db = os.path.join(wd, "source.db")
    for name, text in SOURCES.items():
        path = os.path.join(wd, f"{name}.mlir")
        Path(path).write_text(text)
        print(f"source {name}: {args.source_trials} trials (random search)", file=sys.stderr, flush=True)
        cli("tune", path, "--search", "random", "--trials", str(args.source_trials), "--seed", "0",
            "--db", source_db, *common, log=os.path.join(wd, f"{name}.log"))
    dataset = os.path.join(wd, "dataset")
    model = os.path.join(wd, "model.json")
    cli("export-dataset", source_db, "-o", dataset, log=os.path.join(wd, "export.log"))
    cli("train-model", dataset, "-o", model, log=os.path.join(wd, "train.log"))
    t_source = time.perf_counter() - t0

    # 3. Targets, cold and warm.
    results = {}
    for tname in args.targets.split(","):
        title, text = TARGETS[tname.strip()]
        path = os.path.join(wd, f"target_{tname}.mlir")
        Path(path).write_text(text)
        runs: dict[str, list[dict]] = {"cold": [], "warm": []}
        for seed in seeds:
            for mode in ("cold", "warm"):
                db = os.path.join(wd, f"{tname}-{mode}-{seed}.db")
                extra = ["--pretrained-model", model] if mode == "warm" else []
                print(f"{title} {mode} seed {seed}: {args.trials} trials", file=sys.stderr, flush=True)
                t1 = time.perf_counter()
                cli("tune", path, "--search", "evolutionary", "--trials", str(args.trials), "--seed", str(seed),
                    "--db", db, *common, *extra, log=os.path.join(wd, f"{tname}-{mode}-{seed}.log"))
                c, _ = curve(db)
                runs[mode].append({"curve": c, "db": db, "time_s": time.perf_counter() - t1})
        acc = ranking(model, text, [r["db"] for rs in runs.values() for r in rs], args.batch_size)
        results[title] = (runs, acc)

    print(f"\ntransfer learning: model trained on {len(SOURCES)} source tasks x {args.source_trials} random trials "
          f"({', '.join(SOURCES)}; {t_source:.0f} s with export and training); targets tuned with the "
          f"evolutionary search, {args.trials} trials, {args.threads} thread(s), seeds {args.seeds}")
    marks = sorted({m for m in (16, 32, 48, 64, 100, 200, args.trials) if m <= args.trials})
    for title, (runs, (acc_warm, acc_cold, n)) in results.items():
        print(f"\n{title}: median best GFLOP/s after N trials")
        hdr = f"{'model':<6} " + " ".join(f"{'N=' + str(m):>8}" for m in marks) + f" {'time':>7}"
        print(hdr)
        print("-" * len(hdr))
        for mode, rs in runs.items():
            vals = [statistics.median(r["curve"][min(m, len(r["curve"])) - 1] if r["curve"] else 0.0 for r in rs)
                    for m in marks]
            t = statistics.median(r["time_s"] for r in rs)
            print(f"{mode:<6} " + " ".join(f"{v:>8.1f}" for v in vals) + f" {t:>6.0f}s")
        reach = [first_reaching(w["curve"], c["curve"][-1]) for w, c in zip(runs["warm"], runs["cold"])]
        med = statistics.median(x if x is not None else math.inf for x in reach)
        print(f"trials for the warm search to reach the cold search's {args.trials}-trial best, per seed: "
              f"{', '.join(str(x) if x else 'never' for x in reach)} (median {med:g})")
        print(f"ranking quality on {n} measured records of the target (pairwise accuracy): pretrained, zero-shot "
              f"{acc_warm:.3f}; trained on the target's first {args.batch_size} records {acc_cold:.3f}")
    print(f"\n(databases, dataset, model and logs in {wd})")
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
