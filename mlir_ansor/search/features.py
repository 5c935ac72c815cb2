"""Features of candidates, read from the scheduled IR, for the cost model.

Roadmap:
  * :func:`extract_features` is the entry point: a sketch and a population
    of knob assignments in, one ``(statements, N_FEATURES)`` array per
    candidate out. :data:`FEATURE_NAMES` names the columns (documented in
    ``docs/features.md``).
  * :class:`FeatureExtractor` (one per sketch, cached by sketch hash) holds
    one :class:`Template` per *structural key*; a template is the IR
    structure of the scheduled program plus a formula for every number in it.
  * :func:`read_program` reads a scheduled module (after the transform
    script, before LLVM) into a :class:`Structure` and named quantities;
    :func:`program_features` turns those into the feature rows. Both paths
    (a template evaluated for a population, or one real module read
    directly) go through the same feature code, so tests can check one
    against the other.

Why templates and not the IR of every candidate: applying the transform
interpreter costs 20-60 ms per candidate, i.e. 15-50 candidates/s, while
evolutionary search scores thousands per batch. But across the candidates of
one sketch the scheduled IR has the same *shape* (the same loops, the same
statements touching the same buffers); only numbers change: trip counts,
steps, vector widths, how many times a body is replicated (register rows,
unroll), allocation shapes, index coefficients. Each of those numbers is a
product of knob values and constants (``1024 / p_d0``, ``p_d0 / r_d0``,
``r_d0 * u_d2``, ``k_d2 x p_d1``). So, once per structural key, the sketch
is applied to a few *probe* assignments (chosen so that no loop has a single
iteration, which canonicalization would fold away and so change the shape);
every named quantity is fitted as ``c * prod(knob ** e)`` with integer
exponents by least squares in log space and verified exactly on every probe.
A population is then evaluated with numpy: ``exp(log K @ E) * c`` gives every
quantity of every candidate at once, and the features are array arithmetic
over the population (tens of thousands of candidates per second, against a
target of 200).

The structural key of an assignment is the value of every knob that changes
the shape rather than a number: ``transform.tune.alternatives`` (packing or
not) and knobs with at most two options (e.g. a convolution window tile of
1 or 3, which moves a loop between tiling levels), and the remainder of a
tile that is not a multiple of its parent tile (6 register rows in a thread
tile of 64 peel 4 rows: `remainder_name`). Degenerate values (a tile
equal to its loop, giving one iteration) are evaluated with the fitted
formulas, which give the right numbers (a trip count of 1, a replication of
1); the features never count loops of one iteration, so a folded loop and a
loop of one iteration look the same.

Probes run in an isolated worker process by default (``isolate=True``,
the measurement pool of `measure/pool.py`): an
MLIR build with assertions can abort the process on a bad schedule, and the
tuner must not die with it. A quantity whose formula cannot be fitted falls
back to the median of its probe values (counted in
``Template.unfitted``); a key whose probes all fail gives zero features.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mlir_ansor.ir.dtypes import element_bytes
from mlir_ansor.search.sketch import Sketch
from mlir_ansor.search.space import Assignment, KnobSpec

# --------------------------------------------------------------------------
# Feature names (the columns of a statement row). docs/features.md lists them.

COMPUTE_CATS = ("fma", "addsub", "mul", "div", "cmp", "math", "int", "select", "shuffle")
"""Op categories counted per statement (see :func:`_category`)."""
MAX_BUFFERS = 5
"""Buffers described per statement (the ones with the most bytes)."""
AI_POINTS = 10
"""Samples of the arithmetic-intensity curve."""
CACHE_LINE = 64

_BUFFER_FEATURES = (
    "is_read",
    "is_write",
    "is_read_write",
    "bytes",
    "unique_bytes",
    "lines",
    "unique_lines",
    "reuse_loop",
    "reuse_serial",
    "reuse_none",
    "reuse_dis_iter",
    "reuse_dis_bytes",
    "reuse_ct",
    "bytes_d_reuse_ct",
    "unique_bytes_d_reuse_ct",
    "lines_d_reuse_ct",
    "unique_lines_d_reuse_ct",
    "stride",
)

FEATURE_NAMES: tuple[str, ...] = (
    *(f"{c}_ops" for c in COMPUTE_CATS),
    "flops",
    "vec_len",
    "vec_bytes",
    "vec_num",
    "vec_prod",
    "unroll_num",
    "unroll_len",
    "innermost_trip",
    "parallel_num",
    "parallel_prod",
    "parallel_len",
    "parallel_pos",
    "inside_parallel",
    "num_loops",
    "outer_prod",
    "outermost_trip",
    "num_buffers",
    "alloc_size",
    "alloc_num",
    "alloc_prod",
    "writes_alloc",
    "program_alloc_size",
    "linalg_ops",
    *(f"buf{b}_{n}" for b in range(MAX_BUFFERS) for n in _BUFFER_FEATURES),
    *(f"ai_curve_{i}" for i in range(AI_POINTS)),
)
"""Column names of a statement row, in order."""
N_FEATURES = len(FEATURE_NAMES)
_COL = {n: i for i, n in enumerate(FEATURE_NAMES)}


# --------------------------------------------------------------------------
# The structure of a scheduled program (knob-independent) and its quantities.


@dataclass(frozen=True)
class Axis:
    """One loop dimension: an `scf.for`, or one dimension of an `scf.forall`.

    Quantity ``{id}.trip`` is its trip count."""

    id: str
    kind: str  # "for" | "forall"
    parent: str | None  # enclosing axis (None: the function body)


@dataclass(frozen=True)
class Access:
    """How one statement touches one buffer.

    Quantities: ``{q}.n`` access ops per body iteration, ``{q}.el`` elements
    per body iteration, ``{q}.span{j}`` elements of dim j one body iteration
    covers, ``{q}.c{j}.{axis}`` the change of the dim-j index per iteration
    of `axis` (index coefficient times step), for the pairs in `coeffs`.
    """

    q: str  # quantity prefix
    buf: str  # "arg<i>" or "alloc<k>"
    elsize: int
    rank: int
    read: bool
    write: bool
    coeffs: tuple[tuple[int, str], ...]  # (dim, axis) pairs with a non-zero coefficient


@dataclass(frozen=True)
class Statement:
    """The non-loop ops directly in one loop body (or the function body)
    that compute or store. Quantities ``{id}.<cat>.n`` / ``{id}.<cat>.lanes``
    per category present, ``{id}.vw`` (widest compute vector), ``{id}.rep``
    (replication: most ops of one compute kind, or stores), ``{id}.linalg``
    (elements of leftover Linalg ops)."""

    id: str
    axes: tuple[str, ...]  # enclosing axes, outermost first
    cats: tuple[str, ...]
    accesses: tuple[Access, ...]
    linalg: bool = False


@dataclass(frozen=True)
class Alloc:
    """A `memref.alloc`/`alloca`: quantities ``shape.{buf}.{j}``."""

    buf: str
    axes: tuple[str, ...]
    rank: int
    elsize: int


@dataclass(frozen=True)
class Structure:
    """The knob-independent shape of a scheduled program."""

    axes: tuple[Axis, ...]
    statements: tuple[Statement, ...]
    allocs: tuple[Alloc, ...]
    buffers: tuple[tuple[str, int], ...]  # (buffer, rank): quantities shape.{buf}.{j}



_FLOAT_OPS = {
    "vector.fma": "fma",
    "math.fma": "fma",
    "vector.outerproduct": "fma",
    "arith.addf": "addsub",
    "arith.subf": "addsub",
    "arith.mulf": "mul",
    "arith.divf": "div",
    "arith.remf": "div",
    "arith.cmpf": "cmp",
    "arith.maximumf": "cmp",
    "arith.minimumf": "cmp",
    "arith.maxnumf": "cmp",
    "arith.minnumf": "cmp",
    "arith.negf": "addsub",
    "arith.select": "select",
}
_SHUFFLE_OPS = {
    "vector.broadcast",
    "vector.extract",
    "vector.insert",
    "vector.shuffle",
    "vector.to_elements",
    "vector.from_elements",
    "vector.shape_cast",
    "vector.extract_strided_slice",
    "vector.insert_strided_slice",
    "vector.splat",
    "vector.transpose",
    "vector.extractelement",
    "vector.insertelement",
}
_INT_PREFIXES = ("arith.addi", "arith.subi", "arith.muli", "arith.divsi", "arith.divui", "arith.remsi",
                 "arith.remui", "arith.floordivsi", "arith.ceildivsi", "arith.index_cast", "arith.cmpi",
                 "arith.andi", "arith.ori", "arith.xori", "arith.shli", "arith.shrsi", "arith.shrui",
                 "affine.apply", "arith.maxsi", "arith.minsi", "arith.maxui", "arith.minui")
_VIEW_OPS = {"memref.subview", "memref.cast", "memref.reinterpret_cast", "memref.expand_shape",
             "memref.collapse_shape", "memref.assume_alignment"}


def _category(name: str) -> str | None:
    if name in _FLOAT_OPS:
        return _FLOAT_OPS[name]
    if name.startswith("math."):
        return "math"
    if name in _SHUFFLE_OPS:
        return "shuffle"
    if name in _INT_PREFIXES:
        return "int"
    return None


# --------------------------------------------------------------------------
# Reading one scheduled module.


class _Reader:
    """Walks a scheduled module once; fills `values` (name -> number) and
    the structure lists."""

    def __init__(self) -> None:
        from mlir import ir

        self.ir = ir
        self.values: dict[str, float] = {}
        self.axes: list[Axis] = []
        self.statements: list[Statement] = []
        self.allocs: list[Alloc] = []
        self.buffers: dict[str, int] = {}
        self.iv: dict = {}  # Value -> (axis id, step, lb)
        self.roots: dict = {}  # alloc result Value -> buffer name
        self.lin_cache: dict = {}

    # -- linear index expressions: {axis: coeff per iteration, "": const}
    def _const(self, v) -> int | None:
        ir = self.ir
        if isinstance(v, ir.OpResult) and v.owner.name == "arith.constant":
            try:
                return int(ir.IntegerAttr(v.owner.attributes["value"]).value)
            except (ValueError, TypeError):
                return None
        return None

    def _lin(self, v) -> dict | None:
        if v in self.lin_cache:
            return self.lin_cache[v]
        r = self._lin_uncached(v)
        self.lin_cache[v] = r
        return r

    def _lin_uncached(self, v) -> dict | None:
        ir = self.ir
        if v in self.iv:
            ax, step, lb = self.iv[v]
            return {ax: step, "": lb}
        c = self._const(v)
        if c is not None:
            return {"": c}
        if not isinstance(v, ir.OpResult):
            return None
        op = v.owner
        name = op.name
        if name == "affine.apply":
            amap = ir.AffineMapAttr(op.attributes["map"]).value
            args = [self._lin(o) for o in op.operands]
            return self._affine(amap.results[0], args, amap.n_dims)
        if name in ("arith.addi", "arith.subi", "arith.muli"):
            a, b = self._lin(op.operands[0]), self._lin(op.operands[1])
            if a is None or b is None:
                return None
            if name == "arith.addi":
                return _ladd(a, b, 1)
            if name == "arith.subi":
                return _ladd(a, b, -1)
            if set(a) == {""}:
                return _lscale(b, a[""])
            if set(b) == {""}:
                return _lscale(a, b[""])
        return None

    def _affine(self, e, args: list, n_dims: int) -> dict | None:
        ir = self.ir
        if isinstance(e, ir.AffineConstantExpr):
            return {"": e.value}
        if isinstance(e, ir.AffineDimExpr):
            return args[e.position]
        if isinstance(e, ir.AffineSymbolExpr):
            return args[n_dims + e.position]
        if isinstance(e, ir.AffineAddExpr):
            a, b = self._affine(e.lhs, args, n_dims), self._affine(e.rhs, args, n_dims)
            return None if a is None or b is None else _ladd(a, b, 1)
        if isinstance(e, ir.AffineMulExpr):
            a, b = self._affine(e.lhs, args, n_dims), self._affine(e.rhs, args, n_dims)
            if a is None or b is None:
                return None
            if set(b) == {""}:
                return _lscale(a, b[""])
            if set(a) == {""}:
                return _lscale(b, a[""])
        return None

    # -- buffers
    def _root(self, v) -> tuple[str, list | None] | None:
        """The buffer a memref value views, and per dim the linear offset of
        the view (None when the view is not a plain offset)."""
        ir = self.ir
        offsets: list | None = None
        while True:
            if v in self.roots:
                return self.roots[v], offsets
            if isinstance(v, ir.BlockArgument):
                owner = v.owner.owner
                if owner is not None and owner.operation.name == "func.func":
                    name = f"arg{v.arg_number}"
                    self.buffers.setdefault(name, _rank(v.type))
                    self.roots[v] = name
                    for j, s in enumerate(_shape(v.type)):
                        self.values[f"shape.{name}.{j}"] = s
                    return name, offsets
                return None
            op = v.owner
            if op.name not in _VIEW_OPS:
                return None
            if op.name == "memref.subview" and offsets is None:
                offsets = self._subview_offsets(op)
            elif op.name != "memref.cast":
                offsets = [None] * 16
            v = op.operands[0]

    def _subview_offsets(self, op) -> list | None:
        ir = self.ir
        static = list(ir.DenseI64ArrayAttr(op.attributes["static_offsets"]))
        dyn = list(op.operands)[1:]
        out: list = []
        k = 0
        for s in static:
            if s == ir.ShapedType.get_dynamic_stride_or_offset():
                out.append(self._lin(dyn[k]) if k < len(dyn) else None)
                k += 1
            else:
                out.append({"": s})
        return out

    # -- the walk
    def read(self, module) -> None:
        func = None
        for op in module.body.operations:
            if op.operation.name == "func.func":
                func = op
                break
        if func is None:
            raise ValueError("no func.func in the scheduled module")
        self._body(func.regions[0].blocks[0], (), None)

    def _new_axis(self, kind: str, parent: str | None, trip: int) -> str:
        ax = f"L{len(self.axes)}"
        self.axes.append(Axis(ax, kind, parent))
        self.values[f"{ax}.trip"] = max(1, trip)
        return ax

    def _body(self, block, axes: tuple[str, ...], parent: str | None) -> None:
        ir = self.ir
        ops: list = []
        nested: list = []
        self._collect(block, ops, nested)
        self._statement(ops, axes)
        for op in nested:
            if op.name == "scf.for":
                lb, ub, step = (self._const(o) for o in op.operands[:3])
                if None in (lb, ub, step) or step == 0:
                    lb, ub, step = 0, 1, 1
                trip = -(-(ub - lb) // step)
                ax = self._new_axis("for", parent, trip)
                body = op.regions[0].blocks[0]
                self.iv[body.arguments[0]] = (ax, step, lb)
                self._body(body, axes + (ax,), ax)
            elif op.name == "scf.forall":
                ubs = list(ir.DenseI64ArrayAttr(op.attributes["staticUpperBound"]))
                lbs = list(ir.DenseI64ArrayAttr(op.attributes["staticLowerBound"]))
                steps = list(ir.DenseI64ArrayAttr(op.attributes["staticStep"]))
                body = op.regions[0].blocks[0]
                new = list(axes)
                par = parent
                for i, (lb, ub, st) in enumerate(zip(lbs, ubs, steps)):
                    if min(lb, ub, st) < 0:  # dynamic bound
                        lb, ub, st = 0, 1, 1
                    ax = self._new_axis("forall", par, -(-(ub - lb) // st))
                    self.iv[body.arguments[i]] = (ax, st, lb)
                    new.append(ax)
                    par = ax
                self._body(body, tuple(new), par)

    def _collect(self, block, ops: list, nested: list) -> None:
        for op in block.operations:
            o = op.operation
            if o.name in ("scf.for", "scf.forall"):
                nested.append(o)
                continue
            ops.append(o)
            if o.name.startswith("linalg."):
                continue  # its region is its scalar body, read in _statement
            for region in o.regions:
                for b in region.blocks:
                    self._collect(b, ops, nested)

    def _statement(self, ops: list, axes: tuple[str, ...]) -> None:
        ir = self.ir
        sid = f"S{len(self.statements)}"
        counts: dict[str, list[int]] = {}
        acc: dict[str, dict] = {}
        stores = 0
        linalg_elems = 0
        vw = 0
        mem_vw = 0
        for o in ops:
            name = o.name
            if name in ("memref.alloc", "memref.alloca"):
                buf = f"alloc{len(self.allocs)}"
                self.roots[o.results[0]] = buf
                t = o.results[0].type
                self.buffers[buf] = _rank(t)
                for j, s in enumerate(_shape(t)):
                    self.values[f"shape.{buf}.{j}"] = s
                self.allocs.append(Alloc(buf, axes, _rank(t), _elsize(t)))
                continue
            if name.startswith("linalg.") and name != "linalg.yield":
                linalg_elems += self._linalg(o, acc)
                continue
            mem = _memory_operands(name, o)
            if mem is not None:
                base, idx, lanes_t, write = mem
                lanes = _lanes(lanes_t) if lanes_t is not None else 1
                vshape = list(ir.VectorType(lanes_t).shape) if lanes_t is not None else []
                mem_vw = max(mem_vw, lanes)
                stores += int(write)
                self._access(acc, base, idx, lanes, vshape, write)
                continue
            cat = _category(name)
            if cat is None:
                continue
            lanes = _lanes(o.results[0].type) if len(o.results) and _is_vector(o.results[0].type) else 1
            if name == "vector.outerproduct":
                lanes = _lanes(o.results[0].type)
            c = counts.setdefault(cat, [0, 0])
            c[0] += 1
            c[1] += lanes
            if cat in ("fma", "addsub", "mul", "div", "cmp", "math"):
                vw = max(vw, lanes)
        if not (stores or linalg_elems or any(k in counts for k in ("fma", "addsub", "mul", "div", "math"))):
            return
        cats = tuple(sorted(counts))
        for cat, (n, lanes) in counts.items():
            self.values[f"{sid}.{cat}.n"] = n
            self.values[f"{sid}.{cat}.lanes"] = lanes
        self.values[f"{sid}.vw"] = max(1, vw or mem_vw)
        compute = [counts[c][0] for c in ("fma", "addsub", "mul", "div", "cmp", "math") if c in counts]
        self.values[f"{sid}.rep"] = max(1, max(compute) if compute else stores)
        if linalg_elems:
            self.values[f"{sid}.linalg"] = linalg_elems
        accesses = []
        for buf, a in sorted(acc.items()):
            q = f"{sid}.{buf}"
            self.values[f"{q}.n"] = a["n"]
            self.values[f"{q}.el"] = a["el"]
            for j, (lo, hi) in enumerate(a["span"]):
                self.values[f"{q}.span{j}"] = max(1, hi - lo + 1)
            coeffs = []
            for (j, ax), c in sorted(a["coef"].items()):
                if c != 0:
                    self.values[f"{q}.c{j}.{ax}"] = abs(c)
                    coeffs.append((j, ax))
            accesses.append(Access(q, buf, a["elsize"], a["rank"], a["read"], a["write"], tuple(coeffs)))
        self.statements.append(Statement(sid, axes, cats, tuple(accesses), linalg=bool(linalg_elems)))

    def _access(self, acc: dict, base, idx: list, lanes: int, vshape: list, write: bool, *,
                extent: list | None = None, read: bool | None = None) -> None:
        root = self._root(base)
        if root is None:
            return
        buf, offs = root
        rank = self.buffers[buf]
        a = acc.setdefault(buf, {"n": 0, "el": 0, "span": None, "coef": {}, "read": False, "write": False,
                                 "elsize": _elsize(base.type), "rank": rank})
        a["n"] += 1
        a["el"] += lanes
        if write:
            a["write"] = True
        if read if read is not None else not write:
            a["read"] = True
        lins = [self._lin(i) for i in idx]
        if offs is not None and len(offs) >= len(lins):
            lins = [None if (x is None or o is None) else _ladd(x, o, 1) for x, o in zip(lins, offs)]
        lins = (lins + [None] * rank)[:rank]
        ext = extent or [1] * rank
        for k, s in enumerate(reversed(vshape)):
            j = rank - 1 - k
            if j >= 0:
                ext[j] = max(ext[j], s)
        span = a["span"] or [(math.inf, -math.inf)] * rank
        for j, lin in enumerate(lins):
            const = lin.get("", 0) if lin else 0
            lo, hi = span[j]
            span[j] = (min(lo, const), max(hi, const + ext[j] - 1))
            for ax, c in (lin or {}).items():
                if ax:
                    a["coef"][(j, ax)] = c
        a["span"] = span

    def _linalg(self, o, acc: dict) -> int:
        """A Linalg op left in the program (default sketch): its operands are
        whole views; returns the elements of its largest operand."""
        ir = self.ir
        biggest = 1
        n_in = len(o.operands) - len(o.results) if o.results else None
        if "operandSegmentSizes" in o.attributes:
            n_in = int(ir.DenseI32ArrayAttr(o.attributes["operandSegmentSizes"])[0])
        for i, v in enumerate(o.operands):
            if not isinstance(v.type, ir.MemRefType):
                continue
            shape = _shape(v.type)
            n = math.prod(shape)
            biggest = max(biggest, n)
            is_out = n_in is not None and i >= n_in
            self._access(acc, v, [None] * len(shape), n, [], is_out, extent=list(shape), read=True)
        return biggest


def _ladd(a: dict, b: dict, sign: int) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + sign * v
    return out


def _lscale(a: dict, s: int) -> dict:
    return {k: v * s for k, v in a.items()}


def _rank(t) -> int:
    from mlir import ir

    return ir.ShapedType(t).rank


def _shape(t) -> list[int]:
    from mlir import ir

    return [max(1, int(s)) for s in ir.ShapedType(t).shape]


def _elsize(t) -> int:
    from mlir import ir

    return element_bytes(str(ir.ShapedType(t).element_type))


def _is_vector(t) -> bool:
    from mlir import ir

    return isinstance(t, ir.VectorType)


def _lanes(t) -> int:
    from mlir import ir

    return math.prod(ir.VectorType(t).shape) if isinstance(t, ir.VectorType) else 1


def _memory_operands(name: str, o):
    """(base, indices, vector type or None, is_write) of a load/store op."""
    ops = list(o.operands)
    if name in ("vector.load", "vector.maskedload", "vector.transfer_read"):
        rank = _rank(ops[0].type)
        return ops[0], ops[1 : 1 + rank], o.results[0].type, False
    if name in ("vector.store", "vector.maskedstore", "vector.transfer_write"):
        rank = _rank(ops[1].type)
        return ops[1], ops[2 : 2 + rank], ops[0].type, True
    if name == "memref.load":
        return ops[0], ops[1:], None, False
    if name == "memref.store":
        return ops[1], ops[2:], None, True
    return None


def read_program(module) -> tuple[Structure, dict[str, float]]:
    """Read a scheduled module (in the current MLIR context) into its
    structure and its named quantities."""
    r = _Reader()
    r.read(module)
    st = Structure(tuple(r.axes), tuple(r.statements), tuple(r.allocs), tuple(sorted(r.buffers.items())))
    return st, r.values


# --------------------------------------------------------------------------
# Features from a structure and quantities (arrays over a population).


def _log(x: np.ndarray) -> np.ndarray:
    return np.log2(1.0 + np.maximum(x, 0.0))


def program_features(st: Structure, q: dict[str, np.ndarray], n: int) -> np.ndarray:
    """Feature rows of `n` programs that share structure `st`; `q` maps each
    quantity name to an array of shape (n,). Returns (n, statements, F)."""
    one = np.ones(n)
    get = lambda name, default=0.0: q.get(name, default * one)  # noqa: E731
    trips = {ax.id: np.maximum(get(f"{ax.id}.trip", 1.0), 1.0) for ax in st.axes}
    kinds = {ax.id: ax.kind for ax in st.axes}
    shapes = {b: [get(f"shape.{b}.{j}", 1.0) for j in range(r)] for b, r in st.buffers}
    elsizes = {a.buf: a.elsize for a in st.allocs}
    alloc_bytes = {}
    for a in st.allocs:
        sz = np.prod(np.stack(shapes[a.buf]), axis=0) * a.elsize if a.rank else a.elsize * one
        alloc_bytes[a.buf] = sz
    program_alloc = sum(alloc_bytes.values(), 0 * one)
    out = np.zeros((n, max(1, len(st.statements)), N_FEATURES))
    for si, s in enumerate(st.statements):
        f = out[:, si, :]
        axes = s.axes
        tr = [trips[a] for a in axes]
        iters = np.prod(np.stack(tr), axis=0) if tr else one
        flops_iter = 0 * one
        for cat in COMPUTE_CATS:
            if cat in s.cats:
                lanes = get(f"{s.id}.{cat}.lanes")
                f[:, _COL[f"{cat}_ops"]] = _log(lanes * iters)
                if cat in ("fma",):
                    flops_iter = flops_iter + 2 * lanes
                elif cat in ("addsub", "mul", "div", "math"):
                    flops_iter = flops_iter + lanes
        if s.linalg:
            flops_iter = flops_iter + get(f"{s.id}.linalg")
            f[:, _COL["linalg_ops"]] = _log(get(f"{s.id}.linalg") * iters)
        f[:, _COL["flops"]] = _log(flops_iter * iters)
        vw = get(f"{s.id}.vw", 1.0)
        elsize = max((a.elsize for a in s.accesses), default=4)
        f[:, _COL["vec_len"]] = vw
        f[:, _COL["vec_bytes"]] = vw * elsize
        vec_ops = sum((get(f"{s.id}.{c}.n") for c in s.cats if c in ("fma", "addsub", "mul", "div", "cmp", "math")), 0 * one)
        f[:, _COL["vec_num"]] = _log(np.where(vw > 1, vec_ops, 0))
        f[:, _COL["vec_prod"]] = _log(np.where(vw > 1, vec_ops * vw * iters, 0))
        rep = get(f"{s.id}.rep", 1.0)
        f[:, _COL["unroll_num"]] = rep
        inner = tr[-1] if tr else one
        f[:, _COL["unroll_len"]] = _log(rep * inner)
        f[:, _COL["innermost_trip"]] = _log(inner)
        # Parallel (scf.forall) dimensions and where they sit.
        live = [t > 1 for t in tr]
        n_live = sum(live, 0 * one)
        par = [i for i, a in enumerate(axes) if kinds[a] == "forall"]
        pprod = np.prod(np.stack([tr[i] for i in par]), axis=0) if par else one
        f[:, _COL["parallel_num"]] = sum((live[i] for i in par), 0 * one)
        f[:, _COL["parallel_prod"]] = _log(pprod)
        f[:, _COL["parallel_len"]] = _log(tr[par[-1]]) if par else 0
        if par:
            before = sum((live[i] for i in range(par[0])), 0 * one)
            f[:, _COL["parallel_pos"]] = before / np.maximum(n_live, 1)
            f[:, _COL["inside_parallel"]] = (pprod > 1).astype(float)
        f[:, _COL["num_loops"]] = n_live
        f[:, _COL["outer_prod"]] = _log(iters)
        outermost = 0 * one
        for t in reversed(tr):  # the outermost loop of more than one iteration
            outermost = np.where(t > 1, t, outermost)
        f[:, _COL["outermost_trip"]] = _log(outermost)
        # Allocations in scope: those made in a body that encloses this one.
        in_scope = [a for a in st.allocs if a.axes == axes[: len(a.axes)]]
        if in_scope:
            f[:, _COL["alloc_size"]] = _log(sum((alloc_bytes[a.buf] for a in in_scope), 0 * one))
            f[:, _COL["alloc_num"]] = len(in_scope)
            times = [np.prod(np.stack([trips[x] for x in a.axes]), axis=0) if a.axes else one for a in in_scope]
            f[:, _COL["alloc_prod"]] = _log(sum(times, 0 * one))
        f[:, _COL["writes_alloc"]] = float(any(a.write and a.buf in elsizes for a in s.accesses))
        f[:, _COL["program_alloc_size"]] = _log(program_alloc)
        f[:, _COL["num_buffers"]] = len(s.accesses)
        # Buffers: footprints at every loop level (innermost first).
        levels = len(axes) + 1
        per_buf = []
        total_unique = [0 * one for _ in range(levels)]
        for a in s.accesses:
            rank = a.rank
            shape = shapes.get(a.buf, [one] * rank)
            coef = {(j, ax): get(f"{a.q}.c{j}.{ax}") for j, ax in a.coeffs}
            spans = [get(f"{a.q}.span{j}", 1.0) for j in range(rank)]
            uniq = []  # unique elements at level L (loops L.. inside), L = len(axes) .. 0
            lines_l = []
            cur = list(spans)
            for lvl in range(len(axes), -1, -1):
                if lvl < len(axes):
                    ax = axes[lvl]
                    for j in range(rank):
                        if (j, ax) in coef:
                            cur[j] = cur[j] + coef[(j, ax)] * (trips[ax] - 1)
                capped = [np.minimum(c, s_) for c, s_ in zip(cur, shape)] if rank else []
                u = np.prod(np.stack(capped), axis=0) if rank else one
                ln = (np.prod(np.stack(capped[:-1]), axis=0) if rank > 1 else one) * np.ceil(
                    (capped[-1] if rank else one) * a.elsize / CACHE_LINE
                )
                uniq.append(u)
                lines_l.append(ln)
            for li in range(levels):
                total_unique[li] = total_unique[li] + uniq[li] * a.elsize
            nacc = get(f"{a.q}.n", 1.0)
            el = get(f"{a.q}.el", 1.0)
            bytes_ = el * a.elsize * iters
            avg = el / np.maximum(nacc, 1)
            lines = nacc * iters * np.maximum(1, np.ceil(avg * a.elsize / CACHE_LINE))
            ub, ul = uniq[-1] * a.elsize, lines_l[-1]
            # Reuse: the innermost loop (of more than one iteration) whose
            # index does not move this buffer.
            found = np.zeros(n, bool)
            dis_iter = 0 * one
            dis_bytes = 0 * one
            reuse_ct = 0 * one
            inner_iters = one.copy()
            for k in range(len(axes) - 1, -1, -1):
                ax = axes[k]
                moves = any(c_ax == ax for _, c_ax in a.coeffs)
                hit = (~found) & (trips[ax] > 1) & (not moves)
                lvl_index = len(axes) - 1 - k  # uniq index of the level inside ax
                dis_iter = np.where(hit, inner_iters, dis_iter)
                dis_bytes = np.where(hit, uniq[lvl_index] * a.elsize, dis_bytes)
                reuse_ct = np.where(hit, trips[ax], reuse_ct)
                found |= hit
                inner_iters = inner_iters * trips[ax]
            serial = (~found) & a.read & a.write
            stride = 0 * one
            got = np.zeros(n, bool)
            row = [np.prod(np.stack(shape[j + 1 :]), axis=0) if j + 1 < rank else one for j in range(rank)]
            for k in range(len(axes) - 1, -1, -1):
                ax = axes[k]
                s_ = sum((coef[(j, ax)] * row[j] for j in range(rank) if (j, ax) in coef), 0 * one)
                hit = (~got) & (trips[ax] > 1) & (s_ > 0)
                stride = np.where(hit, s_, stride)
                got |= hit
            ct = np.maximum(reuse_ct, 1)
            vals = {
                "is_read": float(a.read and not a.write) * one,
                "is_write": float(a.write and not a.read) * one,
                "is_read_write": float(a.read and a.write) * one,
                "bytes": _log(bytes_),
                "unique_bytes": _log(ub),
                "lines": _log(lines),
                "unique_lines": _log(ul),
                "reuse_loop": found.astype(float),
                "reuse_serial": serial.astype(float),
                "reuse_none": (~found & ~serial).astype(float),
                "reuse_dis_iter": _log(dis_iter),
                "reuse_dis_bytes": _log(dis_bytes),
                "reuse_ct": _log(reuse_ct),
                "bytes_d_reuse_ct": _log(bytes_ / ct),
                "unique_bytes_d_reuse_ct": _log(ub / ct),
                "lines_d_reuse_ct": _log(lines / ct),
                "unique_lines_d_reuse_ct": _log(ul / ct),
                "stride": _log(stride),
            }
            per_buf.append((bytes_, vals))
        if per_buf:
            order_key = np.stack([b for b, _ in per_buf], axis=1)  # (n, B)
            order = np.argsort(-order_key, axis=1, kind="stable")[:, :MAX_BUFFERS]
            for name in _BUFFER_FEATURES:
                mat = np.stack([v[name] for _, v in per_buf], axis=1)
                picked = np.take_along_axis(mat, order, axis=1)
                for b in range(picked.shape[1]):
                    f[:, _COL[f"buf{b}_{name}"]] = picked[:, b]
        # Arithmetic intensity at each level, sampled at AI_POINTS points
        # evenly spaced over log2(flops).
        fl = []
        acc_it = one.copy()
        for li in range(levels):
            if li > 0:
                acc_it = acc_it * trips[axes[len(axes) - li]]
            fl.append(flops_iter * acc_it)
        xs = np.stack([_log(x) for x in fl], axis=1)  # (n, levels), non-decreasing
        ys = np.stack([fl[li] / np.maximum(total_unique[li], 1) for li in range(levels)], axis=1)
        f[:, _COL["ai_curve_0"] : _COL["ai_curve_0"] + AI_POINTS] = _sample_curve(xs, ys, AI_POINTS)
    return out


def _sample_curve(xs: np.ndarray, ys: np.ndarray, k: int) -> np.ndarray:
    """Piecewise-linear y(x) per row, sampled at k points evenly spaced over
    (0, max x]; y before the first point is the first y."""
    n, m = xs.shape
    pts = xs[:, -1:] * (np.arange(1, k + 1) / k)[None, :]  # (n, k)
    out = np.repeat(ys[:, :1], k, axis=1)
    for i in range(1, m):
        x0, x1 = xs[:, i - 1 : i], xs[:, i : i + 1]
        y0, y1 = ys[:, i - 1 : i], ys[:, i : i + 1]
        w = np.clip((pts - x0) / np.maximum(x1 - x0, 1e-9), 0.0, 1.0)
        seg = y0 + w * (y1 - y0)
        out = np.where(pts > x0, seg, out)
    return out


# --------------------------------------------------------------------------
# Templates: one structure, a formula per quantity.


@dataclass
class Template:
    """The structure of one structural key and a fitted formula per quantity:
    value = const * prod(knob ** exponent) over the `knobs` columns."""

    structure: Structure | None
    knobs: tuple[str, ...]
    names: tuple[str, ...]
    consts: np.ndarray  # (Q,)
    exponents: np.ndarray  # (len(knobs), Q)
    unfitted: tuple[str, ...] = ()
    probes: int = 0
    linear: dict = field(default_factory=dict)  # name -> weights over _basis() columns
    pairs: bool = False  # whether the basis has the pairwise products

    def quantities(self, values: np.ndarray) -> dict[str, np.ndarray]:
        """Every quantity for a population; `values` is (n, len(knobs))."""
        values = values.astype(float)
        logk = np.log(np.maximum(values, 1e-12))
        vals = np.rint(np.exp(logk @ self.exponents) * self.consts[None, :] * 1e6) / 1e6
        out = {name: vals[:, i] for i, name in enumerate(self.names)}
        if self.linear:
            basis = _basis(values, self.pairs)
            for name, w in self.linear.items():
                out[name] = np.rint(basis @ w * 1e6) / 1e6
        return out


def _basis(values: np.ndarray, pairs: bool) -> np.ndarray:
    """Columns 1, k_i (and k_i * k_j, i <= j, with `pairs`) of a (n, knobs)
    matrix: the terms of a quantity that is a sum of monomials (index
    arithmetic, shuffles)."""
    n, m = values.shape
    cols = [np.ones(n)] + [values[:, i] for i in range(m)]
    if pairs:
        cols += [values[:, i] * values[:, j] for i in range(m) for j in range(i, m)]
    return np.stack(cols, axis=1)


def structural_knobs(knobs: Sequence[KnobSpec]) -> tuple[str, ...]:
    """Knobs whose value changes the shape of the scheduled IR (see the
    module docstring)."""
    return tuple(k.name for k in knobs if k.alternatives or len(k.options) <= 2)


def remainder_name(knob: KnobSpec) -> str:
    """The structural-key entry of a knob whose value need not be a multiple
    of its ``multiple_of`` parent (6 register rows in a thread tile of 64:
    the rest, 4 rows, is peeled): the remainder, which changes the shape of
    the scheduled IR (a peeled loop, with that many rows)."""
    return f"{knob.name}%{knob.multiple_of}"


def probe_assignments(knobs: Sequence[KnobSpec], key: dict[str, int], rng: random.Random, n: int) -> list[Assignment]:
    """Distinct assignments for fitting, in which no loop has one iteration
    (canonicalization would fold it away and change the shape): structural
    knobs fixed to `key`; a knob that is a multiple of another never equals
    it (the loop between them would have one iteration); a knob whose
    options are the divisors of a loop extent never takes the whole extent.
    Assignments that cannot meet this are drawn again; when none can, the
    rules are dropped."""
    out: list[Assignment] = []
    seen: set[Assignment] = set()
    for attempt in range(200 * n):
        strict = attempt < 100 * n
        chosen: dict[str, int] = {}
        ok = True
        for k in knobs:
            if k.name in key:
                chosen[k.name] = key[k.name]
                continue
            cands = list(k.allowed(chosen))
            if k.multiple_of is not None and k.multiple_of in chosen:
                # The remainder the key names (none when it names none).
                base, rem = chosen[k.multiple_of], key.get(remainder_name(k), 0)
                cands = [v for v in cands if base and v % base == rem]
                if strict:
                    # Not one tile (a loop of one iteration); with a peeled
                    # rest, two full tiles before it.
                    cands = [v for v in cands if v != base and (not rem or v >= 2 * base)]
            if strict:
                top = max(k.options)
                if len(k.options) > 2 and all(top % o == 0 for o in k.options) and 1 in k.options:
                    cands = [v for v in cands if v != top]
            if not cands:
                ok = False
                break
            chosen[k.name] = rng.choice(cands)
        if not ok:
            continue
        a = tuple(sorted(chosen.items()))
        if a not in seen:
            seen.add(a)
            out.append(a)
        if len(out) >= n:
            break
    return out


def _probe_worker(payload: str, script: str, assignments: list[Assignment]) -> list:
    """Apply the sketch to each assignment; returns, per assignment, its
    (structure, quantities) or None when the schedule failed."""
    from mlir import ir

    from mlir_ansor.schedule.apply import BuildError, apply_schedule
    from mlir_ansor.search.sketch import select_knobs

    out = []
    for a in assignments:
        try:
            with ir.Context(), ir.Location.unknown():
                module = apply_schedule(payload, select_knobs(script, dict(a)))
                out.append(read_program(module))
        except (BuildError, ValueError, ir.MLIRError):
            out.append(None)
    return out


def fit_template(knobs: Sequence[KnobSpec], probes: list[Assignment], read: list) -> Template:
    """Fit every quantity from the probes that share the most common structure."""
    groups: dict = {}
    for a, r in zip(probes, read):
        if r is None:
            continue
        st, vals = r
        sig = (st, tuple(sorted(vals)))
        groups.setdefault(sig, []).append((a, vals))
    numeric = tuple(k.name for k in knobs if not k.alternatives)
    if not groups:
        return Template(None, numeric, (), np.zeros(0), np.zeros((len(numeric), 0)), probes=0)
    (st, names), members = max(groups.items(), key=lambda kv: len(kv[1]))
    kmat = np.array([[dict(a)[k] for k in numeric] for a, _ in members], dtype=float)
    logk = np.log(np.maximum(kmat, 1e-12))
    varying = [i for i in range(len(numeric)) if np.ptp(logk[:, i]) > 0]
    x = np.hstack([np.ones((len(members), 1)), logk[:, varying]])
    vals = np.array([[v[name] for name in names] for _, v in members], dtype=float)  # (P, Q)
    consts = np.zeros(len(names))
    expo = np.zeros((len(numeric), len(names)))
    unfitted = []
    linear = {}
    # A sum of monomials is only trusted when there are more probes than terms.
    pairs = _basis(kmat[:1], True).shape[1] + 3 <= len(members)
    basis = _basis(kmat, pairs)
    can_linear = basis.shape[1] + 2 <= len(members)
    positive = np.all(vals > 0, axis=0)
    logv = np.log(np.where(vals > 0, vals, 1.0))
    sol, *_ = np.linalg.lstsq(x, logv, rcond=None)  # (1 + V, Q)
    for qi, name in enumerate(names):
        col = vals[:, qi]
        if np.ptp(col) == 0 or not positive[qi]:
            consts[qi] = float(np.median(col))
            continue
        e = np.rint(sol[1:, qi])
        c = np.exp(np.mean(logv[:, qi] - logk[:, varying] @ e))
        pred = c * np.exp(logk[:, varying] @ e)
        if np.allclose(pred, col, rtol=1e-6, atol=1e-6):
            consts[qi] = c
            expo[varying, qi] = e
        else:
            # Not a monomial: try a sum of monomials of degree <= 2.
            w, *_ = np.linalg.lstsq(basis, col, rcond=None)
            w = np.where(np.abs(w) < 1e-6, 0.0, w)
            if can_linear and np.allclose(basis @ w, col, rtol=1e-6, atol=1e-4):
                linear[name] = w
            else:
                unfitted.append(name)
            consts[qi] = float(np.median(col))
    return Template(st, numeric, tuple(names), consts, expo, tuple(unfitted), probes=len(members), linear=linear, pairs=pairs)


@dataclass
class FeatureExtractor:
    """Features for the candidates of one sketch (templates made lazily, one
    per structural key).

    n_probes: probe assignments applied per structural key.
    isolate: apply probes in an isolated worker process (a crash in MLIR
      cannot kill the caller).
    seed: the probes' random stream.
    """

    sketch: Sketch
    n_probes: int = 14
    isolate: bool = True
    seed: int = 0
    templates: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.struct = structural_knobs(self.sketch.knobs)
        self.multiples = tuple((k.name, k.multiple_of, remainder_name(k)) for k in self.sketch.knobs if k.multiple_of)

    def key_of(self, assignment: Assignment) -> tuple[tuple[str, int], ...]:
        """The structural knobs' values, then the remainder of each tile
        that is not a multiple of its parent (none in most sketches)."""
        d = dict(assignment)
        rests = tuple(
            (name, d[child] % d[parent])
            for child, parent, name in self.multiples
            if child in d and d.get(parent) and d[child] % d[parent]
        )
        return tuple((k, d[k]) for k in self.struct) + rests

    def template(self, key: tuple[tuple[str, int], ...]) -> Template:
        if key not in self.templates:
            rng = random.Random(f"{self.seed}:{self.sketch.hash}:{key}")
            probes = probe_assignments(self.sketch.knobs, dict(key), rng, self.n_probes)
            read = _run_probes(self.sketch.payload, self.sketch.script, probes, self.isolate)
            self.templates[key] = fit_template(self.sketch.knobs, probes, read)
        return self.templates[key]

    def features(self, assignments: Sequence[Assignment]) -> list[np.ndarray]:
        """One (statements, N_FEATURES) array per assignment."""
        out: list[np.ndarray | None] = [None] * len(assignments)
        by_key: dict = {}
        for i, a in enumerate(assignments):
            by_key.setdefault(self.key_of(a), []).append(i)
        for key, idx in by_key.items():
            t = self.template(key)
            if t.structure is None:
                for i in idx:
                    out[i] = np.zeros((1, N_FEATURES))
                continue
            vals = np.array([[dict(assignments[i])[k] for k in t.knobs] for i in idx], dtype=float)
            feats = program_features(t.structure, t.quantities(vals), len(idx))
            for j, i in enumerate(idx):
                out[i] = feats[j]
        return out  # type: ignore[return-value]


def _run_probes(payload: str, script: str, probes: list[Assignment], isolate: bool) -> list:
    if not isolate:
        return _probe_worker(payload, script, probes)
    from mlir_ansor.measure.pool import WorkerPool

    # All probes in one job; if the worker crashes, again one probe per job
    # (a crash then loses only that probe).
    with WorkerPool(1) as pool:
        res = pool.run(_probe_worker, (payload, script, probes), timeout_s=300.0)
        if res.ok:
            return res.value
        out = []
        for a in probes:
            one = pool.run(_probe_worker, (payload, script, [a]), timeout_s=120.0)
            out.extend(one.value if one.ok else [None])
        return out


_EXTRACTORS: dict[str, FeatureExtractor] = {}


def extractor_for(sketch: Sketch, *, isolate: bool = True) -> FeatureExtractor:
    """The cached extractor of a sketch (by sketch hash)."""
    fx = _EXTRACTORS.get(sketch.hash)
    if fx is None:
        fx = _EXTRACTORS[sketch.hash] = FeatureExtractor(sketch, isolate=isolate)
    return fx


def extract_features(sketch: Sketch, assignments: Sequence[Assignment], *, isolate: bool = True) -> list[np.ndarray]:
    """Features of candidates of `sketch`: one (statements, N_FEATURES)
    array per assignment (a program's features are its statement rows)."""
    return extractor_for(sketch, isolate=isolate).features(assignments)


def features_of_module(module) -> np.ndarray:
    """Features of one scheduled module read directly (no template): the
    reference the template path is checked against."""
    st, vals = read_program(module)
    q = {k: np.array([float(v)]) for k, v in vals.items()}
    return program_features(st, q, 1)[0]
