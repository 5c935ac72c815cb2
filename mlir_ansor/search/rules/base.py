"""What a sketch rule is, and the pieces rules share.

A rule answers two questions about a task (Ansor, section 4.1): does it
apply here (:meth:`Rule.condition`: skip, apply, or apply and skip the rules
after it), and which sketches does it produce (:meth:`Rule.apply`). Rules
read the task's structure (:class:`~mlir_ansor.search.sketch.OpStructure`:
iterator types, indexing, body ops), never just op names, so a
`linalg.generic` that is a matmul gets the matmul's sketches.
"""

from __future__ import annotations

import abc
import enum
from dataclasses import dataclass

from mlir_ansor.schedule.writer import ScheduleWriter
from mlir_ansor.search.sketch import OpStructure, Sketch
from mlir_ansor.target import Target


class RuleResult(enum.Enum):
    SKIP = "skip"
    APPLY = "apply"
    APPLY_AND_SKIP_REST = "apply_and_skip_rest"


@dataclass(frozen=True)
class SketchContext:
    """A task as the rules see it: the tagged payload and its ops' structure."""

    payload: str
    ops: tuple[OpStructure, ...]
    anchor: OpStructure
    target: Target

    @property
    def root(self) -> OpStructure:
        """The op whose result the task returns (the last fused consumer)."""
        roots = [o for o in self.ops if o.is_root]
        return roots[-1] if roots else self.anchor

    def lanes(self) -> int:
        return self.target.lanes(self.anchor.dtype)


class Rule(abc.ABC):
    """A sketch generation rule."""

    name: str = "rule"

    @abc.abstractmethod
    def condition(self, ctx: SketchContext) -> RuleResult:
        """Whether this rule applies to the task."""

    @abc.abstractmethod
    def apply(self, ctx: SketchContext) -> list[Sketch]:
        """The sketches this rule makes for the task (may be empty)."""


def tile_root_and_fuse(w: ScheduleWriter, ctx: SketchContext, sizes: list[int | str]) -> str:
    """Tile the task's root op with `scf.forall` (`sizes` per root loop) and
    fuse every other op of the task into it, consumers first (producers of
    the ops already inside). Returns the forall handle."""
    root = ctx.root
    _, forall = w.tile_forall(w.match_op_id("%root", root.op_id), sizes)
    for o in reversed(ctx.ops):
        if o.op_id != root.op_id:
            _, forall = w.fuse_into(w.match_op_id("%root", o.op_id), forall)
    return forall


def root_sizes_from_anchor(ctx: SketchContext, anchor_sizes: dict[int, int | str]) -> list[int | str]:
    """Translate tile sizes of the anchor's output loops to the root's loops
    (the root's output and the anchor's output are the same tensor, fused
    elementwise)."""
    root = ctx.root
    sizes: list[int | str] = [0] * len(root.loop_ranges)
    for a_d, r_d in zip(ctx.anchor.output_dims, root.output_dims):
        if r_d is not None and a_d is not None and a_d in anchor_sizes:
            sizes[r_d] = anchor_sizes[a_d]
    return sizes


def tile_others_like(
    w: ScheduleWriter, ctx: SketchContext, forall: str, anchor_sizes: list[int | str], skip: set[int]
) -> None:
    """Tile the ops of the task other than `skip` inside `forall` like the
    anchor's output loops (register-sized), so their vectors stay small."""
    for o in ctx.ops:
        if o.op_id in skip:
            continue
        sizes: list[int | str] = [0] * len(o.loop_ranges)
        for a_d, o_d in zip(ctx.anchor.output_dims, o.output_dims):
            if o_d is not None and a_d is not None:
                s = anchor_sizes[a_d]
                sizes[o_d] = s if s != 0 else 1
        if any(s != 0 for s in sizes):
            w.tile_for(w.match_op_id(forall, o.op_id), sizes)


def finish(w: ScheduleWriter, *, vectorize: bool, unit_dims: bool = False, reduction: str = "innerparallel") -> None:
    """Vectorize (optionally), keep accumulators in registers, bufferize,
    and lower vector ops to what LLVM maps to SIMD instructions.
    `unit_dims`: see `ScheduleWriter.hoist_accumulators`; `reduction`: see
    `ScheduleWriter.lower_vectors`."""
    func = w.match_func("%root")
    if vectorize:
        func = w.vectorize_children(func)
        w.cleanup(func)
        w.hoist_accumulators(func, unit_dims=unit_dims)
        w.cleanup(func)
    buf = w.bufferize("%root")
    func = w.match_func(buf)
    w.lower_vectors(func, reduction=reduction)


def vector_tile_options(extent: int, lanes: int, *, partial: bool = False) -> tuple[int, ...]:
    """Register tile sizes for a vectorized loop: 1, 2 or 4 vectors when they
    divide the extent, else divisors up to one vector. With `partial` (the
    sketch peels the remainder of a tile that does not divide its loop),
    1, 2 or 4 vectors no larger than the extent, or the whole extent when it
    is shorter than a vector."""
    if partial:
        return tuple(v for v in (lanes, 2 * lanes, 4 * lanes) if v <= extent) or (extent,)
    opts = tuple(v for v in (lanes, 2 * lanes, 4 * lanes) if extent % v == 0)
    if opts:
        return opts
    return tuple(x for x in range(1, lanes + 1) if extent % x == 0)


def reads_vector_dim_transposed(op: OpStructure, vec: int) -> bool:
    """Whether some input of `op` is indexed by loop `vec` in a dimension
    other than its last (contiguous) one, e.g. B of A.B^T, or a transpose."""
    return any(vec in dims and dims[-1] != vec for dims in op.operand_dims[: op.num_inputs])
