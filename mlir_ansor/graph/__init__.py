"""Layer 2: rewrites of the user's whole module, and its partition into tasks.

- `normalize`: brings imported Linalg (torch-mlir's output) into the shape
  tasks are cut from (dead results, unit broadcasts), running `layout`
  (channel-last convolutions, transposes sunk until they cancel),
  `split_conv` (grouped, 3-D and transposed convolutions as plain 2-D ones)
  and `fold_transpose` (transposes folded into the maps of their readers).
- `precision`: narrow element types: f32 accumulation for bf16/f16 sums
  (rounded once, in an op fused into the task), quantized matmuls as
  generics, and the widened (f32) copy of a task its reference is computed
  with.
- `task`: the partition into tasks (anchor op plus fused producers and
  consumers), workload keys, flops, tolerances (`Task`, `extract_tasks`,
  `partition`).
- `prepack`, `share`, `winograd`: the target's rewrites at extraction
  (constant weights in the kernels' layout, a costly subexpression computed
  once, 3x3 convolutions in Winograd's F(4x4, 3x3) on CPUs).
- `constants`: the ops that compute from constants only, evaluated once at
  compile time (the evaluator is passed in by the compiler).
- `fold_eval`: that evaluation with numpy, for the ops numpy computes
  exactly as the LLVM build does (copies, transposes, IEEE arithmetic).

May import: `errors`, `target`, `ir`. Knows nothing of schedules, lowering
or measurement.
"""
