"""Replay: rebuild and re-measure the best records of a database, report drift.

:func:`replay` takes the `top` best valid records of every task (for this
host's target), regenerates their sketches, builds each concrete schedule
and times it again through the tuner's measurer, `measure.measurer.Measurer`
(builders and the runner in isolated worker processes, the output checked
against the untuned lowering on seeded inputs, exactly as during tuning).
Drift is new latency / recorded latency: 1.0 means the measurement
reproduced; a record that no longer builds or checks is reported with its
error. The versions recorded with each record are compared with the ones
installed now, so a drift can be told apart from an upgrade.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

from mlir_ansor.errors import InputError
from mlir_ansor.measure.runner import TimingPolicy
from mlir_ansor.target import Target

__all__ = ["ReplayReport", "ReplayRow", "replay"]


@dataclass
class ReplayRow:
    """One re-measured record."""

    name: str
    workload_key: str
    rank: int  # 1 = the task's best record
    threads: int
    sketch: str
    knobs: tuple
    old_latency_s: float
    new_latency_s: float = math.inf
    error: str = ""  # empty when it rebuilt, checked and timed fine
    seed: int | None = None
    changed_versions: dict = field(default_factory=dict)  # name -> (recorded, now)
    recorded_host: str = ""  # the host (CPU model or GPU) the record was measured on
    other_host: bool = False  # recorded on another kind of machine: drift mixes machines

    @property
    def drift(self) -> float:
        """New / recorded latency (nan when it failed now)."""
        if not math.isfinite(self.new_latency_s) or self.old_latency_s <= 0:
            return math.nan
        return self.new_latency_s / self.old_latency_s

    def to_json(self) -> dict:
        fin = lambda x: x if math.isfinite(x) else None  # noqa: E731
        return {
            "name": self.name,
            "workload_key": self.workload_key,
            "rank": self.rank,
            "threads": self.threads,
            "sketch": self.sketch,
            "knobs": dict(self.knobs),
            "old_latency_s": fin(self.old_latency_s),
            "new_latency_s": fin(self.new_latency_s),
            "drift": fin(self.drift),
            "error": self.error,
            "seed": self.seed,
            "changed_versions": {k: list(v) for k, v in self.changed_versions.items()},
            "recorded_host": self.recorded_host,
            "other_host": self.other_host,
        }


@dataclass
class ReplayReport:
    rows: list[ReplayRow]
    target: str
    skipped: dict  # reason -> count

    def to_json(self) -> dict:
        return {"target": self.target, "rows": [r.to_json() for r in self.rows], "skipped": self.skipped}


def _versions_of(text: str) -> dict:
    try:
        v = json.loads(text) if text else {}
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {}


def replay(
    db_path: str | os.PathLike,
    *,
    top: int = 1,
    target: Target | None = None,
    threads: int | None = None,
    timing: TimingPolicy | None = None,
    build_workers: int | None = None,
) -> ReplayReport:
    """Re-measure the `top` best valid records of every task of `db_path`
    (on `threads` threads only, when given) on this machine."""
    from mlir_ansor.importers import load
    from mlir_ansor.measure.measurer import Candidate, Measurement, Measurer
    from mlir_ansor.measure.pool import ErrorKind
    from mlir_ansor.records import Database
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.tasks import tasks_for
    from mlir_ansor.tuner import TuneConfig, package_versions

    target = target or Target.host()
    db_path = os.fspath(db_path)
    if not os.path.exists(db_path):
        raise InputError(f"{db_path}: no such file")
    now = package_versions()
    skipped: dict[str, int] = {}
    jobs: dict[int, list] = {}  # threads -> [(task, sketch, record, rank)]
    with Database(db_path) as db:
        for w in db.workloads():
            # Records measured on this kind of machine; else those of the
            # host with the most records (drift then compares machines).
            recs = db.best(w["workload_key"], target.key, threads=threads, k=10**6, prefer_host=target.model)
            if not recs:
                continue
            try:
                # Extracted as the tuner does (the target's packing and row
                # merges): without them a layer norm's one task came back as
                # five, and the first one's inputs, given to the whole task's
                # reference, crashed it. A task text is one task; its key
                # may differ from the one it had in its model.
                tasks = tasks_for(load(text=w["task_mlir"]), target)
                task = next((t for t in tasks if t.workload_key == w["workload_key"]), tasks[0] if len(tasks) == 1 else None)
                sketches = {sk.hash: sk for sk in generate_sketches(w["task_mlir"], target)}
            except Exception:  # noqa: BLE001 - a task the current frontend or rules refuse
                task = None
            if task is None:
                skipped["task no longer supported"] = skipped.get("task no longer supported", 0) + 1
                continue
            per_threads: dict[int, int] = {}
            for rec in recs:
                rank = per_threads.get(rec.threads, 0)
                if rank >= top:
                    continue
                sk = sketches.get(rec.sketch_hash)
                if sk is None:
                    skipped["sketch no longer generated"] = skipped.get("sketch no longer generated", 0) + 1
                    continue
                per_threads[rec.threads] = rank + 1
                jobs.setdefault(rec.threads, []).append((w, task, sk, rec, rank + 1))
    rows: list[ReplayRow] = []
    timing = timing or TimingPolicy()
    for n_threads, items in sorted(jobs.items()):
        config = TuneConfig(threads=n_threads, timing=timing, overlap=False, build_workers=build_workers)
        with Measurer(config) as m:
            data: dict[str, tuple[str, float]] = {}  # workload key -> (reference data, tolerance)
            cands = []
            for i, (w, task, sk, rec, rank) in enumerate(items):
                old_v = _versions_of(rec.versions)
                seed = old_v.get("seed")
                row = ReplayRow(
                    w["name"], w["workload_key"], rank, n_threads, sk.name, tuple(rec.knobs), rec.latency_s,
                    seed=seed if isinstance(seed, int) else None,
                    changed_versions={k: (old_v[k], v) for k, v in now.items() if k in old_v and old_v[k] != v},
                    recorded_host=rec.host,
                    other_host=rec.host != target.model,
                )
                rows.append(row)
                if w["workload_key"] not in data:
                    path, res = m.reference(sk.payload, task, row.seed or 0, len(data))
                    if not res.ok:
                        row.error = f"reference: {res.error_kind.value}"
                        continue
                    tol = task.tolerance
                    data[w["workload_key"]] = (path, tol)
                path, tol = data[w["workload_key"]]
                c = Candidate(sk, tuple(rec.knobs), path, so_path=m.path(f"r{i}.so"))
                try:
                    c.script = sk.concrete(rec.knobs)
                except Exception as e:  # noqa: BLE001 - knobs the sketch no longer accepts
                    row.error = f"script: {_last_line(str(e))}"
                    continue
                cands.append((row, c, tol))
            builds = m.build([c for _, c, _ in cands]) if cands else []
            for (row, c, tol), b in zip(cands, builds):
                if not b.ok:
                    row.error = f"build: {b.error_kind.value}: {_last_line(b.error_msg)}"
                    continue
                r = m.run(c, tol)
                meas = Measurement.of_run(r, tol)
                if meas.error_kind == ErrorKind.WRONG_ANSWER:
                    row.error = f"wrong answer: relative error {meas.rel_error:.3g} > {tol:.3g}"
                elif meas.error_kind != ErrorKind.NONE:  # named by the run's own kind, as before
                    row.error = f"run: {r.error_kind.value}: {_last_line(meas.error_msg)}"
                else:
                    row.new_latency_s = meas.latency_s
    rows.sort(key=lambda r: (r.name, r.threads, r.rank))
    return ReplayReport(rows, target.key, skipped)


def _last_line(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip()]
    return lines[-1] if lines else ""

