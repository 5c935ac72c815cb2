"""One way of timing a kernel, shared by the benchmarks and their peers.

Standard library only: `peers_tvm.py` imports it from TVM's own virtual env,
where neither numpy's pins nor mlir_ansor are installed, so every system of
`peers.py` is timed by the same loop.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_time(fn: Callable[[], object], min_time: float = 0.5, min_repeat: int = 5, max_repeat: int = 1000) -> float:
    """Median wall time of `fn()` in seconds, after one untimed warm-up call.

    Runs at least `min_repeat` times and until `min_time` seconds are spent
    (at most `max_repeat` runs); the median resists the outliers that other
    processes on a shared machine cause.
    """
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
    rounds: int = 7,
    min_time: float = 0.1,
    min_repeat: int = 3,
    settle_s: float = 0.3,
) -> dict[str, float]:
    """Median wall time (s) of each of `fns`, timed in turns.

    Each round times every function with :func:`median_time` (`min_time`
    seconds, at least `min_repeat` runs), one after the other; the result is
    the median of a function's round medians. On a shared machine the load
    drifts over seconds, so systems timed one after the other see different
    machines; timed in turns, they share the drift and their ratios hold.

    Before each turn the process sleeps `settle_s` seconds: the thread pools
    of the previous system (an OpenMP runtime spins 200 ms after its last
    parallel region by default, OpenBLAS's threads spin too) would otherwise
    take cores from the next. Measured at 2 threads: PyTorch's GEMM 1024 took
    25.2 ms right after numpy's, 16.5 ms alone.
    """
    per: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            time.sleep(settle_s)
            per[name].append(median_time(fn, min_time=min_time, min_repeat=min_repeat))
    return {name: statistics.median(ts) for name, ts in per.items()}
