"""Sketches: transform-dialect schedules with free knobs, made for one task.

Roadmap:
  * :func:`prepare_payload` tags every Linalg op of a task module with
    ``ansor.op = <index>`` (program order) and reads its structure
    (:class:`OpStructure`: loop extents, iterator types, which loop each
    operand dimension indexes) from a generalized copy, so rules read the
    op's structure, never just its name.
  * :func:`generate_sketches` returns the sketches for a task:
    :func:`_contraction_sketch` for the matmul family and convolutions,
    :func:`_default_sketch` for anything else.
  * :class:`Sketch` holds the script (text with unselected knobs), its
    :class:`~mlir_ansor.search.space.KnobSpec` list, and
    :meth:`Sketch.concrete`, which sets every knob's ``selected`` value and
    returns a script that plain ``mlir-opt --transform-interpreter`` applies.

The CPU contraction sketch (tiling structure S S R S R, Ansor's "SSRSRS" with
the innermost spatial level vectorized):

  1. ``scf.forall`` over the parallel loops of the root op (tile knobs
     ``p_d<i>``), with the anchor and its fused producers/consumers fused in:
     the outer level, spread over threads;
  2. ``scf.for`` over the reduction loops (``k_d<i>``): the cache level;
  3. optionally (alternatives ``pack``) copy the tile of the reused operand
     (the one that does not depend on the row loop: B of a matmul, the
     filter of a convolution) into a contiguous buffer: the biggest single
     win on GEMM (shared/MLIR-NOTES.md);
  4. ``scf.for`` over a register tile (``r_d<i>``): rows x vector columns;
  5. ``scf.for`` over the remaining reduction with unroll factor ``u``;
  6. vectorize, hoist the accumulator out of the reduction loops (it stays in
     registers), bufferize, lower contractions to FMAs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from mlir import ir, passmanager

from ..dialects.schedule import ScheduleWriter
from ..errors import UnsupportedError
from ..target import Target
from .space import Assignment, KnobSpec, divisors

OP_ATTR = "ansor.op"
ANCHOR_ATTR = "ansor.anchor"
FUSED_ATTR = "ansor.fused"


@dataclass(frozen=True)
class OpStructure:
    """Structure of one Linalg op of a task (read from its generalized form).

    op_id: value of its ``ansor.op`` tag.
    name: the op name before generalization (``linalg.matmul``).
    role: "anchor", "fused" or "producer".
    loop_ranges / iterator_types: the iteration domain.
    operand_dims: per operand, per dimension, the loop index it is indexed by
    (None for a compound expression such as ``oh + kh`` of a convolution).
    num_inputs: how many of the operands are inputs (the rest are inits).
    dtype: element type of the first output.
    is_root: whether its result is returned by the task function.
    """

    op_id: int
    name: str
    role: str
    loop_ranges: tuple[int, ...]
    iterator_types: tuple[str, ...]
    operand_dims: tuple[tuple[int | None, ...], ...]
    num_inputs: int
    dtype: str
    is_root: bool
    compound_dims: tuple[tuple[int, ...], ...] = ()  # loops of each compound expr (conv windows)

    @property
    def parallel(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.iterator_types) if t == "parallel")

    @property
    def reductions(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.iterator_types) if t == "reduction")

    @property
    def output_dims(self) -> tuple[int | None, ...]:
        return self.operand_dims[self.num_inputs]


def _expr_dims(e: ir.AffineExpr) -> list[int]:
    if isinstance(e, ir.AffineDimExpr):
        return [e.position]
    if isinstance(e, ir.AffineConstantExpr) or isinstance(e, ir.AffineSymbolExpr):
        return []
    return _expr_dims(e.lhs) + _expr_dims(e.rhs)


def _linalg_ops(module: ir.Module) -> list[ir.Operation]:
    ops: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name.startswith("linalg.") and op.name != "linalg.yield" and op.parent.name == "func.func":
            ops.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return ops


def _returned_values(module: ir.Module) -> set:
    vals = set()

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "func.return":
            for v in op.operands:
                vals.add(v)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return vals


def prepare_payload(task_mlir: str) -> tuple[str, tuple[OpStructure, ...]]:
    """Tag the Linalg ops of a task module and read their structure.

    Returns the tagged module's text (what sketches are applied to) and one
    :class:`OpStructure` per Linalg op in program order.
    """
    with ir.Context() as ctx, ir.Location.unknown():
        ctx.allow_unregistered_dialects = False
        module = ir.Module.parse(task_mlir)
        ops = _linalg_ops(module)
        returned = _returned_values(module)
        meta = []
        for i, op in enumerate(ops):
            op.attributes[OP_ATTR] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), i)
            role = "anchor" if ANCHOR_ATTR in op.attributes else "fused" if FUSED_ATTR in op.attributes else "producer"
            is_root = any(r in returned for r in op.results)
            meta.append((op.name, role, is_root))
        payload = str(module)
        generic = ir.Module.parse(payload)
        passmanager.PassManager.parse("builtin.module(func.func(linalg-generalize-named-ops))").run(generic.operation)
        structures = []
        # Generalization drops discardable attributes; program order is kept.
        for i, ((name, role, is_root), gop) in enumerate(zip(meta, _linalg_ops(generic))):
            structures.append(_structure(gop, i, name, role, is_root))
    return payload, tuple(structures)


def _structure(op: ir.Operation, op_id: int, name: str, role: str, is_root: bool) -> OpStructure:
    maps = [ir.AffineMapAttr(a).value for a in ir.ArrayAttr(op.attributes["indexing_maps"])]
    iters = []
    for a in ir.ArrayAttr(op.attributes["iterator_types"]):
        s = str(a)
        iters.append("reduction" if "reduction" in s else "parallel")
    operand_dims = []
    compound = []
    ranges: list[int | None] = [None] * len(iters)
    shapes = []
    for operand in op.operands:
        t = operand.type
        shapes.append(list(ir.ShapedType(t).shape) if isinstance(t, (ir.RankedTensorType, ir.MemRefType)) else [])
    for m, shape in zip(maps, shapes):
        dims: list[int | None] = []
        for j, e in enumerate(m.results):
            if isinstance(e, ir.AffineDimExpr):
                dims.append(e.position)
                if j < len(shape) and ranges[e.position] is None:
                    ranges[e.position] = shape[j]
            else:
                dims.append(None)
                if not isinstance(e, ir.AffineConstantExpr):
                    compound.append(tuple(_expr_dims(e)))
        operand_dims.append(tuple(dims))
    if any(r is None for r in ranges):
        raise UnsupportedError(f"{name}: cannot infer the static extent of every loop")
    num_inputs = int(ir.DenseI32ArrayAttr(op.attributes["operandSegmentSizes"])[0]) if "operandSegmentSizes" in op.attributes else len(op.operands) - len(op.results)
    out_t = op.operands[num_inputs].type if num_inputs < len(op.operands) else op.results[0].type
    dtype = str(ir.ShapedType(out_t).element_type)
    return OpStructure(
        op_id=op_id,
        name=name,
        role=role,
        loop_ranges=tuple(int(r) for r in ranges),
        iterator_types=tuple(iters),
        operand_dims=tuple(operand_dims),
        num_inputs=num_inputs,
        dtype=dtype,
        is_root=is_root,
        compound_dims=tuple(compound),
    )


@dataclass(frozen=True)
class Sketch:
    """A schedule with free knobs for one task.

    name: which rule made it ("cpu-contraction", "cpu-default").
    payload: the task module, with its Linalg ops tagged ``ansor.op``.
    script: the transform module; its knobs carry no ``selected`` value.
    knobs: the knobs in sampling order (parents first).
    """

    name: str
    payload: str
    script: str
    knobs: tuple[KnobSpec, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
    forall: tuple[tuple[str, int], ...] = ()  # (tile knob, loop extent) of the scf.forall

    def parallelism(self, assignment: Assignment) -> int:
        """How many iterations the scf.forall of this schedule has."""
        values = dict(assignment)
        n = 1
        for name, extent in self.forall:
            n *= extent // max(1, values.get(name, extent))
        return n

    @property
    def hash(self) -> str:
        """Stable identity of the sketch (script and payload text)."""
        h = hashlib.sha256()
        h.update(self.payload.encode())
        h.update(b"\0")
        h.update(self.script.encode())
        return h.hexdigest()[:16]

    def concrete(self, assignment: Assignment) -> str:
        """The script with each knob's ``selected`` value set, verified."""
        return select_knobs(self.script, dict(assignment))


def select_knobs(script: str, values: dict[str, int]) -> str:
    """Set ``selected`` on every `transform.tune.knob` and
    `transform.tune.alternatives` of `script`; returns the verified text."""
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(script)
        apply_selection(module, values)
        module.operation.verify()
        return str(module)


def apply_selection(module: ir.Module, values: dict[str, int]) -> None:
    """Set knob and alternatives selections in a parsed script, in place."""
    missing: list[str] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name in ("transform.tune.knob", "transform.tune.alternatives"):
            name = ir.StringAttr(op.attributes["name"]).value
            if name not in values:
                missing.append(name)
                return ir.WalkResult.ADVANCE
            if op.name == "transform.tune.knob":
                op.attributes["selected"] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), values[name])
            else:
                op.attributes["selected_region_attr"] = ir.IntegerAttr.get(
                    ir.IntegerType.get_signless(32), values[name]
                )
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    if missing:
        raise ValueError(f"no value given for knob(s): {', '.join(missing)}")


# --------------------------------------------------------------------------
# Rules
# --------------------------------------------------------------------------

_ROW_TILES = (1, 2, 3, 4, 5, 6, 8)
_UNROLLS = (1, 2, 4)


def generate_sketches(task_mlir: str, target: Target) -> list[Sketch]:
    """All sketches for one task (the first one is the default to try)."""
    payload, ops = prepare_payload(task_mlir)
    anchors = [o for o in ops if o.role == "anchor"] or list(ops[:1])
    if not anchors:
        raise UnsupportedError("task has no Linalg operation")
    anchor = anchors[0]
    sketches: list[Sketch] = []
    if _is_mul_add_like(anchor) and anchor.reductions:
        sk = _contraction_sketch(payload, ops, anchor, target)
        if sk is not None:
            sketches.append(sk)
    sketches.append(_default_sketch(payload, ops, anchor, target))
    return sketches


def _is_mul_add_like(op: OpStructure) -> bool:
    # Contractions and convolutions: reductions, an output indexed by plain
    # loops only, and inputs indexed by the reduction loops.
    out = op.output_dims
    return all(d is not None for d in out) and len(op.parallel) >= 1 and op.name not in (
        "linalg.pooling_nhwc_max",
        "linalg.pooling_nhwc_sum",
    )


def _vector_and_row_dims(anchor: OpStructure) -> tuple[int, int | None]:
    out = [d for d in anchor.output_dims if d is not None]
    vec = out[-1]
    # Loops that appear inside compound (window) expressions next to a
    # reduction, other than the innermost window, must be tiled to 1 so the
    # convolution decomposes to a 1-D one that vectorizes.
    forced_one = _forced_unit_loops(anchor)
    row = None
    for d in reversed(out[:-1]):
        if d not in forced_one:
            row = d
            break
    return vec, row


def _forced_unit_loops(anchor: OpStructure) -> set[int]:
    """Loops that must be tiled to 1 for a convolution to decompose to 1-D:
    every window pair except the innermost one (e.g. oh and kh of a 2-D
    NHWC convolution)."""
    windows = [c for c in anchor.compound_dims if len(c) >= 2]
    forced: set[int] = set()
    for w in windows[:-1]:
        forced.update(w)
    return forced


_DECOMPOSABLE = {
    "linalg.conv_2d_nhwc_hwcf",
    "linalg.conv_2d_nchw_fchw",
    "linalg.depthwise_conv_2d_nhwc_hwc",
    "linalg.pooling_nhwc_sum",
    "linalg.pooling_nhwc_max",
    "linalg.pooling_nchw_sum",
    "linalg.pooling_nchw_max",
}


def _contraction_sketch(
    payload: str, ops: tuple[OpStructure, ...], anchor: OpStructure, target: Target
) -> Sketch | None:
    is_conv = bool(anchor.compound_dims)
    if is_conv and anchor.name not in _DECOMPOSABLE and anchor.name not in _CONV_1D:
        return None
    ranges = anchor.loop_ranges
    lanes = target.lanes(anchor.dtype)
    vec, row = _vector_and_row_dims(anchor)
    forced_one = _forced_unit_loops(anchor) if is_conv else set()
    inner_red = [d for d in anchor.reductions if d not in forced_one]
    reused = _reused_operand(anchor, row)

    # The knobs, in sampling order: the register tile first, then the outer
    # tiles as multiples of it (so every level nests, by construction).
    specs: list[KnobSpec] = []
    for d in anchor.parallel:
        if d == vec:
            opts = tuple(v for v in (lanes, 2 * lanes, 4 * lanes) if ranges[d] % v == 0) or tuple(
                x for x in divisors(ranges[d]) if x <= lanes
            )
            specs.append(KnobSpec(f"r_d{d}", opts, doc=f"vector (register) tile of loop d{d}"))
        elif d == row:
            opts = tuple(x for x in _ROW_TILES if ranges[d] % x == 0)
            specs.append(KnobSpec(f"r_d{d}", opts, doc=f"register rows of loop d{d}"))
    if inner_red:
        d = inner_red[-1]
        opts = tuple(x for x in _UNROLLS if ranges[d] % x == 0)
        specs.append(KnobSpec(f"u_d{d}", opts, doc=f"inner unroll of reduction loop d{d}"))
    reg = {sp.name for sp in specs}
    for d in anchor.parallel:
        base = f"r_d{d}" if f"r_d{d}" in reg else None
        specs.append(KnobSpec(f"p_d{d}", divisors(ranges[d]), multiple_of=base, doc=f"parallel (scf.forall) tile of loop d{d}"))
    for d in anchor.reductions:
        if d in forced_one:
            continue
        base = f"u_d{d}" if f"u_d{d}" in reg else None
        specs.append(KnobSpec(f"k_d{d}", divisors(ranges[d]), multiple_of=base, doc=f"reduction (cache) tile of loop d{d}"))
    if reused is not None:
        specs.append(
            KnobSpec("pack", (0, 1), alternatives=True, doc=f"0: copy the tile of operand {reused} to a contiguous buffer; 1: read it in place")
        )

    w = ScheduleWriter()
    h = {sp.name: w.knob(sp.name, sp.options) for sp in specs if not sp.alternatives}

    # Level 1: parallel tiles of the root, mapped to scf.forall, with every
    # other op of the task fused in (consumers first).
    roots = [o for o in ops if o.is_root]
    root = roots[-1] if roots else anchor
    root_sizes: list[int | str] = [0] * len(root.loop_ranges)
    for a_d, r_d in zip(anchor.output_dims, root.output_dims):
        if r_d is not None and a_d is not None and f"p_d{a_d}" in h:
            root_sizes[r_d] = h[f"p_d{a_d}"]
    _, forall = w.tile_forall(w.match_op_id("%root", root.op_id), root_sizes)
    for o in reversed(ops):
        if o.op_id != root.op_id:
            _, forall = w.fuse_into(w.match_op_id("%root", o.op_id), forall)

    # Level 2: reduction (cache) tiles.
    a_h = w.match_op_id(forall, anchor.op_id)
    k_sizes: list[int | str] = [h.get(f"k_d{d}", 0) if d in anchor.reductions else 0 for d in range(len(ranges))]
    if any(isinstance(s, str) for s in k_sizes):
        a_h, _ = w.tile_for(a_h, k_sizes)

    # Level 3 (structural): pack the reused operand's tile, or not.
    if reused is not None:
        n_ops = len(anchor.operand_dims)
        cur = a_h
        (a_h,) = w.alternatives(
            "pack",
            [lambda wr: [wr.pack_operand(cur, reused, n_ops, anchor.dtype)], lambda wr: [cur]],
        )

    # Level 4: register tile (rows x vector columns); other loops to 1.
    r_sizes: list[int | str] = [0] * len(ranges)
    for d in anchor.parallel:
        r_sizes[d] = h.get(f"r_d{d}", 1)
    for d in forced_one:
        r_sizes[d] = 1
    a_h, _ = w.tile_for(a_h, r_sizes)

    # Level 5: the remaining reductions, the innermost unrolled by u.
    u_sizes: list[int | str] = [0] * len(ranges)
    for d in anchor.reductions:
        u_sizes[d] = h.get(f"u_d{d}", 1)
    a_h, _ = w.tile_for(a_h, u_sizes)
    if is_conv and anchor.name in _DECOMPOSABLE:
        w.decompose(a_h)

    # Other ops in the forall (fills, fused elementwise consumers) get the
    # register tiling too, so that their vectors stay register-sized.
    for o in ops:
        if o.op_id == anchor.op_id:
            continue
        sizes: list[int | str] = [0] * len(o.loop_ranges)
        for a_d, o_d in zip(anchor.output_dims, o.output_dims):
            if o_d is not None and a_d is not None:
                sizes[o_d] = r_sizes[a_d] if r_sizes[a_d] != 0 else 1
        if any(s != 0 for s in sizes):
            w.tile_for(w.match_op_id(forall, o.op_id), sizes)
    # Copies made by packing: one row at a time (vectors of the tile width).
    if reused is not None:
        w.tile_each(w.match_ops(forall, ["linalg.copy"]), [1, 0])

    _finish(w, vectorize=True)
    forall_knobs = tuple((f"p_d{d}", ranges[d]) for d in anchor.parallel)
    return Sketch("cpu-contraction", payload, w.text(), tuple(specs), forall=forall_knobs)


_CONV_1D = ("linalg.conv_1d_nwc_wcf", "linalg.conv_1d_ncw_fcw", "linalg.depthwise_conv_1d_nwc_wc")


def _reused_operand(anchor: OpStructure, row: int | None) -> int | None:
    """The input reused across the row loop (B of C = A.B, the filter of a
    convolution): indexed by plain loops only, not by the row loop."""
    if row is None:
        return None
    for i in range(anchor.num_inputs):
        dims = anchor.operand_dims[i]
        if len(dims) >= 2 and None not in dims and row not in dims:
            return i
    return None


def _default_sketch(payload: str, ops: tuple[OpStructure, ...], anchor: OpStructure, target: Target) -> Sketch:
    """A sound schedule for any op: parallel outer tiles over scf.forall,
    with the rest of the task fused in, lowered as loops."""
    w = ScheduleWriter()
    knobs: list[KnobSpec] = []
    roots = [o for o in ops if o.is_root]
    root = roots[-1] if roots else anchor
    sizes: list[int | str] = [0] * len(root.loop_ranges)
    for d in root.parallel:
        spec = KnobSpec(f"p_d{d}", divisors(root.loop_ranges[d]), doc=f"parallel tile of loop d{d}")
        knobs.append(spec)
        sizes[d] = w.knob(spec.name, spec.options)
    if any(isinstance(s, str) for s in sizes):
        root_h = w.match_op_id("%root", root.op_id)
        _, forall = w.tile_forall(root_h, sizes)
        for o in reversed(ops):
            if o.op_id == root.op_id:
                continue
            h = w.match_op_id("%root", o.op_id)
            _, forall = w.fuse_into(h, forall)
    _finish(w, vectorize=False)
    forall_knobs = tuple((f"p_d{d}", root.loop_ranges[d]) for d in root.parallel)
    return Sketch("cpu-default", payload, w.text(), tuple(knobs), forall=forall_knobs)


def _finish(w: ScheduleWriter, *, vectorize: bool) -> None:
    func = w.match_func("%root")
    if vectorize:
        func = w.vectorize_children(func)
        w.cleanup(func)
        w.hoist_accumulators(func)
        w.cleanup(func)
    buf = w.bufferize("%root")
    func = w.match_func(buf)
    w.lower_vectors(func)
