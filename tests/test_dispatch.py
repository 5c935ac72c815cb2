"""One library for a function with dynamic dimensions (`mlir_ansor.dispatch`):
specializations behind a dispatch in MLIR, exact, padded, blocked and generic paths,
the saved library loaded again, and `compile` on the command line."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import INPUTS

import mlir_ansor
from mlir_ansor import dispatch
from mlir_ansor.dispatch import (
    Blocks,
    Case,
    DynamicLibrary,
    build_library,
    plan_blocks,
    plan_cases,
    tuned_sizes,
)
from mlir_ansor.errors import InputError
from mlir_ansor.target import Target
from mlir_ansor.tools.cli import main

# Dynamic M times a static 64x64.
GEMM = """
func.func @gemm(%A: tensor<?x64xf32>, %B: tensor<64x64xf32>) -> tensor<?x64xf32> {
  %c0 = arith.constant 0 : index
  %cst = arith.constant 0.0 : f32
  %m = tensor.dim %A, %c0 : tensor<?x64xf32>
  %e = tensor.empty(%m) : tensor<?x64xf32>
  %z = linalg.fill ins(%cst : f32) outs(%e : tensor<?x64xf32>) -> tensor<?x64xf32>
  %r = linalg.matmul ins(%A, %B : tensor<?x64xf32>, tensor<64x64xf32>) outs(%z : tensor<?x64xf32>) -> tensor<?x64xf32>
  return %r : tensor<?x64xf32>
}
"""


@pytest.fixture(scope="module")
def library():
    lib = build_library(mlir_ansor.load(text=GEMM), sizes={(0, 0): (16, 64)}, cache_dir=False)
    yield lib
    lib.close()


def _inputs(m: int, seed: int = 0):
    rng = np.random.default_rng(seed + m)
    return rng.standard_normal((m, 64)).astype(np.float32), rng.standard_normal((64, 64)).astype(np.float32)


def test_the_table_has_exact_sizes_first_then_padded_ranges():
    made = [("f__0_0_16", {(0, 0): 16}), ("f__0_0_64", {(0, 0): 64})]
    cases = plan_cases([[(0, 0)]], [True], made, pad_work=1.15)
    assert cases == [Case("exact", "f__0_0_16", (16,), (16,)), Case("exact", "f__0_0_64", (64,), (64,)),
                     Case("padded", "f__0_0_16", (16,), (14,)), Case("padded", "f__0_0_64", (64,), (56,))]
    # 56 * 1.15 >= 64 > 55 * 1.15
    assert cases[3].takes((56,)) and not cases[3].takes((55,)) and not cases[3].takes((65,))
    assert plan_cases([[(0, 0)]], [False], made) == cases[:2]  # not paddable: exact sizes only


def test_the_blocked_plan_covers_the_rows_at_the_least_cost():
    # 100 rows at 16 and 64: 64 + 16 + 16 + 4 padded to 16 (112 rows, 4
    # calls) before 64 + 36 padded to 64 (128 rows, 2 calls) at 4 rows a
    # call; at 8 they tie, and the fewer calls win
    assert plan_blocks(100, (16, 64)) == Blocks(((64, 1), (16, 2)), 4, 16)
    assert plan_blocks(100, (16, 64), call_rows=8) == Blocks(((64, 1),), 36, 64)
    # 333 at 16, 64, 256: not 256 + 77 padded to 256 (54% more work)
    assert plan_blocks(333, (16, 64, 256)) == Blocks(((256, 1), (64, 1)), 13, 16)
    # few rows: one padded call, not 7 calls of a 1-row schedule
    assert plan_blocks(7, (1, 16, 64)) == Blocks((), 7, 16)
    assert plan_blocks(2000, (16, 64)) == Blocks(((64, 31),), 16, 16)
    assert plan_blocks(2000, (16, 64)).label() == "31 x 64 + 16 exact"
    for m in range(1, 300):
        plan = plan_blocks(m, (16, 64, 256))
        assert sum(t * q for t, q in plan.blocks) + plan.rest == m and 0 <= plan.cover - plan.rest < 64


@pytest.mark.parametrize("m, path, runs_at, label", [
    (16, "exact", 16, None), (64, "exact", 64, None),     # specialised
    (60, "padded", 64, None), (14, "padded", 16, None),   # within 15% below one
    # none near: whole blocks and the rest padded
    (100, "blocked", 64, "0.0=100: 1 x 64 + 2 x 16 + 4 padded to 16"),
    (129, "blocked", 64, "0.0=129: 2 x 64 + 1 padded to 16"),
    (200, "blocked", 64, "0.0=200: 3 x 64 + 8 padded to 16"),
    (37, "blocked", 16, "0.0=37: 2 x 16 + 5 padded to 16"),
    (50, "blocked", 64, "0.0=50: 50 padded to 64"),
    (1, "blocked", 16, "0.0=1: 1 padded to 16"),
    (7, "blocked", 16, "0.0=7: 7 padded to 16"),
    (143, "blocked", 64, "0.0=143: 2 x 64 + 15 padded to 16"),
    (144, "blocked", 64, "0.0=144: 2 x 64 + 16 exact"),
])
def test_each_size_runs_its_path_and_matches_numpy(library, m, path, runs_at, label):
    a, b = _inputs(m)
    out = library(a, b)
    assert out.shape == (m, 64)
    np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-4)
    chosen = library.dispatch(a, b)
    assert chosen["path"] == path and chosen["sizes"] == {(0, 0): runs_at}
    assert chosen["function"] == f"gemm__0_0_{runs_at}"
    assert chosen.get("label") == label


def test_the_library_chooses_the_blocks_plan_blocks_does(library):
    """``@gemm__block``, the choice in MLIR, agrees with `plan_blocks` at
    every size the table leaves to it."""
    for m in range(1, 400):
        chosen = library.dispatch_at((m,))
        if chosen["path"] == "blocked":
            assert chosen["blocks"] == plan_blocks(m, (16, 64)), m
        else:
            assert m in (14, 15, 16) or 56 <= m <= 64


# Elementwise on 8 x N: the dynamic dimension is the inner one.
SCALE = """
func.func @scale(%A: tensor<8x?xf32>, %B: tensor<8x?xf32>) -> tensor<8x?xf32> {
  %c1 = arith.constant 1 : index
  %n = tensor.dim %A, %c1 : tensor<8x?xf32>
  %e = tensor.empty(%n) : tensor<8x?xf32>
  %r = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>,
                                        affine_map<(i, j) -> (i, j)>],
      iterator_types = ["parallel", "parallel"]} ins(%A, %B : tensor<8x?xf32>, tensor<8x?xf32>)
      outs(%e : tensor<8x?xf32>) {
  ^bb0(%x: f32, %y: f32, %o: f32):
    %z = arith.mulf %x, %y : f32
    linalg.yield %z : f32
  } -> tensor<8x?xf32>
  return %r : tensor<8x?xf32>
}
"""


def test_ranged_cases_take_the_rows_nearest_each_tuned_size():
    assert dispatch.ranged_cases([(24, "b"), (8, "a"), (1024, "c")]) == [
        Case("ranged", "a", (13,), (1,)), Case("ranged", "b", (156,), (14,)),
        Case("ranged", "c", (dispatch.ROWS_PROBE,), (157,))]
    assert dispatch.ranged_cases([(16, "a")]) == [Case("ranged", "a", (dispatch.ROWS_PROBE,), (1,))]
    assert Case("ranged", "a", (13,), (1,)).label([[(0, 0)]]) == "0.0=1..13 on dynamic rows"


@pytest.mark.parametrize("memref, memcpy", [
    ("memref<?x64xf32>", True),  # identity layouts, any shape
    ("memref<4x?xf32>", True),
    ("memref<64x64xf32, strided<[64, 1], offset: ?>>", True),  # a whole block of rows
    ("memref<?x64xf32, strided<[64, 1], offset: ?>>", False),  # a dynamic count of rows
    ("memref<8x16xf32, strided<[64, 1], offset: ?>>", False),  # a block of columns
])
def test_copies_that_lower_to_memcpy(memref, memcpy):
    from mlir import ir

    with ir.Context():
        assert dispatch._memcpy(memref) is memcpy


def test_blocks_of_an_inner_dimension():
    """Blocks of columns (strided views of the arguments, not whole rows)."""
    lib = build_library(mlir_ansor.load(text=SCALE), sizes={(0, 1): (4, 16)}, cache_dir=False)
    assert lib.blocks == (4, 16)
    rng = np.random.default_rng(5)
    for m, label in ((3, "0.1=3: 3 padded to 4"), (37, "0.1=37: 2 x 16 + 1 x 4 + 1 padded to 4"),
                     (100, "0.1=100: 6 x 16 + 4 exact")):
        a, b = (rng.standard_normal((8, m)).astype(np.float32) for _ in range(2))
        np.testing.assert_array_equal(lib(a, b), a * b)
        assert lib.dispatch(a, b)["label"] == label
    lib.close()


def test_the_dispatch_is_mlir_in_the_module(library):
    text = library.mlir
    entry = text[text.index("func.func @gemm(") :]
    assert entry.startswith("func.func @gemm(%arg0: memref<?x64xf32>, %arg1: memref<64x64xf32>, %arg2: memref<?x64xf32>)")
    assert "memref.dim %arg0" in entry and "scf.index_switch" in entry and "call @gemm__case" in entry
    assert "func.call @gemm__0_0_16(" in entry and "cf.assert" in entry  # the output's rows are the input's
    # the default case is the blocked path: the smallest block size, a loop
    # over whole blocks of each size (64 first), copied through static
    # buffers, then a switch on the size the rest runs at
    default = entry[entry.index("default {") :]
    assert default.index("call @gemm__block(") < default.index("scf.for") < default.index("call @gemm__cover(")
    loop = default[default.index("scf.for") :]
    loop = loop[: loop.index("\n      }\n")]
    assert "step %c64" in loop and "memref.subview %arg0[%arg3, 0] [64, 64] [1, 1]" in loop
    assert "func.call @gemm__0_0_64(" in loop and loop.count("memref.copy") == 2
    rest = default[default.index("call @gemm__cover(") :]
    assert "scf.index_switch" in rest and "case 16 {" in rest and "case 64 {" in rest
    # the rest is a dynamic count of rows: copied in and out by loops
    # (linalg.copy), not by memref.copy, which calls the C runtime's
    # element-at-a-time memrefCopy on a strided view of dynamic size
    rest = rest[: rest.index("default {")]
    assert "memref.copy" not in rest and rest.count("linalg.copy ins(%subview") == 2
    # a padded case copies whole arrays of identity layout: memcpy
    cases = entry[: entry.index("default {")]
    assert cases.count("memref.copy %arg0, %cast") == 2 and "linalg.copy" not in cases
    assert "func.call @gemm__generic(" not in entry
    assert 'ansor.dispatch = ["0: 0.0=16 exact", "1: 0.0=64 exact", "2: 0.0=14..16 padded", "3: 0.0=56..64 padded"]' in text
    # the generic path is the function itself, on dynamic shapes, its
    # matmul in tiles whose last one is masked (they need not divide)
    generic = text[text.index("func.func @gemm__generic(%arg0: memref<?x64xf32>") :]
    generic = generic[: generic.index("\n  }\n")]
    assert "scf.for" in generic and "vector.create_mask" in generic
    assert library.to_json()["dispatch"][-1] == "else blocked in 16, 64"


def test_inputs_the_function_does_not_take_are_errors(library):
    a, b = _inputs(8)
    with pytest.raises(InputError, match=r"argument 1 has shape \(32, 64\), expected 64x64"):
        library(a, b[:32])
    with pytest.raises(InputError, match="takes 2 argument"):
        library(a)
    with pytest.raises(InputError, match="at least 1"):
        library(a[:0], b)


def test_a_call_is_set_up_once_per_shape_and_takes_any_array(library, monkeypatch):
    """Calls at shapes seen before reuse their set-up (descriptors and a
    straight-line call), which must not keep anything of the previous call:
    each result is right for its own inputs, whatever their order, type,
    alignment or dtype; a shape is still checked the first time it comes;
    and the set-ups kept are bounded."""
    monkeypatch.setattr(dispatch, "PLANS_KEPT", 3)
    library.close()
    for m in (5, 16, 5, 100, 16, 5):
        a, b = _inputs(m)
        np.testing.assert_allclose(library(a, b), a @ b, rtol=2e-5, atol=2e-5)
    assert len(library._plans) == 3
    a, b = _inputs(7, seed=1)
    misaligned = np.empty(a.size + 1, np.float32)[1:].reshape(a.shape)
    misaligned[...] = a
    for args in ((misaligned, b), (a.tolist(), b), (a.astype(np.float64), b), (a, np.asfortranarray(b))):
        np.testing.assert_allclose(library(*args), a @ b, rtol=2e-5, atol=2e-5)
    with pytest.raises(InputError, match=r"argument 1 has shape \(32, 64\), expected 64x64"):
        library(a, b[:32])
    assert library._plans, "a failed call left the set-ups as they were"


def test_tied_dimensions_that_differ_are_an_error():
    """The rows of A and of C (the matmul's d0) are one symbol: A with 5
    rows and C with 6 is refused before the call, which would abort on the
    library's own cf.assert."""
    lib = build_library(str(INPUTS / "dynamic.mlir"), sizes={(0, 0): (8,)}, cache_dir=False)
    rng = np.random.default_rng(3)
    b = rng.standard_normal((64, 32)).astype(np.float32)
    with pytest.raises(InputError, match=r"dimensions 0\.0=5, 2\.0=6 are one dimension"):
        lib(np.zeros((5, 64), np.float32), b, np.zeros((6, 32), np.float32))
    for m, path in ((8, "exact"), (7, "padded"), (3, "blocked"), (21, "blocked")):
        a = rng.standard_normal((m, 64)).astype(np.float32)
        c = rng.standard_normal((m, 32)).astype(np.float32)
        np.testing.assert_allclose(lib(a, b, c), c + a @ b, rtol=1e-4, atol=1e-4)
        assert lib.dispatch(a, b, c)["path"] == path
    lib.close()


def test_a_saved_library_loads_and_runs(library, tmp_path):
    path = tmp_path / "gemm.so"
    side = library.save(path)
    assert json.loads(open(side).read())["entry"] == "gemm"
    again = DynamicLibrary.load(path)
    assert again.blocks == (16, 64)
    for m, path_kind in ((60, "padded"), (37, "blocked"), (16, "exact"), (129, "blocked")):
        a, b = _inputs(m, seed=1)
        np.testing.assert_allclose(again(a, b), a @ b, rtol=1e-4, atol=1e-4)
        assert again.dispatch(a, b)["path"] == path_kind
    assert again.dispatch_at({(0, 0): 57})["sizes"] == {(0, 0): 64}
    assert again.dispatch_at((129,))["label"] == "0.0=129: 2 x 64 + 1 padded to 16"
    with pytest.raises(InputError, match="side file"):
        DynamicLibrary.load(tmp_path / "missing.so")


# Sums the rows: a reduction runs over the dynamic dimension, which is not paddable.
COLUMN_SUM = (INPUTS / "column_sum_dynamic.mlir").read_text()


@pytest.mark.parametrize("source, pad", [(COLUMN_SUM, True), (GEMM, False)])
def test_no_blocks_where_rows_cannot_be_split(source, pad):
    """Rows a reduction runs over, or `pad=False`: the sizes not
    specialised take the generic path, not blocks."""
    lib = build_library(mlir_ansor.load(text=source), sizes={(0, 0): (16,)}, pad=pad, cache_dir=False)
    assert lib.blocks == () and f"{lib.entry}__block" not in lib.mlir and lib.to_json()["dispatch"][-1] == "else generic"
    rng = np.random.default_rng(4)
    for m, path in ((16, "exact"), (37, "generic")):
        a = rng.standard_normal((m, 32 if source is COLUMN_SUM else 64)).astype(np.float32)
        args = (a,) if source is COLUMN_SUM else (a, _inputs(1)[1])
        want = a.sum(axis=0) if source is COLUMN_SUM else a @ args[1]
        np.testing.assert_allclose(lib(*args), want, rtol=1e-4, atol=1e-4)
        assert lib.dispatch(*args)["path"] == path
    lib.close()


def test_without_sizes_only_the_generic_path():
    lib = build_library(mlir_ansor.load(text=GEMM), sizes={}, cache_dir=False)
    assert lib.cases == [] and "scf.index_switch" in lib.mlir
    a, b = _inputs(16)
    np.testing.assert_allclose(lib(a, b), a @ b, rtol=1e-4, atol=1e-4)
    assert lib.dispatch(a, b)["path"] == "generic"


def test_compile_finds_the_tuned_sizes_in_the_records(tmp_path, capsys):
    """`tune --sizes` at 8 and 24, then `compile` with no --sizes: the
    library specialises those two (found from the records) and 16 between
    them on a schedule carried over from a tuned size, runs the other rows
    on kernels on dynamic rows (each tuned size's record carried to a row
    loop of any extent), writes the dispatch into the MLIR and the library,
    and the saved .so runs; with the sizes given, it specialises just those
    and runs the other rows in blocks."""
    src = tmp_path / "gemm.mlir"
    src.write_text(GEMM)
    db = str(tmp_path / "g.db")
    assert main(["tune", str(src), "--sizes", "0.0=8,24", "--trials", "2", "--batch-size", "2", "--db", db,
                 "--progress", "none", "--retime-rounds", "0"]) == 0
    assert tuned_sizes(GEMM, None, db, Target.host()) == {(0, 0): (8, 24)}
    out = tmp_path / "g.mlir"
    assert main(["compile", str(src), "--db", db, "-o", str(out)]) == 0
    text = out.read_text()
    assert "scf.index_switch" in text and all(f"@gemm__0_0_{m}(" in text for m in (8, 16, 24))
    assert ("dispatch: 0.0=8 exact; 0.0=16 exact; 0.0=24 exact; 0.0=7..8 padded; 0.0=14..16 padded; "
            "0.0=21..24 padded; 0.0=1..13 on dynamic rows; 0.0=14..1000003 on dynamic rows; else generic"
            in capsys.readouterr().err)
    for m in (8, 24):  # the tuned schedule (threads, FMAs), the rows past its register tiles one by one
        rows = text[text.index(f"func.func @gemm__rows_{m}(%arg0: memref<?x64xf32>") :]
        rows = rows[: rows.index("\n  }\n")]
        assert "scf.forall" in rows and "vector.fma" in rows and "vector.create_mask" not in rows
        # computed in the output argument, not in a buffer copied there
        assert "memref.alloc(%" not in rows and "memref.copy" not in rows
    lib = build_library(mlir_ansor.load(text=GEMM), db=db, cache_dir=False)
    assert sorted((k.task.name, k.source) for k in lib.kernels) == [
        ("matmul_16x64x64_f32", "transferred"), ("matmul_24x64x64_f32", "tuned"), ("matmul_8x64x64_f32", "tuned")]
    assert main(["compile", str(src), "--db", db, "--sizes", "0.0=8,24", "-o", str(out)]) == 0
    assert "else blocked in 8, 24)" in capsys.readouterr().err
    so = tmp_path / "g.so"
    assert main(["compile", str(src), "--db", db, "-o", str(so)]) == 0
    lib = DynamicLibrary.load(so)
    for m, path in ((24, "exact"), (22, "padded"), (1, "ranged"), (5, "ranged"), (13, "ranged"), (50, "ranged"),
                    (101, "ranged")):
        a, b = _inputs(m, seed=2)
        np.testing.assert_allclose(lib(a, b), a @ b, rtol=1e-4, atol=1e-4)
        assert lib.dispatch(a, b)["path"] == path
    assert lib.dispatch(*_inputs(13))["function"] == "gemm__rows_8" and lib.dispatch(*_inputs(14))["function"] == "gemm__0_0_16"
    assert lib.dispatch(*_inputs(50))["label"] == "0.0=50: on dynamic rows, gemm__rows_24"


def test_a_record_that_copied_b_runs_on_dynamic_rows_reading_it_in_place(tmp_path):
    """Dynamic rows make every thread tile of rows of a dynamic size, where
    the copy of B does not build (`Sketch.requires`): the kernel on dynamic
    rows takes the tuned size's record that read B in place, or, where the
    best copied it, that record reading B in place."""
    from mlir_ansor.graph.dynamic import parse_sizes, specializations
    from mlir_ansor.records import Database, Record
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.sketch import default_assignment

    target = Target.host()
    wide = GEMM.replace("%B: tensor<64x64xf32>", "%B: tensor<64x256xf32>").replace("tensor<64x64xf32>) outs", "tensor<64x256xf32>) outs")
    wide = wide.replace("tensor<?x64xf32> {", "tensor<?x256xf32> {").replace("tensor.empty(%m) : tensor<?x64xf32>",
                                                                           "tensor.empty(%m) : tensor<?x256xf32>")
    wide = wide.replace("outs(%e : tensor<?x64xf32>) -> tensor<?x64xf32>", "outs(%e : tensor<?x256xf32>) -> tensor<?x256xf32>")
    wide = wide.replace("outs(%z : tensor<?x64xf32>) -> tensor<?x64xf32>", "outs(%z : tensor<?x256xf32>) -> tensor<?x256xf32>")
    wide = wide.replace("return %r : tensor<?x64xf32>", "return %r : tensor<?x256xf32>")
    text, _ = specializations(wide, parse_sizes(["0.0=24"]), keep_name=True)
    (task,) = [t for t in mlir_ansor.extract_tasks(mlir_ansor.load(text=text)) if "matmul" in t.name]
    sk = next(s for s in generate_sketches(task.mlir, target) if s.name == "cpu-contraction")
    copied = tuple((k, 0 if k == "pack" else 24 if k == "p_d0" else v) for k, v in default_assignment(sk, 1))
    assert dict(copied)["pack"] == 0 and sk.violation(copied) is None
    db = str(tmp_path / "c.db")
    with Database(db) as d:
        d.add_workload(task.workload_key, task.name, task.mlir, task.flops)
        d.commit_record(Record(task.workload_key, target.key, sk.hash, copied, (1e-6,), "none", host=target.model, threads=1))
    lib = build_library(mlir_ansor.load(text=wide), db=db, threads=1, cache_dir=False)
    rng = np.random.default_rng(3)
    b = rng.standard_normal((64, 256)).astype(np.float32)
    for m in (24, 50, 7):
        a = rng.standard_normal((m, 64)).astype(np.float32)
        np.testing.assert_allclose(lib(a, b), a @ b, rtol=1e-4, atol=1e-4)
        assert lib.dispatch(a, b)["function"] == ("gemm__0_0_24" if m == 24 else "gemm__rows_24")
    lib.close()
