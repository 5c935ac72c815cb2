"""Layer 2: models from other frameworks, in as Linalg text.

- `pytorch`: a ``torch.nn.Module`` through torch-mlir's FX importer to Linalg
  on tensors (the `torch` extra).
- `onnx`: an ONNX model through torch-mlir's ONNX importer to Linalg on
  tensors (the `onnx` extra).
- :func:`load`: what every entry point (`tune`, `compile`, the command line)
  parses a source with: `ir.program.load`, except that a path ending in
  ``.onnx`` is imported first.

May import: `errors`, `target`, `ir`.
"""

from __future__ import annotations

import os
from typing import Any

from mlir_ansor.ir.program import Program
from mlir_ansor.ir.program import load as load_mlir

__all__ = ["is_onnx_path", "load"]


def is_onnx_path(source: Any) -> bool:
    """Whether `source` names an ONNX model file (a path ending in .onnx)."""
    return isinstance(source, (str, os.PathLike)) and os.fspath(source).lower().endswith(".onnx")


def load(source: Any = None, *, text: str | None = None) -> Program:
    """`ir.program.load` (a path, ``"-"``, an ``ir.Module`` or ``text=``);
    a path ending in ``.onnx`` goes through `onnx.import_onnx` first, and
    diagnostics name that file (``<model.onnx, imported>``, lines of the
    imported text)."""
    if text is None and is_onnx_path(source):
        from mlir_ansor.importers.onnx import import_onnx

        return load_mlir(text=import_onnx(source), name=f"<{os.fspath(source)}, imported>")
    return load_mlir(source, text=text)
