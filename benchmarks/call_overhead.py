"""What a compiled call costs beyond its kernel: one-kernel modules called
through `mlir_ansor.compile(...)(*arrays)` against the same library function
run on buffers bound once (`CompiledModule.bind`: the kernel and the ctypes
call, nothing else), at each thread count.

A call checks its arguments against the signature, reads their data
pointers into the memref descriptors it made once, allocates its outputs
(cache-line aligned) and calls the function. Arguments that are aligned,
C-contiguous and of the right type are passed as they are; numpy's own
arrays are only 16-byte aligned and are copied (`runner.ALIGNMENT` says why),
which the last column shows.

A call keeps the data pointers of the arrays it last passed as they are
(weak references: weights passed at every call cost 0.4 us less each).
"call" passes the same arrays at every call; "other arrays" alternates
between two sets of them, so that no argument is the last call's, and its
overhead is over the kernel run on the same two sets in turn.

Each figure is the best of 7 rounds of `--calls` calls (microseconds per
call); the systems are timed in turns, round by round.

Usage:
  python benchmarks/call_overhead.py [--threads 1,2] [--calls 20000]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
import time

import numpy as np

import mlir_ansor
from mlir_ansor.examples import workloads as W
from mlir_ansor.measure.runner import aligned_copy, np_dtype
from mlir_ansor.target import Target

MODULES = {
    "add_relu 64x64": lambda: W.elementwise_add_relu(64, 64),
    "matmul 64x64x64": lambda: W.matmul(64, 64, 64),
    "reduce 256x256": lambda: W.reduce_last(256, 256),
}


def per_call_us(fn, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()
    print(Target.host().key, f"({os.cpu_count()} cores)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for threads in (int(t) for t in args.threads.split(",")):
            for name, make in MODULES.items():
                path = os.path.join(tmp, "m.mlir")
                with open(path, "w") as f:
                    f.write(make())
                cm = mlir_ansor.compile(path, threads=threads, cache_dir=False)
                if len(cm.kernels) != 1:
                    sys.exit(f"{name}: {len(cm.kernels)} kernels, expected one")
                rng = np.random.default_rng(0)
                plain = [rng.standard_normal(s).astype(np_dtype(d)) for s, d in cm.functions[cm.entry][0]]
                aligned = [aligned_copy(a) for a in plain]
                sets = [[aligned_copy(a) for a in plain] for _ in range(2)]
                others = itertools.cycle(sets)
                bound_others = itertools.cycle([cm.bind(*a)[0] for a in sets])
                bound, _ = cm.bind(*aligned)
                systems = {
                    "kernel": bound,
                    "kernel (other arrays)": lambda b=bound_others: next(b)(),
                    "call": lambda cm=cm, a=aligned: cm(*a),
                    "call (other arrays)": lambda cm=cm, o=others: cm(*next(o)),
                    "call (numpy arrays)": lambda cm=cm, a=plain: cm(*a),
                }
                best = dict.fromkeys(systems, float("inf"))
                for fn in systems.values():  # warm-up
                    per_call_us(fn, max(1, args.calls // 10))
                for _ in range(7):
                    for key, fn in systems.items():
                        best[key] = min(best[key], per_call_us(fn, args.calls))
                rows.append((name, threads, best))
                cm.close()
    head = (f"{'module':18} {'thr':>3} {'kernel us':>10} {'call us':>8} {'overhead us':>12} "
            f"{'other arrays us':>16} {'overhead us':>12} {'numpy arrays us':>16}")
    print(head)
    print("-" * len(head))
    for name, threads, b in rows:
        print(f"{name:18} {threads:>3} {b['kernel']:>10.2f} {b['call']:>8.2f} {b['call'] - b['kernel']:>12.2f} "
              f"{b['call (other arrays)']:>16.2f} {b['call (other arrays)'] - b['kernel (other arrays)']:>12.2f} "
              f"{b['call (numpy arrays)']:>16.2f}")
    worst = max(max(b["call"] - b["kernel"], b["call (other arrays)"] - b["kernel (other arrays)"]) for _, _, b in rows)
    print(f"largest overhead of a call over its kernel: {worst:.2f} us (target <= 5 us)")


if __name__ == "__main__":
    main()
