"""mlir-ansor: an auto-scheduler for MLIR Linalg.

Public API:
  load(source)            parse and verify a module (file, "-", text, ir.Module)
  extract_tasks(source)   split its functions into tuning tasks
  tune(source, ...)       search schedules; returns a TuneResult
  compile(source, ...)    the whole module with the best schedules: a
                          callable, a shared library, the scheduled MLIR
  TuneConfig, Target      what steers the search, and for which machine
"""

__version__ = "0.1.0"

from .compile import CompiledModule, compile  # noqa: E402, A004
from .errors import AnsorError, DatabaseError, InputError, UnsupportedError  # noqa: E402
from .frontend import load  # noqa: E402
from .search.task import extract_tasks  # noqa: E402
from .target import Target  # noqa: E402
from .tuner import TuneConfig, TuneResult, tune  # noqa: E402

__all__ = [
    "AnsorError",
    "CompiledModule",
    "DatabaseError",
    "InputError",
    "Target",
    "TuneConfig",
    "TuneResult",
    "UnsupportedError",
    "__version__",
    "compile",
    "extract_tasks",
    "load",
    "tune",
]
