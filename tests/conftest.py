"""Shared test helpers: FileCheck, and paths of the small test inputs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

INPUTS = Path(__file__).parent / "inputs"


def _filecheck_exe() -> str:
    exe = Path(sys.executable).parent / "filecheck"
    if exe.exists():
        return str(exe)
    found = shutil.which("filecheck")
    if not found:
        pytest.skip("the `filecheck` package (dev extra) is not installed")
    return found


def filecheck(text: str, checks: str, tmp_path: Path) -> None:
    """Run FileCheck patterns `checks` (CHECK lines) over `text`; fail with
    FileCheck's own report when they do not match."""
    check_file = tmp_path / "checks.txt"
    check_file.write_text(checks)
    proc = subprocess.run([_filecheck_exe(), str(check_file)], input=text, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def mlir_opt() -> str:
    import mlir

    exe = Path(mlir.__path__[0]) / "bin" / "mlir-opt"
    if not exe.exists():
        pytest.skip("mlir-opt is not shipped with these MLIR wheels")
    return str(exe)
