"""The Ray executor: builds on any node of a Ray cluster, measures on one reserved runner.

See `measure.executor` for the interface; `measurer.make_executor` makes one
for the specs ``auto`` and ``ray://HOST:PORT``.

* Builder tasks ask for one CPU and run on any node; the library's bytes stay
  in the object store of the node that built it until the runner fetches
  them. The runner is one actor (a warm process, like the local runner
  process) whose CPUs (and a GPU, or a custom resource) a one-bundle
  placement group reserves, so measurement never waits behind builds and
  builds use the other CPUs of the cluster, as the local pool leaves the
  runner its cores.
* Every measurement carries the CPU model (or GPU name) of the host that ran
  it (``Outcome.host``): records are compared only between machines of the
  same kind.
* A task lost with its worker or node (WorkerCrashedError, NodeDiedError,
  ObjectLostError, ...) is logged, counted in :attr:`RayExecutor.lost`, and
  submitted again, spread to other nodes, up to ``max_retries`` times; a
  library or reference lost with its node is made again first, and a lost
  runner actor is replaced by a fresh one. Only when every
  attempt is lost does the candidate get a recorded ``crash``. A tuning run
  is never lost to a node.

The node side (the functions and the `_Runner` actor that run inside Ray
worker processes) comes first, then the driver side (:class:`RayExecutor`).
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlir_ansor.errors import AnsorError
from mlir_ansor.measure import jobs
from mlir_ansor.measure.executor import (
    BuildJob,
    Executor,
    Outcome,
    ReferenceJob,
    RunJob,
    host_model,
    worker_env,
)
from mlir_ansor.measure.pool import ErrorKind, JobResult, WorkerPool
from mlir_ansor.measure.runner import TimingPolicy

__all__ = ["LOCAL_RAY_CONFIG", "RayExecutor"]

log = logging.getLogger("mlir_ansor")

# Settings of a Ray instance that this package starts on one machine (the
# tests and benchmarks use them too): workers at normal priority, as the
# local pool's (Ray's default niceness 15 makes a measured kernel lose its
# core to any other process), and no node-wide memory monitor, which kills
# Ray workers when the machine is full for any reason (other people's jobs
# on a shared machine); the isolated subprocesses keep `memory_limit_mb`.
LOCAL_RAY_CONFIG: dict[str, Any] = {"worker_niceness": 0, "memory_monitor_refresh_ms": 0}

# Extra seconds the driver waits for a Ray run task beyond the job's own time
# limit (which the node-side subprocess enforces): a fresh Ray worker starts
# its isolated subprocess and imports MLIR first.
_RAY_SLACK_S = 120.0


# --------------------------------------------------------------------------
# The node side (these run inside Ray worker processes)

_NODE_LOCK = threading.Lock()
_NODE_POOLS: dict[tuple, WorkerPool] = {}
_NODE_DIR: list[str] = []
_NODE_DATA: dict[str, str] = {}  # reference data key -> local .npz


_NODE_PREFIX = "mlir-ansor-ray-"


def _node_dir() -> str:
    """This Ray worker's scratch folder. Ray ends its workers without running
    `atexit`, so each new one also removes the folders of dead ones."""
    with _NODE_LOCK:
        if not _NODE_DIR:
            tmp = tempfile.gettempdir()
            for name in os.listdir(tmp):
                pid = name[len(_NODE_PREFIX) :].split("-", 1)[0]
                if name.startswith(_NODE_PREFIX) and pid.isdigit() and not _alive(int(pid)):
                    shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
            d = tempfile.mkdtemp(prefix=f"{_NODE_PREFIX}{os.getpid()}-")
            atexit.register(shutil.rmtree, d, True)
            _NODE_DIR.append(d)
        return _NODE_DIR[0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # someone else's process
    return True


def _node_pool(role: str, threads: int, memory_limit_mb: int | None) -> WorkerPool:
    """One isolated subprocess per Ray worker process, role ("build" or
    "run") and settings, kept warm across tasks: it has MLIR imported
    already. A runner's is started after `_runner_priority`."""
    key = (role, threads, memory_limit_mb)
    with _NODE_LOCK:
        pool = _NODE_POOLS.get(key)
        if pool is None:
            pool = WorkerPool(1, env=worker_env(threads), max_jobs_per_worker=200, memory_limit_mb=memory_limit_mb)
            _NODE_POOLS[key] = pool
        return pool


def _node_meta(r: JobResult, gpu: bool = False) -> dict:
    import ray

    return {
        "value": r.value,
        "error_kind": r.error_kind.value,
        "error_msg": r.error_msg,
        "elapsed_s": r.elapsed_s,
        "host": _node_host(gpu),
        "node": ray.get_runtime_context().get_node_id(),
        "pid": os.getpid(),
    }


_HOSTS: dict[bool, str] = {}
_PRIORITY: list[str] = []


def _runner_priority() -> str:
    """Ray starts its workers at niceness 15 (below everything else on the
    node), and a kernel timed at that priority on a busy node is preempted:
    raise a runner back to niceness 0 before it starts its subprocess.
    Returns a warning when that is not permitted ("" when all is well)."""
    if not _PRIORITY:
        note = ""
        try:
            if os.getpriority(os.PRIO_PROCESS, 0) > 0:
                os.setpriority(os.PRIO_PROCESS, 0, 0)
        except OSError as e:
            note = (
                f"the runner stays at niceness {os.getpriority(os.PRIO_PROCESS, 0)} ({e.strerror}): its timings "
                "lose the CPU to every other process of the node; start the Ray nodes with "
                "RAY_worker_niceness=0 (e.g. `RAY_worker_niceness=0 ray start ...`)"
            )
        _PRIORITY.append(note)
    return _PRIORITY[0]


def _node_host(gpu: bool) -> str:
    if gpu not in _HOSTS:
        _HOSTS[gpu] = host_model(gpu)
    return _HOSTS[gpu]


def _read_and_remove(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def _warm() -> None:
    """A job that does nothing: unpickling it in a fresh subprocess imports
    this module, hence MLIR (what a first build would pay)."""


def _ray_warm(threads: int, mem: int | None) -> None:
    """Start a Ray worker's build subprocess and import MLIR in it, while
    the driver prepares the references (builds then start warm)."""
    _node_pool("build", threads, mem).run(_warm, (), timeout_s=300.0)


def _ray_build(
    fn: Callable, payload: str, script: str | None, threads: int, opt_level: int, timeout_s: float, mem: int | None
) -> tuple[dict, bytes]:
    """Build one candidate in this node's isolated subprocess; return the
    outcome and the library's bytes (empty on failure)."""
    path = os.path.join(_node_dir(), f"b{uuid.uuid4().hex}.so")
    r = _node_pool("build", threads, mem).run(fn, (payload, script, threads, path, opt_level), timeout_s=timeout_s)
    data = b""
    if r.ok:
        try:
            data = _read_and_remove(path)
        except OSError as e:
            r = JobResult(error_kind=ErrorKind.EXCEPTION, error_msg=f"the build wrote no library: {e}")
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)
    return _node_meta(r), data


class _Runner:
    """The measuring side on a Ray cluster: one actor (one process, placed
    in the runner's reservation) that keeps one isolated subprocess warm for
    the executor's lifetime, as the local runner pool does. The reference
    runs in it too, so one-time costs of a fresh process (the OpenMP
    runtime's start, a few milliseconds) never land on a candidate's
    checking run, and the reference data stays on its disk."""

    def __init__(self, threads: int, memory_limit_mb: int | None, gpu: bool) -> None:
        self.threads = threads
        self.mem = memory_limit_mb
        self.gpu = gpu
        self.note = _runner_priority()

    def probe(self) -> tuple[str, str, str]:
        """(host model, Ray node id, a warning about its priority or "")."""
        import ray

        return _node_host(self.gpu), ray.get_runtime_context().get_node_id(), self.note

    def reference(self, fn: Callable, job: ReferenceJob, timeout_s: float) -> tuple[dict, bytes]:
        """Compute a task's reference here; return the outcome and the data
        file's bytes (the file is kept here for the runs that follow)."""
        d = _node_dir()
        stem = os.path.join(d, f"ref{uuid.uuid4().hex}")
        args = (
            job.payload,
            [tuple(s) for s in job.inputs],
            [tuple(s) for s in job.outputs],
            job.seed,
            stem + ".so",
            stem + ".npz",
            job.threads,
            job.policy,
        )
        r = _node_pool("run", job.threads, self.mem).run(fn, args, timeout_s=timeout_s)
        with contextlib.suppress(OSError):
            os.unlink(stem + ".so")
        data = b""
        meta = _node_meta(r, self.gpu)
        if r.ok:
            with open(stem + ".npz", "rb") as f:
                data = f.read()
            key = hashlib.sha256(data).hexdigest()[:24]
            path = os.path.join(d, f"data-{key}.npz")
            os.replace(stem + ".npz", path)
            _NODE_DATA[key] = path
            meta["data_key"] = key
        return meta, data

    def run(
        self,
        fn: Callable,
        library: bytes,
        data_box: list,
        data_key: str,
        policy: TimingPolicy,
        tol: float,
        cutoff_s: float,
        timeout_s: float,
    ) -> dict:
        """Check and time one library here. The reference data comes boxed
        (Ray leaves it unresolved) and is fetched only when this process has
        not got it yet (a restarted runner)."""
        import ray

        d = _node_dir()
        data_path = _NODE_DATA.get(data_key)
        if data_path is None or not os.path.exists(data_path):
            blob = ray.get(data_box[0])
            data_path = os.path.join(d, f"data-{data_key}.npz")
            with open(data_path, "wb") as f:
                f.write(blob)
            _NODE_DATA[data_key] = data_path
        so_path = os.path.join(d, f"r{uuid.uuid4().hex}.so")
        with open(so_path, "wb") as f:
            f.write(library)
        try:
            pool = _node_pool("run", self.threads, self.mem)
            r = pool.run(fn, (so_path, data_path, policy, tol, cutoff_s), timeout_s=timeout_s)
        finally:
            with contextlib.suppress(OSError):
                os.unlink(so_path)
        return _node_meta(r, self.gpu)


# --------------------------------------------------------------------------
# The driver side


@dataclass
class _RayLibrary:
    """A built library in the object store, and the job that made it (to
    rebuild it if its node is lost before the run)."""

    job: BuildJob
    ref: Any


@dataclass
class _RayData:
    """A task's reference data in the object store (`key`: its hash), and
    the job that made it."""

    job: ReferenceJob
    ref: Any
    key: str
    timeout_s: float


@dataclass
class _Slot:
    """One job's attempts, and why the lost ones were lost."""

    attempts: int = 0
    lost: list[str] = field(default_factory=list)


def _require_ray():
    try:
        import ray
    except ImportError as e:
        raise AnsorError(
            f"the Ray executor needs Ray ({e}); install it with: pip install 'mlir-ansor[ray]' "
            "(or run with --executor local)"
        ) from None
    return ray


class RayExecutor(Executor):
    """Builds on any node of a Ray cluster, measures on one reserved runner.

    `address`: ``auto`` (the Ray instance this process already started, a
    running cluster found by Ray, or else a local instance started here) or
    ``ray://HOST:PORT`` (a Ray Client address). The cluster's nodes need
    mlir-ansor installed (same versions as here).
    `runner_resource`: the runner also asks for one unit of this custom
    resource (``ray start --resources='{"NAME": 1}'`` on the measuring
    nodes); `gpu`: it asks for a GPU (cuda targets).
    `max_retries`: submissions of a job lost with its worker or node.
    `build_workers`: at most this many builds in flight (default: as many as
    the cluster's free CPUs take).
    """

    def __init__(
        self,
        address: str = "auto",
        threads: int = 1,
        *,
        build_workers: int | None = None,
        overlap: bool = True,
        memory_limit_mb: int | None = None,
        runner_resource: str | None = None,
        gpu: bool = False,
        max_retries: int = 3,
        build_fn: Callable = jobs.build_candidate,
        run_fn: Callable = jobs.run_candidate,
        reference_fn: Callable = jobs.prepare_reference,
        placement_timeout_s: float = 120.0,
    ) -> None:
        ray = _require_ray()
        self._ray = ray
        self.threads = threads
        self.memory_limit_mb = memory_limit_mb
        self.gpu = gpu
        self.max_retries = max_retries
        self.build_fn, self.run_fn, self.reference_fn = build_fn, run_fn, reference_fn
        self.build_workers = build_workers
        self.lost: list[str] = []  # one line per attempt lost with a worker or node
        self._own_ray = False
        self._pg = None
        self._runner = None
        self._build_timeout_s = 120.0
        self._warming: list = []
        self._connect(address)
        try:
            self._setup(overlap, runner_resource, placement_timeout_s)
        except BaseException:
            self.close()
            raise

    def _connect(self, address: str) -> None:
        ray = self._ray
        if ray.is_initialized():
            return
        opts = {"log_to_driver": False, "logging_level": logging.WARNING}
        if address == "auto":
            try:
                ray.init(address="auto", **opts)
                return
            except ConnectionError:
                pass
            ray.init(include_dashboard=False, _system_config=LOCAL_RAY_CONFIG, **opts)
            self._own_ray = True
            return
        try:
            ray.init(address=address, **opts)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise AnsorError(
                f"--executor {address}: cannot connect to the Ray cluster ({e}); start one with "
                "`ray start --head` and pass ray://HEAD_IP:10001, or use --executor auto"
            ) from None

    def _setup(self, overlap: bool, runner_resource: str | None, placement_timeout_s: float) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle: dict[str, float] = {"CPU": float(self.threads)}
        if self.gpu:
            bundle["GPU"] = 1.0
        if runner_resource:
            bundle[runner_resource] = 1.0
        self._pg = placement_group([bundle], strategy="STRICT_PACK", name=f"mlir-ansor-runner-{uuid.uuid4().hex[:8]}")
        ready, _ = ray.wait([self._pg.ready()], timeout=placement_timeout_s)
        if not ready:
            raise AnsorError(
                f"no node of the Ray cluster offers the runner's resources {bundle} within "
                f"{placement_timeout_s:g} s; start one with e.g. `ray start --address=HEAD:6379 "
                + (f"--resources='{{\"{runner_resource}\": 1}}'" if runner_resource else f"--num-cpus={self.threads}")
                + "`, or lower --threads"
            )
        in_pg = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=0)
        total_cpus = float(ray.cluster_resources().get("CPU", 0.0))
        # Builds overlap runs only when CPUs are left outside the runner's
        # reservation; else they share the reservation, between runs.
        self._overlap = overlap and total_cpus - self.threads >= 1
        # The runner actor holds no CPU of its own: the reservation keeps the
        # bundle's CPUs for it (builds share them only without overlap, and
        # then never while it measures).
        runner_opts: dict[str, Any] = {"num_cpus": 0, "max_restarts": 0, "scheduling_strategy": in_pg}
        if self.gpu:
            runner_opts["num_gpus"] = 1
        if runner_resource:
            runner_opts["resources"] = {runner_resource: 1}
        self._runner_cls = ray.remote(_Runner).options(**runner_opts)
        self._runner = None
        build_opts: dict[str, Any] = {"num_cpus": 1, "max_retries": 0, "num_returns": 2}
        if not self._overlap:
            build_opts["scheduling_strategy"] = in_pg
        build = ray.remote(_ray_build)
        self._build = build.options(name="mlir_ansor.build", **build_opts)
        # A lost build goes again, spread over the nodes (the node it was on
        # may be gone, and is left out while it is).
        retry_opts = build_opts if not self._overlap else {**build_opts, "scheduling_strategy": "SPREAD"}
        self._build_retry = build.options(name="mlir_ansor.build", **retry_opts)
        if self._overlap:  # (without overlap they would disturb the baselines' timing)
            warm = ray.remote(_ray_warm).options(name="mlir_ansor.warm", **{**build_opts, "num_returns": 1})
            n = max(1, min(int(total_cpus - self.threads), 64))
            self._warming = [warm.remote(self.threads, self.memory_limit_mb) for _ in range(n)]
        self._host, self._node, note = ray.get(
            self._actor().probe.remote(), timeout=placement_timeout_s + _RAY_SLACK_S
        )
        if note:
            log.warning("Ray executor: %s", note)
        log.info(
            "Ray executor: %g CPUs in %d node(s); runner on %s (node %s)%s",
            total_cpus,
            len([n for n in ray.nodes() if n.get("Alive")]),
            self._host,
            self._node[:12],
            "" if self._overlap else "; builds wait for the runner (no CPU left outside its reservation)",
        )

    @property
    def host(self) -> str:
        return self._host

    @property
    def overlap(self) -> bool:
        return self._overlap

    # -- failures ------------------------------------------------------------

    def _lost_kind(self, exc: BaseException) -> str | None:
        """The failure's name when the attempt was lost with a worker, a node
        or an object (worth another attempt); None otherwise."""
        ex = self._ray.exceptions
        lost = (
            ex.WorkerCrashedError,
            ex.NodeDiedError,
            ex.ObjectLostError,
            ex.RayActorError,
            ex.LocalRayletDiedError,
            ex.OutOfMemoryError,
            ex.TaskCancelledError,
            ex.RaySystemError,
            ex.ObjectStoreFullError,
            ex.OutOfDiskError,
            ex.TaskPlacementGroupRemoved,
        )
        cause = getattr(exc, "cause", None) if isinstance(exc, ex.RayTaskError) else None
        for e in (exc, cause):
            if e is not None and isinstance(e, lost):
                return type(e).__name__
        return None

    def _object_lost(self, exc: BaseException) -> bool:
        ex = self._ray.exceptions
        cause = getattr(exc, "cause", None)
        return isinstance(exc, ex.ObjectLostError) or isinstance(cause, ex.ObjectLostError)

    def _note_lost(self, what: str, kind: str, exc: BaseException, slot: _Slot) -> None:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        msg = f"{what}: attempt {slot.attempts} lost ({kind}: {first[:300]})"
        slot.lost.append(msg)
        self.lost.append(msg)
        more = slot.attempts <= self.max_retries
        log.warning("Ray executor: %s%s", msg, "; submitting it again" if more else "; giving up")

    def _gave_up(self, slot: _Slot) -> Outcome:
        return Outcome(
            error_kind=ErrorKind.CRASH,
            error_msg=f"lost {slot.attempts} time(s) on the Ray cluster:\n" + "\n".join(slot.lost),
            retries=slot.attempts,
        )

    def _from_meta(self, meta: dict, slot: _Slot, artifact: Any = None) -> Outcome:
        kind = ErrorKind(meta["error_kind"])
        return Outcome(
            value=meta["value"],
            error_kind=kind,
            error_msg=meta["error_msg"],
            elapsed_s=meta["elapsed_s"],
            host=meta["host"],
            node=meta["node"],
            artifact=artifact if kind == ErrorKind.NONE else None,
            retries=slot.attempts - 1,
        )

    # -- builds ----------------------------------------------------------------

    def _submit_build(self, job: BuildJob, timeout_s: float, retry: bool) -> tuple[Any, Any]:
        remote = self._build_retry if retry else self._build
        return remote.remote(
            self.build_fn, job.payload, job.script, job.threads, job.opt_level, timeout_s, self.memory_limit_mb
        )

    def build(self, jobs: Sequence[BuildJob], timeout_s: float) -> list[Outcome]:
        ray = self._ray
        self._build_timeout_s = timeout_s
        out: list[Outcome | None] = [None] * len(jobs)
        slots = [_Slot() for _ in jobs]
        waiting = list(range(len(jobs)))
        waiting.reverse()
        inflight: dict[Any, tuple[int, Any]] = {}  # meta ref -> (index, library ref)
        cap = self.build_workers or len(jobs) or 1
        while waiting or inflight:
            while waiting and len(inflight) < cap:
                i = waiting.pop()
                slots[i].attempts += 1
                meta_ref, lib_ref = self._submit_build(jobs[i], timeout_s, slots[i].attempts > 1)
                inflight[meta_ref] = (i, lib_ref)
            done, _ = ray.wait(list(inflight), num_returns=1)
            for ref in done:
                i, lib_ref = inflight.pop(ref)
                try:
                    meta = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - classified below
                    kind = self._lost_kind(e)
                    if kind is None:
                        out[i] = Outcome(error_kind=ErrorKind.EXCEPTION, error_msg=f"Ray build task failed: {e}")
                        continue
                    self._note_lost(f"build of candidate {i + 1}/{len(jobs)}", kind, e, slots[i])
                    if slots[i].attempts <= self.max_retries:
                        waiting.append(i)
                    else:
                        out[i] = self._gave_up(slots[i])
                    continue
                log.debug("build %d on Ray worker %s", i, meta.get("pid"))
                out[i] = self._from_meta(meta, slots[i], _RayLibrary(jobs[i], lib_ref))
        return out  # type: ignore[return-value]

    # -- reference and runs ---------------------------------------------------

    def _actor(self):
        """The runner actor, started (again, after a loss) when needed."""
        if self._runner is None:
            self._runner = self._runner_cls.remote(self.threads, self.memory_limit_mb, self.gpu)
        return self._runner

    def _drop_actor(self) -> None:
        if self._runner is not None:
            with contextlib.suppress(Exception):
                self._ray.kill(self._runner)
            self._runner = None

    def _await(self, ref: Any, deadline_s: float) -> Any:
        """`ray.get` with a deadline; a runner past it is killed (a fresh one
        takes over) and the attempt counts as lost."""
        ready, _ = self._ray.wait([ref], timeout=deadline_s)
        if not ready:
            self._drop_actor()
            raise self._ray.exceptions.TaskCancelledError(
                None, f"no answer within {deadline_s:g} s (the job's limit plus {_RAY_SLACK_S:g} s); runner restarted"
            )
        return self._ray.get(ref)

    def _lost_runner(self, what: str, kind: str, e: BaseException, slot: _Slot) -> bool:
        """Note a lost attempt; True when another is allowed. A dead or
        unreachable runner actor is replaced by a fresh one (the placement
        group brings its reservation back on a live node)."""
        self._note_lost(what, kind, e, slot)
        if isinstance(e, self._ray.exceptions.RayActorError) or kind in ("RayActorError", "ActorDiedError"):
            self._drop_actor()
        return slot.attempts <= self.max_retries

    def prepare_reference(self, job: ReferenceJob, timeout_s: float) -> Outcome:
        slot = _Slot()
        while True:
            slot.attempts += 1
            meta_ref, data_ref = self._actor().reference.options(num_returns=2).remote(
                self.reference_fn, job, timeout_s
            )
            try:
                meta = self._await(meta_ref, timeout_s + _RAY_SLACK_S)
            except Exception as e:  # noqa: BLE001 - classified below
                kind = self._lost_kind(e)
                if kind is None:
                    return Outcome(error_kind=ErrorKind.EXCEPTION, error_msg=f"Ray reference task failed: {e}")
                if not self._lost_runner("reference", kind, e, slot):
                    return self._gave_up(slot)
                continue
            self._check_host(meta)
            data = _RayData(job, data_ref, meta.get("data_key", ""), timeout_s)
            return self._from_meta(meta, slot, data)

    def run(self, job: RunJob, timeout_s: float) -> Outcome:
        lib: _RayLibrary = job.artifact
        data: _RayData = job.data
        slot = _Slot()
        while True:
            slot.attempts += 1
            ref = self._actor().run.remote(
                self.run_fn, lib.ref, [data.ref], data.key, job.policy, job.tol, job.cutoff_s, timeout_s
            )
            try:
                meta = self._await(ref, timeout_s + _RAY_SLACK_S)
            except Exception as e:  # noqa: BLE001 - classified below
                kind = self._lost_kind(e)
                if kind is None:
                    return Outcome(error_kind=ErrorKind.EXCEPTION, error_msg=f"Ray run task failed: {e}")
                if not self._lost_runner("run", kind, e, slot):
                    return self._gave_up(slot)
                if self._object_lost(e) and not self._recover(lib, data, slot):
                    return self._gave_up(slot)
                continue
            self._check_host(meta)
            log.debug("run on Ray worker %s", meta.get("pid"))
            return self._from_meta(meta, slot)

    def _available(self, ref: Any) -> bool:
        try:
            self._ray.get(ref, timeout=_RAY_SLACK_S)
            return True
        except Exception:  # noqa: BLE001 - lost with its node (or unreachable)
            return False

    def _recover(self, lib: _RayLibrary, data: _RayData, slot: _Slot) -> bool:
        """Make again what a lost node took with it: the library (rebuilt)
        and the reference data (recomputed: same seed, same inputs)."""
        if not self._available(lib.ref):
            (built,) = self.build([lib.job], timeout_s=self._build_timeout_s)
            if not built.ok:
                slot.lost.append(f"rebuilding the lost library failed: {built.error_kind.value}")
                return False
            lib.ref = built.artifact.ref
        if not self._available(data.ref):
            ref = self.prepare_reference(data.job, data.timeout_s)
            if not ref.ok:
                slot.lost.append(f"recomputing the lost reference failed: {ref.error_kind.value}")
                return False
            data.ref, data.key = ref.artifact.ref, ref.artifact.key
        return True

    def _check_host(self, meta: dict) -> None:
        if meta["host"] != self._host:
            log.warning(
                "Ray executor: the runner moved from %s to %s (node lost?); records carry the new host",
                self._host,
                meta["host"],
            )
            self._host = meta["host"]

    def release(self, artifact: Any) -> None:
        if isinstance(artifact, _RayLibrary):
            artifact.ref = None  # dropping the last reference frees the object

    def close(self) -> None:
        ray = self._ray
        if ray.is_initialized():
            self._drop_actor()
        if self._pg is not None and ray.is_initialized():
            with contextlib.suppress(Exception):
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self._pg)
            self._pg = None
        if self._own_ray and ray.is_initialized():
            ray.shutdown()
            self._own_ray = False
