"""Which task gets the next batch of trials (Ansor, section 6).

The objective is the end-to-end latency of the module, f = sum_i w_i g_i,
where w_i is the task's weight (occurrences) and g_i its best latency so far.
After a round-robin warm-up (every task gets `warmup_rounds` batches), the
next batch goes to the task whose latency is expected to bring f down
fastest per trial:

    df/dt_i ~= w_i * ( alpha * backward_i + (1 - alpha) * forward_i )
    backward_i = (g_i(t_i) - g_i(t_i - window)) / window         (its recent slope)
    forward_i  = min(-g_i / t_i,                                  (optimistic: keep improving
                     beta * flops_i / max_{k in N(i)} V_k - g_i)   as fast as so far; or reach
                                                                  what similar tasks achieve)

with t_i the task's trials, N(i) the tasks of the same kind (same anchor op
and kind, flops per byte within 4x: `INTENSITY_RATIO`; i itself included) and V_k = flops_k / g_k their best throughput.
For memory-bound tasks (elementwise ops, reductions: `TaskStats.memory_bound`)
flops and V count bytes instead: their arithmetic per byte differs by orders
of magnitude (a GELU's erf against an f64 subtraction), so a flop rate reached
by one promised the other a speed it can never have, and it kept the trials
(a BERT layer gave 98 of 200 to a 30 us subtraction, 16-24 to each of its
three matmuls).
A module of several functions (``tune --sizes``: one static
specialization of a dynamic function per size; or several entry points)
has the objective f = sum_F log(L_F), L_F = sum_{i in F} w_i g_i the
latency of function F: each function counts by its relative gain, so the
largest size does not take the trials of the others (a GEMM tuned at
M = 1, 16, 64, 256 and 1024 with 200 trials gave 140 to M = 1024 and 8 to
M = 1, whose schedule then ran 1.2x slower than one tuned alone). Task
i's gradient is then divided by L_F of its function; with one function
that scales every gradient alike and the choice is the same.

The task with the most negative gradient wins; with probability `epsilon` a
random task is picked instead (exploration). A task without any valid
measurement yet has an unknown latency and goes first. Every choice and its
reason goes to the ``mlir_ansor`` log.

Schedulers are registered by name (`mlir_ansor.search.registry`): "gradient" and
"round-robin" are :class:`TaskScheduler`; "random" (:class:`RandomTaskScheduler`,
a uniformly random live task per batch) is the ablation baseline. A
scheduler of one's own subclasses :class:`BaseTaskScheduler`.
"""

from __future__ import annotations

import abc
import logging
import math
import random
from dataclasses import dataclass, field

log = logging.getLogger("mlir_ansor")

SCHEDULERS = ("gradient", "round-robin")

NO_VALID_AFTER = 48
"""Trials after which a task that has no valid candidate yet stops
drawing batches by its untuned latency (its gradient is then 0, as for a
task with nothing left to gain): a rule whose every schedule failed the
check on one task of a dynamic BERT (12x64x64x64 attention) took 353 of
640 trials while the layer's matmuls waited. The task keeps its default
schedule."""


@dataclass
class TaskStats:
    """What the scheduler knows about one task.

    history: best latency so far after each trial of this run (inf until a
    valid one); best_s: the best latency known (may come from an earlier run).
    """

    name: str
    weight: int
    flops: int
    group: str
    """Tasks with the same group are "similar" (forward estimate)."""
    best_s: float = math.inf
    history: list[float] = field(default_factory=list)
    baseline_s: float = math.inf
    """The untuned latency: stands for g while no candidate is valid."""
    bytes: int = 0
    """Bytes the task's arguments and results hold."""
    memory_bound: bool = False
    """Whether its speed is bytes moved, not arithmetic (elementwise ops,
    reductions): its "similar tasks" estimate compares bytes per second."""
    function: str = ""
    """The function the task occurs in (its first): the objective sums the
    logarithms of the functions' latencies."""

    @property
    def work(self) -> int:
        """What its throughput V counts: bytes for a memory-bound task
        (where it knows them), else flops."""
        return self.bytes if self.memory_bound and self.bytes else self.flops

    @property
    def trials(self) -> int:
        return len(self.history)


INTENSITY_RATIO = 4.0
"""Tasks of one group are "similar" only if their flops per byte are within
this factor of each other."""


def _alike(a: TaskStats, b: TaskStats) -> bool:
    """Whether `a`'s speed says what `b` can reach: their flops per byte
    (where both know their bytes) are within :data:`INTENSITY_RATIO`. A
    1 x 1024 . 1024 x 1024 GEMV does 0.5 flop a byte, the 1024^3 GEMM 170:
    the GEMM's flop rate promised the GEMV a 40x gain it can never have, and
    it kept the trials of a dynamic GEMM's other sizes (148 of 200)."""
    if not (a.bytes and b.bytes and a.flops and b.flops):
        return True
    ratio = (a.flops / a.bytes) / (b.flops / b.bytes)
    return 1 / INTENSITY_RATIO <= ratio <= INTENSITY_RATIO


def function_latency(stats: list[TaskStats], function: str) -> float:
    """L_F: the weighted latencies of the tasks of `function` (the best so
    far, else the untuned one; inf while one has neither)."""
    total = 0.0
    for k in stats:
        if k.function == function:
            g = k.best_s if math.isfinite(k.best_s) else k.baseline_s
            total += k.weight * g
    return total


@dataclass(frozen=True)
class Choice:
    task: int
    reason: str
    gradient: float = 0.0


class BaseTaskScheduler(abc.ABC):
    """The interface of a task scheduler: one instance per tuning run."""

    @abc.abstractmethod
    def choose(self, stats: list[TaskStats], exhausted: set[int] = frozenset()) -> Choice | None:
        """The task to give the next batch to (an index into `stats`, never
        one of `exhausted`), or None to stop tuning."""


class RandomTaskScheduler(BaseTaskScheduler):
    """A uniformly random task that still has candidates (seeded)."""

    def __init__(self, n_tasks: int, *, seed: int = 0) -> None:
        self.n = n_tasks
        self.rng = random.Random(seed)

    def choose(self, stats: list[TaskStats], exhausted: set[int] = frozenset()) -> Choice | None:
        live = [i for i in range(self.n) if i not in exhausted]
        if not live:
            return None
        return Choice(self.rng.choice(live), "random task scheduler")


class TaskScheduler(BaseTaskScheduler):
    """Hands out task indices: round-robin, or gradient-based after a warm-up."""

    def __init__(
        self,
        n_tasks: int,
        *,
        strategy: str = "gradient",
        warmup_rounds: int = 1,
        window: int = 3,
        alpha: float = 0.2,
        beta: float = 2.0,
        epsilon: float = 0.05,
        seed: int = 0,
    ) -> None:
        if strategy not in SCHEDULERS:
            raise ValueError(f"unknown task scheduler {strategy!r}: expected one of {', '.join(SCHEDULERS)}")
        self.n = n_tasks
        self.strategy = strategy
        self.warmup_rounds = warmup_rounds
        self.window = max(1, window)
        self.alpha = alpha
        self.beta = beta
        self.epsilon = epsilon
        self.rng = random.Random(seed)
        self.rounds = [0] * n_tasks
        self._next_rr = 0

    # -- the objective's pieces ------------------------------------------------

    def gradient(self, i: int, stats: list[TaskStats]) -> tuple[float, str]:
        """d(weighted latency)/d(trials of task i), and how it was made."""
        s = stats[i]
        g = s.best_s
        if not math.isfinite(g):
            if s.trials == 0:
                if self.rounds[i] == 0:
                    return -math.inf, "no measurement yet"
                return 0.0, "its first batch is still being measured"
            if s.trials >= NO_VALID_AFTER:
                return 0.0, f"no valid candidate in {s.trials} trials"
            g = s.baseline_s
            if not math.isfinite(g):
                return 0.0, "no valid candidate and no baseline"
        t = max(1, s.trials)
        backward = 0.0
        if s.trials > self.window:
            before = s.history[-1 - self.window]
            if math.isfinite(before):
                backward = (s.history[-1] - before) / self.window
        optimistic = -g / t
        rates = [k.work / k.best_s for k in stats
                 if k.group == s.group and _alike(k, s) and math.isfinite(k.best_s) and k.best_s > 0]
        forward = optimistic
        similar = ""
        if rates and s.work > 0:
            reachable = self.beta * s.work / max(rates) - g
            forward = min(optimistic, reachable)
            unit = "GB/s" if s.memory_bound and s.bytes else "GFLOP/s"
            similar = f", similar tasks reach {max(rates) / 1e9:.3g} {unit}"
        grad = s.weight * (self.alpha * backward + (1 - self.alpha) * forward)
        why = f"backward {backward:.3g} s/trial, forward {forward:.3g} s/trial, weight {s.weight}{similar}"
        scale = function_latency(stats, s.function) if len({k.function for k in stats}) > 1 else math.inf
        if math.isfinite(scale) and scale > 0:
            grad /= scale
            why += f", over @{s.function}'s {scale * 1e3:.3g} ms"
        return grad, why

    # -- choosing --------------------------------------------------------------

    def choose(self, stats: list[TaskStats], exhausted: set[int] = frozenset()) -> Choice | None:
        """The task to give the next batch to, or None when all are exhausted."""
        live = [i for i in range(self.n) if i not in exhausted]
        if not live:
            return None
        if self.strategy == "round-robin":
            choice = self._round_robin(live, "round-robin")
        elif any(self.rounds[i] < self.warmup_rounds for i in live):
            cold = [i for i in live if self.rounds[i] < self.warmup_rounds]
            choice = self._round_robin(cold, f"warm-up ({self.warmup_rounds} batch(es) per task)")
        elif len(live) > 1 and self.rng.random() < self.epsilon:
            choice = Choice(self.rng.choice(live), f"epsilon exploration (p={self.epsilon})")
        else:
            grads = {i: self.gradient(i, stats) for i in live}
            best = min(live, key=lambda i: (grads[i][0], self.rounds[i], i))
            runner_up = min((grads[i][0] for i in live if i != best), default=None)
            extra = f"; next best {runner_up:.3g}" if runner_up is not None else ""
            choice = Choice(best, f"gradient {grads[best][0]:.3g} s/trial ({grads[best][1]}){extra}", grads[best][0])
        self.rounds[choice.task] += 1
        name = stats[choice.task].name if choice.task < len(stats) else str(choice.task)
        log.info("task scheduler: next batch -> %s: %s", name, choice.reason)
        return choice

    def _round_robin(self, candidates: list[int], reason: str) -> Choice:
        for k in range(self.n):
            i = (self._next_rr + k) % self.n
            if i in candidates:
                self._next_rr = (i + 1) % self.n
                return Choice(i, reason)
        return Choice(candidates[0], reason)  # pragma: no cover - candidates is never empty
