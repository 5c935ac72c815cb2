"""Evaluate a whole Linalg function with numpy: `run`'s reference without LLVM.

`mlir-ansor run` checks a compiled module against a reference on random
inputs. The untuned build of the module was that reference; for ResNet-50 it
cost 40-70 s of code generation on a first `run`, three times the tuned
compile. This evaluator computes the same function in numpy instead, in a
few seconds, and independently of our lowering (the untuned build shares the
frontend and the pipeline with the code it checks):

* named ops are generalized first (``linalg-generalize-named-ops`` on a
  clone), so every Linalg op is a ``linalg.generic``;
* each operand enters a generic as a zero-copy strided view over the
  iteration domain, read through its indexing map (any map whose results are
  non-negative linear combinations of loop dims plus a constant: transposes,
  broadcasts, a convolution's ``oh * s + kh``);
* a parallel generic evaluates its body once, vectorized over the domain;
* a reduction whose yield is ``out <comb> x`` (add, max, min, ...) computes
  ``x`` and reduces it: a sum of products of two operands' per-element
  functions is one ``np.einsum`` (BLAS through ``tensordot``: a convolution
  becomes im2col and a GEMM), anything else is evaluated over the domain in
  chunks and reduced with the combiner's ufunc;
* ``tensor`` ops that move data (pad, reshapes, slices, concat, cast) are the
  numpy operations they describe.

Precision: sums and products of a reduction accumulate in float64 (integer
ones exactly) and are rounded once to the result's type, so the reference is
at least as accurate as any schedule; elementwise float ops compute in their
own type, bf16 and f16 widened to f32 without rounding (as the untuned
reference did: `graph.precision.widen_payload`, the check's tolerance counts
that rounding); integers wrap at their width. Math functions are numpy's and
scipy's (exact to an ulp or so, where our kernels use approximations within
the check's tolerance).

What it does not evaluate (memrefs, ``linalg.softmax`` and other ops that do
not generalize, maps with ``mod`` or ``floordiv``, a reduction whose yield is
not ``out <comb> x``) raises :class:`NotInterpretable` naming the op, and
the caller falls back to the untuned build.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from mlir import ir

from mlir_ansor.graph.fold_eval import CMPF_PREDICATES
from mlir_ansor.graph.task import generalized_copy
from mlir_ansor.ir.program import location_str, resource_bytes
from mlir_ansor.ir.rewrite import backward_slice

__all__ = ["NotInterpretable", "interpret"]


class NotInterpretable(Exception):
    """The function holds something this evaluator does not compute."""


_CHUNK_ELEMENTS = 1 << 24
"""Largest domain (elements) a general reduction's body is evaluated over at
once (128 MiB per float64 temporary); larger ones go in slices of a parallel
dimension."""

_FLOAT_COMPUTE = {"f64": np.float64, "f32": np.float32, "f16": np.float32, "bf16": np.float32}


def _compute_dtype(t: ir.Type) -> np.dtype:
    """The numpy type a value of MLIR type `t` (scalar or shaped) is held in."""
    s = _element(t)
    if s in _FLOAT_COMPUTE:
        return np.dtype(_FLOAT_COMPUTE[s])
    if s == "i1":
        return np.dtype(np.bool_)
    if s == "index" or (s.startswith("i") and s[1:].isdigit() and int(s[1:]) <= 64):
        return np.dtype(np.int64)
    raise NotInterpretable(f"element type {s}")


def _element(t: ir.Type) -> str:
    """The element type of `t` (itself for a scalar), as MLIR spells it."""
    try:
        return str(ir.ShapedType(t).element_type)
    except ValueError:
        return str(t)


def _bits(et: str) -> int:
    return 64 if et == "index" else int(et[1:])


def _wrap(x, et: str):
    """Integer `x` (int64) wrapped to the signed range of type `et`."""
    if et == "i1":
        return np.asarray(x).astype(np.bool_)
    b = _bits(et)
    x = np.asarray(x, dtype=np.int64)
    if b >= 64:
        return x
    half = 1 << (b - 1)
    return ((x + half) & ((1 << b) - 1)) - half


def _unsigned(x, et: str):
    b = _bits(et)
    x = np.asarray(x, dtype=np.int64)
    return x if b >= 64 else x & ((1 << b) - 1)


class _Empty:
    """A ``tensor.empty``: a shape and no defined contents."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        self.shape = shape


def _array(v, what: str) -> np.ndarray:
    if isinstance(v, _Empty):
        raise NotInterpretable(f"{what} reads a tensor.empty")
    return np.asarray(v)


# --------------------------------------------------------------------------
# Constants
# --------------------------------------------------------------------------


def _scalar_attr(attr: ir.Attribute, t: ir.Type):
    dt = _compute_dtype(t)
    if dt.kind == "f":
        return dt.type(ir.FloatAttr(attr).value)
    v = ir.IntegerAttr(attr).value
    return np.bool_(v & 1) if dt.kind == "b" else np.int64(v)


_STORAGE = {"f64": np.float64, "f32": np.float32, "f16": np.float16, "i64": np.int64, "i32": np.int32,
            "i16": np.int16, "i8": np.int8}


def _constant(op: ir.Operation, blobs: Mapping[str, str]):
    attr = op.attributes["value"]
    t = op.results[0].type
    if not isinstance(t, ir.RankedTensorType) and not str(t).startswith("tensor<"):
        return _scalar_attr(attr, t)
    st = ir.RankedTensorType(t)
    et = str(st.element_type)
    dt = _compute_dtype(t)
    text = str(attr)
    if text.startswith("dense_resource<"):
        name, data = resource_bytes(text, blobs)
        if data is None:
            raise NotInterpretable(f"resource {name} not found")
        if et == "bf16":
            import ml_dtypes

            storage = np.dtype(ml_dtypes.bfloat16)
        elif et in _STORAGE:
            storage = np.dtype(_STORAGE[et])
        else:
            raise NotInterpretable(f"resource {name} of element type {et}")
        if len(data) != math.prod(st.shape) * storage.itemsize:
            raise NotInterpretable(f"resource {name} has an unexpected size")
        return np.frombuffer(data, dtype=storage).reshape(st.shape).astype(dt)
    dense = ir.DenseElementsAttr(attr)
    if dense.is_splat:
        return np.full(st.shape, _scalar_attr(dense.get_splat_value(), st.element_type), dtype=dt)
    if et == "bf16":
        raise NotInterpretable("a non-splat bf16 constant written inline")
    arr = np.array(dense)
    if arr.dtype == object or arr.shape != tuple(st.shape):
        raise NotInterpretable(f"constant of type {t}")
    return arr.astype(dt)


# --------------------------------------------------------------------------
# Elementwise (scalar) ops, vectorized
# --------------------------------------------------------------------------


def _erf(x):
    from scipy.special import erf

    return erf(x).astype(np.asarray(x).dtype)


def _round_away(x):
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


_FLOAT_BINARY = {
    "arith.addf": np.add, "arith.subf": np.subtract, "arith.mulf": np.multiply, "arith.divf": np.divide,
    "arith.remf": np.fmod, "arith.maximumf": np.maximum, "arith.minimumf": np.minimum,
    "arith.maxnumf": np.fmax, "arith.minnumf": np.fmin, "math.powf": np.power, "math.atan2": np.arctan2,
    "math.copysign": np.copysign,
}
_FLOAT_UNARY = {
    "arith.negf": np.negative, "math.absf": np.abs, "math.sqrt": np.sqrt, "math.exp": np.exp,
    "math.exp2": np.exp2, "math.expm1": np.expm1, "math.log": np.log, "math.log1p": np.log1p,
    "math.log2": np.log2, "math.log10": np.log10, "math.tanh": np.tanh, "math.sin": np.sin,
    "math.cos": np.cos, "math.tan": np.tan, "math.atan": np.arctan, "math.erf": _erf,
    "math.floor": np.floor, "math.ceil": np.ceil, "math.trunc": np.trunc, "math.roundeven": np.rint,
    "math.round": _round_away, "math.rsqrt": lambda x: 1 / np.sqrt(x), "math.cbrt": np.cbrt,
    "math.sinh": np.sinh, "math.cosh": np.cosh, "math.asin": np.arcsin, "math.acos": np.arccos,
    "math.asinh": np.arcsinh, "math.acosh": np.arccosh, "math.atanh": np.arctanh, "math.erfc": lambda x: 1 - _erf(x),
}
_INT_BINARY = {
    "arith.addi": np.add, "arith.subi": np.subtract, "arith.muli": np.multiply,
    "arith.andi": np.bitwise_and, "arith.ori": np.bitwise_or, "arith.xori": np.bitwise_xor,
    "arith.maxsi": np.maximum, "arith.minsi": np.minimum,
}
_CMPI = {0: np.equal, 1: np.not_equal, 2: np.less, 3: np.less_equal, 4: np.greater, 5: np.greater_equal,
         6: np.less, 7: np.less_equal, 8: np.greater, 9: np.greater_equal}
"""arith::CmpIPredicate: eq, ne, slt, sle, sgt, sge, ult, ule, ugt, uge (6-9 on unsigned values)."""


def _elementwise(op: ir.Operation, args: list):
    """The result of scalar op `op` applied to (broadcastable) arrays `args`."""
    name = op.name
    rt = op.results[0].type
    et = _element(rt)
    dt = _compute_dtype(rt)
    if name in _FLOAT_BINARY:
        return _FLOAT_BINARY[name](args[0], args[1]).astype(dt, copy=False)
    if name in _FLOAT_UNARY:
        return np.asarray(_FLOAT_UNARY[name](args[0])).astype(dt, copy=False)
    if name in ("math.isnan", "math.isinf", "math.isfinite"):
        return {"math.isnan": np.isnan, "math.isinf": np.isinf, "math.isfinite": np.isfinite}[name](args[0])
    if name in ("math.fpowi", "math.ipowi"):
        if dt.kind == "f":
            return np.power(args[0], np.asarray(args[1], dtype=np.float64)).astype(dt)
        return _wrap(np.power(np.asarray(args[0], dtype=np.int64), np.asarray(args[1], dtype=np.int64)), et)
    if name == "math.absi":
        return _wrap(np.abs(np.asarray(args[0], dtype=np.int64)), et)
    if name == "math.fma":
        return (args[0] * args[1] + args[2]).astype(dt, copy=False)
    if name in _INT_BINARY:
        if dt.kind == "b":
            return _INT_BINARY[name](args[0], args[1]).astype(np.bool_)
        return _wrap(_INT_BINARY[name](args[0], args[1]), et)
    if name in ("arith.maxui", "arith.minui"):
        ua, ub = (_unsigned(a, et) for a in args)
        pick = ua >= ub if name == "arith.maxui" else ua <= ub
        return np.where(pick, args[0], args[1])
    if name in ("arith.divsi", "arith.remsi", "arith.divui", "arith.remui", "arith.floordivsi", "arith.ceildivsi"):
        return _int_division(name, args[0], args[1], et)
    if name in ("arith.shli", "arith.shrsi", "arith.shrui"):
        a, s = np.asarray(args[0], dtype=np.int64), np.asarray(args[1], dtype=np.int64)
        if name == "arith.shli":
            return _wrap(a << s, et)
        if name == "arith.shrsi":
            return a >> s
        return _wrap(_unsigned(a, et) >> s, et)
    if name in ("arith.extf", "arith.truncf"):
        return np.asarray(args[0]).astype(dt)  # bf16/f16 held in f32: widened, not rounded
    if name in ("arith.extsi", "arith.index_cast", "arith.index_castui", "arith.trunci"):
        src = _element(op.operands[0].type)
        v = _unsigned(args[0], src) if name == "arith.index_castui" else np.asarray(args[0], dtype=np.int64)
        return _wrap(v, et)
    if name == "arith.extui":
        return _wrap(_unsigned(args[0], _element(op.operands[0].type)), et)
    if name == "arith.sitofp":
        return np.asarray(args[0]).astype(dt)
    if name == "arith.uitofp":
        return _unsigned(args[0], _element(op.operands[0].type)).astype(dt)
    if name in ("arith.fptosi", "arith.fptoui"):
        return _wrap(np.trunc(np.asarray(args[0], dtype=np.float64)).astype(np.int64), et)
    if name == "arith.cmpf":
        pred = ir.IntegerAttr(op.attributes["predicate"]).value
        if pred not in CMPF_PREDICATES:
            raise NotInterpretable(f"arith.cmpf predicate {pred}")
        return CMPF_PREDICATES[pred](np.asarray(args[0]), np.asarray(args[1]))
    if name == "arith.cmpi":
        pred = ir.IntegerAttr(op.attributes["predicate"]).value
        src = _element(op.operands[0].type)
        a, b = ((_unsigned(x, src) for x in args) if pred >= 6 else args)
        return _CMPI[pred](a, b)
    if name == "arith.select":
        return np.where(args[0], args[1], args[2])
    if name == "arith.bitcast":
        raise NotInterpretable("arith.bitcast")
    raise NotInterpretable(f"op {name}")


def _int_division(name: str, a, b, et: str):
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    if np.any(b == 0):
        raise NotInterpretable(f"{name} by zero")
    if name in ("arith.divui", "arith.remui"):
        ua, ub = _unsigned(a, et), _unsigned(b, et)
        return _wrap(ua // ub if name == "arith.divui" else ua % ub, et)
    if name == "arith.floordivsi":
        return _wrap(a // b, et)
    if name == "arith.ceildivsi":
        return _wrap(-((-a) // b), et)
    q = np.abs(a) // np.abs(b) * np.sign(a) * np.sign(b)  # C division: toward zero
    return _wrap(q if name == "arith.divsi" else a - q * b, et)


# --------------------------------------------------------------------------
# Indexing maps as strided views
# --------------------------------------------------------------------------


def _linear(e: ir.AffineExpr) -> tuple[dict[int, int], int]:
    """`e` as ({dim: coefficient}, constant); raises where it is not linear in the dims."""
    if isinstance(e, ir.AffineDimExpr):
        return {e.position: 1}, 0
    if isinstance(e, ir.AffineConstantExpr):
        return {}, e.value
    if isinstance(e, ir.AffineAddExpr):
        (a, ca), (b, cb) = _linear(e.lhs), _linear(e.rhs)
        out = dict(a)
        for d, k in b.items():
            out[d] = out.get(d, 0) + k
        return out, ca + cb
    if isinstance(e, ir.AffineMulExpr):
        (a, ca), (b, cb) = _linear(e.lhs), _linear(e.rhs)
        if a and b:
            raise NotInterpretable(f"indexing expression {e}")
        coef, terms = (cb, a) if a else (ca, b)
        return {d: k * coef for d, k in terms.items()}, ca * cb
    raise NotInterpretable(f"indexing expression {e}")


def _view(arr: np.ndarray, lin: list[tuple[dict[int, int], int]], dims: list[int], extents: list[int]) -> np.ndarray:
    """The elements of `arr` read at every point of the domain's dims `dims`
    (one axis each, in that order), through the map `lin`; no copy."""
    strides = [0] * len(dims)
    pos = {d: i for i, d in enumerate(dims)}
    start = []
    for ax, (coef, c) in enumerate(lin):
        hi = c + sum(k * (extents[d] - 1) for d, k in coef.items())
        if c < 0 or any(k < 0 for k in coef.values()) or hi >= arr.shape[ax]:
            raise NotInterpretable(f"an indexing map reads outside an operand of shape {arr.shape}")
        start.append(c)
        for d, k in coef.items():
            strides[pos[d]] += k * arr.strides[ax]
    base = arr[tuple(slice(c, None) for c in start)] if any(start) else arr
    return np.lib.stride_tricks.as_strided(base, shape=[extents[d] for d in dims], strides=strides, writeable=False)


# --------------------------------------------------------------------------
# linalg.generic
# --------------------------------------------------------------------------

_COMBINERS = {
    "arith.addf": np.add, "arith.addi": np.add, "arith.mulf": np.multiply, "arith.muli": np.multiply,
    "arith.maximumf": np.maximum, "arith.minimumf": np.minimum, "arith.maxnumf": np.fmax,
    "arith.minnumf": np.fmin, "arith.maxsi": np.maximum, "arith.minsi": np.minimum,
    "arith.ori": np.bitwise_or, "arith.andi": np.bitwise_and, "arith.xori": np.bitwise_xor,
}
"""Ops whose yield ``out <op> x`` is a reduction with that ufunc (associative and commutative)."""


class _Generic:
    """One ``linalg.generic``: its domain, its operands' maps, its body."""

    def __init__(self, op: ir.Operation, env: dict) -> None:
        self.iters = [str(a) for a in ir.ArrayAttr(op.attributes["iterator_types"])]
        self.rank = len(self.iters)
        maps = [ir.AffineMapAttr(a).value for a in ir.ArrayAttr(op.attributes["indexing_maps"])]
        if any(m.n_symbols for m in maps):
            raise NotInterpretable("an indexing map with symbols")
        self.n_out = len(op.results)
        self.n_in = len(op.operands) - self.n_out
        self.values = [env[v] for v in op.operands]
        self.lins = [[_linear(e) for e in m.results] for m in maps]
        extents: list[int | None] = [None] * self.rank
        for val, lin in zip(self.values, self.lins):
            shape = val.shape if isinstance(val, _Empty) else np.shape(val)
            for (coef, c), s in zip(lin, shape):
                if c == 0 and len(coef) == 1 and next(iter(coef.values())) == 1:
                    extents[next(iter(coef))] = s
        if any(e is None for e in extents):
            raise NotInterpretable("a loop dimension that no operand indexes directly")
        self.extents: list[int] = extents  # type: ignore[assignment]
        self.out_dims = []
        for lin in self.lins[self.n_in:]:
            dims = []
            for coef, c in lin:
                if not coef and c == 0:
                    continue  # a constant 0 on a dimension of size 1: (d0, 0)
                if c != 0 or len(coef) != 1 or next(iter(coef.values())) != 1:
                    raise NotInterpretable("an output map that is no projection")
                dims.append(next(iter(coef)))
            self.out_dims.append(dims)
        self.block = op.regions[0].blocks[0]
        self.args = list(self.block.arguments)
        self.ops = [o.operation for o in self.block.operations]
        self.defining = {r: o for o in self.ops for r in o.results}
        """The body's op that defines each of its values."""

    def depends(self, v: ir.Value) -> set[int]:
        """Indexes of the block arguments `v` depends on; -1 for ``linalg.index``."""
        pos = {a: i for i, a in enumerate(self.args)}
        needed = backward_slice(self.block, [v])
        found = {pos[a] for a in self.args if a in needed}
        return found | ({-1} if any(o.name == "linalg.index" for o in self.ops if o in needed) else set())

    def scalar_inputs(self) -> list[int]:
        """The inputs read as one value at every point (no loop dimension in their map)."""
        return [k for k in range(self.n_in) if not self.dims_of(k) and not isinstance(self.values[k], _Empty)
                and np.size(self.values[k]) == 1]

    def read_inputs(self) -> list[int]:
        """The inputs the body reads (a pooling's window operand is only a shape)."""
        return [k for k in range(self.n_in) if list(self.args[k].uses)]

    def dims_of(self, k: int) -> list[int]:
        return sorted({d for coef, _ in self.lins[k] for d in coef})

    def domain_view(self, k: int, lo: int = 0, hi: int | None = None, cut: int | None = None) -> np.ndarray:
        """Operand `k` over the whole domain (broadcast along the dims it does
        not use), restricted to ``[lo, hi)`` of dim `cut` when given."""
        arr = _array(self.values[k], "linalg.generic")
        dims = self.dims_of(k)
        v = _view(arr, self.lins[k], dims, self.extents)
        if cut is not None and cut in dims:
            idx = [slice(None)] * len(dims)
            idx[dims.index(cut)] = slice(lo, hi)
            v = v[tuple(idx)]
        shape = [1] * self.rank
        for i, d in enumerate(dims):
            shape[d] = v.shape[i]
        return v.reshape(shape)

    def evaluate(self, wanted: list[ir.Value], args: dict, outer: dict, cut=None) -> list:
        """Values `wanted` of the body, block arguments given by `args`, ops
        evaluated in order (only those `wanted` depends on)."""
        need = backward_slice(self.block, wanted)
        local = dict(args)
        for b in self.ops:
            if b.name == "linalg.yield" or b not in need:
                continue
            if b.name == "linalg.index":
                d = ir.IntegerAttr(b.attributes["dim"]).value
                lo, hi = (cut[1], cut[2]) if cut and cut[0] == d else (0, self.extents[d])
                shape = [1] * self.rank
                shape[d] = hi - lo
                local[b.results[0]] = np.arange(lo, hi, dtype=np.int64).reshape(shape)
                continue
            if b.name == "arith.constant":
                local[b.results[0]] = _constant(b, {})
                continue
            if b.name == "tensor.extract":  # a gather: indices computed over the domain
                src = outer.get(b.operands[0])
                if src is None or np.ndim(src) == 0:
                    raise NotInterpretable("tensor.extract in a generic's body from a tensor it has not")
                idx = [_value(v, local, outer) for v in list(b.operands)[1:]]
                local[b.results[0]] = _array(src, "tensor.extract")[tuple(np.broadcast_arrays(*idx))] if idx else src[()]
                continue
            local[b.results[0]] = _elementwise(b, [_value(v, local, outer) for v in b.operands])
        return [_value(v, local, outer) for v in wanted]


def _value(v: ir.Value, local: dict, outer: dict):
    """A value a body reads: its own (`local`), or a scalar from outside it."""
    if v in local:
        return local[v]
    if v in outer and np.ndim(outer[v]) == 0:
        return outer[v]
    raise NotInterpretable("a generic's body reads a value from outside it that is no scalar")


def _generic(op: ir.Operation, env: dict) -> None:
    g = _Generic(op, env)
    yields = next(o for o in g.ops if o.name == "linalg.yield").operands
    results = []
    if all(it.endswith("parallel>") or it == "parallel" for it in g.iters):
        args = {}
        for k, a in enumerate(g.args):
            if list(a.uses):
                args[a] = g.domain_view(k)
        full = g.evaluate(list(yields), args, env)
        for r, y, dims in zip(op.results, full, g.out_dims):
            if sorted(dims) != list(range(g.rank)):
                raise NotInterpretable("a parallel generic whose output map is no permutation")
            y = np.broadcast_to(np.asarray(y, dtype=_compute_dtype(r.type)), g.extents)
            results.append(np.ascontiguousarray(np.transpose(y, dims)))
    else:
        for j, (r, y) in enumerate(zip(op.results, yields)):
            arg = _arg_reduction(g, j, y)
            results.append(_arg_reduce(g, j, r, arg, env) if arg else _reduce(g, j, r, y, env))
    for r, v in zip(op.results, results):
        env[r] = np.reshape(v, ir.RankedTensorType(r.type).shape)  # with the size-1 axes of constant map results


def _reduce(g: _Generic, j: int, result: ir.Value, y: ir.Value, env: dict) -> np.ndarray:
    """Output `j` of a reduction generic whose yield `y` is ``out_j <comb> x``."""
    out_arg = g.args[g.n_in + j]
    comb, x = _combiner(g, y, out_arg)
    outs = set(range(g.n_in, g.n_in + g.n_out))
    if g.depends(x) & outs:
        raise NotInterpretable("a reduction whose value depends on its outputs other than by one combiner")
    dims = g.out_dims[j]
    dt = _compute_dtype(result.type)
    et = _element(result.type)
    init = _array(g.values[g.n_in + j], "a reduction's initial value").reshape([g.extents[d] for d in dims])
    red = _einsum_sum(g, x, dims, env) if comb is np.add else None
    if red is None:
        red = _general_reduce(g, x, dims, comb, env)
    if dt.kind == "f":
        total = comb(init.astype(np.float64), red)
        return np.ascontiguousarray(total.astype(dt))
    if dt.kind == "b":
        return np.ascontiguousarray(comb(init, red).astype(np.bool_))
    return np.ascontiguousarray(_wrap(comb(init.astype(np.int64), red), et))


_MAX_PREDICATES = {"cmpf": {2, 3, 9, 10}, "cmpi": {4, 5, 8, 9}}
"""Predicates of ``a > b`` and ``a >= b`` (ordered or not, signed or not); the
others of `_MIN_PREDICATES` are ``<`` and ``<=``."""
_MIN_PREDICATES = {"cmpf": {4, 5, 11, 12}, "cmpi": {2, 3, 6, 7}}


def _combiner(g: _Generic, y: ir.Value, out_arg: ir.Value):
    """(ufunc, x) where the yield `y` is ``out_arg <op> x``: an associative
    op, or ``select(cmp(u, v), u, v)`` with {u, v} = {out_arg, x} (a max or a
    min as torch-mlir writes max pooling)."""
    ops = g.defining
    op = ops.get(y)
    if op is not None and op.name in _COMBINERS:
        a, b = op.operands
        if out_arg in (a, b) and a != b:
            return _COMBINERS[op.name], b if a == out_arg else a
    if op is not None and op.name == "arith.select":
        cond, p, q = op.operands
        cmp = ops.get(cond)
        if cmp is not None and cmp.name in ("arith.cmpf", "arith.cmpi") and out_arg in (p, q) and p != q:
            u, v = cmp.operands
            pred = ir.IntegerAttr(cmp.attributes["predicate"]).value
            kind = cmp.name.split(".")[1]
            if (u, v) in ((p, q), (q, p)):
                greater = pred in _MAX_PREDICATES[kind]
                if greater or pred in _MIN_PREDICATES[kind]:
                    # select(u > v, u, v) is max; with the operands swapped, min
                    is_max = greater == ((u, v) == (p, q))
                    unsigned = kind == "cmpi" and pred >= 6
                    if not unsigned:
                        return (np.maximum if is_max else np.minimum), (q if p == out_arg else p)
    name = op.name if op is not None else "an argument"
    raise NotInterpretable(f"a reduction whose yield is not out <op> x ({name})")


def _arg_reduction(g: _Generic, k: int, y: ir.Value):
    """(x, compare predicate, output j, index value) where output `k` yields
    ``select(cmpf(x, out_j), index, out_k)``: the position of output j's
    max or min (torch-mlir's argmax); None for any other yield."""
    ops = g.defining
    sel = ops.get(y)
    if sel is None or sel.name != "arith.select" or sel.operands[2] != g.args[g.n_in + k]:
        return None
    cmp = ops.get(sel.operands[0])
    if cmp is None or cmp.name != "arith.cmpf":
        return None
    u, v = cmp.operands
    outs = {a: i - g.n_in for i, a in enumerate(g.args) if i >= g.n_in}
    if v not in outs or outs[v] == k:
        return None
    pred = ir.IntegerAttr(cmp.attributes["predicate"]).value
    return u, pred, outs[v], sel.operands[1]


def _arg_reduce(g: _Generic, k: int, result: ir.Value, arg, env: dict) -> np.ndarray:
    """Output `k`, the index where output j's reduction takes its value
    (the first such position for a strict compare, the last otherwise)."""
    x, pred, j, index = arg
    red = [d for d in range(g.rank) if d not in g.out_dims[k]]
    if len(red) != 1 or g.out_dims[k] != g.out_dims[j]:
        raise NotInterpretable("an arg-reduction over more than one dimension")
    if pred not in (2, 3, 4, 5):  # ogt, oge, olt, ole
        raise NotInterpretable(f"an arg-reduction with compare predicate {pred}")
    r = red[0]
    args = {g.args[i]: g.domain_view(i) for i in g.read_inputs()}
    vals, idx = g.evaluate([x, index], args, env)
    vals = np.broadcast_to(np.asarray(vals, dtype=np.float64), g.extents)
    idx = np.broadcast_to(np.asarray(idx), g.extents)
    strict, larger = pred in (2, 4), pred in (2, 3)
    scores = vals if larger else -vals
    if strict:  # the first extreme position wins
        pos = np.argmax(scores, axis=r)
    else:  # the last one
        pos = g.extents[r] - 1 - np.argmax(np.flip(scores, axis=r), axis=r)
    pos = np.expand_dims(pos, r)
    best = np.squeeze(np.take_along_axis(vals, pos, axis=r), r)
    at = np.squeeze(np.take_along_axis(idx, pos, axis=r), r)
    kept = [d for d in range(g.rank) if d != r]
    perm = [kept.index(d) for d in g.out_dims[k]]
    best, at = np.transpose(best, perm), np.transpose(at, perm)
    shape = [g.extents[d] for d in g.out_dims[k]]
    init_j = _array(g.values[g.n_in + j], "an arg-reduction's initial value").astype(np.float64).reshape(shape)
    init_k = _array(g.values[g.n_in + k], "an arg-reduction's initial value").reshape(shape)
    wins = {2: best > init_j, 3: best >= init_j, 4: best < init_j, 5: best <= init_j}[pred]
    out = np.where(wins, at, init_k)
    dt = _compute_dtype(result.type)
    return np.ascontiguousarray(out.astype(dt) if dt.kind != "i" else _wrap(out, _element(result.type)))


def _factor(g: _Generic, v: ir.Value) -> tuple[int, ir.Value] | None:
    """(operand, value) where `v` is a per-element function of one input
    operand (and of scalar inputs: a quantized op's zero points)."""
    deps = g.depends(v) - set(g.scalar_inputs())
    if len(deps) != 1 or -1 in deps or next(iter(deps)) >= g.n_in:
        return None
    return next(iter(deps)), v


def _einsum_sum(g: _Generic, x: ir.Value, out_dims: list[int], env: dict) -> np.ndarray | None:
    """sum over the reduction dims of ``p * q`` where each factor is a
    per-element function of one input: one einsum (im2col + BLAS for a
    convolution, through ``tensordot``). None where `x` is no such product."""
    mul = g.defining.get(x)
    if mul is None or mul.name not in ("arith.mulf", "arith.muli"):
        return None
    factors = [_factor(g, v) for v in mul.operands]
    if any(f is None for f in factors):
        return None
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    if g.rank > len(letters):
        return None
    views, subs = [], []
    ints = mul.name == "arith.muli"
    bound = 1.0
    for k, v in factors:  # type: ignore[misc]
        base = _array(g.values[k], "linalg.generic")
        given = {g.args[k]: base, **{g.args[i]: _array(g.values[i], "a scalar input").reshape(())
                                     for i in g.scalar_inputs()}}
        (val,) = g.evaluate([v], given, env)
        val = np.asarray(val)
        if val.shape != base.shape:
            val = np.broadcast_to(val, base.shape)
        if ints:
            bound *= float(np.max(np.abs(val))) if val.size else 0.0
        dims = g.dims_of(k)
        views.append(_view(np.ascontiguousarray(val, dtype=np.float64), g.lins[k], dims, g.extents))
        subs.append("".join(letters[d] for d in dims))
    red_dims = [d for d in range(g.rank) if d not in out_dims]
    if ints and bound * math.prod(g.extents[d] for d in red_dims) >= 2.0**53:
        return None  # float64 would not be exact: the general (int64) path
    present = [d for d in out_dims if any(letters[d] in s for s in subs)]
    spec = ",".join(subs) + "->" + "".join(letters[d] for d in present)
    s = np.einsum(spec, *views, optimize=True)
    # a reduction dim no factor indexes adds the same product that many times
    s = s * math.prod(g.extents[d] for d in red_dims if not any(letters[d] in t for t in subs))
    # the output dims the factors do not index repeat the same sum
    shape = [g.extents[d] if d in present else 1 for d in out_dims]
    s = np.broadcast_to(s.reshape(shape), [g.extents[d] for d in out_dims])
    return np.rint(s).astype(np.int64) if ints else s


def _general_reduce(g: _Generic, x: ir.Value, out_dims: list[int], comb, env: dict) -> np.ndarray:
    """`x` evaluated over the domain (in slices of one parallel dim when the
    domain is large) and reduced over the other dims with `comb`'s ufunc,
    floats in float64."""
    red_axes = tuple(d for d in range(g.rank) if d not in out_dims)
    size = math.prod(g.extents)
    par = [d for d in out_dims if g.extents[d] > 1]
    cut = max(par, key=lambda d: g.extents[d]) if size > _CHUNK_ELEMENTS and par else None
    step = 1 if cut is None else max(1, _CHUNK_ELEMENTS * g.extents[cut] // size)
    pieces = []
    total = g.extents[cut] if cut is not None else 1
    for lo in range(0, total, step):
        hi = min(total, lo + step)
        window = (cut, lo, hi) if cut is not None else None
        args = {g.args[k]: g.domain_view(k, lo, hi, cut) for k in g.read_inputs()}
        (val,) = g.evaluate([x], args, env, cut=window)
        val = np.asarray(val)
        if val.dtype.kind == "f":
            val = val.astype(np.float64)
        shape = list(g.extents)
        if cut is not None:
            shape[cut] = hi - lo
        val = np.broadcast_to(val, shape)
        pieces.append(comb.reduce(val, axis=red_axes, keepdims=True) if red_axes else val)
    red = np.concatenate(pieces, axis=cut) if cut is not None else pieces[0]
    red = red.reshape([g.extents[d] for d in range(g.rank) if d not in red_axes])
    kept = [d for d in range(g.rank) if d not in red_axes]  # ascending: the order of `red`'s axes
    return np.transpose(red, [kept.index(d) for d in out_dims])


# --------------------------------------------------------------------------
# Tensor ops and the function
# --------------------------------------------------------------------------


def _static(values: Sequence[int], what: str) -> list[int]:
    out = [int(v) for v in values]
    if any(v < -(2**62) for v in out):
        raise NotInterpretable(f"{what} that is not static")
    return out


def _pad(op: ir.Operation, env: dict) -> None:
    src = _array(env[op.operands[0]], "tensor.pad")
    if len(op.operands) != 1:
        raise NotInterpretable("tensor.pad with dynamic padding")
    low = _static(ir.DenseI64ArrayAttr(op.attributes["static_low"]), "tensor.pad's low padding")
    high = _static(ir.DenseI64ArrayAttr(op.attributes["static_high"]), "tensor.pad's high padding")
    body = op.regions[0].blocks[0]
    (yielded,) = [o for o in body.operations][-1].operands
    inner = {o.operation.results[0]: o.operation for o in body.operations if o.operation.name == "arith.constant"}
    if yielded in inner:
        value = _constant(inner[yielded], {})
    elif yielded in env and np.ndim(env[yielded]) == 0:
        value = env[yielded]
    else:
        raise NotInterpretable("tensor.pad whose padding value depends on the position")
    if any(v < 0 for v in low + high):
        raise NotInterpretable("tensor.pad with negative padding")
    shape = [s + lo + hi for s, lo, hi in zip(src.shape, low, high)]
    out = np.full(shape, value, dtype=src.dtype)
    out[tuple(slice(lo, lo + s) for lo, s in zip(low, src.shape))] = src
    env[op.results[0]] = out


def _slice_index(op: ir.Operation) -> tuple[slice, ...]:
    if len(op.operands) > (2 if op.name == "tensor.insert_slice" else 1):
        raise NotInterpretable(f"{op.name} with dynamic offsets, sizes or strides")
    offsets = _static(ir.DenseI64ArrayAttr(op.attributes["static_offsets"]), f"{op.name}'s offsets")
    sizes = _static(ir.DenseI64ArrayAttr(op.attributes["static_sizes"]), f"{op.name}'s sizes")
    strides = _static(ir.DenseI64ArrayAttr(op.attributes["static_strides"]), f"{op.name}'s strides")
    return tuple(slice(o, o + (n - 1) * s + 1, s) for o, n, s in zip(offsets, sizes, strides))


def _tensor_op(op: ir.Operation, env: dict) -> None:
    name = op.name
    res = op.results[0] if len(op.results) else None
    if name == "tensor.empty":
        if len(op.operands):
            raise NotInterpretable("tensor.empty with dynamic sizes")
        env[res] = _Empty(tuple(ir.RankedTensorType(res.type).shape))
    elif name in ("tensor.expand_shape", "tensor.collapse_shape", "tensor.reshape"):
        shape = tuple(ir.RankedTensorType(res.type).shape)
        env[res] = np.reshape(_array(env[op.operands[0]], name), shape)
    elif name == "tensor.cast":
        env[res] = env[op.operands[0]]
    elif name == "tensor.pad":
        _pad(op, env)
    elif name == "tensor.extract_slice":
        part = _array(env[op.operands[0]], name)[_slice_index(op)]
        env[res] = np.ascontiguousarray(part.reshape(ir.RankedTensorType(res.type).shape))
    elif name == "tensor.insert_slice":
        dest = env[op.operands[1]]
        # the parts of a tensor.empty no slice writes are undefined: zeros here
        dest = np.zeros(dest.shape, _compute_dtype(res.type)) if isinstance(dest, _Empty) else dest.copy()
        idx = _slice_index(op)
        dest[idx] = np.reshape(_array(env[op.operands[0]], name), dest[idx].shape)
        env[res] = dest
    elif name == "tensor.extract":
        idx = tuple(int(env[v]) for v in list(op.operands)[1:])
        env[res] = _array(env[op.operands[0]], name)[idx]
    elif name == "tensor.concat":
        dim = ir.IntegerAttr(op.attributes["dim"]).value
        env[res] = np.concatenate([_array(env[v], name) for v in op.operands], axis=dim)
    else:
        raise NotInterpretable(f"op {name}")


def interpret(
    module: ir.Module, entry: str, args: Sequence[np.ndarray], resources: Mapping[str, str] | None = None
) -> tuple[np.ndarray, ...]:
    """The results of function `entry` of `module` (Linalg on tensors) on
    `args`, computed with numpy; `resources` maps ``dense_resource`` names to
    their hex blobs (`ir.program.resource_blobs` of the module's text).

    Results are float32 for bf16, f16 and f32 results (not rounded to the
    narrow types), float64 for f64, and the integer results in their own
    width. Raises :class:`NotInterpretable` naming what it cannot compute."""
    copy = generalized_copy(module)
    funcs = {
        ir.StringAttr(o.operation.attributes["sym_name"]).value: o.operation
        for o in copy.regions[0].blocks[0].operations if o.operation.name == "func.func"
    }
    if entry not in funcs:
        raise NotInterpretable(f"no function @{entry}")
    with np.errstate(all="ignore"):  # inf and nan as the kernels compute them, without warnings
        return _call(funcs, entry, list(args), resources or {})


def _call(funcs: dict, name: str, args: list, blobs: Mapping[str, str]) -> tuple[np.ndarray, ...]:
    fn = funcs[name]
    if len(fn.regions[0].blocks) != 1:
        raise NotInterpretable(f"@{name} has more than one block")
    block = fn.regions[0].blocks[0]
    if len(block.arguments) != len(args):
        raise NotInterpretable(f"@{name} takes {len(block.arguments)} arguments, given {len(args)}")
    env: dict = {}
    for a, v in zip(block.arguments, args):
        if isinstance(a.type, ir.MemRefType) or str(a.type).startswith("memref"):
            raise NotInterpretable(f"@{name} takes a memref")
        dt = _compute_dtype(a.type)
        env[a] = np.asarray(v).astype(dt) if dt.kind != "i" else _wrap(np.asarray(v).astype(np.int64), _element(a.type))
    for o in block.operations:
        op = o.operation
        if op.name == "func.return":
            return tuple(np.ascontiguousarray(_array(env[v], "func.return")) for v in op.operands)
        try:
            _step(op, env, funcs, blobs)
        except NotInterpretable as e:
            where = location_str(op)
            raise NotInterpretable(f"{where + ': ' if where else ''}{op.name}: {e}") from None
    raise NotInterpretable(f"@{name} has no func.return")


def _step(op: ir.Operation, env: dict, funcs: dict, blobs: Mapping[str, str]) -> None:
    """Evaluate one op of a function body into `env`."""
    name_ = op.name
    if name_ == "arith.constant":
        env[op.results[0]] = _constant(op, blobs)
    elif name_ == "linalg.generic":
        _generic(op, env)
    elif name_.startswith("tensor."):
        _tensor_op(op, env)
    elif name_ == "func.call":
        callee = ir.FlatSymbolRefAttr(op.attributes["callee"]).value
        if callee not in funcs:
            raise NotInterpretable(f"func.call of @{callee}, which has no body here")
        outs = _call(funcs, callee, [env[v] for v in op.operands], blobs)
        for r, v in zip(op.results, outs):
            env[r] = v
    elif name_ == "cf.assert":
        if not np.all(_array(env[op.operands[0]], name_)):
            raise NotInterpretable(f"the assertion fails: {ir.StringAttr(op.attributes['msg']).value}")
    elif name_.startswith(("arith.", "math.")):
        env[op.results[0]] = _elementwise(op, [_array(env[v], name_) for v in op.operands])
    else:
        raise NotInterpretable(f"op {name_}")
