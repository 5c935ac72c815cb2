"""Sketch generation: run the registered sketch rules on one task.

The rules (`search.rules`, one per file) say whether they apply to a task's
op on a target and write its sketches; the registry (`search.registry`)
holds them in priority order, with any a plugin adds. This module sits above
both: it is the one place that asks the registry for rules and runs them,
for CPU and CUDA targets alike (each rule's condition reads the target).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mlir_ansor.errors import UnsupportedError
from mlir_ansor.search.registry import sketch_rules
from mlir_ansor.search.rules import RuleResult, SketchContext, default_rule
from mlir_ansor.search.sketch import OpStructure, Sketch, fix_knobs, prepare_payload
from mlir_ansor.target import Target

__all__ = ["generate_sketches"]


def _anchor(ops: tuple[OpStructure, ...], target: Target) -> OpStructure:
    """The op the rules schedule around: the one task extraction tagged.
    Untagged (a hand-written module): on a CPU the first op; on a GPU the
    last op with a reduction, else the last op."""
    tagged = [o for o in ops if o.role == "anchor"]
    if tagged:
        return tagged[0]
    if target.kind == "cuda":
        return ([o for o in ops if o.reductions] or list(ops))[-1]
    return ops[0]


def generate_sketches(
    task_mlir: str,
    target: Target,
    *,
    rules: Sequence[str] | None = None,
    fixed: Mapping[str, int] | None = None,
) -> list[Sketch]:
    """All sketches for one task on `target` (a CPU or a cuda target): those
    of the rules that apply, in rule order, then the target's default
    schedule (``cpu-default`` or ``cuda-default``) last.

    rules: names of the rules to run (`mlir_ansor.search.registry.rules()` lists
      them); None runs every registered rule. The default schedule is
      always added, so every task keeps a sound sketch.
    fixed: knob values to hold fixed (see :func:`fix_knobs`); e.g.
      ``rules.NO_PACKING`` drops the packing alternative.
    """
    selected = sketch_rules(rules)
    default = default_rule(target)
    payload, ops = prepare_payload(task_mlir, fuse=target.kind == "cpu")
    if not ops:
        raise UnsupportedError("task has no Linalg operation")
    ctx = SketchContext(payload, ops, _anchor(ops, target), target)
    sketches: list[Sketch] = []
    for rule in selected:
        verdict = rule.condition(ctx)
        if verdict is RuleResult.SKIP:
            continue
        sketches.extend(rule.apply(ctx))
        if verdict is RuleResult.APPLY_AND_SKIP_REST:
            break
    sketches.extend(default.apply(ctx))
    if fixed:
        sketches = [fix_knobs(sk, fixed) for sk in sketches]
    return sketches
