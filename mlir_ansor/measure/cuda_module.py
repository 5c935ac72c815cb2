"""Run a whole module compiled for an NVIDIA GPU (a bundle of
`cuda_compiler`): load its cubins, keep its buffers and weights on the GPU,
launch its kernels in order, copy the outputs back.

Like `cuda_runner`, this module imports no MLIR and nothing of mlir_ansor
beyond `cuda_runner`, so a GPU host with only numpy and cuda-python (or
pycuda) runs a bundle: copy the bundle folder and ``mlir_ansor/`` there, then
``CudaModule("model.cuda")(x)``.

A bundle is a folder:

  plan.json         what to allocate and launch (below)
  kernels/          <symbol>.ptx and <symbol>.cubin per distinct task
  weights/          <buffer id>.npy (raw <id>.bin where numpy lacks the type)

plan.json (``format`` = :data:`FORMAT`, ``version`` = :data:`VERSION`)::

  {"entry": "net", "target": "cuda:sm_90",
   "buffers": [{"id": 0, "role": "input", "index": 0, "shape": [8, 16], "dtype": "f32"},
               {"id": 1, "role": "constant", "file": "weights/1.npy", ...},
               {"id": 2, "role": "intermediate", ...},          # written by a kernel
               {"id": 3, "role": "view", "of": 2, ...}],        # same bytes, another shape
   "kernels": [{"symbol": "ansor_matmul", "cubin": "ansor_matmul.cubin", "ptx": ..., "ptxas": {...}}],
   "launches": [{"kernel": 0, "entry": "ansor_matmul_kernel", "grid": [gx, gy, gz],
                 "block": [bx, by, bz], "dynamic_smem": 0, "args": [2, 0, 1], "task": "matmul_...",
                 "task_args": [0, 1, 2], "task_inputs": 2}],   # the task's inputs, then its results
   "outputs": [3, ...],                                          # buffer ids, in result order
   "tasks": [...]}                                               # the schedule of each task (report)

Every kernel argument is a device pointer (bare-pointer convention) to the
buffer ``args[i]`` names; a view's pointer is its base buffer's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from mlir_ansor.measure.cuda_runner import CudaRunError, np_dtype, open_backend

__all__ = ["FORMAT", "PLAN_FILE", "VERSION", "CudaModule", "read_plan"]

FORMAT = "mlir-ansor-cuda-module"
VERSION = 1
PLAN_FILE = "plan.json"


def read_plan(folder: str | Path) -> dict:
    """The plan of the bundle in `folder`, checked for its format and version."""
    path = Path(folder) / PLAN_FILE
    try:
        plan = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CudaRunError(f"{folder}: not a CUDA module bundle ({e})") from None
    if plan.get("format") != FORMAT or plan.get("version") != VERSION:
        raise CudaRunError(f"{folder}: plan format {plan.get('format')!r} version {plan.get('version')!r}; "
                           f"expected {FORMAT!r} version {VERSION}")
    return plan


def _load_constant(folder: Path, buf: dict) -> np.ndarray:
    dt = np_dtype(buf["dtype"])
    path = folder / buf["file"]
    if path.suffix == ".npy":
        array = np.load(path, allow_pickle=False)
    else:
        array = np.fromfile(path, dtype=dt)
    return np.ascontiguousarray(array.reshape(buf["shape"]), dtype=dt)


class CudaModule:
    """A compiled module on an NVIDIA GPU, called like a function on numpy
    arrays (the entry function's arguments, in order; returns one array or
    a tuple).

    The first call (or :meth:`open`) opens the backend (`cuda_runner.
    open_backend`, or the `backend` given), loads every cubin, allocates
    every buffer of the plan once and uploads the constants (weights);
    later calls upload only the inputs, launch, and copy the outputs back.
    Not reentrant: the buffers are the module's.
    """

    def __init__(self, folder: str | Path, *, backend=None, device: int = 0) -> None:
        self.folder = Path(folder)
        self.plan = read_plan(self.folder)
        self.entry: str = self.plan["entry"]
        self.backend = backend
        self.device = device
        self._ptrs: dict[int, object] = {}
        self._modules: list = []
        self._funcs: list = []
        self._opened = False

    # ------------------------------------------------------------------ info
    @property
    def inputs(self) -> list[tuple[tuple[int, ...], str]]:
        """(shape, element type) of each argument of the entry function."""
        ins = sorted((b for b in self.plan["buffers"] if b["role"] == "input"), key=lambda b: b["index"])
        return [(tuple(b["shape"]), b["dtype"]) for b in ins]

    @property
    def outputs(self) -> list[tuple[tuple[int, ...], str]]:
        """(shape, element type) of each result of the entry function."""
        bufs = self.plan["buffers"]
        return [(tuple(bufs[i]["shape"]), bufs[i]["dtype"]) for i in self.plan["outputs"]]

    def pointer(self, buf_id: int):
        """The device pointer of buffer `buf_id` (a view's is its base's); after :meth:`open`."""
        return self._ptrs[self._base(buf_id)]

    # --------------------------------------------------------------- set up
    def _base(self, buf_id: int) -> int:
        buf = self.plan["buffers"][buf_id]
        while buf["role"] == "view":
            buf = self.plan["buffers"][buf["of"]]
        return buf["id"]

    def open(self) -> None:
        """Load the kernels, allocate the buffers and upload the weights (once)."""
        if self._opened:
            return
        if self.backend is None:
            self.backend = open_backend(self.device)
        be = self.backend
        try:
            for k in self.plan["kernels"]:
                self._modules.append(be.load((self.folder / "kernels" / k["cubin"]).read_bytes()))
            self._funcs = [be.function(self._modules[ln["kernel"]], ln["entry"]) for ln in self.plan["launches"]]
            for buf in self.plan["buffers"]:
                if buf["role"] == "view":
                    continue
                nbytes = math.prod(buf["shape"]) * np_dtype(buf["dtype"]).itemsize
                self._ptrs[buf["id"]] = be.alloc(nbytes)
                if buf["role"] == "constant":
                    be.to_device(self._ptrs[buf["id"]], _load_constant(self.folder, buf))
        except BaseException:
            self.close()
            raise
        self._args = [[self._ptrs[self._base(i)] for i in ln["args"]] for ln in self.plan["launches"]]
        self._opened = True

    # ------------------------------------------------------------------ run
    def upload(self, *arrays: np.ndarray) -> None:
        """Copy the entry function's arguments to their device buffers."""
        self.open()
        specs = self.inputs
        if len(arrays) != len(specs):
            raise ValueError(f"@{self.entry} takes {len(specs)} argument(s), got {len(arrays)}")
        ins = sorted((b for b in self.plan["buffers"] if b["role"] == "input"), key=lambda b: b["index"])
        for a, buf, (shape, dtype) in zip(arrays, ins, specs):
            a = np.asarray(a)
            if a.shape != shape:
                raise ValueError(f"@{self.entry}: argument {buf['index']} has shape {a.shape}, expected {shape}")
            self.backend.to_device(self._ptrs[buf["id"]], np.ascontiguousarray(a, dtype=np_dtype(dtype)))

    def launch(self) -> None:
        """Launch every kernel of the plan in order (asynchronously, on the backend's stream)."""
        for func, ln, ptrs in zip(self._funcs, self.plan["launches"], self._args):
            self.backend.launch(func, ln["grid"], ln["block"], ln.get("dynamic_smem", 0), ptrs)

    def download(self) -> list[np.ndarray]:
        """The outputs, copied from the device into new arrays."""
        self.backend.synchronize()
        outs = []
        for i, (shape, dtype) in zip(self.plan["outputs"], self.outputs):
            arr = np.empty(shape, dtype=np_dtype(dtype))
            self.backend.to_host(arr, self._ptrs[self._base(i)])
            outs.append(arr)
        return outs

    def __call__(self, *arrays: np.ndarray):
        self.upload(*arrays)
        self.launch()
        outs = self.download()
        if not outs:
            return None
        return outs[0] if len(outs) == 1 else tuple(outs)

    def time(self, *arrays: np.ndarray, repeat: int = 10, warmup: int = 1) -> list[float]:
        """Seconds of each of `repeat` runs of the launch sequence on
        `arrays` (uploaded once), measured with CUDA events after `warmup`
        runs."""
        self.upload(*arrays)
        be = self.backend
        for _ in range(warmup):
            self.launch()
        start, end = be.event(), be.event()
        costs = []
        for _ in range(repeat):
            be.record(start)
            self.launch()
            be.record(end)
            costs.append(be.elapsed_s(start, end))
        return costs

    def close(self) -> None:
        """Free the device buffers and unload the kernels."""
        be = self.backend
        for ptr in self._ptrs.values():
            try:
                be.free(ptr)
            except CudaRunError:
                pass
        for m in self._modules:
            try:
                be.unload(m)
            except CudaRunError:
                pass
        self._ptrs.clear()
        self._modules.clear()
        self._funcs = []
        self._opened = False
