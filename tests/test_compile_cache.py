"""The compile cache (mlir_ansor.passes.compile_cache): a second compile reuses
what the first built and gives the same library; what changes the code
misses; damaged entries are rebuilt; it can be switched off. Also the
pieces it rests on: the split of a lowered module into units
(passes.split) and the numpy evaluation of constant-only ops
(graph.fold_eval)."""

from __future__ import annotations

import re

import numpy as np
import pytest

import mlir_ansor
from mlir_ansor.passes.compile_cache import CompileCache, cache_for
from mlir_ansor.tools.cli import main

MATMUL_RELU = """
func.func @f(%a: tensor<64x64xf32>, %b: tensor<64x64xf32>) -> tensor<64x64xf32> {
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<64x64xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e : tensor<64x64xf32>) -> tensor<64x64xf32>
  %m = linalg.matmul ins(%a, %b : tensor<64x64xf32>, tensor<64x64xf32>) outs(%z : tensor<64x64xf32>) -> tensor<64x64xf32>
  %r = linalg.generic {indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (i, j)>],
                       iterator_types = ["parallel", "parallel"]}
      ins(%m : tensor<64x64xf32>) outs(%e : tensor<64x64xf32>) {
  ^bb0(%x: f32, %o: f32):
    %y = arith.maximumf %x, %zero : f32
    linalg.yield %y : f32
  } -> tensor<64x64xf32>
  return %r : tensor<64x64xf32>
}
"""


def _weights_module() -> str:
    """A matmul by a constant weight that is transposed, and scaled by
    1 / sqrt(v + eps) of a constant v: the ops a model's folding sees."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 8)).astype(np.float32)
    v = rng.random(16).astype(np.float32) + 0.5
    dense_w = ", ".join("[" + ", ".join(f"{x:.6e}" for x in row) + "]" for row in w)
    dense_v = ", ".join(f"{x:.6e}" for x in v)
    id1 = "affine_map<(d0) -> (d0)>"
    return f"""
func.func @g(%x: tensor<4x8xf32>) -> tensor<4x16xf32> {{
  %w = arith.constant dense<[{dense_w}]> : tensor<16x8xf32>
  %v = arith.constant dense<[{dense_v}]> : tensor<16xf32>
  %eps = arith.constant 1.0e-5 : f64
  %one = arith.constant 1.0 : f32
  %zero = arith.constant 0.0 : f32
  %e8 = tensor.empty() : tensor<8x16xf32>
  %wt = linalg.transpose ins(%w : tensor<16x8xf32>) outs(%e8 : tensor<8x16xf32>) permutation = [1, 0]
  %e16 = tensor.empty() : tensor<16xf32>
  %ve = linalg.generic {{indexing_maps = [{id1}, {id1}], iterator_types = ["parallel"]}}
      ins(%v : tensor<16xf32>) outs(%e16 : tensor<16xf32>) {{
  ^bb0(%in: f32, %o: f32):
    %t = arith.truncf %eps : f64 to f32
    %s = arith.addf %in, %t : f32
    linalg.yield %s : f32
  }} -> tensor<16xf32>
  %sq = linalg.generic {{indexing_maps = [{id1}, {id1}], iterator_types = ["parallel"]}}
      ins(%ve : tensor<16xf32>) outs(%e16 : tensor<16xf32>) {{
  ^bb0(%in: f32, %o: f32):
    %s = math.sqrt %in : f32
    linalg.yield %s : f32
  }} -> tensor<16xf32>
  %inv = linalg.generic {{indexing_maps = [{id1}, {id1}], iterator_types = ["parallel"]}}
      ins(%sq : tensor<16xf32>) outs(%e16 : tensor<16xf32>) {{
  ^bb0(%in: f32, %o: f32):
    %s = arith.divf %one, %in : f32
    linalg.yield %s : f32
  }} -> tensor<16xf32>
  %e = tensor.empty() : tensor<4x16xf32>
  %z = linalg.fill ins(%zero : f32) outs(%e : tensor<4x16xf32>) -> tensor<4x16xf32>
  %m = linalg.matmul ins(%x, %wt : tensor<4x8xf32>, tensor<8x16xf32>) outs(%z : tensor<4x16xf32>) -> tensor<4x16xf32>
  %r = linalg.generic {{indexing_maps = [affine_map<(i, j) -> (i, j)>, affine_map<(i, j) -> (j)>, affine_map<(i, j) -> (i, j)>],
                        iterator_types = ["parallel", "parallel"]}}
      ins(%m, %inv : tensor<4x16xf32>, tensor<16xf32>) outs(%e : tensor<4x16xf32>) {{
  ^bb0(%a: f32, %b: f32, %o: f32):
    %y = arith.mulf %a, %b : f32
    linalg.yield %y : f32
  }} -> tensor<4x16xf32>
  return %r : tensor<4x16xf32>
}}
"""


@pytest.fixture
def module(tmp_path):
    path = tmp_path / "mm.mlir"
    path.write_text(MATMUL_RELU)
    return str(path)


def _run(cm) -> np.ndarray:
    rng = np.random.default_rng(0)
    ins = [rng.standard_normal(shape).astype(np.float32) for shape, _ in cm.functions[cm.entry][0]]
    return cm(*ins)


def _library(cm) -> bytes:
    with open(cm.library_path, "rb") as f:
        return f.read()


def test_second_compile_hits_and_gives_the_same_library(module, tmp_path):
    cache = tmp_path / "cache"
    first = mlir_ansor.compile(module, cache_dir=cache)
    assert first.cache_stats["module_miss"] == 1 and first.cache_stats.get("obj_hit", 0) == 0
    units = first.cache_stats["obj_write"]
    assert units >= 2  # the driver and the kernels, code-generated apart
    second = mlir_ansor.compile(module, cache_dir=cache)
    assert second.cache_stats == {"module_hit": 1}
    assert second.library_path != first.library_path and _library(second) == _library(first)
    assert _run(second).tobytes() == _run(first).tobytes()
    assert second.mlir == first.mlir and second.entry == first.entry and second.functions == first.functions
    assert [k.source for k in second.kernels] == [k.source for k in first.kernels]
    # Without the whole-compile entry: every unit's object comes from the cache.
    for p in (cache / "module").iterdir():
        p.unlink()
    third = mlir_ansor.compile(module, cache_dir=cache)
    assert third.cache_stats["obj_hit"] == units and third.cache_stats.get("obj_miss", 0) == 0
    assert _library(third) == _library(first)
    # ... and a build without any cache makes the same library.
    fresh = mlir_ansor.compile(module, cache_dir=False)
    assert fresh.cache_stats == {} and _library(fresh) == _library(first)


def test_threads_opt_level_and_schedule_miss(module, tmp_path):
    cache = tmp_path / "cache"
    base = mlir_ansor.compile(module, cache_dir=cache)
    units = base.cache_stats["obj_write"]
    for options in ({"threads": 2}, {"opt_level": 2}, {"default": "naive"}):
        cm = mlir_ansor.compile(module, cache_dir=cache, **options)
        assert cm.cache_stats["module_miss"] == 1, options
        assert cm.cache_stats["obj_miss"] >= 1, options  # the kernel's code differs
        np.testing.assert_allclose(_run(cm), _run(base), rtol=1e-5, atol=1e-5)
    # opt level changes every unit's object
    assert mlir_ansor.compile(module, cache_dir=cache, opt_level=1).cache_stats["obj_miss"] == units


def test_damaged_entries_are_rebuilt(module, tmp_path):
    cache = tmp_path / "cache"
    first = mlir_ansor.compile(module, cache_dir=cache)
    entries = [p for p in cache.rglob("*") if p.is_file()]
    assert entries
    for i, p in enumerate(entries):
        data = p.read_bytes()
        p.write_bytes(data[: len(data) // 2] if i % 2 else data[:-1] + bytes([data[-1] ^ 0xFF]))
    again = mlir_ansor.compile(module, cache_dir=cache)
    assert again.cache_stats["module_damaged"] >= 1 and again.cache_stats["obj_damaged"] >= 1
    assert again.cache_stats.get("obj_hit", 0) == 0
    assert _library(again) == _library(first) and _run(again).tobytes() == _run(first).tobytes()
    # rewritten whole: the next compile hits
    assert mlir_ansor.compile(module, cache_dir=cache).cache_stats == {"module_hit": 1}


def test_cache_can_be_switched_off(module, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("MLIR_ANSOR_CACHE_DIR", str(cache))
    assert cache_for(None, None).root == cache
    cm = mlir_ansor.compile(module, cache_dir=False)
    assert cm.cache_stats == {} and not cache.exists()
    monkeypatch.setenv("MLIR_ANSOR_NO_CACHE", "1")
    assert cache_for(None, "x.db") is None and cache_for(tmp_path / "other", None) is None
    assert mlir_ansor.compile(module).cache_stats == {} and not cache.exists()
    monkeypatch.delenv("MLIR_ANSOR_NO_CACHE")
    out = tmp_path / "m.so"
    assert main(["compile", module, "--no-cache", "-o", str(out)]) == 0
    assert out.exists() and not cache.exists()
    assert main(["compile", module, "-o", str(out)]) == 0
    assert sorted(p.suffix for p in (cache / "module").iterdir()) == [".meta", ".mlir", ".slot", ".so"]


def test_default_folder_is_beside_the_database(monkeypatch, tmp_path):
    monkeypatch.delenv("MLIR_ANSOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("MLIR_ANSOR_NO_CACHE", raising=False)
    assert cache_for(None, tmp_path / "t.db").root == tmp_path / "t.db.cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_for(None, None).root == tmp_path / "xdg" / "mlir-ansor"
    assert cache_for(tmp_path / "mine", tmp_path / "t.db").root == tmp_path / "mine"


def test_a_changed_database_misses_the_whole_compile(module, tmp_path):
    cache = tmp_path / "cache"
    db = tmp_path / "t.db"
    db.write_bytes(b"")  # an empty file: no records (default schedules)
    first = mlir_ansor.compile(module, db=db, cache_dir=cache)
    db.write_bytes(b"\0" * 0)
    assert mlir_ansor.compile(module, db=db, cache_dir=cache).cache_stats == {"module_hit": 1}
    (tmp_path / "t.db-wal").write_bytes(b"")  # what a reader's open leaves: no change
    assert mlir_ansor.compile(module, db=db, cache_dir=cache).cache_stats == {"module_hit": 1}
    (tmp_path / "t.db-wal").write_bytes(b"new records")
    cm = mlir_ansor.compile(module, db=db, cache_dir=cache)
    assert cm.cache_stats["module_miss"] == 1 and cm.cache_stats["obj_hit"] == first.cache_stats["obj_write"]
    # the entry of the database before is replaced, not kept beside
    assert len(list((cache / "module").glob("*.so"))) == 1
    assert mlir_ansor.compile(module, db=db, cache_dir=cache).cache_stats == {"module_hit": 1}


def test_folded_constants_are_cached_and_numpy_matches_llvm(tmp_path, monkeypatch):
    import mlir_ansor.compiler as compiler
    from mlir_ansor.graph import fold_eval

    path = tmp_path / "w.mlir"
    path.write_text(_weights_module())
    cache = tmp_path / "cache"
    first = mlir_ansor.compile(str(path), cache_dir=cache)
    assert first.cache_stats["fold_miss"] == 1 and first.cache_stats["fold_write"] == 1
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    for p in (cache / "module").iterdir():
        p.unlink()
    second = mlir_ansor.compile(str(path), cache_dir=cache)
    assert second.cache_stats["fold_hit"] == 1
    assert second(x).tobytes() == first(x).tobytes()
    # The folded constants through LLVM (numpy refusing) are the same bits.
    def refuse(*args):
        raise fold_eval.NotEvaluable("refused by the test")

    monkeypatch.setattr(fold_eval, "evaluate", refuse)
    built = compiler.compile(str(path), cache_dir=False)
    assert built.mlir == first.mlir and built(x).tobytes() == first(x).tobytes()


def test_split_units_of_a_lowered_module(tmp_path):
    from mlir import ir

    from mlir_ansor.compiler import schedule_module
    from mlir_ansor.passes.lowering import lower_to_llvm
    from mlir_ansor.passes.split import split_units

    path = tmp_path / "mm.mlir"
    path.write_text(MATMUL_RELU)
    s = schedule_module(str(path))
    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(s.mlir)
        lower_to_llvm(m, 1)
        units = split_units(m, {"f"})
    assert units is not None and units[0].name == "drivers"
    assert {"f", "_mlir_ciface_f"} <= set(units[0].defines)
    kernels = [u for u in units[1:]]
    assert kernels and all(u.name.startswith("ansor_") for u in kernels)
    assert set(units[0].needs) == {u.name for u in kernels}
    for u in kernels:
        assert u.name in u.defines and f"_mlir_ciface_{u.name}" in u.defines and "llvm.func @f(" not in u.text


def test_cache_key_names_its_parts():
    assert CompileCache.key("obj", "a", 3) != CompileCache.key("obj", "a", 2)
    assert CompileCache.key("obj", "ab", "") != CompileCache.key("obj", "a", "b")


def test_compile_help_describes_the_cache(capsys):
    with pytest.raises(SystemExit):
        main(["compile", "--help"])
    out = capsys.readouterr().out
    assert "--no-cache" in out and "--cache-dir" in out


LLVM_MODULE = """
llvm.func internal @helper(%x: i64) -> i64 {
  llvm.return %x : i64
}
llvm.func @k1(%x: i64) -> i64 {
  %r = llvm.call @helper(%x) : (i64) -> i64
  llvm.return %r : i64
}
llvm.func internal @k2(%x: i64) -> i64 {
  %r = llvm.call @helper(%x) : (i64) -> i64
  llvm.return %r : i64
}
llvm.mlir.global private constant @table(dense<[1, 2]> : tensor<2xi64>) : !llvm.array<2 x i64>
llvm.func @main(%x: i64) -> i64 {
  %a = llvm.call @k1(%x) : (i64) -> i64
  %b = llvm.call @k2(%a) : (i64) -> i64
  %p = llvm.mlir.addressof @table : !llvm.ptr
  llvm.return %b : i64
}
"""


def test_split_duplicates_private_helpers_and_exposes_called_kernels():
    from mlir import ir

    from mlir_ansor.passes.split import split_units

    with ir.Context(), ir.Location.unknown():
        m = ir.Module.parse(LLVM_MODULE)
        units = {u.name: u for u in split_units(m, {"main"})}
    assert set(units) == {"drivers", "k1", "k2"}
    assert units["drivers"].needs == ("k1", "k2") and "@table" in units["drivers"].text
    # the private helper is copied into both kernels' units; k2, private and
    # called from the drivers' unit, is external there but hidden
    for name in ("k1", "k2"):
        assert "llvm.func internal @helper" in units[name].text and "@table" not in units[name].text
    assert "llvm.func hidden @k2" in units["k2"].text and units["k2"].defines == ("k2",)


def test_split_units_carry_module_attributes_and_their_resource_blobs():
    """A unit's text is put together from its ops' texts: it keeps the
    module's attributes, and the blobs of the dense_resource constants it
    reads (and only those); each unit parses on its own."""
    from mlir import ir

    from mlir_ansor.passes.split import split_units

    text = """
module attributes {test.mark = 7 : i64} {
  llvm.mlir.global private constant @w(dense_resource<blob_w> : tensor<2xf32>) : !llvm.array<2 x f32>
  llvm.mlir.global private constant @v(dense_resource<blob_v> : tensor<2xf32>) : !llvm.array<2 x f32>
  llvm.func @k(%x: i64) -> i64 {
    %p = llvm.mlir.addressof @w : !llvm.ptr
    llvm.return %x : i64
  }
  llvm.func @main(%x: i64) -> i64 {
    %r = llvm.call @k(%x) : (i64) -> i64
    %p = llvm.mlir.addressof @v : !llvm.ptr
    llvm.return %r : i64
  }
}
{-#
  dialect_resources: {
    builtin: {
      blob_w: "0x040000000000803F00000040",
      blob_v: "0x040000000000404000008040"
    }
  }
#-}
"""
    with ir.Context(), ir.Location.unknown():
        units = {u.name: u for u in split_units(ir.Module.parse(text), {"main"})}
        assert set(units) == {"drivers", "k"}
        for u in units.values():
            printed = str(ir.Module.parse(u.text))
            assert "test.mark = 7" in printed
        assert "blob_w" in units["k"].text and "blob_v" not in units["k"].text
        assert "blob_v" in units["drivers"].text and "blob_w" not in units["drivers"].text
        assert "0000803F00000040" in str(ir.Module.parse(units["k"].text))


def test_a_module_that_does_not_split_is_one_unit():
    from mlir import ir

    from mlir_ansor.passes.split import split_units

    with ir.Context() as ctx, ir.Location.unknown():
        ctx.allow_unregistered_dialects = True
        m = ir.Module.parse(LLVM_MODULE + '"test.other"() : () -> ()\n')
        assert split_units(m, {"main"}) is None
        # a mutable global that two units use cannot be copied into both
        m = ir.Module.parse("""
llvm.mlir.global internal @state(0 : i64) : i64
llvm.func @k1() { %p = llvm.mlir.addressof @state : !llvm.ptr
  llvm.return }
llvm.func @main() { %p = llvm.mlir.addressof @state : !llvm.ptr
  llvm.call @k1() : () -> ()
  llvm.return }
""")
        assert split_units(m, {"main"}) is None


def test_untuned_reference_is_cached(module, tmp_path, capsys):
    """`run`'s reference, the untuned build, is kept too: a second `run`
    loads it, and says so."""
    import json

    from mlir_ansor.compiler import compile_untuned

    cache = tmp_path / "cache"
    first = compile_untuned(module, cache_dir=cache)
    assert first.cache_stats["module_miss"] == 1
    second = compile_untuned(module, cache_dir=cache)
    assert second.cache_stats == {"module_hit": 1}
    np.testing.assert_array_equal(_run(first), _run(second))
    assert compile_untuned(module, cache_dir=cache, threads=2).cache_stats["module_miss"] == 1
    assert compile_untuned(module).cache_stats == {}  # no cache unless asked
    args = ["run", module, "--cache-dir", str(tmp_path / "run-cache"), "--json", "--repeat", "1"]
    refs = []
    for extra in (["--reference", "untuned"], []):  # auto takes the cached build over numpy
        assert main(args + extra) == 0
        refs.append(json.loads(capsys.readouterr().out)["reference"])
    assert refs == ["untuned build", "untuned build (from the compile cache)"]


def _matmul_by_constant(path, m: int, transposed: bytes, shape: tuple[int, int], dtype: str):
    """Write `path`: x[m, k] . W[k, n] into f32, W a constant given
    transposed (its [n, k] bytes, `dtype`) and transposed back at compile
    time; x of W's type. Returns `path`."""
    k, n = shape
    path.write_text(f"""
func.func @f(%x: tensor<{m}x{k}x{dtype}>) -> tensor<{m}x{n}xf32> {{
  %w = arith.constant dense<"0x{transposed.hex().upper()}"> : tensor<{n}x{k}x{dtype}>
  %zero = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<{k}x{n}x{dtype}>
  %wt = linalg.transpose ins(%w : tensor<{n}x{k}x{dtype}>) outs(%e : tensor<{k}x{n}x{dtype}>) permutation = [1, 0]
  %o = tensor.empty() : tensor<{m}x{n}xf32>
  %z = linalg.fill ins(%zero : f32) outs(%o : tensor<{m}x{n}xf32>) -> tensor<{m}x{n}xf32>
  %r = linalg.matmul ins(%x, %wt : tensor<{m}x{k}x{dtype}>, tensor<{k}x{n}x{dtype}>) outs(%z : tensor<{m}x{n}xf32>) -> tensor<{m}x{n}xf32>
  return %r : tensor<{m}x{n}xf32>
}}
""")
    return path


def test_large_weights_skip_the_text_and_the_scheduled_mlir_comes_back(tmp_path):
    """A weight of 64 KiB or more leaves the scheduled module before it is
    printed for the lowering worker (its bytes go to the library through a
    file, not 2x their size of text), and the compiled module's ``mlir``
    still holds it; on a cache hit, whose entry keeps no MLIR, ``mlir`` is
    scheduled again from the source."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((160, 128)).astype(np.float32)  # 80 KiB, transposed at compile time
    path = _matmul_by_constant(tmp_path / "big.mlir", 8, w.T.copy().tobytes(), w.shape, "f32")
    from mlir_ansor.compiler import schedule_module
    from mlir_ansor.search.rules.dot_product import lanes_of
    from mlir_ansor.target import Target

    s = schedule_module(str(path), _weights_dir=str(tmp_path))
    assert len(s.weights) == 1 and s.weights[0][2] == w.nbytes
    # folded in the column panels the contraction rule reads (`graph.prepack.Panels`)
    p = 2 * lanes_of(Target.host())
    assert len(s.mlir) < w.nbytes and re.search(rf"memref.global constant @\S+ : memref<{128 // p}x160x{p}xf32>\s", s.mlir)
    with open(s.weights[0][1], "rb") as f:
        panels = w.reshape(160, 128 // p, p).transpose(1, 0, 2)
        assert np.frombuffer(f.read(), np.float32).reshape(panels.shape).tobytes() == panels.tobytes()

    cache = tmp_path / "cache"
    cm = mlir_ansor.compile(str(path), cache_dir=cache)
    x = rng.standard_normal((8, 160)).astype(np.float32)
    np.testing.assert_allclose(cm(x), x @ w, rtol=1e-5, atol=1e-5)
    assert len(cm.mlir) > 2 * w.nbytes and 'memref.global "private" constant' in cm.mlir
    assert sorted(p.suffix for p in (cache / "module").iterdir()) == [".meta", ".slot", ".so"]
    again = mlir_ansor.compile(str(path), cache_dir=cache)
    assert again.cache_stats == {"module_hit": 1}
    np.testing.assert_array_equal(again(x), cm(x))
    assert again.mlir == cm.mlir


def test_large_bf16_weights_leave_the_text_too(tmp_path):
    """bf16, which numpy cannot hold: a folded bf16 weight's bytes come from
    its printed hex form."""
    rng = np.random.default_rng(6)
    w32 = rng.standard_normal((320, 128)).astype(np.float32)
    bits = (w32.view(np.uint32) >> 16).astype(np.uint16)  # bf16, truncated
    w = (bits.astype(np.uint32) << 16).view(np.float32)
    path = _matmul_by_constant(tmp_path / "bf16.mlir", 4, bits.T.copy().tobytes(), bits.shape, "bf16")
    from mlir_ansor.compiler import schedule_module

    s = schedule_module(str(path), _weights_dir=str(tmp_path))
    assert [size for _, _, size in s.weights] == [bits.nbytes]
    cm = mlir_ansor.compile(str(path), cache_dir=False)
    x = (rng.standard_normal((4, 320)).astype(np.float32).view(np.uint32) & 0xFFFF0000).view(np.float32)
    np.testing.assert_allclose(cm(x), x @ w, rtol=1e-4, atol=1e-3)
