"""Dynamic dimensions: symbols, static specializations, and `--sizes` on
the command line (tune at several sizes, run and compile one)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import INPUTS
from mlir import ir

import mlir_ansor
from mlir_ansor.errors import InputError, UnsupportedError
from mlir_ansor.graph.dynamic import parse_sizes, specializations, symbols
from mlir_ansor.records.database import Database
from mlir_ansor.tools.cli import main

# Dynamic M: tensor.dim, tensor.empty(%m), a fill, the matmul and a ReLU.
GEMM = """
func.func @gemm(%A: tensor<?x32xf32>, %B: tensor<32x16xf32>) -> tensor<?x16xf32> {
  %c0 = arith.constant 0 : index
  %cst = arith.constant 0.0 : f32
  %m = tensor.dim %A, %c0 : tensor<?x32xf32>
  %e = tensor.empty(%m) : tensor<?x16xf32>
  %z = linalg.fill ins(%cst : f32) outs(%e : tensor<?x16xf32>) -> tensor<?x16xf32>
  %r = linalg.matmul ins(%A, %B : tensor<?x32xf32>, tensor<32x16xf32>) outs(%z : tensor<?x16xf32>) -> tensor<?x16xf32>
  %relu = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>],
      iterator_types = ["parallel", "parallel"]} ins(%r : tensor<?x16xf32>) outs(%e : tensor<?x16xf32>) {
  ^bb0(%x: f32, %o: f32):
    %y = arith.maximumf %x, %cst : f32
    linalg.yield %y : f32
  } -> tensor<?x16xf32>
  return %relu : tensor<?x16xf32>
}
"""


def test_parse_sizes_and_its_errors():
    assert parse_sizes(["0.0=1,16,64", "1.1=8"]) == {(0, 0): (1, 16, 64), (1, 1): (8,)}
    assert parse_sizes("0.0=3;2.1=4") == {(0, 0): (3,), (2, 1): (4,)}
    assert parse_sizes("0.0=..1024") == {(0, 0): (1, 4, 16, 64, 256, 1024)}
    assert parse_sizes(["0.0=..384", "1.1=..1"]) == {(0, 0): (1, 4, 16, 64, 256, 384), (1, 1): (1,)}
    for bad in (["0=4"], ["0.0="], ["0.0=0"], ["a.b=1"], [], ["0.0=..0"], ["0.0=.."], ["0.0=1,..4"]):
        with pytest.raises(InputError, match="--sizes"):
            parse_sizes(bad)


def test_tied_dimensions_are_one_symbol():
    with ir.Context():
        module = ir.Module.parse((INPUTS / "dynamic.mlir").read_text())
        # A's rows and C's rows are both the matmul's loop d0.
        assert symbols(module) == [[(0, 0), (2, 0)]]


def test_specializations_are_static_and_named_by_size():
    text, made = specializations(GEMM, parse_sizes(["0.0=1,7"]))
    assert [name for name, _ in made] == ["gemm__0_0_1", "gemm__0_0_7"]
    assert "?" not in text and "tensor.dim" not in text
    assert "func.func @gemm__0_0_7(%arg0: tensor<7x32xf32>, %arg1: tensor<32x16xf32>) -> tensor<7x16xf32>" in text
    one, made = specializations((INPUTS / "dynamic.mlir").read_text(), parse_sizes(["2.0=5"]), keep_name=True)
    assert made == [("dyn", {(0, 0): 5, (2, 0): 5})]
    assert "tensor<5x64xf32>" in one and "tensor<5x32xf32>" in one


def test_sizes_that_do_not_name_a_symbol_are_errors():
    with pytest.raises(InputError, match=r"1\.0: not a dynamic dimension"):
        specializations(GEMM, parse_sizes(["1.0=4"]))
    with pytest.raises(InputError, match="are one dimension"):
        specializations((INPUTS / "dynamic.mlir").read_text(), parse_sizes(["0.0=4", "2.0=4"]))
    with pytest.raises(InputError, match="no function with dynamic dimensions"):
        specializations((INPUTS / "matmul.mlir").read_text(), parse_sizes(["0.0=4"]))


def test_tune_at_sizes_then_run_and_compile_one(tmp_path, capsys):
    src = tmp_path / "gemm.mlir"
    src.write_text(GEMM)
    db = str(tmp_path / "g.db")
    # ..9: a spread of sizes up to 9, the powers of 4 below it and 9
    assert main(["tune", str(src), "--sizes", "0.0=..9", "--trials", "4", "--batch-size", "2", "--db", db,
                 "--progress", "none", "--json"]) == 0
    tuned = json.loads(capsys.readouterr().out)
    shapes = {t["name"] for t in tuned["tasks"]}
    assert all(any(f"_{m}x16x32" in n for n in shapes) for m in (1, 4, 9)), shapes
    with Database(db) as d:
        names = {w["name"] for w in d.workloads()}
    assert all(any(f"_{m}x16x32" in n for n in names) for m in (1, 4, 9)), names
    # A tuned size and one between them, each checked against its untuned build.
    for size in (9, 6):
        assert main(["run", str(src), "--sizes", f"0.0={size}", "--db", db, "--repeat", "2", "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["ok"] and out["function"] == "gemm"
    so = tmp_path / "g9.so"  # --static: the one size's own library (without it: a dispatch, test_dispatch.py)
    assert main(["compile", str(src), "--sizes", "0.0=9", "--static", "--db", db, "-o", str(so)]) == 0
    assert so.exists()
    # The specialized file is kept beside the database's cache, named by its text.
    assert list((tmp_path / "g.db.cache" / "sized").glob("gemm-*.mlir"))


def test_the_sizes_between_are_measured_on_carried_schedules(tmp_path):
    """`tune --sizes 0.0=1,16` also specialises 2, 4 and 8, the sizes a
    library specialises between them (`dispatch.sizes_to_tune`), and names
    their functions for `TuneConfig.carry`: those tasks are not searched;
    when the search ends each measures its default point and its
    neighbours' best, carried, within the trials of the run (a quarter at
    most), and the re-timing times them in turns."""
    from mlir_ansor.dispatch import sizes_to_tune
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.sketch import default_assignment
    from mlir_ansor.target import Target
    from mlir_ansor.tuner import CARRIED_PER_TASK

    sized, made, carry = sizes_to_tune(GEMM, parse_sizes(["0.0=1,16"]))
    assert [v[(0, 0)] for _, v in made] == [1, 16, 2, 4, 8]  # the named sizes first
    assert carry == ("gemm__0_0_2", "gemm__0_0_4", "gemm__0_0_8")
    assert sizes_to_tune(GEMM, parse_sizes(["0.0=1,16"]), between=False)[2] == ()
    db = str(tmp_path / "c.db")
    config = mlir_ansor.TuneConfig(trials=24, batch_size=3, threads=1, carry=carry, retime_rounds=1)
    result = mlir_ansor.tune(mlir_ansor.load(text=sized), config=config, db=db)
    trials = {t.task.func_name: t.trials for t in result.tasks if "matmul" in t.task.name}
    assert sum(trials.values()) <= 24 and result.measured <= 24
    assert trials["gemm__0_0_1"] > CARRIED_PER_TASK and trials["gemm__0_0_16"] > CARRIED_PER_TASK, trials
    # 24 trials keep 6 for the carried tasks, 3 at most each (fewer where a
    # neighbour's best, carried, is the default point or the other's)
    carried = [trials[f"gemm__0_0_{m}"] for m in (2, 4, 8)]
    assert sum(carried) <= 6 and max(carried) <= CARRIED_PER_TASK and carried[0] >= 1, trials
    target = Target.host()
    (two,) = [t.task for t in result.tasks if t.task.func_name == "gemm__0_0_2" and "matmul" in t.task.name]
    sketch = generate_sketches(two.mlir, target)[0]
    with Database(db) as d:
        recs = [r for r in d.records(two.workload_key, target.key) if not r.retime]
        assert len(recs) == carried[0] and all(r.valid for r in recs)
        assert len({(r.sketch_hash, r.knobs) for r in recs}) == len(recs)
        assert tuple(recs[0].knobs) == tuple(default_assignment(sketch, 1))  # the default point first
        assert d.best(two.workload_key, target.key)  # and the re-timing ranked them


def test_compile_of_a_dynamic_module_runs_any_size():
    """`compile` returns a DynamicModule: each new size compiles its
    specialization once, and a call at shapes seen before goes straight to
    it; tied dimensions of other sizes are an error."""
    dm = mlir_ansor.compile(str(INPUTS / "dynamic.mlir"))
    assert isinstance(dm, mlir_ansor.compiler.DynamicModule) and dm.symbols == [[(0, 0), (2, 0)]]
    rng = np.random.default_rng(0)
    b = rng.standard_normal((64, 32)).astype(np.float32)
    for m in (3, 1, 3):
        a = rng.standard_normal((m, 64)).astype(np.float32)
        c = rng.standard_normal((m, 32)).astype(np.float32)
        np.testing.assert_allclose(dm(a, b, c), c + a @ b, rtol=1e-4, atol=1e-4)
    assert dm.sizes == [{(0, 0): 3, (2, 0): 3}, {(0, 0): 1, (2, 0): 1}]
    with pytest.raises(mlir_ansor.AnsorError, match="must have the same size"):
        dm(np.zeros((2, 64), np.float32), b, np.zeros((4, 32), np.float32))
    np.testing.assert_allclose(dm(a.tolist(), b, c), c + a @ b, rtol=1e-4, atol=1e-4)  # shapes seen before, a list
    dm.close()


def test_tasks_of_a_dynamic_module_say_how_to_give_sizes():
    with pytest.raises(mlir_ansor.AnsorError, match="--sizes"):
        mlir_ansor.tune(str(INPUTS / "dynamic.mlir"), config=mlir_ansor.TuneConfig(trials=1))


def test_run_takes_one_size_per_dimension(tmp_path, capsys):
    assert main(["run", str(INPUTS / "dynamic.mlir"), "--sizes", "0.0=4,8", "--db", str(tmp_path / "x.db")]) == 2
    assert "one size per dimension" in capsys.readouterr().err


def test_specialized_module_computes_the_matmul():
    text, _ = specializations(GEMM, parse_sizes(["0.0=5"]), keep_name=True)
    cm = mlir_ansor.compile(mlir_ansor.load(text=text))
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 32)).astype(np.float32)
    b = rng.standard_normal((32, 16)).astype(np.float32)
    np.testing.assert_allclose(cm(a, b), np.maximum(a @ b, 0), rtol=1e-4, atol=1e-4)


# The rows reduced (a column sum): padding them would add the pad rows in.
COLUMN_SUM = (INPUTS / "column_sum_dynamic.mlir").read_text()


def test_only_dimensions_every_op_keeps_apart_are_paddable():
    from mlir_ansor.graph.dynamic import paddable

    sliced = GEMM.replace("return %relu : tensor<?x16xf32>",
                          "%s = tensor.extract_slice %relu[1, 0] [4, 16] [1, 1] : tensor<?x16xf32> to tensor<4x16xf32>\n"
                          "  return %s : tensor<4x16xf32>").replace("-> tensor<?x16xf32> {\n  %c0", "-> tensor<4x16xf32> {\n  %c0")
    with ir.Context():
        assert paddable(ir.Module.parse(GEMM)) == [True]  # rows: parallel in the matmul and the ReLU
        assert paddable(ir.Module.parse((INPUTS / "dynamic.mlir").read_text())) == [True]
        assert paddable(ir.Module.parse(COLUMN_SUM)) == [False]  # a reduction runs over them
        assert paddable(ir.Module.parse(sliced)) == [False]  # a slice could move rows


def test_untuned_odd_sizes_run_padded_on_request_and_give_the_exact_rows():
    """Untuned sizes run as they are (`compile`); with pad=True, a size
    that is not a multiple of 8 runs at the next one (at most 15% more
    rows, more than 16), on zero-padded inputs, and returns its own rows;
    a column sum is never padded."""
    dm = mlir_ansor.compiler.DynamicModule(mlir_ansor.load(text=GEMM), entry=None, pad=True)
    rng = np.random.default_rng(1)
    b = rng.standard_normal((32, 16)).astype(np.float32)
    for m, padded in ((30, 32), (100, 104), (7, None), (15, None), (3, None), (16, None)):
        a = rng.standard_normal((m, 32)).astype(np.float32)
        got = dm(a, b)
        assert got.shape == (m, 16) and got.flags.c_contiguous
        np.testing.assert_allclose(got, np.maximum(a @ b, 0), rtol=1e-4, atol=1e-4)
        assert dm.padded_sizes(a, b) == ({(0, 0): padded} if padded else None)
    assert {(0, 0): 104} in dm.sizes and {(0, 0): 100} not in dm.sizes and {(0, 0): 7} in dm.sizes
    dm.close()
    exact = mlir_ansor.compile(mlir_ansor.load(text=GEMM))
    a = rng.standard_normal((30, 32)).astype(np.float32)
    np.testing.assert_allclose(exact(a, b), np.maximum(a @ b, 0), rtol=1e-4, atol=1e-4)
    assert exact.padded_sizes(a, b) is None and exact.sizes == [{(0, 0): 30}]
    exact.close()
    cs = mlir_ansor.compiler.DynamicModule(mlir_ansor.load(text=COLUMN_SUM), entry=None, pad=True)
    a = rng.standard_normal((7, 32)).astype(np.float32)
    np.testing.assert_allclose(cs(a), a.sum(axis=0), rtol=1e-4, atol=1e-4)
    assert cs.padded_sizes(a) is None
    cs.close()


def test_torch_export_with_a_dynamic_sequence_length(torch, tmp_path, capsys):
    """A BERT layer exported with ``Dim`` (torch-mlir's view shapes computed
    from ``tensor.dim``, reshaped through ``tensor.reshape``): one symbol,
    static at every size, and the compiled module at two sizes gives torch's
    output at those sizes."""
    from mlir_ansor.examples.models import BertLayer, dynamic_shapes
    from mlir_ansor.importers.pytorch import import_module

    torch.manual_seed(0)
    model = BertLayer(hidden=64, heads=2, ffn=128).eval()
    example = (torch.randn(1, 16, 64),)
    text = import_module(model, example, dynamic_shapes=dynamic_shapes(example, ["0.1"]))
    assert "tensor<1x?x64xf32>" in text and "tensor.reshape" in text
    program = mlir_ansor.load(text=text)
    with program.context:
        assert symbols(program.module) == [[(0, 1)]]
    cm = mlir_ansor.compile(program)
    for seq in (16, 37):
        x = torch.randn(1, seq, 64, generator=torch.Generator().manual_seed(seq))
        with torch.no_grad():
            want = model(x).numpy()
        out = cm(x.numpy())
        assert out.shape == (1, seq, 64)
        assert np.max(np.abs(out - want)) / np.max(np.abs(want)) < 1e-5
    path = tmp_path / "bert_dyn.mlir"
    path.write_text(text)
    assert main(["run", str(path), "--db", str(tmp_path / "none.db"), "--sizes", "0.1=23", "--json",
                 "--repeat", "1", "--reference", "numpy"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["ok"] and res["reference"] == "numpy evaluation"


def _weighted_gemm_text(w: np.ndarray) -> str:
    """A GEMM of dynamic rows against the constant `w` (128 KiB: kept out of LLVM)."""
    with ir.Context():
        dense = ir.DenseElementsAttr.get(w)
    return f"""
    func.func @main(%x: tensor<?x128xf32>) -> tensor<?x256xf32> {{
      %c0 = arith.constant 0 : index
      %w = arith.constant {dense}
      %zero = arith.constant 0.0 : f32
      %m = tensor.dim %x, %c0 : tensor<?x128xf32>
      %e = tensor.empty(%m) : tensor<?x256xf32>
      %f = linalg.fill ins(%zero : f32) outs(%e : tensor<?x256xf32>) -> tensor<?x256xf32>
      %r = linalg.matmul ins(%x, %w : tensor<?x128xf32>, tensor<128x256xf32>) outs(%f : tensor<?x256xf32>) -> tensor<?x256xf32>
      return %r : tensor<?x256xf32>
    }}"""


def test_the_sizes_of_a_dynamic_module_share_one_library_of_its_weights(tmp_path):
    """Each size's library links against one library of the weights, found
    by their bytes (kept in the compile cache's folder), instead of holding
    a copy; a library of them deleted is built again."""
    import os

    from mlir_ansor import compiler

    rng = np.random.default_rng(4)
    w = rng.standard_normal((128, 256)).astype(np.float32)
    text = _weighted_gemm_text(w)
    cache = tmp_path / "cache"
    dm = mlir_ansor.compile(mlir_ansor.load(text=text), cache_dir=cache)
    libs = set()
    for m in (3, 8, 3):
        x = rng.standard_normal((m, 128)).astype(np.float32)
        np.testing.assert_allclose(dm(x), x @ w, rtol=1e-5, atol=1e-4)
        cm = dm.specialization(x)
        libs.add(cm.weights_library)
        assert os.path.getsize(cm.library_path) < w.nbytes  # the weights are not in it
    (shared,) = libs
    assert shared is not None and os.path.dirname(shared) == str(cache / "weights")
    assert os.path.getsize(shared) > w.nbytes
    # Another dynamic module of the same text: a size compiled before comes whole from the cache (named
    # by its text), with the same library; a new size finds the library. Other weights get their own.
    again = mlir_ansor.compile(mlir_ansor.load(text=text), cache_dir=cache)
    x8 = rng.standard_normal((8, 128)).astype(np.float32)
    np.testing.assert_allclose(again(x8), x8 @ w, rtol=1e-5, atol=1e-4)
    assert again.specialization(x8).cache_stats.get("module_hit") == 1
    assert again.specialization(x8).weights_library == shared
    x = rng.standard_normal((5, 128)).astype(np.float32)
    np.testing.assert_allclose(again(x), x @ w, rtol=1e-5, atol=1e-4)
    assert again.specialization(x).weights_library == shared
    assert again.specialization(x).cache_stats.get("module_hit", 0) == 0
    other = mlir_ansor.compile(mlir_ansor.load(text=_weighted_gemm_text(2 * w)), cache_dir=cache)
    np.testing.assert_allclose(other(x), x @ (2 * w), rtol=1e-5, atol=1e-4)
    assert other.specialization(x).weights_library not in (None, shared)
    np.testing.assert_allclose(dm(x), x @ w, rtol=1e-5, atol=1e-4)  # each module reads its own weights
    # The library deleted with the cache's folder: the next size builds it again, and a size whose
    # whole compile names it is a miss of the cache, built again.
    os.unlink(shared)
    x = rng.standard_normal((6, 128)).astype(np.float32)
    np.testing.assert_allclose(dm(x), x @ w, rtol=1e-5, atol=1e-4)
    assert os.path.exists(dm.specialization(x).weights_library)
    os.unlink(shared)
    compiler._SHARED_WEIGHTS.clear()
    third = mlir_ansor.compile(mlir_ansor.load(text=text), cache_dir=cache)
    np.testing.assert_allclose(third(x8), x8 @ w, rtol=1e-5, atol=1e-4)
    assert third.specialization(x8).cache_stats.get("module_hit", 0) == 0
    assert os.path.exists(third.specialization(x8).weights_library)
    without = mlir_ansor.compile(mlir_ansor.load(text=text), cache_dir=False)  # no cache: a folder of the process
    np.testing.assert_allclose(without(x), x @ w, rtol=1e-5, atol=1e-4)
    assert without.specialization(x).weights_library in compiler._SHARED_WEIGHTS.values()


def test_attention_on_a_kv_cache_of_dynamic_length(torch):
    """A decoder's attention step: the new tokens' keys and values joined to
    the cache's (``torch.cat``: a ``tensor.concat`` whose length is the sum
    of two symbols). Each specialization gives the concatenation its static
    type, and the module computes torch's outputs at sizes of both."""
    from torch.export import Dim

    from mlir_ansor.importers.pytorch import import_module

    class CachedAttention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(32, 32) for _ in range(3))

        def forward(self, x, past_k, past_v):
            k = torch.cat([past_k, self.k(x)], dim=1)
            v = torch.cat([past_v, self.v(x)], dim=1)
            scores = torch.softmax(self.q(x) @ k.transpose(1, 2) / 4.0, dim=-1)
            return scores @ v, k, v

    torch.manual_seed(0)
    model = CachedAttention().eval()
    example = (torch.randn(1, 4, 32), torch.randn(1, 10, 32), torch.randn(1, 10, 32))
    new, past = Dim("new", min=1, max=64), Dim("past", min=1, max=1024)
    text = import_module(model, example, dynamic_shapes=({1: new}, {1: past}, {1: past}))
    assert "tensor.concat" in text and "-> tensor<1x?x32xf32>" in text
    # The cache's keys and values share torch.export's symbol: one dimension, though no op ties them.
    assert 'ansor.same_dims = ["1.1=2.1"]' in text
    program = mlir_ansor.load(text=text)
    with program.context:
        assert sorted(symbols(program.module)) == [[(0, 1)], [(1, 1), (2, 1)]]
    cm = mlir_ansor.compile(program, cache_dir=False)
    for n, p in ((1, 10), (3, 17)):
        g = torch.Generator().manual_seed(n * 100 + p)
        args = (torch.randn(1, n, 32, generator=g), torch.randn(1, p, 32, generator=g), torch.randn(1, p, 32, generator=g))
        with torch.no_grad():
            want = model(*args)
        out = cm(*(a.numpy() for a in args))
        assert [o.shape for o in out] == [(1, n, 32), (1, n + p, 32), (1, n + p, 32)]
        for o, w in zip(out, want):
            np.testing.assert_allclose(o, w.numpy(), rtol=1e-5, atol=1e-5)
    # Keys and values of different lengths: the gather of the values would read past their end.
    x, k, v = (np.zeros((1, n, 32), np.float32) for n in (2, 10, 11))
    with pytest.raises(InputError, match=r"dimensions 1.1=10, 2.1=11 are one dimension"):
        cm(x, k, v)
    # More new tokens than the export's Dim allows (max=64).
    assert 'ansor.dim_ranges = ["0.1=1..64", "1.1=1..1024", "2.1=1..1024"]' in text
    x, k, v = (np.zeros((1, n, 32), np.float32) for n in (65, 10, 10))
    with pytest.raises(InputError, match=r"dimension 0.1 is 65, outside 1..64, the sizes the function allows"):
        cm(x, k, v)


@pytest.mark.parametrize("same, error", [('["0.0=1.0"]', None), ('["0.1=1.0"]', r"names 0.1, not a dynamic dimension"),
                                         ('["0.0"]', r"entry '0.0' is not like"), ("[1]", r"must be an array of strings")])
def test_a_function_may_state_dimensions_that_are_one_size(same, error):
    """``ansor.same_dims`` ties argument dimensions no op ties (here two
    halves of a concatenation), and a wrong entry is an error naming it."""
    text = f"""
    func.func @f(%a: tensor<?x8xf32>, %b: tensor<?x8xf32>) -> tensor<?x8xf32> attributes {{ansor.same_dims = {same}}} {{
      %r = tensor.concat dim(0) %a, %b : (tensor<?x8xf32>, tensor<?x8xf32>) -> tensor<?x8xf32>
      return %r : tensor<?x8xf32>
    }}"""
    with ir.Context():
        module = ir.Module.parse(text)
        if error is not None:
            with pytest.raises(InputError, match=error):
                symbols(module)
            return
        assert symbols(module) == [[(0, 0), (1, 0)]]
    specialized, _ = specializations(text, {(0, 0): (3,)}, keep_name=True)
    assert "-> tensor<6x8xf32>" in specialized and "tensor.concat dim(0) %arg0, %arg1 : (tensor<3x8xf32>, tensor<3x8xf32>)" in specialized


def test_a_function_its_ops_make_invalid_at_a_size_is_an_error_naming_the_cast():
    """An importer's cast of a dynamic extent to a fixed one (torch-mlir's,
    where the traced program assumed a size) makes the ops disagree at
    other sizes: an error naming the sizes, the disagreement and the cast."""
    text = """
    #id = affine_map<(d0, d1) -> (d0, d1)>
    func.func @f(%a: tensor<?x8xf32>) -> tensor<?x8xf32> {
      %c0 = arith.constant 0 : index
      %one = tensor.cast %a : tensor<?x8xf32> to tensor<1x8xf32>
      %n = tensor.dim %a, %c0 : tensor<?x8xf32>
      %e = tensor.empty(%n) : tensor<?x8xf32>
      %r = linalg.generic {indexing_maps = [#id, #id, #id], iterator_types = ["parallel", "parallel"]}
          ins(%one, %a : tensor<1x8xf32>, tensor<?x8xf32>) outs(%e : tensor<?x8xf32>) {
      ^bb0(%x: f32, %y: f32, %o: f32):
        %s = arith.addf %x, %y : f32
        linalg.yield %s : f32
      } -> tensor<?x8xf32>
      return %r : tensor<?x8xf32>
    }"""
    specializations(text, {(0, 0): (1,)})
    with pytest.raises(UnsupportedError, match=r"@f__0_0_3 is not valid at sizes 0.0=3: .*dimension #0 to be 1, but found 3; "
                                               r"the function casts a dynamic extent to a fixed one \(tensor<\?x8xf32> to tensor<1x8xf32>"):
        specializations(text, {(0, 0): (3,)})


@pytest.mark.parametrize("ranges, error", [('["0.0=4..", "1.0=4..16"]', None), ('["0.0=4"]', r"entry '0.0=4' is not like")])
def test_a_function_may_state_the_sizes_a_dimension_takes(ranges, error):
    """``ansor.dim_ranges``: a size outside is an error before anything is
    specialized; a malformed entry is an error naming it."""
    text = f"""
    func.func @f(%a: tensor<?x8xf32>, %b: tensor<?x8xf32>) -> tensor<?x8xf32> attributes {{ansor.dim_ranges = {ranges}}} {{
      %r = tensor.concat dim(0) %a, %b : (tensor<?x8xf32>, tensor<?x8xf32>) -> tensor<?x8xf32>
      return %r : tensor<?x8xf32>
    }}"""
    if error is not None:
        with pytest.raises(InputError, match=error):
            specializations(text, {(0, 0): (4,), (1, 0): (4,)})
        return
    specializations(text, {(0, 0): (4, 100), (1, 0): (16,)})
    with pytest.raises(InputError, match=r"@f__0_0_4_1_0_17: dimension 1.0 is 17, outside 4..16"):
        specializations(text, {(0, 0): (4,), (1, 0): (17,)})
    with pytest.raises(InputError, match=r"dimension 0.0 is 3, outside 4.."):
        specializations(text, {(0, 0): (3,), (1, 0): (4,)})
