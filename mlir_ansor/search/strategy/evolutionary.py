"""Evolutionary search ranked by a learned cost model (Ansor, section 5).

Roadmap: :class:`EvolutionarySearch` is the strategy; its knobs live in
:class:`EvolutionConfig`. Per batch (:meth:`EvolutionarySearch.generate_candidates`):

  1. until the cost model is trained (``min_train`` measured records), the
     batch is random annotation, as in :class:`RandomSearch`; a pretrained
     model (``pretrained=True``, `TuneConfig.pretrained_model`) ranks from
     the first batch;
  2. otherwise an initial population is the best measured candidates (this
     run's and the database's, ``ctx.history``) plus random samples;
  3. for ``generations`` rounds, every member is scored by the model (over
     the features of `search/features/`, a whole population at once),
     parents are drawn with probability rising with their score, and
     children are made by :func:`mutate` (one knob: a tile size, the
     parallel granularity ``p_*``, the unroll ``u_*``, the vector width
     ``r_*`` of the vector loop, or an alternative) or :func:`crossover`
     (per knob, either parent's value; only parents of one sketch); every
     child is repaired to a valid assignment (:func:`repair`, with
     ``KnobSpec.allowed``);
  4. the batch is the best-scored candidates never measured, kept apart
     (:func:`pick_diverse`: any two differ in at least ``min_distance``
     knobs while enough candidates do), with ``eps_greedy`` of it replaced
     by random samples (the model is wrong somewhere; random candidates
     find where), and ``local_share`` of it (none by default) taken from
     the best-scored :func:`neighbours` of the best measured candidate (one
     knob moved to an adjacent option: refinement, where the rest explores).

Measured results come back through :meth:`notify_results`; the model is
retrained on all of them (throughput = task flops / latency; failures count
as 0). No candidate is proposed twice (``ctx.measured`` holds every
(sketch, assignment) measured, in earlier runs too); two assignments that
compile to the same machine code are measured once by the tuner, which
compares binary hashes.

Not in the search space: loop order (the sketches have no loop-order knob
yet).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mlir_ansor.search.cost_model import CostModel, RandomModel, XGBModel
from mlir_ansor.search.features import extractor_for
from mlir_ansor.search.sketch import Sketch
from mlir_ansor.search.space import Assignment, KnobSpec, make_assignment
from mlir_ansor.search.strategy.base import MeasuredCandidate, SearchStrategy, TaskContext, usable


@dataclass(frozen=True)
class EvolutionConfig:
    """How the evolutionary search spends its effort.

    population: candidates alive in each generation.
    generations: rounds of selection, mutation and crossover per batch.
    mutation_prob: chance that a child is a mutation (else a crossover).
    eps_greedy: share of every batch drawn at random instead of by score.
    init_measured: best measured candidates seeded into the first population.
    min_train: measured candidates (valid or not) before the model is used.
    fallback_after: failures of the rule-based sketch before the fallback
      sketches join the pool (as in random search).
    max_tries: attempts to draw a fresh random sample.
    isolate_probes: make feature templates in a worker process (an MLIR
      abort cannot kill the tuner); tests turn it off for speed.
    crossover: False makes every child a mutation (the "no crossover"
      ablation, `mlir-ansor tune --no-crossover`).
    min_distance: candidates of one batch differ in at least this many
      knobs, while enough candidates do (then in fewer). Why: the best-scored
      candidates of a young model crowd around one point (seen on GEMM 1024:
      14 of 16 with the same parallel tiles, varying only the unroll); when
      the model is wrong there, the whole batch is wasted.
    local_share: share of every batch taken from the neighbours of the best
      measured candidate (one knob moved to an adjacent option), the
      best-scored first: the diverse rest explores, this part refines. Off
      by default: at 0.25 it lost on GEMM 1024 and did not clearly win on
      the ResNet 3x3 convolution (the figures are in ``docs/tuning.md``,
      under `evolution`). `mlir-ansor tune --local-share 0.25`.
    """

    population: int = 256
    generations: int = 4
    mutation_prob: float = 0.85
    eps_greedy: float = 0.1
    init_measured: int = 32
    min_train: int = 16
    fallback_after: int = 32
    max_tries: int = 200
    isolate_probes: bool = True
    crossover: bool = True
    min_distance: int = 3
    local_share: float = 0.0


Candidate = tuple[Sketch, Assignment]

_KINDS = ("tile", "parallel", "unroll", "vector", "alternative")


def knob_kind(spec: KnobSpec) -> str:
    """Which mutation moves this knob: "parallel" (``p_*``), "unroll"
    (``u_*``), "vector" (the register tile of the vector loop), "alternative"
    (a structural choice) or "tile" (other tile sizes)."""
    if spec.alternatives:
        return "alternative"
    if spec.name.startswith("p_"):
        return "parallel"
    if spec.name.startswith("u_"):
        return "unroll"
    if spec.name.startswith("r_") and "vector" in spec.doc:
        return "vector"
    return "tile"


def _nearest(options: Sequence[int], value: int) -> int:
    """The option closest to `value` on a log scale (ties: the smaller)."""
    lv = math.log(max(value, 1))
    return min(options, key=lambda o: (abs(math.log(max(o, 1)) - lv), o))


def repair(knobs: Sequence[KnobSpec], values: dict[str, int]) -> Assignment:
    """Make `values` valid: in sampling order, keep each value if it is
    still allowed, else take the nearest allowed one."""
    chosen: dict[str, int] = {}
    for k in knobs:
        allowed = k.allowed(chosen)
        v = values.get(k.name, allowed[0])
        chosen[k.name] = v if v in allowed else _nearest(allowed, v)
    return make_assignment(chosen)


def mutate(knobs: Sequence[KnobSpec], assignment: Assignment, rng: random.Random) -> Assignment:
    """Change one knob (of a kind drawn uniformly among those present), to a
    neighbouring allowed value most of the time, then repair the knobs after it."""
    values = dict(assignment)
    movable = [i for i, k in enumerate(knobs) if len(k.options) > 1]
    if not movable:
        return assignment
    kinds = sorted({knob_kind(knobs[i]) for i in movable}, key=_KINDS.index)
    kind = rng.choice(kinds)
    i = rng.choice([j for j in movable if knob_kind(knobs[j]) == kind])
    spec = knobs[i]
    chosen = {k.name: values[k.name] for k in knobs[:i]}
    allowed = list(spec.allowed(chosen))
    cur = values[spec.name]
    others = [v for v in allowed if v != cur]
    if not others:
        return repair(knobs, values)
    if cur in allowed and rng.random() < 0.7:
        pos = allowed.index(cur)
        near = [allowed[p] for p in (pos - 1, pos + 1) if 0 <= p < len(allowed)]
        new = rng.choice(near)
    else:
        new = rng.choice(others)
    values[spec.name] = new
    return repair(knobs, values)


def neighbours(knobs: Sequence[KnobSpec], assignment: Assignment) -> list[Assignment]:
    """Every assignment with one knob moved to an adjacent allowed option
    (the knobs after it repaired), without repeats."""
    values = dict(assignment)
    out: list[Assignment] = []
    seen = {assignment}
    for i, spec in enumerate(knobs):
        chosen = {k.name: values[k.name] for k in knobs[:i]}
        allowed = list(spec.allowed(chosen))
        cur = values[spec.name]
        if cur not in allowed:
            continue
        pos = allowed.index(cur)
        for p in (pos - 1, pos + 1):
            if 0 <= p < len(allowed):
                a = repair(knobs, {**values, spec.name: allowed[p]})
                if a not in seen:
                    seen.add(a)
                    out.append(a)
    return out


def distance(a: Assignment, b: Assignment) -> int:
    """How many knobs two assignments of one sketch set differently."""
    return sum(1 for (_, x), (_, y) in zip(a, b) if x != y)


def pick_diverse(ranked: Sequence[Candidate], n: int, min_distance: int) -> list[Candidate]:
    """Up to `n` of `ranked` (best first), greedily: a candidate is taken
    when it differs from every one already taken of its sketch in at least
    `min_distance` knobs; while fewer than `n` are taken, the pass repeats
    with the distance one lower (at distance 1 every candidate qualifies)."""
    out: list[Candidate] = []
    taken: set[tuple[str, Assignment]] = set()
    for d in range(max(1, min_distance), 0, -1):
        for sk, a in ranked:
            if len(out) >= n:
                return out
            if (sk.hash, a) in taken:
                continue
            if all(distance(a, b) >= d for s2, b in out if s2.hash == sk.hash):
                taken.add((sk.hash, a))
                out.append((sk, a))
    return out


def crossover(knobs: Sequence[KnobSpec], a: Assignment, b: Assignment, rng: random.Random) -> Assignment:
    """Each knob from one parent or the other, then repaired (the parents
    belong to the same sketch)."""
    da, db = dict(a), dict(b)
    child = {k.name: (da if rng.random() < 0.5 else db)[k.name] for k in knobs}
    return repair(knobs, child)


class EvolutionarySearch(SearchStrategy):
    """Evolutionary search over knob assignments, ranked by a cost model."""

    name = "evolutionary"

    def __init__(
        self, config: EvolutionConfig | None = None, *, model: CostModel | None = None, pretrained: bool = False
    ) -> None:
        """`pretrained`: the model was trained beforehand (on other tasks,
        `TuneConfig.pretrained_model`), so it ranks candidates from the
        first batch instead of after ``min_train`` measurements."""
        self.config = config or EvolutionConfig()
        self.model = model if model is not None else XGBModel()
        self.pretrained = pretrained
        self.failures = 0
        self.results: list[MeasuredCandidate] = []
        self.n_records = 0
        self._unlearned: list[MeasuredCandidate] = []  # kept, not yet featurized (see `_learn`)

    # ---------------------------------------------------------- lifecycle
    def pre_tuning(self, ctx: TaskContext) -> None:
        super().pre_tuning(ctx)
        self.rng = ctx.rng("evolutionary")
        known = {sk.hash for sk in ctx.sketches}
        history = [r for r in ctx.history if r.sketch.hash in known]
        if history:
            self._learn(history)

    def notify_results(self, results: list[MeasuredCandidate]) -> None:
        self.failures += sum(1 for r in results if not r.valid)
        self._learn(results)

    # ---------------------------------------------------------- proposals
    def generate_candidates(self, n: int) -> list[Candidate] | None:
        pool = self._pool()
        out: list[Candidate] = self.ctx.take_seeds(n)
        taken: set = {(sk.hash, a) for sk, a in out}
        if self._model_ready():
            n_random = int(round(n * self.config.eps_greedy))
            n_local = int(round(n * self.config.local_share))
            for sk, a in self._refine(pool, n_local):
                self._take(sk, a, out, taken)
            for sk, a in self._evolve(pool, n - n_random - len(out)):
                self._take(sk, a, out, taken)
        self._fill_random(pool, n, out, taken)
        return out or None

    @property
    def prefetch_ok(self) -> bool:
        return self._model_ready()

    def _model_ready(self) -> bool:
        """Whether the batch is chosen by evolution: the model is trained on
        ``min_train`` records (or was pretrained). A :class:`RandomModel`
        never trains; it ranks at random from ``min_train`` records on (the
        "no cost model" ablation: evolution without a learned model)."""
        if self.pretrained and self.model.trained:
            return True
        ranks = self.model.trained or isinstance(self.model, RandomModel)
        return ranks and self.n_records >= self.config.min_train

    def _pool(self) -> list[Sketch]:
        sk = self.ctx.sketches
        return sk if len(sk) == 1 or self.failures >= self.config.fallback_after else sk[:1]

    def _fresh(self, sk: Sketch, a: Assignment, taken: set) -> bool:
        key = (sk.hash, a)
        return key not in self.ctx.measured and key not in taken and usable(sk, a, self.ctx.threads)

    def _take(self, sk: Sketch, a: Assignment, out: list, taken: set) -> None:
        if self._fresh(sk, a, taken):
            taken.add((sk.hash, a))
            self.ctx.measured.add((sk.hash, a))
            out.append((sk, a))

    def _fill_random(self, pool: list[Sketch], n: int, out: list, taken: set) -> None:
        tries = 0
        while len(out) < n and tries < self.config.max_tries:
            tries += 1
            sk = pool[self.rng.randrange(len(pool))]
            self._take(sk, sk.sample(self.rng), out, taken)

    def _best_measured(self, pool: list[Sketch]) -> list[Candidate]:
        """This run's (and the database's) valid measured candidates of the
        sketches in `pool`, fastest first."""
        by_hash = {sk.hash: sk for sk in pool}
        valid = sorted((r for r in self.results if r.valid and r.sketch.hash in by_hash), key=lambda r: r.latency_s)
        return [(by_hash[r.sketch.hash], r.knobs) for r in valid]

    def _refine(self, pool: list[Sketch], n: int) -> list[Candidate]:
        """Up to `n` fresh neighbours of the best measured candidate (see
        ``local_share``), best-scored first."""
        measured = self._best_measured(pool)
        if n <= 0 or not measured:
            return []
        sk, knobs = measured[0]
        near = [(sk, sk.complete(a)) for a in neighbours(sk.knobs, knobs)]
        near = [(s, a) for s, a in near if s.violation(a) is None and self._fresh(s, a, set())]
        if not near:
            return []
        scores = self._score(near)
        order = np.argsort(-scores, kind="stable")
        return [near[i] for i in order[:n]]

    def _evolve(self, pool: list[Sketch], n: int) -> list[Candidate]:
        """The `n` best-scored fresh candidates found by evolution."""
        cfg = self.config
        rng = self.rng
        # Initial population: the best measured, then random samples.
        population: list[Candidate] = []
        seen: set = set()
        for sk, knobs in self._best_measured(pool)[: cfg.init_measured]:
            key = (sk.hash, knobs)
            if key not in seen:
                seen.add(key)
                population.append((sk, knobs))
        tries = 0
        while len(population) < cfg.population and tries < 4 * cfg.population:
            tries += 1
            sk = pool[rng.randrange(len(pool))]
            a = sk.sample(rng)
            if (sk.hash, a) not in seen:
                seen.add((sk.hash, a))
                population.append((sk, a))
        scored: dict[tuple[str, Assignment], float] = {}
        sketches: dict[str, Sketch] = {}
        for gen in range(cfg.generations + 1):
            scores = self._score(population)
            for (sk, a), s in zip(population, scores):
                scored[(sk.hash, a)] = float(s)
                sketches[sk.hash] = sk
            if gen == cfg.generations:
                break
            population = self._offspring(population, scores)
        ranked = sorted(scored.items(), key=lambda kv: (-kv[1], kv[0]))
        fresh = [(sketches[h], a) for (h, a), _ in ranked if self._fresh(sketches[h], a, set())]
        return pick_diverse(fresh, n, cfg.min_distance)

    def _offspring(self, population: list[Candidate], scores: np.ndarray) -> list[Candidate]:
        """A new population: parents drawn by rank of score, children by
        mutation or same-sketch crossover; no duplicates."""
        cfg = self.config
        rng = self.rng
        order = np.argsort(-scores, kind="stable")
        ranks = np.empty(len(scores))
        ranks[order] = np.arange(len(scores))
        weights = list(1.0 / (1.0 + ranks))  # rank-based: robust to the scale of scores
        by_sketch: dict[str, list[int]] = {}
        for i, (sk, _) in enumerate(population):
            by_sketch.setdefault(sk.hash, []).append(i)
        children: list[Candidate] = []
        seen: set = set()
        tries = 0
        while len(children) < cfg.population and tries < 4 * cfg.population:
            tries += 1
            (i,) = rng.choices(range(len(population)), weights=weights)
            sk, a = population[i]
            mates = by_sketch[sk.hash]
            if not cfg.crossover or rng.random() < cfg.mutation_prob or len(mates) < 2:
                child = mutate(sk.knobs, a, rng)
            else:
                (j,) = rng.choices(mates, weights=[weights[m] for m in mates])
                child = crossover(sk.knobs, a, population[j][1], rng)
            child = sk.complete(child)  # derived knobs; then drop what breaks the sketch's limits
            if sk.violation(child) is None and (sk.hash, child) not in seen:
                seen.add((sk.hash, child))
                children.append((sk, child))
        return children or population

    # ---------------------------------------------------------- the model
    def _features(self, cands: Sequence[Candidate]) -> list[np.ndarray]:
        out: list = [None] * len(cands)
        groups: dict[str, list[int]] = {}
        for i, (sk, _) in enumerate(cands):
            groups.setdefault(sk.hash, []).append(i)
        for idx in groups.values():
            sk = cands[idx[0]][0]
            fx = extractor_for(sk, isolate=self.config.isolate_probes)
            for i, f in zip(idx, fx.features([cands[i][1] for i in idx])):
                out[i] = f
        return out

    def _score(self, cands: Sequence[Candidate]) -> np.ndarray:
        return np.asarray(self.model.predict(self._features(cands)), float)

    def _learn(self, results: Sequence[MeasuredCandidate]) -> None:
        """Keep `results`; hand them to the model once it can train on them.

        Extracting a record's features costs about as much as scoring a
        population (a template per sketch, then a pass per candidate), and a
        model tune gives most tasks a few trials each: a record is only
        featurized once the task has as many as the model needs to train
        (``records_to_train``) and, for a model trained here, as many as the
        search needs before it ranks (``min_train``). Retraining starts from
        the same point every time, so the model the search ranks with is the
        one it would have been had every batch been learned at once."""
        self.results.extend(results)
        self.n_records += len(results)
        needed = self.model.records_to_train
        if needed is None:
            return
        self._unlearned.extend(results)
        if not self.pretrained:
            needed = max(needed, self.config.min_train)
        if self.n_records < needed:
            return
        todo, self._unlearned = self._unlearned, []
        flops = self.ctx.task.flops
        feats = self._features([(r.sketch, r.knobs) for r in todo])
        thr = [flops / r.latency_s if r.valid and r.latency_s > 0 else 0.0 for r in todo]
        self.model.update(list(zip(feats, thr)))
