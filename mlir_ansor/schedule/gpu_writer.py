"""Building transform-dialect schedules for NVIDIA targets.

:class:`GpuScheduleWriter` is the :class:`~mlir_ansor.schedule.writer.ScheduleWriter`
with the steps GPU sketches are made of: tiling with a device mapping
(``#gpu.block``, ``#gpu.warp``, ``#gpu.thread``), promoting operand tiles to
copies in shared (workgroup) memory and spreading copies over the block's
threads, bufferizing with device copies, and rewriting a matmul as
tensor-core ``mma.sync``. The GPU sketch rules (`search/rules/gpu_*.py`)
write with it; `passes/nvvm.py` lowers what it produces.
"""

from __future__ import annotations

from collections.abc import Sequence

from mlir_ansor.schedule.writer import ANY, PARAM, ScheduleWriter, Size

__all__ = ["STAGES_ATTR", "GpuScheduleWriter"]

STAGES_ATTR = "ansor.copy_stages"
"""Function attribute (i64): how many shared-memory stages the K loop's
operand copies get (1: synchronous copies, the default;
`passes.async_copies` reads it)."""


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

    def promote_inputs(self, op: str, inputs: list[int], num_operands: int,
                       dtype: str | Sequence[str]) -> tuple[str, list[str]]:
        """Copy input operands `inputs` of `op` into fresh buffers (a no-fold
        `pad` rewritten to `linalg.copy` into `bufferization.alloc_tensor`).
        `dtype`: the operands' element type, or one per operand (a
        mixed-precision contraction: f16 inputs, an f32 accumulator; the pad
        value must have each operand's type). Returns the op after padding
        and, per input, the handle of its copy."""
        padded, pad, copy = self._fresh("padded"), self._fresh("pad"), self._fresh("copy")
        dtypes = [dtype] * num_operands if isinstance(dtype, str) else list(dtype)
        if len(dtypes) != num_operands:
            raise ValueError(f"promote_inputs: {len(dtypes)} element types for {num_operands} operands")
        zeros = ", ".join(f"{0 if t.startswith('i') else 0.0} : {t}" for t in dtypes)
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

    def coalesce(self, loop: str) -> str:
        """`transform.loop.coalesce`: the perfectly nested `scf.for` band
        under `loop` as one loop (a conv's (kh, kw, c) reduction loops as
        one K loop, the form the cp.async pipeliner takes); returns the new
        loop. Handles to ops inside the band are invalidated."""
        out = self._fresh("coalesced")
        self.emit(f"{out} = transform.loop.coalesce {loop} : ({ANY}) -> {ANY}")
        return out

    def empty_tensors_to_allocations(self, container: str) -> None:
        """Turn every `tensor.empty` under `container` into a
        `bufferization.alloc_tensor` (which :meth:`to_workgroup_memory` can
        then place in shared memory)."""
        empties, typed = self.match_ops(container, ["tensor.empty"]), self._fresh("empty")
        self.emit(f'{typed} = transform.cast {empties} : {ANY} to !transform.op<"tensor.empty">')
        self.emit(f"transform.bufferization.empty_tensor_to_alloc_tensor {typed} "
                  f': (!transform.op<"tensor.empty">) -> !transform.op<"bufferization.alloc_tensor">')

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

    def annotate_stages(self, root: str, stages: str) -> None:
        """Record the ``stages`` knob (a param handle) on the function under
        `root` as ``ansor.copy_stages``: `passes.async_copies` then turns the
        K loop's copies to shared memory into that many stages of
        ``cp.async`` (1: the synchronous copies, unchanged)."""
        self.emit(f'transform.annotate {self.match_func(root)} "{STAGES_ATTR}" = {stages} : {ANY}, {PARAM}')

    def mma_sync(self, root: str) -> None:
        mm = self.match_ops(root, ["linalg.matmul"])
        self.emit(f"transform.nvgpu.rewrite_matmul_as_mma_sync {mm} : ({ANY}) -> ()")
