"""Public registries: sketch rules, cost models, search strategies and task
schedulers, selected by name from the API (`TuneConfig`) and the command line.

Roadmap: the four ``register_*`` functions add an implementation under a
name; the ``make_*`` / :func:`sketch_rules` functions look names up (the
tuner calls them); :func:`load_plugin` imports a module that registers
things (``mlir-ansor tune --plugin MODULE``); :func:`discover_plugins` loads
every installed package that declares an entry point in the group
``mlir_ansor.plugins`` (done once, on the first lookup), so a pip-installed
plugin registers itself::

    # the plugin's pyproject.toml
    [project.entry-points."mlir_ansor.plugins"]
    my_rules = "my_package.ansor_plugin"          # a module that registers on import
    my_model = "my_package.models:register"       # or a function called with no arguments

What each registry holds (``docs/extending.md`` has a worked example of each):

* rules: :class:`~mlir_ansor.search.rules.Rule` *instances*, in priority order
  (``before=`` inserts ahead of a named rule; by default a new rule goes
  last): the CPU rules, then the GPU rules, then plugins'. One list serves
  both kinds of target: each rule's condition reads ``ctx.target`` (the CPU
  rules skip a cuda target, the GPU rules a CPU). The default schedules
  (``cpu-default``, ``cuda-default``) are not in this list: the target's is
  always appended, so every task keeps a sound sketch.
* cost models: ``factory(config: TuneConfig) -> CostModel``.
* search strategies: ``factory(config: TuneConfig) -> SearchStrategy`` (one
  instance per task).
* task schedulers: ``factory(n_tasks: int, config: TuneConfig) -> scheduler``,
  where the scheduler has ``choose(stats, exhausted) -> Choice | None`` (see
  :class:`~mlir_ansor.search.task_scheduler.BaseTaskScheduler`).

Why module-level tables and not a plugin manager object: a researcher's
script registers with one call before calling `tune`, and worker processes
never need the registries (they receive concrete scripts, not rules).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from mlir_ansor.errors import AnsorError

log = logging.getLogger("mlir_ansor")

ENTRY_POINT_GROUP = "mlir_ansor.plugins"

_RULES: dict[str, Any] = {}  # name -> Rule, in priority order (dicts keep insertion order)
_COST_MODELS: dict[str, Callable[[Any], Any]] = {}
_TASK_SCHEDULERS: dict[str, Callable[[int, Any], Any]] = {}
_STRATEGIES: dict[str, Callable[[Any], Any]] = {}
_builtins_loaded = False
_plugins_loaded = False
_plugin_errors: list[str] = []

__all__ = [
    "ENTRY_POINT_GROUP",
    "cost_models",
    "default_rule_names",
    "discover_plugins",
    "isolated",
    "load_plugin",
    "make_cost_model",
    "make_strategy",
    "make_task_scheduler",
    "register_cost_model",
    "register_rule",
    "register_strategy",
    "register_task_scheduler",
    "rules",
    "sketch_rules",
    "strategies",
    "task_schedulers",
    "unregister",
]


# ----------------------------------------------------------------- built-ins


def _strategies() -> dict[str, Callable[[Any], Any]]:
    _load_builtins()
    return _STRATEGIES


def _evolutionary(config: Any) -> Any:
    """Evolutionary search with the cost model named by ``config.cost_model``
    (loaded from ``config.pretrained_model`` when set) and the settings of
    ``config.evolution``."""
    import dataclasses

    from mlir_ansor.search.strategy import EvolutionarySearch, EvolutionConfig

    evo = getattr(config, "evolution", None) or EvolutionConfig()
    evo = dataclasses.replace(evo, max_tries=config.max_sample_tries)
    pretrained = bool(getattr(config, "pretrained_model", None))
    return EvolutionarySearch(evo, model=make_cost_model(config), pretrained=pretrained)


def _random_search(config: Any) -> Any:
    from mlir_ansor.search.strategy import RandomSearch

    return RandomSearch(max_tries=config.max_sample_tries)


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    from mlir_ansor.search.cost_model import RandomModel, XGBModel
    from mlir_ansor.search.rules import CPU_RULES, GPU_RULES
    from mlir_ansor.search.task_scheduler import RandomTaskScheduler, TaskScheduler

    for rule in [*CPU_RULES, *GPU_RULES]:
        _RULES.setdefault(rule.name, rule)
    _STRATEGIES.setdefault("random", _random_search)
    _STRATEGIES.setdefault("evolutionary", _evolutionary)
    _COST_MODELS.setdefault("xgb", lambda config: XGBModel(seed=config.seed))
    _COST_MODELS.setdefault("random", lambda config: RandomModel(seed=config.seed))
    _TASK_SCHEDULERS.setdefault(
        "gradient", lambda n, config: TaskScheduler(n, strategy="gradient", seed=config.seed)
    )
    _TASK_SCHEDULERS.setdefault(
        "round-robin", lambda n, config: TaskScheduler(n, strategy="round-robin", seed=config.seed)
    )
    _TASK_SCHEDULERS.setdefault("random", lambda n, config: RandomTaskScheduler(n, seed=config.seed))


def _ready() -> None:
    _load_builtins()
    discover_plugins()


# -------------------------------------------------------------- registering


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or "," in name or name != name.strip():
        raise AnsorError(f"registry name {name!r}: expected a non-empty name without commas or outer spaces")


def register_rule(name: str, rule: Any, *, before: str | None = None, replace: bool = False) -> None:
    """Add a sketch rule (a :class:`~mlir_ansor.search.rules.Rule` instance)
    under `name`, tried before the rule named `before` (default: after every
    registered rule, still before the default schedule). The rule's
    sketches are named by ``rule.name``; `name` is what users select. Its
    condition sees ``ctx.target``: a rule for cuda targets only skips the
    others, as the built-in GPU rules do."""
    from mlir_ansor.search.rules import Rule

    _check_name(name)
    _load_builtins()
    if not isinstance(rule, Rule):
        raise AnsorError(f"rule {name!r}: expected an instance of mlir_ansor.search.rules.Rule, got {rule!r}")
    if name in _RULES and not replace:
        raise AnsorError(f"a sketch rule named {name!r} is already registered (pass replace=True to replace it)")
    if before is not None and before not in _RULES:
        raise AnsorError(f"register_rule({name!r}, before={before!r}): no rule {before!r}; rules: {', '.join(_RULES)}")
    _RULES.pop(name, None)
    items = list(_RULES.items())
    at = len(items) if before is None else [n for n, _ in items].index(before)
    items.insert(at, (name, rule))
    _RULES.clear()
    _RULES.update(items)


def register_cost_model(name: str, factory: Callable[[Any], Any], *, replace: bool = False) -> None:
    """Add a cost model: ``factory(config: TuneConfig) -> CostModel``."""
    _check_name(name)
    _load_builtins()
    _add(_COST_MODELS, "cost model", name, factory, replace)


def register_strategy(name: str, factory: Callable[[Any], Any], *, replace: bool = False) -> None:
    """Add a search strategy: ``factory(config: TuneConfig) -> SearchStrategy``
    (called once per task)."""
    _check_name(name)
    _add(_strategies(), "search strategy", name, factory, replace)


def register_task_scheduler(name: str, factory: Callable[[int, Any], Any], *, replace: bool = False) -> None:
    """Add a task scheduler: ``factory(n_tasks, config: TuneConfig)`` returning
    an object with ``choose(stats, exhausted) -> Choice | None``."""
    _check_name(name)
    _load_builtins()
    _add(_TASK_SCHEDULERS, "task scheduler", name, factory, replace)


def _add(table: dict, what: str, name: str, factory: Callable, replace: bool) -> None:
    if not callable(factory):
        raise AnsorError(f"{what} {name!r}: expected a factory function, got {factory!r}")
    if name in table and not replace:
        raise AnsorError(f"a {what} named {name!r} is already registered (pass replace=True to replace it)")
    table[name] = factory


def unregister(kind: str, name: str) -> None:
    """Remove `name` from the registry `kind` ("rule", "cost_model",
    "strategy" or "task_scheduler"); a missing name is not an error."""
    tables = {"rule": _RULES, "cost_model": _COST_MODELS, "strategy": _strategies(), "task_scheduler": _TASK_SCHEDULERS}
    if kind not in tables:
        raise AnsorError(f"unknown registry {kind!r}: expected one of {', '.join(tables)}")
    tables[kind].pop(name, None)


@contextlib.contextmanager
def isolated() -> Iterator[None]:
    """Restore every registry on exit (for tests and notebooks that register
    things temporarily)."""
    _ready()
    saved = [(t, dict(t)) for t in (_RULES, _COST_MODELS, _strategies(), _TASK_SCHEDULERS)]
    try:
        yield
    finally:
        for table, content in saved:
            table.clear()
            table.update(content)


# ------------------------------------------------------------------ lookups


def rules() -> list[str]:
    """Names of the registered sketch rules, in priority order."""
    _ready()
    return list(_RULES)


def cost_models() -> list[str]:
    _ready()
    return sorted(_COST_MODELS)


def strategies() -> list[str]:
    _ready()
    return sorted(_strategies())


def task_schedulers() -> list[str]:
    _ready()
    return sorted(_TASK_SCHEDULERS)


def _unknown(what: str, name: str, known: Sequence[str], option: str) -> AnsorError:
    extra = ""
    if _plugin_errors:
        extra = f" (plugins that failed to load: {'; '.join(_plugin_errors)})"
    return AnsorError(f"unknown {what} {name!r} ({option}): expected one of {', '.join(known)}{extra}")


def default_rule_names() -> list[str]:
    """Names of the default schedules ("cpu-default", "cuda-default"): not
    registered rules, but accepted wherever rules are named."""
    from mlir_ansor.search.rules import DEFAULT_RULES

    return [r.name for r in DEFAULT_RULES.values()]


def sketch_rules(names: Sequence[str] | None = None) -> list[Any]:
    """The rules to run, in priority order: all registered ones (None), or
    those named (their registry order is kept; "cpu-default" and
    "cuda-default" may be named and are ignored: the target's default
    schedule is always added). The same names serve CPU and cuda targets:
    a rule for the other kind of target skips the task."""
    _ready()
    if names is None:
        return list(_RULES.values())
    wanted = set(names)
    defaults = default_rule_names()
    for n in names:
        if n not in _RULES and n not in defaults:
            raise _unknown("sketch rule", n, list(_RULES) + defaults, "--rules / TuneConfig.rules")
    return [r for n, r in _RULES.items() if n in wanted]


BUILTIN_MODEL_NAME = "builtin"


def builtin_model_path() -> str:
    """The cost model shipped in the package (``--pretrained-model builtin``):
    XGBoost trained on a seeded tuning run of the bundled operators and
    models (made by ``scripts/pretrain_cost_model.py``)."""
    return os.path.join(os.path.dirname(__file__), "cost_model", "pretrained", "cpu_xgb.json.gz")


def make_cost_model(config: Any) -> Any:
    """A fresh cost model named by ``config.cost_model``, loaded from
    ``config.pretrained_model`` when that is set (transfer learning)."""
    _ready()
    name = getattr(config, "cost_model", "xgb")
    if name not in _COST_MODELS:
        raise _unknown("cost model", name, sorted(_COST_MODELS), "--cost-model / TuneConfig.cost_model")
    model = _COST_MODELS[name](config)
    path = getattr(config, "pretrained_model", None)
    builtin = path == BUILTIN_MODEL_NAME
    if builtin:
        path = builtin_model_path()
    if path:
        if not os.path.exists(path):
            hint = f" (the {BUILTIN_MODEL_NAME!r} one: build it with scripts/pretrain_cost_model.py)" if builtin else ""
            raise AnsorError(f"pretrained model {path}: no such file{hint}")
        try:
            model.load(path)
        except AnsorError:
            raise
        except Exception as e:  # noqa: BLE001 - any loader failure is the user's file
            raise AnsorError(f"pretrained model {path}: cannot be loaded by cost model {name!r}: {e}") from e
    return model


def make_strategy(config: Any) -> Any:
    """A fresh search strategy named by ``config.strategy``."""
    _ready()
    table = _strategies()
    if config.strategy not in table:
        raise _unknown("search strategy", config.strategy, sorted(table), "--search / TuneConfig.strategy")
    return table[config.strategy](config)


def make_task_scheduler(config: Any, n_tasks: int) -> Any:
    """A task scheduler named by ``config.task_scheduler`` for `n_tasks` tasks."""
    _ready()
    name = config.task_scheduler
    if name not in _TASK_SCHEDULERS:
        raise _unknown(
            "task scheduler", name, sorted(_TASK_SCHEDULERS), "--task-scheduler / TuneConfig.task_scheduler"
        )
    return _TASK_SCHEDULERS[name](n_tasks, config)


# ------------------------------------------------------------------ plugins


def load_plugin(spec: str) -> Any:
    """Import a plugin: a module path (``my_pkg.plugin``) or a ``.py`` file.
    Importing it is expected to register things; a module-level
    ``register()`` function, if there is one, is called too. Returns the module."""
    _load_builtins()
    try:
        if spec.endswith(".py"):
            if not os.path.exists(spec):
                raise AnsorError(f"plugin {spec}: no such file")
            name = "mlir_ansor_plugin_" + "".join(c if c.isalnum() else "_" for c in os.path.abspath(spec))
            if name in sys.modules:
                return sys.modules[name]
            loader_spec = importlib.util.spec_from_file_location(name, spec)
            if loader_spec is None or loader_spec.loader is None:
                raise AnsorError(f"plugin {spec}: cannot be imported")
            module = importlib.util.module_from_spec(loader_spec)
            sys.modules[name] = module
            loader_spec.loader.exec_module(module)
        else:
            already = spec in sys.modules
            module = importlib.import_module(spec)
            if already:
                return module
    except AnsorError:
        raise
    except ImportError as e:
        raise AnsorError(f"plugin {spec}: cannot be imported ({e}); pass a module on sys.path or a .py file") from e
    register = getattr(module, "register", None)
    if callable(register):
        register()
    return module


def discover_plugins(*, force: bool = False) -> list[str]:
    """Load every entry point of the group ``mlir_ansor.plugins`` (once per
    process unless `force`). An entry point names a module (importing it
    registers things) or a function (called with no arguments). A plugin
    that fails is logged and skipped; lookups of unknown names then mention
    it. Returns the names of the entry points loaded."""
    global _plugins_loaded
    if _plugins_loaded and not force:
        return []
    _plugins_loaded = True
    _load_builtins()
    from importlib.metadata import entry_points

    loaded = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            if callable(obj) and not isinstance(obj, type):
                obj()
            loaded.append(ep.name)
        except Exception as e:  # noqa: BLE001 - a broken plugin must not break the tool
            msg = f"{ep.name} ({ep.value}): {type(e).__name__}: {e}"
            _plugin_errors.append(msg)
            log.warning("mlir-ansor plugin %s failed to load", msg)
    return loaded
