"""Dynamic shapes (issue #27): one GEMM with a dynamic M, tuned at a few
sizes, run at others, against a static module tuned for each exact M and
against IREE compiling the dynamic module, in one run.

The module: ``C[M, 1024] = A[M, 1024] . B[1024, 1024]`` in f32, M dynamic
(``tensor<?x1024xf32>``, ``tensor.dim``, ``tensor.empty(%m)``).

Systems, at each ``--at`` size M and each ``--threads`` count:

- ``dynamic``: mlir-ansor tuned once at ``--tuned`` sizes (``tune --sizes
  0.0=1,16,64,256,1024``: their specializations tuned together, `--trials`
  measured candidates in all; the powers of two between them, which the
  library specialises, each measured on its default point and its
  neighbours' best schedules, within those trials: `TuneConfig.carry`), compiled as one dynamic module
  (`mlir_ansor.compile` returns a `DynamicModule`); a size that was not
  tuned gets the schedule of its nearest tuned size, its knobs carried to
  that size's options (`search.transfer`; the table's "from" column), and
  runs on its own rows (the dynamic
  module pads only with ``pad=True``: ``@336`` would say 333 rows ran as
  336);
- ``library``: the same tuned sizes as one library that dispatches in
  MLIR (`mlir_ansor.build_library`, the sizes found from the records, and
  the powers of two between them): exact sizes run their specialization,
  sizes up to 15% below one run it padded, the others a kernel on dynamic
  rows carried from the nearest tuned size ("ranged"; the line under the
  row says which); the "path" column says which, "lib/st" its time over
  the static module's;
- ``static``: a module specialized to exactly M, tuned with the same
  `--trials` on its own (``--no-static``: skip these tunes);
- ``iree``: IREE 3.13 (`benchmarks/peers_iree.py` in `.venv-iree`, made by
  ``bash benchmarks/setup_peers.sh --iree``) compiling the dynamic module
  once with its best CPU flags (O2, data tiling, micro-kernels) and, with
  ``--iree-default``, its default flags;

Every system's output is checked against numpy in float64 first. The
systems of a size are timed in turns, `--rounds` rounds (`timing.median_time`
for the in-process ones, IREE's `iree-benchmark-module` between them). A
ratio is the median over the rounds of the two systems' times in the same
round (`timing.paired_ratio` says why). Ratios to IREE are of throughput
(> 1: ours is faster). Ours are timed as called
(``f(a, b)``: outputs allocated, padding copied), IREE by its benchmark tool. Targets: dynamic within 15% of static
(dynamic/static latency <= 1.15) and >= 1.2x IREE, at every size.

Usage:
  bash benchmarks/setup_peers.sh --iree
  .venv/bin/python benchmarks/dynamic_gemm.py [--trials 200] [--threads 1] [--at 1,7,16,100,333,1024]
      [--tuned 1,16,64,256,1024] [--no-static] [--iree-default] [--json out.json] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from iree_peer import DEFAULT_IREE_PYTHON, Iree  # noqa: E402
from timing import median_time, paired_ratio  # noqa: E402

K = N = 1024

DYNAMIC = f"""func.func @gemm(%A: tensor<?x{K}xf32>, %B: tensor<{K}x{N}xf32>) -> tensor<?x{N}xf32> {{
  %c0 = arith.constant 0 : index
  %cst = arith.constant 0.0 : f32
  %m = tensor.dim %A, %c0 : tensor<?x{K}xf32>
  %e = tensor.empty(%m) : tensor<?x{N}xf32>
  %z = linalg.fill ins(%cst : f32) outs(%e : tensor<?x{N}xf32>) -> tensor<?x{N}xf32>
  %r = linalg.matmul ins(%A, %B : tensor<?x{K}xf32>, tensor<{K}x{N}xf32>) outs(%z : tensor<?x{N}xf32>) -> tensor<?x{N}xf32>
  return %r : tensor<?x{N}xf32>
}}
"""


@dataclass
class Row:
    m: int
    threads: int
    ms: dict[str, float] = field(default_factory=dict)
    err: dict[str, float] = field(default_factory=dict)
    ratio: dict[str, float] = field(default_factory=dict)
    """Latency ratios ("dynamic/static", "library/static", "iree-best/dynamic"): each the median over
    the rounds of the two systems' times in that round."""
    source: str = ""
    """How the dynamic module scheduled the matmul at this M: tuned, or transferred (from which size)."""
    path: str = ""
    """The library's dispatch at this M: exact, padded, blocked or generic."""
    notes: list[str] = field(default_factory=list)


@dataclass
class Workload:
    """What `iree_peer.Iree` reads: one size of the dynamic module."""

    name: str
    path: str
    arrays: list[np.ndarray]
    reference: list[np.ndarray]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _tune(text: str, db: str, trials: int, threads: int, seed: int, carry: tuple[str, ...] = ()) -> float:
    import mlir_ansor
    from mlir_ansor import TuneConfig

    t0 = time.perf_counter()
    config = TuneConfig(trials=trials, threads=threads, seed=seed, carry=carry)
    mlir_ansor.tune(mlir_ansor.load(text=text), config=config, db=db)
    return time.perf_counter() - t0


def _matmul_plan(cm, padded) -> str:
    """How the matmul runs: tuned, or carried from a tuned size; "@P": padded to P rows."""
    plans = [p for p in cm.kernels if "matmul" in p.task.name]
    if not plans:
        return "?"
    p = plans[0]
    what = f"from {p.origin.split('_')[1].split('x')[0]}" if p.origin else p.source  # matmul_MxNxK...
    return what + (f" @{next(iter(padded.values()))}" if padded else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=200, help="measured candidates of each tune (dynamic: all sizes together)")
    ap.add_argument("--threads", default="1")
    ap.add_argument("--at", default="1,7,16,100,333,1024", help="sizes M to run at")
    ap.add_argument("--tuned", default="1,16,64,256,1024", help="sizes M the dynamic module is tuned at")
    ap.add_argument("--no-between", action="store_true",
                    help="tune only the --tuned sizes (tune --no-between), not also the sizes between them on carried schedules")
    ap.add_argument("--no-static", action="store_true", help="no static module per size (no per-size tunes)")
    ap.add_argument("--only", default="dynamic,library,static,iree")
    ap.add_argument("--iree-default", action="store_true", help="also IREE with its default flags")
    ap.add_argument("--iree-python", default=DEFAULT_IREE_PYTHON)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--min-time", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="FILE")
    ap.add_argument("--work-dir")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if args.no_static:
        only.discard("static")

    import mlir_ansor
    from mlir_ansor.dispatch import sizes_to_tune
    from mlir_ansor.graph.dynamic import parse_sizes, specializations
    from mlir_ansor.measure.runner import aligned_copy
    from mlir_ansor.target import Target

    wd = args.work_dir or tempfile.mkdtemp(prefix="dyn_gemm_")
    os.makedirs(wd, exist_ok=True)
    dyn_path = os.path.join(wd, "gemm_dyn.mlir")
    with open(dyn_path, "w", encoding="utf-8") as f:
        f.write(DYNAMIC)
    sizes, tuned = _ints(args.at), _ints(args.tuned)
    threads = _ints(args.threads)
    rng = np.random.default_rng(args.seed)
    # Aligned as `mlir_ansor.measure.runner.aligned_copy` makes them: ours pass
    # such arrays to the kernels as they are (numpy's own are copied first).
    b = aligned_copy(rng.standard_normal((K, N)).astype(np.float32))
    inputs = {m: aligned_copy(rng.standard_normal((m, K)).astype(np.float32)) for m in sizes}
    refs = {m: (inputs[m].astype(np.float64) @ b.astype(np.float64)) for m in sizes}

    iree = None
    if "iree" in only:
        if os.path.exists(args.iree_python):
            flag_sets = ["best", "default"] if args.iree_default else ["best"]
            iree = Iree(args.iree_python, wd, flag_sets, args.min_time)
        else:
            print(f"IREE: no {args.iree_python} (bash benchmarks/setup_peers.sh --iree); its column is left out", file=sys.stderr)

    rows: list[Row] = []
    tune_s: dict[str, float] = {}
    for t in threads:
        dm = lib = None
        if only & {"dynamic", "library"}:
            db = os.path.join(wd, f"dyn_{t}.db")
            text, _, carry = sizes_to_tune(DYNAMIC, parse_sizes([f"0.0={','.join(map(str, tuned))}"]),
                                           between=not args.no_between)
            tune_s[f"dynamic x{t}"] = _tune(text, db, args.trials, t, args.seed, carry)
            if "dynamic" in only:
                dm = mlir_ansor.compile(dyn_path, db=db, threads=t)
            if "library" in only:
                lib = mlir_ansor.build_library(dyn_path, db=db, threads=t)
        for m in sizes:
            row = Row(m, t)
            rows.append(row)
            a = inputs[m]
            fns = {}
            # Every system is timed as a user calls it (arrays in, arrays out):
            # the dynamic module's call includes its padding, where it pads.
            if dm is not None:
                row.source = _matmul_plan(dm.specialization(a, b), dm.padded_sizes(a, b))
                row.err["dynamic"] = float(np.max(np.abs(dm(a, b) - refs[m])) / np.max(np.abs(refs[m])))
                fns["dynamic"] = lambda a=a, dm=dm: dm(a, b)
            if lib is not None:
                chosen = lib.dispatch(a, b)
                row.path = chosen["path"]
                if "label" in chosen:
                    row.notes.append(f"library: {chosen['label']}")
                row.err["library"] = float(np.max(np.abs(lib(a, b) - refs[m])) / np.max(np.abs(refs[m])))
                fns["library"] = lambda a=a, lib=lib: lib(a, b)
            if "static" in only:
                text, _ = specializations(DYNAMIC, parse_sizes([f"0.0={m}"]), keep_name=True)
                db = os.path.join(wd, f"static_{m}_{t}.db")
                tune_s[f"static M={m} x{t}"] = _tune(text, db, args.trials, t, args.seed)
                scm = mlir_ansor.compile(mlir_ansor.load(text=text), db=db, threads=t)
                row.err["static"] = float(np.max(np.abs(scm(a, b) - refs[m])) / np.max(np.abs(refs[m])))
                fns["static"] = lambda a=a, scm=scm: scm(a, b)
            w = Workload(f"gemm_dyn_m{m}", dyn_path, [a, b], [refs[m].astype(np.float32)])
            iree_ok: list[str] = []
            if iree is not None:
                prepared = iree.prepare(w, t)
                for fs, r in prepared.items():
                    if "error" in r:
                        row.notes.append(f"IREE {fs}: {r['error']}")
                    else:
                        iree_ok.append(fs)
                        row.err[f"iree-{fs}"] = r.get("rel_err", float("nan"))
            per: dict[str, list[float]] = {k: [] for k in [*fns, *(f"iree-{fs}" for fs in iree_ok)]}
            for _ in range(args.rounds):
                for name, fn in fns.items():
                    per[name].append(median_time(fn, min_time=args.min_time, min_repeat=3, warmup_s=0.2))
                if iree_ok:
                    for fs, v in iree.time(w, t, iree_ok).items():
                        if isinstance(v, float):
                            per[f"iree-{fs}"].append(v)
            row.ms = {k: 1e3 * statistics.median(v) for k, v in per.items() if v}
            for num, den in (("dynamic", "static"), ("library", "static"), ("iree-best", "dynamic")):
                if per.get(num) and per.get(den):  # (a round IREE failed in: the medians' ratio)
                    same = len(per[num]) == len(per[den])
                    row.ratio[f"{num}/{den}"] = paired_ratio(per[num], per[den]) if same else row.ms[num] / row.ms[den]
            print(f"M={m} x{t}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in row.ms.items()) + f" ({row.source})",
                  file=sys.stderr, flush=True)
        if dm is not None:
            dm.close()

    host = Target.host()
    info = {"model": host.model, "core": host.core, "features": list(host.features)}
    print(f"\ndynamic-M GEMM, M x {K} . {K} x {N} f32; tuned at M = {tuned}, {args.trials} trials per tune; "
          f"rounds {args.rounds} x {args.min_time} s; host: {host.model} ({host.core}), {os.cpu_count()} cores")
    if iree is not None:
        print(f"IREE: {iree.version}")
    head = (f"{'M':>5} {'thr':>3} {'dynamic ms':>10} {'schedule':>14} {'library ms':>10} {'path':>7} {'static ms':>9} "
            f"{'dyn/static':>10} {'lib/st':>6} {'IREE ms':>8} {'/IREE':>6}  err")
    print(head)
    print("-" * len(head))
    fails = []
    for r in rows:
        d, s, i, lb = (r.ms.get(k) for k in ("dynamic", "static", "iree-best", "library"))

        def f(x, w=9, p=3):
            return f"{x:{w}.{p}f}" if x is not None else f"{'-':>{w}}"

        slow, lib_slow, vs_iree = (r.ratio.get(k) for k in ("dynamic/static", "library/static", "iree-best/dynamic"))
        print(f"{r.m:>5} {r.threads:>3} {f(d, 10)} {r.source:>14} {f(lb, 10)} {r.path or '-':>7} {f(s)} {f(slow, 10, 2)} "
              f"{f(lib_slow, 6, 2)} {f(i, 8)} {f(vs_iree, 6, 2)}  "
              f"{max(r.err.values()) if r.err else float('nan'):.1e}")
        for note in r.notes:
            print(f"      {note}")
        if slow is not None and slow > 1.15:
            fails.append(f"M={r.m} x{r.threads}: dynamic {slow:.2f}x the static module's time (target <= 1.15)")
        if lib_slow is not None and lib_slow > 1.15:
            fails.append(f"M={r.m} x{r.threads}: library {lib_slow:.2f}x the static module's time (target <= 1.15)")
        if vs_iree is not None and vs_iree < 1.2:
            fails.append(f"M={r.m} x{r.threads}: {vs_iree:.2f}x IREE (target >= 1.2)")
        if any(e > 1e-4 for e in r.err.values()):
            fails.append(f"M={r.m} x{r.threads}: an error above 1e-4 ({r.err})")
    print("\ntune seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in tune_s.items()))
    print("targets: " + ("all met" if not fails else "NOT met:\n  " + "\n  ".join(fails)))
    print(f"work folder: {wd}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump({"rows": [r.__dict__ for r in rows], "tune_s": tune_s, "tuned": tuned, "trials": args.trials,
                       "host": info, "iree": iree.version if iree else None}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
