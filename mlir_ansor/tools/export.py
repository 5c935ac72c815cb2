"""Export the best schedule of a task as standalone MLIR.

:func:`export_best` reads a task's MLIR and its records from a records
database, regenerates the task's sketches (the database stores only the
sketch hash and the knob assignment), picks the sketch whose hash matches the
best valid record, and returns two texts:

* the schedule: a transform module (``@__transform_main``) with every
  ``transform.tune.knob`` / ``transform.tune.alternatives`` selected;
* the payload: the task module with its Linalg ops tagged ``ansor.op``, which
  the schedule's ``transform.structured.match`` ops look for.

Plain MLIR tools apply them (shared/DESIGN.md, decision 2)::

    mlir-opt payload.mlir \\
      --transform-preload-library=transform-library-paths=schedule.mlir \\
      --transform-interpreter
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

from mlir_ansor.errors import InputError
from mlir_ansor.target import Target

log = logging.getLogger("mlir_ansor")

__all__ = ["ExportedSchedule", "export_best", "find_workload"]

MLIR_OPT_HINT = (
    "mlir-opt {payload} --transform-preload-library=transform-library-paths={schedule} --transform-interpreter"
)


@dataclass(frozen=True)
class ExportedSchedule:
    name: str
    workload_key: str
    target: str
    threads: int
    latency_s: float
    gflops: float
    sketch: str
    knobs: tuple[tuple[str, int], ...]
    schedule: str
    """The transform module, knobs selected, with a comment header."""
    payload: str
    """The tagged task module the schedule applies to."""


def find_workload(db, name_or_key: str | None) -> dict:
    """The workload row whose name or key is `name_or_key` (a unique key
    prefix also matches); with None, the only workload of the database."""
    rows = db.workloads()
    if not rows:
        raise InputError(f"{db.path}: the database holds no task")
    listing = "; ".join(f"{w['name']} ({w['workload_key']})" for w in rows)
    if name_or_key is None:
        if len(rows) == 1:
            return rows[0]
        raise InputError(f"{db.path} holds {len(rows)} tasks; pick one with --task NAME_OR_KEY: {listing}")
    exact = [w for w in rows if name_or_key in (w["name"], w["workload_key"])]
    if not exact:
        exact = [w for w in rows if w["workload_key"].startswith(name_or_key)]
    if len(exact) == 1:
        return exact[0]
    if not exact:
        raise InputError(f"no task {name_or_key!r} in {db.path}; its tasks: {listing}")
    keys = ", ".join(w["workload_key"] for w in exact)
    raise InputError(f"{name_or_key!r} names {len(exact)} tasks in {db.path}; pass a workload key: {keys}")


def export_best(
    db_path: str | os.PathLike,
    task: str | None = None,
    *,
    target: Target | None = None,
    threads: int | None = None,
) -> ExportedSchedule:
    """The best valid record of `task` (name or workload key) for `target`
    (default: this host) and `threads` (default: any), as MLIR texts."""
    from mlir_ansor.records import Database
    from mlir_ansor.search.generate import generate_sketches

    target = target or Target.host()
    db_path = os.fspath(db_path)
    if not os.path.exists(db_path):
        raise InputError(f"{db_path}: no such file")
    with Database(db_path, readonly=True) as db:
        w = find_workload(db, task)
        recs = [r for r in db.records(w["workload_key"]) if r.valid]
        # Best first, each schedule timed by all its timings (`Database.best`).
        mine = db.best(w["workload_key"], target.key, threads=threads, k=10**6, prefer_host=target.model)
        invalid = dict(db.invalid_rows)
    if threads is not None:
        recs = [r for r in recs if r.threads == threads]
    if not mine:
        others = sorted({r.target for r in recs})
        extra = f" (records exist for {', '.join(others)})" if others else ""
        thr = f" on {threads} thread(s)" if threads is not None else ""
        bad = f" ({len(invalid)} invalid record(s) skipped: {_invalid_ids(invalid)})" if invalid else ""
        raise InputError(f"task {w['name']}: no valid record for target {target.key}{thr}{extra}{bad}")
    sketches = {sk.hash: sk for sk in generate_sketches(w["task_mlir"], target)}
    for rec in mine:
        sk = sketches.get(rec.sketch_hash)
        if sk is None:
            continue  # made by sketch rules that have changed since
        problem = sk.knob_problem(rec.knobs)
        if problem is not None:
            invalid[rec.row_id] = problem
            log.warning("%s: record %s is invalid and is skipped: %s", db_path, rec.row_id, problem)
            continue
        script = sk.concrete(rec.knobs)
        lat = rec.latency_s
        gflops = w["flops"] / lat / 1e9 if lat > 0 and math.isfinite(lat) else 0.0
        knobs = ", ".join(f"{k}={v}" for k, v in rec.knobs)
        header = (
            f"// mlir-ansor schedule for task {w['name']} (workload {w['workload_key']})\n"
            f"// target {rec.target}, {rec.threads} thread(s), measured {lat:.4g} s ({gflops:.2f} GFLOP/s)\n"
            f"// sketch {sk.name} ({sk.hash}), knobs: {knobs}\n"
            f"// apply: " + MLIR_OPT_HINT.format(payload="payload.mlir", schedule="schedule.mlir") + "\n"
        )
        return ExportedSchedule(
            name=w["name"],
            workload_key=w["workload_key"],
            target=rec.target,
            threads=rec.threads,
            latency_s=lat,
            gflops=gflops,
            sketch=sk.name,
            knobs=tuple(rec.knobs),
            schedule=header + script,
            payload=f"// mlir-ansor payload for task {w['name']}: Linalg ops tagged ansor.op\n" + sk.payload,
        )
    if invalid:
        raise InputError(
            f"task {w['name']}: no usable record for target {target.key}: {len(invalid)} invalid record(s) "
            f"skipped ({_invalid_ids(invalid)}); any other was made by a sketch the current rules no longer generate"
        )
    raise InputError(
        f"task {w['name']}: none of its {len(mine)} valid record(s) was made by a sketch the current "
        "sketch rules generate (the rules changed since it was tuned); tune it again"
    )


def _invalid_ids(invalid: dict) -> str:
    """`Database.invalid_rows`' ids and reasons, the first three."""
    items = sorted(invalid.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))
    text = "; ".join(f"record {i}: {why}" for i, why in items[:3])
    return text + ("; ..." if len(items) > 3 else "")
