"""IREE as a peer, driven from our venv: `peers_iree.py` runs in IREE's own
(`.venv-iree`, `setup_peers.sh --iree`) and answers in JSON; this client
compiles and checks a workload once, then times it per call, so the
benchmarks can time IREE in turns with the other systems.

A workload is anything with ``name``, ``path`` (the MLIR file, Linalg on
tensors), ``arrays`` (the inputs) and ``reference`` (the expected outputs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Protocol

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_IREE_PYTHON = os.path.join(ROOT, ".venv-iree", "bin", "python")


class Peerable(Protocol):
    """What the client reads of a workload."""

    name: str
    path: str
    arrays: list[np.ndarray]
    reference: list[np.ndarray]


class Iree:
    """IREE in its own env: compile and check once per workload, time per call."""

    def __init__(self, python: str, wd: str, flag_sets: list[str], min_time: float) -> None:
        self.python, self.wd, self.flag_sets, self.min_time = python, wd, flag_sets, min_time
        self.version = ""
        self.flags: dict[str, list[str]] = {}  # flag set -> iree-compile flags
        self.compile_s: dict[str, dict[str, float]] = {}  # workload -> flag set -> compile time

    def _cmd(self, w: Peerable, threads: int, *extra: str) -> list[str]:
        return [self.python, os.path.join(ROOT, "benchmarks", "peers_iree.py"), "--mlir", w.path,
                "--inputs", os.path.join(self.wd, f"{w.name}.in.npz"), "--threads", str(threads),
                "--flags", ",".join(self.flag_sets), "--work-dir", os.path.join(self.wd, "iree"), *extra]

    def _call(self, cmd: list[str]) -> dict:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
            return {"error": f"peers_iree.py exited {proc.returncode}: {tail[-1][:300] if tail else ''}"}
        info = json.loads(proc.stdout.strip().splitlines()[-1])
        self.version = info.get("iree", self.version)
        return info

    def prepare(self, w: Peerable, threads: int) -> dict:
        """Compile with every flag set (once per workload: the .vmfb serves
        every thread count) and check the outputs at `threads`:
        {flag set: {compile_s, rel_err | error}}."""
        first = w.name not in self.compile_s
        if first:
            np.savez(os.path.join(self.wd, f"{w.name}.in.npz"), *[_bits(a) for a in w.arrays])
            np.savez(os.path.join(self.wd, f"{w.name}.ref.npz"), *w.reference)
        extra = ["--compile-only", "--reference", os.path.join(self.wd, f"{w.name}.ref.npz")]
        info = self._call(self._cmd(w, threads, *extra, *([] if first else ["--reuse-vmfb"])))
        if "error" in info:
            return {f: {"error": info["error"]} for f in self.flag_sets}
        times = self.compile_s.setdefault(w.name, {})
        for fs, r in info["results"].items():
            self.flags[fs] = r["flags"]
            if "compile_s" in r:
                times[fs] = r["compile_s"]
            elif fs in times:
                r["compile_s"] = times[fs]
        return info["results"]

    def time(self, w: Peerable, threads: int, flag_sets: list[str]) -> dict[str, float | str]:
        """One timing window of each flag set: latency (s) or an error."""
        cmd = self._cmd(w, threads, "--time-only", "--min-time", str(self.min_time))
        cmd[cmd.index("--flags") + 1] = ",".join(flag_sets)
        info = self._call(cmd)
        if "error" in info:
            return {f: info["error"] for f in flag_sets}
        return {f: r.get("latency_s", r.get("error", "no figure")) for f, r in info["results"].items()}

    def latencies(self, w: Peerable, threads: int) -> tuple[dict[str, float], dict[str, float]]:
        """Compile, check and time `w` once with every flag set:
        ({flag set: latency s}, {flag set: compile s}); a flag set that
        fails is left out and its error printed on stderr."""
        prepared = self.prepare(w, threads)
        compile_s = {}
        for fs, r in prepared.items():
            if "error" in r:
                print(f"{w.name}: IREE ({fs} flags): {r['error']}", file=sys.stderr)
            elif "compile_s" in r:
                compile_s[fs] = r["compile_s"]
        ok = [fs for fs, r in prepared.items() if "error" not in r]
        timed = self.time(w, threads, ok) if ok else {}
        return {fs: v for fs, v in timed.items() if isinstance(v, float)}, compile_s


def _bits(a: np.ndarray) -> np.ndarray:
    """bf16 as its uint16 bits (an .npz IREE's env can read without ml_dtypes)."""
    return a.view(np.uint16) if str(a.dtype) == "bfloat16" else a


def _bits(a: np.ndarray) -> np.ndarray:
    """bf16 as its uint16 bits (an .npz IREE's env can read without ml_dtypes)."""
    return a.view(np.uint16) if str(a.dtype) == "bfloat16" else a
