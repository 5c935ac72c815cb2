"""What a compilation target is.

A :class:`Target` says what the schedules may assume about the machine: the
vector width (in bits) of its SIMD unit, its ISA features (the dot-product
and narrow-type ones too: AVX-512 BF16 and VNNI, AVX-VNNI, AMX), how many
cores there are, the CPU model (so that measurements are only compared
between machines of the same kind) and the LLVM CPU name code is built for.
Targets are plain frozen dataclasses; ``Target.host()`` reads the machine
mlir-ansor runs on, ``Target.cpu("znver4")`` names another one (from
:data:`NAMED_CPUS`), so that a schedule can be written and built for a CPU
other than the host (``passes/objcode.py`` builds the object code).

Which instructions each feature brings for a dot product is a table,
:data:`DOT_PRODUCTS`; :attr:`Target.dot_products` is its part the target
has, and what a tensorizing schedule asks.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field

from mlir_ansor.errors import AnsorError

CPU_FEATURES: tuple[str, ...] = (
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_bf16",
    "avx512_vnni",
    "avx512_fp16",
    "avx_vnni",
    "avx_vnni_int8",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "neon",
)
"""The CPU features a :class:`Target` records, as ``/proc/cpuinfo`` spells
them (every other flag is ignored): the vector ISAs, and the dot-product and
narrow-type extensions the schedules may use. Adding one changes the
:attr:`Target.key` of the hosts that have it."""

_LLVM_ATTRS: dict[str, str] = {
    "avx": "avx",
    "avx2": "avx2",
    "fma": "fma",
    "f16c": "f16c",
    "avx512f": "avx512f",
    "avx512bw": "avx512bw",
    "avx512vl": "avx512vl",
    "avx512_bf16": "avx512bf16",
    "avx512_vnni": "avx512vnni",
    "avx512_fp16": "avx512fp16",
    "avx_vnni": "avxvnni",
    "avx_vnni_int8": "avxvnniint8",
    "amx_tile": "amx-tile",
    "amx_bf16": "amx-bf16",
    "amx_int8": "amx-int8",
    "neon": "neon",
}
"""cpuinfo spelling -> LLVM's ``-mattr`` spelling."""

_X86 = {f for f in CPU_FEATURES if f != "neon"}

_HASWELL = ("avx", "avx2", "fma", "f16c")
_SKX = _HASWELL + ("avx512f", "avx512bw", "avx512vl")
_SPR = _SKX + ("avx512_bf16", "avx512_vnni", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
_ZEN4 = _SKX + ("avx512_bf16", "avx512_vnni")

NAMED_CPUS: dict[str, tuple[str, ...]] = {
    "x86-64-v3": _HASWELL,
    "x86-64-v4": _SKX,
    "haswell": _HASWELL,
    "skylake-avx512": _SKX,
    "cascadelake": _SKX + ("avx512_vnni",),
    "cooperlake": _SKX + ("avx512_vnni", "avx512_bf16"),
    "icelake-server": _SKX + ("avx512_vnni",),
    "sapphirerapids": _SPR,
    "emeraldrapids": _SPR,
    "graniterapids": _SPR,
    "alderlake": _HASWELL + ("avx_vnni",),
    "sierraforest": _HASWELL + ("avx_vnni", "avx_vnni_int8"),
    "arrowlake": _HASWELL + ("avx_vnni", "avx_vnni_int8"),
    "znver2": _HASWELL,
    "znver3": _HASWELL,
    "znver4": _ZEN4,
    "znver5": _ZEN4 + ("avx_vnni",),
}
"""x86-64 CPUs by their LLVM name (``-mcpu``), with the :data:`CPU_FEATURES`
LLVM gives them, so that ``Target.cpu(name).key`` equals the key of a host of
that kind (``tests/test_target.py`` checks the dot-product features against
what ``llc -mcpu=NAME`` accepts). The vector width follows from the features,
as for the host: 512 bits with AVX-512 (Zen 4 runs them as two halves, and
is still given 512), else 256."""


@dataclass(frozen=True)
class DotProduct:
    """One SIMD dot-product instruction: each 32-bit lane of the accumulator
    gains the sum of `group` products of adjacent narrow elements.

    kind: what it multiplies and accumulates, "bf16xbf16->f32",
        "u8xs8->i32" (the first operand unsigned), "s16xs16->i32", "s8xs8->i32".
    feature: the :data:`CPU_FEATURES` flag that provides it.
    bits: vector width of its operands.
    group: narrow elements per accumulator lane (2 for bf16 and 16-bit, 4 for 8-bit).
    instruction: the mnemonic in a disassembly.
    intrinsic: the LLVM intrinsic (``llvm.call_intrinsic``; LLVM 22 operand
        types: `acc_type`, then two `operand_type`), or the x86vector op
        (`x86vector_op`) that lowers to it, where MLIR has one.
    """

    kind: str
    feature: str
    bits: int
    group: int
    instruction: str
    intrinsic: str
    acc_type: str
    operand_type: str
    x86vector_op: str = ""
    needs: tuple[str, ...] = ()  # further features (AVX-512VL for the 256-bit EVEX forms)
    accumulates: bool = True  # False: the products' sums only, an add follows (AVX2's vpmaddwd)


DOT_PRODUCTS: tuple[DotProduct, ...] = (
    DotProduct("bf16xbf16->f32", "avx512_bf16", 512, 2, "vdpbf16ps", "llvm.x86.avx512bf16.dpbf16ps.512",
               "vector<16xf32>", "vector<32xbf16>", "x86vector.avx512.dot"),
    DotProduct("bf16xbf16->f32", "avx512_bf16", 256, 2, "vdpbf16ps", "llvm.x86.avx512bf16.dpbf16ps.256",
               "vector<8xf32>", "vector<16xbf16>", "x86vector.avx512.dot", ("avx512vl",)),
    DotProduct("u8xs8->i32", "avx512_vnni", 512, 4, "vpdpbusd", "llvm.x86.avx512.vpdpbusd.512",
               "vector<16xi32>", "vector<64xi8>"),
    DotProduct("u8xs8->i32", "avx512_vnni", 256, 4, "vpdpbusd", "llvm.x86.avx512.vpdpbusd.256",
               "vector<8xi32>", "vector<32xi8>", "", ("avx512vl",)),
    DotProduct("u8xs8->i32", "avx_vnni", 256, 4, "vpdpbusd", "llvm.x86.avx512.vpdpbusd.256",
               "vector<8xi32>", "vector<32xi8>"),
    DotProduct("s16xs16->i32", "avx512_vnni", 512, 2, "vpdpwssd", "llvm.x86.avx512.vpdpwssd.512",
               "vector<16xi32>", "vector<32xi16>"),
    DotProduct("s16xs16->i32", "avx512_vnni", 256, 2, "vpdpwssd", "llvm.x86.avx512.vpdpwssd.256",
               "vector<8xi32>", "vector<16xi16>", "", ("avx512vl",)),
    DotProduct("s16xs16->i32", "avx_vnni", 256, 2, "vpdpwssd", "llvm.x86.avx512.vpdpwssd.256",
               "vector<8xi32>", "vector<16xi16>"),
    DotProduct("s8xs8->i32", "avx_vnni_int8", 256, 4, "vpdpbssd", "llvm.x86.avx2.vpdpbssd.256",
               "vector<8xi32>", "vector<32xi8>", "x86vector.avx.dot.i8"),
    # AVX2 alone: the same pairs of 16-bit products without the accumulation
    # (an add follows; LLVM fuses them where the CPU has VNNI).
    DotProduct("s16xs16->i32", "avx2", 256, 2, "vpmaddwd", "llvm.x86.avx2.pmadd.wd",
               "vector<8xi32>", "vector<16xi16>", accumulates=False),
)
"""The x86 dot products, widest first within a kind. The 256-bit
``vpdpbusd``/``vpdpwssd`` intrinsics are one each for two encodings: EVEX with
AVX512-VNNI + AVX512-VL, VEX with AVX-VNNI (LLVM picks). AMX (tiles, not
vectors) is recorded in the features and is not a vector dot product: its
matmuls are `search.rules.amx`'s."""


DOT_RATES: dict[tuple[str, str, int], float] = {
    # Zen 5 (EPYC 9005, family 26), full-width AVX-512: FMA zmm 240 GFLOP/s,
    # vdpbf16ps 478, vpdpbusd 956 GOP/s, vpdpwssd 475 (one core).
    ("znver5", "vdpbf16ps", 512): 2.0,
    ("znver5", "vpdpbusd", 512): 4.0,
    ("znver5", "vpdpwssd", 512): 2.0,
    # Zen 4 (family 25), AVX-512 in two halves: FMA 118 GFLOP/s, vdpbf16ps
    # 202-227.
    ("znver4", "vdpbf16ps", 512): 1.8,
    # Sapphire / Emerald Rapids (Golden / Raptor Cove; measured on family 6
    # model 207 without AMX exposed): FMA zmm 166-173 GFLOP/s, vdpbf16ps
    # only 83 (one every other cycle), vpdpbusd 713 GOP/s, vpdpwssd 349.
    ("sapphirerapids", "vdpbf16ps", 512): 0.5,
    ("sapphirerapids", "vpdpbusd", 512): 4.1,
    ("sapphirerapids", "vpdpwssd", 512): 2.0,
}
"""How many multiply-adds one core's dot-product instruction (by
:attr:`Target.core`, mnemonic and width) does per cycle, relative to f32 FMAs
of the same width: measured with a loop of 16 independent accumulators
(one core, the figures in the comments). A dot product is only worth its data
layout where this exceeds what widening plus FMAs gives (1.0): on Intel's
server cores without AMX, ``vdpbf16ps`` runs at half the FMAs' rate, so bf16
is computed in f32 there (`search.rules.dot_product`). Cores not in the table
get the instruction's nominal rate (:meth:`Target.dot_rate`)."""


def _vector_bits(flags: frozenset[str] | set[str]) -> int:
    if "avx512f" in flags:
        return 512
    if "avx2" in flags or "avx" in flags:
        return 256
    return 128


def parse_cpuinfo(text: str) -> tuple[frozenset[str], str]:
    """The flags and the model name of the first processor of a
    ``/proc/cpuinfo`` text. x86 lists ``flags``; AArch64 lists ``Features``,
    where ``asimd`` is NEON (recorded as "neon")."""
    flags: set[str] = set()
    model = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("flags", "Features") and not flags:
            flags = set(value.split())
            if "asimd" in flags:
                flags.add("neon")
        elif key == "model name" and not model:
            model = value.strip()
    return frozenset(flags), model


_INTEL_CORES: dict[int, str] = {
    85: "skylake-avx512",  # also Cascade and Cooper Lake: told apart by their flags
    106: "icelake-server",
    108: "icelake-server",
    143: "sapphirerapids",
    207: "sapphirerapids",  # Emerald Rapids: the same core (LLVM's "emeraldrapids" is an alias)
    173: "graniterapids",
    174: "graniterapids",
}
"""Intel family 6 server models -> the LLVM name of their core."""


def core_of_cpuinfo(text: str) -> str:
    """The LLVM name of the core a ``/proc/cpuinfo`` text's first processor
    has ("znver5", "sapphirerapids"...), from its vendor, family and model
    (and flags, where one model number covers several), or "" when it is
    not one of the cores :data:`DOT_RATES` and :data:`NAMED_CPUS` know."""
    info: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if not key and info:
            break  # the first processor only
        info.setdefault(key, value.strip())
    flags = set(info.get("flags", "").split())
    try:
        family, model = int(info.get("cpu family", "")), int(info.get("model", ""))
    except ValueError:
        return ""
    vendor = info.get("vendor_id", "")
    if vendor == "AuthenticAMD":
        if family == 26:
            return "znver5"
        if family == 25:
            return "znver4" if "avx512f" in flags else "znver3"
        return "znver2" if family == 23 and model >= 0x30 else ""
    if vendor == "GenuineIntel" and family == 6:
        core = _INTEL_CORES.get(model, "")
        if core == "skylake-avx512" and "avx512_vnni" in flags:
            return "cooperlake" if "avx512_bf16" in flags else "cascadelake"
        return core
    return ""


def _read_cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""


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
    features: ISA features, sorted, those of :data:`CPU_FEATURES` the CPU
        has, e.g. ("avx", "avx2", "f16c", "fma"); they make the :attr:`key`.
    llvm_cpu: the CPU LLVM builds for (``llc -mcpu``): "native" for the
        host, the name for ``Target.cpu(name)``; "" for a target made by hand
        (then generic x86-64, or AArch64, with its `features`).
    core: the LLVM name of the CPU's core where it is known ("znver5",
        "sapphirerapids": the host's from its cpuinfo, `core_of_cpuinfo`),
        else ""; it says how fast each dot product runs (:data:`DOT_RATES`).
        Not part of the :attr:`key` (the features are).

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
    llvm_cpu: str = ""
    core: str = ""

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
        """The machine this process runs on (its ``/proc/cpuinfo``, its usable cores)."""
        return Target.from_cpuinfo(_read_cpuinfo(), cores=usable_cores())

    @staticmethod
    def from_cpuinfo(text: str, *, cores: int = 1) -> Target:
        """The CPU target a ``/proc/cpuinfo`` text describes (its first
        processor): the :data:`CPU_FEATURES` among its flags, the vector width
        they allow, its model name; built for "native" (the host LLVM runs on)."""
        flags, model = parse_cpuinfo(text)
        feats = tuple(sorted(f for f in CPU_FEATURES if f in flags))
        model = model or platform.processor() or platform.machine()
        return Target("cpu", _vector_bits(flags), max(1, cores), model, feats, llvm_cpu="native", core=core_of_cpuinfo(text))

    @staticmethod
    def cpu(name: str, *, cores: int | None = None) -> Target:
        """A named x86-64 CPU (:data:`NAMED_CPUS`, LLVM's names: "znver4",
        "sapphirerapids", "haswell"...), to write and build schedules for a
        machine other than the host. `cores` defaults to this host's usable
        cores. Its key is that of a host of its kind; measuring its code
        needs a host that has its features (:meth:`runs_on`)."""
        feats = NAMED_CPUS.get(name.lower())
        if feats is None:
            raise AnsorError(f"CPU {name!r} is not known; expected one of {', '.join(NAMED_CPUS)}")
        n = usable_cores() if cores is None else max(1, cores)
        name = name.lower()
        core = "sapphirerapids" if name == "emeraldrapids" else name
        return Target("cpu", _vector_bits(set(feats)), n, name, tuple(sorted(feats)), llvm_cpu=name, core=core)

    @staticmethod
    def parse(spec: str | None) -> Target:
        """Parse a command-line target spec: "cpu" or "host" (this machine),
        "cpu:NAME" (a named CPU, e.g. "cpu:znver4"), "cuda" (sm_90) or
        "cuda:sm_XX"."""
        if spec in (None, "", "cpu", "host", "llvm", "cpu:host", "cpu:native"):
            return Target.host()
        if spec in ("cuda", "gpu", "nvidia"):
            return Target.cuda(90)
        if spec.startswith("cuda:"):
            return Target.cuda(spec.split(":", 1)[1])
        if spec.startswith("cpu:"):
            return Target.cpu(spec.split(":", 1)[1])
        raise AnsorError(
            f"unknown target {spec!r}: expected 'cpu' (this host), 'cpu:NAME' (e.g. cpu:znver4), 'cuda' or 'cuda:sm_XX'"
        )

    def has(self, feature: str) -> bool:
        """Whether the target has a CPU feature (cpuinfo spelling, "avx512_bf16")."""
        return feature in self.features

    def runs_on(self, host: Target) -> bool:
        """Whether code built for this target can run on `host`: a CPU whose
        features include all of this target's (the vector width follows)."""
        return self.kind == host.kind == "cpu" and set(self.features) <= set(host.features)

    @property
    def dot_products(self) -> tuple[DotProduct, ...]:
        """The :data:`DOT_PRODUCTS` this target has, one per (kind, width),
        widest first within a kind."""
        out: list[DotProduct] = []
        seen: set[tuple[str, int]] = set()
        for d in DOT_PRODUCTS:
            if self.has(d.feature) and all(self.has(f) for f in d.needs) and (d.kind, d.bits) not in seen:
                seen.add((d.kind, d.bits))
                out.append(d)
        return tuple(out)

    @property
    def dot_product_kinds(self) -> frozenset[str]:
        """The kinds of dot product the target has ("bf16xbf16->f32",
        "u8xs8->i32", "s16xs16->i32", "s8xs8->i32")."""
        return frozenset(d.kind for d in self.dot_products)

    def dot_product(self, kind: str, bits: int | None = None) -> DotProduct | None:
        """The widest dot product of `kind` (no wider than `bits`, where
        given) this target has, or None."""
        for d in self.dot_products:
            if d.kind == kind and (bits is None or d.bits <= bits):
                return d
        return None

    def dot_rate(self, d: DotProduct) -> float:
        """Multiply-adds per cycle of `d` relative to f32 FMAs of its width
        on this target's core: measured (:data:`DOT_RATES`), or else the
        nominal rate, `d.group` products per lane at one instruction per
        FMA (half that where an add follows: AVX2's ``vpmaddwd``)."""
        nominal = d.group if d.accumulates else d.group / 2
        return DOT_RATES.get((self.core, d.instruction, d.bits), float(nominal))

    @property
    def llvm_attrs(self) -> tuple[str, ...]:
        """The features in LLVM's ``-mattr`` spelling ("+avx512bf16", ...)."""
        return tuple(f"+{_LLVM_ATTRS[f]}" for f in self.features if f in _LLVM_ATTRS)

    @property
    def llvm_triple(self) -> str:
        """The LLVM target triple code for this CPU is built with:
        x86-64 or AArch64 Linux, or "" (LLVM's default, the host) when
        neither the features nor the CPU name tell."""
        if self.kind != "cpu":
            return ""
        if self.llvm_cpu in NAMED_CPUS or _X86 & set(self.features):
            return "x86_64-unknown-linux-gnu"
        if "neon" in self.features:
            return "aarch64-unknown-linux-gnu"
        return ""

    @property
    def vector_registers(self) -> int:
        """How many SIMD registers the schedules' register tiles may fill:
        32 with AVX-512 (zmm0-31) and on AArch64 (v0-31), else 16 (AVX2's
        and SSE's ymm/xmm0-15)."""
        return 32 if self.has("avx512f") or self.has("neon") else 16

    def lanes(self, dtype: str) -> int:
        """How many elements of `dtype` fit in one vector register."""
        bits = {"f64": 64, "f32": 32, "f16": 16, "bf16": 16, "i64": 64, "i32": 32, "i8": 8}.get(dtype, 32)
        return max(1, self.vector_bits // bits)

    @property
    def key(self) -> str:
        """A short string naming the target, stored with every record and
        used to query them: "cpu:" and the :attr:`features` joined by "+"
        ("cpu:avx+avx2+f16c+fma"), or "cuda:sm_XX". Hosts with different
        instruction sets never share records; the same features on another
        CPU model do (records also carry the host model, which queries can
        prefer). The dot-product and narrow-type features entered the key in
        issue #23: a database written before holds its CPU records under the
        older, shorter key (e.g. "cpu:avx+avx2+avx512f+fma"), so it simply
        has no records for the new key on such a host; tune again."""
        if self.kind == "cuda":
            return f"cuda:{self.chip}"
        feats = "+".join(self.features) or "generic"
        return f"cpu:{feats}"
