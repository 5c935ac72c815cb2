"""Measure a build-only tuning database's CUDA candidates on a GPU host without MLIR.

A build-only run (`mlir-ansor tune --target cuda:sm_XX --build-only --db X.db`,
on a host with MLIR and ptxas but no GPU) records its candidates as
``not_measured`` and keeps, next to the database, in ``X.db.gpu/`` (see
:func:`bundle_dir`), everything a GPU host needs to measure them:

    X.db.gpu/<workload_key>/task.json        the task: input/output shapes and
                                             dtypes, seed and input range,
                                             tolerance, digest of the inputs
    X.db.gpu/<workload_key>/reference.npz    the reference outputs (ref0, ...)
    X.db.gpu/<workload_key>/<id>.cubin-bundle  one per built candidate
                                             (`cuda_runner.write_bundle`)

The reference is the one a measuring `tune` checks against: the untuned CPU
lowering's outputs on seeded inputs, computed on the build host (it needs
MLIR). Only the outputs are kept; the inputs are drawn again here from the
seed (`runner.random_inputs`, as on the build host) and checked against the
digest. On the GPU host, with numpy, cuda-python (or pycuda) and the
``mlir_ansor`` package (copied there, or installed without its MLIR
dependencies: importing this module imports no MLIR)::

    python -m mlir_ansor.measure.gpu_measure X.db [--bundles DIR] [--jsonl OUT]

(``python3 mlir_ansor/measure/gpu_measure.py X.db`` works too: run as a
script, it imports the package it is in.)

measures every ``not_measured`` CUDA candidate (checked against the
reference, timed with CUDA events by `cuda_runner.run`, each in a worker
subprocess with a time limit: a crash or hang is that candidate's record)
and adds one record per candidate, as a measuring `tune` on this host would:
the GPU's name as host, ``none``/``wrong_answer``/``run_error``/``timeout``/
``crash``, the build run's timing policy and limits, and a ``runs`` row
(``info["measure_only"]``). The ``not_measured`` records stay (as after a
measuring `tune`). The database is read and written through
`records.database` (`Database`, or a `JsonlWriter` for ``--jsonl``), CUDA
runs go through `cuda_runner`. Each record is committed on its own; a candidate that
already has a record from this GPU is not measured again, so the command
resumes. ``--jsonl OUT`` leaves the database as it is and appends the run and
its records to OUT instead, for ``Database(X.db).import_jsonl(OUT)`` on the
build host.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import json
import math
import os
import platform
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np

if __name__ == "__main__" and not __package__:
    # Run as a script (python3 mlir_ansor/measure/gpu_measure.py): import the
    # package it is in, not its folder's modules as top-level ones.
    if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
        del sys.path[0]
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mlir_ansor.errors import AnsorError  # noqa: E402
from mlir_ansor.measure import cuda_runner  # noqa: E402
from mlir_ansor.measure.runner import random_inputs, read_data  # noqa: E402
from mlir_ansor.records.database import Database, JsonlWriter, Record, knobs_text  # noqa: E402

TASK_FORMAT = "mlir-ansor-gpu-task 1"
BUNDLE_SUFFIX = ".cubin-bundle"

# The defaults of `tuner.TuneConfig` that measuring depends on, for a run
# whose stored config lacks them.
_DEFAULTS = {
    "timing": {"warmup": 0, "min_repeat": 3, "max_repeat": 50, "min_time_s": 0.05},
    "run_timeout_s": 60.0,
    "cutoff_factor": 2.0,
    "hang_factor": 50.0,
    "min_run_timeout_s": 5.0,
}


# --------------------------------------------------------------------------
# The folder of a build-only run (written on the build host by `tuner`)


def bundle_dir(db_path: str | os.PathLike) -> str:
    """Where a build-only run into `db_path` keeps its bundles and references."""
    return os.fspath(db_path) + ".gpu"


def bundle_name(target: str, sketch_hash: str, knobs) -> str:
    """The file name of a candidate's bundle in its task's folder."""
    key = f"{target}\n{sketch_hash}\n{knobs_text(knobs)}".encode()
    return hashlib.sha256(key).hexdigest()[:20] + BUNDLE_SUFFIX


def task_ready(task_dir: str | os.PathLike) -> bool:
    return (Path(task_dir) / "task.json").is_file() and (Path(task_dir) / "reference.npz").is_file()


def inputs_digest(arrays: list[np.ndarray]) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()[:32]


def export_task(
    task_dir: str | os.PathLike,
    data_path: str,
    *,
    workload_key: str,
    name: str,
    target: str,
    seed: int,
    inputs: list[tuple[tuple[int, ...], str]],
    outputs: list[tuple[tuple[int, ...], str]],
    input_range: list[float],
    tol: float,
    flops: int = 0,
) -> None:
    """Keep a task's reference (the .npz of `jobs.prepare_reference`) in
    `task_dir`: the reference outputs, and a description of the inputs
    (drawn again on the GPU host) with their digest. task.json is written
    last: its presence means the folder is complete."""
    d = Path(task_dir)
    d.mkdir(parents=True, exist_ok=True)
    ins, ref_arrays, _ = read_data(data_path)
    ins = ins[: len(inputs)]
    refs = {f"ref{i}": ref_arrays[i] for i in range(len(outputs))}
    tmp = d / "reference.tmp.npz"
    np.savez(tmp, **refs)
    os.replace(tmp, d / "reference.npz")
    spec = {
        "format": TASK_FORMAT,
        "workload_key": workload_key,
        "name": name,
        "target": target,
        "seed": int(seed),
        "inputs": [[list(s), dt] for s, dt in inputs],
        "outputs": [[list(s), dt] for s, dt in outputs],
        "input_range": [float(x) for x in input_range],
        "inputs_digest": inputs_digest(ins),
        "tol": float(tol),
        "flops": int(flops),
    }
    tmp = d / "task.tmp.json"
    tmp.write_text(json.dumps(spec) + "\n")
    os.replace(tmp, d / "task.json")


def keep_bundle(task_dir: str | os.PathLike, artifact: str, target: str, sketch_hash: str, knobs) -> str:
    """Copy a built candidate's bundle into its task's folder; returns its path."""
    dest = Path(task_dir) / bundle_name(target, sketch_hash, knobs)
    tmp = dest.with_suffix(".tmp")
    shutil.copyfile(artifact, tmp)
    os.replace(tmp, dest)
    return str(dest)


# --------------------------------------------------------------------------
# Inputs and reference on the GPU host


def load_task(task_dir: str | os.PathLike) -> tuple[dict, list[np.ndarray], list[np.ndarray]]:
    """A kept task's description, inputs (drawn again from its seed and
    checked against their digest) and reference outputs."""
    d = Path(task_dir)
    spec = json.loads((d / "task.json").read_text())
    if spec.get("format") != TASK_FORMAT:
        raise ValueError(f"{d / 'task.json'}: format {spec.get('format')!r}, this reads {TASK_FORMAT!r}")
    low, high = spec["input_range"]
    inputs = random_inputs(spec["inputs"], spec["seed"], low, high)
    if inputs_digest(inputs) != spec["inputs_digest"]:
        raise ValueError(
            f"{d}: the inputs drawn here from seed {spec['seed']} differ from the build host's "
            f"(numpy {np.__version__}'s generator?); the reference does not apply"
        )
    with np.load(d / "reference.npz") as data:
        refs = [data[f"ref{i}"] for i in range(len(spec["outputs"]))]
    return spec, inputs, refs


# --------------------------------------------------------------------------
# Worker: one process that runs candidates on the GPU; replaced after a
# crash, a hang, or a driver error (a CUDA context is unusable after one)


def _format_exception(exc: BaseException) -> str:
    head = f"{type(exc).__name__}: {exc}"
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    return head + "\n" + "\n".join("".join(tb).rstrip().splitlines()[-12:])


def _open_backend(spec: str | None, device: int):
    """The CUDA backend (`cuda_runner.open_backend`), or ``module:callable``
    (a stand-in device, for tests)."""
    if not spec:
        return cuda_runner.open_backend(device)
    mod, _, attr = spec.partition(":")
    return getattr(importlib.import_module(mod), attr)()


def _worker_main(backend_spec: str | None, device: int) -> None:  # pragma: no cover - runs in a subprocess
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever else writes to stdout goes to the log

    def send(obj: dict) -> None:
        out.write(json.dumps(obj) + "\n")

    try:
        be = _open_backend(backend_spec, device)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        send({"ready": False, "error": f"{type(e).__name__}: {e}"})
        return
    send({"ready": True, "device": be.device_name, "backend": getattr(be, "name", "?")})
    tasks: dict[str, tuple] = {}
    for line in sys.stdin:
        job = json.loads(line)
        try:
            if job["task_dir"] not in tasks:
                tasks.clear()
                spec, inputs, refs = load_task(job["task_dir"])
                tasks[job["task_dir"]] = (inputs, refs)
            inputs, refs = tasks[job["task_dir"]]
            entry, image = cuda_runner.read_bundle(job["bundle"])
            p = job["policy"]
            cutoff = job["cutoff_s"]
            slow = min(cutoff, 1.0) if cutoff is not None else 1.0
            r = cuda_runner.run(
                be, entry, os.path.dirname(job["bundle"]), inputs, refs, job["tol"],
                warmup=p["warmup"], min_repeat=p["min_repeat"], max_repeat=p["max_repeat"],
                min_time_s=p["min_time_s"], slow_s=slow, image=image,
            )
            if r.ok:
                send({"result": "ok", "costs": r.costs, "error": r.max_rel_err})
            elif r.error.startswith("wrong answer"):
                send({"result": "wrong", "error": r.max_rel_err})
            else:
                raise cuda_runner.CudaRunError(r.error)
        except Exception as e:  # noqa: BLE001 - the candidate's run error
            send({"result": "exception", "message": _format_exception(e)})
            return  # a driver error can leave the context unusable: start afresh


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


# The worker's command: this module's `main`, from the very package the
# parent imported (its folder goes on the worker's path when missing there).
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_WORKER_BOOT = (
    "import sys\n"
    "root = sys.argv.pop(1)\n"
    "if root not in sys.path:\n"
    "    sys.path.insert(0, root)\n"
    "from mlir_ansor.measure.gpu_measure import main\n"
    "sys.exit(main())\n"
)


class _Worker:
    """The parent's handle on a worker subprocess."""

    def __init__(self, backend: str | None, device: int, init_timeout_s: float = 120.0) -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - closed in kill()
        cmd = [sys.executable, "-c", _WORKER_BOOT, _PACKAGE_ROOT, "--worker", "--device", str(device)]
        if backend:
            cmd += ["--backend", backend]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, start_new_session=True
        )
        self.buf = b""
        hello = self.receive(init_timeout_s)
        if hello is None or not hello.get("ready"):
            why = hello.get("error") if hello else self.death_reason()
            self.kill()
            raise RuntimeError(f"the GPU worker did not start: {why}")
        self.device = hello["device"]
        self.backend = hello.get("backend", "")

    def receive(self, timeout_s: float) -> dict | None:
        """The next message, or None on a timeout or the worker's death."""
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return json.loads(line)

    def send(self, job: dict) -> bool:
        try:
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            return False
        return True

    def alive(self) -> bool:
        return self.proc.poll() is None

    def death_reason(self) -> str:
        try:
            rc = self.proc.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            return "worker stopped responding"
        if rc < 0:
            return f"worker killed by {_signal_name(-rc)}"
        return f"worker exited with status {rc}"

    def stderr_tail(self, n: int = 20) -> str:
        self.log.seek(0)
        lines = self.log.read().decode(errors="replace").rstrip().splitlines()
        return "\n".join(lines[-n:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        for f in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                f.close()
        self.log.close()


# --------------------------------------------------------------------------
# The database side


def gpu_name(device: int = 0) -> str:
    """The GPU's name as `executor.host_model(gpu=True)` gives it (nvidia-smi);
    "" when nvidia-smi cannot tell."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30,
        )
        names = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        if out.returncode == 0 and names:
            return names[0] if device >= len(names) else names[device]
    return ""


def _key(rec: Record) -> tuple:
    """What names a candidate across runs and hosts (as resuming `tune` does)."""
    return (rec.workload_key, rec.target, rec.sketch_hash, rec.knobs, rec.threads)


def _config(run: dict) -> dict:
    """A run's stored config (a `Database.runs` entry's): what a measuring
    run is timed by."""
    config = run.get("config")
    return config if isinstance(config, dict) else {}


def _setting(config: dict, name: str):
    v = config.get(name)
    if name == "timing":
        return {**_DEFAULTS["timing"], **(v if isinstance(v, dict) else {})}
    return float(v) if isinstance(v, (int, float)) else _DEFAULTS[name]


def measure_database(
    db: str,
    *,
    bundles: str | None = None,
    jsonl: str | None = None,
    timeout_s: float | None = None,
    device: int = 0,
    backend: str | None = None,
    limit: int | None = None,
    log=print,
) -> dict:
    """Measure every ``not_measured`` CUDA candidate of `db` (see the module's
    docstring). `bundles`: the build-only run's folder (default
    :func:`bundle_dir`); `jsonl`: write there instead of into `db`;
    `timeout_s`: the run time limit (default: the build run's
    ``run_timeout_s``, shortened by the best latency as `tune` does);
    `backend`: ``module:callable`` making a stand-in device (tests);
    `limit`: measure at most this many. Returns a summary: per task
    counts and best latency, ``measured``, ``skipped`` (with reasons), ``host``."""
    bundles = bundles or bundle_dir(db)
    with Database(db, readonly=jsonl is not None, create=False) as database:
        records = database.records_with_ids()
        pending = [(i, r) for i, r in records if r.error_kind == "not_measured" and r.target.startswith("cuda:")]
        summary: dict = {"measured": 0, "skipped": [], "tasks": {}, "host": "", "run_ids": []}
        if not pending:
            log("nothing to measure: no not_measured CUDA record")
            return summary
        # The records' host: the GPU's name as a measuring tune here gives it
        # (nvidia-smi), else the driver's; a stand-in device's own name.
        worker: _Worker | None = None
        host = "" if backend else gpu_name(device)
        if not host:
            worker = _Worker(backend, device)
            host = worker.device
        summary["host"] = host
        # Where the run and its records go: the database, or a JSON-lines
        # file for `Database.import_jsonl` (its new runs numbered after the
        # database's).
        runs = {int(r["id"]): r for r in database.runs()}
        sink = database if jsonl is None else JsonlWriter(jsonl, reserved_run_ids=runs)
        measured = [r for _, r in records if r.error_kind != "not_measured"]
        if isinstance(sink, JsonlWriter):
            measured += sink.records()
        done = {_key(r) for r in measured if r.host == host}
        best: dict[tuple, float] = {}  # (workload, target, threads) -> the best latency measured on this host
        for _, r in records:
            if r.valid and r.host == host:
                k = (r.workload_key, r.target, r.threads)
                best[k] = min(best.get(k, math.inf), r.latency_s)
        todo, seen = [], set()
        for i, r in pending:
            k = _key(r)
            if k in done or k in seen:
                continue
            seen.add(k)
            todo.append((i, r))
        if limit is not None:
            todo = todo[:limit]
        log(f"{len(todo)} candidate(s) to measure on {host} ({len(pending) - len(todo)} measured before or repeated)")
        if not todo:
            if worker is not None:
                worker.kill()
            return summary
        if worker is None:
            worker = _Worker(backend, device)
        build_runs = []
        for _, r in todo:
            rid = _versions(r.versions).get("run")
            if rid not in build_runs:
                build_runs.append(rid)
        first = runs.get(build_runs[0], {"seed": 0})
        info = {
            "config": _config(first),
            "versions": first.get("versions", {}),
            "target_info": first.get("target_info", {}),
            "host": {"model": host, "node": platform.node(), "platform": platform.platform(),
                     "machine": platform.machine(), "cpu_count": os.cpu_count(),
                     "python_implementation": platform.python_implementation()},
            "runner_host": host,
            "measure_only": {"tool": "gpu_measure", "of_runs": build_runs, "bundles": os.path.abspath(bundles),
                             "backend": worker.backend, "device": worker.device, "numpy": np.__version__,
                             "python": platform.python_version()},
        }
        run_ids: dict[str, int] = {}  # target -> this measuring run's id (one per target, as tune's)

        def run_id(target: str) -> int:
            if target not in run_ids:
                tasks = sorted({r.workload_key for _, r in todo if r.target == target})
                run_ids[target] = sink.add_run(int(first["seed"]), target, {**info, "tasks": tasks}, time.time())
                summary["run_ids"].append(run_ids[target])
            return run_ids[target]

        binaries: dict[tuple, dict] = {}  # (workload, target, cubin hash) -> outcome, as tune's per-task reuse
        specs: dict[str, dict | str] = {}
        try:
            for rid, r in todo:
                task_dir = os.path.join(bundles, r.workload_key)
                bundle = os.path.join(task_dir, bundle_name(r.target, r.sketch_hash, r.knobs))
                if task_dir not in specs:
                    # A task whose reference is missing or does not apply is
                    # no candidate's fault: its records stay not_measured.
                    try:
                        specs[task_dir] = load_task(task_dir)[0]
                    except (OSError, ValueError, KeyError) as e:
                        specs[task_dir] = f"no usable reference ({type(e).__name__}: {e})"
                spec = specs[task_dir]
                why = spec if isinstance(spec, str) else ""
                if not why:
                    try:
                        image_hash = _cubin_hash(bundle)
                    except FileNotFoundError:
                        why = "no bundle"
                    except (OSError, ValueError, RuntimeError) as e:
                        why = f"unreadable bundle ({e})"
                if why:
                    summary["skipped"].append({"record": rid, "why": f"{why} in {task_dir}"})
                    continue
                versions = _versions(r.versions)
                cfg = _config(runs.get(versions.get("run"), {}))
                bkey = (r.workload_key, r.target, r.threads)
                best_s = best.get(bkey, math.inf)
                limit_s = timeout_s if timeout_s is not None else _setting(cfg, "run_timeout_s")
                if math.isfinite(best_s):
                    limit_s = min(limit_s, max(_setting(cfg, "min_run_timeout_s"), _setting(cfg, "hang_factor") * best_s))
                cutoff = _setting(cfg, "cutoff_factor") * best_s
                tol = float(spec["tol"])
                bin_key = (r.workload_key, r.target, image_hash)
                if bin_key in binaries:
                    out = dict(binaries[bin_key])
                else:
                    if worker is None or not worker.alive():
                        if worker is not None:
                            worker.kill()
                        worker = _Worker(backend, device)
                    job = {"bundle": bundle, "task_dir": task_dir, "tol": tol, "policy": _setting(cfg, "timing"),
                           "cutoff_s": cutoff if math.isfinite(cutoff) else None}
                    out, worker = _run_one(worker, job, limit_s, tol)
                    binaries[bin_key] = out
                versions["run"] = run_id(r.target)
                rec = Record(
                    workload_key=r.workload_key, target=r.target, sketch_hash=r.sketch_hash, knobs=r.knobs,
                    costs=out["costs"], error_kind=out["error_kind"], error_msg=out["error_msg"][-2000:], host=host,
                    threads=r.threads, build_s=r.build_s, timestamp=time.time(), versions=json.dumps(versions),
                )
                sink.commit_record(rec)
                summary["measured"] += 1
                lat = rec.latency_s if rec.valid else None
                t = summary["tasks"].setdefault(r.workload_key, {"name": spec.get("name", ""), "measured": 0,
                                                                 "errors": {}, "best_s": None})
                t["measured"] += 1
                if lat is None:
                    t["errors"][out["error_kind"]] = t["errors"].get(out["error_kind"], 0) + 1
                else:
                    best[bkey] = min(best_s, lat)
                    if t["best_s"] is None or lat < t["best_s"]:
                        t["best_s"] = lat
                log(f"  {spec.get('name', r.workload_key)[:40]:<40} {r.sketch_hash[:10]} "
                    + (f"{lat * 1e6:10.1f} us" if lat is not None else f"{out['error_kind']:>13}"))
        finally:
            if worker is not None:
                worker.kill()
        return summary


def _versions(text: str) -> dict:
    try:
        v = json.loads(text) if text else {}
    except ValueError:
        v = {}
    return v if isinstance(v, dict) else {}


def _cubin_hash(bundle: str) -> str:
    _, image = cuda_runner.read_bundle(bundle)
    return hashlib.sha256(image).hexdigest()[:20]


def _run_one(worker: _Worker, job: dict, limit_s: float, tol: float) -> tuple[dict, _Worker | None]:
    """Run one job on `worker`; the outcome as a record's fields, and the
    worker (None once it is gone: the caller starts another)."""
    t0 = time.monotonic()
    msg = worker.receive(limit_s) if worker.send(job) else None
    if msg is not None:
        if msg["result"] == "ok":
            return {"costs": msg["costs"], "error_kind": "none", "error_msg": ""}, worker
        if msg["result"] == "wrong":
            return {"costs": [], "error_kind": "wrong_answer",
                    "error_msg": f"relative error {msg['error']:.3g} exceeds tolerance {tol:.3g}"}, worker
        worker.kill()
        return {"costs": [], "error_kind": "run_error", "error_msg": msg["message"]}, None
    elapsed = time.monotonic() - t0
    if worker.alive() and elapsed >= limit_s:
        tail = worker.stderr_tail()
        worker.kill()
        tail = f"\n--- worker stderr (last lines) ---\n{tail}" if tail else ""
        return {"costs": [], "error_kind": "timeout",
                "error_msg": f"job timed out after {elapsed:.3g} s (limit {limit_s:.3g} s){tail}"}, None
    reason = worker.death_reason()
    tail = worker.stderr_tail()
    worker.kill()
    msg_text = reason + (f"\n--- worker stderr (last lines) ---\n{tail}" if tail else "")
    return {"costs": [], "error_kind": "crash", "error_msg": msg_text}, None


# --------------------------------------------------------------------------
# Command line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m mlir_ansor.measure.gpu_measure",
        description="Measure the not_measured CUDA candidates of a build-only tuning database on this GPU "
        "(needs numpy and cuda-python or pycuda; no MLIR).",
    )
    p.add_argument("db", nargs="?", help="the tuning database (X.db); records are added to it")
    p.add_argument("--bundles", help="the build-only run's folder (default: DB + '.gpu')")
    p.add_argument("--jsonl", help="append the run and its records to this JSON-lines file; leave DB as it is")
    p.add_argument("--timeout", type=float, help="run time limit per candidate, s (default: the build run's)")
    p.add_argument("--device", type=int, default=0, help="CUDA device ordinal")
    p.add_argument("--limit", type=int, help="measure at most this many candidates")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--backend", help=argparse.SUPPRESS)  # module:callable, a stand-in device (tests)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker_main(args.backend, args.device)
        return 0
    if not args.db:
        p.error("the database is required")
    quiet = (lambda *a: None) if args.json else print
    try:
        s = measure_database(args.db, bundles=args.bundles, jsonl=args.jsonl, timeout_s=args.timeout,
                             device=args.device, backend=args.backend, limit=args.limit, log=quiet)
    except (OSError, ValueError, RuntimeError, AnsorError) as e:
        print(f"gpu_measure: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(s, indent=1))
    else:
        for key, t in s["tasks"].items():
            best = f"{t['best_s'] * 1e6:.1f} us" if t["best_s"] is not None else "none valid"
            errs = ", ".join(f"{k} {v}" for k, v in sorted(t["errors"].items()))
            print(f"{t['name'] or key}: {t['measured']} measured, best {best}" + (f"; errors: {errs}" if errs else ""))
        where = args.jsonl or args.db
        runs = ", ".join(map(str, s["run_ids"]))
        print(f"{s['measured']} record(s) written to {where}" + (f" (run {runs})" if runs else ""))
        for sk in s["skipped"]:
            print(f"skipped record {sk['record']}: {sk['why']}", file=sys.stderr)
    return 1 if s["skipped"] else 0


if __name__ == "__main__":
    sys.exit(main())
