"""mlir-ansor: an auto-scheduler for MLIR Linalg.

Public API:
  load(source)            parse and verify a module (file, "-", text, ir.Module),
                          or import an ONNX model (a path ending in .onnx)
  extract_tasks(source)   split its functions into tuning tasks
  tune(source, ...)       search schedules; returns a TuneResult
  compile(source, ...)    the whole module with the best schedules: a
                          callable, a shared library, the scheduled MLIR;
                          for a CUDA target a CudaModule (kernels and a host
                          plan, run through cuda-python without MLIR)
  build_library(source, sizes=...)
                          a function with dynamic dimensions as one library
                          that dispatches among size-specialised schedules
                          in MLIR at run time: a DynamicLibrary
  TuneConfig, Target      what steers the search, and for which machine
  torch_backend(...)      a torch.compile backend (also registered as "mlir_ansor")

The names are imported on first use (module ``__getattr__``), so importing a
part that needs no MLIR (`mlir_ansor.records`, the CUDA runner on a GPU host)
does not import the MLIR bindings.

The house, bottom to top (each package's docstring says what it holds and
what it may import; `tests/test_layering.py` checks it):
  errors, target, version   what every layer may name
  records/                  the tuning database (SQLite; no MLIR)
  ir/                       IR helpers: parsing, rewriting, attribute names, element types
  graph/, importers/        module-level rewrites and the partition into tasks; PyTorch in
  schedule/                 transform-IR writers (CPU and GPU), applying a schedule
  passes/                   lowering pipelines, driver rewrites, libraries and PTX
  measure/                  builders, runners, executors, the measurer
  search/                   space, sketch rules, strategies, cost models, features, task scheduler
  cuda_compiler             whole modules for NVIDIA GPUs: kernels and a host plan (a bundle)
  tuner, compile            the tuning loop and the compiler: the API
  dispatch                  one library for dynamic shapes: specializations behind a dispatch
  tools/, examples/         command line and its back-ends; example workloads and models
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from mlir_ansor.version import __version__

_API = {
    "CompiledModule": "mlir_ansor.compiler",
    "CudaModule": "mlir_ansor.measure.cuda_module",
    "DynamicLibrary": "mlir_ansor.dispatch",
    "build_library": "mlir_ansor.dispatch",
    "compile": "mlir_ansor.compiler",
    "AnsorError": "mlir_ansor.errors",
    "DatabaseError": "mlir_ansor.errors",
    "InputError": "mlir_ansor.errors",
    "UnsupportedError": "mlir_ansor.errors",
    "extract_tasks": "mlir_ansor.graph.task",
    "Target": "mlir_ansor.target",
    "TuneConfig": "mlir_ansor.tuner",
    "TuneResult": "mlir_ansor.tuner",
    "tune": "mlir_ansor.tuner",
    "torch_backend": "mlir_ansor.tools.torch_backend",
}

__all__ = [
    "AnsorError",
    "CompiledModule",
    "CudaModule",
    "DatabaseError",
    "DynamicLibrary",
    "InputError",
    "Target",
    "TuneConfig",
    "TuneResult",
    "UnsupportedError",
    "__version__",
    "build_library",
    "compile",
    "extract_tasks",
    "load",
    "torch_backend",
    "tune",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from mlir_ansor.compiler import CompiledModule, compile  # noqa: A004
    from mlir_ansor.dispatch import DynamicLibrary, build_library
    from mlir_ansor.errors import AnsorError, DatabaseError, InputError, UnsupportedError
    from mlir_ansor.graph.task import extract_tasks
    from mlir_ansor.measure.cuda_module import CudaModule
    from mlir_ansor.target import Target
    from mlir_ansor.tools.torch_backend import torch_backend
    from mlir_ansor.tuner import TuneConfig, TuneResult, tune


def load(source: Any = None, *, text: str | None = None) -> Any:
    """Parse and verify an MLIR module into a context of our own
    (`mlir_ansor.ir.program.load`: a path, ``"-"``, an ``ir.Module``, or
    ``text=``); a path ending in ``.onnx`` is an ONNX model, imported to
    Linalg through torch-mlir first (`mlir_ansor.importers.onnx`, the
    ``onnx`` extra). Returns a ``Program``, what `tune` and `compile` take."""
    from mlir_ansor.importers import load as load_source

    return load_source(source, text=text)


def __getattr__(name: str) -> Any:
    module = _API.get(name)
    if module is None:
        raise AttributeError(f"module 'mlir_ansor' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_API))
