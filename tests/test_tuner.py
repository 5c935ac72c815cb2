"""End-to-end tuning on small inputs, and the failure paths of candidates."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys

import faulty_jobs
import numpy as np
import pytest
from conftest import INPUTS, CountingMeasurer

from mlir_ansor import TuneConfig, tune
from mlir_ansor.measure.builder import build
from mlir_ansor.measure.measurer import Measurer
from mlir_ansor.measure.runner import Kernel, TimingPolicy
from mlir_ansor.passes.compile_cache import CompileCache
from mlir_ansor.records import Database
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.target import Target

FAST = TimingPolicy(warmup=1, min_repeat=2, max_repeat=5, min_time_s=0.005)


def _config(**kw) -> TuneConfig:
    base = dict(trials=6, batch_size=3, build_workers=2, timing=FAST, build_timeout_s=60, run_timeout_s=30)
    base.update(kw)
    return TuneConfig(**base)


@pytest.mark.slow
def test_tune_small_matmul_and_check_against_numpy(tmp_path):
    db = tmp_path / "t.db"
    result = tune(str(INPUTS / "matmul.mlir"), config=_config(), db=db)
    (r,) = result.tasks
    assert r.trials == 6 and result.measured == 6
    assert np.isfinite(r.best_latency_s) and r.gflops > 0
    assert r.baseline_latency_s > 0
    # The best schedule, rebuilt here, computes A @ B.
    sk = next(s for s in generate_sketches(r.task.mlir, Target.host()) if s.name == r.best_sketch)
    so = str(tmp_path / "best.so")
    build(sk.payload, r.best_script, 1, so)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((128, 64), dtype=np.float32)
    b = rng.standard_normal((64, 256), dtype=np.float32)
    c = np.full((128, 256), np.nan, dtype=np.float32)
    k = Kernel(so)
    k.bind([a, b, c])()
    k.close()
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)
    # Every trial is in the database, valid ones with their timings.
    with Database(db) as d:
        recs = [x for x in d.records(r.task.workload_key) if not x.retime]
        assert len(recs) == 6
        best = d.best(r.task.workload_key, Target.host().key)[0]
        assert best.latency_s == pytest.approx(r.best_latency_s)
        assert best.threads == 1 and best.host


@pytest.mark.slow
def test_the_best_schedules_are_re_timed_in_turns(tmp_path):
    """When the search ends, each task's best schedules are timed again,
    `retime_rounds` times each, from the libraries the search kept (nothing
    is built again), and the pick is made on all their timings."""
    db = tmp_path / "rt.db"
    # (The default point's turn beside the best: tests/test_default_point.py.)
    config = _config(trials=6, retime_top=3, retime_rounds=2, retime_default_factor=0.0)
    with CountingMeasurer(config, replay=True) as m:
        result = tune(str(INPUTS / "matmul.mlir"), config=config, db=db, measurer=m)
        assert m.built == 6
    (r,) = result.tasks
    with Database(db) as d:
        recs = d.records()
        retimes = [x for x in recs if x.retime]
        searched = {(x.sketch_hash, x.knobs): x for x in recs if not x.retime}
        assert len(searched) == 6
        valid = sorted((x for x in searched.values() if x.valid), key=lambda x: x.latency_s)
        top = {(x.sketch_hash, x.knobs) for x in valid[:3]}
        # every re-timing is of one of the search's 3 best, each timed twice more
        assert {(x.sketch_hash, x.knobs) for x in retimes} == top and len(retimes) == 2 * len(top)
        assert all(x.valid and x.build_s == 0.0 for x in retimes)
        best = d.best(r.task.workload_key, Target.host().key)[0]
        assert len(best.costs) > len(searched[(best.sketch_hash, best.knobs)].costs)
        assert r.best_latency_s == pytest.approx(best.latency_s) and dict(r.best_knobs) == dict(best.knobs)
    assert r.retimed == len(top) and r.search_latency_s == pytest.approx(valid[0].latency_s)
    assert result.measured == 6  # re-timings are not trials
    # A resumed run with nothing new among the best re-times nothing (and builds nothing).
    with CountingMeasurer(config) as m:
        again = tune(str(INPUTS / "matmul.mlir"), config=dataclasses.replace(config, trials=0), db=db, measurer=m)
        assert m.built == 0
    with Database(db) as d:
        assert sum(x.retime for x in d.records()) == len(retimes)
    assert again.tasks[0].best_latency_s == pytest.approx(r.best_latency_s)
    # Nor does one where re-timings pushed an earlier run's un-re-timed
    # schedule among the best: it is not new to this run.
    with Database(db) as d:
        slow = [dataclasses.replace(x, costs=(1.0,) * 1000, timestamp=x.timestamp + 1e-3) for x in retimes[:3]]
        for x in slow:
            d.commit_record(x)
        k4 = {(x.sketch_hash, x.knobs) for x in d.best(r.task.workload_key, Target.host().key, k=3)}
        assert k4 - top, "the slowed schedules must leave room for one the first run did not re-time"
    with CountingMeasurer(config) as m:
        tune(str(INPUTS / "matmul.mlir"), config=dataclasses.replace(config, trials=0), db=db, measurer=m)
        assert m.built == 0
    retimes += slow
    # One with new candidates re-times those among the best, and of the
    # schedules re-timed before only the incumbent they take turns with.
    with Database(db) as d:
        t_end = max(x.timestamp for x in d.records())
    tune(str(INPUTS / "matmul.mlir"), config=dataclasses.replace(config, trials=4, seed=7), db=db)
    with Database(db) as d:
        new = [x for x in d.records() if x.timestamp > t_end]
    fresh = {(x.sketch_hash, x.knobs) for x in new if not x.retime}
    again_timed = {(x.sketch_hash, x.knobs) for x in new if x.retime}
    assert len(fresh) == 4 and len(again_timed - fresh) <= 1 and (again_timed - fresh) <= top
    # Off: no re-timing.
    off = tune(str(INPUTS / "matmul.mlir"), config=_config(trials=3, retime_rounds=0), db=tmp_path / "off.db")
    with Database(tmp_path / "off.db") as d:
        assert not any(x.retime for x in d.records()) and off.tasks[0].retimed == 0


@pytest.mark.slow
def test_same_seed_same_candidates(tmp_path):
    def knobs(db_name):
        tune(str(INPUTS / "matmul.mlir"), config=_config(trials=3, seed=11), db=tmp_path / db_name)
        with Database(tmp_path / db_name) as d:
            return sorted(r.knobs for r in d.records())

    assert knobs("a.db") == knobs("b.db")


@pytest.mark.slow
def test_resume_measures_nothing_twice(tmp_path):
    db = tmp_path / "r.db"
    tune(str(INPUTS / "matmul.mlir"), config=_config(trials=3), db=db)
    tune(str(INPUTS / "matmul.mlir"), config=_config(trials=3), db=db)
    with Database(db) as d:
        recs = [r for r in d.records() if not r.retime]  # re-timings are not candidates
    keys = [(r.sketch_hash, r.knobs) for r in recs]
    assert len(recs) == 6 and len(set(keys)) == 6


@pytest.mark.slow
def test_crashes_hangs_and_wrong_answers_become_records(tmp_path):
    db = tmp_path / "f.db"
    config = _config(trials=24, batch_size=8, build_timeout_s=4, seed=3)
    with Measurer(
        config, build_fn=faulty_jobs.build_that_aborts_or_hangs, run_fn=faulty_jobs.run_that_segfaults
    ) as m:
        result = tune(str(INPUTS / "matmul.mlir"), config=config, db=db, measurer=m)
    (r,) = result.tasks
    with Database(db) as d:
        recs = [r for r in d.records() if not r.retime]
    kinds = {}
    for rec in recs:
        kinds.setdefault(rec.error_kind, []).append(rec)
    assert len(recs) == 24
    assert "crash" in kinds and any("SIGABRT" in x.error_msg for x in kinds["crash"])
    assert any("SIGSEGV" in x.error_msg for x in kinds["crash"])
    assert "timeout" in kinds
    assert "wrong_answer" in kinds and "exceeds tolerance" in kinds["wrong_answer"][0].error_msg
    # Tuning went on: valid records exist, none of them with the faulty tiles.
    assert kinds.get("none")
    for rec in kinds["none"]:
        assert dict(rec.knobs).get("r_d0") not in (2, 4, 8)
    assert dict(r.best_knobs).get("r_d0") not in (2, 4, 8)


def _cli(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "mlir_ansor.tools.cli", *args], capture_output=True, text=True, input=stdin, timeout=600
    )


@pytest.mark.parametrize(
    "name, expected",
    [
        ("malformed.mlir", "malformed.mlir:3:"),
        ("dynamic.mlir", "dynamic"),
        ("unsupported_op.mlir", "unsupported_op.mlir:"),
        ("mask_only.mlir", "element type i1, which tasks do not take yet"),
        ("no_linalg.mlir", "no Linalg operation"),
        ("does_not_exist.mlir", "no such file"),
    ],
)
def test_cli_bad_input_is_a_clear_error(tmp_path, name, expected):
    proc = _cli("tune", str(INPUTS / name), "--trials", "1", "--db", str(tmp_path / "x.db"))
    assert proc.returncode == 2, proc.stderr
    assert expected in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_refuses_a_foreign_database(tmp_path):
    bogus = tmp_path / "notes.db"
    bogus.write_text("not a database\n")
    proc = _cli("tune", str(INPUTS / "matmul.mlir"), "--trials", "1", "--db", str(bogus))
    assert proc.returncode == 2 and "notes.db" in proc.stderr and "Traceback" not in proc.stderr
    assert bogus.read_text() == "not a database\n"


@pytest.mark.slow
def test_cli_tune_json_from_stdin_and_show(tmp_path):
    db = tmp_path / "cli.db"
    text = (INPUTS / "matmul.mlir").read_text()
    proc = _cli("tune", "-", "--trials", "2", "--batch-size", "2", "--db", str(db), "--seed", "1", "--json", stdin=text)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    (task,) = out["tasks"]
    assert task["name"] == "matmul_128x256x64_f32"
    assert task["flops"] == 2 * 128 * 256 * 64 and task["weight"] == 1 and task["trials"] == 2
    assert task["best_latency_s"] > 0 and task["gflops"] > 0 and task["baseline_latency_s"] > 0
    assert out["latency_s"] == pytest.approx(task["best_latency_s"])
    show = _cli("show", str(db))
    assert show.returncode == 0 and "matmul_128x256x64_f32" in show.stdout


@pytest.mark.slow
def test_random_search_warns_that_a_cost_model_is_unused(tmp_path, caplog):
    with caplog.at_level("WARNING", logger="mlir_ansor"):
        tune(str(INPUTS / "matmul.mlir"), config=_config(trials=1, strategy="random", cost_model="random"), db=tmp_path / "w.db")
    assert any("only take effect with --search evolutionary" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_a_strategy_that_is_learning_sees_results_before_its_next_batch(tmp_path):
    """Builds of the next batch overlap measurement, except while a strategy
    says it still needs the current results (`prefetch_ok` False)."""
    from mlir_ansor.search import registry
    from mlir_ansor.search.strategy import RandomSearch

    calls: list[str] = []

    class Learning(RandomSearch):
        @property
        def prefetch_ok(self) -> bool:
            return False

        def generate_candidates(self, n):
            calls.append("generate")
            return super().generate_candidates(n)

        def notify_results(self, results):
            calls.append("notify")
            super().notify_results(results)

    with registry.isolated():
        registry.register_strategy("_learning", lambda config: Learning())
        tune(str(INPUTS / "matmul.mlir"), config=_config(trials=6, batch_size=2, strategy="_learning"), db=tmp_path / "l.db")
    assert calls[:6] == ["generate", "notify", "generate", "notify", "generate", "notify"]


@pytest.mark.slow
def test_a_small_budget_still_reaches_every_task(tmp_path):
    """Batches are capped at an equal share of the budget, so the warm-up
    gives every task of a model a batch: 4 trials over 2 tasks with batches
    of 16 tune both, 2 trials each (not 4 for the first and none for the
    second)."""
    result = tune(str(INPUTS / "two_matmuls.mlir"), config=_config(trials=4, batch_size=16), db=tmp_path / "s.db")
    assert sorted(r.trials for r in result.tasks) == [2, 2]
    assert all(np.isfinite(r.best_latency_s) for r in result.tasks)


def test_flushed_timing_evicts_what_a_run_reads():
    """With flush_caches, every timed run reads its 4 MiB from memory: no
    faster than unflushed runs (the flush itself is not timed), and the
    buffer written is twice the last-level cache."""
    from mlir_ansor.measure.runner import _flush_buffer, last_level_cache_bytes, time_callable

    assert _flush_buffer().nbytes == 2 * last_level_cache_bytes() >= 2 << 20
    data = np.ones(1 << 20, np.float32)
    warm = TimingPolicy(warmup=2, min_repeat=15, max_repeat=15, min_time_s=0.0)
    cold = dataclasses.replace(warm, flush_caches=True)
    assert len(time_callable(data.sum, cold)) == 15
    assert min(time_callable(data.sum, cold)) >= 0.8 * min(time_callable(data.sum, warm))


@pytest.mark.slow
def test_tune_with_flushed_timing(tmp_path):
    result = tune(str(INPUTS / "matmul.mlir"), config=_config(trials=3, timing=dataclasses.replace(FAST, flush_caches=True)),
                  db=tmp_path / "f.db")
    assert all(np.isfinite(r.best_latency_s) for r in result.tasks)


MATMUL_AND_TRANSPOSE = """
func.func @f(%a: tensor<96x96xf32>, %b: tensor<96x96xf32>) -> tensor<96x96xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<96x96xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e : tensor<96x96xf32>) -> tensor<96x96xf32>
  %m = linalg.matmul ins(%a, %b : tensor<96x96xf32>, tensor<96x96xf32>) outs(%z : tensor<96x96xf32>) -> tensor<96x96xf32>
  %t = linalg.transpose ins(%m : tensor<96x96xf32>) outs(%e : tensor<96x96xf32>) permutation = [1, 0]
  return %t : tensor<96x96xf32>
}
"""


@pytest.mark.slow
def test_first_batches_follow_the_share_of_time(tmp_path):
    """A task that is a sliver of the untuned module's time (a transpose
    beside a matmul) gets a first batch of 2, and the budget goes to the
    matmul: 10 trials, batches of 5 (an equal share), round-robin."""
    path = tmp_path / "mt.mlir"
    path.write_text(MATMUL_AND_TRANSPOSE)
    config = _config(trials=10, batch_size=8, task_scheduler="round-robin")
    result = tune(str(path), config=config, db=tmp_path / "mt.db")
    trials = {r.task.name.split("_")[0]: r.trials for r in result.tasks}
    assert trials == {"matmul": 8, "transpose": 2}


SIBLINGS = """
func.func @f(%a: tensor<32x40xf32>, %b: tensor<40x48xf32>, %c: tensor<32x40xf32>) -> (tensor<32x48xf32>, tensor<32x48xf32>) {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<32x48xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e : tensor<32x48xf32>) -> tensor<32x48xf32>
  %m1 = linalg.matmul ins(%a, %b : tensor<32x40xf32>, tensor<40x48xf32>) outs(%z : tensor<32x48xf32>) -> tensor<32x48xf32>
  %m2 = linalg.matmul ins(%c, %b : tensor<32x40xf32>, tensor<40x48xf32>) outs(%z : tensor<32x48xf32>) -> tensor<32x48xf32>
  %r = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>],
                       iterator_types = ["parallel", "parallel"]}
      ins(%m2 : tensor<32x48xf32>) outs(%e : tensor<32x48xf32>) {
  ^bb0(%x: f32, %o: f32):
    %y = arith.maximumf %x, %zero : f32
    linalg.yield %y : f32
  } -> tensor<32x48xf32>
  return %m1, %r : tensor<32x48xf32>, tensor<32x48xf32>
}
"""


@pytest.mark.slow
@pytest.mark.parametrize("share", [True, False])
def test_tasks_with_the_same_knobs_share_their_best(tmp_path, share):
    """A matmul and the same matmul with a fused ReLU are two tasks whose
    sketches have the same knobs: the second one's later batch measures the
    first one's best schedule (random points would not hit it). Its first
    batch is drawn before the first task's results are in."""
    path = tmp_path / "siblings.mlir"
    path.write_text(SIBLINGS)
    config = _config(
        trials=8, batch_size=2, strategy="random", task_scheduler="round-robin", default_candidate=False,
        share_best=share,
    )
    first, second = tune(str(path), config=config, db=tmp_path / "s.db").tasks
    assert "relu" not in first.task.name and "relu" in second.task.name
    with Database(tmp_path / "s.db") as d:
        def knobs(task):
            return {tuple(r.knobs) for r in d.records(task.task.workload_key) if not r.retime}

        shared = knobs(first) & knobs(second)
    assert bool(shared) == share


def test_a_second_run_takes_each_reference_from_the_cache_beside_the_database(tmp_path, caplog):
    """The second run of a task with the same seed and threads computes no
    reference: its seeded inputs, reference outputs and untuned timings come
    from ``<db>.cache/references`` (the run says so), and candidates are
    still checked against them; a cache file cut short is computed again;
    ``reference_cache=False`` computes it every time."""
    db = tmp_path / "r.db"
    src = str(INPUTS / "matmul.mlir")
    first = tune(src, config=_config(trials=2, batch_size=2), db=db)
    cached = sorted((tmp_path / "r.db.cache" / "references").iterdir())
    assert [p.suffix for p in cached] == [".json", ".npz"]
    with caplog.at_level("INFO", logger="mlir_ansor"):
        second = tune(src, config=_config(trials=2, batch_size=2), db=db)
    assert any("untuned baseline from the cache" in r.getMessage() for r in caplog.records)
    assert second.tasks[0].baseline_latency_s == first.tasks[0].baseline_latency_s
    assert second.measured == 2 and math.isfinite(second.tasks[0].best_latency_s)
    recs = Database(db).records(first.tasks[0].task.workload_key, Target.host().key)
    assert len({tuple(r.knobs) for r in recs}) == 4 and all(r.error_kind == "none" for r in recs)

    cached[0].write_text('{"costs": [')  # cut short: a miss, computed again and kept again
    caplog.clear()
    with caplog.at_level("INFO", logger="mlir_ansor"):
        tune(src, config=_config(trials=1, batch_size=1), db=db)
    assert not any("from the cache" in r.getMessage() for r in caplog.records)
    entry = CompileCache(tmp_path / "r.db.cache").get("references", cached[0].stem, ".json")
    assert json.loads(entry)["costs"]

    caplog.clear()
    with caplog.at_level("INFO", logger="mlir_ansor"):
        tune(src, config=_config(trials=1, batch_size=1, reference_cache=False), db=db)
    assert not any("from the cache" in r.getMessage() for r in caplog.records)
