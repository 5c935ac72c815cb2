"""Progress of a tuning run: a live block on a terminal, log lines elsewhere.

:class:`ProgressDisplay` is an ``on_progress`` callback for
:func:`mlir_ansor.tuner.tune`. On a terminal it keeps a block of lines at the
bottom of stderr, redrawn after every measured batch: trials done out of the
budget, elapsed time and an estimate of the time left, and per task its trials
and best GFLOP/s. Log records printed meanwhile go above the block (a logging
filter erases the block first; the next batch redraws it). When stderr is not
a terminal (a log file, CI), it logs one plain line per batch instead, with
no escape sequences.

Plain ANSI escapes rather than a terminal library: the block is a handful of
lines, and the package keeps its dependencies few.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from typing import TextIO

from mlir_ansor.tuner import TaskResult, TuneProgress

__all__ = ["ProgressDisplay", "format_eta"]

log = logging.getLogger("mlir_ansor")

_UP_AND_CLEAR = "\x1b[1F\x1b[2K"  # cursor to the start of the previous line, erase it


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def _task_line(r: TaskResult, width: int) -> str:
    best = f"{r.gflops:8.1f} GFLOP/s" if math.isfinite(r.best_latency_s) else "       - GFLOP/s"
    speed = (
        f"{r.baseline_latency_s / r.best_latency_s:6.1f}x untuned"
        if math.isfinite(r.best_latency_s) and math.isfinite(r.baseline_latency_s)
        else ""
    )
    errs = sum(r.errors.values())
    tail = f"  {errs} error(s)" if errs else ""
    return f"  {r.task.name[:width]:<{width}} {r.trials:>5} trials {best} {speed}{tail}"


class ProgressDisplay:
    """Callback for ``tune(..., on_progress=...)``.

    live: redraw a block on `stream` (default: whether `stream` is a
    terminal); otherwise log one line per batch.
    max_tasks: tasks shown in the live block (the slowest-to-finish first,
    by weight x latency); the rest are summed in one line.
    """

    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None, max_tasks: int = 12) -> None:
        self.stream = stream or sys.stderr
        if live is None:
            isatty = getattr(self.stream, "isatty", None)
            live = bool(isatty and isatty())
        self.live = live
        self.max_tasks = max_tasks
        self._drawn = 0
        self._filter: logging.Filter | None = None
        self.last: TuneProgress | None = None

    # -- the callback ---------------------------------------------------------

    def __call__(self, p: TuneProgress) -> None:
        self.last = p
        if self.live:
            self._draw(self.lines(p))
        else:
            best = ", ".join(
                f"{r.task.name} {r.gflops:.1f}" for r in p.tasks if math.isfinite(r.best_latency_s)
            )
            log.info(
                "progress: %d/%d trials, %s elapsed, about %s left; best GFLOP/s: %s",
                p.measured,
                p.total_trials,
                format_eta(p.elapsed_s),
                format_eta(self.eta(p)),
                best or "none yet",
            )

    @staticmethod
    def eta(p: TuneProgress) -> float:
        """Seconds left at the rate measured so far."""
        if p.measured <= 0:
            return math.inf
        return max(0, p.total_trials - p.measured) * p.elapsed_s / p.measured

    def lines(self, p: TuneProgress) -> list[str]:
        """The live block's text (without escapes)."""
        frac = min(1.0, p.measured / p.total_trials) if p.total_trials else 1.0
        bar_w = 24
        filled = int(round(frac * bar_w))
        head = (
            f"tuning [{'#' * filled}{'.' * (bar_w - filled)}] {p.measured}/{p.total_trials} trials, "
            f"{format_eta(p.elapsed_s)} elapsed, ~{format_eta(self.eta(p))} left"
        )
        tasks = sorted(
            p.tasks,
            key=lambda r: -(r.task.weight * (r.best_latency_s if math.isfinite(r.best_latency_s) else r.baseline_latency_s)),
        )
        width = max((len(r.task.name) for r in tasks[: self.max_tasks]), default=10)
        width = min(40, max(10, width))
        out = [head] + [_task_line(r, width) for r in tasks[: self.max_tasks]]
        if len(tasks) > self.max_tasks:
            out.append(f"  ... and {len(tasks) - self.max_tasks} more task(s)")
        return out

    # -- terminal drawing -----------------------------------------------------

    def _erase(self) -> None:
        if self._drawn:
            self.stream.write(_UP_AND_CLEAR * self._drawn)
            self.stream.flush()
            self._drawn = 0

    def _draw(self, lines: list[str]) -> None:
        self._erase()
        self.stream.write("".join(line + "\n" for line in lines))
        self.stream.flush()
        self._drawn = len(lines)

    def __enter__(self) -> ProgressDisplay:
        if self.live:
            display = self

            class _EraseFirst(logging.Filter):
                def filter(self, record: logging.LogRecord) -> bool:  # noqa: A003
                    display._erase()
                    return True

            self._filter = _EraseFirst()
            for h in logging.getLogger().handlers:
                h.addFilter(self._filter)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self._filter is not None:
            for h in logging.getLogger().handlers:
                h.removeFilter(self._filter)
            self._filter = None
        # The final block stays on screen: it is the run's summary.
        self._drawn = 0
