"""The torch.compile backend on whole models: ResNet-50 (batch 1, 224x224)
and a BERT-base encoder layer (sequence 128), `torch.compile(model,
backend=mlir_ansor.torch_backend(db=...))` against PyTorch eager and
`torch.compile`'s own Inductor backend, timed in turns in one process.

For every model (`mlir_ansor.examples.models`, seeded random weights): with
`--trials N`, tune the database first (the model imported by
`importers.pytorch`, as `mlir-ansor tune` would: the backend's graphs have the
same tasks, so it finds those records by workload key); then compile with
each system, check our output against eager's, and time all three in turns
(`timing.interleaved_medians`). One table at the end: latencies, ratios
(>1: the backend is faster), how many of the backend's kernels had a tuned
record, and compile times (the first call).

Usage:
  python benchmarks/torch_backend.py [--models bert_layer,resnet50] [--threads 1] [--trials 0]
                                     [--db-dir DIR] [--inductor-mode default|max-autotune-no-cudagraphs]
Needs the 'torch' extra (torch and torch-mlir).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import interleaved_medians  # noqa: E402

import mlir_ansor  # noqa: E402
from mlir_ansor.tools import torch_backend as tb  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="bert_layer,resnet50")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--trials", type=int, default=0, help="tune each model's database to this many records first")
    ap.add_argument("--db-dir", default=".", help="where the databases <model>.db are (kept between runs)")
    ap.add_argument("--inductor-mode", default="default", help="torch.compile's mode for Inductor")
    args = ap.parse_args()

    import torch

    from mlir_ansor.examples import models
    from mlir_ansor.importers.pytorch import import_module

    torch.set_num_threads(args.threads)
    os.makedirs(args.db_dir, exist_ok=True)
    rows = []
    for name in args.models.split(","):
        model, inputs = getattr(models, name)()
        model.eval()
        db = os.path.join(args.db_dir, f"{name}.db")
        if args.trials:
            program = mlir_ansor.load(text=import_module(model, inputs))
            t0 = time.perf_counter()
            mlir_ansor.tune(program, db=db, config=mlir_ansor.TuneConfig(trials=args.trials, threads=args.threads))
            print(f"{name}: tuned {args.trials} trials in {time.perf_counter() - t0:.0f} s", flush=True)
        tb.clear_cache()
        torch._dynamo.reset()
        ours = torch.compile(model, backend=mlir_ansor.torch_backend(db=db, threads=args.threads))
        inductor = torch.compile(model, mode=None if args.inductor_mode == "default" else args.inductor_mode)
        with torch.no_grad():
            want = model(*inputs)
            t0 = time.perf_counter()
            got = ours(*inputs)
            ours_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            inductor(*inputs)
            inductor_s = time.perf_counter() - t0
            err = float(np.max(np.abs(got.numpy() - want.numpy())) / (np.max(np.abs(want.numpy())) + 1e-30))
            sources = Counter(k.source for cm in tb.compiled_graphs() for k in cm.kernels)
            times = interleaved_medians({
                "eager": lambda m=model, i=inputs: m(*i),
                "inductor": lambda c=inductor, i=inputs: c(*i),
                "mlir_ansor": lambda c=ours, i=inputs: c(*i),
            })
        rows.append((name, times, err, sources, ours_s, inductor_s, tb.stats.fallbacks))
        print(f"{name}: eager {times['eager'] * 1e3:.2f} ms, inductor {times['inductor'] * 1e3:.2f} ms, "
              f"mlir_ansor {times['mlir_ansor'] * 1e3:.2f} ms (rel. error {err:.1e})", flush=True)

    print(f"\n{args.threads} thread(s); ratios > 1: the mlir_ansor backend is faster")
    header = (f"{'model':<12} {'rel. err':>8} {'eager ms':>9} {'inductor':>9} {'ours ms':>9} {'vs eager':>9} {'vs ind.':>8} "
              f"{'kernels (tuned/default/naive)':>30} {'eager graphs':>12} {'compile s (ours/ind.)':>22}")
    print(header)
    print("-" * len(header))
    for name, t, err, src, ours_s, ind_s, fallbacks in rows:
        kernels = f"{src.get('tuned', 0)}/{src.get('default', 0)}/{src.get('naive', 0)}"
        print(f"{name:<12} {err:>8.1e} {t['eager'] * 1e3:>9.2f} {t['inductor'] * 1e3:>9.2f} {t['mlir_ansor'] * 1e3:>9.2f} "
              f"{t['eager'] / t['mlir_ansor']:>8.2f}x {t['inductor'] / t['mlir_ansor']:>7.2f}x {kernels:>30} "
              f"{fallbacks:>12} {ours_s:>11.1f}/{ind_s:<10.1f}")


if __name__ == "__main__":
    main()
