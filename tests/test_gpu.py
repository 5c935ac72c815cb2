"""GPU: CUDA targets, GPU sketches built to cubin with ptxas, and the runner.

Two halves, so that the file runs on both kinds of machine:
  * build side (needs MLIR and the CUDA toolkit's ptxas, no GPU): every
    sampled candidate of the matmul, conv2d and softmax sketches becomes a
    cubin that ptxas accepts within the target's limits; PTX checks;
  * run side (needs only numpy and a CUDA driver binding, no MLIR): the
    prebuilt candidates of tests/inputs/gpu (written by
    `benchmarks/gpu_build.py --preset test`) are launched, checked against
    numpy and timed. It skips, with the reason, where there is no GPU.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import filecheck
from fake_cuda import FakeMatmulDevice

ROOT = Path(__file__).resolve().parents[1]
GPU_INPUTS = Path(__file__).parent / "inputs" / "gpu"

CANNED_PTXAS = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'matmul_kernel' for 'sm_90'
ptxas info    : Function properties for matmul_kernel
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 88 registers, used 1 barriers, 5120 bytes smem, 368 bytes cmem[0]
ptxas info    : Compile time = 45.396 ms
ptxas info    : Compiling entry function 'fill_kernel' for 'sm_90'
ptxas info    : Function properties for fill_kernel
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 20 registers, 360 bytes cmem[0]
"""


def _runner():
    path = ROOT / "mlir_ansor" / "measure" / "cuda_runner.py"
    spec = importlib.util.spec_from_file_location("ansor_cuda_runner_test", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    return mod


# --------------------------------------------------------------------------
# Build side
# --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mlir_side():
    pytest.importorskip("mlir", reason="MLIR bindings are not installed (a GPU host has none)")
    from mlir_ansor.passes import nvvm

    return nvvm


@pytest.fixture(scope="module")
def ptxas(mlir_side):
    exe = mlir_side.find_ptxas()
    if exe is None:
        pytest.skip("ptxas (CUDA toolkit) not found on PATH, $CUDA_HOME/bin or /usr/local/cuda/bin")
    return exe


def test_cuda_target(mlir_side):
    from mlir_ansor.errors import AnsorError
    from mlir_ansor.target import Target

    t = Target.parse("cuda")
    assert (t.kind, t.chip, t.key) == ("cuda", "sm_90", "cuda:sm_90")
    assert t.max_threads_per_block == 1024 and t.warp_size == 32 and t.smem_per_block == 48 * 1024
    assert Target.parse("cuda:sm_80").arch == 80
    assert Target.parse("cpu").kind == "cpu" and Target.parse("cpu").key.startswith("cpu:")
    with pytest.raises(AnsorError):
        Target.parse("cuda:sm_1")
    with pytest.raises(AnsorError):
        Target.parse("tpu")


def _gpu_count() -> tuple[int, str]:
    return _runner().device_count()


def test_tune_without_a_gpu_stops_before_building(mlir_side, ptxas, tmp_path):
    """No GPU: `tune` for a cuda target names the reason and --build-only,
    before it builds or records anything."""
    from mlir_ansor import tune
    from mlir_ansor.errors import AnsorError
    from mlir_ansor.target import Target

    n, why = _gpu_count()
    if n:
        pytest.skip(f"this host has {n} GPU(s): tune measures there")
    db = tmp_path / "t.db"
    with pytest.raises(AnsorError, match="needs a GPU on this host.*--build-only") as e:
        tune(str(Path(__file__).parent / "inputs" / "matmul.mlir"), target=Target.cuda(), db=db)
    assert why in str(e.value)
    assert not db.exists()


MATMUL_MLIR = Path(__file__).parent / "inputs" / "matmul.mlir"  # 128x64 @ 64x256, f32


def _ptxas_figures(msg: str) -> dict:
    return json.loads(msg[msg.index("{"):])


@pytest.mark.slow
def test_tune_build_only_records_ptxas_checked_candidates(mlir_side, ptxas, tmp_path):
    """Build-only tuning for CUDA: candidates come from the GPU sketches
    within the target's limits, each is built to a cubin, and ptxas's
    figures decide: within the block's registers (a quarter of sm_90's here,
    so some candidates pass the limit), recorded ``not_measured``; past it,
    ``ptxas_limit``, with the figures it was judged on."""
    import dataclasses

    from mlir_ansor import tune
    from mlir_ansor.graph.task import extract_tasks
    from mlir_ansor.ir.program import load
    from mlir_ansor.records import Database
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.target import Target
    from mlir_ansor.tuner import TuneConfig

    target = dataclasses.replace(Target.cuda(90), registers_per_block=16384)
    cfg = TuneConfig(trials=16, batch_size=8, build_only=True, seed=1)
    res = tune(str(MATMUL_MLIR), target=target, config=cfg, db=tmp_path / "t.db")
    (task,) = res.tasks
    assert res.measured == 16 and task.trials == 16 and not math.isfinite(task.best_latency_s)
    sketches = {sk.hash: sk for sk in generate_sketches(extract_tasks(load(str(MATMUL_MLIR)))[0].mlir, target)}
    recs = Database(str(tmp_path / "t.db")).records()
    kinds = {r.error_kind for r in recs}
    assert kinds <= {"not_measured", "ptxas_limit"}, [r.error_msg[:200] for r in recs]
    assert {"not_measured", "ptxas_limit"} <= kinds  # both outcomes met (seeded)
    assert dict(task.errors) == {k: sum(r.error_kind == k for r in recs) for k in kinds}
    for r in recs:
        sk = sketches[r.sketch_hash]
        assert sk.violation(r.knobs) is None, (sk.name, r.knobs)  # sampled within the sketch's limits
        fig = _ptxas_figures(r.error_msg)
        ((entry, p),) = fig["ptxas"].items()
        threads = math.prod(fig["launches"][0]["block"])
        over = p["registers"] * threads > 16384 or p["spill_stores"] or p["stack"]
        assert bool(over) == (r.error_kind == "ptxas_limit"), (r.error_kind, p, threads)
        if r.error_kind == "ptxas_limit":
            assert r.error_msg.startswith(f"dropped after ptxas: {entry}")
    # Resuming in build-only mode builds nothing twice.
    again = tune(str(MATMUL_MLIR), target=target, config=dataclasses.replace(cfg, trials=4), db=tmp_path / "t.db")
    recs2 = Database(str(tmp_path / "t.db")).records()
    assert again.measured == 4 and len({(r.sketch_hash, r.knobs) for r in recs2}) == 20


CSE_PLUGIN = '''
import dataclasses

from mlir_ansor.search import registry
from mlir_ansor.search.rules.gpu_default import GpuDefaultSchedule


class CseFirst(GpuDefaultSchedule):
    name = "cuda-cse-first"

    def apply(self, ctx):
        (sk,) = super().apply(ctx)
        head = "{transform.consumed}) {\\n"
        script = sk.script.replace(head, head + "    transform.apply_cse to %root : !transform.any_op\\n", 1)
        return [dataclasses.replace(sk, name=self.name, script=script)]


registry.register_rule("cuda-cse-first", CseFirst(), before="cuda-staged-matmul")
'''


@pytest.mark.slow
def test_cli_rules_and_a_plugin_rule_steer_cuda_tuning(mlir_side, ptxas, tmp_path, capsys):
    """`mlir-ansor tune --target cuda --rules ... --plugin ...`: the rule
    selection and a plugin's rule apply to a cuda target like a CPU one.
    The plugin's rule goes first, so the random search (which draws from
    the first sketch) builds its sketch: a GPU sketch that ptxas accepts."""
    from mlir_ansor.graph.task import extract_tasks
    from mlir_ansor.records import Database
    from mlir_ansor.search import registry
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.target import Target
    from mlir_ansor.tools.cli import main

    plugin = tmp_path / "cse_plugin.py"
    plugin.write_text(CSE_PLUGIN)
    db = tmp_path / "t.db"
    with registry.isolated():
        rc = main(["tune", str(MATMUL_MLIR), "--target", "cuda", "--build-only", "--plugin", str(plugin),
                   "--rules", "cuda-staged-matmul,cuda-cse-first", "--search", "random", "--trials", "4",
                   "--batch-size", "4", "--db", str(db), "--progress", "none", "--json"])
        assert rc == 0, capsys.readouterr().err
        (task,) = extract_tasks(str(MATMUL_MLIR))
        every = {s.hash: s.name for s in generate_sketches(task.mlir, Target.cuda(90))}
        assert list(every.values()) == ["cuda-cse-first", "cuda-tiled", "cuda-mma", "cuda-contraction", "cuda-default"]
    with Database(db) as d:
        recs = d.records()
        assert d.runs()[0]["config"]["rules"] == ["cuda-staged-matmul", "cuda-cse-first"]
    assert len(recs) == 4 and {r.error_kind for r in recs} <= {"not_measured", "ptxas_limit"}
    assert "not_measured" in {r.error_kind for r in recs}  # built to a cubin within the limits
    assert {every[r.sketch_hash] for r in recs} == {"cuda-cse-first"}


@pytest.mark.slow
@pytest.mark.parametrize("wrong", [False, True])
def test_tune_measures_cuda_candidates_on_a_fake_gpu(wrong, mlir_side, ptxas, tmp_path):
    """The measuring path without a GPU: real builds and cubins, the runner's
    bundle, buffers, reference check and timing loop, with a fake device
    that computes the product itself (`fake_cuda.py`). Right answers become
    valid records timed at the fake's 0.1 ms; a wrong one is caught."""
    import fake_cuda

    from mlir_ansor import tune
    from mlir_ansor.measure.measurer import Measurer
    from mlir_ansor.records import Database
    from mlir_ansor.target import Target
    from mlir_ansor.tuner import TuneConfig

    target = Target.cuda(90)
    cfg = TuneConfig(trials=3, batch_size=3, seed=2)
    run = fake_cuda.wrong_run_on_fake_gpu if wrong else fake_cuda.run_on_fake_gpu
    with Measurer(cfg, target=target, run_fn=run, reference_fn=fake_cuda.reference_on_fake_gpu) as m:
        res = tune(str(MATMUL_MLIR), target=target, config=cfg, db=tmp_path / "t.db", measurer=m)
    recs = [r for r in Database(str(tmp_path / "t.db")).records() if not r.retime]
    assert len(recs) == 3
    built = [r for r in recs if r.error_kind != "ptxas_limit"]
    assert built
    if wrong:
        assert all(r.error_kind == "wrong_answer" and "relative error" in r.error_msg for r in built)
        assert not math.isfinite(res.tasks[0].best_latency_s)
    else:
        assert all(r.valid and set(r.costs) == {1e-4} for r in built)
        assert res.tasks[0].best_latency_s == pytest.approx(1e-4)


@pytest.mark.slow
def test_tune_on_the_gpu(mlir_side, ptxas, tmp_path):
    """On a host with a GPU (cuda-python and a device), tuning measures
    real candidates, checked against the reference."""
    from mlir_ansor import tune
    from mlir_ansor.target import Target
    from mlir_ansor.tuner import TuneConfig

    n, why = _gpu_count()
    if not n:
        pytest.skip(f"no GPU to measure on: {why}")
    res = tune(str(MATMUL_MLIR), target=Target.cuda(90), config=TuneConfig(trials=8, batch_size=8), db=tmp_path / "t.db")
    assert res.measured == 8 and math.isfinite(res.tasks[0].best_latency_s)


def test_evolution_keeps_gpu_limits(mlir_side):
    """Mutation and crossover of GPU assignments stay within the sketch's
    limits (derived copy knobs recomputed, violators dropped); a bare
    mutation does not, which is why the hook exists."""
    from mlir_ansor.examples import workloads
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.strategy import EvolutionarySearch
    from mlir_ansor.search.strategy.evolutionary import mutate
    from mlir_ansor.target import Target

    sks = generate_sketches(workloads.matmul(128, 256, 64, "f32"), Target.cuda(90))
    sk = next(s for s in sks if s.name == "cuda-tiled")  # derived copy knobs and register-tile limits
    rng = random.Random(0)
    pop = [(sk, sk.sample(rng)) for _ in range(48)]
    assert any(sk.violation(mutate(sk.knobs, a, rng)) for _, a in pop)
    es = EvolutionarySearch()
    es.rng = random.Random(1)
    children = es._offspring(pop, np.asarray([rng.random() for _ in pop]))
    assert len(children) > 48
    assert all(s.violation(a) is None for s, a in children)


def test_ptxas_report_parsing(mlir_side):
    rep = mlir_side.parse_ptxas_report(CANNED_PTXAS)
    assert rep["matmul_kernel"] == {
        "registers": 88, "spill_stores": 4, "spill_loads": 12, "stack": 8, "smem": 5120, "barriers": 1
    }
    assert rep["fill_kernel"]["registers"] == 20 and rep["fill_kernel"]["smem"] == 0
    from mlir_ansor.target import Target

    launch = mlir_side.KernelLaunch("matmul_kernel", (1, 1, 1), (256, 1, 1), (0, 1, 2))
    assert "spills" in mlir_side.check_limits(rep, [launch], Target.cuda())
    rep["matmul_kernel"].update(spill_stores=0, spill_loads=0)
    assert "stack frame" in mlir_side.check_limits(rep, [launch], Target.cuda())  # local memory
    rep["matmul_kernel"].update(stack=0)
    assert mlir_side.check_limits(rep, [launch], Target.cuda()) is None
    big = mlir_side.KernelLaunch("matmul_kernel", (1, 1, 1), (1024, 1, 1), (0, 1, 2))
    assert "registers" in mlir_side.check_limits(rep, [big], Target.cuda())
    # 88 registers -> 11 x 256 per warp; 8 warps a block -> 2 blocks (16 of 64 warps) per SM.
    f = mlir_side.ptxas_features(rep, [launch], Target.cuda())
    assert (f["registers"], f["smem"], f["threads"], f["blocks_per_sm"], f["occupancy"]) == (88, 5120, 256, 2, 0.25)
    assert f["spill_bytes"] == 0 and f["grid_blocks"] == 1


def test_ptx_instruction_mix(mlir_side):
    ptx = """
$L__BB0_1:
	ld.global.nc.v4.b32 	{%r1, %r2, %r3, %r4}, [%rd1];
	ld.global.b32 	%r5, [%rd2];
	@%p1 st.global.v4.b32 	[%rd3], {%r1, %r2, %r3, %r4};
	st.shared.v4.b32 	[%r6], {%r1, %r2, %r3, %r4};
	bar.sync 	0;
	ldmatrix.sync.aligned.m8n8.x4.shared.b16 	{%r7, %r8, %r9, %r10}, [%r11];
	mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 	{%r12, %r13}, {%r7, %r8, %r9, %r10}, {%r1, %r2}, {%r12, %r13};
	fma.rn.f32 	%f1, %f2, %f3, %f1;
	fma.rn.f16x2 	%r14, %r15, %r16, %r14;
	@%p2 bra 	$L__BB0_1;
"""
    mix = mlir_side.ptx_instruction_mix(ptx)
    assert mix["ld.global.v"] == 1 and mix["ld.global"] == 1 and mix["st.global.v"] == 1 and mix["st.global"] == 0
    assert mix["mma.sync"] == 1 and mix["ldmatrix"] == 1 and mix["fma"] == 2 and mix["bar.sync"] == 1
    assert mix["st.shared"] == 1 and mix["ld.shared"] == 0 and mix["ld.local"] == 0


def _tasks(kind: str) -> list[str]:
    from mlir_ansor.examples import workloads
    from mlir_ansor.graph.task import extract_tasks
    from mlir_ansor.ir.program import load

    if kind == "matmul_f16":
        return [workloads.matmul(128, 128, 64, "f16")]  # hand-written: extraction accumulates f16 in f32
    src = {
        "matmul": workloads.matmul(256, 512, 128),
        "conv2d": workloads.conv2d_nhwc(1, 18, 18, 32, 64, 3, 3),
        "softmax": workloads.softmax(128, 256),
    }[kind]
    return [t.mlir for t in extract_tasks(load(text=src))]


@pytest.mark.parametrize("kind,per_sketch", [("matmul", 3), ("matmul_f16", 2), ("conv2d", 3), ("softmax", 2)])
def test_sampled_candidates_assemble(kind, per_sketch, mlir_side, ptxas, tmp_path):
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.gpu_sketch import sample
    from mlir_ansor.target import Target

    target = Target.cuda()
    built = 0
    names = set()
    for ti, task in enumerate(_tasks(kind)):
        for sk in generate_sketches(task, target):
            names.add(sk.name)
            rng = random.Random(1234 + ti)
            for i in range(per_sketch):
                a = sample(sk, rng)
                assert sk.violation(a) is None
                b = mlir_side.build_cuda(sk.payload, sk.concrete(a), target, str(tmp_path / f"{ti}_{i}.cubin"))
                assert Path(b.cubin_path).stat().st_size > 0
                assert mlir_side.check_limits(b.ptxas, b.launches, target) is None, (sk.name, a, b.ptxas)
                (k,) = b.launches
                assert k.entry in b.ptxas and ".visible .entry " + k.entry in b.ptx
                assert k.block[0] * k.block[1] * k.block[2] == sk.block_threads(a) or sk.name == "cuda-default"
                if sk.smem_bytes(a):
                    assert ".shared" in b.ptx and b.ptxas[k.entry]["smem"] == sk.smem_bytes(a)
                if sk.name.startswith("cuda-mma"):
                    assert "mma.sync.aligned" in b.ptx
                built += 1
    assert built >= 4
    if kind == "matmul":
        assert {"cuda-tiled", "cuda-mma", "cuda-contraction", "cuda-default"} <= names
    if kind == "matmul_f16":
        assert {"cuda-mma-smem", "cuda-tiled", "cuda-mma", "cuda-contraction", "cuda-default"} <= names


def _loop_bodies(ptx: str) -> list[str]:
    """The text of every PTX loop: from a label to the last branch back to it."""
    lines = ptx.splitlines()
    out = []
    for i, line in enumerate(lines):
        label = line.strip()
        if label.startswith("$L__") and label.endswith(":"):
            back = [j for j in range(i + 1, len(lines)) if lines[j].strip().endswith(f"bra \t{label[:-1]};")
                    or lines[j].split()[-1:] == [f"{label[:-1]};"]]
            if back:
                out.append("\n".join(lines[i:back[-1] + 1]))
    return out


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_staged_matmul_accumulates_in_registers(dtype, mlir_side, ptxas, tmp_path):
    """`cuda-tiled` (both dtypes) and `cuda-mma-smem` (f16): A/B tiles go
    through `.shared` with barriers, 128-bit global loads, and the K loop
    neither loads nor stores C: the accumulator stays in registers (no
    spills, no stack frame)."""
    from mlir_ansor.examples import workloads
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.space import make_assignment
    from mlir_ansor.target import Target

    target = Target.cuda()
    sketches = {s.name: s for s in generate_sketches(workloads.matmul(256, 256, 256, dtype), target)}
    cases = [("cuda-tiled", {"b_d0": 64, "b_d1": 64, "t_d0": 8, "t_d1": 16, "k_d2": 16, "stages": 1})]
    if dtype == "f16":
        cases.append(("cuda-mma-smem", {"b_d0": 64, "b_d1": 64, "w_d0": 32, "w_d1": 32, "k_d2": 32, "stages": 1}))
    elem = 4 if dtype == "f32" else 2
    for name, knobs in cases:
        sk = sketches[name]
        a = sk.complete(make_assignment(knobs))
        assert sk.violation(a) is None
        b = mlir_side.build_cuda(sk.payload, sk.concrete(a), target, str(tmp_path / f"{name}.cubin"))
        fig = b.ptxas[b.launches[0].entry]
        assert fig["spill_stores"] == fig["spill_loads"] == fig["stack"] == 0, fig
        assert fig["smem"] == (64 * knobs["k_d2"] * 2) * elem == sk.smem_bytes(a)
        assert b.launches[0].grid == (4, 4, 1)
        (loop,) = _loop_bodies(b.ptx)
        mix = mlir_side.ptx_instruction_mix(loop)
        assert mix["ld.global.v"] > 0 and mix["ld.global"] == 0, mix  # operands: 16-byte loads only
        assert mix["st.global"] == mix["st.global.v"] == 0, mix  # no C traffic in the K loop
        assert mix["st.shared"] > 0 and mix["bar.sync"] >= 2 and mix["ld.local"] == mix["st.local"] == 0
        if name == "cuda-mma-smem":
            assert mix["ldmatrix"] > 0 and mix["ld.shared"] == 0
            # 2 x 2 warps of 32 x 32: 2 x 4 mma tiles (16 x 8) per warp, 2 k-steps of 16.
            assert mix["mma.sync"] == 2 * 4 * 2 and "mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16" in loop
            assert b.launches[0].block == (64, 2, 1)
        else:
            assert mix["ld.shared"] > 0 and mix["mma.sync"] == 0
            # per thread an 8 x 4 register tile, 16 k-steps: 512 FMAs (f16: packed f16x2, 256)
            assert mix["fma"] == (512 if dtype == "f32" else 256), mix
            assert b.launches[0].block == (16, 8, 1)
        assert b.features["occupancy"] > 0 and b.features["ptx_ld.global.v"] > 0


def test_promotion_and_tensor_core_ptx(mlir_side, ptxas, tmp_path):
    """FileCheck over the PTX of a promoted tile and of the MMA sketch."""
    from mlir_ansor.examples import workloads
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.space import make_assignment
    from mlir_ansor.target import Target

    target = Target.cuda()
    sketches = {s.name: s for s in generate_sketches(workloads.matmul(128, 128, 64, "f16"), target)}
    mma, con = sketches["cuda-mma"], sketches["cuda-contraction"]
    a = make_assignment({"b_d0": 64, "b_d1": 64, "k_d2": 16, "smem": 0, "t_d0": 16, "t_d1": 16})
    b = mlir_side.build_cuda(con.payload, con.concrete(a), target, str(tmp_path / "s.cubin"))
    assert b.launches[0].grid == (2, 2, 1) and b.launches[0].block == (16, 16, 1)
    assert b.ptxas[b.launches[0].entry]["smem"] == (64 * 16 + 16 * 64) * 2
    filecheck(b.ptx, """
CHECK: .visible .entry matmul_kernel(
CHECK: .shared .align {{[0-9]+}} .b8 {{.*}}[2048];
CHECK: .shared .align {{[0-9]+}} .b8 {{.*}}[2048];
CHECK: st.shared
CHECK: bar.sync 0;
CHECK: ld.shared
""", tmp_path)
    a = make_assignment({"b_d0": 64, "b_d1": 32, "k_d2": 32, "w_d0": 32, "w_d1": 16})
    b = mlir_side.build_cuda(mma.payload, mma.concrete(a), target, str(tmp_path / "m.cubin"))
    assert b.launches[0].block == (64, 2, 1)  # 2x2 warps
    filecheck(b.ptx, """
CHECK: .visible .entry matmul_kernel(
CHECK: mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16
""", tmp_path)


def test_limits_reject_oversized_knobs(mlir_side):
    from mlir_ansor.examples import workloads
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.space import make_assignment
    from mlir_ansor.target import Target

    sketches = {s.name: s for s in generate_sketches(workloads.matmul(1024, 1024, 1024, "f32"), Target.cuda())}
    con = sketches["cuda-contraction"]
    too_much_smem = make_assignment({"b_d0": 256, "b_d1": 256, "k_d2": 64, "smem": 0, "t_d0": 32, "t_d1": 32})
    assert "shared memory" in con.violation(too_much_smem)
    too_few_threads = make_assignment({"b_d0": 8, "b_d1": 8, "k_d2": 8, "smem": 1, "t_d0": 2, "t_d1": 2})
    assert "warp" in con.violation(too_few_threads)
    tiled = sketches["cuda-tiled"]
    # 256 threads copy a 128 x 16 tile of A in 4-wide pieces: 2 rows each.
    ok = tiled.complete(make_assignment({"b_d0": 128, "b_d1": 128, "k_d2": 16, "t_d0": 16, "t_d1": 16}))
    assert dict(ok)["cp_a"] == 2 and dict(ok)["cp_b"] == 2 and tiled.violation(ok) is None
    assert "cp_a" in tiled.violation(tuple((k, 1 if k == "cp_a" else v) for k, v in ok))
    one_row = tiled.complete(make_assignment({"b_d0": 32, "b_d1": 128, "k_d2": 16, "t_d0": 32, "t_d1": 16}))
    assert "register tile extent 1" in tiled.violation(one_row)


# --------------------------------------------------------------------------
# Run side (no MLIR)
# --------------------------------------------------------------------------


def test_runner_imports_no_mlir():
    src = (ROOT / "mlir_ansor" / "measure" / "cuda_runner.py").read_text()
    assert "import mlir" not in src and "from mlir" not in src and "mlir_ansor" not in src.split('"""', 2)[2]
    r = _runner()
    assert r.relative_error(np.ones(3), np.ones(3)) == 0.0
    assert r.relative_error(np.array([np.nan]), np.ones(1)) == float("inf")


@pytest.fixture(scope="module")
def backend():
    r = _runner()
    try:
        return r, r.open_backend()
    except r.CudaUnavailable as e:
        pytest.skip(f"no GPU to run on: {e}")


def _tolerance(dtype: str, sketch: str) -> float:
    if dtype == "f16":
        return 1e-2  # f16 accumulation over K = 64
    return 2e-2 if sketch == "cuda-mma" else 1e-5  # tf32 tensor cores, else f32 FMAs


def test_prebuilt_candidates_run_and_match_numpy(backend):
    """Every prebuilt test candidate (one per sketch: the staged f32/f16
    kernels, tensor cores on f16 and tf32, and the older sketches) matches
    a float64 numpy product."""
    r, be = backend
    manifest = json.loads((GPU_INPUTS / "manifest.json").read_text())
    assert {w["dtype"] for w in manifest["workloads"]} == {"f32", "f16"}
    for wl in manifest["workloads"]:
        m, n, k = wl["mnk"]
        dt = np.float16 if wl["dtype"] == "f16" else np.float32
        rng = np.random.default_rng(0)
        a = rng.uniform(-1, 1, (m, k)).astype(dt)
        b = rng.uniform(-1, 1, (k, n)).astype(dt)
        ref = a.astype(np.float64) @ b.astype(np.float64)
        assert len(wl["candidates"]) >= 2
        for c in wl["candidates"]:
            res = r.run(be, c, GPU_INPUTS, [a, b], [ref], _tolerance(wl["dtype"], c["sketch"]), min_repeat=2, min_time_s=0.0)
            assert res.ok, (wl["name"], c["sketch"], c["knobs"], res.error)
            assert 0 < res.latency_s < 1.0
        # A wrong reference is caught.
        bad = r.run(be, wl["candidates"][0], GPU_INPUTS, [a, b], [ref + 1.0], 1e-5)
        assert not bad.ok and "wrong answer" in bad.error


def _f32_workload() -> dict:
    manifest = json.loads((GPU_INPUTS / "manifest.json").read_text())
    return next(w for w in manifest["workloads"] if w["dtype"] == "f32")


class _FakeBackend(FakeMatmulDevice):
    """Stands in for a device (`fake_cuda.FakeMatmulDevice`: buffers are
    numpy arrays, and a launch of the test GEMM computes A.B, so the buffer
    plumbing of `run` is checked without a GPU); also records each launch
    and checks the pointers it is given."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__(wrong)
        self.launched: list[tuple] = []

    def launch(self, func, grid, block, smem, ptrs):
        self.launched.append((func, tuple(grid), tuple(block)))
        # Buffers were allocated in host-argument order: A, B, C.
        assert sorted(ptrs) == [4096, 8192, 12288]
        super().launch(func, grid, block, smem, ptrs)


def test_runner_plumbing_with_a_fake_device():
    r = _runner()
    wl = _f32_workload()
    c = wl["candidates"][0]
    m, n, k = wl["mnk"]
    rng = np.random.default_rng(0)
    a = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    b = rng.uniform(-1, 1, (k, n)).astype(np.float32)
    be = _FakeBackend()
    res = r.run(be, c, GPU_INPUTS, [a, b], [a.astype(np.float64) @ b], 1e-5, min_repeat=3, min_time_s=0.0)
    assert res.ok and len(res.costs) == 3 and res.latency_s == 1e-4
    launch = c["launches"][0]
    assert be.launched[0] == (launch["entry"], tuple(launch["grid"]), tuple(launch["block"]))
    assert not be.mem  # every buffer freed
    bad = r.run(_FakeBackend(wrong=True), c, GPU_INPUTS, [a, b], [a.astype(np.float64) @ b], 1e-5)
    assert not bad.ok and "wrong answer" in bad.error
    assert not r.run(be, c, GPU_INPUTS, [a], None, 1e-5).ok  # missing input


def test_lower_to_nvvm_pipeline_element(mlir_side):
    """`ansor-lower-to-nvvm` takes a GPU-scheduled module to NVVM with the
    kernel's PTX in a gpu.binary; an unscheduled module is a clear error."""
    import random

    from mlir import ir

    from mlir_ansor.errors import AnsorError
    from mlir_ansor.passes.nvvm import extract_ptx
    from mlir_ansor.schedule.apply import apply_schedule
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.gpu_sketch import sample
    from mlir_ansor.target import Target
    from mlir_ansor.tools.pipeline import run_pipeline

    task = _tasks("matmul")[0]
    sk = generate_sketches(task, Target.cuda())[-1]
    script = sk.concrete(sample(sk, random.Random(0)))
    with ir.Context(), ir.Location.unknown():
        module = apply_schedule(sk.payload, script)
        run_pipeline(module, "builtin.module(ansor-lower-to-nvvm{chip=sm_90})")
        assert ".entry" in extract_ptx(module)
        plain = ir.Module.parse(task)
        with pytest.raises(AnsorError, match="ansor-lower-to-nvvm"):
            run_pipeline(plain, "builtin.module(ansor-lower-to-nvvm)")
