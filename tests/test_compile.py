"""Whole-module compilation: partition, driver, best records, CLI."""

from __future__ import annotations

import ctypes
import importlib
import json
import math
import sqlite3

import numpy as np
import pytest
from conftest import INPUTS
from mlir import ir

import mlir_ansor
from mlir_ansor import TuneConfig, tune
from mlir_ansor.graph.task import extract_tasks, partition
from mlir_ansor.ir.program import load
from mlir_ansor.measure.runner import (
    ALIGNMENT,
    TimingPolicy,
    aligned_copy,
    aligned_empty,
    aligned_full,
    descriptor,
)
from mlir_ansor.tools.cli import main

compile_mod = importlib.import_module("mlir_ansor.compiler")

FAST = TimingPolicy(warmup=1, min_repeat=2, max_repeat=5, min_time_s=0.005)


def _inputs(cm, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, size=s).astype(np.float32 if d == "f32" else np.float64) for s, d in cm.functions[cm.entry][0]]


def test_partition_maps_values_between_occurrences():
    program = load(str(INPUTS / "two_matmuls.mlir"))
    occs = partition(program)
    assert [o.task.name for o in occs] == ["matmul_32x64x64_f32", "matmul_32x64x64_f32", "matmul_32x16x64_f32"]
    assert occs[0].task is occs[1].task and occs[0].task.weight == 2
    fn_args = list(program.module.body.operations[0].regions[0].blocks[0].arguments)
    assert occs[0].args == (fn_args[0], fn_args[1])
    # the second matmul reads the first one's result
    assert occs[1].args[0] == occs[0].results[0] and occs[1].args[1] == fn_args[2]
    assert all(o.ops[-1].name == "linalg.matmul" and not o.on_memref for o in occs)
    assert [t.workload_key for t in extract_tasks(program)] == [occs[0].task.workload_key, occs[2].task.workload_key]


def test_compile_untuned_defaults_match_reference_and_numpy():
    cm = mlir_ansor.compile(str(INPUTS / "two_matmuls.mlir"), threads=2)
    ref = compile_mod.compile_untuned(str(INPUTS / "two_matmuls.mlir"))
    x, w1, w2, w3 = _inputs(cm)
    out = cm(x, w1, w2, w3)
    # the default schedules reassociate the sums (values reach 100)
    np.testing.assert_allclose(out, ref(x, w1, w2, w3), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(out, ((x @ w1) @ w2) @ w3, rtol=1e-4, atol=1e-4)
    assert {k.source for k in cm.kernels} == {"default"}
    # the scheduled MLIR holds one kernel per distinct task and the driver
    assert cm.mlir.count("func.func @ansor_") == 2 and "call @ansor_matmul_32x64x64_f32" in cm.mlir
    # the library's C ABI: inputs, then the output, as memref descriptors
    lib = ctypes.CDLL(cm.library_path)
    c = np.full((32, 16), np.nan, dtype=np.float32)
    descs = [descriptor(a) for a in (x, w1, w2, w3, c)]
    lib._mlir_ciface_mlp(*[ctypes.byref(d) for d in descs])
    np.testing.assert_allclose(c, out, rtol=1e-6)
    # bind's copies and outputs start on cache lines, whatever numpy gave
    unaligned = []
    for a in (x, w1, w2, w3):
        raw = np.zeros(a.nbytes + 80, np.uint8)
        start = (16 - raw.ctypes.data) % 64 or 64  # 16 bytes past a cache line
        u = raw[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
        u[...] = a
        assert u.ctypes.data % ALIGNMENT == 16
        unaligned.append(u)
    run, (o,) = cm.bind(*unaligned)
    run()
    assert o.ctypes.data % ALIGNMENT == 0
    np.testing.assert_allclose(o, out, rtol=1e-6)


def test_calls_take_any_array_and_return_fresh_outputs():
    """A call passes aligned C-contiguous inputs of the right type as they
    are and copies the others (views, other dtypes, misaligned); each call
    has outputs of its own (the descriptors are set up once per function)."""
    cm = mlir_ansor.compile(str(INPUTS / "two_matmuls.mlir"))
    x, w1, w2, w3 = (aligned_copy(a) for a in _inputs(cm))
    want = ((x @ w1) @ w2) @ w3
    first = cm(x, w1, w2, w3)
    np.testing.assert_allclose(first, want, rtol=1e-4, atol=1e-4)
    x2 = x * 2
    second = cm(np.asfortranarray(x2), w1.astype(np.float64), w2, w3[:, :])
    assert second is not first
    np.testing.assert_allclose(second, 2 * want, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(first, want, rtol=1e-4, atol=1e-4)  # untouched by the second call


def _past_a_cache_line(a: np.ndarray, offset: int, *, writeable: bool = True) -> np.ndarray:
    """A copy of `a` whose data starts `offset` bytes past a cache line."""
    raw = np.empty(a.nbytes + 2 * ALIGNMENT, np.uint8)
    out = np.ndarray(a.shape, a.dtype, raw, offset + (-raw.ctypes.data % ALIGNMENT))
    out[...] = a
    out.setflags(write=writeable)
    return out


def _count_copies(monkeypatch) -> list:
    """The arrays `compiler.aligned_copy` is called on, from now on."""
    copies = []
    real_copy = compile_mod.aligned_copy
    monkeypatch.setattr(compile_mod, "aligned_copy", lambda a, dtype=None: copies.append(a) or real_copy(a, dtype))
    return copies


def test_calls_pass_aligned_arrays_as_they_are_and_copy_the_rest(monkeypatch):
    """The call made for a signature (`CallPlan._fast_call`) copies only
    what the kernel cannot read in place: a misaligned, read-only-but-
    misaligned or list argument is copied; an aligned one, read-only too,
    is not; every result is right and each call's output is its own."""
    cm = mlir_ansor.compile(str(INPUTS / "two_matmuls.mlir"))
    x, w1, w2, w3 = (aligned_copy(a) for a in _inputs(cm))
    want = ((x @ w1) @ w2) @ w3
    # copies of misaligned arguments pay here (`copy_pays`; the test below has both cases)
    monkeypatch.setattr(compile_mod, "MISALIGNED_SHARE", 1e9)
    copies = _count_copies(monkeypatch)
    frozen = aligned_copy(w2)
    frozen.setflags(write=False)
    first = cm(x, w1, frozen, w3)
    assert copies == []
    np.testing.assert_allclose(first, want, rtol=1e-4, atol=1e-4)
    shifted = _past_a_cache_line(w1, 4)
    frozen_shifted = _past_a_cache_line(w1, 4, writeable=False)
    second = cm(x.tolist(), shifted, w2, w3)
    assert len(copies) == 2
    third = cm(x, frozen_shifted, w2, w3)
    assert len(copies) == 3
    for got in (second, third):
        assert got is not first
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert first.ctypes.data % ALIGNMENT == 0 and first.flags["C_CONTIGUOUS"] and first.flags["WRITEABLE"]
    with pytest.raises(mlir_ansor.AnsorError, match="takes 4 argument"):
        cm(x, w1)


def test_the_last_calls_arrays_are_checked_again_when_passed_again():
    """The call keeps the data pointer of each argument it last passed as it
    was (a weak reference): the same arrays again are read where they are,
    written in between or not; an array whose shape was set in place since
    is refused, and a new array after the old one was freed is read anew."""
    cm = mlir_ansor.compile(str(INPUTS / "two_matmuls.mlir"))
    x, w1, w2, w3 = (aligned_copy(a) for a in _inputs(cm))
    np.testing.assert_allclose(cm(x, w1, w2, w3), ((x @ w1) @ w2) @ w3, rtol=1e-4, atol=1e-4)
    x *= 2  # in place: the same buffer
    np.testing.assert_allclose(cm(x, w1, w2, w3), ((x @ w1) @ w2) @ w3, rtol=1e-4, atol=1e-4)
    square = w2.shape
    w2.shape = (w2.size,)
    with pytest.raises(mlir_ansor.AnsorError, match="argument 2 has shape"):
        cm(x, w1, w2, w3)
    w2.shape = square
    for seed in range(3):  # each x freed before the next is made, often at the same address
        shape = x.shape
        del x
        x = aligned_copy(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))
        np.testing.assert_allclose(cm(x, w1, w2, w3), ((x @ w1) @ w2) @ w3, rtol=1e-4, atol=1e-4)
    # read-only weights are passed as they are, and kept the same way
    frozen = [aligned_copy(w3), aligned_copy(-w3)]
    for f in frozen:
        f.setflags(write=False)
    for f in frozen + frozen:
        np.testing.assert_allclose(cm(x, w1, w2, f), ((x @ w1) @ w2) @ f, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("expected_s, copied", [(1.0, 4), (1e-9, 0)])
def test_misaligned_arguments_are_copied_only_where_the_copy_pays(monkeypatch, expected_s, copied):
    """An argument 16 bytes past a cache line (where numpy puts its buffers)
    is copied to an aligned one when the call's kernels take long beside the
    copy (`compiler.copy_pays`), and read where it is when they do not (the
    weights of a small-M GEMM took 3.5x its kernel to copy); either way the
    results are right."""
    cm = mlir_ansor.compile(str(INPUTS / "two_matmuls.mlir"))
    arrays = [aligned_copy(a) for a in _inputs(cm)]
    want = ((arrays[0] @ arrays[1]) @ arrays[2]) @ arrays[3]
    shifted = [_past_a_cache_line(a, 16) for a in arrays]
    copies = _count_copies(monkeypatch)
    plan = compile_mod.CallPlan(cm._kernel(cm.entry), *cm.functions[cm.entry], expected_s=expected_s, name=cm.entry)
    for _ in range(2):
        got = plan.call(*shifted)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert len(copies) == 2 * copied
    # what the module expects its default kernels to take: their flops at the fallback rate
    assert compile_mod.expected_seconds(cm.kernels) == pytest.approx(
        sum(k.task.flops * k.task.weight for k in cm.kernels) / compile_mod.FALLBACK_FLOPS_PER_S
    )


def test_aligned_buffers():
    for shape, dtype in [((3, 5), np.float32), ((7,), np.float64), ((), np.int32), ((0, 4), np.float32)]:
        e = aligned_empty(shape, dtype)
        assert e.shape == shape and e.dtype == dtype and e.flags["C_CONTIGUOUS"]
        assert e.ctypes.data % ALIGNMENT == 0 or e.size == 0
    a = np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2]  # not contiguous
    c = aligned_copy(a, np.float32)
    assert c.ctypes.data % ALIGNMENT == 0 and c.dtype == np.float32 and c.flags["C_CONTIGUOUS"]
    np.testing.assert_array_equal(c, a)
    f = aligned_full((2, 3), np.float32, np.nan)
    assert f.ctypes.data % ALIGNMENT == 0 and f.dtype == np.float32 and np.isnan(f).all()


def test_weights_reshape_reduction_and_two_results():
    path = str(INPUTS / "mini_net.mlir")
    cm = mlir_ansor.compile(path)
    ref = compile_mod.compile_untuned(path)
    (x,) = _inputs(cm)
    got, want = cm(x), ref(x)
    assert [g.shape for g in got] == [(2, 4, 8), (8,)]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    assert "memref.global" in cm.mlir  # the weights stay constants of the library
    naive = mlir_ansor.compile(path, default="naive")
    assert {k.source for k in naive.kernels} == {"naive"}
    for g, w in zip(naive(x), want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_memref_function_returns_written_arguments():
    path = str(INPUTS / "matmul_memref.mlir")
    cm = mlir_ansor.compile(path)
    a, b, c = _inputs(cm)
    c_before = c.copy()
    out = cm(a, b, c)
    np.testing.assert_allclose(out, a @ b, rtol=1e-10)
    np.testing.assert_array_equal(c, c_before)  # the caller's array is untouched


@pytest.mark.parametrize(
    "op, out_shape, want",
    [
        ("linalg.transpose ins(%a : memref<4x6xf32>) outs(%out : memref<6x4xf32>) permutation = [1, 0]", (6, 4), np.transpose),
        ("linalg.map { math.exp } ins(%a : memref<4x6xf32>) outs(%out : memref<4x6xf32>)", (4, 6), np.exp),
    ],
)
def test_memref_function_returns_named_outputs(tmp_path, op, out_shape, want):
    # transpose and map name their output (no operand segments); the compiled
    # function and the untuned reference must still return the argument they
    # write.
    out_type = "memref<{}xf32>".format("x".join(map(str, out_shape)))
    src = tmp_path / "named.mlir"
    src.write_text(f"func.func @f(%a: memref<4x6xf32>, %out: {out_type}) {{\n  {op}\n  return\n}}\n")
    a = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    for cm in (mlir_ansor.compile(str(src)), compile_mod.compile_untuned(str(src))):
        assert cm.functions["f"][2] == [1]
        np.testing.assert_allclose(cm(a, np.zeros(out_shape, np.float32)), want(a), rtol=1e-5)


@pytest.mark.slow
def test_best_record_is_applied(tmp_path):
    db = tmp_path / "t.db"
    cfg = TuneConfig(trials=3, batch_size=3, build_workers=2, timing=FAST)
    result = tune(str(INPUTS / "matmul.mlir"), config=cfg, db=db)
    (r,) = result.tasks
    cm = mlir_ansor.compile(str(INPUTS / "matmul.mlir"), db=db)
    (k,) = cm.kernels
    assert k.source == "tuned" and k.knobs == r.best_knobs and k.trials == 3
    a, b = _inputs(cm)
    np.testing.assert_allclose(cm(a, b), a @ b, rtol=1e-4, atol=1e-4)
    # another thread count has no record: the default schedule
    cm2 = mlir_ansor.compile(str(INPUTS / "matmul.mlir"), db=db, threads=2)
    assert cm2.kernels[0].source == "default"
    # A record of an earlier form of the sketch (its hash no longer made,
    # as after `fuse_epilogue` changed the payloads): its knobs still apply.
    with sqlite3.connect(db) as con:
        con.execute("UPDATE records SET sketch_hash = 'earlier'")
    cm3 = mlir_ansor.compile(str(INPUTS / "matmul.mlir"), db=db, cache_dir=False)
    (k,) = cm3.kernels
    assert k.source == "tuned" and k.knobs == r.best_knobs and k.origin == "an earlier form of its sketch"
    np.testing.assert_allclose(cm3(a, b), a @ b, rtol=1e-4, atol=1e-4)


def test_a_record_that_copied_b_in_panels_applies_read_in_place(tmp_path, caplog):
    """The rules no longer offer the copy of a B already in column panels
    (session 45). A record tuned when they did (its sketch's hash, and a
    "pack" knob) still applies: its other knobs, B read in place, and the
    log says which choice it made that the sketch no longer offers."""
    import logging

    from conftest import PANELS_MATMUL

    from mlir_ansor.records import Database, Record
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.sketch import default_assignment
    from mlir_ansor.target import Target

    target = Target.host()
    src = tmp_path / "p.mlir"
    src.write_text(PANELS_MATMUL.format(m=16, p=4))
    (task,) = extract_tasks(str(src))
    (sk,) = [s for s in generate_sketches(task.mlir, target) if s.name == "cpu-contraction"]
    assert "pack" not in {k.name for k in sk.knobs}
    knobs = dict(default_assignment(sk, 1)) | {"pack": 0}
    db = tmp_path / "t.db"
    with Database(str(db)) as d:
        d.commit_record(Record(task.workload_key, target.key, "earlier", tuple(sorted(knobs.items())), (1e-5,), "none",
                               host=target.model, threads=1))
    with caplog.at_level(logging.INFO, logger="mlir_ansor"):
        cm = mlir_ansor.compile(str(src), db=db, cache_dir=False)
    (k,) = cm.kernels
    assert k.source == "tuned" and k.origin == "an earlier form of its sketch"
    assert dict(k.knobs) == {n: v for n, v in knobs.items() if n != "pack"}
    assert "but pack = 0, which it no longer offers" in caplog.text
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((16, 64)).astype(np.float32), rng.standard_normal((4, 64, 32)).astype(np.float32)
    np.testing.assert_allclose(cm(x, w), np.einsum("mk,pkn->mpn", x, w), rtol=1e-4, atol=1e-4)


def test_default_assignment_gives_threads_work():
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.sketch import default_assignment
    from mlir_ansor.target import Target

    (task,) = extract_tasks(str(INPUTS / "matmul.mlir"))
    sk = generate_sketches(task.mlir, Target.host())[-1]
    assert sk.parallelism(default_assignment(sk, 1)) == 1
    assert sk.parallelism(default_assignment(sk, 4)) >= 4


def test_cli_compile_and_run(tmp_path, capsys, monkeypatch):
    import mlir_ansor.compiler as compiler

    path = str(INPUTS / "mini_net.mlir")
    out_mlir = tmp_path / "m.mlir"
    with monkeypatch.context() as m:  # the scheduled MLIR needs no code generation
        m.setattr(compiler, "lower_and_link", lambda *a, **k: pytest.fail("compile -o X.mlir generated code"))
        assert main(["compile", path, "--db", str(tmp_path / "none.db"), "-o", str(out_mlir)]) == 0
    assert "func.func @net" in out_mlir.read_text() and "ansor_matmul" in out_mlir.read_text()
    assert not (tmp_path / "none.db").exists()  # compile never creates a database
    assert main(["compile", path, "-o", str(tmp_path / "bad.txt")]) == 2
    capsys.readouterr()
    assert main(["run", path, "--db", str(tmp_path / "none.db"), "--repeat", "2", "--json", "--reference", "untuned"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["ok"] and res["latency_s"] > 0 and res["untuned_latency_s"] > 0
    assert res["untuned_repeat"] == 2  # a tiny module: timed as often as asked, within a second
    assert [t["name"] for t in res["tasks"]] == ["matmul_8x8x16_f32_add_relu", "reduction_8x8_f32", "div_8x8_f32"]
    assert {"workload_key", "flops", "weight", "trials", "best_latency_s", "gflops", "baseline_latency_s"} <= set(res["tasks"][0])


def test_wrong_argument_shape_is_an_error():
    cm = mlir_ansor.compile(str(INPUTS / "matmul.mlir"), default="naive")
    with pytest.raises(mlir_ansor.AnsorError, match="shape"):
        cm(np.zeros((2, 2), np.float32), np.zeros((2, 2), np.float32))


def test_a_record_made_before_partial_rows_offered_the_copy_of_b_applies_reading_it_in_place(tmp_path):
    """Until session 50 a contraction with partial rows (100, not a multiple
    of 8) had no "pack" knob: B was read in place. Such a record (its
    sketch's hash no longer made) applies to today's sketch with "pack" 1,
    and gives numpy's answer."""
    from mlir_ansor.examples import workloads
    from mlir_ansor.records import Database, Record
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.sketch import default_assignment
    from mlir_ansor.target import Target

    target = Target.host()
    src = tmp_path / "m.mlir"
    src.write_text(workloads.matmul(100, 256, 64))
    (task,) = extract_tasks(str(src))
    sk = next(s for s in generate_sketches(task.mlir, target) if s.name == "cpu-contraction")
    assert "pack" in {k.name for k in sk.knobs}
    knobs = {k: v for k, v in default_assignment(sk, 1) if k != "pack"} | {"r_d0": 4}
    db = tmp_path / "t.db"
    with Database(str(db)) as d:
        d.commit_record(Record(task.workload_key, target.key, "earlier", tuple(sorted(knobs.items())), (1e-5,), "none",
                               host=target.model, threads=1))
    cm = mlir_ansor.compile(str(src), db=db, cache_dir=False)
    (k,) = [k for k in cm.kernels if "matmul" in k.task.name]
    assert k.source == "tuned" and k.origin == "an earlier form of its sketch"
    assert dict(k.knobs) == knobs | {"pack": 1}
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((100, 64)).astype(np.float32), rng.standard_normal((64, 256)).astype(np.float32)
    np.testing.assert_allclose(cm(a, b), a @ b, rtol=1e-4, atol=1e-4)
    cm.close()


@pytest.mark.parametrize("element", ["f32", "bf16"])
def test_the_scheduled_text_has_the_weights_the_library_was_built_with(element):
    """A compiled module keeps no MLIR context alive for its `mlir` (a
    dynamic module compiles one per size; with the context, each kept every
    copy of the weights): the weights kept out of LLVM come back from their
    files, with their type, as the values of their globals."""
    import gc
    import weakref

    import ml_dtypes
    from mlir import ir

    rng = np.random.default_rng(3)
    w = rng.standard_normal((128, 256)).astype(np.float32)  # 128 KiB: kept out of LLVM
    if element == "bf16":
        w = w.astype(ml_dtypes.bfloat16)
    with ir.Context():
        et = ir.F32Type.get() if element == "f32" else ir.BF16Type.get()
        bits = w.view(np.uint32 if element == "f32" else np.uint16)
        dense = ir.DenseElementsAttr.get(bits, type=et, shape=list(w.shape))
    text = f"""
    func.func @main(%x: tensor<4x128x{element}>) -> tensor<4x256x{element}> {{
      %w = arith.constant {dense}
      %c0 = arith.constant 0.0 : {element}
      %e = tensor.empty() : tensor<4x256x{element}>
      %f = linalg.fill ins(%c0 : {element}) outs(%e : tensor<4x256x{element}>) -> tensor<4x256x{element}>
      %r = linalg.matmul ins(%x, %w : tensor<4x128x{element}>, tensor<128x256x{element}>)
                         outs(%f : tensor<4x256x{element}>) -> tensor<4x256x{element}>
      return %r : tensor<4x256x{element}>
    }}"""
    program = load(text=text)
    cm = mlir_ansor.compile(program, cache_dir=False)
    gone = weakref.ref(program.context)
    del program
    gc.collect()
    assert gone() is None  # nothing of the compile holds the input's context (and its weights)
    x = rng.standard_normal((4, 128)).astype(np.float32).astype(w.dtype)
    np.testing.assert_allclose(np.asarray(cm(x), np.float32), x.astype(np.float32) @ w.astype(np.float32),
                               rtol=2e-2 if element == "bf16" else 1e-5, atol=2e-2 if element == "bf16" else 1e-4)
    with ir.Context():
        module = ir.Module.parse(cm.mlir)
        found = []
        for op in module.body.operations:
            op = op.operation
            if op.name == "memref.global" and "initial_value" in op.attributes:
                attr = ir.DenseElementsAttr(op.attributes["initial_value"])
                if math.prod(ir.ShapedType(attr.type).shape) == w.size:
                    raw = bytes.fromhex(str(attr).split('"')[1][2:]) if element == "bf16" else np.array(attr).tobytes()
                    found.append(np.frombuffer(raw, dtype=w.dtype))
    (values,) = found  # the weights, in the layout the kernel reads (column panels): the same values
    np.testing.assert_array_equal(np.sort(values.astype(np.float32)), np.sort(w.astype(np.float32).ravel()))


@pytest.mark.parametrize("init", ["argument", "constant"])
def test_a_peeled_register_tile_reads_the_init_it_starts_from(init):
    """A 1x1 convolution of 104 -> 26 channels on a 1x1 image that adds to
    an init (a bias): the default register tile is 16 channels, so the last
    10 are peeled and read their accumulators from the first part's result.
    Bufferization gave the read-only init a buffer of its own without
    copying it there (`compiler._copy_read_inits`), and those 10 channels
    came out as garbage (RegNet-Y's squeeze-excitation was 0.4% off)."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((1, 1, 104, 26)).astype(np.float32)
    b = rng.standard_normal((1, 1, 1, 26)).astype(np.float32)
    x = rng.standard_normal((1, 1, 1, 104)).astype(np.float32)
    with ir.Context():
        dw, db = str(ir.DenseElementsAttr.get(w)), str(ir.DenseElementsAttr.get(b))
    bias = f"%b = arith.constant {db}" if init == "constant" else ""
    barg = ", %b: tensor<1x1x1x26xf32>" if init == "argument" else ""
    text = f"""
    func.func @f(%x: tensor<1x1x1x104xf32>{barg}) -> tensor<1x1x1x26xf32> {{
      %w = arith.constant {dw}
      {bias}
      %r = linalg.conv_2d_nhwc_hwcf {{dilations = dense<1> : tensor<2xi64>, strides = dense<1> : tensor<2xi64>}}
          ins(%x, %w : tensor<1x1x1x104xf32>, tensor<1x1x104x26xf32>) outs(%b : tensor<1x1x1x26xf32>) -> tensor<1x1x1x26xf32>
      return %r : tensor<1x1x1x26xf32>
    }}"""
    cm = mlir_ansor.compile(mlir_ansor.load(text=text), cache_dir=False)
    got = cm(x) if init == "constant" else cm(x, b)
    np.testing.assert_allclose(got, b + (x.reshape(1, 104) @ w.reshape(104, 26)).reshape(b.shape), rtol=1e-5, atol=1e-5)
    assert [k.source for k in cm.kernels] == ["default"] and "memref.copy %arg2, %alloc" in cm.mlir
