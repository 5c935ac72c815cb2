"""One way of timing a kernel, shared by the benchmarks and their peers.

Standard library only: `peers_tvm.py` imports it from TVM's own virtual env,
where neither numpy's pins nor mlir_ansor are installed, so every system of
`peers.py` is timed by the same loop.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_time(
    fn: Callable[[], object],
    min_time: float = 0.5,
    min_repeat: int = 5,
    max_repeat: int = 1000,
    warmup_s: float = 0.0,
) -> float:
    """Median wall time of `fn()` in seconds, after one untimed warm-up call
    (and more, untimed, for `warmup_s` seconds).

    Runs at least `min_repeat` times and until `min_time` seconds are spent
    (at most `max_repeat` runs); the median resists the outliers that other
    processes on a shared machine cause.
    """
    fn()
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_s:
        fn()
    ts: list[float] = []
    total = 0.0
    while len(ts) < min_repeat or total < min_time:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        ts.append(dt)
        total += dt
        if len(ts) >= max_repeat:
            break
    return statistics.median(ts)


def interleaved_medians(
    fns: dict[str, Callable[[], object]],
    rounds: int = 5,
    min_time: float = 0.5,
    min_repeat: int = 3,
    warmup_s: float = 0.3,
) -> dict[str, float]:
    """Median wall time (s) of each of `fns`, timed in turns.

    Each round times every function with :func:`median_time` (`min_time`
    seconds, at least `min_repeat` runs), one after the other; the result is
    the median of a function's round medians. On a shared machine the load
    drifts over seconds, so systems timed one after the other see different
    machines; timed in turns, they share the drift and their ratios hold.

    Each turn first runs its function, untimed, for `warmup_s` seconds:
    the previous system's thread pools may still spin then (an OpenMP
    runtime spins 200 ms after its last parallel region by default, and
    OpenBLAS's threads spin too), taking cores from this one. At 2 threads,
    PyTorch's GEMM 1024 took 25.2 ms right after numpy's and 16.5 ms alone.
    Sleeping between turns instead is worse: on these VMs a kernel timed
    right after a 0.3 s sleep ran 3.5-6.9 ms where it ran 2.9 ms back to
    back (DIL, one thread).
    """
    per = interleaved_times(fns, rounds, min_time, min_repeat, warmup_s)
    return {name: statistics.median(ts) for name, ts in per.items()}


def interleaved_times(
    fns: dict[str, Callable[[], object]],
    rounds: int = 5,
    min_time: float = 0.5,
    min_repeat: int = 3,
    warmup_s: float = 0.3,
) -> dict[str, list[float]]:
    """Each of `fns`' round medians (s), timed in turns as
    :func:`interleaved_medians` times them: one entry per round, for
    :func:`paired_ratio`."""
    per: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            per[name].append(median_time(fn, min_time=min_time, min_repeat=min_repeat, warmup_s=warmup_s))
    return per


def paired_ratio(num: list[float], den: list[float]) -> float:
    """The median over rounds of ``num[i] / den[i]``: two systems' times
    taken in the same round, in turns. On these VMs the speed moves by
    1.3-1.5x within seconds; the ratio of each system's median over all
    rounds lets the phase of one round decide it, the ratio within each
    round does not (a 7-row GEMM against its static module read 1.54 from
    5 rounds' medians, 1.10-1.15 from 13 rounds' ratios)."""
    if not num or len(num) != len(den):
        raise ValueError(f"paired_ratio: {len(num)} and {len(den)} rounds")
    return statistics.median(x / y for x, y in zip(num, den))
