"""GPU sketches: transform-dialect schedules with knobs for NVIDIA targets.

Roadmap: :func:`generate_gpu_sketches` returns, for one task, the sketches a
CUDA target (``Target.cuda()``) gets, best first:

  * ``cuda-mma`` (f16/f32 ``linalg.matmul`` only): block tiles mapped to
    ``#gpu.block``, warp tiles mapped to ``#gpu.warp``, the warp tile cut
    into 16x8xK pieces that ``transform.nvgpu.rewrite_matmul_as_mma_sync``
    turns into tensor-core ``mma.sync`` (f16, or tf32 for f32);
  * ``cuda-contraction`` (the matmul family and convolutions, read from the
    op's structure): block tiles (``#gpu.block``), a reduction (cache) tile
    of the innermost reduction loop, an alternative ``smem`` that copies the
    input tiles into shared memory (cooperatively, by all threads of the
    block), and threads (``#gpu.thread``) each computing a register tile;
  * ``cuda-default`` (any op: reductions, softmax pieces, elementwise):
    block tiles and threads over the parallel loops, reductions serial per
    thread.

The sketches take the task up to bufferized loops with ``scf.forall`` ops
carrying block/thread/warp mappings; `passes/nvvm.py` then maps them to a
``gpu.launch`` (the thread counts are read from the foralls, since the
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

from mlir_ansor.errors import UnsupportedError
from mlir_ansor.ir.dtypes import element_bytes
from mlir_ansor.schedule.writer import ANY, PARAM, ScheduleWriter, Size
from mlir_ansor.search.sketch import OpStructure, Sketch, prepare_payload
from mlir_ansor.search.space import Assignment, KnobSpec, divisors, make_assignment
from mlir_ansor.search.space import sample as _sample_knobs
from mlir_ansor.target import Target

_THREADS = (1, 2, 4, 8, 16, 32)
_AXES = ("x", "y", "z")


def _bytes(dtype: str) -> int:
    return element_bytes(dtype)


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
    min_register_dim: least extent of the register tile along each axis
      (vectorized sketches: a unit dimension leaves an n-D broadcast that
      the NVVM lowering cannot convert).
    derived: knobs whose value follows from the others (see `complete`):
      (knob, rows term, cols term, vector width) of a copy distributed over
      all threads of the block in vector-wide pieces; the knob is how many
      rows one thread copies per piece, the least that lets the block's
      threads cover the tile.
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

    def sample(self, rng: random.Random) -> Assignment:
        """A random assignment within the target's limits (:func:`sample`)."""
        return sample(self, rng)

    def block_threads(self, assignment: Assignment) -> int:
        v = dict(assignment)
        n = 1
        for _, knob in self.threads:
            n *= int(knob) if knob.isdigit() else v[knob]
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
            rows = int(rows_t) if rows_t.isdigit() else v[rows_t]
            cols = int(cols_t) if cols_t.isdigit() else v[cols_t]
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
        total = 0
        for nbytes, dims in self.smem_tiles:
            size = nbytes
            for terms in dims:
                ext = sum(int(t) if t.isdigit() else v[t] for t in terms) - (len(terms) - 1)
                size *= max(1, ext)
            total += size
        return total

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
        return None


def sample(sketch: Sketch, rng: random.Random, tries: int = 500) -> Assignment:
    """Draw a knob assignment that respects the sketch's limits (rejection
    sampling over `space.sample`; raises when none is found)."""
    for _ in range(tries):
        a = _sample_knobs(sketch.knobs, rng)
        if isinstance(sketch, GpuSketch):
            a = sketch.complete(a)
        if not isinstance(sketch, GpuSketch) or sketch.violation(a) is None:
            return a
    raise UnsupportedError(f"{sketch.name}: no knob assignment within the target's limits found in {tries} draws")


# --------------------------------------------------------------------------
# Writer helpers (transform ops the CPU writer does not need)
# --------------------------------------------------------------------------


class GpuScheduleWriter(ScheduleWriter):
    """A :class:`ScheduleWriter` with the mapped tiling and promotion steps
    GPU sketches are made of."""

    def tile_forall_mapped(
        self, op: str, sizes: list[Size], mapping: list[str], *, num_threads: bool = False
    ) -> tuple[str, str]:
        """`tile_using_forall` with a device mapping (one entry per non-zero
        size); `num_threads`: the sizes are thread counts, not tile sizes."""
        text, params = self._sizes(sizes)
        t, loop = self._fresh("t"), self._fresh("forall")
        in_types = ", ".join([ANY] + [PARAM] * len(params))
        kind = "num_threads" if num_threads else "tile_sizes"
        self.emit(
            f"{t}, {loop} = transform.structured.tile_using_forall {op} {kind} {text} "
            f"(mapping = [{', '.join(mapping)}]) : ({in_types}) -> ({ANY}, {ANY})"
        )
        return t, loop

    def promote_inputs(self, op: str, inputs: list[int], num_operands: int, dtype: str) -> tuple[str, list[str]]:
        """Copy input operands `inputs` of `op` into fresh buffers (a no-fold
        `pad` rewritten to `linalg.copy` into `bufferization.alloc_tensor`).
        Returns the op after padding and, per input, the handle of its copy."""
        padded, pad, copy = self._fresh("padded"), self._fresh("pad"), self._fresh("copy")
        zeros = ", ".join([f"0.0 : {dtype}"] * num_operands)
        nofold = ", ".join("1" if i in inputs else "0" for i in range(num_operands))
        self.emit(
            f"{padded}, {pad}, {copy} = transform.structured.pad {op} {{padding_values = [{zeros}], "
            f'nofold_flags = [{nofold}], copy_back_op = "none"}} '
            f": ({ANY}) -> ({ANY}, {ANY}, {ANY})"
        )
        copies = []
        for i in inputs:
            producer = self._fresh("prod")
            self.emit(f"{producer} = transform.get_producer_of_operand {padded}[{i}] : ({ANY}) -> {ANY}")
            self.emit(
                f"transform.structured.rewrite_in_destination_passing_style {producer} : ({ANY}) -> {ANY}"
            )
            c = self._fresh("cp")
            self.emit(f"{c} = transform.get_producer_of_operand {padded}[{i}] : ({ANY}) -> {ANY}")
            copies.append(c)
        return padded, copies

    def distribute_linear(self, op: str, sizes: list[Size]) -> str:
        """Tile `op` into pieces of `sizes` spread over all threads of the
        block by their linear id (`#gpu.thread<linear_dim_i>`: the forall
        may have any shape up to the block's thread count); returns the
        forall."""
        n = sum(1 for s in sizes if not (isinstance(s, int) and s == 0))
        mapping = [f"#gpu.thread<linear_dim_{i}>" for i in reversed(range(n))]
        _, loop = self.tile_forall_mapped(op, sizes, mapping)
        return loop

    def to_workgroup_memory(self, container: str) -> None:
        """Put every `bufferization.alloc_tensor` under `container` in
        workgroup (shared) memory."""
        allocs = self.match_ops(container, ["bufferization.alloc_tensor"])
        space = self._fresh("space")
        self.emit(f"{space} = transform.param.constant #gpu.address_space<workgroup> -> !transform.any_param")
        self.emit(f'transform.annotate {allocs} "memory_space" = {space} : {ANY}, !transform.any_param')

    def gpu_bufferize(self, root: str) -> str:
        """Canonicalize, bufferize (copies as `linalg.copy`, which lower to
        loops on the device), canonicalize again; returns the new root."""
        func = self.match_func(root)
        self.emit(f"transform.apply_patterns to {func} {{")
        self.emit("  transform.apply_patterns.canonicalization")
        self.emit(f"}} : {ANY}")
        self.emit(f"transform.apply_cse to {func} : {ANY}")
        h = self._fresh("buf")
        self.emit(
            f"{h} = transform.bufferization.one_shot_bufferize {root} "
            '{bufferize_function_boundaries = true, function_boundary_type_conversion = 1 : i32, memcpy_op = "linalg.copy"} '
            f": ({ANY}) -> {ANY}"
        )
        func = self.match_func(h)
        self.emit(f"transform.apply_patterns to {func} {{")
        self.emit("  transform.apply_patterns.canonicalization")
        self.emit(f"}} : {ANY}")
        return h

    def mma_sync(self, root: str) -> None:
        mm = self.match_ops(root, ["linalg.matmul"])
        self.emit(f"transform.nvgpu.rewrite_matmul_as_mma_sync {mm} : ({ANY}) -> ()")


# --------------------------------------------------------------------------
# Rules
# --------------------------------------------------------------------------


def generate_gpu_sketches(task_mlir: str, target: Target) -> list[GpuSketch]:
    """The GPU sketches of one task (best first; the last one always applies)."""
    if target.kind != "cuda":
        raise UnsupportedError(f"GPU sketches need a CUDA target, not {target.key}")
    payload, ops = prepare_payload(task_mlir)
    if not ops:
        raise UnsupportedError("task has no Linalg operation")
    # The anchor tagged by task extraction, else (a hand-written module) the
    # last op with a reduction, else the last op.
    anchors = [o for o in ops if o.role == "anchor"] or [o for o in ops if o.reductions][-1:] or [ops[-1]]
    anchor = anchors[0]
    out: list[GpuSketch] = []
    for tensor_cores in (True, False):
        staged = _staged_matmul_sketch(payload, ops, anchor, target, tensor_cores=tensor_cores)
        if staged is not None:
            out.append(staged)
    mma = _mma_sketch(payload, ops, anchor, target)
    if mma is not None:
        out.append(mma)
    con = _contraction_sketch(payload, ops, anchor, target)
    if con is not None:
        out.append(con)
    out.append(_default_sketch(payload, ops, anchor, target))
    return out


def _root(ops: tuple[OpStructure, ...], anchor: OpStructure) -> OpStructure:
    roots = [o for o in ops if o.is_root]
    return roots[-1] if roots else anchor


def _is_contraction(op: OpStructure) -> bool:
    out = op.output_dims
    return (
        bool(op.reductions)
        and all(d is not None for d in out)
        and "pooling" not in op.name
        and op.num_inputs >= 2
    )


def _axes_of(dims: list[int]) -> dict[int, str]:
    """The innermost loop gets x, the next y, the next z."""
    return {d: _AXES[i] for i, d in enumerate(reversed(dims))}


def _mapping(sizes: list[Size], axes: dict[int, str], kind: str) -> list[str]:
    return [f"#gpu.{kind}<{axes[d]}>" for d, s in enumerate(sizes) if not (isinstance(s, int) and s == 0)]


def _fuse_rest(w: GpuScheduleWriter, ops: tuple[OpStructure, ...], root: OpStructure, forall: str) -> str:
    for o in reversed(ops):
        if o.op_id != root.op_id:
            _, forall = w.fuse_into(w.match_op_id("%root", o.op_id), forall)
    return forall


def _sizes_for(o: OpStructure, anchor: OpStructure, per_anchor_dim: dict[int, Size]) -> list[Size]:
    """Tile sizes for op `o` that follow the anchor's output tiling."""
    sizes: list[Size] = [0] * len(o.loop_ranges)
    for a_d, o_d in zip(anchor.output_dims, o.output_dims):
        if a_d is not None and o_d is not None and a_d in per_anchor_dim:
            sizes[o_d] = per_anchor_dim[a_d]
    return sizes


def _operand_tile_terms(op: OpStructure, operand: int, tile: dict[int, str]) -> tuple[tuple[str, ...], ...]:
    """Per dimension of `operand`, the tile-extent terms (see `GpuSketch.smem_tiles`)."""
    compound = list(op.compound_dims)
    index = 0
    for i in range(operand):
        index += sum(1 for d in op.operand_dims[i] if d is None)
    dims = []
    for d in op.operand_dims[operand]:
        if d is not None:
            dims.append((tile.get(d, str(op.loop_ranges[d])),))
        else:
            loops = compound[index] if index < len(compound) else ()
            index += 1
            dims.append(tuple(tile.get(l_, str(op.loop_ranges[l_])) for l_ in loops) or ("1",))
    return tuple(dims)


def _contraction_sketch(
    payload: str, ops: tuple[OpStructure, ...], anchor: OpStructure, target: Target
) -> GpuSketch | None:
    if not _is_contraction(anchor):
        return None
    ranges = anchor.loop_ranges
    par = [d for d in anchor.parallel if ranges[d] > 1]
    if not par or len(par) > 3:
        return None
    reds = [d for d in anchor.reductions if ranges[d] > 1]
    if not reds:
        return None
    kr = reds[-1]
    axes = _axes_of(par)
    thread_dims = [d for d in par if axes[d] in ("x", "y")]

    specs: list[KnobSpec] = []
    for d in par:
        limit = 256 if axes[d] in ("x", "y") else 4
        opts = tuple(x for x in divisors(ranges[d]) if x <= limit)
        specs.append(KnobSpec(f"b_d{d}", opts, doc=f"block tile of loop d{d} (#gpu.block<{axes[d]}>)"))
    for d in thread_dims:
        specs.append(
            KnobSpec(f"t_d{d}", _THREADS, divides=f"b_d{d}", doc=f"threads along loop d{d} (#gpu.thread<{axes[d]}>)")
        )
    specs.append(KnobSpec(f"k_d{kr}", tuple(x for x in divisors(ranges[kr]) if x <= 64), doc=f"reduction tile of loop d{kr}"))
    inputs = [i for i in range(anchor.num_inputs) if len(anchor.operand_dims[i]) >= 1]
    specs.append(
        KnobSpec("smem", (0, 1), alternatives=True, doc="0: copy the input tiles to shared memory; 1: read them from global memory")
    )

    w = GpuScheduleWriter()
    h = {sp.name: w.knob(sp.name, sp.options) for sp in specs if not sp.alternatives}
    root = _root(ops, anchor)

    # Level 1: blocks, over the root, with the rest of the task fused in.
    block = {d: h[f"b_d{d}"] for d in par}
    root_sizes = _sizes_for(root, anchor, block)
    root_axes = {o_d: axes[a_d] for a_d, o_d in zip(anchor.output_dims, root.output_dims) if a_d in axes}
    _, forall = w.tile_forall_mapped(w.match_op_id("%root", root.op_id), root_sizes, _mapping(root_sizes, root_axes, "block"))
    forall = _fuse_rest(w, ops, root, forall)

    # Level 2: the reduction (cache) tile of the innermost reduction loop.
    a_h = w.match_op_id(forall, anchor.op_id)
    k_sizes: list[Size] = [0] * len(ranges)
    k_sizes[kr] = h[f"k_d{kr}"]
    a_h, _ = w.tile_for(a_h, k_sizes)

    threads = {d: h[f"t_d{d}"] for d in thread_dims}
    thread_axes = {d: axes[d] for d in thread_dims}

    # Level 3 (structural): the input tiles in shared memory, copied by all
    # threads of the block, or read in place.
    def in_place(wr: GpuScheduleWriter) -> list[str]:
        return [a_h]

    # Copies are distributed over the last two dimensions of each tile,
    # with the thread counts of the compute level (same block shape).
    def promote_real(wr: GpuScheduleWriter) -> list[str]:
        padded, copies = wr.promote_inputs(a_h, inputs, len(anchor.operand_dims), anchor.dtype)
        for i, c in zip(inputs, copies):
            rank = len(anchor.operand_dims[i])
            counts: list[Size] = [0] * rank
            ts = [threads[d] for d in sorted(thread_dims)]  # y (outer) then x
            tail = ts[-rank:] if rank < len(ts) else ts
            for j, t in enumerate(tail):
                counts[rank - len(tail) + j] = t
            cmap = [f"#gpu.thread<{a}>" for a in ("y", "x")[2 - len(tail):]]
            wr.tile_forall_mapped(c, counts, cmap, num_threads=True)
        wr.to_workgroup_memory(forall)
        return [padded]

    (a_h,) = w.alternatives("smem", [promote_real, in_place])

    # Level 4: threads, each computing a register tile.
    t_sizes: list[Size] = [0] * len(ranges)
    for d in thread_dims:
        t_sizes[d] = threads[d]
    w.tile_forall_mapped(a_h, t_sizes, _mapping(t_sizes, thread_axes, "thread"), num_threads=True)
    for o in ops:
        if o.op_id == anchor.op_id:
            continue
        sizes = _sizes_for(o, anchor, threads)
        o_axes = {o_d: axes[a_d] for a_d, o_d in zip(anchor.output_dims, o.output_dims) if a_d in thread_axes and o_d is not None}
        if any(not (isinstance(s, int) and s == 0) for s in sizes):
            w.tile_forall_mapped(w.match_op_id(forall, o.op_id), sizes, _mapping(sizes, o_axes, "thread"), num_threads=True)
    w.gpu_bufferize("%root")

    tile_terms = {d: f"b_d{d}" for d in par}
    tile_terms[kr] = f"k_d{kr}"
    smem_tiles = tuple(
        (_bytes(anchor.dtype), _operand_tile_terms(anchor, i, tile_terms)) for i in inputs
    )
    return GpuSketch(
        "cuda-contraction",
        payload,
        w.text(),
        tuple(specs),
        target_key=target.key,
        max_threads=target.max_threads_per_block,
        smem_limit=target.smem_per_block,
        threads=tuple((axes[d], f"t_d{d}") for d in thread_dims),
        register_tile=tuple((f"b_d{d}", f"t_d{d}") for d in thread_dims),
        smem_tiles=smem_tiles,
        smem_knob="smem",
        min_threads=_min_threads(ranges, thread_dims, target),
    )


def _min_threads(ranges: tuple[int, ...], thread_dims: list[int], target: Target) -> int:
    """At least a warp per block, where the loops are that large."""
    n = 1
    for d in thread_dims:
        n *= ranges[d]
    return min(target.warp_size or 32, n)


def _mma_sketch(
    payload: str, ops: tuple[OpStructure, ...], anchor: OpStructure, target: Target
) -> GpuSketch | None:
    if anchor.name != "linalg.matmul" or anchor.dtype not in ("f16", "f32") or target.arch < 80:
        return None
    m, n, k = anchor.loop_ranges
    kmma = 16 if anchor.dtype == "f16" else 4
    if m % 16 or n % 8 or k % kmma:
        return None
    if any(o.op_id != anchor.op_id and o.name != "linalg.fill" for o in ops):
        return None  # fused consumers: the contraction sketch handles them
    specs = [
        KnobSpec("b_d0", tuple(x for x in divisors(m) if x % 16 == 0 and x <= 256), doc="block tile of M (#gpu.block<y>)"),
        KnobSpec("b_d1", tuple(x for x in divisors(n) if x % 8 == 0 and x <= 256), doc="block tile of N (#gpu.block<x>)"),
        KnobSpec("w_d0", tuple(x for x in (16, 32, 64, 128) if m % x == 0), divides="b_d0", doc="warp tile of M (#gpu.warp<y>)"),
        KnobSpec("w_d1", tuple(x for x in (8, 16, 32, 64, 128) if n % x == 0), divides="b_d1", doc="warp tile of N (#gpu.warp<x>)"),
        KnobSpec("k_d2", tuple(x for x in divisors(k) if x % kmma == 0 and x <= 128), doc="reduction tile of K"),
    ]
    w = GpuScheduleWriter()
    h = {sp.name: w.knob(sp.name, sp.options) for sp in specs}
    _, forall = w.tile_forall_mapped(
        w.match_op_id("%root", anchor.op_id), [h["b_d0"], h["b_d1"]], ["#gpu.block<y>", "#gpu.block<x>"]
    )
    forall = _fuse_rest(w, ops, anchor, forall)
    a_h = w.match_op_id(forall, anchor.op_id)
    a_h, _ = w.tile_for(a_h, [0, 0, h["k_d2"]])
    a_h, _ = w.tile_forall_mapped(a_h, [h["w_d0"], h["w_d1"]], ["#gpu.warp<y>", "#gpu.warp<x>"])
    for o in ops:
        if o.op_id != anchor.op_id:
            w.tile_forall_mapped(w.match_op_id(forall, o.op_id), [h["w_d0"], h["w_d1"]], ["#gpu.warp<y>", "#gpu.warp<x>"])
    w.tile_for(a_h, [16, 8, kmma])
    buf = w.gpu_bufferize("%root")
    w.mma_sync(w.match_func(buf))
    return GpuSketch(
        "cuda-mma",
        payload,
        w.text(),
        tuple(specs),
        target_key=target.key,
        max_threads=target.max_threads_per_block,
        smem_limit=target.smem_per_block,
        warps=(("b_d0", "w_d0"), ("b_d1", "w_d1")),
    )


#: The layout of a plain matmul: A(m, k), B(k, n), C(m, n) over loops (m, n, k).
_MATMUL_DIMS = ((0, 2), (2, 1), (0, 1))


def _is_plain_matmul(op: OpStructure) -> bool:
    return (
        op.operand_dims == _MATMUL_DIMS
        and op.iterator_types == ("parallel", "parallel", "reduction")
        and op.is_mul_add
        and op.num_inputs == 2
    )


def _staged_matmul_sketch(
    payload: str, ops: tuple[OpStructure, ...], anchor: OpStructure, target: Target, *, tensor_cores: bool
) -> GpuSketch | None:
    """A matmul with its operand tiles staged in shared memory and its
    output tile kept in registers across the whole K loop.

    Per block (``#gpu.block``) a BM x BN tile of C; a loop over K in steps
    of BK; in each step all threads of the block copy the BM x BK tile of A
    and the BK x BN tile of B to `.shared` in 16-byte pieces (the copy is a
    forall over the block's linear thread id, so the copy's shape does not
    need to match the compute's thread shape; a barrier follows), then
    compute from shared memory:

      * ``cuda-mma-smem`` (f16, sm_80+): each warp (``#gpu.warp``) a WM x WN
        tile, as a vector contraction that `passes/nvvm.py` unrolls to
        16x8x16 and turns into ``ldmatrix`` + ``mma.sync``;
      * ``cuda-tiled`` (f16, f32): each thread (``#gpu.thread``) a register
        tile of (BM / threads_y) x (BN / threads_x), as a vector
        contraction lowered to FMAs.

    The operand tiles are vectorized here; `passes/nvvm.py` hoists the
    output tile's read and write out of the K loop once the thread foralls
    are mapped, which is what keeps the accumulator in registers.
    """
    if not _is_plain_matmul(anchor) or anchor.dtype not in ("f16", "f32"):
        return None
    if any(o.op_id != anchor.op_id and o.name != "linalg.fill" for o in ops):
        return None  # fused consumers: the contraction sketch handles them
    if tensor_cores and (anchor.dtype != "f16" or target.arch < 80):
        return None
    m, n, k = anchor.loop_ranges
    vw = 16 // _bytes(anchor.dtype)  # elements per 16-byte global load
    if tensor_cores:
        if m % 16 or n % 8 or k % 16 or n % vw:
            return None
        block_m = tuple(x for x in divisors(m) if x % 16 == 0 and 32 <= x <= 256)
        block_n = tuple(x for x in divisors(n) if x % 8 == 0 and x % vw == 0 and 32 <= x <= 256)
        k_opts = tuple(x for x in divisors(k) if x % 16 == 0 and x <= 64)
    else:
        if k % vw or n % vw:
            return None
        block_m = tuple(x for x in divisors(m) if 8 <= x <= 256)
        block_n = tuple(x for x in divisors(n) if x % vw == 0 and 16 <= x <= 256)
        k_opts = tuple(x for x in divisors(k) if x % vw == 0 and x <= 64)
    if not block_m or not block_n or not k_opts:
        return None
    specs = [
        KnobSpec("b_d0", block_m, doc="block tile of M (#gpu.block<y>)"),
        KnobSpec("b_d1", block_n, doc="block tile of N (#gpu.block<x>)"),
    ]
    if tensor_cores:
        specs += [
            KnobSpec("w_d0", tuple(x for x in (16, 32, 64, 128) if m % x == 0), divides="b_d0", doc="warp tile of M (#gpu.warp<y>)"),
            KnobSpec("w_d1", tuple(x for x in (8, 16, 32, 64, 128) if n % x == 0), divides="b_d1", doc="warp tile of N (#gpu.warp<x>)"),
        ]
    else:
        specs += [
            KnobSpec("t_d0", _THREADS, divides="b_d0", doc="threads along M (#gpu.thread<y>)"),
            KnobSpec("t_d1", _THREADS, divides="b_d1", doc="threads along N (#gpu.thread<x>)"),
        ]
    specs.append(KnobSpec("k_d2", k_opts, doc="reduction tile of K (one shared-memory stage)"))
    rows = tuple(x for x in divisors(max(m, k)) if x <= 256)
    copies = [("cp_a", "b_d0", "k_d2"), ("cp_b", "k_d2", "b_d1")]
    what = {"cp_a": "the A tile copy", "cp_b": "the B tile copy", "cp_c": "the zero fill of C"}
    if tensor_cores:
        copies.append(("cp_c", "b_d0", "b_d1"))
    for name, *_ in copies:
        specs.append(KnobSpec(name, rows, doc=f"rows per thread and piece of {what[name]} (derived)"))

    w = GpuScheduleWriter()
    h = {sp.name: w.knob(sp.name, sp.options) for sp in specs}
    _, forall = w.tile_forall_mapped(
        w.match_op_id("%root", anchor.op_id), [h["b_d0"], h["b_d1"]], ["#gpu.block<y>", "#gpu.block<x>"]
    )
    forall = _fuse_rest(w, ops, anchor, forall)
    a_h = w.match_op_id(forall, anchor.op_id)
    a_h, _ = w.tile_for(a_h, [0, 0, h["k_d2"]])
    padded, (copy_a, copy_b) = w.promote_inputs(a_h, [0, 1], 3, anchor.dtype)
    w.distribute_linear(copy_a, [h["cp_a"], vw])
    w.distribute_linear(copy_b, [h["cp_b"], vw])
    w.to_workgroup_memory(forall)
    fills = [o for o in ops if o.op_id != anchor.op_id]
    if tensor_cores:
        w.tile_forall_mapped(padded, [h["w_d0"], h["w_d1"]], ["#gpu.warp<y>", "#gpu.warp<x>"])
        for o in fills:
            w.distribute_linear(w.match_op_id(forall, o.op_id), [h["cp_c"], vw])
    else:
        # The fill gets the compute's thread tiles, so each thread zeroes
        # exactly its own accumulator tile (LLVM then forwards the zeros).
        mapping = ["#gpu.thread<y>", "#gpu.thread<x>"]
        w.tile_forall_mapped(padded, [h["t_d0"], h["t_d1"]], mapping, num_threads=True)
        for o in fills:
            w.tile_forall_mapped(w.match_op_id(forall, o.op_id), [h["t_d0"], h["t_d1"]], mapping, num_threads=True)
    func = w.vectorize_children(w.match_func("%root"))
    w.cleanup(func)
    w.gpu_bufferize("%root")

    common = dict(
        target_key=target.key,
        max_threads=target.max_threads_per_block,
        smem_limit=target.smem_per_block,
        smem_tiles=((_bytes(anchor.dtype), (("b_d0",), ("k_d2",))), (_bytes(anchor.dtype), (("k_d2",), ("b_d1",)))),
        staged=True,
        derived=tuple((name, r, c, vw) for name, r, c in copies),
        min_threads=32,
    )
    if tensor_cores:
        return GpuSketch(
            "cuda-mma-smem", payload, w.text(), tuple(specs),
            warps=(("b_d0", "w_d0"), ("b_d1", "w_d1")), max_mma_per_warp=32, **common,
        )
    return GpuSketch(
        "cuda-tiled", payload, w.text(), tuple(specs),
        threads=(("y", "t_d0"), ("x", "t_d1")),
        register_tile=(("b_d0", "t_d0"), ("b_d1", "t_d1")),
        max_register_tile=64, min_register_dim=2, **common,
    )


def _default_sketch(payload: str, ops: tuple[OpStructure, ...], anchor: OpStructure, target: Target) -> GpuSketch:
    """Blocks and threads over the innermost parallel loops of the root;
    reductions run serially in each thread."""
    root = _root(ops, anchor)
    ranges = root.loop_ranges
    par = [d for d in root.parallel if ranges[d] > 1][-3:]
    if not par:
        raise UnsupportedError(f"{root.name}: no parallel loop to map to GPU blocks")
    axes = _axes_of(par)
    thread_dims = [d for d in par if axes[d] in ("x", "y")]
    specs: list[KnobSpec] = []
    for d in par:
        limit = {"x": 1024, "y": 64, "z": 8}[axes[d]]
        specs.append(KnobSpec(f"b_d{d}", tuple(x for x in divisors(ranges[d]) if x <= limit), doc=f"block tile of loop d{d}"))
    for d in thread_dims:
        opts = _THREADS + ((64, 128, 256, 512, 1024) if axes[d] == "x" else ())
        specs.append(KnobSpec(f"t_d{d}", opts, divides=f"b_d{d}", doc=f"threads along loop d{d}"))
    w = GpuScheduleWriter()
    h = {sp.name: w.knob(sp.name, sp.options) for sp in specs}
    sizes: list[Size] = [0] * len(ranges)
    for d in par:
        sizes[d] = h[f"b_d{d}"]
    _, forall = w.tile_forall_mapped(w.match_op_id("%root", root.op_id), sizes, _mapping(sizes, axes, "block"))
    forall = _fuse_rest(w, ops, root, forall)
    t_sizes: list[Size] = [0] * len(ranges)
    for d in thread_dims:
        t_sizes[d] = h[f"t_d{d}"]
    _, tforall = w.tile_forall_mapped(
        w.match_op_id(forall, root.op_id), t_sizes, _mapping(t_sizes, axes, "thread"), num_threads=True
    )
    for o in reversed(ops):
        if o.op_id != root.op_id:
            _, tforall = w.fuse_into(w.match_op_id(forall, o.op_id), tforall)
    w.gpu_bufferize("%root")
    return GpuSketch(
        "cuda-default",
        payload,
        w.text(),
        tuple(specs),
        target_key=target.key,
        max_threads=target.max_threads_per_block,
        smem_limit=target.smem_per_block,
        threads=tuple((axes[d], f"t_d{d}") for d in thread_dims),
        max_register_tile=256,
        min_threads=_min_threads(ranges, thread_dims, target),
        register_tile=tuple((f"b_d{d}", f"t_d{d}") for d in thread_dims),
    )

