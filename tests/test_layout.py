"""Channel-last layout (mlir_ansor.graph.layout): NCHW convolutions and
poolings as torch-mlir writes them, converted to NHWC, with the transposes
between layers sunk until they cancel; outputs checked against the
untransformed module."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import filecheck
from mlir import ir

from mlir_ansor.compiler import compile_untuned
from mlir_ansor.graph import normalize as normalize_mod
from mlir_ansor.graph.layout import convert_layout
from mlir_ansor.graph.normalize import normalize
from mlir_ansor.graph.task import extract_tasks
from mlir_ansor.ir.program import load

_ID = "affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>"
_CH = "affine_map<(d0, d1, d2, d3) -> (d1, 0, 0)>"
_PAR4 = '["parallel", "parallel", "parallel", "parallel"]'


def _dense(rng: np.random.Generator, size: int, low: float = -1.0, high: float = 1.0) -> str:
    values = rng.uniform(low, high, size=size).astype(np.float32)
    return f"dense<[{', '.join(f'{v:.6e}' for v in values)}]> : tensor<{size}xf32>"


def _t(shape: tuple[int, ...]) -> str:
    return f"tensor<{'x'.join(map(str, shape))}xf32>"


class _Net:
    """Text of a small NCHW network written the way torch-mlir writes one."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.lines: list[str] = []
        self.n = 0

    def name(self) -> str:
        self.n += 1
        return f"%v{self.n}"

    def const(self, shape: tuple[int, ...], low: float = -1.0, high: float = 1.0) -> str:
        flat, v = self.name(), self.name()
        size = int(np.prod(shape))
        self.lines.append(f"{flat} = arith.constant {_dense(self.rng, size, low, high)}")
        groups = "[[" + ", ".join(map(str, range(len(shape)))) + "]]"
        self.lines.append(
            f"{v} = tensor.expand_shape {flat} {groups} output_shape {list(shape)} : tensor<{size}xf32> into {_t(shape)}"
        )
        return v

    def filled(self, shape: tuple[int, ...], value: str = "%zero") -> str:
        e, f = self.name(), self.name()
        self.lines.append(f"{e} = tensor.empty() : {_t(shape)}")
        self.lines.append(f"{f} = linalg.fill ins({value} : f32) outs({e} : {_t(shape)}) -> {_t(shape)}")
        return f

    def conv(self, x: str, shape: tuple[int, ...], f: int, k: int, stride: int = 1, dilation: int = 1, filt: str | None = None) -> tuple[str, tuple]:
        n, c, h, w = shape
        ext = dilation * (k - 1) + 1
        out = (n, f, (h - ext) // stride + 1, (w - ext) // stride + 1)
        filt = filt or self.const((f, c, k, k))
        init = self.filled(out)
        r = self.name()
        self.lines.append(
            f"{r} = linalg.conv_2d_nchw_fchw {{dilations = dense<{dilation}> : vector<2xi64>, strides = dense<{stride}> : vector<2xi64>}}"
            f" ins({x}, {filt} : {_t(shape)}, {_t((f, c, k, k))}) outs({init} : {_t(out)}) -> {_t(out)}"
        )
        return r, out

    def binary(self, op: str, x: str, y: str, shape: tuple[int, ...], broadcast: bool) -> str:
        e, r = self.name(), self.name()
        ytype = _t((shape[1], 1, 1)) if broadcast else _t(shape)
        self.lines.append(f"{e} = tensor.empty() : {_t(shape)}")
        self.lines.append(
            f"{r} = linalg.generic {{indexing_maps = [{_ID}, {_CH if broadcast else _ID}, {_ID}], iterator_types = {_PAR4}}}"
            f" ins({x}, {y} : {_t(shape)}, {ytype}) outs({e} : {_t(shape)}) {{\n"
            f"^bb0(%a: f32, %b: f32, %o: f32):\n  %s = arith.{op} %a, %b : f32\n  linalg.yield %s : f32\n}} -> {_t(shape)}"
        )
        return r

    def batch_norm(self, x: str, shape: tuple[int, ...]) -> str:
        ch = (shape[1], 1, 1)
        y = self.binary("subf", x, self.const(ch, -0.2, 0.2), shape, True)
        y = self.binary("mulf", y, self.const(ch, 0.8, 1.2), shape, True)
        y = self.binary("mulf", y, self.const(ch, 0.8, 1.2), shape, True)
        return self.binary("addf", y, self.const(ch, -0.2, 0.2), shape, True)

    def relu(self, x: str, shape: tuple[int, ...]) -> str:
        e, r = self.name(), self.name()
        self.lines.append(f"{e} = tensor.empty() : {_t(shape)}")
        self.lines.append(
            f"{r} = linalg.generic {{indexing_maps = [{_ID}, {_ID}], iterator_types = {_PAR4}}}"
            f" ins({x} : {_t(shape)}) outs({e} : {_t(shape)}) {{\n"
            f"^bb0(%a: f32, %o: f32):\n  %c = arith.cmpf ugt, %a, %zero : f32\n  %s = arith.select %c, %a, %zero : f32\n"
            f"  linalg.yield %s : f32\n}} -> {_t(shape)}"
        )
        return r

    def pad(self, x: str, shape: tuple[int, ...], p: int, value: str = "%zero") -> tuple[str, tuple]:
        r = self.name()
        out = (shape[0], shape[1], shape[2] + 2 * p, shape[3] + 2 * p)
        self.lines.append(
            f"{r} = tensor.pad {x} low[0, 0, {p}, {p}] high[0, 0, {p}, {p}] {{\n"
            f"^bb0(%i0: index, %i1: index, %i2: index, %i3: index):\n  tensor.yield {value} : f32\n"
            f"}} : {_t(shape)} to {_t(out)}"
        )
        return r, out

    def max_pool(self, x: str, shape: tuple[int, ...], k: int, stride: int, kind: str = "max") -> tuple[str, tuple]:
        n, c, h, w = shape
        out = (n, c, (h - k) // stride + 1, (w - k) // stride + 1)
        init = self.filled(out, "%ninf" if kind == "max" else "%zero")
        win, r = self.name(), self.name()
        self.lines.append(f"{win} = tensor.empty() : tensor<{k}x{k}xf32>")
        self.lines.append(
            f"{r} = linalg.pooling_nchw_{kind} {{dilations = dense<1> : vector<2xi64>, strides = dense<{stride}> : vector<2xi64>}}"
            f" ins({x}, {win} : {_t(shape)}, tensor<{k}x{k}xf32>) outs({init} : {_t(out)}) -> {_t(out)}"
        )
        return r, out

    def text(self, args: list[tuple[str, tuple]], result: str, result_shape: tuple) -> str:
        sig = ", ".join(f"{a}: {_t(s)}" for a, s in args)
        head = [
            "%zero = arith.constant 0.0 : f32",
            "%ninf = arith.constant 0xFF800000 : f32",
        ]
        body = "\n    ".join(head + self.lines + [f"return {result} : {_t(result_shape)}"])
        return f"func.func @main({sig}) -> {_t(result_shape)} {{\n    {body}\n}}\n"


def resnet_like(seed: int = 0, pool: str = "max") -> str:
    """conv 3x3 (padded input) + BN + ReLU, padded pooling, a bottleneck-ish
    block (1x1 conv + BN, 3x3 conv + BN, residual add with the pool's
    output, ReLU), a strided dilated conv, flatten and a linear layer."""
    net = _Net(seed)
    x0 = (1, 3, 10, 10)
    p, s = net.pad("%x", x0, 1)
    y, s = net.conv(p, s, 8, 3)  # 1x8x10x10
    y = net.relu(net.batch_norm(y, s), s)
    p, s = net.pad(y, s, 1, "%ninf" if pool == "max" else "%zero")
    skip, s = net.max_pool(p, s, 3, 2, pool)  # 1x8x5x5
    y, _ = net.conv(skip, s, 8, 1)
    y = net.relu(net.batch_norm(y, s), s)
    p, ps = net.pad(y, s, 1)
    y, _ = net.conv(p, ps, 8, 3)
    y = net.batch_norm(y, s)
    y = net.relu(net.binary("addf", y, skip, s, False), s)
    y, s = net.conv(y, s, 6, 2, stride=2, dilation=2)  # 1x6x2x2
    y = net.relu(y, s)
    flat = net.name()
    net.lines.append(f"{flat} = tensor.collapse_shape {y} [[0], [1, 2, 3]] : {_t(s)} into tensor<1x24xf32>")
    w = net.const((24, 5))
    init = net.filled((1, 5))
    out = net.name()
    net.lines.append(f"{out} = linalg.matmul ins({flat}, {w} : tensor<1x24xf32>, tensor<24x5xf32>) outs({init} : tensor<1x5xf32>) -> tensor<1x5xf32>")
    return net.text([("%x", x0)], out, (1, 5))


def _body(module: ir.Module) -> list[ir.Operation]:
    fn = next(o.operation for o in module.body.operations if o.operation.name == "func.func")
    return [o.operation for o in fn.regions[0].blocks[0].operations]


def _from_input(v: ir.Value, memo: dict) -> bool:
    if isinstance(v, ir.BlockArgument):
        return True
    op = v.owner.operation
    if op not in memo:
        memo[op] = False
        memo[op] = any(_from_input(u, memo) for u in op.operands)
    return memo[op]


def _activation_transposes(ops: list[ir.Operation]) -> list[int]:
    """Positions (in `ops`) of the transposes of values computed from the
    function's arguments (filter transposes are of constants)."""
    memo: dict = {}
    return [k for k, op in enumerate(ops) if op.name == "linalg.transpose" and _from_input(op.operands[0], memo)]


def _run(text: str, x: np.ndarray, *, layout: bool) -> tuple[np.ndarray, str]:
    program = load(text=text)
    normalize(program.module, layout=layout)
    out = compile_untuned(program)(x)
    return out, str(program.module)


@pytest.fixture(scope="module")
def resnet_text() -> str:
    return resnet_like()


# Over a whole module: every convolution is channel-last (NHWC input, HWCF
# filter), and how many there are.
NO_CHANNEL_FIRST = """
CHECK-NOT: linalg.conv_2d_nchw_fchw
CHECK-NOT: linalg.pooling_nchw
"""
FOUR_CHANNEL_LAST_CONVS = """
CHECK-COUNT-4: linalg.conv_2d_nhwc_hwcf
CHECK-NOT:     linalg.conv_2d
"""


def test_no_transposes_between_consecutive_convolutions(resnet_text):
    program = load(text=resnet_text)
    fn = next(o.operation for o in program.module.body.operations)
    assert convert_layout(fn) > 0
    program.module.operation.verify()
    text = str(program.module)
    # One transpose into the first convolution (of the padded input,
    # NCHW -> NHWC: [0, 2, 3, 1]), one out of the last one (the flatten reads
    # NCHW order: [0, 3, 1, 2]); none in between: the filters' transposes
    # (FCHW -> HWCF) are [2, 3, 1, 0]. The later paddings moved to the NHWC
    # side (pads of H and W are dims 1 and 2); the batch norm reads its
    # per-channel constants on the last loop.
    filecheck(text, r"""
CHECK-DAG:   #[[ID:\w+]] = affine_map<(d0, d1, d2, d3) -> (d0, d1, d2, d3)>
CHECK-DAG:   #[[CH:\w+]] = affine_map<(d0, d1, d2, d3) -> (d3, 0, 0)>
CHECK-LABEL: func.func @main(
CHECK-SAME:    %[[X:\w+]]: tensor<1x3x10x10xf32>) -> tensor<1x5xf32>
CHECK:         %[[P:\w+]] = tensor.pad %[[X]] low[0, 0, 1, 1] high[0, 0, 1, 1]
CHECK:         %[[XT:\w+]] = linalg.transpose ins(%[[P]] : tensor<1x3x12x12xf32>) outs(%{{\w+}} : tensor<1x12x12x3xf32>) permutation = [0, 2, 3, 1]
CHECK:         %[[C1:\w+]] = linalg.conv_2d_nhwc_hwcf
CHECK-SAME:      ins(%[[XT]], %{{\w+}} : tensor<1x12x12x3xf32>, tensor<3x3x3x8xf32>) outs(%{{\w+}} : tensor<1x10x10x8xf32>)
CHECK-NOT:     permutation = [0,
CHECK:         linalg.generic {indexing_maps = [#[[ID]], #[[CH]], #[[ID]]]{{.*}} ins(%[[C1]], %{{\w+}} : tensor<1x10x10x8xf32>, tensor<8x1x1xf32>)
CHECK-NOT:     permutation = [0,
CHECK:         tensor.pad %{{\w+}} low[0, 1, 1, 0] high[0, 1, 1, 0]
CHECK-NOT:     permutation = [0,
CHECK:         %[[POOL:\w+]] = linalg.pooling_nhwc_max
CHECK-SAME:      ins(%{{\w+}}, %{{\w+}} : tensor<1x12x12x8xf32>, tensor<3x3xf32>) outs(%{{\w+}} : tensor<1x5x5x8xf32>)
CHECK-NOT:     permutation = [0,
CHECK:         linalg.conv_2d_nhwc_hwcf {{.*}}ins(%[[POOL]], %{{\w+}} : tensor<1x5x5x8xf32>, tensor<1x1x8x8xf32>)
CHECK-NOT:     permutation = [0,
CHECK:         tensor.pad %{{\w+}} low[0, 1, 1, 0] high[0, 1, 1, 0]
CHECK-NOT:     permutation = [0,
CHECK:         linalg.conv_2d_nhwc_hwcf {{.*}}: tensor<1x7x7x8xf32>, tensor<3x3x8x8xf32>)
CHECK-NOT:     permutation = [0,
CHECK:         linalg.generic {indexing_maps = [#[[ID]], #[[ID]], #[[ID]]]{{.*}} ins(%{{\w+}}, %[[POOL]] :
CHECK-NOT:     permutation = [0,
CHECK:         linalg.conv_2d_nhwc_hwcf {dilations = dense<2> : tensor<2xi64>, strides = dense<2> : tensor<2xi64>}
CHECK-SAME:      : tensor<1x5x5x8xf32>, tensor<2x2x8x6xf32>) outs(%{{\w+}} : tensor<1x2x2x6xf32>)
CHECK:         %[[Y:\w+]] = linalg.transpose ins(%{{\w+}} : tensor<1x2x2x6xf32>) outs(%{{\w+}} : tensor<1x6x2x2xf32>) permutation = [0, 3, 1, 2]
CHECK-NEXT:    tensor.collapse_shape %[[Y]] {{\[\[}}0], [1, 2, 3]] : tensor<1x6x2x2xf32> into tensor<1x24xf32>
CHECK-NOT:     permutation = [0,
CHECK:         return
""")
    filecheck(text, NO_CHANNEL_FIRST)
    filecheck(text, FOUR_CHANNEL_LAST_CONVS)
    # the same by data flow: the transposes of values computed from the
    # input (not of constant filters) are the first and the last one
    ops = _body(program.module)
    convs = [k for k, op in enumerate(ops) if op.name == "linalg.conv_2d_nhwc_hwcf"]
    acts = _activation_transposes(ops)
    assert len(acts) == 2 and acts[0] < convs[0] and acts[1] > convs[-1]


def test_converted_network_computes_the_same(resnet_text):
    x = np.random.default_rng(1).standard_normal((1, 3, 10, 10)).astype(np.float32)
    want = compile_untuned(load(text=resnet_text))(x)
    got, text = _run(resnet_text, x, layout=True)
    filecheck(text, FOUR_CHANNEL_LAST_CONVS)
    filecheck(text, NO_CHANNEL_FIRST)
    assert np.abs(want).max() > 1e-3
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    off, text = _run(resnet_text, x, layout=False)
    filecheck(text, """
CHECK-COUNT-4: linalg.conv_2d_nchw_fchw
CHECK-NOT:     linalg.conv_2d
""")
    filecheck(text, "CHECK-NOT: linalg.conv_2d_nhwc_hwcf\nCHECK-NOT: linalg.pooling_nhwc")
    np.testing.assert_allclose(off, want, rtol=1e-4, atol=1e-5)


def test_sum_pooling_converts_and_computes_the_same():
    text = resnet_like(seed=2, pool="sum")
    x = np.random.default_rng(3).standard_normal((1, 3, 10, 10)).astype(np.float32)
    want = compile_untuned(load(text=text))(x)
    got, out_text = _run(text, x, layout=True)
    filecheck(out_text, r"CHECK: linalg.pooling_nhwc_sum {{.*}}: tensor<1x12x12x8xf32>, tensor<3x3xf32>) outs(%{{\w+}} : tensor<1x5x5x8xf32>)")
    filecheck(out_text, NO_CHANNEL_FIRST)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_tasks_are_channel_last(resnet_text, monkeypatch):
    monkeypatch.setattr(normalize_mod, "CONVERT_LAYOUT", True)
    tasks = extract_tasks(load(text=resnet_text))
    anchors = [t.anchor_op for t in tasks if t.kind == "convolution"]
    assert len(anchors) == 4 and set(anchors) == {"linalg.conv_2d_nhwc_hwcf"}
    assert [t.anchor_op for t in tasks if t.kind == "pooling"] == ["linalg.pooling_nhwc_max"]
    # the only zero-FLOP layout task left is the input's (the flatten's
    # transpose folds into nothing: it feeds a reshape, so it stays a task)
    assert sorted(t.name for t in tasks if t.anchor_op == "linalg.transpose") == [
        "transpose_1x12x12x3_f32",
        "transpose_1x6x2x2_f32",
    ]


def test_on_by_default_and_the_switch_keeps_channel_first(resnet_text, monkeypatch):
    # on by default (normalize.CONVERT_LAYOUT)
    anchors = {t.anchor_op for t in extract_tasks(load(text=resnet_text)) if t.kind == "convolution"}
    assert anchors == {"linalg.conv_2d_nhwc_hwcf"}
    monkeypatch.setattr(normalize_mod, "CONVERT_LAYOUT", False)
    anchors = {t.anchor_op for t in extract_tasks(load(text=resnet_text)) if t.kind == "convolution"}
    assert anchors == {"linalg.conv_2d_nchw_fchw"}


def test_runtime_filters_and_channel_last_modules_are_left_alone():
    net = _Net(5)
    y, s = net.conv("%x", (1, 4, 6, 6), 4, 3, filt="%w")
    text = net.text([("%x", (1, 4, 6, 6)), ("%w", (4, 4, 3, 3))], y, s)
    program = load(text=text)
    fn = next(o.operation for o in program.module.body.operations)
    before = str(program.module)
    assert convert_layout(fn) == 0 and str(program.module) == before
    nhwc = load(text="""
    func.func @f(%x: tensor<1x6x6x4xf32>, %w: tensor<3x3x4x4xf32>) -> tensor<1x4x4x4xf32> {
      %z = arith.constant 0.0 : f32
      %e = tensor.empty() : tensor<1x4x4x4xf32>
      %f = linalg.fill ins(%z : f32) outs(%e : tensor<1x4x4x4xf32>) -> tensor<1x4x4x4xf32>
      %r = linalg.conv_2d_nhwc_hwcf {dilations = dense<1> : tensor<2xi64>, strides = dense<1> : tensor<2xi64>}
          ins(%x, %w : tensor<1x6x6x4xf32>, tensor<3x3x4x4xf32>) outs(%f : tensor<1x4x4x4xf32>) -> tensor<1x4x4x4xf32>
      return %r : tensor<1x4x4x4xf32>
    }""")
    before = str(nhwc.module)
    assert convert_layout(next(o.operation for o in nhwc.module.body.operations)) == 0
    assert str(nhwc.module) == before


def test_generic_with_permuted_input_maps_sinks_correctly():
    # an elementwise op reading its first operand through a permutation and
    # its second through a broadcast: the rebuilt op must read the same
    # elements
    net = _Net(6)
    y, s = net.conv("%x", (1, 3, 5, 5), 4, 1)  # 1x4x5x5
    e, r = net.name(), net.name()
    bias = net.const((5, 4))
    net.lines.append(f"{e} = tensor.empty() : {_t(s)}")
    net.lines.append(
        f"{r} = linalg.generic {{indexing_maps = [affine_map<(d0, d1, d2, d3) -> (d0, d1, d3, d2)>, "
        f"affine_map<(d0, d1, d2, d3) -> (d3, d1)>, {_ID}], iterator_types = {_PAR4}}}"
        f" ins({y}, {bias} : {_t(s)}, tensor<5x4xf32>) outs({e} : {_t(s)}) {{\n"
        f"^bb0(%a: f32, %b: f32, %o: f32):\n  %m = arith.mulf %a, %b : f32\n  linalg.yield %m : f32\n}} -> {_t(s)}"
    )
    z = net.relu(r, s)
    w2, _ = net.conv(z, s, 2, 1)
    text = net.text([("%x", (1, 3, 5, 5))], w2, (1, 2, 5, 5))
    x = np.random.default_rng(7).standard_normal((1, 3, 5, 5)).astype(np.float32)
    want = compile_untuned(load(text=text))(x)
    got, out_text = _run(text, x, layout=True)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    program = load(text=text)
    convert_layout(next(o.operation for o in program.module.body.operations))
    ops = _body(program.module)
    # the generic sank too, but it changes the layout (it swaps H and W):
    # one transpose stays between the two convolutions, not two
    names = [op.name for op in ops]
    acts = _activation_transposes(ops)
    convs = [k for k, n in enumerate(names) if n == "linalg.conv_2d_nhwc_hwcf"]
    assert len(acts) == 3 and sum(convs[0] < k < convs[1] for k in acts) == 1


def test_tiny_cnn_from_torch(torch):
    from mlir_ansor.examples.models import tiny_cnn
    from mlir_ansor.importers.pytorch import import_module

    model, inputs = tiny_cnn(seed=4)
    with torch.no_grad():
        expected = model(*inputs).numpy()
    text = import_module(model, inputs)
    x = inputs[0].numpy()
    got, out_text = _run(text, x, layout=True)
    filecheck(out_text, "CHECK: linalg.conv_2d_nhwc_hwcf")
    filecheck(out_text, NO_CHANNEL_FIRST)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got, compile_untuned(load(text=text))(x), rtol=1e-5, atol=1e-7)
