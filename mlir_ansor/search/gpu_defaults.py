"""Default knob values for GPU sketches: what a task nobody tuned for a CUDA
target is compiled with (`cuda_compiler`).

CPU sketches name a preferred point (`Sketch.prefer`, `sketch.default_assignment`);
GPU sketches have hardware limits beyond their knobs' options (threads per
block, shared memory, register tiles, derived copy knobs: `GpuSketch.violation`),
so a preferred point per knob would often be invalid. Instead
:func:`default_gpu_assignments` draws valid assignments (seeded, so the
default is the same on every compile) and ranks them by :func:`score`, a few
rules of thumb of CUDA tuning:

  * blocks of about 256 threads (8 warps; tensor-core sketches 4 warps):
    enough warps to hide latency, small enough for several blocks per SM;
  * contractions: a register tile of 16-64 outputs per thread (each operand
    element loaded is reused that often; one output per thread is the naive
    kernel this module exists to avoid), operand tiles in shared memory, a
    reduction tile of 16-32; on sm_80+ the staged sketches' copies in
    ``cp.async`` stages: three for tensor-core tiles, two for FMA tiles
    (the copies of the next steps in flight while one computes);
  * other ops: 1-4 outputs per thread (elementwise and row reductions have
    no reuse to gain from more);
  * enough blocks to fill the GPU (two per SM, where the task has about
    a thousand outputs per block for them).

Why not the cost model: a task nobody tuned has no measurements on this
target, and a model trained elsewhere is no better than these rules on the
first build; tuning replaces them.
"""

from __future__ import annotations

import math
import random

from mlir_ansor.errors import UnsupportedError
from mlir_ansor.search.gpu_sketch import GpuSketch
from mlir_ansor.search.sketch import OpStructure, prepare_payload
from mlir_ansor.search.space import Assignment, make_assignment
from mlir_ansor.target import Target

__all__ = ["CONTRACTION_SKETCHES", "default_gpu_assignments", "score"]

CONTRACTION_SKETCHES = ("cuda-mma-smem", "cuda-tiled", "cuda-mma", "cuda-conv-smem", "cuda-contraction")
"""Sketches that schedule a contraction with reuse (register or warp tiles);
``cuda-default`` is the only other GPU sketch."""

_SM_COUNT = {70: 80, 75: 68, 80: 108, 86: 84, 89: 128, 90: 132, 100: 148}
"""Streaming multiprocessors of the largest part of each architecture (the
grid should fill them; a smaller part is filled all the more)."""


def _tiled_ranges(sketch: GpuSketch) -> tuple[tuple[int, ...], bool, bool]:
    """Loop extents of the op whose loops the sketch's ``b_d<i>`` knobs tile
    (the root for ``cuda-default``, the anchor otherwise); whether the
    task is a contraction with reuse (a reduction over two or more inputs:
    matmul, convolution), whatever sketch schedules it; and whether it has
    fused consumers (an epilogue)."""
    _, ops = prepare_payload(sketch.payload)
    anchor = next((o for o in ops if o.role == "anchor"), None)
    if anchor is None:
        anchor = ([o for o in ops if o.reductions] or list(ops))[-1]
    contraction = bool(anchor.reductions) and anchor.num_inputs >= 2 and all(d is not None for d in anchor.output_dims)
    fused = any(o.role == "fused" for o in ops)
    if sketch.name == "cuda-default":
        roots: list[OpStructure] = [o for o in ops if o.is_root]
        return (roots[-1] if roots else anchor).loop_ranges, contraction, fused
    return anchor.loop_ranges, contraction, fused


def score(sketch: GpuSketch, assignment: Assignment, ranges: tuple[int, ...], target: Target, *,
          contraction: bool = False, fused: bool = False) -> float:
    """How far `assignment` is from the rules of thumb above (0 is ideal;
    lower is better). `ranges`: the extents of the loops the ``b_d<i>``
    knobs tile; `contraction`: the task reuses its operands (a matmul or a
    convolution, whichever sketch schedules it); `fused`: it has an
    epilogue, whose input tile (the block's) each thread keeps in local
    memory (`passes.cuda_kernels.device_allocs_to_stack`), so a block tile
    past 2 KB costs."""
    v = dict(assignment)
    threads = sketch.block_threads(assignment)
    contraction = contraction or sketch.name in CONTRACTION_SKETCHES
    penalty = abs(math.log2(threads / (128 if sketch.warps else 256)))
    tile = 1
    for block, thr in sketch.register_tile:
        tile *= max(1, v[block] // max(1, v[thr]))
    if contraction and not sketch.warps:
        if tile < 16:
            penalty += 2.0 * math.log2(16 / tile)
        elif tile > 64:
            penalty += math.log2(tile / 64)
    elif not contraction:
        if tile > 4:
            penalty += 0.5 * math.log2(tile / 4)
    if sketch.warps:
        mmas = 1
        for (_, warp), shape in zip(sketch.warps, sketch.mma_shape):
            mmas *= v[warp] // shape
        penalty += abs(math.log2(max(1, mmas) / 8)) * 0.5  # a 32x32 warp tile of 16x8 pieces
        area = 1
        for block, _ in sketch.warps:
            area *= v[block]
        if area < 64 * 128:  # each operand element staged in shared memory is reused by 64-128 outputs
            penalty += 0.5 * math.log2(64 * 128 / area)
    if sketch.stages_knob and target.arch >= 80:
        # cp.async stages: three for tensor-core tiles (an mma consumes a
        # K step faster than global memory delivers it), two for FMA tiles
        want_stages = 3 if sketch.warps else 2
        penalty += 0.5 * abs(sketch.stages(assignment) - want_stages)
    if sketch.smem_knob and v.get(sketch.smem_knob) == 1:
        penalty += 1.0  # operands read in place from global memory
    for name, value in v.items():
        if name.startswith("k_d"):
            penalty += 0.5 * abs(math.log2(min(max(value, 16), 32) / value)) if value else 0.0
    blocks = outputs = 1
    for name, value in v.items():
        if name.startswith("b_d") and name[3:].isdigit() and int(name[3:]) < len(ranges):
            blocks *= -(-ranges[int(name[3:])] // max(1, value))
            outputs *= ranges[int(name[3:])]
    if fused and blocks:
        tile_bytes = 4 * outputs // blocks
        if tile_bytes > 2048:
            penalty += 0.5 * math.log2(tile_bytes / 2048)
    want = 2 * _SM_COUNT.get(target.arch, 132)
    # The blocks that fill the GPU, where the task has work for them (a
    # block of fewer than about 1024 outputs is mostly overhead).
    reachable = min(want, max(1, outputs // 1024))
    if blocks < reachable:
        penalty += 0.5 * math.log2(reachable / blocks)
    return penalty


def _enumerate(sketch: GpuSketch, limit: int) -> list[Assignment] | None:
    """Every assignment of the sketch's knobs (derived knobs completed), or
    None when there are more than `limit`."""
    derived = {d[0] for d in sketch.derived}
    out: list[Assignment] = []
    chosen: dict[str, int] = {}
    knobs = sketch.knobs

    def visit(i: int) -> bool:
        if i == len(knobs):
            out.append(make_assignment(chosen))
            return len(out) <= limit
        k = knobs[i]
        for value in (k.options[:1] if k.name in derived else k.allowed(chosen)):
            chosen[k.name] = value
            if not visit(i + 1):
                return False
        del chosen[k.name]
        return True

    if not visit(0):
        return None
    return [sketch.complete(a) for a in out]


def default_gpu_assignments(sketch: GpuSketch, target: Target, *, count: int = 4, limit: int = 60000,
                            draws: int = 2000, seed: int = 0) -> list[Assignment]:
    """Up to `count` distinct valid assignments of `sketch`, best
    (:func:`score`) first: every assignment where the space has at most
    `limit`, else `draws` drawn with a fixed `seed`; the same on every call.
    Raises :class:`UnsupportedError` when none is valid."""
    ranges, contraction, fused = _tiled_ranges(sketch)
    pool = _enumerate(sketch, limit)
    if pool is None:
        rng = random.Random(seed)
        pool = []
        for _ in range(draws):
            try:
                pool.append(sketch.sample(rng))
            except UnsupportedError:
                break
    seen: dict[Assignment, float] = {}
    for a in pool:
        if a not in seen and sketch.violation(a) is None:
            seen[a] = score(sketch, a, ranges, target, contraction=contraction, fused=fused)
    ranked = sorted(seen, key=lambda a: (seen[a], sorted(dict(a).items())))
    if not ranked:
        raise UnsupportedError(f"{sketch.name}: no knob assignment within the limits of {target.key}")
    return ranked[:count]
