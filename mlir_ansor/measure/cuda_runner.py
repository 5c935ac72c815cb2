"""Run a built GPU candidate: load its cubin, launch, check, time with CUDA events.

This module imports no MLIR and nothing else of mlir_ansor, so it runs on a
GPU host that has only numpy and a CUDA driver binding; load it by path
there (`benchmarks/gpu_bench.py` does). What it needs is the candidate's
manifest entry (written by `passes.nvvm.CudaBuild.to_json`):

  {"cubin": "x.cubin",
   "launches": [{"entry": "k", "grid": [gx, gy, gz], "block": [bx, by, bz],
                 "args": [0, 1, 2], "dynamic_smem": 0}, ...],
   "buffers": [{"role": "input"|"output", "shape": [...], "dtype": "f32"}, ...]}

Every kernel argument is a device pointer to one of the buffers (bare-pointer
calling convention). Backends: NVIDIA's `cuda-python` (`cuda.bindings.driver`)
first, `pycuda` where that is installed.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

_NP = {
    "f32": np.float32, "f16": np.float16, "f64": np.float64,
    "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64,
}
try:  # numpy has no bf16; ml_dtypes (a dependency of mlir-ansor) brings it
    import ml_dtypes

    _NP["bf16"] = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover - a GPU host with numpy only
    pass


class CudaUnavailable(RuntimeError):
    """No CUDA driver binding, no driver, or no device."""


class CudaRunError(RuntimeError):
    """A driver call failed while loading or running a candidate."""


def np_dtype(dtype: str) -> np.dtype:
    """numpy's type for an element type ("bf16": ``ml_dtypes.bfloat16``)."""
    if dtype not in _NP:
        extra = " (bf16 needs the ml_dtypes package)" if dtype == "bf16" else ""
        raise ValueError(f"element type {dtype} has no numpy equivalent here{extra}")
    return np.dtype(_NP[dtype])


# --------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------


class _DriverBackend:
    """`cuda.bindings.driver` (cuda-python >= 12.x; older: `cuda.cuda`)."""

    name = "cuda-python"

    def __init__(self, device: int = 0) -> None:
        try:
            from cuda.bindings import driver as cu  # type: ignore[import-not-found]
        except ImportError:
            try:
                from cuda import cuda as cu  # type: ignore[import-not-found,no-redef]
            except ImportError as e:
                raise CudaUnavailable("cuda-python (cuda.bindings) is not installed") from e
        self.cu = cu
        try:
            self._call(cu.cuInit(0), "cuInit")
            dev = self._call(cu.cuDeviceGet(device), "cuDeviceGet")
            self.ctx = self._call(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            self._call(cu.cuCtxSetCurrent(self.ctx), "cuCtxSetCurrent")
            self.stream = self._call(cu.cuStreamCreate(0), "cuStreamCreate")
            name = self._call(cu.cuDeviceGetName(256, dev), "cuDeviceGetName")
            self.device_name = bytes(name).split(b"\0", 1)[0].decode(errors="replace")
        except Exception as e:  # noqa: BLE001 - no driver library raises its own error types
            raise CudaUnavailable(f"no usable CUDA device: {type(e).__name__}: {e}") from None

    def _call(self, result, what: str):
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            _, msg = self.cu.cuGetErrorString(err)
            text = msg.decode() if isinstance(msg, bytes) else str(msg)
            raise CudaRunError(f"{what}: {text} ({int(err)})")
        if not rest:
            return None
        return rest[0] if len(rest) == 1 else tuple(rest)

    def load(self, image: bytes):
        return self._call(self.cu.cuModuleLoadData(image), "cuModuleLoadData")

    def function(self, module, entry: str):
        return self._call(self.cu.cuModuleGetFunction(module, entry.encode()), f"cuModuleGetFunction({entry})")

    def unload(self, module) -> None:
        self._call(self.cu.cuModuleUnload(module), "cuModuleUnload")

    def alloc(self, nbytes: int):
        return self._call(self.cu.cuMemAlloc(max(1, nbytes)), "cuMemAlloc")

    def free(self, ptr) -> None:
        self._call(self.cu.cuMemFree(ptr), "cuMemFree")

    def to_device(self, ptr, array: np.ndarray) -> None:
        self._call(self.cu.cuMemcpyHtoD(ptr, array.ctypes.data, array.nbytes), "cuMemcpyHtoD")

    def to_host(self, array: np.ndarray, ptr) -> None:
        self._call(self.cu.cuMemcpyDtoH(array.ctypes.data, ptr, array.nbytes), "cuMemcpyDtoH")

    def launch(self, func, grid, block, smem: int, ptrs: list) -> None:
        # kernelParams: the address of an array of pointers to the values.
        values = [np.array([int(p)], dtype=np.uint64) for p in ptrs]
        addrs = np.array([v.ctypes.data for v in values], dtype=np.uint64)
        self._call(
            self.cu.cuLaunchKernel(func, *grid, *block, smem, self.stream, addrs.ctypes.data, 0),
            "cuLaunchKernel",
        )

    def event(self):
        return self._call(self.cu.cuEventCreate(0), "cuEventCreate")

    def record(self, ev) -> None:
        self._call(self.cu.cuEventRecord(ev, self.stream), "cuEventRecord")

    def elapsed_s(self, start, end) -> float:
        self._call(self.cu.cuEventSynchronize(end), "cuEventSynchronize")
        return self._call(self.cu.cuEventElapsedTime(start, end), "cuEventElapsedTime") / 1e3

    def synchronize(self) -> None:
        self._call(self.cu.cuStreamSynchronize(self.stream), "cuStreamSynchronize")


class _PycudaBackend:
    name = "pycuda"

    def __init__(self, device: int = 0) -> None:
        try:
            import pycuda.driver as drv  # type: ignore[import-not-found]
        except ImportError as e:
            raise CudaUnavailable("pycuda is not installed") from e
        try:
            drv.init()
            self.dev = drv.Device(device)
            self.context = self.dev.retain_primary_context()
            self.context.push()
        except Exception as e:  # noqa: BLE001 - pycuda raises its own types
            raise CudaUnavailable(f"no usable CUDA device: {e}") from None
        self.drv = drv
        self.device_name = self.dev.name()
        self.stream = drv.Stream()

    def load(self, image: bytes):
        return self.drv.module_from_buffer(image)

    def function(self, module, entry: str):
        return module.get_function(entry)

    def unload(self, module) -> None:
        pass

    def alloc(self, nbytes: int):
        return self.drv.mem_alloc(max(1, nbytes))

    def free(self, ptr) -> None:
        ptr.free()

    def to_device(self, ptr, array: np.ndarray) -> None:
        self.drv.memcpy_htod(ptr, array)

    def to_host(self, array: np.ndarray, ptr) -> None:
        self.drv.memcpy_dtoh(array, ptr)

    def launch(self, func, grid, block, smem: int, ptrs: list) -> None:
        func(*[np.uintp(int(p)) for p in ptrs], grid=tuple(grid), block=tuple(block), shared=smem, stream=self.stream)

    def event(self):
        return self.drv.Event()

    def record(self, ev) -> None:
        ev.record(self.stream)

    def elapsed_s(self, start, end) -> float:
        end.synchronize()
        return start.time_till(end) / 1e3

    def synchronize(self) -> None:
        self.stream.synchronize()


def device_count() -> tuple[int, str]:
    """How many CUDA devices this process sees, and why none when 0 (no
    `cuda-python`, no driver library, or no device); makes no context."""
    try:
        from cuda.bindings import driver as cu  # type: ignore[import-not-found]
    except ImportError:
        try:
            from cuda import cuda as cu  # type: ignore[import-not-found,no-redef]
        except ImportError:
            return 0, "cuda-python (cuda.bindings) is not installed"
    try:
        (err,) = cu.cuInit(0)
        if int(err) != 0:
            return 0, f"cuInit failed ({int(err)}): no CUDA driver or no device"
        err, n = cu.cuDeviceGetCount()
        if int(err) != 0:
            return 0, f"cuDeviceGetCount failed ({int(err)})"
    except Exception as e:  # noqa: BLE001 - a missing libcuda raises its own types
        return 0, f"no CUDA driver: {type(e).__name__}: {e}"
    return int(n), "" if n else "the CUDA driver reports no device"


# A built candidate as one file (what a builder hands to a runner, which may
# be on another machine): a magic line, its manifest entry as one JSON line,
# then the cubin's bytes.
_BUNDLE_MAGIC = b"mlir-ansor-cuda-bundle 1\n"


def write_bundle(path: str | Path, entry: dict, cubin: bytes) -> None:
    """Write a candidate's manifest `entry` and `cubin` to one file."""
    Path(path).write_bytes(_BUNDLE_MAGIC + json.dumps(entry).encode() + b"\n" + cubin)


def read_bundle(path: str | Path) -> tuple[dict, bytes]:
    """The manifest entry and cubin of a file written by :func:`write_bundle`."""
    data = Path(path).read_bytes()
    if not data.startswith(_BUNDLE_MAGIC):
        raise CudaRunError(f"{path}: not a candidate bundle")
    head, _, image = data[len(_BUNDLE_MAGIC) :].partition(b"\n")
    return json.loads(head), image


def open_backend(device: int = 0):
    """The first CUDA backend that works; raises :class:`CudaUnavailable`
    with every reason otherwise."""
    reasons = []
    for cls in (_DriverBackend, _PycudaBackend):
        try:
            return cls(device)
        except CudaUnavailable as e:
            reasons.append(f"{cls.name}: {e}")
    raise CudaUnavailable("; ".join(reasons))


# --------------------------------------------------------------------------
# Running a candidate
# --------------------------------------------------------------------------


@dataclass
class RunResult:
    ok: bool
    costs: list[float] = field(default_factory=list)  # seconds per run (all launches)
    max_rel_err: float = float("nan")
    error: str = ""

    @property
    def latency_s(self) -> float:
        return statistics.median(self.costs) if self.costs else float("inf")

    def to_json(self) -> dict:
        return {"ok": self.ok, "costs": self.costs, "latency_s": self.latency_s if self.costs else None,
                "max_rel_err": self.max_rel_err, "error": self.error}


#: 4 epsilons of each type a kernel may round its f32 inputs to (the
#: manifest's "rounds_to", `passes.nvvm.input_rounding`): what `ir.dtypes.
#: tolerance` adds for ``rounds_to``, kept here since this module imports
#: nothing of the package (a test checks that the two agree).
INPUT_ROUNDING_TOLERANCE = {"tf32": 4 * 2.0**-10}


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    if not np.all(np.isfinite(out)):
        return float("inf")
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    diff = float(np.max(np.abs(out.astype(np.float64) - ref.astype(np.float64)))) if ref.size else 0.0
    return diff / max(scale, 1e-30)


def run(
    backend,
    entry: dict,
    folder: str | Path,
    inputs: list[np.ndarray],
    references: list[np.ndarray] | None,
    tol: float,
    *,
    warmup: int = 1,
    min_repeat: int = 3,
    max_repeat: int = 20,
    min_time_s: float = 0.2,
    slow_s: float = 1.0,
    image: bytes | None = None,
) -> RunResult:
    """Load the candidate's cubin, run it once on `inputs` and check the
    outputs against `references` (relative max error <= `tol`), then time
    the whole launch sequence with CUDA events: `warmup` runs, then at least
    `min_repeat` and at most `max_repeat` runs, until `min_time_s` is spent.
    A checking run slower than `slow_s` is the only timing. `image`: the
    cubin's bytes (else read from `folder` / ``entry["cubin"]``). A kernel
    that rounds its inputs (``entry["rounds_to"]``: tf32 tensor cores on
    f32) is checked with that rounding's epsilons added to `tol`."""
    tol = tol + INPUT_ROUNDING_TOLERANCE.get(entry.get("rounds_to", ""), 0.0)
    buffers = entry["buffers"]
    if image is None:
        image = (Path(folder) / entry["cubin"]).read_bytes()
    module = backend.load(image)
    ptrs: list = []
    try:
        funcs = [backend.function(module, k["entry"]) for k in entry["launches"]]
        ins = [b for b in buffers if b["role"] == "input"]
        if len(ins) != len(inputs):
            return RunResult(False, error=f"{len(inputs)} inputs given, the kernel takes {len(ins)}")
        outs: list[np.ndarray] = []
        it = iter(inputs)
        for b in buffers:
            shape, dt = tuple(b["shape"]), np_dtype(b["dtype"])
            if b["role"] == "input":
                arr = np.ascontiguousarray(next(it), dtype=dt)
                if arr.shape != shape:
                    return RunResult(False, error=f"input of shape {arr.shape}, expected {shape}")
            else:
                arr = np.full(shape, np.iinfo(dt).min if np.issubdtype(dt, np.integer) else np.nan, dtype=dt)
                outs.append(arr)
            p = backend.alloc(arr.nbytes)
            ptrs.append(p)
            backend.to_device(p, arr)

        def once() -> None:
            for f, k in zip(funcs, entry["launches"]):
                backend.launch(f, k["grid"], k["block"], k.get("dynamic_smem", 0), [ptrs[i] for i in k["args"]])

        start, end = backend.event(), backend.event()
        backend.record(start)
        once()
        backend.record(end)
        first = backend.elapsed_s(start, end)
        err = 0.0
        if references is not None:
            out_ptrs = [p for p, b in zip(ptrs, buffers) if b["role"] == "output"]
            for arr, p, ref in zip(outs, out_ptrs, references):
                backend.to_host(arr, p)
                err = max(err, relative_error(arr, np.asarray(ref)))
            if not err <= tol:
                return RunResult(False, [first], err, f"wrong answer: relative error {err:.3g} > {tol:.3g}")
        if first >= slow_s:
            return RunResult(True, [first], err)
        for _ in range(warmup):
            once()
        costs: list[float] = []
        spent = 0.0
        while len(costs) < max_repeat and (len(costs) < min_repeat or spent < min_time_s):
            backend.record(start)
            once()
            backend.record(end)
            c = backend.elapsed_s(start, end)
            costs.append(c)
            spent += c
        return RunResult(True, costs, err)
    except CudaRunError as e:
        return RunResult(False, error=str(e))
    finally:
        for p in ptrs:
            try:
                backend.free(p)
            except CudaRunError:
                pass
        try:
            backend.unload(module)
        except CudaRunError:
            pass
