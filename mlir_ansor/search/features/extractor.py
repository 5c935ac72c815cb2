"""The entry point: :class:`FeatureExtractor` (one per sketch, cached by
sketch hash, :func:`extractor_for`) makes a template per structural key
lazily, by applying the sketch to probe assignments (in an isolated worker
process by default) and fitting them; :func:`extract_features` gives the
feature rows of a population.
"""

from __future__ import annotations

import atexit
import contextlib
import pickle
import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mlir_ansor.passes.compile_cache import CompileCache
from mlir_ansor.search.features.reader import read_program
from mlir_ansor.search.features.rows import N_FEATURES, program_features
from mlir_ansor.search.features.template import (
    Template,
    fit_template,
    probe_assignments,
    remainder_name,
    structural_knobs,
)
from mlir_ansor.search.sketch import Sketch
from mlir_ansor.search.space import Assignment

# --------------------------------------------------------------------------
# Probes and the extractor of a sketch.


def _probe_worker(payload: str, script: str, assignments: list[Assignment]) -> list:
    """Apply the sketch to each assignment; returns, per assignment, its
    (structure, quantities) or None when the schedule failed."""
    from mlir import ir

    from mlir_ansor.schedule.apply import BuildError, apply_schedule
    from mlir_ansor.search.sketch import select_knobs

    out = []
    for a in assignments:
        try:
            with ir.Context(), ir.Location.unknown():
                module = apply_schedule(payload, select_knobs(script, dict(a)))
                out.append(read_program(module))
        except (BuildError, ValueError, ir.MLIRError):
            out.append(None)
    return out



@dataclass
class FeatureExtractor:
    """Features for the candidates of one sketch (templates made lazily, one
    per structural key).

    n_probes: probe assignments applied per structural key.
    isolate: apply probes in an isolated worker process (a crash in MLIR
      cannot kill the caller).
    seed: the probes' random stream.
    """

    sketch: Sketch
    n_probes: int = 14
    isolate: bool = True
    seed: int = 0
    templates: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.struct = structural_knobs(self.sketch.knobs)
        self.multiples = tuple((k.name, k.multiple_of, remainder_name(k)) for k in self.sketch.knobs if k.multiple_of)

    def key_of(self, assignment: Assignment) -> tuple[tuple[str, int], ...]:
        """The structural knobs' values, then the remainder of each tile
        that is not a multiple of its parent (none in most sketches)."""
        d = dict(assignment)
        rests = tuple(
            (name, d[child] % d[parent])
            for child, parent, name in self.multiples
            if child in d and d.get(parent) and d[child] % d[parent]
        )
        return tuple((k, d[k]) for k in self.struct) + rests

    def template(self, key: tuple[tuple[str, int], ...]) -> Template:
        self.make_templates([key])
        return self.templates[key]

    def make_templates(self, keys: Sequence[tuple[tuple[str, int], ...]]) -> None:
        """Make the templates of `keys` that do not exist yet, applying all
        their probes in one job (a population of a fresh sketch needs a
        dozen templates; a worker each cost more than the probes)."""
        missing = [k for k in dict.fromkeys(keys) if k not in self.templates]
        for key in list(missing):
            kept = _load_template(self._cache_key(key))
            if kept is not None:
                self.templates[key] = kept
                missing.remove(key)
        if not missing:
            return
        probes = []
        for key in missing:
            rng = random.Random(f"{self.seed}:{self.sketch.hash}:{key}")
            probes.append(probe_assignments(self.sketch.knobs, dict(key), rng, self.n_probes))
        read = _run_probes(self.sketch.payload, self.sketch.script, [a for p in probes for a in p], self.isolate)
        at = 0
        for key, p in zip(missing, probes):
            self.templates[key] = fit_template(self.sketch.knobs, p, read[at : at + len(p)])
            _keep_template(self._cache_key(key), self.templates[key])
            at += len(p)

    def _cache_key(self, key: tuple[tuple[str, int], ...]) -> str | None:
        """The template cache's key of `key`'s template (None: no cache):
        the sketch, the key, the probes and (`CompileCache.key`) the
        toolchain (our version and source, the MLIR wheels: what the
        probes read)."""
        if _TEMPLATES is None:
            return None
        return _TEMPLATES.key(_KIND, self.sketch.hash, repr(key), self.n_probes, self.seed)

    def features(self, assignments: Sequence[Assignment]) -> list[np.ndarray]:
        """One (statements, N_FEATURES) array per assignment."""
        out: list[np.ndarray | None] = [None] * len(assignments)
        by_key: dict = {}
        for i, a in enumerate(assignments):
            by_key.setdefault(self.key_of(a), []).append(i)
        self.make_templates(list(by_key))
        for key, idx in by_key.items():
            t = self.template(key)
            if t.structure is None:
                for i in idx:
                    out[i] = np.zeros((1, N_FEATURES))
                continue
            vals = np.array([[dict(assignments[i])[k] for k in t.knobs] for i in idx], dtype=float)
            feats = program_features(t.structure, t.quantities(vals), len(idx))
            for j, i in enumerate(idx):
                out[i] = feats[j]
        return out  # type: ignore[return-value]


def _run_probes(payload: str, script: str, probes: list[Assignment], isolate: bool) -> list:
    if not isolate:
        return _probe_worker(payload, script, probes)
    # All probes in one job; if the worker crashes, again one probe per job
    # (a crash then loses only that probe).
    pool = _probe_pool()
    res = pool.run(_probe_worker, (payload, script, probes), timeout_s=max(300.0, 20.0 * len(probes)))
    if res.ok:
        return res.value
    out = []
    for a in probes:
        one = pool.run(_probe_worker, (payload, script, [a]), timeout_s=120.0)
        out.extend(one.value if one.ok else [None])
    return out


_KIND = "templates"  # the template cache's kind of entry (its folder in the cache)
_TEMPLATES: CompileCache | None = None


@contextlib.contextmanager
def template_cache(cache: CompileCache | None):
    """Within the block, templates are kept in `cache` (under
    ``templates/``) and read from it by every extractor: a sketch's probes
    are applied once per toolchain, not once per process (resuming a
    ResNet-50 tune spent 50 of 117 s making its templates again). None: no
    cache."""
    global _TEMPLATES
    before, _TEMPLATES = _TEMPLATES, cache
    try:
        yield
    finally:
        _TEMPLATES = before


def _load_template(key: str | None) -> Template | None:
    """The cached template of `key`; None when absent or damaged (the
    cache checks each entry's digest) or of another layout."""
    data = _TEMPLATES.get(_KIND, key, ".pkl", count=False) if key is not None else None
    if data is None:
        return None
    try:
        t = pickle.loads(data)
    except Exception:  # noqa: BLE001 - written by another layout: a miss, made again
        return None
    return t if isinstance(t, Template) else None


def _keep_template(key: str | None, t: Template) -> None:
    """A cache that cannot be written only costs the next process the
    probes (`CompileCache.put` writes aside, then renames)."""
    if key is not None:
        _TEMPLATES.put(_KIND, key, ".pkl", pickle.dumps(t, protocol=pickle.HIGHEST_PROTOCOL))


_PROBE_POOL = None
_PROBE_LOCK = threading.Lock()


def _probe_pool():
    """The process's probe worker, started on first use and kept (a tune
    makes templates for every task; starting an interpreter with MLIR for
    each cost about 0.4 s, as much as the probes). A crashed worker is
    replaced by the pool; a worker is renewed after 256 jobs, so memory
    that MLIR keeps cannot pile up; the pool closes at exit."""
    global _PROBE_POOL
    with _PROBE_LOCK:
        if _PROBE_POOL is None:
            from mlir_ansor.measure.pool import WorkerPool

            _PROBE_POOL = WorkerPool(1, max_jobs_per_worker=256)
            atexit.register(_close_probe_pool)
        return _PROBE_POOL


def _close_probe_pool() -> None:
    global _PROBE_POOL
    with _PROBE_LOCK:
        pool, _PROBE_POOL = _PROBE_POOL, None
    if pool is not None:
        pool.close()


_EXTRACTORS: dict[str, FeatureExtractor] = {}


def extractor_for(sketch: Sketch, *, isolate: bool = True) -> FeatureExtractor:
    """The cached extractor of a sketch (by sketch hash)."""
    fx = _EXTRACTORS.get(sketch.hash)
    if fx is None:
        fx = _EXTRACTORS[sketch.hash] = FeatureExtractor(sketch, isolate=isolate)
    return fx


def extract_features(sketch: Sketch, assignments: Sequence[Assignment], *, isolate: bool = True) -> list[np.ndarray]:
    """Features of candidates of `sketch`: one (statements, N_FEATURES)
    array per assignment (a program's features are its statement rows)."""
    return extractor_for(sketch, isolate=isolate).features(assignments)
