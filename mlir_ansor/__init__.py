"""mlir-ansor: an auto-scheduler for MLIR Linalg.

Public API:
  load(source)            parse and verify a module (file, "-", text, ir.Module)
  extract_tasks(source)   split its functions into tuning tasks
  tune(source, ...)       search schedules; returns a TuneResult
  TuneConfig, Target      what steers the search, and for which machine
"""

__version__ = "0.1.0"

from .errors import AnsorError, DatabaseError, InputError, UnsupportedError  # noqa: E402
from .frontend import load  # noqa: E402
from .search.task import extract_tasks  # noqa: E402
from .target import Target  # noqa: E402
from .tuner import TuneConfig, TuneResult, tune  # noqa: E402

__all__ = [
    "AnsorError",
    "DatabaseError",
    "InputError",
    "Target",
    "TuneConfig",
    "TuneResult",
    "UnsupportedError",
    "__version__",
    "extract_tasks",
    "load",
    "tune",
]
