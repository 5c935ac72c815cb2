"""mlir-opt style pass pipelines that mix upstream passes with ours.

``builtin.module(canonicalize,ansor-apply-best{db=tuning.db},ansor-lower-to-llvm)``

The Python bindings run a Python callable as a pass, but cannot register it
under a name that ``PassManager.parse`` knows (shared/MLIR-NOTES.md, "Python
passes"). So this driver parses the pipeline text itself
(:func:`parse_pipeline`), hands each upstream element (``canonicalize``,
``func.func(cse,canonicalize)``, ``convert-scf-to-openmp{num-threads=2}``) to
``PassManager.parse`` verbatim, and runs our elements as Python steps on the
same module:

* ``ansor-tune{trials=N,db=FILE,threads=N,seed=N,timeout=S,batch-size=B}``:
  tune every task of the module into the records database; the IR is left
  as it is.
* ``ansor-apply-best{db=FILE,threads=N}``: the module with the best record of
  every task applied (the default schedule for untuned tasks), bufferized:
  :func:`mlir_ansor.compiler.schedule_module`, spliced in place of the module's
  body.
* ``ansor-lower-to-nvvm{chip=sm_90}``: a GPU-scheduled module (block and
  thread ``scf.forall`` loops) to NVVM, kernels as PTX in a ``gpu.binary``.
* ``ansor-lower-to-llvm{threads=N}``: the lowering candidates are measured
  with (`passes/lowering.py`), to the LLVM dialect.

Options of our passes are ``key=value`` separated by commas or spaces. The
whole pipeline is checked before anything runs (as mlir-opt does); an error
points at the element that is wrong with a caret under it.

Entry point: :func:`run_pipeline` (in place on an ``ir.Module``);
``mlir-ansor opt`` is its command line.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from mlir import ir, passmanager

from mlir_ansor.errors import AnsorError

__all__ = ["ANSOR_PASSES", "Element", "PipelineError", "parse_pipeline", "run_pipeline"]


class PipelineError(AnsorError):
    """A pipeline that does not parse, names an unknown pass or option, or
    fails while running; the message shows the pipeline with a caret under
    the element at fault."""

    def __init__(self, message: str, text: str | None = None, start: int = 0, length: int = 1) -> None:
        self.reason = message
        self.text = text
        self.start = start
        self.length = max(1, length)
        if text is not None:
            message = f"{message}\n  {text}\n  {' ' * start}^{'~' * (self.length - 1)}"
        super().__init__(message)


@dataclass
class Element:
    """One element of a pipeline: a pass (``name{options}``) or an op-anchored
    nested pipeline (``name(children)``); `start`/`end` index the pipeline text."""

    name: str
    start: int
    end: int
    text: str
    options: str | None = None
    options_start: int = 0
    children: list[Element] | None = None

    @property
    def is_ours(self) -> bool:
        return self.name.startswith("ansor-")


_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class _Parser:
    def __init__(self, text: str) -> None:
        self.s = text
        self.i = 0

    def error(self, msg: str, pos: int | None = None, length: int = 1) -> PipelineError:
        return PipelineError(msg, self.s, self.i if pos is None else pos, length)

    def ws(self) -> None:
        while self.i < len(self.s) and self.s[self.i].isspace():
            self.i += 1

    def elements(self, closing: str | None) -> list[Element]:
        out: list[Element] = []
        self.ws()
        if closing and self.i < len(self.s) and self.s[self.i] == closing:
            return out  # an empty nested pipeline: func.func()
        while True:
            out.append(self.element())
            self.ws()
            if self.i < len(self.s) and self.s[self.i] == ",":
                self.i += 1
                self.ws()
                continue
            return out

    def element(self) -> Element:
        self.ws()
        m = _NAME.match(self.s, self.i)
        if not m:
            found = repr(self.s[self.i]) if self.i < len(self.s) else "the end"
            raise self.error(f"expected a pass name, found {found}")
        start = self.i
        self.i = m.end()
        el = Element(m.group(), start, self.i, "")
        self.ws()
        if self.i < len(self.s) and self.s[self.i] == "{":
            el.options_start = self.i + 1
            self.i = self._skip_braces(self.i)
            el.options = self.s[el.options_start : self.i - 1]
        elif self.i < len(self.s) and self.s[self.i] == "(":
            open_at = self.i
            self.i += 1
            el.children = self.elements(")")
            self.ws()
            if self.i >= len(self.s) or self.s[self.i] != ")":
                raise self.error(f"expected ',' or ')' to close the '(' of {el.name}", open_at if self.i >= len(self.s) else None)
            self.i += 1
        el.end = self.i
        el.text = self.s[start : self.i].strip()
        return el

    def _skip_braces(self, at: int) -> int:
        depth = 0
        i = at
        quote = None
        while i < len(self.s):
            c = self.s[i]
            if quote:
                if c == quote:
                    quote = None
            elif c in "\"'":
                quote = c
            elif c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        raise self.error("unclosed '{' of the pass options", at)


def parse_pipeline(text: str) -> list[Element]:
    """The module-level elements of `text`: the children of its
    ``builtin.module(...)`` anchor (a bare list is read as module-level)."""
    p = _Parser(text)
    els = p.elements(None)
    p.ws()
    if p.i < len(text):
        raise p.error(f"unexpected {text[p.i]!r} after the pipeline" if text[p.i] != ")" else "unbalanced ')'")
    if len(els) == 1 and els[0].name == "builtin.module" and els[0].children is not None:
        return els[0].children
    for el in els:
        if el.name == "builtin.module":
            raise PipelineError("builtin.module(...) must be the whole pipeline", text, el.start, len(el.name))
    return els


# --------------------------------------------------------------------------
# Our passes.


@dataclass(frozen=True)
class AnsorPass:
    run: Callable[[ir.Module, dict], None]
    options: dict[str, type] = field(default_factory=dict)
    doc: str = ""


def _tune(module: ir.Module, opts: dict) -> None:
    from mlir_ansor.tuner import TuneConfig, tune

    cfg = TuneConfig(
        trials=opts.get("trials", 64),
        threads=opts.get("threads", 1),
        seed=opts.get("seed", 0),
        batch_size=opts.get("batch-size", 16),
        build_timeout_s=opts.get("timeout", 120.0),
        run_timeout_s=opts.get("timeout", 60.0),
    )
    tune(module, config=cfg, db=opts.get("db", "tuning.db"))


def _apply_best(module: ir.Module, opts: dict) -> None:
    from mlir_ansor.compiler import schedule_module

    s = schedule_module(module, db=opts.get("db", "tuning.db"), threads=opts.get("threads", 1))
    _replace_module(module, s.mlir)


def _lower_to_llvm(module: ir.Module, opts: dict) -> None:
    from mlir_ansor.passes.lowering import lower_to_llvm

    lower_to_llvm(module, opts.get("threads", 1))


def _lower_to_nvvm(module: ir.Module, opts: dict) -> None:
    from mlir_ansor.errors import AnsorError
    from mlir_ansor.passes.nvvm import GpuBuildError, lower_to_nvvm
    from mlir_ansor.target import Target

    try:
        lower_to_nvvm(module, Target.parse(f"cuda:{opts.get('chip', 'sm_90')}"))
    except GpuBuildError as e:
        raise AnsorError(f"ansor-lower-to-nvvm: {e} (the module needs a GPU schedule: block/thread scf.forall loops)") from None


ANSOR_PASSES: dict[str, AnsorPass] = {
    "ansor-tune": AnsorPass(
        _tune,
        {"trials": int, "db": str, "threads": int, "seed": int, "timeout": float, "batch-size": int},
        "tune every task of the module into a records database (IR unchanged)",
    ),
    "ansor-apply-best": AnsorPass(
        _apply_best, {"db": str, "threads": int}, "apply the best schedule of every task, bufferize"
    ),
    "ansor-lower-to-llvm": AnsorPass(_lower_to_llvm, {"threads": int}, "lower to the LLVM dialect (OpenMP threads)"),
    "ansor-lower-to-nvvm": AnsorPass(
        _lower_to_nvvm, {"chip": str}, "lower a GPU-scheduled module to NVVM with the kernels' PTX in a gpu.binary"
    ),
}


def _replace_module(module: ir.Module, text: str) -> None:
    """Replace the body and attributes of `module` by those of `text`."""
    new = ir.Module.parse(text, module.context)
    for op in list(module.body.operations):
        op.operation.erase()
    for op in list(new.body.operations):
        module.body.append(op.operation)
    for attr in list(new.operation.attributes):
        module.operation.attributes[attr.name] = attr.attr


def _parse_options(el: Element, spec: dict[str, type], text: str) -> dict:
    opts: dict = {}
    if not el.options:
        return opts
    for m in re.finditer(r"[^,\s]+", el.options):
        item = m.group()
        pos = el.options_start + m.start()
        key, eq, value = item.partition("=")
        if key not in spec:
            allowed = ", ".join(spec) or "none"
            raise PipelineError(f"{el.name} has no option '{key}' (its options: {allowed})", text, pos, len(key))
        if not eq or not value:
            raise PipelineError(f"{el.name}: option '{key}' needs a value ({key}=...)", text, pos, len(item))
        kind = spec[key]
        value = value.strip("\"'")
        try:
            v = kind(value)
        except ValueError:
            raise PipelineError(
                f"{el.name}: option '{key}' expects {'an integer' if kind is int else 'a number'}, got {value!r}",
                text, pos + len(key) + 1, len(value),
            ) from None
        if kind in (int, float) and v <= 0 and key != "seed":
            raise PipelineError(f"{el.name}: option '{key}' must be positive", text, pos + len(key) + 1, len(value))
        opts[key] = v
    return opts


# --------------------------------------------------------------------------
# Checking and running.


@dataclass
class _Step:
    element: Element
    ours: AnsorPass | None = None
    options: dict = field(default_factory=dict)
    pm: passmanager.PassManager | None = None


def _check_upstream(el: Element, text: str, context: ir.Context) -> passmanager.PassManager:
    try:
        return passmanager.PassManager.parse(f"builtin.module({el.text})", context)
    except ValueError as e:
        msg = str(e)
        m = re.search(r"Parser:1:(\d+): error: (.*)", msg)
        if m:
            col = int(m.group(1)) - 1
            word = _NAME.match(el.text, col)
            reason = m.group(2)
            if "does not refer to a registered pass" in reason and word and word.group().startswith("ansor-"):
                reason += f" (mlir-ansor passes: {', '.join(ANSOR_PASSES)})"
            raise PipelineError(reason, text, el.start + col, len(word.group()) if word else 1) from None
        # option errors name no column: point at the options of the element
        lines = [ln.strip() for ln in msg.strip().splitlines() if ln.strip()]
        reason = "; ".join(lines) or "invalid pass"
        if el.options is not None:
            raise PipelineError(reason, text, el.options_start, max(1, len(el.options))) from None
        raise PipelineError(reason, text, el.start, len(el.name)) from None


def _nested_ours(el: Element) -> Element | None:
    for c in el.children or []:
        if c.is_ours:
            return c
        found = _nested_ours(c)
        if found:
            return found
    return None


def plan_pipeline(text: str, context: ir.Context) -> list[_Step]:
    """Parse and check the whole pipeline; nothing runs."""
    steps: list[_Step] = []
    for el in parse_pipeline(text):
        if el.is_ours:
            if el.children is not None:
                raise PipelineError(f"{el.name} is a pass, not an op anchor: it takes {{options}}, not (...)",
                                    text, el.start, len(el.name))
            ours = ANSOR_PASSES.get(el.name)
            if ours is None:
                raise PipelineError(
                    f"unknown mlir-ansor pass '{el.name}' (available: {', '.join(ANSOR_PASSES)})",
                    text, el.start, len(el.name),
                )
            steps.append(_Step(el, ours, _parse_options(el, ours.options, text)))
            continue
        nested = _nested_ours(el)
        if nested is not None:
            raise PipelineError(
                f"{nested.name} works on the whole module: put it directly in builtin.module(...), "
                f"not inside {el.name}(...)",
                text, nested.start, len(nested.name),
            )
        steps.append(_Step(el, pm=_check_upstream(el, text, context)))
    return steps


def run_pipeline(
    module: ir.Module,
    pipeline: str,
    *,
    print_ir_after_all: bool = False,
    stream: TextIO | None = None,
) -> ir.Module:
    """Run `pipeline` on `module`, in place (the module's own context);
    returns `module`. With `print_ir_after_all`, the IR after every element
    goes to `stream` (default stderr), headed as mlir-opt heads it."""
    context = module.context
    steps = plan_pipeline(pipeline, context)
    stream = stream or sys.stderr
    for st in steps:
        el = st.element
        try:
            with context, ir.Location.unknown():
                if st.ours is not None:
                    st.ours.run(module, st.options)
                else:
                    st.pm.run(module.operation)
        except ir.MLIRError as e:
            raise PipelineError(f"{el.text} failed: {e}", pipeline, el.start, len(el.text)) from None
        except PipelineError:
            raise
        except AnsorError as e:
            raise PipelineError(f"{el.text} failed: {e}", pipeline, el.start, len(el.text)) from None
        if print_ir_after_all:
            stream.write(f"// -----// IR Dump After {el.text} //----- //\n{module}\n")
            stream.flush()
    return module


def run_pipeline_on_file(source: str, pipeline: str, output: str | None = None, *,
                         print_ir_after_all: bool = False) -> str:
    """`mlir-ansor opt`: load `source` (a path or "-"), run, write `output`
    (a path; None or "-": stdout). Returns the final IR text."""
    from mlir_ansor.importers import load

    program = load(source)
    run_pipeline(program.module, pipeline, print_ir_after_all=print_ir_after_all)
    with program.context:
        text = str(program.module)
    if output is None or output == "-":
        sys.stdout.write(text)
    else:
        with open(os.fspath(output), "w", encoding="utf-8") as f:
            f.write(text)
    return text
