"""cp.async stages of the staged conv sketch (``cuda-conv-smem`` in
`rules/gpu_contraction.py`; `passes/async_copies.py`): the sketch and its
knob, the shared-memory bound, what `violation` excludes, the PTX and
ptxas. Nothing here runs a kernel (no GPU on CI); the device check
(benchmarks/gpu_check.sh) times stages 1/2/3 against cuDNN."""

from __future__ import annotations

import random
import re

import pytest
from conftest import ptx_counts

pytest.importorskip("mlir", reason="MLIR bindings are not installed (a GPU host has none)")

from mlir_ansor.examples import workloads  # noqa: E402
from mlir_ansor.passes import nvvm  # noqa: E402
from mlir_ansor.search.generate import generate_sketches  # noqa: E402
from mlir_ansor.search.gpu_defaults import default_gpu_assignments  # noqa: E402
from mlir_ansor.search.gpu_sketch import sample  # noqa: E402
from mlir_ansor.search.space import make_assignment  # noqa: E402
from mlir_ansor.target import Target  # noqa: E402

SM90 = Target.cuda(90)
CONV3 = workloads.conv2d_nhwc(1, 58, 58, 64, 64, 3, 3)  # ResNet-50's 3x3, 56x56 out
CONV1 = workloads.conv2d_nhwc(1, 56, 56, 64, 64, 1, 1)
#: 8 x 8 pixels x 64 filters a block, 256 threads of 4 x 4 outputs, 16
#: channels of one filter tap a K step: 256 16-byte pieces of each tile
FIRST = {"b_d1": 8, "b_d2": 8, "b_d3": 64, "t_d2": 2, "t_d3": 16, "k_d6": 16}


def _sketches(mlir: str, target: Target = SM90) -> dict:
    return {s.name: s for s in generate_sketches(mlir, target)}


def test_staged_conv_sketch_and_its_stages_knob():
    for mlir in (CONV3, CONV1):
        sks = _sketches(mlir)
        assert list(sks) == ["cuda-conv-smem", "cuda-contraction", "cuda-default"]
        sk = sks["cuda-conv-smem"]
        (knob,) = [k for k in sk.knobs if k.name == "stages"]
        assert knob.options == (1, 2, 3) and sk.stages_knob == "stages"
        assert '"ansor.copy_stages"' in sk.script
        assert ("transform.loop.coalesce" in sk.script) == (mlir is CONV3)  # one K loop over (kh, kw, c)
    (knob,) = [k for k in _sketches(CONV3, Target.cuda(75))["cuda-conv-smem"].knobs if k.name == "stages"]
    assert knob.options == (1,)  # cp.async is sm_80+
    # strided convs, fused consumers, NCHW: the plain contraction sketch only
    strided = workloads.conv2d_nhwc(1, 57, 57, 64, 64, 3, 3, stride=2)
    assert "cuda-conv-smem" not in _sketches(strided)
    assert "cuda-conv-smem" not in _sketches(workloads.conv2d_nchw(1, 64, 58, 58, 64, 3, 3))


def test_shared_memory_counts_every_stage():
    sk = _sketches(CONV3)["cuda-conv-smem"]
    tiles = (8 * 8 * 16 + 16 * 64) * 4  # input and filter tiles of one K step, f32
    for stages in (1, 2, 3):
        a = sk.complete(make_assignment({**FIRST, "stages": stages}))
        assert dict(a)["cp_i"] == dict(a)["cp_f"] == 1
        assert sk.smem_bytes(a) == stages * tiles and sk.violation(a) is None
    big = {**FIRST, "k_d6": 64, "b_d3": 128, "t_d3": 32, "b_d2": 14, "t_d2": 1}
    a = sk.complete(make_assignment({**big, "stages": 3}))
    assert sk.smem_bytes(a) == 3 * (8 * 14 * 64 + 64 * 128) * 4 and "shared memory" in sk.violation(a)
    rng = random.Random(0)
    for _ in range(200):
        a = sample(sk, rng)
        assert sk.smem_bytes(a) <= SM90.smem_per_block and sk.violation(a) is None


def test_stages_excluded_where_the_pipeliner_cannot_take_them():
    sk = _sketches(CONV3)["cuda-conv-smem"]
    # 256 threads; 4 channels a step: the input tile 8 x 8 x 4 is 64 16-byte
    # pieces, so only a quarter of the threads copy (a predicated copy, an
    # scf.if in the K loop: the pipeliner refuses it)
    a = sk.complete(make_assignment({**FIRST, "k_d6": 4, "stages": 2}))
    assert "cp_i has 64 pieces for 256 threads" in sk.violation(a)
    assert sk.violation(tuple((k, 1 if k == "stages" else v) for k, v in a)) is None
    # a 1x1 conv with the whole of C a step has one K step: no room for 2 stages
    one = _sketches(CONV1)["cuda-conv-smem"]
    a = one.complete(make_assignment({**FIRST, "b_d2": 4, "k_d6": 64, "stages": 2}))
    assert "2 stages > 1 steps" in one.violation(a)


@pytest.mark.parametrize("which", ["3x3", "1x1"])
def test_conv_stages_become_cp_async_that_ptxas_accepts(which, ptxas, tmp_path):
    """Stage 1: 16-byte loads stored to shared memory, synchronously.
    Stages S > 1: one 16-byte cp.async.cg per thread and tile a K step, S
    steps issued before the K loop and one per iteration, wait_group S - 1;
    ptxas accepts it with S x the tiles of shared memory and no spills."""
    sk = _sketches(CONV3 if which == "3x3" else CONV1)["cuda-conv-smem"]
    for stages in (1, 2, 3) if which == "3x3" else (1, 3):
        a = sk.complete(make_assignment({**FIRST, "stages": stages}))
        b = nvvm.build_cuda(sk.payload, sk.concrete(a), SM90, str(tmp_path / f"{stages}.cubin"))
        fig = b.ptxas[b.launches[0].entry]
        assert fig["smem"] == sk.smem_bytes(a) == stages * 8192
        assert fig["spill_stores"] == fig["stack"] == 0 and b.dropped(SM90) is None
        assert b.launches[0].grid == (1, 7, 7) and b.launches[0].block == (16, 2, 8)
        c = ptx_counts(b.ptx)
        assert c["fma"] == 4 * 4 * 16  # a 4 x 4 register tile over 16 channels a step
        # the reads from shared memory stay 16 bytes wide at every stage (a
        # view shared with the copies became loop-carried: scalar ld.shared)
        assert c["ld.shared"] == c["ld.shared.v4"] == 32
        if stages == 1:
            assert c["cp.async"] == c["commit"] == c["wait"] == 0 and c["st.shared"] == 2
            continue
        assert c["cp.async"] == 2 * (stages + 1) and c["st.shared"] == 0  # input + filter, prologue + loop
        assert c["commit"] == stages + 1 and c["wait"] == 1
        assert f"cp.async.wait_group \t{stages - 1};" in b.ptx
        assert "cp.async.cg.shared.global" in b.ptx


def test_default_schedule_stages_the_conv():
    """The default GPU schedule of a plain conv is the staged sketch with
    two cp.async stages on sm_90 (FMA tiles, as cuda-tiled), one on sm_75."""
    sk = _sketches(CONV3)["cuda-conv-smem"]
    best = default_gpu_assignments(sk, SM90)[0]
    assert dict(best)["stages"] == 2 and sk.violation(best) is None
    sk75 = _sketches(CONV3, Target.cuda(75))["cuda-conv-smem"]
    assert dict(default_gpu_assignments(sk75, Target.cuda(75))[0])["stages"] == 1


@pytest.mark.parametrize("kh,knobs", [
    (3, {**FIRST, "stages": 1}),
    (3, {"b_d1": 4, "b_d2": 14, "b_d3": 16, "t_d2": 1, "t_d3": 16, "k_d6": 32, "stages": 1}),
    (1, {**FIRST, "stages": 1}),
])
def test_staged_conv_schedule_computes_the_conv_on_the_cpu(kh, knobs):
    """The schedule before the GPU mapping (tiles, the coalesced K loop over
    (kh, kw, c), the copies into the staged buffers), its foralls run as
    plain loops on this CPU, against numpy in float64. It checks the tiling
    and the copies, not the cp.async pipelining (that needs a GPU)."""
    import ctypes

    import numpy as np
    from mlir import ir, passmanager
    from mlir import runtime as rt
    from mlir.execution_engine import ExecutionEngine

    from mlir_ansor.passes.lowering import lower_to_llvm
    from mlir_ansor.schedule.apply import apply_schedule

    h = 56 + kh - 1
    sk = _sketches(CONV3 if kh == 3 else CONV1)["cuda-conv-smem"]
    a = sk.complete(make_assignment(knobs))
    assert sk.violation(a) is None
    with ir.Context(), ir.Location.unknown():
        text = str(apply_schedule(sk.payload, sk.concrete(a)))
    assert "#gpu.address_space<workgroup>" in text and "#gpu.thread<linear_dim_0>" in text
    text = text.replace(", #gpu.address_space<workgroup>", "")
    text = text.replace("{memory_space = #gpu.address_space<workgroup>}", "")
    text = re.sub(r"\{?mapping = \[[^\]]*\]\}?", "", text)
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (1, h, h, 64)).astype(np.float32)
    w = rng.uniform(-1, 1, (kh, kh, 64, 64)).astype(np.float32)
    out = np.zeros((1, 56, 56, 64), np.float32)
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(text)
        passmanager.PassManager.parse(
            "builtin.module(func.func(scf-forall-to-for),canonicalize,buffer-results-to-out-params)"
        ).run(m.operation)
        lower_to_llvm(m)
        engine = ExecutionEngine(m, opt_level=2)
        engine.invoke("conv2d", *[ctypes.pointer(ctypes.pointer(rt.get_ranked_memref_descriptor(v)))
                                  for v in (x, w, out)])
    ref = np.zeros((1, 56, 56, 64))
    for i in range(kh):
        for j in range(kh):
            ref += np.tensordot(x[:, i:i + 56, j:j + 56, :].astype(np.float64), w[i, j].astype(np.float64),
                                axes=([3], [0]))
    np.testing.assert_allclose(out, ref, rtol=0, atol=1e-4)
