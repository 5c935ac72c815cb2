"""Import an ONNX model as Linalg-on-tensors MLIR (the optional ``onnx`` extra).

Entry point: :func:`import_onnx` ``(path) -> str``. torch-mlir's ONNX
importer (``torch_mlir.extras.onnx_importer``, what ``torch-mlir-import-onnx``
runs) turns the model, after ONNX's shape inference, into the ``torch.onnx``
dialect; the ``torch-onnx-to-torch-backend-pipeline`` makes Torch backend IR
of it, and torch-mlir's ``torch-backend-to-linalg-on-tensors-backend-pipeline``
Linalg on tensors, with the weights as dense constants. ``mlir_ansor.load``
of a ``.onnx`` path and ``mlir-ansor import MODEL.onnx -o MODEL.mlir`` call it.

As for PyTorch models (`importers.pytorch`), the work happens in a child
interpreter that never loads our MLIR bindings: torch-mlir ships its own
copy, and two in one process abort it. Only the printed module comes back.

Needs ``onnx`` and ``torch-mlir`` (the ``onnx`` extra; the ``torch`` extra
that ``scripts/setup.sh`` installs has both); without them
:func:`import_onnx` raises :class:`~mlir_ansor.errors.AnsorError` naming
the extra.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile

from mlir_ansor.errors import AnsorError, InputError
from mlir_ansor.importers.pytorch import child_failure, refuse_tm_tensor

__all__ = ["ONNX_EXTRA_HINT", "import_onnx"]

ONNX_EXTRA_HINT = "install the 'onnx' extra: pip install -e '.[onnx]' (onnx and torch-mlir)"
"""What to do when onnx or torch-mlir is missing."""

_CHILD = """
import importlib.util
import sys
import onnx
from torch_mlir.compiler_utils import OutputType, lower_mlir_module, run_pipeline_with_repro_report
from torch_mlir.dialects import torch as torch_d
from torch_mlir.extras import onnx_importer
from torch_mlir.ir import Context

model = onnx.load(sys.argv[1])
onnx.checker.check_model(model)
spec = importlib.util.spec_from_file_location("onnx_shapes", sys.argv[3])
onnx_shapes = importlib.util.module_from_spec(spec)
spec.loader.exec_module(onnx_shapes)
model, _ = onnx_shapes.fold_shapes(model)
context = Context()
torch_d.register_dialect(context)
info = onnx_importer.ModelInfo(model)
module = info.create_module(context=context).operation
onnx_importer.NodeImporter.define_function(info.main_graph, module).import_all()
module.verify()
run_pipeline_with_repro_report(
    module, "builtin.module(torch-onnx-to-torch-backend-pipeline)", "Lowering ONNX to Torch backend IR"
)
lower_mlir_module(False, OutputType.LINALG_ON_TENSORS, module)
with open(sys.argv[2], "w") as f:
    f.write(str(module))
"""


_SHAPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "onnx_shapes.py")
"""`onnx_shapes`, which the child runs by path (it must not import our package)."""


def _require(who: str) -> None:
    """Check that onnx and torch-mlir are installed, without importing them here."""
    missing = [
        pkg
        for mod, pkg in (("onnx", "onnx"), ("torch_mlir", "torch-mlir"))
        if (mod in sys.modules and sys.modules[mod] is None) or importlib.util.find_spec(mod) is None
    ]
    if missing:
        raise AnsorError(f"{who} needs {' and '.join(missing)}, which is not installed; {ONNX_EXTRA_HINT}")


def import_onnx(path: str | os.PathLike) -> str:
    """MLIR text (Linalg on tensors) of the ONNX model at `path`.

    The function is named after the ONNX graph (``@main_graph`` for
    ``torch.onnx.export``'s models); its arguments are the graph's inputs,
    its weights dense constants. A dimension the model names instead of
    sizing (``dim_param``: a batch exported with ``dynamic_axes``) stays
    dynamic (``tensor<?x3x224x224xf32>``): `mlir_ansor.compile` gives a
    `DynamicModule` for it, and ``tune --sizes 0.0=1,8`` tunes it at sizes. Raises :class:`InputError` for a missing
    file, :class:`AnsorError` when onnx or torch-mlir is missing or the
    model does not import or lower (with torch-mlir's first diagnostic).
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise InputError(f"{path}: no such ONNX model")
    _require("mlir_ansor.importers.onnx.import_onnx")
    with tempfile.TemporaryDirectory(prefix="mlir-ansor-onnx-") as tmp:
        out = os.path.join(tmp, "model.mlir")
        proc = subprocess.run([sys.executable, "-c", _CHILD, path, out, _SHAPES], capture_output=True, text=True)
        if proc.returncode != 0:
            raise AnsorError(
                f"torch-mlir could not import {path} to linalg-on-tensors (exit {proc.returncode})"
                + child_failure(proc.stderr)
            )
        with open(out, encoding="utf-8") as f:
            text = f.read()
    refuse_tm_tensor(text, path)
    return text
