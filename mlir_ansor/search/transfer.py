"""Schedules carried from a task to the same task at other sizes.

A function with dynamic dimensions is tuned at a few sizes (``tune --sizes``);
it is called at others. The tasks of a size nobody tuned are the tuned ones
with other extents: the same ops, maps, body and element types, only the
static sizes of their types differ (their *family*, `family_key`). Such a
task takes the best schedule of its nearest tuned relative (by the ratios
of their extents, on a log scale: `size_distance`): the sketch the same
rule makes for it, with each knob at the option nearest to the relative's
value that the new extents allow (`transfer_knobs`, the search's own `repair`). `compile`
applies it to a task without records of its own (``source: transferred``);
the tuner seeds such a task's search with it (the records of one size seed
the next, as Ansor's and MetaSchedule's transfer learning start a new task
from a similar one's measurements).

A transferred schedule has not been measured at the new size: it is the
schedule a tuned neighbour found best, made valid for these extents. It is
built and lowered like a default schedule, and replaced by the naive
lowering where it fails to build.
"""

from __future__ import annotations

import hashlib
import logging
import math
import re
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from mlir_ansor.errors import AnsorError
from mlir_ansor.search.sketch import Sketch, default_assignment
from mlir_ansor.search.space import Assignment
from mlir_ansor.search.strategy.evolutionary import repair

log = logging.getLogger(__name__)

_SHAPED = re.compile(r"\b(tensor|memref|vector)<([^<>]*)>")

__all__ = ["Transfer", "faithful", "family_key", "size_distance", "transfer_knobs", "transferred", "with_added"]

_SCANNED = 64
"""A relative's best records looked at for ones the new sketch can make as they are."""


def family_key(task_mlir: str) -> str:
    """What a task is without its sizes: a digest of its text with every
    dimension of its shaped types written ``?``. Two tasks with the same
    key differ only in their static extents."""
    text = _SHAPED.sub(lambda m: f"{m.group(1)}<{_unsized(m.group(2))}>", task_mlir)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _dims(body: str) -> tuple[list[str], list[str]]:
    """A shaped type's body (``1x128x?xf32``) split into its dimensions
    (``1``, ``128``, ``?``) and the rest (the element type, even ``index``
    or one that holds an ``x``)."""
    parts = body.split("x")
    for i, p in enumerate(parts[:-1]):
        if not (p.isdigit() or p == "?"):
            return parts[:i], parts[i:]
    return parts[:-1], parts[-1:]


def _unsized(body: str) -> str:
    """A shaped type's body (``1x128x768xf32``) with every dimension ``?``
    (``?x?x?xf32``); the element type (even ``index``) is kept."""
    dims, rest = _dims(body)
    return "x".join(["?"] * len(dims) + rest)


def transfer_knobs(sketch: Sketch, knobs: Sequence[tuple[str, int]], source: Sketch | None = None,
                   threads: int | None = None) -> Assignment | None:
    """`knobs` (a relative's assignment of the sketch the same rule made
    for it, `source`) made valid for `sketch`: in sampling order, each value
    kept where `sketch` allows it, else the nearest allowed option (log
    scale); a knob the relative's sketch did not have (a choice its extents
    did not offer) takes its first allowed option, and one `sketch` lacks is
    dropped. A parallel tile that spanned the relative's whole loop spans
    this one's (one tile over the rows stays one tile: a 64-row GEMM's
    p = 64 carried to 104 rows took 52, the nearest option, and ran two row
    tiles of 52 = 4 x 12 + 4 rows, 0.760 ms, against 0.649 with one; 2
    threads, Emerald Rapids). One that split it evenly and would leave a
    remainder here spans this one's loop too, where with `threads` given
    the other parallel tiles keep that many threads busy (128 rows' p = 64
    carried to 100 rows took 60, tiles of 60 and 40 rows, 1.13x the static
    module's time; one tile of 100 ran 0.99x; 2 threads, Emerald Rapids).
    The relative's default point
    (`sketch.default_assignment` at `threads`, where given) becomes this
    sketch's own: the rule's choice made again for these extents (a
    16-row GEMM's default, 6 rows by 4 vectors, carried to 8 rows ran
    0.182 ms, 8 rows' own default, 8 by 4, 0.166; 2 threads, Emerald
    Rapids). None when they share no knob, a value is not an integer, or
    the result breaks a limit of the target."""
    if threads is not None and source is not None and source.prefer and sketch.prefer:
        if tuple(sorted(knobs)) == tuple(sorted(default_assignment(source, threads))):
            return default_assignment(sketch, threads)
    names = {k.name for k in sketch.knobs}
    values = {k: v for k, v in knobs if k in names}
    if not values or any(isinstance(v, bool) or not isinstance(v, int) for v in values.values()):
        return None
    if source is not None:
        mine = dict(sketch.forall)
        for name, extent in source.forall:
            if name not in mine or name not in values:
                continue
            v = values[name]
            if v >= extent:
                values[name] = mine[name]
            elif extent % v == 0 and mine[name] % v != 0:
                # Tiles that split the relative's loop evenly would leave a
                # remainder tile here (and a thread with more rows than the
                # other): one tile, where the other loops keep the threads busy.
                whole = dict(values, **{name: mine[name]})
                if threads is not None and sketch.parallelism(repair(sketch.knobs, whole)) >= threads:
                    values = whole
    a = repair(sketch.knobs, values)
    return None if sketch.violation(a) is not None else a


@dataclass(frozen=True)
class Transfer:
    """A schedule carried over from a relative task."""

    sketch: Sketch
    knobs: Assignment
    source: str
    """The name of the task it was tuned for."""
    source_latency_s: float
    """Its measured latency there."""


def faithful(sketch: Sketch, knobs: Sequence[tuple[str, int]]) -> bool:
    """Whether a relative's `knobs` describe a schedule `sketch` can make:
    each of its knobs that `sketch` lacks was at the value `sketch`
    behaves as (`Sketch.implied`); a knob it lacks with no such value is
    taken as one the new sketch does not need."""
    names = {k.name for k in sketch.knobs}
    implied = dict(sketch.implied)
    return all(implied.get(k, v) == v for k, v in knobs if k not in names)


DROPPABLE = frozenset({"pack"})
"""Knobs of structural choices a sketch may no longer offer where records
made before it had them (the copy of B, which the contraction rule dropped
for a B in column panels in session 45): a record of an earlier form of a
sketch still applies without them (:func:`earlier_forms`)."""


ADDED = {"pack": 1}
"""Knobs of structural choices a sketch offers where records made before
it did not, with the value the earlier form behaved as (the copy of B,
offered at partial rows since session 50: before, B was read in place,
"pack" 1): a record of the earlier form applies with it
(:func:`earlier_forms`, :func:`with_added`)."""


def earlier_forms(sketches: Iterable[Sketch], knobs: Sequence[tuple[str, int]]) -> list[Sketch]:
    """The sketches among `sketches` that a record of an earlier form of
    one (a hash the rules no longer make) with `knobs` may have been tuned
    on, best first: those with exactly its knobs, then those with its knobs
    but :data:`DROPPABLE` ones they take as choices they do not need
    (:func:`faithful`), then those with its knobs and :data:`ADDED` ones
    (:func:`with_added` completes the record's knobs)."""
    names = {k for k, _ in knobs}
    exact, dropping, adding = [], [], []
    for sk in sketches:
        mine = {k.name for k in sk.knobs}
        if mine == names:
            exact.append(sk)
        elif mine and mine <= names and names - mine <= DROPPABLE and faithful(sk, knobs):
            dropping.append(sk)
        elif names and names <= mine and mine - names <= ADDED.keys():
            adding.append(sk)
    return exact + dropping + adding


def with_added(sketch: Sketch, knobs: Sequence[tuple[str, int]]) -> tuple[tuple[str, int], ...]:
    """`knobs` and, for each :data:`ADDED` knob `sketch` has and they lack,
    the value the earlier form behaved as, sorted by name."""
    names = {k for k, _ in knobs}
    extra = [(spec.name, ADDED[spec.name]) for spec in sketch.knobs if spec.name in ADDED and spec.name not in names]
    return tuple(sorted(tuple(knobs) + tuple(extra)))


def size_distance(a_mlir: str, b_mlir: str) -> float:
    """How far apart two relatives (task texts of one family) are: the sum,
    over the dimensions of their shaped types in the order the texts write
    them, of the ratio of the two extents on a log scale.

    Why not their flops: a family holds every task of one structure, and
    in a BERT layer the FFN's second matmul (K = 3072) and the output
    projection (K = 768), each with its bias and residual add, are one
    family. By flops, FFN-out at 100 rows (472 MFLOP) was nearest to the
    output projection at 384 rows (453 MFLOP), whose schedule is made for
    another K; by extents it is nearest to itself at 128 rows."""
    a, b = _extents(a_mlir), _extents(b_mlir)
    if len(a) != len(b):
        return math.inf
    return sum(abs(math.log(x) - math.log(y)) for x, y in zip(a, b) if x > 0 and y > 0)


def _extents(task_mlir: str) -> list[int]:
    """Every static dimension of the shaped types in `task_mlir`, in
    order (a dynamic one is 0)."""
    return [int(p) if p.isdigit() else 0 for m in _SHAPED.finditer(task_mlir) for p in _dims(m.group(2))[0]]


def transferred(
    database,
    task,
    sketches: Sequence[Sketch],
    target,
    *,
    threads: int,
    prefer_host: str | None = None,
    relatives: int = 2,
    per_relative: int = 2,
    source_key: str | None = None,
    sources: Collection[str] | None = None,
    defaults: bool = True,
) -> list[Transfer]:
    """The best schedules of `task`'s nearest relatives in `database`
    (`relatives` of them, nearest first, `per_relative` each; `source_key`:
    only the relative of that workload key; `sources`: only relatives of
    those workload keys), carried to
    `sketches` (the task's own, by sketch name). Of a relative's records,
    those `sketch` can make as they are come first (`faithful`: a relative
    tuned at 8 rows may have chosen to copy B, which a sketch for 7 rows
    streaming B does not offer, unless B is in column panels already,
    where the copy changes next to nothing); the others follow. Carried
    without the copy, such a record can be much slower: 256 rows' best
    (8 x 32 registers, `k` 1024, 64 columns a thread tile, B copied) ran
    333 rows 2.07x as long reading B in place as copying it (Emerald
    Rapids, 2 threads). A
    relative's default point becomes the task's own (`transfer_knobs`),
    unless `defaults` is False (a sketch made at a probe size, not the
    size it runs at). Empty when it has none, or none whose schedule fits."""
    from mlir_ansor.search.generate import generate_sketches

    family = family_key(task.mlir)
    others = [
        w
        for w in database.workloads()
        if w["workload_key"] != task.workload_key and family_key(w["task_mlir"]) == family
        and source_key in (None, w["workload_key"]) and (sources is None or w["workload_key"] in sources)
    ]
    others.sort(key=lambda w: size_distance(w["task_mlir"], task.mlir))
    mine = {}
    for sk in sketches:
        mine.setdefault(sk.name, sk)
    out: list[Transfer] = []
    taken: set = set()
    used = 0
    for w in others:
        if used >= relatives:
            break
        best = database.best(w["workload_key"], target.key, threads=threads, k=_SCANNED, prefer_host=prefer_host)
        if not best:
            continue
        try:
            theirs = {sk.hash: sk for sk in generate_sketches(w["task_mlir"], target)}
        except AnsorError as e:
            log.debug("transfer: task %s: no sketches (%s)", w["name"], e)
            continue
        used += 1
        carried: list[tuple[bool, Transfer]] = []
        for rec in best:
            src = theirs.get(rec.sketch_hash) or next(iter(earlier_forms(theirs.values(), rec.knobs)), None)
            sk = mine.get(src.name) if src is not None else None
            if sk is None:
                continue
            knobs = transfer_knobs(sk, with_added(src, rec.knobs), source=src, threads=threads if defaults else None)
            if knobs is None or (sk.hash, knobs) in taken:
                continue
            taken.add((sk.hash, knobs))
            carried.append((faithful(sk, rec.knobs), Transfer(sk, knobs, w["name"], rec.latency_s)))
        carried.sort(key=lambda ft: not ft[0])  # stable: by latency within each kind
        out += [t for _, t in carried[:per_relative]]
    return out
