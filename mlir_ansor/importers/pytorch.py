"""Import a PyTorch module as Linalg-on-tensors MLIR (the optional ``torch`` extra).

Entry points:

* :func:`import_module` ``(model, example_inputs) -> str``: the model traced
  with ``torch.export`` and lowered by torch-mlir to ``linalg-on-tensors``;
  the text parses with our MLIR bindings, weights are ``dense_resource``
  blobs at the end of it. Hand it to ``mlir_ansor.load(text=...)``,
  ``tune``, ``compile``.
* :func:`load_module` ``(model, example_inputs) -> Program``: the same, parsed
  and verified into a context of ours (what every other API accepts).

Why text: torch-mlir ships its own copy of the MLIR Python bindings
(``torch_mlir.ir``); its objects cannot be handed to ours, but the printed
module can (same IR, generic syntax where needed).

Neither torch nor torch-mlir is a dependency of mlir-ansor; without them
these functions raise :class:`~mlir_ansor.errors.AnsorError` saying to
``pip install -e '.[torch]'``.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import warnings
from types import ModuleType
from typing import Any

from mlir_ansor.errors import AnsorError, UnsupportedError
from mlir_ansor.ir.program import Program, load

__all__ = ["TORCH_EXTRA_HINT", "child_failure", "import_module", "load_module", "refuse_tm_tensor", "require_torch"]

TORCH_EXTRA_HINT = "install the 'torch' extra: pip install -e '.[torch]' (torch and torch-mlir)"
"""What to do when torch or torch-mlir is missing."""


def _require(module: str, package: str, who: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise AnsorError(f"{who} needs {package}, which is not installed ({err}); {TORCH_EXTRA_HINT}") from None


def require_torch(who: str = "the PyTorch import") -> ModuleType:
    """The ``torch`` module, or an :class:`AnsorError` naming the extra to install."""
    return _require("torch", "torch", who)


def _require_torch_mlir(who: str) -> None:
    """Check that torch-mlir is installed, without importing it: its own
    copy of MLIR aborts the process when ours is loaded already."""
    require_torch(who)
    missing = "torch_mlir" in sys.modules and sys.modules["torch_mlir"] is None
    if missing or importlib.util.find_spec("torch_mlir") is None:
        raise AnsorError(f"{who} needs torch-mlir, which is not installed; {TORCH_EXTRA_HINT}")


# Run in a fresh interpreter that never loads our MLIR bindings (torch-mlir
# ships its own MLIR; two in one process abort it): the traced program in,
# MLIR text out.
_CHILD = """
import sys, warnings
import torch
from torch_mlir import fx
warnings.simplefilter("ignore", FutureWarning)
prog = torch.export.load(sys.argv[1])
module = fx.export_and_import(prog, output_type="linalg-on-tensors", func_name=sys.argv[3])
import json
attrs = {k: v for k, v in json.loads(sys.argv[4]).items() if v}
if attrs:
    from torch_mlir import ir
    with module.context:
        for op in module.body.operations:
            if op.operation.name == "func.func" and ir.StringAttr(op.operation.attributes["sym_name"]).value == sys.argv[3]:
                for name, strings in attrs.items():
                    op.operation.attributes[name] = ir.Attribute.parse(json.dumps(strings))
with open(sys.argv[2], "w") as f:
    f.write(str(module))
"""


def import_module(model: Any, example_inputs: Any, *, func_name: str = "main", dynamic_shapes: Any = None) -> str:
    """MLIR text (Linalg on tensors) of ``model`` called on ``example_inputs``.

    ``model``: a ``torch.nn.Module`` (put it in eval mode first if it has
    batch norms or dropout: the export traces what it computes now).
    ``example_inputs``: a tensor or a tuple of tensors; their shapes and
    dtypes become the static signature of ``@func_name``.
    ``dynamic_shapes``: ``torch.export``'s, one entry per input (a dict
    from dimension to ``torch.export.Dim``), for dimensions that stay
    dynamic (``tensor<1x?x768xf32>``): a BERT layer's sequence length.
    `tune --sizes` and `compile` give them sizes (`graph.dynamic`); those
    the export gave one symbol are one dimension of the function too (its
    ``ansor.same_dims``), and a call whose arrays differ there is an error,
    as is one outside the ``Dim``'s ``min``/``max`` (its ``ansor.dim_ranges``:
    :func:`_dim_symbols`).
    Raises :class:`AnsorError` when torch or torch-mlir is missing, or when
    the export or the lowering fails (with torch-mlir's message).
    """
    _require_torch_mlir("mlir_ansor.importers.pytorch.import_module")
    torch = require_torch()
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example_inputs = tuple(example_inputs)
    name = type(model).__name__
    with tempfile.TemporaryDirectory(prefix="mlir-ansor-torch-") as tmp:
        traced, out = os.path.join(tmp, "model.pt2"), os.path.join(tmp, "model.mlir")
        try:
            with warnings.catch_warnings():
                # torch.export warns about pytree internals that users cannot act on.
                warnings.simplefilter("ignore", FutureWarning)
                exported = torch.export.export(model, example_inputs, dynamic_shapes=dynamic_shapes, strict=False)
                torch.export.save(exported, traced)
        except Exception as err:  # torch.export raises many kinds
            raise AnsorError(f"torch.export could not trace {name}: {type(err).__name__}: {str(err).strip()[:2000]}") from err
        symbols = _dim_symbols(exported)
        attrs = json.dumps({"ansor.same_dims": ["=".join(g) for g, _ in symbols.values() if len(g) > 1],
                            "ansor.dim_ranges": [f"{d}={lo}..{'' if hi is None else hi}"
                                                 for g, (lo, hi) in symbols.values() for d in g]})
        proc = subprocess.run([sys.executable, "-c", _CHILD, traced, out, func_name, attrs], capture_output=True, text=True)
        if proc.returncode != 0:
            raise AnsorError(f"torch-mlir could not import {name} to linalg-on-tensors (exit {proc.returncode})"
                             + child_failure(proc.stderr))
        with open(out, encoding="utf-8") as f:
            text = f.read()
    refuse_tm_tensor(text, name)
    return text


_TM_TENSOR_SOURCES = {"scan": "torch.cumsum, cumprod", "sort": "torch.sort, argsort", "topk": "torch.topk",
                      "scatter": "scatter, index_put", "attention": "scaled_dot_product_attention"}


def refuse_tm_tensor(text: str, name: str) -> None:
    """torch-mlir lowers a few torch ops (cumsum, sort, topk, scatter) to
    its own TMTensor dialect, not to Linalg: an :class:`UnsupportedError`
    that names them, rather than a parse error of a dialect our MLIR does
    not have."""
    if "tm_tensor." not in text:  # (a substring search: the regex would scan a model's 100 MB of weights too)
        return
    found = sorted(set(re.findall(r"\btm_tensor\.(\w+)", text)) - {"yield"})
    if found:
        ops = ", ".join(f"tm_tensor.{op}" + (f" (from {_TM_TENSOR_SOURCES[op]})" if op in _TM_TENSOR_SOURCES else "")
                        for op in found)
        raise UnsupportedError(f"torch-mlir lowered part of {name} to its TMTensor dialect, not to Linalg: {ops}; "
                               "mlir-ansor takes Linalg with tensor, arith and math ops")


def _finite(bound: Any) -> int | None:
    """A sympy bound as an int; None for an infinite one (``int_oo``)."""
    try:
        return int(bound)
    except (TypeError, ValueError, AttributeError, OverflowError):
        return None


def _dim_symbols(exported: Any) -> dict[str, tuple[list[str], tuple[int, int | None]]]:
    """The dynamic dimensions of an ``ExportedProgram``'s tensor inputs, by
    the symbol it gave them: the ``"ARG.DIM"`` of each, and the range the
    export allows it (``Dim("past", min=1, max=4096)``; None: no bound).
    The importer writes those of one symbol as the function's
    ``ansor.same_dims`` (`ir.attrs.SAME_DIMS_ATTR`: a KV cache's keys and
    values), since torch-mlir's function keeps only ``?`` for each, and the
    ranges as its ``ansor.dim_ranges`` (`ir.attrs.DIM_RANGES_ATTR`)."""
    torch = require_torch()
    from torch.export.graph_signature import InputKind

    placeholders = {n.name: n for n in exported.graph.nodes if n.op == "placeholder"}
    users = [spec.arg.name for spec in exported.graph_signature.input_specs if spec.kind == InputKind.USER_INPUT]
    found: dict[str, tuple[list[str], tuple[int, int | None]]] = {}
    tensors = [placeholders[n].meta.get("val") for n in users if n in placeholders]
    for i, val in enumerate(v for v in tensors if isinstance(v, torch.Tensor)):
        for d, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                expr = size.node.expr
                if expr not in found:
                    rng = exported.range_constraints.get(expr)
                    # torch.export's floor of 2 (it specializes 0 and 1) is no bound of the
                    # Linalg, which runs one row as well: only a larger min is kept.
                    lo = int(rng.lower) if rng is not None and int(rng.lower) > 2 else 1
                    hi = _finite(rng.upper) if rng is not None else None
                    found[expr] = ([], (lo, hi))
                found[expr][0].append(f"{i}.{d}")
    return {str(k): v for k, v in found.items()}


def child_failure(stderr: str) -> str:
    """What a failed torch-mlir child said: its first MLIR diagnostic (which
    names the op it could not lower: the traceback after it does not) on the
    first line, then the traceback's last lines."""
    lines = stderr.strip().splitlines()
    diag = next((ln.strip() for ln in lines if " error: " in ln or ln.startswith("error: ")), "")
    tail = "\n".join(lines[-15:])
    return (f": {diag}" if diag else ":") + f"\n{tail}"


def load_module(model: Any, example_inputs: Any, *, func_name: str = "main", dynamic_shapes: Any = None) -> Program:
    """:func:`import_module`, parsed and verified into a context of ours."""
    return load(text=import_module(model, example_inputs, func_name=func_name, dynamic_shapes=dynamic_shapes))
