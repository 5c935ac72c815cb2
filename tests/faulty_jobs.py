"""Build and run functions that misbehave on purpose, for the tuner's tests.

Each wraps the real job and fails for candidates whose concrete schedule
selects a given register-tile value, so that one tuning run meets a crashing
compiler, a hanging compiler, a crashing kernel and a wrong answer. Which
values the search samples depends on timings (the cost model ranks by them),
so each fault also happens once for the first build that claims it (a flag
file beside the libraries): every run meets each fault at least once.
"""

from __future__ import annotations

import ctypes
import os
import time

from mlir_ansor.measure import jobs


def _selected(script: str, knob: str) -> int | None:
    for line in script.splitlines():
        if f'knob<"{knob}"> = ' in line:
            return int(line.split('"> = ')[1].split(" :")[0])
    return None


_FAULT_ROWS = {"abort": 2, "hang": 4, "wrong": 8}


def _claim(folder: str, fault: str) -> bool:
    """Whether this build is the first to claim `fault` (atomic across workers)."""
    try:
        os.close(os.open(os.path.join(folder, f"fault-{fault}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    return True


def build_that_aborts_or_hangs(payload, script, threads, so_path, opt_level=3):
    rows = _selected(script, "r_d0")
    if rows not in _FAULT_ROWS.values():
        folder = os.path.dirname(so_path)
        rows = next((r for fault, r in _FAULT_ROWS.items() if _claim(folder, fault)), rows)
    if rows == 2:
        os.abort()  # what an MLIR assertion does to the process
    if rows == 4:
        time.sleep(3600)  # a compiler that never returns
    if rows == 8:
        # A wrong kernel: the accumulator starts at 1 instead of 0.
        payload = payload.replace("arith.constant 0.000000e+00 : f32", "arith.constant 1.000000e+00 : f32")
        open(so_path + ".wrong", "w").close()  # so that its run is not the one that segfaults
    return jobs.build_candidate(payload, script, threads, so_path, opt_level)


def run_that_segfaults(so_path, data_path, policy, tol, cutoff_s=float("inf")):
    flag = os.path.join(os.path.dirname(so_path), "segfaulted-once")
    if not os.path.exists(flag) and not os.path.exists(so_path + ".wrong"):
        open(flag, "w").close()
        ctypes.string_at(0)  # the first kernel run reads address 0
    return jobs.run_candidate(so_path, data_path, policy, tol, cutoff_s)


def probe_that_aborts_on_batches(payload, script, assignments):
    """The feature extractor's probe job, aborting the worker whenever it is
    given more than one probe (as an MLIR assertion would)."""
    from mlir_ansor.search.features.extractor import _probe_worker

    if len(assignments) > 1:
        os.abort()
    return _probe_worker(payload, script, assignments)
