"""mlir-ansor's version, apart from the package's `__init__` so that any
layer can name it without importing the public API (and MLIR with it)."""

__version__ = "0.1.0"
