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
    """Evolutionary search with the cost model named by ``config.cost_model``
    (loaded from ``config.pretrained_model`` when set) and the settings of
    ``config.evolution``."""
    import dataclasses

    from ...registry import make_cost_model

    evo = getattr(config, "evolution", None) or EvolutionConfig()
    evo = dataclasses.replace(evo, max_tries=config.max_sample_tries)
    pretrained = bool(getattr(config, "pretrained_model", None))
    return EvolutionarySearch(evo, model=make_cost_model(config), pretrained=pretrained)


STRATEGIES: dict[str, Callable[[Any], SearchStrategy]] = {
    "random": lambda config: RandomSearch(max_tries=config.max_sample_tries),
    "evolutionary": _evolutionary,
}
"""Search strategies by name (`TuneConfig.strategy`, `mlir-ansor tune --search`).
Each entry makes a fresh strategy (one per task) from the `TuneConfig`. Add
one with `mlir_ansor.registry.register_strategy`."""

__all__ = [
    "STRATEGIES",
    "EvolutionConfig",
    "EvolutionarySearch",
    "MeasuredCandidate",
    "RandomSearch",
    "SearchStrategy",
    "TaskContext",
]
