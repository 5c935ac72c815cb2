"""Build and run functions that misbehave on purpose, for the Ray tests.

The first three distinct schedules built (whatever the search draws) get a
fault each, in this order: the compiler aborts, the compiler hangs, the
kernel computes a wrong answer; and the first other kernel run segfaults. The
assignment lives in files under ``$MLIR_ANSOR_TEST_FAULTS`` (shared by every
Ray worker on the machine), so a build submitted again after a lost worker
meets the same fault.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import time

from mlir_ansor.measure import jobs

FAULTS = ("abort", "hang", "wrong")


def script_key(script: str) -> str:
    return hashlib.sha256(script.encode()).hexdigest()[:16]


def assigned(root: str) -> dict[str, str]:
    """Schedule key -> fault, as assigned so far under `root`."""
    out = {}
    for k, fault in enumerate(FAULTS):
        try:
            with open(os.path.join(root, f"slot{k}")) as f:
                out[f.read().strip()] = fault
        except OSError:
            pass
    return out


def _fault_of(script: str) -> str | None:
    key = script_key(script)
    root = os.environ["MLIR_ANSOR_TEST_FAULTS"]
    for k, fault in enumerate(FAULTS):
        path = os.path.join(root, f"slot{k}")
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            for _ in range(100):  # its writer may not have written yet
                with open(path) as f:
                    owner = f.read().strip()
                if owner:
                    break
                time.sleep(0.01)
            if owner == key:
                return fault
            continue
        with os.fdopen(fd, "w") as f:
            f.write(key)
        return fault
    return None


def build(payload, script, threads, so_path, opt_level=3):
    fault = _fault_of(script)
    if fault == "abort":
        os.abort()  # what an MLIR assertion does to the process
    if fault == "hang":
        time.sleep(3600)  # a compiler that never returns
    if fault == "wrong":
        # The accumulator starts at 1 instead of 0.
        payload = payload.replace("arith.constant 0.000000e+00 : f32", "arith.constant 1.000000e+00 : f32")
    out = jobs.build_candidate(payload, script, threads, so_path, opt_level)
    if fault == "wrong":  # so that `run` leaves this library to its check
        with open(so_path, "rb") as f, open(os.path.join(os.environ["MLIR_ANSOR_TEST_FAULTS"], "wrong.sha"), "w") as g:
            g.write(hashlib.sha256(f.read()).hexdigest())
    return out


def _claim(path: str) -> bool:
    """True for the one caller that creates `path`."""
    try:
        os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        return True
    except FileExistsError:
        return False


def run(so_path, data_path, policy, tol, cutoff_s=float("inf")):
    root = os.environ["MLIR_ANSOR_TEST_FAULTS"]
    with open(so_path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    try:
        with open(os.path.join(root, "wrong.sha")) as f:
            wrong = f.read().strip()
    except OSError:
        wrong = ""
    # The wrong kernel is left to the check; the first other run segfaults.
    if digest != wrong and _claim(os.path.join(root, "segfaulted")):
        ctypes.string_at(0)  # reads address 0
    return jobs.run_candidate(so_path, data_path, policy, tol, cutoff_s)
