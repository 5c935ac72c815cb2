"""Row reductions with warp shuffles (``cuda-warp-reduction``,
`passes/warp_reduce.py`): the sketch and its knobs, the PTX and ptxas, the
default schedule and a whole softmax module. Nothing here runs a kernel (no
GPU on CI); the device check times softmax against torch."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("mlir", reason="MLIR bindings are not installed (a GPU host has none)")

from mlir_ansor.examples import workloads  # noqa: E402
from mlir_ansor.graph.task import extract_tasks  # noqa: E402
from mlir_ansor.ir.program import load  # noqa: E402
from mlir_ansor.passes import nvvm  # noqa: E402
from mlir_ansor.search.generate import generate_sketches  # noqa: E402
from mlir_ansor.search.gpu_defaults import default_gpu_assignments  # noqa: E402
from mlir_ansor.search.space import make_assignment  # noqa: E402
from mlir_ansor.target import Target  # noqa: E402

SM90 = Target.cuda(90)


def _softmax_tasks(rows: int = 128, n: int = 256) -> list:
    return extract_tasks(load(text=workloads.softmax(rows, n)))


def test_rule_takes_row_reductions_first():
    """Both of softmax's reductions (max; sum of exp) get the warp sketch
    ahead of the others; its elementwise tail does not."""
    names = [[s.name for s in generate_sketches(t.mlir, SM90)] for t in _softmax_tasks()]
    assert names[0][0] == names[1][0] == "cuda-warp-reduction"
    assert "cuda-warp-reduction" not in names[2]
    sk = generate_sketches(_softmax_tasks()[0].mlir, SM90)[0]
    knobs = {k.name: k.options for k in sk.knobs}
    assert knobs == {"b_d0": (1, 2, 4, 8), "lanes": (0, 1, 2)}  # lanes: 8, 16, 32
    assert "tile_reduction_using_forall" in sk.script and "#gpu.thread<x>" in sk.script
    # the lanes knob stands for 8, 16, 32 threads per block
    assert [sk.block_threads(make_assignment({"b_d0": 2, "lanes": i})) for i in range(3)] == [8, 16, 32]
    # a row of 12 elements: 8 and 16 lanes do not divide it, no sketch
    odd = [s.name for s in generate_sketches(_softmax_tasks(8, 12)[0].mlir, SM90)]
    assert "cuda-warp-reduction" not in odd


@pytest.mark.parametrize("task", [0, 1])
def test_shuffles_in_the_ptx(task, ptxas, tmp_path):
    """Per row of the block, log2(lanes) `shfl.sync.bfly` steps, with the
    lane mask of the block's lanes; ptxas accepts it; the partials take
    rows x lanes x 4 bytes of shared memory; the block is `lanes` threads."""
    t = _softmax_tasks()[task]
    sk = generate_sketches(t.mlir, SM90)[0]
    for i, lanes in enumerate((8, 16, 32)):
        a = make_assignment({"b_d0": 4, "lanes": i})
        b = nvvm.build_cuda(sk.payload, sk.concrete(a), SM90, str(tmp_path / f"{i}.cubin"))
        (k,) = b.launches
        assert k.block == (lanes, 1, 1) and k.grid == (128 // 4, 1, 1)
        shuffles = [ln.strip() for ln in b.ptx.splitlines() if ln.strip().startswith("shfl.sync.bfly")]
        assert len(shuffles) == 4 * int(math.log2(lanes))
        mask = (1 << lanes) - 1 if lanes < 32 else -1
        assert all(ln.endswith(f", {lanes - 1}, {mask};") for ln in shuffles), shuffles[:2]
        fig = b.ptxas[k.entry]
        assert fig["smem"] == 4 * lanes * 4 and fig["spill_stores"] == fig["stack"] == 0
        combine = "max.NaN.f32" if task == 0 else "add.rn.f32"
        assert combine in b.ptx


def test_default_schedule_takes_a_warp_per_row():
    sk = generate_sketches(_softmax_tasks(1024, 768)[0].mlir, SM90)[0]
    best = dict(default_gpu_assignments(sk, SM90)[0])
    assert best["lanes"] == 2 and sk.block_threads(make_assignment(best)) == 32


def test_whole_softmax_module_uses_shuffles(ptxas, tmp_path):
    """`compile --target cuda` of a softmax: both reductions are warp
    reductions by default, the bundle's PTX has the shuffles and ptxas
    accepts it."""
    import subprocess

    from mlir_ansor.cuda_compiler import build_bundle, bundle_ptx

    src = tmp_path / "softmax.mlir"
    src.write_text(workloads.softmax(256, 512))
    plan = build_bundle(str(src), tmp_path / "s.cuda", target=SM90)
    sketches = [t["sketch"] for t in plan["tasks"]]
    assert sketches.count("cuda-warp-reduction") == 2 and not any(t["error"] for t in plan["tasks"]), plan["tasks"]
    ptx = bundle_ptx(tmp_path / "s.cuda")
    assert ptx.count("shfl.sync.bfly") >= 2 * 5
    (tmp_path / "s.ptx").write_text(ptx)
    proc = subprocess.run([ptxas, "-arch=sm_90", "-o", str(tmp_path / "s.cubin"), str(tmp_path / "s.ptx")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
