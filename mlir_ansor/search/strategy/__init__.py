"""Search strategies: which candidates of a task to measure next.

One strategy instance serves one task through the lifecycle
``pre_tuning`` -> ``generate_candidates`` (None when done) ->
``notify_results`` -> ... -> ``post_tuning``. See `base.py`.

Strategies are selected by name (`TuneConfig.strategy`, `mlir-ansor tune
--search`) through `mlir_ansor.search.registry`, which registers these two
("random", "evolutionary") and any a plugin adds.
"""

from mlir_ansor.search.strategy.base import MeasuredCandidate, SearchStrategy, TaskContext
from mlir_ansor.search.strategy.evolutionary import EvolutionarySearch, EvolutionConfig
from mlir_ansor.search.strategy.random_search import RandomSearch

__all__ = [
    "EvolutionConfig",
    "EvolutionarySearch",
    "MeasuredCandidate",
    "RandomSearch",
    "SearchStrategy",
    "TaskContext",
]
