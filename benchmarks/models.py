"""Whole models from PyTorch: ResNet-50 (batch 1, 224x224) and a BERT-base
encoder layer (sequence 128), end to end, against PyTorch CPU eager and the
untuned lowering, measured in the same run, at each thread count.

For every model (`mlir_ansor.examples.models`, seeded random weights, nothing
downloaded): import it with torch-mlir (`mlir_ansor.importers.pytorch`), extract
its tasks (printed with their weights), and for every thread count: tune
with `--trials` candidates in total (the budget is printed), compile the best
records (`mlir_ansor.compile`; tasks without a record get the default
schedule), check the output against PyTorch's and against the untuned
lowering, and time it; time the untuned lowering (`compile_untuned`: the
whole module lowered as it is) and PyTorch eager (`torch.set_num_threads`,
`torch.no_grad`) in the same process right after. One table at the end:
latencies and ratios (>1 means mlir-ansor is faster).

Usage:
  python benchmarks/models.py [--models resnet50,bert_layer] [--threads 1,2] [--trials 96]
                              [--batch-size 2] [--no-untuned] [--keep DIR]
Needs the 'torch' extra (torch and torch-mlir).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import median_time  # noqa: E402

import mlir_ansor  # noqa: E402
from mlir_ansor import TuneConfig  # noqa: E402
from mlir_ansor.compiler import compile_untuned  # noqa: E402


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,bert_layer")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--trials", type=int, default=96, help="trials per model and thread count (whole budget)")
    ap.add_argument(
        "--batch-size", type=int, default=2,
        help="candidates per batch; the warm-up gives every task one batch, so keep trials >= tasks x batch size",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-untuned", action="store_true", help="skip timing the untuned lowering (slow on ResNet-50)")
    ap.add_argument("--keep", default=None, help="folder for the MLIR and the databases (default: a temporary one)")
    args = ap.parse_args()

    import torch

    from mlir_ansor.examples import models
    from mlir_ansor.importers.pytorch import import_module

    wd_ctx = tempfile.TemporaryDirectory(prefix="ansor-models-") if args.keep is None else None
    wd = args.keep or wd_ctx.name
    os.makedirs(wd, exist_ok=True)
    rows = []
    print(f"budget: {args.trials} trials per model and thread count, batches of {args.batch_size}", file=sys.stderr, flush=True)
    for name in args.models.split(","):
        model, inputs = models.MODELS[name](args.seed)
        t0 = time.perf_counter()
        text = import_module(model, inputs)
        import_s = time.perf_counter() - t0
        path = os.path.join(wd, f"{name}.mlir")
        with open(path, "w") as f:
            f.write(text)
        t0 = time.perf_counter()
        tasks = mlir_ansor.extract_tasks(mlir_ansor.load(path))
        extract_s = time.perf_counter() - t0
        kinds = Counter(t.kind for t in tasks)
        flops = sum(t.flops * t.weight for t in tasks)
        print(
            f"{name}: imported in {import_s:.1f} s ({len(text) / 1e6:.0f} MB of MLIR); {len(tasks)} distinct tasks, "
            f"{sum(t.weight for t in tasks)} occurrences ({', '.join(f'{k} {v}' for k, v in sorted(kinds.items()))}), "
            f"{flops / 1e9:.2f} GFLOP, extracted in {extract_s:.1f} s",
            file=sys.stderr,
            flush=True,
        )
        for t in tasks:
            print(f"  x{t.weight:<3} {t.kind:<12} {t.flops / 1e6:9.1f} MFLOP  {t.name}", file=sys.stderr)
        x = [i.numpy() for i in inputs]
        with torch.no_grad():
            want = model(*inputs).numpy()
        for threads in (int(s) for s in args.threads.split(",")):
            db = os.path.join(wd, f"{name}_t{threads}.db")
            config = TuneConfig(trials=args.trials, threads=threads, seed=args.seed, batch_size=args.batch_size)
            t0 = time.perf_counter()
            res = mlir_ansor.tune(path, config=config, db=db)
            tune_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            cm = mlir_ansor.compile(path, db=db, threads=threads)
            compile_s = time.perf_counter() - t0
            got = np.asarray(cm(*x))
            err_torch = _rel_err(got, want)
            run, _ = cm.bind(*x)
            ours = median_time(run, min_time=1.0, min_repeat=5)
            untuned = err_untuned = math.nan
            if not args.no_untuned:
                ref = compile_untuned(path, threads=threads)
                err_untuned = _rel_err(got, np.asarray(ref(*x)))
                urun, _ = ref.bind(*x)
                untuned = median_time(urun, min_time=0.5, min_repeat=1, max_repeat=3)
                ref.close()
            torch.set_num_threads(threads)
            with torch.no_grad():
                eager = median_time(lambda m=model, i=inputs: m(*i), min_time=1.0, min_repeat=5)
            sources = Counter(k.source for k in cm.kernels)
            cm.close()
            rows.append((name, threads, ours, untuned, eager, flops, res.measured, tune_s, compile_s, err_torch, err_untuned, sources))
            print(
                f"{name} x{threads}: ours {ours * 1e3:.1f} ms, torch {eager * 1e3:.1f} ms, untuned "
                f"{untuned * 1e3:.1f} ms; tuned {res.measured} trials in {tune_s:.0f} s, compiled in {compile_s:.0f} s; "
                f"kernels {dict(sources)}; rel err vs torch {err_torch:.1e}",
                file=sys.stderr,
                flush=True,
            )
    hdr = (
        f"{'model':<11} {'thr':>3} {'ours ms':>9} {'GF/s':>6} {'torch ms':>9} {'untuned ms':>10} {'vs torch':>8} "
        f"{'vs untuned':>10} {'trials':>6} {'tune s':>6} {'compile s':>9} {'err/torch':>9} {'err/untuned':>11}  kernels"
    )
    print(f"budget: {args.trials} trials per model and thread count; >1 means mlir-ansor is faster")
    print(hdr)
    print("-" * len(hdr))

    def ms(v: float) -> str:
        return f"{v * 1e3:.1f}" if math.isfinite(v) else "-"

    def ratio(peer: float, ours: float) -> str:
        return f"{peer / ours:.2f}" if math.isfinite(peer) else "-"

    for name, threads, ours, untuned, eager, flops, trials, tune_s, compile_s, et, eu, sources in rows:
        kernels = ", ".join(f"{k} {v}" for k, v in sorted(sources.items()))
        print(
            f"{name:<11} {threads:>3} {ms(ours):>9} {flops / ours / 1e9:>6.1f} {ms(eager):>9} {ms(untuned):>10} "
            f"{ratio(eager, ours):>8} {ratio(untuned, ours):>10} {trials:>6} {tune_s:>6.0f} {compile_s:>9.0f} "
            f"{et:>9.1e} {eu:>11.1e}  {kernels}"
        )
    if wd_ctx is not None:
        wd_ctx.cleanup()


if __name__ == "__main__":
    main()
