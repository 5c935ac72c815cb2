"""Records coming in are checked, and a database that cannot be written is
read (issue #22, items 5 and 6).

A JSON-lines line with a NaN, infinite, zero or negative cost, a bad thread
count, an absurd knob value or too deep or too long JSON is refused with
InputError naming the file and line; a stored row like it is skipped by every
reader, with a warning naming the row, and is never a best. ``show``,
``export``, ``compile`` and ``run`` open the database read-only, so one in a
folder SQLite cannot write (no ``-wal``/``-shm``) or without write permission
reads as usual and is never called corrupt."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile

import pytest
from conftest import INPUTS, as_unprivileged

from mlir_ansor.errors import DatabaseError, InputError
from mlir_ansor.records import Database, Record
from mlir_ansor.records import database as dbmod

WK = "wk-matmul-64"
TGT = "cpu:znver3:avx2"
MATMUL = str(INPUTS / "matmul.mlir")


def rec(knobs, costs=(1e-3,), *, err="none", threads=1, ts=1.0, sketch="s1", host="H", **kw):
    return Record(WK, TGT, sketch, knobs, tuple(costs), err, threads=threads, timestamp=ts, host=host, **kw)


def _line(**over) -> str:
    d = {"kind": "record", **rec({"t": 1}).to_json()}
    d.update(over)
    return json.dumps(d)


GOOD = _line()


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (GOOD.replace('"costs": [0.001]', '"costs": [NaN]'), "costs[0] is NaN, which is not a JSON number"),
        (GOOD.replace('"costs": [0.001]', '"costs": [Infinity]'), "costs[0] is Infinity"),
        (GOOD.replace('"costs": [0.001]', '"costs": [-Infinity]'), "costs[0] is -Infinity"),
        (GOOD.replace('"costs": [0.001]', '"costs": [1e999]'), r"costs[0] is inf: a cost must be a positive finite"),
        (_line(costs=[0.0]), r"costs[0] is 0.0: a cost must be a positive finite"),
        (_line(costs=[1e-3, -2e-3]), r"costs[1] is -0.002"),
        (_line(costs=["fast"]), r"costs[0] is 'fast'"),
        (_line(costs=[True]), r"costs[0] is True"),
        (_line(threads=-4), "threads is -4: a thread count must be an integer from 1 to 2147483648"),
        (_line(threads=0), "threads is 0"),
        (_line(threads=2**40), f"threads is {2**40}"),
        (_line(threads=2.5), "threads is 2.5"),
        (_line(knobs=[["t", 2**40]]), f"knob t is {2**40}: beyond 2147483648"),
        (_line(knobs=[["t", 1.5]]), "knob t is 1.5: a knob value must be an integer"),
        (_line(knobs=[["t", [1]]]), r"knob t is [1]"),
        (_line(knobs=[["t", 1], ["t", 2]]), "knob t is given twice"),
        (_line(knobs={"t": 1}), "knobs must be a list of"),
        (_line(build_s=-1.0), "build_s is -1.0"),
        (_line(workload_key=7), "workload_key must be a non-empty string"),
        (json.dumps({"kind": "record"}), "no field 'knobs'"),
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        (json.dumps({"kind": "run", "id": 1, "started": 1.0, "seed": 1, "target": TGT,
                     "info": {"a": json.loads("[" * 40 + "]" * 40)}}), "nested too deeply"),
        (json.dumps({"kind": "run", "id": -1, "started": 1.0, "seed": 1, "target": TGT, "info": {}}), "run id is -1"),
        (json.dumps({"kind": "run", "id": 1, "started": 1.0, "seed": 2**70, "target": TGT, "info": {}}), "seed is"),
        (json.dumps({"kind": "workload", "workload_key": "k", "name": "n", "task_mlir": "", "flops": -1}),
         "flops is -1"),
        (json.dumps({"kind": "workload", "workload_key": "k", "name": "n", "task_mlir": "", "flops": 2**64}),
         "flops is"),
        ("[1, 2]", "a line must hold a JSON object"),
        ('{"kind": "bogus"}', "unknown kind 'bogus'"),
    ],
)
def test_import_refuses_a_bad_line_naming_file_and_line(tmp_path, line, why):
    path = tmp_path / "in.jsonl"
    path.write_text(GOOD + "\n\n" + line + "\n")
    with Database(tmp_path / "x.db") as db:
        with pytest.raises(InputError, match=r"in\.jsonl:3: not a tuning record: .*" + re.escape(why)):
            db.import_jsonl(path)
        assert db.count() == 0  # nothing half-imported


def test_import_refuses_a_huge_line_and_non_utf8(tmp_path, monkeypatch):
    monkeypatch.setattr(dbmod, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "big.jsonl"
    path.write_text(GOOD + "\n" + _line(error_msg="x" * 2000) + "\n")
    with Database(tmp_path / "x.db") as db:
        with pytest.raises(InputError, match=r"big\.jsonl:2: a line longer than 1000 characters"):
            db.import_jsonl(path)
        path.write_bytes(GOOD.encode() + b"\n\xff\xfe\n")
        with pytest.raises(InputError, match=r"big\.jsonl: not UTF-8 text"):
            db.import_jsonl(path)
        assert db.count() == 0


def test_import_keeps_an_infinite_timeout_in_a_runs_info(tmp_path):
    """A run's info is free-form (a configured timeout may be inf): its
    Infinity stays a float; nowhere else is it accepted."""
    path = tmp_path / "in.jsonl"
    run = {"kind": "run", "id": 3, "started": 1.0, "seed": 1, "target": TGT, "info": {"timeout": 0}}
    path.write_text(json.dumps(run).replace('"timeout": 0', '"timeout": Infinity') + "\n" + GOOD + "\n")
    with Database(tmp_path / "x.db") as db:
        assert db.import_jsonl(path) == 1
        assert db.runs()[0]["timeout"] == float("inf")


def _store_bad_rows(path) -> dict[str, int]:
    """A database with one good record and bad rows written behind its back
    (as an old version or a hand edit might have): name -> row id."""
    with Database(path) as db:
        db.commit_record(rec({"t": 1}, (2e-3,), ts=1.0))
        for i in range(6):
            db.commit_record(rec({"t": 10 + i}, (1e-3,), ts=2.0 + i))  # each made bad below
        ids = [i for i, _ in db.records_with_ids()]
    con = sqlite3.connect(path)
    bad = {
        "nan cost": ("UPDATE records SET costs = '[NaN]', latency_s = NULL WHERE id = ?", ids[1]),
        "negative cost": ("UPDATE records SET costs = '[-1e-3]', latency_s = -1e-3 WHERE id = ?", ids[2]),
        "zero cost": ("UPDATE records SET costs = '[0]', latency_s = 0 WHERE id = ?", ids[3]),
        "negative threads": ("UPDATE records SET threads = -2, latency_s = 1e-9 WHERE id = ?", ids[4]),
        "huge knob": (f"UPDATE records SET knobs = '[[\"t\",{2**40}]]', latency_s = 1e-9 WHERE id = ?", ids[5]),
        "garbage knobs": ("UPDATE records SET knobs = '[[[[', latency_s = 1e-9 WHERE id = ?", ids[6]),
    }
    with con:
        for sql, i in bad.values():
            con.execute(sql, (i,))
    con.close()
    return {"good": ids[0], **{k: i for k, (_, i) in bad.items()}}


def test_stored_bad_rows_are_skipped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "bad.db"
    ids = _store_bad_rows(path)
    caplog.set_level(logging.WARNING)
    with Database(path, readonly=True) as db:
        (best,) = db.best(WK, TGT)
        assert best.row_id == ids["good"] and best.latency_s == 2e-3  # never the NaN, 0 or negative one
        assert [i for i, _ in db.records_with_ids()] == [ids["good"]]
        assert set(db.invalid_rows) == set(ids.values()) - {ids["good"]}
        assert db.count() == 7  # counting reads no row
        assert len(db.measured_keys(WK, TGT)) == 6  # the garbage knobs cannot be a key
    text = caplog.text
    for name in ("nan cost", "negative cost", "zero cost", "negative threads", "huge knob", "garbage knobs"):
        assert f"record {ids[name]} is invalid and is skipped" in text, name
    assert "costs[0] is -0.001: a cost must be a positive finite number" in text
    assert "threads is -2" in text and f"knob t is {2**40}" in text and "NaN" in text
    assert "corrupt" not in text
    # export_jsonl leaves them out, so its file imports again
    with Database(path) as db:
        assert db.export_jsonl(tmp_path / "out.jsonl") == 1
    with Database(tmp_path / "again.db") as db:
        assert db.import_jsonl(tmp_path / "out.jsonl") == 1


def test_many_bad_rows_warn_a_few_times(tmp_path, caplog):
    path = tmp_path / "many.db"
    with Database(path) as db:
        for i in range(30):
            db.commit_record(rec({"t": i}, ts=float(i)))
    con = sqlite3.connect(path)
    with con:
        con.execute("UPDATE records SET costs = '[NaN]'")
    con.close()
    caplog.set_level(logging.WARNING)
    with Database(path, readonly=True) as db:
        assert db.records() == [] and db.best(WK, TGT) == [] and len(db.invalid_rows) == 30
    assert caplog.text.count("is invalid and is skipped") == 10
    assert "further invalid records are skipped without a warning each" in caplog.text
    assert "30 invalid records were skipped in all" in caplog.text


# -- the commands -------------------------------------------------------------


def _cli(*args, user: str | None = None, cwd=None, home=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mlir_ansor.tools.cli", *args]
    if user is not None:
        cmd = as_unprivileged(cmd)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    if home is not None:
        env["HOME"] = str(home)
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


@pytest.fixture(scope="module")
def tuned_db(tmp_path_factory):
    """A database for matmul.mlir's task on this host: the default point of
    its first sketch (2 ms), a faster record whose knob value the sketch
    does not offer, and a faster one with a NaN cost: (path, ids, task name)."""
    from mlir_ansor.graph.task import extract_tasks
    from mlir_ansor.search.generate import generate_sketches
    from mlir_ansor.search.sketch import default_assignment
    from mlir_ansor.target import Target

    target = Target.host()
    (task,) = extract_tasks(MATMUL)
    sk = generate_sketches(task.mlir, target)[0]
    good = dict(default_assignment(sk, 1))
    name = sk.knobs[0].name
    off = dict(good, **{name: max(sk.knobs[0].options) + 12345})
    path = tmp_path_factory.mktemp("db") / "t.db"
    with Database(path) as db:
        db.add_workload(task.workload_key, task.name, task.mlir, task.flops)
        for i, (knobs, cost) in enumerate([(good, 2e-3), (off, 1e-3), (dict(good, **{name: -1}), 1e-4)]):
            db.commit_record(Record(task.workload_key, target.key, sk.hash, knobs, (cost,), "none",
                                    host=target.model, threads=1, timestamp=float(i)))
        ids = [i for i, _ in db.records_with_ids()]
    con = sqlite3.connect(path)
    with con:
        con.execute("UPDATE records SET costs = '[NaN]' WHERE id = ?", (ids[2],))
    con.close()
    return path, ids, task.name


def test_show_export_compile_skip_bad_records(tuned_db, tmp_path):
    path, ids, name = tuned_db
    before = path.read_bytes()
    p = _cli("show", str(path))
    assert p.returncode == 0, p.stderr
    assert f"record {ids[2]} is invalid and is skipped: costs[0] is NaN" in p.stderr
    assert name in p.stdout
    p = _cli("export", str(path), "-o", str(tmp_path / "s.mlir"))
    assert p.returncode == 0, p.stderr
    assert f"record {ids[1]} is invalid and is skipped: knob" in p.stderr and "not one of the options" in p.stderr
    assert "measured 0.002 s" in (tmp_path / "s.mlir").read_text()  # the good record, not the faster bad ones
    p = _cli("compile", MATMUL, "--db", str(path), "-o", str(tmp_path / "m.mlir"))
    assert p.returncode == 0, p.stderr
    assert f"record {ids[1]} is invalid and is skipped" in p.stderr
    assert (tmp_path / "m.mlir").exists()
    assert path.read_bytes() == before and "corrupt" not in p.stderr


def test_export_with_only_bad_records_names_them(tuned_db, tmp_path):
    path, ids, name = tuned_db
    only = tmp_path / "only.db"
    shutil.copy(path, only)
    con = sqlite3.connect(only)
    with con:
        con.execute("DELETE FROM records WHERE id = ?", (ids[0],))
    con.close()
    p = _cli("export", str(only))
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith(f"mlir-ansor: error: task {name}: no ")
    assert f"record {ids[2]}: costs[0] is NaN" in p.stderr  # from the database's checks
    assert f"record {ids[1]}" in p.stderr  # the knob outside the sketch's options
    assert "Traceback" not in p.stderr


def test_readonly_open_writes_nothing(tuned_db, tmp_path):
    path, _, _ = tuned_db
    db_path = tmp_path / "ro.db"
    shutil.copy(path, db_path)
    os.chmod(db_path, 0o444)
    before = sorted(os.listdir(tmp_path)), db_path.read_bytes()
    with Database(db_path, readonly=True) as db:
        assert len(db.records()) == 2 and not db.immutable
        with pytest.raises(DatabaseError, match="commit_record"):
            db.commit_record(rec({"t": 1}))
    assert db_path.read_bytes() == before[1]


def _nobody() -> str | None:
    """A user without root's privileges to run commands as, or None."""
    if os.geteuid() != 0:
        return None  # the current user is unprivileged already: permissions apply to it
    if shutil.which("setpriv") is None:
        pytest.skip("running as root, and no setpriv to run as an unprivileged user: read-only folders "
                    "and files cannot be tested (root writes them anyway)")
    return "nobody"


@pytest.mark.parametrize("case", ["read-only folder", "read-only file"])
def test_commands_read_a_database_that_cannot_be_written(tuned_db, case):
    """As an unprivileged user: in a folder it cannot write (SQLite cannot
    make -wal/-shm: opened immutable), or a file without write permission in
    a folder it can, show, export, compile and run read the database, write
    nothing, and never call it corrupt."""
    path, ids, name = tuned_db
    user = _nobody()
    top = tempfile.mkdtemp(prefix="mlir-ansor-ro-")
    try:
        os.chmod(top, 0o755)
        folder = os.path.join(top, "dbs")
        os.mkdir(folder)
        db_path = os.path.join(folder, "t.db")
        shutil.copy(path, db_path)
        os.chmod(db_path, 0o444)
        home = os.path.join(top, "home")
        os.mkdir(home)
        os.chmod(home, 0o777)
        os.chmod(folder, 0o555 if case == "read-only folder" else 0o777)
        if user is None and case == "read-only folder":
            os.chmod(folder, 0o555)
        before = sorted(os.listdir(folder)), open(db_path, "rb").read()
        # compile and run start worker processes, which this sandbox's
        # unprivileged user cannot (it cannot execute the venv's interpreter's
        # target): they run as this user, on the same read-only file.
        runs = {
            "show": _cli("show", db_path, "--json", user=user, cwd=home, home=home),
            "export": _cli("export", db_path, user=user, cwd=home, home=home),
        }
        if case == "read-only folder":
            assert sorted(os.listdir(folder)) == before[0]  # no -wal, no -shm
        runs |= {
            "compile": _cli("compile", MATMUL, "--db", db_path, "-o", os.path.join(home, "m.mlir"), cwd=home),
            "run": _cli("run", MATMUL, "--db", db_path, "--repeat", "1", "--json", cwd=home),
        }
        for cmd, p in runs.items():
            assert p.returncode == 0, (cmd, p.stderr)
            assert "corrupt" not in p.stderr and "readonly" not in p.stderr, (cmd, p.stderr)
            assert f"record {ids[2]} is invalid" in p.stderr or cmd == "export", (cmd, p.stderr)
        (row,) = json.loads(runs["show"].stdout)["tasks"]
        # the NaN row skipped; show knows no sketch, so the off-option record stays its best
        assert row["trials"] == 2 and row["best_latency_s"] == 1e-3
        assert "transform.named_sequence" in runs["export"].stdout
        assert json.loads(runs["run"].stdout)["ok"]
        assert open(db_path, "rb").read() == before[1]
    finally:
        for d, _, _ in os.walk(top):
            os.chmod(d, 0o755)
        shutil.rmtree(top, ignore_errors=True)


def test_readonly_folder_opens_immutable_in_process(tuned_db, tmp_path, monkeypatch):
    """The fallback itself: where ``mode=ro`` cannot make the -shm file
    (simulated: SQLite answers SQLITE_READONLY_DIRECTORY, as it does to an
    unprivileged user), the database opens ``immutable=1``."""
    path, _, _ = tuned_db
    real = sqlite3.connect
    seen = []

    class Refusing(sqlite3.Connection):
        def execute(self, sql, *a):
            if not seen[-1].endswith("immutable=1"):
                exc = sqlite3.OperationalError("attempt to write a readonly database")
                exc.sqlite_errorname = "SQLITE_READONLY_DIRECTORY"
                raise exc
            return super().execute(sql, *a)

    def connect(database, **kw):
        seen.append(database)
        return real(database, factory=Refusing, **kw)

    monkeypatch.setattr(dbmod.sqlite3, "connect", connect)
    with Database(path, readonly=True) as db:
        assert db.immutable and len(db.records()) == 2
    assert any(u.endswith("mode=ro&immutable=1") for u in seen)
