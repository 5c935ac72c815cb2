"""The pieces the GPU sketch rules share (the CPU rules' are in `base`).

Every GPU rule's :meth:`~mlir_ansor.search.rules.base.Rule.condition` first
asks :func:`is_cuda`; it then writes with
:class:`~mlir_ansor.schedule.gpu_writer.GpuScheduleWriter` and returns
:class:`~mlir_ansor.search.gpu_sketch.GpuSketch` objects, whose limits come
from the target (`gpu_sketch.target_limits`).
"""

from __future__ import annotations

from mlir_ansor.schedule.gpu_writer import GpuScheduleWriter
from mlir_ansor.schedule.writer import Size
from mlir_ansor.search.rules.base import SketchContext
from mlir_ansor.search.sketch import OpStructure
from mlir_ansor.target import Target

THREAD_COUNTS = (1, 2, 4, 8, 16, 32)
"""Options of a thread-count knob along one mapped axis (at most 32, so a
block of two or three mapped axes stays within 1024 threads)."""

AXES = ("x", "y", "z")


def is_cuda(ctx: SketchContext) -> bool:
    """Whether the task is scheduled for an NVIDIA target (GPU rules skip
    every other target; CPU rules skip this one)."""
    return ctx.target.kind == "cuda"


def axes_of(dims: list[int]) -> dict[int, str]:
    """The innermost loop gets x, the next y, the next z."""
    return {d: AXES[i] for i, d in enumerate(reversed(dims))}


def device_mapping(sizes: list[Size], axes: dict[int, str], kind: str) -> list[str]:
    """The ``#gpu.<kind><axis>`` mapping of each tiled (non-zero) loop."""
    return [f"#gpu.{kind}<{axes[d]}>" for d, s in enumerate(sizes) if not (isinstance(s, int) and s == 0)]


def fuse_others(w: GpuScheduleWriter, ops: tuple[OpStructure, ...], root: OpStructure, forall: str) -> str:
    """Fuse every op of the task other than `root` into `forall`, consumers
    first; returns the forall handle."""
    for o in reversed(ops):
        if o.op_id != root.op_id:
            _, forall = w.fuse_into(w.match_op_id("%root", o.op_id), forall)
    return forall


def operand_dtypes(op: OpStructure) -> tuple[str, ...]:
    """Each operand's element type, inputs then outputs (a mixed-precision
    contraction reads f16 or bf16 and accumulates in f32)."""
    n = len(op.operand_dims)
    ins = op.input_dtypes if len(op.input_dtypes) == op.num_inputs else (op.dtype,) * op.num_inputs
    return tuple(ins) + (op.dtype,) * (n - op.num_inputs)


def min_block_threads(ranges: tuple[int, ...], thread_dims: list[int], target: Target) -> int:
    """At least a warp per block, where the loops are that large."""
    n = 1
    for d in thread_dims:
        n *= ranges[d]
    return min(target.warp_size or 32, n)
