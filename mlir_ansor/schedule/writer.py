"""Building transform-dialect schedules.

A :class:`ScheduleWriter` emits one `transform.named_sequence @__transform_main`
op by op. Each method emits one transform op (or a short, fixed group of
them), returns the SSA names of the handles it produces, and takes the plain
Python values or knob handles that parametrize it. Knobs are
`transform.tune.knob` ops; structural choices are
`transform.tune.alternatives` regions (see :meth:`alternatives`).

Why text and not the Python op builders: a sketch is data that is stored,
hashed, printed for the user and re-applied by plain `mlir-opt`; emitting its
text directly keeps the generator free of MLIR contexts (sketches can be made
in any process), and every produced script is parsed and verified before use
(:meth:`Sketch.concrete` in `search/sketch.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

ANY = "!transform.any_op"
PARAM = "!transform.param<i64>"

Size = int | str  # a static tile size, or the SSA name of a knob handle


def zero_of(dtype: str) -> str:
    """A zero of element type `dtype` as a typed attribute ("0.0 : bf16", "0 : i8")."""
    return f"0 : {dtype}" if dtype.startswith("i") else f"0.0 : {dtype}"


@dataclass
class ScheduleWriter:
    """Accumulates the body of the schedule; `text()` wraps it in a module."""

    lines: list[str] = field(default_factory=list)
    _counter: int = 0
    _indent: int = 2
    sequences: list[str] = field(default_factory=list)
    """Named sequences the body calls (matchers and actions of
    `transform.foreach_match`): written after ``@__transform_main``, which
    stays the module's first (its entry, for whoever runs the script)."""

    # ---------------------------------------------------------------- naming
    def _fresh(self, stem: str) -> str:
        self._counter += 1
        return f"%{stem}{self._counter}"

    def emit(self, line: str) -> None:
        self.lines.append(" " * self._indent + line)

    # ----------------------------------------------------------------- knobs
    def knob(self, name: str, options: Sequence[int], default: int | None = None) -> str:
        """A `transform.tune.knob` with integer options; returns its param handle.

        The knob is emitted without a `selected` value: a tuner selects one
        per candidate (the interpreter refuses to run an unselected knob).
        """
        h = self._fresh("k")
        opts = ", ".join(str(int(o)) for o in options)
        self.emit(f'{h} = transform.tune.knob<"{name}"> options = [{opts}] -> {PARAM}')
        return h

    def alternatives(self, name: str, regions: Sequence[callable], results: int = 1) -> list[str]:
        """A `transform.tune.alternatives` op: exactly one region runs.

        Each entry of `regions` is called with this writer to emit its body and
        must return the list of handle names the region yields.
        """
        outs = [self._fresh("alt") for _ in range(results)]
        if outs:
            self.emit(f'{", ".join(outs)} = transform.tune.alternatives<"{name}"> -> {", ".join([ANY] * results)} {{')
        else:
            self.emit(f'transform.tune.alternatives<"{name}"> {{')
        for i, region in enumerate(regions):
            self._indent += 2
            yielded = region(self)
            self.emit(f"transform.yield {', '.join(yielded)} : {', '.join([ANY] * len(yielded))}" if yielded else "transform.yield")
            self._indent -= 2
            self.emit("}, {" if i + 1 < len(regions) else "}")
        return outs

    # ---------------------------------------------------------------- match
    def match_op_id(self, target: str, op_id: int) -> str:
        """Match the payload op tagged `ansor.op = op_id` under `target`."""
        h = self._fresh("op")
        self.emit(
            f"{h} = transform.structured.match attributes{{ansor.op = {op_id} : i64}} in {target} "
            f": ({ANY}) -> {ANY}"
        )
        return h

    def match_ops(self, target: str, names: Sequence[str]) -> str:
        h = self._fresh("m")
        quoted = ", ".join(f'"{n}"' for n in names)
        self.emit(f"{h} = transform.structured.match ops{{[{quoted}]}} in {target} : ({ANY}) -> {ANY}")
        return h

    def match_func(self, target: str) -> str:
        return self.match_ops(target, ["func.func"])

    # --------------------------------------------------------------- tiling
    @staticmethod
    def _sizes(sizes: Sequence[Size]) -> tuple[str, list[str]]:
        text = ", ".join(str(s) for s in sizes)
        params = [s for s in sizes if isinstance(s, str)]
        return f"[{text}]", params

    def tile_forall(self, op: str, sizes: Sequence[Size]) -> tuple[str, str]:
        """`tile_using_forall`: returns (tiled op, forall loop)."""
        text, params = self._sizes(sizes)
        t, loop = self._fresh("t"), self._fresh("forall")
        in_types = ", ".join([ANY] + [PARAM] * len(params))
        self.emit(
            f"{t}, {loop} = transform.structured.tile_using_forall {op} tile_sizes {text} "
            f": ({in_types}) -> ({ANY}, {ANY})"
        )
        return t, loop

    def tile_for(self, op: str, sizes: Sequence[Size], *, fuse: bool = False) -> tuple[str, list[str]]:
        """`tile_using_for`: returns (tiled op, one loop handle per non-zero size).

        `fuse`: `transform.structured.fuse` instead, which also fuses the
        op's producers into the loops: the `linalg.fill` of an accumulator
        then writes its register tile inside them, so the accumulator starts
        as a zero vector in registers rather than a separate pass over the
        output that the op reads back. Every producer is fused, a packing
        copy too: tile this way only where none feeds the op. A loop between
        the producer and the op (a reduction tile) stops the fusion, and the
        op is tiled alone."""
        text, params = self._sizes(sizes)
        nloops = sum(1 for s in sizes if not (isinstance(s, int) and s == 0))
        t = self._fresh("t")
        loops = [self._fresh("loop") for _ in range(nloops)]
        in_types = ", ".join([ANY] + [PARAM] * len(params))
        out_types = ", ".join([ANY] * (1 + nloops))
        lhs = ", ".join([t] + loops)
        how = "fuse" if fuse else "tile_using_for"
        self.emit(
            f"{lhs} = transform.structured.{how} {op} tile_sizes {text}{' {apply_cleanup}' if fuse else ''} "
            f": ({in_types}) -> ({out_types})"
        )
        return t, loops

    def tile_reduction(self, op: str, sizes: Sequence[int]) -> tuple[str, str, str, str]:
        """`tile_reduction_using_for` (Ansor's rfactor) with static `sizes`
        (non-zero on the reduction loops): the reduction accumulates into
        partial results of that size, elementwise, and is combined once after
        the loop. Returns (fill of the partials, partial op, combining op, loop)."""
        outs = [self._fresh(s) for s in ("fill", "partial", "combine", "loop")]
        self.emit(
            f"{', '.join(outs)} = transform.structured.tile_reduction_using_for {op} "
            f"by tile_sizes = [{', '.join(str(s) for s in sizes)}] : ({ANY}) -> ({', '.join([ANY] * 4)})"
        )
        return tuple(outs)  # type: ignore[return-value]

    def tile_each(self, ops: str, sizes: Sequence[Size], *, fuse: bool = False, peel: bool = False) -> None:
        """Tile every op of the handle `ops` separately (`transform.foreach`);
        works when `ops` is empty too. Sizes may be knob handles: tiling one
        handle that holds several ops with knob sizes is refused ("expected
        as many parameter values as target ops"), tiling each is not.
        `fuse`: as :meth:`tile_for`'s. `peel`: peel the partial last tile
        of the innermost loop made (`transform.loop.peel`, where its step
        does not divide its range; the other sizes must divide theirs), as
        :meth:`peel_partial_loops` does for every loop, but only for these
        (the pass peels again every loop whose bounds it cannot prove whole,
        :meth:`tile_dynamic_rows`' too). The caller canonicalizes after,
        so that the full tiles have static shapes."""
        self.emit(f"transform.foreach {ops} : {ANY} {{")
        self.emit(f"^bb0(%each: {ANY}):")
        self._indent += 2
        _, loops = self.tile_for("%each", sizes, fuse=fuse)
        if peel and loops:
            for_op = self._fresh("for")
            self.emit(f'{for_op} = transform.cast {loops[-1]} : {ANY} to !transform.op<"scf.for">')
            # A step that divides the range is refused (a silenceable error): nothing to peel.
            self.emit(f'transform.sequence {for_op} : !transform.op<"scf.for"> failures(suppress) {{')
            self.emit('^bb0(%loop: !transform.op<"scf.for">):')
            self.emit(f'  %full, %rest = transform.loop.peel %loop : (!transform.op<"scf.for">) -> ({ANY}, {ANY})')
            self.emit("}")
        self._indent -= 2
        self.emit("}")

    def peel_partial_loops(self, root: str) -> str:
        """Peel every `scf.for` under `root` whose step may not divide its
        range (the `scf-for-loop-peeling` pass, inside remainders too): the
        main loop then runs full tiles of static shape, and the remainder
        iteration the rest, static when the loop bounds are. Loops whose
        step divides a static range are left alone, so on shapes that tiles
        divide this changes nothing.

        Every handle to ops inside `root` is invalidated: match again, in
        the returned handle (the functions). Not in a re-matched
        `scf.forall`: one with a single iteration is folded away here."""
        func = self.match_func(root)
        h = self._fresh("peeled")
        self.emit(
            f'{h} = transform.apply_registered_pass "scf-for-loop-peeling" '
            f'with options = {{ "skip-partial" = false }} to {func} : ({ANY}) -> {ANY}'
        )
        # Fold the peeled bounds into static tile shapes (else the full
        # tiles keep dynamic types and are not vectorized).
        self.emit(f"transform.apply_patterns to {h} {{")
        self.emit("  transform.apply_patterns.canonicalization")
        self.emit(f"}} : {ANY}")
        self.emit(f"transform.apply_cse to {h} : {ANY}")
        return h

    def fuse_into(self, producer: str, containing: str) -> tuple[str, str]:
        """`fuse_into_containing_op`: returns (fused op, new containing op)."""
        f, c = self._fresh("fused"), self._fresh("forall")
        self.emit(
            f"{f}, {c} = transform.structured.fuse_into_containing_op {producer} into {containing} "
            f": ({ANY}, {ANY}) -> ({ANY}, {ANY})"
        )
        return f, c

    # -------------------------------------------------------------- packing
    def pack_operand(
        self,
        op: str,
        operand: int,
        num_operands: int,
        dtype: str | Sequence[str],
        dims: Sequence[int] | None = None,
        copy_back: str = "none",
    ) -> str:
        """Copy operand `operand` of `op` into a fresh contiguous buffer.
        `dtype`: the operands' element type, or one per operand where they
        differ (bf16 inputs of an f32 matmul: each padding value has its
        operand's type).

        Implemented as a no-fold `pad` rewritten in destination-passing
        style, which leaves a `linalg.copy` into a `bufferization.alloc_tensor`.
        `dims` (loop indices) limits the padding to the loops that index the
        operand, whose tiles are static, so that no other operand of a
        partial tile gets padded (and copied). `copy_back`: how the result
        returns to the op's destination ("none" leaves an `extract_slice`,
        which folds away only when the output's shape is static).
        Returns the handle of the op after padding.
        """
        padded, pad, copy = self._fresh("padded"), self._fresh("pad"), self._fresh("copy")
        types = [dtype] * num_operands if isinstance(dtype, str) else list(dtype)
        zeros = ", ".join(zero_of(t) for t in types)
        nofold = ", ".join("1" if i == operand else "0" for i in range(num_operands))
        pad_dims = "" if dims is None else f"padding_dimensions = [{', '.join(str(d) for d in dims)}], "
        self.emit(
            f"{padded}, {pad}, {copy} = transform.structured.pad {op} {{padding_values = [{zeros}], "
            f"{pad_dims}nofold_flags = [{nofold}], copy_back_op = \"{copy_back}\"}} "
            f": ({ANY}) -> ({ANY}, {ANY}, {ANY})"
        )
        producer = self._fresh("prod")
        self.emit(f"{producer} = transform.get_producer_of_operand {padded}[{operand}] : ({ANY}) -> {ANY}")
        dps = self._fresh("dps")
        self.emit(
            f"{dps} = transform.structured.rewrite_in_destination_passing_style {producer} "
            f": ({ANY}) -> {ANY}"
        )
        return padded

    def pack_loops(self, op: str, sizes: Sequence[int], op_id: int | None = None) -> str:
        """`transform.structured.pack`: every loop with a non-zero size is
        split into an outer loop and an inner one of that size, the inner
        loops appended last, and each operand indexed by them is packed
        (`linalg.pack` producers). Returns the new `linalg.generic`, tagged
        ``ansor.op = op_id`` when given (the packed op is a new op)."""
        h = self._fresh("packed")
        self.emit(
            f"{h} = transform.structured.pack {op} packed_sizes = [{', '.join(str(int(s)) for s in sizes)}] "
            f": ({ANY}) -> {ANY}"
        )
        if op_id is not None:
            tag = self._fresh("tag")
            self.emit(f"{tag} = transform.param.constant {int(op_id)} : i64 -> {PARAM}")
            self.emit(f'transform.annotate {h} "ansor.op" = {tag} : {ANY}, {PARAM}')
        return h

    def producer_of(self, op: str, operand: int) -> str:
        """The op that produces operand `operand` of `op`."""
        h = self._fresh("prod")
        self.emit(f"{h} = transform.get_producer_of_operand {op}[{int(operand)}] : ({ANY}) -> {ANY}")
        return h

    def lower_pack(self, pack: str) -> None:
        """Rewrite a `linalg.pack` as pad, `expand_shape` and transpose: a
        pack that only splits the innermost dimension (no padding) is then
        a free view."""
        cast = self._fresh("pack")
        self.emit(f'{cast} = transform.cast {pack} : {ANY} to !transform.op<"linalg.pack">')
        outs = [self._fresh(s) for s in ("pad", "expand", "tr")]
        self.emit(
            f"{', '.join(outs)} = transform.structured.lower_pack {cast} "
            '{lowerPadLikeWithInsertSlice = false} : (!transform.op<"linalg.pack">) -> '
            '(!transform.op<"tensor.pad">, !transform.op<"tensor.expand_shape">, !transform.op<"linalg.transpose">)'
        )

    def unroll(self, loop: str, factor: int) -> None:
        """`transform.loop.unroll` by a static `factor` (the trip count: fully)."""
        self.emit(f"transform.loop.unroll {loop} {{factor = {int(factor)}}} : {ANY}")

    def apply_patterns(self, func: str, patterns: Sequence[str]) -> None:
        """One `transform.apply_patterns` region holding `patterns`
        (their names after ``transform.apply_patterns.``)."""
        self.emit(f"transform.apply_patterns to {func} {{")
        for p in patterns:
            self.emit(f"  transform.apply_patterns.{p}")
        self.emit(f"}} : {ANY}")
        self.emit(f"transform.apply_cse to {func} : {ANY}")

    def decompose(self, op: str) -> str:
        h = self._fresh("dec")
        self.emit(f"{h} = transform.structured.decompose {op} : ({ANY}) -> {ANY}")
        return h

    # -------------------------------------------------- vectors and cleanup
    def vectorize_children(self, func: str) -> str:
        h = self._fresh("vf")
        self.emit(f"{h} = transform.structured.vectorize_children_and_apply_patterns {func} : ({ANY}) -> {ANY}")
        return h

    def vectorize_each(self, ops: str, sizes: Sequence[Size]) -> None:
        """Vectorize every op of the handle `ops` to vectors of `sizes` (one
        per loop; knob handles allowed), masked where the op's extent is
        dynamic or smaller (partial tiles). Where the shape equals `sizes`
        no mask is made."""
        text, params = self._sizes(sizes)
        types = ", ".join([ANY] + [PARAM] * len(params))
        self.emit(f"transform.foreach {ops} : {ANY} {{")
        self.emit(f"^bb0(%each: {ANY}):")
        self.emit(f"  transform.structured.vectorize %each vector_sizes {text} : {types}")
        self.emit("}")

    def tile_dynamic_rows(self, root: str, ops: Sequence[tuple[str, int, int]], rows: Size,
                          options: Sequence[int] = (), down_to: int = 1) -> None:
        """Split every op under `root` whose row extent is dynamic into
        static tiles of rows, vectorized without masks. `ops`: (op name, its
        row loop, its loop count) of each kind of op to split; an op matches
        where its name and loop count are those and its extent on that loop
        is not static (`transform.match.structured.dim` gives a negative
        size). `rows`: a bound the op's rows stay below (the register
        tile's rows: an int, or a knob handle taking one of `options`); the
        op is tiled by the largest power of two below it, the rest peeled
        and tiled by the next (:func:`row_cascade`), down to tiles of
        `down_to` rows: fewer rows than that are left as they are, of a
        dynamic count, for a later call to split."""
        groups: dict[tuple[int, ...], tuple[int, int]] = {}
        for r in ([rows] if isinstance(rows, int) else options):
            steps = tuple(s for s in row_cascade(r) if s >= down_to)
            if steps:
                lo, hi = groups.get(steps, (r, r))
                groups[steps] = (min(lo, r), max(hi, r))
        pairs = []
        for name, row, rank in dict.fromkeys(ops):
            for steps, (lo, hi) in groups.items():
                k = len(self.sequences) // 2
                matcher, action = f"@dynamic_rows_{k}", f"@rows_by_{'_'.join(map(str, steps))}_{k}"
                if isinstance(rows, int):
                    args, check = "", ""
                else:
                    args = f", %rows: {PARAM} {{transform.readonly}}"
                    check = (f"    %lo = transform.param.constant {lo} : i64 -> {PARAM}\n"
                             f"    transform.match.param.cmpi ge %rows, %lo : {PARAM}\n"
                             f"    %hi = transform.param.constant {hi} : i64 -> {PARAM}\n"
                             f"    transform.match.param.cmpi le %rows, %hi : {PARAM}\n")
                self.sequences += [
                    f"  transform.named_sequence {matcher}(%op: {ANY} {{transform.readonly}}{args}) -> {ANY} {{\n"
                    f'    transform.match.operation_name %op ["{name}"] : {ANY}\n'
                    f"    %size, %loops = transform.match.structured %op : ({ANY}) -> ({PARAM}, {PARAM}) {{\n"
                    f"    ^bb0(%s: {ANY}):\n"
                    f"      %r = transform.match.structured.rank %s : ({ANY}) -> {PARAM}\n"
                    f"      %d = transform.match.structured.dim %s[{row}] : ({ANY}) -> {PARAM}\n"
                    f"      transform.match.structured.yield %d, %r : {PARAM}, {PARAM}\n"
                    "    }\n"
                    f"    %rank = transform.param.constant {rank} : i64 -> {PARAM}\n"
                    f"    transform.match.param.cmpi eq %loops, %rank : {PARAM}\n"
                    f"    %zero = transform.param.constant 0 : i64 -> {PARAM}\n"
                    f"    transform.match.param.cmpi lt %size, %zero : {PARAM}\n"
                    f"{check}"
                    f"    transform.yield %op : {ANY}\n"
                    "  }",
                    f"  transform.named_sequence {action}(%op: {ANY} {{transform.consumed}}) {{\n"
                    + _cascade_body(name, row, rank, steps)
                    + "    transform.yield\n"
                    "  }",
                ]
                pairs.append(f"{matcher} -> {action}")
        if pairs:
            h = self._fresh("rows")
            forwarded = "" if isinstance(rows, int) else f", {rows}"
            types = ANY if isinstance(rows, int) else f"{ANY}, {PARAM}"
            self.emit(f"{h} = transform.foreach_match in {root}{forwarded} {', '.join(pairs)} : ({types}) -> {ANY}")

    def cleanup(self, func: str) -> None:
        """Canonicalize, fold tensor slices into transfers, CSE."""
        self.apply_patterns(func, ["canonicalization", "tensor.fold_tensor_subset_ops_into_vector_transfers"])

    def hoist_accumulators(self, func: str, *, unit_dims: bool = False) -> None:
        """Keep accumulators in registers across reduction loops.

        On tensors, `hoist_loop_invariant_subsets` turns the read/modify/write
        of the output tile in the reduction loop into a loop-carried vector
        (the memref-level `hoist_redundant_vector_transfers` did nothing on
        these loops with the pinned MLIR).

        A second round, after a cleanup, hoists across the loops around the
        ones hoisted in the first: the kh loop of a decomposed depthwise
        convolution, once its kw loop carries the accumulators, kept
        reloading and storing them (a 112x112x32 depthwise convolution went
        from 144 to 115 us; GEMM, 2-D and 1-D convolutions did not change).
        (Casting unit dimensions away first hoisted as well, but changed the
        IR of one-row register tiles, which the features' templates do not
        expect.)

        `unit_dims`: cast the vectors' leading unit dimensions away first
        (for the rules' decomposed windows). The 1-D op a window decomposes
        to reads its output tile as ``vector<1x4x32>`` and writes it as
        ``vector<1x1x4x32>``; the two are no subset pair, and a depthwise
        convolution whose kw loop is unrolled whole stored and reloaded its
        accumulators at every kh (the 112x112x32 one, one schedule, 1
        thread, Zen 4: 0.095 ms, 0.086 with them hoisted, 0.072 with its
        fill fused too, :meth:`tile_for`'s `fuse`)."""
        if unit_dims:
            self.apply_patterns(func, ["vector.cast_away_vector_leading_one_dim", "canonicalization"])
        loops = self.match_ops(func, ["scf.for"])
        self.emit(f"transform.apply_licm to {loops} : {ANY}")
        self.emit(f"transform.loop.hoist_loop_invariant_subsets {loops} : {ANY}")
        self.cleanup(func)
        loops = self.match_ops(func, ["scf.for"])
        self.emit(f"transform.loop.hoist_loop_invariant_subsets {loops} : {ANY}")

    def bufferize(self, root: str) -> str:
        h = self._fresh("buf")
        self.emit(
            f"{h} = transform.bufferization.one_shot_bufferize {root} "
            "{bufferize_function_boundaries = true, function_boundary_type_conversion = 1 : i32} "
            f": ({ANY}) -> {ANY}"
        )
        return h

    def lower_vectors(self, func: str, *, contraction: str = "outerproduct", reduction: str = "innerparallel") -> None:
        """Lower vector contractions to FMAs and transfers to plain loads/stores.
        `reduction`: how `vector.multi_reduction` is lowered, "innerparallel"
        (elementwise ops across the reduced dimension, for reductions over
        outer dimensions) or "innerreduction" (a `vector.reduction` across
        the lanes, for reductions along the innermost one: the rows of a
        softmax, where "innerparallel" makes a chain of scalar ops)."""
        self.emit(f"transform.apply_patterns to {func} {{")
        self.emit("  transform.apply_patterns.memref.fold_memref_alias_ops")
        self.emit("  transform.apply_patterns.canonicalization")
        self.emit(f"}} : {ANY}")
        self.emit(f"transform.apply_cse to {func} : {ANY}")
        # Leading unit dimensions are dropped first, then contractions are
        # lowered on their own and canonicalized, before the rest: with
        # masked contractions (partial tiles) lowering all together looped
        # forever (lower_contraction + lower_transpose + lower_shape_cast +
        # canonicalization rewrote the transposed masks back and forth,
        # growing memory without bound), and so did the rest when a batch
        # dimension left a unit dimension on the masks.
        self.emit(f"transform.apply_patterns to {func} {{")
        self.emit("  transform.apply_patterns.vector.cast_away_vector_leading_one_dim")
        self.emit("  transform.apply_patterns.canonicalization")
        self.emit(f"}} : {ANY}")
        self.emit(f"transform.apply_patterns to {func} {{")
        self.emit(f'  transform.apply_patterns.vector.lower_contraction lowering_strategy = "{contraction}"')
        self.emit(f"}} : {ANY}")
        self.emit(f"transform.apply_patterns to {func} {{")
        self.emit("  transform.apply_patterns.canonicalization")
        self.emit(f"}} : {ANY}")
        self.emit(f"transform.apply_patterns to {func} {{")
        for p in (
            "transform.apply_patterns.vector.transfer_permutation_patterns",
            f'transform.apply_patterns.vector.lower_multi_reduction lowering_strategy = "{reduction}"',
            'transform.apply_patterns.vector.split_transfer_full_partial split_transfer_strategy = "linalg-copy"',
            "transform.apply_patterns.vector.transfer_to_scf max_transfer_rank = 1 full_unroll = true",
            "transform.apply_patterns.vector.lower_transfer max_transfer_rank = 1",
            'transform.apply_patterns.vector.lower_transpose lowering_strategy = "shuffle_1d"',
            "transform.apply_patterns.vector.lower_outerproduct",
            "transform.apply_patterns.canonicalization",
        ):
            self.emit("  " + p)
        self.emit(f"}} : {ANY}")
        # Shape casts last, without canonicalization: a cast that drops a
        # trailing unit dimension (vector<16x1xf32> to vector<16xf32>, a
        # one-wide reduction tile) is lowered to a chain of extracts and
        # inserts that canonicalization folds back into the cast, and the
        # two together never stop (the builder grew to its memory limit).
        self.emit(f"transform.apply_patterns to {func} {{")
        self.emit("  transform.apply_patterns.vector.lower_shape_cast")
        self.emit(f"}} : {ANY}")

    # ----------------------------------------------------------------- text
    def text(self) -> str:
        body = "\n".join(self.lines)
        return (
            "module attributes {transform.with_named_sequence} {\n"
            f"  transform.named_sequence @__transform_main(%root: {ANY} {{transform.consumed}}) {{\n"
            f"{body}\n"
            "    transform.yield\n"
            "  }\n"
            + "".join(f"{seq}\n" for seq in self.sequences)
            + "}\n"
        )

    def __post_init__(self) -> None:
        self._indent = 4


def row_cascade(rows: int) -> tuple[int, ...]:
    """The tile sizes that split fewer rows than a register tile of `rows`
    (a dynamic count) into static tiles: the powers of two below `rows`,
    largest first (8 rows: 4, 2, 1; any remainder up to 7 is at most one
    tile of each). Empty for one row, which leaves no remainder."""
    steps, p = [], 1
    while p < rows:
        steps.append(p)
        p *= 2
    return tuple(reversed(steps))


def _cascade_body(name: str, row: int, rank: int, steps: Sequence[int]) -> str:
    """The action of :meth:`ScheduleWriter.tile_dynamic_rows`: `%op` tiled
    by each of `steps` in turn, rows, the full tiles of each peeled off and
    canonicalized to static shapes, the rest, matched again in the
    remainder loop, tiled by the next (after the last step, left as it is;
    by one row, nothing is left).

    Before each step the op is tiled by twice the step (more rows than it
    has: a loop of one iteration), so that its extent is an `affine.min` of
    its own. Tiled as it came, its extent (an `affine.apply` of the
    enclosing loops) was folded into each tile's `affine.min`, where
    peeling cannot relate it to the loop's bound: the full tiles kept a
    dynamic shape and were not vectorized."""
    def sizes(step: int) -> str:
        return ", ".join(str(step) if d == row else "0" for d in range(rank))

    lines, op = [], "%op"
    for i, step in enumerate(steps):
        if step == 1:
            lines.append(f"    %t{i}, %l{i} = transform.structured.tile_using_for {op} tile_sizes [{sizes(1)}] : ({ANY}) -> ({ANY}, {ANY})")
            break
        lines += [
            f"    %w{i}, %once{i} = transform.structured.tile_using_for {op} tile_sizes [{sizes(2 * step)}] : ({ANY}) -> ({ANY}, {ANY})",
            f"    %t{i}, %l{i} = transform.structured.tile_using_for %w{i} tile_sizes [{sizes(step)}] : ({ANY}) -> ({ANY}, {ANY})",
            f'    %f{i} = transform.cast %l{i} : {ANY} to !transform.op<"scf.for">',
            f'    %full{i}, %rest{i} = transform.loop.peel %f{i} : (!transform.op<"scf.for">) -> ({ANY}, {ANY})',
            f"    transform.apply_patterns to %full{i} {{\n      transform.apply_patterns.canonicalization\n    }} : {ANY}",
        ]
        if i < len(steps) - 1:
            lines.append(f'    %o{i + 1} = transform.structured.match ops{{["{name}"]}} in %rest{i} : ({ANY}) -> {ANY}')
            op = f"%o{i + 1}"
    return "".join(line + "\n" for line in lines)
