"""3x3 convolutions in Winograd's minimal filtering, F(4 x 4, 3 x 3).

A 3x3 convolution with unit strides computes each 4 x 4 block of its output
from a 6 x 6 block of its input with 36 multiplications per input and
output channel (Lavin and Gray, "Fast Algorithms for Convolutional Neural
Networks", 2016), where the direct form takes 144: a quarter of the
multiply-adds, in exchange for transforms of the input and of the output
that are linear in the image (6 and 4 multiply-adds per value and pass) and
a transform of the filter that, for a model's constant weights, is computed
once at compile time. TVM's and IREE's CPU back ends offer the same
rewrite; oneDNN, behind PyTorch's CPU convolutions, does not on these cores.

:func:`winograd_convolutions` rewrites ``linalg.conv_2d_nhwc_hwcf`` (3x3,
unit strides and dilations, static f32 shapes, a constant filter, a zero
initial output, at least :data:`MIN_CHANNELS` channels in and out and
:data:`MIN_BLOCKS` blocks of output) into ops each of which the CPU rules
already schedule:

* the input, zero-padded to whole blocks (one ``tensor.pad``, merged with
  the convolution's own), is transformed in two passes, its rows then its
  columns (``V = B^T d B``), each a ``linalg.generic`` with only parallel
  loops whose six reads are views of the input (``tensor.extract_slice`` of
  a ``tensor.expand_shape``: every map a projected permutation, so the
  vectorizer takes them); the transform's coefficients are small constant
  vectors read along the loop they depend on;
* the filter's transform ``U = G g G^T``, an op on constants only, which
  `graph.constants.fold_constants` evaluates once;
* one batched contraction (a ``linalg.generic``) over the 36 points of a
  block: ``M[e, p, f] = sum_c V[p, e, c] U[e, c, f]`` (p: the blocks of the
  image; V is written point-inner by its pass);
* the output transform ``Y = A^T M A`` in two passes like the input's, the
  second writing ``[n, block row, 4, block column, 4, f]``, a free view of
  the NHWC output (cropped where the image is not whole blocks).

The rounding differs from the direct form's: about 1e-5 of the output's
largest value for 64-512 channels against 5e-7 (numpy, float64 reference),
well inside the tolerance a 3x3 x 64-channel reduction is checked with.
Which convolutions are rewritten is the target's decision
(``winograd`` of the extraction's `prepack`, `search.rules.dot_product.weight_packing`),
and only while `graph.task.WINOGRAD` is on (off by default: a layer gains
1.8-2x, but ResNet-50 as a whole gained nothing measurable at 160 trials;
see its docstring).
"""

from __future__ import annotations

from fractions import Fraction

from mlir import ir

from mlir_ansor.graph.layout import fill_value, static_pad
from mlir_ansor.ir.rewrite import (
    defining_op,
    erase_unused,
    inline_body,
    is_float_zero,
    static_tensor_type,
    window_ints,
)

__all__ = ["A_T", "B_T", "G", "MIN_BLOCKS", "MIN_CHANNELS", "filter_transform", "winograd_convolutions"]

MIN_CHANNELS = 32
"""Fewest input and output channels a convolution is rewritten with: the
batched matmul's reduction and columns; with fewer the transforms, which do
not shrink with the channels, outweigh the multiplications saved."""

MIN_BLOCKS = 32
"""Fewest 4 x 4 output blocks (rows of the batched contraction) a
convolution is rewritten with. The transformed filter is 4x the size of the
filter, and each of its values is used once per block: a model reads its
weights from memory on every call, and with few blocks that read outweighs
the multiplications saved. Tuned alone, 48 trials, 1 thread (Emerald
Rapids), compiled modules timed in turns in one process, warm: 56 x 56 x 64
(196 blocks) 1.76x the direct form, 28 x 28 x 128 (49) 1.96x, 14 x 14 x 256
(16) 1.79x; with the caches flushed before each task (the weights cold, as
in a model, but every intermediate too): 0.86x, 1.38x, 0.93x, and the 7 x 7
x 512 one's contraction alone (4 blocks, 9.4 MB of transformed weights for
16 rows) took 4.0 ms against 2.3 for the whole direct convolution."""

TILE = 4
"""Output pixels of a block, per side (m of F(m, 3))."""

ALPHA = TILE + 2
"""Input pixels of a block, per side."""

# Interpolation points 0, 1, -1, 2, -2 and infinity (Lavin and Gray).
B_T = [
    [4, 0, -5, 0, 1, 0],
    [0, -4, -4, 1, 1, 0],
    [0, 4, -4, -1, 1, 0],
    [0, -2, -1, 2, 1, 0],
    [0, 2, -1, -2, 1, 0],
    [0, 4, 0, -5, 0, 1],
]
G = [
    [Fraction(1, 4), 0, 0],
    [Fraction(-1, 6), Fraction(-1, 6), Fraction(-1, 6)],
    [Fraction(-1, 6), Fraction(1, 6), Fraction(-1, 6)],
    [Fraction(1, 24), Fraction(1, 12), Fraction(1, 6)],
    [Fraction(1, 24), Fraction(-1, 12), Fraction(1, 6)],
    [0, 0, 1],
]
A_T = [
    [1, 1, 1, 1, 1, 0],
    [0, 1, -1, 2, -2, 0],
    [0, 1, 1, 4, 4, 0],
    [0, 1, -1, 8, -8, 1],
]


def _column(matrix: list[list], j: int) -> str:
    """Column `j` of `matrix` as a dense f32 vector literal."""
    return "dense<[" + ", ".join(f"{float(row[j]):.9e}" for row in matrix) + "]>"


def _tensor(shape: list[int]) -> str:
    return "tensor<" + "x".join(str(s) for s in shape) + "xf32>"


def _map(rank: int, results: list) -> str:
    dims = ", ".join(f"d{i}" for i in range(rank))
    res = ", ".join(f"d{r}" if isinstance(r, int) else r for r in results)
    return f"affine_map<({dims}) -> ({res})>"


def _parallel(rank: int) -> str:
    return ", ".join(['"parallel"'] * rank)


def _sum_body(n: int) -> str:
    """A generic's body summing `n` products of (value, coefficient) pairs:
    block arguments in0..in{n-1}, then k0..k{n-1}, then the output's (names
    no value of :func:`_program` outside a body has)."""
    args = ", ".join([f"%in{i}: f32" for i in range(n)] + [f"%k{i}: f32" for i in range(n)] + ["%out: f32"])
    lines = [f"^bb0({args}):"]
    for i in range(n):
        lines.append(f"  %pr{i} = arith.mulf %in{i}, %k{i} : f32")
    acc = "%pr0"
    for i in range(1, n):
        lines.append(f"  %sm{i} = arith.addf {acc}, %pr{i} : f32")
        acc = f"%sm{i}"
    lines.append(f"  linalg.yield {acc} : f32")
    return "\n".join(lines)


def _slices(lines: list[str], src: str, src_shape: list[int], sizes: list[int],
            result_shape: list[int], offsets: list[list[int]]) -> list[str]:
    """Append a rank-reducing ``tensor.extract_slice`` of ``%src`` at each of
    `offsets` (unit strides) to `lines`, named ``%src_s0``, ``%src_s1``, ...;
    returns the names."""
    names = []
    for k, off in enumerate(offsets):
        lines.append(
            f"%{src}_s{k} = tensor.extract_slice %{src}[{', '.join(map(str, off))}] [{', '.join(map(str, sizes))}] "
            f"[{', '.join(['1'] * len(sizes))}] : {_tensor(src_shape)} to {_tensor(result_shape)}"
        )
        names.append(f"%{src}_s{k}")
    return names


def _pass(out: str, values: list[str], value_type: str, value_map: str,
          coefficients: list[str], coefficient_map: str, out_shape: list[int], rows: int) -> str:
    """One transform pass: ``out = sum_i values[i] * coefficients[i]`` over
    the loops of `out_shape` (all parallel); the coefficients are vectors of
    `rows`, read along the one loop `coefficient_map` names."""
    rank = len(out_shape)
    n = len(values)
    maps = [value_map] * n + [coefficient_map] * n + [_map(rank, list(range(rank)))]
    ins = ", ".join(values + coefficients)
    types = ", ".join([value_type] * n + [f"tensor<{rows}xf32>"] * n)
    return (
        f"%{out}_e = tensor.empty() : {_tensor(out_shape)}\n"
        f"%{out} = linalg.generic {{indexing_maps = [{', '.join(maps)}], "
        f"iterator_types = [{_parallel(rank)}]}} "
        f"ins({ins} : {types}) outs(%{out}_e : {_tensor(out_shape)}) {{\n{_sum_body(n)}\n}} -> {_tensor(out_shape)}\n"
    )


def filter_transform(c: int, f: int) -> list[str]:
    """The lines computing ``%u`` (6 x 6 x c x f), U = G g G^T of the filter
    ``%g`` (3 x 3 x c x f), with G's columns ``%g0`` .. ``%g2`` defined: one
    generic reading the taps through maps with constant results, which
    `graph.fold_eval` evaluates."""
    lines: list[str] = []
    # U[xi, nu, c, f] = sum_{kh, kw} G[xi, kh] G[nu, kw] g[kh, kw, c, f].
    taps = [(kh, kw) for kh in range(3) for kw in range(3)]
    gmaps = [_map(4, [str(kh), str(kw), 2, 3]) for kh, kw in taps] + [_map(4, [0])] * 9 + [_map(4, [1])] * 9
    gmaps.append(_map(4, [0, 1, 2, 3]))
    body = [
        "^bb0(" + ", ".join([f"%w{i}: f32" for i in range(9)] + [f"%a{i}: f32" for i in range(9)]
                           + [f"%b{i}: f32" for i in range(9)] + ["%o: f32"]) + "):"
    ]
    acc = None
    for i in range(9):
        body.append(f"  %ab{i} = arith.mulf %a{i}, %b{i} : f32")
        body.append(f"  %wt{i} = arith.mulf %w{i}, %ab{i} : f32")
        if acc is None:
            acc = f"%wt{i}"
        else:
            body.append(f"  %ws{i} = arith.addf {acc}, %wt{i} : f32")
            acc = f"%ws{i}"
    body.append(f"  linalg.yield {acc} : f32")
    g_ins = ["%g"] * 9 + [f"%g{kh}" for kh, _ in taps] + [f"%g{kw}" for _, kw in taps]
    g_types = [_tensor([3, 3, c, f])] * 9 + ["tensor<6xf32>"] * 18
    lines.append(f"%ue = tensor.empty() : {_tensor([ALPHA, ALPHA, c, f])}")
    lines.append(
        f"%u = linalg.generic {{indexing_maps = [{', '.join(gmaps)}], "
        f"iterator_types = [{_parallel(4)}]}} "
        f"ins({', '.join(g_ins)} : {', '.join(g_types)}) outs(%ue : {_tensor([ALPHA, ALPHA, c, f])}) {{\n"
        + "\n".join(body) + f"\n}} -> {_tensor([ALPHA, ALPHA, c, f])}"
    )
    return lines


def _program(n: int, hs: int, ws: int, c: int, f: int, low: list[int], ho: int, wo: int) -> str:
    """The text of a function ``(x: NHWC source, g: HWCF filter) -> NHWC
    output`` computing the padded 3x3 convolution in F(4x4, 3x3)."""
    th, tw = -(-ho // TILE), -(-wo // TILE)
    hp, wp = TILE * (th + 1), TILE * (tw + 1)
    p = n * th * tw
    e = ALPHA * ALPHA
    lines = ["%zero = arith.constant 0.000000e+00 : f32"]
    for name, matrix, count in (("bt", B_T, ALPHA), ("g", G, 3), ("at", A_T, ALPHA)):
        rows = len(matrix)
        for j in range(count):
            lines.append(f"%{name}{j} = arith.constant {_column(matrix, j)} : tensor<{rows}xf32>")
    # The input, zero-padded to whole blocks plus the 2 pixels of overlap.
    lines.append(
        f"%xp = tensor.pad %x low[0, {low[0]}, {low[1]}, 0] high[0, {hp - hs - low[0]}, {wp - ws - low[1]}, 0] {{\n"
        f"^bb0(%i0: index, %i1: index, %i2: index, %i3: index):\n  tensor.yield %zero : f32\n"
        f"}} : {_tensor([n, hs, ws, c])} to {_tensor([n, hp, wp, c])}"
    )
    # Rows: T1[n, th, w, xi, c] = sum_i B_T[xi, i] x[n, 4 th + i, w, c].
    lines.append(
        f"%xh = tensor.expand_shape %xp [[0], [1, 2], [3], [4]] output_shape [{n}, {th + 1}, {TILE}, {wp}, {c}] "
        f": {_tensor([n, hp, wp, c])} into {_tensor([n, th + 1, TILE, wp, c])}"
    )
    rows = _slices(lines, "xh", [n, th + 1, TILE, wp, c], [n, th, 1, wp, c], [n, th, wp, c],
                   [[0, i // TILE, i % TILE, 0, 0] for i in range(ALPHA)])
    # [n, th, w, xi, c]: the pass's register tile takes all six xi of a
    # pixel (the elementwise rule tiles the second-to-last output loop),
    # each row read once for the six.
    lines.append(_pass("t1", rows, _tensor([n, th, wp, c]), _map(5, [0, 1, 2, 4]),
                       [f"%bt{i}" for i in range(ALPHA)], _map(5, [3]), [n, th, wp, ALPHA, c], ALPHA))
    # Columns: V[n, th, tw, xi, nu, c] = sum_j B_T[nu, j] T1[n, th, 4 tw + j, xi, c].
    lines.append(
        f"%t1w = tensor.expand_shape %t1 [[0], [1], [2, 3], [4], [5]] output_shape [{n}, {th}, {tw + 1}, {TILE}, {ALPHA}, {c}] "
        f": {_tensor([n, th, wp, ALPHA, c])} into {_tensor([n, th, tw + 1, TILE, ALPHA, c])}"
    )
    cols = _slices(lines, "t1w", [n, th, tw + 1, TILE, ALPHA, c], [n, th, tw, 1, ALPHA, c], [n, th, tw, ALPHA, c],
                   [[0, 0, j // TILE, j % TILE, 0, 0] for j in range(ALPHA)])
    lines.append(_pass("v", cols, _tensor([n, th, tw, ALPHA, c]), _map(6, [0, 1, 2, 3, 5]),
                       [f"%bt{j}" for j in range(ALPHA)], _map(6, [4]), [n, th, tw, ALPHA, ALPHA, c], ALPHA))
    lines.append(
        f"%v2 = tensor.collapse_shape %v [[0, 1, 2], [3, 4], [5]] : {_tensor([n, th, tw, ALPHA, ALPHA, c])} into {_tensor([p, e, c])}"
    )
    lines.extend(filter_transform(c, f))
    lines.append(
        f"%u2 = tensor.collapse_shape %u [[0, 1], [2], [3]] : {_tensor([ALPHA, ALPHA, c, f])} into {_tensor([e, c, f])}"
    )
    # The products of the 36 points: M[e, p, f] = sum_c V[p, e, c] U[e, c, f].
    lines.append(f"%me = tensor.empty() : {_tensor([e, p, f])}")
    lines.append(f"%mz = linalg.fill ins(%zero : f32) outs(%me : {_tensor([e, p, f])}) -> {_tensor([e, p, f])}")
    contraction_maps = ", ".join(
        _map(4, dims) for dims in ([1, 0, 3], [0, 3, 2], [0, 1, 2])  # loops (e, p, f, c)
    )
    lines.append(
        f"%m = linalg.generic {{indexing_maps = [{contraction_maps}], "
        f'iterator_types = ["parallel", "parallel", "parallel", "reduction"]}} '
        f"ins(%v2, %u2 : {_tensor([p, e, c])}, {_tensor([e, c, f])}) outs(%mz : {_tensor([e, p, f])}) {{\n"
        f"^bb0(%ina: f32, %inb: f32, %acc: f32):\n  %mul = arith.mulf %ina, %inb : f32\n"
        f"  %add = arith.addf %acc, %mul : f32\n  linalg.yield %add : f32\n}} -> {_tensor([e, p, f])}"
    )
    lines.append(
        f"%m6 = tensor.expand_shape %m [[0, 1], [2, 3, 4], [5]] output_shape [{ALPHA}, {ALPHA}, {n}, {th}, {tw}, {f}] "
        f": {_tensor([e, p, f])} into {_tensor([ALPHA, ALPHA, n, th, tw, f])}"
    )
    # Output rows: O1[n, th, tw, nu, a, f] = sum_xi A_T[a, xi] M[xi, nu, n, th, tw, f].
    ms = _slices(lines, "m6", [ALPHA, ALPHA, n, th, tw, f], [1, ALPHA, n, th, tw, f], [ALPHA, n, th, tw, f],
                 [[xi, 0, 0, 0, 0, 0] for xi in range(ALPHA)])
    # [n, th, tw, nu, a, f]: all four a of a point in one register tile.
    lines.append(_pass("o1", ms, _tensor([ALPHA, n, th, tw, f]), _map(6, [3, 0, 1, 2, 5]),
                       [f"%at{i}" for i in range(ALPHA)], _map(6, [4]), [n, th, tw, ALPHA, TILE, f], TILE))
    # Output columns: Y[n, th, a, tw, b, f] = sum_nu A_T[b, nu] O1[n, th, tw, nu, a, f].
    os_ = _slices(lines, "o1", [n, th, tw, ALPHA, TILE, f], [n, th, tw, 1, TILE, f], [n, th, tw, TILE, f],
                  [[0, 0, 0, nu, 0, 0] for nu in range(ALPHA)])
    lines.append(_pass("y", os_, _tensor([n, th, tw, TILE, f]), _map(6, [0, 1, 3, 2, 5]),
                       [f"%at{i}" for i in range(ALPHA)], _map(6, [4]), [n, th, TILE, tw, TILE, f], TILE))
    lines.append(
        f"%y4 = tensor.collapse_shape %y [[0], [1, 2], [3, 4], [5]] : {_tensor([n, th, TILE, tw, TILE, f])} "
        f"into {_tensor([n, TILE * th, TILE * tw, f])}"
    )
    result = "%y4"
    if (TILE * th, TILE * tw) != (ho, wo):
        lines.append(
            f"%yc = tensor.extract_slice %y4[0, 0, 0, 0] [{n}, {ho}, {wo}, {f}] [1, 1, 1, 1] "
            f": {_tensor([n, TILE * th, TILE * tw, f])} to {_tensor([n, ho, wo, f])}"
        )
        result = "%yc"
    lines.append(f"return {result} : {_tensor([n, ho, wo, f])}")
    body_text = "\n".join("    " + line.replace("\n", "\n    ") for line in lines)
    return (
        f"func.func @winograd(%x: {_tensor([n, hs, ws, c])}, %g: {_tensor([3, 3, c, f])}) -> {_tensor([n, ho, wo, f])} {{\n"
        f"{body_text}\n}}"
    )


_LEFT_BEHIND = frozenset({"linalg.fill", "tensor.empty", "tensor.pad", "arith.constant"})
"""What a rewritten convolution leaves unread: its output's fill, its pad."""


def _zero_pad_source(x: ir.Value) -> tuple[ir.Value, list[int]]:
    """(the unpadded source, its (top, left) padding) of a convolution's
    input `x`: through a ``tensor.pad`` by zeros with static amounts, else
    `x` itself with none."""
    pad = defining_op(x, "tensor.pad")
    amounts = static_pad(pad) if pad is not None else None
    if amounts is None or not is_float_zero(list(pad.regions[0].blocks[0].operations)[0].operands[0]):
        return x, [0, 0]
    low, high = amounts
    if low[0] or low[3] or high[0] or high[3] or min(low + high) < 0:
        return x, [0, 0]
    return pad.operands[0], [low[1], low[2]]


def _eligible(op: ir.Operation, constant: set) -> bool:
    if op.name != "linalg.conv_2d_nhwc_hwcf" or len(op.operands) != 3:
        return False
    x, w, init = op.operands
    types = [static_tensor_type(v) for v in (x, w, init)]
    if not all(types) or any(str(t.element_type) != "f32" for t in types):
        return False
    if window_ints(op, "strides") != [1, 1] or window_ints(op, "dilations") != [1, 1]:
        return False
    kh, kw, c, f = types[1].shape
    if (kh, kw) != (3, 3) or c < MIN_CHANNELS or f < MIN_CHANNELS or w not in constant:
        return False
    n, ho, wo, _ = types[2].shape
    if n * -(-ho // TILE) * -(-wo // TILE) < MIN_BLOCKS:
        return False
    zero = fill_value(init)
    return zero is not None and is_float_zero(zero)


def winograd_convolutions(fn: ir.Operation, constant: set) -> int:
    """Rewrite each eligible 3x3 convolution directly in `fn`'s body (see the
    module's docstring; `constant`: the values computed from constants only)
    in F(4x4, 3x3); returns how many were rewritten."""
    if not fn.regions[0].blocks:
        return 0
    block = fn.regions[0].blocks[0]
    convs = [o.operation for o in block.operations if _eligible(o.operation, constant)]
    for op in convs:
        x, w, _ = op.operands
        source, low = _zero_pad_source(x)
        n, hs, ws, c = ir.RankedTensorType(source.type).shape
        _, ho, wo, f = ir.RankedTensorType(op.results[0].type).shape
        program = ir.Module.parse(_program(n, hs, ws, c, f, low, ho, wo))
        with ir.InsertionPoint(op):
            (result,) = inline_body(program.body.operations[0].operation, [source, w])
        op.results[0].replace_all_uses_with(result)
        op.erase()
    if convs:
        erase_unused(block, _LEFT_BEHIND)
    return len(convs)
