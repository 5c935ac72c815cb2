"""Datasets of measured programs, for training cost models offline.

:func:`export_dataset` turns a records database into a folder (the format is
documented in ``docs/dataset.md``): for every measured candidate whose
sketch the registered rules still generate, the task (MLIR text), the
concrete transform script, the feature rows of `search/features/` and the
measured costs with the error kind. :func:`load` reads it back as a
:class:`Dataset`; :func:`train_cost_model` fits a cost model on it, whose
saved file `TuneConfig.pretrained_model` loads (transfer learning).

Why .npz and JSON lines, not Parquet: numpy is already a dependency, and a
feature matrix plus an offsets vector is the whole columnar part; the text
(task modules, scripts) is easier to read and grep as JSON lines.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mlir_ansor.errors import InputError
from mlir_ansor.target import Target

log = logging.getLogger("mlir_ansor")

FORMAT = "mlir-ansor-dataset"
VERSION = 1

__all__ = ["FORMAT", "VERSION", "Dataset", "ExportSummary", "export_dataset", "load", "train_cost_model"]


@dataclass(frozen=True)
class ExportSummary:
    """What :func:`export_dataset` wrote."""

    out_dir: str
    candidates: int
    tasks: int
    valid: int
    skipped: dict  # reason -> count (records not exported)


def _target_for(key: str, runs: list[dict]) -> Target | None:
    """The target whose `key` a record carries: this host, or the one a run
    of the database described."""
    host = Target.host()
    if host.key == key:
        return host
    for r in reversed(runs):
        info = r.get("target_info")
        if r.get("target") == key and isinstance(info, dict):
            fields = {f.name for f in dataclasses.fields(Target)}
            kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in info.items() if k in fields}
            return Target(**kw)
    return None


def _json_versions(text: str) -> dict:
    try:
        v = json.loads(text) if text else {}
        return v if isinstance(v, dict) else {"raw": text}
    except ValueError:
        return {"raw": text}


def export_dataset(db_path: str | os.PathLike, out_dir: str | os.PathLike, *, isolate: bool = True) -> ExportSummary:
    """Write every measured candidate of `db_path` to `out_dir` (created;
    files already there are replaced). `isolate`: read features in worker
    processes (an MLIR abort on a probe cannot kill the export)."""
    from mlir_ansor.records import Database
    from mlir_ansor.search.features import FEATURE_NAMES, extract_features
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.tuner import package_versions

    db_path = os.fspath(db_path)
    if not os.path.exists(db_path):
        raise InputError(f"{db_path}: no such file")
    out_dir = os.fspath(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise InputError(f"-o {out_dir}: is a file, not a folder (export-dataset writes a folder of files)")
    with Database(db_path) as db:
        workloads = db.workloads()
        records = db.records()
        runs = db.runs()
    # Only once the database is known good: a bad one leaves no new folder
    # and an existing manifest.json untouched.
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise InputError(f"-o {out_dir}: cannot create the folder: {e.strerror or e}") from None
    if not os.access(out_dir, os.W_OK):
        raise InputError(f"-o {out_dir}: cannot write into the folder (permission denied)")
    by_key = {w["workload_key"]: i for i, w in enumerate(workloads)}
    skipped: dict[str, int] = {}

    def skip(reason: str) -> None:
        skipped[reason] = skipped.get(reason, 0) + 1

    # Regenerate the sketches of each (workload, target) once.
    sketch_cache: dict[tuple[str, str], dict] = {}
    groups: dict[tuple[str, str], list[int]] = {}  # (workload, sketch hash) -> record positions
    sketch_of: dict[tuple[str, str], object] = {}
    for pos, rec in enumerate(records):
        if rec.workload_key not in by_key:
            skip("no task in the database")
            continue
        if rec.retime:
            skip("a re-timing of a candidate (not a candidate)")
            continue
        ck = (rec.workload_key, rec.target)
        if ck not in sketch_cache:
            target = _target_for(rec.target, runs)
            if target is None or target.kind != "cpu":
                sketch_cache[ck] = {}
            else:
                mlir = workloads[by_key[rec.workload_key]]["task_mlir"]
                try:
                    sketch_cache[ck] = {sk.hash: sk for sk in generate_sketches(mlir, target)}
                except Exception as e:  # noqa: BLE001 - a task the rules no longer handle
                    log.warning("export-dataset: task %s: no sketches (%s)", rec.workload_key, e)
                    sketch_cache[ck] = {}
        sk = sketch_cache[ck].get(rec.sketch_hash)
        if sk is None:
            skip("sketch not generated by the current rules (or unknown target)")
            continue
        gk = (rec.workload_key, rec.sketch_hash)
        groups.setdefault(gk, []).append(pos)
        sketch_of[gk] = sk

    features: dict[int, np.ndarray] = {}
    scripts: dict[int, str] = {}
    for gk, positions in groups.items():
        sk = sketch_of[gk]
        ok = []
        for pos in positions:
            try:
                scripts[pos] = sk.concrete(records[pos].knobs)
                ok.append(pos)
            except Exception:  # noqa: BLE001 - knobs that no longer fit the sketch
                skip("knobs do not fit the sketch")
        if not ok:
            continue
        rows = extract_features(sk, [tuple(records[p].knobs) for p in ok], isolate=isolate)
        for pos, f in zip(ok, rows):
            features[pos] = np.asarray(f, np.float32).reshape(-1, len(FEATURE_NAMES))

    kept = sorted(features)
    n_feat = len(FEATURE_NAMES)
    offsets = np.zeros(len(kept) + 1, np.int64)
    for i, pos in enumerate(kept):
        offsets[i + 1] = offsets[i] + len(features[pos])
    matrix = np.concatenate([features[p] for p in kept], axis=0) if kept else np.zeros((0, n_feat), np.float32)
    task_index = np.array([by_key[records[p].workload_key] for p in kept], np.int32)
    latency = np.array([records[p].latency_s if records[p].valid else math.inf for p in kept], np.float64)
    flops = np.array([workloads[by_key[records[p].workload_key]]["flops"] for p in kept], np.float64)
    valid = np.isfinite(latency) & (latency > 0)
    throughput = np.where(valid, flops / np.where(valid, latency, 1.0), 0.0)
    error_kind = np.array([records[p].error_kind for p in kept], dtype=str)
    threads = np.array([records[p].threads for p in kept], np.int32)

    def atomic_write(name: str, write) -> None:
        tmp = os.path.join(out_dir, f".{name}.tmp")
        write(tmp)
        os.replace(tmp, os.path.join(out_dir, name))

    def write_npz(path: str) -> None:
        with open(path, "wb") as f:
            np.savez_compressed(
                f,
                features=matrix,
                offsets=offsets,
                task_index=task_index,
                latency_s=latency,
                throughput=throughput,
                valid=valid,
                error_kind=error_kind,
                threads=threads,
            )

    def write_tasks(path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for i, w in enumerate(workloads):
                f.write(json.dumps({"task_index": i, "workload_key": w["workload_key"], "name": w["name"],
                                    "flops": w["flops"], "task_mlir": w["task_mlir"]}) + "\n")

    def write_candidates(path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for i, pos in enumerate(kept):
                r = records[pos]
                sk = sketch_of[(r.workload_key, r.sketch_hash)]
                f.write(json.dumps({
                    "row": i,
                    "record": pos,
                    "task_index": int(task_index[i]),
                    "workload_key": r.workload_key,
                    "target": r.target,
                    "threads": r.threads,
                    "host": r.host,
                    "sketch": sk.name,
                    "sketch_hash": r.sketch_hash,
                    "knobs": dict(r.knobs),
                    "script": scripts[pos],
                    "costs": list(r.costs),
                    "latency_s": r.latency_s if r.valid else None,
                    "throughput": float(throughput[i]),
                    "error_kind": r.error_kind,
                    "error_msg": r.error_msg,
                    "build_s": r.build_s,
                    "timestamp": r.timestamp,
                    "versions": _json_versions(r.versions),
                }) + "\n")

    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "source_db": os.path.abspath(db_path),
        "created": time.time(),
        "exported_by": package_versions(),
        "feature_names": list(FEATURE_NAMES),
        "candidates": len(kept),
        "valid": int(valid.sum()),
        "tasks": len(workloads),
        "skipped": skipped,
        "runs": runs,
    }
    atomic_write("features.npz", write_npz)
    atomic_write("tasks.jsonl", write_tasks)
    atomic_write("candidates.jsonl", write_candidates)
    atomic_write("manifest.json", lambda p: open(p, "w", encoding="utf-8").write(json.dumps(manifest, indent=2, default=str)))
    return ExportSummary(out_dir, len(kept), len(workloads), int(valid.sum()), skipped)


@dataclass
class Dataset:
    """An exported dataset in memory.

    manifest: the format header, feature names, counts, the runs.
    tasks: one dict per task (``task_index``, ``workload_key``, ``name``,
      ``flops``, ``task_mlir``).
    candidates: one dict per measured candidate (see docs/dataset.md).
    features / offsets: the statement rows of all candidates stacked; those
      of candidate i are ``features[offsets[i]:offsets[i + 1]]``.
    task_index, latency_s (inf when invalid), throughput (FLOP/s; 0 when
    invalid), valid, error_kind, threads: one entry per candidate.
    """

    manifest: dict
    tasks: list[dict]
    candidates: list[dict]
    features: np.ndarray
    offsets: np.ndarray
    task_index: np.ndarray
    latency_s: np.ndarray
    throughput: np.ndarray
    valid: np.ndarray
    error_kind: np.ndarray
    threads: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def feature_names(self) -> list[str]:
        return list(self.manifest["feature_names"])

    def program(self, i: int) -> np.ndarray:
        """The feature rows of candidate `i`: (statements, features)."""
        return self.features[self.offsets[i] : self.offsets[i + 1]]

    def programs(self) -> list[np.ndarray]:
        return [self.program(i) for i in range(len(self))]

    def normalized_throughput(self) -> np.ndarray:
        """Throughput divided by the best of the same task (0..1): the
        targets of tasks of different sizes become comparable."""
        out = np.zeros(len(self))
        for t in np.unique(self.task_index):
            m = self.task_index == t
            best = self.throughput[m].max(initial=0.0)
            if best > 0:
                out[m] = self.throughput[m] / best
        return out

    def training_records(self, tasks: Sequence[int] | None = None) -> list[tuple[np.ndarray, float]]:
        """``(features, target)`` pairs for `CostModel.update`, the target
        being the per-task normalized throughput (failures 0); `tasks`
        restricts to those task indices."""
        norm = self.normalized_throughput()
        keep = range(len(self)) if tasks is None else [i for i in range(len(self)) if self.task_index[i] in set(tasks)]
        return [(self.program(i), float(norm[i])) for i in keep]


def load(path: str | os.PathLike) -> Dataset:
    """Read a folder written by :func:`export_dataset`."""
    path = os.fspath(path)
    man_path = os.path.join(path, "manifest.json")
    if not os.path.exists(man_path):
        raise InputError(f"{path}: not an mlir-ansor dataset (no manifest.json)")
    with open(man_path, encoding="utf-8") as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise InputError(f"{path}: manifest format is {manifest.get('format')!r}, not {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise InputError(f"{path}: dataset version {manifest.get('version')!r} (this mlir-ansor reads {VERSION})")

    def jsonl(name: str) -> list[dict]:
        with open(os.path.join(path, name), encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    with np.load(os.path.join(path, "features.npz")) as z:
        arrays = {k: z[k] for k in z.files}
    ds = Dataset(manifest=manifest, tasks=jsonl("tasks.jsonl"), candidates=jsonl("candidates.jsonl"), **arrays)
    if len(ds.candidates) != len(ds):
        raise InputError(f"{path}: candidates.jsonl has {len(ds.candidates)} lines, features.npz {len(ds)} candidates")
    return ds


def train_cost_model(dataset: Dataset, model=None, *, tasks: Sequence[int] | None = None):
    """Fit `model` (default: a fresh `XGBModel`) on the dataset's candidates
    (optionally only those of `tasks`); returns the model, ready to `save`."""
    from mlir_ansor.search.cost_model import XGBModel

    model = model if model is not None else XGBModel()
    model.update(dataset.training_records(tasks))
    return model
