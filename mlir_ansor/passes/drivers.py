"""The rewrites :func:`~mlir_ansor.passes.lowering.lower_to_llvm` makes in
Python between its pass pipelines, mostly on the drivers of compiled modules
(the functions `graph.normalize` marks with ``NORMALIZED_ATTR``: straight-line
calls of kernels):

- :func:`forward_output_copies`: results computed in the output arguments;
- :func:`views_into_kernels`: kernels read and write views of a driver's
  buffers in place (no copy of a slice in or out);
- :func:`accumulate_in_place`: a kernel that accumulates into a copy of its
  input accumulates in that input's buffer;
- :func:`static_driver_buffers`: intermediate buffers in static storage,
  shared between buffers whose lifetimes do not overlap;
- :func:`strided_copies_to_linalg`: strided ``memref.copy`` as loops (a
  driver's as calls of one copy routine per rank);
- :func:`widen_bool_buffers`: ``i1`` buffers stored as bytes (on loops);
- :func:`copy_read_inits`: a kernel's read-only init copied into the
  buffer bufferization gave its result without it (run by the compiler on
  each scheduled kernel);
- :func:`linalg_inits`: the operands a Linalg op writes (also used by the
  compiler).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlir import ir

from mlir_ansor.ir.attrs import NORMALIZED_ATTR
from mlir_ansor.ir.rewrite import defining_op
from mlir_ansor.ir.types import identity_layout, sub_byte_elements


def _widen_global(glob: ir.Operation | None, i8: ir.Type, apply: bool = True) -> bool:
    """Make a ``memref.global`` of sub-byte integers one of bytes (its
    initial value zero-extended); True where it is one of bytes now (or,
    without `apply`, where it can be made one: nothing is changed)."""
    if glob is None:
        return False
    t = ir.MemRefType(ir.TypeAttr(glob.attributes["type"]).value)
    if t.element_type == i8:
        return True
    init = glob.attributes["initial_value"] if "initial_value" in glob.attributes else None
    try:
        dense = None if init is None else ir.DenseIntElementsAttr(init)
    except (TypeError, ValueError):
        return False  # (a resource, an unexpected kind: left as it is)
    if not apply:
        return True
    if dense is not None:
        tensor_t = ir.RankedTensorType.get(t.shape, i8)
        if dense.is_splat:
            value = ir.IntegerAttr.get(i8, int(ir.IntegerAttr(dense.get_splat_value()).value) & 1)
            glob.attributes["initial_value"] = ir.DenseElementsAttr.get_splat(tensor_t, value)
        else:
            import numpy as np

            values = np.array([int(v) & 1 for v in dense], dtype=np.int8).reshape(t.shape)
            glob.attributes["initial_value"] = ir.DenseElementsAttr.get(values, type=tensor_t)
    glob.attributes["type"] = ir.TypeAttr.get(ir.MemRefType.get(t.shape, i8, t.layout, t.memory_space))
    return True


@dataclass
class _BoolBuffer:
    """A buffer of sub-byte integers `widen_bool_buffers` may widen."""

    op: ir.Operation  # its alloc, alloca or get_global
    values: list[ir.Value]  # it and its views
    accesses: list[ir.Operation]  # the loads, stores and deallocs of those
    ok: bool  # whether every other user is a copy
    symbol: str | None  # the global a get_global reads


def widen_bool_buffers(module: ir.Module) -> int:
    """Store booleans as bytes: every ``memref.alloc``/``alloca`` of ``i1``
    (of any integer narrower than a byte, :func:`sub_byte_elements`), and
    every constant global of them read through ``memref.get_global``, used
    only by loads, stores, deallocs and reshaping views (``collapse_shape``,
    ``expand_shape``, ``subview``) and copies to or from another such buffer
    becomes one of ``i8``, with its views (stores extend, loads truncate). The LLVM 22.1.8 wheels abort on any
    ``memref.store`` of ``i1``, and torch-mlir's attention
    (``scaled_dot_product_attention``: masks, all-masked-row checks) makes
    ``i1`` tensors. Runs on loops (after
    ``convert-linalg-to-loops``), where those are the only users left; a
    buffer with other users (a call), or copied to or from one, is left as
    it is. Returns how many buffers were widened."""
    from mlir.dialects import arith, memref

    i8 = ir.IntegerType.get_signless(8, module.context)
    views = ("memref.collapse_shape", "memref.expand_shape", "memref.subview")
    allocs: list[ir.Operation] = []
    globals_: dict[str, ir.Operation] = {}

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name in ("memref.alloc", "memref.alloca", "memref.get_global") and sub_byte_elements(op.results[0].type):
            allocs.append(op)
        elif op.name == "memref.global":
            globals_[ir.StringAttr(op.attributes["sym_name"]).value] = op
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    buffers: list[_BoolBuffer] = []
    for op in allocs:
        # The buffer and its views, and whether every user is one we handle
        # (a copy: where its other side is such a buffer too, below).
        values, accesses, ok = [op.results[0]], [], True
        for v in values:
            for u in v.uses:
                user = u.owner.operation
                if user.name in views and u.operand_number == 0:
                    values.append(user.results[0])
                elif user.name in ("memref.load", "memref.dealloc") or (user.name == "memref.store" and u.operand_number == 1):
                    accesses.append(user)
                elif user.name != "memref.copy":
                    ok = False
        symbol = ir.FlatSymbolRefAttr(op.attributes["name"]).value if op.name == "memref.get_global" else None
        if symbol is not None and not _widen_global(globals_.get(symbol), i8, apply=False):
            ok = False
        buffers.append(_BoolBuffer(op, values, accesses, ok, symbol))
    # Buffers copied into each other (a mask a reduction starts from), and
    # the get_globals of one global, are widened together or not at all.
    group = list(range(len(buffers)))

    def root(k: int) -> int:
        while group[k] != k:
            k = group[k]
        return k

    def join(a: int, b: int) -> None:
        group[root(a)] = root(b)

    by_symbol: dict[str, int] = {}
    for k, buf in enumerate(buffers):
        if buf.symbol is not None:
            join(k, by_symbol.setdefault(buf.symbol, k))
        for other in _copied_with(buf.values, buffers):
            if other is None:
                buf.ok = False
            else:
                join(k, other)
    bad = {root(k) for k, buf in enumerate(buffers) if not buf.ok}
    widened = 0
    for k, buf in enumerate(buffers):
        if root(k) in bad:
            continue
        narrow = ir.MemRefType(buf.op.results[0].type).element_type
        if buf.symbol is not None:
            # A constant mask (torch-mlir's ``ones(bool)``): its global holds a byte per element.
            _widen_global(globals_[buf.symbol], i8)
        for v in buf.values:
            t = ir.MemRefType(v.type)
            v.set_type(ir.MemRefType.get(t.shape, i8, t.layout, t.memory_space))
        for user in buf.accesses:
            with ir.InsertionPoint(user), user.location:
                if user.name == "memref.load":
                    byte = memref.LoadOp(user.operands[0], list(user.operands[1:])).result
                    user.results[0].replace_all_uses_with(arith.TruncIOp(narrow, byte).result)
                    user.erase()
                elif user.name == "memref.store":
                    memref.StoreOp(arith.ExtUIOp(i8, user.operands[0]).result, user.operands[1], list(user.operands[2:]))
                    user.erase()
        widened += 1
    return widened


def _copied_with(values: list[ir.Value], buffers: list[_BoolBuffer]) -> list[int | None]:
    """For each ``memref.copy`` that reads or writes one of `values` (a
    buffer and its views): the index in `buffers` of the buffer on its
    other side, or None where that is no buffer `widen_bool_buffers` considers."""
    out: list[int | None] = []
    for v in values:
        for u in v.uses:
            user = u.owner.operation
            if user.name != "memref.copy":
                continue
            other = user.operands[1 - u.operand_number]
            out.append(next((k for k, b in enumerate(buffers) if any(other == w for w in b.values)), None))
    return out


def _block_ops(block: ir.Block) -> list[ir.Operation]:
    return [op.operation for op in block.operations]


def forward_output_copies(module: ir.Module) -> int:
    """Let each function compute its results in its output arguments; returns
    how many copies went away.

    `buffer-results-to-out-params` gives a function that returns what a call
    returned (a model's driver returning its last kernel's result) a fresh
    buffer for the call, then a ``memref.copy`` of it into the output
    argument, and a dealloc: on every call, an allocation and a copy of the
    whole result (a 112x112x32 depthwise convolution's 1.6 MB took its call
    from 147 us to 166 us). When the buffer is a
    ``memref.alloc`` of the output's exact type in the function's entry block,
    the output argument has no other use, and nothing but deallocs uses the
    buffer after the copy, the buffer *is* the output argument: its uses take
    the argument, and the alloc, copy and deallocs go."""
    count = 0
    for fn in module.body.operations:
        if fn.operation.name != "func.func" or not fn.operation.regions[0].blocks:
            continue
        entry = fn.operation.regions[0].blocks[0]
        # One rewrite at a time, the block read afresh after each: the
        # bindings' operation handles do not survive erasing their neighbours.
        while _forward_one_copy(entry):
            count += 1
    return count


def _forward_one_copy(entry: ir.Block) -> bool:
    args = list(entry.arguments)
    ops = _block_ops(entry)
    position = {op: i for i, op in enumerate(ops)}
    for copy in ops:
        if copy.name != "memref.copy":
            continue
        src, dst = copy.operands[0], copy.operands[1]
        if not any(dst == a for a in args) or src.type != dst.type or not identity_layout(dst.type):
            continue
        if sum(1 for _ in dst.uses) != 1 or not isinstance(src, ir.OpResult):
            continue
        # The copied buffer, or a reshape of it used by the copy alone (the
        # driver of a 3-D convolution split into 2-D ones expands its last
        # result to 5-D): the buffer becomes the inverse reshape of `dst`.
        reshape = src.owner.operation if src.owner.operation.name in _INVERSE_RESHAPE else None
        if reshape is not None:
            if sum(1 for _ in src.uses) != 1 or not isinstance(reshape.operands[0], ir.OpResult):
                continue
            buf = reshape.operands[0]
        else:
            buf = src
        alloc = buf.owner.operation
        if alloc.name != "memref.alloc" or alloc not in position or not identity_layout(buf.type):
            continue
        users = [u.owner.operation for u in buf.uses]
        others = [u for u in users if u != copy and (reshape is None or u != reshape) and u.name != "memref.dealloc"]
        if any(position[_top_level(u, entry)] > position[copy] for u in others):
            continue
        for u in users:
            if u.name == "memref.dealloc":
                u.erase()
        copy.erase()
        if reshape is not None:
            from mlir.dialects import memref

            reassociation = reshape.attributes["reassociation"]
            with ir.InsertionPoint(alloc), alloc.location:
                if reshape.name == "memref.expand_shape":
                    view = memref.collapse_shape(buf.type, dst, reassociation)
                else:
                    view = memref.expand_shape(buf.type, dst, reassociation, [], ir.MemRefType(buf.type).shape)
            reshape.erase()
            buf.replace_all_uses_with(view)
        else:
            buf.replace_all_uses_with(dst)
        alloc.erase()
        return True
    return False


_INVERSE_RESHAPE = ("memref.expand_shape", "memref.collapse_shape")


_VIEW_OPS = frozenset(
    {"memref.subview", "memref.collapse_shape", "memref.expand_shape", "memref.cast", "memref.reinterpret_cast"}
)


def views_into_kernels(module: ir.Module) -> int:
    """Let kernels read and write views of a driver's buffers in place;
    returns how many copies went away.

    A kernel takes identity-layout memrefs, so a driver that feeds it a slice
    (one group of a grouped convolution, one depth window of a 3-D one,
    `graph/split_conv.py`) copies the slice into a fresh buffer first, and a
    kernel whose result lands in a slice of a larger buffer writes a fresh
    buffer that is copied there after. Ansor's GRP spent a third of its call
    in those copies at 2 threads (0.61 against 0.42 ms without them). Here,
    in each driver (``NORMALIZED_ATTR``): when a call's operand is a fresh
    ``memref.alloc`` whose only other uses are one ``memref.copy`` from a view
    just before the call (nothing between writes the view's buffer) or one
    copy into a view just after it, and deallocs, the call takes the view
    itself, and calls a copy of the kernel whose argument has the view's
    strides (and a dynamic offset, so that the slices of one buffer share
    it). The kernel's body is retyped along its argument's subviews; where it
    uses the argument some other way (a reshape, a call, a cast that pins the
    layout), where the view's innermost stride is not 1, or where the call
    also writes the view's buffer through another argument, the copy stays."""
    clones: dict[tuple[str, tuple[str, ...]], str] = {}
    count = _rewrite_drivers(module, _view_into_one_call, clones)
    if count:
        _erase_unused_clones(module, set(clones.values()))
    return count


def _rewrite_drivers(module: ir.Module, rewrite_one, clones: dict) -> int:
    """Apply ``rewrite_one(module, entry, clones)`` to the entry block of
    every driver (``NORMALIZED_ATTR``) until it finds nothing more to do;
    returns how many rewrites it made. One rewrite at a time, the block read
    afresh after each (as in `forward_output_copies`)."""
    count = 0
    for fn in list(module.body.operations):
        op = fn.operation
        if op.name != "func.func" or NORMALIZED_ATTR not in op.attributes or not op.regions[0].blocks:
            continue
        entry = op.regions[0].blocks[0]
        while rewrite_one(module, entry, clones):
            count += 1
    return count


def _root(v: ir.Value) -> ir.Value:
    """The buffer `v` is a view of (through subviews, reshapes and casts)."""
    while isinstance(v, ir.OpResult) and v.owner.operation.name in _VIEW_OPS:
        v = v.owner.operation.operands[0]
    return v


def _touches(op: ir.Operation, root: ir.Value) -> bool:
    """Whether `op` (not a view op) may use the buffer `root` or a view of it."""
    if op.name in _VIEW_OPS or op.name in ("memref.alloc", "memref.get_global", "memref.dealloc", "arith.constant"):
        return False
    found = False

    def visit(inner: ir.Operation) -> ir.WalkResult:
        nonlocal found
        if any(isinstance(v.type, ir.MemRefType) and _root(v) == root for v in inner.operands):
            found = True
            return ir.WalkResult.INTERRUPT
        return ir.WalkResult.ADVANCE

    op.walk(visit)
    return found


def _kernel_calls(module: ir.Module, entry: ir.Block) -> tuple[list[ir.Operation], dict, list[tuple[ir.Operation, ir.Operation]]]:
    """The ops of a driver's `entry` block, their positions, and each call
    of a function defined in `module` with that function."""
    ops = _block_ops(entry)
    position = {o: k for k, o in enumerate(ops)}
    funcs = {ir.StringAttr(f.operation.attributes["sym_name"]).value: f.operation
             for f in module.body.operations if f.operation.name == "func.func"}
    calls = []
    for call in ops:
        if call.name == "func.call":
            callee = funcs.get(ir.FlatSymbolRefAttr(call.attributes["callee"]).value)
            if callee is not None and callee.regions[0].blocks:
                calls.append((call, callee))
    return ops, position, calls


def _private_clone(callee: ir.Operation, name: str) -> ir.Operation:
    """A copy of the function `callee`, inserted before it: private, named
    `name`, without a C interface."""
    with ir.InsertionPoint(callee):
        clone = callee.clone()
    clone.attributes["sym_name"] = ir.StringAttr.get(name)
    clone.attributes["sym_visibility"] = ir.StringAttr.get("private")
    if "llvm.emit_c_interface" in clone.attributes:
        del clone.attributes["llvm.emit_c_interface"]
    return clone


def _view_into_one_call(module: ir.Module, entry: ir.Block, clones: dict) -> bool:
    ops, position, calls = _kernel_calls(module, entry)
    for call, callee in calls:
        operands = list(call.operands)
        for i, buf in enumerate(operands):
            if not isinstance(buf, ir.OpResult) or buf.owner.operation.name != "memref.alloc":
                continue
            alloc = buf.owner.operation
            if alloc not in position or alloc.operands or not identity_layout(buf.type):
                continue
            if sum(1 for v in operands if v == buf) != 1:
                continue
            users = [u.owner.operation for u in buf.uses]
            copies = [u for u in users if u.name == "memref.copy"]
            if len(copies) != 1 or any(u not in (call, copies[0]) and u.name != "memref.dealloc" for u in users):
                continue
            copy = copies[0]
            if copy not in position:
                continue
            params = list(callee.regions[0].blocks[0].arguments)
            if copy.operands[1] == buf and position[copy] < position[call]:
                if not _only_reads(params[i]):
                    continue  # the copy is the kernel's to write
                view, between = copy.operands[0], ops[position[copy] + 1 : position[call]]
                # the kernel must not write the buffer it reads the view of
                if any(_root(v) == _root(view) and not _only_reads(params[j]) for j, v in enumerate(operands) if j != i):
                    continue
            elif copy.operands[0] == buf and position[copy] > position[call]:
                view, between = copy.operands[1], ops[position[call] + 1 : position[copy]]
                # nor read the buffer it writes the view of
                if any(_root(v) == _root(view) for j, v in enumerate(operands) if j != i):
                    continue
            else:
                continue
            root = _root(view)
            if any(_touches(o, root) for o in between):
                continue
            target = _strided_arg_type(ir.MemRefType(view.type))
            if target is None:
                continue
            kernel = _kernel_taking(module, callee, i, target, clones)
            if kernel is None:
                continue
            if not _hoist_view(view, call, position):
                continue
            with ir.InsertionPoint(call), call.location:
                arg = _cast(view, target)
            call.operands[i] = arg
            call.attributes["callee"] = ir.FlatSymbolRefAttr.get(kernel)
            for u in users:
                if u != call:
                    u.erase()
            alloc.erase()
            return True
    return False


def _only_reads(v: ir.Value) -> bool:
    """Whether every use of the buffer `v` (and of its views) reads it."""
    for use in v.uses:
        user = use.owner.operation
        if user.name in _VIEW_OPS and user.operands[0] == v:
            if not all(_only_reads(r) for r in user.results):
                return False
        elif user.name in ("vector.load", "vector.transfer_read", "memref.load", "memref.dim"):
            continue
        elif user.name == "memref.copy" and user.operands[1] != v:
            continue
        elif user.name.startswith("linalg."):
            if any(w == v for w in linalg_inits(user)):
                return False
        else:
            return False
    return True


_READS = ("vector.transfer_read", "vector.load", "vector.maskedload", "memref.load", "vector.gather", "memref.copy")


def copy_read_inits(fn: ir.Operation, inits: list[int | None]) -> int:
    """Copy an argument into the buffer a kernel returns where the result
    starts from that argument (`inits`, `compiler._result_inits`), the kernel
    reads the buffer, and bufferization allocated it without the copy; returns
    how many copies it added.

    The arguments are read-only, so bufferization gives each such result a
    buffer of its own. With a register tile that does not divide the output
    (26 channels in tiles of 16, the last 10 peeled), the peeled part reads
    its accumulators from the result of the first part's write, at elements
    that write does not touch: one-shot bufferization (LLVM 22.1.8) then
    allocates the buffer without copying the argument into it, and the peeled
    part read garbage (a 1x1 convolution of 104 -> 26 channels on a 1x1 image
    with a bias, RegNet-Y's squeeze-excitation). The tuner builds its kernels
    with writable arguments, in place, where this does not happen."""
    from mlir.dialects import memref

    args = list(fn.regions[0].blocks[0].arguments)
    ret = list(fn.regions[0].blocks[0].operations)[-1]
    added = 0
    for v, j in zip(ret.operands, inits):
        if j is None:
            continue
        alloc = defining_op(v, "memref.alloc")
        if alloc is None or v.type != args[j].type:
            continue
        views, read, copied = [v], False, False
        for buf in views:
            for use in buf.uses:
                user = use.owner.operation
                if user.name in _VIEW_OPS:
                    views.append(user.results[0])
                elif user.name in _READS and use.operand_number == 0:
                    read = True
                elif user.name == "memref.copy" and use.operand_number == 1 and user.operands[0] == args[j]:
                    copied = True  # bufferization copied it (:func:`accumulate_in_place` looks for that copy)
        if not read or copied:
            continue
        with ir.InsertionPoint.after(alloc), alloc.location:
            memref.CopyOp(args[j], v)
        added += 1
    return added


def linalg_inits(op: ir.Operation) -> list[ir.Value]:
    """The operands a Linalg op writes (its ``outs``); all of them where
    the op's Python class does not say."""
    view = op.opview
    for attr in ("outputs", "inits", "init"):
        if hasattr(view, attr):
            inits = getattr(view, attr)
            return [inits] if isinstance(inits, ir.Value) else list(inits)
    return list(op.operands)


def _hoist_view(view: ir.Value, call: ir.Operation, position: dict) -> bool:
    """Move the view ops that make `view` and sit after `call` to just before
    it (an output's slice is often taken after the call that fills it), and
    the static ``memref.alloc`` they view where that comes after it too (a
    concatenation's buffer, allocated after the calls that fill its slices);
    False if one of them needs a value made after `call`."""
    chain: list[ir.Operation] = []
    v = view
    while isinstance(v, ir.OpResult) and position.get(v.owner.operation, -1) > position[call]:
        o = v.owner.operation
        if o.name == "memref.alloc" and not o.operands:
            chain.append(o)
            break
        if o.name not in _VIEW_OPS:
            return False
        chain.append(o)
        v = o.operands[0]
    made = set(chain)
    for o in chain:
        for w in list(o.operands)[1:]:
            if isinstance(w, ir.OpResult) and (w.owner.operation in made or position.get(w.owner.operation, -1) > position[call]):
                return False
    for o in reversed(chain):
        o.move_before(call)
    return True


def _strided_arg_type(t: ir.MemRefType) -> ir.MemRefType | None:
    """The type a kernel's argument takes to read or write views like `t`
    in place: `t`'s static strides with a dynamic offset (or `t`'s identity
    type when `t` is contiguous at offset 0); None where `t` has a dynamic
    stride or shape, or an innermost stride other than 1."""
    dyn = ir.ShapedType.get_dynamic_stride_or_offset()
    if not t.has_static_shape:
        return None
    strides, offset = t.get_strides_and_offset()
    if any(s == dyn for s in strides) or (strides and strides[-1] != 1):
        return None
    identity = ir.MemRefType.get(t.shape, t.element_type, memory_space=t.memory_space)
    if offset == 0 and list(strides) == list(identity.get_strides_and_offset()[0]):
        return identity
    layout = ir.StridedLayoutAttr.get(dyn, list(strides))
    return ir.MemRefType.get(t.shape, t.element_type, layout, memory_space=t.memory_space)


def _kernel_taking(module: ir.Module, callee: ir.Operation, index: int, t: ir.MemRefType, clones: dict) -> str | None:
    """The symbol of a copy of `callee` whose argument `index` has type `t`
    (`callee` itself when it already does); None when the body cannot be
    retyped."""
    name = ir.StringAttr(callee.attributes["sym_name"]).value
    fn_type = ir.FunctionType(ir.TypeAttr(callee.attributes["function_type"]).value)
    inputs = list(fn_type.inputs)
    if inputs[index] == t:
        return name
    inputs[index] = t
    base = name.split(_VIEW_SUFFIX)[0]
    key = (base, tuple(str(x) for x in inputs))
    if key in clones:
        return clones[key]
    clone_name = f"{base}{_VIEW_SUFFIX}{len(clones)}"
    clone = _private_clone(callee, clone_name)
    clone.attributes["function_type"] = ir.TypeAttr.get(ir.FunctionType.get(inputs, list(fn_type.results)))
    ok = _retype(clone.regions[0].blocks[0].arguments[index], t)
    if ok:
        try:
            clone.verify()
        except ir.MLIRError:
            ok = False
    if not ok:
        clone.erase()
        return None
    clones[key] = clone_name
    return clone_name


_VIEW_SUFFIX = "__view"

# Ops that take a memref of any strided layout and whose results do not
# depend on it.
_LAYOUT_FREE = frozenset({"memref.load", "memref.store", "memref.copy", "memref.dim", "memref.prefetch"})


def _retype(v: ir.Value, t: ir.MemRefType) -> bool:
    """Give `v` type `t` (another layout of the same shape) and its subviews
    the layouts that follow; False if some use cannot take it."""
    old = ir.MemRefType(v.type)
    v.set_type(t)
    for use in list(v.uses):
        user = use.owner.operation
        if user.name == "memref.subview" and user.operands[0] == v:
            nt = _subview_type(user, old, t)
            if nt is None or not _retype(user.results[0], nt):
                return False
        elif user.name in _LAYOUT_FREE or user.name.startswith("linalg."):
            continue
        elif user.name == "memref.cast":
            # A cast to a layout at least as dynamic stays right; one that
            # pins the offset (or a stride) would now be a wrong promise.
            if not _at_least_as_dynamic(ir.MemRefType(user.results[0].type), t):
                return False
        elif user.name.startswith("vector.") and user.name != "vector.type_cast":
            continue
        else:
            return False
    return True


def _at_least_as_dynamic(a: ir.MemRefType, b: ir.MemRefType) -> bool:
    """Whether layout `a` holds every memref of layout `b` (each of its
    strides and its offset dynamic or equal to `b`'s)."""
    dyn = ir.ShapedType.get_dynamic_stride_or_offset()
    (sa, oa), (sb, ob) = a.get_strides_and_offset(), b.get_strides_and_offset()
    return len(sa) == len(sb) and all(x in (dyn, y) for x, y in zip([*sa, oa], [*sb, ob]))


def _subview_type(op: ir.Operation, old_src: ir.MemRefType, new_src: ir.MemRefType) -> ir.MemRefType | None:
    """The result type of subview `op` once its source has type `new_src`
    (it had `old_src`), keeping the dims the old result kept."""
    dyn = ir.ShapedType.get_dynamic_stride_or_offset()
    sizes = list(ir.DenseI64ArrayAttr(op.attributes["static_sizes"]))
    steps = list(ir.DenseI64ArrayAttr(op.attributes["static_strides"]))
    old_res = ir.MemRefType(op.results[0].type)
    old_res_strides, _ = old_res.get_strides_and_offset()

    def full(src: ir.MemRefType) -> list[int]:
        strides, _ = src.get_strides_and_offset()
        return [s * k if dyn not in (s, k) else dyn for s, k in zip(strides, steps)]

    old_full, new_full = full(old_src), full(new_src)
    kept: list[int] = []
    j = 0
    for d, size in enumerate(sizes):
        if j < old_res.rank and size == old_res.shape[j] and old_full[d] == old_res_strides[j]:
            kept.append(new_full[d])
            j += 1
        elif size != 1:
            return None
    if j != old_res.rank:
        return None
    layout = ir.StridedLayoutAttr.get(dyn, kept)
    return ir.MemRefType.get(old_res.shape, old_res.element_type, layout, memory_space=old_res.memory_space)


def _erase_unused_clones(module: ir.Module, names: set[str]) -> None:
    """Erase the kernel copies no call uses any more (a copy retyped again
    for a second argument leaves the first one behind)."""
    called: set[str] = set()

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "func.call":
            called.add(ir.FlatSymbolRefAttr(op.attributes["callee"]).value)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    for f in list(module.body.operations):
        if f.operation.name == "func.func" and ir.StringAttr(f.operation.attributes["sym_name"]).value in names - called:
            f.operation.erase()


def accumulate_in_place(module: ir.Module) -> int:
    """Let a kernel that accumulates into a copy of its input accumulate in
    that input's buffer; returns how many calls now do.

    A task whose anchor adds to an initial value it takes as an argument (a
    3-D convolution split into 2-D ones sums its depth taps, each 2-D
    convolution starting from the previous one's result; a transposed
    convolution's phases add up their taps) is a kernel that copies that
    argument into its output before it touches either, whole, on one
    thread: 13 MB per call for each depth tap of Ansor's C3D, 4 to 7% of
    its call at 2 threads. In each driver
    (``NORMALIZED_ATTR``), when the buffer a call reads that way is a fresh
    ``memref.alloc`` that nothing uses after the call, the buffer becomes the
    call's output buffer (from its first use on) and the call goes to a copy
    of the kernel without the copy. Only where nothing between the buffer's
    first use and the call touches the output buffer (or what it is a view
    of), where the call reads no other view of it, and where the output
    buffer can be made before the buffer's first use."""
    clones: dict[str, str] = {}  # kernel -> its copy without the initial copy
    count = _rewrite_drivers(module, _in_place_one_call, clones)
    if count:
        # the private kernels replaced by their in-place copies (those of
        # views_into_kernels) that no call needs now
        private = {
            ir.StringAttr(f.operation.attributes["sym_name"]).value
            for f in module.body.operations
            if f.operation.name == "func.func" and "sym_visibility" in f.operation.attributes
            and ir.StringAttr(f.operation.attributes["sym_visibility"]).value == "private"
        }
        _erase_unused_clones(module, private & set(clones))
    return count


_IN_PLACE_SUFFIX = "__inplace"


def _init_copy(callee: ir.Operation) -> tuple[int, int, ir.Operation] | None:
    """(i, o, copy) when `callee` copies its argument i, which nothing else
    uses, into its argument o, which nothing before the copy uses (a tuned
    kernel may pack a filter first)."""
    block = callee.regions[0].blocks[0]
    args = list(block.arguments)
    ops = _block_ops(block)
    for pos, op in enumerate(ops):
        if op.name != "memref.copy":
            continue
        src, dst = op.operands[0], op.operands[1]
        i = next((k for k, a in enumerate(args) if a == src), None)
        o = next((k for k, a in enumerate(args) if a == dst), None)
        if i is None or o is None or i == o or src.type != dst.type or sum(1 for _ in src.uses) != 1:
            return None
        if any(_touches(x, dst) for x in ops[:pos]):
            return None
        return i, o, op
    return None


def _in_place_kernel(callee: ir.Operation, clones: dict) -> str:
    """The symbol of a copy of `callee` without its initial copy."""
    name = ir.StringAttr(callee.attributes["sym_name"]).value
    if name in clones:
        return clones[name]
    clone_name = name + _IN_PLACE_SUFFIX
    _init_copy(_private_clone(callee, clone_name))[2].erase()
    clones[name] = clone_name
    return clone_name


def _in_place_one_call(module: ir.Module, entry: ir.Block, clones: dict) -> bool:
    ops, position, calls = _kernel_calls(module, entry)
    for call, callee in calls:
        found = _init_copy(callee)
        if found is None:
            continue
        i, o, _ = found
        operands = list(call.operands)
        buf, out = operands[i], operands[o]
        root = _root(out)
        # the kernel must not read its output buffer through another argument
        if any(_root(v) == root for k, v in enumerate(operands) if k not in (i, o)):
            continue
        if buf != out:
            if not isinstance(buf, ir.OpResult) or buf.owner.operation.name != "memref.alloc":
                continue
            alloc = buf.owner.operation
            if alloc not in position or alloc.operands or buf.type != out.type or root == buf:
                continue
            if sum(1 for v in operands if v == buf) != 1:
                continue
            users = [u.owner.operation for u in buf.uses]
            if any(u.name not in ("func.call", "memref.dealloc") or u not in position for u in users):
                continue
            writers = [u for u in users if u.name == "func.call"]
            if any(position[u] > position[call] for u in writers):
                continue
            first = min(writers, key=lambda u: position[u])
            if any(_touches(x, root) for x in ops[position[first] : position[call]]):
                continue
            # `out` must exist before the buffer's first use.
            if isinstance(out, ir.OpResult) and position.get(out.owner.operation, -1) > position[first]:
                made = out.owner.operation
                if made.name == "memref.alloc" and not made.operands:
                    made.move_before(first)
                elif not _hoist_view(out, first, position):
                    continue
            for u in users:
                if u.name == "memref.dealloc":
                    u.erase()
            buf.replace_all_uses_with(out)
            alloc.erase()
        call.attributes["callee"] = ir.FlatSymbolRefAttr.get(_in_place_kernel(callee, clones))
        return True
    return False


def static_driver_buffers(module: ir.Module) -> int:
    """Give each driver's intermediate buffers static storage, shared between
    buffers whose lifetimes do not overlap; returns how many allocations went.

    A driver (a function `normalize` marked with ``NORMALIZED_ATTR``, which
    `compile` turned into straight-line calls of kernels) allocates every
    intermediate result with ``malloc`` on every call. Large blocks come from
    fresh ``mmap`` pages that fault in on first touch, and the kernels pay
    for it: a 3-D convolution split into three 2-D ones (five buffers of
    13 MB) spent about a quarter of its call there. Here, every
    ``memref.alloc`` of static shape in a driver's entry block becomes a
    ``memref.get_global`` of an uninitialized, 64-byte-aligned global. A
    global is reused by a later allocation of the same type once the last
    use of its previous buffer (and of every view of it) is behind; the
    buffers' deallocs go.

    The price: a compiled driver is not reentrant (two threads calling it at
    once would share these buffers); its kernels still run in parallel with
    OpenMP inside each call."""
    from mlir.dialects import memref

    count = 0
    for fn in list(module.body.operations):
        op = fn.operation
        if op.name != "func.func" or NORMALIZED_ATTR not in op.attributes or not op.regions[0].blocks:
            continue
        name = ir.StringAttr(op.attributes["sym_name"]).value
        entry = op.regions[0].blocks[0]
        ops = _block_ops(entry)
        position = {o: i for i, o in enumerate(ops)}
        # The plan first (positions stay valid: each alloc is replaced in place).
        plan: list[tuple[int, ir.MemRefType, str]] = []
        free: dict[str, list[str]] = {}
        live: list[tuple[int, str, str]] = []  # (last use, type, global)
        symbols: list[tuple[str, ir.MemRefType]] = []
        for i, inner in enumerate(ops):
            if inner.name != "memref.alloc" or inner.operands:
                continue
            t = ir.MemRefType(inner.results[0].type)
            if not t.has_static_shape or not identity_layout(t):
                continue
            if sub_byte_elements(t):
                continue  # masks stay allocations, which widen_bool_buffers stores as bytes
            for entry_live in [x for x in live if x[0] < i]:
                live.remove(entry_live)
                free.setdefault(entry_live[1], []).append(entry_live[2])
            key = str(t)
            if free.get(key):
                sym = free[key].pop()
            else:
                sym = f"__ansor_{name}_buf{len(symbols)}"
                symbols.append((sym, t))
            live.append((_last_use(inner.results[0], entry, position), key, sym))
            plan.append((i, t, sym))
        if not plan:
            continue
        with ir.InsertionPoint(op), op.location:  # before the driver
            for sym, t in symbols:
                memref.GlobalOp(sym, ir.TypeAttr.get(t), sym_visibility="private", initial_value=ir.UnitAttr.get(), alignment=64)
        for i, t, sym in plan:
            alloc = _block_ops(entry)[i]
            with ir.InsertionPoint(alloc), alloc.location:
                buf = memref.get_global(t, sym)
            alloc.results[0].replace_all_uses_with(buf)
            alloc.erase()
            count += 1
        for inner in _block_ops(entry):
            src = inner.operands[0] if inner.name == "memref.dealloc" else None
            if isinstance(src, ir.OpResult) and src.owner.operation.name == "memref.get_global":
                inner.erase()
    return count


def _last_use(value: ir.Value, block: ir.Block, position: dict) -> int:
    """Position in `block` of the last op (deallocs aside) that uses `value`
    or a view of it."""
    last = 0
    todo = [value]
    while todo:
        v = todo.pop()
        for use in v.uses:
            user = use.owner.operation
            if user.name == "memref.dealloc":
                continue
            last = max(last, position[_top_level(user, block)])
            if user.name in _VIEW_OPS:
                todo.extend(user.results)
    return last


def _top_level(op: ir.Operation, block: ir.Block) -> ir.Operation:
    """The ancestor of `op` (or `op`) that sits directly in `block`."""
    while op.block != block:
        op = op.parent.operation
    return op


def strided_copies_to_linalg(module: ir.Module) -> int:
    """Turn every ``memref.copy`` with a strided (non-identity) side into a
    ``linalg.copy``, which becomes loops that LLVM vectorizes; returns how
    many. Left alone, such a copy lowers to a call of the C runner's generic
    ``memrefCopy``, which walks the elements one at a time (the slices of a
    grouped convolution split per group, `graph/split_conv.py`, spent 19 ms
    there against 0.8 ms in the convolutions). Contiguous copies stay
    ``memref.copy`` (a memcpy).

    A driver's own copies (``NORMALIZED_ATTR``, outside any loop) become
    calls of one copy routine per rank and element type
    (:func:`_copy_routine`), of any sizes and strides: inline, each was a
    loop nest of its own in the driver, and LLVM's loop passes over
    DenseNet-121's 711 (its concatenations) took 40 s of a 65 s compile, and
    more with a batch of 2 or 3 (100 and 190 s), where the batch loop stays.
    A kernel's copies stay inline, with their static shapes."""
    from mlir.dialects import func, linalg

    copies: list[ir.Operation] = []

    def visit(op: ir.Operation) -> ir.WalkResult:
        if op.name == "memref.copy" and not all(identity_layout(v.type) for v in op.operands):
            copies.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    routines: dict[tuple, tuple[str, ir.Type]] = {}
    for op in copies:
        routine = _driver_copy(op, module, routines)
        with ir.InsertionPoint(op), op.location:
            if routine is None:
                linalg.copy(op.operands[0], outs=[op.operands[1]])
            else:
                name, t = routine
                func.CallOp([], ir.FlatSymbolRefAttr.get(name), [_cast(v, t) for v in op.operands])
        op.erase()
    return len(copies)


def _driver_copy(op: ir.Operation, module: ir.Module, routines: dict) -> tuple[str, ir.Type] | None:
    """The copy routine (its name and argument type) `op`, a strided
    ``memref.copy``, calls instead where it is a driver's own, outside any
    loop (None: it stays inline). Byte-narrow elements stay inline too
    (:func:`widen_bool_buffers` widens buffers, not routines' arguments)."""
    parent = op.parent
    if parent.name != "func.func" or NORMALIZED_ATTR not in parent.attributes:
        return None
    src, dst = (ir.MemRefType(v.type) for v in op.operands)
    if src.rank == 0 or sub_byte_elements(src) or src.memory_space is not None or dst.memory_space is not None:
        return None
    unit = all(t.get_strides_and_offset()[0][-1] == 1 for t in (src, dst))
    key = (str(src.element_type), src.rank, unit)
    if key not in routines:
        routines[key] = _copy_routine(module, src.element_type, src.rank, unit)
    return routines[key]


def _copy_routine(module: ir.Module, element: ir.Type, rank: int, unit: bool) -> tuple[str, ir.Type]:
    """A private function of `module` that copies one memref of `rank`
    dimensions into another, both of any sizes and strides (the innermost
    stride 1 where `unit`: LLVM then vectorizes its inner loop), and the
    type of its arguments."""
    from mlir.dialects import func, linalg

    dyn = ir.ShapedType.get_dynamic_stride_or_offset()
    strides = [dyn] * rank
    if unit:
        strides[-1] = 1
    t = ir.MemRefType.get([ir.ShapedType.get_dynamic_size()] * rank, element,
                          ir.StridedLayoutAttr.get(dyn, strides))
    name = "__ansor_copy_{}d_{}{}".format(rank, re.sub(r"\W", "_", str(element)), "_unit" if unit else "")
    with ir.InsertionPoint(module.body), ir.Location.unknown():
        fn = func.FuncOp(name, ([t, t], []), visibility="private")
        with ir.InsertionPoint(fn.add_entry_block()):
            linalg.copy(fn.arguments[0], outs=[fn.arguments[1]])
            func.ReturnOp([])
    return name, t


def _cast(v: ir.Value, t: ir.Type) -> ir.Value:
    from mlir.dialects import memref

    return v if v.type == t else memref.cast(t, v)
