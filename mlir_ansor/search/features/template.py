"""Templates: the structure of one structural key and a fitted formula
per quantity (:class:`Template`, :func:`fit_template`), the knobs that make
up a structural key (:func:`structural_knobs`, :func:`remainder_name`), and
the probe assignments the formulas are fitted on (:func:`probe_assignments`).
The package docstring (`search/features/__init__.py`) explains why.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mlir_ansor.search.features.reader import Structure
from mlir_ansor.search.space import Assignment, KnobSpec

# --------------------------------------------------------------------------
# Templates: one structure, a formula per quantity.


@dataclass
class Template:
    """The structure of one structural key and a fitted formula per quantity:
    value = const * prod(knob ** exponent) over the `knobs` columns."""

    structure: Structure | None
    knobs: tuple[str, ...]
    names: tuple[str, ...]
    consts: np.ndarray  # (Q,)
    exponents: np.ndarray  # (len(knobs), Q)
    unfitted: tuple[str, ...] = ()
    probes: int = 0
    linear: dict = field(default_factory=dict)  # name -> weights over _basis() columns
    pairs: bool = False  # whether the basis has the pairwise products

    def quantities(self, values: np.ndarray) -> dict[str, np.ndarray]:
        """Every quantity for a population; `values` is (n, len(knobs))."""
        values = values.astype(float)
        logk = np.log(np.maximum(values, 1e-12))
        vals = np.rint(np.exp(logk @ self.exponents) * self.consts[None, :] * 1e6) / 1e6
        out = {name: vals[:, i] for i, name in enumerate(self.names)}
        if self.linear:
            basis = _basis(values, self.pairs)
            for name, w in self.linear.items():
                out[name] = np.rint(basis @ w * 1e6) / 1e6
        return out


def _basis(values: np.ndarray, pairs: bool) -> np.ndarray:
    """Columns 1, k_i (and k_i * k_j, i <= j, with `pairs`) of a (n, knobs)
    matrix: the terms of a quantity that is a sum of monomials (index
    arithmetic, shuffles)."""
    n, m = values.shape
    cols = [np.ones(n)] + [values[:, i] for i in range(m)]
    if pairs:
        cols += [values[:, i] * values[:, j] for i in range(m) for j in range(i, m)]
    return np.stack(cols, axis=1)


def structural_knobs(knobs: Sequence[KnobSpec]) -> tuple[str, ...]:
    """Knobs whose value changes the shape of the scheduled IR (see the
    package docstring)."""
    return tuple(k.name for k in knobs if k.alternatives or len(k.options) <= 2)


def remainder_name(knob: KnobSpec) -> str:
    """The structural-key entry of a knob whose value need not be a multiple
    of its ``multiple_of`` parent (6 register rows in a thread tile of 64:
    the rest, 4 rows, is peeled): the remainder, which changes the shape of
    the scheduled IR (a peeled loop, with that many rows)."""
    return f"{knob.name}%{knob.multiple_of}"


def probe_assignments(knobs: Sequence[KnobSpec], key: dict[str, int], rng: random.Random, n: int) -> list[Assignment]:
    """Distinct assignments for fitting, in which no loop has one iteration
    (canonicalization would fold it away and change the shape): structural
    knobs fixed to `key`; a knob that is a multiple of another never equals
    it (the loop between them would have one iteration); a knob whose
    options are the divisors of a loop extent never takes the whole extent.
    Assignments that cannot meet this are drawn again; when none can, the
    rules are dropped."""
    out: list[Assignment] = []
    seen: set[Assignment] = set()
    for attempt in range(200 * n):
        strict = attempt < 100 * n
        chosen: dict[str, int] = {}
        ok = True
        for k in knobs:
            if k.name in key:
                chosen[k.name] = key[k.name]
                continue
            cands = list(k.allowed(chosen))
            if k.multiple_of is not None and k.multiple_of in chosen:
                # The remainder the key names (none when it names none).
                base, rem = chosen[k.multiple_of], key.get(remainder_name(k), 0)
                cands = [v for v in cands if base and v % base == rem]
                if strict:
                    # Not one tile (a loop of one iteration); with a peeled
                    # rest, two full tiles before it.
                    cands = [v for v in cands if v != base and (not rem or v >= 2 * base)]
            if strict:
                top = max(k.options)
                if len(k.options) > 2 and all(top % o == 0 for o in k.options) and 1 in k.options:
                    cands = [v for v in cands if v != top]
            if not cands:
                ok = False
                break
            chosen[k.name] = rng.choice(cands)
        if not ok:
            continue
        a = tuple(sorted(chosen.items()))
        if a not in seen:
            seen.add(a)
            out.append(a)
        if len(out) >= n:
            break
    return out


def fit_template(knobs: Sequence[KnobSpec], probes: list[Assignment], read: list) -> Template:
    """Fit every quantity from the probes that share the most common structure."""
    groups: dict = {}
    for a, r in zip(probes, read):
        if r is None:
            continue
        st, vals = r
        sig = (st, tuple(sorted(vals)))
        groups.setdefault(sig, []).append((a, vals))
    numeric = tuple(k.name for k in knobs if not k.alternatives)
    if not groups:
        return Template(None, numeric, (), np.zeros(0), np.zeros((len(numeric), 0)), probes=0)
    (st, names), members = max(groups.items(), key=lambda kv: len(kv[1]))
    kmat = np.array([[dict(a)[k] for k in numeric] for a, _ in members], dtype=float)
    logk = np.log(np.maximum(kmat, 1e-12))
    varying = [i for i in range(len(numeric)) if np.ptp(logk[:, i]) > 0]
    x = np.hstack([np.ones((len(members), 1)), logk[:, varying]])
    vals = np.array([[v[name] for name in names] for _, v in members], dtype=float)  # (P, Q)
    consts = np.zeros(len(names))
    expo = np.zeros((len(numeric), len(names)))
    unfitted = []
    linear = {}
    # A sum of monomials is only trusted when there are more probes than terms.
    pairs = _basis(kmat[:1], True).shape[1] + 3 <= len(members)
    basis = _basis(kmat, pairs)
    can_linear = basis.shape[1] + 2 <= len(members)
    positive = np.all(vals > 0, axis=0)
    logv = np.log(np.where(vals > 0, vals, 1.0))
    sol, *_ = np.linalg.lstsq(x, logv, rcond=None)  # (1 + V, Q)
    for qi, name in enumerate(names):
        col = vals[:, qi]
        if np.ptp(col) == 0 or not positive[qi]:
            consts[qi] = float(np.median(col))
            continue
        e = np.rint(sol[1:, qi])
        c = np.exp(np.mean(logv[:, qi] - logk[:, varying] @ e))
        pred = c * np.exp(logk[:, varying] @ e)
        if np.allclose(pred, col, rtol=1e-6, atol=1e-6):
            consts[qi] = c
            expo[varying, qi] = e
        else:
            # Not a monomial: try a sum of monomials of degree <= 2.
            w, *_ = np.linalg.lstsq(basis, col, rcond=None)
            w = np.where(np.abs(w) < 1e-6, 0.0, w)
            if can_linear and np.allclose(basis @ w, col, rtol=1e-6, atol=1e-4):
                linear[name] = w
            else:
                unfitted.append(name)
            consts[qi] = float(np.median(col))
    return Template(st, numeric, tuple(names), consts, expo, tuple(unfitted), probes=len(members), linear=linear, pairs=pairs)


