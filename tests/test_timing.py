"""The benchmarks' timing helpers (`benchmarks/timing.py`)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from timing import interleaved_times, paired_ratio  # noqa: E402


def test_a_ratio_is_taken_within_each_round():
    """System a takes 1.1x system b's time in four rounds of five; the
    machine's speed halved between their turns in the third. The rounds'
    ratios say 1.1; the ratio of the two systems' medians says 0.55."""
    a = [1.1 * p for p in (1, 1, 1, 2, 2)]
    b = [1.0 * p for p in (1, 1, 2, 2, 2)]
    assert paired_ratio(a, b) == pytest.approx(1.1)
    assert statistics.median(a) / statistics.median(b) == pytest.approx(0.55)
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])


def test_interleaved_times_gives_one_time_per_round_in_turns():
    order: list[str] = []
    times = interleaved_times({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                              rounds=3, min_time=0.0, min_repeat=1, warmup_s=0.0)
    assert [len(v) for v in times.values()] == [3, 3]
    assert all(t >= 0 for v in times.values() for t in v)
    # each round runs a's calls, then b's: the turns alternate
    runs = "".join(order)
    assert runs.count("ab") >= 1 and runs.count("ba") >= 2
