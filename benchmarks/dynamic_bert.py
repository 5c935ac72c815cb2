"""Dynamic shapes on a model (issue #27): the BERT-base layer of
`mlir_ansor.examples.models` exported with a dynamic sequence length
(``torch.export`` ``Dim``: ``tensor<1x?x768xf32>``), tuned once at a few
lengths, run at each length against PyTorch eager at the same length, in
one run.

- ``ours``: `mlir-ansor`'s tune of the dynamic module at ``--tuned`` lengths
  (``tune --sizes 0.1=16,64,128,384``: their specializations tuned together,
  `--trials` measured candidates in all, each length's search seeded with
  its neighbours' best), compiled as one dynamic module (`mlir_ansor.compile`
  returns a `DynamicModule`, which compiles a length the first time it sees
  it); a length that was not tuned gets its nearest tuned length's
  schedules carried over (`search.transfer`). Kernels are tuned with the
  caches flushed (`TimingPolicy.flush_caches`), as a model runs them.
- ``eager``: the same torch module (same weights) with ``torch.no_grad()``,
  ``torch.set_num_threads(threads)``.
- with ``--torch-compile``, two more, both ``torch.compile(model,
  dynamic=True)``: ``backend``, our backend on the same database
  (``backend=mlir_ansor.torch_backend(db=...)``: dynamo's graph of a
  symbolic length compiled as one dynamic module, its tasks finding the
  tune's records by workload key), and ``inductor``, torch's own.

Each output is checked against torch's first; the systems are timed in
turns (`timing.interleaved_times`); a ratio is the median of the rounds'
ratios (`timing.paired_ratio`). Target: ours >= 1.2x eager at every
length.

Usage:
  .venv/bin/python benchmarks/dynamic_bert.py [--trials 320] [--threads 1]
      [--tuned 16,64,128,384] [--at 16,64,100,128,384] [--torch-compile] [--json out.json] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import interleaved_times, paired_ratio  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _kernel_sources(cm) -> str:
    """How the length's kernels were scheduled: tuned, carried from another length, or default."""
    counts: dict[str, int] = {}
    for k in cm.kernels:
        counts[k.source] = counts.get(k.source, 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=320, help="measured candidates of the tune (all lengths together)")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--tuned", default="16,64,128,384", help="sequence lengths the module is tuned at")
    ap.add_argument("--at", default="16,64,100,128,384", help="sequence lengths to run at")
    ap.add_argument("--no-between", action="store_true",
                    help="tune only the --tuned lengths (tune --no-between), not also the lengths between them")
    ap.add_argument("--flush-caches", choices=("on", "off"), default="on")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--torch-compile", action="store_true",
                    help="also time torch.compile(dynamic=True) with our backend and with Inductor")
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--work-dir")
    args = ap.parse_args()

    import torch

    import mlir_ansor
    from mlir_ansor import TuneConfig
    from mlir_ansor.dispatch import sizes_to_tune
    from mlir_ansor.examples.models import bert_layer, dynamic_shapes
    from mlir_ansor.graph.dynamic import parse_sizes
    from mlir_ansor.importers.pytorch import import_module
    from mlir_ansor.measure.runner import TimingPolicy, aligned_copy
    from mlir_ansor.target import Target

    wd = args.work_dir or tempfile.mkdtemp(prefix="dyn_bert_")
    os.makedirs(wd, exist_ok=True)
    model, (example,) = bert_layer(args.seed)
    path = os.path.join(wd, "bert_dyn.mlir")
    if not os.path.exists(path):
        text = import_module(model, (example,), dynamic_shapes=dynamic_shapes((example,), ["0.1"]))
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    with open(path, encoding="utf-8") as f:
        text = f.read()
    tuned, at = _ints(args.tuned), _ints(args.at)
    hidden = example.shape[-1]
    gen = torch.Generator().manual_seed(args.seed + 7)
    inputs = {s: torch.randn(1, s, hidden, generator=gen) for s in at}
    with torch.no_grad():
        want = {s: model(x).numpy() for s, x in inputs.items()}

    rows = []
    tune_s = {}
    for t in _ints(args.threads):
        db = os.path.join(wd, f"bert_dyn_{t}.db")
        sized, _, carry = sizes_to_tune(text, parse_sizes([f"0.1={','.join(map(str, tuned))}"]),
                                        between=not args.no_between)
        config = TuneConfig(trials=args.trials, threads=t, seed=args.seed, carry=carry)
        if args.flush_caches == "on":
            config = dataclasses.replace(config, timing=TimingPolicy(flush_caches=True))
        start = time.perf_counter()
        mlir_ansor.tune(mlir_ansor.load(text=sized), config=config, db=db)
        tune_s[t] = time.perf_counter() - start
        print(f"tuned at {tuned} x{t} in {tune_s[t]:.0f} s", file=sys.stderr, flush=True)
        dm = mlir_ansor.compile(path, db=db, threads=t)
        torch.set_num_threads(t)
        compiled = _torch_compiled(model, db, t) if args.torch_compile else {}
        for s in at:
            x = aligned_copy(inputs[s].numpy())
            out = dm(x)
            err = float(np.max(np.abs(out - want[s])) / np.max(np.abs(want[s])))
            xt = inputs[s]

            def eager(xt=xt, m=model):
                with torch.no_grad():
                    return m(xt)

            systems = {"ours": lambda x=x, dm=dm: dm(x), "eager": eager}
            first_s = {}
            for label, fn in compiled.items():
                systems[label] = (lambda xt=xt, fn=fn: eager(xt, fn))
                start = time.perf_counter()
                got = systems[label]().numpy()  # the first call at a length compiles it
                first_s[label] = time.perf_counter() - start
                bad = float(np.max(np.abs(got - want[s])) / np.max(np.abs(want[s])))
                if bad > 1e-4:
                    raise SystemExit(f"seq {s}: {label} differs from eager by {bad:.1e}")
            per = interleaved_times(systems, rounds=args.rounds, min_time=args.min_time)
            row = {"seq": s, "threads": t, "ours_ms": 1e3 * statistics.median(per["ours"]),
                   "eager_ms": 1e3 * statistics.median(per["eager"]),
                   "ratio": paired_ratio(per["eager"], per["ours"]), "rel_err": err, "tuned": s in tuned,
                   "kernels": _kernel_sources(dm.specialization(x))}
            for label in compiled:
                row[f"{label}_ms"] = 1e3 * statistics.median(per[label])
                row[f"{label}_vs_eager"] = paired_ratio(per["eager"], per[label])
                row[f"{label}_first_s"] = first_s[label]
            if compiled:
                row["ours_vs_inductor"] = paired_ratio(per["inductor"], per["ours"])
                row["backend_vs_inductor"] = paired_ratio(per["inductor"], per["backend"])
            rows.append(row)
            print(f"seq {s} x{t}: ours {row['ours_ms']:.3f} ms, eager {row['eager_ms']:.3f} ms "
                  f"({row['ratio']:.2f}x), err {err:.1e}"
                  + "".join(f", {k} {row[k + '_ms']:.3f} ms (first call {row[k + '_first_s']:.1f} s)"
                            for k in compiled), file=sys.stderr, flush=True)
        dm.close()

    host = Target.host()
    print(f"\nBERT-base layer, dynamic sequence length; tuned at {tuned} with {args.trials} trials in all "
          f"(caches flushed: {args.flush_caches}); rounds {args.rounds} x {args.min_time} s; "
          f"host: {host.model} ({host.core}), {os.cpu_count()} cores; torch {torch.__version__}")
    head = f"{'seq':>5} {'thr':>3} {'ours ms':>9} {'eager ms':>9} {'vs eager':>8}  {'err':>7}  kernels"
    print(head)
    print("-" * len(head))
    fails = []
    for r in rows:
        print(f"{r['seq']:>5} {r['threads']:>3} {r['ours_ms']:9.3f} {r['eager_ms']:9.3f} {r['ratio']:8.2f}  "
              f"{r['rel_err']:7.1e}  {r['kernels']}")
        if r["ratio"] < 1.2:
            fails.append(f"seq {r['seq']} x{r['threads']}: {r['ratio']:.2f}x eager (target >= 1.2)")
        if r["rel_err"] > 1e-4:
            fails.append(f"seq {r['seq']} x{r['threads']}: relative error {r['rel_err']:.1e} against torch")
    if args.torch_compile:
        print("\ntorch.compile(model, dynamic=True): our backend on the same database, and Inductor "
              "(ratios > 1: the first system is faster; first call: seconds, compiles that length)")
        head = (f"{'seq':>5} {'thr':>3} {'backend ms':>10} {'inductor ms':>11} {'backend/eager':>13} "
                f"{'backend/ind.':>12} {'ours/ind.':>9} {'first call s (backend/ind.)':>27}")
        print(head)
        print("-" * len(head))
        for r in rows:
            print(f"{r['seq']:>5} {r['threads']:>3} {r['backend_ms']:10.3f} {r['inductor_ms']:11.3f} "
                  f"{r['backend_vs_eager']:13.2f} {r['backend_vs_inductor']:12.2f} {r['ours_vs_inductor']:9.2f} "
                  f"{r['backend_first_s']:>15.1f}/{r['inductor_first_s']:<11.1f}")
    print("\ntune seconds: " + ", ".join(f"x{t} {v:.0f}" for t, v in tune_s.items()))
    print("targets: " + ("all met" if not fails else "NOT met:\n  " + "\n  ".join(fails)))
    print(f"work folder: {wd}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"rows": rows, "tune_s": tune_s, "tuned": tuned, "trials": args.trials,
                       "host": {"model": host.model, "core": host.core}}, fh, indent=1)
    return 0


def _torch_compiled(model, db: str, threads: int) -> dict:
    """``torch.compile(model, dynamic=True)`` with our backend on `db` and
    with Inductor, each called as the module it wraps."""
    import torch

    import mlir_ansor
    from mlir_ansor.tools import torch_backend as tb

    tb.clear_cache()
    torch._dynamo.reset()
    return {
        "backend": torch.compile(model, backend=mlir_ansor.torch_backend(db=db, threads=threads), dynamic=True),
        "inductor": torch.compile(model, dynamic=True),
    }


if __name__ == "__main__":
    sys.exit(main())
