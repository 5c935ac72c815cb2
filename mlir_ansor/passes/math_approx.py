"""Vectorizable expansions of `math.exp`, `math.erf` and `math.tanh` on f32.

Why: `convert-math-to-llvm` turns `math.exp` into the `llvm.exp` intrinsic,
which the x86 back end scalarizes into one libm `expf` call per lane; a
softmax or a GELU then spends nearly all its time in those calls (a
1024x1024 softmax ran 12 ms untuned, 10x PyTorch). Upstream MLIR has
polynomial approximations for these functions, but the pinned wheels expose
no pass or transform op that runs them, so :func:`expand_math` writes them
out here with `arith` ops, which work on scalars and vectors alike and lower
to straight-line SIMD code (FMA where the target has it: the multiply-adds
carry the `contract` fast-math flag).

The approximations:
- exp: Cody-Waite range reduction, x = n ln2 + r with n = round(x log2 e)
  and ln2 split in two parts, then a degree-6 minimax polynomial of r on
  [-ln2/2, ln2/2] (the classic Cephes `expf` coefficients, about 1 ulp),
  times 2^n, so that denormal results, 0 and inf come out as from `expf`.
  NaN stays NaN. On AVX-512 targets 2^n is applied with LLVM's `ldexp`
  intrinsic, which the x86 back end emits as one `vscalefps`; elsewhere
  (AVX2 would scalarize `ldexp` into libm calls) 2^n is built from exponent
  bits in two halves (six integer ops and two multiplies): the AVX-512 form
  is 18 vector instructions per exp instead of 26.
- tanh: upstream's `math-expand-ops` rewrites it with exp (run first).
- erf: Abramowitz and Stegun 7.1.26, 1 - t (a1 + t (a2 + ...)) e^(-x^2)
  with t = 1 / (1 + p |x|), odd in x; absolute error below 1.5e-7 (5e-7
  measured in float32).

f64 and other types are left alone (they still lower to libm calls).
"""

from __future__ import annotations

import itertools

from mlir import ir, passmanager
from mlir.dialects import arith, llvm, vector
from mlir.dialects import math as math_d

from mlir_ansor.target import Target

LOG2E = 1.44269504088896341
# ln 2 = _LN2_HI + _LN2_LO; _LN2_HI has few mantissa bits, so n * _LN2_HI is exact.
_LN2_HI = 0.693359375
_LN2_LO = -2.12194440e-4
# exp(-104) rounds to 0 and exp(89) to inf in f32: clamping there changes no result.
_EXP_LO, _EXP_HI = -104.0, 89.0
# exp(r) ~ 1 + r + r^2 (c0 + r (c1 + r (c2 + ...))), |r| <= ln2 / 2
_EXP_POLY = (5.0000001201e-1, 1.6666665459e-1, 4.1665795894e-2, 8.3334519073e-3, 1.3981999507e-3, 1.9875691500e-4)
# Abramowitz & Stegun 7.1.26
_ERF_P = 0.3275911
_ERF_POLY = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)
# erf(x) rounds to 1.0 in f32 from x = 3.92 on; |x| is clamped here, so that
# e^(-x^2) is never a denormal (it is from |x| = 9.4 on: Intel cores take a
# microcode assist per denormal operand; the GELU after a 384 x 3072 matmul
# of random inputs took 8.6 ms instead of 0.6 on Emerald Rapids).
_ERF_ONE = 4.0


class _Builder:
    """Emits f32 arith ops of one shape (a scalar f32 or a vector of f32)
    at the current insertion point."""

    def __init__(self, ty: ir.Type, scalef: bool = False) -> None:
        self.ty = ty
        self.vector = isinstance(ty, ir.VectorType)
        # ldexp only on vectors with lanes (not 0-D): the scalar path is not hot.
        self.scalef = scalef and self.vector and ir.VectorType(ty).rank > 0
        f32 = ir.F32Type.get()
        i32 = ir.IntegerType.get_signless(32)
        self.ity = ir.VectorType.get(ir.VectorType(ty).shape, i32) if self.vector else i32
        self.f32, self.i32 = f32, i32
        self.contract = ir.Attribute.parse("#arith.fastmath<contract>")

    def const(self, value: float) -> ir.Value:
        attr = ir.FloatAttr.get(self.f32, value)
        if self.vector:
            attr = ir.DenseElementsAttr.get_splat(self.ty, attr)
        return arith.constant(self.ty, attr)

    def iconst(self, value: int) -> ir.Value:
        attr = ir.IntegerAttr.get(self.i32, value)
        if self.vector:
            attr = ir.DenseElementsAttr.get_splat(self.ity, attr)
        return arith.constant(self.ity, attr)

    def mul(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return arith.mulf(a, b, fastmath=self.contract)

    def add(self, a: ir.Value, b: ir.Value) -> ir.Value:
        return arith.addf(a, b, fastmath=self.contract)

    def fma(self, a: ir.Value, b: ir.Value, c: ir.Value) -> ir.Value:
        """a * b + c (fused where the target has FMA)."""
        return self.add(self.mul(a, b), c)

    def horner(self, x: ir.Value, coeffs: tuple[float, ...]) -> ir.Value:
        """c0 + x (c1 + x (c2 + ...))."""
        acc = self.const(coeffs[-1])
        for c in reversed(coeffs[:-1]):
            acc = self.fma(acc, x, self.const(c))
        return acc

    def pow2(self, n: ir.Value) -> ir.Value:
        """2^n for integers n in [-126, 127], from the exponent bits."""
        return arith.bitcast(self.ty, arith.shli(arith.addi(n, self.iconst(127)), self.iconst(23)))

    def ldexp(self, x: ir.Value, n: ir.Value) -> ir.Value:
        """x * 2^n with LLVM's `ldexp` intrinsic on 1-D vectors (MLIR's
        `llvm.intr.ldexp` takes a scalar exponent only, so it is called by
        name), one row at a time for an n-D vector (its rows are an LLVM
        array: extracting and inserting them costs nothing)."""
        vt = ir.VectorType(self.ty)
        width = vt.shape[-1]
        row = ir.VectorType.get([width], self.f32)
        name = f"llvm.ldexp.v{width}f32.v{width}i32"

        def call(a: ir.Value, b: ir.Value) -> ir.Value:
            return llvm.call_intrinsic(row, name, [a, b], [], [])

        if vt.rank == 1:
            return call(x, n)
        out = x
        for pos in itertools.product(*(range(d) for d in vt.shape[:-1])):
            static = list(pos)
            r = call(vector.extract(x, [], static), vector.extract(n, [], static))
            out = vector.insert(r, out, [], static)
        return out

    def exp(self, x: ir.Value) -> ir.Value:
        xc = arith.minimumf(arith.maximumf(x, self.const(_EXP_LO)), self.const(_EXP_HI))
        n = math_d.floor(self.fma(xc, self.const(LOG2E), self.const(0.5)))
        r = self.fma(n, self.const(-_LN2_HI), xc)
        r = self.fma(n, self.const(-_LN2_LO), r)
        r2 = self.mul(r, r)
        p = self.fma(self.horner(r, _EXP_POLY), r2, self.add(r, self.const(1.0)))
        ni = arith.fptosi(self.ity, n)
        if self.scalef:
            # vscalefps rounds once, into denormals and 0 or to inf, as exp does.
            y = self.ldexp(p, ni)
        else:
            # 2^n as 2^(n >> 1) * 2^(n - (n >> 1)): both factors are normal
            # floats over the whole clamped range, so results underflow gradually
            # to denormals and 0, and overflow to inf, as exp does.
            n1 = arith.shrsi(ni, self.iconst(1))
            n2 = arith.subi(ni, n1)
            y = self.mul(self.mul(p, self.pow2(n1)), self.pow2(n2))
        # NaN in, NaN out (the clamps above kept it, fptosi does not).
        isnan = arith.cmpf(arith.CmpFPredicate.UNO, x, x)
        return arith.select(isnan, x, y)

    def erf(self, x: ir.Value) -> ir.Value:
        ax = arith.minimumf(math_d.absf(x), self.const(_ERF_ONE))
        t = arith.divf(self.const(1.0), self.fma(ax, self.const(_ERF_P), self.const(1.0)))
        poly = self.mul(self.horner(t, _ERF_POLY), t)
        e = self.exp(arith.negf(self.mul(ax, ax)))
        y = arith.subf(self.const(1.0), self.mul(poly, e))
        return math_d.copysign(y, x)


def _is_f32(ty: ir.Type) -> bool:
    if isinstance(ty, ir.VectorType):
        ty = ir.VectorType(ty).element_type
    return isinstance(ty, ir.F32Type)


def expand_math(module: ir.Module, scalef: bool | None = None) -> int:
    """Rewrite every f32 `math.tanh`, `math.erf` and `math.exp` in `module`
    (scalars and vectors, inside any region) into `arith` ops, in place.
    `scalef`: scale vector results by 2^n with `ldexp` (one `vscalefps`),
    for code built for an AVX-512 CPU; None asks the host (the
    ExecutionEngine builds for it). Returns how many ops were rewritten.
    The module's context must be current."""
    if scalef is None:
        scalef = Target.host().has("avx512f")
    passmanager.PassManager.parse("builtin.module(math-expand-ops{ops=tanh})").run(module.operation)
    found: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name in ("math.exp", "math.erf") and _is_f32(op.results[0].type):
            found.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit, ir.WalkOrder.POST_ORDER)
    for op in found:
        with ir.InsertionPoint(op), op.location:
            b = _Builder(op.results[0].type, scalef)
            x = op.operands[0]
            new = b.exp(x) if op.name == "math.exp" else b.erf(x)
        op.results[0].replace_all_uses_with(new)
        op.erase()
    return len(found)

