"""Tuning through the Ray executor on a local two-CPU Ray instance: valid
results in the database, candidates that crash or hang isolated from the Ray
workers, and Ray workers killed mid-run without a record lost."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
pytestmark = pytest.mark.slow  # starts Ray and tunes

import ray_faults  # noqa: E402

from mlir_ansor import TuneConfig, tune  # noqa: E402
from mlir_ansor.examples import workloads as wl  # noqa: E402
from mlir_ansor.measure.builder import build  # noqa: E402
from mlir_ansor.measure.measurer import Measurer  # noqa: E402
from mlir_ansor.measure.ray_executor import LOCAL_RAY_CONFIG, RayExecutor  # noqa: E402
from mlir_ansor.measure.runner import Kernel, TimingPolicy  # noqa: E402
from mlir_ansor.records import Database  # noqa: E402
from mlir_ansor.search.generate import generate_sketches  # noqa: E402
from mlir_ansor.target import Target  # noqa: E402

FAST = TimingPolicy(warmup=1, min_repeat=2, max_repeat=5, min_time_s=0.005)
TESTS = Path(__file__).parent


@pytest.fixture(scope="module")
def ray_instance(tmp_path_factory):
    """A local Ray instance with two CPU workers, shared by this module's
    tests. Its workers can import this folder's modules (`ray_faults`), and
    find the folder where the faults are assigned; the fixture yields it."""
    if ray.is_initialized():
        pytest.skip("a Ray instance is already running in this process")
    faults = str(tmp_path_factory.mktemp("faults"))
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _system_config=LOCAL_RAY_CONFIG,
        runtime_env={"env_vars": {"PYTHONPATH": path, "MLIR_ANSOR_TEST_FAULTS": faults}},
    )
    yield faults
    ray.shutdown()


@pytest.fixture
def matmul64(tmp_path) -> Path:
    path = tmp_path / "matmul64.mlir"
    path.write_text(wl.matmul(64, 64, 64))
    return path


def _config(**kw) -> TuneConfig:
    base = dict(trials=8, batch_size=4, timing=FAST, build_timeout_s=60, run_timeout_s=30, executor="auto")
    base.update(kw)
    return TuneConfig(**base)


def test_tune_through_ray(ray_instance, matmul64, tmp_path):
    db = tmp_path / "ray.db"
    config = _config()
    with Measurer(config) as m:
        assert isinstance(m.executor, RayExecutor) and m.overlap  # a CPU left for builds beside the runner
        result = tune(str(matmul64), config=config, db=db, measurer=m)
        assert m.executor.lost == []
    (r,) = result.tasks
    assert result.measured == 8 and r.trials == 8
    assert np.isfinite(r.best_latency_s) and r.gflops > 0 and r.baseline_latency_s > 0
    # Every trial is in the database once, measured on (and labelled with)
    # the host that ran it: this machine.
    with Database(db) as d:
        recs = [x for x in d.records(r.task.workload_key) if not x.retime]  # candidates
        assert len(recs) == 8 and len({(x.sketch_hash, x.knobs) for x in recs}) == 8
        assert {x.host for x in recs} == {Target.host().model}
        best = d.best(r.task.workload_key, Target.host().key, host=Target.host().model)[0]
        assert best.latency_s == pytest.approx(r.best_latency_s)
        assert d.runs()[-1]["runner_host"] == Target.host().model
    # The best schedule, rebuilt here from the database's record, computes A @ B.
    sk = next(s for s in generate_sketches(r.task.mlir, Target.host()) if s.hash == best.sketch_hash)
    so = str(tmp_path / "best.so")
    build(sk.payload, sk.concrete(best.knobs), 1, so)
    rng = np.random.default_rng(1)
    a = rng.standard_normal((64, 64), dtype=np.float32)
    b = rng.standard_normal((64, 64), dtype=np.float32)
    c = np.full((64, 64), np.nan, dtype=np.float32)
    k = Kernel(so)
    k.bind([a, b, c])()
    k.close()
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class _Killer(threading.Thread):
    """Kills, among this test's own processes, first a Ray worker while it
    runs a build task, then the runner actor's process (SIGKILL: a lost
    worker, as when its node goes away)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.killed: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        targets = ["ray::mlir_ansor.build", "ray::_Runner"]
        while targets and not self.stop.is_set():
            for pid in _descendants(os.getpid()):
                title = _title(pid)
                if title.startswith(targets[0]):
                    os.kill(pid, signal.SIGKILL)
                    self.killed.append(title.strip())
                    targets.pop(0)
                    break
            time.sleep(0.01)


def test_crashes_and_killed_workers_lose_nothing(ray_instance, matmul64, tmp_path):
    """Candidates that abort the compiler, hang it, segfault the kernel or
    compute a wrong answer are recorded errors inside their Ray tasks (no
    Ray worker dies of them); Ray workers killed mid-run are retried, and
    every trial is recorded exactly once."""
    db = tmp_path / "faults.db"
    config = _config(trials=8, build_timeout_s=3)
    killer = _Killer()
    with Measurer(config, build_fn=ray_faults.build, run_fn=ray_faults.run) as m:
        killer.start()
        try:
            result = tune(str(matmul64), config=config, db=db, measurer=m)
        finally:
            killer.stop.set()
            killer.join()
        lost = list(m.executor.lost)
    assert [t.split()[0] for t in killer.killed] == ["ray::mlir_ansor.build", "ray::_Runner"]
    # Both kills were noticed as lost attempts and submitted again.
    assert any(line.startswith("build") and "WorkerCrashedError" in line for line in lost), lost
    assert any(line.startswith(("run", "reference")) and "Actor" in line for line in lost), lost
    with Database(db) as d:
        recs = [x for x in d.records() if not x.retime]  # candidates
        workload = d.workloads()[0]
    assert result.measured == 8 and len(recs) == 8
    assert len({(r.sketch_hash, r.knobs) for r in recs}) == 8
    assert not any("lost" in x.error_msg and "Ray cluster" in x.error_msg for x in recs)
    # Each candidate's own failure is recorded, by the isolated subprocess of
    # a Ray task, with the fault it was given.
    sketches = {sk.hash: sk for sk in generate_sketches(workload["task_mlir"], Target.host())}
    faults = ray_faults.assigned(ray_instance)
    got = {}
    for rec in recs:
        fault = faults.get(ray_faults.script_key(sketches[rec.sketch_hash].concrete(rec.knobs)))
        got.setdefault(fault, []).append(rec)
    assert sorted(k for k in got if k) == ["abort", "hang", "wrong"]
    (abort,), (hang,), (wrong,) = got["abort"], got["hang"], got["wrong"]
    assert abort.error_kind == "crash" and "SIGABRT" in abort.error_msg
    assert hang.error_kind == "timeout"
    assert wrong.error_kind == "wrong_answer" and "exceeds tolerance" in wrong.error_msg
    rest = got.get(None, [])
    assert sum("SIGSEGV" in r.error_msg for r in rest) == 1  # the first other run
    assert any(r.error_kind == "none" for r in rest)  # tuning went on
