"""Whole models from PyTorch: ResNet-50 (batch 1, 224x224) and a BERT-base
encoder layer (sequence 128), end to end, against PyTorch CPU eager,
`torch.compile` (inductor, ``mode="max-autotune-no-cudagraphs"``), IREE
(`iree_peer.py`, both flag sets, on the same MLIR we tune) and the untuned
lowering, measured in the same run, at each thread count.

For every model (`mlir_ansor.examples.models`, seeded random weights, nothing
downloaded): import it with torch-mlir (`mlir_ansor.importers.pytorch`), extract
its tasks (printed with their weights), and for every thread count: tune
with `--trials` candidates in total (the budget is printed), compile the best
records (`mlir_ansor.compile`; tasks without a record get the default
schedule), check the output against PyTorch's and against the untuned
lowering, and time it; time the untuned lowering (`compile_untuned`: the
whole module lowered as it is) and PyTorch eager (`torch.set_num_threads`,
`torch.no_grad`), `torch.compile` and IREE in the same process right after
(IREE through its own venv). One table at the end: latencies, the sum of
the tuned kernels' own timings beside the compiled module's, compile times,
and ratios (>1 means mlir-ansor is faster) against each peer and the best.

Kernels are timed with the caches flushed by default (`--flush-caches on`,
`TimingPolicy.flush_caches`): in a model each kernel finds its weights in
memory. `--fresh N` also times the compiled module in N fresh processes
(the spread of a 2-thread run from one process to the next) and prints each.

Usage:
  python benchmarks/models.py [--models resnet50,bert_layer] [--threads 1,2] [--trials 96]
                              [--batch-size 2] [--no-untuned] [--keep DIR] [--fresh 10]
                              [--peers eager,compile,iree] [--flush-caches on|off]
Needs the 'torch' extra (torch and torch-mlir); IREE: `bash benchmarks/setup_peers.sh --iree`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from iree_peer import DEFAULT_IREE_PYTHON, Iree  # noqa: E402
from timing import median_time  # noqa: E402

import mlir_ansor  # noqa: E402
from mlir_ansor import TuneConfig  # noqa: E402
from mlir_ansor.compiler import compile_untuned  # noqa: E402
from mlir_ansor.measure.runner import TimingPolicy  # noqa: E402
from mlir_ansor.search.rules.dot_product import weight_packing  # noqa: E402
from mlir_ansor.target import Target  # noqa: E402


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))


def _fresh_run(lib: str, seconds: float) -> None:
    """--time-library: load a saved compiled module in this (fresh) process,
    time it for `seconds` on seeded inputs, print the median (JSON)."""
    from mlir_ansor.compiler import CompiledModule
    from mlir_ansor.measure.runner import np_dtype

    with open(lib + ".json") as f:
        meta = json.load(f)
    fns = {k: tuple(v) for k, v in meta["functions"].items()}
    cm = CompiledModule(lib, "", fns, meta["entry"], [], meta["threads"])
    rng = np.random.default_rng(0)
    arrays = [rng.uniform(-1, 1, tuple(sh)).astype(np_dtype(dt)) for sh, dt in fns[meta["entry"]][0]]
    run, _ = cm.bind(*arrays)
    steal = _steal_s()
    median = median_time(run, min_time=seconds, min_repeat=5)
    print(json.dumps({"median_s": median, "steal_s": _steal_s() - steal}))


def _steal_s() -> float:
    """Seconds of this VM's vCPUs' time the hypervisor gave to others (the
    `steal` column of /proc/stat, all CPUs); 0 where there is none to read."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def fresh_processes(cm, wd: str, tag: str, n: int, seconds: float = 1.0) -> tuple[list[float], list[float]]:
    """The compiled module timed in `n` fresh processes, one after another:
    each one's median, and the vCPU time stolen while it timed (a 2-thread
    run slows down when the hypervisor takes one of the two vCPUs)."""
    lib = os.path.join(wd, f"{tag}.so")
    shutil.copy(cm.library_path, lib)
    with open(lib + ".json", "w") as f:
        json.dump({"functions": cm.functions, "entry": cm.entry, "threads": cm.threads}, f)
    out, stolen = [], []
    for _ in range(n):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--time-library", lib, "--seconds", str(seconds)],
                              capture_output=True, text=True, check=True)
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        out.append(got["median_s"])
        stolen.append(got["steal_s"])
    return out, stolen


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
    ap.add_argument("--peers", default="eager,compile,iree", help="peers to time, of: eager, compile (torch.compile), iree")
    ap.add_argument("--iree-python", default=DEFAULT_IREE_PYTHON, help="python of IREE's env")
    ap.add_argument("--flush-caches", choices=("on", "off"), default="on",
                    help="tune with the caches flushed before each timed run (TimingPolicy.flush_caches)")
    ap.add_argument("--fresh", type=int, default=0, metavar="N", help="also time each compiled module in N fresh processes")
    ap.add_argument("--time-library", help=argparse.SUPPRESS)
    ap.add_argument("--seconds", type=float, default=1.0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.time_library:
        _fresh_run(args.time_library, args.seconds)
        return
    peers = {p.strip() for p in args.peers.split(",") if p.strip()}

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
        # the host's tasks, as tuning cuts them (weights in panels, a
        # softmax or a layer norm one task)
        tasks = mlir_ansor.extract_tasks(mlir_ansor.load(path), prepack=weight_packing(Target.host()))
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
        compiled_torch = compile_torch_s = None
        if "compile" in peers:
            compiled_torch = torch.compile(model, mode="max-autotune-no-cudagraphs")
        iree = None
        work = SimpleNamespace(name=name, path=path, arrays=x, reference=[want])
        if "iree" in peers:
            if os.path.exists(args.iree_python):
                iree = Iree(args.iree_python, wd, ["best", "default"], min_time=1.0)
            else:
                print(f"IREE: no {args.iree_python} (bash benchmarks/setup_peers.sh --iree); not timed", file=sys.stderr)
        for threads in (int(s) for s in args.threads.split(",")):
            db = os.path.join(wd, f"{name}_t{threads}.db")
            config = TuneConfig(trials=args.trials, threads=threads, seed=args.seed, batch_size=args.batch_size)
            if args.flush_caches == "on":
                config = dataclasses.replace(config, timing=TimingPolicy(flush_caches=True))
            t0 = time.perf_counter()
            res = mlir_ansor.tune(path, config=config, db=db)
            tune_s = time.perf_counter() - t0
            kernels_s = sum(r.task.weight * r.best_latency_s for r in res.tasks)
            t0 = time.perf_counter()
            cm = mlir_ansor.compile(path, db=db, threads=threads)
            compile_s = time.perf_counter() - t0
            got = np.asarray(cm(*x))
            err_torch = _rel_err(got, want)
            run, _ = cm.bind(*x)
            ours = median_time(run, min_time=1.0, min_repeat=5)
            fresh, stolen = fresh_processes(cm, wd, f"{name}_t{threads}", args.fresh) if args.fresh else ([], [])
            untuned = err_untuned = math.nan
            if not args.no_untuned:
                ref = compile_untuned(path, threads=threads)
                err_untuned = _rel_err(got, np.asarray(ref(*x)))
                urun, _ = ref.bind(*x)
                untuned = median_time(urun, min_time=0.5, min_repeat=1, max_repeat=3)
                ref.close()
            torch.set_num_threads(threads)
            peer: dict[str, float] = {}
            with torch.no_grad():
                if "eager" in peers:
                    peer["eager"] = median_time(lambda m=model, i=inputs: m(*i), min_time=1.0, min_repeat=5)
                if compiled_torch is not None:
                    if compile_torch_s is None:
                        t0 = time.perf_counter()
                        compiled_torch(*inputs)
                        compile_torch_s = time.perf_counter() - t0
                    peer["torch.compile"] = median_time(lambda c=compiled_torch, i=inputs: c(*i), min_time=1.0, min_repeat=5)
            iree_compile_s: dict[str, float] = {}
            if iree is not None:
                timed, iree_compile_s = iree.latencies(work, threads)
                peer.update({f"IREE {fs}": v for fs, v in timed.items()})
            sources = Counter(k.source for k in cm.kernels)
            cm.close()
            rows.append(dict(model=name, threads=threads, ours=ours, kernels=kernels_s, untuned=untuned, peer=peer,
                             flops=flops, trials=res.measured, tune_s=tune_s, compile_s=compile_s, err_torch=err_torch,
                             err_untuned=err_untuned, sources=sources, fresh=fresh, fresh_steal=stolen, torch_compile_s=compile_torch_s,
                             iree_compile_s=iree_compile_s))
            print(
                f"{name} x{threads}: ours {ours * 1e3:.2f} ms (kernels {kernels_s * 1e3:.2f} ms), "
                + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in peer.items())
                + f"; untuned {untuned * 1e3:.1f} ms; tuned {res.measured} trials in {tune_s:.0f} s, compiled in "
                f"{compile_s:.0f} s; kernels {dict(sources)}; rel err vs torch {err_torch:.1e}"
                + (f"; fresh processes: {', '.join(f'{f * 1e3:.2f}' for f in fresh)} ms" if fresh else ""),
                file=sys.stderr,
                flush=True,
            )
    report(rows, args)
    if wd_ctx is not None:
        wd_ctx.cleanup()


def report(rows: list[dict], args: argparse.Namespace) -> None:
    """The table: latencies, the kernels' sum, each peer, the best peer and
    our ratio to it, compile times, errors; then each row's fresh processes."""

    def ms(v: float | None) -> str:
        return f"{v * 1e3:.2f}" if v is not None and math.isfinite(v) else "-"

    names = sorted({k for r in rows for k in r["peer"]}, key=lambda k: ("eager", "torch.compile", "IREE best", "IREE default").index(k)
                   if k in ("eager", "torch.compile", "IREE best", "IREE default") else 9)
    hdr = (f"{'model':<11} {'thr':>3} {'ours ms':>8} {'GF/s':>6} {'kernels':>8} {'ours/kern':>9} "
           + " ".join(f"{n:>13}" for n in names)
           + f" {'best peer':>13} {'vs best':>7} {'untuned':>9} {'trials':>6} {'tune s':>6} {'comp s':>6} "
           f"{'tc comp s':>9} {'IREE comp s':>11} {'err/torch':>9}  kernels")
    print(f"budget: {args.trials} trials per model and thread count; kernels: the sum of the tuned kernels' own timings "
          f"(caches flushed: {args.flush_caches}); ratios > 1 mean mlir-ansor is faster")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        best = min(r["peer"].items(), key=lambda kv: kv[1], default=(None, math.nan))
        vs = best[1] / r["ours"] if best[0] else math.nan
        iree_c = "/".join(f"{r['iree_compile_s'][k]:.1f}" for k in ("best", "default") if k in r["iree_compile_s"]) or "-"
        tc = f"{r['torch_compile_s']:.1f}" if r["torch_compile_s"] is not None else "-"
        kernels = ", ".join(f"{k} {v}" for k, v in sorted(r["sources"].items()))
        print(
            f"{r['model']:<11} {r['threads']:>3} {ms(r['ours']):>8} {r['flops'] / r['ours'] / 1e9:>6.1f} {ms(r['kernels']):>8} "
            f"{r['ours'] / r['kernels']:>9.3f} "
            + " ".join(f"{ms(r['peer'].get(n)):>13}" for n in names)
            + f" {(best[0] or '-'):>13} {vs:>7.2f} {ms(r['untuned']):>9} {r['trials']:>6} {r['tune_s']:>6.0f} "
            f"{r['compile_s']:>6.0f} {tc:>9} {iree_c:>11} {r['err_torch']:>9.1e}  {kernels}"
        )
    for r in rows:
        if r["fresh"]:
            f = np.array(r["fresh"])
            med = float(np.median(f))
            print(f"{r['model']} x{r['threads']}: {len(f)} fresh processes: "
                  + ", ".join(f"{v * 1e3:.2f}" for v in f)
                  + f" ms; median {med * 1e3:.2f}, spread {100 * (f.min() / med - 1):+.0f}% .. {100 * (f.max() / med - 1):+.0f}%"
                  + "; vCPU time stolen while each timed: " + ", ".join(f"{v * 1e3:.0f}" for v in r["fresh_steal"]) + " ms")


if __name__ == "__main__":
    main()
