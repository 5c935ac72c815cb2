"""Tests of the isolated worker pool (mlir_ansor.measure.pool)."""

from __future__ import annotations

import ctypes
import os
import sys
import time

import pytest

from mlir_ansor.measure.pool import ErrorKind, JobResult, WorkerPool

# ---- job functions (module level: pickled by reference) -------------------


def add(a, b):
    return a + b


def boom(msg):
    raise ValueError(msg)


def abort_noisy():
    os.write(2, b"Assertion `isa<FooOp>(op)' failed.\n")
    os.abort()


def segfault():
    ctypes.string_at(0)


def sleep_forever():
    while True:
        time.sleep(10)


def nap(s):
    time.sleep(s)
    return os.getpid()


def getenv(name):
    return os.environ.get(name)


def noisy_print(x):
    print("stdout noise that must not break the protocol")
    sys.stdout.flush()
    os.write(1, b"raw fd-1 noise\n")
    return x


def exit_code(n):
    os._exit(n)


def unpicklable_result():
    return lambda: 0


_INIT_STATE = {}


def init_state(value):
    _INIT_STATE["v"] = value


def read_state():
    return _INIT_STATE.get("v")


def init_fail():
    raise RuntimeError("cannot initialize")


# ---- tests ----------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    with WorkerPool(1, env={"ANSOR_TEST_VAR": "42"}) as p:
        yield p


def test_value(pool):
    r = pool.run(add, (2, 3), timeout_s=20)
    assert r.ok and r.value == 5 and r.error_kind is ErrorKind.NONE
    # elapsed_s is the job's own time: at least the nap, at most the
    # caller's wall time around the call
    t0 = time.monotonic()
    r = pool.run(nap, (0.2,), timeout_s=20)
    wall = time.monotonic() - t0
    assert r.ok and 0.2 <= r.elapsed_s <= wall, (r.elapsed_s, wall)


def test_env(pool):
    assert pool.run(getenv, ("ANSOR_TEST_VAR",), timeout_s=20).value == "42"


def test_exception(pool):
    r = pool.run(boom, ("bad knob",), timeout_s=20)
    assert not r.ok and r.error_kind is ErrorKind.EXCEPTION
    assert "ValueError: bad knob" in r.error_msg
    assert "boom" in r.error_msg  # traceback tail names the function
    assert pool.run(add, (1, 1), timeout_s=20).value == 2


def test_abort(pool):
    r = pool.run(abort_noisy, (), timeout_s=20)
    assert r.error_kind is ErrorKind.CRASH and r.error_kind == "crash"
    assert "SIGABRT" in r.error_msg
    assert "Assertion `isa<FooOp>(op)' failed." in r.error_msg  # stderr tail
    assert pool.run(add, (1, 2), timeout_s=20).value == 3


def test_segfault(pool):
    r = pool.run(segfault, (), timeout_s=20)
    assert r.error_kind is ErrorKind.CRASH
    assert "SIGSEGV" in r.error_msg
    assert pool.run(add, (1, 3), timeout_s=20).value == 4


def test_exit_status(pool):
    r = pool.run(exit_code, (3,), timeout_s=20)
    assert r.error_kind is ErrorKind.CRASH and "status 3" in r.error_msg
    assert pool.run(add, (1, 4), timeout_s=20).value == 5


def test_timeout(pool):
    hung = pool.run(nap, (0,), timeout_s=20).value  # the worker's pid (and it is warm)
    r = pool.run(sleep_forever, (), timeout_s=1.0)
    assert r.error_kind is ErrorKind.TIMEOUT
    # stopped at its limit, not before, and said so
    assert r.elapsed_s >= 1.0 and "limit 1 s" in r.error_msg, r
    # the hung worker is killed and replaced: the next job runs in another
    # process
    assert not _alive(hung)
    again = pool.run(nap, (0,), timeout_s=20)
    assert again.ok and again.value != hung
    assert pool.run(add, (2, 2), timeout_s=20).value == 4


def test_noise_and_bad_results(pool):
    assert pool.run(noisy_print, (7,), timeout_s=20).value == 7
    r = pool.run(unpicklable_result, (), timeout_s=20)
    assert r.error_kind is ErrorKind.EXCEPTION
    # a function that cannot be pickled is an error of that job only
    r = pool.run(lambda: 1, (), timeout_s=20)
    assert r.error_kind is ErrorKind.EXCEPTION and "cannot send job" in r.error_msg
    assert pool.run(add, (3, 3), timeout_s=20).value == 6


def test_map_mixed_keeps_order(pool):
    jobs = [
        (add, (1, 1)),
        (boom, ("x",)),
        (segfault, ()),
        (add, (2, 2)),
        (abort_noisy, ()),
        (add, (3, 3)),
    ]
    # map takes one fn: dispatch through a module-level trampoline
    results = pool.map(call, [(f, a) for f, a in jobs], timeout_s=20)
    kinds = [r.error_kind for r in results]
    assert kinds == [
        ErrorKind.NONE,
        ErrorKind.EXCEPTION,
        ErrorKind.CRASH,
        ErrorKind.NONE,
        ErrorKind.CRASH,
        ErrorKind.NONE,
    ]
    assert [r.value for r in results if r.ok] == [2, 4, 6]


def call(f, args):
    return f(*args)


def rendezvous(folder, me, other):
    """Announce `me` in `folder`, then wait for `other` (up to 10 s): the
    worker's pid when the two jobs met (ran at the same time), else None."""
    open(os.path.join(folder, me), "w").close()
    for _ in range(200):
        if os.path.exists(os.path.join(folder, other)):
            return os.getpid()
        time.sleep(0.05)
    return None


def test_concurrency_and_timeouts_two_workers(tmp_path):
    with WorkerPool(2) as p:
        # two jobs that can only both finish if they run at the same time,
        # in two processes
        rs = p.map(rendezvous, [(str(tmp_path), "a", "b"), (str(tmp_path), "b", "a")], timeout_s=20)
        pids = [r.value for r in rs]
        assert all(r.ok for r in rs) and None not in pids and pids[0] != pids[1], rs
        # a hang and a crash among good jobs: every job gets its own result
        rs = p.map(
            call,
            [(sleep_forever, ()), (add, (1, 1)), (segfault, ()), (nap, (0.1,))],
            timeout_s=1.0,
        )
        assert [r.error_kind for r in rs] == [
            ErrorKind.TIMEOUT,
            ErrorKind.NONE,
            ErrorKind.CRASH,
            ErrorKind.NONE,
        ]


def test_initializer_and_max_jobs():
    with WorkerPool(
        1, initializer=init_state, init_args=("hello",), max_jobs_per_worker=2
    ) as p:
        pids = [p.run(nap, (0,), timeout_s=20).value for _ in range(4)]
        assert pids[0] == pids[1] and pids[1] != pids[2] and pids[2] == pids[3]
        assert p.run(read_state, (), timeout_s=20).value == "hello"


def test_initializer_failure_does_not_hang():
    with WorkerPool(1, initializer=init_fail) as p:
        rs = p.map(add, [(1, 1), (2, 2)], timeout_s=5)
        assert all(r.error_kind is ErrorKind.EXCEPTION for r in rs)
        assert "cannot initialize" in rs[0].error_msg


def test_timeout_kills_process_group():
    with WorkerPool(1) as p:
        r = p.run(call, (spawn_then_sleep, ()), timeout_s=1.5)
        assert r.error_kind is ErrorKind.TIMEOUT
        with open(_CHILD_PID_FILE) as f:
            child = int(f.read())
        for _ in range(50):
            if not _alive(child):
                break
            time.sleep(0.05)
        assert not _alive(child)


_CHILD_PID_FILE = os.path.join(
    os.environ.get("TMPDIR", "/tmp"), f"ansor-pool-test-{os.getpid()}.pid"
)


def spawn_then_sleep():
    import subprocess

    c = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    # the worker imports this module too (with its own pid), so the file name
    # comes from the environment the parent test process set before the pool
    with open(os.environ["ANSOR_CHILD_PID_FILE"], "w") as f:
        f.write(str(c.pid))
    time.sleep(60)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


os.environ.setdefault("ANSOR_CHILD_PID_FILE", _CHILD_PID_FILE)


def test_closed_pool_refuses():
    p = WorkerPool(1)
    p.close()
    p.close()  # idempotent
    with pytest.raises(RuntimeError):
        p.run(add, (1, 1), timeout_s=1)


def test_jobresult_ok():
    assert JobResult(value=1).ok
    assert not JobResult(error_kind=ErrorKind.TIMEOUT).ok
    assert str(ErrorKind.WRONG_ANSWER) == "wrong_answer"


# ---- MLIR: an abort inside MLIR (LLVM ERROR -> SIGABRT) --------------------


def mlir_abort_job():
    from mlir import ir
    from mlir.passmanager import PassManager

    with ir.Context():
        m = ir.Module.parse("func.func @f() { return }")
        pm = PassManager("builtin.module")
        # a func.func pass on a module-level manager: "did you intend to nest?" abort
        pm.add(_noop_pass, op_name="func.func")
        pm.run(m.operation)
    return "survived"


def _noop_pass(op, pass_):
    pass


def mlir_ok_job():
    from mlir import ir

    with ir.Context():
        return str(ir.Module.parse("func.func @f() { return }")).count("func.func")


def test_mlir_abort_is_a_crash():
    pytest.importorskip("mlir.ir")
    with WorkerPool(1) as p:
        r = p.run(mlir_abort_job, (), timeout_s=60)
        assert r.error_kind is ErrorKind.CRASH, r
        assert "SIGABRT" in r.error_msg
        assert "did you intend to nest?" in r.error_msg
        r = p.run(mlir_ok_job, (), timeout_s=60)
        assert r.ok and r.value == 1, r


def _hog_memory(mb: int) -> int:
    import time as _time

    blocks = [bytearray(2**20) for _ in range(mb)]
    _time.sleep(5)
    return len(blocks)


def test_memory_limit_kills_the_job_and_the_pool_goes_on():
    # The limit sits well above a worker that imported mlir_ansor (~200 MB).
    with WorkerPool(1, memory_limit_mb=800) as pool:
        res = pool.run(_hog_memory, (1500,), timeout_s=30)
        assert res.error_kind == ErrorKind.CRASH
        assert "memory limit exceeded" in res.error_msg
        assert pool.run(_hog_memory, (1,), timeout_s=30).value == 1
