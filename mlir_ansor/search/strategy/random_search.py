"""Random search: Ansor's random annotation, and the baseline of the others.

Each candidate is a fresh sample of the knobs (valid by construction). The
rule-based sketch (the first) is sampled alone; the fallback sketches join
once it has failed `fallback_after` times, so a rule that cannot compile a
task does not waste the budget.
"""

from __future__ import annotations

from mlir_ansor.search.sketch import Sketch
from mlir_ansor.search.space import Assignment
from mlir_ansor.search.strategy.base import MeasuredCandidate, SearchStrategy, TaskContext, usable


class RandomSearch(SearchStrategy):
    name = "random"

    def __init__(self, *, max_tries: int = 200, fallback_after: int = 32) -> None:
        self.max_tries = max_tries
        self.fallback_after = fallback_after
        self.failures = 0

    def pre_tuning(self, ctx: TaskContext) -> None:
        super().pre_tuning(ctx)
        self.rng = ctx.rng("random")

    def _pool(self) -> list[Sketch]:
        sk = self.ctx.sketches
        return sk if len(sk) == 1 or self.failures >= self.fallback_after else sk[:1]

    def generate_candidates(self, n: int) -> list[tuple[Sketch, Assignment]] | None:
        pool = self._pool()
        out = self.ctx.take_seeds(n)
        tries = 0
        while len(out) < n and tries < self.max_tries:
            tries += 1
            sk = pool[self.rng.randrange(len(pool))]
            knobs = sk.sample(self.rng)
            key = (sk.hash, knobs)
            if key in self.ctx.measured or not usable(sk, knobs, self.ctx.threads):
                continue
            self.ctx.measured.add(key)
            out.append((sk, knobs))
        return out or None

    def notify_results(self, results: list[MeasuredCandidate]) -> None:
        self.failures += sum(1 for r in results if not r.valid)
