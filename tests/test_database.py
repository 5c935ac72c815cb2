"""Tests of the tuning database (mlir_ansor.records.database)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap

import pytest

from mlir_ansor.errors import AnsorError, DatabaseError, InputError
from mlir_ansor.records import Database, JsonlWriter, Record, knobs_text

WK = "wk-matmul-64"
TGT = "cpu:znver3:avx2"


def rec(
    knobs,
    costs=(1e-3,),
    *,
    err="none",
    wk=WK,
    target=TGT,
    sketch="s1",
    threads=1,
    ts=1.0,
    **kw,
):
    return Record(
        wk,
        target,
        sketch,
        knobs,
        tuple(costs),
        err,
        threads=threads,
        timestamp=ts,
        **kw,
    )


def test_record_basics():
    r = rec({"tile_j": 8, "tile_i": 4, "vec": True}, costs=(3.0, 1.0, 2.0))
    assert r.knobs == (("tile_i", 4), ("tile_j", 8), ("vec", True))  # sorted pairs
    assert r.latency_s == 2.0
    assert rec({}, costs=(), err="crash").latency_s == math.inf
    hash(r)  # frozen and hashable


def test_round_trip(tmp_path):
    path = tmp_path / "t.db"
    r1 = Record(
        WK,
        TGT,
        "abc123",
        (("tile", 16), ("unroll", 4), ("name", "pack"), ("flag", False)),
        (1e-3, 2e-3, 1.5e-3),
        "none",
        host="AMD EPYC",
        threads=8,
        build_s=0.25,
        timestamp=1700000000.5,
        versions=json.dumps({"mlir_ansor": "0.1"}),
    )
    r2 = rec({"tile": 32}, costs=(), err="crash", error_msg="worker killed by SIGSEGV")
    with Database(path) as db:
        db.add_workload(WK, "matmul", "func.func @f() { return }", 2 * 64**3)
        db.add_workload(WK, "other name", "ignored", 1)  # idempotent: first wins
        db.commit_record(r1)
        db.commit_record(r2)
        db.commit_record(r2)  # exact duplicate stored once
    with Database(path) as db:
        assert db.workload(WK) == {
            "workload_key": WK,
            "name": "matmul",
            "task_mlir": "func.func @f() { return }",
            "flops": 2 * 64**3,
        }
        assert db.workload("nope") is None
        assert [w["workload_key"] for w in db.workloads()] == [WK]
        got = db.records()
        assert got == [r1, r2]
        k = dict(got[0].knobs)
        assert k["flag"] is False and type(k["tile"]) is int and k["name"] == "pack"
        assert db.records(WK, TGT) == [r1, r2]
        assert db.records(target="cuda:sm_90") == []
        assert db.count(WK) == 2


def test_best_ordering_and_error_filtering(tmp_path):
    with Database(tmp_path / "b.db") as db:
        db.commit_record(rec({"t": 1}, (5e-3,)))
        db.commit_record(rec({"t": 2}, (1e-3, 9.0, 1.1e-3)))  # median 1.1e-3
        db.commit_record(rec({"t": 3}, (), err="timeout"))
        db.commit_record(rec({"t": 4}, (1e-6,), err="wrong_answer"))  # fast but wrong
        db.commit_record(rec({"t": 5}, (2e-3,), threads=4))
        db.commit_record(rec({"t": 6}, (1e-9,), target="cpu:other"))
        db.commit_record(rec({"t": 7}, (1e-9,), wk="other"))
        best = db.best(WK, TGT, k=10)
        assert [dict(r.knobs)["t"] for r in best] == [2, 5, 1]
        assert db.best(WK, TGT)[0].knobs == (("t", 2),)
        assert [dict(r.knobs)["t"] for r in db.best(WK, TGT, threads=4, k=5)] == [5]
        assert db.best(WK, "cuda:sm_90") == []


def test_best_times_a_schedule_by_all_its_timings(tmp_path):
    """A schedule timed again (the re-timing at the end of a run) is one
    schedule whose latency is the median of all its timings: a lucky first
    timing no longer wins on its own. One failed run disqualifies it."""
    with Database(tmp_path / "r.db") as db:
        db.commit_record(rec({"t": 1}, (1.0e-3,), ts=1.0))  # lucky first timing
        db.commit_record(rec({"t": 2}, (1.2e-3,), ts=2.0))
        db.commit_record(rec({"t": 3}, (1.1e-3,), ts=3.0))
        db.commit_record(rec({"t": 2}, (1.3e-3, 1.3e-3), ts=4.0))  # re-timed: 1.3 ms
        db.commit_record(rec({"t": 1}, (1.5e-3, 1.6e-3), ts=5.0))  # re-timed: slower
        db.commit_record(rec({"t": 1}, (1.5e-3,), ts=6.0))
        db.commit_record(rec({"t": 3}, (), err="wrong_answer", ts=7.0))  # one failed run: out
        db.commit_record(rec({"t": 4}, (1.4e-3,), ts=8.0))
        db.commit_record(rec({"t": 4}, (), err="not_measured", ts=9.0))  # built only: not a failure
        best = db.best(WK, TGT, k=10)
        assert [dict(r.knobs)["t"] for r in best] == [2, 4, 1]
        one = best[2]
        assert one.costs == (1.0e-3, 1.5e-3, 1.6e-3, 1.5e-3) and one.latency_s == pytest.approx(1.5e-3)
        assert one.timestamp == 1.0  # the schedule's first record, carrying every timing
        assert best[0].latency_s == pytest.approx(1.3e-3)


def test_best_ranks_retimed_schedules_by_their_turns(tmp_path):
    """Re-timed schedules rank by the sets they were timed in turns in, not
    by their pooled timings: the second set, timed in a slow phase of the
    machine, holds the incumbent (A) and B; the third, in a fast phase, C
    and the earlier set's runner-up D, not A. Pooled, A (timed in the slow
    set too) fell behind D; in turns, A beat D by 10%, B beat A by 5%, C
    lost to D. Schedules never re-timed keep their own timing."""

    def retimed(knobs, costs, run, attempt, ts):
        versions = json.dumps({"run": run, "retime": 0, "retime_attempt": attempt})
        return rec(knobs, costs, ts=ts, versions=versions)

    with Database(tmp_path / "t.db") as db:
        for t, ts in ((1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0)):
            db.commit_record(rec({"t": t}, (1.0e-3,), ts=ts))  # the search's one timing each
        db.commit_record(rec({"t": 5}, (1.25e-3,), ts=5.0))  # never re-timed
        db.commit_record(retimed({"t": 1}, (1.0e-3, 1.0e-3), 7, 0, 6.0))  # A
        db.commit_record(retimed({"t": 4}, (1.1e-3, 1.1e-3), 7, 0, 6.1))  # D
        db.commit_record(retimed({"t": 1}, (2.0e-3, 2.0e-3, 2.0e-3), 7, 1, 7.0))  # A, slow phase
        db.commit_record(retimed({"t": 2}, (1.9e-3, 1.9e-3), 7, 1, 7.1))  # B
        db.commit_record(retimed({"t": 4}, (0.8e-3, 0.8e-3), 7, 2, 8.0))  # D, fast phase
        db.commit_record(retimed({"t": 3}, (0.9e-3, 0.9e-3), 7, 2, 8.1))  # C
        best = db.best(WK, TGT, k=10)
        assert [dict(r.knobs)["t"] for r in best] == [2, 1, 4, 3, 5]
        # latencies stay the medians of every timing of the schedule
        assert best[1].latency_s == pytest.approx(1.5e-3) and best[2].latency_s == pytest.approx(1.0e-3)
        # a re-timing that names no set (an earlier tuner) is of its run's one set: pooled there
        db.commit_record(rec({"t": 6}, (0.5e-3,), ts=9.0, versions=json.dumps({"run": 8, "retime": 0})))
        assert dict(db.best(WK, TGT)[0].knobs)["t"] == 6


def test_measured_keys(tmp_path):
    with Database(tmp_path / "m.db") as db:
        db.commit_record(rec({"b": 2, "a": 1}, sketch="s1"))
        db.commit_record(rec({"a": 9}, (), err="crash", sketch="s2"))
        db.commit_record(rec({"a": 9}, sketch="s2", ts=2.0))  # measured twice: one key
        db.commit_record(rec({"a": 1}, target="cpu:other"))
        keys = db.measured_keys(WK, TGT)
        assert keys == {("s1", (("a", 1), ("b", 2))), ("s2", (("a", 9),))}
        # the key of a fresh Record built from a dict matches
        assert ("s1", rec({"a": 1, "b": 2}).knobs) in keys


def test_export_import_round_trip(tmp_path):
    src = tmp_path / "src.db"
    with Database(src) as db:
        db.add_workload(WK, "matmul", "module {}", 123)
        recs = [
            rec(
                {"t": i, "v": bool(i % 2), "s": f"x{i}"},
                (i * 1e-3 + 1e-3,),
                ts=float(i),
            )
            for i in range(5)
        ]
        recs.append(rec({"t": 99}, (), err="crash", error_msg="boom\nline 2"))
        for r in recs:
            db.commit_record(r)
        assert db.export_jsonl(tmp_path / "out.jsonl") == 6
    with Database(tmp_path / "dst.db") as dst:
        assert dst.import_jsonl(tmp_path / "out.jsonl") == 6
        assert dst.records() == recs
        assert dst.workload(WK)["flops"] == 123
        assert dst.import_jsonl(tmp_path / "out.jsonl") == 0  # duplicates skipped
        assert dst.count() == 6
        assert dst.best(WK, TGT)[0] == recs[0]


def test_jsonl_carries_runs_and_renumbers_them(tmp_path):
    """A run's seed, versions and host travel with its records; importing
    into a database that has runs of its own gives the run a new id, and
    the records follow it."""
    src, dst = tmp_path / "src.db", tmp_path / "dst.db"
    with Database(src) as db:
        run = db.add_run(7, TGT, {"host": "cpu A", "mlir": "22.1.8"}, started=100.0)
        r = rec({"t": 1}, (1e-3,), ts=1.0)
        db.commit_record(dataclasses.replace(r, versions=json.dumps({"seed": 7, "run": run})))
        db.export_jsonl(tmp_path / "out.jsonl")
    with Database(dst) as db:
        db.add_run(1, TGT, {"host": "other"}, started=5.0)
        db.add_run(2, TGT, {"host": "other"}, started=6.0)
        assert db.import_jsonl(tmp_path / "out.jsonl") == 1
        runs = db.runs()
        assert [(x["seed"], x.get("host")) for x in runs] == [(1, "other"), (2, "other"), (7, "cpu A")]
        (got,) = db.records()
        assert json.loads(got.versions) == {"seed": 7, "run": runs[2]["id"]}
        # Importing the same file again adds neither a run nor a record.
        assert db.import_jsonl(tmp_path / "out.jsonl") == 0
        assert len(db.runs()) == 3


def test_jsonl_writer_appends_what_import_reads(tmp_path):
    """`JsonlWriter` writes runs and records as `export_jsonl` does, each
    line on its own: its runs are numbered after the reserved ids and its
    own, it reads back what it holds, and importing the file gives the
    records with their run renumbered into the database."""
    out = tmp_path / "gpu.jsonl"
    w = JsonlWriter(out, reserved_run_ids=[1, 4])
    assert w.records() == [] and w.run_ids() == []
    run = w.add_run(7, TGT, {"b": 1, "a": {"y": 2, "x": 1}}, 100.0)
    assert run == 5
    r = rec({"t": 1, "v": True}, (2e-3, 1e-3), ts=3.0, host="GPU", versions=json.dumps({"run": run}))
    w.commit_record(r)
    w.commit_record(rec({"t": 2}, (), err="wrong_answer", ts=4.0, error_msg="relative error 1"))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0] == {"kind": "run", "id": 5, "started": 100.0, "seed": 7, "target": TGT,
                        "info": {"a": {"x": 1, "y": 2}, "b": 1}}
    assert lines[1] == {"kind": "record", **r.to_json()}
    again = JsonlWriter(out, reserved_run_ids=[1])
    assert again.run_ids() == [5] and again.records()[0] == r and len(again.records()) == 2
    assert again.add_run(8, TGT, {}, 101.0) == 6
    with Database(tmp_path / "dst.db") as db:
        db.add_run(1, TGT, {}, started=1.0)
        assert db.import_jsonl(out) == 2
        got = db.records()
        assert [dataclasses.replace(x, versions="") for x in got] == [
            dataclasses.replace(x, versions="") for x in again.records()
        ]
        assert json.loads(got[0].versions) == {"run": db.runs()[1]["id"]}
    out.write_text(out.read_text() + "{not json\n")
    with pytest.raises(InputError, match=r"gpu\.jsonl:5"):
        JsonlWriter(out).records()


def test_knobs_text_is_canonical():
    assert knobs_text({"b": 2, "a": True}) == knobs_text([("a", True), ("b", 2)]) == '[["a",true],["b",2]]'


def test_readonly_and_existing_only(tmp_path):
    """``readonly=True`` reads an existing database and writes nothing;
    ``create=False`` opens only an existing one. Neither makes a file."""
    path = tmp_path / "r.db"
    with Database(path) as db:
        db.add_run(3, TGT, {"config": {"trials": 2}}, started=1.0)
        for i in range(3):
            db.commit_record(rec({"t": i}, ts=float(i)))
    before = path.read_bytes()
    with Database(path, readonly=True) as db:
        numbered = db.records_with_ids()
        assert [r for _, r in numbered] == db.records() and len(numbered) == 3
        assert [i for i, _ in numbered] == sorted(i for i, _ in numbered)
        assert db.runs()[0]["config"] == {"trials": 2}
        with pytest.raises(DatabaseError, match="commit_record"):
            db.commit_record(rec({"t": 9}, ts=9.0))
        with pytest.raises(DatabaseError):
            db.add_run(1, TGT, {}, started=2.0)
    assert path.read_bytes() == before
    with Database(path, create=False) as db:
        assert db.count() == 3
    for kw in ({"readonly": True}, {"create": False}):
        with pytest.raises(DatabaseError, match="no such tuning database"):
            Database(tmp_path / "missing.db", **kw)
        assert not (tmp_path / "missing.db").exists()
        (tmp_path / "empty.db").write_bytes(b"")
        with pytest.raises(DatabaseError, match="empty"):
            Database(tmp_path / "empty.db", **kw)


def test_import_bad_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    good = json.dumps(rec({"t": 1}).to_json())
    bad.write_text(good + "\n{not json\n")
    with Database(tmp_path / "x.db") as db:
        with pytest.raises(InputError, match=r"bad\.jsonl:2"):
            db.import_jsonl(bad)
        assert db.count() == 0  # nothing half-imported


def _snapshot(path):
    st = os.stat(path)
    return path.read_bytes(), st.st_mtime_ns, st.st_size


def test_foreign_sqlite_refused_and_unchanged(tmp_path):
    path = tmp_path / "foreign.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE people (name TEXT)")
    con.execute("INSERT INTO people VALUES ('ada')")
    con.commit()
    con.close()
    before = _snapshot(path)
    with pytest.raises(DatabaseError, match="not an mlir-ansor tuning database") as ei:
        Database(path)
    assert str(path) in str(ei.value)
    assert isinstance(ei.value, AnsorError)
    assert _snapshot(path) == before
    assert sorted(os.listdir(tmp_path)) == ["foreign.db"]  # no -wal/-shm left behind


def test_foreign_meta_refused(tmp_path):
    path = tmp_path / "meta.db"
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE meta (key TEXT, value TEXT)")
    con.execute("INSERT INTO meta VALUES ('format', 'something-else')")
    con.commit()
    con.close()
    before = _snapshot(path)
    with pytest.raises(DatabaseError, match="something-else"):
        Database(path)
    assert _snapshot(path) == before


@pytest.mark.parametrize(
    "content",
    [
        os.urandom(4096),
        b"workload,latency\nmatmul,1e-3\n",
        b"SQLite format 3\x00" + b"\xff" * 200,
    ],
    ids=["random", "text", "corrupt-header"],
)
def test_garbage_refused_and_unchanged(tmp_path, content):
    path = tmp_path / "junk.db"
    path.write_bytes(content)
    before = _snapshot(path)
    with pytest.raises(DatabaseError, match="junk.db"):
        Database(path)
    assert _snapshot(path) == before


def test_corrupt_pages_refused(tmp_path):
    path = tmp_path / "c.db"
    with Database(path) as db:
        for i in range(200):
            db.commit_record(rec({"t": i}, ts=float(i), error_msg="x" * 200))
    # checkpointed on close; smash everything after the first page
    data = bytearray(path.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    data[page:] = os.urandom(len(data) - page)
    path.write_bytes(bytes(data))
    with pytest.raises(DatabaseError):
        db = Database(path)
        db.records()  # corruption may only show when the pages are read
        db.close()


def test_newer_schema_refused(tmp_path):
    path = tmp_path / "v.db"
    Database(path).close()
    con = sqlite3.connect(path)
    con.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    con.commit()
    con.close()
    with pytest.raises(DatabaseError, match="version"):
        Database(path)


def test_empty_file_and_reopen(tmp_path):
    path = tmp_path / "empty.db"
    path.write_bytes(b"")
    with Database(path) as db:
        db.commit_record(rec({"t": 1}))
    with Database(path) as db:
        assert len(db.records()) == 1


def test_closed_database_errors(tmp_path):
    db = Database(tmp_path / "z.db")
    db.close()
    db.close()
    with pytest.raises(DatabaseError, match="closed"):
        db.records()


def test_record_survives_sigkill(tmp_path):
    path = tmp_path / "kill.db"
    child = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path[:0] = {sys.path!r}
        from mlir_ansor.records import Database, Record
        db = Database({str(path)!r})
        db.add_workload("wk", "matmul", "module {{}}", 10)
        db.commit_record(Record("wk", "cpu", "s", (("t", 4),), (0.5,), "none"))
        print("committed", flush=True)
        time.sleep(60)
        """
    )
    p = subprocess.Popen(
        [sys.executable, "-c", child], stdout=subprocess.PIPE, text=True
    )
    try:
        assert p.stdout.readline().strip() == "committed"
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == -signal.SIGKILL
    with Database(path) as db:
        assert db.workload("wk")["flops"] == 10
        (r,) = db.records()
        assert r.knobs == (("t", 4),) and r.latency_s == 0.5
