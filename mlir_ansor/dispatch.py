"""One library for a function with dynamic dimensions: schedules specialised
to a few sizes, chosen among at run time by a dispatch written in MLIR.

Roadmap: :func:`build_library` is the entry point; :class:`DynamicLibrary`
is what it returns (call it on numpy arrays, save it, load it again).

The module it compiles, for an entry ``@gemm`` whose argument 0's rows are
dynamic, specialised at 16 and 64 rows:

- ``@gemm__0_0_16``, ``@gemm__0_0_64``: the static specializations
  (`graph.dynamic.specializations`), scheduled like any static module
  (`compiler.schedule_module`: the database's records of that size, else
  those of its nearest tuned size, `search.transfer`, else the default
  schedules), their results turned into trailing memref arguments;
- ``@gemm__generic``: the function itself, bufferized on its dynamic
  shapes, valid for every extent: its matmuls tiled and vectorized with
  masks (:data:`_GENERIC_TILES`), the rest loops;
- ``@gemm__case(%s0: index) -> index``: the row of the dispatch table
  (:class:`Case`) the extents fall in, -1 for none: exact sizes first,
  then the ranges that run padded, smallest first;
- ``@gemm__block(%m: index) -> index`` and ``@gemm__cover(%r: index) ->
  index``, where the blocked path runs (below): the smallest block size
  :func:`plan_blocks` chooses for m rows, and the smallest specialised size
  that holds r rows;
- ``@gemm(%A: memref<?x64xf32>, %B: memref<64x64xf32>, %C: memref<?x64xf32>)``:
  reads the extents (``memref.dim``), checks that tied dimensions agree
  (``cf.assert``: a C caller gets an abort, the Python wrapper checks
  before the call and raises), and ``scf.index_switch``es on the case: an
  exact size casts its arguments to the static types and calls its
  specialization; a padded one copies the inputs into zero-padded buffers,
  calls the specialization of the larger size and copies the rows back;
  the default runs the blocked path where there is one symbol, paddable,
  and calls ``@gemm__generic`` otherwise.

The blocked path (:func:`_blocked`, :func:`plan_blocks`) runs the rows
the table does not take as whole blocks of specialised sizes and a rest:
for each size T, largest first, an ``scf.for`` over the blocks of T rows
that fit in what is left, each copied into a static buffer, run by
``@gemm__0_0_T`` and its output rows copied back (a block of a row-major
array is one contiguous run: the copies are memcpy); then the rest, fewer
rows than the smallest block size used, copied (by loops, :func:`_copy`:
its row count is dynamic) into a zero-padded buffer of the smallest
specialised size that holds it. 333 rows at 16, 64, 256:
256 + 64 + 13 padded to 16. It is valid for the same functions as
padding: each row of the output depends only on the same row of the
inputs.

Where the sizes come from the records (no sizes given) and the function
has one paddable symbol, the library also specialises the powers of two
between tuned sizes more than twice apart (:func:`between_sizes`: 1, 16,
64 gives 2, 4, 8 and 32 too), on schedules carried over from the nearest
tuned size; 7 rows then run padded to 8, not to 16. And where the function
is one task whose ops are its own, the rows no specialization takes run
on kernels on dynamic rows instead of the blocked path
(:func:`_ranged_functions`, ``@gemm__rows_64``): each tuned size's record
carried to a row loop of any extent (its thread tile over all the rows,
where the record's spanned them; its last register tile of rows masked),
taking the rows nearest that size (:func:`ranged_cases`). The blocked path
calls a kernel per block, each reading all of B: 100 rows at 1, 16, 64,
256, 1024 ran as 64 + 32 + 4 in 1.40x the time of a module tuned at 100,
and on 64's record on dynamic rows as fast as the same record compiled at
104 rows, padded (Emerald Rapids, 2 threads).

The padded ranges follow `compiler.DynamicModule`'s rule with ``pad=True``
(which it no longer applies by default, having an exact specialization of
every size): a symbol the function keeps apart (`graph.dynamic.paddable`:
no reduction, window or slice over it) runs at a specialised size at most
:data:`PAD_WORK` times its own, so the schedules tuned for whole register
tiles still apply. Small extents are padded too (no
`DynamicModule.PAD_FROM`): the library has no exact specialization of an
untuned 7 or 15 rows, only the dynamic-rows kernel, and that ran 7 rows
1.13x the static module against the padded 1.18x, 15 rows 1.10x against
1.00x (Emerald Rapids, 2 threads, in turns).

The caller allocates the outputs from the symbols' values: each output
dimension is static or equal to one symbol (found by specializing at
distinct probe sizes); a function whose output extents are other functions
of the sizes is refused.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import logging
import math
import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field

import numpy as np
from mlir import ir, passmanager

from mlir_ansor import compiler
from mlir_ansor.errors import AnsorError, InputError, UnsupportedError
from mlir_ansor.graph.dynamic import (
    Dim,
    argument_shapes,
    dynamic_function,
    extents,
    specializations,
    symbols_with_padding,
)
from mlir_ansor.ir.program import Program
from mlir_ansor.measure.runner import ALIGNMENT, Kernel
from mlir_ansor.passes.lowering import BUFFERIZE
from mlir_ansor.target import Target

__all__ = ["BLOCK_CALL_ROWS", "PAD_WORK", "Blocks", "Case", "DynamicLibrary", "between_sizes", "build_library", "dynamic_entry",
           "plan_blocks", "plan_cases", "ranged_cases", "sizes_to_tune", "tuned_sizes", "ROWS_PROBE"]

log = logging.getLogger("mlir_ansor")

PAD_WORK = compiler.DynamicModule.PAD_WORK
"""The most a padded size may exceed the size it stands for, per symbol, as a ratio."""

_OUT_PARAMS = "buffer-results-to-out-params{hoist-static-allocs=true modify-public-functions=true}"
_PROBES = (1009, 1013, 1019, 1021, 1031, 1033, 1039, 1049)
"""Sizes given to the symbols to see which of them each output extent is."""


@dataclass(frozen=True)
class Case:
    """One row of the dispatch table: the extents it takes (per symbol,
    ``low[k] <= value <= sizes[k]``) and the specialization that runs them
    (at `sizes`; "padded": on inputs padded to those sizes)."""

    kind: str
    """"exact", "padded" or "ranged" (a kernel on dynamic rows, :func:`_ranged_functions`)."""
    function: str
    sizes: tuple[int, ...]
    low: tuple[int, ...]

    def takes(self, values: tuple[int, ...]) -> bool:
        return all(lo <= v <= s for lo, v, s in zip(self.low, values, self.sizes))

    def label(self, groups: list[list[Dim]]) -> str:
        parts = []
        for (i, d), lo, s in zip((g[0] for g in groups), self.low, self.sizes):
            parts.append(f"{i}.{d}={s}" if lo == s else f"{i}.{d}={lo}..{s}")
        return ", ".join(parts) + {"exact": " exact", "padded": " padded"}.get(self.kind, " on dynamic rows")

    def to_json(self) -> dict:
        return {"kind": self.kind, "function": self.function, "sizes": list(self.sizes), "low": list(self.low)}


def plan_cases(groups: list[list[Dim]], padding: list[bool], specialised: list[tuple[str, dict[Dim, int]]],
               pad_work: float = PAD_WORK) -> list[Case]:
    """The dispatch table: each specialised size exactly, then (where a
    symbol is paddable) the smaller extents that run at it padded, at most
    `pad_work` times less, by increasing work (the first row that takes an
    extent runs it)."""
    exact, padded = [], []
    for name, values in specialised:
        sizes = tuple(values[g[0]] for g in groups)
        exact.append(Case("exact", name, sizes, sizes))
        low = tuple(math.ceil(s / pad_work - 1e-9) if ok else s for s, ok in zip(sizes, padding))
        if low != sizes:
            padded.append(Case("padded", name, sizes, low))
    padded.sort(key=lambda c: (math.prod(c.sizes), c.sizes))
    return exact + padded


def between_sizes(values: tuple[int, ...]) -> tuple[int, ...]:
    """`values` and the powers of two between each two of them more than
    twice apart: 1, 16, 64 -> 1, 2, 4, 8, 16, 32, 64. A library whose
    records hold only those tuned sizes otherwise runs 7 rows padded to 16
    (1.7x the time of a static module at 7, Zen 4); at 8 it runs within
    :data:`PAD_WORK` of its own size, on a schedule carried over from the
    nearest tuned size (`search.transfer`)."""
    out = set(values)
    ordered = sorted(values)
    for low, high in zip(ordered, ordered[1:]):
        p = 1 << low.bit_length()  # the least power of two above `low`
        while high > 2 * low and p < high:
            out.add(p)
            p *= 2
    return tuple(sorted(out))


def sizes_to_tune(text: str, sizes: dict[Dim, tuple[int, ...]], func: str | None = None,
                  between: bool = True) -> tuple[str, list[tuple[str, dict[Dim, int]]], tuple[str, ...]]:
    """What ``tune --sizes`` tunes: the module with the dynamic function
    specialised at `sizes` (`graph.dynamic.specializations`) and, with
    `between`, also at the sizes a library of it specialises besides them
    (:func:`between_sizes`; where it has one symbol, paddable, and `sizes`
    names it), after them; its functions and their sizes; and the names
    of those of the sizes between, whose tasks are measured on carried
    schedules, not searched (`TuneConfig.carry`)."""
    extra: tuple[int, ...] = ()
    if between and len(sizes) == 1:
        with ir.Context(), ir.Location.unknown():
            module = ir.Module.parse(text)
            name = ir.StringAttr(dynamic_function(module, func).attributes["sym_name"]).value
            groups, padding = symbols_with_padding(module, name)
        ((dim, values),) = sizes.items()
        if len(groups) == 1 and padding[0]:
            extra = tuple(v for v in between_sizes(tuple(values)) if v not in values)
            sizes = {dim: tuple(values) + extra}
    sized, made = specializations(text, sizes, func=func)
    return sized, made, tuple(name for name, values in made if set(values.values()) & set(extra))


BLOCK_CALL_ROWS = 4
"""What one more call of a specialization costs the blocked path, in rows
of work: each call reads again the operands the blocked dimension does not
index (a GEMM's B, which a whole block of rows reuses), copies its block in
and out and starts its kernels. Measured on Zen 4 (1 thread, M x 1024 .
1024 x 1024 f32, default schedules): 16 rows in 0.404 ms, 64 in 1.31 ms,
256 in 5.37 ms: 20.5 us a row and about 0.08 ms, 4 rows, a call. It keeps
the blocked path from running many small blocks where one padded call
does (7 rows at 1, 16, 64: one call at 16, not seven at 1)."""


@dataclass(frozen=True)
class Blocks:
    """How the blocked path covers an extent: whole blocks of specialised
    sizes, largest first (``(size, count)``), then the `rest` rows run at
    `cover`, the smallest specialised size that holds them (padded, or
    exact when equal; 0 when nothing is left)."""

    blocks: tuple[tuple[int, int], ...]
    rest: int
    cover: int

    @property
    def rows(self) -> int:
        """The rows the specializations compute: the extent, with the padding."""
        return sum(t * q for t, q in self.blocks) + self.cover

    @property
    def calls(self) -> int:
        return sum(q for _, q in self.blocks) + (self.rest > 0)

    def label(self) -> str:
        parts = [f"{q} x {t}" for t, q in self.blocks]
        if self.rest:
            parts.append(f"{self.rest} exact" if self.rest == self.cover else f"{self.rest} padded to {self.cover}")
        return " + ".join(parts)


def _cover(rows: int, sizes: tuple[int, ...]) -> int:
    """The smallest of `sizes` that holds `rows` (0 for no rows, -1 for none)."""
    return 0 if rows == 0 else min((s for s in sizes if s >= rows), default=-1)


def plan_blocks(m: int, sizes: tuple[int, ...], call_rows: int = BLOCK_CALL_ROWS) -> Blocks:
    """How the blocked path runs an extent `m` of a paddable symbol on the
    specializations at `sizes` (the library's ``@<entry>__block`` computes
    the same choice in MLIR; :meth:`DynamicLibrary.dispatch_at` asks it).

    Each candidate is a smallest block size b among `sizes`: greedily as
    many whole blocks of each size >= b as fit, largest first, and the rest
    (fewer than b rows) at the smallest size that holds it. The one chosen
    costs least, counting the rows computed (padding included) plus
    `call_rows` per call; ties go to the larger b (fewer calls).

    Why not one block size, or the least padding alone: with one size T the
    rest pads to a size that may be far larger (333 rows at 256: 256 + 77
    padded to 256, 54% more work; greedily 256 + 64 + 13 padded to 16 is 1%
    more); and the least padding alone prefers the smallest blocks (100
    calls of a 1-row schedule, each reading all of a GEMM's weights, for
    100 rows). 100 rows at 16 and 64: 64 + 16 + 16 + 4 padded to 16 (112
    rows, 4 calls: 128) before 64 + 36 padded to 64 (128 rows, 2 calls:
    136); measured with other jobs on the machine, 1 thread, 1024 x 1024
    B: best of five 2.54 against 2.71 ms, medians 2.73 and 2.75 (within
    noise)."""
    best, best_cost = None, None
    for b in sorted(set(sizes), reverse=True):
        plan = _greedy(m, sizes, b)
        cost = plan.rows + call_rows * plan.calls
        if best_cost is None or cost < best_cost:
            best, best_cost = plan, cost
    return best


def _greedy(m: int, sizes: tuple[int, ...], smallest: int) -> Blocks:
    """`m` rows in whole blocks of each of `sizes` >= `smallest`, largest first, and the rest."""
    left, blocks = m, []
    for t in sorted(set(sizes), reverse=True):
        if t < smallest:
            break
        q = left // t
        left -= q * t
        if q:
            blocks.append((t, q))
    return Blocks(tuple(blocks), left, _cover(left, tuple(sizes)))


# --------------------------------------------------------------------------
# Which sizes the records hold.


def tuned_sizes(text: str, entry: str | None, db: str | os.PathLike | None, target: Target,
                limit: int = 64) -> dict[Dim, tuple[int, ...]]:
    """The sizes the records database `db` holds records for (this
    target): those at which some task of the function's specialization is
    a task of the database. Candidates are the extents of the database's
    tasks of the same families (`search.transfer.family_key`) as the
    function's tasks; each is checked by specializing at it. Returns
    ``{first dimension of each symbol: sizes}``, empty when there are none
    (or more than `limit` combinations to check)."""
    import itertools
    import re

    from mlir_ansor.ir.program import load as load_text
    from mlir_ansor.records import Database
    from mlir_ansor.search.tasks import tasks_for
    from mlir_ansor.search.transfer import family_key

    if db is None or not os.path.exists(db) or os.path.getsize(db) == 0:
        return {}
    groups = _groups(text, entry)

    def tasks_at(values: tuple[int, ...]):
        sized, _ = specializations(text, {g[0]: (v,) for g, v in zip(groups, values)}, func=entry, keep_name=True)
        return tasks_for(load_text(text=sized), target, func=entry)

    probe = tuple(_PROBES[k % len(_PROBES)] for k in range(len(groups)))
    families = {family_key(t.mlir) for t in tasks_at(probe)}
    with Database(db, readonly=True) as d:
        tuned = {w["workload_key"]: w for w in d.workloads()
                 if family_key(w["task_mlir"]) in families and d.count(w["workload_key"], target.key)}
    if not tuned:
        return {}
    numbers = sorted({int(n) for w in tuned.values() for n in re.findall(r"(\d+)x", w["task_mlir"]) if int(n) > 0})
    combos = list(itertools.product(numbers, repeat=len(groups)))
    if len(combos) > limit:
        log.info("compile: %d candidate sizes in the records: too many to check; none taken", len(combos))
        return {}
    found: list[tuple[int, ...]] = []
    for values in combos:
        try:
            if any(t.workload_key in tuned for t in tasks_at(values)):
                found.append(values)
        except AnsorError:
            continue
    return {g[0]: tuple(sorted({v[k] for v in found})) for k, g in enumerate(groups)} if found else {}


def dynamic_entry(source, func: str | None = None) -> str | None:
    """The name of the function of `source` (a path, or anything
    `importers.load` takes) with dynamic dimensions in its arguments
    (`func`, when given), or None when it has none."""
    from mlir_ansor.graph.dynamic import dynamic_dims
    from mlir_ansor.importers import load

    program = load(source.module if isinstance(source, Program) else source)
    with program.context:
        for op in program.module.body.operations:
            fn = op.operation
            if fn.name != "func.func" or not fn.regions[0].blocks:
                continue
            name = ir.StringAttr(fn.attributes["sym_name"]).value
            if (func is None or name == func) and dynamic_dims(fn):
                return name
    return None


def _groups(text: str, entry: str | None) -> list[list[Dim]]:
    with ir.Context():
        return symbols_with_padding(ir.Module.parse(text), entry)[0]


# --------------------------------------------------------------------------
# Building the module.


def _output_dims(text: str, entry: str, groups: list[list[Dim]]) -> list[tuple[int, ...]]:
    """Each output's extents: a static one as it is, a dynamic one as
    ``-1 - k`` for symbol k (the symbol it equals at the probe sizes)."""
    probe = [_PROBES[k % len(_PROBES)] for k in range(len(groups))]
    sized, _ = specializations(text, {g[0]: (v,) for g, v in zip(groups, probe)}, func=entry, keep_name=True)
    with ir.Context():
        dyn = ir.Module.parse(text)
        fn = dynamic_function(dyn, entry)
        declared = list(ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value).results)
        module = ir.Module.parse(sized)
        static = next(op.operation for op in module.body.operations if op.operation.name == "func.func"
                      and ir.StringAttr(op.operation.attributes["sym_name"]).value == entry)
        got = list(ir.FunctionType(ir.TypeAttr(static.attributes["function_type"]).value).results)
        out = []
        for r, (t, s) in enumerate(zip(declared, got)):
            if not isinstance(t, (ir.RankedTensorType, ir.MemRefType)):
                raise UnsupportedError(f"@{entry}: result {r} is a {t}, not a tensor")
            st, ss = ir.ShapedType(t), ir.ShapedType(s)
            dims = []
            for d in range(st.rank):
                if not st.is_dynamic_dim(d):
                    dims.append(st.get_dim_size(d))
                elif ss.get_dim_size(d) in probe:
                    dims.append(-1 - probe.index(ss.get_dim_size(d)))
                else:
                    raise UnsupportedError(f"@{entry}: result {r}'s dimension {d} is no dimension of the arguments "
                                           "(one library needs outputs whose sizes the arguments give)")
            out.append(tuple(dims))
    return out


_GENERIC_TILES = """
module attributes {transform.with_named_sequence} {
  transform.named_sequence @__transform_main(%root: !transform.any_op {transform.readonly}) {
    %mm = transform.structured.match ops{["linalg.matmul"]} in %root : (!transform.any_op) -> !transform.any_op
    %t, %l0, %l1, %l2 = transform.structured.tile_using_for %mm tile_sizes [8, 32, 1]
      : (!transform.any_op) -> (!transform.any_op, !transform.any_op, !transform.any_op, !transform.any_op)
    transform.structured.vectorize %t vector_sizes [8, 32, 1] : !transform.any_op
    %f = transform.structured.match ops{["func.func"]} in %root : (!transform.any_op) -> !transform.any_op
    transform.apply_patterns to %f {
      transform.apply_patterns.vector.lower_masked_transfers
      transform.apply_patterns.vector.transfer_permutation_patterns
      transform.apply_patterns.canonicalization
    } : !transform.any_op
    transform.yield
  }
}
"""
"""The generic path's one schedule: each ``linalg.matmul`` in tiles of 8 x
32 x 1, vectorized with masks where a tile runs past the extents (tiles
that need not divide): an outer product per step of the reduction."""


def _alone(text: str, entry: str, name: str) -> tuple[ir.Module, ir.Operation]:
    """A module (in the current context) of the dynamic function `entry` of
    `text` alone, renamed `name`; and the function."""
    module = ir.Module.parse(text)
    fn = dynamic_function(module, entry)
    for op in list(module.body.operations):
        if op.operation != fn:
            op.operation.erase()
    fn.attributes["sym_name"] = ir.StringAttr.get(name)
    return module, fn


def _generic_function(text: str, entry: str, name: str, tiles: bool = True) -> str:
    """The dynamic function alone, renamed `name`, bufferized on its dynamic
    shapes, its results turned into trailing arguments: a module's text.
    `tiles`: its matmuls tiled and vectorized first (:data:`_GENERIC_TILES`;
    left as they are where that fails)."""
    from mlir.dialects.transform import interpreter

    with ir.Context(), ir.Location.unknown():
        module, _ = _alone(text, entry, name)
        if tiles:
            tiled = ir.Module.parse(str(module))
            script = ir.Module.parse(_GENERIC_TILES)
            try:
                interpreter.apply_named_sequence(tiled, script.body.operations[0], script)
                tiled.operation.verify()
                module = tiled
            except ir.MLIRError as e:
                log.info("compile: @%s: the generic path's tiles do not apply (%s); plain loops", entry, e)
        passmanager.PassManager.parse(f"builtin.module({BUFFERIZE},{_OUT_PARAMS},canonicalize,cse)").run(module.operation)
        return str(module)


ROWS_PROBE = 1_000_003
"""The row count at which the ranged kernels' sketches are made: a prime
above the rows they run, so that the contraction rule writes its schedule
for a row loop its thread tiles need not divide (the remainder masked, as
on a dynamic extent), and a thread tile over all the rows stays one."""


def _linalg_ops(op: ir.Operation) -> list[ir.Operation]:
    """The Linalg operations in `op`, in order (not their bodies' ops)."""
    found: list[ir.Operation] = []

    def visit(inner: ir.Operation) -> ir.WalkResult:
        if inner.name.startswith("linalg.") and inner.name not in ("linalg.yield", "linalg.index"):
            found.append(inner)
        return ir.WalkResult.ADVANCE

    op.walk(visit, ir.WalkOrder.PRE_ORDER)
    return found


def _write_in_place(fn: ir.Operation) -> None:
    """Results computed in buffers of `fn`'s own and copied to its output
    arguments at the end (`buffer-results-to-out-params` hoists only
    static allocations) are computed in the output arguments themselves:
    the allocation and the copy go (the 333-row result of a GEMM is
    1.3 MiB)."""
    fn = fn.operation
    block = fn.regions[0].blocks[0]
    args = list(block.arguments)
    for op in list(block.operations):
        op = op.operation
        if op.name != "memref.copy":
            continue
        src, dst = op.operands
        made = getattr(src.owner, "operation", src.owner)  # an op's view, or a block
        if (not isinstance(made, ir.Operation) or made.name != "memref.alloc" or made.parent != fn
                or dst not in args or src.type != dst.type):
            continue
        op.erase()
        src.replace_all_uses_with(dst)
        made.erase()


def _ranged_functions(text: str, entry: str, dim: Dim, tuned: tuple[int, ...], *, db, target: Target,
                      threads: int) -> list[tuple[int, str, str]]:
    """Kernels on a dynamic row count, one per tuned size T: the function
    (one symbol, its rows; one task) scheduled with T's best record carried
    to a row loop of any extent (`search.transfer`: the sketch made at
    :data:`ROWS_PROBE` rows, whose thread tile over the rows spans them all
    where T's did, and whose last register tile of rows is masked), then
    bufferized on its dynamic shapes, its results trailing arguments.
    Returns ``(T, name, module text)``; none where the function is more
    than one task, its task's ops are not the function's own (rewritten
    by the task extraction), or a schedule does not apply."""
    from mlir.dialects.transform import interpreter

    from mlir_ansor.ir.attrs import FLOPS_ATTR
    from mlir_ansor.records import Database
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.rules import NO_PACKING
    from mlir_ansor.search.tasks import tasks_for
    from mlir_ansor.search.transfer import transferred

    def task_at(rows: int):
        sized, _ = specializations(text, {dim: (rows,)}, func=entry, keep_name=True)
        tasks = tasks_for(_load_text(sized), target, func=entry)
        return tasks[0] if len(tasks) == 1 else None

    if db is None or not os.path.exists(db):
        return []
    try:
        probe = task_at(ROWS_PROBE)
        sketches = generate_sketches(probe.mlir, target) if probe is not None else []
    except AnsorError as e:
        log.info("compile: @%s: no kernel on dynamic rows (%s)", entry, str(e).splitlines()[0])
        return []
    out = []
    with Database(db, readonly=True) as d:
        for size in tuned:
            task = task_at(size)
            carried = task and transferred(d, probe, sketches, target, threads=threads, relatives=1, per_relative=4,
                                           source_key=task.workload_key, defaults=False)
            if not carried:
                continue
            # On dynamic rows every thread tile of rows is of a dynamic size,
            # where the copy of B does not build (`Sketch.requires`): the
            # relative's best record that read B in place comes first, else
            # its best read in place (256 rows' best, copying B, ran 333
            # rows 2.07x as long in place: Emerald Rapids, 2 threads).
            t = next((c for c in carried if all(NO_PACKING.get(k, v) == v for k, v in c.knobs)), None)
            if t is None:
                t = dataclasses.replace(carried[0], knobs=tuple((k, NO_PACKING.get(k, v)) for k, v in carried[0].knobs))
            name = f"{entry}__rows_{size}"
            with ir.Context(), ir.Location.unknown():
                module, fn = _alone(text, entry, name)
                fn.attributes[FLOPS_ATTR] = ir.IntegerAttr.get(ir.IntegerType.get_signless(64), task.flops)
                payload = ir.Module.parse(t.sketch.payload)
                theirs = _linalg_ops(payload.operation)
                mine = _linalg_ops(fn)
                if [op.name for op in theirs] != [op.name for op in mine]:
                    log.info("compile: @%s: its task rewrites its ops; no kernel on dynamic rows", entry)
                    return []
                for a, b in zip(theirs, mine):
                    for key in a.attributes:
                        if key.startswith("ansor."):
                            b.attributes[key] = a.attributes[key]
                script = ir.Module.parse(t.sketch.concrete(t.knobs))
                try:
                    interpreter.apply_named_sequence(module.operation, script.body.operations[0], script)
                    passmanager.PassManager.parse(f"builtin.module({BUFFERIZE},{_OUT_PARAMS},canonicalize,cse)").run(
                        module.operation)
                    _write_in_place(dynamic_function(module, name))
                    module.operation.verify()
                except (ir.MLIRError, ValueError) as e:  # the interpreter's failures are ValueErrors
                    log.info("compile: @%s: the schedule of %d rows does not apply on dynamic rows (%s)", entry, size,
                             str(e).splitlines()[0])
                    continue
                out.append((size, name, str(module)))
    return out


def ranged_cases(sizes: list[tuple[int, str]]) -> list[Case]:
    """The rows of the dispatch table that the kernels on dynamic rows take
    (``(T, function)``): each the rows nearest its size T on a log scale,
    from 1 to :data:`ROWS_PROBE` (cut at the geometric means of neighbours)."""
    sizes = sorted(sizes)
    cases = []
    for k, (size, function) in enumerate(sizes):
        low = 1 if k == 0 else math.isqrt(sizes[k - 1][0] * size) + 1
        high = ROWS_PROBE if k == len(sizes) - 1 else math.isqrt(size * sizes[k + 1][0])
        if low <= high:
            cases.append(Case("ranged", function, (high,), (low,)))
    return cases


def _memref(t: ir.Type) -> ir.MemRefType:
    return ir.MemRefType(t)


def _shape_text(shape: list) -> str:
    return "x".join("?" if isinstance(d, str) else str(d) for d in shape)


def _strides(shape: list[int]) -> list[int]:
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= d
    return out[::-1]


def _zero(element: ir.Type) -> str:
    e = str(element)
    if e == "i1":
        return "false"
    return f"0 : {e}" if e.startswith(("i", "ui", "si")) or e == "index" else f"0.0 : {e}"


def _memcpy(t: str) -> bool:
    """Whether MLIR lowers a memref.copy to or from the memref type `t`
    (text) to a memcpy: an identity layout, or a static shape with
    contiguous row-major strides (any offset)."""
    mt = ir.MemRefType(ir.Type.parse(t))
    if isinstance(mt.layout, ir.AffineMapAttr):
        return mt.layout.value == ir.AffineMap.get_identity(mt.rank)
    return mt.has_static_shape and mt.get_strides_and_offset()[0] == _strides(list(mt.shape))


def _copy(w: _Writer, src: str, src_t: str, dst: str, dst_t: str, depth: int) -> None:
    """Copy memref `src` into `dst` (their types' texts): ``memref.copy``
    where it lowers to a memcpy (:func:`_memcpy`), else ``linalg.copy``,
    loops that LLVM vectorizes. Elsewhere a memref.copy calls the C
    runtime's ``memrefCopy``, which moves an element at a time: the 13 rows
    of a 1024-column f32 GEMM left over by the blocked path took 0.11 ms to
    copy in and out (0.215 ms for the 16-row kernel itself), and the 64
    rows after a 256-row block 1 ms (Emerald Rapids, 2 threads)."""
    if _memcpy(src_t) and _memcpy(dst_t):
        w.emit(f"memref.copy {src}, {dst} : {src_t} to {dst_t}", depth)
    else:
        w.emit(f"linalg.copy ins({src} : {src_t}) outs({dst} : {dst_t})", depth)


class _Writer:
    """Text of the dispatcher: fresh SSA names, index constants."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.n = 0
        self.consts: dict[int, str] = {}

    def fresh(self, stem: str) -> str:
        self.n += 1
        return f"%{stem}{self.n}"

    def index(self, v: int) -> str:
        if v not in self.consts:
            self.consts[v] = f"%c{v}" if v >= 0 else f"%cm{-v}"
        return self.consts[v]

    def emit(self, line: str, depth: int = 1) -> None:
        self.lines.append("  " * depth + line)

    def constants(self) -> list[str]:
        return [f"    {name} = arith.constant {v} : index" for v, name in sorted(self.consts.items())]


def _case_function(name: str, cases: list[Case], groups: list[list[Dim]]) -> str:
    """The text of ``@<entry>__case``: the first row of `cases` that takes
    the symbols' values, -1 for none (an ``arith.select`` chain, built from
    the last row up); the table is also written on it, as the
    ``ansor.dispatch`` attribute, for a reader."""
    n_symbols = len(groups)
    w = _Writer()
    args = ", ".join(f"%s{k}: index" for k in range(n_symbols))
    result = w.index(-1)
    for j in reversed(range(len(cases))):
        c = cases[j]
        conds = []
        for k, (lo, s) in enumerate(zip(c.low, c.sizes)):
            if lo == s:
                v = w.fresh("eq")
                w.emit(f"{v} = arith.cmpi eq, %s{k}, {w.index(s)} : index", 2)
                conds.append(v)
            else:
                a, b = w.fresh("ge"), w.fresh("le")
                w.emit(f"{a} = arith.cmpi sge, %s{k}, {w.index(lo)} : index", 2)
                w.emit(f"{b} = arith.cmpi sle, %s{k}, {w.index(s)} : index", 2)
                conds += [a, b]
        ok = conds[0]
        for c2 in conds[1:]:
            v = w.fresh("and")
            w.emit(f"{v} = arith.andi {ok}, {c2} : i1", 2)
            ok = v
        r = w.fresh("case")
        w.emit(f"{r} = arith.select {ok}, {w.index(j)}, {result} : index", 2)
        result = r
    table = ", ".join(json.dumps(f"{j}: {c.label(groups)}") for j, c in enumerate(cases))
    head = f"  func.func @{name}({args}) -> index attributes {{ansor.dispatch = [{table}]}} {{"
    return "\n".join([head, *w.constants(), *w.lines,
                      f"    return {result} : index", "  }"])


def _cover_function(name: str, sizes: tuple[int, ...]) -> str:
    """The text of ``@<entry>__cover(%r: index) -> index``: the smallest of
    `sizes` that holds `r` rows, 0 for none, -1 for more than the largest
    (:func:`_cover`)."""
    w = _Writer()
    result = w.index(-1)
    for s in sorted(sizes, reverse=True):
        ok, r = w.fresh("fits"), w.fresh("cover")
        w.emit(f"{ok} = arith.cmpi ule, %r, {w.index(s)} : index", 2)
        w.emit(f"{r} = arith.select {ok}, {w.index(s)}, {result} : index", 2)
        result = r
    none, r = w.fresh("none"), w.fresh("cover")
    w.emit(f"{none} = arith.cmpi eq, %r, {w.index(0)} : index", 2)
    w.emit(f"{r} = arith.select {none}, {w.index(0)}, {result} : index", 2)
    return "\n".join([f"  func.func @{name}(%r: index) -> index {{", *w.constants(), *w.lines,
                      f"    return {r} : index", "  }"])


def _block_function(name: str, cover: str, sizes: tuple[int, ...], call_rows: int) -> str:
    """The text of ``@<entry>__block(%m: index) -> index``: the smallest
    block size :func:`plan_blocks` chooses for `m` rows (each candidate's
    rows and calls computed in turn, largest candidate first, the cheapest
    kept)."""
    w = _Writer()
    order = sorted(set(sizes), reverse=True)
    best, best_cost = w.index(order[0]), None
    for b in order:
        left, rows, calls = "%m", w.index(0), w.index(0)
        for t in order:
            if t < b:
                break
            q, n, left2, rows2, calls2 = (w.fresh(x) for x in ("q", "n", "left", "rows", "calls"))
            w.emit(f"{q} = arith.divui {left}, {w.index(t)} : index", 2)
            w.emit(f"{n} = arith.muli {q}, {w.index(t)} : index", 2)
            w.emit(f"{left2} = arith.subi {left}, {n} : index", 2)
            w.emit(f"{rows2} = arith.addi {rows}, {n} : index", 2)
            w.emit(f"{calls2} = arith.addi {calls}, {q} : index", 2)
            left, rows, calls = left2, rows2, calls2
        cov, some, one, calls2, rows2, per, cost = (w.fresh(x) for x in ("cov", "some", "one", "calls", "rows", "per",
                                                                         "cost"))
        w.emit(f"{cov} = func.call @{cover}({left}) : (index) -> index", 2)
        w.emit(f"{some} = arith.cmpi ne, {left}, {w.index(0)} : index", 2)
        w.emit(f"{one} = arith.select {some}, {w.index(1)}, {w.index(0)} : index", 2)
        w.emit(f"{calls2} = arith.addi {calls}, {one} : index", 2)
        w.emit(f"{rows2} = arith.addi {rows}, {cov} : index", 2)
        w.emit(f"{per} = arith.muli {calls2}, {w.index(call_rows)} : index", 2)
        w.emit(f"{cost} = arith.addi {rows2}, {per} : index", 2)
        if best_cost is None:
            best_cost = cost
            continue
        less, b2, c2 = w.fresh("less"), w.fresh("best"), w.fresh("least")
        w.emit(f"{less} = arith.cmpi ult, {cost}, {best_cost} : index", 2)
        w.emit(f"{b2} = arith.select {less}, {w.index(b)}, {best} : index", 2)
        w.emit(f"{c2} = arith.select {less}, {cost}, {best_cost} : index", 2)
        best, best_cost = b2, c2
    return "\n".join([f"  func.func @{name}(%m: index) -> index {{", *w.constants(), *w.lines,
                      f"    return {best} : index", "  }"])


def _dispatcher(entry: str, case_fn: str, generic: str, arg_types: list[ir.Type], n_in: int,
                groups: list[list[Dim]], out_dims: list[tuple[int, ...]], cases: list[Case],
                spec_types: dict[str, list[ir.Type]], blocked: dict[int, str] | None = None,
                helpers: tuple[str, str] = ("", "")) -> str:
    """The text of the entry function (see the module docstring). `blocked`:
    the specializations of the one symbol by size, where the default runs
    the blocked path (:func:`_blocked`; `helpers`: the names of
    ``@<entry>__block`` and ``@<entry>__cover``), else the generic one."""
    w = _Writer()
    args = [f"%arg{i}" for i in range(len(arg_types))]
    types = [str(t) for t in arg_types]
    # Each argument dimension that is a symbol, and the output ones.
    of_symbol: dict[tuple[int, int], int] = {}
    for k, g in enumerate(groups):
        for i, d in g:
            of_symbol[(i, d)] = k
    for r, dims in enumerate(out_dims):
        for d, v in enumerate(dims):
            if v < 0:
                of_symbol[(n_in + r, d)] = -1 - v
    sym = [f"%s{k}" for k in range(len(groups))]
    for k, g in enumerate(groups):
        i, d = g[0]
        w.emit(f"{sym[k]} = memref.dim {args[i]}, {w.index(d)} : {types[i]}")
    for (i, d), k in of_symbol.items():
        if (i, d) == groups[k][0]:
            continue
        v, eq = w.fresh("d"), w.fresh("tied")
        w.emit(f"{v} = memref.dim {args[i]}, {w.index(d)} : {types[i]}")
        w.emit(f"{eq} = arith.cmpi eq, {v}, {sym[k]} : index")
        what = f"argument {i}" if i < n_in else f"output {i - n_in}"
        i0, d0 = groups[k][0]
        w.emit(f'cf.assert {eq}, "@{entry}: {what}\'s dimension {d} must equal argument {i0}\'s dimension {d0}"')
    case = w.fresh("case")
    w.emit(f"{case} = func.call @{case_fn}({', '.join(sym)}) : ({', '.join(['index'] * len(sym))}) -> index")
    w.emit(f"scf.index_switch {case}")
    for j, c in enumerate(cases):
        w.emit(f"case {j} {{")
        padded = {k for k, (lo, s) in enumerate(zip(c.low, c.sizes)) if lo != s}
        operands, copy_back = [], []
        for i, (a, t, st) in enumerate(zip(args, arg_types, spec_types[c.function])):
            mt, ms = _memref(t), _memref(st)
            if str(t) == str(st):
                operands.append(a)
                continue
            dims = [of_symbol.get((i, d)) for d in range(mt.rank)]
            if not any(k in padded for k in dims if k is not None):
                v = w.fresh("x")
                w.emit(f"{v} = memref.cast {a} : {t} to {st}", 2)
                operands.append(v)
                continue
            full = list(ms.shape)
            strides = _strides(full)
            elt = str(ms.element_type)
            buf = w.fresh("pad")
            w.emit(f"{buf} = memref.alloc() {{alignment = {ALIGNMENT} : i64}} : {st}", 2)
            # the extents of the argument itself: its symbols' values
            live = [sym[k] if k is not None else str(full[d]) for d, k in enumerate(dims)]
            live_shape = ["?" if k is not None else full[d] for d, k in enumerate(dims)]
            view_t = f"memref<{_shape_text(live_shape)}x{elt}, strided<{strides}>>"
            view = w.fresh("rows")
            w.emit(f"{view} = memref.subview {buf}[{', '.join(['0'] * len(full))}] [{', '.join(live)}] "
                   f"[{', '.join(['1'] * len(full))}] : {st} to {view_t}", 2)
            if not any(k in padded for k in dims[1:] if k is not None):
                # Padded only in the outermost dimension: the rows are one
                # block, and an identity layout makes the copies memcpy.
                flat, flat_t = w.fresh("block"), f"memref<{_shape_text(live_shape)}x{elt}>"
                w.emit(f"{flat} = memref.cast {view} : {view_t} to {flat_t}", 2)
                view, view_t = flat, flat_t
            if i < n_in:
                for d, k in enumerate(dims):
                    if k not in padded:
                        continue
                    n, tail = w.fresh("n"), w.fresh("tail")
                    w.emit(f"{n} = arith.subi {w.index(full[d])}, {sym[k]} : index", 2)
                    offsets = [sym[k] if e == d else "0" for e in range(len(full))]
                    sizes = [n if e == d else str(full[e]) for e in range(len(full))]
                    tail_shape = ["?" if e == d else full[e] for e in range(len(full))]
                    tail_t = f"memref<{_shape_text(tail_shape)}x{elt}, strided<{strides}, offset: ?>>"
                    w.emit(f"{tail} = memref.subview {buf}[{', '.join(offsets)}] [{', '.join(sizes)}] "
                           f"[{', '.join(['1'] * len(full))}] : {st} to {tail_t}", 2)
                    zero = w.fresh("zero")
                    w.emit(f"{zero} = arith.constant {_zero(ms.element_type)}", 2)
                    w.emit(f"linalg.fill ins({zero} : {elt}) outs({tail} : {tail_t})", 2)
                _copy(w, a, str(t), view, view_t, 2)
            else:
                copy_back.append((view, view_t, a, t))
            operands.append(buf)
        spec = ", ".join(str(x) for x in spec_types[c.function])
        w.emit(f"func.call @{c.function}({', '.join(operands)}) : ({spec}) -> ()", 2)
        for view, view_t, a, t in copy_back:
            _copy(w, view, view_t, a, str(t), 2)
        w.emit("scf.yield", 2)
        w.emit("}")
    w.emit("default {")
    if blocked:
        _blocked(w, args, arg_types, of_symbol, n_in, blocked, spec_types, *helpers)
    else:
        w.emit(f"func.call @{generic}({', '.join(args)}) : ({', '.join(types)}) -> ()", 2)
    w.emit("scf.yield", 2)
    w.emit("}")
    head = f"  func.func @{entry}({', '.join(f'{a}: {t}' for a, t in zip(args, types))}) {{"
    body = ["  " + line for line in w.lines]
    return "\n".join([head, *w.constants(), *body, "    return", "  }"])


def _run_rows(w: _Writer, args: list[str], arg_types: list[ir.Type], of_symbol: dict[tuple[int, int], int],
              n_in: int, function: str, types: list[ir.Type], start: str, rows: str | int, depth: int,
              buffers: dict[int, str] | None = None) -> None:
    """Emit a call of the specialization `function` (argument `types`) on
    rows ``[start, start + rows)`` of the one symbol: each argument that has
    the symbol as a dimension is copied into a buffer of the
    specialization's size (an input's rows past `rows` zeroed when `rows`
    is a value, not the whole size) and an output's rows are copied back
    after the call; the others are cast to the static types. `buffers`:
    those buffers, allocated before (:func:`_buffers`), else here."""
    operands, copy_back = [], []
    for i, (a, t, st) in enumerate(zip(args, arg_types, types)):
        mt, ms = _memref(t), _memref(st)
        dims = [d for d in range(mt.rank) if (i, d) in of_symbol]
        if not dims:
            if str(t) == str(st):
                operands.append(a)
            else:
                v = w.fresh("x")
                w.emit(f"{v} = memref.cast {a} : {t} to {st}", depth)
                operands.append(v)
            continue
        full, elt = list(ms.shape), str(ms.element_type)
        # The argument's own strides: static up to its first dynamic dimension.
        arg_strides, acc = [], 1
        for d in reversed(range(mt.rank)):
            arg_strides.append(acc if acc is not None else "?")
            acc = None if acc is None or mt.is_dynamic_dim(d) else acc * mt.get_dim_size(d)
        arg_strides = ", ".join(map(str, reversed(arg_strides)))
        static = isinstance(rows, int)
        live = [str(rows) if d in dims else str(full[d]) for d in range(len(full))]
        live_shape = [(rows if static else "?") if d in dims else full[d] for d in range(len(full))]
        offsets = [start if d in dims else "0" for d in range(len(full))]
        ones = ", ".join(["1"] * len(full))
        part, part_t = w.fresh("part"), f"memref<{_shape_text(live_shape)}x{elt}, strided<[{arg_strides}], offset: ?>>"
        w.emit(f"{part} = memref.subview {a}[{', '.join(offsets)}] [{', '.join(live)}] [{ones}] : {t} to {part_t}", depth)
        buf = (buffers or _buffers(w, [i], types, depth))[i]
        view, view_t = buf, str(st)
        if not static:
            strides = _strides(full)
            view, view_t = w.fresh("rows"), f"memref<{_shape_text(live_shape)}x{elt}, strided<{strides}>>"
            w.emit(f"{view} = memref.subview {buf}[{', '.join(['0'] * len(full))}] [{', '.join(live)}] [{ones}] "
                   f": {st} to {view_t}", depth)
            if dims == [0]:
                # the rows are one block: an identity layout makes the copies memcpy
                flat, flat_t = w.fresh("block"), f"memref<{_shape_text(live_shape)}x{elt}>"
                w.emit(f"{flat} = memref.cast {view} : {view_t} to {flat_t}", depth)
                view, view_t = flat, flat_t
            if i < n_in:
                for d in dims:
                    n, tail = w.fresh("n"), w.fresh("tail")
                    w.emit(f"{n} = arith.subi {w.index(full[d])}, {rows} : index", depth)
                    t_off = [rows if e == d else "0" for e in range(len(full))]
                    t_sizes = [n if e == d else str(full[e]) for e in range(len(full))]
                    tail_shape = ["?" if e == d else full[e] for e in range(len(full))]
                    tail_t = f"memref<{_shape_text(tail_shape)}x{elt}, strided<{strides}, offset: ?>>"
                    w.emit(f"{tail} = memref.subview {buf}[{', '.join(t_off)}] [{', '.join(t_sizes)}] [{ones}] "
                           f": {st} to {tail_t}", depth)
                    zero = w.fresh("zero")
                    w.emit(f"{zero} = arith.constant {_zero(ms.element_type)}", depth)
                    w.emit(f"linalg.fill ins({zero} : {elt}) outs({tail} : {tail_t})", depth)
        if i < n_in:
            _copy(w, part, part_t, view, view_t, depth)
        else:
            copy_back.append((view, view_t, part, part_t))
        operands.append(buf)
    w.emit(f"func.call @{function}({', '.join(operands)}) : ({', '.join(str(x) for x in types)}) -> ()", depth)
    for view, view_t, part, part_t in copy_back:
        _copy(w, view, view_t, part, part_t, depth)


def _buffers(w: _Writer, which: list[int], types: list[ir.Type], depth: int) -> dict[int, str]:
    """Allocate a buffer of each type of `types` at the indices `which`."""
    out = {}
    for i in which:
        out[i] = w.fresh("blk")
        w.emit(f"{out[i]} = memref.alloc() {{alignment = {ALIGNMENT} : i64}} : {types[i]}", depth)
    return out


def _blocked(w: _Writer, args: list[str], arg_types: list[ir.Type], of_symbol: dict[tuple[int, int], int],
             n_in: int, blocked: dict[int, str], spec_types: dict[str, list[ir.Type]], block: str,
             cover: str) -> None:
    """The blocked path, in the default case of the dispatch (one symbol,
    paddable): ``@<entry>__block`` gives the smallest block size b
    (:func:`plan_blocks`); then, for each specialised size T, largest
    first, an ``scf.for`` over the whole blocks of T rows that fit in what
    is left (none when T < b), each block copied in, run by ``@<entry>__T``
    and copied out; then the rest, fewer than b rows, runs at the size
    ``@<entry>__cover`` gives (an ``scf.index_switch`` on it: padded, or
    exact; nothing for no rows)."""
    m = "%s0"
    b = w.fresh("b")
    w.emit(f"{b} = func.call @{block}({m}) : (index) -> index", 2)
    start = w.index(0)
    for t in sorted(blocked, reverse=True):
        use, left, q, n, none, end = (w.fresh(x) for x in ("use", "left", "q", "n", "none", "end"))
        w.emit(f"{use} = arith.cmpi uge, {w.index(t)}, {b} : index", 2)
        w.emit(f"{left} = arith.subi {m}, {start} : index", 2)
        w.emit(f"{q} = arith.divui {left}, {w.index(t)} : index", 2)
        w.emit(f"{n} = arith.muli {q}, {w.index(t)} : index", 2)
        w.emit(f"{none} = arith.select {use}, {n}, {w.index(0)} : index", 2)
        w.emit(f"{end} = arith.addi {start}, {none} : index", 2)
        types = spec_types[blocked[t]]
        bufs = _buffers(w, [i for i in range(len(args)) if any(i == j for j, _ in of_symbol)], types, 2)
        row = w.fresh("row")
        w.emit(f"scf.for {row} = {start} to {end} step {w.index(t)} {{", 2)
        _run_rows(w, args, arg_types, of_symbol, n_in, blocked[t], types, row, t, 3, bufs)
        w.emit("}", 2)
        start = end
    rest, size = w.fresh("rest"), w.fresh("size")
    w.emit(f"{rest} = arith.subi {m}, {start} : index", 2)
    w.emit(f"{size} = func.call @{cover}({rest}) : (index) -> index", 2)
    w.emit(f"scf.index_switch {size}", 2)
    for t in sorted(blocked):
        w.emit(f"case {t} {{", 2)
        _run_rows(w, args, arg_types, of_symbol, n_in, blocked[t], spec_types[blocked[t]], start, rest, 3)
        w.emit("scf.yield", 3)
        w.emit("}", 2)
    w.emit("default {", 2)
    w.emit("scf.yield", 3)
    w.emit("}", 2)


@dataclass
class _Built:
    mlir: str
    functions: list[str]
    inputs: list[tuple[tuple[int, ...], str]]
    outputs: list[tuple[tuple[int, ...], str]]
    groups: list[list[Dim]]
    cases: list[Case]
    kernels: list
    blocks: tuple[int, ...] = ()


def _build_module(program: Program, entry: str | None, sizes: dict[Dim, tuple[int, ...]], *, db, threads: int,
                  target: Target, default: str, pad: bool, pad_work: float, tiles: bool = True,
                  call_rows: int = BLOCK_CALL_ROWS, between: bool = False, ranged: bool = False) -> tuple[str, _Built]:
    """The entry's name and the module of the module docstring (on
    memrefs, before LLVM), with what the library's caller needs to know.
    The default case is the blocked path where the function has one
    symbol, paddable (and `pad`), and some specialization; else generic.
    `between`: that symbol is also specialised at :func:`between_sizes`.
    `ranged`: there, the rows no specialization takes run on kernels on
    dynamic rows carried from the records (:func:`_ranged_functions`)
    where the function allows them, instead of the blocked path."""
    with program.context:
        text = str(program.module)
        fn = dynamic_function(program.module, entry)
        name = ir.StringAttr(fn.attributes["sym_name"]).value
        if any(isinstance(a.type, ir.MemRefType) for a in fn.regions[0].blocks[0].arguments):
            raise UnsupportedError(f"@{name}: one library with a dispatch takes functions on tensors "
                                   "(this one has memref arguments)")
        groups, padding = symbols_with_padding(program.module, name)
        ftype = ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value)
        inputs = [(tuple(-1 if ir.ShapedType(t).is_dynamic_dim(d) else ir.ShapedType(t).get_dim_size(d)
                         for d in range(ir.ShapedType(t).rank)), str(ir.ShapedType(t).element_type))
                  for t in ftype.inputs]
        n_in = len(inputs)
    out_dims = _output_dims(text, name, groups)
    tuned = dict(sizes)
    if between and pad and len(groups) == 1 and padding[0] and len(sizes) == 1:
        ((dim, values),) = sizes.items()
        sizes = {dim: between_sizes(values)}
    with program.context:
        results = list(ftype.results)
        outputs = [(dims, str(ir.ShapedType(t).element_type)) for dims, t in zip(out_dims, results)]
    generic = f"{name}__generic"
    case_fn = f"{name}__case"
    if sizes:
        sized, made = specializations(text, sizes, func=name)
        scheduled = compiler.schedule_module(_load_text(sized), db=db, threads=threads, target=target, default=default)
        spec_text, kernels = scheduled.mlir, scheduled.kernels
    else:
        made, spec_text, kernels = [], "module {}", []
    cases = plan_cases(groups, padding if pad else [False] * len(groups), made, pad_work)
    blocked = {values[groups[0][0]]: n for n, values in made} if pad and len(groups) == 1 and padding[0] else {}
    rows = []
    if ranged and blocked and len(tuned) == 1:
        ((dim, values),) = tuned.items()
        rows = _ranged_functions(text, name, dim, values, db=db, target=target, threads=threads)
        if rows:
            cases = cases + ranged_cases([(size, fn) for size, fn, _ in rows])
            blocked = {}
    helpers = (f"{name}__block", f"{name}__cover")
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(spec_text)
        passmanager.PassManager.parse(f"builtin.module({_OUT_PARAMS})").run(module.operation)
        _move_in(module, _generic_function(text, name, generic, tiles))
        for _, _, ranged_text in rows:
            _move_in(module, ranged_text)
        funcs = {ir.StringAttr(op.operation.attributes["sym_name"]).value: op.operation
                 for op in module.body.operations if op.operation.name == "func.func"}
        arg_types = list(ir.FunctionType(ir.TypeAttr(funcs[generic].attributes["function_type"]).value).inputs)
        spec_types = {c.function: list(ir.FunctionType(ir.TypeAttr(funcs[c.function].attributes["function_type"]).value).inputs)
                      for c in cases}
        callees = [generic] + sorted({c.function for c in cases})
        decls = [f"  func.func private @{f}({', '.join(str(t) for t in (arg_types if f == generic else spec_types[f]))})"
                 for f in callees]
        extra = [_cover_function(helpers[1], tuple(blocked)),
                 _block_function(helpers[0], helpers[1], tuple(blocked), call_rows)] if blocked else []
        text_out = "\n".join(["module {", *decls, _case_function(case_fn, cases, groups), *extra, _dispatcher(
            name, case_fn, generic, arg_types, n_in, groups, out_dims, cases, spec_types, blocked, helpers), "}", ""])
        try:
            _move_in(module, text_out)
            module.operation.verify()
        except ir.MLIRError as e:
            raise AnsorError(f"@{name}: the dispatching module does not verify: {e}") from None
        mlir = str(module)
    functions = [name, case_fn, generic] + (list(helpers) if blocked else []) + [n for n, _ in made] + [fn for _, fn, _ in rows]
    return name, _Built(mlir, functions, inputs, outputs, groups, cases, kernels, tuple(sorted(blocked)))


def _load_text(text: str) -> Program:
    from mlir_ansor.ir.program import load as load_text

    return load_text(text=text, name="<specializations>")


def _move_in(module: ir.Module, text: str) -> None:
    """Parse `text` in `module`'s context and move its top-level ops to the
    end of `module`, except the declarations of functions `module` defines
    (they let `text` parse on its own)."""
    other = ir.Module.parse(text)
    defined = {ir.StringAttr(op.operation.attributes["sym_name"]).value for op in module.body.operations
               if op.operation.name == "func.func"}
    for op in list(other.body.operations):
        op = op.operation
        if op.name == "func.func" and not op.regions[0].blocks and \
                ir.StringAttr(op.attributes["sym_name"]).value in defined:
            continue
        ir.InsertionPoint(module.body).insert(op.detach_from_parent())


# --------------------------------------------------------------------------
# The library.


PLANS_KEPT = 256
"""Call set-ups a `DynamicLibrary` keeps, one per distinct argument shapes."""


@dataclass
class DynamicLibrary:
    """A compiled library whose entry function takes any extents of its
    dynamic dimensions and dispatches among specialised schedules in MLIR
    (see the module docstring). Call it on numpy arrays; the outputs are
    allocated from the symbols' values.

    `save` writes the library and a side file ``<path>.json`` (entry,
    symbols, input and output types, the dispatch table); `load` reads
    them back. Not reentrant (the specializations' drivers keep their
    intermediates in static buffers)."""

    library_path: str
    entry: str
    symbols: list[list[Dim]]
    """The dynamic dimensions of the arguments, one list per symbol (`graph.dynamic.symbols`)."""
    inputs: list[tuple[tuple[int, ...], str]]
    """Each argument's shape (-1: dynamic) and element type."""
    outputs: list[tuple[tuple[int, ...], str]]
    """Each output's shape (``-1 - k``: symbol k's value) and element type."""
    cases: list[Case]
    mlir: str = ""
    """The module compiled (on memrefs, before LLVM): specializations, generic function, dispatcher."""
    kernels: list = field(default_factory=list)
    """The specializations' `compiler.KernelPlan`s (empty for a loaded library)."""
    threads: int = 1
    blocks: tuple[int, ...] = ()
    """The sizes the blocked path runs in (the default case; empty: the generic path is)."""
    _lib: object = field(default=None, repr=False)
    _plans: dict = field(default_factory=dict, repr=False)

    def _library(self):
        """(the entry as a `runner.Kernel`, ``@<entry>__case``, ``@<entry>__block`` or None)."""
        if self._lib is None:
            kernel = Kernel(self.library_path, self.entry)
            lib = kernel.lib
            case = getattr(lib, f"{self.entry}__case")
            case.restype = ctypes.c_int64
            case.argtypes = [ctypes.c_int64] * len(self.symbols)
            block = None
            if self.blocks:
                block = getattr(lib, f"{self.entry}__block")
                block.restype = ctypes.c_int64
                block.argtypes = [ctypes.c_int64]
            self._lib = (kernel, case, block)
        return self._lib

    def _values(self, arrays) -> dict[Dim, int]:
        if len(arrays) != len(self.inputs):
            raise InputError(f"@{self.entry} takes {len(self.inputs)} argument(s), got {len(arrays)}")
        shapes = [tuple(np.shape(a)) for a in arrays]
        for i, (shape, (want, _)) in enumerate(zip(shapes, self.inputs)):
            if len(shape) != len(want) or any(w >= 0 and s != w for s, w in zip(shape, want)):
                shown = "x".join("?" if w < 0 else str(w) for w in want)
                raise InputError(f"@{self.entry}: argument {i} has shape {shape}, expected {shown}")
        return extents(self.symbols, shapes, self.entry)

    def dispatch_at(self, values: dict[Dim, int] | tuple[int, ...]) -> dict:
        """Which path runs the symbols' `values` (one per symbol, in order,
        or by dimension), as the library's own ``@<entry>__case`` decides:
        ``{"path": "exact" | "padded" | "ranged" | "blocked" | "generic",
        "function": ..., "sizes": {dimension: size it runs at}}``. A ranged
        one (a kernel on dynamic rows) runs at the sizes themselves and has a
        "label" (``"0.0=100: on dynamic rows, gemm__rows_64"``). A blocked one also
        has "blocks", the :class:`Blocks` (``@<entry>__block``'s choice),
        "sizes" the largest size it calls, and "label" (``"0.0=100: 1 x 64
        + 36 padded to 64"``)."""
        if isinstance(values, dict):
            values = tuple(values[g[0]] for g in self.symbols)
        lib = self._library()
        row = int(lib[1](*values))
        firsts = [g[0] for g in self.symbols]
        if row < 0 and self.blocks:
            (m,) = values
            plan = _greedy(m, self.blocks, int(lib[2](m)))
            top = plan.blocks[0][0] if plan.blocks else plan.cover
            function = next(c.function for c in self.cases if c.kind == "exact" and c.sizes == (top,))
            return {"path": "blocked", "function": function,
                    "sizes": {firsts[0]: top}, "blocks": plan,
                    "label": f"{firsts[0][0]}.{firsts[0][1]}={m}: {plan.label()}"}
        if row < 0:
            return {"path": "generic", "function": f"{self.entry}__generic", "sizes": dict(zip(firsts, values))}
        c = self.cases[row]
        if c.kind == "ranged":  # runs at its own sizes
            return {"path": "ranged", "function": c.function, "sizes": dict(zip(firsts, values)),
                    "label": f"{firsts[0][0]}.{firsts[0][1]}={values[0]}: on dynamic rows, {c.function}"}
        return {"path": c.kind, "function": c.function, "sizes": dict(zip(firsts, c.sizes))}

    def dispatch(self, *arrays: np.ndarray) -> dict:
        """:meth:`dispatch_at` the sizes of `arrays` (checked as a call checks them)."""
        values = self._values(arrays)
        return self.dispatch_at(tuple(values[g[0]] for g in self.symbols))

    def _plan(self, arrays) -> compiler.CallPlan:
        """The call at the shapes of `arrays`, set up on first use of those
        shapes (checked then, as `dispatch` checks them): descriptors and a
        straight-line call (`compiler.CallPlan`), a few microseconds a call
        where making them per call cost about 20."""
        shapes = argument_shapes(arrays)
        plan = self._plans.get(shapes)
        if plan is None:
            values = self._values(arrays)
            sym = [values[g[0]] for g in self.symbols]
            ins = [(shape, dtype) for shape, (_, dtype) in zip(shapes, self.inputs)]
            outs = [(tuple(d if d >= 0 else sym[-1 - d] for d in dims), dtype) for dims, dtype in self.outputs]
            plan = compiler.CallPlan(self._library()[0], ins, outs, (), name=self.entry)
            if len(self._plans) >= PLANS_KEPT:
                del self._plans[next(iter(self._plans))]  # the oldest shapes
            self._plans[shapes] = plan
        return plan

    def __call__(self, *arrays: np.ndarray):
        return self._plan(arrays).call(*arrays)

    def to_json(self) -> dict:
        return {
            "entry": self.entry,
            "symbols": [[list(d) for d in g] for g in self.symbols],
            "inputs": [{"shape": list(s), "dtype": t} for s, t in self.inputs],
            "outputs": [{"shape": list(s), "dtype": t} for s, t in self.outputs],
            "cases": [c.to_json() for c in self.cases],
            "dispatch": [c.label(self.symbols) for c in self.cases]
            + [f"else blocked in {', '.join(map(str, self.blocks))}" if self.blocks else "else generic"],
            "threads": self.threads,
            "blocks": list(self.blocks),
        }

    def save(self, path: str | os.PathLike) -> str:
        """Copy the library to `path` and write its side file ``<path>.json``; returns the side file's path."""
        path = os.fspath(path)
        shutil.copyfile(self.library_path, path)
        side = path + ".json"
        with open(side, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f)
            f.write("\n")
        return side

    @classmethod
    def load(cls, path: str | os.PathLike) -> DynamicLibrary:
        """A library :meth:`save` wrote (its side file beside it)."""
        path = os.fspath(path)
        try:
            with open(path + ".json", encoding="utf-8") as f:
                meta = json.load(f)
        except OSError as e:
            raise InputError(f"{path}.json: cannot read the library's side file: {e.strerror or e}") from None
        if not os.path.isfile(path):
            raise InputError(f"{path}: no such library")
        return cls(
            library_path=os.path.abspath(path),
            entry=meta["entry"],
            symbols=[[tuple(d) for d in g] for g in meta["symbols"]],
            inputs=[(tuple(x["shape"]), x["dtype"]) for x in meta["inputs"]],
            outputs=[(tuple(x["shape"]), x["dtype"]) for x in meta["outputs"]],
            cases=[Case(c["kind"], c["function"], tuple(c["sizes"]), tuple(c["low"])) for c in meta["cases"]],
            threads=meta.get("threads", 1),
            blocks=tuple(meta.get("blocks", ())),
        )

    def close(self) -> None:
        self._plans.clear()
        self._lib = None


def build_library(
    source,
    *,
    sizes: dict[Dim, tuple[int, ...]] | None = None,
    db: str | os.PathLike | None = None,
    threads: int = 1,
    target: Target | None = None,
    default: str = "sketch",
    entry: str | None = None,
    pad: bool = True,
    pad_work: float = PAD_WORK,
    opt_level: int = 3,
    cache_dir: str | os.PathLike | bool | None = None,
    between: bool | None = None,
    ranged: bool | None = None,
) -> DynamicLibrary:
    """Compile a function with dynamic dimensions into one library that
    dispatches among static specializations at run time (the module
    docstring says what it holds).

    `source`: as `compiler.compile`'s. `sizes`: the sizes to specialise,
    ``{(arg, dim): (v1, v2, ...)}`` as `graph.dynamic.parse_sizes` gives
    them (every combination is one specialization); None: the sizes
    `db` holds records for (:func:`tuned_sizes`); none there, or ``{}``:
    only the generic path. `pad`: run extents up to `pad_work` times
    smaller than a specialised size at that size, padded, where the
    function allows it. `between`: where the function has one dynamic
    dimension, paddable, also specialise it at the powers of two between
    sizes more than twice apart (:func:`between_sizes`); None (default):
    when the sizes are those of the records. `ranged`: there, the rows no
    specialization takes run on kernels on dynamic rows, one per tuned size
    (its record carried to a row loop of any extent: :func:`ranged_cases`
    says which rows each takes), where the function is one task whose ops
    are its own, instead of in blocks of specialised sizes; None (default):
    with `between`. The other arguments are `compiler.compile`'s."""
    from mlir_ansor.importers import load
    from mlir_ansor.passes.compile_cache import cache_for

    target = target or Target.host()
    if target.kind != "cpu":
        raise UnsupportedError("one library with a dispatch is built for CPU targets only")
    program = load(source.module if isinstance(source, Program) else source)
    with program.context:
        text = str(program.module)
    if between is None:
        between = sizes is None
    if ranged is None:
        ranged = between
    if sizes is None:
        sizes = tuned_sizes(text, entry, db, target)
        log.info("compile: specialised sizes from the records: %s",
                 "; ".join(f"{i}.{d}={','.join(map(str, v))}" for (i, d), v in sizes.items()) or "none")
    options = dict(db=db, threads=threads, target=target, default=default, pad=pad, pad_work=pad_work, between=between,
                   ranged=ranged)
    name, built = _build_module(program, entry, sizes, **options)
    workdir = tempfile.mkdtemp(prefix="mlir-ansor-dispatch-")
    so_path = os.path.join(workdir, "module.so")
    cache = cache_for(cache_dir, db)
    try:
        # `compiler`'s lowering and linking of a scheduled module (the same
        # units, workers and object cache a static compile uses; a private
        # name, until compiler.py gives it a public one).
        try:
            compiler.lower_and_link(built.mlir, dict.fromkeys(built.functions), threads, so_path, opt_level, cache)
        except AnsorError as e:
            log.warning("compile: @%s with the generic path's tiles or the kernels on dynamic rows failed to "
                        "build (%s); again with plain loops there and blocks", name, str(e).splitlines()[0])
            name, built = _build_module(program, entry, sizes, **{**options, "ranged": False}, tiles=False)
            compiler.lower_and_link(built.mlir, dict.fromkeys(built.functions), threads, so_path, opt_level, cache)
    except BaseException:
        shutil.rmtree(workdir, ignore_errors=True)
        raise
    lib = DynamicLibrary(so_path, name, built.groups, built.inputs, built.outputs, built.cases, built.mlir,
                         built.kernels, threads, built.blocks)
    weakref.finalize(lib, shutil.rmtree, workdir, True)
    log.info("compile: @%s dispatches %s; else %s", name, "; ".join(c.label(built.groups) for c in built.cases) or "nothing",
             f"blocked in {', '.join(map(str, built.blocks))}" if built.blocks else "generic")
    return lib
