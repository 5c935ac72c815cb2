"""Isolated worker processes with per-job time limits.

Candidates are built (transform interpreter + LLVM JIT, which can abort on an
assertion) and run (a JIT'd kernel can segfault or hang) in long-lived worker
processes. A crash, a hang or an exception in a job becomes a :class:`JobResult`
with an error; the worker is replaced and the pool carries on.

Design:

* A worker is ``python -c ...`` started with :mod:`subprocess` in a new session
  (so it is the leader of its own process group, and killing the group also
  kills anything the job spawned, e.g. a ``cc`` link). Nothing is forked from
  the parent, so no MLIR state is shared. ``env`` is applied at exec time, so
  variables such as ``OMP_NUM_THREADS`` are seen by every library the worker
  loads.
* Jobs and results travel as length-prefixed pickles over private pipes (the
  worker moves the pipes off fds 0/1; its fd 1 then goes to the same log file as
  fd 2, so stray prints and C-level noise never corrupt the protocol).
* The worker's stderr (fd 2) goes to a temp file that is truncated when a job
  starts; the tail of that file is attached to CRASH/TIMEOUT errors, so an MLIR
  assertion message reaches the user.
* ``fn`` and ``initializer`` must be module-level functions (pickled by
  reference); functions of a script's ``__main__`` work when the script is a
  file (the worker loads it as ``__mp_main__``, like multiprocessing does).
* ``memory_limit_mb`` is enforced by the operating system: the worker sets
  its data rlimit (``RLIMIT_DATA``: heap and private writable mappings, so a
  numpy array, an LLVM allocation or a library's zero-fill pages, but not the
  address space of the mapped libraries) before anything is imported, so an
  allocation past it fails at once, also in C code that holds the GIL. A job
  whose allocation fails (a ``MemoryError``, or a C++ ``std::bad_alloc`` /
  ``LLVM ERROR: out of memory`` that aborts the worker) is a ``CRASH`` whose
  message begins with "memory limit exceeded" and names the limit
  (:func:`memory_limit_message`). The watchdog thread stays as a second line
  (resident memory sampled every 0.5 s, e.g. shared or file-backed pages).
"""

from __future__ import annotations

import contextlib
import enum
import errno
import fcntl
import os
import pickle
import resource
import select
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Self

__all__ = [
    "ErrorKind",
    "JobResult",
    "WorkerPool",
    "data_limit",
    "default_memory_limit_mb",
    "is_memory_error",
    "machine_memory_mb",
    "memory_limit_message",
]

_STDERR_TAIL_LINES = 20
_HDR = struct.Struct("<Q")
_POLL_S = 0.05  # how often a waiting parent checks that its workers are alive


class ErrorKind(enum.StrEnum):
    """Why a job (or a candidate) failed. Stored in the database as ``.value``."""

    NONE = "none"
    TIMEOUT = "timeout"
    CRASH = "crash"  # the worker died (signal or exit); the message names it
    EXCEPTION = "exception"  # the function raised; message = type, text, traceback tail
    WRONG_ANSWER = "wrong_answer"  # set by callers
    BUILD_ERROR = "build_error"  # set by callers
    RUN_ERROR = "run_error"  # set by callers
    PTXAS_LIMIT = "ptxas_limit"  # built, but ptxas's figures rule it out (spills, stack, smem, registers)
    NOT_MEASURED = "not_measured"  # built in a build-only run; a measuring run measures it


@dataclass
class JobResult:
    value: Any = None
    error_kind: ErrorKind = ErrorKind.NONE
    error_msg: str = ""
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.error_kind == ErrorKind.NONE


# --------------------------------------------------------------------------
# memory limits

MEMORY_LIMIT_EXCEEDED = "memory limit exceeded"
"""How the message of a job stopped by the memory limit begins."""

_OS_OOM_MESSAGES = ("Cannot allocate memory", "cannot map zero-fill pages")  # ENOMEM; a library's pages
_OOM_SIGNS = ("MemoryError", "std::bad_alloc", "LLVM ERROR: out of memory", *_OS_OOM_MESSAGES, MEMORY_LIMIT_EXCEEDED)


def memory_limit_message(limit_mb: int, detail: str = "") -> str:
    """The first line of a job's error when it passed the memory limit."""
    msg = f"{MEMORY_LIMIT_EXCEEDED}: the job needed more than the worker memory limit of {limit_mb} MB"
    return msg + (f" ({detail})" if detail else "")


def is_memory_error(exc: BaseException) -> bool:
    """`exc`, or an exception it was raised from, is a failed allocation: a
    ``MemoryError``, or an ``OSError``/``ImportError`` for want of memory
    (``ENOMEM``; a library whose zero-fill pages could not be mapped)."""
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 8:
        if isinstance(e, MemoryError):
            return True
        if isinstance(e, OSError) and e.errno == errno.ENOMEM:
            return True
        if isinstance(e, (OSError, ImportError)) and any(sign in str(e) for sign in _OS_OOM_MESSAGES):
            return True
        e = e.__cause__ or e.__context__
        seen += 1
    return False


def _cgroup_limit_bytes() -> int | None:
    """The memory limit of this process's cgroup (v2 or v1); None: none."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        ctrl, path = parts[1], parts[2]
        if ctrl == "":
            candidates = [f"/sys/fs/cgroup{path}/memory.max", "/sys/fs/cgroup/memory.max"]
        elif "memory" in ctrl.split(","):
            candidates = [
                f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes",
                "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            ]
        else:
            continue
        for c in candidates:
            try:
                with open(c) as f:
                    text = f.read().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < 1 << 60:
                return int(text)
    return None


def machine_memory_mb() -> int:
    """Memory this process may use (MiB): the machine's physical memory, or
    its cgroup's limit when that is lower."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        total = 8 << 30
    cg = _cgroup_limit_bytes()
    if cg is not None:
        total = min(total, cg)
    return max(1, total >> 20)


def default_memory_limit_mb(share: float = 0.8) -> int:
    """A limit for one process that leaves the machine some room: `share`
    of `machine_memory_mb`."""
    return max(64, int(machine_memory_mb() * share))


def _data_mb() -> float:
    """This process's data size (``VmData``, what ``RLIMIT_DATA`` limits), MiB."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def _set_data_limit(limit_bytes: int | None) -> tuple[int, int]:
    """Set the soft ``RLIMIT_DATA`` (None: unlimited; never above the hard
    limit); returns the previous (soft, hard)."""
    old = resource.getrlimit(resource.RLIMIT_DATA)
    soft = resource.RLIM_INFINITY if limit_bytes is None else int(limit_bytes)
    hard = old[1]
    if hard != resource.RLIM_INFINITY and (soft == resource.RLIM_INFINITY or soft > hard):
        soft = hard
    resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
    return old


@contextlib.contextmanager
def data_limit(extra_mb: int | None):
    """Let this process allocate at most `extra_mb` MiB more than it holds
    now (``RLIMIT_DATA``), until the block ends; the previous limit is put
    back. An allocation past it fails (numpy: ``MemoryError``) instead of
    taking the machine's memory. None: no limit set."""
    if not extra_mb:
        yield
        return
    old = _set_data_limit(int((_data_mb() + extra_mb) * 2**20))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, old)


# --------------------------------------------------------------------------
# framing


def _widen_pipe(fd: int) -> None:
    """Give a protocol pipe the largest buffer an unprivileged process may
    (``/proc/sys/fs/pipe-max-size``, 1 MiB by default) instead of 64 KiB: a
    compile hands its lowering worker 200 MB of ResNet-50's scheduled
    module, which took 1.75 s in 64 KiB steps, each a wake-up of the other
    side. Nothing changes where the system refuses."""
    try:
        with open("/proc/sys/fs/pipe-max-size", encoding="ascii") as f:
            size = int(f.read())
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
    except (OSError, ValueError, AttributeError):
        pass


def _write_frame(fd: int, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    buf = memoryview(_HDR.pack(len(data)) + data)
    while buf:
        n = os.write(fd, buf)
        buf = buf[n:]


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks = []
    while n:
        b = os.read(fd, min(n, 1 << 20))
        if not b:
            return None
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def _read_frame_blocking(fd: int) -> Any:
    hdr = _read_exact(fd, _HDR.size)
    if hdr is None:
        return None
    body = _read_exact(fd, _HDR.unpack(hdr)[0])
    if body is None:
        return None
    return pickle.loads(body)


def _format_exception(exc: BaseException) -> str:
    head = f"{type(exc).__name__}: {exc}"
    tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
    tail = "".join(tb).rstrip().splitlines()[-12:]
    return head + "\n" + "\n".join(tail)


# --------------------------------------------------------------------------
# worker side


def _start_watchdog(parent_pid: int | None, memory_limit_mb: int | None) -> None:  # pragma: no cover
    """A daemon thread that ends the worker when its parent is gone (a killed
    tuner must not leave compilers running) or when the worker's resident
    memory passes `memory_limit_mb` (a schedule whose IR explodes); the
    parent then sees a crash by SIGKILL, with this message in the log. The
    limit itself is the data rlimit (`_worker_main`): this thread, which
    cannot run while a job holds the GIL, reports what the rlimit does not
    cover (resident shared or file-backed pages)."""

    def watch() -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while True:
            time.sleep(0.5)
            if parent_pid is not None and os.getppid() != parent_pid:
                os._exit(70)
            if memory_limit_mb:
                try:
                    with open("/proc/self/statm") as f:
                        rss_mb = int(f.read().split()[1]) * page / 2**20
                except (OSError, ValueError, IndexError):
                    continue
                if rss_mb > memory_limit_mb:
                    sys.stderr.write(
                        f"mlir-ansor worker: {MEMORY_LIMIT_EXCEEDED} "
                        f"(resident {rss_mb:.0f} MB > {memory_limit_mb} MB)\n"
                    )
                    sys.stderr.flush()
                    os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="mlir-ansor-watchdog", daemon=True).start()


def _worker_main() -> None:  # pragma: no cover - runs in the child
    # Take the protocol pipes off fds 0/1, then point 0 at /dev/null and 1 at
    # the stderr log so that job output cannot corrupt the protocol.
    rfd = os.dup(0)
    wfd = os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    sys.stdin = open(os.devnull)  # noqa: SIM115
    sys.stdout = sys.stderr

    config = _read_frame_blocking(rfd)
    if config is None:
        return
    sys.path[:] = config["sys_path"]
    limit_mb = config.get("memory_limit_mb")
    if limit_mb:
        try:
            _set_data_limit(int(limit_mb) * 2**20)
        except (ValueError, OSError) as exc:
            sys.stderr.write(
                f"mlir-ansor worker: cannot set the data rlimit ({exc}); the watchdog alone limits memory\n"
            )
    _start_watchdog(config.get("parent_pid"), limit_mb)
    main_path = config.get("main_path")
    try:
        init = _read_frame_blocking(rfd)
        if init is None:
            return
        initializer, init_args = _loads(init, main_path)
        if initializer is not None:
            initializer(*init_args)
    except BaseException as exc:  # noqa: BLE001
        _write_frame(wfd, ("init_error", _format_exception(exc)))
        return
    _write_frame(wfd, ("ready",))

    while True:
        msg = _read_frame_blocking(rfd)
        if msg is None or msg[0] == "exit":
            return
        payload = msg[1]
        t0 = time.perf_counter()
        try:
            fn, args = _loads(payload, main_path)
            value = fn(*args)
            elapsed = time.perf_counter() - t0
            out = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
            reply = ("ok", out, elapsed)
        except BaseException as exc:  # noqa: BLE001
            tag = "memory" if limit_mb and is_memory_error(exc) else "exc"
            reply = (tag, _format_exception(exc), time.perf_counter() - t0)
        sys.stdout.flush()
        sys.stderr.flush()
        _write_frame(wfd, reply)


def _loads(payload: bytes, main_path: str | None):  # pragma: no cover - runs in the child
    """Unpickle a job. The parent's ``__main__`` script is loaded only when
    the job refers to it: running a user's script (which may lack an
    ``if __name__ == "__main__"`` guard) in every worker would re-run it."""
    try:
        return pickle.loads(payload)
    except (AttributeError, ModuleNotFoundError):
        if not main_path or "__mp_main__" in sys.modules:
            raise
        _load_main(main_path)
        return pickle.loads(payload)


def _load_main(path: str) -> None:  # pragma: no cover - runs in the child
    """Make functions of the parent's ``__main__`` script unpicklable here."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("__mp_main__", path)
    if spec is None or spec.loader is None:
        return
    mod = importlib.util.module_from_spec(spec)
    sys.modules["__mp_main__"] = mod
    spec.loader.exec_module(mod)
    sys.modules["__main__"] = mod


# --------------------------------------------------------------------------
# parent side


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


class _Worker:
    STARTING, IDLE, BUSY = "starting", "idle", "busy"

    def __init__(self, pool: WorkerPool):
        # lives as long as the worker; closed in kill()
        self.log = tempfile.TemporaryFile(  # noqa: SIM115
            mode="a+b", prefix="ansor-worker-", suffix=".log"
        )
        env = dict(os.environ)
        env.update({k: str(v) for k, v in pool._env.items()})
        code = f"from {__name__} import _worker_main; _worker_main()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=env,
            start_new_session=True,
            close_fds=True,
        )
        self.wfd = self.proc.stdin.fileno()
        self.rfd = self.proc.stdout.fileno()
        _widen_pipe(self.wfd)
        _widen_pipe(self.rfd)
        os.set_blocking(self.rfd, False)
        self.buf = bytearray()
        self.state = _Worker.STARTING
        self.started = time.monotonic()
        self.deadline = self.started + pool._init_timeout_s
        self.job: int | None = None
        self.job_t0 = 0.0
        self.jobs_done = 0
        self.dead = False
        try:
            _write_frame(
                self.wfd,
                {
                    "sys_path": list(sys.path),
                    "main_path": pool._main_path,
                    "parent_pid": os.getpid(),
                    "memory_limit_mb": pool._memory_limit_mb,
                },
            )
            _write_frame(self.wfd, pool._init_payload)
        except OSError:
            pass  # it died already; noticed by the poll loop

    def frames(self) -> tuple[list, bool]:
        """Read what is available; return (complete frames, eof)."""
        eof = False
        while True:
            try:
                b = os.read(self.rfd, 1 << 20)
            except BlockingIOError:
                break
            except OSError:
                eof = True
                break
            if not b:
                eof = True
                break
            self.buf += b
        out = []
        while len(self.buf) >= _HDR.size:
            (n,) = _HDR.unpack_from(self.buf)
            if len(self.buf) < _HDR.size + n:
                break
            body = bytes(self.buf[_HDR.size : _HDR.size + n])
            del self.buf[: _HDR.size + n]
            out.append(pickle.loads(body))
        return out, eof

    def send_job(self, payload: bytes, timeout_s: float) -> bool:
        self.log.truncate(0)
        try:
            os.set_blocking(self.wfd, True)
            _write_frame(self.wfd, ("job", payload))
        except OSError:
            return False
        self.state = _Worker.BUSY
        self.job_t0 = time.monotonic()
        self.deadline = self.job_t0 + timeout_s
        return True

    def stderr_tail(self, n: int = _STDERR_TAIL_LINES) -> str:
        try:
            self.log.flush()
            self.log.seek(0)
            data = self.log.read()
        except (OSError, ValueError):
            return ""
        lines = data.decode("utf-8", "replace").rstrip().splitlines()
        return "\n".join(lines[-n:])

    def death_reason(self) -> str:
        rc = self.proc.poll()
        if rc is None:
            try:
                rc = self.proc.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                return "worker stopped responding"
        if rc < 0:
            return f"worker killed by {_signal_name(-rc)}"
        return f"worker exited with status {rc}"

    def kill(self) -> None:
        if self.dead:
            return
        self.dead = True
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.kill()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass
        self._close_files()

    def shutdown(self) -> None:
        if self.dead:
            return
        if self.state == _Worker.IDLE:
            try:
                _write_frame(self.wfd, ("exit",))
                self.proc.wait(timeout=1.0)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self.kill()

    def _close_files(self) -> None:
        for f in (self.proc.stdin, self.proc.stdout, self.log):
            try:
                f.close()
            except OSError:
                pass


class WorkerPool:
    """A pool of long-lived, isolated worker processes.

    ``map``/``run`` never raise because of a job: every job gets a
    :class:`JobResult`. A worker that crashes or passes a job's time limit is
    killed (with its whole process group) and replaced.
    """

    def __init__(
        self,
        n_workers: int = 1,
        *,
        initializer: Callable | None = None,
        init_args: tuple = (),
        env: dict | None = None,
        start_method: str = "spawn",
        max_jobs_per_worker: int | None = None,
        init_timeout_s: float = 300.0,
        memory_limit_mb: int | None = None,
    ):
        if n_workers < 1:
            raise ValueError("n_workers must be >= 1")
        if start_method != "spawn":
            raise ValueError(
                "WorkerPool only supports start_method='spawn' (fresh interpreters)"
            )
        if max_jobs_per_worker is not None and max_jobs_per_worker < 1:
            raise ValueError("max_jobs_per_worker must be >= 1 or None")
        self.n_workers = n_workers
        self._env = dict(env or {})
        self._max_jobs = max_jobs_per_worker
        self._init_timeout_s = init_timeout_s
        self._memory_limit_mb = memory_limit_mb
        self._init_payload = pickle.dumps(
            (initializer, tuple(init_args)), protocol=pickle.HIGHEST_PROTOCOL
        )
        main = sys.modules.get("__main__")
        main_file = getattr(main, "__file__", None)
        # A module run with `python -m pkg.mod` has a spec: it cannot be
        # loaded as a plain script (its relative imports need the package).
        by_module = getattr(main, "__spec__", None) is not None
        self._main_path = (
            os.path.abspath(main_file)
            if main_file and os.path.isfile(main_file) and not by_module
            else None
        )
        self._lock = threading.Lock()
        self._closed = False
        self._workers: list[_Worker | None] = [None] * n_workers
        for i in range(n_workers):
            self._workers[i] = _Worker(self)

    # -- public API -------------------------------------------------------

    def run(self, fn: Callable, args: tuple = (), *, timeout_s: float) -> JobResult:
        return self.map(fn, [args], timeout_s=timeout_s)[0]

    def map(
        self, fn: Callable, args_list: Sequence[tuple], *, timeout_s: float
    ) -> list[JobResult]:
        """Run ``fn(*args)`` for every ``args``; results in input order."""
        with self._lock:
            if self._closed:
                raise RuntimeError("WorkerPool is closed")
            results: list[JobResult | None] = [None] * len(args_list)
            payloads: list[bytes | None] = []
            for i, args in enumerate(args_list):
                try:
                    payloads.append(
                        pickle.dumps(
                            (fn, tuple(args)), protocol=pickle.HIGHEST_PROTOCOL
                        )
                    )
                except Exception as exc:  # noqa: BLE001
                    payloads.append(None)
                    results[i] = JobResult(
                        error_kind=ErrorKind.EXCEPTION,
                        error_msg=f"cannot send job: {_format_exception(exc)}",
                    )
            pending = [i for i, p in enumerate(payloads) if p is not None]
            pending.reverse()  # pop() from the end takes them in input order
            try:
                self._loop(pending, payloads, results, timeout_s)
            except BaseException:
                # KeyboardInterrupt or a bug: the busy workers are in an unknown state
                for w in self._workers:
                    if w is not None and w.state == _Worker.BUSY:
                        w.kill()
                raise
            return results  # type: ignore[return-value]

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for w in self._workers:
                if w is not None:
                    w.shutdown()
            self._workers = [None] * self.n_workers

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    # -- scheduling loop ----------------------------------------------------

    def _replace(self, slot: int) -> None:
        w = self._workers[slot]
        if w is not None:
            w.kill()
        self._workers[slot] = _Worker(self)

    def _loop(
        self, pending: list[int], payloads: list, results: list, timeout_s: float
    ) -> None:
        def live() -> list[_Worker]:
            return [w for w in self._workers if w is not None and not w.dead]

        while pending or any(w.state == _Worker.BUSY for w in live()):
            # hand jobs to idle workers; restart dead slots while there is work
            for slot, w in enumerate(self._workers):
                if w is None or w.dead:
                    if not pending:
                        continue
                    self._replace(slot)
                    w = self._workers[slot]
                if w.state == _Worker.IDLE and pending:
                    i = pending.pop()
                    if w.send_job(payloads[i], timeout_s):
                        w.job = i
                    else:
                        pending.append(i)  # never ran; retry on a fresh worker
                        w.kill()

            waiting = [w for w in live() if w.state != _Worker.IDLE]
            if not waiting:
                continue
            wait = max(
                0.0, min(_POLL_S, min(w.deadline for w in waiting) - time.monotonic())
            )
            try:
                ready, _, _ = select.select([w.rfd for w in waiting], [], [], wait)
            except InterruptedError:
                ready = []
            ready_set = set(ready)

            for slot, w in enumerate(self._workers):
                if w is None or w.dead or w.state == _Worker.IDLE:
                    continue
                eof = False
                if w.rfd in ready_set:
                    try:
                        frames, eof = w.frames()
                    except Exception:  # noqa: BLE001 - garbled reply: treat as a dead worker
                        frames, eof = [], True
                    for fr in frames:
                        self._on_frame(slot, fr, pending, results)
                    if w.dead or w.state == _Worker.IDLE:
                        continue
                if eof or w.proc.poll() is not None:
                    self._handle_death(slot, pending, results)
                elif time.monotonic() > w.deadline:
                    self._handle_timeout(slot, pending, results)

    def _on_frame(
        self, slot: int, fr: tuple, pending: list[int], results: list
    ) -> None:
        w = self._workers[slot]
        tag = fr[0]
        if tag == "ready":
            w.state = _Worker.IDLE
            return
        if tag == "init_error":
            # The initializer raised: a fresh worker would most likely fail the
            # same way, so charge it to the next job (guarantees progress).
            w.kill()
            if pending:
                i = pending.pop()
                results[i] = JobResult(
                    error_kind=ErrorKind.EXCEPTION,
                    error_msg=f"worker initializer failed: {fr[1]}",
                )
            return
        i = w.job
        elapsed = fr[2]
        if tag == "ok":
            try:
                value = pickle.loads(fr[1])
                results[i] = JobResult(value=value, elapsed_s=elapsed)
            except Exception as exc:  # noqa: BLE001
                results[i] = JobResult(
                    error_kind=ErrorKind.EXCEPTION,
                    error_msg=f"cannot load the job's result: {_format_exception(exc)}",
                    elapsed_s=elapsed,
                )
        elif tag == "memory":
            first = fr[1].splitlines()[0] if fr[1] else "MemoryError"
            results[i] = JobResult(
                error_kind=ErrorKind.CRASH,
                error_msg=memory_limit_message(self._memory_limit_mb, first) + "\n" + fr[1],
                elapsed_s=elapsed,
            )
        else:
            results[i] = JobResult(
                error_kind=ErrorKind.EXCEPTION, error_msg=fr[1], elapsed_s=elapsed
            )
        w.job = None
        w.state = _Worker.IDLE
        w.jobs_done += 1
        if self._max_jobs is not None and w.jobs_done >= self._max_jobs:
            w.shutdown()
            self._workers[slot] = _Worker(self)  # start its successor now

    def _handle_death(self, slot: int, pending: list[int], results: list) -> None:
        w = self._workers[slot]
        reason = w.death_reason()
        tail = w.stderr_tail()
        msg = reason + (f"\n--- worker stderr (last lines) ---\n{tail}" if tail else "")
        if self._memory_limit_mb and any(sign in tail for sign in _OOM_SIGNS):
            msg = memory_limit_message(self._memory_limit_mb, reason) + "\n" + msg
        if w.state == _Worker.BUSY and w.job is not None:
            results[w.job] = JobResult(
                error_kind=ErrorKind.CRASH,
                error_msg=msg,
                elapsed_s=time.monotonic() - w.job_t0,
            )
        elif w.state == _Worker.STARTING:
            # died while starting (e.g. the initializer aborted): charge a job,
            # which guarantees progress; the slot restarts when there is work
            if pending:
                i = pending.pop()
                results[i] = JobResult(
                    error_kind=ErrorKind.CRASH,
                    error_msg=f"worker failed to start: {msg}",
                )
            w.kill()
            return
        w.job = None
        self._replace(slot)

    def _handle_timeout(self, slot: int, pending: list[int], results: list) -> None:
        w = self._workers[slot]
        if w.state == _Worker.BUSY and w.job is not None:
            elapsed = time.monotonic() - w.job_t0
            tail = w.stderr_tail()
            msg = f"job timed out after {elapsed:.3g} s (limit {w.deadline - w.job_t0:.3g} s)"
            if tail:
                msg += f"\n--- worker stderr (last lines) ---\n{tail}"
            results[w.job] = JobResult(
                error_kind=ErrorKind.TIMEOUT, error_msg=msg, elapsed_s=elapsed
            )
        elif w.state == _Worker.STARTING:
            if pending:
                i = pending.pop()
                results[i] = JobResult(
                    error_kind=ErrorKind.TIMEOUT,
                    error_msg=f"worker did not start within {self._init_timeout_s:g} s",
                )
            w.kill()
            return
        w.job = None
        self._replace(slot)
