"""The tasks tuning makes of a program for a target: one way to extract them.

`graph.task.extract_tasks` and `graph.task.partition` rewrite nothing
unless given a target's decisions (``prepack=None`` by default): which
constant weights to pack in the kernels' layout, which row-wise chains and
attentions to join into one task, which repeated subexpressions to compute
once (`search.rules.dot_product.weight_packing`). A task's workload key
depends on those decisions. `tune` extracts with its target's, and every
caller that looks records up by key (compiling a module, replaying a
record, the command line's reports, the torch backend's "tuned already?")
must extract exactly as it did, or finds no records (or, worse, hands a
record's kernel the inputs of a different task). These functions are that
one way; nothing else in the package passes `prepack` itself.
"""

from __future__ import annotations

from mlir_ansor.graph.task import Occurrence, Task, extract_tasks, partition
from mlir_ansor.ir.program import Program
from mlir_ansor.search.rules.dot_product import weight_packing
from mlir_ansor.target import Target


def tasks_for(program, target: Target, *, func: str | None = None) -> list[Task]:
    """`extract_tasks` of `program` (anything it takes) as `tune` does for
    `target`: the tasks, workload keys and weights of its records."""
    return extract_tasks(program, func=func, prepack=weight_packing(target))


def occurrences_for(program: Program, target: Target, *, func: str | None = None) -> list[Occurrence]:
    """`partition` of `program` as `tune` extracts its tasks for `target`:
    every occurrence, in program order, of the tasks of :func:`tasks_for`."""
    return partition(program, func, prepack=weight_packing(target))
