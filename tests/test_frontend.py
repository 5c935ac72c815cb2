"""Tests of mlir_ansor.ir.program: loading, diagnostics with locations."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from mlir import ir

from mlir_ansor.errors import AnsorError, InputError
from mlir_ansor.ir.program import Program, load, location_str

INPUTS = Path(__file__).parent / "inputs"

SMALL = """func.func @f(%a: tensor<4xf32>, %b: tensor<4xf32>) -> tensor<4xf32> {
  %r = linalg.add ins(%a, %b : tensor<4xf32>, tensor<4xf32>) outs(%a : tensor<4xf32>) -> tensor<4xf32>
  return %r : tensor<4xf32>
}
"""


def _first_linalg(program: Program) -> ir.Operation:
    fn = program.module.body.operations[0]
    return next(
        o.operation
        for o in fn.regions[0].blocks[0].operations
        if o.name.startswith("linalg.")
    )


def test_load_file_keeps_user_path_in_locations():
    path = str(INPUTS / "matmul.mlir")
    program = load(path)
    assert program.source == path
    assert program.module.context is program.context
    op = _first_linalg(program)
    assert op.name == "linalg.fill"
    assert location_str(op) == f"{path}:4:8"


def test_load_pathlike():
    program = load(INPUTS / "matmul.mlir")
    assert program.source.endswith("matmul.mlir")


def test_load_text_names_string():
    program = load(text=SMALL)
    assert program.source == "<string>"
    assert location_str(_first_linalg(program)) == "<string>:2:8"


def test_load_stdin(monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(SMALL))
    program = load("-")
    assert program.source == "<stdin>"
    assert location_str(_first_linalg(program)) == "<stdin>:2:8"


def test_load_foreign_module_reparsed_into_own_context():
    caller_ctx = ir.Context()
    theirs = ir.Module.parseFile(str(INPUTS / "matmul.mlir"), caller_ctx)
    program = load(theirs)
    assert program.source == "<ir.Module>"
    assert program.context is not caller_ctx
    assert program.module.context is program.context
    # Locations of the caller's module survive the round trip.
    assert location_str(_first_linalg(program)).endswith("matmul.mlir:4:8")
    # The caller's module is untouched and still usable.
    assert "linalg.matmul" in str(theirs)


def test_malformed_reports_file_line_col():
    path = str(INPUTS / "malformed.mlir")
    with pytest.raises(InputError) as err:
        load(path)
    assert f"{path}:3:94: expected ')'" in str(err.value)


def test_malformed_text_reports_line():
    with pytest.raises(InputError, match=r"<string>:2:3: custom op 'retur' is unknown"):
        load(text="func.func @f() {\n  retur\n}")


def test_verifier_failure_is_input_error_with_location():
    path = str(INPUTS / "invalid.mlir")
    with pytest.raises(InputError) as err:
        load(path)
    msg = str(err.value)
    assert f"{path}:2:8:" in msg
    assert "linalg.matmul" in msg


def test_verifier_failure_in_text():
    with pytest.raises(
        InputError, match=r"<string>:2:3: 'func.return' op has 0 operands"
    ):
        load(text="func.func @f() -> f32 {\n  return\n}")


def test_missing_file():
    with pytest.raises(InputError, match=r"does-not-exist\.mlir: no such file"):
        load("/tmp/does-not-exist.mlir")


def test_text_given_as_a_path_says_so_in_a_line():
    text = "func.func @f(%a: tensor<4xf32>) -> tensor<4xf32> {\n  return %a : tensor<4xf32>\n}\n" + "// weights\n" * 5000
    with pytest.raises(InputError, match=r"the path given is MLIR text \('func.func @f.*load\(text=\.\.\.\)") as err:
        load(text[:-1])
    assert len(str(err.value)) < 250


def test_directory_is_input_error(tmp_path):
    with pytest.raises(InputError, match="is a directory"):
        load(tmp_path)


def test_errors_are_ansor_errors():
    assert issubclass(InputError, AnsorError)
    with pytest.raises(AnsorError):
        load(text="this is not mlir")


def test_location_str_unknown():
    ctx = ir.Context()
    with ctx, ir.Location.unknown():
        module = ir.Module.create()
        assert location_str(module.operation) == "<unknown>"


def test_bad_arguments():
    with pytest.raises(TypeError):
        load()
    with pytest.raises(TypeError):
        load("x.mlir", text=SMALL)
