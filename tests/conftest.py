"""Shared test helpers: FileCheck, the PyTorch path's fixture, and paths of
the small test inputs."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from mlir_ansor.measure.measurer import Measurer

INPUTS = Path(__file__).parent / "inputs"

# A matmul whose B is laid out in column panels, `graph.prepack`'s
# ``[N / 32, K, 32]`` (BERT's weights): a linalg.generic, M rows (`m`), N / 32
# panels (`p`).
PANELS_MATMUL = """
#a = affine_map<(d0, d1, d2, d3) -> (d0, d3)>
#b = affine_map<(d0, d1, d2, d3) -> (d1, d3, d2)>
#c = affine_map<(d0, d1, d2, d3) -> (d0, d1, d2)>
func.func @kernel(%x: tensor<{m}x64xf32>, %w: tensor<{p}x64x32xf32>) -> tensor<{m}x{p}x32xf32> {{
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<{m}x{p}x32xf32>
  %init = linalg.fill ins(%zero : f32) outs(%e : tensor<{m}x{p}x32xf32>) -> tensor<{m}x{p}x32xf32>
  %r = linalg.generic {{indexing_maps = [#a, #b, #c], iterator_types = ["parallel", "parallel", "parallel", "reduction"]}}
      ins(%x, %w : tensor<{m}x64xf32>, tensor<{p}x64x32xf32>) outs(%init : tensor<{m}x{p}x32xf32>) attrs = {{ansor.anchor}} {{
  ^bb0(%a: f32, %b: f32, %o: f32):
    %p = arith.mulf %a, %b : f32
    %s = arith.addf %o, %p : f32
    linalg.yield %s : f32
  }} -> tensor<{m}x{p}x32xf32>
  return %r : tensor<{m}x{p}x32xf32>
}}
"""


class CountingMeasurer(Measurer):
    """Counts the libraries it builds. With `replay`, a schedule measured
    again gives its first timings again: the re-timing's ranking cannot
    move with the machine's noise (a schedule outside the re-timed best,
    pushed to the top by it, is built again: a count the test cannot know)."""

    built = 0

    def __init__(self, config, replay=False):
        super().__init__(config)
        self.replay = {} if replay else None

    def build(self, cands):
        self.built += len(cands)
        return super().build(cands)

    def measure(self, cand, tol, best_s=math.inf):
        out = super().measure(cand, tol, best_s)
        if self.replay is None or not out.costs:
            return out
        first = self.replay.setdefault((cand.sketch.hash, cand.knobs), out.costs)
        return dataclasses.replace(out, costs=first)


def run_schedule(payload: str, script: str, arrays: list, tmp_path: Path, threads: int = 1) -> None:
    """Build the schedule `script` of `payload` into a library of its own
    under `tmp_path` and call it once on `arrays` (its inputs, then its
    outputs, which it writes)."""
    from mlir_ansor.measure import jobs
    from mlir_ansor.measure.runner import Kernel

    fd, so = tempfile.mkstemp(suffix=".so", dir=tmp_path)
    os.close(fd)
    jobs.build_candidate(payload, script, threads, so)
    kernel = Kernel(so)
    try:
        kernel.bind(arrays)()
    finally:
        kernel.close()


# The compile cache (mlir_ansor.passes.compile_cache) of a test session: a folder of
# its own, never the user's ~/.cache nor one beside a test's database.
if "MLIR_ANSOR_CACHE_DIR" not in os.environ:
    import atexit

    os.environ["MLIR_ANSOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="mlir-ansor-test-cache-")
    atexit.register(shutil.rmtree, os.environ["MLIR_ANSOR_CACHE_DIR"], True)


def _filecheck_exe() -> str:
    exe = Path(sys.executable).parent / "filecheck"
    if exe.exists():
        return str(exe)
    found = shutil.which("filecheck")
    if not found:  # pytest and filecheck come in the same extra: no reason to skip
        pytest.fail("the `filecheck` package (dev extra) is not installed: pip install -e '.[dev]'")
    return found


def lowered_driver(scheduled: str) -> tuple[str, int]:
    """The driver of a compiled module (`CompiledModule.mlir`) once the
    lowering's driver rewrites have run (bufferization's cleanup, outputs
    forwarded, views into kernels, accumulation in place), and how many of
    its calls accumulate in place."""
    from mlir import ir, passmanager

    from mlir_ansor.passes.drivers import accumulate_in_place, forward_output_copies, views_into_kernels
    from mlir_ansor.passes.lowering import _front

    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(scheduled)
        passmanager.PassManager.parse(f"builtin.module({_front()})").run(m.operation)
        forward_output_copies(m)
        views_into_kernels(m)
        in_place = accumulate_in_place(m)
        m.operation.verify()
        driver = next(str(f) for f in m.body.operations if "ansor.normalized" in f.operation.attributes)
    return driver, in_place


def filecheck(text: str, checks: str, tmp_path: Path | None = None) -> None:
    """Run FileCheck patterns `checks` (CHECK, CHECK-NEXT, CHECK-NOT, ...
    lines, as in LLVM's FileCheck) over `text`; fail with FileCheck's own
    report when they do not match. `tmp_path` (optional) is where the
    patterns are written.

    The `filecheck` package (a Python clone of LLVM's FileCheck) checks a
    CHECK-NOT up to the end of the next match, where LLVM's stops at its
    start: keep the excluded text out of the line matched next (or put the
    CHECK-NOTs in a call of their own, which then covers all of `text`)."""
    with tempfile.TemporaryDirectory(dir=tmp_path) as folder:
        check_file = Path(folder) / "checks.txt"
        check_file.write_text(checks)
        proc = subprocess.run([_filecheck_exe(), str(check_file)], input=text, capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.fail(f"FileCheck failed:\n{proc.stdout}{proc.stderr}", pytrace=False)


def _in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


@pytest.fixture(scope="session")
def torch():
    """The `torch` module, for tests of the PyTorch path (torch and torch-mlir:
    the 'torch' extra). Without them the test is skipped, except in CI (the
    environment variable CI set), where scripts/setup.sh installs the extra
    and a missing package is a failure. torch-mlir is only looked up, not
    imported: its MLIR bindings would clash with ours in this process."""
    missing = [name for name in ("torch", "torch_mlir") if importlib.util.find_spec(name) is None]
    if missing:
        why = f"the PyTorch path needs {' and '.join(missing)} (the 'torch' extra: pip install -e '.[torch]')"
        if _in_ci():
            pytest.fail(f"{why}; CI installs it (scripts/setup.sh), so it must be there", pytrace=False)
        pytest.skip(why)
    import torch as module

    return module


def small_torch_model(torch, which: str):
    """(f32 module in eval mode, input): a small BERT layer (hidden 64, 2
    heads, FFN 128, sequence 16) or a ResNet bottleneck (32 -> 8 -> 32
    channels, 8x8) whose batch norms have seeded, non-trivial statistics."""
    from mlir_ansor.examples.models import BertLayer, Bottleneck

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if which == "bert":
        model, x = BertLayer(hidden=64, heads=2, ffn=128), torch.randn(1, 16, 64, generator=gen)
    else:
        model, x = Bottleneck(32, 8, 1), torch.randn(1, 32, 8, 8, generator=gen)
        for bn in (model.bn1, model.bn2, model.bn3):
            with torch.no_grad():
                bn.running_mean.copy_(0.1 * torch.randn(bn.running_mean.shape, generator=gen))
                bn.running_var.copy_(1.0 + 0.1 * torch.rand(bn.running_var.shape, generator=gen))
    return model.eval(), x


def mlir_opt() -> str:
    import mlir

    exe = Path(mlir.__path__[0]) / "bin" / "mlir-opt"
    if not exe.exists():
        pytest.skip("mlir-opt is not shipped with these MLIR wheels")
    return str(exe)


def as_unprivileged(cmd: list[str]) -> list[str]:
    """`cmd` to run as a user whom file permissions apply to: as it is for
    an unprivileged user, through ``setpriv`` as `nobody` for root (who
    writes anywhere). Skips when no such user can run this interpreter (a
    checkout in a folder `nobody` cannot read)."""
    if os.geteuid() != 0:
        return cmd
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: permissions cannot be tested")
    prefix = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups"]
    probe = subprocess.run([*prefix, sys.executable, "-c", "import mlir_ansor"], capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    if probe.returncode != 0:
        pytest.skip(f"user nobody cannot run this checkout's Python: {probe.stderr.strip()[-200:]}")
    return [*prefix, *cmd]


def ptx_counts(ptx: str) -> dict[str, int]:
    """How many of each instruction the GPU tests look for a PTX text holds
    (cp.async copies, predicated ones too, their groups, shared and FMA)."""
    import re

    lines = [ln.strip() for ln in ptx.splitlines()]
    return {
        "cp.async": sum(1 for ln in lines if re.match(r"(@%p\d+ )?cp\.async\.c[ag]\.shared\.global", ln)),
        "commit": sum(1 for ln in lines if ln.startswith("cp.async.commit_group")),
        "wait": sum(1 for ln in lines if ln.startswith("cp.async.wait_group")),
        "st.shared": sum(1 for ln in lines if ln.startswith("st.shared")),
        "fma": sum(1 for ln in lines if ln.startswith("fma.rn.f32")),
        "ld.shared.v4": sum(1 for ln in lines if ln.startswith("ld.shared.v4")),
        "ld.shared": sum(1 for ln in lines if ln.startswith("ld.shared")),
    }


@pytest.fixture(scope="session")
def ptxas() -> str:
    """The CUDA toolkit's ptxas, or a skip (test_gpu.py has its own, for a
    GPU host without the MLIR bindings)."""
    from mlir_ansor.passes.nvvm import find_ptxas

    exe = find_ptxas()
    if exe is None:
        pytest.skip("ptxas (CUDA toolkit) not found on PATH, $PTXAS, $CUDA_HOME/bin or /usr/local/cuda/bin")
    return exe
