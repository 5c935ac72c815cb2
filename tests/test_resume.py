"""A tuning run killed with SIGKILL at a random point, then resumed, loses no
record and measures no candidate twice."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import INPUTS

from mlir_ansor import TuneConfig, tune
from mlir_ansor.measure.runner import TimingPolicy
from mlir_ansor.records import Database

pytestmark = pytest.mark.slow  # tunes (200 trials, killed and resumed)


def _trials_logged(proc: subprocess.Popen, threshold: int, timeout_s: float) -> str:
    """Read the tuner's log until it reports `threshold` trials committed (a
    log line per batch, after its records are committed); the database itself
    is not touched while the writer runs. Returns the log read."""
    lines: list[str] = []
    done = threading.Event()

    def reader() -> None:
        for raw in proc.stderr:
            line = raw.decode(errors="replace")
            lines.append(line)
            m = re.search(r": (\d+) trials, best", line)
            if m and int(m.group(1)) >= threshold:
                done.set()
        done.set()

    threading.Thread(target=reader, daemon=True).start()
    done.wait(timeout_s)
    return "".join(lines)


def test_killed_run_resumes_without_loss_or_repeats(tmp_path):
    db = str(tmp_path / "kill.db")
    rng = random.Random()
    threshold = rng.randint(1, 6)  # trials committed before the kill
    exe = os.path.join(os.path.dirname(sys.executable), "mlir-ansor")
    cmd = [exe, "tune", str(INPUTS / "matmul.mlir"), "--trials", "200", "--batch-size", "2", "--db", db]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        log = _trials_logged(proc, threshold, 90)
        time.sleep(rng.uniform(0.0, 0.5))  # land anywhere: mid-build, mid-run, mid-commit
        assert proc.poll() is None, log[-2000:]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the driver and all its workers
        except ProcessLookupError:
            pass
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    with Database(db) as d:
        before = d.records()
    assert len(before) >= threshold

    cfg = TuneConfig(trials=4, batch_size=2, build_workers=2, timing=TimingPolicy(warmup=1, min_repeat=2, max_repeat=5, min_time_s=0.005))
    result = tune(str(INPUTS / "matmul.mlir"), config=cfg, db=db)
    assert result.measured == 4
    with Database(db) as d:
        after = d.records()
    key = lambda r: (r.sketch_hash, r.knobs)  # noqa: E731
    # every record of the killed run is kept, unchanged
    assert [r.to_json() for r in after[: len(before)]] == [r.to_json() for r in before]
    # (a run killed while re-timing its best leaves re-timings: not candidates)
    searched = [r for r in after if not r.retime]
    assert len(searched) == len([r for r in before if not r.retime]) + 4
    # and no candidate was measured twice: the search's records have one
    # key each, and the re-timings at the end time schedules already measured
    assert len({key(r) for r in searched}) == len(searched)
    retimes = [r for r in after[len(before) :] if r.retime]
    assert retimes and {key(r) for r in retimes} <= {key(r) for r in searched}
