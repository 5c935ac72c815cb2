"""The interface every search strategy implements, and what it is given."""

from __future__ import annotations

import abc
import math
import random
from dataclasses import dataclass, field

from mlir_ansor.graph.task import Task
from mlir_ansor.search.sketch import Sketch
from mlir_ansor.search.space import Assignment
from mlir_ansor.target import Target


@dataclass
class TaskContext:
    """What a strategy knows about its task.

    sketches: the task's sketches, the rule-based one first.
    threads: threads the kernels will run on (a forall with fewer
      iterations than threads wastes cores).
    seed: the strategy's random stream derives from it, so the same seed
      gives the same candidates.
    measured: (sketch hash, assignment) pairs already measured (in earlier
      runs too: a resumed run never measures one twice).
    history: earlier valid measurements, for warm starts.
    seeds: candidates to measure first, before any sampling (the rules'
      default points, `sketch.default_assignment`): a task that gets one
      batch has the rule's guess measured, not only random points.
    """

    task: Task
    sketches: list[Sketch]
    target: Target
    threads: int
    seed: int
    measured: set[tuple[str, Assignment]] = field(default_factory=set)
    history: list[MeasuredCandidate] = field(default_factory=list)
    seeds: list[tuple[Sketch, Assignment]] = field(default_factory=list)

    def take_seeds(self, n: int) -> list[tuple[Sketch, Assignment]]:
        """Up to `n` seeds not measured yet, each handed out once and marked
        measured."""
        out: list[tuple[Sketch, Assignment]] = []
        while self.seeds and len(out) < n:
            sk, a = self.seeds.pop(0)
            if (sk.hash, a) in self.measured or not usable(sk, a, self.threads):
                continue
            self.measured.add((sk.hash, a))
            out.append((sk, a))
        return out

    def rng(self, salt: str = "") -> random.Random:
        return random.Random(f"{self.seed}:{self.task.workload_key}:{salt}")


@dataclass(frozen=True)
class MeasuredCandidate:
    """The outcome of one candidate: costs in seconds (empty when invalid)."""

    sketch: Sketch
    knobs: Assignment
    costs: tuple[float, ...]
    error_kind: str = "none"

    @property
    def valid(self) -> bool:
        return self.error_kind == "none" and bool(self.costs)

    @property
    def latency_s(self) -> float:
        if not self.valid:
            return math.inf
        c = sorted(self.costs)
        return c[len(c) // 2]


class SearchStrategy(abc.ABC):
    """Proposes candidates for one task, learning from their measurements."""

    name: str = "abstract"

    def pre_tuning(self, ctx: TaskContext) -> None:
        """Called once before the first `generate_candidates`."""
        self.ctx = ctx

    @abc.abstractmethod
    def generate_candidates(self, n: int) -> list[tuple[Sketch, Assignment]] | None:
        """Up to `n` new candidates, never measured before; None when the
        strategy has nothing left to propose."""

    @property
    def prefetch_ok(self) -> bool:
        """Whether the next batch may be drawn before the results of the
        batch being measured arrive (the tuner builds it meanwhile). A
        learning strategy says no until it has something to learn from, so
        that its first model-guided batch is not drawn blind."""
        return True

    def notify_results(self, results: list[MeasuredCandidate]) -> None:  # noqa: B027 - optional hook
        """Called with the outcome of every candidate it proposed."""

    def post_tuning(self) -> None:  # noqa: B027 - optional hook
        """Called once when the task's tuning ends."""


def balanced(iterations: int, threads: int) -> bool:
    """Whether a parallel loop of `iterations` keeps `threads` threads busy:
    at least one iteration each, and an even split unless there are many
    (then the imbalance is small). With one thread every schedule is fine."""
    if threads <= 1:
        return True
    return iterations >= threads and (iterations % threads == 0 or iterations >= 8 * threads)


def usable(sketch: Sketch, knobs: Assignment, threads: int) -> bool:
    """Whether a sampled assignment is worth measuring at `threads` threads
    (a forall that cannot keep the threads busy is not, unless the loop
    nest is too small to ever do so)."""
    if sketch.violation(knobs) is not None:  # a limit of the target (GPU sketches)
        return False
    max_parallel = math.prod(e for _, e in sketch.forall)
    return max_parallel < threads or balanced(sketch.parallelism(knobs), threads)
