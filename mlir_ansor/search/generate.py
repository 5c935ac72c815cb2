"""Sketch generation: run the registered sketch rules on one task.

The rules (`search.rules`, one per file) say whether they apply to a task's
op on a target and write its sketches; the registry (`search.registry`)
holds them in priority order, with any a plugin adds. This module sits above
both: it is the one place that asks the registry for rules and runs them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mlir_ansor.errors import UnsupportedError
from mlir_ansor.search.registry import sketch_rules
from mlir_ansor.search.rules import DEFAULT_RULE, RuleResult, SketchContext
from mlir_ansor.search.sketch import Sketch, fix_knobs, prepare_payload
from mlir_ansor.target import Target

__all__ = ["generate_sketches"]


def generate_sketches(
    task_mlir: str,
    target: Target,
    *,
    rules: Sequence[str] | None = None,
    fixed: Mapping[str, int] | None = None,
) -> list[Sketch]:
    """All sketches for one task: those of the rules that apply, in rule
    order, then the default schedule last.

    rules: names of the rules to run (`mlir_ansor.search.registry.rules()` lists
      them); None runs every registered rule. The default schedule is
      always added, so every task keeps a sound sketch.
    fixed: knob values to hold fixed (see :func:`fix_knobs`); e.g.
      ``rules.NO_PACKING`` drops the packing alternative.
    """
    selected = sketch_rules(rules)
    payload, ops = prepare_payload(task_mlir)
    anchors = [o for o in ops if o.role == "anchor"] or list(ops[:1])
    if not anchors:
        raise UnsupportedError("task has no Linalg operation")
    ctx = SketchContext(payload, ops, anchors[0], target)
    sketches: list[Sketch] = []
    for rule in selected:
        verdict = rule.condition(ctx)
        if verdict is RuleResult.SKIP:
            continue
        sketches.extend(rule.apply(ctx))
        if verdict is RuleResult.APPLY_AND_SKIP_REST:
            break
    sketches.extend(DEFAULT_RULE.apply(ctx))
    if fixed:
        sketches = [fix_knobs(sk, fixed) for sk in sketches]
    return sketches
