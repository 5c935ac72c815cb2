"""The IR reader: a scheduled module (after the transform script, before
LLVM) into its knob-independent :class:`Structure` (loops, statements,
allocations, buffers) and its named quantities (trip counts, lanes, spans,
index coefficients, allocation shapes), by :func:`read_program`.

The op categories a statement's compute ops are counted in
(:data:`COMPUTE_CATS`) are defined here too; `rows.py` names a column for
each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlir_ansor.ir.dtypes import element_bytes

COMPUTE_CATS = ("fma", "addsub", "mul", "div", "cmp", "math", "int", "select", "shuffle")
"""Op categories counted per statement (see :func:`_category`)."""

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
    # The tensorized sketches' multiply-adds (`rules/dot_product.py`): a
    # bf16 dot product, and the contractions `passes.dot_products` lowers.
    "x86vector.avx512.dot": "fma",
    "vector.contract": "fma",
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

