"""Split the user's functions into tuning tasks.

Roadmap:
  * :func:`extract_tasks` is the entry point. Per function it checks the body
    (:func:`_check_function`), classifies every Linalg op from a generalized
    copy of the module (:class:`_OpInfo`), groups ops into tasks
    (:func:`_partition`), builds each task as a standalone module
    (:class:`_TaskBuilder`), hashes it (:func:`workload_key`) and merges
    identical tasks (same key) into one with ``weight`` = count.
  * A task is an *anchor* (a Linalg op with a reduction iterator, or the first
    op of an elementwise chain no anchor took), the elementwise consumers fused
    after it (single-use chain, identity access to the fused value), and cheap
    producers cloned into it (``arith.constant`` scalars and splats,
    ``tensor.empty``, ``linalg.fill`` on tensors; a ``linalg.fill`` of the
    anchor's output buffer on memrefs).
  * Ops on memrefs become ops on tensors in destination-passing style: every
    memref read or written is a tensor argument of ``@kernel``; every memref
    written is a result.

In the task module the anchor carries the unit attribute ``ansor.anchor`` and
each fused consumer ``ansor.fused``; sketches match on them.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from dataclasses import dataclass, field

from mlir import ir
from mlir.dialects import func as func_d
from mlir.passmanager import PassManager

from mlir_ansor.errors import InputError, UnsupportedError
from mlir_ansor.graph.normalize import normalize, reciprocal_divisors
from mlir_ansor.graph.prepack import Decide, prepack_weights
from mlir_ansor.graph.share import share_subexpressions
from mlir_ansor.graph.winograd import winograd_convolutions
from mlir_ansor.ir.attrs import ANCHOR_ATTR, FUSED_ATTR, PACKED_ATTR
from mlir_ansor.ir.dtypes import EPSILON, element_bytes, tolerance
from mlir_ansor.ir.program import Program, load, location_str
from mlir_ansor.ir.rewrite import defining_op
from mlir_ansor.ir.rewrite import segments as _segments

log = logging.getLogger(__name__)

__all__ = [
    "ALLOWED_NON_LINALG_OPS",
    "Occurrence",
    "SUPPORTED_DTYPES",
    "Task",
    "TensorSpec",
    "constant_linalg_ops",
    "generalized_copy",
    "extract_tasks",
    "linalg_flops",
    "partition",
    "workload_key",
]

SUPPORTED_DTYPES = ("f32", "f64", "bf16", "f16", "i8", "i16", "i32", "i64")
"""Element types a task may use: floats (bf16 and f16 sums accumulate in f32,
`graph.precision`), and integers wider than a bit (i8 operands with i32
accumulation, quantized models). An op on i1 masks or index values stays
out of the tasks, lowered as plain loops."""

ALLOWED_NON_LINALG_OPS = frozenset(
    {
        "func.return",
        "arith.constant",
        "tensor.empty",
        "memref.alloc",
        "memref.alloca",
        "memref.dealloc",
        # Reshapes are free views; they stay outside tasks (a reshaped value
        # is a task argument), which keeps torch-mlir output usable.
        "tensor.expand_shape",
        "tensor.collapse_shape",
        # Padding (torch-mlir pads convolution and pooling inputs) stays
        # outside tasks too: the padded tensor is the task's argument.
        "tensor.pad",
        # Slices (convolutions split into plain 2-D ones, `split_conv.py`) stay
        # outside tasks as well: tasks read and write whole tensors.
        "tensor.extract_slice",
        "tensor.insert_slice",
        # A concatenation becomes an empty tensor and a slice per operand
        # (`graph.normalize.decompose_concats`), read through the casts of
        # its operands to dynamic types (torch-mlir's roll), which then go;
        # a cast that stays leaves a dynamic type, which is refused.
        "tensor.concat",
        "tensor.cast",
    }
)
"""Non-Linalg ops that may appear in a function body; they are left outside tasks."""

_BODY_DENIED_DIALECTS = ("func.", "vector.", "memref.", "gpu.", "llvm.", "cf.", "bufferization.", "transform.")
"""Dialects whose ops a Linalg body may not hold: a task's body is scalar
arithmetic (calls, vectors, memory and control flow are not lowered)."""

_GENERALIZE = "builtin.module(func.func(linalg-generalize-named-ops))"
_CAST_OPS = re.compile(
    r"arith\.(constant|ext[fsui]+|trunc[fi]|sitofp|uitofp|fptosi|fptoui|index_cast\w*|bitcast)$"
)
_DIM = re.compile(r"d(\d+)")
_CONVERSIONS = frozenset({"extf", "truncf", "extsi", "extui", "trunci", "sitofp", "uitofp", "fptosi", "fptoui"})
"""The arith ops that convert between element types (a generic of these
only is named after them)."""


@dataclass(frozen=True)
class TensorSpec:
    """Shape and element type of one argument or result of a task."""

    shape: tuple[int, ...]
    dtype: str
    """MLIR element type spelling: "f32", "f64", ..."""


@dataclass(frozen=True)
class Task:
    """One tuning task: a standalone ``@kernel`` function and what it costs."""

    name: str
    """Readable and unique within one extract_tasks() result, e.g. matmul_128x256x64_f32."""
    workload_key: str
    """16 hex chars; structural hash of the task (see workload_key())."""
    mlir: str
    """A module holding ``func.func @kernel(inputs as tensors) -> outputs``."""
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    flops: int
    """Arithmetic ops of all ops of the task (anchor and fused)."""
    weight: int
    """How many times this task occurs in the input."""
    anchor_op: str
    """The anchor's op name, e.g. linalg.matmul."""
    kind: str
    """contraction | convolution | reduction | pooling | elementwise."""
    loop_ranges: tuple[int, ...]
    """Static iteration domain of the generalized anchor, in loop order."""
    iterator_types: tuple[str, ...]
    """"parallel" or "reduction" per anchor loop."""
    locations: tuple[str, ...]
    """file:line:col of the anchor in the user's input, one per occurrence."""
    func_name: str
    """The user's function the first occurrence came from."""
    accumulator_dtype: str = ""
    """Element type the anchor sums in (its output's: "f32" for a bf16
    matmul, whose f32 sum a fused op rounds to bf16); "" when it sums
    nothing (elementwise ops, maxima) or is not known."""
    rounding_dtype: str = ""
    """The narrowest floating-point type the task rounds a computed value to
    (a bf16 sum of two bf16 values; a truncation to bf16 between two f32
    ops), which its check allows for; "" when it computes no float value."""

    @property
    def bytes(self) -> int:
        """Bytes its arguments and results hold (each read or written once:
        what a memory-bound task must move at least)."""
        return sum(math.prod(t.shape) * element_bytes(t.dtype) for t in (*self.inputs, *self.outputs))

    @property
    def memory_bound(self) -> bool:
        """Whether its speed is a matter of bytes moved rather than of
        arithmetic: every kind but contractions and convolutions."""
        return self.kind not in ("contraction", "convolution")

    @property
    def reduction_length(self) -> int:
        """How many terms each output element sums or combines: the product
        of the anchor's reduction loop extents (1 for elementwise tasks)."""
        n = 1
        for r, it in zip(self.loop_ranges, self.iterator_types):
            if it == "reduction":
                n *= r
        return n

    @property
    def tolerance(self) -> float:
        """The relative error a candidate's outputs may have against the
        reference: the largest `ir.dtypes.tolerance` of an output's element
        type, with the reduction length, the anchor's accumulation type and
        the narrowest type a value is rounded to (a bf16 result of an f32
        sum: the f32 accumulation and the bf16 rounding); 0 when every
        output is an integer computed exactly."""
        acc = self.accumulator_dtype or None
        narrow = self.rounding_dtype or None
        dtypes = [o.dtype for o in self.outputs] or ["f32"]
        return max(tolerance(d, self.reduction_length, accumulate=acc, rounds_to=narrow) for d in dtypes)


# --------------------------------------------------------------------------
# Facts about one Linalg op, read from its generalized form.


@dataclass(eq=False)
class _OpInfo:
    op: ir.Operation
    """The original op (named or generic)."""
    maps: list[ir.AffineMap]
    iterators: list[str]
    n_ins: int
    n_outs: int
    body: list[str]
    """Op names of the generalized body, linalg.yield excluded."""
    ranges: tuple[int, ...]
    on_memref: bool

    @property
    def name(self) -> str:
        return self.op.name

    @property
    def is_fill(self) -> bool:
        return self.op.name == "linalg.fill"

    @property
    def has_reduction(self) -> bool:
        return "reduction" in self.iterators

    @property
    def flops(self) -> int:
        if self.is_fill or self.op.name == "linalg.copy":
            return 0
        arith = sum(1 for n in self.body if _is_arith(n))
        return math.prod(self.ranges) * arith

    @property
    def kind(self) -> str:
        return _kind(self.maps, self.iterators, self.body)


def _is_arith(name: str) -> bool:
    if name.startswith("math."):
        return True
    return name.startswith("arith.") and not _CAST_OPS.match(name)


def _kind(maps: list[ir.AffineMap], iterators: list[str], body: list[str]) -> str:
    if "reduction" not in iterators:
        return "elementwise"
    has_mul = any(n in ("arith.mulf", "arith.muli") for n in body)
    has_add = any(n in ("arith.addf", "arith.addi") for n in body)
    if all(m.is_projected_permutation for m in maps):
        return "contraction" if has_mul and has_add else "reduction"
    return "convolution" if has_mul else "pooling"


def _isa(cls: type, obj: object) -> bool:
    """Whether an MLIR type/attribute can be viewed as ``cls``."""
    try:
        cls(obj)
    except (ValueError, TypeError):
        return False
    return True


def _iterator_name(attr: ir.Attribute) -> str:
    text = str(attr)  # "#linalg.iterator_type<parallel>"
    return "reduction" if "reduction" in text else "parallel"


def _shape_of(t: ir.Type) -> list[int] | None:
    if _isa(ir.ShapedType, t):
        return list(ir.ShapedType(t).shape)
    return None


def _loop_ranges(op: ir.Operation, maps: list[ir.AffineMap]) -> tuple[int, ...] | None:
    if not maps:
        return ()
    n = maps[0].n_dims
    ranges: list[int | None] = [None] * n
    for value, amap in zip(op.operands, maps):
        shape = _shape_of(value.type) or []
        for j, expr in enumerate(amap.results):
            m = _DIM.fullmatch(str(expr))
            if m and j < len(shape) and ranges[int(m.group(1))] is None:
                ranges[int(m.group(1))] = shape[j]
    if any(r is None for r in ranges):
        return None
    return tuple(int(r) for r in ranges)  # type: ignore[arg-type]


def _generic_info(original: ir.Operation, generic: ir.Operation) -> _OpInfo:
    maps = [ir.AffineMapAttr(a).value for a in generic.attributes["indexing_maps"]]
    iterators = [_iterator_name(a) for a in generic.attributes["iterator_types"]]
    n_ins, n_outs = _segments(generic)
    body = [
        o.name
        for o in generic.regions[0].blocks[0].operations
        if o.name != "linalg.yield"
    ]
    ranges = _loop_ranges(generic, maps)
    if ranges is None:
        raise UnsupportedError(
            f"{location_str(original)}: {original.name}: cannot infer the loop ranges "
            "from the operand shapes (a loop appears in no plain indexing-map result)"
        )
    on_memref = any(_isa(ir.MemRefType, v.type) for v in original.operands)
    return _OpInfo(original, maps, iterators, n_ins, n_outs, body, ranges, on_memref)


def generalized_copy(module: ir.Module):
    """A generalized copy of `module` (a ``builtin.module`` op: ``.body``,
    ``.operation``). A clone, not printed and parsed again: attributes are
    shared, not copied, so ResNet-50's 100 MB of weights cost nothing here
    (the text round trip took 0.8 s of a 1.7 s partition)."""
    copy = module.operation.clone()
    PassManager.parse(_GENERALIZE, module.context).run(copy.operation)
    return copy


def linalg_flops(module: ir.Module) -> int:
    """The arithmetic operations of the Linalg ops of `module`, counted as
    `Task.flops` counts them: each op's iteration space times the arith ops
    of its generalized body (fills and copies count 0, and so does an op
    whose loop ranges are not static)."""
    total = 0

    def visit(op: ir.Operation) -> ir.WalkResult:
        nonlocal total
        if op.name == "linalg.generic":
            try:
                total += _generic_info(op, op).flops
            except UnsupportedError:  # loop ranges that are not static
                pass
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    generalized_copy(module).operation.walk(visit)
    return total


# --------------------------------------------------------------------------
# Checks on the user's function.


def _dtype_str(t: ir.Type) -> str:
    if _isa(ir.ShapedType, t):
        return str(ir.ShapedType(t).element_type)
    return str(t)


def _check_type(op: ir.Operation, t: ir.Type) -> None:
    where = f"{location_str(op)}: {op.name}"
    if _isa(ir.ShapedType, t):
        st = ir.ShapedType(t)
        if not st.has_rank or not st.has_static_shape:
            raise UnsupportedError(
                f"{where}: dynamic shape {t}: tasks are static; give the dynamic dimensions sizes "
                "(tune/run/compile --sizes ARG.DIM=V1,V2,..., or mlir_ansor.graph.dynamic.specializations)"
            )
        if any(d == 0 for d in st.shape):
            raise UnsupportedError(
                f"{where}: zero-sized dimension in {t}: there is nothing to compute "
                "(every dimension must be at least 1)"
            )
        if _isa(ir.MemRefType, t):
            layout = str(ir.MemRefType(t).layout)
            if not (layout.startswith("affine_map<(d") and _is_identity_text(layout)):
                raise UnsupportedError(
                    f"{where}: memref with a non-identity layout {t} is not supported yet"
                )
        if _isa(ir.RankedTensorType, t) and ir.RankedTensorType(t).encoding is not None:
            raise UnsupportedError(
                f"{where}: tensor encoding in {t} is not supported yet"
            )
    dtype = _dtype_str(t)
    if dtype not in SUPPORTED_DTYPES:
        raise UnsupportedError(
            f"{where}: element type {dtype} is not supported yet "
            f"({', '.join(SUPPORTED_DTYPES)} are)"
        )


def _is_identity_text(layout: str) -> bool:
    m = re.fullmatch(r"affine_map<\(([^)]*)\) -> \(([^)]*)\)>", layout)
    return bool(m) and m.group(1) == m.group(2)


def _check_linalg_op(op: ir.Operation) -> None:
    for v in op.operands:
        _check_type(op, v.type)
    for r in op.results:
        _check_type(op, r.type)


def _check_body(op: ir.Operation, checks: bool = False) -> None:
    """Fail on an op a Linalg op's body may not hold, at that op's own
    file and line. `checks`: a ``cf.assert`` may stay (before
    normalization, which turns a gather's checks into clamps:
    `graph.normalize.clamp_gathers`)."""
    for region in op.regions:
        for block in region.blocks:
            for inner in block.operations:
                name = inner.operation.name
                if name.startswith(_BODY_DENIED_DIALECTS) and not (checks and name == "cf.assert"):
                    raise UnsupportedError(
                        f"{location_str(inner.operation)}: {name} is not supported inside the body of "
                        f"{op.name} ({location_str(op)}); a body may hold scalar arith and math ops"
                    )
                _check_body(inner.operation, checks)


def _untunable_dtype(op: ir.Operation) -> str | None:
    """The first integer element type of `op`'s operands or results that
    tasks do not take (i1 masks, index values: ops that stay out of tasks),
    if its shapes are otherwise fine and its other types are ones tasks take;
    None otherwise. Other floats (f8 types, f128) are not "untunable":
    :func:`_check_linalg_op` refuses them, as it refuses dynamic shapes, so
    that a model in those types is not silently compiled to plain loops."""
    types = [v.type for v in op.operands] + [r.type for r in op.results]
    for t in types:
        if _isa(ir.ShapedType, t) and not (ir.ShapedType(t).has_rank and ir.ShapedType(t).has_static_shape):
            return None
    found = None
    for t in types:
        dtype = _dtype_str(t)
        if dtype in SUPPORTED_DTYPES:
            continue
        if not re.fullmatch(r"i\d+|index", dtype):
            return None
        found = found or dtype
    return found


def _function_body(fn: ir.Operation) -> ir.Block | None:
    region = fn.regions[0]
    blocks = list(region.blocks)
    if not blocks:
        return None  # a declaration
    if len(blocks) > 1:
        raise UnsupportedError(
            f"{location_str(fn)}: func.func @{_func_name(fn)}: functions with several "
            "blocks (control flow) are not supported yet"
        )
    return blocks[0]


def _func_name(fn: ir.Operation) -> str:
    return ir.StringAttr(fn.attributes["sym_name"]).value


def constant_linalg_ops(block: ir.Block) -> list[ir.Operation]:
    """Linalg ops of ``block`` (fills excepted) that compute from constants
    only, in program order.

    A value is constant when an ``arith.constant`` or ``tensor.empty`` makes
    it, or an op on tensors whose operands (and the values its regions
    capture) are all constant. torch-mlir leaves such ops on the weights
    (``linalg.transpose`` of a linear layer's weight, the batch-norm
    ``1 / sqrt(var + eps)``): they are no tasks (their result is the same on
    every call), and :func:`mlir_ansor.compile` evaluates them once at compile
    time. Fills stay where they are: tasks clone them as producers.
    """
    found: list[ir.Operation] = []
    _constants(block, found)
    return found


def constant_values(block: ir.Block) -> set:
    """The values of ``block`` computed from constants only (see
    :func:`constant_linalg_ops`)."""
    return _constants(block, [])


def _constants(block: ir.Block, linalg_ops: list[ir.Operation]) -> set:
    const_vals: set = set()
    for opview in block.operations:
        op = opview.operation
        if op.name in ("arith.constant", "tensor.empty"):
            const_vals.update(op.results)
            continue
        if not len(op.results):
            continue
        operands = list(op.operands) + _captured_values(op)
        if any(_isa(ir.MemRefType, v.type) for v in operands) or any(
            _isa(ir.MemRefType, r.type) for r in op.results
        ):
            continue
        if all(v in const_vals for v in operands):
            const_vals.update(op.results)
            if op.name.startswith("linalg.") and op.name != "linalg.fill":
                linalg_ops.append(op)
    return const_vals


def _check_function(block: ir.Block, linalg_types: bool = True, left_out: list[str] | None = None) -> list[ir.Operation]:
    """The function's Linalg ops to tune, in order, after checking every op
    of its body (ops on constants only are left out, see
    :func:`constant_linalg_ops`). ``linalg_types=False`` checks only which
    ops there are (before normalization, which may remove some). Ops whose
    element types tasks do not take are left out, and described in
    `left_out`."""
    linalg_ops: list[ir.Operation] = []
    constant = set(constant_linalg_ops(block))
    for opview in block.operations:
        op = opview.operation
        if op in constant:
            continue
        if op.name.startswith("linalg."):
            _check_body(op, checks=not linalg_types)
            if linalg_types:
                dtype = _untunable_dtype(op)
                if dtype is not None:
                    # Left where it is, out of every task: the driver lowers
                    # it to plain loops, like the glue around the tasks.
                    why = f"{location_str(op)}: {op.name} has element type {dtype}, which tasks do not take yet ({', '.join(SUPPORTED_DTYPES)} do)"
                    log.info("%s: left out of the tasks, lowered without a schedule", why)
                    if left_out is not None:
                        left_out.append(why)
                    continue
                _check_linalg_op(op)
            linalg_ops.append(op)
        elif op.name not in ALLOWED_NON_LINALG_OPS:
            raise UnsupportedError(
                f"{location_str(op)}: {op.name} is not supported inside a function to tune; "
                "mlir-ansor tunes functions made of Linalg ops (plus "
                f"{', '.join(sorted(ALLOWED_NON_LINALG_OPS))})"
            )
    return linalg_ops


# --------------------------------------------------------------------------
# Partition into groups of ops.


@dataclass
class _Group:
    anchor: _OpInfo
    fused: list[_OpInfo] = field(default_factory=list)
    pre: list[_OpInfo] = field(default_factory=list)
    """Member ops emitted before the anchor (a memref fill of its output;
    an attention's scores and softmax)."""
    label: _OpInfo | None = None
    """The op that names the task in place of the anchor (an attention's
    first matmul: ``attention_<batch>x<rows>x<keys>x<head dim>``)."""

    @property
    def members(self) -> list[_OpInfo]:
        return [*self.pre, self.anchor, *self.fused]


def _fusable_consumer(
    tail: _OpInfo, infos: dict[ir.Operation, _OpInfo], taken: set
) -> _OpInfo | None:
    """The elementwise op that can be fused after ``tail``, if there is one."""
    if tail.on_memref or len(tail.op.results) != 1:
        return None
    value = tail.op.results[0]
    owners = {use.owner.operation for use in value.uses}
    if len(owners) != 1:
        return None
    (owner,) = owners
    cand = infos.get(owner)
    if (
        cand is None
        or cand in taken
        or cand.is_fill
        or cand.has_reduction
        or cand.on_memref
    ):
        return None
    if cand.n_outs != 1 or cand.op.name == "linalg.copy":
        return None
    out_map = cand.maps[cand.n_ins]
    if not out_map.is_permutation or not all(
        m.is_projected_permutation for m in cand.maps
    ):
        return None
    if ir.ShapedType(value.type).shape != ir.ShapedType(cand.op.results[0].type).shape:
        return None
    for i, operand in enumerate(cand.op.operands):
        if operand == value and str(cand.maps[i]) != str(out_map):
            return None
    return cand


def _partition(linalg_infos: list[_OpInfo], fuse_rows: bool = False) -> list[_Group]:
    infos = {i.op: i for i in linalg_infos}
    taken: set = set()
    groups: list[_Group] = []

    def grow(group: _Group) -> None:
        tail = group.anchor
        while True:
            nxt = _fusable_consumer(tail, infos, taken)
            if nxt is None:
                return
            taken.add(nxt)
            group.fused.append(nxt)
            tail = nxt

    for pos, info in enumerate(linalg_infos):
        if info.is_fill or not info.has_reduction:
            continue
        taken.add(info)
        group = _Group(info)
        if info.on_memref and pos > 0:
            prev = linalg_infos[pos - 1]
            inits = list(info.op.operands)[info.n_ins :]
            if (
                prev.is_fill
                and prev.on_memref
                and prev not in taken
                and list(prev.op.operands)[prev.n_ins] in inits
            ):
                taken.add(prev)
                group.pre.append(prev)
        grow(group)
        groups.append(group)
    for info in linalg_infos:
        if info in taken or info.is_fill:
            continue
        taken.add(info)
        group = _Group(info)
        grow(group)
        groups.append(group)
    order = {info.op: k for k, info in enumerate(linalg_infos)}
    groups.sort(key=lambda g: order[g.anchor.op])
    if not (fuse_rows and FUSE_ROWS):
        return groups
    groups = _merge_rows(groups, order)
    return _merge_attention(groups, order) if FUSE_ATTENTION else groups


FUSE_ROWS = True
"""Whether the partitioner joins a row-wise chain of reductions and their
elementwise ops (softmax, layer norm) into one task (:func:`_merge_rows`)
where the target asks for it (``fuse_rows`` of the extraction's `prepack`:
CPUs). Off: the ops are tasks of their own, as before."""


def row_rank(iterators, operand_dims, num_inputs: int) -> int:
    """How many leading loops of an op are its rows: parallel loops that
    index the leading dimensions of its outputs in order, and of each input
    either the same way or not at all (a bias or a scale read by every
    row). `operand_dims`: per operand, the loop each dimension is indexed
    by (None for anything else). The partitioner joins ops over such rows
    (:func:`_merge_rows`), and the ``cpu-row-fused`` rule tiles them."""
    p = 0
    while p < len(iterators) and iterators[p] == "parallel":
        lead = tuple(range(p + 1))
        if not all(tuple(d[: p + 1]) == lead for d in operand_dims[num_inputs:]):
            break
        if not all(tuple(d[: p + 1]) == lead or not set(lead) & set(d) for d in operand_dims[:num_inputs]):
            break
        p += 1
    return p


def _map_dims(m: ir.AffineMap) -> tuple[int | None, ...]:
    """The loop each result of `m` is, None where it is not a loop."""
    return tuple(e.position if isinstance(e, ir.AffineDimExpr) else None for e in m.results)


def _rows_of(members: list[_OpInfo]) -> tuple[int, ...]:
    """The row extents the ops share: the longest common prefix of their
    loop ranges over loops that are rows of every op (:func:`row_rank`),
    such that every op reads what another of them made row by row (its map
    leads with the rows); () if none."""
    p = min(row_rank(m.iterators, [_map_dims(a) for a in m.maps], m.n_ins) for m in members)
    rows = members[0].ranges[:p]
    for m in members[1:]:
        k = 0
        while k < len(rows) and m.ranges[k] == rows[k]:
            k += 1
        rows = rows[:k]
    made = {r for m in members for r in m.op.results}
    lead = tuple(range(len(rows)))
    for m in members:
        for v, amap in zip(list(m.op.operands)[: m.n_ins], m.maps):
            if v in made and _map_dims(amap)[: len(rows)] != lead:
                return ()
    return rows


def _merge_rows(groups: list[_Group], order: dict) -> list[_Group]:
    """Join runs of consecutive groups that compute row by row into one
    group: a softmax (scale, maximum, exp, sum, divide) or a layer norm
    (residual add, mean, centred square, variance, normalize) is five to
    seven tasks, each reading and writing the whole tensor; joined, one
    task reads the input once and writes the output once, and its rule
    (``cpu-row-fused``) computes every op of a block of rows while the rows
    are in cache. BERT's attention scores at sequence length 384 are 7 MB
    per tensor, and five passes over them cost 2.7 ms.

    A run is joined when its groups share at least one row loop
    (:func:`_rows_of`), at least one reduces along the rest, each group
    after the first reads a result of the run, no group is on memrefs,
    nothing made inside the run but the last group's result is read outside
    it (the task has one result, and no reshape stands between two of its
    ops), and it has two reductions or more. The longest such prefix of
    each run is taken."""
    out: list[_Group] = []
    i = 0
    while i < len(groups):
        run = [groups[i]]
        j = i + 1
        while j < len(groups) and _joins(run, groups[j]):
            run.append(groups[j])
            j += 1
        k = len(run)
        while k >= 2 and not _closed(run[:k]):
            k -= 1
        if k >= 2:
            out.append(_joined(run[:k], order))
            i += k
        else:
            out.append(groups[i])
            i += 1
    return out


def _joins(run: list[_Group], nxt: _Group) -> bool:
    members = [m for g in run for m in g.members] + nxt.members
    if not all(_row_op(m) for m in members):
        return False
    if not _rows_of(members):
        return False
    made = {r for g in run for m in g.members for r in m.op.results}
    return any(v in made for m in nxt.members for v in m.op.operands)


def _row_op(m: _OpInfo) -> bool:
    """Whether `m` may join a row-wise task: a reduction or an elementwise op
    on tensors (contractions, convolutions and poolings keep their rules)."""
    return not (m.on_memref or m.is_fill) and m.kind in ("reduction", "elementwise")


def _closed(run: list[_Group]) -> bool:
    """Whether only the run's last op's result is read outside the run, and
    the run has two reductions or more (the ``cpu-row-fused`` rule's tasks;
    one reduction and its elementwise ops are a task already)."""
    members = [m for g in run for m in g.members]
    ops = {m.op for m in members}
    last = run[-1].members[-1].op
    for m in members:
        for r in m.op.results:
            if m.op != last and any(u.owner.operation not in ops for u in r.uses):
                return False
    return sum(1 for m in members if m.has_reduction) >= 2


def _joined(run: list[_Group], order: dict) -> _Group:
    members = sorted((m for g in run for m in g.members), key=lambda m: order[m.op])
    anchor = next(m for m in members if m.has_reduction)
    k = members.index(anchor)
    return _Group(anchor, fused=members[k + 1 :], pre=members[:k])


def _merge_attention(groups: list[_Group], order: dict) -> list[_Group]:
    """Join an attention into one task: a batch matmul of scores (Q.K^T and
    its scaling), the softmax over their rows (a group of
    :func:`_merge_rows`) and the batch matmul of the probabilities with V.
    Apart, the scores go to memory twice and come back twice: at sequence
    length 384, 7 MB per head set. Joined, the ``cpu-attention`` rule
    computes a block of query rows at a time (scores, softmax, P.V) while
    the block's scores stay in cache. The whole row of keys is in the block
    (no online softmax): rows up to ``row_fused.LONGEST_ROW``.

    Joined when, in f32 on tensors: the softmax group reads exactly one
    contraction's result, which nothing else reads; its result is read only
    by a second contraction, as that one's first input, reduced along the
    softmax rows' last loop; both contractions compute the softmax's rows
    (:func:`_attention_rows`)."""
    maker: dict = {}
    for k, g in enumerate(groups):
        for m in g.members:
            for r in m.op.results:
                maker[r] = k
    merged: dict[int, _Group] = {}
    gone: set[int] = set()
    for k, rows in enumerate(groups):
        members = rows.members
        if k in gone or sum(1 for m in members if m.has_reduction) < 2 or not all(_row_op(m) for m in members):
            continue
        made = {r for m in members for r in m.op.results}
        sources = {maker.get(v) for m in members for v in list(m.op.operands)[: m.n_ins] if v not in made}
        producers = [j for j in sources if j is not None and groups[j].anchor.kind == "contraction"]
        if len(producers) != 1 or producers[0] in gone or producers[0] in merged:
            continue
        first = groups[producers[0]]
        scores = first.members[-1].op.results
        ops = {m.op for m in members}
        if len(scores) != 1 or any(u.owner.operation not in ops for u in scores[0].uses):
            continue
        probs = members[-1].op.results
        users = list(probs[0].uses) if len(probs) == 1 else []
        if len(users) != 1 or users[0].operand_number != 0:
            continue
        second = next((j for j, g in enumerate(groups) if g.anchor.op == users[0].owner.operation), None)
        if second is None or second in gone or groups[second].anchor.kind != "contraction":
            continue
        last = groups[second]
        shape = ir.ShapedType(probs[0].type).shape
        if not _attention_rows(first.anchor, shape) or not _attention_rows(last.anchor, shape, keys=shape[-1]):
            continue
        every = [m for g in (first, rows, last) for m in g.members]
        if any(g.pre for g in (first, last)) or any(m.on_memref or not _all_f32(m) for m in every):
            continue
        pre = sorted(first.members + members, key=lambda m: order[m.op])
        merged[second] = _Group(last.anchor, fused=list(last.fused), pre=pre, label=first.anchor)
        gone |= {producers[0], k}
    return [merged.get(k, g) for k, g in enumerate(groups) if k not in gone]


FUSE_ATTENTION = True
"""Whether the partitioner joins an attention (scores, softmax, P.V) into
one task where it joins rows (:func:`_merge_attention`)."""

RECIPROCAL_DIVISORS = True
"""Whether the extraction turns divisions by a broadcast input into
multiplications by its reciprocal where the target asks for it
(``reciprocals`` of the extraction's `prepack`: CPUs;
`graph.normalize.reciprocal_divisors`)."""

WINOGRAD = False
"""Whether the extraction computes 3x3 convolutions in Winograd's F(4x4,
3x3) where the target asks for it (``winograd`` of the extraction's
`prepack`: CPUs; `graph.winograd`). Off by default: a convolution tuned
alone runs 1.76-1.96x faster (56 x 56 x 64, 28 x 28 x 128), but ResNet-50
at 1 thread and 160 trials ran 99.2 ms with it against 101.0 without
(within this host's noise): its 10 more tasks thin the budget, and its
tuning took 1166 s instead of 896 (Emerald Rapids)."""


def _attention_rows(info: _OpInfo, shape: list[int], keys: int | None = None) -> bool:
    """Whether the contraction `info` computes the rows of a softmax over
    `shape` ([batch..., rows, keys]): its loops are the batch loops, the
    rows, one more parallel loop and one reduction (over the keys where
    `keys` is given), its output and first input lead with the batch loops
    and the rows in any order (Q read and the output written through a
    folded transpose: ``Q[row, head, d]``), and its second input is indexed
    by the batch loops and read by every row."""
    nr = len(shape) - 1
    its = info.iterators
    if len(its) != nr + 2 or its[: nr + 1] != ["parallel"] * (nr + 1) or its[-1] != "reduction":
        return False
    if info.n_ins != 2 or info.n_outs != 1 or list(info.ranges[:nr]) != list(shape[:nr]):
        return False
    if keys is not None and info.ranges[-1] != keys:
        return False
    a, b, out = (_map_dims(m) for m in info.maps)
    lead = tuple(range(nr))
    return sorted(out[:nr]) == sorted(a[:nr]) == list(lead) and set(lead[:-1]) <= set(b) and nr - 1 not in b


def _all_f32(info: _OpInfo) -> bool:
    """Whether every shaped operand of `info` holds f32 (the attention rule
    computes with FMAs; bf16's dot-product layouts are the matmul rules')."""
    return all(
        isinstance(ir.ShapedType(v.type).element_type, ir.F32Type)
        for v in info.op.operands
        if _isa(ir.ShapedType, v.type)
    )


# --------------------------------------------------------------------------
# Build a task module.


def _tensor_type(t: ir.Type) -> ir.Type:
    if _isa(ir.MemRefType, t):
        mt = ir.MemRefType(t)
        return ir.RankedTensorType.get(list(mt.shape), mt.element_type)
    return t


def _spec(t: ir.Type) -> TensorSpec:
    st = ir.ShapedType(t)
    return TensorSpec(tuple(int(d) for d in st.shape), str(st.element_type))


def _captured_values(op: ir.Operation) -> list[ir.Value]:
    """Values used inside op's regions but defined outside op, in first-use order."""
    defined: set = set()
    used: list[ir.Value] = []

    def visit(inner: ir.Operation) -> ir.WalkResult:
        for region in inner.regions:
            for block in region.blocks:
                defined.update(block.arguments)
        if inner != op:
            defined.update(inner.results)
        return ir.WalkResult.ADVANCE

    op.walk(visit, ir.WalkOrder.PRE_ORDER)

    def collect(inner: ir.Operation) -> ir.WalkResult:
        if inner != op:
            for v in inner.operands:
                if v not in defined and v not in used:
                    used.append(v)
        return ir.WalkResult.ADVANCE

    op.walk(collect, ir.WalkOrder.PRE_ORDER)
    return used


class _TaskBuilder:
    """Emits one group of ops into a fresh ``@kernel`` on tensors."""

    def __init__(self, ctx: ir.Context, group: _Group) -> None:
        self.ctx = ctx
        self.group = group
        self.loc = ir.Location.unknown(ctx)
        self.module = ir.Module.create(self.loc)
        with ctx, self.loc, ir.InsertionPoint(self.module.body):
            self.fn = func_d.FuncOp("kernel", ([], []))
        self.block = self.fn.add_entry_block()
        self.mapping: dict[ir.Value, ir.Value] = {}
        self.arg_types: list[ir.Type] = []
        self.written: list[ir.Value] = []  # memrefs written, first-write order
        self.member_ops = {m.op for m in group.members}
        self.arg_sources: list[ir.Value] = []
        """The original value behind each argument of ``@kernel``."""
        self.result_sources: list[ir.Value] = []
        """The original value (op result, or memref written) behind each result."""

    # Values -------------------------------------------------------------
    def value(self, v: ir.Value, user: ir.Operation) -> ir.Value:
        if v in self.mapping:
            return self.mapping[v]
        producer = defining_op(v)
        if producer is not None:
            if self._cloneable(producer):
                self._emit(producer, role=None)
                return self.mapping[v]
        t = v.type
        if not _isa(ir.ShapedType, t):
            raise UnsupportedError(
                f"{location_str(user)}: {user.name}: scalar operand of type {t} defined "
                "outside the op is not supported yet (only tensors, memrefs and constants)"
            )
        arg = self.block.add_argument(_tensor_type(t), self.loc)
        self.arg_types.append(_tensor_type(t))
        self.arg_sources.append(v)
        self.mapping[v] = arg
        return arg

    @staticmethod
    def _cloneable(op: ir.Operation) -> bool:
        if op.name == "tensor.empty":
            return True
        if op.name == "arith.constant":
            t = op.results[0].type
            if not _isa(ir.ShapedType, t):
                return True
            return (
                _isa(ir.DenseElementsAttr, op.attributes["value"])
                and ir.DenseElementsAttr(op.attributes["value"]).is_splat
            )
        if op.name == "linalg.fill":
            return not any(_isa(ir.MemRefType, v.type) for v in op.operands)
        return False

    # Ops ----------------------------------------------------------------
    def _emit(self, op: ir.Operation, role: str | None) -> ir.Operation:
        operands = [self.value(v, op) for v in op.operands]
        captured = [self.value(v, op) for v in _captured_values(op)]
        captured_map = dict(zip(_captured_values(op), captured))
        on_memref = any(_isa(ir.MemRefType, v.type) for v in op.operands)
        if on_memref:
            _, n_outs = _segments(op)
            outs = list(op.operands)[len(op.operands) - n_outs :]
            result_types = [_tensor_type(v.type) for v in outs]
        else:
            outs = []
            result_types = [r.type for r in op.results]
        attrs = {
            op.attributes[i].name: op.attributes[i].attr
            for i in range(len(op.attributes))
        }
        with self.ctx, self.loc, ir.InsertionPoint(self.block):
            new = ir.Operation.create(
                op.name,
                results=result_types,
                operands=operands,
                attributes=attrs,
                regions=len(op.regions),
            )
            if op.regions:
                clone = op.clone()
                for k, region in enumerate(clone.regions):
                    for blk in list(region.blocks):
                        blk.append_to(new.regions[k])
                clone.erase()
            if captured_map:

                def remap(inner: ir.Operation) -> ir.WalkResult:
                    if inner != new:
                        for idx, v in enumerate(inner.operands):
                            if v in captured_map:
                                inner.operands[idx] = captured_map[v]
                    return ir.WalkResult.ADVANCE

                new.walk(remap)
            if role is not None:
                new.attributes[role] = ir.UnitAttr.get()
        if on_memref:
            for memref, res in zip(outs, new.results):
                if memref not in self.written:
                    self.written.append(memref)
                self.mapping[memref] = res
        else:
            for old, res in zip(op.results, new.results):
                self.mapping[old] = res
        return new

    def build(self) -> tuple[ir.Module, list[ir.Type], list[ir.Type]]:
        with self.ctx, self.loc:
            return self._build()

    def _build(self) -> tuple[ir.Module, list[ir.Type], list[ir.Type]]:
        g = self.group
        for info in g.pre:
            self._emit(info.op, role=None)
        self._emit(g.anchor.op, role=ANCHOR_ATTR)
        for info in g.fused:
            self._emit(info.op, role=FUSED_ATTR)
        outputs: list[ir.Value] = []
        sources: list[ir.Value] = []
        if self.written:
            sources = list(self.written)
        else:
            for info in g.members:
                for r in info.op.results:
                    if any(u.owner.operation not in self.member_ops for u in r.uses):
                        sources.append(r)
            if not sources:
                sources = list(g.members[-1].op.results)
        outputs = [self.mapping[v] for v in sources]
        self.result_sources = sources
        with self.ctx, self.loc, ir.InsertionPoint(self.block):
            func_d.ReturnOp(outputs)
            result_types = [v.type for v in outputs]
            self.fn.attributes["function_type"] = ir.TypeAttr.get(
                ir.FunctionType.get(self.arg_types, result_types)
            )
        try:
            self.module.operation.verify()
        except ir.MLIRError as err:
            msgs = "; ".join(str(d.message) for d in err.error_diagnostics)
            raise UnsupportedError(
                f"{location_str(g.anchor.op)}: {g.anchor.name}: could not extract it as a "
                f"standalone task ({msgs})"
            ) from None
        return self.module, self.arg_types, result_types


# --------------------------------------------------------------------------
# Workload key.


_GENERIC_SEMANTIC_ATTRS = ("indexing_maps", "iterator_types", "operandSegmentSizes")


def _attrs_desc(op: ir.Operation) -> list[tuple[str, str]]:
    """Sorted (name, value) of the attributes that carry meaning.

    Our role markers are described apart (generalization drops them), and a
    linalg.generic keeps only its structural attributes, since generalizing a
    named op drops the rest too.
    """
    attrs = op.attributes
    pairs = [(attrs[i].name, str(attrs[i].attr)) for i in range(len(attrs))]
    if op.name == "linalg.generic":
        pairs = [p for p in pairs if p[0] in _GENERIC_SEMANTIC_ATTRS]
    return sorted(p for p in pairs if not p[0].startswith("ansor."))


def _roles(module: ir.Module) -> list[str]:
    """The role marker (anchor/fused/none) of each op of ``@kernel``'s body."""
    fn = next(o for o in module.body.operations if o.operation.name == "func.func")
    roles = []
    for opview in fn.regions[0].blocks[0].operations:
        attrs = opview.operation.attributes
        roles.append(
            "anchor"
            if ANCHOR_ATTR in attrs
            else "fused"
            if FUSED_ATTR in attrs
            else "-"
        )
    return roles


def _describe(module: ir.Module, roles: list[str]) -> str:
    """Canonical text of a generalized task module: no SSA names, no locations,
    attributes sorted."""
    fn = next(o for o in module.body.operations if o.operation.name == "func.func")
    block = fn.regions[0].blocks[0]
    ids: dict[ir.Value, str] = {}
    for i, a in enumerate(block.arguments):
        ids[a] = f"arg{i}:{a.type}"
    lines: list[str] = []

    def ref(v: ir.Value, local: dict[ir.Value, str]) -> str:
        return local.get(v) or ids.get(v) or "?"

    for k, opview in enumerate(block.operations):
        op = opview.operation
        operands = [ref(v, {}) for v in op.operands]
        role = roles[k] if k < len(roles) else "?"
        lines.append(
            f"{k} [{role}] {op.name} ({', '.join(operands)}) -> "
            f"({', '.join(str(r.type) for r in op.results)}) {_attrs_desc(op)}"
        )
        for region in op.regions:
            for block_in in region.blocks:
                local: dict[ir.Value, str] = {}
                for j, a in enumerate(block_in.arguments):
                    local[a] = f"bb{j}:{a.type}"
                for m, inner in enumerate(block_in.operations):
                    inner = inner.operation
                    args = [ref(v, local) for v in inner.operands]
                    lines.append(
                        f"  {m} {inner.name} ({', '.join(args)}) -> "
                        f"({', '.join(str(r.type) for r in inner.results)}) {_attrs_desc(inner)}"
                    )
                    for j, r in enumerate(inner.results):
                        local[r] = f"v{m}.{j}"
                    if inner.regions:
                        lines.append("  " + inner.get_asm(print_generic_op_form=True))
        for j, r in enumerate(op.results):
            ids[r] = f"op{k}.{j}"
    return "\n".join(lines)


def workload_key(task_mlir: str | ir.Module) -> str:
    """Structural hash (16 hex chars) of a task module.

    The module is generalized (``linalg-generalize-named-ops``) in a fresh
    context first, so a named op and the equivalent ``linalg.generic`` hash the
    same; SSA names, locations, attribute order and function names do not count.
    """
    text = task_mlir if isinstance(task_mlir, str) else str(task_mlir)
    ctx = ir.Context()
    try:
        module = ir.Module.parse(text, ctx)
    except ir.MLIRError as err:
        raise InputError(f"workload_key: the task text does not parse: {err}") from None
    roles = _roles(module)
    PassManager.parse(_GENERALIZE, ctx).run(module.operation)
    return hashlib.sha256(_describe(module, roles).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------
# Names.


def _short(info: _OpInfo) -> str:
    if PACKED_ATTR in info.op.attributes:
        return "matmul_packed"  # graph.prepack's matmul on a packed constant B
    if info.name != "linalg.generic":
        return info.name.removeprefix("linalg.")
    arith = [n for n in info.body if _is_arith(n)]
    if info.kind != "elementwise":
        return info.kind
    guesses = {
        ("arith.maximumf",): "relu",
        ("arith.maxnumf",): "relu",
        ("arith.addf",): "add",
        ("arith.subf",): "sub",
        ("arith.mulf",): "mul",
        ("arith.divf",): "div",
        ("arith.cmpf", "arith.select"): "relu",
    }
    if tuple(arith) in guesses:
        name = guesses[tuple(arith)]
        if name == "relu" and len(info.op.operands) > 2:
            return "max"
        return name
    if not arith:
        # A body of element type conversions only (a bf16 result's rounding,
        # "truncf"); anything else (indices, copies) stays "copy".
        casts = {n.removeprefix("arith.") for n in info.body if n != "arith.constant"}
        if casts and casts <= _CONVERSIONS:
            return casts.pop() if len(casts) == 1 else "cast"
        return "copy"
    return "generic"


def _anchor_dtypes(info: _OpInfo) -> str:
    """The element types of an anchor for its task's name: "f32" when all
    its tensors have that one, else the distinct input types then the
    output's ("bf16_f32", "i8_i32"), scalar operands left out."""
    operands = list(info.op.operands)
    ins = [_dtype_str(v.type) for v in operands[: info.n_ins] if _isa(ir.ShapedType, v.type)]
    out = _dtype_str(operands[len(operands) - 1].type)
    seen: list[str] = []
    for d in [*ins, out]:
        if d not in seen:
            seen.append(d)
    if seen[-1] != out:  # the output type also read as an input: it ends the name
        seen.remove(out)
        seen.append(out)
    return "_".join(seen)


def _rounding_dtype(module: ir.Module) -> str:
    """The narrowest float type a scalar op in a Linalg body of `module`
    computes (constants and extensions, which are exact, aside); ""
    when there is none (see `Task.rounding_dtype`)."""
    found: list[str] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name.startswith("linalg."):
            for region in op.regions:
                for block in region.blocks:
                    for inner in block.operations:
                        name = inner.operation.name
                        if name in ("arith.constant", "arith.extf", "linalg.yield"):
                            continue
                        found.extend(str(r.type) for r in inner.operation.results if str(r.type) in EPSILON)
            return ir.WalkResult.SKIP
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    return max(found, key=EPSILON.__getitem__, default="")


def _accumulator_dtype(info: _OpInfo) -> str:
    """The element type an anchor sums in (its output's), or "" for an anchor
    that sums nothing (elementwise, a maximum): its results are rounded
    once, in their own type."""
    if not info.has_reduction or not any(n in ("arith.addf", "arith.addi") for n in info.body):
        return ""
    operands = list(info.op.operands)
    return _dtype_str(operands[len(operands) - 1].type)


def _task_name(group: _Group, dtype: str) -> str:
    a = group.anchor
    if group.label is not None:
        return "_".join(["attention", "x".join(str(r) for r in group.label.ranges), dtype])
    parts = [_short(a), "x".join(str(r) for r in a.ranges), dtype]
    parts += [_short(f) for f in group.fused]
    return "_".join(p for p in parts if p)


# --------------------------------------------------------------------------
# Entry point.


@dataclass(frozen=True, eq=False)
class Occurrence:
    """One place a task occurs in a user's function, tied to that function's IR.

    The values and ops belong to the :class:`Program` given to
    :func:`partition`; they stay valid while it lives and is not modified.
    Calling the task's ``@kernel`` on ``args`` computes ``results``: on
    tensors, ``results`` are op results the rest of the function uses; on
    memrefs, they are the memrefs the occurrence writes (the kernel returns
    their new contents).
    """

    task: Task
    """The merged task (same object for every occurrence of one workload)."""
    func_name: str
    ops: tuple[ir.Operation, ...]
    """The member ops in the user's function, in program order."""
    args: tuple[ir.Value, ...]
    """One value of the user's function per ``@kernel`` argument, in order."""
    results: tuple[ir.Value, ...]
    """One value of the user's function per ``@kernel`` result, in order."""
    on_memref: bool
    """Whether the occurrence works on memrefs (results are memrefs written)."""


def _load_program(program_or_module: Program | ir.Module | str) -> Program:
    return (
        program_or_module
        if isinstance(program_or_module, Program)
        else load(program_or_module)
    )


def extract_tasks(
    program_or_module: Program | ir.Module | str, *, func: str | None = None, prepack: Decide | None = None
) -> list[Task]:
    """Split every function (or only ``func``) into tuning tasks.

    Accepts a :class:`Program`, an ``ir.Module`` (loaded into our own context
    first) or anything :func:`mlir_ansor.ir.program.load` takes as a path.
    Identical tasks are merged: ``weight`` counts them, ``locations`` lists
    each occurrence. Raises :class:`UnsupportedError` for what cannot be tuned
    (dynamic shapes, element types other than those of
    :data:`SUPPORTED_DTYPES`, non-Linalg compute ops, no Linalg op at all).
    `prepack`: the target's rewrites of the graph (its ``share_costly``
    attribute: compute once a costly subexpression two ops repeat,
    :mod:`.share`; ``fuse_rows``: one task for a softmax or a layer norm,
    :func:`_merge_rows`), and which matmuls with a constant B to read it packed for the
    target's dot products (:mod:`.prepack`); None: none. The workload keys
    depend on it: `tune`'s records match the tasks extracted with its
    target's decisions, which `search.tasks.tasks_for` does (the tuner,
    the compiler and the tools all go through it).
    """
    return _extract(_load_program(program_or_module), func, prepack)[0]


def partition(program: Program, func: str | None = None, prepack: Decide | None = None) -> list[Occurrence]:
    """Every task occurrence of every function (or only ``func``), in program
    order, with the mapping from the function's values to the task's
    arguments and results. The tasks are those :func:`extract_tasks` returns
    for the same arguments (merged, with weights)."""
    return _extract(program, func, prepack)[1]


def _extract(program: Program, func: str | None, prepack: Decide | None = None) -> tuple[list[Task], list[Occurrence]]:
    ctx = program.context
    # Unsupported ops are reported as the user wrote them, before
    # normalization's canonicalization can fold them away.
    for fn in program.module.body.operations:
        if fn.operation.name == "func.func" and (func is None or _func_name(fn.operation) == func):
            body = _function_body(fn.operation)
            if body is not None:
                _check_function(body, linalg_types=False)
    normalize(program.module)
    if prepack is not None:
        with ctx, ir.Location.unknown():
            for fn in program.module.body.operations:
                body = _function_body(fn.operation) if fn.operation.name == "func.func" else None
                if body is not None:
                    if getattr(prepack, "share_costly", False):
                        share_subexpressions(fn.operation)
                    if getattr(prepack, "reciprocals", False) and RECIPROCAL_DIVISORS:
                        reciprocal_divisors(fn.operation)
                    if getattr(prepack, "winograd", False) and WINOGRAD:
                        winograd_convolutions(fn.operation, constant_values(body))
                    prepack_weights(fn.operation, prepack, constant_values(body))
    funcs = [
        o.operation
        for o in program.module.body.operations
        if o.operation.name == "func.func"
    ]
    if func is not None:
        funcs = [f for f in funcs if _func_name(f) == func]
        if not funcs:
            raise UnsupportedError(f"no function @{func} in {program.source}")
    generalized = generalized_copy(program.module)
    gen_funcs = {
        _func_name(o.operation): o.operation
        for o in generalized.body.operations
        if o.operation.name == "func.func"
    }

    found: dict[str, dict] = {}
    order: list[str] = []
    left_out: list[str] = []
    pending: list[tuple[str, str, list[_OpInfo], _TaskBuilder]] = []
    for fn in funcs:
        body = _function_body(fn)
        if body is None:
            continue
        linalg_ops = _check_function(body, left_out=left_out)
        if not linalg_ops:
            continue
        gen_body = gen_funcs[_func_name(fn)].regions[0].blocks[0]
        positions = {op.operation: k for k, op in enumerate(body.operations)}
        # The k-th Linalg op of the body is the k-th of its generalized copy
        # (the generalization's folding may drop reshapes, never a Linalg op).
        gen_linalg = [o.operation for o in gen_body.operations if o.operation.name.startswith("linalg.")]
        nth = {op: k for k, op in enumerate(o.operation for o in body.operations if o.operation.name.startswith("linalg."))}
        if len(gen_linalg) != len(nth):
            raise UnsupportedError(
                f"{program.source}: @{_func_name(fn)}: generalizing its Linalg ops changed their number "
                f"({len(nth)} -> {len(gen_linalg)}); please report this input"
            )
        infos = []
        for op in linalg_ops:
            gen = gen_linalg[nth[op]]
            if gen.name != "linalg.generic":
                raise UnsupportedError(
                    f"{location_str(op)}: {op.name} cannot be generalized to linalg.generic; "
                    "it is not supported yet"
                )
            infos.append(_generic_info(op, gen))
        for group in _partition(infos, fuse_rows=getattr(prepack, "fuse_rows", False)):
            builder = _TaskBuilder(ctx, group)
            module, arg_types, res_types = builder.build()
            text = str(module)
            key = workload_key(text)
            members = sorted(group.members, key=lambda m: positions[m.op])
            pending.append((key, _func_name(fn), members, builder))
            loc = location_str(group.anchor.op)
            if key in found:
                found[key]["weight"] += 1
                found[key]["locations"].append(loc)
                continue
            a = group.anchor
            found[key] = {
                "name": _task_name(group, _anchor_dtypes(a)),
                "workload_key": key,
                "mlir": text,
                "inputs": tuple(_spec(t) for t in arg_types),
                "outputs": tuple(_spec(t) for t in res_types),
                "flops": sum(m.flops for m in group.members),
                "weight": 1,
                "anchor_op": a.name,
                "kind": a.kind,
                "loop_ranges": a.ranges,
                "iterator_types": tuple(a.iterators),
                "locations": [loc],
                "func_name": _func_name(fn),
                "accumulator_dtype": _accumulator_dtype(a),
                "rounding_dtype": _rounding_dtype(module),
            }
            order.append(key)
    if not order:
        why = f": {left_out[0]}" + (f" (and {len(left_out) - 1} more)" if len(left_out) > 1 else "") if left_out else ""
        raise UnsupportedError(f"no Linalg operation to tune in {program.source}{why}")
    tasks: list[Task] = []
    by_key: dict[str, Task] = {}
    seen: dict[str, int] = {}
    for key in order:
        fields = found[key]
        base = fields["name"]
        seen[base] = seen.get(base, 0) + 1
        if seen[base] > 1:
            fields["name"] = f"{base}_{seen[base]}"
        fields["locations"] = tuple(fields["locations"])
        by_key[key] = Task(**fields)
        tasks.append(by_key[key])
    occurrences = []
    for key, fname, members, builder in pending:
        occurrences.append(
            Occurrence(
                task=by_key[key],
                func_name=fname,
                ops=tuple(m.op for m in members),
                args=tuple(builder.arg_sources),
                results=tuple(builder.result_sources),
                on_memref=any(m.on_memref for m in members),
            )
        )
    return tasks, occurrences

