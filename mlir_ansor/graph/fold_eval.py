"""Evaluate a constants-only function (`graph.constants`) with numpy.

The weights of an imported model are folded once per compile: transposes
of filters, a batch norm's ``sqrt(var + eps)`` and its reciprocal. Built
through LLVM, that function took 10-13 s of a ResNet-50 compile (most of it
code generation of 160 loops that each run once); numpy does it in well
under a second.

Only what numpy computes exactly as the LLVM build would is evaluated here:
copies (``linalg.transpose``, ``linalg.broadcast``, ``linalg.fill``,
``linalg.copy``), and ``linalg.generic`` with parallel loops, projected
permutation maps and a body of correctly rounded IEEE operations (add,
subtract, multiply, divide, square root, negation, min/max, comparisons,
conversions between float widths, integer arithmetic) without fast-math
flags. Anything else (a reduction, whose order LLVM may choose; ``exp``,
which we lower to our own approximation; an op we do not know) raises
:class:`NotEvaluable`, and the caller builds the function through LLVM as
before. A failing ``cf.assert`` raises it too, so that the LLVM build
reports it as it always did.
"""

from __future__ import annotations

import math

import numpy as np
from mlir import ir

from mlir_ansor.ir.program import resource_bytes

__all__ = ["CMPF_PREDICATES", "NotEvaluable", "evaluate"]


class NotEvaluable(Exception):
    """The function holds something this evaluator does not reproduce exactly."""


_FLOATS = {"f16": np.float16, "f32": np.float32, "f64": np.float64}
_INTS = {"i1": np.bool_, "i8": np.int8, "i16": np.int16, "i32": np.int32, "i64": np.int64}

_BINARY = {
    "arith.addf": np.add,
    "arith.subf": np.subtract,
    "arith.mulf": np.multiply,
    "arith.divf": np.divide,
    "arith.addi": np.add,
    "arith.subi": np.subtract,
    "arith.muli": np.multiply,
    "arith.andi": np.bitwise_and,
    "arith.ori": np.bitwise_or,
    "arith.xori": np.bitwise_xor,
}
_UNARY = {"math.sqrt": np.sqrt, "arith.negf": np.negative, "math.absf": np.abs}
CMPF_PREDICATES = {
    # predicate number -> function (arith::CmpFPredicate)
    1: lambda a, b: a == b,  # oeq
    2: lambda a, b: a > b,  # ogt
    3: lambda a, b: a >= b,  # oge
    4: lambda a, b: a < b,  # olt
    5: lambda a, b: a <= b,  # ole
    6: lambda a, b: (a != b) & ~np.isnan(a) & ~np.isnan(b),  # one
    7: lambda a, b: ~np.isnan(a) & ~np.isnan(b),  # ord
    8: lambda a, b: (a == b) | np.isnan(a) | np.isnan(b),  # ueq
    9: lambda a, b: ~(a <= b),  # ugt
    10: lambda a, b: ~(a < b),  # uge
    11: lambda a, b: ~(a >= b),  # ult
    12: lambda a, b: ~(a > b),  # ule
    13: lambda a, b: a != b,  # une
    14: lambda a, b: np.isnan(a) | np.isnan(b),  # uno
}


def _dtype(t: ir.Type):
    s = str(t)
    if s in _FLOATS:
        return _FLOATS[s]
    if s in _INTS:
        return _INTS[s]
    raise NotEvaluable(f"element type {s}")


def _no_fastmath(op: ir.Operation) -> None:
    if "fastmath" in op.attributes and str(op.attributes["fastmath"]) != "#arith.fastmath<none>":
        raise NotEvaluable(f"{op.name} with fast-math flags")


def _constant(op: ir.Operation, blobs: dict[str, str]) -> np.ndarray:
    attr = op.attributes["value"]
    t = op.results[0].type
    if isinstance(t, ir.RankedTensorType):
        st = ir.RankedTensorType(t)
        dt = _dtype(st.element_type)
        text = str(attr)
        if text.startswith("dense_resource<"):
            name, data = resource_bytes(text, blobs)
            if data is None:
                raise NotEvaluable(f"resource {name} not found")
            if dt is np.bool_ or len(data) != math.prod(st.shape) * np.dtype(dt).itemsize:
                raise NotEvaluable(f"resource {name} has an unexpected size")
            return np.frombuffer(data, dtype=dt).reshape(st.shape)
        dense = ir.DenseElementsAttr(attr)
        if dense.is_splat:
            return np.full(st.shape, _scalar(dense.get_splat_value(), st.element_type), dtype=dt)
        arr = np.array(dense)
        if arr.dtype == object or arr.shape != tuple(st.shape):
            raise NotEvaluable(f"constant of type {t}")
        return arr.astype(dt, copy=False)
    return _scalar(attr, t)


def _scalar(attr: ir.Attribute, t: ir.Type):
    dt = _dtype(t)
    if dt in _FLOATS.values():
        return dt(ir.FloatAttr(attr).value)
    if dt is np.bool_:
        return np.bool_(ir.IntegerAttr(attr).value & 1)
    return dt(ir.IntegerAttr(attr).value)


def evaluate(fold: ir.Module, entry: str, resources: dict[str, str]) -> tuple[np.ndarray, ...]:
    """The results of function `entry` of `fold` (no arguments, on tensors),
    computed with numpy; `resources` maps ``dense_resource`` names to their
    hex blobs (``ir.program.resource_blobs``). Raises :class:`NotEvaluable`."""
    fn = next(
        (o.operation for o in fold.body.operations
         if o.operation.name == "func.func" and ir.StringAttr(o.operation.attributes["sym_name"]).value == entry),
        None,
    )
    if fn is None or len(fn.regions[0].blocks) != 1:
        raise NotEvaluable(f"no function @{entry} of one block")
    env: dict = {}
    with np.errstate(all="ignore"):  # inf and nan as LLVM computes them, without warnings
        for opview in fn.regions[0].blocks[0].operations:
            op = opview.operation
            if op.name == "func.return":
                return tuple(np.ascontiguousarray(env[v]) for v in op.operands)
            _step(op, env, resources)
    raise NotEvaluable("no func.return")


def _step(op: ir.Operation, env: dict, blobs: dict[str, str]) -> None:
    name = op.name
    if name == "arith.constant":
        env[op.results[0]] = _constant(op, blobs)
    elif name == "tensor.empty":
        st = ir.RankedTensorType(op.results[0].type)
        env[op.results[0]] = _Empty(tuple(st.shape), _dtype(st.element_type))
    elif name == "linalg.transpose":
        perm = [int(x) for x in ir.DenseI64ArrayAttr(op.attributes["permutation"])]
        env[op.results[0]] = np.ascontiguousarray(np.transpose(_array(env[op.operands[0]]), perm))
    elif name == "linalg.copy":
        env[op.results[0]] = np.array(_array(env[op.operands[0]]), copy=True)
    elif name == "linalg.fill":
        st = ir.RankedTensorType(op.results[0].type)
        env[op.results[0]] = np.full(st.shape, env[op.operands[0]], dtype=_dtype(st.element_type))
    elif name == "linalg.broadcast":
        src = _array(env[op.operands[0]])
        st = ir.RankedTensorType(op.results[0].type)
        dims = [int(x) for x in ir.DenseI64ArrayAttr(op.attributes["dimensions"])]
        shape = [1 if i in dims else None for i in range(len(st.shape))]
        it = iter(src.shape)
        shape = [s if s is not None else next(it) for s in shape]
        env[op.results[0]] = np.ascontiguousarray(np.broadcast_to(src.reshape(shape), st.shape))
    elif name == "linalg.generic":
        _generic(op, env)
    elif name in _BINARY or name in _UNARY or name in ("arith.truncf", "arith.extf", "arith.cmpf"):
        _scalar_op(op, env)  # a scalar op outside any loop
    else:
        raise NotEvaluable(f"op {name}")


class _Empty:
    """A ``tensor.empty``: its shape, no defined contents."""

    def __init__(self, shape: tuple[int, ...], dtype) -> None:
        self.shape, self.dtype = shape, dtype


def _array(v) -> np.ndarray:
    if isinstance(v, _Empty):
        raise NotEvaluable("reads a tensor.empty")
    return np.asarray(v)


def _map_dims(m: ir.AffineMap) -> tuple[list[int], tuple]:
    """The loop dims a projected permutation map reads, and the index that
    picks its operand's part: a constant result (``(d0, d1) -> (2, d1)``)
    fixes its axis, a dim takes the whole axis."""
    dims = []
    index: list = []
    for e in m.results:
        if isinstance(e, ir.AffineConstantExpr):
            index.append(e.value)
            continue
        if not isinstance(e, ir.AffineDimExpr):
            raise NotEvaluable(f"indexing map {m}")
        dims.append(e.position)
        index.append(slice(None))
    if len(set(dims)) != len(dims):
        raise NotEvaluable(f"indexing map {m}")
    return dims, tuple(index)


def _to_domain(arr: np.ndarray, dims: list[int], rank: int) -> np.ndarray:
    """`arr` (indexed by loop dims `dims`) as an array over the loop domain
    (size 1 along the dims it does not depend on)."""
    order = sorted(range(len(dims)), key=lambda i: dims[i])
    a = np.transpose(arr, order) if order != list(range(len(dims))) else arr
    shape = [1] * rank
    for i in order:
        shape[dims[i]] = arr.shape[i]
    return a.reshape(shape)


def _generic(op: ir.Operation, env: dict) -> None:
    iters = [str(a) for a in ir.ArrayAttr(op.attributes["iterator_types"])]
    if any("parallel" not in a for a in iters):
        raise NotEvaluable("a reduction")
    maps = [ir.AffineMapAttr(a).value for a in ir.ArrayAttr(op.attributes["indexing_maps"])]
    n_out = len(op.results)
    n_in = len(op.operands) - n_out
    rank = len(iters)
    block = op.regions[0].blocks[0]
    shapes = [0] * rank
    operands = []
    for v, m in zip(op.operands, maps):
        dims, index = _map_dims(m)
        val = env[v]
        if len(dims) != len(index):
            val = _array(val)[index]
        shape = val.shape
        for d, s in zip(dims, shape):
            shapes[d] = s
        operands.append((val, dims))
    outs_dims = [d for _, d in operands[n_in:]]
    if any(sorted(d) != list(range(rank)) for d in outs_dims):
        raise NotEvaluable("an output map that is no permutation")
    local: dict = {}
    for k, (val, dims) in enumerate(operands):
        arg = block.arguments[k]
        if k >= n_in and not list(arg.uses):
            continue  # an output's initial value the body does not read
        local[arg] = _to_domain(_array(val), dims, rank)
    outer = env
    for bop in block.operations:
        b = bop.operation
        if b.name == "linalg.yield":
            for r, y, dims in zip(op.results, b.operands, outs_dims):
                res_type = ir.RankedTensorType(r.type)
                dt = _dtype(res_type.element_type)
                full = np.broadcast_to(np.asarray(_lookup(y, local, outer), dtype=dt), tuple(shapes))
                out = np.transpose(full, dims) if dims != list(range(rank)) else full  # axis j is loop dim dims[j]
                env[r] = np.ascontiguousarray(out)
            return
        if b.name == "cf.assert":
            if not np.all(_lookup(b.operands[0], local, outer)):
                raise NotEvaluable("an assertion fails")
            continue
        if b.name == "arith.constant":
            local[b.results[0]] = _constant(b, {})
            continue
        _scalar_op(b, local, outer)
    raise NotEvaluable("a generic without linalg.yield")


def _lookup(v, local: dict, outer: dict):
    if v in local:
        return local[v]
    if v in outer:
        val = outer[v]
        if np.ndim(val) == 0:
            return val
    raise NotEvaluable("a value from outside the body that is no scalar")


def _scalar_op(b: ir.Operation, local: dict, outer: dict | None = None) -> None:
    outer = outer if outer is not None else {}
    name = b.name
    _no_fastmath(b)
    args = [_lookup(v, local, outer) for v in b.operands]
    res_t = _dtype(b.results[0].type) if len(b.results) == 1 else None
    if name in _BINARY:
        if name.endswith("i") and res_t in _FLOATS.values():
            raise NotEvaluable(name)
        if name == "arith.divf":
            out = np.divide(args[0], args[1])
        else:
            out = _BINARY[name](args[0], args[1])
    elif name in _UNARY:
        out = _UNARY[name](args[0])
    elif name in ("arith.truncf", "arith.extf"):
        if "roundingmode" in b.attributes:
            raise NotEvaluable(f"{name} with a rounding mode")
        out = np.asarray(args[0]).astype(res_t)
    elif name == "arith.cmpf":
        pred = ir.IntegerAttr(b.attributes["predicate"]).value
        if pred not in CMPF_PREDICATES:
            raise NotEvaluable(f"cmpf predicate {pred}")
        out = CMPF_PREDICATES[pred](np.asarray(args[0]), np.asarray(args[1]))
    elif name == "arith.select":
        out = np.where(args[0], args[1], args[2])
    else:
        raise NotEvaluable(f"op {name}")
    arr = np.asarray(out)
    if res_t is not None and arr.dtype != np.dtype(res_t):
        # numpy would promote; the op computes in its own type
        if not all(np.asarray(a).dtype == np.dtype(res_t) for a in args) and name not in ("arith.truncf", "arith.extf", "arith.cmpf"):
            raise NotEvaluable(f"{name}: operand types differ from the result type")
        arr = arr.astype(res_t)
    local[b.results[0]] = arr if arr.ndim else res_t(arr) if res_t is not None else arr
