"""GPU sketches: transform-dialect schedules with knobs for NVIDIA targets,
and the limits their knobs must respect.

Roadmap: the GPU sketch rules (``search/rules/gpu_*.py``, run by
`search.generate.generate_sketches` for a ``Target.cuda()`` as the CPU
rules are for a CPU target) make :class:`GpuSketch` objects; in registry
order:

  * ``cuda-staged-matmul`` (`rules/gpu_staged_matmul.py`; plain f16/f32
    matmuls): operand tiles staged in shared memory, the output tile in
    registers: ``cuda-mma-smem`` (f16, tensor cores) and ``cuda-tiled``;
  * ``cuda-mma`` (`rules/gpu_mma.py`; f16/f32 ``linalg.matmul`` only): block
    tiles mapped to ``#gpu.block``, warp tiles mapped to ``#gpu.warp``, the
    warp tile cut into 16x8xK pieces that
    ``transform.nvgpu.rewrite_matmul_as_mma_sync`` turns into tensor-core
    ``mma.sync`` (f16, or tf32 for f32);
  * ``cuda-contraction`` (`rules/gpu_contraction.py`; the matmul family and
    convolutions, read from the op's structure): block tiles
    (``#gpu.block``), a reduction (cache) tile of the innermost reduction
    loop, an alternative ``smem`` that copies the input tiles into shared
    memory (cooperatively, by all threads of the block), and threads
    (``#gpu.thread``) each computing a register tile; for a plain NHWC conv
    with unit strides first ``cuda-conv-smem``: one coalesced K loop over
    (kh, kw, c), input and filter tiles staged in shared memory with a
    cp.async ``stages`` knob, register tiles;
  * ``cuda-default`` (`rules/gpu_default.py`; any op: reductions, softmax
    pieces, elementwise; always added, like ``cpu-default`` on a CPU):
    block tiles and threads over the parallel loops, reductions serial per
    thread.

The sketches take the task up to bufferized loops with ``scf.forall`` ops
carrying block/thread/warp mappings (written with
`schedule.gpu_writer.GpuScheduleWriter`); `passes/nvvm.py` then maps them to
a ``gpu.launch`` (the thread counts are read from the foralls, since the
mapping ops take static block sizes), gives shared buffers a real `.shared`
home, and lowers to PTX and a cubin.

Knob limits: thread counts are at most 32 per mapped dimension (so a block
never has more than 1024 threads); the rest of the hardware limits (shared
memory per block, register tile size, warps per block) are checked by
:meth:`GpuSketch.violation`, and :func:`sample` draws assignments that pass
it. Everything that ptxas then reports (registers, spills, shared memory) is
checked again after the build (`passes.nvvm.check_limits`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from mlir_ansor.errors import UnsupportedError
from mlir_ansor.search.sketch import Sketch
from mlir_ansor.search.space import Assignment, divisors, make_assignment
from mlir_ansor.search.space import sample as sample_knobs
from mlir_ansor.target import Target

__all__ = ["GpuSketch", "sample", "target_limits"]


def target_limits(target: Target) -> dict[str, Any]:
    """The :class:`GpuSketch` fields every GPU sketch takes from its target
    (its key, threads and shared memory per block)."""
    return {
        "target_key": target.key,
        "max_threads": target.max_threads_per_block,
        "smem_limit": target.smem_per_block,
    }


def _term(term: str, values: dict[str, int]) -> int:
    """The value of a size term: a count, a knob, or a product of those
    written ``a*b``."""
    out = 1
    for part in term.split("*"):
        out *= int(part) if part.isdigit() else values[part]
    return out


@dataclass(frozen=True)
class GpuSketch(Sketch):
    """A sketch for a CUDA target, with the limits its knobs must respect.

    threads: per mapped axis ("x", "y"), the thread-count knob (or a fixed
      count as a string of digits) of the thread level.
    warps: per axis, (block tile knob, warp tile knob) of an MMA sketch.
    register_tile: knob pairs (block tile, thread count) whose quotient is
      the per-thread tile; their product is bounded by `max_register_tile`.
    smem_tiles: per promoted operand, per dimension, the tile extent as a
      list of (knob or fixed extent) terms: extent = sum(term) - (n - 1).
    smem_knob: the alternatives knob that selects promotion (value 0).
    staged: the tiles of `smem_tiles` are always in shared memory.
    stages_knob: the knob of how many shared-memory stages the operand
      copies get ("": one); the tiles of `smem_tiles` at the indices
      `multibuffered` count that many times.
    pipelined_copies: derived copy knobs whose copies are pipelined with
      ``cp.async`` when the stages knob is above 1: each must give every
      thread of the block exactly one piece per step (a predicated copy
      leaves an ``scf.if`` in the K loop, which the nvgpu pipeliner refuses).
    stage_loop: (step knob, extent) of the pipelined loop: it needs at
      least as many steps as there are stages.
    choices: alternatives knobs that stand for a count (a transform op
      that takes only static sizes, written once per option): per knob,
      the count of each region index, read where `threads` names it.
    min_register_dim: least extent of the register tile along each axis
      (vectorized sketches: a unit dimension leaves an n-D broadcast that
      the NVVM lowering cannot convert).
    derived: knobs whose value follows from the others (see `complete`):
      (knob, rows term, cols term, vector width) of a copy distributed over
      all threads of the block in vector-wide pieces; the knob is how many
      rows one thread copies per piece, the least that lets the block's
      threads cover the tile. A term is a knob, a count, or a product of
      those written ``a*b`` (the conv's input tile: its columns are
      ``b_d1*k_d6``, output rows times channels).
    """

    target_key: str = ""
    max_threads: int = 1024
    smem_limit: int = 48 * 1024
    threads: tuple[tuple[str, str], ...] = ()
    warps: tuple[tuple[str, str], ...] = ()
    register_tile: tuple[tuple[str, str], ...] = ()
    max_register_tile: int = 64
    smem_tiles: tuple[tuple[int, tuple[tuple[str, ...], ...]], ...] = ()
    smem_knob: str = ""
    max_mma_per_warp: int = 16
    min_threads: int = 1
    derived: tuple[tuple[str, str, str, int], ...] = ()
    staged: bool = False
    min_register_dim: int = 1
    mma_shape: tuple[int, int] = (16, 8)
    stages_knob: str = ""
    multibuffered: tuple[int, ...] = ()
    pipelined_copies: tuple[str, ...] = ()
    stage_loop: tuple[str, int] = ("", 0)
    choices: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def sample(self, rng: random.Random) -> Assignment:
        """A random assignment within the target's limits (:func:`sample`)."""
        return sample(self, rng)

    def block_threads(self, assignment: Assignment) -> int:
        v = dict(assignment)
        n = 1
        counts = dict(self.choices)
        for _, knob in self.threads:
            n *= int(knob) if knob.isdigit() else counts[knob][v[knob]] if knob in counts else v[knob]
        if self.warps:
            w = 1
            for block, warp in self.warps:
                w *= v[block] // v[warp]
            n *= w * 32
        return n

    def derived_values(self, assignment: Assignment) -> dict[str, int]:
        """The value each derived knob must take under `assignment`: rows
        per copy piece r, the least divisor of the tile's rows with
        (rows / r) * (cols / width) <= threads (0: no such divisor)."""
        v = dict(assignment)
        threads = self.block_threads(assignment)
        out = {}
        for knob, rows_t, cols_t, width in self.derived:
            rows, cols = _term(rows_t, v), _term(cols_t, v)
            need = -(-(rows * max(1, cols // width)) // max(1, threads))
            out[knob] = min((d for d in divisors(rows) if d >= need), default=0)
        return out

    def complete(self, assignment: Assignment) -> Assignment:
        """`assignment` with every derived knob set to its value."""
        v = dict(assignment)
        v.update({k: x for k, x in self.derived_values(assignment).items() if x})
        return make_assignment(v)

    def smem_bytes(self, assignment: Assignment) -> int:
        v = dict(assignment)
        if not self.staged and (not self.smem_knob or v.get(self.smem_knob) != 0):
            return 0
        stages = v.get(self.stages_knob, 1) if self.stages_knob else 1
        total = 0
        for i, (nbytes, dims) in enumerate(self.smem_tiles):
            size = nbytes * (stages if i in self.multibuffered else 1)
            for terms in dims:
                ext = sum(int(t) if t.isdigit() else v[t] for t in terms) - (len(terms) - 1)
                size *= max(1, ext)
            total += size
        return total

    def stages(self, assignment: Assignment) -> int:
        """How many shared-memory stages the operand copies get (1: synchronous)."""
        return dict(assignment).get(self.stages_knob, 1) if self.stages_knob else 1

    def violation(self, assignment: Assignment) -> str | None:
        """Why `assignment` breaks a hardware limit of the target (None: it does not)."""
        v = dict(assignment)
        threads = self.block_threads(assignment)
        if threads > self.max_threads:
            return f"{threads} threads per block > {self.max_threads}"
        if threads < self.min_threads:
            return f"{threads} threads per block < {self.min_threads} (less than a warp)"
        tile = 1
        for block, thr in self.register_tile:
            extent = max(1, v[block] // max(1, v[thr]))
            if extent < self.min_register_dim:
                return f"register tile extent {extent} along {block} < {self.min_register_dim}"
            tile *= extent
        if tile > self.max_register_tile:
            return f"register tile of {tile} elements > {self.max_register_tile}"
        smem = self.smem_bytes(assignment)
        if smem > self.smem_limit:
            return f"{smem} bytes of shared memory > {self.smem_limit}"
        if self.warps:
            mmas = 1
            for (_block, warp), shape in zip(self.warps, self.mma_shape):
                mmas *= v[warp] // shape
            if mmas > self.max_mma_per_warp:
                return f"{mmas} mma tiles per warp > {self.max_mma_per_warp}"
        for knob, want in self.derived_values(assignment).items():
            if not want:
                return f"{knob}: the block's {threads} threads cannot cover the copied tile"
            if v.get(knob) != want:
                return f"{knob} = {v.get(knob)}, but the tile and thread counts make it {want}"
        stages = self.stages(assignment)
        step, extent = self.stage_loop
        if stages > 1 and step and extent // max(1, v[step]) < stages:
            return f"{stages} stages > {extent // max(1, v[step])} steps of the K loop"
        if stages > 1:
            for knob, rows_t, cols_t, width in self.derived:
                if knob not in self.pipelined_copies:
                    continue
                rows, cols = _term(rows_t, v), _term(cols_t, v)
                pieces = rows // max(1, v[knob]) * max(1, cols // width)
                if pieces != threads:
                    return (f"{stages} stages: the copy of {knob} has {pieces} pieces for {threads} threads "
                            "(cp.async pipelining needs one per thread)")
        return None


def sample(sketch: Sketch, rng: random.Random, tries: int = 500) -> Assignment:
    """Draw a knob assignment that respects the sketch's limits (rejection
    sampling over `space.sample`; raises when none is found)."""
    for _ in range(tries):
        a = sample_knobs(sketch.knobs, rng)
        if isinstance(sketch, GpuSketch):
            a = sketch.complete(a)
        if not isinstance(sketch, GpuSketch) or sketch.violation(a) is None:
            return a
    raise UnsupportedError(f"{sketch.name}: no knob assignment within the target's limits found in {tries} draws")
