"""TVM MetaSchedule as a peer of `peers.py`: tune workloads, re-time the best.

Runs in TVM's own virtual env (`bash benchmarks/setup_peers.sh` makes
`.venv-tvm`), as a subprocess of `peers.py`, which writes the inputs:

  .venv-tvm/bin/python benchmarks/peers_tvm.py --work-dir DIR --ops GMM,C2D \\
      [--models resnet50] --trials 64 --threads 1 [--batch-size 16] [--seed 0]
  .venv-tvm/bin/python benchmarks/peers_tvm.py --work-dir DIR --ops GMM,C2D --time-only

For every op NAME, `DIR/NAME.in.npz` holds its input arrays (`arr_0`, ...,
in the order of our `@func`'s arguments; their shapes give the workload's
sizes). The op is written in TVM's tensor expressions (`WORKLOADS`: the same
computation as `mlir_ansor.examples.workloads.ANSOR_SET[NAME]`), made a PrimFunc,
tuned by MetaSchedule with `--trials` measured candidates (evolutionary
search, XGBoost cost model, as MetaSchedule ships), then the best schedule is
built again and timed in this process with `timing.median_time`, the loop
that times our kernels. Its output on the inputs goes to `DIR/NAME.tvm.npy`,
for `peers.py` to check against ours, and the built library to
`DIR/NAME.tvm.so`, which `--time-only` times again. Models (`--models`) come
as `DIR/NAME.pt2` (torch.export) and go through the Relax frontend and
`tune_relax`. One JSON object goes to stdout:
`{"tvm": VERSION, "target": ..., "results": {NAME: {"tune_s", "latency_s",
"trials", "valid", "errors"} or {"error": MESSAGE}}}`.

What MetaSchedule needs on TVM 0.27 (see also benchmarks/setup_peers.sh):
- its default builder imports `tvm.s_tir.tensor_intrin` in every fresh worker
  pool (about 30 s here, mostly CUDA intrinsics), longer than the default 30 s
  build timeout, so every candidate fails: `_build` is the default build
  without that import (no f32 CPU schedule tensorizes with those intrinsics);
- the runtime's thread pool uses half the logical cores unless
  `TVM_NUM_THREADS` is set: `main` sets it to `--threads` before importing tvm.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _conv(te, inp, ker, *, dims: int, dilation: int = 1, out_name: str = "conv"):
    """N(D)(H)WC input, (KD)(KH)KW-C-F kernel, stride 1: our linalg.conv_*_n*wc_*cf."""
    n, *spatial, c = inp.shape
    *ks, _, f = ker.shape
    outs = [int(s) - dilation * (int(k) - 1) for s, k in zip(spatial, ks)]
    rk = [te.reduce_axis((0, int(k)), name=f"r{i}") for i, k in enumerate(ks)]
    rc = te.reduce_axis((0, int(c)), name="rc")

    def body(*idx):
        b, *xs, ff = idx
        pos = [x + dilation * r for x, r in zip(xs, rk)]
        return te.sum(inp[(b, *pos, rc)] * ker[(*rk, rc, ff)], axis=[*rk, rc])

    return te.compute((int(n), *outs, int(f)), body, name=out_name)


def _t2d(te, inp, ker, *, stride: int = 2, pad: int = 1):
    """Transposed conv (our workloads.conv2d_transpose_nhwc), as TVM's topi
    writes it: the input with zeros inserted between pixels and padded, then
    a convolution with the flipped (kh, kw, c, f) kernel."""
    import tvm

    n, h, w, c = (int(x) for x in inp.shape)
    kh, kw, _, f = (int(x) for x in ker.shape)
    bh, bw = kh - 1 - pad, kw - 1 - pad
    dh, dw = (h - 1) * stride + 1 + 2 * bh, (w - 1) * stride + 1 + 2 * bw
    zero = tvm.tirx.const(0.0, "float32")

    def dilated(b, y, x, cc):
        yy, xx = y - bh, x - bw
        inside = tvm.tirx.all(yy >= 0, yy < (h - 1) * stride + 1, yy % stride == 0, xx >= 0, xx < (w - 1) * stride + 1, xx % stride == 0)
        return tvm.tirx.if_then_else(inside, inp[b, yy // stride, xx // stride, cc], zero)

    data = te.compute((n, dh, dw, c), dilated, name="dilated")
    ry, rx, rc = te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx"), te.reduce_axis((0, c), "rc")
    return te.compute(
        (n, dh - kh + 1, dw - kw + 1, f),
        lambda b, y, x, ff: te.sum(data[b, y + ry, x + rx, rc] * ker[kh - 1 - ry, kw - 1 - rx, rc, ff], axis=[ry, rx, rc]),
        name="t2d",
    )


def _gmm(te, a, b):
    m, k = a.shape
    _, n = b.shape
    r = te.reduce_axis((0, int(k)), name="k")
    return te.compute((int(m), int(n)), lambda i, j: te.sum(a[i, r] * b[r, j], axis=r), name="C")


def _grp(te, inp, ker):
    """Grouped conv, NHWGC input, GFHWC kernel (our linalg.conv_2d_nhwgc_gfhwc)."""
    n, h, w, g, c = (int(x) for x in inp.shape)
    _, f, kh, kw, _ = (int(x) for x in ker.shape)
    ry, rx, rc = te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx"), te.reduce_axis((0, c), "rc")
    return te.compute(
        (n, h - kh + 1, w - kw + 1, g, f),
        lambda b, y, x, gg, ff: te.sum(inp[b, y + ry, x + rx, gg, rc] * ker[gg, ff, ry, rx, rc], axis=[ry, rx, rc]),
        name="grp",
    )


def _dep(te, inp, ker):
    n, h, w, c = (int(x) for x in inp.shape)
    kh, kw, _ = (int(x) for x in ker.shape)
    ry, rx = te.reduce_axis((0, kh), "ry"), te.reduce_axis((0, kw), "rx")
    return te.compute(
        (n, h - kh + 1, w - kw + 1, c),
        lambda b, y, x, cc: te.sum(inp[b, y + ry, x + rx, cc] * ker[ry, rx, cc], axis=[ry, rx]),
        name="dep",
    )


def _nrm(te, x):
    m, n = (int(v) for v in x.shape)
    r = te.reduce_axis((0, n), "j")
    return te.compute((m,), lambda i: te.sum(x[i, r], axis=r), name="rowsum")


def _sfm(te, x):
    import tvm

    m, n = (int(v) for v in x.shape)
    r1, r2 = te.reduce_axis((0, n), "j1"), te.reduce_axis((0, n), "j2")
    mx = te.compute((m,), lambda i: te.max(x[i, r1], axis=r1), name="rowmax")
    sm = te.compute((m,), lambda i: te.sum(tvm.tirx.exp(x[i, r2] - mx[i]), axis=r2), name="expsum")
    return te.compute((m, n), lambda i, j: tvm.tirx.exp(x[i, j] - mx[i]) / sm[i], name="softmax")


def _cbr(te, inp, ker, bias):
    import tvm

    conv = _conv(te, inp, ker, dims=2)
    zero = tvm.tirx.const(0.0, "float32")
    return te.compute(conv.shape, lambda b, y, x, f: te.max(conv[b, y, x, f] + bias[f], zero), name="cbr")


def _tbg(te, q, k):
    """Transpose + batch matmul: Q, K as (seq, heads, dim) -> (heads, seq, seq)."""
    s, h, d = (int(v) for v in q.shape)
    qt = te.compute((h, s, d), lambda b, i, j: q[i, b, j], name="q_t")
    kt = te.compute((h, d, s), lambda b, i, j: k[j, b, i], name="k_t")
    r = te.reduce_axis((0, d), "d")
    return te.compute((h, s, s), lambda b, i, j: te.sum(qt[b, i, r] * kt[b, r, j], axis=r), name="bmm")


WORKLOADS = {
    "GMM": _gmm,
    "C1D": lambda te, i, k: _conv(te, i, k, dims=1),
    "C2D": lambda te, i, k: _conv(te, i, k, dims=2),
    "C3D": lambda te, i, k: _conv(te, i, k, dims=3),
    "DIL": lambda te, i, k: _conv(te, i, k, dims=2, dilation=2),
    "GRP": _grp,
    "DEP": _dep,
    "T2D": _t2d,
    "NRM": _nrm,
    "SFM": _sfm,
    "CBR": _cbr,
    "TBG": _tbg,
}
"""Op name (as in mlir_ansor.examples.workloads.ANSOR_SET) -> builder(te, *placeholders)
returning the output tensor."""


def _build(mod, target, _params):
    """MetaSchedule's default build, without importing `tvm.s_tir.tensor_intrin`
    (about 30 s per fresh worker pool, which the default timeout kills)."""
    from tvm.driver import build as tvm_build
    from tvm.s_tir.transform import RemoveWeightLayoutRewriteBlock

    mod = RemoveWeightLayoutRewriteBlock(skip_tensor_rewrite=True)(mod)
    return tvm_build(mod, target=target)


def _tune_one(name: str, args: argparse.Namespace, target) -> dict:
    import numpy as np
    import tvm
    from timing import median_time
    from tvm import te
    from tvm.s_tir import meta_schedule as ms

    data = np.load(os.path.join(args.work_dir, f"{name}.in.npz"))
    arrays = [data[f"arr_{i}"] for i in range(len(data.files))]
    phs = [te.placeholder(a.shape, dtype=str(a.dtype), name=f"in{i}") for i, a in enumerate(arrays)]
    out = WORKLOADS[name](te, *phs)
    func = te.create_prim_func([*phs, out])
    work = os.path.join(args.work_dir, f"tvm-{name}")
    builder = ms.builder.LocalBuilder(f_build=_build, timeout_sec=args.build_timeout)
    t0 = time.perf_counter()
    db = ms.tir_integration.tune_tir(
        mod=func,
        target=target,
        work_dir=work,
        max_trials_global=args.trials,
        num_trials_per_iter=args.batch_size,
        builder=builder,
        num_tuning_cores=os.cpu_count() or 1,
        seed=args.seed,
    )
    tune_s = time.perf_counter() - t0
    records = db.get_all_tuning_records()
    valid = [r for r in records if r.run_secs and all(float(s) < 1e9 for s in r.run_secs)]
    sch = ms.tir_integration.compile_tir(db, func, target)
    if sch is None:
        return {"error": f"no valid schedule among {len(records)} measured candidates (logs: {work}/logs)",
                "tune_s": tune_s, "trials": len(records)}
    lib = tvm.compile(sch.mod, target=target)
    dev = tvm.cpu(0)
    tin = [tvm.runtime.tensor(a, dev) for a in arrays]
    tout = tvm.runtime.empty(tuple(int(x) for x in out.shape), str(out.dtype), dev)
    fn = lib["main"]
    fn(*tin, tout)
    np.save(os.path.join(args.work_dir, f"{name}.tvm.npy"), tout.numpy())
    latency = median_time(lambda: fn(*tin, tout))
    lib.export_library(os.path.join(args.work_dir, f"{name}.tvm.so"))  # for --time-only
    return {
        "tune_s": tune_s,
        "latency_s": latency,
        "trials": len(records),
        "valid": len(valid),
        "errors": len(records) - len(valid),
    }


def _tune_model(name: str, args: argparse.Namespace, target) -> dict:
    """Import `DIR/NAME.pt2` (a torch.export program) with TVM's Relax
    frontend, tune its tasks with MetaSchedule (`--trials` in total, the
    gradient task scheduler), compile (untuned tasks get DLight's default
    schedules), run and time it on `DIR/NAME.in.npz`."""
    import numpy as np
    import torch
    import tvm
    from timing import median_time
    from tvm import relax
    from tvm.relax.frontend.torch import from_exported_program
    from tvm.s_tir import meta_schedule as ms

    data = np.load(os.path.join(args.work_dir, f"{name}.in.npz"))
    arrays = [data[f"arr_{i}"] for i in range(len(data.files))]
    # Weights stay constants in the module (detach_params' list of tensors is
    # not the dict BindParams wants). tune_relax extracts tasks from PrimFuncs
    # only: legalize and fuse first, as compile_relax does before applying the
    # database (the same passes, so the workload keys match).
    mod = from_exported_program(torch.export.load(os.path.join(args.work_dir, f"{name}.pt2")))
    fused = tvm.transform.Sequential([
        *relax.pipeline.library_dispatch_passes(target),
        relax.transform.LegalizeOps(),
        relax.transform.AnnotateTIROpPattern(),
        relax.transform.FoldConstant(),
        relax.transform.FuseOps(),
        relax.transform.FuseTIR(),
    ])(mod)
    work = os.path.join(args.work_dir, f"tvm-{name}")
    builder = ms.builder.LocalBuilder(f_build=_build, timeout_sec=args.build_timeout)
    t0 = time.perf_counter()
    db = ms.relax_integration.tune_relax(
        fused, None, target, work, max_trials_global=args.trials,
        num_trials_per_iter=args.batch_size, builder=builder, seed=args.seed,
    )
    tune_s = time.perf_counter() - t0
    records = db.get_all_tuning_records()
    ex = ms.relax_integration.compile_relax(db, mod, target, None)
    vm = relax.VirtualMachine(ex, tvm.cpu(0))
    tin = [tvm.runtime.tensor(a) for a in arrays]
    out = vm["main"](*tin)
    while not hasattr(out, "numpy"):  # a (nested) tuple of results: the first
        out = out[0]
    np.save(os.path.join(args.work_dir, f"{name}.tvm.npy"), out.numpy())
    latency = median_time(lambda: vm["main"](*tin), min_time=1.0, min_repeat=3)
    valid = [r for r in records if r.run_secs and all(float(s) < 1e9 for s in r.run_secs)]
    return {"tune_s": tune_s, "latency_s": latency, "trials": len(records), "valid": len(valid),
            "errors": len(records) - len(valid)}


def _time_again(name: str, args: argparse.Namespace) -> dict:
    """Time `DIR/NAME.tvm.so` (the best schedule, exported after tuning) on
    `DIR/NAME.in.npz` once more: `peers.py` re-times every system at the end,
    in the same window, so that load from other processes hits both alike."""
    import numpy as np
    import tvm
    from timing import median_time

    data = np.load(os.path.join(args.work_dir, f"{name}.in.npz"))
    arrays = [data[f"arr_{i}"] for i in range(len(data.files))]
    want = np.load(os.path.join(args.work_dir, f"{name}.tvm.npy"))
    fn = tvm.runtime.load_module(os.path.join(args.work_dir, f"{name}.tvm.so"))["main"]
    dev = tvm.cpu(0)
    tin = [tvm.runtime.tensor(a, dev) for a in arrays]
    tout = tvm.runtime.empty(want.shape, str(want.dtype), dev)
    return {"latency_s": median_time(lambda: fn(*tin, tout))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", required=True, help="folder holding NAME.in.npz; results go there too")
    ap.add_argument("--ops", default="", help="comma-separated op names: " + ",".join(WORKLOADS))
    ap.add_argument("--models", default="", help="comma-separated model names (DIR/NAME.pt2, needs torch)")
    ap.add_argument("--trials", type=int, default=64, help="measured candidates per op")
    ap.add_argument("--threads", type=int, default=1, help="threads the kernels run on")
    ap.add_argument("--batch-size", type=int, default=16, help="candidates per search iteration")
    ap.add_argument("--build-timeout", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--time-only", action="store_true", help="no tuning: time the exported best of each op again")
    args = ap.parse_args()
    # Before tvm is imported: its runtime reads this once (default: half the cores).
    os.environ["TVM_NUM_THREADS"] = str(args.threads)
    import tvm
    from tvm.target import Target, codegen

    ops = [n for n in args.ops.split(",") if n]
    models = [n for n in args.models.split(",") if n]
    unknown = [n for n in ops if n not in WORKLOADS]
    if unknown:
        sys.exit(f"peers_tvm.py: no TVM description of {', '.join(unknown)} (known: {', '.join(WORKLOADS)})")
    target = Target({"kind": "llvm", "mcpu": codegen.llvm_get_system_cpu(), "num-cores": args.threads})
    if args.time_only:
        json.dump({"tvm": tvm.__version__, "results": {n: _time_again(n, args) for n in ops}}, sys.stdout)
        print()
        return
    # One-time cost, paid by MetaSchedule's first tuning context in a process
    # (the space generator imports every tensor intrinsic): taken out of the
    # per-workload tuning times, reported on its own.
    t0 = time.perf_counter()
    import tvm.s_tir.tensor_intrin  # noqa: F401
    startup_s = time.perf_counter() - t0
    results = {}
    for name, fn in [(n, _tune_one) for n in ops] + [(n, _tune_model) for n in models]:
        try:
            results[name] = fn(name, args, target)
        except Exception as e:  # one workload failing must not lose the others' figures
            traceback.print_exc()
            results[name] = {"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        print(f"tvm {name}: {results[name]}", file=sys.stderr, flush=True)
    json.dump({"tvm": tvm.__version__, "target": str(target), "startup_s": startup_s, "results": results}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
