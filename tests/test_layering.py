"""The house's layers: no import runs from a lower layer to a higher one, no
package imports a peer of its own layer, no module imports another's private
names, and the import graph has no cycle (imports inside functions count).

The layers, bottom to top, are those the package docstrings describe
(`mlir_ansor/__init__.py` lists them).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "mlir_ansor"

LAYERS: list[tuple[str, ...]] = [
    ("errors", "version"),
    ("target",),
    ("records",),
    ("ir",),
    ("graph", "importers"),
    ("schedule",),
    ("passes",),
    ("measure",),
    ("search",),
    ("cuda_compiler",),
    ("tuner", "compiler"),
    ("dispatch",),
    ("tools", "examples"),
    ("__init__",),
]
"""Each entry is one layer: its packages (or top-level modules) may import
from the layers before it, and from inside themselves, and nothing else."""

_RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def _unit(module: str) -> str:
    """The layer unit of a module: its first package under mlir_ansor (or
    the top-level module's own name; the package itself is ``__init__``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _package_of(module: str, path: Path) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imports(modules: dict[str, Path]) -> list[tuple[str, str, int, list[str]]]:
    """(importer, imported module, line, names imported) for every import of
    an mlir_ansor module, wherever it stands in the file."""
    found = []
    for mod, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    if a.name == "mlir_ansor" or a.name.startswith("mlir_ansor."):
                        found.append((mod, a.name, node.lineno, []))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = _package_of(mod, path).split(".")
                    base = base[: len(base) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not (target == "mlir_ansor" or target.startswith("mlir_ansor.")):
                    continue
                plain = []
                for a in node.names:
                    sub = f"{target}.{a.name}"
                    if sub in modules:
                        found.append((mod, sub, node.lineno, []))
                    else:
                        plain.append(a.name)
                if plain:
                    found.append((mod, target, node.lineno, plain))
    return found


def test_every_package_has_a_layer():
    units = {_unit(m) for m in _modules()}
    assert units <= set(_RANK), f"packages with no layer in LAYERS: {sorted(units - set(_RANK))}"


def _against_layers(modules: dict[str, Path]) -> list[str]:
    bad = []
    for src, dst, line, _ in _imports(modules):
        a, b = _unit(src), _unit(dst)
        if a == b or dst == "mlir_ansor.version":
            continue
        if _RANK[b] >= _RANK[a]:
            bad.append(f"{modules[src].relative_to(ROOT.parent)}:{line}: {src} ({a}) imports {dst} ({b})")
    return bad


def _private_imports(modules: dict[str, Path]) -> list[str]:
    bad = []
    for src, dst, line, names in _imports(modules):
        for n in names:
            if n.startswith("_") and not (n.startswith("__") and n.endswith("__")) and dst != src:
                bad.append(f"{modules[src].relative_to(ROOT.parent)}:{line}: {src} imports {dst}.{n}")
    return bad


def _cycles(modules: dict[str, Path]) -> list[list[str]]:
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for src, dst, _, _ in _imports(modules):
        if dst in graph and dst != src:
            # A package's __init__ runs before its submodules: importing a
            # submodule imports its parents too, but that is no edge of the
            # importer's own making, so only the named module counts.
            graph[src].add(dst)
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    return cycles


def test_no_import_goes_up_or_sideways():
    bad = _against_layers(_modules())
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_no_private_name_crosses_modules():
    bad = _private_imports(_modules())
    assert not bad, "private names imported from another module:\n" + "\n".join(bad)


def test_the_import_graph_has_no_cycle():
    cycles = _cycles(_modules())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_checks_see_violations(tmp_path, monkeypatch):
    """On a made-up package with an upward import inside a function (written
    relative), a private name taken from another module, and a cycle, each
    check reports it: the tests above can fail."""
    pkg = tmp_path / "mlir_ansor"
    (pkg / "ir").mkdir(parents=True)
    (pkg / "search").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "ir" / "__init__.py").write_text("")
    (pkg / "search" / "__init__.py").write_text("")
    (pkg / "search" / "rules.py").write_text("from mlir_ansor.search import sketch\n")
    (pkg / "search" / "sketch.py").write_text("import mlir_ansor.search.rules\n")
    (pkg / "ir" / "bad.py").write_text("def g():\n    from ..search.rules import _private\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", pkg)
    modules = _modules()
    assert ("mlir_ansor.ir.bad", "mlir_ansor.search.rules", 2, ["_private"]) in _imports(modules)
    assert _against_layers(modules) == ["mlir_ansor/ir/bad.py:2: mlir_ansor.ir.bad (ir) imports mlir_ansor.search.rules (search)"]
    assert _private_imports(modules) == ["mlir_ansor/ir/bad.py:2: mlir_ansor.ir.bad imports mlir_ansor.search.rules._private"]
    assert _cycles(modules) == [["mlir_ansor.search.rules", "mlir_ansor.search.sketch", "mlir_ansor.search.rules"]]


def test_tasks_are_extracted_for_a_target_one_way():
    """Workload keys depend on the target's decisions (`weight_packing`):
    every caller that extracts tasks for a target goes through
    `search.tasks` (a caller that passed its own `prepack`, or none, found
    no records in the past: `replay` printed "reference: crash")."""
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).as_posix()
        if rel in ("mlir_ansor/search/tasks.py",) or rel.startswith("mlir_ansor/graph/"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and any(k.arg == "prepack" for k in node.keywords):
                offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, "pass a target to search.tasks instead of prepack= at: " + ", ".join(offenders)
