"""The torch.compile backend (`mlir_ansor.torch_backend`, backend="mlir_ansor"):
captured graphs compiled and compared with eager, the eager fallback of a
graph torch-mlir cannot lower, and the in-process cache."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mlir_ansor
from mlir_ansor.compiler import DynamicModule
from mlir_ansor.records import Database
from mlir_ansor.tools import torch_backend as tb


@pytest.fixture(autouse=True)
def fresh(torch):
    torch._dynamo.reset()
    tb.clear_cache()
    yield
    torch._dynamo.reset()
    tb.clear_cache()


def _cnn(torch, seed: int):
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 4 * 4, 10)
    ).eval()


def _attention(torch, seed: int):
    torch.manual_seed(seed)

    class Attention(torch.nn.Module):
        def __init__(self, d: int = 32) -> None:
            super().__init__()
            self.q, self.k, self.v, self.o = (torch.nn.Linear(d, d) for _ in range(4))
            self.scale = d**-0.5

        def forward(self, x):
            att = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) * self.scale, dim=-1)
            return self.o(att @ self.v(x))

    return Attention().eval()


def _compare(torch, model, x, backend, rtol=1e-4, atol=1e-5):
    with torch.no_grad():
        expected = model(x)
        compiled = torch.compile(model, backend=backend)
        got = compiled(x)
        again = compiled(x + 1)
        expected_again = model(x + 1)
    assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=rtol, atol=atol)
    np.testing.assert_allclose(again.numpy(), expected_again.numpy(), rtol=rtol, atol=atol)


def test_cnn_matches_eager(torch, caplog):
    model = _cnn(torch, 0)
    x = torch.randn(2, 3, 8, 8)
    with caplog.at_level(logging.WARNING, logger="mlir_ansor"):
        _compare(torch, model, x, mlir_ansor.torch_backend(trials=0))
    assert "runs eagerly" not in caplog.text
    assert (tb.stats.compiled, tb.stats.fallbacks) == (1, 0)


def test_attention_by_name_matches_eager(torch, caplog):
    model = _attention(torch, 1)
    x = torch.randn(1, 16, 32)
    with caplog.at_level(logging.WARNING, logger="mlir_ansor"):
        _compare(torch, model, x, "mlir_ansor")
    assert "runs eagerly" not in caplog.text
    assert (tb.stats.compiled, tb.stats.fallbacks) == (1, 0)


def test_shapes_static_graph_each_or_one_dynamic_graph(torch, caplog):
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU()).eval()
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="mlir_ansor"):
        static = torch.compile(model, backend=mlir_ansor.torch_backend(), dynamic=False)
        for n in (2, 3):
            x = torch.randn(n, 16)
            np.testing.assert_allclose(static(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
        assert (tb.stats.compiled, tb.stats.fallbacks) == (2, 0)
        torch._dynamo.reset()
        tb.clear_cache()
        # dynamo compiles 2 rows static, then makes the rows dynamic (a torch.SymInt input and a tensor
        # of rows s0): one dynamic module, which compiles each new size when a call brings it
        dynamic = torch.compile(model, backend=mlir_ansor.torch_backend())
        for n in (2, 3, 5, 13, 3):
            x = torch.randn(n, 16)
            np.testing.assert_allclose(dynamic(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
    assert (tb.stats.compiled, tb.stats.fallbacks) == (2, 0), caplog.text
    static_cm, dynamic_cm = tb.compiled_graphs()
    assert isinstance(dynamic_cm, DynamicModule) and not isinstance(static_cm, DynamicModule)
    assert sorted(v for sizes in dynamic_cm.sizes for v in sizes.values()) == [3, 5, 13]


def test_dynamic_graph_shares_its_symbol_and_compiles_in_its_numbers(torch, caplog):
    """Under dynamic=True dynamo passes a LayerNorm's eps and a float
    attribute as 0-d tensors (compiled in as constants: another value of the
    attribute runs the graph eagerly), and one symbol for the rows of two
    inputs."""
    torch.manual_seed(8)

    class Gate(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm, self.proj, self.scale = torch.nn.LayerNorm(16), torch.nn.Linear(16, 16), 0.5

        def forward(self, x, g):
            return self.proj(self.norm(x)) * torch.sigmoid(g) * self.scale

    model = Gate().eval()
    compiled = torch.compile(model, backend=mlir_ansor.torch_backend(), dynamic=True)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="mlir_ansor"):
        for n in (4, 9):
            x, g = torch.randn(n, 16), torch.randn(n, 16)
            np.testing.assert_allclose(compiled(x, g).numpy(), model(x, g).numpy(), rtol=1e-4, atol=1e-5)
        assert (tb.stats.compiled, tb.stats.fallbacks) == (1, 0) and "eagerly" not in caplog.text
        (cm,) = tb.compiled_graphs()
        assert isinstance(cm, DynamicModule) and cm.n_args == 2 and len(cm.symbols) == 1
        model.scale = 2.0  # dynamo passes the new value to the same graph: it must not use the old one
        x, g = torch.randn(6, 16), torch.randn(6, 16)
        np.testing.assert_allclose(compiled(x, g).numpy(), model(x, g).numpy(), rtol=1e-4, atol=1e-5)
    assert caplog.text.count("is 2.0 in this call") == 1 and tb.stats.fallbacks == 0


def test_dynamic_true_on_a_cnn_keeps_dynamic_only_what_the_graph_allows(torch, caplog):
    """dynamic=True makes the height and width dynamic too, which the linear
    head constrains (a named Dim there is an error of torch.export): the
    batch is a symbol of the compiled module, and the graph compiles."""
    model = _cnn(torch, 10)
    compiled = torch.compile(model, backend=mlir_ansor.torch_backend(), dynamic=True)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="mlir_ansor"):
        for n in (2, 3):
            x = torch.randn(n, 3, 8, 8)
            np.testing.assert_allclose(compiled(x).numpy(), model(x).numpy(), rtol=1e-4, atol=1e-5)
    assert (tb.stats.compiled, tb.stats.fallbacks) == (1, 0), caplog.text
    (cm,) = tb.compiled_graphs()
    assert isinstance(cm, DynamicModule) and [(0, 0)] in cm.symbols


def test_a_dynamic_integer_no_tensor_carries_runs_eagerly(torch, caplog):
    class Repeat(torch.nn.Module):
        def forward(self, x, n: int):
            return torch.relu(x) * n

    model, x = Repeat(), torch.randn(3, 8)
    compiled = torch.compile(model, backend=mlir_ansor.torch_backend(), dynamic=True)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="mlir_ansor"):
        for n in (3, 4):
            np.testing.assert_allclose(compiled(x, n).numpy(), model(x, n).numpy(), rtol=1e-6)
    assert "no tensor's shape carries" in caplog.text and tb.stats.fallbacks == 1


def test_bf16_tensors_in_and_out(torch):
    torch.manual_seed(6)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).eval()
    model = model.to(torch.bfloat16)
    x = torch.randn(4, 16).to(torch.bfloat16)
    with torch.no_grad():
        got, want = torch.compile(model, backend=mlir_ansor.torch_backend())(x), model(x)
    assert got.dtype == torch.bfloat16 and tb.stats.compiled == 1
    np.testing.assert_allclose(got.float().numpy(), want.float().numpy(), rtol=2e-2, atol=2e-2)


def test_graph_torch_mlir_refuses_runs_eagerly_with_one_line(torch, caplog):
    class Spectrum(torch.nn.Module):
        def forward(self, x):
            return torch.fft.rfft(torch.relu(x)).abs()  # no linalg lowering of aten.fft_rfft

    model, x = Spectrum(), torch.randn(2, 16)
    with caplog.at_level(logging.WARNING, logger="mlir_ansor"), torch.no_grad():
        got = torch.compile(model, backend=mlir_ansor.torch_backend())(x)
    np.testing.assert_allclose(got.numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
    lines = [r.getMessage() for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "torch-mlir could not import" in lines[0] and "error:" in lines[0]  # with torch-mlir's diagnostic
    assert (tb.stats.compiled, tb.stats.fallbacks) == (0, 1)


def test_graph_needing_gradients_runs_eagerly(torch, caplog):
    model = _cnn(torch, 2)  # parameters require grad, and grad mode is on
    x = torch.randn(1, 3, 8, 8)
    with caplog.at_level(logging.WARNING, logger="mlir_ansor"):
        got = torch.compile(model, backend=mlir_ansor.torch_backend())(x)
    assert got.requires_grad  # eager's result, with its graph
    np.testing.assert_allclose(got.detach().numpy(), model(x).detach().numpy(), rtol=1e-6)
    assert "the graph needs gradients" in caplog.text and tb.stats.fallbacks == 1


def test_a_weight_changed_in_place_runs_eagerly(torch, caplog):
    model = _cnn(torch, 5)
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="mlir_ansor"):
        compiled = torch.compile(model, backend=mlir_ansor.torch_backend())
        np.testing.assert_allclose(compiled(x).numpy(), model(x).numpy(), rtol=1e-4, atol=1e-5)
        assert "has changed" not in caplog.text
        model[0].weight.mul_(2)  # the weights were compiled in: this graph must not use them any more
        np.testing.assert_allclose(compiled(x).numpy(), model(x).numpy(), rtol=1e-4, atol=1e-5)
    assert caplog.text.count("has changed since") == 1


def test_same_graph_is_compiled_once(torch):
    # Weights as arguments (freeze=False): two models of one architecture import to the same text.
    backend = mlir_ansor.torch_backend(freeze=False)
    a, b = _cnn(torch, 3), _cnn(torch, 4)
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        got_a = torch.compile(a, backend=backend)(x)
        torch._dynamo.reset()  # dynamo forgets its graphs: it calls the backend again
        got_b = torch.compile(b, backend=backend)(x)
        want_a, want_b = a(x), b(x)
    assert (tb.stats.compiled, tb.stats.hits) == (1, 1)
    np.testing.assert_allclose(got_a.numpy(), want_a.numpy(), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got_b.numpy(), want_b.numpy(), rtol=1e-4, atol=1e-5)


def test_bad_arguments_raise(torch):
    with pytest.raises(mlir_ansor.InputError, match="needs a records database"):
        mlir_ansor.torch_backend(trials=4)
    with pytest.raises(mlir_ansor.InputError, match="threads=0"):
        mlir_ansor.torch_backend(threads=0)


_SECOND_PROCESS = """
import logging, sys
import numpy as np, torch
import mlir_ansor
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).eval()
x = torch.randn(4, 32)
with torch.no_grad():
    got = torch.compile(model, backend=mlir_ansor.torch_backend(db=sys.argv[1], trials=2))(x)
    np.testing.assert_allclose(got.numpy(), model(x).numpy(), rtol=1e-4, atol=1e-5)
print("MATCHED")
"""


@pytest.mark.slow
def test_trials_tune_once_and_a_second_process_does_not(torch, tmp_path):
    db = tmp_path / "model.db"
    script = tmp_path / "second.py"
    script.write_text(textwrap.dedent(_SECOND_PROCESS))
    first = subprocess.run([sys.executable, str(script), str(db)], capture_output=True, text=True, cwd=tmp_path)
    assert first.returncode == 0 and "MATCHED" in first.stdout, first.stdout[-3000:] + first.stderr[-3000:]
    assert "no tuning" not in first.stdout and "runs eagerly" not in first.stdout
    with Database(db, readonly=True) as d:
        assert d.count() >= 2
        measured = d.count()
    second = subprocess.run([sys.executable, str(script), str(db)], capture_output=True, text=True, cwd=tmp_path)
    assert second.returncode == 0 and "MATCHED" in second.stdout, second.stdout[-3000:] + second.stderr[-3000:]
    # The second process finds the whole compile in the compile cache beside the database: no import, no tuning.
    assert "comes from the compile cache" in second.stdout and "runs eagerly" not in second.stdout
    with Database(db, readonly=True) as d:
        assert d.count() == measured  # nothing measured again


def test_a_graph_compiled_before_comes_from_the_compile_cache_with_its_own_weights(torch, tmp_path, caplog,
                                                                                   monkeypatch):
    """A later process (here: the in-process cache cleared) finds a graph's
    compile by its code, input types and weights, before importing it; the
    same graph with other weights is imported and compiled again."""
    db = str(tmp_path / "m.db")
    a, b = _cnn(torch, 5), _cnn(torch, 6)
    x = torch.randn(2, 3, 8, 8)

    def compiled(model):
        torch._dynamo.reset()
        tb.clear_cache()
        with torch.no_grad():
            return torch.compile(model, backend=mlir_ansor.torch_backend(db=db))(x)

    first = compiled(a)
    imports = []
    from mlir_ansor.importers import pytorch

    original = pytorch.import_module

    def counting(*args, **kwargs):
        imports.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(pytorch, "import_module", counting)  # the backend imports it at each compile
    with caplog.at_level(logging.INFO, logger="mlir_ansor"):
        again = compiled(a)
        assert imports == [] and "comes from the compile cache" in caplog.text
        caplog.clear()
        other = compiled(b)
        assert imports == [1] and "comes from the compile cache" not in caplog.text
    with torch.no_grad():
        want_a, want_b = a(x), b(x)
    for got, want in ((first, want_a), (again, want_a), (other, want_b)):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_trials_tune_a_dynamic_graph_at_the_sizes_dynamo_passed(torch, tmp_path):
    torch.manual_seed(9)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU()).eval()
    db = str(tmp_path / "dyn.db")
    compiled = torch.compile(model, backend=mlir_ansor.torch_backend(db=db, trials=2), dynamic=True)
    with torch.no_grad():
        for n in (6, 11):
            x = torch.randn(n, 32)
            np.testing.assert_allclose(compiled(x).numpy(), model(x).numpy(), rtol=1e-4, atol=1e-5)
    with Database(db, readonly=True) as d:
        names = {d.workload(r.workload_key)["name"] for r in d.records()}
    assert names and all("_6x" in name for name in names), names  # tuned at 6 rows; 11 takes their schedules
    assert tb.stats.compiled == 1 and tb.stats.fallbacks == 0


def test_a_dynamic_graphs_import_and_sizes_come_from_the_compile_cache(torch, tmp_path, caplog, monkeypatch):
    """A later process (here: dynamo and the in-process cache reset) finds a
    dynamic graph's import in the compile cache, and each size's whole
    compile."""
    torch.manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU()).eval()
    db = str(tmp_path / "m.db")

    def run(n):
        torch._dynamo.reset()
        tb.clear_cache()
        x = torch.randn(n, 64)
        with torch.no_grad():
            got = torch.compile(model, backend=mlir_ansor.torch_backend(db=db), dynamic=True)(x)
            np.testing.assert_allclose(got.numpy(), model(x).numpy(), rtol=1e-4, atol=1e-5)
        (cm,) = tb.compiled_graphs()
        return cm.specialization(x.numpy())

    run(6)
    from mlir_ansor.importers import pytorch

    monkeypatch.setattr(pytorch, "import_module", lambda *a, **k: pytest.fail("imported again"))
    with caplog.at_level(logging.INFO, logger="mlir_ansor"):
        spec = run(6)
    assert "import comes from the compile cache" in caplog.text
    assert spec.cache_stats.get("module_hit") == 1


@pytest.mark.slow
def test_trials_tune_a_dynamic_graph_at_the_sizes_given(torch, tmp_path):
    """sizes= tunes a dynamic graph as tune --sizes does: each size searched,
    the powers of two between them measured on carried schedules."""
    torch.manual_seed(12)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU()).eval()
    db = str(tmp_path / "sizes.db")
    backend = mlir_ansor.torch_backend(db=db, trials=6, sizes="0.0=4,16")
    compiled = torch.compile(model, backend=backend, dynamic=True)
    with torch.no_grad():
        x = torch.randn(6, 32)
        np.testing.assert_allclose(compiled(x).numpy(), model(x).numpy(), rtol=1e-4, atol=1e-5)
    with Database(db, readonly=True) as d:
        rows = {d.workload(r.workload_key)["name"].split("x")[0].split("_")[-1] for r in d.records()}
    assert rows == {"4", "8", "16"}, rows  # 8: between 4 and 16, carried
    assert tb.stats.compiled == 1 and tb.stats.fallbacks == 0
    with pytest.raises(mlir_ansor.InputError, match="needs trials"):
        mlir_ansor.torch_backend(db=db, sizes="0.0=4")
    with pytest.raises(mlir_ansor.InputError, match="ARG.DIM"):
        mlir_ansor.torch_backend(db=db, trials=2, sizes="rows=4")


def test_a_size_a_dynamic_graph_cannot_be_compiled_at_runs_eagerly(torch, caplog, monkeypatch):
    """Each size of a dynamic graph compiles on its first call; where one
    cannot (here made to fail at 5 rows; torch-mlir's casts of a dynamic
    extent to a fixed one do this at every size), the call and the later
    ones run eagerly, with one warning that says why, not an exception
    out of the model."""
    from mlir_ansor.errors import UnsupportedError
    from mlir_ansor.graph import dynamic

    specialize = dynamic.specialize

    def failing_at_5(fn, values):
        if 5 in values.values():
            raise UnsupportedError("@main is not valid at sizes 0.0=5: made to fail")
        specialize(fn, values)

    monkeypatch.setattr(dynamic, "specialize", failing_at_5)
    torch.manual_seed(8)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU()).eval()
    compiled = torch.compile(model, backend=mlir_ansor.torch_backend(), dynamic=True)
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="mlir_ansor"):
        for n in (3, 5, 7, 3):
            x = torch.randn(n, 16)
            np.testing.assert_allclose(compiled(x).numpy(), model(x).numpy(), rtol=1e-5, atol=1e-6)
    assert caplog.text.count("could not be compiled at these sizes (@main is not valid at sizes 0.0=5: made to fail)") == 1
    (cm,) = tb.compiled_graphs()
    assert [sorted(sizes.values()) for sizes in cm.sizes] == [[3]]  # 7 ran eagerly
