"""Bad input gets a one-line error that names the problem, exit status 2, and
never a traceback (issue #22, items 2, 3 and 7, and the inputs around them).

In-process through `cli.main` where it can be; as a subprocess where the
test needs stdin bytes, a signal or a closed pipe."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import as_unprivileged

from mlir_ansor.tools.cli import main

MM64 = """func.func @mm(%a: tensor<64x64xf32>, %b: tensor<64x64xf32>, %c: tensor<64x64xf32>) -> tensor<64x64xf32> {
  %r = linalg.matmul ins(%a, %b : tensor<64x64xf32>, tensor<64x64xf32>) outs(%c : tensor<64x64xf32>) -> tensor<64x64xf32>
  return %r : tensor<64x64xf32>
}
"""
ZERO = MM64.replace("64x64", "0x16")
GENERIC_CALL = """#map = affine_map<(d0) -> (d0)>
func.func private @g(f32) -> f32
func.func @f(%a: tensor<16xf32>, %o: tensor<16xf32>) -> tensor<16xf32> {
  %r = linalg.generic {indexing_maps = [#map, #map], iterator_types = ["parallel"]}
      ins(%a : tensor<16xf32>) outs(%o : tensor<16xf32>) {
  ^bb0(%x: f32, %y: f32):
    %e = func.call @g(%x) : (f32) -> f32
    linalg.yield %e : f32
  } -> tensor<16xf32>
  return %r : tensor<16xf32>
}
"""
CLI = [sys.executable, "-m", "mlir_ansor.tools.cli"]


def _error(capsys) -> str:
    """The one error line on stderr (log lines aside); no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("mlir-ansor")]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def mm64(tmp_path: Path) -> Path:
    p = tmp_path / "mm64.mlir"
    p.write_text(MM64)
    return p


@pytest.fixture(scope="module")
def tuned_db(tmp_path_factory) -> Path:
    """A database with two measured candidates of the 64^3 matmul."""
    d = tmp_path_factory.mktemp("db")
    (d / "mm64.mlir").write_text(MM64)
    db = d / "good.db"
    assert main(["tune", str(d / "mm64.mlir"), "--trials", "2", "--threads", "1", "--db", str(db),
                 "--progress", "none", "--retime-rounds", "0", "--json"]) == 0
    return db


# -- item 2: no candidate for the threads; threads beyond the cores; no NaN


@pytest.mark.slow
def test_no_candidate_for_threads_says_why_and_never_nan(mm64, tmp_path, capsys, caplog):
    db = tmp_path / "t.db"
    args = ["tune", str(mm64), "--trials", "4", "--threads", "33", "--db", str(db), "--progress", "none"]
    assert main(args) == 0
    out = capsys.readouterr().out
    log = caplog.text
    assert "no valid candidate to measure: no candidate keeps 33 threads busy" in log
    assert "--threads 33 is more than the" in log and "core(s) this process may use" in log
    assert "nan" not in out.lower()
    row = next(ln for ln in out.splitlines() if ln.startswith("matmul_64x64x64_f32"))
    assert row.split()[-3:] == ["-", "-", "-"]  # tuned, GFLOP/s, speedup
    assert main([*args, "--json"]) == 0
    out = capsys.readouterr().out
    assert "NaN" not in out
    task = json.loads(out)["tasks"][0]
    assert task["trials"] == 0 and task["best_latency_s"] is None and task["speedup_over_baseline"] is None
    assert main(["show", str(db), "--json"]) == 0
    assert "NaN" not in capsys.readouterr().out
    assert main(["show", str(db)]) == 0
    assert "nan" not in capsys.readouterr().out.lower()


# -- item 3: tracebacks that reached the user


@pytest.mark.parametrize("command", ["tune", "compile", "run"])
def test_zero_sized_dimension(tmp_path, capsys, command):
    src = tmp_path / "zero.mlir"
    src.write_text(ZERO)
    db = tmp_path / "z.db"
    extra = ["--trials", "1"] if command == "tune" else []
    assert main([command, str(src), "--db", str(db), *extra]) == 2
    line = _error(capsys)
    assert f"{src}:2:8: linalg.matmul: zero-sized dimension in tensor<0x16xf32>" in line
    assert not db.exists()  # a failed tune leaves no database behind


@pytest.mark.parametrize("command", [["tune", "-", "--trials", "1"], ["compile", "-"]])
@pytest.mark.parametrize("data,why", [(b"\xff\xfe\x00\x01binary", "is not UTF-8"), (b"func.func\x00", "NUL byte")])
def test_binary_stdin(tmp_path, command, data, why):
    extra = ["--db", str(tmp_path / "s.db")] if command[0] == "tune" else []
    proc = subprocess.run([*CLI, *command, *extra], input=data, capture_output=True, cwd=tmp_path, timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert "Traceback" not in err
    assert err.startswith("mlir-ansor: error: <stdin>: not MLIR text (") and why in err, err
    assert not (tmp_path / "s.db").exists()


def test_compile_output_paths(mm64, tmp_path, capsys):
    (tmp_path / "adir.mlir").mkdir()
    cases = {
        str(tmp_path / "adir.mlir"): "is a directory; give a file name",
        str(tmp_path / "nodir" / "x.mlir"): "does not exist",
        str(mm64 / "x.so"): "is a file, not a folder",
        str(tmp_path / "x.txt"): "expected a file name ending in .mlir or .so",
    }
    for out, msg in cases.items():
        assert main(["compile", str(mm64), "--untuned", "-o", out]) == 2, out
        line = _error(capsys)
        assert line.startswith(f"mlir-ansor: error: -o {out}: ") and msg in line, line


def test_compile_output_not_writable(mm64):
    """As an unprivileged user (root writes anywhere: the command then runs
    as `nobody` through setpriv), `compile -o` into a folder it cannot write
    is refused before anything is built."""
    import shutil
    import subprocess
    import sys
    import tempfile

    top = tempfile.mkdtemp(prefix="mlir-ansor-ro-")
    try:
        os.chmod(top, 0o755)
        src = os.path.join(top, "mm64.mlir")
        shutil.copy(mm64, src)
        os.chmod(src, 0o644)
        ro = os.path.join(top, "ro")
        os.mkdir(ro, 0o555)
        os.chmod(ro, 0o555)
        cmd = [sys.executable, "-m", "mlir_ansor.tools.cli", "compile", src, "--untuned", "-o", os.path.join(ro, "x.mlir")]
        cmd = as_unprivileged(cmd)
        env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
               "HOME": top}
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=top, env=env, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert "cannot write (permission denied)" in proc.stderr.strip().splitlines()[-1], proc.stderr
        assert os.listdir(ro) == []
    finally:
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.slow
def test_export_and_dataset_output_paths(tuned_db, tmp_path, capsys):
    d = tmp_path / "d"
    d.mkdir()
    assert main(["export", str(tuned_db), "-o", str(d)]) == 2
    assert f"-o {d}: is a directory" in _error(capsys)
    assert main(["export", str(tuned_db), "--payload", str(tmp_path / "no" / "p.mlir")]) == 2
    assert "--payload" in _error(capsys)
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["export-dataset", str(tuned_db), "-o", str(afile)]) == 2
    assert "is a file, not a folder" in _error(capsys)
    assert main(["train-model", str(d), "-o", str(d)]) == 2
    assert f"-o {d}: is a directory" in _error(capsys)


@pytest.mark.slow
def test_show_into_closed_pipe(tuned_db):
    proc = subprocess.run(f"{sys.executable} -m mlir_ansor.tools.cli show {tuned_db} | head -c 10",
                          shell=True, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert "Traceback" not in proc.stderr, proc.stderr
    # head may read it all before it exits; when it did not, the one-line message
    assert proc.stderr.strip() in ("", "mlir-ansor: error: the output was closed before it was all written "
                                   "(broken pipe)")
    code = ("import sys, os\nr, w = os.pipe()\nos.close(r)\nos.dup2(w, 1)\n"
            "from mlir_ansor.tools.cli import main\nsys.exit(main(['show', sys.argv[1]]))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tuned_db)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "mlir-ansor: error: the output was closed before it was all written (broken pipe)" in proc.stderr


@pytest.mark.slow
def test_record_with_knob_out_of_range(tuned_db, tmp_path, capsys, caplog):
    db = tmp_path / "bad.db"
    with sqlite3.connect(tuned_db) as src, sqlite3.connect(db) as dst:
        src.backup(dst)
    with sqlite3.connect(db) as con:
        (rid, knobs), *_ = con.execute("SELECT id, knobs FROM records").fetchall()
        bad = [[k, 63 if i == 0 else v] for i, (k, v) in enumerate(json.loads(knobs))]
        con.execute("UPDATE records SET knobs = ?, costs = '[1e-09]', latency_s = 1e-09 WHERE id = ?",
                    (json.dumps(bad), rid))
    src = tmp_path / "mm64.mlir"
    src.write_text(MM64)
    for args in (["compile", str(src)], ["export", str(db)], ["run", str(src), "--repeat", "1"]):
        caplog.clear()
        rc = main([*args, "--db", str(db)] if args[0] != "export" else args)
        err = capsys.readouterr().err
        assert "Traceback" not in err
        # the record is skipped (named, with the reason), and the rest still applies
        assert rc == 0, err
        assert "is invalid and is skipped" in caplog.text and "is 63, not one of the options" in caplog.text


# -- item 7: smaller ones


@pytest.mark.slow
def test_sigterm_stops_tune_and_cleans_up(mm64, tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([*CLI, "tune", str(mm64), "--trials", "400", "--db", str(tmp_path / "t.db"),
                             "--progress", "log", "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "TMPDIR": str(tmp)}, text=True)
    deadline = time.monotonic() + 120
    while not any(tmp.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    assert "mlir-ansor: terminated by SIGTERM (measured records are kept in the database)" in err
    assert list(tmp.iterdir()) == []


@pytest.mark.slow
def test_plot_into_a_folder(tuned_db, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    d = tmp_path / "plots"
    d.mkdir()
    assert main(["plot", str(tuned_db), "-o", str(d)]) == 0
    assert (d / "curve.png").is_file()
    assert f"wrote {d / 'curve.png'}" in capsys.readouterr().err
    assert main(["plot", str(tuned_db), "-o", str(tmp_path / "nope") + os.sep]) == 2
    assert "no such folder" in _error(capsys)
    assert main(["plot", str(tuned_db), "-o", str(tmp_path / "x.txt")]) == 2
    assert "expected an image file name" in _error(capsys)


def test_export_dataset_leaves_nothing_for_a_bad_database(tmp_path, capsys):
    bad = tmp_path / "bad.db"
    bad.write_text("not a database")
    out = tmp_path / "ds"
    assert main(["export-dataset", str(bad), "-o", str(out)]) == 2
    assert "not an mlir-ansor tuning database" in _error(capsys)
    assert not out.exists()
    out.mkdir()
    (out / "manifest.json").write_text('{"keep": 1}')
    assert main(["export-dataset", str(bad), "-o", str(out)]) == 2
    capsys.readouterr()
    assert (out / "manifest.json").read_text() == '{"keep": 1}'


def test_unsupported_op_in_generic_body_at_its_line(tmp_path, capsys):
    src = tmp_path / "call.mlir"
    src.write_text(GENERIC_CALL)
    assert main(["compile", str(src)]) == 2
    line = _error(capsys)
    assert line.startswith(f"mlir-ansor: error: {src}:7:10: func.call is not supported inside the body of "
                           f"linalg.generic ({src}:4:8)"), line


# -- beyond: other inputs a user or an attacker sends


def test_other_bad_inputs(mm64, tmp_path, capsys):
    empty = tmp_path / "empty.mlir"
    empty.write_text("")
    d = tmp_path / "d"
    d.mkdir()
    db = tmp_path / "x.db"
    cases = [
        (["compile", str(empty)], "no Linalg operation to tune"),
        (["tune", str(d), "--trials", "1", "--db", str(db)], "is a directory, not an MLIR file"),
        (["tune", str(mm64), "--func", "nope", "--trials", "1", "--db", str(db)], "no function @nope"),
        (["tune", str(mm64), "--target", "foo", "--trials", "1", "--db", str(db)], "unknown target 'foo'"),
        (["run", str(mm64), "--func", "nope"], "no function @nope"),
        (["show", str(d)], "is a directory, not a tuning database"),
        (["show", str(empty)], "an empty file, not a tuning database"),
        (["opt", str(mm64), "--pass-pipeline=builtin.module(cse)", "-o", str(d)], "is a directory"),
        (["peak", "--cache", str(d)], "--cache"),
        (["tune", str(mm64), "--trials", "1", "--db", str(d)], "is a directory"),
        (["tune", str(mm64), "--trials", "1", "--executor", "bogus", "--db", str(db)], "unknown executor"),
    ]
    for args, msg in cases:
        assert main(args) == 2, args
        line = _error(capsys)
        assert line.startswith("mlir-ansor: error: ") and msg in line, (args, line)
    assert not db.exists()
    for args, msg in [
        (["tune", str(mm64), "--trials", "0"], "argument --trials: expected a positive number, got '0'"),
        (["tune", str(mm64), "--trials", "-1"], "argument --trials: expected a positive number, got '-1'"),
        (["tune", str(mm64), "--seed", "-1"], "argument --seed: expected a non-negative number, got '-1'"),
        (["run", str(mm64), "--seed", "-3"], "argument --seed: expected a non-negative number, got '-3'"),
    ]:
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2
        assert msg in capsys.readouterr().err
