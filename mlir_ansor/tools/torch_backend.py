"""A ``torch.compile`` backend: every graph dynamo captures, tuned and compiled by mlir-ansor.

Use::

    model = torch.compile(model, backend=mlir_ansor.torch_backend(db="model.db", trials=0))
    model = torch.compile(model, backend="mlir_ansor")          # the defaults: no database
    model = torch.compile(model, backend="mlir_ansor", options={"db": "model.db", "threads": 4})

Roadmap: :class:`TorchBackend` ``__call__`` ``(gm, example_inputs)`` is what
dynamo calls once per captured graph (graph breaks are dynamo's: each piece
between two breaks is a graph of its own). It

1. checks that the graph is one we can run: every input a CPU tensor of a
   type we have, no gradient wanted (we compile inference graphs; under
   ``torch.no_grad()``, or with parameters that do not require grad);
2. imports it through torch-mlir's FX importer to Linalg on tensors
   (:func:`mlir_ansor.importers.pytorch.import_module`: ``torch.export`` of the
   graph, lowered in a child process, since torch-mlir's own MLIR cannot share
   ours); the graph's parameters and buffers (dynamo passes them as inputs)
   are compiled in as constants (``freeze``), as ``mlir-ansor import`` would;
3. tunes it first when ``trials`` asks for it: until the module's tasks hold
   ``trials`` records of this target and thread count in the database (so a
   second process with the same database tunes nothing);
4. compiles it with :func:`mlir_ansor.compile` (the database's best record per
   task, found by workload key; default schedules for the others), cached in
   this process by the hash of the imported text, the thread count and the
   database path: the same graph is compiled once;
5. returns a callable that takes and returns torch tensors, through numpy
   views (``.numpy()``, ``torch.from_numpy``; bf16 as int16 views), so
   C-contiguous, aligned inputs of the compiled types are not copied, nor are
   outputs.

A graph of dynamic sizes (``torch.compile(..., dynamic=True)``, or the
graph dynamo traces again once it has seen a size change) is exported with
those dimensions dynamic where the graph lets them be (``torch.export``'s
``Dim.AUTO``: a dimension the graph fixes stays static, and those its ops
make equal are one symbol), so it compiles to a
`compiler.DynamicModule`: each size a call brings is compiled once, with the
database's records of that size or those of its nearest tuned size
(`search.transfer`); ``trials`` tunes it at the sizes of the inputs dynamo
passed. The sizes dynamo passes on their own (``torch.SymInt`` inputs) are
read from the tensors' shapes, and the Python numbers it passes as 0-d
tensors (a LayerNorm's ``eps``) are compiled in, checked at every call.

Any failure of steps 1-4 (an op torch-mlir or our compiler refuses, a size
that is an expression of others or that no tensor carries, a failed
lowering) makes that graph run eagerly (``gm.forward``), with one warning on
the ``mlir_ansor`` logger naming the reason; the backend never raises for a
graph.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlir_ansor.errors import AnsorError, InputError

__all__ = ["BACKEND_NAME", "TorchBackend", "clear_cache", "compiled_graphs", "mlir_ansor_backend", "torch_backend"]

log = logging.getLogger("mlir_ansor")

BACKEND_NAME = "mlir_ansor"
"""The name registered with dynamo: ``torch.compile(model, backend="mlir_ansor")``."""

_SUPPORTED = ("float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")
"""torch dtypes (their names) of inputs a compiled graph takes."""


@dataclass
class CacheStats:
    """What the in-process cache did: graphs compiled, graphs found compiled, graphs run eagerly."""

    compiled: int = 0
    hits: int = 0
    fallbacks: int = 0


_CACHE: dict[str, Any] = {}
_LOCK = threading.Lock()
stats = CacheStats()
"""The counters of this process (tests read them; `clear_cache` resets them)."""


def compiled_graphs() -> list[Any]:
    """The graphs compiled in this process (``CompiledModule``s: their
    `kernels` say which schedule each task got; a graph of dynamic sizes is
    a ``DynamicModule``), oldest first."""
    with _LOCK:
        return list(_CACHE.values())


def clear_cache() -> None:
    """Forget every compiled graph of this process and reset `stats`."""
    with _LOCK:
        for cm in _CACHE.values():
            cm.close()
        _CACHE.clear()
        stats.compiled = stats.hits = stats.fallbacks = 0


class _Fallback(Exception):
    """Why a graph runs eagerly (one line)."""


def _one_line(err: BaseException) -> str:
    """The reason an error gives, on one line: its first line and, for a
    child's traceback, the last line that names an error."""
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    if not lines:
        return type(err).__name__
    first = lines[0]
    if "error" in first.lower():
        return first[:400]
    named = [ln for ln in lines[1:] if "Error" in ln.split(":")[0] or ln.startswith("error:")]
    text = f"{first} {named[-1]}" if named else first
    return text[:400]


@dataclass
class TorchBackend:
    """A dynamo backend (``torch.compile(model, backend=TorchBackend(...))``).

    `db`: the records database (None: no database, every task gets its
    default schedule). `trials`: tune each graph until its tasks hold this
    many records for the target and thread count (0: never tune; needs a
    `db`). `threads`: the threads the kernels use. `config`: a
    ``TuneConfig`` for the tuning (its `trials` and `threads` are replaced by
    these). `target`: None for the host. `freeze`: compile the model's
    parameters and buffers in as constants (the compiler then folds their
    layout changes and packs them once, and the tasks are those
    ``mlir-ansor import``/``tune`` see); a weight changed in place after
    that makes its graph run eagerly (see `_Runner`). False: weights are
    arguments of the compiled function. `sizes`: where a graph of dynamic
    sizes is tuned, as ``tune --sizes`` takes them (``"0.1=16,64,128,384"``:
    dimension 1 of the graph's first tensor input that is not a weight; the
    powers of two between them are measured on carried schedules), instead
    of at the sizes of its first inputs; needs `trials`.
    """

    db: str | os.PathLike | None = None
    trials: int = 0
    threads: int = 1
    target: Any = None
    config: Any = None
    freeze: bool = True
    sizes: str | None = None
    _db_path: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.trials < 0:
            raise InputError(f"torch_backend: trials={self.trials}: expected 0 or more")
        if self.threads < 1:
            raise InputError(f"torch_backend: threads={self.threads}: expected 1 or more")
        if self.trials and self.db is None:
            raise InputError("torch_backend: trials > 0 needs a records database (db='model.db')")
        if self.sizes is not None:
            from mlir_ansor.graph.dynamic import parse_sizes

            parse_sizes(self.sizes)  # an InputError names a malformed one now, not at the first graph
            if not self.trials:
                raise InputError(f"torch_backend: sizes={self.sizes!r} says where to tune: it needs trials > 0")
        self._db_path = os.path.abspath(os.fspath(self.db)) if self.db is not None else None

    def __call__(self, gm: Any, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        name = f"#{stats.compiled + stats.hits + stats.fallbacks + 1}"
        try:
            run = self._compile(gm, list(example_inputs))
        except _Fallback as why:
            reason = str(why)
        except Exception as err:  # any import or compile failure: this graph runs eagerly
            reason = f"{type(err).__name__}: {_one_line(err)}"
            log.debug("torch backend: graph %s failed", name, exc_info=True)
        else:
            return run
        stats.fallbacks += 1
        log.warning("torch backend: graph %s (%d inputs) runs eagerly: %s", name, len(example_inputs), reason)
        return gm.forward

    # ---------------------------------------------------------------------

    def _compile(self, gm: Any, example_inputs: list[Any]) -> Callable[..., Any]:
        import torch

        from mlir_ansor.importers.pytorch import import_module

        shapes = _symbolic_shapes(torch, gm, example_inputs)
        _check_inputs(torch, example_inputs, shapes)
        n_out, single = _outputs(gm)
        frozen = _weights(torch, gm, example_inputs) if self.freeze else []
        scalars = _scalars(torch, gm, example_inputs)
        live = [i for i, t in enumerate(example_inputs)
                if i not in frozen and i not in scalars and isinstance(t, torch.Tensor)]
        sizes = _size_inputs(shapes, frozen, live)
        dynamic = sizes is not None
        tensors = tuple(example_inputs[i] for i in live)
        model = (_frozen(torch, gm, example_inputs, frozen, sizes or {}, scalars)
                 if frozen or sizes or scalars else gm)
        source_key = _graph_key(torch, gm, example_inputs, frozen, self.trials, shapes, scalars)
        key = hashlib.sha256(f"{source_key}\0{self.threads}\0{self._db_path}\0{self.sizes}".encode()).hexdigest()
        with _LOCK:
            cm = _CACHE.get(key)
            if cm is not None:
                stats.hits += 1
            else:
                cm = None if dynamic else self._cached(source_key)
                if cm is None:
                    text = self._imported(source_key) if dynamic else None
                    if text is None:
                        with _outside_dynamo(torch):
                            text = import_module(model, tensors, func_name="main",
                                                 dynamic_shapes=_export_dims(shapes, live) if dynamic else None)
                        if dynamic:
                            self._imported(source_key, text)
                    cm = self._build(text, source_key, tensors if dynamic else None)
                n_in, n_res = _arity(cm)
                if n_in != len(live) or n_res != n_out:
                    cm.close()
                    raise _Fallback(
                        f"the compiled function takes {n_in} and returns {n_res} value(s); "
                        f"the graph takes {len(live)} (besides its weights and sizes) and returns {n_out}"
                    )
                _CACHE[key] = cm
                stats.compiled += 1
        return _Runner(cm, n_out, single, live, {i: _stamp(example_inputs[i]) for i in frozen}, gm.forward, scalars)

    def _cached(self, source_key: tuple[str, str]):
        """The graph's whole compile from the compile cache (an earlier
        process compiled it with this database): no import, no compile."""
        from mlir_ansor.compiler import cached_compile
        from mlir_ansor.target import Target

        cm = cached_compile(source_key, db=self._db_path, threads=self.threads, target=self.target or Target.host())
        if cm is not None:
            log.info("torch backend: graph %s comes from the compile cache", source_key[0][:16])
        return cm

    def _imported(self, source_key: tuple[str, str], text: str | None = None) -> str | None:
        """The imported text of a graph of dynamic sizes, from the compile
        cache (`text`: store it there). Its compile is a `DynamicModule`,
        which the cache does not keep whole (its sizes' compiles are kept
        one by one), so a later process would import it again: torch-mlir
        took 4 s of the BERT layer's first call."""
        from mlir_ansor.passes.compile_cache import CompileCache, cache_for

        cache = cache_for(None, self._db_path)
        if cache is None:
            return None
        key = CompileCache.key("import", *source_key)
        if text is not None:
            cache.put("import", key, ".mlir", text.encode())
            return text
        data = cache.get("import", key, ".mlir")
        if data is None:
            return None
        log.info("torch backend: graph %s's import comes from the compile cache", source_key[0][:16])
        return data.decode()

    def _build(self, text: str, source_key: tuple[str, str] | None = None, example: tuple | None = None):
        """The compiled module of the imported `text`; a graph of dynamic
        sizes (`example`: the inputs dynamo passed) gives a
        `compiler.DynamicModule` (a static specialization compiled per size a
        call brings), tuned at the sizes of `example`: the other sizes take
        the schedules of their nearest tuned size (`search.transfer`)."""
        from mlir_ansor.compiler import DynamicModule
        from mlir_ansor.compiler import compile as compile_module
        from mlir_ansor.ir.program import load
        from mlir_ansor.target import Target

        target = self.target or Target.host()
        if example is None:
            if self.trials:
                self._tune(text, target)
            return compile_module(load(text=text), db=self._db_path, threads=self.threads, target=target,
                                  source_key=source_key)
        cm = compile_module(load(text=text), db=self._db_path, threads=self.threads, target=target)
        if not isinstance(cm, DynamicModule):
            raise _Fallback("the graph's dynamic sizes did not reach the compiled function")
        if self.trials and self.sizes:
            from mlir_ansor.dispatch import sizes_to_tune
            from mlir_ansor.graph.dynamic import parse_sizes

            sized, _, carry = sizes_to_tune(text, parse_sizes(self.sizes), func="main")
            self._tune(sized, target, carry)
        elif self.trials:
            self._tune(cm.text_at(*[_to_numpy(t) for t in example]), target)
        return cm

    def _tune(self, text: str, target: Any, carry: tuple[str, ...] | None = None) -> None:
        """Tune until the module's tasks hold `trials` records of this target
        and thread count (what an earlier run measured counts). `carry`: the
        functions of sizes between tuned ones (`TuneConfig.carry`)."""
        import dataclasses

        from mlir_ansor.ir.program import load
        from mlir_ansor.records.database import Database
        from mlir_ansor.search.tasks import tasks_for
        from mlir_ansor.tuner import TuneConfig, tune

        have = 0
        if self._db_path and os.path.exists(self._db_path):
            # The tasks as `tune` extracts them (the target's weight panels
            # and row merges), so their keys are the records' keys.
            keys = {t.workload_key for t in tasks_for(load(text=text), target)}
            with Database(self._db_path, readonly=True) as db:
                have = sum(
                    1
                    for k in keys
                    for r in db.records(k, target.key)
                    if r.threads == self.threads and not r.retime
                )
        if have >= self.trials:
            log.info("torch backend: the database holds %d record(s) of this graph's tasks; no tuning", have)
            return
        config = dataclasses.replace(self.config or TuneConfig(), trials=self.trials - have, threads=self.threads)
        if carry is not None:
            config = dataclasses.replace(config, carry=carry)
        tune(load(text=text), target=target, config=config, db=self._db_path)


def _outside_dynamo(torch: Any):
    """A context without dynamo's tracing context, for ``torch.export``
    inside a backend call: an export of dynamic sizes there adds its guards
    to the graph dynamo is compiling ("Guard failed on the same frame it was
    created")."""
    import contextlib

    tracing = getattr(getattr(torch, "_guards", None), "tracing", None)
    return tracing(None) if tracing is not None else contextlib.nullcontext()


def _check_inputs(torch: Any, example_inputs: list[Any], shapes: list[Any]) -> None:
    """Inputs we can run: CPU tensors of the types we have, and the sizes
    dynamo made dynamic (`shapes`: :func:`_symbolic_shapes`)."""
    for i, t in enumerate(example_inputs):
        if isinstance(shapes[i], str):  # a dynamic size (s0): :func:`_size_inputs` finds it in a tensor's shape
            continue
        if not isinstance(t, torch.Tensor):
            raise _Fallback(
                f"input {i} is a {type(t).__name__} ({t!r}), not a tensor or a dynamic size of one; "
                "torch.compile(..., dynamic=False) compiles one static graph per value instead"
            )
        if t.device.type != "cpu":
            raise _Fallback(f"input {i} is on {t.device}; mlir-ansor compiles for the CPU")
        if str(t.dtype).removeprefix("torch.") not in _SUPPORTED:
            raise _Fallback(f"input {i} is {t.dtype}, a type the compiled module cannot take")
        if any(not isinstance(s, int) for s in t.shape):
            raise _Fallback(f"input {i} has no concrete shape ({tuple(t.shape)})")
        if t.requires_grad and torch.is_grad_enabled():
            raise _Fallback(
                "the graph needs gradients (an input requires grad); mlir-ansor compiles inference: "
                "run it under torch.no_grad() or torch.inference_mode()"
            )


def _symbolic_shapes(torch: Any, gm: Any, example_inputs: list[Any]) -> list[Any]:
    """What dynamo traced each input as, one entry per input: for a tensor,
    its shape, each dimension an int or the name of the symbol dynamo made
    it (``"s0"``: a size that varies from call to call, under
    ``torch.compile(..., dynamic=True)`` or once dynamo has seen two); for a
    size passed on its own (a ``torch.SymInt``), its symbol's name; None
    for anything else. A dimension that is an expression of symbols
    (``2*s0``) makes the graph run eagerly."""
    nodes = _placeholders(gm, example_inputs)
    if nodes is None:
        return [None if isinstance(t, torch.SymInt) else _static_shape(torch, t) for t in example_inputs]

    def name(v: Any, what: str) -> Any:
        if not isinstance(v, torch.SymInt):
            return int(v)
        expr = v.node.expr
        if getattr(expr, "is_Symbol", False):
            return str(expr)
        if getattr(expr, "is_Integer", False):
            return int(expr)
        raise _Fallback(f"{what} is {expr}, an expression of dynamic sizes: only sizes of their own "
                        "compile (torch.compile(..., dynamic=False) compiles one static graph per shape)")

    out: list[Any] = []
    for i, (node, t) in enumerate(zip(nodes, example_inputs)):
        v = node.meta.get("example_value")
        if isinstance(v, torch.SymInt):
            out.append(name(v, f"input {i}"))
        elif isinstance(v, torch.Tensor):
            out.append(tuple(name(s, f"dimension {d} of input {i}") for d, s in enumerate(v.shape)))
        else:
            out.append(_static_shape(torch, t))
    return out


def _placeholders(gm: Any, example_inputs: list[Any]) -> list[Any] | None:
    """The graph's input nodes, one per example input (None where they do not pair up)."""
    nodes = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return nodes if len(nodes) == len(example_inputs) else None


def _static_shape(torch: Any, t: Any) -> Any:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def _scalars(torch: Any, gm: Any, example_inputs: list[Any]) -> dict[int, float | int | bool]:
    """The Python numbers dynamo passes as 0-d tensors (a float it did not
    specialize, such as a LayerNorm's ``eps`` under ``dynamic=True``),
    input index -> value: they are compiled in as constants (``torch.export``
    cannot trace the ``.item()`` the graph reads them with), and a call that
    brings another value runs eagerly (:class:`_Runner`)."""
    nodes = _placeholders(gm, example_inputs)
    if nodes is None:
        return {}
    return {
        i: t.item()
        for i, (node, t) in enumerate(zip(nodes, example_inputs))
        if getattr(node.meta.get("grapharg"), "pass_arg_as_tensor", False)
        and isinstance(t, torch.Tensor) and t.dim() == 0
    }


def _size_inputs(shapes: list[Any], frozen: list[int], live: list[int]) -> dict[int, tuple[int, int]] | None:
    """Where each dynamic size passed on its own is read at run time: input
    index -> (position among the `live` tensors, dimension), the first
    tensor dimension of the same symbol; None for a graph of static shapes.
    The compiled module takes tensors only, so a size no tensor carries (a
    Python int made dynamic) makes the graph run eagerly."""
    symbolic = [i for i, s in enumerate(shapes) if isinstance(s, str)]
    if not symbolic and not any(isinstance(d, str) for s in shapes if isinstance(s, tuple) for d in s):
        return None
    for i in frozen:
        if any(isinstance(d, str) for d in shapes[i]):
            raise _Fallback(f"weight input {i} has a dynamic shape {shapes[i]}")
    where: dict[str, tuple[int, int]] = {}
    for k, i in enumerate(live):
        for d, sym in enumerate(shapes[i]):
            if isinstance(sym, str):
                where.setdefault(sym, (k, d))
    sizes = {}
    for i in symbolic:
        if shapes[i] not in where:
            raise _Fallback(
                f"input {i} is a dynamic integer ({shapes[i]}) that no tensor's shape carries; the compiled "
                "module takes tensors only (torch.compile(..., dynamic=False) compiles one graph per value)"
            )
        sizes[i] = where[shapes[i]]
    return sizes


def _export_dims(shapes: list[Any], live: list[int]) -> tuple:
    """``torch.export``'s ``dynamic_shapes`` for the frozen graph's
    ``forward(*live)``: ``Dim.AUTO`` for each dimension dynamo made
    dynamic (a symbol in `shapes`: :func:`_symbolic_shapes`). Export keeps it dynamic, or static where the graph fixes it
    (``dynamic=True`` makes a CNN's height dynamic, which the linear head's
    input size then fixes: a named ``Dim`` there is an error), and ties the
    dimensions the ops make equal (one symbol of the compiled function)."""
    from torch.export import Dim

    return (tuple({d: Dim.AUTO for d, s in enumerate(shapes[i]) if isinstance(s, str)} or None for i in live),)


def _arity(cm: Any) -> tuple[int, int]:
    """(arguments, results) of the compiled module's entry function."""
    if hasattr(cm, "functions"):
        ins, outs, _ = cm.functions[cm.entry]
        return len(ins), len(outs)
    return cm.n_args, cm.n_results


def _outputs(gm: Any) -> tuple[int, bool]:
    """(how many values the graph returns, whether it returns one value, not a tuple)."""
    (node,) = [n for n in gm.graph.nodes if n.op == "output"]
    out = node.args[0]
    if isinstance(out, (tuple, list)):
        for v in out:
            if getattr(v, "op", None) is None:
                raise _Fallback(f"the graph returns {v!r}, not only tensors")
        return len(out), False
    return 1, True


def _weights(torch: Any, gm: Any, example_inputs: list[Any]) -> list[int]:
    """Indices of the graph's inputs that are the model's weights: its
    parameters, and its buffers (dynamo names their placeholders
    ``..._buffers_...``)."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    if len(names) != len(example_inputs):
        return []
    return [
        i
        for i, (t, name) in enumerate(zip(example_inputs, names))
        if isinstance(t, torch.nn.Parameter) or "_buffers_" in name
    ]


def _frozen(torch: Any, gm: Any, example_inputs: list[Any], frozen: list[int], sizes: dict[int, tuple[int, int]],
            scalars: dict[int, Any]):
    """`gm` with the inputs `frozen` held as buffers: ``torch.export`` then
    lifts them as constants, which torch-mlir imports as weights
    (``dense_resource``), so the compiler folds their layout changes and packs
    them once. It takes the other tensors only: a dynamic size passed on its
    own is read from a tensor's shape (`sizes`: :func:`_size_inputs`), which
    ``torch.export`` traces as the symbol of that dimension; a number passed
    as a 0-d tensor (`scalars`) is a tensor made in ``forward``, whose
    ``.item()`` the trace knows."""

    class Frozen(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.graph_module = gm
            for i in frozen:
                self.register_buffer(f"weight_{i}", example_inputs[i].detach())

        def forward(self, *live):
            it = iter(live)
            args = [
                getattr(self, f"weight_{i}") if i in frozen
                else live[sizes[i][0]].shape[sizes[i][1]] if i in sizes
                else torch.tensor(scalars[i], dtype=example_inputs[i].dtype) if i in scalars
                else next(it)
                for i in range(len(example_inputs))
            ]
            return self.graph_module(*args)

    return Frozen()


def _graph_key(torch: Any, gm: Any, example_inputs: list[Any], frozen: list[int], trials: int,
               shapes: list[Any], scalars: dict[int, Any]) -> tuple[str, str]:
    """What decides the module torch-mlir imports for a graph, before
    importing it (a ResNet-50 takes half a minute), as the compile cache's
    ``source_key``: a name, the SHA-256 of the graph's code and modules, its
    inputs' types (a dynamic dimension by its symbol, `shapes`), which inputs
    are frozen, the numbers compiled in (`scalars`), `trials` (a graph tuned
    to more records is another compile) and the versions of torch and
    torch-mlir;
    and a digest, that name with the bytes of the frozen weights and of the
    graph's own parameters and buffers (one compile is kept per name: new
    weights replace the old)."""
    from importlib.metadata import PackageNotFoundError, version

    versions = []
    for dist in ("torch", "torch-mlir"):
        try:
            versions.append(f"{dist} {version(dist)}")
        except PackageNotFoundError:
            versions.append(f"{dist} -")
    name = hashlib.sha256()
    for part in (gm.code, repr(gm), repr(frozen), repr(sorted(scalars.items())), str(trials), *versions):
        name.update(part.encode())
        name.update(b"\0")
    for t, shape in zip(example_inputs, shapes):
        if not isinstance(t, torch.Tensor):
            name.update(f"size {shape}\0".encode())
        elif shape == tuple(t.shape):
            name.update(f"{t.dtype} {tuple(t.shape)} {t.stride()}\0".encode())
        else:  # dynamic: the strides follow the sizes
            name.update(f"{t.dtype} {shape}\0".encode())
    digest = hashlib.sha256(name.digest())
    tensors = [example_inputs[i] for i in frozen] + [t for _, t in sorted(gm.state_dict().items())]
    for t in tensors:
        t = t.detach().contiguous().reshape(-1)
        digest.update(f"{t.dtype} {t.numel()}\0".encode())
        if t.numel():
            digest.update(memoryview(t.view(torch.uint8).numpy()))
    return name.hexdigest(), digest.hexdigest()


def _stamp(t: Any) -> tuple[int, int]:
    """What changes when a weight is changed or replaced: its storage and its version counter."""
    try:
        version = t._version
    except RuntimeError:  # a tensor made under torch.inference_mode() has no version counter
        version = -1
    return t.data_ptr(), version


class _Runner:
    """A compiled graph as dynamo calls it: tensors (and the sizes dynamo
    made dynamic, which the compiled module reads from the tensors' shapes)
    in, a tuple of tensors out. The weights compiled in are not passed to the
    library; if one was changed in place since (an optimizer step,
    ``load_state_dict``), the graph runs eagerly from then on, with one
    warning. So does a call that brings another value of a number compiled
    in (`scalars`), and one at sizes a graph of dynamic sizes cannot be
    compiled at (each size is compiled on its first call)."""

    def __init__(self, cm: Any, n_out: int, single: bool, live: list[int], stamps: dict, eager: Callable,
                 scalars: dict | None = None) -> None:
        self.cm = cm
        self.n_out = n_out
        self.single = single
        self.live = live
        self.stamps = stamps
        self.scalars = scalars or {}
        self.eager: Callable | None = None
        self._eager = eager

    def __call__(self, *args: Any) -> Any:
        if self.eager is not None:
            return self.eager(*args)
        for i, stamp in self.stamps.items():
            if _stamp(args[i]) != stamp:
                return self._go_eager(args, f"a weight compiled into a graph (input {i}) has changed since")
        for i, value in self.scalars.items():
            if args[i].item() != value:
                return self._go_eager(args, f"a number compiled into a graph (input {i}, {value!r}) is "
                                            f"{args[i].item()!r} in this call")
        try:
            results = self.cm(*[_to_numpy(args[i]) for i in self.live])
        except AnsorError as err:
            from mlir_ansor.compiler import DynamicModule

            if not isinstance(self.cm, DynamicModule):
                raise
            # A graph of dynamic sizes compiles each size on its first call.
            return self._go_eager(args, f"the graph could not be compiled at these sizes ({err})")
        if results is None:
            results = ()
        elif not isinstance(results, tuple):
            results = (results,)
        outs = tuple(_to_torch(a) for a in results)
        return outs[0] if self.single else outs

    def _go_eager(self, args: tuple, why: str) -> Any:
        log.warning("torch backend: %s; the graph runs eagerly from now on (torch._dynamo.reset() compiles it "
                    "again, with the new values)", why)
        self.eager = self._eager
        return self.eager(*args)


def _to_numpy(t: Any):
    """A numpy view of a CPU tensor (bf16 as ``ml_dtypes.bfloat16``, through an int16 view)."""
    import torch

    t = t.detach()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _to_torch(a: Any):
    """A tensor over the numpy array `a`, without a copy (bf16 through an int16 view)."""
    import numpy as np
    import torch

    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def torch_backend(
    *,
    db: str | os.PathLike | None = None,
    trials: int = 0,
    threads: int = 1,
    target: Any = None,
    config: Any = None,
    freeze: bool = True,
    sizes: str | None = None,
) -> TorchBackend:
    """A backend for ``torch.compile(model, backend=...)`` (see :class:`TorchBackend`)."""
    return TorchBackend(db=db, trials=trials, threads=threads, target=target, config=config, freeze=freeze,
                        sizes=sizes)


def mlir_ansor_backend(gm: Any, example_inputs: Sequence[Any], *, options: dict | None = None, mode: str | None = None):
    """The backend registered as ``"mlir_ansor"``: ``torch.compile(model,
    backend="mlir_ansor", options={"db": ..., "trials": ..., "threads": ...})``
    (`mode` is ignored)."""
    return TorchBackend(**(options or {}))(gm, example_inputs)


def register() -> None:
    """Register :func:`mlir_ansor_backend` with dynamo as ``"mlir_ansor"``
    (done when this module is imported; the package's entry point in the
    ``torch_dynamo_backends`` group finds it without an import)."""
    from importlib.metadata import entry_points

    if entry_points(group="torch_dynamo_backends", name=BACKEND_NAME):
        return  # dynamo loads it through the entry point (registering it here too would be a duplicate)
    try:
        from torch._dynamo import register_backend
    except ImportError:  # no torch: nothing to register with
        return
    try:
        register_backend(mlir_ansor_backend, name=BACKEND_NAME)
    except AssertionError:  # registered already, by an earlier import
        pass


register()
