"""Dynamic dimensions: which extents of a function's arguments are dynamic,
which of them are one symbol, and static specializations of the function.

A dimension is named by argument and dimension, 0-based: ``0.0`` is
argument 0's dimension 0 (the command line's ``--sizes 0.0=1,16,64``).
Dimensions that the function's Linalg ops tie together (a matmul's A rows
and C rows: both are its loop d0) are one symbol, :func:`symbols` finds
them, and a size given for one is the size of all. So are those the
function's ``ansor.same_dims`` attribute names (``["1.1=2.1"]``), which
its ops need not tie: a KV cache's keys and values, whose lengths
torch-mlir's gathers read without a check, and which the PyTorch importer
marks where ``torch.export`` gave them one symbol.

:func:`specialize` makes a function static: each dynamic argument gets its
static type, a ``tensor.cast`` (``memref.cast``) back to the dynamic type
stands where the argument was used, and MLIR's canonicalization folds the
casts into the ops (`linalg`'s cast folding, ``tensor.dim`` of a static
value, ``tensor.empty`` with constant sizes), so that every op sees static
shapes; the results' types follow. The tasks, the schedules and the records
of a specialization are those of any static module: tuning a list of sizes
is tuning a module with one specialization per size
(:func:`specializations`), and running a size compiles its specialization.
"""

from __future__ import annotations

import itertools
import math
import re

import numpy as np
from mlir import ir, passmanager

from mlir_ansor.errors import InputError, UnsupportedError
from mlir_ansor.ir.attrs import DIM_RANGES_ATTR, SAME_DIMS_ATTR
from mlir_ansor.ir.program import first_diagnostic
from mlir_ansor.ir.rewrite import cast_source, concat, walk_op

__all__ = ["Dim", "argument_shapes", "dim_ranges", "dynamic_dims", "dynamic_function", "expand", "extents", "paddable", "parse_sizes", "size_label", "specializations",
           "specialize", "spread", "symbols", "symbols_with_padding"]

Dim = tuple[int, int]
"""(argument, dimension), both 0-based."""

_SIZE = re.compile(r"^(\d+)\.(\d+)=(\d+(?:,\d+)*|\.\.\d+)$")


def spread(bound: int) -> tuple[int, ...]:
    """The sizes ``ARG.DIM=..N`` stands for: the powers of 4 below `bound`,
    and `bound` (``..1024``: 1, 4, 16, 64, 256, 1024; ``..384``: 1, 4, 16,
    64, 256, 384). Every size up to the bound is then within 4x of a tuned
    one, and the library built from the records (`dispatch.build_library`)
    specialises the powers of two between them on schedules carried from
    the nearest (`dispatch.between_sizes`)."""
    out = []
    p = 1
    while p < bound:
        out.append(p)
        p *= 4
    return (*out, bound)


def parse_sizes(specs: list[str] | str) -> dict[Dim, tuple[int, ...]]:
    """``["0.0=1,16,64", "1.1=8"]`` (or one string with ``;`` between
    them) -> ``{(0, 0): (1, 16, 64), (1, 1): (8,)}``; ``0.0=..N`` is a
    spread of sizes up to the bound N (:func:`spread`)."""
    items = specs.split(";") if isinstance(specs, str) else [s for spec in specs for s in spec.split(";")]
    out: dict[Dim, tuple[int, ...]] = {}
    for item in (s.strip() for s in items):
        if not item:
            continue
        m = _SIZE.match(item)
        if not m:
            raise InputError(f"--sizes {item!r}: expected ARG.DIM=V1,V2,... (for example 0.0=1,16,64) "
                             "or ARG.DIM=..N (a spread of sizes up to N)")
        given = m.group(3)
        values = spread(int(given[2:])) if given.startswith("..") else tuple(int(v) for v in given.split(","))
        if any(v < 1 for v in values):  # ..0 spreads to (0,)
            raise InputError(f"--sizes {item!r}: sizes must be at least 1")
        out[(int(m.group(1)), int(m.group(2)))] = values
    if not out:
        raise InputError("--sizes: no size given")
    return out


def dynamic_function(module: ir.Module, name: str | None) -> ir.Operation:
    funcs = [op.operation for op in module.body.operations
             if op.operation.name == "func.func" and op.operation.regions[0].blocks]
    if name is not None:
        funcs = [f for f in funcs if ir.StringAttr(f.attributes["sym_name"]).value == name]
        if not funcs:
            raise InputError(f"no function @{name} with a body in the module")
    dynamic = [f for f in funcs if dynamic_dims(f)]
    if not dynamic:
        raise InputError("the module has no function with dynamic dimensions in its arguments"
                         if name is None else f"@{name} has no dynamic dimension in its arguments")
    if name is None and len(dynamic) > 1:
        names = ", ".join("@" + ir.StringAttr(f.attributes["sym_name"]).value for f in dynamic)
        raise InputError(f"several functions have dynamic dimensions ({names}): name one with --func")
    return dynamic[0]


def _shaped(t: ir.Type) -> ir.ShapedType | None:
    return ir.ShapedType(t) if isinstance(t, (ir.RankedTensorType, ir.MemRefType)) else None


def dynamic_dims(fn: ir.Operation) -> list[Dim]:
    """The dynamic (argument, dimension) pairs of `fn`'s arguments."""
    out = []
    for i, arg in enumerate(fn.regions[0].blocks[0].arguments):
        st = _shaped(arg.type)
        if st is not None:
            out += [(i, d) for d in range(st.rank) if st.is_dynamic_dim(d)]
    return out


def _strings(fn: ir.Operation, attr: str, like: str) -> list[str]:
    """The strings of `fn`'s array attribute `attr`; an :class:`InputError`
    where it is something else (`like`: an entry, for the message)."""
    try:
        return [ir.StringAttr(a).value for a in ir.ArrayAttr(fn.attributes[attr])]
    except (TypeError, ValueError) as err:
        name = ir.StringAttr(fn.attributes["sym_name"]).value
        raise InputError(f"@{name}: {attr} must be an array of strings like \"{like}\"") from err


def _same_dims(fn: ir.Operation) -> list[list[Dim]]:
    """The groups of argument dimensions the function's ``ansor.same_dims``
    attribute states are one size (`ir.attrs.SAME_DIMS_ATTR`), checked:
    each must name a dynamic dimension of an argument."""
    if SAME_DIMS_ATTR not in fn.attributes:
        return []
    name = ir.StringAttr(fn.attributes["sym_name"]).value
    dynamic = set(dynamic_dims(fn))
    groups = []
    for item in _strings(fn, SAME_DIMS_ATTR, "1.1=2.1"):
        try:
            group = [tuple(int(x) for x in part.split(".")) for part in item.split("=")]
        except ValueError:
            group = []
        if len(group) < 2 or any(len(g) != 2 for g in group):
            raise InputError(f"@{name}: {SAME_DIMS_ATTR} entry {item!r} is not like \"1.1=2.1\"")
        wrong = [f"{a}.{d}" for a, d in group if (a, d) not in dynamic]
        if wrong:
            raise InputError(f"@{name}: {SAME_DIMS_ATTR} names {', '.join(wrong)}, not a dynamic dimension of an argument")
        groups.append(group)
    return groups


def dim_ranges(fn: ir.Operation) -> dict[Dim, tuple[int, int | None]]:
    """The sizes the function's ``ansor.dim_ranges`` attribute allows each
    dynamic argument dimension (`ir.attrs.DIM_RANGES_ATTR`; None: no upper
    bound); empty without one."""
    if DIM_RANGES_ATTR not in fn.attributes:
        return {}
    name = ir.StringAttr(fn.attributes["sym_name"]).value
    out: dict[Dim, tuple[int, int | None]] = {}
    for item in _strings(fn, DIM_RANGES_ATTR, "0.1=2..128"):
        m = re.fullmatch(r"(\d+)\.(\d+)=(\d+)\.\.(\d*)", item)
        if m is None:
            raise InputError(f"@{name}: {DIM_RANGES_ATTR} entry {item!r} is not like \"0.1=2..128\"")
        out[(int(m[1]), int(m[2]))] = (int(m[3]), int(m[4]) if m[4] else None)
    return out


def _check_ranges(fn: ir.Operation, name: str, values: dict[Dim, int]) -> None:
    """An :class:`InputError` for a size outside its dimension's range (:func:`dim_ranges`)."""
    for dim, (lo, hi) in dim_ranges(fn).items():
        v = values.get(dim)
        if v is not None and (v < lo or (hi is not None and v > hi)):
            raise InputError(f"@{name}: dimension {dim[0]}.{dim[1]} is {v}, outside {lo}..{'' if hi is None else hi}, "
                             "the sizes the function allows (its ansor.dim_ranges: torch.export's Dim)")


def _ties(module: ir.Module, func: str | None):
    """Walk a generalized copy of the dynamic function: the union-find of the
    (value, dimension) pairs its Linalg ops tie together (each loop of a
    ``linalg.generic`` ties the operand dimensions its indexing maps give
    that loop, and each result is its init's shape); the pairs a reduction
    runs over or an expression other than a loop index reads (a window);
    and the ops other than those of :data:`_PADDABLE_OPS`. Returns
    (the module holding the copy, which must outlive the rest; the copy,
    find, blocked pairs, other ops)."""
    fn = dynamic_function(module, func)
    holder = ir.Module.create(ir.Location.unknown(module.context))
    copy = fn.clone()  # detached, then generalized in a module of its own
    holder.body.append(copy)
    args = copy.regions[0].blocks[0].arguments
    passmanager.PassManager.parse("builtin.module(func.func(linalg-generalize-named-ops))").run(holder.operation)
    parent: dict = {}

    def find(x):
        parent.setdefault(x, x)
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(a, b):
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[ra] = rb

    for group in _same_dims(fn):
        for a, d in group[1:]:
            union((args[a], d), (args[group[0][0]], group[0][1]))
    blocked: list = []
    other_ops: list[str] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "func.func":
            return ir.WalkResult.ADVANCE
        if op.name not in _PADDABLE_OPS and not (op.name.startswith("arith.") and all(
                isinstance(r.type, ir.IndexType) for r in op.results)):
            other_ops.append(op.name)
            return ir.WalkResult.SKIP
        if op.name != "linalg.generic":
            return ir.WalkResult.SKIP
        maps = [ir.AffineMapAttr(m).value for m in ir.ArrayAttr(op.attributes["indexing_maps"])]
        kinds = [str(a) for a in ir.ArrayAttr(op.attributes["iterator_types"])]
        loops: dict[int, list] = {}
        for v, amap in zip(op.operands, maps):
            for k, expr in enumerate(amap.results):
                if isinstance(expr, ir.AffineDimExpr):
                    loops.setdefault(ir.AffineDimExpr(expr).position, []).append((v, k))
                elif not isinstance(expr, ir.AffineConstantExpr):
                    blocked.append((v, k))
        for pos, members in loops.items():
            for m in members[1:]:
                union(members[0], m)
            if "reduction" in kinds[pos]:
                blocked.append(members[0])
        n_results = len(op.results)
        for r, init in zip(op.results, list(op.operands)[len(op.operands) - n_results:]):
            st = _shaped(r.type)
            for k in range(st.rank if st else 0):
                union((r, k), (init, k))
        return ir.WalkResult.SKIP

    copy.operation.walk(visit, ir.WalkOrder.PRE_ORDER)
    return holder, copy.operation, find, blocked, other_ops


def symbols(module: ir.Module, func: str | None = None) -> list[list[Dim]]:
    """The dynamic dimensions of the function's arguments, grouped into the
    symbols that its Linalg ops tie together (each loop of a
    ``linalg.generic``, after generalizing a copy, ties the operand
    dimensions its indexing maps give that loop, and each result is its
    init's shape), in argument order."""
    return symbols_with_padding(module, func)[0]


_PADDABLE_OPS = {"linalg.generic", "tensor.empty", "tensor.dim", "tensor.cast", "func.return", "arith.constant"}
"""The ops a function may hold for its symbols to be paddable (`paddable`)."""


def paddable(module: ir.Module, func: str | None = None) -> list[bool]:
    """For each symbol of :func:`symbols` (same order): whether its extent
    can be padded, the function run at a larger size on inputs padded at
    the end of those dimensions, and each result sliced back to its first
    rows, with the same values in them: every loop the symbol is in is
    parallel and indexes its operands directly (no reduction runs over it,
    no window or other expression reads across it), and the function holds
    only Linalg ops, ``tensor.empty``/``dim``/``cast`` and constants (a
    slice, a reshape or a loop of its own could move rows: nothing is
    paddable then). A GEMM's M is; a sequence length that attention
    reduces over is not."""
    return symbols_with_padding(module, func)[1]


def symbols_with_padding(module: ir.Module, func: str | None = None) -> tuple[list[list[Dim]], list[bool]]:
    """:func:`symbols` and :func:`paddable` from one walk of the function."""
    holder, copy, find, blocked, other_ops = _ties(module, func)
    args = copy.regions[0].blocks[0].arguments
    groups: dict = {}
    for i, d in dynamic_dims(copy):
        groups.setdefault(find((args[i], d)), []).append((i, d))
    bad = {find(x) for x in blocked}
    padding = [not other_ops and all(find((args[i], d)) not in bad for i, d in g) for g in groups.values()]
    del holder  # (only now: the arguments live in it)
    return list(groups.values()), padding


def argument_shapes(arrays) -> tuple[tuple[int, ...], ...]:
    """The shapes of a call's arguments (a numpy array's own, a list's as
    numpy reads it): what a dynamic call keys the set-up of its sizes by."""
    return tuple(a.shape if type(a) is np.ndarray else np.shape(a) for a in arrays)


def extents(groups: list[list[Dim]], shapes: list[tuple[int, ...]], name: str) -> dict[Dim, int]:
    """The size of every dynamic dimension of arguments of `shapes`, checked
    against the symbols `groups` (:func:`symbols`): each dimension must
    exist, those of one symbol must have the same size, and every size must
    be at least 1. Raises :class:`InputError` naming the dimensions (`name`:
    the function's, for the message)."""
    values: dict[Dim, int] = {}
    for group in groups:
        seen = {}
        for i, d in group:
            if d >= len(shapes[i]):
                raise InputError(f"@{name}: argument {i} has rank {len(shapes[i])}, expected more than {d}")
            seen[(i, d)] = int(shapes[i][d])
        if len(set(seen.values())) > 1:
            raise InputError(f"@{name}: dimensions {size_label(seen)} are one dimension of the function "
                             "and must have the same size")
        if any(v < 1 for v in seen.values()):
            raise InputError(f"@{name}: dimensions {size_label(seen)} are empty: every size must be at least 1")
        values.update(seen)
    return values


def _static(t: ir.Type, shape: list[int]) -> ir.Type:
    if isinstance(t, ir.RankedTensorType):
        return ir.RankedTensorType.get(shape, t.element_type, t.encoding)
    mt = ir.MemRefType(t)
    return ir.MemRefType.get(shape, mt.element_type, None, mt.memory_space)


def _clean(fn: ir.Operation, name: str, values: dict[Dim, int], hint: str) -> None:
    """Canonicalize the function being specialized; a verifier error (its
    ops disagree on a shape at these sizes) is an :class:`UnsupportedError`
    that names the sizes and the first disagreement, and `hint`: the casts
    to static extents the function had before (:func:`_fixed_casts`:
    torch-mlir's, where the traced program assumed a size), since those are
    what usually disagree."""
    try:
        passmanager.PassManager.parse("func.func(canonicalize,cse)").run(fn)
    except ir.MLIRError as err:
        raise UnsupportedError(f"@{name} is not valid at sizes {size_label(values)}: {first_diagnostic(err)}{hint}") from None


def _fixed_casts(fn: ir.Operation) -> str:
    """``tensor.cast``s of `fn` that fix a dynamic extent, described for an
    error message (empty where there are none)."""
    found: list[str] = []
    for op in walk_op(fn, "tensor.cast"):
        src, dst = ir.RankedTensorType(op.operands[0].type), ir.RankedTensorType(op.results[0].type)
        if any(src.is_dynamic_dim(d) and not dst.is_dynamic_dim(d) for d in range(src.rank)):
            found.append(f"{src} to {dst} at {op.location}")
    found = found[:3]
    if not found:
        return ""
    return ("; the function casts a dynamic extent to a fixed one (" + "; ".join(found)
            + "): it holds at that size only (the traced program assumed it)")


def specialize(fn: ir.Operation, values: dict[Dim, int]) -> None:
    """Make `fn` static in place: `values` gives every dynamic dimension of
    its arguments a size (see the module's docstring). Raises
    :class:`UnsupportedError` when some op stays dynamic."""
    from mlir.dialects import memref, tensor

    entry = fn.regions[0].blocks[0]
    name = ir.StringAttr(fn.attributes["sym_name"]).value
    missing = [f"{i}.{d}" for i, d in dynamic_dims(fn) if (i, d) not in values]
    if missing:
        raise InputError(f"@{name}: no size for dynamic dimension(s) {', '.join(missing)}")
    _check_ranges(fn, name, values)
    hint = _fixed_casts(fn)
    for i, arg in enumerate(entry.arguments):
        st = _shaped(arg.type)
        if st is None or st.has_static_shape:
            continue
        old = arg.type
        shape = [values[(i, d)] if st.is_dynamic_dim(d) else st.get_dim_size(d) for d in range(st.rank)]
        arg.set_type(_static(old, shape))
        with ir.InsertionPoint.at_block_begin(entry), ir.Location.unknown():
            cast = (tensor.CastOp(old, arg) if isinstance(old, ir.RankedTensorType) else memref.CastOp(old, arg))
        for use in list(arg.uses):
            owner = getattr(use.owner, "operation", use.owner)
            if owner != cast.operation:
                owner.operands[use.operand_number] = cast.result
    results = list(ir.FunctionType(ir.TypeAttr(fn.attributes["function_type"]).value).results)
    fn.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get([a.type for a in entry.arguments], results))
    _clean(fn, name, values, hint)
    while _static_reshapes(fn) + _static_concats(fn):  # ops whose static types the canonicalizer does not infer
        _clean(fn, name, values, hint)
    # The results: a cast back to the dynamic type at the return goes.
    ret = list(entry.operations)[-1]
    for k, v in enumerate(list(ret.operands)):
        owner = getattr(v.owner, "operation", v.owner) if not isinstance(v.owner, ir.Block) else None
        if owner is not None and owner.name in ("tensor.cast", "memref.cast"):
            ret.operands[k] = owner.operands[0]
    fn.attributes["function_type"] = ir.TypeAttr.get(
        ir.FunctionType.get([a.type for a in entry.arguments], [v.type for v in ret.operands]))
    _clean(fn, name, values, hint)
    left: list[str] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        for r in op.results:
            st = _shaped(r.type)
            if st is not None and not st.has_static_shape:
                left.append(f"{op.name} -> {r.type}")
        return ir.WalkResult.ADVANCE

    fn.walk(visit)
    if left:
        raise UnsupportedError(f"@{name} stays dynamic at sizes {size_label(values)}: {left[0]}"
                               + (f" (and {len(left) - 1} more)" if len(left) > 1 else ""))


def _one_group(rank: int) -> ir.ArrayAttr:
    """The reassociation of every dimension into one: ``[[0, ..., rank - 1]]``."""
    i64 = ir.IntegerType.get_signless(64)
    return ir.ArrayAttr.get([ir.ArrayAttr.get([ir.IntegerAttr.get(i64, i) for i in range(rank)])])


def _static_reshapes(fn: ir.Operation) -> int:
    """Rewrite each ``tensor.reshape`` to a constant shape (torch-mlir's
    ``view`` with sizes computed from ``tensor.dim``, folded by the
    specialization) of a static source as a ``collapse_shape`` to one
    dimension and an ``expand_shape`` to the shape, whose static types the
    canonicalizer then carries on (it folds no ``tensor.reshape``). Returns
    how many it rewrote."""
    from mlir.dialects import tensor

    done = 0
    for op in walk_op(fn, "tensor.reshape"):
        src, shape_v = op.operands
        shape_op = shape_v.owner if not isinstance(shape_v.owner, ir.Block) else None
        if shape_op is None or shape_op.name != "arith.constant":
            continue
        try:
            shape = [int(x) for x in ir.DenseIntElementsAttr(shape_op.attributes["value"])]
        except (ValueError, TypeError):
            continue
        src = cast_source(src)
        st = ir.RankedTensorType(src.type)
        old = ir.RankedTensorType(op.results[0].type)
        if not st.has_static_shape or any(d < 0 for d in shape) or math.prod(shape) != math.prod(st.shape):
            continue
        with ir.InsertionPoint(op), op.location:
            flat_type = ir.RankedTensorType.get([math.prod(st.shape)], st.element_type)
            flat = tensor.CollapseShapeOp(flat_type, src, _one_group(st.rank)).result
            out = tensor.ExpandShapeOp(ir.RankedTensorType.get(shape, old.element_type), flat,
                                       _one_group(len(shape)), [], shape).result
            back = tensor.CastOp(old, out).result
        op.results[0].replace_all_uses_with(back)
        op.erase()
        done += 1
    return done


def _static_concats(fn: ir.Operation) -> int:
    """Give each ``tensor.concat`` of static operands whose result type is
    dynamic (a KV cache's past rows joined to the new ones: the length is
    the sum of two symbols) its static type, followed by a ``tensor.cast``
    back that the canonicalizer folds into the users: it infers no concat's
    type. Returns how many it rewrote."""
    from mlir.dialects import tensor

    done = 0
    for op in walk_op(fn, "tensor.concat"):
        if ir.RankedTensorType(op.results[0].type).has_static_shape:
            continue
        inputs = [cast_source(v) for v in op.operands]
        if not all(ir.RankedTensorType(v.type).has_static_shape for v in inputs):
            continue
        with ir.InsertionPoint(op), op.location:
            out = concat(inputs, ir.IntegerAttr(op.attributes["dim"]).value)
            back = tensor.CastOp(op.results[0].type, out).result
        op.results[0].replace_all_uses_with(back)
        op.erase()
        done += 1
    return done


def size_label(values: dict[Dim, int]) -> str:
    """``{(0, 0): 16, (2, 0): 16}`` -> ``"0.0=16, 2.0=16"`` (as ``--sizes`` names them)."""
    return ", ".join(f"{i}.{d}={v}" for (i, d), v in sorted(values.items()))


def expand(module: ir.Module, sizes: dict[Dim, tuple[int, ...]], func: str | None = None) -> list[dict[Dim, int]]:
    """Every combination of the given sizes, each spread over the
    dimensions of its symbol (a size for 0.0 is the size of every dimension
    tied to it); a symbol without a size, or two sizes for one symbol, is
    an error that names them."""
    groups = symbols(module, func)
    by_dim = {d: g for g in groups for d in g}
    unknown = [f"{i}.{d}" for i, d in sizes if (i, d) not in by_dim]
    if unknown:
        raise InputError(f"--sizes {', '.join(unknown)}: not a dynamic dimension of the function's arguments "
                         f"(those are {', '.join(f'{i}.{d}' for g in groups for i, d in g) or 'none'})")
    chosen: list[tuple[list[Dim], tuple[int, ...]]] = []
    for g in groups:
        given = [d for d in g if d in sizes]
        if not given:
            raise InputError(f"--sizes: no size for {' = '.join(f'{i}.{d}' for i, d in g)} "
                             f"(give one, for example --sizes {g[0][0]}.{g[0][1]}=1,16,64)")
        if len(given) > 1:
            raise InputError(f"--sizes: {' and '.join(f'{i}.{d}' for i, d in given)} are one dimension; give one of them")
        chosen.append((g, sizes[given[0]]))
    out = []
    for combo in itertools.product(*(vals for _, vals in chosen)):
        out.append({d: v for (g, _), v in zip(chosen, combo) for d in g})
    return out


def specializations(text: str, sizes: dict[Dim, tuple[int, ...]], func: str | None = None,
                    keep_name: bool = False) -> tuple[str, list[tuple[str, dict[Dim, int]]]]:
    """The module with the dynamic function replaced by one static copy per
    combination of `sizes` (named ``<func>__<arg>_<dim>_<size>...``, or
    keeping its name when there is one combination and `keep_name`), and
    the list of (name, sizes). Its tasks are those of every size."""
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(text)
        fn = dynamic_function(module, func)
        combos = expand(module, sizes, func)
        base = ir.StringAttr(fn.attributes["sym_name"]).value
        made = []
        for values in combos:
            name = base if keep_name and len(combos) == 1 else base + "__" + "_".join(
                f"{i}_{d}_{v}" for (i, d), v in sorted(values.items()) if (i, d) in sizes)
            copy = fn.clone(ir.InsertionPoint(fn))
            copy.attributes["sym_name"] = ir.StringAttr.get(name)
            specialize(copy.operation, values)
            made.append((name, values))
        fn.erase()
        return str(module), made
