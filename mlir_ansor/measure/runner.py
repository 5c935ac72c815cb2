"""Run a built candidate: call it through its C ABI, check it, time it.

A kernel built by `builder.build` exports `_mlir_ciface_kernel(desc*...)`:
one pointer to a ranked memref descriptor per input, then one per output
(`buffer-results-to-out-params`). This module needs numpy, ml_dtypes (bf16)
and ctypes only, not MLIR, so a measuring host needs nothing but the artifact.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import glob
import math
import statistics
import time
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from mlir_ansor.ir.dtypes import element_bytes, is_float

_NP_DTYPES = {
    "f32": np.float32, "f64": np.float64, "f16": np.float16, "bf16": ml_dtypes.bfloat16,
    "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64,
}
"""numpy's type for each element type a kernel's buffers may have (numpy has
no bf16: `ml_dtypes` brings it)."""


def np_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of an element type ("bf16" -> ``ml_dtypes.bfloat16``)."""
    if dtype not in _NP_DTYPES:
        raise ValueError(f"element type {dtype} has no numpy equivalent")
    return np.dtype(_NP_DTYPES[dtype])


def mlir_dtype(dt) -> str:
    """The element type's MLIR spelling of a numpy dtype (inverse of `np_dtype`)."""
    dt = np.dtype(dt)
    for name, t in _NP_DTYPES.items():
        if np.dtype(t) == dt:
            return name
    raise ValueError(f"numpy type {dt} is no element type kernels take")


def is_float_array(a: np.ndarray) -> bool:
    """Whether `a` holds floating-point numbers, bf16 included (which numpy
    does not count among its floating types)."""
    return np.issubdtype(a.dtype, np.floating) or a.dtype == np.dtype(ml_dtypes.bfloat16)


def random_inputs(
    specs: list[tuple[tuple[int, ...], str]], seed: int, low: float = -1.0, high: float = 1.0
) -> list[np.ndarray]:
    """Seeded inputs, uniform in [low, high) and rounded to the element type
    (bf16, f16 drawn as float64, then cast), integers in [-8, 8) (their
    products summed over K = 1024 stay far inside i32, and read unsigned,
    ``arith.extui``, they are 0..7 and 248..255): those a task's reference is
    computed on (`jobs.prepare_reference`), drawn again from the seed where
    candidates are checked (`gpu_measure` on a GPU host)."""
    rng = np.random.default_rng(seed)
    arrays = []
    for shape, dtype in specs:
        dt = np_dtype(dtype)
        if is_float(dtype):
            arrays.append(rng.uniform(low, high, size=tuple(shape)).astype(dt))
        else:
            arrays.append(rng.integers(-8, 8, size=tuple(shape)).astype(dt))
    return arrays


def buffer_bytes(specs) -> int:
    """Bytes of the arrays `specs` describe ((shape, dtype) pairs)."""
    return sum(math.prod(int(d) for d in shape) * element_bytes(dtype) for shape, dtype in specs)


def reference_bytes(inputs, outputs) -> int:
    """Bytes a task's reference preparation (`jobs.prepare_reference`) and
    each checking run (`run`) hold at their peak: the inputs and outputs
    twice (the data and the copies the kernel runs on), and the float64
    draw of the largest float input (`random_inputs`)."""
    return 2 * (buffer_bytes(inputs) + buffer_bytes(outputs)) + draw_bytes(inputs)


def draw_bytes(inputs) -> int:
    """Bytes of the float64 draw `random_inputs` makes for the largest
    floating-point input of `inputs` ((shape, dtype) pairs), before casting."""
    floats = [shape for shape, dtype in inputs if is_float(dtype)]
    return max((math.prod(int(d) for d in shape) * 8 for shape in floats), default=0)


def format_bytes(n: float) -> str:
    """`n` bytes as "74.5 GiB", "768 KiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"  # pragma: no cover


ALIGNMENT = 64
"""Bytes every buffer a kernel is timed or called on is aligned to (a cache
line). numpy's own buffers are only 16-byte aligned, at an offset that
changes from one allocation to the next: Ansor's DIL timed 2.53 ms on
64-byte-aligned buffers, 3.03 ms at 16 bytes past and 3.44 ms at 32 (its
vector loads straddle cache lines), so a candidate's timing depended on where
malloc put its buffers."""


ONE_BYTE = ctypes.c_byte * 1


def data_pointer(a: np.ndarray) -> int:
    """The address of `a`'s first element. ctypes' view of a writable
    C-contiguous buffer gives it in about 0.5 us, half of what
    ``a.ctypes.data`` costs (a compiled call reads one per argument and
    output); read-only and empty arrays take numpy's way."""
    try:
        return ctypes.addressof(ONE_BYTE.from_buffer(a))
    except (TypeError, ValueError, BufferError):
        return a.ctypes.data


def aligned_empty_at(shape: tuple[int, ...], dtype: np.dtype, nbytes: int) -> tuple[np.ndarray, int]:
    """:func:`aligned_empty` for a caller that has `dtype` as an ``np.dtype``
    and the byte count at hand, and wants the data pointer too."""
    raw = np.empty(nbytes + ALIGNMENT, dtype=np.uint8)
    ptr = data_pointer(raw)
    start = -ptr % ALIGNMENT
    return np.ndarray(shape, dtype, raw, start), ptr + start


def aligned_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on an
    `ALIGNMENT`-byte boundary."""
    dtype = np.dtype(dtype)
    return aligned_empty_at(shape, dtype, math.prod(shape) * dtype.itemsize)[0]


def aligned_full(shape: tuple[int, ...], dtype, value) -> np.ndarray:
    """An `ALIGNMENT`-aligned array of `shape` filled with `value`."""
    out = aligned_empty(shape, dtype)
    out.fill(value)
    return out


def poisoned(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An `ALIGNMENT`-aligned output buffer that a kernel must overwrite
    to pass its check: NaN for floats, the type's smallest value for integers."""
    dtype = np.dtype(dtype)
    if np.issubdtype(dtype, np.integer):
        return aligned_full(shape, dtype, np.iinfo(dtype).min)
    return aligned_full(shape, dtype, np.nan)


def aligned_copy(a: np.ndarray, dtype=None) -> np.ndarray:
    """A C-contiguous, `ALIGNMENT`-aligned copy of `a` (cast to `dtype`)."""
    a = np.asarray(a)
    dtype = a.dtype if dtype is None else np.dtype(dtype)
    out = aligned_empty_at(a.shape, dtype, a.size * dtype.itemsize)[0]
    np.copyto(out, a, casting="unsafe")  # as `out[...] = a` casts
    return out


@functools.cache
def _descriptor_type(rank: int) -> type:
    """The ctypes struct of a rank-`rank` memref descriptor (one class per
    rank: making a ctypes class costs tens of microseconds, which a
    compiled module's every call paid three times over)."""
    fields = [
        ("allocated", ctypes.c_void_p),
        ("aligned", ctypes.c_void_p),
        ("offset", ctypes.c_int64),
    ]
    if rank:
        fields += [("sizes", ctypes.c_int64 * rank), ("strides", ctypes.c_int64 * rank)]
    return type(f"MemRef{rank}D", (ctypes.Structure,), {"_fields_": fields})


def descriptor(array: np.ndarray) -> ctypes.Structure:
    """A ranked memref descriptor viewing a C-contiguous numpy array."""
    if not array.flags["C_CONTIGUOUS"]:
        raise ValueError("arrays passed to kernels must be C-contiguous")
    desc = _descriptor_type(array.ndim)()
    ptr = array.ctypes.data
    desc.allocated = ptr
    desc.aligned = ptr
    desc.offset = 0
    if array.ndim:
        desc.sizes[:] = list(array.shape)
        desc.strides[:] = [s // array.itemsize for s in array.strides]
    return desc


class Kernel:
    """A loaded kernel library, callable on numpy arrays (inputs, then outputs)."""

    def __init__(self, path: str, name: str = "kernel") -> None:
        from mlir_ansor.passes.amx import request_amx

        request_amx()  # the tile state, for kernels on AMX (a no-op where there is none)
        self.path = path
        self.lib = ctypes.CDLL(path)
        self.fn = getattr(self.lib, f"_mlir_ciface_{name}")
        self.fn.restype = None

    def bind(self, arrays: list[np.ndarray]):
        """Return a no-argument callable that runs the kernel on `arrays`."""
        descs = [descriptor(a) for a in arrays]
        fn = self.fn
        fn.argtypes = [ctypes.c_void_p] * len(descs)
        raw = [ctypes.addressof(d) for d in descs]

        def call() -> None:
            fn(*raw)

        call._keepalive = (descs, arrays)  # type: ignore[attr-defined]
        return call

    def close(self) -> None:
        import _ctypes

        try:
            _ctypes.dlclose(self.lib._handle)
        except OSError:
            pass


@dataclass(frozen=True)
class TimingPolicy:
    """How a candidate is timed.

    warmup: untimed runs first (page faults, caches, OpenMP thread start);
      a checked candidate's checking run is its warm-up.
    min_repeat: at least this many timed runs.
    max_repeat: at most this many.
    min_time_s: keep timing until this much time has been measured.
    flush_caches: before each timed run, write a buffer twice the size of
      the last-level cache (untimed), so that every run finds its inputs in
      memory, as the kernels of a model find their weights (Ansor's
      ``enable_cpu_cache_flush``). A BERT layer's 128 x 768 x 768 bf16
      matmul timed 0.74 ms warm and 0.95 ms so (Zen 4, 1 thread), and the
      compiled layer ran about 15% slower than the sum of its kernels timed
      warm. Records timed both ways do not compare: keep them apart.
    """

    warmup: int = 0
    min_repeat: int = 3
    max_repeat: int = 50
    min_time_s: float = 0.05
    flush_caches: bool = False


def last_level_cache_bytes() -> int:
    """The largest CPU cache of this host (sysfs; 32 MiB when it says
    nothing)."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    sizes = []
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(index, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text[-1:] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes, default=32 << 20)


@functools.cache
def _flush_buffer() -> np.ndarray:
    return np.zeros(2 * last_level_cache_bytes(), dtype=np.uint8)


def time_callable(call, policy: TimingPolicy) -> list[float]:
    """Seconds per run, one entry per timed run."""
    for _ in range(policy.warmup):
        call()
    flush = _flush_buffer() if policy.flush_caches else None
    costs: list[float] = []
    total = 0.0
    while len(costs) < policy.max_repeat and (len(costs) < policy.min_repeat or total < policy.min_time_s):
        if flush is not None:
            flush += 1
        t0 = time.perf_counter()
        call()
        dt = time.perf_counter() - t0
        costs.append(dt)
        total += dt
    return costs


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """Largest absolute difference of `out` and `ref` over the largest
    magnitude of `ref`, both read in float64 (a bf16 output against its f32
    reference); inf when `out` has a non-finite value."""
    if not ref.size:
        return 0.0
    o = np.asarray(out).astype(np.float64)
    if not np.all(np.isfinite(o)):
        return float("inf")
    r = np.asarray(ref).astype(np.float64)
    scale = float(np.max(np.abs(r)))
    diff = float(np.max(np.abs(o - r)))
    return diff / max(scale, 1e-30)


_DATA: dict[str, tuple[list[np.ndarray], list[np.ndarray], list[np.dtype]]] = {}
"""`read_data` of the last few data files, per process."""


def _stored(a: np.ndarray) -> np.ndarray:
    """`a` as .npz stores it: bf16 as its bits (numpy would write a void type)."""
    return a.view(np.uint16) if a.dtype == np.dtype(ml_dtypes.bfloat16) else a


def save_data(data_path: str, inputs: list[np.ndarray], refs: list[np.ndarray], output_dtypes: list[str]) -> None:
    """Write a task's data for `run` (and `gpu_measure`): inputs ``in{i}`` in
    their own element types (``type_in{i}`` names each one), the reference
    outputs ``ref{i}`` (f32 for a bf16 or f16 output: the reference is
    computed wider, `jobs.prepare_reference`), and ``dtype{i}``: the element
    type a candidate writes output i in."""
    arrays: dict[str, np.ndarray] = {}
    for i, a in enumerate(inputs):
        arrays[f"in{i}"] = _stored(a)
        arrays[f"type_in{i}"] = np.array(mlir_dtype(a.dtype))
    for i, (r, dt) in enumerate(zip(refs, output_dtypes)):
        arrays[f"ref{i}"] = _stored(r)
        arrays[f"type_ref{i}"] = np.array(mlir_dtype(r.dtype))
        arrays[f"dtype{i}"] = np.array(dt)
    np.savez(data_path, **arrays)


def _restored(data, key: str) -> np.ndarray:
    a = data[key]
    type_key = f"type_{key}"
    if type_key in data.files:
        dt = np_dtype(str(data[type_key]))
        if a.dtype != dt:
            a = a.view(dt)
    return np.ascontiguousarray(a)


def read_data(data_path: str) -> tuple[list[np.ndarray], list[np.ndarray], list[np.dtype]]:
    """(inputs, reference outputs, output element types) of a task's data as
    `save_data` wrote them; an older file without ``dtype{i}`` gives the
    reference's own types."""
    with np.load(data_path) as data:
        n_in = sum(1 for k in data.files if k.startswith("in") and k[2:].isdigit())
        n_ref = sum(1 for k in data.files if k.startswith("ref") and k[3:].isdigit())
        inputs = [_restored(data, f"in{i}") for i in range(n_in)]
        refs = [_restored(data, f"ref{i}") for i in range(n_ref)]
        dtypes = [
            np_dtype(str(data[f"dtype{i}"])) if f"dtype{i}" in data.files else refs[i].dtype for i in range(n_ref)
        ]
    return inputs, refs, dtypes


def load_data(data_path: str) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Inputs and reference outputs of a task, cached per process (a runner
    measures many candidates of the same task)."""
    return _cached(data_path)[:2]


def _cached(data_path: str) -> tuple[list[np.ndarray], list[np.ndarray], list[np.dtype]]:
    if data_path not in _DATA:
        if len(_DATA) >= 4:
            _DATA.pop(next(iter(_DATA)))
        _DATA[data_path] = read_data(data_path)
    return _DATA[data_path]


def output_dtypes(data_path: str) -> list[np.dtype]:
    """The element types a candidate's outputs are allocated in (bf16 for a
    bf16 result, whose reference is stored in f32)."""
    return _cached(data_path)[2]


def run(
    path: str,
    data_path: str,
    policy: TimingPolicy,
    check: bool = True,
    tol: float = 1e-4,
    cutoff_s: float = float("inf"),
) -> dict:
    """Check a kernel against the reference outputs, then time it.

    `data_path` is an .npz holding `in0..inN`, the reference `ref0..refM`
    and the outputs' element types (`save_data`); the outputs are allocated
    in those types and compared with the reference in float64.
    The checking run is timed too: when it and one more (warm) run both take
    longer than `cutoff_s` (the tuner passes a multiple of the best latency
    so far) the candidate is hopeless, and the warm run is its cost, instead
    of a full timing.
    Returns {"costs": [...], "error": relative error or None, "ok": bool}.
    """
    inputs, refs = load_data(data_path)
    dtypes = output_dtypes(data_path)
    kernel = Kernel(path)
    try:
        err = None
        if check:
            # Fresh copies: a kernel may write its inputs (destination style).
            ins = [aligned_copy(a) for a in inputs]
            outs = [poisoned(r.shape, dt) for r, dt in zip(refs, dtypes)]
            call = kernel.bind(ins + outs)
            t0 = time.perf_counter()
            call()
            first = time.perf_counter() - t0
            err = max((relative_error(o, r) for o, r in zip(outs, refs)), default=0.0)
            if not err <= tol:
                return {"costs": [], "error": err, "ok": False}
            if first > cutoff_s:
                # The checking run is the first call of a freshly loaded
                # library: its code pages fault in and a sleeping OpenMP
                # team wakes up. On a small kernel that is a few times the
                # kernel itself (a 16 x 1024 . 1024 x 1024 matmul at 2
                # threads: 0.3-0.7 ms first, 0.155 ms warm), and a cut on it
                # threw away near-best candidates. One warm run decides.
                t0 = time.perf_counter()
                call()
                warm = time.perf_counter() - t0
                if warm > cutoff_s:
                    return {"costs": [warm], "error": err, "ok": True, "cut": True}
            # The checking run was the warm-up; time on the same buffers.
            costs = time_callable(call, policy)
            return {"costs": costs, "error": err, "ok": True, "median_s": statistics.median(costs)}
        ins = [aligned_copy(a) for a in inputs]
        outs = [aligned_empty(r.shape, dt) for r, dt in zip(refs, dtypes)]
        costs = time_callable(kernel.bind(ins + outs), dataclasses.replace(policy, warmup=max(1, policy.warmup)))
        return {"costs": costs, "error": err, "ok": True, "median_s": statistics.median(costs)}
    finally:
        kernel.close()
