"""Split a lowered module (LLVM dialect) into units that compile apart.

:func:`split_units` takes the whole module after `lowering.lower_to_llvm`
(so after the whole-module driver rewrites of `drivers.py`, which must see
drivers and kernels together) and returns one module per unit: the
drivers (the user's functions and their ``_mlir_ciface_`` wrappers) in one,
every function a driver calls (a kernel, or a private clone of one that
`drivers.py` made) in one of its own, with its wrapper and the private
functions only it reaches. Each unit is then code-generated on its own (in
parallel workers, and cached: `compile_cache`), and ``cc`` links the
objects into one library.

What changes against one whole-module build: a function called from
another unit gets external linkage with hidden visibility (it stays out of
the library's exported symbols if it was private), and LLVM no longer
inlines a kernel into its driver. Kernels are large and called once per
occurrence, so the call costs nothing measurable; the code of each kernel
is the same as in the whole-module build.

Why symbols defined elsewhere need no more than a declaration: every unit
is compiled to a relocatable object, and ``cc`` resolves the references.
The ExecutionEngine that generates a unit's code still wants each symbol it
references to have an address while it links the object in memory
(`artifacts.emit_object` gives it a stub library for those).

Constructs that do not split (a top-level op other than ``llvm.func`` and
``llvm.mlir.global``, a mutable global that two units reference): None,
and the caller builds the whole module as one unit.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlir import ir

__all__ = ["Unit", "split_units"]

_SYMBOL_REF = re.compile(r'@([A-Za-z_.$][\w.$]*|"[^"]*")')
_CIFACE = "_mlir_ciface_"


@dataclass(frozen=True)
class Unit:
    """One module to compile on its own: its text, the symbols it defines
    (with external linkage) and those it references but leaves to others."""

    name: str
    text: str
    defines: tuple[str, ...]
    needs: tuple[str, ...]


def _sym(op: ir.Operation) -> str:
    return ir.StringAttr(op.attributes["sym_name"]).value


def _linkage(op: ir.Operation) -> str:
    if "linkage" not in op.attributes:
        return "external"
    return str(op.attributes["linkage"]).removeprefix("#llvm.linkage<").removesuffix(">")


def _local(op: ir.Operation) -> bool:
    return _linkage(op) in ("private", "internal")


def _defined(op: ir.Operation) -> bool:
    if op.name == "llvm.func":
        return bool(op.regions[0].blocks)
    return "value" in op.attributes or bool(op.regions and op.regions[0].blocks)


def split_units(module: ir.Module, drivers: set[str], blobs: dict[str, str] | None = None) -> list[Unit] | None:
    """The units of `module` (LLVM dialect, its context current), drivers
    first; `drivers` names the user's functions. None when the module does
    not split (see the module docstring). `module` itself is modified:
    functions called across units get external, hidden linkage. `blobs`:
    the hex data of the module's ``dense_resource`` constants by name
    (`ir.program.resource_blobs` of a text that holds them; by default,
    the module's own).

    A unit's text is put together from its ops' texts, each printed once
    (cloning every unit into a module of its own and printing that took
    twice as long: 0.8 s of ResNet-50's lowering worker)."""
    ops: dict[str, ir.Operation] = {}
    order: list[str] = []
    for opview in module.body.operations:
        op = opview.operation
        if op.name not in ("llvm.func", "llvm.mlir.global") or "sym_name" not in op.attributes:
            return None
        ops[_sym(op)] = op
        order.append(_sym(op))
    # Local scope: printing a nested op otherwise numbers the whole module
    # for every op (27 s on ResNet-50's).
    texts = {name: op.get_asm(use_local_scope=True) for name, op in ops.items()}
    refs = {}
    for name, text in texts.items():
        found = {m.strip('"') for m in _SYMBOL_REF.findall(text)}
        refs[name] = sorted(s for s in found if s in ops and s != name)
    funcs = {n for n in order if ops[n].name == "llvm.func" and _defined(ops[n])}

    def owner_of_wrapper(name: str) -> str | None:
        base = name[len(_CIFACE):] if name.startswith(_CIFACE) else None
        return base if base in funcs else None

    driver_roots = {n for n in funcs if n in drivers or owner_of_wrapper(n) in drivers}
    if not driver_roots:
        return None
    # Roots: every defined function a driver calls, and every external one
    # nothing else reaches (a kernel's C wrapper goes with its kernel).
    roots = {c for d in driver_roots for c in refs[d] if c in funcs and c not in driver_roots}
    reached = set(driver_roots) | roots
    stack = list(reached)
    while stack:
        for c in refs[stack.pop()]:
            if c in funcs and c not in reached:
                reached.add(c)
                stack.append(c)
    for n in funcs:
        if n not in reached and not _local(ops[n]) and owner_of_wrapper(n) is None:
            roots.add(n)
    units: dict[str, set[str]] = {}
    while True:
        members: dict[str, list[str]] = {}  # function -> units whose closure holds it
        units = {}
        for root in ["<drivers>", *sorted(roots)]:
            start = driver_roots if root == "<drivers>" else {root} | {n for n in funcs if owner_of_wrapper(n) == root}
            closure, todo = set(start), list(start)
            while todo:
                for c in refs[todo.pop()]:
                    if c in funcs and c not in closure and c not in roots:
                        closure.add(c)
                        todo.append(c)
            units[root] = closure
            for n in closure:
                members.setdefault(n, []).append(root)
        shared = {n for n, us in members.items() if len(us) > 1 and not _local(ops[n])}
        if not shared:
            break
        roots |= shared  # an external function two units reach is a unit of its own
    # Globals: a private constant is copied into each unit that reads it; a
    # declaration too; anything else may be reached from one unit only.
    users: dict[str, set[str]] = {}
    for root, closure in units.items():
        for n in closure:
            for g in refs[n]:
                if ops[g].name == "llvm.mlir.global":
                    users.setdefault(g, set()).add(root)
    for g, us in users.items():
        op = ops[g]
        copyable = not _defined(op) or ("constant" in op.attributes and _local(op))
        if len(us) > 1 and not copyable:
            return None
    # Functions called from another unit than their own: external, hidden.
    hidden_ty = ir.IntegerType.get_signless(64)
    for closure in units.values():
        for n in closure:
            for c in refs[n]:
                if c in funcs and c not in closure and _local(ops[c]):
                    ops[c].attributes["linkage"] = ir.Attribute.parse("#llvm.linkage<external>")
                    ops[c].attributes["visibility_"] = ir.IntegerAttr.get(hidden_ty, 1)
                    texts[c] = ops[c].get_asm(use_local_scope=True)
    shell = ir.Module.create(loc=ir.Location.unknown())
    attrs = module.operation.attributes
    for n in attrs:
        if n != "sym_name":
            shell.operation.attributes[n] = attrs[n]
    head = str(shell).rstrip()[:-1]  # "module [attributes {...}] {"
    decls: dict[str, str] = {}
    out = []
    for root, closure in units.items():
        body, defines, needs, declared = [], [], [], set()
        for n in order:
            op = ops[n]
            if n in closure:
                body.append(texts[n])
                if not _local(op):
                    defines.append(n)
            elif op.name == "llvm.mlir.global" and root in users.get(n, ()):
                body.append(texts[n])  # a copy (private constant) or a declaration
                if not _defined(op):
                    needs.append(n)
        for n in [n for n in order if n in closure]:
            for c in refs[n]:
                if c in declared or c in closure or ops[c].name != "llvm.func":
                    continue
                declared.add(c)
                if c in funcs:
                    needs.append(c)
                    if c not in decls:
                        decls[c] = _declaration(ops[c])
                    body.append(decls[c])
                else:
                    body.append(texts[c])  # an external declaration (malloc, memrefCopy)
        text = "\n".join([head, *body, "}", ""])
        if "dense_resource<" in text:
            if blobs is None:
                from mlir_ansor.ir.program import resource_blobs

                blobs = resource_blobs(str(module))
            text += _resources(text, blobs)
        name = "drivers" if root == "<drivers>" else root
        out.append(Unit(name, text, tuple(defines), tuple(needs)))
    return out


_RESOURCE_REF = re.compile(r'dense_resource<("[^"]*"|[^>]*)>')


def _resources(text: str, blobs: dict[str, str]) -> str:
    """The ``dialect_resources`` section of the blobs `text` refers to."""
    lines = []
    for key in dict.fromkeys(_RESOURCE_REF.findall(text)):
        data = blobs.get(key.strip('"'))
        if data is not None:
            lines.append(f'      {key}: "0x{data}"')
    if not lines:
        return ""
    return "{-#\n  dialect_resources: {\n    builtin: {\n" + ",\n".join(lines) + "\n    }\n  }\n#-}\n"


def _declaration(op: ir.Operation) -> str:
    """The text of ``llvm.func @name(types) -> type``: a function defined elsewhere."""
    from mlir.dialects import llvm

    scratch = ir.Module.create(loc=ir.Location.unknown())
    with ir.InsertionPoint(scratch.body):
        decl = llvm.LLVMFuncOp(_sym(op), ir.TypeAttr(op.attributes["function_type"]), loc=ir.Location.unknown())
    return decl.operation.get_asm(use_local_scope=True)
