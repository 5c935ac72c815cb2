"""`mlir-ansor opt` pass pipelines: parsing, error carets, mixed steps."""

from __future__ import annotations

import io

import numpy as np
import pytest
from conftest import INPUTS
from mlir import ir

from mlir_ansor.tools.cli import main
from mlir_ansor.tools.pipeline import PipelineError, parse_pipeline, run_pipeline

MATMUL = str(INPUTS / "matmul.mlir")


def test_parse_nesting_and_options():
    els = parse_pipeline("builtin.module(canonicalize, ansor-apply-best{db=a.db threads=2},func.func(cse,canonicalize{max-iterations=3}))")
    assert [e.name for e in els] == ["canonicalize", "ansor-apply-best", "func.func"]
    assert els[1].options == "db=a.db threads=2" and els[1].is_ours
    assert [c.text for c in els[2].children] == ["cse", "canonicalize{max-iterations=3}"]
    assert els[2].text == "func.func(cse,canonicalize{max-iterations=3})"
    # a bare list is module-level
    assert [e.name for e in parse_pipeline("cse,canonicalize")] == ["cse", "canonicalize"]


def _caret(pipeline: str) -> tuple[str, str]:
    """(reason, the text the caret underlines)."""
    with ir.Context():
        module = ir.Module.parse("module {}")
        with pytest.raises(PipelineError) as info:
            run_pipeline(module, pipeline)
    e = info.value
    lines = str(e).splitlines()
    # the caret line lines up with the pipeline line
    assert lines[-2] == "  " + pipeline and lines[-1].index("^") - 2 == e.start
    return e.reason, pipeline[e.start : e.start + e.length]


@pytest.mark.parametrize(
    "pipeline, reason, pointed",
    [
        ("builtin.module(cse,canonicalise)", "does not refer to a registered pass", "canonicalise"),
        ("builtin.module(cse,func.func(cse,fooo))", "does not refer to a registered pass", "fooo"),
        ("builtin.module(ansor-apply-bst{db=x})", "unknown mlir-ansor pass", "ansor-apply-bst"),
        ("builtin.module(ansor-lower-to-llvm{thread=2})", "has no option 'thread'", "thread"),
        ("builtin.module(ansor-lower-to-llvm{threads=two})", "expects an integer", "two"),
        ("builtin.module(ansor-tune{trials=0})", "must be positive", "0"),
        ("builtin.module(func.func(ansor-lower-to-llvm))", "works on the whole module", "ansor-lower-to-llvm"),
        ("builtin.module(canonicalize{bogus=1})", "no such option bogus", "bogus=1"),
        ("builtin.module(cse{max=1)", "unclosed '{'", "{"),
        ("builtin.module(cse,,cse)", "expected a pass name", ","),
        ("builtin.module(cse))", "unbalanced ')'", ")"),
    ],
)
def test_errors_point_at_the_element(pipeline, reason, pointed):
    got_reason, got_pointed = _caret(pipeline)
    assert reason in got_reason
    assert got_pointed == pointed


def test_cli_pipeline_error_exit_status(capsys):
    assert main(["opt", MATMUL, "--pass-pipeline", "builtin.module(cse,canonicalise)"]) == 2
    err = capsys.readouterr().err
    assert "mlir-ansor: error: 'canonicalise' does not refer" in err
    assert "\n  builtin.module(cse,canonicalise)\n" + " " * 21 + "^" + "~" * 11 + "\n" in err


def test_upstream_only_stdin_and_print_after_all(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr("sys.stdin", io.StringIO(open(MATMUL).read()))
    out = tmp_path / "g.mlir"
    assert main(["opt", "-", "--pass-pipeline", "builtin.module(func.func(linalg-generalize-named-ops),cse)",
                 "-o", str(out), "--print-ir-after-all"]) == 0
    err = capsys.readouterr().err
    assert err.count("// -----// IR Dump After") == 2
    assert "IR Dump After func.func(linalg-generalize-named-ops) //" in err and "IR Dump After cse //" in err
    text = out.read_text()
    assert "linalg.generic" in text and "linalg.matmul" not in text


@pytest.mark.slow
def test_tune_apply_best_lower_in_one_pipeline(tmp_path, capsys):
    """ansor-tune, then the best record applied and spliced in, then lowered;
    the result runs and matches numpy."""
    from mlir_ansor.measure.runner import Kernel
    from mlir_ansor.passes.artifacts import emit_shared_library

    db = tmp_path / "p.db"
    out = tmp_path / "llvm.mlir"
    pipeline = (f"builtin.module(canonicalize,ansor-tune{{trials=2,batch-size=2,db={db}}},"
                f"ansor-apply-best{{db={db}}},cse,ansor-lower-to-llvm)")
    assert main(["opt", MATMUL, "--pass-pipeline", pipeline, "-o", str(out), "--print-ir-after-all"]) == 0
    err = capsys.readouterr().err
    dumps = err.split("// -----// IR Dump After ")[1:]
    assert [d.split(" //")[0] for d in dumps] == [
        "canonicalize", f"ansor-tune{{trials=2,batch-size=2,db={db}}}", f"ansor-apply-best{{db={db}}}", "cse",
        "ansor-lower-to-llvm",
    ]
    assert "func.func @ansor_matmul_128x256x64_f32" in dumps[2] and "memref<" in dumps[2]
    assert "linalg.matmul" in dumps[1] and "tensor<" in dumps[1]  # tuning leaves the IR alone
    text = out.read_text()
    assert "llvm.func @matmul" in text and "func.func" not in text
    with ir.Context():
        module = ir.Module.parse(text)
        so = tmp_path / "m.so"
        emit_shared_library(module, so)
    rng = np.random.default_rng(0)
    a = rng.uniform(-1, 1, (128, 64)).astype(np.float32)
    b = rng.uniform(-1, 1, (64, 256)).astype(np.float32)
    c = np.zeros((128, 256), np.float32)
    Kernel(str(so), "matmul").bind([a, b, c])()
    np.testing.assert_allclose(c, a @ b, rtol=1e-4, atol=1e-4)


def test_run_pipeline_on_a_callers_module(tmp_path):
    """The Python API works in place on a module of the caller's own context."""
    with ir.Context() as ctx:
        module = ir.Module.parse(open(MATMUL).read())
        run_pipeline(module, f"builtin.module(ansor-apply-best{{db={tmp_path / 'none.db'}}})")
        assert module.context is ctx
        text = str(module)
    assert "func.func @ansor_matmul_128x256x64_f32" in text and "call @ansor_matmul" in text
