"""Reproducibility: a tuning run records its seed, versions, target and host;
`replay` rebuilds and re-measures the best records and reports drift."""

from __future__ import annotations

import json
import math

import pytest
from conftest import INPUTS

from mlir_ansor import TuneConfig, tune
from mlir_ansor.measure.runner import TimingPolicy
from mlir_ansor.records import Database, Record
from mlir_ansor.target import Target
from mlir_ansor.tools.cli import main
from mlir_ansor.tools.replay import replay

TINY = TimingPolicy(warmup=1, min_repeat=2, max_repeat=3, min_time_s=0.005)

pytestmark = pytest.mark.slow  # every test reads a tuned database


@pytest.fixture(scope="module")
def tiny_db(tmp_path_factory):
    db = tmp_path_factory.mktemp("replay") / "tiny.db"
    tune(str(INPUTS / "matmul.mlir"), config=TuneConfig(trials=4, batch_size=4, timing=TINY, seed=7), db=db)
    return db


def test_runs_and_records_carry_seed_versions_target_and_host(tiny_db):
    with Database(tiny_db) as db:
        (run,) = db.runs()
        recs = db.records()
    assert run["seed"] == 7 and run["config"]["seed"] == 7 and run["config"]["trials"] == 4
    assert run["target"] == Target.host().key and run["target_info"]["kind"] == "cpu"
    assert run["host"]["model"] == Target.host().model and run["host"]["cpu_count"] >= 1
    for key in ("mlir_ansor", "mlir", "xgboost", "numpy", "python"):
        assert run["versions"][key] not in ("", "unknown"), key
    for rec in recs:
        v = json.loads(rec.versions)
        assert v["seed"] == 7 and v["run"] == run["id"] and v["xgboost"] == run["versions"]["xgboost"]


def test_replay_remeasures_the_best_records(tiny_db):
    with Database(tiny_db) as db:
        best = db.best(db.workloads()[0]["workload_key"], Target.host().key, k=2)
    report = replay(tiny_db, top=2, timing=TINY)
    assert [r.rank for r in report.rows] == [1, 2]
    for row, rec in zip(report.rows, best):
        assert row.knobs == tuple(rec.knobs) and row.old_latency_s == pytest.approx(rec.latency_s)
        assert row.error == "" and math.isfinite(row.new_latency_s) and row.new_latency_s > 0
        assert 0.1 < row.drift < 10  # the same kernel on the same machine
        assert row.seed == 7 and row.changed_versions == {}


def test_replay_reports_records_that_no_longer_build(tiny_db, tmp_path, capsys):
    import shutil

    db_path = tmp_path / "copy.db"
    shutil.copyfile(tiny_db, db_path)
    with Database(db_path) as db:
        w = db.workloads()[0]
        good = db.best(w["workload_key"], Target.host().key)[0]
        # A "best" record whose knobs the sketch does not offer, with an old
        # version recorded, and one of a sketch the rules no longer make.
        bad_knobs = tuple((k, 7 if k == "r_d0" else v) for k, v in good.knobs)
        versions = json.dumps({**json.loads(good.versions), "mlir": "0.0.1"})
        db.commit_record(Record(**{**good.to_json(), "knobs": bad_knobs, "costs": (1e-9,), "versions": versions,
                                   "timestamp": 1.0}))
        db.commit_record(Record(**{**good.to_json(), "sketch_hash": "0" * 16, "costs": (1e-9,), "timestamp": 2.0}))
    report = replay(db_path, top=2, timing=TINY)
    first = report.rows[0]
    assert first.error.startswith("script:") and not math.isfinite(first.new_latency_s)
    assert first.changed_versions["mlir"][0] == "0.0.1"
    assert report.rows[1].error == "" and report.skipped == {"sketch no longer generated": 1}
    assert main(["replay", str(db_path), "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "script:" in out and "versions changed: mlir 0.0.1 ->" in out and "skipped 1 record(s)" in out
    assert main(["replay", str(db_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["rows"][0]["rank"] == 1 and data["target"] == Target.host().key


def test_replay_prefers_records_of_this_machine(tiny_db, tmp_path, capsys):
    import shutil

    db_path = tmp_path / "hosts.db"
    shutil.copyfile(tiny_db, db_path)
    with Database(db_path) as db:
        w = db.workloads()[0]
        mine = db.best(w["workload_key"], Target.host().key)[0]
        # Another machine's records, more of them and faster: never compared
        # with this machine's while this machine has some.
        for i in range(len(mine.knobs)):
            db.commit_record(Record(**{**mine.to_json(), "host": "Other CPU", "costs": (1e-9,), "timestamp": 10.0 + i}))
    report = replay(db_path, top=1, timing=TINY)
    (row,) = report.rows
    assert row.recorded_host == Target.host().model and not row.other_host
    assert row.old_latency_s == pytest.approx(mine.latency_s)
    # Only another machine's records: replayed, and the drift says so.
    other = Target(**{**Target.host().__dict__, "model": "Some Other CPU"})
    report = replay(db_path, top=1, timing=TINY, target=other)
    (row,) = report.rows
    assert row.recorded_host == "Other CPU" and row.other_host
    assert main(["replay", str(db_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rows"][0]["other_host"] is False


def test_replay_rebuilds_a_row_task_as_one_task(tmp_path):
    """A softmax (or a layer norm) is one task on a CPU, its reductions
    merged row by row; replay extracts the stored task text as the tuner
    did. Without the target's merges a BERT layer norm came back as five
    tasks, the first one's inputs were given to the whole task's reference,
    and the reference crashed."""
    from mlir_ansor import load
    from mlir_ansor.examples import workloads

    db = tmp_path / "sfm.db"
    tune(load(text=workloads.softmax(16, 64)), config=TuneConfig(trials=2, batch_size=2, timing=TINY, seed=1), db=db)
    report = replay(db, top=1, timing=TINY)
    (row,) = report.rows
    assert row.error == "" and math.isfinite(row.new_latency_s), row.error
