"""The search space of a sketch: knobs, their constraints, and sampling.

A knob is data (a frozen :class:`KnobSpec`); a concrete schedule is an
:class:`Assignment`, an immutable, hashable tuple of ``(name, value)`` pairs
sorted by name, so it can be stored in the database and replayed.

Every sample is valid by construction: a knob takes one of its options, and
the options and relations say which sizes the sketch can build. A knob with
a ``divides`` parent takes a value that divides the parent's value; with a
``multiple_of`` parent, a multiple of it (or, when no option is one, a
value no smaller; with ``or_whole``, the whole extent too); with an
``at_least`` parent, a value no smaller (or the largest option). Tile sizes that do not divide the
extent they tile are options only where the sketch handles the partial tile
(peeled remainders, masked vectors): see `search/rules/multi_level_tiling.py`.
Knobs are listed parents-first, so one pass samples them.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

Assignment = tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class KnobSpec:
    """One free parameter of a sketch.

    name: unique within the sketch; the `transform.tune.knob` (or
    `transform.tune.alternatives`) op carries the same name.
    options: every value the knob may take.
    divides: name of an earlier knob whose value this one must divide.
    multiple_of: name of an earlier knob whose value must divide this one
    (when it divides none of the options: this one must not be smaller).
    at_least: name of an earlier knob whose value this one must not be
    smaller than (the largest option is always allowed: the whole extent).
    or_whole: with `multiple_of`, the largest option (the whole extent) is
    allowed too, a multiple or not: one tile whose last register tile the
    sketch masks (a contraction's partial rows).
    alternatives: True for a `transform.tune.alternatives` choice (options are
    region indices), False for a numeric `transform.tune.knob`.
    doc: what the knob controls, for reports.
    """

    name: str
    options: tuple[int, ...]
    divides: str | None = None
    multiple_of: str | None = None
    at_least: str | None = None
    alternatives: bool = False
    doc: str = ""
    or_whole: bool = False

    def allowed(self, chosen: Mapping[str, int]) -> tuple[int, ...]:
        """Options compatible with the values already chosen for earlier knobs."""
        ok = self.options
        if self.divides is not None and self.divides in chosen:
            parent = chosen[self.divides]
            ok = tuple(o for o in ok if o != 0 and parent % o == 0)
        if self.multiple_of is not None and self.multiple_of in chosen:
            base = chosen[self.multiple_of]
            multiples = tuple(o for o in ok if base != 0 and o % base == 0)
            top = max(self.options)
            if self.or_whole and multiples and top not in multiples and top in ok:
                multiples += (top,)
            # A parent that divides none of the options (6 register rows in
            # a loop of 1024, whose remainder the schedule peels): then any
            # option at least as large.
            ok = multiples or tuple(o for o in ok if o >= base)
        if self.at_least is not None and self.at_least in chosen:
            floor, top = chosen[self.at_least], max(self.options)
            ok = tuple(o for o in ok if o >= floor or o == top)
        return ok or (min(self.options),)


def divisors(n: int) -> tuple[int, ...]:
    """All positive divisors of `n`, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return tuple(sorted(set(small + [n // d for d in small])))


# Tile counts tried beside the divisors when a tile may leave a partial one.
_MULTIPLES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


def partial_tile_options(extent: int, bases: Iterable[int]) -> tuple[int, ...]:
    """Tile sizes for a loop whose last tile may be partial: every divisor of
    `extent`, and the multiples ``b * j`` (j in 1, 2, 3, 4, 6, 8, ... 64) of
    each base `b` (the register tile sizes it must be a multiple of) below
    `extent`, so that every base has multiples to choose from even when the
    extent is prime."""
    opts = set(divisors(extent))
    for b in bases:
        opts.update(b * j for j in _MULTIPLES if b * j < extent)
    return tuple(sorted(opts))


def make_assignment(values: Mapping[str, int] | Iterable[tuple[str, int]]) -> Assignment:
    items = values.items() if isinstance(values, Mapping) else values
    return tuple(sorted((str(k), int(v)) for k, v in items))


def sample(knobs: tuple[KnobSpec, ...], rng: random.Random) -> Assignment:
    """Draw one assignment uniformly per knob among the values still allowed."""
    chosen: dict[str, int] = {}
    for k in knobs:
        chosen[k.name] = rng.choice(k.allowed(chosen))
    return make_assignment(chosen)


def is_valid(knobs: tuple[KnobSpec, ...], assignment: Assignment) -> bool:
    """Whether `assignment` sets every knob to an allowed value."""
    values = dict(assignment)
    if set(values) != {k.name for k in knobs}:
        return False
    return all(values[k.name] in k.allowed(values) for k in knobs)
