"""Layer 1: IR helpers that know nothing of tasks, schedules or tuning.

- `program`: parse and verify a module (file, text, stdin, ``ir.Module``) into
  a :class:`~mlir_ansor.ir.program.Program`, with file:line locations for errors.
- `rewrite`: small public helpers for rewriting Linalg on tensors (backward
  slices, cloning with remapped operands, transposes and their permutations).
- `attrs`: the names of the attributes mlir-ansor sets on ops and functions.
- `dtypes`: element-type facts in one table (sizes, rounding, the tolerance a
  result is checked with); it imports neither MLIR nor numpy, so the runners
  on a GPU host without MLIR can use it.

May import: `mlir_ansor.errors`, `mlir_ansor.target`, and the MLIR bindings.
Nothing here imports from any other mlir-ansor package.
"""
