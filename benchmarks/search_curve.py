"""Search quality: evolutionary search with XGBoost against random search.

For each workload (GEMM 1024 and the ResNet 3x3 convolution 1x56x56x64 ->
64, NHWC, input padded to 1x58x58x64, by default), each strategy and each
seed, runs `mlir_ansor.tune(..., config=TuneConfig(strategy=...))` with the
same trial budget and records the best-so-far GFLOP/s after every trial.
Prints:

  * the feature-extraction rate on the GEMM 1024 sketch (target >= 200
    candidates/s per core), with the one-time template cost apart;
  * a table per workload: median (over seeds) best GFLOP/s at a few trial
    counts, and after how many trials the evolutionary search reached random
    search's final best (target: random's 200-trial best within 80 trials,
    median of the seeds);
  * the cost model's ranking quality: XGBoost trained on half of all valid
    records of a workload (every run), pairwise accuracy on the other half;

and plots best-so-far GFLOP/s against trials (median line, min-max band) to
`--plot` (needs matplotlib: `pip install -e '.[bench]'`).

Usage (the full run takes hours; a small one minutes):
  python benchmarks/search_curve.py --trials 200 --seeds 0,1,2
  python benchmarks/search_curve.py --trials 32 --seeds 0 --workloads gemm512
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import sys
import tempfile
import time

import numpy as np

import mlir_ansor
from mlir_ansor import TuneConfig
from mlir_ansor.examples import workloads
from mlir_ansor.graph.task import extract_tasks
from mlir_ansor.records import Database
from mlir_ansor.search.cost_model import XGBModel, pairwise_accuracy
from mlir_ansor.search.features import FeatureExtractor, extractor_for
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.search.space import sample
from mlir_ansor.target import Target

STRATEGIES = ("evolutionary", "random")


def workload(name: str) -> str:
    if name == "conv":
        return workloads.conv2d_nhwc(1, 58, 58, 64, 64, 3, 3)
    if name.startswith("gemm"):
        return workloads.matmul(*[int(name[4:] or 1024)] * 3)
    raise SystemExit(f"unknown workload {name!r}: expected gemm<N> or conv")


def feature_rate(n: int = 4000) -> None:
    """Candidates per second of feature extraction on the GEMM 1024 sketch."""
    (task,) = extract_tasks(mlir_ansor.load(text=workloads.matmul(1024, 1024, 1024)))
    sk = generate_sketches(task.mlir, Target.host())[0]
    fx = FeatureExtractor(sk, isolate=True)
    rng = random.Random(0)
    pop = [sample(sk.knobs, rng) for _ in range(n)]
    t0 = time.perf_counter()
    for key in sorted({fx.key_of(a) for a in pop}):
        fx.template(key)
    t_templates = time.perf_counter() - t0
    t1 = time.perf_counter()
    feats = fx.features(pop)
    t_eval = time.perf_counter() - t1
    rows = sum(len(f) for f in feats)
    print(f"\nfeature extraction, GEMM 1024 sketch ({len(fx.templates)} templates, {rows / n:.1f} statements/candidate):")
    print(f"  templates (once per sketch, {sum(t.probes for t in fx.templates.values())} probe applications): {t_templates:.2f} s")
    print(f"  {n} candidates: {t_eval:.3f} s = {n / t_eval:,.0f} candidates/s on one core (target >= 200)")
    print(f"  including the one-time templates: {n / (t_eval + t_templates):,.0f} candidates/s")


def run_one(src: str, strategy: str, seed: int, trials: int, threads: int, batch: int, workdir: str) -> dict:
    db = os.path.join(workdir, f"{strategy}-{seed}.db")
    cfg = TuneConfig(trials=trials, threads=threads, seed=seed, strategy=strategy, batch_size=batch)
    t0 = time.perf_counter()
    res = mlir_ansor.tune(mlir_ansor.load(text=src), config=cfg, db=db)
    (task,) = res.tasks
    gf = [task.task.flops / h / 1e9 if math.isfinite(h) else 0.0 for h in task.history]
    return {"curve": gf, "db": db, "task": task.task, "time_s": time.perf_counter() - t0, "errors": dict(task.errors)}


def held_out_accuracy(runs: list[dict], seed: int = 0) -> tuple[float, int]:
    """Train XGBoost on half of all valid records, pairwise accuracy on the rest."""
    task = runs[0]["task"]
    sketches = {sk.hash: sk for sk in generate_sketches(task.mlir, Target.host())}
    recs = []
    for r in runs:
        with Database(r["db"]) as db:
            recs += [x for x in db.records(task.workload_key) if x.valid and x.sketch_hash in sketches]
    seen = set()
    uniq = []
    for x in recs:
        key = (x.sketch_hash, tuple(x.knobs))
        if key not in seen:
            seen.add(key)
            uniq.append(x)
    if len(uniq) < 16:
        return float("nan"), len(uniq)
    random.Random(seed).shuffle(uniq)
    feats = []
    for x in uniq:
        (f,) = extractor_for(sketches[x.sketch_hash]).features([tuple(x.knobs)])
        feats.append(f)
    thr = [task.flops / x.latency_s for x in uniq]
    half = len(uniq) // 2
    model = XGBModel()
    model.update(list(zip(feats[:half], thr[:half])))
    return pairwise_accuracy(model.predict(feats[half:]), thr[half:]), len(uniq)


def first_reaching(curve: list[float], level: float) -> int | None:
    for i, g in enumerate(curve):
        if g >= level * (1 - 1e-9):
            return i + 1
    return None


def report(name: str, runs: dict[str, list[dict]], trials: int) -> None:
    marks = [t for t in (16, 32, 80, 128, 200, trials) if t <= trials]
    marks = sorted(set(marks))
    print(f"\n{name}: median best GFLOP/s over {len(runs['random'])} seed(s) after N trials")
    hdr = f"{'strategy':>13} " + " ".join(f"{'N=' + str(m):>8}" for m in marks) + f" {'time':>7} errors"
    print(hdr)
    print("-" * len(hdr))
    for strat, rs in runs.items():
        vals = []
        for m in marks:
            at = [r["curve"][min(m, len(r["curve"])) - 1] if r["curve"] else 0.0 for r in rs]
            vals.append(float(np.median(at)))
        errs = {}
        for r in rs:
            for k, v in r["errors"].items():
                errs[k] = errs.get(k, 0) + v
        t = float(np.median([r["time_s"] for r in rs]))
        print(f"{strat:>13} " + " ".join(f"{v:>8.1f}" for v in vals) + f" {t:>6.0f}s {errs or ''}")
    reach = []
    for e, r in zip(runs["evolutionary"], runs["random"]):
        target = r["curve"][-1] if r["curve"] else math.inf
        reach.append(first_reaching(e["curve"], target))
    shown = [str(x) if x is not None else "never" for x in reach]
    finite = [x if x is not None else math.inf for x in reach]
    med = float(np.median(finite))
    print(
        f"trials for evolutionary to reach random's {trials}-trial best, per seed: {', '.join(shown)}"
        f" (median {med:g}; target <= 80 at 200 trials)"
    )


def plot(results: dict[str, dict[str, list[dict]]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no plot: matplotlib is not installed; pip install -e '.[bench]')", file=sys.stderr)
        return
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4), squeeze=False)
    for ax, (name, runs) in zip(axes[0], results.items()):
        for strat, rs in runs.items():
            n = min(len(r["curve"]) for r in rs)
            if n == 0:
                continue
            mat = np.array([r["curve"][:n] for r in rs])
            x = np.arange(1, n + 1)
            ax.plot(x, np.median(mat, axis=0), label=f"{strat} (median of {len(rs)})")
            ax.fill_between(x, mat.min(axis=0), mat.max(axis=0), alpha=0.2)
        ax.set_title(name)
        ax.set_xlabel("trials")
        ax.set_ylabel("best GFLOP/s so far")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--workloads", default="gemm1024,conv", help="comma-separated: gemm<N>, conv")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--plot", default="search_curve.png")
    ap.add_argument("--skip-feature-rate", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    seeds = [int(s) for s in args.seeds.split(",")]
    if not args.skip_feature_rate:
        feature_rate()
    results: dict[str, dict[str, list[dict]]] = {}
    with tempfile.TemporaryDirectory(prefix="search-curve-") as wd:
        for name in args.workloads.split(","):
            src = workload(name)
            runs: dict[str, list[dict]] = {s: [] for s in STRATEGIES}
            for seed in seeds:
                for strat in STRATEGIES:
                    sub = os.path.join(wd, name)
                    os.makedirs(sub, exist_ok=True)
                    r = run_one(src, strat, seed, args.trials, args.threads, args.batch_size, sub)
                    runs[strat].append(r)
                    best = r["curve"][-1] if r["curve"] else 0.0
                    print(f"{name} {strat} seed {seed}: best {best:.1f} GFLOP/s in {r['time_s']:.0f} s", file=sys.stderr)
            results[name] = runs
            report(name, runs, args.trials)
            acc, n = held_out_accuracy(runs["evolutionary"] + runs["random"])
            print(f"cost model: pairwise ranking accuracy on held-out records = {acc:.3f} (trained on {n // 2}, tested on {n - n // 2})")
    plot(results, args.plot)


if __name__ == "__main__":
    main()
