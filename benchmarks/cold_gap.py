"""How a kernel's time grows with the time since its last call, when
nothing of ours touches memory in between (the caller spins in Python).

On a host whose caches other tenants share, a kernel goes cold by itself:
its operands leave the last-level cache within milliseconds, whatever the
kernel's access pattern. Beside the gaps, the call after a flush (a buffer
twice the last-level cache written, `TimingPolicy.flush_caches`' cold
call) and the call after a flush followed by a pass over the kernel's own
arrays: if that pass makes the call warm again, the cold penalty is the
kernel's data; if not, it is something the kernel does not control.

With `--torch`, the same matmul in PyTorch (`torch.matmul` into a
preallocated output, `torch.set_num_threads`) is timed the same way, in
the same rounds: a kernel of another library that goes cold the same way
shows that the penalty is the host's.

Each figure is the median of `--rounds` calls, the gaps taken in turns.

Usage:
  python benchmarks/cold_gap.py [--m 128 --n 3072 --k 768] [--threads 1] [--db DB] [--rounds 15] [--torch]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

import mlir_ansor
from mlir_ansor.examples import workloads as W
from mlir_ansor.measure.runner import Kernel, aligned_copy, aligned_empty, last_level_cache_bytes, np_dtype
from mlir_ansor.target import Target

GAPS_MS = (0.0, 0.5, 2.0, 5.0, 10.0, 20.0, 50.0)


def spin(seconds: float) -> None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=128)
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--k", type=int, default=768)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--db", default=None, help="records to compile the matmul with (default: its default schedule)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--torch", action="store_true", help="also time torch.matmul the same way")
    args = ap.parse_args()
    cm = mlir_ansor.compile(mlir_ansor.load(text=W.matmul(args.m, args.n, args.k)), db=args.db, threads=args.threads)
    rng = np.random.default_rng(0)
    ins, outs_spec, _ = cm.functions[cm.entry]
    arrays = [aligned_copy(rng.standard_normal(s).astype(np_dtype(d))) for s, d in ins]
    outs = [aligned_empty(s, np_dtype(d)) for s, d in outs_spec]
    # The library's function on these very buffers (`CompiledModule.bind` runs on copies).
    run = Kernel(cm.library_path, cm.entry).bind(arrays + outs)
    touched = arrays + outs
    flush = np.ones(2 * last_level_cache_bytes() // 4, np.float32)
    print(Target.host().key, f"({os.cpu_count()} cores); matmul {args.m}x{args.n}x{args.k}, {args.threads} thread(s), "
          f"{sum(a.nbytes for a in touched) / 1e6:.1f} MB of operands; {cm.kernels[0].source} schedule")

    def after_flush(then_touch: bool):
        def prepare():
            flush.__iadd__(1.0)
            if then_touch:
                for a in touched:
                    a.__iadd__(0)
        return prepare

    prepares = {f"{g:g} ms": (lambda g=g: spin(g / 1e3)) for g in GAPS_MS}
    prepares["flush"] = after_flush(False)
    prepares["flush, then its arrays"] = after_flush(True)
    systems = {"ours": run}
    if args.torch:
        import torch

        torch.set_num_threads(args.threads)
        ta, tb = (torch.from_numpy(a) for a in arrays)
        tc = torch.from_numpy(aligned_empty((args.m, args.n), np.float32))
        touched.append(tc.numpy())
        systems["torch"] = lambda: torch.matmul(ta, tb, out=tc)
    times = {(s, name): [] for s in systems for name in prepares}
    for _ in range(args.rounds):
        for s, fn in systems.items():
            for name, prepare in prepares.items():
                fn()
                fn()
                prepare()
                t0 = time.perf_counter()
                fn()
                times[(s, name)].append(time.perf_counter() - t0)
    print(f"{'before the call':24}" + "".join(f" {s + ' ms':>10} {'/ b2b':>6}" for s in systems))
    for name in prepares:
        row = f"{name:24}"
        for s in systems:
            m, warm = (statistics.median(times[(s, n)]) for n in (name, f"{GAPS_MS[0]:g} ms"))
            row += f" {m * 1e3:10.3f} {m / warm:6.2f}"
        print(row)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
