"""Errors a user can meet.

Every error raised because of the user's input derives from :class:`AnsorError`.
The command line prints its message (no traceback) and exits with status 2, so
the message must say what was wrong and, where possible, where (file, line, op)
and what to do about it.
"""

from __future__ import annotations


class AnsorError(Exception):
    """Base class of the errors caused by the user's input or environment."""


class InputError(AnsorError):
    """The input could not be read or parsed (missing file, malformed MLIR)."""


class UnsupportedError(AnsorError):
    """The input is valid MLIR, but uses something mlir-ansor cannot tune:
    an unknown op, a dynamic shape, an unsupported element type."""


class DatabaseError(AnsorError):
    """The tuning database is corrupt, foreign, or from an incompatible version."""
