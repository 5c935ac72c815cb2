"""AMX micro-kernels for the register tiles `search.rules.amx` leaves.

The rule tags a matmul's register tile (``ansor.amx``) and leaves it a
``linalg.generic`` through bufferization. On memrefs it reads, for groups
of g = 2 bf16 (f32 accumulators) or g = 4 bytes (i32), with leading unit
dimensions where a batch loop was::

    A: memref<MR x KC x g, strided<[sa, g, 1]>>   (m, k/g, g)
    B: memref<KC x NR x g, strided<[sb, g, 1]>>   (k/g, n, g)
    C: memref<MR x NR, strided<[sc, 1]>>          (m, n)

:func:`amx_microkernels` replaces it with the AMX program: A's and B's
group dimensions collapsed into their rows (a tile row is then 64
contiguous bytes of A, and 16 groups of B), MR rows in as few tiles of at
most 16 rows as hold them by NR/16 accumulator tiles loaded from C, KC/16
reduction steps unrolled (at each, the reused operand's tiles loaded
first, then one at a time the other's, and one ``amx.tile_mulf`` /
``amx.tile_muli`` per accumulator), the accumulators stored back. No tile
crosses a block boundary, so the standard LLVM conversion takes it
(`lowering`).

Linux gives a process the AMX tile state only when it asks for it
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``); without it the
first tile instruction is a SIGILL. :func:`request_amx` asks, once per
process (`measure.runner.Kernel` calls it), and :func:`request_amx_object`
is a constructor that asks when a library loads (`compiler` links it into
libraries with AMX kernels).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import platform
import subprocess

from mlir import ir

from mlir_ansor.errors import AnsorError
from mlir_ansor.ir.rewrite import inline_body, walk_op
from mlir_ansor.ir.types import identity_layout

log = logging.getLogger(__name__)

AMX_ATTR = "ansor.amx"
TILE = 16
"""Rows and 32-bit columns of an accumulator tile; groups in a row of an
operand tile (64 bytes) and in a reduction step."""

GROUPS = {"bf16": 2, "i8": 4}
"""Input element type -> the reduction elements one 32-bit lane of an AMX
product takes: pairs of bf16 (``tdpbf16ps``), quads of bytes (``tdpbssd``)."""

ACCUMULATORS = {"bf16": "f32", "i8": "i32"}
"""Input element type -> the accumulator's."""

_MAPS = (
    "affine_map<(d0, d1, d2, d3) -> (d0, d2, d3)>",
    "affine_map<(d0, d1, d2, d3) -> (d2, d1, d3)>",
    "affine_map<(d0, d1, d2, d3) -> (d0, d1)>",
)

_SYS_ARCH_PRCTL = 158
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18


def _linux_x86_64() -> bool:
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64")


@functools.cache
def request_amx() -> bool:
    """Ask Linux for the AMX tile data state for this process (x86-64
    Linux only; a no-op elsewhere). Returns whether it was granted. Safe to
    call on a CPU without AMX (the kernel refuses; nothing else happens)."""
    if not _linux_x86_64():
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA) == 0
    except (OSError, AttributeError):
        return False


_CONSTRUCTOR = f"""
#include <unistd.h>
__attribute__((constructor)) static void mlir_ansor_request_amx(void) {{
    syscall({_SYS_ARCH_PRCTL}, {_ARCH_REQ_XCOMP_PERM} /* ARCH_REQ_XCOMP_PERM */, {_XFEATURE_XTILEDATA} /* XFEATURE_XTILEDATA */);
}}
"""
"""The same request as :func:`request_amx`, as a C constructor."""


def request_amx_object(folder: str) -> str | None:
    """An object file (in `folder`) whose constructor asks for the tile
    state when the library it is linked into loads, so that a compiled
    module with AMX kernels also runs where no Python of ours loads it
    (``dlopen`` from C). None off x86-64 Linux."""
    if not _linux_x86_64():
        return None
    src, obj = os.path.join(folder, "request_amx.c"), os.path.join(folder, "request_amx.o")
    with open(src, "w", encoding="utf-8") as f:
        f.write(_CONSTRUCTOR)
    proc = subprocess.run(["cc", "-O2", "-fPIC", "-c", "-o", obj, src], capture_output=True, text=True)
    if proc.returncode != 0:
        raise AnsorError(f"amx: building the tile-state request failed: {proc.stderr.strip()[-1000:]}")
    return obj


def _collapse(t: ir.MemRefType, groups: list[list[int]]) -> str:
    """The type of `t` with each group of its dimensions (contiguous within
    the group, or unit) collapsed into one."""
    strides, offset = t.get_strides_and_offset()
    shape = [math.prod(t.shape[d] for d in g) for g in groups]
    for g in groups:
        for d, nxt in zip(g, g[1:]):
            if t.shape[d] != 1 and strides[d] != strides[nxt] * t.shape[nxt]:
                raise AnsorError(f"amx: dimensions {g} of {t} are not contiguous")
    if identity_layout(t):
        return str(ir.MemRefType.get(shape, t.element_type))  # identity in, identity out
    layout = ir.StridedLayoutAttr.get(offset, [strides[g[-1]] for g in groups])
    return str(ir.MemRefType.get(shape, t.element_type, layout))


def _reassociation(groups: list[list[int]]) -> str:
    return "[" + ", ".join("[" + ", ".join(map(str, g)) + "]" for g in groups) + "]"


def tile_rows(mr: int) -> tuple[int, int]:
    """(tiles, rows of each) that `mr` rows of a register tile are cut into:
    as few tiles as hold them (16 rows at most), of equal rows (a
    convolution's 56 pixels: 4 of 14)."""
    tm = -(-mr // TILE)
    while mr % tm:
        tm += 1
    return tm, mr // tm


def _program(ta: ir.MemRefType, tb: ir.MemRefType, tc: ir.MemRefType, unsigned: tuple[bool, bool] = (False, False)) -> str:
    """The micro-kernel as a function of the three operands (with as many
    leading unit dimensions as the batch loops left).

    Tiles live at once: the accumulators, the operand tiles that are
    reused (A's when there are no more rows of tiles than columns, else
    B's) and one of the other; at most 4 + 2 + 1 of AMX's 8 for the rule's
    register tiles, so none is spilled. `unsigned`: whether A's and B's
    bytes are unsigned (int8; ``tdpbusd`` and its kin)."""
    lead = ta.rank - 3
    ins, out = str(ta.element_type), str(tc.element_type)
    group = GROUPS[ins]
    width = group * TILE  # elements in a row of an operand tile (64 bytes)
    mr, kc, nr = ta.shape[lead], ta.shape[lead + 1], tb.shape[lead + 1]
    (tm, tr), tn, steps = tile_rows(mr), nr // TILE, kc // TILE
    rows = list(range(lead + 1))  # the unit dimensions with the rows
    in_groups = [rows, [lead + 1, lead + 2]]
    ca, cb = _collapse(ta, in_groups), _collapse(tb, in_groups)
    t_a, t_b = f"!amx.tile<{tr}x{width}x{ins}>", f"!amx.tile<{TILE}x{width}x{ins}>"
    t_acc = f"!amx.tile<{tr}x{TILE}x{out}>"
    lines = [f"func.func @mk(%a: {ta}, %b: {tb}, %c: {tc}) {{"]
    consts: set[int] = set()

    def at(v: int) -> str:
        consts.add(v)
        return f"%i{v}"

    body = [
        f"  %ca = memref.collapse_shape %a {_reassociation(in_groups)} : {ta} into {ca}",
        f"  %cb = memref.collapse_shape %b {_reassociation(in_groups)} : {tb} into {cb}",
    ]
    if lead:
        cc = _collapse(tc, [rows, [lead + 1]])
        body.append(f"  %cc = memref.collapse_shape %c {_reassociation([rows, [lead + 1]])} : {tc} into {cc}")
        c = "%cc"
    else:
        cc, c = str(tc), "%c"
    acc = {}
    for i in range(tm):
        for j in range(tn):
            acc[i, j] = f"%acc_{i}_{j}_0"
            body.append(f"  {acc[i, j]} = amx.tile_load {c}[{at(tr * i)}, {at(TILE * j)}] : {cc} into {t_acc}")

    def load_a(s: int, i: int) -> None:
        body.append(f"  %a_{s}_{i} = amx.tile_load %ca[{at(tr * i)}, {at(width * s)}] : {ca} into {t_a}")

    def load_b(s: int, j: int) -> None:
        body.append(f"  %b_{s}_{j} = amx.tile_load %cb[{at(TILE * s)}, {at(width * j)}] : {cb} into {t_b}")

    def mul(s: int, i: int, j: int) -> None:
        new = f"%acc_{i}_{j}_{s + 1}"
        if out == "f32":
            body.append(f"  {new} = amx.tile_mulf %a_{s}_{i}, %b_{s}_{j}, {acc[i, j]} : {t_a}, {t_b}, {t_acc}")
        else:
            za, zb = (" zext" if u else "" for u in unsigned)
            body.append(f"  {new} = amx.tile_muli %a_{s}_{i}{za}, %b_{s}_{j}{zb}, {acc[i, j]} : {t_a}, {t_b}, {t_acc}")
        acc[i, j] = new

    for s in range(steps):
        if tm <= tn:
            for i in range(tm):
                load_a(s, i)
            for j in range(tn):
                load_b(s, j)
                for i in range(tm):
                    mul(s, i, j)
        else:
            for j in range(tn):
                load_b(s, j)
            for i in range(tm):
                load_a(s, i)
                for j in range(tn):
                    mul(s, i, j)
    for i in range(tm):
        for j in range(tn):
            body.append(f"  amx.tile_store {c}[{at(tr * i)}, {at(TILE * j)}], {acc[i, j]} : {cc}, {t_acc}")
    lines += [f"  %i{v} = arith.constant {v} : index" for v in sorted(consts)]
    lines += body + ["  return", "}"]
    return "\n".join(lines)


_BATCH_MAPS = (
    "affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d3, d4)>",
    "affine_map<(d0, d1, d2, d3, d4) -> (d0, d3, d2, d4)>",
    "affine_map<(d0, d1, d2, d3, d4) -> (d0, d1, d2)>",
)


def _unsigned(op: ir.Operation) -> tuple[bool, bool]:
    """Whether the body widens A's and B's elements as unsigned."""
    block = op.regions[0].blocks[0]
    zext = {0: False, 1: False}
    for inner in block.operations:
        inner = inner.operation
        if inner.name == "arith.extui":
            for i in (0, 1):
                if inner.operands[0] == block.arguments[i]:
                    zext[i] = True
    return zext[0], zext[1]


def _check(op: ir.Operation) -> tuple[ir.MemRefType, ir.MemRefType, ir.MemRefType]:
    """The operand types of a tagged register tile, checked to be the form
    the micro-kernel computes."""
    if len(op.operands) != 3 or not all(isinstance(v.type, ir.MemRefType) for v in op.operands):
        raise AnsorError(f"amx: the tagged register tile is not a matmul on memrefs: {op}")
    ta, tb, tc = (ir.MemRefType(v.type) for v in op.operands)
    maps = tuple(str(m) for m in ir.ArrayAttr(op.attributes["indexing_maps"]))
    if maps not in (_MAPS, _BATCH_MAPS):
        raise AnsorError(f"amx: the tagged register tile reads its operands as {list(maps)}, not (m, k/2, 2), (k/2, n, 2), (m, n)")
    lead = len(maps[0].split("->")[1].split(",")) - 3
    if ta.rank != lead + 3 or any(x != 1 for x in list(ta.shape[:lead]) + list(tc.shape[:lead])):
        raise AnsorError(f"amx: register tile {ta} x {tb} -> {tc} has a batch of more than one")
    mr, kc, group = ta.shape[lead:]
    ins = str(ta.element_type)
    if (
        GROUPS.get(ins) != group
        or ACCUMULATORS[ins] != str(tc.element_type)
        or tb.element_type != ta.element_type
        or tuple(tb.shape[lead:]) != (kc, tc.shape[lead + 1], group)
        or tc.shape[lead] != mr
        or kc % TILE
        or tc.shape[lead + 1] % TILE
    ):
        raise AnsorError(f"amx: register tile {ta} x {tb} -> {tc} is not bf16 pairs or byte quads in whole tiles "
                         "of 16 columns and 16 groups")
    return ta, tb, tc


def amx_microkernels(module: ir.Module) -> int:
    """Replace every register tile tagged `AMX_ATTR` by its AMX program;
    returns how many. Raises `AnsorError` on a tagged op it cannot compute
    (a schedule of the rule gone wrong: the candidate fails, loudly)."""
    count = 0
    cache: dict[tuple, ir.Module] = {}  # the parsed programs (their ops live as long as these)
    tagged = [op for op in walk_op(module.operation, "linalg.generic") if AMX_ATTR in op.attributes]
    for op in tagged:
        ta, tb, tc = _check(op)
        unsigned = _unsigned(op)
        key = (str(ta), str(tb), str(tc), unsigned)
        if key not in cache:
            cache[key] = ir.Module.parse(_program(ta, tb, tc, unsigned))
        with ir.InsertionPoint(op), op.location:
            inline_body(cache[key].body.operations[0].operation, list(op.operands))
        op.erase()
        count += 1
    if count:
        log.debug("amx: %d register tile(s) on AMX", count)
    return count
