"""Dataset export: a tiny tuned database exported, read back, checked against
the database, used to train a cost model; the saved model loaded at the start
of tuning (transfer learning) and used from the first batch."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import INPUTS

from mlir_ansor import TuneConfig, tune
from mlir_ansor.errors import InputError
from mlir_ansor.measure.runner import TimingPolicy
from mlir_ansor.records import Database
from mlir_ansor.search.cost_model import XGBModel, XGBModelConfig, pairwise_accuracy
from mlir_ansor.search.features import N_FEATURES, extract_features
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.search.strategy import EvolutionarySearch
from mlir_ansor.target import Target
from mlir_ansor.tools.cli import main
from mlir_ansor.tools.dataset import load, train_cost_model
from mlir_ansor.tuner import make_strategy

TINY = TimingPolicy(warmup=1, min_repeat=2, max_repeat=3, min_time_s=0.005)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    d = tmp_path_factory.mktemp("ds")
    db = d / "tiny.db"
    tune(str(INPUTS / "matmul.mlir"), config=TuneConfig(trials=8, batch_size=8, timing=TINY, seed=5), db=db)
    out = d / "dataset"
    assert main(["export-dataset", str(db), "-o", str(out)]) == 0
    return db, out


@pytest.mark.slow
def test_exported_dataset_matches_the_database(tuned):
    db_path, out = tuned
    ds = load(out)
    with Database(db_path) as db:
        recs = [r for r in db.records() if not r.retime]  # the re-timings are not exported
        (w,) = db.workloads()
    assert len(ds) == len(recs) == 8
    assert ds.features.shape == (ds.offsets[-1], N_FEATURES) and ds.features.dtype == np.float32
    assert np.all(np.diff(ds.offsets) > 0)
    assert ds.feature_names[0] and len(ds.feature_names) == N_FEATURES
    (task,) = ds.tasks
    assert task["task_mlir"] == w["task_mlir"] and task["flops"] == w["flops"]
    sketches = {sk.hash: sk for sk in generate_sketches(w["task_mlir"], Target.host())}
    for i, (cand, rec) in enumerate(zip(ds.candidates, recs)):
        assert cand["row"] == i and cand["knobs"] == dict(rec.knobs)
        assert cand["costs"] == list(rec.costs) and cand["error_kind"] == rec.error_kind
        assert ds.error_kind[i] == rec.error_kind and ds.valid[i] == rec.valid
        sk = sketches[rec.sketch_hash]
        assert cand["script"] == sk.concrete(rec.knobs)
        assert "transform.tune.knob" in cand["script"] and " = " in cand["script"].split("tune.knob")[1]
        if rec.valid:
            assert ds.latency_s[i] == pytest.approx(rec.latency_s)
            assert ds.throughput[i] == pytest.approx(w["flops"] / rec.latency_s)
        else:
            assert ds.throughput[i] == 0 and not np.isfinite(ds.latency_s[i])
    # The stored rows are what extract_features gives for that candidate.
    rec = recs[3]
    (want,) = extract_features(sketches[rec.sketch_hash], [tuple(rec.knobs)], isolate=False)
    np.testing.assert_allclose(ds.program(3), want, rtol=1e-5)
    man = json.loads((out / "manifest.json").read_text())
    assert man["format"] == "mlir-ansor-dataset" and man["candidates"] == 8
    assert man["runs"][0]["seed"] == 5


@pytest.mark.slow
def test_train_a_model_on_the_dataset(tuned, tmp_path):
    _, out = tuned
    ds = load(out)
    assert ds.valid.sum() >= 4
    model = train_cost_model(ds, XGBModel(XGBModelConfig(min_records=4, min_child_weight=0.0)))
    assert model.trained
    pred = model.predict(ds.programs())
    assert pred.shape == (len(ds),)
    assert pairwise_accuracy(pred, ds.throughput) > 0.8  # it learned the training set's order
    # train-model writes a file the XGBModel loads, predicting the same.
    path = tmp_path / "model.json"
    assert main(["train-model", str(out), "-o", str(path)]) == 0
    loaded = XGBModel()
    loaded.load(path)
    assert loaded.trained and loaded.predict(ds.programs()).shape == (len(ds),)


def test_load_refuses_other_folders(tmp_path):
    with pytest.raises(InputError, match="no manifest.json"):
        load(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": "other"}')
    with pytest.raises(InputError, match="not 'mlir-ansor-dataset'"):
        load(tmp_path)


@pytest.mark.slow
def test_pretrained_model_is_loaded_and_ranks_the_first_batch(tuned, tmp_path, monkeypatch):
    _, out = tuned
    ds = load(out)
    model = train_cost_model(ds, XGBModel(XGBModelConfig(min_records=4, min_child_weight=0.0)))
    path = tmp_path / "pretrained.json"
    model.save(path)

    config = TuneConfig(trials=4, batch_size=4, timing=TINY, strategy="evolutionary", pretrained_model=str(path))
    strat = make_strategy(config)
    assert isinstance(strat, EvolutionarySearch) and strat.pretrained and strat.model.trained
    np.testing.assert_allclose(strat.model.predict(ds.programs()), model.predict(ds.programs()))

    evolved = []
    real = EvolutionarySearch._evolve

    def spy(self, pool, n):
        out = real(self, pool, n)
        evolved.append(len(out))
        return out

    monkeypatch.setattr(EvolutionarySearch, "_evolve", spy)
    # Without the pretrained model, 4 trials are too few to train one: no evolution.
    tune(str(INPUTS / "matmul.mlir"), config=TuneConfig(trials=4, batch_size=4, timing=TINY,
                                                        strategy="evolutionary"), db=tmp_path / "cold.db")
    assert evolved == []
    result = tune(str(INPUTS / "matmul.mlir"), config=config, db=tmp_path / "warm.db")
    assert evolved and evolved[0] >= 3  # the first batch came (mostly) from the model's ranking
    assert result.tasks[0].trials == 4
    with Database(tmp_path / "warm.db") as db:
        assert db.runs()[0]["config"]["pretrained_model"] == str(path)


def test_missing_pretrained_model_is_an_error(tmp_path):
    from mlir_ansor import AnsorError

    with pytest.raises(AnsorError, match="no such file"):
        make_strategy(TuneConfig(strategy="evolutionary", pretrained_model=str(tmp_path / "none.json")))


@pytest.mark.slow
def test_dataset_doc_example_runs(tuned, monkeypatch, capsys):
    import re
    from pathlib import Path

    _, out = tuned
    doc = (Path(__file__).parent.parent / "docs" / "dataset.md").read_text()
    (block,) = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    monkeypatch.chdir(out.parent)
    exec(compile(block, "docs/dataset.md", "exec"), {"__name__": "__dataset_doc__"})  # noqa: S102
    assert capsys.readouterr().out.startswith("8 candidates of 1 tasks;")
    assert (out.parent / "model.json").exists()


def test_the_builtin_model_ships_loads_and_prefers_good_schedules():
    """`--pretrained-model builtin`: the model in the package loads (its
    feature columns are this version's) and, zero-shot, scores the rule's
    default schedule of a 512^3 matmul (vectorized, register-tiled) above
    most random assignments of the same sketch, for the instruction set it
    was trained on (its "about"'s target). Across instruction sets it ranks
    no better than chance: the model trained on Zen 4 put an AVX2 target's
    default above 48% of them, the one trained on Emerald Rapids 50%."""
    import gzip
    import random

    from mlir_ansor.search.registry import builtin_model_path
    from mlir_ansor.search.sketch import default_assignment

    with gzip.open(builtin_model_path(), "rt") as f:
        about = json.load(f)["about"]
    assert about["made_by"] == "scripts/pretrain_cost_model.py" and about["valid"] > 500
    strat = make_strategy(TuneConfig(strategy="evolutionary", pretrained_model="builtin"))
    assert strat.pretrained and strat.model.trained
    from mlir_ansor.examples import workloads as wl
    from mlir_ansor.graph.task import extract_tasks
    from mlir_ansor.ir.program import load as load_program

    (task,) = extract_tasks(load_program(text=wl.matmul(512, 512, 512)))
    features = tuple(about["target"].removeprefix("cpu:").split("+"))
    trained_on = Target("cpu", 512 if "avx512f" in features else 256, 1, "trained-on", features)
    sk = generate_sketches(task.mlir, trained_on)[0]
    rng = random.Random(0)
    cands = [default_assignment(sk, 1)] + [sk.sample(rng) for _ in range(40)]
    scores = strat.model.predict(extract_features(sk, cands))
    assert np.all(np.isfinite(scores)) and np.ptp(scores) > 0
    assert (scores[1:] < scores[0]).mean() >= 0.75


def test_a_model_saved_with_other_feature_columns_is_refused_by_name(tmp_path):
    from mlir_ansor import AnsorError

    model = XGBModel(XGBModelConfig(min_records=2))
    rng = np.random.default_rng(0)
    model.update([(rng.uniform(size=(2, N_FEATURES)), float(t)) for t in rng.uniform(1, 2, size=8)])
    path = tmp_path / "m.json.gz"
    model.save(path)  # gzip-compressed by its name
    again = XGBModel()
    again.load(path)
    assert again.trained
    import gzip

    with gzip.open(path, "rt") as f:
        data = json.load(f)
    data["features"]["columns"] -= 1
    old = tmp_path / "old.json"
    old.write_text(json.dumps(data))
    with pytest.raises(AnsorError, match="feature columns.*retrain it"):
        make_strategy(TuneConfig(strategy="evolutionary", pretrained_model=str(old)))
