"""The README's Python examples run as written (with small trial budgets)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.slow
def test_readme_python_examples_run(tmp_path, monkeypatch, capsys):
    blocks = python_blocks()
    assert len(blocks) >= 4
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__readme__"}
    for i, block in enumerate(blocks):
        code = re.sub(r"trials=\d+", "trials=2", block)
        exec(compile(code, f"README.md python block {i + 1}", "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out
    assert "matmul_128x256x64_f32" in out
    assert (tmp_path / "tuning.db").exists()
    assert "transform.tune.knob" in (tmp_path / "schedule.mlir").read_text()
    assert "ansor.op = 1" in (tmp_path / "payload.mlir").read_text()


def test_readme_pipeline_error_example_is_exact(tmp_path, capsys):
    """The error shown in the README is what the command prints."""
    from mlir_ansor.tools.cli import main

    text = README.read_text()
    m = re.search(r"\$ mlir-ansor opt m\.mlir --pass-pipeline='([^']*)'\n(.*?)```", text, flags=re.S)
    assert m
    src = tmp_path / "m.mlir"
    src.write_text((Path(__file__).parent / "inputs" / "matmul.mlir").read_text())
    assert main(["opt", str(src), "--pass-pipeline", m.group(1)]) == 2
    assert capsys.readouterr().err == m.group(2)
