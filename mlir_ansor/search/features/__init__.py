"""Features of candidates, read from the scheduled IR, for the cost model.

Roadmap:
  * :func:`extract_features` is the entry point: a sketch and a population
    of knob assignments in, one ``(statements, N_FEATURES)`` array per
    candidate out. :data:`FEATURE_NAMES` names the columns (documented in
    ``docs/features.md``).
  * :class:`FeatureExtractor` (one per sketch, cached by sketch hash) holds
    one :class:`Template` per *structural key*; a template is the IR
    structure of the scheduled program plus a formula for every number in it.
  * :func:`read_program` reads a scheduled module (after the transform
    script, before LLVM) into a :class:`Structure` and named quantities;
    :func:`program_features` turns those into the feature rows. Both paths
    (a template evaluated for a population, or one real module read
    directly) go through the same feature code, so tests can check one
    against the other.

One concept per file:
  * `reader.py`: the IR reader (:func:`read_program`, :class:`Structure`
    and its parts :class:`Axis`, :class:`Statement`, :class:`Access`,
    :class:`Alloc`; the op categories :data:`COMPUTE_CATS`).
  * `rows.py`: the feature columns (:data:`FEATURE_NAMES`,
    :data:`N_FEATURES`) and their arithmetic (:func:`program_features`,
    :func:`features_of_module`).
  * `template.py`: structural keys, probe assignments and the fitting of
    quantities (:class:`Template`, :func:`fit_template`).
  * `extractor.py`: probing a sketch and the per-sketch cache
    (:class:`FeatureExtractor`, :func:`extractor_for`,
    :func:`extract_features`).

Why templates and not the IR of every candidate: applying the transform
interpreter costs 20-60 ms per candidate, i.e. 15-50 candidates/s, while
evolutionary search scores thousands per batch. But across the candidates of
one sketch the scheduled IR has the same *shape* (the same loops, the same
statements touching the same buffers); only numbers change: trip counts,
steps, vector widths, how many times a body is replicated (register rows,
unroll), allocation shapes, index coefficients. Each of those numbers is a
product of knob values and constants (``1024 / p_d0``, ``p_d0 / r_d0``,
``r_d0 * u_d2``, ``k_d2 x p_d1``). So, once per structural key, the sketch
is applied to a few *probe* assignments (chosen so that no loop has a single
iteration, which canonicalization would fold away and so change the shape);
every named quantity is fitted as ``c * prod(knob ** e)`` with integer
exponents by least squares in log space and verified exactly on every probe.
A population is then evaluated with numpy: ``exp(log K @ E) * c`` gives every
quantity of every candidate at once, and the features are array arithmetic
over the population (tens of thousands of candidates per second, against a
target of 200).

The structural key of an assignment is the value of every knob that changes
the shape rather than a number: ``transform.tune.alternatives`` (packing or
not) and knobs with at most two options (e.g. a convolution window tile of
1 or 3, which moves a loop between tiling levels), and the remainder of a
tile that is not a multiple of its parent tile (6 register rows in a thread
tile of 64 peel 4 rows: `remainder_name`). Degenerate values (a tile
equal to its loop, giving one iteration) are evaluated with the fitted
formulas, which give the right numbers (a trip count of 1, a replication of
1); the features never count loops of one iteration, so a folded loop and a
loop of one iteration look the same.

Probes run in an isolated worker process by default (``isolate=True``,
the measurement pool of `measure/pool.py`): an
MLIR build with assertions can abort the process on a bad schedule, and the
tuner must not die with it. A quantity whose formula cannot be fitted falls
back to the median of its probe values (counted in
``Template.unfitted``); a key whose probes all fail gives zero features.
"""

from __future__ import annotations

from mlir_ansor.search.features.extractor import (
    FeatureExtractor,
    extract_features,
    extractor_for,
    template_cache,
)
from mlir_ansor.search.features.reader import (
    COMPUTE_CATS,
    Access,
    Alloc,
    Axis,
    Statement,
    Structure,
    read_program,
)
from mlir_ansor.search.features.rows import (
    AI_POINTS,
    CACHE_LINE,
    FEATURE_NAMES,
    MAX_BUFFERS,
    N_FEATURES,
    features_of_module,
    program_features,
)
from mlir_ansor.search.features.template import (
    Template,
    fit_template,
    probe_assignments,
    remainder_name,
    structural_knobs,
)

__all__ = [
    "AI_POINTS",
    "CACHE_LINE",
    "COMPUTE_CATS",
    "FEATURE_NAMES",
    "MAX_BUFFERS",
    "N_FEATURES",
    "Access",
    "Alloc",
    "Axis",
    "FeatureExtractor",
    "Statement",
    "Structure",
    "Template",
    "extract_features",
    "extractor_for",
    "features_of_module",
    "fit_template",
    "probe_assignments",
    "program_features",
    "read_program",
    "remainder_name",
    "structural_knobs",
    "template_cache",
]
