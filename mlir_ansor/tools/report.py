"""Reports on a records database: the per-task summary and tuning curves.

* :func:`summarize` (``mlir-ansor show``): per task its trials, best latency,
  GFLOP/s, the fraction of the machine's FMA peak and of its roofline bound
  (from the cached `mlir-ansor peak` figures, see `tools/peak.py`), and errors by
  kind.
* :func:`curves` and :func:`plot` (``mlir-ansor plot``): best-so-far GFLOP/s
  against trials per task, and the end-to-end latency (sum over tasks of
  weight x best latency) against the total trials, in the order the records
  were committed.

The roofline bound of a task is min(peak, intensity x bandwidth), with the
intensity counted on compulsory traffic: every input and output of the task
read or written once. It says how far a kernel could still go, not where it
must get: caches can make a kernel beat a bound computed on DRAM bandwidth
only if its data fits them, which the small test workloads do.
"""

from __future__ import annotations

import math
import os
from collections import Counter
from dataclasses import dataclass, field

from mlir_ansor.errors import InputError
from mlir_ansor.tools.peak import Peak

__all__ = ["Curves", "TaskSummary", "compulsory_bytes", "curves", "plot", "summarize"]


@dataclass
class TaskSummary:
    name: str
    workload_key: str
    flops: int
    trials: int
    best_latency_s: float | None
    gflops: float
    threads: int | None
    errors: dict[str, int]
    bytes: int = 0
    peak_gflops: float | None = None
    percent_of_peak: float | None = None
    roofline_gflops: float | None = None
    percent_of_roofline: float | None = None

    def to_json(self) -> dict:
        return dict(self.__dict__)


def compulsory_bytes(task_mlir: str) -> int:
    """Bytes of the task function's arguments and results (each touched once)."""
    from mlir import ir

    total = 0
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(task_mlir)
        for op in module.body.operations:
            if op.operation.name != "func.func":
                continue
            ft = ir.FunctionType(ir.TypeAttr(op.operation.attributes["function_type"]).value)
            for t in list(ft.inputs) + list(ft.results):
                if not isinstance(t, (ir.RankedTensorType, ir.MemRefType)):
                    continue
                st = ir.ShapedType(t)
                if not st.has_static_shape:
                    continue
                width = getattr(st.element_type, "width", 32)
                total += math.prod(st.shape) * max(1, width // 8)
            break
    return total


def _open(db_path: str | os.PathLike):
    from mlir_ansor.records import Database

    db_path = os.fspath(db_path)
    if not os.path.exists(db_path):
        raise InputError(f"{db_path}: no such file")
    return Database(db_path, readonly=True)


def summarize(db_path: str | os.PathLike, peak: Peak | None = None) -> list[TaskSummary]:
    """One :class:`TaskSummary` per task of the database (all targets)."""
    rows = []
    with _open(db_path) as db:
        for w in db.workloads():
            recs = [r for r in db.records(w["workload_key"]) if not r.retime]  # candidates, not re-timings
            errors = Counter(r.error_kind for r in recs if r.error_kind != "none")
            # Each target's best schedule, timed by all its timings (`Database.best`).
            bests = [b for t in sorted({r.target for r in recs if r.valid}) for b in db.best(w["workload_key"], t)]
            best = min(bests, key=lambda r: r.latency_s) if bests else None
            s = TaskSummary(
                name=w["name"],
                workload_key=w["workload_key"],
                flops=w["flops"],
                trials=len(recs),
                best_latency_s=best.latency_s if best else None,
                gflops=w["flops"] / best.latency_s / 1e9 if best else 0.0,
                threads=best.threads if best else None,
                errors=dict(errors),
            )
            try:
                s.bytes = compulsory_bytes(w["task_mlir"])
            except Exception:  # noqa: BLE001 - a report never fails on one odd task
                s.bytes = 0
            if peak is not None and best is not None:
                s.peak_gflops = peak.gflops(best.threads)
                s.percent_of_peak = 100.0 * s.gflops / s.peak_gflops if s.peak_gflops > 0 else None
                if s.bytes:
                    bound = min(s.peak_gflops, w["flops"] / s.bytes * peak.bandwidth(best.threads))
                    s.roofline_gflops = bound
                    s.percent_of_roofline = 100.0 * s.gflops / bound if bound > 0 else None
            rows.append(s)
    return rows


@dataclass
class Curves:
    """Best-so-far figures after each record (records in commit order)."""

    tasks: dict[str, list[float]] = field(default_factory=dict)
    """task name -> best GFLOP/s after its 1st, 2nd, ... trial (NaN before the first valid one)."""
    end_to_end: list[float] = field(default_factory=list)
    """sum of weight x best latency (s) after each trial of any task (NaN until every task has a valid record)."""
    weights: dict[str, int] = field(default_factory=dict)


def curves(db_path: str | os.PathLike, weights: dict[str, int] | None = None) -> Curves:
    """The tuning curves of a database. `weights` (workload key -> how many
    times the task occurs in the model) default to 1 each."""
    out = Curves()
    with _open(db_path) as db:
        wls = db.workloads()
        recs = db.records()
    names = {w["workload_key"]: w["name"] for w in wls}
    flops = {w["workload_key"]: w["flops"] for w in wls}
    weights = {k: (weights or {}).get(k, 1) for k in names}
    best: dict[str, float] = {}
    for k in names:
        out.tasks[names[k]] = []
    out.weights = {names[k]: weights[k] for k in names}
    for r in recs:
        k = r.workload_key
        if k not in names or r.retime:  # a curve's steps are the search's trials
            continue
        if r.valid and r.latency_s < best.get(k, math.inf):
            best[k] = r.latency_s
        lat = best.get(k, math.inf)
        out.tasks[names[k]].append(flops[k] / lat / 1e9 if math.isfinite(lat) else math.nan)
        if len(best) == len(names):
            out.end_to_end.append(sum(weights[kk] * best[kk] for kk in names))
        else:
            out.end_to_end.append(math.nan)
    return out


def plot(db_path: str | os.PathLike, output: str | os.PathLike, *, weights: dict[str, int] | None = None,
         title: str | None = None) -> Curves:
    """Write the tuning curves of a database to an image (PNG, SVG, PDF by
    the file name): per task best-so-far GFLOP/s, and end to end."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - matplotlib is a dependency of the plot extra
        raise InputError(f"plot needs matplotlib ({e}); pip install 'mlir-ansor[plot]'") from None
    c = curves(db_path, weights)
    if not c.tasks or not any(c.tasks.values()):
        raise InputError(f"{os.fspath(db_path)}: no records to plot")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, ys in c.tasks.items():
        if ys:
            ax1.plot(range(1, len(ys) + 1), ys, drawstyle="steps-post", label=f"{name} (x{c.weights[name]})")
    ax1.set_xlabel("trials of the task")
    ax1.set_ylabel("best GFLOP/s so far")
    ax1.set_title("per task")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize="small")
    finite = [x for x in c.end_to_end if math.isfinite(x)]
    scale, unit_s = (1e3, "ms") if finite and max(finite) >= 1e-3 else (1e6, "us")
    e2e = [x * scale for x in c.end_to_end]
    ax2.plot(range(1, len(e2e) + 1), e2e, drawstyle="steps-post", color="black")
    ax2.set_xlabel("trials (all tasks)")
    ax2.set_ylabel(f"sum of weight x best latency ({unit_s})")
    unit = "weights given" if weights else "weight 1 per task"
    ax2.set_title(f"end to end ({unit})")
    ax2.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(os.fspath(output), dpi=100)
    plt.close(fig)
    return c
