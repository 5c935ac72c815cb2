"""The executor interface without Ray: the local executor's handles and
hosts, executor specs, and best-record queries that never compare hosts."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import INPUTS

from mlir_ansor.errors import AnsorError
from mlir_ansor.examples import workloads as wl
from mlir_ansor.graph.task import extract_tasks
from mlir_ansor.ir.dtypes import tolerance
from mlir_ansor.ir.program import load
from mlir_ansor.measure.executor import BuildJob, ReferenceJob, RunJob, parse_executor
from mlir_ansor.measure.local_executor import LocalExecutor
from mlir_ansor.measure.measurer import make_executor
from mlir_ansor.measure.pool import ErrorKind
from mlir_ansor.measure.runner import TimingPolicy
from mlir_ansor.records import Database, Record
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.search.space import sample
from mlir_ansor.target import Target

FAST = TimingPolicy(warmup=1, min_repeat=2, max_repeat=5, min_time_s=0.005)


def test_local_executor_builds_checks_and_times_by_handle():
    (task,) = extract_tasks(load(text=wl.matmul(64, 64, 64)))
    sketch = generate_sketches(task.mlir, Target.host())[0]
    knobs = sample(sketch.knobs, random.Random(0))
    spec = lambda ts: tuple((tuple(t.shape), t.dtype) for t in ts)  # noqa: E731
    with LocalExecutor(1, build_workers=1) as ex:
        ref = ex.prepare_reference(ReferenceJob(sketch.payload, spec(task.inputs), spec(task.outputs), 0, 1, FAST), 600)
        assert ref.ok and ref.host == Target.host().model and min(ref.value["costs"]) > 0
        with np.load(ref.artifact) as data:  # the handle is the reference data file
            np.testing.assert_allclose(data["ref0"], data["in0"] @ data["in1"], rtol=1e-4, atol=1e-4)
        good, bad = ex.build(
            [BuildJob(sketch.payload, sketch.concrete(knobs), 1), BuildJob("not mlir", None, 1)], 60
        )
        assert good.ok and os.path.exists(good.artifact) and good.value["binary_hash"]
        assert bad.error_kind == ErrorKind.EXCEPTION and bad.artifact is None
        run = ex.run(RunJob(good.artifact, ref.artifact, FAST, tolerance("f32", 64)), 30)
        assert run.ok and run.value["ok"] and run.value["error"] <= tolerance("f32", 64)
        assert run.host == Target.host().model and len(run.value["costs"]) >= 2
        ex.release(good.artifact)
        assert not os.path.exists(good.artifact)


def test_executor_specs():
    assert parse_executor("local") == "local"
    assert parse_executor("auto") == "auto"
    assert parse_executor("ray://10.0.0.1:10001") == "ray://10.0.0.1:10001"
    for bad in ("ray://", "slurm", "10.0.0.1:6379"):
        with pytest.raises(AnsorError, match="expected 'local', 'auto'"):
            parse_executor(bad)


def test_ray_executor_without_ray_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(AnsorError, match=r"pip install 'mlir-ansor\[ray\]'"):
        make_executor("auto")


def test_cli_rejects_an_unknown_executor(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mlir_ansor.tools.cli", "tune", str(INPUTS / "matmul.mlir"), "--trials", "1",
         "--db", str(tmp_path / "x.db"), "--executor", "slurm"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2 and "unknown executor 'slurm'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "x.db").exists()


def _rec(t: int, lat: float, host: str, threads: int = 1) -> Record:
    return Record("wk", "cpu:avx2", "sk", {"t": t}, (lat,), "none", host=host, threads=threads, timestamp=float(t))


def test_best_compares_records_of_one_host_only(tmp_path):
    with Database(tmp_path / "h.db") as db:
        # A fast machine's records must not beat a slow machine's best when
        # the slow machine is asked for, and the other way round.
        for t, lat in ((1, 3e-3), (2, 2e-3), (3, 4e-3)):
            db.commit_record(_rec(t, lat, "Slow CPU"))
        for t, lat in ((4, 1e-4), (5, 5e-5)):
            db.commit_record(_rec(t, lat, "Fast CPU"))
        db.commit_record(_rec(6, 1e-9, "Fast CPU", threads=2))
        assert [dict(r.knobs)["t"] for r in db.best("wk", "cpu:avx2", host="Slow CPU", k=5)] == [2, 1, 3]
        assert [dict(r.knobs)["t"] for r in db.best("wk", "cpu:avx2", threads=1, host="Fast CPU", k=5)] == [5, 4]
        assert db.best("wk", "cpu:avx2", host="Other CPU") == []
        # No host named: the host with the most valid records (for these
        # threads), never a mix of hosts.
        assert {r.host for r in db.best("wk", "cpu:avx2", threads=1, k=10)} == {"Slow CPU"}
        assert [dict(r.knobs)["t"] for r in db.best("wk", "cpu:avx2", threads=2, k=10)] == [6]
        assert db.best("wk", "cpu:other") == []


def test_cores_follow_cpu_affinity():
    # Under `taskset -c 0` the tuner must not overlap builds with timing on
    # the one core it may use (the machine may have more).
    import subprocess
    import sys

    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))});"
        "from mlir_ansor.target import usable_cores, Target;"
        "from mlir_ansor.measure.local_executor import LocalExecutor;"
        "ex = LocalExecutor(threads=1);"
        "print(usable_cores(), Target.host().cores, ex.overlap); ex.close()"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1", "False"]


def test_the_executor_interface_imports_no_mlir():
    """`measure.executor` (the interface, its jobs' data, `host_model`) is
    importable where MLIR is not: only the executors import the jobs."""
    code = "import sys, mlir_ansor.measure.executor; print(sorted(n for n in sys.modules if n.split('.')[0] == 'mlir'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_measurement_of_builds_and_runs():
    """A build's or a run's outcome as the measurement a record holds: an
    exception in a build is a build_error, in a run a run_error; a run past
    the tolerance is a wrong answer; the host is the run's."""
    import dataclasses

    from mlir_ansor.measure.executor import Outcome
    from mlir_ansor.measure.measurer import Measurement

    assert Measurement.of_build(Outcome(value={"binary_hash": "x"})) is None
    failed = Measurement.of_build(Outcome(error_kind=ErrorKind.EXCEPTION, error_msg="boom"), "CPU")
    assert (failed.error_kind, failed.error_msg, failed.host, failed.costs) == (ErrorKind.BUILD_ERROR, "boom", "CPU", ())
    assert not failed.valid and failed.latency_s == float("inf")
    assert Measurement.of_build(Outcome(error_kind=ErrorKind.TIMEOUT), "CPU").error_kind == ErrorKind.TIMEOUT
    ok = Measurement.of_run(Outcome(value={"ok": True, "costs": [3e-3, 1e-3, 2e-3], "error": 1e-7}, host="H"), 1e-4)
    assert ok.valid and ok.costs == (3e-3, 1e-3, 2e-3) and ok.latency_s == 2e-3
    assert (ok.error_kind, ok.error_msg, ok.host, ok.rel_error) == (ErrorKind.NONE, "", "H", 1e-7)
    wrong = Measurement.of_run(Outcome(value={"ok": False, "costs": [], "error": 0.5}, host="H"), 1e-4)
    assert wrong.error_kind == ErrorKind.WRONG_ANSWER and wrong.rel_error == 0.5
    assert wrong.error_msg == "relative error 0.5 exceeds tolerance 0.0001"
    crashed = Measurement.of_run(Outcome(error_kind=ErrorKind.CRASH, error_msg="killed by SIGSEGV"), 1e-4)
    assert (crashed.error_kind, crashed.host) == (ErrorKind.CRASH, "")
    assert Measurement.of_run(Outcome(error_kind=ErrorKind.EXCEPTION), 1e-4).error_kind == ErrorKind.RUN_ERROR
    assert Measurement(error_kind="not_measured").error_kind is ErrorKind.NOT_MEASURED
    with pytest.raises(dataclasses.FrozenInstanceError):
        ok.costs = ()  # type: ignore[misc]
    rec = Record("wk", "cpu:avx2", "sk", {}, ok.costs, ok.error_kind, host=ok.host)
    assert rec.error_kind == "none" and rec.latency_s == ok.latency_s


class _ColdFirstCall:
    """A kernel library whose first call is slow (its code faulting in, a
    sleeping OpenMP team waking) and whose later calls are fast; it writes
    the reference into its output."""

    def __init__(self, first_s: float, warm_s: float, ref: np.ndarray) -> None:
        self.first_s, self.warm_s, self.ref, self.calls = first_s, warm_s, ref, 0

    def __call__(self, path: str) -> _ColdFirstCall:
        return self

    def bind(self, arrays):
        def call() -> None:
            time.sleep(self.first_s if self.calls == 0 else self.warm_s)
            self.calls += 1
            arrays[-1][...] = self.ref

        return call

    def close(self) -> None:
        pass


@pytest.mark.parametrize("warm_s, cut", [(0.002, False), (0.05, True)])
def test_a_slow_first_call_alone_does_not_cut_a_candidate(tmp_path, monkeypatch, warm_s, cut):
    """The cutoff is decided by a warm run, not by the checking run: a
    16 x 1024 . 1024 x 1024 matmul at 2 threads ran 0.3-0.7 ms on its first
    call and 0.155 ms after, and was recorded as hopeless at 0.7 ms."""
    from mlir_ansor.measure import runner

    a = np.ones((4, 4), np.float32)
    ref = a @ a
    data = str(tmp_path / "d.npz")
    runner.save_data(data, [a, a], [ref], ["f32"])
    kernel = _ColdFirstCall(first_s=0.05, warm_s=warm_s, ref=ref)
    monkeypatch.setattr(runner, "Kernel", kernel)
    policy = TimingPolicy(min_repeat=3, max_repeat=3, min_time_s=0.0)
    r = runner.run("unused.so", data, policy, cutoff_s=0.02)
    assert r["ok"]
    assert r.get("cut", False) == cut
    if cut:
        assert r["costs"] == [pytest.approx(0.05, abs=0.04)] and kernel.calls == 2
    else:
        assert len(r["costs"]) == 3 and max(r["costs"]) < 0.02 and kernel.calls == 5
