"""Features of scheduled programs: values checked on a small matmul sketch
(128x256x64), and the template path checked against reading the real IR."""

from __future__ import annotations

import math
import random
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import INPUTS
from mlir import ir

from mlir_ansor.graph.task import extract_tasks
from mlir_ansor.passes.compile_cache import CompileCache
from mlir_ansor.schedule.apply import apply_schedule
from mlir_ansor.search import features as F
from mlir_ansor.search.generate import generate_sketches
from mlir_ansor.search.space import is_valid, sample
from mlir_ansor.target import Target

AVX2 = Target("cpu", 256, 2, "test", ("avx2", "fma"))
M, N, K = 128, 256, 64
COL = {n: i for i, n in enumerate(F.FEATURE_NAMES)}


@pytest.fixture(scope="module")
def setup():
    (task,) = extract_tasks(str(INPUTS / "matmul.mlir"))
    sk = generate_sketches(task.mlir, AVX2)[0]
    fx = F.FeatureExtractor(sk, isolate=False, n_probes=12)
    return task, sk, fx


def _read(sk, a):
    with ir.Context(), ir.Location.unknown():
        module = apply_schedule(sk.payload, sk.concrete(a))
        return F.read_program(module), F.features_of_module(module)


def _fma_statement(st):
    (s,) = [s for s in st.statements if "fma" in s.cats]
    return s


def _peeled(a) -> bool:
    """6 register rows in a thread tile they do not divide: the rest peeled."""
    d = dict(a)
    return d["p_d0"] % d["r_d0"] != 0


def test_fixed_length_and_every_feature_documented(setup):
    _, sk, fx = setup
    rng = random.Random(0)
    feats = fx.features([sample(sk.knobs, rng) for _ in range(40)])
    assert len(F.FEATURE_NAMES) == F.N_FEATURES == len(set(F.FEATURE_NAMES))
    assert all(f.ndim == 2 and f.shape[1] == F.N_FEATURES and f.shape[0] >= 2 for f in feats)
    assert all(np.isfinite(f).all() for f in feats)
    doc = (Path(__file__).parent.parent / "docs" / "features.md").read_text()
    documented = set(re.findall(r"`([a-z0-9_]+)`", doc))
    for name in F.FEATURE_NAMES:
        generic = re.sub(r"^buf\d_", "buf<i>_", re.sub(r"_\d+$", "_<i>", name))
        assert name in documented or generic.replace("<i>", "i") in documented or generic in doc, name


def test_flops_of_every_candidate_sum_to_the_task(setup):
    # Degenerate tiles included (loops of one iteration): the formulas hold.
    task, sk, fx = setup
    rng = random.Random(1)
    pop = [sample(sk.knobs, rng) for _ in range(200)]
    for f in fx.features(pop):
        total = sum(2.0 ** r[COL["flops"]] - 1 for r in f)
        assert total == pytest.approx(2 * M * N * K, rel=1e-9)
    assert task.flops == 2 * M * N * K


def test_vector_width_and_trip_counts(setup):
    _, sk, fx = setup
    rng = random.Random(2)
    pop = [sample(sk.knobs, rng) for _ in range(64)]
    feats = fx.features(pop)
    widths = set()
    for a, f in zip(pop, feats):
        d = dict(a)
        vecs = set(f[f[:, COL["fma_ops"]] > 0, COL["vec_len"]])
        assert vecs == {d["r_d1"]}  # the FMAs are as wide as the vector tile
        widths |= vecs
        if _peeled(a):
            continue  # two FMA statements (the peeled rows): their flops are checked above
        key = fx.key_of(a)
        t = fx.template(key)
        q = t.quantities(np.array([[d[k] for k in t.knobs]], float))
        s = _fma_statement(t.structure)
        trips = math.prod(q[f"{ax}.trip"][0] for ax in s.axes)
        # Loop trips x register tile (rows x vector x unroll) = the iteration space.
        assert trips * d["r_d0"] * d["r_d1"] * d["u_d2"] == M * N * K
        forall = [ax for ax in s.axes if dict((x.id, x.kind) for x in t.structure.axes)[ax] == "forall"]
        assert math.prod(q[f"{ax}.trip"][0] for ax in forall) == (M // d["p_d0"]) * (N // d["p_d1"])
    assert {8, 16} <= widths


def test_packed_buffer_bytes_are_the_tile(setup):
    _, sk, fx = setup
    rng = random.Random(3)
    n = 0
    for _ in range(200):
        a = sample(sk.knobs, rng)
        d = dict(a)
        if d["pack"] != 0:
            continue
        t = fx.template(fx.key_of(a))
        q = t.quantities(np.array([[d[k] for k in t.knobs]], float))
        inner = [al for al in t.structure.allocs if al.axes]  # the output buffer is allocated outside loops
        (buf,) = inner
        bytes_ = math.prod(q[f"shape.{buf.buf}.{j}"][0] for j in range(buf.rank)) * buf.elsize
        assert bytes_ == d["k_d2"] * d["p_d1"] * 4  # a k-tile x n-tile of B, f32
        n += 1
    assert n > 20


def test_template_matches_the_real_ir(setup):
    # On assignments without loops of one iteration the template has the
    # same structure as the real IR, and every fitted quantity is exact.
    _, sk, fx = setup
    rng = random.Random(7)
    checked = 0
    # Without a remainder, and with 6 register rows peeling 2 or 4 rows of
    # their thread tile (`features.remainder_name`).
    for key in [(("pack", 0),), (("pack", 1),), (("pack", 0), ("p_d0%r_d0", 2)), (("pack", 1), ("p_d0%r_d0", 4))]:
        t = fx.template(key)
        assert t.structure is not None and t.probes >= 8
        for a in F.probe_assignments(sk.knobs, dict(key), rng, 3):
            assert is_valid(sk.knobs, a)
            (st, vals), direct = _read(sk, a)
            assert st == t.structure
            q = t.quantities(np.array([[dict(a)[k] for k in t.knobs]], float))
            fitted = [name for name in vals if name not in t.unfitted]
            assert all(q[name][0] == pytest.approx(vals[name]) for name in fitted)
            via_template = fx.features([a])[0]
            exact = [c for n, c in COL.items() if n not in ("shuffle_ops", "int_ops")]
            np.testing.assert_allclose(via_template[:, exact], direct[:, exact], rtol=1e-9)
            assert fx.key_of(a) == key
            checked += 1
    assert checked == 12


def test_reuse_and_stride_of_the_fma_statement(setup):
    # In the FMA statement, B (or its packed copy) does not depend on the
    # row loops: loop-carried reuse; A is read with stride K along rows.
    _, sk, fx = setup
    a = (("k_d2", 16), ("p_d0", 32), ("p_d1", 64), ("pack", 1), ("r_d0", 4), ("r_d1", 16), ("u_d2", 2))
    f = fx.features([a])[0]
    t = fx.template(fx.key_of(a))
    idx = t.structure.statements.index(_fma_statement(t.structure))
    row = f[idx]
    assert row[COL["vec_len"]] == 16
    assert row[COL["unroll_num"]] == 4 * 2  # rows x unroll FMAs per iteration
    reuse = [row[COL[f"buf{b}_reuse_loop"]] for b in range(2)]
    assert max(reuse) == 1.0


def test_isolated_templates_come_from_one_kept_worker_and_survive_its_crash(setup, monkeypatch):
    """Templates made in the probe worker equal those made in process; the
    templates a population needs are made in one job, by a worker kept
    between calls; a job that kills the worker is redone one probe a job."""
    import faulty_jobs

    from mlir_ansor.search.features import extractor as E

    _, sk, local = setup
    rng = random.Random(3)
    pop = [sample(sk.knobs, rng) for _ in range(40)]
    isolated = F.FeatureExtractor(sk, isolate=True, n_probes=12)
    jobs = []
    real_run = E._run_probes
    monkeypatch.setattr(E, "_run_probes", lambda *a: jobs.append(len(a[2])) or real_run(*a))
    got = isolated.features(pop)
    keys = {isolated.key_of(a) for a in pop}
    assert len(keys) > 1 and jobs == [12 * len(keys)]
    for g, w in zip(got, local.features(pop)):
        np.testing.assert_allclose(g, w)
    pool = E._probe_pool()
    assert E._probe_pool() is pool  # kept for the next sketch

    monkeypatch.setattr(E, "_probe_worker", faulty_jobs.probe_that_aborts_on_batches)
    again = F.FeatureExtractor(sk, isolate=True, n_probes=12)
    for g, w in zip(again.features(pop[:8]), local.features(pop[:8])):
        np.testing.assert_allclose(g, w)


def test_templates_kept_in_the_template_cache_are_not_probed_again(setup, tmp_path, monkeypatch):
    """Within `template_cache(CompileCache(DIR))` a template is written once and read by
    any later extractor of the sketch (another process's too): no probe is
    applied again and the features are the same; a file cut short is a
    miss, probed and written again."""
    from mlir_ansor.search.features import extractor as E

    _, sk, local = setup
    rng = random.Random(11)
    pop = [sample(sk.knobs, rng) for _ in range(30)]
    probed = []
    real_run = E._run_probes
    monkeypatch.setattr(E, "_run_probes", lambda *a: probed.append(len(a[2])) or real_run(*a))
    with F.template_cache(CompileCache(tmp_path / "t")):
        want = F.FeatureExtractor(sk, isolate=False, n_probes=12).features(pop)
        files = sorted((tmp_path / "t" / "templates").iterdir())
        assert probed and len(files) == len({local.key_of(a) for a in pop})
        probed.clear()
        got = F.FeatureExtractor(sk, isolate=False, n_probes=12).features(pop)
        assert probed == []
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w)
        files[0].write_bytes(files[0].read_bytes()[:20])
        F.FeatureExtractor(sk, isolate=False, n_probes=12).features(pop)
        assert probed == [12]
    probed.clear()
    F.FeatureExtractor(sk, isolate=False, n_probes=12).features(pop[:3])  # outside the block: no cache
    assert probed
