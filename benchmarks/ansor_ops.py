"""Ansor's single-operator set: tuned latency against numpy/OpenBLAS,
PyTorch CPU eager, `torch.compile` (inductor, max-autotune-no-cudagraphs) and
IREE (`iree_peer.py`: its best and its default flags, on the same MLIR we
tune), measured in the same run, at each thread count; the ratio to the best
peer per op, its median and lowest per thread count, and the peers' compile
times.

For every workload of `mlir_ansor.examples.workloads.ANSOR_SET` (C1D, C2D, C3D, GMM,
GRP, DIL, DEP, NRM, SFM, conv + bias + ReLU, transpose + batch matmul, and
T2D, which Linalg writes as phases of 1x1 convolutions) and thread count: tune with `--trials` candidates,
compile the module with the best records (`mlir_ansor.compile`), check it
against the untuned module, and time it; time the same computation in numpy
(where it has one) and in PyTorch (channels-last convolutions,
`torch.set_num_threads`) in the same process, in turns with our kernel
(`timing.interleaved_medians`: five rounds, each turn 0.3 s of warm-up then
0.5 s timed; each system's median of its round medians, so a load that
drifts over seconds moves all of them), and
print one table of latencies, GFLOP/s and ratios (>1 means mlir-ansor is faster).

Usage:
  python benchmarks/ansor_ops.py [--ops GMM,C2D] [--threads 1,2] [--trials 200] [--peers numpy,torch,compile,iree]
PyTorch is optional (`pip install torch==2.13.0`); without it that column is "-".
IREE: `bash benchmarks/setup_peers.sh --iree` (its own venv); in-process peers are
timed in turns with ours, IREE's `iree-benchmark-module` right after.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from mlir_ansor import TuneConfig, compile, tune  # noqa: A004
from mlir_ansor.compiler import compile_untuned
from mlir_ansor.examples import workloads  # noqa: A004
from mlir_ansor.graph.task import extract_tasks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from iree_peer import DEFAULT_IREE_PYTHON, Iree  # noqa: E402
from timing import interleaved_medians, median_time  # noqa: E402

_time = median_time


def peer_kernels(name: str, arrays: list[np.ndarray], threads: int) -> dict[str, Callable[[], object]]:
    """Callables running the computation of `workloads.ANSOR_SET[name]` on
    `arrays` (its inputs) in numpy ("numpy") and PyTorch CPU ("torch"), set
    up for `threads` threads (time them inside `peer_settings(threads)`); a
    system with no such computation, or not installed, is left out."""
    out: dict[str, Callable[[], object]] = {}
    np_fn = {
        "GMM": lambda a, b: a @ b,
        "NRM": lambda x: x.sum(axis=1),
        "SFM": lambda x: (lambda e: e / e.sum(1, keepdims=True))(np.exp(x - x.max(1, keepdims=True))),
        "TBG": lambda q, k: np.matmul(q.transpose(1, 0, 2), k.transpose(1, 2, 0)),
    }.get(name)
    if np_fn is not None:
        out["numpy"] = lambda: np_fn(*arrays)
    try:
        import torch
        import torch.nn.functional as F  # noqa: N812
    except ImportError:
        return out
    torch.set_num_threads(threads)
    t = [torch.from_numpy(a) for a in arrays]

    def nhwc_conv(x, k, stride=1, dilation=1, groups=1, bias=None, relu=False):
        # NHWC input, HWCF filter -> torch NCHW views in channels-last memory.
        xin = x.permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
        w = k.permute(3, 2, 0, 1).contiguous()
        def run():
            y = F.conv2d(xin, w, bias=bias, stride=stride, dilation=dilation, groups=groups)
            return F.relu(y) if relu else y
        return run

    fn = None
    if name == "GMM":
        fn = lambda: torch.mm(t[0], t[1])  # noqa: E731
    elif name == "C2D":
        fn = nhwc_conv(t[0], t[1])
    elif name == "DIL":
        fn = nhwc_conv(t[0], t[1], dilation=2)
    elif name == "CBR":
        fn = nhwc_conv(t[0], t[1], bias=t[2], relu=True)
    elif name == "DEP":
        x = t[0].permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
        w = t[1].permute(2, 0, 1).unsqueeze(1).contiguous()
        fn = lambda: F.conv2d(x, w, groups=w.shape[0])  # noqa: E731
    elif name == "C1D":
        x = t[0].permute(0, 2, 1).contiguous()
        w = t[1].permute(2, 1, 0).contiguous()
        fn = lambda: F.conv1d(x, w)  # noqa: E731
    elif name == "C3D":
        x = t[0].permute(0, 4, 1, 2, 3).contiguous(memory_format=torch.channels_last_3d)
        w = t[1].permute(4, 3, 0, 1, 2).contiguous()
        fn = lambda: F.conv3d(x, w)  # noqa: E731
    elif name == "T2D":
        # Transposed convolution, stride 2, padding 1 (ANSOR_SET's T2D);
        # torch's filter is (c_in, c_out, kh, kw).
        x = t[0].permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
        w = t[1].permute(2, 3, 0, 1).contiguous()
        fn = lambda: F.conv_transpose2d(x, w, stride=2, padding=1)  # noqa: E731
    elif name == "GRP":
        n, h, w_, g, c = t[0].shape
        x = t[0].reshape(n, h, w_, g * c).permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
        g_, f, kh, kw, c_ = t[1].shape
        wt = t[1].permute(0, 1, 4, 2, 3).reshape(g_ * f, c_, kh, kw).contiguous()
        fn = lambda: F.conv2d(x, wt, groups=g_)  # noqa: E731
    elif name == "NRM":
        fn = lambda: t[0].sum(dim=1)  # noqa: E731
    elif name == "SFM":
        fn = lambda: torch.softmax(t[0], dim=1)  # noqa: E731
    elif name == "TBG":
        fn = lambda: torch.bmm(t[0].permute(1, 0, 2), t[1].permute(1, 2, 0))  # noqa: E731
    if fn is not None:
        out["torch"] = fn
    return out


def torch_compiled(name: str, arrays: list[np.ndarray], threads: int) -> tuple[Callable[[], object] | None, float]:
    """PyTorch's computation of `name` through ``torch.compile`` (inductor,
    ``mode="max-autotune-no-cudagraphs"``) and its compile time (the first
    call); (None, nan) without PyTorch or a torch form of `name`."""
    fn = peer_kernels(name, arrays, threads).get("torch")
    if fn is None:
        return None, math.nan
    import torch

    compiled = torch.compile(fn, mode="max-autotune-no-cudagraphs")
    t0 = time.perf_counter()
    with peer_settings(threads):
        compiled()
    return compiled, time.perf_counter() - t0


@contextlib.contextmanager
def peer_settings(threads: int) -> Iterator[None]:
    """What the peers are timed under: numpy's BLAS (and every OpenMP
    runtime threadpoolctl finds) limited to `threads` threads, where
    threadpoolctl is installed, and PyTorch's autograd off, where PyTorch is
    (entered once here, not on every timed call)."""
    with contextlib.ExitStack() as stack:
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:  # pragma: no cover - optional
            pass
        else:
            stack.enter_context(threadpool_limits(limits=threads))
        try:
            import torch
        except ImportError:  # pragma: no cover - optional
            pass
        else:
            stack.enter_context(torch.no_grad())
        yield


def peer_latencies(name: str, arrays: list[np.ndarray], threads: int) -> dict[str, float]:
    """Latency (s) of each of `peer_kernels`, one after the other."""
    with peer_settings(threads):
        return {system: _time(fn) for system, fn in peer_kernels(name, arrays, threads).items()}


def time_in_turns(ours: Callable[[], object], peers: dict[str, Callable[[], object]], threads: int) -> dict[str, float]:
    """Median latency (s) of our kernel ("ours") and each peer, timed in
    turns (`timing.interleaved_medians`) so that all of them see the same
    machine."""
    with peer_settings(threads):
        return interleaved_medians({"ours": ours, **peers})


@dataclass
class Ours:
    """Our tuned kernel of one module, timed and checked."""

    latency_s: float  # median of the compiled module with the best records
    untuned_s: float  # median of the untuned lowering (nan when not timed)
    tune_s: float  # wall time of `tune` (references, baselines and search)
    trials: int  # candidates measured
    rel_err: float  # max |tuned - untuned| / max |untuned| on `arrays`
    output: np.ndarray  # the untuned lowering's output on `arrays` (a reference for peers)
    kernel: Callable[[], object]  # runs the tuned kernel on `arrays` (to time it again)


def random_inputs(path: str, threads: int = 1, seed: int = 0) -> list[np.ndarray]:
    """Seeded uniform(-1, 1) f32 inputs for the entry function of `path`."""
    ref = compile_untuned(path, threads=threads)
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, s).astype(np.float32) for s, _ in ref.functions[ref.entry][0]]


def tune_and_time(
    path: str, arrays: list[np.ndarray], config: TuneConfig, db: str, *, time_untuned: bool = True
) -> Ours:
    """Tune `path` with `config` into `db`, compile the best records, check
    them against the untuned lowering on `arrays`, and time both."""
    t0 = time.perf_counter()
    res = tune(path, config=config, db=db)
    tune_s = time.perf_counter() - t0
    cm = compile(path, db=db, threads=config.threads)
    ref = compile_untuned(path, threads=config.threads)
    got, want = np.asarray(cm(*arrays)), np.asarray(ref(*arrays))
    err = float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))
    run, _ = cm.bind(*arrays)
    ours = _time(run)
    untuned = math.nan
    if time_untuned:
        urun, _ = ref.bind(*arrays)
        untuned = _time(urun, min_time=0.2, min_repeat=1)
    return Ours(ours, untuned, tune_s, res.measured, err, want, run)


def _numpy_threads_unlimited() -> str | None:
    """A warning when numpy's BLAS cannot be held to the thread count (no
    threadpoolctl): its column would then compare against every core (a
    1-thread GEMM "0.49 of numpy" that was numpy on two cores)."""
    try:
        import threadpoolctl  # noqa: F401
    except ImportError:
        return (
            "warning: threadpoolctl is not installed (pip install -e '.[bench]'): numpy's BLAS runs on "
            "every core at each thread count, so 'vs numpy' is not a same-thread comparison"
        )
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=",".join(workloads.ANSOR_SET))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--trials", type=int, default=200, help="trials per workload")
    ap.add_argument("--search", default="evolutionary", help="our search strategy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", metavar="DIR", help="copy each tuning database (<op>_<threads>.db) into DIR")
    ap.add_argument("--peers", default="numpy,torch,compile,iree",
                    help="peers to time, of: numpy, torch (eager), compile (torch.compile), iree (both flag sets)")
    ap.add_argument("--iree-python", default=DEFAULT_IREE_PYTHON, help="python of IREE's env")
    args = ap.parse_args()
    wanted = {p.strip() for p in args.peers.split(",") if p.strip()}
    unlimited = _numpy_threads_unlimited()
    if unlimited:
        print(unlimited, file=sys.stderr)
    rows = []
    compile_times: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="ansor-ops-") as wd:
        iree = None
        if "iree" in wanted:
            if os.path.exists(args.iree_python):
                iree = Iree(args.iree_python, wd, ["best", "default"], min_time=0.5)
            else:
                print(f"IREE: no {args.iree_python} (bash benchmarks/setup_peers.sh --iree); not timed", file=sys.stderr)
        for name in args.ops.split(","):
            path = os.path.join(wd, f"{name}.mlir")
            with open(path, "w") as f:
                f.write(workloads.ANSOR_SET[name]())
            flops = sum(t.flops * t.weight for t in extract_tasks(path))
            arrays = random_inputs(path)
            work = None
            for threads in (int(x) for x in args.threads.split(",")):
                db = os.path.join(wd, f"{name}_{threads}.db")
                config = TuneConfig(trials=args.trials, threads=threads, seed=args.seed, strategy=args.search)
                o = tune_and_time(path, arrays, config, db)
                in_turns = {k: v for k, v in peer_kernels(name, arrays, threads).items() if k in wanted}
                compiled, compile_s = torch_compiled(name, arrays, threads) if "compile" in wanted else (None, math.nan)
                if compiled is not None:
                    in_turns["torch.compile"] = compiled
                    compile_times.setdefault(name, {})["torch.compile"] = compile_s
                peers = time_in_turns(o.kernel, in_turns, threads)
                ours = peers.pop("ours")
                if iree is not None:
                    work = work or SimpleNamespace(name=name, path=path, arrays=arrays, reference=[o.output])
                    timed, compiled_s = iree.latencies(work, threads)
                    peers.update({f"IREE {fs}": v for fs, v in timed.items()})
                    compile_times.setdefault(name, {}).update({f"IREE {fs}": v for fs, v in compiled_s.items()})
                rows.append((name, threads, ours, o.untuned_s, peers, flops, o.tune_s, o.rel_err, o.trials))
                if args.keep:
                    os.makedirs(args.keep, exist_ok=True)
                    shutil.copy(db, args.keep)
                print(
                    f"{name} x{threads}: {ours * 1e3:.3f} ms ({flops / ours / 1e9:.1f} GFLOP/s), "
                    f"tuned in {o.tune_s:.0f} s; "
                    + ", ".join(f"{system} {t * 1e3:.3f} ms" for system, t in peers.items()),
                    file=sys.stderr,
                    flush=True,
                )
    systems = [s for s in ("numpy", "torch", "torch.compile", "IREE best", "IREE default") if any(s in r[4] for r in rows)]
    hdr = (
        f"{'op':<5} {'thr':>3} {'ours ms':>9} {'GF/s':>7} {'untuned ms':>10} "
        + " ".join(f"{s + ' ms':>16}" for s in systems)
        + f" {'best peer':>13} {'vs best':>7} {'trials':>6} {'tune s':>6} {'rel err':>8}"
    )
    print(hdr)
    print("-" * len(hdr))
    fmt = lambda x: f"{x * 1e3:.3f}" if x is not None and math.isfinite(x) else "-"  # noqa: E731
    ratios: dict[int, list[float]] = {}
    for name, threads, ours, untuned, peers, flops, tune_s, err, n in rows:
        best = min(peers.items(), key=lambda kv: kv[1], default=(None, math.nan))
        vs = best[1] / ours if best[0] else math.nan
        if best[0]:
            ratios.setdefault(threads, []).append(vs)
        print(
            f"{name:<5} {threads:>3} {fmt(ours):>9} {flops / ours / 1e9:>7.1f} {fmt(untuned):>10} "
            + " ".join(f"{fmt(peers.get(s)):>16}" for s in systems)
            + f" {(best[0] or '-'):>13} {vs:>7.2f} {n:>6} {tune_s:>6.0f} {err:>8.1e}"
        )
    for threads, rs in ratios.items():
        print(f"{threads} thread(s): against the best peer, median {float(np.median(rs)):.2f}, lowest {min(rs):.2f} "
              f"({sum(r >= 1.0 for r in rs)} of {len(rs)} ops >= 1.0)")
    if compile_times:
        print("compile s: " + "; ".join(f"{op} " + ", ".join(f"{k} {v:.1f}" for k, v in c.items()) for op, c in compile_times.items()))
    if unlimited:
        print(unlimited)


if __name__ == "__main__":
    main()
