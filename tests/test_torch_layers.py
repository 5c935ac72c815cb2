"""PyTorch layers a model brings, each imported through torch-mlir, compiled
with the default schedules and compared with PyTorch: static shapes, and a
few with a dynamic dimension at sizes that were not the traced one. Each
case is a layer some model of torchvision or a decoder uses that once failed
or that no other test covers (slices joined, gathers, masks, windows,
recurrences)."""

from __future__ import annotations

import numpy as np
import pytest

import mlir_ansor


def _wrap(torch, f):
    class Layer(torch.nn.Module):
        def forward(self, x):
            return f(x)

    return Layer()


def _static_cases(torch):
    F, nn = torch.nn.functional, torch.nn
    x4, x3, x2 = torch.randn(1, 8, 12, 12), torch.randn(2, 10, 16), torch.randn(6, 16)
    return {
        "stack": (_wrap(torch, lambda a: torch.stack([a, a * 2], 1)), x2),
        "chunk": (_wrap(torch, lambda a: sum(torch.chunk(a, 4, dim=1))), x2),
        "flip": (_wrap(torch, lambda a: torch.flip(a, [1]) + a), x2),
        "repeat": (_wrap(torch, lambda a: a.repeat(2, 3)), x2),
        "argmax": (_wrap(torch, lambda a: torch.argmax(a, 1)), x2),
        "where": (_wrap(torch, lambda a: torch.where(a > 0, a, a * 0.1)), x2),
        "index_select": (_wrap(torch, lambda a: torch.index_select(a, 0, torch.tensor([0, 3, 5]))), x2),
        "einsum": (_wrap(torch, lambda a: torch.einsum("bik,bjk->bij", a, a)), x3),
        "pixel_shuffle": (nn.PixelShuffle(2), x4),
        "upsample_nearest": (nn.Upsample(scale_factor=2, mode="nearest"), x4),
        "adaptive_avg_pool": (nn.AdaptiveAvgPool2d((3, 3)), x4),
        "max_pool_ceil": (nn.MaxPool2d(3, 2, ceil_mode=True), x4),
        "reflect_pad": (_wrap(torch, lambda a: F.pad(a, (1, 2, 1, 2), mode="reflect")), x4),
        "conv1d": (nn.Conv1d(10, 12, 3), x3),
        "instance_norm": (nn.InstanceNorm2d(8), x4),
        "log_softmax": (_wrap(torch, lambda a: F.log_softmax(a, -1)), x2),
        "lstm": (nn.LSTM(16, 8, batch_first=True), x3),
        # A squeeze-excitation: 1x1 convolutions on a 1x1 image with a bias, 26 channels (a peeled register tile).
        "squeeze_excitation": (nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Conv2d(8, 26, 1), nn.ReLU(), nn.Conv2d(26, 8, 1)), x4),
    }


_STATIC = ["stack", "chunk", "flip", "repeat", "argmax", "where", "index_select", "einsum", "pixel_shuffle",
           "upsample_nearest", "adaptive_avg_pool", "max_pool_ceil", "reflect_pad", "conv1d", "instance_norm",
           "log_softmax", "lstm", "squeeze_excitation"]


@pytest.mark.parametrize("name", _STATIC)
def test_a_layer_compiles_to_what_torch_computes(torch, name):
    from mlir_ansor.importers.pytorch import import_module

    torch.manual_seed(0)
    model, x = _static_cases(torch)[name]
    model = model.eval()
    with torch.no_grad():
        want = model(x)
    want = (want[0] if isinstance(want, tuple) else want).numpy()
    cm = mlir_ansor.compile(mlir_ansor.load(text=import_module(model, (x,))), db=None, cache_dir=False)
    got = cm(x.numpy())
    got = got[0] if isinstance(got, tuple) else got
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["causal_attention", "conv_batch", "embedding", "concat_batch"])
def test_a_layer_of_a_dynamic_size_compiles_at_sizes_it_was_not_traced_at(torch, name):
    from torch.export import Dim

    from mlir_ansor.importers.pytorch import import_module

    F, nn = torch.nn.functional, torch.nn
    torch.manual_seed(0)
    model, make, dim = {
        "causal_attention": (_wrap(torch, lambda q: F.scaled_dot_product_attention(q, q * 2, q, is_causal=True)),
                             lambda n: torch.randn(1, 2, n, 16), 2),
        "conv_batch": (nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2)),
                       lambda n: torch.randn(n, 4, 8, 8), 0),
        "embedding": (nn.Embedding(50, 8), lambda n: torch.randint(0, 50, (1, n)), 1),
        "concat_batch": (_wrap(torch, lambda a: torch.cat([F.relu(a), a * 2], 1).sum(1)), lambda n: torch.randn(n, 4, 3, 3), 0),
    }[name]
    model = model.eval()
    text = import_module(model, (make(8),), dynamic_shapes=({dim: Dim("n", min=2, max=64)},))
    cm = mlir_ansor.compile(mlir_ansor.load(text=text), db=None, cache_dir=False)
    for n in (3, 13):
        x = make(n)
        with torch.no_grad():
            want = model(x).numpy()
        np.testing.assert_allclose(cm(x.numpy()), want, rtol=1e-4, atol=1e-5)
