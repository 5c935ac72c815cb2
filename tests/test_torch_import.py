"""The PyTorch path: import a small torch.nn model with torch-mlir, extract
its tasks, tune a tiny budget, compile, and compare with PyTorch's output."""

from __future__ import annotations

import importlib.util
import re
import sys

import numpy as np
import pytest

import mlir_ansor
from mlir_ansor import TuneConfig
from mlir_ansor.compiler import compile_untuned
from mlir_ansor.errors import AnsorError
from mlir_ansor.measure.runner import TimingPolicy

TINY = TimingPolicy(warmup=0, min_repeat=1, max_repeat=2, min_time_s=0.001)


def test_missing_torch_mlir_names_the_extra(monkeypatch):
    from mlir_ansor.importers import pytorch as torch_import

    # None in sys.modules makes an import fail as if the package were absent.
    monkeypatch.setitem(sys.modules, "torch_mlir", None)
    monkeypatch.setitem(sys.modules, "torch_mlir.fx", None)
    # Without torch the first thing missing is torch itself.
    missing = "torch-mlir" if importlib.util.find_spec("torch") is not None else "torch"
    with pytest.raises(AnsorError, match=rf"import_module needs {missing}\b.*pip install -e '\.\[torch\]'"):
        torch_import.import_module(object(), ())
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(AnsorError, match=r"needs torch, which is not installed.*'torch' extra"):
        torch_import.require_torch("mlir_ansor.examples.models")


@pytest.fixture(scope="module")
def tiny(torch):
    from mlir_ansor.examples.models import tiny_cnn
    from mlir_ansor.importers.pytorch import import_module

    model, inputs = tiny_cnn(seed=3)
    with torch.no_grad():
        expected = model(*inputs).numpy()
    return import_module(model, inputs), inputs[0].numpy(), expected


def test_import_and_extract_tasks(tiny):
    text, _, _ = tiny
    assert "func.func @main" in text and "dense_resource" in text
    tasks = mlir_ansor.extract_tasks(mlir_ansor.load(text=text))
    kinds = [t.kind for t in tasks]
    # conv + batch norm + ReLU is one task (the norm's arithmetic fused after
    # the convolution), channel-last (graph.layout), the linear layer
    # another (bias fused), then softmax
    (conv,) = [t for t in tasks if t.kind == "convolution"]
    assert conv.anchor_op == "linalg.conv_2d_nhwc_hwcf"
    assert conv.name.endswith("_relu") and conv.inputs[0].shape == (1, 10, 10, 3)  # the padded image, NHWC
    assert kinds.index("convolution") < kinds.index("contraction")
    assert [t for t in tasks if t.kind == "contraction"][0].name.endswith("_add")
    assert kinds.count("reduction") == 2  # softmax: max and sum
    # the weight transposes and the batch-norm factors are computed from
    # constants only: no tasks; the two layout changes of activations stay
    # (the input to NHWC, the flattened output back to NCHW order)
    assert sorted(t.name for t in tasks if "transpose" in t.name) == ["transpose_1x10x10x3_f32", "transpose_1x8x8x8_f32"]
    assert all(s.dtype == "f32" for t in tasks for s in t.inputs + t.outputs)


@pytest.mark.slow
def test_tune_compile_and_compare_with_torch(tiny, tmp_path):
    text, x, expected = tiny
    program = mlir_ansor.load(text=text)
    db = tmp_path / "tiny.db"
    config = TuneConfig(trials=6, batch_size=3, build_workers=2, timing=TINY, seed=1, build_timeout_s=20)
    result = mlir_ansor.tune(program, config=config, db=db)
    assert sum(t.trials for t in result.tasks) >= 6
    assert any(t.best_knobs for t in result.tasks)
    cm = mlir_ansor.compile(program, db=db)
    assert "tuned" in {k.source for k in cm.kernels}
    out = cm(x)
    assert out.shape == expected.shape == (1, 16)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(out.sum(), 1.0, rtol=1e-5)  # a softmax
    np.testing.assert_allclose(out, compile_untuned(mlir_ansor.load(text=text))(x), rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("kernel, stride, padding, output_padding", [(4, 2, 1, 0), (3, 2, 1, 1), (2, 2, 0, 0)])
def test_transposed_conv_from_torch_skips_the_zeros(torch, tmp_path, kernel, stride, padding, output_padding):
    """torch-mlir writes ConvTranspose2d as a convolution of the input with
    zeros inserted between its pixels; normalization turns it into phases of
    1x1 convolutions that skip them (graph/split_conv.py)."""
    from mlir_ansor.importers.pytorch import import_module

    torch.manual_seed(0)
    model = torch.nn.ConvTranspose2d(8, 16, kernel, stride=stride, padding=padding, output_padding=output_padding).eval()
    x = torch.randn(1, 8, 5, 6)
    with torch.no_grad():
        expected = model(x).numpy()
    program = mlir_ansor.load(text=import_module(model, (x,)))
    convs = [t for t in mlir_ansor.extract_tasks(program) if t.kind == "convolution"]
    assert convs and all("x1x1x8_f32" in t.name for t in convs)  # 1x1 convolutions over 8 channels
    # Each input pixel meets each tap at most once: no product with a zero.
    assert sum(t.flops * t.weight for t in convs) <= 2 * 5 * 6 * 8 * 16 * kernel * kernel
    db = tmp_path / "t.db"
    mlir_ansor.tune(program, config=TuneConfig(trials=4, batch_size=2, build_workers=2, timing=TINY, seed=1, build_timeout_s=20), db=db)
    out = mlir_ansor.compile(program, db=db)(x.numpy())
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("layer", ["group_norm", "bilinear", "attention", "two_attentions"])
def test_layers_with_integer_or_boolean_steps_compile(torch, layer):
    """Index arithmetic (i64) and masks (i1) stay out of tasks, lowered as
    loops, masks stored as bytes; the float ops around them are tasks. Two
    attentions share their masks' empty tensor, and the second's mask
    buffer is a copy of the first's: both are widened (a ViT-B/16 aborted
    the lowering on an i1 store)."""
    from mlir_ansor.importers.pytorch import import_module

    torch.manual_seed(0)
    if layer == "group_norm":
        model, x = torch.nn.GroupNorm(4, 16), torch.randn(1, 16, 6, 6)
    elif layer == "bilinear":
        model, x = torch.nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False), torch.randn(1, 8, 6, 6)
    else:

        class SelfAttention(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.mha = torch.nn.MultiheadAttention(32, 4, batch_first=True)

            def forward(self, x):
                y = self.mha(x, x, x, need_weights=False)[0]
                return self.mha(y, y, y, need_weights=False)[0] if layer == "two_attentions" else y

        model, x = SelfAttention(), torch.randn(1, 6, 32)
    model = model.eval()
    with torch.no_grad():
        expected = model(x).numpy()
    program = mlir_ansor.load(text=import_module(model, (x,)))
    assert mlir_ansor.extract_tasks(program)
    np.testing.assert_allclose(mlir_ansor.compile(program, db=None)(x.numpy()), expected, rtol=1e-4, atol=1e-5)


def test_a_concatenation_of_convolutions_compiles_channel_last(torch):
    """``torch.cat`` (``tensor.concat``) of two convolutions along the
    channels: the layout pass sinks their transposes through it, so the
    next convolution reads it channel-last with no transpose between, and
    it becomes slices the driver fills (`graph.normalize.decompose_concats`)."""
    from mlir_ansor.importers.pytorch import import_module

    class Branches(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Conv2d(8, 16, 3, padding=1)
            self.b = torch.nn.Conv2d(8, 12, 1)
            self.c = torch.nn.Conv2d(28, 8, 3, padding=1)

        def forward(self, x):
            return self.c(torch.cat([torch.relu(self.a(x)), self.b(x)], dim=1)) + x

    torch.manual_seed(0)
    model, x = Branches().eval(), torch.randn(1, 8, 10, 10)
    with torch.no_grad():
        expected = model(x).numpy()
    text = import_module(model, (x,))
    assert "tensor.concat" in text
    program = mlir_ansor.load(text=text)
    names = [t.name for t in mlir_ansor.extract_tasks(program)]
    assert sum(n.startswith("conv_2d_nhwc_hwcf") for n in names) == 3
    # The input's transposes (padded for the 3x3, plain for the 1x1) and the output's (with the residual
    # add): none around the concatenation.
    assert [n for n in names if n.startswith("transpose")] == [
        "transpose_1x12x12x8_f32", "transpose_1x10x10x8_f32", "transpose_1x8x10x10_f32_add"]
    cm = mlir_ansor.compile(mlir_ansor.load(text=text), db=None, cache_dir=False)
    np.testing.assert_allclose(cm(x.numpy()), expected, rtol=1e-4, atol=1e-5)
    # The two branches write their slices of the concatenation in place (`passes.drivers.views_into_kernels`,
    # the concatenation's buffer moved before the calls that fill it), not into buffers copied there after.
    from mlir import ir, passmanager

    from mlir_ansor.passes.drivers import forward_output_copies, views_into_kernels
    from mlir_ansor.passes.lowering import _front

    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(cm.mlir)
        passmanager.PassManager.parse(f"builtin.module({_front()})").run(m.operation)
        forward_output_copies(m)
        assert views_into_kernels(m) == 2
        m.operation.verify()


def test_a_dense_block_writes_each_layer_once_into_one_growing_tensor(torch):
    """DenseNet's dense block: layer k reads the concatenation of the input
    and every earlier layer's output. The concatenations share one tensor of
    the last one's size, each a leading slice of it, so each output is
    written into it once (`graph.normalize.decompose_concats`), and the
    driver's bufferization writes it in place (the kernels' stand-in bodies,
    `compiler._stub_kernel_bodies`): DenseNet-121 went from 711 copies per
    call, 25.6 M elements, to 68 copies of 5.8 M, and ran 1.11x faster."""
    from conftest import lowered_driver

    from mlir_ansor.importers.pytorch import import_module

    class Dense(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Conv2d(8 + 4 * k, 4, 3, padding=1) for k in range(3))
            self.out = torch.nn.Conv2d(20, 8, 1)

        def forward(self, x):
            features = [x]
            for layer in self.layers:
                features.append(torch.relu(layer(torch.cat(features, 1))))
            return self.out(torch.cat(features, 1))

    torch.manual_seed(0)
    model, x = Dense().eval(), torch.randn(1, 8, 6, 6)
    with torch.no_grad():
        expected = model(x).numpy()
    text = import_module(model, (x,))
    cm = mlir_ansor.compile(mlir_ansor.load(text=text), db=None, cache_dir=False)
    np.testing.assert_allclose(cm(x.numpy()), expected, rtol=1e-4, atol=1e-5)
    driver, _ = lowered_driver(cm.mlir)
    # each of the four joined tensors is copied in once (each concatenation
    # apart: 1 + 2 + 3 + 4 copies), and nothing copies the 20 channels whole
    # (the others fill the 3x3 convolutions' zero-padded 8x8 inputs)
    copies = [line.strip() for line in driver.splitlines() if "memref.copy" in line]
    joined = [c for c in copies if re.search(r"to memref<1x\d+x6x6xf32, strided<\[\d+, 36, 6, 1\]", c)
              or re.search(r"to memref<1x6x6x\d+xf32, strided<\[720, 120, 20, 1\]", c)]
    assert len(joined) == 4, copies
    assert not [c for c in copies if re.search(r"to memref<1x(20x6x6|6x6x20)xf32>$", c)], copies


def test_an_embedding_compiles_and_an_id_out_of_range_reads_the_last_row(torch):
    """``nn.Embedding`` checks its ids in its body (``cf.assert``); they
    become clamps (`graph.normalize.clamp_gathers`): the module computes
    torch's output, and an id past the table reads its last row, not memory
    beyond it."""
    from mlir_ansor.importers.pytorch import import_module

    class Tokens(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(50, 16)
            self.out = torch.nn.Linear(16, 8)

        def forward(self, ids):
            return self.out(torch.relu(self.emb(ids)))

    torch.manual_seed(0)
    model, ids = Tokens().eval(), torch.randint(0, 50, (2, 5))
    text = import_module(model, (ids,))
    assert "cf.assert" in text
    cm = mlir_ansor.compile(mlir_ansor.load(text=text), db=None, cache_dir=False)
    with torch.no_grad():
        np.testing.assert_allclose(cm(ids.numpy()), model(ids).numpy(), rtol=1e-5, atol=1e-5)
        far = np.array([[3, 49, 1000, -7, 0]] * 2, dtype=np.int64)
        want = model(torch.from_numpy(far.clip(0, 49))).numpy()
    np.testing.assert_allclose(cm(far), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer", ["causal_attention", "roll"])
def test_masks_made_of_constants_and_slices_joined_through_casts(torch, layer):
    """``scaled_dot_product_attention(is_causal=True)``: its mask is built
    from a constant ``tensor<10x10xi1>``, a global of booleans the lowering
    stores as bytes (`passes.drivers.widen_bool_buffers`; LLVM aborted on
    its i1 loads). ``torch.roll``: two slices cast to ``tensor<6x?xf32>``
    and joined (`graph.normalize.decompose_concats` reads through the casts)."""
    import torch.nn.functional as F

    from mlir_ansor.importers.pytorch import import_module

    class Layer(torch.nn.Module):
        def forward(self, *xs):
            if layer == "roll":
                return torch.roll(xs[0], 3, 1) * 2
            return F.scaled_dot_product_attention(*xs, is_causal=True)

    torch.manual_seed(0)
    xs = (torch.randn(6, 16),) if layer == "roll" else tuple(torch.randn(2, 4, 10, 16) for _ in range(3))
    with torch.no_grad():
        expected = Layer()(*xs).numpy()
    text = import_module(Layer(), xs)
    assert ("tensor<10x10xi1>" in text) if layer != "roll" else ("tensor<6x?xf32>" in text)
    out = mlir_ansor.compile(mlir_ansor.load(text=text), db=None, cache_dir=False)(*(x.numpy() for x in xs))
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_ops_torch_mlir_lowers_to_tm_tensor_are_named(torch):
    """torch.cumsum becomes ``tm_tensor.scan``, which is not Linalg: an
    error naming it and the torch ops it comes from, not a parse error."""
    from mlir_ansor.errors import UnsupportedError
    from mlir_ansor.importers.pytorch import import_module

    class Cumsum(torch.nn.Module):
        def forward(self, x):
            return torch.cumsum(x, 1)

    with pytest.raises(UnsupportedError, match=r"Cumsum to its TMTensor dialect, not to Linalg: tm_tensor.scan \(from torch.cumsum"):
        import_module(Cumsum(), (torch.randn(3, 5),))
