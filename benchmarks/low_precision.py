"""Low precision on the CPU: bf16 and int8 against f32, against IREE and PyTorch, in one run.

Workloads (`--ops`, all by default), each at every `--threads` count:

- ``gemm_f32``, ``gemm_bf16``, ``gemm_i8``: C = A . B, 1024x1024x1024;
  f32 -> f32, bf16 inputs with f32 accumulation and output
  (``linalg.matmul ins(tensor<1024x1024xbf16>, tensor<1024x1024xbf16>) outs(tensor<1024x1024xf32>)``),
  i8 inputs with i32 accumulation and output;
- ``conv_f32``, ``conv_bf16``, ``conv_i8``: ResNet's 3x3 64->64 convolution on
  56x56 (ANSOR_SET's C2D: NHWC input 1x58x58x64, already padded, HWCF filter,
  ``linalg.conv_2d_nhwc_hwcf``), with the same element types as the GEMMs;
- ``bert_bf16``: the BERT-base layer of `mlir_ansor.examples.models`
  (sequence 128) converted with ``.to(torch.bfloat16)`` and imported with
  torch-mlir (``output_type="linalg-on-tensors"``).

Systems (`--only`, all by default), on the same seeded inputs:

- ``ours``: mlir-ansor, as `ansor_ops.py` drives it: ``tune`` with `--trials`
  measured candidates, ``compile`` with the best records, the output checked
  against numpy (float64), the bound kernel timed. A failing step leaves the
  row's figure empty and the table says why (the error's first line); the
  other systems and rows still run.
- ``iree``: IREE 3.13 (`benchmarks/peers_iree.py` in `.venv-iree`, made by
  ``bash benchmarks/setup_peers.sh --iree``), with its best CPU flags (O2,
  data tiling, micro-kernels), and with ``--iree-default`` also its default
  flags as a second figure; compiled once per workload (compile time in the
  table), checked with ``iree-run-module``, timed with ``iree-benchmark-module``.
- ``torch``: PyTorch eager (oneDNN): ``torch.mm`` on f32 and bf16 tensors
  (bf16 output), ``torch._int_mm`` for int8 (int32 output), channels-last
  ``F.conv2d`` in f32 and bf16 (PyTorch eager has no int8 convolution outside
  its quantized backends: "-"), the bf16 model for BERT.
- ``numpy``: numpy/OpenBLAS, f32 GEMM only, in a child process (each round)
  with the BLAS thread count pinned and this machine's OPENBLAS_CORETYPE /
  OPENBLAS_L2_SIZE overrides removed, as `gemm_core.py` times it.

Timing: the systems of a row are timed in turns, `--rounds` rounds: in each,
every in-process system gets `timing.median_time` (0.3 s untimed warm-up,
then at least `--min-time` seconds), and numpy and IREE one call of their
timer in a child process (the same warm-up and time; IREE's is
``iree-benchmark-module``'s real time per iteration); each figure is the median of its round medians, so a load that
drifts over seconds (other jobs on the machine) moves all of them alike.

Ratios are of throughput (a peer's latency over ours; > 1: ours is faster);
``/our-f32`` compares with our f32 row of the same kind and thread count.
Targets (issue #23), checked at every thread count:

- GEMM bf16 and i8: >= 1.7x our f32 GEMM and >= 1.1x IREE;
- conv bf16 and i8: >= 1.5x our f32 conv;
- on a host without AVX-512 (AVX2 only), the int8 rows' f32 target is 1.3x,
  and the bf16 rows (computed in f32: no bf16 instruction) are only checked;
  ``--target cpu:znver3`` builds ours for an AVX2-only CPU (Zen 3: AVX2 and
  FMA, no AVX-512) on an AVX-512 host, which runs that code too: the AVX2
  rows' correctness and their ratio to our own f32, on this host's core
  (the peers keep their own code for the host);
- bf16 BERT: >= 1.2x PyTorch bf16 eager and >= 1.0x IREE.

Usage:
  bash benchmarks/setup_peers.sh --iree
  .venv/bin/python benchmarks/low_precision.py [--trials 200] [--threads 1,2] [--ops gemm_bf16,conv_i8]
      [--only iree,torch] [--iree-default] [--json lp.json] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from iree_peer import DEFAULT_IREE_PYTHON, Iree  # noqa: E402
from timing import median_time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SYSTEMS = ("ours", "iree", "torch", "numpy")

# Element types of each precision: (inputs, accumulator and output).
PRECISIONS = {"f32": ("f32", "f32"), "bf16": ("bf16", "f32"), "i8": ("i8", "i32")}

GEMM_N = 1024
CONV = dict(n=1, h=58, w=58, c=64, f=64, k=3)  # ANSOR_SET's C2D: 56x56 output
BERT = dict(seq=128, hidden=768, heads=12, ffn=3072)


# --------------------------------------------------------------------------
# The workloads as Linalg on tensors.


def _t(shape: tuple[int, ...], dtype: str) -> str:
    return "tensor<" + "x".join(str(d) for d in shape) + f"x{dtype}>"


def _zero(dtype: str) -> str:
    return f"arith.constant {'0.0' if dtype.startswith(('f', 'bf')) else '0'} : {dtype}"


def gemm_mlir(n: int, in_t: str, acc_t: str) -> str:
    """C(n, n) = A(n, n) . B(n, n), inputs `in_t`, accumulated and returned in
    `acc_t` (linalg.matmul extends the inputs: extf for floats, sign-extension for integers)."""
    a, c = _t((n, n), in_t), _t((n, n), acc_t)
    return (
        f"func.func @matmul(%A: {a}, %B: {a}) -> {c} {{\n"
        f"  %zero = {_zero(acc_t)}\n"
        f"  %empty = tensor.empty() : {c}\n"
        f"  %init = linalg.fill ins(%zero : {acc_t}) outs(%empty : {c}) -> {c}\n"
        f"  %r = linalg.matmul ins(%A, %B : {a}, {a}) outs(%init : {c}) -> {c}\n"
        f"  return %r : {c}\n}}\n"
    )


def conv_mlir(n: int, h: int, w: int, c: int, f: int, k: int, in_t: str, acc_t: str) -> str:
    """NHWC x HWCF -> NHWF convolution, stride 1, `h`, `w` the padded input sizes."""
    out = (n, h - k + 1, w - k + 1, f)
    ti, tk, to = _t((n, h, w, c), in_t), _t((k, k, c, f), in_t), _t(out, acc_t)
    return (
        f"func.func @conv2d(%I: {ti}, %K: {tk}) -> {to} {{\n"
        f"  %zero = {_zero(acc_t)}\n"
        f"  %empty = tensor.empty() : {to}\n"
        f"  %init = linalg.fill ins(%zero : {acc_t}) outs(%empty : {to}) -> {to}\n"
        "  %r = linalg.conv_2d_nhwc_hwcf {dilations = dense<1> : tensor<2xi64>, strides = dense<1> : tensor<2xi64>}\n"
        f"      ins(%I, %K : {ti}, {tk}) outs(%init : {to}) -> {to}\n"
        f"  return %r : {to}\n}}\n"
    )


def conv_ref(x: np.ndarray, k: np.ndarray) -> np.ndarray:
    """The convolution in float64 (exact for the int8 inputs)."""
    x, k = x.astype(np.float64), k.astype(np.float64)
    kh, kw = k.shape[:2]
    oh, ow = x.shape[1] - kh + 1, x.shape[2] - kw + 1
    out = np.zeros((x.shape[0], oh, ow, k.shape[3]))
    for i in range(kh):
        for j in range(kw):
            out += np.tensordot(x[:, i:i + oh, j:j + ow, :], k[i, j], axes=([3], [0]))
    return out


def bert_flops() -> int:
    """Multiply-adds x 2 of the layer's matmuls: Q, K, V, output projection,
    the two FFN matmuls, and the attention's two batch matmuls."""
    s, h, heads, ffn = BERT["seq"], BERT["hidden"], BERT["heads"], BERT["ffn"]
    return 2 * s * h * h * 4 + 2 * 2 * s * h * ffn + 2 * 2 * heads * s * s * (h // heads)


def _np_type(dtype: str):
    if dtype == "bf16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return {"f32": np.float32, "i8": np.int8, "i32": np.int32}[dtype]


def _draw(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    if dtype == "i8":
        return rng.integers(-128, 128, size=shape).astype(np.int8)
    return rng.uniform(-1, 1, size=shape).astype(np.float32).astype(_np_type(dtype))


@dataclass
class Workload:
    """One row kind: its MLIR file, inputs, float64 reference, FLOP count."""

    name: str
    kind: str  # "gemm", "conv" or "bert"
    dtype: str  # the inputs' precision: "f32", "bf16" or "i8"
    label: str
    path: str
    arrays: list[np.ndarray]
    reference: list[np.ndarray]
    flops: int
    torch_fn: Callable[[int], Callable[[], object] | None] | None = None  # threads -> callable
    torch_note: str = ""


def make_workload(name: str, wd: str, seed: int) -> Workload:
    """Write `name`'s module to `wd`, draw its inputs, compute its reference."""
    if name == "bert_bf16":
        return _bert_workload(wd, seed)
    if name not in OPS:
        raise SystemExit(f"low_precision.py: unknown workload {name} (known: {', '.join(OPS)})")
    kind, dtype = name.split("_")
    rng = np.random.default_rng(seed)
    in_t, acc_t = PRECISIONS[dtype]
    path = os.path.join(wd, f"{name}.mlir")
    if kind == "gemm":
        n = GEMM_N
        text = gemm_mlir(n, in_t, acc_t)
        arrays = [_draw(rng, (n, n), in_t), _draw(rng, (n, n), in_t)]
        ref = [arrays[0].astype(np.float64) @ arrays[1].astype(np.float64)]
        flops, label = 2 * n**3, f"GEMM {n} {in_t}->{acc_t}"
    elif kind == "conv":
        cv = CONV
        text = conv_mlir(cv["n"], cv["h"], cv["w"], cv["c"], cv["f"], cv["k"], in_t, acc_t)
        arrays = [_draw(rng, (cv["n"], cv["h"], cv["w"], cv["c"]), in_t), _draw(rng, (cv["k"], cv["k"], cv["c"], cv["f"]), in_t)]
        ref = [conv_ref(*arrays)]
        oh, ow = cv["h"] - cv["k"] + 1, cv["w"] - cv["k"] + 1
        flops = 2 * cv["n"] * oh * ow * cv["f"] * cv["k"] ** 2 * cv["c"]
        label = f"conv 3x3 {oh}x{ow}x{cv['c']}->{cv['f']} {in_t}->{acc_t}"
    else:
        raise SystemExit(f"low_precision.py: unknown workload kind {kind}")
    with open(path, "w") as f:
        f.write(text)
    w = Workload(name, kind, dtype, label, path, arrays, ref, flops)
    w.torch_fn, w.torch_note = _torch_op(w)
    return w


def _bert_workload(wd: str, seed: int) -> Workload:
    """The bf16 BERT layer: exported with torch-mlir (in a child process, by
    `mlir_ansor.importers.pytorch.import_module`); the reference is the same
    bf16-rounded weights and input computed in f32 by PyTorch."""
    import torch

    from mlir_ansor.examples.models import bert_layer
    from mlir_ansor.importers.pytorch import import_module

    model, (x,) = bert_layer(seed)
    model_bf16, x_bf16 = model.to(torch.bfloat16).eval(), x.to(torch.bfloat16)
    path = os.path.join(wd, "bert_bf16.mlir")
    with open(path, "w") as f:
        f.write(import_module(model_bf16, (x_bf16,)))
    ref_model = bert_layer(seed)[0].to(torch.bfloat16).float().eval()
    with torch.no_grad():
        ref = ref_model(x_bf16.float()).double().numpy()
    arrays = [x_bf16.view(torch.int16).numpy().view(_np_type("bf16"))]

    def torch_fn(threads: int) -> Callable[[], object]:
        torch.set_num_threads(threads)
        return lambda: model_bf16(x_bf16)

    return Workload("bert_bf16", "bert", "bf16", f"BERT layer seq {BERT['seq']} bf16", path, arrays, [ref],
                    bert_flops(), torch_fn, "bf16 model, eager")


def _to_torch(a: np.ndarray):
    import torch

    if str(a.dtype) == "bfloat16":
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


def _torch_op(w: Workload) -> tuple[Callable[[int], Callable[[], object] | None] | None, str]:
    """PyTorch eager's version of a GEMM or conv row (None: it has none), and what it computes."""
    try:
        import torch
        import torch.nn.functional as F  # noqa: N812
    except ImportError:
        return None, "torch not installed"
    if w.kind == "conv" and w.dtype == "i8":
        return None, "no int8 convolution in PyTorch eager (only in its quantized backends)"
    a, b = (_to_torch(x) for x in w.arrays)

    def make(threads: int) -> Callable[[], object]:
        torch.set_num_threads(threads)
        if w.kind == "gemm":
            return (lambda: torch._int_mm(a, b)) if w.dtype == "i8" else (lambda: torch.mm(a, b))
        x = a.permute(0, 3, 1, 2).contiguous(memory_format=torch.channels_last)
        k = b.permute(3, 2, 0, 1).contiguous()
        return lambda: F.conv2d(x, k)  # NCHW view of NHWC memory: checked through .permute(0, 2, 3, 1)

    notes = {"gemm": {"f32": "torch.mm f32", "bf16": "torch.mm bf16 (bf16 output)", "i8": "torch._int_mm int8->int32"},
             "conv": {"f32": "F.conv2d channels-last f32", "bf16": "F.conv2d channels-last bf16 (bf16 output)"}}
    return make, notes[w.kind][w.dtype]


OPS = ("gemm_f32", "gemm_bf16", "gemm_i8", "conv_f32", "conv_bf16", "conv_i8", "bert_bf16")


# --------------------------------------------------------------------------
# Systems.


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"


def _rel_err(got, want: np.ndarray) -> float:
    """max |got - want| / max |want|; `got` a numpy array (bf16 too) or a torch tensor."""
    if hasattr(got, "detach"):  # a torch tensor
        got = got.detach().double().numpy()
    got = np.asarray(got)
    if str(got.dtype) == "bfloat16":
        got = got.astype(np.float32)
    got = np.asarray(got, dtype=np.float64)
    if got.shape != want.shape:
        raise ValueError(f"output shape {got.shape}, reference {want.shape}")
    return float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30))


@dataclass
class Ours:
    run: Callable[[], object] | None = None
    tune_s: float = math.nan
    trials: int = 0
    rel_err: float = math.nan
    error: str = ""


def tune_ours(w: Workload, threads: int, args: argparse.Namespace, wd: str) -> Ours:
    """Tune, compile, check and bind our kernel (the calls of `ansor_ops.tune_and_time`);
    on failure, which step failed and its error's first line."""
    step = "import"
    try:
        from mlir_ansor import TuneConfig, compile, tune  # noqa: A004
        from mlir_ansor.target import Target

        step = "tune"
        config = TuneConfig(trials=args.trials, threads=threads, seed=args.seed, strategy=args.search)
        target = Target.parse(args.target)
        if args.flush_caches == "all" or (args.flush_caches == "models" and w.kind == "bert"):
            # A model's kernels find their weights in memory, not in cache.
            from mlir_ansor.measure.runner import TimingPolicy

            config = dataclasses.replace(config, timing=TimingPolicy(flush_caches=True))
        db = os.path.join(wd, f"{w.name}_{threads}.db")
        t0 = time.perf_counter()
        res = tune(w.path, config=config, db=db, target=target)
        tune_s = time.perf_counter() - t0
        step = "compile"
        cm = compile(w.path, db=db, threads=threads, target=target)
        step = "run"
        out = cm(*w.arrays)
        outs = out if isinstance(out, (list, tuple)) else [out]
        err = max(_rel_err(o, r) for o, r in zip(outs, w.reference))
        run, _ = cm.bind(*w.arrays)
        return Ours(run, tune_s, res.measured, err)
    except Exception as e:  # one failure must not lose the other rows
        return Ours(error=f"{step}: {_first_line(e)}")


class _PeerSettings:
    """numpy's BLAS (and OpenMP runtimes threadpoolctl finds) held to `threads`; autograd off."""

    def __init__(self, threads: int) -> None:
        self.threads, self.stack = threads, []

    def __enter__(self) -> None:
        try:
            from threadpoolctl import threadpool_limits

            self.stack.append(threadpool_limits(limits=self.threads))
        except ImportError:
            pass
        try:
            import torch

            self.stack.append(torch.no_grad())
        except ImportError:
            pass
        for s in self.stack:
            s.__enter__()

    def __exit__(self, *exc: object) -> None:
        for s in reversed(self.stack):
            s.__exit__(*exc)


# --------------------------------------------------------------------------
# One row: every system on one workload at one thread count.


@dataclass
class Row:
    name: str
    label: str
    kind: str
    dtype: str
    threads: int
    flops: int
    latency: dict[str, float] = field(default_factory=dict)  # system -> s ("iree", "iree_default", ...)
    rel_err: dict[str, float] = field(default_factory=dict)
    compile_s: dict[str, float] = field(default_factory=dict)  # IREE's, per flag set
    tune_s: float = math.nan
    trials: int = 0
    errors: dict[str, str] = field(default_factory=dict)  # system -> why it has no figure
    notes: list[str] = field(default_factory=list)

    def gops(self, system: str) -> float:
        v = self.latency.get(system)
        return self.flops / v / 1e9 if v else math.nan


NUMPY_TIMER = """
import json, sys
sys.path.insert(0, sys.argv[3])
import numpy as np
from timing import median_time
d = np.load(sys.argv[1]); a, b = d["arr_0"], d["arr_1"]
print(json.dumps({"median_s": median_time(lambda: a @ b, min_time=float(sys.argv[2]), min_repeat=3, warmup_s=0.3)}))
"""


def _numpy_env(threads: int) -> dict[str, str]:
    """numpy's BLAS pinned to `threads`, without the core-type and L2
    overrides this machine's environment sets (OPENBLAS_CORETYPE=Haswell holds
    OpenBLAS to AVX2 kernels; see gemm_core.py)."""
    env = dict(os.environ)
    env.pop("OPENBLAS_CORETYPE", None)
    env.pop("OPENBLAS_L2_SIZE", None)
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env[var] = str(threads)
    return env


def run_row(w: Workload, threads: int, args: argparse.Namespace, wd: str, iree: Iree | None) -> Row:
    row = Row(w.name, w.label, w.kind, w.dtype, threads, w.flops)
    fns: dict[str, Callable[[], object]] = {}
    if "ours" in args.only:
        o = tune_ours(w, threads, args, wd)
        if o.error:
            row.errors["ours"] = o.error
        else:
            fns["ours"] = o.run
            row.rel_err["ours"], row.tune_s, row.trials = o.rel_err, o.tune_s, o.trials
    if "torch" in args.only:
        if w.torch_fn is None:
            row.errors["torch"] = w.torch_note
        else:
            try:
                fn = w.torch_fn(threads)
                with _PeerSettings(threads):
                    got = fn()
                    if w.kind == "conv":
                        got = got.permute(0, 2, 3, 1)
                    row.rel_err["torch"] = _rel_err(got, w.reference[0])
                fns["torch"] = fn
                row.notes.append(f"torch: {w.torch_note}")
            except Exception as e:
                row.errors["torch"] = _first_line(e)
    numpy_timer = None
    if "numpy" in args.only and w.name == "gemm_f32":
        a, b = w.arrays
        row.rel_err["numpy"] = _rel_err(a @ b, w.reference[0])
        np.savez(os.path.join(wd, f"{w.name}.numpy.npz"), a, b)
        numpy_timer = [sys.executable, "-c", NUMPY_TIMER, os.path.join(wd, f"{w.name}.numpy.npz"), str(args.min_time),
                       os.path.dirname(os.path.abspath(__file__))]
    iree_sets: list[str] = []
    if iree is not None:
        prepared = iree.prepare(w, threads)
        for fs, r in prepared.items():
            key = "iree" if fs == "best" else f"iree_{fs}"
            if "compile_s" in r:
                row.compile_s[fs] = r["compile_s"]
            if "error" in r:
                row.errors[key] = r["error"]
            else:
                row.rel_err[key] = r.get("rel_err", math.nan)
                iree_sets.append(fs)
    # Timed in turns: every system once per round, IREE in its own process.
    per: dict[str, list[float]] = {k: [] for k in fns}
    with _PeerSettings(threads):
        for _ in range(args.rounds):
            for k, fn in fns.items():
                per[k].append(median_time(fn, min_time=args.min_time, min_repeat=3, warmup_s=0.3))
            if numpy_timer:
                proc = subprocess.run(numpy_timer, env=_numpy_env(threads), capture_output=True, text=True)
                if proc.returncode == 0:
                    per.setdefault("numpy", []).append(json.loads(proc.stdout)["median_s"])
                else:
                    row.errors["numpy"] = (proc.stderr.strip().splitlines() or ["failed"])[-1][:200]
            if iree_sets:
                for fs, v in iree.time(w, threads, iree_sets).items():
                    key = "iree" if fs == "best" else f"iree_{fs}"
                    if isinstance(v, str):
                        row.errors[key] = v
                    else:
                        per.setdefault(key, []).append(v)
    row.latency = {k: statistics.median(v) for k, v in per.items() if v}
    return row


# --------------------------------------------------------------------------
# Report.


def host_info() -> dict:
    """lscpu's model name and flags; which of the ISA extensions that matter here are present."""
    info: dict = {"model": "unknown", "flags": ""}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        out = ""
    for ln in out.splitlines():
        key, _, val = ln.partition(":")
        key, val = key.strip(), val.strip()
        if key == "Model name":
            info["model"] = val
        elif key == "CPU family":
            info["family"] = val
        elif key == "Flags":
            info["flags"] = val
    flags = set(info["flags"].split())
    info["has"] = {f: f in flags for f in ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")}
    info["avx2_only"] = "avx2" in flags and "avx512f" not in flags
    return info


def _ms(x: float | None) -> str:
    return f"{x * 1e3:.3f}" if x is not None and math.isfinite(x) else "-"


def _f(x: float, spec: str = ".2f") -> str:
    return format(x, spec) if x is not None and math.isfinite(x) else "-"


def ratios(row: Row, rows: list[Row]) -> dict[str, float]:
    """ours/our-f32, ours/IREE, ours/torch (throughput), and IREE's own low-precision gain."""
    ours = row.latency.get("ours")
    f32 = next((r for r in rows if r.kind == row.kind and r.dtype == "f32" and r.threads == row.threads), None)
    out = {}

    def ratio(num: float | None, den: float | None) -> float:
        return num / den if num and den else math.nan

    out["vs_our_f32"] = ratio(f32.latency.get("ours") if f32 and row.dtype != "f32" else None, ours)
    out["vs_iree"] = ratio(row.latency.get("iree"), ours)
    out["vs_torch"] = ratio(row.latency.get("torch"), ours)
    out["iree_vs_iree_f32"] = ratio(f32.latency.get("iree") if f32 and row.dtype != "f32" else None, row.latency.get("iree"))
    return out


def targets(rows: list[Row], host: dict) -> list[dict]:
    """Each of the issue's targets, per row it applies to: value, bound, PASS/FAIL."""
    out = []
    for r in rows:
        rt = ratios(r, rows)
        checks: list[tuple[str, str, float]] = []
        if r.dtype == "bf16" and host["avx2_only"]:
            pass  # no bf16 instruction: computed in f32, checked for correctness only (the error columns)
        elif r.kind == "gemm" and r.dtype in ("bf16", "i8"):
            f32_bound = 1.3 if (r.dtype == "i8" and host["avx2_only"]) else 1.7
            checks += [("vs_our_f32", "our f32 GEMM", f32_bound), ("vs_iree", "IREE", 1.1)]
        elif r.kind == "conv" and r.dtype in ("bf16", "i8"):
            checks.append(("vs_our_f32", "our f32 conv", 1.3 if (r.dtype == "i8" and host["avx2_only"]) else 1.5))
        elif r.kind == "bert":
            checks += [("vs_torch", "torch bf16 eager", 1.2), ("vs_iree", "IREE", 1.0)]
        for key, what, bound in checks:
            v = rt[key]
            why = ""
            if not math.isfinite(v):
                missing = "ours" if "ours" not in r.latency else {"vs_our_f32": "ours (f32 row)", "vs_iree": "iree",
                                                                  "vs_torch": "torch"}[key]
                if "setup" in r.errors:
                    why = f"workload not set up: {r.errors['setup']}"
                elif missing == "ours":
                    why = r.errors.get("ours", "ours not run (--only)")
                else:
                    why = f"no {missing} figure"
            out.append({"row": f"{r.name} x{r.threads}", "target": f"ours/{what} >= {bound}", "value": v,
                        "bound": bound, "status": "PASS" if math.isfinite(v) and v >= bound else "FAIL", "why": why})
    return out


def print_report(rows: list[Row], host: dict, args: argparse.Namespace, iree_version: str) -> list[dict]:
    print(f"\nlow precision: {args.trials} trials per row (ours), rounds {args.rounds} x {args.min_time} s, seed {args.seed}; "
          f"systems: {', '.join(args.only)}; {iree_version or 'IREE not run'}")
    print(f"host: {host['model']} (family {host.get('family', '?')}); "
          + ", ".join(f"{k} {'yes' if v else 'no'}" for k, v in host["has"].items()))
    if "built_for" in host:
        print(f"ours built for {host['built_for']} (run on this host){'; AVX2-only targets' if host['avx2_only'] else ''}")
    print(f"lscpu flags: {host['flags']}")
    print("ratios are of throughput (peer latency / ours; > 1: ours faster); GOP/s counts a multiply-add as 2")
    hdr = (f"{'workload':<36} {'thr':>3} {'ours ms':>8} {'GOP/s':>6} {'IREE ms':>8} {'GOP/s':>6} {'IREEdef':>8} "
           f"{'torch ms':>8} {'numpy ms':>8} {'/our-f32':>8} {'/IREE':>6} {'/torch':>6} {'IREE/f32':>8} "
           f"{'IREE comp s':>11} {'err ours':>8} {'err IREE':>8} {'err torch':>9}")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        rt = ratios(r, rows)
        comp = "/".join(_f(r.compile_s[k], ".1f") for k in r.compile_s) or "-"
        print(f"{r.label:<36} {r.threads:>3} {_ms(r.latency.get('ours')):>8} {_f(r.gops('ours'), '.1f'):>6} "
              f"{_ms(r.latency.get('iree')):>8} {_f(r.gops('iree'), '.1f'):>6} {_ms(r.latency.get('iree_default')):>8} "
              f"{_ms(r.latency.get('torch')):>8} {_ms(r.latency.get('numpy')):>8} {_f(rt['vs_our_f32']):>8} "
              f"{_f(rt['vs_iree']):>6} {_f(rt['vs_torch']):>6} {_f(rt['iree_vs_iree_f32']):>8} {comp:>11} "
              f"{_f(r.rel_err.get('ours', math.nan), '.1e'):>8} {_f(r.rel_err.get('iree', math.nan), '.1e'):>8} "
              f"{_f(r.rel_err.get('torch', math.nan), '.1e'):>9}")
    seen = set()
    for r in rows:
        for system, why in r.errors.items():
            if (r.name, system, why) not in seen:  # the same reason at every thread count: once
                seen.add((r.name, system, why))
                print(f"  {r.name} x{r.threads}: {system}: {why}")
    if "iree" in args.only:
        print("  IREE compile s: best flags" + ("/default flags" if args.iree_default else "") + ", one compile per workload")
    ts = targets(rows, host)
    if ts and "ours" not in args.only:
        print("\ntargets: not checked (mlir-ansor left out by --only)")
    elif ts:
        print("\ntargets:")
        for t in ts:
            print(f"  {t['row']:<14} {t['target']:<34} {_f(t['value']):>6}  {t['status']}"
                  + (f"  ({t['why']})" if t["why"] else ""))
    return ts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of: {', '.join(OPS)}")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--trials", type=int, default=200, help="our measured candidates per row")
    ap.add_argument("--search", default="evolutionary", help="our search strategy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=",".join(SYSTEMS), help=f"systems to run, of: {', '.join(SYSTEMS)}")
    ap.add_argument("--iree-default", action="store_true", help="also IREE with its default flags (a second figure)")
    ap.add_argument("--iree-python", default=DEFAULT_IREE_PYTHON, help="python of IREE's env")
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds (systems in turns)")
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds timed per system per round")
    ap.add_argument("--flush-caches", choices=("models", "all", "none"), default="models",
                    help="tune with TimingPolicy.flush_caches: for the model rows (default), every row, or none")
    ap.add_argument("--json", metavar="FILE", help="write every figure as JSON")
    ap.add_argument("--work-dir", help="keep modules, inputs, databases and IREE's files here")
    ap.add_argument("--target", default="cpu",
                    help="what ours is built for: cpu (this host) or cpu:NAME, a CPU whose features this host has "
                         "(cpu:znver3: AVX2 and FMA only; its targets are the AVX2-only host's)")
    args = ap.parse_args()
    names = [n for n in args.ops.split(",") if n]
    args.only = [s for s in args.only.split(",") if s]
    bad = [n for n in names if n not in OPS] + [s for s in args.only if s not in SYSTEMS]
    if bad:
        ap.error(f"unknown {', '.join(bad)}; workloads: {', '.join(OPS)}; systems: {', '.join(SYSTEMS)}")
    if "iree" in args.only and not os.path.exists(args.iree_python):
        ap.error(f"no IREE env at {args.iree_python}: run `bash benchmarks/setup_peers.sh --iree`, pass --iree-python, "
                 "or leave iree out of --only")
    names.sort(key=OPS.index)  # f32 rows first: the others' ratios need them
    thread_counts = [int(t) for t in args.threads.split(",")]
    wd = args.work_dir or tempfile.mkdtemp(prefix="low-precision-")
    os.makedirs(os.path.join(wd, "iree"), exist_ok=True)
    host = host_info()
    if args.target not in ("cpu", "host"):
        from mlir_ansor.target import Target

        built = Target.parse(args.target)
        if not built.runs_on(Target.host()):
            ap.error(f"--target {args.target}: this host lacks some of its features, so its code cannot run here")
        host["built_for"] = args.target
        host["avx2_only"] = built.has("avx2") and not built.has("avx512f")
    iree = None
    if "iree" in args.only:
        iree = Iree(args.iree_python, wd, ["best", "default"] if args.iree_default else ["best"], args.min_time)
    rows: list[Row] = []
    for name in names:
        try:
            w = make_workload(name, wd, args.seed)
        except Exception as e:
            print(f"{name}: could not be set up: {_first_line(e)}", file=sys.stderr)
            for t in thread_counts:
                r = Row(name, name, name.split("_")[0], name.split("_")[1], t, 0)
                r.errors["setup"] = _first_line(e)
                rows.append(r)
            continue
        for t in thread_counts:
            r = run_row(w, t, args, wd, iree)
            rows.append(r)
            print(f"{r.label} x{t}: " + ", ".join(f"{k} {v * 1e3:.3f} ms" for k, v in r.latency.items())
                  + "".join(f"; {k}: {v}" for k, v in r.errors.items()), file=sys.stderr, flush=True)
    ts = print_report(rows, host, args, iree.version if iree else "")
    print(f"work folder: {wd}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "host": host, "iree": iree.version if iree else None,
                       "iree_flags": iree.flags if iree else None,
                       "time": time.strftime("%Y-%m-%d %H:%M:%S"), "targets": ts,
                       "rows": [{**r.__dict__, "gops": {k: r.gops(k) for k in r.latency}, "ratios": ratios(r, rows)}
                                for r in rows]}, f, indent=1, default=str)


if __name__ == "__main__":
    main()
