"""Fold an ONNX model's shape computations where its shapes are static.

Exporters write a reshape's target shape as a small graph of its own:
``Shape`` of a tensor, ``Slice``, ``Gather``, ``Mod``, ``Concat`` (ViT-B/16's
attention, exported by ``torch.onnx.export``, computes every head split that
way). ONNX's shape inference does not follow such a graph (its data propagation,
off by default, knows a few ops and not ``Mod``, and guessed wrong through a
``Slice`` it could not evaluate), so the reshape's result, and everything
after it, stays without a shape; torch-mlir then refuses the
first op that needs one ("failed to legalize operation 'torch.operator'
... onnx.Transpose" on a ``!torch.vtensor<[],f32>``).

:func:`fold_shapes` evaluates those graphs once the shapes they read are
known: a ``Shape`` or ``Size`` of a tensor whose shape inference gave static
dimensions, and then every node whose inputs are all constants and whose
results are small (ONNX's reference evaluator, one node at a time, at the
model's opset), each replaced by a ``Constant`` of its value; shape
inference runs again, and so on until nothing more folds. A dimension the
model leaves named (``dim_param``: a dynamic batch) is not static, so what
depends on it stays as it is.

This module imports onnx and numpy only: the ONNX importer's child
interpreter, which holds torch-mlir's MLIR bindings and must not load ours,
runs it by path (`importers.onnx`).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["fold_shapes"]

MAX_ELEMENTS = 4096
"""The largest value folded: a shape, an index or a small table, never a
weight (the compiler folds constant weights itself)."""

_NEVER = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
                    "Bernoulli", "If", "Loop", "Scan", "SequenceConstruct", "SequenceEmpty", "Optional"})
"""Ops not folded even with constant inputs: random ones, and those with
subgraphs or non-tensor results."""


def _static_shapes(model: onnx.ModelProto) -> dict[str, list[int]]:
    graph = model.graph
    shapes = {}
    for v in [*graph.input, *graph.value_info, *graph.output]:
        t = v.type.tensor_type
        if t.HasField("shape") and all(d.HasField("dim_value") for d in t.shape.dim):
            shapes[v.name] = [d.dim_value for d in t.shape.dim]
    for init in graph.initializer:
        shapes[init.name] = list(init.dims)
    return shapes


def _shape_value(node: onnx.NodeProto, shape: list[int]) -> np.ndarray:
    """What a ``Shape`` (with its ``start``/``end``) or ``Size`` node gives
    for an input of `shape`."""
    if node.op_type == "Size":
        return np.array(int(np.prod(shape)), dtype=np.int64)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    start, end = attrs.get("start", 0), attrs.get("end", len(shape))
    return np.array(shape[start:end], dtype=np.int64)


def _evaluate(node: onnx.NodeProto, inputs: list[np.ndarray | None], opset: int) -> list[np.ndarray] | None:
    from onnx.reference import ReferenceEvaluator

    names = [f"in{i}" if name else "" for i, name in enumerate(node.input)]
    probe = onnx.NodeProto()
    probe.CopyFrom(node)
    del probe.input[:]
    probe.input.extend(names)
    try:
        outs = ReferenceEvaluator(probe, opsets={"": opset}).run(
            None, {n: v for n, v in zip(names, inputs) if n})
    except Exception:  # an op the reference evaluator lacks or refuses: left to torch-mlir
        return None
    return [np.asarray(o) for o in outs]


def fold_shapes(model: onnx.ModelProto, rounds: int = 16) -> tuple[onnx.ModelProto, int]:
    """A copy of `model` with its shape computations folded (see the module
    docstring), shape-inferred, and how many nodes became constants."""
    if model.graph.value_info:  # cleared below: the caller's model is left as it is
        model = onnx.ModelProto.FromString(model.SerializeToString())
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    folded = 0
    for _ in range(rounds):
        # Inferred afresh each time, without ONNX's data propagation: it
        # guesses through a Slice whose start it does not know (a 2-D
        # reshape of x[2, 2, 6] inferred as 1x2x2x6), and a shape kept from
        # an earlier round would then contradict the folded one.
        del model.graph.value_info[:]
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        graph = model.graph
        shapes = _static_shapes(model)
        values = {init.name: numpy_helper.to_array(init) for init in graph.initializer
                  if int(np.prod(init.dims)) <= MAX_ELEMENTS}
        nodes, changed = [], 0
        for node in graph.node:
            outs = None
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                attr = next((a for a in node.attribute if a.name == "value"), None)
                value = [numpy_helper.to_array(attr.t)] if attr is not None else _evaluate(node, [], opset)
                if value:
                    values[node.output[0]] = value[0]
            elif node.domain not in ("", "ai.onnx") or node.op_type in _NEVER:
                pass
            elif node.op_type in ("Shape", "Size"):
                if node.input[0] in shapes:
                    outs = [_shape_value(node, shapes[node.input[0]])]
            elif node.input and all(not i or i in values for i in node.input):
                outs = _evaluate(node, [values[i] if i else None for i in node.input], opset)
            if outs is None or len(outs) != len(node.output) or any(o.size > MAX_ELEMENTS for o in outs):
                nodes.append(node)
                continue
            for k, (name, value) in enumerate(zip(node.output, outs)):
                if name:
                    values[name] = value
                    nodes.append(onnx.helper.make_node(
                        "Constant", [], [name], name=f"{node.name or node.op_type}__folded{k or ''}",
                        value=numpy_helper.from_array(value)))
            changed += 1
        if not changed:
            break
        folded += changed
        del graph.node[:]
        graph.node.extend(nodes)
    return model, folded
