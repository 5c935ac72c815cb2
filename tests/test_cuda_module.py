"""Whole modules for NVIDIA GPUs (`cuda_compiler`, `measure.cuda_module`),
without a GPU: real MLIR builds every kernel to PTX and a cubin, ptxas
assembles the PTX that `compile --target cuda -o X.ptx` writes, and the
host plan runs on a fake device (`fake_cuda.FakeModuleDevice`) whose
kernels compute their tasks with numpy, so that the launch order, the
buffers each launch gets, the weights' single upload and the outputs are
checked against the untuned CPU build.

What only a GPU can check (the kernels' own arithmetic, and the times) is
left to `benchmarks/gpu_check.sh` on a GPU host.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fake_cuda import FakeModuleDevice

from mlir_ansor.errors import AnsorError
from mlir_ansor.examples import workloads
from mlir_ansor.target import Target
from mlir_ansor.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]
INPUTS = Path(__file__).parent / "inputs"
SM90 = Target.parse("cuda:sm_90")

MODULES = {
    "matmul": lambda: workloads.matmul(256, 256, 256),
    "conv_bias_relu": lambda: workloads.conv_bias_relu(1, 18, 18, 32, 64, 3),
    "softmax": lambda: workloads.softmax(64, 256),
}


@pytest.mark.parametrize("name", sorted(MODULES))
def test_compile_to_ptx_that_ptxas_accepts(name, ptxas, tmp_path, capsys):
    """`compile --target cuda:sm_90 -o X.ptx` writes every kernel of the
    module in one PTX file that `ptxas -arch=sm_90` assembles; each task's
    kernel is an entry of it, and a contraction's threads each compute
    several outputs (no one-thread-per-element kernel)."""
    src = tmp_path / f"{name}.mlir"
    src.write_text(MODULES[name]())
    out = tmp_path / f"{name}.ptx"
    bundle = tmp_path / f"{name}.cuda"
    assert main(["compile", str(src), "--target", "cuda:sm_90", "--db", str(tmp_path / "none.db"),
                 "-o", str(bundle)]) == 0
    plan = json.loads((bundle / "plan.json").read_text())
    assert main(["compile", str(src), "--target", "cuda:sm_90", "--db", str(tmp_path / "none.db"),
                 "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().err
    ptx = out.read_text()
    assert ptx.count(".version ") == 1 and ".target sm_90" in ptx
    entries = {ln["entry"] for ln in plan["launches"]}
    for entry in entries:
        assert f".entry {entry}(" in ptx
    proc = subprocess.run([ptxas, "-arch=sm_90", "-v", "-o", str(tmp_path / "all.cubin"), str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "all.cubin").read_bytes()[:4] == b"\x7fELF"
    for entry in entries:
        assert f"Compiling entry function '{entry}'" in proc.stdout + proc.stderr
    assert "malloc" not in ptx  # no buffer left to device malloc (it would leak on every launch)
    for k in plan["kernels"]:
        assert (bundle / "kernels" / k["cubin"]).read_bytes()[:4] == b"\x7fELF"
        for fig in k["ptxas"].values():
            assert fig["spill_stores"] == 0 and fig["smem"] <= SM90.smem_per_block
    if name in ("matmul", "conv_bias_relu"):
        (task,) = plan["tasks"]
        assert task["schedule"] == "default" and task["sketch"] in ("cuda-tiled", "cuda-contraction")
        outputs = np.prod(plan["buffers"][plan["outputs"][0]]["shape"])
        (launch,) = plan["launches"]
        threads = np.prod(launch["grid"]) * np.prod(launch["block"])
        assert outputs >= 8 * threads, (outputs, launch)  # a register tile of 8 or more outputs per thread
    else:  # softmax: max, exp-sum, divide: three kernels in dependency order
        assert [t["name"].split("_")[0] for t in plan["tasks"]] == ["reduction", "reduction", "generic"]
        assert len(plan["launches"]) == 3


def _numpy_tasks(module, dev: FakeModuleDevice, fns: dict) -> None:
    """Make the fake device compute each launch's task with the numpy
    function of `fns` (task name -> f(*inputs) -> result), reading and
    writing the buffers the launch's pointers name."""
    plan = module.plan

    def on_launch(entry: str, ptrs: list[int]) -> None:
        ln = plan["launches"][(len(dev.launches) - 1) % len(plan["launches"])]  # launches run in plan order
        assert entry == ln["entry"] and ptrs == [module.pointer(i) for i in ln["args"]]
        bufs = [plan["buffers"][i] for i in ln["task_args"]]
        arrays = [dev.array(module.pointer(b["id"]), b["shape"], np.float32) for b in bufs]
        n = ln["task_inputs"]
        arrays[n][...] = fns[ln["task"]](*arrays[:n])

    dev.on_launch = on_launch


def test_whole_module_on_a_fake_device(tmp_path):
    """tests/inputs/mini_net.mlir (constant weights, matmul + bias + ReLU, a
    row sum, a division, an expand_shape view, two results) as a CUDA
    module: launched in program order on distinct buffers, the weights
    uploaded once over two calls, the inputs on each, and both outputs as
    the untuned CPU build gives them."""
    from mlir_ansor.compiler import compile, compile_untuned

    folder = tmp_path / "net.cuda"
    from mlir_ansor.cuda_compiler import compile_cuda

    module = compile_cuda(str(INPUTS / "mini_net.mlir"), target=SM90, folder=folder)
    assert (folder / "plan.json").exists()
    plan = module.plan
    assert [ln["task"] for ln in plan["launches"]] == ["matmul_8x8x16_f32_add_relu", "reduction_8x8_f32", "div_8x8_f32"]
    roles = [b["role"] for b in plan["buffers"]]
    assert roles.count("input") == 1 and roles.count("constant") == 2 and roles.count("view") == 1
    view = next(b for b in plan["buffers"] if b["role"] == "view")
    assert plan["outputs"] == [view["id"], plan["launches"][1]["task_args"][-1]]
    assert view["shape"] == [2, 4, 8] and view["of"] == plan["launches"][2]["task_args"][-1]

    dev = FakeModuleDevice()
    module.backend = dev
    module.open()
    _numpy_tasks(module, dev, {
        "matmul_8x8x16_f32_add_relu": lambda x, w, b: np.maximum(x @ w + b, 0),
        "reduction_8x8_f32": lambda r: 1 + r.sum(axis=1),  # the sum starts from 1 (its linalg.fill)
        "div_8x8_f32": lambda r, s: r / s[:, None],
    })
    reference = compile_untuned(str(INPUTS / "mini_net.mlir"))
    rng = np.random.default_rng(0)
    for call in range(2):
        x = rng.uniform(-1, 1, (8, 16)).astype(np.float32)
        got = module(x)
        want = reference(x)
        assert len(got) == 2
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == np.float32
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        assert len(dev.launches) == 3 * (call + 1)
    # the launches of both calls, in order, on the same buffers
    assert dev.launches[:3] == dev.launches[3:]
    assert [e for e, *_ in dev.launches[:3]] == [ln["entry"] for ln in plan["launches"]]
    # weights uploaded once, the input on each call
    const_ptrs = {module.pointer(b["id"]) for b in plan["buffers"] if b["role"] == "constant"}
    input_ptr = module.pointer(0)
    uploaded = [p for p, _ in dev.uploads]
    assert all(uploaded.count(p) == 1 for p in const_ptrs) and uploaded.count(input_ptr) == 2
    # every buffer but the view its own memory; the view its base's
    own = [module.pointer(b["id"]) for b in plan["buffers"] if b["role"] != "view"]
    assert len(set(own)) == len(own) == len(plan["buffers"]) - 1
    assert module.pointer(view["id"]) == module.pointer(view["of"])
    module.close()
    assert dev.mem == {}

    # `compile(..., target=cuda)` is the same thing, in a folder of its own
    again = compile(str(INPUTS / "mini_net.mlir"), target=SM90)
    assert [ln["entry"] for ln in again.plan["launches"]] == [ln["entry"] for ln in plan["launches"]]


def test_an_op_outside_the_tasks_is_an_error_naming_it(tmp_path):
    """A value the plan would have to compute on the host (an extract_slice
    feeding a matmul) is refused with the op's name and place, before any
    kernel is built."""
    from mlir_ansor.cuda_compiler import build_bundle

    src = tmp_path / "slice.mlir"
    src.write_text("""
func.func @f(%A: tensor<64x64xf32>, %B: tensor<64x32xf32>) -> tensor<32x32xf32> {
  %cst = arith.constant 0.0 : f32
  %s = tensor.extract_slice %A[0, 0] [32, 64] [1, 1] : tensor<64x64xf32> to tensor<32x64xf32>
  %e = tensor.empty() : tensor<32x32xf32>
  %C = linalg.fill ins(%cst : f32) outs(%e : tensor<32x32xf32>) -> tensor<32x32xf32>
  %R = linalg.matmul ins(%s, %B : tensor<32x64xf32>, tensor<64x32xf32>) outs(%C : tensor<32x32xf32>) -> tensor<32x32xf32>
  return %R : tensor<32x32xf32>
}
""")
    with pytest.raises(AnsorError, match=r"slice.mlir:4:\d+: tensor.extract_slice computes a value outside every task"):
        build_bundle(str(src), tmp_path / "out", target=SM90)
    assert not (tmp_path / "out").exists()  # refused before any kernel was built


def test_run_without_a_gpu_is_a_one_line_error(capsys):
    from mlir_ansor.measure.cuda_runner import device_count

    if device_count()[0]:
        pytest.skip("a CUDA device is present")
    assert main(["run", str(INPUTS / "matmul.mlir"), "--target", "cuda:sm_90"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mlir-ansor: error: run --target cuda:sm_90: no CUDA device here") and "\n" not in err


def test_the_runtime_imports_no_mlir():
    """A GPU host needs numpy and cuda-python only: loading the runtime
    imports no MLIR binding."""
    code = ("import sys; import mlir_ansor.measure.cuda_module as m; "
            "assert not [k for k in sys.modules if k == 'mlir' or k.startswith('mlir.')], 'MLIR imported'; "
            "print(m.FORMAT)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "mlir-ansor-cuda-module"


def test_compile_names_what_it_writes(tmp_path, capsys):
    """-o with --target cuda takes OUT.ptx or a bundle folder, and says so before compiling."""
    assert main(["compile", str(INPUTS / "matmul.mlir"), "--target", "cuda:sm_90", "-o", str(tmp_path / "x.so")]) == 2
    err = capsys.readouterr().err
    assert "x.so: with --target cuda:sm_90, expected OUT.ptx or a bundle folder (a name ending in .cuda or /)" in err
    assert not (tmp_path / "x.so").exists()


def test_default_gpu_assignments_follow_the_rules_of_thumb():
    """Untuned tasks' defaults (`search.gpu_defaults`): valid within the
    target's limits, the same on every call, a contraction's threads each
    with a register tile of 16-64 outputs even under the generic sketch,
    an elementwise op's with at most 4."""
    from mlir_ansor.graph.task import partition
    from mlir_ansor.importers import load
    from mlir_ansor.ir.program import load as load_text
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.gpu_defaults import default_gpu_assignments

    def tile(sk, a) -> int:
        v = dict(a)
        return int(np.prod([v[b] // v[t] for b, t in sk.register_tile]))

    (occ,) = partition(load_text(text=workloads.matmul(256, 256, 256)))
    sketches = {sk.name: sk for sk in generate_sketches(occ.task.mlir, SM90)}
    for name in ("cuda-tiled", "cuda-contraction", "cuda-default"):
        sk = sketches[name]
        best = default_gpu_assignments(sk, SM90, count=3)
        assert best == default_gpu_assignments(sk, SM90, count=3) and len(best) == 3
        assert all(sk.violation(a) is None for a in best)
        assert 16 <= tile(sk, best[0]) <= 64, (name, dict(best[0]))
    occs = partition(load(str(INPUTS / "mini_net.mlir")))
    div = next(o.task for o in occs if o.task.name.startswith("div"))
    (sk,) = generate_sketches(div.mlir, SM90)
    assert tile(sk, default_gpu_assignments(sk, SM90)[0]) <= 4


def test_a_tuned_record_is_the_schedule_and_a_failing_one_falls_back(tmp_path):
    """A task's best valid record for the target is its schedule; when the
    best record's schedule does not build, the next one is tried, and the
    plan says why."""
    from mlir_ansor.cuda_compiler import build_bundle
    from mlir_ansor.graph.task import partition
    from mlir_ansor.ir.program import load as load_text
    from mlir_ansor.records import Database, Record
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.gpu_defaults import default_gpu_assignments

    text = workloads.matmul(128, 128, 64)
    src = tmp_path / "mm.mlir"
    src.write_text(text)
    (occ,) = partition(load_text(text=text))
    sk = next(s for s in generate_sketches(occ.task.mlir, SM90) if s.name == "cuda-tiled")
    default = dict(default_gpu_assignments(sk, SM90)[0])
    # synchronous copies: some of the cp.async candidates near the top spill
    mine = next(dict(a) for a in default_gpu_assignments(sk, SM90, count=40)[1:]
                if (dict(a)["b_d0"] != default["b_d0"] or dict(a)["b_d1"] != default["b_d1"]) and dict(a)["stages"] == 1)
    db = tmp_path / "t.db"
    with Database(str(db)) as d:
        d.commit_record(Record(occ.task.workload_key, SM90.key, sk.hash, tuple(mine.items()), (2e-5,), "none",
                               host="NVIDIA H200", threads=1))
    plan = build_bundle(str(src), tmp_path / "a", db=db, target=SM90)
    (task,) = plan["tasks"]
    assert (task["schedule"], task["sketch"], task["knobs"]) == ("tuned", "cuda-tiled", mine)
    assert task["best_latency_s"] == 2e-5 and task["trials"] == 1
    (launch,) = plan["launches"]
    assert launch["grid"][:2] == [128 // mine["b_d1"], 128 // mine["b_d0"]]

    # a faster record that does not build (4 threads cannot share the copies of 128x128 tiles)
    greedy = {**mine, "b_d0": 128, "b_d1": 128, "t_d0": 2, "t_d1": 2, "cp_a": 1, "cp_b": 1}
    greedy = dict(sk.complete(tuple(sorted(greedy.items()))))
    with Database(str(db)) as d:
        d.commit_record(Record(occ.task.workload_key, SM90.key, sk.hash, tuple(greedy.items()), (1e-5,), "none",
                               host="NVIDIA H200", threads=1))
    plan = build_bundle(str(src), tmp_path / "b", db=db, target=SM90)
    (task,) = plan["tasks"]
    assert task["knobs"] == mine and task["schedule"] == "tuned"
    assert task["error"].startswith("tuned cuda-tiled {'b_d0': 128, 'b_d1': 128"), task["error"]


MIXED = """
func.func @mm(%A: tensor<256x256xf16>, %B: tensor<256x256xf16>) -> tensor<256x256xf32> {
  %cst = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<256x256xf32>
  %C = linalg.fill ins(%cst : f32) outs(%e : tensor<256x256xf32>) -> tensor<256x256xf32>
  %R = linalg.matmul ins(%A, %B : tensor<256x256xf16>, tensor<256x256xf16>) outs(%C : tensor<256x256xf32>) -> tensor<256x256xf32>
  return %R : tensor<256x256xf32>
}
"""


def test_f16_operands_accumulate_in_f32_on_tensor_cores(ptxas, tmp_path):
    """A matmul of f16 operands into f32, and an f16 GEMM (which its task
    accumulates in f32 and rounds once, in an epilogue), compile to
    `cuda-mma-smem` with mma.sync's f32 accumulators (m16n8k16
    .f32.f16.f16.f32), which ptxas assembles without spills. The f16 GEMM's
    accumulator tile goes to shared memory once, after the K loop, and a
    barrier separates those writes from the epilogue's reads (other warps'
    tiles) before it rounds to f16 and stores. A bf16 GEMM (no bf16 mma
    from this MLIR) gets the contraction sketch with its operands in shared
    memory, no longer the generic one."""
    from mlir_ansor.cuda_compiler import build_bundle, bundle_ptx

    for name, text in (("mixed", MIXED), ("f16", workloads.matmul(256, 256, 128, "f16"))):
        src = tmp_path / f"{name}.mlir"
        src.write_text(text)
        plan = build_bundle(str(src), tmp_path / f"{name}.cuda", target=SM90)
        (task,) = plan["tasks"]
        assert task["sketch"] == "cuda-mma-smem" and not task["error"], task
        ptx = bundle_ptx(tmp_path / f"{name}.cuda")
        assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx
        assert "mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16" not in ptx
        (fig,) = plan["kernels"][0]["ptxas"].values()
        assert fig["spill_stores"] == fig["stack"] == 0 and fig["smem"] > 0
        (tmp_path / f"{name}.ptx").write_text(ptx)
        proc = subprocess.run([ptxas, "-arch=sm_90", "-o", str(tmp_path / "m.cubin"), str(tmp_path / f"{name}.ptx")],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        if name == "f16":
            v = task["knobs"]
            # A and B tiles once per cp.async stage; the accumulator tile once
            assert fig["smem"] == 2 * (v["b_d0"] + v["b_d1"]) * v["k_d2"] * v["stages"] + 4 * v["b_d0"] * v["b_d1"]
            assert v["stages"] == 3 and "cp.async.wait_group" in ptx
            after_loop = ptx[ptx.rindex("bra"):]
            ops = [line.split()[0] for line in after_loop.splitlines()[1:] if line.strip() and not line.startswith("$")]
            first = {op: ops.index(op) for op in reversed(ops)}
            store = next(i for i, op in enumerate(ops) if op.startswith("st.shared"))
            barrier = next(i for i, op in enumerate(ops) if op.startswith("bar.sync") and i > store)
            load = next(i for i, op in enumerate(ops) if op.startswith("ld.shared") and i > store)
            assert store < barrier < load < first["cvt.rn.f16x2.f32"] < max(
                i for i, op in enumerate(ops) if op.startswith("st.global")), ops
    src = tmp_path / "bf16.mlir"
    src.write_text(workloads.matmul(128, 128, 64, "bf16"))
    plan = build_bundle(str(src), tmp_path / "bf16.cuda", target=SM90)
    (task,) = plan["tasks"]
    assert task["name"].endswith("_f32_truncf") and task["sketch"] == "cuda-contraction", task
    assert not task["error"] and plan["kernels"][0]["ptxas"]


def test_tf32_kernels_are_checked_with_tf32_rounding(tmp_path):
    """A kernel on tf32 tensor cores (`cuda-mma` on f32) says so in its
    manifest ("rounds_to": "tf32", read from its PTX), and the runner checks
    it with 4 tf32 epsilons added to the task's f32 tolerance: a product off
    by 5e-4 (what tf32 operands give) passes there, and fails for an f32
    FMA kernel, whose tolerance is the f32 accumulation's alone."""
    from fake_cuda import FakeMatmulDevice

    from mlir_ansor.ir.dtypes import EPSILON, tolerance
    from mlir_ansor.measure import cuda_runner, jobs
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.space import make_assignment

    assert cuda_runner.INPUT_ROUNDING_TOLERANCE["tf32"] == 4 * EPSILON["tf32"]
    assert tolerance("f32", 64, rounds_to="tf32") == tolerance("f32", 64) + 4 * EPSILON["tf32"]

    class Tf32Like(FakeMatmulDevice):
        def launch(self, func, grid, block, smem, ptrs):
            a, b, c = (self.mem[p] for p in self.order[:3])
            c[...] = (a @ b) * (1 + 5e-4)

    sketches = {s.name: s for s in generate_sketches(workloads.matmul(64, 64, 64), SM90)}
    knobs = {"cuda-mma": {"b_d0": 32, "b_d1": 32, "w_d0": 16, "w_d1": 16, "k_d2": 16},
             "cuda-tiled": {"b_d0": 32, "b_d1": 32, "t_d0": 8, "t_d1": 8, "k_d2": 16, "stages": 1}}
    rng = np.random.default_rng(0)
    a, b = (rng.uniform(-1, 1, (64, 64)).astype(np.float32) for _ in range(2))
    tol = tolerance("f32", 64)
    for name, want in (("cuda-mma", "tf32"), ("cuda-tiled", "")):
        sk = sketches[name]
        path = str(tmp_path / f"{name}.bundle")
        jobs.build_cuda_candidate(sk.payload, sk.concrete(sk.complete(make_assignment(knobs[name]))), 1, path,
                                  target=SM90)
        entry, image = cuda_runner.read_bundle(path)
        assert entry["rounds_to"] == want
        r = cuda_runner.run(Tf32Like(), entry, tmp_path, [a, b], [a.astype(np.float64) @ b], tol, image=image)
        assert r.ok == (want == "tf32"), (name, r.error)
        assert 4e-4 < r.max_rel_err < 6e-4


def _mlp(seed: int = 0) -> str:
    """Two identical layers (matmul + ReLU: one task, launched twice on
    other buffers) with constant weights, a reshape of the result, and a
    softmax over it (three more kernels)."""
    rng = np.random.default_rng(seed)

    def dense(shape) -> str:
        return "dense<" + json.dumps(np.round(rng.uniform(-1, 1, shape), 3).tolist()) + f"> : tensor<{shape[0]}x{shape[1]}xf32>"

    layer = """
  %e{i} = tensor.empty() : tensor<16x32xf32>
  %z{i} = linalg.fill ins(%zero : f32) outs(%e{i} : tensor<16x32xf32>) -> tensor<16x32xf32>
  %m{i} = linalg.matmul ins(%h{j}, %w{i} : tensor<16x32xf32>, tensor<32x32xf32>) outs(%z{i} : tensor<16x32xf32>) -> tensor<16x32xf32>
  %h{i} = linalg.generic {{indexing_maps = [#id, #id], iterator_types = ["parallel", "parallel"]}}
      ins(%m{i} : tensor<16x32xf32>) outs(%e{i} : tensor<16x32xf32>) {{
  ^bb0(%a: f32, %o: f32):
    %r = arith.maximumf %a, %zero : f32
    linalg.yield %r : f32
  }} -> tensor<16x32xf32>"""
    body = "".join(layer.format(i=i, j=i - 1) for i in (1, 2))
    soft = workloads.softmax(8, 64).split("{", 1)[1].rsplit("}", 1)[0].replace("%X", "%flat").replace("%zero", "%szero")
    return f"""#id = affine_map<(d0, d1) -> (d0, d1)>
func.func @mlp(%h0: tensor<16x32xf32>) -> (tensor<8x64xf32>, tensor<16x32xf32>) {{
  %zero = arith.constant 0.0 : f32
  %w1 = arith.constant {dense((32, 32))}
  %w2 = arith.constant {dense((32, 32))}{body}
  %flat = tensor.collapse_shape %h2 [[0, 1]] : tensor<16x32xf32> into tensor<512xf32>
  %flat8 = tensor.expand_shape %flat [[0, 1]] output_shape [8, 64] : tensor<512xf32> into tensor<8x64xf32>
""".replace("%flat)", "%flat8)") + soft.replace("ins(%flat", "ins(%flat8").replace("return %o : tensor<8x64xf32>",
                                                     "return %o, %h1 : tensor<8x64xf32>, tensor<16x32xf32>") + "}\n"


def test_a_plan_runs_as_its_tasks_on_the_cpu_would(tmp_path):
    """Every launch of a bundle computed by its task lowered for the CPU
    (the task's own MLIR, untuned): the whole module's outputs then equal
    the untuned CPU build's, which checks the plan's wiring (constants,
    views, a task launched twice on other buffers, two outputs) whatever
    the task computes."""
    from mlir_ansor.compiler import compile_untuned
    from mlir_ansor.cuda_compiler import compile_cuda
    from mlir_ansor.graph.task import partition
    from mlir_ansor.ir.program import load as load_text
    from mlir_ansor.measure.cuda_runner import np_dtype
    from mlir_ansor.measure.runner import random_inputs

    text = _mlp()
    src = tmp_path / "mlp.mlir"
    src.write_text(text)
    module = compile_cuda(str(src), target=SM90, folder=tmp_path / "mlp.cuda")
    plan = module.plan
    names = [ln["task"] for ln in plan["launches"]]
    assert names[0] == names[1] and len(plan["kernels"]) == len(set(names)) == len(names) - 1
    assert plan["launches"][0]["args"] != plan["launches"][1]["args"]  # one kernel, other buffers
    assert [b["role"] for b in plan["buffers"]].count("view") == 2
    tasks = {o.task.name: o.task for o in partition(load_text(text=text))}
    cpu = {name: compile_untuned(load_text(text=tasks[name].mlir)) for name in set(names)}
    dev = FakeModuleDevice()
    module.backend = dev
    module.open()

    def on_launch(entry: str, ptrs: list[int]) -> None:
        ln = plan["launches"][(len(dev.launches) - 1) % len(plan["launches"])]
        assert entry == ln["entry"] and ptrs == [module.pointer(i) for i in ln["args"]]
        bufs = [plan["buffers"][i] for i in ln["task_args"]]
        arrays = [dev.array(module.pointer(b["id"]), b["shape"], np_dtype(b["dtype"])) for b in bufs]
        n = ln["task_inputs"]
        outs = cpu[ln["task"]](*[a.copy() for a in arrays[:n]])
        for a, o in zip(arrays[n:], outs if isinstance(outs, tuple) else (outs,)):
            a[...] = o

    dev.on_launch = on_launch
    inputs = random_inputs(module.inputs, 0)
    got = module(*inputs)
    want = compile_untuned(str(src))(*inputs)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)
    module.close()


def test_an_argument_only_a_fill_writes_becomes_an_empty_tensor(tmp_path):
    """A task whose fill writes a tensor.empty the user's function shares
    with other ops gets it as an argument (BERT's layer norms); read-only,
    it made bufferization copy it on the host ("host code has a scf.for").
    The kernel now fills an empty tensor of its own and builds."""
    from mlir_ansor.passes.cuda_kernels import build_module_kernel, prepare_payload_for_module
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.gpu_defaults import default_gpu_assignments

    task = """#map = affine_map<(d0, d1, d2) -> (d0, d1, d2)>
#map1 = affine_map<(d0, d1, d2) -> (d0, d1)>
module {
  func.func @kernel(%arg0: tensor<1x128x768xf32>, %arg1: tensor<1x128xf32>) -> tensor<1x128xf32> {
    %cst = arith.constant 0.000000e+00 : f32
    %0 = linalg.fill ins(%cst : f32) outs(%arg1 : tensor<1x128xf32>) -> tensor<1x128xf32>
    %1 = linalg.generic {indexing_maps = [#map, #map1], iterator_types = ["parallel", "parallel", "reduction"]}
        ins(%arg0 : tensor<1x128x768xf32>) outs(%0 : tensor<1x128xf32>) attrs = {ansor.anchor} {
    ^bb0(%in: f32, %out: f32):
      %2 = arith.addf %in, %out : f32
      linalg.yield %2 : f32
    } -> tensor<1x128xf32>
    return %1 : tensor<1x128xf32>
  }
}
"""
    (sk,) = generate_sketches(task, SM90)
    prepared = prepare_payload_for_module(sk.payload, "ansor_norm")
    assert "func.func @ansor_norm(%arg0: tensor<1x128x768xf32> {bufferization.writable = false}" in prepared
    assert "tensor.empty() : tensor<1x128xf32>" in prepared and "outs(%arg1" not in prepared
    entry = build_module_kernel(sk.payload, sk.concrete(default_gpu_assignments(sk, SM90)[0]), "ansor_norm", SM90,
                                str(tmp_path))
    (launch,) = entry["launches"]
    assert launch["entry"] == "ansor_norm_kernel" and launch["args"][-1] == 2  # writes the result, not argument 1
    assert (tmp_path / "ansor_norm.cubin").read_bytes()[:4] == b"\x7fELF"
