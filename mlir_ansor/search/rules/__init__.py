"""CPU sketch rules, one per file, tried in order (see `base.Rule`).

The default schedule is always last: every task has a sound sketch, and the
search falls back to it when the rule-based sketches keep failing.
More rules are registered by name with `mlir_ansor.search.registry.register_rule`
(``CPU_RULES`` seeds that registry).
"""

from mlir_ansor.search.rules.base import Rule, RuleResult, SketchContext
from mlir_ansor.search.rules.default import DefaultSchedule
from mlir_ansor.search.rules.elementwise import ElementwiseVectorize
from mlir_ansor.search.rules.multi_level_tiling import MultiLevelTiling
from mlir_ansor.search.rules.reduction import ReductionVectorize

CPU_RULES: list[Rule] = [MultiLevelTiling(), ReductionVectorize(), ElementwiseVectorize()]
"""Rules that produce specialized sketches, in priority order."""

DEFAULT_RULE: Rule = DefaultSchedule()

NO_PACKING: dict[str, int] = {"pack": 1}
"""Knob values that drop packing (`generate_sketches(..., fixed=NO_PACKING)`,
`TuneConfig.packing=False`, `mlir-ansor tune --no-packing`): the ``pack``
alternative of multi-level tiling held at 1, "read the operand in place"."""

__all__ = ["CPU_RULES", "DEFAULT_RULE", "NO_PACKING", "Rule", "RuleResult", "SketchContext"]
