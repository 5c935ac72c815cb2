"""Search strategies: which candidates of a task to measure next.

One strategy instance serves one task through the lifecycle
``pre_tuning`` -> ``generate_candidates`` (None when done) ->
``notify_results`` -> ... -> ``post_tuning``. See `base.py`.
"""

from collections.abc import Callable
from typing import Any

from .base import MeasuredCandidate, SearchStrategy, TaskContext
from .evolutionary import EvolutionarySearch, EvolutionConfig
from .random_search import RandomSearch


def _evolutionary(config: Any) -> SearchStrategy:
    from ..cost_model import XGBModel

    return EvolutionarySearch(
        EvolutionConfig(max_tries=config.max_sample_tries), model=XGBModel(seed=config.seed)
    )


STRATEGIES: dict[str, Callable[[Any], SearchStrategy]] = {
    "random": lambda config: RandomSearch(max_tries=config.max_sample_tries),
    "evolutionary": _evolutionary,
}
"""Search strategies by name (`TuneConfig.strategy`, `mlir-ansor tune --search`).
Each entry makes a fresh strategy (one per task) from the `TuneConfig`."""

__all__ = [
    "STRATEGIES",
    "EvolutionConfig",
    "EvolutionarySearch",
    "MeasuredCandidate",
    "RandomSearch",
    "SearchStrategy",
    "TaskContext",
]
