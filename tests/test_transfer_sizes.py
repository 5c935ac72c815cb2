"""Schedules carried to the same task at other sizes (`search.transfer`):
the family of a task, knobs made valid for new extents, `compile` of an
untuned size, and the tuner's seeds."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import PANELS_MATMUL
from test_dynamic import GEMM

import mlir_ansor
from mlir_ansor import TuneConfig
from mlir_ansor.compiler import DynamicModule
from mlir_ansor.graph.dynamic import parse_sizes, specializations
from mlir_ansor.records.database import Database
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.search.sketch import default_assignment
from mlir_ansor.search.transfer import family_key, size_distance, transfer_knobs, transferred
from mlir_ansor.target import Target


def _task(m: int, dtype: str = "f32", n: int = 16):
    gemm = GEMM.replace("x16x", f"x{n}x").replace("x16>", f"x{n}>") if n != 16 else GEMM
    text, _ = specializations(gemm.replace("f32", dtype) if dtype != "f32" else gemm, parse_sizes([f"0.0={m}"]), keep_name=True)
    (task,) = [t for t in mlir_ansor.extract_tasks(mlir_ansor.load(text=text)) if "matmul" in t.name]
    return task


def test_a_family_is_the_task_without_its_sizes():
    a, b = _task(64), _task(100)
    assert a.workload_key != b.workload_key
    assert family_key(a.mlir) == family_key(b.mlir)
    assert family_key(a.mlir) != family_key(a.mlir.replace("arith.maximumf", "arith.minimumf"))
    assert family_key(a.mlir) != family_key(a.mlir.replace("xf32>", "xf64>"))
    # every dimension, not only the first: a sequence length is BERT's second
    add = "func.func @k(%a: tensor<1x{s}x768xf32>) -> tensor<1x{s}x768xf32> {{ return %a : tensor<1x{s}x768xf32> }}"
    assert family_key(add.format(s=100)) == family_key(add.format(s=128))
    assert family_key(add.format(s=100)) != family_key(add.format(s=100).replace("768xf32", "768xi32"))
    assert family_key("tensor<4xindex>") == family_key("tensor<8xindex>") != family_key("tensor<8xi64>")


def test_the_nearest_relative_is_nearest_in_every_extent():
    """A BERT layer's FFN out (K = 3072) and output projection (K = 768) are
    one family; at 100 rows FFN out is nearest to itself at 128 rows, not
    to the projection at 384 rows, whose flops are closer."""
    from mlir_ansor.examples import workloads

    ffn_out = lambda m: workloads.matmul(m, 768, 3072)  # noqa: E731
    proj = lambda m: workloads.matmul(m, 768, 768)  # noqa: E731
    assert family_key(ffn_out(100)) == family_key(proj(384))
    assert size_distance(ffn_out(100), ffn_out(128)) < size_distance(ffn_out(100), proj(384))
    assert size_distance(ffn_out(100), ffn_out(100)) == 0
    assert size_distance(ffn_out(100), ffn_out(128)) == pytest.approx(size_distance(ffn_out(128), ffn_out(100)))


def test_knobs_are_carried_to_the_options_of_other_extents():
    """Each knob of the new sketch gets an option of its own; a value the new
    extents allow (and no other knob constrains) is kept; knobs the old
    sketch lacks take a default, knobs the new one lacks are dropped."""
    target = Target.host()
    small = {sk.name: sk for sk in generate_sketches(_task(64).mlir, target)}
    odd = {sk.name: sk for sk in generate_sketches(_task(100).mlir, target)}
    carried = 0
    for name, sk in small.items():
        if name not in odd or not sk.knobs:
            continue
        new = {k.name: k for k in odd[name].knobs}
        for pick in (-1, 0):
            knobs = tuple((k.name, k.options[pick]) for k in sk.knobs) + (("no_such_knob", 4),)
            got = transfer_knobs(odd[name], knobs, source=sk)
            assert got is not None
            carried += 1
            assert odd[name].knob_problem(got) is None and {k for k, _ in got} == set(new)
            whole = {k for k, extent in sk.forall if dict(knobs)[k] >= extent}
            free = [k for k, v in knobs
                    if k in new and k not in whole and v in new[k].options and not (new[k].divides or new[k].multiple_of)]
            assert all(dict(got)[k] == dict(knobs)[k] for k in free)
    assert carried
    assert transfer_knobs(next(iter(odd.values())), (("no_such_knob", 4),)) is None


def test_a_parallel_tile_over_a_whole_loop_stays_whole():
    """One row tile at 64 rows is one row tile at 104 (not 52, the option
    nearest to 64, which split the rows in two with a 4-row remainder each);
    a tile of part of the loop goes to the nearest option."""
    from mlir_ansor.examples import workloads

    target = Target.host()
    sk = {m: generate_sketches(mlir_ansor.extract_tasks(mlir_ansor.load(text=workloads.matmul(m, 256, 128)))[0].mlir,
                               target)[0] for m in (64, 104)}
    assert dict(sk[64].forall)["p_d0"] == 64 and dict(sk[104].forall)["p_d0"] == 104
    knobs = dict(default_assignment(sk[64], 2))
    for p, want in ((64, 104), (32, 26)):
        knobs["p_d0"] = p
        got = dict(transfer_knobs(sk[104], tuple(knobs.items()), source=sk[64]))
        assert got["p_d0"] == want
        assert {k: v for k, v in got.items() if k != "p_d0"} == {k: v for k, v in knobs.items() if k != "p_d0"}
    # without its source sketch, the value alone: the nearest option
    knobs["p_d0"] = 64
    assert dict(transfer_knobs(sk[104], tuple(knobs.items())))["p_d0"] == 52


def test_an_even_split_that_would_leave_a_remainder_becomes_one_tile():
    """128 rows split in two thread tiles of 64, carried to 100 rows, would
    run tiles of 60 and 40 (1.13x the static module); with the columns
    keeping the threads busy it is one tile of 100 (0.99x), else the split
    stays; without a thread count, as before."""
    from mlir_ansor.examples import workloads

    zen4 = Target.cpu("znver4", cores=2)
    sk = {m: next(s for s in generate_sketches(mlir_ansor.extract_tasks(mlir_ansor.load(text=workloads.matmul(m, 1024, 1024)))[0].mlir,
                                               zen4) if s.name == "cpu-contraction") for m in (100, 128)}
    knobs = dict(default_assignment(sk[128], 2)) | {"p_d0": 64, "p_d1": 256, "r_d0": 6, "pack": 1, "k_d2": 128}
    carried = dict(transfer_knobs(sk[100], tuple(knobs.items()), source=sk[128], threads=2))
    assert carried["p_d0"] == 100 and carried["p_d1"] == 256
    one_column_tile = dict(transfer_knobs(sk[100], tuple((knobs | {"p_d1": 1024}).items()), source=sk[128], threads=2))
    assert one_column_tile["p_d0"] not in (100, 64) and one_column_tile["p_d0"] % 6 == 0  # still two tiles
    assert dict(transfer_knobs(sk[100], tuple(knobs.items()), source=sk[128]))["p_d0"] != 100


def test_a_default_point_is_carried_as_the_default_point_of_the_new_size():
    """A relative's default point, carried with the thread count it was
    made for, is the rule's choice made again at the new size (16 rows' 6 x
    4 vectors, in place, becomes 8 rows' 8 x 4); without the thread count,
    or for another point, its values are carried as they are."""
    from mlir_ansor.examples import workloads

    zen4 = Target.cpu("znver4", cores=2)
    sk = {m: generate_sketches(mlir_ansor.extract_tasks(mlir_ansor.load(text=workloads.matmul(m, 1024, 1024)))[0].mlir,
                               zen4)[0] for m in (8, 16)}
    mine, theirs = default_assignment(sk[8], 2), default_assignment(sk[16], 2)
    assert (dict(theirs)["r_d0"], dict(mine)["r_d0"]) == (6, 8)
    assert transfer_knobs(sk[8], theirs, source=sk[16], threads=2) == mine
    assert dict(transfer_knobs(sk[8], theirs, source=sk[16]))["r_d0"] == 6
    other = tuple((k, 2 if k == "u_d2" else v) for k, v in theirs)
    assert dict(transfer_knobs(sk[8], other, source=sk[16], threads=2))["r_d0"] == 6


@pytest.mark.slow
def test_an_untuned_size_compiles_with_its_tuned_neighbours_schedule(tmp_path):
    """Tuned at M = 64 only: a call at M = 100 compiles the matmul task with
    the schedule tuned at 64 (knobs carried to 100's options), and computes
    the right answer; the tuner seeds the new size's search with it."""
    text, _ = specializations(GEMM, parse_sizes(["0.0=64"]), keep_name=True)
    db = tmp_path / "g.db"
    mlir_ansor.tune(mlir_ansor.load(text=text), config=TuneConfig(trials=4, batch_size=2), db=db)
    target = Target.host()
    task = _task(100)
    sketches = generate_sketches(task.mlir, target)
    with Database(db) as d:
        ts = transferred(d, task, sketches, target, threads=1, prefer_host=target.model)
        assert ts and all(t.sketch.knob_problem(t.knobs) is None and "64x16x32" in t.source for t in ts)
    dm = mlir_ansor.compile(mlir_ansor.load(text=GEMM), db=db)  # 100 as 100
    rng = np.random.default_rng(0)
    a = rng.standard_normal((100, 32)).astype(np.float32)
    b = rng.standard_normal((32, 16)).astype(np.float32)
    np.testing.assert_allclose(dm(a, b), np.maximum(a @ b, 0), rtol=1e-4, atol=1e-4)
    (plan,) = [p for p in dm.specialization(a, b).kernels if "matmul" in p.task.name]
    assert plan.source == "transferred" and (plan.sketch_name, plan.knobs) == (ts[0].sketch.name, ts[0].knobs)
    # The tuned size itself keeps its own record.
    a64 = rng.standard_normal((64, 32)).astype(np.float32)
    (own,) = [p for p in dm.specialization(a64, b).kernels if "matmul" in p.task.name]
    assert own.source == "tuned"
    dm.close()
    # Padded (on request), 100 rows run as 104, carried from 64 too.
    padded = DynamicModule(mlir_ansor.load(text=GEMM), entry=None, db=db, pad=True)
    np.testing.assert_allclose(padded(a, b), np.maximum(a @ b, 0), rtol=1e-4, atol=1e-4)
    assert padded.padded_sizes(a, b) == {(0, 0): 104}
    (plan,) = [p for p in padded.specialization(a, b).kernels if "matmul" in p.task.name]
    assert plan.source == "transferred" and "64x16x32" in plan.origin
    padded.close()
    # Tuning M = 100 into the same database measures the carried schedule in its first batch.
    text100, _ = specializations(GEMM, parse_sizes(["0.0=100"]), keep_name=True)
    mlir_ansor.tune(mlir_ansor.load(text=text100), config=TuneConfig(trials=2, batch_size=2, default_candidate=False), db=db)
    with Database(db) as d:
        first = sorted((r for r in d.records(task.workload_key) if not r.retime), key=lambda r: r.timestamp)[:2]
    assert (ts[0].sketch.hash, ts[0].knobs) in {(r.sketch_hash, r.knobs) for r in first}  # in the first batch


def test_the_sizes_of_one_run_seed_each_other():
    """In one run (``tune --sizes``), the tasks of one family are relatives:
    each seeds the others' batches with its best (`TuneConfig.transfer`)."""
    from types import SimpleNamespace

    from mlir_ansor.tuner import _siblings

    target = Target.host()
    tasks = (_task(64), _task(100), _task(64, "f64"))
    states = [SimpleNamespace(task=t, sketches=generate_sketches(t.mlir, target)) for t in tasks]
    sib = _siblings(states, same_knobs=False, relatives=True)
    assert {j for j, _, _ in sib[0]} == {1} and {j for j, _, _ in sib[1]} == {0} and 2 not in sib
    assert all(theirs.name == mine.name for pairs in sib.values() for _, theirs, mine in pairs)
    assert not _siblings(states, same_knobs=False, relatives=False)


def test_partial_rows_offer_the_copy_of_b_unless_few_rows_stream_it(tmp_path):
    """At 100 rows (not a multiple of 8) cpu-contraction offers the copy of
    B ("pack") as at 104: a record of 128 rows that copied B is carried as
    it was (read in place, 256 rows' best ran 333 rows 2.07x as long). At 7
    rows streaming a large B there is no copy: B is read in place, "pack"
    1 (`Sketch.implied`), so a record of 8 rows that copied B is not one it
    makes as it is (`faithful`), and the relative's records it does make
    come first, slower or not."""
    from mlir_ansor.examples import workloads
    from mlir_ansor.records import Record
    from mlir_ansor.search.transfer import faithful

    zen4 = Target.cpu("znver4", cores=2)
    tasks = {m: mlir_ansor.extract_tasks(mlir_ansor.load(text=workloads.matmul(m, 1024, 1024)))[0] for m in (7, 8, 100)}
    sk = {m: next(s for s in generate_sketches(t.mlir, zen4) if s.name == "cpu-contraction") for m, t in tasks.items()}
    assert "pack" in {k.name for k in sk[100].knobs} and sk[100].implied == ()
    assert "pack" in {k.name for k in sk[8].knobs} and sk[8].implied == ()
    assert dict(sk[7].implied) == {"pack": 1} and "pack" not in {k.name for k in sk[7].knobs}
    in_place = default_assignment(sk[8], 2)
    assert dict(in_place)["pack"] == 1
    copied = tuple((k, 0 if k == "pack" else 2 if k == "r_d0" else v) for k, v in in_place)  # another register tile too
    assert faithful(sk[7], in_place) and not faithful(sk[7], copied) and faithful(sk[100], copied)
    with Database(str(tmp_path / "t.db")) as db:
        t8 = tasks[8]
        db.add_workload(t8.workload_key, t8.name, t8.mlir, t8.flops)
        for knobs, cost in ((in_place, 2e-5), (copied, 1e-5)):
            db.commit_record(Record(t8.workload_key, zen4.key, sk[8].hash, knobs, (cost,), "none", host=zen4.model, threads=2))
        first, second = transferred(db, tasks[7], [sk[7]], zen4, threads=2)
    assert first.source_latency_s == 2e-5 and first.knobs == default_assignment(sk[7], 2)  # 8's default point is 7's
    assert second.source_latency_s == 1e-5 and dict(second.knobs)["r_d0"] == 2 and "pack" not in dict(second.knobs)


def test_a_copy_of_b_already_in_panels_is_carried_as_a_read_in_place():
    """B laid out in column panels (`graph.prepack`'s ``[N / 32, K, 32]``)
    is read in place as contiguously as the packing copy lays it out: no
    sketch offers the copy there (session 45; it made BERT's weight
    matmuls 10-30% slower), and a record that copied it (made before) is
    carried as it is, read in place (BERT's FFN-out at 100 rows took a
    record 1.65x slower than the best of 128 rows before)."""
    from mlir_ansor.search.transfer import faithful

    target = Target.host()
    (sk100,) = [s for s in generate_sketches(PANELS_MATMUL.format(m=100, p=2), target) if s.name == "cpu-contraction"]
    (sk128,) = [s for s in generate_sketches(PANELS_MATMUL.format(m=128, p=2), target) if s.name == "cpu-contraction"]
    assert "pack" not in {k.name for k in sk100.knobs} | {k.name for k in sk128.knobs}
    assert sk100.implied == () and sk128.implied == ()
    copied = tuple(sorted([(k.name, k.options[0]) for k in sk128.knobs] + [("pack", 0)]))
    assert faithful(sk100, copied) and faithful(sk128, copied)
    # a plain B (row-major K x N) keeps the copy a choice
    (plain,) = [s for s in generate_sketches(_task(100, n=128).mlir, target) if s.name == "cpu-contraction"]
    assert plain.implied == () and "pack" in {k.name for k in plain.knobs}


def test_a_record_of_the_sketch_that_offered_the_copy_of_b_in_panels_is_carried(tmp_path):
    """A relative's record tuned when the rule still offered the copy of a
    B in column panels (its sketch's hash no longer made, a "pack" knob)
    is carried to another size, read in place (`transfer.earlier_forms`);
    a record whose knobs no sketch has is not."""
    from mlir_ansor.records import Record

    target = Target.host()
    t128, t100 = (mlir_ansor.extract_tasks(mlir_ansor.load(text=PANELS_MATMUL.format(m=m, p=2)))[0] for m in (128, 100))
    (sk128,) = [s for s in generate_sketches(t128.mlir, target) if s.name == "cpu-contraction"]
    knobs = dict(default_assignment(sk128, 1)) | {"pack": 0}
    with Database(str(tmp_path / "t.db")) as db:
        db.add_workload(t128.workload_key, t128.name, t128.mlir, t128.flops)
        db.commit_record(Record(t128.workload_key, target.key, "earlier", tuple(sorted(knobs.items())), (1e-5,), "none",
                                host=target.model, threads=1))
        db.commit_record(Record(t128.workload_key, target.key, "other", (("q_d9", 4),), (1e-6,), "none",
                                host=target.model, threads=1))
        (t,) = transferred(db, t100, generate_sketches(t100.mlir, target), target, threads=1)
    assert t.sketch.name == "cpu-contraction" and "pack" not in dict(t.knobs)
    assert dict(t.knobs)["k_d3"] == knobs["k_d3"] and dict(t.knobs)["r_d2"] == knobs["r_d2"]
