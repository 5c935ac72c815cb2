"""cp.async stages of the staged GEMM sketches (`passes/async_copies.py`,
the ``stages`` knob of `rules/gpu_staged_matmul.py`): the knob, the
shared-memory bound, the PTX and ptxas. Nothing here runs a kernel (no GPU
on CI); the device check (benchmarks/gpu_check.sh) times stages 1 vs 2/3."""

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
STAGED = ("cuda-mma-smem", "cuda-tiled")


def _sketches(n: int, dtype: str, target: Target = SM90) -> dict:
    return {s.name: s for s in generate_sketches(workloads.matmul(n, n, n, dtype), target)}


def test_stages_knob_on_the_staged_sketches_only():
    sks = _sketches(256, "f16")
    for name in STAGED:
        (knob,) = [k for k in sks[name].knobs if k.name == "stages"]
        assert knob.options == (1, 2, 3) and sks[name].stages_knob == "stages"
        assert 'transform.annotate' in sks[name].script and '"ansor.copy_stages"' in sks[name].script
    for name in ("cuda-mma", "cuda-contraction", "cuda-default"):
        assert all(k.name != "stages" for k in sks[name].knobs)
    # cp.async is sm_80+: before that the knob has one option
    (knob,) = [k for k in _sketches(256, "f32", Target.cuda(75))["cuda-tiled"].knobs if k.name == "stages"]
    assert knob.options == (1,)


def test_shared_memory_counts_every_stage():
    sks = _sketches(1024, "f16")
    mma = sks["cuda-mma-smem"]
    base = {"b_d0": 128, "b_d1": 128, "w_d0": 64, "w_d1": 32, "k_d2": 32}
    tiles = (128 * 32 + 32 * 128) * 2  # A and B tiles of one K step, f16
    for stages in (1, 2, 3):
        a = mma.complete(make_assignment({**base, "stages": stages}))
        assert mma.smem_bytes(a) == stages * tiles
        assert mma.violation(a) is None  # 3 x 16 KB = 48 KB: exactly the static limit
    over = mma.complete(make_assignment({**base, "k_d2": 64, "stages": 2}))
    assert mma.smem_bytes(over) == 2 * 2 * tiles and "shared memory" in mma.violation(over)
    # sampling never crosses the limit, whatever the stages
    rng = random.Random(0)
    seen = set()
    for sk in (mma, sks["cuda-tiled"]):
        for _ in range(200):
            a = sample(sk, rng)
            seen.add(dict(a)["stages"])
            assert sk.smem_bytes(a) <= SM90.smem_per_block


def test_stages_need_a_piece_per_thread_and_enough_k_steps():
    tiled = _sketches(256, "f32")["cuda-tiled"]
    # 256 threads; the B tile 16 x 32 in 4-wide pieces is 128 pieces: half the threads copy
    a = tiled.complete(make_assignment({"b_d0": 128, "b_d1": 32, "t_d0": 32, "t_d1": 8, "k_d2": 16, "stages": 2}))
    assert "cp_b has 128 pieces for 256 threads" in tiled.violation(a)
    assert tiled.violation(tuple((k, 1 if k == "stages" else v) for k, v in a)) is None
    few = _sketches(64, "f32")["cuda-tiled"]
    a = few.complete(make_assignment({"b_d0": 32, "b_d1": 32, "t_d0": 8, "t_d1": 8, "k_d2": 32, "stages": 3}))
    assert "3 stages > 2 steps" in few.violation(a)


@pytest.mark.parametrize("dtype,name,knobs", [
    ("f16", "cuda-mma-smem", {"b_d0": 64, "b_d1": 64, "w_d0": 32, "w_d1": 32, "k_d2": 32}),
    ("f32", "cuda-tiled", {"b_d0": 64, "b_d1": 64, "t_d0": 8, "t_d1": 16, "k_d2": 16}),
])
def test_stages_become_cp_async_that_ptxas_accepts(dtype, name, knobs, ptxas, tmp_path):
    """Stage 1: the synchronous copy (no cp.async). Stages S > 1: 16-byte
    cp.async copies, S groups (K steps) issued before the K loop and one
    per iteration, a wait_group S - 1 at the top of the loop (so S - 1
    steps stay in flight while one computes); ptxas accepts
    it and counts S x the tiles of shared memory, without spills."""
    sk = _sketches(256, dtype)[name]
    for stages in (1, 2, 3):
        a = sk.complete(make_assignment({**knobs, "stages": stages}))
        assert sk.violation(a) is None
        b = nvvm.build_cuda(sk.payload, sk.concrete(a), SM90, str(tmp_path / f"{stages}.cubin"))
        fig = b.ptxas[b.launches[0].entry]
        assert fig["smem"] == sk.smem_bytes(a) == stages * sk.smem_bytes(sk.complete(make_assignment({**knobs, "stages": 1})))
        assert fig["spill_stores"] == fig["stack"] == 0
        c = ptx_counts(b.ptx)
        if stages == 1:
            assert c["cp.async"] == c["commit"] == c["wait"] == 0 and c["st.shared"] > 0
            continue
        per_step = c["cp.async"] // (stages + 1)  # prologue: S steps; loop: one
        assert c["cp.async"] == (stages + 1) * per_step > 0 and c["st.shared"] == 0
        assert c["commit"] == stages + 1 and c["wait"] == 1
        assert f"cp.async.wait_group \t{stages - 1};" in b.ptx
        assert "cp.async.cg.shared.global" in b.ptx  # 16-byte copies that bypass L1
        # the FMA tiles' reads from shared memory stay 16 bytes wide
        # (passes/async_copies.py gives them a view of their own)
        assert not re.search(r"ld\.shared\.(b|f)32", b.ptx)
        (loop,) = [body for body in _loop_bodies(b.ptx)]
        # in the loop: wait, barrier, compute, barrier, then the next step's copies
        order = [m.group(0) for m in re.finditer(r"cp\.async\.wait_group|bar\.sync|cp\.async\.c[ag]|mma\.sync|fma", loop)]
        assert order[0] == "cp.async.wait_group" and order[1] == "bar.sync" and order[-1].startswith("cp.async.c")
        last_bar = max(i for i, x in enumerate(order) if x == "bar.sync")
        assert all(x.startswith("cp.async.c") for x in order[last_bar + 1:])
        assert all(not x.startswith("cp.async.c") for x in order[:last_bar])


def _loop_bodies(ptx: str) -> list[str]:
    lines = ptx.splitlines()
    out = []
    for i, line in enumerate(lines):
        label = line.strip()
        if label.startswith("$L__") and label.endswith(":"):
            back = [j for j in range(i + 1, len(lines)) if lines[j].strip().endswith(f"{label[:-1]};")]
            if back:
                out.append("\n".join(lines[i:back[-1] + 1]))
    return out


def test_default_schedule_picks_stages():
    """The default GPU schedule (no tuning) takes three stages for tensor-core
    tiles and two for FMA tiles on sm_90, one where cp.async does not exist."""
    for n, dtype, name, want in [(4096, "f16", "cuda-mma-smem", 3), (4096, "f32", "cuda-tiled", 2)]:
        sk = _sketches(n, dtype)[name]
        best = default_gpu_assignments(sk, SM90)[0]
        assert dict(best)["stages"] == want and sk.violation(best) is None
        assert sk.smem_bytes(best) <= SM90.smem_per_block
    sk = _sketches(1024, "f32", Target.cuda(75))["cuda-tiled"]
    assert dict(default_gpu_assignments(sk, Target.cuda(75))[0])["stages"] == 1
