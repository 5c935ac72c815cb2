"""Layer 3: schedules as transform IR, and applying them.

- `writer`: :class:`~mlir_ansor.schedule.writer.ScheduleWriter`, the builder of
  ``transform.named_sequence`` scripts with ``transform.tune.knob`` and
  ``transform.tune.alternatives`` ops; the CPU sketch rules write with it.
- `gpu_writer`: :class:`~mlir_ansor.schedule.gpu_writer.GpuScheduleWriter`, the
  same for GPU schedules (block and thread mapping, shared memory, tensor cores).
- `apply`: :func:`~mlir_ansor.schedule.apply.apply_schedule`, which parses a
  task's payload and runs a concrete script on it with the transform
  interpreter (every builder, the feature extractor and the compiler
  schedule through it).

May import: `errors`, `target`, `ir`, `graph`.
"""
