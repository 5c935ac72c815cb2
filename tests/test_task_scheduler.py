"""The task scheduler's allocation logic, on synthetic histories (no MLIR)."""

from __future__ import annotations

import logging
import math

import pytest

from mlir_ansor.search.task_scheduler import TaskScheduler, TaskStats


def _stats(name, weight, flops, hist, group="contraction:linalg.matmul", baseline=math.inf):
    best = min(hist) if hist else math.inf
    running = []
    cur = math.inf
    for h in hist:
        cur = min(cur, h)
        running.append(cur)
    return TaskStats(name, weight, flops, group, best, running, baseline)


def _warm(sched, stats):
    for _ in range(len(stats) * sched.warmup_rounds):
        sched.choose(stats)


def test_round_robin_cycles_and_skips_exhausted():
    stats = [_stats(f"t{i}", 1, 1, [1.0]) for i in range(3)]
    s = TaskScheduler(3, strategy="round-robin")
    assert [s.choose(stats).task for _ in range(4)] == [0, 1, 2, 0]
    assert [s.choose(stats, {2}).task for _ in range(3)] == [1, 0, 1]
    assert s.choose(stats, {0, 1, 2}) is None


def test_warmup_is_round_robin_then_gradient():
    stats = [_stats(f"t{i}", 1, 10**6, [1e-3]) for i in range(3)]
    s = TaskScheduler(3, warmup_rounds=2, epsilon=0.0)
    first = [s.choose(stats) for _ in range(6)]
    assert [c.task for c in first] == [0, 1, 2, 0, 1, 2]
    assert all("warm-up" in c.reason for c in first)
    assert "gradient" in s.choose(stats).reason


def test_heavier_weight_wins_with_equal_histories():
    hist = [4e-3, 3e-3, 2e-3, 1.5e-3]
    stats = [_stats("light", 1, 10**7, hist), _stats("heavy", 5, 10**7, hist)]
    s = TaskScheduler(2, epsilon=0.0)
    _warm(s, stats)
    assert s.choose(stats).task == 1


def test_still_improving_beats_converged():
    # same weight and flops: one task is still falling fast, the other flat
    improving = _stats("improving", 1, 10**7, [8e-3, 6e-3, 4e-3, 2e-3, 1e-3])
    flat = _stats("flat", 1, 10**7, [1e-3] * 40)
    s = TaskScheduler(2, epsilon=0.0, window=3)
    _warm(s, [flat, improving])
    assert s.choose([flat, improving]).task == 1
    g_flat, _ = s.gradient(0, [flat, improving])
    g_imp, _ = s.gradient(1, [flat, improving])
    assert g_imp < g_flat < 0


def test_forward_estimate_from_similar_tasks():
    # task 0 reaches 100 GFLOP/s; task 1 (same kind, many trials, flat) is at 1
    # GFLOP/s, so similar tasks say it can gain a lot; task 2 is of another kind
    # and has no better peer.
    fast = _stats("fast", 1, 10**9, [1e-2] * 50)
    slow = _stats("slow", 1, 10**7, [1e-2] * 50)
    other = _stats("other", 1, 10**7, [1e-2] * 50, group="reduction:linalg.generic")
    stats = [fast, slow, other]
    s = TaskScheduler(3, epsilon=0.0, beta=2.0)
    _warm(s, stats)
    g = [s.gradient(i, stats)[0] for i in range(3)]
    assert g[1] < g[2] and g[1] < g[0]
    assert s.choose(stats).task == 1
    # the forward term is capped by what the similar tasks reach
    expected_forward = min(-1e-2 / 50, 2.0 * 10**7 / (10**9 / 1e-2) - 1e-2)
    assert g[1] == pytest.approx(0.8 * expected_forward)


def test_task_without_measurement_goes_first_and_failing_task_uses_baseline():
    stats = [_stats("done", 1, 10**7, [1e-3] * 5), _stats("new", 1, 10**7, [])]
    s = TaskScheduler(2, epsilon=0.0, warmup_rounds=0)
    assert s.choose(stats).task == 1
    # all candidates failed so far: the untuned latency stands for g
    failing = TaskStats("failing", 1, 10**7, "x", math.inf, [math.inf] * 4, baseline_s=2e-3)
    g, why = s.gradient(0, [failing])
    assert g == pytest.approx(0.8 * (-2e-3 / 4)) and "forward" in why
    # ... until NO_VALID_AFTER trials: then it waits behind every task that
    # can still gain (its untuned latency promised 100x here)
    from mlir_ansor.search.task_scheduler import NO_VALID_AFTER

    hopeless = TaskStats("failing", 1, 10**7, "x", math.inf, [math.inf] * NO_VALID_AFTER, baseline_s=1e-1)
    assert s.gradient(0, [hopeless]) == (0.0, f"no valid candidate in {NO_VALID_AFTER} trials")
    assert s.choose([hopeless, _stats("done", 1, 10**7, [1e-3] * 5)]).task == 1


def test_epsilon_explores_and_everything_is_logged(caplog):
    stats = [_stats("a", 100, 10**7, [1.0] * 10), _stats("b", 1, 10**7, [1.0] * 10)]
    s = TaskScheduler(2, epsilon=1.0, warmup_rounds=0, seed=1)
    with caplog.at_level(logging.INFO, logger="mlir_ansor"):
        picks = [s.choose(stats).task for _ in range(40)]
    assert set(picks) == {0, 1}
    assert sum("epsilon exploration" in r.message for r in caplog.records) == 40
    greedy = TaskScheduler(2, epsilon=0.0, warmup_rounds=0)
    with caplog.at_level(logging.INFO, logger="mlir_ansor"):
        assert greedy.choose(stats).task == 0
    assert "gradient" in caplog.records[-1].message and "-> a" in caplog.records[-1].message


def test_allocation_follows_the_objective():
    """Simulate tasks whose latency falls as 1/sqrt(trials) towards a floor;
    the gradient scheduler lowers the weighted sum faster than round-robin."""

    def simulate(strategy):
        tasks = [("big", 10, 1.0, 0.05), ("small", 1, 1.0, 0.05), ("tiny", 1, 0.1, 0.05)]
        hists = [[] for _ in tasks]
        s = TaskScheduler(len(tasks), strategy=strategy, epsilon=0.0, seed=0)
        for _ in range(60):
            stats = [
                TaskStats(n, w, 10**6, n, min(h) if h else math.inf, list(h), g0)
                for (n, w, g0, _), h in zip(tasks, hists)
            ]
            i = s.choose(stats).task
            for _ in range(4):  # a batch of 4 trials
                n, w, g0, floor = tasks[i]
                t = len(hists[i]) + 1
                lat = max(floor * g0, g0 / math.sqrt(t))
                hists[i].append(min([lat] + hists[i]))
        return sum(w * min(h) for (_, w, _, _), h in zip(tasks, hists))

    assert simulate("gradient") < simulate("round-robin")


def test_unknown_strategy():
    with pytest.raises(ValueError, match="round-robin"):
        TaskScheduler(2, strategy="magic")


def test_memory_bound_tasks_compare_bytes_not_flops():
    """BERT's case: a 70 us f64 subtraction (few flops per byte) beside a
    GELU that reaches many GFLOP/s on as many bytes. Compared in flops, the
    subtraction "could" run 10x faster and kept taking the trials from a
    heavier matmul; compared in bytes per second (what bounds both), it is
    already as fast as the GELU, and the matmul gets the batch."""
    flat = [7e-5] * 40
    gelu = dict(name="gelu", weight=1, flops=40 * 10**6, hist=[1.3e-4] * 3, group="elementwise:linalg.generic")
    sub = dict(name="sub", weight=2, flops=2 * 10**5, hist=flat, group="elementwise:linalg.generic")
    matmul = _stats("matmul", 4, 151 * 10**6, [4.6e-4, 4.5e-4] + [4.44e-4] * 30)
    for memory_bound, winner in ((False, "sub"), (True, "matmul")):
        tasks = [_stats(**gelu), _stats(**sub), matmul]
        for t, nbytes in zip(tasks[:2], (1_572_864, 2_359_296)):
            # (without bytes, nothing tells their flops per byte apart either)
            t.bytes, t.memory_bound = (nbytes if memory_bound else 0), memory_bound
        s = TaskScheduler(3, epsilon=0.0)
        _warm(s, tasks)
        assert tasks[s.choose(tasks).task].name == winner


def test_each_function_counts_by_its_relative_gain():
    """`tune --sizes`: one static GEMM per size, each a function of its own.
    By absolute time the M = 1024 GEMM took nearly every trial (140 of 200,
    8 for M = 1, which then ran 1.2x slower than tuned alone); with the
    functions' latencies in the objective as logarithms, a small size still
    improving as fast, relatively, gets its batches. With one function the
    objective picks what the weighted sum picks."""

    def run(functions):
        # (name, flops, latency before, latency now: both 10% faster a batch)
        tasks = [("m1", 2 * 1024**2, 6.0e-5, 5.4e-5), ("m1024", 2 * 1024**3, 2.4e-2, 2.16e-2)]
        stats = [_stats(n, 1, flops, [g0] * 4 + [g1] * 4) for n, flops, g0, g1 in tasks]
        for st, f in zip(stats, functions):
            st.function = f
        s = TaskScheduler(2, epsilon=0.0, window=3)
        _warm(s, stats)
        return [stats[s.choose(stats).task].name for _ in range(4)]

    assert run(["main", "main"]) == ["m1024"] * 4
    picked = run(["main__0_0_1", "main__0_0_1024"])
    assert "m1" in picked


def test_tasks_of_other_arithmetic_intensity_are_not_similar():
    """A GEMV (0.5 flop a byte) does not take a GEMM's flop rate (170 a
    byte) as what it could reach: that promise kept every trial of a
    dynamic GEMM's tune on M = 1 (148 of 200)."""
    gemv = _stats("gemv", 1, 2 * 1024**2, [6.0e-5] * 8)
    gemm = _stats("gemm", 1, 2 * 1024**3, [2.4e-2] * 6 + [2.16e-2] * 2)  # still improving
    gemv.bytes, gemm.bytes = 4 * (1024 + 1024**2 + 1024), 4 * 3 * 1024**2
    gemv.function, gemm.function = "main__0_0_1", "main__0_0_1024"
    s = TaskScheduler(2, epsilon=0.0, window=3)
    _warm(s, [gemv, gemm])
    grad, why = s.gradient(0, [gemv, gemm])
    assert "reach 35 GFLOP/s" in why and grad == pytest.approx(-0.8 / 8)  # its own rate: (1 - alpha) g/t over L_F = g
    assert [gemv, gemm][s.choose([gemv, gemm]).task].name == "gemm"
