"""Example PyTorch models, written in plain ``torch.nn`` with seeded random
weights, and a command line that writes their Linalg MLIR to a file.

Why our own definitions: nothing is downloaded (no torchvision, no
pretrained weights), so the examples run on a machine without network, and
the tests and benchmarks can rebuild exactly the same network from a seed.

Models (:data:`MODELS` maps each name to a function that returns the module,
in eval mode, and its example inputs):

* ``resnet50``: ResNet-50 v1.5 (bottleneck blocks 3-4-6-3, stride on the
  3x3 convolution), batch 1, 3x224x224, 1000 classes.
* ``bert_layer``: one BERT-base encoder layer (hidden 768, 12 heads, FFN
  3072, GELU, post-LayerNorm), batch 1, sequence 128.
* ``tiny_cnn``: conv + batch norm + ReLU, a linear layer and a softmax on an
  8x8 image: small enough for tests.

This module needs torch; importing it without torch raises
:class:`~mlir_ansor.errors.AnsorError` naming the extra to install.

Command line::

    python -m mlir_ansor.examples.models resnet50 -o resnet50.mlir
    python -m mlir_ansor.examples.models bert_layer -o bert.mlir --seed 1
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

from mlir_ansor.importers.pytorch import require_torch

torch = require_torch("mlir_ansor.examples.models")
nn = torch.nn
F = torch.nn.functional

__all__ = [
    "MODELS",
    "BertLayer",
    "ResNet50",
    "TinyCNN",
    "bert_layer",
    "main",
    "resnet50",
    "tiny_cnn",
]


# --------------------------------------------------------------------------
# ResNet-50.


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carries the stride), 1x1 expand; each followed by
    batch norm, ReLU after the first two and after the residual add."""

    expansion = 4

    def __init__(self, in_ch: int, width: int, stride: int) -> None:
        super().__init__()
        out_ch = width * self.expansion
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.downsample: nn.Module | None = None
        if stride != 1 or in_ch != out_ch:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False), nn.BatchNorm2d(out_ch)
            )

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return F.relu(y + identity)


class ResNet50(nn.Module):
    """ResNet-50 for 224x224 images (the torchvision layout, written out)."""

    def __init__(self, num_classes: int = 1000, layers: tuple[int, ...] = (3, 4, 6, 3)) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        blocks: list[nn.Module] = []
        in_ch = 64
        for stage, count in enumerate(layers):
            width = 64 * 2**stage
            for i in range(count):
                stride = 2 if (stage > 0 and i == 0) else 1
                blocks.append(Bottleneck(in_ch, width, stride))
                in_ch = width * Bottleneck.expansion
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(in_ch, num_classes)

    def forward(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.blocks(x)
        x = torch.mean(x, dim=(2, 3))
        return self.fc(x)


# --------------------------------------------------------------------------
# BERT encoder layer.


class BertLayer(nn.Module):
    """One BERT encoder layer: self-attention (scaled dot product, softmax),
    output projection, residual + LayerNorm, FFN (GELU), residual + LayerNorm."""

    def __init__(self, hidden: int = 768, heads: int = 12, ffn: int = 3072, eps: float = 1e-12) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} is not a multiple of the {heads} heads")
        self.heads = heads
        self.head_dim = hidden // heads
        self.query = nn.Linear(hidden, hidden)
        self.key = nn.Linear(hidden, hidden)
        self.value = nn.Linear(hidden, hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.ln1 = nn.LayerNorm(hidden, eps=eps)
        self.ffn_in = nn.Linear(hidden, ffn)
        self.ffn_out = nn.Linear(ffn, hidden)
        self.ln2 = nn.LayerNorm(hidden, eps=eps)

    def _split(self, x):
        b, s, _ = x.shape
        return x.reshape(b, s, self.heads, self.head_dim).permute(0, 2, 1, 3)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self._split(self.query(x)), self._split(self.key(x)), self._split(self.value(x))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        probs = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(probs, v).permute(0, 2, 1, 3).reshape(b, s, h)
        x = self.ln1(x + self.attn_out(ctx))
        return self.ln2(x + self.ffn_out(F.gelu(self.ffn_in(x))))


# --------------------------------------------------------------------------
# A small network for tests.


class TinyCNN(nn.Module):
    """conv 3x3 (padding 1) + batch norm + ReLU, flatten, linear, softmax."""

    def __init__(self, channels: int = 8, size: int = 8, classes: int = 16) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, channels, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)
        self.fc = nn.Linear(channels * size * size, classes)

    def forward(self, x):
        y = F.relu(self.bn(self.conv(x)))
        return torch.softmax(self.fc(y.flatten(1)), dim=-1)


# --------------------------------------------------------------------------
# Factories.


def _randomize_norms(model: nn.Module, gen: torch.Generator) -> None:
    """Give batch norms non-trivial running statistics and affine weights,
    so that a wrong folding of them cannot go unnoticed."""
    for m in model.modules():
        if isinstance(m, (nn.BatchNorm2d, nn.LayerNorm)):
            with torch.no_grad():
                m.weight.copy_(1.0 + 0.1 * torch.randn(m.weight.shape, generator=gen))
                m.bias.copy_(0.1 * torch.randn(m.bias.shape, generator=gen))
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.copy_(0.1 * torch.randn(m.running_mean.shape, generator=gen))
                    m.running_var.copy_(1.0 + 0.1 * torch.rand(m.running_var.shape, generator=gen))


def _build(cls: Callable[[], nn.Module], inputs: Callable[[torch.Generator], tuple], seed: int):
    torch.manual_seed(seed)
    model = cls()
    gen = torch.Generator().manual_seed(seed + 1)
    _randomize_norms(model, gen)
    return model.eval(), inputs(gen)


def resnet50(seed: int = 0) -> tuple[nn.Module, tuple]:
    """(ResNet-50 with seeded random weights, in eval mode; its input 1x3x224x224)."""
    return _build(ResNet50, lambda g: (torch.randn(1, 3, 224, 224, generator=g),), seed)


def bert_layer(seed: int = 0) -> tuple[nn.Module, tuple]:
    """(a BERT-base encoder layer with seeded random weights; its input 1x128x768)."""
    return _build(BertLayer, lambda g: (torch.randn(1, 128, 768, generator=g),), seed)


def tiny_cnn(seed: int = 0) -> tuple[nn.Module, tuple]:
    """(the small test network; its input 1x3x8x8)."""
    return _build(TinyCNN, lambda g: (torch.randn(1, 3, 8, 8, generator=g),), seed)


MODELS: dict[str, Callable[..., tuple[nn.Module, tuple]]] = {
    "resnet50": resnet50,
    "bert_layer": bert_layer,
    "tiny_cnn": tiny_cnn,
}
"""Model name -> factory(seed) returning (module in eval mode, example inputs)."""


def dynamic_shapes(inputs: tuple, dims: list[str], max_size: int = 4096) -> tuple:
    """``torch.export``'s ``dynamic_shapes`` for `inputs` with the dimensions
    named ``ARG.DIM`` (0-based, as ``--sizes`` names them) dynamic, each a
    ``torch.export.Dim`` of its own from 2 to `max_size` (torch.export
    specializes sizes 0 and 1)."""
    spec: list[dict | None] = [None] * len(inputs)
    for text in dims:
        try:
            arg, dim = (int(x) for x in text.split("."))
        except ValueError:
            raise SystemExit(f"--dynamic {text}: expected ARG.DIM, for example 0.1") from None
        if not (0 <= arg < len(inputs)) or not (0 <= dim < inputs[arg].dim()):
            raise SystemExit(f"--dynamic {text}: the inputs have shapes {[tuple(x.shape) for x in inputs]}")
        spec[arg] = {**(spec[arg] or {}), dim: torch.export.Dim(f"arg{arg}_dim{dim}", min=2, max=max_size)}
    return tuple(spec)


def main(argv: list[str] | None = None) -> int:
    """``python -m mlir_ansor.examples.models NAME -o FILE.mlir``: write a model's
    Linalg-on-tensors MLIR (weights as ``dense_resource`` blobs)."""
    from mlir_ansor.importers.pytorch import import_module

    parser = argparse.ArgumentParser(
        prog="python -m mlir_ansor.examples.models",
        description="Write an example PyTorch model as Linalg-on-tensors MLIR (seeded random weights).",
    )
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("-o", "--output", default="-", help="output file (default: stdout)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and the example input")
    parser.add_argument("--dynamic", action="append", default=[], metavar="ARG.DIM",
                        help="leave this dimension of an input dynamic (tensor<1x?x768xf32>), for example 0.1: the "
                             "BERT layer's sequence length; each one a size of its own, from 2 to 4096")
    args = parser.parse_args(argv)
    model, inputs = MODELS[args.model](args.seed)
    text = import_module(model, inputs, dynamic_shapes=dynamic_shapes(inputs, args.dynamic) if args.dynamic else None)
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as f:
            f.write(text)
        print(f"wrote {args.output} ({len(text) / 1e6:.1f} MB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
