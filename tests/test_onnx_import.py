"""ONNX in (mlir_ansor.importers.onnx): a small ResNet-style model exported
with torch.onnx, imported by `mlir-ansor import` and by `mlir_ansor.load`,
compiled, and compared with PyTorch."""

from __future__ import annotations

import importlib.util
import json
import sys
import warnings

import numpy as np
import pytest

import mlir_ansor
from mlir_ansor.compiler import DynamicModule
from mlir_ansor.errors import AnsorError, InputError
from mlir_ansor.tools.cli import main


def _block(torch):
    """A small ResNet-style model with seeded weights."""
    nn = torch.nn

    class Block(nn.Module):
        """conv-bn-relu-conv-bn, the skip added, relu; then pooling and a linear head."""

        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
            self.body = nn.Sequential(
                nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(),
                nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8),
            )
            self.head = nn.Linear(8, 10)

        def forward(self, x):
            y = self.stem(x)
            y = torch.relu(self.body(y) + y)
            return self.head(y.mean(dim=(2, 3)))

    torch.manual_seed(0)
    model = Block()
    for bn in (model.body[1], model.body[4]):  # batch statistics that are not the identity
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    return model.eval()


def _export(torch, model, x, path, **options) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the TorchScript exporter (no onnxscript here)
        torch.onnx.export(model, (x,), str(path), dynamo=False, input_names=["x"], output_names=["logits"], **options)


@pytest.fixture(scope="module")
def onnx_model(torch, tmp_path_factory):
    """(path of the .onnx file, an input, PyTorch's output). Needs onnx (the
    'torch' extra that scripts/setup.sh installs has it): skipped without
    it, except in CI, where it is a failure."""
    from conftest import _in_ci

    if importlib.util.find_spec("onnx") is None:
        why = "the ONNX path needs the onnx package (the 'onnx' or 'torch' extra: pip install -e '.[onnx]')"
        if _in_ci():
            pytest.fail(f"{why}; CI installs it (scripts/setup.sh), so it must be there", pytrace=False)
        pytest.skip(why)
    model = _block(torch)
    x = torch.randn(1, 3, 12, 12)
    path = tmp_path_factory.mktemp("onnx") / "block.onnx"
    _export(torch, model, x, path)
    with torch.no_grad():
        expected = model(x).numpy()
    return path, x.numpy(), expected


def test_import_command_then_compile_matches_torch(onnx_model, tmp_path, capsys):
    path, x, expected = onnx_model
    out = tmp_path / "block.mlir"
    assert main(["import", str(path), "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().err
    text = out.read_text()
    assert "func.func @main_graph(%arg0: tensor<1x3x12x12xf32>) -> tensor<1x10xf32>" in text
    assert "linalg.conv_2d_nchw_fchw" in text and "torch." not in text  # all Linalg, no torch dialect left
    cm = mlir_ansor.compile(str(out))
    got = cm(x)
    assert got.shape == (1, 10)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_load_of_an_onnx_path_compiles_and_matches_torch(onnx_model):
    path, x, expected = onnx_model
    program = mlir_ansor.load(path)
    kinds = sorted({t.kind for t in mlir_ansor.extract_tasks(program)})
    assert "convolution" in kinds and "contraction" in kinds
    np.testing.assert_allclose(mlir_ansor.compile(program)(x), expected, rtol=1e-4, atol=1e-5)


def test_import_errors(tmp_path, capsys, monkeypatch):
    from mlir_ansor.importers.onnx import import_onnx

    with pytest.raises(InputError, match="no such ONNX model"):
        import_onnx(tmp_path / "missing.onnx")
    assert main(["import", str(tmp_path / "model.pt2")]) == 2
    assert "expected an ONNX model" in capsys.readouterr().err
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a protobuf")
    monkeypatch.setitem(sys.modules, "onnx", None)  # as if the package were absent
    with pytest.raises(AnsorError, match=r"needs onnx\b.*pip install -e '\.\[onnx\]'"):
        import_onnx(bad)


def test_tune_and_run_take_an_onnx_path(onnx_model, tmp_path, capsys):
    """The command line's tune, compile and run read a .onnx file as load does."""
    path, _, _ = onnx_model
    db = str(tmp_path / "t.db")
    assert main(["tune", str(path), "--trials", "2", "--db", db, "--progress", "none", "--json"]) == 0
    tuned = json.loads(capsys.readouterr().out)
    assert tuned["trials"] >= 1 and tuned["tasks"]
    assert main(["run", str(path), "--db", db, "--repeat", "1", "--json"]) == 0
    ran = json.loads(capsys.readouterr().out)
    assert ran["max_relative_error"] <= 1e-4


def test_a_dynamic_batch_compiles_to_one_dynamic_module(onnx_model, torch, tmp_path):
    """An ONNX input whose batch is a named dimension (``dim_param``, as
    ``dynamic_axes`` exports it) stays dynamic: compile gives a
    DynamicModule that runs any batch."""
    model = _block(torch)
    path = tmp_path / "batch.onnx"
    _export(torch, model, torch.randn(2, 3, 12, 12), path, dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}})
    program = mlir_ansor.load(path)
    assert "func.func @main_graph(%arg0: tensor<?x3x12x12xf32>) -> tensor<?x10xf32>" in str(program.module)
    cm = mlir_ansor.compile(program)
    assert isinstance(cm, DynamicModule)
    for n in (1, 3):
        x = torch.randn(n, 3, 12, 12)
        with torch.no_grad():
            expected = model(x).numpy()
        np.testing.assert_allclose(cm(x.numpy()), expected, rtol=1e-4, atol=1e-5)
    assert sorted(v for sizes in cm.sizes for v in sizes.values()) == [1, 3]


def test_an_attention_whose_head_split_is_computed_by_shape_ops_compiles(onnx_model, torch, tmp_path):
    """``nn.MultiheadAttention`` exported by ``torch.onnx.export`` computes
    its head split's reshape from ``Shape``, ``Slice`` and ``Mod`` (ViT-B/16's
    attention); ONNX's shape inference does not follow ``Mod``, so torch-mlir
    refused the first op after it ("failed to legalize ... onnx.Transpose")
    until `onnx_shapes.fold_shapes` folded those graphs. Its projections, a
    ``MatMul`` of the 3-D input by a weight, arrive as a batch matmul of the
    weight broadcast along the tokens: they compile as one matmul
    (`normalize.unbatch_broadcast_matmuls`), not as a batch of copies."""

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    torch.manual_seed(0)
    model = Attention().eval()
    x = torch.randn(1, 7, 32)
    path = tmp_path / "attention.onnx"
    _export(torch, model, x, path)
    program = mlir_ansor.load(path)
    cm = mlir_ansor.compile(program)
    with torch.no_grad():
        expected = model(x).numpy()
    np.testing.assert_allclose(cm(x.numpy()), expected, rtol=1e-5, atol=1e-5)
    # the projection's weight is one 32x96 constant, not 7 copies of it
    assert "memref<32x96xf32>" in cm.mlir and "memref<7x32x96xf32>" not in cm.mlir


def test_fold_shapes_evaluates_shape_graphs_of_static_tensors():
    """A reshape whose target comes from ``Shape`` -> ``Slice`` -> ``Mod`` ->
    ``Concat``: shape inference alone leaves its result without a shape;
    folded, the graph is constants and the result is 4x6. A tensor whose
    dimension is named (dynamic) keeps its ``Shape``."""
    pytest.importorskip("onnx")
    import onnx
    from onnx import TensorProto, helper

    from mlir_ansor.importers.onnx_shapes import fold_shapes

    def const(name, values):
        return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64,
                                                                                   [len(values)], values))

    def graph(x_dims):
        nodes = [
            const("m", [-1]), const("three", [3]), const("end", [3]), const("minus_one", [-1]),
            helper.make_node("Mod", ["m", "three"], ["start"]),              # 2
            helper.make_node("Shape", ["x"], ["shape"]),
            helper.make_node("Slice", ["shape", "start", "end"], ["last"]),  # [6]
            helper.make_node("Concat", ["minus_one", "last"], ["target"], axis=0),
            helper.make_node("Reshape", ["x", "target"], ["y"]),
        ]
        g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_dims)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])

    def y_dims(model):
        t = next(v for v in model.graph.output if v.name == "y").type.tensor_type
        return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in t.shape.dim] if t.HasField("shape") \
            else None

    assert y_dims(onnx.shape_inference.infer_shapes(graph([2, 2, 6]))) is None
    folded, n = fold_shapes(graph([2, 2, 6]))
    assert n == 4  # Mod, Shape, Slice, Concat
    assert y_dims(folded) == [4, 6]
    assert [node.op_type for node in folded.graph.node].count("Reshape") == 1
    assert "Shape" not in [node.op_type for node in folded.graph.node]
    dynamic, _ = fold_shapes(graph(["batch", 2, 6]))
    assert "Shape" in [node.op_type for node in dynamic.graph.node]
