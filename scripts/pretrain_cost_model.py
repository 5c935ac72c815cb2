"""Build the cost model shipped in the package (``--pretrained-model builtin``).

What it does, all seeded so anyone can rebuild it:
  1. tunes the bundled operators (`mlir_ansor.examples.workloads`: matmuls,
     convolutions, depthwise and pooling, reductions, softmax, elementwise
     chains) and, with the 'torch' extra, ResNet-50 and the BERT layer of
     `mlir_ansor.examples.models`, into one database, at 1 thread, with the
     evolutionary search (its records lean to the fast programs a search
     needs told apart, and its first batches are random);
  2. exports the records (`mlir-ansor export-dataset`) and trains XGBoost on
     them, each task's throughputs normalized by its best (`train-model`);
  3. writes the model, gzip-compressed, to
     ``mlir_ansor/search/cost_model/pretrained/cpu_xgb.json.gz`` with what it
     was trained on (host, tasks, records, versions) under "about".

The latencies are this host's: a model trained on one CPU ranks programs on
another by what the two share (vector width, caches), which is why tuning
retrains on the new task's own records from the first batch on.

Usage:
  python scripts/pretrain_cost_model.py [--work DIR] [--scale 1.0] [--no-models] [-o FILE]
(About 20 minutes on an idle 2-core machine at --scale 1; run nothing beside it.)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import mlir_ansor  # noqa: E402
from mlir_ansor import TuneConfig  # noqa: E402
from mlir_ansor.examples import workloads as wl  # noqa: E402
from mlir_ansor.search.registry import builtin_model_path  # noqa: E402

# (name, MLIR, trials at --scale 1): the operator families a model is made
# of, at shapes other than the models' own where that is cheap.
OPERATORS = [
    ("matmul_256x512x384", wl.matmul(256, 512, 384), 48),
    ("matmul_1024x1024x1024", wl.matmul(1024, 1024, 1024), 48),
    ("matmul_64x3072x768", wl.matmul(64, 3072, 768), 40),
    ("batch_matmul_12x128x64x128", wl.batch_matmul(12, 128, 64, 128), 32),
    ("matmul_tb_128x768x768", wl.matmul_transposed_b(128, 768, 768), 32),
    ("conv_28x28x128_3x3", wl.conv2d_nhwc(1, 30, 30, 128, 128, 3, 3), 48),
    ("conv_14x14x256_1x1", wl.conv2d_nhwc(1, 14, 14, 256, 256, 1, 1), 40),
    ("conv_56x56x64_s2", wl.conv2d_nhwc(1, 57, 57, 64, 128, 3, 3, stride=2), 32),
    ("conv_bias_relu_28x28x64", wl.conv_bias_relu(1, 28, 28, 64, 64, 3), 32),
    ("depthwise_56x56x64", wl.depthwise_conv2d_nhwc(1, 58, 58, 64, 3, 3), 24),
    ("maxpool_56x56x64", wl.pool2d_nhwc(1, 57, 57, 64, 3, 2), 16),
    ("reduce_512x1024", wl.reduce_last(512, 1024), 16),
    ("softmax_256x512", wl.softmax(256, 512), 16),
    ("add_relu_512x1024", wl.elementwise_add_relu(512, 1024), 16),
]
MODELS = [("resnet50", 256), ("bert_layer", 128)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="pretrain-work", help="folder for the database and the dataset (kept)")
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every trial budget (0.1: a quick look)")
    ap.add_argument("--no-models", action="store_true", help="operators only (no torch needed)")
    ap.add_argument("--seed", type=int, default=1, help="tuning and training seed (benchmarks tune with 0)")
    ap.add_argument("-o", "--output", default=builtin_model_path(), help="default: the built-in model's file")
    args = ap.parse_args()

    from mlir_ansor.search.cost_model import XGBModel
    from mlir_ansor.target import Target
    from mlir_ansor.tools.dataset import export_dataset, load, train_cost_model
    from mlir_ansor.tuner import host_info, package_versions

    os.makedirs(args.work, exist_ok=True)
    db = os.path.join(args.work, "pretrain.db")
    jobs = [(name, mlir_ansor.load(text=text), trials) for name, text, trials in OPERATORS]
    if not args.no_models:
        from mlir_ansor.examples import models
        from mlir_ansor.importers.pytorch import import_module

        for name, trials in MODELS:
            model, inputs = models.MODELS[name](0)
            path = os.path.join(args.work, f"{name}.mlir")
            if not os.path.exists(path):
                with open(path, "w") as f:
                    f.write(import_module(model, inputs))
            jobs.append((name, path, trials))
    t_all = time.perf_counter()
    for name, source, trials in jobs:
        n = max(4, round(trials * args.scale))
        t0 = time.perf_counter()
        res = mlir_ansor.tune(source, config=TuneConfig(trials=n, threads=1, seed=args.seed), db=db)
        print(f"{name}: {res.measured} trials in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    tune_s = time.perf_counter() - t_all

    ds_dir = os.path.join(args.work, "dataset")
    summary = export_dataset(db, ds_dir)
    ds = load(ds_dir)
    model = train_cost_model(ds, XGBModel(seed=args.seed))
    if not model.trained:
        raise SystemExit(f"{ds_dir}: too few valid candidates to train on")
    about = {
        "made_by": "scripts/pretrain_cost_model.py",
        "scale": args.scale,
        "seed": args.seed,
        "tasks": summary.tasks,
        "candidates": summary.candidates,
        "valid": summary.valid,
        "sources": [name for name, _, _ in jobs],
        "tune_s": round(tune_s, 1),
        "host": host_info(),
        "target": Target.host().key,
        "versions": package_versions(),
        "made": time.strftime("%Y-%m-%d"),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    model.save(args.output, about=about)
    print(json.dumps({k: about[k] for k in ("tasks", "candidates", "valid", "tune_s")}), file=sys.stderr)
    print(f"wrote {args.output} ({os.path.getsize(args.output) / 1e3:.0f} kB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
