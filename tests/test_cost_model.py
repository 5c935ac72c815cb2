"""Cost models: XGBoost learns a ranking, save/load round trip, the random baseline."""

from __future__ import annotations

import numpy as np

from mlir_ansor.search.cost_model import RandomModel, XGBModel, XGBModelConfig, pairwise_accuracy
from mlir_ansor.search.features import N_FEATURES


def _programs(n: int, seed: int):
    """Synthetic programs of 3 statements (the programs of one sketch share
    a statement count); the run time is a sum over statements of a
    nonlinear function of three of the features."""
    rng = np.random.default_rng(seed)
    progs, thr = [], []
    for _ in range(n):
        s = 3
        f = rng.uniform(0, 4, size=(s, N_FEATURES))
        cost = np.sum(np.exp(f[:, 0]) * (1 + (f[:, 5] > 2)) / (1 + f[:, 9]))
        progs.append(f)
        thr.append(1.0 / cost)
    return progs, np.array(thr)


def test_pairwise_accuracy_metric():
    assert pairwise_accuracy([1, 2, 3], [10, 20, 30]) == 1.0
    assert pairwise_accuracy([3, 2, 1], [10, 20, 30]) == 0.0
    assert pairwise_accuracy([1, 1, 1], [10, 20, 30]) == 0.5


def test_xgboost_learns_a_ranking_and_round_trips(tmp_path):
    train, y_train = _programs(400, 0)
    test, y_test = _programs(200, 1)
    model = XGBModel(XGBModelConfig(), seed=0)
    assert not model.trained
    model.update(list(zip(train[:200], y_train[:200])))
    model.update(list(zip(train[200:], y_train[200:])))  # retrains on all 400
    assert model.trained and len(model.features) == 400
    scores = model.predict(test)
    assert scores.shape == (200,)
    acc = pairwise_accuracy(scores, y_test)
    assert acc > 0.8, acc
    path = tmp_path / "model.json"
    model.save(path)
    other = XGBModel()
    other.load(path)
    np.testing.assert_array_equal(other.predict(test), scores)
    assert other.config == model.config


def _programs_that_fail(n: int, seed: int):
    """Synthetic programs of 3 statements that fail (throughput 0) when a
    statement's feature 1 is over 3.5 (as a tile over a limit would), and
    otherwise run in a time that grows with feature 0."""
    rng = np.random.default_rng(seed)
    progs, thr = [], []
    for _ in range(n):
        f = rng.uniform(0, 4, size=(3, N_FEATURES))
        progs.append(f)
        thr.append(0.0 if (f[:, 1] > 3.5).any() else 1.0 / np.sum(1 + f[:, 0]))
    return progs, np.array(thr)


def test_failed_programs_rank_low():
    train, y = _programs_that_fail(200, 4)
    test, y_test = _programs_that_fail(200, 5)
    assert 0.2 < (y == 0).mean() < 0.5 and 0.2 < (y_test == 0).mean() < 0.5
    model = XGBModel(XGBModelConfig(), seed=0)
    model.update(list(zip(train, y)))  # failures are kept with throughput 0
    scores = model.predict(test)
    assert np.isfinite(scores).all()
    # held-out programs that fail score below the ones that run: nearly every
    # (failed, good) pair is ordered (a model trained on the good programs
    # only orders about half of them)
    failed, good = scores[y_test == 0], scores[y_test > 0]
    ordered = (failed[:, None] < good[None, :]).mean()
    assert ordered > 0.95, ordered


def test_random_model_knows_nothing():
    test, y = _programs(300, 3)
    model = RandomModel(seed=0)
    model.update(list(zip(test, y)))
    assert not model.trained
    acc = pairwise_accuracy(model.predict(test), y)
    assert 0.4 < acc < 0.6
