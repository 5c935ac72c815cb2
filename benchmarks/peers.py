"""mlir-ansor against its peers, in one run: one table of ratios, one plot.

For every workload of `mlir_ansor.examples.workloads.ANSOR_SET` (Ansor's operator set,
the conv + bias + ReLU and transpose + batch-matmul subgraphs) and, with
`--models`, ResNet-50 and a BERT-base layer (`mlir_ansor.examples.models`), on the same
seeded inputs and with the same thread count:

- mlir-ansor: tune with `--trials` measured candidates, compile the best
  records, check them against the untuned lowering, time (`benchmarks/ansor_ops.py`);
- numpy/OpenBLAS (where the op is one numpy call) and PyTorch CPU (oneDNN,
  channels-last convolutions), timed in this process (`peer_latencies`);
- TVM MetaSchedule (apache-tvm 0.27 in its own env, `.venv-tvm`, made by
  `bash benchmarks/setup_peers.sh`): the same computation in tensor
  expressions, tuned with the same number of measured candidates and the
  same batch size, the best re-built and timed (`benchmarks/peers_tvm.py`,
  run as a subprocess), its output checked against ours.

Every system is timed by the same loop (`timing.median_time`), one system at
a time, right after its tuning and again all together at the end (the better
of the two counts). The table gives latencies, GFLOP/s, ratios ours/peer of GFLOP/s (>1:
mlir-ansor is faster) and each tuner's wall time; the summary gives the
median speedup over MetaSchedule across the single operators (the issue's
target: >= 1.2x, with a tuning wall time no longer than MetaSchedule's).

Usage:
  bash benchmarks/setup_peers.sh [--models]
  .venv/bin/python benchmarks/peers.py --trials 64 --threads 1 [--ops GMM,C2D]
      [--models] [--plot peers.png] [--json peers.json] [--no-tvm]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ansor_ops import peer_latencies, random_inputs, tune_and_time  # noqa: E402
from timing import median_time  # noqa: E402

from mlir_ansor import TuneConfig  # noqa: E402
from mlir_ansor.examples import workloads  # noqa: E402
from mlir_ansor.graph.task import extract_tasks  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_TVM_PYTHON = os.path.join(ROOT, ".venv-tvm", "bin", "python")
MODELS = ("resnet50", "bert_layer")
SYSTEMS = ("numpy", "torch", "tvm")


@dataclass
class Row:
    """One workload: our figures and every peer's, in seconds."""

    name: str
    flops: int
    ours_s: float = math.nan
    ours_tune_s: float = math.nan
    ours_trials: int = 0
    ours_err: float = math.nan
    peers: dict[str, float] = field(default_factory=dict)  # system -> latency (s)
    tvm_tune_s: float = math.nan
    tvm_trials: int = 0
    tvm_err: float = math.nan
    notes: list[str] = field(default_factory=list)

    def gflops(self, latency_s: float | None) -> float:
        return self.flops / latency_s / 1e9 if latency_s and math.isfinite(latency_s) else math.nan

    def ratio(self, system: str) -> float:
        """ours/peer in GFLOP/s (= peer latency / our latency)."""
        p = self.peers.get(system)
        return p / self.ours_s if p and math.isfinite(self.ours_s) else math.nan


def _rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.max(np.abs(got.astype(np.float64) - want)) / (np.max(np.abs(want)) + 1e-30))


def _run_tvm(args: argparse.Namespace, wd: str, names: list[str], models: list[str]) -> dict:
    """Run peers_tvm.py in TVM's env on the inputs in `wd`; its JSON object,
    or {"error": why} when TVM is not set up or the run failed."""
    py = args.tvm_python
    if not os.path.exists(py):
        return {"error": f"no TVM env at {py}: run `bash benchmarks/setup_peers.sh` (or pass --tvm-python)"}
    cmd = [
        py, os.path.join(ROOT, "benchmarks", "peers_tvm.py"), "--work-dir", wd,
        "--trials", str(args.trials), "--threads", str(args.threads),
        "--batch-size", str(args.batch_size), "--seed", str(args.seed),
    ]
    if names:
        cmd += ["--ops", ",".join(names)]
    if models:
        cmd += ["--models", ",".join(models)]
    log = os.path.join(wd, "tvm.log")
    print(f"TVM MetaSchedule: {' '.join(cmd)} (log: {log})", file=sys.stderr, flush=True)
    with open(log, "w") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
    if proc.returncode != 0:
        with open(log) as f:
            tail = f.read()[-2000:]
        return {"error": f"peers_tvm.py exited with status {proc.returncode}; end of {log}:\n{tail}"}
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    with open(os.path.join(wd, "tvm.json"), "w") as f:  # for --reuse-tvm
        json.dump(info, f, indent=1)
    return info


def _reused_tvm(tvm_dir: str) -> dict:
    """TVM's results of an earlier run in `tvm_dir` (its `tvm.json`), to be
    re-timed in this run (`--reuse-tvm`)."""
    path = os.path.join(tvm_dir, "tvm.json")
    if not os.path.exists(path):
        return {"error": f"--reuse-tvm: no {path} (written by a run of peers.py with TVM)"}
    with open(path) as f:
        info = json.load(f)
    info["reused_from"] = tvm_dir
    return info


def _retime_tvm(args: argparse.Namespace, wd: str, names: list[str]) -> dict[str, float]:
    """TVM's exported best kernels timed again (`peers_tvm.py --time-only`)."""
    names = [n for n in names if os.path.exists(os.path.join(wd, f"{n}.tvm.so"))]
    if not names:
        return {}
    cmd = [args.tvm_python, os.path.join(ROOT, "benchmarks", "peers_tvm.py"), "--work-dir", wd,
           "--threads", str(args.threads), "--ops", ",".join(names), "--time-only"]
    with open(os.path.join(wd, "tvm-retime.log"), "w") as err:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT)
    if proc.returncode != 0:
        return {}
    res = json.loads(proc.stdout.strip().splitlines()[-1])["results"]
    return {n: r["latency_s"] for n, r in res.items()}


def _model_module(name: str, wd: str) -> tuple[str, list[np.ndarray], object, tuple]:
    """The model's Linalg MLIR file, its inputs as arrays, the torch module and
    its example inputs; also writes the exported program for TVM to `wd`."""
    try:
        import torch

        from mlir_ansor.examples.models import MODELS as MODEL_FNS
        from mlir_ansor.importers.pytorch import import_module
    except ImportError as e:
        raise SystemExit(f"peers.py --models: needs torch, torch-mlir and mlir_ansor.examples.models ({e})") from e
    model, example = MODEL_FNS[name]()
    path = os.path.join(wd, f"{name}.mlir")
    with open(path, "w") as f:
        f.write(import_module(model, example))
    torch.export.save(torch.export.export(model, example), os.path.join(wd, f"{name}.pt2"))
    arrays = [t.detach().numpy() for t in example]
    np.savez(os.path.join(wd, f"{name}.in.npz"), *arrays)
    return path, arrays, model, example


def _torch_model_latency(model: object, example: tuple, threads: int) -> float:
    import torch

    torch.set_num_threads(threads)
    with torch.no_grad():
        return median_time(lambda: model(*example), min_time=1.0, min_repeat=3)


def _fmt_ms(x: float | None) -> str:
    return f"{x * 1e3:.3f}" if x is not None and math.isfinite(x) else "-"


def _fmt(x: float, spec: str = ".1f") -> str:
    return format(x, spec) if math.isfinite(x) else "-"


def print_table(rows: list[Row], args: argparse.Namespace, tvm_info: dict) -> dict:
    """Print the table and the summary; return the summary as a dict."""
    print(
        f"\nmlir-ansor vs peers: {args.trials} trials per workload, {args.threads} thread(s), "
        f"batch {args.batch_size}, search {args.search}, seed {args.seed}; "
        f"TVM {tvm_info.get('tvm', '-')}; each latency: the better of two timing windows (after its tuning, "
        "and all together at the end); machine shared with other jobs: compare ratios, not times"
    )
    hdr = (
        f"{'workload':<10} {'GFLOP':>7} {'ours ms':>9} {'ours GF/s':>9} {'numpy GF/s':>10} {'torch GF/s':>10} "
        f"{'TVM GF/s':>9} {'/numpy':>7} {'/torch':>7} {'/TVM':>6} {'tune s ours':>11} {'tune s TVM':>10} "
        f"{'trials ours/TVM':>15} {'err ours':>8} {'err TVM':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        trials = f"{r.ours_trials}/{r.tvm_trials or '-'}"
        print(
            f"{r.name:<10} {r.flops / 1e9:>7.3f} {_fmt_ms(r.ours_s):>9} {_fmt(r.gflops(r.ours_s)):>9} "
            f"{_fmt(r.gflops(r.peers.get('numpy'))):>10} {_fmt(r.gflops(r.peers.get('torch'))):>10} "
            f"{_fmt(r.gflops(r.peers.get('tvm'))):>9} {_fmt(r.ratio('numpy'), '.2f'):>7} "
            f"{_fmt(r.ratio('torch'), '.2f'):>7} {_fmt(r.ratio('tvm'), '.2f'):>6} {_fmt(r.ours_tune_s, '.0f'):>11} "
            f"{_fmt(r.tvm_tune_s, '.0f'):>10} {trials:>15} "
            f"{_fmt(r.ours_err, '.1e'):>8} {_fmt(r.tvm_err, '.1e'):>8}"
        )
    for r in rows:
        for n in r.notes:
            print(f"  {r.name}: {n}")
    if "error" in tvm_info:
        print(f"  TVM: {tvm_info['error']}")
    if tvm_info.get("reused_from"):
        print(f"  TVM: tuned in an earlier run ({tvm_info['reused_from']}), its kernels re-timed in this one")
    elif tvm_info.get("startup_s"):
        print(f"  TVM: one-time start-up (imports, tensor intrinsics) {tvm_info['startup_s']:.0f} s, not in its tune times")
    single = [r for r in rows if r.name in workloads.ANSOR_SET and r.name not in workloads.SUBGRAPHS]
    vs_tvm = [r.ratio("tvm") for r in single if math.isfinite(r.ratio("tvm"))]
    both = [r for r in single if math.isfinite(r.ours_tune_s) and math.isfinite(r.tvm_tune_s)]
    summary = {
        "median_vs_tvm_single_ops": statistics.median(vs_tvm) if vs_tvm else None,
        "single_ops_compared": len(vs_tvm),
        "tune_s_ours": sum(r.ours_tune_s for r in both),
        "tune_s_tvm": sum(r.tvm_tune_s for r in both),
    }
    for system in ("numpy", "torch"):
        vals = [r.ratio(system) for r in single if math.isfinite(r.ratio(system))]
        summary[f"median_vs_{system}_single_ops"] = statistics.median(vals) if vals else None
    if vs_tvm:
        med = summary["median_vs_tvm_single_ops"]
        print(
            f"\nmedian ours/TVM over {len(vs_tvm)} single operators: {med:.2f}x (target >= 1.2x: "
            f"{'met' if med >= 1.2 else 'not met'})"
        )
        print(
            f"tuning wall time, same operators: ours {summary['tune_s_ours']:.0f} s, TVM {summary['tune_s_tvm']:.0f} s "
            f"(target ours <= TVM: {'met' if summary['tune_s_ours'] <= summary['tune_s_tvm'] else 'not met'})"
        )
    for system in ("numpy", "torch"):
        v = summary[f"median_vs_{system}_single_ops"]
        if v is not None:
            print(f"median ours/{system} over the single operators that have one: {v:.2f}x")
    return summary


def plot(rows: list[Row], path: str, args: argparse.Namespace) -> None:
    """GFLOP/s of every system per workload, and the two tuners' wall times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.name for r in rows]
    x = np.arange(len(rows))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(max(6, 1.1 * len(rows) + 2), 7), height_ratios=[2, 1])
    series = [("mlir-ansor", lambda r: r.gflops(r.ours_s))] + [
        (label, lambda r, s=s: r.gflops(r.peers.get(s)))
        for s, label in (("numpy", "numpy/OpenBLAS"), ("torch", "PyTorch CPU"), ("tvm", "TVM MetaSchedule"))
    ]
    w = 0.8 / len(series)
    for i, (label, fn) in enumerate(series):
        ax1.bar(x + (i - (len(series) - 1) / 2) * w, [np.nan_to_num(fn(r)) for r in rows], w, label=label)
    for r_i, r in enumerate(rows):
        v = r.ratio("tvm")
        if math.isfinite(v):
            ax1.annotate(f"{v:.2f}x", (r_i, r.gflops(r.ours_s)), ha="center", va="bottom", fontsize=7)
    ax1.set_xticks(x, names)
    ax1.set_ylabel("GFLOP/s")
    ax1.set_title(f"{args.trials} trials, {args.threads} thread(s); labels: ours/TVM")
    ax1.legend(fontsize=8)
    ax2.bar(x - 0.2, [np.nan_to_num(r.ours_tune_s) for r in rows], 0.4, label="mlir-ansor")
    ax2.bar(x + 0.2, [np.nan_to_num(r.tvm_tune_s) for r in rows], 0.4, label="TVM MetaSchedule")
    ax2.set_xticks(x, names)
    ax2.set_ylabel("tuning wall time (s)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=",".join(workloads.ANSOR_SET), help="ANSOR_SET names; '' for none")
    ap.add_argument("--models", nargs="?", const=",".join(MODELS), default="",
                    help=f"also the whole models (default all of: {', '.join(MODELS)})")
    ap.add_argument("--trials", type=int, default=64, help="measured candidates per workload, for every tuner")
    ap.add_argument("--threads", type=int, default=1, help="threads of every system's kernels")
    ap.add_argument("--batch-size", type=int, default=16, help="candidates per search batch, for both tuners")
    ap.add_argument("--search", default="evolutionary", help="our search strategy (MetaSchedule: evolutionary)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-tvm", action="store_true", help="leave TVM out")
    ap.add_argument("--tvm-python", default=DEFAULT_TVM_PYTHON, help="python of TVM's env")
    ap.add_argument("--reuse-tvm", metavar="DIR",
                    help="take TVM's tuning (times, trials, best kernels) from the work folder of an earlier run "
                         "on the same inputs (same --seed) and only re-time its kernels in this run")
    ap.add_argument("--plot", metavar="PNG", help="write a bar chart of GFLOP/s and tuning times")
    ap.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    ap.add_argument("--work-dir", help="keep inputs, databases and TVM logs here (default: a temporary folder)")
    args = ap.parse_args()
    names = [n for n in args.ops.split(",") if n]
    models = [m for m in args.models.split(",") if m]
    bad = [n for n in names if n not in workloads.ANSOR_SET] + [m for m in models if m not in MODELS]
    if bad:
        ap.error(f"unknown workload(s) {', '.join(bad)}; ops: {', '.join(workloads.ANSOR_SET)}; models: {', '.join(MODELS)}")
    if not args.no_tvm and not os.path.exists(args.tvm_python):
        # Said now, not after our tuning: the re-timing of TVM's kernels needs it too.
        ap.error(f"no TVM env at {args.tvm_python}: run `bash benchmarks/setup_peers.sh`, pass --tvm-python, or --no-tvm")
    wd = args.work_dir or tempfile.mkdtemp(prefix="peers-")
    os.makedirs(wd, exist_ok=True)
    config = TuneConfig(trials=args.trials, threads=args.threads, seed=args.seed, strategy=args.search,
                        batch_size=args.batch_size)

    # 1. Inputs (shared by every system) and the FLOP counts (ours, for all).
    work: list[tuple[str, str, list[np.ndarray], object, tuple]] = []
    for name in names:
        path = os.path.join(wd, f"{name}.mlir")
        with open(path, "w") as f:
            f.write(workloads.ANSOR_SET[name]())
        arrays = random_inputs(path, seed=args.seed)
        np.savez(os.path.join(wd, f"{name}.in.npz"), *arrays)
        work.append((name, path, arrays, None, ()))
    for name in models:
        path, arrays, model, example = _model_module(name, wd)
        work.append((name, path, arrays, model, example))
    rows = {name: Row(name, sum(t.flops * t.weight for t in extract_tasks(path))) for name, path, *_ in work}

    # 2. Ours, then numpy and PyTorch, one workload at a time.
    kernels = {}
    for name, path, arrays, model, example in work:
        row = rows[name]
        try:
            o = tune_and_time(path, arrays, config, os.path.join(wd, f"{name}.db"), time_untuned=False)
        except Exception as e:  # one failure must not lose the other rows
            row.notes.append(f"mlir-ansor failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        row.ours_s, row.ours_tune_s, row.ours_trials, row.ours_err = o.latency_s, o.tune_s, o.trials, o.rel_err
        kernels[name] = o.kernel
        np.save(os.path.join(wd, f"{name}.ours.npy"), o.output)
        if model is None:
            row.peers.update(peer_latencies(name, arrays, args.threads))
        else:
            row.peers["torch"] = _torch_model_latency(model, example, args.threads)
        print(f"ours {name}: {o.latency_s * 1e3:.3f} ms, tuned in {o.tune_s:.0f} s", file=sys.stderr, flush=True)

    # 3. TVM MetaSchedule, in its own env, after ours (never at the same time).
    tvm_dir = args.reuse_tvm or wd
    if args.no_tvm:
        tvm_info: dict = {"error": "left out (--no-tvm)"}
    elif args.reuse_tvm:
        tvm_info = _reused_tvm(tvm_dir)
    else:
        tvm_info = _run_tvm(args, wd, names, models)
    for name, res in tvm_info.get("results", {}).items():
        row = rows[name]
        if "error" in res:
            row.notes.append(f"TVM failed: {res['error']}")
        row.tvm_tune_s, row.tvm_trials = res.get("tune_s", math.nan), res.get("trials", 0)
        if "latency_s" in res:
            row.peers["tvm"] = res["latency_s"]
            ref_path = os.path.join(wd, f"{name}.ours.npy")
            if os.path.exists(ref_path):
                row.tvm_err = _rel_err(np.load(os.path.join(tvm_dir, f"{name}.tvm.npy")), np.load(ref_path))
                if row.tvm_err > 1e-3:
                    row.notes.append(f"TVM's output differs from ours (relative error {row.tvm_err:.1e})")

    # 4. Every kernel timed again, together at the end: each latency is the
    # better of its two windows, so a burst of load from other processes in
    # one window does not decide a ratio alone.
    if len(work) > 0:
        print("timing every system again", file=sys.stderr, flush=True)
        again = {} if args.no_tvm else _retime_tvm(args, tvm_dir, names)
        for name, _path, arrays, model, example in work:
            row = rows[name]
            if name in kernels:
                row.ours_s = min(row.ours_s, median_time(kernels[name]))
                fresh = (peer_latencies(name, arrays, args.threads) if model is None
                         else {"torch": _torch_model_latency(model, example, args.threads)})
                for s, v in fresh.items():
                    row.peers[s] = min(row.peers.get(s, math.inf), v)
            if name in again and "tvm" in row.peers:
                # a reused tuning counts only as timed in this run
                row.peers["tvm"] = again[name] if args.reuse_tvm else min(row.peers["tvm"], again[name])

    table = [rows[n] for n, *_ in work]
    summary = print_table(table, args, tvm_info)
    print(f"work folder: {wd}")
    if args.plot:
        plot(table, args.plot, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({
                "args": vars(args), "tvm": {k: v for k, v in tvm_info.items() if k != "results"},
                "summary": summary, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                "rows": [{**r.__dict__, "gflops": {"ours": r.gflops(r.ours_s), **{s: r.gflops(v) for s, v in r.peers.items()}}}
                         for r in table],
            }, f, indent=1, default=str)


if __name__ == "__main__":
    main()
