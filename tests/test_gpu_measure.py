"""Measuring a build-only database on a GPU host without MLIR (`gpu_measure`).

The build side (MLIR + ptxas) builds a tiny matmul's candidates into a
database and keeps their bundles and the reference next to it; the measure
side runs ``python -m mlir_ansor.measure.gpu_measure`` in a process where
`mlir` cannot be imported and `mlir_ansor` is a copy of the package (as on
the GPU host, where the package is copied and MLIR is absent), on the fake
device of `fake_cuda.py` (computes A @ B itself; 0.1 ms a run).

Without MLIR (a GPU host), the database is made from the prebuilt copy in
tests/inputs/gpu_db: its SQL text (t.sql) and its bundles and reference
(t.db.gpu); `python tests/test_gpu_measure.py --regen` writes them, and
`test_measure_only_on_the_gpu` measures them on the real device.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
TESTS = Path(__file__).parent
SCRIPT = ROOT / "mlir_ansor" / "measure" / "gpu_measure.py"
MODULE = "mlir_ansor.measure.gpu_measure"
PREBUILT = TESTS / "inputs" / "gpu_db" / "t.db"  # its .gpu folder is committed; the database itself as SQL text:
PREBUILT_SQL = PREBUILT.with_suffix(".sql")
M, N, K = 64, 128, 64  # the f32 matmul built: 64x64 @ 64x128

_BLOCKER = '''
import os
import sys
from importlib.machinery import PathFinder

class _NoMlir:
    """This process stands for a GPU host: no MLIR, and mlir_ansor only as
    the copy of the package in $GPU_HOST (not the one installed here)."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "mlir":
            raise ModuleNotFoundError(f"{name} is not installed here (a GPU host without MLIR)", name=name)
        if name == "mlir_ansor":
            spec = PathFinder.find_spec(name, sys.path)
            if spec is None or not spec.origin.startswith(os.environ["GPU_HOST"] + os.sep):
                raise ModuleNotFoundError(f"{name}: only the copy in $GPU_HOST is here", name=name)
            return spec
        return None

sys.meta_path.insert(0, _NoMlir())
'''


@pytest.fixture(scope="module")
def gpu_host(tmp_path_factory) -> Path:
    """A folder standing for the GPU host: a copy of the whole `mlir_ansor`
    package (as README says to copy there), nothing else."""
    d = tmp_path_factory.mktemp("gpu_host")
    shutil.copytree(ROOT / "mlir_ansor", d / "mlir_ansor", ignore=shutil.ignore_patterns("__pycache__"))
    return d


@pytest.fixture(scope="module")
def no_mlir(tmp_path_factory, gpu_host) -> dict:
    """Environment for a subprocess that cannot import mlir (a sitecustomize
    on PYTHONPATH, inherited by the worker too), imports `mlir_ansor` only
    from the copy in `gpu_host`, and finds `fake_cuda`."""
    d = tmp_path_factory.mktemp("no_mlir")
    (d / "sitecustomize.py").write_text(_BLOCKER)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (d, gpu_host, TESTS))), "GPU_HOST": str(gpu_host)}


def _measure(db: Path, env: dict, *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", MODULE, str(db), *args], capture_output=True, text=True, env=env, timeout=timeout,
        cwd=db.parent,
    )


def test_gpu_measure_imports_without_mlir(no_mlir, gpu_host):
    """gpu_measure, the database it writes through (`mlir_ansor.records`)
    and the runner it draws inputs with import no MLIR: with MLIR installed
    none of them imports it, and where it is absent the copied package runs
    as ``python -m mlir_ansor.measure.gpu_measure``."""
    imports = re.findall(r"^\s*(?:import|from)\s+(\S+)", SCRIPT.read_text(), re.M)
    assert not [m for m in imports if m.split(".")[0] in ("mlir", "")], imports
    assert {"mlir_ansor.records.database", "mlir_ansor.measure.runner"} <= set(imports), imports
    loaded = (
        "import sys\n"
        "import mlir_ansor.records, mlir_ansor.measure.runner, mlir_ansor.measure.gpu_measure as gm\n"
        "assert gm.Database is mlir_ansor.records.Database and gm.random_inputs is mlir_ansor.measure.runner.random_inputs\n"
        "print(gm.__file__, sorted(n for n in sys.modules if n.split('.')[0] == 'mlir'))\n"
    )
    # Where MLIR is installed: nothing of it is imported.
    r = subprocess.run([sys.executable, "-c", loaded], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.split()[1:] == ["[]"], r.stdout + r.stderr
    # Where it is absent (the blocker says so), from the copied package.
    r = subprocess.run(
        [sys.executable, "-c", "import mlir_ansor.records\nimport mlir"], capture_output=True, text=True, env=no_mlir,
        timeout=60, cwd=gpu_host,
    )
    assert r.returncode == 1 and "ModuleNotFoundError: mlir is not installed here" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-c", loaded], capture_output=True, text=True, env=no_mlir, timeout=60,
                       cwd=gpu_host)
    assert r.returncode == 0, r.stderr
    path, mods = r.stdout.split()
    assert Path(path).is_relative_to(gpu_host) and mods == "[]", r.stdout
    r = subprocess.run([sys.executable, "-m", MODULE, "--help"], capture_output=True, text=True, env=no_mlir,
                       timeout=60, cwd=gpu_host)
    assert r.returncode == 0 and "not_measured" in r.stdout, r.stderr
    # The script form of earlier releases still runs: it imports the package
    # it is in (here the only one: the copy is not on PYTHONPATH).
    script = gpu_host / "mlir_ansor" / "measure" / "gpu_measure.py"
    env = {**no_mlir, "PYTHONPATH": no_mlir["PYTHONPATH"].replace(str(gpu_host), str(gpu_host / "nowhere"))}
    r = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, env=env, timeout=60,
                       cwd=gpu_host.parent)
    assert r.returncode == 0 and "not_measured" in r.stdout, r.stderr


def build_database(db: Path) -> None:
    """A build-only run of the test matmul (3 candidates) into `db`."""
    from mlir_ansor import tune
    from mlir_ansor.examples import workloads
    from mlir_ansor.ir.program import load
    from mlir_ansor.target import Target
    from mlir_ansor.tuner import TuneConfig

    cfg = TuneConfig(trials=3, batch_size=3, seed=2, build_only=True)
    tune(load(text=workloads.matmul(M, N, K, "f32")), target=Target.cuda(90), config=cfg, db=db)


def _can_build() -> bool:
    try:
        from mlir_ansor.passes.nvvm import find_ptxas
    except ImportError:
        return False
    return find_ptxas() is not None


def _prebuilt(dest: Path) -> Path:
    """The prebuilt database, made at `dest` from its SQL text, with its
    bundle folder next to it."""
    import sqlite3

    with sqlite3.connect(dest) as con:
        con.executescript(PREBUILT_SQL.read_text())
    con.close()
    shutil.copytree(str(PREBUILT) + ".gpu", str(dest) + ".gpu")
    return dest


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """A build-only database of the test matmul: built afresh where MLIR
    and ptxas are, else the prebuilt copy."""
    if not _can_build():
        if not PREBUILT_SQL.exists():
            pytest.skip("no MLIR and ptxas to build with, and no prebuilt database")
        return _prebuilt(tmp_path_factory.mktemp("prebuilt") / "t.db")
    db = tmp_path_factory.mktemp("built") / "t.db"
    build_database(db)
    return db


@pytest.fixture
def mlir_side():
    pytest.importorskip("mlir", reason="MLIR bindings are not installed (a GPU host has none)")


@pytest.fixture
def db(built, tmp_path) -> Path:
    """A copy of the built database and its bundle folder."""
    dest = tmp_path / "t.db"
    shutil.copyfile(built, dest)
    shutil.copytree(str(built) + ".gpu", str(dest) + ".gpu")
    return dest


def _records(db: Path):
    from mlir_ansor.records import Database

    with Database(db) as d:
        return d.records(), d.runs()


def test_build_only_keeps_bundles_and_reference(built, mlir_side):
    """Every not_measured record has its bundle (named by target, sketch and
    knobs); the task's reference matches A @ B on the inputs drawn again
    from the seed, which are `runner.random_inputs`'s, as the build host's."""
    from mlir_ansor.measure import cuda_runner, gpu_measure
    from mlir_ansor.measure.runner import random_inputs

    recs, _ = _records(built)
    todo = [r for r in recs if r.error_kind == "not_measured"]
    assert todo
    (task_dir,) = Path(gpu_measure.bundle_dir(built)).iterdir()
    assert task_dir.name == todo[0].workload_key
    names = {gpu_measure.bundle_name(r.target, r.sketch_hash, r.knobs) for r in todo}
    assert names == {p.name for p in task_dir.glob("*.cubin-bundle")}
    for n in names:
        entry, image = cuda_runner.read_bundle(task_dir / n)
        assert image[:4] == b"\x7fELF" and [b["shape"] for b in entry["buffers"]] == [[M, K], [K, N], [M, N]]
    spec, inputs, refs = gpu_measure.load_task(task_dir)
    assert spec["seed"] == 2 and spec["target"] == "cuda:sm_90" and spec["tol"] > 0
    for a, b in zip(inputs, random_inputs([((M, K), "f32"), ((K, N), "f32")], 2)):
        np.testing.assert_array_equal(a, b)
    exact = inputs[0].astype(np.float64) @ inputs[1].astype(np.float64)
    assert cuda_runner.relative_error(refs[0], exact) < 1e-5
    size = sum(p.stat().st_size for p in task_dir.iterdir())
    assert size < 256 << 10  # the reference outputs (32 KiB) and the cubins; no inputs


@pytest.mark.parametrize("wrong", [False, True])
def test_measure_only_on_a_fake_gpu(wrong, db, no_mlir, mlir_side):
    """Every not_measured candidate gets a record as a measuring `tune` on
    the GPU host writes it (the GPU as host, the build's figures, a run of
    its own); right answers are valid at the fake's 0.1 ms and `best()`
    finds them, a wrong one is a wrong_answer. Measuring again adds nothing."""
    from mlir_ansor.records import Database

    device = "fake_cuda:wrong_device" if wrong else "fake_cuda:FakeMatmulDevice"
    before, runs0 = _records(db)
    r = _measure(db, no_mlir, "--backend", device)
    assert r.returncode == 0, r.stdout + r.stderr
    after, runs = _records(db)
    assert after[: len(before)] == before  # the not_measured records stay, as after a measuring tune
    new = after[len(before):]
    todo = [x for x in before if x.error_kind == "not_measured"]
    assert len(new) == len(todo)
    (run,) = runs[len(runs0):]
    assert run["measure_only"]["of_runs"] == [runs0[0]["id"]] and run["runner_host"] == "Fake GPU"
    assert run["config"] == runs0[0]["config"] and run["seed"] == 2
    for old, rec in zip(todo, new):
        assert (rec.workload_key, rec.target, rec.sketch_hash, rec.knobs) == (old.workload_key, old.target, old.sketch_hash, old.knobs)
        assert (rec.host, rec.threads, rec.build_s) == ("Fake GPU", old.threads, old.build_s)
        versions = json.loads(rec.versions)
        assert versions["run"] == run["id"] and versions["seed"] == 2
        if wrong:
            assert rec.error_kind == "wrong_answer" and not rec.costs
            assert rec.error_msg.startswith("relative error ") and "exceeds tolerance 3.05e-05" in rec.error_msg
        else:
            assert rec.valid and set(rec.costs) == {1e-4} and len(rec.costs) >= 3, rec
    with Database(db) as d:
        best = d.best(todo[0].workload_key, "cuda:sm_90")
        if wrong:
            assert best == []
        else:
            assert (best[0].latency_s, best[0].host) == (1e-4, "Fake GPU")
        assert len(d.measured_keys(todo[0].workload_key, "cuda:sm_90")) == len(todo)
    again = _measure(db, no_mlir, "--backend", device)
    assert again.returncode == 0 and "0 candidate(s) to measure" in again.stdout, again.stdout + again.stderr
    assert _records(db)[0] == after


@pytest.mark.parametrize("fault", ["abort", "hang"])
def test_measure_only_survives_a_crash_and_a_hang(fault, db, no_mlir, tmp_path, mlir_side):
    """The first candidate's run aborts the worker (or hangs past the
    limit): it is recorded as a crash (a timeout), and the others are
    measured by a fresh worker."""
    env = {**no_mlir, "FAKE_GPU_FAULT": fault, "FAKE_GPU_MARKER": str(tmp_path / "faulted")}
    before, _ = _records(db)
    r = _measure(db, env, "--backend", "fake_cuda:faulty_device", "--timeout", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    new = _records(db)[0][len(before):]
    assert len(new) == sum(x.error_kind == "not_measured" for x in before) >= 2
    first, *rest = new
    if fault == "abort":
        assert first.error_kind == "crash" and first.error_msg.startswith("worker killed by SIGABRT")
    else:
        assert first.error_kind == "timeout" and first.error_msg.startswith("job timed out after")
    assert all(x.valid for x in rest)


def test_measure_only_to_jsonl(db, no_mlir, tmp_path, mlir_side):
    """--jsonl leaves the database alone; importing the file gives what
    measuring in place gives, and a second run appends nothing."""
    from mlir_ansor.records import Database

    out = tmp_path / "gpu.jsonl"
    before, _ = _records(db)
    r = _measure(db, no_mlir, "--backend", "fake_cuda:FakeMatmulDevice", "--jsonl", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert _records(db)[0] == before
    lines = out.read_text().splitlines()
    again = _measure(db, no_mlir, "--backend", "fake_cuda:FakeMatmulDevice", "--jsonl", str(out))
    assert again.returncode == 0 and out.read_text().splitlines() == lines, again.stdout + again.stderr
    with Database(db) as d:
        added = d.import_jsonl(out)
        assert added == sum(x.error_kind == "not_measured" for x in before)
        new = d.records()[len(before):]
        (run,) = d.runs()[1:]
    assert all(x.valid and x.host == "Fake GPU" and json.loads(x.versions)["run"] == run["id"] for x in new)


def test_measure_only_without_bundles_skips(db, no_mlir, mlir_side):
    """Inputs that do not match the reference's (another numpy's generator)
    leave the task's records not_measured; so does a missing bundle, and
    the others are measured. Exit status 1, naming what was skipped."""
    from mlir_ansor.measure import gpu_measure

    before, _ = _records(db)
    todo = [x for x in before if x.error_kind == "not_measured"]
    folder = Path(gpu_measure.bundle_dir(db)) / todo[0].workload_key
    spec = json.loads((folder / "task.json").read_text())
    (folder / "task.json").write_text(json.dumps({**spec, "inputs_digest": "0" * 32}))
    r = _measure(db, no_mlir, "--backend", "fake_cuda:FakeMatmulDevice")
    assert r.returncode == 1 and r.stderr.count("differ from the build host's") == len(todo), r.stdout + r.stderr
    assert _records(db)[0] == before
    (folder / "task.json").write_text(json.dumps(spec))
    (folder / gpu_measure.bundle_name(todo[0].target, todo[0].sketch_hash, todo[0].knobs)).unlink()
    r = _measure(db, no_mlir, "--backend", "fake_cuda:FakeMatmulDevice")
    assert r.returncode == 1 and "no bundle" in r.stderr, r.stdout + r.stderr
    assert len(_records(db)[0]) == len(before) + len(todo) - 1


def test_prebuilt_database_is_current(no_mlir, tmp_path):
    """The prebuilt copy (for GPU hosts) is in the format this code reads:
    every not_measured record's bundle is there, and it measures on the
    fake device."""
    import sqlite3

    if not PREBUILT_SQL.exists():
        pytest.skip("no prebuilt database")
    db = _prebuilt(tmp_path / "t.db")
    r = _measure(db, no_mlir, "--backend", "fake_cuda:FakeMatmulDevice", "--json")
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(r.stdout)
    with sqlite3.connect(db) as con:
        todo = con.execute("SELECT COUNT(*) FROM records WHERE error_kind = 'not_measured'").fetchone()[0]
    assert todo >= 2 and summary["measured"] == todo and not summary["skipped"]
    ((key, task),) = summary["tasks"].items()
    assert task["errors"] == {} and task["best_s"] == pytest.approx(1e-4)


def _gpu_count() -> tuple[int, str]:
    import importlib.util

    name = "ansor_cuda_runner_gm"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT.with_name("cuda_runner.py"))
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])  # type: ignore[union-attr]
    mod = sys.modules[name]
    return mod.device_count()


def test_measure_only_on_the_gpu(built, tmp_path):
    """On a host with a GPU: every candidate runs on the device, is checked
    against the build host's reference and timed; the staged f32 kernels
    match (FMAs, no TF32). Needs only numpy, cuda-python and sqlite3."""
    import sqlite3

    n, why = _gpu_count()
    if not n:
        pytest.skip(f"no GPU to measure on: {why}")
    db = tmp_path / "t.db"
    shutil.copyfile(built, db)
    shutil.copytree(str(built) + ".gpu", str(db) + ".gpu")
    r = _measure(db, dict(os.environ), "--json", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    summary = json.loads(r.stdout)
    with sqlite3.connect(db) as con:
        rows = con.execute("SELECT error_kind, error_msg, latency_s, host FROM records WHERE error_kind != 'not_measured'").fetchall()
    assert len(rows) == summary["measured"] >= 2
    assert all(kind == "none" and 0 < lat < 1.0 and host == summary["host"] for kind, _, lat, host in rows), rows


if __name__ == "__main__":
    # Write the prebuilt database (needs MLIR and ptxas): python tests/test_gpu_measure.py --regen
    if sys.argv[1:] != ["--regen"]:
        sys.exit("usage: python tests/test_gpu_measure.py --regen")
    import sqlite3
    import tempfile

    shutil.rmtree(str(PREBUILT) + ".gpu", ignore_errors=True)
    PREBUILT.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "t.db"
        build_database(db)
        con = sqlite3.connect(db)
        PREBUILT_SQL.write_text("\n".join(con.iterdump()) + "\n")
        con.close()
        shutil.copytree(str(db) + ".gpu", str(PREBUILT) + ".gpu")
    print(f"wrote {PREBUILT_SQL} and {PREBUILT}.gpu")
