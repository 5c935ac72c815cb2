"""Sketch rules, one per file, tried in order (see `base.Rule`), for both
kinds of target: each rule's condition reads the target and the op, so the
CPU rules skip a cuda target and the GPU rules (``gpu_*.py``) skip a CPU.

The target's default schedule (:func:`default_rule`: ``cpu-default`` or
``cuda-default``) is always last: every task has a sound sketch, and the
search falls back to it when the rule-based sketches keep failing.
More rules are registered by name with `mlir_ansor.search.registry.register_rule`
(``CPU_RULES`` then ``GPU_RULES`` seed that registry).
"""

from mlir_ansor.errors import UnsupportedError
from mlir_ansor.search.rules.amx import AmxTiling
from mlir_ansor.search.rules.attention import Attention
from mlir_ansor.search.rules.base import Rule, RuleResult, SketchContext
from mlir_ansor.search.rules.default import DefaultSchedule
from mlir_ansor.search.rules.dot_product import DotProductTiling
from mlir_ansor.search.rules.elementwise import ElementwiseVectorize
from mlir_ansor.search.rules.gpu_contraction import GpuContraction
from mlir_ansor.search.rules.gpu_default import GpuDefaultSchedule
from mlir_ansor.search.rules.gpu_mma import TensorCoreMatmul
from mlir_ansor.search.rules.gpu_staged_matmul import StagedMatmul
from mlir_ansor.search.rules.gpu_warp_reduction import WarpReduction
from mlir_ansor.search.rules.multi_level_tiling import MultiLevelTiling
from mlir_ansor.search.rules.reduction import ReductionVectorize
from mlir_ansor.search.rules.row_fused import RowFused
from mlir_ansor.search.rules.transpose import TransposeBlocks
from mlir_ansor.target import Target

CPU_RULES: list[Rule] = [
    Attention(), RowFused(), AmxTiling(), DotProductTiling(), MultiLevelTiling(), ReductionVectorize(), TransposeBlocks(), ElementwiseVectorize()
]
"""Rules that produce specialized CPU sketches, in priority order."""

GPU_RULES: list[Rule] = [StagedMatmul(), TensorCoreMatmul(), WarpReduction(), GpuContraction()]
"""Rules that produce specialized CUDA sketches, in priority order (best
first: staged shared-memory matmuls, tensor cores, row reductions with
warp shuffles, then any contraction)."""

DEFAULT_RULE: Rule = DefaultSchedule()
"""The CPU default schedule (``cpu-default``)."""

GPU_DEFAULT_RULE: Rule = GpuDefaultSchedule()
"""The CUDA default schedule (``cuda-default``)."""

DEFAULT_RULES: dict[str, Rule] = {"cpu": DEFAULT_RULE, "cuda": GPU_DEFAULT_RULE}
"""The default schedule of each target kind."""


def default_rule(target: Target) -> Rule:
    """The default schedule of `target`'s kind, always added after the rules."""
    rule = DEFAULT_RULES.get(target.kind)
    if rule is None:
        raise UnsupportedError(f"no default schedule for target {target.key} (kinds: {', '.join(DEFAULT_RULES)})")
    return rule


NO_PACKING: dict[str, int] = {"pack": 1}
"""Knob values that drop packing (`generate_sketches(..., fixed=NO_PACKING)`,
`TuneConfig.packing=False`, `mlir-ansor tune --no-packing`): the ``pack``
alternative of multi-level tiling held at 1, "read the operand in place"."""

__all__ = [
    "CPU_RULES",
    "DEFAULT_RULE",
    "DEFAULT_RULES",
    "GPU_DEFAULT_RULE",
    "GPU_RULES",
    "NO_PACKING",
    "Rule",
    "RuleResult",
    "SketchContext",
    "default_rule",
]
