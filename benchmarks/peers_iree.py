"""IREE as a peer: compile a Linalg-on-tensors module with `iree-compile`,
time it with `iree-benchmark-module`, check its outputs, print JSON.

Runs in IREE's own env (`.venv-iree`, made by `bash benchmarks/setup_peers.sh
--iree`), as a subprocess of the main env's benchmarks
(`benchmarks/low_precision.py`), so that no benchmark of ours imports IREE.
It drives IREE's command-line tools, found beside this interpreter; it needs
numpy and the standard library only.

Flag sets (`--flags`, several comma-separated; each is one figure):

- ``best``: IREE's best CPU code, ``--iree-opt-level=O2 --iree-opt-data-tiling
  --iree-llvmcpu-enable-ukernels=all`` on top of ``default`` (data tiling
  packs the operands into the layouts of its mmt4d micro-kernels, with
  vdpbf16ps for bf16 and VNNI for int8 where the host has them; it is off by
  default since IREE 3.8);
- ``default``: ``--iree-hal-target-device=local
  --iree-hal-local-target-device-backends=llvm-cpu --iree-llvmcpu-target-cpu=host``.

Threads: 1 runs on ``--device=local-sync`` (the caller's thread, no task
system), N > 1 on ``--device=local-task --task_topology_max_group_count=N``.

Inputs and outputs, and what IREE 3.13's tools accept (checked on this host):

- every input is passed as raw bytes, ``--input=1024x1024xbf16=@arg0.bin``,
  shape and element type taken from the function's signature: this works for
  every type (f32, bf16, i8, ...);
- ``--input=@a.npy`` works for numpy's own types and for a bf16 array saved
  with ml_dtypes (descr ``<V2``); an ``.npy`` of uint16 (bf16 bits) is refused
  ("element type mismatch; expected bf16 but have ui16");
- ``--output=@out.npy`` cannot write bf16 ("UNIMPLEMENTED; unsupported data
  encoding"): outputs are read back from ``--output=@out.bin`` (raw bytes),
  bf16 as uint16 bits widened to f32 here.

The input file (`--inputs`) is an ``.npz`` of ``arr_0``, ``arr_1``, ... (or a
comma-separated list of ``.npy``) in the function's argument order; bf16
arguments may be given as uint16 bits or as ml_dtypes.bfloat16 (the bytes
are what counts; the shape and the element size are checked against the
signature). `--reference` (an ``.npz`` in the same form, one array per
result, any numeric dtype) gives each output's relative error,
max |IREE - reference| / max |reference|.

Latency: real time per iteration that `iree-benchmark-module` reports
(Google Benchmark's loop over the function, inputs uploaded once, outputs
allocated per call), the median over `--repetitions`, after
`--warmup` seconds untimed; `cpu_s` is its process CPU time per iteration.

Usage (from the main env, as `low_precision.py` does):
  .venv-iree/bin/python benchmarks/peers_iree.py --mlir gemm_bf16.mlir --inputs gemm_bf16.in.npz \\
      --threads 2 --flags best,default --reference gemm_bf16.ref.npz --work-dir /tmp/w
  ... --compile-only  # compile and check, no timing (the .vmfb serves every thread count)
  ... --time-only     # no compiling: time the .vmfb files of an earlier call again
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

import numpy as np

BIN = os.path.dirname(os.path.abspath(sys.executable))
"""IREE's tools live beside the interpreter of its env (pip's console scripts)."""

BASE_FLAGS = (
    "--iree-hal-target-device=local",
    "--iree-hal-local-target-device-backends=llvm-cpu",
    "--iree-llvmcpu-target-cpu=host",
)
FLAG_SETS: dict[str, tuple[str, ...]] = {
    "best": (*BASE_FLAGS, "--iree-opt-level=O2", "--iree-opt-data-tiling", "--iree-llvmcpu-enable-ukernels=all"),
    "default": BASE_FLAGS,
}
"""Flag set name -> iree-compile flags (see the module docstring)."""

_NP = {"f64": np.float64, "f32": np.float32, "f16": np.float16, "bf16": np.uint16, "i64": np.int64,
       "i32": np.int32, "i16": np.int16, "i8": np.int8, "i1": np.bool_}
"""Element type -> the numpy type its bytes are read as (bf16: its bits)."""

_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def tool(name: str) -> str:
    """Path of IREE tool `name` in this env; exits saying how to install it when missing."""
    path = os.path.join(BIN, name)
    if not os.path.exists(path):
        sys.exit(f"peers_iree.py: no {name} beside {sys.executable}: run `bash benchmarks/setup_peers.sh --iree` "
                 "and run this script with .venv-iree/bin/python")
    return path


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis that closes the one at `text[start]`."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "(<[{":
            depth += 1
        elif text[i] in ")>]}":
            depth -= 1
            if depth == 0:
                return i + 1
    raise ValueError("unbalanced brackets in the function signature")


_TENSOR = re.compile(r"tensor<((?:(?:\d+|\?)x)*)([a-z]+\d*)>")


def signature(mlir: str, function: str | None = None) -> tuple[str, list[tuple[tuple[int, ...], str]], list[tuple[tuple[int, ...], str]]]:
    """(name, argument types, result types) of the module's public function
    `function` (default: the first public one); each type a (shape, element
    type) pair, a dynamic dimension (``?``) as None."""
    for m in re.finditer(r"func\.func\s+(private\s+)?@([\w$.]+)\s*\(", mlir):
        if m.group(1) or (function and m.group(2) != function):
            continue
        args_end = _balanced(mlir, m.end() - 1)
        body = mlir.find("{", args_end)
        attrs = mlir.find(" attributes", args_end, body)
        head = mlir[args_end: attrs if attrs >= 0 else body]

        def types(s: str) -> list[tuple[tuple[int, ...], str]]:
            return [(tuple(None if d == "?" else int(d) for d in shp.split("x") if d), et) for shp, et in _TENSOR.findall(s)]

        return m.group(2), types(mlir[m.end(): args_end]), types(head)
    raise SystemExit(f"peers_iree.py: no public func.func{' @' + function if function else ''} in the module")


def _type_str(shape: tuple[int, ...], dtype: str) -> str:
    return "x".join([*(str(d) for d in shape), dtype])


def load_arrays(spec: str) -> list[np.ndarray]:
    """The arrays of an .npz (arr_0, arr_1, ...) or of comma-separated .npy files."""
    if spec.endswith(".npz"):
        data = np.load(spec)
        return [data[f"arr_{i}"] for i in range(len(data.files))]
    return [np.load(p) for p in spec.split(",") if p]


def write_inputs(arrays: list[np.ndarray], args_types: list, wd: str, tag: str) -> list[str]:
    """Raw-byte files of `arrays`, checked against the signature; the `--input=` flags that pass them."""
    if len(arrays) != len(args_types):
        sys.exit(f"peers_iree.py: {len(arrays)} inputs given, the function takes {len(args_types)}")
    flags = []
    for i, (a, (shape, et)) in enumerate(zip(arrays, args_types)):
        want = np.dtype(_NP[et]).itemsize if et in _NP else None
        fits = len(a.shape) == len(shape) and all(d is None or d == n for d, n in zip(shape, a.shape))
        if not fits or (want and a.dtype.itemsize != want):
            sys.exit(f"peers_iree.py: input {i} is {a.dtype}{list(a.shape)}, the function wants "
                     f"{_type_str(tuple('?' if d is None else d for d in shape), et)}")
        path = os.path.join(wd, f"{tag}.arg{i}.bin")
        np.ascontiguousarray(a).tofile(path)
        flags.append(f"--input={_type_str(tuple(a.shape), et)}=@{path}")  # a dynamic dimension at the array's size
    return flags


def read_output(path: str, shape: tuple[int, ...], et: str) -> np.ndarray:
    """A raw output file as numpy (bf16 widened to f32); one dynamic
    dimension (None) is what the file's size leaves for it."""
    if et not in _NP:
        raise ValueError(f"cannot read outputs of element type {et}")
    if sum(d is None for d in shape) > 1:
        raise ValueError(f"cannot read an output of {len(shape)} dimensions with more than one dynamic")
    raw = np.fromfile(path, dtype=_NP[et]).reshape(tuple(-1 if d is None else d for d in shape))
    if et == "bf16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    return raw


def device_flags(threads: int) -> list[str]:
    if threads <= 1:
        return ["--device=local-sync"]
    return ["--device=local-task", f"--task_topology_max_group_count={threads}"]


def _first_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if "error" in ln.lower():
            return ln[:300]
    return (lines[-1] if lines else "no output")[:300]


def compile_module(mlir_path: str, vmfb: str, flags: tuple[str, ...], timeout: float) -> dict:
    """Compile; {"compile_s": wall time} or {"error": iree-compile's first error line}."""
    cmd = [tool("iree-compile"), mlir_path, "-o", vmfb, *flags]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"iree-compile ran past {timeout:.0f} s", "compile_s": timeout}
    dt = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"error": f"iree-compile failed (exit {proc.returncode}): {_first_error(proc.stderr)}", "compile_s": dt}
    return {"compile_s": dt}


def check(vmfb: str, function: str, inputs: list[str], results: list, threads: int, wd: str, tag: str,
          reference: list[np.ndarray] | None) -> dict:
    """Run once with `iree-run-module`; the relative error of each output against `reference`."""
    outs = [os.path.join(wd, f"{tag}.out{i}.bin") for i in range(len(results))]
    cmd = [tool("iree-run-module"), f"--module={vmfb}", f"--function={function}", *device_flags(threads), *inputs,
           *(f"--output=@{p}" for p in outs)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": f"iree-run-module failed: {_first_error(proc.stderr + proc.stdout)}"}
    if reference is None:
        return {}
    errs = []
    for p, (shape, et), want in zip(outs, results, reference):
        got = read_output(p, shape, et).astype(np.float64)
        want = np.asarray(want, dtype=np.float64)
        if got.shape != want.shape:
            return {"error": f"output shape {got.shape}, reference {want.shape}"}
        errs.append(float(np.max(np.abs(got - want)) / (np.max(np.abs(want)) + 1e-30)))
    return {"rel_err": max(errs) if errs else math.nan, "rel_errs": errs}


def benchmark(vmfb: str, function: str, inputs: list[str], threads: int, min_time: float, repetitions: int,
              warmup: float) -> dict:
    """{"latency_s": median real time per iteration, "latencies_s": one per repetition, "iterations"}."""
    cmd = [tool("iree-benchmark-module"), f"--module={vmfb}", f"--function={function}", *device_flags(threads),
           *inputs, "--benchmark_format=json", f"--benchmark_min_time={min_time}s",
           f"--benchmark_repetitions={repetitions}", f"--benchmark_min_warmup_time={warmup}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": f"iree-benchmark-module failed: {_first_error(proc.stderr + proc.stdout)}"}
    out = proc.stdout
    report = json.loads(out[out.index("{"):])
    runs = [b for b in report["benchmarks"] if b.get("run_type") == "iteration"]
    if not runs:
        return {"error": "iree-benchmark-module reported no iterations"}
    lat = [b["real_time"] * _TIME_UNITS[b["time_unit"]] for b in runs]
    cpu = [b["cpu_time"] * _TIME_UNITS[b["time_unit"]] for b in runs]
    # cpu_s: the process's CPU time per iteration, all threads together; on a
    # machine shared with other jobs, cpu_s / threads well under latency_s
    # says the figure was taken while cores were lent to others.
    return {"latency_s": statistics.median(lat), "latencies_s": lat, "cpu_s": statistics.median(cpu),
            "iterations": sum(b["iterations"] for b in runs)}


def compiler_version() -> str:
    proc = subprocess.run([tool("iree-compile"), "--version"], capture_output=True, text=True)
    lines = [ln.strip() for ln in proc.stdout.splitlines() if "compiler version" in ln]
    return lines[0] if lines else "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mlir", required=True, help="Linalg-on-tensors module (func with tensor arguments and results)")
    ap.add_argument("--inputs", required=True, help="NAME.npz (arr_0, arr_1, ...) or a.npy,b.npy, in argument order")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--flags", default="best", help=f"comma-separated flag sets: {', '.join(FLAG_SETS)}")
    ap.add_argument("--function", help="entry function (default: the module's first public function)")
    ap.add_argument("--reference", help="expected outputs (.npz, arr_0, ... one per result) for the error check")
    ap.add_argument("--work-dir", help="where the .vmfb, input and output files go (default: beside --mlir)")
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds of timed iterations per repetition")
    ap.add_argument("--repetitions", type=int, default=1)
    ap.add_argument("--warmup", type=float, default=0.3,
                    help="seconds of untimed iterations first (the caller's thread pools may still spin)")
    ap.add_argument("--compile-timeout", type=float, default=600.0)
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--time-only", action="store_true",
                      help="no compiling and no check: time the .vmfb files an earlier call left in --work-dir")
    mode.add_argument("--compile-only", action="store_true", help="compile and check, no timing")
    ap.add_argument("--reuse-vmfb", action="store_true",
                    help="skip compiling where the .vmfb exists and is newer than --mlir (it serves every thread count)")
    args = ap.parse_args()
    unknown = [f for f in args.flags.split(",") if f not in FLAG_SETS]
    if unknown:
        ap.error(f"unknown flag set(s) {', '.join(unknown)} (known: {', '.join(FLAG_SETS)})")
    wd = args.work_dir or os.path.dirname(os.path.abspath(args.mlir))
    os.makedirs(wd, exist_ok=True)
    tag = os.path.splitext(os.path.basename(args.mlir))[0]
    with open(args.mlir, encoding="utf-8") as f:
        text = f.read()
    function, arg_types, res_types = signature(text, args.function)
    inputs = write_inputs(load_arrays(args.inputs), arg_types, wd, tag)
    reference = load_arrays(args.reference) if args.reference else None
    results = {}
    for name in args.flags.split(","):
        vmfb = os.path.join(wd, f"{tag}.{name}.vmfb")
        res: dict = {"flags": list(FLAG_SETS[name])}
        fresh = os.path.exists(vmfb) and os.path.getmtime(vmfb) >= os.path.getmtime(args.mlir)
        if not args.time_only:
            if args.reuse_vmfb and fresh:
                res["reused"] = vmfb
            else:
                res.update(compile_module(args.mlir, vmfb, FLAG_SETS[name], args.compile_timeout))
            if "error" not in res:
                res.update(check(vmfb, function, inputs, res_types, args.threads, wd, f"{tag}.{name}", reference))
        elif not os.path.exists(vmfb):
            res["error"] = f"--time-only: no {vmfb} (compile it first, without --time-only)"
        if "error" not in res and not args.compile_only:
            res.update(benchmark(vmfb, function, inputs, args.threads, args.min_time, args.repetitions, args.warmup))
        results[name] = res
        print(f"iree {tag} {name} x{args.threads}: {res}", file=sys.stderr, flush=True)
    info = {"iree": compiler_version(), "function": function, "threads": args.threads,
            "device": device_flags(args.threads), "results": results}
    json.dump(info, sys.stdout)
    print()


if __name__ == "__main__":
    main()
