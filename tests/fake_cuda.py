"""A stand-in CUDA device for the tuner's GPU tests on machines without one.

`run_on_fake_gpu` and `reference_on_fake_gpu` are the CUDA job functions
(`jobs.run_cuda_candidate`, `jobs.prepare_cuda_reference`) with this
worker's CUDA backend replaced by :class:`FakeMatmulDevice`, which loads
the real cubin (checks it is an ELF image), keeps the buffers, and on each
launch computes C = A @ B itself. So everything around the driver (the
bundle, the buffer order, the check against the reference, the timing
loop, the records) runs as on a GPU; `wrong_run_on_fake_gpu` adds 1 to C,
which the check must catch.

`gpu_measure` (measuring a build-only database without MLIR) takes a device
as ``--backend fake_cuda:CALLABLE``: :class:`FakeMatmulDevice`,
:func:`wrong_device`, or :func:`faulty_device` (crashes or hangs on the
first launch). This module imports no MLIR (the jobs only when installed).
"""

from __future__ import annotations

import os
import time

import numpy as np


class _FakeTimer:
    """A device's timing calls: every launch takes 0.1 ms."""

    def event(self):
        return object()

    def record(self, ev):
        pass

    def elapsed_s(self, start, end):
        return 1e-4

    def synchronize(self):
        pass


class FakeMatmulDevice(_FakeTimer):
    name = "fake"
    device_name = "Fake GPU"

    def __init__(self, wrong: bool = False) -> None:
        self.mem: dict[int, np.ndarray | None] = {}
        self.order: list[int] = []
        self.wrong = wrong
        self.next = 4096

    def load(self, image):
        assert image[:4] == b"\x7fELF", "a cubin is an ELF image"
        return "module"

    def function(self, module, entry):
        return entry

    def unload(self, module):
        pass

    def alloc(self, nbytes):
        ptr, self.next = self.next, self.next + 4096  # 4096, 8192, ... never reused
        self.mem[ptr] = None
        self.order.append(ptr)
        return ptr

    def free(self, ptr):
        del self.mem[ptr]
        self.order.remove(ptr)

    def to_device(self, ptr, array):
        self.mem[ptr] = array.copy()

    def to_host(self, array, ptr):
        array[...] = self.mem[ptr]

    def launch(self, func, grid, block, smem, ptrs):
        a, b, c = (self.mem[p] for p in self.order[:3])  # host-argument order: A, B, C
        c[...] = a @ b + (1.0 if self.wrong else 0.0)


def wrong_device() -> FakeMatmulDevice:
    return FakeMatmulDevice(wrong=True)


class _FaultyDevice(FakeMatmulDevice):
    """Aborts the process ($FAKE_GPU_FAULT=abort) or hangs (=hang) on the
    first launch of all processes that share the marker file
    $FAKE_GPU_MARKER; later launches compute the product."""

    def launch(self, func, grid, block, smem, ptrs):
        marker = os.environ["FAKE_GPU_MARKER"]
        if not os.path.exists(marker):
            open(marker, "w").close()
            if os.environ.get("FAKE_GPU_FAULT") == "hang":
                time.sleep(3600)
            os.abort()
        super().launch(func, grid, block, smem, ptrs)


def faulty_device() -> FakeMatmulDevice:
    return _FaultyDevice()


def _install(wrong: bool = False) -> None:
    from mlir_ansor.measure import jobs

    jobs._BACKENDS[:] = [FakeMatmulDevice(wrong)]


def reference_on_fake_gpu(*args):
    from mlir_ansor.measure import jobs

    _install()
    return jobs.prepare_cuda_reference(*args)


def run_on_fake_gpu(*args):
    from mlir_ansor.measure import jobs

    _install()
    return jobs.run_cuda_candidate(*args)


def wrong_run_on_fake_gpu(*args):
    from mlir_ansor.measure import jobs

    _install(wrong=True)
    return jobs.run_cuda_candidate(*args)


class FakeModuleDevice(_FakeTimer):
    """A stand-in device for whole modules (`measure.cuda_module.CudaModule`):
    buffers are byte arrays at distinct, never reused addresses; it records
    every upload (pointer, bytes) and every launch (entry, grid, block,
    pointers), and on a launch calls ``on_launch(entry, pointers)`` when set
    (a test computes the kernel's task with numpy there, through
    :meth:`array`)."""

    name = "fake-module"
    device_name = "Fake GPU"

    def __init__(self) -> None:
        self.mem: dict[int, np.ndarray] = {}
        self.next = 1 << 20
        self.uploads: list[tuple[int, int]] = []
        self.launches: list[tuple[str, tuple, tuple, tuple[int, ...]]] = []
        self.images: list[bytes] = []
        self.on_launch = None

    def load(self, image):
        assert image[:4] == b"\x7fELF", "a cubin is an ELF image"
        self.images.append(image)
        return len(self.images) - 1

    def function(self, module, entry):
        return entry

    def unload(self, module):
        pass

    def alloc(self, nbytes):
        ptr = self.next
        self.next += -(-max(1, nbytes) // 256) * 256 + 256  # 256-byte aligned, a gap between buffers
        self.mem[ptr] = np.zeros(nbytes, np.uint8)
        return ptr

    def free(self, ptr):
        del self.mem[ptr]

    def to_device(self, ptr, array):
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        assert data.nbytes == self.mem[ptr].nbytes, (data.nbytes, self.mem[ptr].nbytes)
        self.mem[ptr][:] = data
        self.uploads.append((ptr, data.nbytes))

    def to_host(self, array, ptr):
        array.reshape(-1).view(np.uint8)[:] = self.mem[ptr]

    def array(self, ptr, shape, dtype) -> np.ndarray:
        """The buffer at `ptr` seen as an array (writes go to the device)."""
        return self.mem[ptr].view(dtype).reshape(shape)

    def launch(self, func, grid, block, smem, ptrs):
        self.launches.append((func, tuple(grid), tuple(block), tuple(int(p) for p in ptrs)))
        if self.on_launch is not None:
            self.on_launch(func, [int(p) for p in ptrs])
