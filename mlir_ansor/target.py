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

from .errors import AnsorError


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


@dataclass(frozen=True)
class Target:
    """A CPU target.

    kind: "cpu" (GPU targets are a separate issue).
    vector_bits: width of the widest SIMD register the schedules may use.
    cores: physical parallelism available to ``scf.forall``.
    model: CPU model name, recorded with every measurement.
    features: ISA features, e.g. ("avx2", "fma").
    """

    kind: str = "cpu"
    vector_bits: int = 256
    cores: int = 1
    model: str = "unknown"
    features: tuple[str, ...] = field(default_factory=tuple)

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
        return Target("cpu", bits, os.cpu_count() or 1, model, feats)

    @staticmethod
    def parse(spec: str | None) -> Target:
        """Parse a command-line target spec: "cpu" (the host) for now."""
        if spec in (None, "", "cpu", "host", "llvm"):
            return Target.host()
        if spec.startswith("cuda"):
            raise AnsorError(
                f"target {spec!r}: CUDA targets are not available in this version; use --target cpu"
            )
        raise AnsorError(f"unknown target {spec!r}: expected 'cpu'")

    def lanes(self, dtype: str) -> int:
        """How many elements of `dtype` fit in one vector register."""
        bits = {"f64": 64, "f32": 32, "f16": 16, "bf16": 16, "i64": 64, "i32": 32, "i8": 8}.get(dtype, 32)
        return max(1, self.vector_bits // bits)

    @property
    def key(self) -> str:
        """A short string naming the target, stored with every record."""
        feats = "+".join(self.features) or "generic"
        return f"cpu:{feats}"
