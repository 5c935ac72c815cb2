"""int8 contractions onto AVX-512 VNNI's ``vpdpwssd``.

The tensorized sketch (`search/rules/dot_product.py`) leaves, for a matmul
with i8 inputs and i32 accumulation, one ``vector.contract`` per 1 x 16
accumulator and reduction pair::

    A: vector<1x1x2xi8>  (m, k/2, 2)   B: vector<1x16x2xi8>  (k/2, n, 2)
    C: vector<1x16xi32>                 maps (m, k/2, 2), (k/2, n, 2), (m, n)

The upstream x86vector patterns map i8 contractions only onto AVX-VNNI-INT8
(``vpdpbssd``, signed x signed bytes), which AMD's Zen 4 and Zen 5 lack;
their ``vpdpbusd`` multiplies *unsigned* by signed bytes, which needs a
correction term per column (summed across the reduction loop and subtracted
after it, :func:`_correct_after_loop`). ``vpdpwssd`` multiplies signed 16-bit pairs and
adds both products to each i32 lane, exactly: :func:`lower_pair_contracts`
sign-extends the 32 bytes of B's tile to 16 bits (one ``vpmovsxbw``, shared
by every row of the register tile), repeats A's pair of bytes and widens it
the same way, and calls ``llvm.x86.avx512.vpdpwssd.512``: 32 multiply-adds per
instruction, twice an f32 FMA, with no rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlir import ir

from mlir_ansor.target import DOT_PRODUCTS


def _intrinsic(instruction: str, bits: int) -> str:
    """The LLVM intrinsic of `instruction` at `bits` wide, from the one
    table of them (`target.DOT_PRODUCTS`)."""
    return next(d.intrinsic for d in DOT_PRODUCTS if d.instruction == instruction and d.bits == bits)


INT8_INTRINSIC = _intrinsic("vpdpwssd", 512)
INT8_AVX2_INTRINSIC = _intrinsic("vpmaddwd", 256)
INT8_QUAD_INTRINSIC = _intrinsic("vpdpbusd", 512)
BF16_INTRINSIC = _intrinsic("vdpbf16ps", 512)

# The two forms a pair contraction takes: a matmul's piece (m, n, k/2, 2)
# with its unit loops, and the same after `fold_unit_extent_dims` (what a
# convolution's piece becomes): A's pair, B's lanes x 2, C's lanes. The
# shapes, for L lanes (16 with AVX-512, 8 with AVX2).
_FORMS = {
    (
        "affine_map<(d0, d1, d2, d3) -> (d0, d2, d3)>",
        "affine_map<(d0, d1, d2, d3) -> (d2, d1, d3)>",
        "affine_map<(d0, d1, d2, d3) -> (d0, d1)>",
    ): lambda n, g: ([1, 1, g], [1, n, g], [1, n]),
    (
        "affine_map<(d0, d1) -> (d1)>",
        "affine_map<(d0, d1) -> (d0, d1)>",
        "affine_map<(d0, d1) -> (d0)>",
    ): lambda n, g: ([g], [n, g], [n]),
}


@dataclass(frozen=True)
class _Pair:
    """A contraction `lower_pair_contracts` rewrites: its kind ("bf16";
    "i8": pairs through 16-bit products; "i8x4": quads through vpdpbusd),
    its two operands as narrow vectors, and which of them are unsigned
    bytes (the body widened them with ``arith.extui``: the contraction
    then has i32 operands, each the widening of an i8 vector)."""

    kind: str
    lhs: ir.Value
    rhs: ir.Value
    lhs_unsigned: bool = False
    rhs_unsigned: bool = False

    @property
    def corrected(self) -> bool:
        """Signed x signed quads: vpdpbusd takes one unsigned operand, so
        A's sign is flipped and 128 x sum(B) taken off again."""
        return self.kind == "i8x4" and not (self.lhs_unsigned or self.rhs_unsigned)


def lower_pair_contracts(module: ir.Module) -> int:
    """Rewrite every pair (or quad) contraction of i8 or bf16 operands in
    one of the forms above into dot-product instructions; returns how many.
    Other contractions are left alone. (The matmul sketch's bf16 pieces
    already went through the upstream x86vector patterns inside its
    script; a convolution's or batch's folded pieces do not match those.)"""
    found: list[tuple[ir.Operation, _Pair]] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "vector.contract":
            pair = _pair_kind(op)
            if pair is not None:
                found.append((op, pair))
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    carried: dict[ir.Operation, list[tuple[ir.Operation, _Pair, int]]] = {}
    for op, pair in found:
        loop_and_slot = _carried_by_loop(op) if pair.corrected else None
        if loop_and_slot is None:
            _rewrite(op, pair)
        else:
            carried.setdefault(loop_and_slot[0], []).append((op, pair, loop_and_slot[1]))
    for loop, contracts in carried.items():
        _correct_after_loop(loop, contracts)
    return len(found)


def _carried_by_loop(op: ir.Operation) -> tuple[ir.Operation, int] | None:
    """(the ``scf.for``, the iter_arg's position) when `op`'s accumulator is
    an iter_arg of the loop around it that nothing else uses, and the
    contraction's result is what the loop yields for it, and nothing else."""
    loop = op.parent.operation
    acc = op.operands[2]
    if loop.name != "scf.for":
        return None
    try:
        arg = ir.BlockArgument(acc)
    except ValueError:
        return None  # not a block argument
    body = loop.regions[0].blocks[0]
    if arg.owner != body or arg.arg_number == 0 or len(list(arg.uses)) != 1 or len(list(op.results[0].uses)) != 1:
        return None
    slot = arg.arg_number - 1
    yielded = body.operations[len(body.operations) - 1]
    if yielded.operands[slot] != op.results[0]:
        return None
    return loop, slot


def _correct_after_loop(loop: ir.Operation, contracts: list[tuple[ir.Operation, _Pair, int]]) -> None:
    """Quad contractions carried by `loop`: their vpdpbusd steps without the
    correction, and the correction (128 x the sum of each distinct B vector
    over the loop, one vpdpbusd per B vector and step, shared by every row
    of the register tile) carried in extra iter_args of a rebuilt loop and
    subtracted once from each accumulator after it. What the per-step
    correction cost: a vpsubd per accumulator and step (on Zen 5, 12% of the
    dot products' rate with 16 accumulators, 38% with 8)."""
    from mlir.dialects import arith, llvm, scf, vector

    i8, i32 = (ir.IntegerType.get_signless(b) for b in (8, 32))
    v = ir.VectorType.get
    b_vectors: list[ir.Value] = []
    owner: dict[int, int] = {}  # iter_arg slot -> its B vector's correction
    for op, pair, slot in contracts:
        j = next((j for j, b in enumerate(b_vectors) if b == pair.rhs), None)
        if j is None:
            j = len(b_vectors)
            b_vectors.append(pair.rhs)
        owner[slot] = j
        _rewrite(op, pair, correct=False)
    old = loop.opview
    body = old.body
    n = len(old.initArgs)
    with ir.InsertionPoint(loop), loop.location:
        lanes = v([16], i32)
        zero = arith.constant(lanes, ir.DenseElementsAttr.get_splat(lanes, ir.IntegerAttr.get(i32, 0)))
        new = scf.ForOp(old.lowerBound, old.upperBound, old.step, list(old.initArgs) + [zero] * len(b_vectors))
    for k, arg in enumerate(body.arguments):
        arg.replace_all_uses_with(new.body.arguments[k])
    for op in list(body.operations):
        new.body.append(op)
    yielded = new.body.operations[len(new.body.operations) - 1]
    with ir.InsertionPoint(yielded), loop.location:
        bias = _sign_bytes(16)
        name = ir.StringAttr.get(INT8_QUAD_INTRINSIC)
        sums = [
            llvm.call_intrinsic(lanes, name, [new.body.arguments[1 + n + j], bias, vector.shape_cast(v([64], i8), b)], [],
                                ir.DenseI32ArrayAttr.get([]))
            for j, b in enumerate(b_vectors)
        ]
        scf.YieldOp(list(yielded.operands) + sums)
    yielded.erase()
    with ir.InsertionPoint.after(new.operation), loop.location:
        for slot in range(n):
            result = new.results[slot]
            if slot not in owner:
                loop.results[slot].replace_all_uses_with(result)
                continue
            flat = vector.shape_cast(lanes, result)
            fixed = vector.shape_cast(result.type, arith.subi(flat, new.results[n + owner[slot]]))
            loop.results[slot].replace_all_uses_with(fixed)
    loop.erase()


_SIGN_BITS = 0x80808080 - (1 << 32)
"""Four 0x80 bytes as a signed i32: each byte's sign bit."""


def _sign_bytes(lanes: int) -> ir.Value:
    """A vector of `lanes` x 4 bytes 0x80 (inside an insertion point)."""
    from mlir.dialects import arith, vector

    i32 = ir.IntegerType.get_signless(32)
    words = vector.broadcast(ir.VectorType.get([lanes], i32), arith.constant(i32, _SIGN_BITS))
    return vector.bitcast(ir.VectorType.get([4 * lanes], ir.IntegerType.get_signless(8)), words)


def _narrow(value: ir.Value, shape: list[int]) -> tuple[ir.Value, bool] | None:
    """`value` as an i8 vector of `shape` and whether it is unsigned: itself
    (a contraction on i8 operands, which `fold_arith_extension` made from
    sign extensions), or the source of its ``arith.extsi`` / ``extui``."""
    t = ir.VectorType(value.type)
    if str(t.element_type) == "i8":
        return value, False
    owner = value.owner
    if not isinstance(owner, ir.Block) and owner.name in ("arith.extsi", "arith.extui"):
        src = owner.operands[0]
        st = ir.VectorType(src.type) if isinstance(src.type, ir.VectorType) else None
        if st is not None and str(st.element_type) == "i8" and list(st.shape) == shape:
            return src, owner.name == "arith.extui"
    return None


def _pair_kind(op: ir.Operation) -> _Pair | None:
    if len(op.operands) != 3:
        return None  # masked
    try:
        lhs, rhs, acc = (ir.VectorType(op.operands[i].type) for i in range(3))
    except (ValueError, TypeError):
        return None
    maps = tuple(str(m) for m in ir.ArrayAttr(op.attributes["indexing_maps"]))
    form = _FORMS.get(maps)
    lanes = acc.shape[-1] if acc.rank else 0
    group = lhs.shape[-1] if lhs.rank else 0
    if form is None or lanes not in (8, 16) or group not in (2, 4):
        return None
    if [list(lhs.shape), list(rhs.shape), list(acc.shape)] != list(form(lanes, group)):
        return None
    if "#vector.kind<add>" not in str(op.attributes["kind"]):
        return None
    a, b = op.operands[0], op.operands[1]
    types = (str(lhs.element_type), str(rhs.element_type), str(acc.element_type))
    if types == ("bf16", "bf16", "f32"):
        return _Pair("bf16", a, b) if lanes == 16 and group == 2 else None
    if types[2] != "i32":
        return None
    na, nb = _narrow(a, list(lhs.shape)), _narrow(b, list(rhs.shape))
    if na is None or nb is None or (na[1] and nb[1]):
        return None  # not bytes, or both unsigned (no instruction takes two)
    if group == 4 and lanes != 16:
        return None
    return _Pair("i8x4" if group == 4 else "i8", na[0], nb[0], na[1], nb[1])


def _rewrite(op: ir.Operation, pair: _Pair, correct: bool = True) -> None:
    from mlir.dialects import arith, llvm, vector

    lhs, rhs, acc = pair.lhs, pair.rhs, op.operands[2]
    i8, i16, i32 = (ir.IntegerType.get_signless(b) for b in (8, 16, 32))
    v = ir.VectorType.get
    lanes = ir.VectorType(acc.type).shape[-1]
    no_attrs = ir.DenseI32ArrayAttr.get([])
    with ir.InsertionPoint(op), op.location:
        if pair.kind == "i8x4":
            quad = vector.bitcast(v([1], i32), vector.shape_cast(v([4], i8), lhs))
            a_rep = vector.broadcast(v([lanes], i32), vector.extract(quad, [], [0]))
            b = vector.shape_cast(v([4 * lanes], i8), rhs)
            c = vector.shape_cast(v([lanes], i32), acc)
            name = ir.StringAttr.get(INT8_QUAD_INTRINSIC)
            if pair.lhs_unsigned or pair.rhs_unsigned:
                # One operand is unsigned bytes already: vpdpbusd as it is,
                # the unsigned one first (products commute).
                a = vector.bitcast(v([4 * lanes], i8), a_rep)
                first, second = (a, b) if pair.lhs_unsigned else (b, a)
                dot = llvm.call_intrinsic(v([lanes], i32), name, [c, first, second], [], no_attrs)
                out = vector.shape_cast(ir.VectorType(op.results[0].type), dot)
                op.results[0].replace_all_uses_with(out)
                op.erase()
                return
            # vpdpbusd multiplies unsigned bytes of A by signed bytes of B:
            # A + 128 (its sign bit flipped) is unsigned, and 128 * (sum of
            # B's quad), one more vpdpbusd of B by 0x80 bytes shared by every
            # row of the register tile (same B: CSE), is taken off again:
            # here, or (`correct` False) once after the loop that carries
            # the accumulator (`_correct_after_loop`).
            flip = arith.constant(v([lanes], i32), ir.DenseElementsAttr.get_splat(v([lanes], i32), ir.IntegerAttr.get(i32, _SIGN_BITS)))
            a = vector.bitcast(v([4 * lanes], i8), arith.xori(a_rep, flip))
            dot = llvm.call_intrinsic(v([lanes], i32), name, [c, a, b], [], no_attrs)
            if not correct:
                op.results[0].replace_all_uses_with(vector.shape_cast(ir.VectorType(op.results[0].type), dot))
                op.erase()
                return
            bias = _sign_bytes(lanes)
            zero = arith.constant(v([lanes], i32), ir.DenseElementsAttr.get_splat(v([lanes], i32), ir.IntegerAttr.get(i32, 0)))
            correction = llvm.call_intrinsic(v([lanes], i32), name, [zero, bias, b], [], no_attrs)
            out = vector.shape_cast(ir.VectorType(op.results[0].type), arith.subi(dot, correction))
            op.results[0].replace_all_uses_with(out)
            op.erase()
            return
        if pair.kind == "i8":
            # A's pair as one 16-bit word, repeated, then widened (each
            # operand as the body widens it): two instructions (vpbroadcastw,
            # vpmovsxbw) where widening first and broadcasting a 32-bit word
            # took four. Unsigned bytes fit 16-bit products exactly too.
            a_word = vector.extract(vector.bitcast(v([1], i16), vector.shape_cast(v([2], i8), lhs)), [], [0])
            a_rep = vector.bitcast(v([2 * lanes], i8), vector.broadcast(v([lanes], i16), a_word))
            a = (arith.extui if pair.lhs_unsigned else arith.extsi)(v([2 * lanes], i16), a_rep)
            b = (arith.extui if pair.rhs_unsigned else arith.extsi)(v([2 * lanes], i16), vector.shape_cast(v([2 * lanes], i8), rhs))
            c = vector.shape_cast(v([lanes], i32), acc)
            if lanes == 8:
                # AVX2: vpmaddwd, then the add (LLVM fuses the two into a
                # vpdpwssd where the CPU has AVX-VNNI).
                pairs = llvm.call_intrinsic(v([lanes], i32), ir.StringAttr.get(INT8_AVX2_INTRINSIC), [a, b], [], no_attrs)
                out = vector.shape_cast(ir.VectorType(op.results[0].type), arith.addi(c, pairs))
                op.results[0].replace_all_uses_with(out)
                op.erase()
                return
            name, res = INT8_INTRINSIC, v([lanes], i32)
        else:
            bf16 = ir.BF16Type.get()
            a_word = vector.extract(vector.bitcast(v([1], i32), vector.shape_cast(v([2], bf16), lhs)), [], [0])
            a = vector.bitcast(v([2 * lanes], bf16), vector.broadcast(v([lanes], i32), a_word))
            b = vector.shape_cast(v([2 * lanes], bf16), rhs)
            c = vector.shape_cast(v([lanes], ir.F32Type.get()), acc)
            name, res = BF16_INTRINSIC, v([lanes], ir.F32Type.get())
        dot = llvm.call_intrinsic(res, ir.StringAttr.get(name), [c, a, b], [], no_attrs)
        out = vector.shape_cast(ir.VectorType(op.results[0].type), dot)
    op.results[0].replace_all_uses_with(out)
    op.erase()
