"""CPU sketch rules, one per file, tried in order (see `base.Rule`).

The default schedule is always last: every task has a sound sketch, and the
search falls back to it when the rule-based sketches keep failing.
"""

from .base import Rule, RuleResult, SketchContext
from .default import DefaultSchedule
from .elementwise import ElementwiseVectorize
from .multi_level_tiling import MultiLevelTiling
from .reduction import ReductionVectorize

CPU_RULES: list[Rule] = [MultiLevelTiling(), ReductionVectorize(), ElementwiseVectorize()]
"""Rules that produce specialized sketches, in priority order."""

DEFAULT_RULE: Rule = DefaultSchedule()

__all__ = ["CPU_RULES", "DEFAULT_RULE", "Rule", "RuleResult", "SketchContext"]
