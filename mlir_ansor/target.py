"""What a compilation target is.

A :class:`Target` says what the schedules may assume about the machine: the
vector width (in bits) of its SIMD unit, how many cores there are, the CPU
model (so that measurements are only compared between machines of the same
kind). Targets are plain frozen dataclasses; ``Target.host()`` reads the
machine mlir-ansor runs on.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field

from mlir_ansor.errors import AnsorError


def _cpu_flags_and_model() -> tuple[frozenset[str], str]:
    flags: set[str] = set()
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "flags" and not flags:
                    flags = set(value.split())
                elif key == "model name":
                    model = value.strip()
    except OSError:
        pass
    return frozenset(flags), model


# Per-architecture limits of one thread block: (static shared memory,
# opt-in dynamic shared memory, registers per block). Static `.shared` (what workgroup attributions become) is capped at
# 48 KiB on every architecture.
_CUDA_ARCHS: dict[int, tuple[int, int, int]] = {
    70: (48 * 1024, 96 * 1024, 65536),
    75: (48 * 1024, 64 * 1024, 65536),
    80: (48 * 1024, 163 * 1024, 65536),
    86: (48 * 1024, 99 * 1024, 65536),
    89: (48 * 1024, 99 * 1024, 65536),
    90: (48 * 1024, 227 * 1024, 65536),
    100: (48 * 1024, 227 * 1024, 65536),
    120: (48 * 1024, 99 * 1024, 65536),
}



def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (``taskset``, a
    container's cpuset), not the machine's count. Under ``taskset -c 0`` on a
    2-core machine, counting 2 made the tuner build the next batch on the
    very core that was timing this one (GEMM 1024's default point measured
    33 GFLOP/s that way, 54 alone)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Target:
    """A CPU or CUDA target.

    kind: "cpu" or "cuda".
    vector_bits: width of the widest SIMD register the schedules may use.
    cores: physical parallelism available to ``scf.forall``.
    model: CPU model name (or the CUDA arch), recorded with every measurement.
    features: ISA features, e.g. ("avx2", "fma").

    CUDA only (zero for a CPU):
    arch: compute capability as an int (90 for sm_90).
    smem_per_block: static shared memory a block may use, bytes.
    smem_per_block_optin: with the dynamic opt-in, bytes.
    max_threads_per_block, registers_per_block, max_registers_per_thread,
    warp_size: the usual hardware limits.
    """

    kind: str = "cpu"
    vector_bits: int = 256
    cores: int = 1
    model: str = "unknown"
    features: tuple[str, ...] = field(default_factory=tuple)
    arch: int = 0
    smem_per_block: int = 0
    smem_per_block_optin: int = 0
    max_threads_per_block: int = 0
    registers_per_block: int = 0
    max_registers_per_thread: int = 0
    warp_size: int = 0

    @staticmethod
    def cuda(arch: int | str = 90) -> Target:
        """An NVIDIA target, e.g. ``Target.cuda(90)`` or ``Target.cuda("sm_80")``."""
        text = str(arch).lower()
        digits = text[3:] if text.startswith("sm_") else text
        digits = digits.rstrip("a")  # sm_90a: same limits
        if not digits.isdigit():
            raise AnsorError(f"CUDA arch {arch!r}: expected sm_XX (e.g. sm_90)")
        cc = int(digits)
        if cc not in _CUDA_ARCHS:
            known = ", ".join(f"sm_{a}" for a in sorted(_CUDA_ARCHS))
            raise AnsorError(f"CUDA arch sm_{cc} is not known; expected one of {known}")
        smem, optin, regs = _CUDA_ARCHS[cc]
        return Target(
            kind="cuda",
            vector_bits=128,  # widest global load (ld.global.v4.b32)
            cores=1,
            model=f"sm_{cc}",
            features=(f"sm_{cc}",),
            arch=cc,
            smem_per_block=smem,
            smem_per_block_optin=optin,
            max_threads_per_block=1024,
            registers_per_block=regs,
            max_registers_per_thread=255,
            warp_size=32,
        )

    @property
    def chip(self) -> str:
        """The arch name given to NVVM and ptxas ("sm_90")."""
        return f"sm_{self.arch}"

    @staticmethod
    def host() -> Target:
        """The machine this process runs on."""
        flags, model = _cpu_flags_and_model()
        if "avx512f" in flags:
            bits = 512
        elif "avx2" in flags or "avx" in flags:
            bits = 256
        else:
            bits = 128
        feats = tuple(sorted(f for f in ("avx512f", "avx2", "fma", "avx", "neon") if f in flags))
        return Target("cpu", bits, usable_cores(), model, feats)

    @staticmethod
    def parse(spec: str | None) -> Target:
        """Parse a command-line target spec: "cpu" (the host), "cuda" (sm_90)
        or "cuda:sm_XX"."""
        if spec in (None, "", "cpu", "host", "llvm"):
            return Target.host()
        if spec in ("cuda", "gpu", "nvidia"):
            return Target.cuda(90)
        if spec.startswith("cuda:"):
            return Target.cuda(spec.split(":", 1)[1])
        raise AnsorError(f"unknown target {spec!r}: expected 'cpu', 'cuda' or 'cuda:sm_XX'")

    def lanes(self, dtype: str) -> int:
        """How many elements of `dtype` fit in one vector register."""
        bits = {"f64": 64, "f32": 32, "f16": 16, "bf16": 16, "i64": 64, "i32": 32, "i8": 8}.get(dtype, 32)
        return max(1, self.vector_bits // bits)

    @property
    def key(self) -> str:
        """A short string naming the target, stored with every record."""
        if self.kind == "cuda":
            return f"cuda:{self.chip}"
        feats = "+".join(self.features) or "generic"
        return f"cpu:{feats}"
