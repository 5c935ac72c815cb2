"""The rules' default points (`Sketch.prefer`, `sketch.default_assignment`):
valid for every sketch, the expected register tile for a GEMM, measured
first by the search, and what `compile` gives a task without records."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import CountingMeasurer

import mlir_ansor
from mlir_ansor import TuneConfig, tune
from mlir_ansor.examples import workloads
from mlir_ansor.graph.task import extract_tasks
from mlir_ansor.records import Database
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.search.sketch import default_assignment
from mlir_ansor.search.space import is_valid, make_assignment
from mlir_ansor.target import Target

AVX2 = Target("cpu", 256, 2, "test", ("avx2", "fma"))

WORKLOADS = {
    "matmul": workloads.matmul(128, 96, 64),
    "odd_matmul": workloads.matmul(67, 45, 33),
    "matmul_tb": workloads.matmul_transposed_b(64, 64, 32),
    "batch_matmul": workloads.batch_matmul(2, 32, 32, 16),
    "conv_nhwc": workloads.conv2d_nhwc(1, 10, 10, 8, 16, 3, 3),
    "conv_nchw": workloads.conv2d_nchw(1, 8, 10, 10, 16, 3, 3),
    "pool": workloads.pool2d_nhwc(1, 10, 10, 8, 3, 1, "max"),
    "reduce": workloads.reduce_last(16, 64),
    "softmax": workloads.softmax(16, 64),
    "elementwise": workloads.elementwise_add_relu(16, 64),
    "conv3d": workloads.conv3d_ndhwc(1, 4, 6, 6, 4, 8, 3),
}


def _tasks(text: str, tmp_path):
    path = tmp_path / "w.mlir"
    path.write_text(text)
    return extract_tasks(str(path))


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_default_point_is_valid_and_keeps_threads_busy(name, tmp_path):
    for task in _tasks(WORKLOADS[name], tmp_path):
        for sk in generate_sketches(task.mlir, AVX2):
            for threads in (1, 2, 4):
                a = default_assignment(sk, threads)
                assert is_valid(sk.knobs, a), (sk.name, threads, a)
                most = 1
                for _, extent in sk.forall:
                    most *= extent
                want = min(threads, most)
                assert sk.parallelism(a) >= want, (sk.name, threads, a)
                if threads == 1:
                    assert sk.parallelism(a) == 1 or any(sk.prefer), (sk.name, a)


def test_gemm_default_is_six_rows_by_two_vectors_packed(tmp_path):
    (task,) = _tasks(workloads.matmul(512, 512, 512), tmp_path)
    sk = generate_sketches(task.mlir, AVX2)[0]
    assert sk.name == "cpu-contraction"
    a = dict(default_assignment(sk, 1))
    # 6 rows (12 accumulators) although 6 does not divide 512: peeled
    assert (a["r_d0"], a["r_d1"], a["u_d2"], a["k_d2"], a["pack"]) == (6, 16, 4, 256, 0)
    assert (a["p_d0"], a["p_d1"]) == (64, 128)
    # two threads: the same tiles already give 8 x 4 forall iterations
    assert dict(default_assignment(sk, 2)) == a


def test_window_loops_get_no_partial_tiles(tmp_path):
    # a 3x3 NCHW convolution: k = u = 2 on its kw loop made the transform
    # interpreter loop forever; tiles of window loops divide them
    (task,) = _tasks(workloads.conv2d_nchw(1, 8, 10, 10, 16, 3, 3), tmp_path)
    sk = generate_sketches(task.mlir, AVX2)[0]
    for spec in sk.knobs:
        if spec.name in ("u_d6", "k_d6", "u_d5", "k_d5"):
            assert all(3 % o == 0 for o in spec.options), (spec.name, spec.options)


def _default_point(path) -> tuple:
    """(sketch hash, knobs) of the one-task module's default point on this host."""
    (task,) = extract_tasks(str(path))
    sk = generate_sketches(task.mlir, Target.host())[0]
    return sk.hash, default_assignment(sk, 1)


@pytest.mark.slow
def test_first_batch_measures_the_default_point(tmp_path):
    path = tmp_path / "mm.mlir"
    path.write_text(workloads.matmul(64, 64, 32))
    db = tmp_path / "t.db"
    config = TuneConfig(trials=3, batch_size=3, strategy="random", seed=5)
    tune(str(path), config=config, db=db)
    want = _default_point(path)
    with Database(db) as d:
        recs = [r for r in d.records() if not r.retime]  # candidates
    keys = [(r.sketch_hash, tuple(r.knobs)) for r in recs]
    assert want in keys and len(set(keys)) == len(keys) == 3
    # the ablation: no default point
    db2 = tmp_path / "n.db"
    tune(str(path), config=TuneConfig(trials=3, batch_size=3, strategy="random", seed=5, default_candidate=False), db=db2)
    with Database(db2) as d:
        assert want not in [(r.sketch_hash, tuple(r.knobs)) for r in d.records()]


def _four_candidates_not_retimed(tmp_path) -> tuple:
    """A 64x64x32 matmul tuned with 4 candidates (its default point among
    them) and no re-timing: (its path, the database, each record's
    ``(sketch_hash, knobs)`` in the order of their rows)."""
    path = tmp_path / "mm.mlir"
    path.write_text(workloads.matmul(64, 64, 32))
    db = tmp_path / "t.db"
    tune(str(path), config=TuneConfig(trials=4, batch_size=4, strategy="random", seed=5, retime_rounds=0), db=db)
    with Database(db) as d:
        keys = [(r.sketch_hash, tuple(r.knobs)) for r in d.records()]
    assert len(keys) == 4
    return path, db, keys


def _set_timings(db, costs: list[float]) -> None:
    """Give the records, in the order of their rows, one timing each."""
    import json
    import sqlite3

    with sqlite3.connect(db) as c:
        ids = [row_id for (row_id,) in c.execute("SELECT id FROM records ORDER BY id")]
        for row_id, cost in zip(ids, costs, strict=True):
            c.execute("UPDATE records SET costs = ?, latency_s = ? WHERE id = ?", (json.dumps([cost]), cost, row_id))


@pytest.mark.slow
@pytest.mark.parametrize("factor, retimed", [(1.5, True), (1.2, False)])
def test_a_default_point_timed_in_a_slow_phase_is_timed_again_at_the_end(tmp_path, factor, retimed):
    """The re-timing at the end of a search takes the default point beside the
    best ones when its one timing is within `retime_default_factor` of the best's."""
    path, db, keys = _four_candidates_not_retimed(tmp_path)
    want = _default_point(path)
    # As if the default had been timed while the machine ran slow: 1.4x the best.
    _set_timings(db, [1.4e-3 if key == want else 1e-3 * (1 + 0.01 * n) for n, key in enumerate(keys)])
    config = TuneConfig(trials=0, retime_top=2, retime_rounds=1, retime_default_factor=factor)
    tune(str(path), config=config, db=db)
    with Database(db) as d:
        again = [(r.sketch_hash, tuple(r.knobs)) for r in d.records() if r.retime]
    assert len(again) == 2 + retimed  # the two best, and the default when near them
    assert (want in again) == retimed


@pytest.mark.slow
def test_the_default_points_library_is_kept_for_the_re_timing(tmp_path):
    """The search keeps the default point's library beside its best ones:
    the re-timing times it without building it again."""
    path = tmp_path / "mm.mlir"
    path.write_text(workloads.matmul(64, 64, 32))
    db = tmp_path / "t.db"
    config = TuneConfig(trials=6, batch_size=3, strategy="random", seed=5, retime_top=2, retime_rounds=1, retime_default_factor=1e9)
    with CountingMeasurer(config, replay=True) as m:
        tune(str(path), config=config, db=db, measurer=m)
    assert m.built == 6
    with Database(db) as d:
        again = {(r.sketch_hash, tuple(r.knobs)) for r in d.records() if r.retime}
    assert _default_point(path) in again


@pytest.mark.slow
def test_a_second_re_timing_takes_turns_with_the_incumbent(tmp_path):
    """When the re-timing leaves a schedule it has not timed again as the
    best, the second attempt times that one in turns with the incumbent
    (the best it did re-time), not against the incumbent's earlier timings."""
    path, db, keys = _four_candidates_not_retimed(tmp_path)
    # A and B look impossibly fast, C next (faster than any real timing), D slow:
    # the first attempt re-times A and B, whose real timings then rank C first.
    _set_timings(db, [1e-9, 1.1e-9, 1e-6, 1.0])
    key = dict(zip(keys, "ABCD"))
    config = TuneConfig(trials=0, retime_top=2, retime_rounds=3, retime_default_factor=1.0)
    with CountingMeasurer(config) as m:
        tune(str(path), config=config, db=db, measurer=m)
    # A and B, then C: the incumbent's library, kept from the first attempt, is not built again
    assert m.built == 3
    with Database(db) as d:
        counts = {}
        for r in d.records():
            if r.retime:
                n = key[(r.sketch_hash, tuple(r.knobs))]
                counts[n] = counts.get(n, 0) + 1
    assert counts.get("C") == 3 and "D" not in counts
    assert sorted([counts.get("A", 0), counts.get("B", 0)]) == [3, 6]  # the incumbent, timed again beside C


def test_compile_without_records_uses_the_rule_default(tmp_path):
    path = tmp_path / "mm.mlir"
    path.write_text(workloads.matmul(96, 80, 48))
    cm = mlir_ansor.compile(str(path), db=None)
    (k,) = cm.kernels
    assert k.source == "default" and k.sketch_name == "cpu-contraction"
    rng = np.random.default_rng(0)
    a = rng.standard_normal((96, 48), dtype=np.float32)
    b = rng.standard_normal((48, 80), dtype=np.float32)
    np.testing.assert_allclose(cm(a, b), a @ b, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_another_machines_records_do_not_count_as_measured(tmp_path):
    import sqlite3

    path = tmp_path / "mm.mlir"
    path.write_text(workloads.matmul(64, 64, 32))
    db = tmp_path / "h.db"
    config = TuneConfig(trials=2, batch_size=2, strategy="random", seed=9)
    tune(str(path), config=config, db=db)
    with sqlite3.connect(db) as c:  # as if another kind of machine had measured them
        c.execute("UPDATE records SET host = 'Other CPU'")
    tune(str(path), config=config, db=db)
    seed_point = _default_point(path)
    with Database(db) as d:
        hosts = [r.host for r in d.records() if (r.sketch_hash, tuple(r.knobs)) == seed_point and not r.retime]
    assert sorted(hosts) == sorted(["Other CPU", Target.host().model])


SQUARED_DIFF = """
#id = affine_map<(d0, d1) -> (d0, d1)>
#row = affine_map<(d0, d1) -> (d0)>
func.func @sq(%x: tensor<16x64xf64>, %m: tensor<16xf64>) -> tensor<16x64xf64> {
  %e = tensor.empty() : tensor<16x64xf64>
  %d = linalg.generic {indexing_maps = [#id, #row, #id], iterator_types = ["parallel", "parallel"]}
      ins(%x, %m : tensor<16x64xf64>, tensor<16xf64>) outs(%e : tensor<16x64xf64>) {
  ^bb0(%a: f64, %b: f64, %o: f64):
    %s = arith.subf %a, %b : f64
    linalg.yield %s : f64
  } -> tensor<16x64xf64>
  %q = linalg.generic {indexing_maps = [#id, #id, #id], iterator_types = ["parallel", "parallel"]}
      ins(%d, %d : tensor<16x64xf64>, tensor<16x64xf64>) outs(%e : tensor<16x64xf64>) {
  ^bb0(%a: f64, %b: f64, %o: f64):
    %p = arith.mulf %a, %b : f64
    linalg.yield %p : f64
  } -> tensor<16x64xf64>
  return %q : tensor<16x64xf64>
}
"""


def test_elementwise_consumer_reading_its_producer_twice(tmp_path):
    # (x - mean)^2 as BERT's layer norm writes it: the producer is fused in
    # twice, and tiling both copies with knob sizes once was refused
    # ("expected as many parameter values (0) as target ops (2)").
    path = tmp_path / "sq.mlir"
    path.write_text(SQUARED_DIFF)
    cm = mlir_ansor.compile(str(path), db=None)
    (k,) = cm.kernels
    assert k.source == "default" and k.sketch_name == "cpu-elementwise"
    rng = np.random.default_rng(0)
    x, m = rng.standard_normal((16, 64)), rng.standard_normal(16)
    np.testing.assert_allclose(cm(x, m), (x - m[:, None]) ** 2, rtol=1e-12)


def test_convolution_default_is_one_register_tile_wide(tmp_path):
    # 3x3, 64 -> 64 channels: the thread tile spans 16 output channels (one
    # register tile), so the packed filter tile (3x3x64x16) stays in L1
    (task,) = _tasks(workloads.conv2d_nhwc(1, 58, 58, 64, 64, 3, 3), tmp_path)
    sk = generate_sketches(task.mlir, AVX2)[0]
    assert sk.name == "cpu-contraction"
    a = dict(default_assignment(sk, 1))
    assert (a["r_d2"], a["r_d3"], a["u_d6"], a["k_d6"], a["pack"]) == (4, 16, 4, 64, 0)
    assert a["p_d3"] == 16 and a["p_d2"] == 56
    # pooling has no filter to keep in L1: its thread tiles stay wide
    (task,) = _tasks(workloads.pool2d_nhwc(1, 18, 18, 64, 3, 1, "max"), tmp_path)
    sk = generate_sketches(task.mlir, AVX2)[0]
    p = {k: v for k, v in default_assignment(sk, 1) if k.startswith("p_")}
    assert p and max(p.values()) == 64, p


def test_avx512_contraction_default_is_twelve_rows_in_256_row_thread_tiles(tmp_path):
    """32 vector registers: 12 rows by 2 vectors (24 accumulators), 14 rows
    offered too, and thread tiles of 256 rows (each packed B tile serves 4x
    the rows of AVX2's 64). AVX2 keeps 6 rows, 64-row tiles and no 12 or 14."""
    (task,) = _tasks(workloads.matmul(512, 512, 512), tmp_path)
    zen4 = Target.cpu("znver4", cores=2)
    assert zen4.vector_registers == 32 and AVX2.vector_registers == 16
    sk = generate_sketches(task.mlir, zen4)[0]
    rows = {k.name: k.options for k in sk.knobs}["r_d0"]
    assert {12, 14} <= set(rows)
    a = dict(default_assignment(sk, 1))
    assert (a["r_d0"], a["r_d1"], a["u_d2"], a["k_d2"], a["pack"]) == (12, 32, 4, 256, 0)
    assert (a["p_d0"], a["p_d1"]) == (256, 128)
    sk2 = generate_sketches(task.mlir, AVX2)[0]
    assert not {12, 14} & set({k.name: k.options for k in sk2.knobs}["r_d0"])
    # a convolution's rows (pixels) keep their tiles
    (conv,) = _tasks(workloads.conv2d_nhwc(1, 58, 58, 64, 64, 3, 3), tmp_path)
    c = dict(default_assignment(generate_sketches(conv.mlir, zen4)[0], 1))
    assert c["r_d2"] == 4 and c["p_d2"] == 56


def test_thread_tiles_leave_no_sliver_and_split_the_columns_where_the_rows_fit(tmp_path):
    """Where the preferred thread tiles give every thread as many tiles, they
    are taken: a 100-row GEMM keeps its rows in one tile and splits the
    columns at 2 threads (rows in tiles of 96 left a 4-row tile, a pass over
    all of B for 4 rows). A tile is one that leaves no remainder or one of
    at least half a tile: 333 rows at one thread are one tile, not 240 and
    93. A loop without a preference is still split for the threads."""
    zen4 = Target.cpu("znver4", cores=2)
    for m, threads, rows in ((100, 2, 100), (64, 2, 64), (333, 1, 333), (384, 2, 192)):
        (task,) = _tasks(workloads.matmul(m, 1024, 1024), tmp_path)
        sk = generate_sketches(task.mlir, zen4)[0]
        a = default_assignment(sk, threads)
        assert dict(a)["p_d0"] == rows, (m, threads, dict(a))
        assert sk.parallelism(a) % threads == 0
    (task,) = _tasks(workloads.elementwise_add_relu(16, 64), tmp_path)
    sk = generate_sketches(task.mlir, zen4)[0]
    assert sk.parallelism(default_assignment(sk, 2)) >= 2


def test_panels_default_thread_tile_is_128_columns(tmp_path):
    """B in column panels ([N / 32, K, 32]): the loop over panels gets
    thread tiles of 4 panels, not all 24 (whose packed tile is 24x the one
    the vector loop's 128-column preference asks for)."""
    from conftest import PANELS_MATMUL

    for target in (AVX2, Target.cpu("znver4", cores=2)):
        (sk,) = [s for s in generate_sketches(PANELS_MATMUL.format(m=384, p=24), target) if s.name == "cpu-contraction"]
        for threads in (1, 2):
            a = dict(default_assignment(sk, threads))
            assert a["p_d1"] == 4 and a["p_d2"] == 32, (target.model, threads, a)
    # a plain B (row-major K x N): its column loop is the vector loop, 128 wide
    (task,) = _tasks(workloads.matmul(384, 768, 64), tmp_path)
    assert dict(default_assignment(generate_sketches(task.mlir, AVX2)[0], 1))["p_d1"] == 128


@pytest.mark.skipif(Target.host().vector_registers < 32, reason="the host has 16 vector registers (no AVX-512)")
@pytest.mark.parametrize("rows", [12, 14])
def test_wide_row_tiles_match_numpy(tmp_path, rows):
    """12 and 14 register rows, full tiles and a masked remainder (100 rows)
    in panels, and peeled (128 rows) in a plain GEMM."""
    from conftest import PANELS_MATMUL, run_schedule

    from mlir_ansor.search.sketch import select_knobs

    host = Target.host()
    rng = np.random.default_rng(0)
    (sk,) = [s for s in generate_sketches(PANELS_MATMUL.format(m=100, p=4), host) if s.name == "cpu-contraction"]
    values = dict(default_assignment(sk, 1)) | {"r_d0": rows, "p_d0": 100}
    x, w = rng.standard_normal((100, 64)).astype(np.float32), rng.standard_normal((4, 64, 32)).astype(np.float32)
    out = np.zeros((100, 4, 32), np.float32)
    run_schedule(sk.payload, select_knobs(sk.script, values), [x, w, out], tmp_path)
    np.testing.assert_allclose(out, np.einsum("mk,pkl->mpl", x, w), rtol=1e-5, atol=1e-4)
    (task,) = _tasks(workloads.matmul(128, 64, 48), tmp_path)
    sk = generate_sketches(task.mlir, host)[0]
    values = dict(default_assignment(sk, 1)) | {"r_d0": rows}
    assert is_valid(sk.knobs, make_assignment(values))
    a, b = rng.standard_normal((128, 48)).astype(np.float32), rng.standard_normal((48, 64)).astype(np.float32)
    out = np.zeros((128, 64), np.float32)
    run_schedule(sk.payload, select_knobs(sk.script, values), [a, b, out], tmp_path)
    np.testing.assert_allclose(out, a @ b, rtol=1e-5, atol=1e-4)


def test_few_rows_against_a_large_b_stream_it_in_tiles_4_vectors_wide(tmp_path):
    """Up to 16 rows against a 1024 x 1024 B on a 32-register target:
    register tiles 4 vectors wide, over all the rows up to 8 (the largest
    row tile offered: 6 at 7 rows), else 6 rows. At 8 or 16 rows, where
    packing B is a choice, B is read in place (pack = 1) in thread tiles
    of 4 vectors of columns. 32 rows, a small B, B in panels and a
    16-register target keep the usual default (B packed, pack = 0, where
    there is the choice: not for B in panels, read in place)."""
    from conftest import PANELS_MATMUL

    zen4 = Target.cpu("znver4", cores=2)

    def default(text, target=zen4, threads=2):
        (sk,) = [s for s in generate_sketches(text, target) if s.name == "cpu-contraction"]
        return dict(default_assignment(sk, threads))

    for m, rows in ((8, 8), (16, 6)):
        for threads in (1, 2):
            a = default(_tasks(workloads.matmul(m, 1024, 1024), tmp_path)[0].mlir, threads=threads)
            assert (a["pack"], a["r_d0"], a["r_d1"], a["p_d1"], a["p_d0"]) == (1, rows, 64, 64, m), (m, threads, a)
    for m, rows in ((1, 1), (5, 5), (7, 6), (12, 6)):
        a = default(_tasks(workloads.matmul(m, 1024, 1024), tmp_path)[0].mlir)
        assert (a.get("pack", 0), a["r_d0"], a["r_d1"], a["p_d1"]) == (0, rows, 64, 128), (m, a)
    a = default(_tasks(workloads.matmul(32, 1024, 1024), tmp_path)[0].mlir)
    assert (a["pack"], a["r_d0"], a["r_d1"], a["p_d1"]) == (0, 12, 32, 128), a
    assert default(_tasks(workloads.matmul(16, 256, 256), tmp_path)[0].mlir)["pack"] == 0
    avx2 = default(_tasks(workloads.matmul(16, 1024, 1024), tmp_path)[0].mlir, AVX2)
    assert avx2["pack"] == 0 and avx2["r_d1"] != 64, avx2
    panels = default(PANELS_MATMUL.format(m=16, p=128))  # B: 128 x 64 x 32, 256 Ki elements
    assert "pack" not in panels and (panels["r_d0"], panels["p_d1"]) == (12, 4), panels
    # and it computes the product, where the host has the registers for it
    host = Target.host()
    if host.vector_registers >= 32:
        from conftest import run_schedule

        from mlir_ansor.search.sketch import select_knobs

        rng = np.random.default_rng(0)
        for m, rows in ((16, 6), (7, 6)):
            (task,) = _tasks(workloads.matmul(m, 512, 512), tmp_path)
            (sk,) = [s for s in generate_sketches(task.mlir, host) if s.name == "cpu-contraction"]
            values = dict(default_assignment(sk, 2))
            assert values.get("pack", 1) == 1 and (values["r_d0"], values["r_d1"]) == (rows, 64), values
            a, b = rng.standard_normal((m, 512)).astype(np.float32), rng.standard_normal((512, 512)).astype(np.float32)
            out = np.zeros((m, 512), np.float32)
            run_schedule(sk.payload, select_knobs(sk.script, values), [a, b, out], tmp_path, threads=2)
            np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-3)
