"""The f32 exp/erf/tanh expansions (mlir_ansor.passes.math_approx), compiled
and run on awkward inputs, against numpy/math in float64."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from mlir import ir

from mlir_ansor.measure.runner import Kernel
from mlir_ansor.passes.artifacts import emit_shared_library
from mlir_ansor.passes.lowering import lower_to_llvm
from mlir_ansor.passes.math_approx import expand_math
from mlir_ansor.passes.objcode import emit_object, instruction_counts
from mlir_ansor.target import Target

N = 1024
KERNEL = f"""
func.func @f(%x: memref<{N}xf32>, %y: memref<{N}xf32>, %z: memref<{N}xf32>, %w: memref<{N}xf32>,
             %s: memref<{N}xf32>) {{
  %c0 = arith.constant 0 : index
  %c1 = arith.constant 1 : index
  %c8 = arith.constant 8 : index
  %n = arith.constant {N} : index
  %p = arith.constant 0.0 : f32
  scf.for %i = %c0 to %n step %c8 {{
    %v = vector.transfer_read %x[%i], %p : memref<{N}xf32>, vector<8xf32>
    %e = math.exp %v : vector<8xf32>
    vector.transfer_write %e, %y[%i] : vector<8xf32>, memref<{N}xf32>
    %r = math.erf %v : vector<8xf32>
    vector.transfer_write %r, %z[%i] : vector<8xf32>, memref<{N}xf32>
    %t = math.tanh %v : vector<8xf32>
    vector.transfer_write %t, %w[%i] : vector<8xf32>, memref<{N}xf32>
  }}
  scf.for %i = %c0 to %n step %c1 {{
    %v = memref.load %x[%i] : memref<{N}xf32>
    %e = math.exp %v : f32
    memref.store %e, %s[%i] : memref<{N}xf32>
  }}
  return
}}
"""


def test_expand_math_rewrites_every_f32_function():
    for scalef in (False, True):
        with ir.Context(), ir.Location.unknown():
            module = ir.Module.parse(KERNEL)
            assert expand_math(module, scalef) == 4  # 2 exp, 1 erf, 1 tanh (rewritten with exp)
            text = str(module)
            assert "math.exp" not in text and "math.erf" not in text
            # The vector exps (the erf's one too) scale by 2^n with ldexp; the scalar one does not.
            assert text.count("llvm.ldexp.v8f32.v8i32") == (3 if scalef else 0)


def test_exp_on_avx512_scales_with_one_vscalefps(tmp_path):
    """Built for Zen 4, a 16-lane exp is 2^n by `vscalefps` (no libm call,
    no exponent-bit arithmetic); built for Zen 3 (no AVX-512) it keeps the
    integer form, since `ldexp` would become a libm call per lane there."""
    src = """
    func.func @f(%x: memref<64xf32>, %y: memref<64xf32>) {
      %c0 = arith.constant 0 : index
      %p = arith.constant 0.0 : f32
      %v = vector.transfer_read %x[%c0], %p {in_bounds = [true, true]} : memref<64xf32>, vector<16xf32>
      %e = math.exp %v : vector<16xf32>
      vector.transfer_write %e, %y[%c0] {in_bounds = [true]} : vector<16xf32>, memref<64xf32>
      return
    }"""
    counts = {}
    for cpu in ("znver4", "znver3"):
        with ir.Context(), ir.Location.unknown():
            module = ir.Module.parse(src.replace("[true, true]", "[true]"))
            lower_to_llvm(module, 1, target=Target.cpu(cpu, cores=1))
            counts[cpu] = instruction_counts(emit_object(module, tmp_path / f"{cpu}.o", cpu=cpu))
    assert counts["znver4"].get("vscalefps", 0) == 1 and counts["znver4"].get("vpslld", 0) == 0
    assert counts["znver3"].get("vscalefps", 0) == 0 and counts["znver3"].get("vpslld", 0) == 4  # two ymm halves
    for c in counts.values():  # the C-interface wrapper's call to f, no libm call
        assert sum(n for m, n in c.items() if m.startswith("call")) == 1


@pytest.fixture(scope="module", params=[False, True], ids=["bits", "ldexp"])
def results(request, tmp_path_factory):
    # Both forms run on any host: ldexp without AVX-512 is a (slow) libm call.
    target = Target.cpu("znver4" if request.param else "znver3", cores=1)
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(KERNEL)
        lower_to_llvm(module, 1, target=target)
        so = emit_shared_library(module, tmp_path_factory.mktemp("math") / "k.so")
    special = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-8, -1e-8, 88.7, 88.8, -87.5, -103.0, -110.0]
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [np.linspace(-110, 95, 600), rng.standard_normal(N - 600 - len(special)) * 4, special]
    ).astype(np.float32)
    outs = [np.zeros(N, np.float32) for _ in range(4)]
    k = Kernel(so, "f")
    k.bind([x, *outs])()
    return x, outs


def test_exp_matches_float64_within_a_few_ulp(results):
    x, (y, _, _, s) = results
    exact = np.exp(x.astype(np.float64))
    with np.errstate(all="ignore"):
        normal = np.isfinite(exact) & (exact >= np.finfo(np.float32).tiny) & (exact <= np.finfo(np.float32).max)
    for got in (y, s):  # vector and scalar forms
        rel = np.abs(got[normal] - exact[normal]) / exact[normal]
        assert rel.max() < 4 * np.finfo(np.float32).eps
        assert np.array_equal(got[exact > np.finfo(np.float32).max], np.full((exact > 3.5e38).sum(), np.inf))
        tiny = exact < np.finfo(np.float32).tiny  # denormal results and 0
        assert np.all(np.abs(got[tiny] - exact[tiny]) < 1e-44)
        assert np.isnan(got[np.isnan(x)]).all()


def test_erf_and_tanh_absolute_error(results):
    x, (_, z, w, _) = results
    ok = ~np.isnan(x)
    erf = np.array([math.erf(v) for v in x[ok].astype(np.float64)])
    assert np.abs(z[ok] - erf).max() < 5e-7  # the formula's 1.5e-7, plus float32 rounding
    assert np.abs(w[ok] - np.tanh(x[ok].astype(np.float64))).max() < 3e-7
    assert np.isnan(z[~ok]).all() and np.isnan(w[~ok]).all()
    assert z[x == np.inf][0] == 1.0 and z[x == -np.inf][0] == -1.0
    # where erf rounds to +-1 in f32 it is exactly that, clamped or not
    big = ok & (np.abs(x) >= 3.92)
    assert big.sum() > 100 and np.array_equal(z[big], np.sign(x[big]))


def test_erf_clamps_its_argument_so_its_exp_never_makes_a_denormal():
    """e^(-x^2) is a denormal from |x| = 9.4 on, and Intel cores take a
    microcode assist per denormal operand: the GELU of a 384 x 3072 matmul
    on random inputs ran in 8.6 ms instead of 0.6 (Emerald Rapids). |x| is
    clamped to 4, where erf is already 1.0 in f32."""
    from mlir_ansor.passes.math_approx import _ERF_ONE

    assert np.float32(math.erf(_ERF_ONE)) == 1.0
    assert np.exp(np.float32(-_ERF_ONE * _ERF_ONE)) >= np.finfo(np.float32).tiny
    with ir.Context(), ir.Location.unknown():
        module = ir.Module.parse(KERNEL.replace("math.exp %v : vector<8xf32>", "arith.negf %v : vector<8xf32>")
                                 .replace("math.tanh %v : vector<8xf32>", "arith.negf %v : vector<8xf32>")
                                 .replace("math.exp %v : f32", "arith.negf %v : f32"))
        assert expand_math(module, True) == 1  # the erf alone
        text = str(module)
        (a,) = re.findall(r"(%\w+) = math.absf", text)
        (c,) = re.findall(rf"= arith.minimumf {a}, (%\w+)", text)
        assert re.search(rf"{c} = arith.constant dense<4.000000e\+00>", text)
