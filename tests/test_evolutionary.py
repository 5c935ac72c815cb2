"""Evolutionary search: valid mutations and crossovers, no duplicates,
determinism, and that it beats random search on a synthetic objective
(a fake measurement: no candidate is built)."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from conftest import INPUTS

from mlir_ansor.graph.task import extract_tasks
from mlir_ansor.search import registry
from mlir_ansor.search.cost_model import XGBModel
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.search.space import is_valid, sample
from mlir_ansor.search.strategy import (
    EvolutionarySearch,
    MeasuredCandidate,
    RandomSearch,
    TaskContext,
)
from mlir_ansor.search.strategy.evolutionary import (
    EvolutionConfig,
    crossover,
    distance,
    knob_kind,
    mutate,
    neighbours,
    pick_diverse,
    repair,
)
from mlir_ansor.target import Target
from mlir_ansor.tuner import TuneConfig

AVX2 = Target("cpu", 256, 2, "test", ("avx2", "fma"))
SMALL = EvolutionConfig(population=64, generations=3, min_train=16, isolate_probes=False)
REFINE = replace(SMALL, local_share=0.25)


@pytest.fixture(scope="module")
def task_and_sketches():
    (task,) = extract_tasks(str(INPUTS / "matmul.mlir"))
    return task, generate_sketches(task.mlir, AVX2)


def _ctx(task_and_sketches, seed: int, measured=None) -> TaskContext:
    task, sketches = task_and_sketches
    return TaskContext(task, list(sketches), AVX2, 1, seed, measured=set(measured or ()))


def fake_gflops(knobs) -> float:
    """A smooth synthetic objective with one optimum inside the space."""
    d = dict(knobs)
    lg = lambda k: math.log2(d[k])  # noqa: E731
    dist = (lg("r_d0") - 2) ** 2 + (lg("r_d1") - 4) ** 2 + (lg("p_d0") - 5) ** 2
    dist += (lg("p_d1") - 6) ** 2 + (lg("k_d2") - 4) ** 2 + (lg("u_d2") - 1) ** 2
    return 100.0 * math.exp(-dist / 4) * (1.3 if d["pack"] == 0 else 1.0)


def _run(strategy, ctx, budget: int, batch: int = 8) -> tuple[list, float]:
    """Drive a strategy through its lifecycle with fake measurements."""
    strategy.pre_tuning(ctx)
    proposed = []
    best = 0.0
    while len(proposed) < budget:
        cands = strategy.generate_candidates(min(batch, budget - len(proposed)))
        if not cands:
            break
        results = []
        for sk, knobs in cands:
            g = fake_gflops(knobs) if sk.name == "cpu-contraction" else 0.1
            best = max(best, g)
            results.append(MeasuredCandidate(sk, knobs, (ctx.task.flops / (g * 1e9),)))
        proposed.extend(cands)
        strategy.notify_results(results)
    strategy.post_tuning()
    return proposed, best


def test_mutation_and_crossover_stay_valid(task_and_sketches):
    _, sketches = task_and_sketches
    sk = sketches[0]
    rng = random.Random(0)
    kinds = {knob_kind(k) for k in sk.knobs}
    assert kinds == {"tile", "parallel", "unroll", "vector", "alternative"}
    changed = 0
    for _ in range(300):
        a, b = sample(sk.knobs, rng), sample(sk.knobs, rng)
        m = mutate(sk.knobs, a, rng)
        c = crossover(sk.knobs, a, b, rng)
        assert is_valid(sk.knobs, m) and is_valid(sk.knobs, c)
        # Knobs without constraints are inherited unchanged from a parent.
        free = [k.name for k in sk.knobs if k.multiple_of is None and k.divides is None]
        assert all(dict(c)[k] in (dict(a)[k], dict(b)[k]) for k in free)
        changed += m != a
    assert changed > 250  # a mutation almost always changes something
    # Repair keeps what is valid and fixes the rest.
    a = sample(sk.knobs, rng)
    assert repair(sk.knobs, dict(a)) == a
    broken = dict(a, r_d0=8, p_d0=4)
    assert is_valid(sk.knobs, repair(sk.knobs, broken))


def test_batches_are_kept_apart(task_and_sketches):
    """pick_diverse takes the best-ranked candidates that differ in at least
    min_distance knobs from those taken, and relaxes only to fill the batch."""
    sk = task_and_sketches[1][0]
    rng = random.Random(0)
    base = sample(sk.knobs, rng)
    near = [mutate(sk.knobs, base, rng) for _ in range(40)]  # one knob away, mostly
    far = [sample(sk.knobs, rng) for _ in range(40)]
    ranked = [(sk, a) for a in dict.fromkeys([base, *near, *far])]
    picked = [a for _, a in pick_diverse(ranked, 8, 3)]
    assert picked[0] == base  # the best first
    assert all(distance(x, y) >= 3 for i, x in enumerate(picked) for y in picked[:i])
    # Too few far-apart candidates: the batch is still filled, best first.
    few = pick_diverse(ranked[:5], 5, 3)
    assert len(few) == 5 and few[0][1] == base
    assert pick_diverse(ranked, 8, 1) == ranked[:8]


def test_neighbours_move_one_knob_to_an_adjacent_option(task_and_sketches):
    sk = task_and_sketches[1][0]
    a = sample(sk.knobs, random.Random(4))
    near = neighbours(sk.knobs, a)
    assert near and a not in near and len(set(near)) == len(near)
    assert all(is_valid(sk.knobs, b) for b in near)
    for k in sk.knobs:  # every knob that has room moves both ways, when still valid
        opts = list(k.options)
        if dict(a)[k.name] in opts and len(opts) > 1:
            assert any(dict(b)[k.name] != dict(a)[k.name] for b in near), k.name


def test_every_model_batch_refines_the_incumbent(task_and_sketches):
    """With local_share, each batch chosen by the model holds neighbours of
    the best candidate measured so far (the diverse rest alone holds fewer)."""
    counts = [_neighbours_in_second_batch(task_and_sketches, share) for share in (REFINE.local_share, 0.0)]
    assert counts[0] >= round(16 * REFINE.local_share) > counts[1], counts


def _neighbours_in_second_batch(task_and_sketches, share: float) -> int:
    ctx = _ctx(task_and_sketches, 2)
    strat = EvolutionarySearch(replace(SMALL, local_share=share), model=XGBModel(seed=2))
    strat.pre_tuning(ctx)
    first = strat.generate_candidates(16)
    strat.notify_results([MeasuredCandidate(s, a, (ctx.task.flops / (fake_gflops(a) * 1e9),)) for s, a in first])
    best = max(first, key=lambda c: fake_gflops(c[1]))
    batch = strat.generate_candidates(16)
    near = set(neighbours(best[0].knobs, best[1]))
    return sum(a in near for _, a in batch)


def test_registered_and_built_from_the_config():
    strat = registry.make_strategy(TuneConfig(strategy="evolutionary", seed=3))
    assert isinstance(strat, EvolutionarySearch) and isinstance(strat.model, XGBModel)


def test_no_duplicates_never_measured_and_deterministic(task_and_sketches):
    sk = task_and_sketches[1][0]
    pre = {(sk.hash, sample(sk.knobs, random.Random(i))) for i in range(20)}
    runs = []
    for _ in range(2):
        ctx = _ctx(task_and_sketches, 5, measured=pre)
        proposed, _ = _run(EvolutionarySearch(SMALL, model=XGBModel(seed=5)), ctx, 48)
        keys = [(s.hash, a) for s, a in proposed]
        assert len(keys) == len(set(keys)) == 48
        assert not set(keys) & pre
        assert all(is_valid(s.knobs, a) for s, a in proposed)
        runs.append(keys)
    assert runs[0] == runs[1]


def test_evolutionary_beats_random_with_the_same_budget(task_and_sketches):
    budget = 64
    evo, rnd = [], []
    for seed in (0, 1, 2):
        _, b_evo = _run(EvolutionarySearch(SMALL, model=XGBModel(seed=seed)), _ctx(task_and_sketches, seed), budget)
        _, b_rnd = _run(RandomSearch(), _ctx(task_and_sketches, seed), budget)
        evo.append(b_evo)
        rnd.append(b_rnd)
    print("best GFLOP/s, evolutionary:", evo, "random:", rnd)
    assert sorted(evo)[1] > sorted(rnd)[1], (evo, rnd)  # the medians
    assert sum(evo) > sum(rnd)


def test_warm_start_from_history(task_and_sketches):
    task, sketches = task_and_sketches
    sk = sketches[0]
    rng = random.Random(9)
    history = []
    for _ in range(24):
        a = sample(sk.knobs, rng)
        history.append(MeasuredCandidate(sk, a, (task.flops / (fake_gflops(a) * 1e9),)))
    ctx = _ctx(task_and_sketches, 9)
    ctx.history = history
    strat = EvolutionarySearch(SMALL, model=XGBModel(seed=9))
    strat.pre_tuning(ctx)
    assert strat.model.trained
    cands = strat.generate_candidates(8)
    assert len(cands) == 8
    # The batch mixes model-ranked candidates with eps-greedy random ones,
    # and the model-ranked ones are better on average than random samples.
    mean_pick = sum(fake_gflops(a) for _, a in cands) / len(cands)
    mean_rand = sum(fake_gflops(sample(sk.knobs, rng)) for _ in range(200)) / 200
    assert mean_pick > mean_rand


def test_records_are_featurized_only_once_the_model_can_train_on_them(task_and_sketches, monkeypatch):
    """A task with fewer records than the search needs before it ranks
    costs no feature extraction; at ``min_train`` every kept record is
    learned at once, and the model equals one fed batch by batch."""
    task, sketches = task_and_sketches
    sk = sketches[0]
    rng = random.Random(5)
    batches = []
    for _ in range(4):
        batch = []
        for _ in range(4):
            a = sample(sk.knobs, rng)
            batch.append(MeasuredCandidate(sk, a, (task.flops / (fake_gflops(a) * 1e9),)))
        batches.append(batch)
    featurized: list[int] = []
    real = EvolutionarySearch._features
    monkeypatch.setattr(EvolutionarySearch, "_features", lambda self, c: featurized.append(len(c)) or real(self, c))

    lazy = EvolutionarySearch(SMALL, model=XGBModel(seed=5))
    lazy.pre_tuning(_ctx(task_and_sketches, 5))
    for b in batches[:3]:
        lazy.notify_results(b)
    assert featurized == [] and not lazy.model.trained and len(lazy.results) == 12
    lazy.notify_results(batches[3])
    assert featurized == [16] and lazy.model.trained

    # The same records given to the model batch by batch: the same ranking.
    eager = XGBModel(seed=5)
    for b in batches:
        eager.update(list(zip(real(lazy, [(r.sketch, r.knobs) for r in b]), [task.flops / r.latency_s for r in b])))
    probe = [(sk, sample(sk.knobs, rng)) for _ in range(32)]
    feats = real(lazy, probe)
    assert list(lazy.model.predict(feats)) == pytest.approx(list(eager.predict(feats)))

    # A model that never learns (the "no cost model" ablation) is never fed.
    from mlir_ansor.search.cost_model import RandomModel

    featurized.clear()
    blind = EvolutionarySearch(SMALL, model=RandomModel(5))
    blind.pre_tuning(_ctx(task_and_sketches, 5))
    for b in batches:
        blind.notify_results(b)
    assert featurized == [] and blind.n_records == 16
