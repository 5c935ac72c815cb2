"""Layer 6: what to try next, for every task.

- `space`: knobs, their options and assignments (immutable, hashable).
- `sketch`: a task's payload as op structures, and :class:`Sketch` (a
  transform script with knobs, its space and its preferred point).
- `rules/`: the sketch rules, one per file, for CPUs (`multi_level_tiling`,
  `reduction`, `elementwise`, `default`) and CUDA GPUs (`gpu_*`); each says
  whether it applies to an op on a target and writes its sketches.
  `gpu_sketch` is the GPU sketch type (its knobs checked against the
  target's limits).
- `registry`: rules, cost models, strategies and task schedulers by name,
  plugins included; `generate`: runs the registered rules on a task.
- `strategy/`, `cost_model/`, `features/`, `task_scheduler`: the search proper
  (evolutionary search ranked by XGBoost on features of the scheduled IR,
  and the gradient task scheduler).

May import every layer below it: `errors`, `target`, `records`, `ir`, `graph`,
`schedule`, `passes`, `measure`.
"""
